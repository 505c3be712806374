//! VMX data: typed VMCS fields, capability arithmetic and the exit decoder.
//! The instructions that act on them live in the binary's `arch` module.

pub mod ap;
pub mod caps;
pub mod cr;
pub mod debug;
pub mod entry;
pub mod event;
pub mod exit;
pub mod fields;
pub mod handle;
pub mod port;
pub mod profile;
pub mod regs;
pub mod route;
pub mod shadow;
