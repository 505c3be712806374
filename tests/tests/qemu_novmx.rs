//! Under QEMU TCG there is no VMX: the hypervisor must refuse cleanly, with
//! its error line, before any guest code runs, and `hvtrace run` must report
//! that and fail.
//!
//! Run: `cargo test -p hvtrace-tests --test qemu_novmx`

use std::process::{Command, Stdio};
use std::time::Duration;

use hvtrace::{Emulator, Guest, Vm};
use hvtrace_tests::{guest_config, hvtrace_bin, hypervisor_image, must, vm_lock, Checks};

#[test]
fn hypervisor_refuses_without_vmx() {
    let _vm = vm_lock();
    let cfg = guest_config(Guest::Fast, Duration::from_secs(120))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Qemu { kvm: false });
    let mut vm = must(Vm::start(cfg), "starting QEMU TCG");
    let mut checks = Checks::new();
    match vm.wait_ready() {
        Ok(()) => checks.check(false, "the guest shell came up although the CPU has no VMX"),
        Err(e) => {
            let e = format!("{e:#}");
            checks.check(
                e.contains("VMX is not supported"),
                format!("the run failed for another reason: {e}"),
            );
        }
    }
    let errors = vm.hv_errors();
    let lines = vm.hv_lines();
    checks.check(
        errors.iter().any(|e| e.contains("VMX is not supported")),
        format!("no `hvtrace: error:` line says VMX is not supported; hypervisor lines: {lines:?}"),
    );
    checks.check(
        errors.iter().any(|e| e.contains("-cpu host,+vmx")),
        format!("the error line does not mention -cpu host,+vmx: {errors:?}"),
    );
    checks.check(
        !vm.guest_started() && !lines.iter().any(|l| l == "guest started"),
        format!("a `guest started` line appeared: {lines:?}"),
    );
    vm.close();
    checks.finish();
}

#[test]
fn run_command_fails_without_vmx() {
    let _vm = vm_lock();
    let hypervisor = hypervisor_image();
    let output = Command::new(hvtrace_bin())
        .args([
            "run",
            "--emulator",
            "qemu",
            "--no-kvm",
            "--guest",
            "fast",
            "--quiet",
        ])
        .arg("--hypervisor")
        .arg(&hypervisor)
        .args(["--exec", "true", "--timeout", "120"])
        .stdin(Stdio::null())
        .output()
        .expect("cannot run hvtrace");
    let stderr = String::from_utf8_lossy(&output.stderr);
    // A failed run keeps its directory for diagnosis; this failure was expected.
    for line in stderr.lines() {
        if let Some(dir) = line.strip_prefix("hvtrace: run directory kept: ") {
            let _ = std::fs::remove_dir_all(dir.trim());
        }
    }
    let mut checks = Checks::new();
    checks.check(
        !output.status.success(),
        format!("hvtrace run succeeded: {stderr}"),
    );
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("hvtrace: error: "))
        .collect();
    checks.eq("number of error lines", errors.len(), 1);
    checks.check(
        errors.iter().any(|l| l.contains("VMX is not supported")),
        format!("no error line says VMX is not supported; stderr:\n{stderr}"),
    );
    checks.check(
        !stderr.contains("panicked"),
        format!("hvtrace panicked:\n{stderr}"),
    );
    checks.check(output.stdout.is_empty(), "a command ran in the guest");
    checks.finish();
}
