//! The guest's own 4-level page tables, walked in software.
//!
//! SDM Vol. 3A 4.5 "4-Level Paging and 5-Level Paging": CR3 points at the
//! PML4; bits 47..39, 38..30, 29..21 and 20..12 of the linear address index
//! the PML4, PDPT, PD and PT. A PDPT entry with PS=1 maps a 1 GiB page, a PD
//! entry with PS=1 a 2 MiB page. Access rights are the AND of R/W and U/S
//! over the levels; execute-disable is the OR of XD (with IA32_EFER.NXE=1,
//! which every x86-64 Linux kernel sets).
//!
//! 5-level paging (CR4.LA57) is not handled: the caller must not pass a CR3
//! that roots a PML5.

use core::fmt;

use crate::addr::{Gpa, Gva};
use crate::mem::{GuestMemory, MemError};

/// The guest's CR3 as read from the VMCS. Bits 11..0 (PCID or PWT/PCD) and
/// bit 63 are ignored.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Cr3(pub u64);

impl Cr3 {
    /// The guest-physical address of the PML4 (bits 51..12).
    #[inline]
    pub const fn pml4(self) -> Gpa {
        Gpa(self.0 & ADDR_MASK)
    }

    /// With page-table isolation (PTI), a task has two PGDs in one 8 KiB
    /// block: the kernel's, and at +4 KiB the user one, which maps no kernel
    /// text or rodata (arch/x86/include/asm/pgtable.h, `PTI_PGTABLE_SWITCH_BIT`
    /// = 12). A CR3 read while the guest runs user code (or early in the
    /// entry code) is the user one; this is the kernel one. Only meaningful
    /// when bit 12 is set and PTI is on: try it when a search through the
    /// CR3 as read fails.
    #[inline]
    pub const fn pti_kernel(self) -> Self {
        Self(self.0 & !(1 << 12))
    }
}

impl fmt::Debug for Cr3 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cr3({:#x})", self.0)
    }
}

/// Bits 51..12 of a paging-structure entry: the next table or the 4 KiB frame.
pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// P: the entry maps something.
pub const PTE_PRESENT: u64 = 1 << 0;
/// R/W: writes allowed (at every level).
pub const PTE_WRITABLE: u64 = 1 << 1;
/// U/S: user-mode accesses allowed (at every level).
pub const PTE_USER: u64 = 1 << 2;
/// PS: in a PDPT or PD entry, the entry maps a 1 GiB or 2 MiB page.
pub const PTE_LARGE: u64 = 1 << 7;
/// XD: instruction fetches not allowed (when IA32_EFER.NXE = 1).
pub const PTE_NX: u64 = 1 << 63;

/// A level of the 4-level hierarchy, named after the table it indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Level {
    /// Page-map level 4: bits 47..39, 512 GiB per entry.
    Pml4,
    /// Page-directory-pointer table: bits 38..30, 1 GiB per entry.
    Pdpt,
    /// Page directory: bits 29..21, 2 MiB per entry.
    Pd,
    /// Page table: bits 20..12, 4 KiB per entry.
    Pt,
}

impl Level {
    /// Shift of the index bits for this level.
    #[inline]
    pub const fn shift(self) -> u32 {
        match self {
            Self::Pml4 => 39,
            Self::Pdpt => 30,
            Self::Pd => 21,
            Self::Pt => 12,
        }
    }

    /// The span of linear addresses one entry of this level covers.
    #[inline]
    pub const fn entry_span(self) -> u64 {
        1 << self.shift()
    }
}

/// Size of the page a translation ended in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageSize {
    /// A 4 KiB page, mapped by a PT entry.
    Size4K,
    /// A 2 MiB page, mapped by a PD entry with PS=1.
    Size2M,
    /// A 1 GiB page, mapped by a PDPT entry with PS=1.
    Size1G,
}

impl PageSize {
    /// Size in bytes.
    #[inline]
    pub const fn bytes(self) -> u64 {
        match self {
            Self::Size4K => 1 << 12,
            Self::Size2M => 1 << 21,
            Self::Size1G => 1 << 30,
        }
    }
}

/// A successful translation of one linear address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    /// The guest-physical address of the byte translated.
    pub gpa: Gpa,
    /// Size of the page it is in.
    pub size: PageSize,
    /// Writable at every level.
    pub writable: bool,
    /// User-accessible at every level.
    pub user: bool,
    /// Execute-disable at some level.
    pub nx: bool,
    /// The leaf entry as read.
    pub leaf: u64,
}

impl Translation {
    /// Bytes from the translated address to the end of its page.
    #[inline]
    pub const fn bytes_to_page_end(&self) -> u64 {
        self.size.bytes() - (self.gpa.0 & (self.size.bytes() - 1))
    }
}

/// Why a walk failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalkError {
    /// The address is not canonical (bits 63..47 differ).
    NonCanonical {
        /// The address asked for.
        gva: Gva,
    },
    /// The entry at `level` has P=0.
    NotPresent {
        /// The address asked for.
        gva: Gva,
        /// The table whose entry is not present.
        level: Level,
    },
    /// The entry at `level` sets a bit that must be zero (PS in a PML4E).
    Reserved {
        /// The address asked for.
        gva: Gva,
        /// The table whose entry is malformed.
        level: Level,
    },
    /// A paging structure or the data itself could not be read.
    Phys {
        /// The address asked for.
        gva: Gva,
        /// The physical-memory error.
        err: MemError,
    },
}

impl WalkError {
    /// The linear address whose translation failed.
    pub const fn gva(&self) -> Gva {
        match *self {
            Self::NonCanonical { gva }
            | Self::NotPresent { gva, .. }
            | Self::Reserved { gva, .. }
            | Self::Phys { gva, .. } => gva,
        }
    }

    /// For a hole in the address space, the first address after it that
    /// could be mapped: the end of the non-present entry's span, or the start
    /// of the upper canonical half. `None` for other errors or at the top.
    pub fn resume_at(&self) -> Option<Gva> {
        match *self {
            Self::NotPresent { gva, level } => {
                let span = level.entry_span();
                (gva.0 | (span - 1)).checked_add(1).map(Gva)
            }
            Self::NonCanonical { gva } if gva.0 < 0xffff_8000_0000_0000 => {
                Some(Gva(0xffff_8000_0000_0000))
            }
            _ => None,
        }
    }
}

impl fmt::Display for WalkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::NonCanonical { gva } => write!(f, "{gva} is not canonical"),
            Self::NotPresent { gva, level } => {
                write!(f, "{gva} is not mapped ({level:?} entry not present)")
            }
            Self::Reserved { gva, level } => {
                write!(f, "{gva}: reserved bit set in its {level:?} entry")
            }
            Self::Phys { gva, err } => write!(f, "{gva}: {err}"),
        }
    }
}

/// Reads the entry of `table` that indexes `gva` at `level`, checks P, and
/// folds its access bits into `acc`.
fn entry<M: GuestMemory + ?Sized>(
    mem: &M,
    table: Gpa,
    gva: Gva,
    level: Level,
    acc: &mut (bool, bool, bool),
) -> Result<u64, WalkError> {
    let index = (gva.0 >> level.shift()) & 0x1ff;
    // Cannot overflow: a table address has at most 52 bits.
    let entry = mem
        .read_u64(Gpa(table.0 + index * 8))
        .map_err(|err| WalkError::Phys { gva, err })?;
    if entry & PTE_PRESENT == 0 {
        return Err(WalkError::NotPresent { gva, level });
    }
    acc.0 &= entry & PTE_WRITABLE != 0;
    acc.1 &= entry & PTE_USER != 0;
    acc.2 |= entry & PTE_NX != 0;
    Ok(entry)
}

/// Translates `gva` through the tables rooted at `cr3`.
pub fn translate<M: GuestMemory + ?Sized>(
    mem: &M,
    cr3: Cr3,
    gva: Gva,
) -> Result<Translation, WalkError> {
    walk(mem, cr3, gva).map(|(t, _)| t)
}

/// [`translate`], and where the leaf entry is.
fn walk<M: GuestMemory + ?Sized>(
    mem: &M,
    cr3: Cr3,
    gva: Gva,
) -> Result<(Translation, Gpa), WalkError> {
    if !gva.is_canonical() {
        return Err(WalkError::NonCanonical { gva });
    }
    // (writable, user, nx), accumulated over the levels.
    let mut acc = (true, true, false);
    let leaf = |entry: u64, size: PageSize, acc: (bool, bool, bool)| {
        // In a large-page entry bit 12 is PAT and the frame is aligned to the
        // page size: keep bits 51..log2(size).
        let frame = entry & ADDR_MASK & !(size.bytes() - 1);
        let gpa = Gpa(frame | (gva.0 & (size.bytes() - 1)));
        Translation {
            gpa,
            size,
            writable: acc.0,
            user: acc.1,
            nx: acc.2,
            leaf: entry,
        }
    };
    let at = |table: u64, level: Level| {
        Gpa((table & ADDR_MASK) + ((gva.0 >> level.shift()) & 0x1ff) * 8)
    };
    let pml4e = entry(mem, cr3.pml4(), gva, Level::Pml4, &mut acc)?;
    if pml4e & PTE_LARGE != 0 {
        return Err(WalkError::Reserved {
            gva,
            level: Level::Pml4,
        });
    }
    let pdpte = entry(mem, Gpa(pml4e & ADDR_MASK), gva, Level::Pdpt, &mut acc)?;
    if pdpte & PTE_LARGE != 0 {
        return Ok((leaf(pdpte, PageSize::Size1G, acc), at(pml4e, Level::Pdpt)));
    }
    let pde = entry(mem, Gpa(pdpte & ADDR_MASK), gva, Level::Pd, &mut acc)?;
    if pde & PTE_LARGE != 0 {
        return Ok((leaf(pde, PageSize::Size2M, acc), at(pdpte, Level::Pd)));
    }
    let pte = entry(mem, Gpa(pde & ADDR_MASK), gva, Level::Pt, &mut acc)?;
    Ok((leaf(pte, PageSize::Size4K, acc), at(pde, Level::Pt)))
}

/// Translations kept by a [`WalkCache`].
pub const WALK_CACHE_SLOTS: usize = 4;

/// The last few translations of one address space, for **reads** of guest
/// data on a hot path (never for writes: a write must see the tables as
/// they are).
///
/// Each use reads the cached leaf entry again from guest memory and takes
/// the translation only if it is unchanged: one 8-byte read instead of a
/// walk's four. What it cannot see is a change above the leaf (a PDE
/// pointed at another table); its owner flushes it on every turn of the
/// run loop, which bounds how long such a change goes unseen, and a CR3
/// other than the cached one empties it. A stale translation still reads
/// guest RAM through the same [`GuestMemory`]: it can mislead the trace of
/// a guest that rewrites its tables under a hot page, nothing else.
#[derive(Clone, Debug, Default)]
pub struct WalkCache {
    cr3: u64,
    slots: [Option<CachedLeaf>; WALK_CACHE_SLOTS],
    next: usize,
    /// Uses served from the cache, and walks.
    hits: u64,
    walks: u64,
}

#[derive(Clone, Copy, Debug)]
struct CachedLeaf {
    /// The page's first address and size.
    base: u64,
    size: PageSize,
    /// Where the leaf entry is, and what it held.
    leaf_at: Gpa,
    leaf: u64,
}

impl WalkCache {
    /// Forgets every translation.
    pub fn flush(&mut self) {
        self.slots = [None; WALK_CACHE_SLOTS];
    }

    /// (uses served from the cache, walks) since it was made.
    pub fn counts(&self) -> (u64, u64) {
        (self.hits, self.walks)
    }

    /// Where `gva` is, and the bytes from there to its page's end.
    pub fn translate<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        cr3: Cr3,
        gva: Gva,
    ) -> Result<(Gpa, u64), WalkError> {
        if self.cr3 != cr3.0 {
            self.flush();
            self.cr3 = cr3.0;
        }
        for slot in &mut self.slots {
            let Some(c) = *slot else { continue };
            let span = c.size.bytes();
            if gva.0 & !(span - 1) != c.base {
                continue;
            }
            if mem.read_u64(c.leaf_at).ok() == Some(c.leaf) {
                self.hits += 1;
                let frame = c.leaf & ADDR_MASK & !(span - 1);
                let off = gva.0 & (span - 1);
                return Ok((Gpa(frame | off), span - off));
            }
            *slot = None;
        }
        self.walks += 1;
        let (t, leaf_at) = walk(mem, cr3, gva)?;
        let size = t.size;
        if let Some(slot) = self.slots.get_mut(self.next % WALK_CACHE_SLOTS) {
            *slot = Some(CachedLeaf {
                base: gva.0 & !(size.bytes() - 1),
                size,
                leaf_at,
                leaf: t.leaf,
            });
        }
        self.next = self.next.wrapping_add(1);
        Ok((t.gpa, t.bytes_to_page_end()))
    }

    /// [`read_virt`] through the cache.
    pub fn read_virt<M: GuestMemory + ?Sized>(
        &mut self,
        mem: &M,
        cr3: Cr3,
        gva: Gva,
        buf: &mut [u8],
    ) -> Result<(), WalkError> {
        read_pages(mem, gva, buf, |at| self.translate(mem, cr3, at))
    }
}

/// Why the kernel's own top-level table could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootError {
    /// The table's address does not translate through the CR3 given.
    Walk(WalkError),
    /// The table is not page aligned where it translates to.
    Unaligned(Gpa),
    /// The candidate table does not map the kernel the way the CR3 does
    /// (it maps `probe` elsewhere, or not at all): not the kernel's PGD.
    Mismatch {
        /// The address both walks were asked for.
        probe: Gva,
    },
}

/// The kernel's own top-level page table (x86-64 `init_top_pgt`, which
/// `swapper_pg_dir` names), found from its virtual address `pgd` through
/// any CR3 whose kernel half is live (`via`), and checked: walking `probes`
/// (kernel addresses, e.g. the table itself and `_text`) through it must
/// give the same physical addresses as through `via`.
///
/// The kernel half of every address space points at the same lower tables,
/// but a task's PGD is freed when the task exits; this one lives as long as
/// the kernel, so walks that must stay valid for the VM's life use it.
pub fn kernel_root<M: GuestMemory + ?Sized>(
    mem: &M,
    via: Cr3,
    pgd: Gva,
    probes: &[Gva],
) -> Result<Cr3, RootError> {
    let t = translate(mem, via, pgd).map_err(RootError::Walk)?;
    if t.gpa.0 & 0xfff != 0 {
        return Err(RootError::Unaligned(t.gpa));
    }
    let root = Cr3(t.gpa.0);
    for &probe in core::iter::once(&pgd).chain(probes) {
        let a = translate(mem, via, probe).map(|t| t.gpa);
        let b = translate(mem, root, probe).map(|t| t.gpa);
        match (a, b) {
            (Ok(a), Ok(b)) if a == b => {}
            _ => return Err(RootError::Mismatch { probe }),
        }
    }
    Ok(root)
}

/// Reads `buf.len()` bytes of guest-virtual memory at `gva`, translating
/// every page crossed. Fails (never panics) on the first unmapped byte; the
/// error names that byte's address. On error `buf` is partly filled.
pub fn read_virt<M: GuestMemory + ?Sized>(
    mem: &M,
    cr3: Cr3,
    gva: Gva,
    buf: &mut [u8],
) -> Result<(), WalkError> {
    read_pages(mem, gva, buf, |at| {
        translate(mem, cr3, at).map(|t| (t.gpa, t.bytes_to_page_end()))
    })
}

/// Reads `buf` from `gva` page by page, each piece where `translate` says
/// (its guest-physical address and the bytes left in its page).
#[inline(always)]
fn read_pages<M: GuestMemory + ?Sized>(
    mem: &M,
    gva: Gva,
    buf: &mut [u8],
    mut translate: impl FnMut(Gva) -> Result<(Gpa, u64), WalkError>,
) -> Result<(), WalkError> {
    let mut done = 0usize;
    while done < buf.len() {
        let at = gva
            .checked_add(done as u64)
            .ok_or(WalkError::NonCanonical { gva: Gva(u64::MAX) })?;
        let (gpa, room) = translate(at)?;
        let chunk = core::cmp::min((buf.len() - done) as u64, room) as usize;
        let phys = |err| WalkError::Phys { gva: at, err };
        // `chunk` fits what is left of `buf`: this error is never returned.
        let short = phys(MemError::OutOfRange { gpa, len: chunk });
        let out = buf.get_mut(done..done + chunk).ok_or(short)?;
        mem.read_phys(gpa, out).map_err(phys)?;
        done += chunk;
    }
    Ok(())
}
