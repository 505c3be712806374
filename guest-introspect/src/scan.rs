//! Forward search for a byte string over a memory view, tolerant of holes.
//!
//! The view is read in 64 KiB chunks into one reused buffer (a failed chunk
//! is retried page by page and its unmapped pages skipped, jumping over
//! whole holes when the view says where they end). Each chunk is searched
//! with Boyer-Moore-Horspool on byte pairs: the window shifts by how far
//! the pair under its last two bytes can be from the needle's end. Pairs
//! that are not in the needle, such as the `00 00` that fills data, shift by
//! the needle length less one; for the 20-byte kallsyms needle that is about
//! one probe per 15 bytes of kernel text and rodata.

use alloc::vec::Vec;

use crate::addr::{Gva, GvaRange};
use crate::view::{ViewError, VirtMemory};

/// Bytes read per view access while scanning.
pub const CHUNK: u64 = 64 * 1024;
const PAGE: u64 = 4096;

/// What a scan cost, for estimating its run time in an emulator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Bytes copied out of the view by the search itself.
    pub bytes_scanned: u64,
    /// Horspool steps (one pair looked up and one shift each).
    pub probes: u64,
    /// View reads issued by the search.
    pub reads: u64,
    /// Matches of the needle handed to the validator.
    pub candidates: u64,
    /// Bytes skipped as unmapped.
    pub bytes_skipped: u64,
}

/// A Horspool matcher over byte pairs for one needle of 2 to 255 bytes.
pub struct Horspool<'n> {
    needle: &'n [u8],
    /// Shift for each pair `(a, b)` at `[a as usize * 256 + b]`.
    shift: Vec<u8>,
}

impl<'n> Horspool<'n> {
    /// Builds the 64 KiB shift table. `None` for a needle shorter than 2 or
    /// longer than 255 bytes.
    pub fn new(needle: &'n [u8]) -> Option<Self> {
        let k = needle.len();
        if !(2..=255).contains(&k) {
            return None;
        }
        // A pair found nowhere in the needle but whose second byte is the
        // needle's first can still start a match k-1 bytes on.
        let mut shift = alloc::vec![(k - 1) as u8; 65536];
        // Pairs inside the needle (all but the final one): align the
        // rightmost occurrence with the window's last two bytes.
        for j in 0..k - 2 {
            shift[needle[j] as usize * 256 + needle[j + 1] as usize] = (k - 2 - j) as u8;
        }
        Some(Self { needle, shift })
    }

    /// Calls `hit` for every match starting at or after `from`, in order,
    /// until it returns `true`. Returns whether it did, and counts steps.
    pub fn each(
        &self,
        hay: &[u8],
        from: usize,
        probes: &mut u64,
        mut hit: impl FnMut(usize) -> bool,
    ) -> bool {
        let k = self.needle.len();
        let (a, b) = (self.needle[k - 2], self.needle[k - 1]);
        let first = self.needle[0];
        let mut i = from;
        while let Some(&[x, y]) = hay.get(i + k - 2..i + k) {
            *probes += 1;
            if x == a
                && y == b
                && hay[i] == first
                && hay[i..i + k - 2] == self.needle[..k - 2]
                && hit(i)
            {
                return true;
            }
            // The final pair itself shifts by 1 at least (table value for
            // other occurrences, or k-1).
            i += core::cmp::max(1, self.shift[x as usize * 256 + y as usize] as usize);
        }
        false
    }
}

/// Searches `range` of `view` for `needle` and calls `check` on each match's
/// address, in increasing order, until it returns `Some`. Matches that span a
/// hole in the view are not seen (they cannot be real tables).
pub fn find<V, T>(
    view: &V,
    range: GvaRange,
    needle: &[u8],
    stats: &mut ScanStats,
    mut check: impl FnMut(Gva) -> Option<T>,
) -> Option<T>
where
    V: VirtMemory + ?Sized,
{
    let matcher = Horspool::new(needle)?;
    let k = needle.len();
    let end = range.end.0;
    // buf[..have] holds the bytes of [buf_start, buf_start + have): the
    // last k-1 bytes of the previous chunk (not yet tried as match starts),
    // then the new chunk. Allocated and zeroed once.
    let mut buf: Vec<u8> = alloc::vec![0u8; CHUNK as usize + k];
    let mut have = 0usize;
    let mut buf_start = range.start.0;
    let mut pos = range.start.0;
    let mut found: Option<T> = None;

    // Searches buf[..have], then keeps its last k-1 bytes.
    let mut search =
        |buf: &mut [u8], have: &mut usize, buf_start: &mut u64, stats: &mut ScanStats| {
            let mut out = None;
            let base = *buf_start;
            let mut probes = 0;
            matcher.each(&buf[..*have], 0, &mut probes, |i| {
                stats.candidates += 1;
                out = check(Gva(base + i as u64));
                out.is_some()
            });
            stats.probes += probes;
            let keep_from = have.saturating_sub(k - 1);
            buf.copy_within(keep_from..*have, 0);
            *have -= keep_from;
            *buf_start += keep_from as u64;
            out
        };

    while pos < end && found.is_none() {
        let n = core::cmp::min(CHUNK - pos % CHUNK, end - pos) as usize;
        stats.reads += 1;
        if view.read_virt(Gva(pos), &mut buf[have..have + n]).is_ok() {
            stats.bytes_scanned += n as u64;
            have += n;
            pos += n as u64;
            found = search(&mut buf, &mut have, &mut buf_start, stats);
            continue;
        }
        // Page by page: keep what reads, search it, and drop the buffer at
        // every hole.
        let chunk_end = pos + n as u64;
        while pos < chunk_end && found.is_none() {
            let m = core::cmp::min(PAGE - pos % PAGE, chunk_end - pos) as usize;
            stats.reads += 1;
            match view.read_virt(Gva(pos), &mut buf[have..have + m]) {
                Ok(()) => {
                    stats.bytes_scanned += m as u64;
                    have += m;
                    pos += m as u64;
                }
                Err(e) => {
                    // A page backed only in part (the end of an ELF
                    // segment): keep the part that reads.
                    let bad = e.gva().0;
                    if bad > pos && bad < pos + m as u64 {
                        let part = (bad - pos) as usize;
                        stats.reads += 1;
                        if view
                            .read_virt(Gva(pos), &mut buf[have..have + part])
                            .is_ok()
                        {
                            stats.bytes_scanned += part as u64;
                            have += part;
                            pos = bad;
                        }
                    }
                    found = search(&mut buf, &mut have, &mut buf_start, stats);
                    have = 0;
                    let next = match e {
                        ViewError::Unmapped {
                            resume: Some(r), ..
                        } if r.0 > pos => r.0,
                        _ => (pos | (PAGE - 1)).saturating_add(1),
                    };
                    // Unmapped bytes up to `next`, clamped to the range.
                    let next = core::cmp::min(next, end);
                    stats.bytes_skipped += next - pos;
                    pos = next;
                    buf_start = pos;
                }
            }
        }
        if found.is_none() {
            found = search(&mut buf, &mut have, &mut buf_start, stats);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::SegmentView;
    use alloc::vec;

    #[test]
    fn horspool_finds_all() {
        assert!(Horspool::new(b"a").is_none());
        let h = Horspool::new(b"aba").unwrap();
        let mut hits = vec![];
        let mut p = 0;
        h.each(b"abababxaba", 0, &mut p, |i| {
            hits.push(i);
            false
        });
        assert_eq!(hits, [0, 2, 7]);
        assert!(Horspool::new(b"").is_none());
        // Against a naive search, on text made of the needle's own bytes.
        let needle = b"0\x001\x002\x003\x00";
        let h = Horspool::new(needle).unwrap();
        let mut x = 12345u32;
        let mut hay: Vec<u8> = (0..20000)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                [b'0', b'1', b'2', b'3', 0, 0][(x >> 16) as usize % 6]
            })
            .collect();
        // Planted copies, some overlapping each other's tails.
        for at in [0usize, 17, 100, 106, 5000, 19992] {
            hay[at..at + needle.len()].copy_from_slice(needle);
        }
        let naive: Vec<usize> = (0..=hay.len() - needle.len())
            .filter(|&i| &hay[i..i + needle.len()] == needle)
            .collect();
        let mut fast = vec![];
        h.each(&hay, 0, &mut p, |i| {
            fast.push(i);
            false
        });
        assert_eq!(fast, naive);
        assert!(!naive.is_empty());
    }

    #[test]
    fn across_chunks_and_holes() {
        // Needle straddling a chunk boundary, one after a hole, one spanning
        // a hole (not reported).
        let mut a = vec![0u8; 3 * CHUNK as usize];
        let at = CHUNK as usize - 3;
        a[at..at + 6].copy_from_slice(b"needle");
        let n = a.len();
        a[n - 3..].copy_from_slice(b"nee");
        let mut b = vec![0u8; 100];
        b[..3].copy_from_slice(b"dle");
        b[50..56].copy_from_slice(b"needle");
        let mut v = SegmentView::new();
        v.add(Gva(0x10_0000), &a, a.len() as u64);
        let b_base = 0x10_0000 + a.len() as u64 + 0x5000;
        v.add(Gva(b_base), &b, b.len() as u64);
        let mut hits = vec![];
        let mut st = ScanStats::default();
        let r: Option<()> = find(
            &v,
            GvaRange::new(Gva(0x10_0000), Gva(b_base + 0x1000)),
            b"needle",
            &mut st,
            |g| {
                hits.push(g.0);
                None
            },
        );
        assert!(r.is_none());
        assert_eq!(hits, [0x10_0000 + at as u64, b_base + 50]);
        assert_eq!(st.bytes_scanned, a.len() as u64 + 100);
    }
}
