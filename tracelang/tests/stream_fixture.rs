//! The host's renderer on a real recorded stream: the records and context
//! root sent for a fast-lane guest under Bochs (probes with fetch
//! arguments, a return probe, the function tracer, a function_graph
//! session over `dd`), fed to [`RecordRenderer`] over a real symbol index
//! built from the guest's symbols the records need, give exactly the text
//! root rendered from the same records in the same run.
//!
//! The fixture (`tests/fixtures/stream/`) is made by
//! `scripts/record-stream-fixture.sh`: `stream.rec` has one line per event
//! (`ctx`/`rec`: a `TraceContext` or `TraceRecords` frame, `root`: a
//! `TraceText` root rendered, each as its encoded frame in hex), `kallsyms`
//! the guest's symbols that contain the addresses the records name, each
//! with the next one above it (so that sizes are the guest's), and the
//! text's bounds; `root.txt` is root's text, for reading.

use guest_introspect::kallsyms::{locate, LocateStats, SymbolIndex};
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use protocol::{Body, Event, FrameDecoder, TraceFormat};
use tracelang::kprobe::IndexSymbols;
use tracelang::render::RecordRenderer;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/stream");

/// A recorded event and its tag.
struct Recorded {
    tag: String,
    event: Event,
}

fn unhex(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd hex");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The recording's events, in order.
fn recording(text: &str) -> Vec<Recorded> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (tag, hex) = line.split_once(' ').expect("a tag and a frame");
        let frames: Vec<_> = FrameDecoder::new().feed(&unhex(hex)).collect();
        let [Ok(frame)] = frames.as_slice() else {
            panic!("not one frame: {line:.80}: {frames:?}");
        };
        let Body::Event(event) = frame.body.clone() else {
            panic!("not an event: {line:.80}");
        };
        out.push(Recorded {
            tag: tag.to_string(),
            event,
        });
    }
    out
}

/// A real symbol index over `listing` (`/proc/kallsyms` lines): the
/// symbols laid out as the kernel's kallsyms tables, found and built by
/// the code root runs over guest memory.
fn index(listing: &str) -> SymbolIndex {
    use test_support::synth::{generate, Order, Sym};
    let mut syms: Vec<Sym> = listing
        .lines()
        .map(|l| {
            let mut f = l.split_whitespace();
            let addr = u64::from_str_radix(f.next().expect("address"), 16).expect("hex address");
            let kind = f.next().expect("type").as_bytes()[0];
            let name = f.next().expect("name").to_string();
            Sym { kind, name, addr }
        })
        .collect();
    syms.sort_by_key(|s| s.addr);
    let base = syms.first().expect("symbols").addr;
    let top = syms.last().expect("symbols").addr;
    assert!(top - base < 1 << 31, "the symbols span too much");
    // Data after every symbol kept, as many as a kernel's tables need to
    // be found: above the last one, they contain no recorded address.
    for i in 0..600u64 {
        syms.push(Sym {
            kind: b'd',
            name: format!("fixture_data_{i:04}"),
            addr: top + 0x1000 + i * 0x40,
        });
    }
    let (blob, _) = generate(&syms, Order::V612, false, base);
    let mut mem: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(7919) as u8) | 1)
        .collect();
    mem.extend_from_slice(&blob);
    mem.extend((0..4096u32).map(|i| (i.wrapping_mul(104_729) as u8) | 1));
    let at = 0xffff_ffff_8200_0000u64;
    let mut view = SegmentView::new();
    view.add(Gva(at), &mem, mem.len() as u64);
    let range = GvaRange::with_len(Gva(at), mem.len() as u64);
    let t = locate(&view, &[range], &mut LocateStats::default()).expect("tables found");
    SymbolIndex::build(&view, &t).expect("index built")
}

/// What the host renders from the recorded context and records, and the
/// renderer's counters.
fn host_text(events: &[Recorded], index: &SymbolIndex) -> (String, RecordRenderer) {
    let syms = IndexSymbols::new(index, None);
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let mut text = String::new();
    for r in events {
        let mut out = Vec::new();
        match &r.event {
            Event::TraceContext(c) => renderer.context(c),
            Event::TraceRecords { lost, now_ns, data } => {
                renderer.records(*lost, *now_ns, data, &syms, &mut out)
            }
            _ => {}
        }
        for e in out {
            if let Event::TraceText { text: t, .. } = e {
                text.push_str(&t);
            }
        }
    }
    (text, renderer)
}

/// Root's text, from its recorded `TraceText` events.
fn root_text(events: &[Recorded]) -> String {
    events
        .iter()
        .filter(|r| r.tag == "root")
        .filter_map(|r| match &r.event {
            Event::TraceText {
                format: TraceFormat::Text,
                text,
                ..
            } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn read(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURE}/{name}")).expect("the fixture")
}

#[test]
fn the_host_renders_a_recorded_stream_as_root_rendered_it() {
    let events = recording(&read("stream.rec"));
    let index = index(&read("kallsyms"));
    let root = root_text(&events);
    assert_eq!(root, read("root.txt"), "root.txt is root's recorded text");
    // Non-trivial: every kind of line the stream had.
    let lines = root.lines().count();
    assert!(lines > 200, "{lines} lines");
    assert!(root.contains(" open: ("), "an entry probe line");
    assert!(root.contains(" path=\""), "a string fetch");
    assert!(root.contains(" openret: ("), "a return probe line");
    assert!(
        root.contains(" <- do_sys_openat2"),
        "a return probe's caller"
    );
    assert!(root.contains(" vfs_statx <-"), "a function-tracer line");
    assert!(root.contains("vfs_read() {"), "a graph entry");
    assert!(
        root.lines().any(|l| l.trim_end().ends_with('}')),
        "a graph exit"
    );
    assert!(events.iter().any(|r| r.tag == "ctx"), "context events");
    let (host, renderer) = host_text(&events, &index);
    if host != root {
        let at = host
            .lines()
            .zip(root.lines())
            .position(|(h, r)| h != r)
            .unwrap_or(host.lines().count().min(lines));
        panic!(
            "the host's text differs from root's at line {}:\n host: {:?}\n root: {:?}",
            at + 1,
            host.lines().nth(at),
            root.lines().nth(at)
        );
    }
    assert_eq!(renderer.stats.bad_chunks, 0);
    assert_eq!(renderer.stats.bad_specs, 0);
    assert!(renderer.stats.records as usize >= lines / 2);
}
