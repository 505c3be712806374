//! CRC-32 (IEEE 802.3, the one of zlib, PNG and Ethernet).
//!
//! Parameters: reflected polynomial `0xEDB8_8320` (0x04C11DB7 bit-reversed),
//! initial value `0xFFFF_FFFF`, final XOR `0xFFFF_FFFF`, input and output
//! reflected. Check value: `crc32(b"123456789") == 0xCBF4_3926`.
//!
//! One 256-entry table (1 KiB), built at compile time, one lookup per byte.

/// The reflected IEEE polynomial.
const POLY: u32 = 0xEDB8_8320;

/// `TABLE[i]` is the CRC register after shifting the byte `i` through eight
/// rounds of the bitwise algorithm.
static TABLE: [u32; 256] = build_table();

// Evaluated at compile time only: the indices are bounded by the loop
// conditions, and a mistake would fail the build, not a decode.
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
const fn build_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0usize;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                POLY ^ (crc >> 1)
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

/// An incremental CRC-32 computation.
///
/// ```
/// use protocol::crc32::{crc32, Crc32};
/// let mut c = Crc32::new();
/// c.update(b"1234");
/// c.update(b"56789");
/// assert_eq!(c.finish(), crc32(b"123456789"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crc32 {
    /// The register before the final XOR.
    state: u32,
}

impl Crc32 {
    /// A fresh computation (nothing hashed yet).
    pub const fn new() -> Self {
        Self { state: 0xFFFF_FFFF }
    }

    /// Hashes one more byte.
    #[inline]
    pub fn update_byte(&mut self, byte: u8) {
        // The low byte of the register, XORed with the input, selects the
        // table entry: a `u8` always indexes a 256-entry table in bounds.
        let index = usize::from((self.state as u8) ^ byte);
        #[allow(clippy::indexing_slicing)]
        let entry = TABLE[index];
        self.state = entry ^ (self.state >> 8);
    }

    /// Hashes more bytes.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.update_byte(b);
        }
    }

    /// The CRC of everything hashed so far. The computation can go on.
    #[inline]
    pub const fn finish(&self) -> u32 {
        self.state ^ 0xFFFF_FFFF
    }
}

impl Default for Crc32 {
    fn default() -> Self {
        Self::new()
    }
}

/// The CRC-32 of `bytes`, in one call.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut c = Crc32::new();
    c.update(bytes);
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bitwise algorithm, one bit at a time, as a reference for the table.
    fn crc32_bitwise(bytes: &[u8]) -> u32 {
        let mut crc = 0xFFFF_FFFFu32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    POLY ^ (crc >> 1)
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn known_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"a"), 0xE8B7_BE43);
        assert_eq!(
            crc32(b"The quick brown fox jumps over the lazy dog"),
            0x414F_A339
        );
        assert_eq!(crc32(&[0u8; 32]), 0x190A_55AD);
        assert_eq!(crc32(&[0xFFu8; 32]), 0xFF6C_AB0B);
    }

    #[test]
    fn table_matches_bitwise() {
        let data: [u8; 256] = core::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5A);
        for len in 0..data.len() {
            assert_eq!(
                crc32(&data[..len]),
                crc32_bitwise(&data[..len]),
                "len {len}"
            );
        }
    }

    #[test]
    fn incremental_equals_oneshot() {
        let data = b"hvtrace control channel";
        for split in 0..=data.len() {
            let (a, b) = data.split_at(split);
            let mut c = Crc32::new();
            c.update(a);
            c.update(b);
            assert_eq!(c.finish(), crc32(data));
        }
    }

    #[test]
    fn single_bit_flips_change_the_crc() {
        let data = *b"0123456789abcdef";
        let good = crc32(&data);
        for byte in 0..data.len() {
            for bit in 0..8 {
                let mut d = data;
                d[byte] ^= 1 << bit;
                assert_ne!(crc32(&d), good);
            }
        }
    }
}
