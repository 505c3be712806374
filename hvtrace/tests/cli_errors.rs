//! Bad options and missing files: one `hvtrace: error:` line on stderr, a
//! non-zero exit, no panic, and nothing started. None of these cases needs an
//! emulator, a kernel or the hypervisor.
//!
//! The control commands are checked against a missing socket, a stale one
//! and a fake supervisor (version mismatch, ended VM).
//!
//! The runs that only need a command line (and a few scratch files and
//! sockets) are the rows of one table, [`ROWS`]: each gives the arguments,
//! the exit code and what the error line must say, and a failing row is
//! named in the failure. The runs with a fake supervisor, a timing or more
//! than one line to check are tests of their own.
//!
//! Run: `cargo test -p hvtrace --test cli_errors`

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

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

/// Runs hvtrace with `args` and nothing of the user's to find: no stdin,
/// no repository (`HVTRACE_ROOT` pointing nowhere, so that no kernel,
/// initramfs or hypervisor can be built), and a default control socket
/// under a directory that does not exist (the tests name theirs with
/// `--socket`).
fn run_hvtrace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hvtrace"))
        .env("HVTRACE_ROOT", "/nonexistent-hvtrace-root")
        .env_remove("XDG_RUNTIME_DIR")
        .env("HVTRACE_TMPDIR", "/nonexistent-hvtrace-tmp")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace")
}

/// Checks that a run of hvtrace with `args` failed with one
/// `hvtrace: error:` line on stderr, nothing on stdout and no sign of a
/// panic or of clap's usage text; returns the message after the prefix, or
/// what is wrong.
fn one_error_line(args: &[&str], output: &Output) -> Result<String, String> {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if output.status.success() {
        return Err(format!("{args:?} succeeded: {stderr}"));
    }
    if !output.stdout.is_empty() {
        return Err(format!(
            "{args:?} printed on stdout: {:?}",
            String::from_utf8_lossy(&output.stdout)
        ));
    }
    let lines: Vec<&str> = stderr.lines().collect();
    if lines.len() != 1 {
        return Err(format!(
            "{args:?} did not print exactly one line: {stderr:?}"
        ));
    }
    let line = lines[0];
    let Some(msg) = line.strip_prefix("hvtrace: error: ") else {
        return Err(format!("{args:?}: {line:?}"));
    };
    for bad in [
        "panicked",
        "backtrace",
        "RUST_BACKTRACE",
        "Caused by",
        "Usage:",
    ] {
        if line.contains(bad) {
            return Err(format!("{args:?}: {line:?}"));
        }
    }
    Ok(msg.to_string())
}

/// Runs hvtrace and checks the one-line failure; returns the message.
fn fails(args: &[&str]) -> String {
    one_error_line(args, &run_hvtrace(args)).unwrap_or_else(|why| panic!("{why}"))
}

// ----- the table: bad options, missing files, no VM -----

/// What a row expects. `{scratch}` in a string stands for the table's
/// scratch directory (see [`bad_command_lines_fail_with_one_line`]).
enum Expect {
    /// The error message contains this.
    Has(&'static str),
    /// The error message starts with this.
    Starts(&'static str),
    /// The error message is exactly this.
    Is(&'static str),
    /// After the run, this path is still a plain file: nothing replaced it.
    FileStays(&'static str),
}

use Expect::{FileStays, Has, Is, Starts};

/// One run of hvtrace that must fail with one error line
/// ([`one_error_line`]), exit with `code`, and meet every `expect`.
struct Row {
    /// Names the row in a failure: the test it came from, then the case.
    name: &'static str,
    /// The command line after `hvtrace`; `{scratch}` as in [`Expect`].
    args: &'static [&'static str],
    /// The exit status: 2 for a command line that clap refuses, 1 for an
    /// error found after parsing.
    code: i32,
    expect: &'static [Expect],
}

/// The socket path in the scratch directory where nothing is.
const MISSING: &str = "{scratch}/missing.sock";

const ROWS: &[Row] = &[
    Row {
        name: "missing_kernel",
        args: &["run", "--bare", "--kernel", "/nonexistent/bzImage"],
        code: 1,
        expect: &[Has("kernel /nonexistent/bzImage not found")],
    },
    Row {
        name: "missing_initrd",
        args: &[
            "run",
            "--bare",
            "--kernel",
            "{scratch}/bzImage",
            "--initrd",
            "/nonexistent/initrd",
        ],
        code: 1,
        expect: &[Has("initrd /nonexistent/initrd not found")],
    },
    Row {
        name: "missing_hypervisor",
        args: &[
            "run",
            "--kernel",
            "{scratch}/bzImage",
            "--initrd",
            "{scratch}/initrd",
            "--hypervisor",
            "/nonexistent/hypervisor",
        ],
        code: 1,
        expect: &[Has("hypervisor image /nonexistent/hypervisor not found")],
    },
    Row {
        name: "bad_emulator",
        args: &["run", "--emulator", "vmware"],
        code: 2,
        expect: &[Has("invalid value 'vmware'"), Has("bochs"), Has("qemu")],
    },
    Row {
        name: "nokaslr_is_refused",
        args: &["run", "--bare", "--append", "console=ttyS0,115200 nokaslr"],
        code: 1,
        expect: &[Has("nokaslr"), Has("--allow-nokaslr")],
    },
    // With the override the next problem is reported instead.
    Row {
        name: "nokaslr_is_refused/allowed, then the kernel",
        args: &[
            "run",
            "--bare",
            "--allow-nokaslr",
            "--append",
            "nokaslr",
            "--kernel",
            "/nonexistent/bzImage",
        ],
        code: 1,
        expect: &[Has("kernel /nonexistent/bzImage not found")],
    },
    Row {
        name: "bare_conflicts_with_hypervisor",
        args: &["run", "--bare", "--hypervisor", "/x"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    Row {
        name: "unknown_subcommand_and_option/subcommand",
        args: &["frobnicate"],
        code: 2,
        expect: &[Has("frobnicate")],
    },
    Row {
        name: "unknown_subcommand_and_option/option",
        args: &["run", "--no-such-option"],
        code: 2,
        expect: &[Has("--no-such-option")],
    },
    Row {
        name: "bad_numbers/memory",
        args: &["run", "--memory", "lots"],
        code: 2,
        expect: &[Has("lots")],
    },
    Row {
        name: "bad_numbers/timeout 0",
        args: &["run", "--bare", "--timeout", "0"],
        code: 1,
        expect: &[Has("--timeout")],
    },
    Row {
        name: "bad_numbers/cpus 0",
        args: &["run", "--bare", "--cpus", "0"],
        code: 2,
        expect: &[Has("--cpus must be between 1 and 16")],
    },
    Row {
        name: "bad_numbers/cpus 17",
        args: &["run", "--bare", "--cpus", "17"],
        code: 2,
        expect: &[Has("--cpus must be between 1 and 16")],
    },
    // Only the Debian guest's initramfs carries its package's modules.
    Row {
        name: "modules_option_errors/fast guest",
        args: &["run", "--guest", "fast", "--modules", "xfs"],
        code: 1,
        expect: &[Is(
            "--modules adds modules of Debian's kernel package to the Debian guest's initramfs; the fast-lane guest (--guest fast) takes none",
        )],
    },
    // An initramfs or a kernel of the user's: the modules are theirs to add.
    Row {
        name: "modules_option_errors/with --initrd",
        args: &["run", "--modules", "xfs", "--initrd", "{scratch}/file"],
        code: 2,
        expect: &[
            Has("'--modules <LIST>' cannot be used with"),
            Has("--initrd"),
        ],
    },
    Row {
        name: "modules_option_errors/with --kernel",
        args: &["run", "--modules", "xfs", "--kernel", "{scratch}/file"],
        code: 2,
        expect: &[
            Has("'--modules <LIST>' cannot be used with"),
            Has("--kernel"),
        ],
    },
    // Names as modprobe takes them: no paths, no .ko, none empty.
    Row {
        name: "modules_option_errors/name with .ko",
        args: &["run", "--modules", "xfs,ext4.ko"],
        code: 2,
        expect: &[
            Has("--modules <LIST>"),
            Has("'ext4.ko' is not a module name"),
        ],
    },
    Row {
        name: "modules_option_errors/name with a path",
        args: &["run", "--modules", "xfs,../fs/xfs"],
        code: 2,
        expect: &[
            Has("--modules <LIST>"),
            Has("'../fs/xfs' is not a module name"),
        ],
    },
    Row {
        name: "modules_option_errors/empty name in a list",
        args: &["run", "--modules", "xfs,,btrfs"],
        code: 2,
        expect: &[Has("--modules <LIST>"), Has("an empty module name")],
    },
    Row {
        name: "modules_option_errors/empty list",
        args: &["run", "--modules", ""],
        code: 2,
        expect: &[Has("--modules <LIST>"), Has("an empty module name")],
    },
    Row {
        name: "control_commands_without_a_vm/status",
        args: &["--socket", MISSING, "status"],
        code: 1,
        expect: &[Starts("no VM is running at"), Has(MISSING)],
    },
    Row {
        name: "control_commands_without_a_vm/exec",
        args: &["--socket", MISSING, "exec", "true"],
        code: 1,
        expect: &[Starts("no VM is running at"), Has(MISSING)],
    },
    Row {
        name: "control_commands_without_a_vm/stop",
        args: &["--socket", MISSING, "stop"],
        code: 1,
        expect: &[Starts("no VM is running at"), Has(MISSING)],
    },
    // A socket file nobody listens on: the VM died without cleaning up.
    Row {
        name: "control_commands_without_a_vm/stale socket",
        args: &["--socket", "{scratch}/stale.sock", "status", "--json"],
        code: 1,
        expect: &[Has("is gone")],
    },
    Row {
        name: "detach_refuses_a_taken_socket/live socket",
        args: &["--socket", "{scratch}/live.sock", "run", "--detach"],
        code: 1,
        expect: &[Has("already owns")],
    },
    Row {
        name: "detach_refuses_a_taken_socket/plain file",
        args: &["--socket", "{scratch}/plain", "run", "--detach"],
        code: 1,
        expect: &[Has("is not a socket"), FileStays("{scratch}/plain")],
    },
    Row {
        name: "detach_refuses_a_taken_socket/bare",
        args: &["run", "--detach", "--bare"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    Row {
        name: "probe_removal_spec_is_refused_with_a_hint",
        args: &["--socket", "/nonexistent/x.sock", "probe", "add", "-:myopen"],
        code: 1,
        expect: &[Has("hvtrace probe del myopen")],
    },
    Row {
        name: "probe_and_trace_commands_without_a_vm/probe add",
        args: &["--socket", MISSING, "probe", "add", "p vfs_read"],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "probe_and_trace_commands_without_a_vm/probe del",
        args: &["--socket", MISSING, "probe", "del", "p_vfs_read_0"],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "probe_and_trace_commands_without_a_vm/probe list",
        args: &["--socket", MISSING, "probe", "list"],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "probe_and_trace_commands_without_a_vm/trace",
        args: &["--socket", MISSING, "trace"],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "probe_and_trace_commands_without_a_vm/trace --follow",
        args: &[
            "--socket",
            MISSING,
            "trace",
            "--follow",
            "--function",
            "vfs_*",
        ],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "traced_run_option_errors/bare",
        args: &["run", "--bare", "--probe", "p vfs_read", "--exec", "true"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    Row {
        name: "traced_run_option_errors/no --exec",
        args: &["run", "--probe", "p vfs_read"],
        code: 2,
        expect: &[Has("--exec")],
    },
    Row {
        name: "traced_run_option_errors/--format without a tracer",
        args: &["run", "--format", "json", "--exec", "true"],
        code: 2,
        expect: &[Has("--probe")],
    },
    Row {
        name: "traced_run_option_errors/detach",
        args: &["run", "--detach", "--function", "vfs_*"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    // An unwritable --output fails before anything is built.
    Row {
        name: "traced_run_option_errors/unwritable --output",
        args: &[
            "run",
            "--function",
            "vfs_*",
            "--exec",
            "true",
            "--output",
            "/nonexistent/dir/trace.txt",
        ],
        code: 1,
        expect: &[Starts("cannot create /nonexistent/dir/trace.txt")],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/graph",
        args: &["--socket", MISSING, "graph"],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/chrome, follow",
        args: &[
            "--socket",
            MISSING,
            "graph",
            "--function",
            "vfs_read",
            "--format",
            "chrome",
            "-f",
        ],
        code: 1,
        expect: &[Starts("no VM is running at")],
    },
    // Filters are checked before anything else.
    Row {
        name: "graph_without_a_vm_and_bad_filters/empty --function",
        args: &["--socket", MISSING, "graph", "--function", ""],
        code: 1,
        expect: &[Is(r#"--function needs a glob (got "")"#)],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/two globs in --trace",
        args: &["--socket", MISSING, "graph", "--trace", "a b"],
        code: 1,
        expect: &[Has("one glob per --trace")],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/empty --graph-notrace",
        args: &["--socket", MISSING, "graph", "--graph-notrace", ""],
        code: 1,
        expect: &[Is(r#"--graph-notrace needs a glob (got "")"#)],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/long --comm",
        args: &["--socket", MISSING, "graph", "--comm", "a-very-long-name"],
        code: 1,
        expect: &[Has("at most 15 bytes")],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/negative --pid",
        args: &["graph", "--pid", "-3"],
        code: 2,
        expect: &[Has("-3 is not in 0..=")],
    },
    Row {
        name: "graph_without_a_vm_and_bad_filters/--format xml",
        args: &["graph", "--format", "xml"],
        code: 2,
        expect: &[Has("possible values: text, json, chrome")],
    },
    Row {
        name: "trace_dat/run without --output",
        args: &[
            "run",
            "--format",
            "trace-dat",
            "--function",
            "x",
            "--exec",
            "true",
        ],
        code: 1,
        expect: &[Is("--format trace-dat writes a file: give it with --output FILE")],
    },
    Row {
        name: "trace_dat/graph without --output",
        args: &["--socket", MISSING, "graph", "--format", "trace-dat"],
        code: 1,
        expect: &[Is("--format trace-dat writes a file: give it with --output FILE")],
    },
    Row {
        name: "trace_dat/trace without --output",
        args: &["--socket", MISSING, "trace", "--format", "trace-dat"],
        code: 1,
        expect: &[Is("--format trace-dat writes a file: give it with --output FILE")],
    },
    Row {
        name: "trace_dat/record for no time",
        args: &["--socket", MISSING, "record", "--duration", "0"],
        code: 1,
        expect: &[Is("--duration needs a number of seconds above 0")],
    },
    Row {
        name: "trace_dat/record graph options without --graph",
        args: &["--socket", MISSING, "record", "--graph-comm", "dd"],
        code: 1,
        expect: &[Is("the graph options need --graph GLOB")],
    },
    Row {
        name: "trace_dat/record into a directory that is not there",
        args: &["--socket", MISSING, "record", "-o", "/nonexistent-dir/t.dat"],
        code: 1,
        expect: &[Starts("cannot write beside /nonexistent-dir/t.dat")],
    },
    Row {
        name: "trace_dat/convert a missing file",
        args: &["convert", "/nonexistent/lines.jsonl", "-o", "{scratch}/c.dat"],
        code: 1,
        expect: &[Starts("cannot read /nonexistent/lines.jsonl")],
    },
    Row {
        name: "graph_run_option_errors/no --exec",
        args: &["run", "--graph", "vfs_read"],
        code: 2,
        expect: &[Has("--exec")],
    },
    Row {
        name: "trace_dat/a count into a trace.dat",
        args: &[
            "run",
            "--format",
            "trace-dat",
            "--count",
            "vfs_*",
            "--exec",
            "true",
        ],
        code: 1,
        expect: &[Is(
            "--count and --hist print text, json or chrome, not a trace.dat",
        )],
    },
    Row {
        name: "graph_run_option_errors/--graph-trace without --graph",
        args: &["run", "--graph-trace", "vfs_*", "--exec", "true"],
        code: 2,
        expect: &[Has("--graph")],
    },
    Row {
        name: "graph_run_option_errors/--graph-ftrace-notrace without --graph",
        args: &["run", "--graph-ftrace-notrace", "x", "--exec", "true"],
        code: 2,
        expect: &[Has("--graph")],
    },
    Row {
        name: "graph_run_option_errors/two globs in --graph-ftrace-notrace",
        args: &[
            "run",
            "--graph",
            "vfs_read",
            "--graph-ftrace-notrace",
            "a b",
            "--exec",
            "true",
        ],
        code: 1,
        expect: &[Is(
            r#"--graph-ftrace-notrace "a b": one glob per --graph-ftrace-notrace (repeat the option for more)"#,
        )],
    },
    Row {
        name: "graph_run_option_errors/detach",
        args: &["run", "--detach", "--graph", "vfs_read"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    Row {
        name: "graph_run_option_errors/bare",
        args: &["run", "--bare", "--graph", "vfs_read", "--exec", "true"],
        code: 2,
        expect: &[Has("cannot be used with")],
    },
    // Checked before anything is built.
    Row {
        name: "graph_run_option_errors/empty --graph-comm",
        args: &[
            "run",
            "--graph",
            "vfs_read",
            "--graph-comm",
            "",
            "--exec",
            "true",
        ],
        code: 1,
        expect: &[Is("--graph-comm needs a task name")],
    },
    Row {
        name: "graph_run_option_errors/empty --graph",
        args: &["run", "--graph", "", "--exec", "true"],
        code: 1,
        expect: &[Is(r#"--graph needs a glob (got "")"#)],
    },
    Row {
        name: "graph_run_option_errors/unwritable --output",
        args: &[
            "run",
            "--graph",
            "vfs_read",
            "--format",
            "chrome",
            "--exec",
            "true",
            "--output",
            "/nonexistent/dir/trace.json",
        ],
        code: 1,
        expect: &[Starts("cannot create /nonexistent/dir/trace.json")],
    },
];

/// Runs one row; `place` puts the scratch directory in for `{scratch}`.
/// Returns what is wrong, if anything.
fn check_row(row: &Row, place: &dyn Fn(&str) -> String) -> Result<(), String> {
    let args: Vec<String> = row.args.iter().map(|a| place(a)).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = run_hvtrace(&args);
    let msg = one_error_line(&args, &output)?;
    let code = output.status.code();
    if code != Some(row.code) {
        return Err(format!(
            "{args:?} exited with {code:?}, expected {}: {msg:?}",
            row.code
        ));
    }
    for expect in row.expect {
        let ok = match expect {
            Has(s) => msg.contains(&place(s)),
            Starts(s) => msg.starts_with(&place(s)),
            Is(s) => msg == place(s),
            FileStays(path) => std::path::Path::new(&place(path)).is_file(),
        };
        if !ok {
            let what = match expect {
                Has(s) => format!("the message to contain {:?}", place(s)),
                Starts(s) => format!("the message to start with {:?}", place(s)),
                Is(s) => format!("the message to be {:?}", place(s)),
                FileStays(path) => format!("{} to stay a plain file", place(path)),
            };
            return Err(format!("{args:?}: expected {what}; got {msg:?}"));
        }
    }
    Ok(())
}

/// Every row of [`ROWS`], against a scratch directory that holds files that
/// exist (`bzImage`, `initrd`, `file`, `plain`, none of them a kernel), a
/// socket nobody listens on (`stale.sock`), a socket somebody listens on
/// while the rows run (`live.sock`), and nothing at `missing.sock`. All rows
/// run; the failure names each row that failed and why.
#[test]
fn bad_command_lines_fail_with_one_line() {
    let mut names = std::collections::BTreeSet::new();
    for row in ROWS {
        assert!(names.insert(row.name), "two rows are named {:?}", row.name);
    }
    let scratch = Scratch::new("table");
    for name in ["bzImage", "initrd", "file", "plain"] {
        scratch.file(name);
    }
    drop(UnixListener::bind(scratch.0.join("stale.sock")).unwrap());
    let _live = UnixListener::bind(scratch.0.join("live.sock")).unwrap();
    let dir = scratch.0.to_str().unwrap().to_string();
    let place = |s: &str| s.replace("{scratch}", &dir);
    let failures: Vec<String> = ROWS
        .iter()
        .filter_map(|row| {
            check_row(row, &place)
                .err()
                .map(|why| format!("row {:?}: {why}", row.name))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        ROWS.len(),
        failures.join("\n")
    );
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

// ----- the control commands, against a fake supervisor -----

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

// ----- probes and tracing -----

/// Runs hvtrace; returns the exit code, stdout and stderr.
fn runs(args: &[&str]) -> (i32, String, String) {
    let output = run_hvtrace(args);
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
        // Instants (probes, function hits) sit on a thread, unnested.
        if ph == "i" {
            assert_eq!(e["s"], "t", "{e}");
            assert!(
                e["ts"].as_f64().is_some() && e["tid"].as_i64().is_some(),
                "{e}"
            );
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
            gate: false,
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
         hvtrace: chrome trace: 3 calls in 2 tasks, 1 probe or function hit; \
         1 return without a traced call dropped; 1 call without a return closed\n"
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

// ----- trace.dat -----

/// `trace-cmd ARGS` (Debian's, which scripts/setup.sh installs): (success,
/// stdout, stderr).
fn trace_cmd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new("trace-cmd")
        .args(args)
        .output()
        .expect("trace-cmd not found: scripts/setup.sh installs it");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn function_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"ts\":\"5.0\",\"ts_ns\":{},\"cpu\":{},\"pid\":{},\"comm\":\"t{}\",\"kind\":\"function\",\"func\":\"vfs_read\",\"parent\":\"ksys_read+0x6d/0xf0\",\"ip\":\"0xffffffff81200000\",\"parent_ip\":\"0xffffffff8120106d\"}}\n",
                5_000_000_000u64 + i as u64 * 1000,
                i % 2,
                100 + i % 3,
                i % 3
            )
        })
        .collect()
}

#[test]
fn a_graph_session_writes_a_trace_dat_that_trace_cmd_reads() {
    let scratch = Scratch::new("graphdat");
    let path = scratch.0.join("graph.sock");
    let lines = [
        r#"{"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","ip":"0xffffffff81200000","depth":0}"#,
        r#"{"ts":"5.000001","ts_ns":5000001000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"rw_verify_area","ip":"0xffffffff81201000","depth":1}"#,
        r#"{"ts":"5.000002","ts_ns":5000001812,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"rw_verify_area","ip":"0xffffffff81201000","depth":1,"duration_ns":812,"retval":"0x0"}"#,
        r#"{"ts":"5.000015","ts_ns":5000015062,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","ip":"0xffffffff81200000","depth":0,"duration_ns":15062,"retval":"0x40"}"#,
    ]
    .map(|l| format!("{l}\n"))
    .concat();
    let (server, _seen) = fake_graph_supervisor(
        &path,
        vec![Response::Trace {
            next: GRAPH_CURSOR + 4,
            text: lines,
            lost: 2,
        }],
    );
    let file = scratch.0.join("graph.dat");
    let (code, stdout, stderr) = runs(&[
        "--socket",
        path.to_str().unwrap(),
        "graph",
        "--function",
        "vfs_read",
        "--format",
        "trace-dat",
        "--output",
        file.to_str().unwrap(),
    ]);
    server.join().unwrap();
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    // This supervisor lists no probes and no symbols: said once each, and
    // the file names the functions its lines name.
    assert!(
        stderr.contains("hvtrace: note: trace.dat: kallsyms: ")
            && stderr.contains("the file names only the functions its events name"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hvtrace: trace.dat: 4 events on 1 CPU, ") && stderr.contains("; 2 lost"),
        "{stderr}"
    );
    let (ok, report, err) = trace_cmd(&["report", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let graph: Vec<&str> = report
        .lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(_, r)| r.trim_end())
        .collect();
    assert_eq!(
        graph,
        ["  vfs_read() {", "    rw_verify_area();", "  }"],
        "{report}"
    );
    assert!(
        report.contains("0.812 us") && report.contains("15.062 us"),
        "{report}"
    );
    // The loss marks a page on the CPU.
    assert!(report.contains("EVENTS DROPPED"), "{report}");
}

#[test]
fn a_full_disk_leaves_no_half_file() {
    let scratch = Scratch::new("fulldisk");
    let input = scratch.0.join("lines.jsonl");
    std::fs::write(&input, function_lines(20_000)).unwrap();
    let out = scratch.0.join("t.dat");
    std::fs::write(&out, b"an earlier file").unwrap();
    // A file size limit of 64 KiB stands for a full disk: writes past it
    // fail with EFBIG (the signal it raises is ignored).
    let output = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 128; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_hvtrace"))
        .args([
            "convert",
            input.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("hvtrace: error: cannot write {}: ", out.display()))
            && stderr.contains("too large"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"an earlier file");
    let names: Vec<String> = std::fs::read_dir(&scratch.0)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| n == "lines.jsonl" || n == "t.dat"),
        "{names:?}"
    );
    // With room, the same input converts, and trace-cmd reads it whole.
    let (code, _, stderr) = runs(&[
        "convert",
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--cpus",
        "2",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.starts_with("hvtrace: trace.dat: 20000 events on 2 CPUs, "),
        "{stderr}"
    );
    let (ok, report, err) = trace_cmd(&["report", "--cpu", "1", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = report.lines().filter(|l| l.contains("function:")).collect();
    assert_eq!(lines.len(), 10_000);
    assert!(lines.iter().all(|l| l.contains("[001]")));
    assert!(
        lines[0].contains("t1-101") && lines[0].contains("vfs_read"),
        "{}",
        lines[0]
    );
}

/// The scheduler's events print as the kernel's format says, read by
/// libtraceevent from the format text alone (`-N`: no plugins), and with
/// trace-cmd's own sched plugin.
#[test]
fn sched_events_print_as_the_kernel_prints_them() {
    let scratch = Scratch::new("schedfmt");
    let input = scratch.0.join("sched.jsonl");
    let lines = [
        r#"{"ts":"0","ts_ns":1000,"cpu":0,"pid":52,"comm":"sh","kind":"sched_switch","prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"S","next_comm":"dd","next_pid":55,"next_prio":120}"#,
        r#"{"ts":"0","ts_ns":2000,"cpu":0,"pid":55,"comm":"dd","kind":"sched_wakeup","target_comm":"sh","target_pid":52,"target_prio":120,"target_cpu":0}"#,
        r#"{"ts":"0","ts_ns":3000,"cpu":0,"pid":55,"comm":"dd","kind":"sched_switch","prev_comm":"dd","prev_pid":55,"prev_prio":120,"prev_state":"R","next_comm":"sh","next_pid":52,"next_prio":120}"#,
        r#"{"ts":"0","ts_ns":4000,"cpu":0,"pid":52,"comm":"sh","kind":"sched_switch","prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"D","next_comm":"dd","next_pid":55,"next_prio":120}"#,
    ]
    .join("\n");
    std::fs::write(&input, lines + "\n").unwrap();
    let out = scratch.0.join("sched.dat");
    let (code, _, stderr) = runs(&[
        "convert",
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let (ok, plain, err) = trace_cmd(&["report", "-N", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let events: Vec<&str> = plain
        .lines()
        .filter_map(|l| l.split_once(": sched_").map(|(_, r)| r.trim()))
        .map(|r| r.split_once(':').map_or(r, |(_, rest)| rest.trim()))
        .collect();
    assert_eq!(
        events,
        [
            "prev_comm=sh prev_pid=52 prev_prio=120 prev_state=S ==> next_comm=dd next_pid=55 next_prio=120",
            "comm=sh pid=52 prio=120 target_cpu=000",
            "prev_comm=dd prev_pid=55 prev_prio=120 prev_state=R ==> next_comm=sh next_pid=52 next_prio=120",
            "prev_comm=sh prev_pid=52 prev_prio=120 prev_state=D ==> next_comm=dd next_pid=55 next_prio=120",
        ],
        "{plain}"
    );
}
