//! Bounds on what a VM's output may take on the host.
//!
//! The emulator's stdout and stderr, the hypervisor's log lines in them and
//! the guest console are all in the guest's reach: a guest that floods its
//! console, or makes the emulator print without end, must not exhaust the
//! host's memory or disk. Lines are read with [`read_line`], which cuts
//! them at [`MAX_LINE`] bytes; the run directory's logs are
//! [`CappedLog`]s, which stop at [`LOG_CAP`] bytes (`console.log` at the
//! run's `--console-cap`, at most that) and say how much they dropped.
//! (The console buffer's bound is the console cap, at most
//! [`crate::vm::console::CONSOLE_KEEP`]; the hypervisor log's
//! [`crate::vm::hvlog::MAX_LINES`] and [`crate::vm::hvlog::MAX_BYTES`].)

use std::fs::File;
use std::io::{self, BufRead, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The longest line read from the emulator's stdout or stderr: a longer
/// one is handled in pieces of this size (its bytes still reach the log).
pub const MAX_LINE: usize = 64 * 1024;

/// The most bytes of output each log in the run directory keeps
/// (`console.log`, `emulator.stdout.log`, `emulator.stderr.log`); then a
/// last line says the log was truncated and how many bytes it dropped.
pub const LOG_CAP: u64 = 64 * 1024 * 1024;

/// Reads one line into `buf` (appended): up to and including the next
/// newline, or up to `max` bytes in `buf`, or to the end of the input,
/// whichever comes first. Returns the number of bytes read, 0 at the end
/// of the input. Unlike [`BufRead::read_until`], input without newlines
/// never grows `buf` past `max` bytes: the rest comes with the next calls.
pub fn read_line<R: BufRead + ?Sized>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<usize> {
    let mut read = 0;
    while buf.len() < max {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            break;
        }
        let room = max - buf.len();
        let window = &available[..available.len().min(room)];
        let (take, done) = match window.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (window.len(), false),
        };
        buf.extend_from_slice(&window[..take]);
        reader.consume(take);
        read += take;
        if done {
            break;
        }
    }
    Ok(read)
}

/// A log file that stops growing at a cap. Past the cap, what comes is
/// counted, not written, and the log's last line says so:
///
/// ```text
/// [hvtrace: log truncated at its cap of 67108864 bytes; dropped since:   1234 bytes]
/// ```
///
/// The count in that line is brought up to date with every write, so it
/// is right even when the writer is killed.
#[derive(Debug)]
pub struct CappedLog {
    file: File,
    cap: u64,
    written: u64,
    dropped: u64,
    /// Where the truncation line starts, once written.
    note_at: Option<u64>,
    /// The last byte written was a newline (or nothing was written).
    at_line_start: bool,
}

impl CappedLog {
    /// Creates (or truncates) the log at `path`, to hold at most `cap`
    /// bytes of output.
    pub fn create(path: &Path, cap: u64) -> io::Result<CappedLog> {
        Ok(CappedLog {
            file: File::create(path)?,
            cap,
            written: 0,
            dropped: 0,
            note_at: None,
            at_line_start: true,
        })
    }

    /// Appends `bytes`, as far as the cap allows.
    pub fn append(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if self.note_at.is_none() {
            let room = self.cap - self.written;
            let keep = bytes.len().min(usize::try_from(room).unwrap_or(usize::MAX));
            if keep > 0 {
                self.file.write_all(&bytes[..keep])?;
                self.written += keep as u64;
                self.at_line_start = bytes[keep - 1] == b'\n';
            }
            if keep == bytes.len() {
                return Ok(());
            }
            self.note_at = Some(self.written);
            self.dropped = (bytes.len() - keep) as u64;
        } else {
            self.dropped += bytes.len() as u64;
        }
        self.write_note()
    }

    /// (Re)writes the truncation line with the current count.
    fn write_note(&mut self) -> io::Result<()> {
        let Some(at) = self.note_at else {
            return Ok(());
        };
        let line = format!(
            "{}[hvtrace: log truncated at its cap of {} bytes; dropped since: {:>20} bytes]\n",
            if self.at_line_start { "" } else { "\n" },
            self.cap,
            self.dropped
        );
        self.file.write_all_at(line.as_bytes(), at)
    }

    /// Bytes of output written (the truncation line not counted).
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Bytes of output dropped past the cap.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufReader, Read};

    /// Input that yields `total` bytes without a newline, in reads of at
    /// most 64 KiB, without holding them.
    struct Flood {
        left: usize,
    }

    impl Read for Flood {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.left).min(64 * 1024);
            buf[..n].fill(b'A');
            self.left -= n;
            Ok(n)
        }
    }

    #[test]
    fn lines_are_read_whole_or_cut() {
        let mut r = BufReader::new(&b"one\ntwo\nthree-is-long\nend"[..]);
        let mut buf = Vec::new();
        let mut lines = Vec::new();
        loop {
            buf.clear();
            if read_line(&mut r, &mut buf, 8).unwrap() == 0 {
                break;
            }
            lines.push(String::from_utf8(buf.clone()).unwrap());
        }
        assert_eq!(lines, ["one\n", "two\n", "three-is", "-long\n", "end"]);
        // A reader buffer smaller than a line: the line is put together.
        let mut r = BufReader::with_capacity(2, &b"abcdef\ng"[..]);
        buf.clear();
        assert_eq!(read_line(&mut r, &mut buf, 100).unwrap(), 7);
        assert_eq!(buf, b"abcdef\n");
    }

    #[test]
    fn a_flood_without_newlines_stays_bounded() {
        const TOTAL: usize = 10 * 1024 * 1024;
        let mut r = BufReader::new(Flood { left: TOTAL });
        let mut buf = Vec::new();
        let (mut pieces, mut bytes, mut largest_capacity) = (0usize, 0usize, 0usize);
        loop {
            buf.clear();
            let n = read_line(&mut r, &mut buf, MAX_LINE).unwrap();
            if n == 0 {
                break;
            }
            assert!(buf.len() <= MAX_LINE, "{}", buf.len());
            assert_eq!(n, buf.len());
            largest_capacity = largest_capacity.max(buf.capacity());
            pieces += 1;
            bytes += n;
        }
        assert_eq!(bytes, TOTAL);
        assert_eq!(pieces, TOTAL / MAX_LINE);
        // The buffer never grew past about one line.
        assert!(largest_capacity <= 2 * MAX_LINE, "{largest_capacity}");
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "hvtrace-bounded-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_log_stops_at_its_cap_and_says_so() {
        let dir = scratch("cap");
        let path = dir.join("console.log");
        let mut log = CappedLog::create(&path, 100).unwrap();
        log.append(&[b'x'; 60]).unwrap();
        log.append(b"abc\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), 64);
        // Crosses the cap: 36 bytes fit, 14 are dropped.
        log.append(&[b'y'; 50]).unwrap();
        for _ in 0..1000 {
            log.append(&[b'z'; 1000]).unwrap();
        }
        assert_eq!(log.written(), 100);
        assert_eq!(log.dropped(), 14 + 1_000_000);
        let text = String::from_utf8(std::fs::read(&path).unwrap()).unwrap();
        let (kept, note) = text.split_at(100);
        assert_eq!(kept, format!("{}abc\n{}", "x".repeat(60), "y".repeat(36)));
        let note = note.strip_prefix('\n').expect("the note starts a line");
        assert!(note.ends_with(" 1000014 bytes]\n"), "{note:?}");
        assert!(
            note.starts_with("[hvtrace: log truncated at its cap of 100 bytes"),
            "{note:?}"
        );
        assert_eq!(note.lines().count(), 1);
        // The file never grew past the cap and one line.
        assert!(text.len() < 100 + 100, "{}", text.len());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_log_under_its_cap_is_untouched() {
        let dir = scratch("under");
        let path = dir.join("log");
        let mut log = CappedLog::create(&path, 10).unwrap();
        log.append(b"0123456789").unwrap();
        assert_eq!(log.dropped(), 0);
        assert_eq!(std::fs::read(&path).unwrap(), b"0123456789");
        // Exactly at the cap, one more byte cuts, at a line end: no blank line.
        let mut log = CappedLog::create(&path, 4).unwrap();
        log.append(b"abc\nd").unwrap();
        let text = String::from_utf8(std::fs::read(&path).unwrap()).unwrap();
        assert!(text.starts_with("abc\n[hvtrace: log truncated"), "{text:?}");
        assert!(text.ends_with("1 bytes]\n"), "{text:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
