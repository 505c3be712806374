//! One vCPU's state in root: its registers, its exit and guard counters,
//! its preemption-timer turns, the events it delivers at the next entry,
//! and its half of the tracer (ring, step). Nothing here is shared with
//! another vCPU; what is lives in [`crate::vm::Vm`].

use hypervisor::stats::ExitCounters;
use hypervisor::tracer;
use hypervisor::tracer::machine::View;
use hypervisor::vmx::event::Event;
use hypervisor::vmx::regs::GuestRegs;
use protocol::GuardReport;

/// A vCPU's state across exits.
pub struct CpuState {
    /// Root's index of this vCPU (0: the boot processor); also its slot in
    /// [`crate::vm::Vm::cpus`].
    pub index: usize,
    /// Whether this CPU's VMCS has been launched (VMRESUME from then on).
    pub launched: bool,
    /// The HOST_RSP its VMCS holds (0 before the first entry), written
    /// by `vmx_run` only when it changes.
    pub host_rsp: u64,
    /// The hypercall being served, and the TSC at its exit (moved on by
    /// the length of any turn taken before the next entry), until that
    /// entry accounts for it (`vcpu::ROOT_TIME`).
    pub pending_time: Option<(hypervisor::stats::RootWork, u64)>,
    /// TSC ticks spent waiting for the VM lock, and how often it was taken.
    pub lock_wait_ticks: u64,
    pub lock_takes: u64,
    /// TSC ticks spent waiting for the VM lock's shared side (the tracer's
    /// hypercalls), and how often it was taken.
    pub shared_wait_ticks: u64,
    pub shared_takes: u64,
    /// Guest APIC stores root could not decode, and start-up IPIs to the
    /// boot processor, refused.
    pub apic_refused: u64,
    /// Entries on which root cleared the blocking-by-SMI bit that Bochs
    /// 2.7 leaves in an AP's interruptibility state.
    pub smi_blocking_cleared: u64,
    /// This vCPU's two EPT views' pointers (armed, quiet), and the one its
    /// VMCS has (the one the tracer last named for it).
    pub eptps: [u64; 2],
    pub view: View,
    /// TSC ticks spent held in root while another vCPU had the world
    /// stopped (`crate::world`).
    pub held_ticks: u64,
    /// The APIC page whose guest stores exit (0: not protected, one vCPU).
    pub lapic_base: u64,
    /// Exits handled without the VM lock.
    pub local_exits: u64,
    /// Parked in wait-for-SIPI (an AP before its start or after an INIT):
    /// no event may be injected.
    pub parked: bool,
    /// The raw TSC at the last turn (the exits handled without the lock
    /// look at it; root's monotonic clock is the VM's, behind the lock).
    pub last_turn_tsc: u64,
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
    /// Whether external interrupts exit (only while a step is armed).
    pub irq_exits: bool,
    /// The event this exit's handler wants delivered at the next entry.
    pub inject: Option<Event>,
    /// The event whose delivery the last exit interrupted.
    pub vectoring: Option<Event>,
    /// Whether NMI-window exiting is on in the VMCS.
    pub nmi_window: bool,
    /// The tracer's per-vCPU state: event ring, stream, step.
    pub tracer: tracer::CpuState,
    /// The log port's frames the boot processor writes outside the VM
    /// lock, and what it wrote until the control channel counts it the
    /// next time it holds the lock.
    pub bulk: crate::control::QueuedBulk,
}

impl CpuState {
    /// Invalidates the cached translations of both its views, each
    /// before the vCPU next enters on it (`crate::world::entering_guest`).
    pub fn invalidate_views(&self) {
        crate::world::own_views_changed(self.index);
    }

    /// The EPT pointer of its view `view`.
    pub fn eptp_of(&self, view: View) -> u64 {
        match view {
            View::Armed => self.eptps[0],
            View::Quiet => self.eptps[1],
        }
    }

    /// The state of vCPU `index` before its first entry.
    pub fn new(index: usize) -> Self {
        CpuState {
            index,
            launched: false,
            host_rsp: 0,
            pending_time: None,
            lock_wait_ticks: 0,
            lock_takes: 0,
            shared_wait_ticks: 0,
            shared_takes: 0,
            apic_refused: 0,
            smi_blocking_cleared: 0,
            bulk: Default::default(),
            eptps: [0; 2],
            view: View::Armed,
            held_ticks: 0,
            lapic_base: 0,
            local_exits: 0,
            parked: index != 0,
            last_turn_tsc: 0,
            regs: GuestRegs::default(),
            counters: ExitCounters::new(),
            guard: GuardReport::default(),
            timer: 0,
            last_turn: 0,
            turn_ticks: u64::MAX,
            debug_exits: false,
            irq_exits: false,
            inject: None,
            vectoring: None,
            nmi_window: false,
            tracer: tracer::CpuState::new(index),
        }
    }
}
