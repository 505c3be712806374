use super::*;

// ----- the request door --------------------------------------------------

#[test]
fn the_request_door_serves_the_tracers_requests_with_what_they_need() {
    use crate::tracer::door::{needs, Given, Needs};
    use protocol::{ErrorKind, Request, Response};
    let add = || Request::ProbeAdd {
        spec: "p:a my_func".into(),
    };
    // Root's own requests are not the tracer's.
    assert_eq!(needs(&Request::Status), None);
    assert_eq!(needs(&Request::Ping { nonce: 7 }), None);
    assert_eq!(needs(&Request::ProbeList), Some(Needs::State));
    assert_eq!(
        needs(&Request::CountRead {
            cursor: 0,
            limit: 10
        }),
        Some(Needs::Kernel)
    );
    assert_eq!(
        needs(&Request::ProbeDel { name: "a".into() }),
        Some(Needs::World)
    );
    assert_eq!(needs(&add()), Some(Needs::KernelAndWorld));

    let mut g = Guest::new();
    pub(super) fn given<'a, 'e>(
        kernel: Option<&'a FakeKernel>,
        env: Option<&'a mut Env<'e>>,
    ) -> Given<'a, 'e> {
        Given {
            kernel: kernel.map(|k| k as &dyn KernelView),
            env,
            now_ns: 0,
        }
    }
    // A request that changes hooks, without the world: refused, and
    // nothing is hooked.
    let e = g
        .with(|t, _, k| t.request(add(), given(Some(k), None)))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    assert_eq!(g.tracer().report().sites, 0);
    // Without the kernel: refused too.
    let e = g
        .with(|t, env, _| t.request(add(), given(None, Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    assert_eq!(g.tracer().report().sites, 0);

    // With both: added and hooked, as `probe_add` does.
    let r = g
        .with(|t, env, k| t.request(add(), given(Some(k), Some(env))))
        .unwrap();
    assert_eq!(
        r,
        Response::ProbeAdded {
            name: "kprobes/a".into(),
            site: FUNC
        }
    );
    assert_eq!(g.tracer().report().sites, 1);
    let r = g
        .with(|t, _, _| t.request(Request::ProbeList, given(None, None)))
        .unwrap();
    let Response::Probes(list) = r else {
        panic!("not a probe list: {r:?}");
    };
    assert_eq!(
        list.iter().map(|p| (&*p.name, p.site)).collect::<Vec<_>>(),
        [("kprobes/a", FUNC)]
    );
    // The tracer's own errors come through with their kind.
    let e = g
        .with(|t, env, k| t.request(add(), given(Some(k), Some(env))))
        .unwrap_err();
    assert_ne!(e.kind, ErrorKind::Internal, "{e:?}");
    let del = || Request::ProbeDel { name: "a".into() };
    let r = g
        .with(|t, env, _| t.request(del(), given(None, Some(env))))
        .unwrap();
    assert_eq!(r, Response::Ok);
    assert_eq!(g.tracer().report().sites, 0);
    let e = g
        .with(|t, env, _| t.request(del(), given(None, Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    // A read that needs the kernel, without it; and a request that is not
    // the tracer's at all.
    let read = Request::CountRead {
        cursor: 0,
        limit: 10,
    };
    let e = g
        .with(|t, _, _| t.request(read, given(None, None)))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    let e = g
        .with(|t, env, k| t.request(Request::Status, given(Some(k), Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
}

// ----- the turn door -----------------------------------------------------

#[test]
fn the_turn_door_reads_the_vcpu_only_when_its_view_is_due() {
    // Its next turn reads the vCPU once and arms it.
    let mut g = quiet_vcpu_under_a_new_pid_session();
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let mut reads = 0;
    let done = g
        .with(|t, env, k| {
            t.turn(
                env,
                Some(k),
                || {
                    reads += 1;
                    Ok::<_, ()>(cpu.clone())
                },
                now,
            )
        })
        .unwrap();
    assert!(done.view_picked && !done.debug_exits, "{done:?}");
    assert_eq!(reads, 1);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Nothing changed since: the vCPU is not read, and a read that would
    // fail does not matter.
    let done = g
        .with(|t, env, k| t.turn(env, Some(k), || Err("not read"), now))
        .unwrap();
    assert!(!done.view_picked);
    // A change again, and a read that fails: the error comes back, and the
    // view is left for the next turn.
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    let e = g
        .with(|t, env, k| t.turn(env, Some(k), || Err("VMREAD failed"), now))
        .unwrap_err();
    assert_eq!(e, "VMREAD failed");
    assert!(g.tracer().view_due());
}

/// The control channel as a test sees it.
#[derive(Default)]
pub(super) struct TestOutbox {
    room: usize,
    sent: Vec<Event>,
    modules: bool,
    resend: bool,
}

impl crate::tracer::turn::Outbox for TestOutbox {
    fn room(&self) -> usize {
        self.room
    }
    fn send(&mut self, event: Event) {
        self.sent.push(event);
    }
    fn sending_modules(&self) -> bool {
        self.modules
    }
    fn take_context_resend(&mut self) -> bool {
        core::mem::take(&mut self.resend)
    }
}

#[test]
fn the_stream_turn_waits_for_the_modules_then_sends_what_fits() {
    let mut g = Guest::new();
    g.probe("p:myprobe my_func x=%di").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, 42);
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let mut out = TestOutbox {
        room: 1 << 20,
        modules: true,
        ..TestOutbox::default()
    };
    // A copy of the modules' symbols on its way: the records wait, and
    // the turns stay busy.
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    assert!(out.sent.is_empty(), "{:?}", out.sent);
    assert!(waiting);
    // No room: still nothing.
    out.modules = false;
    out.room = 0;
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    assert!(out.sent.is_empty() && waiting);
    // Room: the probe's line goes out, and nothing waits any more.
    out.room = 1 << 20;
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    let text: String = out
        .sent
        .iter()
        .map(|e| match e {
            Event::TraceText { text, .. } => text.clone(),
            other => panic!("unexpected event {other:?}"),
        })
        .collect();
    assert!(
        text.contains("sleeper-42") && text.contains("myprobe: (my_func+0x0/"),
        "{text}"
    );
    assert!(!waiting);
}

// ----- the step's exit door ----------------------------------------------

#[test]
fn the_step_door_ends_the_step_and_says_what_becomes_of_tf_and_db() {
    use crate::tracer::exit::{StepDone, StepExit};
    use crate::vmx::debug::{DR6_B0_B3, DR6_BS};
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow = g.root.leaf(page).unwrap().hpa;
    let step = |g: &mut Guest, guest_tf: bool| {
        let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
        assert!(matches!(v, Violation::Stepping));
        g.tracer().set_old_tf(guest_tf);
    };
    let exit = |g: &mut Guest, e: StepExit| g.with(|t, env, _| t.step_exit(env, e));
    let closed = |g: &mut Guest| g.root.leaf(page).unwrap().hpa == shadow;

    // Root's own single step: swallowed, the guest's TF (clear) back, the
    // page closed, no more #DB wanted.
    step(&mut g, false);
    let debug = |qualification| StepExit::Debug {
        qualification,
        int1: false,
    };
    assert_eq!(
        exit(&mut g, debug(DR6_BS)),
        StepDone {
            ended: true,
            tf: Some(false),
            reflect: None,
            as_int1: false,
            debug_exits: false,
        }
    );
    assert!(closed(&mut g));
    // The guest single-steps itself: its step trap is delivered too, with
    // a breakpoint that hit on the way.
    step(&mut g, true);
    let done = exit(&mut g, debug(DR6_BS | 1));
    assert_eq!(
        (done.ended, done.tf, done.reflect),
        (true, Some(true), Some(DR6_BS | 1))
    );
    // INT1 in a step: the step ends, the guest's INT1 goes back as INT1.
    step(&mut g, false);
    let done = exit(
        &mut g,
        StepExit::Debug {
            qualification: 0,
            int1: true,
        },
    );
    assert!(
        done.ended && done.as_int1 && done.reflect == Some(0),
        "{done:?}"
    );
    assert!(closed(&mut g));
    // No step: the guest's own breakpoint, delivered whole.
    let done = exit(&mut g, debug(DR6_B0_B3));
    assert_eq!(
        (done.ended, done.tf, done.reflect),
        (false, None, Some(DR6_B0_B3))
    );

    // An interrupt before the stepped instruction ran: the step ends
    // unfinished and the guest's TF goes back; without a step, nothing.
    step(&mut g, true);
    let done = exit(&mut g, StepExit::Interrupt);
    assert_eq!(
        (done.ended, done.tf, done.debug_exits),
        (true, Some(true), false)
    );
    assert!(closed(&mut g));
    assert_eq!(exit(&mut g, StepExit::Interrupt), StepDone::default());
    // INIT: the step ends, TF is INIT's to reset.
    step(&mut g, true);
    let done = exit(&mut g, StepExit::Init);
    assert_eq!((done.ended, done.tf), (true, None));
    assert!(closed(&mut g));
}

// ----- the status part ---------------------------------------------------

#[test]
fn the_status_part_fills_each_vcpus_row_by_its_index() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    // Two hits on vCPU 1, one on vCPU 0.
    for on in [1, 1, 0] {
        g.on = on;
        g.hit(FUNC, RETP, CALLER_RET, 0);
    }
    g.on = 0;
    // The rows in another order than the vCPUs', and one for a vCPU the
    // tracer does not know.
    let mut rows: Vec<protocol::VcpuReport> = [1u32, 0, 7]
        .iter()
        .map(|&index| protocol::VcpuReport {
            index,
            hits: 99,
            ..protocol::VcpuReport::default()
        })
        .collect();
    let now = g.now_ns;
    let (tracer, sessions) = g.tracer().status_part(&mut rows, now);
    assert_eq!(
        rows.iter().map(|r| (r.index, r.hits)).collect::<Vec<_>>(),
        [(1, 2), (0, 1), (7, 0)]
    );
    assert_eq!(tracer.hits, 3);
    assert_eq!(tracer.probes, 1);
    assert!(sessions.is_empty());
    // A graph session shows in the part.
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    let (_, sessions) = g.tracer().status_part(&mut rows, now);
    assert_eq!(sessions.len(), 1);
}
