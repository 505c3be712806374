//! Root's own page tables: the boot stub's identity map with one 4 KiB page
//! taken out, the guard page under root's stack.
//!
//! The boot stub maps the first 4 GiB with 2 MiB pages. Root's stack sits
//! in the image's bss right above the boot page tables, so an overflow
//! would silently run through them. [`unmap_guard_page`] builds a copy of
//! the path from CR3 to the guard page's 2 MiB mapping, splits that one
//! mapping into 512 4 KiB entries ([`split_large_page`]) with the guard's
//! entry not present, and returns the new CR3: every other translation,
//! with its attributes, is the boot stub's. An overflow then faults on the
//! guard; the #PF cannot be delivered on that stack, so the CPU raises #DF,
//! which root takes on an IST stack of its own and reports.
//!
//! Only the new path is written; the boot tables are read and left as they
//! are (the untouched page directories stay shared).

use crate::addr::Hpa;
use crate::ept::{slot, TableStore};

/// Present.
pub const PRESENT: u64 = 1 << 0;
/// Writable.
pub const WRITABLE: u64 = 1 << 1;
/// User accessible.
pub const USER: u64 = 1 << 2;
/// Accessed.
pub const ACCESSED: u64 = 1 << 5;
/// In a PDE or PDPTE: the entry maps a large page.
pub const LARGE: u64 = 1 << 7;
/// In a 4 KiB PTE: the PAT bit (bit 7, where a PDE has `LARGE`).
pub const PTE_PAT: u64 = 1 << 7;
/// In a large-page entry: the PAT bit.
pub const LARGE_PAT: u64 = 1 << 12;
/// Physical address bits of an entry (bits 12..=51).
pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// Physical address bits of a 2 MiB mapping (bits 21..=51).
pub const LARGE_ADDR_MASK: u64 = 0x000f_ffff_ffe0_0000;

const PAGE: u64 = 4096;
const LARGE_PAGE: u64 = 2 << 20;

/// Why the guard page could not be taken out of the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardError {
    /// The guard address is not 4 KiB aligned or not canonical-low.
    BadGuard(u64),
    /// The entry on the way (level 4 = PML4 ... 2 = PD) is not present.
    NotMapped { level: u8, entry: u64 },
    /// A 1 GiB page maps the guard (the boot stub uses none).
    HugePage(u64),
    /// The 2 MiB entry does not contain the guard.
    OutsideLargePage { pde: u64, guard: u64 },
    /// Reading an existing table failed.
    Unreadable(u64),
    /// No frame for a new table.
    OutOfTables,
}

impl core::fmt::Display for GuardError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::BadGuard(a) => write!(f, "guard page address {a:#x} is not a 4 KiB page"),
            Self::NotMapped { level, entry } => {
                write!(
                    f,
                    "level-{level} entry {entry:#x} on the way to the guard page is not present"
                )
            }
            Self::HugePage(e) => write!(f, "a 1 GiB page ({e:#x}) maps the guard page"),
            Self::OutsideLargePage { pde, guard } => {
                write!(
                    f,
                    "2 MiB entry {pde:#x} does not map the guard page {guard:#x}"
                )
            }
            Self::Unreadable(a) => write!(f, "page table at {a:#x} cannot be read"),
            Self::OutOfTables => write!(f, "no frame left for root's page tables"),
        }
    }
}

/// The table indices of `addr`: PML4, PDPT, PD, PT.
pub fn indices(addr: u64) -> [usize; 4] {
    [39, 30, 21, 12].map(|shift| ((addr >> shift) & 0x1ff) as usize)
}

/// The 512 4 KiB entries that map what the 2 MiB entry `pde` maps, with the
/// same attributes (PAT moved from bit 12 to bit 7), except that the entry
/// of `guard` is not present.
pub fn split_large_page(pde: u64, guard: u64) -> Result<[u64; 512], GuardError> {
    if pde & PRESENT == 0 {
        return Err(GuardError::NotMapped {
            level: 2,
            entry: pde,
        });
    }
    if !guard.is_multiple_of(PAGE) {
        return Err(GuardError::BadGuard(guard));
    }
    let base = pde & LARGE_ADDR_MASK;
    if pde & LARGE == 0 || guard < base || guard - base >= LARGE_PAGE {
        return Err(GuardError::OutsideLargePage { pde, guard });
    }
    // Everything but the address, the large bit and the large PAT bit
    // (bits 0..=6, 8..=11 and 52..=63) carries over as it is.
    let mut flags = pde & !(ADDR_MASK | LARGE);
    if pde & LARGE_PAT != 0 {
        flags |= PTE_PAT;
    }
    let mut table = [0u64; 512];
    for (i, e) in table.iter_mut().enumerate() {
        let page = base + i as u64 * PAGE;
        *e = if page == guard { 0 } else { page | flags };
    }
    Ok(table)
}

/// Builds a copy of the hierarchy at `cr3` in which the 4 KiB page at
/// `guard` is not present, and returns the CR3 value that loads it (with
/// `cr3`'s own low flag bits).
///
/// `read(pa)` reads the 8-byte entry at physical address `pa` of the
/// current tables; new tables come from `store`. The PML4, the PDPT and the
/// PD on the guard's path are copied with one entry each pointing at the
/// next new table; the 2 MiB mapping of the guard becomes a page table. If
/// the guard is already mapped by a page table, that table is copied with
/// the guard's entry cleared.
pub fn unmap_guard_page<S: TableStore>(
    store: &mut S,
    read: impl Fn(u64) -> Option<u64>,
    cr3: u64,
    guard: u64,
) -> Result<u64, GuardError> {
    if !guard.is_multiple_of(PAGE) || guard >> 47 != 0 {
        return Err(GuardError::BadGuard(guard));
    }
    let copy = |store: &mut S, from: u64| -> Result<Hpa, GuardError> {
        let to = store.alloc_table().ok_or(GuardError::OutOfTables)?;
        for (i, e) in (0u64..).zip(store.table(to).iter_mut()) {
            *e = read(from + i * 8).ok_or(GuardError::Unreadable(from))?;
        }
        Ok(to)
    };
    let pml4 = copy(store, cr3 & ADDR_MASK)?;
    let e4 = *slot(store.table(pml4), guard, 3);
    if e4 & PRESENT == 0 {
        return Err(GuardError::NotMapped {
            level: 4,
            entry: e4,
        });
    }
    let pdpt = copy(store, e4 & ADDR_MASK)?;
    let e3 = *slot(store.table(pdpt), guard, 2);
    if e3 & PRESENT == 0 {
        return Err(GuardError::NotMapped {
            level: 3,
            entry: e3,
        });
    }
    if e3 & LARGE != 0 {
        return Err(GuardError::HugePage(e3));
    }
    let pd = copy(store, e3 & ADDR_MASK)?;
    let e2 = *slot(store.table(pd), guard, 1);
    if e2 & PRESENT == 0 {
        return Err(GuardError::NotMapped {
            level: 2,
            entry: e2,
        });
    }
    let pde = if e2 & LARGE != 0 {
        let entries = split_large_page(e2, guard)?;
        let pt = store.alloc_table().ok_or(GuardError::OutOfTables)?;
        *store.table(pt) = entries;
        // A table pointer keeps the access rights of the large page; its
        // caching bits would only apply to reading the table itself.
        pt.0 | (e2 & (PRESENT | WRITABLE | USER | ACCESSED))
    } else {
        let pt = copy(store, e2 & ADDR_MASK)?;
        *slot(store.table(pt), guard, 0) = 0;
        (e2 & !ADDR_MASK) | pt.0
    };
    *slot(store.table(pd), guard, 1) = pde;
    *slot(store.table(pdpt), guard, 2) = (e3 & !ADDR_MASK) | pd.0;
    *slot(store.table(pml4), guard, 3) = (e4 & !ADDR_MASK) | pdpt.0;
    Ok(pml4.0 | (cr3 & !ADDR_MASK))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Physical memory holding page tables: frames by address.
    #[derive(Default)]
    struct Mem {
        frames: BTreeMap<u64, Box<[u64; 512]>>,
        next: u64,
    }

    impl Mem {
        fn read(&self, pa: u64) -> Option<u64> {
            self.frames
                .get(&(pa & !0xfff))
                .map(|t| t[((pa & 0xfff) / 8) as usize])
        }
    }

    impl TableStore for Mem {
        fn alloc_table(&mut self) -> Option<Hpa> {
            if self.frames.len() >= 64 {
                return None;
            }
            self.next += PAGE;
            self.frames.insert(self.next, Box::new([0; 512]));
            Some(Hpa(self.next))
        }
        fn table(&mut self, hpa: Hpa) -> &mut [u64; 512] {
            self.frames.get_mut(&hpa.0).expect("a table of the store")
        }
    }

    /// What the boot stub builds: PML4[0] -> PDPT, PDPT[0..4] -> 4 PDs of
    /// 2 MiB pages (present | writable | large), identity over 4 GiB.
    fn boot_tables(m: &mut Mem) -> u64 {
        m.next = 0x10_0000;
        let pml4 = m.alloc_table().unwrap();
        let pdpt = m.alloc_table().unwrap();
        m.table(pml4)[0] = pdpt.0 | 3;
        for g in 0..4u64 {
            let pd = m.alloc_table().unwrap();
            m.table(pdpt)[g as usize] = pd.0 | 3;
            for (i, e) in m.table(pd).iter_mut().enumerate() {
                *e = ((g << 30) + ((i as u64) << 21)) | 0x83;
            }
        }
        pml4.0
    }

    /// The translation of `va` under `cr3`: physical address and the
    /// leaf's flags (low 12 bits, PAT normalized away), or None.
    fn walk(m: &Mem, cr3: u64, va: u64) -> Option<(u64, u64)> {
        let [i4, i3, i2, i1] = indices(va);
        let e4 = m.read((cr3 & ADDR_MASK) + i4 as u64 * 8)?;
        (e4 & PRESENT != 0).then_some(())?;
        let e3 = m.read((e4 & ADDR_MASK) + i3 as u64 * 8)?;
        (e3 & PRESENT != 0).then_some(())?;
        let e2 = m.read((e3 & ADDR_MASK) + i2 as u64 * 8)?;
        (e2 & PRESENT != 0).then_some(())?;
        if e2 & LARGE != 0 {
            let pat = u64::from(e2 & LARGE_PAT != 0);
            return Some((
                (e2 & LARGE_ADDR_MASK) + (va & (LARGE_PAGE - 1)),
                (e2 & 0xf7f) | (pat << 12) | (e2 & (0xfff << 52)),
            ));
        }
        let e1 = m.read((e2 & ADDR_MASK) + i1 as u64 * 8)?;
        (e1 & PRESENT != 0).then_some(())?;
        let pat = u64::from(e1 & PTE_PAT != 0);
        Some((
            (e1 & ADDR_MASK) + (va & (PAGE - 1)),
            (e1 & 0xf7f) | (pat << 12) | (e1 & (0xfff << 52)),
        ))
    }

    #[test]
    fn split_keeps_every_page_but_the_guard() {
        let pde = 0x0020_0000 | 0x83;
        let t = split_large_page(pde, 0x0023_4000).unwrap();
        for (i, e) in t.iter().enumerate() {
            if i == 0x34 {
                assert_eq!(*e, 0);
            } else {
                assert_eq!(*e, (0x0020_0000 + i as u64 * 4096) | 0x3, "entry {i}");
            }
        }
    }

    #[test]
    fn split_carries_attributes_and_moves_pat() {
        // Present, writable, PWT, PCD, accessed, dirty, global, PAT, NX.
        let pde = 0x4000_0000
            | 0x1
            | 0x2
            | 0x8
            | 0x10
            | 0x20
            | 0x40
            | 0x80
            | 0x100
            | LARGE_PAT
            | (1 << 63);
        let t = split_large_page(pde, 0x4000_0000).unwrap();
        assert_eq!(t[0], 0);
        assert_eq!(
            t[1],
            0x4000_1000 | 0x1 | 0x2 | 0x8 | 0x10 | 0x20 | 0x40 | PTE_PAT | 0x100 | (1 << 63)
        );
    }

    #[test]
    fn split_refuses_what_it_cannot_do() {
        assert_eq!(
            split_large_page(0x20_0083, 0x23_4008),
            Err(GuardError::BadGuard(0x23_4008))
        );
        assert_eq!(
            split_large_page(0x20_0083, 0x40_0000),
            Err(GuardError::OutsideLargePage {
                pde: 0x20_0083,
                guard: 0x40_0000
            })
        );
        assert_eq!(
            split_large_page(0x20_0003, 0x20_0000),
            Err(GuardError::OutsideLargePage {
                pde: 0x20_0003,
                guard: 0x20_0000
            })
        );
        assert_eq!(
            split_large_page(0x20_0082, 0x20_0000),
            Err(GuardError::NotMapped {
                level: 2,
                entry: 0x20_0082
            })
        );
    }

    #[test]
    fn only_the_guard_leaves_the_identity_map() {
        let mut m = Mem::default();
        let old = boot_tables(&mut m);
        let before: BTreeMap<u64, Box<[u64; 512]>> = m.frames.clone();
        let guard = 0x0025_7000;
        let new = unmap_guard_page(&mut m, |pa| m_read(&before, pa), old | 0x18, guard).unwrap();
        assert_eq!(new & 0xfff, 0x18, "CR3 flags kept");
        assert_ne!(new & ADDR_MASK, old);
        // The boot tables are untouched.
        for (pa, t) in &before {
            assert_eq!(m.frames[pa], *t, "boot table {pa:#x} changed");
        }
        // Four new tables: PML4, PDPT, PD, PT.
        assert_eq!(m.frames.len(), before.len() + 4);
        // Every 4 KiB page of the split 2 MiB and its neighbours, and one
        // page in each other 2 MiB of the 4 GiB, translate as before.
        let mut vas: Vec<u64> = (0x0000_0000..0x0080_0000).step_by(4096).collect();
        vas.extend((0..2048u64).map(|i| (i << 21) + 0x1_5000 + (i % 7) * 8));
        vas.push((4 << 30) - 8);
        for va in vas {
            let got = walk(&m, new, va);
            if va & !0xfff == guard {
                assert_eq!(got, None, "guard {va:#x} is mapped");
            } else {
                assert_eq!(got, walk(&m, old, va), "translation of {va:#x}");
                assert_eq!(got.map(|(pa, _)| pa), Some(va), "identity at {va:#x}");
            }
        }
        assert_eq!(walk(&m, new, 4 << 30), None);
    }

    fn m_read(frames: &BTreeMap<u64, Box<[u64; 512]>>, pa: u64) -> Option<u64> {
        frames
            .get(&(pa & !0xfff))
            .map(|t| t[((pa & 0xfff) / 8) as usize])
    }

    #[test]
    fn an_existing_page_table_is_copied_not_changed() {
        let mut m = Mem::default();
        let cr3 = boot_tables(&mut m);
        let guard = 0x0025_7000;
        let first = unmap_guard_page(&mut m, |_| None, cr3, guard);
        assert_eq!(first, Err(GuardError::Unreadable(cr3)));
        let snapshot = m.frames.clone();
        let once = unmap_guard_page(&mut m, |pa| m_read(&snapshot, pa), cr3, guard).unwrap();
        // A second guard in the same 2 MiB, on top of the first map.
        let snapshot = m.frames.clone();
        let twice =
            unmap_guard_page(&mut m, |pa| m_read(&snapshot, pa), once, guard + 0x1000).unwrap();
        for va in (0x0020_0000..0x0040_0000u64).step_by(4096) {
            let got = walk(&m, twice, va);
            if va == guard || va == guard + 0x1000 {
                assert_eq!(got, None);
            } else {
                assert_eq!(got, Some((va, 0x3)), "{va:#x}");
            }
        }
        // The first map still has its own guard only.
        assert_eq!(walk(&m, once, guard + 0x1000), Some((guard + 0x1000, 0x3)));
        assert_eq!(walk(&m, once, guard), None);
    }

    #[test]
    fn missing_paths_and_bad_guards_are_errors() {
        let mut m = Mem::default();
        let cr3 = boot_tables(&mut m);
        let snap = m.frames.clone();
        let r = |pa| m_read(&snap, pa);
        assert_eq!(
            unmap_guard_page(&mut m, r, cr3, 0x25_7001),
            Err(GuardError::BadGuard(0x25_7001))
        );
        assert_eq!(
            unmap_guard_page(&mut m, r, cr3, 1 << 47),
            Err(GuardError::BadGuard(1 << 47))
        );
        assert!(matches!(
            unmap_guard_page(&mut m, r, cr3, 1 << 39),
            Err(GuardError::NotMapped { level: 4, .. })
        ));
        assert!(matches!(
            unmap_guard_page(&mut m, r, cr3, 5 << 30),
            Err(GuardError::NotMapped { level: 3, .. })
        ));
        let mut small = Mem::default();
        let cr3 = boot_tables(&mut small);
        while small.alloc_table().is_some() {}
        let snap = small.frames.clone();
        assert_eq!(
            unmap_guard_page(&mut small, |pa| m_read(&snap, pa), cr3, 0x25_7000),
            Err(GuardError::OutOfTables)
        );
    }
}
