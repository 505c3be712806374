//! What the two-vCPU VM tests (`smp.rs`, `smp_debian.rs`) share: the
//! boot checks, the kprobe oracle per CPU and small request helpers.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use hvtrace::client::Client;
use hvtrace_tests::{
    cpuinfo_flags, guest_exec, hv_call, hv_status, parse_trace_line, Checks, Stream, TRACEFS,
};
use protocol::{Request, Response};

/// The CPU column of a trace_pipe line (`comm-pid [001] ...`), ours or the
/// guest's.
pub fn cpu_column(l: &str) -> Option<u32> {
    let open = l.find(" [")? + 2;
    let close = open + l[open..].find(']')?;
    l[open..close].trim().parse().ok()
}

/// (comm, pid, cpu, body) of each trace line of `text` from a task named
/// `comm`, sorted.
pub fn events_of(text: &str, comm: &str) -> Vec<(String, i32, u32, String)> {
    let mut v: Vec<_> = text
        .lines()
        .filter_map(|l| {
            let t = parse_trace_line(l)?;
            (t.comm == comm).then(|| (t.comm, t.pid, cpu_column(l).unwrap_or(u32::MAX), t.body))
        })
        .collect();
    v.sort();
    v
}

/// Adds a probe; false (and a failed check) when it is refused.
pub fn probe_add(ck: &mut Checks, c: &mut Client, spec: &str) -> bool {
    match hv_call(c, Request::ProbeAdd { spec: spec.into() }) {
        Response::ProbeAdded { .. } => true,
        other => {
            ck.check(false, format!("probe add {spec}: {other:?}"));
            false
        }
    }
}

/// The hits of probe `name` (0 when it is not there).
pub fn probe_hits(c: &mut Client, name: &str) -> u64 {
    match hv_call(c, Request::ProbeList) {
        Response::Probes(list) => list
            .iter()
            .find(|p| p.name.ends_with(&format!("/{name}")))
            .map_or(0, |p| p.hits),
        _ => 0,
    }
}

/// Starts a graph session on `root` alone, depth 1; its number.
pub fn graph_start(ck: &mut Checks, c: &mut Client, root: &str) -> Option<u32> {
    graph_start_with(
        ck,
        c,
        protocol::GraphFilter {
            functions: vec![root.into()],
            trace: vec![root.into()],
            max_depth: 1,
            ..protocol::GraphFilter::default()
        },
    )
}

/// Starts a graph session with `filter`; its number.
pub fn graph_start_with(
    ck: &mut Checks,
    c: &mut Client,
    filter: protocol::GraphFilter,
) -> Option<u32> {
    let roots = filter.functions.join(",");
    match hv_call(c, Request::GraphStart(filter)) {
        Response::GraphStarted { session, .. } => Some(session),
        other => {
            ck.check(false, format!("graph start {roots}: {other:?}"));
            None
        }
    }
}

pub fn graph_stop(ck: &mut Checks, c: &mut Client, session: u32) {
    let r = hv_call(
        c,
        Request::GraphStop {
            session: Some(session),
        },
    );
    ck.check(matches!(r, Response::Ok), format!("graph stop: {r:?}"));
}

pub fn probe_del(ck: &mut Checks, c: &mut Client, name: &str) {
    let r = hv_call(c, Request::ProbeDel { name: name.into() });
    ck.check(
        matches!(r, Response::Ok),
        format!("probe del {name}: {r:?}"),
    );
}

/// Our probe and the guest's own kprobe, same spec, over `head` pinned to
/// CPU 1, CPU 0 and CPU 1 again: the same events, CPU column included.
pub fn probe_oracle_across_cpus(ck: &mut Checks, c: &mut Client) {
    const SPEC: &str = "p:smpopen do_sys_openat2";
    guest_exec(
        c,
        &format!("[ -e {TRACEFS}/trace ] || mount -t tracefs nodev {TRACEFS}"),
    );
    let mut stream = Stream::new();
    if !probe_add(ck, c, SPEC) {
        return;
    }
    let _ = stream.read(c);
    let guest = guest_exec(
        c,
        &format!(
            "cd {TRACEFS} && echo '{SPEC}' > kprobe_events && echo > trace && \
             echo 1 > events/kprobes/smpopen/enable && \
             taskset 2 head -c 1 /etc/hostname > /dev/null; taskset 1 head -c 1 /etc/hostname > /dev/null; \
             taskset 2 head -c 1 /etc/hostname > /dev/null; \
             echo 0 > events/kprobes/smpopen/enable && cat trace && echo > kprobe_events"
        ),
    );
    let ours = stream.read(c);
    let g = events_of(&guest, "head");
    let o = events_of(&ours, "head");
    println!("smp oracle: guest {} events, ours {}", g.len(), o.len());
    for (comm, pid, cpu, body) in o.iter().take(4) {
        println!("  ours:  {comm}-{pid} [{cpu:03}] {body}");
    }
    ck.check(
        g.iter().any(|e| e.2 == 1) && g.iter().any(|e| e.2 == 0),
        format!("the guest's own events are not on both CPUs: {g:?}"),
    );
    ck.eq("our events equal the guest's, CPU column included", &o, &g);
    ck.eq("stream losses (oracle)", stream.lost, 0);
    probe_del(ck, c, "smpopen");
}

/// Two processors, both online and without `vmx`, `nproc` 2, and exits on
/// both vCPUs.
pub fn boot_checks(ck: &mut Checks, c: &mut Client) {
    let processors = guest_exec(c, "grep -c ^processor /proc/cpuinfo");
    ck.eq("processors in /proc/cpuinfo", processors.trim(), "2");
    ck.eq("nproc", guest_exec(c, "nproc").trim(), "2");
    let online = guest_exec(c, "cat /sys/devices/system/cpu/online");
    ck.eq("online CPUs", online.trim(), "0-1");
    let cpuinfo = guest_exec(c, "cat /proc/cpuinfo");
    let flag_lines = cpuinfo.lines().filter(|l| l.starts_with("flags")).count();
    ck.eq("flags lines in /proc/cpuinfo", flag_lines, 2);
    ck.check(
        cpuinfo_flags(&cpuinfo).is_some_and(|f| !f.iter().any(|x| x == "vmx"))
            && !cpuinfo.contains(" vmx"),
        "the guest sees vmx",
    );
    let st = hv_status(c);
    ck.check(
        st.per_vcpu.len() == 2 && st.per_vcpu.iter().all(|v| v.exits_total > 0),
        format!("not every vCPU has exits: {:?}", st.per_vcpu),
    );
}

/// Prints each vCPU's exits, lock waits, time held for patching and
/// records lost, as `status` has them, after `tag`.
pub fn print_vcpus(tag: &str, st: &protocol::StatusReport) {
    for v in &st.per_vcpu {
        eprintln!(
            "{tag}: vCPU {}: {} exits, waited {} us for the VM lock over {} takes and {} us for its shared side over {} hypercalls, held {} us, lost {}",
            v.index,
            v.exits_total,
            v.lock_wait_ns / 1000,
            v.lock_takes,
            v.shared_wait_ns / 1000,
            v.shared_takes,
            v.held_ns / 1000,
            v.lost
        );
    }
}

/// Prints what each vCPU waited for the VM lock (whole and shared side)
/// between two `status` reports, after `tag`.
pub fn print_lock_waits(
    tag: &str,
    before: &protocol::StatusReport,
    after: &protocol::StatusReport,
) {
    for (a, b) in after.per_vcpu.iter().zip(&before.per_vcpu) {
        eprintln!(
            "{tag}: vCPU {}: {} exits, {} VMCALLs; waited {} us for the VM lock over {} takes, {} us for its shared side over {} hypercalls",
            a.index,
            a.exits_total - b.exits_total,
            a.vmcalls - b.vmcalls,
            (a.lock_wait_ns - b.lock_wait_ns) / 1000,
            a.lock_takes - b.lock_takes,
            (a.shared_wait_ns - b.shared_wait_ns) / 1000,
            a.shared_takes - b.shared_takes
        );
    }
}

/// `status` once every vCPU's VMCALL exits (the exit loop's counter,
/// published at the vCPU's turns) equal its hypercalls as the tracer
/// counted them (hits + returns + refused, counted as they happen): the
/// two counts are kept apart, so they agree only if every VMCALL was
/// served once and counted once. Polled while the published counters
/// catch up (the caller makes sure no traced function runs then); a
/// check fails if they never agree within 20 s.
pub fn settled_status(ck: &mut Checks, c: &mut Client, what: &str) -> protocol::StatusReport {
    let t0 = std::time::Instant::now();
    loop {
        let st = hv_status(c);
        let apart: Vec<_> = st
            .per_vcpu
            .iter()
            .filter(|v| v.vmcalls != v.hits + v.returns + v.refused)
            .map(|v| (v.index, v.vmcalls, v.hits, v.returns, v.refused))
            .collect();
        if apart.is_empty() {
            return st;
        }
        if t0.elapsed() > std::time::Duration::from_secs(20) {
            ck.check(
                false,
                format!("{what}: VMCALL exits and hypercalls never agree (vCPU, VMCALLs, hits, returns, refused): {apart:?}"),
            );
            return st;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
