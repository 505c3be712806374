//! The tracer's state that every vCPU shares: one per VM.

use super::fgraph::Graph;
use super::probes::Probes;
use super::region::Region;
use super::split::SplitView;
use super::stream::Stream;
use protocol::TracerReport;

/// The trampoline region, the hooked sites and pages, the probes, the
/// function-graph sessions with their return stacks, and the stream with
/// every vCPU's ring.
#[derive(Default)]
pub struct VmState {
    pub(super) region: Option<Region>,
    pub(super) view: SplitView,
    pub(super) probes: Probes,
    pub(super) graph: Graph,
    pub(super) stream: Stream,
    /// The counters for `status`, summed over the vCPUs.
    pub(super) stats: TracerReport,
}

impl VmState {
    /// The state of a VM with `cpus` vCPUs (a ring each).
    pub fn new(cpus: usize) -> Self {
        VmState {
            stream: Stream::new(cpus),
            ..VmState::default()
        }
    }

    /// Records vCPU `index` lost (its ring was full, or a hit could not
    /// be recorded).
    pub fn lost_of(&self, index: usize) -> u64 {
        self.stream.rings.lost_of(index)
    }
}
