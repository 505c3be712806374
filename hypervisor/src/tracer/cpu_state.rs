//! The tracer's state that belongs to one vCPU.

use super::machine::View;
use super::modules::ModuleEvent;
use super::step::Stepper;
use crate::stats::RootWork;
use alloc::vec::Vec;
use guest_introspect::paging::WalkCache;

/// The vCPU's number, its single step and its scratch for encoding a
/// record (its ring is in the VM's stream, which merges every vCPU's).
pub struct CpuState {
    /// Root's index of the vCPU (0: the boot processor): its ring.
    pub(super) index: usize,
    pub(super) step: Stepper,
    /// Scratch for one encoded record.
    pub(super) record: Vec<u8>,
    /// The fetched values of the last hit, whose room and strings' buffers
    /// the next one reuses.
    pub(super) values: Vec<tracelang::kprobe::FetchedValue>,
    /// A module load or unload seen at a hidden hook by this vCPU's last
    /// hypercall, for the exit handler to serve before the vCPU enters
    /// the guest again.
    pub(super) module_event: Option<ModuleEvent>,
    /// The last hypercall entered a call the count times (`latency`).
    pub(super) timed_entry: bool,
    /// The EPT view the vCPU is to run on (root moves it there after each
    /// hypercall; see `super::quiet`).
    pub(super) view: View,
    /// The quiet views' epoch it last picked its view at a turn for
    /// (`super::quiet::QuietState::epoch`).
    pub(super) epoch: u64,
    /// Recent translations for the hit's reads of the guest stack (the
    /// `pt_regs` frame, the parent): flushed at every turn
    /// ([`WalkCache`] says why that is enough).
    pub(super) walks: WalkCache,
    /// What the last hypercall was, until root takes it to account for
    /// its time.
    pub(super) served: Option<RootWork>,
    /// The kernel's GS base on this vCPU (GUEST_GS_BASE at CPL 0, the CPU's
    /// per-CPU area) as a hit last read it, kept until the next turn: one
    /// read of the field per turn rather than per recorded hit (under
    /// nested KVM each is an exit). A guest that moves it meanwhile has
    /// its next records name the task as the per-CPU area it left says.
    pub(super) kernel_gs: Option<u64>,
}

impl CpuState {
    /// The state of vCPU `index`.
    pub fn new(index: usize) -> Self {
        CpuState {
            index,
            step: Stepper::default(),
            record: Vec::with_capacity(512),
            values: Vec::new(),
            module_event: None,
            timed_entry: false,
            view: View::Armed,
            epoch: 0,
            walks: WalkCache::default(),
            served: None,
            kernel_gs: None,
        }
    }
    /// The kernel's GS base as this turn's hits read it, if one did.
    pub fn kernel_gs(&self) -> Option<u64> {
        self.kernel_gs
    }

    /// Keeps the kernel's GS base a hit read (GUEST_GS_BASE at CPL 0)
    /// until the next turn.
    pub fn keep_kernel_gs(&mut self, base: u64) {
        self.kernel_gs = Some(base);
    }

    /// The EPT view the vCPU is to run on.
    pub fn view(&self) -> View {
        self.view
    }

    /// Whether the last hypercall entered a call the count times: a turn
    /// then waits for a later exit, since its work would count in the
    /// call's time (the call's clock was read on the entry).
    pub fn timed_entry(&self) -> bool {
        self.timed_entry
    }

    /// What the last hypercall was (a hit, a return, refused), once.
    pub fn take_served(&mut self) -> Option<RootWork> {
        self.served.take()
    }

    /// Whether the last hypercall saw a module load or unload.
    pub fn has_module_event(&self) -> bool {
        self.module_event.is_some()
    }

    /// The module load or unload the last hypercall saw, if any (see
    /// [`super::modules`]).
    pub fn take_module_event(&mut self) -> Option<ModuleEvent> {
        self.module_event.take()
    }
}

impl Default for CpuState {
    fn default() -> Self {
        CpuState::new(0)
    }
}
