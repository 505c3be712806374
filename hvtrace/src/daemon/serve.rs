//! The supervisor as a daemon (`hvtrace run --detach`, the hidden
//! `supervise` subcommand): its control socket, its clients (one thread
//! each, refused past a limit or when not the owner), and the state file
//! that `run --detach` polls.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use protocol::{encode, ErrorKind, Frame, Response};

use crate::daemon::owners::ClientBackend;
use crate::daemon::session::Session;
use crate::daemon::socket::ClaimedSocket;
use crate::daemon::supervisor::{run_vm, Ending, Phase, Supervisor, END_GRACE};
use crate::vm::config::RunConfig;

/// The supervisor's log, in the run directory.
pub const LOG_FILE: &str = "supervisor.log";

/// The state file, in the run directory.
pub const STATE_FILE: &str = "state";

/// At most this many clients at once; more are turned away.
pub const MAX_CLIENTS: usize = 32;

/// A client that does not read its answers for this long is dropped.
const CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

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
    // The supervisor as this connection sees it: the graph sessions it
    // starts are its own ([`crate::daemon::owners`]).
    let conn = ClientBackend::new(&*sup, &sup.graphs, id);
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
        if !session.on_bytes(&buf[..n], &conn, &mut send) {
            break;
        }
    }
    {
        let _busy = Busy::new(&sup.busy);
        session.on_eof(&conn);
        // The graph sessions it started and left running end with it.
        if let Some(line) = conn.close() {
            sup.note(&line);
        }
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

/// Accepts clients for as long as the process lives: those of the
/// supervisor's own user and root; others are turned away
/// ([`crate::daemon::socket::peer_allowed`]).
fn accept_clients(sup: Arc<Supervisor>, listener: std::os::unix::net::UnixListener) {
    std::thread::spawn(move || {
        let ours = crate::sys::euid();
        let mut refused = 0u64;
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    sup.note(&format!("accepting a client failed: {e}"));
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if let Some(why) = refuse_peer(&stream, ours) {
                refused += 1;
                if refused <= MAX_REFUSALS_NOTED {
                    sup.note(&format!("turned a client away: {why}"));
                } else if refused == MAX_REFUSALS_NOTED + 1 {
                    sup.note("turned another client away; further ones are not logged");
                }
                continue;
            }
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

/// How many turned-away clients the log names; then it says no more.
const MAX_REFUSALS_NOTED: u64 = 20;

/// Why the client at the other end of `stream` is not served, if it is not:
/// it is neither user `ours` nor root, or who it is cannot be told.
fn refuse_peer(stream: &UnixStream, ours: u32) -> Option<String> {
    match crate::sys::peer_uid(stream) {
        Ok(uid) if crate::daemon::socket::peer_allowed(uid, ours) => None,
        Ok(uid) => Some(format!(
            "uid {uid} is neither the supervisor's user (uid {ours}) nor root"
        )),
        Err(e) => Some(format!("cannot tell who it is: {e}")),
    }
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

/// What the supervisor takes from its command line (the hidden
/// `supervise` subcommand) besides the VM's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuperviseOptions {
    /// The run directory (boot image, logs, state file).
    pub run_dir: PathBuf,
}

/// Runs the supervisor (the hidden `supervise` subcommand); returns the
/// process exit code once the VM has ended. `resolve` gives the VM's
/// configuration; it is called once the socket is claimed and clients are
/// served, and its failure ends the supervisor as a failed boot does.
pub fn supervise(
    socket_path: &Path,
    opts: &SuperviseOptions,
    resolve: impl FnOnce() -> Result<RunConfig>,
) -> Result<u8> {
    let dir: PathBuf = opts.run_dir.clone();
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

    let result = resolve().and_then(|mut cfg| {
        cfg.run_dir = Some(dir.clone());
        cfg.progress = true;
        cfg.echo_boot_console = false;
        run_vm(&sup, cfg, true, &|state| write_state(&dir, state))
    });
    let result = result.map(|report| Ending::from_report(&report));
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
    sup.log_counters();
    sup.note(&format!("the VM has ended: {}", ending.reason));
    match result {
        Ok(ending) if ending.clean => Ok(0),
        Ok(ending) => anyhow::bail!("the VM has ended: {}", ending.reason),
        // The error as it is: `run --detach` shows it to the user.
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_user_and_root_are_served() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let euid = crate::sys::euid();
        assert_eq!(refuse_peer(&ours, euid), None);
        let other = if euid == 4242 { 4243 } else { 4242 };
        let refusal = refuse_peer(&ours, other);
        if euid == 0 {
            // Root is always served.
            assert_eq!(refusal, None);
        } else {
            let expected =
                format!("uid {euid} is neither the supervisor's user (uid {other}) nor root");
            assert_eq!(refusal, Some(expected));
        }
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
}
