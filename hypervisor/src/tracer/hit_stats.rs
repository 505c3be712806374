//! The hit path's counters: atomic, so that hits on several vCPUs add to
//! them at once through the VM's shared state.

use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use protocol::TracerReport;

/// The counters the hit path adds to, summed over the vCPUs.
#[derive(Default)]
pub(super) struct HitStats {
    pub(super) foreign_vmcalls: AtomicU64,
    pub(super) forged_entries: AtomicU64,
    pub(super) graph_misses: AtomicU64,
    pub(super) graph_dropped: AtomicU64,
    pub(super) graph_orphans: AtomicU64,
    /// Takes of the return stacks' lock that found it held by another
    /// vCPU.
    pub(super) stack_lock_waits: AtomicU64,
    /// Each vCPU's hypercalls, by what they were.
    pub(super) vcpus: Vec<VcpuHits>,
}

/// One vCPU's hypercalls (each is exactly one of `hits`, `returns` and
/// `refused`) and its EPT views.
pub(super) struct VcpuHits {
    /// Entries from a hooked site, recorded.
    pub(super) hits: AtomicU64,
    /// Returns through a frame, handed back.
    pub(super) returns: AtomicU64,
    /// The rest: forged, foreign, orphan returns, unreadable frames.
    pub(super) refused: AtomicU64,
    /// Its moves between the armed and the quiet EPT view.
    pub(super) switches: AtomicU64,
    /// Nanoseconds (the hit clock) on each view since its first move:
    /// closed stretches, then when the open one began ([`NOT_YET`]: no
    /// move yet) and on which view.
    pub(super) armed_ns: AtomicU64,
    pub(super) quiet_ns: AtomicU64,
    pub(super) since_ns: AtomicU64,
    pub(super) on_quiet: core::sync::atomic::AtomicBool,
}

/// `VcpuHits::since_ns` of a vCPU that never changed view.
pub(super) const NOT_YET: u64 = u64::MAX;

impl Default for VcpuHits {
    fn default() -> Self {
        VcpuHits {
            hits: AtomicU64::new(0),
            returns: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            switches: AtomicU64::new(0),
            armed_ns: AtomicU64::new(0),
            quiet_ns: AtomicU64::new(0),
            since_ns: AtomicU64::new(NOT_YET),
            on_quiet: core::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl VcpuHits {
    /// The vCPU moves to the quiet view (`quiet`) or the armed one at
    /// `now_ns`: the stretch on the other view closes.
    pub(super) fn switched(&self, quiet: bool, now_ns: u64) {
        add(&self.switches, 1);
        let since = self.since_ns.swap(now_ns, Relaxed);
        if since != NOT_YET {
            let was = if quiet {
                &self.armed_ns
            } else {
                &self.quiet_ns
            };
            add(was, now_ns.saturating_sub(since));
        }
        self.on_quiet.store(quiet, Relaxed);
    }

    /// Nanoseconds on the armed and on the quiet view at `now_ns`.
    pub(super) fn view_ns(&self, now_ns: u64) -> (u64, u64) {
        let (mut armed, mut quiet) = (self.armed_ns.load(Relaxed), self.quiet_ns.load(Relaxed));
        let since = self.since_ns.load(Relaxed);
        if since != NOT_YET {
            let open = now_ns.saturating_sub(since);
            if self.on_quiet.load(Relaxed) {
                quiet += open;
            } else {
                armed += open;
            }
        }
        (armed, quiet)
    }
}

/// A vCPU's hypercalls for `status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HypercallCounts {
    /// Entries from a hooked site, recorded.
    pub hits: u64,
    /// Returns through a frame, handed back.
    pub returns: u64,
    /// Forged, foreign, orphan returns, unreadable frames.
    pub refused: u64,
    /// Moves between the armed and the quiet EPT view.
    pub view_switches: u64,
    /// Nanoseconds on the armed and on the quiet view since the first
    /// move.
    pub armed_ns: u64,
    pub quiet_ns: u64,
    /// Whether it runs on the quiet view now.
    pub quiet: bool,
}

/// Adds `n` to a hit counter.
#[inline]
pub(super) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Relaxed);
}

impl HitStats {
    /// `report` with the hit path's counters filled in.
    pub(super) fn fill(&self, report: TracerReport) -> TracerReport {
        TracerReport {
            // Each vCPU counts its own; no counter shared by all on the
            // hit path.
            hits: self.vcpus.iter().map(|c| c.hits.load(Relaxed)).sum(),
            foreign_vmcalls: self.foreign_vmcalls.load(Relaxed),
            forged_entries: self.forged_entries.load(Relaxed),
            graph_misses: self.graph_misses.load(Relaxed),
            graph_dropped: self.graph_dropped.load(Relaxed),
            graph_orphans: self.graph_orphans.load(Relaxed),
            stack_lock_waits: self.stack_lock_waits.load(Relaxed),
            ..report
        }
    }
}
