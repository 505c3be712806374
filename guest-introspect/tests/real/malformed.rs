//! Truncated and corrupted real images: errors, never panics.

use guest_introspect::btf::{self, Btf};
use guest_introspect::elf::Elf;
use guest_introspect::fentry::survey;
use guest_introspect::kallsyms::{locate, LocateStats, SymbolIndex};
use guest_introspect::{Gva, GvaRange};

use crate::common::{self, Patched, Window};
use test_support::Rng;

fn iterations(debug: usize, release: usize) -> usize {
    if cfg!(debug_assertions) {
        debug
    } else {
        release
    }
}

/// The span of the fast-lane kallsyms tables: num_syms to the end of
/// seqs_of_names.
fn table_span() -> (u64, u64) {
    let t = &crate::fast().tables;
    (
        t.names.0 - 8,
        t.relative_base_at.0 + 8 + 3 * t.num_syms as u64,
    )
}

/// The view cut at every kind of place inside the tables.
#[test]
fn truncated_tables() {
    let img = common::fast();
    let (start, end) = table_span();
    let mut rng = Rng(test_support::seed());
    // Scan only from 1 MiB before the tables, to keep each try cheap.
    let from = start - (1 << 20);
    for _ in 0..iterations(25, 200) {
        let cut = start + rng.below(end - start);
        let view = Window {
            inner: img.view(),
            start: from,
            end: cut,
        };
        let range = GvaRange::new(Gva(from), Gva(cut));
        let mut st = LocateStats::default();
        if let Ok(t) = locate(&view, &[range], &mut st) {
            // Only possible once everything needed is inside the window.
            assert!(
                t.relative_base_at.0 + 8 <= cut,
                "tables found past the cut {cut:#x}: {t:?}"
            );
            let _ = SymbolIndex::build(&view, &t);
        }
    }
    // Cut right after relative_base: found (seqs_of_names is not needed).
    let t = &crate::fast().tables;
    let cut = t.relative_base_at.0 + 8;
    let view = Window {
        inner: img.view(),
        start: from,
        end: cut,
    };
    let mut st = LocateStats::default();
    assert!(locate(&view, &[GvaRange::new(Gva(from), Gva(cut))], &mut st).is_ok());
}

/// Random byte changes in the tables.
#[test]
fn corrupted_tables() {
    let img = common::fast();
    let (start, end) = table_span();
    let from = start - (1 << 20);
    let mut rng = Rng(test_support::seed());
    let (mut found, mut built) = (0, 0);
    let n = iterations(25, 250);
    for _ in 0..n {
        let mut patches = vec![];
        for _ in 0..1 + rng.below(8) {
            // Bias towards the small tables, where one byte matters most.
            let t = &crate::fast().tables;
            let (lo, hi) = match rng.below(4) {
                0 => (t.markers.0, t.token_index.0 + 512),
                1 => (t.relative_base_at.0 - 64, t.relative_base_at.0 + 8),
                2 => (t.names.0 - 8, t.names.0 + 64),
                _ => (start, end),
            };
            let at = lo + rng.below(hi - lo);
            patches.push((at, vec![rng.next() as u8]));
        }
        let view = Patched {
            inner: Window {
                inner: img.view(),
                start: from,
                end,
            },
            patches,
        };
        let mut st = LocateStats::default();
        if let Ok(t) = locate(&view, &[GvaRange::new(Gva(from), Gva(end))], &mut st) {
            found += 1;
            if let Ok(idx) = SymbolIndex::build(&view, &t) {
                built += 1;
                let _ = idx.lookup("vfs_read");
                let _ = idx.resolve(Gva(0xffff_ffff_8110_0000));
            }
        }
    }
    eprintln!("{n} corrupted copies: tables found in {found}, index built in {built}");
}

/// Random changes to Debian's BTF header and types.
#[test]
fn corrupted_btf() {
    let img = common::debian();
    let idx = &crate::debian().index;
    let at = idx.addr_of("__start_BTF").unwrap().0;
    let sec = img.elf().section(".BTF").unwrap();
    let mut rng = Rng(test_support::seed());
    let mut ok = 0;
    let n = iterations(6, 60);
    for _ in 0..n {
        let mut patches = vec![];
        for _ in 0..1 + rng.below(6) {
            let off = match rng.below(3) {
                0 => rng.below(24),
                1 => 24 + rng.below(4096),
                _ => rng.below(sec.size),
            };
            let bytes = match rng.below(3) {
                0 => vec![0xff; 4],
                1 => vec![0; 4],
                _ => (rng.next() as u32).to_le_bytes().to_vec(),
            };
            patches.push((at + off, bytes));
        }
        let view = Patched {
            inner: img.view(),
            patches,
        };
        if let Ok(b) = Btf::parse(&view, Gva(at)) {
            if btf::task_layout(&b).is_ok() {
                ok += 1;
            }
        }
    }
    eprintln!("{n} corrupted BTF copies: task layout still found in {ok}");
}

/// Truncated and mangled ELF files.
#[test]
fn truncated_elf() {
    let bytes = &common::fast().vmlinux;
    let mut rng = Rng(test_support::seed());
    for cut in [
        0usize,
        4,
        63,
        64,
        100,
        0x200,
        0x1000,
        bytes.len() / 2,
        bytes.len() - 1,
    ] {
        if let Ok(e) = Elf::parse(&bytes[..cut]) {
            let _ = e.load_segments(|_| true);
            let _ = e.section(".text");
        }
    }
    let mut copy = bytes[..0x4000].to_vec();
    for _ in 0..iterations(200, 2000) {
        let p = rng.below(0x100) as usize;
        copy[p] = rng.next() as u8;
        if let Ok(e) = Elf::parse(&copy) {
            let _ = e.load_segments(|_| true);
            let _ = e.sections().count();
        }
    }
}

/// fentry classification over a view missing most of the text: every
/// symbol classified, unreadable ones as such.
#[test]
fn fentry_over_holes() {
    let img = common::fast();
    let idx = &crate::fast().index;
    let text = idx.text().unwrap();
    let view = Window {
        inner: img.view(),
        start: text.start.0 + (1 << 20),
        end: text.start.0 + (2 << 20),
    };
    let s = survey(&view, idx, false);
    assert_eq!(s.symbols as usize, idx.len());
    assert!(s.unreadable > 0 && s.traceable > 0, "{s:?}");
}
