//! The one door from VMX root to guest-physical memory.
//!
//! Every address root reads or writes on the guest's behalf (page-table
//! walks, symbol tables, return addresses, the tracer's page-table entry,
//! pages it is about to shadow or step) comes from the guest, and the guest
//! may be hostile: it can name a page of hypervisor memory, an MMIO window
//! or a hole. [`GuestPhys`] refuses any access that is not wholly inside
//! guest RAM as the guest's e820 describes it — which never contains
//! hypervisor memory — before a single byte moves. Raw physical access
//! stays behind [`RawMemory`], which only this type and the
//! hypervisor's handling of its own frames use.

use guest_introspect::mem::{GuestMemory, MemError};
use guest_introspect::Gpa;
use loader::e820::E820Map;

/// Physical memory as root's own page tables map it (identity in the
/// binary, a buffer in tests). No checks: that is [`GuestPhys`]'s job.
pub trait RawMemory {
    /// Copies from physical `addr`; `false` when the range is not mapped.
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool;
    /// Copies to physical `addr`; `false` when the range is not mapped.
    fn write(&self, addr: u64, bytes: &[u8]) -> bool;
}

/// Most RAM ranges kept (an e820 holds at most 128 entries).
const MAX_RANGES: usize = 128;

/// The chunks of the fast check: 2 MiB each, the first 16 GiB.
const CHUNK_SHIFT: u32 = 21;
const CHUNKS: usize = 8192;

/// Guest RAM, checked.
pub struct GuestPhys<R> {
    /// The RAM entries of the map, sorted and merged, as `[start, end)`:
    /// the check on every access (each page-table entry of every walk) is
    /// a short scan of a few ranges.
    ranges: [(u64, u64); MAX_RANGES],
    count: usize,
    /// A range that is never guest RAM whatever the map says (hypervisor
    /// memory); checked as well, so a bad map cannot open it.
    reserved: core::ops::Range<u64>,
    /// One bit per 2 MiB chunk that lies wholly inside one of `ranges`
    /// and outside `reserved`: an access inside one such chunk is RAM
    /// without the scan (each entry of every page walk asks). The scan
    /// answers everything else, so the check is exactly as strict.
    whole: [u64; CHUNKS / 64],
    raw: R,
}

impl<R: RawMemory> GuestPhys<R> {
    /// Guest RAM is the RAM entries of `ram` (the guest's e820), minus
    /// `reserved`.
    pub fn new(ram: E820Map, reserved: core::ops::Range<u64>, raw: R) -> Self {
        let mut ranges = [(0u64, 0u64); MAX_RANGES];
        let mut count = 0usize;
        let mut list: [(u64, u64); MAX_RANGES] = [(0, 0); MAX_RANGES];
        let mut n = 0;
        let ram = ram.iter().filter(|e| e.is_ram() && e.size != 0);
        for (slot, e) in list.iter_mut().zip(ram) {
            *slot = (e.addr, e.addr.saturating_add(e.size));
            n += 1;
        }
        let list = list.get_mut(..n).unwrap_or(&mut []);
        list.sort_unstable();
        for &(start, end) in list.iter() {
            let last = count.checked_sub(1).and_then(|i| ranges.get_mut(i));
            match last {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => {
                    // `count` never passes `n`, itself at most MAX_RANGES.
                    if let Some(slot) = ranges.get_mut(count) {
                        *slot = (start, end);
                        count += 1;
                    }
                }
            }
        }
        let mut door = Self {
            ranges,
            count,
            reserved,
            whole: [0; CHUNKS / 64],
            raw,
        };
        for chunk in 0..CHUNKS as u64 {
            let start = chunk << CHUNK_SHIFT;
            if door.scan(start, start + (1 << CHUNK_SHIFT)) {
                if let Some(w) = door.whole.get_mut((chunk / 64) as usize) {
                    *w |= 1 << (chunk % 64);
                }
            }
        }
        door
    }

    /// A door that refuses every access (before guest RAM is known).
    pub const fn refusing_all(raw: R) -> Self {
        Self {
            ranges: [(0, 0); MAX_RANGES],
            count: 0,
            reserved: 0..u64::MAX,
            whole: [0; CHUNKS / 64],
            raw,
        }
    }

    /// Whether `[gpa, end)` (not empty) lies wholly inside one RAM range
    /// and outside the reserved one, by the scan.
    fn scan(&self, gpa: u64, end: u64) -> bool {
        !self.touches_reserved(gpa, end)
            && self
                .ranges
                .get(..self.count)
                .unwrap_or(&[])
                .iter()
                .any(|&(start, stop)| start <= gpa && end <= stop)
    }

    /// Whether `[gpa, gpa + len)` is guest RAM (an empty range at a RAM
    /// address is).
    pub fn is_ram(&self, gpa: u64, len: u64) -> bool {
        let Some(end) = gpa.checked_add(len) else {
            return false;
        };
        let end = end.max(gpa.saturating_add(1));
        let chunk = gpa >> CHUNK_SHIFT;
        if chunk == (end - 1) >> CHUNK_SHIFT {
            let word = self.whole.get((chunk / 64) as usize).copied().unwrap_or(0);
            if word & (1 << (chunk % 64)) != 0 {
                return true;
            }
        }
        // Merged ranges: the whole access lies in one of them, or it is not RAM.
        self.scan(gpa, end)
    }

    /// Whether `[gpa, end)` overlaps the reserved range.
    fn touches_reserved(&self, gpa: u64, end: u64) -> bool {
        gpa < self.reserved.end && end > self.reserved.start
    }

    fn check(&self, gpa: u64, len: usize) -> Result<(), MemError> {
        if self.is_ram(gpa, len as u64) {
            Ok(())
        } else if self.touches_reserved(gpa, gpa.saturating_add(len as u64)) {
            Err(MemError::Denied { gpa: Gpa(gpa) })
        } else {
            Err(MemError::OutOfRange { gpa: Gpa(gpa), len })
        }
    }

    /// Reads guest RAM.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.check(gpa, buf.len())?;
        if self.raw.read(gpa, buf) {
            Ok(())
        } else {
            Err(MemError::OutOfRange {
                gpa: Gpa(gpa),
                len: buf.len(),
            })
        }
    }

    /// Writes guest RAM.
    pub fn write(&self, gpa: u64, bytes: &[u8]) -> Result<(), MemError> {
        self.check(gpa, bytes.len())?;
        if self.raw.write(gpa, bytes) {
            Ok(())
        } else {
            Err(MemError::OutOfRange {
                gpa: Gpa(gpa),
                len: bytes.len(),
            })
        }
    }

    /// Reads a little-endian word of guest RAM.
    pub fn read_u64(&self, gpa: u64) -> Result<u64, MemError> {
        let mut b = [0u8; 8];
        self.read(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Writes a little-endian word of guest RAM.
    pub fn write_u64(&self, gpa: u64, value: u64) -> Result<(), MemError> {
        self.write(gpa, &value.to_le_bytes())
    }
}

impl<R: RawMemory> GuestMemory for GuestPhys<R> {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError> {
        self.read(gpa.0, buf)
    }
}

/// The guarded door as an object: what the tracer is handed, so that the
/// binary's identity-mapped RAM and a test's buffer look the same to it.
pub trait GuestDoor: GuestMemory {
    /// Whether `[gpa, gpa + len)` is guest RAM.
    fn is_ram(&self, gpa: u64, len: u64) -> bool;
    /// Reads guest RAM.
    fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError>;
    /// Writes guest RAM.
    fn write(&self, gpa: u64, bytes: &[u8]) -> Result<(), MemError>;
    /// Reads a little-endian word of guest RAM.
    fn read_word(&self, gpa: u64) -> Result<u64, MemError> {
        let mut b = [0u8; 8];
        self.read(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    /// Writes a little-endian word of guest RAM.
    fn write_word(&self, gpa: u64, value: u64) -> Result<(), MemError> {
        self.write(gpa, &value.to_le_bytes())
    }
}

impl<R: RawMemory> GuestDoor for GuestPhys<R> {
    fn is_ram(&self, gpa: u64, len: u64) -> bool {
        GuestPhys::is_ram(self, gpa, len)
    }
    fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError> {
        GuestPhys::read(self, gpa, buf)
    }
    fn write(&self, gpa: u64, bytes: &[u8]) -> Result<(), MemError> {
        GuestPhys::write(self, gpa, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::cell::RefCell;
    use loader::e820::E820Entry;

    /// 64 MiB of "physical memory" in a vector.
    struct Buffer(RefCell<Vec<u8>>);

    impl RawMemory for Buffer {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            let m = self.0.borrow();
            let Some(src) = m.get(addr as usize..addr as usize + buf.len()) else {
                return false;
            };
            buf.copy_from_slice(src);
            true
        }
        fn write(&self, addr: u64, bytes: &[u8]) -> bool {
            let mut m = self.0.borrow_mut();
            let Some(dst) = m.get_mut(addr as usize..addr as usize + bytes.len()) else {
                return false;
            };
            dst.copy_from_slice(bytes);
            true
        }
    }

    const MIB: u64 = 1 << 20;
    const HV: core::ops::Range<u64> = 2 * MIB..32 * MIB;

    /// RAM [0, 640 KiB) and [32 MiB, 64 MiB), as the guest's e820 has it
    /// (the hypervisor's [2 MiB, 32 MiB) already cut out), and [1, 2) MiB.
    fn guest(map_hv_too: bool) -> GuestPhys<Buffer> {
        let mut entries = vec![
            E820Entry {
                addr: 0,
                size: 0xa0000,
                kind: 1,
            },
            E820Entry {
                addr: MIB,
                size: MIB,
                kind: 1,
            },
            E820Entry {
                addr: 32 * MIB,
                size: 32 * MIB,
                kind: 1,
            },
            E820Entry {
                addr: 0xfec0_0000,
                size: 0x1000,
                kind: 2,
            },
        ];
        if map_hv_too {
            // A map that (wrongly) calls hypervisor memory RAM.
            entries.push(E820Entry {
                addr: 2 * MIB,
                size: 30 * MIB,
                kind: 1,
            });
        }
        let map = E820Map::from_entries(&entries).unwrap();
        GuestPhys::new(map, HV, Buffer(RefCell::new(vec![0u8; 64 * MIB as usize])))
    }

    #[test]
    fn guest_ram_reads_and_writes() {
        let g = guest(false);
        g.write_u64(32 * MIB + 8, 0x1122_3344_5566_7788).unwrap();
        assert_eq!(g.read_u64(32 * MIB + 8).unwrap(), 0x1122_3344_5566_7788);
        // Across two adjacent RAM entries is fine only if both are RAM.
        assert!(g.is_ram(0x9f000, 0x1000));
        assert!(!g.is_ram(0x9f000, 0x2000));
        // Through the trait, as the page walker uses it.
        let mut b = [0u8; 8];
        g.read_phys(Gpa(32 * MIB + 8), &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), 0x1122_3344_5566_7788);
    }

    #[test]
    fn hypervisor_memory_is_refused_even_if_the_map_says_ram() {
        for g in [guest(false), guest(true)] {
            for gpa in [2 * MIB, 16 * MIB, 32 * MIB - 8] {
                assert_eq!(
                    g.read_u64(gpa),
                    Err(MemError::Denied { gpa: Gpa(gpa) }),
                    "{gpa:#x}"
                );
                assert!(g.write_u64(gpa, 1).is_err());
            }
            // Straddling into it from below or above.
            assert!(g.write(2 * MIB - 4, &[0; 8]).is_err());
            assert!(g.read(32 * MIB - 4, &mut [0; 8]).is_err());
            assert!(!g.is_ram(2 * MIB - 0x1000, 0x2000));
        }
        // Nothing was written into the reserved range.
        let g = guest(true);
        let _ = g.write_u64(16 * MIB, u64::MAX);
        assert!(g.raw.0.borrow()[16 * MIB as usize..16 * MIB as usize + 8]
            .iter()
            .all(|&b| b == 0));
    }

    /// The chunk bitmap answers as the scan does, on random maps (RAM
    /// ranges at any alignment, a reserved range anywhere) and random
    /// accesses, aligned to chunks and not, inside, across and around.
    #[test]
    fn the_fast_check_agrees_with_the_scan_on_random_maps() {
        let mut rng = test_support::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.next();
        let mut fast_hits = 0u32;
        for _ in 0..200 {
            let mut entries = Vec::new();
            let mut at = 0u64;
            for _ in 0..(1 + next() % 8) {
                at += next() % (256 * MIB);
                let size = 1 + next() % (512 * MIB);
                let size = if next() % 2 == 0 {
                    size & !(2 * MIB - 1)
                } else {
                    size
                };
                entries.push(E820Entry {
                    addr: at & !0xfff,
                    size: size.max(0x1000),
                    kind: if next() % 5 == 0 { 2 } else { 1 },
                });
                at += size;
            }
            let Ok(map) = E820Map::from_entries(&entries) else {
                continue;
            };
            let rs = next() % (4096 * MIB);
            let reserved = rs..rs + next() % (128 * MIB);
            let g = GuestPhys::new(map, reserved, Buffer(RefCell::new(Vec::new())));
            for _ in 0..2000 {
                let base = match next() % 3 {
                    0 => (next() % 2048) << CHUNK_SHIFT,
                    1 => next() % (5000 * MIB),
                    _ => entries[(next() % entries.len() as u64) as usize]
                        .addr
                        .wrapping_add(next() % (4 * MIB))
                        .wrapping_sub(2 * MIB),
                };
                let len = [0, 1, 8, 4096, 2 * MIB, 3 * MIB][(next() % 6) as usize];
                let end = base.saturating_add(len).max(base.saturating_add(1));
                let want = base.checked_add(len).is_some() && g.scan(base, end);
                assert_eq!(g.is_ram(base, len), want, "{base:#x}+{len:#x}");
                fast_hits += u32::from(want);
            }
        }
        assert!(
            fast_hits > 10_000,
            "the maps give RAM to check: {fast_hits}"
        );
    }

    #[test]
    fn the_chunk_bitmap_leaves_out_reserved_and_partial_chunks() {
        let g = guest(true);
        // [32, 64) MiB: 16 whole chunks; the hypervisor's [2, 32) none,
        // though the map calls it RAM; [0, 640 KiB) and [1, 2) MiB are
        // parts of chunk 0.
        for chunk in 0..40u64 {
            let set = g.whole[0] & (1 << chunk) != 0;
            assert_eq!(set, (16..32).contains(&chunk), "chunk {chunk}");
        }
    }

    #[test]
    fn mmio_holes_and_wrapping_ranges_are_refused() {
        let g = guest(false);
        // The IOAPIC window (reserved in e820), a hole, beyond RAM, a wrap.
        for gpa in [0xfec0_0000u64, 0xa0000, 0xc0000, 64 * MIB, u64::MAX - 3] {
            assert!(g.read_u64(gpa).is_err(), "{gpa:#x}");
            assert!(g.write_u64(gpa, 0).is_err(), "{gpa:#x}");
            assert!(!g.is_ram(gpa, 8));
        }
        assert!(g.read(u64::MAX, &mut [0; 2]).is_err());
    }
}
