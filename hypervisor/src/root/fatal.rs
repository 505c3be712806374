//! What VMX root does when something goes wrong in root itself: an
//! exception taken in root, a panic, and the NMIs that arrive while root
//! runs.
//!
//! - An NMI taken in root belongs to the guest (root has no NMI sources of
//!   its own): the handler marks it pending and returns; the run loop
//!   injects it at the next entry that can take it.
//! - Any other exception in root is a hypervisor bug or an attack that got
//!   through: it is reported with the faulting state, and the machine is
//!   powered off. Root never returns into code that faulted and never halts
//!   silently. A panic ends the same way ([`die`]).
//!
//! The report is one line of at most [`protocol::MAX_FATAL_REASON`] bytes,
//! formatted on the stack, and goes two ways: an `error:` line on the log
//! port, and an [`Event::Fatal`](protocol::Event::Fatal) frame on COM2 once
//! the control UART is known ([`set_control_port`]), for hosts that do not
//! capture the log port. Both bypass every lock the failing code may hold
//! (the log's, the control channel's): the log port is written directly, and
//! the frame goes straight to the UART's registers ([`crate::uart::FatalTx`])
//! with a bounded wait. The frame starts with a delimiter, which ends a
//! frame the control channel had half sent. Nothing on the path allocates.
//!
//! Then the machine is powered off (ACPI PM1a). When that does not take,
//! root halts with interrupts off on its own IDT, reloaded first: an NMI
//! wakes the CPU into root's NMI gate, which marks the NMI pending and
//! returns to the halt.

use crate::arch::instructions::{self as insn, TrapFrame};
use crate::logger::DebugPort;
use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use hypervisor::acpi::MAX_CPUS;

/// Per CPU (by root's CPU index, `arch::cpu::this_cpu`): an NMI arrived
/// for the guest and is not injected yet.
static NMI_PENDING: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];
/// NMIs taken while root ran (through root's IDT, not as an exit).
static NMIS_IN_ROOT: AtomicU64 = AtomicU64::new(0);
/// The ACPI PM1a control port, for a power-off from any context (0: none).
static PM1A_CNT: AtomicU32 = AtomicU32::new(0);
/// Per CPU: set while root runs its NMI handler through INT 2 after an NMI
/// exit, so that the handler does not count it as an NMI that interrupted
/// root.
static SOFT_NMI: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];
/// Set once the fatal path runs, so that a fault inside it only halts.
static DYING: AtomicBool = AtomicBool::new(false);
/// The control UART's base port, for the fatal report (0: none).
static CONTROL_UART: AtomicU16 = AtomicU16::new(0);

/// Records where the platform's power-off lives.
pub fn set_power_off_port(port: Option<u16>) {
    PM1A_CNT.store(port.map_or(0, u32::from), Ordering::Relaxed);
}

/// Records the control UART, programmed by [`crate::uart::Uart::init`]:
/// from now on the fatal report goes to the host on COM2 as well.
pub fn set_control_port(base: Option<u16>) {
    CONTROL_UART.store(base.unwrap_or(0), Ordering::Release);
}

/// This CPU's slot in a per-CPU table (CPUs past the table share the last
/// slot; root never starts them).
fn slot<T>(table: &[T; MAX_CPUS], cpu: usize) -> &T {
    // In bounds: the index is clamped to the table's length less one.
    #[allow(clippy::indexing_slicing)]
    &table[cpu.min(MAX_CPUS - 1)]
}

/// Marks an NMI as pending for the guest on this CPU.
pub fn nmi_arrived() {
    slot(&NMI_PENDING, crate::arch::cpu::this_cpu()).store(true, Ordering::Release);
}

/// An NMI exit: the NMI is the guest's. Root runs its own handler through
/// INT 2, which marks the NMI pending and, by its IRET, lifts the NMI
/// blocking that the exit left in root.
pub fn nmi_exit(cpu: usize) {
    slot(&SOFT_NMI, cpu).store(true, Ordering::Release);
    insn::run_nmi_handler();
}

/// Takes CPU `cpu`'s pending NMI, if any.
pub fn take_nmi(cpu: usize) -> bool {
    slot(&NMI_PENDING, cpu).swap(false, Ordering::AcqRel)
}

/// Whether an NMI is pending on CPU `cpu`.
pub fn nmi_pending(cpu: usize) -> bool {
    slot(&NMI_PENDING, cpu).load(Ordering::Acquire)
}

/// NMIs that interrupted root itself.
pub fn nmis_in_root() -> u64 {
    NMIS_IN_ROOT.load(Ordering::Relaxed)
}

/// Powers the machine off (ACPI S5 through PM1a), then halts for good.
pub fn power_off_and_halt() -> ! {
    let port = PM1A_CNT.load(Ordering::Relaxed);
    if port != 0 {
        crate::ports::forward_out(port as u16, 2, hypervisor::policy::PM1_SLP_EN);
    }
    halt()
}

/// Halts for good with interrupts off, on root's own IDT (see the module
/// documentation).
fn halt() -> ! {
    crate::arch::cpu::reload_root_idt();
    insn::halt_forever()
}

/// Reports a fatal condition in root (the log port and, once it is known,
/// COM2) and stops the machine.
pub fn die(args: core::fmt::Arguments<'_>) -> ! {
    if DYING.swap(true, Ordering::AcqRel) {
        halt();
    }
    let mut reason = Reason::new();
    let _ = reason.write_fmt(args);
    let reason = reason.as_str();
    let mut w = DebugPort;
    let _ = w.write_str("hvtrace: error: ");
    let _ = w.write_str(reason);
    let _ = w.write_str("\nhvtrace: guest stopped: hypervisor fault\n");
    let base = CONTROL_UART.load(Ordering::Acquire);
    if base != 0 {
        let mut tx = crate::uart::FatalTx::new(base);
        protocol::encode_fatal(reason, |b| tx.put(b));
        tx.drain();
    }
    power_off_and_halt()
}

/// The fatal report's text: one line of at most
/// [`protocol::MAX_FATAL_REASON`] bytes, in a buffer on the stack. Line
/// breaks become spaces (a panic message may have some; the host reads
/// lines); what does not fit is cut at a character boundary.
struct Reason {
    buf: [u8; protocol::MAX_FATAL_REASON],
    len: usize,
}

impl Reason {
    fn new() -> Self {
        Self {
            buf: [0; protocol::MAX_FATAL_REASON],
            len: 0,
        }
    }

    fn as_str(&self) -> &str {
        let bytes = self.buf.get(..self.len).unwrap_or_default();
        // Only whole characters are copied in, so this never fails.
        core::str::from_utf8(bytes).unwrap_or("(unprintable fatal report)")
    }
}

impl Write for Reason {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for c in s.chars() {
            let c = if matches!(c, '\n' | '\r') { ' ' } else { c };
            let mut utf8 = [0u8; 4];
            let bytes = c.encode_utf8(&mut utf8).as_bytes();
            let Some(slot) = self.buf.get_mut(self.len..self.len + bytes.len()) else {
                return Err(core::fmt::Error);
            };
            slot.copy_from_slice(bytes);
            self.len += bytes.len();
        }
        Ok(())
    }
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
        let soft = slot(&SOFT_NMI, crate::arch::cpu::this_cpu());
        if !soft.swap(false, Ordering::AcqRel) {
            NMIS_IN_ROOT.fetch_add(1, Ordering::Relaxed);
        }
        nmi_arrived();
        return;
    }
    let name = NAMES
        .get((frame.vector % 32) as usize)
        .copied()
        .unwrap_or("?");
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

/// The note a root fault report gets when it looks like a stack overflow
/// (`rootstack::guard_hit`: the fault address (CR2) is in the guard page
/// under one of root's stacks, the boot processor's or an AP's, or the
/// interrupted RSP is in it or at the stack's very bottom). Prints
/// nothing otherwise.
struct StackOverflow(u64, u64);

impl core::fmt::Display for StackOverflow {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let &StackOverflow(rsp, cr2) = self;
        if let Some((guard, bottom, top)) = crate::rootstack::guard_hit(rsp, cr2) {
            write!(
                f,
                "; root stack overflow: guard page {guard:#x}..{bottom:#x} hit (stack {bottom:#x}..{top:#x}, CPU {})",
                crate::arch::cpu::this_cpu()
            )?;
        }
        Ok(())
    }
}
