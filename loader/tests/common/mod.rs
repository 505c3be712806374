//! Helpers shared by the loader's host tests.
#![allow(dead_code)]

pub const MIB: u64 = 0x10_0000;
pub const GIB: u64 = 0x4000_0000;

pub use test_support::Rng as XorShift;
