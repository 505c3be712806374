//! Entry and return trampolines for hooked fentry sites, the patch
//! encodings, and the `pt_regs` layout they share with Linux.
#![no_std]

pub mod ptregs;

pub use ptregs::PtRegs;
