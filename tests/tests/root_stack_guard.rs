//! Root's stack has a guard page under it, and an overflow in VMX root is
//! reported, never silent.
//!
//! The hypervisor's own command line `hvtrace.selftest=stack-overflow` makes
//! root recurse on purpose right after its IDT and the guard page are set up,
//! before the guest is loaded and before VMX is looked at, so QEMU TCG (no
//! VMX, seconds per boot) runs it. The recursion must hit the guard page;
//! the #PF cannot be delivered on the overflowed stack, so the CPU raises
//! #DF, which root takes on its own IST stack: one `hypervisor fault in VMX
//! root: #DF` line that names the guard page, then a power-off. Without the
//! guard the recursion runs through the boot page directory and the bss
//! below the stack, and the machine dies without a word (a triple fault,
//! which ends QEMU under `-no-reboot`).
//!
//! Each AP's root stack has its own guard page (`smp::prepare` takes it out
//! of root's page tables). `hvtrace.selftest=ap-stack-overflow` makes the
//! first AP recurse the same way once its own IDT and IST stacks are in
//! place, before it enters VMX: AP bring-up needs VMX, so that half runs in
//! Bochs with two processors (a minute or two to that point). The report
//! must name the AP's guard page and CPU 1.
//!
//! Run: `cargo test --release -p hvtrace-tests --test root_stack_guard`

use std::time::{Duration, Instant};

use hvtrace::{Emulator, Guest, RunConfig, Vm};
use hvtrace_tests::{guest_config, hypervisor_image, must, vm_lock, Checks};

/// The hypervisor command line word of the hook (`hypervisor::selftest`).
const HOOK: &str = "hvtrace.selftest=stack-overflow";
/// The same for the first AP's stack.
const AP_HOOK: &str = "hvtrace.selftest=ap-stack-overflow";

#[test]
fn root_stack_overflow_hits_the_guard_page_and_is_reported() {
    let _vm = vm_lock();
    let base = guest_config(Guest::Fast, Duration::from_secs(90))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Qemu { kvm: false });
    let cfg = RunConfig {
        hypervisor_cmdline: HOOK.to_string(),
        ..base
    };
    let started = Instant::now();
    let mut vm = must(
        Vm::start(cfg),
        "starting QEMU TCG with the stack-overflow hook",
    );
    let mut checks = Checks::new();
    // The hypervisor powers the machine off after its report: QEMU must end
    // by itself, well within this bound (a hang is a failure).
    let (lines, _) = check_reported(
        &mut checks,
        &mut vm,
        "QEMU",
        Duration::from_secs(60),
        "self-test: overflowing root's stack",
        |l| l.contains("root stack overflow: guard page"),
    );
    let elapsed = started.elapsed();
    checks.check(
        !lines
            .iter()
            .any(|l| l.contains("VMX") && !l.starts_with("error: hypervisor fault in VMX root")),
        format!("the hypervisor got as far as VMX: {lines:?}"),
    );
    eprintln!("root_stack_guard: VM ended after {elapsed:?}; hypervisor lines: {lines:#?}");
    vm.close();
    checks.finish();
}

#[test]
fn an_ap_root_stack_overflow_hits_its_guard_page_and_is_reported() {
    let _vm = vm_lock();
    let base = guest_config(Guest::Fast, Duration::from_secs(600))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Bochs);
    let cfg = RunConfig {
        hypervisor_cmdline: AP_HOOK.to_string(),
        cpus: 2,
        ..base
    };
    let started = Instant::now();
    let mut vm = must(
        Vm::start(cfg),
        "starting Bochs with two processors and the AP stack-overflow hook",
    );
    let mut checks = Checks::new();
    let (lines, double_faults) = check_reported(
        &mut checks,
        &mut vm,
        "Bochs",
        Duration::from_secs(300),
        "self-test: overflowing AP 1's root stack",
        |l| l.contains("root stack overflow: guard page") && l.contains("CPU 1)"),
    );
    let elapsed = started.elapsed();
    // The guard named is the AP's, not the boot processor's.
    let bsp_guard = lines
        .iter()
        .find_map(|l| l.split_once("root stack guard page at "))
        .map(|(_, g)| g.trim().to_string());
    checks.check(
        bsp_guard.is_some_and(|g| {
            double_faults
                .iter()
                .all(|l| !l.contains(&format!("guard page {g}..")))
        }),
        format!(
            "the #DF report names the boot processor's guard page: {double_faults:?} {lines:?}"
        ),
    );
    eprintln!("root_stack_guard (AP): VM ended after {elapsed:?}; hypervisor lines: {lines:#?}");
    vm.close();
    checks.finish();
}

/// What an overflow's report must be, once the hook ran in `emulator`: no
/// guest shell, the emulator ending by itself within `wait`, the
/// self-test's `start` line, exactly one #DF line, which `names_guard`
/// accepts, one error line, no panic, the stop line, no guest started.
/// Returns the hypervisor's lines and the #DF lines.
fn check_reported(
    checks: &mut Checks,
    vm: &mut Vm,
    emulator: &str,
    wait: Duration,
    start: &str,
    names_guard: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    if vm.wait_ready().is_ok() {
        checks.check(false, "the guest shell came up: the self-test did not run");
    }
    let status = vm.wait_exit_or_kill(wait);
    checks.check(
        matches!(status, Ok(Some(_))),
        format!("{emulator} did not end by itself after the overflow ({status:?})"),
    );
    let lines = vm.hv_lines();
    let errors = vm.hv_errors();
    checks.check(
        lines.iter().any(|l| l.starts_with(start)),
        format!("the self-test did not start ({start}): {lines:?}"),
    );
    let double_faults: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with("error: hypervisor fault in VMX root: #DF"))
        .cloned()
        .collect();
    checks.eq(
        "`hypervisor fault in VMX root: #DF` lines",
        double_faults.len(),
        1,
    );
    checks.check(
        double_faults.iter().all(|l| names_guard(l)),
        format!("the #DF report does not name the guard page: {double_faults:?}"),
    );
    checks.check(
        errors.len() == 1,
        format!("expected exactly one error line, got {errors:?}"),
    );
    checks.check(
        !lines.iter().any(|l| l.contains("panic")),
        format!("a panic was reported: {lines:?}"),
    );
    checks.check(
        lines.iter().any(|l| l == "guest stopped: hypervisor fault"),
        format!("no `guest stopped: hypervisor fault` line: {lines:?}"),
    );
    checks.check(
        !vm.guest_started(),
        format!("a `guest started` line appeared: {lines:?}"),
    );
    (lines, double_faults)
}
