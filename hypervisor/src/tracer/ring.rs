//! A per-vCPU event ring: variable-length records in one fixed byte buffer,
//! filled in VMX root at each hit and drained on the hypervisor's turns, or
//! by the host itself ([`protocol::TraceChannel::SharedRings`]).
//!
//! The ring is [`protocol::ring`]'s layout over memory this type owns (root
//! heap, identity-mapped and outside the guest's e820 and EPT, so that its
//! address is its physical address): a header with the producer's and the
//! consumer's positions, then records of a little-endian `u32` length and
//! their bytes. When a record does not fit, it is dropped and counted in
//! the header (the kernel's ring buffer in its default non-overwrite mode
//! does the same for trace_pipe readers): what is stored is never
//! overwritten, so a reader sees the oldest events and a count of the
//! newest that were lost. One producer (the ring's vCPU in root) and one
//! consumer (root's stream, or the host when it reads the rings).

use alloc::vec;
use alloc::vec::Vec;
use protocol::ring::{Ring, RING_HEADER, RING_MIN};
use tracelang::render::oldest;

/// A bounded FIFO of byte records.
pub struct EventRing {
    /// The ring's memory (header and data); never reallocated, since
    /// `ring` points into it.
    mem: Vec<u64>,
    ring: Ring,
}

impl EventRing {
    /// A ring of at least [`RING_MIN`] data bytes: the largest power of
    /// two not above `capacity`.
    pub fn new(capacity: usize) -> Self {
        let data = capacity.max(RING_MIN);
        let data = 1usize << (usize::BITS - 1 - data.leading_zeros());
        let mut mem = vec![0u64; (RING_HEADER + data) / 8];
        let len = mem.len() * 8;
        // SAFETY: `mem` is 8-aligned, `len` bytes long, owned by the value
        // the ring lives in and never reallocated; nothing else writes it.
        let ring = unsafe { Ring::format(mem.as_mut_ptr().cast(), len) };
        let ring = ring.unwrap_or_else(|| unreachable!("at least RING_MIN bytes of data"));
        EventRing { mem, ring }
    }

    /// Data bytes.
    pub fn capacity(&self) -> usize {
        self.ring.size()
    }

    /// Where the ring is (its header) and its bytes: root's heap is
    /// identity-mapped, so this is its physical address there.
    pub fn region(&self) -> (u64, u64) {
        (self.mem.as_ptr() as u64, (self.mem.len() * 8) as u64)
    }

    /// Bytes in use (framing included).
    pub fn used(&self) -> usize {
        self.ring.used()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Records dropped because they did not fit, since the ring was made.
    pub fn lost(&self) -> u64 {
        self.ring.lost()
    }

    /// Counts a record the producer could not even build (it is lost too).
    pub fn count_lost(&mut self) {
        self.ring.count_lost();
    }

    /// Appends a record; `false` (and one more lost record) if it does not fit.
    pub fn push(&mut self, record: &[u8]) -> bool {
        self.ring.push(record)
    }

    /// Appends a record of `len` bytes that `fill` writes, in place where
    /// it can be (see [`Ring::push_with`]); `false` (and one more lost
    /// record) if it does not fit or `fill` fails.
    pub fn push_with(
        &mut self,
        len: usize,
        scratch: &mut Vec<u8>,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> bool {
        self.ring.push_with(len, scratch, fill)
    }

    /// Length of the oldest record, if any.
    pub fn peek_len(&self) -> Option<usize> {
        self.ring.peek_len().ok().flatten()
    }

    /// The little-endian `u64` at byte `offset` of the oldest record, if
    /// there is one that long.
    pub fn peek_u64(&self, offset: usize) -> Option<u64> {
        self.ring.peek_u64(offset)
    }

    /// Removes the oldest record into `out` (replacing its contents). A
    /// ring whose positions cannot be right (only a host that read it
    /// wrongly could make them so) is emptied and serves again.
    pub fn pop(&mut self, out: &mut Vec<u8>) -> bool {
        match self.ring.pop(out) {
            Ok(taken) => taken,
            Err(_) => {
                self.ring.discard();
                false
            }
        }
    }
}

/// The vCPUs' rings, one each, read as one stream: oldest record first by
/// the timestamp each record carries at a fixed offset. Each vCPU's ring is
/// in its own order already (its records are stamped from one monotonic
/// clock as they are stored), so taking the oldest head each time merges
/// them.
///
/// Each ring has a lock of its own. On the hit path only its vCPU takes it
/// (under the VM's shared lock, where nobody drains), so it is never
/// waited for there; the drain runs with the VM to itself and reaches the
/// rings through `&mut` without locking.
pub struct Rings {
    rings: Vec<spin::Mutex<EventRing>>,
    /// Byte offset of the records' little-endian `u64` timestamp.
    stamp_at: usize,
}

impl Rings {
    /// `count` rings (at least one) of `each` bytes, with timestamps at
    /// `stamp_at`.
    pub fn new(count: usize, each: usize, stamp_at: usize) -> Self {
        Rings {
            rings: (0..count.max(1))
                .map(|_| spin::Mutex::new(EventRing::new(each)))
                .collect(),
            stamp_at,
        }
    }

    /// How many rings.
    pub fn count(&self) -> usize {
        self.rings.len()
    }

    /// The ring of vCPU `index` (the last one for an index past the end,
    /// which root never passes: it makes one ring per vCPU).
    fn slot(&self, index: usize) -> &spin::Mutex<EventRing> {
        let last = self.rings.len().saturating_sub(1);
        // `new` makes at least one ring, so `last` is in bounds.
        #[allow(clippy::indexing_slicing)]
        &self.rings[index.min(last)]
    }

    /// vCPU `index`'s ring, with the rings to ourselves.
    pub fn of(&mut self, index: usize) -> &mut EventRing {
        let last = self.rings.len().saturating_sub(1);
        // As in `slot`.
        #[allow(clippy::indexing_slicing)]
        self.rings[index.min(last)].get_mut()
    }

    /// vCPU `index`'s ring, locked: the hit path's way in, while other
    /// vCPUs record into theirs.
    pub fn lock(&self, index: usize) -> spin::MutexGuard<'_, EventRing> {
        self.slot(index).lock()
    }

    /// Where each ring is, in vCPU order (see [`EventRing::region`]).
    pub fn regions(&self) -> Vec<(u64, u64)> {
        self.rings.iter().map(|r| r.lock().region()).collect()
    }

    /// The fullest ring's bytes in use, as a fraction of its size in
    /// 1/256ths.
    pub fn fullest(&self) -> usize {
        self.rings
            .iter()
            .map(|r| {
                let r = r.lock();
                r.used().saturating_mul(256) / r.capacity().max(1)
            })
            .max()
            .unwrap_or(0)
    }

    /// Records lost by ring `index`.
    pub fn lost_of(&self, index: usize) -> u64 {
        self.rings.get(index).map_or(0, |r| r.lock().lost())
    }

    /// Records lost by every ring.
    pub fn lost(&self) -> u64 {
        self.rings.iter().map(|r| r.lock().lost()).sum()
    }

    /// Whether every ring is empty.
    pub fn is_empty(&self) -> bool {
        self.rings.iter().all(|r| r.lock().is_empty())
    }

    /// Removes the oldest record of all rings into `out`; returns its
    /// ring's index. A record too short to carry a timestamp counts as
    /// oldest (it is taken first, so it never blocks its ring).
    pub fn pop_oldest(&mut self, out: &mut Vec<u8>) -> Option<usize> {
        let i = self.oldest_index()?;
        let r = self.rings.get_mut(i)?.get_mut();
        r.pop(out).then_some(i)
    }

    /// Appends `prefix(len)` and the oldest record of all rings to `out`
    /// when the record is at most `max` bytes ([`Ring::pop_append`]):
    /// `None` when the rings are empty; the record's length otherwise
    /// (left where it is when over `max`).
    pub fn pop_oldest_append<const N: usize>(
        &mut self,
        out: &mut Vec<u8>,
        max: usize,
        prefix: impl FnOnce(usize) -> [u8; N],
    ) -> Option<usize> {
        let i = self.oldest_index()?;
        let r = &mut self.rings.get_mut(i)?.get_mut().ring;
        match r.pop_append(out, max, prefix) {
            Ok(len) => len,
            Err(_) => {
                // As `EventRing::pop`: emptied, and it serves again.
                r.discard();
                None
            }
        }
    }

    /// The ring whose oldest record is the oldest of all; a ring alone
    /// in holding records needs no timestamp read.
    fn oldest_index(&mut self) -> Option<usize> {
        let stamp_at = self.stamp_at;
        let mut holding = self
            .rings
            .iter_mut()
            .map(|r| r.get_mut().is_empty())
            .enumerate()
            .filter(|&(_, empty)| !empty);
        let (first, _) = holding.next()?;
        if holding.next().is_none() {
            return Some(first);
        }
        oldest(self.rings.iter_mut().map(|r| {
            let r = r.get_mut();
            (!r.is_empty()).then(|| r.peek_u64(stamp_at))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_back_in_order_across_the_wrap() {
        let mut r = EventRing::new(RING_MIN);
        assert_eq!(r.capacity(), RING_MIN);
        let mut out = Vec::new();
        let mut next_in = 0u8;
        let mut next_out = 0u8;
        let mut stored = 0usize;
        for round in 0..200 {
            // Records of 1..=200 bytes, each filled with its own number.
            while r.push(&vec![next_in; 1 + (next_in as usize % 200)]) {
                next_in = next_in.wrapping_add(1);
                stored += 1;
            }
            assert_eq!(r.lost(), round + 1);
            // Drain about half.
            for _ in 0..(stored / 2).max(1) {
                assert!(r.pop(&mut out));
                assert_eq!(out.len(), 1 + (next_out as usize % 200));
                assert!(out.iter().all(|&b| b == next_out), "{out:?} {next_out}");
                next_out = next_out.wrapping_add(1);
                stored -= 1;
            }
            assert!(r.used() <= r.capacity());
        }
        while r.pop(&mut out) {
            assert!(out.iter().all(|&b| b == next_out));
            next_out = next_out.wrapping_add(1);
        }
        assert_eq!(next_in, next_out);
        assert!(r.is_empty() && r.used() == 0);
    }

    #[test]
    fn rings_are_merged_oldest_first_and_count_their_own_losses() {
        // Records: an 8-byte id then the timestamp at offset 8, padded so
        // that a ring of RING_MIN holds four.
        let rec = |id: u64, ts: u64| {
            let mut v = id.to_le_bytes().to_vec();
            v.extend_from_slice(&ts.to_le_bytes());
            v.resize(RING_MIN / 4 - 8, 0);
            v
        };
        let mut rs = Rings::new(3, RING_MIN, 8);
        // Ring 0: 10, 40, 50; ring 1: 20, 30; ring 2: 5, then 60 and
        // three more it has no room for.
        for (ring, ts) in [(0, 10), (0, 40), (0, 50), (1, 20), (1, 30), (2, 5), (2, 60)] {
            assert!(rs.of(ring).push(&rec(ring as u64, ts)));
        }
        for ts in [61, 62, 63] {
            rs.of(2).push(&rec(2, ts));
        }
        assert_eq!(
            (rs.lost_of(0), rs.lost_of(1), rs.lost_of(2), rs.lost()),
            (0, 0, 1, 1)
        );
        assert_eq!(rs.fullest(), 256 * 4 * (RING_MIN / 4) / RING_MIN);
        let mut out = Vec::new();
        let mut got = Vec::new();
        while let Some(i) = rs.pop_oldest(&mut out) {
            let ts = u64::from_le_bytes(out[8..16].try_into().unwrap());
            got.push((i, ts));
        }
        assert_eq!(
            got,
            [
                (2, 5),
                (0, 10),
                (1, 20),
                (1, 30),
                (0, 40),
                (0, 50),
                (2, 60),
                (2, 61),
                (2, 62)
            ]
        );
        assert!(rs.is_empty());
        assert_eq!(rs.fullest(), 0);
        // Each ring is where it says, one after another in vCPU order.
        let regions = rs.regions();
        assert_eq!(regions.len(), 3);
        for (i, (at, len)) in regions.iter().enumerate() {
            assert_eq!(*len as usize, RING_HEADER + RING_MIN);
            assert_eq!(*at, rs.of(i).region().0);
            // SAFETY: the ring's own memory, read as the host reads it.
            let r = unsafe { Ring::attach(*at as *mut u8, *len as usize) }.unwrap();
            assert_eq!(r.size(), RING_MIN);
        }
        // A timestamp that wraps the ring's end is read whole.
        let mut r = EventRing::new(RING_MIN);
        let filler = vec![1u8; RING_MIN - 4 - 12];
        assert!(r.push(&filler));
        assert!(r.pop(&mut out));
        assert!(r.push(&rec(9, 0x1122_3344_5566_7788)[..16]));
        assert_eq!(r.peek_u64(8), Some(0x1122_3344_5566_7788));
        assert_eq!(r.peek_u64(9), None);
        let mut w = Rings {
            rings: Vec::new(),
            stamp_at: 8,
        };
        w.rings.push(spin::Mutex::new(r));
        assert_eq!(w.pop_oldest(&mut out), Some(0));
        assert_eq!(w.pop_oldest(&mut out), None);
    }

    #[test]
    fn a_full_ring_keeps_the_oldest_and_counts_the_rest() {
        let mut r = EventRing::new(RING_MIN);
        let rec = |i: u64| {
            let mut v = i.to_le_bytes().to_vec();
            v.resize(RING_MIN / 4 - 8, 0);
            v
        };
        for i in 0..10u64 {
            r.push(&rec(i));
        }
        assert_eq!(r.lost(), 6);
        let mut out = Vec::new();
        for i in 0..4u64 {
            assert!(r.pop(&mut out));
            assert_eq!(out, rec(i));
        }
        assert!(!r.pop(&mut out));
        // A record larger than the whole ring is refused, not split.
        assert!(!r.push(&[0; RING_MIN + 1]));
        assert_eq!(r.lost(), 7);
        // A position the host broke empties the ring, which serves again.
        assert!(r.push(b"abc"));
        let (at, len) = r.region();
        // SAFETY: the ring's own memory, written as a careless host could.
        let host = unsafe { Ring::attach(at as *mut u8, len as usize) }.unwrap();
        assert!(host.pop(&mut out).unwrap());
        assert!(r.push(b"def"));
        // SAFETY: as above; the consumer's position moved past the head.
        unsafe { (at as *mut u64).add(3).write(host.head() + 64) };
        assert!(!r.pop(&mut out));
        assert!(r.is_empty());
        assert!(r.push(b"ghi"));
        assert!(r.pop(&mut out));
        assert_eq!(out, b"ghi");
    }
}
