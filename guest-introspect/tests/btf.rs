//! BTF over blobs built type by type (common/synth.rs): nested anonymous
//! members (6.12's `pcpu_hot`, randomized `task_struct` layouts), bitfields,
//! typedef chains, and corruptions.

mod common;
use test_support::synth;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use guest_introspect::btf::{
    self, Btf, BtfError, Kind, MAX_ANONYMOUS_DEPTH, MAX_MEMBERS_VISITED, MAX_RESOLVE_STEPS,
};
use guest_introspect::budget::{poll_slice, Budget};
use guest_introspect::scan::ScanStats;
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use synth::{kernel_like, m, Builder};
use test_support::Rng;

fn view_of(bytes: &[u8], at: u64) -> SegmentView<'_> {
    let mut v = SegmentView::new();
    assert!(v.add(Gva(at), bytes, bytes.len() as u64));
    v
}

const AT: u64 = 0xffff_ffff_8240_0000;

#[test]
fn nested_anonymous_members() {
    for prefix in [0u32, 8] {
        let blob = kernel_like(prefix);
        let view = view_of(&blob, AT);
        let b = Btf::parse(&view, Gva(AT)).unwrap();
        assert_eq!(b.type_count(), 16);
        assert_eq!(btf::pcpu_hot_current_task(&b), Ok(prefix));
        let t = btf::task_layout(&b).unwrap();
        assert_eq!(
            t,
            btf::TaskLayout {
                pid: 0x908,
                comm: 0xba0,
                comm_len: 16,
                size: 4096,
                stack: None,
                prio: None,
                // The synthetic task_struct's `__state`, an int at 0.
                state: Some((0, 4)),
                exit_state: None,
                cpu: None,
            }
        );
        // A bitfield member reports its width and has no byte offset.
        let task = b.find(Kind::Struct, "task_struct").unwrap();
        let bf = b.member(&task, "sched_migrated").unwrap();
        assert_eq!(
            (bf.bit_offset, bf.bitfield_bits, bf.byte_offset()),
            (0x900 * 8 + 1, 1, None)
        );
        assert_eq!(
            b.member(&task, "nothing"),
            Err(BtfError::NoMember("nothing"))
        );
        assert_eq!(
            b.find(Kind::Union, "task_struct"),
            Err(BtfError::NoType("task_struct"))
        );
    }
}

#[test]
fn wrong_member_types_are_refused() {
    let mut b = Builder::new();
    let int = b.int("int", 4);
    let long = b.int("long", 8);
    let ch = b.int("char", 1);
    let comm = b.array(ch, int, 16);
    b.record(
        Kind::Struct,
        "task_struct",
        100,
        &[m("pid", long, 0), m("comm", comm, 16)],
    );
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let parsed = Btf::parse(&view, Gva(AT)).unwrap();
    assert_eq!(
        btf::task_layout(&parsed),
        Err(BtfError::UnexpectedType("pid"))
    );
}

#[test]
fn located_by_header_scan() {
    let blob = kernel_like(0);
    let mut mem: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + 3) as u8).collect();
    // A decoy: the magic and header prefix with impossible lengths.
    mem[1000..1008].copy_from_slice(&[0x9f, 0xeb, 1, 0, 24, 0, 0, 0]);
    mem[1008..1024].copy_from_slice(&[0xff; 16]);
    let at = 20_000;
    mem[at..at + blob.len()].copy_from_slice(&blob);
    let view = view_of(&mem, AT);
    let mut st = ScanStats::default();
    let found = btf::locate(
        &view,
        None,
        &[GvaRange::with_len(Gva(AT), mem.len() as u64)],
        &mut st,
    );
    assert_eq!(found, Ok(Gva(AT + at as u64)));
    let none = btf::locate(&view, None, &[GvaRange::with_len(Gva(AT), 10_000)], &mut st);
    assert_eq!(none, Err(BtfError::Absent));
}

#[test]
fn corrupted_blobs_never_panic() {
    let good = kernel_like(0);
    let mut rng = Rng(test_support::seed());
    let (mut tried, mut parsed, mut ok) = (0, 0, 0);
    for _ in 0..3000 {
        let mut blob = good.clone();
        for _ in 0..1 + rng.below(4) {
            let p = rng.below(blob.len() as u64) as usize;
            blob[p] = rng.next() as u8;
        }
        if rng.below(5) == 0 {
            blob.truncate(rng.below(blob.len() as u64) as usize);
        }
        if blob.is_empty() {
            continue;
        }
        tried += 1;
        let view = view_of(&blob, AT);
        if let Ok(b) = Btf::parse(&view, Gva(AT)) {
            parsed += 1;
            let _ = btf::pcpu_hot_current_task(&b);
            if btf::task_layout(&b).is_ok() {
                ok += 1;
            }
            for id in 0..=b.type_count() + 1 {
                let _ = b.resolve(id);
            }
        }
    }
    eprintln!("{tried} corrupted blobs: parsed {parsed}, task layout still found in {ok}");
    // About 3 in 4 still parse and 1 in 2 still give the layout (the bytes
    // changed, or the cut, missed the header and the types walked): a
    // parser that refuses everything, or accepts everything, fails here.
    assert!(parsed >= tried / 2, "parsed {parsed} of {tried}");
    assert!(ok >= tried / 4, "layout found in {ok} of {tried}");
    assert!(parsed < tried, "every corrupted blob parsed");
}

/// Runs `walk`, paced by `pace`, one step at a time: each poll is given a
/// slice of no work, so it ends at the walk's next pause. Returns the
/// result and the steps taken (polls, [`Budget::slices`]), or `None` when
/// the walk has not ended after `max_steps`: a walk without a bound fails
/// the test instead of hanging it.
fn stepped<F: Future>(walk: F, pace: &Budget, max_steps: u64) -> (Option<F::Output>, u64) {
    let mut walk = pin!(walk);
    while pace.slices() < max_steps {
        if let Poll::Ready(out) = poll_slice(walk.as_mut(), pace, 0) {
            return (Some(out), pace.slices());
        }
    }
    (None, pace.slices())
}

/// Self-referencing typedefs and deeply nested anonymous members end in an
/// error after a bounded number of steps, not a hang. The steps are
/// counted, not timed.
#[test]
fn cycles_are_bounded() {
    let mut b = Builder::new();
    let int = b.int("int", 4); // 1
    let _loop = b.alias(Kind::Typedef, "loop", 2); // 2 -> itself
                                                   // 3: anonymous struct containing itself anonymously.
    b.record(Kind::Struct, "", 8, &[m("", 3, 0)]);
    b.record(
        Kind::Struct,
        "task_struct",
        64,
        &[m("", 3, 0), m("pid", 2, 4), m("x", int, 8)],
    ); // 4
       // 5: an anonymous union of three anonymous copies of itself: 3^16
       // paths if only the depth were bounded.
    b.record(Kind::Union, "", 8, &[m("", 5, 0), m("", 5, 0), m("", 5, 0)]);
    b.record(Kind::Struct, "pcpu_hot", 8, &[m("", 5, 0)]); // 6
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let parsed = Btf::parse(&view, Gva(AT)).unwrap();
    let types = u64::from(parsed.type_count());
    let resolve_steps = u64::from(MAX_RESOLVE_STEPS);
    let depth = MAX_ANONYMOUS_DEPTH as u64;
    let visits = u64::from(MAX_MEMBERS_VISITED);
    // Nothing is charged to it (the view is not metered): it only paces.
    let pace = || Budget::new(u64::MAX);

    // The typedef naming itself: one step per typedef followed, and a last
    // poll for the result.
    let bound = resolve_steps + 1;
    let p = pace();
    let (out, steps) = stepped(parsed.resolve_paced(2, &p), &p, bound);
    assert_eq!(out, Some(Err(BtfError::BadId(2))), "after {steps} steps");

    // task_struct's anonymous member contains itself: the search for `pid`
    // goes MAX_ANONYMOUS_DEPTH deep (each anonymous member visited is two
    // steps, the visit and the resolution of its type, and each struct
    // entered one more to leave it), comes back, finds `pid`, and
    // resolving its type, the looping typedef, fails. Before that, one step
    // per type to find task_struct.
    let bound = types + 3 * (depth + 1) + 1 + resolve_steps + 1;
    let p = pace();
    let (out, steps) = stepped(btf::task_layout_paced(&parsed, &p), &p, bound);
    assert_eq!(out, Some(Err(BtfError::BadId(2))), "after {steps} steps");

    // pcpu_hot's union holds three copies of itself: 3^16 paths within the
    // depth bound, but the search gives up after MAX_MEMBERS_VISITED
    // members. Each visit is a step and one more to resolve the member's
    // type (a union: no typedef to follow), and each union entered takes
    // a step to leave.
    let bound = types + 3 * (visits + 1) + 1;
    let p = pace();
    let (out, steps) = stepped(btf::pcpu_hot_current_task_paced(&parsed, &p), &p, bound);
    assert!(
        matches!(out, Some(Err(BtfError::Malformed { .. }))),
        "{out:?} after {steps} steps (at most {bound})"
    );
    // Run at once, the same walks give the same answers.
    assert_eq!(btf::pcpu_hot_current_task(&parsed), out.unwrap());
    assert_eq!(parsed.resolve(2), Err(BtfError::BadId(2)));
    assert_eq!(btf::task_layout(&parsed), Err(BtfError::BadId(2)));
}

/// Enumerators: 32-bit (signed unless the kind flag says unsigned), 64-bit
/// (`BTF_KIND_ENUM64`, 12-byte entries), and an enum that is the last type
/// (its last 8-byte entry ends where the section does).
#[test]
fn enumerators() {
    let mut b = Builder::new();
    let states = b.enum_(
        "module_state",
        &[
            ("MODULE_STATE_LIVE", 0),
            ("MODULE_STATE_GOING", 2),
            ("NEG", u32::MAX),
        ],
    );
    let wide = b.head("wide", Kind::Enum64, 2, true, 8);
    for (name, v) in [("SMALL", 5u64), ("HUGE", 0x1_0000_0002)] {
        let n = b.s(name);
        b.words(&[n, v as u32, (v >> 32) as u32]);
    }
    let last = b.enum_("mod_mem_type", &[("MOD_TEXT", 0), ("MOD_INIT_TEXT", 4)]);
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let p = Btf::parse(&view, Gva(AT)).unwrap();
    let t = p.type_info(states).unwrap();
    assert_eq!(p.enumerator(&t, "MODULE_STATE_GOING"), Ok(2));
    assert_eq!(p.enumerator(&t, "NEG"), Ok(-1));
    assert_eq!(
        p.enumerator(&t, "MODULE_STATE_COMING"),
        Err(BtfError::NoMember("MODULE_STATE_COMING"))
    );
    let w = p.type_info(wide).unwrap();
    assert_eq!(p.enumerator(&w, "HUGE"), Ok(0x1_0000_0002));
    assert_eq!(p.enumerator(&w, "SMALL"), Ok(5));
    let l = p.type_info(last).unwrap();
    assert_eq!(p.enumerator(&l, "MOD_INIT_TEXT"), Ok(4));
    // Not an enum.
    let int = b.int("int", 4);
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let p = Btf::parse(&view, Gva(AT)).unwrap();
    let i = p.type_info(int).unwrap();
    assert_eq!(p.enumerator(&i, "X"), Err(BtfError::UnexpectedType("enum")));
}

/// A `struct module` whose `mem` array names region indices past its end
/// is refused, not read out of bounds.
#[test]
fn module_regions_past_the_array_are_refused() {
    use guest_introspect::module::module_layout;
    let mut b = Builder::new();
    let int = b.int("int", 4);
    let ch = b.int("char", 1);
    let long = b.int("long", 8);
    let ptr = b.alias(Kind::Ptr, "", ch);
    let state = b.enum_(
        "module_state",
        &[
            ("MODULE_STATE_LIVE", 0),
            ("MODULE_STATE_COMING", 1),
            ("MODULE_STATE_GOING", 2),
            ("MODULE_STATE_UNFORMED", 3),
        ],
    );
    let list = b.record(
        Kind::Struct,
        "list_head",
        16,
        &[m("next", long, 0), m("prev", long, 8)],
    );
    let name = b.array(ch, int, 56);
    let region = b.record(
        Kind::Struct,
        "module_memory",
        16,
        &[m("base", ptr, 0), m("size", int, 8)],
    );
    let mem = b.array(region, int, 3);
    b.enum_("mod_mem_type", &[("MOD_TEXT", 0), ("MOD_INIT_TEXT", 4)]);
    b.record(
        Kind::Struct,
        "module",
        200,
        &[
            m("state", state, 0),
            m("list", list, 8),
            m("name", name, 24),
            m("mem", mem, 80),
        ],
    );
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let p = Btf::parse(&view, Gva(AT)).unwrap();
    assert_eq!(
        module_layout(&p),
        Err(BtfError::UnexpectedType("MOD_INIT_TEXT"))
    );
}
