//! Function-graph sessions tied to the control connections that started
//! them.
//!
//! A graph session hooks functions in the guest until something stops it.
//! A client that dies without stopping its sessions (killed, a lost
//! terminal) would leave them armed in a guest that nobody traces, so the
//! supervisor notes which connection started which session and, when that
//! connection closes, stops the sessions it did not stop. A client that
//! says [`PERSIST_WORD`] in its `Hello` (`hvtrace graph --persist`) keeps
//! its sessions running after it goes.
//!
//! [`ClientBackend`] is the supervisor as one connection sees it: it
//! passes every request on and watches the answers to `GraphStart` and
//! `GraphStop`, whoever sends them (a session another client stopped, or
//! that `GraphStop` without a number stopped, is nobody's any more; its
//! number may go to a new session). The starts and stops of every client
//! go through one lock, with the map, so that a closing connection never
//! stops a session that has become another's.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use protocol::{ErrorKind, Frame, Request, Response};

use crate::daemon::session::{Backend, Reply};

/// The word in the `Hello` client name that asks the supervisor to leave
/// this connection's function-graph sessions running when it closes
/// (`hvtrace graph --persist`). The supervisor reads it; the hypervisor
/// only logs the name.
pub const PERSIST_WORD: &str = "persist-graph-sessions";

/// Who started a running session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owner {
    /// The connection's number.
    client: u32,
    /// It asked its sessions to persist.
    persist: bool,
}

/// The running graph sessions started through the control socket, by
/// session number, with the connection that started each.
#[derive(Debug, Default)]
pub struct GraphOwners {
    sessions: Mutex<BTreeMap<u32, Owner>>,
}

impl GraphOwners {
    /// No sessions.
    pub fn new() -> GraphOwners {
        GraphOwners::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u32, Owner>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection that started `session`, if it is running and was
    /// started through the socket.
    pub fn owner(&self, session: u32) -> Option<u32> {
        self.lock().get(&session).map(|o| o.client)
    }
}

/// Notes what the answer to a graph request says: a session started, or
/// stopped (or found not to exist).
fn note_answer(
    sessions: &mut BTreeMap<u32, Owner>,
    owner: Owner,
    request: &Request,
    response: &Response,
) {
    match (request, response) {
        (Request::GraphStart(_), Response::GraphStarted { session, .. }) => {
            sessions.insert(*session, owner);
        }
        (Request::GraphStop { session: None }, Response::Ok) => sessions.clear(),
        (
            Request::GraphStop {
                session: Some(session),
            },
            Response::Ok
            | Response::Error {
                kind: ErrorKind::NotFound,
                ..
            },
        ) => {
            sessions.remove(session);
        }
        _ => {}
    }
}

/// The words of a `Hello` client name that ask for persisting sessions.
pub fn asks_to_persist(client_name: &str) -> bool {
    client_name.split_whitespace().any(|w| w == PERSIST_WORD)
}

/// The supervisor as one connection sees it: requests go to `inner`; the
/// graph sessions this connection starts are noted in `owners`, and
/// [`ClientBackend::close`] stops those it leaves running.
pub struct ClientBackend<'a> {
    inner: &'a dyn Backend,
    owners: &'a GraphOwners,
    client: u32,
    persist: Cell<bool>,
}

impl<'a> ClientBackend<'a> {
    /// Connection number `client`, served by `inner`.
    pub fn new(inner: &'a dyn Backend, owners: &'a GraphOwners, client: u32) -> ClientBackend<'a> {
        ClientBackend {
            inner,
            owners,
            client,
            persist: Cell::new(false),
        }
    }

    /// The connection closed: stops each graph session it started and
    /// left running, unless it asked them to persist. Returns the line for
    /// the supervisor's log, if it had any.
    pub fn close(&self) -> Option<String> {
        let mut sessions = self.owners.lock();
        let mine: Vec<(u32, Owner)> = sessions
            .iter()
            .filter(|(_, o)| o.client == self.client)
            .map(|(&s, &o)| (s, o))
            .collect();
        if mine.is_empty() {
            return None;
        }
        let mut parts = Vec::new();
        for (session, owner) in mine {
            sessions.remove(&session);
            if owner.persist {
                parts.push(format!(
                    "session {session} left running (the client asked its sessions to persist)"
                ));
                continue;
            }
            let request = Request::GraphStop {
                session: Some(session),
            };
            let part = match self.inner.serve(request).response {
                Response::Ok => format!("session {session} stopped"),
                Response::Error {
                    kind: ErrorKind::NotFound,
                    ..
                } => format!("session {session} was gone already"),
                Response::Error { message, .. } if message.starts_with("the VM has ended") => {
                    format!("session {session} ended with the VM")
                }
                Response::Error { message, .. } => {
                    format!("session {session} could not be stopped: {message}")
                }
                other => format!("session {session}: unexpected answer to its stop: {other:?}"),
            };
            parts.push(part);
        }
        Some(format!(
            "client {} left without stopping its function graph sessions: {}",
            self.client,
            parts.join("; ")
        ))
    }
}

impl Backend for ClientBackend<'_> {
    fn serve(&self, request: Request) -> Reply {
        match &request {
            Request::Hello { client, .. } => {
                self.persist.set(asks_to_persist(client));
                self.inner.serve(request)
            }
            Request::GraphStart(_) | Request::GraphStop { .. } => {
                // Held while the request is carried out: the answer and
                // the map change together for every client.
                let mut sessions = self.owners.lock();
                let noted = request.clone();
                let reply = self.inner.serve(request);
                let owner = Owner {
                    client: self.client,
                    persist: self.persist.get(),
                };
                note_answer(&mut sessions, owner, &noted, &reply.response);
                reply
            }
            _ => self.inner.serve(request),
        }
    }

    fn forward_wrong_version(&self, wire: &[u8], seq: u32) -> Result<Frame, String> {
        self.inner.forward_wrong_version(wire, seq)
    }

    fn forward_garbage(&self, wire: &[u8]) {
        self.inner.forward_garbage(wire)
    }

    fn next_event_seq(&self) -> u32 {
        self.inner.next_event_seq()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{GraphFilter, PROTOCOL_VERSION};
    use std::cell::RefCell;

    /// A hypervisor with graph sessions: starts take the lowest free
    /// number; stops answer as the hypervisor does. Records every request.
    #[derive(Default)]
    struct FakeHv {
        running: RefCell<Vec<u32>>,
        served: RefCell<Vec<Request>>,
        ended: Cell<bool>,
    }

    impl Backend for FakeHv {
        fn serve(&self, request: Request) -> Reply {
            self.served.borrow_mut().push(request.clone());
            if self.ended.get() {
                return Response::error(
                    ErrorKind::NotReady,
                    "the VM has ended (guest stopped: power off)",
                )
                .into();
            }
            let mut running = self.running.borrow_mut();
            match request {
                Request::Hello { .. } => Response::Hello {
                    version: PROTOCOL_VERSION,
                    hypervisor: "fake".into(),
                },
                Request::GraphStart(_) => {
                    let session = (1..).find(|n| !running.contains(n)).unwrap();
                    running.push(session);
                    Response::GraphStarted {
                        session,
                        hooked: 1,
                        roots: 1,
                        skipped: 0,
                    }
                }
                Request::GraphStop { session: None } => {
                    running.clear();
                    Response::Ok
                }
                Request::GraphStop { session: Some(n) } => {
                    if let Some(i) = running.iter().position(|&s| s == n) {
                        running.remove(i);
                        Response::Ok
                    } else {
                        Response::error(
                            ErrorKind::NotFound,
                            format!("no function-graph session {n}"),
                        )
                    }
                }
                _ => Response::Pong { nonce: 0 },
            }
            .into()
        }

        fn forward_wrong_version(&self, _wire: &[u8], _seq: u32) -> Result<Frame, String> {
            Err("no".into())
        }

        fn forward_garbage(&self, _wire: &[u8]) {}

        fn next_event_seq(&self) -> u32 {
            0
        }
    }

    impl FakeHv {
        /// The requests served since the last call.
        fn take(&self) -> Vec<Request> {
            std::mem::take(&mut *self.served.borrow_mut())
        }
    }

    fn hello(c: &ClientBackend<'_>, name: &str) {
        c.serve(Request::Hello {
            version: PROTOCOL_VERSION,
            client: name.into(),
        });
    }

    fn start(c: &ClientBackend<'_>) -> u32 {
        match c
            .serve(Request::GraphStart(GraphFilter::default()))
            .response
        {
            Response::GraphStarted { session, .. } => session,
            other => panic!("{other:?}"),
        }
    }

    fn stop(c: &ClientBackend<'_>, session: Option<u32>) -> Response {
        c.serve(Request::GraphStop { session }).response
    }

    fn stop_of(n: u32) -> Request {
        Request::GraphStop { session: Some(n) }
    }

    #[test]
    fn a_closing_connection_stops_the_sessions_it_left_running() {
        let hv = FakeHv::default();
        let owners = GraphOwners::new();
        let a = ClientBackend::new(&hv, &owners, 1);
        hello(&a, "hvtrace 0.1.0");
        assert_eq!((start(&a), start(&a), start(&a)), (1, 2, 3));
        assert_eq!(stop(&a, Some(2)), Response::Ok);
        assert_eq!(owners.owner(1), Some(1));
        assert_eq!(owners.owner(2), None);
        hv.take();
        let line = a.close().unwrap();
        // Only the sessions it did not stop, each once.
        assert_eq!(hv.take(), [stop_of(1), stop_of(3)]);
        assert_eq!(
            line,
            "client 1 left without stopping its function graph sessions: session 1 stopped; session 3 stopped"
        );
        assert!(hv.running.borrow().is_empty());
        assert_eq!(owners.owner(1), None);
        // Closing again sends nothing.
        assert_eq!(a.close(), None);
        assert!(hv.take().is_empty());
    }

    #[test]
    fn a_connection_that_stopped_its_session_sends_nothing() {
        let hv = FakeHv::default();
        let owners = GraphOwners::new();
        let a = ClientBackend::new(&hv, &owners, 1);
        let s = start(&a);
        stop(&a, Some(s));
        // Other requests do not count.
        a.serve(Request::Ping { nonce: 1 });
        hv.take();
        assert_eq!(a.close(), None);
        assert!(hv.take().is_empty());
    }

    #[test]
    fn persisting_sessions_are_left_running() {
        let hv = FakeHv::default();
        let owners = GraphOwners::new();
        let a = ClientBackend::new(&hv, &owners, 4);
        hello(&a, &format!("hvtrace 0.1.0 {PERSIST_WORD}"));
        let s = start(&a);
        hv.take();
        let line = a.close().unwrap();
        assert!(hv.take().is_empty());
        assert_eq!(*hv.running.borrow(), [s]);
        assert!(
            line.ends_with("session 1 left running (the client asked its sessions to persist)"),
            "{line}"
        );
        assert!(asks_to_persist(&format!("x {PERSIST_WORD}")));
        assert!(!asks_to_persist("hvtrace 0.1.0"));
        assert!(!asks_to_persist(&format!("x{PERSIST_WORD}")));
    }

    #[test]
    fn a_session_stopped_by_another_client_is_not_stopped_again() {
        let hv = FakeHv::default();
        let owners = GraphOwners::new();
        let a = ClientBackend::new(&hv, &owners, 1);
        let b = ClientBackend::new(&hv, &owners, 2);
        let c = ClientBackend::new(&hv, &owners, 3);
        // b stops a's session; c's new session takes its number.
        let s = start(&a);
        assert_eq!(stop(&b, Some(s)), Response::Ok);
        assert_eq!(start(&c), s);
        assert_eq!(owners.owner(s), Some(3));
        hv.take();
        assert_eq!(a.close(), None);
        assert!(hv.take().is_empty());
        assert_eq!(*hv.running.borrow(), [s]);
        // A stop of every session leaves nobody anything to stop.
        start(&a);
        assert_eq!(stop(&b, None), Response::Ok);
        hv.take();
        assert_eq!(a.close(), None);
        assert_eq!(c.close(), None);
        assert!(hv.take().is_empty());
        // A session the hypervisor does not know any more is forgotten.
        let s = start(&c);
        hv.running.borrow_mut().clear();
        assert!(matches!(
            stop(&c, Some(s)),
            Response::Error {
                kind: ErrorKind::NotFound,
                ..
            }
        ));
        hv.take();
        assert_eq!(c.close(), None);
        assert!(hv.take().is_empty());
    }

    #[test]
    fn failed_starts_and_stops_change_nothing() {
        let hv = FakeHv::default();
        let owners = GraphOwners::new();
        let a = ClientBackend::new(&hv, &owners, 1);
        let s = start(&a);
        // The VM ends: the stop fails, the session stays a's; its close
        // says what became of it.
        hv.ended.set(true);
        assert!(matches!(stop(&a, Some(s)), Response::Error { .. }));
        assert_eq!(owners.owner(s), Some(1));
        assert!(matches!(
            a.serve(Request::GraphStart(GraphFilter::default()))
                .response,
            Response::Error { .. }
        ));
        hv.take();
        let line = a.close().unwrap();
        assert_eq!(hv.take(), [stop_of(s)]);
        assert!(line.ends_with("session 1 ended with the VM"), "{line}");
    }
}
