//! function_graph from VMX root (both kernels, KASLR on, one boot each):
//!
//! - **oracle**: the call tree under `vfs_read` for one `dd` read, traced by
//!   us and by the guest's own function_graph (`set_graph_function`) at the
//!   same time; the trees (order, nesting, functions) must agree, and the
//!   agreement rate is printed;
//! - **sleepers**: two tasks sleep inside `do_nanosleep` while others run;
//!   every return goes back to the right place, the durations cover the
//!   sleeps, the guest stays healthy and the return-stack memory goes back
//!   to zero;
//! - **cost**: VM exits per traced call (exactly 2) and emulated
//!   instructions per call against the guest's own function_graph on the
//!   same function.
//!
//! Run: `cargo test -p hvtrace-tests --test graph -- --nocapture`

use std::time::Instant;

use hvtrace::client::Client;
use hvtrace_tests::{
    guest_exec as exec, hv_call as call, hv_exits as exits, hv_status as status, vm_lock, Checks,
    Detached, Stream,
};
use protocol::{GraphFilter, Request, Response};

const TRACEFS: &str = "/sys/kernel/tracing";

/// What both tracers hook beneath `vfs_read` in the oracle (ftrace's
/// `set_ftrace_filter` takes the same globs). Hooking every function would
/// be faithful too, but the guest patching twenty thousand sites through
/// our split view takes many minutes in Bochs.
const TRACE_SET: &[&str] = &[
    "vfs_read",
    "rw_verify_area",
    "*file_read_iter",
    "filemap_*",
    "copy_page_to_iter",
    "_copy_to_iter",
    "touch_atime",
    "atime_needs_update",
    "*fsnotify*",
    "security_file_permission",
    "shmem_*",
    "folio_*",
    "xas_*",
];

/// One function_graph line: depth and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Open(usize, String),
    Leaf(usize, String),
    Close(usize),
}

/// Parses function_graph text (ours or the guest's) into nodes. Lines are
/// ` CPU) [marker] [duration] |  <indent>call`; the indent is two spaces
/// per level after the two that follow `|`.
fn parse_graph(text: &str) -> Vec<Node> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(bar) = line.find('|') else { continue };
        let head = line[..bar].trim_start();
        if !head.contains(')') || head.starts_with('#') {
            continue;
        }
        let body = &line[bar + 1..];
        let body = body.strip_prefix("  ").unwrap_or(body);
        let indent = body.len() - body.trim_start().len();
        let depth = indent / 2;
        let t = body.trim();
        if let Some(name) = t.strip_suffix("() {") {
            out.push(Node::Open(depth, name.to_string()));
        } else if let Some(name) = t.split("();").next().filter(|_| t.contains("();")) {
            out.push(Node::Leaf(depth, name.to_string()));
        } else if t.starts_with('}') {
            out.push(Node::Close(depth));
        }
    }
    out
}

/// Graph lines of ours for one task: the stream interleaves tasks, marked
/// by `=>` separators naming the task that follows.
fn ours_for(text: &str, comm: &str) -> String {
    let mut keep = false;
    let mut out = String::new();
    let mut first = true;
    for line in text.lines() {
        if let Some(after) = line.split("=> ").nth(1) {
            keep = after.trim().starts_with(&format!("{comm}-"));
            first = false;
            continue;
        }
        if line.trim_start().starts_with("----") || line.trim().is_empty() {
            continue;
        }
        // Lines before the first separator belong to the first task seen;
        // the test starts each run with a quiet stream, so they are ours.
        if keep || first {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn graph_start(c: &mut Client, f: GraphFilter) -> Option<(u32, u32, u32)> {
    match call(c, Request::GraphStart(f)) {
        Response::GraphStarted {
            hooked,
            roots,
            skipped,
        } => Some((hooked, roots, skipped)),
        other => {
            println!("graph start refused: {other:?}");
            None
        }
    }
}

fn oracle(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let _ = stream.read(c);
    let started = graph_start(
        c,
        GraphFilter {
            functions: vec!["vfs_read".into()],
            trace: TRACE_SET.iter().map(|s| s.to_string()).collect(),
            comm: Some("dd".into()),
            ..GraphFilter::default()
        },
    );
    ck.check(started.is_some(), "graph start on vfs_read");
    if let Some((hooked, roots, skipped)) = started {
        println!("oracle: {hooked} functions hooked, {roots} roots, {skipped} skipped");
        ck.eq("roots", roots, 1);
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > set_ftrace_filter && for g in {}; do echo \"$g\" >> set_ftrace_filter 2>/dev/null; done; echo vfs_read > set_graph_function && echo 0 > options/funcgraph-irqs && \
             echo function_graph > current_tracer && echo > trace && \
             sh -c 'echo $$ > set_ftrace_pid; exec dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null' && \
             cat trace > /tmp/graph.txt; echo nop > current_tracer; echo > set_graph_function; \
             echo > set_ftrace_pid; echo > set_ftrace_filter; echo 1 > options/funcgraph-irqs; cat /tmp/graph.txt",
            TRACE_SET
                .iter()
                .map(|g| format!("'{g}'"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    );
    let ours_all = stream.read(c);
    ck.check(
        matches!(call(c, Request::GraphStop), Response::Ok),
        "graph stop",
    );
    let ours = ours_for(&ours_all, "dd");
    let g = parse_graph(&guest);
    let o = parse_graph(&ours);
    let same = g.iter().zip(o.iter()).take_while(|(a, b)| a == b).count();
    let total = g.len().max(o.len());
    println!(
        "oracle: guest tree {} nodes, ours {} nodes, {} agree in order ({:.1} %)",
        g.len(),
        o.len(),
        same,
        100.0 * same as f64 / total.max(1) as f64
    );
    for line in ours.lines().take(12) {
        println!("  ours:  {line}");
    }
    for line in guest.lines().filter(|l| l.contains('|')).take(14) {
        println!("  guest: {line}");
    }
    if same < total {
        println!(
            "  first difference at node {same}: guest {:?} ours {:?}",
            g.get(same),
            o.get(same)
        );
    }
    ck.check(
        g.len() >= 5,
        format!("the guest's tree under vfs_read has nodes: {}", g.len()),
    );
    ck.eq("our vfs_read tree equals the guest's", &o, &g);
}

fn sleepers(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let _ = stream.read(c);
    let base = status(c).tracer;
    let started = graph_start(
        c,
        GraphFilter {
            functions: vec!["do_nanosleep".into()],
            trace: vec!["do_nanosleep".into(), "hrtimer_*".into()],
            ..GraphFilter::default()
        },
    );
    ck.check(started.is_some(), "graph start on do_nanosleep");
    // Two sleepers overlap; traced work runs while they sleep.
    let t0 = Instant::now();
    exec(
        c,
        "hvbench sleep 400 & hvbench sleep 700 & for i in 1 2 3; do cat /etc/hostname >/dev/null; hvbench sleep 50; done; wait",
    );
    let wall = t0.elapsed();
    let mid = status(c).tracer;
    let text = stream.read(c);
    ck.check(
        matches!(call(c, Request::GraphStop), Response::Ok),
        "graph stop",
    );
    // The outermost do_nanosleep closes of each task, with durations.
    let mut closes = Vec::new();
    let mut task = String::new();
    for line in text.lines() {
        if let Some(after) = line.split("=> ").nth(1) {
            task = after.trim().to_string();
        }
        if line.contains("|  }") && !line.contains("|    ") {
            let us: f64 = line
                .split(')')
                .nth(1)
                .and_then(|r| r.split("us").next())
                .and_then(|d| {
                    d.trim_start_matches([' ', '+', '!', '#', '*', '@', '$'])
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0);
            closes.push((task.clone(), us));
        }
    }
    println!(
        "sleepers: {:.1} s wall; outer returns {closes:?}",
        wall.as_secs_f64()
    );
    println!("sleepers: tracer while sleeping {mid:?}");
    let long: Vec<f64> = closes
        .iter()
        .map(|c| c.1)
        .filter(|&us| us >= 390_000.0)
        .collect();
    ck.check(
        long.len() >= 2 && long.iter().any(|&us| us >= 690_000.0),
        format!("both long sleeps returned through us with their durations: {closes:?}"),
    );
    let after = status(c).tracer;
    println!("sleepers: tracer after {after:?}");
    ck.eq("live frames after the sleepers", after.graph_frames, 0);
    ck.eq("return stacks after the sleepers", after.graph_stacks, 0);
    ck.eq(
        "return-stack bytes after the sleepers",
        after.graph_bytes,
        0,
    );
    ck.eq("orphan returns", after.graph_orphans, base.graph_orphans);
    let alive = exec(c, "echo alive");
    ck.eq("guest alive after the sleepers", alive.trim(), "alive");
}

fn cost(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const N: u64 = 5000;
    // The name ftrace lists for the syscall body (6.12 lists `__do_sys_`,
    // whose `__x64_sys_` wrapper aliases it; 6.1 lists the wrapper).
    let listed = exec(
        c,
        &format!(
            "grep -m1 -E '^(__do_sys|__x64_sys)_getppid$' {TRACEFS}/available_filter_functions"
        ),
    );
    let func = listed.trim().to_string();
    let func = func.as_str();
    ck.check(
        matches!(call(c, Request::TraceStop), Response::Ok),
        "trace stop",
    );
    let measure = |c: &mut Client| -> (f64, f64, u64) {
        let before = exits(c);
        let t0 = Instant::now();
        let out = exec(c, &format!("hvbench getppid {N}"));
        let wall = t0.elapsed().as_secs_f64() / N as f64;
        let after = exits(c);
        let vmcalls =
            after.get("VMCALL").copied().unwrap_or(0) - before.get("VMCALL").copied().unwrap_or(0);
        let ns: f64 = out
            .split_whitespace()
            .find_map(|t| t.strip_prefix("ns="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        (ns / N as f64, wall, vmcalls)
    };
    let none = measure(c);
    graph_start(
        c,
        GraphFilter {
            functions: vec![func.into()],
            trace: vec![func.into()],
            ..GraphFilter::default()
        },
    );
    let ours = measure(c);
    call(c, Request::GraphStop);
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo {func} > set_ftrace_filter && echo {func} > set_graph_function && echo function_graph > current_tracer"
        ),
    );
    let guest = measure(c);
    exec(
        c,
        &format!("cd {TRACEFS} && echo nop > current_tracer && echo > set_ftrace_filter && echo > set_graph_function"),
    );
    let _ = stream.read(c);
    println!(
        "graph cost: {N} getppid calls per phase (1 emulated instruction = 20 ns of guest time)"
    );
    for (name, (ns, wall, vmcalls)) in [
        ("no tracer", none),
        ("hvtrace graph", ours),
        ("guest function_graph", guest),
    ] {
        println!(
            "  {name:<22} {ns:>8.0} ns/call  {:>6.0} instr/call (+{:.0})  {:>6.1} us Bochs  {vmcalls} VMCALLs",
            ns / 20.0,
            (ns - none.0) / 20.0,
            wall * 1e6
        );
    }
    ck.eq("VMCALLs without a tracer", none.2, 0);
    ck.eq("VMCALLs per traced call: exactly 2", ours.2, 2 * N);
    ck.eq("VMCALLs under the guest's function_graph", guest.2, 0);
}

fn exercise(guest: &str) {
    let _l = vm_lock();
    let vm = Detached::start(guest, "graph");
    let mut c = vm.client();
    let mut ck = Checks::new();
    ck.check(status(&mut c).kernel.is_some(), "kernel recovered");
    let mut stream = Stream::new();
    oracle(&mut ck, &mut c, &mut stream);
    sleepers(&mut ck, &mut c, &mut stream);
    cost(&mut ck, &mut c, &mut stream);
    let t = status(&mut c).tracer;
    println!("{guest}: graph tracer counters at the end: {t:?}");
    let alive = exec(&mut c, "echo alive");
    ck.eq("guest still healthy", alive.trim(), "alive");
    ck.finish();
}

#[test]
fn function_graph_fast_lane() {
    exercise("fast");
}

#[test]
fn function_graph_debian() {
    exercise("debian");
}
