//! Per-reason exit counters, and root's time by kind of work.

use crate::vmx::exit::{reason, reason_name};
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What root's time went to on a vCPU: a hypercall by what it was (the
/// tracer's count of the same name), or a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootWork {
    /// An entry hypercall recorded.
    Hit = 0,
    /// A return handed back.
    Return = 1,
    /// Any other VMCALL.
    Refused = 2,
    /// A turn of the run loop.
    Turn = 3,
}

/// Kinds of [`RootWork`].
pub const ROOT_WORK_KINDS: usize = RootWork::Turn as usize + 1;

/// Adds `n` to a counter only one CPU writes: a load and a store, no
/// locked instruction (readers on other CPUs see each value whole).
#[inline]
pub fn add_own(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(n), Relaxed);
}

/// One kind of root work's time on one CPU, in TSC ticks: how often, in
/// all, the shortest, the longest. Only its CPU adds to it (plain loads
/// and stores, no locked instruction); the status report reads it from
/// any CPU, each field whole.
pub struct TimeStat {
    count: AtomicU64,
    sum: AtomicU64,
    min: AtomicU64,
    max: AtomicU64,
}

impl TimeStat {
    /// Nothing yet.
    pub const fn new() -> Self {
        Self {
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            min: AtomicU64::new(u64::MAX),
            max: AtomicU64::new(0),
        }
    }

    /// One more occurrence of `ticks` (by the owning CPU only).
    #[inline]
    pub fn add(&self, ticks: u64) {
        add_own(&self.count, 1);
        self.sum
            .store(self.sum.load(Relaxed).saturating_add(ticks), Relaxed);
        if ticks < self.min.load(Relaxed) {
            self.min.store(ticks, Relaxed);
        }
        if ticks > self.max.load(Relaxed) {
            self.max.store(ticks, Relaxed);
        }
    }

    /// (count, sum, min, max) in ticks; min and max 0 when there was none.
    pub fn read(&self) -> (u64, u64, u64, u64) {
        let count = self.count.load(Relaxed);
        if count == 0 {
            return (0, 0, 0, 0);
        }
        (
            count,
            self.sum.load(Relaxed),
            self.min.load(Relaxed),
            self.max.load(Relaxed),
        )
    }
}

impl Default for TimeStat {
    fn default() -> Self {
        Self::new()
    }
}

/// Counts of VM exits by basic reason.
#[derive(Debug, Clone)]
pub struct ExitCounters {
    counts: [u64; reason::COUNT],
    other: u64,
}

impl Default for ExitCounters {
    fn default() -> Self {
        Self::new()
    }
}

impl ExitCounters {
    /// All zero.
    pub const fn new() -> Self {
        Self {
            counts: [0; reason::COUNT],
            other: 0,
        }
    }

    /// Counts one exit with basic reason `r`.
    pub fn record(&mut self, r: u16) {
        match self.counts.get_mut(r as usize) {
            Some(c) => *c += 1,
            None => self.other += 1,
        }
    }

    /// The count for basic reason `r`.
    pub fn get(&self, r: u16) -> u64 {
        self.counts.get(r as usize).copied().unwrap_or(0)
    }

    /// Adds `other`'s counts to these (another vCPU's, for the VM's sum).
    pub fn add(&mut self, other: &ExitCounters) {
        for (c, o) in self.counts.iter_mut().zip(other.counts.iter()) {
            *c = c.saturating_add(*o);
        }
        self.other = self.other.saturating_add(other.other);
    }

    /// Total exits.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.other
    }

    /// Non-zero counters as `(basic reason, name, count)`; reasons beyond the
    /// table are summed under `u16::MAX`.
    pub fn nonzero_with_reason(&self) -> impl Iterator<Item = (u16, &'static str, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, c)| **c != 0)
            .map(|(r, c)| (r as u16, reason_name(r as u16), *c))
            .chain((self.other != 0).then_some((u16::MAX, "OTHER", self.other)))
    }

    /// Non-zero counters as `(name, count)`.
    pub fn nonzero(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.nonzero_with_reason().map(|(_, name, c)| (name, c))
    }
}

impl core::fmt::Display for ExitCounters {
    /// `CPUID=12 MSR_READ=3 ...`, the format the host launcher parses.
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let mut first = true;
        for (name, c) in self.nonzero() {
            if !first {
                f.write_str(" ")?;
            }
            first = false;
            write!(f, "{name}={c}")?;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod time_tests {
    use super::TimeStat;

    #[test]
    fn a_time_stat_keeps_count_sum_and_extremes() {
        let t = TimeStat::new();
        assert_eq!(t.read(), (0, 0, 0, 0));
        for ticks in [700, 300, 1_000, 300] {
            t.add(ticks);
        }
        assert_eq!(t.read(), (4, 2_300, 300, 1_000));
        t.add(u64::MAX);
        assert_eq!(t.read().1, u64::MAX, "the sum saturates");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_formats() {
        let mut c = ExitCounters::new();
        assert_eq!(c.to_string(), "none");
        for _ in 0..3 {
            c.record(10);
        }
        c.record(52);
        c.record(1000);
        assert_eq!(c.get(10), 3);
        assert_eq!(c.total(), 5);
        assert_eq!(c.to_string(), "CPUID=3 PREEMPTION_TIMER=1 OTHER=1");
        let v: Vec<_> = c.nonzero_with_reason().collect();
        assert_eq!(
            v,
            vec![
                (10, "CPUID", 3),
                (52, "PREEMPTION_TIMER", 1),
                (u16::MAX, "OTHER", 1)
            ]
        );
    }

    #[test]
    fn sums_of_two_vcpus() {
        let (mut a, mut b) = (ExitCounters::new(), ExitCounters::new());
        a.record(10);
        a.record(10);
        b.record(10);
        b.record(48);
        b.record(u16::MAX);
        a.add(&b);
        assert_eq!((a.get(10), a.get(48), a.total()), (3, 1, 5));
        assert_eq!(b.total(), 3);
    }
}
