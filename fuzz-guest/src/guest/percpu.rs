//! Each vCPU's state, at the bottom of its stack: found from RSP, so no
//! MSR the operations write (FS, GS) can lose it.

/// Bytes per vCPU stack (the state sits at its bottom).
pub const STACK_SIZE: usize = 0x1_0000;

/// Where, in each vCPU's stack block, the exception stack (IST1) ends ...
pub const IST_EXCEPTIONS: usize = 0x6000;
/// ... the NMI stack (IST2) ends ...
pub const IST_NMI: usize = 0x8000;
/// ... and the sacrificial stack foreign code runs on ([0x1000, 0x3000)).
pub const SACRIFICIAL: usize = 0x3000;
/// Its size.
pub const SACRIFICIAL_LEN: usize = 0x2000;
/// What fills the sacrificial stack: a non-canonical address, so that any
/// return or stack switch to a value from it faults at once.
pub const SACRIFICIAL_FILL: u64 = 0xDEAD_0000_0000_0000;

/// Offsets the assembly uses.
pub const RECOVER_RIP: usize = 0;
pub const RECOVER_RSP: usize = 8;

/// One vCPU's state.
#[repr(C)]
pub struct PerCpu {
    /// Where a fault during an operation resumes (0: no operation runs).
    pub recover_rip: u64,
    /// The stack pointer it resumes with.
    pub recover_rsp: u64,
    /// The last fault's vector (0xFF: none).
    pub vector: u64,
    /// Its error code.
    pub error: u64,
    /// CR2 for a page fault, DR6 for a debug exception.
    pub addr: u64,
    /// NMIs taken.
    pub nmis: u64,
    /// External interrupts taken.
    pub irqs: u64,
    /// The last external interrupt's vector.
    pub last_irq: u64,
    /// This vCPU's index.
    pub cpu: u64,
    /// Faults taken while no operation ran.
    pub stray: u64,
    /// The index of the operation this vCPU runs.
    pub op: u64,
    /// Set while foreign code runs (`exec::run_foreign`).
    pub foreign: u64,
    /// Foreign code that another vCPU found halted or looping, and took
    /// back to its recovery point with an NMI.
    pub rescued: u64,
}

const _: () = assert!(core::mem::offset_of!(PerCpu, recover_rip) == RECOVER_RIP);
const _: () = assert!(core::mem::offset_of!(PerCpu, recover_rsp) == RECOVER_RSP);

/// The state of the vCPU whose stack holds `sp`.
pub fn of_sp(sp: u64) -> *mut PerCpu {
    (sp & !(STACK_SIZE as u64 - 1)) as *mut PerCpu
}

/// vCPU `cpu`'s state (read by another vCPU: only with volatile loads).
pub fn of_cpu(cpu: u32) -> *mut PerCpu {
    // SAFETY: only the address of the stacks is taken.
    let stacks = core::ptr::addr_of!(crate::boot::fz_stacks) as u64;
    (stacks + u64::from(cpu) * STACK_SIZE as u64) as *mut PerCpu
}

/// The running vCPU's state.
pub fn this() -> &'static mut PerCpu {
    let sp: u64;
    // SAFETY: reads RSP only.
    unsafe { core::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack)) };
    // SAFETY: every stack the program runs on is one of `fz_stacks`, whose
    // bottom holds this vCPU's state; only this vCPU uses it (handlers run
    // on the same stack and do not overlap an access from the code they
    // interrupt to the same field).
    unsafe { &mut *of_sp(sp) }
}
