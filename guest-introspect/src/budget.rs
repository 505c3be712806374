//! One work budget for a recovery attempt, and the slicing of that work
//! across calls.
//!
//! Everything recovery does is driven by numbers the guest chooses: how
//! many needle matches its memory holds, how long a forged BTF header says
//! its sections are, how many symbols a forged `num_syms` claims. A
//! [`Budget`] counts the work of one attempt in *units* (about one unit per
//! byte handled, see [`read_cost`]) and refuses work past its limit, so that
//! the kallsyms search and validation, the index build, the banner and BTF
//! searches, the BTF walks and the fentry survey together do bounded work
//! whatever the guest plants. Reads are charged by [`Metered`], a view that
//! fails with [`ViewError::OverBudget`] once the budget is spent; other work
//! (hash probes, name expansion) is charged with [`Budget::charge`].
//!
//! The same budget paces the work. The long loops of recovery are `async`
//! and call [`Budget::pause`] between bounded steps; a pause suspends the
//! computation once the current *slice* is used up. [`poll_slice`] runs a
//! recovery future for one slice: in the hypervisor, one slice per turn of
//! the run loop, so that the control channel keeps being served while a
//! recovery runs. Nothing here waits for anything: a pending future only
//! means "the slice is used up, call again". [`block_on`] runs a future to
//! the end in one call (the synchronous entry points use it).
//!
//! # Numbers
//!
//! Measured with the tests over real images (`tests/real/budget.rs`), from
//! LSTAR's 2 MiB page through page tables as the hypervisor searches, in
//! units of [`read_cost`] (bytes read in parentheses):
//!
//! | | kallsyms scan + validation | index build | BTF parse + `task_struct` | fentry survey | total |
//! |---|---|---|---|---|---|
//! | Debian 6.1 (94,266 symbols, 100,810 BTF types) | 8.4 M (8.3 MB) | 5.2 M (1.6 MB) | 2.7 M (2.6 MB) | 3.6 M (0.4 MB in 49,552 reads) | 19.9 M (12.9 MB) |
//! | fast-lane 6.12 (48,827 symbols, 58,086 BTF types) | 3.6 M (3.6 MB) | 2.2 M (0.8 MB) | 1.6 M (1.5 MB) | 2.0 M (0.3 MB) | 9.4 M (6.2 MB) |
//!
//! The index build is mostly the charge for expanding every name and for
//! its hash probes (the copy itself is 1.6 MB); the survey mostly the
//! per-read charge of one 9-byte read per text symbol. The kallsyms search
//! reads everything from LSTAR's page to the tables (7.5 MB for Debian);
//! its validation of the one real candidate reads 0.74 MB.
//!
//! [`RECOVERY_BUDGET`] is 8.4 times Debian's total; [`TURN_SLICE`] is 0.7%
//! of that total, which Debian's recovery takes in 150 slices, none more
//! than 181 Ki units.

use core::cell::Cell;
use core::future::Future;
use core::pin::{pin, Pin};
use core::task::{Context, Poll, Waker};

use crate::addr::Gva;
use crate::view::{ViewError, VirtMemory};

/// Units charged per page a read touches, on top of its length: a read
/// through the guest's page tables is a 4-level walk (four 8-byte table
/// reads) and a call, whatever its length.
pub const READ_PAGE_COST: u64 = 64;

/// The work one recovery attempt may do, in units ([`read_cost`]): 160 Mi
/// units, 8.4 times what Debian's 6.1 kernel needs (19.9 M units; see the
/// module documentation), so that a kernel twice its size in symbols, BTF
/// and distance from LSTAR to the tables still has a 4x margin. Forged
/// tables or headers that would make the search run longer make it fail
/// with a budget error instead. Bochs ran the fast-lane recovery (about
/// 9.4 M units) in about 1.15 s of emulated time, which puts the whole
/// budget at about 20 s there, spread over turns.
pub const RECOVERY_BUDGET: u64 = 160 << 20;

/// The work one slice may do before the next [`Budget::pause`] suspends
/// the computation: 128 Ki units, 0.7% of Debian's recovery (150 slices),
/// about 16 ms in Bochs.
pub const TURN_SLICE: u64 = 128 << 10;

/// The most work done between two pauses, in units: a slice ends at the
/// first pause after its share, so it does at most `slice + MAX_STEP`. The
/// largest step is in the kallsyms validation: a names check (one read of
/// up to 263 KiB) followed by the marker run of the next marker width
/// (128 KiB in 4 KiB reads). Everything else between two pauses is one
/// 64 KiB scan chunk, a token table check (up to 137 KiB), one 16 KiB BTF
/// window or one BTF type lookup (at most 64 headers, 2 KiB each).
pub const MAX_STEP: u64 = 512 << 10;

/// Units a read of `len` bytes costs: its length plus [`READ_PAGE_COST`]
/// per 4 KiB page touched (at least one).
pub const fn read_cost(len: u64) -> u64 {
    len.saturating_add(READ_PAGE_COST * (1 + len / 4096))
}

/// The work budget of one recovery attempt. Shared by reference between the
/// metered view and the code it paces (its counters are [`Cell`]s).
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: Cell<u64>,
    /// [`Budget::pause`] suspends once `used` reaches this.
    slice_end: Cell<u64>,
    /// Bytes read through [`Metered`] views.
    bytes: Cell<u64>,
    /// Reads made (refused ones included).
    reads: Cell<u64>,
    /// Units charged with [`Budget::charge`] (work other than reads).
    other: Cell<u64>,
    /// Set once a charge was refused.
    exhausted: Cell<bool>,
    /// What the attempt was doing, for reports.
    stage: Cell<&'static str>,
    /// Slices started with [`Budget::begin_slice`].
    slices: Cell<u64>,
}

/// A charge was refused: the budget is spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverBudget;

impl Budget {
    /// A budget of `limit` units, with no slice (pauses never suspend
    /// until [`Self::begin_slice`] is called).
    pub const fn new(limit: u64) -> Self {
        Self {
            limit,
            used: Cell::new(0),
            slice_end: Cell::new(u64::MAX),
            bytes: Cell::new(0),
            reads: Cell::new(0),
            other: Cell::new(0),
            exhausted: Cell::new(false),
            stage: Cell::new(""),
            slices: Cell::new(0),
        }
    }

    /// A budget that never refuses and never suspends: for synchronous
    /// callers whose views are not metered.
    pub const fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    /// Charges `units` of work. Refuses (and remembers it) when that would
    /// pass the limit; nothing is charged then.
    pub fn charge(&self, units: u64) -> Result<(), OverBudget> {
        self.take(units)?;
        self.other.set(self.other.get().saturating_add(units));
        Ok(())
    }

    /// Charges a read of `len` bytes ([`read_cost`]).
    pub fn charge_read(&self, len: u64) -> Result<(), OverBudget> {
        self.reads.set(self.reads.get() + 1);
        self.take(read_cost(len))?;
        self.bytes.set(self.bytes.get().saturating_add(len));
        Ok(())
    }

    fn take(&self, units: u64) -> Result<(), OverBudget> {
        match self.used.get().checked_add(units) {
            Some(u) if u <= self.limit && !self.exhausted.get() => {
                self.used.set(u);
                Ok(())
            }
            _ => {
                self.exhausted.set(true);
                Err(OverBudget)
            }
        }
    }

    /// The limit, in units.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Units charged so far.
    pub fn used(&self) -> u64 {
        self.used.get()
    }

    /// Bytes read through metered views so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes.get()
    }

    /// Reads made through metered views so far (refused ones included).
    pub fn reads(&self) -> u64 {
        self.reads.get()
    }

    /// Units charged for work other than reads.
    pub fn other_work(&self) -> u64 {
        self.other.get()
    }

    /// Whether a charge was refused: the attempt must give up.
    pub fn exhausted(&self) -> bool {
        self.exhausted.get()
    }

    /// Names what the attempt is doing (for reports). Once the budget is
    /// spent the name stays: it says where it ran out.
    pub fn set_stage(&self, stage: &'static str) {
        if !self.exhausted() {
            self.stage.set(stage);
        }
    }

    /// What the attempt is doing, or was doing when the budget ran out.
    pub fn stage(&self) -> &'static str {
        self.stage.get()
    }

    /// Starts a slice of `units`: the next pause after that much work
    /// suspends the computation.
    pub fn begin_slice(&self, units: u64) {
        self.slices.set(self.slices.get() + 1);
        self.slice_end.set(self.used.get().saturating_add(units));
    }

    /// Slices started so far.
    pub fn slices(&self) -> u64 {
        self.slices.get()
    }

    /// Whether the current slice is used up (or the budget spent: the work
    /// after the pause then fails fast).
    pub fn slice_spent(&self) -> bool {
        self.used.get() >= self.slice_end.get()
    }

    /// A point where the computation may be suspended: pending once when
    /// the slice is used up, ready otherwise (and when polled again).
    pub fn pause(&self) -> Pause<'_> {
        Pause {
            budget: self,
            yielded: false,
        }
    }
}

/// The future of [`Budget::pause`].
#[derive(Debug)]
#[must_use = "a pause does nothing unless awaited"]
pub struct Pause<'b> {
    budget: &'b Budget,
    yielded: bool,
}

impl Future for Pause<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
        // Pending at most once: whoever polls again has started a new slice
        // (or wants the computation to go on regardless).
        if !self.yielded && self.budget.slice_spent() && !self.budget.exhausted() {
            self.yielded = true;
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    }
}

/// Polls `fut` for one slice of `slice` units of `budget`'s work: `Pending`
/// when the slice ran out first (call again), else the result.
pub fn poll_slice<F: Future + ?Sized>(
    fut: Pin<&mut F>,
    budget: &Budget,
    slice: u64,
) -> Poll<F::Output> {
    budget.begin_slice(slice);
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

/// Runs `fut` to its end. The futures of this crate only suspend at
/// [`Budget::pause`], so every poll makes progress.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

/// Root time before a failed recovery may be attempted again: 10 s, each
/// further failure doubling it up to [`RETRY_MAX_NS`]. A failed attempt may
/// have spent its whole budget (about 20 s of Bochs time, spread over
/// turns), so retries are paced by time, not by the guest's requests.
pub const RETRY_FIRST_NS: u64 = 10_000_000_000;
/// The longest wait between two attempts (about 10 minutes).
pub const RETRY_MAX_NS: u64 = 640 * 1_000_000_000;
/// Turns of the run loop before a failed recovery may be attempted again,
/// doubling like the time (10 s of idle turns at 200 a second). Root's
/// clock is the guest's TSC made monotonic, which a guest can push forward;
/// turns come from the preemption timer, which it cannot. A failing attempt
/// runs at most `RECOVERY_BUDGET / TURN_SLICE` (1,280) turns, so this keeps
/// failing attempts to a minority of turns even if time is forged.
pub const RETRY_FIRST_TURNS: u64 = 2_000;
/// The most turns asked for between two attempts.
pub const RETRY_MAX_TURNS: u64 = 128_000;

/// When a failed recovery may run again: after enough root time and enough
/// turns, both doubling with each consecutive failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    failures: u32,
    not_before_ns: u64,
    not_before_turn: u64,
}

impl Backoff {
    /// No failure yet: an attempt may start at once.
    pub const fn new() -> Self {
        Self {
            failures: 0,
            not_before_ns: 0,
            not_before_turn: 0,
        }
    }

    /// An attempt failed at root time `now_ns`, turn `turn`. Returns the
    /// wait in root time before the next one.
    pub fn failed(&mut self, now_ns: u64, turn: u64) -> u64 {
        self.failures = self.failures.saturating_add(1);
        let double = |first: u64, max: u64| {
            first
                .checked_shl(self.failures - 1)
                .filter(|w| w >> (self.failures - 1) == first)
                .map_or(max, |w| w.min(max))
        };
        let wait = double(RETRY_FIRST_NS, RETRY_MAX_NS);
        self.not_before_ns = now_ns.saturating_add(wait);
        self.not_before_turn = turn.saturating_add(double(RETRY_FIRST_TURNS, RETRY_MAX_TURNS));
        wait
    }

    /// An attempt succeeded: the next failure starts from the first wait.
    pub fn succeeded(&mut self) {
        *self = Self::new();
    }

    /// Whether a new attempt may start.
    pub fn may_retry(&self, now_ns: u64, turn: u64) -> bool {
        now_ns >= self.not_before_ns && turn >= self.not_before_turn
    }

    /// Root time left before a new attempt (0 when only turns are missing).
    pub fn wait_ns(&self, now_ns: u64) -> u64 {
        self.not_before_ns.saturating_sub(now_ns)
    }

    /// Consecutive failures.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// A view whose reads are charged to a [`Budget`]: once the budget is
/// spent, every read fails with [`ViewError::OverBudget`] without touching
/// the view.
pub struct Metered<'a, V: ?Sized> {
    inner: &'a V,
    budget: &'a Budget,
}

impl<'a, V: ?Sized> Metered<'a, V> {
    /// Meters `inner` with `budget`.
    pub fn new(inner: &'a V, budget: &'a Budget) -> Self {
        Self { inner, budget }
    }

    /// The budget reads are charged to.
    pub fn budget(&self) -> &'a Budget {
        self.budget
    }

    /// The view underneath.
    pub fn inner(&self) -> &'a V {
        self.inner
    }
}

impl<V: VirtMemory + ?Sized> VirtMemory for Metered<'_, V> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        self.budget
            .charge_read(buf.len() as u64)
            .map_err(|_| ViewError::OverBudget { gva })?;
        self.inner.read_virt(gva, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::SegmentView;

    #[test]
    fn charges_refuse_past_the_limit_and_stay_refused() {
        let b = Budget::new(1000);
        assert_eq!(b.charge(600), Ok(()));
        assert_eq!(b.charge(401), Err(OverBudget));
        assert!(b.exhausted());
        assert_eq!(b.used(), 600);
        // Once spent, even a charge that would fit is refused.
        assert_eq!(b.charge(1), Err(OverBudget));
        assert_eq!(read_cost(0), READ_PAGE_COST);
        assert_eq!(read_cost(4096), 4096 + 2 * READ_PAGE_COST);
    }

    #[test]
    fn metered_reads_fail_once_spent() {
        let data = [7u8; 8192];
        let mut v = SegmentView::new();
        v.add(Gva(0x1000), &data, data.len() as u64);
        let b = Budget::new(read_cost(4096) + read_cost(100));
        let m = Metered::new(&v, &b);
        let mut buf = [0u8; 4096];
        assert!(m.read_virt(Gva(0x1000), &mut buf).is_ok());
        assert!(m.read_virt(Gva(0x1000), &mut buf[..100]).is_ok());
        assert_eq!(
            m.read_virt(Gva(0x2000), &mut buf[..1]),
            Err(ViewError::OverBudget { gva: Gva(0x2000) })
        );
        assert_eq!((b.bytes_read(), b.reads()), (4196, 3));
    }

    #[test]
    fn backoff_doubles_in_time_and_turns() {
        let mut b = Backoff::new();
        assert!(b.may_retry(0, 0));
        let s = 1_000_000_000;
        assert_eq!(b.failed(5 * s, 100), 10 * s);
        assert!(!b.may_retry(14 * s, 100_000));
        assert!(!b.may_retry(15 * s, 2_099), "time alone is not enough");
        assert!(b.may_retry(15 * s, 2_100));
        assert_eq!(b.wait_ns(12 * s), 3 * s);
        assert_eq!(b.failed(20 * s, 3_000), 20 * s);
        assert!(!b.may_retry(39 * s, 100_000));
        assert!(!b.may_retry(40 * s, 6_999));
        assert!(b.may_retry(40 * s, 7_000));
        // Capped, however many failures.
        for _ in 0..100 {
            b.failed(0, 0);
        }
        assert_eq!(b.failures(), 102);
        assert!(b.may_retry(RETRY_MAX_NS, RETRY_MAX_TURNS));
        assert!(!b.may_retry(RETRY_MAX_NS - 1, RETRY_MAX_TURNS));
        b.succeeded();
        assert_eq!(b, Backoff::new());
    }

    #[test]
    fn pauses_suspend_once_per_slice() {
        let b = Budget::new(1 << 20);
        let work = async {
            let mut steps = 0;
            for _ in 0..10 {
                b.charge(100).unwrap();
                b.pause().await;
                steps += 1;
            }
            steps
        };
        let mut work = core::pin::pin!(work);
        let mut polls = 0;
        let out = loop {
            polls += 1;
            if let Poll::Ready(v) = poll_slice(work.as_mut(), &b, 300) {
                break v;
            }
        };
        assert_eq!(out, 10);
        // 300 units a slice, 100 a step: 3 steps a poll, the 10th finishes.
        assert_eq!(polls, 4);
        assert_eq!(b.slices(), 4);
    }
}
