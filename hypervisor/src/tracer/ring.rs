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
