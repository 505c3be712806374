//! Entry and return trampolines for hooked fentry sites, the patch
//! encodings, and the `pt_regs` layout they share with Linux.
//!
//! - [`ptregs`]: `struct pt_regs` as the kernel lays it out, every offset
//!   asserted at compile time.
//! - [`abi`]: the hypercall ABI between the trampolines and VMX root: which
//!   registers carry what, what VMX root may change, the return frame.
//! - [`region`]: [`TrampolineRegion`], the generated code page (entry and
//!   return trampolines) for a given guest-virtual base.
//! - [`patch`]: NOP5, `call rel32` with range checking and decoding,
//!   ENDBR64 / sealed ENDBR recognition.
//!
//! The machine code is produced by a small x86-64 encoder in this crate;
//! there is no assembler at build time and no inline assembly. Host tests
//! (`tests/native.rs`) map the generated page into executable memory and
//! run it, with each VMCALL replaced by a call to a Rust function
//! (`HypercallMode::CallHook`, behind the `call-hook` feature).
#![no_std]
#![forbid(unsafe_code)]

pub mod abi;
mod enc;
pub mod patch;
pub mod ptregs;
pub mod region;

pub use abi::{Hypercall, ReturnFrame};
pub use ptregs::PtRegs;
pub use region::{BuildError, HypercallMode, PathStats, TrampolineRegion};

/// A guest-virtual address: the workspace's one type, from the loader's
/// layout.
pub use loader::layout::Gva;
