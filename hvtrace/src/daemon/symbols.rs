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
//! as root's build checks guest memory. The modules' index follows it
//! ([`ModuleIndex::unpack`]), and a new copy of it whenever the loaded
//! modules change. The listing is written in the run directory as
//! `kallsyms`, in `/proc/kallsyms`' form and order (the kernel image's
//! symbols, then the modules' with ` [module]`), and again at each new
//! copy of the modules, for whoever post-processes a saved trace.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use guest_introspect::kallsyms::{SymbolIndex, DEFAULT_MAX_INDEX_BYTES};
use guest_introspect::module::ModuleIndex;
use protocol::SymbolsPart;

/// Most bytes of a packed index taken (the index's own bound).
pub const MAX_PACKED: usize = DEFAULT_MAX_INDEX_BYTES;

/// An export's announced size in bytes, when it is one this host takes
/// (at most [`MAX_PACKED`]).
fn taken(total: u64) -> Option<usize> {
    usize::try_from(total).ok().filter(|&t| t <= MAX_PACKED)
}

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

/// The modules' index: the copy being received and the last one rebuilt.
#[derive(Default)]
struct Modules {
    /// The export coming: its id, size and bytes so far.
    coming: Option<(u32, usize, Vec<u8>)>,
    index: Option<Arc<ModuleIndex>>,
    /// Copies rebuilt.
    copies: u32,
    /// Why the last copy was refused, if it was.
    error: Option<String>,
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
    modules: Mutex<Modules>,
    cv: Condvar,
    /// Where the listing is written once the index is rebuilt.
    listing: Option<PathBuf>,
    /// The listing's text, for the modules' copy it was made with.
    text: Mutex<Option<(u32, Arc<String>)>>,
}

impl HostSymbols {
    /// No index yet; the listing goes to `listing` when there is one.
    pub fn new(listing: Option<PathBuf>) -> HostSymbols {
        HostSymbols {
            state: Mutex::new(State::Idle),
            modules: Mutex::new(Modules::default()),
            cv: Condvar::new(),
            listing,
            text: Mutex::new(None),
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
        let Some(total) = taken(total) else {
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
    pub fn chunk(&self, id: u32, part: SymbolsPart, total: u64, offset: u64, data: &[u8]) {
        match part {
            SymbolsPart::Kernel => self.kernel_chunk(id, total, offset, data),
            SymbolsPart::Modules => self.module_chunk(id, total, offset, data),
            _ => {}
        }
    }

    fn kernel_chunk(&self, id: u32, total: u64, offset: u64, data: &[u8]) {
        let mut s = self.lock();
        let State::Receiving(r) = &mut *s else {
            return;
        };
        match r.id {
            Some(known) if known != id => return,
            Some(_) => {}
            None => r.id = Some(id),
        }
        if r.total.is_none() {
            match taken(total) {
                Some(t) => r.total = Some(t),
                None => {
                    *s = State::Failed(format!(
                        "root offered {total} bytes of symbols, more than the {MAX_PACKED} taken"
                    ));
                    self.cv.notify_all();
                    return;
                }
            }
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

    /// A piece of the modules' index: a new export (offset 0) replaces one
    /// that did not finish; a piece out of place drops the copy (the last
    /// whole one stays).
    fn module_chunk(&self, id: u32, total: u64, offset: u64, data: &[u8]) {
        let mut m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if offset == 0 {
            match taken(total) {
                Some(t) => m.coming = Some((id, t, Vec::new())),
                None => {
                    m.coming = None;
                    m.error = Some(format!("root offered {total} bytes of module symbols"));
                    return;
                }
            }
        }
        let Some((cid, ctotal, bytes)) = m.coming.as_mut() else {
            return;
        };
        if *cid != id || offset != bytes.len() as u64 || bytes.len() + data.len() > *ctotal {
            m.coming = None;
            m.error = Some(format!(
                "module symbols: piece at byte {offset} of export {id} out of place (a frame was lost)"
            ));
            return;
        }
        bytes.extend_from_slice(data);
        if bytes.len() < *ctotal {
            return;
        }
        let Some((_, _, bytes)) = m.coming.take() else {
            return;
        };
        match ModuleIndex::unpack(&bytes) {
            Ok(index) => {
                m.index = Some(Arc::new(index));
                m.copies += 1;
                m.error = None;
            }
            Err(e) => m.error = Some(format!("module symbols: {e}")),
        }
        let modules = m.index.clone();
        drop(m);
        // The listing follows the modules once the kernel's index is in.
        let s = self.lock();
        if let State::Ready(index, _) = &*s {
            let index = index.clone();
            drop(s);
            if let Some(e) = self.write_listing(&index, modules.as_deref()) {
                self.modules.lock().unwrap_or_else(|e| e.into_inner()).error = Some(e);
            }
        }
    }

    /// The export id of the copy of the modules' index on its way (its
    /// first piece came, its last not yet), if one is.
    pub fn modules_coming(&self) -> Option<u32> {
        self.modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .coming
            .as_ref()
            .map(|(id, _, _)| *id)
    }

    /// The modules' index, the last whole copy.
    pub fn modules(&self) -> Option<Arc<ModuleIndex>> {
        self.modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .index
            .clone()
    }

    /// Writes the listing aside and renames it, so that a reader never
    /// sees half of it; why not, when it could not.
    fn write_listing(&self, index: &SymbolIndex, modules: Option<&ModuleIndex>) -> Option<String> {
        let path = self.listing.as_ref()?;
        let part = path.with_extension("part");
        std::fs::write(&part, listing(index, modules))
            .and_then(|()| std::fs::rename(&part, path))
            .err()
            .map(|e| format!("cannot write {}: {e}", path.display()))
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
                // it, so a failed write is only noted. It waits for the
                // modules' first copy, which root sends right after.
                let listing_error = self
                    .modules()
                    .and_then(|m| self.write_listing(&index, Some(&m)));
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

    /// The listing's text ([`listing`]) once the index is rebuilt (waiting
    /// up to `timeout` for it), made once for each copy of the modules'
    /// index; why not, as [`HostSymbols::wait`] says.
    pub fn listing_text(&self, timeout: Duration) -> Result<Arc<String>, String> {
        let (index, _) = self.wait(timeout)?;
        let (copies, modules) = {
            let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            (m.copies, m.index.clone())
        };
        let mut text = self.text.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((made_with, t)) = &*text {
            if *made_with == copies {
                return Ok(t.clone());
            }
        }
        let t = Arc::new(listing(&index, modules.as_deref()));
        *text = Some((copies, t.clone()));
        Ok(t)
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
        .map(|line| {
            let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.index.as_ref().map_or(0, |i| i.modules().len());
            let mut line = format!("{line}; {n} modules ({} copies)", m.copies);
            if let Some(e) = &m.error {
                line.push_str(&format!(" ({e})"));
            }
            line
        })
    }
}

/// The indexes as `/proc/kallsyms` prints them: the kernel image's
/// symbols, then the modules' with a tab and `[module]`.
pub fn listing(index: &SymbolIndex, modules: Option<&ModuleIndex>) -> String {
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
    for (_, m, s) in modules.into_iter().flat_map(ModuleIndex::kallsyms_order) {
        let _ = writeln!(
            out,
            "{:016x} {} {}\t[{}]",
            s.addr, s.kind as char, s.name, m.name
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use guest_introspect::kallsyms::{locate, LocateStats};
    use guest_introspect::view::SegmentView;
    use guest_introspect::{Gva, GvaRange};
    use test_support::synth::{generate, random_syms, Order};
    use test_support::Rng;

    /// A small real-format index and its packed bytes.
    /// A symbol index of 700 random symbols, and its export.
    pub(crate) fn packed() -> (SymbolIndex, Vec<u8>) {
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
            h.chunk(
                4,
                SymbolsPart::Kernel,
                bytes.len() as u64,
                (k * 1000) as u64,
                piece,
            );
        }
        assert!(!path.exists(), "the listing waits for the modules");
        let none = modules(&[]).pack().unwrap();
        h.chunk(5, SymbolsPart::Modules, none.len() as u64, 0, &none);
        h.answered(4, bytes.len() as u64);
        let (back, got) = h.wait(Duration::ZERO).unwrap();
        assert_eq!(got.symbols, idx.len());
        assert_eq!(listing(&back, None), listing(&idx, None));
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
        let total = bytes.len() as u64;
        h.chunk(1, SymbolsPart::Kernel, total, 0, &bytes[..1000]);
        h.chunk(1, SymbolsPart::Kernel, total, 2000, &bytes[2000..3000]);
        let e = h.wait(Duration::ZERO).unwrap_err();
        assert!(e.contains("expected byte 1000"), "{e}");

        let h = HostSymbols::new(None);
        h.start();
        h.answered(1, 10);
        h.chunk(1, SymbolsPart::Kernel, 10, 0, &bytes[..11]);
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
        h.chunk(2, SymbolsPart::Kernel, total, 0, &bad);
        assert!(h.wait(Duration::ZERO).is_err());

        // Chunks of another export are not mixed in.
        let h = HostSymbols::new(None);
        h.start();
        h.answered(3, bytes.len() as u64);
        h.chunk(2, SymbolsPart::Kernel, total, 0, &bytes);
        assert!(h.wait(Duration::ZERO).is_err());
        h.chunk(3, SymbolsPart::Kernel, total, 0, &bytes);
        assert!(h.wait(Duration::ZERO).is_ok());
    }

    /// A module index of modules named `names`.
    pub(crate) fn modules(names: &[&str]) -> ModuleIndex {
        use guest_introspect::module::{Module, ModuleStates, ModuleSymbol};
        use guest_introspect::{Gva, GvaRange};
        let states = ModuleStates {
            live: 0,
            coming: 1,
            going: 2,
            unformed: 3,
        };
        let base = 0xffff_ffff_c000_0000u64;
        let ms = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let text = base + ((i as u64) << 20);
                Module {
                    addr: Gva(text + 0x8000),
                    name: n.to_string(),
                    state: 0,
                    text: GvaRange::with_len(Gva(text), 0x1000),
                    init_text: GvaRange::with_len(Gva(0), 0),
                    symbols: vec![
                        ModuleSymbol {
                            addr: text,
                            kind: b't',
                            name: format!("{n}_open"),
                        },
                        ModuleSymbol {
                            addr: text + 0x40,
                            kind: b'T',
                            name: format!("{n}_read"),
                        },
                    ],
                }
            })
            .collect();
        ModuleIndex::new(ms, states).unwrap()
    }

    #[test]
    fn the_modules_follow_the_kernel_and_every_new_copy_replaces_the_last() {
        let (idx, bytes) = packed();
        let dir = std::env::temp_dir().join(format!("hvtrace-mods-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kallsyms");
        let h = HostSymbols::new(Some(path.clone()));
        h.start();
        h.chunk(1, SymbolsPart::Kernel, bytes.len() as u64, 0, &bytes);
        let send = |id: u32, m: &ModuleIndex| {
            let p = m.pack().unwrap();
            for (k, piece) in p.chunks(50).enumerate() {
                h.chunk(
                    id,
                    SymbolsPart::Modules,
                    p.len() as u64,
                    (k * 50) as u64,
                    piece,
                );
            }
        };
        send(2, &modules(&["ext4", "loop"]));
        let got = h.modules().unwrap();
        assert_eq!(got.modules().len(), 2);
        let file = std::fs::read_to_string(&path).unwrap();
        assert_eq!(file.lines().count(), idx.len() + 4);
        assert!(
            file.ends_with("ffffffffc0100040 T loop_read\t[loop]\n"),
            "{file:?}"
        );
        // A new copy replaces it, listing and all.
        send(3, &modules(&["ext4"]));
        assert_eq!(h.modules().unwrap().modules().len(), 1);
        let file = std::fs::read_to_string(&path).unwrap();
        assert!(!file.contains("[loop]") && file.contains("\t[ext4]\n"));
        // A piece out of place drops that copy; the last whole one stays.
        let p = modules(&["a", "b", "c"]).pack().unwrap();
        h.chunk(4, SymbolsPart::Modules, p.len() as u64, 0, &p[..10]);
        h.chunk(4, SymbolsPart::Modules, p.len() as u64, 20, &p[20..]);
        assert_eq!(h.modules().unwrap().modules().len(), 1);
        assert!(h.summary().unwrap().contains("out of place"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
