//! The EPT builder (SDM 29.3 "The extended page table mechanism").
//!
//! Four-level tables of 512 64-bit entries. Leaves map 2 MiB where a range is
//! 2 MiB-aligned and 4 KiB elsewhere. The tables live in frames handed out by a
//! [`TableStore`]: the hypervisor backs it with its own (identity-mapped)
//! memory, the tests with plain vectors.

use crate::addr::{Gpa, Hpa};

/// EPT read permission (bit 0).
pub const READ: u64 = 1 << 0;
/// EPT write permission (bit 1).
pub const WRITE: u64 = 1 << 1;
/// EPT execute permission (bit 2).
pub const EXEC: u64 = 1 << 2;
/// All three.
pub const RWX: u64 = READ | WRITE | EXEC;
const LARGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const MEMTYPE_SHIFT: u32 = 3;

/// EPT memory types (SDM 29.3.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MemType {
    /// Uncacheable: MMIO.
    Uncacheable = 0,
    /// Write-back: RAM.
    WriteBack = 6,
}

/// Storage for page-table frames.
pub trait TableStore {
    /// Hands out a zeroed 4 KiB table and its host-physical address.
    fn alloc_table(&mut self) -> Option<Hpa>;
    /// The table at `hpa`, which `alloc_table` returned earlier.
    fn table(&mut self, hpa: Hpa) -> &mut [u64; 512];
}

/// Errors while building EPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EptError {
    /// The table store is exhausted.
    OutOfTables,
    /// A range was not 4 KiB aligned.
    Unaligned,
    /// The address is beyond the 48-bit guest-physical space.
    TooHigh,
    /// A change every vCPU's view must see, refused: the other vCPUs did
    /// not come to root in time.
    Stalled,
}

impl core::fmt::Display for EptError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::OutOfTables => write!(f, "out of memory for EPT tables"),
            Self::Unaligned => write!(f, "EPT range is not page aligned"),
            Self::TooHigh => write!(f, "EPT address beyond 48 bits"),
            Self::Stalled => write!(f, "the other vCPUs did not come to root in time"),
        }
    }
}

/// A translation found by [`Ept::translate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leaf {
    /// Host-physical address the GPA maps to.
    pub hpa: Hpa,
    /// Permission bits (READ | WRITE | EXEC).
    pub perms: u64,
    /// Memory type.
    pub memtype: u8,
    /// Page size in bytes.
    pub size: u64,
}

/// An EPT hierarchy rooted at one PML4.
#[derive(Debug, Clone, Copy)]
pub struct Ept {
    root: Hpa,
}

const GIB_512: u64 = 1 << 39;
const GIB: u64 = 1 << 30;
const MIB_2: u64 = 1 << 21;
const KIB_4: u64 = 1 << 12;

fn index(gpa: u64, level: u32) -> usize {
    ((gpa >> (12 + 9 * level)) & 0x1ff) as usize
}

/// The entry of table `t` that the walk for `gpa` uses at `level` (3 = PML4
/// .. 0 = PT). Root's own page tables have the same layout.
// In bounds: index() masks to 0..=0x1ff and `t` has 512 entries.
#[allow(clippy::indexing_slicing)]
pub(crate) fn slot(t: &mut [u64; 512], gpa: u64, level: u32) -> &mut u64 {
    &mut t[index(gpa, level)]
}

impl Ept {
    /// Allocates an empty PML4.
    pub fn new(store: &mut impl TableStore) -> Result<Self, EptError> {
        Ok(Self {
            root: store.alloc_table().ok_or(EptError::OutOfTables)?,
        })
    }

    /// The EPT pointer for the VMCS: write-back paging structures, 4-level
    /// walk (SDM 25.6.11).
    pub fn eptp(&self) -> u64 {
        self.root.0 | (3 << 3) | MemType::WriteBack as u64
    }

    /// The table below the level-`level` entry for `gpa` in table `t`,
    /// created on demand.
    fn next(store: &mut impl TableStore, t: Hpa, gpa: u64, level: u32) -> Result<Hpa, EptError> {
        let e = *slot(store.table(t), gpa, level);
        if e & RWX != 0 && e & LARGE == 0 {
            return Ok(Hpa(e & ADDR_MASK));
        }
        let n = store.alloc_table().ok_or(EptError::OutOfTables)?;
        // Non-leaf entries grant everything; leaves decide.
        *slot(store.table(t), gpa, level) = n.0 | RWX;
        Ok(n)
    }

    /// Identity-maps `[start, end)` with `perms` and `memtype`, using 2 MiB
    /// pages where the range allows and 4 KiB pages elsewhere. Existing
    /// mappings in the range are replaced.
    pub fn map_identity(
        &self,
        store: &mut impl TableStore,
        start: Gpa,
        end: Gpa,
        perms: u64,
        memtype: MemType,
        allow_2m: bool,
    ) -> Result<(), EptError> {
        if !start.is_aligned(KIB_4) || !end.is_aligned(KIB_4) {
            return Err(EptError::Unaligned);
        }
        if end.0 > 1 << 48 {
            return Err(EptError::TooHigh);
        }
        let leaf_bits = perms | ((memtype as u64) << MEMTYPE_SHIFT);
        let mut a = start.0;
        while a < end.0 {
            let pdpt = Self::next(store, self.root, a, 3)?;
            let pd = Self::next(store, pdpt, a, 2)?;
            if allow_2m && a.is_multiple_of(MIB_2) && end.0 - a >= MIB_2 {
                *slot(store.table(pd), a, 1) = a | leaf_bits | LARGE;
                a += MIB_2;
            } else {
                let pt = Self::next_split(store, pd, a)?;
                *slot(store.table(pt), a, 0) = a | leaf_bits;
                a += KIB_4;
            }
        }
        Ok(())
    }

    /// Identity-maps `[start, end)`, both 1 GiB-aligned, with 1 GiB leaves
    /// (the CPU must offer them: EPT_VPID_CAP bit 17). Nothing may be
    /// mapped there yet: a later finer mapping inside replaces the leaf.
    pub fn map_identity_gib(
        &self,
        store: &mut impl TableStore,
        start: Gpa,
        end: Gpa,
        perms: u64,
        memtype: MemType,
    ) -> Result<(), EptError> {
        if !start.is_aligned(GIB) || !end.is_aligned(GIB) {
            return Err(EptError::Unaligned);
        }
        if end.0 > 1 << 48 {
            return Err(EptError::TooHigh);
        }
        let leaf_bits = perms | ((memtype as u64) << MEMTYPE_SHIFT) | LARGE;
        let mut a = start.0;
        while a < end.0 {
            let pdpt = Self::next(store, self.root, a, 3)?;
            *slot(store.table(pdpt), a, 2) = a | leaf_bits;
            a += GIB;
        }
        Ok(())
    }

    /// Maps the one 4 KiB page at `gpa` to `hpa` (any frame: a shadow copy,
    /// a hypervisor page shown to the guest) with `perms`, splitting a 2 MiB
    /// leaf if one covers it. `perms` may be execute-only (`EXEC`) where the
    /// CPU supports it. Returns the entry that was there (0 if none).
    pub fn map_page(
        &self,
        store: &mut impl TableStore,
        gpa: Gpa,
        hpa: Hpa,
        perms: u64,
        memtype: MemType,
    ) -> Result<u64, EptError> {
        if !gpa.is_aligned(KIB_4) || !hpa.0.is_multiple_of(KIB_4) {
            return Err(EptError::Unaligned);
        }
        if gpa.0 >= 1 << 48 || hpa.0 >= 1 << 48 {
            return Err(EptError::TooHigh);
        }
        let pdpt = Self::next(store, self.root, gpa.0, 3)?;
        let pd = Self::next(store, pdpt, gpa.0, 2)?;
        let pt = Self::next_split(store, pd, gpa.0)?;
        let slot = slot(store.table(pt), gpa.0, 0);
        let old = *slot;
        *slot = hpa.0 | (perms & RWX) | ((memtype as u64) << MEMTYPE_SHIFT);
        Ok(old)
    }

    /// Puts back `raw`, a 4 KiB leaf entry [`Self::map_page`] returned, at
    /// `gpa`: the undo of that call (its table exists, so nothing is
    /// allocated).
    pub fn restore_page(
        &self,
        store: &mut impl TableStore,
        gpa: Gpa,
        raw: u64,
    ) -> Result<(), EptError> {
        let pt = self
            .table_at(store, gpa.0, 0)
            .ok_or(EptError::OutOfTables)?;
        *slot(store.table(pt), gpa.0, 0) = raw;
        Ok(())
    }

    /// Like [`Self::next`] for the PD entry for `gpa`, but a 2 MiB leaf there
    /// is split into 512 equivalent 4 KiB leaves first.
    fn next_split(store: &mut impl TableStore, pd: Hpa, gpa: u64) -> Result<Hpa, EptError> {
        let e = *slot(store.table(pd), gpa, 1);
        if e & LARGE != 0 && e & RWX != 0 {
            let pt = store.alloc_table().ok_or(EptError::OutOfTables)?;
            let base = e & ADDR_MASK & !(MIB_2 - 1);
            let bits = e & 0x7f;
            let t = store.table(pt);
            for (i, slot) in t.iter_mut().enumerate() {
                *slot = (base + i as u64 * KIB_4) | bits;
            }
            *slot(store.table(pd), gpa, 1) = pt.0 | RWX;
            return Ok(pt);
        }
        Self::next(store, pd, gpa, 1)
    }

    /// Removes every mapping in `[start, end)` (splitting 2 MiB leaves at the edges).
    pub fn unmap(&self, store: &mut impl TableStore, start: Gpa, end: Gpa) -> Result<(), EptError> {
        if !start.is_aligned(KIB_4) || !end.is_aligned(KIB_4) {
            return Err(EptError::Unaligned);
        }
        let mut a = start.0;
        while a < end.0 {
            let Some(pd) = self.table_at(store, a, 1) else {
                a = (a / GIB + 1) * GIB;
                continue;
            };
            let e = *slot(store.table(pd), a, 1);
            if e & RWX == 0 {
                a = (a / MIB_2 + 1) * MIB_2;
            } else if e & LARGE != 0 && a.is_multiple_of(MIB_2) && end.0 - a >= MIB_2 {
                *slot(store.table(pd), a, 1) = 0;
                a += MIB_2;
            } else {
                let pt = Self::next_split(store, pd, a)?;
                *slot(store.table(pt), a, 0) = 0;
                a += KIB_4;
            }
        }
        Ok(())
    }

    /// The table that holds the level-`level` entry for `gpa` (3 = PML4 ..
    /// 0 = PT), if the walk gets there.
    fn table_at(&self, store: &mut impl TableStore, gpa: u64, level: u32) -> Option<Hpa> {
        let mut t = self.root;
        for l in (level + 1..=3).rev() {
            let e = *slot(store.table(t), gpa, l);
            if e & RWX == 0 || e & LARGE != 0 {
                return None;
            }
            t = Hpa(e & ADDR_MASK);
        }
        Some(t)
    }

    /// Walks the tables for `gpa`.
    pub fn translate(&self, store: &mut impl TableStore, gpa: Gpa) -> Option<Leaf> {
        let mut t = self.root;
        for level in (0..=3u32).rev() {
            let e = *slot(store.table(t), gpa.0, level);
            if e & RWX == 0 {
                return None;
            }
            let size = KIB_4 << (9 * level);
            if level == 0 || e & LARGE != 0 {
                let base = e & ADDR_MASK & !(size - 1);
                return Some(Leaf {
                    hpa: Hpa(base + (gpa.0 & (size - 1))),
                    perms: e & RWX,
                    memtype: ((e >> MEMTYPE_SHIFT) & 7) as u8,
                    size,
                });
            }
            t = Hpa(e & ADDR_MASK);
        }
        None
    }
}

/// The most guest-physical space mapped with 1 GiB pages above
/// [`identity_limit`]: 8 TiB (16 tables), whatever the CPU's width.
pub const BEYOND_CAP: u64 = 1 << 43;

/// The guest-physical range above `limit` that nothing backs but that the
/// guest can still address (up to its physical-address width, at most
/// [`BEYOND_CAP`]), for 1 GiB identity pages: there the guest finds no
/// device, as on the bare machine (loads read all-ones, stores go
/// nowhere), instead of an EPT violation root cannot serve. `None` when
/// nothing is left.
pub fn beyond_limit(limit: u64, phys_bits: u8) -> Option<(u64, u64)> {
    let width = 1u64 << u32::from(phys_bits.clamp(32, 48));
    let end = width.min(BEYOND_CAP);
    let start = limit.div_ceil(GIB) * GIB;
    (start < end).then_some((start, end))
}

/// Upper bound of guest-physical space we map for a given top of RAM: at
/// least 4 GiB so that the MMIO hole below 4 GiB (LAPIC, IOAPIC, HPET, PCI
/// BARs) is covered, rounded up to 1 GiB.
pub fn identity_limit(ram_top: u64) -> u64 {
    let top = ram_top.max(4 * GIB);
    top.div_ceil(GIB) * GIB
}

const _: () = assert!(GIB_512 == 1 << 39);

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Tables in a vector; "physical" addresses are (index + 1) * 4 KiB;
    /// at most 4,096 of them. The other modules' EPT tests use it too.
    #[derive(Default)]
    pub(crate) struct VecStore(Vec<Box<[u64; 512]>>);

    impl TableStore for VecStore {
        fn alloc_table(&mut self) -> Option<Hpa> {
            if self.0.len() >= 4096 {
                return None;
            }
            self.0.push(Box::new([0; 512]));
            Some(Hpa(self.0.len() as u64 * 4096))
        }
        fn table(&mut self, hpa: Hpa) -> &mut [u64; 512] {
            &mut self.0[(hpa.0 / 4096 - 1) as usize]
        }
    }

    #[test]
    fn single_pages_point_anywhere_with_any_permissions() {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        ept.map_identity(&mut s, Gpa(0), Gpa(64 << 20), RWX, MemType::WriteBack, true)
            .unwrap();
        // A code page executes from a shadow frame, execute-only.
        let code = Gpa(0x340_5000);
        let old = ept
            .map_page(&mut s, code, Hpa(0x30_0000), EXEC, MemType::WriteBack)
            .unwrap();
        assert_eq!(old & RWX, RWX, "the split kept the identity leaf");
        assert_eq!(old & ADDR_MASK, code.0);
        let l = ept.translate(&mut s, Gpa(code.0 + 0x123)).unwrap();
        assert_eq!((l.hpa, l.perms, l.size), (Hpa(0x30_0123), EXEC, KIB_4));
        // Its neighbours in the split 2 MiB page are still identity RWX.
        for n in [code.0 - 0x1000, code.0 + 0x1000, 0x340_0000, 0x35f_f000] {
            let l = ept.translate(&mut s, Gpa(n)).unwrap();
            assert_eq!((l.hpa, l.perms, l.size), (Hpa(n), RWX, KIB_4));
            assert_eq!(l.memtype, MemType::WriteBack as u8);
        }
        // Back to the identity page.
        let old = ept
            .map_page(&mut s, code, Hpa(code.0), RWX, MemType::WriteBack)
            .unwrap();
        assert_eq!((old & ADDR_MASK, old & RWX), (0x30_0000, EXEC));
        assert_eq!(ept.translate(&mut s, code).unwrap().hpa, Hpa(code.0));
        // A page inside an absent range (the hypervisor's) can be shown alone.
        ept.unmap(&mut s, Gpa(2 << 20), Gpa(32 << 20)).unwrap();
        assert_eq!(
            ept.map_page(
                &mut s,
                Gpa(0x40_0000),
                Hpa(0x40_0000),
                READ,
                MemType::WriteBack
            )
            .unwrap(),
            0
        );
        assert_eq!(ept.translate(&mut s, Gpa(0x40_0000)).unwrap().perms, READ);
        assert!(ept.translate(&mut s, Gpa(0x40_1000)).is_none());
        assert!(ept.translate(&mut s, Gpa(0x3f_f000)).is_none());
        assert_eq!(
            ept.map_page(&mut s, Gpa(0x1001), Hpa(0), READ, MemType::WriteBack),
            Err(EptError::Unaligned)
        );
    }

    #[test]
    fn a_mapped_page_can_be_put_back_as_it_was() {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        ept.map_identity(&mut s, Gpa(0), Gpa(4 << 20), RWX, MemType::WriteBack, true)
            .unwrap();
        let page = Gpa(0x20_3000);
        let old = ept
            .map_page(&mut s, page, Hpa(0x9000_0000), EXEC, MemType::WriteBack)
            .unwrap();
        assert_eq!(ept.translate(&mut s, page).unwrap().hpa, Hpa(0x9000_0000));
        ept.restore_page(&mut s, page, old).unwrap();
        let l = ept.translate(&mut s, page).unwrap();
        assert_eq!((l.hpa, l.perms, l.size), (Hpa(page.0), RWX, 4096));
        // A page under a 2 MiB leaf has no table to put an entry back in.
        assert_eq!(
            ept.restore_page(&mut s, Gpa(0x1000), 0),
            Err(EptError::OutOfTables)
        );
    }

    #[test]
    fn identity_map_with_a_hole() {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        // RAM 0..512 MiB with the hypervisor at [2 MiB, 32 MiB) absent.
        ept.map_identity(&mut s, Gpa(0), Gpa(2 << 20), RWX, MemType::WriteBack, true)
            .unwrap();
        ept.map_identity(
            &mut s,
            Gpa(32 << 20),
            Gpa(512 << 20),
            RWX,
            MemType::WriteBack,
            true,
        )
        .unwrap();
        ept.map_identity(
            &mut s,
            Gpa(0xfec0_0000),
            Gpa(0x1_0000_0000),
            RWX,
            MemType::Uncacheable,
            true,
        )
        .unwrap();
        for gpa in [
            0u64,
            0x7000,
            0x1f_ffff,
            0x200_0000,
            0x1234_5678,
            0x1fff_ffff,
        ] {
            let l = ept
                .translate(&mut s, Gpa(gpa))
                .unwrap_or_else(|| panic!("{gpa:#x} unmapped"));
            assert_eq!(l.hpa, Hpa(gpa));
            assert_eq!(l.perms, RWX);
            assert_eq!(l.memtype, 6);
            assert_eq!(l.size, 2 << 20);
        }
        for gpa in [
            0x20_0000u64,
            0x100_0000,
            0x1ff_ffff,
            0x2000_0000,
            0xfebf_ffff,
        ] {
            assert_eq!(
                ept.translate(&mut s, Gpa(gpa)),
                None,
                "{gpa:#x} must be absent"
            );
        }
        let l = ept.translate(&mut s, Gpa(0xfee0_0030)).unwrap();
        assert_eq!((l.hpa, l.memtype), (Hpa(0xfee0_0030), 0));
        // Few tables: PML4, one PDPT, PDs for 0 GiB and 3 GiB.
        assert_eq!(s.0.len(), 4);
        let eptp = ept.eptp();
        assert_eq!(eptp & 0xfff, 0x1e);
    }

    #[test]
    fn unaligned_ranges_use_small_pages_and_unmap_splits() {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        ept.map_identity(
            &mut s,
            Gpa(0x1000),
            Gpa(0x40_3000),
            RWX,
            MemType::WriteBack,
            true,
        )
        .unwrap();
        assert_eq!(ept.translate(&mut s, Gpa(0)), None);
        assert_eq!(ept.translate(&mut s, Gpa(0x1000)).unwrap().size, 4096);
        assert_eq!(ept.translate(&mut s, Gpa(0x20_0000)).unwrap().size, 2 << 20);
        assert_eq!(
            ept.translate(&mut s, Gpa(0x40_2fff)).unwrap().hpa,
            Hpa(0x40_2fff)
        );
        assert_eq!(ept.translate(&mut s, Gpa(0x40_3000)), None);
        // Punch one page out of the 2 MiB leaf: the neighbours survive.
        ept.unmap(&mut s, Gpa(0x30_0000), Gpa(0x30_1000)).unwrap();
        assert_eq!(ept.translate(&mut s, Gpa(0x30_0000)), None);
        let n = ept.translate(&mut s, Gpa(0x30_1000)).unwrap();
        assert_eq!((n.hpa, n.size, n.perms), (Hpa(0x30_1000), 4096, RWX));
        assert_eq!(
            ept.translate(&mut s, Gpa(0x2f_f000)).unwrap().hpa,
            Hpa(0x2f_f000)
        );
        assert_eq!(
            ept.map_identity(&mut s, Gpa(1), Gpa(0x1000), RWX, MemType::WriteBack, true),
            Err(EptError::Unaligned)
        );
    }

    #[test]
    fn exhausted_store_is_an_error() {
        struct Tiny(Vec<Box<[u64; 512]>>);
        impl TableStore for Tiny {
            fn alloc_table(&mut self) -> Option<Hpa> {
                if self.0.len() == 2 {
                    return None;
                }
                self.0.push(Box::new([0; 512]));
                Some(Hpa(self.0.len() as u64 * 4096))
            }
            fn table(&mut self, hpa: Hpa) -> &mut [u64; 512] {
                &mut self.0[(hpa.0 / 4096 - 1) as usize]
            }
        }
        let mut s = Tiny(Vec::new());
        let ept = Ept::new(&mut s).unwrap();
        assert_eq!(
            ept.map_identity(&mut s, Gpa(0), Gpa(1 << 30), RWX, MemType::WriteBack, true),
            Err(EptError::OutOfTables)
        );
    }

    /// Found by the fuzzing guest (seed 1): an instruction fetch from
    /// 0x1_027F_D720, above 4 GiB where the guest has no RAM, was an EPT
    /// violation root could not serve, and root stopped the VM; the bare
    /// machine reads all-ones there (and the fetch is a #UD).
    #[test]
    fn the_space_beyond_ram_is_mapped_with_gib_pages() {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        let limit = identity_limit(256 << 20);
        ept.map_identity(&mut s, Gpa(0), Gpa(limit), RWX, MemType::Uncacheable, true)
            .unwrap();
        let before = s.0.len();
        let (start, end) = beyond_limit(limit, 39).unwrap();
        assert_eq!((start, end), (4 << 30, 1 << 39));
        ept.map_identity_gib(&mut s, Gpa(start), Gpa(end), RWX, MemType::Uncacheable)
            .unwrap();
        // One PDPT's worth of 1 GiB leaves: no new table at all here.
        assert_eq!(s.0.len(), before);
        let leaf = ept.translate(&mut s, Gpa(0x1_027F_D720)).unwrap();
        assert_eq!(leaf.hpa, Hpa(0x1_027F_D720));
        assert_eq!(leaf.perms, RWX);
        assert_eq!(leaf.memtype, MemType::Uncacheable as u8);
        assert_eq!(leaf.size, 1 << 30);
        assert!(ept.translate(&mut s, Gpa((1 << 39) - 1)).is_some());
        assert!(ept.translate(&mut s, Gpa(1 << 39)).is_none());
        // RAM below is untouched.
        assert_eq!(ept.translate(&mut s, Gpa(0x40_0000)).unwrap().size, 2 << 20);
        // Wider CPUs: capped; nothing left when RAM reaches the cap.
        assert_eq!(beyond_limit(limit, 46), Some((4 << 30, BEYOND_CAP)));
        assert_eq!(beyond_limit(BEYOND_CAP, 46), None);
        assert_eq!(
            ept.map_identity_gib(
                &mut s,
                Gpa(1 << 20),
                Gpa(1 << 30),
                RWX,
                MemType::Uncacheable
            ),
            Err(EptError::Unaligned)
        );
    }

    #[test]
    fn limit_covers_the_mmio_hole() {
        assert_eq!(identity_limit(512 << 20), 4 << 30);
        assert_eq!(identity_limit((6 << 30) + 1), 7 << 30);
    }
}
