//! A hostile guest kernel against VMX root, on one fast-lane boot with the
//! attacker module (`guest/attacker/hvattack.c`) in the initramfs. Each
//! attack is one `insmod` with its own parameter; after each, the guest
//! must still answer and the hypervisor must have counted what it refused.
//!
//! - **NMI storm into root**: the guest writes an interrupt gate of its own
//!   at guest-physical 0x20 (vector 2 of an IDT based at 0, where root's
//!   IDT base used to point), routes the PIT to NMI through the IOAPIC at
//!   about 6 kHz and makes root run most of the time (a CPUID loop). The
//!   gate must never run in root (it would print a line on port 0xE9); the
//!   NMIs must reach the guest (its own NMI count grows) through NMI exits
//!   and injection.
//! - **Port 0xE9 forging**: forged `hvtrace: error:` and `guest stopped:`
//!   lines are dropped and counted; the VM keeps running and stops later
//!   for the real reason.
//! - **The LAPIC window moved into hypervisor memory** (IA32_APIC_BASE =
//!   31 MiB) gets #GP and the base stays where it was.
//! - **Control-register values that would fail VM entry** (NW without CD)
//!   get #GP in the guest; **XSETBV** values that break the XCR0 rules get
//!   #GP; **GETSEC** gets #UD; **port accesses straddling the control
//!   UART** float where they touch it. Before, each of these stopped the VM.
//!
//! Run: `cargo test -p hvtrace-tests --test hardening -- --nocapture`

use hvtrace_tests::{guest_exec as exec, hv_status as status, vm_lock, Checks, Detached};

/// The guest's NMI count (the `NMI:` line of /proc/interrupts).
fn guest_nmis(c: &mut hvtrace::client::Client) -> u64 {
    let text = exec(c, "grep NMI: /proc/interrupts");
    text.split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Loads the attacker with `params` and returns its `hvattack:` lines, each
/// once (the kernel also prints them on the console the shell runs on, and
/// busybox insmod runs the module's init a second time when the first
/// load fails, which the module always makes it do: two runs, two
/// timestamps).
fn attack(c: &mut hvtrace::client::Client, params: &str) -> String {
    let out = exec(
        c,
        &format!("dmesg -c >/dev/null; insmod /lib/hvattack.ko {params} 2>/dev/null; dmesg | grep hvattack: || true"),
    );
    let mut lines: Vec<&str> = out
        .lines()
        .map(str::trim)
        .filter(|l| l.contains("hvattack:"))
        .collect();
    lines.sort_unstable();
    lines.dedup();
    lines.join("\n")
}

fn alive(ck: &mut Checks, c: &mut hvtrace::client::Client, after: &str) {
    let out = exec(c, "echo alive");
    ck.eq(&format!("guest answers after {after}"), out.trim(), "alive");
}

fn nmi_storm(ck: &mut Checks, vm: &Detached, c: &mut hvtrace::client::Client) {
    let nmis_before = guest_nmis(c);
    let before = status(c).guard;
    let log = attack(c, "nmi_storm=40");
    println!("nmi storm:\n{log}");
    ck.check(
        log.contains("hvattack: nmi storm: 40000 exits"),
        format!("the storm ran: {log:?}"),
    );
    let after = status(c).guard;
    let nmis_after = guest_nmis(c);
    println!(
        "guard before {before:?}\nguard after {after:?}\nguest NMIs {nmis_before} -> {nmis_after}"
    );
    let output = vm.emulator_output();
    ck.check(vm.run_dir.is_some(), "run --detach named its run directory");
    ck.check(
        !output.contains("NMI gate ran in VMX root"),
        "the guest's gate at guest-physical 0x20 never ran in VMX root",
    );
    let arrived = (after.nmi_exits - before.nmi_exits) + (after.nmis_in_root - before.nmis_in_root);
    ck.check(
        arrived >= 20,
        format!("NMIs arrived during the storm: {arrived}"),
    );
    ck.check(
        after.nmis_in_root > before.nmis_in_root,
        format!(
            "some NMIs hit root itself and were taken through root's IDT: {}",
            after.nmis_in_root - before.nmis_in_root
        ),
    );
    let injected = after.nmis_injected - before.nmis_injected;
    ck.check(
        injected >= 20,
        format!("NMIs injected into the guest: {injected}"),
    );
    ck.check(
        nmis_after - nmis_before >= injected.saturating_sub(1),
        format!(
            "the guest counted the injected NMIs: {} for {injected}",
            nmis_after - nmis_before
        ),
    );
    alive(ck, c, "the NMI storm");
}

fn forge_debug_port(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let before = status(c).guard.debug_port_writes;
    let log = attack(c, "forge_e9=1");
    ck.check(
        log.contains("hvattack: forged"),
        format!("forging ran: {log:?}"),
    );
    let after = status(c).guard.debug_port_writes;
    ck.check(
        after - before >= 70,
        format!(
            "guest writes to port 0xE9 dropped and counted: {}",
            after - before
        ),
    );
    alive(ck, c, "forged log lines");
}

fn bad_instructions(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let before = status(c).guard;
    let log = attack(c, "cr0_nw=1 bad_xsetbv=1 getsec=1 straddle=1 apic_base=1");
    println!("instructions:\n{log}");
    ck.check(
        log.contains("hvattack: cr0 NW without CD raised #GP"),
        format!("CR0 NW without CD gets #GP: {log:?}"),
    );
    for value in [
        "xsetbv 27 raised #GP",
        "xsetbv f raised #GP",
        "xsetbv 20007 raised #GP",
    ] {
        ck.check(log.contains(value), format!("{value}: {log:?}"));
    }
    ck.check(
        !log.contains("was accepted"),
        format!("no bad value was accepted: {log:?}"),
    );
    let refused_lines = log.matches("raised #GP (xcr0 now").count() as u64;
    ck.check(
        log.contains("hvattack: getsec raised #UD"),
        format!("GETSEC gets #UD: {log:?}"),
    );
    ck.check(
        log.contains("hvattack: straddling inl(0x2f6) = ffffffff"),
        format!("a read straddling the control UART floats: {log:?}"),
    );
    ck.check(
        log.contains("-> 1f00900 raised #GP (read back fee00900)"),
        format!("moving the LAPIC window into hypervisor memory gets #GP: {log:?}"),
    );
    let after = status(c).guard;
    ck.check(
        after.apic_moves_refused > before.apic_moves_refused,
        "the refused LAPIC move is counted",
    );
    ck.check(
        after.cr_writes_refused > before.cr_writes_refused,
        "the refused CR0 write is counted",
    );
    ck.eq(
        "refused XSETBVs counted, one per #GP the guest saw",
        after.xsetbv_refused - before.xsetbv_refused,
        refused_lines,
    );
    alive(ck, c, "the bad instructions");
}

#[test]
fn hostile_guest_fast_lane() {
    let _l = vm_lock();
    let initrd = hvtrace::guest::run_script("scripts/guest/attacker.sh")
        .expect("building the attacker module failed");
    let vm = Detached::start_with(
        "fast",
        "hardening",
        &[
            "--initrd",
            initrd.to_str().expect("initrd path is not UTF-8"),
        ],
    );
    let mut c = vm.client();
    let mut ck = Checks::new();
    bad_instructions(&mut ck, &mut c);
    forge_debug_port(&mut ck, &mut c);
    nmi_storm(&mut ck, &vm, &mut c);
    let (rc, out, err) = vm.cli(&["stop"]);
    ck.eq("stop succeeds", rc, 0);
    let text = format!("{out}{err}");
    ck.check(
        text.contains("stopped by the host") && !text.contains("forged"),
        format!("the VM stops for the real reason: {text:?}"),
    );
    ck.finish();
}
