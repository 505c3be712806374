//! Bad options and missing files: one `hvtrace: error:` line on stderr, a
//! non-zero exit, no panic, and nothing started. None of these cases needs an
//! emulator, a kernel or the hypervisor.
//!
//! The control commands are checked against a missing socket, a stale one
//! and a fake supervisor (version mismatch, ended VM).
//!
//! Run: `cargo test -p hvtrace --test cli_errors`

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-cli-test-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// A file that exists, for the options that must point at one.
    fn file(&self, name: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, b"not really a kernel").unwrap();
        path.to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// hvtrace, with nothing of the user's to find: no repository (guest
/// images), and a default control socket under a directory that does not
/// exist (the tests name theirs with `--socket`).
fn hvtrace() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hvtrace"));
    cmd.env("HVTRACE_ROOT", "/nonexistent-hvtrace-root")
        .env_remove("XDG_RUNTIME_DIR")
        .env("HVTRACE_TMPDIR", "/nonexistent-hvtrace-tmp");
    cmd
}

/// Runs hvtrace and checks the one-line failure; returns the message.
fn fails(args: &[&str]) -> String {
    let output = hvtrace()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{args:?} succeeded: {stderr}");
    assert!(
        output.stdout.is_empty(),
        "{args:?} printed on stdout: {:?}",
        String::from_utf8_lossy(&output.stdout)
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{args:?} did not print exactly one line: {stderr:?}"
    );
    let line = lines[0];
    assert!(line.starts_with("hvtrace: error: "), "{args:?}: {line:?}");
    for bad in [
        "panicked",
        "backtrace",
        "RUST_BACKTRACE",
        "Caused by",
        "Usage:",
    ] {
        assert!(!line.contains(bad), "{args:?}: {line:?}");
    }
    line["hvtrace: error: ".len()..].to_string()
}

#[test]
fn missing_kernel() {
    let msg = fails(&["run", "--bare", "--kernel", "/nonexistent/bzImage"]);
    assert!(
        msg.contains("kernel /nonexistent/bzImage not found"),
        "{msg}"
    );
}

#[test]
fn missing_initrd() {
    let scratch = Scratch::new("initrd");
    let kernel = scratch.file("bzImage");
    let msg = fails(&[
        "run",
        "--bare",
        "--kernel",
        &kernel,
        "--initrd",
        "/nonexistent/initrd",
    ]);
    assert!(
        msg.contains("initrd /nonexistent/initrd not found"),
        "{msg}"
    );
}

#[test]
fn missing_hypervisor() {
    let scratch = Scratch::new("hypervisor");
    let kernel = scratch.file("bzImage");
    let initrd = scratch.file("initrd");
    let msg = fails(&[
        "run",
        "--kernel",
        &kernel,
        "--initrd",
        &initrd,
        "--hypervisor",
        "/nonexistent/hypervisor",
    ]);
    assert!(
        msg.contains("hypervisor image /nonexistent/hypervisor not found"),
        "{msg}"
    );
}

#[test]
fn bad_emulator() {
    let msg = fails(&["run", "--emulator", "vmware"]);
    assert!(msg.contains("invalid value 'vmware'"), "{msg}");
    assert!(msg.contains("bochs") && msg.contains("qemu"), "{msg}");
}

#[test]
fn nokaslr_is_refused() {
    let msg = fails(&["run", "--bare", "--append", "console=ttyS0,115200 nokaslr"]);
    assert!(msg.contains("nokaslr"), "{msg}");
    assert!(msg.contains("--allow-nokaslr"), "{msg}");
    // With the override the next problem is reported instead.
    let msg = fails(&[
        "run",
        "--bare",
        "--allow-nokaslr",
        "--append",
        "nokaslr",
        "--kernel",
        "/nonexistent/bzImage",
    ]);
    assert!(
        msg.contains("kernel /nonexistent/bzImage not found"),
        "{msg}"
    );
}

#[test]
fn bare_conflicts_with_hypervisor() {
    let msg = fails(&["run", "--bare", "--hypervisor", "/x"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
}

#[test]
fn unknown_subcommand_and_option() {
    let msg = fails(&["frobnicate"]);
    assert!(msg.contains("frobnicate"), "{msg}");
    let msg = fails(&["run", "--no-such-option"]);
    assert!(msg.contains("--no-such-option"), "{msg}");
}

#[test]
fn bad_numbers() {
    let msg = fails(&["run", "--memory", "lots"]);
    assert!(msg.contains("lots"), "{msg}");
    let msg = fails(&["run", "--bare", "--timeout", "0"]);
    assert!(msg.contains("--timeout"), "{msg}");
    for cpus in ["0", "17"] {
        let msg = fails(&["run", "--bare", "--cpus", cpus]);
        assert!(msg.contains("--cpus must be between 1 and 16"), "{msg}");
    }
}

#[test]
fn modules_option_errors() {
    let scratch = Scratch::new("modules");
    let file = scratch.file("file");
    // Only the Debian guest's initramfs carries its package's modules.
    let msg = fails(&["run", "--guest", "fast", "--modules", "xfs"]);
    assert_eq!(
        msg,
        "--modules adds modules of Debian's kernel package to the Debian guest's initramfs; the fast-lane guest (--guest fast) takes none"
    );
    // An initramfs or a kernel of the user's: the modules are theirs to add.
    for other in ["--initrd", "--kernel"] {
        let msg = fails(&["run", "--modules", "xfs", other, &file]);
        assert!(
            msg.contains("'--modules <LIST>' cannot be used with") && msg.contains(other),
            "{msg}"
        );
    }
    // Names as modprobe takes them: no paths, no .ko, none empty.
    for (list, bad) in [
        ("xfs,ext4.ko", "'ext4.ko' is not a module name"),
        ("xfs,../fs/xfs", "'../fs/xfs' is not a module name"),
        ("xfs,,btrfs", "an empty module name"),
        ("", "an empty module name"),
    ] {
        let msg = fails(&["run", "--modules", list]);
        assert!(
            msg.contains("--modules <LIST>") && msg.contains(bad),
            "{list}: {msg}"
        );
    }
}

#[test]
fn help_works() {
    let output = Command::new(env!("CARGO_BIN_EXE_hvtrace"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    for option in [
        "--kernel",
        "--initrd",
        "--append",
        "--emulator",
        "--exec",
        "--bare",
        "--timeout",
        "--cpus",
        "--modules",
        "--socket",
    ] {
        assert!(text.contains(option), "help lacks {option}");
    }
}

// ----- the control commands, against no VM or a fake supervisor -----

use std::os::unix::net::UnixListener;

use protocol::io::{FrameReader, FrameWriter};
use protocol::{Body, ErrorKind, Frame, Request, Response, PROTOCOL_VERSION};

/// Serves one connection on `path`, answering each request frame with
/// `answer`.
fn fake_supervisor(
    path: &std::path::Path,
    answer: impl Fn(&Request) -> Response + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(stream.try_clone().unwrap());
        let mut w = FrameWriter::new(stream);
        while let Ok(frame) = r.read_frame() {
            if let Body::Request(req) = &frame.body {
                if w.write_frame(&Frame::response(frame.seq, answer(req)))
                    .is_err()
                {
                    return;
                }
            }
        }
    })
}

#[test]
fn control_commands_without_a_vm() {
    let scratch = Scratch::new("novm");
    let missing = scratch.0.join("missing.sock");
    let missing = missing.to_str().unwrap();
    for args in [
        vec!["--socket", missing, "status"],
        vec!["--socket", missing, "exec", "true"],
        vec!["--socket", missing, "stop"],
    ] {
        let msg = fails(&args);
        assert!(msg.starts_with("no VM is running at"), "{args:?}: {msg}");
        assert!(msg.contains(missing), "{msg}");
    }
    // A socket file nobody listens on: the VM died without cleaning up.
    let stale = scratch.0.join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let msg = fails(&["--socket", stale.to_str().unwrap(), "status", "--json"]);
    assert!(msg.contains("is gone"), "{msg}");
}

#[test]
fn version_mismatch_is_one_line() {
    let scratch = Scratch::new("version");
    let path = scratch.0.join("old.sock");
    let server = fake_supervisor(&path, |_| Response::VersionMismatch {
        ours: PROTOCOL_VERSION + 1,
        theirs: PROTOCOL_VERSION,
    });
    let msg = fails(&["--socket", path.to_str().unwrap(), "status"]);
    assert!(msg.starts_with("protocol version mismatch"), "{msg}");
    server.join().unwrap();
}

#[test]
fn ended_vm_is_one_line() {
    let scratch = Scratch::new("ended");
    let path = scratch.0.join("ended.sock");
    let server = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => Response::Hello {
            version: PROTOCOL_VERSION,
            hypervisor: "fake".into(),
        },
        _ => Response::error(
            ErrorKind::NotReady,
            "the VM has ended (guest stopped: triple fault)",
        ),
    });
    let msg = fails(&["--socket", path.to_str().unwrap(), "exec", "uname", "-r"]);
    assert_eq!(msg, "the VM has ended (guest stopped: triple fault)");
    server.join().unwrap();
}

#[test]
fn detach_refuses_a_taken_socket() {
    let scratch = Scratch::new("taken");
    let live = scratch.0.join("live.sock");
    let _listener = UnixListener::bind(&live).unwrap();
    let msg = fails(&["--socket", live.to_str().unwrap(), "run", "--detach"]);
    assert!(msg.contains("already owns"), "{msg}");
    let file = scratch.file("plain");
    let msg = fails(&["--socket", &file, "run", "--detach"]);
    assert!(msg.contains("is not a socket"), "{msg}");
    assert!(std::path::Path::new(&file).is_file());
    let msg = fails(&["run", "--detach", "--bare"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
}

// ----- probes and tracing -----

/// Runs hvtrace; returns the exit code, stdout and stderr.
fn runs(args: &[&str]) -> (i32, String, String) {
    let output = hvtrace()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn bad_probe_spec_points_at_the_token_without_a_vm() {
    let scratch = Scratch::new("badspec");
    let missing = scratch.0.join("missing.sock");
    let spec = "p:myopen do_sys_openat2 dfd=%dj";
    let (code, stdout, stderr) =
        runs(&["--socket", missing.to_str().unwrap(), "probe", "add", spec]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stdout.is_empty());
    let lines: Vec<&str> = stderr.lines().collect();
    // The error line first, on its own; then the spec and the caret.
    assert_eq!(
        lines,
        [
            r#"hvtrace: error: probe spec: bad register name "%dj" at column 29"#,
            "  p:myopen do_sys_openat2 dfd=%dj",
            "                              ^~~",
        ],
        "{stderr}"
    );
}

#[test]
fn probe_removal_spec_is_refused_with_a_hint() {
    let msg = fails(&[
        "--socket",
        "/nonexistent/x.sock",
        "probe",
        "add",
        "-:myopen",
    ]);
    assert!(msg.contains("hvtrace probe del myopen"), "{msg}");
}

#[test]
fn probe_and_trace_commands_without_a_vm() {
    let scratch = Scratch::new("probenovm");
    let missing = scratch.0.join("missing.sock");
    let missing = missing.to_str().unwrap();
    for args in [
        vec!["--socket", missing, "probe", "add", "p vfs_read"],
        vec!["--socket", missing, "probe", "del", "p_vfs_read_0"],
        vec!["--socket", missing, "probe", "list"],
        vec!["--socket", missing, "trace"],
        vec![
            "--socket",
            missing,
            "trace",
            "--follow",
            "--function",
            "vfs_*",
        ],
    ] {
        let msg = fails(&args);
        assert!(msg.starts_with("no VM is running at"), "{args:?}: {msg}");
    }
}

#[test]
fn traced_run_option_errors() {
    let msg = fails(&["run", "--bare", "--probe", "p vfs_read", "--exec", "true"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
    let msg = fails(&["run", "--probe", "p vfs_read"]);
    assert!(msg.contains("--exec"), "{msg}");
    let msg = fails(&["run", "--format", "json", "--exec", "true"]);
    assert!(msg.contains("--probe"), "{msg}");
    let msg = fails(&["run", "--detach", "--function", "vfs_*"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
    // An unwritable --output fails before anything is built.
    let msg = fails(&[
        "run",
        "--function",
        "vfs_*",
        "--exec",
        "true",
        "--output",
        "/nonexistent/dir/trace.txt",
    ]);
    assert!(
        msg.starts_with("cannot create /nonexistent/dir/trace.txt"),
        "{msg}"
    );
}

#[test]
fn traced_run_checks_probe_specs_before_booting() {
    let (code, stdout, stderr) = runs(&["run", "--probe", "p vfs_read %rax", "--exec", "true"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stdout.is_empty());
    let first = stderr.lines().next().unwrap_or("");
    assert_eq!(
        first,
        r#"hvtrace: error: --probe "p vfs_read %rax": probe spec: bad register name "%rax" at column 12 (kprobe_events calls it %ax)"#
    );
    assert!(stderr.contains("           ^~~~"), "{stderr}");
}

/// Serves one connection on `path` with a stateful `answer`.
fn fake_supervisor_mut(
    path: &std::path::Path,
    mut answer: impl FnMut(&Request) -> Response + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut r = FrameReader::new(stream.try_clone().unwrap());
        let mut w = FrameWriter::new(stream);
        while let Ok(frame) = r.read_frame() {
            if let Body::Request(req) = &frame.body {
                if w.write_frame(&Frame::response(frame.seq, answer(req)))
                    .is_err()
                {
                    return;
                }
            }
        }
    })
}

fn hello() -> Response {
    Response::Hello {
        version: PROTOCOL_VERSION,
        hypervisor: "fake".into(),
    }
}

#[test]
fn probe_commands_against_a_fake_supervisor() {
    let scratch = Scratch::new("probes");
    let path = scratch.0.join("ok.sock");
    let server = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => hello(),
        Request::ProbeAdd { spec } if spec == "p:myopen do_sys_openat2 dfd=%di" => {
            Response::ProbeAdded {
                name: "kprobes/myopen".into(),
                site: 0xffff_ffff_8123_4564,
            }
        }
        other => Response::error(ErrorKind::Internal, format!("unexpected {other:?}")),
    });
    // Unquoted words make one spec.
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "probe",
        "add",
        "p:myopen",
        "do_sys_openat2",
        "dfd=%di",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "added kprobes/myopen at 0xffffffff81234564\n");
    server.join().unwrap();

    let path = scratch.0.join("del.sock");
    let server = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => hello(),
        Request::ProbeDel { name } => {
            Response::error(ErrorKind::NotFound, format!("no probe named {name}"))
        }
        _ => Response::error(ErrorKind::Internal, "unexpected"),
    });
    let msg = fails(&["--socket", path.to_str().unwrap(), "probe", "del", "nope"]);
    assert_eq!(msg, "no probe named nope");
    server.join().unwrap();

    let path = scratch.0.join("list.sock");
    let server = fake_supervisor(&path, |req| match req {
        Request::Hello { .. } => hello(),
        Request::ProbeList => Response::Probes(vec![protocol::ProbeInfo {
            name: "kprobes/myopen".into(),
            spec: "p:kprobes/myopen do_sys_openat2 dfd=%di".into(),
            symbol: "do_sys_openat2".into(),
            site: 0x1000,
            hits: 7,
            misses: 0,
            pending: false,
        }]),
        _ => Response::error(ErrorKind::Internal, "unexpected"),
    });
    let (code, stdout, stderr) = runs(&["--socket", path.to_str().unwrap(), "probe", "list"]);
    assert_eq!(code, 0, "{stderr}");
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    assert_eq!(
        fields,
        [
            "kprobes/myopen",
            "7",
            "0",
            "p:kprobes/myopen",
            "do_sys_openat2",
            "dfd=%di"
        ]
    );
    server.join().unwrap();
}

#[test]
fn trace_reads_until_quiet() {
    let scratch = Scratch::new("trace");
    let path = scratch.0.join("trace.sock");
    let mut reads = 0u64;
    let server = fake_supervisor_mut(&path, move |req| match req {
        Request::Hello { .. } => hello(),
        Request::FunctionAdd { glob } => Response::FunctionAdded {
            traced: 12,
            skipped: vec![format!("{glob}: 1 notrace")],
            skipped_total: 1,
        },
        Request::TraceRead {
            cursor,
            format: protocol::TraceFormat::Json,
            ..
        } => {
            reads += 1;
            match reads {
                1 => Response::Trace {
                    next: cursor + 2,
                    text: "{\"a\":1}\n{\"a\":2}\n".into(),
                    lost: 0,
                },
                2 => Response::Trace {
                    next: cursor + 1,
                    text: String::new(),
                    lost: 5,
                },
                3 => Response::Trace {
                    next: cursor + 1,
                    text: "{\"a\":3}\n".into(),
                    lost: 0,
                },
                _ => Response::Trace {
                    next: *cursor,
                    text: String::new(),
                    lost: 0,
                },
            }
        }
        other => Response::error(ErrorKind::Internal, format!("unexpected {other:?}")),
    });
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "trace",
        "--format",
        "json",
        "--function",
        "vfs_*",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n");
    assert_eq!(
        stderr,
        "hvtrace: function tracer on vfs_*: 12 traced, 1 skipped (vfs_*: 1 notrace)\nhvtrace: 5 events lost\n"
    );
    server.join().unwrap();
}

#[test]
fn trace_follow_ends_with_the_vm() {
    let scratch = Scratch::new("follow");
    let path = scratch.0.join("follow.sock");
    let mut reads = 0u64;
    let server = fake_supervisor_mut(&path, move |req| match req {
        Request::Hello { .. } => hello(),
        Request::TraceRead { cursor, .. } => {
            reads += 1;
            match reads {
                1 => Response::Trace {
                    next: cursor + 1,
                    text: "line\n".into(),
                    lost: 0,
                },
                // An empty answer does not end --follow.
                2 => Response::Trace {
                    next: *cursor,
                    text: String::new(),
                    lost: 0,
                },
                _ => Response::error(
                    ErrorKind::NotReady,
                    "the VM has ended (guest stopped: power off)",
                ),
            }
        }
        other => Response::error(ErrorKind::Internal, format!("unexpected {other:?}")),
    });
    let (code, stdout, stderr) = runs(&["--socket", path.to_str().unwrap(), "trace", "--follow"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "line\n");
    assert_eq!(
        stderr,
        "hvtrace: the VM has ended (guest stopped: power off)\n"
    );
    server.join().unwrap();
}

// ----- the function graph -----

use std::sync::{Arc, Mutex};

use protocol::{GraphFilter, TraceFormat};

/// Where the fake supervisor's trace buffer ends when `graph` starts.
const GRAPH_CURSOR: u64 = 40;

/// The session the fake hypervisor starts.
const GRAPH_SESSION: u32 = 2;

/// The stop of the fake's session.
const GRAPH_STOP: Request = Request::GraphStop {
    session: Some(GRAPH_SESSION),
};

/// Whether `r` stops any graph session.
fn is_graph_stop(r: &Request) -> bool {
    matches!(r, Request::GraphStop { .. })
}

/// A fake supervisor for `graph`: it records the requests, answers the
/// first `TraceRead` (from past the end) with the end of its buffer, starts
/// graph session [`GRAPH_SESSION`], then serves `reads` of that session in
/// turn (an empty answer once they run out) and acknowledges the stop of
/// that session. Reads of another source and other stops are refused.
fn fake_graph_supervisor(
    path: &std::path::Path,
    reads: Vec<Response>,
) -> (std::thread::JoinHandle<()>, Arc<Mutex<Vec<Request>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let mut reads = reads.into_iter();
    let server = fake_supervisor_mut(path, move |req| {
        // The views' status at the start and at the end of a session is
        // left out of the log: this supervisor has none to give (the
        // closing line then leaves the views out).
        if *req == Request::Status {
            return Response::error(ErrorKind::NotReady, "no status here");
        }
        log.lock().unwrap().push(req.clone());
        match req {
            Request::Hello { .. } => hello(),
            Request::TraceRead {
                cursor: u64::MAX, ..
            } => Response::Trace {
                next: GRAPH_CURSOR,
                text: String::new(),
                lost: 0,
            },
            Request::GraphStart(f) if f.functions.iter().any(|g| g == "vfs_nope") => {
                Response::error(
                    ErrorKind::NotFound,
                    "no traceable function matches vfs_nope",
                )
            }
            Request::GraphStart(_) => Response::GraphStarted {
                session: GRAPH_SESSION,
                hooked: 12,
                roots: 1,
                skipped: 0,
            },
            Request::TraceRead {
                cursor,
                source: Some(GRAPH_SESSION),
                ..
            } => reads.next().unwrap_or(Response::Trace {
                next: *cursor,
                text: String::new(),
                lost: 0,
            }),
            Request::GraphStop {
                session: Some(GRAPH_SESSION),
            } => Response::Ok,
            other => Response::error(ErrorKind::Internal, format!("unexpected {other:?}")),
        }
    });
    (server, seen)
}

const GRAPH_TEXT: &str = " 0)               |  vfs_read() {\n 0)   0.812 us    |    rw_verify_area();\n 0) + 15.062 us   |  }\n";

fn graph_json_lines() -> String {
    [
        r#"{"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","depth":0}"#,
        r#"{"ts":"5.000001","ts_ns":5000001000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"rw_verify_area","depth":1}"#,
        r#"{"ts":"5.000002","ts_ns":5000001812,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"rw_verify_area","depth":1,"duration_ns":812,"retval":"0x0"}"#,
        r#"{"ts":"5.000003","ts_ns":5000003000,"cpu":0,"pid":7,"comm":"sh","kind":"kprobe","event":"kprobes/p_vfs_read_0"}"#,
        // The return of a call that began before the graph did.
        r#"{"ts":"5.000004","ts_ns":5000004000,"cpu":0,"pid":7,"comm":"sh","kind":"graph_return","func":"ksys_read","depth":0,"duration_ns":9000,"retval":"0x1"}"#,
        r#"{"ts":"5.000015","ts_ns":5000015062,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":15062,"retval":"0x40"}"#,
        // Still open at the end.
        r#"{"ts":"5.000020","ts_ns":5000020000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","depth":0}"#,
    ]
    .iter()
    .map(|l| format!("{l}\n"))
    .collect()
}

fn requests(seen: &Arc<Mutex<Vec<Request>>>) -> Vec<Request> {
    seen.lock().unwrap().clone()
}

/// Checks a Chrome trace document: it parses, and each thread's B and E
/// events nest and balance. Returns the B/E events as `(tid, ph, name)`.
fn check_chrome(doc: &str) -> Vec<(i64, String, String)> {
    let v: serde_json::Value = serde_json::from_str(doc).expect("not JSON");
    assert_eq!(v["displayTimeUnit"], "ns");
    let mut open: std::collections::BTreeMap<i64, Vec<String>> = Default::default();
    let mut out = Vec::new();
    for e in v["traceEvents"].as_array().unwrap() {
        let ph = e["ph"].as_str().unwrap().to_string();
        if ph == "M" {
            continue;
        }
        let tid = e["tid"].as_i64().unwrap();
        let name = e["name"].as_str().unwrap().to_string();
        let stack = open.entry(tid).or_default();
        match ph.as_str() {
            "B" => stack.push(name.clone()),
            "E" => assert_eq!(stack.pop().as_deref(), Some(name.as_str()), "{doc}"),
            _ => panic!("phase {ph}"),
        }
        out.push((tid, ph, name));
    }
    assert!(open.values().all(Vec::is_empty), "{doc}");
    out
}

#[test]
fn graph_without_a_vm_and_bad_filters() {
    let scratch = Scratch::new("graphnovm");
    let missing = scratch.0.join("missing.sock");
    let missing = missing.to_str().unwrap();
    for args in [
        vec!["--socket", missing, "graph"],
        vec![
            "--socket",
            missing,
            "graph",
            "--function",
            "vfs_read",
            "--format",
            "chrome",
            "-f",
        ],
    ] {
        let msg = fails(&args);
        assert!(msg.starts_with("no VM is running at"), "{args:?}: {msg}");
    }
    // Filters are checked before anything else.
    let msg = fails(&["--socket", missing, "graph", "--function", ""]);
    assert_eq!(msg, r#"--function needs a glob (got "")"#);
    let msg = fails(&["--socket", missing, "graph", "--trace", "a b"]);
    assert!(msg.contains("one glob per --trace"), "{msg}");
    let msg = fails(&["--socket", missing, "graph", "--graph-notrace", ""]);
    assert_eq!(msg, r#"--graph-notrace needs a glob (got "")"#);
    let msg = fails(&["--socket", missing, "graph", "--comm", "a-very-long-name"]);
    assert!(msg.contains("at most 15 bytes"), "{msg}");
    let msg = fails(&["graph", "--pid", "-3"]);
    assert!(msg.contains("-3 is not in 0..="), "{msg}");
    let msg = fails(&["graph", "--format", "xml"]);
    assert!(msg.contains("possible values: text, json, chrome"), "{msg}");
}

#[test]
fn graph_run_option_errors() {
    let msg = fails(&["run", "--graph", "vfs_read"]);
    assert!(msg.contains("--exec"), "{msg}");
    let msg = fails(&[
        "run",
        "--format",
        "chrome",
        "--function",
        "x",
        "--exec",
        "true",
    ]);
    assert!(msg.contains("--graph"), "{msg}");
    let msg = fails(&["run", "--graph-trace", "vfs_*", "--exec", "true"]);
    assert!(msg.contains("--graph"), "{msg}");
    let msg = fails(&["run", "--graph-ftrace-notrace", "x", "--exec", "true"]);
    assert!(msg.contains("--graph"), "{msg}");
    let msg = fails(&[
        "run",
        "--graph",
        "vfs_read",
        "--graph-ftrace-notrace",
        "a b",
        "--exec",
        "true",
    ]);
    assert_eq!(
        msg,
        r#"--graph-ftrace-notrace "a b": one glob per --graph-ftrace-notrace (repeat the option for more)"#
    );
    let msg = fails(&["run", "--detach", "--graph", "vfs_read"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
    let msg = fails(&["run", "--bare", "--graph", "vfs_read", "--exec", "true"]);
    assert!(msg.contains("cannot be used with"), "{msg}");
    // Checked before anything is built.
    let msg = fails(&[
        "run",
        "--graph",
        "vfs_read",
        "--graph-comm",
        "",
        "--exec",
        "true",
    ]);
    assert_eq!(msg, "--graph-comm needs a task name");
    let msg = fails(&["run", "--graph", "", "--exec", "true"]);
    assert_eq!(msg, r#"--graph needs a glob (got "")"#);
    let msg = fails(&[
        "run",
        "--graph",
        "vfs_read",
        "--format",
        "chrome",
        "--exec",
        "true",
        "--output",
        "/nonexistent/dir/trace.json",
    ]);
    assert!(
        msg.starts_with("cannot create /nonexistent/dir/trace.json"),
        "{msg}"
    );
}

#[test]
fn graph_reads_until_quiet_then_stops() {
    let scratch = Scratch::new("graphtext");
    let path = scratch.0.join("graph.sock");
    let (server, seen) = fake_graph_supervisor(
        &path,
        vec![
            Response::Trace {
                next: GRAPH_CURSOR + 3,
                text: GRAPH_TEXT.into(),
                lost: 0,
            },
            Response::Trace {
                next: GRAPH_CURSOR + 4,
                text: String::new(),
                lost: 2,
            },
        ],
    );
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "graph",
        "--function",
        "vfs_read",
        "--trace",
        "vfs_*",
        "--trace",
        "rw_verify_area",
        "--notrace",
        "*fsnotify*",
        "--graph-notrace",
        "schedule",
        "--max-depth",
        "5",
        "--pid",
        "90",
        "--comm",
        "dd",
        "--retval",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, GRAPH_TEXT);
    assert_eq!(
        stderr,
        "hvtrace: function graph session 2: 12 functions hooked, 1 root, 0 skipped\nhvtrace: 2 events lost\n"
    );
    server.join().unwrap();
    let seen = requests(&seen);
    assert!(matches!(seen[0], Request::Hello { .. }), "{seen:?}");
    // The reading starts where the buffer ended before the graph started.
    assert_eq!(
        seen[1],
        Request::TraceRead {
            cursor: u64::MAX,
            format: TraceFormat::Text,
            wait_ms: 0,
            source: None,
        }
    );
    assert_eq!(
        seen[2],
        Request::GraphStart(GraphFilter {
            functions: vec!["vfs_read".into()],
            trace: vec!["vfs_*".into(), "rw_verify_area".into()],
            notrace: vec!["*fsnotify*".into()],
            graph_notrace: vec!["schedule".into()],
            max_depth: 5,
            pid: Some(90),
            comm: Some("dd".into()),
            retval: true,
            stack_frames: 0,
        })
    );
    assert!(
        matches!(
            seen[3],
            Request::TraceRead {
                cursor: GRAPH_CURSOR,
                format: TraceFormat::Text,
                source: Some(GRAPH_SESSION),
                ..
            }
        ),
        "{seen:?}"
    );
    // Every read after the start is of the session's lines alone.
    for r in &seen[3..seen.len() - 1] {
        assert!(
            matches!(
                r,
                Request::TraceRead {
                    source: Some(GRAPH_SESSION),
                    ..
                }
            ),
            "{seen:?}"
        );
    }
    // Only its own session is stopped, once.
    assert_eq!(seen.last(), Some(&GRAPH_STOP), "{seen:?}");
    assert_eq!(seen.iter().filter(|r| is_graph_stop(r)).count(), 1);
}

#[test]
fn graph_writes_a_chrome_trace() {
    let scratch = Scratch::new("graphchrome");
    let path = scratch.0.join("graph.sock");
    let (server, seen) = fake_graph_supervisor(
        &path,
        vec![Response::Trace {
            next: GRAPH_CURSOR + 7,
            text: graph_json_lines(),
            lost: 0,
        }],
    );
    let file = scratch.0.join("trace.json");
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "graph",
        "--function",
        "vfs_read",
        "--format",
        "chrome",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(
        stderr,
        "hvtrace: function graph session 2: 12 functions hooked, 1 root, 0 skipped\n\
         hvtrace: chrome trace: 3 calls in 1 task; 1 return without a traced call dropped; \
         1 call without a return closed; 1 line of other tracers left out\n"
    );
    server.join().unwrap();
    let doc = std::fs::read_to_string(&file).unwrap();
    let events = check_chrome(&doc);
    let names: Vec<String> = events
        .iter()
        .map(|(tid, ph, name)| format!("{tid} {ph} {name}"))
        .collect();
    assert_eq!(
        names,
        [
            "90 B vfs_read",
            "90 B rw_verify_area",
            "90 E rw_verify_area",
            "90 E vfs_read",
            "90 B vfs_read",
            "90 E vfs_read",
        ]
    );
    assert!(
        doc.contains(r#"{"name":"thread_name","ph":"M","pid":90,"tid":90,"args":{"name":"dd"}}"#),
        "{doc}"
    );
    assert!(
        doc.contains(r#""args":{"retval":"0x40","duration_ns":15062}"#),
        "{doc}"
    );
    let seen = requests(&seen);
    assert!(
        matches!(
            seen[1],
            Request::TraceRead {
                cursor: u64::MAX,
                format: TraceFormat::Json,
                ..
            }
        ),
        "{seen:?}"
    );
    assert!(
        matches!(
            seen[3],
            Request::TraceRead {
                cursor: GRAPH_CURSOR,
                format: TraceFormat::Json,
                source: Some(GRAPH_SESSION),
                ..
            }
        ),
        "{seen:?}"
    );
    assert_eq!(seen.last(), Some(&GRAPH_STOP));
}

#[test]
fn graph_start_refused_is_one_line() {
    let scratch = Scratch::new("graphrefused");
    let path = scratch.0.join("graph.sock");
    let (server, seen) = fake_graph_supervisor(&path, Vec::new());
    let msg = fails(&[
        "--socket",
        path.to_str().unwrap(),
        "graph",
        "--function",
        "vfs_nope",
    ]);
    assert_eq!(msg, "no traceable function matches vfs_nope");
    server.join().unwrap();
    // Nothing was started, so nothing is stopped.
    assert!(!requests(&seen).iter().any(is_graph_stop));
}

#[test]
fn graph_ends_with_the_vm() {
    let scratch = Scratch::new("graphended");
    let path = scratch.0.join("graph.sock");
    let (server, seen) = fake_graph_supervisor(
        &path,
        vec![
            Response::Trace {
                next: GRAPH_CURSOR + 7,
                text: graph_json_lines(),
                lost: 0,
            },
            Response::error(
                ErrorKind::NotReady,
                "the VM has ended (guest stopped: power off)",
            ),
        ],
    );
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "graph",
        "--follow",
        "--format",
        "chrome",
    ]);
    assert_eq!(code, 0, "{stderr}");
    check_chrome(&stdout);
    assert!(
        stderr.contains("hvtrace: the VM has ended (guest stopped: power off)\n"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hvtrace: chrome trace: 3 calls"),
        "{stderr}"
    );
    server.join().unwrap();
    // The VM is gone: there is nothing to stop.
    assert!(!requests(&seen).iter().any(is_graph_stop));
}

#[test]
fn graph_follow_stops_on_ctrl_c() {
    let scratch = Scratch::new("graphint");
    let path = scratch.0.join("graph.sock");
    let (server, seen) = fake_graph_supervisor(
        &path,
        vec![Response::Trace {
            next: GRAPH_CURSOR + 7,
            text: graph_json_lines(),
            lost: 0,
        }],
    );
    let file = scratch.0.join("trace.json");
    let child = Command::new(env!("CARGO_BIN_EXE_hvtrace"))
        .args([
            "--socket",
            path.to_str().unwrap(),
            "graph",
            "--follow",
            "--format",
            "chrome",
            "--output",
            file.to_str().unwrap(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once it reads the graph's lines, it follows (the fake answers at once,
    // with nothing) until interrupted.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while requests(&seen)
        .iter()
        .filter(|r| matches!(r, Request::TraceRead { cursor, .. } if *cursor != u64::MAX))
        .count()
        < 3
    {
        assert!(
            std::time::Instant::now() < until,
            "no reads: {:?}",
            requests(&seen)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let kill = Command::new("sh")
        .args(["-c", &format!("kill -INT {}", child.id())])
        .status()
        .unwrap();
    assert!(kill.success());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("hvtrace: chrome trace: 3 calls"),
        "{stderr}"
    );
    // The closing line comes last.
    assert_eq!(
        stderr.lines().last(),
        Some("hvtrace: function graph session 2 stopped by Ctrl-C after 7 lines"),
        "{stderr}"
    );
    server.join().unwrap();
    assert_eq!(requests(&seen).last(), Some(&GRAPH_STOP));
    check_chrome(&std::fs::read_to_string(&file).unwrap());
}

/// The smallest image the loader's bzImage parser accepts: a setup header
/// (protocol 2.15, 64-bit entry, relocatable), four setup sectors and one
/// 16-byte paragraph of protected-mode code.
fn tiny_bzimage() -> Vec<u8> {
    use loader::bzimage::{hdr, BOOT_FLAG, HEADER_MAGIC, SECTOR_SIZE};
    let mut image = vec![0u8; 5 * SECTOR_SIZE + 16];
    image[hdr::SETUP_SECTS] = 4;
    image[hdr::SYSSIZE..hdr::SYSSIZE + 4].copy_from_slice(&1u32.to_le_bytes());
    image[hdr::BOOT_FLAG..hdr::BOOT_FLAG + 2].copy_from_slice(&BOOT_FLAG.to_le_bytes());
    image[hdr::JUMP_OFFSET] = (hdr::MIN_END - hdr::JUMP_BASE) as u8;
    image[hdr::HEADER_MAGIC..hdr::HEADER_MAGIC + 4].copy_from_slice(&HEADER_MAGIC);
    image[hdr::VERSION..hdr::VERSION + 2].copy_from_slice(&0x020fu16.to_le_bytes());
    image[hdr::RELOCATABLE_KERNEL] = 1;
    image[hdr::XLOADFLAGS] = 1; // XLF_KERNEL_64
    assert!(loader::bzimage::parse(&image).is_ok());
    image
}

#[test]
fn a_file_that_is_not_a_kernel_fails_at_once() {
    let scratch = Scratch::new("not-a-kernel");
    let initrd = scratch.file("initrd");
    let started = std::time::Instant::now();
    let msg = fails(&[
        "run",
        "--bare",
        "--kernel",
        "/etc/hostname",
        "--initrd",
        &initrd,
    ]);
    let took = started.elapsed();
    assert!(
        msg.starts_with("kernel /etc/hostname: not a bzImage"),
        "{msg}"
    );
    // The host's own parse, not a boot: well under a second (2 s allows a
    // loaded machine).
    assert!(took < std::time::Duration::from_secs(2), "{took:?}: {msg}");
    // A truncated copy of a real header is named as such.
    let mut cut = tiny_bzimage();
    cut.truncate(cut.len() - 8);
    let kernel = scratch.0.join("cut-bzImage");
    std::fs::write(&kernel, &cut).unwrap();
    let msg = fails(&[
        "run",
        "--bare",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        &initrd,
    ]);
    assert!(msg.contains("image truncated"), "{msg}");
}

#[test]
fn a_file_that_is_not_an_initramfs_fails_at_once() {
    let scratch = Scratch::new("not-an-initrd");
    let kernel = scratch.0.join("bzImage");
    std::fs::write(&kernel, tiny_bzimage()).unwrap();
    let initrd = scratch.file("initrd");
    let msg = fails(&[
        "run",
        "--bare",
        "--kernel",
        kernel.to_str().unwrap(),
        "--initrd",
        &initrd,
    ]);
    assert!(
        msg.contains("not an initramfs (expected a cpio archive, bare or compressed with gzip"),
        "{msg}"
    );
}
