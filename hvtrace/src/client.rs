//! A client of a running VM's control socket.
//!
//! ```no_run
//! use std::time::Duration;
//! use hvtrace::client::Client;
//! let mut client = Client::connect(std::path::Path::new("/tmp/hvtrace-1000.sock"))?;
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

use crate::link::SeqCounter;

/// The name the client gives in `Hello`.
pub const CLIENT_NAME: &str = concat!("hvtrace ", env!("CARGO_PKG_VERSION"));

/// How long `Hello` may take.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

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
    reader: FrameReader<UnixStream>,
    writer: FrameWriter<UnixStream>,
    seq: SeqCounter,
}

impl Client {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Client> {
        let stream = UnixStream::connect(path).map_err(|e| connect_error(path, &e))?;
        let reader = stream
            .try_clone()
            .map_err(|e| anyhow!("cannot use the control socket {}: {e}", path.display()))?;
        Ok(Client {
            path: path.to_path_buf(),
            reader: FrameReader::new(reader),
            writer: FrameWriter::new(stream),
            seq: SeqCounter::default(),
        })
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
                client: CLIENT_NAME.to_string(),
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
    /// ahead of the response (see [`crate::supervisor::exec_reply`]); this
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
    /// that do not decode are skipped, events are collected.
    pub fn wait(&mut self, seq: u32, timeout: Duration) -> Result<(Response, Vec<Event>)> {
        let deadline = Instant::now() + timeout;
        let mut events = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "no answer from the VM's supervisor within {:.1} s",
                    timeout.as_secs_f64()
                );
            }
            self.reader
                .get_ref()
                .set_read_timeout(Some(left))
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

/// What answers requests: a [`Client`] of a VM's control socket, or a
/// supervisor in this process ([`crate::supervisor::LocalControl`]). The
/// commands that both `hvtrace run` and the control commands use are
/// written against it.
pub trait Control {
    /// Sends `request` and returns its response, waiting up to `timeout`.
    /// Events that come with the response are left out (the output of an
    /// `Exec` is put back together first).
    fn request(&mut self, request: Request, timeout: Duration) -> Result<Response>;
}

impl Control for Client {
    fn request(&mut self, request: Request, timeout: Duration) -> Result<Response> {
        Ok(self.call(request, timeout)?.response)
    }
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

/// Turns a response that is not the expected one into an error.
pub fn response_error(response: Response) -> anyhow::Error {
    match response {
        Response::Error { message, .. } => anyhow!("{}", one_line(&message)),
        Response::VersionMismatch { ours, .. } => mismatch(ours),
        other => anyhow!("unexpected answer: {other:?}"),
    }
}

fn mismatch(theirs: u16) -> anyhow::Error {
    anyhow!(
        "protocol version mismatch: the hypervisor speaks version {theirs}, this hvtrace speaks version {PROTOCOL_VERSION} (use the hvtrace that started the VM)"
    )
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

fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
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
