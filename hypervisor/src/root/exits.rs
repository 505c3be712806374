//! The run loop and the exit handlers of the vCPU. Each exit is read once
//! into a `RawExit`, decoded into a `VmExit`, counted, and handled here.

use crate::arch::instructions::{self as insn, GuestRegs, RunOutcome};
use crate::control::{Action, StatusSource};
use crate::cpu_state::CpuState;
use crate::hvprintln;
use crate::introspect::{CpuView, GuestRam, KernelView};
use crate::machine::{with_env, with_env_clocked, with_world};
use crate::phys;
use crate::vcpu::Vmcs;
use crate::vm::{HitView, Vm};
use alloc::vec::Vec;
use core::fmt;
use guest_introspect::paging::{self, Cr3, WalkError};
use hypervisor::addr::Gva;
use hypervisor::pci;
use hypervisor::policy::{self, CrWrite};
use hypervisor::stats::RootWork;
use hypervisor::task_switch::LegacyPaging;
use hypervisor::tracer::machine::{GuestGs, View};
use hypervisor::tracer::modules::{ModuleEvent, ModuleHook};
use hypervisor::tracer::{DebugState, Hit, Hypercall, Tracer, Violation};
use hypervisor::vmx::ap;
use hypervisor::vmx::debug;
use hypervisor::vmx::entry::{self, Pending};
use hypervisor::vmx::event::{self, Event};
use hypervisor::vmx::exit::{decode, reason_name, CrAccess, IoAccess, VmExit};
use hypervisor::vmx::fields::{self as f, VmcsError, VmcsIo};
use hypervisor::vmx::handle::{self, HostCpu, MsrRefused, Outcome, DB, GP, UD};
use protocol::GuardReport;
use x86::vmx::vmcs::control::EntryControls;

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

/// Preemption-timer periods: idle, and while the control channel has
/// traffic in flight (SDM 26.5.1: the timer counts down at the TSC rate
/// divided by 2^IA32_VMX_MISC[4:0]).
const IDLE_TURNS_PER_SEC: u64 = 200;
const BUSY_TURNS_PER_SEC: u64 = 5000;
/// Local exits between two looks at the clock under the VM lock (the
/// look itself is cheap; the lock is not).
const LOCAL_EXITS_PER_CHECK: u64 = 64;
/// At most this many busy turns are spent draining output before a stop.
const STOP_DRAIN_TURNS: u32 = 500;

fn gpr(regs: &mut GuestRegs, n: u8) -> Option<&mut u64> {
    Some(match n {
        0 => &mut regs.rax,
        1 => &mut regs.rcx,
        2 => &mut regs.rdx,
        3 => &mut regs.rbx,
        5 => &mut regs.rbp,
        6 => &mut regs.rsi,
        7 => &mut regs.rdi,
        8 => &mut regs.r8,
        9 => &mut regs.r9,
        10 => &mut regs.r10,
        11 => &mut regs.r11,
        12 => &mut regs.r12,
        13 => &mut regs.r13,
        14 => &mut regs.r14,
        15 => &mut regs.r15,
        _ => return None, // 4 = RSP lives in the VMCS
    })
}

/// Guest-physical memory through the guarded door, for the task-switch
/// emulation; it keeps the pages written, for the tracer's shadows.
#[derive(Default)]
struct GuardedPhys {
    written: [u64; 8],
    n: usize,
    /// More pages written than `written` holds.
    more: bool,
}

impl GuardedPhys {
    /// Notes the pages of a write of `len` bytes at `gpa`.
    fn note(&mut self, gpa: u64, len: usize) {
        let last = gpa.saturating_add(len.max(1) as u64 - 1);
        let mut page = gpa & !0xfff;
        while page <= last {
            if !self.written.iter().take(self.n).any(|&p| p == page) {
                match self.written.get_mut(self.n) {
                    Some(slot) => {
                        *slot = page;
                        self.n += 1;
                    }
                    None => self.more = true,
                }
            }
            page = match page.checked_add(0x1000) {
                Some(p) => p,
                None => break,
            };
        }
    }

    /// The pages written, when all of them are known.
    fn pages(&self) -> Option<&[u64]> {
        (!self.more).then(|| self.written.get(..self.n).unwrap_or(&[]))
    }
}

impl hypervisor::task_switch::Phys for GuardedPhys {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        phys::guest_ram().read(gpa, buf).is_ok()
    }
    fn write(&mut self, gpa: u64, buf: &[u8]) -> bool {
        self.note(gpa, buf.len());
        phys::guest_ram().write(gpa, buf).is_ok()
    }
}

/// How a string instruction's memory operand is translated.
enum OperandWalk {
    /// IA-32e paging (4-level) from this CR3.
    Long(Cr3),
    /// Legacy paging, or none.
    Legacy(LegacyPaging),
}

impl OperandWalk {
    /// The guest-physical address of `la` if `access` may touch it.
    fn translate(&self, la: u64, access: policy::StringAccess) -> Result<u64, MemoryFault> {
        let (gpa, writable, user) = match self {
            Self::Long(cr3) => match paging::translate(&GuestRam, *cr3, Gva(la)) {
                Ok(t) => (t.gpa.0, t.writable, t.user),
                Err(WalkError::NonCanonical { .. }) => return Err(MemoryFault::General),
                Err(_) => return Err(MemoryFault::Page(la, access.not_present())),
            },
            Self::Legacy(p) => match p.walk(&GuardedPhys::default(), la as u32, access.write) {
                Ok(w) => (w.gpa, w.writable, w.user),
                Err(_) => return Err(MemoryFault::Page(la, access.not_present())),
            },
        };
        match access.denied(writable, user) {
            Some(code) => Err(MemoryFault::Page(la, code)),
            None => Ok(gpa),
        }
    }
}

/// The guest's legacy paging mode, from CR0.PG (set), CR4.PAE and PSE, and
/// the PDPTEs VMX keeps in the VMCS.
fn legacy_paging(v: &Vmcs, cr3: u64, cr4: u64) -> Result<LegacyPaging, VmcsError> {
    Ok(if cr4 & policy::CR4_PAE != 0 {
        LegacyPaging::Pae {
            pdptes: [
                f::GUEST_PDPTE0.read(v)?,
                f::GUEST_PDPTE1.read(v)?,
                f::GUEST_PDPTE2.read(v)?,
                f::GUEST_PDPTE3.read(v)?,
            ],
        }
    } else {
        LegacyPaging::Bits32 {
            cr3: cr3 as u32,
            pse: cr4 & policy::CR4_PSE != 0,
        }
    })
}

/// Why an emulated memory access faults.
enum MemoryFault {
    /// #PF at this linear address, with this error code.
    Page(u64, u32),
    /// #GP(0): a non-canonical address.
    General,
}

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
/// IA32_APIC_BASE bits 12..=51: the APIC page's address.
const APIC_BASE_ADDRESS: u64 = 0x000f_ffff_ffff_f000;

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

/// The vCPU state the tracer and introspection need, from the current
/// VMCS.
fn cpu_view() -> Result<CpuView, VmcsError> {
    CpuView::read(&Vmcs, read_kernel_gs_base, read_gs_base)
}

/// IA32_KERNEL_GS_BASE, the guest's while root runs (VMX does not switch
/// it), for a view taken in user mode.
fn read_kernel_gs_base() -> u64 {
    // SAFETY: IA32_KERNEL_GS_BASE exists on every x86-64 CPU.
    unsafe { insn::rdmsr(x86::msr::IA32_KERNEL_GSBASE) }
}

/// GUEST_GS_BASE for a view's lazy read: 0 (no task found there) when the
/// VMREAD fails, which is logged.
fn read_gs_base() -> u64 {
    f::GUEST_GS_BASE.read(&Vmcs).unwrap_or_else(|e| {
        log::warn!("{e}: the running task is not known");
        0
    })
}

/// A VMCALL exit, under one take of the lock's shared side (the other
/// vCPUs' hits run too): the entry fast path ([`Hit::fast_entry`]: three
/// VMREADs after the exit reason, RIP among them unless the exit already
/// read it (`rip`), and one VMWRITE) when it serves, otherwise the general
/// hypercall ([`hypercall`]) at the same RIP.
fn vmcall_exit(
    shared: &crate::vm::Shared,
    cpu: &mut CpuState,
    exit_tsc: u64,
    rip: Option<u64>,
) -> Result<Next, VmcsError> {
    let vm = shared.read(&mut cpu.shared_wait_ticks);
    cpu.shared_takes += 1;
    let hv = vm.hit_view();
    let rip = match rip {
        Some(r) => r,
        None => f::GUEST_RIP.read(&Vmcs)?,
    };
    let exit = match hv.tracer.entry_vmcall() {
        Some(vmcall) => entry::fast_entry_at(&Vmcs, rip, vmcall)?,
        None => None,
    };
    let chain = match (exit, hv.kernel) {
        (Some(exit), Some(k)) => {
            let (clock, tsc_hz) = (hv.clock, hv.tsc_hz);
            Hit::new(hv.tracer, &mut cpu.tracer).fast_entry(
                phys::guest_ram(),
                k,
                exit,
                &cpu.regs,
                read_gs_base,
                || crate::clock::tsc_to_ns(clock.peek(insn::rdtsc()), tsc_hz),
            )
        }
        _ => None,
    };
    let next = match (exit, chain) {
        (Some(exit), Some(chain)) => {
            drop(vm);
            cpu.regs.rax = chain;
            entry::fast_entry_end(&mut Vmcs, &exit)?;
            Next::Resume
        }
        _ => {
            // The fast path's reads (CPL, RSP) serve the general one.
            let view = match exit {
                Some(x) => {
                    CpuView::read_rest(&Vmcs, x.cpl, x.rsp, read_kernel_gs_base, read_gs_base)?
                }
                None => cpu_view()?,
            };
            let next = hypercall(hv, cpu, rip, view);
            drop(vm);
            next?
        }
    };
    cpu.pending_time = cpu.tracer.take_served().map(|work| (work, exit_tsc));
    Ok(next)
}

/// The tracer's hypercall (a VMCALL from its trampolines, or anyone's: #UD
/// then) with the VM shared: nothing here changes the VM but through what
/// `hypervisor::tracer::Hit` locks or counts atomically.
fn hypercall(
    vm: HitView<'_>,
    cpu: &mut CpuState,
    rip: u64,
    mut view: CpuView,
) -> Result<Next, VmcsError> {
    // The kernel's GS base as this turn's hits read it (CPL 0 only: in
    // user mode the kernel's is IA32_KERNEL_GS_BASE).
    if view.cpl == 0 {
        if let Some(base) = cpu.tracer.kernel_gs() {
            view.gs_base = GuestGs::known(base);
        }
    }
    let now = crate::clock::tsc_to_ns(vm.clock.peek(insn::rdtsc()), vm.tsc_hz);
    let kernel = vm.kernel.map(|k| k as &dyn KernelView);
    let mut hit = Hit::new(vm.tracer, &mut cpu.tracer);
    let regs = &mut cpu.regs;
    let served = with_env_clocked(vm.views, cpu.index, cpu.view, vm.clock, vm.tsc_hz, |env| {
        hit.hypercall(env, rip, regs, &view, kernel, now)
    });
    if let (0, Some(base)) = (view.cpl, view.gs_base.peek()) {
        cpu.tracer.keep_kernel_gs(base);
    }
    switch_view(cpu)?;
    if let Some(ud) = entry::hypercall_end(&mut Vmcs, rip, matches!(served, Hypercall::Handled))? {
        cpu.inject = Some(ud);
    }
    Ok(Next::Resume)
}

/// Moves the vCPU to the EPT view its tracer state names, if it is not
/// there (`hypervisor::tracer::quiet`). No INVEPT: each view's
/// translations are tagged by its own EPT pointer, and a change to a view
/// invalidates it (`crate::world`, `Machine::invept`).
fn switch_view(cpu: &mut CpuState) -> Result<(), VmcsError> {
    let want = cpu.tracer.view();
    if want != cpu.view {
        let eptp = cpu.eptp_of(want);
        f::EPT_POINTER.write(&mut Vmcs, eptp)?;
        cpu.view = want;
    }
    Ok(())
}

/// Whether a turn period has passed since the vCPU's last turn, by the
/// raw TSC. A TSC the guest set back reads as a turn due (the difference
/// wraps), and the turn starts the count again from there.
fn turn_due(cpu: &CpuState) -> bool {
    insn::rdtsc().wrapping_sub(cpu.last_turn_tsc) > cpu.turn_ticks
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

/// A decoded guest store to an interrupt window (the APIC page, an I/O
/// APIC's, the MSI MiB): the instruction and the value.
struct ApicStore {
    store: hypervisor::apic::Store,
    value: u32,
}

/// Decodes the guest's store at RIP, through `hypervisor::apic::guest_store`:
/// refused when the exit interrupted an event's delivery (the store was
/// the delivery's, not the instruction's), outside 64-bit mode on 4-level
/// paging (the only mode the decoder and the walk of RIP know), and when
/// the instruction is not one root carries out.
fn decode_apic_store(
    cpu: &mut CpuState,
) -> Result<Result<ApicStore, hypervisor::apic::Refusal>, VmcsError> {
    let v = &Vmcs;
    let mode = hypervisor::apic::GuestMode {
        cr0: f::GUEST_CR0.read(v)?,
        cr4: f::GUEST_CR4.read(v)?,
        efer: f::GUEST_IA32_EFER.read(v)?,
        cs_access_rights: f::GUEST_CS_ACCESS_RIGHTS.read(v)?,
    };
    let rip = f::GUEST_RIP.read(v)?;
    let cr3 = Cr3(f::GUEST_CR3.read(v)?);
    let decoded = hypervisor::apic::guest_store(&mode, cpu.vectoring.is_some(), |bytes| {
        // The instruction may end before a page it does not reach.
        let room = (0x1000 - (rip & 0xfff)).min(15) as usize;
        for len in [bytes.len(), room] {
            if let Some(b) = bytes.get_mut(..len) {
                if paging::read_virt(&GuestRam, cr3, Gva(rip), b).is_ok() {
                    return len;
                }
            }
        }
        0
    });
    let store = match decoded {
        Ok(store) => store,
        Err(why) => return Ok(Err(why)),
    };
    let value = match store.value {
        hypervisor::apic::StoreValue::Imm(x) => x,
        hypervisor::apic::StoreValue::Reg(4) => f::GUEST_RSP.read(v)? as u32,
        hypervisor::apic::StoreValue::Reg(n) => gpr(&mut cpu.regs, n).map_or(0, |r| *r as u32),
    };
    Ok(Ok(ApicStore { store, value }))
}

/// Refuses a guest store to an interrupt window with #GP(0). When the
/// store was part of an event's delivery, the #GP meets that event as the
/// SDM's double-fault rules say (`event::nested_fault`): a #DF after a
/// contributory exception or a #PF, a shutdown during a #DF's delivery, so
/// that a guest whose stack points into the window ends as it would on a
/// CPU that faulted there, never in a loop of refusals.
fn refuse_store(cpu: &mut CpuState) -> Next {
    cpu.apic_refused += 1;
    match event::nested_fault(cpu.vectoring.as_ref(), Event::exception(GP, Some(0))) {
        event::Nested::Deliver(e) => {
            cpu.vectoring = None;
            cpu.inject = Some(e);
            Next::Resume
        }
        event::Nested::Shutdown => Next::Stop(StopReason::TripleFault),
    }
}

/// Set once a guest store that would program INIT (or SMI, or a reserved
/// delivery mode) into an interrupt route was dropped: root logs the first.
static ROUTE_REFUSED: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Counts a dropped store to an interrupt route (`what`, with `value`),
/// and logs the first of the VM.
fn route_refused(cpu: &mut CpuState, what: &str, value: u64) {
    cpu.apic_refused += 1;
    if !ROUTE_REFUSED.swap(true, core::sync::atomic::Ordering::Relaxed) {
        log::info!(
            "vCPU {}: the guest's {what} {value:#x} (delivery mode {:#05b}) dropped: no INIT, SMI or reserved mode past root; further ones are counted only",
            cpu.index,
            hypervisor::apic::routed_mode(value as u32)
        );
    }
}

/// Completes a store root carried out: XCHG's register gets the old
/// value, and RIP moves past the instruction.
fn complete_apic_store(cpu: &mut CpuState, s: &ApicStore, old: u32) -> Result<(), VmcsError> {
    if s.store.xchg {
        if let hypervisor::apic::StoreValue::Reg(n) = s.store.value {
            if n == 4 {
                f::GUEST_RSP.write(&mut Vmcs, u64::from(old))?;
            } else if let Some(r) = gpr(&mut cpu.regs, n) {
                *r = u64::from(old);
            }
        }
    }
    entry::advance_by(&mut Vmcs, u64::from(s.store.len))
}

/// A guest store to a register of the APIC page other than the ICR's low
/// word: root carries it out on this CPU's APIC, unless
/// `hypervisor::apic::register_write` drops it (a read-only or reserved
/// register, the APIC ID, an LVT entry with INIT, SMI or a reserved
/// delivery mode). A store it may not decode is refused ([`refuse_store`]).
fn apic_store(cpu: &mut CpuState, offset: u64) -> Result<Next, VmcsError> {
    use hypervisor::apic::RegisterWrite;
    let s = match decode_apic_store(cpu)? {
        Ok(s) => s,
        Err(_) => return Ok(refuse_store(cpu)),
    };
    let lapic = cpu.lapic_base;
    // Only XCHG reads the register (a read can have effects of its own).
    let old = if s.store.xchg {
        crate::arch::ap_start::apic_read(lapic, offset)
    } else {
        0
    };
    match hypervisor::apic::register_write(offset, s.value) {
        RegisterWrite::Carry => crate::arch::ap_start::apic_write(lapic, offset, s.value),
        RegisterWrite::Ignore => {}
        RegisterWrite::Refuse => route_refused(cpu, "LVT entry", u64::from(s.value)),
    }
    complete_apic_store(cpu, &s, old)?;
    Ok(Next::Resume)
}

impl Vcpu<'_> {
    /// Root's guard counters, as the status reports them.
    pub fn guard(&self) -> GuardReport {
        GuardReport {
            nmis_in_root: crate::fatal::nmis_in_root(),
            ..self.cpu.guard
        }
    }

    fn timer_value(&self, busy: bool) -> u32 {
        let per_sec = if busy {
            BUSY_TURNS_PER_SEC
        } else {
            IDLE_TURNS_PER_SEC
        };
        ((self.vm.tsc_hz / per_sec) >> self.vm.cfg.timer_shift).clamp(1, u32::MAX as u64) as u32
    }

    fn cpu_view(&self) -> Result<CpuView, VmcsError> {
        cpu_view()
    }

    fn now_ns(&self) -> u64 {
        crate::clock::tsc_to_ns(self.vm.clock.now(), self.vm.tsc_hz)
    }

    /// A module load or unload this vCPU saw at a hidden hook (see
    /// `hypervisor::tracer::modules`): the tracer arms or disarms what is
    /// on the module, holding the other vCPUs for its changes, before this
    /// vCPU runs the kernel function's body. A load walks the module list
    /// again first (the pending probes are looked up in the new module's
    /// symbols); an unload needs no walk (the going module's text is read
    /// from its own `struct module`).
    fn module_event(&mut self, ev: ModuleEvent) -> Result<(), VmcsError> {
        let rip = f::GUEST_RIP.read(&Vmcs)?;
        let tsc_hz = self.vm.tsc_hz;
        let t0 = insn::rdtsc();
        if ev.hook == ModuleHook::Load {
            self.vm
                .introspection
                .refresh_modules_at_load(tsc_hz, ev.module);
        }
        let kernel = self.vm.introspection.take_kernel();
        if let Some(k) = kernel.as_ref() {
            with_world(&self.vm.cfg.views, self.cpu.index, rip, tsc_hz, |env| {
                let mut t = tracer!(self);
                t.module_event(ev, k, env);
                t.settle_views(Some(k), env);
            });
        }
        self.vm.introspection.put_kernel(kernel);
        // When the host reads the record rings, the new copy of the
        // modules' symbols starts before the module's code can record: its
        // first piece on the frame ring tells the host to hold the records
        // until the copy is whole.
        if tracer!(self).host_reads() {
            let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
            if let Some(c) = self.vm.control.as_mut() {
                c.module_loaded(kernel);
            }
        }
        log::info!(
            "module {:?} at {:#x} served in {} us of root time",
            ev.hook,
            ev.module,
            crate::clock::tsc_to_ns(insn::rdtsc().saturating_sub(t0), tsc_hz) / 1000
        );
        Ok(())
    }

    /// Gives the control channel and the tracer a turn and sets the next
    /// timer period.
    fn service(&mut self) -> Result<Next, VmcsError> {
        let next = self.turn();
        // `turn` read the TSC first thing.
        let spent = insn::rdtsc().wrapping_sub(self.cpu.last_turn_tsc);
        if let Some(t) = crate::vcpu::root_time(self.cpu.index, RootWork::Turn) {
            t.add(spent);
        }
        // A hypercall whose exit took this turn is timed without it.
        if let Some((_, exit_tsc)) = &mut self.cpu.pending_time {
            *exit_tsc = exit_tsc.wrapping_add(spent);
        }
        next
    }

    /// The turn [`Self::service`] times.
    fn turn(&mut self) -> Result<Next, VmcsError> {
        let mut stop = false;
        let mut busy = false;
        self.cpu.last_turn_tsc = insn::rdtsc();
        self.cpu.last_turn = self.vm.clock.update(self.cpu.last_turn_tsc);
        with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
            tracer!(self).on_turn(env)
        });
        if tracer!(self).view_due() {
            // The sessions that filter by pid or comm changed: the view for
            // the task this vCPU runs now.
            let cpu = self.cpu_view()?;
            let now = self.now_ns();
            let kernel = self.vm.introspection.take_kernel();
            tracer!(self).turn_view(kernel.as_ref().map(|k| k as &dyn KernelView), &cpu, now);
            self.vm.introspection.put_kernel(kernel);
            switch_view(self.cpu)?;
        }
        // #DB exits follow the tracer: on every vCPU while a step ended by
        // force may have left TF in a context that resumes anywhere.
        let want = tracer!(self).wants_debug_exits();
        if want != self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, if want { 1 << DB } else { 0 })?;
            self.cpu.debug_exits = want;
        }
        if self.cpu.index == 0 {
            self.resend_sipis();
        }
        if self.cpu.index == 0 && self.vm.control.is_some() {
            let now = self.now_ns();
            let cpu = self.cpu_view()?;
            let rip = f::GUEST_RIP.read(&Vmcs)?;
            let guard = self.guard();
            let Some(c) = self.vm.control.as_mut() else {
                return Ok(Next::Resume);
            };
            let mut src = StatusSource {
                uptime_ns: crate::clock::tsc_to_ns(self.vm.clock.now(), self.vm.tsc_hz),
                memory_used: crate::frames::used(),
                memory_total: loader::layout::HV_RESERVED_SIZE,
                heap_used: crate::heap::used() as u64,
                introspection: &mut self.vm.introspection,
                cpu: cpu.clone(),
                tsc_hz: self.vm.tsc_hz,
                tracer: tracer!(self),
                views: &self.vm.cfg.views,
                vcpu: self.cpu.index,
                rip,
                guard,
                cpus: &self.vm.cpus,
            };
            stop = c.poll(&mut src) == Action::Stop;
            let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
            tracer!(self).reap(kernel, &cpu, now);
            let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
            // A new copy of the modules' symbols goes before the records,
            // which may name the modules' code (the host renders them).
            c.export_turn(kernel);
            // When the host reads the record rings, the context goes out
            // in this turn whatever else is under way (see
            // `Stream::next_records`); the host holds the records while a
            // copy of the modules' symbols is on its way.
            if !c.sending_modules() || tracer!(self).host_reads() {
                while let Some(ev) = tracer!(self).next_text(c.tx_room(), kernel, now) {
                    c.send_event(ev);
                }
            }
            if c.take_context_resend() {
                tracer!(self).resend_context();
            }
            if tracer!(self).doorbell(now) {
                c.send_event(protocol::Event::TraceDoorbell);
            }
            c.flush();
            busy = c.busy() || tracer!(self).has_output();
        }
        let per_sec = if busy {
            BUSY_TURNS_PER_SEC
        } else {
            IDLE_TURNS_PER_SEC
        };
        self.cpu.turn_ticks = self.vm.tsc_hz / per_sec;
        if self.vm.cfg.has_timer {
            let t = self.timer_value(busy);
            if t != self.cpu.timer {
                f::PREEMPTION_TIMER_VALUE.write(&mut Vmcs, t)?;
                self.cpu.timer = t;
            }
        }
        if self.cpu.index != 0 {
            return Ok(Next::Resume);
        }
        if stop && self.vm.stopping.is_none() {
            // Keep the guest running a few turns so that the acknowledgement
            // reaches the host before the machine goes away.
            self.vm.stopping = Some(STOP_DRAIN_TURNS);
        }
        if let Some(left) = self.vm.stopping {
            if !busy || left == 0 {
                return Ok(Next::Stop(StopReason::HostStop));
            }
            self.vm.stopping = Some(left - 1);
        }
        Ok(Next::Resume)
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
        // An AP's INIT and SIPI are root's to carry out (`smp`); the boot
        // processor's INIT is the guest resetting the machine (below).
        if self.cpu.index != 0 {
            match exit {
                VmExit::Sipi { .. } => {
                    // Root's own SIPIs carry the guest's vector in the
                    // slot; one without (sent again after the guest took
                    // it back with an INIT, or late) starts nothing.
                    let vector = self
                        .vm
                        .cpus
                        .get_mut(self.cpu.index)
                        .and_then(|s| s.sipi.take());
                    return match vector {
                        Some(v) => self.ap_start(v),
                        None => self.stay_parked(),
                    };
                }
                VmExit::Init => return self.init_exit(),
                _ => {}
            }
        }
        if let VmExit::EptViolation(e) = exit {
            // Every other store to the APIC page was handled in
            // `local_exit`, which sees each exit first.
            if e.write
                && self.cpu.lapic_base != 0
                && e.gpa == self.cpu.lapic_base + hypervisor::apic::XAPIC_ICR_LOW
            {
                return self.icr_write();
            }
            // The I/O APICs' pages and the MSI MiB (`hypervisor::irq`).
            if let Some(w) = self.vm.windows.and_then(|w| w.classify(e.gpa)) {
                if e.write && !matches!(w, hypervisor::irq::Window::LocalApic { .. }) {
                    return self.window_store(w);
                }
            }
        }
        if let VmExit::MsrWrite { msr, value } = exit {
            if let Some(offset) = hypervisor::apic::x2apic_lvt_offset(msr) {
                // An x2APIC LVT entry: no INIT, SMI or reserved delivery
                // mode (bits 32..=63 are reserved: the CPU refuses them).
                if value >> 32 == 0
                    && hypervisor::apic::register_write(offset, value as u32)
                        == hypervisor::apic::RegisterWrite::Refuse
                {
                    route_refused(self.cpu, "x2APIC LVT entry", value);
                    return self.advance();
                }
                // SAFETY: the guest's own value for its own x2APIC's LVT
                // entry, which it could write itself, with a delivery mode
                // checked above; a CPU not in x2APIC mode, or a reserved
                // bit, makes it a #GP, which goes to the guest.
                if unsafe { insn::wrmsr_safe(msr, value) }.is_err() {
                    return self.inject(GP, Some(0));
                }
                return self.advance();
            }
        }
        if let VmExit::MsrWrite {
            msr: policy::MSR_APIC_BASE,
            value,
        } = exit
        {
            // With more than one vCPU the APIC page is where root watches
            // the guest's start-up IPIs: it stays where it is.
            if self.vm.cpus.len() > 1 && value & APIC_BASE_ADDRESS != self.vm.lapic_base {
                self.cpu.apic_refused += 1;
                return self.inject(GP, Some(0));
            }
        }
        if let VmExit::MsrWrite {
            msr: hypervisor::apic::X2APIC_ICR_MSR,
            value,
        } = exit
        {
            // SAFETY: IA32_APIC_BASE exists on every CPU with a local APIC.
            let base = unsafe { insn::rdmsr(policy::MSR_APIC_BASE) };
            if base & APIC_BASE_EXTD == 0 {
                // Not in x2APIC mode: the MSR does not exist for the guest.
                return self.inject(GP, Some(0));
            }
            let icr = hypervisor::apic::Icr::from_x2apic(value);
            let mut refused = false;
            self.guest_ipi(&icr, || {
                // SAFETY: the guest's own value for its own x2APIC's ICR,
                // which it could write itself; a CPU not in x2APIC mode
                // refuses it with #GP, which goes to the guest.
                refused =
                    unsafe { insn::wrmsr_safe(hypervisor::apic::X2APIC_ICR_MSR, value) }.is_err();
            });
            if refused {
                return self.inject(GP, Some(0));
            }
            return self.advance();
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
        match exit {
            VmExit::Cr(access) => self.cr_access(access),
            VmExit::Io(io) => self.io(io),
            VmExit::TaskSwitch { qualification } => self.task_switch(qualification),
            VmExit::Vmcall => self.vmcall(),
            VmExit::Exception { vector: DB, info } => self.debug_exception(info),
            VmExit::ExternalInterrupt => self.interrupt_in_step(),
            VmExit::PreemptionTimer => self.service(),
            VmExit::EptViolation(e) => {
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
            VmExit::EptMisconfig { gpa } => {
                dump_vmcs();
                Ok(Next::Stop(StopReason::EptMisconfig { gpa }))
            }
            VmExit::EntryFailure {
                reason,
                qualification,
            } => {
                hvprintln!("error: VM entry failed: reason {} ({reason}), qualification {qualification:#x}", reason_name(reason));
                dump_vmcs();
                Ok(Next::Stop(StopReason::EntryFailed))
            }
            other => {
                let r = f::EXIT_REASON.read(&Vmcs)? as u16;
                hvprintln!("error: unhandled exit {} ({r}): {other:?}", reason_name(r));
                dump_vmcs();
                Ok(Next::Stop(StopReason::Unhandled(r)))
            }
        }
    }

    /// Sends again the SIPIs that wait for parked APs (a physical SIPI
    /// that reached an AP while it was in root was lost).
    fn resend_sipis(&mut self) {
        let lapic = self.vm.lapic_base;
        for slot in self.vm.cpus.iter().skip(1) {
            if let (Some(vector), true, false) = (slot.sipi, slot.life.is_parked(), slot.init) {
                crate::smp::wake(lapic, slot.apic_id, vector);
            }
        }
    }

    /// Starts this parked AP at the SIPI's `vector`, as a SIPI starts a
    /// CPU in wait-for-SIPI; a SIPI to a running AP is discarded.
    fn ap_start(&mut self, vector: u8) -> Result<Next, VmcsError> {
        let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) else {
            return Ok(Next::Resume);
        };
        if slot.life.on_sipi(vector).is_none() {
            return Ok(Next::Resume);
        }
        slot.init = false;
        ap::write_sipi_state(&mut Vmcs, vector, self.vm.cfg.has_timer)?;
        self.cpu.lapic_base = self.vm.lapic_base;
        self.cpu.parked = false;
        self.forget_events()?;
        if self.vm.cfg.has_timer {
            let t = self.timer_value(false);
            f::PREEMPTION_TIMER_VALUE.write(&mut Vmcs, t)?;
            self.cpu.timer = t;
        }
        // EPT may have changed while the AP was parked.
        self.cpu.invalidate_views();
        // NMIs to this CPU were blocked by the way Bochs 2.7 takes the SIPI
        // exit; an IRET in root lets them through again (a no-op on a CPU
        // whose NMIs are not blocked).
        insn::iret_to_self();
        log::info!(
            "vCPU {} started at {:#x}",
            self.cpu.index,
            u64::from(vector) << 12
        );
        Ok(Next::Resume)
    }

    /// A SIPI exit that starts nothing: back to wait-for-SIPI (Bochs 2.7
    /// saves the activity as active, and blocking bits, after it).
    fn stay_parked(&mut self) -> Result<Next, VmcsError> {
        if self
            .vm
            .cpus
            .get(self.cpu.index)
            .is_some_and(|s| s.life.is_parked())
        {
            f::GUEST_INTERRUPTIBILITY.write(&mut Vmcs, 0)?;
            f::GUEST_ACTIVITY_STATE.write(&mut Vmcs, ap::ACTIVITY_WAIT_FOR_SIPI)?;
        }
        Ok(Next::Resume)
    }

    /// Drops the events this vCPU carried (INIT and SIPI discard them): the
    /// event to inject, the interrupted one, a pending NMI and NMI-window
    /// exiting, in the VMCS as well as in root's copy.
    fn forget_events(&mut self) -> Result<(), VmcsError> {
        self.cpu.inject = None;
        self.cpu.vectoring = None;
        crate::fatal::take_nmi(self.cpu.index);
        if self.cpu.nmi_window {
            let ctl = f::PRIMARY_PROC_CONTROLS.read(&Vmcs)?;
            f::PRIMARY_PROC_CONTROLS.write(&mut Vmcs, ctl & !NMI_WINDOW_EXITING)?;
            self.cpu.nmi_window = false;
        }
        Ok(())
    }

    /// Resets this AP as INIT does and parks it in wait-for-SIPI.
    fn ap_park(&mut self) -> Result<Next, VmcsError> {
        self.ap_reset(true)
    }

    /// An INIT that reached this AP as a signal. None of the guest's
    /// should: root carries out the INITs the guest writes to its ICR,
    /// and drops those it would route past root (`hypervisor::irq`). One
    /// that still comes parks the AP as INIT does; when they keep coming
    /// (Bochs 2.7 keeps an INIT pending for good, so it parks the AP again
    /// at every start) the AP is held parked and its SIPIs are dropped
    /// (`hypervisor::irq::InitLimiter`), logged once.
    fn init_exit(&mut self) -> Result<Next, VmcsError> {
        use hypervisor::irq::{InitLimiter, InitVerdict};
        let now = self.vm.clock.now();
        let window = self.vm.tsc_hz;
        let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) else {
            return self.ap_park();
        };
        match slot.init_limiter.on_init(now, window) {
            InitVerdict::Park => self.ap_park(),
            InitVerdict::Hold { first } => {
                slot.sipi = None;
                if first {
                    log::info!(
                        "vCPU {}: more than {} INIT exits in a second (an INIT the emulator keeps pending): it stays parked, and start-up IPIs to it are dropped",
                        self.cpu.index,
                        InitLimiter::LIMIT
                    );
                }
                self.ap_reset(false)
            }
        }
    }

    /// [`Self::ap_park`], with its log line when `log`.
    fn ap_reset(&mut self, log: bool) -> Result<Next, VmcsError> {
        let fixed = ap::FixedCrs {
            cr0: self.vm.cfg.fixed.cr0,
            cr4: self.vm.cfg.fixed.cr4,
        };
        ap::write_init_state(&mut Vmcs, &mut self.cpu.regs, fixed, insn::cpuid(1, 0)[0])?;
        if let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) {
            slot.life.on_init();
            slot.init = false;
        }
        // A step in flight ends: INIT resets RFLAGS, and the pages must
        // not stay open while the AP sleeps.
        if tracer!(self).debug_state().stepping {
            with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
                tracer!(self).finish_step(env)
            });
        }
        self.step_irq_exits(false)?;
        self.cpu.parked = true;
        self.forget_events()?;
        if self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, 0)?;
            self.cpu.debug_exits = false;
        }
        if log {
            log::info!("vCPU {} parked by INIT", self.cpu.index);
        }
        Ok(Next::Resume)
    }

    /// Before an AP's next entry: the INIT and SIPI that other vCPUs
    /// posted for it (`smp`).
    fn ap_mailbox(&mut self) -> Result<(), VmcsError> {
        if self.cpu.index == 0 {
            return Ok(());
        }
        let Some(init) = self.vm.cpus.get(self.cpu.index).map(|s| s.init) else {
            return Ok(());
        };
        if init {
            self.ap_park()?;
        }
        let parked = self
            .vm
            .cpus
            .get(self.cpu.index)
            .is_some_and(|s| s.life.is_parked());
        if parked {
            if let Some(vector) = self
                .vm
                .cpus
                .get_mut(self.cpu.index)
                .and_then(|s| s.sipi.take())
            {
                self.ap_start(vector)?;
            }
        }
        Ok(())
    }

    /// A guest store to the local APIC's interrupt command register
    /// (low word): root decodes it and takes INIT and SIPI for its own
    /// (`smp`); other IPIs are written through. A store root cannot decode
    /// is refused with #GP.
    fn icr_write(&mut self) -> Result<Next, VmcsError> {
        let st = match decode_apic_store(self.cpu)? {
            Ok(st) => st,
            Err(_) => return Ok(refuse_store(self.cpu)),
        };
        use crate::arch::ap_start::{apic_read, apic_write};
        use hypervisor::apic::{XAPIC_ICR_HIGH, XAPIC_ICR_LOW};
        let lapic = self.cpu.lapic_base;
        let old = if st.store.xchg {
            apic_read(lapic, XAPIC_ICR_LOW)
        } else {
            0
        };
        let icr = hypervisor::apic::Icr::from_xapic(st.value, apic_read(lapic, XAPIC_ICR_HIGH));
        let value = st.value;
        self.guest_ipi(&icr, || apic_write(lapic, XAPIC_ICR_LOW, value));
        complete_apic_store(self.cpu, &st, old)?;
        Ok(Next::Resume)
    }

    /// A guest store to an I/O APIC's page or to the MSI MiB
    /// (`hypervisor::irq`): root carries it out, except a redirection
    /// entry or an interrupt message with INIT, SMI or a reserved delivery
    /// mode (dropped, counted) and a store to no register of the I/O APIC
    /// (dropped). A store that is not aligned to its register (16 bytes in
    /// the I/O APIC, 4 in the MSI MiB) or that root may not decode is
    /// refused ([`refuse_store`]). Under the VM lock: the I/O APIC's
    /// register select is one for all vCPUs, and root reads it back before
    /// a store to the data window.
    fn window_store(&mut self, window: hypervisor::irq::Window) -> Result<Next, VmcsError> {
        use crate::arch::ap_start::{window_read, window_write};
        use hypervisor::irq::{IoApicWrite, Window};
        let (addr, aligned) = match window {
            Window::IoApic { base, offset } => (base + offset, offset & 0xf == 0),
            Window::Msi { address } => (address, address & 0x3 == 0),
            // The local APIC's page is `local_exit`'s and `icr_write`'s.
            Window::LocalApic { .. } => return Ok(refuse_store(self.cpu)),
        };
        if !aligned {
            return Ok(refuse_store(self.cpu));
        }
        let st = match decode_apic_store(self.cpu)? {
            Ok(st) => st,
            Err(_) => return Ok(refuse_store(self.cpu)),
        };
        let (verdict, what) = match window {
            Window::IoApic { base, offset } => {
                let select = if offset == hypervisor::irq::IOWIN {
                    window_read(base + hypervisor::irq::IOREGSEL)
                } else {
                    0
                };
                (
                    hypervisor::irq::ioapic_write(offset, select, st.value),
                    "I/O APIC redirection entry",
                )
            }
            _ if hypervisor::irq::msi_write(st.value) => (IoApicWrite::Carry, ""),
            _ => (IoApicWrite::Refuse, "interrupt message (MSI)"),
        };
        let old = if st.store.xchg { window_read(addr) } else { 0 };
        match verdict {
            IoApicWrite::Carry => window_write(addr, st.value),
            IoApicWrite::Ignore => {}
            IoApicWrite::Refuse => route_refused(self.cpu, what, u64::from(st.value)),
        }
        complete_apic_store(self.cpu, &st, old)?;
        Ok(Next::Resume)
    }

    /// An IPI the guest asked for: INIT and SIPI to APs go to their slots
    /// (and a SIPI to a parked AP wakes it); everything else is sent as
    /// the guest wrote it, by `forward`.
    fn guest_ipi(&mut self, icr: &hypervisor::apic::Icr, forward: impl FnOnce()) {
        use hypervisor::apic::{classify, targets, IpiAction};
        let action = classify(icr);
        let (init, sipi) = match action {
            IpiAction::Forward => {
                forward();
                return;
            }
            IpiAction::Ignore => return,
            IpiAction::Init => (true, None),
            IpiAction::Startup(vector) => (false, Some(vector)),
        };
        let ids: Vec<u32> = self.vm.cpus.iter().map(|s| s.apic_id).collect();
        let mask = targets(icr, self.cpu.index, &ids);
        let lapic = self.vm.lapic_base;
        for (i, slot) in self.vm.cpus.iter_mut().enumerate() {
            if i >= 32 || mask & (1 << i) == 0 {
                continue;
            }
            if i == 0 {
                // Start-up IPIs to the boot processor: nothing root models.
                self.cpu.apic_refused += 1;
                continue;
            }
            if init {
                slot.sipi = None;
                // A parked AP is already in the state INIT leaves.
                slot.init = !slot.life.is_parked();
            } else if let Some(vector) = sipi {
                if slot.init_limiter.holding() {
                    // An AP an emulator's pending INIT would park again at
                    // once (`Vcpu::init_exit`).
                    self.cpu.apic_refused += 1;
                } else if slot.life.is_parked() || slot.init {
                    slot.sipi = Some(vector);
                    if !slot.init {
                        crate::smp::wake(lapic, slot.apic_id, vector);
                    }
                }
            }
        }
    }

    /// The instruction that exited on an EPT violation did not complete, so
    /// no single-step is due for it; Bochs 2.7 still saves BS in the
    /// pending-debug-exceptions field when TF was set, and would deliver a
    /// #DB at the next entry before the instruction runs (ending a step
    /// that never happened, over and over).
    fn clear_stale_step(&mut self) -> Result<(), VmcsError> {
        let v = &mut Vmcs;
        let pending = f::GUEST_PENDING_DEBUG_EXCEPTIONS.read(v)?;
        if pending & debug::PENDING_BS != 0 {
            f::GUEST_PENDING_DEBUG_EXCEPTIONS.write(v, pending & !debug::PENDING_BS)?;
        }
        Ok(())
    }

    /// An EPT violation the tracer does not own: a hypervisor bug.
    fn bad_violation(&mut self, e: hypervisor::vmx::exit::EptViolation) -> Result<Next, VmcsError> {
        hvprintln!(
            "error: EPT violation: gpa {:#x} gla {:?} read={} write={} fetch={} allowed={:#x}",
            e.gpa,
            e.gla,
            e.read,
            e.write,
            e.fetch,
            e.allowed
        );
        let at = crate::machine::view_index(self.cpu.index, self.cpu.view);
        let leaf = self.vm.cfg.views.get(at).and_then(|ept| {
            ept.translate(
                &mut crate::frames::PoolTables,
                hypervisor::addr::Gpa(e.gpa & !0xfff),
            )
        });
        hvprintln!("error: EPT entry for that page: {leaf:?}");
        dump_vmcs();
        Ok(Next::Stop(StopReason::EptViolation { gpa: e.gpa }))
    }

    /// A VMCALL: the tracer's entry hypercall, or #UD. (The exit loop
    /// serves them under the lock's shared side; see [`hypercall`].)
    fn vmcall(&mut self) -> Result<Next, VmcsError> {
        let rip = f::GUEST_RIP.read(&Vmcs)?;
        hypercall(self.vm.hit_view(), self.cpu, rip, cpu_view()?)
    }

    /// Lets the guest execute one instruction against the page the tracer
    /// just remapped: TF on, #DB intercepted. STI/MOV-SS blocking is
    /// dropped (an entry with TF and such blocking would need a pending
    /// single-step, which would trap before the instruction ran).
    fn arm_step(&mut self) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        tracer!(self).set_old_tf(rflags & RFLAGS_TF != 0);
        f::GUEST_RFLAGS.write(v, rflags | RFLAGS_TF)?;
        let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
        if intr & event::BLOCKING_BY_STI_OR_MOV_SS != 0 {
            f::GUEST_INTERRUPTIBILITY.write(v, intr & !event::BLOCKING_BY_STI_OR_MOV_SS)?;
        }
        if !self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(v, 1 << DB)?;
            self.cpu.debug_exits = true;
        }
        self.step_irq_exits(true)?;
        Ok(Next::Resume)
    }

    /// Root's emulation wrote the guest pages `phys` noted, straight to
    /// the guest's frames: a hooked one's shadows take the write (every
    /// hooked page when more pages were written than were noted).
    fn emulated_writes(&mut self, phys: &GuardedPhys) {
        let pages = phys.pages();
        with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
            let mut t = tracer!(self);
            match pages {
                Some(pages) => {
                    for &page in pages {
                        t.emulated_write(page, env);
                    }
                }
                None => t.resync_all(env),
            }
        });
    }

    /// Puts the guest's own TF back after root's step ended without its
    /// #DB (the step's TF must not ride into an event's frame).
    fn restore_guest_tf(&mut self, guest_tf: bool) -> Result<(), VmcsError> {
        self.set_guest_tf(guest_tf)?;
        self.step_irq_exits(false)
    }

    /// Sets RFLAGS.TF to `tf` and drops a pending single-step (BS) that
    /// root's own TF left.
    fn set_guest_tf(&mut self, tf: bool) -> Result<(), VmcsError> {
        let v = &mut Vmcs;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        let want = if tf {
            rflags | RFLAGS_TF
        } else {
            rflags & !RFLAGS_TF
        };
        if want != rflags {
            f::GUEST_RFLAGS.write(v, want)?;
        }
        self.clear_stale_step()
    }

    /// External-interrupt exiting on while a step is armed, off otherwise
    /// (without acknowledge on exit: the interrupt stays pending in the
    /// local APIC, and root runs with interrupts off). Without it, an
    /// interrupt pending at the step's entry would be delivered before the
    /// stepped instruction, and its handler, softirqs and whatever the
    /// scheduler picks next would run with the step's pages open.
    fn step_irq_exits(&mut self, on: bool) -> Result<(), VmcsError> {
        if self.cpu.irq_exits == on || (on && !irq_exiting_allowed()) {
            return Ok(());
        }
        let v = &mut Vmcs;
        let pin = f::PIN_BASED_CONTROLS.read(v)?;
        let pin = if on {
            pin | PIN_EXTERNAL_INTERRUPT_EXITING
        } else {
            pin & !PIN_EXTERNAL_INTERRUPT_EXITING
        };
        f::PIN_BASED_CONTROLS.write(v, pin)?;
        self.cpu.irq_exits = on;
        Ok(())
    }

    /// An external interrupt while a step was armed. The stepped
    /// instruction has not run (its single-step #DB would have come before
    /// any interrupt), so the step ends here, unfinished: its pages close,
    /// the guest's own TF goes back, and the guest takes the interrupt at
    /// the next entry in its own state. When the handler returns to the
    /// instruction, it faults into a new step.
    fn interrupt_in_step(&mut self) -> Result<Next, VmcsError> {
        let DebugState {
            stepping, guest_tf, ..
        } = tracer!(self).debug_state();
        if stepping {
            with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
                tracer!(self).finish_step(env)
            });
            self.restore_guest_tf(guest_tf)?;
        }
        self.step_irq_exits(false)?;
        if !tracer!(self).wants_debug_exits() && self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, 0)?;
            self.cpu.debug_exits = false;
        }
        Ok(Next::Resume)
    }

    /// #DB: the end of the tracer's step, the guest's own, or both
    /// (`hypervisor::vmx::debug::decide`): root's single-step is swallowed,
    /// the guest's breakpoints and single-steps are delivered, INT1 goes
    /// back as INT1.
    fn debug_exception(&mut self, info: u32) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let qual = f::EXIT_QUALIFICATION.read(v)?;
        let int1 = event::info_type(info) == event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION;
        let DebugState {
            stepping,
            guest_tf,
            stray_tf: stray,
        } = tracer!(self).debug_state();
        let act = debug::decide(qual, int1, stepping, guest_tf, stray);
        if act.end_step {
            with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
                tracer!(self).finish_step(env)
            });
            self.step_irq_exits(false)?;
        } else if stray && act.tf == Some(false) {
            tracer!(self).clear_stray_tf();
        }
        if let Some(tf) = act.tf {
            // Bochs 2.7 leaves a stale BS here after a TF step, and the next
            // entry fails on it; the guest's other pending conditions stay.
            self.set_guest_tf(tf)?;
        }
        let next = match act.reflect {
            Some(bits) => {
                // The CPU did not update DR6 for an intercepted #DB (SDM
                // 27.1): do it as delivery would, then deliver.
                let dr6 = (insn::read_dr6() & !0xf) | bits | 0xffff_0ff0;
                insn::write_dr6(dr6);
                if act.as_int1 {
                    self.cpu.inject = Some(Event {
                        vector: DB,
                        kind: event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION,
                        error_code: None,
                        instruction_len: f::EXIT_INSTRUCTION_LEN.read(v)?,
                    });
                    Next::Resume
                } else {
                    self.inject(DB, None)?
                }
            }
            None => Next::Resume,
        };
        if !tracer!(self).wants_debug_exits() && self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, 0)?;
            self.cpu.debug_exits = false;
        }
        Ok(next)
    }

    /// A control-register value the CPU would refuse: #GP(0), counted.
    fn refuse_cr(&mut self) -> Result<Next, VmcsError> {
        self.cpu.guard.cr_writes_refused += 1;
        self.inject(GP, Some(0))
    }

    fn cr_access(&mut self, access: CrAccess) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let (f0, f1) = self.vm.cfg.fixed.cr0;
        let (f40, f41) = self.vm.cfg.fixed.cr4;
        match access {
            CrAccess::MovTo { cr, gpr: g } => {
                let value = match gpr(&mut self.cpu.regs, g) {
                    Some(r) => *r,
                    None => f::GUEST_RSP.read(v)?,
                };
                match cr {
                    0 => {
                        let cr4 = f::CR4_READ_SHADOW.read(v)?;
                        let efer = f::GUEST_IA32_EFER.read(v)?;
                        match policy::cr0_write(value, f0, f1, cr4, efer) {
                            CrWrite::Load { actual, shadow } => {
                                let old = f::GUEST_CR0.read(v)?;
                                f::GUEST_CR0.write(v, actual)?;
                                f::CR0_READ_SHADOW.write(v, shadow)?;
                                if (old ^ actual) & policy::CR0_PG != 0 {
                                    let efer = policy::efer_after_cr0(efer, actual);
                                    f::GUEST_IA32_EFER.write(v, efer)?;
                                    let mut ctl = f::ENTRY_CONTROLS.read(v)?;
                                    ctl &= !EntryControls::IA32E_MODE_GUEST.bits();
                                    if efer & policy::EFER_LMA != 0 {
                                        ctl |= EntryControls::IA32E_MODE_GUEST.bits();
                                    }
                                    f::ENTRY_CONTROLS.write(v, ctl)?;
                                }
                                self.advance()
                            }
                            CrWrite::Fault => self.refuse_cr(),
                        }
                    }
                    4 => {
                        let old = f::CR4_READ_SHADOW.read(v)?;
                        let lma = f::GUEST_IA32_EFER.read(v)? & policy::EFER_LMA != 0;
                        match policy::cr4_write(value, old, f40, f41, lma) {
                            CrWrite::Load { actual, shadow } => {
                                f::GUEST_CR4.write(v, actual)?;
                                f::CR4_READ_SHADOW.write(v, shadow)?;
                                self.advance()
                            }
                            CrWrite::Fault => self.refuse_cr(),
                        }
                    }
                    3 => {
                        f::GUEST_CR3.write(v, value)?;
                        self.advance()
                    }
                    8 => {
                        // The task-priority register; bits 63:4 are reserved.
                        if value >> 4 != 0 {
                            return self.inject(GP, Some(0));
                        }
                        // SAFETY: root runs with interrupts off, so the TPR
                        // (the guest's, with no TPR shadow) is the guest's alone.
                        unsafe { insn::write_cr8(value) };
                        self.advance()
                    }
                    _ => self.inject(UD, None),
                }
            }
            CrAccess::MovFrom { cr, gpr: g } => {
                let value = match cr {
                    0 => f::CR0_READ_SHADOW.read(v)?,
                    3 => f::GUEST_CR3.read(v)?,
                    4 => f::CR4_READ_SHADOW.read(v)?,
                    8 => insn::read_cr8(),
                    _ => return self.inject(UD, None),
                };
                match gpr(&mut self.cpu.regs, g) {
                    Some(r) => *r = value,
                    None => f::GUEST_RSP.write(v, value)?,
                }
                self.advance()
            }
            CrAccess::Clts => {
                let ts = policy::CR0_TS;
                let c = f::GUEST_CR0.read(v)?;
                f::GUEST_CR0.write(v, c & !ts)?;
                let s = f::CR0_READ_SHADOW.read(v)?;
                f::CR0_READ_SHADOW.write(v, s & !ts)?;
                self.advance()
            }
            CrAccess::Lmsw { source } => {
                // LMSW loads CR0[3:0] but cannot clear PE.
                let msw = policy::CR0_PE | policy::CR0_MP | policy::CR0_EM | policy::CR0_TS;
                let s = f::CR0_READ_SHADOW.read(v)?;
                let new = (s & !(msw & !policy::CR0_PE)) | (source as u64 & msw);
                let cr4 = f::CR4_READ_SHADOW.read(v)?;
                let efer = f::GUEST_IA32_EFER.read(v)?;
                match policy::cr0_write(new, f0, f1, cr4, efer) {
                    CrWrite::Load { actual, shadow } => {
                        f::GUEST_CR0.write(v, actual)?;
                        f::CR0_READ_SHADOW.write(v, shadow)?;
                        self.advance()
                    }
                    CrWrite::Fault => self.refuse_cr(),
                }
            }
        }
    }

    /// Whether VMX root keeps `port` from the guest: the control UART, the
    /// log port and the bus-master IDE registers.
    fn owns_port(&self, port: u16) -> bool {
        policy::CONTROL_PORTS.contains(&port)
            || port == policy::DEBUG_PORT
            || self
                .vm
                .cfg
                .dma_block
                .as_ref()
                .is_some_and(|d| d.ports.contains(&port))
    }

    /// A guest access to PCI configuration space (mechanism #1): the address
    /// latch is forwarded and remembered; data reads are forwarded; data
    /// writes are merged into the dword and filtered (`hypervisor::pci`).
    fn pci_config(&mut self, io: IoAccess) -> Result<Option<StopReason>, VmcsError> {
        let mask = policy::floating_bus(io.size);
        if io.port == pci::CONFIG_ADDRESS && io.size == 4 {
            if io.input {
                // SAFETY: the configuration address register, read for the guest.
                let v = unsafe { insn::inl(pci::CONFIG_ADDRESS) };
                self.cpu.regs.rax = (self.cpu.regs.rax & !0xffff_ffff) | u64::from(v);
            } else {
                let v = self.cpu.regs.rax as u32;
                self.vm.pci_address = v;
                forward_out(pci::CONFIG_ADDRESS, 4, v);
            }
            return Ok(None);
        }
        let addr = pci::ConfigAddress::decode(self.vm.pci_address);
        if !pci::CONFIG_DATA.contains(&io.port) || !addr.enabled {
            // 0xCF9 (reset control) and friends, or data with cycles off:
            // the platform's, byte by byte.
            return Ok(self.io_bytes(io));
        }
        let offset = (io.port - pci::CONFIG_DATA.start()) as u8;
        if io.input {
            forward_out(pci::CONFIG_ADDRESS, 4, self.vm.pci_address);
            // SAFETY: a configuration read for the guest, at the address it set.
            let v = unsafe {
                match io.size {
                    1 => u32::from(insn::inb(io.port)),
                    2 => u32::from(insn::inw(io.port)),
                    _ => insn::inl(io.port),
                }
            };
            self.cpu.regs.rax = (self.cpu.regs.rax & !u64::from(mask)) | u64::from(v & mask);
            return Ok(None);
        }
        // Decide on the whole dword, but write only the bytes the guest
        // wrote, at its size: a read-modify-write of the dword would write
        // back neighbouring registers (write-1-to-clear status bits, chipset
        // controls) that the guest never touched.
        let old = pci_read(self.vm.pci_address);
        let new = pci::merge(old, offset, io.size, self.cpu.regs.rax as u32);
        let shift = u32::from(offset) * 8;
        let guest_bytes = |dword: u32| (dword >> shift) & mask;
        let blocked = self
            .vm
            .cfg
            .dma_block
            .as_ref()
            .filter(|d| d.bdf == addr.bdf)
            .map(|d| d.bar);
        match pci::config_write(addr.register, new, blocked) {
            pci::ConfigWrite::Write(v) => {
                if v != new {
                    self.cpu.guard.pci_writes_refused += 1;
                }
                pci_data_write(self.vm.pci_address, io.port, io.size, guest_bytes(v));
            }
            pci::ConfigWrite::Drop => self.cpu.guard.pci_writes_refused += 1,
            pci::ConfigWrite::WriteThenCheckBar => {
                pci_data_write(self.vm.pci_address, io.port, io.size, guest_bytes(new));
                let value = pci_read(self.vm.pci_address);
                pci_write(self.vm.pci_address, u32::MAX);
                let probe = pci_read(self.vm.pci_address);
                pci_write(self.vm.pci_address, value);
                let upper = (addr.register < 0x24 && (value & 7) == 4)
                    .then(|| pci_read(self.vm.pci_address + 4));
                let hv =
                    loader::layout::HV_RESERVED.as_u64()..loader::layout::HV_RESERVED_END.as_u64();
                if pci::bar_overlaps(addr.register, value, probe, upper, &hv) {
                    pci_write(self.vm.pci_address, old);
                    self.cpu.guard.pci_writes_refused += 1;
                }
            }
        }
        Ok(None)
    }

    fn io(&mut self, io: IoAccess) -> Result<Next, VmcsError> {
        if io.string {
            return self.string_io(io);
        }
        let stop = self.port(io)?;
        self.advance()?;
        Ok(stop.map_or(Next::Resume, Next::Stop))
    }

    /// One IN or OUT of `io.size` bytes with the value in (or for) RAX, as
    /// the platform would answer it with root's policy applied: root's
    /// ports float, PM1 writes of SLP_EN stop the VM, PCI configuration is
    /// filtered, the rest goes to the platform. Does not move RIP.
    fn port(&mut self, io: IoAccess) -> Result<Option<StopReason>, VmcsError> {
        let debug = policy::DEBUG_PORT..=policy::DEBUG_PORT;
        if !io.input && policy::io_touches(io.port, io.size, &debug) {
            self.cpu.guard.debug_port_writes += 1;
        }
        let dma = self.vm.cfg.dma_block.as_ref();
        if !io.input && dma.is_some_and(|d| policy::io_touches(io.port, io.size, &d.ports)) {
            self.cpu.guard.dma_port_writes_blocked += 1;
        }
        if !io.input {
            // A software reset would restart the machine without root: the
            // VM ends, as at a triple fault.
            let out = self.cpu.regs.rax as u32;
            if policy::resets(io.port, io.size, out) {
                log::info!(
                    "vCPU {}: the guest reset the machine through port {:#x}",
                    self.cpu.index,
                    io.port
                );
                return Ok(Some(StopReason::Reset));
            }
        }
        let ours = self.touches_owned(io);
        let pm1 = self.vm.cfg.fadt.map(|fd| (fd.pm1a_cnt, fd.pm1b_cnt));
        if let Some((a, b)) = pm1 {
            let exact = (io.port == a || Some(io.port) == b) && !ours;
            if exact {
                if io.input {
                    // SAFETY: forwarding the guest's own read of its PM1 control register.
                    let val = unsafe {
                        match io.size {
                            1 => insn::inb(io.port) as u32,
                            2 => insn::inw(io.port) as u32,
                            _ => insn::inl(io.port),
                        }
                    } as u64;
                    let mask = policy::floating_bus(io.size) as u64;
                    self.cpu.regs.rax = (self.cpu.regs.rax & !mask) | (val & mask);
                    return Ok(None);
                }
                let value = (self.cpu.regs.rax & policy::floating_bus(io.size) as u64) as u32;
                if value & policy::PM1_SLP_EN != 0 {
                    return Ok(Some(StopReason::PowerOff {
                        port: io.port,
                        value,
                        size: io.size,
                    }));
                }
                forward_out(io.port, io.size, value);
                return Ok(None);
            }
        }
        if io.port == pci::CONFIG_ADDRESS || pci::CONFIG_DATA.contains(&io.port) {
            return self.pci_config(io);
        }
        // Everything else, straddles of root's ports included, byte by byte.
        Ok(self.io_bytes(io))
    }

    /// INS or OUTS (with or without REP) on an intercepted port: one
    /// element per exit, through [`Self::port`], with its memory operand
    /// read or written through the guest's page tables and the guarded
    /// door. A REP instruction stays at its RIP with RCX and RSI/RDI moved
    /// on, and exits again for the next element, as the CPU would have
    /// let an interrupt in between. A memory operand the guest may not
    /// access gets #PF at that element; one that is not guest RAM floats
    /// (reads all ones, writes dropped).
    fn string_io(&mut self, io: IoAccess) -> Result<Next, VmcsError> {
        let v = &Vmcs;
        let linear = f::GUEST_LINEAR_ADDRESS.read(v)?;
        let efer = f::GUEST_IA32_EFER.read(v)?;
        let cs_ar = f::GUEST_CS_ACCESS_RIGHTS.read(v)?;
        // The address size: from the instruction information when the CPU
        // reports it for INS/OUTS (IA32_VMX_BASIC bit 54), else from the
        // code segment (an address-size prefix is then not seen).
        let mask = if self.vm.cfg.ins_outs_info {
            policy::address_size_mask(f::EXIT_INSTRUCTION_INFO.read(v)?)
        } else if efer & policy::EFER_LMA != 0 && cs_ar & f::AR_L != 0 {
            u64::MAX
        } else if cs_ar & f::AR_DB != 0 {
            0xffff_ffff
        } else {
            0xffff
        };
        if io.rep && self.cpu.regs.rcx & mask == 0 {
            return self.advance();
        }
        self.cpu.guard.string_io_emulated += 1;
        let cpu = self.cpu_view()?;
        let cr0 = f::GUEST_CR0.read(v)?;
        let cr4 = f::GUEST_CR4.read(v)?;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        let size = usize::from(io.size.clamp(1, 4));
        let access = policy::StringAccess {
            write: io.input,
            user: cpu.cpl == 3,
            write_protect: cr0 & policy::CR0_WP != 0,
            smap: cr4 & policy::CR4_SMAP != 0 && rflags & policy::RFLAGS_AC == 0 && cpu.cpl < 3,
        };
        let walk = if cr0 & policy::CR0_PG == 0 {
            OperandWalk::Legacy(LegacyPaging::Off)
        } else if efer & policy::EFER_LMA != 0 {
            OperandWalk::Long(Cr3(cpu.cr3))
        } else {
            OperandWalk::Legacy(legacy_paging(v, cpu.cr3, cr4)?)
        };
        // Every byte is translated and checked before the port is touched:
        // a fault must not lose what a port read consumed.
        let mut gpas = [0u64; 4];
        for (i, gpa) in gpas.iter_mut().take(size).enumerate() {
            match walk.translate(linear.wrapping_add(i as u64), access) {
                Ok(g) => *gpa = g,
                Err(fault) => return self.memory_fault(fault),
            }
        }
        let ram = phys::guest_ram();
        let saved = self.cpu.regs.rax;
        if !io.input {
            let mut bytes = [0xffu8; 4];
            for (b, &gpa) in bytes.iter_mut().zip(&gpas).take(size) {
                if ram.read(gpa, core::slice::from_mut(b)).is_err() {
                    *b = 0xff;
                }
            }
            self.cpu.regs.rax = u64::from(u32::from_le_bytes(bytes));
        }
        let stop = self.port(IoAccess {
            string: false,
            rep: false,
            ..io
        })?;
        if io.input {
            let bytes = (self.cpu.regs.rax as u32).to_le_bytes();
            let mut written = GuardedPhys::default();
            for (b, &gpa) in bytes.iter().zip(&gpas).take(size) {
                // Not guest RAM (MMIO, a hole, hypervisor memory): dropped.
                if ram.write(gpa, core::slice::from_ref(b)).is_ok() {
                    written.note(gpa, 1);
                }
            }
            self.emulated_writes(&written);
        }
        self.cpu.regs.rax = saved;
        let step = if rflags & policy::RFLAGS_DF != 0 {
            (size as u64).wrapping_neg()
        } else {
            size as u64
        };
        // 16-bit writes keep the register's upper bits; 32-bit writes
        // zero-extend (in 64-bit mode; outside it the upper half is not
        // visible).
        let set = |reg: &mut u64, value: u64| {
            *reg = if mask == 0xffff {
                (*reg & !mask) | (value & mask)
            } else {
                value & mask
            };
        };
        let index = if io.input {
            &mut self.cpu.regs.rdi
        } else {
            &mut self.cpu.regs.rsi
        };
        set(index, index.wrapping_add(step));
        let last = if io.rep {
            let left = (self.cpu.regs.rcx & mask).wrapping_sub(1) & mask;
            set(&mut self.cpu.regs.rcx, left);
            left == 0
        } else {
            true
        };
        if last || stop.is_some() {
            self.advance()?;
        }
        Ok(stop.map_or(Next::Resume, Next::Stop))
    }

    /// Injects the fault of an emulated memory access.
    fn memory_fault(&mut self, fault: MemoryFault) -> Result<Next, VmcsError> {
        match fault {
            MemoryFault::Page(linear, code) => self.page_fault(linear, code),
            MemoryFault::General => self.inject(GP, Some(0)),
        }
    }

    /// Injects #PF at `linear`. Root loads CR2 itself (CR2 is not in the
    /// VMCS) before the entry delivers the fault.
    fn page_fault(&mut self, linear: u64, code: u32) -> Result<Next, VmcsError> {
        insn::write_cr2(linear);
        self.inject(PF, Some(code))
    }

    /// Injects a fault the task-switch emulation raised.
    fn task_fault(&mut self, fault: hypervisor::task_switch::Fault) -> Result<Next, VmcsError> {
        match fault {
            hypervisor::task_switch::Fault::Pf(la, code) => self.page_fault(u64::from(la), code),
            other => {
                let (vector, code) = other.vector_and_code();
                self.inject(vector, Some(code))
            }
        }
    }

    /// A task switch (legacy protected mode only): emulated as the CPU
    /// would have done it (`hypervisor::task_switch`), the state copied
    /// from and back to the VMCS. An event that was being delivered
    /// through a task gate is consumed by the switch, not delivered again.
    fn task_switch(&mut self, q: u64) -> Result<Next, VmcsError> {
        use hypervisor::task_switch::{self as ts, Outcome, Seg, Source, TaskCpu};
        let v = &mut Vmcs;
        if f::GUEST_IA32_EFER.read(v)? & policy::EFER_LMA != 0 {
            // IA-32e mode raises #GP before a task switch could exit.
            hvprintln!("error: a task switch exit in IA-32e mode: {q:#x}");
            return Ok(Next::Stop(StopReason::Unhandled(9)));
        }
        self.cpu.guard.task_switches += 1;
        let source = Source::from_qualification(q);
        let rip = f::GUEST_RIP.read(v)?;
        let len = u64::from(f::EXIT_INSTRUCTION_LEN.read(v)?);
        let event = if source == Source::Gate {
            self.cpu.vectoring.take()
        } else {
            None
        };
        let software = event.is_some_and(|e| {
            matches!(
                e.kind,
                event::TYPE_SOFTWARE_INTERRUPT
                    | event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION
                    | event::TYPE_SOFTWARE_EXCEPTION
            )
        });
        let return_eip = if source != Source::Gate || software {
            rip.wrapping_add(len)
        } else {
            rip
        };
        let mut segs = [Seg::default(); 8];
        for (s, fields) in segs.iter_mut().zip(&f::GUEST_SEGMENTS) {
            *s = Seg {
                selector: fields.selector.read(v)?,
                base: fields.base.read(v)? as u32,
                limit: fields.limit.read(v)?,
                ar: fields.access_rights.read(v)?,
            };
        }
        let r = &self.cpu.regs;
        let mut cpu = TaskCpu {
            gpr: [
                r.rax as u32,
                r.rcx as u32,
                r.rdx as u32,
                r.rbx as u32,
                f::GUEST_RSP.read(v)? as u32,
                r.rbp as u32,
                r.rsi as u32,
                r.rdi as u32,
            ],
            eip: rip as u32,
            eflags: f::GUEST_RFLAGS.read(v)? as u32,
            seg: [segs[0], segs[1], segs[2], segs[3], segs[4], segs[5]],
            ldtr: segs[f::SEG_LDTR],
            tr: segs[f::SEG_TR],
            gdtr: (
                f::GUEST_GDTR_BASE.read(v)? as u32,
                f::GUEST_GDTR_LIMIT.read(v)?,
            ),
            cr0: f::GUEST_CR0.read(v)? as u32,
            cr3: f::GUEST_CR3.read(v)? as u32,
        };
        let cr4 = f::GUEST_CR4.read(v)?;
        let paging = if u64::from(cpu.cr0) & policy::CR0_PG == 0 {
            LegacyPaging::Off
        } else {
            legacy_paging(v, u64::from(cpu.cr3), cr4)?
        };
        let old_cr3 = cpu.cr3;
        let mut phys = GuardedPhys::default();
        let mut mem = ts::LegacyLinear {
            paging,
            phys: &mut phys,
            pdptes_changed: false,
        };
        let req = ts::Request {
            selector: q as u16,
            source,
            return_eip: return_eip as u32,
            error_code: event.and_then(|e| e.error_code),
        };
        let outcome = ts::switch(&mut cpu, &mut mem, req);
        let (pdptes_changed, paging) = (mem.pdptes_changed, mem.paging);
        self.emulated_writes(&phys);
        if let Outcome::FaultBefore(fault) = outcome {
            return self.task_fault(fault);
        }
        // The new task's state, loaded (all of it, or up to a fault that
        // the new task takes).
        let [es, cs, ss, ds, fs, gs] = cpu.seg;
        for (s, fields) in [es, cs, ss, ds, fs, gs, cpu.ldtr, cpu.tr]
            .iter()
            .zip(&f::GUEST_SEGMENTS)
        {
            fields.write(v, s.selector, u64::from(s.base), s.limit, s.ar)?;
        }
        let g = cpu.gpr.map(u64::from);
        self.cpu.regs.rax = g[0];
        self.cpu.regs.rcx = g[1];
        self.cpu.regs.rdx = g[2];
        self.cpu.regs.rbx = g[3];
        f::GUEST_RSP.write(v, g[4])?;
        self.cpu.regs.rbp = g[5];
        self.cpu.regs.rsi = g[6];
        self.cpu.regs.rdi = g[7];
        f::GUEST_RIP.write(v, u64::from(cpu.eip))?;
        f::GUEST_RFLAGS.write(v, u64::from(cpu.eflags))?;
        f::GUEST_CR0.write(v, u64::from(cpu.cr0))?;
        f::GUEST_CR3.write(v, u64::from(cpu.cr3))?;
        if cpu.cr3 != old_cr3 {
            // A MOV to CR3 would have flushed the old address space's
            // translations; with VPID, VM entry does not. Both views: the
            // vCPU may move to the other one before its next CR3 load.
            self.cpu.invalidate_views();
        }
        if let (true, LegacyPaging::Pae { pdptes }) = (pdptes_changed, paging) {
            f::GUEST_PDPTE0.write(v, pdptes[0])?;
            f::GUEST_PDPTE1.write(v, pdptes[1])?;
            f::GUEST_PDPTE2.write(v, pdptes[2])?;
            f::GUEST_PDPTE3.write(v, pdptes[3])?;
        }
        // The instruction that switched completed: no STI/MOV SS blocking.
        let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
        let nmi = event.is_some_and(|e| e.kind == event::TYPE_NMI);
        let mut intr = intr & !event::BLOCKING_BY_STI_OR_MOV_SS;
        if nmi {
            intr |= event::BLOCKING_BY_NMI;
        }
        if source == Source::Iret {
            // IRET unblocks NMIs (virtual NMIs: root keeps the blocking).
            intr &= !event::BLOCKING_BY_NMI;
        }
        f::GUEST_INTERRUPTIBILITY.write(v, intr)?;
        // A task switch clears the local breakpoint enables (L0..L3).
        let dr7 = f::GUEST_DR7.read(v)?;
        f::GUEST_DR7.write(v, dr7 & !DR7_LOCAL_ENABLES)?;
        match outcome {
            Outcome::FaultAfter(fault) => self.task_fault(fault),
            Outcome::Switched { debug_trap: true } => {
                // The new TSS's T flag: a #DB that DR6.BT names.
                insn::write_dr6(insn::read_dr6() | DR6_BT);
                self.inject(DB, None)
            }
            _ => Ok(Next::Resume),
        }
    }

    /// Whether any byte of the access is a port root keeps (`owns_port`).
    fn touches_owned(&self, io: IoAccess) -> bool {
        (0..u16::from(io.size.max(1)))
            .any(|i| io.port.checked_add(i).is_some_and(|p| self.owns_port(p)))
    }

    /// A port access done byte by byte: root's ports float (reads all
    /// ones, writes dropped), the others go to the platform, as a bus
    /// would split it; a write of SLP_EN to PM1 still powers off.
    fn io_bytes(&mut self, io: IoAccess) -> Option<StopReason> {
        let pm1 = self.vm.cfg.fadt.map(|fd| (fd.pm1a_cnt, fd.pm1b_cnt));
        let mut value = 0u32;
        let out = self.cpu.regs.rax as u32;
        for i in 0..io.size.min(4) {
            let Some(p) = io.port.checked_add(u16::from(i)) else {
                break;
            };
            let shift = 8 * u32::from(i);
            if io.input {
                let byte = if self.owns_port(p) {
                    0xff
                } else {
                    // SAFETY: a port the guest owns, read on its behalf.
                    unsafe { insn::inb(p) }
                };
                value |= u32::from(byte) << shift;
            } else if !self.owns_port(p) {
                let byte = (out >> shift) as u8;
                if let Some((a, b)) = pm1 {
                    let high = p == a.wrapping_add(1) || Some(p) == b.map(|b| b.wrapping_add(1));
                    if high && u32::from(byte) << 8 & policy::PM1_SLP_EN != 0 {
                        let base = p - 1;
                        // SAFETY: the guest's own PM1 register, read back.
                        let low = u32::from(unsafe { insn::inb(base) });
                        return Some(StopReason::PowerOff {
                            port: base,
                            value: low | u32::from(byte) << 8,
                            size: 2,
                        });
                    }
                }
                forward_out(p, 1, u32::from(byte));
            }
        }
        if io.input {
            let mask = policy::floating_bus(io.size) as u64;
            self.cpu.regs.rax = (self.cpu.regs.rax & !mask) | (u64::from(value) & mask);
        }
        None
    }
}

/// Reads configuration dword `address` (a CONFIG_ADDRESS value).
fn pci_read(address: u32) -> u32 {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    // SAFETY: a configuration read; the address latch was just set.
    unsafe { insn::inl(*pci::CONFIG_DATA.start()) }
}

/// Writes `size` bytes of configuration space at data port `port` under
/// `address`, as the guest asked.
fn pci_data_write(address: u32, port: u16, size: u8, value: u32) {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    forward_out(port, size, value);
}

/// Writes configuration dword `address`.
fn pci_write(address: u32, value: u32) {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    forward_out(*pci::CONFIG_DATA.start(), 4, value);
}

/// A bus-master IDE function and its bus-master register block (BAR4).
#[derive(Debug, Clone)]
pub struct DmaBlock {
    /// Bus, device, function.
    pub bdf: (u8, u8, u8),
    /// The configuration register of the I/O BAR (0x20).
    pub bar: u8,
    /// The ports it decodes.
    pub ports: core::ops::RangeInclusive<u16>,
}

/// Finds the bus-master IDE function on bus 0 (PIIX in Bochs and QEMU's
/// i440FX machines), before the guest runs: its bus-master registers can
/// make the controller write any physical address, hypervisor memory
/// included, so root keeps the guest away from them (and from moving them).
pub fn find_bus_master_ide() -> Option<DmaBlock> {
    for dev in 0..32u32 {
        for func in 0..8u32 {
            let address = pci::ConfigAddress {
                enabled: true,
                bdf: (0, dev as u8, func as u8),
                register: 0,
            }
            .encode();
            let id = pci_read(address);
            if id & 0xffff == 0xffff {
                if func == 0 {
                    break;
                }
                continue;
            }
            let class = pci_read(address | 0x08) >> 8;
            // Mass storage, IDE, bus-master capable (prog-if bit 7).
            if class >> 8 == 0x0101 && class & 0x80 != 0 {
                let bar = pci_read(address | 0x20);
                if bar & 1 == 1 && bar & 0xfffc != 0 {
                    let base = (bar & 0xfff0) as u16;
                    return Some(DmaBlock {
                        bdf: (0, dev as u8, func as u8),
                        bar: 0x20,
                        ports: base..=base + 15,
                    });
                }
            }
        }
    }
    None
}

/// Performs an OUT on behalf of the guest.
pub fn forward_out(port: u16, size: u8, value: u32) {
    // SAFETY: the guest asked for exactly this write to a port it owns
    // (the ACPI PM1 control block).
    unsafe {
        match size {
            1 => insn::outb(port, value as u8),
            2 => insn::outw(port, value as u16),
            _ => insn::outl(port, value),
        }
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
