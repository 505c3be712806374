//! Our Chrome traces against a checker that is not ours: the jsonschema
//! package (Debian's python3-jsonschema, which scripts/setup.sh installs)
//! validating scripts/chrome-trace.schema.json, the Trace Event Format's
//! phases and their required fields, plus the nesting and overlap rules a
//! viewer needs (scripts/check-chrome-trace.py). A trace with every kind
//! of event passes; broken ones are refused, so the checker can fail.
//!
//! Run: `cargo test -p hvtrace --test chrome_schema`

use std::path::{Path, PathBuf};
use std::process::Command;

use hvtrace::output::chrome::Chrome;
use hvtrace::output::json;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs the checker on `doc`: (passed, its line).
fn check(doc: &str, name: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("hvtrace-chrome-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, doc).unwrap();
    let out = Command::new("/usr/bin/python3")
        .arg(repo().join("scripts/check-chrome-trace.py"))
        .arg(&path)
        .output()
        .expect("/usr/bin/python3 with python3-jsonschema: scripts/setup.sh installs them");
    let _ = std::fs::remove_file(&path);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn every_kind() -> String {
    let lines = [
        r#"{"ts":"0","ts_ns":1000,"cpu":0,"pid":0,"comm":"swapper/0","kind":"sched_switch","prev_comm":"swapper/0","prev_pid":0,"prev_prio":120,"prev_state":"R","next_comm":"dd","next_pid":90,"next_prio":120}"#,
        r#"{"ts":"0","ts_ns":1100,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","ip":"0x1","depth":0}"#,
        r#"{"ts":"0","ts_ns":1200,"cpu":0,"pid":90,"comm":"dd","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0x2","probe":"do_sys_openat2+0x0/0x150","args":{"dfd":-100,"filename":"/etc/hostname"}}"#,
        r#"{"ts":"0","ts_ns":1250,"cpu":0,"pid":90,"comm":"dd","group":"kprobes","event":"ret","kind":"kretprobe","ip":"0x2","ret_ip":"0x3","probe":"vfs_read+0x0/0x200","args":{"ret":"0x40"}}"#,
        r#"{"ts":"0","ts_ns":1300,"cpu":0,"pid":90,"comm":"dd","kind":"function","func":"vfs_open","parent":"path_openat+0x6d/0xf0","ip":"0x1","parent_ip":"0x2"}"#,
        r#"{"ts":"0","ts_ns":1400,"cpu":0,"pid":90,"comm":"dd","kind":"sched_switch","prev_comm":"dd","prev_pid":90,"prev_prio":120,"prev_state":"D","next_comm":"swapper/0","next_pid":0,"next_prio":120}"#,
        r#"{"ts":"0","ts_ns":1900,"cpu":0,"pid":0,"comm":"swapper/0","kind":"sched_switch","prev_comm":"swapper/0","prev_pid":0,"prev_prio":120,"prev_state":"R","next_comm":"dd","next_pid":90,"next_prio":120}"#,
        r#"{"ts":"0","ts_ns":2000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","ip":"0x1","depth":0,"duration_ns":900,"retval":"0x40"}"#,
        r#"{"ts":"0","ts_ns":2100,"cpu":1,"pid":91,"comm":"cat","kind":"graph_entry","func":"vfs_read","ip":"0x1","depth":0}"#,
    ]
    .join("\n");
    let mut chrome = Chrome::new();
    chrome.push_text(&lines);
    chrome.counter(1_500, "vfs_read", json::int(3u64));
    let mut out = Vec::new();
    chrome.write(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

#[test]
fn every_kind_of_event_passes_the_schema_and_the_nesting_rules() {
    let doc = every_kind();
    let (ok, line) = check(&doc, "every.json");
    assert!(ok, "{line}\n{doc}");
    // Every phase we write was there to check.
    for ph in ["2 B", "2 E", " M,", " X,", "3 i", "1 C"] {
        assert!(line.contains(ph), "{ph} in {line}");
    }
}

#[test]
fn broken_traces_are_refused() {
    let doc = every_kind();
    let broken = [
        // A phase the format does not have.
        (doc.replacen(r#""ph":"i""#, r#""ph":"Q""#, 1), "schema"),
        // An instant without its time.
        (
            doc.replacen(r#""ph":"i","s":"t","ts":1.2,"#, r#""ph":"i","s":"t","#, 1),
            "schema",
        ),
        // A counter whose value is not a number.
        (doc.replacen(r#""value":3"#, r#""value":"3""#, 1), "schema"),
        // An E with no B.
        (
            doc.replacen(
                r#""name":"vfs_read","cat":"graph","ph":"B""#,
                r#""name":"vfs_read","cat":"graph","ph":"i","s":"t""#,
                1,
            ),
            "closes nothing",
        ),
        // Two slices of one CPU track overlap.
        (doc.replacen(r#""dur":0.4"#, r#""dur":0.9"#, 1), "overlap"),
    ];
    for (i, (bad, why)) in broken.iter().enumerate() {
        assert_ne!(bad, &doc, "case {i} changed nothing");
        let (ok, line) = check(bad, &format!("broken{i}.json"));
        assert!(!ok && line.contains(why), "case {i}: {line}");
    }
}
