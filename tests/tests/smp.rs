//! A guest with two vCPUs under the hypervisor in Bochs (`--cpus 2`), on
//! one detached boot of the fast-lane kernel (Debian's is in
//! `smp_debian.rs`):
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
//!   VM lock (the VM's exits are their sum);
//! - tracing on both vCPUs: our probe and the guest's own kprobe on the
//!   same function record the same events for tasks pinned to CPU 0 and
//!   CPU 1, with the same CPU column (the guest's own numbers);
//! - a function-graph session over sleepers pinned to each CPU gives each
//!   its tree, on its own CPU, and a `dd` read on each CPU at once gives
//!   each CPU's tree under `vfs_read` equal to the guest's own
//!   function_graph's for that CPU;
//! - a sleeper moved from CPU 0 to CPU 1 while asleep in a traced function
//!   returns through us once, on CPU 1, with its whole sleep as duration,
//!   and the callee it makes after its wake is traced there (the quiet
//!   views arm CPU 1 when it comes in);
//! - a getppid loop on CPU 1 outside a session's root costs no exits
//!   while a dd read on CPU 0 inside it is traced (the quiet views);
//! - hotplug with a probe and a graph session on, and a probe added and
//!   removed while CPU 1 is offline (parked vCPUs are not waited for);
//! - the attacker module reads a hooked function 3,000 times on CPU 0
//!   while CPU 1 calls it: every read sees the NOP5 and every call is
//!   traced;
//! - patching under fire, with both CPUs calling the function and the
//!   guest toggling its own kprobe and function tracer on it;
//! - the function tracer on `'*'` with a workload on each CPU: the guest
//!   lives, both vCPUs hit, losses are reported per vCPU;
//! - the hostile guest on CPU 1 while CPU 0 traces (`hostile_on_cpu1`):
//!   the hardening attacks, a fetch from hypervisor memory, a step storm
//!   under a fast timer with the reader moving between CPUs, INIT through
//!   the IOAPIC and LINT0; the guest's log stays clean and CPU 1 still
//!   hotplugs.
//!
//! Run: `cargo test --release -p hvtrace-tests --test smp -- --nocapture`

mod smp_common;

use hvtrace::client::Client;
use hvtrace_tests::{
    guest_exec, guest_vfs_read_graph, hv_call, hv_status, parse_graph, vm_lock, Checks, Detached,
    Node, Stream, TRACEFS, TRACE_SET,
};
use protocol::{Request, Response, TraceFormat};
use smp_common::{
    boot_checks, cpu_column, graph_start, graph_start_with, graph_stop, print_lock_waits,
    print_vcpus, probe_add, probe_del, probe_hits, probe_oracle_across_cpus, settled_status,
};

/// A task sleeps in a traced function on CPU 0 and is moved to CPU 1
/// while asleep: it returns through us once, on CPU 1, after its whole
/// sleep, and no frame is left. The session traces `hrtimer_cancel`
/// beneath the root (depth 2), which the quiet views leave unhooked
/// outside it: do_nanosleep calls it once the sleep is over, on CPU 1,
/// which the scheduler hook must have armed when the sleeper came in.
fn migrating_sleeper(ck: &mut Checks, c: &mut Client) {
    let Some(session) = graph_start_with(
        ck,
        c,
        protocol::GraphFilter {
            functions: vec!["do_nanosleep".into()],
            trace: vec!["do_nanosleep".into(), "hrtimer_cancel".into()],
            max_depth: 2,
            ..protocol::GraphFilter::default()
        },
    ) else {
        return;
    };
    let status = hv_status(c);
    let st = status.tracer;
    ck.check(
        st.switch_hook && st.quiet_pages + st.quiet_partial >= 1,
        format!(
            "hrtimer_cancel's page is quiet: {} quiet pages, {} partly, scheduler hook {}",
            st.quiet_pages, st.quiet_partial, st.switch_hook
        ),
    );
    let switches = |s: &protocol::StatusReport| -> Vec<u64> {
        s.per_vcpu.iter().map(|v| v.view_switches).collect()
    };
    let switches_before = switches(&status);
    let mut json = Stream::of(session, TraceFormat::Json, 0);
    let _ = json.read(c);
    let out = guest_exec(
        c,
        "taskset 1 hvbench sleep 1500 & p=$!; hvbench sleep 400; \
         echo CPU $(cut -d' ' -f39 /proc/$p/stat); taskset -p 2 $p > /dev/null; wait $p; echo PID $p",
    );
    let text = json.read(c);
    let switches_after = switches(&hv_status(c));
    graph_stop(ck, c, session);
    // CPU 1 was quiet, armed when the sleeper came in, and quiet again
    // after its root returned: two moves at least.
    let moved = switches_after
        .get(1)
        .zip(switches_before.get(1))
        .map_or(0, |(a, b)| a - b);
    ck.check(
        moved >= 2,
        format!("CPU 1 moved between its views for the sleeper: {moved} moves"),
    );
    let pid: i32 = out
        .split("PID ")
        .nth(1)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(-1);
    ck.check(
        out.contains("CPU 0"),
        format!("the sleeper was not asleep on CPU 0: {out}"),
    );
    let num = |l: &str, key: &str| -> Option<u64> {
        let at = l.find(&format!("\"{key}\":"))? + key.len() + 3;
        l[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .ok()
    };
    let mine: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&format!("\"pid\":{pid},")))
        .collect();
    let of = |kind: &str, func: &str| -> Vec<&&str> {
        mine.iter()
            .filter(|l| l.contains(kind) && l.contains(&format!("\"func\":\"{func}\"")))
            .collect()
    };
    let entries = of("graph_entry", "do_nanosleep");
    let returns = of("graph_return", "do_nanosleep");
    ck.eq("the sleeper's entries", entries.len(), 1);
    ck.eq("the sleeper's returns", returns.len(), 1);
    let cancels = of("graph_entry", "hrtimer_cancel");
    ck.eq(
        "hrtimer_cancel beneath the sleeper's root, after its wake",
        cancels.len(),
        1,
    );
    if let Some(e) = cancels.first() {
        ck.eq(
            "hrtimer_cancel's CPU (armed at the switch)",
            num(e, "cpu"),
            Some(1),
        );
    }
    if let (Some(e), Some(r)) = (entries.first(), returns.first()) {
        ck.eq("the sleeper's entry CPU", num(e, "cpu"), Some(0));
        ck.eq("the sleeper's return CPU", num(r, "cpu"), Some(1));
        let d = num(r, "duration_ns").unwrap_or(0);
        ck.check(
            (1_400_000_000..4_000_000_000).contains(&d),
            format!("the sleeper's duration: {d} ns for a 1.5 s sleep"),
        );
    }
    let st = hv_status(c).tracer;
    ck.eq("return frames left after the move", st.graph_frames, 0);
    println!("smp migrating sleeper: {}", mine.join(" | "));
}

/// Patching under fire: busy loops on both CPUs call a function while
/// the host hooks and unhooks it ten times (a probe, the function tracer
/// and a graph session in turn) and the guest turns its own kprobe and
/// function tracer on and off on the same function. Last of the tracing
/// checks: the records of the hits are left to drain (COM2 carries about
/// 100 lines a second), so hits are counted from the counters.
fn patching_under_fire(ck: &mut Checks, c: &mut Client) {
    const ROUNDS: usize = 9;
    const FUNC: &str = "__x64_sys_getppid";
    let start = hv_status(c);
    let held_before = start.per_vcpu.get(1).map_or(0, |v| v.held_ns);
    guest_exec(
        c,
        &format!(
            "rm -f /tmp/stop; for m in 1 2; do taskset $m sh -c 'while [ ! -e /tmp/stop ]; do hvbench getppid 2000 > /dev/null; done' > /dev/null 2>&1 & done; \
             taskset 1 sh -c 'cd {TRACEFS}; echo p:gk {FUNC} > kprobe_events; while [ ! -e /tmp/stop ]; do \
               echo 1 > events/kprobes/gk/enable; echo {FUNC} > set_ftrace_filter; echo function > current_tracer; hvbench sleep 40; \
               echo nop > current_tracer; echo 0 > events/kprobes/gk/enable; hvbench sleep 40; done' > /dev/null 2>&1 & \
             hvbench sleep 300; echo started"
        ),
    );
    let mut per_round = Vec::new();
    let mut per_vcpu_rounds = Vec::new();
    let mut hits_per_vcpu = [0u64; 2];
    let mut prev = settled_status(ck, c, "before the rounds");
    for round in 0..ROUNDS {
        let hits0 = hv_status(c).tracer.hits;
        let mut session = None;
        let what = match round % 3 {
            0 => {
                if !probe_add(ck, c, &format!("p:fire {FUNC}")) {
                    break;
                }
                "probe"
            }
            1 => {
                let r = hv_call(c, Request::FunctionAdd { glob: FUNC.into() });
                ck.check(
                    matches!(r, Response::FunctionAdded { traced: 1, .. }),
                    format!("function tracer on {FUNC}: {r:?}"),
                );
                "function"
            }
            _ => {
                session = graph_start(ck, c, FUNC);
                if session.is_none() {
                    break;
                }
                "graph"
            }
        };
        guest_exec(c, "hvbench sleep 200");
        let hits = hv_status(c).tracer.hits - hits0;
        ck.check(
            hits > 0,
            format!("round {round} ({what}): no hit while both CPUs call {FUNC}"),
        );
        if what == "probe" {
            ck.check(
                probe_hits(c, "fire") > 0,
                format!("round {round}: the probe counted no hit"),
            );
            probe_del(ck, c, "fire");
        } else if what == "function" {
            let r = hv_call(c, Request::FunctionClear);
            ck.check(matches!(r, Response::Ok), format!("function clear: {r:?}"));
        } else if let Some(s) = session {
            graph_stop(ck, c, s);
        }
        per_round.push((hits, what));
        // Unhooked: each vCPU's VMCALL exits of the round are its hits,
        // its returns and the calls refused (in flight at the unhook),
        // and nothing else (`settled_status`); a graph call exits exactly
        // twice (every hijacked call returned through us), a probe or
        // function hit once.
        let now = settled_status(ck, c, &format!("round {round} ({what})"));
        let mut line = Vec::new();
        let (mut all_hits, mut all_returns) = (0, 0);
        for (a, b) in now.per_vcpu.iter().zip(&prev.per_vcpu) {
            let (hits, returns, refused) = (
                a.hits - b.hits,
                a.returns - b.returns,
                a.refused - b.refused,
            );
            if let Some(h) = hits_per_vcpu.get_mut(a.index as usize) {
                *h += hits;
            }
            all_hits += hits;
            all_returns += returns;
            line.push(format!(
                "vCPU {}: {} VMCALLs = {hits} hits + {returns} returns + {refused} refused",
                a.index,
                a.vmcalls - b.vmcalls
            ));
        }
        // (A call may return on another vCPU than it entered on, so the
        // returns are matched over all of them.)
        ck.eq(
            &format!("round {round} ({what}): returns through us"),
            all_returns,
            if what == "graph" { all_hits } else { 0 },
        );
        per_vcpu_rounds.push(format!("{what}: {}", line.join(", ")));
        prev = now;
    }
    for l in &per_vcpu_rounds {
        println!("smp fire round: {l}");
    }
    // Both CPUs ran their loop through the rounds (in a given round the
    // boot processor's guest may get little time: it also serves COM2).
    ck.check(
        hits_per_vcpu.iter().all(|&h| h > 0),
        format!("hits per vCPU over the rounds: {hits_per_vcpu:?}"),
    );
    print_lock_waits("smp fire", &start, &hv_status(c));
    // Unhooked: no more hits, and the guest is well.
    let hits_then = hv_status(c).tracer.hits;
    guest_exec(c, "hvbench sleep 300");
    ck.eq(
        "hits after the last unhook",
        hv_status(c).tracer.hits - hits_then,
        0,
    );
    let alive = guest_exec(
        c,
        &format!("touch /tmp/stop; wait; cd {TRACEFS}; echo nop > current_tracer; echo 0 > events/kprobes/gk/enable; echo > kprobe_events; echo alive"),
    );
    ck.check(
        alive.contains("alive"),
        format!("guest after the rounds: {alive}"),
    );
    let oops = guest_exec(
        c,
        "dmesg | grep -c -e 'BUG:' -e 'Oops' -e 'invalid opcode' -e 'ftrace failed' || true",
    );
    ck.eq(
        "oopses and ftrace failures in the guest's log",
        oops.trim(),
        "0",
    );
    let st = hv_status(c);
    ck.eq("sites hooked after the rounds", st.tracer.sites, 0);
    ck.check(
        st.tracer.guest_writes > 0,
        "the guest's own ftrace never wrote the hooked page",
    );
    let held = st.per_vcpu.get(1).map_or(0, |v| v.held_ns);
    println!(
        "smp fire: hits per round {per_round:?}; vCPU 1 held {} us in all; guest writes stepped {}",
        (held - held_before.min(held)) / 1000,
        st.tracer.guest_writes
    );
}

/// What a probe hit costs on two vCPUs, against no probe and against the
/// guest's own kprobe on the same function: `hvbench getppid N` on CPU 1
/// alone, then on both CPUs at once. Each hit is exactly one VMCALL exit,
/// on the vCPU that called. Costs are guest time per call (the TSC runs
/// at Bochs's `ips`: one emulated instruction of each CPU per 20 ns).
fn cost_on_two_cpus(ck: &mut Checks, c: &mut Client) {
    const N: u64 = 3000;
    const FUNC: &str = "__x64_sys_getppid";
    let ns_of = |out: &str| -> Vec<f64> {
        out.split_whitespace()
            .filter_map(|t| t.strip_prefix("ns="))
            .filter_map(|v| v.parse::<f64>().ok())
            .map(|ns| ns / N as f64)
            .collect()
    };
    let alone = format!("taskset 2 hvbench getppid {N}");
    let both = format!(
        "taskset 1 hvbench getppid {N} > /tmp/cpu0 & taskset 2 hvbench getppid {N}; wait; cat /tmp/cpu0"
    );
    // No rendering on the boot processor's turns while measuring: the
    // records wait in the rings.
    hv_call(c, Request::TraceStop);
    let none = ns_of(&guest_exec(c, &alone));
    if !probe_add(ck, c, &format!("p:cost {FUNC}")) {
        return;
    }
    let s0 = settled_status(ck, c, "before the cost phases");
    let ours = ns_of(&guest_exec(c, &alone));
    let s1 = settled_status(ck, c, "after the probe on CPU 1");
    let ours_both = ns_of(&guest_exec(c, &both));
    let s2 = settled_status(ck, c, "after the probe on both CPUs");
    probe_del(ck, c, "cost");
    let hits = |a: &protocol::StatusReport, b: &protocol::StatusReport, i: usize| {
        a.per_vcpu.get(i).map_or(0, |v| v.hits) - b.per_vcpu.get(i).map_or(0, |v| v.hits)
    };
    let vmcalls = |a: &protocol::StatusReport, b: &protocol::StatusReport, i: usize| {
        a.per_vcpu.get(i).map_or(0, |v| v.vmcalls) - b.per_vcpu.get(i).map_or(0, |v| v.vmcalls)
    };
    ck.eq(
        "probe hits and VMCALL exits on (vCPU 0, vCPU 1), CPU 1 calling",
        (hits(&s1, &s0, 0), hits(&s1, &s0, 1), vmcalls(&s1, &s0, 1)),
        (0, N, N),
    );
    ck.eq(
        "probe hits and VMCALL exits on (vCPU 0, vCPU 1), both calling",
        (
            hits(&s2, &s1, 0),
            vmcalls(&s2, &s1, 0),
            hits(&s2, &s1, 1),
            vmcalls(&s2, &s1, 1),
        ),
        (N, N, N, N),
    );
    guest_exec(
        c,
        &format!("cd {TRACEFS} && echo 'p:gcost {FUNC}' > kprobe_events && echo 1 > events/kprobes/gcost/enable"),
    );
    let guest = ns_of(&guest_exec(c, &alone));
    let guest_both = ns_of(&guest_exec(c, &both));
    guest_exec(
        c,
        &format!("cd {TRACEFS} && echo 0 > events/kprobes/gcost/enable && echo > kprobe_events"),
    );
    let waits = hv_status(c);
    ck.check(
        [&none, &ours, &guest].iter().all(|v| v.len() == 1)
            && [&ours_both, &guest_both].iter().all(|v| v.len() == 2),
        format!("hvbench timings: {none:?} {ours:?} {ours_both:?} {guest:?} {guest_both:?}"),
    );
    let base = none.first().copied().unwrap_or(f64::NAN);
    println!("smp cost: {N} getppid calls per CPU per phase, 2 vCPUs (guest ns per call; 20 ns per emulated instruction)");
    for (name, v) in [
        ("no probe, CPU 1", &none),
        ("hvtrace probe, CPU 1", &ours),
        ("hvtrace probe, CPUs 1 and 0", &ours_both),
        ("guest kprobe, CPU 1", &guest),
        ("guest kprobe, CPUs 1 and 0", &guest_both),
    ] {
        let per: Vec<String> = v
            .iter()
            .map(|ns| {
                format!(
                    "{ns:.0} ns = {:.0} instr (+{:.0} per hit)",
                    ns / 20.0,
                    (ns - base) / 20.0
                )
            })
            .collect();
        println!("  {name:<28} {}", per.join("; "));
    }
    print_lock_waits("smp cost", &s0, &waits);
}

/// The function tracer on every traceable function while a task on CPU 1
/// wakes and exits (each call exits, so that is the whole workload): the
/// guest lives without a lockup or stall report, every vCPU hits, losses are
/// reported per vCPU and add up, and clearing it leaves nothing hooked.
/// Last: its records are not drained.
fn scale(ck: &mut Checks, c: &mut Client) {
    let before = hv_status(c);
    // A task asleep on CPU 1 wakes and exits under '*'.
    guest_exec(c, "taskset 2 hvbench sleep 400 & echo started");
    let t0 = std::time::Instant::now();
    let traced = match hv_call(c, Request::FunctionAdd { glob: "*".into() }) {
        Response::FunctionAdded { traced, .. } => traced,
        other => {
            ck.check(false, format!("function add '*': {other:?}"));
            return;
        }
    };
    let hook_s = t0.elapsed().as_secs_f64();
    let mid = hv_status(c);
    let t1 = std::time::Instant::now();
    let out = guest_exec(c, "taskset 2 true; echo done");
    let work_s = t1.elapsed().as_secs_f64();
    let after = hv_status(c);
    print_lock_waits("smp scale workload", &mid, &after);
    ck.check(out.contains("done"), format!("workload under '*': {out:?}"));
    let hits: Vec<u64> = after
        .per_vcpu
        .iter()
        .zip(&mid.per_vcpu)
        .map(|(a, m)| a.vmcalls - m.vmcalls)
        .collect();
    ck.check(
        hits.len() == 2 && hits.iter().all(|&h| h > 100),
        format!("'*' did not hit on every vCPU: VMCALL exits {hits:?}"),
    );
    let lost: u64 = after.per_vcpu.iter().map(|v| v.lost).sum();
    ck.eq("losses: the vCPUs' sum", after.tracer.lost, lost);
    let r = hv_call(c, Request::FunctionClear);
    ck.check(
        matches!(r, Response::Ok),
        format!("function clear after '*': {r:?}"),
    );
    let end = hv_status(c);
    ck.eq("sites after clearing '*'", end.tracer.sites, 0);
    ck.eq("shadow pages after clearing '*'", end.tracer.pages, 0);
    ck.eq(
        "guest alive after '*'",
        guest_exec(c, "echo alive").trim(),
        "alive",
    );
    let stalls = guest_exec(
        c,
        "dmesg | grep -c -e 'soft lockup' -e 'rcu.*stall' -e 'hung task' || true",
    );
    ck.eq(
        "lockup and stall reports in the guest's log",
        stalls.trim(),
        "0",
    );
    println!(
        "smp scale: '*' traced {traced} functions in {hook_s:.1} s (vCPU 1 held {} us); workload {work_s:.1} s, VMCALL exits per vCPU {hits:?}, lost per vCPU {:?}",
        (end.per_vcpu.get(1).map_or(0, |v| v.held_ns) - before.per_vcpu.get(1).map_or(0, |v| v.held_ns)) / 1000,
        after.per_vcpu.iter().map(|v| v.lost).collect::<Vec<_>>()
    );
}

/// The attacker on two vCPUs: the module reads a hooked function's first
/// bytes in a loop on CPU 0 while a task on CPU 1 calls it. Every read sees
/// the guest's NOP5 (the step opens the page in CPU 0's view only), and
/// every call on CPU 1 is traced.
fn attacker_on_two_cpus(ck: &mut Checks, c: &mut Client) {
    const CALLS: u64 = 300;
    let Some(addr) = probed_getppid(ck, c, "atk2") else {
        return;
    };
    let mut stream = Stream::new();
    let _ = stream.read(c);
    let st0 = hv_status(c);
    let steps0 = st0.tracer.steps;
    let vmcalls = |st: &protocol::StatusReport| st.per_vcpu.get(1).map_or(0, |v| v.vmcalls);
    let log = guest_exec(
        c,
        &format!(
            "dmesg -c > /dev/null; taskset 2 sh -c 'for i in 1 2 3 4 5 6 7 8 9 10; do hvbench getppid {} > /dev/null; hvbench sleep 10; done' & \
             taskset 1 insmod /lib/hvattack.ko func=0x{addr} reads=3000 2>/dev/null; wait; dmesg | grep 'hvattack: timed'",
            CALLS / 10
        ),
    );
    let st1 = hv_status(c);
    let steps = st1.tracer.steps - steps0;
    let exits_cpu1 = vmcalls(&st1) - vmcalls(&st0);
    let ours = stream.read(c);
    probe_del(ck, c, "atk2");
    let timed = log
        .lines()
        .find(|l| l.contains("hvattack: timed"))
        .unwrap_or("");
    println!("smp attacker: {timed}; {steps} steps");
    ck.check(
        timed.contains("(0 faulted, 0 not a nop5)"),
        format!("a read of the hooked function did not see its NOP5: {log}"),
    );
    ck.check(
        steps >= 3000,
        format!("reads stepped: {steps} steps for 3000 reads"),
    );
    let traced = ours
        .lines()
        .filter(|l| l.contains(" atk2: ") && l.trim_start().starts_with("hvbench-"))
        .collect::<Vec<_>>();
    ck.eq("calls traced on CPU 1", traced.len() as u64, CALLS);
    ck.check(
        traced.iter().all(|l| cpu_column(l) == Some(1)),
        "a traced call not on CPU 1",
    );
    // One exit per hit on vCPU 1: its VMCALL exits are its events (the
    // hvbench calls, and any other task's on CPU 1).
    let on_cpu1 = ours
        .lines()
        .filter(|l| l.contains(" atk2: ") && cpu_column(l) == Some(1))
        .count() as u64;
    println!("smp attacker: vCPU 1: {exits_cpu1} VMCALL exits for {on_cpu1} events");
    ck.eq("VMCALL exits on vCPU 1 per event", exits_cpu1, on_cpu1);
}

/// A probe `name` on `__x64_sys_getppid`, and the function's address as
/// the guest's kallsyms has it (hex, for the attacker's parameters).
fn probed_getppid(ck: &mut Checks, c: &mut Client, name: &str) -> Option<String> {
    let line = guest_exec(c, "grep ' __x64_sys_getppid$' /proc/kallsyms");
    let Some(addr) = line.split_whitespace().next().map(str::to_string) else {
        ck.check(false, "__x64_sys_getppid not in kallsyms");
        return None;
    };
    probe_add(ck, c, &format!("p:{name} __x64_sys_getppid")).then_some(addr)
}

/// A guest-physical frame inside the hypervisor's reservation (2 MiB to
/// 32 MiB), which EPT never maps for the guest.
const HV_FRAME: u64 = 0x1f0_0000;

/// The hostile guest on two vCPUs: every attack of the hardening test that
/// needs no set-up of its own, loaded pinned to CPU 1 while a probe traces
/// a loop pinned to CPU 0, and the attacks for the paths that only SMP or
/// steps reach: a fetch from hypervisor memory (a #UD the module catches;
/// the vCPU once spun there forever), a step storm (reads of a hooked
/// page with a 10 us hrtimer firing and the reader moving itself between
/// the CPUs every 64 reads: interrupts now end a step before they are
/// delivered, and no stray single-step #DB reaches the guest), an IOAPIC
/// entry in INIT mode aimed at APIC 1 and LVT LINT0 in INIT mode (INIT
/// reaches a vCPU only through root). Then: no WARN, oops or BUG in the
/// guest's log, CPU 0's probe kept firing, status answers, and CPU 1 goes
/// offline and comes back.
fn hostile_on_cpu1(ck: &mut Checks, c: &mut Client) {
    let Some(func) = probed_getppid(ck, c, "h0") else {
        return;
    };
    guest_exec(
        c,
        "dmesg -c > /dev/null; rm -f /tmp/stop; taskset 1 sh -c 'while [ ! -e /tmp/stop ]; do hvbench getppid 200 > /dev/null; hvbench sleep 5; done' > /dev/null 2>&1 & echo started",
    );
    let hits0 = probe_hits(c, "h0");
    let fetch = format!("hv_fetch={HV_FRAME:#x}");
    let hwbp = format!("func=0x{func} hwbp=1");
    let storm = format!("func=0x{func} step_storm=1000");
    let attacks = [
        "forge_e9=1",
        "cr0_nw=1",
        "bad_xsetbv=1",
        "getsec=1",
        "straddle=1",
        "pci_dma=1",
        "apic_base=1",
        "vmcall=1",
        "nmi_storm=5",
        hwbp.as_str(),
        fetch.as_str(),
        storm.as_str(),
        "ioapic_init=1",
        "lint_init=1",
    ];
    let mut log = String::new();
    for params in attacks {
        let t0 = std::time::Instant::now();
        let out = guest_exec(
            c,
            &format!(
                "taskset 2 insmod /lib/hvattack.ko {params} 2>/dev/null; dmesg | grep 'hvattack: done' | wc -l"
            ),
        );
        // The console's kernel lines come first: the count is the last.
        let done = out.lines().last().unwrap_or("").trim();
        println!("hostile on CPU 1: {params}: {done} in {:?}", t0.elapsed());
        ck.check(
            done.parse::<u32>().is_ok_and(|n| n > 0),
            format!("the attack {params} ran to its end on CPU 1: {out:?}"),
        );
        log.push_str(&guest_exec(c, "dmesg -c"));
    }
    guest_exec(c, "touch /tmp/stop; sleep 1");
    let hits1 = probe_hits(c, "h0");
    probe_del(ck, c, "h0");
    let lines = |key: &str| {
        log.lines()
            .filter(|l| l.contains(key))
            .collect::<Vec<_>>()
            .join("\n")
    };
    println!("hostile on CPU 1:\n{}", lines("hvattack:"));
    ck.check(
        hits1 > hits0,
        format!("CPU 0's probe fired while CPU 1 attacked: {hits0} -> {hits1}"),
    );
    let fetched = lines("hvattack: hv fetch");
    ck.check(
        fetched.contains(&format!("hv fetch {HV_FRAME:x}: returned, 1 #UD")),
        format!("a fetch from hypervisor memory got #UD and returned: {fetched:?}"),
    );
    let storm = lines("hvattack: step storm");
    let moved = storm
        .split(", ")
        .find_map(|p| p.strip_suffix(" moves"))
        .and_then(|n| n.trim().parse::<u32>().ok());
    let fires = storm
        .split(", ")
        .find_map(|p| p.strip_suffix(" timer fires"))
        .and_then(|n| n.trim().parse::<u32>().ok());
    ck.check(
        storm.contains("(0 faulted, 0 not a nop5)")
            && moved.is_some_and(|m| m >= 10)
            && fires.is_some_and(|f| f > 0),
        format!("the step storm read the NOP5 every time, moving between CPUs under a fast timer: {storm:?}"),
    );
    // What an INIT route reads back: root dropped the store, so the
    // delivery mode (bits 8 to 10) is not INIT (101b).
    for key in ["hvattack: ioapic init", "hvattack: lint0 init"] {
        let found = lines(key);
        let values: Vec<u32> = found
            .lines()
            .filter_map(|l| l.split("reads ").nth(1))
            .filter_map(|v| u32::from_str_radix(v.trim(), 16).ok())
            .collect();
        ck.check(
            !values.is_empty() && values.iter().all(|v| v & 0x700 != 0x500),
            format!("an INIT route never took: {found:?}"),
        );
    }
    for bad in [
        "WARNING",
        "Oops",
        "BUG:",
        "exc_debug",
        "general protection",
        "soft lockup",
    ] {
        let found = lines(bad);
        ck.check(
            found.is_empty(),
            format!("the guest's log during the attacks on CPU 1 has {bad}: {found}"),
        );
    }
    let st = hv_status(c);
    ck.eq("vCPUs in status after the attacks", st.vcpus, 2);
    ck.eq(
        "the CPU a task pinned to CPU 1 ran on, after the attacks",
        cpu_of_pinned_task(c, "2").as_str(),
        "1",
    );
    guest_exec(c, "echo 0 > /sys/devices/system/cpu/cpu1/online");
    guest_exec(c, "echo 1 > /sys/devices/system/cpu/cpu1/online");
    let online = guest_exec(c, "cat /sys/devices/system/cpu/online");
    ck.eq(
        "online CPUs after a hotplug that followed the attacks",
        online.trim(),
        "0-1",
    );
    ck.eq(
        "the CPU a task pinned to CPU 1 ran on, after that hotplug",
        cpu_of_pinned_task(c, "2").as_str(),
        "1",
    );
}

/// The lines of function_graph text (ours or the guest's) printed by CPU
/// `cpu`, as nodes.
fn graph_of_cpu(text: &str, cpu: u32) -> Vec<Node> {
    let lines: String = text
        .lines()
        .filter(|l| {
            l.trim_start()
                .split(')')
                .next()
                .and_then(|n| n.trim().parse::<u32>().ok())
                == Some(cpu)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    parse_graph(&lines)
}

/// Graph oracle on both CPUs at once: a `dd` read pinned to each CPU, the
/// two at the same time, traced by our session and by the guest's own
/// function_graph over the same functions. Each CPU's tree is the guest's.
fn graph_oracle_per_cpu(ck: &mut Checks, c: &mut Client) {
    let Some(session) = graph_start_with(
        ck,
        c,
        protocol::GraphFilter {
            functions: vec!["vfs_read".into()],
            trace: TRACE_SET.iter().map(|s| s.to_string()).collect(),
            comm: Some("dd".into()),
            ..protocol::GraphFilter::default()
        },
    ) else {
        return;
    };
    let mut stream = Stream::of(session, TraceFormat::Text, 0);
    let _ = stream.read(c);
    let dd = "sh -c 'echo $$ >> set_ftrace_pid; exec dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null'";
    let guest = guest_vfs_read_graph(c, &format!("(taskset 1 {dd} & taskset 2 {dd} & wait)"));
    let ours = stream.read(c);
    graph_stop(ck, c, session);
    for cpu in [0, 1] {
        let g = graph_of_cpu(&guest, cpu);
        let o = graph_of_cpu(&ours, cpu);
        println!(
            "smp graph oracle: CPU {cpu}: the guest's tree {} nodes, ours {}",
            g.len(),
            o.len()
        );
        ck.check(
            g.len() >= 5,
            format!(
                "the guest's tree under vfs_read on CPU {cpu} has nodes: {}\n{guest}",
                g.len()
            ),
        );
        ck.eq(
            &format!("our vfs_read tree on CPU {cpu} equals the guest's"),
            &o,
            &g,
        );
    }
}

/// The quiet views on two CPUs: a session rooted at vfs_read whose trace
/// set holds the getppid system call's body, while a getppid loop pinned
/// to CPU 1 runs outside the root and a dd read on CPU 0 inside it. The
/// loop's calls cost nothing (they cost two exits each with the trace set
/// hooked on every view), and the dd read is traced.
fn quiet_other_cpu(ck: &mut Checks, c: &mut Client) {
    const N: u64 = 20_000;
    let func = guest_exec(
        c,
        &format!(
            "grep -m1 -E '^(__do_sys|__x64_sys)_getppid$' {TRACEFS}/available_filter_functions"
        ),
    )
    .trim()
    .to_string();
    let mut trace: Vec<String> = TRACE_SET.iter().map(|s| s.to_string()).collect();
    trace.push(func.clone());
    let Some(session) = graph_start_with(
        ck,
        c,
        protocol::GraphFilter {
            functions: vec!["vfs_read".into()],
            trace,
            ..protocol::GraphFilter::default()
        },
    ) else {
        return;
    };
    let mut stream = Stream::of(session, TraceFormat::Text, 0);
    let _ = stream.read(c);
    let calls = |c: &mut Client| -> u64 {
        hv_status(c)
            .per_vcpu
            .iter()
            .map(|v| v.hits + v.returns)
            .sum()
    };
    let st = hv_status(c);
    let before = calls(c);
    let out = guest_exec(
        c,
        &format!(
            "taskset 2 hvbench getppid {N} & taskset 1 dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null; wait"
        ),
    );
    let spent = calls(c) - before;
    let text = stream.read(c);
    graph_stop(ck, c, session);
    let views: Vec<(u64, bool)> = hv_status(c)
        .per_vcpu
        .iter()
        .map(|v| (v.view_switches, v.quiet))
        .collect();
    println!(
        "smp quiet views: {N} getppid calls on CPU 1 outside the root, a dd read on CPU 0 inside it: {spent} hypercalls in all ({} quiet pages, {} partial); view switches and quiet now per vCPU {views:?}; {out}",
        st.tracer.quiet_pages, st.tracer.quiet_partial
    );
    ck.check(
        st.tracer.switch_hook,
        "the scheduler hook is in for the rooted session",
    );
    ck.check(
        spent < N / 10,
        format!("the loop outside the root costs nothing: {spent} hypercalls for {N} calls of a traced function"),
    );
    ck.check(
        text.contains("vfs_read() {"),
        format!("the dd read inside the root is traced:\n{text}"),
    );
}

/// A graph session on do_nanosleep over one sleeper pinned to each CPU:
/// two trees, each on its sleeper's CPU.
fn graph_on_two_cpus(ck: &mut Checks, c: &mut Client) {
    let Some(session) = graph_start(ck, c, "do_nanosleep") else {
        return;
    };
    let mut stream = Stream::of(session, TraceFormat::Text, 0);
    let _ = stream.read(c);
    guest_exec(
        c,
        "taskset 1 hvbench sleep 300 & taskset 2 hvbench sleep 300 & wait",
    );
    let text = stream.read(c);
    graph_stop(ck, c, session);
    // `N) ... |  do_nanosleep();` lines (a leaf at depth 1), by CPU.
    let cpus: Vec<u32> = text
        .lines()
        .filter(|l| l.contains("do_nanosleep"))
        .filter_map(|l| l.trim_start().split(')').next()?.trim().parse().ok())
        .collect();
    println!("smp graph: {text}");
    ck.check(
        cpus.contains(&0) && cpus.contains(&1),
        format!("graph lines of do_nanosleep not on both CPUs: {cpus:?}\n{text}"),
    );
}

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
    // The initramfs with the attacker module (guest/attacker).
    let initrd = hvtrace::vm::guest::run_script("scripts/guest/attacker.sh")
        .expect("building the attacker module failed");
    let initrd = initrd.to_str().expect("initrd path is not UTF-8");
    let vm = Detached::start_with("fast", "smp", &["--cpus", "2", "--initrd", initrd]);
    let mut c = vm.client();
    let mut checks = Checks::new();

    boot_checks(&mut checks, &mut c);
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

    // Hotplug, with a probe and a graph session on: offline, then online
    // again through INIT and SIPI.
    let hot = probe_add(&mut checks, &mut c, "p:hot do_sys_openat2");
    let session = graph_start(&mut checks, &mut c, "do_nanosleep");
    guest_exec(&mut c, "echo 0 > /sys/devices/system/cpu/cpu1/online");
    let online = guest_exec(&mut c, "cat /sys/devices/system/cpu/online");
    checks.eq("online CPUs with CPU 1 offline", online.trim(), "0");
    checks.eq(
        "the CPU a task pinned to any CPU ran on, CPU 1 offline",
        cpu_of_pinned_task(&mut c, "3").as_str(),
        "0",
    );
    // A change to every view with vCPU 1 parked: it is not waited for.
    if probe_add(&mut checks, &mut c, "p:parked vfs_read") {
        probe_del(&mut checks, &mut c, "parked");
    }
    guest_exec(&mut c, "echo 1 > /sys/devices/system/cpu/cpu1/online");
    let online = guest_exec(&mut c, "cat /sys/devices/system/cpu/online");
    checks.eq("online CPUs after CPU 1 came back", online.trim(), "0-1");
    let hits_before = probe_hits(&mut c, "hot");
    checks.eq(
        "the CPU a task pinned to CPU 1 ran on, after hotplug",
        cpu_of_pinned_task(&mut c, "2").as_str(),
        "1",
    );
    checks.check(
        probe_hits(&mut c, "hot") > hits_before,
        "the probe did not fire on CPU 1 after it came back",
    );
    if hot {
        probe_del(&mut checks, &mut c, "hot");
    }
    if let Some(s) = session {
        graph_stop(&mut checks, &mut c, s);
    }

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
    probe_oracle_across_cpus(&mut checks, &mut c);
    graph_on_two_cpus(&mut checks, &mut c);
    graph_oracle_per_cpu(&mut checks, &mut c);
    quiet_other_cpu(&mut checks, &mut c);
    migrating_sleeper(&mut checks, &mut c);
    attacker_on_two_cpus(&mut checks, &mut c);
    patching_under_fire(&mut checks, &mut c);
    hostile_on_cpu1(&mut checks, &mut c);
    cost_on_two_cpus(&mut checks, &mut c);
    scale(&mut checks, &mut c);

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
    // Every hook and unhook request held the other vCPU (root logs each
    // hold): at least the fire test's 9 rounds of two.
    let holds = log.matches("the other vCPUs were held").count();
    checks.check(
        holds >= 18,
        format!("root's log shows {holds} holds of the other vCPUs for patching, want 18 or more"),
    );
    let st = hv_status(&mut c);
    print_vcpus("smp", &st);
    // How deep each vCPU's root stack went over all of the above (module
    // loads on CPU 1 with probes pending, view settling, steps, patching
    // under fire, the hostile module): at most half of it, so that a path
    // that grows shows here long before it reaches the guard page.
    for v in &st.per_vcpu {
        eprintln!(
            "smp: vCPU {} root stack: {} of {} KiB used at the deepest",
            v.index,
            v.root_stack_used.div_ceil(1024),
            v.root_stack_size >> 10
        );
        checks.check(
            v.root_stack_size > 0
                && v.root_stack_used > 0
                && v.root_stack_used <= v.root_stack_size / 2,
            format!(
                "vCPU {}'s root stack: {} of {} bytes used, want at most half",
                v.index, v.root_stack_used, v.root_stack_size
            ),
        );
    }
    checks.finish();
}
