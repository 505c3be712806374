//! Window digests: FNV-1a over each operation's index, kind and outcome.

/// An FNV-1a 64-bit hash in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest(pub u64);

impl Default for Digest {
    fn default() -> Digest {
        Digest::new()
    }
}

impl Digest {
    /// The empty digest.
    pub const fn new() -> Digest {
        Digest(0xCBF2_9CE4_8422_2325)
    }

    /// Adds the eight bytes of `v`.
    pub fn add(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01B3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_fnv1a() {
        // FNV-1a of eight zero bytes.
        let mut d = Digest::new();
        d.add(0);
        let mut h: u64 = 0xCBF2_9CE4_8422_2325;
        for _ in 0..8 {
            h = h.wrapping_mul(0x100_0000_01B3);
        }
        assert_eq!(d.0, h);
        let mut e = Digest::new();
        e.add(1);
        assert_ne!(d, e);
    }
}
