//! A panic in VMX root reaches the host on the control channel (COM2), not
//! only on the log port, and the VM ends by itself.
//!
//! The hypervisor's own command line `hvtrace.selftest=panic` makes root
//! panic right after it has programmed the control UART, before the guest is
//! loaded and before VMX is looked at, so QEMU TCG (no VMX, about a second
//! per boot) runs it. The panic handler is the real fatal path
//! (`hypervisor::fatal::die`): an `error:` line on the log port, an
//! `Event::Fatal` frame on COM2, then a power-off.
//!
//! - `a_panic_in_root_is_reported_on_com2`: QEMU without the log port (no
//!   `-debugcon`), as on a platform that does not capture it: the report
//!   can only have come over COM2, through the VM's control tap.
//! - `a_panic_in_root_reaches_the_run_as_its_error`: the same through the
//!   in-process supervisor `hvtrace run` uses to trace: the error the user
//!   sees names the panic.
//! - `a_panic_reported_both_ways_counts_once`: with the log port captured
//!   too, the report is one error, not two.
//!
//! Run: `cargo test --release -p hvtrace-tests --test root_panic`

use std::time::Duration;

use hvtrace::daemon::local::LocalVm;
use hvtrace::{Emulator, Guest, RunConfig, Vm};
use hvtrace_tests::{guest_config, hypervisor_image, must, vm_lock, Checks};

/// The hypervisor command line word of the hook (`hypervisor::selftest`).
const HOOK: &str = "hvtrace.selftest=panic";
/// The panic's message in `hv_entry64`.
const MESSAGE: &str = "self-test: a deliberate panic in VMX root";

fn config(log_port: bool) -> RunConfig {
    let base = guest_config(Guest::Fast, Duration::from_secs(90))
        .with_hypervisor(hypervisor_image())
        .with_emulator(Emulator::Qemu { kvm: false });
    RunConfig {
        hypervisor_cmdline: HOOK.to_string(),
        log_port,
        ..base
    }
}

/// Boots with the hook, waits for QEMU to end by itself and checks the
/// report; returns the checks so far and the ended VM.
fn boot_and_die(log_port: bool) -> (Checks, Vm) {
    let mut vm = must(
        Vm::start(config(log_port)),
        "starting QEMU TCG with the panic hook",
    );
    let mut checks = Checks::new();
    // The hypervisor powers the machine off after its report: QEMU must end
    // by itself, well within this bound (a hang is a failure).
    let status = vm.wait_exit_or_kill(Duration::from_secs(60));
    checks.check(
        matches!(status, Ok(Some(_))),
        format!("QEMU did not end by itself after the panic ({status:?})"),
    );
    let fault = vm.control_fault();
    checks.check(
        fault
            .as_deref()
            .is_some_and(|f| f.starts_with("hypervisor panic: ") && f.contains(MESSAGE)),
        format!("no fatal report naming the panic came on COM2: {fault:?}"),
    );
    let errors = vm.hv_errors();
    checks.check(
        errors.len() == 1 && Some(&errors[0]) == fault.as_ref(),
        format!("expected the COM2 report as the one error, got {errors:?}"),
    );
    checks.check(
        !vm.guest_started(),
        format!("a `guest started` line appeared: {:?}", vm.hv_lines()),
    );
    (checks, vm)
}

#[test]
fn a_panic_in_root_is_reported_on_com2() {
    let _vm = vm_lock();
    let (mut checks, vm) = boot_and_die(false);
    let lines = vm.hv_lines();
    // No log port: the hypervisor's lines are the two the COM2 report
    // stands for, and nothing else.
    checks.eq("hypervisor lines", lines.len(), 2);
    checks.check(
        lines
            .first()
            .is_some_and(|l| l.starts_with("error: hypervisor panic: ")),
        format!("the first line is not the report: {lines:?}"),
    );
    checks.check(
        lines.get(1).map(String::as_str) == Some("guest stopped: hypervisor fault"),
        format!("no `guest stopped: hypervisor fault` line: {lines:?}"),
    );
    eprintln!("root_panic: hypervisor lines without the log port: {lines:#?}");
    vm.close();
    checks.finish();
}

#[test]
fn a_panic_reported_both_ways_counts_once() {
    let _vm = vm_lock();
    let (mut checks, vm) = boot_and_die(true);
    let lines = vm.hv_lines();
    checks.check(
        lines
            .iter()
            .any(|l| l.starts_with("self-test: panicking in VMX root")),
        format!("the log port was not captured: {lines:?}"),
    );
    checks.eq(
        "`error: hypervisor panic` lines",
        lines
            .iter()
            .filter(|l| l.starts_with("error: hypervisor panic: "))
            .count(),
        1,
    );
    checks.eq(
        "`guest stopped:` lines",
        lines
            .iter()
            .filter(|l| l.starts_with("guest stopped:"))
            .count(),
        1,
    );
    vm.close();
    checks.finish();
}

#[test]
fn a_panic_in_root_reaches_the_run_as_its_error() {
    let _vm = vm_lock();
    let result = LocalVm::start(config(false));
    let Err(e) = result else {
        panic!("the guest shell came up: the self-test did not run");
    };
    let message = format!("{e:#}");
    assert!(
        message.starts_with("the hypervisor reported an error: hypervisor panic: ")
            && message.contains(MESSAGE),
        "the run's error does not name the panic: {message}"
    );
}
