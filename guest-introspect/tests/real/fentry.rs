//! fentry sites against the build's own list, `__mcount_loc`.
//!
//! The oracle is what ftrace itself would accept: the non-zero entries of
//! `__start_mcount_loc..__stop_mcount_loc` whose kallsyms offset is at most
//! FTRACE_MCOUNT_MAX_OFFSET (4 with IBT, else 0). The others are the leftover
//! fentry calls of overridden `__weak` functions (no symbol of their own),
//! which ftrace disables (`test_for_valid_rec`) or the build zeroes
//! (`sorttable`, 6.12).

use std::collections::BTreeSet;

use guest_introspect::elf::Elf;
use guest_introspect::fentry::{
    survey, Classifier, Endbr, NotTraceable, SiteState, Survey, ENDBR_POISON, NOP5,
};
use guest_introspect::kallsyms::SymbolIndex;
use guest_introspect::view::{SegmentView, VirtMemory};
use guest_introspect::{Gva, GvaRange};

use crate::common;

/// The mcount_loc entries, zeroes dropped.
fn mcount_loc(view: &impl VirtMemory, start: u64, stop: u64) -> Vec<u64> {
    let mut buf = vec![0u8; (stop - start) as usize];
    view.read_virt(Gva(start), &mut buf)
        .expect("__mcount_loc readable");
    buf.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .filter(|&a| a != 0)
        .collect()
}

struct Oracle {
    /// Valid sites outside init text.
    text: BTreeSet<u64>,
    /// Valid sites in init text.
    init: BTreeSet<u64>,
    /// Entries ftrace would reject (offset too large).
    invalid: usize,
    zeroes: usize,
}

fn split(
    entries: &[u64],
    zeroes: usize,
    offset_of: impl Fn(u64) -> Option<u64>,
    max_off: u64,
    init: Option<GvaRange>,
) -> Oracle {
    let mut o = Oracle {
        text: BTreeSet::new(),
        init: BTreeSet::new(),
        invalid: 0,
        zeroes,
    };
    for &ip in entries {
        if offset_of(ip).is_none_or(|off| off > max_off) {
            o.invalid += 1;
        } else if init.is_some_and(|r| r.contains(Gva(ip))) {
            o.init.insert(ip);
        } else {
            o.text.insert(ip);
        }
    }
    o
}

fn name_at(idx: &SymbolIndex, ip: u64) -> String {
    let mut s = String::new();
    idx.format_addr(Gva(ip), &mut s).unwrap();
    s
}

/// Compares a survey with the oracle: text sites must match exactly; init
/// sites are reported (a few `__init` functions keep a `call __fentry__`
/// that the build leaves out of `__mcount_loc`).
fn compare(what: &str, idx: &SymbolIndex, s: &Survey, o: &Oracle, init_text: Option<GvaRange>) {
    let in_init = |a: &u64| init_text.is_some_and(|r| r.contains(Gva(*a)));
    let ours_text: BTreeSet<u64> = s
        .sites
        .iter()
        .map(|g| g.0)
        .filter(|a| !in_init(a))
        .collect();
    let ours_init: BTreeSet<u64> = s.sites.iter().map(|g| g.0).filter(in_init).collect();
    let missing: Vec<String> = o
        .text
        .difference(&ours_text)
        .map(|&a| name_at(idx, a))
        .collect();
    let extra: Vec<String> = ours_text
        .difference(&o.text)
        .map(|&a| name_at(idx, a))
        .collect();
    let init_missing: Vec<String> = o
        .init
        .difference(&ours_init)
        .map(|&a| name_at(idx, a))
        .collect();
    let init_extra: Vec<String> = ours_init
        .difference(&o.init)
        .map(|&a| name_at(idx, a))
        .collect();
    eprintln!(
        "{what}: __mcount_loc {} valid ({} text + {} init), {} weak leftovers, {} zeroes | \
         survey: {} traceable symbols, {} distinct text sites (states nop/call/guest/int3 {:?}, {} after ENDBR), \
         not traceable: data {}, not-text {}, init {} ({} with a site), no-fentry {}, unreadable {} | \
         text mismatches: {} missing, {} extra | init: {} missing, {} extra {:?}",
        o.text.len() + o.init.len(),
        o.text.len(),
        o.init.len(),
        o.invalid,
        o.zeroes,
        s.traceable,
        ours_text.len(),
        s.by_state,
        s.with_endbr,
        s.data,
        s.not_text,
        s.init_text,
        s.init_text_with_site,
        s.no_fentry,
        s.unreadable,
        missing.len(),
        extra.len(),
        init_missing.len(),
        init_extra.len(),
        init_extra
    );
    assert!(missing.is_empty(), "{what}: sites not found: {missing:?}");
    assert!(
        extra.is_empty(),
        "{what}: sites not in __mcount_loc: {extra:?}"
    );
    assert!(
        init_missing.is_empty(),
        "{what}: init sites not found: {init_missing:?}"
    );
    assert!(
        init_extra.len() <= 8,
        "{what}: init sites not in __mcount_loc: {init_extra:?}"
    );
}

/// Offset of `ip` in its System.map text symbol (independent of our index).
fn map_offset(ip: u64) -> Option<u64> {
    use std::sync::OnceLock;
    static TEXT: OnceLock<Vec<u64>> = OnceLock::new();
    let text = TEXT.get_or_init(|| {
        let mut v: Vec<u64> = common::fast_system_map()
            .iter()
            .filter(|s| matches!(s.kind, 't' | 'T' | 'w' | 'W'))
            .map(|s| s.addr)
            .collect();
        v.sort_unstable();
        v
    });
    let i = text.partition_point(|&a| a <= ip).checked_sub(1)?;
    Some(ip - text[i])
}

fn fast_oracle() -> Oracle {
    let map = common::fast_map_by_name();
    let view = common::fast().view();
    let (start, stop) = (map["__start_mcount_loc"], map["__stop_mcount_loc"]);
    let total = ((stop - start) / 8) as usize;
    let entries = mcount_loc(&view, start, stop);
    split(
        &entries,
        total - entries.len(),
        map_offset,
        4,
        crate::fast().index.init_text(),
    )
}

/// The vmlinux file as it is: every site is `call __fentry__`.
#[test]
fn fast_lane_unpatched_matches_mcount_loc() {
    let idx = &crate::fast().index;
    let view = common::fast().view();
    let t0 = std::time::Instant::now();
    let s = survey(&view, idx, true);
    eprintln!("survey took {:?}", t0.elapsed());
    assert_eq!(s.by_state[0], 0, "a vmlinux file has no NOP5 sites yet");
    assert!(s.with_endbr > 0, "IBT kernel: sites after endbr64");
    compare(
        "fast-lane vmlinux",
        idx,
        &s,
        &fast_oracle(),
        idx.init_text(),
    );

    // Per-function queries.
    let c = Classifier::new(idx);
    let vfs_read = c.site_of(&view, "vfs_read").unwrap().unwrap();
    assert_eq!(vfs_read.endbr, Endbr::Endbr64);
    assert_eq!(vfs_read.site.0, vfs_read.func.0 + 4);
    assert_eq!(vfs_read.state, SiteState::CallFentry);
    assert_eq!(
        c.site_of(&view, "linux_banner").unwrap(),
        Err(NotTraceable::DataSymbol)
    );
    assert_eq!(
        c.site_of(&view, "entry_SYSCALL_64").unwrap(),
        Err(NotTraceable::NoFentry)
    );
    assert!(matches!(
        c.site_of(&view, "start_kernel").unwrap(),
        Err(NotTraceable::InitText { site: Some(_) })
    ));
}

/// Copies the image and applies what boot does to the sites: `ftrace_init`
/// (every valid site to NOP5) and `apply_seal_endbr` (the ENDBRs objtool
/// listed in `.ibt_endbr_seal` to the poison).
fn boot_patched(img: &common::Image, sites: impl Iterator<Item = u64>) -> (Vec<u8>, usize) {
    let elf = img.elf();
    let mut bytes = img.vmlinux.clone();
    let file_off = |va: u64| {
        elf.program_headers().filter_map(Result::ok).find_map(|ph| {
            (ph.kind == 1 && va >= ph.vaddr && va < ph.vaddr + ph.file_size)
                .then(|| (ph.offset + va - ph.vaddr) as usize)
        })
    };
    for s in sites {
        let o = file_off(s).expect("site in a segment");
        bytes[o..o + 5].copy_from_slice(&NOP5);
    }
    let mut sealed = 0;
    if let Some(sec) = elf.section(".ibt_endbr_seal") {
        let data = elf.data(&sec).unwrap().to_vec();
        for (i, c) in data.chunks_exact(4).enumerate() {
            let rel = i32::from_le_bytes(c.try_into().unwrap()) as i64;
            let at = (sec.addr + 4 * i as u64).wrapping_add(rel as u64);
            if let Some(o) = file_off(at) {
                if bytes[o..o + 4] == [0xf3, 0x0f, 0x1e, 0xfa] {
                    bytes[o..o + 4].copy_from_slice(&ENDBR_POISON);
                    sealed += 1;
                }
            }
        }
    }
    (bytes, sealed)
}

/// After boot, sites are NOP5 and only the bytes say which functions have
/// one. A `notrace` function that starts with a jump-label NOP5 would look
/// the same: such false positives are counted here (in a booted guest the
/// guest's own `ftrace_pages` list is the authority, see
/// `fentry::ftrace_records`).
fn after_boot_patching(what: &str, img: &common::Image, idx: &SymbolIndex, o: &Oracle) {
    let (bytes, sealed) = boot_patched(img, o.text.iter().chain(&o.init).copied());
    let elf = Elf::parse(&bytes).unwrap();
    let view: SegmentView<'_> = elf.load_segments(Gva::is_kernel_image).unwrap();
    let s = survey(&view, idx, true);
    let ours: BTreeSet<u64> = s
        .sites
        .iter()
        .map(|g| g.0)
        .filter(|&a| !idx.init_text().is_some_and(|r| r.contains(Gva(a))))
        .collect();
    let missing = o.text.difference(&ours).count();
    let extra: Vec<String> = ours.difference(&o.text).map(|&a| name_at(idx, a)).collect();
    eprintln!(
        "{what} after ftrace_init: {sealed} ENDBRs sealed, states nop/call/guest/int3 {:?}, \
         {} text sites vs {} in __mcount_loc: {missing} missing, {} NOP5-at-entry false positives {:?}",
        s.by_state,
        ours.len(),
        o.text.len(),
        extra.len(),
        &extra[..extra.len().min(10)]
    );
    assert_eq!(missing, 0);
    assert_eq!(s.by_state[1], 0, "every call __fentry__ was patched");
    assert!(
        extra.len() * 100 <= o.text.len(),
        "too many false positives: {}",
        extra.len()
    );
}

#[test]
fn fast_lane_after_boot_patching() {
    after_boot_patching(
        "fast-lane",
        common::fast(),
        &crate::fast().index,
        &fast_oracle(),
    );
}

#[test]
fn debian_after_boot_patching() {
    after_boot_patching(
        "Debian",
        common::debian(),
        &crate::debian().index,
        &debian_oracle(),
    );
}

fn debian_oracle() -> Oracle {
    let idx = &crate::debian().index;
    let view = common::debian().view();
    let start = idx.addr_of("__start_mcount_loc").unwrap().0;
    let stop = idx.addr_of("__stop_mcount_loc").unwrap().0;
    let entries = mcount_loc(&view, start, stop);
    let total = ((stop - start) / 8) as usize;
    split(
        &entries,
        total - entries.len(),
        |ip| idx.resolve(Gva(ip)).map(|r| r.offset),
        0,
        idx.init_text(),
    )
}

/// Debian's image has no symbol table, but its kallsyms has
/// `__start_mcount_loc`/`__stop_mcount_loc` (KALLSYMS_ALL).
#[test]
fn debian_unpatched_matches_mcount_loc() {
    let idx = &crate::debian().index;
    let view = common::debian().view();
    let s = survey(&view, idx, true);
    assert_eq!(s.with_endbr, 0, "Debian 6.1 is built without IBT");
    let oracle = debian_oracle();
    compare("Debian vmlinux", idx, &s, &oracle, idx.init_text());
}

/// The guest's own record list, walked from `ftrace_pages_start`: built here
/// in a region added to the fast-lane image (a vmlinux file has the list
/// empty: `ftrace_init` has not run).
#[test]
fn ftrace_records_list() {
    use crate::common::Patched;
    use guest_introspect::fentry::{ftrace_records, RecordsError};

    let idx = &crate::fast().index;
    let head = idx
        .addr_of("ftrace_pages_start")
        .expect("ftrace_pages_start")
        .0;
    assert_eq!(
        ftrace_records(&common::fast().view(), idx, 1 << 20),
        Err(RecordsError::NotInitialised)
    );

    // Two ftrace_page structs and their dyn_ftrace arrays in the direct map.
    let area = 0xffff_8880_0100_0000u64;
    let mut mem = vec![0u8; 0x3000];
    let put =
        |mem: &mut Vec<u8>, off: usize, v: u64| mem[off..off + 8].copy_from_slice(&v.to_le_bytes());
    // page 0 at +0: next = page 1, records at +0x1000, index 3
    put(&mut mem, 0, area + 0x100);
    put(&mut mem, 8, area + 0x1000);
    mem[16..20].copy_from_slice(&3i32.to_le_bytes());
    // page 1 at +0x100: next = 0, records at +0x2000, index 2
    put(&mut mem, 0x108, area + 0x2000);
    mem[0x110..0x114].copy_from_slice(&2i32.to_le_bytes());
    let ips = [
        0xffff_ffff_8100_3004u64,
        0xffff_ffff_8100_1004,
        0xffff_ffff_8100_2004,
        0xffff_ffff_8120_0004,
        0xffff_ffff_8110_0004,
    ];
    for (i, ip) in ips[..3].iter().enumerate() {
        put(&mut mem, 0x1000 + 16 * i, *ip);
        put(&mut mem, 0x1008 + 16 * i, 0x1234); // flags
    }
    for (i, ip) in ips[3..].iter().enumerate() {
        put(&mut mem, 0x2000 + 16 * i, *ip);
    }
    let img = common::fast();
    let with = |mem: &[u8], first_page: u64| {
        let mut v = img.view();
        // The segment must outlive the view: leak the test's small buffer.
        let mem: &'static [u8] = Box::leak(mem.to_vec().into_boxed_slice());
        assert!(v.add(Gva(area), mem, mem.len() as u64));
        Patched {
            inner: v,
            patches: vec![(head, first_page.to_le_bytes().to_vec())],
        }
    };
    let mut want = ips.to_vec();
    want.sort_unstable();
    let got = ftrace_records(&with(&mem, area), idx, 1 << 20).unwrap();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), want);
    // Bounds: too many records, a loop, a negative count, a bad pointer.
    assert_eq!(
        ftrace_records(&with(&mem, area), idx, 4),
        Err(RecordsError::TooMany)
    );
    let mut looped = mem.clone();
    put(&mut looped, 0x100, area + 0x100);
    assert_eq!(
        ftrace_records(&with(&looped, area), idx, 1 << 20),
        Err(RecordsError::TooMany)
    );
    let mut negative = mem.clone();
    negative[16..20].copy_from_slice(&(-1i32).to_le_bytes());
    assert_eq!(
        ftrace_records(&with(&negative, area), idx, 1 << 20),
        Err(RecordsError::TooMany)
    );
    assert!(matches!(
        ftrace_records(&with(&mem, 0x1000), idx, 1 << 20),
        Err(RecordsError::Read(_))
    ));
}

/// Root follows module loads and unloads at the fentry sites of
/// `do_init_module` and `free_module`, and the freeing of a module's init
/// text at `module_arch_freeing_init`'s (hypervisor `tracer/modules.rs`):
/// both real kernels have them, per their own `__mcount_loc`.
#[test]
fn module_load_and_free_have_fentry_sites() {
    for (what, idx, oracle) in [
        ("fast-lane", &crate::fast().index, fast_oracle()),
        ("Debian", &crate::debian().index, debian_oracle()),
    ] {
        for f in ["do_init_module", "free_module", "module_arch_freeing_init"] {
            let a = idx
                .addr_of(f)
                .unwrap_or_else(|| panic!("{what}: no {f} in kallsyms"))
                .0;
            assert!(
                oracle.text.contains(&a) || oracle.text.contains(&(a + 4)),
                "{what}: {f} at {a:#x} has no fentry site"
            );
        }
    }
}
