//! Host tests for the e820 map: fixed cases and randomized properties.

mod common;
use common::*;

use loader::e820::{E820Entry, E820Error, E820Kind, E820Map, E820_MAX_ENTRIES};

fn ram(addr: u64, size: u64) -> E820Entry {
    E820Entry::new(addr, size, E820Kind::Ram)
}

fn reserved(addr: u64, size: u64) -> E820Entry {
    E820Entry::new(addr, size, E820Kind::Reserved)
}

fn entries(map: &E820Map) -> Vec<(u64, u64, u32)> {
    map.iter().map(|e| (e.addr, e.size, e.kind)).collect()
}

/// A typical PC map, like the one SeaBIOS gives a 1 GiB QEMU guest.
fn pc_map() -> E820Map {
    E820Map::from_entries(&[
        ram(0, 0x9_FC00),
        reserved(0x9_FC00, 0x400),
        reserved(0xF_0000, 0x1_0000),
        ram(MIB, GIB - MIB - 0x2_0000),
        reserved(GIB - 0x2_0000, 0x2_0000),
        reserved(0xFFFC_0000, 0x4_0000),
    ])
    .unwrap()
}

/// Byte-exact model of the RAM in a map: sorted, disjoint RAM intervals.
fn ram_intervals(map: &E820Map) -> Vec<(u128, u128)> {
    let mut v: Vec<(u128, u128)> = map
        .iter()
        .filter(|e| e.is_ram() && e.size > 0)
        .map(|e| (e.addr as u128, e.end()))
        .collect();
    v.sort();
    let mut out: Vec<(u128, u128)> = Vec::new();
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if last.1 >= s => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

fn overlap_len(a: (u128, u128), b: (u128, u128)) -> u128 {
    let s = a.0.max(b.0);
    let e = a.1.min(b.1);
    e.saturating_sub(s)
}

#[test]
fn entry_layout_and_encoding() {
    assert_eq!(core::mem::size_of::<E820Entry>(), 20);
    let e = E820Entry::new(0x1122_3344_5566_7788, 0x99AA_BBCC_DDEE_FF00, E820Kind::Acpi);
    let b = e.to_bytes();
    assert_eq!(&b[0..8], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&b[8..16], &0x99AA_BBCC_DDEE_FF00u64.to_le_bytes());
    assert_eq!(&b[16..20], &3u32.to_le_bytes());
    assert_eq!(E820Entry::from_bytes(&b), e);
}

#[test]
fn kinds_round_trip() {
    for raw in 0..20u32 {
        assert_eq!(E820Kind::from_raw(raw).to_raw(), raw);
    }
    assert_eq!(E820Kind::from_raw(1), E820Kind::Ram);
    assert_eq!(E820Kind::from_raw(2), E820Kind::Reserved);
    assert_eq!(E820Kind::from_raw(3), E820Kind::Acpi);
    assert_eq!(E820Kind::from_raw(4), E820Kind::Nvs);
    assert_eq!(E820Kind::from_raw(5), E820Kind::Unusable);
    assert_eq!(E820Kind::from_raw(12), E820Kind::Other(12));
    assert_eq!(u32::from(E820Kind::Nvs), 4);
}

#[test]
fn push_until_full() {
    let mut map = E820Map::new();
    assert!(map.is_empty());
    for i in 0..E820_MAX_ENTRIES as u64 {
        map.push(ram(i * 2 * MIB, MIB)).unwrap();
    }
    assert_eq!(map.len(), E820_MAX_ENTRIES);
    assert_eq!(map.push(ram(0, 1)), Err(E820Error::Full));
    assert_eq!(map.len(), E820_MAX_ENTRIES);
    assert!(E820Error::Full.to_string().contains("128"));
}

#[test]
fn remove_range_cases() {
    // Hole strictly inside: split.
    let mut m = E820Map::from_entries(&[ram(0, 10 * MIB)]).unwrap();
    m.remove_range(2 * MIB, 3 * MIB).unwrap();
    assert_eq!(entries(&m), vec![(0, 2 * MIB, 1), (5 * MIB, 5 * MIB, 1)]);

    // A split keeps the order of a sorted map.
    let mut m = E820Map::from_entries(&[
        ram(0, 10 * MIB),
        reserved(10 * MIB, MIB),
        ram(11 * MIB, MIB),
    ])
    .unwrap();
    m.remove_range(2 * MIB, MIB).unwrap();
    assert_eq!(
        entries(&m),
        vec![
            (0, 2 * MIB, 1),
            (3 * MIB, 7 * MIB, 1),
            (10 * MIB, MIB, 2),
            (11 * MIB, MIB, 1)
        ]
    );

    // Hole covering the start.
    let mut m = E820Map::from_entries(&[ram(4 * MIB, 4 * MIB)]).unwrap();
    m.remove_range(2 * MIB, 4 * MIB).unwrap();
    assert_eq!(entries(&m), vec![(6 * MIB, 2 * MIB, 1)]);

    // Hole covering the end.
    let mut m = E820Map::from_entries(&[ram(4 * MIB, 4 * MIB)]).unwrap();
    m.remove_range(6 * MIB, 4 * MIB).unwrap();
    assert_eq!(entries(&m), vec![(4 * MIB, 2 * MIB, 1)]);

    // Hole covering whole entries, and spanning several.
    let mut m =
        E820Map::from_entries(&[ram(0, MIB), ram(2 * MIB, MIB), ram(4 * MIB, 2 * MIB)]).unwrap();
    m.remove_range(MIB / 2, 4 * MIB).unwrap();
    assert_eq!(
        entries(&m),
        vec![(0, MIB / 2, 1), (9 * MIB / 2, 3 * MIB / 2, 1)]
    );

    // Exactly one entry.
    let mut m = E820Map::from_entries(&[ram(0, MIB), ram(2 * MIB, MIB)]).unwrap();
    m.remove_range(2 * MIB, MIB).unwrap();
    assert_eq!(entries(&m), vec![(0, MIB, 1)]);

    // Touching but not overlapping: unchanged.
    let mut m = E820Map::from_entries(&[ram(2 * MIB, MIB)]).unwrap();
    m.remove_range(MIB, MIB).unwrap();
    m.remove_range(3 * MIB, MIB).unwrap();
    assert_eq!(entries(&m), vec![(2 * MIB, MIB, 1)]);

    // Non-RAM entries are left alone.
    let mut m = E820Map::from_entries(&[reserved(0, 10 * MIB)]).unwrap();
    m.remove_range(2 * MIB, MIB).unwrap();
    assert_eq!(entries(&m), vec![(0, 10 * MIB, 2)]);

    // Zero length: no-op.
    let mut m = E820Map::from_entries(&[ram(0, 10 * MIB)]).unwrap();
    m.remove_range(2 * MIB, 0).unwrap();
    assert_eq!(entries(&m), vec![(0, 10 * MIB, 1)]);

    // A hole running past the top of the address space.
    let mut m = E820Map::from_entries(&[ram(u64::MAX - 2 * MIB + 1, 2 * MIB)]).unwrap();
    m.remove_range(u64::MAX - MIB + 1, u64::MAX).unwrap();
    assert_eq!(entries(&m), vec![(u64::MAX - 2 * MIB + 1, MIB, 1)]);
}

#[test]
fn remove_range_split_when_full_changes_nothing() {
    let mut m = E820Map::new();
    for i in 0..E820_MAX_ENTRIES as u64 {
        m.push(ram(i * 4 * MIB, 2 * MIB)).unwrap();
    }
    let before = entries(&m);
    // Strictly inside the first entry: needs one more slot.
    assert_eq!(m.remove_range(MIB / 2, MIB / 4), Err(E820Error::Full));
    assert_eq!(entries(&m), before);
    // Trimming needs no slot and still works when full.
    m.remove_range(0, MIB).unwrap();
    assert_eq!(m.iter().next().map(|e| (e.addr, e.size)), Some((MIB, MIB)));
}

#[test]
fn hypervisor_carve_out_of_pc_map() {
    let mut m = pc_map();
    let before = m.total_ram();
    m.remove_range(
        loader::layout::HV_RESERVED.0,
        loader::layout::HV_RESERVED_SIZE,
    )
    .unwrap();
    m.sanitize().unwrap();
    assert_eq!(m.total_ram(), before - loader::layout::HV_RESERVED_SIZE);
    assert!(m.is_ram(MIB, MIB));
    assert!(!m.is_ram(2 * MIB, 1));
    assert!(!m.is_ram(32 * MIB - 1, 1));
    assert!(m.is_ram(32 * MIB, MIB));
    for e in m.iter().filter(|e| e.is_ram()) {
        assert!(e.end() <= 2 * MIB as u128 || e.addr >= 32 * MIB, "{e:?}");
    }
}

#[test]
fn sanitize_sorts_merges_and_drops_empty() {
    let mut m = E820Map::from_entries(&[
        ram(4 * MIB, 2 * MIB),
        ram(0, MIB),
        reserved(10 * MIB, MIB),
        ram(MIB, MIB),         // touches [0, 1M): merged
        ram(5 * MIB, 4 * MIB), // overlaps [4M, 6M): merged
        ram(20 * MIB, 0),      // empty: dropped
        reserved(11 * MIB, MIB),
    ])
    .unwrap();
    m.sanitize().unwrap();
    assert_eq!(
        entries(&m),
        vec![
            (0, 2 * MIB, 1),
            (4 * MIB, 5 * MIB, 1),
            (10 * MIB, 2 * MIB, 2)
        ]
    );
}

#[test]
fn sanitize_gives_overlaps_to_the_non_ram_kind() {
    let mut m = E820Map::from_entries(&[
        ram(0, 16 * MIB),
        reserved(4 * MIB, MIB),
        E820Entry::new(15 * MIB, 2 * MIB, E820Kind::Acpi),
    ])
    .unwrap();
    m.sanitize().unwrap();
    assert_eq!(
        entries(&m),
        vec![
            (0, 4 * MIB, 1),
            (4 * MIB, MIB, 2),
            (5 * MIB, 10 * MIB, 1),
            (15 * MIB, 2 * MIB, 3)
        ]
    );
    assert_eq!(m.total_ram(), 14 * MIB);
}

#[test]
fn sanitize_is_idempotent_on_pc_map() {
    let mut m = pc_map();
    m.sanitize().unwrap();
    let once = entries(&m);
    m.sanitize().unwrap();
    assert_eq!(entries(&m), once);
    assert_eq!(once.len(), 6);
}

#[test]
fn is_ram_cases() {
    let m = E820Map::from_entries(&[
        ram(0, MIB),
        ram(MIB, MIB),
        reserved(2 * MIB, MIB),
        ram(3 * MIB, MIB),
    ])
    .unwrap();
    assert!(m.is_ram(0, MIB));
    assert!(m.is_ram(MIB / 2, MIB)); // across two touching RAM entries
    assert!(m.is_ram(0, 2 * MIB));
    assert!(!m.is_ram(0, 2 * MIB + 1));
    assert!(!m.is_ram(2 * MIB, 1));
    assert!(m.is_ram(3 * MIB, MIB));
    assert!(!m.is_ram(3 * MIB, MIB + 1));
    assert!(m.is_ram(5 * MIB, 0));
    assert!(!m.is_ram(u64::MAX, u64::MAX));
}

#[test]
fn find_ram_cases() {
    let m = pc_map();
    // Lowest 2 MiB aligned block above 1 MiB.
    assert_eq!(m.find_ram(MIB, 2 * MIB, MIB, u64::MAX, &[]), Some(2 * MIB));
    // Alignment 0 and 1 mean no alignment.
    assert_eq!(m.find_ram(0x1000, 0, 0, u64::MAX, &[]), Some(0));
    assert_eq!(m.find_ram(0x1000, 1, 0x123, u64::MAX, &[]), Some(0x123));
    // Not a power of two, or empty size: None.
    assert_eq!(m.find_ram(0x1000, 3, 0, u64::MAX, &[]), None);
    assert_eq!(m.find_ram(0, 1, 0, u64::MAX, &[]), None);
    // Avoided ranges are skipped, rounding up to the alignment.
    let avoid = [(2 * MIB, 1), (4 * MIB + 5, 10)];
    assert_eq!(
        m.find_ram(MIB, 2 * MIB, MIB, u64::MAX, &avoid),
        Some(6 * MIB)
    );
    // Avoid ranges in any order, overlapping each other.
    let avoid = [(7 * MIB, 2 * MIB), (2 * MIB, 5 * MIB), (3 * MIB, MIB)];
    assert_eq!(
        m.find_ram(MIB, 2 * MIB, MIB, u64::MAX, &avoid),
        Some(10 * MIB)
    );
    // Zero-length avoid ranges avoid nothing.
    assert_eq!(
        m.find_ram(MIB, 2 * MIB, MIB, u64::MAX, &[(2 * MIB, 0)]),
        Some(2 * MIB)
    );
    // Too big for any entry.
    assert_eq!(m.find_ram(GIB, 2 * MIB, 0, u64::MAX, &[]), None);
    // max_end bounds the end of the block.
    assert_eq!(m.find_ram(MIB, 2 * MIB, MIB, 3 * MIB, &[]), Some(2 * MIB));
    assert_eq!(m.find_ram(MIB, 2 * MIB, MIB, 3 * MIB - 1, &[]), None);
    // Never straddles two entries, even touching ones.
    let m2 = E820Map::from_entries(&[ram(0, 2 * MIB), ram(2 * MIB, 2 * MIB)]).unwrap();
    assert_eq!(m2.find_ram(3 * MIB, 1, 0, u64::MAX, &[]), None);
    // Large alignment near the top of the address space does not overflow.
    let m3 = E820Map::from_entries(&[ram(u64::MAX - GIB, GIB)]).unwrap();
    assert_eq!(m3.find_ram(MIB, 1 << 63, 0, u64::MAX, &[]), None);
    assert_eq!(
        m3.find_ram(MIB, 2 * MIB, 0, u64::MAX, &[(u64::MAX - 4, 4)]),
        Some(u64::MAX - GIB + 1)
    );
}

/// A random map of up to `max_entries` entries below 64 GiB, some
/// overlapping, some empty, of a few kinds.
fn random_map(rng: &mut XorShift, max_entries: u64) -> E820Map {
    let mut m = E820Map::new();
    let n = rng.below(max_entries + 1);
    for _ in 0..n {
        // Mix page-granular and byte-granular values.
        let gran = if rng.below(2) == 0 { 0x1000 } else { 1 };
        let addr = rng.below(64 * GIB / gran) * gran;
        let size = match rng.below(4) {
            0 => 0,
            1 => rng.below(MIB),
            2 => rng.below(64 * MIB),
            _ => rng.below(4 * GIB),
        };
        let kind = match rng.below(6) {
            0..=2 => E820Kind::Ram,
            3 => E820Kind::Reserved,
            4 => E820Kind::Acpi,
            _ => E820Kind::Other(7),
        };
        m.push(E820Entry::new(addr, size, kind)).unwrap();
    }
    m
}

#[test]
fn randomized_remove_range() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for round in 0..20_000 {
        let mut m = random_map(&mut rng, 40);
        m.sanitize().unwrap();
        let before = ram_intervals(&m);
        let total_before = m.total_ram();
        let base = rng.below(64 * GIB);
        let len = match rng.below(3) {
            0 => rng.below(MIB),
            1 => rng.below(GIB),
            _ => rng.below(16 * GIB),
        };
        let hole = (base as u128, base as u128 + len as u128);
        let removed: u128 = before.iter().map(|&r| overlap_len(r, hole)).sum();

        m.remove_range(base, len).unwrap();

        // Still sorted.
        for w in m.as_slice().windows(2) {
            assert!(w[0].addr <= w[1].addr, "round {round}: unsorted {m:?}");
        }
        // No RAM entry overlaps the hole.
        for e in m.iter().filter(|e| e.is_ram()) {
            assert_eq!(
                overlap_len((e.addr as u128, e.end()), hole),
                0,
                "round {round}: {e:?} overlaps {hole:x?}"
            );
            assert!(e.size > 0, "round {round}: empty entry left");
        }
        // RAM went down by exactly the overlap.
        assert_eq!(
            m.total_ram() as u128,
            total_before as u128 - removed,
            "round {round}"
        );
        // And every RAM byte outside the hole is still RAM.
        let after = ram_intervals(&m);
        let expected: Vec<(u128, u128)> = before
            .iter()
            .flat_map(|&(s, e)| {
                let mut v = Vec::new();
                if s < hole.0.min(e) {
                    v.push((s, hole.0.min(e)));
                }
                if e > hole.1.max(s) {
                    v.push((hole.1.max(s), e));
                }
                if len == 0 {
                    v = vec![(s, e)];
                }
                v
            })
            .collect();
        assert_eq!(after, expected, "round {round}");
    }
}

#[test]
fn randomized_sanitize() {
    let mut rng = XorShift(0xDEAD_BEEF_CAFE_F00D);
    for round in 0..20_000 {
        let mut m = random_map(&mut rng, 60);
        let raw = m.clone();
        m.sanitize().unwrap();
        let s = m.as_slice();
        // Sorted, no empty entries.
        for w in s.windows(2) {
            assert!(w[0].addr <= w[1].addr, "round {round}: unsorted {m:?}");
        }
        assert!(s.iter().all(|e| e.size > 0), "round {round}");
        // Same-kind entries neither overlap nor touch; RAM overlaps nothing.
        for (i, a) in s.iter().enumerate() {
            for b in &s[i + 1..] {
                if a.kind == b.kind {
                    assert!(
                        a.end() < b.addr as u128 || b.end() < a.addr as u128,
                        "round {round}: {a:?} {b:?}"
                    );
                }
                if a.is_ram() || b.is_ram() {
                    assert_eq!(
                        overlap_len((a.addr as u128, a.end()), (b.addr as u128, b.end())),
                        0,
                        "round {round}: {a:?} {b:?}"
                    );
                }
            }
        }
        // RAM = raw RAM minus every raw non-RAM range, byte for byte.
        let mut expect = ram_intervals(&raw);
        for e in raw.iter().filter(|e| !e.is_ram() && e.size > 0) {
            let hole = (e.addr as u128, e.end());
            expect = expect
                .into_iter()
                .flat_map(|(s, en)| {
                    let mut v = Vec::new();
                    if s < hole.0.min(en) {
                        v.push((s, hole.0.min(en)));
                    }
                    if en > hole.1.max(s) {
                        v.push((hole.1.max(s), en));
                    }
                    v
                })
                .collect();
        }
        assert_eq!(ram_intervals(&m), expect, "round {round}");
        // Sanitizing twice changes nothing.
        let once = entries(&m);
        m.sanitize().unwrap();
        assert_eq!(entries(&m), once, "round {round}");
    }
}

#[test]
fn randomized_find_ram() {
    let mut rng = XorShift(0x0123_4567_89AB_CDEF);
    for round in 0..5_000 {
        // Small, page-granular maps so that a brute-force search is cheap.
        let mut m = E820Map::new();
        for _ in 0..rng.below(6) {
            let kind = if rng.below(4) == 0 {
                E820Kind::Reserved
            } else {
                E820Kind::Ram
            };
            m.add(rng.below(256) * 0x1000, rng.below(128) * 0x1000, kind)
                .unwrap();
        }
        m.sanitize().unwrap();
        let avoid: Vec<(u64, u64)> = (0..rng.below(4))
            .map(|_| (rng.below(256) * 0x1000, rng.below(32) * 0x1000))
            .collect();
        let size = (rng.below(16) + 1) * 0x1000;
        let align = 0x1000 << rng.below(4);
        let min_addr = rng.below(128) * 0x1000;
        let max_end = rng.below(400) * 0x1000;

        let got = m.find_ram(size, align, min_addr, max_end, &avoid);

        let fits = |a: u64| {
            a.is_multiple_of(align)
                && a >= min_addr
                && a + size <= max_end
                && m.iter()
                    .any(|e| e.is_ram() && e.addr <= a && e.end() >= (a + size) as u128)
                && avoid
                    .iter()
                    .all(|&(b, l)| l == 0 || a + size <= b || b + l <= a)
        };
        let brute = (0..400u64).map(|p| p * 0x1000).find(|&a| fits(a));
        assert_eq!(got, brute, "round {round}: map {m:?} avoid {avoid:x?} size {size:#x} align {align:#x} min {min_addr:#x} max {max_end:#x}");
    }
}
