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
