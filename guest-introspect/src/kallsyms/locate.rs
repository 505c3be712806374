//! Finding the kallsyms tables (see the module documentation for the
//! layouts and the steps).
//!
//! The search's own buffers are bounded by constants, not by what the guest
//! claims: the token table at most `MAX_TOKEN_TABLE`, backward reads
//! `BACK_CHUNK`, a marker run at most `MAX_SYMS / 256 + 1` words (64 KiB),
//! the names check `2 * 256 * MAX_ENTRY` bytes (about 257 KiB). They stay
//! infallible: the hypervisor keeps more than that free beside the symbol
//! index's budget.

use alloc::vec::Vec;
use core::cell::Cell;
use core::fmt;

use super::{align8, entry_header, for_each_offset, MAX_ENTRY, MAX_SYMS};
use crate::addr::{Gva, GvaRange};
use crate::budget::{block_on, Budget, Metered, RECOVERY_BUDGET};
use crate::scan::{ScanStats, ScanStep, Scanner};
use crate::view::{read_array, ViewError, VirtMemory};

/// The 20 bytes the search starts from: the single-character tokens "0" to
/// "9", each NUL-terminated, consecutive in `kallsyms_token_table`.
pub const DIGIT_TOKENS: &[u8; 20] = b"0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00";

/// Most bytes the token table may take (256 tokens; real ones are 1-3 KiB).
const MAX_TOKEN_TABLE: u64 = 64 * 1024;
/// Bytes read after "0" to find the end of the table, at first.
const TOKEN_WINDOW: usize = 8 * 1024;
/// How far back from the token table the markers may start: a
/// `seqs_of_names` of the largest symbol count plus the markers.
const MAX_MARKER_DISTANCE: u64 = 3 * MAX_SYMS as u64 + 8 * (MAX_SYMS as u64 / 256 + 1) + 16;
/// Backward reads while looking for the markers and `num_syms`.
const BACK_CHUNK: u64 = 16 * 1024;

/// Where `offsets` and `relative_base` sit relative to the other tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `offsets, relative_base, num_syms, names, markers, [seqs_of_names],
    /// token_table, token_index` (6.1 up to the reordering).
    OffsetsFirst,
    /// `num_syms, names, markers, token_table, token_index, offsets,
    /// relative_base, seqs_of_names` (6.12).
    OffsetsLast,
}

/// How an entry of `kallsyms_offsets` becomes an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddressMode {
    /// `CONFIG_KALLSYMS_ABSOLUTE_PERCPU`: `off >= 0` is the (per-cpu)
    /// address itself, otherwise `relative_base - 1 - off`. Chosen when some
    /// offset is negative.
    AbsolutePercpu,
    /// `relative_base + (u32)off` for every symbol. Chosen when no offset is
    /// negative.
    Relative,
}

impl AddressMode {
    /// The address an offset stands for.
    #[inline]
    pub const fn address(self, relative_base: u64, off: i32) -> u64 {
        match self {
            Self::AbsolutePercpu if off >= 0 => off as u64,
            Self::AbsolutePercpu => relative_base
                .wrapping_sub(1)
                .wrapping_sub(off as i64 as u64),
            Self::Relative => relative_base.wrapping_add(off as u32 as u64),
        }
    }
}

/// Where the tables are, as found in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KallsymsTables {
    /// `kallsyms_num_syms`.
    pub num_syms: u32,
    /// `kallsyms_names`.
    pub names: Gva,
    /// Bytes of the names stream (without the alignment padding).
    pub names_len: u32,
    /// `kallsyms_markers`.
    pub markers: Gva,
    /// Width of a marker: 4 (`.long`, every kernel this targets) or 8 (older
    /// kernels emitted `PTR`).
    pub marker_width: u8,
    /// `kallsyms_seqs_of_names` when the kernel has it where it can be seen
    /// (between the markers and the token table, or after relative_base).
    pub seqs_of_names: Option<Gva>,
    /// `kallsyms_token_table`.
    pub token_table: Gva,
    /// Bytes of the token table, NULs included.
    pub token_table_len: u32,
    /// `kallsyms_token_index`.
    pub token_index: Gva,
    /// `kallsyms_offsets`.
    pub offsets: Gva,
    /// `kallsyms_relative_base` (the variable's address).
    pub relative_base_at: Gva,
    /// Its value: a runtime address, relocated by KASLR.
    pub relative_base: u64,
    /// The table order.
    pub layout: Layout,
    /// How offsets become addresses.
    pub mode: AddressMode,
}

/// What the search cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocateStats {
    /// The forward search for the digit tokens.
    pub scan: ScanStats,
    /// Needle matches that were also a consistent token table.
    pub token_tables: u32,
    /// View reads made to validate candidates.
    pub validation_reads: u64,
    /// Bytes those reads copied.
    pub validation_bytes: u64,
}

/// Why the tables were not found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KallsymsError {
    /// No run of digit tokens in the ranges searched formed a consistent
    /// token table and token index.
    NoTokenTable,
    /// A token table was found but no markers before it.
    NoMarkers {
        /// The token table that had none.
        token_table: Gva,
    },
    /// Markers were found but no `num_syms` + `names` matching them.
    NoNames {
        /// The markers.
        markers: Gva,
    },
    /// Names were found but neither layout gave sorted addresses.
    NoOffsets {
        /// The names.
        names: Gva,
    },
    /// The names stream does not decode as the markers say.
    BadNames {
        /// The symbol number where decoding went wrong.
        symbol: u32,
    },
    /// The work budget ([`crate::budget::Budget`]) was spent before the
    /// tables were found (memory forged to look like them, or decoys before
    /// them), or, from [`crate::facts::discover_budgeted`], before the
    /// later stages were done ([`crate::budget::Budget::stage`] says which).
    BudgetExhausted,
    /// The index would take more heap than allowed.
    TooLarge {
        /// Bytes it would take.
        bytes: usize,
    },
    /// The heap refused one of the index's buffers (the index was within
    /// its limit, but the heap had less room).
    OutOfMemory {
        /// Bytes the whole index needs.
        bytes: usize,
    },
    /// More symbols than [`super::MAX_SYMS`].
    TooManySymbols(u32),
    /// The tables could not be read.
    Read(ViewError),
}

impl fmt::Display for KallsymsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::NoTokenTable => f.write_str("no kallsyms token table in the ranges searched"),
            Self::NoMarkers { token_table } => write!(
                f,
                "kallsyms token table at {token_table} has no markers before it"
            ),
            Self::NoNames { markers } => {
                write!(f, "kallsyms markers at {markers} match no num_syms/names")
            }
            Self::NoOffsets { names } => write!(
                f,
                "kallsyms names at {names}: no offsets/relative_base with sorted addresses"
            ),
            Self::BadNames { symbol } => {
                write!(f, "kallsyms names do not decode at symbol {symbol}")
            }
            Self::BudgetExhausted => f.write_str("recovery gave up: its work budget is spent"),
            Self::TooManySymbols(n) => write!(f, "{n} kallsyms symbols is more than supported"),
            Self::TooLarge { bytes } => {
                write!(f, "a kallsyms index of {bytes} bytes is more than allowed")
            }
            Self::OutOfMemory { bytes } => write!(
                f,
                "out of hypervisor memory: the symbol index needs {bytes} bytes"
            ),
            Self::Read(e) => write!(f, "kallsyms tables unreadable: {e}"),
        }
    }
}

impl KallsymsError {
    /// How far the search got: a later stage wins when reporting.
    fn stage(&self) -> u8 {
        match self {
            Self::NoTokenTable => 0,
            Self::NoMarkers { .. } => 1,
            Self::NoNames { .. } => 2,
            Self::NoOffsets { .. }
            | Self::BadNames { .. }
            | Self::TooManySymbols(_)
            | Self::TooLarge { .. }
            | Self::OutOfMemory { .. }
            | Self::Read(_) => 3,
            Self::BudgetExhausted => 4,
        }
    }
}

/// A view that counts what it reads (the validation's share of the work).
struct Counted<'v, V: ?Sized> {
    inner: &'v V,
    reads: Cell<u64>,
    bytes: Cell<u64>,
}

impl<V: VirtMemory + ?Sized> VirtMemory for Counted<'_, V> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        self.reads.set(self.reads.get() + 1);
        self.bytes.set(self.bytes.get() + buf.len() as u64);
        self.inner.read_virt(gva, buf)
    }
}

/// Reads up to `max` bytes at `gva`, stopping at the first unreadable page.
fn read_prefix<V: VirtMemory + ?Sized>(view: &V, gva: Gva, max: usize) -> Vec<u8> {
    let mut out = alloc::vec![0u8; max];
    let mut done = 0usize;
    while done < max {
        let at = gva.0.wrapping_add(done as u64);
        let n = core::cmp::min(max - done, (4096 - at % 4096) as usize);
        let Some(dst) = out.get_mut(done..done + n) else {
            break;
        };
        if view.read_virt(Gva(at), dst).is_err() {
            break;
        }
        done += n;
    }
    out.truncate(done);
    out
}

/// Reads the part of `[lo, hi)` that is readable right below `hi`: when a
/// hole interrupts the range, the bytes after the hole (8-aligned start).
/// `None` when nothing right below `hi` reads.
fn read_tail<V: VirtMemory + ?Sized>(view: &V, mut lo: u64, hi: u64) -> Option<(u64, Vec<u8>)> {
    loop {
        let mut buf = alloc::vec![0u8; (hi - lo) as usize];
        match view.read_virt(Gva(lo), &mut buf) {
            Ok(()) => return Some((lo, buf)),
            Err(ViewError::Unmapped {
                resume: Some(r), ..
            }) if r.0 > lo && r.0 < hi => {
                lo = align8(r.0);
                if lo >= hi {
                    return None;
                }
            }
            Err(_) => return None,
        }
    }
}

/// The little-endian `u32` at `off`, if `b` holds all of it.
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    b.get(off..)
        .and_then(<[u8]>::first_chunk)
        .copied()
        .map(u32::from_le_bytes)
}

/// A token table and index that agree with each other.
#[derive(Clone, Copy, Debug)]
struct TokenTable {
    table: Gva,
    len: u64,
    index: Gva,
}

/// Step 2: is `p` the "0" token of a real token table?
fn token_table_at<V: VirtMemory + ?Sized>(view: &V, p: Gva) -> Option<TokenTable> {
    // The tokens for bytes 0x30..=0xff, starting at "0".
    let mut window = read_prefix(view, p, TOKEN_WINDOW);
    let mut pos = 0usize;
    let mut strings = 0;
    while strings < 256 - 0x30 {
        // `pos` never passes the end of `window` (nor of a longer re-read).
        let rest = window.get(pos..).unwrap_or_default();
        match rest.iter().position(|&c| c == 0) {
            Some(z) => {
                pos += z + 1;
                strings += 1;
            }
            None if window.len() == TOKEN_WINDOW => {
                // Long tokens: one more, bigger read.
                window = read_prefix(view, p, MAX_TOKEN_TABLE as usize);
                if window.len() <= TOKEN_WINDOW {
                    return None;
                }
            }
            None => return None,
        }
    }
    let end = p.checked_add(pos as u64)?;
    let index = end.align_up(8)?;
    let raw: [u8; 512] = read_array(view, index).ok()?;
    let mut idx = [0u16; 256];
    for (v, &pair) in idx.iter_mut().zip(raw.as_chunks::<2>().0) {
        *v = u16::from_le_bytes(pair);
    }
    let start = p.0.checked_sub(idx[0x30] as u64).map(Gva)?;
    // Strictly increasing.
    if idx[0] != 0 || !start.is_aligned(8) || !idx.is_sorted_by(|a, b| a < b) {
        return None;
    }
    let len = end.0 - start.0;
    if len > MAX_TOKEN_TABLE || idx[255] as u64 >= len {
        return None;
    }
    // Every string k must run from idx[k] to the NUL just before idx[k+1].
    let mut table = alloc::vec![0u8; len as usize];
    view.read_virt(start, &mut table).ok()?;
    let ends = idx
        .iter()
        .skip(1)
        .map(|&e| e as usize)
        .chain(core::iter::once(len as usize));
    for (&s, e) in idx.iter().zip(ends) {
        // In range: the starts increase and the last is below `len`.
        match table.get(s as usize..e)?.split_last() {
            Some((0, body)) if !body.contains(&0) => {}
            _ => return None,
        }
    }
    Some(TokenTable {
        table: start,
        len,
        index,
    })
}

/// What steps 3 and 4 find.
#[derive(Clone, Copy, Debug)]
struct NamesAndMarkers {
    names: Gva,
    names_len: u64,
    num_syms: u32,
    markers: Gva,
    marker_width: u8,
    seqs: Option<Gva>,
}

/// Reads the longest run of plausible markers starting at `s` (`markers[0]
/// = 0`, then increasing by 2..=MAX_ENTRY bytes per symbol), at most up to
/// `limit`.
fn marker_run<V: VirtMemory + ?Sized>(view: &V, s: Gva, limit: Gva, width: u64) -> Vec<u32> {
    let max_words = core::cmp::min((limit.0 - s.0) / width, MAX_SYMS as u64 / 256 + 1);
    let mut run: Vec<u32> = Vec::new();
    let mut at = s.0;
    let end = s.0 + max_words * width;
    let mut prev: Option<u32> = None;
    while at < end {
        let n = core::cmp::min(4096, end - at) as usize;
        let mut buf = alloc::vec![0u8; n];
        if view.read_virt(Gva(at), &mut buf).is_err() {
            break;
        }
        for w in buf.chunks_exact(width as usize) {
            let v = match *w {
                [a, b, c, d] | [a, b, c, d, 0, 0, 0, 0] => u32::from_le_bytes([a, b, c, d]),
                // An 8-byte marker with its high half set.
                _ => return run,
            };
            let ok = match prev {
                None => v == 0,
                Some(p) => v > p && (v - p) as u64 >= 2 * 256 && (v - p) as u64 <= MAX_ENTRY * 256,
            };
            if !ok {
                return run;
            }
            run.push(v);
            prev = Some(v);
        }
        at += n as u64;
    }
    run
}

/// Decodes `count` entries of the names stream from `buf[from..]`; the
/// offset after the last one, or `None` if an entry is malformed or runs out
/// of `buf`.
fn skip_entries(buf: &[u8], from: usize, count: u64) -> Option<usize> {
    let mut off = from;
    for _ in 0..count {
        let (h, len) = entry_header(buf, off)?;
        if len == 0 {
            return None;
        }
        off = off.checked_add(h + len)?;
        if off > buf.len() {
            return None;
        }
    }
    Some(off)
}

/// Step 4: `num_syms` and the start of `names`, given markers at `s`.
/// `n_lo..=n_hi` are the symbol counts the markers (and a `seqs_of_names`
/// gap) allow. Returns (names, num_syms, names_len).
async fn names_before<V: VirtMemory + ?Sized>(
    view: &V,
    s: Gva,
    markers: &[u32],
    n_lo: u64,
    n_hi: u64,
    pace: &Budget,
) -> Option<(Gva, u32, u64)> {
    let last = *markers.last()? as u64;
    // The names start N is 8-aligned, holds at least one entry after the
    // last marker, and the last group is at most 256 entries.
    let top = s.0.checked_sub(last + 2)? & !7;
    let bottom = core::cmp::max(s.0.saturating_sub(last + 256 * MAX_ENTRY + 8) & !7, 8);
    // buf holds [buf_lo, buf_lo + buf.len()); N needs the 8 bytes below it.
    let mut buf: Vec<u8> = Vec::new();
    let mut buf_lo = 0u64;
    let mut n_at = top;
    while n_at >= bottom {
        if n_at - 8 < buf_lo || buf.is_empty() {
            pace.pause().await;
            let want = core::cmp::max(bottom - 8, n_at.saturating_sub(BACK_CHUNK));
            let (lo, b) = read_tail(view, want, n_at)?;
            if n_at - lo < 8 {
                return None;
            }
            buf = b;
            buf_lo = lo;
        }
        let b = (n_at - 8 - buf_lo) as usize;
        // `buf` covers `[buf_lo, n_at)`, which holds these 8 bytes.
        let n = u32_at(&buf, b)? as u64;
        let pad = u32_at(&buf, b + 4)?;
        if pad == 0 && n >= n_lo && n <= n_hi {
            pace.pause().await;
            if let Some(len) = check_names(view, Gva(n_at), s, markers, n) {
                return Some((Gva(n_at), n as u32, len));
            }
        }
        n_at -= 8;
    }
    None
}

/// Does the names stream at `names` with `n` symbols end just before `s` (the
/// markers), with the last two marker groups where the markers say?
fn check_names<V: VirtMemory + ?Sized>(
    view: &V,
    names: Gva,
    s: Gva,
    markers: &[u32],
    n: u64,
) -> Option<u64> {
    let m = markers.len();
    let (&last, init) = markers.split_last()?;
    // Decode from the second-to-last group (if any) to the end.
    let from = init.last().copied().unwrap_or(last) as u64;
    let region_start = names.0 + from;
    let region = s.0.checked_sub(region_start)?;
    if region > 2 * 256 * MAX_ENTRY + 8 {
        return None;
    }
    let mut buf = alloc::vec![0u8; region as usize];
    view.read_virt(Gva(region_start), &mut buf).ok()?;
    let mut off = 0usize;
    if m >= 2 {
        off = skip_entries(&buf, 0, 256)?;
        if off as u64 != last as u64 - from {
            return None;
        }
    }
    let rest = n - 256 * (m as u64 - 1);
    let end = skip_entries(&buf, off, rest)?;
    // Then only the alignment padding before the markers.
    let pad = buf.get(end..)?;
    if pad.len() > 7 || pad.iter().any(|&b| b != 0) {
        return None;
    }
    Some(from + end as u64)
}

/// Step 3: markers (and `seqs_of_names`) before the token table.
async fn markers_before<V: VirtMemory + ?Sized>(
    view: &V,
    tt: &TokenTable,
    pace: &Budget,
) -> Option<NamesAndMarkers> {
    let t = tt.table.0;
    let bottom = t.saturating_sub(MAX_MARKER_DISTANCE) & !7;
    let mut hi = t;
    while hi > bottom {
        pace.pause().await;
        let want = core::cmp::max(bottom, hi.saturating_sub(BACK_CHUNK));
        // At the start of the mapping: nothing further back.
        let (lo, buf) = read_tail(view, want, hi)?;
        let mut s = hi;
        while s > lo {
            s -= 8;
            let b = (s - lo) as usize;
            // `b + 8` is at most `buf.len()`: the word is always there.
            if u32_at(&buf, b) != Some(0) {
                continue;
            }
            // Cheap filter before reading a marker run: the next marker (4 or
            // 8 bytes on) must be a plausible first-group size, unless this
            // is a one-marker table right before the tokens.
            let word = |off: usize| u32_at(&buf, b + off).map(u64::from);
            let first_group = 2 * 256..=MAX_ENTRY * 256;
            let near_end = t - s <= 8 + align8(3 * 256);
            let plausible = near_end
                || word(4).is_none_or(|w| first_group.contains(&w))
                || (word(4) == Some(0) && word(8).is_none_or(|w| first_group.contains(&w)));
            if !plausible {
                continue;
            }
            pace.pause().await;
            if let Some(found) = markers_at(view, tt, Gva(s), pace).await {
                return Some(found);
            }
        }
        if lo > want {
            // A hole below: the tables cannot continue past it.
            return None;
        }
        hi = lo;
    }
    None
}

/// Are there markers starting at `s` that fit the token table at `tt`?
async fn markers_at<V: VirtMemory + ?Sized>(
    view: &V,
    tt: &TokenTable,
    s: Gva,
    pace: &Budget,
) -> Option<NamesAndMarkers> {
    let t = tt.table.0;
    for width in [4u64, 8] {
        let run = marker_run(view, s, tt.table, width);
        // Longest first: a shorter prefix only fits if the run ran on into
        // the data after the markers.
        for m in (1..=run.len() as u64).rev() {
            let mend = align8(s.0 + width * m);
            if mend > t {
                continue;
            }
            let gap = t - mend;
            let (lo, hi) = ((m - 1) * 256 + 1, m * 256);
            let (n_lo, n_hi, seqs) = if gap == 0 {
                (lo, hi, None)
            } else {
                // align8(3 n) == gap
                let n_lo = core::cmp::max(lo, (gap.saturating_sub(7)).div_ceil(3));
                let n_hi = core::cmp::min(hi, gap / 3);
                (n_lo, n_hi, Some(Gva(mend)))
            };
            if n_lo > n_hi || !gap.is_multiple_of(8) {
                continue;
            }
            let Some(markers) = run.get(..m as usize) else {
                continue;
            };
            if let Some((names, num_syms, names_len)) =
                names_before(view, s, markers, n_lo, n_hi, pace).await
            {
                if seqs.is_some() && align8(3 * num_syms as u64) != gap {
                    continue;
                }
                return Some(NamesAndMarkers {
                    names,
                    names_len,
                    num_syms,
                    markers: s,
                    marker_width: width as u8,
                    seqs,
                });
            }
        }
    }
    None
}

/// Step 5: offsets and relative_base for one layout guess; `Some` when the
/// addresses decode sorted.
async fn offsets_at<V: VirtMemory + ?Sized>(
    view: &V,
    offsets: Gva,
    rb_at: Gva,
    n: u32,
    pace: &Budget,
) -> Option<(u64, AddressMode)> {
    let rb = u64::from_le_bytes(read_array(view, rb_at).ok()?);
    // A kernel-half canonical address.
    if rb < 0xffff_8000_0000_0000 {
        return None;
    }
    // Two passes over the offsets, read in pieces: is any negative (the
    // mode), then are the addresses sorted.
    let mut negative = false;
    for_each_offset(view, offsets, n, pace, |o| {
        negative |= o < 0;
        !negative
    })
    .await
    .ok()?;
    let mode = if negative {
        AddressMode::AbsolutePercpu
    } else {
        AddressMode::Relative
    };
    let mut prev = 0u64;
    let mut sorted = true;
    for_each_offset(view, offsets, n, pace, |o| {
        let a = mode.address(rb, o);
        // Relative addresses sit at or above the base (no wrap).
        let relative = !(mode == AddressMode::AbsolutePercpu && o >= 0);
        sorted = a >= prev && !(relative && a < rb);
        prev = a;
        sorted
    })
    .await
    .ok()?;
    if !sorted {
        return None;
    }
    Some((rb, mode))
}

/// Finds the kallsyms tables in `ranges` of `view`, trying each run of digit
/// tokens in address order until one checks out. `stats` accumulates what
/// the search cost. The search may do [`RECOVERY_BUDGET`] units of work
/// (see [`locate_budgeted`]).
pub fn locate<V: VirtMemory + ?Sized>(
    view: &V,
    ranges: &[GvaRange],
    stats: &mut LocateStats,
) -> Result<KallsymsTables, KallsymsError> {
    let budget = Budget::new(RECOVERY_BUDGET);
    block_on(locate_budgeted(&Metered::new(view, &budget), ranges, stats))
}

/// [`locate`] charging its reads (the scan and the validation of every
/// candidate) to the view's budget, and pausing on it between steps. Once
/// the budget is spent the search ends with
/// [`KallsymsError::BudgetExhausted`].
pub async fn locate_budgeted<V: VirtMemory + ?Sized>(
    view: &Metered<'_, V>,
    ranges: &[GvaRange],
    stats: &mut LocateStats,
) -> Result<KallsymsTables, KallsymsError> {
    let budget = view.budget();
    let counted = Counted {
        inner: view,
        reads: Cell::new(0),
        bytes: Cell::new(0),
    };
    let mut best_err = KallsymsError::NoTokenTable;
    let mut result = None;
    'ranges: for &range in ranges {
        let Some(mut scanner) = Scanner::new(range, DIGIT_TOKENS) else {
            continue;
        };
        loop {
            budget.pause().await;
            let p = match scanner.step(view, &mut stats.scan) {
                ScanStep::Hit(p) => p,
                ScanStep::Read => continue,
                ScanStep::Done => break,
                ScanStep::OverBudget => break 'ranges,
            };
            let Some(tt) = token_table_at(&counted, p) else {
                continue;
            };
            stats.token_tables += 1;
            match tables_from_tokens(&counted, &tt, range, budget).await {
                Ok(t) => {
                    result = Some(t);
                    break 'ranges;
                }
                Err(e) => {
                    if e.stage() >= best_err.stage() {
                        best_err = e;
                    }
                }
            }
            if budget.exhausted() {
                break 'ranges;
            }
        }
    }
    stats.validation_reads += counted.reads.get();
    stats.validation_bytes += counted.bytes.get();
    match result {
        Some(t) => Ok(t),
        None if budget.exhausted() => Err(KallsymsError::BudgetExhausted),
        None => Err(best_err),
    }
}

/// Steps 3 to 5 from a validated token table.
/// Every table must lie in `range`, the range the token table was found in.
async fn tables_from_tokens<V: VirtMemory + ?Sized>(
    view: &V,
    tt: &TokenTable,
    range: GvaRange,
    pace: &Budget,
) -> Result<KallsymsTables, KallsymsError> {
    let nm = markers_before(view, tt, pace)
        .await
        .ok_or(KallsymsError::NoMarkers {
            token_table: tt.table,
        })?;
    let n = nm.num_syms;
    if n > MAX_SYMS {
        return Err(KallsymsError::TooManySymbols(n));
    }
    let offsets_bytes = align8(4 * n as u64);
    // 6.1 order: relative_base right before num_syms, offsets before it.
    let first = nm
        .names
        .0
        .checked_sub(16 + offsets_bytes)
        .map(|off| (Gva(off), Gva(nm.names.0 - 16)));
    // 6.12 order: offsets right after the token index.
    let last = tt.index.0.checked_add(512).and_then(|off| {
        let rb = off.checked_add(4 * n as u64 + 7)? & !7;
        Some((Gva(off), Gva(rb)))
    });
    for (layout, guess) in [(Layout::OffsetsFirst, first), (Layout::OffsetsLast, last)] {
        let Some((offsets, rb_at)) = guess else {
            continue;
        };
        // Offsets and relative_base inside the range searched: no reading
        // of a guest-claimed table size beyond it.
        let inside = range.contains(offsets)
            && rb_at
                .checked_add(8)
                .is_some_and(|e| rb_at > offsets && e <= range.end);
        if !inside {
            continue;
        }
        if let Some((relative_base, mode)) = offsets_at(view, offsets, rb_at, n, pace).await {
            let seqs_of_names = match layout {
                Layout::OffsetsFirst => nm.seqs,
                Layout::OffsetsLast => rb_at.checked_add(8),
            };
            return Ok(KallsymsTables {
                num_syms: n,
                names: nm.names,
                names_len: nm.names_len as u32,
                markers: nm.markers,
                marker_width: nm.marker_width,
                seqs_of_names,
                token_table: tt.table,
                token_table_len: tt.len as u32,
                token_index: tt.index,
                offsets,
                relative_base_at: rb_at,
                relative_base,
                layout,
                mode,
            });
        }
    }
    Err(KallsymsError::NoOffsets { names: nm.names })
}
