//! The supervisor of a detached VM (`hvtrace run --detach`).
//!
//! It is the `hvtrace` binary re-run with a hidden subcommand, in a session
//! of its own, its output in `supervisor.log` in the run directory. It owns
//! the emulator, the guest console (COM1) and the control channel (COM2),
//! and serves one unix control socket:
//!
//! - `Exec` runs through the guest console, one command at a time, each in
//!   a subshell (so `exit` or `cd` leave the console's shell as it was);
//! - `Stop` is forwarded; once the hypervisor has acknowledged it and the VM
//!   has ended, the client gets the hypervisor's last log lines as `Log`
//!   events, then the response;
//! - `TraceRead` is served here, from the trace buffer ([`TraceBuffer`]),
//!   which the hypervisor's `TraceText` events fill once the stream is
//!   started: the first read in a format starts the stream in that format
//!   (or switches it), then each read waits up to its `wait_ms` for a line
//!   of its source (one source, or all of them);
//!   `TraceStart` and `TraceStop` are forwarded, and the supervisor notes
//!   the format the stream is in;
//! - every other request is forwarded to the hypervisor, one at a time
//!   ([`HvLink`]), under the supervisor's own sequence numbers; the answer
//!   goes back under the client's;
//! - frames of another protocol version and bytes that are not frames are
//!   forwarded as they are ([`crate::daemon::session`]).
//!
//! Clients come and go as they like; a client that leaves in the middle of
//! a frame or of a request harms nobody. The function-graph sessions a
//! client started and did not stop are stopped when its connection closes,
//! unless it asked them to persist ([`crate::daemon::owners`]). When the VM ends
//! (the guest stops, the emulator exits), waiting clients get an error
//! saying so, the socket is removed and the supervisor exits.
//!
//! This file is the supervisor's core: its phases, the answers to each
//! request, and the VM's life (`run_vm`). The daemon around it, the socket,
//! its client threads and the run directory's `state` file (`starting`,
//! `booting`, `ready`, `ended: ...`, `failed: ...`, which `run --detach`
//! polls), is [`crate::daemon::serve`].
//!
//! [`crate::daemon::local::LocalVm`] runs the same supervisor inside the
//! calling process, without a socket, for `hvtrace run` with tracing
//! options: the caller is its only client and calls it directly.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::recording::{Noting, Recorder};
use super::symbols::HostSymbols;
use anyhow::Result;
use protocol::{ErrorKind, Event, Frame, Request, Response, TraceChannel, TraceFormat};
use tracelang::kprobe::IndexSymbols;
use tracelang::render::RecordRenderer;

use crate::daemon::link::{self, HvLink, LinkError};
use crate::daemon::owners::GraphOwners;
use crate::daemon::session::{Backend, Reply};
use crate::daemon::tracebuf::{TraceBuffer, TraceChunk, READ_BUDGET};
use crate::vm::config::RunConfig;
use crate::vm::console::ExecResult;
use crate::vm::{StopReport, Vm, VmWatch};

/// The longest a guest command may run.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a stop may take from the hypervisor's acknowledgement to the
/// emulator's end.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(120);

/// Output bytes per frame of an `Exec` answer: a frame carries at most
/// [`protocol::MAX_FRAME`] bytes, so longer output goes ahead of the
/// response as `Log` events of this size (see [`exec_reply`]).
pub const EXEC_CHUNK: usize = 3072;

/// The longest a `TraceRead` waits for a line, whatever it asks for.
pub const MAX_TRACE_WAIT: Duration = Duration::from_secs(30);
/// How long a stream's start waits for root's symbols to reach the host
/// (asked for at the first start: recovering the kernel, if no request
/// did yet, and a few seconds of the log port); past it root renders this
/// stream, and the next start takes the symbols that came meanwhile.
const SYMBOLS_WAIT: Duration = Duration::from_secs(20);

/// How long, once the VM has ended, the answers in progress get to go out.
pub(crate) const END_GRACE: Duration = Duration::from_secs(10);

/// How the VM ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// Why, in one line (`guest stopped: stopped by the host`).
    pub reason: String,
    /// The guest stopped as asked (by the host, or by powering off).
    pub clean: bool,
    /// The hypervisor's last log lines: the exit counts and the stop.
    pub lines: Vec<String>,
}

impl Ending {
    /// The ending of a VM whose stop was reported.
    pub fn from_report(report: &StopReport) -> Ending {
        let counts = report
            .hv_lines
            .iter()
            .rev()
            .find(|l| l.starts_with("exit counts:"));
        let stop = report
            .hv_lines
            .iter()
            .find(|l| l.starts_with("guest stopped:"));
        Ending {
            reason: format!("guest stopped: {}", report.reason),
            clean: matches!(report.reason.as_str(), "stopped by the host" | "power off"),
            lines: counts.into_iter().chain(stop).cloned().collect(),
        }
    }
}

/// Where the VM is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Building the boot image and starting the emulator.
    Starting,
    /// The emulator runs; the guest shell is not up yet.
    Booting,
    /// The guest shell answers.
    Ready,
    /// Over.
    Ended(Ending),
}

/// Prints a progress line, timed from `start`. It may quote the guest or
/// the hypervisor, and `run --detach` copies it to the terminal: control
/// characters are escaped.
fn note_at(start: Instant, message: &str) {
    eprintln!(
        "[{:7.1}s] {}",
        start.elapsed().as_secs_f64(),
        crate::output::term::sanitize(message)
    );
}

/// The trace buffer, shared with the link's reader thread, which fills it.
struct TraceShared {
    buf: Mutex<TraceBuffer>,
    cv: Condvar,
    /// Binary `Trace` events received (this supervisor reads rendered text).
    binary: AtomicU64,
    /// The host's copy of root's symbol index, once the VM started.
    symbols: OnceLock<Arc<HostSymbols>>,
    /// The renderer of root's records, while the stream is in records.
    render: Mutex<Option<HostRender>>,
    /// Records that came with no renderer (dropped).
    unrendered: AtomicU64,
    /// The host takes the records out of root's rings itself (the channel
    /// is `SharedRings` and the stream is in records). Held by the ring
    /// reader while it takes records, so that root drains again only after
    /// the reader stopped ([`Supervisor::stop_host_reads`]).
    host_reads: Mutex<bool>,
    /// Root's doorbell rings ([`Event::TraceDoorbell`]): counted, and the
    /// ring reader woken.
    doorbell: Mutex<u64>,
    doorbell_cv: Condvar,

    /// The recording `HVTRACE_RECORD_STREAM` names, when it is set and
    /// could be opened: streams rendered here are then started as records
    /// and root's text ([`crate::daemon::recording`]).
    recording: Option<Mutex<Recorder>>,
    /// The stream is records and root's text: root's `TraceText` goes to
    /// the recording, not to the buffer.
    root_text_recorded: AtomicBool,
}

/// The stream rendered here: the renderer and the index it names with.
struct HostRender {
    renderer: RecordRenderer,
    index: Arc<guest_introspect::kallsyms::SymbolIndex>,
}

impl TraceShared {
    pub(crate) fn new() -> TraceShared {
        TraceShared {
            buf: Mutex::new(TraceBuffer::new()),
            cv: Condvar::new(),
            binary: AtomicU64::new(0),
            symbols: OnceLock::new(),
            render: Mutex::new(None),
            unrendered: AtomicU64::new(0),
            host_reads: Mutex::new(false),
            doorbell: Mutex::new(0),
            doorbell_cv: Condvar::new(),
            recording: None,
            root_text_recorded: AtomicBool::new(false),
        }
    }

    fn host_reads_lock(&self) -> MutexGuard<'_, bool> {
        self.host_reads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits up to `wait` for the doorbell after `seen` rings; returns the
    /// rings so far.
    fn wait_doorbell(&self, seen: u64, wait: Duration) -> u64 {
        let rings = self.doorbell.lock().unwrap_or_else(|e| e.into_inner());
        if *rings != seen {
            return *rings;
        }
        *self
            .doorbell_cv
            .wait_timeout(rings, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// With the recording `HVTRACE_RECORD_STREAM` names, if any (a file
    /// that cannot be opened is noted, and nothing is recorded).
    fn with_recording(mut self, start: Instant) -> TraceShared {
        match Recorder::from_env() {
            Some(Ok(r)) => {
                note_at(start, "the trace stream is recorded with root's own text");
                self.recording = Some(Mutex::new(r));
            }
            Some(Err(e)) => note_at(
                start,
                &format!("the stream recording cannot be opened: {e}"),
            ),
            None => {}
        }
        self
    }

    fn recorder(&self) -> Option<MutexGuard<'_, Recorder>> {
        self.recording
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds text to the buffer (root's, or rendered here).
    fn buffer_text(&self, format: TraceFormat, source: u32, lost: u64, text: &str) {
        let mut buf = self.lock();
        buf.push_lost(lost);
        buf.push_text(format, source, text);
        drop(buf);
        self.cv.notify_all();
    }

    fn render_lock(&self) -> MutexGuard<'_, Option<HostRender>> {
        self.render.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock(&self) -> MutexGuard<'_, TraceBuffer> {
        self.buf.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one event from the hypervisor.
    fn on_event(&self, event: Event, note: &dyn Fn(&str)) {
        match event {
            Event::TraceText { .. } if self.root_text_recorded.load(Ordering::Relaxed) => {
                if let Some(mut r) = self.recorder() {
                    r.event("root", &event);
                }
            }
            Event::TraceText {
                format,
                source,
                lost,
                text,
            } => self.buffer_text(format, source, lost, &text),
            Event::Lost { count } => {
                self.lock().push_lost(count);
                self.cv.notify_all();
            }
            Event::Log { text } => note(&format!("hypervisor: {text}")),
            // The VM's control tap hands the fatal report to the VM's log
            // digest, where the log port's copy goes too.
            Event::Fatal { .. } => {}
            Event::SymbolChunk {
                id,
                part,
                total,
                offset,
                data,
            } => {
                if let Some(s) = self.symbols.get() {
                    s.chunk(id, part, total, offset, &data);
                }
            }
            Event::TraceContext(c) => {
                if let Some(mut r) = self.recorder() {
                    r.event("ctx", &Event::TraceContext(c.clone()));
                }
                if let Some(r) = self.render_lock().as_mut() {
                    r.renderer.context(&c);
                }
            }
            Event::TraceRecords { lost, now_ns, data } => {
                let mut recorder = self.recorder();
                if let Some(r) = recorder.as_mut() {
                    r.event(
                        "rec",
                        &Event::TraceRecords {
                            lost,
                            now_ns,
                            data: data.clone(),
                        },
                    );
                }
                let mut out = Vec::new();
                match self.render_lock().as_mut() {
                    Some(r) => {
                        let modules = self.symbols.get().and_then(|s| s.modules());
                        let syms = IndexSymbols::new(&r.index, modules.as_deref());
                        match recorder.as_mut() {
                            Some(rec) => {
                                let noting = Noting::new(&syms);
                                r.renderer.records(lost, now_ns, &data, &noting, &mut out);
                                rec.addresses(&noting.seen.borrow());
                            }
                            None => r.renderer.records(lost, now_ns, &data, &syms, &mut out),
                        }
                    }
                    None => {
                        if self.unrendered.fetch_add(1, Ordering::Relaxed) == 0 {
                            note("trace records came with no renderer; they are dropped");
                        }
                    }
                }
                for e in out {
                    if let Event::TraceText {
                        format,
                        source,
                        lost,
                        text,
                    } = e
                    {
                        if let Some(r) = recorder.as_mut() {
                            r.host_text(&text);
                        }
                        self.buffer_text(format, source, lost, &text);
                    }
                }
            }
            Event::TraceDoorbell => {
                *self.doorbell.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                self.doorbell_cv.notify_all();
            }
            Event::Trace { .. } => {
                if self.binary.fetch_add(1, Ordering::Relaxed) == 0 {
                    note("the hypervisor sends binary trace records, which this hvtrace does not read; they are dropped");
                }
            }
            other => note(&format!(
                "dropped an unknown event from the hypervisor: {other:?}"
            )),
        }
    }

    /// Reads from `cursor`, waiting up to `wait` for a line of `format`
    /// from `source` (`None`: any source); `ended` cuts the wait short.
    /// Losses alone do not end the wait: they come with the first line
    /// after them, or when the wait is over.
    fn wait_read(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        wait: Duration,
        ended: &dyn Fn() -> bool,
    ) -> TraceChunk {
        let deadline = Instant::now() + wait;
        let mut buf = self.lock();
        let mut cursor = cursor;
        loop {
            let chunk = buf.read(cursor, format, source, READ_BUDGET);
            let left = deadline.saturating_duration_since(Instant::now());
            if !chunk.text.is_empty() || left.is_zero() || ended() {
                return chunk;
            }
            if chunk.lost == 0 {
                // Only lines of another format or source, if anything: go
                // on from there. With a loss to report, read from the cursor again.
                cursor = chunk.next;
            }
            // The end of the VM does not notify this condition variable;
            // short slices bound the delay.
            let slice = left.min(Duration::from_millis(200));
            buf = self
                .cv
                .wait_timeout(buf, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How often the ring reader looks at root's rings without a doorbell.
const RING_POLL: Duration = Duration::from_millis(10);
/// How often the reader of the frame ring alone (root drains its rings
/// into it, and rings no doorbell) looks at it.
const FRAME_RING_POLL: Duration = Duration::from_millis(2);
/// How long records wait for a copy of the modules' symbols at most.
const MODULES_HOLD: Duration = Duration::from_secs(2);
/// How long records wait in a row at most (copies after copies).
const HOLD_IN_A_ROW: Duration = Duration::from_secs(10);

/// The state the client threads share.
pub(crate) struct Supervisor {
    phase: Mutex<Phase>,
    phase_cv: Condvar,
    vm: Mutex<Option<Vm>>,
    link: OnceLock<HvLink>,
    events: AtomicU32,
    /// Chunks of client input being handled (requests being answered).
    pub(crate) busy: AtomicUsize,
    pub(crate) clients: AtomicUsize,
    pub(crate) client_ids: AtomicU32,
    start: Instant,
    trace: Arc<TraceShared>,
    /// The format the hypervisor streams trace text in, once started.
    /// Held while the stream is started or switched.
    stream: Mutex<Option<TraceFormat>>,
    /// Which connection started which function-graph session.
    pub(crate) graphs: GraphOwners,
    /// The VM whose log port carries the trace stream, when it does.
    trace_port: OnceLock<VmWatch>,
    /// The trace stream has a path of its own (the log port or the ring).
    bulk: AtomicBool,
    /// The first stream rendered here was noted.
    rendering_noted: AtomicBool,
    /// A reader of root's record rings runs ([`Supervisor::use_ring`]).
    rings_reader: AtomicBool,
    /// A reader of root's frame ring runs (the record rings' reader, or
    /// the frame ring's alone).
    frame_reader: AtomicBool,
    /// The channel is `SharedRings`: the host reads the record rings once
    /// the stream is in records.
    channel_rings: AtomicBool,
}

impl Supervisor {
    pub(crate) fn new() -> Supervisor {
        let start = Instant::now();
        Supervisor {
            phase: Mutex::new(Phase::Starting),
            phase_cv: Condvar::new(),
            vm: Mutex::new(None),
            link: OnceLock::new(),
            events: AtomicU32::new(0),
            busy: AtomicUsize::new(0),
            clients: AtomicUsize::new(0),
            client_ids: AtomicU32::new(1),
            start,
            trace: Arc::new(TraceShared::new().with_recording(start)),
            stream: Mutex::new(None),
            graphs: GraphOwners::new(),
            trace_port: OnceLock::new(),
            bulk: AtomicBool::new(false),
            rendering_noted: AtomicBool::new(false),
            rings_reader: AtomicBool::new(false),
            frame_reader: AtomicBool::new(false),
            channel_rings: AtomicBool::new(false),
        }
    }

    pub(crate) fn note(&self, message: &str) {
        note_at(self.start, message);
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_phase(&self, phase: Phase) {
        *self.phase() = phase;
        self.phase_cv.notify_all();
        self.trace.cv.notify_all();
    }

    /// Waits until the guest shell is up; returns the ending instead if
    /// the VM ended first.
    pub(crate) fn wait_ready(&self) -> std::result::Result<(), Ending> {
        let mut phase = self.phase();
        loop {
            match &*phase {
                Phase::Ready => return Ok(()),
                Phase::Ended(e) => return Err(e.clone()),
                _ => {}
            }
            phase = self.phase_cv.wait(phase).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub(crate) fn ending(&self) -> Option<Ending> {
        match &*self.phase() {
            Phase::Ended(e) => Some(e.clone()),
            _ => None,
        }
    }

    /// Waits up to `timeout` for the VM to end.
    fn wait_ending(&self, timeout: Duration) -> Option<Ending> {
        let deadline = Instant::now() + timeout;
        let mut phase = self.phase();
        loop {
            if let Phase::Ended(e) = &*phase {
                return Some(e.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            phase = self
                .phase_cv
                .wait_timeout(phase, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(crate) fn vm(&self) -> MutexGuard<'_, Option<Vm>> {
        self.vm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The message for a request the link could not carry.
    fn link_failure(&self, e: &LinkError) -> String {
        match e {
            LinkError::Closed(_) => match self.wait_ending(Duration::from_secs(5)) {
                Some(end) => ended_message(&end),
                None => e.to_string(),
            },
            LinkError::Timeout(_) if *self.phase() == Phase::Booting => {
                format!("{e} (the VM is still booting)")
            }
            LinkError::Timeout(_) => e.to_string(),
        }
    }

    fn forward(&self, request: Request) -> Response {
        let Some(link) = self.link.get() else {
            return Response::error(ErrorKind::NotReady, "the VM is starting; try again shortly");
        };
        match link.request(request) {
            Ok(response) => response,
            Err(e) => Response::error(ErrorKind::NotReady, self.link_failure(&e)),
        }
    }

    fn exec(&self, command: &str) -> Reply {
        match self.exec_command(command, true) {
            Ok(result) => exec_reply(result.output, result.rc),
            Err(refusal) => refusal.response().into(),
        }
    }

    /// Runs a command in the guest shell; in a subshell when `subshell`
    /// (so that `exit` or `cd` leave the console's shell as it was).
    pub(crate) fn exec_command(
        &self,
        command: &str,
        subshell: bool,
    ) -> std::result::Result<ExecResult, Refusal> {
        if *self.phase() != Phase::Ready {
            return Err(Refusal::new(
                ErrorKind::NotReady,
                "the guest shell is not up yet (the VM is booting)",
            ));
        }
        let mut vm = self.vm();
        let Some(vm) = vm.as_mut() else {
            let message = match self.wait_ending(Duration::from_secs(5)) {
                Some(end) => ended_message(&end),
                None => "the VM is ending".to_string(),
            };
            return Err(Refusal::new(ErrorKind::NotReady, message));
        };
        // `eval` keeps a trailing comment from swallowing the parenthesis.
        let line = if subshell {
            format!("( eval {} )", crate::vm::console::sh_quote(command))
        } else {
            command.to_string()
        };
        vm.exec_timeout(&line, EXEC_TIMEOUT).map_err(|e| {
            if let Some(end) = vm.watch().ended() {
                return Refusal::new(ErrorKind::NotReady, format!("the VM has ended ({end})"));
            }
            let message = format!("{e:#}");
            let kind = if message.contains("too long") {
                ErrorKind::InvalidArgument
            } else {
                ErrorKind::Internal
            };
            Refusal::new(kind, format!("exec failed: {message}"))
        })
    }

    pub(crate) fn stop(&self) -> Reply {
        match self.forward(Request::Stop) {
            Response::Ok => {}
            other => return other.into(),
        }
        self.note("the hypervisor acknowledged a stop; waiting for the VM to end");
        match self.wait_ending(STOP_TIMEOUT) {
            Some(end) => Reply {
                events: end
                    .lines
                    .iter()
                    .map(|text| Event::Log { text: text.clone() })
                    .collect(),
                response: if end.clean {
                    Response::Ok
                } else {
                    Response::error(ErrorKind::Internal, ended_message(&end))
                },
            },
            None => Response::error(
                ErrorKind::Internal,
                format!(
                    "the hypervisor acknowledged the stop, but the VM did not end within {} s",
                    STOP_TIMEOUT.as_secs()
                ),
            )
            .into(),
        }
    }

    /// Starts the trace stream in `format` (or switches it), and notes
    /// the format on success.
    fn trace_start(&self, format: TraceFormat) -> Response {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let response = self.start_stream(format);
        if response == Response::Ok {
            *stream = Some(format);
        }
        response
    }

    /// Starts root's stream for lines in `format`: as records rendered
    /// here once the host has root's symbols (the stream's path being the
    /// log port or the ring), else rendered by root. A switch of format
    /// keeps the records stream and its context.
    /// The ring reader stopped on a ring it cannot trust: root drains the
    /// rings again and renders the stream on COM2 (restarted at once).
    fn give_up_rings(&self) {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        self.stop_host_reads();
        self.rings_reader.store(false, Ordering::Relaxed);
        self.frame_reader.store(false, Ordering::Relaxed);
        self.channel_rings.store(false, Ordering::Relaxed);
        self.bulk.store(false, Ordering::Relaxed);
        let back = self.forward(Request::TraceChannel {
            channel: TraceChannel::Control,
        });
        self.note(&format!(
            "the trace stream goes back to the control channel: {back:?}"
        ));
        if let Some(format) = *stream {
            let restarted = self.start_stream(format);
            if restarted != Response::Ok {
                self.note(&format!("the stream did not start again: {restarted:?}"));
            }
        }
    }

    /// Stops the ring reader taking records (it finishes the take under
    /// way first): before any request after which root drains the rings.
    fn stop_host_reads(&self) {
        *self.trace.host_reads_lock() = false;
    }

    fn start_stream(&self, format: TraceFormat) -> Response {
        self.stop_host_reads();
        if let Some(index) = self.host_index() {
            {
                let mut render = self.trace.render_lock();
                match render.as_mut() {
                    Some(r) => r.renderer.set_format(format),
                    None => {
                        *render = Some(HostRender {
                            renderer: RecordRenderer::new(format),
                            index,
                        })
                    }
                }
            }
            // Recording: root's own text comes beside the records.
            let recorded = self.trace.recording.is_some();
            let records = if recorded {
                TraceFormat::RecordsAndText
            } else {
                TraceFormat::Records
            };
            self.trace
                .root_text_recorded
                .store(recorded, Ordering::Relaxed);
            let response = self.forward(Request::TraceStart { format: records });
            if response == Response::Ok {
                // Root drains the rings itself when it renders beside them.
                let rings = self.channel_rings.load(Ordering::Relaxed) && !recorded;
                *self.trace.host_reads_lock() = rings;
                if !self.rendering_noted.swap(true, Ordering::Relaxed) {
                    self.note(if rings {
                        "the hypervisor's records are read from its rings and rendered here"
                    } else {
                        "the hypervisor streams records; they are rendered here"
                    });
                }
                return response;
            }
            *self.trace.render_lock() = None;
            self.trace
                .root_text_recorded
                .store(false, Ordering::Relaxed);
            self.note(&format!(
                "the stream is rendered by the hypervisor: records were refused: {response:?}"
            ));
        } else {
            *self.trace.render_lock() = None;
        }
        self.forward(Request::TraceStart { format })
    }

    /// Root's symbol index as the host has it, waiting for it while it
    /// comes; `None` without a path of the stream's own, or when the
    /// export failed (the stream is then rendered by root).
    fn host_index(&self) -> Option<Arc<guest_introspect::kallsyms::SymbolIndex>> {
        if !self.bulk.load(Ordering::Relaxed) || std::env::var_os("HVTRACE_ROOT_RENDERS").is_some()
        {
            return None;
        }
        let deadline = Instant::now() + SYMBOLS_WAIT;
        self.export_symbols();
        let symbols = self.trace.symbols.get()?;
        match symbols.wait(deadline.saturating_duration_since(Instant::now())) {
            Ok((index, _)) => Some(index),
            Err(why) => {
                self.note(&format!("the stream is rendered by the hypervisor: {why}"));
                None
            }
        }
    }

    /// Asks root for its symbol index once per boot, at the first start of
    /// a stream with a path of its own (the chunks come along that path).
    /// Not at boot: recovering the kernel waits for a request that needs
    /// it.
    fn export_symbols(&self) {
        let (Some(symbols), Some(link)) = (self.trace.symbols.get(), self.link.get()) else {
            return;
        };
        if !self.bulk.load(Ordering::Relaxed) || !symbols.start() {
            return;
        }
        // Root holds the request while it recovers the kernel, for a
        // while; a kernel still not found is asked about again.
        let deadline = Instant::now() + SYMBOLS_WAIT;
        loop {
            match link.request(Request::SymbolsExport) {
                Ok(Response::SymbolsExport {
                    id,
                    bytes,
                    symbols: n,
                }) => {
                    self.note(&format!(
                        "root sends its symbol index: {n} symbols in {bytes} bytes (export {id})"
                    ));
                    symbols.answered(id, bytes);
                }
                Ok(Response::Error {
                    kind: ErrorKind::NotReady,
                    message,
                }) if Instant::now() < deadline && self.ending().is_none() => {
                    self.note(&format!("symbol export: {message}; asking again"));
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
                Ok(other) => symbols.refused(format!("root answered {other:?}")),
                Err(e) => symbols.refused(e.to_string()),
            }
            break;
        }
    }

    /// `TraceChannel` from a client: forwarded; records go only on a path
    /// of the stream's own, so a running stream is started again, as
    /// records on the log port or the ring, rendered by root on COM2.
    fn trace_channel(&self, channel: TraceChannel) -> Response {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        // Nothing goes where nobody reads it.
        let unread = match channel {
            TraceChannel::SharedRings => !self.rings_reader.load(Ordering::Relaxed),
            TraceChannel::SharedRing => !self.frame_reader.load(Ordering::Relaxed),
            TraceChannel::LogPort => self.trace_port.get().is_none(),
            _ => false,
        };
        if unread {
            return Response::error(
                ErrorKind::Unsupported,
                "nothing reads that trace channel here (the shared rings: QEMU with KVM; the log port: a VM this supervisor launched)",
            );
        }
        self.stop_host_reads();
        // Whatever root answers (or if no answer comes), it drains the
        // rings itself unless it says where they are below.
        self.channel_rings.store(false, Ordering::Relaxed);
        let response = self.forward(Request::TraceChannel { channel });
        if response != Response::Ok
            && !matches!(
                response,
                Response::TraceRing { .. } | Response::TraceRings { .. }
            )
        {
            return response;
        }
        // Root now drains the rings itself unless this is `SharedRings`
        // and this process reads them (the rings stay where they were).
        self.channel_rings.store(
            matches!(response, Response::TraceRings { .. })
                && self.rings_reader.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let bulk = match channel {
            TraceChannel::Control => false,
            TraceChannel::LogPort => self.trace_port.get().is_some(),
            _ => true,
        };
        self.bulk.store(bulk, Ordering::Relaxed);
        if let Some(format) = *stream {
            let restarted = self.start_stream(format);
            if restarted != Response::Ok {
                self.note(&format!(
                    "the stream did not start again after the channel changed: {restarted:?}"
                ));
            }
        }
        response
    }

    fn trace_stop(&self) -> Response {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        self.stop_host_reads();
        let response = self.forward(Request::TraceStop);
        if response == Response::Ok {
            *stream = None;
            *self.trace.render_lock() = None;
            self.trace
                .root_text_recorded
                .store(false, Ordering::Relaxed);
        }
        response
    }

    /// Serves `TraceRead`: starts or switches the stream when it is not in
    /// `format`, then reads the buffer (the lines of `source`, or of every
    /// source).
    fn trace_read(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        wait_ms: u32,
    ) -> Response {
        {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            if *stream != Some(format) {
                match self.start_stream(format) {
                    Response::Ok => *stream = Some(format),
                    other => return other,
                }
            }
        }
        let wait = Duration::from_millis(u64::from(wait_ms)).min(MAX_TRACE_WAIT);
        let chunk = self
            .trace
            .wait_read(cursor, format, source, wait, &|| self.ending().is_some());
        trace_response(chunk)
    }

    /// Serves `TraceRead` once the VM has ended: what is left in the buffer,
    /// then the end.
    fn trace_read_after_end(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        end: &Ending,
    ) -> Response {
        let chunk = self.trace.lock().read(cursor, format, source, READ_BUDGET);
        if chunk.is_empty() {
            return Response::error(ErrorKind::NotReady, ended_message(end));
        }
        trace_response(chunk)
    }
}

/// Why a request was not carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    kind: ErrorKind,
    message: String,
}

impl Refusal {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Refusal {
        Refusal {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn response(self) -> Response {
        Response::error(self.kind, self.message)
    }
}

/// The answer to `Exec`: output that does not fit one frame goes first, in
/// `Log` events of at most [`EXEC_CHUNK`] bytes (cut at character
/// boundaries), and the response carries the rest;
/// [`crate::client::Client::call`] puts the pieces together again.
pub fn exec_reply(output: String, status: i32) -> Reply {
    let mut chunks = Vec::new();
    let mut rest = output.as_str();
    while rest.len() > EXEC_CHUNK {
        let mut cut = EXEC_CHUNK;
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        chunks.push(Event::Log {
            text: rest[..cut].to_string(),
        });
        rest = &rest[cut..];
    }
    Reply {
        events: chunks,
        response: Response::Exec {
            output: rest.to_string(),
            status,
        },
    }
}

fn trace_response(chunk: TraceChunk) -> Response {
    Response::Trace {
        next: chunk.next,
        text: chunk.text,
        lost: chunk.lost,
    }
}

fn ended_message(end: &Ending) -> String {
    format!("the VM has ended ({})", end.reason)
}

impl Backend for Supervisor {
    fn serve(&self, request: Request) -> Reply {
        if let Some(end) = self.ending() {
            if let Request::TraceRead {
                cursor,
                format,
                source,
                ..
            } = request
            {
                return self
                    .trace_read_after_end(cursor, format, source, &end)
                    .into();
            }
            return Response::error(ErrorKind::NotReady, ended_message(&end)).into();
        }
        match request {
            Request::Exec { command } => self.exec(&command),
            Request::Stop => self.stop(),
            Request::TraceRead {
                cursor,
                format,
                wait_ms,
                source,
            } => self.trace_read(cursor, format, source, wait_ms).into(),
            Request::TraceStart { format } => self.trace_start(format).into(),
            Request::TraceStop => self.trace_stop().into(),
            Request::TraceChannel { channel } => self.trace_channel(channel).into(),
            other => self.forward(other).into(),
        }
    }

    fn forward_wrong_version(&self, wire: &[u8], seq: u32) -> Result<Frame, String> {
        let Some(link) = self.link.get() else {
            return Err("the VM is starting; try again shortly".to_string());
        };
        link.forward_expecting(wire, seq)
            .map_err(|e| self.link_failure(&e))
    }

    fn forward_garbage(&self, wire: &[u8]) {
        if let Some(link) = self.link.get() {
            let _ = link.forward(wire);
        }
    }

    fn next_event_seq(&self) -> u32 {
        self.events.fetch_add(1, Ordering::Relaxed)
    }
}

impl Supervisor {
    /// Starts the link to the hypervisor over the control channel's two
    /// halves; its events go to the trace buffer and the log.
    fn attach<R, W>(&self, reader: R, writer: W, timeout: Duration)
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        let trace = self.trace.clone();
        let start = self.start;
        let link = HvLink::with_events(reader, writer, timeout, move |_, event| {
            trace.on_event(event, &|message| note_at(start, message))
        });
        let _ = self.link.set(link);
    }

    /// Asks the hypervisor to send the trace stream on the log port, which
    /// this process reads (far faster than COM2); on any failure the
    /// stream stays on COM2.
    fn use_log_port(&self, watch: VmWatch) {
        let Some(link) = self.link.get() else {
            return;
        };
        match link.request(Request::TraceChannel {
            channel: TraceChannel::LogPort,
        }) {
            Ok(Response::Ok) => {
                let _ = self.trace_port.set(watch);
                self.bulk.store(true, Ordering::Relaxed);
                self.note("the trace stream takes the log port");
            }
            Ok(other) => self.note(&format!(
                "the trace stream stays on the control channel: the hypervisor answered {other:?}"
            )),
            Err(e) => self.note(&format!(
                "the trace stream stays on the control channel: {e}"
            )),
        }
    }

    /// Asks the hypervisor to put the trace stream in a ring in its memory,
    /// which this process reads from the file behind the guest's RAM, and
    /// starts the thread that drains it. On any failure the caller falls
    /// back to the log port.
    fn use_ring(
        self: &Arc<Self>,
        file: &std::fs::File,
        machine: crate::vm::shm::MachineType,
        ram: u64,
        watch: VmWatch,
    ) -> bool {
        let Some(link) = self.link.get() else {
            return false;
        };
        let rings = link.request(Request::TraceChannel {
            channel: TraceChannel::SharedRings,
        });
        match rings {
            Ok(Response::TraceRings {
                frames,
                records,
                stamp_at,
            }) if !records.is_empty() => match self.read_rings(
                file,
                machine,
                ram,
                frames,
                &records,
                stamp_at,
                watch.clone(),
            ) {
                Ok(()) => return true,
                Err(e) => self.note(&format!("the record rings cannot be read: {e}")),
            },
            other => self.note(&format!("no record rings to read: {other:?}")),
        }
        // The frame ring alone: root drains its rings into it.
        let frames = match link.request(Request::TraceChannel {
            channel: TraceChannel::SharedRing,
        }) {
            Ok(Response::TraceRing { gpa, len }) => protocol::RingAt { gpa, len },
            other => {
                self.note(&format!("no shared trace ring: {other:?}"));
                return false;
            }
        };
        match self.read_rings(file, machine, ram, frames, &[], 0, watch) {
            Ok(()) => true,
            Err(e) => {
                self.note(&format!("the shared trace ring cannot be read: {e}"));
                false
            }
        }
    }

    /// Reads root's frame ring and every vCPU's record ring from the RAM
    /// file ([`TraceChannel::SharedRings`]): a thread takes, each time the
    /// doorbell rings or every [`RING_POLL`], the rings' marks, then the
    /// frames, then (while the stream is in records and no copy of the
    /// modules' symbols is on its way) the records up to the marks. With
    /// no record ring ([`TraceChannel::SharedRing`]: root drains its rings
    /// into the frame ring) it reads the frames alone, every
    /// [`FRAME_RING_POLL`].
    #[allow(clippy::too_many_arguments)]
    fn read_rings(
        self: &Arc<Self>,
        file: &std::fs::File,
        machine: crate::vm::shm::MachineType,
        ram: u64,
        frames: protocol::RingAt,
        records: &[protocol::RingAt],
        stamp_at: u32,
        watch: VmWatch,
    ) -> Result<(), String> {
        let map = crate::sys::SharedMap::map(file, ram as usize)
            .map_err(|e| format!("cannot map the guest's RAM file: {e}"))?;
        let place = |r: &protocol::RingAt| -> Result<(usize, usize), String> {
            let at = crate::vm::shm::file_offset(machine, ram, r.gpa)
                .filter(|&at| at.checked_add(r.len).is_some_and(|end| end <= ram))
                .ok_or_else(|| format!("the ring at {:#x} is not in the RAM file", r.gpa))?;
            map.ring(at as usize, r.len as usize, false)
                .map_err(|e| format!("no ring at {:#x}: {e:?}", r.gpa))?;
            Ok((at as usize, r.len as usize))
        };
        let frames_at = place(&frames)?;
        let records_at = records.iter().map(place).collect::<Result<Vec<_>, _>>()?;
        let trace = self.trace.clone();
        let start = self.start;
        let n = records_at.len();
        self.bulk.store(true, Ordering::Relaxed);
        self.rings_reader.store(n > 0, Ordering::Relaxed);
        self.channel_rings.store(n > 0, Ordering::Relaxed);
        let every = if n > 0 { RING_POLL } else { FRAME_RING_POLL };
        let sup = Arc::downgrade(self);
        self.frame_reader.store(true, Ordering::Relaxed);
        std::thread::spawn(move || {
            let note = |m: &str| note_at(start, m);
            let ring = |(at, len): (usize, usize)| map.ring(at, len, false);
            let Ok(frames) = ring(frames_at) else { return };
            let Ok(rings) = records_at
                .into_iter()
                .map(ring)
                .collect::<Result<Vec<_>, _>>()
            else {
                return;
            };
            let mut poll = crate::vm::shm::RingsPoll::new(frames, rings, stamp_at as usize);
            let mut rung = 0;
            let mut on = |ev: Event| trace.on_event(ev, &note);
            let failed = |why: String| {
                note(&format!("{why}; the rings are no longer read"));
                *trace.host_reads_lock() = false;
                if let Some(sup) = sup.upgrade() {
                    sup.give_up_rings();
                }
            };
            // The copy of the modules' symbols records wait for, and since
            // when; and since when they have waited without a break.
            let mut held: Option<(u32, Instant)> = None;
            let mut holding_since: Option<Instant> = None;
            loop {
                let ended = watch.ended().is_some();
                // The consumer's lock is held from the marks to the last
                // record taken: records are taken only against marks
                // taken while this process was the consumer.
                let mut consume = trace.host_reads_lock();
                let host = *consume;
                let mark = match poll.frames(host, &mut on) {
                    Ok(mark) => mark,
                    Err(e) => {
                        drop(consume);
                        return failed(format!("{e:#}"));
                    }
                };
                // Records naming a module's code wait for its symbols,
                // whose first piece came before them on the frame ring (2 s
                // a copy, 10 s in a row at most: a copy that never ends, or
                // a guest loading modules without pause, holds nothing for
                // good); and for a whole context after frames were lost.
                let coming = trace.symbols.get().and_then(|s| s.modules_coming());
                let now = Instant::now();
                let module_hold = match (coming, held) {
                    (None, _) => {
                        held = None;
                        false
                    }
                    (Some(id), Some((was, since))) if id == was => since + MODULES_HOLD > now,
                    (Some(id), _) => {
                        held = Some((id, now));
                        true
                    }
                };
                let hold = (module_hold || poll.waiting_for_context())
                    && *holding_since.get_or_insert(now) + HOLD_IN_A_ROW > now;
                if !(module_hold || poll.waiting_for_context()) {
                    holding_since = None;
                }
                if host && !hold {
                    if let Err(e) = poll.records(&mark, &mut on) {
                        *consume = false;
                        drop(consume);
                        return failed(format!("{e:#}"));
                    }
                }
                drop(consume);
                if ended {
                    return;
                }
                rung = trace.wait_doorbell(rung, every);
            }
        });
        self.note(&format!(
            "the trace stream takes a frame ring at {:#x} ({} bytes) and reads {n} record rings in the guest RAM file",
            frames.gpa, frames.len
        ));
        Ok(())
    }

    /// Logs the control channel's and the trace buffer's counters.
    pub(crate) fn log_counters(&self) {
        if let Some(link) = self.link.get() {
            let s = link.stats();
            self.note(&format!(
                "control channel: {} requests, {} raw segments forwarded, {} bytes out, {} bytes in, {} frames in, {} undecodable, {} stale answers, {} timeouts, {} events ({} event frames missing)",
                s.requests, s.forwarded, s.bytes_out, s.bytes_in, s.frames_in, s.bad_frames_in, s.stale, s.timeouts, s.events, s.event_gaps
            ));
        }
        if let Some(w) = self.trace_port.get() {
            let b = w.trace_port_stats();
            self.note(&format!(
                "log port: {} trace frames ({} bytes), {} undecodable, {} missing, {} unheard",
                b.frames, b.bytes, b.bad, b.missing, b.unheard
            ));
        }
        if let Some(line) = self.trace.symbols.get().and_then(|s| s.summary()) {
            self.note(&line);
        }
        if let Some(r) = self.trace.render_lock().as_ref() {
            let st = r.renderer.stats;
            self.note(&format!(
                "host rendering: {} records rendered, {} chunks out of place, {} probe definitions refused",
                st.records, st.bad_chunks, st.bad_specs
            ));
        }
        let t = self.trace.lock().stats();
        if t.lines + t.hv_lost > 0 {
            self.note(&format!(
                "trace buffer: {} lines ({} bytes) received, {} dropped (buffer full), {} events lost by the hypervisor",
                t.lines, t.bytes, t.dropped, t.hv_lost
            ));
        }
    }
}

/// Boots the VM, serves it until it ends, and returns its stop report.
/// `state` hears of each step (`booting`, `ready SECS`). A detached VM has
/// no time limit once the guest is up; otherwise the run's limit holds.
pub(crate) fn run_vm(
    sup: &Arc<Supervisor>,
    cfg: RunConfig,
    detached: bool,
    state: &dyn Fn(&str),
) -> Result<StopReport> {
    let mut vm = Vm::start(cfg)?;
    sup.note(&format!("emulator pid {}", vm.emulator_pid()));
    let control = vm.take_control()?;
    sup.attach(control.reader, control.writer, link::DEFAULT_TIMEOUT);
    let trace = sup.trace.clone();
    let start = sup.start;
    let symbols = Arc::new(HostSymbols::new(Some(vm.run_dir().join("kallsyms"))));
    let _ = sup.trace.symbols.set(symbols);
    vm.set_trace_sink(move |event| trace.on_event(event, &|message| note_at(start, message)));
    sup.set_phase(Phase::Booting);
    state("booting");
    vm.wait_ready()?;
    let ram = vm.ram_file();
    let ring =
        ram.is_some_and(|(file, machine, ram)| sup.use_ring(&file, machine, ram, vm.watch()));
    if !ring && vm.reads_log_port() {
        sup.use_log_port(vm.watch());
    }
    if detached {
        vm.clear_deadline();
    }
    let watch = vm.watch();
    let boot = vm.boot_time().unwrap_or_default();
    *sup.vm() = Some(vm);
    sup.set_phase(Phase::Ready);
    state(&format!("ready {:.1}", boot.as_secs_f64()));
    if detached {
        sup.note("serving the control socket");
    }

    let why = loop {
        if let Some(why) = watch.ended() {
            break why;
        }
        if let Some(why) = sup.link.get().and_then(HvLink::closed) {
            break format!("the control channel closed ({why})");
        }
        watch.wait(Duration::from_millis(500));
    };
    sup.note(&format!("the VM is ending: {why}"));
    // An exec in progress fails as soon as the guest stops; then the VM is ours.
    let vm = sup.vm().take();
    let Some(vm) = vm else {
        anyhow::bail!("{why}");
    };
    vm.wait_stop()
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::encode;
    use std::os::unix::net::UnixStream;

    use std::collections::BTreeMap;

    #[test]
    fn ending_from_a_report() {
        let report = StopReport {
            reason: "stopped by the host".into(),
            exit_counts: Some(BTreeMap::new()),
            hv_lines: vec![
                "guest started".into(),
                "exit counts: CPUID=1".into(),
                "exit counts: CPUID=2 PREEMPTION_TIMER=9".into(),
                "guest stopped: stopped by the host".into(),
                "powering off".into(),
            ],
            wall_time: Duration::from_secs(1),
            boot_time: None,
            emulator_status: None,
        };
        let end = Ending::from_report(&report);
        assert!(end.clean);
        assert_eq!(end.reason, "guest stopped: stopped by the host");
        assert_eq!(
            end.lines,
            [
                "exit counts: CPUID=2 PREEMPTION_TIMER=9",
                "guest stopped: stopped by the host"
            ]
        );
        let crash = StopReport {
            reason: "triple fault".into(),
            ..report
        };
        assert!(!Ending::from_report(&crash).clean);
    }

    #[test]
    fn long_exec_output_is_cut_into_frames() {
        let short = exec_reply("hello\n".into(), 3);
        assert!(short.events.is_empty());
        assert_eq!(
            short.response,
            Response::Exec {
                output: "hello\n".into(),
                status: 3
            }
        );

        // Multi-byte characters across the cut points.
        let long: String = "é-abc\n".repeat(2000);
        let reply = exec_reply(long.clone(), 0);
        assert!(reply.events.len() >= 4);
        let mut joined = String::new();
        for e in &reply.events {
            let Event::Log { text } = e else {
                panic!("{e:?}")
            };
            assert!(text.len() <= EXEC_CHUNK);
            joined.push_str(text);
        }
        let Response::Exec { output, status: 0 } = &reply.response else {
            panic!()
        };
        joined.push_str(output);
        assert_eq!(joined, long);
        // Every frame fits.
        for e in reply.events {
            encode(&Frame::event(0, e), &mut Vec::new()).unwrap();
        }
        encode(&Frame::response(1, reply.response), &mut Vec::new()).unwrap();
    }

    use protocol::io::{FrameReader, FrameWriter};

    use protocol::{Body, TraceFormat};

    /// A fake hypervisor behind a supervisor in the `Ready` phase: it
    /// answers `TraceStart` with `Ok` and everything else with `Pong`, and
    /// records the requests. The writer sends it events.
    struct FakeHv {
        sup: Arc<Supervisor>,
        writer: Arc<Mutex<FrameWriter<UnixStream>>>,
        requests: Arc<Mutex<Vec<Request>>>,
        event_seq: u32,
    }

    impl FakeHv {
        fn new() -> FakeHv {
            FakeHv::answering(|_| None)
        }

        /// A fake hypervisor whose answers come from `answer` first.
        fn answering(answer: impl Fn(&Request) -> Option<Response> + Send + 'static) -> FakeHv {
            let (ours, theirs) = UnixStream::pair().unwrap();
            let sup = Arc::new(Supervisor::new());
            sup.attach(ours.try_clone().unwrap(), ours, Duration::from_secs(5));
            sup.set_phase(Phase::Ready);
            let writer = Arc::new(Mutex::new(FrameWriter::new(theirs.try_clone().unwrap())));
            let requests = Arc::new(Mutex::new(Vec::new()));
            let (w, seen) = (writer.clone(), requests.clone());
            std::thread::spawn(move || {
                let mut r = FrameReader::new(theirs);
                while let Ok(frame) = r.read_frame() {
                    let Body::Request(request) = frame.body else {
                        continue;
                    };
                    let answer = answer(&request).unwrap_or(match &request {
                        Request::TraceStart { .. } | Request::TraceStop => Response::Ok,
                        _ => Response::Pong { nonce: 0 },
                    });
                    seen.lock().unwrap().push(request);
                    if w.lock()
                        .unwrap()
                        .write_frame(&Frame::response(frame.seq, answer))
                        .is_err()
                    {
                        return;
                    }
                }
            });
            FakeHv {
                sup,
                writer,
                requests,
                event_seq: 0,
            }
        }

        fn send(&mut self, event: Event) {
            self.event_seq += 1;
            self.writer
                .lock()
                .unwrap()
                .write_frame(&Frame::event(self.event_seq, event))
                .unwrap();
        }

        fn text(&mut self, format: TraceFormat, lost: u64, text: &str) {
            self.text_from(format, 0, lost, text);
        }

        fn text_from(&mut self, format: TraceFormat, source: u32, lost: u64, text: &str) {
            self.send(Event::TraceText {
                format,
                source,
                lost,
                text: text.to_string(),
            });
        }

        /// Waits until the buffer holds `n` entries.
        fn wait_entries(&self, n: u64) {
            let until = Instant::now() + Duration::from_secs(5);
            while self.sup.trace.lock().end() < n && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert_eq!(self.sup.trace.lock().end(), n);
        }

        fn read(&self, cursor: u64, format: TraceFormat, wait_ms: u32) -> (u64, String, u64) {
            self.read_source(cursor, format, None, wait_ms)
        }

        fn read_source(
            &self,
            cursor: u64,
            format: TraceFormat,
            source: Option<u32>,
            wait_ms: u32,
        ) -> (u64, String, u64) {
            let request = Request::TraceRead {
                cursor,
                format,
                wait_ms,
                source,
            };
            match self.sup.serve(request).response {
                Response::Trace { next, text, lost } => (next, text, lost),
                other => panic!("{other:?}"),
            }
        }

        fn starts(&self) -> Vec<Request> {
            self.requests
                .lock()
                .unwrap()
                .iter()
                .filter(|r| matches!(r, Request::TraceStart { .. }))
                .cloned()
                .collect()
        }
    }

    #[test]
    fn trace_read_starts_the_stream_once_and_reads_the_buffer() {
        let mut hv = FakeHv::new();
        // Nothing yet: the read starts the stream and waits in vain.
        let (next, text, lost) = hv.read(0, TraceFormat::Text, 50);
        assert_eq!((next, text.as_str(), lost), (0, "", 0));
        assert_eq!(
            hv.starts(),
            [Request::TraceStart {
                format: TraceFormat::Text
            }]
        );
        hv.text(TraceFormat::Text, 0, "one\ntwo\n");
        let (next, text, lost) = hv.read(0, TraceFormat::Text, 5000);
        assert_eq!((next, text.as_str(), lost), (2, "one\ntwo\n", 0));
        // Losses reported by the hypervisor, with the lines after them.
        hv.text(TraceFormat::Text, 3, "three\n");
        hv.send(Event::Lost { count: 2 });
        let until = Instant::now() + Duration::from_secs(5);
        while hv.sup.trace.lock().end() < 5 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let (next, text, lost) = hv.read(next, TraceFormat::Text, 1000);
        assert_eq!((next, text.as_str(), lost), (5, "three\n", 5));
        // The stream was started once.
        assert_eq!(hv.starts().len(), 1);
        // Another format switches the stream; the text lines are skipped.
        hv.read(5, TraceFormat::Json, 0);
        assert_eq!(
            hv.starts().last(),
            Some(&Request::TraceStart {
                format: TraceFormat::Json
            })
        );
        hv.text(TraceFormat::Json, 0, "{\"a\":1}\n");
        let (next, text, lost) = hv.read(5, TraceFormat::Json, 5000);
        assert_eq!((next, text.as_str(), lost), (6, "{\"a\":1}\n", 0));
    }

    #[test]
    fn a_waiting_read_returns_when_a_line_arrives() {
        let hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        let start = Instant::now();
        let (next, text, _) = std::thread::scope(|s| {
            let reader = s.spawn(|| hv.read(0, TraceFormat::Text, 20_000));
            std::thread::sleep(Duration::from_millis(100));
            let line = Event::TraceText {
                format: TraceFormat::Text,
                source: 0,
                lost: 0,
                text: "late\n".into(),
            };
            let frame = Frame::event(1, line);
            hv.writer.lock().unwrap().write_frame(&frame).unwrap();
            reader.join().unwrap()
        });
        assert_eq!((next, text.as_str()), (1, "late\n"));
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_loss_alone_waits_for_the_next_line() {
        let mut hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        hv.send(Event::Lost { count: 4 });
        let until = Instant::now() + Duration::from_secs(5);
        while hv.sup.trace.lock().end() < 1 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        // The wait runs out: the loss is reported without text.
        let start = Instant::now();
        assert_eq!(hv.read(0, TraceFormat::Text, 300), (1, String::new(), 4));
        assert!(start.elapsed() >= Duration::from_millis(250));
        // A line arriving meanwhile comes with it.
        let (next, text, lost) = std::thread::scope(|s| {
            let reader = s.spawn(|| hv.read(0, TraceFormat::Text, 20_000));
            std::thread::sleep(Duration::from_millis(100));
            let line = Event::TraceText {
                format: TraceFormat::Text,
                source: 0,
                lost: 0,
                text: "after\n".into(),
            };
            hv.writer
                .lock()
                .unwrap()
                .write_frame(&Frame::event(2, line))
                .unwrap();
            reader.join().unwrap()
        });
        assert_eq!((next, text.as_str(), lost), (2, "after\n", 4));
    }

    #[test]
    fn reads_keep_to_their_source() {
        let mut hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        hv.text_from(TraceFormat::Text, 0, 0, "p1\n");
        hv.text_from(TraceFormat::Text, 2, 0, "g1\ng2\n");
        hv.text_from(TraceFormat::Text, 0, 0, "p2\n");
        hv.wait_entries(4);
        let graph = hv.read_source(0, TraceFormat::Text, Some(2), 1000);
        assert_eq!(graph, (4, "g1\ng2\n".to_string(), 0));
        let probes = hv.read_source(0, TraceFormat::Text, Some(0), 1000);
        assert_eq!(probes, (4, "p1\np2\n".to_string(), 0));
        let all = hv.read_source(0, TraceFormat::Text, None, 1000);
        assert_eq!(all, (4, "p1\ng1\ng2\np2\n".to_string(), 0));
        // A loss from the hypervisor reaches every reader.
        hv.text_from(TraceFormat::Text, 0, 3, "p3\n");
        hv.wait_entries(6);
        let graph = hv.read_source(4, TraceFormat::Text, Some(2), 0);
        assert_eq!(graph, (6, String::new(), 3));
    }

    #[test]
    fn a_waiting_read_is_not_woken_by_other_sources() {
        let hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        let (next, text, lost) = std::thread::scope(|s| {
            let reader = s.spawn(|| hv.read_source(0, TraceFormat::Text, Some(1), 20_000));
            let mut seq = 10;
            let mut send = |source: u32, text: &str| {
                seq += 1;
                let line = Event::TraceText {
                    format: TraceFormat::Text,
                    source,
                    lost: 0,
                    text: text.into(),
                };
                hv.writer
                    .lock()
                    .unwrap()
                    .write_frame(&Frame::event(seq, line))
                    .unwrap();
            };
            std::thread::sleep(Duration::from_millis(100));
            send(0, "probe\n");
            send(2, "other graph\n");
            std::thread::sleep(Duration::from_millis(300));
            // Still waiting: those lines were not its own.
            assert!(!reader.is_finished());
            send(1, "mine\n");
            reader.join().unwrap()
        });
        assert_eq!((next, text.as_str(), lost), (3, "mine\n", 0));
    }

    #[test]
    fn after_the_end_reads_keep_to_their_source() {
        let mut hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        hv.text_from(TraceFormat::Text, 1, 0, "g\n");
        hv.text_from(TraceFormat::Text, 0, 0, "p\n");
        hv.wait_entries(2);
        hv.sup.set_phase(Phase::Ended(Ending {
            reason: "guest stopped: power off".into(),
            clean: true,
            lines: vec![],
        }));
        assert_eq!(
            hv.read_source(0, TraceFormat::Text, Some(0), 0),
            (2, "p\n".to_string(), 0)
        );
        assert_eq!(
            hv.read_source(0, TraceFormat::Text, Some(1), 0),
            (2, "g\n".to_string(), 0)
        );
        // Only another source's line after it: the end.
        let reply = hv.sup.serve(Request::TraceRead {
            cursor: 1,
            format: TraceFormat::Text,
            wait_ms: 0,
            source: Some(1),
        });
        assert_eq!(
            reply.response,
            Response::error(
                ErrorKind::NotReady,
                "the VM has ended (guest stopped: power off)"
            )
        );
    }

    #[test]
    fn trace_start_and_stop_are_forwarded_and_noted() {
        let hv = FakeHv::new();
        let start = Request::TraceStart {
            format: TraceFormat::Json,
        };
        assert_eq!(hv.sup.serve(start).response, Response::Ok);
        assert_eq!(*hv.sup.stream.lock().unwrap(), Some(TraceFormat::Json));
        // A read in the same format does not start it again.
        hv.read(0, TraceFormat::Json, 0);
        assert_eq!(hv.starts().len(), 1);
        assert_eq!(hv.sup.serve(Request::TraceStop).response, Response::Ok);
        assert_eq!(*hv.sup.stream.lock().unwrap(), None);
        hv.read(0, TraceFormat::Json, 0);
        assert_eq!(hv.starts().len(), 2);
    }

    #[test]
    fn after_the_end_the_buffer_is_read_out_then_the_end_reported() {
        let mut hv = FakeHv::new();
        hv.read(0, TraceFormat::Text, 0);
        hv.text(TraceFormat::Text, 0, "last\n");
        let until = Instant::now() + Duration::from_secs(5);
        while hv.sup.trace.lock().end() < 1 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        hv.sup.set_phase(Phase::Ended(Ending {
            reason: "guest stopped: stopped by the host".into(),
            clean: true,
            lines: vec![],
        }));
        let (next, text, _) = hv.read(0, TraceFormat::Text, 10_000);
        assert_eq!((next, text.as_str()), (1, "last\n"));
        let reply = hv.sup.serve(Request::TraceRead {
            cursor: next,
            format: TraceFormat::Text,
            wait_ms: 10_000,
            source: None,
        });
        assert_eq!(
            reply.response,
            Response::error(
                ErrorKind::NotReady,
                "the VM has ended (guest stopped: stopped by the host)"
            )
        );
        // Nothing else is forwarded once the VM has ended.
        let before = hv.requests.lock().unwrap().len();
        hv.sup.serve(Request::Ping { nonce: 1 });
        assert_eq!(hv.requests.lock().unwrap().len(), before);
    }

    #[test]
    fn requests_before_the_vm_runs_get_a_clear_answer() {
        let sup = Supervisor::new();
        let reply = sup.serve(Request::Status);
        assert!(matches!(
            reply.response,
            Response::Error {
                kind: ErrorKind::NotReady,
                ..
            }
        ));
        let reply = sup.serve(Request::Exec {
            command: "true".into(),
        });
        assert!(
            matches!(&reply.response, Response::Error { kind: ErrorKind::NotReady, message } if message.contains("not up yet"))
        );
        sup.set_phase(Phase::Ended(Ending {
            reason: "guest stopped: power off".into(),
            clean: true,
            lines: vec![],
        }));
        let reply = sup.serve(Request::Ping { nonce: 1 });
        assert_eq!(
            reply.response,
            Response::error(
                ErrorKind::NotReady,
                "the VM has ended (guest stopped: power off)"
            )
        );
    }

    /// Under QEMU's shared RAM file: the supervisor reads root's frame ring
    /// and every vCPU's record ring, renders two vCPUs' records merged by
    /// time with the symbols root sent on the frame ring, and gives the
    /// rings back to root at a channel change (no record is taken after
    /// it); a client's `SharedRings` is passed on only while this process
    /// reads the rings.
    #[test]
    fn the_supervisor_reads_the_vcpus_rings_and_gives_them_back() {
        use crate::sys::SharedMap;
        use protocol::{RenderContext, RingAt, SymbolsPart};
        use tracelang::kprobe::{EventHeader, RawEvent};
        const RAM: usize = 2 << 20;
        const LEN: u64 = 64 + 64 * 1024;
        let (frames_at, ring_at) = (0x1000u64, [0x40000u64, 0x80000]);
        let (dir, file) = crate::vm::shm::tests::shared_file("suprings", RAM);
        // Root's side: the rings formatted where it says they are.
        let root = Arc::new(SharedMap::map(&file, RAM).unwrap());
        root.ring(frames_at as usize, LEN as usize, true).unwrap();
        for at in ring_at {
            root.ring(at as usize, LEN as usize, true).unwrap();
        }
        let (idx, packed) = crate::daemon::symbols::tests::packed();
        let frame_seq = Arc::new(AtomicU32::new(0));
        // Root writes frames on its frame ring, as its turns do.
        let put_frame = {
            let (root, seq) = (root.clone(), frame_seq.clone());
            move |event: Event| {
                let frames = root.ring(frames_at as usize, LEN as usize, false).unwrap();
                let mut wire = Vec::new();
                let n = seq.fetch_add(1, Ordering::Relaxed);
                encode(&Frame::event(n, event), &mut wire).unwrap();
                assert!(frames.push(&wire));
            }
        };
        let symbols = idx.len() as u32;
        let func = idx
            .iter()
            .find(|s| s.kind.letter().eq_ignore_ascii_case(&'t'))
            .unwrap();
        let (func_at, name) = (func.addr.0, idx.name(func.id).to_string());
        let answer = {
            let put_frame = put_frame.clone();
            let packed = packed.clone();
            move |r: &Request| match r {
                Request::TraceChannel {
                    channel: TraceChannel::SharedRings,
                } => Some(Response::TraceRings {
                    frames: RingAt {
                        gpa: frames_at,
                        len: LEN,
                    },
                    records: ring_at
                        .iter()
                        .map(|&gpa| RingAt { gpa, len: LEN })
                        .collect(),
                    stamp_at: tracelang::kprobe::TIMESTAMP_AT as u32,
                }),
                Request::TraceChannel {
                    channel: TraceChannel::SharedRing,
                } => Some(Response::TraceRing {
                    gpa: frames_at,
                    len: LEN,
                }),
                Request::TraceChannel { .. } => Some(Response::Ok),
                // Root sends the context in the turn that starts the
                // stream, before any record can need it.
                Request::TraceStart {
                    format: TraceFormat::Records,
                } => {
                    put_frame(Event::TraceContext(RenderContext::Begin));
                    put_frame(Event::TraceContext(RenderContext::Probe {
                        id: 1,
                        spec: format!("p:kprobes/hit {name}"),
                    }));
                    put_frame(Event::TraceContext(RenderContext::End));
                    Some(Response::Ok)
                }
                Request::SymbolsExport => {
                    for (k, piece) in packed.chunks(3000).enumerate() {
                        put_frame(Event::SymbolChunk {
                            id: 1,
                            part: SymbolsPart::Kernel,
                            total: packed.len() as u64,
                            offset: (k * 3000) as u64,
                            data: piece.to_vec(),
                        });
                    }
                    put_frame(Event::SymbolChunk {
                        id: 2,
                        part: SymbolsPart::Modules,
                        total: 0,
                        offset: 0,
                        data: Vec::new(),
                    });
                    Some(Response::SymbolsExport {
                        id: 1,
                        bytes: packed.len() as u64,
                        symbols,
                    })
                }
                _ => None,
            }
        };
        let hv = FakeHv::answering(answer);
        let _ = hv.sup.trace.symbols.set(Arc::new(HostSymbols::new(None)));
        assert!(hv.sup.use_ring(
            &file,
            crate::vm::shm::MachineType::Pc,
            RAM as u64,
            VmWatch::detached()
        ));
        // Records of two vCPUs, out of time order between the rings,
        // written before the stream starts: nobody takes them yet.
        let record = |cpu: u32, pid: i32, ts: u64| {
            let mut comm = [0u8; 16];
            comm[..4].copy_from_slice(b"task");
            RawEvent {
                header: EventHeader {
                    probe_id: 1,
                    cpu,
                    pid,
                    timestamp_ns: ts,
                    ip: func_at,
                    ret_ip: 0,
                    comm,
                },
                values: Vec::new(),
            }
            .encode()
        };
        let rings: Vec<_> = ring_at
            .iter()
            .map(|&at| root.ring(at as usize, LEN as usize, false).unwrap())
            .collect();
        // Whether the host empties `ring` within 10 s.
        let emptied = |ring: &protocol::ring::Ring| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !ring.is_empty() && Instant::now() < deadline {
                std::thread::sleep(RING_POLL);
            }
            ring.is_empty()
        };
        for (cpu, pid, ts) in [
            (1, 11, 2_000),
            (1, 12, 4_000),
            (0, 13, 3_000),
            (0, 14, 1_000),
        ] {
            assert!(rings[cpu as usize].push(&record(cpu, pid, ts)));
        }
        std::thread::sleep(RING_POLL * 3);
        assert!(
            rings.iter().all(|r| !r.is_empty()),
            "not taken before the stream"
        );
        assert_eq!(
            hv.sup
                .serve(Request::TraceStart {
                    format: TraceFormat::Text
                })
                .response,
            Response::Ok
        );
        assert!(
            *hv.sup.trace.host_reads_lock(),
            "the host takes the records"
        );
        let mut text = String::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while text.lines().count() < 4 && Instant::now() < deadline {
            let chunk = hv.sup.trace.wait_read(
                0,
                TraceFormat::Text,
                None,
                Duration::from_millis(200),
                &|| false,
            );
            text = chunk.text;
        }
        let pids: Vec<&str> = text
            .lines()
            .map(|l| l.split_whitespace().next().unwrap_or(""))
            .collect();
        // Ring 1 holds 2,000 and 4,000, ring 0 3,000 then 1,000: one take
        // merges by time what each ring holds in its own order.
        assert_eq!(pids, ["task-11", "task-13", "task-14", "task-12"], "{text}");
        assert_eq!(text.matches("hit: (").count(), 4, "{text}");
        assert_eq!(text.matches("+0x0/").count(), 4, "{text}");
        assert!(rings.iter().all(|r| r.is_empty()), "the host took them");
        // A module's load: the first piece of the new modules' copy comes
        // on the frame ring before its code's records, which wait for the
        // copy to be whole.
        let copy = crate::daemon::symbols::tests::modules(&["m1", "m2"])
            .pack()
            .unwrap();
        let piece = |offset: usize, data: &[u8]| Event::SymbolChunk {
            id: 3,
            part: SymbolsPart::Modules,
            total: copy.len() as u64,
            offset: offset as u64,
            data: data.to_vec(),
        };
        put_frame(piece(0, &copy[..8]));
        assert!(rings[1].push(&record(1, 16, 4_500)));
        std::thread::sleep(RING_POLL * 5);
        assert!(!rings[1].is_empty(), "held while the modules' copy comes");
        put_frame(piece(8, &copy[8..]));
        assert!(emptied(&rings[1]), "taken once the copy is whole");
        // A channel change gives the rings back: records stay for root
        // (which drains them into the frame ring with `SharedRing`).
        assert!(matches!(
            hv.sup
                .serve(Request::TraceChannel {
                    channel: TraceChannel::SharedRing
                })
                .response,
            Response::TraceRing { .. }
        ));
        assert!(!*hv.sup.trace.host_reads_lock());
        assert!(rings[0].push(&record(0, 15, 5_000)));
        std::thread::sleep(RING_POLL * 5);
        assert!(!rings[0].is_empty(), "no record taken once root drains");
        // SharedRings again: passed on, and the host reads again.
        assert!(matches!(
            hv.sup
                .serve(Request::TraceChannel {
                    channel: TraceChannel::SharedRings
                })
                .response,
            Response::TraceRings { .. }
        ));
        assert!(emptied(&rings[0]), "the host reads the rings again");
        assert!(hv.requests.lock().unwrap().contains(&Request::TraceStart {
            format: TraceFormat::Records
        }));
        // A supervisor that reads no rings does not pass SharedRings on.
        let plain = FakeHv::new();
        let r = plain
            .sup
            .serve(Request::TraceChannel {
                channel: TraceChannel::SharedRings,
            })
            .response;
        assert!(
            matches!(
                r,
                Response::Error {
                    kind: ErrorKind::Unsupported,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(plain.requests.lock().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
