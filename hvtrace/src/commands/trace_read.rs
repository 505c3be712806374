//! Reading a VM's trace: the cursor-following reader over `TraceRead`,
//! the output it writes (a file or stdout, Chrome traces built on the
//! way), and the copy loop that `trace`, `run` and `graph` share.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use protocol::{ErrorKind, Request, Response, TraceFormat};

use crate::client::SupervisorGone;
use crate::commands::cli::OutputFormatArg;
use crate::commands::timeouts::PROBE_TIMEOUT;
use crate::control::{response_error, Control};
use crate::output::chrome::{Chrome, ChromeSummary};
use crate::sys;
use crate::term::{self, Mode};

/// Starts the trace stream in `format`.
pub fn start_trace(control: &mut dyn Control, format: TraceFormat) -> Result<()> {
    match control.request(Request::TraceStart { format }, PROBE_TIMEOUT)? {
        Response::Ok => Ok(()),
        other => Err(response_error(other)),
    }
}

/// What one trace read brought.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceRead {
    /// Complete lines.
    pub text: String,
    /// Lines or events lost since the previous read.
    pub lost: u64,
}

/// How a trace read ended without lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceEnd {
    /// The VM has ended (the message says how); the trace is complete.
    VmEnded(String),
}

/// Reads the supervisor's trace buffer from a cursor
/// ([`Request::TraceRead`]).
#[derive(Clone, Debug)]
pub struct TraceReader {
    /// Where the next read starts.
    pub cursor: u64,
    /// The format asked for.
    pub format: TraceFormat,
    /// The source asked for ([`protocol::Event::TraceText`]: 0 for probes
    /// and the function tracer, N for function-graph session N); `None`:
    /// every source.
    pub source: Option<u32>,
    /// Lines read so far.
    pub lines: u64,
    /// Losses reported so far.
    pub lost: u64,
}

impl TraceReader {
    /// A reader of every source from the start of the buffer.
    pub fn new(format: TraceFormat) -> TraceReader {
        TraceReader {
            cursor: 0,
            format,
            source: None,
            lines: 0,
            lost: 0,
        }
    }

    /// The same reader, reading only the lines of `source` (`None`: of
    /// every source) from its cursor on.
    pub fn with_source(mut self, source: Option<u32>) -> TraceReader {
        self.source = source;
        self
    }

    /// A reader (of every source) from the end of the buffer as it is now:
    /// it gets the lines that arrive from here on. Its one read (a cursor
    /// past the end reads from the end, without waiting) also starts the
    /// stream in `format` if it is not. Fails when the VM has ended.
    pub fn at_end(control: &mut dyn Control, format: TraceFormat) -> Result<TraceReader> {
        let mut reader = TraceReader::new(format);
        reader.cursor = u64::MAX;
        match reader.read(control, 0)? {
            Ok(_) => {}
            Err(TraceEnd::VmEnded(why)) => bail!("{why}"),
        }
        if reader.cursor == u64::MAX {
            bail!("the trace buffer did not say where it ends");
        }
        reader.lines = 0;
        reader.lost = 0;
        Ok(reader)
    }

    /// One read, waiting up to `wait_ms` for a line. Losses are reported on
    /// stderr (`hvtrace: N events lost`). The end of the VM is `Err(end)`
    /// inside the `Ok`; other failures are errors.
    pub fn read(
        &mut self,
        control: &mut dyn Control,
        wait_ms: u32,
    ) -> Result<std::result::Result<TraceRead, TraceEnd>> {
        let request = Request::TraceRead {
            cursor: self.cursor,
            format: self.format,
            wait_ms,
            source: self.source,
        };
        // The wait, a stream start forwarded to the hypervisor, and margin.
        let timeout = Duration::from_millis(u64::from(wait_ms))
            + crate::daemon::link::DEFAULT_TIMEOUT
            + Duration::from_secs(30);
        let response = match control.request(request, timeout) {
            Ok(response) => response,
            Err(e) if e.downcast_ref::<SupervisorGone>().is_some() => {
                return Ok(Err(TraceEnd::VmEnded(e.to_string())));
            }
            Err(e) => return Err(e),
        };
        match response {
            Response::Trace { next, text, lost } => {
                self.cursor = next;
                self.lines += text.bytes().filter(|&b| b == b'\n').count() as u64;
                self.lost += lost;
                if lost > 0 {
                    eprintln!("hvtrace: {lost} events lost");
                }
                Ok(Ok(TraceRead { text, lost }))
            }
            Response::Error {
                kind: ErrorKind::NotReady,
                message,
            } if message.starts_with("the VM has ended") => Ok(Err(TraceEnd::VmEnded(message))),
            other => Err(response_error(other)),
        }
    }
}

/// `trace --follow`: each read waits this long for a line.
pub const FOLLOW_WAIT_MS: u32 = 5000;

/// `trace`: the first read waits this long (the stream may only start
/// with it).
pub const FIRST_WAIT_MS: u32 = 3000;

/// `trace`: a read that brings nothing after this long ends the trace. A
/// full frame takes about 0.36 s on the serial line, so this is well above.
pub const DRAIN_WAIT_MS: u32 = 1000;

/// Where trace lines go: copied to a writer as they come, or collected
/// for a Chrome trace that is written when the trace ends.
pub struct TraceOutput {
    out: Box<dyn Write + Send>,
    chrome: Option<Chrome>,
}

impl TraceOutput {
    /// Lines are copied to `out` as they come.
    pub fn copy(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput { out, chrome: None }
    }

    /// Lines (JSON) are collected; [`TraceOutput::finish`] writes the
    /// Chrome trace to `out`.
    pub fn chrome(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput {
            out,
            chrome: Some(Chrome::new()),
        }
    }

    /// The output for `format`, into `path` (created now) or stdout (with
    /// control characters escaped: [`stdout_for`]).
    pub fn create(path: Option<&Path>, format: OutputFormatArg) -> Result<TraceOutput> {
        let out = sink(path, format.protocol())?;
        Ok(match format {
            OutputFormatArg::Chrome => TraceOutput::chrome(out),
            OutputFormatArg::Text | OutputFormatArg::Json => TraceOutput::copy(out),
        })
    }

    /// Takes complete lines.
    pub fn write(&mut self, text: &str) -> std::io::Result<()> {
        match &mut self.chrome {
            Some(chrome) => {
                chrome.push_text(text);
                Ok(())
            }
            None => {
                self.out.write_all(text.as_bytes())?;
                self.out.flush()
            }
        }
    }

    /// Ends the output: writes the Chrome trace, if that is what it is
    /// (and says what it holds), and flushes.
    pub fn finish(mut self) -> std::io::Result<Option<ChromeSummary>> {
        let summary = match self.chrome.take() {
            Some(chrome) => Some(chrome.write(&mut self.out)?),
            None => None,
        };
        self.out.flush()?;
        Ok(summary)
    }
}

/// Where trace lines in `format` go: `path` (created now), or stdout
/// ([`stdout_for`]).
pub fn sink(path: Option<&Path>, format: TraceFormat) -> Result<Box<dyn Write + Send>> {
    Ok(match path {
        Some(path) => Box::new(BufWriter::new(
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => stdout_for(format),
    })
}

/// Stdout for trace lines in `format`: the lines quote the guest (task
/// names, string arguments, symbols), so the characters a terminal acts on
/// are escaped, as text or as JSON escapes ([`term::Sanitizing`]).
pub fn stdout_for(format: TraceFormat) -> Box<dyn Write + Send> {
    let mode = match format {
        TraceFormat::Text => Mode::Text,
        _ => Mode::Json,
    };
    Box::new(term::Sanitizing::new(std::io::stdout(), mode))
}

/// A writer whose bytes tests read back ([`TraceOutput::copy`] into it).
#[cfg(test)]
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedBuf(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

#[cfg(test)]
impl SharedBuf {
    /// What was written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[cfg(test)]
impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How [`copy_trace`] ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyEnd {
    /// A read stayed empty (without `follow`).
    Quiet,
    /// The VM has ended (the message says how).
    VmEnded(String),
    /// `stop` said so (an interrupt).
    Stopped,
    /// The reader of the output left (a broken pipe).
    ReaderLeft,
}

/// Copies the trace from `reader` to `out`: until a read stays empty, or
/// with `follow` until `stop` says so or the VM ends. The first read waits
/// [`FIRST_WAIT_MS`] and the next ones [`DRAIN_WAIT_MS`]; with `follow`
/// each waits `follow_wait_ms`. `stop` is asked before each read; a read
/// that a Ctrl-C ended ([`sys::Interrupted`]) stops the copy too.
pub fn copy_trace(
    control: &mut dyn Control,
    reader: &mut TraceReader,
    follow: bool,
    follow_wait_ms: u32,
    out: &mut TraceOutput,
    stop: &dyn Fn() -> bool,
) -> Result<CopyEnd> {
    let mut wait = if follow {
        follow_wait_ms
    } else {
        FIRST_WAIT_MS
    };
    loop {
        if stop() {
            return Ok(CopyEnd::Stopped);
        }
        let read = match reader.read(control, wait) {
            Ok(Ok(read)) => read,
            Ok(Err(TraceEnd::VmEnded(why))) => return Ok(CopyEnd::VmEnded(why)),
            Err(e) if sys::is_interrupted(&e) => return Ok(CopyEnd::Stopped),
            Err(e) => return Err(e),
        };
        if !follow {
            wait = DRAIN_WAIT_MS;
        }
        if !read.text.is_empty() {
            match out.write(&read.text) {
                Ok(()) => {}
                // The reader of our output left (`| head`): done.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    return Ok(CopyEnd::ReaderLeft)
                }
                Err(e) => return Err(anyhow!("cannot write the trace: {e}")),
            }
        } else if read.lost == 0 && !follow {
            return Ok(CopyEnd::Quiet);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testing::Canned;

    #[test]
    fn the_reader_follows_the_cursor_and_counts() {
        let mut c = Canned {
            answers: [
                Ok(Response::Trace {
                    next: 2,
                    text: "a\nb\n".into(),
                    lost: 0,
                }),
                Ok(Response::Trace {
                    next: 9,
                    text: "c\n".into(),
                    lost: 4,
                }),
                Ok(Response::error(
                    ErrorKind::NotReady,
                    "the VM has ended (guest stopped: power off)",
                )),
                Err(anyhow::Error::new(SupervisorGone)),
                Ok(Response::error(ErrorKind::Unsupported, "no trace here")),
            ]
            .into(),
            seen: Vec::new(),
        };
        let mut r = TraceReader::new(TraceFormat::Json);
        let first = r.read(&mut c, 10).unwrap().unwrap();
        assert_eq!(first.text, "a\nb\n");
        let second = r.read(&mut c, 10).unwrap().unwrap();
        assert_eq!((second.text.as_str(), second.lost), ("c\n", 4));
        assert_eq!((r.cursor, r.lines, r.lost), (9, 3, 4));
        assert_eq!(
            r.read(&mut c, 10).unwrap(),
            Err(TraceEnd::VmEnded(
                "the VM has ended (guest stopped: power off)".into()
            ))
        );
        assert!(matches!(
            r.read(&mut c, 10).unwrap(),
            Err(TraceEnd::VmEnded(_))
        ));
        let e = r.read(&mut c, 10).unwrap_err().to_string();
        assert_eq!(e, "no trace here");
        assert_eq!(
            c.seen[1],
            Request::TraceRead {
                cursor: 2,
                format: TraceFormat::Json,
                wait_ms: 10,
                source: None,
            }
        );
    }

    #[test]
    fn a_reader_asks_for_its_source() {
        let trace = |next: u64| {
            Ok(Response::Trace {
                next,
                text: String::new(),
                lost: 0,
            })
        };
        let mut c = Canned {
            answers: [trace(5), trace(7), trace(9), trace(9)].into(),
            seen: Vec::new(),
        };
        // From the end of the buffer, then only session 3's lines.
        let mut r = TraceReader::at_end(&mut c, TraceFormat::Text).unwrap();
        assert_eq!((r.cursor, r.source), (5, None));
        r = r.with_source(Some(3));
        r.read(&mut c, 100).unwrap().unwrap();
        r.read(&mut c, 100).unwrap().unwrap();
        assert_eq!(
            c.seen,
            [
                Request::TraceRead {
                    cursor: u64::MAX,
                    format: TraceFormat::Text,
                    wait_ms: 0,
                    source: None,
                },
                Request::TraceRead {
                    cursor: 5,
                    format: TraceFormat::Text,
                    wait_ms: 100,
                    source: Some(3),
                },
                Request::TraceRead {
                    cursor: 7,
                    format: TraceFormat::Text,
                    wait_ms: 100,
                    source: Some(3),
                },
            ]
        );
        // Back to every source.
        let mut r = TraceReader::new(TraceFormat::Json)
            .with_source(Some(0))
            .with_source(None);
        r.read(&mut c, 1).unwrap().unwrap();
        assert!(matches!(
            c.seen.last(),
            Some(Request::TraceRead { source: None, .. })
        ));
    }
}
