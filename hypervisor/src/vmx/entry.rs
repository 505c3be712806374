//! The VMCS side of an exit and of the next entry: reading the exit and the
//! event it interrupted, skipping the exiting instruction, and writing the
//! events to deliver. Over [`VmcsIo`], so that the host tests run them
//! against an in-memory VMCS; the binary's exit loop calls them with the
//! real one.

use super::event::{self, EntryPlan, Event};
use super::exit::RawExit;
use super::fields::{self as f, VmcsError, VmcsIo};
use super::regs::GuestRegs;
use crate::tracer::FastExit;
use x86::vmx::vmcs::control::PrimaryControls;

/// Reads the exit's fields, with the guest registers some exits take
/// operands from. A VMCALL, the exit of every hit, needs its reason
/// alone: its other fields are not read.
pub fn read_exit(v: &impl VmcsIo, regs: &GuestRegs) -> Result<RawExit, VmcsError> {
    read_exit_of(v, f::EXIT_REASON.read(v)?, regs)
}

/// [`read_exit`] for an exit whose reason the caller has read.
pub fn read_exit_of(v: &impl VmcsIo, reason: u32, regs: &GuestRegs) -> Result<RawExit, VmcsError> {
    if reason as u16 == super::exit::reason::VMCALL {
        return Ok(RawExit {
            reason,
            qualification: 0,
            guest_physical: 0,
            guest_linear: 0,
            interruption_info: 0,
            rax: regs.rax,
            rcx: regs.rcx,
            rdx: regs.rdx,
        });
    }
    Ok(RawExit {
        reason,
        qualification: f::EXIT_QUALIFICATION.read(v)?,
        guest_physical: f::GUEST_PHYSICAL_ADDRESS.read(v)?,
        guest_linear: f::GUEST_LINEAR_ADDRESS.read(v)?,
        interruption_info: f::EXIT_INTERRUPTION_INFO.read(v)?,
        rax: regs.rax,
        rcx: regs.rcx,
        rdx: regs.rdx,
    })
}

/// The event whose delivery the exit of `raw` interrupted (SDM 28.2.4),
/// if any. A VMCALL has none: the IDT-vectoring information is valid only
/// for an exit during an event's delivery through the IDT, and a VMCALL
/// exits as its own instruction executes, so it is not read.
pub fn read_vectoring_of(v: &impl VmcsIo, raw: &RawExit) -> Result<Option<Event>, VmcsError> {
    if raw.reason as u16 == super::exit::reason::VMCALL {
        return Ok(None);
    }
    read_vectoring(v)
}

/// The event whose delivery this exit interrupted (SDM 28.2.4), if any.
pub fn read_vectoring(v: &impl VmcsIo) -> Result<Option<Event>, VmcsError> {
    let info = f::IDT_VECTORING_INFO.read(v)?;
    if !event::info_valid(info) {
        return Ok(None);
    }
    Ok(Event::from_vectoring(
        info,
        f::IDT_VECTORING_ERROR_CODE.read(v)?,
        f::EXIT_INSTRUCTION_LEN.read(v)?,
    ))
}

/// Skips the instruction that exited, and clears STI/MOV-SS blocking as
/// the instruction completing would (SDM 25.4.2); blocking by NMI stays.
pub fn advance(v: &mut impl VmcsIo) -> Result<(), VmcsError> {
    let len = u64::from(f::EXIT_INSTRUCTION_LEN.read(v)?);
    advance_by(v, len)
}

/// Skips `len` bytes of instruction, as [`advance`] does, for exits that
/// report no instruction length (an EPT violation on a store that root
/// carried out itself).
pub fn advance_by(v: &mut impl VmcsIo, len: u64) -> Result<(), VmcsError> {
    let rip = f::GUEST_RIP.read(v)?;
    f::GUEST_RIP.write(v, rip.wrapping_add(len))?;
    let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
    if intr & event::BLOCKING_BY_STI_OR_MOV_SS != 0 {
        f::GUEST_INTERRUPTIBILITY.write(v, intr & !event::BLOCKING_BY_STI_OR_MOV_SS)?;
    }
    Ok(())
}

/// The VMCS side of a VMCALL exit at `rip` (GUEST_RIP, read by the
/// caller) for the entry fast path ([`crate::tracer::Hit::fast_entry`]):
/// only when it is the entry trampoline's VMCALL (`entry_vmcall`),
/// GUEST_SS_ACCESS_RIGHTS and GUEST_RSP, each a field a nested KVM
/// shadows; `None`: another VMCALL, for the general path. The general
/// path's view of the same exit reads the rest ([`CpuView::read_rest`]).
pub fn fast_entry_at(
    v: &impl VmcsIo,
    rip: u64,
    entry_vmcall: u64,
) -> Result<Option<FastExit>, VmcsError> {
    if rip != entry_vmcall {
        return Ok(None);
    }
    Ok(Some(FastExit {
        rip,
        cpl: event::cpl_from_ss_ar(f::GUEST_SS_ACCESS_RIGHTS.read(v)?),
        rsp: f::GUEST_RSP.read(v)?,
    }))
}

/// The VMCS side of an entry hypercall the fast path served: one VMWRITE,
/// of RIP past the trampoline's VMCALL. [`hypercall_end`] reads two fields
/// more, which this one does without:
/// - the exit's instruction length: the region's VMCALL has no prefix
///   ([`trampolines::abi::VMCALL_LEN`], asserted by the region's tests);
/// - the interruptibility state: the trampoline's VMCALL follows a `mov
///   eax, imm32`, so no blocking by STI or by MOV SS covers it (each
///   covers only the instruction right after; SDM Vol. 3, 25.4.2).
///
/// A guest that maps bytes of its own at the region's address and runs a
/// longer VMCALL there, or one right after STI or MOV SS, resumes three
/// bytes on (or with that blocking one instruction longer): its own
/// doing, and the entry stays valid (the blocking was valid at the exit;
/// a pending NMI waits for its window, [`event::plan_entry`]).
pub fn fast_entry_end(v: &mut impl VmcsIo, exit: &FastExit) -> Result<(), VmcsError> {
    f::GUEST_RIP.write(v, exit.rip.wrapping_add(trampolines::abi::VMCALL_LEN))
}

/// The VMCS side of a VMCALL exit at `rip` once served: the guest goes on
/// past the VMCALL when the tracer handled it, by the length the exit
/// reports (the trampolines' VMCALL has 3 bytes, but a guest that maps a
/// page of its own at that address may put a prefixed one there);
/// otherwise it was not ours (no trampoline's, or forged) and the guest
/// gets the #UD a VMCALL outside VMX would raise, returned for the next
/// entry.
pub fn hypercall_end(
    v: &mut impl VmcsIo,
    rip: u64,
    handled: bool,
) -> Result<Option<Event>, VmcsError> {
    if handled {
        let len = u64::from(f::EXIT_INSTRUCTION_LEN.read(v)?);
        f::GUEST_RIP.write(v, rip.wrapping_add(len))?;
        let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
        if intr & event::BLOCKING_BY_STI_OR_MOV_SS != 0 {
            f::GUEST_INTERRUPTIBILITY.write(v, intr & !event::BLOCKING_BY_STI_OR_MOV_SS)?;
        }
        Ok(None)
    } else {
        Ok(Some(Event::exception(super::handle::UD, None)))
    }
}

/// The events a vCPU carries from one exit to its next entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pending {
    /// The event the exit's handler wants delivered.
    pub inject: Option<Event>,
    /// The event whose delivery the exit interrupted.
    pub vectoring: Option<Event>,
    /// Whether NMI-window exiting is on in the VMCS.
    pub nmi_window: bool,
}

/// What [`prepare_entry`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    /// The pending NMI was injected (the caller takes it off its queue).
    pub nmi_delivered: bool,
    /// An interrupted event was delivered again.
    pub reinjected: bool,
}

/// Fills the entry's event-injection fields: the handler's event, the
/// interrupted one, or a pending NMI (see [`event::plan_entry`]), and turns
/// NMI-window exiting on while an NMI still waits (off once it does not).
/// The common exit, with nothing to deliver and no window to close, does
/// not touch the VMCS at all.
pub fn prepare_entry(
    v: &mut impl VmcsIo,
    pending: &mut Pending,
    nmi_pending: bool,
) -> Result<Prepared, VmcsError> {
    if pending.inject.is_none()
        && pending.vectoring.is_none()
        && !pending.nmi_window
        && !nmi_pending
    {
        return Ok(Prepared::default());
    }
    let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
    let plan = event::plan_entry(
        pending.inject.take(),
        pending.vectoring.take(),
        nmi_pending,
        intr,
    );
    write_plan(v, &plan, intr, pending)?;
    Ok(Prepared {
        nmi_delivered: plan.inject.is_some() && plan.nmi_delivered,
        reinjected: plan.inject.is_some() && plan.reinjected,
    })
}

fn write_plan(
    v: &mut impl VmcsIo,
    plan: &EntryPlan,
    intr: u32,
    pending: &mut Pending,
) -> Result<(), VmcsError> {
    if let Some(e) = plan.inject {
        if let Some(code) = e.error_code {
            f::ENTRY_EXCEPTION_ERROR_CODE.write(v, code)?;
        }
        if e.needs_instruction_len() {
            f::ENTRY_INSTRUCTION_LEN.write(v, e.instruction_len)?;
        }
        f::ENTRY_INTERRUPTION_INFO.write(v, e.entry_info())?;
    }
    if plan.interruptibility != intr {
        f::GUEST_INTERRUPTIBILITY.write(v, plan.interruptibility)?;
    }
    if plan.nmi_window != pending.nmi_window {
        let mut ctl = f::PRIMARY_PROC_CONTROLS.read(v)?;
        ctl ^= PrimaryControls::NMI_WINDOW_EXITING.bits();
        f::PRIMARY_PROC_CONTROLS.write(v, ctl)?;
        pending.nmi_window = plan.nmi_window;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmx::event::{
        BLOCKING_BY_MOV_SS, BLOCKING_BY_NMI, BLOCKING_BY_STI, TYPE_EXTERNAL,
        TYPE_HARDWARE_EXCEPTION, TYPE_NMI, TYPE_SOFTWARE_INTERRUPT,
    };
    use std::cell::Cell;
    use std::collections::HashMap;

    /// An in-memory VMCS that counts its accesses.
    #[derive(Default)]
    struct Vmcs {
        fields: HashMap<u32, u64>,
        accesses: Cell<u32>,
    }

    impl VmcsIo for Vmcs {
        fn read_raw(&self, e: u32) -> Option<u64> {
            self.accesses.set(self.accesses.get() + 1);
            Some(*self.fields.get(&e).unwrap_or(&0))
        }
        fn write_raw(&mut self, e: u32, v: u64) -> bool {
            self.accesses.set(self.accesses.get() + 1);
            self.fields.insert(e, v);
            true
        }
    }

    impl Vmcs {
        fn get(&self, e: u32) -> u64 {
            *self.fields.get(&e).unwrap_or(&0)
        }
        fn set(&mut self, e: u32, v: u64) {
            self.fields.insert(e, v);
        }
    }

    const VALID: u64 = 1 << 31;
    const HAS_CODE: u64 = 1 << 11;
    const NMI_WINDOW: u64 = PrimaryControls::NMI_WINDOW_EXITING.bits() as u64;

    #[test]
    fn the_fast_path_reads_three_fields_and_writes_rip_past_the_vmcall() {
        const VMCALL: u64 = 0xffff_ffff_a000_0080;
        let mut v = Vmcs::default();
        v.set(f::GUEST_RIP.encoding, VMCALL);
        // Ring 0's SS: DPL 0; a user SS has DPL 3 (bits 5-6).
        v.set(f::GUEST_SS_ACCESS_RIGHTS.encoding, 0xc093);
        v.set(f::GUEST_RSP.encoding, 0xffff_c900_0001_3e00);
        let start = |v: &Vmcs| fast_entry_at(v, f::GUEST_RIP.read(v).unwrap(), VMCALL).unwrap();
        let exit = start(&v).unwrap();
        assert_eq!(
            (exit.rip, exit.cpl, exit.rsp),
            (VMCALL, 0, 0xffff_c900_0001_3e00)
        );
        assert_eq!(v.accesses.get(), 3);
        fast_entry_end(&mut v, &exit).unwrap();
        assert_eq!(v.get(f::GUEST_RIP.encoding), VMCALL + 3);
        assert_eq!(v.accesses.get(), 4);
        // A user-mode SS reads as CPL 3.
        v.set(f::GUEST_RIP.encoding, VMCALL);
        v.set(f::GUEST_SS_ACCESS_RIGHTS.encoding, 0xc0f3);
        assert_eq!(start(&v).unwrap().cpl, 3);
        // Another VMCALL: its RIP only.
        v.accesses.set(0);
        v.set(f::GUEST_RIP.encoding, VMCALL + 0x400);
        assert!(start(&v).is_none());
        assert_eq!(v.accesses.get(), 1);
    }

    #[test]
    fn advance_skips_the_instruction_and_ends_an_sti_shadow_only() {
        let mut v = Vmcs::default();
        v.set(f::GUEST_RIP.encoding, 0xffff_ffff_8100_1000);
        v.set(f::EXIT_INSTRUCTION_LEN.encoding, 3);
        v.set(
            f::GUEST_INTERRUPTIBILITY.encoding,
            u64::from(BLOCKING_BY_STI | BLOCKING_BY_NMI),
        );
        advance(&mut v).unwrap();
        assert_eq!(v.get(f::GUEST_RIP.encoding), 0xffff_ffff_8100_1003);
        assert_eq!(
            v.get(f::GUEST_INTERRUPTIBILITY.encoding),
            u64::from(BLOCKING_BY_NMI)
        );
        v.set(
            f::GUEST_INTERRUPTIBILITY.encoding,
            u64::from(BLOCKING_BY_MOV_SS),
        );
        advance(&mut v).unwrap();
        assert_eq!(v.get(f::GUEST_RIP.encoding), 0xffff_ffff_8100_1006);
        assert_eq!(v.get(f::GUEST_INTERRUPTIBILITY.encoding), 0);
    }

    #[test]
    fn vectoring_info_becomes_the_event_to_deliver_again() {
        let mut v = Vmcs::default();
        assert_eq!(read_vectoring(&v).unwrap(), None);
        // A #PF (vector 14, hardware exception, error code 2) whose
        // delivery hit an EPT violation.
        v.set(
            f::IDT_VECTORING_INFO.encoding,
            VALID | HAS_CODE | (u64::from(TYPE_HARDWARE_EXCEPTION) << 8) | 14,
        );
        v.set(f::IDT_VECTORING_ERROR_CODE.encoding, 2);
        let e = read_vectoring(&v).unwrap().unwrap();
        assert_eq!(
            (e.vector, e.kind, e.error_code),
            (14, TYPE_HARDWARE_EXCEPTION, Some(2))
        );
        // INT 0x80: software interrupt, the length of its instruction kept.
        v.set(
            f::IDT_VECTORING_INFO.encoding,
            VALID | (u64::from(TYPE_SOFTWARE_INTERRUPT) << 8) | 0x80,
        );
        v.set(f::EXIT_INSTRUCTION_LEN.encoding, 2);
        let e = read_vectoring(&v).unwrap().unwrap();
        assert_eq!((e.vector, e.error_code, e.instruction_len), (0x80, None, 2));
    }

    #[test]
    fn nothing_to_deliver_touches_no_field() {
        let mut v = Vmcs::default();
        let mut p = Pending::default();
        assert_eq!(
            prepare_entry(&mut v, &mut p, false).unwrap(),
            Prepared::default()
        );
        assert_eq!(v.accesses.get(), 0);
    }

    #[test]
    fn a_handlers_exception_is_written_with_its_error_code() {
        let mut v = Vmcs::default();
        let mut p = Pending {
            inject: Some(Event::exception(13, Some(0))),
            ..Pending::default()
        };
        prepare_entry(&mut v, &mut p, false).unwrap();
        assert_eq!(
            v.get(f::ENTRY_INTERRUPTION_INFO.encoding),
            VALID | HAS_CODE | (u64::from(TYPE_HARDWARE_EXCEPTION) << 8) | 13
        );
        assert_eq!(v.get(f::ENTRY_EXCEPTION_ERROR_CODE.encoding), 0);
        assert_eq!(p.inject, None, "taken");
    }

    #[test]
    fn an_interrupted_external_interrupt_is_reinjected_without_a_shadow() {
        let mut v = Vmcs::default();
        v.set(
            f::GUEST_INTERRUPTIBILITY.encoding,
            u64::from(BLOCKING_BY_STI),
        );
        let mut p = Pending {
            vectoring: Event::from_vectoring(
                (1 << 31) | (u32::from(TYPE_EXTERNAL) << 8) | 0x30,
                0,
                0,
            ),
            ..Pending::default()
        };
        let r = prepare_entry(&mut v, &mut p, false).unwrap();
        assert!(r.reinjected);
        assert_eq!(v.get(f::ENTRY_INTERRUPTION_INFO.encoding), VALID | 0x30);
        assert_eq!(v.get(f::GUEST_INTERRUPTIBILITY.encoding), 0);
    }

    #[test]
    fn a_pending_nmi_waits_for_its_window_then_is_delivered() {
        let mut v = Vmcs::default();
        // The guest is in an STI shadow: the NMI cannot go in; the window
        // exit is asked for.
        v.set(
            f::GUEST_INTERRUPTIBILITY.encoding,
            u64::from(BLOCKING_BY_STI),
        );
        let mut p = Pending::default();
        let r = prepare_entry(&mut v, &mut p, true).unwrap();
        assert!(!r.nmi_delivered);
        assert!(p.nmi_window);
        assert_eq!(
            v.get(f::PRIMARY_PROC_CONTROLS.encoding) & NMI_WINDOW,
            NMI_WINDOW
        );
        assert_eq!(v.get(f::ENTRY_INTERRUPTION_INFO.encoding), 0);
        // The window opens: the NMI is injected and the window closed.
        v.set(f::GUEST_INTERRUPTIBILITY.encoding, 0);
        let r = prepare_entry(&mut v, &mut p, true).unwrap();
        assert!(r.nmi_delivered);
        assert!(!p.nmi_window);
        assert_eq!(v.get(f::PRIMARY_PROC_CONTROLS.encoding) & NMI_WINDOW, 0);
        assert_eq!(
            v.get(f::ENTRY_INTERRUPTION_INFO.encoding),
            VALID | (u64::from(TYPE_NMI) << 8) | 2
        );
    }

    #[test]
    fn read_exit_takes_the_operand_registers() {
        let mut v = Vmcs::default();
        v.set(f::EXIT_REASON.encoding, 31);
        let regs = GuestRegs {
            rax: 1,
            rcx: 0xc000_0080,
            rdx: 2,
            ..GuestRegs::default()
        };
        let x = read_exit(&v, &regs).unwrap();
        assert_eq!((x.reason, x.rax, x.rcx, x.rdx), (31, 1, 0xc000_0080, 2));
    }
}
