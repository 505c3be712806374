//! The program's random numbers: SplitMix64, one stream per vCPU.
//!
//! Small, fast and fully determined by (seed, vCPU), so a run can be
//! replayed operation by operation on the host.

/// A SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// The stream of vCPU `cpu` for `seed`.
    pub fn new(seed: u64, cpu: u32) -> Rng {
        let mut r = Rng {
            state: seed ^ (u64::from(cpu).wrapping_add(1)).wrapping_mul(0xA076_1D64_78BD_642F),
        };
        // Mix the seed in before the first value is used.
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0; 0 gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// True with probability `num`/`den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// One element of `items` (which must not be empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        let i = self.below(items.len() as u64) as usize;
        items[i.min(items.len() - 1)]
    }

    /// A value with a few random bits set, or fully random now and then:
    /// random operands are mostly near the interesting edges.
    pub fn bits(&mut self) -> u64 {
        match self.below(6) {
            0 => 0,
            1 => self.next_u64(),
            2 => 1 << self.below(64),
            3 => !(1u64 << self.below(64)),
            4 => self.next_u64() & 0xFFFF_FFFF,
            _ => (1 << self.below(64)) | (1 << self.below(64)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_differ_by_cpu() {
        let mut a = Rng::new(42, 0);
        let mut b = Rng::new(42, 0);
        let mut c = Rng::new(42, 1);
        let xs: [u64; 8] = core::array::from_fn(|_| a.next_u64());
        let ys: [u64; 8] = core::array::from_fn(|_| b.next_u64());
        let zs: [u64; 8] = core::array::from_fn(|_| c.next_u64());
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
        // SplitMix64's first output for state 0 after one step is known.
        let mut z = Rng { state: 0 };
        assert_eq!(z.next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = Rng::new(7, 0);
        for n in [1u64, 2, 3, 10, 1000, u64::MAX] {
            for _ in 0..1000 {
                assert!(r.below(n) < n);
            }
        }
        assert_eq!(r.below(0), 0);
    }
}
