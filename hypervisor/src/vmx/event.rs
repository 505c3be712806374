//! Events delivered to the guest at VM entry (SDM 26.6 "Event injection",
//! 28.2.4 "Information for VM exits that occur during event delivery",
//! 27.3.1.5 "Checks on guest non-register state").
//!
//! Three sources compete for the one injection slot of an entry:
//! - the exit handler's own event (a #GP, #UD or #DB it decided on);
//! - the event whose delivery the exit interrupted (IDT-vectoring
//!   information), which must be delivered again or it is lost;
//! - an NMI that VMX root took for the guest ("NMI exiting" on), held
//!   pending until the guest can take it.
//!
//! [`plan_entry`] decides, as a pure function, what goes into the slot and
//! whether NMI-window exiting must stay on, so the rules are tested on the
//! host.

/// Interruption types (bits 10:8 of the information fields).
pub const TYPE_EXTERNAL: u8 = 0;
/// Non-maskable interrupt.
pub const TYPE_NMI: u8 = 2;
/// Hardware exception.
pub const TYPE_HARDWARE_EXCEPTION: u8 = 3;
/// Software interrupt (INT n).
pub const TYPE_SOFTWARE_INTERRUPT: u8 = 4;
/// Privileged software exception (INT1).
pub const TYPE_PRIVILEGED_SOFTWARE_EXCEPTION: u8 = 5;
/// Software exception (INT3, INTO).
pub const TYPE_SOFTWARE_EXCEPTION: u8 = 6;

/// Guest interruptibility state bits (SDM Table 25-3).
pub const BLOCKING_BY_STI: u32 = 1 << 0;
/// Blocking by MOV SS / POP SS.
pub const BLOCKING_BY_MOV_SS: u32 = 1 << 1;
/// Blocking by SMI.
pub const BLOCKING_BY_SMI: u32 = 1 << 2;
/// Blocking by NMI (virtual-NMI blocking when "virtual NMIs" is on).
pub const BLOCKING_BY_NMI: u32 = 1 << 3;

/// The NMI vector.
pub const NMI_VECTOR: u8 = 2;

const VALID: u32 = 1 << 31;
const HAS_ERROR_CODE: u32 = 1 << 11;

/// Blocking by STI or by MOV SS: what an instruction that completes ends.
pub const BLOCKING_BY_STI_OR_MOV_SS: u32 = BLOCKING_BY_STI | BLOCKING_BY_MOV_SS;

/// Whether interruption information (exit, IDT-vectoring or entry) holds
/// an event: its valid bit (bit 31).
pub const fn info_valid(info: u32) -> bool {
    info & VALID != 0
}

/// The interruption type of interruption information (bits 10:8, a
/// `TYPE_*`).
pub const fn info_type(info: u32) -> u8 {
    ((info >> 8) & 7) as u8
}

/// The current privilege level, from the guest's SS access rights: their
/// DPL field (bits 6:5), which the CPU keeps equal to CPL (SDM 26.3.1.5).
pub const fn cpl_from_ss_ar(ss_ar: u32) -> u8 {
    ((ss_ar >> 5) & 3) as u8
}

/// One event to deliver at VM entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// IDT vector.
    pub vector: u8,
    /// Interruption type (`TYPE_*`).
    pub kind: u8,
    /// The error code to push, for exceptions that have one.
    pub error_code: Option<u32>,
    /// VM-entry instruction length, for software interrupts and exceptions
    /// (the return address the guest's handler sees is RIP plus this).
    pub instruction_len: u32,
}

impl Event {
    /// A hardware exception (#GP, #UD, #DB, ...).
    pub const fn exception(vector: u8, error_code: Option<u32>) -> Event {
        Event {
            vector,
            kind: TYPE_HARDWARE_EXCEPTION,
            error_code,
            instruction_len: 0,
        }
    }

    /// A non-maskable interrupt.
    pub const fn nmi() -> Event {
        Event {
            vector: NMI_VECTOR,
            kind: TYPE_NMI,
            error_code: None,
            instruction_len: 0,
        }
    }

    /// The event that an exit interrupted, from the IDT-vectoring
    /// information and error-code fields and the exit's instruction length
    /// (which is the length of the INT n / INT3 / INTO / INT1 that raised
    /// it, for software events). `None` when bit 31 is clear.
    pub fn from_vectoring(info: u32, error_code: u32, instruction_len: u32) -> Option<Event> {
        if info & VALID == 0 {
            return None;
        }
        let kind = info_type(info);
        let software = matches!(
            kind,
            TYPE_SOFTWARE_INTERRUPT | TYPE_PRIVILEGED_SOFTWARE_EXCEPTION | TYPE_SOFTWARE_EXCEPTION
        );
        Some(Event {
            vector: info as u8,
            kind,
            error_code: (info & HAS_ERROR_CODE != 0).then_some(error_code),
            instruction_len: if software { instruction_len } else { 0 },
        })
    }

    /// The VM-entry interruption-information field for this event.
    pub fn entry_info(&self) -> u32 {
        let mut info = VALID | (u32::from(self.kind) << 8) | u32::from(self.vector);
        if self.error_code.is_some() {
            info |= HAS_ERROR_CODE;
        }
        info
    }

    /// Whether the entry needs the instruction-length field.
    pub fn needs_instruction_len(&self) -> bool {
        matches!(
            self.kind,
            TYPE_SOFTWARE_INTERRUPT | TYPE_PRIVILEGED_SOFTWARE_EXCEPTION | TYPE_SOFTWARE_EXCEPTION
        )
    }
}

/// What the next VM entry does with events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPlan {
    /// The event to inject, if any.
    pub inject: Option<Event>,
    /// Whether the pending NMI went into the slot (and is no longer pending).
    pub nmi_delivered: bool,
    /// Whether "NMI-window exiting" must be on for this entry.
    pub nmi_window: bool,
    /// The guest interruptibility state to load.
    pub interruptibility: u32,
    /// Whether a re-injected event came from the IDT-vectoring field.
    pub reinjected: bool,
}

/// Decides the injection for the next entry.
///
/// - The handler's own event wins (instruction exits never happen during
///   event delivery, so it does not race a vectored event in practice).
/// - Otherwise the interrupted event is delivered again. Re-injecting an
///   NMI clears virtual-NMI blocking first (the entry checks forbid an NMI
///   injection with blocking by NMI set, and its first delivery never
///   completed).
/// - A pending NMI takes a free slot only when the guest is not blocking
///   NMIs (virtual-NMI blocking) and has no STI or MOV-SS shadow (the SDM
///   lets a CPU refuse an NMI injection under an STI shadow). Otherwise the
///   NMI stays pending and NMI-window exiting brings the next chance.
pub fn plan_entry(
    handler: Option<Event>,
    vectoring: Option<Event>,
    nmi_pending: bool,
    interruptibility: u32,
) -> EntryPlan {
    let mut intr = interruptibility;
    let reinjected = handler.is_none() && vectoring.is_some();
    let inject = handler.or(vectoring);
    if let Some(e) = inject {
        if reinjected && e.kind == TYPE_NMI {
            intr &= !BLOCKING_BY_NMI;
        }
        if e.kind == TYPE_EXTERNAL || e.kind == TYPE_NMI {
            // Entry checks: no MOV-SS (and, for external interrupts, STI)
            // blocking with such an injection. The interrupted delivery
            // began after any shadow had expired.
            intr &= !(BLOCKING_BY_MOV_SS | BLOCKING_BY_STI);
        }
        return EntryPlan {
            inject,
            nmi_delivered: false,
            nmi_window: nmi_pending,
            interruptibility: intr,
            reinjected,
        };
    }
    let blocked = intr & (BLOCKING_BY_NMI | BLOCKING_BY_MOV_SS | BLOCKING_BY_STI) != 0;
    if nmi_pending && !blocked {
        return EntryPlan {
            inject: Some(Event::nmi()),
            nmi_delivered: true,
            nmi_window: false,
            interruptibility: intr,
            reinjected: false,
        };
    }
    EntryPlan {
        inject: None,
        nmi_delivered: false,
        nmi_window: nmi_pending,
        interruptibility: intr,
        reinjected: false,
    }
}

/// The double-fault vector.
pub const DF_VECTOR: u8 = 8;

/// What the CPU does when an exception arises while it delivers another
/// event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nested {
    /// Deliver this event (the interrupted one is lost, as on hardware).
    Deliver(Event),
    /// Shutdown: a fault while delivering a double fault (a triple fault).
    Shutdown,
}

/// The exception classes of SDM Vol. 3A table 6-4.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Benign,
    Contributory,
    PageFault,
    DoubleFault,
}

/// The class of an event: hardware exceptions by vector (#DE, #TS, #NP,
/// #SS, #GP, #CP contributory; #PF, #VE page faults; #DF), everything else
/// (interrupts, NMIs, INT n, INT3, INTO, INT1) benign.
fn class(e: &Event) -> Class {
    if e.kind != TYPE_HARDWARE_EXCEPTION {
        return Class::Benign;
    }
    match e.vector {
        0 | 10 | 11 | 12 | 13 | 21 => Class::Contributory,
        14 | 20 => Class::PageFault,
        DF_VECTOR => Class::DoubleFault,
        _ => Class::Benign,
    }
}

/// The event to deliver when the hardware exception `fault` arises while
/// the CPU delivers `first` (the IDT-vectoring information of the exit;
/// `None` when the exit interrupted no delivery): SDM Vol. 3A table 6-5.
/// A contributory fault during a contributory exception or a page fault,
/// and a page fault during a page fault, become #DF(0); a contributory
/// fault or a page fault during #DF is a shutdown; anything else is
/// delivered serially (the fault itself).
pub fn nested_fault(first: Option<&Event>, fault: Event) -> Nested {
    let Some(first) = first else {
        return Nested::Deliver(fault);
    };
    let second = class(&fault);
    let serious = matches!(second, Class::Contributory | Class::PageFault);
    match class(first) {
        Class::DoubleFault if serious => Nested::Shutdown,
        Class::PageFault if serious => Nested::Deliver(Event::exception(DF_VECTOR, Some(0))),
        Class::Contributory if second == Class::Contributory => {
            Nested::Deliver(Event::exception(DF_VECTOR, Some(0)))
        }
        _ => Nested::Deliver(fault),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_during_delivery_follows_the_double_fault_rules() {
        let gp = Event::exception(13, Some(0));
        let df = Nested::Deliver(Event::exception(DF_VECTOR, Some(0)));
        assert_eq!(nested_fault(None, gp), Nested::Deliver(gp));
        // Benign first events: the fault is delivered, the event lost.
        let ext = Event::from_vectoring(VALID | 0x31, 0, 0).unwrap();
        let int_13 = Event::from_vectoring(VALID | (4 << 8) | 13, 0, 2).unwrap();
        for first in [
            ext,
            Event::nmi(),
            int_13,
            Event::exception(1, None),
            Event::exception(6, None),
        ] {
            assert_eq!(
                nested_fault(Some(&first), gp),
                Nested::Deliver(gp),
                "{first:?}"
            );
        }
        // Contributory or #PF first: #DF.
        for first in [
            Event::exception(0, None),
            Event::exception(10, Some(8)),
            Event::exception(13, Some(0)),
            Event::exception(21, Some(1)),
            Event::exception(14, Some(2)),
            Event::exception(20, None),
        ] {
            assert_eq!(nested_fault(Some(&first), gp), df, "{first:?}");
        }
        // #PF during a contributory exception is delivered serially; during
        // a #PF it is a #DF.
        let pf = Event::exception(14, Some(2));
        assert_eq!(
            nested_fault(Some(&Event::exception(13, Some(0))), pf),
            Nested::Deliver(pf)
        );
        assert_eq!(nested_fault(Some(&pf), pf), df);
        // During #DF: shutdown, for contributory faults and #PF alike.
        let first_df = Event::exception(DF_VECTOR, Some(0));
        assert_eq!(nested_fault(Some(&first_df), gp), Nested::Shutdown);
        assert_eq!(nested_fault(Some(&first_df), pf), Nested::Shutdown);
        // A benign fault during #DF is delivered.
        let ud = Event::exception(6, None);
        assert_eq!(nested_fault(Some(&first_df), ud), Nested::Deliver(ud));
    }

    #[test]
    fn interruption_fields_and_cpl_are_named() {
        // A #PF with an error code: valid, hardware exception.
        let pf = VALID | HAS_ERROR_CODE | (3 << 8) | 14;
        assert!(info_valid(pf));
        assert_eq!(info_type(pf), TYPE_HARDWARE_EXCEPTION);
        assert!(!info_valid(pf & !VALID));
        assert_eq!(
            info_type(VALID | (5 << 8) | 1),
            TYPE_PRIVILEGED_SOFTWARE_EXCEPTION
        );
        // SS access rights: a 64-bit kernel's 0x93 (DPL 0), a user's 0xf3 (DPL 3).
        assert_eq!(cpl_from_ss_ar(0x93), 0);
        assert_eq!(cpl_from_ss_ar(0xf3), 3);
        assert_eq!(cpl_from_ss_ar(0xc0b3), 1);
        assert_eq!(BLOCKING_BY_STI_OR_MOV_SS, 3);
    }

    #[test]
    fn vectoring_information_round_trips_into_entry_information() {
        // #PF with an error code, interrupted by an EPT violation.
        let info = VALID | HAS_ERROR_CODE | (3 << 8) | 14;
        let e = Event::from_vectoring(info, 0x2, 7).unwrap();
        assert_eq!(e, Event::exception(14, Some(2)));
        assert_eq!(e.entry_info(), info);
        assert!(!e.needs_instruction_len());
        // INT3 keeps its instruction length; an external interrupt does not.
        let int3 = Event::from_vectoring(VALID | (6 << 8) | 3, 0, 1).unwrap();
        assert_eq!(int3.instruction_len, 1);
        assert!(int3.needs_instruction_len());
        let ext = Event::from_vectoring(VALID | 0x31, 0, 3).unwrap();
        assert_eq!((ext.kind, ext.instruction_len), (TYPE_EXTERNAL, 0));
        // INT1 is a privileged software exception, re-injected as such.
        let int1 = Event::from_vectoring(VALID | (5 << 8) | 1, 0, 1).unwrap();
        assert_eq!(int1.entry_info() >> 8 & 7, 5);
        assert_eq!(Event::from_vectoring(0x0000_0b0e, 0, 0), None);
    }

    #[test]
    fn a_pending_nmi_waits_for_a_free_slot_and_an_open_window() {
        // Free slot, no blocking: the NMI goes in.
        let p = plan_entry(None, None, true, 0);
        assert_eq!(p.inject, Some(Event::nmi()));
        assert!(p.nmi_delivered && !p.nmi_window);
        assert_eq!(p.inject.unwrap().entry_info(), 0x8000_0202);
        // Each kind of blocking defers it to the NMI window.
        for b in [BLOCKING_BY_NMI, BLOCKING_BY_MOV_SS, BLOCKING_BY_STI] {
            let p = plan_entry(None, None, true, b);
            assert_eq!(p.inject, None, "blocking {b:#x}");
            assert!(!p.nmi_delivered && p.nmi_window);
            assert_eq!(p.interruptibility, b);
        }
        // Blocking by SMI alone does not hold an NMI back.
        assert!(plan_entry(None, None, true, BLOCKING_BY_SMI).nmi_delivered);
        // An occupied slot defers it too.
        let gp = Event::exception(13, Some(0));
        let p = plan_entry(Some(gp), None, true, 0);
        assert_eq!(p.inject, Some(gp));
        assert!(!p.nmi_delivered && p.nmi_window);
        // No NMI: no window.
        let p = plan_entry(None, None, false, BLOCKING_BY_NMI);
        assert_eq!((p.inject, p.nmi_window), (None, false));
    }

    #[test]
    fn an_interrupted_delivery_is_redone_unless_the_handler_injects() {
        let pf = Event::exception(14, Some(0));
        let p = plan_entry(None, Some(pf), false, 0);
        assert_eq!(p.inject, Some(pf));
        assert!(p.reinjected);
        let ud = Event::exception(6, None);
        let p = plan_entry(Some(ud), Some(pf), false, 0);
        assert_eq!(p.inject, Some(ud));
        assert!(!p.reinjected);
        // A redone NMI clears the virtual-NMI blocking its first try set.
        let p = plan_entry(
            None,
            Some(Event::nmi()),
            false,
            BLOCKING_BY_NMI | BLOCKING_BY_STI,
        );
        assert_eq!(p.inject, Some(Event::nmi()));
        assert_eq!(p.interruptibility, 0);
        // A redone external interrupt drops a stale STI shadow.
        let ext = Event::from_vectoring(VALID | 0xec, 0, 0).unwrap();
        let p = plan_entry(None, Some(ext), true, BLOCKING_BY_STI);
        assert_eq!(p.interruptibility, 0);
        assert!(p.nmi_window);
    }
}
