//! Baseline: the fast-lane kernel booted bare (GRUB loads it directly, no
//! hypervisor) in Bochs. Checks the harness itself and gives the boot cost
//! the hypervisor runs are compared with.
//!
//! Run: `cargo test -p hvtrace-tests --test bare_boot -- --nocapture`

use std::time::Duration;

use hvtrace::{launch, Emulator, Guest};
use hvtrace_tests::{expected_release, guest_config, must, vm_lock, Checks};

#[test]
fn bare_fast_kernel_boots_in_bochs() {
    let _vm = vm_lock();
    let cfg = guest_config(Guest::Fast, Duration::from_secs(300))
        .bare()
        .with_emulator(Emulator::Bochs);
    let release = expected_release(&cfg.kernel);
    let mut vm = must(launch(cfg), "booting the fast-lane kernel bare in Bochs");
    let mut checks = Checks::new();

    if let Some(uname) = checks.ok("uname -r", vm.exec("uname -r")) {
        checks.eq("uname -r", uname.output.trim(), release.as_str());
        checks.eq("uname -r status", uname.rc, 0);
    }
    if let Some(cmdline) = checks.ok("cat /proc/cmdline", vm.exec("cat /proc/cmdline")) {
        checks.check(
            !hvtrace::vm::config::disables_kaslr(&cmdline.output),
            format!("/proc/cmdline has nokaslr: {:?}", cmdline.output),
        );
        checks.check(
            cmdline.output.contains("console=ttyS0"),
            format!("/proc/cmdline lacks the console: {:?}", cmdline.output),
        );
    }
    // The shell driver keeps status and output apart.
    if let Some(r) = checks.ok(
        "a failing command",
        vm.exec("echo out; echo err >&2; exit_code() { return 3; }; exit_code"),
    ) {
        checks.eq("failing command output", r.output.as_str(), "out\nerr\n");
        checks.eq("failing command status", r.rc, 3);
    }
    checks.check(
        vm.hv_lines().is_empty(),
        "a bare boot printed hypervisor lines",
    );

    if let Some(report) = checks.ok("power off", vm.poweroff()) {
        checks.eq("stop reason", report.reason.as_str(), "power off");
        if let Some(boot) = report.boot_time {
            eprintln!(
                "bare fast-lane boot in Bochs: shell ready after {:.1} s, {:.1} s in all",
                boot.as_secs_f64(),
                report.wall_time.as_secs_f64()
            );
        }
    }
    checks.finish();
}
