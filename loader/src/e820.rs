//! The e820 memory map handed to the guest, and the queries the loader needs
//! to place things in it.
//!
//! Layout of one entry: `struct boot_e820_entry` in
//! arch/x86/include/uapi/asm/bootparam.h (20 bytes, packed). The zero page
//! holds at most [`E820_MAX_ENTRIES`] of them.

use core::fmt;
use core::mem::size_of;

use crate::layout::ranges_overlap;

/// Maximum number of entries in the zero page's `e820_table`
/// (`E820_MAX_ENTRIES_ZEROPAGE`), and so in an [`E820Map`].
pub const E820_MAX_ENTRIES: usize = 128;

/// One e820 entry exactly as Linux reads it from the zero page.
#[repr(C, packed)]
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct E820Entry {
    /// First byte of the range.
    pub addr: u64,
    /// Length of the range in bytes.
    pub size: u64,
    /// Raw type (see [`E820Kind`]).
    pub kind: u32,
}

const _: () = assert!(size_of::<E820Entry>() == 20);
const _: () = assert!(core::mem::offset_of!(E820Entry, addr) == 0);
const _: () = assert!(core::mem::offset_of!(E820Entry, size) == 8);
const _: () = assert!(core::mem::offset_of!(E820Entry, kind) == 16);

impl E820Entry {
    /// Size of one encoded entry.
    pub const SIZE: usize = 20;

    /// An entry of the given kind.
    pub const fn new(addr: u64, size: u64, kind: E820Kind) -> Self {
        Self {
            addr,
            size,
            kind: kind.to_raw(),
        }
    }

    /// The typed kind.
    pub const fn typed_kind(&self) -> E820Kind {
        E820Kind::from_raw(self.kind)
    }

    /// Whether this is usable RAM.
    pub const fn is_ram(&self) -> bool {
        self.kind == E820Kind::Ram.to_raw()
    }

    /// One past the last byte, computed in 128 bits so that a range ending
    /// at the top of the address space does not wrap.
    pub const fn end(&self) -> u128 {
        self.addr as u128 + self.size as u128
    }

    /// Little-endian encoding, as in the zero page.
    pub const fn to_bytes(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        let a = self.addr.to_le_bytes();
        let s = self.size.to_le_bytes();
        let k = self.kind.to_le_bytes();
        let mut i = 0;
        while i < 8 {
            out[i] = a[i];
            out[8 + i] = s[i];
            i += 1;
        }
        let mut i = 0;
        while i < 4 {
            out[16 + i] = k[i];
            i += 1;
        }
        out
    }

    /// Decodes the little-endian zero-page encoding.
    pub fn from_bytes(b: &[u8; 20]) -> Self {
        let mut a = [0u8; 8];
        let mut s = [0u8; 8];
        let mut k = [0u8; 4];
        a.copy_from_slice(&b[0..8]);
        s.copy_from_slice(&b[8..16]);
        k.copy_from_slice(&b[16..20]);
        Self {
            addr: u64::from_le_bytes(a),
            size: u64::from_le_bytes(s),
            kind: u32::from_le_bytes(k),
        }
    }
}

impl fmt::Debug for E820Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (addr, size) = (self.addr, self.size);
        write!(
            f,
            "[{:#014x}-{:#014x}] {:?}",
            addr,
            self.end().saturating_sub(1),
            self.typed_kind()
        )?;
        if size == 0 {
            f.write_str(" (empty)")?;
        }
        Ok(())
    }
}

/// The e820 range types Linux knows (arch/x86/include/asm/e820/types.h).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum E820Kind {
    /// Usable RAM (1).
    Ram,
    /// Reserved (2).
    Reserved,
    /// ACPI tables, reclaimable after boot (3).
    Acpi,
    /// ACPI non-volatile storage (4).
    Nvs,
    /// Unusable, e.g. bad memory (5).
    Unusable,
    /// Any other type, kept as is.
    Other(u32),
}

impl E820Kind {
    /// The raw e820 type number.
    pub const fn to_raw(self) -> u32 {
        match self {
            E820Kind::Ram => 1,
            E820Kind::Reserved => 2,
            E820Kind::Acpi => 3,
            E820Kind::Nvs => 4,
            E820Kind::Unusable => 5,
            E820Kind::Other(x) => x,
        }
    }

    /// The kind for a raw e820 type number.
    pub const fn from_raw(raw: u32) -> Self {
        match raw {
            1 => E820Kind::Ram,
            2 => E820Kind::Reserved,
            3 => E820Kind::Acpi,
            4 => E820Kind::Nvs,
            5 => E820Kind::Unusable,
            x => E820Kind::Other(x),
        }
    }
}

impl From<u32> for E820Kind {
    fn from(raw: u32) -> Self {
        Self::from_raw(raw)
    }
}

impl From<E820Kind> for u32 {
    fn from(kind: E820Kind) -> Self {
        kind.to_raw()
    }
}

/// Why an [`E820Map`] operation failed. The map is left unchanged.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum E820Error {
    /// The map already holds [`E820_MAX_ENTRIES`] entries, or the operation
    /// would need more than that.
    Full,
}

impl fmt::Display for E820Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            E820Error::Full => write!(
                f,
                "memory map: more than {E820_MAX_ENTRIES} e820 entries needed"
            ),
        }
    }
}

/// A fixed-capacity e820 map (no allocation).
#[derive(Clone)]
pub struct E820Map {
    entries: [E820Entry; E820_MAX_ENTRIES],
    len: usize,
}

impl Default for E820Map {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for E820Map {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl E820Map {
    /// An empty map.
    pub const fn new() -> Self {
        Self {
            entries: [E820Entry {
                addr: 0,
                size: 0,
                kind: 0,
            }; E820_MAX_ENTRIES],
            len: 0,
        }
    }

    /// A map holding `entries`, in the given order.
    pub fn from_entries(entries: &[E820Entry]) -> Result<Self, E820Error> {
        let mut map = Self::new();
        for e in entries {
            map.push(*e)?;
        }
        Ok(map)
    }

    /// Number of entries.
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether the map has no entries.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The entries, in their current order.
    pub fn as_slice(&self) -> &[E820Entry] {
        &self.entries[..self.len]
    }

    /// Iterates over the entries.
    pub fn iter(&self) -> impl Iterator<Item = &E820Entry> + '_ {
        self.as_slice().iter()
    }

    /// Appends an entry.
    pub fn push(&mut self, entry: E820Entry) -> Result<(), E820Error> {
        let slot = self.entries.get_mut(self.len).ok_or(E820Error::Full)?;
        *slot = entry;
        self.len += 1;
        Ok(())
    }

    /// Appends a range of the given kind.
    pub fn add(&mut self, addr: u64, size: u64, kind: E820Kind) -> Result<(), E820Error> {
        self.push(E820Entry::new(addr, size, kind))
    }

    fn remove_at(&mut self, index: usize) {
        if index < self.len {
            self.entries.copy_within(index + 1..self.len, index);
            self.len -= 1;
        }
    }

    /// Carves `[base, base + len)` out of every RAM entry it overlaps,
    /// splitting an entry in two when the hole falls strictly inside it.
    /// Entries of other kinds are left alone, and the order of the entries is
    /// kept (a sorted map stays sorted). Fails, changing nothing, when the
    /// splits would need more than [`E820_MAX_ENTRIES`] entries.
    pub fn remove_range(&mut self, base: u64, len: u64) -> Result<(), E820Error> {
        if len == 0 {
            return Ok(());
        }
        let hole_start = base as u128;
        let hole_end = base as u128 + len as u128;

        // Count the splits first so that a failure leaves the map unchanged.
        let splits = self
            .iter()
            .filter(|e| e.is_ram() && (e.addr as u128) < hole_start && e.end() > hole_end)
            .count();
        if self.len + splits > E820_MAX_ENTRIES {
            return Err(E820Error::Full);
        }

        let mut i = 0;
        while i < self.len {
            let e = self.entries[i];
            let (start, end) = (e.addr as u128, e.end());
            if !e.is_ram() || end <= hole_start || start >= hole_end {
                i += 1;
                continue;
            }
            // The pieces left lie inside the original entry, so they fit in
            // 64 bits: the low piece ends at hole_start (a u64 base), and the
            // high one starts at hole_end, below the entry's end.
            let low = (start < hole_start).then(|| E820Entry {
                addr: e.addr,
                size: (hole_start - start) as u64,
                kind: e.kind,
            });
            let high = (end > hole_end).then(|| E820Entry {
                addr: hole_end as u64,
                size: (end - hole_end) as u64,
                kind: e.kind,
            });
            match (low, high) {
                (None, None) => {
                    self.remove_at(i);
                    continue;
                }
                (Some(piece), None) | (None, Some(piece)) => self.entries[i] = piece,
                (Some(low), Some(high)) => {
                    self.entries[i] = low;
                    // Capacity was checked above. The high piece goes right
                    // after the low one, so a sorted map stays sorted; it
                    // does not overlap the hole, so skip over it.
                    self.entries.copy_within(i + 1..self.len, i + 2);
                    self.entries[i + 1] = high;
                    self.len += 1;
                    i += 1;
                }
            }
            i += 1;
        }
        Ok(())
    }

    fn sort(&mut self) {
        // Insertion sort: at most 128 entries, no allocation, stable.
        let entries = &mut self.entries[..self.len];
        for i in 1..entries.len() {
            let mut j = i;
            while j > 0 && key(&entries[j - 1]) > key(&entries[j]) {
                entries.swap(j - 1, j);
                j -= 1;
            }
        }
        fn key(e: &E820Entry) -> (u64, u32, u64) {
            (e.addr, e.kind, e.size)
        }
    }

    fn merge_same_kind(&mut self) {
        // Expects the map sorted by address. Merges each entry into the
        // previous entry of the same kind that it overlaps or touches.
        let mut out = 0;
        for i in 0..self.len {
            let e = self.entries[i];
            if e.size == 0 {
                continue;
            }
            // The latest kept entry of the same kind is the only candidate:
            // kept entries of one kind are sorted and disjoint. With several
            // kinds interleaved it need not be the last entry kept.
            let prev = (0..out).rev().find(|&k| self.entries[k].kind == e.kind);
            match prev {
                Some(k) if self.entries[k].end() >= e.addr as u128 => {
                    let p = self.entries[k];
                    let end = p.end().max(e.end());
                    // A range wider than 64 bits cannot be described; clamp
                    // (only reachable with entries that run past 2^64).
                    let size = (end - p.addr as u128).min(u64::MAX as u128) as u64;
                    self.entries[k].size = size;
                }
                _ => {
                    self.entries[out] = e;
                    out += 1;
                }
            }
        }
        self.len = out;
    }

    /// Puts the map in canonical form: drops empty entries, sorts by address,
    /// merges touching or overlapping entries of the same kind, and gives any
    /// range that is both RAM and something else to the other kind (so no RAM
    /// entry overlaps any other entry afterwards). Overlaps between two
    /// non-RAM kinds are kept, as Linux will sort those out itself.
    pub fn sanitize(&mut self) -> Result<(), E820Error> {
        let backup = self.clone();
        self.sort();
        self.merge_same_kind();
        // Carve every non-RAM range out of RAM. Carving moves RAM entries
        // around, so walk a copy. Each carve may split a RAM entry, which
        // remove_range checks against the capacity.
        let merged = self.clone();
        for e in merged.iter().filter(|e| !e.is_ram()) {
            if let Err(err) = self.remove_range(e.addr, e.size) {
                *self = backup;
                return Err(err);
            }
        }
        self.sort();
        self.merge_same_kind();
        Ok(())
    }

    /// Total bytes of RAM in the map (counting overlapping RAM entries twice,
    /// so call [`sanitize`](Self::sanitize) first).
    pub fn total_ram(&self) -> u64 {
        self.iter()
            .filter(|e| e.is_ram())
            .fold(0u64, |acc, e| acc.saturating_add(e.size))
    }

    /// Whether every byte of `[base, base + len)` is RAM, possibly across
    /// several entries. An empty range is RAM.
    pub fn is_ram(&self, base: u64, len: u64) -> bool {
        let end = base as u128 + len as u128;
        let mut cursor = base as u128;
        while cursor < end {
            let next = self
                .iter()
                .filter(|e| e.is_ram() && (e.addr as u128) <= cursor && e.end() > cursor)
                .map(|e| e.end())
                .max();
            match next {
                Some(n) => cursor = n,
                None => return false,
            }
        }
        true
    }

    /// The lowest `align`-aligned address `a` such that `[a, a + size)` lies
    /// inside one RAM entry, `a >= min_addr`, `a + size <= max_end`, and the
    /// range overlaps none of the `(base, len)` ranges in `avoid`.
    ///
    /// `align` must be a power of two (`0` counts as `1`); `size` must not be
    /// zero. Otherwise, or when nothing fits, the result is `None`.
    pub fn find_ram(
        &self,
        size: u64,
        align: u64,
        min_addr: u64,
        max_end: u64,
        avoid: &[(u64, u64)],
    ) -> Option<u64> {
        let align = if align == 0 { 1 } else { align };
        if size == 0 || !align.is_power_of_two() {
            return None;
        }
        self.iter()
            .filter(|e| e.is_ram())
            .filter_map(|e| {
                let limit = e.end().min(max_end as u128);
                let mut a = crate::layout::align_up(e.addr.max(min_addr), align)?;
                // Every step moves `a` past the end of an avoided range it
                // overlapped, so each range is passed at most once.
                for _ in 0..=avoid.len() {
                    if a as u128 + size as u128 > limit {
                        return None;
                    }
                    match avoid
                        .iter()
                        .filter(|&&(b, l)| ranges_overlap(a, size, b, l))
                        .map(|&(b, l)| b as u128 + l as u128)
                        .max()
                    {
                        None => return Some(a),
                        Some(past) => {
                            let past = u64::try_from(past).ok()?;
                            a = crate::layout::align_up(past, align)?;
                        }
                    }
                }
                None
            })
            .min()
    }
}
