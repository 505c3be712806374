//! The few ACPI tables the hypervisor reads from firmware memory before the
//! guest runs: the RSDP (to hand its address to the guest), the FADT's PM1a
//! control port (to notice the guest powering off) and the MADT's
//! processors (to take every one into VMX before the guest can start it)
//! and I/O APICs (whose redirection entries root filters).
//! ACPI 6.4 sections 5.2.5 (RSDP), 5.2.7/5.2.8 (RSDT/XSDT), 5.2.9 (FADT)
//! and 5.2.12 (MADT).

use crate::irq::MAX_IOAPICS;

/// Reads physical memory; `false` when the range is not readable.
pub trait PhysRead {
    /// Fills `buf` from physical address `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool;
}

fn sum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
}

/// The little-endian `u32` at `b[o..o + 4]`, or `None` past the end of `b`.
fn le32(b: &[u8], o: usize) -> Option<u32> {
    b.get(o..)?.first_chunk().map(|c| u32::from_le_bytes(*c))
}

/// The little-endian `u64` at `b[o..o + 8]`, or `None` past the end of `b`.
fn le64(b: &[u8], o: usize) -> Option<u64> {
    b.get(o..)?.first_chunk().map(|c| u64::from_le_bytes(*c))
}

/// Where the BIOS puts the RSDP: the read-only BIOS area, searched on
/// 16-byte boundaries.
pub const BIOS_AREA: core::ops::Range<u64> = 0xe_0000..0x10_0000;

/// Finds a valid RSDP ("RSD PTR " with a good checksum) in `area`, which
/// holds the bytes at physical address `base`. Returns its physical address.
pub fn find_rsdp(area: &[u8], base: u64) -> Option<u64> {
    (0..area.len().saturating_sub(20))
        .step_by(16)
        .find(|&o| {
            area.get(o..)
                .and_then(|a| a.first_chunk::<20>())
                .is_some_and(|r| r.starts_with(b"RSD PTR ") && sum(r) == 0)
        })
        .map(|o| base + o as u64)
}

/// Facts taken from the FADT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fadt {
    /// I/O port of the PM1a control block.
    pub pm1a_cnt: u16,
    /// I/O port of the PM1b control block, if any.
    pub pm1b_cnt: Option<u16>,
}

/// Reads an SDT header and body at `addr` if its signature and checksum are right.
fn table<'b>(mem: &impl PhysRead, addr: u64, sig: &[u8; 4], buf: &'b mut [u8]) -> Option<&'b [u8]> {
    let mut hdr = [0u8; 36];
    if !mem.read(addr, &mut hdr) || !hdr.starts_with(sig) {
        return None;
    }
    let len = le32(&hdr, 4)? as usize;
    if len < 36 {
        return None;
    }
    let t = buf.get_mut(..len)?;
    if !mem.read(addr, t) || sum(t) != 0 {
        return None;
    }
    Some(t)
}

/// The system description tables the RSDP lists (through the XSDT when
/// it has one, else the RSDT): their addresses, at most 32.
fn sdt_addresses(mem: &impl PhysRead, rsdp: u64) -> Option<([u64; 32], usize)> {
    let mut r = [0u8; 36];
    if !mem.read(rsdp, &mut r[..20]) {
        return None;
    }
    // Revision 2+ RSDPs are 36 bytes long and may carry an XSDT address.
    if r[15] >= 2 && !mem.read(rsdp, &mut r) {
        r[15] = 0;
    }
    let mut buf = [0u8; 1024];
    let xsdt = le64(&r, 24).filter(|&a| r[15] >= 2 && a != 0);
    let (root, entry, sig) = match xsdt {
        Some(xsdt) => (xsdt, 8usize, b"XSDT"),
        None => (le32(&r, 16)? as u64, 4usize, b"RSDT"),
    };
    let mut entries = [0u64; 32];
    let t = table(mem, root, sig, &mut buf)?;
    let body = t.get(36..)?;
    let mut n = 0;
    for (e, raw) in entries.iter_mut().zip(body.chunks_exact(entry)) {
        *e = if entry == 8 {
            le64(raw, 0)?
        } else {
            le32(raw, 0)? as u64
        };
        n += 1;
    }
    Some((entries, n))
}

/// Follows RSDP -> XSDT or RSDT -> FACP and returns the PM1 control ports.
pub fn find_fadt(mem: &impl PhysRead, rsdp: u64) -> Option<Fadt> {
    let (entries, n) = sdt_addresses(mem, rsdp)?;
    for &addr in entries.iter().take(n) {
        let mut fb = [0u8; 512];
        if let Some(f) = table(mem, addr, b"FACP", &mut fb) {
            // PM1a_CNT_BLK is at offset 64; a FADT too short for it is no use.
            let a = le32(f, 64)?;
            // PM1b_CNT_BLK (offset 68) is optional: a FADT that ends before
            // it has none.
            let b = le32(f, 68).unwrap_or(0);
            if a == 0 || a > 0xffff {
                return None;
            }
            return Some(Fadt {
                pm1a_cnt: a as u16,
                pm1b_cnt: (b != 0 && b <= 0xffff).then_some(b as u16),
            });
        }
    }
    None
}

/// The most processors the hypervisor takes (and reads from the MADT).
pub const MAX_CPUS: usize = 16;

/// The processors the MADT lists as usable, in its order (the order in
/// which Linux numbers them, after the boot processor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpus {
    /// The local APIC's physical address (the MADT's, or its 64-bit override).
    pub lapic_base: u64,
    /// APIC IDs of the enabled (or online-capable) processors.
    ids: [u32; MAX_CPUS],
    count: usize,
    /// Usable processors past [`MAX_CPUS`], not taken.
    pub ignored: usize,
    /// The I/O APICs' register addresses, in MADT order.
    ioapics: [u64; MAX_IOAPICS],
    ioapic_count: usize,
}

impl Cpus {
    /// The APIC IDs, in MADT order.
    pub fn apic_ids(&self) -> &[u32] {
        self.ids.get(..self.count).unwrap_or(&[])
    }

    /// The I/O APICs' register addresses (at most [`MAX_IOAPICS`]).
    pub fn ioapics(&self) -> &[u64] {
        self.ioapics.get(..self.ioapic_count).unwrap_or(&[])
    }

    fn push(&mut self, id: u32) {
        if self.apic_ids().contains(&id) {
            return;
        }
        match self.ids.get_mut(self.count) {
            Some(slot) => {
                *slot = id;
                self.count += 1;
            }
            None => self.ignored += 1,
        }
    }
}

/// MADT entry types (ACPI 6.4 table 5.45).
const MADT_LOCAL_APIC: u8 = 0;
const MADT_IOAPIC: u8 = 1;
const MADT_LAPIC_OVERRIDE: u8 = 5;
const MADT_LOCAL_X2APIC: u8 = 9;
/// Local APIC flags: enabled, online capable (ACPI 6.4 table 5.47).
const LAPIC_ENABLED: u32 = 1;
const LAPIC_ONLINE_CAPABLE: u32 = 2;

/// Reads the processors from the MADT ("APIC"). `None` when there is no
/// readable MADT; a table cut short yields the entries before the cut.
pub fn find_cpus(mem: &impl PhysRead, rsdp: u64) -> Option<Cpus> {
    let (entries, n) = sdt_addresses(mem, rsdp)?;
    let mut buf = [0u8; 4096];
    let t = entries
        .iter()
        .take(n)
        .find_map(|&addr| table(mem, addr, b"APIC", &mut buf).map(|t| t.len()))
        .and_then(|len| buf.get(..len))?;
    let mut cpus = Cpus {
        lapic_base: u64::from(le32(t, 36)?),
        ids: [0; MAX_CPUS],
        count: 0,
        ignored: 0,
        ioapics: [0; MAX_IOAPICS],
        ioapic_count: 0,
    };
    let mut o = 44usize;
    while let (Some(&kind), Some(&len)) = (t.get(o), t.get(o + 1)) {
        let e = match t.get(o..o + usize::from(len)) {
            Some(e) if len >= 2 => e,
            _ => break,
        };
        match kind {
            MADT_LOCAL_APIC => {
                if let (Some(&id), Some(flags)) = (e.get(3), le32(e, 4)) {
                    if flags & (LAPIC_ENABLED | LAPIC_ONLINE_CAPABLE) != 0 {
                        cpus.push(u32::from(id));
                    }
                }
            }
            MADT_LOCAL_X2APIC => {
                if let (Some(id), Some(flags)) = (le32(e, 4), le32(e, 8)) {
                    if flags & (LAPIC_ENABLED | LAPIC_ONLINE_CAPABLE) != 0 {
                        cpus.push(id);
                    }
                }
            }
            MADT_IOAPIC => {
                // ID, reserved, then the 32-bit address (table 5.49).
                if let Some(addr) = le32(e, 4) {
                    if let Some(slot) = cpus.ioapics.get_mut(cpus.ioapic_count) {
                        *slot = u64::from(addr);
                        cpus.ioapic_count += 1;
                    }
                }
            }
            MADT_LAPIC_OVERRIDE => {
                if let Some(base) = le64(e, 4) {
                    cpus.lapic_base = base;
                }
            }
            _ => {}
        }
        o += usize::from(len);
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    struct Mem(BTreeMap<u64, Vec<u8>>);
    impl PhysRead for Mem {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            for (&base, bytes) in &self.0 {
                if addr >= base && addr + buf.len() as u64 <= base + bytes.len() as u64 {
                    let o = (addr - base) as usize;
                    buf.copy_from_slice(&bytes[o..o + buf.len()]);
                    return true;
                }
            }
            false
        }
    }

    fn fix_sum(t: &mut [u8], at: usize) {
        t[at] = 0;
        t[at] = 0u8.wrapping_sub(sum(t));
    }

    fn sdt(sig: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut t = vec![0u8; 36];
        t[..4].copy_from_slice(sig);
        t.extend_from_slice(body);
        let len = t.len() as u32;
        t[4..8].copy_from_slice(&len.to_le_bytes());
        fix_sum(&mut t, 9);
        t
    }

    fn rsdp(rsdt: u32) -> Vec<u8> {
        let mut r = vec![0u8; 20];
        r[..8].copy_from_slice(b"RSD PTR ");
        r[16..20].copy_from_slice(&rsdt.to_le_bytes());
        fix_sum(&mut r, 8);
        r
    }

    #[test]
    fn finds_rsdp_and_pm1a_through_the_rsdt() {
        let mut area = vec![0u8; 0x100];
        area[0x40..0x54].copy_from_slice(&rsdp(0x1000));
        assert_eq!(find_rsdp(&area, 0xe0000), Some(0xe0040));
        let mut fadt_body = vec![0u8; 80];
        fadt_body[64 - 36..68 - 36].copy_from_slice(&0xb004u32.to_le_bytes());
        let fadt = sdt(b"FACP", &fadt_body);
        let rsdt = sdt(b"RSDT", &[0x00, 0x30, 0, 0, 0x00, 0x20, 0, 0]);
        let mut apic = sdt(b"APIC", &[1, 2, 3]);
        apic[20] = 9;
        let mut m = Mem(BTreeMap::new());
        m.0.insert(0xe0040, area[0x40..0x54].to_vec());
        m.0.insert(0x1000, rsdt);
        m.0.insert(0x3000, apic);
        m.0.insert(0x2000, fadt);
        assert_eq!(
            find_fadt(&m, 0xe0040),
            Some(Fadt {
                pm1a_cnt: 0xb004,
                pm1b_cnt: None
            })
        );
    }

    #[test]
    fn a_fadt_that_ends_inside_pm1b_has_none() {
        // 70 bytes: PM1a_CNT_BLK (64..68) is there, PM1b_CNT_BLK (68..72)
        // is cut short.
        let mut fadt_body = vec![0u8; 70 - 36];
        fadt_body[64 - 36..68 - 36].copy_from_slice(&0x604u32.to_le_bytes());
        fadt_body[68 - 36..].copy_from_slice(&[0xff, 0xff]);
        let fadt = sdt(b"FACP", &fadt_body);
        assert_eq!(fadt.len(), 70);
        let mut m = Mem(BTreeMap::new());
        m.0.insert(0, rsdp(0x1000));
        m.0.insert(0x1000, sdt(b"RSDT", &0x2000u32.to_le_bytes()));
        m.0.insert(0x2000, fadt);
        assert_eq!(
            find_fadt(&m, 0),
            Some(Fadt {
                pm1a_cnt: 0x604,
                pm1b_cnt: None
            })
        );
        // Shorter than PM1a_CNT_BLK: no answer.
        m.0.insert(0x2000, sdt(b"FACP", &[0; 66 - 36]));
        assert_eq!(find_fadt(&m, 0), None);
    }

    #[test]
    fn bad_checksums_are_ignored() {
        let mut area = vec![0u8; 0x40];
        let mut r = rsdp(0x1000);
        r[19] ^= 1;
        area[0x10..0x24].copy_from_slice(&r);
        assert_eq!(find_rsdp(&area, 0), None);
        let mut m = Mem(BTreeMap::new());
        let mut rsdt = sdt(b"RSDT", &[0, 0x20, 0, 0]);
        rsdt[20] ^= 0xff;
        m.0.insert(0x1000, rsdt);
        m.0.insert(0, rsdp(0x1000));
        assert_eq!(find_fadt(&m, 0), None);
    }

    fn madt(entries: &[&[u8]]) -> Vec<u8> {
        let mut body = 0xfee0_0000u32.to_le_bytes().to_vec();
        body.extend_from_slice(&1u32.to_le_bytes());
        for e in entries {
            body.extend_from_slice(e);
        }
        sdt(b"APIC", &body)
    }

    fn lapic(id: u8, flags: u32) -> Vec<u8> {
        let mut e = vec![0u8, 8, id, id];
        e.extend_from_slice(&flags.to_le_bytes());
        e
    }

    fn with_madt(madt: Vec<u8>) -> Mem {
        let mut m = Mem(BTreeMap::new());
        m.0.insert(0, rsdp(0x1000));
        m.0.insert(0x1000, sdt(b"RSDT", &[0x00, 0x20, 0, 0, 0x00, 0x30, 0, 0]));
        m.0.insert(0x2000, sdt(b"FACP", &[0; 40]));
        m.0.insert(0x3000, madt);
        m
    }

    #[test]
    fn the_madt_lists_usable_processors_in_order() {
        let x2 = {
            let mut e = vec![9u8, 16, 0, 0];
            e.extend_from_slice(&300u32.to_le_bytes());
            e.extend_from_slice(&1u32.to_le_bytes());
            e.extend_from_slice(&7u32.to_le_bytes());
            e
        };
        // An IOAPIC entry (type 1, 12 bytes) between the processors.
        let ioapic = [1u8, 12, 0, 0, 0, 0, 0xc0, 0xfe, 0, 0, 0, 0];
        let m = with_madt(madt(&[
            &lapic(0, 1),
            &ioapic,
            &lapic(2, 1),
            &lapic(1, 0), // disabled, not online capable
            &lapic(3, 2), // online capable
            &x2,
            &lapic(2, 1), // listed twice
        ]));
        let cpus = find_cpus(&m, 0).unwrap();
        assert_eq!(cpus.apic_ids(), &[0, 2, 3, 300]);
        assert_eq!((cpus.lapic_base, cpus.ignored), (0xfee0_0000, 0));
        assert_eq!(cpus.ioapics(), &[0xfec0_0000]);
    }

    #[test]
    fn a_madt_override_moves_the_lapic_and_extra_processors_are_counted() {
        let mut over = vec![5u8, 12, 0, 0];
        over.extend_from_slice(&0x1_fee0_0000u64.to_le_bytes());
        let procs: Vec<Vec<u8>> = (0..MAX_CPUS as u8 + 3).map(|i| lapic(i, 1)).collect();
        let mut entries: Vec<&[u8]> = procs.iter().map(|p| p.as_slice()).collect();
        entries.push(&over);
        let cpus = find_cpus(&with_madt(madt(&entries)), 0).unwrap();
        assert_eq!(cpus.apic_ids().len(), MAX_CPUS);
        assert_eq!(cpus.apic_ids()[MAX_CPUS - 1], MAX_CPUS as u32 - 1);
        assert_eq!((cpus.ignored, cpus.lapic_base), (3, 0x1_fee0_0000));
    }

    #[test]
    fn the_madt_lists_the_io_apics() {
        let ioapic = |id: u8, addr: u32| {
            let mut e = vec![1u8, 12, id, 0];
            e.extend_from_slice(&addr.to_le_bytes());
            e.extend_from_slice(&(u32::from(id) * 24).to_le_bytes());
            e
        };
        let many: Vec<Vec<u8>> = (0..MAX_IOAPICS as u8 + 2)
            .map(|i| ioapic(i, 0xfec0_0000 + u32::from(i) * 0x1000))
            .collect();
        let mut entries: Vec<&[u8]> = vec![&[1u8, 6, 0, 0, 0, 0]]; // cut short
        entries.extend(many.iter().map(|e| e.as_slice()));
        let cpus = find_cpus(&with_madt(madt(&entries)), 0).unwrap();
        assert_eq!(cpus.ioapics().len(), MAX_IOAPICS);
        assert_eq!(cpus.ioapics()[0], 0xfec0_0000);
        assert_eq!(cpus.ioapics()[1], 0xfec0_1000);
        let none = find_cpus(&with_madt(madt(&[&lapic(0, 1)])), 0).unwrap();
        assert!(none.ioapics().is_empty());
    }

    #[test]
    fn a_truncated_or_corrupt_madt_yields_what_precedes_the_damage() {
        // An entry whose length runs past the table, after one good entry.
        let mut t = madt(&[&lapic(0, 1), &[0u8, 40, 1, 1]]);
        fix_sum(&mut t, 9);
        assert_eq!(find_cpus(&with_madt(t), 0).unwrap().apic_ids(), &[0]);
        // A zero-length entry cannot loop forever.
        let t = madt(&[&lapic(4, 1), &[7u8, 0, 0, 0]]);
        assert_eq!(find_cpus(&with_madt(t), 0).unwrap().apic_ids(), &[4]);
        // A bad checksum: no MADT at all.
        let mut t = madt(&[&lapic(0, 1)]);
        t[40] ^= 1;
        assert_eq!(find_cpus(&with_madt(t), 0), None);
    }
}
