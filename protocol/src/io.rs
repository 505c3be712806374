//! Blocking frame I/O over `std::io` streams, for the host side.
//!
//! ```
//! use protocol::io::{FrameReader, FrameWriter};
//! use protocol::{Frame, Request};
//!
//! let mut w = FrameWriter::new(Vec::new());
//! w.write_frame(&Frame::request(1, Request::Status)).unwrap();
//! let wire = w.into_inner();
//!
//! let mut r = FrameReader::new(&wire[..]);
//! assert_eq!(r.read_frame().unwrap(), Frame::request(1, Request::Status));
//! assert!(matches!(r.read_frame(), Err(protocol::io::ReadError::Closed)));
//! ```

extern crate std;

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::fmt;
use std::io::{self, Read, Write};

use crate::codec::{encode, DecodeError, EncodeError, FrameDecoder, MAX_WIRE_FRAME};
use crate::message::Frame;

/// Bytes asked of the underlying reader at a time.
const READ_CHUNK: usize = 1024;

/// Reads frames from a byte stream, one per call.
///
/// Buffers at most 1 KiB of undecoded bytes plus one frame in its
/// [`FrameDecoder`]. Bytes read past the end of a frame stay for the next call.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    decoder: FrameDecoder,
    chunk: Box<[u8; READ_CHUNK]>,
    /// `chunk[pos..len]` is read but not yet decoded.
    pos: usize,
    len: usize,
}

impl<R: Read> FrameReader<R> {
    /// Wraps a reader (a socket, a serial port, a pipe).
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            decoder: FrameDecoder::new(),
            chunk: Box::new([0; READ_CHUNK]),
            pos: 0,
            len: 0,
        }
    }

    /// Blocks until a frame, a malformed frame, an I/O error or the end of
    /// the stream.
    ///
    /// After [`ReadError::Decode`] the reader is in step again and can go on.
    /// After an I/O error such as a read time-out (`WouldBlock`/`TimedOut`) it
    /// can go on too: nothing read so far is lost.
    pub fn read_frame(&mut self) -> Result<Frame, ReadError> {
        loop {
            while let Some(&byte) = self.chunk.get(self.pos..self.len).and_then(<[u8]>::first) {
                self.pos = self.pos.saturating_add(1);
                if let Some(result) = self.decoder.push_byte(byte) {
                    return result.map_err(ReadError::Decode);
                }
            }
            self.pos = 0;
            self.len = 0;
            match self.inner.read(&mut *self.chunk) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(n) => self.len = n.min(READ_CHUNK),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// The underlying reader.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The underlying reader, e.g. to set a time-out. Reading from it directly
    /// loses frames.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Unwraps the reader; buffered bytes are dropped.
    pub fn into_inner(self) -> R {
        self.inner
    }
}

/// Why [`FrameReader::read_frame`] returned no frame.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReadError {
    /// The stream ended (a partial frame at the end is dropped).
    Closed,
    /// The underlying reader failed.
    Io(io::Error),
    /// Bytes arrived that are not a frame of this version. Recoverable.
    Decode(DecodeError),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Closed => write!(f, "control channel closed"),
            ReadError::Io(e) => write!(f, "control channel read failed: {e}"),
            ReadError::Decode(e) => write!(f, "control channel: {e}"),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReadError::Closed => None,
            ReadError::Io(e) => Some(e),
            ReadError::Decode(e) => Some(e),
        }
    }
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Writes frames to a byte stream, flushing after each.
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    /// Reused encoding buffer.
    buf: Vec<u8>,
}

impl<W: Write> FrameWriter<W> {
    /// Wraps a writer.
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            buf: Vec::with_capacity(MAX_WIRE_FRAME),
        }
    }

    /// Encodes `frame`, writes it whole and flushes.
    pub fn write_frame(&mut self, frame: &Frame) -> Result<(), WriteError> {
        self.buf.clear();
        encode(frame, &mut self.buf).map_err(WriteError::Encode)?;
        self.inner.write_all(&self.buf).map_err(WriteError::Io)?;
        self.inner.flush().map_err(WriteError::Io)
    }

    /// The underlying writer.
    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// The underlying writer.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Unwraps the writer.
    pub fn into_inner(self) -> W {
        self.inner
    }
}

/// Why [`FrameWriter::write_frame`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum WriteError {
    /// The frame cannot be encoded; nothing was written.
    Encode(EncodeError),
    /// The underlying writer failed; part of the frame may have been written
    /// (the peer will discard it at the next delimiter).
    Io(io::Error),
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::Encode(e) => write!(f, "cannot encode frame: {e}"),
            WriteError::Io(e) => write!(f, "control channel write failed: {e}"),
        }
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WriteError::Encode(e) => Some(e),
            WriteError::Io(e) => Some(e),
        }
    }
}
