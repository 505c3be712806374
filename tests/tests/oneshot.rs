//! The one-shot traced run, end to end, as a user types it (fast lane, one
//! boot): `hvtrace run --graph vfs_read ... --probe 'r:...' --exec CMD
//! --format chrome --output FILE`. The file must be a Chrome trace that
//! parses, whose B/E events nest per task, with `dd`'s vfs_read tree in it;
//! the return probe rides on the same frames.
//!
//! Run: `cargo test -p hvtrace-tests --test oneshot -- --nocapture`

use std::process::Command;

use hvtrace_tests::{hvtrace_bin, hypervisor_image, vm_lock, Checks};

#[test]
fn one_shot_graph_to_chrome() {
    let _vm = vm_lock();
    let dir = std::env::temp_dir().join(format!("hvtrace-oneshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let out_file = dir.join("graph.json");
    let output = Command::new(hvtrace_bin())
        .args([
            "run",
            "--guest",
            "fast",
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
            "--probe",
            "r:readret vfs_read ret=$retval:x64",
            "--exec",
            "dd if=/etc/hostname of=/dev/null bs=64 count=1",
            "--exec",
            "dd if=/etc/hostname of=/dev/null bs=64 count=1",
            "--format",
            "chrome",
            "--output",
        ])
        .arg(&out_file)
        .arg("--hypervisor")
        .arg(hypervisor_image())
        .output()
        .expect("running hvtrace run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("hvtrace run: {}\n{stderr}", output.status);
    let mut ck = Checks::new();
    ck.check(
        output.status.success(),
        format!("hvtrace run succeeded: {}", output.status),
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
    let output = Command::new(hvtrace_bin())
        .args([
            "run",
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
        ])
        .arg("--hypervisor")
        .arg(hypervisor_image())
        .output()
        .expect("running hvtrace run");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("hvtrace run --hist: {}\n{stderr}\n{stdout}", output.status);
    let mut ck = Checks::new();
    ck.check(
        output.status.success(),
        format!("hvtrace run --hist succeeded: {}", output.status),
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
