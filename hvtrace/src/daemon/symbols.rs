//! The host's copy of root's kernel symbol index.
//!
//! Once the trace stream has a path of its own (the log port or the shared
//! ring), the supervisor asks root for its index ([`Request::SymbolsExport`]
//! (protocol::Request::SymbolsExport)) when the stream first starts; root
//! sends it packed ([`SymbolIndex::packed_at`]) in [`Event::SymbolChunk`]
//! (protocol::Event::SymbolChunk)s along that path, a piece per turn. The
//! chunks may come before the answer on COM2 does (the paths are not
//! ordered with each other), so they are kept from the first one on.
//!
//! The bytes are rebuilt with [`SymbolIndex::unpack`], which checks them
//! as root's build checks guest memory, and the listing is written in the
//! run directory as `kallsyms`, in `/proc/kallsyms`' form (the kernel
//! image's symbols, in the kernel's order), for whoever post-processes a
//! saved trace.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use guest_introspect::kallsyms::{SymbolIndex, DEFAULT_MAX_INDEX_BYTES};

/// Most bytes of a packed index taken (the index's own bound).
pub const MAX_PACKED: usize = DEFAULT_MAX_INDEX_BYTES;

/// Where the export stands.
enum State {
    /// Not asked for.
    Idle,
    /// Asked for, or chunks coming.
    Receiving(Receiving),
    /// Rebuilt.
    Ready(Arc<SymbolIndex>, Received),
    /// Refused, and why.
    Failed(String),
}

struct Receiving {
    /// The export's id, once a chunk or the answer named it.
    id: Option<u32>,
    /// Its size, once the answer gave it.
    total: Option<usize>,
    bytes: Vec<u8>,
    started: Instant,
}

/// What a finished export took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// Symbols in the index.
    pub symbols: usize,
    /// Packed bytes received.
    pub bytes: usize,
    /// From the request to the rebuilt index.
    pub took: Duration,
    /// Why the listing could not be written, if it could not.
    pub listing_error: Option<String>,
}

/// The host's copy of the index, shared by the supervisor and the
/// threads that read the trace path.
pub struct HostSymbols {
    state: Mutex<State>,
    cv: Condvar,
    /// Where the listing is written once the index is rebuilt.
    listing: Option<PathBuf>,
}

impl HostSymbols {
    /// No index yet; the listing goes to `listing` when there is one.
    pub fn new(listing: Option<PathBuf>) -> HostSymbols {
        HostSymbols {
            state: Mutex::new(State::Idle),
            cv: Condvar::new(),
            listing,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the export asked for; `false` when it already was (or is
    /// done): one export per boot.
    pub fn start(&self) -> bool {
        let mut s = self.lock();
        if !matches!(*s, State::Idle) {
            return false;
        }
        *s = State::Receiving(Receiving {
            id: None,
            total: None,
            bytes: Vec::new(),
            started: Instant::now(),
        });
        true
    }

    /// Root's answer: the export's id and size.
    pub fn answered(&self, id: u32, total: u64) {
        let mut s = self.lock();
        let State::Receiving(r) = &mut *s else {
            return;
        };
        let Some(total) = usize::try_from(total).ok().filter(|&t| t <= MAX_PACKED) else {
            *s = State::Failed(format!(
                "root offered {total} bytes of symbols, more than the {MAX_PACKED} taken"
            ));
            self.cv.notify_all();
            return;
        };
        if r.id.is_some_and(|seen| seen != id) {
            // Chunks of another export came first: start over with this one.
            r.bytes.clear();
        }
        r.id = Some(id);
        r.total = Some(total);
        self.finish_if_done(&mut s);
    }

    /// The request failed: why.
    pub fn refused(&self, why: String) {
        let mut s = self.lock();
        if matches!(*s, State::Receiving(_)) {
            *s = State::Failed(why);
            self.cv.notify_all();
        }
    }

    /// One [`protocol::Event::SymbolChunk`].
    pub fn chunk(&self, id: u32, offset: u64, data: &[u8]) {
        let mut s = self.lock();
        let State::Receiving(r) = &mut *s else {
            return;
        };
        match r.id {
            Some(known) if known != id => return,
            Some(_) => {}
            None => r.id = Some(id),
        }
        if offset != r.bytes.len() as u64 {
            *s = State::Failed(format!(
                "symbol chunk at byte {offset} of export {id}, expected byte {} (a frame was lost)",
                r.bytes.len()
            ));
            self.cv.notify_all();
            return;
        }
        let limit = r.total.unwrap_or(MAX_PACKED);
        if r.bytes.len() + data.len() > limit {
            *s = State::Failed(format!("symbol export {id} runs past its {limit} bytes"));
            self.cv.notify_all();
            return;
        }
        r.bytes.extend_from_slice(data);
        self.finish_if_done(&mut s);
    }

    /// Rebuilds the index once every byte is in.
    fn finish_if_done(&self, s: &mut State) {
        let State::Receiving(r) = s else {
            return;
        };
        if r.total != Some(r.bytes.len()) {
            return;
        }
        let bytes = std::mem::take(&mut r.bytes);
        let started = r.started;
        *s = match SymbolIndex::unpack(&bytes) {
            Ok(index) => {
                // The listing is a convenience: the index stands without
                // it, so a failed write is only noted.
                // Written aside and renamed, so that a reader never sees
                // half of it.
                let listing_error = self.listing.as_ref().and_then(|path| {
                    let part = path.with_extension("part");
                    std::fs::write(&part, listing(&index))
                        .and_then(|()| std::fs::rename(&part, path))
                        .err()
                        .map(|e| format!("cannot write {}: {e}", path.display()))
                });
                let got = Received {
                    symbols: index.len(),
                    bytes: bytes.len(),
                    took: started.elapsed(),
                    listing_error,
                };
                State::Ready(Arc::new(index), got)
            }
            Err(e) => State::Failed(e.to_string()),
        };
        self.cv.notify_all();
    }

    /// The index once rebuilt; `Err` with why not when it failed or did
    /// not come within `timeout` (or was never asked for).
    pub fn wait(&self, timeout: Duration) -> Result<(Arc<SymbolIndex>, Received), String> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        loop {
            match &*s {
                State::Ready(index, got) => return Ok((index.clone(), got.clone())),
                State::Failed(why) => return Err(why.clone()),
                State::Idle => return Err("the symbol index was not asked for".into()),
                State::Receiving(r) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(format!(
                            "{} bytes of the symbol index came in {:.1} s",
                            r.bytes.len(),
                            r.started.elapsed().as_secs_f64()
                        ));
                    }
                    s = self
                        .cv
                        .wait_timeout(s, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// A line for the supervisor's log.
    pub fn summary(&self) -> Option<String> {
        match &*self.lock() {
            State::Idle => None,
            State::Receiving(r) => Some(format!(
                "host symbol index: {} bytes in so far",
                r.bytes.len()
            )),
            State::Ready(_, got) => Some(format!(
                "host symbol index: {} symbols, {} bytes in {:.2} s{}",
                got.symbols,
                got.bytes,
                got.took.as_secs_f64(),
                got.listing_error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            )),
            State::Failed(why) => Some(format!("host symbol index: none: {why}")),
        }
    }
}

/// The index as `/proc/kallsyms` prints the kernel image's symbols.
pub fn listing(index: &SymbolIndex) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(index.len() * 40);
    for s in index.iter() {
        let _ = writeln!(
            out,
            "{:016x} {} {}",
            s.addr.0,
            s.kind.letter(),
            index.name(s.id)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_introspect::kallsyms::{locate, LocateStats};
    use guest_introspect::view::SegmentView;
    use guest_introspect::{Gva, GvaRange};
    use test_support::synth::{generate, random_syms, Order};
    use test_support::Rng;

    /// A small real-format index and its packed bytes.
    fn packed() -> (SymbolIndex, Vec<u8>) {
        let mut rng = Rng(test_support::seed());
        let rb = 0xffff_ffff_8100_0000;
        let syms = random_syms(&mut rng, 700, false, rb);
        let (blob, _) = generate(&syms, Order::V612, false, rb);
        let base = 0xffff_ffff_8200_0000;
        let mut view = SegmentView::new();
        view.add(Gva(base), &blob, blob.len() as u64);
        let range = GvaRange::with_len(Gva(base), blob.len() as u64);
        let t = locate(&view, &[range], &mut LocateStats::default()).unwrap();
        let idx = SymbolIndex::build(&view, &t).unwrap();
        let mut bytes = vec![0; idx.packed_len()];
        idx.packed_at(0, &mut bytes);
        (idx, bytes)
    }

    #[test]
    fn chunks_before_the_answer_rebuild_the_index_and_its_listing() {
        let (idx, bytes) = packed();
        let dir = std::env::temp_dir().join(format!("hvtrace-syms-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kallsyms");
        let h = HostSymbols::new(Some(path.clone()));
        assert!(h.start());
        assert!(!h.start(), "one export per boot");
        for (k, piece) in bytes.chunks(1000).enumerate() {
            h.chunk(4, (k * 1000) as u64, piece);
        }
        assert!(h.wait(Duration::ZERO).is_err(), "no size yet");
        h.answered(4, bytes.len() as u64);
        let (back, got) = h.wait(Duration::ZERO).unwrap();
        assert_eq!(got.symbols, idx.len());
        assert_eq!(listing(&back), listing(&idx));
        let file = std::fs::read_to_string(&path).unwrap();
        assert_eq!(file.lines().count(), idx.len());
        let first = idx.iter().next().unwrap();
        assert!(file.starts_with(&format!(
            "{:016x} {} {}\n",
            first.addr.0,
            first.kind.letter(),
            idx.name(first.id)
        )));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_lost_chunk_a_long_export_and_bad_bytes_are_refused() {
        let (_, bytes) = packed();
        let h = HostSymbols::new(None);
        h.start();
        h.answered(1, bytes.len() as u64);
        h.chunk(1, 0, &bytes[..1000]);
        h.chunk(1, 2000, &bytes[2000..3000]);
        let e = h.wait(Duration::ZERO).unwrap_err();
        assert!(e.contains("expected byte 1000"), "{e}");

        let h = HostSymbols::new(None);
        h.start();
        h.answered(1, 10);
        h.chunk(1, 0, &bytes[..11]);
        assert!(h.wait(Duration::ZERO).unwrap_err().contains("past its 10"));

        let h = HostSymbols::new(None);
        h.start();
        h.answered(1, (MAX_PACKED + 1) as u64);
        assert!(h.wait(Duration::ZERO).unwrap_err().contains("more than"));

        let mut bad = bytes.clone();
        bad[8] ^= 1;
        let h = HostSymbols::new(None);
        h.start();
        h.answered(2, bad.len() as u64);
        h.chunk(2, 0, &bad);
        assert!(h.wait(Duration::ZERO).is_err());

        // Chunks of another export are not mixed in.
        let h = HostSymbols::new(None);
        h.start();
        h.answered(3, bytes.len() as u64);
        h.chunk(2, 0, &bytes);
        assert!(h.wait(Duration::ZERO).is_err());
        h.chunk(3, 0, &bytes);
        assert!(h.wait(Duration::ZERO).is_ok());
    }
}
