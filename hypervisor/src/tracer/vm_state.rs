//! The tracer's state that every vCPU shares: one per VM.

use super::count::CountState;
use super::cpu_state::CpuState;
use super::fgraph::Graph;
use super::hit_stats::{HitStats, HypercallCounts, VcpuHits};
use super::machine::{CpuView, KernelView, View};
use super::modules::ModuleTrack;
use super::probes::Probes;
use super::quiet::QuietState;
use super::region::Region;
use super::split::SplitView;
use super::stream::Stream;
use core::sync::atomic::Ordering::Relaxed;
use protocol::TracerReport;

/// The trampoline region, the hooked sites and pages, the probes, the
/// function-graph sessions with their return stacks, and the stream with
/// every vCPU's ring.
///
/// Hits (the hypercalls) reach it through `&VmState`, several vCPUs at
/// once: what they change is behind a lock of its own (a vCPU's ring, the
/// return stacks) or atomic (the counters in [`HitStats`] and the probes').
/// Everything else changes only through `&mut VmState`, with no hit in
/// flight.
#[derive(Default)]
pub struct VmState {
    pub(super) region: Option<Region>,
    pub(super) view: SplitView,
    pub(super) probes: Probes,
    pub(super) graph: Graph,
    pub(super) stream: Stream,
    /// The counters for `status` that only requests, steps and turns
    /// change (the hit path's are in `hit`).
    pub(super) stats: TracerReport,
    /// The hit path's counters.
    pub(super) hit: HitStats,
    /// The hidden hooks that follow module loads and unloads.
    pub(super) modules: ModuleTrack,
    /// The call count, when one runs.
    pub(super) count: CountState,
    /// The quiet views: root's scheduler hook and the quiet pages.
    pub(super) quiet: QuietState,
    /// Root's TF left in guest contexts by steps ended by force.
    pub(super) stray: super::step::StrayTf,
}

impl VmState {
    /// The state of a VM with `cpus` vCPUs (a ring each).
    pub fn new(cpus: usize) -> Self {
        VmState {
            stream: Stream::new(cpus),
            hit: HitStats {
                vcpus: (0..cpus.max(1)).map(|_| VcpuHits::default()).collect(),
                ..HitStats::default()
            },
            ..VmState::default()
        }
    }

    /// vCPU `index`'s hypercalls, by what they were, and its views at
    /// `now_ns` (the hit clock).
    pub fn hypercalls_of(&self, index: usize, now_ns: u64) -> HypercallCounts {
        self.hit
            .vcpus
            .get(index)
            .map_or(HypercallCounts::default(), |c| {
                let (armed_ns, quiet_ns) = c.view_ns(now_ns);
                HypercallCounts {
                    hits: c.hits.load(Relaxed),
                    returns: c.returns.load(Relaxed),
                    refused: c.refused.load(Relaxed),
                    view_switches: c.switches.load(Relaxed),
                    armed_ns,
                    quiet_ns,
                    quiet: c.on_quiet.load(Relaxed),
                }
            })
    }

    /// The guest address of the entry trampoline's VMCALL, once the
    /// region is placed (the fast path's first check).
    pub fn entry_vmcall(&self) -> Option<u64> {
        self.region.as_ref()?.tramp.entry_vmcall().map(|g| g.0)
    }

    /// Records vCPU `index` lost (its ring was full, or a hit could not
    /// be recorded).
    pub fn lost_of(&self, index: usize) -> u64 {
        self.stream.rings.lost_of(index)
    }

    /// Picks the view for the vCPU's context as it is now: armed while the
    /// task it runs passes the filter of a session that filters by pid or
    /// comm, or while it is
    /// inside a root of a session the quiet view leaves unhooked (a frame of
    /// one on its stacks), or while no kernel is known; quiet otherwise (when
    /// no such session runs, both views hook the same).
    pub(super) fn pick_view(
        &self,
        state: &mut CpuState,
        kernel: Option<&dyn KernelView>,
        cpu: &CpuView,
        now_ns: u64,
    ) {
        let users = self.arming_users();
        let inside = match (users, kernel) {
            (0, _) => false,
            (_, None) => true,
            (_, Some(k)) => match k.current(cpu) {
                // The task is not known: hooked everywhere is always safe.
                None => true,
                Some(r) => {
                    let filtering = users & self.graph.filter_users();
                    (filtering != 0 && self.graph.admitted_by(filtering, r.pid, &r.comm)) || {
                        let stack = k.task_stack(r.task);
                        self.graph
                            .inside_roots(users, cpu, stack, k.cpu_number(cpu), &self.hit)
                    }
                }
            },
        };
        let view = if inside || users == 0 {
            View::Armed
        } else {
            View::Quiet
        };
        self.set_view(state, view, now_ns);
    }

    /// Moves the vCPU to `view` (root switches its EPT pointer when it
    /// resumes the guest), counting the move.
    #[inline]
    pub(super) fn set_view(&self, state: &mut CpuState, view: View, now_ns: u64) {
        if state.view == view {
            return;
        }
        state.view = view;
        if let Some(c) = self.hit.vcpus.get(state.index) {
            c.switched(view == View::Quiet, now_ns);
        }
    }
}
