//! One client of the control socket, as the supervisor serves it.
//!
//! A [`Session`] cuts the client's bytes into segments
//! ([`crate::daemon::segment`]) and, for each one:
//!
//! - a request of this protocol version goes to the [`Backend`], and the
//!   answer goes back under the **client's** sequence number, preceded by
//!   any events of the reply (each with the supervisor's event counter);
//! - a frame of another version is forwarded as it is, and the hypervisor's
//!   answer (a `VersionMismatch` under that frame's own sequence number) is
//!   passed back as it is;
//! - a frame of this version that is not a request gets a `Malformed` error;
//! - anything else, including a frame cut by the client's disconnection, is
//!   forwarded as it is and gets no answer, exactly as on a serial line.

use protocol::{ErrorKind, Event, Frame, Request, Response};

use crate::daemon::segment::{Classifier, Inbound, Segment, Splitter};

/// What serving one request produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// Events to send before the response (e.g. the hypervisor's last log
    /// lines after a stop).
    pub events: Vec<Event>,
    /// The response.
    pub response: Response,
}

impl From<Response> for Reply {
    fn from(response: Response) -> Reply {
        Reply {
            events: Vec::new(),
            response,
        }
    }
}

/// What a session needs from the supervisor.
pub trait Backend {
    /// Serves one request of this protocol version.
    fn serve(&self, request: Request) -> Reply;
    /// Forwards a frame of another version as it is; returns the answer
    /// frame, or a message saying why there is none.
    fn forward_wrong_version(&self, wire: &[u8], seq: u32) -> Result<Frame, String>;
    /// Forwards bytes that are not a frame as they are.
    fn forward_garbage(&self, wire: &[u8]);
    /// The sequence number of the next event frame.
    fn next_event_seq(&self) -> u32;
}

/// What one session saw, for the supervisor's log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Requests served.
    pub requests: u64,
    /// Frames of another protocol version.
    pub wrong_version: u64,
    /// Frames that were not requests.
    pub not_requests: u64,
    /// Segments that were not frames (cut ones included).
    pub garbage: u64,
    /// Bytes of those segments.
    pub garbage_bytes: u64,
}

/// One client connection's state.
#[derive(Debug, Default)]
pub struct Session {
    splitter: Splitter,
    classifier: Classifier,
    /// The client stopped reading (a write to it failed).
    gone: bool,
    stats: SessionStats,
}

impl Session {
    /// A session at the start of a connection.
    pub fn new() -> Session {
        Session::default()
    }

    /// Handles bytes from the client. `send` writes one frame to the client
    /// and returns `false` once it cannot. Returns `false` when the client
    /// is gone; the rest of its bytes are then ignored.
    pub fn on_bytes(
        &mut self,
        bytes: &[u8],
        backend: &dyn Backend,
        send: &mut dyn FnMut(&Frame) -> bool,
    ) -> bool {
        for &b in bytes {
            if self.gone {
                break;
            }
            if let Some(segment) = self.splitter.push(b) {
                self.handle(&segment, backend, send);
            }
        }
        !self.gone
    }

    /// The client disconnected: a frame it left unfinished is forwarded
    /// as garbage, as a cut frame on a serial line would arrive.
    pub fn on_eof(&mut self, backend: &dyn Backend) {
        if let Some(cut) = self.splitter.finish() {
            self.garbage(&cut, backend);
        }
    }

    /// What this session saw so far.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    fn handle(
        &mut self,
        segment: &Segment,
        backend: &dyn Backend,
        send: &mut dyn FnMut(&Frame) -> bool,
    ) {
        match self.classifier.classify(segment) {
            Inbound::Request { seq, request } => {
                self.stats.requests += 1;
                let reply = backend.serve(request);
                for event in reply.events {
                    self.send(send, &Frame::event(backend.next_event_seq(), event));
                }
                self.send(send, &Frame::response(seq, reply.response));
            }
            Inbound::WrongVersion { seq, .. } => {
                self.stats.wrong_version += 1;
                match backend.forward_wrong_version(&segment.wire(), seq) {
                    Ok(answer) => self.send(send, &answer),
                    Err(why) => self.send(
                        send,
                        &Frame::response(seq, Response::error(ErrorKind::NotReady, why)),
                    ),
                }
            }
            Inbound::NotRequest { seq } => {
                self.stats.not_requests += 1;
                self.send(
                    send,
                    &Frame::response(
                        seq,
                        Response::error(ErrorKind::Malformed, "expected a request"),
                    ),
                );
            }
            Inbound::Garbage(_) => self.garbage(segment, backend),
        }
    }

    fn garbage(&mut self, segment: &Segment, backend: &dyn Backend) {
        self.stats.garbage += 1;
        self.stats.garbage_bytes += (segment.bytes.len() + segment.dropped) as u64;
        backend.forward_garbage(&segment.wire());
    }

    fn send(&mut self, send: &mut dyn FnMut(&Frame) -> bool, frame: &Frame) {
        if !self.gone && !send(frame) {
            self.gone = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{encode, Body, PROTOCOL_VERSION};
    use std::cell::{Cell, RefCell};

    /// Records what the session asked for; answers pings and stops.
    #[derive(Default)]
    struct Fake {
        served: RefCell<Vec<Request>>,
        wrong: RefCell<Vec<(Vec<u8>, u32)>>,
        garbage: RefCell<Vec<Vec<u8>>>,
        events: Cell<u32>,
    }

    impl Backend for Fake {
        fn serve(&self, request: Request) -> Reply {
            self.served.borrow_mut().push(request.clone());
            match request {
                Request::Ping { nonce } => Response::Pong { nonce }.into(),
                Request::Stop => Reply {
                    events: vec![
                        Event::Log {
                            text: "exit counts: CPUID=3".into(),
                        },
                        Event::Log {
                            text: "guest stopped: stopped by the host".into(),
                        },
                    ],
                    response: Response::Ok,
                },
                _ => Response::error(ErrorKind::Unsupported, "no").into(),
            }
        }

        fn forward_wrong_version(&self, wire: &[u8], seq: u32) -> Result<Frame, String> {
            self.wrong.borrow_mut().push((wire.to_vec(), seq));
            Ok(Frame::response(
                seq,
                Response::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: 99,
                },
            ))
        }

        fn forward_garbage(&self, wire: &[u8]) {
            self.garbage.borrow_mut().push(wire.to_vec());
        }

        fn next_event_seq(&self) -> u32 {
            let n = self.events.get();
            self.events.set(n + 1);
            n
        }
    }

    fn wire(frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        encode(frame, &mut out).unwrap();
        out
    }

    fn run(session: &mut Session, fake: &Fake, bytes: &[u8]) -> Vec<Frame> {
        let mut out = Vec::new();
        assert!(session.on_bytes(bytes, fake, &mut |f: &Frame| {
            out.push(f.clone());
            true
        }));
        out
    }

    #[test]
    fn answers_carry_the_clients_numbers() {
        let fake = Fake::default();
        let mut s = Session::new();
        let mut bytes = wire(&Frame::request(77, Request::Ping { nonce: 1 }));
        bytes.extend(wire(&Frame::request(5, Request::Ping { nonce: 2 })));
        let out = run(&mut s, &fake, &bytes);
        assert_eq!(
            out,
            [
                Frame::response(77, Response::Pong { nonce: 1 }),
                Frame::response(5, Response::Pong { nonce: 2 })
            ]
        );
        assert_eq!(s.stats().requests, 2);
    }

    #[test]
    fn events_come_before_the_response() {
        let fake = Fake::default();
        let mut s = Session::new();
        let out = run(&mut s, &fake, &wire(&Frame::request(9, Request::Stop)));
        assert_eq!(out.len(), 3);
        assert!(
            matches!(&out[0].body, Body::Event(Event::Log { text }) if text.starts_with("exit counts:"))
        );
        assert_eq!((out[0].seq, out[1].seq), (0, 1));
        assert_eq!(out[2], Frame::response(9, Response::Ok));
    }

    #[test]
    fn wrong_version_is_forwarded_verbatim() {
        let fake = Fake::default();
        let mut s = Session::new();
        let mut old = Frame::request(31337, Request::Status);
        old.version = 99;
        let raw = wire(&old);
        let out = run(&mut s, &fake, &raw);
        assert_eq!(fake.wrong.borrow().as_slice(), [(raw, 31337)]);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].seq, 31337);
        assert!(matches!(
            out[0].body,
            Body::Response(Response::VersionMismatch { theirs: 99, .. })
        ));
        assert!(fake.served.borrow().is_empty());
    }

    #[test]
    fn garbage_and_cut_frames_are_forwarded_unanswered() {
        let fake = Fake::default();
        let mut s = Session::new();
        let good = wire(&Frame::request(1, Request::Ping { nonce: 7 }));
        let mut bytes = b"\x00hello\x01\x02\x00".to_vec();
        bytes.extend_from_slice(&good);
        bytes.extend_from_slice(&good[..6]);
        let out = run(&mut s, &fake, &bytes);
        assert_eq!(out, [Frame::response(1, Response::Pong { nonce: 7 })]);
        assert_eq!(
            fake.garbage.borrow().as_slice(),
            [b"\x00hello\x01\x02\x00".to_vec()]
        );
        s.on_eof(&fake);
        let garbage = fake.garbage.borrow();
        assert_eq!(garbage.len(), 2);
        // The cut frame goes out as the client sent it, without an end.
        assert_eq!(garbage[1], good[..6]);
        assert_eq!(s.stats().garbage, 2);
    }

    #[test]
    fn non_requests_are_malformed() {
        let fake = Fake::default();
        let mut s = Session::new();
        let out = run(&mut s, &fake, &wire(&Frame::response(4, Response::Ok)));
        assert_eq!(
            out,
            [Frame::response(
                4,
                Response::error(ErrorKind::Malformed, "expected a request")
            )]
        );
    }

    #[test]
    fn a_client_that_left_is_not_served_further() {
        let fake = Fake::default();
        let mut s = Session::new();
        let mut bytes = wire(&Frame::request(1, Request::Ping { nonce: 1 }));
        bytes.extend(wire(&Frame::request(2, Request::Ping { nonce: 2 })));
        let still_there = s.on_bytes(&bytes, &fake, &mut |_: &Frame| false);
        assert!(!still_there);
        assert_eq!(fake.served.borrow().len(), 1);
    }
}
