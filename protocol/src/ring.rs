//! A byte ring in memory that two parties share: one producer (a vCPU in
//! VMX root), one consumer (the host, which maps the same memory from the
//! file that backs the guest's RAM). No locks: each side owns one index and
//! publishes it with release ordering; the other reads it with acquire
//! ordering.
//!
//! ```text
//! offset  0  magic   "HVTRING1"
//!         8  size    data bytes (a power of two, at least 4 KiB)
//!        16  head    bytes ever written (the producer's)
//!        24  tail    bytes ever consumed (the consumer's)
//!        32  lost    records the producer dropped: the ring was full
//!        40  records records ever written
//!        64  data    `size` bytes
//! ```
//!
//! A record is a little-endian `u32` length and that many bytes, padded to
//! 8; it may wrap around the end of the data. The producer writes a record
//! only when all of it fits between its head and the consumer's tail, so
//! the consumer never sees a record in the making, and a slow consumer
//! costs records (counted in `lost`), never torn ones. The consumer trusts
//! nothing it reads: a length that cannot be right ends its reading with
//! [`RingError::Corrupt`].

use core::sync::atomic::{AtomicU64, Ordering};

/// The ring's magic number.
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"HVTRING1");
/// Bytes of the header before the data.
pub const RING_HEADER: usize = 64;
/// Smallest data size.
pub const RING_MIN: usize = 4096;

const MAGIC_AT: usize = 0;
const SIZE_AT: usize = 8;
const HEAD_AT: usize = 16;
const TAIL_AT: usize = 24;
const LOST_AT: usize = 32;
const RECORDS_AT: usize = 40;
const LEN_BYTES: usize = 4;

/// What the consumer found wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingError {
    /// The header is not a ring's (magic, size).
    NotARing,
    /// The producer's index or a record's length cannot be right.
    Corrupt,
}

/// A ring over memory it does not own.
pub struct Ring {
    base: *mut u8,
    size: usize,
}

// SAFETY: every access to the shared header is atomic, and the data bytes
// are written only by the producer in the part the consumer does not read
// (between head and tail + size) and read only by the consumer in the
// part it owns; `Ring` holds a raw pointer only.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

/// Bytes a record of `len` payload bytes takes.
pub const fn record_bytes(len: usize) -> usize {
    LEN_BYTES.saturating_add(len).div_ceil(8).saturating_mul(8)
}

impl Ring {
    /// Formats `len` bytes at `base` as an empty ring (the data is the
    /// largest power of two that fits). Returns `None` if it would be
    /// smaller than [`RING_MIN`].
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `len` bytes, aligned to 8,
    /// for as long as the ring is used, and nothing else writes there but
    /// the consumer (its position), whose writes the ring checks.
    pub unsafe fn format(base: *mut u8, len: usize) -> Option<Ring> {
        let size = Self::size_for(len)?;
        let r = Ring { base, size };
        r.word(SIZE_AT).store(size as u64, Ordering::Relaxed);
        r.word(HEAD_AT).store(0, Ordering::Relaxed);
        r.word(TAIL_AT).store(0, Ordering::Relaxed);
        r.word(LOST_AT).store(0, Ordering::Relaxed);
        r.word(RECORDS_AT).store(0, Ordering::Relaxed);
        r.word(MAGIC_AT).store(RING_MAGIC, Ordering::Release);
        Some(r)
    }

    /// The data size [`Self::format`] gives `len` bytes.
    fn size_for(len: usize) -> Option<usize> {
        let room = len.checked_sub(RING_HEADER)?;
        if room < RING_MIN {
            return None;
        }
        // The largest power of two not above `room` (which is non-zero).
        Some(
            1usize.wrapping_shl(
                usize::BITS
                    .wrapping_sub(1)
                    .wrapping_sub(room.leading_zeros()),
            ),
        )
    }

    /// The producer's ring at `base` again, as [`Self::format`] made it
    /// from the same `len`, without reading its header (whose size word
    /// the consumer could have changed): the positions go on as they are.
    ///
    /// # Safety
    /// As for [`Self::format`], and `format(base, len)` was called before.
    pub unsafe fn resume(base: *mut u8, len: usize) -> Option<Ring> {
        Some(Ring {
            base,
            size: Self::size_for(len)?,
        })
    }

    /// The ring at `base`, as its producer formatted it.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `len` bytes, aligned to 8,
    /// for as long as the ring is used.
    pub unsafe fn attach(base: *mut u8, len: usize) -> Result<Ring, RingError> {
        if len < RING_HEADER + RING_MIN || !(base as usize).is_multiple_of(8) {
            return Err(RingError::NotARing);
        }
        let probe = Ring {
            base,
            size: RING_MIN,
        };
        if probe.word(MAGIC_AT).load(Ordering::Acquire) != RING_MAGIC {
            return Err(RingError::NotARing);
        }
        let size = probe.word(SIZE_AT).load(Ordering::Relaxed);
        let fits = usize::try_from(size).ok().filter(|&s| {
            s.is_power_of_two() && s >= RING_MIN && s <= len.saturating_sub(RING_HEADER)
        });
        match fits {
            Some(size) => Ok(Ring { base, size }),
            None => Err(RingError::NotARing),
        }
    }

    /// Data bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the header's 8-aligned words, within the
        // memory `format`/`attach` were given; AtomicU64 has u64's layout.
        unsafe { AtomicU64::from_ptr(self.base.add(at).cast::<u64>()) }
    }

    /// Where position `pos` is in the data (the size is a power of two).
    fn offset(&self, pos: u64) -> usize {
        (pos as usize) & self.size.wrapping_sub(1)
    }

    fn data(&self, pos: u64) -> *mut u8 {
        // SAFETY: the offset is below size, and the data follows the header.
        unsafe { self.base.add(RING_HEADER).add(self.offset(pos)) }
    }

    /// Copies `bytes` into the data from position `pos`, wrapping.
    fn put(&self, pos: u64, bytes: &[u8]) {
        let first = bytes.len().min(self.size.wrapping_sub(self.offset(pos)));
        let (a, b) = bytes.split_at(first);
        // SAFETY: both parts lie within the data, in the producer's part
        // (the caller checked the room); plain bytes.
        unsafe {
            core::ptr::copy_nonoverlapping(a.as_ptr(), self.data(pos), a.len());
            core::ptr::copy_nonoverlapping(b.as_ptr(), self.data(0), b.len());
        }
    }

    /// Writes a record's length word at position `pos` (a record's start,
    /// 8-aligned: the word never wraps).
    fn put_len(&self, pos: u64, len: u32) {
        if self.size.wrapping_sub(self.offset(pos)) >= LEN_BYTES {
            // SAFETY: the 4 bytes lie within the data (checked), in the
            // producer's part; an unaligned write of plain bytes.
            unsafe {
                self.data(pos)
                    .cast::<[u8; LEN_BYTES]>()
                    .write_unaligned(len.to_le_bytes())
            };
        } else {
            self.put(pos, &len.to_le_bytes());
        }
    }

    /// Copies bytes out of the data from position `pos`, wrapping.
    fn get(&self, pos: u64, out: &mut [u8]) {
        let first = out.len().min(self.size.wrapping_sub(self.offset(pos)));
        let (a, b) = out.split_at_mut(first);
        // SAFETY: both parts lie within the data, in the consumer's part
        // (published by the producer's release store of head).
        unsafe {
            core::ptr::copy_nonoverlapping(self.data(pos), a.as_mut_ptr(), a.len());
            core::ptr::copy_nonoverlapping(self.data(0), b.as_mut_ptr(), b.len());
        }
    }

    /// Producer: writes one record, or drops it and counts it when it does
    /// not fit. Returns whether it was written.
    pub fn push(&self, payload: &[u8]) -> bool {
        let need = record_bytes(payload.len()) as u64;
        let head = self.word(HEAD_AT).load(Ordering::Relaxed);
        let tail = self.word(TAIL_AT).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if payload.len() > u32::MAX as usize
            || used > self.size as u64
            || need > (self.size as u64).wrapping_sub(used)
        {
            self.word(LOST_AT).fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.put(head.wrapping_add(LEN_BYTES as u64), payload);
        self.publish(head, payload.len(), need);
        true
    }

    /// Producer: writes the length of the record at `head`, whose bytes
    /// are in place, and publishes it (`need` bytes of the ring).
    fn publish(&self, head: u64, len: usize, need: u64) {
        self.put_len(head, len as u32);
        // One producer: a plain store, not a locked add, on the hit path.
        let records = self.word(RECORDS_AT).load(Ordering::Relaxed);
        self.word(RECORDS_AT)
            .store(records.wrapping_add(1), Ordering::Relaxed);
        self.word(HEAD_AT)
            .store(head.wrapping_add(need), Ordering::Release);
    }

    /// Producer: writes a record of `len` bytes that `fill` makes, in place
    /// when the record's bytes lie in one piece of the data, else in
    /// `scratch` and copied; `fill` gets exactly `len` bytes (whatever they
    /// held) and says whether it filled them. A record that does not fit,
    /// or that `fill` or `scratch` fails, is dropped and counted. Returns
    /// whether it was written.
    pub fn push_with(
        &self,
        len: usize,
        scratch: &mut alloc::vec::Vec<u8>,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> bool {
        let need = record_bytes(len) as u64;
        let head = self.word(HEAD_AT).load(Ordering::Relaxed);
        let tail = self.word(TAIL_AT).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        let start = head.wrapping_add(LEN_BYTES as u64);
        let fits = len <= u32::MAX as usize
            && used <= self.size as u64
            && need <= (self.size as u64).wrapping_sub(used);
        // In one piece: from its first byte to its last, no wrap.
        let whole = len <= self.size.wrapping_sub(self.offset(start));
        let filled = if !fits {
            false
        } else if whole {
            // SAFETY: `len` bytes from `start` lie within the data without
            // wrapping, in the producer's part (the room was checked
            // above): the consumer reads them only after the release store
            // of head below, and nothing else holds a reference to them.
            let buf = unsafe { core::slice::from_raw_parts_mut(self.data(start), len) };
            fill(buf)
        } else {
            scratch.clear();
            scratch.try_reserve(len).is_ok() && {
                scratch.resize(len, 0);
                let ok = fill(scratch);
                if ok {
                    self.put(start, scratch);
                }
                ok
            }
        };
        if !filled {
            self.word(LOST_AT).fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.publish(head, len, need);
        true
    }

    /// Consumer: takes the oldest record if it is at most `max` bytes,
    /// appending `prefix(len)` and then its bytes to `out`. `Ok(None)`: the
    /// ring is empty; `Ok(Some(len))` with `len > max`: the record is left
    /// where it is.
    pub fn pop_append<const N: usize>(
        &self,
        out: &mut alloc::vec::Vec<u8>,
        max: usize,
        prefix: impl FnOnce(usize) -> [u8; N],
    ) -> Result<Option<usize>, RingError> {
        let Some(len) = self.peek_len()? else {
            return Ok(None);
        };
        if len > max {
            return Ok(Some(len));
        }
        let tail = self.word(TAIL_AT).load(Ordering::Relaxed);
        out.extend_from_slice(&prefix(len));
        let at = out.len();
        out.resize(at.saturating_add(len), 0);
        if let Some(dst) = out.get_mut(at..) {
            self.get(tail.wrapping_add(LEN_BYTES as u64), dst);
        }
        self.word(TAIL_AT).store(
            tail.wrapping_add(record_bytes(len) as u64),
            Ordering::Release,
        );
        Ok(Some(len))
    }

    /// Consumer: takes the oldest record into `out` (emptied first).
    /// `Ok(false)`: the ring is empty.
    pub fn pop(&self, out: &mut alloc::vec::Vec<u8>) -> Result<bool, RingError> {
        out.clear();
        Ok(self.pop_append(out, usize::MAX, |_| [0u8; 0])?.is_some())
    }

    /// Consumer: the oldest record's length, without taking it; `Ok(None)`
    /// when the ring is empty.
    pub fn peek_len(&self) -> Result<Option<usize>, RingError> {
        let tail = self.word(TAIL_AT).load(Ordering::Relaxed);
        let head = self.word(HEAD_AT).load(Ordering::Acquire);
        let avail = head.wrapping_sub(tail);
        if avail == 0 {
            return Ok(None);
        }
        if avail > self.size as u64 || avail < LEN_BYTES as u64 {
            return Err(RingError::Corrupt);
        }
        let mut len = [0u8; LEN_BYTES];
        self.get(tail, &mut len);
        let len = u32::from_le_bytes(len) as usize;
        if record_bytes(len) as u64 > avail {
            return Err(RingError::Corrupt);
        }
        Ok(Some(len))
    }

    /// Consumer: the little-endian `u64` at byte `offset` of the oldest
    /// record, when there is a record that long.
    pub fn peek_u64(&self, offset: usize) -> Option<u64> {
        let len = self.peek_len().ok()??;
        if offset.checked_add(8)? > len {
            return None;
        }
        let tail = self.word(TAIL_AT).load(Ordering::Relaxed);
        let mut b = [0u8; 8];
        self.get(
            tail.wrapping_add(LEN_BYTES as u64)
                .wrapping_add(offset as u64),
            &mut b,
        );
        Some(u64::from_le_bytes(b))
    }

    /// The producer's position: bytes ever written (acquire: the records
    /// before it are whole).
    pub fn head(&self) -> u64 {
        self.word(HEAD_AT).load(Ordering::Acquire)
    }

    /// The consumer's position: bytes ever consumed.
    pub fn tail(&self) -> u64 {
        self.word(TAIL_AT).load(Ordering::Acquire)
    }

    /// Bytes written and not yet consumed, as either side sees them now
    /// (at most the size: a tail that cannot be right reads as full).
    pub fn used(&self) -> usize {
        let used = self.head().wrapping_sub(self.tail());
        usize::try_from(used).map_or(self.size, |u| u.min(self.size))
    }

    /// Whether nothing is waiting for the consumer.
    pub fn is_empty(&self) -> bool {
        self.head() == self.tail()
    }

    /// Consumer: drops everything published (after [`RingError::Corrupt`],
    /// so that the ring serves again).
    pub fn discard(&self) {
        let head = self.word(HEAD_AT).load(Ordering::Acquire);
        self.word(TAIL_AT).store(head, Ordering::Release);
    }

    /// Producer: counts a record it could not even build.
    pub fn count_lost(&self) {
        self.word(LOST_AT).fetch_add(1, Ordering::Relaxed);
    }

    /// Records the producer dropped.
    pub fn lost(&self) -> u64 {
        self.word(LOST_AT).load(Ordering::Relaxed)
    }

    /// Records ever written.
    pub fn records(&self) -> u64 {
        self.word(RECORDS_AT).load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use alloc::vec::Vec;

    fn ring(mem: &mut [u64]) -> Ring {
        // SAFETY: the test's own buffer, 8-aligned, alive for the test.
        unsafe { Ring::format(mem.as_mut_ptr().cast(), mem.len() * 8) }.unwrap()
    }

    #[test]
    fn records_come_out_whole_and_in_order_across_the_wrap() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        assert_eq!(r.size(), RING_MIN);
        let mut out = Vec::new();
        let mut n = 0u32;
        // Many passes over the data, each record of another length.
        for round in 0..2000u32 {
            let len = (round * 37 % 300) as usize;
            let rec: Vec<u8> = (0..len).map(|i| (i as u32 ^ round) as u8).collect();
            assert!(r.push(&rec));
            assert!(r.pop(&mut out).unwrap());
            assert_eq!(out, rec, "record {round}");
            n += 1;
        }
        assert!(!r.pop(&mut out).unwrap());
        assert_eq!((r.records(), r.lost()), (u64::from(n), 0));
    }

    /// Records made in place read back as pushed ones do, across the wrap
    /// (where they go through the scratch); a fill that fails and a record
    /// with no room are dropped and counted.
    #[test]
    fn records_filled_in_place_come_out_as_pushed_ones() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        let lo = mem.as_ptr() as usize;
        let ring_bytes = lo..lo + mem.len() * 8;
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        let (mut inplace, mut copied) = (0, 0);
        for round in 0..2000u32 {
            let len = (round * 41 % 300) as usize;
            let rec: Vec<u8> = (0..len).map(|i| (i as u32 ^ round) as u8).collect();
            let mut in_ring = false;
            assert!(r.push_with(len, &mut scratch, |buf| {
                in_ring = ring_bytes.contains(&(buf.as_ptr() as usize));
                buf.copy_from_slice(&rec);
                true
            }));
            if in_ring {
                inplace += 1;
            } else {
                copied += 1;
            }
            assert!(r.pop(&mut out).unwrap());
            assert_eq!(out, rec, "record {round}");
        }
        assert!(
            inplace > 1000 && copied > 0,
            "{inplace} in place, {copied} copied"
        );
        assert!(!r.push_with(8, &mut scratch, |_| false));
        assert!(!r.push_with(RING_MIN, &mut scratch, |_| true));
        assert!(!r.pop(&mut out).unwrap());
        assert_eq!((r.records(), r.lost()), (2000, 2));
    }

    #[test]
    fn records_appended_come_after_their_prefix_and_long_ones_stay() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        let mut out = vec![9u8];
        for round in 0..500u32 {
            let len = (round * 53 % 200) as usize;
            let rec: Vec<u8> = (0..len).map(|i| (i as u32 ^ round) as u8).collect();
            assert!(r.push(&rec));
            if len > 150 {
                // Too long for the room: left for the next reader.
                assert_eq!(r.pop_append(&mut out, 150, |n| [n as u8]), Ok(Some(len)));
                let mut whole = Vec::new();
                assert!(r.pop(&mut whole).unwrap());
                assert_eq!(whole, rec);
                continue;
            }
            out.truncate(1);
            assert_eq!(
                r.pop_append(&mut out, 150, |n| [n as u8, 0xAA]),
                Ok(Some(len))
            );
            assert_eq!(out[..3], [9, len as u8, 0xAA], "record {round}");
            assert_eq!(out[3..], rec[..], "record {round}");
        }
        assert_eq!(r.pop_append(&mut out, 150, |_| [0u8; 0]), Ok(None));
    }

    #[test]
    fn a_full_ring_drops_and_counts_and_keeps_what_it_has() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        let rec = [7u8; 100];
        let fit = RING_MIN / record_bytes(rec.len());
        for _ in 0..fit {
            assert!(r.push(&rec));
        }
        assert!(!r.push(&rec));
        assert!(!r.push(&[1; 2000]));
        assert_eq!(r.lost(), 2);
        let mut out = Vec::new();
        for _ in 0..fit {
            assert!(r.pop(&mut out).unwrap());
            assert_eq!(out, rec);
        }
        assert!(!r.pop(&mut out).unwrap());
        assert!(!r.push(&vec![0; RING_MIN]), "larger than the ring");
    }

    #[test]
    fn the_consumer_peeks_before_it_takes() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        assert_eq!(r.peek_len(), Ok(None));
        assert_eq!(r.peek_u64(0), None);
        assert!(r.is_empty() && r.used() == 0);
        // Move the positions so that the next record wraps the end.
        let filler = [0u8; RING_MIN - 4 - 12];
        assert!(r.push(&filler));
        let mut out = Vec::new();
        assert!(r.pop(&mut out).unwrap());
        let mut rec = 7u64.to_le_bytes().to_vec();
        rec.extend_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        assert!(r.push(&rec));
        assert_eq!(r.used(), record_bytes(16));
        assert_eq!(r.peek_len(), Ok(Some(16)));
        assert_eq!(
            r.peek_u64(8),
            Some(0x1122_3344_5566_7788),
            "read across the wrap"
        );
        assert_eq!(r.peek_u64(9), None, "past the record");
        assert!(!r.is_empty());
        assert!(r.pop(&mut out).unwrap());
        assert_eq!(out, rec);
        // Discarding leaves an empty ring that serves again; a record the
        // producer could not build is counted.
        assert!(r.push(b"x"));
        r.discard();
        assert!(r.is_empty());
        r.count_lost();
        assert_eq!(r.lost(), 1);
        assert!(r.push(b"y"));
        assert!(r.pop(&mut out).unwrap());
        assert_eq!(out, b"y");
        // A length the producer never published is refused by the peek too.
        assert!(r.push(b"z"));
        let tail = r.tail();
        r.put(tail, &10_000u32.to_le_bytes());
        assert_eq!(r.peek_len(), Err(RingError::Corrupt));
        assert_eq!(r.peek_u64(0), None);
    }

    #[test]
    fn the_consumer_trusts_nothing_it_reads() {
        let mut mem = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        let r = ring(&mut mem);
        assert!(r.push(b"hello"));
        let mut out = Vec::new();
        // A length past what was published.
        r.put(0, &10_000u32.to_le_bytes());
        assert_eq!(r.pop(&mut out), Err(RingError::Corrupt));
        // A head beyond the ring's size.
        r.word(HEAD_AT)
            .store(RING_MIN as u64 * 3, Ordering::Relaxed);
        assert_eq!(r.pop(&mut out), Err(RingError::Corrupt));
        // Not a ring at all.
        let mut other = vec![0u64; (RING_HEADER + RING_MIN) / 8];
        // SAFETY: the test's own buffer.
        let e = unsafe { Ring::attach(other.as_mut_ptr().cast(), other.len() * 8) };
        assert_eq!(e.err(), Some(RingError::NotARing));
        // A size that does not fit the memory given.
        let len = mem.len() * 8;
        // SAFETY: the test's own buffer, shorter than the ring says.
        let e = unsafe { Ring::attach(mem.as_mut_ptr().cast(), len - 8) };
        assert_eq!(e.err(), Some(RingError::NotARing));
    }
}
