//! Boot cost of the hypervisor: the fast-lane kernel booted twice in one run
//! of Bochs, bare (GRUB loads the kernel and initrd directly) and under the
//! hypervisor, to the guest shell answering, with one vCPU and with two.
//! Prints the wall times, their ratio and the VM exits by reason.
//!
//! The project's target is a ratio of at most 1.3; the assertion below is a
//! looser regression guard (2.0) because wall time on a shared machine moves
//! by tens of percent from run to run.
//!
//! Run: `cargo test -p hvtrace-tests --test boot_cost -- --nocapture`

use std::time::Duration;

use hvtrace::{launch, Emulator, Guest};
use hvtrace_tests::{guest_config, hypervisor_image, must, vm_lock, Checks};

#[test]
fn hypervisor_boot_cost_against_bare() {
    boot_cost(1);
}

#[test]
fn hypervisor_boot_cost_against_bare_two_vcpus() {
    boot_cost(2);
}

/// Boots bare, then under the hypervisor, with `cpus` vCPUs.
fn boot_cost(cpus: u32) {
    let _vm = vm_lock();
    let mut checks = Checks::new();

    let mut bare_cfg = guest_config(Guest::Fast, Duration::from_secs(300))
        .bare()
        .with_emulator(Emulator::Bochs);
    bare_cfg.cpus = cpus;
    let bare = must(
        launch(bare_cfg),
        "bare boot of the fast-lane kernel in Bochs",
    );
    let bare_time = bare.boot_time().expect("a launched VM has a boot time");
    let bare_stop = must(bare.poweroff(), "powering the bare guest off");

    let mut hv_cfg = guest_config(Guest::Fast, Duration::from_secs(300))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Bochs);
    hv_cfg.cpus = cpus;
    let hv = must(
        launch(hv_cfg),
        "boot of the fast-lane kernel under the hypervisor in Bochs",
    );
    let hv_time = hv.boot_time().expect("a launched VM has a boot time");
    let hv_stop = must(hv.poweroff(), "powering the hypervisor guest off");

    let ratio = hv_time.as_secs_f64() / bare_time.as_secs_f64();
    println!("boot to shell, fast-lane 6.12 in Bochs, {cpus} vCPU(s):");
    println!(
        "  bare              {:>7.2} s (stop: {})",
        bare_time.as_secs_f64(),
        bare_stop.reason
    );
    println!(
        "  under hypervisor  {:>7.2} s (stop: {})",
        hv_time.as_secs_f64(),
        hv_stop.reason
    );
    println!("  ratio             {ratio:>7.3} (target <= 1.3)");
    match &hv_stop.exit_counts {
        Some(counts) => {
            let total: u64 = counts.values().sum();
            println!("  VM exits          {total} in all: {counts:?}");
            checks.check(
                counts.get("CPUID").is_some_and(|&n| n > 0),
                "no CPUID exits counted",
            );
        }
        None => checks.check(false, "the hypervisor printed no exit counts"),
    }
    checks.eq(
        "hypervisor run stop reason",
        hv_stop.reason.as_str(),
        "power off",
    );
    checks.check(
        ratio <= 2.0,
        format!("boot under the hypervisor took {ratio:.2}x the bare boot"),
    );
    checks.finish();
}
