//! The one-shot traced run, end to end, as a user types it (fast lane, one
//! boot): `hvtrace run --graph vfs_read ... --probe 'r:...' --sched --exec
//! CMD --format chrome --output FILE`. The file must be a Chrome trace that
//! parses, whose B/E events nest per task, with `dd`'s vfs_read tree in it;
//! the return probe rides on the same frames and its hits are instants on
//! dd's thread; the task switches draw a CPU track; and the document passes
//! scripts/check-chrome-trace.py (jsonschema and the nesting rules).
//!
//! Run: `cargo test -p hvtrace-tests --test oneshot -- --nocapture`

use std::process::Command;

use hvtrace_tests::{hvtrace_bin, hypervisor_image, vm_lock, Checks, DD_READ_GRAPH};

/// Runs `hvtrace run ARGS --hypervisor IMAGE` and returns (status,
/// stdout, stderr).
fn hvtrace_run(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let output = Command::new(hvtrace_bin())
        .arg("run")
        .args(args)
        .arg("--hypervisor")
        .arg(hypervisor_image())
        .output()
        .expect("running hvtrace run");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs scripts/check-chrome-trace.py (jsonschema and the nesting rules)
/// on `file`: whether it passed, and its line.
fn check_chrome_trace(file: &std::path::Path) -> (bool, String) {
    let checked = Command::new("/usr/bin/python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/check-chrome-trace.py"
        ))
        .arg(file)
        .output()
        .expect("/usr/bin/python3");
    (
        checked.status.success(),
        String::from_utf8_lossy(&checked.stdout).into_owned(),
    )
}

#[test]
fn one_shot_graph_to_chrome() {
    let _vm = vm_lock();
    let dir = std::env::temp_dir().join(format!("hvtrace-oneshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let out_file = dir.join("graph.json");
    let out_path = out_file.to_string_lossy().into_owned();
    let args: Vec<&str> = ["--guest", "fast"]
        .iter()
        .chain(DD_READ_GRAPH)
        .copied()
        .chain([
            "--probe",
            "r:readret vfs_read ret=$retval:x64",
            "--sched",
            "--exec",
            "dd if=/etc/hostname of=/dev/null bs=64 count=1",
            "--exec",
            "dd if=/etc/hostname of=/dev/null bs=64 count=1",
            "--format",
            "chrome",
            "--output",
            &out_path,
        ])
        .collect();
    let (status, _, stderr) = hvtrace_run(&args);
    println!("hvtrace run: {status}\n{stderr}");
    let mut ck = Checks::new();
    ck.check(
        status.success(),
        format!("hvtrace run succeeded: {}", status),
    );
    ck.check(
        stderr.contains("function graph session 1:"),
        "the run reports its graph session",
    );
    let text = std::fs::read_to_string(&out_file).unwrap_or_default();
    let doc: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            ck.check(false, format!("the Chrome trace parses: {e}"));
            ck.finish();
            return;
        }
    };
    let events = doc["traceEvents"].as_array().cloned().unwrap_or_default();
    let mut open: std::collections::HashMap<i64, Vec<String>> = Default::default();
    let mut bad = Vec::new();
    let mut roots = 0;
    let mut names = std::collections::BTreeSet::new();
    for ev in &events {
        let tid = ev["tid"].as_i64().unwrap_or(-1);
        let name = ev["name"].as_str().unwrap_or("").to_string();
        match ev["ph"].as_str() {
            Some("B") => {
                let stack = open.entry(tid).or_default();
                if stack.is_empty() && name == "vfs_read" {
                    roots += 1;
                }
                names.insert(name.clone());
                stack.push(name);
            }
            Some("E") => match open.entry(tid).or_default().pop() {
                Some(top) if name.is_empty() || top == name => {}
                other => bad.push(format!("E {name} on tid {tid} closes {other:?}")),
            },
            _ => {}
        }
    }
    println!(
        "chrome trace: {} events, {roots} vfs_read roots, functions {names:?}",
        events.len()
    );
    ck.eq("dd's two vfs_read trees", roots, 2);
    ck.check(
        names.contains("shmem_file_read_iter"),
        "the trees reach into shmem_file_read_iter",
    );
    ck.check(bad.is_empty(), format!("B/E nest per task: {bad:?}"));
    ck.check(open.values().all(Vec::is_empty), "no call left open");
    // Every event is kept: the return probe's hits as instants on dd's
    // threads, the switches as CPU tracks that show dd running.
    let dd_tids: std::collections::BTreeSet<i64> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "dd")
        .filter_map(|e| e["tid"].as_i64())
        .collect();
    let readrets = events
        .iter()
        .filter(|e| e["ph"] == "i" && e["name"] == "readret" && e["cat"] == "kretprobe")
        .filter(|e| dd_tids.contains(&e["tid"].as_i64().unwrap_or(-1)))
        .count();
    ck.check(
        readrets >= 2,
        format!("dd's vfs_read returns as instants: {readrets}"),
    );
    let cpus_pid = events
        .iter()
        .find(|e| e["ph"] == "M" && e["name"] == "process_name" && e["args"]["name"] == "CPUs")
        .and_then(|e| e["pid"].as_i64());
    // Each dd task ran on a CPU: a slice carries its pid (named after its
    // comm when it came in, which is still the shell's before the exec).
    let dd_ran: std::collections::BTreeSet<i64> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"].as_i64() == cpus_pid)
        .filter_map(|e| e["args"]["pid"].as_i64())
        .filter(|pid| dd_tids.contains(pid))
        .collect();
    ck.check(
        cpus_pid.is_some() && dd_ran.len() == 2,
        format!("the CPU track shows both dd tasks running: {dd_ran:?}"),
    );
    // A checker that is not ours: the schema of the format's phases, and
    // the nesting and overlap rules.
    let (passed, verdict) = check_chrome_trace(&out_file);
    println!("{verdict}");
    ck.check(
        passed,
        format!("the trace passes the schema and the nesting rules: {verdict}"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    ck.finish();
}

/// `hvtrace run --hist SPEC --hist-key comm --count-comm dd --exec ...
/// --format json` as a user types it: one boot, the histogram kept in VMX
/// root while the commands run, printed once. dd reads its input in
/// blocks of its `bs`: 10 reads of 512 bytes, 5 of 4096 and 3 of 65536 go
/// to log2 buckets 10, 13 and 17, and nothing else is dd's.
#[test]
fn one_shot_hist() {
    let _vm = vm_lock();
    let (status, stdout, stderr) = hvtrace_run(&[
        "--guest",
        "fast",
        "--hist",
        "p vfs_read count=%dx:u64",
        "--hist-key",
        "comm",
        "--count-comm",
        "dd",
        "--exec",
        "dd if=/dev/zero of=/dev/null bs=512 count=10",
        "--exec",
        "dd if=/dev/zero of=/dev/null bs=4096 count=5",
        "--exec",
        "dd if=/dev/zero of=/dev/null bs=65536 count=3",
        "--format",
        "json",
    ]);
    println!("hvtrace run --hist: {status}\n{stderr}\n{stdout}");
    let mut ck = Checks::new();
    ck.check(
        status.success(),
        format!("hvtrace run --hist succeeded: {}", status),
    );
    ck.check(
        stderr.contains("hvtrace: histogram: counting 1 functions"),
        "the histogram's start line on stderr",
    );
    let json = stdout
        .lines()
        .find(|l| l.starts_with("{\"rows\""))
        .unwrap_or("");
    match serde_json::from_str::<serde_json::Value>(json) {
        Err(e) => ck.check(
            false,
            format!("no histogram JSON on stdout ({e}): {stdout:?}"),
        ),
        Ok(v) => {
            let rows = v["rows"].as_array().cloned().unwrap_or_default();
            ck.eq("rows", rows.len(), 1);
            let key = rows.first().and_then(|r| r["key"].as_str()).unwrap_or("");
            ck.eq("the row's key", key, "dd");
            let buckets: Vec<u64> = rows
                .first()
                .and_then(|r| r["buckets_log2"].as_array())
                .map(|a| a.iter().filter_map(|n| n.as_u64()).collect())
                .unwrap_or_default();
            let mut want = vec![0u64; 18];
            want[10] = 10;
            want[13] = 5;
            want[17] = 3;
            ck.eq("dd's reads by log2 bucket", buckets, want);
            ck.eq("overflow", v["overflow"].as_u64(), Some(0));
            ck.eq("faults", v["faults"].as_u64(), Some(0));
        }
    }
    ck.finish();
}

/// `hvtrace run --syscalls openat,read,write,close --count-comm dd
/// --format json --exec 'dd if=/etc/hostname bs=64 count=1'` as a user
/// types it: one boot, one line per call of dd, paired: dd opens the file
/// (the name read from its memory), reads the bytes the command printed,
/// writes them to fd 1, and closes what it opened.
/// (busybox's dd moves its input to fd 0 with a dup2, untraced here.)
#[test]
fn one_shot_syscalls() {
    let _vm = vm_lock();
    let (status, stdout, stderr) = hvtrace_run(&[
        "--guest",
        "fast",
        "--syscalls=openat,read,write,close",
        "--count-comm",
        "dd",
        "--format",
        "json",
        "--exec",
        "dd if=/etc/hostname bs=64 count=1",
    ]);
    println!("hvtrace run --syscalls: {status}\n{stderr}\n{stdout}");
    let mut ck = Checks::new();
    ck.check(
        status.success(),
        format!("hvtrace run --syscalls succeeded: {}", status),
    );
    // The command's output, as the run copied it to stderr.
    let hostname = stderr
        .lines()
        .skip_while(|l| !l.contains("$ dd if=/etc/hostname"))
        .nth(1)
        .unwrap_or("")
        .to_string();
    ck.check(!hostname.is_empty(), "the command printed the hostname");
    let calls: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    ck.check(
        !calls.is_empty() && calls.iter().all(|c| c["comm"] == "dd"),
        "only dd's calls",
    );
    let open = calls
        .iter()
        .find(|c| c["syscall"] == "openat" && c["args"]["filename"] == "/etc/hostname");
    let fd = open.and_then(|c| c["ret"].as_i64()).unwrap_or(-1);
    ck.check(fd >= 3, format!("dd opened /etc/hostname: {open:?}"));
    ck.eq(
        "openat's number",
        open.map(|c| c["nr"].clone()),
        Some(257.into()),
    );
    let len = hostname.len() as i64 + 1;
    // busybox dd moves the file to fd 0 (dup2, not traced) and closes fd
    // 3 before it reads.
    let read = calls.iter().find(|c| c["syscall"] == "read");
    ck.eq(
        "dd's read returned the hostname's bytes",
        read.map(|c| (c["args"]["count"].as_i64(), c["ret"].as_i64())),
        Some((Some(64), Some(len))),
    );
    let write = calls
        .iter()
        .find(|c| c["syscall"] == "write" && c["args"]["fd"] == 1);
    ck.eq(
        "dd wrote them to fd 1",
        write.map(|c| (c["args"]["count"].as_i64(), c["ret"].as_i64())),
        Some((Some(len), Some(len))),
    );
    ck.check(
        calls.iter().any(|c| {
            c["syscall"] == "close" && c["args"]["fd"].as_i64() == Some(fd) && c["ret"] == 0
        }),
        "dd closed it",
    );
    ck.check(
        stderr.contains("hvtrace: tracing 4 system calls"),
        "the arming line on stderr",
    );
    ck.finish();
}

/// `hvtrace run --count 'vfs_*' --count-comm dd --format chrome --output
/// FILE --exec ...`: the count sampled while dd runs becomes counter
/// tracks. vfs_read's track has samples while dd runs, never goes down
/// and ends at dd's 4000 reads and more; the document passes the schema and nesting checker.
#[test]
fn one_shot_count_to_chrome() {
    let _vm = vm_lock();
    let dir = std::env::temp_dir().join(format!("hvtrace-oneshot-count-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let out_file = dir.join("count.json");
    let out_path = out_file.to_string_lossy().into_owned();
    let (status, _, stderr) = hvtrace_run(&[
        "--guest",
        "fast",
        "--count",
        "vfs_*",
        "--count-comm",
        "dd",
        "--format",
        "chrome",
        "--output",
        &out_path,
        "--exec",
        "dd if=/dev/zero of=/dev/null bs=512 count=4000",
    ]);
    println!("hvtrace run --count --format chrome: {status}\n{stderr}");
    let mut ck = Checks::new();
    ck.check(status.success(), format!("the run succeeded: {status}"));
    let text = std::fs::read_to_string(&out_file).unwrap_or_default();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let reads: Vec<i64> = doc["traceEvents"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == "vfs_read")
        .filter_map(|e| e["args"]["value"].as_i64())
        .collect();
    println!("vfs_read samples: {reads:?}");
    ck.check(
        reads.windows(2).all(|w| w[0] <= w[1]),
        "the count never goes down",
    );
    ck.check(
        reads.last().is_some_and(|&n| n >= 4000),
        format!("dd's 4000 reads are counted: {reads:?}"),
    );
    // Sampled along the way, not only at the end.
    ck.check(
        reads.len() >= 2,
        format!("samples while dd runs: {reads:?}"),
    );
    let (passed, verdict) = check_chrome_trace(&out_file);
    ck.check(
        passed && verdict.contains(" C"),
        format!("the trace passes the checker with counters: {verdict}"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    ck.finish();
}
