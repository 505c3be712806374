//! The decoder gets back in step after garbage, a cut frame or a corrupted
//! frame: the bad bytes give errors, the good frame after them decodes.

mod common;

use common::{decode_all, wire};
use protocol::{encode, DecodeError, Event, Frame, FrameDecoder, Request, Response, MAX_FRAME};

fn good() -> Frame {
    Frame::response(41, Response::Status(common::status_report()))
}

fn other() -> Frame {
    Frame::event(
        7,
        Event::Log {
            text: "vcpu1: a log line".into(),
        },
    )
}

/// Results of `before` followed by the good frame; checks that the good
/// frame comes last and returns what came before it.
fn then_good(before: &[u8]) -> Vec<Result<Frame, DecodeError>> {
    let mut stream = before.to_vec();
    stream.extend(wire(&good()));
    let mut results = decode_all(&stream);
    assert_eq!(results.pop(), Some(Ok(good())), "input {before:02x?}");
    results
}

#[test]
fn garbage_without_zeros() {
    let errors = then_good(b"\x13\x37 line noise \xff\xfe\x01");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].is_err());
}

#[test]
fn garbage_with_zeros() {
    let garbage = [
        0u8, 0, 5, 0, 0xFF, 1, 2, 0, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0x42,
    ];
    let errors = then_good(&garbage);
    assert!(
        !errors.is_empty() && errors.iter().all(Result::is_err),
        "{errors:?}"
    );
    // Each result ends at a delimiter: no more results than delimiters.
    assert!(errors.len() <= garbage.iter().filter(|&&b| b == 0).count() + 1);
}

#[test]
fn only_delimiters() {
    assert!(
        then_good(&[0; 100]).is_empty(),
        "empty frames are skipped silently"
    );
}

#[test]
fn cut_frame_then_good_frame() {
    let cut = wire(&other());
    for len in 0..cut.len() {
        let results = then_good(&cut[..len]);
        match len {
            // Nothing, or just the leading delimiter.
            0 | 1 => assert!(results.is_empty(), "cut at {len}: {results:?}"),
            // Everything but the final delimiter: the good frame's leading
            // delimiter completes it.
            n if n == cut.len() - 1 => assert_eq!(results, vec![Ok(other())]),
            _ => {
                assert_eq!(results.len(), 1, "cut at {len}: {results:?}");
                assert!(results[0].is_err(), "cut at {len}: {results:?}");
            }
        }
    }
}

#[test]
fn tail_of_a_frame_then_good_frame() {
    // Joining the stream in the middle of a frame.
    let cut = wire(&other());
    // From 1 it is the whole frame without its leading delimiter.
    for start in 2..cut.len() - 1 {
        let results = then_good(&cut[start..]);
        assert!(
            results.iter().all(Result::is_err),
            "from {start}: {results:?}"
        );
    }
}

#[test]
fn every_single_bit_flip_is_caught() {
    let victim = wire(&other());
    let mut flips = 0;
    for byte in 0..victim.len() {
        for bit in 0..8 {
            let mut bad = victim.clone();
            bad[byte] ^= 1 << bit;
            let results = then_good(&bad);
            assert!(
                results.iter().all(Result::is_err) && !results.is_empty(),
                "flip byte {byte} bit {bit}: {results:?}"
            );
            flips += 1;
        }
    }
    assert_eq!(flips, victim.len() * 8);
}

#[test]
fn flipped_bit_gives_a_crc_error() {
    // A flip in a data byte (not a COBS code byte, not a delimiter) leaves the
    // structure intact, so the CRC is what catches it.
    let f = Frame::request(
        1,
        Request::ProbeAdd {
            spec: "p:x vfs_read".into(),
        },
    );
    let mut bad = wire(&f);
    let at = bad.len() / 2;
    bad[at] ^= 0x10;
    let results = then_good(&bad);
    assert!(
        matches!(results.as_slice(), [Err(DecodeError::Crc { .. })]),
        "{results:?}"
    );
}

#[test]
fn other_version_then_good_frame() {
    let mut future = Frame::request(9, Request::Status);
    future.version = protocol::PROTOCOL_VERSION + 1;
    let results = then_good(&wire(&future));
    assert_eq!(
        results,
        vec![Err(DecodeError::UnsupportedVersion {
            found: protocol::PROTOCOL_VERSION + 1,
            seq: 9
        })]
    );
}

#[test]
fn endless_garbage_is_reported_once_then_skipped() {
    let flood: Vec<u8> = (0..5 * MAX_FRAME).map(|i| (i % 255 + 1) as u8).collect();
    let results = then_good(&flood);
    assert!(
        matches!(results.as_slice(), [Err(DecodeError::TooLong { len })] if *len > MAX_FRAME),
        "{results:?}"
    );
}

#[test]
fn frames_without_leading_delimiter() {
    // A peer that writes only a trailing delimiter is understood too.
    let frames = [good(), other(), good()];
    let mut stream = Vec::new();
    for f in &frames {
        stream.extend_from_slice(&wire(f)[1..]);
    }
    let got: Vec<_> = decode_all(&stream);
    assert_eq!(got, frames.iter().cloned().map(Ok).collect::<Vec<_>>());
}

#[test]
fn any_chunking_gives_the_same_frames() {
    let frames = [
        good(),
        other(),
        Frame::request(3, Request::Ping { nonce: 3 }),
    ];
    let mut stream = b"junk".to_vec();
    for f in &frames {
        encode(f, &mut stream).unwrap();
        stream.extend_from_slice(b"\x01\x02 more junk \x00");
    }
    let expected: Vec<_> = decode_all(&stream);
    assert_eq!(expected.iter().filter(|r| r.is_ok()).count(), frames.len());
    for chunk in 1..=stream.len() {
        let mut dec = FrameDecoder::new();
        let got: Vec<_> = stream
            .chunks(chunk)
            .flat_map(|c| dec.feed(c).collect::<Vec<_>>())
            .collect();
        assert_eq!(got, expected, "chunk size {chunk}");
    }
}
