//! A compact symbol index over a copy of the kernel's kallsyms tables.
//!
//! The names stay compressed, as the kernel keeps them: the index holds the
//! `names` stream and the token table as copied from the guest, plus
//!
//! - `offsets` (4 bytes a symbol): the kernel's own address encoding. The
//!   kernel sorts its table by address, so symbol ids are in address order
//!   and a binary search over the decoded offsets resolves an address;
//! - `anchors` (4 bytes every 16 symbols): where in `names` symbol `16 k`
//!   starts; a name is found by skipping at most 15 entries from there;
//! - `buckets` (about 5 bytes a symbol): an open-addressing hash table from
//!   name to id, each slot holding the id (22 bits) and 10 more hash bits
//!   that spare most string comparisons.
//!
//! Copying keeps the index independent of what the guest later does to its
//! own memory. A name is expanded only when asked for or compared.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use super::locate::{AddressMode, KallsymsError, KallsymsTables};
use super::{entry_header, for_each_offset, KSYM_NAME_LEN, MAX_SYMS};
use crate::addr::{Gva, GvaRange};
use crate::budget::{block_on, Budget, Metered, RECOVERY_BUDGET};
use crate::fallible::{self, OutOfMemory};
use crate::glob;
use crate::view::{read_array, ViewError, VirtMemory};

/// Default bound on an index's heap: far above a real kernel's (about
/// 2 MiB for Debian's 94k symbols), far below what forged tables could ask.
pub const DEFAULT_MAX_INDEX_BYTES: usize = 64 << 20;
/// Bytes of `names` copied between two pauses.
const NAMES_PIECE: usize = 64 * 1024;
/// One anchor every this many symbols.
const ANCHOR_EVERY: u32 = 16;
/// Id bits in a bucket slot; the rest are hash tag bits.
const ID_BITS: u32 = 22;
const ID_MASK: u32 = (1 << ID_BITS) - 1;
const EMPTY: u32 = u32::MAX;

/// A symbol's position in the kallsyms table (and so in address order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SymbolId(pub u32);

/// The `nm`-style type letter the kernel stores first in every name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SymbolKind(pub u8);

impl SymbolKind {
    /// The letter as a `char`.
    pub fn letter(self) -> char {
        self.0 as char
    }

    /// `t` or `T`: code, by the symbol table's word.
    pub fn is_text(self) -> bool {
        matches!(self.0, b't' | b'T')
    }

    /// `w` or `W`: a weak symbol, which may be code or data.
    pub fn is_weak(self) -> bool {
        matches!(self.0, b'w' | b'W')
    }

    /// An upper-case (global) letter.
    pub fn is_global(self) -> bool {
        self.0.is_ascii_uppercase()
    }
}

/// One symbol: where it is and what kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Symbol {
    /// Its id.
    pub id: SymbolId,
    /// Its runtime address.
    pub addr: Gva,
    /// Its type letter.
    pub kind: SymbolKind,
}

/// An address resolved to `symbol+offset/size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The symbol containing the address (the first of its aliases).
    pub id: SymbolId,
    /// The symbol's address.
    pub addr: Gva,
    /// How far into the symbol the address is.
    pub offset: u64,
    /// Distance to the next symbol at a higher address (capped at the end of
    /// the text region the symbol is in); `None` for the last symbol.
    pub size: Option<u64>,
}

/// Decoding state: the token table split into strings.
#[derive(Clone, Debug)]
struct Tokens {
    bytes: Vec<u8>,
    start: [u16; 256],
    len: [u16; 256],
}

impl Tokens {
    /// Token `t`'s bytes (its NUL left out). Every byte value has one, and
    /// the build checked that each lies in `bytes`: the empty fallback is
    /// never taken.
    #[inline]
    fn get(&self, t: u8) -> &[u8] {
        let t = usize::from(t);
        match (self.start.get(t), self.len.get(t)) {
            (Some(&s), Some(&l)) => {
                let s = usize::from(s);
                self.bytes.get(s..s + usize::from(l)).unwrap_or_default()
            }
            _ => &[],
        }
    }
}

/// What an index is made of, borrowed for [`super::packed`].
pub(super) struct PackedParts<'a> {
    pub relative_base: u64,
    pub mode: AddressMode,
    pub offsets: &'a [i32],
    pub names: &'a [u8],
    pub anchors: &'a [u32],
    pub token_table: &'a [u8],
    pub token_starts: &'a [u16; 256],
}

/// One anchor every this many symbols, for [`super::packed`].
pub(super) const ANCHOR_STRIDE: u32 = ANCHOR_EVERY;

/// The symbol index. Build it with [`SymbolIndex::build`].
#[derive(Clone)]
pub struct SymbolIndex {
    relative_base: u64,
    mode: AddressMode,
    offsets: Vec<i32>,
    names: Vec<u8>,
    anchors: Vec<u32>,
    tokens: Tokens,
    buckets: Vec<u32>,
    text: Option<GvaRange>,
    init_text: Option<GvaRange>,
    /// The most slots one insertion probed.
    longest_probe: u64,
}

impl fmt::Debug for SymbolIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SymbolIndex")
            .field("symbols", &self.offsets.len())
            .field("relative_base", &format_args!("{:#x}", self.relative_base))
            .field("mode", &self.mode)
            .field("heap_bytes", &self.heap_bytes())
            .finish()
    }
}

/// FNV-1a, 64 bits, fed incrementally.
#[derive(Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    const fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    #[inline]
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The hash, mixed (MurmurHash3's 64-bit finalizer): FNV's low bits
    /// barely change with the last bytes, which would cluster names that
    /// differ only at the end in neighbouring buckets.
    #[inline]
    fn finish(self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// Bucket count for `n` symbols: load factor 0.8 at most.
fn bucket_count(n: usize) -> usize {
    core::cmp::max(8, n + n / 4 + 1)
}

#[inline]
fn home(hash: u64, buckets: usize) -> usize {
    (((hash as u32) as u64 * buckets as u64) >> 32) as usize
}

#[inline]
fn tag(hash: u64) -> u32 {
    ((hash >> 54) as u32) << ID_BITS
}

impl SymbolIndex {
    /// Copies the tables found by [`super::locate`] out of `view` and indexes
    /// them. Every entry is decoded once: the markers are checked, each name
    /// must start with a printable type letter and expand to at most
    /// [`KSYM_NAME_LEN`] bytes.
    ///
    /// The index may take at most [`DEFAULT_MAX_INDEX_BYTES`]; see
    /// [`Self::build_limited`].
    pub fn build<V: VirtMemory + ?Sized>(
        view: &V,
        t: &KallsymsTables,
    ) -> Result<Self, KallsymsError> {
        Self::build_limited(view, t, DEFAULT_MAX_INDEX_BYTES)
    }

    /// The heap bytes an index of these tables will take (the peak during
    /// the build is the same: nothing of a guest-chosen size is read into a
    /// temporary buffer).
    pub fn size_for(t: &KallsymsTables) -> usize {
        let n = t.num_syms as usize;
        t.names_len as usize
            + 4 * n
            + 4 * bucket_count(n)
            + 4 * n.div_ceil(ANCHOR_EVERY as usize)
            + t.token_table_len as usize
    }

    /// [`Self::build`], refusing ([`KallsymsError::TooLarge`]) tables whose
    /// index would take more than `max_bytes` of heap: the sizes come from
    /// guest memory, and a hypervisor heap is small. Every buffer is
    /// reserved fallibly: a heap that cannot serve one (even within
    /// `max_bytes`) gives [`KallsymsError::OutOfMemory`], never an abort. The build may do
    /// [`RECOVERY_BUDGET`] units of work (see [`Self::build_budgeted`]).
    pub fn build_limited<V: VirtMemory + ?Sized>(
        view: &V,
        t: &KallsymsTables,
        max_bytes: usize,
    ) -> Result<Self, KallsymsError> {
        let budget = Budget::new(RECOVERY_BUDGET);
        block_on(Self::build_budgeted(
            &Metered::new(view, &budget),
            t,
            max_bytes,
        ))
    }

    /// [`Self::build_limited`] charging its reads and its decoding (the
    /// expanded name bytes and the hash table probes, which forged tables
    /// could make quadratic) to the view's budget, and pausing on it
    /// between pieces. [`KallsymsError::BudgetExhausted`] once it is spent.
    pub async fn build_budgeted<V: VirtMemory + ?Sized>(
        view: &Metered<'_, V>,
        t: &KallsymsTables,
        max_bytes: usize,
    ) -> Result<Self, KallsymsError> {
        let budget = view.budget();
        let n = t.num_syms;
        if n > MAX_SYMS {
            return Err(KallsymsError::TooManySymbols(n));
        }
        let bytes = Self::size_for(t);
        if bytes > max_bytes {
            return Err(KallsymsError::TooLarge { bytes });
        }
        let read_err = |e: ViewError| {
            if budget.exhausted() {
                KallsymsError::BudgetExhausted
            } else {
                KallsymsError::Read(e)
            }
        };
        // A refused allocation reports what the whole index needs.
        let oom = |_: OutOfMemory| KallsymsError::OutOfMemory { bytes };
        let read = |gva: Gva, len: usize| -> Result<Vec<u8>, KallsymsError> {
            let mut v = fallible::try_vec(0u8, len).map_err(oom)?;
            view.read_virt(gva, &mut v).map_err(read_err)?;
            Ok(v)
        };
        // The token table and index.
        let bytes = read(t.token_table, t.token_table_len as usize)?;
        let raw: [u8; 512] = read_array(view, t.token_index).map_err(read_err)?;
        let mut start = [0u16; 256];
        let mut len = [0u16; 256];
        let slots = start.iter_mut().zip(len.iter_mut());
        for (&pair, (start, len)) in raw.as_chunks::<2>().0.iter().zip(slots) {
            let s = u16::from_le_bytes(pair) as usize;
            let rest = bytes
                .get(s..)
                .ok_or(KallsymsError::BadNames { symbol: 0 })?;
            let l = rest
                .iter()
                .position(|&c| c == 0)
                .ok_or(KallsymsError::BadNames { symbol: 0 })?;
            *start = s as u16;
            *len = l as u16;
        }
        let tokens = Tokens { bytes, start, len };

        let mut names = fallible::try_vec(0u8, t.names_len as usize).map_err(oom)?;
        let mut at = t.names;
        for piece in names.chunks_mut(NAMES_PIECE) {
            budget.pause().await;
            view.read_virt(at, piece).map_err(read_err)?;
            at = at.wrapping_add(piece.len() as u64);
        }
        let marker_count = (n as usize).div_ceil(256);
        let markers_raw = read(t.markers, marker_count * t.marker_width as usize)?;
        // Marker `k` (its low 32 bits), for `k` below `marker_count`.
        let marker = |k: usize| {
            let o = k * t.marker_width as usize;
            markers_raw
                .get(o..)
                .and_then(<[u8]>::first_chunk)
                .map(|&m| u32::from_le_bytes(m) as usize)
        };
        // Reserved for all `n`: the pushes below never grow it.
        let mut offsets: Vec<i32> = fallible::try_with_capacity(n as usize).map_err(oom)?;
        for_each_offset(view, t.offsets, n, budget, |o| {
            offsets.push(o);
            true
        })
        .await
        .map_err(read_err)?;

        let mut index = SymbolIndex {
            relative_base: t.relative_base,
            mode: t.mode,
            offsets,
            names,
            // One anchor per `ANCHOR_EVERY` ids, all reserved here.
            anchors: fallible::try_with_capacity((n as usize).div_ceil(ANCHOR_EVERY as usize))
                .map_err(oom)?,
            tokens,
            buckets: fallible::try_vec(EMPTY, bucket_count(n as usize)).map_err(oom)?,
            text: None,
            init_text: None,
            longest_probe: 0,
        };

        // One pass over every entry.
        let mut off = 0usize;
        let mut prev_addr = 0u64;
        for id in 0..n {
            // Per entry: an entry's probes can be many (see `insert`).
            budget.pause().await;
            let bad = KallsymsError::BadNames { symbol: id };
            if id % 256 == 0 && marker(id as usize / 256) != Some(off) {
                return Err(bad);
            }
            if id % ANCHOR_EVERY == 0 {
                index.anchors.push(off as u32);
            }
            let (h, l) = entry_header(&index.names, off).ok_or(bad)?;
            let body = index.names.get(off + h..off + h + l).ok_or(bad)?;
            let (kind, hash, expanded) = index.hash_entry(body).ok_or(bad)?;
            if l == 0 || !kind.is_ascii_graphic() {
                return Err(bad);
            }
            // `for_each_offset` read all `n` offsets (or failed above).
            let &offset = index.offsets.get(id as usize).ok_or(bad)?;
            let addr = index.mode.address(index.relative_base, offset);
            if addr < prev_addr {
                return Err(bad);
            }
            prev_addr = addr;
            let probes = index.insert(hash, id);
            index.longest_probe = index.longest_probe.max(probes);
            budget
                .charge(expanded as u64 + probes)
                .map_err(|_| KallsymsError::BudgetExhausted)?;
            off += h + l;
        }
        if off != index.names.len() {
            return Err(KallsymsError::BadNames { symbol: n });
        }
        index.text = index
            .region("_stext", "_etext")
            .or_else(|| index.region("_text", "_etext"));
        index.init_text = index.region("_sinittext", "_einittext");
        Ok(index)
    }

    /// Expands an entry's tokens: (type letter, hash of the name without
    /// it, expanded name length without it). `None` for an entry without
    /// a type letter or whose name expands past [`KSYM_NAME_LEN`] (checked
    /// before hashing each token: a forged token table can make every token
    /// 64 KiB long).
    fn hash_entry(&self, body: &[u8]) -> Option<(u8, u64, usize)> {
        let mut h = Fnv::new();
        let mut kind = None;
        let mut total = 0usize;
        for &t in body {
            let mut s = self.tokens.get(t);
            if kind.is_none() {
                let (&k, rest) = s.split_first()?;
                kind = Some(k);
                s = rest;
            }
            total += s.len();
            if total > KSYM_NAME_LEN {
                return None;
            }
            h.feed(s);
        }
        Some((kind?, h.finish(), total))
    }

    /// Inserts `id`; returns the slots probed (names that hash alike, as
    /// forged tables can make them all, cost quadratic time).
    fn insert(&mut self, hash: u64, id: u32) -> u64 {
        let nb = self.buckets.len();
        let mut i = home(hash, nb);
        let mut probes = 1;
        // `home` is below `nb`, and so is every slot after it (wrapping):
        // the loop only ends at an empty slot (there is one at least, the
        // table being larger than the symbol count).
        while let Some(slot) = self.buckets.get_mut(i) {
            if *slot == EMPTY {
                *slot = tag(hash) | id;
                break;
            }
            i = if i + 1 == nb { 0 } else { i + 1 };
            probes += 1;
        }
        probes
    }

    /// `[start symbol, end symbol)` when both exist.
    fn region(&self, start: &str, end: &str) -> Option<GvaRange> {
        let s = self.symbol(self.lookup(start)?).addr;
        let e = self.symbol(self.lookup(end)?).addr;
        (s < e).then_some(GvaRange::new(s, e))
    }

    /// The parts [`super::packed`] writes out: relative base, address
    /// mode, offsets, names stream, anchors, token table and token starts.
    pub(super) fn packed_parts(&self) -> PackedParts<'_> {
        PackedParts {
            relative_base: self.relative_base,
            mode: self.mode,
            offsets: &self.offsets,
            names: &self.names,
            anchors: &self.anchors,
            token_table: &self.tokens.bytes,
            token_starts: &self.tokens.start,
        }
    }

    /// The most hash table slots one symbol's insertion probed (a lookup of
    /// its name probes as many).
    pub fn longest_probe_run(&self) -> u64 {
        self.longest_probe
    }

    /// Number of symbols.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether there is no symbol.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// The relative base the addresses are computed from (a runtime address).
    pub fn relative_base(&self) -> u64 {
        self.relative_base
    }

    /// How offsets were turned into addresses.
    pub fn mode(&self) -> AddressMode {
        self.mode
    }

    /// `[_stext, _etext)` (or from `_text`), when those symbols exist.
    pub fn text(&self) -> Option<GvaRange> {
        self.text
    }

    /// `[_sinittext, _einittext)`, when those symbols exist.
    pub fn init_text(&self) -> Option<GvaRange> {
        self.init_text
    }

    /// Bytes of heap the index holds.
    pub fn heap_bytes(&self) -> usize {
        self.offsets.capacity() * 4
            + self.names.capacity()
            + self.anchors.capacity() * 4
            + self.tokens.bytes.capacity()
            + self.buckets.capacity() * 4
    }

    /// The address of symbol `id` (0 for an id not below [`Self::len`]).
    #[inline]
    fn addr(&self, id: usize) -> u64 {
        self.offsets
            .get(id)
            .map_or(0, |&o| self.mode.address(self.relative_base, o))
    }

    /// Where symbol `id`'s entry starts in `names`; `None` for an id not
    /// below [`Self::len`].
    fn entry_offset(&self, id: u32) -> Option<usize> {
        let mut off = *self.anchors.get((id / ANCHOR_EVERY) as usize)? as usize;
        for _ in 0..id % ANCHOR_EVERY {
            // Entries were validated at build time.
            let (h, l) = entry_header(&self.names, off).unwrap_or((1, 0));
            off += h + l;
        }
        Some(off)
    }

    /// The token bytes of symbol `id`'s entry (none for an id not below
    /// [`Self::len`]).
    fn entry(&self, id: SymbolId) -> &[u8] {
        let Some(off) = self.entry_offset(id.0) else {
            return &[];
        };
        let (h, l) = entry_header(&self.names, off).unwrap_or((1, 0));
        self.names.get(off + h..off + h + l).unwrap_or_default()
    }

    /// Symbol `id`. Ids come from this index, never from the guest; one
    /// not below [`Self::len`] gives address 0, kind `?` and an empty
    /// name (no panic).
    pub fn symbol(&self, id: SymbolId) -> Symbol {
        let first = self
            .entry(id)
            .first()
            .map_or(&[][..], |&t| self.tokens.get(t));
        Symbol {
            id,
            addr: Gva(self.addr(id.0 as usize)),
            kind: SymbolKind(first.first().copied().unwrap_or(b'?')),
        }
    }

    /// Every symbol, in address order.
    pub fn iter(&self) -> impl Iterator<Item = Symbol> + '_ {
        (0..self.len() as u32).map(move |i| self.symbol(SymbolId(i)))
    }

    /// Calls `f` with the pieces of symbol `id`'s name, type letter left out.
    fn name_pieces(&self, id: SymbolId, mut f: impl FnMut(&[u8]) -> bool) {
        let mut first = true;
        for &t in self.entry(id) {
            let mut s = self.tokens.get(t);
            if first {
                s = s.get(1..).unwrap_or(&[]);
                first = false;
            }
            if !f(s) {
                return;
            }
        }
    }

    /// Appends symbol `id`'s name (without the type letter) to `out`.
    pub fn name_into(&self, id: SymbolId, out: &mut Vec<u8>) {
        self.name_pieces(id, |s| {
            out.extend_from_slice(s);
            true
        });
    }

    /// Symbol `id`'s name, non-UTF-8 bytes replaced.
    pub fn name(&self, id: SymbolId) -> String {
        let mut v = Vec::new();
        self.name_into(id, &mut v);
        String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// Whether symbol `id` is called `name`, expanding no more than needed.
    pub fn name_is(&self, id: SymbolId, name: &[u8]) -> bool {
        let mut rest = name;
        let mut equal = true;
        self.name_pieces(id, |s| match rest.strip_prefix(s) {
            Some(after) => {
                rest = after;
                true
            }
            None => {
                equal = false;
                false
            }
        });
        equal && rest.is_empty()
    }

    /// The first symbol (lowest address) called exactly `name`.
    pub fn lookup(&self, name: &str) -> Option<SymbolId> {
        self.lookup_all(name).next()
    }

    /// Every symbol called exactly `name`, lowest address first (static
    /// functions of the same name are common).
    pub fn lookup_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = SymbolId> + 'a {
        let mut h = Fnv::new();
        h.feed(name.as_bytes());
        let nb = self.buckets.len();
        let hash = h.finish();
        let mut i = home(hash, nb);
        let want = tag(hash);
        let mut done = nb == 0;
        core::iter::from_fn(move || {
            while !done {
                // `i` stays below `nb`, as in `insert`.
                let Some(&slot) = self.buckets.get(i) else {
                    done = true;
                    return None;
                };
                i = if i + 1 == nb { 0 } else { i + 1 };
                if slot == EMPTY {
                    done = true;
                    return None;
                }
                if slot & !ID_MASK == want {
                    let id = SymbolId(slot & ID_MASK);
                    if self.name_is(id, name.as_bytes()) {
                        return Some(id);
                    }
                }
            }
            None
        })
    }

    /// The address of the first symbol called `name`.
    pub fn addr_of(&self, name: &str) -> Option<Gva> {
        self.lookup(name).map(|id| self.symbol(id).addr)
    }

    /// Every symbol whose name matches the glob `pattern` (`*` any run,
    /// `?` any one byte), in address order. Decodes every name: O(total name
    /// length).
    pub fn glob<'a>(&'a self, pattern: &'a str) -> impl Iterator<Item = SymbolId> + 'a {
        let mut buf = Vec::with_capacity(64);
        (0..self.len() as u32).map(SymbolId).filter(move |&id| {
            buf.clear();
            self.name_into(id, &mut buf);
            glob::matches(pattern.as_bytes(), &buf)
        })
    }

    /// The size of symbol `id`: the distance to the next symbol at a higher
    /// address, capped at the end of the text region it is in.
    pub fn size(&self, id: SymbolId) -> Option<u64> {
        let i = id.0 as usize;
        let a = self.addr(i);
        let next = (i + 1..self.len()).map(|j| self.addr(j)).find(|&b| b > a);
        let cap = [self.text, self.init_text]
            .into_iter()
            .flatten()
            .find(|r| r.contains(Gva(a)))
            .map(|r| r.end.0);
        match (next, cap) {
            (Some(b), Some(c)) => Some(core::cmp::min(b, c) - a),
            (Some(b), None) => Some(b - a),
            (None, Some(c)) => Some(c - a),
            (None, None) => None,
        }
    }

    /// The symbol containing `addr`: the last one at or below it (the first
    /// of its aliases, as the kernel picks), by binary search.
    pub fn resolve(&self, addr: Gva) -> Option<Resolved> {
        let n = self.len();
        // Number of symbols at or below addr.
        let (mut lo, mut hi) = (0usize, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.addr(mid) <= addr.0 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let mut i = lo.checked_sub(1)?;
        let a = self.addr(i);
        while i > 0 && self.addr(i - 1) == a {
            i -= 1;
        }
        let id = SymbolId(i as u32);
        let size = self.size(id);
        // Past the end of a region's last symbol (between `_etext` and the
        // next symbol): nothing contains it. Otherwise the next symbol is
        // above `addr`, so the offset is within the size.
        if size.is_some_and(|s| addr.0 - a >= s) {
            return None;
        }
        Some(Resolved {
            id,
            addr: Gva(a),
            offset: addr.0 - a,
            size,
        })
    }

    /// Writes `name+0xoff/0xsize` (the kernel's `%pS` style) for `addr`, or
    /// the bare address when no symbol contains it.
    pub fn format_addr(&self, addr: Gva, out: &mut impl fmt::Write) -> fmt::Result {
        match self.resolve(addr) {
            Some(r) => {
                let mut name = Vec::new();
                self.name_into(r.id, &mut name);
                out.write_str(&String::from_utf8_lossy(&name))?;
                match r.size {
                    Some(s) => write!(out, "+{:#x}/{:#x}", r.offset, s),
                    None => write!(out, "+{:#x}", r.offset),
                }
            }
            None => write!(out, "{addr}"),
        }
    }
}
