//! A probe hit as raw data, and its compact binary form for the per-vCPU
//! rings: VMX root stores events, the host decodes and renders them.
//!
//! ```text
//! record (little-endian, length a multiple of 8):
//!  0  u8   version (EVENT_VERSION)
//!  1  u8   reserved, 0
//!  2  u16  number of values
//!  4  u32  record length in bytes, header and padding included
//!  8  u32  probe id
//! 12  u32  cpu
//! 16  i32  pid
//! 20  u32  reserved, 0
//! 24  u64  timestamp, ns
//! 32  u64  ip: the probed address (entry) or the function (return)
//! 40  u64  ret_ip: where the function returns to (return probes), else 0
//! 48  [16] comm, NUL-padded
//! 64  values, each a tag byte and a payload:
//!       0            fault       -
//!       1..=13       IntType     the value, 1/2/4/8 bytes by type
//!       TAG_STR      string      u16 length, bytes
//!       TAG_SYMBOL   symbol      u64 address
//!       TAG_SYMSTR   symstr      u64 address
//!     then zero padding to a multiple of 8
//! ```

use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

use super::fetch::{FetchedValue, MAX_STRING_SIZE, TASK_COMM_LEN};
use super::spec::IntType;

/// The record format version.
pub const EVENT_VERSION: u8 = 1;
/// Bytes before the first value.
pub const HEADER_LEN: usize = 64;
/// Byte offset of the timestamp in a record (the rings are merged by it).
pub const TIMESTAMP_AT: usize = 24;

const TAG_FAULT: u8 = 0;
const TAG_STR: u8 = 14;
const TAG_SYMBOL: u8 = 15;
const TAG_SYMSTR: u8 = 16;

/// Who hit which probe, where and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EventHeader {
    /// The probe table's id for the probe.
    pub probe_id: u32,
    /// The vCPU (the guest's CPU number).
    pub cpu: u32,
    /// `current->pid` (0: idle).
    pub pid: i32,
    /// Trace clock, nanoseconds.
    pub timestamp_ns: u64,
    /// Entry probes: the probed address (the fentry site, which is where
    /// the kernel's own kprobe on the function sits: `SYM+0`, or `SYM+4`
    /// behind an `endbr64`). Return probes: the function's address.
    pub ip: u64,
    /// Return probes: the return address. 0 for entry probes.
    pub ret_ip: u64,
    /// `current->comm`, NUL-padded.
    pub comm: [u8; TASK_COMM_LEN],
}

impl EventHeader {
    /// `comm` up to its first NUL.
    pub fn comm_bytes(&self) -> &[u8] {
        let end = self
            .comm
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(TASK_COMM_LEN);
        self.comm.get(..end).unwrap_or(&[])
    }

    /// `comm` from bytes (cut to 15 so a NUL always ends it, as the kernel keeps it).
    pub fn set_comm(&mut self, comm: &[u8]) {
        self.comm = [0; TASK_COMM_LEN];
        let end = comm
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(comm.len())
            .min(TASK_COMM_LEN - 1);
        for (d, s) in self.comm.iter_mut().zip(comm.iter().take(end)) {
            *d = *s;
        }
    }
}

/// One probe hit.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawEvent {
    /// Who, where, when.
    pub header: EventHeader,
    /// The fetched arguments, in the probe's order.
    pub values: Vec<FetchedValue>,
}

/// Why bytes are not a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the header or the record length says.
    Truncated,
    /// A version this code does not read.
    Version(u8),
    /// A record length below the header or not a multiple of 8.
    BadLength,
    /// An unknown value tag.
    BadTag(u8),
    /// The values run past the record length.
    Overrun,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated => f.write_str("truncated event record"),
            DecodeError::Version(v) => {
                write!(f, "event record version {v} (expected {EVENT_VERSION})")
            }
            DecodeError::BadLength => f.write_str("bad event record length"),
            DecodeError::BadTag(t) => write!(f, "bad event value tag {t}"),
            DecodeError::Overrun => f.write_str("event values overrun the record"),
        }
    }
}

impl core::error::Error for DecodeError {}

/// The longest string a record carries.
const MAX_STR: usize = MAX_STRING_SIZE - 1;

fn value_len(v: &FetchedValue) -> usize {
    1 + match v {
        FetchedValue::Fault => 0,
        FetchedValue::Int { ty, .. } => ty.size(),
        FetchedValue::Str(s) => 2 + s.len().min(MAX_STR),
        FetchedValue::Symbol(_) | FetchedValue::SymStr(_) => 8,
    }
}

/// The record length in bytes of an event with `values`.
#[inline]
pub fn encoded_len(values: &[FetchedValue]) -> usize {
    let n = HEADER_LEN
        + values
            .iter()
            .take(u16::MAX as usize)
            .map(value_len)
            .sum::<usize>();
    n.next_multiple_of(8)
}

/// Two 4-byte halves as one 8-byte word.
#[inline]
fn concat4(a: [u8; 4], b: [u8; 4]) -> [u8; 8] {
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Eight bytes of `comm` from `at` (0 or 8).
#[inline]
fn comm_half(comm: &[u8; 16], at: usize) -> [u8; 8] {
    comm.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; 8])
}

/// Writes the record of an event with `header` and `values` into `buf`
/// (what [`RawEvent::encode_into`] does, without a `RawEvent`: the hot
/// path builds its values on the stack); `None` if it does not fit.
#[inline]
pub fn encode_parts(
    header: &EventHeader,
    values: &[FetchedValue],
    buf: &mut [u8],
) -> Option<usize> {
    let len = encoded_len(values);
    let rec = buf.get_mut(..len)?;
    let total = u32::try_from(len).ok()?;
    let count = values.len().min(u16::MAX as usize);
    let h = header;
    // The header, as one fixed-size array: its stores need no bounds
    // checks and no copy calls (every hit writes one).
    let (head, _) = rec.split_first_chunk_mut::<HEADER_LEN>()?;
    let words: [[u8; 8]; 8] = [
        concat4(
            [EVENT_VERSION, 0, count as u8, (count >> 8) as u8],
            total.to_le_bytes(),
        ),
        concat4(h.probe_id.to_le_bytes(), h.cpu.to_le_bytes()),
        concat4(h.pid.to_le_bytes(), [0; 4]),
        h.timestamp_ns.to_le_bytes(),
        h.ip.to_le_bytes(),
        h.ret_ip.to_le_bytes(),
        comm_half(&h.comm, 0),
        comm_half(&h.comm, 8),
    ];
    for (dst, src) in head.chunks_exact_mut(8).zip(words) {
        dst.copy_from_slice(&src);
    }
    let mut w = Writer {
        buf: rec,
        at: HEADER_LEN,
    };
    for v in values.iter().take(count) {
        match v {
            FetchedValue::Fault => w.put(&[TAG_FAULT]),
            FetchedValue::Int { ty, value } => {
                w.put(&[ty.tag()]);
                w.put(value.to_le_bytes().get(..ty.size()).unwrap_or(&[]));
            }
            FetchedValue::Str(s) => {
                let s = s.get(..MAX_STR).unwrap_or(s);
                w.put(&[TAG_STR]);
                w.put(&(s.len() as u16).to_le_bytes());
                w.put(s);
            }
            FetchedValue::Symbol(a) => {
                w.put(&[TAG_SYMBOL]);
                w.put(&a.to_le_bytes());
            }
            FetchedValue::SymStr(a) => {
                w.put(&[TAG_SYMSTR]);
                w.put(&a.to_le_bytes());
            }
        }
    }
    // The padding up to a multiple of 8.
    if let Some(pad) = w.buf.get_mut(w.at..len) {
        pad.fill(0);
        w.at = len;
    }
    (w.at == len).then_some(len)
}

impl RawEvent {
    /// The record length in bytes.
    pub fn encoded_len(&self) -> usize {
        encoded_len(&self.values)
    }

    /// Writes the record into `buf`; `None` if it does not fit (nothing
    /// meaningful is written then). Strings longer than 4095 bytes and
    /// values past 65535 are cut.
    pub fn encode_into(&self, buf: &mut [u8]) -> Option<usize> {
        encode_parts(&self.header, &self.values, buf)
    }

    /// The record as a new vector.
    pub fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; self.encoded_len()];
        let n = self.encode_into(&mut buf).unwrap_or(0);
        buf.truncate(n);
        buf
    }

    /// Reads one record from the front of `buf`; returns it and its length
    /// (where the next record starts).
    pub fn decode(buf: &[u8]) -> Result<(RawEvent, usize), DecodeError> {
        let mut r = ByteReader { buf, at: 0 };
        let version = r.u8()?;
        if version != EVENT_VERSION {
            return Err(DecodeError::Version(version));
        }
        r.u8()?;
        let count = r.u16()?;
        let total = r.u32()? as usize;
        if total < HEADER_LEN || !total.is_multiple_of(8) {
            return Err(DecodeError::BadLength);
        }
        let rec = buf.get(..total).ok_or(DecodeError::Truncated)?;
        let mut r = ByteReader { buf: rec, at: 8 };
        let mut h = EventHeader {
            probe_id: r.u32()?,
            cpu: r.u32()?,
            pid: r.u32()? as i32,
            ..EventHeader::default()
        };
        r.u32()?;
        h.timestamp_ns = r.u64()?;
        h.ip = r.u64()?;
        h.ret_ip = r.u64()?;
        h.comm.copy_from_slice(r.take(TASK_COMM_LEN)?);
        let mut values = Vec::with_capacity(usize::from(count).min(rec.len() - HEADER_LEN));
        for _ in 0..count {
            let tag = r.u8()?;
            let v = match tag {
                TAG_FAULT => FetchedValue::Fault,
                TAG_STR => {
                    let n = r.u16()?;
                    FetchedValue::Str(r.take(usize::from(n))?.to_vec())
                }
                TAG_SYMBOL => FetchedValue::Symbol(r.u64()?),
                TAG_SYMSTR => FetchedValue::SymStr(r.u64()?),
                t => {
                    let ty = IntType::from_tag(t).ok_or(DecodeError::BadTag(t))?;
                    let mut b = [0u8; 8];
                    let src = r.take(ty.size())?;
                    b.get_mut(..src.len())
                        .ok_or(DecodeError::Overrun)?
                        .copy_from_slice(src);
                    FetchedValue::Int {
                        ty,
                        value: u64::from_le_bytes(b),
                    }
                }
            };
            values.push(v);
        }
        Ok((RawEvent { header: h, values }, total))
    }
}

struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        if let Some(d) = self.buf.get_mut(self.at..self.at + b.len()) {
            d.copy_from_slice(b);
            self.at += b.len();
        } else {
            // Leaves `at` short of the length, which encode_into reports.
            self.at = usize::MAX / 2;
        }
    }
}

struct ByteReader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).ok_or(DecodeError::Overrun)?;
        let s = self.buf.get(self.at..end).ok_or(if self.at < HEADER_LEN {
            DecodeError::Truncated
        } else {
            DecodeError::Overrun
        })?;
        self.at = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let b = self.take(N)?;
        // `take` returns exactly N bytes, so this never fails.
        b.first_chunk().copied().ok_or(DecodeError::Overrun)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        let [b] = self.array()?;
        Ok(b)
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    fn sample() -> RawEvent {
        let mut header = EventHeader {
            probe_id: 7,
            cpu: 3,
            pid: 123,
            timestamp_ns: 12_345_678_000,
            ip: 0xffff_ffff_8123_4560,
            ret_ip: 0,
            comm: [0; 16],
        };
        header.set_comm(b"cat");
        let mut values = vec![
            FetchedValue::Fault,
            FetchedValue::Str(b"/etc/hostname".to_vec()),
        ];
        for (i, ty) in IntType::ALL.into_iter().enumerate() {
            values.push(FetchedValue::Int {
                ty,
                value: ty.truncate(0x8877_6655_4433_2211 + i as u64),
            });
        }
        values.push(FetchedValue::Symbol(0xffff_ffff_8100_0000));
        values.push(FetchedValue::SymStr(42));
        values.push(FetchedValue::Str(Vec::new()));
        RawEvent { header, values }
    }

    #[test]
    fn round_trip() {
        let ev = sample();
        let bytes = ev.encode();
        assert_eq!(bytes.len(), ev.encoded_len());
        assert_eq!(bytes.len() % 8, 0);
        let (back, n) = RawEvent::decode(&bytes).unwrap();
        assert_eq!(n, bytes.len());
        assert_eq!(back, ev);
        assert_eq!(back.header.comm_bytes(), b"cat");
    }

    #[test]
    fn records_follow_each_other() {
        let a = sample();
        let mut b = sample();
        b.header.probe_id = 8;
        b.values.truncate(1);
        let mut ring = a.encode();
        ring.extend_from_slice(&b.encode());
        let (x, n) = RawEvent::decode(&ring).unwrap();
        let (y, m) = RawEvent::decode(&ring[n..]).unwrap();
        assert_eq!((x, y), (a, b));
        assert_eq!(n + m, ring.len());
    }

    #[test]
    fn no_room_is_reported() {
        let ev = sample();
        let mut small = vec![0u8; ev.encoded_len() - 1];
        assert_eq!(ev.encode_into(&mut small), None);
    }

    #[test]
    fn long_strings_are_cut() {
        let ev = RawEvent {
            values: vec![FetchedValue::Str(vec![b'a'; 10_000])],
            ..RawEvent::default()
        };
        let (back, _) = RawEvent::decode(&ev.encode()).unwrap();
        assert_eq!(
            back.values,
            vec![FetchedValue::Str(vec![b'a'; MAX_STRING_SIZE - 1])]
        );
    }

    #[test]
    fn comm_is_cut_to_fifteen() {
        let mut h = EventHeader::default();
        h.set_comm(b"a_very_long_command_name");
        assert_eq!(h.comm_bytes(), b"a_very_long_com");
        h.set_comm(b"ab\0cd");
        assert_eq!(h.comm_bytes(), b"ab");
    }

    #[test]
    fn every_prefix_and_corruption_decodes_or_errs() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(RawEvent::decode(&bytes[..n]).is_err(), "prefix {n}");
        }
        // Flip each byte through a few values: never a panic.
        for i in 0..bytes.len() {
            for x in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] = x;
                let _ = RawEvent::decode(&b);
            }
        }
        assert_eq!(
            RawEvent::decode(&[2, 0, 0, 0]).unwrap_err(),
            DecodeError::Version(2)
        );
        assert_eq!(
            RawEvent::decode(&[1, 0, 0, 0, 65, 0, 0, 0])
                .unwrap_err()
                .to_string(),
            "bad event record length"
        );
    }
}
