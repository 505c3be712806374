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
//! - `TraceRead` is served here, from the trace buffer
//!   ([`TraceBuffer`](crate::daemon::tracebuf::TraceBuffer)),
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
//! This module is the supervisor's core: its phases, the answers to each
//! request, and the VM's life (`run_vm`). The trace stream's requests are
//! in `stream`, the hypervisor's events and the trace buffer they fill in
//! `events`, and the stream's own paths (the log port, the rings in guest
//! RAM) in `rings`. The daemon around it, the socket,
//! its client threads and the run directory's `state` file (`starting`,
//! `booting`, `ready`, `ended: ...`, `failed: ...`, which `run --detach`
//! polls), is [`crate::daemon::serve`].
//!
//! [`crate::daemon::local::LocalVm`] runs the same supervisor inside the
//! calling process, without a socket, for `hvtrace run` with tracing
//! options: the caller is its only client and calls it directly.

mod events;
mod rings;
mod stream;
#[cfg(test)]
mod tests;

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use protocol::{ErrorKind, Event, Frame, Request, Response, TraceFormat};

use self::events::TraceShared;
use crate::daemon::link::{self, HvLink, LinkError};
use crate::daemon::owners::GraphOwners;
use crate::daemon::session::{Backend, Reply};
use crate::daemon::symbols::HostSymbols;
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
        crate::term::sanitize(message)
    );
}

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
            trace: Arc::new(TraceShared::new().with_recording(&|m| note_at(start, m))),
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
/// boundaries), and the response carries the rest; the client
/// (`Client::call`) puts the pieces together again.
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
            Request::Kallsyms { offset } => self.kallsyms(offset).into(),
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
