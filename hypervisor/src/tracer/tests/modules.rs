use super::*;

// ----- modules that come and go ----------------------------------------

/// The module list as the kernel has it while `hvtarget` is coming: its
/// init text still in place, with `hvtarget_init` there.
pub(super) fn modules_coming() -> guest_introspect::module::ModuleIndex {
    use guest_introspect::module::{ModuleIndex, ModuleStates, ModuleSymbol};
    let idx = modules(true);
    let states = ModuleStates {
        live: 0,
        coming: 1,
        going: 2,
        unformed: 3,
    };
    let mut list = idx.modules().to_vec();
    list[0].init_text = GvaRange::with_len(Gva(MOD_INIT_TEXT), 0x1000);
    list[0].symbols.push(ModuleSymbol {
        addr: MOD_INIT_FUNC,
        kind: b't',
        name: "hvtarget_init".into(),
    });
    ModuleIndex::new(list, states).unwrap()
}

/// The module list as the kernel has it with `hvtarget` loaded (or not).
pub(super) fn modules(loaded: bool) -> guest_introspect::module::ModuleIndex {
    use guest_introspect::module::{Module, ModuleIndex, ModuleStates, ModuleSymbol};
    let states = ModuleStates {
        live: 0,
        coming: 1,
        going: 2,
        unformed: 3,
    };
    let list = if loaded {
        vec![Module {
            addr: Gva(MOD_STRUCT),
            name: "hvtarget".into(),
            state: states.coming,
            text: GvaRange::with_len(Gva(MOD_TEXT), 0x1000),
            init_text: GvaRange::new(Gva(0), Gva(0)),
            symbols: vec![ModuleSymbol {
                addr: MOD_FUNC,
                kind: b't',
                name: "hvtarget_sum".into(),
            }],
        }]
    } else {
        Vec::new()
    };
    ModuleIndex::new(list, states).unwrap()
}

impl Guest {
    /// The guest calls the kernel function `func` with `struct module *`
    /// `module`; the hidden hook there notes the event, which the exit
    /// handler then serves (with the module list as the kernel now has
    /// it). Returns the event seen.
    pub(super) fn module_call(
        &mut self,
        func: u64,
        module: u64,
    ) -> Option<crate::tracer::modules::ModuleEvent> {
        let (out, _) = self.hit(func, RETP, CALLER_RET, module);
        assert!(matches!(out, Hypercall::Handled));
        let ev = self.cpus[self.on].take_module_event()?;
        self.with(|t, env, k| t.module_event(ev, k, env));
        Some(ev)
    }

    pub(super) fn sites_and_pages(&mut self) -> (u32, u32, u32) {
        let r = self.tracer().report();
        (r.sites, r.pages, r.module_hooks)
    }
}

#[test]
fn a_probe_on_a_module_not_loaded_is_armed_at_its_load_and_pending_again_at_its_unload() {
    use crate::tracer::modules::{ModuleEvent, ModuleHook};
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // Pending: nothing of the module is hooked, but root's own hooks on
    // do_init_module and free_module are in.
    let (name, site) = g.probe("p:ms hvtarget:hvtarget_sum n=%di").unwrap();
    assert_eq!((name.as_str(), site), ("kprobes/ms", 0));
    let list = g.tracer().probe_list();
    assert!(list[0].pending && list[0].site == 0, "{list:?}");
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    assert_eq!(g.tracer().report().pending_probes, 1);
    let mod_page = gpa(MOD_FUNC) & !0xfff;
    assert!(g.root.leaf(mod_page).is_none_or(|l| l.hpa.0 == mod_page));
    // An unknown symbol of a loaded module is an error, not pending.
    g.kernel.modules = modules(true);
    let e = g.probe("p:nosuch hvtarget:hvtarget_nosuch").unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotFound);
    assert!(e.message.contains("hvtarget_nosuch") && !e.message.contains('\n'));
    g.kernel.modules = modules(false);

    for round in 0..20u64 {
        // The module loads: the hook on do_init_module sees it before its
        // init runs, and the probe is armed at once.
        g.kernel.modules = modules(true);
        let ev = g.module_call(DO_INIT_MODULE, MOD_STRUCT);
        assert_eq!(
            ev,
            Some(ModuleEvent {
                hook: ModuleHook::Load,
                module: MOD_STRUCT
            })
        );
        let list = g.tracer().probe_list();
        assert!(!list[0].pending && list[0].site == MOD_FUNC, "{list:?}");
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
        let leaf = g.root.leaf(mod_page).unwrap();
        assert_eq!(leaf.perms, ept::EXEC);
        let shadow = g.root.frames[&leaf.hpa.0].clone();
        let off = (MOD_FUNC & 0xfff) as usize;
        assert_eq!(
            shadow[off..off + 5],
            call_bytes(MOD_FUNC, g.region().entry().0)
        );
        // Its init calls the function: the probe fires, shown as the
        // module's.
        g.hit(MOD_FUNC, RETP, CALLER_RET, 3 + round);
        let text = g.text();
        assert!(
            text.contains("ms: (hvtarget_sum+0x0/0xfc0 [hvtarget])")
                && text.contains(&format!("n={:#x}", 3 + round)),
            "{text}"
        );
        // The module goes: at free_module everything on its text is
        // unhooked and the guest's page mapped back, before the kernel
        // frees it; the probe is pending again.
        let ev = g.module_call(FREE_MODULE, MOD_STRUCT);
        assert_eq!(ev.map(|e| e.hook), Some(ModuleHook::Unload));
        g.kernel.modules = modules(false);
        let leaf = g.root.leaf(mod_page).unwrap();
        assert_eq!((leaf.hpa.0, leaf.perms), (mod_page, ept::RWX));
        assert_eq!(g.sites_and_pages(), (3, 1, 3), "round {round}");
        assert!(g.tracer().probe_list()[0].pending);
    }
    let r = g.tracer().report();
    assert_eq!(
        (
            r.module_loads,
            r.module_unloads,
            r.module_armed,
            r.module_unhooked
        ),
        (20, 20, 20, 20)
    );
    assert_eq!(g.tracer().probe_list()[0].hits, 20);
    // The last pending probe goes: so do root's hooks.
    g.with(|t, env, _| t.probe_del("ms", env)).unwrap();
    assert_eq!(g.sites_and_pages(), (0, 0, 0));
}

/// What the module's page maps to in vCPU `vcpu`'s armed and quiet views.
pub(super) fn mod_page_leaves(g: &mut Guest, vcpu: usize) -> (Leaf, Leaf) {
    let page = gpa(MOD_FUNC) & !0xfff;
    (
        g.root.leaf_in(vcpu, page).unwrap(),
        g.root.quiet_leaf(vcpu, page).unwrap(),
    )
}

#[test]
fn a_counted_module_function_is_unhooked_at_its_unload_and_keeps_its_calls() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    let filter = protocol::CountFilter {
        functions: vec!["hvtarget:*".into()],
        latency: true,
        ..Default::default()
    };
    let added = g
        .with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    assert_eq!(added.traced, 1);
    // The module's function and root's three hooks.
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    for n in 0..7 {
        g.hit(MOD_FUNC, RETP, CALLER_RET, n);
    }
    let page = gpa(MOD_FUNC) & !0xfff;
    assert_ne!(mod_page_leaves(&mut g, 0).0.hpa.0, page);
    assert_eq!(g.tracer().report().module_globs, 1);
    // The module goes: its site goes with it, whatever counts it, and the
    // guest's own frame is mapped back in every view before the kernel
    // frees it (a shadow left there would run our call over whatever
    // code the frame holds next).
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    // Root's own hooks stay: the count's module glob follows the loads.
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    for vcpu in 0..VCPUS {
        let (armed, quiet) = mod_page_leaves(&mut g, vcpu);
        assert_eq!((armed.hpa.0, armed.perms), (page, ept::RWX));
        assert_eq!((quiet.hpa.0, quiet.perms), (page, ept::RWX));
    }
    // The count keeps the calls, under the function's name marked
    // unloaded.
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!(read.calls, 7);
    let entries: Vec<_> = read
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.addr, e.calls))
        .collect();
    assert_eq!(
        entries,
        [("hvtarget_sum [hvtarget] (unloaded)", MOD_FUNC, 7)]
    );
    // Another module's code in the same frames runs as the guest wrote
    // it: a call there is no hit of ours.
    let (out, _) = g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(g.tracer().report().forged_entries, 1);
    // The module loads again: its function is counted again from its
    // load on, and its calls add up over the unloads.
    g.kernel.modules = modules(true);
    g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    for n in 0..3 {
        g.hit(MOD_FUNC, RETP, CALLER_RET, n);
    }
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    let entries: Vec<_> = read
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.calls))
        .collect();
    assert_eq!(
        (read.calls, entries),
        (
            10,
            vec![
                ("hvtarget_sum [hvtarget]", 3),
                ("hvtarget_sum [hvtarget] (unloaded)", 7)
            ]
        )
    );
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((read.calls, read.entries.len()), (10, 1));
    assert_eq!(read.entries[0].calls, 10);
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    assert_eq!(g.sites_and_pages(), (0, 0, 0));
}

#[test]
fn an_unload_unhooks_even_when_the_other_vcpus_do_not_come() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    g.with(|t, env, k| t.function_add("hvtarget_*", k, env))
        .unwrap();
    g.probe("p:ms hvtarget:hvtarget_sum").unwrap();
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    // Another vCPU is stuck in the guest: a request would change nothing,
    // but the kernel frees the text as soon as the unload hook returns.
    g.root.others_come = false;
    let asked = g.root.must_stops;
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert!(g.root.must_stops > asked);
    let page = gpa(MOD_FUNC) & !0xfff;
    for vcpu in 0..VCPUS {
        let (armed, quiet) = mod_page_leaves(&mut g, vcpu);
        assert_eq!((armed.hpa.0, quiet.hpa.0), (page, page));
    }
    let r = g.tracer().report();
    assert_eq!((r.sites, r.pages, r.functions), (3, 1, 0), "{r:?}");
    assert!(g.tracer().probe_list()[0].pending);
}

#[test]
fn a_hidden_hook_on_a_quiet_page_is_hooked_in_the_quiet_views_at_once() {
    let mut g = Guest::new();
    // A session rooted at my_func whose trace set is the kernel's module
    // functions: their page is left to the guest in the quiet views.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["do_init_module".into(), "free_module".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let page = gpa(FREE_MODULE) & !0xfff;
    assert_eq!(g.root.quiet_leaf(1, page).unwrap().hpa.0, page);
    // A pending probe puts root's hooks on those functions: a vCPU on its
    // quiet view must see the next unload, before any settling.
    g.probe("p:ms hvtarget:hvtarget_sum").unwrap();
    for vcpu in 0..VCPUS {
        let armed = g.root.leaf_in(vcpu, page).unwrap();
        let quiet = g.root.quiet_leaf(vcpu, page).unwrap();
        assert_ne!(armed.hpa.0, page);
        assert_eq!((quiet.hpa, quiet.perms), (armed.hpa, ept::EXEC));
    }
}

#[test]
fn the_function_tracer_on_a_module_follows_its_unload() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    let added = g
        .with(|t, env, k| t.function_add("hvtarget_*", k, env))
        .unwrap();
    assert_eq!(added.traced, 1);
    // Root's hooks came in with the module's function.
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    assert_eq!(g.tracer().report().functions, 1);
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    let r = g.tracer().report();
    // Nothing left to follow: root's hooks went too.
    assert_eq!(
        (r.sites, r.pages, r.module_hooks, r.functions),
        (0, 0, 0, 0)
    );
    // The kernel's own functions are not the module's: an unload of a
    // module whose text is unknown touches nothing.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    assert_eq!(g.sites_and_pages(), (1, 1, 0));
}

#[test]
fn a_module_glob_covers_the_module_at_each_load() {
    let mut g = Guest::new();
    // Malformed module globs are refused.
    for bad in [":x", "hvtarget:", "a:b:c"] {
        let e = g.with(|t, env, k| t.function_add(bad, k, env)).unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument, "{bad}");
    }
    // Not loaded: nothing traced yet, root's hooks in to follow loads.
    let added = g
        .with(|t, env, k| t.function_add("hvtarget:hvtarget_*", k, env))
        .unwrap();
    assert_eq!(added.traced, 0);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    assert_eq!(g.tracer().report().module_globs, 1);
    // A plain glob never matches a later module; the module glob does not
    // match the kernel's own functions.
    let plain = g.with(|t, env, k| t.function_add("my_*", k, env)).unwrap();
    assert_eq!(plain.traced, 1);
    assert_eq!(g.tracer().report().module_globs, 1);
    for round in 0..3 {
        g.kernel.modules = modules(true);
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        let r = g.tracer().report();
        assert_eq!(
            (r.sites, r.functions, r.module_followed),
            (5, 2, round + 1),
            "round {round}"
        );
        g.tracer().set_stream(Some(TraceFormat::Text));
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        let text = g.text();
        assert!(text.contains(": hvtarget_sum <-caller"), "{text}");
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        assert_eq!(g.tracer().report().functions, 1, "round {round}");
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
    }
    // Clearing the function tracer drops the glob, and root's hooks.
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.module_hooks, r.module_globs), (0, 0, 0));
}

#[test]
fn a_graph_session_rooted_in_a_module_glob_waits_for_the_module() {
    let mut g = Guest::new();
    let f = GraphFilter {
        functions: vec!["hvtarget:hvtarget_sum".into()],
        trace: vec!["*_func".into()],
        ..GraphFilter::default()
    };
    let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    // No root yet: the kernel's functions do not start trees meanwhile.
    assert_eq!((started.roots, started.hooked), (0, 2));
    assert_eq!(g.tracer().report().module_hooks, 3);
    assert_eq!(g.tracer().report().module_globs, 1);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET, "not a root");
    let tramp = g.region().return_trampoline().0;
    for round in 0..2 {
        g.kernel.modules = modules(true);
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        // The module's function is a root now; under it the kernel's
        // functions nest.
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        assert_eq!(g.ram.word(gpa(RETP)), tramp, "round {round}");
        g.hit(FUNC, RETP - 0x100, MOD_FUNC + 0x40, 0);
        assert_eq!(g.ram.word(gpa(RETP - 0x100)), tramp, "round {round}");
        assert_eq!(g.ret(RETP - 0x100, 0).1, MOD_FUNC + 0x40);
        assert_eq!(g.ret(RETP, 0).1, CALLER_RET);
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        // Gone with its module: the kernel's function is no root.
        g.hit(FUNC, RETP, CALLER_RET, 0);
        assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET, "round {round}");
        assert_eq!(g.tracer().report().graph_frames, 0);
    }
    // Stopping the session drops what followed the module.
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.module_hooks, r.module_globs), (0, 0, 0));
}

#[test]
fn a_modules_init_text_is_traced_until_the_kernel_frees_it() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // A probe on the init function, pending; the function tracer on all
    // the module's functions. The third hidden hook follows the freeing
    // of init text.
    g.probe("p:mi hvtarget:hvtarget_init n=%di").unwrap();
    let added = g
        .with(|t, env, k| t.function_add("hvtarget:*", k, env))
        .unwrap();
    assert_eq!(added.traced, 0);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let init_page = gpa(MOD_INIT_FUNC) & !0xfff;
    for round in 1..=3u64 {
        g.kernel.modules = modules_coming();
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        // Armed before the init runs: the probe and both functions.
        let list = g.tracer().probe_list();
        assert!(
            !list[0].pending && list[0].site == MOD_INIT_FUNC,
            "{list:?}"
        );
        assert_eq!(g.sites_and_pages(), (5, 3, 3), "round {round}");
        assert_eq!(g.tracer().report().functions, 2);
        let leaf = g.root.leaf(init_page).unwrap();
        assert_eq!(leaf.perms, ept::EXEC);
        // The init runs, and calls the module's core function.
        g.hit(MOD_INIT_FUNC, RETP, CALLER_RET, round);
        g.hit(MOD_FUNC, RETP - 0x100, MOD_INIT_FUNC + 0x20, 0);
        let text = g.text();
        assert!(
            text.contains("mi: (hvtarget_init+0x0/0xff0 [hvtarget])")
                && text.contains(&format!("n={round:#x}"))
                && text.contains(": hvtarget_init <-caller")
                && text.contains(": hvtarget_sum <-hvtarget_init\n"),
            "{text}"
        );
        // The init returned: at module_arch_freeing_init the init text's
        // sites go, before the kernel frees it; the core text's stay.
        g.module_call(FREEING_INIT, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(true);
        let leaf = g.root.leaf(init_page).unwrap();
        assert_eq!((leaf.hpa.0, leaf.perms), (init_page, ept::RWX));
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
        let r = g.tracer().report();
        assert_eq!(
            (r.functions, r.module_inits_freed, r.module_init_unhooked),
            (1, round, round)
        );
        assert!(g.tracer().probe_list()[0].pending);
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        assert!(g.text().contains(": hvtarget_sum <-caller"));
        // The module goes: its core text's site too.
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        assert_eq!(g.sites_and_pages(), (3, 1, 3), "round {round}");
    }
    // An init that fails: free_module takes the init text's sites too.
    g.kernel.modules = modules_coming();
    g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
    assert_eq!(g.sites_and_pages(), (5, 3, 3));
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let leaf = g.root.leaf(init_page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (init_page, ept::RWX));
    assert!(g.tracer().probe_list()[0].pending);
}

/// What rendering costs in CPU, the figure that moving it to the host
/// moves there: function-tracer and probe records rendered as trace_pipe
/// lines and as JSON lines by the renderers root runs today (the host
/// links the same code). Every record must come out as one line; the time
/// of the rendering alone is printed per record and per million.
#[test]
fn rendering_cost_per_million_records() {
    use std::time::{Duration, Instant};
    let target: u64 = if cfg!(debug_assertions) {
        20_000
    } else {
        400_000
    };
    const BATCH: u64 = 5_000;
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        g.with(|t, env, k| t.function_add("other_func", k, env))
            .unwrap();
        g.probe("p:bench my_func n=%di:u64 x=%di s=$stack1")
            .unwrap();
        g.tracer().set_stream(Some(format));
        let (mut records, mut lines, mut bytes) = (0u64, 0u64, 0usize);
        let mut spent = Duration::ZERO;
        while records < target {
            for i in 0..BATCH {
                let f = if i % 2 == 0 { FUNC } else { OTHER };
                g.hit(f, RETP, CALLER_RET, i);
            }
            records += BATCH;
            let t0 = Instant::now();
            let text = g.text();
            spent += t0.elapsed();
            lines += text.lines().count() as u64;
            bytes += text.len();
        }
        assert_eq!(lines, records, "{format:?}: a line per record");
        assert_eq!(g.tracer().report().lost, 0);
        let ns = spent.as_nanos() as f64 / records as f64;
        println!(
            "rendering {format:?}: {records} records ({} bytes of text) in {:.3} s: {ns:.0} ns a record, {:.2} CPU s per million",
            bytes,
            spent.as_secs_f64(),
            ns * 1e6 / 1e9
        );
    }
}
