//! Memory bounds: the decoder's buffer never grows, a stream without
//! delimiters costs nothing, and a hostile body (a valid frame claiming huge
//! lengths) cannot make decoding allocate much.
//!
//! A counting global allocator measures what this thread allocates.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{wire, wire_from_payload};
use protocol::{DecodeError, Frame, FrameDecoder, Request, CRC_LEN, MAX_FRAME, PROTOCOL_VERSION};

struct Counting;

thread_local! {
    /// Allocations made by this thread, and the largest one.
    static ALLOCS: Cell<(u64, usize)> = const { Cell::new((0, 0)) };
}

fn note(size: usize) {
    // `try_with`: allocations during thread teardown are not counted.
    let _ = ALLOCS.try_with(|a| {
        let (n, max) = a.get();
        a.set((n + 1, max.max(size)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// bookkeeping touches a const-initialized thread-local `Cell` only, which
// does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: same contract as this function's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as this function's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: same contract as this function's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns (allocations, largest allocation) made meanwhile.
fn measure(f: impl FnOnce()) -> (u64, usize) {
    ALLOCS.with(|a| a.set((0, 0)));
    f();
    ALLOCS.with(|a| a.get())
}

#[test]
fn no_delimiter_stream_stays_bounded_and_allocates_nothing() {
    let mut dec = FrameDecoder::new();
    let capacity = dec.buffer_capacity();
    assert!(capacity >= MAX_FRAME + CRC_LEN);
    let chunk: Vec<u8> = (0..4096u32).map(|i| (i % 251 + 1) as u8).collect();
    let mut too_long = 0;
    let (allocs, _) = measure(|| {
        // 64 MiB without a single zero byte, in chunks and byte by byte.
        for i in 0..16 * 1024 {
            if i % 1024 == 0 {
                for &b in &chunk {
                    if let Some(r) = dec.push_byte(b) {
                        assert!(matches!(r, Err(DecodeError::TooLong { .. })));
                        too_long += 1;
                    }
                }
            }
            for r in dec.feed(&chunk) {
                assert!(matches!(r, Err(DecodeError::TooLong { .. })));
                too_long += 1;
            }
            assert!(dec.buffered() <= MAX_FRAME + CRC_LEN);
        }
    });
    assert_eq!(allocs, 0, "decoding a delimiter-less flood allocated");
    assert_eq!(dec.buffer_capacity(), capacity);
    assert_eq!(too_long, 1, "one error for one endless frame");

    // And the decoder is fine afterwards.
    let good = Frame::request(5, Request::Ping { nonce: 5 });
    let results: Vec<_> = dec.feed(&wire(&good)).collect();
    assert_eq!(results, vec![Ok(good)]);
}

#[test]
fn many_small_frames_allocate_only_their_contents() {
    let frame = Frame::request(1, Request::Ping { nonce: 99 });
    let one = wire(&frame);
    let stream: Vec<u8> = one
        .iter()
        .copied()
        .cycle()
        .take(one.len() * 10_000)
        .collect();
    let mut dec = FrameDecoder::new();
    let (allocs, _) = measure(|| {
        let mut n = 0;
        for r in dec.feed(&stream) {
            assert_eq!(r.as_ref(), Ok(&frame));
            n += 1;
        }
        assert_eq!(n, 10_000);
    });
    assert_eq!(allocs, 0, "a Ping owns no heap memory");
}

fn header() -> Vec<u8> {
    let mut h = PROTOCOL_VERSION.to_le_bytes().to_vec();
    h.extend_from_slice(&1u32.to_le_bytes());
    h
}

/// A varint of 2^63 (10 bytes).
const HUGE: [u8; 10] = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01];

#[test]
fn hostile_lengths_do_not_allocate_much() {
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    // Event::Trace { cpu: 0, timestamp_ns: 0, payload: <2^63 bytes> }
    bodies.push([&[2u8, 2, 0, 0][..], &HUGE, &[1, 2, 3]].concat());
    // Event::Log { text: <2^63 bytes> }
    bodies.push([&[2u8, 0][..], &HUGE, b"abc"].concat());
    // Response::Status with an exits list of 2^63 entries.
    bodies.push([&[1u8, 1, 0, 1, 1, 0, 1][..], &HUGE, &[0, 0, 0]].concat());
    // The same with 4000 entries claimed, a few present.
    bodies.push(
        [
            &[1u8, 1, 0, 1, 1, 0, 1][..],
            &[0xA0, 0x1F],
            &[1, 1, b'x', 5, 2, 1, b'y', 6],
        ]
        .concat(),
    );
    // Event::Trace with a payload length just under what remains.
    bodies.push([&[2u8, 2, 0, 0][..], &[0x90, 0x1F], &[7; 100]].concat());

    for body in bodies {
        let w = wire_from_payload(&[header(), body.clone()].concat());
        let mut dec = FrameDecoder::new();
        let mut results = Vec::new();
        let (_, largest) = measure(|| results = dec.feed(&w).collect());
        assert!(
            matches!(results.as_slice(), [Err(DecodeError::Postcard(_))]),
            "body {body:02x?}: {results:?}"
        );
        assert!(
            largest <= 2 * MAX_FRAME,
            "body {body:02x?}: allocated {largest} bytes at once"
        );
    }
}

#[test]
fn a_claimed_length_costs_no_more_than_the_bytes_behind_it() {
    // Response::Status whose exits list claims 4000 entries and has 4000 bytes
    // behind the claim, the first entry invalid (a name that is not UTF-8).
    let claim = [0xA0, 0x1F]; // 4000
    let mut entries = vec![1u8, 1, 0xFF];
    entries.resize(4000, 1);
    let body = [&[1u8, 1, 0, 1, 1, 0, 1][..], &claim, &entries].concat();
    let w = wire_from_payload(&[header(), body].concat());
    assert!(w.len() <= protocol::MAX_WIRE_FRAME);
    let mut dec = FrameDecoder::new();
    let mut results = Vec::new();
    let (_, largest) = measure(|| results = dec.feed(&w).collect());
    assert!(
        matches!(results.as_slice(), [Err(DecodeError::Postcard(_))]),
        "{results:?}"
    );
    // The documented bound: about 40 bytes of heap per body byte.
    let per_entry = std::mem::size_of::<protocol::ExitCount>();
    assert!(
        per_entry <= 40,
        "ExitCount grew to {per_entry} bytes: update the crate docs"
    );
    assert!(
        largest <= 40 * MAX_FRAME,
        "allocated {largest} bytes at once"
    );
    println!("largest allocation for a 4000-entry claim: {largest} bytes");
}
