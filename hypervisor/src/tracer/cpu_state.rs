//! The tracer's state that belongs to one vCPU.

use super::step::Stepper;
use alloc::vec::Vec;

/// The vCPU's number, its single step and its scratch for encoding a
/// record (its ring is in the VM's stream, which merges every vCPU's).
pub struct CpuState {
    /// Root's index of the vCPU (0: the boot processor): its ring.
    pub(super) index: usize,
    pub(super) step: Stepper,
    /// Scratch for one encoded record.
    pub(super) record: Vec<u8>,
}

impl CpuState {
    /// The state of vCPU `index`.
    pub fn new(index: usize) -> Self {
        CpuState {
            index,
            step: Stepper::default(),
            record: Vec::with_capacity(512),
        }
    }
}

impl Default for CpuState {
    fn default() -> Self {
        CpuState::new(0)
    }
}
