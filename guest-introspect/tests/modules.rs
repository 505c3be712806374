//! The module list walk over synthetic guest memory laid out as 6.12 and
//! 6.1 lay out `struct module` (the offsets the real kernels' BTF gives,
//! see tests/real/facts.rs): names, states, text ranges and each module's
//! own symbols; and lists that are broken or hostile.

use guest_introspect::fentry::{
    classify_module, Endbr, NotTraceable, SiteState, SiteTargets, NOP5,
};
use guest_introspect::module::{
    rewalk_modules_at_load, walk_modules, walk_modules_limited, ModKallsyms, ModuleError,
    ModuleIndex, ModuleLayout, ModuleMemory, ModuleResolved, ModuleStates, ModuleSymbol,
    ModuleSymbolId, MAX_MODULES, MAX_MODULE_SYMBOLS,
};
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};

const BASE: u64 = 0xffff_ffff_c000_0000;
const SIZE: usize = 1 << 16;
/// The kernel's `modules` list head.
const HEAD: u64 = BASE + 0x100;

const STATES: ModuleStates = ModuleStates {
    live: 0,
    coming: 1,
    going: 2,
    unformed: 3,
};
const KALLSYMS: ModKallsyms = ModKallsyms {
    symtab: 0,
    num_symtab: 8,
    strtab: 16,
    typetab: Some(24),
};

/// The fast lane's (6.12) layout.
fn regions() -> ModuleLayout {
    ModuleLayout {
        size: 1216,
        state: 0,
        list: 8,
        name: 24,
        name_len: 56,
        memory: ModuleMemory::Regions {
            mem: 320,
            count: 7,
            stride: 72,
            base: 0,
            size: 8,
            text: 0,
            init_text: 4,
        },
        kallsyms: Some((888, KALLSYMS)),
        states: STATES,
    }
}

/// Debian's (6.1) layout.
fn layouts() -> ModuleLayout {
    ModuleLayout {
        size: 896,
        memory: ModuleMemory::Layouts {
            core: 320,
            init: 400,
            base: 0,
            size: 8,
            text_size: 12,
        },
        kallsyms: Some((544, KALLSYMS)),
        ..regions()
    }
}

/// A view that counts the reads made through it.
struct Counting<'a>(SegmentView<'a>, std::cell::Cell<u32>);

impl guest_introspect::view::VirtMemory for Counting<'_> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), guest_introspect::view::ViewError> {
        self.1.set(self.1.get() + 1);
        self.0.read_virt(gva, buf)
    }
}

/// Guest memory being laid out.
struct Mem(Vec<u8>);

impl Mem {
    fn new() -> Mem {
        Mem(vec![0; SIZE])
    }
    fn put(&mut self, at: u64, bytes: &[u8]) {
        let o = (at - BASE) as usize;
        self.0[o..o + bytes.len()].copy_from_slice(bytes);
    }
    fn q(&mut self, at: u64, v: u64) {
        self.put(at, &v.to_le_bytes());
    }
    fn d(&mut self, at: u64, v: u32) {
        self.put(at, &v.to_le_bytes());
    }
    fn view(&self) -> SegmentView<'_> {
        let mut v = SegmentView::new();
        assert!(v.add(Gva(BASE), &self.0, SIZE as u64));
        v
    }
}

/// A module at `m` named `name` in `state`, with core text at `text`
/// (`len` bytes), init text `init`, and `syms` (name, type, address); its
/// tables go at `tables`.
#[allow(clippy::too_many_arguments)]
fn module(
    mem: &mut Mem,
    l: &ModuleLayout,
    m: u64,
    name: &str,
    state: u32,
    text: (u64, u32),
    init: (u64, u32),
    syms: &[(&str, u8, u64)],
    tables: u64,
) {
    mem.d(m + u64::from(l.state), state);
    mem.put(m + u64::from(l.name), name.as_bytes());
    match l.memory {
        ModuleMemory::Layouts {
            core,
            init: i,
            base,
            text_size,
            ..
        } => {
            mem.q(m + u64::from(core + base), text.0);
            mem.d(m + u64::from(core + text_size), text.1);
            mem.q(m + u64::from(i + base), init.0);
            mem.d(m + u64::from(i + text_size), init.1);
        }
        ModuleMemory::Regions {
            mem: at,
            stride,
            base,
            size,
            text: t,
            init_text,
            ..
        } => {
            for (idx, (b, n)) in [(t, text), (init_text, init)] {
                let r = m + u64::from(at + idx * stride);
                mem.q(r + u64::from(base), b);
                mem.d(r + u64::from(size), n);
            }
        }
    }
    // mod_kallsyms, then the symtab (a null symbol first, as the kernel
    // keeps it), the types and the strings.
    let (ks_at, ks) = l.kallsyms.unwrap();
    let ks_addr = tables;
    let symtab = tables + 0x40;
    let n = syms.len() as u64 + 1;
    let typetab = symtab + 24 * n;
    let strtab = typetab + n + 8;
    mem.q(m + u64::from(ks_at), ks_addr);
    mem.q(ks_addr + u64::from(ks.symtab), symtab);
    mem.d(ks_addr + u64::from(ks.num_symtab), n as u32);
    mem.q(ks_addr + u64::from(ks.strtab), strtab);
    mem.q(ks_addr + u64::from(ks.typetab.unwrap()), typetab);
    let mut str_off = 1u32; // offset 0: the empty name
    for (i, (s, kind, addr)) in syms.iter().enumerate() {
        let e = symtab + 24 * (i as u64 + 1);
        mem.d(e, str_off);
        mem.q(e + 8, *addr);
        mem.put(typetab + i as u64 + 1, &[*kind]);
        mem.put(strtab + u64::from(str_off), s.as_bytes());
        str_off += s.len() as u32 + 1;
    }
}

/// Links modules at `ms` (their `struct module` addresses) into the list
/// at HEAD, in that order.
fn link(mem: &mut Mem, l: &ModuleLayout, ms: &[u64]) {
    let nodes: Vec<u64> = std::iter::once(HEAD)
        .chain(ms.iter().map(|m| m + u64::from(l.list)))
        .collect();
    for (i, &node) in nodes.iter().enumerate() {
        let next = nodes[(i + 1) % nodes.len()];
        let prev = nodes[(i + nodes.len() - 1) % nodes.len()];
        mem.q(node, next);
        mem.q(node + 8, prev);
    }
}

#[test]
fn both_layouts_walk_to_names_text_and_symbols() {
    for l in [regions(), layouts()] {
        let mut mem = Mem::new();
        let (a, b, c) = (BASE + 0x1000, BASE + 0x2000, BASE + 0x3000);
        module(
            &mut mem,
            &l,
            a,
            "ext4",
            0,
            (0xffff_ffff_c100_0000, 0x5_2000),
            (0, 0),
            &[
                ("ext4_file_open", b't', 0xffff_ffff_c100_1230),
                ("ext4_fs_type", b'd', 0xffff_ffff_c108_0000),
            ],
            BASE + 0x8000,
        );
        module(
            &mut mem,
            &l,
            b,
            "loop",
            1,
            (0xffff_ffff_c120_0000, 0x3000),
            (0xffff_ffff_c130_0000, 0x800),
            &[("loop_init", b't', 0xffff_ffff_c130_0010)],
            BASE + 0x9000,
        );
        // Being set up: no memory or symbols read yet.
        module(
            &mut mem,
            &l,
            c,
            "dummy",
            3,
            (0xdead, 1),
            (0, 0),
            &[],
            BASE + 0xa000,
        );
        link(&mut mem, &l, &[a, b, c]);
        let view = mem.view();
        let got = walk_modules(&view, &l, Gva(HEAD)).unwrap();
        let summary: Vec<_> = got
            .iter()
            .map(|m| (m.addr.0, m.name.as_str(), m.state, m.text, m.init_text))
            .collect();
        assert_eq!(
            summary,
            [
                (
                    a,
                    "ext4",
                    0,
                    GvaRange::with_len(Gva(0xffff_ffff_c100_0000), 0x5_2000),
                    GvaRange::new(Gva(0), Gva(0))
                ),
                (
                    b,
                    "loop",
                    1,
                    GvaRange::with_len(Gva(0xffff_ffff_c120_0000), 0x3000),
                    GvaRange::with_len(Gva(0xffff_ffff_c130_0000), 0x800)
                ),
                (
                    c,
                    "dummy",
                    3,
                    GvaRange::new(Gva(0), Gva(0)),
                    GvaRange::new(Gva(0), Gva(0))
                ),
            ],
            "{l:?}"
        );
        assert_eq!(
            got[0].symbols,
            [
                ModuleSymbol {
                    addr: 0xffff_ffff_c100_1230,
                    kind: b't',
                    name: "ext4_file_open".into()
                },
                ModuleSymbol {
                    addr: 0xffff_ffff_c108_0000,
                    kind: b'd',
                    name: "ext4_fs_type".into()
                }
            ]
        );
        assert_eq!(got[1].symbols.len(), 1);
        assert!(got[2].symbols.is_empty());
        // No modules: the head points at itself.
        link(&mut mem, &l, &[]);
        assert_eq!(walk_modules(&mem.view(), &l, Gva(HEAD)), Ok(vec![]));
    }
}

#[test]
fn broken_and_hostile_lists_are_errors() {
    let l = regions();
    let mut mem = Mem::new();
    let a = BASE + 0x1000;
    module(&mut mem, &l, a, "a", 0, (0, 0), (0, 0), &[], BASE + 0x8000);
    // A list that loops without coming back to its head.
    link(&mut mem, &l, &[a]);
    mem.q(a + 8, a + 8);
    assert_eq!(
        walk_modules(&mem.view(), &l, Gva(HEAD)),
        Err(ModuleError::TooLong)
    );
    assert_eq!(MAX_MODULES, 4096);
    // A next pointer out of guest memory.
    mem.q(a + 8, 0x1234_5000);
    assert!(matches!(
        walk_modules(&mem.view(), &l, Gva(HEAD)),
        Err(ModuleError::Read(_))
    ));
    // A symbol count no module has.
    link(&mut mem, &l, &[a]);
    let ks = u64::from_le_bytes(mem.0[(a - BASE + 888) as usize..][..8].try_into().unwrap());
    mem.d(ks + 8, u32::MAX);
    assert_eq!(
        walk_modules(&mem.view(), &l, Gva(HEAD)),
        Err(ModuleError::TooManySymbols(u32::MAX))
    );
    // A name with no NUL stops at MODULE_NAME_LEN.
    mem.d(ks + 8, 1);
    mem.put(a + 24, &[b'x'; 56]);
    mem.put(a + 24 + 56, b"overflow");
    let got = walk_modules(&mem.view(), &l, Gva(HEAD)).unwrap();
    assert_eq!(got[0].name, "x".repeat(56));
}

/// Two modules (the second still being set up) walked into an index:
/// `/proc/kallsyms` order, lookups by module and name, `%pS`-style
/// resolution within one module's text, and each function's fentry site
/// read from module text.
#[test]
fn the_index_resolves_and_classifies_module_functions() {
    let l = regions();
    let mut mem = Mem::new();
    let (a, b) = (BASE + 0x1000, BASE + 0x2000);
    let text = BASE + 0x8000;
    module(
        &mut mem,
        &l,
        a,
        "hvtarget",
        STATES.live as u32,
        (text, 0x100),
        (BASE + 0x9000, 0x40),
        &[
            ("hvtarget_leaf", b't', text),
            ("hvtarget_sum", b't', text + 0x10),
            ("hvtarget_poke", b't', text + 0x40),
            ("alias_of_sum", b'T', text + 0x10),
            ("hvtarget_init", b't', BASE + 0x9000),
            ("__this_module", b'D', BASE + 0xa000),
            ("no_site", b't', text + 0x80),
        ],
        BASE + 0x3000,
    );
    module(
        &mut mem,
        &l,
        b,
        "halfway",
        STATES.unformed as u32,
        (0, 0),
        (0, 0),
        &[],
        BASE + 0x4000,
    );
    link(&mut mem, &l, &[a, b]);
    // Sites: a bare NOP5, an ENDBR64 then a NOP5, `call __fentry__` not
    // yet patched is not in a booted module; nothing at no_site.
    mem.put(text, &NOP5);
    mem.put(text + 0x10, &[0xf3, 0x0f, 0x1e, 0xfa]);
    mem.put(text + 0x14, &NOP5);
    mem.put(text + 0x40, &NOP5);
    mem.put(BASE + 0x9000, &NOP5);
    mem.put(
        text + 0x80,
        &[0x55, 0x48, 0x89, 0xe5, 0x90, 0x90, 0x90, 0x90, 0x90],
    );
    let view = mem.view();
    let walked = walk_modules(&view, &l, Gva(HEAD)).unwrap();
    let idx = ModuleIndex::new(walked, STATES).unwrap();
    assert_eq!(idx.modules().len(), 2);
    assert_eq!(idx.symbol_count(), 7);
    assert!(idx.heap_bytes() > 7 * std::mem::size_of::<ModuleSymbol>());

    // Kallsyms order leaves the unformed module out.
    let names: Vec<(&str, &str)> = idx
        .kallsyms_order()
        .map(|(_, m, s)| (m.name.as_str(), s.name.as_str()))
        .collect();
    assert_eq!(names.len(), 7);
    assert!(names.iter().all(|(m, _)| *m == "hvtarget"));
    assert_eq!(names[0].1, "hvtarget_leaf");
    assert_eq!(names[6].1, "no_site");

    let sum = idx.lookup(Some("hvtarget"), "hvtarget_sum").unwrap();
    assert_eq!(
        sum,
        ModuleSymbolId {
            module: 0,
            symbol: 1
        }
    );
    assert_eq!(idx.lookup(None, "hvtarget_sum"), Some(sum));
    assert_eq!(idx.lookup(Some("ext4"), "hvtarget_sum"), None);
    assert_eq!(idx.lookup(None, "ext4_file_open"), None);
    assert!(idx.module("hvtarget").is_some());
    assert!(idx.module("halfway").is_none());

    // Resolution: the first of aliases, sized to the next function or the
    // end of the text the address is in.
    assert_eq!(
        idx.resolve(Gva(text + 0x14)),
        Some(ModuleResolved {
            module: "hvtarget",
            name: "hvtarget_sum",
            addr: text + 0x10,
            offset: 4,
            size: 0x30,
        })
    );
    let last = idx.resolve(Gva(text + 0xff)).unwrap();
    assert_eq!((last.name, last.offset, last.size), ("no_site", 0x7f, 0x80));
    assert_eq!(idx.resolve(Gva(text + 0x100)), None, "past the text");
    assert_eq!(
        idx.resolve(Gva(text - 1)),
        None,
        "before the first function"
    );
    let init = idx.resolve(Gva(BASE + 0x9004)).unwrap();
    assert_eq!((init.name, init.size), ("hvtarget_init", 0x40));
    assert!(idx.in_text(Gva(text + 0x50)));
    assert!(!idx.in_text(Gva(BASE + 0xa000)));

    // Sites (with no call targets known: a booted module's sites hold the
    // NOP5).
    let site = |name: &str| {
        let id = idx.lookup(None, name).unwrap();
        let (m, s) = idx.get(id).unwrap();
        classify_module(&view, &SiteTargets::default(), m, s, false)
    };
    let leaf = site("hvtarget_leaf").unwrap();
    assert_eq!(
        (leaf.site.0, leaf.endbr, leaf.state),
        (text, Endbr::None, SiteState::Nop)
    );
    let s = site("hvtarget_sum").unwrap();
    assert_eq!(
        (s.func.0, s.site.0, s.endbr),
        (text + 0x10, text + 0x14, Endbr::Endbr64)
    );
    assert_eq!(site("no_site"), Err(NotTraceable::NoFentry));
    assert_eq!(site("__this_module"), Err(NotTraceable::DataSymbol));
    assert!(matches!(
        site("hvtarget_init"),
        Err(NotTraceable::InitText { .. })
    ));
    // Traceable when the caller follows the freeing of init text.
    let id = idx.lookup(None, "hvtarget_init").unwrap();
    let (m, s) = idx.get(id).unwrap();
    let init = classify_module(&view, &SiteTargets::default(), m, s, true).unwrap();
    assert_eq!(
        (init.func.0, init.site.0, init.state),
        (s.addr, BASE + 0x9000, SiteState::Nop)
    );

    // Packed for the host and rebuilt: the same modules, the same answers;
    // cut short anywhere, lengthened or mislabelled, refused.
    let packed = idx.pack().unwrap();
    let back = ModuleIndex::unpack(&packed).unwrap();
    assert_eq!(back.modules(), idx.modules());
    assert_eq!(back.states(), idx.states());
    assert_eq!(back.fingerprint(), idx.fingerprint());
    for addr in [text, text + 0x14, text + 0xff, BASE + 0x9004, text + 0x100] {
        assert_eq!(back.resolve(Gva(addr)), idx.resolve(Gva(addr)));
    }
    for cut in 0..packed.len() {
        assert!(ModuleIndex::unpack(&packed[..cut]).is_err(), "cut at {cut}");
    }
    let mut longer = packed.clone();
    longer.push(0);
    assert!(ModuleIndex::unpack(&longer).is_err());
    let mut other = packed.clone();
    other[7] ^= 1;
    assert!(ModuleIndex::unpack(&other).is_err());
    // A symbol count far beyond the bytes is refused before any reserve.
    let mut huge = packed.clone();
    let at = 8 + 32 + 4 + 48 + 2 + "hvtarget".len();
    huge[at..at + 4].copy_from_slice(&(MAX_MODULE_SYMBOLS).to_le_bytes());
    assert!(ModuleIndex::unpack(&huge).is_err());
}

/// Guest memory with one module, `big`, of `n` functions in 6.1's layout.
fn one_big_module(l: &ModuleLayout, n: u64) -> Mem {
    let mut mem = Mem::new();
    let a = BASE + 0x1000;
    let syms: Vec<(String, u8, u64)> = (0..n)
        .map(|i| (format!("function_number_{i}"), b't', BASE + 0x8000 + i * 16))
        .collect();
    let refs: Vec<(&str, u8, u64)> = syms.iter().map(|(n, k, a)| (n.as_str(), *k, *a)).collect();
    module(
        &mut mem,
        l,
        a,
        "big",
        STATES.live as u32,
        (BASE + 0x8000, 0x1000),
        (0, 0),
        &refs,
        BASE + 0x3000,
    );
    link(&mut mem, l, &[a]);
    mem
}

/// A module list whose symbols would take more heap than allowed is
/// refused as out of memory, not read to the end.
#[test]
fn a_walk_over_its_byte_limit_is_refused() {
    let l = layouts();
    let mem = one_big_module(&l, 40);
    let view = mem.view();
    assert_eq!(
        walk_modules(&view, &l, Gva(HEAD)).unwrap()[0].symbols.len(),
        40
    );
    match walk_modules_limited(&view, &l, Gva(HEAD), 1024) {
        Err(ModuleError::OutOfMemory(e)) => assert!(e.bytes > 1024),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The walk through a page cache gives the same modules, with far fewer
/// reads of the view underneath.
#[test]
fn a_page_cache_gives_the_same_walk_with_fewer_reads() {
    use guest_introspect::view::{PageCache, VirtMemory};
    use std::cell::Cell;
    let l = layouts();
    let mem = one_big_module(&l, 200);
    let plain = Counting(mem.view(), Cell::new(0));
    let whole = walk_modules(&plain, &l, Gva(HEAD)).unwrap();
    let counted = Counting(mem.view(), Cell::new(0));
    let cache = PageCache::new(&counted);
    let cached = walk_modules(&cache, &l, Gva(HEAD)).unwrap();
    assert_eq!(cached, whole);
    assert_eq!(cached[0].symbols.len(), 200);
    println!(
        "reads: {} plain, {} through the cache",
        plain.1.get(),
        counted.1.get()
    );
    assert!(plain.1.get() > 600);
    assert!(counted.1.get() < 20, "{} reads", counted.1.get());
    // A read across a page boundary and one of a hole behave as before.
    let mut b = [0u8; 16];
    assert!(cache.read_virt(Gva(BASE + 0xff8), &mut b).is_ok());
    assert!(cache.read_virt(Gva(BASE + SIZE as u64), &mut b).is_err());
}

#[test]
fn a_rewalk_at_a_load_reads_only_the_changed_modules_symbols() {
    use std::cell::Cell;
    let max = usize::MAX;
    for l in [regions(), layouts()] {
        // A big live module, and a small one coming (its init symbol still
        // in its table).
        let (big, small) = (BASE + 0x1000, BASE + 0x2000);
        let mut mem = one_big_module(&l, 150);
        let coming = [
            ("small_fn", b't', BASE + 0xa000),
            ("small_init", b't', BASE + 0xb000),
        ];
        module(
            &mut mem,
            &l,
            small,
            "small",
            STATES.coming as u32,
            (BASE + 0xa000, 0x100),
            (BASE + 0xb000, 0x100),
            &coming,
            BASE + 0x6000,
        );
        link(&mut mem, &l, &[small, big]);
        let first = walk_modules(&mem.view(), &l, Gva(HEAD)).unwrap();

        // small's init is done: live, its init text gone and its table
        // down to its core symbol. Then a third module loads.
        let third = BASE + 0xc000;
        module(
            &mut mem,
            &l,
            small,
            "small",
            STATES.live as u32,
            (BASE + 0xa000, 0x100),
            (0, 0),
            &coming[..1],
            BASE + 0x6000,
        );
        module(
            &mut mem,
            &l,
            third,
            "third",
            STATES.coming as u32,
            (BASE + 0xd000, 0x100),
            (0, 0),
            &[("third_fn", b't', BASE + 0xd000)],
            BASE + 0x7000,
        );
        link(&mut mem, &l, &[third, small, big]);
        let full_view = Counting(mem.view(), Cell::new(0));
        let full = walk_modules(&full_view, &l, Gva(HEAD)).unwrap();
        let re_view = Counting(mem.view(), Cell::new(0));
        let re = rewalk_modules_at_load(&re_view, &l, Gva(HEAD), max, first.clone(), Gva(third))
            .unwrap();
        // The same result: big's symbols kept, small's and third's read.
        assert_eq!(re, full);
        assert_eq!(
            re[1].symbols.len(),
            1,
            "small is live: its core symbol only"
        );
        println!(
            "reads: full walk {}, rewalk at the load {}",
            full_view.1.get(),
            re_view.1.get()
        );
        assert!(full_view.1.get() > 450 && re_view.1.get() < 60);

        // The loading module is read in full even when it looks unchanged
        // (a module loaded again at the same place).
        let again =
            rewalk_modules_at_load(&mem.view(), &l, Gva(HEAD), max, full.clone(), Gva(third))
                .unwrap();
        assert_eq!(again, full);
        let mut stale = full.clone();
        stale[0].symbols[0].name = "stale".into();
        let fixed =
            rewalk_modules_at_load(&mem.view(), &l, Gva(HEAD), max, stale.clone(), Gva(third))
                .unwrap();
        assert_eq!(fixed[0].symbols[0].name, "third_fn");
        // Any other module is kept only when unchanged.
        let kept =
            rewalk_modules_at_load(&mem.view(), &l, Gva(HEAD), max, stale, Gva(small)).unwrap();
        assert_eq!(kept[0].symbols[0].name, "stale");
        // The byte limit counts kept symbols too.
        assert!(matches!(
            rewalk_modules_at_load(&mem.view(), &l, Gva(HEAD), 4096, full.clone(), Gva(third)),
            Err(ModuleError::OutOfMemory(_))
        ));
    }
}

/// Every read of the walk is charged, whether the page cache has its page
/// or not: a list that keeps to a few cached pages pays for its work.
#[test]
fn a_walk_through_the_cache_pays_for_every_read() {
    use guest_introspect::budget::{Budget, READ_PAGE_COST};
    use guest_introspect::module::{walk_modules_budgeted, MODULE_WALK_BUDGET};
    use std::cell::Cell;
    let l = layouts();
    // An honest module of 200 functions: the walk's result is the plain
    // walk's, and the budget was charged for every read the plain walk
    // makes, though only a few pages were read underneath.
    let mem = one_big_module(&l, 200);
    let plain = Counting(mem.view(), Cell::new(0));
    let whole = walk_modules(&plain, &l, Gva(HEAD)).unwrap();
    let under = Counting(mem.view(), Cell::new(0));
    let budget = Budget::new(MODULE_WALK_BUDGET);
    let got = walk_modules_budgeted(&under, &l, Gva(HEAD), usize::MAX, Vec::new(), None, &budget);
    assert_eq!(got.as_ref(), Ok(&whole));
    println!(
        "reads: {} by the walk, {} charged, {} underneath, {} units",
        plain.1.get(),
        budget.reads(),
        under.1.get(),
        budget.used()
    );
    assert!(under.1.get() < 20, "{} reads underneath", under.1.get());
    assert!(budget.reads() >= u64::from(plain.1.get()));
    assert!(budget.used() >= u64::from(plain.1.get()) * READ_PAGE_COST);

    // A hostile list: one module whose list entry points back at itself
    // (so the walk meets it again and again, up to MAX_MODULES times), its
    // 150 nameless symbols in one page of symtab. Nearly every read hits
    // the cache; the walk stops once its budget is spent, long before
    // 4,096 times 150 symbols.
    let l = regions();
    let mut mem = Mem::new();
    let a = BASE + 0x1000;
    let nameless = vec![("", b't', 0u64); 150];
    module(
        &mut mem,
        &l,
        a,
        "loop",
        STATES.live as u32,
        (BASE + 0xe000, 0x100),
        (0, 0),
        &nameless,
        BASE + 0x8000,
    );
    link(&mut mem, &l, &[a]);
    mem.q(a + u64::from(l.list), a + u64::from(l.list));
    let walk = |limit: u64| {
        let under = Counting(mem.view(), Cell::new(0));
        let budget = Budget::new(limit);
        let got =
            walk_modules_budgeted(&under, &l, Gva(HEAD), usize::MAX, Vec::new(), None, &budget);
        println!(
            "hostile loop, budget {limit}: {} reads charged, {} underneath, {} units: {got:?}",
            budget.reads(),
            under.1.get(),
            budget.used()
        );
        assert!(under.1.get() < 20, "{} reads underneath", under.1.get());
        assert!(budget.used() <= limit);
        assert!(budget.reads() <= limit / READ_PAGE_COST + 1);
        (got, budget.exhausted())
    };
    assert_eq!(
        walk(MODULE_WALK_BUDGET / 16),
        (Err(ModuleError::OverBudget), true)
    );
    // With root's budget the walk's cap of symbols stops it first (the
    // nameless entries cost least); either way, within the budget.
    assert!(matches!(
        walk(MODULE_WALK_BUDGET).0,
        Err(ModuleError::OverBudget | ModuleError::TooManyWalkSymbols(_))
    ));
}

/// A walk reads at most MAX_WALK_SYMBOLS symbol table entries over all
/// its modules: a list whose tables claim more is refused before the
/// table that passes the cap is read.
#[test]
fn a_walk_reads_at_most_its_cap_of_symbols() {
    use guest_introspect::module::MAX_WALK_SYMBOLS;
    const { assert!(MAX_WALK_SYMBOLS <= MAX_MODULE_SYMBOLS) };
    let cap = u64::from(MAX_WALK_SYMBOLS);
    let l = regions();
    let mut mem = Mem::new();
    let (a, b) = (BASE + 0x1000, BASE + 0x2000);
    // `a`: ten functions (and the null symbol: 11 entries).
    let syms: Vec<(String, u8, u64)> = (0..10)
        .map(|i| (format!("a_fn_{i}"), b't', BASE + 0xe000 + i * 16))
        .collect();
    let refs: Vec<(&str, u8, u64)> = syms.iter().map(|(n, k, a)| (n.as_str(), *k, *a)).collect();
    let live = STATES.live as u32;
    let text = (BASE + 0xe000, 0x1000);
    module(
        &mut mem,
        &l,
        a,
        "a",
        live,
        text,
        (0, 0),
        &refs,
        BASE + 0x8000,
    );
    // `b`: a big table of nameless entries, in zeroed memory elsewhere.
    module(
        &mut mem,
        &l,
        b,
        "b",
        live,
        (BASE + 0xf000, 0x100),
        (0, 0),
        &[],
        BASE + 0x9000,
    );
    let zeroes = BASE + 0x100_0000;
    let ks = BASE + 0x9000;
    mem.q(ks, zeroes);
    mem.q(ks + 16, zeroes);
    mem.q(ks + 24, zeroes);
    link(&mut mem, &l, &[a, b]);
    fn with_zeroes(mem: &Mem, at: u64, len: u64) -> SegmentView<'_> {
        let mut v = mem.view();
        assert!(v.add(Gva(at), &[], len));
        v
    }
    let len = 24 * cap + 4096;
    // Up to the cap in all: read.
    mem.d(ks + 8, (cap - 11) as u32);
    let got = walk_modules(&with_zeroes(&mem, zeroes, len), &l, Gva(HEAD)).unwrap();
    assert_eq!((got[0].symbols.len(), got[1].symbols.len()), (10, 0));
    // One more: refused, whether walked in full or at a load.
    mem.d(ks + 8, (cap - 10) as u32);
    assert_eq!(
        walk_modules(&with_zeroes(&mem, zeroes, len), &l, Gva(HEAD)),
        Err(ModuleError::TooManyWalkSymbols(cap + 1))
    );
    assert_eq!(
        walk_modules_limited(&with_zeroes(&mem, zeroes, len), &l, Gva(HEAD), usize::MAX),
        Err(ModuleError::TooManyWalkSymbols(cap + 1))
    );
    // At a load the symbols kept from an earlier walk count too.
    mem.d(ks + 8, (cap - 9) as u32);
    assert_eq!(
        rewalk_modules_at_load(
            &with_zeroes(&mem, zeroes, len),
            &l,
            Gva(HEAD),
            usize::MAX,
            got,
            Gva(b)
        ),
        Err(ModuleError::TooManyWalkSymbols(cap + 1))
    );
    // The refusal reads nothing of the table that passes the cap.
    let counted = Counting(with_zeroes(&mem, zeroes, len), std::cell::Cell::new(0));
    assert!(walk_modules(&counted, &l, Gva(HEAD)).is_err());
    assert!(counted.1.get() < 100, "{} reads", counted.1.get());
}
