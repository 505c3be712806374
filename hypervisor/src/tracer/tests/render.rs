use super::*;

// ----- rendering on the host ---------------------------------------------

/// One run of a session with probes, the function tracer and graph
/// sessions, with the stream drained at set points by `drain`: the same
/// hits, deletions and stops whatever the format.
pub(super) fn rendering_scenario(
    g: &mut Guest,
    format: TraceFormat,
    drain: &mut dyn FnMut(&mut Guest),
) {
    g.with(|t, env, k| t.function_add("other_func", k, env))
        .unwrap();
    g.probe("p:a my_func n=%di:u64 b=+0(%di):x8").unwrap();
    g.probe("r:ra my_func ret=$retval").unwrap();
    let mut f = graph(&["my_func"]);
    f.retval = true;
    g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    g.tracer().set_stream(Some(format));
    let inner = RETP - 0x100;
    // Hundreds of records of two sizes, drained at once: records end at
    // every place in the events that carry them.
    // The string probe's records grow a byte at a time, so that events
    // fill to every length.
    g.probe("p:str other_func s=+0(%di):string").unwrap();
    let text = RETP - 0x2000;
    for i in 0..400u64 {
        let f = if i % 3 == 0 { FUNC } else { OTHER };
        let len = (i % 97) as usize;
        g.ram.put(gpa(text), &vec![b'a' + (i % 26) as u8; len]);
        g.ram.put(gpa(text + len as u64), &[0]);
        g.hit(f, inner, FUNC + 0x40, text);
        g.now_ns += 10;
        if f == FUNC {
            g.ret(inner, i);
        }
    }
    drain(g);
    g.with(|t, env, _| t.probe_del("str", env)).unwrap();
    // A tree with a leaf; the probe and the function tracer on the way.
    g.hit(FUNC, RETP, CALLER_RET, CALLER);
    g.now_ns += 1_000;
    g.hit(OTHER, inner, FUNC + 0x40, 0);
    g.now_ns += 2_000;
    g.ret(inner, 7);
    g.now_ns += 3_000;
    g.ret(RETP, 0x10);
    drain(g);
    // A hit whose probe goes before the stream reads it: not printed.
    g.hit(FUNC, RETP, CALLER_RET, 5);
    g.now_ns += 1_000;
    g.ret(RETP, 1);
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    drain(g);
    // An entry held back for a leaf when its session stops: printed open
    // once the rings are empty.
    g.hit(FUNC, RETP, CALLER_RET, 6);
    drain(g);
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    g.now_ns += 1_000;
    drain(g);
    g.ret(RETP, 2);
    // A new session (a new generation of number 1) whose entry waits for
    // longer than the hold: printed open, then its return closes it.
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 8);
    g.now_ns += 1_000;
    drain(g);
    g.now_ns += 2 * tracelang::render::LEAF_HOLD_NS;
    drain(g);
    g.now_ns += 1_000;
    g.ret(RETP, 3);
    drain(g);
}

/// The host's renderer, fed root's records and context, prints what root
/// prints from the same hits, byte for byte, as trace_pipe lines and as
/// JSON lines; records cut across events come back whole.
#[test]
fn the_host_renders_root_records_as_root_renders_them() {
    use tracelang::render::RecordRenderer;
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        let mut root_text = String::new();
        rendering_scenario(&mut g, format, &mut |g| root_text.push_str(&g.text()));

        let mut g = Guest::new();
        let mut renderer = RecordRenderer::new(format);
        let mut host_text = String::new();
        let mut events = 0;
        rendering_scenario(&mut g, TraceFormat::Records, &mut |g| {
            events += render_on_the_host(g, &mut renderer, &mut host_text);
        });
        assert!(root_text.lines().count() >= 8, "{root_text}");
        let probe_line = match format {
            TraceFormat::Json => r#""event":"a""#,
            _ => "a: (my_func",
        };
        assert!(root_text.contains(probe_line), "{root_text}");
        assert_eq!(host_text, root_text, "{format:?}: {events} events");
        assert_eq!(renderer.stats.bad_chunks, 0);
        assert_eq!(renderer.stats.bad_specs, 0);
    }
}

/// The host reading the vCPUs' rings itself
/// ([`protocol::TraceChannel::SharedRings`]): root sends only the context
/// and its clock, the host's reader takes the records from the rings'
/// memory (oldest first across the vCPUs, up to the mark it took before
/// the frames) and renders them as root renders them, byte for byte.
#[test]
fn the_host_reading_the_rings_renders_as_root_renders() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::{RecordRenderer, RingsReader};
    // The main scenario, then hits on two vCPUs stored out of time order.
    pub(super) fn scenario(g: &mut Guest, format: TraceFormat, drain: &mut dyn FnMut(&mut Guest)) {
        rendering_scenario(g, format, drain);
        g.with(|t, env, k| t.function_add("*_func", k, env))
            .unwrap();
        for (on, step) in [
            (1, 10_000),
            (1, 20_000),
            (0, 5_000),
            (0, 30_000),
            (1, 1_000),
        ] {
            g.on = on;
            g.now_ns += step;
            g.hit(OTHER, RETP, CALLER_RET, 0);
        }
        g.on = 0;
        g.now_ns += 1_000;
        drain(g);
    }
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        let mut root_text = String::new();
        scenario(&mut g, format, &mut |g| root_text.push_str(&g.text()));

        let mut g = Guest::new();
        let (regions, stamp_at) = g.tracer().record_rings();
        assert_eq!(regions.len(), VCPUS);
        g.tracer().set_host_reads(true);
        let rings = regions
            .iter()
            .map(|&(at, len)| {
                // SAFETY: the tracer's own rings, alive as long as `g`,
                // read as the host reads them from the RAM file.
                unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap()
            })
            .collect();
        let mut reader = RingsReader::new(rings, stamp_at as usize);
        let mut renderer = RecordRenderer::new(format);
        let mut host_text = String::new();
        let mut taken = 0;
        scenario(&mut g, TraceFormat::Records, &mut |g| {
            let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
            let mut out = Vec::new();
            // The mark, then the frames, then the records up to the mark.
            let mark = reader.mark();
            let mut idle = None;
            // No room at all: the context goes all the same.
            while let Some(ev) =
                Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(0, Some(&g.kernel), g.now_ns)
            {
                match ev {
                    Event::TraceContext(c) => renderer.context(&c),
                    Event::TraceRecords { data, now_ns, .. } if data.is_empty() => {
                        idle = Some(now_ns);
                    }
                    other => panic!("root sent {other:?} while the host reads the rings"),
                }
            }
            assert!(
                !Tracer::new(&mut g.vm, &mut g.cpus[0]).has_output(),
                "root waits for nothing"
            );
            let mut events = Vec::new();
            taken += reader.take(&mark, &mut events).unwrap();
            for ev in events {
                match ev {
                    Event::TraceRecords { lost, now_ns, data } => {
                        renderer.records(lost, now_ns, &data, &syms, &mut out)
                    }
                    other => panic!("the reader made {other:?}"),
                }
            }
            if let Some(now) = idle.filter(|_| reader.is_empty()) {
                renderer.records(0, now, &[], &syms, &mut out);
            }
            for e in out {
                if let Event::TraceText { text, .. } = e {
                    host_text.push_str(&text);
                }
            }
        });
        assert!(taken > 400, "{taken} records taken from the rings");
        assert!(reader.is_empty() && reader.lost() == 0);
        assert_eq!(host_text, root_text, "{format:?}");
        // The two vCPUs' hits came out in time order.
        let tail: Vec<&str> = root_text.lines().rev().take(5).collect();
        assert_eq!(tail.len(), 5);
        assert!(
            tail.iter().filter(|l| l.contains("other_func")).count() == 5,
            "{tail:?}"
        );
    }
}

/// A ring filling while the host reads the rings rings the doorbell, at
/// most every few milliseconds; root never rings it when it drains.
#[test]
fn a_filling_ring_rings_the_doorbell_when_the_host_reads() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Records));
    // Enough hits to fill a quarter of vCPU 0's ring.
    let fill = |g: &mut Guest| {
        for _ in 0..12_000 {
            g.hit(OTHER, RETP, CALLER_RET, 0);
        }
    };
    fill(&mut g);
    let now = 10_000_000;
    assert!(!g.tracer().doorbell(now), "root drains: no doorbell");
    g.tracer().set_host_reads(true);
    assert!(g.tracer().doorbell(now));
    assert!(!g.tracer().doorbell(now + 1_000_000), "too soon");
    assert!(
        !g.tracer().doorbell(now + 6_000_000),
        "once per filling: a ring nobody empties does not keep ringing"
    );
    // Emptied by the host: quiet, and ready to ring again.
    let empty = |g: &mut Guest| {
        for (at, len) in g.tracer().record_rings().0 {
            // SAFETY: the tracer's own ring, read as the host reads it.
            let r = unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap();
            r.discard();
        }
    };
    empty(&mut g);
    assert!(!g.tracer().doorbell(now + 20_000_000));
    fill(&mut g);
    assert!(g.tracer().doorbell(now + 21_000_000), "filling again");
    // Nor without a stream.
    empty(&mut g);
    assert!(!g.tracer().doorbell(now + 30_000_000));
    fill(&mut g);
    g.tracer().set_stream(None);
    assert!(!g.tracer().doorbell(now + 40_000_000));
}

/// Records and root's text: the same records, in the same events, as
/// records alone, and beside them the text root renders alone; the host's
/// renderer turns the records into that text.
#[test]
fn records_and_text_carry_the_records_and_roots_own_text() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::RecordRenderer;
    let mut g = Guest::new();
    let mut root_text = String::new();
    rendering_scenario(&mut g, TraceFormat::Text, &mut |g| {
        root_text.push_str(&g.text())
    });
    let mut records_alone = Vec::new();
    let mut g = Guest::new();
    rendering_scenario(&mut g, TraceFormat::Records, &mut |g| {
        let now = g.now_ns;
        while let Some(ev) =
            Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
        {
            records_alone.push(ev);
        }
    });
    let mut records = Vec::new();
    let mut text = String::new();
    let mut host_text = String::new();
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let mut g = Guest::new();
    rendering_scenario(&mut g, TraceFormat::RecordsAndText, &mut |g| {
        let now = g.now_ns;
        while let Some(ev) =
            Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
        {
            let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
            let mut out = Vec::new();
            match &ev {
                Event::TraceText {
                    format: TraceFormat::Text,
                    lost: 0,
                    text: t,
                    ..
                } => {
                    text.push_str(t);
                    continue;
                }
                Event::TraceContext(c) => renderer.context(c),
                Event::TraceRecords { lost, now_ns, data } => {
                    renderer.records(*lost, *now_ns, data, &syms, &mut out)
                }
                other => panic!("unexpected event {other:?}"),
            }
            records.push(ev);
            for e in out {
                if let Event::TraceText { text, .. } = e {
                    host_text.push_str(&text);
                }
            }
        }
    });
    assert!(root_text.lines().count() >= 8, "{root_text}");
    assert_eq!(records, records_alone);
    assert_eq!(text, root_text);
    assert_eq!(host_text, root_text);
}

/// Records split across events (a long string fetch), losses reported,
/// and chunks out of place dropped without a panic.
#[test]
fn the_host_renderer_takes_split_records_and_refuses_misplaced_chunks() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::RecordRenderer;
    let mut g = Guest::new();
    g.probe("p:s my_func s=+0(%di):string").unwrap();
    let long = vec![b'x'; 3500];
    let at = RETP - 0x2000;
    g.ram.put(gpa(at), &long);
    g.ram.put(gpa(at + 3500), &[0]);
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, at);
    let root_text = g.text();
    g.tracer().set_stream(Some(TraceFormat::Records));
    g.hit(FUNC, RETP, CALLER_RET, at);
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
    let mut datas = Vec::new();
    let mut out = Vec::new();
    while let Some(ev) =
        Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), g.now_ns)
    {
        match ev {
            Event::TraceContext(c) => renderer.context(&c),
            Event::TraceRecords { lost, now_ns, data } => {
                datas.push(data.clone());
                renderer.records(lost, now_ns, &data, &syms, &mut out);
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(datas.len() >= 2, "the record was cut across events");
    let host: String = out
        .iter()
        .filter_map(|e| match e {
            Event::TraceText { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(root_text.contains("xxxxxxxx"), "{root_text}");
    assert_eq!(host, root_text);
    // The second piece alone: a continuation without its start.
    let before = renderer.stats.bad_chunks;
    let mut out = Vec::new();
    renderer.records(2, 0, &datas[1], &syms, &mut out);
    assert_eq!(renderer.stats.bad_chunks, before + 1);
    assert!(matches!(
        out.as_slice(),
        [Event::TraceText { lost: 2, text, .. }] if text.is_empty()
    ));
    // Garbage: a length past the end.
    renderer.records(0, 0, &[0xff, 0xff, 0, 0, 1], &syms, &mut Vec::new());
    assert_eq!(renderer.stats.bad_chunks, before + 2);
}

/// The host's reader passes root's clock on once nothing older is left in
/// the rings: under steady traffic the rings are seldom empty, and held
/// entries must still age.
#[test]
fn the_host_reader_passes_roots_clock_once_nothing_older_is_left() {
    use crate::tracer::ring::Rings;
    use tracelang::render::RingsReader;
    let rec = |ts: u64| {
        let mut v = 0u64.to_le_bytes().to_vec();
        v.extend_from_slice(&ts.to_le_bytes());
        v
    };
    let mut rings = Rings::new(2, protocol::ring::RING_MIN, 8);
    rings.of(0).push(&rec(10));
    rings.of(1).push(&rec(30));
    let attached = rings
        .regions()
        .iter()
        .map(|&(at, len)| {
            // SAFETY: the rings' own memory, alive for the test.
            unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap()
        })
        .collect();
    let mut reader = RingsReader::new(attached, 8);
    assert!(!reader.caught_up(20), "a record from before 20 is waiting");
    assert!(reader.caught_up(10));
    let mark = reader.mark();
    let mut out = Vec::new();
    assert_eq!(reader.take(&mark, &mut out).unwrap(), 2);
    assert!(reader.caught_up(20) && reader.is_empty());
    // Newer records do not hold the clock back.
    rings.of(1).push(&rec(25));
    assert!(reader.caught_up(20) && !reader.is_empty());
    assert!(!reader.caught_up(26));
}

/// A held entry ages at the same turn on the host as in root: root's text
/// mode prints an entry held longer than the hold open on the first turn
/// that finds the rings empty after it; records mode says every such turn
/// to the host while a session runs, so a return that comes after that
/// turn closes an open entry on both sides, never a leaf on one.
#[test]
fn a_held_entry_ages_at_the_same_turn_on_the_host() {
    use tracelang::render::RecordRenderer;
    let ms = 1_000_000;
    let scenario = |g: &mut Guest, format: TraceFormat, drain: &mut dyn FnMut(&mut Guest)| {
        g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
            .unwrap();
        g.tracer().set_stream(Some(format));
        g.now_ns = 5 * ms;
        g.hit(FUNC, RETP, CALLER_RET, 8);
        // Empty turns every 20 ms: root prints the entry open at 120 ms
        // (held 115 ms); the return comes at 125 ms.
        for t in 1..=6 {
            g.now_ns = t * 20 * ms;
            drain(g);
        }
        g.now_ns = 125 * ms;
        g.ret(RETP, 3);
        g.now_ns = 140 * ms;
        drain(g);
    };
    let mut g = Guest::new();
    let mut root_text = String::new();
    scenario(&mut g, TraceFormat::Text, &mut |g| {
        root_text.push_str(&g.text())
    });
    assert!(root_text.contains("my_func() {"), "{root_text}");
    assert!(root_text.contains('}'), "{root_text}");

    let mut g = Guest::new();
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let mut host_text = String::new();
    scenario(&mut g, TraceFormat::Records, &mut |g| {
        render_on_the_host(g, &mut renderer, &mut host_text);
    });
    assert_eq!(host_text, root_text);
}

/// Takes every event root's stream has now (records mode) and renders it
/// with the host's renderer into `text`; returns how many events.
pub(super) fn render_on_the_host(
    g: &mut Guest,
    renderer: &mut tracelang::render::RecordRenderer,
    text: &mut String,
) -> usize {
    let now = g.now_ns;
    let mut events = 0;
    while let Some(ev) =
        Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
    {
        events += 1;
        let syms = tracelang::kprobe::IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
        let mut out = Vec::new();
        match ev {
            Event::TraceContext(c) => renderer.context(&c),
            Event::TraceRecords { lost, now_ns, data } => {
                renderer.records(lost, now_ns, &data, &syms, &mut out)
            }
            other => panic!("unexpected event {other:?}"),
        }
        for e in out {
            if let Event::TraceText { text: t, .. } = e {
                text.push_str(&t);
            }
        }
    }
    events
}
