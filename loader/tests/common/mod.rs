//! Helpers shared by the loader's host tests.
#![allow(dead_code)]

pub const MIB: u64 = 0x10_0000;
pub const GIB: u64 = 0x4000_0000;

/// A tiny deterministic RNG (xorshift64*), so failures reproduce.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}
