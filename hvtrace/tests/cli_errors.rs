//! Bad options and missing files: one `hvtrace: error:` line on stderr, a
//! non-zero exit, no panic, and nothing started. None of these cases needs an
//! emulator, a kernel or the hypervisor.
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

/// Runs hvtrace and checks the one-line failure; returns the message.
fn fails(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_hvtrace"))
        .args(args)
        .env("HVTRACE_ROOT", "/nonexistent-hvtrace-root")
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
        "--socket",
    ] {
        assert!(text.contains(option), "help lacks {option}");
    }
}
