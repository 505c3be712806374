//! Host tests of the guest's initial GDT, page tables and the layout types.

use loader::guest_tables::{self, IDENTITY_TABLES_SIZE, PTE_PAGE_SIZE, PTE_PRESENT, PTE_WRITABLE};
use loader::layout::{self, Gpa, Hpa};

const GIB: u64 = 0x4000_0000;

fn entry(tables: &[u8], base: u64, table_addr: u64, index: u64) -> u64 {
    let off = (table_addr - base + index * 8) as usize;
    u64::from_le_bytes(tables[off..off + 8].try_into().unwrap())
}

/// Walks the tables like the MMU does (4-level paging, 2 MiB leaves).
fn translate(tables: &[u8], base: u64, va: u64) -> Option<u64> {
    let addr_mask = 0x000F_FFFF_FFFF_F000u64;
    let pml4e = entry(tables, base, base, (va >> 39) & 0x1FF);
    if pml4e & PTE_PRESENT == 0 {
        return None;
    }
    assert_eq!(pml4e & PTE_PAGE_SIZE, 0);
    let pdpte = entry(tables, base, pml4e & addr_mask, (va >> 30) & 0x1FF);
    if pdpte & PTE_PRESENT == 0 {
        return None;
    }
    assert_eq!(pdpte & PTE_PAGE_SIZE, 0, "no 1 GiB pages");
    let pde = entry(tables, base, pdpte & addr_mask, (va >> 21) & 0x1FF);
    if pde & PTE_PRESENT == 0 {
        return None;
    }
    assert_ne!(pde & PTE_PAGE_SIZE, 0, "2 MiB leaves");
    assert_ne!(pde & PTE_WRITABLE, 0);
    Some((pde & 0x000F_FFFF_FFE0_0000) | (va & 0x1F_FFFF))
}

#[test]
fn identity_map_of_the_first_4_gib() {
    let mut t = vec![0xEEu8; IDENTITY_TABLES_SIZE];
    let out: &mut [u8; IDENTITY_TABLES_SIZE] = t.as_mut_slice().try_into().unwrap();
    guest_tables::write_identity_tables(out, layout::BOOT_PML4);
    let base = layout::BOOT_PML4.as_u64();
    for va in [
        0,
        0x1000,
        0x7000,
        0x1F_FFFF,
        0x20_0000,
        0x100_0000 + 0x123,
        GIB - 1,
        GIB,
        2 * GIB + 0x5_4321,
        3 * GIB + 0x20_0001,
        4 * GIB - 1,
    ] {
        assert_eq!(translate(&t, base, va), Some(va), "{va:#x}");
    }
    // Every 2 MiB page, exhaustively.
    for page in 0..2048u64 {
        let va = page * 0x20_0000 + (page * 4097) % 0x20_0000;
        assert_eq!(translate(&t, base, va), Some(va));
    }
    // Nothing above 4 GiB.
    assert_eq!(translate(&t, base, 4 * GIB), None);
    assert_eq!(translate(&t, base, 1 << 39), None);
    // The tables sit where layout says.
    assert_eq!(
        entry(&t, base, base, 0) & !0xFFF,
        layout::BOOT_PDPT.as_u64()
    );
    for i in 0..4 {
        assert_eq!(
            entry(&t, base, layout::BOOT_PDPT.as_u64(), i) & !0xFFF,
            layout::BOOT_PD.as_u64() + i * 0x1000
        );
    }
    // All other entries are zero, and the 0xEE fill is gone.
    let nonzero = t
        .chunks_exact(8)
        .filter(|c| c.iter().any(|&b| b != 0))
        .count();
    assert_eq!(nonzero, 1 + 4 + 2048);
}

#[test]
fn identity_tables_at_another_base() {
    let mut t = [0u8; IDENTITY_TABLES_SIZE];
    guest_tables::write_identity_tables(&mut t, Gpa(0x10_0000));
    assert_eq!(translate(&t, 0x10_0000, 0xDEAD_BEEF), Some(0xDEAD_BEEF));
}

#[test]
#[should_panic(expected = "page aligned")]
fn misaligned_tables_are_refused() {
    let mut t = [0u8; IDENTITY_TABLES_SIZE];
    guest_tables::write_identity_tables(&mut t, Gpa(0x9008));
}

#[test]
fn gdt_layout() {
    let g = guest_tables::gdt_bytes();
    assert_eq!(g.len() as u64, layout::GDT_SIZE);
    assert!(g[..16].iter().all(|&b| b == 0));
    let code = usize::from(layout::GUEST_CODE_SELECTOR);
    let data = usize::from(layout::GUEST_DATA_SELECTOR);
    assert_eq!(
        u64::from_le_bytes(g[code..code + 8].try_into().unwrap()),
        0x00AF_9A00_0000_FFFF
    );
    assert_eq!(
        u64::from_le_bytes(g[data..data + 8].try_into().unwrap()),
        0x00CF_9200_0000_FFFF
    );
}

#[test]
fn address_types() {
    let a = Gpa(0x1234);
    assert_eq!(a.as_u64(), 0x1234);
    assert_eq!(a.align_up(0x1000), Some(Gpa(0x2000)));
    assert_eq!(Gpa(0x2000).align_up(0x1000), Some(Gpa(0x2000)));
    assert_eq!(a.align_up(0), Some(a));
    assert_eq!(a.align_up(3), None);
    assert_eq!(Gpa(u64::MAX).align_up(2), None);
    assert_eq!(a.align_down(0x1000), Gpa(0x1000));
    assert!(Gpa(0x20_0000).is_aligned(0x20_0000));
    assert!(!a.is_aligned(0x1000));
    assert_eq!(a + 0x10, Gpa(0x1244));
    assert_eq!(Gpa(u64::MAX).checked_add(1), None);
    assert!(Gpa(1) < Gpa(2));
    assert_eq!(a.identity_hpa(), Hpa(0x1234));
    assert_eq!(format!("{a:?} {a} {a:x}"), "Gpa(0x1234) 0x1234 1234");
    assert_eq!(format!("{:?}", layout::HV_LOAD), "Hpa(0x200000)");
}

#[test]
fn layout_constants() {
    assert_eq!(layout::HV_RESERVED_END.as_u64(), 32 << 20);
    assert!(layout::CONTROL_PORTS.contains(&0x2F8) && layout::CONTROL_PORTS.contains(&0x2FF));
    assert!(!layout::CONTROL_PORTS.contains(&0x3F8));
    assert!(layout::ranges_overlap(0, 2, 1, 1));
    assert!(!layout::ranges_overlap(0, 1, 1, 1));
    assert!(!layout::ranges_overlap(0, 0, 0, 10));
    assert!(layout::ranges_overlap(u64::MAX, 1, u64::MAX - 1, 2));
}
