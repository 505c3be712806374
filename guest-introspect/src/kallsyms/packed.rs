//! A symbol index written out as one byte string, for the host: the tables
//! it was built from, in the kernel's own encoding, behind a small header.
//! VMX root writes it a piece at a time ([`SymbolIndex::packed_at`]) with
//! nothing allocated; the host rebuilds the index from it with
//! [`SymbolIndex::unpack`], which runs the same build (and every check of
//! it) as root's over guest memory, so that both sides resolve and name
//! addresses alike.
//!
//! The layout (little-endian):
//!
//! | at | bytes | what |
//! |---|---|---|
//! | 0 | 8 | [`PACKED_MAGIC`] |
//! | 8 | 4 | symbols (`n`) |
//! | 12 | 4 | bytes of the names stream |
//! | 16 | 4 | bytes of the token table |
//! | 20 | 1 | address mode: 0 relative, 1 absolute per-cpu |
//! | 21 | 3 | zero |
//! | 24 | 8 | the relative base (a runtime address) |
//! | 32 | 512 | the token index: 256 `u16` starts in the token table |
//! | 544 | | the token table, then `ceil(n / 256)` `u32` markers, `n` `i32` offsets, the names stream |

use super::index::{PackedParts, ANCHOR_STRIDE};
use super::locate::{AddressMode, KallsymsError, KallsymsTables, Layout};
use super::{SymbolIndex, DEFAULT_MAX_INDEX_BYTES};
use crate::addr::Gva;
use crate::view::{ViewError, VirtMemory};

/// The first bytes of a packed index (and its format's version).
pub const PACKED_MAGIC: [u8; 8] = *b"HVKSYMS\x01";
/// Bytes before the token table.
const HEAD: usize = 32 + 512;
/// Where [`SymbolIndex::unpack`] places the packed bytes to build from
/// them (any address does; this one leaves room for every length).
const BASE: u64 = 1 << 32;

/// Why packed bytes were refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedError {
    /// Shorter than the header, a wrong magic, or lengths that do not add
    /// up to the bytes given.
    BadHeader(&'static str),
    /// The tables did not build (the same checks as over guest memory).
    Tables(KallsymsError),
}

impl core::fmt::Display for PackedError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PackedError::BadHeader(why) => write!(f, "packed symbol index: {why}"),
            PackedError::Tables(e) => write!(f, "packed symbol index: {e}"),
        }
    }
}

/// The sizes of the pieces after the header.
#[derive(Clone, Copy)]
struct Sizes {
    tokens: usize,
    markers: usize,
    offsets: usize,
    names: usize,
}

impl Sizes {
    fn of(n: usize, names: usize, tokens: usize) -> Sizes {
        Sizes {
            tokens,
            markers: 4 * n.div_ceil(256),
            offsets: 4 * n,
            names,
        }
    }

    fn total(self) -> usize {
        HEAD + self.tokens + self.markers + self.offsets + self.names
    }
}

/// Copies the part of a piece of `len` bytes, starting at `start` in the
/// whole, that falls in `[at, at + out.len())`; `byte(i)` gives the
/// piece's byte `i`.
fn put_piece(start: usize, len: usize, at: usize, out: &mut [u8], byte: impl Fn(usize) -> u8) {
    let from = at.max(start);
    let to = (at + out.len()).min(start + len);
    for pos in from..to {
        if let Some(o) = out.get_mut(pos - at) {
            *o = byte(pos - start);
        }
    }
}

/// Copies the part of `piece` (at `start` in the whole) that falls in
/// `[at, at + out.len())`.
fn put_slice(start: usize, piece: &[u8], at: usize, out: &mut [u8]) {
    let from = at.max(start);
    let to = (at + out.len()).min(start + piece.len());
    if from < to {
        if let (Some(dst), Some(src)) = (
            out.get_mut(from - at..to - at),
            piece.get(from - start..to - start),
        ) {
            dst.copy_from_slice(src);
        }
    }
}

/// Byte `i` of the little-endian words `word(0), word(1), ...`.
fn word_byte(i: usize, word: impl Fn(usize) -> u32) -> u8 {
    word(i / 4).to_le_bytes().get(i % 4).copied().unwrap_or(0)
}

impl SymbolIndex {
    /// Bytes of the packed index.
    pub fn packed_len(&self) -> usize {
        let p = self.packed_parts();
        Sizes::of(p.offsets.len(), p.names.len(), p.token_table.len()).total()
    }

    /// Fills `out` with the packed index's bytes from `at` on; returns how
    /// many (fewer than `out.len()` only at the end, 0 past it). Allocates
    /// nothing: root sends a large index a piece per turn.
    pub fn packed_at(&self, at: usize, out: &mut [u8]) -> usize {
        let p: PackedParts<'_> = self.packed_parts();
        let n = p.offsets.len();
        let sizes = Sizes::of(n, p.names.len(), p.token_table.len());
        let total = sizes.total();
        if at >= total {
            return 0;
        }
        let len = out.len().min(total - at);
        let Some(out) = out.get_mut(..len) else {
            return 0;
        };
        let mut head = [0u8; HEAD];
        let fields: [(usize, &[u8]); 6] = [
            (0, &PACKED_MAGIC),
            (8, &(n as u32).to_le_bytes()),
            (12, &(p.names.len() as u32).to_le_bytes()),
            (16, &(p.token_table.len() as u32).to_le_bytes()),
            (
                20,
                &[match p.mode {
                    AddressMode::Relative => 0,
                    AddressMode::AbsolutePercpu => 1,
                }],
            ),
            (24, &p.relative_base.to_le_bytes()),
        ];
        for (o, bytes) in fields {
            if let Some(dst) = head.get_mut(o..o + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
        }
        for (k, s) in p.token_starts.iter().enumerate() {
            if let Some(dst) = head.get_mut(32 + 2 * k..34 + 2 * k) {
                dst.copy_from_slice(&s.to_le_bytes());
            }
        }
        put_slice(0, &head, at, out);
        let mut start = HEAD;
        put_slice(start, p.token_table, at, out);
        start += sizes.tokens;
        // Marker k: where entry 256 k starts in the names stream, which
        // is anchor 256 k / ANCHOR_STRIDE.
        let per = (256 / ANCHOR_STRIDE) as usize;
        put_piece(start, sizes.markers, at, out, |i| {
            word_byte(i, |k| p.anchors.get(k * per).copied().unwrap_or(0))
        });
        start += sizes.markers;
        put_piece(start, sizes.offsets, at, out, |i| {
            word_byte(i, |k| p.offsets.get(k).map_or(0, |&o| o as u32))
        });
        start += sizes.offsets;
        put_slice(start, p.names, at, out);
        len
    }

    /// Rebuilds an index from the bytes of [`Self::packed_at`], checking
    /// them as the build checks guest memory: nothing in them is trusted.
    pub fn unpack(bytes: &[u8]) -> Result<SymbolIndex, PackedError> {
        let u32_at = |o: usize| {
            bytes
                .get(o..o + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
        };
        if bytes.len() < HEAD {
            return Err(PackedError::BadHeader("shorter than its header"));
        }
        if bytes.get(..8) != Some(&PACKED_MAGIC[..]) {
            return Err(PackedError::BadHeader("not a packed index of this version"));
        }
        let (Some(n), Some(names_len), Some(tokens_len)) = (u32_at(8), u32_at(12), u32_at(16))
        else {
            return Err(PackedError::BadHeader("shorter than its header"));
        };
        let mode = match bytes.get(20) {
            Some(0) => AddressMode::Relative,
            Some(1) => AddressMode::AbsolutePercpu,
            _ => return Err(PackedError::BadHeader("unknown address mode")),
        };
        let relative_base = bytes
            .get(24..32)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .unwrap_or(0);
        if n > super::MAX_SYMS {
            return Err(PackedError::Tables(KallsymsError::TooManySymbols(n)));
        }
        let sizes = Sizes::of(n as usize, names_len as usize, tokens_len as usize);
        if sizes.total() != bytes.len() {
            return Err(PackedError::BadHeader(
                "its lengths do not add up to its size",
            ));
        }
        let at = |o: usize| Gva(BASE + o as u64);
        let token_table = HEAD;
        let markers = token_table + sizes.tokens;
        let offsets = markers + sizes.markers;
        let names = offsets + sizes.offsets;
        let tables = KallsymsTables {
            num_syms: n,
            names: at(names),
            names_len,
            markers: at(markers),
            marker_width: 4,
            seqs_of_names: None,
            token_table: at(token_table),
            token_table_len: tokens_len,
            token_index: at(32),
            offsets: at(offsets),
            relative_base_at: at(24),
            relative_base,
            layout: Layout::OffsetsLast,
            mode,
        };
        SymbolIndex::build_limited(&Packed(bytes), &tables, DEFAULT_MAX_INDEX_BYTES)
            .map_err(PackedError::Tables)
    }
}

/// Packed bytes seen as memory at [`BASE`].
struct Packed<'a>(&'a [u8]);

impl VirtMemory for Packed<'_> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let src = gva
            .0
            .checked_sub(BASE)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| self.0.get(o..o.checked_add(buf.len())?));
        match src {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(ViewError::Unmapped { gva, resume: None }),
        }
    }
}
