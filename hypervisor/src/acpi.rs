//! The few ACPI tables the hypervisor reads from firmware memory before the
//! guest runs: the RSDP (to hand its address to the guest) and the FADT's PM1a
//! control port (to notice the guest powering off). ACPI 6.4 sections 5.2.5
//! (RSDP), 5.2.7/5.2.8 (RSDT/XSDT) and 5.2.9 (FADT).

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

/// Follows RSDP -> XSDT or RSDT -> FACP and returns the PM1 control ports.
pub fn find_fadt(mem: &impl PhysRead, rsdp: u64) -> Option<Fadt> {
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
    let n = {
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
        n
    };
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
}
