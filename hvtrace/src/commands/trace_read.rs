//! Reading a VM's trace: the cursor-following reader over `TraceRead`,
//! the output it writes (a file or stdout, Chrome traces built on the
//! way), and the copy loop that `trace`, `run` and `graph` share.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use protocol::{ErrorKind, Request, Response, TraceFormat};

use crate::client::SupervisorGone;
use crate::commands::cli::OutputFormatArg;
use crate::commands::timeouts::PROBE_TIMEOUT;
use crate::control::{response_error, Control};
use crate::output::chrome::{Chrome, ChromeSummary};
use crate::output::tracedat::{TraceDat, TraceDatSummary};
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
/// for a Chrome trace or a trace.dat that is written when the trace ends.
pub struct TraceOutput {
    out: Box<dyn Write + Send>,
    chrome: Option<Chrome>,
    dat: Option<DatOut>,
}

/// A trace.dat on its way: the events, and the file it goes to (written
/// beside it under another name, then renamed, so that the path never
/// holds half a file).
struct DatOut {
    builder: TraceDat,
    target: PathBuf,
    part: PathBuf,
    /// The guest's listing, once taken.
    kallsyms: Option<String>,
}

/// What an output held when it ended, for the line on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputSummary {
    /// A Chrome trace.
    Chrome(ChromeSummary),
    /// A trace.dat.
    TraceDat(TraceDatSummary),
}

impl OutputSummary {
    /// One line for people.
    pub fn line(&self) -> String {
        match self {
            OutputSummary::Chrome(s) => s.line(),
            OutputSummary::TraceDat(s) => s.line(),
        }
    }
}

impl TraceOutput {
    /// Lines are copied to `out` as they come.
    pub fn copy(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput {
            out,
            chrome: None,
            dat: None,
        }
    }

    /// Lines (JSON) are collected; [`TraceOutput::finish`] writes the
    /// Chrome trace to `out`.
    pub fn chrome(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput {
            out,
            chrome: Some(Chrome::new()),
            dat: None,
        }
    }

    /// Lines (JSON) are collected; [`TraceOutput::finish`] writes a
    /// trace.dat at `path`. Its directory is checked now: the file is
    /// written beside `path` first (`.NAME.part-PID`), then renamed.
    pub fn trace_dat(path: &Path) -> Result<TraceOutput> {
        let part = part_path(path)?;
        create_part(&part).with_context(|| format!("cannot write beside {}", path.display()))?;
        Ok(TraceOutput {
            out: Box::new(std::io::sink()),
            chrome: None,
            dat: Some(DatOut {
                builder: TraceDat::new([]),
                target: path.to_path_buf(),
                part,
                kallsyms: None,
            }),
        })
    }

    /// The output for `format`, into `path` (created now) or stdout (with
    /// control characters escaped: [`stdout_for`]). A trace.dat needs a
    /// path.
    pub fn create(path: Option<&Path>, format: OutputFormatArg) -> Result<TraceOutput> {
        if let Some(path) = trace_dat_path(format == OutputFormatArg::TraceDat, path)? {
            return TraceOutput::trace_dat(path);
        }
        let out = sink(path, format.protocol())?;
        Ok(match format {
            OutputFormatArg::Chrome => TraceOutput::chrome(out),
            _ => TraceOutput::copy(out),
        })
    }

    /// Learns from the VM what a trace.dat needs before its events come:
    /// the probes' definitions (their argument types) and the vCPU count.
    /// Only a trace.dat asks; what cannot be learnt is left to the events
    /// (a note on stderr says so).
    pub fn learn(&mut self, control: &mut dyn Control) {
        let Some(dat) = &mut self.dat else {
            return;
        };
        match control.request(Request::ProbeList, PROBE_TIMEOUT) {
            Ok(Response::Probes(probes)) => {
                dat.builder
                    .add_specs(probes.iter().map(|p| p.spec.as_str()));
            }
            Ok(other) => note_dat(&format!("probe list: {:#}", response_error(other))),
            Err(e) => note_dat(&format!("probe list: {e:#}")),
        }
        match control.request(Request::Status, PROBE_TIMEOUT) {
            Ok(Response::Status(s)) => dat.builder.cpus_at_least(s.vcpus as usize),
            Ok(other) => note_dat(&format!("status: {:#}", response_error(other))),
            Err(e) => note_dat(&format!("status: {e:#}")),
        }
        // Now, while the VM is surely there; again at the end if it changed.
        match kallsyms(control) {
            Ok(text) => dat.kallsyms = Some(text),
            Err(e) => note_dat(&format!(
                "kallsyms: {e:#}; the file names only the functions its events name"
            )),
        }
    }

    /// A trace.dat keeps its JSON lines in `out` too, as they come.
    pub fn with_json_copy(mut self, out: Box<dyn Write + Send>) -> TraceOutput {
        if self.dat.is_some() {
            self.out = out;
        }
        self
    }

    /// Takes complete lines.
    pub fn write(&mut self, text: &str) -> std::io::Result<()> {
        if let Some(dat) = &mut self.dat {
            dat.builder.push_text(text);
            self.out.write_all(text.as_bytes())?;
            return self.out.flush();
        }
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

    /// Takes a loss the stream reported here.
    pub fn lost(&mut self, count: u64) {
        if let Some(dat) = &mut self.dat {
            dat.builder.lost(count);
        }
    }

    /// Whether a trace.dat output took any event or loss.
    pub fn recorded(&self) -> bool {
        self.dat
            .as_ref()
            .is_some_and(|d| d.builder.events() > 0 || d.builder.lost_so_far() > 0)
    }

    /// Events taken so far per CPU (a trace.dat only), for progress lines.
    pub fn events_per_cpu(&self) -> Option<Vec<u64>> {
        self.dat.as_ref().map(|d| d.builder.events_per_cpu())
    }

    /// Bytes of the events taken so far, their headers included (a
    /// trace.dat only; the pages' own headers and ends are not counted).
    pub fn bytes(&self) -> Option<u64> {
        self.dat.as_ref().map(|d| d.builder.payload_bytes())
    }

    /// Ends the output: writes the Chrome trace or the trace.dat, if that
    /// is what it is (and says what it holds), and flushes. A trace.dat
    /// takes the guest's kallsyms from `control` when it is given and the
    /// VM has them; else the symbols its lines named.
    pub fn finish(
        mut self,
        control: Option<&mut dyn Control>,
    ) -> std::io::Result<Option<OutputSummary>> {
        if self.dat.is_some() {
            // The JSON copy first: on its failure the part file goes with
            // the output (`Drop`).
            self.out.flush()?;
        }
        if let Some(mut dat) = self.dat.take() {
            let earlier = dat.kallsyms.take();
            let kallsyms = match (control, earlier) {
                (Some(c), Some(earlier)) => match kallsyms_total(c) {
                    Some(total) if total != earlier.len() as u64 => {
                        kallsyms(c).ok().or(Some(earlier))
                    }
                    _ => Some(earlier),
                },
                (Some(c), None) => match kallsyms(c) {
                    Ok(text) => Some(text),
                    Err(e) => {
                        note_dat(&format!(
                            "kallsyms: {e:#}; the file names only the functions its events name"
                        ));
                        None
                    }
                },
                (None, earlier) => earlier,
            };
            let summary = write_trace_dat(std::mem::take(&mut dat.builder), &dat.target, kallsyms)?;
            return Ok(Some(OutputSummary::TraceDat(summary)));
        }
        let summary = match self.chrome.take() {
            Some(chrome) => Some(OutputSummary::Chrome(chrome.write(&mut self.out)?)),
            None => None,
        };
        self.out.flush()?;
        Ok(summary)
    }
}

/// The part name a trace.dat at `path` is written under first:
/// `.NAME.part-PID` beside it.
pub fn part_path(path: &Path) -> Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| anyhow!("{} names no file", path.display()))?;
    Ok(path.with_file_name(format!(
        ".{}.part-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Writes `builder`'s trace.dat to `path`: under its part name, synced,
/// then renamed over `path`. On failure the part is removed and `path`
/// left as it was.
pub fn write_trace_dat(
    builder: TraceDat,
    path: &Path,
    kallsyms: Option<String>,
) -> std::io::Result<TraceDatSummary> {
    let part = part_path(path).map_err(|e| std::io::Error::other(e.to_string()))?;
    let written = (|| {
        let file = create_part(&part)?;
        let mut w = BufWriter::new(file);
        let summary = builder.write(&mut w, kallsyms)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&part, path)?;
        Ok(summary)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    written.map_err(|e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()))
    })
}

/// Creates the part file `part` anew: whatever is at that name (ours
/// from before, or a link someone put there) is unlinked first, and the
/// file is created only if nothing is there then, so that no link is
/// followed.
fn create_part(part: &Path) -> std::io::Result<File> {
    let _ = std::fs::remove_file(part);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(part)
}

/// The listing's size, from a read past its end (`None` when it cannot
/// be read).
fn kallsyms_total(control: &mut dyn Control) -> Option<u64> {
    match control.request(Request::Kallsyms { offset: u64::MAX }, PROBE_TIMEOUT) {
        Ok(Response::Kallsyms { total, .. }) => Some(total),
        _ => None,
    }
}

impl Drop for TraceOutput {
    fn drop(&mut self) {
        // An output dropped unfinished leaves no part file behind.
        if let Some(dat) = &self.dat {
            let _ = std::fs::remove_file(&dat.part);
        }
    }
}

fn note_dat(what: &str) {
    eprintln!("hvtrace: note: trace.dat: {}", term::sanitize(what));
}

/// The guest's `/proc/kallsyms` text, as the VM's supervisor lists it
/// ([`Request::Kallsyms`]), page by page.
pub fn kallsyms(control: &mut dyn Control) -> Result<String> {
    let mut text = String::new();
    let mut offset = Some(0u64);
    while let Some(at) = offset {
        match control.request(Request::Kallsyms { offset: at }, PROBE_TIMEOUT)? {
            Response::Kallsyms {
                text: page,
                next,
                total,
            } => {
                if next.is_some_and(|n| n <= at) || total > 1 << 30 {
                    bail!("the listing's pages do not add up");
                }
                text.push_str(&page);
                offset = next;
            }
            other => return Err(response_error(other)),
        }
    }
    Ok(text)
}

/// The file a trace.dat goes to when `dat` asks for one: `path`, which
/// it needs (there is no trace.dat on a terminal); `None` for other
/// formats.
pub fn trace_dat_path(dat: bool, path: Option<&Path>) -> Result<Option<&Path>> {
    match (dat, path) {
        (false, _) => Ok(None),
        (true, Some(path)) => Ok(Some(path)),
        (true, None) => bail!("--format trace-dat writes a file: give it with --output FILE"),
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
        out.lost(read.lost);
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
