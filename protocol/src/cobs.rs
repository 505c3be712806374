//! Consistent Overhead Byte Stuffing (Cheshire and Baker, 1999).
//!
//! COBS removes every `0x00` from a message so that `0x00` can delimit frames
//! on the wire: a receiver that lost track (line noise, a cut frame, joining in
//! the middle) is back in step at the next zero byte.
//!
//! The encoding is a sequence of blocks. Each block is a *code byte* `n`
//! (1..=255) followed by `n - 1` non-zero data bytes. A block with `n < 255`
//! stands for its data followed by one zero; a block with `n == 255` stands for
//! its 254 data bytes alone. The zero implied by the very last block is not
//! part of the message.
//!
//! ```text
//! message  11 22 00 33        encoded  03 11 22 02 33
//! message  (empty)            encoded  01
//! message  00                 encoded  01 01
//! ```
//!
//! The encoder here is canonical: when the message ends right after a full
//! 254-byte block it emits no trailing `01`. The decoder accepts that form and
//! the non-canonical one.
//!
//! Overhead: at most one byte per 254 message bytes, plus one
//! ([`max_encoded_len`]). Decoding never yields more bytes than it consumes.

use alloc::vec::Vec;
use core::fmt;
use core::num::NonZeroU8;

/// Data bytes in a full block (code byte `0xFF`).
const FULL_BLOCK: u8 = 254;
const FULL_BLOCK_LEN: usize = FULL_BLOCK as usize;

/// The longest COBS encoding of a message of `len` bytes (without delimiter).
pub const fn max_encoded_len(len: usize) -> usize {
    // One code byte per started block of 254; saturates instead of wrapping
    // for lengths no memory can hold.
    len.saturating_add(len / FULL_BLOCK_LEN).saturating_add(1)
}

/// Appends the COBS encoding of `input` to `out`. `out` gains no `0x00`.
///
/// ```
/// let mut out = Vec::new();
/// protocol::cobs::encode(&[0x11, 0x22, 0x00, 0x33], &mut out);
/// assert_eq!(out, [0x03, 0x11, 0x22, 0x02, 0x33]);
/// ```
pub fn encode(input: &[u8], out: &mut Vec<u8>) {
    let mut enc = Encoder::begin(out);
    enc.push_all(out, input);
    enc.finish(out);
}

/// Decodes one COBS-encoded message (without delimiter), appending it to `out`.
///
/// On error `out` may hold part of the message.
///
/// ```
/// let mut out = Vec::new();
/// protocol::cobs::decode(&[0x03, 0x11, 0x22, 0x02, 0x33], &mut out).unwrap();
/// assert_eq!(out, [0x11, 0x22, 0x00, 0x33]);
/// ```
pub fn decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), CobsError> {
    if input.is_empty() {
        return Err(CobsError::Empty);
    }
    let mut dec = Decoder::new();
    for (offset, &b) in input.iter().enumerate() {
        let Some(b) = NonZeroU8::new(b) else {
            return Err(CobsError::ZeroByte { offset });
        };
        if let Some(byte) = dec.feed(b) {
            out.push(byte);
        }
    }
    dec.finish()
}

/// Why a byte sequence is not a COBS encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CobsError {
    /// No bytes at all: every encoding has at least its first code byte.
    Empty,
    /// A `0x00` inside the encoded data, at this offset.
    ZeroByte {
        /// Offset of the zero byte in the encoded input.
        offset: usize,
    },
    /// The input ended inside a block: its code byte promised `missing` more
    /// data bytes (a frame cut short, or a corrupted code byte).
    Truncated {
        /// Data bytes still owed by the last block.
        missing: u8,
    },
}

impl fmt::Display for CobsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CobsError::Empty => write!(f, "empty COBS input (no code byte)"),
            CobsError::ZeroByte { offset } => {
                write!(f, "zero byte at offset {offset} inside COBS-encoded data")
            }
            CobsError::Truncated { missing } => write!(
                f,
                "COBS block cut short: {missing} more data byte(s) expected before the delimiter"
            ),
        }
    }
}

impl core::error::Error for CobsError {}

/// A streaming COBS encoder writing into a caller's `Vec`.
///
/// The code byte of the open block is a placeholder in `out` at `code_at`,
/// patched when the block closes. The `Vec` is passed to each call rather than
/// held, so that the same `Vec` can be inspected between calls.
#[derive(Debug)]
pub(crate) struct Encoder {
    /// Index in `out` of the open block's code byte (written when the
    /// block closes; `out` already has a byte there).
    code_at: usize,
    /// Data bytes in the open block (0..=253).
    run: u8,
    /// The open block was opened by the close of a full block, and nothing
    /// came since: at the end of the message its code byte is taken back
    /// (the canonical form ends on the full block).
    after_full: bool,
}

impl Encoder {
    /// Starts a message at the end of `out`.
    pub(crate) fn begin(out: &mut Vec<u8>) -> Self {
        let code_at = out.len();
        out.push(1);
        Self {
            code_at,
            run: 0,
            after_full: false,
        }
    }

    /// Encodes one more message byte.
    #[inline]
    pub(crate) fn push(&mut self, out: &mut Vec<u8>, byte: u8) {
        self.push_all(out, &[byte]);
    }

    /// Writes the open block's code byte.
    #[inline]
    fn close(&self, out: &mut [u8], code: u8) {
        if let Some(c) = out.get_mut(self.code_at) {
            *c = code;
        }
    }

    /// Encodes more message bytes, as [`Self::push`] does one at a time,
    /// into room made once, in one pass over a slice of it: records are
    /// short runs between zeros (small numbers, padding), so a byte at a
    /// time with no length kept beats a copy per run.
    pub(crate) fn push_all(&mut self, out: &mut Vec<u8>, bytes: &[u8]) {
        let Some(&last) = bytes.last() else {
            return;
        };
        let start = out.len();
        // Each byte takes one place, and a full block one more.
        out.resize(start.saturating_add(max_encoded_len(bytes.len())), 0);
        let buf = out.as_mut_slice();
        let mut at = start;
        let mut code_at = self.code_at;
        let mut run = self.run;
        for &b in bytes {
            if b == 0 {
                // The zero closes the block; its place is the next code
                // byte (written when that block closes).
                if let Some(c) = buf.get_mut(code_at) {
                    *c = run.wrapping_add(1);
                }
                code_at = at;
                run = 0;
            } else {
                if let Some(slot) = buf.get_mut(at) {
                    *slot = b;
                }
                run = run.wrapping_add(1);
                if run == FULL_BLOCK {
                    if let Some(c) = buf.get_mut(code_at) {
                        *c = FULL_BLOCK.wrapping_add(1);
                    }
                    code_at = at.wrapping_add(1);
                    at = code_at;
                    run = 0;
                }
            }
            // `at` stays inside the room made above: no wrap.
            at = at.wrapping_add(1);
        }
        out.truncate(at);
        self.code_at = code_at;
        self.run = run;
        // The block was closed full by the last byte (a zero would have
        // left `run` 0 too, but closes a short block).
        self.after_full = run == 0 && last != 0;
    }

    /// Ends the message (no delimiter is written).
    pub(crate) fn finish(self, out: &mut Vec<u8>) {
        if self.after_full {
            out.truncate(self.code_at);
        } else {
            self.close(out, self.run.wrapping_add(1));
        }
    }
}

/// A streaming COBS decoder: fed the non-zero bytes between two delimiters one
/// at a time, it yields at most one message byte per input byte.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Decoder {
    /// Data bytes still to come in the current block; 0 when the next byte is
    /// a code byte.
    remaining: u8,
    /// The current block ends with an implied zero, to be yielded when the
    /// next block starts (and dropped at the end of the message).
    zero_pending: bool,
}

impl Decoder {
    pub(crate) const fn new() -> Self {
        Self {
            remaining: 0,
            zero_pending: false,
        }
    }

    /// Consumes one encoded byte and returns the message byte it stands for,
    /// if any. Code bytes yield the zero implied by the previous block.
    #[inline]
    pub(crate) fn feed(&mut self, byte: NonZeroU8) -> Option<u8> {
        if self.remaining == 0 {
            let out = if self.zero_pending { Some(0) } else { None };
            self.zero_pending = byte.get() != 0xFF;
            self.remaining = byte.get() - 1;
            out
        } else {
            // Not zero in this branch: exact.
            self.remaining = self.remaining.saturating_sub(1);
            Some(byte.get())
        }
    }

    /// Checks that the encoding ended on a block boundary.
    pub(crate) fn finish(&self) -> Result<(), CobsError> {
        match self.remaining {
            0 => Ok(()),
            missing => Err(CobsError::Truncated { missing }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn enc(input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(input, &mut out);
        out
    }

    fn dec(input: &[u8]) -> Result<Vec<u8>, CobsError> {
        let mut out = Vec::new();
        decode(input, &mut out).map(|()| out)
    }

    fn roundtrip(input: &[u8]) {
        let e = enc(input);
        assert!(!e.contains(&0), "encoding contains a zero");
        assert!(e.len() <= max_encoded_len(input.len()), "{} > max", e.len());
        assert_eq!(dec(&e).as_deref(), Ok(input));
    }

    /// The worked examples of the COBS literature, both directions.
    #[test]
    fn reference_vectors() {
        let run = |from: u8, to: u8| (from..=to).collect::<Vec<u8>>();
        let cat = |parts: &[&[u8]]| parts.concat();
        let cases: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (vec![], vec![0x01]),
            (vec![0x00], vec![0x01, 0x01]),
            (vec![0x00, 0x00], vec![0x01, 0x01, 0x01]),
            (vec![0x00, 0x11, 0x00], vec![0x01, 0x02, 0x11, 0x01]),
            (
                vec![0x11, 0x22, 0x00, 0x33],
                vec![0x03, 0x11, 0x22, 0x02, 0x33],
            ),
            (
                vec![0x11, 0x22, 0x33, 0x44],
                vec![0x05, 0x11, 0x22, 0x33, 0x44],
            ),
            (
                vec![0x11, 0x00, 0x00, 0x00],
                vec![0x02, 0x11, 0x01, 0x01, 0x01],
            ),
            // 254 non-zero bytes: one full block, no trailing code.
            (run(0x01, 0xFE), cat(&[&[0xFF], &run(0x01, 0xFE)])),
            // A zero, then 254 non-zero bytes.
            (
                cat(&[&[0x00], &run(0x01, 0xFE)]),
                cat(&[&[0x01, 0xFF], &run(0x01, 0xFE)]),
            ),
            // 255 non-zero bytes: a full block, then a one-byte block.
            (
                run(0x01, 0xFF),
                cat(&[&[0xFF], &run(0x01, 0xFE), &[0x02, 0xFF]]),
            ),
            // 254 non-zero bytes then a zero.
            (
                cat(&[&run(0x02, 0xFF), &[0x00]]),
                cat(&[&[0xFF], &run(0x02, 0xFF), &[0x01, 0x01]]),
            ),
            // 253 non-zero bytes, a zero, one more.
            (
                cat(&[&run(0x03, 0xFF), &[0x00, 0x01]]),
                cat(&[&[0xFE], &run(0x03, 0xFF), &[0x02, 0x01]]),
            ),
        ];
        for (plain, encoded) in &cases {
            assert_eq!(&enc(plain), encoded, "encode {plain:02x?}");
            assert_eq!(dec(encoded).as_ref(), Ok(plain), "decode {encoded:02x?}");
        }
    }

    #[test]
    fn empty() {
        assert_eq!(enc(&[]), [0x01]);
        assert_eq!(dec(&[0x01]), Ok(vec![]));
        assert_eq!(dec(&[]), Err(CobsError::Empty));
    }

    #[test]
    fn non_zero_runs_around_the_block_size() {
        for len in [1usize, 2, 253, 254, 255, 256, 507, 508, 509, 1000] {
            let data = vec![0xAB; len];
            let e = enc(&data);
            // ceil(len / 254) code bytes, exactly.
            assert_eq!(e.len(), len + len.div_ceil(254), "len {len}");
            roundtrip(&data);
        }
        // Exactly 254: a single full block.
        assert_eq!(enc(&[7; 254]).first(), Some(&0xFF));
        assert_eq!(enc(&[7; 254]).len(), 255);
        // Exactly 255: a full block and a block of one.
        let e = enc(&[7; 255]);
        assert_eq!((e[0], e[255], e[256]), (0xFF, 0x02, 7));
        assert_eq!(e.len(), 257);
    }

    #[test]
    fn all_zeros() {
        for len in [1usize, 2, 254, 255, 1000] {
            let data = vec![0u8; len];
            let e = enc(&data);
            assert_eq!(e, vec![0x01; len + 1]);
            roundtrip(&data);
        }
    }

    #[test]
    fn mixed_roundtrips() {
        let mut data = Vec::new();
        for i in 0..3000u32 {
            data.push(if i % 7 == 0 || i % 301 == 0 {
                0
            } else {
                (i % 251) as u8
            });
            roundtrip(&data);
        }
    }

    #[test]
    fn non_canonical_trailing_block_is_accepted() {
        // A full block followed by an explicit empty last block.
        let mut e = vec![0xFF];
        e.extend_from_slice(&[9u8; 254]);
        e.push(0x01);
        assert_eq!(dec(&e), Ok(vec![9u8; 254]));
    }

    #[test]
    fn malformed() {
        assert_eq!(
            dec(&[0x05, 0x11, 0x22]),
            Err(CobsError::Truncated { missing: 2 })
        );
        assert_eq!(dec(&[0xFF]), Err(CobsError::Truncated { missing: 254 }));
        assert_eq!(
            dec(&[0x02, 0x11, 0x00]),
            Err(CobsError::ZeroByte { offset: 2 })
        );
        assert_eq!(dec(&[0x00]), Err(CobsError::ZeroByte { offset: 0 }));
    }

    #[test]
    fn decoding_never_outgrows_its_input() {
        // Every byte sequence of length <= 4 over a small alphabet.
        let alphabet = [0x00u8, 0x01, 0x02, 0x03, 0xFE, 0xFF];
        let mut inputs: Vec<Vec<u8>> = vec![vec![]];
        let mut frontier: Vec<Vec<u8>> = vec![vec![]];
        for _ in 0..4 {
            frontier = frontier
                .iter()
                .flat_map(|p| {
                    alphabet.iter().map(move |&a| {
                        let mut q = p.clone();
                        q.push(a);
                        q
                    })
                })
                .collect();
            inputs.extend(frontier.iter().cloned());
        }
        for input in &inputs {
            if let Ok(out) = dec(input) {
                assert!(out.len() <= input.len(), "{input:02x?}");
                // Re-encoding gives back a valid encoding of the same bytes.
                assert_eq!(dec(&enc(&out)), Ok(out));
            }
        }
    }

    /// The textbook encoder, a byte at a time (Cheshire and Baker's
    /// figure), with the canonical end: the oracle for the encoder above.
    fn textbook(msg: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8];
        let mut code_at = 0;
        let mut code = 1u8;
        let mut ended_full = false;
        for &b in msg {
            ended_full = false;
            if b == 0 {
                out[code_at] = code;
                code_at = out.len();
                out.push(0);
                code = 1;
            } else {
                out.push(b);
                code += 1;
                if code == 0xff {
                    out[code_at] = code;
                    code_at = out.len();
                    out.push(0);
                    code = 1;
                    ended_full = true;
                }
            }
        }
        if ended_full {
            out.truncate(code_at);
        } else {
            out[code_at] = code;
        }
        out
    }

    /// `push_all` over any split of the message gives the bytes of one
    /// byte at a time, around the 254-byte block edges and zeros, and
    /// decodes back to the message.
    #[test]
    fn bulk_pushes_encode_as_single_ones() {
        let mut rng = test_support::Rng::new(0x1234_5678);
        let mut next = move || rng.next();
        for case in 0..400 {
            let len = (next() % 1100) as usize;
            // Zeros now dense, now rare, now absent.
            let zero_every = [2, 7, 60, 300, u64::MAX][case % 5];
            let msg: Vec<u8> = (0..len)
                .map(|_| {
                    let r = next();
                    if r % zero_every == 0 {
                        0
                    } else {
                        (r >> 8) as u8 | 1
                    }
                })
                .collect();
            let mut one = Vec::new();
            let mut e = Encoder::begin(&mut one);
            for &b in &msg {
                e.push(&mut one, b);
            }
            e.finish(&mut one);
            let mut bulk = Vec::new();
            let mut e = Encoder::begin(&mut bulk);
            let mut rest = &msg[..];
            while !rest.is_empty() {
                let n = ((next() % 600) as usize).min(rest.len());
                let (a, b) = rest.split_at(n);
                e.push_all(&mut bulk, a);
                rest = b;
            }
            e.finish(&mut bulk);
            assert_eq!(bulk, one, "case {case}, {len} bytes");
            assert_eq!(bulk, textbook(&msg), "case {case}, {len} bytes");
            assert_eq!(dec(&bulk), Ok(msg));
        }
    }
}
