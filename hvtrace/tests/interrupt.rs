//! Ctrl-C ends what it should: a command waiting for an answer that does
//! not come wakes on the first SIGINT, stops what it started, says so in
//! one closing line and exits with 130.
//!
//! Each case runs the `hvtrace` binary against a fake supervisor that
//! leaves one request unanswered, as a supervisor stuck behind a slow
//! hypervisor would. No emulator, kernel or hypervisor is needed.
//!
//! Run: `cargo test -p hvtrace --test interrupt`

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use protocol::io::{FrameReader, FrameWriter};
use protocol::{Body, Frame, Request, Response, PROTOCOL_VERSION};

/// How soon after the SIGINT the command must be gone. Without the
/// wake-up, a read waits for its own time limit (over 40 s).
const PROMPTLY: Duration = Duration::from_secs(5);

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "hvtrace-interrupt-test-{}-{test}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn socket(&self) -> PathBuf {
        self.0.join("hvtrace.sock")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Seen = Arc<Mutex<Vec<Request>>>;

/// Serves one connection on `path`: records each request and answers it
/// with `answer`, or leaves it unanswered when that gives `None`.
fn fake_supervisor(
    path: &Path,
    mut answer: impl FnMut(&Request) -> Option<Response> + Send + 'static,
) -> (JoinHandle<()>, Seen) {
    let listener = UnixListener::bind(path).unwrap();
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(stream.try_clone().unwrap());
        let mut w = FrameWriter::new(stream);
        while let Ok(frame) = r.read_frame() {
            let Body::Request(req) = &frame.body else {
                continue;
            };
            log.lock().unwrap().push(req.clone());
            if let Some(response) = answer(req) {
                if w.write_frame(&Frame::response(frame.seq, response))
                    .is_err()
                {
                    return;
                }
            }
        }
    });
    (server, seen)
}

fn hello() -> Response {
    Response::Hello {
        version: PROTOCOL_VERSION,
        hypervisor: "fake".into(),
    }
}

fn spawn(args: &[&str]) -> Child {
    // Every command names its socket; the default would be under a
    // directory that does not exist, never the user's.
    Command::new(env!("CARGO_BIN_EXE_hvtrace"))
        .args(args)
        .env_remove("XDG_RUNTIME_DIR")
        .env("HVTRACE_TMPDIR", "/nonexistent-hvtrace-tmp")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot run hvtrace")
}

/// Waits until the fake has seen a request that `what` picks, then a
/// moment more, so that the command is surely blocked in its wait.
fn wait_for_request(seen: &Seen, what: impl Fn(&Request) -> bool) {
    let until = Instant::now() + Duration::from_secs(30);
    while !seen.lock().unwrap().iter().any(&what) {
        assert!(
            Instant::now() < until,
            "not seen: {:?}",
            seen.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// Sends one SIGINT to `child`, as a Ctrl-C would, and waits for it to end:
/// returns its exit code, its stderr and how long it took.
fn interrupt(child: Child) -> (Option<i32>, String, Duration) {
    let sent = Instant::now();
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let output = child.wait_with_output().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
        sent.elapsed(),
    )
}

fn is_session_read(r: &Request) -> bool {
    matches!(r, Request::TraceRead { cursor, source: Some(2), .. } if *cursor != u64::MAX)
}

#[test]
fn graph_follow_wakes_from_a_read_without_answer_and_stops_its_session() {
    let scratch = Scratch::new("graph");
    let path = scratch.socket();
    let (server, seen) = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => Some(hello()),
        // The end of the buffer, for the reader that starts there.
        Request::TraceRead {
            cursor: u64::MAX, ..
        } => Some(Response::Trace {
            next: 40,
            text: String::new(),
            lost: 0,
        }),
        Request::GraphStart(_) => Some(Response::GraphStarted {
            session: 2,
            hooked: 37_657,
            roots: 1,
            skipped: 0,
        }),
        // The session's reads: no answer, ever.
        Request::TraceRead { .. } => None,
        Request::GraphStop { session: Some(2) } => Some(Response::Ok),
        other => Some(Response::error(
            protocol::ErrorKind::Internal,
            format!("unexpected {other:?}"),
        )),
    });
    let child = spawn(&["--socket", path.to_str().unwrap(), "graph", "--follow"]);
    wait_for_request(&seen, is_session_read);
    let (code, stderr, took) = interrupt(child);
    assert_eq!(code, Some(130), "{stderr}");
    assert!(took < PROMPTLY, "took {took:?}: {stderr}");
    assert_eq!(
        stderr.lines().last(),
        Some("hvtrace: function graph session 2 stopped by Ctrl-C after 0 lines"),
        "{stderr}"
    );
    server.join().unwrap();
    let seen = seen.lock().unwrap().clone();
    // The session was stopped, once, and last.
    assert_eq!(
        seen.last(),
        Some(&Request::GraphStop { session: Some(2) }),
        "{seen:?}"
    );
    assert_eq!(
        seen.iter()
            .filter(|r| matches!(r, Request::GraphStop { .. }))
            .count(),
        1
    );
    // Without --persist, the supervisor is not asked to keep the session.
    let Request::Hello { client, .. } = &seen[0] else {
        panic!("{seen:?}")
    };
    assert!(!client.contains(hvtrace::client::PERSIST_WORD), "{client}");
}

#[test]
fn graph_persist_says_so_in_hello() {
    let scratch = Scratch::new("persist");
    let path = scratch.socket();
    let (server, seen) = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => Some(hello()),
        Request::TraceRead { cursor, .. } => Some(Response::Trace {
            next: if *cursor == u64::MAX { 0 } else { *cursor },
            text: String::new(),
            lost: 0,
        }),
        Request::GraphStart(_) => Some(Response::GraphStarted {
            session: 2,
            hooked: 1,
            roots: 1,
            skipped: 0,
        }),
        _ => Some(Response::Ok),
    });
    let output = spawn(&["--socket", path.to_str().unwrap(), "graph", "--persist"])
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    server.join().unwrap();
    let seen = seen.lock().unwrap().clone();
    let Request::Hello { client, .. } = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!(
        client,
        &format!(
            "{} {}",
            hvtrace::client::CLIENT_NAME,
            hvtrace::client::PERSIST_WORD
        )
    );
    // The command still stops its own session when it ends.
    assert_eq!(seen.last(), Some(&Request::GraphStop { session: Some(2) }));
}

#[test]
fn trace_follow_ends_on_ctrl_c() {
    let scratch = Scratch::new("trace");
    let path = scratch.socket();
    let (server, seen) = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => Some(hello()),
        Request::TraceRead { cursor: 0, .. } => Some(Response::Trace {
            next: 1,
            text: "one line\n".into(),
            lost: 0,
        }),
        _ => None,
    });
    let child = spawn(&["--socket", path.to_str().unwrap(), "trace", "--follow"]);
    wait_for_request(&seen, |r| matches!(r, Request::TraceRead { cursor: 1, .. }));
    let (code, stderr, took) = interrupt(child);
    assert_eq!(code, Some(130), "{stderr}");
    assert!(took < PROMPTLY, "took {took:?}: {stderr}");
    assert_eq!(
        stderr.trim_end(),
        "hvtrace: trace stopped by Ctrl-C after 1 line"
    );
    server.join().unwrap();
}

#[test]
fn exec_wakes_and_says_what_goes_on() {
    let scratch = Scratch::new("exec");
    let path = scratch.socket();
    let (server, seen) = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => Some(hello()),
        _ => None,
    });
    let child = spawn(&["--socket", path.to_str().unwrap(), "exec", "sleep", "600"]);
    wait_for_request(&seen, |r| matches!(r, Request::Exec { .. }));
    let (code, stderr, took) = interrupt(child);
    assert_eq!(code, Some(130), "{stderr}");
    assert!(took < PROMPTLY, "took {took:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("hvtrace: interrupted (Ctrl-C); the command goes on in the guest"),
        "{stderr}"
    );
    server.join().unwrap();
}
