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
        let pairs = needle.iter().zip(needle.iter().skip(1));
        for (j, (&a, &b)) in pairs.take(k - 2).enumerate() {
            if let Some(s) = shift.get_mut(pair_index(a, b)) {
                *s = (k - 2 - j) as u8;
            }
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
        // `new` took 2 to 255 bytes: the pattern always matches.
        let &[first, ..] = self.needle else {
            return false;
        };
        let [head @ .., a, b] = self.needle else {
            return false;
        };
        let mut i = from;
        while let Some(&[x, y]) = hay.get(i + k - 2..i + k) {
            *probes += 1;
            if x == *a
                && y == *b
                && hay.get(i) == Some(&first)
                && hay.get(i..i + k - 2) == Some(head)
                && hit(i)
            {
                return true;
            }
            // The final pair itself shifts by 1 at least (table value for
            // other occurrences, or k-1; the table covers every pair).
            let shift = self.shift.get(pair_index(x, y)).copied().unwrap_or(1);
            i += core::cmp::max(1, shift as usize);
        }
        false
    }
}

/// Where the shift of the pair `(a, b)` is in [`Horspool`]'s table.
fn pair_index(a: u8, b: u8) -> usize {
    usize::from(a) * 256 + usize::from(b)
}

/// What one [`Scanner::step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanStep {
    /// A match of the needle starts here.
    Hit(Gva),
    /// One piece of the range was read (or skipped as a hole); call again.
    Read,
    /// The range is searched to its end.
    Done,
    /// A read was refused: the work budget is spent. Nothing more comes.
    OverBudget,
}

/// A forward search for one needle over one range, resumable between any
/// two steps: each [`Self::step`] reports the next match in what was read
/// already, or reads one more piece (at most [`CHUNK`] bytes, or skips one
/// hole). Matches that span a hole in the view are not seen (they cannot be
/// real tables).
pub struct Scanner<'n> {
    matcher: Horspool<'n>,
    k: usize,
    end: u64,
    /// `buf[..have]` holds the bytes of `[buf_start, buf_start + have)`:
    /// the last k-1 bytes of the previous piece (not yet tried as match
    /// starts), then the new piece. Allocated and zeroed once.
    buf: Vec<u8>,
    have: usize,
    buf_start: u64,
    /// Next match start to try in `buf`.
    next_try: usize,
    /// Next address to read.
    pos: u64,
    /// A hole follows `buf`: drop it (rather than keep its tail) once
    /// searched, and go on at `pos`.
    hole_after: bool,
    done: bool,
}

impl<'n> Scanner<'n> {
    /// A search for `needle` (2 to 255 bytes) over `range`. `None` for a
    /// needle of another length.
    pub fn new(range: GvaRange, needle: &'n [u8]) -> Option<Self> {
        let matcher = Horspool::new(needle)?;
        let k = needle.len();
        Some(Self {
            matcher,
            k,
            end: range.end.0,
            buf: alloc::vec![0u8; CHUNK as usize + k],
            have: 0,
            buf_start: range.start.0,
            next_try: 0,
            pos: range.start.0,
            hole_after: false,
            done: range.start.0 >= range.end.0,
        })
    }

    /// Where the search has read up to.
    pub fn position(&self) -> Gva {
        Gva(self.pos)
    }

    /// The next match in what is buffered, else reads (or skips) one more
    /// piece.
    pub fn step<V: VirtMemory + ?Sized>(&mut self, view: &V, stats: &mut ScanStats) -> ScanStep {
        if self.done {
            return ScanStep::Done;
        }
        let mut hit = None;
        let mut probes = 0;
        self.matcher
            .each(self.buffered(), self.next_try, &mut probes, |i| {
                hit = Some(i);
                true
            });
        stats.probes += probes;
        if let Some(i) = hit {
            self.next_try = i + 1;
            stats.candidates += 1;
            return ScanStep::Hit(Gva(self.buf_start + i as u64));
        }
        // Everything that can start a match in the buffer was tried: keep
        // the tail that may begin one across the next piece, unless a hole
        // comes next.
        if self.hole_after {
            self.have = 0;
            self.buf_start = self.pos;
            self.hole_after = false;
        } else {
            let keep_from = self.have.saturating_sub(self.k - 1);
            self.buf.copy_within(keep_from..self.have, 0);
            self.have -= keep_from;
            self.buf_start += keep_from as u64;
        }
        self.next_try = 0;
        if self.pos >= self.end {
            self.done = true;
            return ScanStep::Done;
        }
        self.read_piece(view, stats)
    }

    /// Appends the next piece of the range to the buffer: a whole chunk
    /// when it reads, else page by page up to the first hole, which is then
    /// skipped.
    fn read_piece<V: VirtMemory + ?Sized>(&mut self, view: &V, stats: &mut ScanStats) -> ScanStep {
        let pos = self.pos;
        let n = core::cmp::min(CHUNK - pos % CHUNK, self.end - pos) as usize;
        let have = self.have;
        let Some(out) = self.buf.get_mut(have..have + n) else {
            return self.overflowed();
        };
        stats.reads += 1;
        match view.read_virt(Gva(pos), out) {
            Ok(()) => {
                stats.bytes_scanned += n as u64;
                self.have += n;
                self.pos += n as u64;
                return ScanStep::Read;
            }
            Err(ViewError::OverBudget { .. }) => return self.refused(),
            Err(_) => {}
        }
        let chunk_end = pos + n as u64;
        while self.pos < chunk_end {
            let pos = self.pos;
            let m = core::cmp::min(PAGE - pos % PAGE, chunk_end - pos) as usize;
            let have = self.have;
            let Some(out) = self.buf.get_mut(have..have + m) else {
                return self.overflowed();
            };
            stats.reads += 1;
            let e = match view.read_virt(Gva(pos), out) {
                Ok(()) => {
                    stats.bytes_scanned += m as u64;
                    self.have += m;
                    self.pos += m as u64;
                    continue;
                }
                Err(ViewError::OverBudget { .. }) => return self.refused(),
                Err(e) => e,
            };
            // A page backed only in part (the end of an ELF segment): keep
            // the part that reads.
            let bad = e.gva().0;
            if bad > pos && bad < pos + m as u64 {
                let part = (bad - pos) as usize;
                let Some(out) = self.buf.get_mut(have..have + part) else {
                    return self.overflowed();
                };
                stats.reads += 1;
                match view.read_virt(Gva(pos), out) {
                    Ok(()) => {
                        stats.bytes_scanned += part as u64;
                        self.have += part;
                        self.pos = bad;
                    }
                    Err(ViewError::OverBudget { .. }) => return self.refused(),
                    Err(_) => {}
                }
            }
            let next = match e {
                ViewError::Unmapped {
                    resume: Some(r), ..
                } if r.0 > self.pos => r.0,
                _ => (self.pos | (PAGE - 1)).saturating_add(1),
            };
            // Unmapped bytes up to `next`, clamped to the range.
            let next = core::cmp::min(next, self.end);
            stats.bytes_skipped += next - self.pos;
            self.pos = next;
            self.hole_after = true;
            break;
        }
        ScanStep::Read
    }

    fn refused(&mut self) -> ScanStep {
        self.done = true;
        ScanStep::OverBudget
    }

    /// The bytes read and not yet dropped: `buf[..have]`.
    fn buffered(&self) -> &[u8] {
        self.buf.get(..self.have).unwrap_or_default()
    }

    /// A piece would not fit in the buffer. It cannot happen: at most k-1
    /// bytes are kept before a piece of at most [`CHUNK`] bytes, and the
    /// buffer holds `CHUNK + k`. Were it to, the search ends there rather
    /// than panic.
    fn overflowed(&mut self) -> ScanStep {
        self.done = true;
        ScanStep::Done
    }
}

/// Searches `range` of `view` for `needle` and calls `check` on each match's
/// address, in increasing order, until it returns `Some`. Matches that span a
/// hole in the view are not seen (they cannot be real tables). Stops early
/// (with `None`) when the view refuses a read for budget.
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
    let mut scanner = Scanner::new(range, needle)?;
    loop {
        match scanner.step(view, stats) {
            ScanStep::Hit(at) => {
                if let Some(t) = check(at) {
                    return Some(t);
                }
            }
            ScanStep::Read => {}
            ScanStep::Done | ScanStep::OverBudget => return None,
        }
    }
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
