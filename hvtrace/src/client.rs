//! A client of a running VM's control socket.
//!
//! ```no_run
//! use std::time::Duration;
//! use hvtrace::client::Client;
//! let mut client = Client::connect(std::path::Path::new("/tmp/hvtrace-1000/hvtrace.sock"))?;
//! client.hello()?;
//! let reply = client.call(protocol::Request::Status, Duration::from_secs(30))?;
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! Every failure is an error whose text is one line, fit for
//! `hvtrace: error: ...`.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use protocol::io::{FrameReader, FrameWriter, ReadError};
use protocol::{Body, Event, Frame, Request, Response, PROTOCOL_VERSION};

use crate::control::mismatch;
use crate::daemon::link::SeqCounter;
use crate::sys;

// What answers requests and how a wrong answer reads are `control`'s; the
// `Hello` word for persisting sessions is the supervisor's, which reads it.
// They stay reachable here under their old paths.
pub use crate::control::{response_error, Control};
pub use crate::daemon::owners::PERSIST_WORD;

/// The name the client gives in `Hello`.
pub const CLIENT_NAME: &str = concat!("hvtrace ", env!("CARGO_PKG_VERSION"));

/// How long `Hello` may take.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// A read of the socket that a Ctrl-C should end waits at most this long
/// before it looks again (a signal that arrives just before the read
/// starts does not end it).
pub const WAKE_SLICE: Duration = Duration::from_millis(200);

/// The reading half of the socket: a read that a signal interrupted
/// returns as timed out instead of being started again, so that
/// [`Client::wait`] looks at its wake-up condition at once.
#[derive(Debug)]
struct WakeStream(UnixStream);

impl io::Read for WakeStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "interrupted"))
            }
            other => other,
        }
    }
}

/// A response with the events that came before it.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The response.
    pub response: Response,
    /// Events received while waiting for it, in order.
    pub events: Vec<Event>,
    /// From sending the request to receiving the response.
    pub round_trip: Duration,
}

/// A connection to a VM's supervisor.
pub struct Client {
    path: PathBuf,
    reader: FrameReader<WakeStream>,
    writer: FrameWriter<UnixStream>,
    seq: SeqCounter,
    /// When a wait should give up ([`Client::wake_when`]).
    wake: Option<fn() -> bool>,
    /// Say [`PERSIST_WORD`] in `Hello`.
    persist: bool,
}

impl Client {
    /// Connects to the control socket at `path`: refuses a path that
    /// others could have put there ([`crate::daemon::socket::check_path`]), and a
    /// server that is neither our user nor root (`SO_PEERCRED`).
    pub fn connect(path: &Path) -> Result<Client> {
        let euid = crate::sys::euid();
        crate::daemon::socket::check_path(path, euid)?;
        let stream = UnixStream::connect(path).map_err(|e| connect_error(path, &e))?;
        check_server(path, &stream, euid)?;
        let reader = stream
            .try_clone()
            .map_err(|e| anyhow!("cannot use the control socket {}: {e}", path.display()))?;
        Ok(Client {
            path: path.to_path_buf(),
            reader: FrameReader::new(WakeStream(reader)),
            writer: FrameWriter::new(stream),
            seq: SeqCounter::default(),
            wake: None,
            persist: false,
        })
    }

    /// Makes every wait for an answer give up, with [`sys::Interrupted`],
    /// as soon as `wake` says so (`sys::take_interrupt`: the first Ctrl-C).
    /// `wake` is asked every [`WAKE_SLICE`] and whenever a signal ends a
    /// read.
    pub fn wake_when(&mut self, wake: fn() -> bool) {
        self.wake = Some(wake);
    }

    /// Asks the supervisor (in `Hello`, so call this before
    /// [`Client::hello`]) to leave the function-graph sessions this
    /// connection starts running when it closes. Without it, the supervisor
    /// stops them then.
    pub fn persist_graph_sessions(&mut self) {
        self.persist = true;
    }

    fn woken(&self) -> bool {
        self.wake.is_some_and(|wake| wake())
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the session: sends `Hello` and checks that both ends speak
    /// this protocol version. Returns the hypervisor's name and version.
    pub fn hello(&mut self) -> Result<String> {
        let reply = self.call(
            Request::Hello {
                version: PROTOCOL_VERSION,
                client: if self.persist {
                    format!("{CLIENT_NAME} {PERSIST_WORD}")
                } else {
                    CLIENT_NAME.to_string()
                },
            },
            HELLO_TIMEOUT,
        )?;
        match reply.response {
            Response::Hello {
                version,
                hypervisor,
            } if version == PROTOCOL_VERSION => Ok(hypervisor),
            Response::Hello { version, .. } => Err(mismatch(version)),
            other => Err(response_error(other)),
        }
    }

    /// Sends `request` and waits up to `timeout` for its response.
    ///
    /// The output of an `Exec` longer than one frame arrives in `Log` events
    /// ahead of the response (see [`crate::daemon::supervisor::exec_reply`]); this
    /// puts it back together, so that the response holds all of it.
    pub fn call(&mut self, request: Request, timeout: Duration) -> Result<Reply> {
        let is_exec = matches!(request, Request::Exec { .. });
        let seq = self.seq.next_seq();
        let start = Instant::now();
        self.send(&Frame::request(seq, request))?;
        let (mut response, mut events) = self.wait(seq, timeout)?;
        if is_exec {
            if let Response::Exec { output, .. } = &mut response {
                let mut whole = String::new();
                events.retain(|e| match e {
                    Event::Log { text } => {
                        whole.push_str(text);
                        false
                    }
                    _ => true,
                });
                whole.push_str(output);
                *output = whole;
            }
        }
        Ok(Reply {
            response,
            events,
            round_trip: start.elapsed(),
        })
    }

    /// Writes one frame.
    pub fn send(&mut self, frame: &Frame) -> Result<()> {
        self.writer.write_frame(frame).map_err(|e| match e {
            protocol::io::WriteError::Io(e) if is_disconnect(&e) => gone(),
            e => anyhow!("cannot send to the VM's supervisor: {e}"),
        })
    }

    /// Writes raw bytes (for tests of the channel's robustness).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        use std::io::Write;
        let w = self.writer.get_mut();
        w.write_all(bytes)
            .and_then(|_| w.flush())
            .map_err(|e| anyhow!("cannot send to the VM's supervisor: {e}"))
    }

    /// Reads frames until the response with sequence number `seq`; frames
    /// that do not decode are skipped, events are collected. Gives up with
    /// [`sys::Interrupted`] once the wake-up condition says so
    /// ([`Client::wake_when`]).
    pub fn wait(&mut self, seq: u32, timeout: Duration) -> Result<(Response, Vec<Event>)> {
        let deadline = Instant::now() + timeout;
        let mut events = Vec::new();
        loop {
            if self.woken() {
                return Err(anyhow::Error::new(sys::Interrupted));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "no answer from the VM's supervisor within {:.1} s",
                    timeout.as_secs_f64()
                );
            }
            let slice = match self.wake {
                Some(_) => left.min(WAKE_SLICE),
                None => left,
            };
            self.reader
                .get_ref()
                .0
                .set_read_timeout(Some(slice))
                .map_err(|e| anyhow!("control socket: {e}"))?;
            match self.reader.read_frame() {
                Ok(Frame {
                    seq: s,
                    body: Body::Response(response),
                    ..
                }) if s == seq => return Ok((response, events)),
                Ok(Frame {
                    body: Body::Event(event),
                    ..
                }) => events.push(event),
                // Answers to other requests, or frames we cannot read.
                Ok(_) | Err(ReadError::Decode(_)) => {}
                Err(ReadError::Closed) => return Err(gone()),
                Err(ReadError::Io(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(ReadError::Io(e)) if is_disconnect(&e) => return Err(gone()),
                Err(e) => bail!("control socket: {e}"),
            }
        }
    }
}

impl Control for Client {
    fn request(&mut self, request: Request, timeout: Duration) -> Result<Response> {
        Ok(self.call(request, timeout)?.response)
    }
}

/// Fails unless the server at the other end of `stream` runs as user
/// `euid` or as root ([`crate::daemon::socket::peer_allowed`]).
pub fn check_server(path: &Path, stream: &UnixStream, euid: u32) -> Result<()> {
    let uid = crate::sys::peer_uid(stream).map_err(|e| {
        anyhow!(
            "cannot tell who serves the control socket {}: {e}",
            path.display()
        )
    })?;
    if !crate::daemon::socket::peer_allowed(uid, euid) {
        bail!(
            "the control socket {} is served by uid {uid}, not you (uid {euid}); refusing to talk to it",
            path.display()
        );
    }
    Ok(())
}

/// The one-line message for a failed connection to `path`.
pub fn connect_error(path: &Path, e: &io::Error) -> anyhow::Error {
    let p = path.display();
    match e.kind() {
        io::ErrorKind::NotFound => anyhow!(
            "no VM is running at {p}: the control socket does not exist (start one with `hvtrace run --detach`)"
        ),
        io::ErrorKind::ConnectionRefused => anyhow!(
            "the VM at {p} is gone: nothing listens on the control socket (`hvtrace run --detach` replaces it)"
        ),
        io::ErrorKind::PermissionDenied => {
            anyhow!("cannot connect to the control socket {p}: permission denied")
        }
        _ => anyhow!("cannot connect to the control socket {p}: {e}"),
    }
}

/// The supervisor hung up: the VM has ended (or the supervisor died).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SupervisorGone;

impl std::fmt::Display for SupervisorGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the VM's supervisor closed the connection (the VM has ended)")
    }
}

impl std::error::Error for SupervisorGone {}

fn gone() -> anyhow::Error {
    anyhow::Error::new(SupervisorGone)
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::ErrorKind;
    use std::os::unix::net::UnixListener;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-client-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Serves one connection with `answer` per request frame.
    fn server(
        path: &Path,
        answer: impl Fn(&Frame) -> Vec<Frame> + Send + 'static,
    ) -> std::thread::JoinHandle<()> {
        let listener = UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut r = FrameReader::new(stream.try_clone().unwrap());
            let mut w = FrameWriter::new(stream);
            while let Ok(frame) = r.read_frame() {
                for f in answer(&frame) {
                    if w.write_frame(&f).is_err() {
                        return;
                    }
                }
            }
        })
    }

    #[test]
    fn the_server_is_checked() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let euid = crate::sys::euid();
        check_server(Path::new("/x.sock"), &ours, euid).unwrap();
        // As seen by another user, a server of ours is a stranger's,
        // unless we are root.
        let other = if euid == 4242 { 4243 } else { 4242 };
        let result = check_server(Path::new("/x.sock"), &ours, other);
        if euid == 0 {
            result.unwrap();
        } else {
            let e = result.unwrap_err().to_string();
            assert!(
                e.starts_with(&format!(
                    "the control socket /x.sock is served by uid {euid}, not you (uid {other})"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn an_unsafe_socket_path_is_refused_before_connecting() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("unsafe");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = Client::connect(&dir.join("x.sock"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("writable by others"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn connection_errors_are_one_line() {
        let dir = scratch("connect");
        let missing = dir.join("missing.sock");
        let e = Client::connect(&missing).err().unwrap().to_string();
        assert!(e.starts_with("no VM is running at"), "{e}");
        let stale = dir.join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        let e = Client::connect(&stale).err().unwrap().to_string();
        assert!(e.contains("is gone"), "{e}");
        assert!(!e.contains('\n'));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hello_checks_the_version() {
        let dir = scratch("hello");
        let path = dir.join("ok.sock");
        let _s = server(&path, |f| {
            vec![
                Frame::event(0, Event::Log { text: "x".into() }),
                Frame::response(
                    f.seq,
                    Response::Hello {
                        version: PROTOCOL_VERSION,
                        hypervisor: "hv 1".into(),
                    },
                ),
            ]
        });
        let mut c = Client::connect(&path).unwrap();
        assert_eq!(c.hello().unwrap(), "hv 1");

        let path = dir.join("old.sock");
        let _s = server(&path, |f| {
            vec![Frame::response(
                f.seq,
                Response::VersionMismatch {
                    ours: PROTOCOL_VERSION + 1,
                    theirs: PROTOCOL_VERSION,
                },
            )]
        });
        let mut c = Client::connect(&path).unwrap();
        let e = c.hello().unwrap_err().to_string();
        assert!(e.starts_with("protocol version mismatch"), "{e}");
        assert!(
            e.contains(&format!("version {}", PROTOCOL_VERSION + 1)),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_wait_gives_up_when_woken() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static WAKE: AtomicBool = AtomicBool::new(false);
        fn woken() -> bool {
            WAKE.swap(false, Ordering::SeqCst)
        }
        let dir = scratch("wake");
        let path = dir.join("mute.sock");
        // Answers `Hello`, then nothing.
        let _s = server(&path, |f| match &f.body {
            Body::Request(Request::Hello { .. }) => vec![Frame::response(
                f.seq,
                Response::Hello {
                    version: PROTOCOL_VERSION,
                    hypervisor: "hv 1".into(),
                },
            )],
            _ => vec![],
        });
        let mut c = Client::connect(&path).unwrap();
        c.wake_when(woken);
        c.hello().unwrap();
        let start = Instant::now();
        let waker = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            WAKE.store(true, Ordering::SeqCst);
        });
        let e = c
            .call(Request::Status, Duration::from_secs(60))
            .unwrap_err();
        waker.join().unwrap();
        assert!(sys::is_interrupted(&e), "{e:#}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        // The wake-up was taken: the next call waits for its answer again
        // (and gets none within its time).
        let e = c
            .call(Request::Ping { nonce: 1 }, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no answer"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn errors_and_disconnections() {
        let dir = scratch("errors");
        let path = dir.join("err.sock");
        let _s = server(&path, |f| match &f.body {
            Body::Request(Request::Status) => vec![Frame::response(
                f.seq,
                Response::error(
                    ErrorKind::NotReady,
                    "the VM has ended: guest stopped: power off",
                ),
            )],
            // Other requests: the server hangs up.
            _ => vec![],
        });
        let mut c = Client::connect(&path).unwrap();
        let reply = c.call(Request::Status, Duration::from_secs(5)).unwrap();
        let e = response_error(reply.response).to_string();
        assert_eq!(e, "the VM has ended: guest stopped: power off");
        // No answer at all: the time limit.
        let e = c
            .call(Request::Ping { nonce: 1 }, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no answer"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A [`Control`] for tests: answers each request with the next canned
/// response and records the requests.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;

    use anyhow::Result;
    use protocol::{Request, Response};

    use super::Control;

    pub(crate) struct Canned {
        pub(crate) answers: std::collections::VecDeque<Result<Response>>,
        pub(crate) seen: Vec<Request>,
    }

    impl Control for Canned {
        fn request(&mut self, request: Request, _timeout: Duration) -> Result<Response> {
            self.seen.push(request);
            self.answers.pop_front().expect("no answer left")
        }
    }
}
