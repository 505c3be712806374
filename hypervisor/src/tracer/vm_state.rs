//! The tracer's state that every vCPU shares: one per VM.

use super::fgraph::Graph;
use super::probes::Probes;
use super::region::Region;
use super::split::SplitView;
use protocol::TracerReport;

/// The trampoline region, the hooked sites and pages, the probes and the
/// function-graph sessions with their return stacks.
#[derive(Default)]
pub struct VmState {
    pub(super) region: Option<Region>,
    pub(super) view: SplitView,
    pub(super) probes: Probes,
    pub(super) graph: Graph,
    /// The counters for `status`. Kept per VM while there is one vCPU;
    /// the hit and step counters are the vCPU's to keep once there are
    /// more.
    pub(super) stats: TracerReport,
}
