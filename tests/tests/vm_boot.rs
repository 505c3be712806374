//! The guest boots under the hypervisor in Bochs: one boot per kernel, with
//! every check on that boot.
//!
//! Run both: `cargo test -p hvtrace-tests --test vm_boot -- --nocapture`
//! Only the fast-lane 6.12 kernel (tens of seconds):
//!   `cargo test -p hvtrace-tests --test vm_boot fast_6_12`
//! Only Debian's stock 6.1 kernel (minutes):
//!   `cargo test -p hvtrace-tests --test vm_boot debian_6_1`

use std::time::Duration;

use hvtrace::{launch, Emulator, Guest};
use hvtrace_tests::{
    cpuinfo_flags, expected_release, guest_config, hypervisor_image, must, vm_lock, Checks,
};

fn boot_under_hypervisor(guest: Guest, timeout: Duration) {
    let _vm = vm_lock();
    let hypervisor = hypervisor_image();
    let cfg = guest_config(guest, timeout)
        .with_hypervisor(hypervisor)
        .with_emulator(Emulator::Bochs);
    let release = expected_release(&cfg.kernel);
    let mut vm = must(
        launch(cfg),
        &format!("booting the {guest:?} guest under the hypervisor in Bochs"),
    );
    let mut checks = Checks::new();

    checks.check(
        vm.guest_started(),
        "the hypervisor printed no `guest started` line",
    );
    if let Some(uname) = checks.ok("uname -r", vm.exec("uname -r")) {
        checks.eq("uname -r", uname.output.trim(), release.as_str());
    }
    if let Some(cmdline) = checks.ok("cat /proc/cmdline", vm.exec("cat /proc/cmdline")) {
        checks.check(
            !hvtrace::vm::config::disables_kaslr(&cmdline.output),
            format!("/proc/cmdline has nokaslr: {:?}", cmdline.output),
        );
    }
    if let Some(cpuinfo) = checks.ok("cat /proc/cpuinfo", vm.exec("cat /proc/cpuinfo")) {
        match cpuinfo_flags(&cpuinfo.output) {
            Some(flags) => {
                // VMX is root's; the debug store (Bochs offers it: dts,
                // dtes64, ds_cpl) is hidden by the CPUID whitelist; no
                // host hypervisor, no 5-level paging.
                for hidden in ["vmx", "dts", "dtes64", "ds_cpl", "hypervisor", "la57"] {
                    checks.check(
                        !flags.iter().any(|f| f == hidden),
                        format!("the guest sees the {hidden} flag in /proc/cpuinfo"),
                    );
                }
                // What the whitelist passes of Bochs's model stays.
                for kept in [
                    "sse4_2", "avx2", "xsave", "pcid", "x2apic", "smep", "fsgsbase",
                ] {
                    checks.check(
                        flags.iter().any(|f| f == kept),
                        format!("the guest lost the {kept} flag: {flags:?}"),
                    );
                }
            }
            None => checks.check(
                false,
                format!("no flags line in /proc/cpuinfo: {:?}", cpuinfo.output),
            ),
        }
    }

    if let Some(dmesg) = checks.ok(
        "dmesg",
        vm.exec("dmesg | grep -i 'hypervisor detected' || echo none"),
    ) {
        checks.eq(
            "the guest's dmesg on a hypervisor",
            dmesg.output.trim(),
            "none",
        );
    }

    if let Some(report) = checks.ok("power off", vm.poweroff()) {
        checks.eq("stop reason", report.reason.as_str(), "power off");
        match &report.exit_counts {
            Some(counts) => checks.check(
                counts.get("CPUID").is_some_and(|&n| n > 0),
                format!("no CPUID exits counted: {counts:?}"),
            ),
            None => checks.check(false, "the hypervisor printed no exit counts"),
        }
        eprintln!(
            "{guest:?} under the hypervisor in Bochs: shell ready after {:.1} s, {:.1} s in all; exits {:?}",
            report.boot_time.unwrap_or_default().as_secs_f64(),
            report.wall_time.as_secs_f64(),
            report.exit_counts.unwrap_or_default()
        );
    }
    checks.finish();
}

/// A software reset of the fast-lane guest (`reboot -f`: the kernel
/// writes its reset command to the keyboard controller, or the PCI reset
/// register) ends the VM with the reason `reset`, and root names the port:
/// a reset would restart the emulated machine without root (in Bochs the
/// firmware would then jump where the guest's CMOS shutdown byte says).
#[test]
fn fast_6_12_software_reset_ends_the_vm() {
    let _vm = vm_lock();
    let cfg = guest_config(Guest::Fast, Duration::from_secs(600))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Bochs);
    let mut vm = must(launch(cfg), "booting the fast guest under the hypervisor");
    let mut checks = Checks::new();
    checks.ok("a shell", vm.exec("echo ready"));
    checks.ok("reboot -f sent", vm.send(b"reboot -f\n"));
    if let Some(report) = checks.ok("the VM stops after the reset", vm.wait_stop()) {
        checks.eq("stop reason", report.reason.as_str(), "reset");
        checks.check(
            report
                .hv_lines
                .iter()
                .any(|l| l.contains("the guest reset the machine through port 0x")),
            format!(
                "root names the reset port in its log: {:?}",
                report.hv_lines
            ),
        );
    }
    checks.finish();
}

#[test]
fn fast_6_12_boots_under_hypervisor_in_bochs() {
    boot_under_hypervisor(Guest::Fast, Duration::from_secs(600));
}

#[test]
fn debian_6_1_boots_under_hypervisor_in_bochs() {
    boot_under_hypervisor(Guest::Debian, Duration::from_secs(1200));
}
