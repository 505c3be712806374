//! Encode and decode throughput on the host: `cargo bench -p protocol`.
//!
//! A plain `main` (no harness). Under `cargo bench` each case runs for about a
//! second; run any other way (e.g. `cargo test --benches`) it only checks that
//! the cases work.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use protocol::{encode, Event, Frame, FrameDecoder, Request, Response};

struct Case {
    name: &'static str,
    frame: Frame,
}

/// Runs `step` (which handles one frame) for about `budget`, returns frames/s.
fn rate(budget: Duration, mut step: impl FnMut()) -> f64 {
    let mut n = 0u64;
    let mut batch = 1u64;
    let start = Instant::now();
    loop {
        for _ in 0..batch {
            step();
        }
        n += batch;
        let elapsed = start.elapsed();
        if elapsed >= budget {
            return n as f64 / elapsed.as_secs_f64();
        }
        batch = (batch * 2).min(1 << 16);
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let budget = if full {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(20)
    };

    let cases = [
        Case {
            name: "StatusReport",
            frame: Frame::response(7, Response::Status(common::status_report())),
        },
        Case {
            name: "Ping",
            frame: Frame::request(8, Request::Ping { nonce: 0x1234_5678 }),
        },
        Case {
            name: "Trace 4000 B",
            frame: Frame::event(
                9,
                Event::Trace {
                    cpu: 1,
                    timestamp_ns: 1 << 40,
                    payload: (0..4000u32).map(|i| (i * 7) as u8).collect(),
                },
            ),
        },
    ];

    println!(
        "{:<14} {:>6}  {:>24}  {:>24}  {:>24}",
        "frame", "wire B", "encode", "decode", "encode+decode"
    );
    for case in &cases {
        let mut wire = Vec::new();
        encode(&case.frame, &mut wire).expect("encodes");
        let len = wire.len() as f64;

        let mut out = Vec::with_capacity(wire.len());
        let enc = rate(budget, || {
            out.clear();
            encode(black_box(&case.frame), &mut out).expect("encodes");
            black_box(&out);
        });

        let mut dec = FrameDecoder::new();
        let decode = rate(budget, || {
            for r in dec.feed(black_box(&wire)) {
                black_box(r.expect("decodes"));
            }
        });

        let got: Vec<_> = dec.feed(&wire).collect();
        assert_eq!(got, [Ok(case.frame.clone())]);

        let both = rate(budget, || {
            out.clear();
            encode(black_box(&case.frame), &mut out).expect("encodes");
            for r in dec.feed(&out) {
                black_box(r.expect("decodes"));
            }
        });

        let fmt = |fps: f64| format!("{:>9.0} fr/s {:>7.1} MB/s", fps, fps * len / 1e6);
        println!(
            "{:<14} {:>6}  {}  {}  {}",
            case.name,
            wire.len(),
            fmt(enc),
            fmt(decode),
            fmt(both)
        );
    }
    if !full {
        println!("(smoke run; `cargo bench -p protocol` for numbers)");
    }
}
