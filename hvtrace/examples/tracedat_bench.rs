//! The trace.dat writer against the JSON lines it is made from: size and
//! time per million events, for a mix shaped like a recording (function
//! tracer hits, probe hits with a string, graph entries and returns, task
//! switches), on one or two CPUs.
//!
//! `cargo run --release -p hvtrace --example tracedat_bench [EVENTS]`
//! (default 1,000,000). Prints one line per figure.

use std::time::Instant;

use hvtrace::output::tracedat::TraceDat;

fn lines(n: usize) -> String {
    let mut out = String::with_capacity(n * 200);
    let mut ts = 5_000_000_000u64;
    for i in 0..n {
        ts += 700 + (i as u64 % 13) * 100;
        let cpu = i % 2;
        let pid = 100 + (i / 50) % 7;
        let line = match i % 6 {
            0 => format!(
                r#"{{"ts":"5.0","ts_ns":{ts},"cpu":{cpu},"pid":{pid},"comm":"dd","kind":"function","func":"vfs_read","parent":"ksys_read+0x72/0x9f","ip":"0xffffffff81200000","parent_ip":"0xffffffff81201072"}}"#
            ),
            1 => format!(
                r#"{{"ts":"5.0","ts_ns":{ts},"cpu":{cpu},"pid":{pid},"comm":"dd","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81300000","probe":"do_sys_openat2+0x0/0x150","args":{{"dfd":-100,"filename":"/etc/hostname"}}}}"#
            ),
            2 | 3 => format!(
                r#"{{"ts":"5.0","ts_ns":{ts},"cpu":{cpu},"pid":{pid},"comm":"dd","kind":"graph_entry","func":"shmem_file_read_iter","ip":"0xffffffff81280000","depth":1,"session":1}}"#
            ),
            4 => format!(
                r#"{{"ts":"5.0","ts_ns":{ts},"cpu":{cpu},"pid":{pid},"comm":"dd","kind":"graph_return","func":"shmem_file_read_iter","ip":"0xffffffff81280000","depth":1,"session":1,"duration_ns":1500,"retval":"0x40"}}"#
            ),
            _ => format!(
                r#"{{"ts":"5.0","ts_ns":{ts},"cpu":{cpu},"pid":{pid},"comm":"dd","kind":"sched_switch","prev_comm":"dd","prev_pid":{pid},"prev_prio":120,"prev_state":"S","next_comm":"swapper/{cpu}","next_pid":0,"next_prio":120}}"#
            ),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let text = lines(n);
    let t0 = Instant::now();
    let mut dat =
        TraceDat::new(["p:kprobes/myopen do_sys_openat2 dfd=%di:s32 filename=+0(%si):string"]);
    dat.cpus_at_least(2);
    // As the reader hands them over: about 3,000 bytes at a time.
    let mut rest = text.as_str();
    while !rest.is_empty() {
        let mut cut = rest.len().min(3000);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        dat.push_text(&rest[..cut]);
        rest = &rest[cut..];
    }
    let taken = t0.elapsed();
    let mut out = Vec::new();
    let t1 = Instant::now();
    let summary = dat
        .write(&mut out, Some(String::new()))
        .expect("writing to memory");
    let written = t1.elapsed();
    let per_m = |x: f64| x * 1_000_000.0 / n as f64;
    println!("events: {}", summary.events);
    println!(
        "JSON lines: {} bytes ({:.1} MB per million events)",
        text.len(),
        per_m(text.len() as f64) / 1e6
    );
    println!(
        "trace.dat (no kallsyms): {} bytes ({:.1} MB per million events, {:.1}% of the JSON)",
        out.len(),
        per_m(out.len() as f64) / 1e6,
        100.0 * out.len() as f64 / text.len() as f64
    );
    println!(
        "taking the lines: {:.2} s per million events; writing the file: {:.2} s per million events",
        per_m(taken.as_secs_f64()),
        per_m(written.as_secs_f64())
    );
}
