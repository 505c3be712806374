//! CPU-facing code of the bare-metal binary: the instruction wrappers (the
//! only `asm!` in the hypervisor) and the host descriptor tables.

pub mod ap_start;
pub mod cpu;
pub mod instructions;
