//! A recording of the trace stream, for checking the host's renderer
//! against root's on real records (`HVTRACE_RECORD_STREAM=FILE`).
//!
//! The supervisor then starts streams as [`TraceFormat::RecordsAndText`]:
//! root sends its records and, beside them, its own rendering of them. The
//! recording is text, one line per item, appended as the events come:
//!
//! - `ctx HEX`, `rec HEX`: a `TraceContext` or `TraceRecords` event, as
//!   its encoded frame (`protocol::encode`) in hex;
//! - `root HEX`: a `TraceText` root rendered;
//! - `sym ADDR`: an address the host's renderer asked its symbols about
//!   (16 hex digits, each once), so that a fixture can keep only the
//!   symbols the records need.
//!
//! Beside it, `FILE.root.txt` and `FILE.host.txt` get root's text and the
//! host's as they come, so that a difference shows while the VM runs
//! (`diff` them once the stream is drained).
//!
//! [`TraceFormat::RecordsAndText`]: protocol::TraceFormat::RecordsAndText

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use guest_introspect::addr::Gva;
use protocol::{Event, Frame};
use tracelang::kprobe::{SymbolAt, SymbolResolver};

/// The environment variable that names the recording.
pub const RECORD_ENV: &str = "HVTRACE_RECORD_STREAM";

/// The first line of a recording.
pub const HEADER: &str = "# hvtrace stream recording 1";

/// An open recording.
pub struct Recorder {
    events: File,
    root: File,
    host: File,
    /// Addresses already written.
    addrs: BTreeSet<u64>,
    seq: u32,
    /// Writes that failed (the recording goes on without them).
    pub failed: u64,
}

fn open(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

impl Recorder {
    /// The recording `$HVTRACE_RECORD_STREAM` names, when it is set.
    pub fn from_env() -> Option<std::io::Result<Recorder>> {
        let path = std::env::var_os(RECORD_ENV).filter(|p| !p.is_empty())?;
        Some(Recorder::create(Path::new(&path)))
    }

    /// Opens (appends to) the recording at `path` and its two text files.
    pub fn create(path: &Path) -> std::io::Result<Recorder> {
        let mut events = open(path)?;
        writeln!(events, "{HEADER}")?;
        Ok(Recorder {
            events,
            root: open(&beside(path, ".root.txt"))?,
            host: open(&beside(path, ".host.txt"))?,
            addrs: BTreeSet::new(),
            seq: 0,
            failed: 0,
        })
    }

    /// Appends `event` as a line tagged `tag`.
    pub fn event(&mut self, tag: &str, event: &Event) {
        let frame = Frame::event(self.seq, event.clone());
        self.seq = self.seq.wrapping_add(1);
        let mut wire = Vec::new();
        if protocol::encode(&frame, &mut wire).is_err() {
            self.failed += 1;
            return;
        }
        let mut line = String::with_capacity(tag.len() + 2 + 2 * wire.len());
        line.push_str(tag);
        line.push(' ');
        for b in &wire {
            let _ = write!(line, "{b:02x}");
        }
        line.push('\n');
        if self.events.write_all(line.as_bytes()).is_err() {
            self.failed += 1;
        }
        if tag == "root" {
            if let Event::TraceText { text, .. } = event {
                if self.root.write_all(text.as_bytes()).is_err() {
                    self.failed += 1;
                }
            }
        }
    }

    /// Appends text the host rendered to `FILE.host.txt`.
    pub fn host_text(&mut self, text: &str) {
        if self.host.write_all(text.as_bytes()).is_err() {
            self.failed += 1;
        }
    }

    /// Appends the addresses not written yet.
    pub fn addresses(&mut self, addrs: &[u64]) {
        let mut lines = String::new();
        for &a in addrs {
            if self.addrs.insert(a) {
                let _ = writeln!(lines, "sym {a:016x}");
            }
        }
        if !lines.is_empty() && self.events.write_all(lines.as_bytes()).is_err() {
            self.failed += 1;
        }
    }
}

/// A resolver that notes each address it is asked about.
pub struct Noting<'a> {
    inner: &'a dyn SymbolResolver,
    /// The addresses asked about, in order.
    pub seen: std::cell::RefCell<Vec<u64>>,
}

impl<'a> Noting<'a> {
    /// Over `inner`.
    pub fn new(inner: &'a dyn SymbolResolver) -> Self {
        Noting {
            inner,
            seen: std::cell::RefCell::new(Vec::new()),
        }
    }
}

impl SymbolResolver for Noting<'_> {
    fn lookup(&self, name: &str) -> Option<Gva> {
        self.inner.lookup(name)
    }

    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
        self.seen.borrow_mut().push(addr.0);
        self.inner.symbolize(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracelang::kprobe::NoSymbols;

    #[test]
    fn a_recording_has_one_line_per_event_and_notes_addresses_once() {
        let dir = std::env::temp_dir().join(format!("hvtrace-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rec");
        let mut r = Recorder::create(&path).unwrap();
        let text = Event::TraceText {
            format: protocol::TraceFormat::Text,
            source: 0,
            lost: 0,
            text: "a line\n".into(),
        };
        r.event("root", &text);
        r.event(
            "rec",
            &Event::TraceRecords {
                lost: 0,
                now_ns: 5,
                data: vec![],
            },
        );
        let none = NoSymbols;
        let noting = Noting::new(&none);
        assert!(noting.symbolize(Gva(0xffff_ffff_8100_0000)).is_none());
        r.addresses(&noting.seen.borrow());
        r.addresses(&[0xffff_ffff_8100_0000]);
        r.host_text("a line\n");
        drop(r);
        let rec = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = rec.lines().collect();
        assert_eq!(lines.len(), 4, "{rec}");
        assert_eq!(lines[0], HEADER);
        let hex = lines[1].strip_prefix("root ").unwrap();
        let wire: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let frames: Vec<_> = protocol::FrameDecoder::new().feed(&wire).collect();
        assert!(
            matches!(frames.as_slice(), [Ok(f)] if f.body == protocol::Body::Event(text.clone())),
            "{frames:?}"
        );
        assert!(lines[2].starts_with("rec "));
        assert_eq!(lines[3], "sym ffffffff81000000");
        let side = |s| std::fs::read_to_string(beside(&path, s)).unwrap();
        assert_eq!(side(".root.txt"), "a line\n");
        assert_eq!(side(".host.txt"), "a line\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
