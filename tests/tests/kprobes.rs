//! kprobes and the function tracer from VMX root, against the guest's own
//! tracers as oracles, with KASLR on. One detached boot per kernel; on it:
//!
//! - bad probe specs are refused with a clear error, and a VMCALL from
//!   guest user mode gets #UD (SIGILL) and is counted as foreign;
//! - **oracle**: our `p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string`
//!   and the same probe defined inside the guest through its own
//!   kprobe_events record the same events for `cat /etc/hostname`: same
//!   pids, same location, same fetched values;
//! - **coexistence** in the manner of the kernel's ftracetest
//!   `kprobe_ftrace.tc`: with our probe on the function, the guest's own
//!   function tracer and its own kprobe on the same function are toggled
//!   through five phases, and every tracer that is on sees exactly the
//!   workload's calls; the guest's ftrace never notices our patch;
//! - the plain function tracer's `func <-parent` lines equal the guest's
//!   own function tracer's for the same calls;
//! - removing everything restores the guest's own pages (no shadow left).
//!
//! The fast lane also runs module code (`module_code` below, over the test
//! module `guest/attacker/hvtarget.c`): our symbols for the module equal its
//! `/proc/kallsyms` lines; a `MOD:SYM` probe (refused clearly before the
//! module loads), the function tracer over the module's functions and a
//! graph session rooted in the module, whose tree runs through core
//! functions and back, each equal the guest's own tracer over the same
//! calls. Then the benchmark (`benchmark` below): VM exits per hit and
//! emulated instructions per hit against the guest's own kprobes.
//!
//! Both kernels run the BTF arguments against the guest's own
//! kprobe_events (`kprobes_btf`).
//!
//! Debian boots its default initramfs, which carries modules of the stock
//! kernel package (`ext4_module` below: modprobe, a loop mount and a
//! pending `ext4:` probe against the guest's own); `--modules` is checked
//! without a VM (`debian_modules_option_without_a_vm`). It ends with
//! `hvtrace record` into a trace.dat that Debian's `trace-cmd` reads
//! (`record_on_debian`).
//!
//! Run: `cargo test -p hvtrace-tests --test kprobes -- --nocapture`

mod kprobes_btf;
mod kprobes_syscalls;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use hvtrace::client::Client;
use hvtrace_tests::{
    guest_exec as exec, hv_call as call, hv_exits as exits, hv_graph_stop, hv_status as status,
    vm_lock, Checks, Detached, Stream,
};
use protocol::{ErrorKind, ProbeInfo, Request, Response};

const PROBE: &str = "p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string";

use hvtrace_tests::{
    parse_graph, parse_trace_lines as parse_all, Node, TraceLine as Line, TRACEFS,
};

fn probes(c: &mut Client) -> Vec<ProbeInfo> {
    match call(c, Request::ProbeList) {
        Response::Probes(p) => p,
        other => panic!("unexpected answer to probe list: {other:?}"),
    }
}

fn probe(c: &mut Client, name: &str) -> Option<ProbeInfo> {
    probes(c).into_iter().find(|p| p.name == name)
}

fn hits(c: &mut Client, name: &str) -> u64 {
    probe(c, name).map_or(0, |p| p.hits)
}

/// Whether probe `name` waits for its module (`None`: no such probe).
fn pending(c: &mut Client, name: &str) -> Option<bool> {
    probe(c, name).map(|p| p.pending)
}

/// `cat /etc/hostname` `n` times, each a new process.
fn workload(n: usize) -> String {
    vec!["cat /etc/hostname >/dev/null"; n].join("; ")
}

/// The lines of `lines` from `cat` opening /etc/hostname.
fn hostname_opens(lines: &[Line]) -> Vec<Line> {
    let mut v: Vec<Line> = lines
        .iter()
        .filter(|l| l.comm == "cat" && l.body.contains("filename=\"/etc/hostname\""))
        .cloned()
        .collect();
    v.sort();
    v
}

/// Guest function-tracer lines of `func` from the pids of `of`.
fn function_lines(lines: &[Line], func: &str, of: &[Line]) -> Vec<Line> {
    let pids: Vec<i32> = of.iter().map(|l| l.pid).collect();
    let mut v: Vec<Line> = lines
        .iter()
        .filter(|l| pids.contains(&l.pid) && l.body.starts_with(&format!("{func} <-")))
        .cloned()
        .collect();
    v.sort();
    v
}

fn bad_specs(ck: &mut Checks, c: &mut Client) {
    let cases: [(&str, ErrorKind, &str); 4] = [
        (
            "p:bad do_sys_openat2 x=%zz",
            ErrorKind::InvalidArgument,
            "column",
        ),
        ("p do_sys_openat2+4", ErrorKind::InvalidArgument, "entry"),
        (
            "p:nosuch hvtrace_no_such_function",
            ErrorKind::NotFound,
            "kallsyms",
        ),
        (
            "p:badsym do_sys_openat2 x=@hvtrace_no_such_symbol",
            ErrorKind::NotFound,
            "hvtrace_no_such_symbol",
        ),
    ];
    for (spec, kind, says) in cases {
        match call(c, Request::ProbeAdd { spec: spec.into() }) {
            Response::Error { kind: k, message } => {
                ck.eq(&format!("error kind for {spec:?}"), k, kind);
                ck.check(
                    message.contains(says) && !message.contains('\n'),
                    format!("error for {spec:?} is one line naming {says:?}: {message:?}"),
                );
            }
            other => ck.check(false, format!("{spec:?} was accepted: {other:?}")),
        }
    }
    ck.eq("probes after bad specs", probes(c).len(), 0);
}

fn foreign_vmcall(ck: &mut Checks, c: &mut Client) {
    let out = exec(c, "hvbench vmcall");
    ck.check(
        out.trim() == "SIGILL",
        format!("a user-mode VMCALL gets #UD: {out:?}"),
    );
    ck.eq(
        "foreign VMCALLs counted",
        status(c).tracer.foreign_vmcalls,
        1,
    );
}

/// Our probe and the guest's own, same spec, same workload.
fn oracle(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    match call(c, Request::ProbeAdd { spec: PROBE.into() }) {
        Response::ProbeAdded { name, site } => {
            ck.eq("probe name", name.as_str(), "kprobes/myopen");
            println!("probe kprobes/myopen at {site:#x}");
        }
        other => {
            ck.check(false, format!("probe add failed: {other:?}"));
            return;
        }
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{PROBE}' > kprobe_events && echo > trace && \
             echo 1 > events/kprobes/myopen/enable && {} && \
             echo 0 > events/kprobes/myopen/enable && cat trace",
            workload(5)
        ),
    );
    let ours = stream.read(c);
    let g = hostname_opens(&parse_all(&guest));
    let o = hostname_opens(&parse_all(&ours));
    println!("oracle: guest {} events, ours {}", g.len(), o.len());
    for l in o.iter().take(2) {
        println!("  ours:  {}-{} {}", l.comm, l.pid, l.body);
    }
    for l in g.iter().take(2) {
        println!("  guest: {}-{} {}", l.comm, l.pid, l.body);
    }
    ck.eq("guest kprobe events for the workload", g.len(), 5);
    ck.eq(
        "our events equal the guest's (pid, location, values)",
        &o,
        &g,
    );
    ck.eq("stream losses", stream.lost, 0);
}

/// kprobe_ftrace.tc's phases, with our probe on throughout (until the last).
fn coexistence(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let func = "do_sys_openat2";
    let run = |c: &mut Client, stream: &mut Stream, setup: &str| {
        let _ = stream.read(c);
        let guest = exec(
            c,
            &format!(
                "cd {TRACEFS} && {setup} echo > trace && {} && cat trace",
                workload(3)
            ),
        );
        let ours = stream.read(c);
        (parse_all(&guest), parse_all(&ours))
    };
    // 1: the guest's function tracer on the same function.
    let (g, o) = run(
        c,
        stream,
        &format!("echo {func} > set_ftrace_filter && echo function > current_tracer &&"),
    );
    let ours = hostname_opens(&o);
    ck.eq("phase 1: our events", ours.len(), 3);
    ck.eq(
        "phase 1: guest function-tracer lines for our events",
        function_lines(&g, func, &ours).len(),
        3,
    );
    // 2: plus the guest's own kprobe.
    let (g, o) = run(c, stream, "echo 1 > events/kprobes/myopen/enable &&");
    let ours = hostname_opens(&o);
    ck.eq("phase 2: our events", ours.len(), 3);
    ck.eq(
        "phase 2: guest function-tracer lines",
        function_lines(&g, func, &ours).len(),
        3,
    );
    ck.eq(
        "phase 2: guest kprobe events equal ours",
        hostname_opens(&g),
        ours,
    );
    // 3: the guest's function tracer off.
    let (g, o) = run(c, stream, "echo nop > current_tracer &&");
    let ours = hostname_opens(&o);
    ck.eq("phase 3: our events", ours.len(), 3);
    ck.eq(
        "phase 3: guest kprobe events equal ours",
        hostname_opens(&g),
        ours,
    );
    ck.eq(
        "phase 3: no guest function-tracer lines",
        function_lines(&g, func, &hostname_opens(&g)).len(),
        0,
    );
    // 4: the guest's kprobe off: only ours.
    let (g, o) = run(c, stream, "echo 0 > events/kprobes/myopen/enable &&");
    ck.eq("phase 4: our events", hostname_opens(&o).len(), 3);
    ck.eq("phase 4: guest events", hostname_opens(&g).len(), 0);
    // 5: ours removed, the guest's kprobe back on: only the guest's.
    ck.check(
        matches!(
            call(
                c,
                Request::ProbeDel {
                    name: "myopen".into()
                }
            ),
            Response::Ok
        ),
        "probe del myopen",
    );
    let (g, o) = run(c, stream, "echo 1 > events/kprobes/myopen/enable &&");
    ck.eq("phase 5: guest kprobe events", hostname_opens(&g).len(), 3);
    ck.eq("phase 5: our events", hostname_opens(&o).len(), 0);
    exec(
        c,
        &format!("cd {TRACEFS} && echo 0 > events/kprobes/myopen/enable && echo > kprobe_events"),
    );
    let t = status(c).tracer;
    ck.eq("sites hooked after removal", t.sites, 0);
    ck.eq("shadow pages after removal", t.pages, 0);
    ck.check(
        t.guest_writes > 0 && t.steps > t.guest_writes,
        format!("the guest's own patching was stepped: {t:?}"),
    );
    // The guest's ftrace verifies the bytes it replaces: had it seen our
    // call it would have reported a bug and shut itself down.
    let dmesg = exec(
        c,
        "dmesg | grep -i -E 'ftrace (bug|failed|faulted)' || true",
    );
    ck.check(
        dmesg.trim().is_empty(),
        format!("guest ftrace complaints: {dmesg}"),
    );
    println!("coexistence: tracer counters {t:?}");
}

/// Our function tracer against the guest's, same calls.
fn function_tracer(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let func = "do_filp_open";
    match call(c, Request::FunctionAdd { glob: func.into() }) {
        Response::FunctionAdded { traced, .. } => ck.eq("functions traced", traced, 1),
        other => ck.check(false, format!("function add failed: {other:?}")),
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo {func} > set_ftrace_filter && echo function > current_tracer && \
             echo > trace && {} && cat trace; echo nop > current_tracer",
            workload(3)
        ),
    );
    let ours = parse_all(&stream.read(c));
    // ftrace records pids and prints each one's latest comm, so a call made
    // during exec shows the new name; we record the name at the hit. Compare
    // by pid and `func <-parent`.
    // The workload's tasks are the pids the guest shows as `cat`; all
    // their lines count, whatever comm the guest printed on each (its
    // saved comm for a pid is the one last recorded, so the exec of the
    // last `cat` may still show the shell's name).
    let key = |l: &Line| (l.pid, l.body.clone());
    let guest_lines = parse_all(&guest);
    let pids: Vec<i32> = guest_lines
        .iter()
        .filter(|l| l.comm == "cat")
        .map(|l| l.pid)
        .collect();
    let mut g: Vec<(i32, String)> = guest_lines
        .iter()
        .filter(|l| pids.contains(&l.pid) && l.body.starts_with(&format!("{func} <-")))
        .map(key)
        .collect();
    g.sort();
    let mut mine: Vec<(i32, String)> = ours
        .iter()
        .filter(|l| pids.contains(&l.pid) && l.body.starts_with(&format!("{func} <-")))
        .map(key)
        .collect();
    mine.sort();
    println!(
        "function tracer: guest {} lines, ours {}; e.g. {:?}",
        g.len(),
        mine.len(),
        mine.first()
    );
    // Each cat calls it twice (exec, then the open), the workload's three
    // and the one that reads the trace.
    ck.check(
        g.len() >= 6,
        format!("guest function lines for the workload: {g:?}"),
    );
    ck.eq("our function lines equal the guest's", &mine, &g);
    ck.check(
        matches!(call(c, Request::FunctionClear), Response::Ok),
        "function clear",
    );
    ck.eq("sites after function clear", status(c).tracer.sites, 0);
}

/// VM exits and cost per hit, against the guest's own kprobes on the same
/// function, in one boot.
fn benchmark(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const N: u64 = 20_000;
    let func = "__x64_sys_getppid";
    let site = match call(
        c,
        Request::Syms {
            glob: func.into(),
            kinds: String::new(),
            module: String::new(),
            cursor: 0,
            limit: 4,
        },
    ) {
        Response::Syms { symbols, .. } => symbols
            .first()
            .and_then(|s| s.site.map(|site| site - s.addr)),
        _ => None,
    };
    let Some(site_off) = site else {
        ck.check(false, format!("{func} has no fentry site"));
        return;
    };
    let int3_at = site_off + 5;
    struct Phase {
        name: &'static str,
        ns_per_call: f64,
        wall_per_call: f64,
        vmcalls: u64,
        other_exits: u64,
        /// What nested KVM would add: VMCS accesses outside its shadow
        /// VMCS, and INVEPTs (root counts both, in Bochs too).
        unshadowed: u64,
        invept: u64,
    }
    let nested = |c: &mut Client| {
        status(c)
            .per_vcpu
            .iter()
            .fold((0, 0), |(u, i), v| (u + v.vmcs_unshadowed, i + v.invept))
    };
    let measure = |c: &mut Client, name: &'static str| -> Phase {
        let (u0, i0) = nested(c);
        let before = exits(c);
        let t0 = Instant::now();
        let out = exec(c, &format!("hvbench getppid {N}"));
        let wall = t0.elapsed().as_secs_f64();
        let after = exits(c);
        let (u1, i1) = nested(c);
        let delta =
            |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
        let ns: f64 = out
            .split_whitespace()
            .find_map(|t| t.strip_prefix("ns="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        Phase {
            name,
            ns_per_call: ns / N as f64,
            wall_per_call: wall / N as f64,
            vmcalls: delta("VMCALL"),
            other_exits: delta("EPT_VIOLATION") + delta("EXCEPTION_NMI"),
            unshadowed: u1 - u0,
            invept: i1 - i0,
        }
    };
    // No rendering on the hypervisor's turns while measuring: the events
    // wait in the ring (20000 records fit in it).
    let _ = stream.read(c);
    ck.check(
        matches!(call(c, Request::TraceStop), Response::Ok),
        "trace stop",
    );
    let mut phases = vec![measure(c, "no probe")];
    let spec = format!("p:bench {func}");
    call(c, Request::ProbeAdd { spec: spec.clone() });
    // Root's own time on recorded hits (status's root_hit), summed over
    // the vCPUs: (count, ns).
    let root_hits = |c: &mut Client| {
        status(c).per_vcpu.iter().fold((0, 0), |(n, ns), v| {
            (n + v.root_hit.count, ns + v.root_hit.sum_ns)
        })
    };
    let (rn0, rs0) = root_hits(c);
    let h0 = hits(c, "kprobes/bench");
    phases.push(measure(c, "hvtrace probe (VMX root)"));
    let h1 = hits(c, "kprobes/bench");
    let (rn1, rs1) = root_hits(c);
    // Each recorded hit is timed once, and root's time on it is part of
    // what the call cost the guest.
    ck.eq("root_hit counts the probe's hits", rn1 - rn0, h1 - h0);
    let root_ns = (rs1 - rs0) as f64 / (rn1 - rn0).max(1) as f64;
    let call_ns = phases[1].ns_per_call - phases[0].ns_per_call;
    println!("root time per recorded hit: {root_ns:.0} ns of the call's +{call_ns:.0} ns");
    ck.check(
        root_ns > 0.0 && root_ns < call_ns,
        format!(
            "root's time per hit ({root_ns:.0} ns) is part of the call's cost (+{call_ns:.0} ns)"
        ),
    );
    call(
        c,
        Request::ProbeDel {
            name: "bench".into(),
        },
    );
    // The same function counted in root: one VMCALL per call, no record.
    let started = call(
        c,
        Request::CountStart(protocol::CountFilter {
            functions: vec![func.into()],
            ..Default::default()
        }),
    );
    ck.check(
        matches!(started, Response::CountStarted { functions: 1, .. }),
        format!("count start on {func}: {started:?}"),
    );
    phases.push(measure(c, "hvtrace count (VMX root)"));
    match call(
        c,
        Request::CountRead {
            cursor: 0,
            limit: 10,
        },
    ) {
        Response::Counts(protocol::CountPage {
            calls,
            filtered,
            entries,
            ..
        }) => {
            // The benchmark's own calls, and getppid calls by anything
            // else in the window (none are expected in this guest).
            ck.eq("count: calls of the benchmark", calls, N);
            ck.eq("count: calls left out", filtered, 0);
            ck.check(
                entries.len() == 1 && entries[0].name == func,
                format!("count: one function, {func}: {entries:?}"),
            );
        }
        other => ck.check(false, format!("count read: {other:?}")),
    }
    ck.check(
        matches!(call(c, Request::CountStop), Response::Ok),
        "count stop",
    );
    let _ = stream.read(c);
    exec(
        c,
        &format!("cd {TRACEFS} && echo 'p:gbench {func}' > kprobe_events && echo 1 > events/kprobes/gbench/enable"),
    );
    phases.push(measure(c, "guest kprobe on ftrace"));
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/kprobes/gbench/enable && \
             echo 'p:gint3 {func}+{int3_at}' > kprobe_events && echo 1 > events/kprobes/gint3/enable"
        ),
    );
    phases.push(measure(c, "guest int3 kprobe"));
    let profile = exec(c, &format!("cd {TRACEFS} && echo 0 > events/kprobes/gint3/enable && cat kprobe_profile && echo > kprobe_events"));
    println!("benchmark: {N} getppid calls per phase (Bochs ips 50M: 1 emulated instruction = 20 ns of guest time)");
    println!(
        "  {:<26} {:>10} {:>12} {:>14} {:>9} {:>12} {:>11} {:>7}",
        "phase",
        "guest ns",
        "instr/call",
        "Bochs us/call",
        "VMCALLs",
        "EPT+#DB exits",
        "unshadowed",
        "INVEPT"
    );
    let base = phases[0].ns_per_call;
    for p in &phases {
        println!(
            "  {:<26} {:>10.0} {:>12.0} {:>14.1} {:>9} {:>12} {:>11} {:>7}   (+{:.0} instr/hit)",
            p.name,
            p.ns_per_call,
            p.ns_per_call / 20.0,
            p.wall_per_call * 1e6,
            p.vmcalls,
            p.other_exits,
            p.unshadowed,
            p.invept,
            (p.ns_per_call - base) / 20.0
        );
    }
    println!("  guest kprobe_profile: {}", profile.trim());
    ck.eq("VMCALLs with no probe", phases[0].vmcalls, 0);
    ck.eq("EPT/#DB exits with no probe", phases[0].other_exits, 0);
    ck.eq("probe hits", h1 - h0, N);
    ck.eq(
        "VMCALLs with our count (exactly one per call)",
        phases[2].vmcalls,
        N,
    );
    ck.eq(
        "VMCALLs with our probe (exactly one per hit)",
        phases[1].vmcalls,
        N,
    );
    ck.eq("EPT/#DB exits with our probe", phases[1].other_exits, 0);
    // Under nested KVM a hit costs its two exits (the VMCALL, the
    // VMRESUME) and nothing more: no VMCS access outside KVM's shadow
    // VMCS and no INVEPT per hit. A count reads no unshadowed field, nor
    // does a probe's record: GUEST_GS_BASE (for the running task) is read
    // once a turn, by the turn's first record. The allowance (N/20) is
    // for the vCPU's turns and the status requests around the loop.
    for (p, per_hit) in [(&phases[2], 0), (&phases[1], 0)] {
        ck.check(
            p.unshadowed <= per_hit * N + N / 20 && p.invept <= N / 20,
            format!(
                "{}: {} unshadowed VMCS accesses and {} INVEPTs over {N} hits (at most {per_hit} per hit)",
                p.name, p.unshadowed, p.invept
            ),
        );
    }
    ck.check(
        profile.contains("gint3") && profile.contains(&N.to_string()),
        format!("the guest's int3 kprobe was hit {N} times: {profile}"),
    );
}

fn exercise(guest: &str, fast_lane: bool) {
    let _l = vm_lock();
    let vm = if fast_lane {
        // The fast lane boots with the hostile module in its initramfs.
        let initrd = hvtrace::vm::guest::run_script("scripts/guest/attacker.sh")
            .expect("building the attacker module failed");
        Detached::start_with(
            guest,
            "kprobes",
            &[
                "--initrd",
                initrd.to_str().expect("initrd path is not UTF-8"),
            ],
        )
    } else {
        // Debian boots its default initramfs, as a user's `run` does: it
        // carries the kernel package's ext4 and loop modules (ext4_module).
        Detached::start_with(guest, "kprobes", &[])
    };
    let mut c = vm.client();
    let mut ck = Checks::new();
    let st = status(&mut c);
    ck.check(st.kernel.is_some(), "kernel recovered");
    let cmdline = exec(&mut c, "cat /proc/cmdline");
    ck.check(!cmdline.contains("nokaslr"), "KASLR on");
    exec(
        &mut c,
        &format!("[ -e {TRACEFS}/trace ] || mount -t tracefs nodev {TRACEFS}"),
    );
    let mut stream = Stream::new();
    bad_specs(&mut ck, &mut c);
    foreign_vmcall(&mut ck, &mut c);
    oracle(&mut ck, &mut c, &mut stream);
    coexistence(&mut ck, &mut c, &mut stream);
    function_tracer(&mut ck, &mut c, &mut stream);
    kprobes_btf::btf_args(&mut ck, &mut c, &mut stream, fast_lane);
    if fast_lane {
        attacker(&mut ck, &mut c, &mut stream);
        module_code(&mut ck, &mut c, &mut stream, vm.run_dir.as_deref());
        counted_module_churn(&mut ck, &mut c);
        intree_module(&mut ck, &mut c);
        benchmark(&mut ck, &mut c, &mut stream);
    } else {
        ext4_module(&mut ck, &mut c, &mut stream);
        kprobes_btf::btf_ext4(&mut ck, &mut c, &mut stream);
    }
    kprobes_syscalls::syscalls_oracle(&mut ck, &mut c, &vm);
    if fast_lane {
        kprobes_syscalls::syscalls_cost(&mut ck, &mut c, &vm);
    } else {
        kprobes_syscalls::syscalls_compat(&mut ck, &mut c, &vm);
    }
    count_oracle(&mut ck, &mut c, &vm);
    latency_oracle(&mut ck, &mut c, &vm);
    hist_oracle(&mut ck, &mut c, &vm);
    let t = status(&mut c).tracer;
    ck.eq("ring losses before the scale test", t.lost, 0);
    if fast_lane {
        scale(&mut ck, &mut c, &mut stream, vm.supervisor);
    } else {
        record_on_debian(&mut ck, &mut c, &vm);
    }
    let t = status(&mut c).tracer;
    println!("{guest}: tracer counters at the end: {t:?}");
    module_event_cost(&vm.emulator_output(), &t);
    let alive = exec(&mut c, "echo alive");
    ck.eq("guest still healthy", alive.trim(), "alive");
    ck.finish();
}

#[test]
fn kprobes_fast_lane() {
    exercise("fast", true);
}

#[test]
fn kprobes_debian() {
    exercise("debian", false);
}

/// The entries of a newc cpio archive, bare or gzip-compressed: (name,
/// contents).
fn cpio_entries(path: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let raw = std::fs::read(path).expect("cannot read the initramfs");
    let data = if raw.starts_with(&[0x1f, 0x8b]) {
        let out = std::process::Command::new("gzip")
            .arg("-dc")
            .arg(path)
            .output()
            .expect("cannot run gzip");
        assert!(out.status.success(), "gzip -dc {} failed", path.display());
        out.stdout
    } else {
        raw
    };
    let field = |at: usize, i: usize| {
        let hex = std::str::from_utf8(&data[at + 6 + 8 * i..at + 14 + 8 * i]).expect("cpio header");
        usize::from_str_radix(hex, 16).expect("cpio header field")
    };
    let pad4 = |n: usize| n.div_ceil(4) * 4;
    let mut entries = Vec::new();
    let mut at = 0;
    while at + 110 <= data.len() {
        assert_eq!(&data[at..at + 6], b"070701", "newc magic at {at}");
        let (size, name_size) = (field(at, 6), field(at, 11));
        let name = String::from_utf8_lossy(&data[at + 110..at + 110 + name_size - 1]).into_owned();
        let body = pad4(at + 110 + name_size);
        if name == "TRAILER!!!" {
            break;
        }
        entries.push((name, data[body..body + size].to_vec()));
        at = pad4(body + size);
    }
    entries
}

/// `--modules` without a VM. A name Debian's kernel package lacks is
/// refused in one line before anything boots. The default initramfs
/// carries ext4 and loop and what they need, in a depmod-made modules.dep;
/// one with `--modules udf` (whose crc-itu-t is in no default module's
/// dependencies) adds udf and crc-itu-t beside them.
#[test]
fn debian_modules_option_without_a_vm() {
    let _l = vm_lock();
    let mut ck = Checks::new();
    let out = std::process::Command::new(hvtrace_tests::hvtrace_bin())
        .args(["run", "--guest", "debian", "--bare", "--emulator", "bochs"])
        .args(["--modules", "loop,no_such_module", "--exec", "true"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("cannot run hvtrace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let kernel = hvtrace_tests::must(
        hvtrace::vm::guest::kernel(hvtrace::Guest::Debian),
        "the Debian kernel",
    );
    let release = hvtrace_tests::expected_release(&kernel);
    let package = std::fs::read_to_string(kernel.with_file_name("package")).unwrap_or_default();
    ck.eq("an unknown module: exit status", out.status.code(), Some(1));
    ck.eq(
        "an unknown module: the last line",
        stderr.lines().last().unwrap_or_default(),
        format!(
            "hvtrace: error: --modules: no module named no_such_module in {}",
            package.trim()
        ),
    );
    ck.check(
        !stderr.contains("starting bochs"),
        format!("nothing booted: {stderr}"),
    );

    let dir = format!("lib/modules/{release}");
    let files = |initrd: &std::path::Path| -> BTreeMap<String, Vec<u8>> {
        cpio_entries(initrd)
            .into_iter()
            .filter_map(|(name, data)| Some((name.strip_prefix(&dir)?.to_string(), data)))
            .collect()
    };
    let default_path = hvtrace_tests::must(
        hvtrace::vm::guest::default_initrd(hvtrace::Guest::Debian, &[]),
        "the Debian guest's initramfs",
    );
    // Bare: GRUB would spend seconds of the Bochs boot unpacking it.
    let head = std::fs::read(&default_path).unwrap_or_default();
    ck.check(
        head.starts_with(b"070701"),
        format!(
            "the Debian initramfs {} is a bare cpio archive",
            default_path.display()
        ),
    );
    let default = files(&default_path);
    let udf = files(&hvtrace_tests::must(
        hvtrace::vm::guest::debian_initrd(&["udf".to_string()]),
        "the Debian guest's initramfs with udf",
    ));
    let dep_line = |files: &BTreeMap<String, Vec<u8>>, module: &str| {
        let dep = String::from_utf8_lossy(files.get("/modules.dep").map_or(&[][..], |d| d));
        dep.lines()
            .find(|l| l.starts_with(&format!("{module}:")))
            .map(str::to_string)
    };
    for (what, files) in [("default", &default), ("with udf", &udf)] {
        for module in [
            "kernel/fs/ext4/ext4.ko",
            "kernel/fs/jbd2/jbd2.ko",
            "kernel/fs/mbcache.ko",
            "kernel/lib/crc16.ko",
            "kernel/crypto/crc32c_generic.ko",
            "kernel/drivers/block/loop.ko",
            "kernel/fs/fat/vfat.ko",
            "kernel/fs/isofs/isofs.ko",
        ] {
            ck.check(
                files.contains_key(&format!("/{module}")),
                format!("{what}: carries {module}"),
            );
        }
        ck.eq(
            &format!("{what}: ext4's line in modules.dep"),
            dep_line(files, "kernel/fs/ext4/ext4.ko"),
            Some("kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko".to_string()),
        );
    }
    println!(
        "Debian initramfs modules: default {}, with udf {}",
        default.keys().filter(|k| k.ends_with(".ko")).count(),
        udf.keys().filter(|k| k.ends_with(".ko")).count()
    );
    ck.check(
        !default.contains_key("/kernel/fs/udf/udf.ko")
            && !default.contains_key("/kernel/lib/crc-itu-t.ko"),
        "the default initramfs has no udf",
    );
    ck.eq(
        "udf's line in modules.dep",
        dep_line(&udf, "kernel/fs/udf/udf.ko"),
        Some(
            "kernel/fs/udf/udf.ko: kernel/lib/crc-itu-t.ko kernel/drivers/cdrom/cdrom.ko"
                .to_string(),
        ),
    );
    ck.check(
        udf.contains_key("/kernel/lib/crc-itu-t.ko"),
        "udf's dependency crc-itu-t is carried",
    );
    ck.finish();
}

/// The hostile module (guest/attacker): it reads a hooked function, writes
/// to the trampoline page, clears our page-table entry and executes VMCALL.
fn attacker(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let func = "do_sys_openat2";
    match call(
        c,
        Request::ProbeAdd {
            spec: format!("p:atk {func}"),
        },
    ) {
        Response::ProbeAdded { .. } => {}
        other => {
            ck.check(false, format!("probe add for the attack: {other:?}"));
            return;
        }
    }
    let kallsyms = exec(c, &format!("grep ' {func}$' /proc/kallsyms"));
    let addr = kallsyms
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .to_string();
    let before = status(c).tracer;
    let tramp = before.trampolines;
    ck.check(tramp != 0, "the trampoline address is reported");
    let log = exec(
        c,
        &format!(
            "dmesg -c >/dev/null; insmod /lib/hvattack.ko func=0x{addr} tramp={tramp:#x} clear_pmd=1 vmcall=1 2>/dev/null; dmesg | grep hvattack:"
        ),
    );
    println!("attacker:\n{}", log.trim_end());
    let read = log
        .lines()
        .find(|l| l.contains("hvattack: read"))
        .unwrap_or("")
        .to_string();
    let bytes = read.rsplit(": ").next().unwrap_or("");
    ck.check(
        bytes.starts_with("0f1f440000") || bytes.starts_with("f30f1efa0f1f440000"),
        format!("the guest reads its NOP5 at the hooked site: {read:?}"),
    );
    let wrote = log
        .lines()
        .find(|l| l.contains("wrote tramp frame"))
        .unwrap_or("");
    let parts: Vec<&str> = wrote.split_whitespace().collect();
    let val = |k: &str| {
        parts
            .iter()
            .position(|p| *p == k)
            .and_then(|i| parts.get(i + 1))
            .copied()
    };
    ck.check(
        val("before").is_some() && val("before") == val("after"),
        format!("the write to the trampoline page was discarded: {wrote:?}"),
    );
    ck.check(
        log.contains("vmcall raised #UD"),
        "a kernel-mode VMCALL outside the trampolines gets #UD",
    );
    let after = status(c).tracer;
    println!("attacker: counters before {before:?}\n          after {after:?}");
    ck.check(
        after.blocked_writes > before.blocked_writes,
        "the blocked write is counted",
    );
    ck.check(
        after.region_restores > before.region_restores,
        "the cleared page-table entry was restored",
    );
    // "hvattack: cleared pte X: now Y": the write must not have landed.
    let pte = log
        .lines()
        .find_map(|l| l.split("cleared pte ").nth(1))
        .and_then(|rest| rest.split_once(": now "))
        .map(|(x, y)| (x.trim().to_string(), y.trim().to_string()));
    ck.check(
        pte.as_ref().is_some_and(|(x, y)| x == y && x != "0"),
        format!("the write to our page-table page was discarded: {pte:?}"),
    );
    // busybox insmod may try a second load after the first is refused.
    // (The kernel also prints to the console, so lines can come twice.)
    let attempts = log
        .lines()
        .filter(|l| l.contains("vmcall raised #UD"))
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u64;
    ck.eq(
        "foreign VMCALLs after the attack (one per load)",
        after.foreign_vmcalls,
        before.foreign_vmcalls + attempts,
    );
    // The trampoline still works.
    let h0 = hits(c, "kprobes/atk");
    exec(c, &workload(3));
    let h1 = hits(c, "kprobes/atk");
    ck.check(
        h1 >= h0 + 3,
        format!("the probe still fires after the attack: {h0} -> {h1}"),
    );
    split_view_cost(ck, c, &addr);
    call(c, Request::ProbeDel { name: "atk".into() });
    let _ = stream.read(c);
}

/// The cost of a guest read of a hooked page (the split view's single-step
/// round trip), against reads of a page we do not hook, in the same boot.
fn split_view_cost(ck: &mut Checks, c: &mut Client, hooked: &str) {
    const N: u64 = 500;
    let other = exec(c, "grep ' vfs_statx$' /proc/kallsyms");
    let other = other.split_whitespace().next().unwrap_or("0").to_string();
    // (ns, loads) over the distinct "timed" lines of one insmod.
    let mut run = |addr: &str| -> (f64, u64, f64) {
        let steps0 = status(c).tracer.steps;
        let t0 = Instant::now();
        let log = exec(
            c,
            &format!("dmesg -c >/dev/null; insmod /lib/hvattack.ko func=0x{addr} reads={N} 2>/dev/null; dmesg | grep 'hvattack: timed'"),
        );
        let wall = t0.elapsed().as_secs_f64();
        let steps = status(c).tracer.steps - steps0;
        let lines: std::collections::BTreeSet<&str> = log.lines().map(str::trim).collect();
        let mut ns = 0.0;
        let mut reads = 0u64;
        for l in &lines {
            let w: Vec<&str> = l.split_whitespace().collect();
            if let Some(i) = w.iter().position(|x| *x == "ns") {
                ns += w[i - 1].parse::<f64>().unwrap_or(f64::NAN);
                reads += N;
            }
        }
        (
            ns / reads.max(1) as f64,
            steps / reads.max(1),
            wall / reads.max(1) as f64,
        )
    };
    let (hooked_ns, hooked_steps, hooked_wall) = run(hooked);
    let (plain_ns, plain_steps, plain_wall) = run(&other);
    println!(
        "split view: a 9-byte guest read of a hooked page costs {hooked_ns:.0} ns of guest time ({hooked_steps} single steps, {:.0} emulated instructions, {:.1} us of Bochs time) against {plain_ns:.0} ns ({plain_steps} steps, {:.1} us) unhooked: +{:.0} instructions per read",
        hooked_ns / 20.0,
        hooked_wall * 1e6,
        plain_wall * 1e6,
        (hooked_ns - plain_ns) / 20.0
    );
    ck.check(
        hooked_steps >= 1,
        format!("reads of a hooked page are stepped: {hooked_steps} per read"),
    );
    ck.eq("steps for reads of an unhooked page", plain_steps, 0);
}

/// `hvtrace count 'vfs_*' --comm dd --exec WORKLOAD` (the CLI, counting in
/// root) against the guest's own kprobes on every vfs_* function it can
/// probe, filtered on the same comm, over the same workload: the same
/// functions with the same counts.
fn count_oracle(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    const WORK: &str = "dd if=/dev/zero of=/dev/null bs=4096 count=40 2>/dev/null; \
                        dd if=/proc/version of=/dev/null bs=16 2>/dev/null; \
                        dd if=/etc/hostname of=/tmp/hvcount bs=1 2>/dev/null";
    let set_up = exec(
        c,
        &format!(
            "cd {TRACEFS} && for f in $(grep '^vfs_' available_filter_functions | cut -d' ' -f1 | sort -u); do \
               echo \"p:hvc/$f $f\" >> kprobe_events 2>/dev/null; done; \
             echo 'comm == \"dd\"' > events/hvc/filter && echo > trace && echo 1 > events/hvc/enable && \
             ls events/hvc | grep '^vfs_'"
        ),
    );
    let probed: BTreeSet<&str> = set_up.split_whitespace().collect();
    let guest_events = probed.len();
    ck.check(
        guest_events > 10,
        format!("the guest probes its vfs_* functions: {set_up:?}"),
    );
    let t0 = Instant::now();
    let (code, out, err) = vm.cli(&["count", "vfs_*", "--comm", "dd", "--exec", WORK]);
    let took = t0.elapsed();
    let trace = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/hvc/enable && grep -v '^#' trace; \
             for e in $(ls events/hvc | grep '^vfs_'); do echo \"-:hvc/$e\" >> kprobe_events; done; \
             echo > trace; rm -f /tmp/hvcount"
        ),
    );
    ck.eq("count exit code", code, 0);
    let mut ours = BTreeMap::new();
    let mut summary = "";
    for l in out.lines().skip(1) {
        match l
            .rsplit_once(' ')
            .map(|(n, v)| (n.trim(), v.parse::<u64>()))
        {
            Some((name, Ok(v))) if !name.is_empty() => {
                ours.insert(name.to_string(), v);
            }
            _ => summary = l,
        }
    }
    let mut guest: BTreeMap<String, u64> = BTreeMap::new();
    for l in parse_all(&trace) {
        // `vfs_read: (vfs_read+0x4/0x1a0)`
        if let Some((event, _)) = l.body.split_once(':') {
            *guest.entry(event.to_string()).or_default() += 1;
        }
    }
    println!(
        "count: {} functions called by dd, ours (CLI, {:.1} s) {ours:?}; {summary}",
        ours.len(),
        took.as_secs_f64()
    );
    println!("count: the guest's kprobes ({guest_events} events, comm filter) {guest:?}");
    if !err.trim().is_empty() {
        println!("count: stderr: {}", err.trim());
    }
    let reads = ours.get("vfs_read").copied().unwrap_or(0);
    ck.check(
        reads >= 41,
        format!("vfs_read counted at least 41 times for dd: {reads}"),
    );
    ck.check(!guest.is_empty(), "the guest's kprobes saw dd");
    // Every function both sides can see: the same count. A function the
    // guest could not probe is only listed.
    let ours_probed: BTreeMap<String, u64> = ours
        .iter()
        .filter(|(n, _)| probed.contains(n.as_str()))
        .map(|(n, v)| (n.clone(), *v))
        .collect();
    ck.eq(
        "count per function, ours against the guest's kprobes",
        &ours_probed,
        &guest,
    );
    let only_ours: Vec<&String> = ours
        .keys()
        .filter(|n| !ours_probed.contains_key(*n))
        .collect();
    if !only_ours.is_empty() {
        println!("count: counted by us only (the guest has no probe on them): {only_ours:?}");
    }
}

/// `hvtrace latency vfs_read --comm dd --exec DD` (timed in root through
/// the return hijack) against the guest's own function_graph over the same
/// `dd`, run alone before it: the same number of calls, and the calls in
/// the same log2 buckets of duration, ordered by duration and paired rank
/// for rank, give or take one bucket (each tracer's own overhead lands
/// inside what it measures). The slowest tenth is left out of the pairing:
/// the two runs are different calls, and which of them a timer interrupt
/// lands in differs from run to run.
fn latency_oracle(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    const DD: &str = "dd if=/dev/zero of=/dev/null bs=4096 count=40";
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo vfs_read > set_ftrace_filter && echo vfs_read > set_graph_function && \
             echo 0 > options/funcgraph-irqs && echo function_graph > current_tracer && echo > trace && \
             sh -c 'echo $$ > set_ftrace_pid; exec {DD} 2>/dev/null' && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_pid; echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt"
        ),
    );
    // `  0)   9.120 us    |  vfs_read();`
    let mut theirs: Vec<u64> = guest
        .lines()
        .filter(|l| l.contains("vfs_read();"))
        .filter_map(|l| {
            let left = l.split('|').next()?;
            let words: Vec<&str> = left.split_whitespace().collect();
            let unit = words
                .iter()
                .rposition(|w| ["ns", "us", "ms", "s"].contains(w))?;
            let v: f64 = words.get(unit.checked_sub(1)?)?.parse().ok()?;
            let scale = match words[unit] {
                "ns" => 1.0,
                "us" => 1e3,
                "ms" => 1e6,
                _ => 1e9,
            };
            Some((v * scale) as u64)
        })
        .collect();
    theirs.sort_unstable();
    let (code, out, err) = vm.cli(&[
        "latency",
        "vfs_read",
        "--comm",
        "dd",
        "--exec",
        &format!("{DD} 2>/dev/null"),
        "--json",
    ]);
    ck.eq("latency exit code", code, 0);
    let v: serde_json::Value = match serde_json::from_str(out.trim()) {
        Ok(v) => v,
        Err(e) => {
            ck.check(false, format!("latency --json: {e}: {out:?} {err:?}"));
            return;
        }
    };
    let hist: Vec<u64> = v["latency_ns_log2"]
        .as_array()
        .map(|a| a.iter().filter_map(|n| n.as_u64()).collect())
        .unwrap_or_default();
    // Our calls, bucket by bucket, in order of duration.
    let ours: Vec<usize> = hist
        .iter()
        .enumerate()
        .flat_map(|(b, &n)| std::iter::repeat_n(b, n as usize))
        .collect();
    let bucket = |ns: u64| (u64::BITS - ns.leading_zeros()) as usize;
    let guest_buckets: Vec<usize> = theirs.iter().map(|&ns| bucket(ns)).collect();
    println!(
        "latency: vfs_read by dd, ours {} calls {hist:?} (missed {}); the guest's function_graph {} calls, buckets {:?}",
        ours.len(),
        v["latency_missed"],
        theirs.len(),
        {
            let mut h = vec![0u64; guest_buckets.iter().max().map_or(0, |m| m + 1)];
            for &b in &guest_buckets {
                h[b] += 1;
            }
            h
        }
    );
    ck.eq(
        "latency: calls timed, ours and the guest's",
        ours.len(),
        theirs.len(),
    );
    ck.check(
        ours.len() >= 40,
        format!("latency: dd's 40 reads timed: {}", ours.len()),
    );
    let paired = ours.len().min(guest_buckets.len()) * 9 / 10;
    let off: Vec<(usize, usize)> = ours
        .iter()
        .zip(&guest_buckets)
        .take(paired)
        .filter(|(a, b)| a.abs_diff(**b) > 1)
        .map(|(a, b)| (*a, *b))
        .collect();
    ck.check(
        off.is_empty(),
        format!(
            "latency: the fastest {paired} calls within one log2 bucket of the guest's, rank for rank (ours, theirs): {off:?}"
        ),
    );
}

/// `hvtrace hist p vfs_read count=%dx:u64 --key comm --comm dd --exec` dd
/// runs of known block sizes: each read lands in its block size's bucket,
/// and the histogram equals the guest's own kprobe with the same fetch
/// argument and comm filter, bucketed here.
fn hist_oracle(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    const WORK: &str = "dd if=/dev/zero of=/dev/null bs=512 count=10 2>/dev/null; \
                        dd if=/dev/zero of=/dev/null bs=4096 count=5 2>/dev/null; \
                        dd if=/dev/zero of=/dev/null bs=65536 count=3 2>/dev/null";
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 'p:hvh/vr vfs_read count=%dx:u64' >> kprobe_events && \
             echo 'comm == \"dd\"' > events/hvh/vr/filter && echo > trace && echo 1 > events/hvh/vr/enable"
        ),
    );
    let (code, out, err) = vm.cli(&[
        "hist",
        "p vfs_read count=%dx:u64",
        "--key",
        "comm",
        "--comm",
        "dd",
        "--exec",
        WORK,
        "--json",
    ]);
    let trace = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/hvh/vr/enable && grep -v '^#' trace; \
             echo '-:hvh/vr' >> kprobe_events; echo > trace"
        ),
    );
    ck.eq("hist exit code", code, 0);
    let v: serde_json::Value = match serde_json::from_str(out.trim()) {
        Ok(v) => v,
        Err(e) => {
            ck.check(false, format!("hist --json: {e}: {out:?} {err:?}"));
            return;
        }
    };
    let rows = v["rows"].as_array().cloned().unwrap_or_default();
    let ours: BTreeMap<String, Vec<u64>> = rows
        .iter()
        .map(|r| {
            let b = r["buckets_log2"]
                .as_array()
                .map(|a| a.iter().filter_map(|n| n.as_u64()).collect())
                .unwrap_or_default();
            (r["key"].as_str().unwrap_or("").to_string(), b)
        })
        .collect();
    let bucket = |n: u64| (u64::BITS - n.leading_zeros()) as usize;
    let mut theirs = vec![0u64; 0];
    for l in parse_all(&trace) {
        // `vr: (vfs_read+0x4/0x1a0) count=512` (a u64 prints in decimal;
        // an x64 would be 0x...).
        let Some(v) = l.body.split(" count=").nth(1) else {
            continue;
        };
        let v = v.split_whitespace().next().unwrap_or("");
        let n = match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => v.parse(),
        };
        if let Ok(n) = n {
            let b = bucket(n);
            if theirs.len() <= b {
                theirs.resize(b + 1, 0);
            }
            theirs[b] += 1;
        }
    }
    println!(
        "hist: ours {ours:?} (overflow {}, faults {}); the guest's kprobe for dd {theirs:?}",
        v["overflow"], v["faults"]
    );
    ck.eq(
        "hist: one key, dd",
        ours.keys().collect::<Vec<_>>(),
        vec!["dd"],
    );
    let dd = ours.get("dd").cloned().unwrap_or_default();
    ck.eq(
        "hist: dd's histogram equals the guest's kprobe values",
        &dd,
        &theirs,
    );
    let at = |b: usize| dd.get(b).copied().unwrap_or(0);
    // 512 -> bucket 10, 4096 -> 13, 65536 -> 17: each run's reads at least.
    ck.check(
        at(10) >= 10 && at(13) >= 5 && at(17) >= 3,
        format!("hist: the block sizes' buckets hold their reads: {dd:?}"),
    );
    ck.eq("hist: overflow", v["overflow"].as_u64(), Some(0));
}

/// The function tracer on every traceable function during a workload: the
/// guest keeps running, and the losses are reported.
fn scale(ck: &mut Checks, c: &mut Client, stream: &mut Stream, supervisor: Option<u32>) {
    let _ = stream.read(c);
    let lost_before = stream.lost;
    let before = status(c);
    let t0 = Instant::now();
    let added = call(c, Request::FunctionAdd { glob: "*".into() });
    let hook_time = t0.elapsed();
    let (traced, skipped) = match added {
        Response::FunctionAdded {
            traced,
            skipped,
            skipped_total,
        } => {
            println!(
                "scale: '*' traced {traced} functions, skipped {skipped_total} ({skipped:?}) in {:.1} s",
                hook_time.as_secs_f64()
            );
            (traced, skipped_total)
        }
        other => {
            ck.check(false, format!("function add '*': {other:?}"));
            return;
        }
    };
    let traceable = before.kernel.as_ref().map_or(0, |k| k.traceable);
    ck.check(
        u64::from(traced) + u64::from(skipped) + 2 >= u64::from(traceable) / 2,
        format!("'*' reached the traceable functions: {traced} + {skipped} of {traceable}"),
    );
    let mid = status(c).tracer;
    println!("scale: hooked: {mid:?}");
    let cpu0 = supervisor.and_then(cpu_seconds);
    let t1 = Instant::now();
    let out = exec(c, "cat /etc/hostname; ls / | wc -l");
    let work = t1.elapsed();
    // The hits counted now have their records in the rings or on their
    // way, so the read below, until the stream goes quiet, sees every one
    // of them (and maybe later hits' lines too). Counted after the read,
    // hits that came between its last empty wait and the count would
    // have no line yet.
    let after = status(c);
    let lines = stream.read(c);
    let cpu1 = supervisor.and_then(cpu_seconds);
    let hits = after.tracer.hits - mid.hits;
    // The supervisor read the log port, decoded the frames, rendered the
    // records and kept the lines: its CPU time per million lines bounds
    // what rendering on the host costs.
    if let (Some(a), Some(b)) = (cpu0, cpu1) {
        let n = lines.lines().count().max(1) as f64;
        println!(
            "scale: the supervisor used {:.2} CPU s for {n} lines: {:.2} CPU s per million",
            b - a,
            (b - a) * 1e6 / n
        );
    }
    println!(
        "scale: workload took {:.1} s under '*': {hits} hits, {} lines streamed, {} lost in the ring, {} lost on the way",
        work.as_secs_f64(),
        lines.lines().count(),
        after.tracer.lost,
        stream.lost
    );
    ck.check(
        out.contains("hvtrace-guest"),
        format!("workload output: {out:?}"),
    );
    ck.check(hits > 1000, format!("'*' saw the workload: {hits} hits"));
    // The trace stream takes the log port, which keeps up with the guest:
    // every hit reaches the host (on COM2 alone, 96% of them were lost).
    let streamed = lines.lines().count() as u64;
    // Ring losses reach the stream with the next text; the launcher's own
    // drops only the stream's count.
    let lost = (after.tracer.lost - mid.lost).max(stream.lost - lost_before);
    println!(
        "scale: {streamed} lines in {:.1} s = {:.0} lines/s; {lost} lost ({:.2}%); log port: {} frames, {} bytes",
        work.as_secs_f64(),
        streamed as f64 / work.as_secs_f64(),
        lost as f64 * 100.0 / hits.max(1) as f64,
        after.channel.bulk_frames - before.channel.bulk_frames,
        after.channel.bulk_bytes - before.channel.bulk_bytes,
    );
    ck.check(
        after.channel.bulk_frames > before.channel.bulk_frames,
        "the trace stream took the log port",
    );
    ck.check(
        lost * 100 <= hits,
        format!("'*' lost at most 1% of its hits: {lost} of {hits}"),
    );
    ck.check(
        streamed + lost >= hits,
        format!(
            "every hit was streamed or counted lost: {streamed} lines + {lost} lost, {hits} hits"
        ),
    );
    ck.check(
        matches!(call(c, Request::FunctionClear), Response::Ok),
        "function clear after '*'",
    );
    let end = status(c).tracer;
    ck.eq("sites after clearing '*'", end.sites, 0);
    ck.eq("shadow pages after clearing '*'", end.pages, 0);
    let alive = exec(c, "echo alive");
    ck.eq("guest alive after '*'", alive.trim(), "alive");
}

/// (pid, body) of the trace lines of `text` whose body starts with
/// `prefix`, sorted.
fn pid_bodies(text: &str, prefix: &str) -> Vec<(i32, String)> {
    let mut v: Vec<(i32, String)> = parse_all(text)
        .into_iter()
        .filter(|l| l.body.starts_with(prefix))
        .map(|l| (l.pid, l.body))
        .collect();
    v.sort();
    v
}

/// Prints what serving each module load and unload cost in root, from the
/// hypervisor's log (`module Load at ... served in N us of root time`),
/// with Bochs' 50 M instructions a second of guest time.
fn module_event_cost(log: &str, t: &protocol::TracerReport) {
    let mut us: Vec<(bool, u64)> = log
        .lines()
        .filter_map(|l| {
            let load = l.contains("module Load at");
            if !load && !l.contains("module Unload at") {
                return None;
            }
            let n = l.split("served in ").nth(1)?.split_whitespace().next()?;
            Some((load, n.parse().ok()?))
        })
        .collect();
    if us.is_empty() {
        return;
    }
    us.sort_by_key(|&(_, n)| n);
    for load in [true, false] {
        let v: Vec<u64> = us.iter().filter(|e| e.0 == load).map(|e| e.1).collect();
        if let (Some(min), Some(max)) = (v.first(), v.last()) {
            let median = v[v.len() / 2];
            println!(
                "module {}: {} served (status: {}), root time min/median/max {min}/{median}/{max} us = {}/{}/{} guest instructions at 50 M/s",
                if load { "loads" } else { "unloads" },
                v.len(),
                if load { t.module_loads } else { t.module_unloads },
                min * 50,
                median * 50,
                max * 50
            );
        }
    }
}

/// Our symbols of `module` against the guest's `/proc/kallsyms` lines for
/// it. The kernel lists a module's own symbols (its symtab, which we read),
/// then, when a guest ftrace user was registered as the module's init
/// memory was freed, ftrace's saved names of the freed init functions
/// (`ftrace_mod_maps`, shown as `T` after every module's own symbols).
/// Ours must equal the first part exactly, in order; the rest must be
/// such entries only: `T`, an init function's name, not one of ours.
fn same_module_symbols(
    ck: &mut Checks,
    module: &str,
    ours: &[(u64, char, String)],
    guest: &[(u64, char, String)],
) {
    let (own, rest) = guest.split_at(ours.len().min(guest.len()));
    ck.eq(
        &format!("[{module}] symbols equal the guest's own symbols in /proc/kallsyms"),
        ours,
        own,
    );
    let foreign: Vec<&(u64, char, String)> = rest
        .iter()
        .filter(|(addr, kind, name)| {
            *kind != 'T' || !name.contains("init") || ours.iter().any(|o| o.0 == *addr)
        })
        .collect();
    println!(
        "[{module}]: {} symbols equal; the guest also lists {} freed init functions ftrace keeps: {:?}",
        own.len(),
        rest.len(),
        rest.iter().map(|r| r.2.as_str()).take(10).collect::<Vec<_>>()
    );
    ck.eq(
        &format!("[{module}] guest lines after its own symbols that are not ftrace's freed init functions"),
        foreign,
        Vec::<&(u64, char, String)>::new(),
    );
}

/// CPU seconds (user and system) process `pid` has used, from
/// /proc/PID/stat (clock ticks of 1/100 s, as Linux reports them to
/// user space on x86-64).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(") ")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state is field 3, utime 14 and stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// The guest's `/proc/kallsyms` lines of `module`, as (address, type,
/// name), in its order.
fn guest_module_kallsyms(c: &mut Client, module: &str) -> Vec<(u64, char, String)> {
    exec(c, &format!("grep '\\[{module}\\]$' /proc/kallsyms"))
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let addr = u64::from_str_radix(f.next()?, 16).ok()?;
            let kind = f.next()?.chars().next()?;
            Some((addr, kind, f.next()?.to_string()))
        })
        .collect()
}

/// The test module's symbols from our walk of the module list, as
/// (address, type, name), in our order.
fn module_symbols(c: &mut Client, module: &str) -> Vec<protocol::SymbolInfo> {
    let mut cursor = 0;
    let mut out = Vec::new();
    loop {
        let req = Request::Syms {
            glob: "*".into(),
            kinds: String::new(),
            module: module.into(),
            cursor,
            limit: 1000,
        };
        match call(c, req) {
            Response::Syms { next, symbols, .. } => {
                out.extend(symbols);
                match next {
                    Some(n) => cursor = n,
                    None => return out,
                }
            }
            other => panic!("syms failed: {other:?}"),
        }
    }
}

/// The probe on the test module's function, ours and the guest's.
const MPROBE: &str = "p:modsum hvtarget:hvtarget_sum n=%di:s32";
/// A probe on the module's init function, in its init text.
const IPROBE: &str = "p:modinit hvtarget:hvtarget_init";
const POKE: &str = "/sys/module/hvtarget/parameters/poke";

/// Module code (guest/attacker/hvtarget.c), against the guest's own
/// tracers, in the order a user meets it:
/// - a `MOD:SYM` probe before the module loads is pending, ours and the
///   guest's own; at `insmod` both fire on the module's init call (root
///   armed ours before the init ran);
/// - our symbols for the module equal its `/proc/kallsyms` lines;
/// - the probe's events over pokes equal the guest's, the function tracer
///   over `hvtarget_*` equals the guest's, and a graph rooted in the
///   module equals the guest's function_graph;
/// - `rmmod` with the probe, the function tracer and the graph session on
///   the module: the guest lives, nothing of ours stays on the module's
///   text, the probe is pending again; `insmod` re-arms it and it fires;
/// - 20 rounds of unload, load and a poke with the probe armed: sites,
///   pages and return stacks back to the same figures after each.
fn module_code(
    ck: &mut Checks,
    c: &mut Client,
    stream: &mut Stream,
    run_dir: Option<&std::path::Path>,
) {
    module_pending_probe_fires_at_load(ck, c, stream);
    module_symbols_match_the_guests(ck, c, run_dir);
    let session = module_probe_and_functions_match_the_guests(ck, c, stream);
    module_unload_with_everything_on(ck, c, session);
    module_reload_follows_globs_and_init_probes(ck, c, stream);
    module_churn_leaves_no_trace(ck, c, stream);
}

fn module_pending_probe_fires_at_load(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    // Pending, ours and the guest's.
    match call(
        c,
        Request::ProbeAdd {
            spec: MPROBE.into(),
        },
    ) {
        Response::ProbeAdded { name, site } => {
            ck.eq("pending probe name", name.as_str(), "kprobes/modsum");
            ck.eq("a pending probe has no site", site, 0);
        }
        other => ck.check(false, format!("probe on a module not loaded: {other:?}")),
    }
    ck.eq(
        "listed as pending",
        pending(c, "kprobes/modsum"),
        Some(true),
    );
    let t = status(c).tracer;
    // do_init_module, free_module and module_arch_freeing_init.
    ck.eq("root's hooks on the module code", t.module_hooks, 3);
    ck.eq("pending probes", t.pending_probes, 1);
    let _ = stream.read(c);
    // Its init runs hvtarget_sum(3) (1 + 4 + 7 = 12).
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{MPROBE}' >> kprobe_events && echo 1 > events/kprobes/modsum/enable && \
             echo > trace && insmod /lib/hvtarget.ko && echo last=$(cat /sys/module/hvtarget/parameters/last) && cat trace"
        ),
    );
    let ours = stream.read(c);
    ck.check(
        guest.contains("last=12"),
        format!("module loaded, its init ran: {guest}"),
    );
    let (g, o) = (
        pid_bodies(&guest, "modsum: "),
        pid_bodies(&ours, "modsum: "),
    );
    println!("pending probe at load: ours {o:?}, guest {g:?}");
    ck.check(
        g.len() == 1 && g[0].1.ends_with(" n=3"),
        format!("the guest's pending probe fired on the init call: {g:?}"),
    );
    ck.eq(
        "our pending probe fired on the init call, as the guest's",
        &o,
        &g,
    );
    ck.eq(
        "armed once loaded",
        pending(c, "kprobes/modsum"),
        Some(false),
    );
    let t = status(c).tracer;
    ck.check(
        t.module_loads >= 1 && t.module_armed == 1 && t.pending_probes == 0,
        format!("loads and armed probes: {t:?}"),
    );
}

fn module_symbols_match_the_guests(
    ck: &mut Checks,
    c: &mut Client,
    run_dir: Option<&std::path::Path>,
) {
    // Symbols.
    let t0 = Instant::now();
    let ours = module_symbols(c, "hvtarget");
    let took = t0.elapsed();
    let guest = guest_module_kallsyms(c, "hvtarget");
    let mine: Vec<(u64, char, String)> = ours
        .iter()
        .map(|s| (s.addr, char::from(s.kind), s.name.clone()))
        .collect();
    let st = status(c);
    let report = st
        .kernel
        .as_ref()
        .map(|k| k.modules.clone())
        .unwrap_or_default();
    println!(
        "module symbols: guest {}, ours {} (listed in {:.1} s); walk: {report:?}",
        guest.len(),
        mine.len(),
        took.as_secs_f64()
    );
    ck.check(
        guest.iter().any(|s| s.2 == "hvtarget_sum") && guest.len() >= 6,
        format!("the guest lists the module's symbols: {guest:?}"),
    );
    same_module_symbols(ck, "hvtarget", &mine, &guest);
    // The host's copy follows the load: root sends the modules' index
    // again once they change, and the run directory's listing has the
    // module's lines as /proc/kallsyms prints them.
    let listing = run_dir.map(|d| d.join("kallsyms"));
    let t0 = Instant::now();
    let mut host = Vec::new();
    while t0.elapsed() < Duration::from_secs(30) {
        let text = listing
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        host = text
            .lines()
            .filter_map(|l| l.strip_suffix("\t[hvtarget]"))
            .filter_map(|l| {
                let mut f = l.split(' ');
                let addr = u64::from_str_radix(f.next()?, 16).ok()?;
                let kind = f.next()?.chars().next()?;
                Some((addr, kind, f.next()?.to_string()))
            })
            .collect::<Vec<_>>();
        if !host.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "host listing: {} [hvtarget] lines {:.1} s after the symbols were listed",
        host.len(),
        t0.elapsed().as_secs_f64()
    );
    ck.eq(
        "the host's listing of [hvtarget] equals our walk's",
        &host,
        &mine,
    );
    ck.check(
        ours.iter().all(|s| s.module == "hvtarget"),
        "every listed symbol is the module's",
    );
    let traceable: Vec<&str> = ours
        .iter()
        .filter(|s| s.site.is_some())
        .map(|s| s.name.as_str())
        .collect();
    ck.eq(
        "traceable module functions",
        traceable,
        vec!["hvtarget_leaf", "hvtarget_sum", "hvtarget_poke"],
    );
    ck.check(
        report.error.is_none() && report.modules >= 1,
        format!("module walk: {report:?}"),
    );
}

fn module_probe_and_functions_match_the_guests(
    ck: &mut Checks,
    c: &mut Client,
    stream: &mut Stream,
) -> Option<(u32, u32)> {
    // The probe over pokes, against the guest's.
    match call(
        c,
        Request::ProbeAdd {
            spec: "p:nosuch hvtarget:hvtarget_nosuch".into(),
        },
    ) {
        Response::Error { kind, message } => {
            ck.eq(
                "unknown symbol in a loaded module: kind",
                kind,
                ErrorKind::NotFound,
            );
            ck.check(
                message.contains("hvtarget_nosuch") && !message.contains('\n'),
                format!("unknown symbol in a loaded module: {message}"),
            );
        }
        other => ck.check(false, format!("unknown module symbol accepted: {other:?}")),
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > trace && for n in 4 7 9; do echo $n > {POKE}; done && cat trace"
        ),
    );
    let ours = stream.read(c);
    // The guest prints a pid's recorded comm, which may be missing
    // (`<...>`) for the shell: compare by pid and body.
    let (g, o) = (
        pid_bodies(&guest, "modsum: "),
        pid_bodies(&ours, "modsum: "),
    );
    for l in o.iter().take(1) {
        println!("  ours:  {l:?}");
    }
    for l in g.iter().take(1) {
        println!("  guest: {l:?}");
    }
    ck.eq("guest kprobe events on the module function", g.len(), 3);
    ck.check(
        g.iter().all(|l| l.1.contains(" [hvtarget])")) && g.iter().any(|l| l.1.ends_with(" n=7")),
        format!("the guest's module probe lines: {g:?}"),
    );
    ck.eq("our module probe events equal the guest's", &o, &g);

    // The function tracer over the module's functions, against the
    // guest's; ours stays on for the unload.
    match call(
        c,
        Request::FunctionAdd {
            glob: "hvtarget_*".into(),
        },
    ) {
        Response::FunctionAdded { traced, .. } => ck.eq("module functions traced", traced, 3),
        other => ck.check(
            false,
            format!("function add on the module failed: {other:?}"),
        ),
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 'hvtarget_*' > set_ftrace_filter && echo function > current_tracer && \
             echo > trace && echo 5 > {POKE} && cat trace; \
             echo nop > current_tracer; echo > set_ftrace_filter"
        ),
    );
    let ours = stream.read(c);
    let (g, o) = (
        pid_bodies(&guest, "hvtarget_"),
        pid_bodies(&ours, "hvtarget_"),
    );
    println!(
        "module function tracer: guest {} lines, ours {}; e.g. {:?}",
        g.len(),
        o.len(),
        o.first()
    );
    // hvtarget_poke, hvtarget_sum and five hvtarget_leaf calls.
    ck.eq("guest function lines for one poke of 5", g.len(), 7);
    ck.eq("our module function lines equal the guest's", &o, &g);
    module_graph(ck, c, stream)
}

fn module_unload_with_everything_on(ck: &mut Checks, c: &mut Client, session: Option<(u32, u32)>) {
    // Unload with all of it on the module.
    let before = status(c).tracer;
    let out = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/kprobes/modsum/enable && rmmod hvtarget && echo unloaded; echo alive"
        ),
    );
    ck.check(
        out.contains("unloaded") && out.contains("alive"),
        format!("rmmod with our hooks on the module: {out}"),
    );
    let t = status(c).tracer;
    println!("unload: before {before:?}\n        after {t:?}");
    // The graph session's core functions stay hooked; its 3 module
    // functions went, with the probe's and the function tracer's. The
    // session has roots and callees: root's scheduler hook picks the
    // vCPU's view (the quiet one leaves the callees unhooked).
    let graph_core = session.map_or(0, |(_, hooked)| hooked.saturating_sub(3));
    ck.check(
        t.switch_hook,
        "the scheduler hook is in for the rooted session",
    );
    ck.eq(
        "sites left after the unload: root's three module hooks, its scheduler hook and the graph's core functions",
        (t.sites, t.module_hooks),
        (3 + 1 + graph_core, 3),
    );
    ck.eq("function tracer functions after the unload", t.functions, 0);
    ck.eq(
        "pending again after the unload",
        pending(c, "kprobes/modsum"),
        Some(true),
    );
    ck.check(
        t.module_unloads == before.module_unloads + 1
            && t.module_unhooked >= before.module_unhooked + 3,
        format!("the unload was seen and the module's sites unhooked: {t:?}"),
    );
    if let Some((s, _)) = session {
        ck.check(
            hv_graph_stop(c, s),
            "graph session on the unloaded module stopped",
        );
    }
    ck.eq("sites after the graph stops", status(c).tracer.sites, 3);
    ck.check(
        matches!(call(c, Request::FunctionClear), Response::Ok),
        "function clear",
    );
}

fn module_reload_follows_globs_and_init_probes(
    ck: &mut Checks,
    c: &mut Client,
    stream: &mut Stream,
) {
    // Module globs, set while the module is out, cover it from its next
    // load on: our function tracer on `hvtarget:hvtarget_*` against the
    // guest's cached `:mod:` filter, and a graph session rooted at
    // `hvtarget:hvtarget_sum`.
    let follow = follow_module_globs(ck, c, stream.cursor);

    // A probe on the module's init function (init text), pending, ours
    // and the guest's.
    match call(
        c,
        Request::ProbeAdd {
            spec: IPROBE.into(),
        },
    ) {
        Response::ProbeAdded { site, .. } => ck.eq("init probe pending: no site", site, 0),
        other => ck.check(
            false,
            format!("probe on a module's init function: {other:?}"),
        ),
    }
    let freed0 = status(c).tracer;

    // Load again: armed again, it fires on the init call, as the guest's;
    // the module globs' functions (the init function among them) are
    // hooked before the init runs too.
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{IPROBE}' >> kprobe_events && echo 1 > events/kprobes/modinit/enable && \
             echo 'hvtarget_*:mod:hvtarget' > set_ftrace_filter && echo function > current_tracer && \
             echo 1 > events/kprobes/modsum/enable && echo > trace && \
             insmod /lib/hvtarget.ko && cat trace; echo 0 > events/kprobes/modsum/enable; \
             echo 0 > events/kprobes/modinit/enable; echo nop > current_tracer; echo > set_ftrace_filter"
        ),
    );
    let ours = stream.read(c);
    let (g, o) = (
        pid_bodies(&guest, "modinit: "),
        pid_bodies(&ours, "modinit: "),
    );
    println!("init probe at load: ours {o:?}, guest {g:?}");
    ck.check(
        g.len() == 1 && g[0].1.contains("(hvtarget_init+0x") && g[0].1.ends_with(" [hvtarget])"),
        format!("the guest's probe on the init function fired once: {g:?}"),
    );
    ck.eq("our probe on the init function, as the guest's", &o, &g);
    // The init returned and its text is about to be freed: our hooks there
    // went first, and the probe waits for the next load, as the guest's.
    let t = status(c).tracer;
    ck.eq(
        "init probe pending again once the init text is freed",
        pending(c, "kprobes/modinit"),
        Some(true),
    );
    ck.check(
        t.module_inits_freed == freed0.module_inits_freed + 1
            && t.module_init_unhooked == freed0.module_init_unhooked + 1,
        format!("the init text's one site unhooked before it was freed: {t:?}"),
    );
    let (g, o) = (
        pid_bodies(&guest, "modsum: "),
        pid_bodies(&ours, "modsum: "),
    );
    ck.check(
        g.len() == 1 && g[0].1.ends_with(" n=3"),
        format!("the guest's probe fired on the second load: {g:?}"),
    );
    ck.eq("ours re-armed at the second load, as the guest's", &o, &g);
    ck.eq(
        "armed after the second load",
        pending(c, "kprobes/modsum"),
        Some(false),
    );
    let (g, o) = (
        pid_bodies(&guest, "hvtarget_"),
        pid_bodies(&ours, "hvtarget_"),
    );
    println!("module glob at load: ours {o:?}\n  guest {g:?}");
    // The init function (init text), its hvtarget_sum(3) and the three
    // hvtarget_leaf calls.
    ck.check(
        g.len() == 5
            && g.iter().any(|l| l.1.contains("hvtarget_init <-"))
            && g.iter().all(|l| !l.1.contains("hvtarget_poke")),
        format!("the guest's cached :mod: filter traced the init's calls: {g:?}"),
    );
    // The graph session that follows the module (below) hijacks the
    // returns of hvtarget_sum and hvtarget_leaf before the guest's
    // function tracer, chained after ours, reads their return slots: it
    // prints our return trampoline as their parent (docs/TRACER.md, the
    // guest's unwinder). Ours names it; otherwise the lines are the same.
    let tramp = status(c).tracer.trampolines;
    let in_tramp = |parent: &str| {
        parent
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .is_some_and(|a| a >= tramp && a < tramp + (2 << 20))
    };
    let same = o.len() == g.len()
        && o.iter().zip(&g).all(|(a, b)| {
            let (fa, pa) = a.1.split_once(" <-").unwrap_or((&a.1, ""));
            let (fb, pb) = b.1.split_once(" <-").unwrap_or((&b.1, ""));
            a.0 == b.0 && fa == fb && (pa == pb || in_tramp(pb))
        });
    ck.check(
        same,
        format!("our module glob traced the init's calls, as the guest's :mod: filter: ours {o:?}, guest {g:?}"),
    );
    ck.check(
        o.iter().any(|l| l.1 == "hvtarget_sum <-hvtarget_init")
            && o.iter()
                .filter(|l| l.1 == "hvtarget_leaf <-hvtarget_sum")
                .count()
                == 3,
        format!("our parents at the load, init text included: {o:?}"),
    );
    if let Some((session, mut text)) = follow {
        followed_graph(ck, c, stream, session, &mut text);
    }
}

fn module_churn_leaves_no_trace(ck: &mut Checks, c: &mut Client, stream: &Stream) {
    // Churn: unload, load and poke, 20 times, with the probe armed.
    // Frames are not among the figures: EPT tables made to split a large
    // page for a module page stay (bounded by guest RAM), and a module
    // may land on other pages at each load. The heap is.
    let churn = format!("rmmod hvtarget && insmod /lib/hvtarget.ko && echo 2 > {POKE} && echo ok");
    // A warm-up round first: the figures after it are the baseline.
    let (_, _) = churn_rounds(c, &churn, 1, (0, 0, 0, 0));
    let memory0 = status(c).hv_memory_used;
    let (base, heap0) = churn_figures(c);
    let hits0 = hits(c, "kprobes/modsum");
    let loads0 = status(c).tracer.module_loads;
    let followed0 = status(c).tracer.module_followed;
    let inits0 = status(c).tracer;
    let init_hits0 = hits(c, "kprobes/modinit");
    let (drift, heap) = churn_rounds(c, &churn, 20, base);
    check_churn_heap(ck, "hvtarget churn", heap0, &heap);
    let t = status(c).tracer;
    // hvtarget_init, _sum, _leaf and _poke at each load; the init
    // function's site unhooked as each init text is freed.
    ck.eq(
        "functions hooked for the module glob in the churn",
        t.module_followed - followed0,
        80,
    );
    ck.eq(
        "init texts freed and their sites unhooked in the churn",
        (
            t.module_inits_freed - inits0.module_inits_freed,
            t.module_init_unhooked - inits0.module_init_unhooked,
        ),
        (20, 20),
    );
    ck.eq(
        "init probe hits in the churn",
        hits(c, "kprobes/modinit") - init_hits0,
        20,
    );
    println!(
        "churn: baseline (sites, pages, stacks, frames) {base:?}; loads {} -> {}, probe hits +{}, hypervisor memory {} -> {} KiB",
        loads0,
        t.module_loads,
        hits(c, "kprobes/modsum") - hits0,
        memory0 >> 10,
        status(c).hv_memory_used >> 10
    );
    ck.eq(
        "rounds whose figures left the baseline",
        &drift,
        &Vec::new(),
    );
    ck.eq("loads seen in the churn", t.module_loads - loads0, 20);
    // Each round: the init's call and the poke's.
    ck.eq(
        "probe hits in the churn",
        hits(c, "kprobes/modsum") - hits0,
        40,
    );
    ck.check(
        matches!(call(c, Request::FunctionClear), Response::Ok),
        "function clear drops the module glob",
    );
    delete_probes(ck, c, &["modsum", "modinit"], "after the churn");
    ck.eq("stream losses", stream.lost, 0);
}

/// With the module out: our function tracer on `hvtarget:hvtarget_*` and
/// a graph session rooted at `hvtarget:hvtarget_sum` over `hvtarget:*` are
/// accepted with nothing traced yet, and follow the module. Returns the
/// session and its text stream.
fn follow_module_globs(ck: &mut Checks, c: &mut Client, cursor: u64) -> Option<(u32, Stream)> {
    match call(
        c,
        Request::FunctionAdd {
            glob: "hvtarget:hvtarget_*".into(),
        },
    ) {
        Response::FunctionAdded { traced, .. } => {
            ck.eq("a module glob with the module out: traced now", traced, 0)
        }
        other => ck.check(false, format!("function add with a module glob: {other:?}")),
    }
    let filter = protocol::GraphFilter {
        functions: vec!["hvtarget:hvtarget_sum".into()],
        trace: vec!["hvtarget:*".into()],
        ..protocol::GraphFilter::default()
    };
    let session = match call(c, Request::GraphStart(filter)) {
        Response::GraphStarted { session, roots, .. } => {
            ck.eq("graph roots while the module is out", roots, 0);
            Some(session)
        }
        other => {
            ck.check(false, format!("graph on a module glob refused: {other:?}"));
            None
        }
    };
    let t = status(c).tracer;
    ck.eq(
        "module globs followed, hidden hooks in",
        (t.module_globs, t.module_hooks),
        (2, 3),
    );
    session.map(|s| (s, Stream::of(s, protocol::TraceFormat::Text, cursor)))
}

/// The graph session started before the load: it caught the init's
/// hvtarget_sum(3) tree, and over a poke it equals the guest's own
/// function_graph rooted at hvtarget_sum. Stops the session.
fn followed_graph(
    ck: &mut Checks,
    c: &mut Client,
    stream: &mut Stream,
    session: u32,
    ours: &mut Stream,
) {
    let leaf = || Node::Leaf(1, "hvtarget_leaf [hvtarget]".to_string());
    let at_load = parse_graph(&ours.read(c));
    ck.eq(
        "the graph rooted at a module glob caught the init's call",
        at_load,
        vec![
            Node::Open(0, "hvtarget_sum [hvtarget]".to_string()),
            leaf(),
            leaf(),
            leaf(),
            Node::Close(0),
        ],
    );
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 'hvtarget_*' > set_ftrace_filter && \
             echo hvtarget_sum > set_graph_function && echo 0 > options/funcgraph-irqs && \
             echo function_graph > current_tracer && echo > trace && echo 2 > {POKE} && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt"
        ),
    );
    let (g, o) = (parse_graph(&guest), parse_graph(&ours.read(c)));
    let _ = stream.read(c);
    ck.check(
        g.len() == 4 && g.first() == Some(&Node::Open(0, "hvtarget_sum [hvtarget]".into())),
        format!("the guest's graph under hvtarget_sum over a poke of 2: {g:?}"),
    );
    ck.eq("the followed module's graph equals the guest's", &o, &g);
    ck.check(hv_graph_stop(c, session), "followed graph session stopped");
}

/// A graph session rooted at the module's hvtarget_poke, over its own
/// functions and the core kernel's capability check it calls, against the
/// guest's own function_graph with the same root and filter: module and
/// core frames interleave in one tree. Returns the session, left running,
/// and the functions it hooked.
fn module_graph(ck: &mut Checks, c: &mut Client, stream: &mut Stream) -> Option<(u32, u32)> {
    const SET: [&str; 5] = [
        "hvtarget_*",
        "capable",
        "ns_capable*",
        "security_capable",
        "cap_capable",
    ];
    let _ = stream.read(c);
    let filter = protocol::GraphFilter {
        functions: vec!["hvtarget_poke".into()],
        trace: SET.iter().map(|s| s.to_string()).collect(),
        ..protocol::GraphFilter::default()
    };
    let session = match call(c, Request::GraphStart(filter)) {
        Response::GraphStarted {
            session,
            roots,
            hooked,
            ..
        } => {
            ck.eq("module graph roots", roots, 1);
            (session, hooked)
        }
        other => {
            ck.check(false, format!("graph on the module refused: {other:?}"));
            return None;
        }
    };
    let (session, hooked) = session;
    let mut ours = Stream::of(session, protocol::TraceFormat::Text, stream.cursor);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > set_ftrace_filter && for g in {}; do echo \"$g\" >> set_ftrace_filter; done; \
             echo hvtarget_poke > set_graph_function && echo 0 > options/funcgraph-irqs && \
             echo function_graph > current_tracer && echo > trace && \
             echo 3 > /sys/module/hvtarget/parameters/poke && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt",
            SET.iter().map(|g| format!("'{g}'")).collect::<Vec<_>>().join(" ")
        ),
    );
    let text = ours.read(c);
    let _ = stream.read(c);
    let (g, o) = (parse_graph(&guest), parse_graph(&text));
    for line in text.lines().filter(|l| l.contains('|')).take(12) {
        println!("  ours:  {line}");
    }
    for line in guest.lines().filter(|l| l.contains('|')).take(12) {
        println!("  guest: {line}");
    }
    ck.check(
        g.iter()
            .any(|n| matches!(n, Node::Open(0, f) if f == "hvtarget_poke [hvtarget]"))
            && g.iter()
                .any(|n| matches!(n, Node::Open(1, f) | Node::Leaf(1, f) if f == "capable"))
            && g.iter()
                .filter(|n| matches!(n, Node::Leaf(2, f) if f == "hvtarget_leaf [hvtarget]"))
                .count()
                == 3,
        format!("the guest's graph under hvtarget_poke: {g:?}"),
    );
    ck.eq("our module graph equals the guest's", &o, &g);
    Some((session, hooked))
}

/// Debian's own ext4 module, as a user meets it: a probe on
/// `ext4:ext4_file_open` defined before ext4 loads is pending, ours and the
/// guest's own; `modprobe ext4`, a file system made with mke2fs on a loop
/// device, and opens of a file there fire both the same way; our symbols
/// for `[ext4]` equal the guest's `/proc/kallsyms`; after `umount` and
/// `rmmod ext4` ours is pending again and nothing of ours stays on ext4's
/// text; `modprobe` again re-arms it and it fires.
fn ext4_module(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const EPROBE: &str = "p:extopen ext4:ext4_file_open";
    const MOUNT: &str = "mkdir -p /mnt/ext && mount -t ext4 -o loop /tmp/ext.img /mnt/ext";
    match call(
        c,
        Request::ProbeAdd {
            spec: EPROBE.into(),
        },
    ) {
        Response::ProbeAdded { site, .. } => ck.eq("ext4 probe pending: no site", site, 0),
        other => ck.check(false, format!("probe on ext4 before it loads: {other:?}")),
    }
    ck.eq(
        "ext4 probe listed as pending",
        pending(c, "kprobes/extopen"),
        Some(true),
    );
    let _ = stream.read(c);
    let t0 = Instant::now();
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{EPROBE}' >> kprobe_events && echo 1 > events/kprobes/extopen/enable && \
             echo > trace && modprobe ext4 && modprobe loop && \
             dd if=/dev/zero of=/tmp/ext.img bs=1k count=4096 2>/dev/null && mke2fs -F /tmp/ext.img >/dev/null && \
             {MOUNT} && echo hello > /mnt/ext/f && cat /mnt/ext/f && cat /mnt/ext/f >/dev/null && \
             echo mounted && cat trace"
        ),
    );
    let ours = stream.read(c);
    println!(
        "ext4: modprobe, mke2fs, mount and opens in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    ck.check(
        guest.contains("hello") && guest.contains("mounted"),
        format!("ext4 on a loop device: {guest}"),
    );
    let (g, o) = (
        pid_bodies(&guest, "extopen: "),
        pid_bodies(&ours, "extopen: "),
    );
    println!("ext4 pending probe: ours {o:?}\n  guest {g:?}");
    ck.check(
        g.len() >= 3 && g.iter().all(|l| l.1.contains(" [ext4])")),
        format!("the guest's ext4 probe fired on the opens: {g:?}"),
    );
    ck.eq("our ext4 probe events equal the guest's", &o, &g);
    // The hits: ours (root's count) against the guest's kprobe_profile and
    // its trace lines, over the three opens of the file on the mount (the
    // write, then two reads).
    let ours_hits = hits(c, "kprobes/extopen");
    let guest_hits = guest_kprobe_hits(c, "extopen");
    println!("ext4_file_open hits: ours {ours_hits}, the guest's kprobe_profile {guest_hits:?}");
    ck.eq(
        "ext4_file_open hits: ours, the guest's kprobe_profile, the guest's trace lines",
        (Some(ours_hits), guest_hits, g.len()),
        (Some(3), Some(3), 3),
    );
    ck.eq(
        "ext4 probe armed",
        pending(c, "kprobes/extopen"),
        Some(false),
    );

    // Symbols.
    let t0 = Instant::now();
    let ours = module_symbols(c, "ext4");
    let took = t0.elapsed();
    let guest = guest_module_kallsyms(c, "ext4");
    let mine: Vec<(u64, char, String)> = ours
        .iter()
        .map(|s| (s.addr, char::from(s.kind), s.name.clone()))
        .collect();
    let report = status(c).kernel.map(|k| k.modules).unwrap_or_default();
    println!(
        "ext4 symbols: guest {}, ours {} ({} traceable), listed in {:.1} s; walk {report:?}",
        guest.len(),
        mine.len(),
        ours.iter().filter(|s| s.site.is_some()).count(),
        took.as_secs_f64()
    );
    ck.check(
        guest.len() > 1000,
        format!("ext4 symbols in /proc/kallsyms: {}", guest.len()),
    );
    same_module_symbols(ck, "ext4", &mine, &guest);
    let mut ext4_sites: Vec<u64> = ours.iter().filter_map(|s| s.site).collect();
    ext4_sites.sort_unstable();
    ext4_sites.dedup();
    let graph = ext4_graph(ck, c, stream);

    // Unload, then load again.
    let before = status(c).tracer;
    let out = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/kprobes/extopen/enable && umount /mnt/ext && rmmod ext4 && echo unloaded; echo alive"
        ),
    );
    ck.check(
        out.contains("unloaded") && out.contains("alive"),
        format!("rmmod ext4 with our probe and a graph session on it: {out}"),
    );
    let t = status(c).tracer;
    ck.eq(
        "ext4 probe pending after rmmod",
        pending(c, "kprobes/extopen"),
        Some(true),
    );
    // The graph session's core functions stay hooked; every site on
    // ext4's text went.
    let graph_core = graph
        .as_ref()
        .map_or(0, |g| g.hooked.saturating_sub(ext4_sites.len() as u32));
    println!(
        "rmmod ext4: sites {} -> {}, {} unhooked; the graph hooked {:?} ({} ext4 sites listed)",
        before.sites,
        t.sites,
        t.module_unhooked - before.module_unhooked,
        graph.as_ref().map(|g| g.hooked),
        ext4_sites.len()
    );
    // Root's scheduler hook picks the vCPUs' views while the rooted
    // session hooks callees the quiet views leave out.
    ck.check(
        t.switch_hook,
        "the scheduler hook is in for the rooted session",
    );
    ck.eq(
        "sites after rmmod ext4: root's three module hooks, its scheduler hook and the graph's core functions",
        (t.sites, t.module_hooks),
        (3 + 1 + graph_core, 3),
    );
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 1 > events/kprobes/extopen/enable && echo > trace && modprobe ext4 && \
             {MOUNT} && cat /mnt/ext/f && umount /mnt/ext && cat trace; \
             echo 0 > events/kprobes/extopen/enable; echo '-:extopen' >> kprobe_events"
        ),
    );
    let ours = stream.read(c);
    let (g, o) = (
        pid_bodies(&guest, "extopen: "),
        pid_bodies(&ours, "extopen: "),
    );
    ck.check(
        guest.contains("hello") && !g.is_empty(),
        format!("ext4 again: {guest}"),
    );
    ck.eq(
        "ours re-armed at the second modprobe, as the guest's",
        &o,
        &g,
    );
    if graph.is_some() {
        // The session's `ext4:*` covered ext4's init functions (init text)
        // from the second modprobe to the end of its init, and they were
        // unhooked before the kernel freed that text.
        let t2 = status(c).tracer;
        println!(
            "ext4 reload: init texts freed {} -> {}, their sites unhooked {} -> {}",
            t.module_inits_freed,
            t2.module_inits_freed,
            t.module_init_unhooked,
            t2.module_init_unhooked
        );
        ck.check(
            t2.module_inits_freed > t.module_inits_freed
                && t2.module_init_unhooked > t.module_init_unhooked,
            format!("ext4's init functions were traced and unhooked as its init text went: {t2:?}"),
        );
    }
    if let Some(mut g) = graph {
        // The session's module globs re-armed ext4's functions at the
        // second modprobe: the read through the new mount is a tree again.
        let text = g.stream.read(c);
        ck.check(
            text.contains("ext4_file_read_iter [ext4]() {"),
            format!("the graph session on ext4 after its reload: {text}"),
        );
        ck.check(hv_graph_stop(c, g.session), "ext4 graph session stopped");
    }
    loop_churn(ck, c);
    ck.check(
        matches!(
            call(
                c,
                Request::ProbeDel {
                    name: "extopen".into()
                }
            ),
            Response::Ok
        ),
        "ext4 probe deleted",
    );
    let t = status(c).tracer;
    ck.eq("nothing left hooked", (t.sites, t.module_hooks), (0, 0));
}

/// The fast lane's in-tree module, `binfmt_misc` (an `=m` option of the
/// kernel's config fragment, loaded by busybox modprobe from the
/// initramfs's /lib/modules): probes on its `load_misc_binary` (run at
/// every exec once the module is in) and on its init function, both
/// pending before the load, against the guest's own kprobes on the same
/// functions over the same execs; its symbols against /proc/kallsyms; after
/// rmmod, pending again.
fn intree_module(ck: &mut Checks, c: &mut Client) {
    const SPECS: [&str; 2] = [
        "p:bmload binfmt_misc:load_misc_binary",
        "p:bminit binfmt_misc:init_misc_binfmt",
    ];
    for spec in SPECS {
        match call(c, Request::ProbeAdd { spec: spec.into() }) {
            Response::ProbeAdded { site, .. } => ck.eq(&format!("{spec}: pending"), site, 0),
            other => ck.check(false, format!("{spec} before the module loads: {other:?}")),
        }
    }
    // Between the load and the guest's disable only hvbench execs; the
    // guest's counts are read with shell builtins (no exec after it).
    let out = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{}' >> kprobe_events && echo '{}' >> kprobe_events && \
             echo 1 > events/kprobes/bmload/enable && echo 1 > events/kprobes/bminit/enable && \
             modprobe binfmt_misc && for i in 1 2 3 4 5 6; do /bin/hvbench getppid 1 >/dev/null; done; \
             echo 0 > events/kprobes/bmload/enable; echo 0 > events/kprobes/bminit/enable; \
             while read -r name hit miss; do case $name in bm*) echo \"guest $name $hit\";; esac; done < kprobe_profile",
            SPECS[0], SPECS[1]
        ),
    );
    let guest = |name: &str| -> Option<u64> {
        out.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("guest {name} ")))
            .and_then(|n| n.trim().parse().ok())
    };
    let (g_load, g_init) = (guest("bmload"), guest("bminit"));
    let (o_load, o_init) = (hits(c, "kprobes/bmload"), hits(c, "kprobes/bminit"));
    println!(
        "binfmt_misc: load_misc_binary hits ours {o_load}, guest {g_load:?}; init hits ours {o_init}, guest {g_init:?}"
    );
    ck.check(
        g_load.is_some_and(|n| n >= 6) && g_init == Some(1),
        format!("the guest's probes on binfmt_misc fired: {out}"),
    );
    ck.eq(
        "our load_misc_binary hits equal the guest's",
        Some(o_load),
        g_load,
    );
    ck.eq("our init hits equal the guest's", Some(o_init), g_init);
    ck.eq(
        "load_misc_binary armed, the init function pending again",
        (pending(c, "kprobes/bmload"), pending(c, "kprobes/bminit")),
        (Some(false), Some(true)),
    );
    let ours: Vec<(u64, char, String)> = module_symbols(c, "binfmt_misc")
        .iter()
        .map(|s| (s.addr, char::from(s.kind), s.name.clone()))
        .collect();
    let guest_syms = guest_module_kallsyms(c, "binfmt_misc");
    ck.check(
        guest_syms.iter().any(|s| s.2 == "load_misc_binary"),
        format!(
            "the guest lists binfmt_misc's symbols: {} lines",
            guest_syms.len()
        ),
    );
    same_module_symbols(ck, "binfmt_misc", &ours, &guest_syms);
    let out = exec(c, "rmmod binfmt_misc && echo unloaded");
    ck.check(
        out.contains("unloaded"),
        format!("rmmod binfmt_misc: {out}"),
    );
    ck.eq(
        "both pending after rmmod",
        (pending(c, "kprobes/bmload"), pending(c, "kprobes/bminit")),
        (Some(true), Some(true)),
    );
    delete_probes(ck, c, &["bmload", "bminit"], "after binfmt_misc");
}

/// Deletes our probes `names` and the guest's of the same names; then
/// nothing may be left hooked, root's own hooks included.
fn delete_probes(ck: &mut Checks, c: &mut Client, names: &[&str], when: &str) {
    for name in names {
        ck.check(
            matches!(
                call(
                    c,
                    Request::ProbeDel {
                        name: (*name).into()
                    }
                ),
                Response::Ok
            ),
            format!("probe {name} deleted"),
        );
    }
    let guest: Vec<String> = names
        .iter()
        .map(|n| format!("echo '-:{n}' >> kprobe_events"))
        .collect();
    exec(c, &format!("cd {TRACEFS} && {}", guest.join(" && ")));
    let t = status(c).tracer;
    ck.eq(
        &format!("nothing left hooked {when}, root's own hooks included"),
        (t.sites, t.module_hooks),
        (0, 0),
    );
}

/// The hits of the guest's own kprobe `name` so far (its kprobe_profile),
/// which stays as it is.
fn guest_kprobe_hits(c: &mut Client, name: &str) -> Option<u64> {
    let profile = exec(c, &format!("grep -w {name} {TRACEFS}/kprobe_profile"));
    let mut words = profile.split_whitespace();
    match (words.next(), words.next()) {
        (Some(n), Some(hits)) if n == name => hits.parse().ok(),
        _ => None,
    }
}

/// The hits of the guest's own kprobe `name` (its kprobe_profile), which
/// is disabled and deleted.
fn take_guest_kprobe(c: &mut Client, name: &str) -> Option<u64> {
    let profile = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 0 > events/kprobes/{name}/enable && grep {name} kprobe_profile; \
             echo '-:{name}' >> kprobe_events"
        ),
    );
    profile
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
}

/// Every entry of the running count, page by page: (name, calls).
fn count_entries(c: &mut Client) -> Option<(u64, Vec<(String, u64)>)> {
    let mut cursor = 0;
    let mut out = Vec::new();
    for _ in 0..64 {
        let Response::Counts(protocol::CountPage {
            calls,
            entries,
            next,
            ..
        }) = call(c, Request::CountRead { cursor, limit: 50 })
        else {
            return None;
        };
        out.extend(entries.into_iter().map(|e| (e.name, e.calls)));
        match next {
            Some(n) => cursor = n,
            None => return Some((calls, out)),
        }
    }
    None
}

/// The calls of `name` in a count's entries: the live function's and its
/// unloaded loads' (`NAME [MOD] (unloaded)`).
fn count_of(entries: &[(String, u64)], name: &str) -> u64 {
    entries
        .iter()
        .filter(|(n, _)| n.strip_suffix(" (unloaded)").unwrap_or(n) == name)
        .map(|(_, n)| n)
        .sum()
}

/// A count over a module that is unloaded and loaded again 20 times, with
/// another module loaded between (the attacker, whose init fails: its
/// text takes the frames hvtarget's just left). After each unload, no
/// site of the module is left hooked (a counted site once stayed mapped to
/// its shadow over the freed frames: the next module ran our call) and
/// the figures are those before the count's module came; after each load,
/// the count follows the module again (its glob), and the guest's own
/// kprobe on `hvtarget_sum` counts the same calls as ours, summed over the
/// loads.
fn counted_module_churn(ck: &mut Checks, c: &mut Client) {
    let loaded = exec(c, "grep -c '\\[hvtarget\\]' /proc/kallsyms || true");
    ck.check(
        loaded.trim().parse::<u32>().is_ok_and(|n| n > 0),
        format!("hvtarget is loaded before the counted churn: {loaded:?}"),
    );
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo 'p:gcsum hvtarget:hvtarget_sum' >> kprobe_events && echo 1 > events/kprobes/gcsum/enable"
        ),
    );
    let started = call(
        c,
        Request::CountStart(protocol::CountFilter {
            functions: vec!["hvtarget:*".into()],
            ..Default::default()
        }),
    );
    let Response::CountStarted { functions, .. } = started else {
        ck.check(false, format!("count start on hvtarget:*: {started:?}"));
        return;
    };
    ck.check(
        functions >= 3,
        format!("functions counted in hvtarget: {functions}"),
    );
    let figures = |c: &mut Client| {
        let t = status(c).tracer;
        (t.sites, t.pages)
    };
    let loaded_base = figures(c);
    exec(c, "rmmod hvtarget");
    let unloaded_base = figures(c);
    ck.check(
        unloaded_base.0 + functions <= loaded_base.0,
        format!("the count's sites went with the module: {loaded_base:?} -> {unloaded_base:?}"),
    );
    exec(c, &format!("insmod /lib/hvtarget.ko && echo 2 > {POKE}"));
    let heap0 = status(c).hv_heap_used;
    let memory0 = status(c).hv_memory_used;
    let mut drift = Vec::new();
    let mut heap = Vec::new();
    for round in 0..20 {
        let out = exec(c, "rmmod hvtarget && echo unloaded");
        let after_unload = figures(c);
        let out2 = exec(
            c,
            &format!(
                "insmod /lib/hvattack.ko 2>/dev/null; insmod /lib/hvtarget.ko && echo 2 > {POKE} && echo ok"
            ),
        );
        let after_load = figures(c);
        heap.push(status(c).hv_heap_used);
        if !out.contains("unloaded")
            || !out2.contains("ok")
            || after_unload != unloaded_base
            || after_load != loaded_base
        {
            drift.push((round, after_unload, after_load, out2.trim().to_string()));
        }
    }
    check_churn_heap(ck, "counted hvtarget churn", heap0, &heap);
    let memory = status(c).hv_memory_used;
    let counts = count_entries(c);
    let guest = take_guest_kprobe(c, "gcsum");
    println!(
        "counted churn: baseline loaded {loaded_base:?}, unloaded {unloaded_base:?}; hypervisor memory {} -> {} KiB; guest hvtarget_sum hits {guest:?}; count {counts:?}",
        memory0 >> 10,
        memory >> 10
    );
    ck.eq(
        "counted churn rounds whose figures left the baseline",
        &drift,
        &Vec::new(),
    );
    match counts {
        Some((total, entries)) => {
            let ours = count_of(&entries, "hvtarget_sum [hvtarget]");
            // 21 loads after the count started, two calls each (the
            // init's and the poke's).
            ck.eq("counted hvtarget_sum calls over the churn", ours, 42);
            ck.eq(
                "our count of hvtarget_sum equals the guest's kprobe",
                Some(ours),
                guest,
            );
            ck.check(
                entries
                    .iter()
                    .any(|(n, _)| n == "hvtarget_sum [hvtarget] (unloaded)")
                    && entries.iter().any(|(n, _)| n == "hvtarget_sum [hvtarget]"),
                format!("the live function and its unloaded loads: {entries:?}"),
            );
            ck.check(total >= ours, format!("the count's total: {total}"));
        }
        None => ck.check(false, "count read after the churn"),
    }
    ck.check(
        matches!(call(c, Request::CountStop), Response::Ok),
        "count stop after the churn",
    );
    let alive = exec(c, "echo alive");
    ck.eq(
        "guest healthy after the counted churn",
        alive.trim(),
        "alive",
    );
}

/// What a module's churn must leave as it found: sites, pages, graph
/// stacks and frames.
type ChurnFigures = (u32, u32, u64, u64);

/// The churn's figures, and the hypervisor's heap in use.
fn churn_figures(c: &mut Client) -> (ChurnFigures, u64) {
    let st = status(c);
    let t = st.tracer;
    (
        (t.sites, t.pages, t.graph_stacks, t.graph_frames),
        st.hv_heap_used,
    )
}

/// Heap in use may differ between rounds by the trace text still queued
/// for the host (a few lines); a leak of even a few bytes a round would
/// grow past it over the rounds.
const CHURN_HEAP_SLACK: u64 = 4096;

/// Runs `cmd` (an unload and a load, ending in `echo ok`) `rounds` times.
/// Returns the rounds that failed or whose figures left `base`, and the
/// heap in use after each round.
fn churn_rounds(
    c: &mut Client,
    cmd: &str,
    rounds: u32,
    base: ChurnFigures,
) -> (Vec<(u32, String, ChurnFigures)>, Vec<u64>) {
    let mut drift = Vec::new();
    let mut heap = Vec::new();
    for round in 0..rounds {
        let out = exec(c, cmd);
        let (now, h) = churn_figures(c);
        heap.push(h);
        if !out.contains("ok") || now != base {
            drift.push((round, out.trim().to_string(), now));
        }
    }
    (drift, heap)
}

/// Checks the heap over a churn's rounds against its value after a
/// warm-up round: within [`CHURN_HEAP_SLACK`] every round.
fn check_churn_heap(ck: &mut Checks, what: &str, base: u64, heap: &[u64]) {
    let (lo, hi) = (
        heap.iter().copied().min().unwrap_or(base),
        heap.iter().copied().max().unwrap_or(base),
    );
    println!("{what}: heap in use {base} B after the warm-up, {lo}..{hi} B over the rounds");
    ck.check(
        lo + CHURN_HEAP_SLACK >= base && hi <= base + CHURN_HEAP_SLACK,
        format!(
            "{what}: the heap stays at its baseline (±{CHURN_HEAP_SLACK} B): {base} vs {heap:?}"
        ),
    );
}

/// Debian's churn: `loop` unloaded and loaded 20 times with our probe on
/// its `loop_add`, which its init calls once per loop device, beside the
/// guest's own kprobe on the same function: the figures return to their
/// baseline each round and the hits agree.
fn loop_churn(ck: &mut Checks, c: &mut Client) {
    const LPROBE: &str = "p:lpadd loop:loop_add i=%di:s32";
    match call(
        c,
        Request::ProbeAdd {
            spec: LPROBE.into(),
        },
    ) {
        Response::ProbeAdded { site, .. } => ck.check(site != 0, "loop is loaded: lpadd armed"),
        other => ck.check(false, format!("probe on loop:loop_add: {other:?}")),
    }
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{LPROBE}' >> kprobe_events && echo 1 > events/kprobes/lpadd/enable; \
             for d in /dev/loop*; do losetup -d $d 2>/dev/null; done; true"
        ),
    );
    const CHURN: &str = "rmmod loop && modprobe loop && echo ok";
    // A count over the module runs through the churn too: it follows each
    // load, and its sites go at each unload (the figures below).
    let counting = matches!(
        call(
            c,
            Request::CountStart(protocol::CountFilter {
                functions: vec!["loop:*".into()],
                ..Default::default()
            })
        ),
        Response::CountStarted { .. }
    );
    ck.check(counting, "count start on loop:*");
    // Our hits are counted from the guest probe's definition on, as the
    // guest's kprobe_profile counts them: over the warm-up round too.
    let hits0 = hits(c, "kprobes/lpadd");
    let (warm, _) = churn_rounds(c, CHURN, 1, (0, 0, 0, 0));
    ck.check(
        warm.first().is_some_and(|w| w.1.ends_with("ok")),
        format!("loop's warm-up round: {warm:?}"),
    );
    let (base, heap0) = churn_figures(c);
    let t0 = status(c).tracer;
    let started = Instant::now();
    let (drift, heap) = churn_rounds(c, CHURN, 20, base);
    let took = started.elapsed();
    check_churn_heap(ck, "loop churn", heap0, &heap);
    let ours = hits(c, "kprobes/lpadd") - hits0;
    let guest = take_guest_kprobe(c, "lpadd");
    let t = status(c).tracer;
    println!(
        "loop churn: 20 rounds in {:.1} s; baseline {base:?}; probe hits ours +{ours}, guest {guest:?}",
        took.as_secs_f64()
    );
    ck.eq(
        "rounds whose figures left the baseline (loop)",
        &drift,
        &Vec::new(),
    );
    ck.eq(
        "loads and unloads seen in the loop churn",
        (
            t.module_loads - t0.module_loads,
            t.module_unloads - t0.module_unloads,
        ),
        (20, 20),
    );
    ck.check(
        ours > 0 && ours.is_multiple_of(21),
        format!("loop_add hits: one per loop device at each of 21 loads: {ours}"),
    );
    ck.eq(
        "our loop_add hits equal the guest's kprobe",
        Some(ours),
        guest,
    );
    if counting {
        let counted = count_entries(c).map(|(_, e)| count_of(&e, "loop_add [loop]"));
        println!("loop churn: loop_add counted {counted:?}");
        ck.eq(
            "loop_add calls counted over the loads, as the guest's kprobe",
            counted,
            guest,
        );
        ck.check(
            matches!(call(c, Request::CountStop), Response::Ok),
            "count stop after the loop churn",
        );
    }
    ck.check(
        matches!(
            call(
                c,
                Request::ProbeDel {
                    name: "lpadd".into()
                }
            ),
            Response::Ok
        ),
        "loop probe deleted",
    );
}

/// A graph session left running on ext4.
struct ModuleGraph {
    session: u32,
    hooked: u32,
    stream: Stream,
}

/// A graph session rooted at `ext4:ext4_file_read_iter` over ext4's
/// functions (`ext4:*`) and the core kernel's read path, against the
/// guest's own function_graph with the same root and filter
/// (`*:mod:ext4`) over one read with a cold page cache: module and core
/// frames interleave (ext4 → the page cache → ext4's readahead). The
/// session is left running, for the unload.
fn ext4_graph(ck: &mut Checks, c: &mut Client, stream: &mut Stream) -> Option<ModuleGraph> {
    const CORE: [&str; 7] = [
        "generic_file_read_iter",
        "filemap_read",
        "filemap_get_pages",
        "page_cache_sync_ra",
        "page_cache_ra_unbounded",
        "read_pages",
        "touch_atime",
    ];
    let mut trace = vec!["ext4:*".to_string()];
    trace.extend(CORE.iter().map(|s| s.to_string()));
    let filter = protocol::GraphFilter {
        functions: vec!["ext4:ext4_file_read_iter".into()],
        trace,
        ..protocol::GraphFilter::default()
    };
    let _ = stream.read(c);
    let t0 = Instant::now();
    let (session, hooked) = match call(c, Request::GraphStart(filter)) {
        Response::GraphStarted {
            session,
            roots,
            hooked,
            skipped,
        } => {
            println!(
                "ext4 graph: {hooked} hooked, {roots} roots, {skipped} skipped in {:.1} s",
                t0.elapsed().as_secs_f64()
            );
            ck.eq("ext4 graph roots", roots, 1);
            (session, hooked)
        }
        other => {
            ck.check(false, format!("graph on ext4 refused: {other:?}"));
            return None;
        }
    };
    let mut ours = Stream::of(session, protocol::TraceFormat::Text, stream.cursor);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '*:mod:ext4' > set_ftrace_filter && for g in {}; do echo $g >> set_ftrace_filter; done; \
             echo ext4_file_read_iter > set_graph_function && echo 0 > options/funcgraph-irqs && \
             sync && echo 3 > /proc/sys/vm/drop_caches && \
             echo function_graph > current_tracer && echo > trace && cat /mnt/ext/f > /dev/null && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt",
            CORE.join(" ")
        ),
    );
    let text = ours.read(c);
    let _ = stream.read(c);
    let (g, o) = (parse_graph(&guest), parse_graph(&text));
    for line in text.lines().filter(|l| l.contains('|')).take(16) {
        println!("  ours:  {line}");
    }
    for line in guest.lines().filter(|l| l.contains('|')).take(16) {
        println!("  guest: {line}");
    }
    // A module frame whose caller is a core frame, under the module root.
    let mut open: Vec<&str> = Vec::new();
    let mut core_to_module = false;
    for n in &g {
        match n {
            Node::Open(d, f) | Node::Leaf(d, f) => {
                open.truncate(*d);
                if f.ends_with(" [ext4]") && open.last().is_some_and(|p| !p.contains(" [")) {
                    core_to_module = true;
                }
                if matches!(n, Node::Open(..)) {
                    open.push(f);
                }
            }
            Node::Close(d) => open.truncate(*d),
        }
    }
    ck.check(
        g.first() == Some(&Node::Open(0, "ext4_file_read_iter [ext4]".into()))
            && g.iter()
                .any(|n| matches!(n, Node::Open(1, f) if f == "generic_file_read_iter"))
            && core_to_module,
        format!("the guest's graph of an ext4 read, module and core frames interleaved: {g:?}"),
    );
    ck.eq("our ext4 read graph equals the guest's", &o, &g);
    Some(ModuleGraph {
        session,
        hooked,
        stream: ours,
    })
}

/// `hvtrace record` on the stock kernel: a probe with a string, the
/// function tracer and the scheduler's events for `--duration`, while the
/// guest opens and reads its hostname. Debian's `trace-cmd report` lists
/// the probe's file name at the guest's own address of the function, dd's
/// vfs_read, and the switches and wakeups.
fn record_on_debian(ck: &mut Checks, c: &mut Client, vm: &Detached) {
    let dir = std::env::temp_dir().join(format!("hvtrace-record-debian-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dat = dir.join("debian.dat");
    let err = dir.join("record.err");
    let mut child = std::process::Command::new(hvtrace_tests::hvtrace_bin())
        .arg("--socket")
        .arg(&vm.socket)
        .args(["record", "-o"])
        .arg(&dat)
        .args([
            "--probe",
            "p:tdopen do_sys_openat2 filename=+0(%si):string",
            "--function",
            "vfs_read",
            "--duration",
            "10",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline
        && !std::fs::read_to_string(&err).is_ok_and(|t| t.contains("recording to"))
    {
        std::thread::sleep(Duration::from_millis(300));
    }
    exec(
        c,
        "dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null",
    );
    let kallsyms = exec(c, "grep -w do_sys_openat2 /proc/kallsyms");
    let status = child.wait().unwrap();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    println!("{stderr}");
    ck.eq("record on Debian", status.code(), Some(0));
    let out = std::process::Command::new("trace-cmd")
        .arg("report")
        .arg(&dat)
        .output()
        .expect("trace-cmd (scripts/setup.sh installs it)");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let addr = kallsyms
        .lines()
        .find(|l| l.ends_with(" do_sys_openat2"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("none")
        .to_string();
    let opens = report
        .lines()
        .filter(|l| l.contains("dd-") && l.contains("tdopen:"))
        .filter(|l| l.contains("filename=\"/etc/hostname\"") && l.contains(&format!("({addr})")))
        .count();
    ck.eq(
        "trace-cmd: dd's open of /etc/hostname at the guest's address",
        opens,
        1,
    );
    ck.check(
        report
            .lines()
            .any(|l| l.contains("dd-") && l.contains("function:") && l.contains("vfs_read")),
        "trace-cmd: dd's vfs_read",
    );
    for event in ["sched_switch:", "sched_wakeup:"] {
        ck.check(
            report.lines().filter(|l| l.contains(event)).count() >= 2,
            format!("trace-cmd: {event} events"),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
