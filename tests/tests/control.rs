//! The control channel end to end, on one detached boot of the fast-lane
//! kernel under the hypervisor in Bochs:
//!
//! - `run --detach` returns with the guest shell up (replacing a stale socket
//!   file, refusing a second VM on the same socket);
//! - a forged BTF header (its type section cut short by the attacker module)
//!   before the first request: every `status` answers within the
//!   supervisor's first-request deadline (30 s) while recovery walks it,
//!   and recovery refuses the BTF and says so;
//! - `status` twice: the exit counts grow, one vCPU;
//! - `exec` runs guest commands and passes their status on;
//! - the guest sees no device on COM2;
//! - garbage, cut frames and a frame of another protocol version written raw
//!   into the socket: the hypervisor answers the version mismatch, counts the
//!   rest as bad frames and stays in step;
//! - clients that leave mid-frame or while their answer is on its way harm
//!   nobody;
//! - a console flood past the run's `--console-cap`: console.log stops at
//!   the cap and says what it dropped, the answer keeps the output's end
//!   and says its start was dropped, the shell answers afterwards;
//! - the channel's throughput and round-trip time are measured and printed;
//! - `stop` ends the VM cleanly: stop reason, emulator and supervisor gone,
//!   socket removed; afterwards the CLI fails with one line.
//!
//! Run: `cargo test --release -p hvtrace-tests --test control -- --nocapture`

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use hvtrace::client::Client;
use hvtrace_tests::{hvtrace_bin, hypervisor_image, vm_lock, Checks};
use protocol::io::FrameReader;
use protocol::{encode, Body, Frame, Request, Response, StatusReport, PROTOCOL_VERSION};

const CALL: Duration = Duration::from_secs(60);

/// The run's `--console-cap`: small, so that a flood of a few seconds
/// crosses it (the default, 64 MiB, would take the guest hours).
const CONSOLE_CAP: u64 = 64 * 1024;

/// Lines the console flood prints, each [`FLOOD_LINE`] bytes.
const FLOOD_LINES: u64 = 2400;
const FLOOD_LINE: u64 = 64;

/// How long one `status` may take while recovery runs: the supervisor's
/// own deadline for a boot's first requests (its plain limit, stretched
/// as it is before the emulator's pace is measured).
const STATUS_LIMIT: Duration = Duration::from_secs(
    hvtrace::daemon::link::DEFAULT_TIMEOUT.as_secs()
        * hvtrace::daemon::link::Pace::UNMEASURED_STRETCH as u64,
);

/// A forged BTF header before the first request: the attacker shortens the
/// type section of the kernel's own BTF header (`__start_BTF`) by 4 bytes,
/// so that recovery walks every type (the most a header within its bounds
/// can make it read) and only then finds the last one cut. Every `status`
/// during recovery answers within [`STATUS_LIMIT`]; recovery ends with the
/// kernel's symbols and the BTF refused (named in the status), and the
/// attacker puts the header back on rmmod.
fn forged_btf_header(checks: &mut Checks, socket: &Path) {
    let sym = text(&cli(socket, &["exec", "grep ' __start_BTF$' /proc/kallsyms"]).stdout);
    let Some(addr) = hvtrace_tests::kallsyms_address(&sym) else {
        checks.check(false, format!("__start_BTF in /proc/kallsyms: {sym:?}"));
        return;
    };
    let forged = text(
        &cli(
            socket,
            &[
                "exec",
                &format!(
                    "insmod /lib/hvattack.ko btf={addr:#x} 2>&1; dmesg | grep 'hvattack: btf'"
                ),
            ],
        )
        .stdout,
    );
    checks.check(
        forged.contains("hvattack: btf header at"),
        format!("the attacker shortened the BTF type section: {forged:?}"),
    );
    let mut c = match client(socket) {
        Ok(c) => c,
        Err(e) => {
            checks.check(false, format!("cannot open a session: {e:#}"));
            return;
        }
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs(240);
    let (mut asked, mut slowest) = (0u32, Duration::ZERO);
    let kernel = loop {
        let t0 = Instant::now();
        let answer = c.call(Request::Status, STATUS_LIMIT).map(|r| r.response);
        let took = t0.elapsed();
        asked += 1;
        slowest = slowest.max(took);
        match answer {
            Ok(Response::Status(st)) => {
                if let Some(k) = st.kernel {
                    break Some(k);
                }
            }
            other => {
                checks.check(
                    false,
                    format!("status {asked} during recovery over a forged BTF header: {other:?} after {took:?}"),
                );
                break None;
            }
        }
        if Instant::now() > deadline {
            checks.check(
                false,
                "recovery over a forged BTF header did not end in 240 s",
            );
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    println!(
        "forged BTF header: recovery ended after {:.1} s; {asked} status requests, the slowest answered in {:.2} s",
        started.elapsed().as_secs_f64(),
        slowest.as_secs_f64()
    );
    checks.check(
        slowest < STATUS_LIMIT,
        format!("every status answered within {STATUS_LIMIT:?}: slowest {slowest:?}"),
    );
    if let Some(k) = kernel {
        println!(
            "kernel: {} symbols, BTF: {:?}",
            k.symbols, k.task_layout_error
        );
        checks.check(
            k.symbols > 10_000,
            format!("the kernel's symbols were recovered: {}", k.symbols),
        );
        checks.check(
            k.task_layout_error
                .as_deref()
                .is_some_and(|e| e.contains("malformed BTF type")),
            format!(
                "the cut BTF is refused and named: {:?}",
                k.task_layout_error
            ),
        );
    }
    let restored = text(
        &cli(
            socket,
            &[
                "exec",
                "rmmod hvattack; dmesg | grep 'hvattack: btf header restored'",
            ],
        )
        .stdout,
    );
    checks.check(
        restored.contains("restored"),
        format!("the attacker put the header back: {restored:?}"),
    );
}

/// A guest that floods its console: 150 KiB, past the run's console cap.
/// console.log stops at the cap and says how much it dropped; the buffer
/// the answer is read from keeps only the end of the output (the answer
/// says its start was dropped) and still finds the command's end; the
/// shell answers afterwards.
fn console_flood(checks: &mut Checks, socket: &Path, run_dir: Option<&Path>) {
    let Some(log_path) = run_dir.map(|d| d.join("console.log")) else {
        checks.check(false, "no run directory for the console flood");
        return;
    };
    // Each line: "flood-NNNNN-" and x's up to FLOOD_LINE bytes with its newline.
    let cmd = format!(
        "i=0; x=$(printf '%0{}d' 0 | tr 0 x); while [ $i -lt {FLOOD_LINES} ]; do printf 'flood-%05d-%s\\n' $i \"$x\"; i=$((i+1)); done",
        FLOOD_LINE - 13
    );
    let started = Instant::now();
    let flood = cli(socket, &["exec", &cmd]);
    let took = started.elapsed();
    let out = text(&flood.stdout);
    checks.eq("the flood's status", flood.status.code(), Some(0));
    let bytes = FLOOD_LINES * FLOOD_LINE;
    println!(
        "console flood: {bytes} bytes in {:.1} s ({:.1} KB/s of wall time)",
        took.as_secs_f64(),
        bytes as f64 / took.as_secs_f64() / 1000.0
    );
    let first = out.lines().next().unwrap_or("");
    checks.check(
        first.starts_with(&format!(
            "[hvtrace: the start of this output was dropped: the console buffer keeps the last {CONSOLE_CAP} bytes]"
        )),
        format!("the answer says its start was dropped: {first:?}"),
    );
    let last = format!("flood-{:05}-", FLOOD_LINES - 1);
    checks.check(
        out.lines().last().is_some_and(|l| l.starts_with(&last)) && !out.contains("flood-00000-"),
        format!(
            "the answer keeps the end of the output, not its start ({} bytes, last line {:?})",
            out.len(),
            out.lines().last()
        ),
    );
    checks.check(
        (out.len() as u64) <= CONSOLE_CAP + CONSOLE_CAP / 8 + 200,
        format!(
            "the answer is bounded by the console buffer: {} bytes",
            out.len()
        ),
    );
    let log = std::fs::read(&log_path).unwrap_or_default();
    let log_text = String::from_utf8_lossy(&log);
    let note = log_text.lines().last().unwrap_or("");
    let dropped: Option<u64> = note
        .strip_prefix(&format!(
            "[hvtrace: log truncated at its cap of {CONSOLE_CAP} bytes; dropped since:"
        ))
        .and_then(|r| r.trim().strip_suffix("bytes]"))
        .and_then(|n| n.trim().parse().ok());
    println!("console.log: {} bytes, last line {note:?}", log.len());
    checks.check(
        (log.len() as u64) <= CONSOLE_CAP + 200,
        format!("console.log stops at the cap: {} bytes", log.len()),
    );
    checks.check(
        dropped.is_some_and(|d| d + CONSOLE_CAP >= bytes),
        format!("console.log says what it dropped: {note:?}"),
    );
    let echo = cli(socket, &["exec", "echo", "after", "the", "flood"]);
    checks.eq(
        "exec after the console flood",
        text(&echo.stdout),
        "after the flood\n".to_string(),
    );
}

/// The detached VM of this test; stops it (or kills its supervisor) when the
/// test ends early.
struct Detached {
    socket: PathBuf,
    supervisor: Option<u32>,
    run_dir: Option<PathBuf>,
}

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(pid) = self.supervisor.filter(|&p| alive(p)) {
            // SIGTERM ends the supervisor; its emulator has a parent-death
            // signal and follows it.
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A scratch directory for this test's sockets.
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvtrace-control-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn cli(socket: &Path, args: &[&str]) -> Output {
    Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks that a failed command printed exactly one `hvtrace: error:` line
/// (and nothing on stdout); returns the message.
fn one_line_failure(checks: &mut Checks, what: &str, out: &Output) -> String {
    let stderr = text(&out.stderr);
    checks.check(!out.status.success(), format!("{what} succeeded: {stderr}"));
    checks.check(
        out.stdout.is_empty(),
        format!("{what} printed on stdout: {:?}", text(&out.stdout)),
    );
    let lines: Vec<&str> = stderr.lines().collect();
    checks.check(
        lines.len() == 1 && lines[0].starts_with("hvtrace: error: "),
        format!("{what}: not one error line: {stderr:?}"),
    );
    for bad in ["panicked", "backtrace", "Caused by"] {
        checks.check(!stderr.contains(bad), format!("{what}: {stderr:?}"));
    }
    stderr
        .trim()
        .trim_start_matches("hvtrace: error: ")
        .to_string()
}

/// True while a process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .map(|(_, rest)| !rest.starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// The processes whose working directory is `dir` (the supervisor and the
/// emulator run in the run directory).
fn processes_in(dir: &Path) -> Vec<u32> {
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(cwd) = std::fs::read_link(entry.path().join("cwd")) {
            if cwd == dir {
                pids.push(pid);
            }
        }
    }
    pids
}

fn client(socket: &Path) -> anyhow::Result<Client> {
    let mut c = Client::connect(socket)?;
    c.hello()?;
    Ok(c)
}

fn status(c: &mut Client) -> anyhow::Result<(StatusReport, Duration)> {
    let reply = c.call(Request::Status, CALL)?;
    match reply.response {
        Response::Status(s) => Ok((s, reply.round_trip)),
        other => Err(hvtrace::client::response_error(other)),
    }
}

fn exit_count(report: &StatusReport, name: &str) -> u64 {
    report
        .exits
        .iter()
        .find(|e| e.name == name)
        .map_or(0, |e| e.count)
}

fn wire(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out).unwrap();
    out
}

/// A number after `"key":` in a JSON text.
fn json_number(json: &str, key: &str) -> Option<u64> {
    let at = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let digits: String = json[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// The count of one exit reason in `status --json`.
fn json_exit_count(json: &str, name: &str) -> Option<u64> {
    let at = json.find(&format!("\"name\":\"{name}\""))?;
    json_number(&json[at..], "count")
}

/// Reads frames from a raw connection until `want` matches one (or `timeout`).
fn read_until(
    stream: &UnixStream,
    timeout: Duration,
    want: impl Fn(&Frame) -> bool,
) -> Option<Frame> {
    let mut reader = FrameReader::new(stream.try_clone().ok()?);
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        reader.get_ref().set_read_timeout(Some(left)).ok()?;
        match reader.read_frame() {
            Ok(frame) if want(&frame) => return Some(frame),
            Ok(_) | Err(protocol::io::ReadError::Decode(_)) => {}
            Err(protocol::io::ReadError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return None,
        }
    }
}

/// Figures of one throughput run.
struct Rate {
    what: &'static str,
    messages: usize,
    bytes: usize,
    wall: Duration,
}

impl Rate {
    fn print(&self) {
        let secs = self.wall.as_secs_f64();
        println!(
            "   {:<34} {:>4} messages, {:>6} bytes in {:>6.2} s: {:>7.1} messages/s, {:>7.0} bytes/s, {:>6.1} ms per message",
            self.what,
            self.messages,
            self.bytes,
            secs,
            self.messages as f64 / secs,
            self.bytes as f64 / secs,
            secs * 1e3 / self.messages as f64
        );
    }
}

/// Sequential and pipelined pings and a few status reports through the
/// supervisor; prints the rates and what the hypervisor saw meanwhile.
fn bench(checks: &mut Checks, c: &mut Client, socket: &Path, label: &str) {
    println!(" {label}:");
    let hv_before = status(c).ok();
    let bench_start = Instant::now();
    let ping_wire = wire(&Frame::request(1, Request::Ping { nonce: 1 })).len();
    let pong_wire = wire(&Frame::response(1, Response::Pong { nonce: 1 })).len();
    let n = 200;
    let t = Instant::now();
    let mut ok = 0;
    for i in 0..n {
        if let Ok(r) = c.call(Request::Ping { nonce: i as u64 }, CALL) {
            ok += usize::from(r.response == Response::Pong { nonce: i as u64 });
        }
    }
    checks.eq(&format!("{label}: sequential pings answered"), ok, n);
    let sequential = Rate {
        what: "sequential Ping/Pong",
        messages: n,
        bytes: n * (ping_wire + pong_wire),
        wall: t.elapsed(),
    };

    let mut raw = UnixStream::connect(socket).unwrap();
    let mut burst = Vec::new();
    for i in 0..n {
        burst.extend(wire(&Frame::request(
            10_000 + i as u32,
            Request::Ping { nonce: i as u64 },
        )));
    }
    let t = Instant::now();
    raw.write_all(&burst).unwrap();
    let mut reader = FrameReader::new(raw.try_clone().unwrap());
    raw.set_read_timeout(Some(CALL)).unwrap();
    let mut got = 0;
    while got < n {
        match reader.read_frame() {
            Ok(Frame {
                body: Body::Response(Response::Pong { .. }),
                ..
            }) => got += 1,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    checks.eq(&format!("{label}: pipelined pings answered"), got, n);
    let pipelined = Rate {
        what: "pipelined Ping/Pong (200 at once)",
        messages: n,
        bytes: burst.len() + n * pong_wire,
        wall: t.elapsed(),
    };
    drop(reader);
    drop(raw);

    let mut rtts = Vec::new();
    let mut status_bytes = 0;
    let mut response_bytes = 0;
    let t = Instant::now();
    for _ in 0..5 {
        if let Ok((s, rtt)) = status(c) {
            let response = wire(&Frame::response(1, Response::Status(s))).len();
            response_bytes = response;
            status_bytes += wire(&Frame::request(1, Request::Status)).len() + response;
            rtts.push(rtt);
        }
    }
    checks.eq(&format!("{label}: status reports answered"), rtts.len(), 5);
    let statuses = Rate {
        what: "sequential Status",
        messages: rtts.len().max(1),
        bytes: status_bytes,
        wall: t.elapsed(),
    };
    let bench_wall = bench_start.elapsed();
    let hv_after = status(c).ok();
    sequential.print();
    pipelined.print();
    statuses.print();
    if !rtts.is_empty() {
        rtts.sort();
        println!(
            "   status round trip: min {:.1} ms, median {:.1} ms, max {:.1} ms; the answer is {response_bytes} bytes on the wire",
            rtts[0].as_secs_f64() * 1e3,
            rtts[rtts.len() / 2].as_secs_f64() * 1e3,
            rtts[rtts.len() - 1].as_secs_f64() * 1e3,
        );
    }
    if let (Some((b, _)), Some((a, _))) = (&hv_before, &hv_after) {
        let emulated = (a.uptime_ns - b.uptime_ns) as f64 / 1e9;
        let wall = bench_wall.as_secs_f64();
        let turns = exit_count(a, "PREEMPTION_TIMER") - exit_count(b, "PREEMPTION_TIMER");
        let bytes_in = a.channel.bytes_in - b.channel.bytes_in;
        let bytes_out = a.channel.bytes_out - b.channel.bytes_out;
        println!(
            "   hypervisor side: {bytes_in} bytes in, {bytes_out} bytes out, {turns} timer turns; \
             {emulated:.2} s emulated in {wall:.2} s wall ({:.2}x); {:.0} turns per emulated s; \
             {:.0} bytes in per emulated s, {:.2} per turn",
            emulated / wall,
            turns as f64 / emulated,
            bytes_in as f64 / emulated,
            bytes_in as f64 / turns.max(1) as f64
        );
    }
}

#[test]
fn control_channel_in_bochs() {
    let _vm = vm_lock();
    let hypervisor = hypervisor_image();
    let initrd = hvtrace::vm::guest::run_script("scripts/guest/attacker.sh")
        .expect("building the attacker module failed");
    let dir = scratch();
    let socket = dir.join("ctl.sock");
    let mut checks = Checks::new();

    // A stale socket file (its owner died) is replaced.
    drop(UnixListener::bind(&socket).unwrap());

    // ----- run --detach -----
    let started = Instant::now();
    let out = Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(&socket)
        .args([
            "run",
            "--detach",
            "--quiet",
            "--guest",
            "fast",
            "--emulator",
            "bochs",
            "--timeout",
            "300",
            "--console-cap",
            &CONSOLE_CAP.to_string(),
        ])
        .arg("--initrd")
        .arg(&initrd)
        .arg("--hypervisor")
        .arg(&hypervisor)
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace");
    let detach_wall = started.elapsed();
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "hvtrace run --detach failed:\n{stderr}"
    );
    let mut vm = Detached {
        socket: socket.clone(),
        supervisor: None,
        run_dir: None,
    };
    for line in stderr.lines() {
        if let Some(rest) = line.strip_prefix("hvtrace: supervisor pid ") {
            if let Some((pid, dir)) = rest.split_once("; run directory ") {
                vm.supervisor = pid.trim().parse().ok();
                vm.run_dir = Some(PathBuf::from(dir.trim()));
            }
        }
    }
    checks.check(
        vm.supervisor.is_some(),
        format!("run --detach did not name the supervisor: {stderr}"),
    );
    checks.check(
        stderr.contains("VM ready"),
        format!("run --detach did not say the VM is ready: {stderr}"),
    );
    println!(
        "run --detach returned after {:.1} s",
        detach_wall.as_secs_f64()
    );

    // The socket is taken: a second VM on it is refused at once.
    let second = cli(
        &socket,
        &["run", "--detach", "--guest", "fast", "--emulator", "bochs"],
    );
    let msg = one_line_failure(&mut checks, "a second run --detach", &second);
    checks.check(
        msg.contains("already owns"),
        format!("second run --detach: {msg}"),
    );

    // ----- a forged BTF header before the first request to root -----
    forged_btf_header(&mut checks, &socket);

    // ----- status twice -----
    let first = cli(&socket, &["status", "--json"]);
    std::thread::sleep(Duration::from_millis(500));
    let again = cli(&socket, &["status", "--json"]);
    let (j1, j2) = (text(&first.stdout), text(&again.stdout));
    checks.check(
        first.status.success() && again.status.success(),
        format!(
            "status --json failed: {} {}",
            text(&first.stderr),
            text(&again.stderr)
        ),
    );
    checks.eq("vcpus", json_number(&j1, "vcpus"), Some(1));
    checks.eq(
        "protocol version",
        json_number(&j1, "protocol_version"),
        Some(u64::from(PROTOCOL_VERSION)),
    );
    let (t1, t2) = (
        json_number(&j1, "exits_total"),
        json_number(&j2, "exits_total"),
    );
    checks.check(
        matches!((t1, t2), (Some(a), Some(b)) if b > a),
        format!("exits_total did not grow: {t1:?} then {t2:?}"),
    );
    let (p1, p2) = (
        json_exit_count(&j1, "PREEMPTION_TIMER"),
        json_exit_count(&j2, "PREEMPTION_TIMER"),
    );
    checks.check(
        matches!((p1, p2), (Some(a), Some(b)) if b > a),
        format!("PREEMPTION_TIMER did not grow: {p1:?} then {p2:?}"),
    );
    let human = cli(&socket, &["status"]);
    let human_text = text(&human.stdout);
    for needle in [
        "vcpus        1\n",
        "PREEMPTION_TIMER",
        "round trip",
        "channel",
    ] {
        checks.check(
            human_text.contains(needle),
            format!("status lacks {needle:?}:\n{human_text}"),
        );
    }
    println!("status:\n{human_text}");

    // ----- exec -----
    let hostname = cli(&socket, &["exec", "cat", "/etc/hostname"]);
    checks.eq(
        "exec cat /etc/hostname",
        text(&hostname.stdout).trim(),
        "hvtrace-guest",
    );
    checks.eq(
        "exec cat /etc/hostname status",
        hostname.status.code(),
        Some(0),
    );
    let failing = cli(&socket, &["exec", "echo out; echo err >&2; exit 3"]);
    checks.eq(
        "failing exec output",
        text(&failing.stdout),
        "out\nerr\n".to_string(),
    );
    checks.eq("failing exec status", failing.status.code(), Some(3));

    // ----- the guest sees no UART on COM2 -----
    let serial = cli(&socket, &["exec", "cat /proc/tty/driver/serial"]);
    let serial = text(&serial.stdout);
    let com2 = serial
        .lines()
        .find(|l| l.trim_start().starts_with("1:"))
        .unwrap_or("")
        .to_string();
    checks.check(
        com2.contains("uart:unknown"),
        format!("/proc/tty/driver/serial line 1: {com2:?} (all: {serial:?})"),
    );
    checks.check(
        com2.contains("2F8"),
        format!("line 1 is not COM2: {com2:?}"),
    );
    let dmesg = text(&cli(&socket, &["exec", "dmesg"]).stdout);
    checks.check(
        dmesg.contains("ttyS0"),
        "dmesg does not mention ttyS0 (is dmesg empty?)",
    );
    checks.check(
        !dmesg.contains("ttyS1"),
        format!(
            "dmesg mentions ttyS1: {:?}",
            dmesg
                .lines()
                .filter(|l| l.contains("ttyS1"))
                .collect::<Vec<_>>()
        ),
    );

    // ----- garbage, cut frames and another protocol version -----
    let mut c = match client(&socket) {
        Ok(c) => c,
        Err(e) => panic!("cannot open a session: {e:#}"),
    };
    let before = checks.ok("status before the garbage", status(&mut c).map(|s| s.0));
    {
        let mut raw = UnixStream::connect(&socket).unwrap();
        let status_frame = wire(&Frame::request(77, Request::Status));
        let mut old = Frame::request(4242, Request::Ping { nonce: 1 });
        old.version = PROTOCOL_VERSION + 1;
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"\x00hello, hypervisor\x00");
        bytes.extend((0..40u8).map(|i| i.wrapping_mul(37) | 1));
        bytes.push(0);
        // A frame cut short, then (its leading delimiter ends the cut one)
        // a frame of the next protocol version.
        bytes.extend_from_slice(&status_frame[..status_frame.len() / 2]);
        bytes.extend_from_slice(&wire(&old));
        raw.write_all(&bytes).unwrap();
        let answer = read_until(&raw, CALL, |f| f.seq == 4242);
        match answer.map(|f| f.body) {
            Some(Body::Response(Response::VersionMismatch { ours, theirs })) => {
                checks.eq("VersionMismatch ours", ours, PROTOCOL_VERSION);
                checks.eq("VersionMismatch theirs", theirs, PROTOCOL_VERSION + 1);
            }
            other => checks.check(
                false,
                format!("no VersionMismatch for the other-version frame: {other:?}"),
            ),
        }
    }
    let after = checks.ok("status after the garbage", status(&mut c).map(|s| s.0));
    if let (Some(b), Some(a)) = (&before, &after) {
        let grew = a.channel.bad_frames - b.channel.bad_frames;
        // The noise, the bytes, the cut frame and the other version: four.
        checks.check(
            grew >= 4,
            format!("the hypervisor's bad_frames grew by {grew}, expected at least 4"),
        );
        println!("garbage: the hypervisor counted {grew} bad frames and stayed in step");
    }

    // ----- clients that leave early -----
    {
        // In the middle of a frame.
        let mut raw = UnixStream::connect(&socket).unwrap();
        let f = wire(&Frame::request(1, Request::Status));
        raw.write_all(&f[..f.len() - 3]).unwrap();
    }
    {
        // Right after a request, before its answer.
        let mut raw = UnixStream::connect(&socket).unwrap();
        raw.write_all(&wire(&Frame::request(2, Request::Status)))
            .unwrap();
    }
    {
        // While a guest command runs.
        let mut raw = UnixStream::connect(&socket).unwrap();
        raw.write_all(&wire(&Frame::request(
            3,
            Request::Exec {
                command: "sleep 1; echo late".into(),
            },
        )))
        .unwrap();
    }
    match client(&socket).and_then(|mut c| status(&mut c)) {
        Ok((s, _)) => checks.eq("vcpus after early leavers", s.vcpus, 1),
        Err(e) => checks.check(false, format!("status after clients left early: {e:#}")),
    }
    let echo = cli(&socket, &["exec", "echo", "still", "here"]);
    checks.eq(
        "exec after clients left early",
        text(&echo.stdout),
        "still here\n".to_string(),
    );

    // ----- a console flood -----
    console_flood(&mut checks, &socket, vm.run_dir.as_deref());

    // ----- throughput and round trips -----
    println!("control channel in Bochs (client -> supervisor -> COM2 -> hypervisor and back):");
    bench(&mut checks, &mut c, &socket, "idle guest");
    // A guest that never halts: emulated time then runs at the pace of the
    // wall clock instead of racing through idle time.
    let spin = cli(
        &socket,
        &["exec", "while :; do :; done >/dev/null 2>&1 & echo $!"],
    );
    let spinner = text(&spin.stdout).trim().to_string();
    checks.check(
        spinner.parse::<u32>().is_ok(),
        format!("no pid for the busy loop: {spinner:?}"),
    );
    bench(&mut checks, &mut c, &socket, "busy guest");
    let killed = cli(&socket, &["exec", &format!("kill {spinner}")]);
    checks.eq("kill the busy loop", killed.status.code(), Some(0));
    drop(c);

    // ----- stop -----
    let procs = vm.run_dir.as_deref().map(processes_in).unwrap_or_default();
    checks.check(
        procs.len() >= 2,
        format!("expected the supervisor and the emulator in the run directory, found {procs:?}"),
    );
    // A client that stays connected through the stop.
    let mut lingering = client(&socket).ok();
    checks.check(
        lingering.is_some(),
        "cannot connect a client before the stop",
    );
    let stop = cli(&socket, &["stop"]);
    let stop_out = text(&stop.stdout);
    checks.check(
        stop.status.success(),
        format!("stop failed: {}", text(&stop.stderr)),
    );
    checks.check(
        stop_out.contains("guest stopped: stopped by the host"),
        format!("stop output: {stop_out:?}"),
    );
    checks.check(
        stop_out.contains("PREEMPTION_TIMER"),
        format!("stop printed no exit counts: {stop_out:?}"),
    );
    println!("stop:\n{stop_out}");
    checks.check(
        !socket.exists(),
        "the control socket is still there after stop",
    );
    let until = Instant::now() + Duration::from_secs(15);
    while procs.iter().any(|&p| alive(p)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = procs.iter().copied().filter(|&p| alive(p)).collect();
    checks.check(
        left.is_empty(),
        format!("processes of the VM still run after stop: {left:?}"),
    );

    // The client that stayed is told the VM has ended.
    if let Some(c) = lingering.as_mut() {
        match status(c) {
            Ok(_) => checks.check(false, "a status after the stop was answered"),
            Err(e) => {
                let e = format!("{e:#}");
                checks.check(
                    e.contains("ended"),
                    format!("lingering client after the stop: {e}"),
                );
            }
        }
    }

    // ----- one-line errors once the VM is gone -----
    let msg = one_line_failure(&mut checks, "status after stop", &cli(&socket, &["status"]));
    checks.check(
        msg.contains("no VM is running"),
        format!("status after stop: {msg}"),
    );
    drop(UnixListener::bind(&socket).unwrap());
    let msg = one_line_failure(
        &mut checks,
        "exec on a dead VM's socket",
        &cli(&socket, &["exec", "true"]),
    );
    checks.check(
        msg.contains("is gone"),
        format!("exec on a dead VM's socket: {msg}"),
    );
    let _ = std::fs::remove_file(&socket);
    let msg = one_line_failure(
        &mut checks,
        "status on a missing path",
        &cli(Path::new("/nonexistent/dir/hvtrace.sock"), &["status"]),
    );
    checks.check(
        msg.contains("/nonexistent/dir/hvtrace.sock"),
        format!("missing path: {msg}"),
    );

    vm.supervisor = None;
    let _ = std::fs::remove_dir_all(&dir);
    checks.finish();
}
