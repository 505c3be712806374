//! trace.dat for trace-cmd, checked by Debian's `trace-cmd` (fast lane,
//! two vCPUs, one boot):
//!
//! - `record_matches_our_json_lines`: `hvtrace record` with a probe that
//!   fetches a string, the function tracer on `vfs_*` and a graph session
//!   on `vfs_read` and the scheduler's switches (record's default), over
//!   `dd` on each CPU, ended by SIGINT. The file is
//!   whole; `trace-cmd report -R` lists the same events as our own JSON
//!   lines of the same recording (`--also-json`): the same count, the same
//!   functions, arguments and strings, the same order per task, graph
//!   exits whose `rettime - calltime` is our duration; the default report
//!   draws our call tree (leaves merged where the next event on the CPU is
//!   their return), with our durations to the nanosecond it prints. The
//!   probe's `__probe_ip` is the guest's own `/proc/kallsyms` address of
//!   the function.
//! - `report --cpu 1` shows CPU 1's events only, among them the `dd` run
//!   on CPU 1; `trace-cmd convert` to version 7 succeeds and reports the
//!   same lines.
//! - `sched_switch_oracle_and_cost`: with our `sched_switch` and
//!   `sched_wakeup` events and the guest's own on at once, a pipe
//!   ping-pong pinned to CPU 0 (`hvbench switch`) gives the same switches
//!   in both, in the same order, with the same pids, comms and states, and
//!   the same wakeups of each task by the other; then the cost per switch
//!   of our switches and of the guest's, each alone, against the bare
//!   ping-pong, and the VM exits ours take per switch.
//! - `syscalls_to_trace_dat`: `hvtrace syscalls --trace-dat` writes the
//!   calls' entry and return events, which trace-cmd reports with the
//!   file name read and the descriptor returned, as our line shows them.
//! - `record_outlives_its_vm`: a recording whose VM is stopped under it
//!   leaves a whole file with the events so far, and says so.
//!
//! Run: `cargo test -p hvtrace-tests --test tracedat -- --nocapture`

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hvtrace_tests::{
    guest_exec, hv_call, hv_status, hvtrace_bin, vm_lock, Checks, Detached, DD_READ_GRAPH, TRACEFS,
};
use serde_json::Value;

const PROBE: &str = "p:myopen do_sys_openat2 dfd=%di:s32 filename=+0(%si):string";

/// `trace-cmd ARGS`: (success, stdout, stderr).
fn trace_cmd(args: &[&str]) -> (bool, String, String) {
    let out = Command::new("trace-cmd")
        .args(args)
        .output()
        .expect("trace-cmd is installed by scripts/setup.sh");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One line of `trace-cmd report`: pid, CPU, time (µs), event, the rest.
#[derive(Debug, Clone)]
struct Reported {
    pid: i64,
    cpu: u64,
    us: u64,
    event: String,
    rest: String,
}

fn parse_report(text: &str) -> Vec<Reported> {
    let mut out = Vec::new();
    for line in text.lines() {
        // `          dd-55    [000]    14.785078: funcgraph_entry: ...`
        let Some((head, tail)) = line.split_once("]") else {
            continue;
        };
        let Some((task, cpu)) = head.rsplit_once('[') else {
            continue;
        };
        let Some(pid) = task
            .trim()
            .rsplit_once('-')
            .and_then(|(_, p)| p.parse().ok())
        else {
            continue;
        };
        let Some((ts, rest)) = tail.trim_start().split_once(": ") else {
            continue;
        };
        let Some((secs, usecs)) = ts.trim().split_once('.') else {
            continue;
        };
        let (Ok(secs), Ok(usecs)) = (secs.parse::<u64>(), usecs.parse::<u64>()) else {
            continue;
        };
        let (event, rest) = rest.split_once(':').unwrap_or((rest, ""));
        out.push(Reported {
            pid,
            cpu: cpu.trim().parse().unwrap_or(u64::MAX),
            us: secs * 1_000_000 + usecs,
            event: event.trim().to_string(),
            rest: rest.trim().to_string(),
        });
    }
    out
}

/// `key=value` pairs of a raw report line (values without spaces).
fn raw_fields(rest: &str) -> BTreeMap<String, String> {
    rest.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A symbol without its `+0xOFF/0xSIZE`.
fn bare(sym: &str) -> &str {
    sym.split('+').next().unwrap_or(sym)
}

/// What `trace-cmd report -R` should print for a JSON line: (event,
/// fields that must match).
fn expected_raw(v: &Value) -> Option<(String, Vec<(String, String)>)> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let kind = s("kind");
    let hex = |k: &str| {
        let t = s(k);
        format!(
            "{:x}",
            u64::from_str_radix(t.trim_start_matches("0x"), 16).unwrap_or(u64::MAX)
        )
    };
    Some(match kind.as_str() {
        "function" => (
            "function".into(),
            vec![
                ("ip".into(), s("func")),
                ("parent_ip".into(), bare(&s("parent")).to_string()),
            ],
        ),
        "kprobe" => {
            let args = v.get("args")?;
            (
                s("event"),
                vec![
                    ("__probe_ip".into(), hex("ip")),
                    ("dfd".into(), args.get("dfd")?.to_string()),
                    (
                        "filename".into(),
                        args.get("filename")?.as_str()?.to_string(),
                    ),
                ],
            )
        }
        "sched_switch" => {
            let state = match s("prev_state").as_str() {
                "R" => 0,
                "S" => 1,
                "D" => 2,
                "T" => 4,
                "t" => 8,
                "X" => 16,
                "Z" => 32,
                "P" => 64,
                "I" => 128,
                _ => return None,
            };
            let n = |k: &str| v.get(k).map(Value::to_string).unwrap_or_default();
            (
                "sched_switch".into(),
                vec![
                    ("prev_comm".into(), s("prev_comm")),
                    ("prev_pid".into(), n("prev_pid")),
                    ("prev_prio".into(), n("prev_prio")),
                    ("prev_state".into(), state.to_string()),
                    ("next_comm".into(), s("next_comm")),
                    ("next_pid".into(), n("next_pid")),
                    ("next_prio".into(), n("next_prio")),
                ],
            )
        }
        "sched_wakeup" => {
            let n = |k: &str| v.get(k).map(Value::to_string).unwrap_or_default();
            (
                "sched_wakeup".into(),
                vec![
                    ("comm".into(), s("target_comm")),
                    ("pid".into(), n("target_pid")),
                    ("prio".into(), n("target_prio")),
                    // Printed as the kernel's format says: %03d.
                    (
                        "target_cpu".into(),
                        format!("{:03}", v["target_cpu"].as_i64().unwrap_or(-1)),
                    ),
                ],
            )
        }
        "graph_entry" => (
            "funcgraph_entry".into(),
            vec![
                ("func".into(), s("func")),
                ("depth".into(), v.get("depth")?.to_string()),
            ],
        ),
        "graph_return" => (
            "funcgraph_exit".into(),
            vec![
                ("func".into(), s("func")),
                ("depth".into(), v.get("depth")?.to_string()),
                ("retval".into(), hex("retval")),
            ],
        ),
        _ => return None,
    })
}

/// One line of the default report's graph drawing.
#[derive(Debug, Clone, PartialEq)]
enum Drawn {
    Leaf(String, u64, u64),
    Open(String, u64),
    Close(u64, u64),
}

/// The drawing trace-cmd makes of our graph events: an entry whose next
/// event (in the report's order: by time, over every CPU) is its own
/// return is a leaf. Durations in ns.
fn expected_drawing(all: &[Value], pid: i64) -> Vec<(u64, Drawn)> {
    let mut out = Vec::new();
    {
        let events = all;
        let mut i = 0;
        while i < events.len() {
            let v = &events[i];
            let kind = v["kind"].as_str().unwrap_or("");
            let this_pid = v["pid"].as_i64().unwrap_or(-1);
            let ts = v["ts_ns"].as_u64().unwrap_or(0);
            let func = v["func"].as_str().unwrap_or("").to_string();
            let depth = v["depth"].as_u64().unwrap_or(0);
            if this_pid == pid && kind == "graph_entry" {
                let next = events.get(i + 1);
                let leaf = next.filter(|n| {
                    n["kind"] == "graph_return"
                        && n["pid"].as_i64() == Some(pid)
                        && n["func"].as_str() == Some(&func)
                });
                if let Some(n) = leaf {
                    out.push((
                        ts,
                        Drawn::Leaf(func, depth, n["duration_ns"].as_u64().unwrap_or(0)),
                    ));
                    i += 2;
                    continue;
                }
                out.push((ts, Drawn::Open(func, depth)));
            } else if this_pid == pid && kind == "graph_return" {
                out.push((
                    ts,
                    Drawn::Close(depth, v["duration_ns"].as_u64().unwrap_or(0)),
                ));
            }
            i += 1;
        }
    }
    out.sort_by_key(|(ts, _)| *ts);
    out
}

/// The default report's graph lines of `pid`: `+ 95.703 us  |    name();`.
fn drawing(report: &[Reported], pid: i64) -> Vec<Drawn> {
    let mut out = Vec::new();
    for r in report
        .iter()
        .filter(|r| r.pid == pid && r.event.starts_with("funcgraph_"))
    {
        let Some((left, right)) = r.rest.split_once('|') else {
            continue;
        };
        // Two spaces, then two per level.
        let indent = right.len() - right.trim_start().len();
        let depth = (indent.saturating_sub(2) / 2) as u64;
        let body = right.trim();
        let dur_ns = left
            .split_whitespace()
            .find_map(|w| w.parse::<f64>().ok())
            .map(|us| (us * 1000.0).round() as u64);
        if body == "}" {
            out.push(Drawn::Close(depth, dur_ns.unwrap_or(0)));
        } else if let Some(name) = body.strip_suffix("() {") {
            out.push(Drawn::Open(name.to_string(), depth));
        } else if let Some(name) = body.strip_suffix("();") {
            out.push(Drawn::Leaf(name.to_string(), depth, dur_ns.unwrap_or(0)));
        }
    }
    out
}

/// Waits until `path` holds `needle` (a child's stderr), up to `limit`.
fn wait_for(path: &Path, needle: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    false
}

#[test]
fn trace_dat_fast_lane() {
    let _vm = vm_lock();
    let vm = Detached::start_with("fast", "tracedat", &["--cpus", "2"]);
    let dir = std::env::temp_dir().join(format!("hvtrace-tracedat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checks = Checks::new();
    record_matches_our_json_lines(&vm, &dir, &mut checks);
    sched_switch_oracle_and_cost(&vm, &mut checks);
    syscalls_to_trace_dat(&vm, &dir, &mut checks);
    record_outlives_its_vm(&vm, &dir, &mut checks);
    let _ = std::fs::remove_dir_all(&dir);
    checks.finish();
}

fn record_matches_our_json_lines(vm: &Detached, dir: &Path, checks: &mut Checks) {
    let dat = dir.join("a.dat");
    let jsonl = dir.join("a.jsonl");
    let err = dir.join("record.err");
    let mut child = Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(&vm.socket)
        .args(["record", "-o"])
        .arg(&dat)
        .arg("--also-json")
        .arg(&jsonl)
        .args(["--probe", PROBE, "--function", "vfs_*"])
        .args(DD_READ_GRAPH)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let armed = wait_for(&err, "recording to", Duration::from_secs(300));
    checks.check(armed, "record said it records");
    let (status, _, _) = vm.cli(&[
        "exec",
        "taskset 1 dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null; \
         taskset 2 dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null",
    ]);
    checks.eq("workload status", status, 0);
    let (_, kallsyms, _) = vm.cli(&["exec", "grep -w -e do_sys_openat2 /proc/kallsyms"]);
    std::thread::sleep(Duration::from_secs(3));
    // SIGINT, as Ctrl-C sends it.
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    println!("{stderr}");
    checks.eq("record's exit after SIGINT", status.code(), Some(130));
    checks.check(
        stderr.contains("trace.dat: ") && dat.exists(),
        "the file is written after SIGINT",
    );
    let no_parts = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .all(|e| !e.file_name().to_string_lossy().contains(".part-"));
    checks.check(no_parts, "no part file is left");

    let lines: Vec<Value> = std::fs::read_to_string(&jsonl)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let dat_path = dat.to_string_lossy().into_owned();
    let (ok, raw, raw_err) = trace_cmd(&["report", "-R", &dat_path]);
    checks.check(ok, format!("trace-cmd report -R: {raw_err}"));
    let raw = parse_report(&raw);
    let ours: Vec<&Value> = lines.iter().filter(|v| expected_raw(v).is_some()).collect();
    checks.check(ours.len() > 20, format!("{} events recorded", ours.len()));
    checks.eq("events: trace-cmd's and ours", raw.len(), ours.len());
    // Per task, in order: the same events with the same fields.
    let mut by_pid_ours: BTreeMap<i64, Vec<&Value>> = BTreeMap::new();
    for v in &ours {
        by_pid_ours
            .entry(v["pid"].as_i64().unwrap_or(-1))
            .or_default()
            .push(v);
    }
    let mut by_pid_raw: BTreeMap<i64, Vec<&Reported>> = BTreeMap::new();
    for r in &raw {
        by_pid_raw.entry(r.pid).or_default().push(r);
    }
    checks.eq(
        "tasks",
        by_pid_raw.keys().collect::<Vec<_>>(),
        by_pid_ours.keys().collect::<Vec<_>>(),
    );
    let mut mismatches = Vec::new();
    let mut graph_exits = 0;
    for (pid, ours) in &by_pid_ours {
        let theirs = by_pid_raw.get(pid).cloned().unwrap_or_default();
        for (i, v) in ours.iter().enumerate() {
            let Some(r) = theirs.get(i) else {
                mismatches.push(format!("pid {pid}: event {i} missing from the report"));
                break;
            };
            let (event, want) = expected_raw(v).unwrap();
            let got = raw_fields(&r.rest);
            let mut bad = event != r.event || r.cpu != v["cpu"].as_u64().unwrap_or(0);
            for (k, w) in &want {
                bad |= got.get(k) != Some(w);
            }
            // Times: the report prints microseconds, truncated.
            let us = v["ts_ns"].as_u64().unwrap_or(0) / 1000;
            bad |= r.us.abs_diff(us) > 1;
            if r.event == "funcgraph_exit" {
                graph_exits += 1;
                let t = |k: &str| {
                    got.get(k)
                        .and_then(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16).ok())
                        .unwrap_or(0)
                };
                bad |= t("rettime").wrapping_sub(t("calltime"))
                    != v["duration_ns"].as_u64().unwrap_or(1);
                bad |= t("rettime") != v["ts_ns"].as_u64().unwrap_or(0);
            }
            if bad {
                mismatches.push(format!("pid {pid} #{i}: ours {v} / trace-cmd {r:?}"));
            }
        }
    }
    checks.check(
        mismatches.is_empty(),
        format!("trace-cmd -R equals our lines: {mismatches:#?}"),
    );
    checks.check(graph_exits >= 10, format!("{graph_exits} graph exits"));
    let dds: Vec<i64> = lines
        .iter()
        .filter(|v| v["comm"] == "dd" && v["kind"] == "graph_entry" && v["func"] == "vfs_read")
        .filter_map(|v| v["pid"].as_i64())
        .collect();
    checks.check(dds.len() == 2, format!("two dd trees: {dds:?}"));
    let strings: Vec<&str> = lines
        .iter()
        .filter(|v| v["kind"] == "kprobe" && v["comm"] == "dd")
        .filter_map(|v| v["args"]["filename"].as_str())
        .collect();
    checks.check(
        strings.iter().filter(|s| **s == "/etc/hostname").count() == 2,
        format!("dd's opens: {strings:?}"),
    );
    // The probe's address is the guest's own address of the function.
    let guest_addr = kallsyms
        .lines()
        .find(|l| l.ends_with(" do_sys_openat2"))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_string);
    let probe_ips: Vec<String> = raw
        .iter()
        .filter(|r| r.event == "myopen")
        .filter_map(|r| raw_fields(&r.rest).get("__probe_ip").cloned())
        .collect();
    checks.check(
        guest_addr.is_some() && probe_ips.iter().all(|ip| Some(ip) == guest_addr.as_ref()),
        format!("__probe_ip {probe_ips:?} = guest's do_sys_openat2 {guest_addr:?}"),
    );

    // The default report draws our tree.
    let (ok, text, _) = trace_cmd(&["report", &dat_path]);
    checks.check(ok, "trace-cmd report");
    let report = parse_report(&text);
    // The file's order: each CPU's events by time (stably), merged by time.
    let mut ordered: Vec<Value> = lines.clone();
    ordered.sort_by_key(|v| {
        (
            v["ts_ns"].as_u64().unwrap_or(0),
            v["cpu"].as_u64().unwrap_or(0),
        )
    });
    for pid in &dds {
        let want: Vec<Drawn> = expected_drawing(&ordered, *pid)
            .into_iter()
            .map(|(_, d)| d)
            .collect();
        let got = drawing(&report, *pid);
        let leaves = want.iter().filter(|d| matches!(d, Drawn::Leaf(..))).count();
        checks.check(
            leaves >= 2 && want.len() >= 6,
            format!("dd {pid}'s tree: {want:?}"),
        );
        checks.eq(&format!("dd {pid}'s tree as trace-cmd draws it"), got, want);
    }

    // One CPU's events.
    let (ok, cpu1, _) = trace_cmd(&["report", "--cpu", "1", &dat_path]);
    let cpu1 = parse_report(&cpu1);
    checks.check(
        ok && !cpu1.is_empty() && cpu1.iter().all(|r| r.cpu == 1),
        format!("report --cpu 1 shows CPU 1 alone ({} lines)", cpu1.len()),
    );
    checks.check(
        dds.iter().any(|p| cpu1.iter().any(|r| r.pid == *p)),
        "the dd on CPU 1 is in --cpu 1",
    );
    // Version 7.
    let v7 = dir.join("a7.dat").to_string_lossy().into_owned();
    let (ok, _, err) = trace_cmd(&["convert", "-i", &dat_path, "-o", &v7]);
    checks.check(ok, format!("trace-cmd convert to v7: {err}"));
    let (ok, text7, _) = trace_cmd(&["report", &v7]);
    checks.check(ok && text7 == text, "the v7 file reports the same lines");
}

fn record_outlives_its_vm(vm: &Detached, dir: &Path, checks: &mut Checks) {
    let dat = dir.join("b.dat");
    let err = dir.join("record-b.err");
    let mut child = Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(&vm.socket)
        .args(["record", "-o"])
        .arg(&dat)
        .args(["--function", "vfs_read"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    checks.check(
        wait_for(&err, "recording to", Duration::from_secs(120)),
        "the second recording started",
    );
    let (status, _, _) = vm.cli(&[
        "exec",
        "dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null",
    ]);
    checks.eq("workload status", status, 0);
    let (status, _, _) = vm.cli(&["stop"]);
    checks.eq("stop", status, 0);
    let status = child.wait().unwrap();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    println!("{stderr}");
    checks.eq("record's exit when the VM ends", status.code(), Some(0));
    checks.check(
        stderr.contains("during the recording; the file holds the events recorded until then"),
        "the note says the VM ended",
    );
    let (ok, text, err) = trace_cmd(&["report", &dat.to_string_lossy()]);
    let report = parse_report(&text);
    checks.check(
        ok && report
            .iter()
            .any(|r| r.event == "function" && r.rest.contains("vfs_read")),
        format!("the file holds the events: {err}"),
    );
}

/// `ns_per_switch=X` of `hvbench switch`.
fn ns_per_switch(out: &str) -> Option<u64> {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix("ns_per_switch="))
        .and_then(|v| v.parse().ok())
}

/// One switch: (prev pid, prev comm, prev state, next pid, next comm).
type Switch = (i64, String, String, i64, String);

/// The guest's own sched_switch lines, as tracefs prints them.
fn guest_switches(trace: &str) -> Vec<Switch> {
    trace
        .lines()
        .filter_map(|l| {
            let rest = l.split_once("sched_switch: ")?.1;
            let f: BTreeMap<&str, &str> = rest
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .collect();
            Some((
                f.get("prev_pid")?.parse().ok()?,
                f.get("prev_comm")?.to_string(),
                f.get("prev_state")?.trim_end_matches('+').to_string(),
                f.get("next_pid")?.parse().ok()?,
                f.get("next_comm")?.to_string(),
            ))
        })
        .collect()
}

/// One wakeup: (waker pid, woken pid, woken comm, target CPU).
type Wakeup = (i64, i64, String, i64);

/// The guest's own sched_wakeup lines, as tracefs prints them:
/// `hvbench-63 [000] d..3. 12.345678: sched_wakeup: comm=hvbench pid=64 ...`.
fn guest_wakeups(trace: &str) -> Vec<Wakeup> {
    trace
        .lines()
        .filter_map(|l| {
            let (head, rest) = l.split_once("sched_wakeup: ")?;
            let task = head.trim_start().split(" [").next()?;
            let waker = task.rsplit_once('-')?.1.trim().parse().ok()?;
            let f: BTreeMap<&str, &str> = rest
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .collect();
            Some((
                waker,
                f.get("pid")?.parse().ok()?,
                f.get("comm")?.to_string(),
                f.get("target_cpu")?.parse().ok()?,
            ))
        })
        .collect()
}

/// Checks that `ours` equals `theirs`, element by element; a failure
/// shows both lengths and the elements around the first difference.
fn same_sequence<T: PartialEq + std::fmt::Debug>(
    checks: &mut Checks,
    what: &str,
    ours: &[T],
    theirs: &[T],
) {
    let first = ours
        .iter()
        .zip(theirs)
        .position(|(a, b)| a != b)
        .or((ours.len() != theirs.len()).then_some(ours.len().min(theirs.len())));
    let around =
        |list: &[T], i: usize| format!("{:?}", &list[i.saturating_sub(2)..(i + 3).min(list.len())]);
    checks.check(
        first.is_none(),
        format!(
            "{what}: ours ({}) = the guest's ({}); first difference at {first:?}: ours {}, the guest's {}",
            ours.len(),
            theirs.len(),
            first.map_or(String::new(), |i| around(ours, i)),
            first.map_or(String::new(), |i| around(theirs, i)),
        ),
    );
}

/// The VMCALL exits of every vCPU so far.
fn vmcalls(c: &mut hvtrace::client::Client) -> u64 {
    hv_status(c).per_vcpu.iter().map(|v| v.vmcalls).sum()
}

fn sched_switch_oracle_and_cost(vm: &Detached, checks: &mut Checks) {
    let mut c = vm.client();
    let json = protocol::TraceFormat::Json;
    // The stream's end, and the stream on in JSON.
    let cursor = match hv_call(
        &mut c,
        protocol::Request::TraceRead {
            cursor: u64::MAX,
            format: json,
            wait_ms: 0,
            source: Some(0),
        },
    ) {
        protocol::Response::Trace { next, .. } => next,
        other => panic!("{other:?}"),
    };
    // Both tracers at once over a short ping-pong on CPU 0.
    let sched = |on: bool| protocol::Request::Sched {
        switch: on,
        wakeup: on,
    };
    let on = hv_call(&mut c, sched(true));
    checks.eq("sched on", on, protocol::Response::Ok);
    let out = guest_exec(
        &mut c,
        &format!(
            "cd {TRACEFS} && echo > trace && echo 1 > events/sched/sched_switch/enable && \
             echo 1 > events/sched/sched_wakeup/enable && \
             taskset 1 hvbench switch 200; echo 0 > events/sched/sched_switch/enable; \
             echo 0 > events/sched/sched_wakeup/enable"
        ),
    );
    let off = hv_call(&mut c, sched(false));
    checks.eq("sched off", off, protocol::Response::Ok);
    checks.check(
        ns_per_switch(&out).is_some(),
        format!("ping-pong ran: {out}"),
    );
    let guest_trace = guest_exec(&mut c, &format!("cat {TRACEFS}/trace"));
    let theirs = guest_switches(&guest_trace);
    let their_wakeups = guest_wakeups(&guest_trace);
    let mut stream = hvtrace_tests::Stream::of(0, json, cursor);
    let lines = stream.read(&mut c);
    let our_wakeups: Vec<Wakeup> = lines
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "sched_wakeup")
        .map(|v| {
            (
                v["pid"].as_i64().unwrap_or(-1),
                v["target_pid"].as_i64().unwrap_or(-1),
                v["target_comm"].as_str().unwrap_or("").to_string(),
                v["target_cpu"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    let ours: Vec<Switch> = lines
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "sched_switch")
        .map(|v| {
            (
                v["prev_pid"].as_i64().unwrap_or(-1),
                v["prev_comm"].as_str().unwrap_or("").to_string(),
                v["prev_state"].as_str().unwrap_or("").to_string(),
                v["next_pid"].as_i64().unwrap_or(-1),
                v["next_comm"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    // The switches between the two hvbench processes, as each tracer saw
    // them.
    let between = |list: &[Switch]| -> Vec<Switch> {
        list.iter()
            .filter(|s| s.1 == "hvbench" && s.4 == "hvbench")
            .cloned()
            .collect()
    };
    let (ours_hv, theirs_hv) = (between(&ours), between(&theirs));
    println!(
        "sched_switch: ours {} ({} between the ping-pong's tasks), the guest's {} ({})",
        ours.len(),
        ours_hv.len(),
        theirs.len(),
        theirs_hv.len()
    );
    checks.check(
        theirs_hv.len() >= 300,
        format!("the guest saw the ping-pong: {} switches", theirs_hv.len()),
    );
    same_sequence(checks, "the ping-pong's switches", &ours_hv, &theirs_hv);
    checks.eq("no loss", stream.lost, 0);
    // The wakeups of one ping-pong task by the other.
    let pingpong: Vec<i64> = ours_hv.iter().flat_map(|s| [s.0, s.3]).collect();
    let of_pingpong = |list: &[Wakeup]| -> Vec<Wakeup> {
        list.iter()
            .filter(|w| pingpong.contains(&w.0) && pingpong.contains(&w.1))
            .cloned()
            .collect()
    };
    let (ours_w, theirs_w) = (of_pingpong(&our_wakeups), of_pingpong(&their_wakeups));
    println!(
        "sched_wakeup: ours {} ({} within the ping-pong), the guest's {} ({})",
        our_wakeups.len(),
        ours_w.len(),
        their_wakeups.len(),
        theirs_w.len()
    );
    checks.check(
        theirs_w.len() >= 100,
        format!("the guest saw the ping-pong's wakeups: {}", theirs_w.len()),
    );
    same_sequence(checks, "the ping-pong's wakeups", &ours_w, &theirs_w);

    // The cost per switch: bare, ours alone, the guest's alone.
    const N: u32 = 2000;
    let run = |c: &mut hvtrace::client::Client, prefix: &str| {
        let out = guest_exec(c, &format!("{prefix}taskset 1 hvbench switch {N}"));
        ns_per_switch(&out).unwrap_or(0)
    };
    let bare = run(&mut c, "");
    hv_call(
        &mut c,
        protocol::Request::Sched {
            switch: true,
            wakeup: false,
        },
    );
    let before = vmcalls(&mut c);
    let with_ours = run(&mut c, "");
    let exits = vmcalls(&mut c) - before;
    hv_call(&mut c, sched(false));
    let _ = stream.read(&mut c);
    let with_guests = run(
        &mut c,
        &format!("cd {TRACEFS} && echo 1 > events/sched/sched_switch/enable && "),
    );
    guest_exec(
        &mut c,
        &format!("echo 0 > {TRACEFS}/events/sched/sched_switch/enable && echo > {TRACEFS}/trace"),
    );
    let switches = 2 * u64::from(N);
    println!(
        "sched_switch cost per switch: bare {bare} ns; ours {with_ours} ns (+{}), {:.2} exits per switch; the guest's {with_guests} ns (+{})",
        with_ours.saturating_sub(bare),
        exits as f64 / switches as f64,
        with_guests.saturating_sub(bare)
    );
    checks.check(bare > 0 && with_ours > bare, "our events cost something");
    // One exit per switch, and a few for the commands around it.
    checks.check(
        exits >= switches && exits < switches + switches / 10,
        format!("{exits} exits for {switches} switches"),
    );
}

fn syscalls_to_trace_dat(vm: &Detached, dir: &Path, checks: &mut Checks) {
    let dat = dir.join("sys.dat");
    let dat_path = dat.to_string_lossy().into_owned();
    let (status, stdout, stderr) = vm.cli(&[
        "syscalls",
        "openat",
        "--comm",
        "cat",
        "--trace-dat",
        &dat_path,
        "--exec",
        "cat /etc/hostname",
    ]);
    println!("{stderr}{stdout}");
    checks.eq("syscalls --trace-dat", status, 0);
    // Our own line: cat-N [C] T: sys_openat(dfd: AT_FDCWD, filename: "/etc/hostname", ...) = FD
    let ours = stdout
        .lines()
        .find(|l| l.contains("sys_openat(") && l.contains("\"/etc/hostname\""));
    let fd = ours
        .and_then(|l| l.rsplit_once(" = "))
        .and_then(|(_, r)| r.trim().parse::<i64>().ok());
    checks.check(fd.is_some_and(|f| f >= 3), format!("our line: {ours:?}"));
    let (ok, raw, err) = trace_cmd(&["report", "-R", &dat_path]);
    checks.check(ok, format!("trace-cmd report: {err}"));
    let report = parse_report(&raw);
    let entry = report.iter().find(|r| {
        r.event == "sys_openat"
            && raw_fields(&r.rest).get("filename").map(String::as_str) == Some("/etc/hostname")
    });
    let ret = entry.and_then(|e| {
        report
            .iter()
            .find(|r| r.event == "sys_openat_ret" && r.pid == e.pid && r.us >= e.us)
    });
    let got = ret.and_then(|r| {
        raw_fields(&r.rest)
            .get("ret")
            .and_then(|v| v.parse::<i64>().ok())
    });
    checks.check(
        entry.is_some() && got == fd,
        format!("trace-cmd's sys_openat of /etc/hostname returned {got:?}, ours {fd:?}"),
    );
}
