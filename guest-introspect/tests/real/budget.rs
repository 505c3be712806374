//! The work budget over the real images, on the hypervisor's path (page
//! tables, a KASLR slide, the search from LSTAR): what each stage of
//! recovery costs (the numbers in the budget module's documentation), and
//! that recovery run one slice at a time gives the same result as run at
//! once, each slice within its bound.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use guest_introspect::btf;
use guest_introspect::budget::{
    block_on, poll_slice, Budget, Metered, MAX_STEP, RECOVERY_BUDGET, TURN_SLICE,
};
use guest_introspect::facts::{
    banner_paced, current_task_paced, discover_budgeted, ranges_from_lstar, KernelFacts,
};
use guest_introspect::fentry::{survey_paced, Survey};
use guest_introspect::kallsyms::{locate_budgeted, KallsymsError, LocateStats, SymbolIndex};
use guest_introspect::scan::ScanStats;
use guest_introspect::{Gva, GvaRange};

use crate::common::{self, PagedGuest};

fn guest(img: &common::Image, r: &crate::Recovered) -> (PagedGuest, GvaRange) {
    let slide = 0x2a0_0000u64 * 3;
    let g = PagedGuest::new(img, slide, r.tables.relative_base_at.0);
    let lstar = Gva(r.index.addr_of("entry_SYSCALL_64").unwrap().0 + slide);
    (g, ranges_from_lstar(lstar).unwrap())
}

fn mu(units: u64) -> String {
    format!("{:.1} M", units as f64 / 1e6)
}

/// Stage by stage, with the calls `discover_budgeted` makes, then the
/// survey the hypervisor adds.
fn stages(img: &common::Image, r: &crate::Recovered) -> u64 {
    let (g, range) = guest(img, r);
    let view = g.view();
    let budget = Budget::new(RECOVERY_BUDGET);
    let m = Metered::new(&view, &budget);
    let ranges = [range];
    let mut last = 0;
    let mut step = |what: &str| {
        let d = budget.used() - last;
        last = budget.used();
        eprintln!(
            "  {what:<28} {:>8} units ({} bytes in {} reads so far)",
            mu(d),
            budget.bytes_read(),
            budget.reads()
        );
        d
    };
    eprintln!("{}: recovery cost from LSTAR", img.release);
    let mut ls = LocateStats::default();
    let tables = block_on(locate_budgeted(&m, &ranges, &mut ls)).unwrap();
    let kallsyms = step("kallsyms scan + validation");
    let index = block_on(SymbolIndex::build_budgeted(&m, &tables, 10 << 20)).unwrap();
    let build = step("index");
    let mut st = ScanStats::default();
    let banner = block_on(banner_paced(&m, Some(&index), &ranges, &mut st, &budget));
    assert!(banner.is_some());
    step("banner");
    let (at, parsed) = block_on(btf::locate_budgeted(&m, Some(&index), &ranges, &mut st)).unwrap();
    let b = parsed.unwrap();
    assert_eq!(b.base(), at);
    let layout = block_on(btf::task_layout_paced(&b, &budget)).unwrap();
    let current = block_on(current_task_paced(&index, Some(&b), &budget)).unwrap();
    let btf_cost = step("BTF parse + task layout");
    let s = block_on(survey_paced(&m, &index, false, &budget));
    assert_eq!(s.unreadable, 0);
    let survey = step("fentry survey");
    eprintln!(
        "  total {:>8} units of {} ({:.1}x margin): {} symbols, {} BTF types, task {layout:?}, \
         current {current:?}, longest hash probe run {}",
        mu(budget.used()),
        mu(RECOVERY_BUDGET),
        RECOVERY_BUDGET as f64 / budget.used() as f64,
        index.len(),
        b.type_count(),
        index.longest_probe_run(),
    );
    // Every stage has real work, and the whole is far inside the budget.
    assert!(kallsyms > 1_000_000 && build > 500_000 && btf_cost > 1_000_000 && survey > 100_000);
    assert!(!budget.exhausted());
    budget.used()
}

#[test]
fn real_recovery_cost_is_far_inside_the_budget() {
    let debian = stages(common::debian(), crate::debian());
    let fast = stages(common::fast(), crate::fast());
    // The margin the budget's documentation promises, about 8x Debian's
    // cost (the biggest kernel here; its package follows Debian's updates,
    // so with some room).
    assert!(debian * 7 <= RECOVERY_BUDGET, "Debian costs {debian}");
    assert!(fast < debian);
    // One turn's slice is a small part of a real recovery.
    assert!(TURN_SLICE * 50 < debian && TURN_SLICE * 400 > debian);
}

/// The hypervisor's recovery: discovery then the survey, on one budget.
async fn recovery<V: guest_introspect::VirtMemory + ?Sized>(
    m: &Metered<'_, V>,
    range: GvaRange,
) -> Result<(KernelFacts, Survey), KallsymsError> {
    let f = discover_budgeted(m, &[range], 10 << 20).await?;
    let s = survey_paced(m, &f.symbols, false, m.budget()).await;
    Ok((f, s))
}

/// Runs `fut` a slice at a time; returns its result, the number of slices
/// and the most work one slice did.
pub fn run_sliced<F: Future>(fut: F, budget: &Budget, slice: u64) -> (F::Output, u64, u64) {
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

fn sliced_equals_whole(img: &common::Image, r: &crate::Recovered) {
    let (g, range) = guest(img, r);
    let view = g.view();
    let whole_budget = Budget::new(RECOVERY_BUDGET);
    let (whole, whole_s) = block_on(recovery(&Metered::new(&view, &whole_budget), range)).unwrap();
    let budget = Budget::new(RECOVERY_BUDGET);
    let m = Metered::new(&view, &budget);
    let (out, slices, most) = run_sliced(recovery(&m, range), &budget, TURN_SLICE);
    let (f, s) = out.unwrap();
    eprintln!(
        "{}: {slices} slices of {} units, the largest {most} units; {} units in all",
        img.release,
        TURN_SLICE,
        budget.used()
    );
    // The same work, the same answers.
    assert_eq!(budget.used(), whole_budget.used());
    assert_eq!(f.tables, whole.tables);
    assert_eq!(f.symbols.len(), whole.symbols.len());
    assert!(f.symbols.iter().eq(whole.symbols.iter()));
    assert_eq!(
        (f.banner, f.kaslr_slide, f.btf, f.task, f.current),
        (
            whole.banner,
            whole.kaslr_slide,
            whole.btf,
            whole.task,
            whole.current
        )
    );
    assert!(f.task.is_ok());
    assert_eq!(s, whole_s);
    // Each slice stops at the first pause past its share.
    assert!(most <= TURN_SLICE + MAX_STEP, "a slice did {most} units");
    assert!(slices >= budget.used() / (TURN_SLICE + MAX_STEP));
}

#[test]
fn sliced_recovery_matches_whole_debian() {
    sliced_equals_whole(common::debian(), crate::debian());
}

#[test]
fn sliced_recovery_matches_whole_fast_lane() {
    sliced_equals_whole(common::fast(), crate::fast());
}
