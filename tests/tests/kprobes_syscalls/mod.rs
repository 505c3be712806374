//! `hvtrace syscalls` (the CLI) against the guest's own syscall events
//! (`syscalls:sys_enter_*`/`sys_exit_*`, CONFIG_FTRACE_SYSCALLS, which
//! Debian's kernel and the fast lane's have), both filtered on the same
//! comm, over the same workload (`hvbench syscalls`: opens, one failing,
//! one through `openat2` with an `open_how`, reads, writes, a stat, a
//! fork whose child execs `hvbench` again, and a wait; every call under
//! the comm `hvbench`): the same calls in the same order per task, the
//! same numeric arguments and return values, the strings, `argv` and
//! `open_how` the workload passed, and `--summary`'s counts equal to the
//! guest's.

use std::collections::BTreeMap;

use hvtrace::client::Client;
use hvtrace_tests::{
    guest_exec as exec, parse_trace_lines as parse_all, Checks, Detached, TRACEFS,
};
use serde_json::Value;

const CALLS: [&str; 9] = [
    "openat",
    "read",
    "write",
    "close",
    "newfstatat",
    "openat2",
    "clone",
    "execve",
    "wait4",
];
const WORK: &str = "hvbench syscalls /tmp/hvsys; rm -f /tmp/hvsys";
const COMM: &str = "hvbench";

/// One call as both sides can say it: (pid, call, numeric args, return).
type Call = (i32, String, Vec<u64>, i64);

pub fn syscalls_oracle(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    let events: String = CALLS
        .iter()
        .map(|e| {
            format!(
                "echo 'comm == \"{COMM}\"' > events/syscalls/sys_enter_{e}/filter; \
                 echo 'comm == \"{COMM}\"' > events/syscalls/sys_exit_{e}/filter; \
                 echo 1 > events/syscalls/sys_enter_{e}/enable; echo 1 > events/syscalls/sys_exit_{e}/enable; "
            )
        })
        .collect();
    exec(
        c,
        &format!("cd {TRACEFS} && echo > trace && {events} echo on"),
    );
    let mut args = vec!["syscalls"];
    args.extend(CALLS);
    args.extend(["--comm", COMM, "--json", "--exec", WORK]);
    let t0 = std::time::Instant::now();
    let (code, out, err) = vm.cli(&args);
    let took = t0.elapsed();
    let trace = exec(
        c,
        &format!("cd {TRACEFS} && grep -v '^#' trace; echo > trace"),
    );
    // The same workload again, counted in root (`--summary`): calls,
    // errors and time per call, no call recorded.
    let mut args = vec!["syscalls"];
    args.extend(CALLS);
    args.extend(["--comm", COMM, "--json", "--summary", "--exec", WORK]);
    let (sum_code, sum_out, sum_err) = vm.cli(&args);
    let off: String = CALLS
        .iter()
        .map(|e| {
            format!(
                "echo 0 > events/syscalls/sys_enter_{e}/enable; echo 0 > events/syscalls/sys_exit_{e}/enable; \
                 echo 0 > events/syscalls/sys_enter_{e}/filter; echo 0 > events/syscalls/sys_exit_{e}/filter; "
            )
        })
        .collect();
    let sum_trace = exec(
        c,
        &format!("cd {TRACEFS} && {off} grep -v '^#' trace; echo > trace"),
    );
    ck.eq("syscalls exit code", code, 0);
    ck.eq("syscalls --summary exit code", sum_code, 0);
    println!("syscalls --summary: {sum_out}{sum_err}");
    println!(
        "syscalls: ours in {:.1} s; stderr: {}",
        took.as_secs_f64(),
        err.trim()
    );

    // Ours: JSON lines.
    let mut ours: Vec<Call> = Vec::new();
    let mut strings: Vec<(String, String)> = Vec::new();
    let mut decoded: Vec<(i32, String, String, Value)> = Vec::new();
    for l in out.lines() {
        if let Ok(v) = serde_json::from_str::<Value>(l) {
            let call = v["syscall"].as_str().unwrap_or("").to_string();
            let pid = v["pid"].as_i64().unwrap_or(-1) as i32;
            let mut nums = Vec::new();
            if let Some(a) = v["args"].as_object() {
                for (k, x) in a {
                    match x {
                        // Registers, truncated to the width they were read at.
                        Value::Number(n) => {
                            nums.push(n.as_i64().map_or(n.as_u64().unwrap_or(0), |i| i as u64))
                        }
                        Value::String(s) if s.starts_with("0x") => {
                            nums.push(u64::from_str_radix(&s[2..], 16).unwrap_or(0))
                        }
                        Value::String(s) => strings.push((format!("{call}.{k}"), s.clone())),
                        // A string that did not read (the guest had not
                        // paged it in) is not a number either.
                        Value::Null => strings.push((format!("{call}.{k}"), "(fault)".into())),
                        Value::Array(_) | Value::Object(_) => {
                            decoded.push((pid, call.clone(), k.clone(), x.clone()))
                        }
                        _ => nums.push(u64::MAX),
                    }
                }
            }
            ours.push((pid, call, nums, v["ret"].as_i64().unwrap_or(i64::MIN)));
        }
    }

    // The guest's: `sys_openat(dfd: ffffff9c, filename: 7ffc..., ...)` and
    // `sys_openat -> 0x3`, paired per task.
    let guest = guest_calls(&trace);
    let sum_guest = guest_calls(&sum_trace);
    // Ours read registers at their C width: compare the guest's the same way.
    // (Strings, argv and structs left out: openat's dfd, flags, mode;
    // newfstatat's dfd, statbuf, flag; read's and write's fd, buf, count;
    // close's fd; openat2's dfd, usize; execve's envp; clone's five;
    // wait4's upid, stat_addr, options, ru.)
    let width = |call: &str, i: usize| -> u32 {
        match (call, i) {
            ("openat", _) | ("newfstatat", 0) | ("newfstatat", 2) => 32,
            ("close", 0) | ("read", 0) | ("write", 0) => 32,
            ("openat2", 0) | ("wait4", 0) | ("wait4", 2) => 32,
            _ => 64,
        }
    };
    let norm = |v: &[Call]| -> Vec<Call> {
        v.iter()
            .map(|(p, c, a, r)| {
                let a = a
                    .iter()
                    .enumerate()
                    .map(|(i, x)| match width(c, i) {
                        32 => *x as u32 as u64,
                        _ => *x,
                    })
                    .collect();
                (*p, c.clone(), a, *r)
            })
            .collect()
    };
    let (o, g) = (norm(&ours), norm(&guest));
    println!("syscalls: ours {} calls, guest {}", o.len(), g.len());
    for (a, b) in o.iter().zip(&g).take(4) {
        println!("  ours {a:?}\n  guest {b:?}");
    }
    ck.check(
        o.len() >= 16,
        format!("the workload's calls were traced: {out}"),
    );
    ck.eq(
        "our calls equal the guest's syscall events (pid, call, numbers, return)",
        &o,
        &g,
    );
    ck.check(
        strings
            .iter()
            .any(|(k, s)| k == "openat.filename" && s == "/etc/hostname")
            && strings
                .iter()
                .any(|(k, s)| k == "openat.filename" && s == "/nonexistent/hvsys"),
        format!("the file names the workload passed: {strings:?}"),
    );
    ck.check(
        ours.iter().any(|(_, c, _, r)| c == "openat" && *r == -2),
        "the failing open returned -ENOENT",
    );
    ck.check(
        err.contains("status=0"),
        format!("the workload ran to its end: {err}"),
    );
    ck.check(
        strings
            .iter()
            .any(|(k, s)| k == "openat.filename" && s == "/tmp/hvsys")
            && strings
                .iter()
                .any(|(k, s)| k == "execve.filename" && s == "/bin/hvbench"),
        format!("the exec's file and the child's open: {strings:?}"),
    );
    // The fork's return is the child's pid, which then execs with the argv
    // the workload passed, and reads the file under its own pid.
    let child = ours
        .iter()
        .find(|(_, c, _, _)| c == "clone")
        .map_or(-1, |(_, _, _, r)| *r as i32);
    let argv = decoded
        .iter()
        .find(|(p, c, k, _)| *p == child && c == "execve" && k == "argv")
        .map(|(_, _, _, v)| v.clone());
    ck.eq(
        "execve's argv, read in the child the fork returned",
        argv,
        Some(serde_json::json!(["hvbench", "exec-child", "/tmp/hvsys"])),
    );
    ck.check(
        ours.iter()
            .any(|(p, c, _, r)| *p == child && c == "read" && *r > 0),
        format!("the exec'd child read the file under pid {child}"),
    );
    let how = decoded
        .iter()
        .find(|(_, c, k, _)| c == "openat2" && k == "how")
        .map(|(_, _, _, v)| v.clone());
    ck.eq(
        "openat2's open_how, laid out from the guest's BTF",
        how,
        // O_RDONLY | O_CLOEXEC, RESOLVE_NO_SYMLINKS.
        Some(serde_json::json!({"flags": 0o2000000, "mode": 0, "resolve": 4})),
    );
    // --summary: (calls, errors) per call, against the guest's for the
    // same (second) run.
    let mut want: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (_, call, _, ret) in &sum_guest {
        let e = want.entry(call.clone()).or_default();
        e.0 += 1;
        e.1 += u64::from((-4095..0).contains(ret));
    }
    let mut got: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut time_ns = 0;
    if let Some(v) = sum_out
        .lines()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        for r in v["summary"].as_array().into_iter().flatten() {
            got.insert(
                r["syscall"].as_str().unwrap_or("").to_string(),
                (
                    r["calls"].as_u64().unwrap_or(0),
                    r["errors"].as_u64().unwrap_or(0),
                ),
            );
            time_ns += r["ns"].as_u64().unwrap_or(0);
        }
    }
    ck.check(
        want.get("openat").is_some_and(|e| e.1 == 1),
        format!("the guest saw the failing open in the second run: {want:?}"),
    );
    ck.eq(
        "--summary's calls and errors (counted in root) equal the guest's",
        got,
        want,
    );
    ck.check(time_ns > 0, "--summary timed the calls");
}

fn is_string_arg(call: &str, arg: &str) -> bool {
    matches!(
        (call, arg),
        ("openat", "filename")
            | ("newfstatat", "filename")
            | ("openat2", "filename")
            | ("openat2", "how")
            | ("execve", "filename")
            | ("execve", "argv")
    )
}

/// Fast lane: what a traced call costs the guest, ours against its own
/// syscall tracepoints, on `hvbench getppid N` (the guest's clock, ns per
/// call, as the kprobes benchmark reads it).
pub fn syscalls_cost(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    const N: u64 = 2_000;
    let ns = |out: &str| -> f64 {
        out.split_whitespace()
            .find_map(|t| t.strip_prefix("ns="))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(f64::NAN, |v| v / N as f64)
    };
    let bench = format!("hvbench getppid {N}");
    let bare = ns(&exec(c, &bench));
    let (code, out, err) = vm.cli(&["syscalls", "getppid", "--comm", "hvbench", "--exec", &bench]);
    let ours = ns(&err);
    let lines = out.lines().filter(|l| l.contains("sys_getppid(")).count();
    let guest_out = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > trace && echo 1 > events/syscalls/sys_enter_getppid/enable && \
             echo 1 > events/syscalls/sys_exit_getppid/enable && {bench}; \
             echo 0 > events/syscalls/sys_enter_getppid/enable; echo 0 > events/syscalls/sys_exit_getppid/enable; \
             echo \"events $(grep -c sys_getppid trace)\"; echo > trace"
        ),
    );
    let guest = ns(&guest_out);
    // A filter that admits another task: the probes wait behind a gate,
    // and hvbench's calls run on the quiet view, unhooked.
    let (other_code, other_out, other_err) =
        vm.cli(&["syscalls", "getppid", "--comm", "nobody", "--exec", &bench]);
    let other = ns(&other_err);
    println!(
        "syscall cost with --comm of another task (gated, quiet views): {other:.0} (+{:.0})",
        other - bare
    );
    ck.eq("syscalls (another comm) exit code", other_code, 0);
    ck.check(
        other_out.lines().all(|l| !l.contains("sys_getppid(")),
        format!("no line for a task the filter leaves out: {other_out}"),
    );
    ck.check(
        other < 2.0 * bare,
        format!("a task the filter leaves out runs unhooked: {other:.0} ns a call, bare {bare:.0}"),
    );
    // The same for `--summary`: the count sits behind a gate.
    let (q_code, q_out, q_err) = vm.cli(&[
        "syscalls",
        "getppid",
        "--comm",
        "nobody",
        "--summary",
        "--json",
        "--exec",
        &bench,
    ]);
    let quiet_sum = ns(&q_err);
    println!(
        "syscall cost --summary with --comm of another task: {quiet_sum:.0} (+{:.0}); {q_out}",
        quiet_sum - bare
    );
    ck.eq("syscalls --summary (another comm) exit code", q_code, 0);
    ck.check(
        q_out.contains(r#"{"summary":[]}"#),
        format!("nothing counted for a task the filter leaves out: {q_out}"),
    );
    ck.check(
        quiet_sum < 2.0 * bare,
        format!("the count's task filter leaves hvbench unhooked: {quiet_sum:.0} ns a call, bare {bare:.0}"),
    );
    // The same calls counted and timed in root (`--summary`): no record.
    let (sum_code, sum_out, sum_err) = vm.cli(&[
        "syscalls",
        "getppid",
        "--comm",
        "hvbench",
        "--summary",
        "--json",
        "--exec",
        &bench,
    ]);
    let summed = ns(&sum_err);
    let sum_calls = serde_json::from_str::<Value>(sum_out.trim())
        .ok()
        .and_then(|v| v["summary"][0]["calls"].as_u64());
    println!(
        "syscall cost --summary (counted in root): {summed:.0} (+{:.0}); {sum_out}",
        summed - bare
    );
    ck.eq("syscalls --summary (cost run) exit code", sum_code, 0);
    ck.eq("--summary counted every getppid", sum_calls, Some(N));
    println!(
        "syscall cost (hvbench getppid {N}, guest ns per call): bare {bare:.0}, \
         hvtrace syscalls {ours:.0} (+{:.0}), the guest's syscall tracepoints {guest:.0} (+{:.0}); \
         our lines {lines}; {}",
        ours - bare,
        guest - bare,
        guest_out.lines().last().unwrap_or("")
    );
    ck.eq("syscalls (cost run) exit code", code, 0);
    ck.check(
        lines as u64 >= N,
        format!("every getppid of hvbench printed: {lines} lines"),
    );
}

/// The guest's calls in its trace: `sys_openat(dfd: ffffff9c, filename:
/// 7ffc..., ...)` and `sys_openat -> 0x3`, paired per task (the pointers
/// to strings left out).
fn guest_calls(trace: &str) -> Vec<Call> {
    let mut guest: Vec<Call> = Vec::new();
    let mut open: BTreeMap<i32, (String, Vec<(String, u64)>)> = BTreeMap::new();
    for l in parse_all(trace) {
        let b = l.body.as_str();
        if let Some((call, rest)) = b.strip_prefix("sys_").and_then(|r| r.split_once(" -> ")) {
            let ret =
                u64::from_str_radix(rest.trim().trim_start_matches("0x"), 16).unwrap_or(0) as i64;
            if let Some((name, args)) = open.remove(&l.pid).filter(|(n, _)| n == call) {
                let nums = args
                    .iter()
                    .filter(|(k, _)| !is_string_arg(&name, k))
                    .map(|(_, v)| *v)
                    .collect();
                guest.push((l.pid, name, nums, ret));
            }
        } else if let Some((call, rest)) = b.strip_prefix("sys_").and_then(|r| r.split_once('(')) {
            let args = rest
                .trim_end_matches(')')
                .split(", ")
                .filter_map(|kv| kv.split_once(": "))
                .map(|(k, v)| (k.to_string(), u64::from_str_radix(v, 16).unwrap_or(0)))
                .collect();
            open.insert(l.pid, (call.to_string(), args));
        }
    }
    guest
}

/// Debian (IA32 emulation on): a 32-bit program's calls (`hvcompat`,
/// `int $0x80`), traced through `__ia32_*` wrappers with their arguments
/// read from bx, cx, dx at 32 bits: the i386 numbers, the file name it
/// passed, the bytes `wc` counts, and the fd it opened. `getpid`, whose
/// wrapper is the 64-bit call's too, shows as the 64-bit call and returns
/// the task's own pid. The 64-bit probes of the same names stay silent.
/// The kernel's own syscall events skip 32-bit callers, so the program
/// and the guest's `wc` are the oracle.
pub fn syscalls_compat(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    let len: i64 = exec(c, "wc -c < /etc/hostname")
        .trim()
        .parse()
        .unwrap_or(-1);
    let (code, out, err) = vm.cli(&[
        "syscalls",
        "open,read,write,close,getpid",
        "--comm",
        "hvcompat",
        "--json",
        "--exec",
        "hvcompat",
    ]);
    println!("syscalls (ia32): {out}{err}");
    ck.eq("syscalls (ia32) exit code", code, 0);
    ck.check(
        err.contains("of the calls are IA32 emulation's"),
        "the 32-bit calls were armed",
    );
    let calls: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let shape: Vec<(String, String, u64)> = calls
        .iter()
        .map(|v| {
            (
                v["abi"].as_str().unwrap_or("").to_string(),
                v["syscall"].as_str().unwrap_or("").to_string(),
                v["nr"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    let s = |a: &str, n: &str, nr| (a.to_string(), n.to_string(), nr);
    ck.eq(
        "hvcompat's calls: ABI, name, number (i386's, and getpid's 64-bit)",
        shape,
        vec![
            s("ia32", "open", 5),
            s("ia32", "read", 3),
            s("ia32", "write", 4),
            s("ia32", "close", 6),
            s("x64", "getpid", 39),
        ],
    );
    let arg = |i: usize, k: &str| calls.get(i).map(|v| v["args"][k].clone());
    let ret = |i: usize| calls.get(i).and_then(|v| v["ret"].as_i64());
    let fd = ret(0).unwrap_or(-1);
    ck.eq(
        "open's file name, read from the 32-bit caller",
        arg(0, "filename"),
        Some(Value::from("/etc/hostname")),
    );
    ck.check(fd >= 3, format!("open returned an fd: {fd}"));
    ck.eq(
        "read: (fd, count) = (the fd, 64), returning the file's bytes",
        (arg(1, "fd"), arg(1, "count"), ret(1)),
        (Some(Value::from(fd)), Some(Value::from(64)), Some(len)),
    );
    ck.eq(
        "write: fd 1 and the bytes read",
        (arg(2, "fd"), arg(2, "count"), ret(2)),
        (Some(Value::from(1)), Some(Value::from(len)), Some(len)),
    );
    ck.eq(
        "close of the fd returned 0",
        (arg(3, "fd"), ret(3)),
        (Some(Value::from(fd)), Some(0)),
    );
    ck.eq(
        "getpid returned the task's pid",
        ret(4),
        calls.get(4).and_then(|v| v["pid"].as_i64()),
    );
    ck.check(len > 0, format!("wc counted the hostname: {len}"));
}
