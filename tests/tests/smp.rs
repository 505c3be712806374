//! A guest with two vCPUs under the hypervisor in Bochs, on one detached
//! boot of the fast-lane kernel (`--cpus 2`):
//!
//! - the guest brought both CPUs up (its own `/proc/cpuinfo` and
//!   `/sys/devices/system/cpu/online`), and a task pinned to CPU 1 ran
//!   there (field 39 of its own `/proc/self/stat`), with CPU 1 taking its
//!   own timer interrupts;
//! - the guest's sysrq backtrace of every CPU, asked for on CPU 0, comes
//!   back from CPU 1 through an NMI IPI (which root carries through);
//! - root started the AP at the guest's SIPI (its log says where), and the
//!   AP start-up page is missing from the guest's e820 (the guest's own
//!   boot log);
//! - CPU hotplug: CPU 1 goes offline and comes back through INIT and SIPI
//!   again (root's log says it parked and started it), and runs tasks;
//! - `status` reports two vCPUs, each with its exits and its waits for the
//!   VM lock (the VM's exits are their sum), and a probe is refused with a
//!   clear error (tracing on more than one vCPU is not built yet).
//!
//! Run: `cargo test --release -p hvtrace-tests --test smp -- --nocapture`

use hvtrace_tests::{guest_exec, hv_call, hv_status, vm_lock, Checks, Detached};
use protocol::{ErrorKind, Request, Response};

/// The CPU a task pinned with `taskset MASK` ran on, from its own stat.
fn cpu_of_pinned_task(c: &mut hvtrace::client::Client, mask: &str) -> String {
    guest_exec(
        c,
        &format!("taskset {mask} cat /proc/self/stat | cut -d' ' -f39"),
    )
    .trim()
    .to_string()
}

/// The local timer interrupts of each CPU, from `/proc/interrupts`.
fn local_timer_counts(c: &mut hvtrace::client::Client) -> Vec<u64> {
    let text = guest_exec(c, "grep 'LOC:' /proc/interrupts");
    text.split_whitespace()
        .skip(1)
        .map_while(|w| w.parse().ok())
        .collect()
}

#[test]
fn two_vcpus_boot_run_and_hotplug_fast_lane() {
    let _vm = vm_lock();
    let vm = Detached::start_with("fast", "smp", &["--cpus", "2"]);
    let mut c = vm.client();
    let mut checks = Checks::new();

    let processors = guest_exec(&mut c, "grep -c ^processor /proc/cpuinfo");
    checks.eq("processors in /proc/cpuinfo", processors.trim(), "2");
    let online = guest_exec(&mut c, "cat /sys/devices/system/cpu/online");
    checks.eq("online CPUs", online.trim(), "0-1");
    checks.eq(
        "the CPU a task pinned to CPU 1 ran on",
        cpu_of_pinned_task(&mut c, "2").as_str(),
        "1",
    );
    checks.eq(
        "the CPU a task pinned to CPU 0 ran on",
        cpu_of_pinned_task(&mut c, "1").as_str(),
        "0",
    );
    let before = local_timer_counts(&mut c);
    guest_exec(
        &mut c,
        "taskset 2 sh -c 'i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done'",
    );
    let after = local_timer_counts(&mut c);
    checks.check(
        before.len() == 2 && after.len() == 2 && after[1] > before[1],
        format!("CPU 1's local timer did not tick: LOC before {before:?}, after {after:?}"),
    );

    // The AP start-up page is root's: not in any usable range the guest
    // was given.
    let e820 = guest_exec(&mut c, "dmesg | grep 'BIOS-e820:.*usable'");
    let covers_page = e820.lines().any(|l| {
        let Some(range) = l
            .split_once("[mem ")
            .and_then(|(_, r)| r.split_once(']'))
            .map(|(r, _)| r)
        else {
            return false;
        };
        let mut ends = range
            .split('-')
            .map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16).ok());
        matches!((ends.next(), ends.next()), (Some(Some(a)), Some(Some(b))) if a <= 0xf000 && 0xf000 <= b)
    });
    checks.check(
        !e820.is_empty() && !covers_page,
        format!("the guest's e820 gives it the AP start-up page 0xf000: {e820}"),
    );

    // NMI IPIs reach the other vCPU: the guest's own backtrace of every
    // CPU, asked for on CPU 0, comes back from CPU 1 through an NMI.
    guest_exec(
        &mut c,
        "dmesg -c > /dev/null; taskset 1 sh -c 'echo l > /proc/sysrq-trigger'; sleep 1",
    );
    let backtraces = guest_exec(&mut c, "dmesg");
    checks.check(
        backtraces.contains("NMI backtrace for cpu 1"),
        format!(
            "no NMI backtrace from CPU 1: {}",
            &backtraces[backtraces.len().saturating_sub(1500)..]
        ),
    );

    // Hotplug: offline, then online again through INIT and SIPI.
    guest_exec(&mut c, "echo 0 > /sys/devices/system/cpu/cpu1/online");
    let online = guest_exec(&mut c, "cat /sys/devices/system/cpu/online");
    checks.eq("online CPUs with CPU 1 offline", online.trim(), "0");
    checks.eq(
        "the CPU a task pinned to any CPU ran on, CPU 1 offline",
        cpu_of_pinned_task(&mut c, "3").as_str(),
        "0",
    );
    guest_exec(&mut c, "echo 1 > /sys/devices/system/cpu/cpu1/online");
    let online = guest_exec(&mut c, "cat /sys/devices/system/cpu/online");
    checks.eq("online CPUs after CPU 1 came back", online.trim(), "0-1");
    checks.eq(
        "the CPU a task pinned to CPU 1 ran on, after hotplug",
        cpu_of_pinned_task(&mut c, "2").as_str(),
        "1",
    );

    let status = hv_status(&mut c);
    checks.eq("vCPUs in status", status.vcpus, 2);
    checks.eq("vCPU reports in status", status.per_vcpu.len(), 2);
    let sum: u64 = status.per_vcpu.iter().map(|v| v.exits_total).sum();
    checks.eq("status exits: the vCPUs' sum", status.exits_total, sum);
    if let Some(ap) = status.per_vcpu.get(1) {
        checks.check(
            ap.exits_total > 0
                && !ap.parked
                && ap.lock_takes > 0
                && ap.lock_takes <= ap.exits_total,
            format!("vCPU 1 in status: {ap:?}"),
        );
    }
    let (code, text, err) = vm.cli(&["status"]);
    checks.check(
        code == 0 && text.contains("vCPU 1 (APIC ID 1): running"),
        format!("hvtrace status does not show vCPU 1 running: {code} {text} {err}"),
    );
    match hv_call(
        &mut c,
        Request::ProbeAdd {
            spec: "p:smp_open do_sys_openat2".into(),
        },
    ) {
        Response::Error { kind, message } => {
            checks.eq(
                "probe on two vCPUs: error kind",
                kind,
                ErrorKind::Unsupported,
            );
            checks.check(
                message.contains("2 vCPUs"),
                format!("the refusal does not say why: {message}"),
            );
        }
        other => checks.check(
            false,
            format!("a probe on two vCPUs was not refused: {other:?}"),
        ),
    }

    let log = vm.emulator_output();
    let starts = log.matches("vCPU 1 started at 0x").count();
    checks.check(
        starts >= 2,
        format!("root's log shows {starts} starts of vCPU 1 (boot and hotplug), want 2"),
    );
    checks.check(
        log.contains("vCPU 1 parked by INIT"),
        "root's log shows no INIT parking vCPU 1 (hotplug)",
    );
    for v in &status.per_vcpu {
        eprintln!(
            "smp: vCPU {}: {} exits, waited {} us for the VM lock over {} takes",
            v.index,
            v.exits_total,
            v.lock_wait_ns / 1000,
            v.lock_takes
        );
    }
    checks.finish();
}
