//! The hvtrace boot path and the Linux boot protocol for its guest.
//!
//! - [`layout`]: the guest-physical memory map, in one place.
//! - [`e820`]: the guest's memory map and placement queries.
//! - [`bzimage`]: parsing and checking the guest kernel image.
//! - [`bootparams`]: the zero page handed to the kernel.
//! - [`guest_tables`]: the guest's initial GDT and page tables.
//! - [`plan`]: where the kernel is loaded.
//! - [`multiboot`]: what GRUB or QEMU hand over at boot.
//!
//! Everything but `entry` is plain data manipulation that builds and is
//! tested on the host.
// Unit tests (multiboot's among them) use std's prelude; the library itself
// is no_std, which the x86_64-unknown-none build checks.
#![cfg_attr(not(test), no_std)]

pub mod bootparams;
pub mod bzimage;
pub mod e820;
#[cfg(target_os = "none")]
pub mod entry;
pub mod guest_tables;
pub mod layout;
pub mod multiboot;
pub mod plan;

pub use bootparams::{build as build_boot_params, BootError, BootParams, GuestBootConfig};
pub use bzimage::{parse as parse_bzimage, BzImage, BzImageError};
pub use e820::{E820Entry, E820Error, E820Kind, E820Map};
pub use layout::{Gpa, Gva, Hpa};
pub use plan::{entry_point, plan_kernel_load, ENTRY_OFFSET_64};
