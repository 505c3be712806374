//! The fuzzing guest's shared half: the seeded operation stream, the
//! outcome digests and the list of documented differences between root and
//! the bare CPU.
//!
//! The bare-metal program (`src/guest/`) draws its operations from here and
//! the host driver regenerates the same stream to name the operation behind
//! a differing window, so both sides agree by construction. Nothing here
//! touches hardware; it is all host-tested.
#![no_std]

pub mod cmdline;
pub mod digest;
pub mod known;
pub mod ops;
pub mod rng;

/// The address the program is linked at and asks to be loaded at (64 MiB:
/// above the hypervisor's memory, inside the smallest guest RAM).
pub const LINK_BASE: u64 = 0x400_0000;

/// A 2 MiB region the program maps with 4 KiB pages to play with its own
/// page tables (identity-mapped like the rest of the low 4 GiB).
pub const SCRATCH_BASE: u64 = 0x600_0000;

/// The most vCPUs the program runs on.
pub const MAX_CPUS: usize = 4;

/// The prefix of every line the program prints.
pub const LINE_PREFIX: &str = "fuzz: ";
