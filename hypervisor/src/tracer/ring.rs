//! A per-vCPU event ring: variable-length records in one fixed byte buffer,
//! filled in VMX root at each hit and drained on the hypervisor's turns.
//!
//! A record is stored as a little-endian `u32` length followed by its bytes.
//! When a record does not fit, it is dropped and counted (the kernel's ring
//! buffer in its default non-overwrite mode does the same for trace_pipe
//! readers): what is already stored is never overwritten, so a reader sees
//! the oldest events and a count of the newest that were lost.

use alloc::vec;
use alloc::vec::Vec;

/// Bytes of framing per record.
const LEN_BYTES: usize = 4;

/// A bounded FIFO of byte records.
pub struct EventRing {
    buf: Vec<u8>,
    /// Offset of the oldest record.
    head: usize,
    /// Bytes in use (framing included).
    used: usize,
    records: usize,
    lost: u64,
}

impl EventRing {
    /// A ring of `capacity` bytes (framing included).
    pub fn new(capacity: usize) -> Self {
        Self {
            buf: vec![0; capacity.max(LEN_BYTES + 1)],
            head: 0,
            used: 0,
            records: 0,
            lost: 0,
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Bytes in use.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Records stored.
    pub fn len(&self) -> usize {
        self.records
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Records dropped because they did not fit, since the ring was made.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// Counts a record the producer could not even build (it is lost too).
    pub fn count_lost(&mut self) {
        self.lost += 1;
    }

    /// Copies `bytes` (never more than the buffer holds) in at offset `at`
    /// modulo the capacity: up to the end of the buffer, the rest from its
    /// start. Every range below is in bounds by that; none is skipped.
    fn put(&mut self, at: usize, bytes: &[u8]) {
        let cap = self.buf.len();
        let start = at % cap;
        let first = bytes.len().min(cap - start);
        let Some((head, tail)) = bytes.split_at_checked(first) else {
            return;
        };
        if let Some(dst) = self.buf.get_mut(start..start + first) {
            dst.copy_from_slice(head);
        }
        if let Some(dst) = self.buf.get_mut(..tail.len()) {
            dst.copy_from_slice(tail);
        }
    }

    /// Fills `out` (never longer than the buffer) from offset `at` modulo
    /// the capacity, wrapping as [`Self::put`] does.
    fn get(&self, at: usize, out: &mut [u8]) {
        let cap = self.buf.len();
        let start = at % cap;
        let first = out.len().min(cap - start);
        let Some((head, tail)) = out.split_at_mut_checked(first) else {
            return;
        };
        if let Some(src) = self.buf.get(start..start + first) {
            head.copy_from_slice(src);
        }
        if let Some(src) = self.buf.get(..tail.len()) {
            tail.copy_from_slice(src);
        }
    }

    /// Appends a record; `false` (and one more lost record) if it does not fit.
    pub fn push(&mut self, record: &[u8]) -> bool {
        let need = LEN_BYTES + record.len();
        if record.len() > u32::MAX as usize || need > self.buf.len() - self.used {
            self.lost += 1;
            return false;
        }
        let tail = self.head + self.used;
        self.put(tail, &(record.len() as u32).to_le_bytes());
        self.put(tail + LEN_BYTES, record);
        self.used += need;
        self.records += 1;
        true
    }

    /// Length of the oldest record, if any.
    pub fn peek_len(&self) -> Option<usize> {
        if self.records == 0 {
            return None;
        }
        let mut len = [0u8; LEN_BYTES];
        self.get(self.head, &mut len);
        Some(u32::from_le_bytes(len) as usize)
    }

    /// The little-endian `u64` at byte `offset` of the oldest record, if
    /// there is one that long.
    pub fn peek_u64(&self, offset: usize) -> Option<u64> {
        let len = self.peek_len()?;
        if offset.checked_add(8)? > len {
            return None;
        }
        let mut b = [0u8; 8];
        self.get(self.head + LEN_BYTES + offset, &mut b);
        Some(u64::from_le_bytes(b))
    }

    /// Removes the oldest record into `out` (replacing its contents).
    pub fn pop(&mut self, out: &mut Vec<u8>) -> bool {
        let Some(len) = self.peek_len() else {
            return false;
        };
        out.clear();
        out.resize(len, 0);
        self.get(self.head + LEN_BYTES, out);
        self.head = (self.head + LEN_BYTES + len) % self.buf.len();
        self.used -= LEN_BYTES + len;
        self.records -= 1;
        if self.records == 0 {
            self.head = 0;
        }
        true
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
        let mut best: Option<(usize, u64)> = None;
        for (i, r) in self.rings.iter_mut().enumerate() {
            let r = r.get_mut();
            if r.is_empty() {
                continue;
            }
            let ts = r.peek_u64(self.stamp_at).unwrap_or(0);
            if best.is_none_or(|(_, b)| ts < b) {
                best = Some((i, ts));
            }
        }
        let (i, _) = best?;
        let r = self.rings.get_mut(i)?.get_mut();
        r.pop(out).then_some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_back_in_order_across_the_wrap() {
        let mut r = EventRing::new(64);
        let mut out = Vec::new();
        let mut next_in = 0u8;
        let mut next_out = 0u8;
        for round in 0..200 {
            // Records of 1..=20 bytes, each filled with its own number.
            while r.push(&vec![next_in; 1 + (next_in as usize % 20)]) {
                next_in = next_in.wrapping_add(1);
            }
            let lost_before = r.lost();
            assert_eq!(lost_before, round + 1);
            // Drain about half.
            for _ in 0..(r.len() / 2).max(1) {
                assert!(r.pop(&mut out));
                assert_eq!(out.len(), 1 + (next_out as usize % 20));
                assert!(out.iter().all(|&b| b == next_out), "{out:?} {next_out}");
                next_out = next_out.wrapping_add(1);
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
        // Records: an 8-byte id then the timestamp at offset 8.
        let rec = |id: u64, ts: u64| {
            let mut v = id.to_le_bytes().to_vec();
            v.extend_from_slice(&ts.to_le_bytes());
            v
        };
        let mut rs = Rings::new(3, 4 * (LEN_BYTES + 16), 8);
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
        // A timestamp that wraps the ring's end is read whole.
        let mut r = EventRing::new(LEN_BYTES + 16 + 7);
        let mut w = Rings {
            rings: Vec::new(),
            stamp_at: 8,
        };
        assert!(r.push(&[1; 3]));
        assert!(r.pop(&mut out));
        assert!(r.push(&rec(9, 0x1122_3344_5566_7788)));
        assert_eq!(r.peek_u64(8), Some(0x1122_3344_5566_7788));
        assert_eq!(r.peek_u64(9), None);
        w.rings.push(spin::Mutex::new(r));
        assert_eq!(w.pop_oldest(&mut out), Some(0));
        assert_eq!(w.pop_oldest(&mut out), None);
    }

    #[test]
    fn a_full_ring_keeps_the_oldest_and_counts_the_rest() {
        let mut r = EventRing::new(4 * (LEN_BYTES + 8));
        for i in 0..10u64 {
            r.push(&i.to_le_bytes());
        }
        assert_eq!(r.len(), 4);
        assert_eq!(r.lost(), 6);
        let mut out = Vec::new();
        for i in 0..4u64 {
            assert!(r.pop(&mut out));
            assert_eq!(out, i.to_le_bytes());
        }
        assert!(!r.pop(&mut out));
        // A record larger than the whole ring is refused, not split.
        assert!(!r.push(&[0; 100]));
        assert_eq!(r.lost(), 7);
    }
}
