//! Debian's kernel on two vCPUs under the hypervisor in Bochs
//! (`--cpus 2`): the boot (two processors online, no `vmx`, exits on both
//! vCPUs) and our probe against the guest's own kprobe with tasks pinned
//! to each CPU, CPU column included. The fast lane's two-vCPU checks are
//! in `smp.rs`.
//!
//! Run: `cargo test --release -p hvtrace-tests --test smp_debian -- --nocapture`

mod smp_common;

use hvtrace_tests::{hv_status, vm_lock, Checks, Detached};
use smp_common::{boot_checks, print_vcpus, probe_oracle_across_cpus};

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
    print_vcpus("smp debian", &hv_status(&mut c));
    checks.finish();
}
