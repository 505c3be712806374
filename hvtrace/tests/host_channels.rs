//! The host channels, from the command line: where the default control
//! socket lives and what is refused about it, an unsafe `--socket`, and
//! guest text that reaches the terminal without control characters. None of
//! these cases needs an emulator: the control commands talk to a fake
//! supervisor.
//!
//! `a_socket_pre_bound_by_another_uid_is_refused` needs root: it starts a
//! process of a second user (`nobody`) to squat the socket's directory and
//! path, and fails saying so when run as anyone else.
//!
//! Run: `cargo test -p hvtrace --test host_channels`

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use protocol::io::{FrameReader, FrameWriter};
use protocol::{Body, ErrorKind, Frame, ProbeInfo, Request, Response, PROTOCOL_VERSION};

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "hvtrace-channels-test-{}-{test}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        set_mode(&dir, 0o700);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Held while a child process is started, and by a test while it closes a
/// listening socket that must be gone afterwards. Between its fork and its
/// exec, a child started by another test's thread holds a copy of every
/// descriptor of this process, a listener included: a socket closed in that
/// window still accepts connections until the child's exec, and a test
/// that expects "nothing listens" then sees a connection that is accepted
/// and closed. `Command::spawn` returns only once the child has exec'd, so
/// with the lock held no child holds such a copy.
fn spawn_lock() -> MutexGuard<'static, ()> {
    static SPAWN: Mutex<()> = Mutex::new(());
    SPAWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts `cmd` under [`spawn_lock`].
fn spawn(cmd: &mut Command) -> std::io::Result<Child> {
    let _lock = spawn_lock();
    cmd.spawn()
}

/// Runs hvtrace with `env` added; returns the exit code, stdout and stderr.
/// Without `XDG_RUNTIME_DIR` and `HVTRACE_TMPDIR` in `env`, the default
/// socket is under a directory that does not exist, never the user's: a
/// test that names none reaches no VM the user is running.
fn runs_with(args: &[&str], env: &[(&str, &Path)]) -> (i32, Vec<u8>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hvtrace"));
    cmd.args(args)
        .env("HVTRACE_ROOT", "/nonexistent-hvtrace-root")
        .env_remove("XDG_RUNTIME_DIR")
        .env("HVTRACE_TMPDIR", "/nonexistent-hvtrace-tmp")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        cmd.env(key, value);
    }
    let output = spawn(&mut cmd)
        .and_then(Child::wait_with_output)
        .expect("cannot run hvtrace");
    (
        output.status.code().unwrap_or(-1),
        output.stdout,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn runs(args: &[&str]) -> (i32, Vec<u8>, String) {
    runs_with(args, &[])
}

/// The message of a one-line failure.
fn failure(code: i32, stderr: &str) -> String {
    assert_eq!(code, 1, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr:?}");
    lines[0]
        .strip_prefix("hvtrace: error: ")
        .unwrap_or_else(|| panic!("{stderr:?}"))
        .to_string()
}

#[test]
fn the_default_socket_lives_in_a_private_runtime_directory() {
    let scratch = Scratch::new("xdg");
    let runtime = scratch.0.join("runtime");
    std::fs::create_dir(&runtime).unwrap();
    set_mode(&runtime, 0o700);
    let sub = runtime.join("hvtrace");
    // The fallback's base, in place of /tmp: a VM the user runs at the
    // real default is never reached.
    let tmp = scratch.0.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let env = [
        ("XDG_RUNTIME_DIR", runtime.as_path()),
        ("HVTRACE_TMPDIR", tmp.as_path()),
    ];

    // No VM: the client names the default socket and creates nothing.
    let (code, _, stderr) = runs_with(&["status"], &env);
    let msg = failure(code, &stderr);
    let expected = sub.join("hvtrace.sock");
    assert_eq!(
        msg,
        format!(
            "no VM is running at {}: the control socket does not exist (start one with `hvtrace run --detach`)",
            expected.display()
        )
    );
    assert!(!sub.exists());

    // A directory there that others can enter is refused, by name.
    std::fs::create_dir(&sub).unwrap();
    set_mode(&sub, 0o755);
    let (code, _, stderr) = runs_with(&["exec", "true"], &env);
    let msg = failure(code, &stderr);
    assert_eq!(
        msg,
        format!(
            "the control socket directory {} has mode 0755, not 0700; `chmod 700 {}` or pass --socket",
            sub.display(),
            sub.display()
        )
    );
    // So is a symbolic link, even to a private directory.
    std::fs::remove_dir(&sub).unwrap();
    let elsewhere = scratch.0.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    set_mode(&elsewhere, 0o700);
    std::os::unix::fs::symlink(&elsewhere, &sub).unwrap();
    let (code, _, stderr) = runs_with(&["stop"], &env);
    let msg = failure(code, &stderr);
    assert!(msg.contains("is a symbolic link"), "{msg}");
    assert!(msg.contains(&sub.display().to_string()), "{msg}");

    // A runtime directory that others can enter is not used at all: the
    // default falls back to hvtrace-$UID in the temporary base (/tmp
    // without HVTRACE_TMPDIR), which the client does not create either.
    set_mode(&runtime, 0o755);
    let euid = std::fs::metadata(&scratch.0).unwrap().uid();
    let fallback = tmp.join(format!("hvtrace-{euid}"));
    let (code, _, stderr) = runs_with(&["status"], &env);
    let msg = failure(code, &stderr);
    assert_eq!(
        msg,
        format!(
            "no VM is running at {}: the control socket does not exist (start one with `hvtrace run --detach`)",
            fallback.join("hvtrace.sock").display()
        )
    );
    assert!(!msg.contains(&runtime.display().to_string()), "{msg}");
    assert!(!fallback.exists());
}

#[test]
fn an_unsafe_socket_directory_is_refused() {
    let scratch = Scratch::new("unsafe");
    let open = scratch.0.join("open");
    std::fs::create_dir(&open).unwrap();
    set_mode(&open, 0o777);
    let sock = open.join("vm.sock");
    // A listener of our own is there, but anyone could have put it there.
    let listener = UnixListener::bind(&sock).unwrap();
    for args in [vec!["status"], vec!["run", "--detach"]] {
        let mut argv = vec!["--socket", sock.to_str().unwrap()];
        argv.extend(args);
        let (code, _, stderr) = runs(&argv);
        let msg = failure(code, &stderr);
        assert!(
            msg.contains("is writable by others (mode 0777) without the sticky bit"),
            "{argv:?}: {msg}"
        );
    }
    // The same directory with the sticky bit, as /tmp: accepted (the
    // socket file is ours), so the command gets as far as connecting.
    // Closed under the spawn lock, so that no child of another test keeps
    // it listening (see `spawn_lock`).
    {
        let _lock = spawn_lock();
        drop(listener);
    }
    set_mode(&open, 0o1777);
    let (code, _, stderr) = runs(&["--socket", sock.to_str().unwrap(), "status"]);
    let msg = failure(code, &stderr);
    assert!(msg.contains("is gone: nothing listens"), "{msg}");
}

/// Serves one connection on `path`: `Hello` as a supervisor would, every
/// other request with `answer` (given the request's number, from 0).
fn fake_supervisor(
    path: &Path,
    answer: impl Fn(u32, &Request) -> Response + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(stream.try_clone().unwrap());
        let mut w = FrameWriter::new(stream);
        let count = Arc::new(AtomicU32::new(0));
        while let Ok(frame) = r.read_frame() {
            let Body::Request(req) = &frame.body else {
                continue;
            };
            let response = match req {
                Request::Hello { .. } => Response::Hello {
                    version: PROTOCOL_VERSION,
                    hypervisor: "fake".into(),
                },
                other => answer(count.fetch_add(1, Ordering::SeqCst), other),
            };
            if w.write_frame(&Frame::response(frame.seq, response))
                .is_err()
            {
                return;
            }
        }
    })
}

/// Guest text with a terminal title change, a colour and a C1 CSI.
const HOSTILE: &str = "evil\u{1b}]0;owned\u{7}\u{1b}[31mred\u{9b}2J";
/// [`HOSTILE`] as the terminal gets it.
const ESCAPED: &str = "evil\\x1b]0;owned\\x07\\x1b[31mred\\x9b2J";

fn no_controls(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    assert!(
        !text
            .chars()
            .any(|c| c != '\n' && c != '\t' && (c.is_control())),
        "{text:?}"
    );
}

#[test]
fn guest_text_reaches_the_terminal_escaped() {
    let scratch = Scratch::new("hostile");
    let probes = || {
        Response::Probes(vec![ProbeInfo {
            name: "kprobes/x".into(),
            spec: format!("p:kprobes/x {HOSTILE}"),
            symbol: HOSTILE.into(),
            site: 0x1000,
            hits: 1,
            misses: 0,
            pending: false,
        }])
    };

    // Text: visible escapes.
    let path = scratch.0.join("list.sock");
    let server = fake_supervisor(&path, move |_, _| probes());
    let (code, stdout, stderr) = runs(&["--socket", path.to_str().unwrap(), "probe", "list"]);
    assert_eq!(code, 0, "{stderr}");
    no_controls(&stdout);
    let text = String::from_utf8(stdout).unwrap();
    assert!(
        text.ends_with(&format!("p:kprobes/x {ESCAPED}\n")),
        "{text:?}"
    );
    server.join().unwrap();

    // JSON: JSON escapes, which decode to the guest's text.
    let path = scratch.0.join("json.sock");
    let server = fake_supervisor(&path, move |_, _| probes());
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "probe",
        "list",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    no_controls(&stdout);
    let value: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(value["symbol"], HOSTILE);
    server.join().unwrap();

    // Trace lines on stdout, in both formats.
    for (format, expected) in [
        ("text", format!("comm {ESCAPED}\n")),
        (
            "json",
            "{\"comm\":\"evil\\u001b]0;owned\\u0007\\u001b[31mred\\u009b2J\"}\n".to_string(),
        ),
    ] {
        let path = scratch.0.join(format!("trace-{format}.sock"));
        let line = if format == "text" {
            format!("comm {HOSTILE}\n")
        } else {
            // The hypervisor escapes C0 in JSON strings but not C1 or DEL;
            // a raw one must not reach the terminal either.
            "{\"comm\":\"evil\\u001b]0;owned\\u0007\\u001b[31mred\u{9b}2J\"}\n".to_string()
        };
        let server = fake_supervisor(&path, move |n, req| match req {
            Request::TraceRead { cursor, .. } if n == 0 => Response::Trace {
                next: cursor.saturating_add(1),
                text: line.clone(),
                lost: 0,
            },
            Request::TraceRead { cursor, .. } => Response::Trace {
                next: *cursor,
                text: String::new(),
                lost: 0,
            },
            _ => Response::error(ErrorKind::Unsupported, "no"),
        });
        let (code, stdout, stderr) = runs(&[
            "--socket",
            path.to_str().unwrap(),
            "trace",
            "--format",
            format,
        ]);
        assert_eq!(code, 0, "{stderr}");
        no_controls(&stdout);
        assert_eq!(String::from_utf8(stdout).unwrap(), expected);
        server.join().unwrap();
    }

    // Errors that quote the guest.
    let path = scratch.0.join("error.sock");
    let server = fake_supervisor(&path, |_, _| {
        Response::error(ErrorKind::Internal, format!("exec failed: {HOSTILE}"))
    });
    let (code, _, stderr) = runs(&["--socket", path.to_str().unwrap(), "exec", "true"]);
    let msg = failure(code, &stderr);
    assert_eq!(msg, format!("exec failed: {ESCAPED}"));
    server.join().unwrap();

    // The output of a guest command into a pipe (not a terminal) is the
    // guest's, byte for byte.
    let path = scratch.0.join("exec.sock");
    let server = fake_supervisor(&path, |_, _| Response::Exec {
        output: HOSTILE.to_string(),
        status: 0,
    });
    let (code, stdout, stderr) = runs(&["--socket", path.to_str().unwrap(), "exec", "cat", "x"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, HOSTILE.as_bytes());
    server.join().unwrap();
}

/// The uid and gid the other user's process runs as.
const NOBODY: u32 = 65534;
/// The environment variable that makes this test binary the other user's
/// process (see `other_user_helper`): `DIR SOCKET`.
const HELPER_ENV: &str = "HVTRACE_TEST_OTHER_USER";
/// The line the helper prints once its socket listens.
const HELPER_READY: &str = "other-user-helper: listening";

/// Not a test of its own: run by [`as_nobody`] in a child process as user
/// `nobody`, it creates the directory `DIR` (mode 0700) when it is missing,
/// binds and listens on `SOCKET`, says so on stdout, and keeps listening
/// until its stdin closes. Without [`HELPER_ENV`] it does nothing.
#[test]
fn other_user_helper() {
    let Some(spec) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    let spec = spec.into_string().expect("a UTF-8 helper spec");
    let (dir, socket) = spec.split_once(' ').expect("`DIR SOCKET`");
    let dir = Path::new(dir);
    if !dir.exists() {
        std::fs::create_dir(dir).expect("the helper cannot create the directory");
        set_mode(dir, 0o700);
    }
    let listener = UnixListener::bind(socket).expect("the helper cannot bind the socket");
    // Straight to the descriptor: the test harness may capture `println!`.
    let mut out = std::io::stdout();
    writeln!(out, "{HELPER_READY}").unwrap();
    out.flush().unwrap();
    // Until the test closes our stdin.
    let _ = std::io::stdin().read_line(&mut String::new());
    drop(listener);
}

/// A process of user `nobody` (uid and gid [`NOBODY`]), listening on
/// `socket` (and having made `dir` if it was missing); it ends when
/// dropped. Its stdout stays open until then (the harness in it still
/// writes there).
struct OtherUser(Child, Option<BufReader<ChildStdout>>);

impl Drop for OtherUser {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// Starts this test binary as user `nobody` (`Command::uid`/`gid`: a fork,
/// then setgid and setuid in the child, then exec) running
/// `other_user_helper`, and waits until its socket listens.
fn as_nobody(dir: &Path, socket: &Path) -> OtherUser {
    assert_eq!(
        hvtrace::sys::euid(),
        0,
        "this test needs root: it creates a second user's process (setuid to nobody, uid {NOBODY}) \
         to pre-create the socket directory and pre-bind the socket; run it as root"
    );
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(&exe);
    cmd.args([
        "--exact",
        "other_user_helper",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(
        HELPER_ENV,
        format!("{} {}", dir.display(), socket.display()),
    )
    .uid(NOBODY)
    .gid(NOBODY)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut child = OtherUser(
        spawn(&mut cmd)
            .unwrap_or_else(|e| panic!("cannot run {} as uid {NOBODY}: {e}", exe.display())),
        None,
    );
    let stdout = child
        .1
        .insert(BufReader::new(child.0.stdout.take().unwrap()));
    let mut line = String::new();
    let ready = loop {
        line.clear();
        match stdout.read_line(&mut line) {
            Ok(0) | Err(_) => break false,
            // The harness may have begun the line (`test other_user_helper ... `).
            Ok(_) if line.trim_end().ends_with(HELPER_READY) => break true,
            Ok(_) => {}
        }
    };
    assert!(
        ready,
        "the helper running as uid {NOBODY} did not get its socket listening \
         (can uid {NOBODY} execute {}?)",
        exe.display()
    );
    child
}

#[test]
fn a_socket_pre_bound_by_another_uid_is_refused() {
    let scratch = Scratch::new("other-uid");
    // The other user may pass through (not list) the scratch directory.
    set_mode(&scratch.0, 0o711);

    // 1. The default directory, made by another user. The runtime directory
    // is ours and private; `nobody` makes `hvtrace` in it (we let it in for
    // that moment) and listens on the default socket there.
    let runtime = scratch.0.join("runtime");
    std::fs::create_dir(&runtime).unwrap();
    set_mode(&runtime, 0o777);
    let sub = runtime.join("hvtrace");
    let default_sock = sub.join("hvtrace.sock");
    let squatter = as_nobody(&sub, &default_sock);
    set_mode(&runtime, 0o700);
    assert_eq!(std::fs::symlink_metadata(&sub).unwrap().uid(), NOBODY);
    let tmp = scratch.0.join("tmp");
    let env = [
        ("XDG_RUNTIME_DIR", runtime.as_path()),
        ("HVTRACE_TMPDIR", tmp.as_path()),
    ];
    let owned_by_nobody = format!(
        "the control socket directory {} is owned by uid {NOBODY}, not you (uid 0); remove it or pass --socket",
        sub.display()
    );
    // The supervisor side: `run --detach` will not serve there.
    let (code, _, stderr) = runs_with(&["run", "--detach"], &env);
    assert_eq!(failure(code, &stderr), owned_by_nobody);
    // The client side: `status` will not connect there.
    let (code, _, stderr) = runs_with(&["status"], &env);
    assert_eq!(failure(code, &stderr), owned_by_nobody);
    drop(squatter);

    // 2. A socket path in a directory of ours that others may create in (a
    // sticky one, as /tmp), pre-bound by another user.
    let shared = scratch.0.join("shared");
    std::fs::create_dir(&shared).unwrap();
    set_mode(&shared, 0o1777);
    let sock = shared.join("vm.sock");
    let squatter = as_nobody(&shared, &sock);
    let s = sock.to_str().unwrap();
    let owned =
        format!("refusing the control socket {s}: it is owned by uid {NOBODY}, not you (uid 0)");
    // The supervisor side refuses the pre-bound path, and leaves it alone.
    let (code, _, stderr) = runs(&["--socket", s, "run", "--detach"]);
    assert_eq!(failure(code, &stderr), owned);
    assert_eq!(std::fs::symlink_metadata(&sock).unwrap().uid(), NOBODY);
    // So does the client.
    let (code, _, stderr) = runs(&["--socket", s, "status"]);
    assert_eq!(failure(code, &stderr), owned);

    // 3. The same socket with its file made ours (as if the other user's
    // server had been handed a path that passes every file check): the
    // client connects, sees by SO_PEERCRED that uid 65534 serves it, and
    // refuses to talk.
    std::os::unix::fs::lchown(&sock, Some(0), Some(0)).unwrap();
    for args in [vec!["status"], vec!["exec", "true"], vec!["stop"]] {
        let mut argv = vec!["--socket", s];
        argv.extend(&args);
        let (code, _, stderr) = runs(&argv);
        assert_eq!(
            failure(code, &stderr),
            format!(
                "the control socket {s} is served by uid {NOBODY}, not you (uid 0); refusing to talk to it"
            ),
            "{argv:?}"
        );
    }
    drop(squatter);
}
