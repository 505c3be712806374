//! One vCPU's state in root: its registers, its exit and guard counters,
//! its preemption-timer turns, the events it delivers at the next entry,
//! and its half of the tracer (ring, step). Nothing here is shared with
//! another vCPU; what is lives in [`crate::vm::Vm`].

use hypervisor::stats::ExitCounters;
use hypervisor::tracer;
use hypervisor::vmx::event::Event;
use hypervisor::vmx::regs::GuestRegs;
use protocol::GuardReport;

/// A vCPU's state across exits.
pub struct CpuState {
    pub regs: GuestRegs,
    pub counters: ExitCounters,
    /// What root refused or emulated for this vCPU.
    pub guard: GuardReport,
    /// The preemption-timer value currently in the VMCS.
    pub timer: u32,
    /// TSC at the last turn, and the turn period in TSC ticks: a guest that
    /// exits so often that the preemption timer (which counts guest time
    /// only) rarely expires still gets turns (every traced call exits).
    pub last_turn: u64,
    pub turn_ticks: u64,
    /// Whether #DB is in the exception bitmap.
    pub debug_exits: bool,
    /// The event this exit's handler wants delivered at the next entry.
    pub inject: Option<Event>,
    /// The event whose delivery the last exit interrupted.
    pub vectoring: Option<Event>,
    /// Whether NMI-window exiting is on in the VMCS.
    pub nmi_window: bool,
    /// The tracer's per-vCPU state: event ring, stream, step.
    pub tracer: tracer::CpuState,
}

impl Default for CpuState {
    fn default() -> Self {
        CpuState {
            regs: GuestRegs::default(),
            counters: ExitCounters::new(),
            guard: GuardReport::default(),
            timer: 0,
            last_turn: 0,
            turn_ticks: u64::MAX,
            debug_exits: false,
            inject: None,
            vectoring: None,
            nmi_window: false,
            tracer: tracer::CpuState::default(),
        }
    }
}
