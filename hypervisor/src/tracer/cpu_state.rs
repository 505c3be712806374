//! The tracer's state that belongs to one vCPU.

use super::step::Stepper;
use super::stream::Stream;

/// The vCPU's event ring and stream, and its single step.
#[derive(Default)]
pub struct CpuState {
    pub(super) stream: Stream,
    pub(super) step: Stepper,
}
