//! What VMX root does when something goes wrong in root itself: an
//! exception taken in root, a panic, and the NMIs that arrive while root
//! runs.
//!
//! - An NMI taken in root belongs to the guest (root has no NMI sources of
//!   its own): the handler marks it pending and returns; the run loop
//!   injects it at the next entry that can take it.
//! - Any other exception in root is a hypervisor bug or an attack that got
//!   through: it is reported on the log port with the faulting state, and
//!   the machine is powered off. Root never returns into code that faulted
//!   and never halts silently.
//!
//! The report bypasses the log's lock: the fault may have hit while root
//! held it.

use crate::arch::instructions::{self as insn, TrapFrame};
use crate::logger::DebugPort;
use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// An NMI arrived for the guest and is not injected yet.
static NMI_PENDING: AtomicBool = AtomicBool::new(false);
/// NMIs taken while root ran (through root's IDT, not as an exit).
static NMIS_IN_ROOT: AtomicU64 = AtomicU64::new(0);
/// The ACPI PM1a control port, for a power-off from any context (0: none).
static PM1A_CNT: AtomicU32 = AtomicU32::new(0);
/// Set while root runs its NMI handler through INT 2 after an NMI exit, so
/// that the handler does not count it as an NMI that interrupted root.
static SOFT_NMI: AtomicBool = AtomicBool::new(false);
/// Set once the fatal path runs, so that a fault inside it only halts.
static DYING: AtomicBool = AtomicBool::new(false);

/// Records where the platform's power-off lives.
pub fn set_power_off_port(port: Option<u16>) {
    PM1A_CNT.store(port.map_or(0, u32::from), Ordering::Relaxed);
}

/// Marks an NMI as pending for the guest.
pub fn nmi_arrived() {
    NMI_PENDING.store(true, Ordering::Release);
}

/// An NMI exit: the NMI is the guest's. Root runs its own handler through
/// INT 2, which marks the NMI pending and, by its IRET, lifts the NMI
/// blocking that the exit left in root.
pub fn nmi_exit() {
    SOFT_NMI.store(true, Ordering::Release);
    insn::run_nmi_handler();
}

/// Takes the pending NMI, if any.
pub fn take_nmi() -> bool {
    NMI_PENDING.swap(false, Ordering::AcqRel)
}

/// Whether an NMI is pending.
pub fn nmi_pending() -> bool {
    NMI_PENDING.load(Ordering::Acquire)
}

/// NMIs that interrupted root itself.
pub fn nmis_in_root() -> u64 {
    NMIS_IN_ROOT.load(Ordering::Relaxed)
}

/// Powers the machine off (ACPI S5 through PM1a), then halts for good.
pub fn power_off_and_halt() -> ! {
    let port = PM1A_CNT.load(Ordering::Relaxed);
    if port != 0 {
        crate::exits::forward_out(port as u16, 2, hypervisor::policy::PM1_SLP_EN);
    }
    insn::halt_forever()
}

/// Reports a fatal condition in root on the log port and stops the machine.
pub fn die(args: core::fmt::Arguments<'_>) -> ! {
    if DYING.swap(true, Ordering::AcqRel) {
        insn::halt_forever();
    }
    let mut w = DebugPort;
    let _ = w.write_str("hvtrace: error: ");
    let _ = w.write_fmt(args);
    let _ = w.write_str("\nhvtrace: guest stopped: hypervisor fault\n");
    power_off_and_halt()
}

const NAMES: [&str; 32] = [
    "#DE",
    "#DB",
    "NMI",
    "#BP",
    "#OF",
    "#BR",
    "#UD",
    "#NM",
    "#DF",
    "vector 9",
    "#TS",
    "#NP",
    "#SS",
    "#GP",
    "#PF",
    "vector 15",
    "#MF",
    "#AC",
    "#MC",
    "#XM",
    "#VE",
    "#CP",
    "vector 22",
    "vector 23",
    "vector 24",
    "vector 25",
    "vector 26",
    "vector 27",
    "#HV",
    "#VC",
    "#SX",
    "vector 31",
];

/// Called by the exception stubs of root's IDT.
#[unsafe(no_mangle)]
extern "C" fn hv_root_trap(frame: &mut TrapFrame) {
    if frame.vector == 13 {
        if let Some(resume) = insn::fixup_for(frame.rip) {
            frame.rip = resume;
            return;
        }
    }
    if frame.vector == 2 {
        if !SOFT_NMI.swap(false, Ordering::AcqRel) {
            NMIS_IN_ROOT.fetch_add(1, Ordering::Relaxed);
        }
        nmi_arrived();
        return;
    }
    let name = NAMES[(frame.vector % 32) as usize];
    let cr2 = insn::read_cr2();
    die(format_args!(
        "hypervisor fault in VMX root: {name} error code {:#x} at rip {:#x} rsp {:#x} rflags {:#x} cr2 {cr2:#x}{}",
        frame.error_code,
        frame.rip,
        frame.rsp,
        frame.rflags,
        StackOverflow(frame.rsp, cr2),
    ))
}

/// The note a root fault report gets when it looks like a stack overflow:
/// the fault address (CR2) is in the guard page under root's stack, or the
/// interrupted RSP is in it or at the stack's very bottom (a #PF on the
/// guard cannot be delivered on that stack and becomes #DF, whose frame
/// keeps the RSP of the overflowing code). Prints nothing otherwise.
struct StackOverflow(u64, u64);

impl core::fmt::Display for StackOverflow {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let &StackOverflow(rsp, cr2) = self;
        let guard = loader::entry::stack_guard();
        let bottom = guard + 4096;
        if (guard..bottom).contains(&cr2) || (guard..=bottom).contains(&rsp) {
            write!(
                f,
                "; root stack overflow: guard page {guard:#x}..{bottom:#x} hit (stack {bottom:#x}..{:#x})",
                loader::entry::stack_top()
            )?;
        }
        Ok(())
    }
}
