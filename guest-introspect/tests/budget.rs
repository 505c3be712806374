//! The work budget of recovery over a hostile guest: a synthetic kernel
//! (kallsyms tables, a banner, a BTF blob) behind thousands of forged BTF
//! headers claiming huge lengths, or forged kallsyms tables. Recovery finds
//! the real blob or fails with a budget error, never doing more work than
//! its budget; run a slice at a time it gives the same result as at once.

mod common;
use test_support::synth;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use guest_introspect::btf::{self, BtfError, TaskLayout, BTF_PREFIX, MAX_BTF_BYTES};
use guest_introspect::budget::{
    block_on, poll_slice, read_cost, Budget, Metered, MAX_STEP, RECOVERY_BUDGET, TURN_SLICE,
};
use guest_introspect::facts::{discover_budgeted, CurrentSource, CurrentTask, KernelFacts};
use guest_introspect::kallsyms::{locate_budgeted, KallsymsError, LocateStats};
use guest_introspect::scan::ScanStats;
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use synth::{generate, kernel_like, Order, Sym};
use test_support::Rng;

const BASE: u64 = 0xffff_ffff_8100_0000;

/// Forged BTF headers, by what makes them wrong.
#[derive(Clone, Copy, Debug)]
enum Decoy {
    /// Claims gigabytes of sections.
    Huge,
    /// Claims 30 MiB (under the cap) of types, past the end of the image.
    PastRange,
    /// Points at `walk` bytes of well-formed types that end in a malformed
    /// one: only a walk of them refuses the header.
    Walk,
}

/// A synthetic kernel image.
struct Image {
    mem: Vec<u8>,
    btf_at: u64,
    pcpu_hot: u64,
    /// What the decoy headers claim, in all.
    claimed: u64,
}

impl Image {
    fn view(&self) -> SegmentView<'_> {
        let mut v = SegmentView::new();
        assert!(v.add(Gva(BASE), &self.mem, self.mem.len() as u64));
        v
    }

    fn range(&self) -> GvaRange {
        GvaRange::with_len(Gva(BASE), self.mem.len() as u64)
    }
}

fn filler(rng: &mut Rng, n: usize) -> Vec<u8> {
    // Never zero: no needle (the BTF prefix, digit tokens) can occur in it.
    (0..n).map(|_| rng.next() as u8 | 1).collect()
}

fn pad8(mem: &mut Vec<u8>) {
    while !mem.len().is_multiple_of(8) {
        mem.push(0x5a);
    }
}

/// Filler, `decoys` forged headers (each 32 bytes), the types the `Walk`
/// ones walk (`walk` bytes of INTs, then a type of an unknown kind), the
/// real BTF blob, a banner, and kallsyms tables whose symbols include
/// `__start_BTF` only when `btf_symbol` (and never `linux_banner`, so that
/// without `__start_BTF` the BTF header is searched for).
fn image(seed: u64, decoys: &[Decoy], walk: usize, btf_symbol: bool) -> Image {
    let mut rng = Rng(seed);
    let mut mem = filler(&mut rng, 4096);
    let decoys_at = mem.len();
    mem.resize(decoys_at + 32 * decoys.len(), 0);
    pad8(&mut mem);
    let walk_at = mem.len();
    for _ in 0..walk / 16 {
        // BTF_KIND_INT, 4 bytes, 32 bits.
        for w in [0u32, 1 << 24, 4, 32] {
            mem.extend_from_slice(&w.to_le_bytes());
        }
    }
    mem.extend_from_slice(&[0xff; 12]);
    let walk_len = (mem.len() - walk_at) as u32;
    pad8(&mut mem);
    let btf_at = mem.len();
    mem.extend_from_slice(&kernel_like(0));
    pad8(&mut mem);
    let banner_at = mem.len();
    mem.extend_from_slice(b"Linux version 6.1.0-synthetic (test@test) #1 SMP\n\0");
    mem.extend(filler(&mut rng, 4096));
    pad8(&mut mem);

    // The symbols: text at the start, the data ones where they are.
    let pcpu_hot = BASE + 0x40;
    let mut syms = vec![
        sym(b'T', "_text", BASE),
        sym(b'T', "_stext", BASE),
        sym(b'D', "pcpu_hot", pcpu_hot),
        sym(b'T', "_etext", BASE + 0x1000),
        sym(b'D', "banner_text", BASE + banner_at as u64),
    ];
    for i in 0..600u64 {
        syms.push(sym(b't', &format!("func_{i}"), BASE + 0x100 + 4 * i));
    }
    if btf_symbol {
        syms.push(sym(b'R', "__start_BTF", BASE + btf_at as u64));
    }
    syms.sort_by_key(|s| s.addr);
    let (kallsyms, _) = generate(&syms, Order::V61 { seqs: true }, false, BASE);
    mem.extend_from_slice(&kallsyms);
    mem.extend(filler(&mut rng, 4096));

    // The decoys, now that the image's size is known.
    let end = mem.len() as u64;
    let mut claimed = 0u64;
    for (i, d) in decoys.iter().enumerate() {
        let at = decoys_at + 32 * i;
        let data = (at + 24) as u64;
        let (type_off, type_len, str_len) = match d {
            Decoy::Huge => (0, 0xffff_fff0, 0xffff_0000),
            Decoy::PastRange => (0, 30 << 20, 0),
            Decoy::Walk => ((walk_at as u64 - data) as u32, walk_len, 0),
        };
        assert!(
            !matches!(d, Decoy::PastRange) || data + (30 << 20) > end,
            "the image is too big for a past-range decoy"
        );
        claimed += type_len as u64 + str_len as u64;
        mem[at..at + 8].copy_from_slice(&BTF_PREFIX);
        for (k, w) in [type_off, type_len, type_len, str_len].iter().enumerate() {
            mem[at + 8 + 4 * k..at + 12 + 4 * k].copy_from_slice(&w.to_le_bytes());
        }
    }
    Image {
        mem,
        btf_at: BASE + btf_at as u64,
        pcpu_hot,
        claimed,
    }
}

fn sym(kind: u8, name: &str, addr: u64) -> Sym {
    Sym {
        kind,
        name: name.to_string(),
        addr,
    }
}

/// kernel_like(0)'s task layout.
const TASK: TaskLayout = TaskLayout {
    pid: 0x908,
    comm: 0xba0,
    comm_len: 16,
    size: 4096,
    stack: None,
    prio: None,
    state: Some((0, 4)),
    exit_state: None,
    cpu: None,
};

fn mixed(n: usize) -> Vec<Decoy> {
    (0..n)
        .map(|i| [Decoy::Huge, Decoy::PastRange, Decoy::Walk][i % 3])
        .collect()
}

/// Runs `fut` a slice at a time: its result, the number of slices and the
/// most work one slice did.
fn run_sliced<F: Future>(fut: F, budget: &Budget, slice: u64) -> (F::Output, u64, u64) {
    let mut fut = pin!(fut);
    let (mut slices, mut most) = (0u64, 0u64);
    loop {
        let before = budget.used();
        let poll = poll_slice(fut.as_mut(), budget, slice);
        slices += 1;
        most = most.max(budget.used() - before);
        if let Poll::Ready(out) = poll {
            return (out, slices, most);
        }
    }
}

/// What must agree between two recoveries of the same image.
fn summary(f: &KernelFacts) -> String {
    format!(
        "{:?} {} {:?} {:?} {:?} {:?} {:?}",
        f.tables,
        f.symbols.len(),
        f.banner,
        f.kaslr_slide,
        f.btf,
        f.task,
        f.current
    )
}

/// (a) 6,000 forged headers claiming terabytes before the real blob: each
/// refused from its 24 bytes (too large, past the image) or after a short
/// walk; the real one is found, and the work stays near one pass over the
/// image, not the lengths claimed.
#[test]
fn thousands_of_decoy_btf_headers_cost_their_headers_not_their_lengths() {
    let img = image(test_support::seed(), &mixed(6000), 512, false);
    let view = img.view();
    let budget = Budget::new(RECOVERY_BUDGET);
    let m = Metered::new(&view, &budget);
    let mut st = ScanStats::default();
    let (at, parsed) = block_on(btf::locate_budgeted(&m, None, &[img.range()], &mut st)).unwrap();
    assert_eq!(at, Gva(img.btf_at));
    assert_eq!(btf::task_layout(&parsed.unwrap()), Ok(TASK));
    assert_eq!(st.candidates, 6001);
    // The bound: the scan reads the image once; each decoy costs its
    // header, and a walking one its 528 bytes of types.
    let image = img.mem.len() as u64;
    let bound = 2 * image + 6000 * read_cost(24) + 2000 * read_cost(528) + (1 << 20);
    eprintln!(
        "6000 decoys claiming {:.1} TiB before the real BTF: {} units of work ({} bytes read \
         in {} reads), bound {bound}, image {image} bytes",
        img.claimed as f64 / (1u64 << 40) as f64,
        budget.used(),
        budget.bytes_read(),
        budget.reads()
    );
    assert!(img.claimed > 10 << 40);
    assert!(budget.used() <= bound, "{} > {bound}", budget.used());

    // The whole recovery over the same image finds the same.
    let budget = Budget::new(RECOVERY_BUDGET);
    let f = block_on(discover_budgeted(
        &Metered::new(&view, &budget),
        &[img.range()],
        10 << 20,
    ))
    .unwrap();
    assert_eq!(f.btf, Ok(Gva(img.btf_at)));
    assert_eq!(f.task, Ok(TASK));
    assert_eq!(
        f.current,
        Ok(CurrentTask {
            percpu_offset: img.pcpu_hot,
            source: CurrentSource::PcpuHotBtf
        })
    );
    assert!(f.banner.unwrap().contains("6.1.0-synthetic"));
}

/// (a) Forged headers whose types only fail at the end of a 64 KiB walk:
/// each costs its walk, the walks share one budget, and the search either
/// reaches the real blob (few decoys) or stops with a budget error once
/// the budget is spent (many), never past it.
#[test]
fn walking_decoys_share_one_budget() {
    let walk = 64 << 10;
    // 3000 walks of 64 KiB: 192 MiB, more than the budget.
    let img = image(7, &vec![Decoy::Walk; 3000], walk, false);
    let view = img.view();
    let range = [img.range()];

    let budget = Budget::new(RECOVERY_BUDGET);
    let m = Metered::new(&view, &budget);
    let mut st = ScanStats::default();
    let r = block_on(btf::locate_budgeted(&m, None, &range, &mut st));
    assert!(
        matches!(r, Err(BtfError::OverBudget)),
        "{:?}",
        r.map(|x| x.0)
    );
    assert!(budget.exhausted());
    assert!(budget.used() <= RECOVERY_BUDGET);
    // Most of the budget went into walks: the number of candidates tried
    // is what the budget pays for, far fewer than the 3000 planted.
    let per_walk = read_cost(walk as u64 + 12);
    let tried = st.candidates;
    eprintln!(
        "3000 walking decoys: budget spent after {tried} candidates, {} units",
        budget.used()
    );
    assert!(tried < 3000 && tried >= RECOVERY_BUDGET / per_walk / 2);
    assert!(tried <= RECOVERY_BUDGET / per_walk + 1);

    // Recovery as a whole: a clear error naming the stage.
    let budget = Budget::new(RECOVERY_BUDGET);
    let r = block_on(discover_budgeted(
        &Metered::new(&view, &budget),
        &range,
        10 << 20,
    ));
    assert!(matches!(r, Err(KallsymsError::BudgetExhausted)));
    assert_eq!(budget.stage(), "BTF");
    assert_eq!(
        KallsymsError::BudgetExhausted.to_string(),
        "recovery gave up: its work budget is spent"
    );

    // With a budget that pays for every walk, the real blob is found.
    let budget = Budget::new(1 << 30);
    let mut st = ScanStats::default();
    let (at, _) = block_on(btf::locate_budgeted(
        &Metered::new(&view, &budget),
        None,
        &range,
        &mut st,
    ))
    .unwrap();
    assert_eq!(at, Gva(img.btf_at));
    assert_eq!(st.candidates, 3001);
    assert!(budget.used() >= 3000 * per_walk);

    // `__start_BTF` in kallsyms: no header search at all.
    let img = image(7, &vec![Decoy::Walk; 3000], walk, true);
    let view = img.view();
    let budget = Budget::new(RECOVERY_BUDGET);
    let f = block_on(discover_budgeted(
        &Metered::new(&view, &budget),
        &[img.range()],
        10 << 20,
    ))
    .unwrap();
    assert_eq!((f.btf, f.task), (Ok(Gva(img.btf_at)), Ok(TASK)));
    assert!(budget.used() < 16 << 20, "{}", budget.used());
}

/// Headers are refused from their own 24 bytes when they claim too much,
/// or sections past the range they were found in.
#[test]
fn absurd_headers_are_refused_unread() {
    let img = image(3, &[Decoy::Huge, Decoy::PastRange, Decoy::Walk], 64, false);
    let view = img.view();
    let at = |i: u64| Gva(BASE + 4096 + 32 * i);
    let r = img.range();
    let budget = Budget::new(RECOVERY_BUDGET);
    let m = Metered::new(&view, &budget);
    let parse = |i| block_on(btf::Btf::parse_paced(&m, at(i), Some(r), &budget)).map(|_| ());
    assert_eq!(
        parse(0),
        Err(BtfError::TooLarge {
            bytes: 0xffff_fff0 + 0xffff_0000
        })
    );
    assert_eq!(budget.used(), read_cost(24));
    assert_eq!(parse(1), Err(BtfError::OutOfRange));
    assert_eq!(budget.used(), 2 * read_cost(24));
    assert!(matches!(parse(2), Err(BtfError::Malformed { .. })));
    // The cap is on the claim, not on where the range ends.
    const { assert!(MAX_BTF_BYTES < 0xffff_fff0) };
    // Outside the range searched: refused before anything is read.
    let outside = GvaRange::new(Gva(BASE + 8192), r.end);
    let before = budget.used();
    assert_eq!(
        block_on(btf::Btf::parse_paced(&m, at(2), Some(outside), &budget)).map(|_| ()),
        Err(BtfError::OutOfRange)
    );
    assert_eq!(budget.used(), before);
    // The real blob parses within its range.
    assert!(btf::Btf::parse_within(&view, Gva(img.btf_at), r).is_ok());
}

/// (b) Every budget from nothing to enough: recovery either gives exactly
/// the unlimited result or the budget error, without panicking and without
/// passing the budget.
#[test]
fn every_budget_gives_the_result_or_a_clear_error() {
    let img = image(11, &mixed(300), 4096, false);
    let view = img.view();
    let range = [img.range()];
    let full = Budget::new(u64::MAX);
    let whole = block_on(discover_budgeted(
        &Metered::new(&view, &full),
        &range,
        10 << 20,
    ))
    .unwrap();
    let need = full.used();
    let want = summary(&whole);
    assert_eq!(whole.task, Ok(TASK));
    let mut rng = Rng(test_support::seed());
    let mut limits: Vec<u64> = (0..=400).map(|k| need * k / 400).collect();
    limits.extend((0..40).map(|_| rng.below(need + 1)));
    limits.extend([need - 1, need, need + 1]);
    let mut stages = std::collections::BTreeSet::new();
    for limit in limits {
        let budget = Budget::new(limit);
        let r = block_on(discover_budgeted(
            &Metered::new(&view, &budget),
            &range,
            10 << 20,
        ));
        assert!(budget.used() <= limit);
        match r {
            Ok(f) => {
                assert!(limit >= need, "finished under {limit} < {need}");
                assert_eq!(summary(&f), want);
            }
            Err(KallsymsError::BudgetExhausted) => {
                assert!(limit < need, "failed with {limit} >= {need}");
                assert!(budget.exhausted());
                stages.insert(budget.stage());
            }
            Err(e) => panic!("limit {limit}: {e}"),
        }
    }
    eprintln!("recovery needs {need} units; budgets ran out in {stages:?}");
    // The sweep ran out in every stage.
    for s in ["kallsyms search", "symbol index", "banner", "BTF"] {
        assert!(stages.contains(s), "{s} not in {stages:?}");
    }
}

/// (b) Forged kallsyms: copies of a real token table (and index) in 4 MiB
/// of data, each making the validation read back megabytes for markers
/// that are not there. The search ends with the budget error within the
/// budget.
#[test]
fn forged_kallsyms_candidates_exhaust_the_budget_cleanly() {
    let syms: Vec<Sym> = (0..10)
        .map(|i| sym(b'T', &format!("f{i}"), BASE + 16 * i))
        .collect();
    let (blob, at) = generate(&syms, Order::V612, false, BASE);
    let tokens = &blob[at.token_table..at.offsets];
    let mut rng = Rng(test_support::seed());
    let mut mem = filler(&mut rng, 4 << 20);
    let copies = 24;
    for i in 0..copies {
        let o = ((i + 1) * (mem.len() / (copies + 1))) & !7;
        mem[o..o + tokens.len()].copy_from_slice(tokens);
    }
    let mut view = SegmentView::new();
    view.add(Gva(BASE), &mem, mem.len() as u64);
    let range = [GvaRange::with_len(Gva(BASE), mem.len() as u64)];
    // Unlimited, the 24 validations read back 52 MB.
    let all = Budget::new(u64::MAX);
    let mut st = LocateStats::default();
    let r = block_on(locate_budgeted(&Metered::new(&view, &all), &range, &mut st));
    assert!(matches!(r, Err(KallsymsError::NoMarkers { .. })), "{r:?}");
    assert_eq!(st.token_tables, copies as u32);
    let limit = 16 << 20;
    assert!(all.used() > 2 * limit, "{}", all.used());
    let budget = Budget::new(limit);
    let mut st = LocateStats::default();
    let r = block_on(locate_budgeted(
        &Metered::new(&view, &budget),
        &range,
        &mut st,
    ));
    eprintln!(
        "{copies} forged candidates: {} units unlimited; with {limit}: {r:?} after {} units and \
         {} token tables",
        all.used(),
        budget.used(),
        st.token_tables
    );
    assert_eq!(r, Err(KallsymsError::BudgetExhausted));
    assert!(budget.used() <= limit);
    assert!(st.token_tables >= 1 && (st.token_tables as usize) < copies);
}

/// (c) Slice by slice: the same result as at once, each slice within
/// `slice + MAX_STEP`, whatever the slice size; a recovery that runs out
/// of budget runs out the same way.
#[test]
fn sliced_recovery_matches_one_call() {
    let img = image(13, &mixed(900), 16 << 10, false);
    let view = img.view();
    let range = [img.range()];
    // The reference: one call, no limit.
    let one = Budget::unlimited();
    let whole = block_on(discover_budgeted(
        &Metered::new(&view, &one),
        &range,
        10 << 20,
    ))
    .unwrap();
    assert_eq!(whole.task, Ok(TASK));
    assert!(one.used() > 16 * TURN_SLICE);
    for slice in [1, 4096, 64 << 10, TURN_SLICE] {
        let budget = Budget::new(RECOVERY_BUDGET);
        let m = Metered::new(&view, &budget);
        let (r, slices, most) = run_sliced(discover_budgeted(&m, &range, 10 << 20), &budget, slice);
        let f = r.unwrap();
        eprintln!(
            "slice {slice}: {slices} slices, the largest {most} units, {} in all",
            budget.used()
        );
        assert_eq!(summary(&f), summary(&whole));
        assert_eq!(budget.used(), one.used());
        assert!(most <= slice + MAX_STEP, "slice {slice}: {most}");
        assert!(slices > one.used() / (slice + MAX_STEP));
        assert_eq!(budget.slices(), slices);
    }
    // Out of budget, sliced or not: the same error after the same work.
    let limit = one.used() / 2;
    let a = Budget::new(limit);
    let ra = block_on(discover_budgeted(
        &Metered::new(&view, &a),
        &range,
        10 << 20,
    ));
    let b = Budget::new(limit);
    let m = Metered::new(&view, &b);
    let (rb, slices, _) = run_sliced(discover_budgeted(&m, &range, 10 << 20), &b, 4096);
    assert!(matches!(ra, Err(KallsymsError::BudgetExhausted)));
    assert!(matches!(rb, Err(KallsymsError::BudgetExhausted)));
    assert_eq!((a.used(), a.stage()), (b.used(), b.stage()));
    assert!(slices > 1);
}
