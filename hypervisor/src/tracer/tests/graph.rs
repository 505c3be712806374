use super::*;

// ----- function graph ----------------------------------------------------

pub(super) fn graph(functions: &[&str]) -> GraphFilter {
    GraphFilter {
        functions: functions.iter().map(|s| s.to_string()).collect(),
        trace: vec!["*_func".into()],
        ..GraphFilter::default()
    }
}

#[test]
fn graph_entry_hijacks_the_return_and_the_return_gives_it_back() {
    let mut g = Guest::new();
    let started = g
        .with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    assert_eq!((started.session, started.hooked, started.roots), (1, 2, 1));
    g.tracer().set_stream(Some(TraceFormat::Text));
    let tramp = g.region().return_trampoline().0;

    // Entry: the return slot now holds the return trampoline; one frame.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), tramp);
    let r = g.tracer().report();
    assert_eq!((r.graph_stacks, r.graph_frames), (1, 1));
    // A nested call of other_func, lower on the same stack.
    g.now_ns += 1_000;
    let inner = RETP - 0x100;
    g.hit(OTHER, inner, FUNC + 0x40, 0);
    assert_eq!(g.ram.word(gpa(inner)), tramp);
    assert_eq!(g.tracer().report().graph_frames, 2);

    // Returns, innermost first: each hands back its own return address.
    g.now_ns += 2_000;
    let (out, rax) = g.ret(inner, 7);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FUNC + 0x40);
    g.now_ns += 3_000;
    let (_, rax) = g.ret(RETP, 0);
    assert_eq!(rax, CALLER_RET);
    assert_eq!(
        g.cpus[0].take_served(),
        Some(crate::stats::RootWork::Return)
    );
    let r = g.tracer().report();
    assert_eq!((r.graph_stacks, r.graph_frames), (0, 0));

    let text = g.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].ends_with("|  my_func() {"), "{text}");
    assert!(
        lines[1].contains("2.000 us") && lines[1].ends_with("|    other_func();"),
        "{text}"
    );
    assert!(
        lines[2].contains("6.000 us") && lines[2].ends_with("|  }"),
        "{text}"
    );
    // A return with no frame is an orphan: #UD.
    let (out, _) = g.ret(RETP, 0);
    assert!(matches!(out, Hypercall::Foreign));
    assert_eq!(g.tracer().report().graph_orphans, 1);
    // Two entries recorded, two returns handed back, the orphan refused.
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.returns, c.refused), (2, 2, 1));
}

#[test]
fn a_max_depth_1_session_hooks_only_its_roots() {
    let mut g = Guest::new();
    // The default trace set is every function: with max_depth 1 under a
    // root, none of it is hooked.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        max_depth: 1,
        ..GraphFilter::default()
    };
    let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    assert_eq!((started.hooked, started.roots), (1, 1));
    assert_eq!(g.tracer().report().sites, 1);
    g.tracer().set_stream(Some(TraceFormat::Text));
    let tramp = g.region().return_trampoline().0;
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), tramp);
    g.now_ns += 4_000;
    assert_eq!(g.ret(RETP, 0).1, CALLER_RET);
    let text = g.text();
    assert!(
        text.lines().count() == 1 && text.contains("4.000 us") && text.ends_with("|  my_func();\n"),
        "{text}"
    );
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    // max_depth 2, or no roots: the trace set is hooked as before.
    for f in [
        GraphFilter {
            functions: vec!["my_func".into()],
            max_depth: 2,
            ..GraphFilter::default()
        },
        GraphFilter {
            max_depth: 1,
            ..GraphFilter::default()
        },
    ] {
        let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
        assert!(started.hooked >= 3, "{}", started.hooked);
        g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    }
}

#[test]
fn calls_outside_the_roots_are_not_hijacked() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(OTHER, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET);
    assert_eq!(g.tracer().report().graph_frames, 0);
}

#[test]
fn max_depth_and_comm_filters_apply_at_the_root() {
    let mut g = Guest::new();
    let mut f = graph(&["my_func"]);
    f.max_depth = 1;
    f.comm = Some("sleeper".into());
    g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(OTHER, RETP - 0x100, FUNC + 0x40, 0);
    assert_eq!(g.tracer().report().graph_frames, 1, "depth 1 only");
    assert_eq!(g.ram.word(gpa(RETP - 0x100)), FUNC + 0x40);
    g.ret(RETP, 0);

    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 0, "comm does not match");
}

#[test]
fn a_return_probe_sees_the_return_value() {
    let mut g = Guest::new();
    g.probe("r:myret my_func ret=$retval").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 1);
    let (_, rax) = g.ret(RETP, 0x1234);
    assert_eq!(rax, CALLER_RET);
    let text = g.text();
    assert!(
        text.contains("myret: (caller+0x15/0x1000 <- my_func)") && text.contains("ret=0x1234"),
        "{text}"
    );
}

#[test]
fn a_return_probe_reads_the_arguments_saved_at_the_entry() {
    let mut g = Guest::new();
    g.probe("r:myret my_func ret=$retval a=$arg1 b=$arg2:u32 c=$arg3")
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit_si(FUNC, RETP, CALLER_RET, 0xfeed, 7);
    // At the return the registers are the callee's: the values printed
    // are the entry's (and a third argument, 0 at the entry, is 0).
    let (_, rax) = g.ret(RETP, 0x99);
    assert_eq!(rax, CALLER_RET);
    let text = g.text();
    assert!(text.contains("ret=0x99 a=0xfeed b=7 c=0x0"), "{text}");
    // A probe that reads none saves none: the same hit leaves its frame
    // as before.
    let mut g = Guest::new();
    g.probe("r:plain my_func ret=$retval").unwrap();
    g.hit_si(FUNC, RETP, CALLER_RET, 0xfeed, 7);
    assert_eq!(g.tracer().report().graph_frames, 1);
}

#[test]
fn the_reaper_drops_the_stacks_of_dead_tasks_only() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 1);
    let cpu = g.cpu(RETP);
    let reap = |g: &mut Guest| {
        g.now_ns += 1_000_000_000;
        Tracer::new(&mut g.vm, &mut g.cpus[0]).reap(Some(&g.kernel), &cpu, g.now_ns);
        let r = g.tracer().report();
        (r.graph_frames, r.graph_reaped)
    };
    // Alive (its stack is still its own) and running: kept.
    assert_eq!(reap(&mut g), (1, 0));
    // Its task_struct no longer points at the stack, but it is the task
    // running: kept.
    g.kernel.task_stacks.insert(TASK, 0);
    assert_eq!(reap(&mut g), (1, 0));
    // Another task runs, and the dead one's task_struct is unreadable:
    // not known dead, kept.
    g.kernel.running.task = TASK + 0x4000;
    g.kernel.task_stacks.remove(&TASK);
    assert_eq!(reap(&mut g), (1, 0));
    // Its stack pointer is cleared: its frames go.
    g.kernel.task_stacks.insert(TASK, 0);
    assert_eq!(reap(&mut g), (0, 1));
}

#[test]
fn graph_stop_keeps_frames_in_flight_returning() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
    // The hijacked return still comes back, and is handed its address.
    let (out, rax) = g.ret(RETP, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, CALLER_RET);
}

/// A task's kernel stack for the second vCPU, below the first's.
pub(super) const STACK_BASE_2: u64 = STACK_BASE - 0x4000;

#[test]
fn hits_on_two_vcpus_run_at_once_over_the_shared_state() {
    // The tracer's VM state is what root shares between the hits of its
    // vCPUs: it must be `Sync` as a type, not by root's say-so.
    pub(super) fn sync<T: Sync>(_: &T) {}
    let mut g = Guest::new();
    sync(&g.vm);
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.with(|t, env, k| t.graph_start(graph(&["other_func"]), k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Json));
    let region = g.region();
    let entry_rip = region.entry_vmcall().unwrap().0;
    let return_rip = region.return_vmcall().unwrap().0;
    let tramp = region.return_trampoline().0;
    // Two vCPUs in two threads, each a task on its own kernel stack,
    // calling other_func N times: entry, then return, each time with a
    // nested call of my_func on top half of the time.
    const N: u64 = 1500;
    let clock = AtomicU64::new(1_000_000_000);
    let (vm, door, kernel, ram) = (&g.vm, &g.door, &g.kernel, g.ram);
    std::thread::scope(|s| {
        for (on, cpu_state) in g.cpus.iter_mut().enumerate() {
            let clock = &clock;
            s.spawn(move || {
                let mut root = FakeRoot::new();
                root.me = on;
                let base = [STACK_BASE, STACK_BASE_2][on];
                // One VMCALL of this vCPU at `rip` with RSP `rsp` and
                // RAX, RDI, RSI as given: its outcome and the RAX back.
                let vmcall = |root: &mut FakeRoot,
                              cpu_state: &mut CpuState,
                              rip: u64,
                              rsp: u64,
                              [rax, rdi, rsi]: [u64; 3]| {
                    let mut regs = GuestRegs {
                        rax,
                        rdi,
                        rsi,
                        ..GuestRegs::default()
                    };
                    let cpu = CpuView {
                        cr3: PML4,
                        rsp,
                        gs_base: GuestGs::known(GS_BASES[on]),
                        ..CpuView::default()
                    };
                    let mut env = Env { ram: door, m: root };
                    let now = clock.fetch_add(10, SeqCst);
                    let out = Hit::new(vm, cpu_state).hypercall(
                        &mut env,
                        rip,
                        &mut regs,
                        &cpu,
                        Some(kernel),
                        now,
                    );
                    (out, regs.rax)
                };
                let call = |root: &mut FakeRoot,
                            cpu_state: &mut CpuState,
                            func: u64,
                            retp: u64,
                            ret: u64,
                            i: u64| {
                    ram.put(gpa(retp), &ret.to_le_bytes());
                    ram.put(gpa(retp - 8), &(func + 5).to_le_bytes());
                    let regs_at = retp - trampolines::abi::ENTRY_SP_FROM_FRAME;
                    ram.put(gpa(regs_at), &pt_regs(func + 5, retp, i));
                    let regs = [u64::from(HYPERCALL_ENTRY), regs_at, func];
                    let (out, _) = vmcall(root, cpu_state, entry_rip, regs_at, regs);
                    assert!(matches!(out, Hypercall::Handled));
                    assert_eq!(ram.word(gpa(retp)), tramp, "vCPU {on} call {i}");
                };
                let ret = |root: &mut FakeRoot, cpu_state: &mut CpuState, retp: u64, i: u64| {
                    let frame = retp - RETURN_FRAME_RETP as u64;
                    let regs = [u64::from(HYPERCALL_RETURN), frame, i];
                    let (out, rax) = vmcall(root, cpu_state, return_rip, retp, regs);
                    assert!(matches!(out, Hypercall::Handled), "vCPU {on} return {i}");
                    rax
                };
                let outer = base + 0x3f00;
                let inner = outer - 0x100;
                for i in 0..N {
                    call(&mut root, cpu_state, OTHER, outer, CALLER_RET, i);
                    if i % 2 == 0 {
                        call(&mut root, cpu_state, FUNC, inner, OTHER + 0x40, i);
                        assert_eq!(ret(&mut root, cpu_state, inner, i), OTHER + 0x40);
                    }
                    assert_eq!(ret(&mut root, cpu_state, outer, i), CALLER_RET);
                }
            });
        }
    });
    let r = g.tracer().report();
    assert_eq!(r.hits, 2 * (N + N / 2));
    // Each vCPU's hypercalls: its entries and its returns, nothing else.
    for i in 0..2 {
        let c = g.vm.hypercalls_of(i, 0);
        assert_eq!((c.hits, c.returns, c.refused), (N + N / 2, N + N / 2, 0));
    }
    assert_eq!((r.graph_stacks, r.graph_frames), (0, 0));
    assert_eq!(
        (r.graph_misses, r.graph_dropped, r.graph_orphans),
        (0, 0, 0)
    );
    assert_eq!((g.vm.lost_of(0), g.vm.lost_of(1)), (0, 0));
    // Every record, merged oldest first, with the guest's CPU numbers:
    // per CPU, N + N/2 function-tracer lines and the graph's entries and
    // returns of other_func's trees (my_func nested in half of them).
    let text = g.text();
    let mut last_ts = 0;
    let mut per_cpu = BTreeMap::<u64, u64>::new();
    for l in text.lines() {
        let num = |key: &str| -> u64 {
            let at = l.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().unwrap()
        };
        let ts = num("ts_ns");
        assert!(ts >= last_ts, "out of order at {l}");
        last_ts = ts;
        *per_cpu.entry(num("cpu")).or_default() += 1;
    }
    let each = (N + N / 2) * 3;
    assert_eq!(
        per_cpu,
        BTreeMap::from([
            (u64::from(GUEST_CPU[0]), each),
            (u64::from(GUEST_CPU[1]), each)
        ]),
        "{}",
        text.lines().take(8).collect::<Vec<_>>().join("\n")
    );
}
