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
    guest_exec as exec, guest_vfs_read_graph, hv_call as call, hv_exits as exits, hv_graph_stop,
    hv_status as status, parse_graph, parse_trace_lines, vm_lock, Checks, Detached, Node, Stream,
    TRACEFS, TRACE_SET,
};
use protocol::{ErrorKind, GraphFilter, Request, Response, TraceFormat};

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

fn graph_start(c: &mut Client, f: GraphFilter) -> Option<(u32, u32, u32, u32)> {
    match call(c, Request::GraphStart(f)) {
        Response::GraphStarted {
            session,
            hooked,
            roots,
            skipped,
        } => Some((session, hooked, roots, skipped)),
        other => {
            println!("graph start refused: {other:?}");
            None
        }
    }
}

/// A call tree, built from function_graph nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Tree {
    name: String,
    children: Vec<Tree>,
}

fn tree_of(nodes: &[Node]) -> Vec<Tree> {
    let mut stack: Vec<Tree> = vec![Tree {
        name: String::new(),
        children: Vec::new(),
    }];
    for n in nodes {
        match n {
            Node::Open(_, name) => stack.push(Tree {
                name: name.clone(),
                children: Vec::new(),
            }),
            Node::Leaf(_, name) => stack.last_mut().unwrap().children.push(Tree {
                name: name.clone(),
                children: Vec::new(),
            }),
            Node::Close(_) => {
                if stack.len() > 1 {
                    let t = stack.pop().unwrap();
                    stack.last_mut().unwrap().children.push(t);
                }
            }
        }
    }
    while stack.len() > 1 {
        let t = stack.pop().unwrap();
        stack.last_mut().unwrap().children.push(t);
    }
    stack.pop().unwrap().children
}

/// The nodes function_graph prints for `trees` when calls `max` levels
/// deep are not traced and the functions `hidden` picks are left out with
/// everything beneath them (set_graph_notrace).
fn nodes_of(
    trees: &[Tree],
    depth: usize,
    max: usize,
    hidden: &dyn Fn(&str) -> bool,
    out: &mut Vec<Node>,
) {
    for t in trees {
        if hidden(&t.name) {
            continue;
        }
        let shown: Vec<&Tree> = t.children.iter().filter(|c| !hidden(&c.name)).collect();
        if shown.is_empty() || depth + 1 >= max {
            out.push(Node::Leaf(depth, t.name.clone()));
        } else {
            out.push(Node::Open(depth, t.name.clone()));
            nodes_of(&t.children, depth + 1, max, hidden, out);
            out.push(Node::Close(depth));
        }
    }
}

/// Nodes of `nodes` at least `depth` deep.
fn count_deeper(nodes: &[Node], depth: usize) -> usize {
    nodes
        .iter()
        .filter(|n| matches!(n, Node::Open(d, _) | Node::Leaf(d, _) if *d >= depth))
        .count()
}

/// One `dd` read of /etc/hostname under the guest's own function_graph
/// (vfs_read's tree over TRACE_SET); returns the guest's trace.
fn guest_dd(c: &mut Client) -> String {
    guest_vfs_read_graph(
        c,
        "sh -c 'echo $$ > set_ftrace_pid; exec dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null'",
    )
}

fn dd_filter() -> GraphFilter {
    GraphFilter {
        functions: vec!["vfs_read".into()],
        trace: TRACE_SET.iter().map(|s| s.to_string()).collect(),
        comm: Some("dd".into()),
        ..GraphFilter::default()
    }
}

/// Prints how far two node lists agree; returns (agreeing, total).
fn agreement(what: &str, ours: &[Node], guest: &[Node]) -> (usize, usize) {
    let same = guest
        .iter()
        .zip(ours.iter())
        .take_while(|(a, b)| a == b)
        .count();
    let total = guest.len().max(ours.len());
    println!(
        "{what}: expected {} nodes, ours {} nodes, {} agree in order ({:.1} %)",
        guest.len(),
        ours.len(),
        same,
        100.0 * same as f64 / total.max(1) as f64
    );
    if same < total {
        println!(
            "  first difference at node {same}: expected {:?} ours {:?}",
            guest.get(same),
            ours.get(same)
        );
    }
    (same, total)
}

/// Two sessions at once, sharing frames: A traces the whole tree, B
/// the same with max_depth 3 and `shmem_get*` (the page lookup under
/// shmem_file_read_iter, with its own callees) in set_graph_notrace.
/// Both are checked against the guest's own function_graph.
fn oracle(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let _ = stream.read(c);
    let a = graph_start(c, dd_filter());
    let b = graph_start(
        c,
        GraphFilter {
            max_depth: 3,
            graph_notrace: vec!["shmem_get*".into()],
            ..dd_filter()
        },
    );
    let (Some(a), Some(b)) = (a, b) else {
        ck.check(false, "two graph sessions on vfs_read");
        return;
    };
    println!("oracle: session A {a:?}, session B {b:?} (session, hooked, roots, skipped)");
    ck.eq("roots", a.2, 1);
    ck.check(a.0 != b.0, "sessions have distinct numbers");
    let _ = stream.read(c);
    let (mut sa, mut sb) = (
        Stream::of(a.0, TraceFormat::Text, stream.cursor),
        Stream::of(b.0, TraceFormat::Text, stream.cursor),
    );
    let guest = guest_dd(c);
    let ours_a = sa.read(c);
    let ours_b = sb.read(c);
    let _ = stream.read(c);
    let mid = status(c).tracer;
    ck.eq("sessions running", mid.graph_sessions, 2);
    for s in [a.0, b.0] {
        ck.check(
            matches!(
                call(c, Request::GraphStop { session: Some(s) }),
                Response::Ok
            ),
            format!("graph stop {s}"),
        );
    }
    ck.check(
        matches!(
            call(c, Request::GraphStop { session: Some(a.0) }),
            Response::Error {
                kind: ErrorKind::NotFound,
                ..
            }
        ),
        "stopping a stopped session is refused",
    );
    let g = parse_graph(&guest);
    let o = parse_graph(&ours_for(&ours_a, "dd"));
    for line in ours_a.lines().take(12) {
        println!("  ours A: {line}");
    }
    for line in guest.lines().filter(|l| l.contains('|')).take(14) {
        println!("  guest:  {line}");
    }
    agreement("oracle A (full tree)", &o, &g);
    ck.check(
        g.len() >= 5,
        format!("the guest's tree under vfs_read has nodes: {}", g.len()),
    );
    ck.eq("session A's vfs_read tree equals the guest's", &o, &g);
    let mut want_b = Vec::new();
    let hidden = |f: &str| f.starts_with("shmem_get");
    nodes_of(&tree_of(&g), 0, 3, &hidden, &mut want_b);
    let ob = parse_graph(&ours_for(&ours_b, "dd"));
    for line in ours_b.lines().take(8) {
        println!("  ours B: {line}");
    }
    agreement(
        "oracle B (max_depth 3, graph_notrace shmem_get*)",
        &ob,
        &want_b,
    );
    ck.check(
        g.iter()
            .any(|n| matches!(n, Node::Open(2, f) | Node::Leaf(2, f) if hidden(f))),
        "the guest's tree calls shmem_get*, 2 deep",
    );
    ck.check(
        count_deeper(&g, 3) > 0,
        "the guest's tree is deeper than session B's max_depth",
    );
    ck.eq("session B's tree equals the guest's, cut", &ob, &want_b);
}

/// Return stacks of 3 frames: calls deeper than that are not hijacked,
/// each one a counted miss, and the tree is the guest's cut at depth 3.
fn capacity(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let _ = stream.read(c);
    let before = status(c).tracer;
    ck.check(
        matches!(
            call(
                c,
                Request::GraphStart(GraphFilter {
                    stack_frames: 100_000,
                    ..dd_filter()
                })
            ),
            Response::Error {
                kind: ErrorKind::InvalidArgument,
                ..
            }
        ),
        "an absurd stack size is refused",
    );
    let Some(s) = graph_start(
        c,
        GraphFilter {
            stack_frames: 3,
            ..dd_filter()
        },
    ) else {
        ck.check(false, "graph start with 3 frames per stack");
        return;
    };
    // The oracle's sessions stopped: their numbers are free again.
    ck.eq("a stopped session's number is reused", s.0, 1);
    // The return stacks are shared: another size is refused meanwhile.
    ck.check(
        matches!(
            call(
                c,
                Request::GraphStart(GraphFilter {
                    stack_frames: 8,
                    ..dd_filter()
                })
            ),
            Response::Error {
                kind: ErrorKind::InvalidArgument,
                ..
            }
        ),
        "another stack size is refused while a session runs",
    );
    let mut so = Stream::of(s.0, TraceFormat::Text, stream.cursor);
    let guest = guest_dd(c);
    let ours = so.read(c);
    let mid = status(c).tracer;
    call(c, Request::GraphStop { session: Some(s.0) });
    let _ = stream.read(c);
    let g = parse_graph(&guest);
    let mut want = Vec::new();
    nodes_of(&tree_of(&g), 0, 3, &|_| false, &mut want);
    let o = parse_graph(&ours_for(&ours, "dd"));
    agreement("capacity (3 frames per stack)", &o, &want);
    let misses = mid.graph_misses - before.graph_misses;
    let deep = count_deeper(&g, 3);
    println!("capacity: {misses} misses; the guest's tree has {deep} calls 3 or more deep");
    ck.check(deep > 0, "the guest's tree is deeper than 3");
    ck.eq("our tree equals the guest's cut at depth 3", &o, &want);
    ck.eq(
        "misses equal the calls beyond capacity",
        misses,
        deep as u64,
    );
    let after = status(c).tracer;
    ck.eq("frames after the capacity run", after.graph_frames, 0);
    ck.eq(
        "orphans after the capacity run",
        after.graph_orphans,
        before.graph_orphans,
    );
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
    let session = started.map_or(0, |s| s.0);
    // Two sleepers overlap; traced work runs while they sleep. Meanwhile
    // the guest's unwinder walks a sleeper's stack (/proc/PID/stack).
    let t0 = Instant::now();
    // (Each exec runs in a subshell: the sleepers outlive the first one,
    // and the second runs until both must have returned.)
    // (The sleeps leave the shell, the console and the status request
    // that follow 900 ms or more of guest time: root's own work on each
    // exit, the scheduler hook's among them, runs on the guest's clock in
    // Bochs.)
    let out = exec(
        c,
        "hvbench sleep 1000 & a=$!; hvbench sleep 1300 & p=$!; echo PIDS $a $p; hvbench sleep 100; \
         echo STACK-BEGIN; cat /proc/$p/stack && echo READ-OK; echo STACK-END",
    );
    // Both long sleepers are still inside do_nanosleep: their frames and
    // the memory they hold.
    let mid = status(c).tracer;
    exec(
        c,
        "for i in 1 2 3; do cat /etc/hostname >/dev/null; hvbench sleep 50; done; hvbench sleep 1300",
    );
    let wall = t0.elapsed();
    let text = stream.read(c);
    ck.check(hv_graph_stop(c, session), "graph stop");
    // What the guest's unwinder shows for a task sleeping inside a
    // hijacked call, against the same sleep untraced. /proc/PID/stack
    // leaves out scheduler functions (do_nanosleep is `__sched`), so the
    // untraced trace starts at the return address into do_nanosleep's
    // caller; hijacked, that slot holds our return trampoline, which is not
    // kernel text, and the unwinder stops there: the trace is empty.
    // (ftrace's own return handler it would translate back; ours it
    // cannot know.)
    let stack_of = |out: &str| -> Vec<String> {
        out.split("STACK-BEGIN")
            .nth(1)
            .and_then(|r| r.split("STACK-END").next())
            .unwrap_or("")
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    };
    let hijacked = stack_of(&out);
    let plain = stack_of(&exec(
        c,
        "hvbench sleep 300 & p=$!; hvbench sleep 50; echo STACK-BEGIN; cat /proc/$p/stack && echo READ-OK; echo STACK-END; wait",
    ));
    println!("sleepers: /proc/PID/stack of the 1300 ms sleeper, hijacked:");
    for l in &hijacked {
        println!("  {l}");
    }
    println!("sleepers: the same for an untraced sleeper:");
    for l in &plain {
        println!("  {l}");
    }
    let has = |v: &[String], f: &str| v.iter().any(|l| l.contains(&format!("] {f}+")));
    let read_ok = |v: &[String]| v.iter().any(|l| l == "READ-OK");
    ck.check(
        read_ok(&plain) && has(&plain, "hrtimer_nanosleep") && has(&plain, "do_syscall_64"),
        "the untraced sleeper's stack runs from hrtimer_nanosleep to do_syscall_64",
    );
    ck.check(read_ok(&hijacked), "the hijacked sleeper's stack was read");
    ck.eq(
        "entries in the hijacked sleeper's stack",
        hijacked.iter().filter(|l| l.starts_with('[')).count(),
        0,
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
    println!(
        "sleepers: while the two sleep: {} frames on {} stacks, {} B of return stacks",
        mid.graph_frames, mid.graph_stacks, mid.graph_bytes
    );
    ck.check(
        mid.graph_frames >= 2
            && mid.graph_stacks >= 2
            && mid.graph_bytes > 0
            && mid.graph_bytes <= mid.graph_stacks * 1280,
        "each sleeper holds a frame on its own return stack (at most 1280 B each) while it sleeps",
    );
    let pids: Vec<String> = out
        .lines()
        .find_map(|l| l.strip_prefix("PIDS "))
        .map(|p| p.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default();
    for (pid, min_us) in pids.iter().zip([1_000_000.0, 1_300_000.0]) {
        let task = format!("hvbench-{pid}");
        let got: Vec<f64> = closes.iter().filter(|c| c.0 == task).map(|c| c.1).collect();
        ck.check(
            got.len() == 1 && got[0] >= min_us && got[0] < min_us + 100_000.0,
            format!(
                "{task}'s sleep of {} ms returned through us once, with its duration: {got:?}",
                min_us / 1000.0
            ),
        );
    }
    ck.eq("sleeper pids printed", pids.len(), 2);
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
    let func = getppid_function(c);
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
    // A second session on the same function shares the frames.
    graph_start(
        c,
        GraphFilter {
            functions: vec![func.into()],
            trace: vec![func.into()],
            retval: true,
            ..GraphFilter::default()
        },
    );
    let two = measure(c);
    call(c, Request::GraphStop { session: None });
    // max_depth 1 under the root, with the default trace set (every
    // function): only the root is hooked.
    let depth1 = graph_start(
        c,
        GraphFilter {
            functions: vec![func.into()],
            max_depth: 1,
            ..GraphFilter::default()
        },
    );
    ck.eq(
        "a max_depth 1 session hooks its root alone",
        depth1.map(|s| (s.1, s.2)),
        Some((1, 1)),
    );
    let one = measure(c);
    call(c, Request::GraphStop { session: None });
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo {func} > set_ftrace_filter && echo {func} > set_graph_function && echo function_graph > current_tracer"
        ),
    );
    let guest = measure(c);
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo nop > current_tracer && echo > set_ftrace_filter && echo 1 > max_graph_depth && \
             echo function_graph > current_tracer"
        ),
    );
    let guest1 = measure(c);
    exec(
        c,
        &format!("cd {TRACEFS} && echo nop > current_tracer && echo 0 > max_graph_depth && echo > set_graph_function"),
    );
    let _ = stream.read(c);
    println!(
        "graph cost: {N} getppid calls per phase (1 emulated instruction = 20 ns of guest time)"
    );
    for (name, (ns, wall, vmcalls)) in [
        ("no tracer", none),
        ("hvtrace graph", ours),
        ("hvtrace, 2 sessions", two),
        ("hvtrace max_depth 1, *", one),
        ("guest function_graph", guest),
        ("guest max_depth 1, *", guest1),
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
    ck.eq("VMCALLs per call with two sessions: still 2", two.2, 2 * N);
    ck.eq("VMCALLs per call with max_depth 1 over *: 2", one.2, 2 * N);
    ck.eq("VMCALLs under the guest's function_graph", guest.2, 0);
}

/// The function ftrace lists for the getppid system call's body (6.12
/// lists `__do_sys_`, whose `__x64_sys_` wrapper aliases it; 6.1 lists
/// the wrapper).
fn getppid_function(c: &mut Client) -> String {
    exec(
        c,
        &format!(
            "grep -m1 -E '^(__do_sys|__x64_sys)_getppid$' {TRACEFS}/available_filter_functions"
        ),
    )
    .trim()
    .to_string()
}

/// VMCALL exits and wall time of a guest command; its output.
fn vmcalls_of(c: &mut Client, cmd: &str) -> (u64, f64, String) {
    let before = exits(c).get("VMCALL").copied().unwrap_or(0);
    let t0 = Instant::now();
    let out = exec(c, cmd);
    let wall = t0.elapsed().as_secs_f64();
    let after = exits(c).get("VMCALL").copied().unwrap_or(0);
    (after - before, wall, out)
}

/// A number after `key=` in hvbench's output.
fn bench_value(out: &str, key: &str) -> f64 {
    out.split_whitespace()
        .find_map(|t| t.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Every vCPU's view switches so far.
fn view_switches(c: &mut Client) -> u64 {
    status(c).per_vcpu.iter().map(|v| v.view_switches).sum()
}

/// Sessions that cost only what they trace: a session with roots over
/// every function (the default trace set) leaves the calls outside its
/// roots unhooked (each vCPU runs on its quiet EPT view there), and
/// root's scheduler hook costs one exit per context switch.
///
/// - **before** (what every call of a hooked function cost before the
///   quiet views, wherever it ran): a getppid loop inside a root over `*`;
/// - **quiet**: the same loop under a session rooted at `vfs_read`, over
///   `N` and `4N` calls: each call costs under 1 % of what a call inside
///   the root adds;
/// - **scheduler hook**: a pipe ping-pong outside every root, with and
///   without the hook: one exit per context switch, instructions added
///   per switch;
/// - **view switches**: the ping-pong under a session rooted at
///   `pipe_read` (depth 2): the child sleeps inside the root, the parent
///   in poll outside it, so each switch between them moves the view.
fn quiet_views(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const N: u64 = 5000;
    const TRIPS: u64 = 1000;
    let func = getppid_function(c);
    let func = func.as_str();
    ck.check(
        matches!(call(c, Request::TraceStop), Response::Ok),
        "trace stop",
    );
    let getppid = |c: &mut Client, n: u64| {
        let (vmcalls, _, out) = vmcalls_of(c, &format!("hvbench getppid {n}"));
        (vmcalls, bench_value(&out, "ns") / n as f64)
    };
    let switch = |c: &mut Client| {
        let before = view_switches(c);
        let (vmcalls, wall, out) = vmcalls_of(c, &format!("hvbench switch {TRIPS}"));
        let views = view_switches(c) - before;
        (vmcalls, bench_value(&out, "ns_per_switch"), views, wall)
    };
    let none = getppid(c, N);
    let switch_none = switch(c);
    // Before: every call inside a root over `*`, as every call of a
    // hooked function cost wherever it ran.
    let Some(armed_session) = graph_start(
        c,
        GraphFilter {
            functions: vec![func.into()],
            ..GraphFilter::default()
        },
    ) else {
        ck.check(false, format!("a session rooted at {func} over *"));
        return;
    };
    let full = status(c);
    let st = full.tracer;
    let per_session = full
        .graph_sessions
        .iter()
        .find(|g| g.session == armed_session.0)
        .copied();
    println!("quiet views: status per session {per_session:?}");
    ck.check(
        per_session.is_some_and(|g| {
            g.hooked > 1000 && g.hooked <= armed_session.1 && g.roots == 1 && g.quiet > g.hooked / 2
        }),
        format!("status gives the session's hooked functions, most of them quiet: {per_session:?}"),
    );
    println!(
        "quiet views: a session rooted at {func} over *: {} functions hooked, {} pages quiet, {} partly, scheduler hook {}",
        armed_session.1, st.quiet_pages, st.quiet_partial, st.switch_hook
    );
    ck.check(
        st.switch_hook,
        "the scheduler hook is in while a session has roots",
    );
    ck.check(
        st.quiet_pages + st.quiet_partial > 100,
        format!(
            "most hooked pages are quiet: {} of {}, {} partly",
            st.quiet_pages, st.pages, st.quiet_partial
        ),
    );
    let armed = getppid(c, N);
    // The ping-pong runs outside every root: the hook's exit alone.
    let switch_hook = switch(c);
    // A session rooted at vfs_read over the same functions (nothing new is
    // hooked); the first one stops, and the loop runs outside every root.
    let reads = graph_start(
        c,
        GraphFilter {
            functions: vec!["vfs_read".into()],
            ..GraphFilter::default()
        },
    );
    ck.check(
        matches!(
            call(
                c,
                Request::GraphStop {
                    session: Some(armed_session.0)
                }
            ),
            Response::Ok
        ),
        "graph stop",
    );
    let quiet = getppid(c, N);
    let quiet4 = getppid(c, 4 * N);
    // Inside its roots the session still traces: a dd read's tree.
    let mut ours = Stream::of(reads.map_or(0, |r| r.0), TraceFormat::Text, stream.cursor);
    let _ = ours.read(c);
    exec(
        c,
        "dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null",
    );
    let dd = ours.read(c);
    let dd_tree = parse_graph(&ours_for(&dd, "dd"));
    call(c, Request::GraphStop { session: None });
    // The view moves with the ping-pong under a session rooted at
    // pipe_read, depth 2.
    let pipe = graph_start(
        c,
        GraphFilter {
            functions: vec!["pipe_read".into()],
            max_depth: 2,
            ..GraphFilter::default()
        },
    );
    let switch_views = switch(c);
    call(c, Request::GraphStop { session: None });
    let _ = stream.read(c);
    let end = status(c).tracer;
    // The guest's own function_graph under the same root.
    exec(
        c,
        &format!(
            "cd {TRACEFS} && echo vfs_read > set_graph_function && echo function_graph > current_tracer"
        ),
    );
    let guest = getppid(c, N);
    exec(
        c,
        &format!("cd {TRACEFS} && echo nop > current_tracer && echo > set_graph_function"),
    );
    let instr = |ns: f64| ns / 20.0;
    println!("quiet views: {N} getppid calls (1 emulated instruction = 20 ns of guest time)");
    for (name, (vmcalls, ns)) in [
        ("no tracer", none),
        ("inside a root over * (before)", armed),
        ("rooted at vfs_read, quiet", quiet),
        ("the same, 4N calls", quiet4),
        ("guest function_graph, vfs_read", guest),
    ] {
        println!(
            "  {name:<32} {vmcalls:>8} VMCALLs  {:>8.2} per call  {:>7.0} instr/call (+{:.0})",
            vmcalls as f64 / N as f64,
            instr(ns),
            instr(ns - none.1)
        );
    }
    println!("quiet views: {TRIPS} pipe round trips (2 context switches each)");
    for (name, (vmcalls, ns, views, wall)) in [
        ("no tracer", switch_none),
        ("scheduler hook, outside roots", switch_hook),
        ("rooted at pipe_read, depth 2", switch_views),
    ] {
        println!(
            "  {name:<32} {vmcalls:>8} VMCALLs  {:>5.2} per switch  {:>7.0} instr/switch (+{:.0})  {views} view switches, {:.0} per second of Bochs",
            vmcalls as f64 / (2 * TRIPS) as f64,
            instr(ns),
            instr(ns - switch_none.1),
            views as f64 / wall
        );
    }
    println!(
        "quiet views: a dd read under vfs_read: {} nodes; at the end {} pages quiet, scheduler hook {}, {} page changes put off",
        dd_tree.len(),
        end.quiet_pages,
        end.switch_hook,
        end.quiet_busy
    );
    ck.check(
        reads.is_some() && pipe.is_some(),
        "sessions on vfs_read and pipe_read",
    );
    ck.eq("VMCALLs without a tracer", none.0, 0);
    ck.check(
        armed.0 >= 2 * N,
        format!(
            "inside a root every call exits: {} VMCALLs for {N} calls",
            armed.0
        ),
    );
    // Outside the roots the loop costs nothing: each of its calls takes
    // under 1 % of the guest time a call inside a root adds (root's work
    // on an exit runs on the guest's clock in Bochs, so an exit per call
    // would show). The VMCALLs around the loop are other tasks' reads,
    // which are roots: how many come in a run depends on its length (a
    // CI run saw 614 for N calls and 2,409 for 4N).
    for (n, run) in [(N, quiet), (4 * N, quiet4)] {
        ck.check(
            instr(run.1 - none.1) < instr(armed.1 - none.1) / 100.0,
            format!(
                "the loop outside the root costs nothing: {:.0} instructions per call more than untraced over {n} calls, against {:.0} inside a root",
                instr(run.1 - none.1),
                instr(armed.1 - none.1)
            ),
        );
    }
    ck.check(
        quiet.0 * 10 < armed.0,
        format!(
            "quiet costs a tenth of armed at most: {} against {}",
            quiet.0, armed.0
        ),
    );
    ck.check(
        switch_hook.0 >= 2 * TRIPS,
        format!(
            "every context switch exits at the scheduler hook: {} VMCALLs for {} switches",
            switch_hook.0,
            2 * TRIPS
        ),
    );
    ck.check(
        switch_views.2 >= 2 * TRIPS,
        format!(
            "the view moves at each switch between a task inside a root and one outside: {} moves over {TRIPS} round trips",
            switch_views.2
        ),
    );
    ck.check(
        dd_tree
            .iter()
            .any(|n| matches!(n, Node::Open(0, f) if f == "vfs_read")),
        format!("a dd read is traced inside the root:\n{dd}"),
    );
    ck.check(
        !end.switch_hook && end.quiet_pages == 0 && end.quiet_partial == 0,
        format!(
            "the scheduler hook and the quiet pages go with the last session: hook {}, {} quiet, {} partial",
            end.switch_hook, end.quiet_pages, end.quiet_partial
        ),
    );
}

/// A session without roots filtered by comm is armed only while a task of
/// that name runs: a shell that forks and execs into `hvbench` is traced
/// from its exec on (root's hook on `__set_task_comm` arms its vCPU),
/// every one of its calls; a loop under another name costs nothing. One
/// filtered by pid traces a shell that slept when the session started
/// (armed when it comes in) from its wake to its exec's end, and not the
/// child it forks.
fn comm_exec(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const CALLS: u64 = 100;
    const N: u64 = 1000;
    let func = getppid_function(c);
    let Some(s) = graph_start(
        c,
        GraphFilter {
            trace: vec![func.clone()],
            comm: Some("hvbench".into()),
            ..GraphFilter::default()
        },
    ) else {
        ck.check(false, "a session filtered by comm");
        return;
    };
    let st = status(c).tracer;
    ck.check(
        st.switch_hook && st.quiet_pages + st.quiet_partial >= 1,
        format!(
            "the comm session's page is quiet: {} quiet pages, {} partly, scheduler hook {}",
            st.quiet_pages, st.quiet_partial, st.switch_hook
        ),
    );
    let mut ours = Stream::of(s.0, TraceFormat::Text, stream.cursor);
    let _ = ours.read(c);
    exec(c, "cp /bin/hvbench /tmp/hvother");
    let (before, _, _) = vmcalls_of(c, &format!("/tmp/hvother getppid {N}"));
    let (before4, _, _) = vmcalls_of(c, &format!("/tmp/hvother getppid {}", 4 * N));
    // The session's leaf lines of the getppid body, once stopped.
    let traced = |c: &mut Client, ours: &mut Stream, session: u32| -> u64 {
        let text = ours.read(c);
        call(
            c,
            Request::GraphStop {
                session: Some(session),
            },
        );
        text.lines()
            .filter(|l| l.ends_with(&format!("{func}();")))
            .count() as u64
    };
    exec(c, &format!("sh -c 'exec hvbench getppid {CALLS}'"));
    let calls = traced(c, &mut ours, s.0);
    println!(
        "comm filter: {calls} calls traced of {CALLS} after the exec; another name's loop: {before} VMCALLs for {N} calls, {before4} for {}",
        4 * N
    );
    ck.eq(
        "calls traced from the exec into the filtered name",
        calls,
        CALLS,
    );
    ck.check(
        before4 < before + 3 * N / 50,
        format!(
            "another name's loop costs nothing: {before} VMCALLs for {N} calls, {before4} for {}",
            4 * N
        ),
    );
    // A pid filter on a shell that waits on a pipe when the session
    // starts, then forks a child (another pid, outside the filter) and
    // execs into hvbench (the same pid, inside it).
    exec(
        c,
        "rm -f /tmp/go /tmp/pid.out; mkfifo /tmp/go; \
         (sh -c 'echo $$ > /tmp/pid; read x < /tmp/go; hvbench getppid 50 >/dev/null; exec hvbench getppid 100 > /tmp/pid.out' &); \
         while [ ! -s /tmp/pid ]; do hvbench sleep 20; done",
    );
    let pid: i32 = exec(c, "cat /tmp/pid").trim().parse().unwrap_or(-1);
    let Some(s) = graph_start(
        c,
        GraphFilter {
            trace: vec![func.clone()],
            pid: Some(pid),
            ..GraphFilter::default()
        },
    ) else {
        ck.check(false, format!("a session filtered by pid {pid}"));
        return;
    };
    let mut ours = Stream::of(s.0, TraceFormat::Text, stream.cursor);
    let _ = ours.read(c);
    let out = exec(
        c,
        "echo go > /tmp/go; while [ ! -s /tmp/pid.out ]; do hvbench sleep 20; done; cat /tmp/pid.out",
    );
    let calls = traced(c, &mut ours, s.0);
    println!(
        "pid filter: {calls} calls traced of {CALLS} after the exec of pid {pid} ({})",
        out.trim()
    );
    ck.check(pid > 1, format!("the shell's pid: {pid}"));
    ck.eq(
        "calls traced for the pid (its forked child's left out)",
        calls,
        CALLS,
    );
    let _ = stream.read(c);
}

/// Tasks that exit inside traced functions (`do_exit` never returns)
/// leave frames no return pops; they are reclaimed once the task's stack
/// is released, and the memory goes back to where it was.
fn exiting_tasks(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const N: u64 = 10;
    let _ = stream.read(c);
    let before = status(c).tracer;
    let Some(s) = graph_start(
        c,
        GraphFilter {
            functions: vec!["*sys_exit_group".into()],
            trace: vec![
                "*sys_exit_group".into(),
                "do_group_exit".into(),
                "do_exit".into(),
            ],
            comm: Some("cat".into()),
            ..GraphFilter::default()
        },
    ) else {
        ck.check(false, "graph start on the exit path");
        return;
    };
    let mut so = Stream::of(s.0, TraceFormat::Text, stream.cursor);
    exec(c, &vec!["cat /dev/null"; N as usize].join("; "));
    let text = so.read(c);
    // The stacks are released by the next task switches; give it a moment.
    let mut after = status(c).tracer;
    for _ in 0..20 {
        if after.graph_frames == 0 {
            break;
        }
        exec(c, "hvbench sleep 20");
        after = status(c).tracer;
    }
    call(c, Request::GraphStop { session: Some(s.0) });
    let entries = text
        .lines()
        .filter(|l| l.contains("do_exit() {") || l.contains("do_exit();"))
        .count();
    let reaped = after.graph_reaped - before.graph_reaped;
    let dropped = after.graph_dropped - before.graph_dropped;
    println!(
        "exiting tasks: {entries} do_exit entries for {N} exits; {reaped} frames reaped, {dropped} dropped; after: {} frames, {} stacks, {} B",
        after.graph_frames, after.graph_stacks, after.graph_bytes
    );
    for l in text.lines().take(6) {
        println!("  {l}");
    }
    ck.eq("do_exit entered once per exiting cat", entries as u64, N);
    ck.check(
        reaped + dropped >= 3 * N,
        format!("the 3 frames of every exit were reclaimed: {reaped} reaped + {dropped} dropped"),
    );
    ck.check(reaped > 0, "released stacks were reaped");
    ck.eq(
        "frames after the exits",
        after.graph_frames,
        before.graph_frames,
    );
    ck.eq(
        "return-stack bytes after the exits",
        after.graph_bytes,
        before.graph_bytes,
    );
    ck.eq(
        "orphans after the exits",
        after.graph_orphans,
        before.graph_orphans,
    );
}

/// `r:` return probes on the graph mechanism, against the guest's own
/// kretprobe on the same function, while a graph session shares the
/// frames.
fn return_probes(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const SPEC: &str = "r:myret do_sys_openat2 ret=$retval:x64";
    const GUEST: &str = "r:gret do_sys_openat2 ret=$retval:x64";
    // The guest reads its trace with dd, so that only the workload's
    // cats open files as `cat`.
    let guest_run = |c: &mut Client| {
        exec(
            c,
            &format!(
                "cd {TRACEFS} && echo '{GUEST}' > kprobe_events && echo > trace && \
                 echo 1 > events/kprobes/gret/enable && cat /etc/hostname >/dev/null; cat /nonexistent 2>/dev/null; cat /etc/hostname > /dev/null; \
                 echo 0 > events/kprobes/gret/enable && dd if=trace 2>/dev/null; echo > kprobe_events"
            ),
        )
    };
    let pick = |text: &str, event: &str| {
        let mut v: Vec<(i32, String)> = parse_trace_lines(text)
            .into_iter()
            .filter(|l| l.comm == "cat")
            .filter_map(|l| {
                l.body
                    .strip_prefix(&format!("{event}: "))
                    .map(|b| (l.pid, b.to_string()))
            })
            .collect();
        v.sort();
        v
    };
    // Where the guest's kretprobe says do_sys_openat2 returns to, alone.
    let alone = pick(&guest_run(c), "gret");
    let _ = stream.read(c);
    let added = call(c, Request::ProbeAdd { spec: SPEC.into() });
    ck.check(
        matches!(added, Response::ProbeAdded { .. }),
        format!("return probe added: {added:?}"),
    );
    let second = call(
        c,
        Request::ProbeAdd {
            spec: "p:myret2 do_sys_openat2%return ret=$retval:x64".into(),
        },
    );
    ck.check(
        matches!(second, Response::ProbeAdded { .. }),
        format!("SYM%return form added: {second:?}"),
    );
    let g = graph_start(
        c,
        GraphFilter {
            functions: vec!["do_sys_openat2".into()],
            trace: vec!["do_sys_openat2".into()],
            comm: Some("cat".into()),
            retval: true,
            ..GraphFilter::default()
        },
    );
    let _ = stream.read(c);
    let mut ours0 = Stream::of(0, TraceFormat::Text, stream.cursor);
    let mut graph = Stream::of(g.map_or(0, |g| g.0), TraceFormat::Text, stream.cursor);
    let guest = guest_run(c);
    let ours = ours0.read(c);
    let tree = graph.read(c);
    let st = status(c).tracer;
    call(c, Request::GraphStop { session: None });
    let o = pick(&ours, "myret");
    let o2 = pick(&ours, "myret2");
    let gv = pick(&guest, "gret");
    println!(
        "return probes: guest alone {} events, guest with ours {}, ours {} and {}",
        alone.len(),
        gv.len(),
        o.len(),
        o2.len()
    );
    for (what, v) in [("guest alone", &alone), ("guest", &gv), ("ours", &o)] {
        for l in v.iter().take(3) {
            println!("  {what:<11}: {l:?}");
        }
    }
    ck.eq("the guest's kretprobe alone saw the 3 cats", alone.len(), 3);
    ck.eq("the guest's kretprobe saw the 3 cats", gv.len(), 3);
    ck.check(
        gv.iter()
            .any(|(_, b)| b.ends_with("ret=0xfffffffffffffffe")),
        "the failing open returned -ENOENT",
    );
    // Our return location is the real caller, as the guest's kretprobe
    // alone reports it.
    let loc = |b: &str| b.split(')').next().unwrap_or("").to_string();
    let val = |b: &str| b.split(')').nth(1).unwrap_or("").to_string();
    let alone_locs: Vec<String> = alone.iter().map(|(_, b)| loc(b)).collect();
    let our_locs: Vec<String> = o.iter().map(|(_, b)| loc(b)).collect();
    ck.eq(
        "our return location equals the guest's kretprobe alone",
        &our_locs,
        &alone_locs,
    );
    // With both, the guest's rethook hijacks after us and so reports our
    // return trampoline as the caller (ftrace's own it would resolve).
    let tramp_page = st.trampolines >> 12;
    ck.check(
        gv.iter().all(|(_, b)| {
            loc(b)
                .trim_start_matches('(')
                .split(' ')
                .next()
                .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
                .is_some_and(|a| a >> 12 == tramp_page)
        }),
        "with ours on, the guest's kretprobe reports our return trampoline as the caller",
    );
    let pv = |v: &[(i32, String)]| -> Vec<(i32, String)> {
        v.iter().map(|(p, b)| (*p, val(b))).collect()
    };
    ck.eq(
        "our pids and values equal the guest's kretprobe",
        pv(&o),
        pv(&gv),
    );
    ck.eq("the %return form sees the same returns", pv(&o2), pv(&gv));
    ck.eq("return probes in status", st.retprobes, 2);
    // The graph session on the same function saw the same returns.
    let leaves = tree
        .lines()
        .filter(|l| l.contains("do_sys_openat2();"))
        .count();
    ck.eq("graph returns of do_sys_openat2 by cat", leaves, gv.len());
    ck.check(
        tree.contains("do_sys_openat2(); /* = 0xfffffffffffffffe */"),
        "the graph shows the failing open's return value",
    );
    for name in ["myret", "myret2"] {
        ck.check(
            matches!(
                call(c, Request::ProbeDel { name: name.into() }),
                Response::Ok
            ),
            format!("probe del {name}"),
        );
    }
    let after = status(c).tracer;
    ck.eq("sites after the return probes", after.sites, 0);
    ck.eq("frames after the return probes", after.graph_frames, 0);
}

/// The Chrome trace built from a real JSON stream parses, and its B/E
/// events nest per task.
fn chrome(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    let _ = stream.read(c);
    let Some(s) = graph_start(c, dd_filter()) else {
        ck.check(false, "graph start for the Chrome trace");
        return;
    };
    let mut json = Stream::of(s.0, TraceFormat::Json, stream.cursor);
    let _ = json.read(c); // switches the stream to JSON
    exec(
        c,
        "for i in 1 2 3; do dd if=/etc/hostname of=/dev/null bs=64 count=1 2>/dev/null; done",
    );
    let lines = json.read(c);
    call(c, Request::GraphStop { session: Some(s.0) });
    let _ = stream.read(c); // back to text
    let entries = lines
        .lines()
        .filter(|l| l.contains(r#""kind":"graph_entry""#))
        .count();
    let (doc, summary) = hvtrace::output::chrome::convert(&lines);
    println!(
        "chrome: {} JSON lines, {entries} entries; {}",
        lines.lines().count(),
        summary.line()
    );
    let v: serde_json::Value = match serde_json::from_str(&doc) {
        Ok(v) => v,
        Err(e) => {
            ck.check(false, format!("the Chrome trace parses: {e}"));
            return;
        }
    };
    let events = v["traceEvents"].as_array().cloned().unwrap_or_default();
    let mut open: std::collections::HashMap<i64, Vec<String>> = Default::default();
    let mut last_ts: std::collections::HashMap<i64, f64> = Default::default();
    let (mut b, mut e, mut bad) = (0, 0, Vec::new());
    for ev in &events {
        let tid = ev["tid"].as_i64().unwrap_or(-1);
        let ts = ev["ts"].as_f64().unwrap_or(-1.0);
        let name = ev["name"].as_str().unwrap_or("").to_string();
        match ev["ph"].as_str() {
            Some("B") => {
                b += 1;
                open.entry(tid).or_default().push(name);
            }
            Some("E") => {
                e += 1;
                let top = open.entry(tid).or_default().pop();
                if top
                    .as_deref()
                    .is_some_and(|t| !name.is_empty() && t != name)
                    || top.is_none()
                {
                    bad.push(format!("E {name} on tid {tid} closes {top:?}"));
                }
            }
            _ => continue,
        }
        let prev = last_ts.insert(tid, ts).unwrap_or(0.0);
        if ts < prev {
            bad.push(format!("time goes back on tid {tid}: {prev} -> {ts}"));
        }
    }
    println!("chrome: {b} B, {e} E events");
    ck.check(
        entries >= 15,
        format!("three dd trees streamed: {entries} entries"),
    );
    ck.eq("one B per entry", b, entries);
    ck.eq("B and E pair up", e, b);
    ck.check(
        bad.is_empty(),
        format!("B/E nest per task: {:?}", &bad[..bad.len().min(3)]),
    );
    ck.check(open.values().all(Vec::is_empty), "no call left open");
    ck.eq("returns without a call", summary.unmatched_returns, 0);
    ck.eq("calls closed early", summary.closed_early, 0);
    ck.eq("calls left open at the end", summary.closed_at_end, 0);
    ck.eq("malformed lines", summary.malformed, 0);
}

/// A busy graph session (rooted at `vfs_read`, every function hooked
/// beneath) over a read of /proc/kallsyms, twice, side by side: with the
/// trace stream on COM2, then on the log port. Lines streamed, events
/// lost and lines per wall second until the last line arrived, for each:
/// the log port delivers the same lines, losing none, at least twice as
/// fast. (The workload's events fit the rings, so COM2 loses none either;
/// it takes its time.)
fn throughput(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const WORK: &str = "head -c 60000 /proc/kallsyms > /dev/null";
    let _ = stream.read(c);
    let mut figures = Vec::new();
    for (name, channel) in [
        ("COM2", protocol::TraceChannel::Control),
        ("log port", protocol::TraceChannel::LogPort),
    ] {
        ck.check(
            matches!(call(c, Request::TraceChannel { channel }), Response::Ok),
            format!("trace channel {name}"),
        );
        let Some((session, hooked, _, _)) = graph_start(
            c,
            GraphFilter {
                functions: vec!["vfs_read".into()],
                comm: Some("head".into()),
                ..GraphFilter::default()
            },
        ) else {
            ck.check(false, format!("busy graph session ({name})"));
            return;
        };
        let mut s = Stream::of(session, TraceFormat::Text, stream.cursor);
        let lost0 = status(c).tracer.lost;
        let t0 = Instant::now();
        exec(c, WORK);
        let text = s.read(c);
        let took = t0.elapsed().as_secs_f64();
        hv_graph_stop(c, session);
        let lost = (status(c).tracer.lost - lost0).max(s.lost);
        let lines = text.lines().count() as u64;
        println!(
            "throughput ({name}): {hooked} functions hooked; {lines} lines, {lost} events lost, in {took:.1} s = {:.0} lines/s",
            lines as f64 / took
        );
        stream.cursor = s.cursor;
        figures.push((lines, lost, lines as f64 / took));
    }
    ck.check(
        matches!(
            call(
                c,
                Request::TraceChannel {
                    channel: protocol::TraceChannel::LogPort
                }
            ),
            Response::Ok
        ),
        "trace channel back to the log port",
    );
    let (com2, port) = (figures[0], figures[1]);
    ck.check(
        port.0 > 1000,
        format!("the busy session streamed: {port:?}"),
    );
    ck.eq("events lost on the log port", port.1, 0);
    // The same workload: the same lines, unless COM2 lost some.
    ck.check(
        if com2.1 == 0 {
            port.0 == com2.0
        } else {
            port.0 > com2.0
        },
        format!("lines on the log port {port:?} and on COM2 {com2:?}"),
    );
    ck.check(
        port.2 >= 2.0 * com2.2,
        format!(
            "the log port delivers at least twice as fast: {:.0} against {:.0} lines/s",
            port.2, com2.2
        ),
    );
}

fn exercise(guest: &str) {
    let _l = vm_lock();
    let vm = Detached::start(guest, "graph");
    let mut c = vm.client();
    let mut ck = Checks::new();
    ck.check(status(&mut c).kernel.is_some(), "kernel recovered");
    let mut stream = Stream::new();
    oracle(&mut ck, &mut c, &mut stream);
    capacity(&mut ck, &mut c, &mut stream);
    sleepers(&mut ck, &mut c, &mut stream);
    exiting_tasks(&mut ck, &mut c, &mut stream);
    return_probes(&mut ck, &mut c, &mut stream);
    chrome(&mut ck, &mut c, &mut stream);
    if guest == "fast" {
        throughput(&mut ck, &mut c, &mut stream);
    }
    cost(&mut ck, &mut c, &mut stream);
    if guest == "fast" {
        quiet_views(&mut ck, &mut c, &mut stream);
        comm_exec(&mut ck, &mut c, &mut stream);
    }
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
