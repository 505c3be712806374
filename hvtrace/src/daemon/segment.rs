//! What a control-socket client sends, cut at frame delimiters and sorted.
//!
//! The supervisor reads each client's bytes as *segments*: the bytes between
//! two `0x00` delimiters. A segment is either a frame of this protocol version
//! (served, or forwarded with the supervisor's own sequence number), a frame
//! of another version (forwarded as it is, so that the hypervisor's
//! `VersionMismatch` reaches the client), or anything else (forwarded as it
//! is, so that the hypervisor's own resynchronization is what copes with it).

use protocol::{Body, DecodeError, Frame, FrameDecoder, Request, MAX_WIRE_FRAME};

/// The frame delimiter.
pub const DELIMITER: u8 = 0x00;

/// The longest segment kept. Past it the rest, up to the next delimiter, is
/// dropped: no frame is that long, and the hypervisor reads the control
/// channel one byte per turn, so forwarding an endless run of noise would
/// block every other client.
pub const MAX_SEGMENT: usize = MAX_WIRE_FRAME;

/// The bytes between two delimiters (never empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The bytes, without delimiters, at most [`MAX_SEGMENT`].
    pub bytes: Vec<u8>,
    /// A delimiter ended it; `false` for the cut end of a stream.
    pub complete: bool,
    /// Bytes past [`MAX_SEGMENT`] that were dropped.
    pub dropped: usize,
}

impl Segment {
    /// The segment as it goes to the hypervisor: a leading delimiter (so that
    /// it never merges with what came before), the bytes, and the closing
    /// delimiter if the client sent one.
    pub fn wire(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes.len() + 2);
        out.push(DELIMITER);
        out.extend_from_slice(&self.bytes);
        if self.complete {
            out.push(DELIMITER);
        }
        out
    }
}

/// Cuts a byte stream into [`Segment`]s.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: Vec<u8>,
    dropped: usize,
}

impl Splitter {
    /// A splitter at the start of a stream.
    pub fn new() -> Splitter {
        Splitter::default()
    }

    /// Takes one byte; returns the segment that a delimiter ends.
    pub fn push(&mut self, byte: u8) -> Option<Segment> {
        if byte == DELIMITER {
            return self.take(true);
        }
        if self.buf.len() < MAX_SEGMENT {
            self.buf.push(byte);
        } else {
            self.dropped += 1;
        }
        None
    }

    /// Takes a chunk; returns the segments that end in it.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<Segment> {
        bytes.iter().filter_map(|&b| self.push(b)).collect()
    }

    /// The end of the stream: the cut segment left over, if any.
    pub fn finish(&mut self) -> Option<Segment> {
        self.take(false)
    }

    /// Bytes of the segment in progress (kept ones).
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    fn take(&mut self, complete: bool) -> Option<Segment> {
        let dropped = std::mem::take(&mut self.dropped);
        if self.buf.is_empty() && dropped == 0 {
            return None;
        }
        Some(Segment {
            bytes: std::mem::take(&mut self.buf),
            complete,
            dropped,
        })
    }
}

/// What a complete segment is.
#[derive(Clone, Debug, PartialEq)]
pub enum Inbound {
    /// A request of this protocol version.
    Request {
        /// The client's sequence number.
        seq: u32,
        /// The request.
        request: Request,
    },
    /// A sound frame of another protocol version.
    WrongVersion {
        /// Its sequence number (the hypervisor answers under it).
        seq: u32,
        /// Its version.
        version: u16,
    },
    /// A frame of this version that is not a request.
    NotRequest {
        /// Its sequence number.
        seq: u32,
    },
    /// Not a frame: noise, a cut frame, a bad CRC, an unknown body.
    Garbage(DecodeError),
}

/// Sorts segments, reusing one decoder.
#[derive(Debug, Default)]
pub struct Classifier {
    decoder: FrameDecoder,
}

impl Classifier {
    /// A classifier.
    pub fn new() -> Classifier {
        Classifier::default()
    }

    /// What `segment` is. A cut or overlong segment is garbage whatever its
    /// bytes.
    pub fn classify(&mut self, segment: &Segment) -> Inbound {
        if !segment.complete {
            return Inbound::Garbage(DecodeError::Truncated {
                len: segment.bytes.len(),
            });
        }
        if segment.dropped > 0 {
            return Inbound::Garbage(DecodeError::TooLong {
                len: segment.bytes.len() + segment.dropped,
            });
        }
        self.decoder.reset();
        let mut result = None;
        for &b in &segment.bytes {
            if let Some(r) = self.decoder.push_byte(b) {
                result = Some(r);
                break;
            }
        }
        let result = match result {
            Some(r) => r,
            None => match self.decoder.push_byte(DELIMITER) {
                Some(r) => r,
                None => {
                    return Inbound::Garbage(DecodeError::Truncated { len: 0 });
                }
            },
        };
        self.decoder.reset();
        match result {
            Ok(Frame {
                seq,
                body: Body::Request(request),
                ..
            }) => Inbound::Request { seq, request },
            Ok(frame) => Inbound::NotRequest { seq: frame.seq },
            Err(DecodeError::UnsupportedVersion { found, seq }) => Inbound::WrongVersion {
                seq,
                version: found,
            },
            Err(e) => Inbound::Garbage(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{encode, Response};

    fn wire(frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        encode(frame, &mut out).unwrap();
        out
    }

    #[test]
    fn frames_are_segments() {
        let a = wire(&Frame::request(1, Request::Status));
        let b = wire(&Frame::request(2, Request::Ping { nonce: 9 }));
        let mut s = Splitter::new();
        let mut all = a.clone();
        all.extend_from_slice(&b);
        let segs = s.feed(&all);
        assert_eq!(segs.len(), 2);
        assert!(segs.iter().all(|x| x.complete && x.dropped == 0));
        // Delimiters are not part of a segment; wire() restores both.
        assert_eq!(segs[0].wire(), a);
        assert_eq!(segs[1].wire(), b);
        assert!(s.finish().is_none());
    }

    #[test]
    fn chunking_does_not_matter() {
        let a = wire(&Frame::request(
            7,
            Request::Hello {
                version: 1,
                client: "x".into(),
            },
        ));
        let mut whole = Splitter::new();
        let expected = whole.feed(&a);
        let mut bytewise = Splitter::new();
        let got: Vec<Segment> = a.iter().filter_map(|&b| bytewise.push(b)).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn cut_segment_at_the_end() {
        let a = wire(&Frame::request(3, Request::Status));
        let mut s = Splitter::new();
        assert!(s.feed(&a[..5]).is_empty());
        assert_eq!(s.pending(), 4);
        let cut = s.finish().unwrap();
        assert!(!cut.complete);
        assert_eq!(cut.bytes, &a[1..5]);
        // A cut segment goes out with a leading delimiter only.
        let mut expect = vec![0];
        expect.extend_from_slice(&a[1..5]);
        assert_eq!(cut.wire(), expect);
        assert!(s.finish().is_none());
    }

    #[test]
    fn overlong_segments_are_capped() {
        let mut s = Splitter::new();
        let noise = vec![0x55u8; MAX_SEGMENT + 100];
        assert!(s.feed(&noise).is_empty());
        let seg = s.push(0).unwrap();
        assert_eq!(seg.bytes.len(), MAX_SEGMENT);
        assert_eq!(seg.dropped, 100);
        let mut c = Classifier::new();
        assert!(
            matches!(c.classify(&seg), Inbound::Garbage(DecodeError::TooLong { len }) if len == MAX_SEGMENT + 100)
        );
        // The next frame is whole again.
        let a = wire(&Frame::request(4, Request::Status));
        let segs = s.feed(&a);
        assert_eq!(segs.len(), 1);
        assert_eq!(
            c.classify(&segs[0]),
            Inbound::Request {
                seq: 4,
                request: Request::Status
            }
        );
    }

    #[test]
    fn classification() {
        let mut c = Classifier::new();
        let mut s = Splitter::new();
        let mut one = |bytes: &[u8]| -> Inbound {
            let segs = s.feed(bytes);
            assert_eq!(segs.len(), 1, "{bytes:?}");
            c.classify(&segs[0])
        };
        assert_eq!(
            one(&wire(&Frame::request(10, Request::Ping { nonce: 5 }))),
            Inbound::Request {
                seq: 10,
                request: Request::Ping { nonce: 5 }
            }
        );
        let mut old = Frame::request(11, Request::Status);
        old.version = protocol::PROTOCOL_VERSION + 1;
        assert_eq!(
            one(&wire(&old)),
            Inbound::WrongVersion {
                seq: 11,
                version: protocol::PROTOCOL_VERSION + 1
            }
        );
        assert_eq!(
            one(&wire(&Frame::response(12, Response::Ok))),
            Inbound::NotRequest { seq: 12 }
        );
        assert!(matches!(one(b"garbage\x00"), Inbound::Garbage(_)));
        // A changed byte fails the CRC (or the COBS structure).
        let mut bad = wire(&Frame::request(13, Request::Status));
        let at = bad.len() - 3;
        bad[at] = if bad[at] == 0x42 { 0x43 } else { 0x42 };
        assert!(matches!(one(&bad), Inbound::Garbage(_)));
    }

    #[test]
    fn back_to_back_delimiters_are_nothing() {
        let mut s = Splitter::new();
        assert!(s.feed(&[0, 0, 0, 0]).is_empty());
        assert!(s.finish().is_none());
    }
}
