//! Host benchmark of the symbol index over the real images: recovery time,
//! lookup by name and by address, name expansion, globs, memory per symbol.
//!
//! `cargo bench -p guest-introspect` runs it in full; under `cargo test`
//! (no `--bench` argument) it runs a short smoke pass.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use guest_introspect::fentry::survey;
use guest_introspect::kallsyms::{locate, LocateStats, SymbolIndex};
use guest_introspect::{Gva, GvaRange, SymbolId};

fn per(d: Duration, n: usize) -> f64 {
    d.as_nanos() as f64 / n.max(1) as f64
}

fn bench(name: &str, img: &common::Image, rounds: usize) {
    let view = img.view();
    let ranges: Vec<GvaRange> = view.ranges().collect();

    let mut best = (Duration::MAX, Duration::MAX);
    let mut index = None;
    for _ in 0..rounds.clamp(1, 5) {
        let mut st = LocateStats::default();
        let t0 = Instant::now();
        let t = locate(&view, &ranges, &mut st).expect("kallsyms");
        let t1 = Instant::now();
        let idx = SymbolIndex::build(&view, &t).expect("index");
        let t2 = Instant::now();
        best = (best.0.min(t1 - t0), best.1.min(t2 - t1));
        index = Some(idx);
    }
    let idx = index.unwrap();
    let n = idx.len();

    // Names in a scrambled order.
    let mut rng = test_support::Rng(0x9e37_79b9_7f4a_7c15);
    let mut names: Vec<String> = (0..n as u32).map(|i| idx.name(SymbolId(i))).collect();
    for i in (1..names.len()).rev() {
        names.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let lookups = names.len() * rounds;
    let t0 = Instant::now();
    for _ in 0..rounds {
        for name in &names {
            black_box(idx.lookup(black_box(name)));
        }
    }
    let by_name = per(t0.elapsed(), lookups);
    let t0 = Instant::now();
    for i in 0..lookups {
        black_box(idx.lookup(black_box(if i % 2 == 0 {
            "no_such_symbol_here"
        } else {
            "vfs_reed"
        })));
    }
    let miss = per(t0.elapsed(), lookups);

    let text = idx.text().expect("text range");
    let addrs: Vec<Gva> = (0..100_000)
        .map(|_| Gva(text.start.0 + rng.below(text.len())))
        .collect();
    let t0 = Instant::now();
    for _ in 0..rounds {
        for &a in &addrs {
            black_box(idx.resolve(black_box(a)));
        }
    }
    let by_addr = per(t0.elapsed(), addrs.len() * rounds);
    let mut s = String::new();
    let t0 = Instant::now();
    for &a in &addrs {
        s.clear();
        idx.format_addr(a, &mut s).unwrap();
        black_box(&s);
    }
    let formatted = per(t0.elapsed(), addrs.len());

    let t0 = Instant::now();
    let mut buf = Vec::new();
    for i in 0..n as u32 {
        buf.clear();
        idx.name_into(SymbolId(i), &mut buf);
        black_box(&buf);
    }
    let expand = per(t0.elapsed(), n);

    let t0 = Instant::now();
    let hits = idx.glob("*sched*").count();
    let glob = t0.elapsed();

    let t0 = Instant::now();
    let sv = survey(&view, &idx, false);
    let surv = t0.elapsed();

    println!("{name} ({}): {n} symbols", img.release);
    println!("  recovery: locate {:?}, index build {:?}", best.0, best.1);
    println!(
        "  memory: {} bytes = {:.1} bytes/symbol (names stay compressed)",
        idx.heap_bytes(),
        idx.heap_bytes() as f64 / n as f64
    );
    println!("  lookup by name: {by_name:.0} ns (hit), {miss:.0} ns (miss)");
    println!("  resolve address: {by_addr:.0} ns, formatted sym+off/size: {formatted:.0} ns");
    println!("  expand one name: {expand:.0} ns; glob '*sched*' over all: {glob:?} ({hits} hits)");
    println!(
        "  fentry survey: {surv:?} ({} traceable, {} distinct sites)",
        sv.traceable, sv.unique_sites
    );
}

/// The hypervisor's path: the image behind guest page tables with a KASLR
/// slide, searched from LSTAR. Phases are separate functions so that an
/// instruction counter can be pointed at each (`discover_phase`,
/// `survey_phase`).
fn guest_path(name: &str, img: &common::Image) {
    let (rb_at, lstar) = {
        let view = img.view();
        let ranges: Vec<GvaRange> = view.ranges().collect();
        let t = locate(&view, &ranges, &mut LocateStats::default()).expect("kallsyms");
        let idx = SymbolIndex::build(&view, &t).expect("index");
        (
            t.relative_base_at.0,
            idx.addr_of("entry_SYSCALL_64").expect("entry_SYSCALL_64").0,
        )
    };
    let slide = 0x1e0_0000 * 5;
    let g = common::PagedGuest::new(img, slide, rb_at);
    let view = g.view();
    let t0 = Instant::now();
    let facts = discover_phase(&view, Gva(lstar + slide));
    let d = t0.elapsed();
    let t0 = Instant::now();
    let sv = survey_phase(&view, &facts.symbols);
    let s = t0.elapsed();
    println!(
        "{name} guest path (page tables, slide {slide:#x}): discover {d:?}, fentry survey {s:?} ({} sites); {:?}",
        sv.unique_sites, facts.locate_stats
    );
}

#[inline(never)]
fn discover_phase<V: guest_introspect::VirtMemory>(
    view: &V,
    lstar: Gva,
) -> guest_introspect::facts::KernelFacts {
    let range =
        guest_introspect::facts::ranges_from_lstar(lstar).expect("LSTAR in the kernel image");
    guest_introspect::facts::discover(view, &[range]).expect("discover")
}

#[inline(never)]
fn survey_phase<V: guest_introspect::VirtMemory>(
    view: &V,
    idx: &SymbolIndex,
) -> guest_introspect::fentry::Survey {
    survey(view, idx, false)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rounds = if full { 10 } else { 1 };
    // HVTRACE_BENCH=guest runs only the guest path (for an instruction
    // counter); guest-fast and guest-debian only one image's.
    let only = std::env::var("HVTRACE_BENCH").unwrap_or_default();
    if !only.starts_with("guest") {
        bench("fast-lane 6.12", common::fast(), rounds);
        bench("Debian 6.1", common::debian(), rounds);
    }
    if only != "guest-debian" {
        guest_path("fast-lane 6.12", common::fast());
    }
    if only != "guest-fast" {
        guest_path("Debian 6.1", common::debian());
    }
}
