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
//! - every other request is forwarded to the hypervisor, one at a time
//!   ([`HvLink`]), under the supervisor's own sequence numbers; the answer
//!   goes back under the client's;
//! - frames of another protocol version and bytes that are not frames are
//!   forwarded as they are ([`crate::session`]).
//!
//! Clients come and go as they like; a client that leaves in the middle of
//! a frame or of a request harms nobody. When the VM ends (the guest stops,
//! the emulator exits), waiting clients get an error saying so, the socket
//! is removed and the supervisor exits.
//!
//! The run directory holds a `state` file (`starting`, `booting`, `ready`,
//! `ended: ...`, `failed: ...`) that `run --detach` polls.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use protocol::{encode, ErrorKind, Event, Frame, Request, Response};

use crate::cli::SuperviseArgs;
use crate::link::{self, HvLink, LinkError};
use crate::session::{Backend, Reply, Session};
use crate::socket::ClaimedSocket;
use crate::vm::{StopReport, Vm};

/// The supervisor's log, in the run directory.
pub const LOG_FILE: &str = "supervisor.log";
/// The state file, in the run directory.
pub const STATE_FILE: &str = "state";
/// The longest a guest command may run.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a stop may take from the hypervisor's acknowledgement to the
/// emulator's end.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// Output bytes per frame of an `Exec` answer: a frame carries at most
/// [`protocol::MAX_FRAME`] bytes, so longer output goes ahead of the
/// response as `Log` events of this size (see [`exec_reply`]).
pub const EXEC_CHUNK: usize = 3072;
/// At most this many clients at once; more are turned away.
pub const MAX_CLIENTS: usize = 32;
/// How long, once the VM has ended, the answers in progress get to go out.
const END_GRACE: Duration = Duration::from_secs(10);
/// A client that does not read its answers for this long is dropped.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
enum Phase {
    /// Building the boot image and starting the emulator.
    Starting,
    /// The emulator runs; the guest shell is not up yet.
    Booting,
    /// The guest shell answers.
    Ready,
    /// Over.
    Ended(Ending),
}

/// The state the client threads share.
struct Supervisor {
    phase: Mutex<Phase>,
    phase_cv: Condvar,
    vm: Mutex<Option<Vm>>,
    link: OnceLock<HvLink>,
    events: AtomicU32,
    /// Chunks of client input being handled (requests being answered).
    busy: AtomicUsize,
    clients: AtomicUsize,
    client_ids: AtomicU32,
    start: Instant,
}

impl Supervisor {
    fn new() -> Supervisor {
        Supervisor {
            phase: Mutex::new(Phase::Starting),
            phase_cv: Condvar::new(),
            vm: Mutex::new(None),
            link: OnceLock::new(),
            events: AtomicU32::new(0),
            busy: AtomicUsize::new(0),
            clients: AtomicUsize::new(0),
            client_ids: AtomicU32::new(1),
            start: Instant::now(),
        }
    }

    fn note(&self, message: &str) {
        eprintln!("[{:7.1}s] {message}", self.start.elapsed().as_secs_f64());
    }

    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_phase(&self, phase: Phase) {
        *self.phase() = phase;
        self.phase_cv.notify_all();
    }

    fn ending(&self) -> Option<Ending> {
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

    fn vm(&self) -> MutexGuard<'_, Option<Vm>> {
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
        if *self.phase() != Phase::Ready {
            return Response::error(
                ErrorKind::NotReady,
                "the guest shell is not up yet (the VM is booting)",
            )
            .into();
        }
        let mut vm = self.vm();
        let Some(vm) = vm.as_mut() else {
            return self.ended_response().into();
        };
        // A subshell: `exit` in a command must not end the console's shell
        // (whose end powers the guest off). `eval` keeps a trailing comment
        // from swallowing the parenthesis.
        let wrapped = format!("( eval {} )", crate::console::sh_quote(command));
        match vm.exec_timeout(&wrapped, EXEC_TIMEOUT) {
            Ok(result) => exec_reply(result.output, result.rc),
            Err(e) => {
                if let Some(end) = vm.watch().ended() {
                    return Response::error(
                        ErrorKind::NotReady,
                        format!("the VM has ended ({end})"),
                    )
                    .into();
                }
                let message = format!("{e:#}");
                let kind = if message.contains("too long") {
                    ErrorKind::InvalidArgument
                } else {
                    ErrorKind::Internal
                };
                Response::error(kind, format!("exec failed: {message}")).into()
            }
        }
    }

    fn stop(&self) -> Reply {
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

    fn ended_response(&self) -> Response {
        match self.wait_ending(Duration::from_secs(5)) {
            Some(end) => Response::error(ErrorKind::NotReady, ended_message(&end)),
            None => Response::error(ErrorKind::NotReady, "the VM is ending"),
        }
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

fn ended_message(end: &Ending) -> String {
    format!("the VM has ended ({})", end.reason)
}

impl Backend for Supervisor {
    fn serve(&self, request: Request) -> Reply {
        if let Some(end) = self.ending() {
            return Response::error(ErrorKind::NotReady, ended_message(&end)).into();
        }
        match request {
            Request::Exec { command } => self.exec(&command),
            Request::Stop => self.stop(),
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

/// Counts a chunk of client input as in progress while it lives.
struct Busy<'a>(&'a AtomicUsize);

impl<'a> Busy<'a> {
    fn new(counter: &'a AtomicUsize) -> Busy<'a> {
        counter.fetch_add(1, Ordering::SeqCst);
        Busy(counter)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one client until it disconnects.
fn serve_client(sup: Arc<Supervisor>, stream: UnixStream) {
    let id = sup.client_ids.fetch_add(1, Ordering::Relaxed);
    let mut reader = &stream;
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            sup.note(&format!("client {id}: cannot use its socket: {e}"));
            return;
        }
    };
    let _ = writer.set_write_timeout(Some(CLIENT_WRITE_TIMEOUT));
    let mut session = Session::new();
    let mut buf = [0u8; 4096];
    let mut wire = Vec::new();
    let mut send = |frame: &Frame| -> bool {
        wire.clear();
        if let Err(e) = encode(frame, &mut wire) {
            // An answer that cannot be encoded (too long for one frame)
            // still gets an answer under its sequence number.
            wire.clear();
            let error =
                Response::error(ErrorKind::Internal, format!("cannot send the answer: {e}"));
            if encode(&Frame::response(frame.seq, error), &mut wire).is_err() {
                return true;
            }
        }
        writer.write_all(&wire).and_then(|_| writer.flush()).is_ok()
    };
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let _busy = Busy::new(&sup.busy);
        if !session.on_bytes(&buf[..n], &*sup, &mut send) {
            break;
        }
    }
    {
        let _busy = Busy::new(&sup.busy);
        session.on_eof(&*sup);
    }
    let s = session.stats();
    if s.wrong_version + s.garbage + s.not_requests > 0 {
        sup.note(&format!(
            "client {id} left: {} requests, {} of another protocol version, {} not requests, {} garbage segments ({} bytes) forwarded",
            s.requests, s.wrong_version, s.not_requests, s.garbage, s.garbage_bytes
        ));
    }
    sup.clients.fetch_sub(1, Ordering::SeqCst);
}

/// Accepts clients for as long as the process lives.
fn accept_clients(sup: Arc<Supervisor>, listener: std::os::unix::net::UnixListener) {
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    sup.note(&format!("accepting a client failed: {e}"));
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if sup.clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                sup.clients.fetch_sub(1, Ordering::SeqCst);
                sup.note(&format!(
                    "more than {MAX_CLIENTS} clients; turning one away"
                ));
                continue;
            }
            let sup = sup.clone();
            std::thread::spawn(move || serve_client(sup, stream));
        }
    });
}

/// Writes the state file (atomically: a reader sees the old or the new text).
pub fn write_state(dir: &Path, state: &str) {
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    if std::fs::write(&tmp, format!("{state}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(STATE_FILE));
    }
}

/// Reads the state file, if there is one.
pub fn read_state(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(STATE_FILE)).ok()?;
    Some(text.trim().to_string())
}

/// Runs the supervisor (the hidden `supervise` subcommand); returns the
/// process exit code once the VM has ended.
pub fn supervise(socket_path: &Path, args: &SuperviseArgs) -> Result<u8> {
    let dir: PathBuf = args.run_dir.clone();
    let sup = Arc::new(Supervisor::new());
    let socket = match ClaimedSocket::claim(socket_path) {
        Ok(s) => s,
        Err(e) => {
            write_state(&dir, &format!("failed: {e:#}"));
            return Err(e);
        }
    };
    sup.note(&format!(
        "supervisor pid {}; control socket {}",
        std::process::id(),
        socket.path().display()
    ));
    write_state(&dir, "starting");
    let listener = socket
        .listener()
        .try_clone()
        .context("cannot use the control socket")?;
    accept_clients(sup.clone(), listener);

    let result = run_vm(&sup, &dir, args);
    let ending = match &result {
        Ok(ending) => ending.clone(),
        Err(e) => Ending {
            reason: format!("{e:#}"),
            clean: false,
            lines: Vec::new(),
        },
    };
    sup.set_phase(Phase::Ended(ending.clone()));
    write_state(
        &dir,
        &format!(
            "{}: {}",
            if ending.clean { "ended" } else { "failed" },
            ending.reason
        ),
    );
    // New clients find no VM; the answers in progress get a moment.
    socket.remove();
    let until = Instant::now() + END_GRACE;
    while sup.busy.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(link) = sup.link.get() {
        let s = link.stats();
        sup.note(&format!(
            "control channel: {} requests, {} raw segments forwarded, {} bytes out, {} bytes in, {} frames in, {} undecodable, {} stale answers, {} timeouts",
            s.requests, s.forwarded, s.bytes_out, s.bytes_in, s.frames_in, s.bad_frames_in, s.stale, s.timeouts
        ));
    }
    sup.note(&format!("the VM has ended: {}", ending.reason));
    match result {
        Ok(ending) if ending.clean => Ok(0),
        Ok(ending) => anyhow::bail!("the VM has ended: {}", ending.reason),
        // The error as it is: `run --detach` shows it to the user.
        Err(e) => Err(e),
    }
}

/// Boots the VM, serves it until it ends, and says how it ended.
fn run_vm(sup: &Arc<Supervisor>, dir: &Path, args: &SuperviseArgs) -> Result<Ending> {
    let mut cfg = crate::run::resolve(&args.run)?;
    cfg.run_dir = Some(dir.to_path_buf());
    cfg.progress = true;
    cfg.echo_boot_console = false;
    let mut vm = Vm::start(cfg)?;
    sup.note(&format!("emulator pid {}", vm.emulator_pid()));
    let control = vm
        .take_control()
        .context("the emulator did not connect the control channel")?;
    let reader = control
        .try_clone()
        .context("cannot clone the control channel socket")?;
    let reader = crate::sys::QuickAckReader(reader);
    let _ = sup
        .link
        .set(HvLink::start(reader, control, link::DEFAULT_TIMEOUT));
    sup.set_phase(Phase::Booting);
    write_state(dir, "booting");
    vm.wait_ready()?;
    vm.clear_deadline();
    let watch = vm.watch();
    let boot = vm.boot_time().unwrap_or_default();
    *sup.vm() = Some(vm);
    sup.set_phase(Phase::Ready);
    write_state(dir, &format!("ready {:.1}", boot.as_secs_f64()));
    sup.note("serving the control socket");

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
    let report = vm.wait_stop()?;
    Ok(Ending::from_report(&report))
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn state_file_round_trip() {
        let dir = std::env::temp_dir().join(format!("hvtrace-state-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(read_state(&dir), None);
        write_state(&dir, "booting");
        assert_eq!(read_state(&dir).as_deref(), Some("booting"));
        write_state(&dir, "ready 10.5");
        assert_eq!(read_state(&dir).as_deref(), Some("ready 10.5"));
        let _ = std::fs::remove_dir_all(&dir);
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
}
