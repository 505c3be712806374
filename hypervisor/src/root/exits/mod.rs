//! The run loop and the exit handlers of the vCPU. Each exit is read once
//! into a `RawExit`, decoded into a `VmExit`, counted, and handled here.

use crate::arch::instructions::{self as insn, RunOutcome};
use crate::control::{Action, StatusSource};
use crate::cpu_state::CpuState;
use crate::hvprintln;
use crate::introspect::{CpuView, GuestRam, KernelView};
use crate::machine::{with_env, with_env_clocked, with_world};
use crate::phys;
use crate::ports::{forward_in, forward_out, pci_data_write, pci_read, pci_write};
use crate::vcpu::Vmcs;
use crate::vm::{HitView, Vm};
use alloc::vec::Vec;
use core::fmt;
use guest_introspect::paging::{self, Cr3, WalkError};
use hypervisor::addr::Gva;
use hypervisor::pci;
use hypervisor::policy;
use hypervisor::stats::RootWork;
use hypervisor::task_switch::LegacyPaging;
use hypervisor::tracer::machine::{GuestGs, View};
use hypervisor::tracer::modules::{ModuleEvent, ModuleHook};
use hypervisor::tracer::{Hit, Hypercall, Tracer, Violation};
use hypervisor::vmx::ap;
use hypervisor::vmx::cr::gpr;
use hypervisor::vmx::debug;
use hypervisor::vmx::entry::{self, Pending};
use hypervisor::vmx::event::{self, Event};
use hypervisor::vmx::exit::{decode, reason_name, CrAccess, IoAccess, VmExit};
use hypervisor::vmx::fields::{self as f, VmcsError, VmcsIo};
use hypervisor::vmx::handle::{self, HostCpu, MsrRefused, Outcome, DB, GP, UD};
use hypervisor::vmx::route::{self, Early, Late};
use protocol::GuardReport;

/// Why the guest stopped.
#[derive(Debug, Clone, Copy)]
pub enum StopReason {
    /// The guest wrote SLP_EN to an ACPI PM1 control port.
    PowerOff { port: u16, value: u32, size: u8 },
    /// Triple fault: the guest is dead.
    TripleFault,
    /// INIT: the guest reset the machine.
    Reset,
    /// VM entry failed.
    EntryFailed,
    /// An exit we cannot handle.
    Unhandled(u16),
    /// A VMCS access failed.
    Vmcs(VmcsError),
    /// The guest touched memory that is not its own.
    EptViolation { gpa: u64 },
    /// EPT misconfiguration (a hypervisor bug).
    EptMisconfig { gpa: u64 },
    /// The host asked for it over the control channel.
    HostStop,
}

impl fmt::Display for StopReason {
    fn fmt(&self, fm: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PowerOff { .. } => write!(fm, "power off"),
            Self::TripleFault => write!(fm, "triple fault"),
            Self::Reset => write!(fm, "reset"),
            Self::EntryFailed => write!(fm, "VM entry failed"),
            Self::Unhandled(r) => write!(fm, "unhandled exit {} ({r})", reason_name(*r)),
            Self::Vmcs(e) => write!(fm, "{e}"),
            Self::EptViolation { gpa } => write!(fm, "EPT violation at guest-physical {gpa:#x}"),
            Self::EptMisconfig { gpa } => {
                write!(fm, "EPT misconfiguration at guest-physical {gpa:#x}")
            }
            Self::HostStop => write!(fm, "stopped by the host"),
        }
    }
}

impl From<VmcsError> for StopReason {
    fn from(e: VmcsError) -> Self {
        Self::Vmcs(e)
    }
}

/// What a handler wants next.
enum Next {
    /// Re-enter the guest.
    Resume,
    /// Stop the VM.
    Stop(StopReason),
}

/// The host CPU, for the exits policy answers.
struct RootCpu;

impl HostCpu for RootCpu {
    fn cpuid(&self, leaf: u32, subleaf: u32) -> [u32; 4] {
        insn::cpuid(leaf, subleaf)
    }
    fn feature_control(&self) -> u64 {
        // SAFETY: IA32_FEATURE_CONTROL exists on every VMX CPU.
        unsafe { insn::rdmsr(policy::MSR_FEATURE_CONTROL) }
    }
    fn write_msr(&mut self, msr: u32, value: u64) -> Result<(), MsrRefused> {
        // SAFETY: policy forwards only IA32_APIC_BASE, with a base outside
        // hypervisor memory (root uses no APIC), and 0 (off) to
        // IA32_PEBS_ENABLE, IA32_DS_AREA and IA32_RTIT_CTL; a value the
        // CPU refuses (or an MSR it lacks) is a #GP for the guest.
        unsafe { insn::wrmsr_safe(msr, value) }.map_err(|()| MsrRefused)
    }
    fn xsetbv(&mut self, xcr: u32, value: u64) {
        // SAFETY: every rule of the SDM for XCR0 holds (see
        // `policy::xsetbv_valid`, checked by the caller); VMX root set
        // CR4.OSXSAVE when XSAVE exists.
        unsafe { insn::xsetbv(xcr, value) };
    }
}

/// The vCPU at work: the VM's state and its own, which the exit handlers
/// below read and change. The two live in separate types ([`Vm`],
/// [`CpuState`]) so that what an SMP guest shares is plain.
pub struct Vcpu<'a> {
    pub vm: &'a mut Vm,
    pub cpu: &'a mut CpuState,
}

/// The tracer over the VM's state and the vCPU's.
macro_rules! tracer {
    ($v:expr) => {
        Tracer::new(&mut $v.vm.tracer, &mut $v.cpu.tracer)
    };
}

/// Local exits between two looks at the clock under the VM lock (the
/// look itself is cheap; the lock is not).
const LOCAL_EXITS_PER_CHECK: u64 = 64;
/// At most this many busy turns are spent draining output before a stop.
const STOP_DRAIN_TURNS: u32 = 500;

const RFLAGS_TF: u64 = 1 << 8;
/// DR7's local breakpoint enables, L0..L3 (bits 0, 2, 4, 6).
const DR7_LOCAL_ENABLES: u64 = 0x55;
/// DR6.BT: the #DB comes from a task switch into a TSS with its T flag set.
const DR6_BT: u64 = 1 << 15;
/// #PF.
const PF: u8 = 14;
/// Primary processor-based control bit 22: NMI-window exiting.
const NMI_WINDOW_EXITING: u32 = 1 << 22;
/// IA32_APIC_BASE bit 10: x2APIC mode.
const APIC_BASE_EXTD: u64 = 1 << 10;

/// Pin-based control bit 0: external-interrupt exiting.
const PIN_EXTERNAL_INTERRUPT_EXITING: u32 = 1;

/// Whether this CPU lets external-interrupt exiting be set (its
/// pin-based capability's allowed-1 half), read once.
fn irq_exiting_allowed() -> bool {
    static ALLOWED: spin::Once<bool> = spin::Once::new();
    *ALLOWED.call_once(|| {
        // SAFETY: the VMX capability MSRs exist on every CPU root runs on
        // (VMXON succeeded); reading them has no side effect.
        let basic = unsafe { insn::rdmsr(x86::msr::IA32_VMX_BASIC) };
        let msr = if basic & (1 << 55) != 0 {
            x86::msr::IA32_VMX_TRUE_PINBASED_CTLS
        } else {
            x86::msr::IA32_VMX_PINBASED_CTLS
        };
        // SAFETY: as above.
        let caps = unsafe { insn::rdmsr(msr) };
        (caps >> 32) as u32 & PIN_EXTERNAL_INTERRUPT_EXITING != 0
    })
}

/// Fills the entry's event-injection fields (see
/// [`hypervisor::vmx::entry::prepare_entry`]), with the NMI that root's
/// own handler queued for this CPU.
fn prepare_entry(cpu: &mut CpuState) -> Result<(), VmcsError> {
    if cpu.index != 0 {
        // Bochs 2.7 saves blocking by SMI in an AP's exits once it has
        // been in wait-for-SIPI (not only in the SIPI exit), and refuses
        // the next entry on it (see `hypervisor::vmx::ap`): checked before
        // every entry of an AP (a shadowed field under KVM).
        let intr = f::GUEST_INTERRUPTIBILITY.read(&Vmcs)?;
        if intr & ap::BLOCKING_BY_SMI != 0 {
            f::GUEST_INTERRUPTIBILITY.write(&mut Vmcs, intr & !ap::BLOCKING_BY_SMI)?;
            cpu.smi_blocking_cleared += 1;
        }
    }
    if cpu.parked {
        // Wait-for-SIPI takes no event (SDM 27.3.1.5), and blocks NMIs.
        cpu.inject = None;
        cpu.vectoring = None;
        crate::fatal::take_nmi(cpu.index);
        return Ok(());
    }
    let nmi = crate::fatal::nmi_pending(cpu.index);
    if cpu.inject.is_none() && cpu.vectoring.is_none() && !cpu.nmi_window && !nmi {
        // The common entry (every hit's): nothing to deliver, no window.
        return Ok(());
    }
    let mut pending = Pending {
        inject: cpu.inject.take(),
        vectoring: cpu.vectoring.take(),
        nmi_window: cpu.nmi_window,
    };
    let done = entry::prepare_entry(&mut Vmcs, &mut pending, nmi);
    // Whatever was not written stays for the next entry.
    cpu.inject = pending.inject;
    cpu.vectoring = pending.vectoring;
    cpu.nmi_window = pending.nmi_window;
    let done = done?;
    if done.nmi_delivered {
        crate::fatal::take_nmi(cpu.index);
        cpu.guard.nmis_injected += 1;
    }
    if done.reinjected {
        cpu.guard.events_reinjected += 1;
    }
    Ok(())
}

/// Runs vCPU `cpu` until the VM stops: enter, read the exit, take the VM
/// lock, handle the exit, let the lock go, enter again.
pub fn run(cpu: &mut CpuState) -> StopReason {
    let shared = crate::vm::shared();
    let eptp = match f::EPT_POINTER.read(&Vmcs) {
        Ok(e) => e,
        Err(e) => return e.into(),
    };
    cpu.eptps = crate::vcpu::eptps(cpu.index).unwrap_or([eptp; 2]);
    cpu.view = View::Armed;
    if cpu.index == 0 {
        let mut vm = shared.lock(&mut cpu.lock_wait_ticks);
        if let Err(e) = (Vcpu { vm: &mut vm, cpu }).service() {
            return e.into();
        }
    }
    'run: loop {
        if let Err(e) = prepare_entry(cpu) {
            return e.into();
        }
        cpu.held_ticks = cpu.held_ticks.saturating_add(crate::world::entering_guest(
            cpu.index, cpu.eptps, cpu.view, cpu.parked,
        ));
        if let Some((work, exit_tsc)) = cpu.pending_time.take() {
            if let Some(t) = crate::vcpu::root_time(cpu.index, work) {
                t.add(insn::rdtsc().wrapping_sub(exit_tsc));
            }
        }
        let host_rsp = cpu.host_rsp;
        // SAFETY: `vcpu::setup` or `vcpu::setup_ap` filled the current
        // VMCS completely; `cpu.host_rsp` is this VMCS's HOST_RSP (0
        // before its first entry), and only `vmx_run` writes HOST_RSP and
        // HOST_RIP.
        let outcome = unsafe { insn::vmx_run(&mut cpu.regs, cpu.launched, &mut cpu.host_rsp) };
        let exit_tsc = insn::rdtsc();
        if cpu.host_rsp != host_rsp {
            crate::vcpu::NestedCost::add(cpu.index, 2, 0);
        }
        // With other vCPUs, the world's holds want RIP at every exit: a
        // VMCALL's handler takes it from here (one VMREAD per exit).
        let mut exit_rip = None;
        crate::world::left_guest(cpu.index, || {
            exit_rip = f::GUEST_RIP.read(&Vmcs).ok();
            exit_rip.unwrap_or(0)
        });
        if let RunOutcome::EntryFailed(e) = outcome {
            let err = f::VM_INSTRUCTION_ERROR.read(&Vmcs).unwrap_or(0);
            hvprintln!(
                "error: vCPU {}: {} failed: {e:?}, VM-instruction error {err}",
                cpu.index,
                if cpu.launched { "VMRESUME" } else { "VMLAUNCH" }
            );
            dump_vmcs();
            return StopReason::EntryFailed;
        }
        cpu.launched = true;
        let reason = match f::EXIT_REASON.read(&Vmcs) {
            Ok(r) => r,
            Err(e) => return e.into(),
        };
        cpu.counters.record(reason as u16);
        let (exit, timer) = 'exit: {
            if reason as u16 == hypervisor::vmx::exit::reason::VMCALL {
                match vmcall_exit(shared, cpu, exit_tsc, exit_rip) {
                    Ok(Next::Resume) => {}
                    Ok(Next::Stop(r)) => return r,
                    Err(e) => return e.into(),
                }
                // A module load or unload seen at a hidden hook is served
                // below, under the whole lock, before the vCPU enters
                // again; a turn may be due too, unless the hypercall
                // entered a call the count times (the call's return, or
                // the timer, takes the turn then).
                if !cpu.tracer.has_module_event() && (!turn_due(cpu) || cpu.tracer.timed_entry()) {
                    continue 'run;
                }
                break 'exit (None, false);
            }
            let raw = match entry::read_exit_of(&Vmcs, reason, &cpu.regs) {
                Ok(r) => r,
                Err(e) => return e.into(),
            };
            cpu.vectoring = match entry::read_vectoring_of(&Vmcs, &raw) {
                Ok(e) => e,
                Err(e) => return e.into(),
            };
            let exit = decode(&raw);
            let timer = matches!(exit, VmExit::PreemptionTimer);
            // Exits that touch nothing shared are handled without the VM
            // lock.
            let exit = match local_exit(cpu, exit) {
                Local::Done(Ok(Next::Resume)) => {
                    // Turns are due on this path too: a vCPU whose exits are
                    // all local (an idle CPU taking interrupts, whose EOIs
                    // exit) may see its preemption timer expire rarely.
                    cpu.local_exits += 1;
                    if !turn_due(cpu) && !cpu.local_exits.is_multiple_of(LOCAL_EXITS_PER_CHECK) {
                        continue 'run;
                    }
                    None
                }
                Local::Done(Ok(Next::Stop(r))) => return r,
                Local::Done(Err(e)) => return e.into(),
                Local::Shared(exit, policy_done) => Some((exit, policy_done)),
            };
            (exit, timer)
        };
        let module_event = cpu.tracer.has_module_event();
        let mut vm = if (timer || exit.is_none()) && cpu.index != 0 && !module_event {
            // An AP's turn (its timer's, or one due after a local exit or
            // a hit) only re-arms its timer and looks at its mailbox: when
            // another vCPU's exit handler holds the lock (the boot
            // processor serving a long request, rendering the stream, or
            // recovering the kernel), the turn waits for a later one
            // rather than the AP for the lock. Hits inside are waited for
            // (each is one hypercall, and none enters meanwhile).
            match shared.lock_for_turn(&mut cpu.lock_wait_ticks) {
                Some(g) => g,
                None => continue,
            }
        } else {
            shared.lock(&mut cpu.lock_wait_ticks)
        };
        cpu.lock_takes += 1;
        if let Some(slot) = vm.cpus.get_mut(cpu.index) {
            slot.counters.clone_from(&cpu.counters);
            slot.lock_wait_ticks = cpu.lock_wait_ticks;
            slot.lock_takes = cpu.lock_takes;
            slot.shared_wait_ticks = cpu.shared_wait_ticks;
            slot.shared_takes = cpu.shared_takes;
            slot.held_ticks = cpu.held_ticks;
        }
        let mut v = Vcpu { vm: &mut vm, cpu };
        let now = v.vm.clock.update(insn::rdtsc());
        let stop = 'tail: {
            if let Some((exit, policy_done)) = exit {
                match v.handle(exit, policy_done) {
                    Ok(Next::Resume) => {}
                    Ok(Next::Stop(r)) => break 'tail Some(r),
                    Err(e) => break 'tail Some(e.into()),
                }
            }
            if let Some(ev) = v.cpu.tracer.take_module_event() {
                if let Err(e) = v.module_event(ev) {
                    break 'tail Some(e.into());
                }
            }
            if !timer && now.saturating_sub(v.cpu.last_turn) > v.cpu.turn_ticks {
                match v.service() {
                    Ok(Next::Resume) => {}
                    Ok(Next::Stop(r)) => break 'tail Some(r),
                    Err(e) => break 'tail Some(e.into()),
                }
            }
            if let Err(e) = v.ap_mailbox() {
                break 'tail Some(e.into());
            }
            None
        };
        if let Some(r) = stop {
            // The boot processor's last frames (the turn that stopped the
            // VM queued some) go out now, under the lock.
            if cpu.index == 0 {
                if let Some(c) = vm.control.as_mut() {
                    c.settle(&mut cpu.bulk);
                    c.write_queued();
                }
            }
            return r;
        }
        // The boot processor writes the log port's queued frames after it
        // lets the VM lock go: the other vCPUs' hits run meanwhile (the
        // frames' encoding is most of a drain). It alone takes them, so
        // they reach the port in their order.
        let queued = cpu.index == 0
            && vm.control.as_mut().is_some_and(|c| {
                c.settle(&mut cpu.bulk);
                c.take_queued(&mut cpu.bulk)
            });
        drop(vm);
        if queued {
            cpu.bulk.write();
        }
    }
}

/// Whether a turn period has passed since the vCPU's last turn, by the
/// raw TSC. A TSC the guest set back reads as a turn due (the difference
/// wraps), and the turn starts the count again from there.
fn turn_due(cpu: &CpuState) -> bool {
    hypervisor::turns::due(insn::rdtsc(), cpu.last_turn_tsc, cpu.turn_ticks)
}

/// Where an exit is handled.
enum Local {
    /// Handled on the vCPU alone.
    Done(Result<Next, VmcsError>),
    /// Needs the VM's shared state (and its lock); `true` when the policy
    /// of [`handle::handle`] has already looked at it.
    Shared(VmExit, bool),
}

/// Handles the exits that need nothing shared, on the vCPU alone: the
/// policy exits (CPUID, MSR reads, XSETBV, VMX instructions, NMIs, triple
/// fault, INIT of the boot processor) and the guest's stores to the APIC
/// page other than the interrupt command register. Everything else goes to
/// [`Vcpu::handle`] under the VM lock.
fn local_exit(cpu: &mut CpuState, exit: VmExit) -> Local {
    match exit {
        // Root's own: start-up IPIs, MSR writes (the APIC base and the
        // x2APIC ICR among them), turns, the tracer's EPT.
        VmExit::Init | VmExit::Sipi { .. } | VmExit::MsrWrite { .. } | VmExit::PreemptionTimer => {
            return Local::Shared(exit, false)
        }
        VmExit::EptViolation(e) => {
            let page = e.gpa & !0xfff;
            let offset = e.gpa & 0xfff;
            if e.write && cpu.lapic_base != 0 && page == cpu.lapic_base {
                if offset & 0xf != 0 {
                    // APIC registers are 16-byte aligned words: a store
                    // elsewhere is refused, never carried out (it could
                    // reach the ICR behind root's back).
                    return Local::Done(Ok(refuse_store(cpu)));
                }
                if offset != hypervisor::apic::XAPIC_ICR_LOW {
                    return Local::Done(apic_store(cpu, offset));
                }
            }
            return Local::Shared(exit, false);
        }
        _ => {}
    }
    match handle::handle(exit, &mut cpu.regs, &mut RootCpu, &mut cpu.guard) {
        Outcome::Advance => Local::Done(entry::advance(&mut Vmcs).map(|()| Next::Resume)),
        Outcome::Inject(e) => {
            cpu.inject = Some(e);
            Local::Done(Ok(Next::Resume))
        }
        Outcome::Resume => Local::Done(Ok(Next::Resume)),
        Outcome::Nmi => {
            // The NMI is the guest's; root's IDT handler marks it pending,
            // and its IRET unblocks NMIs in root.
            crate::fatal::nmi_exit(cpu.index);
            Local::Done(Ok(Next::Resume))
        }
        Outcome::TripleFault => Local::Done(Ok(Next::Stop(StopReason::TripleFault))),
        Outcome::Reset => Local::Done(Ok(Next::Stop(StopReason::Reset))),
        Outcome::Root(exit) => Local::Shared(exit, true),
    }
}

impl Vcpu<'_> {
    fn cpu_view(&self) -> Result<CpuView, VmcsError> {
        cpu_view()
    }

    fn now_ns(&self) -> u64 {
        crate::clock::tsc_to_ns(self.vm.clock.now(), self.vm.tsc_hz)
    }

    /// Skips the instruction that exited (see
    /// [`hypervisor::vmx::entry::advance`]).
    fn advance(&mut self) -> Result<Next, VmcsError> {
        entry::advance(&mut Vmcs)?;
        Ok(Next::Resume)
    }

    /// Injects a hardware exception at the faulting instruction (SDM 26.6)
    /// at the next entry.
    fn inject(&mut self, vector: u8, error_code: Option<u32>) -> Result<Next, VmcsError> {
        self.cpu.inject = Some(Event::exception(vector, error_code));
        Ok(Next::Resume)
    }

    fn handle(&mut self, exit: VmExit, policy_done: bool) -> Result<Next, VmcsError> {
        let ctx = route::Context {
            ap: self.cpu.index != 0,
            vcpus: self.vm.cpus.len(),
            lapic: self.cpu.lapic_base,
            vm_lapic: self.vm.lapic_base,
            windows: self.vm.windows,
        };
        if let Some(early) = route::early(&exit, &ctx) {
            return self.early(early);
        }
        let outcome = if policy_done {
            Outcome::Root(exit)
        } else {
            handle::handle(exit, &mut self.cpu.regs, &mut RootCpu, &mut self.cpu.guard)
        };
        let exit = match outcome {
            Outcome::Advance => return self.advance(),
            Outcome::Inject(e) => {
                self.cpu.inject = Some(e);
                return Ok(Next::Resume);
            }
            Outcome::Resume => return Ok(Next::Resume),
            Outcome::Nmi => {
                // The NMI is the guest's; root's IDT handler marks it
                // pending, and its IRET unblocks NMIs in root.
                crate::fatal::nmi_exit(self.cpu.index);
                return Ok(Next::Resume);
            }
            Outcome::TripleFault => return Ok(Next::Stop(StopReason::TripleFault)),
            Outcome::Reset => return Ok(Next::Stop(StopReason::Reset)),
            Outcome::Root(exit) => exit,
        };
        match route::late(&exit) {
            Late::Cr(access) => self.cr_access(access),
            Late::Io(io) => self.io(io),
            Late::TaskSwitch(qualification) => self.task_switch(qualification),
            Late::Vmcall => self.vmcall(),
            Late::Debug(info) => self.debug_exception(info),
            Late::ExternalInterrupt => self.interrupt_in_step(),
            Late::Timer => self.service(),
            Late::EptViolation(e) => {
                match with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
                    tracer!(self).on_violation(e.gpa, e.write, e.fetch, env)
                }) {
                    Violation::Stepping => {
                        self.clear_stale_step()?;
                        self.arm_step()
                    }
                    // The instruction already being stepped opened one more page.
                    Violation::Widened => {
                        self.clear_stale_step()?;
                        Ok(Next::Resume)
                    }
                    Violation::FetchRefused { ended_tf } => {
                        // The step that ended had set TF: the guest's own
                        // goes back before #UD is delivered.
                        if let Some(tf) = ended_tf {
                            self.restore_guest_tf(tf)?;
                        }
                        self.inject(UD, None)
                    }
                    Violation::NotOurs => self.bad_violation(e),
                }
            }
            Late::Stop => self.stop_on(exit),
        }
    }

    /// Carries out an exit root takes before the policy exits
    /// ([`route::early`]).
    fn early(&mut self, early: Early) -> Result<Next, VmcsError> {
        match early {
            Early::ApSipi => {
                // Root's own SIPIs carry the guest's vector in the slot;
                // one without (sent again after the guest took it back
                // with an INIT, or late) starts nothing.
                let vector = self
                    .vm
                    .cpus
                    .get_mut(self.cpu.index)
                    .and_then(|s| s.sipi.take());
                match vector {
                    Some(v) => self.ap_start(v),
                    None => self.stay_parked(),
                }
            }
            Early::ApInit => self.init_exit(),
            Early::IcrStore => self.icr_write(),
            Early::WindowStore(w) => self.window_store(w),
            Early::LvtRefused { value } => {
                route_refused(self.cpu, "x2APIC LVT entry", value);
                self.advance()
            }
            Early::LvtWrite { msr, value } => {
                // SAFETY: the guest's own value for its own x2APIC's LVT
                // entry, which it could write itself, with a delivery mode
                // checked (`route::early`); a CPU not in x2APIC mode, or a
                // reserved bit, makes it a #GP, which goes to the guest.
                if unsafe { insn::wrmsr_safe(msr, value) }.is_err() {
                    return self.inject(GP, Some(0));
                }
                self.advance()
            }
            Early::ApicBaseRefused => {
                self.cpu.apic_refused += 1;
                self.inject(GP, Some(0))
            }
            Early::X2apicIcr { value } => {
                // SAFETY: IA32_APIC_BASE exists on every CPU with a local APIC.
                let base = unsafe { insn::rdmsr(policy::MSR_APIC_BASE) };
                if base & APIC_BASE_EXTD == 0 {
                    // Not in x2APIC mode: the MSR does not exist for the guest.
                    return self.inject(GP, Some(0));
                }
                let icr = hypervisor::apic::Icr::from_x2apic(value);
                let mut refused = false;
                self.guest_ipi(&icr, || {
                    // SAFETY: the guest's own value for its own x2APIC's
                    // ICR, which it could write itself; a CPU not in
                    // x2APIC mode refuses it with #GP, which goes to the
                    // guest.
                    refused = unsafe { insn::wrmsr_safe(hypervisor::apic::X2APIC_ICR_MSR, value) }
                        .is_err();
                });
                if refused {
                    return self.inject(GP, Some(0));
                }
                self.advance()
            }
        }
    }

    /// An exit root cannot serve: the VM stops, with the VMCS dumped.
    fn stop_on(&mut self, exit: VmExit) -> Result<Next, VmcsError> {
        let stop = match exit {
            VmExit::EptMisconfig { gpa } => StopReason::EptMisconfig { gpa },
            VmExit::EntryFailure {
                reason,
                qualification,
            } => {
                hvprintln!("error: VM entry failed: reason {} ({reason}), qualification {qualification:#x}", reason_name(reason));
                StopReason::EntryFailed
            }
            other => {
                let r = f::EXIT_REASON.read(&Vmcs)? as u16;
                hvprintln!("error: unhandled exit {} ({r}): {other:?}", reason_name(r));
                StopReason::Unhandled(r)
            }
        };
        dump_vmcs();
        Ok(Next::Stop(stop))
    }
}

/// Prints every VMCS field by name.
pub fn dump_vmcs() {
    hvprintln!("VMCS dump:");
    for (name, enc) in f::ALL {
        match Vmcs.read_raw(*enc) {
            Some(val) => hvprintln!("  {name:<32} = {val:#018x}"),
            None => hvprintln!("  {name:<32} = <unreadable>"),
        }
    }
}

mod apic;
mod cr;
mod guest_mem;
mod hit;
mod io;
mod startup;
mod step;
mod task;
mod turn;

use self::apic::{apic_store, refuse_store, route_refused};
use self::hit::{cpu_view, switch_view, vmcall_exit};
