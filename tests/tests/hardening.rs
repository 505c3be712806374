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
//! - **DMA**: bus mastering of the IDE controller stays off, its
//!   bus-master register block cannot be moved, and its PRD table register
//!   (which would point the controller's DMA anywhere) is out of reach.
//! - **Control-register values that would fail VM entry** (NW without CD)
//!   get #GP in the guest; **XSETBV** values that break the XCR0 rules get
//!   #GP; **GETSEC** gets #UD; **port accesses straddling the control
//!   UART** float where they touch it. Before, each of these stopped the VM.
//! - **String I/O on intercepted ports** (PM1 control, PCI configuration
//!   data) is emulated element by element instead of stopping the VM.
//!
//! - **The guest's stacks**: root keys return stacks by the stack a slot
//!   is on, read from the guest (THREAD_SIZE, each CPU's IRQ and exception
//!   stacks); the guest's own NMI handler and a hard irq_work run on the
//!   ranges root found.
//! - **Jumps into the entry trampoline with forged registers** are refused
//!   and counted, with no event; the guest goes where its forged pt_regs
//!   says.
//! - **Forged PDPT[510] at region setup**: the first hook request is served
//!   while the kernel's top-level table names a kernel-image page
//!   directory in hypervisor memory; it is refused, names the refused read, and
//!   the region is built over the real table afterwards.
//! - **Recovery inside a process that then exits**: recovery's last
//!   slices run in a busy loop, which is killed and its memory reused;
//!   a function-graph session over two sleepers then hooks, names the right
//!   tasks and returns every call (kernel walks use init_top_pgt).
//! - **A guest hardware breakpoint on a hooked page**: it fires for a read
//!   that root single-steps (root swallows only its own single-step).
//! - **Two hooked pages in one instruction**: a read across the boundary of
//!   two pages that both hold hooked functions completes (one step opens
//!   both pages) instead of alternating between them forever.
//!
//! Run: `cargo test -p hvtrace-tests --test hardening -- --nocapture`

use std::time::{Duration, Instant};

use hvtrace_tests::{
    guest_exec as exec, hv_call as call, hv_status as status, vm_lock, Checks, Detached,
};
use protocol::{Request, Response, SymbolInfo};

/// The first two traceable functions, in address order, whose fentry
/// sites lie on adjacent pages (the symbol index is in address order, so
/// this reads only as many pages of `syms` answers as it needs).
fn adjacent_traceable(c: &mut hvtrace::client::Client) -> Option<(SymbolInfo, SymbolInfo)> {
    let mut cursor = 0;
    let mut last: Option<SymbolInfo> = None;
    for _ in 0..200 {
        let req = Request::Syms {
            glob: "*".into(),
            kinds: "tT".into(),
            module: String::new(),
            cursor,
            limit: 1000,
        };
        let Response::Syms { next, symbols, .. } = call(c, req) else {
            return None;
        };
        for s in symbols.into_iter().filter(|s| s.site.is_some()) {
            if let Some(prev) = last.take() {
                let (p, q) = (prev.site.unwrap_or(0) >> 12, s.site.unwrap_or(0) >> 12);
                if q == p + 1 && s.site.unwrap_or(0) & 0xfff >= 16 {
                    return Some((prev, s));
                }
            }
            last = Some(s);
        }
        cursor = next?;
    }
    None
}

/// One instruction that reads across the boundary between two hooked code
/// pages: before, each page's step closed the other and the two steps
/// alternated forever (the guest hung in the read); now the step opens
/// both. Two probes on functions whose fentry sites lie on adjacent pages,
/// then the attacker reads 9 bytes starting 4 bytes before the boundary.
fn two_hooked_pages(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let page = |s: &SymbolInfo| s.site.unwrap_or(0) >> 12;
    let Some((a, b)) = adjacent_traceable(c) else {
        ck.check(false, "no two traceable functions on adjacent pages");
        return;
    };
    for (name, s) in [("pg_a", &a), ("pg_b", &b)] {
        match call(
            c,
            Request::ProbeAdd {
                spec: format!("p:{name} {}", s.name),
            },
        ) {
            Response::ProbeAdded { .. } => {}
            other => ck.check(false, format!("probe on {}: {other:?}", s.name)),
        }
    }
    let boundary = page(&b) << 12;
    let before = status(c).tracer;
    let t0 = Instant::now();
    let reply = c.call(
        Request::Exec {
            command: format!(
                "dmesg -c >/dev/null; insmod /lib/hvattack.ko func={:#x} 2>/dev/null; dmesg | grep 'hvattack: read' | head -n 1",
                boundary - 4
            ),
        },
        Duration::from_secs(120),
    );
    let took = t0.elapsed();
    println!(
        "two pages {} | {} at {boundary:#x}: {reply:?} in {took:?}",
        a.name, b.name
    );
    match reply.map(|r| r.response) {
        Ok(Response::Exec { output, .. }) => {
            ck.check(
                output.contains(&format!("hvattack: read {:x}: ", boundary - 4)),
                format!("the read across two hooked pages completed: {output:?}"),
            );
        }
        other => ck.check(
            false,
            format!("the read across two hooked pages hung: {other:?}"),
        ),
    }
    let after = status(c).tracer;
    ck.check(
        after.steps_widened > before.steps_widened,
        format!("one step opened both pages: {before:?} -> {after:?}"),
    );
    for name in ["pg_a", "pg_b"] {
        let _ = call(c, Request::ProbeDel { name: name.into() });
    }
}

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

/// Checks that a counter grew by at least `n`.
fn grew_by(ck: &mut Checks, what: &str, before: u64, after: u64, n: u64) {
    ck.check(after >= before + n, format!("{what}: {before} -> {after}"));
}

/// The first nonzero hex value after `key` on a line of `log`.
fn hex_after(log: &str, key: &str) -> Option<u64> {
    log.lines().find_map(|l| {
        let rest = &l[l.find(key)? + key.len()..];
        let v = u64::from_str_radix(rest.split_whitespace().next()?.trim_start_matches("0x"), 16)
            .ok()?;
        (v != 0).then_some(v)
    })
}

/// Runs the NMI storm; returns the stack pointer the guest's own NMI
/// handler saw.
fn nmi_storm(ck: &mut Checks, vm: &Detached, c: &mut hvtrace::client::Client) -> Option<u64> {
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
    hex_after(&log, "hvattack: nmi sp ")
}

/// The map of the guest's stacks that root keys return stacks by (logged
/// at recovery) against the guest's own view: `THREAD_SIZE` as compiled,
/// the stack pointer of a hard irq_work (on the CPU's IRQ stack) and of an
/// NMI (on its NMI exception stack) each inside the range root read for
/// that stack, and the task's own stack outside every per-CPU one.
fn stack_map(ck: &mut Checks, vm: &Detached, c: &mut hvtrace::client::Client, nmi_sp: Option<u64>) {
    let log = attack(c, "stacks=1");
    println!("stacks:\n{log}");
    let output = vm.emulator_output();
    let Some(line) = output
        .lines()
        .find(|l| l.contains("introspection: stacks: THREAD_SIZE"))
    else {
        ck.check(false, "root logged the guest's stacks at recovery");
        return;
    };
    println!("{line}");
    // "; cpu N KIND A-B"
    let ranges: Vec<(String, u64, u64)> = line
        .split("; cpu ")
        .skip(1)
        .filter_map(|seg| {
            let mut w = seg.split_whitespace().skip(1);
            let kind = w.next()?.to_string();
            let (a, b) = w.next()?.split_once('-')?;
            let p = |x: &str| u64::from_str_radix(x.trim_start_matches("0x"), 16).ok();
            Some((kind, p(a)?, p(b)?))
        })
        .collect();
    let inside = |kind: &str, sp: u64| {
        ranges
            .iter()
            .any(|(k, a, b)| k == kind && (*a..*b).contains(&sp))
    };
    let ts = hex_after(&log, "thread_size ");
    ck.check(
        ts.is_some_and(|t| line.contains(&format!("THREAD_SIZE {t:#x} (kallsyms)"))),
        format!("THREAD_SIZE from kallsyms equals the guest's: {ts:?}"),
    );
    let irq_sp = hex_after(&log, "irq_sp ");
    ck.check(
        irq_sp.is_some_and(|sp| inside("irq", sp)),
        format!("a hard irq_work ran on the IRQ stack root found: sp {irq_sp:x?} in {ranges:x?}"),
    );
    ck.check(
        nmi_sp.is_some_and(|sp| inside("NMI", sp)),
        format!("an NMI ran on the NMI stack root found: sp {nmi_sp:x?} in {ranges:x?}"),
    );
    for name in ["DF", "DB", "MCE"] {
        ck.check(
            ranges.iter().any(|(k, _, _)| k == name),
            format!("root found the {name} stack"),
        );
    }
    let task = hex_after(&log, "task ");
    ck.check(
        task.is_some_and(|t| {
            ts.is_some_and(|ts| t % ts == 0)
                && !ranges.iter().any(|(_, a, b)| (*a..*b).contains(&t))
        }),
        format!("the task's stack is a THREAD_SIZE block of its own: {task:x?}"),
    );
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

/// A guest hardware breakpoint on a hooked function's first byte, hit by a
/// read that root single-steps (the page is hooked): the guest's #DB must
/// reach it, with root's own single-step swallowed.
fn guest_breakpoint_on_hooked_page(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let func = "do_sys_openat2";
    match call(
        c,
        Request::ProbeAdd {
            spec: format!("p:hwbp {func}"),
        },
    ) {
        Response::ProbeAdded { .. } => {}
        other => {
            ck.check(false, format!("probe for the breakpoint test: {other:?}"));
            return;
        }
    }
    let line = exec(c, &format!("grep ' {func}$' /proc/kallsyms"));
    let addr = line.split_whitespace().next().unwrap_or("0").to_string();
    let steps = status(c).tracer.steps;
    let log = attack(c, &format!("func=0x{addr} hwbp=1"));
    println!("breakpoint:\n{log}");
    ck.check(
        log.contains(&format!(
            "hvattack: hw breakpoint on {addr}: 1 hits (read ok)"
        )),
        format!("the guest's breakpoint fired once per read of the hooked page: {log:?}"),
    );
    ck.check(
        status(c).tracer.steps > steps,
        "the read of the hooked page was single-stepped by root",
    );
    let _ = call(
        c,
        Request::ProbeDel {
            name: "hwbp".into(),
        },
    );
    alive(ck, c, "a guest breakpoint on a hooked page");
}

/// Where the forged PDPT entry points the kernel image's page directory:
/// 16 MiB, inside the hypervisor's reserved memory (2 to 32 MiB).
const FORGED_PD: u64 = 0x100_0000;

/// How long the attacker holds the forge, in the guest's seconds: time for
/// the host to see the forge and send the request that sets up the region.
/// In Bochs a guest second here takes about three seconds of wall time (a
/// busy loop keeps the emulated CPU from idling), and a loaded host slows
/// the guest's clock along with everything else.
const FORGE_HOLD_S: u32 = 5;

/// Forged PDPT[510] at region setup: while the first hook request of the
/// boot is served, the kernel's own top-level table (the one root walks to
/// read the kernel and to place the trampolines) names a PDPT whose
/// kernel-image entry points into hypervisor memory. Root must neither
/// read that memory as a table nor write its PDE there or map it for the
/// guest: the request fails and names the refused read, the region is not
/// built, and the next hook request (the sleepers' graph) builds it over
/// the real page directory once the forge is undone.
fn forged_pdpt_at_region_setup(ck: &mut Checks, vm: &Detached, c: &mut hvtrace::client::Client) {
    ck.eq(
        "no trampoline region before the first hook",
        status(c).tracer.trampolines,
        0,
    );
    let pgd = exec(c, "grep ' init_top_pgt$' /proc/kallsyms");
    let Some(pgd) = hvtrace_tests::kallsyms_address(&pgd) else {
        ck.check(false, format!("init_top_pgt in /proc/kallsyms: {pgd:?}"));
        return;
    };
    let Some(console) = vm.run_dir.as_ref().map(|d| d.join("console.log")) else {
        ck.check(false, "the run directory is known");
        return;
    };
    let seen_before = std::fs::read_to_string(&console)
        .unwrap_or_default()
        .matches("hvattack: pdpt forged")
        .count();
    let mut attacker = vm.client();
    let cmd = format!(
        "dmesg -c >/dev/null; insmod /lib/hvattack.ko forge_pgd={pgd:#x} forge_pd={FORGED_PD:#x} \
         forge_hold={FORGE_HOLD_S} 2>&1; rmmod hvattack; dmesg | grep hvattack: || true"
    );
    let forger = std::thread::spawn(move || exec(&mut attacker, &cmd));
    // The module prints its line on COM1 once the forge is in place.
    let deadline = Instant::now() + Duration::from_secs(180);
    let in_place = loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if text.matches("hvattack: pdpt forged").count() > seen_before {
            break true;
        }
        if Instant::now() > deadline || forger.is_finished() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    ck.check(in_place, "the attacker announced the forge on the console");
    let answer = call(
        c,
        Request::ProbeAdd {
            spec: "p:forged_pd ksys_sync".into(),
        },
    );
    let log = forger.join().unwrap_or_default();
    println!("forged PDPT[510]: first hook request -> {answer:?}\n{log}");
    ck.check(
        log.contains("restored"),
        format!("the attacker held the forge and undid it: {log:?}"),
    );
    // Root walks the kernel's table through its one guarded door: the
    // first read through the forged entry, of the function's own bytes, is
    // refused before any region setup (which checks the page directory
    // again before writing to it).
    match &answer {
        Response::Error { message, .. } => {
            let denied = hex_after(message, "guest-physical ");
            ck.check(
                message.contains("cannot be probed")
                    && denied.is_some_and(|a| (FORGED_PD..FORGED_PD + 4096).contains(&a)),
                format!("the refusal names a read of the forged page directory: {message:?}"),
            );
        }
        other => ck.check(
            false,
            format!(
                "the hook request made while the PDPT was forged must be refused, got {other:?} \
                 (if the probe was added, root read the forged table, or the forge was over \
                 before the request was served)"
            ),
        ),
    }
    ck.eq(
        "no trampoline region after the refusal",
        status(c).tracer.trampolines,
        0,
    );
    alive(ck, c, "a forged PDPT at region setup");
}

/// Recovery ran inside a busy process (its last slices walked that
/// process's page tables); the process has exited and its memory has been
/// reused. Root's kernel walks use the kernel's own top-level table, so a
/// graph session over sleepers still hooks, sees the right tasks and
/// returns every hijacked call: no #UD, no oops, no orphan.
fn sleepers_after_recovery_in_a_dead_process(
    ck: &mut Checks,
    vm: &Detached,
    c: &mut hvtrace::client::Client,
    busy: &str,
) {
    let log = vm.emulator_output();
    let ended = log
        .lines()
        .find(|l| l.contains("introspection: recovery ended in pid"))
        .unwrap_or("")
        .to_string();
    // The task that recovery's last slice interrupted is usually the busy
    // loop, sometimes a kernel thread that borrowed its page tables (lazy
    // TLB); either way a user address space's CR3, not the kernel's own
    // table.
    let kernel_pgd = hex_after(&log, "kernel walks use init_top_pgt at guest-physical ");
    let cr3 = hex_after(&ended, "CR3 ");
    println!("recovery: {ended} (busy loop: pid {busy}; init_top_pgt at {kernel_pgd:x?})");
    ck.check(
        cr3.zip(kernel_pgd)
            .is_some_and(|(c, k)| c & 0x000f_ffff_ffff_e000 != k & 0x000f_ffff_ffff_e000),
        format!("recovery ran through a task's page tables, not the kernel's: {ended:?}"),
    );
    exec(
        c,
        &format!(
            "kill {busy}; wait; dd if=/dev/zero of=/tmp/fill bs=1M count=16 2>/dev/null; rm /tmp/fill; echo 3 >/proc/sys/vm/drop_caches"
        ),
    );
    let before = status(c).tracer;
    let mut stream = hvtrace_tests::Stream::new();
    let _ = stream.read(c);
    let session = match call(
        c,
        Request::GraphStart(protocol::GraphFilter {
            functions: vec!["do_nanosleep".into()],
            trace: vec!["do_nanosleep".into(), "hrtimer_*".into()],
            ..protocol::GraphFilter::default()
        }),
    ) {
        Response::GraphStarted {
            session, hooked, ..
        } => {
            ck.check(
                hooked > 1,
                format!("the session hooked its functions: {hooked}"),
            );
            Some(session)
        }
        other => {
            ck.check(
                false,
                format!("graph start after the process exited: {other:?}"),
            );
            None
        }
    };
    exec(c, "hvbench sleep 200 & hvbench sleep 300 & wait");
    let text = stream.read(c);
    let stop = Request::GraphStop { session };
    ck.check(
        session.is_some() && call(c, stop) == Response::Ok,
        "graph stop",
    );
    let opens = text.matches("do_nanosleep() {").count();
    let tasks: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split("=> ").nth(1))
        .map(str::trim)
        .collect();
    println!("sleepers after recovery in a dead process: {opens} trees, tasks {tasks:?}");
    ck.check(
        opens >= 2,
        format!("both sleepers' trees were traced: {opens}"),
    );
    ck.check(
        tasks.iter().filter(|t| t.starts_with("hvbench-")).count() >= 2,
        format!("the trees belong to the sleepers: {tasks:?}"),
    );
    let after = status(c).tracer;
    ck.eq(
        "no orphan returns",
        after.graph_orphans,
        before.graph_orphans,
    );
    ck.eq("no frame reaped", after.graph_reaped, before.graph_reaped);
    ck.eq("no frame left", after.graph_frames, 0);
    let dmesg = exec(c, "dmesg | grep -ciE 'invalid opcode|oops|BUG:' || true");
    ck.eq("no oops in the guest", dmesg.trim(), "0");
}

/// Hits of probe `name`.
fn probe_hits(c: &mut hvtrace::client::Client, name: &str) -> Option<u64> {
    match call(c, Request::ProbeList) {
        Response::Probes(p) => p.iter().find(|p| p.name == name).map(|p| p.hits),
        _ => None,
    }
}

/// Jumps into the entry trampoline's VMCALL with forged registers: a
/// pt_regs whose ip is not the site's, RDI not equal to RSP, a site that
/// is not hooked. Root refuses each (counted, no event), the guest goes on
/// wherever its forged pt_regs says (here, back into the module), and real
/// calls of the hooked function are still traced.
fn forged_trampoline_entries(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let (name, site) = match call(
        c,
        Request::ProbeAdd {
            spec: "p:forged ksys_sync".into(),
        },
    ) {
        Response::ProbeAdded { name, site } => (name, site),
        other => {
            ck.check(false, format!("probe for the forged entries: {other:?}"));
            return;
        }
    };
    let before = status(c).tracer;
    let vmcall = trampolines::TrampolineRegion::build(
        trampolines::Gva(before.trampolines),
        trampolines::HypercallMode::Vmcall,
    )
    .ok()
    .and_then(|r| r.entry_vmcall());
    let Some(vmcall) = vmcall else {
        ck.check(
            false,
            format!(
                "the entry VMCALL of the region at {:#x}",
                before.trampolines
            ),
        );
        return;
    };
    let hits = probe_hits(c, &name);
    ck.check(hits.is_some(), format!("probe {name} is listed"));
    let log = attack(
        c,
        &format!(
            "forge_entry={:#x} forge_site={site:#x} forge_rax={:#x}",
            vmcall.0,
            trampolines::abi::HYPERCALL_ENTRY
        ),
    );
    println!("forged entries:\n{log}");
    for n in 1..=3 {
        ck.check(
            log.contains(&format!("hvattack: forged entry {n} (")),
            format!("forged entry {n} came back into the module: {log:?}"),
        );
    }
    let after = status(c).tracer;
    grew_by(
        ck,
        "the forged entries are counted",
        before.forged_entries,
        after.forged_entries,
        3,
    );
    ck.eq("no event from a forged entry", probe_hits(c, &name), hits);
    ck.eq(
        "forged entries are not counted as hits",
        after.hits,
        before.hits,
    );
    exec(c, "sync");
    let real = probe_hits(c, &name);
    ck.check(
        real.zip(hits).is_some_and(|(r, h)| r > h),
        format!("a real call of the hooked function is still traced: {hits:?} -> {real:?}"),
    );
    ck.eq(
        "a real call is not counted as forged",
        status(c).tracer.forged_entries,
        after.forged_entries,
    );
    let _ = call(c, Request::ProbeDel { name });
    alive(ck, c, "forged trampoline entries");
}

fn bad_instructions(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let before = status(c).guard;
    let log = attack(
        c,
        "cr0_nw=1 bad_xsetbv=1 getsec=1 straddle=1 apic_base=1 pci_dma=1",
    );
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
    ck.check(
        log.contains("bus master refused") && !log.contains("bus master enabled"),
        format!("the IDE controller's bus mastering stays off: {log:?}"),
    );
    ck.check(
        log.contains("-> d001: refused") && !log.contains("-> d001: moved"),
        format!("the bus-master BAR stays put: {log:?}"),
    );
    ck.check(
        log.contains("ide prd table register reads ffffffff"),
        format!("the PRD table register is out of the guest's reach: {log:?}"),
    );
    let after = status(c).guard;
    ck.check(
        after.pci_writes_refused >= before.pci_writes_refused + 2,
        format!("refused PCI writes counted: {after:?}"),
    );
    ck.check(
        after.dma_port_writes_blocked > before.dma_port_writes_blocked,
        "blocked bus-master register writes counted",
    );
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

/// String I/O on ports root intercepts (ACPI PM1 control, PCI
/// configuration data) is emulated one element per exit: it moves the same
/// data as plain IN and OUT, and the VM keeps running. Before, the first
/// INS or OUTS on such a port stopped the VM.
fn string_io(ck: &mut Checks, c: &mut hvtrace::client::Client) {
    let ioports = exec(c, "grep PM1a_CNT_BLK /proc/ioports");
    let Some(port) = ioports
        .split_whitespace()
        .next()
        .and_then(|r| r.split('-').next())
        .and_then(|p| u16::from_str_radix(p, 16).ok())
    else {
        ck.check(
            false,
            format!("the guest lists its PM1a control block: {ioports:?}"),
        );
        return;
    };
    let before = status(c).guard;
    let log = attack(c, &format!("pm1_string={port}"));
    println!("string I/O:\n{log}");
    let field = |line: &str, key: &str, n: usize| -> Option<String> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().nth(n).map(str::to_string)
    };
    let pm1 = log
        .lines()
        .find(|l| l.contains("hvattack: pm1 ") && l.contains("rep insw"));
    match pm1 {
        Some(l) => {
            let plain = field(l, "hvattack: pm1", 0);
            ck.check(
                plain.is_some()
                    && field(l, "rep insw", 0) == plain
                    && field(l, "rep insw", 1) == plain
                    && l.ends_with("left 0"),
                format!("rep insw from PM1 reads what inw reads, twice: {l:?}"),
            );
            let after = log.lines().find(|l| l.contains("hvattack: pm1 after outs"));
            ck.check(
                after.is_some_and(|a| field(a, "after outs", 0) == plain && a.ends_with("left 0")),
                format!("outsw and rep outsb of PM1's own value leave it as it was: {after:?}"),
            );
        }
        None => ck.check(false, format!("the string I/O attack ran: {log:?}")),
    }
    let pci = log.lines().find(|l| l.contains("hvattack: pci id"));
    ck.check(
        pci.is_some_and(|l| {
            let id = field(l, "pci id", 0);
            id.is_some() && field(l, "rep insl", 0) == id && field(l, "rep insl", 1) == id
        }),
        format!("rep insl from PCI configuration data reads the host bridge's id, twice: {pci:?}"),
    );
    let after = status(c).guard;
    grew_by(
        ck,
        "seven string elements emulated",
        before.string_io_emulated,
        after.string_io_emulated,
        7,
    );
    alive(ck, c, "string I/O on intercepted ports");
}

#[test]
fn hostile_guest_fast_lane() {
    let _l = vm_lock();
    let initrd = hvtrace::vm::guest::run_script("scripts/guest/attacker.sh")
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
    // The first request starts recovery: let a busy process be what runs.
    let busy = exec(
        &mut c,
        "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!",
    )
    .trim()
    .to_string();
    // Recovery ran (status needs it) and moved the kernel walks onto the
    // kernel's own top-level table, cross-checked against the CR3 it came
    // through; a task's CR3 would be freed when the task exits.
    ck.check(status(&mut c).kernel.is_some(), "the kernel was recovered");
    ck.check(
        vm.emulator_output()
            .contains("kernel walks use init_top_pgt at guest-physical"),
        "kernel walks use init_top_pgt",
    );
    // `current`, its pid and its name are read through the kernel's
    // linear maps, both found and checked against walks (the pids and
    // names every probe line carries are checked against the guest's own
    // events in the kprobes tests).
    let log = vm.emulator_output();
    let linear = log
        .lines()
        .find(|l| l.contains("introspection: linear maps:"))
        .unwrap_or("");
    println!("{linear}");
    ck.check(
        linear.contains("direct map 0xffff")
            && linear.contains("image 0xffffffff")
            && !linear.contains("not used"),
        format!("both linear maps found and checked: {linear:?}"),
    );
    forged_pdpt_at_region_setup(&mut ck, &vm, &mut c);
    sleepers_after_recovery_in_a_dead_process(&mut ck, &vm, &mut c, &busy);
    bad_instructions(&mut ck, &mut c);
    string_io(&mut ck, &mut c);
    forge_debug_port(&mut ck, &mut c);
    guest_breakpoint_on_hooked_page(&mut ck, &mut c);
    forged_trampoline_entries(&mut ck, &mut c);
    let nmi_sp = nmi_storm(&mut ck, &vm, &mut c);
    stack_map(&mut ck, &vm, &mut c, nmi_sp);
    two_hooked_pages(&mut ck, &mut c);
    alive(&mut ck, &mut c, "the read across two hooked pages");
    let (rc, out, err) = vm.cli(&["stop"]);
    ck.eq("stop succeeds", rc, 0);
    let text = format!("{out}{err}");
    ck.check(
        text.contains("stopped by the host") && !text.contains("forged"),
        format!("the VM stops for the real reason: {text:?}"),
    );
    ck.finish();
}
