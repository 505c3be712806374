//! The page walker over synthetic guest page tables in a `VecMemory`.

use guest_introspect::paging::{
    kernel_root, read_virt, translate, Cr3, Level, PageSize, RootError, WalkError, PTE_LARGE,
    PTE_NX, PTE_PRESENT, PTE_USER, PTE_WRITABLE,
};
use guest_introspect::view::{PagedView, ViewError, VirtMemory};
use guest_introspect::{Gpa, Gva, MemError, VecMemory};

const P: u64 = PTE_PRESENT;
const W: u64 = PTE_WRITABLE;
const U: u64 = PTE_USER;

/// Guest RAM of 16 MiB at 0 with a table allocator.
struct Builder {
    mem: VecMemory,
    next_table: u64,
    pml4: u64,
}

impl Builder {
    fn new() -> Self {
        let mut b = Self {
            mem: VecMemory::new(Gpa(0), 16 << 20),
            next_table: 0x1000,
            pml4: 0,
        };
        b.pml4 = b.table();
        b
    }

    fn table(&mut self) -> u64 {
        let t = self.next_table;
        self.next_table += 0x1000;
        t
    }

    fn index(gva: u64, level: Level) -> u64 {
        (gva >> level.shift()) & 0x1ff
    }

    fn entry_addr(table: u64, gva: u64, level: Level) -> Gpa {
        Gpa(table + 8 * Self::index(gva, level))
    }

    fn read(&self, at: Gpa) -> u64 {
        use guest_introspect::GuestMemory;
        self.mem.read_u64(at).unwrap()
    }

    /// The table under the entry for `gva` at `level` in `table`, created
    /// with `flags` when missing.
    fn descend(&mut self, table: u64, gva: u64, level: Level, flags: u64) -> u64 {
        let at = Self::entry_addr(table, gva, level);
        let e = self.read(at);
        if e & P != 0 {
            return e & 0x000f_ffff_ffff_f000;
        }
        let t = self.table();
        self.mem.write_u64(at, t | flags).unwrap();
        t
    }

    /// Maps `gva` to `gpa` with a page of `size`; `leaf` flags on the leaf,
    /// `upper` on the tables above.
    fn map(&mut self, gva: u64, gpa: u64, size: PageSize, leaf: u64, upper: u64) {
        let pdpt = self.descend(self.pml4, gva, Level::Pml4, upper);
        if size == PageSize::Size1G {
            self.mem
                .write_u64(
                    Self::entry_addr(pdpt, gva, Level::Pdpt),
                    gpa | leaf | PTE_LARGE,
                )
                .unwrap();
            return;
        }
        let pd = self.descend(pdpt, gva, Level::Pdpt, upper);
        if size == PageSize::Size2M {
            self.mem
                .write_u64(Self::entry_addr(pd, gva, Level::Pd), gpa | leaf | PTE_LARGE)
                .unwrap();
            return;
        }
        let pt = self.descend(pd, gva, Level::Pd, upper);
        self.mem
            .write_u64(Self::entry_addr(pt, gva, Level::Pt), gpa | leaf)
            .unwrap();
    }

    fn cr3(&self) -> Cr3 {
        // PCID bits in 11..0 must be ignored.
        Cr3(self.pml4 | 0x5)
    }
}

const KTEXT: u64 = 0xffff_ffff_8100_0000;

#[test]
fn page_sizes_and_offsets() {
    let mut b = Builder::new();
    b.map(KTEXT, 0x40_0000, PageSize::Size2M, P | W, P | W);
    b.map(
        0xffff_8880_0000_0000,
        0,
        PageSize::Size1G,
        P | W | PTE_NX,
        P | W,
    );
    b.map(
        0x0000_7fff_0000_1000,
        0x80_3000,
        PageSize::Size4K,
        P | W | U,
        P | W | U,
    );
    let cr3 = b.cr3();

    let t = translate(&b.mem, cr3, Gva(KTEXT + 0x1_2345)).unwrap();
    assert_eq!(t.gpa, Gpa(0x41_2345));
    assert_eq!(t.size, PageSize::Size2M);
    assert!(t.writable && !t.nx && !t.user);

    let t = translate(&b.mem, cr3, Gva(0xffff_8880_0012_3456)).unwrap();
    assert_eq!(
        (t.gpa, t.size, t.nx),
        (Gpa(0x12_3456), PageSize::Size1G, true)
    );

    let t = translate(&b.mem, cr3, Gva(0x0000_7fff_0000_1abc)).unwrap();
    assert_eq!(
        (t.gpa, t.size, t.user, t.nx),
        (Gpa(0x80_3abc), PageSize::Size4K, true, false)
    );
}

#[test]
fn access_bits_combine_over_levels() {
    let mut b = Builder::new();
    // Leaf writable and user, but an upper level read-only, supervisor, NX.
    b.map(
        0x40_0000,
        0x10_0000,
        PageSize::Size4K,
        P | W | U,
        P | PTE_NX,
    );
    let t = translate(&b.mem, b.cr3(), Gva(0x40_0000)).unwrap();
    assert!(!t.writable && !t.user && t.nx);
    // The 2 MiB PAT bit (12) is not part of the frame.
    b.map(KTEXT, 0x60_0000, PageSize::Size2M, P | (1 << 12), P);
    assert_eq!(
        translate(&b.mem, b.cr3(), Gva(KTEXT + 0x10)).unwrap().gpa,
        Gpa(0x60_0010)
    );
}

#[test]
fn not_present_at_each_level() {
    let mut b = Builder::new();
    let cr3 = b.cr3();
    // Nothing at all: the PML4 entry.
    assert_eq!(
        translate(&b.mem, cr3, Gva(KTEXT)),
        Err(WalkError::NotPresent {
            gva: Gva(KTEXT),
            level: Level::Pml4
        })
    );
    // A PML4 entry but no PDPT entry for this GiB.
    b.map(KTEXT + (1 << 30), 0, PageSize::Size1G, P, P);
    assert_eq!(
        translate(&b.mem, cr3, Gva(KTEXT)),
        Err(WalkError::NotPresent {
            gva: Gva(KTEXT),
            level: Level::Pdpt
        })
    );
    // A PD with another 2 MiB entry only.
    b.map(KTEXT + (2 << 20), 0, PageSize::Size2M, P, P);
    assert_eq!(
        translate(&b.mem, cr3, Gva(KTEXT)),
        Err(WalkError::NotPresent {
            gva: Gva(KTEXT),
            level: Level::Pd
        })
    );
    // A PT with another 4 KiB entry only.
    b.map(KTEXT + 0x1000, 0, PageSize::Size4K, P, P);
    let e = translate(&b.mem, cr3, Gva(KTEXT)).unwrap_err();
    assert_eq!(
        e,
        WalkError::NotPresent {
            gva: Gva(KTEXT),
            level: Level::Pt
        }
    );
    assert_eq!(e.resume_at(), Some(Gva(KTEXT + 0x1000)));
    // A present leaf with P cleared is not present.
    b.map(KTEXT + 0x2000, 0x5000, PageSize::Size4K, W, P);
    assert!(matches!(
        translate(&b.mem, cr3, Gva(KTEXT + 0x2000)),
        Err(WalkError::NotPresent {
            level: Level::Pt,
            ..
        })
    ));
}

#[test]
fn malformed_tables() {
    let mut b = Builder::new();
    let cr3 = b.cr3();
    // PS in a PML4 entry is reserved.
    b.mem
        .write_u64(
            Builder::entry_addr(b.pml4, KTEXT, Level::Pml4),
            0x2000 | P | PTE_LARGE,
        )
        .unwrap();
    assert_eq!(
        translate(&b.mem, cr3, Gva(KTEXT)),
        Err(WalkError::Reserved {
            gva: Gva(KTEXT),
            level: Level::Pml4
        })
    );
    // A table outside guest RAM.
    b.mem
        .write_u64(
            Builder::entry_addr(b.pml4, KTEXT, Level::Pml4),
            0x7_0000_0000 | P,
        )
        .unwrap();
    assert!(matches!(
        translate(&b.mem, cr3, Gva(KTEXT)),
        Err(WalkError::Phys {
            err: MemError::OutOfRange { .. },
            ..
        })
    ));
    // A CR3 outside guest RAM.
    assert!(matches!(
        translate(&b.mem, Cr3(1 << 40), Gva(KTEXT)),
        Err(WalkError::Phys { .. })
    ));
    // Non-canonical.
    assert_eq!(
        translate(&b.mem, cr3, Gva(0x0000_8000_0000_0000)),
        Err(WalkError::NonCanonical {
            gva: Gva(0x0000_8000_0000_0000)
        })
    );
    // Garbage everywhere: no panic.
    let mut rng = 0x1234_5678_9abc_def1u64;
    for i in 0..4096u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        b.mem
            .write_u64(Gpa(b.pml4 + 8 * (i % 512)), rng | P)
            .unwrap();
        let _ = translate(&b.mem, cr3, Gva(rng & 0xffff_ffff_ffff_f000));
        let _ = read_virt(&b.mem, cr3, Gva(rng), &mut [0u8; 64]);
    }
}

#[test]
fn reads_cross_pages_and_sizes() {
    let mut b = Builder::new();
    // Virtually contiguous, physically scattered: 4K, 4K, then a 2M page.
    let base = KTEXT - 0x2000;
    b.map(base, 0x90_0000, PageSize::Size4K, P, P);
    b.map(base + 0x1000, 0x30_0000, PageSize::Size4K, P, P);
    b.map(KTEXT, 0xa0_0000, PageSize::Size2M, P, P);
    for (gpa, byte) in [(0x90_0000u64, 1u8), (0x30_0000, 2), (0xa0_0000, 3)] {
        b.mem.write(Gpa(gpa), &[byte; 0x1000]).unwrap();
    }
    let cr3 = b.cr3();
    let mut buf = vec![0u8; 0x2800];
    read_virt(&b.mem, cr3, Gva(base + 0x800), &mut buf).unwrap();
    assert!(buf[..0x800].iter().all(|&x| x == 1));
    assert!(buf[0x800..0x1800].iter().all(|&x| x == 2));
    assert!(buf[0x1800..].iter().all(|&x| x == 3));
    // Running off the end of the 2 MiB page into nothing.
    let e = read_virt(&b.mem, cr3, Gva(KTEXT + (2 << 20) - 4), &mut [0u8; 8]).unwrap_err();
    assert_eq!(
        e,
        WalkError::NotPresent {
            gva: Gva(KTEXT + (2 << 20)),
            level: Level::Pd
        }
    );
    // Through the view: the same bytes, holes as Unmapped with a resume
    // address at the end of the missing entry's span.
    let view = PagedView::new(&b.mem, cr3);
    let mut small = [0u8; 4];
    view.read_virt(Gva(base + 0xffe), &mut small).unwrap();
    assert_eq!(small, [1, 1, 2, 2]);
    assert_eq!(
        view.read_virt(Gva(KTEXT + (2 << 20)), &mut small),
        Err(ViewError::Unmapped {
            gva: Gva(KTEXT + (2 << 20)),
            resume: Some(Gva(KTEXT + (4 << 20)))
        })
    );
    // Zero-length reads of unmapped memory succeed; reads at the top of
    // the address space fail cleanly.
    read_virt(&b.mem, cr3, Gva(0x1234), &mut []).unwrap();
    assert!(read_virt(&b.mem, cr3, Gva(u64::MAX - 1), &mut [0u8; 4]).is_err());
}

/// The scanner skips a hole of a whole non-present PD entry in one step.
#[test]
fn scan_skips_holes() {
    use guest_introspect::scan::{find, ScanStats};
    let mut b = Builder::new();
    b.map(KTEXT, 0x20_0000, PageSize::Size2M, P, P);
    b.map(KTEXT + (8 << 20), 0x40_0000, PageSize::Size4K, P, P);
    b.mem.write(Gpa(0x40_0100), b"needle").unwrap();
    let view = PagedView::new(&b.mem, b.cr3());
    let mut st = ScanStats::default();
    let hit = find(
        &view,
        guest_introspect::GvaRange::with_len(Gva(KTEXT), 16 << 20),
        b"needle",
        &mut st,
        Some,
    );
    assert_eq!(hit, Some(Gva(KTEXT + (8 << 20) + 0x100)));
    // 2 MiB + the 4 KiB page were read; the holes were skipped in few reads.
    assert_eq!(st.bytes_scanned, (2 << 20) + 0x1000);
    assert!(st.reads < 80, "{st:?}");
}

/// A task's PGD whose kernel half points at the same PDPT as the kernel's
/// own PGD: `kernel_root` finds the kernel's from the task's, and refuses a
/// table that does not map the kernel the same way.
#[test]
fn the_kernels_own_pgd_is_found_through_a_tasks() {
    let mut b = Builder::new();
    // The kernel's PGD is a table of its own; map the kernel image 2 MiB at
    // KTEXT (physical 4 MiB) through it.
    b.map(KTEXT, 0x40_0000, PageSize::Size2M, P | W, P | W);
    let kernel_pgd = b.pml4;
    // A task's PGD: a copy of the kernel's upper half (same PDPT).
    let task_pgd = b.table();
    for i in 256..512u64 {
        let e = b.read(Gpa(kernel_pgd + i * 8));
        b.mem.write_u64(Gpa(task_pgd + i * 8), e).unwrap();
    }
    // init_top_pgt lives in the kernel image: place the kernel's PGD there
    // by mapping a virtual address onto its frame (4 KiB page).
    let pgd_gva = 0xffff_ffff_8200_0000u64;
    b.map(pgd_gva, kernel_pgd, PageSize::Size4K, P | W, P | W);
    // The task's copy was made before that mapping: copy the half again.
    for i in 256..512u64 {
        let e = b.read(Gpa(kernel_pgd + i * 8));
        b.mem.write_u64(Gpa(task_pgd + i * 8), e).unwrap();
    }
    let via = Cr3(task_pgd | 0x3);
    let root = kernel_root(&b.mem, via, Gva(pgd_gva), &[Gva(KTEXT + 0x1000)]).unwrap();
    assert_eq!(root, Cr3(kernel_pgd));
    // The task exits and its PGD is reused for something else: the walks
    // through the kernel root still work.
    for i in 0..512u64 {
        b.mem
            .write_u64(Gpa(task_pgd + i * 8), 0xdead_0000_0000_0007)
            .unwrap();
    }
    let t = translate(&b.mem, root, Gva(KTEXT + 0x1234)).unwrap();
    assert_eq!(t.gpa, Gpa(0x40_1234));

    // A symbol that points at some other page (not a PGD mapping the
    // kernel the same way) is refused.
    let mut b = Builder::new();
    b.map(KTEXT, 0x40_0000, PageSize::Size2M, P | W, P | W);
    let bogus = b.table();
    b.map(pgd_gva, bogus, PageSize::Size4K, P | W, P | W);
    let err = kernel_root(&b.mem, b.cr3(), Gva(pgd_gva), &[Gva(KTEXT)]).unwrap_err();
    assert!(matches!(err, RootError::Mismatch { .. }), "{err:?}");
    // Unmapped: a walk error.
    assert!(matches!(
        kernel_root(&b.mem, b.cr3(), Gva(0xffff_ffff_9000_0000), &[]),
        Err(RootError::Walk(_))
    ));
}

// ----- linear windows ----------------------------------------------------

use guest_introspect::linear::{LinearError, LinearMaps, LinearView, LinearWindow};

/// A randomized direct-map base, as `page_offset_base` holds it.
const DIRECT: u64 = 0xffff_9a40_0000_0000;
/// `page_offset_base` in the image's data.
const POB_VAR: u64 = KTEXT + 0x28_0010;

/// The linear maps of a [`kernel_layout`], with or without its
/// `page_offset_base` and its image.
fn find(b: &Builder, pob: bool, image: bool) -> guest_introspect::linear::LinearFound {
    LinearMaps::find(
        &b.mem,
        b.cr3(),
        pob.then_some(Gva(POB_VAR)),
        image.then_some((Gva(KTEXT), Gva(KTEXT + 0x60_0000))),
    )
}

/// An image of 6 MiB at KTEXT on guest-physical 4 MiB (2 MiB pages), the
/// first 16 MiB of RAM in the direct map at `direct_pa` for DIRECT (1 GiB
/// page), and `page_offset_base` = DIRECT.
fn kernel_layout(direct_pa: u64) -> Builder {
    let mut b = Builder::new();
    for i in 0..3 {
        b.map(
            KTEXT + i * 0x20_0000,
            0x40_0000 + i * 0x20_0000,
            PageSize::Size2M,
            P | W,
            P | W,
        );
    }
    b.map(DIRECT, direct_pa, PageSize::Size1G, P | W | PTE_NX, P | W);
    b.mem
        .write_u64(Gpa(0x40_0000 + (POB_VAR - KTEXT)), DIRECT)
        .unwrap();
    b
}

#[test]
fn linear_windows_are_found_and_read_as_the_walk_does() {
    let mut b = kernel_layout(0);
    // A "task" in the direct map and bytes in the image.
    b.mem.write(Gpa(0x9a_0100), b"task comm bytes!").unwrap();
    b.mem.write(Gpa(0x41_0000), b"image").unwrap();
    let cr3 = b.cr3();
    let found = find(&b, true, true);
    assert_eq!(
        found.direct,
        Ok(LinearWindow {
            start: DIRECT,
            end: DIRECT + (64 << 40),
            delta: DIRECT
        })
    );
    assert_eq!(
        found.image,
        Ok(LinearWindow {
            start: KTEXT,
            end: KTEXT + 0x60_0000,
            delta: KTEXT - 0x40_0000
        })
    );
    assert_eq!(found.maps.windows().len(), 2);
    let fast = LinearView::new(&b.mem, cr3, &found.maps);
    let slow = PagedView::new(&b.mem, cr3);
    for (gva, len) in [
        (DIRECT + 0x9a_0100, 16),
        (KTEXT + 0x1_0000, 5),
        // Past the image's end: walked (and unmapped there).
        (KTEXT + 0x60_0000 - 2, 4),
    ] {
        let (mut a, mut c) = (vec![0u8; len], vec![0u8; len]);
        let ra = fast.read_virt(Gva(gva), &mut a);
        let rc = slow.read_virt(Gva(gva), &mut c);
        assert_eq!((ra.is_ok(), &a), (rc.is_ok(), &c), "{gva:#x}");
    }
    assert_eq!(
        found.maps.gpa(Gva(DIRECT + 0x9a_0100), 16),
        Some(Gpa(0x9a_0100))
    );
    // A read that starts in the image and ends past it takes no window.
    assert_eq!(found.maps.gpa(Gva(KTEXT + 0x60_0000 - 2), 4), None);
    // The guest unmaps its direct map afterwards: the window still reads
    // where the kernel's layout says (no walk); the walk fails.
    let pdpt = b.descend(b.pml4, DIRECT, Level::Pml4, P | W);
    b.mem
        .write_u64(Builder::entry_addr(pdpt, DIRECT, Level::Pdpt), 0)
        .unwrap();
    let fast = LinearView::new(&b.mem, cr3, &found.maps);
    let slow = PagedView::new(&b.mem, cr3);
    let mut a = [0u8; 16];
    fast.read_virt(Gva(DIRECT + 0x9a_0100), &mut a).unwrap();
    assert_eq!(&a, b"task comm bytes!");
    assert!(slow.read_virt(Gva(DIRECT + 0x9a_0100), &mut a).is_err());
}

#[test]
fn a_direct_map_the_walks_disagree_with_is_not_used() {
    // The direct map's first GiB maps guest-physical 1 GiB, not 0: not
    // the linear map of all memory (and past this 16 MiB RAM).
    let b = kernel_layout(1 << 30);
    let cr3 = b.cr3();
    let found = find(&b, true, true);
    assert!(
        matches!(found.direct, Err(LinearError::Disagrees { .. })),
        "{:?}",
        found.direct
    );
    assert!(found.image.is_ok());
    assert_eq!(found.maps.windows().len(), 1);
    assert_eq!(found.maps.gpa(Gva(DIRECT + 0x100), 8), None);
    // Without the variable the default base is tried: not mapped here.
    let found = LinearMaps::find(
        &b.mem,
        cr3,
        None,
        Some((Gva(KTEXT), Gva(KTEXT + 0x60_0000))),
    );
    assert!(matches!(found.direct, Err(LinearError::Unmapped(_))));
    // Without the image there is no sample for the direct map either.
    let found = find(&b, true, false);
    assert!(found.maps.windows().is_empty());
}

#[test]
fn a_hole_in_a_window_reads_as_the_walk_says() {
    let b = kernel_layout(0);
    let cr3 = b.cr3();
    let found = find(&b, true, true);
    let fast = LinearView::new(&b.mem, cr3, &found.maps);
    // Guest-physical 32 MiB is past this RAM: the physical read fails, the
    // walk then maps it (the 1 GiB page) and fails the same way.
    let mut buf = [0u8; 8];
    let e = fast
        .read_virt(Gva(DIRECT + (32 << 20)), &mut buf)
        .unwrap_err();
    let w = PagedView::new(&b.mem, cr3)
        .read_virt(Gva(DIRECT + (32 << 20)), &mut buf)
        .unwrap_err();
    assert_eq!(e, w);
}

// ----- the walk cache ----------------------------------------------------

use guest_introspect::paging::WalkCache;

/// Guest memory that counts the reads made of it.
struct Counting<'a>(&'a VecMemory, std::cell::Cell<u32>);

impl guest_introspect::GuestMemory for Counting<'_> {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError> {
        self.1.set(self.1.get() + 1);
        self.0.read_phys(gpa, buf)
    }
}

#[test]
fn the_walk_cache_reads_one_entry_and_follows_a_remapped_leaf() {
    let mut b = Builder::new();
    let stack = 0xffff_c900_0001_0000u64;
    b.map(stack, 0x30_0000, PageSize::Size4K, P | W | PTE_NX, P | W);
    b.map(
        stack + 0x1000,
        0x30_5000,
        PageSize::Size4K,
        P | W | PTE_NX,
        P | W,
    );
    b.mem.write(Gpa(0x30_0ff8), &[1; 8]).unwrap();
    b.mem.write(Gpa(0x30_5000), &[2; 8]).unwrap();
    b.mem.write(Gpa(0x30_7000), &[3; 8]).unwrap();
    let cr3 = b.cr3();
    let mut cache = WalkCache::default();
    let read = |b: &Builder, cache: &mut WalkCache, gva: u64, len: usize| {
        let m = Counting(&b.mem, std::cell::Cell::new(0));
        let mut buf = vec![0u8; len];
        let r = cache.read_virt(&m, cr3, Gva(gva), &mut buf);
        let mut want = vec![0u8; len];
        let w = read_virt(&b.mem, cr3, Gva(gva), &mut want);
        assert_eq!(r.is_ok(), w.is_ok(), "{gva:#x}");
        assert_eq!(buf, want, "{gva:#x}");
        m.1.get()
    };
    // Across the two pages: two walks (4 entries each) and two data reads.
    assert_eq!(read(&b, &mut cache, stack + 0xff8, 16), 10);
    // Again: one entry and one data read per page.
    assert_eq!(read(&b, &mut cache, stack + 0xff8, 16), 4);
    assert_eq!(cache.counts(), (2, 2));
    // The guest points the second page elsewhere: the leaf read sees it.
    b.map(
        stack + 0x1000,
        0x30_7000,
        PageSize::Size4K,
        P | W | PTE_NX,
        P | W,
    );
    assert_eq!(read(&b, &mut cache, stack + 0x1000, 8), 1 + 4 + 1);
    assert_eq!(read(&b, &mut cache, stack + 0x1000, 8), 2);
    // Unmapped: the cached leaf no longer matches and the walk fails.
    let pdpt = b.descend(b.pml4, stack, Level::Pml4, P | W);
    let pd = b.descend(pdpt, stack, Level::Pdpt, P | W);
    let pt_at = b.descend(pd, stack, Level::Pd, P | W);
    b.mem
        .write_u64(Builder::entry_addr(pt_at, stack + 0x1000, Level::Pt), 0)
        .unwrap();
    read(&b, &mut cache, stack + 0x1000, 8);
    // Another address space empties it; a flush too.
    let before = cache.counts().1;
    let m = Counting(&b.mem, std::cell::Cell::new(0));
    let mut buf = [0u8; 8];
    cache
        .read_virt(&m, Cr3(b.pml4), Gva(stack + 0xff8), &mut buf)
        .unwrap();
    cache.flush();
    cache
        .read_virt(&m, Cr3(b.pml4), Gva(stack + 0xff8), &mut buf)
        .unwrap();
    assert_eq!(cache.counts().1, before + 2);
    assert_eq!(buf, [1; 8]);
}
