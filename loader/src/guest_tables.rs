//! Byte images of the guest's initial 64-bit state: its GDT and the page
//! tables that identity map the first 4 GiB. The hypervisor copies them to
//! [`crate::layout::GDT`] and [`crate::layout::BOOT_PML4`] before the first
//! VM entry; the kernel replaces both early in its boot.

use crate::layout::{Gpa, BOOT_PD_COUNT, LARGE_PAGE_SIZE, PAGE_SIZE};

/// Null descriptor.
pub const GDT_NULL: u64 = 0;
/// Flat 64-bit code segment: base 0, limit 4 GiB, present, DPL 0,
/// execute/read, L=1 (SDM 3.4.5 "Segment Descriptors").
pub const GDT_CODE64: u64 = 0x00AF_9A00_0000_FFFF;
/// Flat data segment: base 0, limit 4 GiB, present, DPL 0, read/write,
/// D/B=1.
pub const GDT_DATA: u64 = 0x00CF_9200_0000_FFFF;

/// The guest GDT: null, null, 0x10 = code, 0x18 = data, as the 64-bit boot
/// protocol asks (boot.rst, "64-bit Boot Protocol").
pub const GDT_ENTRIES: [u64; 4] = [GDT_NULL, GDT_NULL, GDT_CODE64, GDT_DATA];

/// Access rights of the code segment in the VMCS format (bits 8..15 and
/// 52..55 of the descriptor, SDM 25.4.1): accessed type 0xB, S, P, L, G.
pub const CODE64_ACCESS_RIGHTS: u32 = access_rights(GDT_CODE64) | 1;
/// Access rights of the data segment in the VMCS format, accessed.
pub const DATA_ACCESS_RIGHTS: u32 = access_rights(GDT_DATA) | 1;

/// The VMCS access-rights form of a descriptor: type, S, DPL and P from
/// bits 40..47, AVL, L, D/B and G from bits 52..55 (SDM 25.4.1).
pub const fn access_rights(descriptor: u64) -> u32 {
    (((descriptor >> 40) & 0xFF) | (((descriptor >> 52) & 0xF) << 12)) as u32
}

/// The guest GDT as bytes (little-endian descriptors).
pub fn gdt_bytes() -> [u8; 32] {
    let mut out = [0u8; 32];
    for (chunk, d) in out.chunks_exact_mut(8).zip(GDT_ENTRIES) {
        chunk.copy_from_slice(&d.to_le_bytes());
    }
    out
}

/// Page-table entry bit: present.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Page-table entry bit: writable.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// Page-directory entry bit: maps a 2 MiB page.
pub const PTE_PAGE_SIZE: u64 = 1 << 7;

/// Number of 8-byte entries in a table.
const ENTRIES: usize = 512;
/// Number of pages the identity tables take: PML4, PDPT and the PDs.
pub const IDENTITY_TABLE_PAGES: usize = 2 + BOOT_PD_COUNT as usize;
/// Bytes the identity tables take.
pub const IDENTITY_TABLES_SIZE: usize = IDENTITY_TABLE_PAGES * PAGE_SIZE as usize;

fn put_entry(out: &mut [u8; IDENTITY_TABLES_SIZE], page: usize, index: usize, value: u64) {
    let off = page * PAGE_SIZE as usize + index * 8;
    out[off..off + 8].copy_from_slice(&value.to_le_bytes());
}

/// Fills `out` with page tables that identity map the first 4 GiB with
/// 2 MiB pages, for `out` to be placed at guest-physical `base`:
/// page 0 is the PML4 (load its address into CR3), page 1 the PDPT, pages
/// 2 to 5 the page directories for each GiB. `PML4[0]` points at the PDPT and
/// `PDPT[0..4]` at the directories; all other entries are zero.
///
/// # Panics
///
/// If `base` is not 4 KiB aligned (a constant from [`crate::layout`] in
/// practice, never guest input).
pub fn write_identity_tables(out: &mut [u8; IDENTITY_TABLES_SIZE], base: Gpa) {
    assert!(
        base.is_aligned(PAGE_SIZE),
        "page tables at {base:?} are not page aligned"
    );
    out.fill(0);
    let page_addr = |page: usize| base.as_u64() + (page as u64) * PAGE_SIZE;
    let table = PTE_PRESENT | PTE_WRITABLE;
    put_entry(out, 0, 0, page_addr(1) | table);
    for gib in 0..BOOT_PD_COUNT as usize {
        put_entry(out, 1, gib, page_addr(2 + gib) | table);
        for i in 0..ENTRIES {
            let phys = ((gib * ENTRIES + i) as u64) * LARGE_PAGE_SIZE;
            put_entry(out, 2 + gib, i, phys | table | PTE_PAGE_SIZE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_rights_match_the_descriptors() {
        // Code: type 0xB (accessed exec/read), S, P, L, G.
        assert_eq!(CODE64_ACCESS_RIGHTS, 0xA09B);
        // Data: type 0x3 (accessed read/write), S, P, D/B, G.
        assert_eq!(DATA_ACCESS_RIGHTS, 0xC093);
    }
}
