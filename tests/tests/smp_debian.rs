//! Debian's kernel on two vCPUs under the hypervisor in Bochs
//! (`--cpus 2`): the boot (two processors online, no `vmx`, exits on both
//! vCPUs) and our probe against the guest's own kprobe with tasks pinned
//! to each CPU, CPU column included. The fast lane's two-vCPU checks are
//! in `smp.rs`.
//!
//! Run: `cargo test --release -p hvtrace-tests --test smp_debian -- --nocapture`

mod smp_common;

use hvtrace_tests::{hv_status, vm_lock, Checks, Detached};
use smp_common::{boot_checks, probe_oracle_across_cpus};

/// Debian's kernel on two vCPUs: the boot, and our probe against the
/// guest's own kprobe with tasks pinned to each CPU.
#[test]
fn two_vcpus_boot_and_trace_debian() {
    let _vm = vm_lock();
    let vm = Detached::start_with("debian", "smp", &["--cpus", "2"]);
    let mut c = vm.client();
    let mut checks = Checks::new();
    boot_checks(&mut checks, &mut c);
    probe_oracle_across_cpus(&mut checks, &mut c);
    let st = hv_status(&mut c);
    for v in &st.per_vcpu {
        eprintln!(
            "smp debian: vCPU {}: {} exits, waited {} us for the VM lock over {} takes, held {} us",
            v.index,
            v.exits_total,
            v.lock_wait_ns / 1000,
            v.lock_takes,
            v.held_ns / 1000
        );
    }
    checks.finish();
}
