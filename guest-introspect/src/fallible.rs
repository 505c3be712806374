//! Allocation that fails instead of aborting.
//!
//! In the hypervisor an infallible allocation (`Vec::push`, `vec![..]`,
//! `collect`) that the heap cannot serve calls the allocation error
//! handler, which ends the VM. Every allocation whose size follows guest
//! (or host) data goes through these helpers instead: they reserve first
//! with [`Vec::try_reserve`] and turn a refusal into [`OutOfMemory`], which
//! the caller makes the request's error (or a counted miss).
//!
//! The helpers reserve exactly what they are asked for; growth beyond that
//! follows `Vec`'s own doubling, checked each time.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

/// An allocation of `bytes` bytes was refused (the heap could not serve it,
/// the size overflowed, or it was over a budget).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Bytes asked for (saturated at `usize::MAX` when the size overflows).
    pub bytes: usize,
}

impl OutOfMemory {
    /// The refusal of `n` elements of `T`.
    pub fn of<T>(n: usize) -> Self {
        Self {
            bytes: n.saturating_mul(core::mem::size_of::<T>()),
        }
    }
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "out of hypervisor memory: {} bytes refused", self.bytes)
    }
}

/// Makes room for `additional` more elements in `v`, exactly.
pub fn try_reserve<T>(v: &mut Vec<T>, additional: usize) -> Result<(), OutOfMemory> {
    v.try_reserve_exact(additional)
        .map_err(|_| OutOfMemory::of::<T>(v.len().saturating_add(additional)))
}

/// Makes room for `additional` more elements in `v`, growing it the way
/// `push` does (amortized: for a buffer filled piece by piece).
pub fn try_grow<T>(v: &mut Vec<T>, additional: usize) -> Result<(), OutOfMemory> {
    v.try_reserve(additional)
        .map_err(|_| OutOfMemory::of::<T>(v.len().saturating_add(additional)))
}

/// An empty vector with room for `n` elements.
pub fn try_with_capacity<T>(n: usize) -> Result<Vec<T>, OutOfMemory> {
    let mut v = Vec::new();
    try_reserve(&mut v, n)?;
    Ok(v)
}

/// `vec![value; n]`, or [`OutOfMemory`].
pub fn try_vec<T: Clone>(value: T, n: usize) -> Result<Vec<T>, OutOfMemory> {
    let mut v = try_with_capacity(n)?;
    v.resize(n, value);
    Ok(v)
}

/// `v.push(x)`, reserving first (amortized: `Vec` doubles its capacity).
pub fn try_push<T>(v: &mut Vec<T>, x: T) -> Result<(), OutOfMemory> {
    if v.len() == v.capacity() {
        try_grow(v, 1)?;
    }
    v.push(x);
    Ok(())
}

/// `v.extend_from_slice(s)`, reserving first.
pub fn try_extend_from_slice<T: Clone>(v: &mut Vec<T>, s: &[T]) -> Result<(), OutOfMemory> {
    try_grow(v, s.len())?;
    v.extend_from_slice(s);
    Ok(())
}

/// `iter.collect::<Vec<_>>()`, reserving the iterator's lower size bound
/// up front and each further element as it comes.
pub fn try_collect<T, I: IntoIterator<Item = T>>(iter: I) -> Result<Vec<T>, OutOfMemory> {
    let iter = iter.into_iter();
    let mut v = try_with_capacity(iter.size_hint().0)?;
    for x in iter {
        try_push(&mut v, x)?;
    }
    Ok(v)
}

/// A copy of `s`.
pub fn try_string(s: &str) -> Result<String, OutOfMemory> {
    let mut v = String::new();
    v.try_reserve_exact(s.len())
        .map_err(|_| OutOfMemory { bytes: s.len() })?;
    v.push_str(s);
    Ok(v)
}

/// Rough heap bytes one entry of a `BTreeMap<K, V>` takes (a node holds
/// at most 11 entries and is at least half full after a split; the edge
/// pointers of internal nodes are a small addition): for budgets only.
pub const fn btree_entry_bytes<K, V>() -> usize {
    2 * (core::mem::size_of::<K>() + core::mem::size_of::<V>()) + 8
}

/// `map.insert(k, v)` with at most `cap` entries. A `BTreeMap` cannot
/// reserve, so its size is bounded instead: an insert of a new key into a
/// map of `cap` entries is refused (replacing a present key always works).
/// The caller picks `cap` so that `cap` entries fit its heap budget
/// ([`btree_entry_bytes`]).
pub fn try_insert<K: Ord, V>(
    map: &mut BTreeMap<K, V>,
    k: K,
    v: V,
    cap: usize,
) -> Result<Option<V>, OutOfMemory> {
    if map.len() >= cap && !map.contains_key(&k) {
        return Err(OutOfMemory {
            bytes: cap
                .saturating_add(1)
                .saturating_mul(btree_entry_bytes::<K, V>()),
        });
    }
    Ok(map.insert(k, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_the_heap_cannot_serve_is_an_error() {
        let mut v: Vec<u64> = Vec::new();
        let e = try_reserve(&mut v, usize::MAX).unwrap_err();
        assert_eq!(e.bytes, usize::MAX);
        assert!(v.is_empty());
        assert_eq!(
            try_with_capacity::<u32>(usize::MAX / 2).unwrap_err(),
            OutOfMemory { bytes: usize::MAX }
        );
        assert!(try_vec(0u8, usize::MAX).is_err());
        assert!(e.to_string().starts_with("out of hypervisor memory"));
    }

    #[test]
    fn the_helpers_behave_like_their_infallible_forms() {
        let mut v = try_vec(7u8, 3).unwrap();
        assert_eq!(v, [7, 7, 7]);
        try_push(&mut v, 1).unwrap();
        try_extend_from_slice(&mut v, &[2, 3]).unwrap();
        assert_eq!(v, [7, 7, 7, 1, 2, 3]);
        assert_eq!(try_collect(0..5u32).unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(try_string("abc").unwrap(), "abc");
    }

    #[test]
    fn an_extension_past_the_address_space_is_refused_and_leaves_the_vector() {
        let mut v = vec![1u8, 2];
        // A slice cannot be that long, but the reservation that would follow
        // a huge one can: check the reservation path directly.
        assert!(v.try_reserve(usize::MAX).is_err());
        assert!(try_reserve(&mut v, usize::MAX - 1).is_err());
        assert_eq!(try_grow(&mut v, usize::MAX).unwrap_err().bytes, usize::MAX);
        assert_eq!(v, [1, 2]);
    }

    #[test]
    fn a_capped_map_refuses_new_keys_but_replaces_present_ones() {
        let mut m = BTreeMap::new();
        for k in 0..4u64 {
            assert_eq!(try_insert(&mut m, k, k, 4), Ok(None));
        }
        let e = try_insert(&mut m, 9, 9, 4).unwrap_err();
        assert_eq!(e.bytes, 5 * btree_entry_bytes::<u64, u64>());
        assert_eq!(m.len(), 4);
        assert_eq!(try_insert(&mut m, 2, 20, 4), Ok(Some(2)));
        assert_eq!(m[&2], 20);
    }

    #[test]
    fn a_collect_stops_at_the_first_refusal() {
        // An iterator claiming more than can ever be reserved.
        struct Liar;
        impl Iterator for Liar {
            type Item = u64;
            fn next(&mut self) -> Option<u64> {
                Some(0)
            }
            fn size_hint(&self) -> (usize, Option<usize>) {
                (usize::MAX, None)
            }
        }
        assert!(try_collect(Liar).is_err());
    }
}
