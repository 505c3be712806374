//! Randomized robustness: a million garbage and mutated frames, each followed
//! by a good frame. The decoder must never panic, must stay within its buffer
//! bound, and must decode every good frame exactly.
//!
//! Seeded and deterministic; `PROTOCOL_FUZZ_CASES` and `PROTOCOL_FUZZ_SEED`
//! override the case count and the seed.

mod common;

use std::time::Instant;

use common::{payload_of, random_frame, wire, wire_from_payload, Rng};
use protocol::{DecodeError, Frame, FrameDecoder, HEADER_LEN, MAX_FRAME, MAX_WIRE_FRAME};

const DEFAULT_CASES: u64 = 1_000_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Sample {
    frame: Frame,
    wire: Vec<u8>,
    payload: Vec<u8>,
}

/// Ways to spoil a frame.
#[derive(Clone, Copy, Debug)]
enum Garbage {
    /// Random bytes, zeros included.
    Random,
    /// Random non-zero bytes (one long frame-to-be).
    RandomNonZero,
    /// A good frame with a few bits flipped.
    BitFlips,
    /// A good frame cut anywhere.
    Prefix,
    /// A good frame with bytes inserted, deleted or overwritten (zeros too).
    Edits,
    /// The start of one frame and the end of another.
    Splice,
    /// A correct envelope (COBS, CRC, version) around a mutated body: the
    /// case that reaches postcard.
    HostileBody,
    /// A correct envelope around random bytes.
    RandomBody,
    /// A non-zero flood longer than a frame may be (rare: it is long).
    Flood,
}

const KINDS: [Garbage; 8] = [
    Garbage::Random,
    Garbage::RandomNonZero,
    Garbage::BitFlips,
    Garbage::Prefix,
    Garbage::Edits,
    Garbage::Splice,
    Garbage::HostileBody,
    Garbage::RandomBody,
];

fn make_garbage(kind: Garbage, rng: &mut Rng, pool: &[Sample], out: &mut Vec<u8>) {
    let pick = |rng: &mut Rng| &pool[rng.index(pool.len())];
    match kind {
        Garbage::Random => {
            let len = rng.index(64);
            out.extend((0..len).map(|_| if rng.chance(8) { 0 } else { rng.byte() }));
        }
        Garbage::RandomNonZero => {
            let len = rng.index(300);
            out.extend((0..len).map(|_| rng.byte() | 1));
        }
        Garbage::BitFlips => {
            let start = out.len();
            out.extend_from_slice(&pick(rng).wire);
            for _ in 0..1 + rng.index(4) {
                let at = start + rng.index(out.len() - start);
                out[at] ^= 1 << rng.index(8);
            }
        }
        Garbage::Prefix => {
            let w = &pick(rng).wire;
            out.extend_from_slice(&w[..rng.index(w.len())]);
        }
        Garbage::Edits => {
            let mut w = pick(rng).wire.clone();
            for _ in 0..1 + rng.index(3) {
                let at = rng.index(w.len());
                let byte = if rng.chance(4) { 0 } else { rng.byte() };
                match rng.index(3) {
                    0 => w.insert(at, byte),
                    1 => {
                        w.remove(at);
                        if w.is_empty() {
                            break;
                        }
                    }
                    _ => w[at] = byte,
                }
            }
            out.extend_from_slice(&w);
        }
        Garbage::Splice => {
            let a = &pick(rng).wire;
            let b = &pick(rng).wire;
            out.extend_from_slice(&a[..rng.index(a.len())]);
            out.extend_from_slice(&b[rng.index(b.len())..]);
        }
        Garbage::HostileBody => {
            let mut p = pick(rng).payload.clone();
            // Keep the header (version, seq): the body is what gets parsed.
            for _ in 0..1 + rng.index(4) {
                let body_len = p.len() - HEADER_LEN;
                if body_len == 0 {
                    break;
                }
                let at = HEADER_LEN + rng.index(body_len);
                match rng.index(4) {
                    0 => p[at] ^= 1 << rng.index(8),
                    1 => p[at] = rng.byte(),
                    2 => p[at] = 0xFF, // a varint that goes on
                    _ => p.truncate(at),
                }
            }
            if rng.chance(8) {
                let extra = rng.index(8);
                p.extend(rng.bytes(extra));
            }
            out.extend(wire_from_payload(&p));
        }
        Garbage::RandomBody => {
            let version = if rng.chance(16) {
                rng.next() as u16
            } else {
                protocol::PROTOCOL_VERSION
            };
            let mut p = version.to_le_bytes().to_vec();
            let len = 4 + rng.index(40);
            p.extend(rng.bytes(len));
            out.extend(wire_from_payload(&p));
        }
        Garbage::Flood => {
            let len = MAX_WIRE_FRAME + rng.index(3 * MAX_FRAME);
            out.extend((0..len).map(|_| rng.byte() | 0x80));
        }
    }
}

#[derive(Default)]
struct Stats {
    cases: u64,
    bytes: u64,
    /// By [`error_index`].
    errors: [u64; 7],
    /// Mutated frames that still decoded (a cut after the last byte, a change
    /// inside a string, ...): allowed, and counted.
    garbage_decoded: u64,
}

impl Stats {
    fn add(&mut self, other: &Stats) {
        self.cases += other.cases;
        self.bytes += other.bytes;
        for (a, b) in self.errors.iter_mut().zip(other.errors) {
            *a += b;
        }
        self.garbage_decoded += other.garbage_decoded;
    }
}

/// Runs `cases` cases from `seed` through one decoder.
fn run(seed: u64, cases: u64, pool: &[Sample]) -> Stats {
    let mut rng = Rng::new(seed);
    let mut dec = FrameDecoder::new();
    let capacity = dec.buffer_capacity();
    let mut stream = Vec::with_capacity(4 * MAX_WIRE_FRAME);
    let mut stats = Stats {
        cases,
        ..Stats::default()
    };

    for case in 0..cases {
        stream.clear();
        let kind = if rng.chance(2000) {
            Garbage::Flood
        } else {
            KINDS[rng.index(KINDS.len())]
        };
        for _ in 0..1 + usize::from(rng.chance(4)) {
            make_garbage(kind, &mut rng, pool, &mut stream);
        }
        let good = &pool[rng.index(pool.len())];
        stream.extend_from_slice(&good.wire);
        stats.bytes += stream.len() as u64;

        // Feed in one or more chunks, cut at random places.
        let mut last = None;
        let mut rest = &stream[..];
        while !rest.is_empty() {
            let take = if rng.chance(2) {
                rest.len()
            } else {
                1 + rng.index(rest.len())
            };
            let (chunk, tail) = rest.split_at(take);
            rest = tail;
            for result in dec.feed(chunk) {
                match &result {
                    Err(e) => stats.errors[error_index(e)] += 1,
                    Ok(_) => stats.garbage_decoded += 1,
                }
                last = Some(result);
            }
            assert!(dec.buffered() <= MAX_FRAME + protocol::CRC_LEN);
        }
        stats.garbage_decoded -= 1; // the good frame itself
        assert_eq!(
            last.as_ref(),
            Some(&Ok(good.frame.clone())),
            "case {case} ({kind:?}) from seed {seed:#x}: stream {stream:02x?}"
        );
        assert_eq!(dec.buffered(), 0);
        assert_eq!(dec.buffer_capacity(), capacity, "the decoder buffer grew");
    }
    stats
}

#[test]
fn a_million_garbage_and_mutated_frames() {
    let cases = env_u64("PROTOCOL_FUZZ_CASES", DEFAULT_CASES);
    let seed = env_u64("PROTOCOL_FUZZ_SEED", 0x0048_5654_5241_4345); // "HVTRACE"

    // A fixed pool of good frames: the samples and random ones.
    let mut rng = Rng::new(seed);
    let mut frames: Vec<Frame> = common::sample_bodies()
        .into_iter()
        .enumerate()
        .map(|(i, body)| Frame::new(i as u32, body))
        .collect();
    frames.extend((0..64).map(|_| random_frame(&mut rng)));
    let pool: Vec<Sample> = frames
        .into_iter()
        .map(|frame| {
            let wire = wire(&frame);
            let payload = payload_of(&wire);
            Sample {
                frame,
                wire,
                payload,
            }
        })
        .collect();

    // One worker per core (at most 4), each with its own seed and decoder.
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(4)) as u64;
    let started = Instant::now();
    let mut total = Stats::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let share = cases / workers + u64::from(w < cases % workers);
                let pool = &pool;
                s.spawn(move || {
                    run(
                        seed.wrapping_add(w.wrapping_mul(0x1_0000_0001)),
                        share,
                        pool,
                    )
                })
            })
            .collect();
        for h in handles {
            total.add(&h.join().expect("a fuzz worker failed"));
        }
    });
    let elapsed = started.elapsed();

    let e = &total.errors;
    println!(
        "fuzz: {} cases on {workers} thread(s), {:.1} MB, {elapsed:.2?} ({:.0} cases/s); \
         errors: cobs {} too-long {} truncated {} crc {} version {} postcard {} trailing {}; \
         mutated frames that still decoded: {}",
        total.cases,
        total.bytes as f64 / 1e6,
        total.cases as f64 / elapsed.as_secs_f64(),
        e[0],
        e[1],
        e[2],
        e[3],
        e[4],
        e[5],
        e[6],
        total.garbage_decoded,
    );
    assert_eq!(total.cases, cases);
    // Every class of error was reached (the CRC and postcard layers included).
    if cases >= 100_000 {
        for (i, &n) in e.iter().enumerate() {
            assert!(n > 0, "error class {i} never produced");
        }
    }
}

fn error_index(e: &DecodeError) -> usize {
    match e {
        DecodeError::Cobs(_) => 0,
        DecodeError::TooLong { .. } => 1,
        DecodeError::Truncated { .. } => 2,
        DecodeError::Crc { .. } => 3,
        DecodeError::UnsupportedVersion { .. } => 4,
        DecodeError::Postcard(_) => 5,
        DecodeError::TrailingBytes { .. } => 6,
        _ => panic!("unknown error {e:?}"),
    }
}
