use super::*;

// ----- the region and the split view -------------------------------------

#[test]
fn a_probe_builds_the_region_and_a_shadow_the_guest_cannot_read() {
    let mut g = Guest::new();
    let (name, site) = g.probe("p:myprobe my_func x=%di").unwrap();
    assert_eq!(name, "kprobes/myprobe");
    assert_eq!(site, FUNC);

    // The region: a free 2 MiB slot of the kernel-image PD (the highest),
    // pointing at a hypervisor frame, EPT read-only.
    let base = g.tracer().report().trampolines;
    assert_eq!(base, 0xffff_ffff_8000_0000 + 511 * 2 * MIB);
    let pde = g.ram.word(PD + 511 * 8);
    let table = pde & !0xfff;
    assert!((loader::layout::HV_RESERVED.0..loader::layout::HV_RESERVED_END.0).contains(&table));
    assert_eq!(g.root.leaf(table).unwrap().perms, ept::READ);
    // The PD page itself is write-watched.
    assert_eq!(g.root.leaf(PD).unwrap().perms, ept::READ | ept::EXEC);

    // The guest's own page is untouched; EPT executes a shadow with our call.
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.ram.get(gpa(FUNC), 5), NOP5);
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!(leaf.perms, ept::EXEC, "execute-only: guest reads fault");
    assert_ne!(leaf.hpa.0, page);
    let shadow = g.root.frames[&leaf.hpa.0].clone();
    let off = (FUNC & 0xfff) as usize;
    let entry = g.region().entry().0;
    assert_eq!(shadow[off..off + 5], call_bytes(FUNC, entry));
    // The rest of the shadow is the guest's page.
    assert_eq!(shadow[off + 5], 0xc3);
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], NOP5);
    assert!(g.root.invepts > 0);
}

#[test]
fn a_guest_write_to_a_hooked_page_is_stepped_and_merged_under_our_patch() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;

    // The guest writes to the page (its ftrace turning other_func's site
    // into a call): EPT faults, the page is opened for one instruction.
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (page, ept::RWX));
    assert!(g.tracer().wants_debug_exits());
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    // A second page touched by the same instruction widens the step.
    let v = g.with(|t, env, _| t.on_violation(loader::layout::HV_RESERVED.0, false, false, env));
    assert!(matches!(v, Violation::Widened));
    g.tracer().set_old_tf(false);
    assert_eq!(
        g.tracer().debug_state(),
        DebugState {
            stepping: true,
            guest_tf: false,
            stray_tf: false
        }
    );

    // The #DB: the shadow is rebuilt from the guest's page, our call stays.
    g.with(|t, env, _| t.finish_step(env));
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa, leaf.perms), (shadow_hpa, ept::EXEC));
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    // The hypervisor page went back to unmapped.
    assert!(g.root.leaf(loader::layout::HV_RESERVED.0).is_none());
    assert!(!g.tracer().wants_debug_exits());
    let r = g.tracer().report();
    assert_eq!((r.steps, r.steps_widened, r.guest_writes), (1, 1, 1));
}

#[test]
fn a_write_while_a_read_step_is_open_reaches_the_shadow_when_it_closes() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;
    // A read opens the page; before the step's #DB, something else on the
    // vCPU (an interrupt's handler, a softirq) writes it: the guest's
    // ftrace turns other_func's site into a call.
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    g.with(|t, env, _| t.finish_step(env));
    // The shadow has the write, behind our call.
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    let r = g.tracer().report();
    assert_eq!((r.steps, r.guest_writes), (1, 0));
}

#[test]
fn a_write_root_emulates_reaches_the_shadow() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;
    // An INS or a task switch root emulates writes the guest's frame
    // itself, not through EPT: no step sees it.
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    g.ram.put(gpa(OTHER) + 0x40, &[0x90, 0x90]);
    assert!(g.with(|t, env, _| t.emulated_write(gpa(OTHER) + 0x40, env)));
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    assert_eq!(
        shadow[((OTHER & 0xfff) + 0x40) as usize..][..2],
        [0x90, 0x90]
    );
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    // A page nobody hooks: nothing to do.
    assert!(!g.with(|t, env, _| t.emulated_write(RAM.0 + 0x10_0000, env)));
    // Every hooked page at once, when root does not know which.
    g.ram.put(gpa(OTHER) + 0x80, &[0xcc]);
    g.with(|t, env, _| t.resync_all(env));
    assert_eq!(
        g.root.frames[&shadow_hpa.0][((OTHER & 0xfff) + 0x80) as usize],
        0xcc
    );
}

#[test]
fn tf_left_by_a_forced_step_end_is_looked_for_on_every_vcpu() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    g.tracer().set_old_tf(false);
    // The stepped context was preempted: the step times out on vCPU 0.
    for _ in 0..8 {
        g.with(|t, env, _| t.on_turn(env));
    }
    assert!(!g.tracer().debug_state().stepping);
    // The context resumes on vCPU 1: its #DB is root's, not the guest's.
    g.on = 1;
    assert!(g.tracer().wants_debug_exits());
    assert!(g.tracer().debug_state().stray_tf);
    g.tracer().clear_stray_tf();
    assert!(!g.tracer().wants_debug_exits());
    g.on = 0;
    assert!(!g.tracer().wants_debug_exits());
}

#[test]
fn a_fetch_from_hypervisor_memory_is_refused_without_a_step() {
    let mut g = Guest::new();
    let hv = loader::layout::HV_RESERVED.0 + 0x7000;
    // A fetch would fault again and again from a scratch page mapped
    // without execute: it gets no step.
    let v = g.with(|t, env, _| t.on_violation(hv, false, true, env));
    assert!(matches!(v, Violation::FetchRefused { ended_tf: None }));
    assert!(g.root.leaf(hv).is_none());
    assert!(!g.tracer().wants_debug_exits());
    // An instruction being stepped that runs on into hypervisor memory:
    // its step ends, with the guest's TF handed back.
    g.probe("p:a my_func").unwrap();
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    g.tracer().set_old_tf(true);
    let v = g.with(|t, env, _| t.on_violation(hv, false, true, env));
    assert!(matches!(
        v,
        Violation::FetchRefused {
            ended_tf: Some(true)
        }
    ));
    assert!(!g.tracer().debug_state().stepping);
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.root.leaf(page).unwrap().perms, ept::EXEC);
}

#[test]
fn a_hit_the_heap_cannot_hold_is_lost_not_allocated() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.probe("p:s my_func s=+0(%di):string n=%si").unwrap();
    let name = STACK_BASE + 0x200;
    g.ram.put(gpa(name), b"a string\0");
    g.hit(FUNC, RETP, CALLER_RET, name);
    assert!(g.text().contains("s=\"a string\""));
    // The heap has room for less than one string at its longest: the hit
    // is lost and counted, and nothing is fetched.
    g.root.heap_room = 1024;
    g.hit(FUNC, RETP, CALLER_RET, name);
    g.root.heap_room = 64 << 20;
    let list = g.tracer().probe_list();
    assert_eq!((list[0].hits, list[0].misses), (1, 1), "{list:?}");
    assert_eq!(g.tracer().report().lost, 1);
    assert!(!g.text().contains("a string"));
}

#[test]
fn a_guest_access_to_hypervisor_memory_sees_scratch() {
    let mut g = Guest::new();
    let hv = loader::layout::HV_RESERVED.0 + 0x5000;
    let v = g.with(|t, env, _| t.on_violation(hv, true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let leaf = g.root.leaf(hv).unwrap();
    assert_eq!(leaf.perms, ept::READ | ept::WRITE);
    assert_eq!(g.root.frames[&leaf.hpa.0][..16], [0xcc; 16]);
    g.with(|t, env, _| t.finish_step(env));
    assert!(g.root.leaf(hv).is_none());
    assert_eq!(g.tracer().report().blocked_writes, 1);
    // Guest RAM that is nobody's is not the tracer's business.
    let v = g.with(|t, env, _| t.on_violation(RAM.0 + 0x10_0000, true, false, env));
    assert!(matches!(v, Violation::NotOurs));
}

/// Root's AP start-up page is root's memory too, not the guest's: an
/// access there (the fuzzing guest's code, run from a wild address,
/// read 0xF7E3) is stepped against scratch, and a fetch is refused, as
/// in the rest of root's memory, never a stop of the VM.
#[test]
fn a_guest_access_to_the_ap_start_up_page_sees_scratch() {
    let mut g = Guest::new();
    let ap = loader::layout::AP_TRAMPOLINE.0 + 0x7e3;
    let v = g.with(|t, env, _| t.on_violation(ap, false, false, env));
    assert!(matches!(v, Violation::Stepping));
    let leaf = g.root.leaf(ap).unwrap();
    assert_eq!(leaf.perms, ept::READ | ept::WRITE);
    assert_eq!(g.root.frames[&(leaf.hpa.0 & !0xfff)][..16], [0xcc; 16]);
    g.with(|t, env, _| t.finish_step(env));
    assert!(g.root.leaf(ap).is_none());
    let v = g.with(|t, env, _| t.on_violation(ap, false, true, env));
    assert!(matches!(v, Violation::FetchRefused { .. }));
}

#[test]
fn a_changed_region_pde_is_put_back_on_the_next_turn() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let pde = g.ram.word(PD + 511 * 8);
    g.ram.put(PD + 511 * 8, &0u64.to_le_bytes());
    g.with(|t, env, _| t.on_turn(env));
    assert_eq!(g.ram.word(PD + 511 * 8), pde);
    assert_eq!(g.tracer().report().region_restores, 1);
}

#[test]
fn deleting_the_last_probe_gives_the_page_back() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.probe("p:b other_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    assert_ne!(
        g.root.leaf(page).unwrap().hpa.0,
        page,
        "other_func still hooked"
    );
    g.with(|t, env, _| t.probe_del("kprobes/b", env)).unwrap();
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (page, ept::RWX));
    assert_eq!(g.tracer().report().sites, 0);
    let e = g.with(|t, env, _| t.probe_del("a", env)).unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotFound);
}
