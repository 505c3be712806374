//! The blocking reader and writer over `std::io`.

mod common;

use std::io::{self, Read, Write};

use protocol::io::{FrameReader, FrameWriter, ReadError, WriteError};
use protocol::{DecodeError, EncodeError, Event, Frame, Request, Response, MAX_FRAME};

/// A reader that hands out its bytes a few at a time, with interruptions and
/// time-outs on the way, as a serial port or a socket with a time-out would.
struct Trickle {
    data: Vec<u8>,
    pos: usize,
    calls: usize,
}

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.calls += 1;
        match self.calls % 5 {
            1 => return Err(io::ErrorKind::Interrupted.into()),
            3 => return Err(io::ErrorKind::WouldBlock.into()),
            _ => {}
        }
        let n = buf.len().min(3).min(self.data.len() - self.pos);
        buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[test]
fn writer_then_trickling_reader() {
    let frames = vec![
        Frame::request(
            1,
            Request::Hello {
                version: protocol::PROTOCOL_VERSION,
                client: "t".into(),
            },
        ),
        Frame::response(1, Response::Status(common::status_report())),
        Frame::event(0, Event::Lost { count: 3 }),
    ];
    let mut w = FrameWriter::new(Vec::new());
    for f in &frames {
        w.write_frame(f).unwrap();
    }
    let mut data = b"noise".to_vec();
    data.extend(w.into_inner());

    let mut r = FrameReader::new(Trickle {
        data,
        pos: 0,
        calls: 0,
    });
    let mut got = Vec::new();
    let mut decode_errors = 0;
    loop {
        match r.read_frame() {
            Ok(f) => got.push(f),
            Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(ReadError::Decode(_)) => decode_errors += 1,
            Err(ReadError::Closed) => break,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!(got, frames);
    assert_eq!(decode_errors, 1, "the noise before the first frame");
}

#[test]
fn decode_errors_are_recoverable() {
    let good = Frame::request(2, Request::Status);
    let mut data = common::wire(&good);
    data[4] ^= 0x40;
    data.extend(common::wire(&good));
    let mut r = FrameReader::new(&data[..]);
    assert!(matches!(
        r.read_frame(),
        Err(ReadError::Decode(DecodeError::Crc { .. }))
    ));
    assert_eq!(r.read_frame().unwrap(), good);
    assert!(matches!(r.read_frame(), Err(ReadError::Closed)));
}

#[test]
fn oversized_frame_is_not_written() {
    let huge = Frame::event(
        0,
        Event::Trace {
            cpu: 0,
            timestamp_ns: 0,
            payload: vec![1; MAX_FRAME],
        },
    );
    let mut w = FrameWriter::new(Vec::new());
    assert!(matches!(
        w.write_frame(&huge),
        Err(WriteError::Encode(EncodeError::TooLong { .. }))
    ));
    assert!(w.get_ref().is_empty());
}

struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::ErrorKind::BrokenPipe.into())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn errors_chain_and_display() {
    let mut w = FrameWriter::new(Broken);
    let e = w
        .write_frame(&Frame::request(1, Request::Stop))
        .unwrap_err();
    assert!(matches!(e, WriteError::Io(_)));
    assert!(std::error::Error::source(&e).is_some());
    assert!(!e.to_string().contains('\n'));

    let e = ReadError::Decode(DecodeError::Truncated { len: 2 });
    assert_eq!(
        e.to_string(),
        "control channel: frame truncated: 2 bytes, at least 10 needed"
    );
}
