//! CRC-32 (IEEE 802.3, the one of zlib, PNG and Ethernet).
//!
//! Parameters: reflected polynomial `0xEDB8_8320` (0x04C11DB7 bit-reversed),
//! initial value `0xFFFF_FFFF`, final XOR `0xFFFF_FFFF`, input and output
//! reflected. Check value: `crc32(b"123456789") == 0xCBF4_3926`.
//!
//! Eight 256-entry tables (8 KiB), built at compile time: eight bytes at a
//! time take eight lookups and no shift chain ("slicing by 8"); a tail
//! shorter than a word takes one lookup per byte.

/// The reflected IEEE polynomial.
const POLY: u32 = 0xEDB8_8320;

/// `TABLES[0][i]` is the CRC register after shifting the byte `i` through
/// eight rounds of the bitwise algorithm; `TABLES[k][i]` is that register
/// shifted through `k` more zero bytes, so that a byte `k` places before
/// the end of an 8-byte word is folded in with one lookup.
static TABLES: [[u32; 256]; 8] = build_tables();

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

// Evaluated at compile time only, as `build_table`.
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
const fn build_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    t[0] = build_table();
    let mut k = 1;
    while k < 8 {
        let mut i = 0usize;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = t[0][(prev & 0xFF) as usize] ^ (prev >> 8);
            i += 1;
        }
        k += 1;
    }
    t
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
        let [t0, ..] = &TABLES;
        #[allow(clippy::indexing_slicing)]
        let entry = t0[usize::from((self.state as u8) ^ byte)];
        self.state = entry ^ (self.state >> 8);
    }

    /// Hashes more bytes: whole 8-byte words through the eight tables,
    /// the rest a byte at a time.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        let [t0, t1, t2, t3, t4, t5, t6, t7] = &TABLES;
        for w in &mut words {
            // `chunks_exact(8)` gives 8 bytes: the conversion cannot fail.
            let word = u64::from_le_bytes(w.try_into().unwrap_or_default());
            let lo = (word as u32) ^ self.state;
            let hi = (word >> 32) as u32;
            // Each index is one byte (`& 0xFF` or a shift of a u32 by 24):
            // always inside a 256-entry table.
            #[allow(clippy::indexing_slicing)]
            {
                self.state = t7[(lo & 0xFF) as usize]
                    ^ t6[((lo >> 8) & 0xFF) as usize]
                    ^ t5[((lo >> 16) & 0xFF) as usize]
                    ^ t4[(lo >> 24) as usize]
                    ^ t3[(hi & 0xFF) as usize]
                    ^ t2[((hi >> 8) & 0xFF) as usize]
                    ^ t1[((hi >> 16) & 0xFF) as usize]
                    ^ t0[(hi >> 24) as usize];
            }
        }
        for &b in words.remainder() {
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
    fn split_updates_match_bitwise_at_every_alignment() {
        let data: [u8; 64] = core::array::from_fn(|i| (i as u8).wrapping_mul(91) ^ 0xC3);
        let whole = crc32_bitwise(&data);
        for a in 0..data.len() {
            for b in a..data.len() {
                let mut c = Crc32::new();
                c.update(&data[..a]);
                c.update(&data[a..b]);
                c.update_byte(data[b]);
                c.update(&data[b + 1..]);
                assert_eq!(c.finish(), whole, "split at {a}, {b}");
            }
        }
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
