use super::*;

// ----- the entry hypercall -----------------------------------------------

#[test]
fn a_probe_hit_fetches_its_arguments_and_renders_as_kprobe_events() {
    let mut g = Guest::new();
    g.probe("p:myprobe my_func x=%di").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 42);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, 0, "a NOP site has no call to chain to");
    let text = g.text();
    assert!(
        text.contains("sleeper-42")
            && text.contains("myprobe: (my_func+0x0/")
            && text.contains("x=0x2a"),
        "{text}"
    );
    let r = g.tracer().report();
    assert_eq!((r.hits, r.forged_entries), (1, 0));
    assert_eq!(g.tracer().probe_list()[0].hits, 1);
}

#[test]
fn a_guest_ftrace_call_at_the_site_is_chained_to() {
    let mut g = Guest::new();
    // The guest's own ftrace has turned the site into `call ftrace_caller`:
    // the hook keeps it, and each hit hands it back as the chain target.
    g.ram.put(gpa(FUNC), &call_bytes(FUNC, FTRACE_CALLER));
    g.probe("p:a my_func").unwrap();
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FTRACE_CALLER);
    assert_eq!(g.tracer().report().hits, 1);
}

#[test]
fn forged_entries_are_refused_and_not_counted_as_hits() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // RDI != RSP: not the trampoline's frame.
    let regs_at = RETP - 0x200;
    g.ram.put(gpa(regs_at), &pt_regs(FUNC + 5, RETP, 0));
    let (out, _) = g.entry_vmcall(regs_at, regs_at + 8, FUNC);
    assert!(matches!(out, Hypercall::Handled));
    // A site that is not hooked.
    let (_, rax) = g.entry_vmcall(regs_at, regs_at, OTHER);
    assert_eq!(rax, 0);
    // pt_regs whose ip is not this site's call.
    g.ram.put(gpa(regs_at), &pt_regs(OTHER + 5, RETP, 0));
    g.entry_vmcall(regs_at, regs_at, FUNC);
    let r = g.tracer().report();
    assert_eq!((r.hits, r.forged_entries), (0, 3));
    assert_eq!(g.text(), "");
    // A VMCALL from anywhere else is foreign: #UD.
    let mut regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        ..GuestRegs::default()
    };
    let cpu = g.cpu(regs_at);
    let out = g.with(|t, env, k| t.hypercall(env, FUNC, &mut regs, &cpu, Some(k), 0));
    assert!(matches!(out, Hypercall::Foreign));
    assert_eq!(g.tracer().report().foreign_vmcalls, 1);
    // Every one of the four hypercalls is counted for vCPU 0, as refused.
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.returns, c.refused), (0, 0, 4));
}

#[test]
fn each_hypercall_says_once_what_it_was_for_roots_time() {
    use crate::stats::RootWork;
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.cpus[0].take_served(), None);
    // RDI != RSP: forged.
    g.entry_vmcall(RETP - 0x200, RETP - 0x1f8, FUNC);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Refused));
    // A return with no frame: an orphan, refused too.
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Refused));
}

#[test]
fn the_function_tracer_records_function_and_parent() {
    let mut g = Guest::new();
    let added = g
        .with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    assert_eq!((added.traced, added.skipped_total), (2, 0));
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(OTHER, RETP, CALLER_RET, 0);
    let text = g.text();
    assert!(text.contains("other_func <-caller"), "{text}");
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
}

#[test]
fn a_hits_stack_reads_share_one_walk_until_the_turn() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The frame and the parent are on one stack page: one walk, then the
    // parent through the cached leaf.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (1, 1));
    // The next hit walks nothing.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (3, 1));
    // A turn forgets it.
    g.with(|t, env, _| t.on_turn(env));
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (4, 2));
    let text = g.text();
    assert_eq!(text.matches("my_func <-caller").count(), 3, "{text}");
}

#[test]
fn a_count_counts_calls_in_root_records_nothing_and_keeps_other_uses() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into(), "other_*".into()],
        ..Default::default()
    };
    let added = g
        .with(|t, env, k| t.count_start(&filter, k, env, 1_000))
        .unwrap();
    assert_eq!((added.traced, added.skipped_total), (2, 0));
    // One count at a time.
    let again = g.with(|t, env, k| t.count_start(&filter, k, env, 1_000));
    assert_eq!(again.unwrap_err().kind, protocol::ErrorKind::AlreadyExists);
    for _ in 0..3 {
        g.hit(FUNC, RETP, CALLER_RET, 0);
    }
    g.hit(OTHER, RETP, CALLER_RET, 0);
    assert_eq!(g.text(), "", "a count records no event");
    assert_eq!(g.tracer().report().hits, 4);
    let read = |g: &mut Guest, cursor, limit| {
        g.with(|t, _, k| t.count_read(cursor, limit, k, 5_000))
            .unwrap()
    };
    let page = read(&mut g, 0, 100);
    let got: Vec<(String, u64)> = page
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.calls))
        .collect();
    assert_eq!(
        got,
        [("my_func".to_string(), 3), ("other_func".to_string(), 1)]
    );
    assert_eq!((page.functions, page.calls, page.filtered), (2, 4, 0));
    assert_eq!((page.elapsed_ns, page.next), (4_000, None));
    assert!(page.memory > 0);
    // Paged a function at a time, in address order.
    let first = read(&mut g, 0, 1);
    assert_eq!(first.entries.len(), 1);
    let second = read(&mut g, first.next.unwrap(), 1);
    assert_eq!(second.entries[0].name, "other_func");
    assert_eq!(second.next, None);

    // The function tracer on a counted function records, and counts go on.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(g.text().contains("my_func <-caller"));
    assert_eq!(read(&mut g, 0, 100).calls, 5);
    // Stopping the count keeps the function tracer's site, drops the rest.
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 1);
    let gone = g.with(|t, _, k| t.count_read(0, 10, k, 0).map(|_| ()));
    assert_eq!(gone.unwrap_err().kind, protocol::ErrorKind::NotFound);
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
}

impl Guest {
    /// Lays out an entry as [`Guest::hit`] does (ip = `ip`) and offers it
    /// to the fast path with the exit's `cpl`, RIP `rip` (the entry VMCALL
    /// when `None`), RAX `nr` and RSP = RDI = the frame; the chain target
    /// when served.
    pub(super) fn fast(
        &mut self,
        func: u64,
        ip: u64,
        cpl: u8,
        rip: Option<u64>,
        nr: u32,
    ) -> Option<u64> {
        let regs_at = RETP - trampolines::abi::ENTRY_SP_FROM_FRAME;
        self.ram.put(gpa(RETP), &CALLER_RET.to_le_bytes());
        self.ram.put(gpa(RETP - 8), &ip.to_le_bytes());
        self.ram.put(gpa(regs_at), &pt_regs(ip, RETP, 0));
        let rip = rip.unwrap_or_else(|| self.region().entry_vmcall().unwrap().0);
        let regs = GuestRegs {
            rax: u64::from(nr),
            rdi: regs_at,
            rsi: func,
            ..GuestRegs::default()
        };
        let exit = crate::tracer::FastExit {
            rip,
            cpl,
            rsp: regs_at,
        };
        self.fast_exit(exit, &regs)
    }

    /// The fast path on `exit` and `regs` as given.
    pub(super) fn fast_exit(
        &mut self,
        exit: crate::tracer::FastExit,
        regs: &GuestRegs,
    ) -> Option<u64> {
        let now = self.now_ns;
        Hit::new(&self.vm, &mut self.cpus[self.on]).fast_entry(
            &self.door,
            &self.kernel,
            exit,
            regs,
            gs_of_vcpu0,
            || now,
        )
    }

    /// The calls the count has, over every function.
    pub(super) fn counted(&mut self) -> u64 {
        self.with(|t, _, k| t.count_read(0, 100, k, 0))
            .unwrap()
            .calls
    }
}

/// vCPU 0's GS base, as root's lazy GUEST_GS_BASE read gives it.
pub(super) fn gs_of_vcpu0() -> u64 {
    GS_BASES[0]
}

#[test]
fn the_fast_path_reads_the_gs_base_once_a_turn() {
    static READS: AtomicU64 = AtomicU64::new(0);
    pub(super) fn gs() -> u64 {
        READS.fetch_add(1, SeqCst);
        GS_BASES[0]
    }
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    let regs_at = RETP - trampolines::abi::ENTRY_SP_FROM_FRAME;
    g.ram.put(gpa(RETP), &CALLER_RET.to_le_bytes());
    g.ram.put(gpa(regs_at), &pt_regs(FUNC + 5, RETP, 0));
    let regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        rdi: regs_at,
        rsi: FUNC,
        ..GuestRegs::default()
    };
    let exit = crate::tracer::FastExit {
        rip: g.region().entry_vmcall().unwrap().0,
        cpl: 0,
        rsp: regs_at,
    };
    let fast = |g: &mut Guest| {
        let (door, k) = (&g.door, &g.kernel);
        Hit::new(&g.vm, &mut g.cpus[0]).fast_entry(door, k, exit, &regs, gs, || 0)
    };
    for _ in 0..3 {
        assert_eq!(fast(&mut g), Some(0));
    }
    assert_eq!(
        READS.load(SeqCst),
        1,
        "one GUEST_GS_BASE read for the turn's hits"
    );
    assert_eq!(g.cpus[0].kernel_gs(), Some(GS_BASES[0]));
    g.with(|t, env, _| t.on_turn(env));
    assert_eq!(g.cpus[0].kernel_gs(), None, "forgotten at the turn");
    assert_eq!(fast(&mut g), Some(0));
    assert_eq!(READS.load(SeqCst), 2);
    // Each record names the task the GS base leads to.
    let text = g.text();
    assert_eq!(text.matches("sleeper-42").count(), 4, "{text}");
}

#[test]
fn the_fast_path_serves_counts_probes_and_functions_as_the_general_path_would() {
    use crate::stats::RootWork;
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The guest's own ftrace calls at FUNC: the chain target comes back.
    g.ram.put(gpa(FUNC), &call_bytes(FUNC, FTRACE_CALLER));
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into(), "other_*".into()],
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    assert_eq!(
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY),
        Some(FTRACE_CALLER)
    );
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), Some(0));
    // Served as the general path serves the same entry.
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FTRACE_CALLER);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.counted(), 3);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (3, 0));
    assert_eq!(g.tracer().report().hits, 3);
    assert_eq!(g.text(), "", "a count records no event");

    // Everything else is left to the general path, with nothing counted.
    let entry = g.region().entry_vmcall().unwrap().0;
    let ret = g.region().return_vmcall().unwrap().0;
    let refused = [
        // User mode.
        g.fast(FUNC, FUNC + 5, 3, None, HYPERCALL_ENTRY),
        // Another VMCALL: the return trampoline's, or one of the guest's.
        g.fast(FUNC, FUNC + 5, 0, Some(ret), HYPERCALL_ENTRY),
        g.fast(FUNC, FUNC + 5, 0, Some(entry + 3), HYPERCALL_ENTRY),
        // The wrong number.
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_RETURN),
        // A site nobody hooked.
        g.fast(CALLER, CALLER + 5, 0, None, HYPERCALL_ENTRY),
        // A frame whose ip is not the site's call: forged.
        g.fast(FUNC, OTHER + 5, 0, None, HYPERCALL_ENTRY),
    ];
    assert_eq!(refused, [None; 6]);
    assert_eq!(g.cpus[0].take_served(), None);
    // RDI that is not RSP.
    let mut regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        rdi: RETP - 0x200,
        rsi: FUNC,
        ..GuestRegs::default()
    };
    let exit = crate::tracer::FastExit {
        rip: entry,
        cpl: 0,
        rsp: RETP - 0x1f8,
    };
    assert_eq!(g.fast_exit(exit, &regs), None);
    // A frame that does not read (outside the guest's tables).
    regs.rdi = 0xffff_c900_0000_0000;
    let exit = crate::tracer::FastExit {
        rsp: regs.rdi,
        ..exit
    };
    assert_eq!(g.fast_exit(exit, &regs), None);
    assert_eq!(g.counted(), 3);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (3, 0));
    assert_eq!(g.text(), "");

    // The function tracer and a probe with no argument on counted sites:
    // served, each recording what the general path records.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.probe("p:plain other_func").unwrap();
    assert_eq!(
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY),
        Some(FTRACE_CALLER)
    );
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), Some(0));
    let fast_text = g.text();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(OTHER, RETP, CALLER_RET, 0);
    let general_text = g.text();
    assert!(fast_text.contains("my_func <-caller"), "{fast_text}");
    assert!(fast_text.contains("plain: (other_func+0x0/"), "{fast_text}");
    assert!(fast_text.contains("sleeper-42"), "{fast_text}");
    assert_eq!(
        fast_text, general_text,
        "the fast path records as the general one"
    );
    assert_eq!(g.counted(), 7);
    assert_eq!(g.tracer().probe_list()[0].hits, 2);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (7, 0));

    // A probe that fetches reads registers: general.
    g.probe("p:args other_func x=%di").unwrap();
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), None);
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    // A count with a filter reads the task: general.
    let filtered = protocol::CountFilter {
        comm: Some("sleeper".into()),
        ..filter.clone()
    };
    g.with(|t, env, k| t.count_start(&filtered, k, env, 0))
        .unwrap();
    assert_eq!(g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY), None);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.counted(), 1);
    // A count that times its calls takes their returns: general.
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    let timed = protocol::CountFilter {
        latency: true,
        ..filter
    };
    g.with(|t, env, k| t.count_start(&timed, k, env, 0))
        .unwrap();
    assert_eq!(g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY), None);
}

#[test]
fn a_count_with_latency_times_each_call_through_its_return() {
    let mut g = Guest::new();
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into()],
        comm: Some("sleeper".into()),
        latency: true,
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    // Three calls of 1, 1000 and 5000 ns, returning 0, -ENOENT and
    // -4096 (below the errno range); a fourth by another task is neither
    // counted nor hijacked.
    for (d, ret) in [(1u64, 0u64), (1000, -2i64 as u64), (5000, -4096i64 as u64)] {
        g.now_ns += 10_000;
        g.hit(FUNC, RETP, CALLER_RET, 0);
        let tramp = g.region().return_trampoline().0;
        assert_eq!(g.ram.word(gpa(RETP)), tramp, "the return is hijacked");
        g.now_ns += d;
        let (_, rax) = g.ret(RETP, ret);
        assert_eq!(rax, CALLER_RET, "the call returns to its caller");
    }
    let me = g.kernel.running.comm;
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(
        g.ram.word(gpa(RETP)),
        CALLER_RET,
        "a left-out call is not hijacked"
    );
    g.kernel.running.comm = me;
    let page = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((page.calls, page.filtered, page.latency_missed), (3, 1, 0));
    // 1 ns: bucket 1; 1000 ns: bucket 10 (512..1023); 5000: 13 (4096..8191).
    let mut want = vec![0u64; 14];
    want[1] = 1;
    want[10] = 1;
    want[13] = 1;
    assert_eq!(page.latency, want);
    // Per function: the errno returns and the time, summed.
    let f: Vec<(u64, u64, u64)> = page
        .entries
        .iter()
        .map(|e| (e.calls, e.errors, e.total_ns))
        .collect();
    assert_eq!(f, [(3, 1, 6001)]);
    assert_eq!(crate::tracer::count::latency_bucket(0), 0);
    assert_eq!(crate::tracer::count::latency_bucket(u64::MAX), 63);
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.graph_frames), (0, 0));
}

#[test]
fn a_histogram_buckets_a_fetch_argument_by_key_in_bounded_rows() {
    let mut g = Guest::new();
    let hist = |key| protocol::CountFilter {
        hist: Some(protocol::HistFilter {
            spec: "p my_func n=%di:u64".into(),
            key,
        }),
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&hist(protocol::HistKey::Comm), k, env, 0))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    for n in [512, 512, 4096, 0] {
        g.hit(FUNC, RETP, CALLER_RET, n);
    }
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 1);
    assert_eq!(g.text(), "", "a histogram records no event");
    let page = g.with(|t, _, k| t.hist_read(0, k)).unwrap();
    let rows: Vec<(String, Vec<u64>)> = page
        .rows
        .iter()
        .map(|r| (r.key.clone(), r.buckets.clone()))
        .collect();
    let mut sleeper = vec![0u64; 14];
    sleeper[0] = 1; // 0
    sleeper[10] = 2; // 512..1023
    sleeper[13] = 1; // 4096..8191
    assert_eq!(
        rows,
        [
            ("sleeper".to_string(), sleeper),
            ("other".to_string(), vec![0, 1])
        ]
    );
    assert_eq!((page.overflow, page.faults, page.next), (0, 0, None));
    g.with(|t, env, _| t.count_stop(env)).unwrap();

    // By pid: more pids than rows, the rest counted as overflow.
    g.with(|t, env, k| t.count_start(&hist(protocol::HistKey::Pid), k, env, 0))
        .unwrap();
    let keys = crate::tracer::count::HIST_KEYS as i32;
    for pid in 0..keys + 3 {
        g.kernel.running.pid = 1000 + pid;
        g.hit(FUNC, RETP, CALLER_RET, 8);
    }
    let mut rows = Vec::new();
    let mut cursor = 0;
    let last = loop {
        let page = g.with(|t, _, k| t.hist_read(cursor, k)).unwrap();
        rows.extend(page.rows.iter().map(|r| r.key.clone()));
        match page.next {
            Some(n) => cursor = n,
            None => break page,
        }
    };
    assert_eq!(
        rows.len(),
        crate::tracer::count::HIST_KEYS,
        "paged to the end"
    );
    assert_eq!(rows[0], "1000");
    assert_eq!(last.overflow, 3);
    g.with(|t, env, _| t.count_stop(env)).unwrap();

    // A histogram takes an entry probe with an argument, and no globs.
    for (spec, globs) in [
        ("r my_func $retval", vec![]),
        ("p my_func", vec![]),
        ("p my_func n=%di", vec!["other_*".to_string()]),
        ("p: bad", vec![]),
        ("p my_func s=+0(%di):string n=%si", vec![]),
        ("p my_func s=$comm", vec![]),
        ("p my_func s=%di:symstr", vec![]),
    ] {
        let mut f = hist(protocol::HistKey::Function);
        f.functions = globs;
        if let Some(h) = f.hist.as_mut() {
            h.spec = spec.into();
        }
        let e = g
            .with(|t, env, k| t.count_start(&f, k, env, 0))
            .unwrap_err();
        assert_eq!(
            e.kind,
            protocol::ErrorKind::InvalidArgument,
            "{spec}: {}",
            e.message
        );
        if spec.contains("s=") {
            assert!(e.message.contains("is a string"), "{spec}: {}", e.message);
        }
    }
    assert_eq!(g.tracer().report().sites, 0);
}

#[test]
fn a_counts_comm_filter_counts_the_others_apart() {
    let mut g = Guest::new();
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into()],
        comm: Some("sleeper".into()),
        ..Default::default()
    };
    let name = g.kernel.running.comm;
    assert!(name.starts_with(b"sleeper"), "the test task is sleeper");
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    let page = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((page.calls, page.filtered), (1, 2));
    for bad in ["", "sixteen_bytes_xx"] {
        let f = protocol::CountFilter {
            functions: vec!["my_func".into()],
            comm: Some(bad.into()),
            ..Default::default()
        };
        g.with(|t, env, _| t.count_stop(env)).ok();
        let e = g
            .with(|t, env, k| t.count_start(&f, k, env, 0))
            .unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument, "{bad:?}");
    }
    let none = protocol::CountFilter::default();
    let e = g
        .with(|t, env, k| t.count_start(&none, k, env, 0))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument);
}

#[test]
fn hits_on_two_vcpus_are_merged_by_time_with_the_guests_cpu_numbers() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Json));
    // vCPU 1 stores two hits before vCPU 0 stores the one between them.
    for (on, now) in [(1, 10_000), (1, 30_000), (0, 20_000)] {
        g.on = on;
        g.now_ns = now;
        g.hit(OTHER, RETP, CALLER_RET, 0);
    }
    g.on = 0;
    let text = g.text();
    let got: Vec<(u64, u64)> = text
        .lines()
        .map(|l| {
            let num = |key: &str| -> u64 {
                let at = l.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
                let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
                digits.parse().unwrap()
            };
            (num("ts_ns"), num("cpu"))
        })
        .collect();
    // Oldest first, each with the guest's number for its vCPU.
    assert_eq!(
        got,
        [
            (10_000, u64::from(GUEST_CPU[1])),
            (20_000, u64::from(GUEST_CPU[0])),
            (30_000, u64::from(GUEST_CPU[1]))
        ],
        "{text}"
    );
    // Losses are each vCPU's own.
    assert_eq!((g.vm.lost_of(0), g.vm.lost_of(1)), (0, 0));
}

#[test]
fn a_step_opens_the_page_in_its_own_vcpus_view_only() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow = g.root.leaf_in(0, page).unwrap();
    assert_eq!(
        (shadow.hpa, shadow.perms),
        (g.root.leaf_in(1, page).unwrap().hpa, ept::EXEC),
        "a hook is in every view"
    );
    // vCPU 1 writes the page: its view opens the guest's frame...
    g.on = 1;
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    let mine = g.root.leaf_in(1, page).unwrap();
    assert_eq!((mine.hpa.0, mine.perms), (page, ept::RWX));
    // ... while vCPU 0 keeps executing the shadow, with no step of its own.
    let other = g.root.leaf_in(0, page).unwrap();
    assert_eq!((other.hpa, other.perms), (shadow.hpa, ept::EXEC));
    g.on = 0;
    assert!(!g.tracer().wants_debug_exits());
    // The step ends on vCPU 1: both views execute the resynced shadow.
    g.on = 1;
    g.with(|t, env, _| t.finish_step(env));
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, page).unwrap();
        assert_eq!((l.hpa, l.perms), (shadow.hpa, ept::EXEC), "view {view}");
    }
    assert_eq!(
        g.root.frames[&shadow.hpa.0][(OTHER & 0xfff) as usize..][..5],
        theirs
    );
    // Unhooking returns the page to the guest in every view.
    g.on = 0;
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, page).unwrap();
        assert_eq!((l.hpa.0, l.perms), (page, ept::RWX), "view {view}");
    }
}

#[test]
fn a_site_any_vcpu_is_inside_is_not_patched() {
    let mut g = Guest::new();
    // vCPU 1 was stopped with its RIP inside my_func's site.
    g.root.rips = vec![0, FUNC + 2];
    let e = g
        .with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap_err();
    assert!(e.message.contains("inside the site"), "{e:?}");
    assert_eq!(g.tracer().report().sites, 0);
    g.root.rips = vec![0, FUNC + 5];
    g.with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap();
}

#[test]
fn nothing_changes_when_the_other_vcpus_do_not_come() {
    let mut g = Guest::new();
    g.root.others_come = false;
    let e = g
        .with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    let e = g
        .with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    let r = g.tracer().report();
    assert_eq!((r.sites, r.pages, r.trampolines), (0, 0, 0));
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, gpa(FUNC) & !0xfff).unwrap();
        assert_eq!(l.hpa.0, gpa(FUNC) & !0xfff, "view {view}");
    }
    // They come: the probe is made; they do not: its deletion is refused
    // and it stays.
    g.root.others_come = true;
    g.probe("p:a my_func").unwrap();
    g.root.others_come = false;
    let e = g.with(|t, env, _| t.probe_del("a", env)).unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    assert_eq!(g.tracer().report().sites, 1);
    assert_eq!(g.tracer().probe_list().len(), 1);
}
