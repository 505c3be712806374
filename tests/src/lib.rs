//! Helpers of the hvtrace VM test suite (the tests are in `tests/`).
//!
//! Booting a guest in Bochs takes from ten seconds to minutes, so each test
//! boots once and checks many things on that boot, collecting every failed
//! check before it fails ([`Checks`]). VM tests take [`vm_lock`] so that the
//! tests of one binary never run two emulators at once (cargo runs the test
//! binaries themselves one after another).
//!
//! A missing prerequisite (emulator, kernel, initramfs, hypervisor image)
//! fails the test with a message; nothing is skipped.
//!
//! Environment:
//! - `HVTRACE_HYPERVISOR`: use this hypervisor image instead of building it.
//! - `HVTRACE_ROOT`: the repository root (for the guest scripts).

use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use hvtrace::{Guest, RunConfig};

pub mod fuzz;

/// Serializes the VM tests of one test binary.
pub fn vm_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // A test that panicked while holding the lock leaves nothing behind.
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Unwraps a result, or fails the test with `what` and the error chain.
pub fn must<T>(result: anyhow::Result<T>, what: &str) -> T {
    match result {
        Ok(value) => value,
        Err(e) => panic!("{what}: {e:#}"),
    }
}

/// The configuration for a built-in guest: kernel and initramfs from the
/// guest scripts, Bochs, bare; `timeout` for the whole run.
pub fn guest_config(guest: Guest, timeout: Duration) -> RunConfig {
    let mut cfg = must(
        RunConfig::for_guest(guest),
        &format!("preparing the {guest:?} guest (kernel and initramfs)"),
    );
    cfg.timeout = timeout;
    cfg
}

/// The kernel release that `uname -r` must print for `kernel`.
pub fn expected_release(kernel: &Path) -> String {
    must(
        hvtrace::vm::guest::release_of(kernel),
        "reading the kernel release file",
    )
}

/// The hypervisor image: `$HVTRACE_HYPERVISOR`, or built once per test binary.
pub fn hypervisor_image() -> PathBuf {
    static IMAGE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let image = IMAGE.get_or_init(|| {
        if let Some(path) = std::env::var_os("HVTRACE_HYPERVISOR").filter(|p| !p.is_empty()) {
            let path = PathBuf::from(path);
            return match hvtrace::vm::config::check_file("HVTRACE_HYPERVISOR", &path) {
                Ok(()) => Ok(path),
                Err(e) => Err(format!("{e:#}")),
            };
        }
        hvtrace::vm::hv_image::build().map_err(|e| format!("{e:#}"))
    });
    match image {
        Ok(path) => path.clone(),
        Err(e) => panic!("the hypervisor image is needed: {e}"),
    }
}

/// The `hvtrace` binary of this build profile, built if needed.
pub fn hvtrace_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let bin = BIN.get_or_init(build_hvtrace_bin);
    match bin {
        Ok(path) => path.clone(),
        Err(e) => panic!("the hvtrace binary is needed: {e}"),
    }
}

/// Builds the CLI next to this test binary: `<target>/<profile>/deps/<test>`
/// gives `<target>/<profile>/hvtrace`.
fn build_hvtrace_bin() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("unexpected test binary location")?;
    let target_dir = profile_dir
        .parent()
        .ok_or("unexpected test binary location")?;
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let mut cmd = Command::new("cargo");
    cmd.args([
        "build",
        "-q",
        "-p",
        "hvtrace",
        "--bin",
        "hvtrace",
        "--target-dir",
    ])
    .arg(target_dir)
    .current_dir(env!("CARGO_MANIFEST_DIR"))
    .stdin(Stdio::null());
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build -p hvtrace failed ({status})"));
    }
    let bin = profile_dir.join("hvtrace");
    if !bin.is_file() {
        return Err(format!("{} was not built", bin.display()));
    }
    Ok(bin)
}

/// The flags of the first `flags` line of a `/proc/cpuinfo` text.
pub fn cpuinfo_flags(cpuinfo: &str) -> Option<Vec<String>> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "flags").then(|| value.split_whitespace().map(str::to_string).collect())
    })
}

/// Collects failed checks, so that one boot reports everything it found.
#[derive(Debug, Default)]
pub struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    /// No checks yet.
    pub fn new() -> Checks {
        Checks::default()
    }

    /// Records `what` as failed unless `ok`.
    pub fn check(&mut self, ok: bool, what: impl Into<String>) {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(what.into());
        }
    }

    /// Records a comparison.
    pub fn eq<A: PartialEq<B> + Debug, B: Debug>(&mut self, what: &str, actual: A, expected: B) {
        let ok = actual == expected;
        self.check(ok, format!("{what}: got {actual:?}, expected {expected:?}"));
    }

    /// Records the result of a step; returns its value when it succeeded.
    pub fn ok<T>(&mut self, what: &str, result: anyhow::Result<T>) -> Option<T> {
        match result {
            Ok(value) => {
                self.passed += 1;
                Some(value)
            }
            Err(e) => {
                self.failures.push(format!("{what}: {e:#}"));
                None
            }
        }
    }

    /// Fails the test with every failed check, if any.
    pub fn finish(self) {
        if !self.failures.is_empty() {
            panic!(
                "{} of {} checks failed:\n  - {}",
                self.failures.len(),
                self.failures.len() + self.passed,
                self.failures.join("\n  - ")
            );
        }
    }
}

/// A VM started with `hvtrace run --detach` (Bochs, KASLR on), stopped when
/// dropped. Tests talk to it through [`Detached::client`].
pub struct Detached {
    /// The control socket.
    pub socket: PathBuf,
    /// The run directory `run --detach` reported (emulator logs, console).
    pub run_dir: Option<PathBuf>,
    /// The supervisor's pid, as `run --detach` reported it.
    pub supervisor: Option<u32>,
}

impl Detached {
    /// Boots `guest` (`fast` or `debian`) and waits for its shell.
    pub fn start(guest: &str, tag: &str) -> Detached {
        Self::start_with(guest, tag, &[])
    }

    /// [`Detached::start`] with more `hvtrace run` arguments (`--initrd F`).
    pub fn start_with(guest: &str, tag: &str, extra: &[&str]) -> Detached {
        Self::start_image(guest, tag, &hypervisor_image(), extra)
    }

    /// [`Detached::start_with`] with another hypervisor image.
    pub fn start_image(guest: &str, tag: &str, image: &Path, extra: &[&str]) -> Detached {
        let socket =
            std::env::temp_dir().join(format!("hvtrace-{tag}-{guest}-{}.sock", std::process::id()));
        let out = Command::new(hvtrace_bin())
            .args([
                "run",
                "--detach",
                "--quiet",
                "--emulator",
                "bochs",
                "--guest",
                guest,
                "--timeout",
                "1200",
            ])
            .arg("--socket")
            .arg(&socket)
            .arg("--hypervisor")
            .arg(image)
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .expect("cannot run hvtrace");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "hvtrace run --detach failed: {stderr}"
        );
        let run_dir = stderr.lines().find_map(|l| {
            l.split_once("; run directory ")
                .map(|(_, d)| PathBuf::from(d.trim()))
        });
        let supervisor = stderr.lines().find_map(|l| {
            l.split_once("supervisor pid ")
                .and_then(|(_, rest)| rest.split(';').next())
                .and_then(|p| p.trim().parse().ok())
        });
        Detached {
            socket,
            run_dir,
            supervisor,
        }
    }

    /// Everything the emulator printed so far (the hypervisor's log port
    /// included), from the run directory's emulator logs.
    pub fn emulator_output(&self) -> String {
        let Some(dir) = &self.run_dir else {
            return String::new();
        };
        ["emulator.stdout.log", "emulator.stderr.log"]
            .iter()
            .filter_map(|f| std::fs::read(dir.join(f)).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A client that said hello.
    pub fn client(&self) -> hvtrace::client::Client {
        let mut c = hvtrace::client::Client::connect(&self.socket)
            .expect("cannot connect to the control socket");
        c.hello().expect("hello failed");
        c
    }

    /// Runs `hvtrace --socket S ARGS...` and returns (status, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(hvtrace_bin())
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("cannot run hvtrace");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// Whether process `pid` exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// `pid` and every process below it (children first found through
/// `/proc/*/stat`'s parent field).
fn process_tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let ppid = std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(") ")
                        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
                });
            if let Some(ppid) = ppid {
                parents.push((p, ppid));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|&&(_, pp)| pp == p).map(|&(c, _)| c));
        i += 1;
    }
    tree
}

/// Stops the VM on every way out of a test, a panic included: `stop`
/// through the socket, bounded in time; if the supervisor is still there
/// after that, it and its emulator are killed, so that no VM outlives its
/// test (a leaked emulator keeps a core busy and slows every later test).
impl Drop for Detached {
    fn drop(&mut self) {
        let stop = Command::new(hvtrace_bin())
            .arg("--socket")
            .arg(&self.socket)
            .arg("stop")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if let Ok(mut child) = stop {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        let Some(pid) = self.supervisor else {
            return;
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while process_alive(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        if process_alive(pid) {
            let tree = process_tree(pid);
            eprintln!("hvtrace-tests: the VM did not stop; killing its processes {tree:?}");
            for p in tree {
                let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
            }
        }
    }
}

/// Runs a guest shell command through the VM's console and returns its
/// output; panics if it fails.
pub fn guest_exec(c: &mut hvtrace::client::Client, cmd: &str) -> String {
    match c
        .call(
            protocol::Request::Exec {
                command: cmd.into(),
            },
            Duration::from_secs(600),
        )
        .expect("exec failed")
        .response
    {
        protocol::Response::Exec { output, status } => {
            assert_eq!(status, 0, "guest command {cmd:?} failed: {output}");
            output
        }
        other => panic!("unexpected answer to exec: {other:?}"),
    }
}

/// VM exits so far, by reason name.
pub fn hv_exits(c: &mut hvtrace::client::Client) -> std::collections::BTreeMap<String, u64> {
    hv_status(c)
        .exits
        .into_iter()
        .map(|e| (e.name, e.count))
        .collect()
}

/// The address on a `/proc/kallsyms` line (its first field, hex without
/// `0x`), as `grep ' NAME$' /proc/kallsyms` prints it.
pub fn kallsyms_address(line: &str) -> Option<u64> {
    u64::from_str_radix(line.split_whitespace().next()?, 16).ok()
}

/// The hypervisor's status report.
pub fn hv_status(c: &mut hvtrace::client::Client) -> protocol::StatusReport {
    match c
        .call(protocol::Request::Status, Duration::from_secs(60))
        .expect("status failed")
        .response
    {
        protocol::Response::Status(s) => s,
        other => panic!("unexpected answer to status: {other:?}"),
    }
}

/// One trace line, ours or the guest's, split into what both print alike.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TraceLine {
    /// The task's comm.
    pub comm: String,
    /// Its pid.
    pub pid: i32,
    /// After the timestamp: `myopen: (do_sys_openat2+0x0/0xa2) dfd=...`
    /// or `do_filp_open <-do_sys_openat2`.
    pub body: String,
}

/// Parses `COMM-PID [CPU] [FLAGS] SECS.USECS: BODY` (the guest's lines have
/// the irq-info column, ours do not); `None` for headers and other text.
pub fn parse_trace_line(l: &str) -> Option<TraceLine> {
    let open = l.find(" [")?;
    let (task, rest) = l.split_at(open);
    let task = task.trim();
    let dash = task.rfind('-')?;
    let pid = task[dash + 1..].parse().ok()?;
    let comm = task[..dash].to_string();
    let close = rest.find(']')?;
    let after = &rest[close + 1..];
    // The first "N.NNNNNN: " ends the context.
    let mut idx = 0;
    for tok in after.split_inclusive(' ') {
        let t = tok.trim();
        idx += tok.len();
        if let Some(ts) = t.strip_suffix(':') {
            if ts.contains('.') && ts.chars().all(|c| c.is_ascii_digit() || c == '.') {
                return Some(TraceLine {
                    comm,
                    pid,
                    body: after[idx..].trim_end().to_string(),
                });
            }
        }
    }
    None
}

/// Every trace line of `text` ([`parse_trace_line`]).
pub fn parse_trace_lines(text: &str) -> Vec<TraceLine> {
    text.lines().filter_map(parse_trace_line).collect()
}

/// Our trace stream, read through the launcher's buffer.
pub struct Stream {
    /// The launcher buffer's cursor.
    pub cursor: u64,
    /// Lines lost so far (hypervisor and launcher).
    pub lost: u64,
    /// Only lines of this source (0: probes and function tracer; N: graph
    /// session N); `None`: all.
    pub source: Option<u32>,
    /// The format asked for.
    pub format: protocol::TraceFormat,
}

impl Default for Stream {
    fn default() -> Self {
        Self::new()
    }
}

impl Stream {
    /// A reader of every source's text lines, from the start of the buffer.
    pub fn new() -> Stream {
        Stream {
            cursor: 0,
            lost: 0,
            source: None,
            format: protocol::TraceFormat::Text,
        }
    }

    /// A reader of one source only, in `format`, from `cursor`.
    pub fn of(source: u32, format: protocol::TraceFormat, cursor: u64) -> Stream {
        Stream {
            cursor,
            lost: 0,
            source: Some(source),
            format,
        }
    }

    /// Everything new, waiting until nothing more comes for a while.
    pub fn read(&mut self, c: &mut hvtrace::client::Client) -> String {
        let mut out = String::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let req = protocol::Request::TraceRead {
                cursor: self.cursor,
                format: self.format,
                wait_ms: 3000,
                source: self.source,
            };
            match c
                .call(req, Duration::from_secs(120))
                .expect("trace read failed")
                .response
            {
                protocol::Response::Trace { next, text, lost } => {
                    self.cursor = next;
                    self.lost += lost;
                    if text.is_empty() || std::time::Instant::now() > deadline {
                        return out;
                    }
                    out.push_str(&text);
                }
                other => panic!("unexpected answer to trace read: {other:?}"),
            }
        }
    }
}

/// One request to the hypervisor (through the launcher); panics if the
/// channel fails.
pub fn hv_call(c: &mut hvtrace::client::Client, r: protocol::Request) -> protocol::Response {
    c.call(r, Duration::from_secs(120))
        .expect("request failed")
        .response
}

/// Stops graph session `session`; whether the hypervisor answered Ok.
pub fn hv_graph_stop(c: &mut hvtrace::client::Client, session: u32) -> bool {
    matches!(
        hv_call(
            c,
            protocol::Request::GraphStop {
                session: Some(session)
            }
        ),
        protocol::Response::Ok
    )
}

/// What both tracers hook beneath `vfs_read` in the oracle (ftrace's
/// `set_ftrace_filter` takes the same globs). Hooking every function would
/// be faithful too, but the guest patching twenty thousand sites through
/// our split view takes many minutes in Bochs.
pub const TRACE_SET: &[&str] = &[
    "vfs_read",
    "rw_verify_area",
    "*file_read_iter",
    "filemap_*",
    "copy_page_to_iter",
    "_copy_to_iter",
    "touch_atime",
    "atime_needs_update",
    "*fsnotify*",
    "security_file_permission",
    "shmem_*",
    "folio_*",
    "xas_*",
];

/// One function_graph line: depth and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// `name() {` at a depth.
    Open(usize, String),
    /// `name();` at a depth.
    Leaf(usize, String),
    /// `}` at a depth.
    Close(usize),
}

/// Parses function_graph text (ours or the guest's) into nodes. Lines are
/// ` CPU) [marker] [duration] |  <indent>call`; the indent is two spaces
/// per level after the two that follow `|`.
pub fn parse_graph(text: &str) -> Vec<Node> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(bar) = line.find('|') else { continue };
        let head = line[..bar].trim_start();
        if !head.contains(')') || head.starts_with('#') {
            continue;
        }
        let body = &line[bar + 1..];
        let body = body.strip_prefix("  ").unwrap_or(body);
        let indent = body.len() - body.trim_start().len();
        let depth = indent / 2;
        let t = body.trim();
        if let Some(name) = t.strip_suffix("() {") {
            out.push(Node::Open(depth, name.to_string()));
        } else if let Some(name) = t.split("();").next().filter(|_| t.contains("();")) {
            out.push(Node::Leaf(depth, name.to_string()));
        } else if t.starts_with('}') {
            out.push(Node::Close(depth));
        }
    }
    out
}

/// Where the guest's tracefs is mounted.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// Runs `workload` (a shell fragment, run in tracefs; each traced task adds
/// itself to `set_ftrace_pid`) under the guest's own function_graph over
/// `vfs_read`'s tree ([`TRACE_SET`], interrupts not shown), then puts the
/// tracer back; returns the guest's trace.
pub fn guest_vfs_read_graph(c: &mut hvtrace::client::Client, workload: &str) -> String {
    guest_exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > set_ftrace_filter && for g in {}; do echo \"$g\" >> set_ftrace_filter 2>/dev/null; done; echo vfs_read > set_graph_function && echo 0 > options/funcgraph-irqs && \
             echo function_graph > current_tracer && echo > trace && \
             {workload} && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_pid; echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt",
            TRACE_SET
                .iter()
                .map(|g| format!("'{g}'"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    )
}

/// The options of a graph session over dd's `vfs_read` (as `run` and
/// `record` spell them): rooted at vfs_read, hooking what it reaches in a
/// read of a tmpfs file (shmem, folios, the atime), dd's calls only, with
/// return values.
pub const DD_READ_GRAPH: &[&str] = &[
    "--graph",
    "vfs_read",
    "--graph-trace",
    "vfs_read",
    "--graph-trace",
    "shmem_*",
    "--graph-trace",
    "folio_*",
    "--graph-trace",
    "touch_atime",
    "--graph-comm",
    "dd",
    "--graph-retval",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_line() {
        let text = "processor\t: 0\nflags\t\t: fpu vme de pse\nflags\t\t: other\n";
        assert_eq!(cpuinfo_flags(text).unwrap(), ["fpu", "vme", "de", "pse"]);
        assert!(cpuinfo_flags("nothing").is_none());
    }

    #[test]
    fn checks_collect() {
        let mut c = Checks::new();
        c.check(true, "fine");
        c.eq("same", 1, 1);
        c.finish();
        let mut c = Checks::new();
        c.eq("differs", "a", "b");
        c.check(false, "second");
        let result = std::panic::catch_unwind(move || c.finish());
        assert!(result.is_err());
    }
}
