use super::*;

// ----- the quiet views -----------------------------------------------------

/// A session rooted at my_func tracing quiet_leaf, with the views settled
/// as root settles them after each request.
pub(super) fn quiet_session(g: &mut Guest) -> u32 {
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["quiet_leaf".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        let s = t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
        s.session
    })
}

/// Runs on vCPU `on` as task `task` (its stack `stack`): the scheduler
/// hook's hit as the task comes in.
pub(super) fn switch_to(g: &mut Guest, on: usize, task: u64, stack: u64) {
    g.on = on;
    g.kernel.running.task = task;
    let retp = stack + 0x3e00;
    let (out, _) = g.hit(SWITCH, retp, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
}

#[test]
fn a_rooted_sessions_trace_set_is_unhooked_in_the_quiet_view_only() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    // Status per session: my_func and quiet_leaf hooked, one root, the
    // leaf left unhooked outside it.
    let s = g.tracer().graph_sessions();
    assert_eq!(
        s,
        [protocol::GraphSessionReport {
            session: 1,
            hooked: 2,
            roots: 1,
            quiet: 1
        }]
    );
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    for vcpu in 0..VCPUS {
        // The leaf's page: the shadow in the armed view, the guest's own
        // frame (execute-only) in the quiet one.
        let armed = g.root.leaf_in(vcpu, leaf).unwrap();
        let quiet = g.root.quiet_leaf(vcpu, leaf).unwrap();
        assert_ne!(armed.hpa.0, leaf);
        assert_eq!(armed.perms, ept::EXEC);
        assert_eq!((quiet.hpa.0, quiet.perms), (leaf, ept::EXEC));
        // The root's page and the scheduler hook's are hooked in both.
        for page in [gpa(FUNC) & !0xfff, gpa(SWITCH) & !0xfff] {
            let a = g.root.leaf_in(vcpu, page).unwrap();
            let q = g.root.quiet_leaf(vcpu, page).unwrap();
            assert_ne!(a.hpa.0, page);
            assert_eq!((q.hpa, q.perms), (a.hpa, ept::EXEC));
        }
    }
    // A probe on the leaf needs its hits on every view: hooked again.
    g.with(|t, env, k| {
        t.probe_add("p:leaf quiet_leaf", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    assert_eq!(g.tracer().report().quiet_pages, 0);
    assert_ne!(g.root.quiet_leaf(1, leaf).unwrap().hpa.0, leaf);
    g.with(|t, env, k| {
        t.probe_del("leaf", env).unwrap();
        t.settle_views(Some(k), env);
    });
    assert_eq!(g.root.quiet_leaf(1, leaf).unwrap().hpa.0, leaf);
    // The session stops: nothing is quiet, and the scheduler hook goes.
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    let r = g.tracer().report();
    assert_eq!(
        (r.quiet_pages, r.switch_hook, r.sites),
        (0, false, 0),
        "{r:?}"
    );
    let q = g.root.quiet_leaf(0, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::RWX));
}

#[test]
fn a_vcpu_is_armed_inside_a_root_and_quiet_outside() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    g.tracer().set_stream(Some(TraceFormat::Text));
    // A task outside the root comes in: quiet.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // The root's entry arms the vCPU; its callee is traced there.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    let inner = RETP - 0x100;
    g.hit(QUIET_LEAF, inner, FUNC + 0x40, 0);
    g.ret(inner, 0);
    // Still inside the root after its callee returned.
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    let text = g.text();
    assert!(
        text.contains("my_func() {") && text.contains("quiet_leaf();"),
        "{text}"
    );
    let c = g.vm.hypercalls_of(0, g.now_ns);
    assert_eq!(c.view_switches, 3);
    assert!(c.quiet);
}

#[test]
fn a_task_that_sleeps_in_a_root_arms_the_vcpu_it_wakes_on() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    g.tracer().set_stream(Some(TraceFormat::Text));
    switch_to(&mut g, 0, TASK, STACK_BASE);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // It sleeps: another task comes in on vCPU 0, which goes quiet.
    g.now_ns += 1_000;
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // It wakes on vCPU 1, quiet so far: the switch arms it there, before
    // its first call.
    switch_to(&mut g, 1, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    g.now_ns += 1_000;
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Armed);
    let inner = RETP - 0x100;
    g.hit(QUIET_LEAF, inner, FUNC + 0x40, 0);
    g.ret(inner, 0);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let text = g.text();
    assert!(text.contains("quiet_leaf();"), "{text}");
}

#[test]
fn a_root_entered_from_an_interrupt_returns_to_the_tasks_own_view() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    // An interrupt stack (its own block) on vCPU 0.
    let irq_retp = STACK_BASE - 0x8000 + 0x3f00;
    // On TASK_2, outside the session: the root in the interrupt arms the
    // vCPU, and its return finds TASK_2's own stack outside: quiet.
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    g.hit(FUNC, irq_retp, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(irq_retp, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // On TASK, inside the root: the interrupt's root returns, and the
    // task's own stack still holds its root's frame: armed.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(FUNC, irq_retp, CALLER_RET, 0);
    g.ret(irq_retp, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
}

#[test]
fn a_step_on_a_quiet_page_puts_both_views_back() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    let shadow = g.root.leaf_in(1, leaf).unwrap().hpa;
    // vCPU 1, quiet, writes the page: its quiet view opens it.
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let open = g.root.quiet_leaf(1, leaf).unwrap();
    assert_eq!((open.hpa.0, open.perms), (leaf, ept::RWX));
    assert_eq!(g.root.leaf_in(1, leaf).unwrap().hpa, shadow);
    g.with(|t, env, _| t.finish_step(env));
    let q = g.root.quiet_leaf(1, leaf).unwrap();
    let a = g.root.leaf_in(1, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::EXEC));
    assert_eq!((a.hpa, a.perms), (shadow, ept::EXEC));
}

#[test]
fn a_session_with_nothing_to_leave_quiet_costs_no_scheduler_hook() {
    let mut g = Guest::new();
    // Rooted at its whole trace set: every hooked site is a root.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["my_func".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!(
        (r.quiet_pages, r.switch_hook, r.sites),
        (0, false, 1),
        "{r:?}"
    );
    // Its calls pick no view: the vCPU stays where it was.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.ret(RETP, 0);
    assert_eq!(g.vm.hypercalls_of(0, g.now_ns).view_switches, 0);
}

/// A session without roots over quiet_leaf, filtered by `comm` or `pid`,
/// settled as root settles it.
pub(super) fn filtered_session(g: &mut Guest, comm: Option<&str>, pid: Option<i32>) {
    let f = GraphFilter {
        trace: vec!["quiet_leaf".into()],
        comm: comm.map(Into::into),
        pid,
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
}

#[test]
fn a_comm_filter_arms_the_vcpu_while_its_task_runs_and_from_its_exec() {
    let mut g = Guest::new();
    filtered_session(&mut g, Some("worker"), None);
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The running task is "sleeper": quiet.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // It execs into "worker": renamed, it is armed before its next call.
    g.ram.put(gpa(NAME_AT), b"worker\0");
    g.hit_si(SET_COMM, RETP, CALLER_RET, TASK, NAME_AT);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 0);
    g.ret(RETP, 0);
    assert!(g.text().contains("quiet_leaf();"));
    // The renaming of another task changes nothing here.
    g.ram.put(gpa(NAME_AT), b"idle\0");
    g.hit_si(SET_COMM, RETP, CALLER_RET, TASK_2, NAME_AT);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Another task comes in: quiet; the worker comes back on vCPU 1: armed.
    g.kernel.running.comm = *b"sleeper\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Armed);
}

/// vCPU 0 gone quiet under a session that filtered by comm, then a new
/// session on pid 42, which vCPU 0 runs: no switch comes, but the vCPU's
/// next turn must arm it.
pub(super) fn quiet_vcpu_under_a_new_pid_session() -> Guest {
    let mut g = Guest::new();
    filtered_session(&mut g, Some("worker"), None);
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    filtered_session(&mut g, None, Some(42));
    g
}

#[test]
fn a_pid_filter_arms_the_running_task_at_the_next_turn_after_its_start() {
    let mut g = quiet_vcpu_under_a_new_pid_session();
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let due = g.with(|t, _, k| {
        let due = t.view_due();
        t.turn_view(Some(k), &cpu, now);
        due && !t.view_due()
    });
    assert!(due);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Its hooks: the scheduler's, no renaming hook (no comm filter).
    let r = g.tracer().report();
    assert_eq!((r.switch_hook, r.sites), (true, 2), "{r:?}");
}

#[test]
fn a_page_with_a_root_and_quiet_sites_gets_a_partial_quiet_shadow() {
    let mut g = Guest::new();
    // Room for a partial shadow beyond what hooks keep.
    g.root.frame_limit = 2048;
    // my_func (the root) and other_func (traced beneath it) share a page.
    g.with(|t, env, k| {
        t.graph_start(graph(&["my_func"]), k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 1), "{r:?}");
    let page = gpa(FUNC) & !0xfff;
    let armed = g.root.leaf_in(0, page).unwrap().hpa;
    let quiet = g.root.quiet_leaf(0, page).unwrap();
    assert!(quiet.hpa != armed && quiet.hpa.0 != page, "{quiet:?}");
    assert_eq!(quiet.perms, ept::EXEC);
    assert_eq!(g.root.quiet_leaf(1, page).unwrap().hpa, quiet.hpa);
    let at = |g: &Guest, frame: Hpa, va: u64| -> [u8; 5] {
        g.root.frames[&frame.0][(va & 0xfff) as usize..][..5]
            .try_into()
            .unwrap()
    };
    // The root's call in both shadows; other_func's only in the armed one.
    assert_eq!(at(&g, quiet.hpa, FUNC), at(&g, armed, FUNC));
    assert_ne!(at(&g, armed, FUNC), NOP5);
    assert_eq!(at(&g, quiet.hpa, OTHER), NOP5);
    assert_ne!(at(&g, armed, OTHER), NOP5);
    // A quiet vCPU's write to the page (the guest's ftrace at other_func)
    // reaches both shadows: the guest's call in the quiet one, ours kept
    // in the armed one.
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, FTRACE_CALLER);
    g.ram.put(gpa(OTHER), &theirs);
    g.with(|t, env, _| t.finish_step(env));
    assert_eq!(at(&g, quiet.hpa, OTHER), theirs);
    assert_ne!(at(&g, armed, OTHER), theirs);
    assert_eq!(at(&g, quiet.hpa, FUNC), at(&g, armed, FUNC));
    let q = g.root.quiet_leaf(1, page).unwrap();
    assert_eq!((q.hpa, q.perms), (quiet.hpa, ept::EXEC));
    // A probe on other_func: it matters everywhere, the page is hooked
    // whole in the quiet view again.
    g.with(|t, env, k| {
        t.probe_add("p:o other_func", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 0), "{r:?}");
    assert_eq!(g.root.quiet_leaf(0, page).unwrap().hpa, armed);
}

#[test]
fn a_new_user_of_a_quiet_page_is_hooked_there_even_without_a_frame_to_spare() {
    let mut g = Guest::new();
    // Rooted at quiet_leaf: my_func and other_func's page is all quiet.
    let f = GraphFilter {
        functions: vec!["quiet_leaf".into()],
        trace: vec!["*_func".into(), "quiet_leaf".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.root.quiet_leaf(0, page).unwrap().hpa.0, page);
    // A probe on other_func: its page wants a partial shadow, and the pool
    // has none to spare here; the whole shadow takes its place.
    g.with(|t, env, k| {
        t.probe_add("p:o other_func", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let armed = g.root.leaf_in(0, page).unwrap().hpa;
    for vcpu in 0..VCPUS {
        assert_eq!(g.root.quiet_leaf(vcpu, page).unwrap().hpa, armed);
    }
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 0), "{r:?}");
}

#[test]
fn a_step_open_on_one_view_opens_again_on_the_other() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, false, false, env));
    assert!(matches!(v, Violation::Stepping));
    // The stepped context comes back on the armed view (a step preempted,
    // its vCPU armed meanwhile): the same page faults there, and opens.
    g.cpus[1].view = View::Armed;
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, false, false, env));
    assert!(matches!(v, Violation::Widened));
    let a = g.root.leaf_in(1, leaf).unwrap();
    assert_eq!((a.hpa.0, a.perms), (leaf, ept::RWX));
    // The step's end puts both views back.
    g.with(|t, env, _| t.finish_step(env));
    let q = g.root.quiet_leaf(1, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::EXEC));
    assert_ne!(g.root.leaf_in(1, leaf).unwrap().hpa.0, leaf);
}

/// `hvtrace syscalls --comm`: probes behind a gate (a session that hooks
/// nothing and filters by comm) record only the calls of the tasks it
/// admits, and their site is unhooked on the quiet view, where no such
/// task runs; the gate's stop opens it, and the site is hooked everywhere
/// again.
#[test]
fn probes_behind_a_gate_record_its_tasks_alone_and_go_quiet_elsewhere() {
    let mut g = Guest::new();
    let gate = GraphFilter {
        comm: Some("worker".into()),
        gate: true,
        ..GraphFilter::default()
    };
    let session = g.with(|t, env, k| {
        let s = t.graph_start(gate, k, env).unwrap();
        assert_eq!((s.hooked, s.roots), (0, 0));
        t.probe_add("p:entry quiet_leaf n=%di:u64", k, env).unwrap();
        t.probe_add("r:ret quiet_leaf r=$retval:s64", k, env)
            .unwrap();
        t.settle_views(Some(k), env);
        s.session
    });
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    assert_ne!(
        g.root.quiet_leaf(0, leaf).unwrap().hpa.0,
        leaf,
        "open probes: hooked on every view"
    );
    g.with(|t, env, k| {
        t.probe_gate("entry", Some(session), env).unwrap();
        t.probe_gate("ret", Some(session), env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    for vcpu in 0..VCPUS {
        assert_eq!(g.root.quiet_leaf(vcpu, leaf).unwrap().hpa.0, leaf);
        assert_ne!(g.root.leaf_in(vcpu, leaf).unwrap().hpa.0, leaf);
    }
    g.tracer().set_stream(Some(TraceFormat::Text));
    // "sleeper" comes in: quiet. A hit all the same (a view not yet
    // switched) records nothing, at its entry or its return.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 7);
    g.ret(RETP, 1);
    assert_eq!(g.text(), "", "the gate keeps the other tasks out");
    // "worker" comes in: armed, and its call records both probes.
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 7);
    g.ret(RETP, 5);
    let text = g.text();
    assert!(text.contains("n=7") && text.contains("r=5"), "{text}");
    // What cannot gate: a session with roots, no such session, no such
    // probe.
    let rooted = quiet_session(&mut g);
    g.with(|t, env, _| {
        let e = t.probe_gate("entry", Some(rooted), env).unwrap_err();
        assert_eq!(
            e.kind,
            protocol::ErrorKind::InvalidArgument,
            "{}",
            e.message
        );
        let e = t.probe_gate("entry", Some(14), env).unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::NotFound);
        let e = t.probe_gate("nope", Some(session), env).unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::NotFound);
        t.graph_stop(Some(rooted), env).unwrap();
    });
    // The gate stops: the probes record for every task, hooked everywhere.
    g.with(|t, env, k| {
        t.graph_stop(Some(session), env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (0, false), "{r:?}");
    assert_ne!(g.root.quiet_leaf(0, leaf).unwrap().hpa.0, leaf);
    g.kernel.running.comm = *b"sleeper\0\0\0\0\0\0\0\0\0";
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 9);
    g.ret(RETP, 0);
    assert!(g.text().contains("n=9"));
}

/// A gate needs a task filter and hooks nothing.
#[test]
fn a_gate_filters_tasks_and_takes_no_globs() {
    let mut g = Guest::new();
    g.with(|t, env, k| {
        let bare = GraphFilter {
            gate: true,
            ..GraphFilter::default()
        };
        assert!(t.graph_start(bare, k, env).is_err());
        let globs = GraphFilter {
            gate: true,
            pid: Some(3),
            trace: vec!["quiet_leaf".into()],
            ..GraphFilter::default()
        };
        assert!(t.graph_start(globs, k, env).is_err());
    });
    assert_eq!(g.tracer().report().sites, 0);
}

/// `hvtrace syscalls --summary --comm`: a count (timed, filtered by comm)
/// behind a gate with the same filter leaves its functions unhooked on
/// the quiet view; the gate's stop hooks them everywhere again, and the
/// count goes on.
#[test]
fn a_count_behind_a_gate_goes_quiet_where_its_tasks_do_not_run() {
    let mut g = Guest::new();
    let gate = GraphFilter {
        comm: Some("worker".into()),
        gate: true,
        ..GraphFilter::default()
    };
    let session = g.with(|t, env, k| t.graph_start(gate, k, env).unwrap().session);
    let count = protocol::CountFilter {
        functions: vec!["quiet_leaf".into()],
        comm: Some("worker".into()),
        latency: true,
        gate: Some(session),
        ..Default::default()
    };
    g.with(|t, env, k| {
        t.count_start(&count, k, env, 0).unwrap();
        t.settle_views(Some(k), env);
    });
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    assert_eq!(g.root.quiet_leaf(0, leaf).unwrap().hpa.0, leaf);
    // The worker's calls are counted (and timed).
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 0);
    g.ret(RETP, -2i64 as u64);
    let page = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    let e: Vec<(u64, u64)> = page.entries.iter().map(|e| (e.calls, e.errors)).collect();
    assert_eq!(e, [(1, 1)]);
    // A count's gate must gate: a rooted session cannot.
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    let rooted = quiet_session(&mut g);
    let bad = protocol::CountFilter {
        gate: Some(rooted),
        ..count.clone()
    };
    assert!(g.with(|t, env, k| t.count_start(&bad, k, env, 0)).is_err());
    g.with(|t, env, k| {
        t.graph_stop(Some(rooted), env).unwrap();
        t.count_start(&count, k, env, 0).unwrap();
        // The gate stops: the count's functions are hooked everywhere.
        t.graph_stop(Some(session), env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (0, false), "{r:?}");
    assert_ne!(g.root.quiet_leaf(0, leaf).unwrap().hpa.0, leaf);
}

/// `Request::Sched`: the scheduler hook records each switch as the
/// kernel's `sched_switch` (the outgoing task from the hook's first
/// argument, the incoming one running), the hook on `try_to_wake_up` each
/// wakeup of a task in a state the call wakes; off, both hooks go.
#[test]
fn switches_and_wakeups_are_recorded_as_the_kernels_events() {
    use guest_introspect::facts::TaskSched;
    let mut g = Guest::new();
    let task = |pid: i32, name: &[u8], prio: i32, state: u64| {
        let mut comm = [0u8; 16];
        comm[..name.len()].copy_from_slice(name);
        TaskSched {
            pid,
            comm,
            prio: Some(prio),
            state: Some(state),
            exit_state: Some(0),
            cpu: Some(1),
        }
    };
    g.kernel.tasks.insert(TASK_2, task(7, b"prev", 120, 1));
    g.kernel.tasks.insert(TASK, task(42, b"sleeper", 100, 0));
    let sched = |switch: bool, wakeup: bool| protocol::Request::Sched { switch, wakeup };

    g.with(|t, env, k| {
        let given = crate::tracer::door::Given {
            kernel: Some(k as &dyn KernelView),
            env: Some(&mut *env),
            now_ns: 0,
        };
        let on = t.request(sched(true, true), given);
        assert_eq!(on.unwrap(), protocol::Response::Ok);
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!(
        (r.switch_hook, r.sites, r.quiet_pages),
        (true, 2, 0),
        "{r:?}"
    );
    g.tracer().set_stream(Some(TraceFormat::Text));
    let retp = STACK_BASE + 0x3e00;
    // TASK_2 switched out asleep; the running task (sleeper) comes in.
    g.hit(SWITCH, retp, CALLER_RET, TASK_2);
    // A wakeup of TASK_2 for TASK_NORMAL (3): it sleeps in S, woken.
    g.hit_si(WAKE, retp, CALLER_RET, TASK_2, 3);
    // For TASK_UNINTERRUPTIBLE alone (2): not its state, no wakeup.
    g.hit_si(WAKE, retp, CALLER_RET, TASK_2, 2);
    // An unreadable task: nothing.
    g.hit_si(WAKE, retp, CALLER_RET, TASK_2 + 0x100, 3);
    let text = g.text();
    assert!(
        text.contains(
            "sched_switch: prev_comm=prev prev_pid=7 prev_prio=120 prev_state=S ==> next_comm=sleeper next_pid=42 next_prio=100"
        ),
        "{text}"
    );
    assert!(
        text.contains("sleeper-42      [003]")
            && text.contains("sched_wakeup: comm=prev pid=7 prio=120 target_cpu=001"),
        "{text}"
    );
    assert_eq!(text.matches("sched_wakeup:").count(), 1, "{text}");
    // Off: no session needs the scheduler hook, so both go.
    g.with(|t, env, k| {
        let given = crate::tracer::door::Given {
            kernel: Some(k as &dyn KernelView),
            env: Some(&mut *env),
            now_ns: 0,
        };
        t.request(sched(false, false), given).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.switch_hook, r.sites), (false, 0), "{r:?}");
}
