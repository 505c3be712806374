//! Framing: how a [`Frame`] travels over a byte stream.
//!
//! ```text
//!  0x00 | COBS( version | seq | body | crc ) | 0x00
//!         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
//!   version  u16, little-endian, 2 bytes    \
//!   seq      u32, little-endian, 4 bytes     } the payload, at most MAX_FRAME bytes
//!   body     postcard encoding of Body      /
//!   crc      CRC-32 (IEEE) of the payload, u32 little-endian, 4 bytes
//! ```
//!
//! - **Header.** `version` and `seq` are fixed-width and outside postcard, and
//!   every future version keeps them so. A receiver therefore reads the version
//!   before it touches the body, and can answer a peer of another version with
//!   [`Response::VersionMismatch`](crate::Response::VersionMismatch) under the
//!   right `seq`.
//! - **CRC.** It covers the header and the body, and is checked before either
//!   is believed.
//! - **COBS and delimiters.** COBS ([`crate::cobs`]) removes every zero byte,
//!   so `0x00` marks frame boundaries. The encoder writes a delimiter before
//!   *and* after each frame. The leading one ends whatever garbage or cut frame
//!   came before, so a good frame is decoded even right after noise, and the
//!   empty frames that two adjacent delimiters make are skipped silently.
//!
//! Overhead per frame, beyond the postcard body: 2 delimiters + 6 header +
//! 4 CRC + the COBS code bytes, which are 1 for a body of up to 244 bytes and
//! at most 1 + ⌊(body + 10) / 254⌋ in general. So **13 bytes** for most
//! messages (a `Ping` with a nonce below 128 is 16 bytes on the wire), and 29
//! for the largest frame ([`MAX_WIRE_FRAME`] = 4119 bytes).

use alloc::vec::Vec;
use core::fmt;
use core::num::NonZeroU8;

use crate::cobs::{self, CobsError};
use crate::crc32::{crc32, Crc32};
use crate::message::{Body, Frame};
use crate::PROTOCOL_VERSION;

/// Bytes of the fixed header: `version` (u16) and `seq` (u32).
pub const HEADER_LEN: usize = 6;

/// Bytes of the CRC trailer.
pub const CRC_LEN: usize = 4;

/// The longest payload (header + postcard body, without CRC) a frame may have.
///
/// 4 KiB: a [`StatusReport`](crate::StatusReport) naming every VM-exit reason
/// takes about 2 KiB, and trace records are batched into frames of this size.
/// The decoder's buffer is this plus the CRC (one page and four bytes,
/// allocated once), and at 115200 baud the longest frame keeps the channel
/// busy for about 0.36 s.
pub const MAX_FRAME: usize = 4096;

/// The longest frame on the wire: both delimiters and the COBS encoding of
/// [`MAX_FRAME`] payload bytes plus the CRC.
pub const MAX_WIRE_FRAME: usize = 2 + cobs::max_encoded_len(MAX_FRAME + CRC_LEN);

/// The decoder never holds more decoded bytes than this.
const MAX_DECODED: usize = MAX_FRAME + CRC_LEN;

/// The frame delimiter.
const DELIMITER: u8 = 0x00;

// ---------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------

/// Appends the wire encoding of `frame` (delimiters included) to `out`.
///
/// `frame.version` is written as it is; [`Frame::new`] sets it to
/// [`PROTOCOL_VERSION`]. On error `out` is left as it was.
///
/// Encoding streams straight into `out`: no other buffer is allocated, and a
/// body too long for [`MAX_FRAME`] makes `out` grow by at most
/// [`MAX_WIRE_FRAME`] before the error.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let start = out.len();
    out.push(DELIMITER);
    let mut w = PayloadWriter {
        cobs: cobs::Encoder::begin(out),
        out,
        crc: Crc32::new(),
        len: 0,
    };
    w.put_all(&frame.version.to_le_bytes());
    w.put_all(&frame.seq.to_le_bytes());
    let w = match postcard::serialize_with_flavor(&frame.body, w) {
        Ok(w) => w,
        Err(e) => {
            out.truncate(start);
            return Err(EncodeError::Postcard(e));
        }
    };
    if w.len > MAX_FRAME {
        let len = w.len;
        out.truncate(start);
        return Err(EncodeError::TooLong { len });
    }
    let PayloadWriter {
        out, mut cobs, crc, ..
    } = w;
    for b in crc.finish().to_le_bytes() {
        cobs.push(out, b);
    }
    cobs.finish(out);
    out.push(DELIMITER);
    Ok(())
}

/// A postcard output that hashes and COBS-encodes the payload into the
/// caller's `Vec` as it is produced. Past [`MAX_FRAME`] it only counts.
struct PayloadWriter<'a> {
    out: &'a mut Vec<u8>,
    cobs: cobs::Encoder,
    crc: Crc32,
    /// Payload bytes produced so far, kept or not.
    len: usize,
}

impl PayloadWriter<'_> {
    #[inline]
    fn put(&mut self, byte: u8) {
        self.len = self.len.saturating_add(1);
        if self.len <= MAX_FRAME {
            self.crc.update_byte(byte);
            self.cobs.push(self.out, byte);
        }
    }

    fn put_all(&mut self, bytes: &[u8]) {
        let end = self.len.saturating_add(bytes.len());
        if end <= MAX_FRAME {
            // All kept: hashed and stuffed in bulk.
            self.len = end;
            self.crc.update(bytes);
            self.cobs.push_all(self.out, bytes);
        } else {
            for &b in bytes {
                self.put(b);
            }
        }
    }
}

impl postcard::ser_flavors::Flavor for PayloadWriter<'_> {
    type Output = Self;

    #[inline]
    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.put(data);
        Ok(())
    }

    #[inline]
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.put_all(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Self> {
        Ok(self)
    }
}

/// Why a frame could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EncodeError {
    /// The payload would be `len` bytes, more than [`MAX_FRAME`].
    TooLong {
        /// Header plus body bytes.
        len: usize,
    },
    /// postcard refused the body (not expected for the types of this crate).
    Postcard(postcard::Error),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::TooLong { len } => {
                write!(
                    f,
                    "frame payload of {len} bytes exceeds the {MAX_FRAME}-byte limit"
                )
            }
            EncodeError::Postcard(e) => write!(f, "cannot serialize frame body: {e}"),
        }
    }
}

impl core::error::Error for EncodeError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            EncodeError::Postcard(e) => Some(e),
            EncodeError::TooLong { .. } => None,
        }
    }
}

// ---------------------------------------------------------------------------
// The fatal frame
// ---------------------------------------------------------------------------

/// The longest reason [`encode_fatal`] puts in an
/// [`Event::Fatal`](crate::Event::Fatal) frame, in bytes; a longer one is
/// cut at the last character boundary within it.
pub const MAX_FATAL_REASON: usize = 480;

/// The sequence number of a fatal frame: the fatal path cannot reach the
/// event counter (its owner may be the code that failed), so the frame
/// takes no place in the event sequence.
pub const FATAL_SEQ: u32 = u32::MAX;

/// The payload of the largest fatal frame: header, the body's two variant
/// tags, the reason's length (a varint of at most 2 bytes for
/// [`MAX_FATAL_REASON`]), the reason and the CRC.
const FATAL_PAYLOAD_MAX: usize = HEADER_LEN + 2 + 2 + MAX_FATAL_REASON + CRC_LEN;

/// The most bytes [`encode_fatal`] emits, both delimiters included.
pub const FATAL_WIRE_MAX: usize = 2 + cobs::max_encoded_len(FATAL_PAYLOAD_MAX);

/// postcard's variant index of [`Body::Event`].
const BODY_EVENT: u8 = 2;
/// postcard's variant index of [`Event::Fatal`](crate::Event::Fatal).
const EVENT_FATAL: u8 = 4;

/// Emits, one byte at a time, the wire encoding of
/// `Frame::event(FATAL_SEQ, Event::Fatal { reason })` with `reason` cut to
/// [`MAX_FATAL_REASON`] bytes; returns how many bytes it emitted (at most
/// [`FATAL_WIRE_MAX`]).
///
/// This is [`encode`] for the one frame a failing hypervisor sends: it
/// allocates nothing (the payload is built in a buffer of about 500 bytes
/// on the caller's stack) and cannot fail. The bytes are the same as
/// [`encode`]'s for that frame. Like every frame it starts with a
/// delimiter, which ends whatever frame the sender had half written: the
/// receiver reports that one as malformed and decodes this one.
pub fn encode_fatal(reason: &str, mut emit: impl FnMut(u8)) -> usize {
    let mut cut = reason.len().min(MAX_FATAL_REASON);
    while !reason.is_char_boundary(cut) {
        cut = cut.saturating_sub(1);
    }
    let text = reason.as_bytes().get(..cut).unwrap_or_default();

    let mut payload = FatalPayload {
        bytes: [0; FATAL_PAYLOAD_MAX],
        len: 0,
    };
    for &b in PROTOCOL_VERSION
        .to_le_bytes()
        .iter()
        .chain(FATAL_SEQ.to_le_bytes().iter())
    {
        payload.put(b);
    }
    payload.put(BODY_EVENT);
    payload.put(EVENT_FATAL);
    // postcard's varint (LEB128) of the string's length, then its bytes.
    let mut len = text.len();
    loop {
        let low = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            payload.put(low);
            break;
        }
        payload.put(low | 0x80);
    }
    for &b in text {
        payload.put(b);
    }
    for b in crc32(payload.filled()).to_le_bytes() {
        payload.put(b);
    }

    let mut emitted = 0usize;
    let mut out = |b: u8| {
        emit(b);
        emitted = emitted.saturating_add(1);
    };
    out(DELIMITER);
    cobs_emit(payload.filled(), &mut out);
    out(DELIMITER);
    emitted
}

/// The payload of a fatal frame, built without allocation.
struct FatalPayload {
    bytes: [u8; FATAL_PAYLOAD_MAX],
    len: usize,
}

impl FatalPayload {
    /// Appends a byte (the buffer is sized for the largest fatal frame, so
    /// nothing is ever dropped).
    fn put(&mut self, byte: u8) {
        if let Some(slot) = self.bytes.get_mut(self.len) {
            *slot = byte;
            self.len = self.len.saturating_add(1);
        }
    }

    fn filled(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }
}

/// Emits the canonical COBS encoding of `data` (as [`cobs::encode`] writes
/// it), reading ahead in `data` instead of patching code bytes in an output
/// buffer.
fn cobs_emit(data: &[u8], out: &mut impl FnMut(u8)) {
    const FULL: usize = 254;
    let mut rest = data;
    loop {
        let window = rest.get(..rest.len().min(FULL)).unwrap_or_default();
        match window.iter().position(|&b| b == 0) {
            Some(zero) => {
                // `zero` data bytes, then the zero the block stands for.
                out(u8::try_from(zero.saturating_add(1)).unwrap_or(u8::MAX));
                window.iter().take(zero).for_each(|&b| out(b));
                rest = rest.get(zero.saturating_add(1)..).unwrap_or_default();
            }
            None if window.len() == FULL => {
                out(u8::MAX);
                window.iter().for_each(|&b| out(b));
                rest = rest.get(FULL..).unwrap_or_default();
                if rest.is_empty() {
                    // Canonical: no empty block after a full one at the end.
                    return;
                }
            }
            None => {
                out(u8::try_from(window.len().saturating_add(1)).unwrap_or(u8::MAX));
                window.iter().for_each(|&b| out(b));
                return;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------

/// Why the bytes between two delimiters are not a frame of this version.
///
/// Every variant is recoverable: the decoder is already looking for the next
/// frame when it reports one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes are not a COBS encoding (a cut frame, usually).
    Cobs(CobsError),
    /// More than [`MAX_FRAME`] payload bytes and the CRC arrived without a
    /// delimiter. Reported as soon as the limit is crossed; the rest, up to
    /// the next delimiter, is skipped.
    TooLong {
        /// Decoded bytes so far (a lower bound of the frame's length).
        len: usize,
    },
    /// Fewer bytes than a header and a CRC.
    Truncated {
        /// Decoded bytes.
        len: usize,
    },
    /// The CRC carried by the frame does not match its bytes.
    Crc {
        /// The CRC in the frame's trailer.
        expected: u32,
        /// The CRC of the received header and body.
        found: u32,
    },
    /// A sound frame of another protocol version; its body was not read.
    UnsupportedVersion {
        /// The frame's version.
        found: u16,
        /// The frame's sequence number, to answer it with.
        seq: u32,
    },
    /// A sound frame of this version whose body does not deserialize.
    Postcard(postcard::Error),
    /// The body deserialized but bytes were left over.
    TrailingBytes {
        /// How many.
        count: usize,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Cobs(e) => write!(f, "bad frame encoding: {e}"),
            DecodeError::TooLong { len } => write!(
                f,
                "frame too long: {len} bytes without a delimiter (limit {MAX_FRAME} + CRC), \
                 skipping to the next one"
            ),
            DecodeError::Truncated { len } => write!(
                f,
                "frame truncated: {len} bytes, at least {} needed",
                HEADER_LEN + CRC_LEN
            ),
            DecodeError::Crc { expected, found } => write!(
                f,
                "frame CRC mismatch: frame says {expected:#010x}, contents hash to {found:#010x}"
            ),
            DecodeError::UnsupportedVersion { found, seq } => write!(
                f,
                "frame {seq} is protocol version {found}, this side speaks {PROTOCOL_VERSION}"
            ),
            DecodeError::Postcard(e) => write!(f, "bad frame body: {e}"),
            DecodeError::TrailingBytes { count } => {
                write!(f, "frame body followed by {count} unexpected byte(s)")
            }
        }
    }
}

impl core::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            DecodeError::Cobs(e) => Some(e),
            DecodeError::Postcard(e) => Some(e),
            _ => None,
        }
    }
}

/// Where the decoder stands in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Right after a delimiter (or at the start): nothing of a frame yet.
    Idle,
    /// Inside a frame.
    Collecting,
    /// Inside a frame already reported as [`DecodeError::TooLong`]: waiting
    /// for the delimiter.
    Skipping,
}

/// A streaming frame decoder, fed bytes as they arrive in any chunking.
///
/// It holds at most [`MAX_FRAME`] + 4 decoded bytes, in one buffer allocated
/// by [`FrameDecoder::new`] and never grown. It resynchronizes on every
/// `0x00`: whatever came before (noise, a cut frame, a frame that failed)
/// yields at most one error per delimiter, and the next frame decodes.
///
/// ```
/// use protocol::{encode, Frame, FrameDecoder, Request};
/// let mut wire = Vec::new();
/// encode(&Frame::request(7, Request::Ping { nonce: 42 }), &mut wire).unwrap();
///
/// let mut dec = FrameDecoder::new();
/// let mut got = Vec::new();
/// for chunk in wire.chunks(5) {
///     for result in dec.feed(chunk) {
///         got.push(result.unwrap());
///     }
/// }
/// assert_eq!(got, [Frame::request(7, Request::Ping { nonce: 42 })]);
/// ```
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    /// Decoded bytes of the current frame.
    buf: Vec<u8>,
    cobs: cobs::Decoder,
    state: State,
}

impl FrameDecoder {
    /// A decoder waiting for the first frame. Allocates its buffer.
    pub fn new() -> Self {
        Self {
            buf: Vec::with_capacity(MAX_DECODED),
            cobs: cobs::Decoder::new(),
            state: State::Idle,
        }
    }

    /// Consumes one byte. Returns the result of a frame when this byte is the
    /// delimiter that ends it, or when the frame grows too long.
    #[inline]
    pub fn push_byte(&mut self, byte: u8) -> Option<Result<Frame, DecodeError>> {
        let Some(byte) = NonZeroU8::new(byte) else {
            return self.end_frame();
        };
        match self.state {
            State::Skipping => None,
            State::Idle | State::Collecting => {
                self.state = State::Collecting;
                let decoded = self.cobs.feed(byte)?;
                if self.buf.len() >= MAX_DECODED {
                    let len = self.buf.len().saturating_add(1);
                    self.buf.clear();
                    self.state = State::Skipping;
                    return Some(Err(DecodeError::TooLong { len }));
                }
                self.buf.push(decoded);
                None
            }
        }
    }

    /// Consumes `bytes` lazily, yielding the result of each frame that ends
    /// in them.
    ///
    /// The bytes are consumed as the iterator advances: run it to the end (a
    /// `for` loop does), or take the unread rest with [`Frames::remainder`]
    /// and feed it later.
    pub fn feed<'d, 'a>(&'d mut self, bytes: &'a [u8]) -> Frames<'d, 'a> {
        Frames {
            decoder: self,
            rest: bytes,
        }
    }

    /// Forgets the frame in progress, as if a delimiter had been seen, without
    /// reporting it.
    pub fn reset(&mut self) {
        self.buf.clear();
        self.cobs = cobs::Decoder::new();
        self.state = State::Idle;
    }

    /// Decoded bytes of the frame in progress.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The capacity of the internal buffer, in bytes. It is fixed at
    /// construction and is at least [`MAX_FRAME`] + 4.
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Handles a delimiter.
    fn end_frame(&mut self) -> Option<Result<Frame, DecodeError>> {
        let state = core::mem::replace(&mut self.state, State::Idle);
        let cobs = core::mem::take(&mut self.cobs);
        let result = match state {
            // Back-to-back delimiters, or the end of a frame already reported.
            State::Idle | State::Skipping => None,
            State::Collecting => Some(match cobs.finish() {
                Ok(()) => parse_payload(&self.buf),
                Err(e) => Err(DecodeError::Cobs(e)),
            }),
        };
        self.buf.clear();
        result
    }
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

/// The frames that end in a chunk of bytes; see [`FrameDecoder::feed`].
#[derive(Debug)]
#[must_use = "bytes are consumed only as the iterator advances"]
pub struct Frames<'d, 'a> {
    decoder: &'d mut FrameDecoder,
    rest: &'a [u8],
}

impl<'a> Frames<'_, 'a> {
    /// The bytes not consumed yet.
    pub fn remainder(&self) -> &'a [u8] {
        self.rest
    }
}

impl Iterator for Frames<'_, '_> {
    type Item = Result<Frame, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.decoder.state == State::Skipping {
                // Nothing to keep until the delimiter: jump to it.
                match self.rest.iter().position(|&b| b == DELIMITER) {
                    Some(at) => self.rest = self.rest.get(at..).unwrap_or_default(),
                    None => {
                        self.rest = &[];
                        return None;
                    }
                }
            }
            let (&byte, rest) = self.rest.split_first()?;
            self.rest = rest;
            if let Some(result) = self.decoder.push_byte(byte) {
                return Some(result);
            }
        }
    }
}

/// Checks and deserializes the decoded bytes of one frame.
fn parse_payload(decoded: &[u8]) -> Result<Frame, DecodeError> {
    let truncated = DecodeError::Truncated { len: decoded.len() };
    let Some((payload, crc)) = decoded.split_last_chunk::<CRC_LEN>() else {
        return Err(truncated);
    };
    let Some((version, rest)) = payload.split_first_chunk::<2>() else {
        return Err(truncated);
    };
    let Some((seq, body)) = rest.split_first_chunk::<4>() else {
        return Err(truncated);
    };

    let expected = u32::from_le_bytes(*crc);
    let found = crc32(payload);
    if expected != found {
        return Err(DecodeError::Crc { expected, found });
    }

    let version = u16::from_le_bytes(*version);
    let seq = u32::from_le_bytes(*seq);
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            found: version,
            seq,
        });
    }

    let (body, rest) = postcard::take_from_bytes::<Body>(body).map_err(DecodeError::Postcard)?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes { count: rest.len() });
    }
    Ok(Frame { version, seq, body })
}
