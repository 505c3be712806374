//! kallsyms recovery over both real images, unslid and with a KASLR slide.

use std::collections::{HashMap, HashSet};

use guest_introspect::budget::{block_on, Budget, Metered, RECOVERY_BUDGET};
use guest_introspect::facts::ranges_from_lstar;
use guest_introspect::kallsyms::{locate, AddressMode, LocateStats, SymbolIndex};
use guest_introspect::{Gva, GvaRange, SymbolId};

use crate::common::{self, Patched};
use test_support::Rng;

fn text_kind(c: char) -> bool {
    c == 't' || c == 'T'
}

/// Every text symbol of the fast-lane System.map is recovered with the same
/// name, letter and address, and every recovered text symbol is in the map.
#[test]
fn fast_lane_text_symbols_match_system_map() {
    let r = crate::fast();
    let idx = &r.index;
    let map = common::fast_system_map();
    let ours: HashSet<(String, u64, char)> = idx
        .iter()
        .filter(|s| s.kind.is_text())
        .map(|s| (idx.name(s.id), s.addr.0, s.kind.letter()))
        .collect();
    let theirs: HashSet<(String, u64, char)> = map
        .iter()
        .filter(|s| text_kind(s.kind))
        .map(|s| (s.name.clone(), s.addr, s.kind))
        .collect();
    let missing: Vec<_> = theirs.difference(&ours).collect();
    let extra: Vec<_> = ours.difference(&theirs).collect();
    eprintln!(
        "fast-lane text symbols: System.map {}, recovered {}, matching {}, missing {}, extra {}",
        theirs.len(),
        ours.len(),
        theirs.intersection(&ours).count(),
        missing.len(),
        extra.len()
    );
    assert!(
        missing.is_empty(),
        "text symbols not recovered: {:?}",
        &missing[..missing.len().min(20)]
    );
    assert!(
        extra.is_empty(),
        "recovered text symbols not in System.map: {:?}",
        &extra[..extra.len().min(20)]
    );

    // All kinds: what kallsyms keeps of System.map.
    let all_map: HashSet<(&str, u64)> = map.iter().map(|s| (s.name.as_str(), s.addr)).collect();
    let mut matched = 0;
    let mut unmatched = vec![];
    for s in idx.iter() {
        let name = idx.name(s.id);
        if all_map.contains(&(name.as_str(), s.addr.0)) {
            matched += 1;
        } else {
            unmatched.push((name, s.addr, s.kind.letter()));
        }
    }
    eprintln!(
        "fast-lane all symbols: recovered {}, System.map lines {}, recovered found in the map {matched}",
        idx.len(),
        map.len()
    );
    assert!(
        unmatched.is_empty(),
        "recovered symbols not in System.map: {:?}",
        &unmatched[..unmatched.len().min(20)]
    );
}

#[test]
fn fast_lane_tables_are_where_the_linker_put_them() {
    let r = crate::fast();
    let map = common::fast_map_by_name();
    let t = &r.tables;
    assert_eq!(t.num_syms as usize, r.index.len());
    for (name, at) in [
        ("kallsyms_num_syms", t.names.0 - 8),
        ("kallsyms_names", t.names.0),
        ("kallsyms_markers", t.markers.0),
        ("kallsyms_token_table", t.token_table.0),
        ("kallsyms_token_index", t.token_index.0),
        ("kallsyms_offsets", t.offsets.0),
        ("kallsyms_relative_base", t.relative_base_at.0),
    ] {
        assert_eq!(map.get(name).copied(), Some(at), "{name}");
    }
    assert_eq!(
        t.seqs_of_names.map(|g| g.0),
        map.get("kallsyms_seqs_of_names").copied()
    );
    assert_eq!(t.mode, AddressMode::AbsolutePercpu);
    assert_eq!(t.relative_base, map["_text"]);
    // The index's heap is known before building it, and can be capped.
    assert_eq!(SymbolIndex::size_for(t), r.index.heap_bytes());
    let view = common::fast().view();
    assert_eq!(
        SymbolIndex::build_limited(&view, t, 512 << 10).unwrap_err(),
        guest_introspect::KallsymsError::TooLarge {
            bytes: r.index.heap_bytes()
        }
    );
}

#[test]
fn debian_symbols_are_plausible() {
    let r = crate::debian();
    let idx = &r.index;
    let img = common::debian();
    let elf = img.elf();
    let sec = |n: &str| {
        let s = elf
            .section(n)
            .unwrap_or_else(|| panic!("Debian vmlinux has no {n} section"));
        GvaRange::with_len(Gva(s.addr), s.size)
    };
    let text = idx.text().expect("_stext/_etext");
    assert_eq!(text.start, sec(".text").start);
    for name in [
        "do_sys_openat2",
        "vfs_read",
        "vfs_write",
        "schedule",
        "entry_SYSCALL_64",
        "__fentry__",
        "startup_64",
    ] {
        let s = idx.symbol(
            idx.lookup(name)
                .unwrap_or_else(|| panic!("{name} not recovered")),
        );
        assert!(s.kind.is_text(), "{name}: {:?}", s.kind);
        assert!(
            text.contains(s.addr) && sec(".text").contains(s.addr),
            "{name} at {} outside text",
            s.addr
        );
    }
    let banner = idx.addr_of("linux_banner").expect("linux_banner");
    let rodata = GvaRange::new(
        idx.addr_of("__start_rodata").unwrap(),
        idx.addr_of("__end_rodata").unwrap(),
    );
    assert!(rodata.contains(banner) && sec(".rodata").contains(banner));
    // As in /proc/kallsyms (read as root): per-cpu symbols first from 0,
    // then _text at the link address.
    let first = idx.symbol(guest_introspect::SymbolId(0));
    assert_eq!((first.addr, first.kind.letter()), (Gva(0), 'A'));
    assert_eq!(idx.addr_of("_text"), Some(Gva(0xffff_ffff_8100_0000)));
    assert_eq!(idx.addr_of("startup_64"), idx.addr_of("_text"));
    let text_syms = idx.iter().filter(|s| s.kind.is_text()).count();
    eprintln!("Debian: {} symbols, {text_syms} text (t/T)", idx.len());
    assert!(
        (30_000..200_000).contains(&text_syms),
        "{text_syms} text symbols"
    );
    // Every text symbol is in an executable section.
    let exec = [
        sec(".text"),
        sec(".init.text"),
        sec(".altinstr_aux"),
        sec(".exit.text"),
        sec(".altinstr_replacement"),
    ];
    let stray: Vec<_> = idx
        .iter()
        .filter(|s| s.kind.is_text() && !exec.iter().any(|r| r.contains(s.addr) || r.end == s.addr))
        .map(|s| (idx.name(s.id), s.addr))
        .collect();
    assert!(
        stray.is_empty(),
        "text symbols outside executable sections: {stray:?}"
    );
    // sym+off/size.
    let vfs_read = idx.addr_of("vfs_read").unwrap();
    let mut s = String::new();
    idx.format_addr(Gva(vfs_read.0 + 5), &mut s).unwrap();
    assert!(s.starts_with("vfs_read+0x5/0x"), "{s}");
    // Globs.
    let vfs: Vec<String> = idx.glob("vfs_*").map(|id| idx.name(id)).collect();
    assert!(vfs.iter().any(|n| n == "vfs_read") && vfs.iter().all(|n| n.starts_with("vfs_")));
    assert!(idx
        .glob("do_sys_open*2")
        .any(|id| idx.name(id) == "do_sys_openat2"));
}

/// Every name looks up to a symbol of that name, and `lookup_all` finds the
/// symbol itself among the duplicates.
#[test]
fn names_round_trip() {
    for r in [crate::fast(), crate::debian()] {
        let idx = &r.index;
        // Debug builds check a sample.
        let step = if cfg!(debug_assertions) { 7 } else { 1 };
        let mut dups = 0;
        for i in (0..idx.len() as u32).step_by(step) {
            let id = guest_introspect::SymbolId(i);
            let name = idx.name(id);
            let all: Vec<_> = idx.lookup_all(&name).collect();
            assert!(all.contains(&id), "{name}");
            assert!(all.windows(2).all(|w| w[0] < w[1]));
            if all.len() > 1 {
                dups += 1;
            }
            let res = idx.resolve(idx.symbol(id).addr).unwrap();
            assert_eq!(idx.symbol(res.id).addr, idx.symbol(id).addr);
        }
        eprintln!(
            "{} symbols, {dups} (sampled) share their name with another",
            idx.len()
        );
    }
}

/// The packed index of each real kernel rebuilds to the same symbols,
/// names and text ranges; its size is what root sends the host.
#[test]
fn packed_index_round_trips() {
    for r in [crate::fast(), crate::debian()] {
        let idx = &r.index;
        let mut bytes = vec![0; idx.packed_len()];
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + 2800).min(bytes.len());
            at += idx.packed_at(at, &mut bytes[at..end]);
        }
        let back = guest_introspect::kallsyms::SymbolIndex::unpack(&bytes).unwrap();
        assert_eq!(back.len(), idx.len());
        assert!(idx.iter().zip(back.iter()).all(|(a, b)| a == b));
        let step = if cfg!(debug_assertions) { 13 } else { 1 };
        for i in (0..idx.len() as u32).step_by(step) {
            let id = guest_introspect::SymbolId(i);
            assert_eq!(idx.name(id), back.name(id));
        }
        assert_eq!(back.text(), idx.text());
        eprintln!(
            "{} symbols packed in {} bytes ({} of index heap)",
            idx.len(),
            bytes.len(),
            idx.heap_bytes()
        );
    }
}

fn slide_and_check(img: &common::Image, r: &crate::Recovered, seed: u64) {
    let mut rng = Rng(seed);
    // KASLR keeps the image in the 1 GiB above __START_KERNEL_map, 2 MiB
    // aligned; the images here end below 0xffffffff86000000.
    let slide = (1 + rng.below(400)) << 21;
    let base = img.view();
    let slid = base.slid(slide).expect("slid view");
    // The one value KASLR's relocation changes in the tables.
    let rb_at = r.tables.relative_base_at.0 + slide;
    let view = Patched {
        inner: slid,
        patches: vec![(
            rb_at,
            (r.tables.relative_base + slide).to_le_bytes().to_vec(),
        )],
    };
    let ranges: Vec<GvaRange> = view.inner.ranges().collect();
    let mut stats = LocateStats::default();
    let t = locate(&view, &ranges, &mut stats)
        .unwrap_or_else(|e| panic!("{} slid by {slide:#x}: {e}", img.release));
    assert_eq!(t.token_table.0, r.tables.token_table.0 + slide);
    assert_eq!(t.names.0, r.tables.names.0 + slide);
    assert_eq!(t.relative_base, r.tables.relative_base + slide);
    let idx = SymbolIndex::build(&view, &t).unwrap();
    assert_eq!(idx.len(), r.index.len());
    let mut moved = 0;
    for (a, b) in r.index.iter().zip(idx.iter()) {
        // Absolute (per-cpu) symbols stay; everything else moves by the slide.
        let absolute = a.kind.letter() == 'A' && a.addr.0 < 0x100_0000;
        let want = if absolute { a.addr.0 } else { a.addr.0 + slide };
        assert_eq!(b.addr.0, want, "{} {}", img.release, r.index.name(a.id));
        moved += !absolute as u32;
    }
    // From the guest's LSTAR, as the hypervisor will search.
    let lstar = idx.addr_of("entry_SYSCALL_64").unwrap();
    assert_eq!(
        lstar.0,
        r.index.addr_of("entry_SYSCALL_64").unwrap().0 + slide
    );
    let range = ranges_from_lstar(lstar).unwrap();
    let mut st2 = LocateStats::default();
    let t2 = locate(&view, &[range], &mut st2).unwrap();
    assert_eq!(t2, t);
    eprintln!(
        "{}: slide {slide:#x}: {moved} symbols moved, {} absolute stayed; search from LSTAR {lstar}: {:?}",
        img.release,
        idx.len() as u32 - moved,
        st2
    );
}

#[test]
fn kaslr_slide_fast_lane() {
    slide_and_check(common::fast(), crate::fast(), test_support::seed());
}

#[test]
fn kaslr_slide_debian() {
    slide_and_check(common::debian(), crate::debian(), test_support::seed());
}

/// What recovering each image costs, against the tables themselves. The
/// search copies each byte of the ranges searched at most once, and its
/// Horspool steps are a small part of those bytes (the scan module's
/// figure: about one per 15 bytes of text and rodata); only the real token
/// table is consistent. The index build reads each table once, whole, and
/// nothing else; the rest of its work is each name's expanded bytes plus
/// its hash probes (one a symbol at least, the longest run at most); its
/// heap is what `size_for` said beforehand. Prints the numbers for the
/// report (the benchmark, benches/lookup.rs, times them).
#[test]
fn recovery_costs_follow_the_tables() {
    for (name, img, r) in [
        ("fast-lane 6.12", common::fast(), crate::fast()),
        ("Debian 6.1", common::debian(), crate::debian()),
    ] {
        let (t, idx, st) = (&r.tables, &r.index, &r.stats);
        let n = idx.len() as u64;
        let view = img.view();

        // The search (over the ranges `recover` gave it).
        let searched: u64 = view.ranges().map(|g| g.len()).sum();
        assert!(
            st.scan.bytes_scanned <= searched,
            "{name}: {} bytes scanned of {searched}",
            st.scan.bytes_scanned
        );
        assert!(
            st.scan.probes * 10 <= st.scan.bytes_scanned,
            "{name}: {} probes for {} bytes",
            st.scan.probes,
            st.scan.bytes_scanned
        );
        assert_eq!(st.token_tables, 1, "{name}: {st:?}");
        assert!(st.scan.candidates >= 1, "{name}: {st:?}");

        // The index build, metered: the same index, from one read of each
        // table (the token table, the token index's 256 u16 entries, the
        // names, one marker per 256 symbols, one 4-byte offset a symbol).
        let budget = Budget::new(RECOVERY_BUDGET);
        let metered = Metered::new(&view, &budget);
        let built = block_on(SymbolIndex::build_budgeted(
            &metered,
            t,
            SymbolIndex::size_for(t),
        ))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(built.iter().eq(idx.iter()), "{name}");
        let tables = u64::from(t.token_table_len)
            + 512
            + u64::from(t.names_len)
            + n.div_ceil(256) * u64::from(t.marker_width)
            + 4 * n;
        assert_eq!(budget.bytes_read(), tables, "{name}");
        // Work other than reads: each name's expansion and its hash probes.
        let expanded: u64 = (0..n as u32)
            .map(|i| idx.name(SymbolId(i)).len() as u64)
            .sum();
        let probes = budget
            .other_work()
            .checked_sub(expanded)
            .unwrap_or_else(|| {
                panic!(
                    "{name}: {} units for {expanded} name bytes",
                    budget.other_work()
                )
            });
        assert!(
            n <= probes && probes <= n * built.longest_probe_run(),
            "{name}: {probes} probes for {n} symbols, the longest run {}",
            built.longest_probe_run()
        );
        assert_eq!(idx.heap_bytes(), SymbolIndex::size_for(t), "{name}");

        let mut kinds: HashMap<char, usize> = HashMap::new();
        for s in idx.iter() {
            *kinds.entry(s.kind.letter()).or_default() += 1;
        }
        eprintln!(
            "{name}: {n} symbols ({} text), layout {:?}, seqs_of_names {}, names {} B, \
             index {} B = {:.1} B/symbol, build read {tables} B and made {probes} probes (longest run {}), {st:?}",
            kinds.get(&'t').unwrap_or(&0) + kinds.get(&'T').unwrap_or(&0),
            t.layout,
            t.seqs_of_names.is_some(),
            t.names_len,
            idx.heap_bytes(),
            idx.heap_bytes() as f64 / n as f64,
            built.longest_probe_run(),
        );
    }
}
