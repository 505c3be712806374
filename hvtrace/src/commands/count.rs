//! `hvtrace count GLOB...`: calls per function, counted in VMX root (as
//! bcc's funccount), and `run --count` for one-shot use.
//!
//! The count runs until `--duration` has passed, the `--exec` command has
//! ended, or Ctrl-C (which ends it as planned: the final table is printed
//! and the exit code is 0). With `--interval`, the counts so far are
//! printed at each interval too (they keep adding up, as funccount's do
//! without `-i` clearing).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use protocol::{CountFilter, FunctionCount, HistFilter, HistRow, Request, Response};

use crate::commands::cli::{AggregateArgs, CountArgs, HistArgs, HistKeyArg};
use crate::commands::ctl::{self, open};
use crate::commands::timeouts::{PROBE_TIMEOUT, STATUS_TIMEOUT};
use crate::control::{response_error, Control};
use crate::output::json::{self, Json};
use crate::sys;
use crate::term;

/// Functions asked for per `CountRead` page.
const PAGE: u32 = 200;
/// Most pages one read takes (a guard against a cursor that never ends).
const MAX_PAGES: usize = 10_000;

/// The counters at one moment: the pages of one read merged into one
/// (`next` left `None`).
pub type Counts = protocol::CountPage;

/// The filter of a count from its options, checked.
pub fn filter(
    globs: &[String],
    pid: Option<i32>,
    comm: Option<&str>,
    latency: bool,
) -> Result<CountFilter> {
    if globs.is_empty() {
        bail!("count needs at least one glob");
    }
    if let Some(g) = globs.iter().find(|g| g.trim().is_empty()) {
        bail!("count needs globs, not empty words (got {g:?})");
    }
    check_comm(comm)?;
    Ok(CountFilter {
        functions: globs.to_vec(),
        pid,
        comm: comm.map(str::to_string),
        latency,
        hist: None,
        gate: None,
    })
}

/// Refuses a comm the kernel could not hold (1 to 15 bytes).
pub fn check_comm(comm: Option<&str>) -> Result<()> {
    match comm {
        Some(c) if c.is_empty() || c.len() > 15 => {
            bail!("--comm takes a name of 1 to 15 bytes (got {c:?})")
        }
        _ => Ok(()),
    }
}

/// Starts the count; returns its summary line.
pub fn start(control: &mut dyn Control, filter: CountFilter) -> Result<String> {
    let globs = filter.functions.join(" ");
    match control.request(Request::CountStart(filter), PROBE_TIMEOUT)? {
        Response::CountStarted {
            functions,
            skipped,
            skipped_total,
        } => {
            let mut line = format!("counting {functions} functions matching {globs}");
            if skipped_total > 0 {
                let _ = write!(line, "; {skipped_total} not hooked");
                if let Some(first) = skipped.first() {
                    let _ = write!(line, " (e.g. {first})");
                }
            }
            Ok(line)
        }
        other => Err(response_error(other)),
    }
}

/// Reads every page of the counters.
pub fn read(control: &mut dyn Control) -> Result<Counts> {
    let mut out = Counts::default();
    let mut cursor = 0u64;
    for _ in 0..MAX_PAGES {
        match control.request(
            Request::CountRead {
                cursor,
                limit: PAGE,
            },
            STATUS_TIMEOUT,
        )? {
            Response::Counts(page) => {
                // The last page's figures, every page's entries.
                let next = page.next;
                let mut entries = std::mem::take(&mut out.entries);
                entries.extend(page.entries);
                out = Counts {
                    entries,
                    next: None,
                    ..page
                };
                match next {
                    Some(n) if n > cursor => cursor = n,
                    Some(_) => bail!("the hypervisor's count pages do not move on"),
                    None => return Ok(out),
                }
            }
            other => return Err(response_error(other)),
        }
    }
    bail!("the counts did not end within {MAX_PAGES} pages")
}

/// Stops the count.
pub fn stop(control: &mut dyn Control) -> Result<()> {
    match control.request(Request::CountStop, PROBE_TIMEOUT)? {
        Response::Ok => Ok(()),
        other => Err(response_error(other)),
    }
}

/// The counts as funccount prints them: `FUNC COUNT`, the most called
/// last; `top` keeps only the most called. Names are made safe for a
/// terminal.
pub fn text(c: &Counts, top: Option<usize>) -> String {
    let mut entries: Vec<&FunctionCount> = c.entries.iter().collect();
    entries.sort_by(|a, b| a.calls.cmp(&b.calls).then(a.name.cmp(&b.name)));
    if let Some(n) = top {
        let skip = entries.len().saturating_sub(n);
        entries.drain(..skip);
    }
    let width = entries
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(0)
        .max(36);
    let mut out = format!("{:<width$} {:>12}\n", "FUNC", "COUNT");
    for e in entries {
        let _ = writeln!(out, "{:<width$} {:>12}", term::sanitize(&e.name), e.calls);
    }
    let _ = writeln!(
        out,
        "{} calls of {} functions ({} called) in {:.3} s of root time{}; {} B of hypervisor memory",
        c.calls,
        c.functions,
        c.entries.len(),
        c.elapsed_ns as f64 / 1e9,
        match c.filtered {
            0 => String::new(),
            n => format!(", {n} calls left out by the filter"),
        },
        c.memory
    );
    out
}

/// The latency histogram as bcc's funclatency draws it: one row per log2
/// bucket of nanoseconds from the first to the last that holds a call.
pub fn histogram(c: &Counts) -> String {
    const BAR: usize = 40;
    let mut out = format!(
        "{:>20} : {:<8} {}\n",
        "nsecs",
        "count",
        format_args!("{:<w$}", "distribution", w = BAR + 2)
    );
    let first = c.latency.iter().position(|&n| n != 0);
    let last = c.latency.iter().rposition(|&n| n != 0);
    let max = c.latency.iter().copied().max().unwrap_or(0).max(1);
    if let (Some(first), Some(last)) = (first, last) {
        for (i, &n) in c.latency.iter().enumerate().take(last + 1).skip(first) {
            let (low, high) = match i {
                0 => (0, 0),
                63.. => (1u64 << 62, u64::MAX),
                _ => (1u64 << (i - 1), (1u64 << i) - 1),
            };
            let stars = ((n as u128 * BAR as u128) / max as u128) as usize;
            let _ = writeln!(
                out,
                "{:>20} : {:<8} |{:<BAR$}|",
                format!("{low} -> {high}"),
                n,
                "*".repeat(stars)
            );
        }
    }
    let timed: u64 = c.latency.iter().sum();
    let _ = writeln!(
        out,
        "{timed} calls timed{}",
        match c.latency_missed {
            0 => String::new(),
            n => format!(", {n} not (their return could not be hijacked)"),
        }
    );
    out
}

/// A histogram's rows at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hists {
    pub rows: Vec<HistRow>,
    pub overflow: u64,
    pub faults: u64,
    pub max_keys: u32,
}

/// Reads every page of the histogram.
pub fn read_hist(control: &mut dyn Control) -> Result<Hists> {
    let mut out = Hists::default();
    let mut cursor = 0u32;
    for _ in 0..MAX_PAGES {
        match control.request(Request::HistRead { cursor }, STATUS_TIMEOUT)? {
            Response::Hist {
                rows,
                next,
                overflow,
                faults,
                max_keys,
            } => {
                out.rows.extend(rows);
                out.overflow = overflow;
                out.faults = faults;
                out.max_keys = max_keys;
                match next {
                    Some(n) if n > cursor => cursor = n,
                    Some(_) => bail!("the hypervisor's histogram pages do not move on"),
                    None => return Ok(out),
                }
            }
            other => return Err(response_error(other)),
        }
    }
    bail!("the histogram did not end within {MAX_PAGES} pages")
}

/// A power of two as bpftrace labels it: `512`, `1K`, `4M`.
fn power_label(v: u64) -> String {
    const UNITS: [&str; 7] = ["", "K", "M", "G", "T", "P", "E"];
    let mut v = v;
    let mut unit = 0;
    while v >= 1024 && v.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        v /= 1024;
        unit += 1;
    }
    format!("{v}{}", UNITS[unit])
}

/// The label of log2 bucket `i`: `[0]`, `[1]`, `[2, 4)`, ..., as bpftrace
/// prints a `hist()`.
pub fn bucket_label(i: usize) -> String {
    match i {
        0 => "[0]".to_string(),
        1 => "[1]".to_string(),
        63.. => format!("[{}, ...)", power_label(1 << 62)),
        _ => format!(
            "[{}, {})",
            power_label(1 << (i - 1)),
            power_label(1u64 << i)
        ),
    }
}

/// The histogram as bpftrace draws `@[key] = hist(value)`: a block per
/// key, a row per bucket from its first used one to its last.
pub fn hist_text(h: &Hists) -> String {
    const BAR: usize = 52;
    let mut out = String::new();
    for r in &h.rows {
        let _ = writeln!(out, "@[{}]:", term::sanitize(&r.key));
        let first = r.buckets.iter().position(|&n| n != 0).unwrap_or(0);
        let max = r.buckets.iter().copied().max().unwrap_or(0).max(1);
        for (i, &n) in r.buckets.iter().enumerate().skip(first) {
            let bar = ((n as u128 * BAR as u128) / max as u128) as usize;
            let _ = writeln!(
                out,
                "{:<20} {:>8} |{:<BAR$}|",
                bucket_label(i),
                n,
                "@".repeat(bar)
            );
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "{} keys (at most {}){}{}",
        h.rows.len(),
        h.max_keys,
        match h.overflow {
            0 => String::new(),
            n => format!(", {n} calls of further keys not placed"),
        },
        match h.faults {
            0 => String::new(),
            n => format!(", {n} values unreadable"),
        }
    );
    out
}

/// The histogram as one JSON object.
pub fn hist_json(h: &Hists) -> String {
    let rows = h
        .rows
        .iter()
        .map(|r| {
            json::object([
                ("key", Json::String(r.key.clone())),
                (
                    "buckets_log2",
                    Json::Array(r.buckets.iter().map(|&n| json::int(n)).collect()),
                ),
            ])
        })
        .collect();
    json::object([
        ("rows", Json::Array(rows)),
        ("overflow", json::int(h.overflow)),
        ("faults", json::int(h.faults)),
        ("max_keys", json::int(u64::from(h.max_keys))),
    ])
    .to_string()
}

/// The filter of a histogram from its options, checked.
pub fn hist_filter(
    spec: &str,
    key: HistKeyArg,
    pid: Option<i32>,
    comm: Option<&str>,
) -> Result<CountFilter> {
    ctl::check_probe_spec(spec)?;
    check_comm(comm)?;
    Ok(CountFilter {
        functions: Vec::new(),
        pid,
        comm: comm.map(str::to_string),
        latency: false,
        hist: Some(HistFilter {
            spec: spec.to_string(),
            key: key.protocol(),
        }),
        gate: None,
    })
}

/// `hvtrace hist`.
pub fn hist(socket: &Path, args: &HistArgs) -> Result<u8> {
    let spec = args.spec.join(" ");
    let o = &args.run;
    let filter = hist_filter(&spec, args.key, o.pid, o.comm.as_deref())
        .with_context(|| format!("hist {spec:?}"))?;
    aggregate(socket, filter, "histogram: ", o, false, &mut |c, at| {
        let h = read_hist(c)?;
        if o.json {
            println!("{}", hist_json(&h));
        } else {
            if let Some(at) = at {
                println!("[{:.1} s]", at.as_secs_f64());
            }
            print!("{}", hist_text(&h));
        }
        Ok(())
    })
}

/// The counts as one JSON object.
pub fn json_line(c: &Counts) -> String {
    let entries = c
        .entries
        .iter()
        .map(|e| {
            json::object([
                ("name", Json::String(e.name.clone())),
                ("addr", json::int(e.addr)),
                ("calls", json::int(e.calls)),
                ("errors", json::int(e.errors)),
                ("total_ns", json::int(e.total_ns)),
            ])
        })
        .collect();
    json::object([
        ("functions", json::int(u64::from(c.functions))),
        ("calls", json::int(c.calls)),
        ("filtered", json::int(c.filtered)),
        ("elapsed_ns", json::int(c.elapsed_ns)),
        ("memory", json::int(c.memory)),
        ("counts", Json::Array(entries)),
        (
            "latency_ns_log2",
            Json::Array(c.latency.iter().map(|&n| json::int(n)).collect()),
        ),
        ("latency_missed", json::int(c.latency_missed)),
    ])
    .to_string()
}

fn print(c: &Counts, args: &CountArgs, latency: bool, at: Option<Duration>) {
    if args.run.json {
        println!("{}", json_line(c));
    } else {
        if let Some(at) = at {
            println!("[{:.1} s]", at.as_secs_f64());
        }
        if latency {
            print!("{}", histogram(c));
        } else {
            print!("{}", text(c, args.top));
        }
        if at.is_some() {
            println!();
        }
    }
}

/// `hvtrace count`, and `hvtrace latency` (`latency`: the histogram of
/// durations instead of the counts).
pub fn count(socket: &Path, args: &CountArgs, latency: bool) -> Result<u8> {
    let o = &args.run;
    let filter = filter(&args.globs, o.pid, o.comm.as_deref(), latency)?;
    aggregate(socket, filter, "", o, false, &mut |c, at| {
        print(&read(c)?, args, latency, at);
        Ok(())
    })
}

/// Runs one aggregation on the VM at `socket`: starts it with `filter`
/// (its summary line on stderr after `label`), waits for its end, shows
/// it with `show` at each interval and at the end, and stops it whatever
/// happened (its error comes second).
pub fn aggregate(
    socket: &Path,
    mut filter: CountFilter,
    label: &str,
    o: &AggregateArgs,
    gated: bool,
    show: &mut dyn FnMut(&mut crate::client::Client, Option<Duration>) -> Result<()>,
) -> Result<u8> {
    let interval = seconds("--interval", o.interval)?;
    let duration = seconds("--duration", o.duration)?;
    let mut client = open(socket)?;
    // With `gated` and a task filter: a gate with the same filter, so
    // that the counted functions are unhooked where those tasks do not
    // run (the quiet views).
    let gate = if gated {
        gate_session(&mut client, filter.pid, filter.comm.as_deref())
    } else {
        None
    };
    filter.gate = gate;
    let started = start(&mut client, filter);
    let result = started.and_then(|line| {
        eprintln!("hvtrace: {label}{}", term::sanitize(&line));
        run_until_done(&mut client, o.exec.as_deref(), interval, duration, show)
    });
    let stopped = stop(&mut client);
    if let Some(s) = gate {
        let _ = client.request(Request::GraphStop { session: Some(s) }, PROBE_TIMEOUT);
    }
    let code = result?;
    stopped?;
    Ok(code)
}

/// A gate session (`GraphFilter::gate`) filtering by `pid` and `comm`;
/// `None` without a filter, or when root cannot start one (the note says
/// so: the filter then runs after each call's exit).
pub fn gate_session(
    control: &mut dyn Control,
    pid: Option<i32>,
    comm: Option<&str>,
) -> Option<u32> {
    if pid.is_none() && comm.is_none() {
        return None;
    }
    let filter = protocol::GraphFilter {
        pid,
        comm: comm.map(str::to_string),
        gate: true,
        ..protocol::GraphFilter::default()
    };
    match control.request(Request::GraphStart(filter), PROBE_TIMEOUT) {
        Ok(Response::GraphStarted { session, .. }) => Some(session),
        other => {
            let why = match other {
                Ok(r) => format!("{:#}", response_error(r)),
                Err(e) => format!("{e:#}"),
            };
            eprintln!(
                "hvtrace: note: the task filter applies after each call's exit (no gate): {}",
                term::sanitize(&why)
            );
            None
        }
    }
}

/// Waits for the end of a count (its `--exec` command, `--duration`, or
/// Ctrl-C), showing it at each `--interval`, then once more at the end.
fn run_until_done(
    client: &mut crate::client::Client,
    exec: Option<&str>,
    interval: Option<Duration>,
    duration: Option<Duration>,
    show: &mut dyn FnMut(&mut crate::client::Client, Option<Duration>) -> Result<()>,
) -> Result<u8> {
    let t0 = Instant::now();
    if let Some(cmd) = exec {
        let (output, status) = ctl::run_in_guest(client, cmd)?;
        eprint!("{}", term::for_stream(&output, term::stderr_is_terminal()));
        if status != 0 {
            eprintln!("hvtrace: the command exited with {status}");
        }
    } else {
        if interval.is_none() && duration.is_none() {
            eprintln!("hvtrace: Ctrl-C ends the count and prints it");
        }
        let mut next_print = interval.map(|i| t0 + i);
        loop {
            if sys::take_interrupt() {
                break;
            }
            let now = Instant::now();
            if duration.is_some_and(|d| now >= t0 + d) {
                break;
            }
            if let Some(at) = next_print.filter(|&at| now >= at) {
                show(client, Some(at - t0))?;
                next_print = interval.map(|i| at + i);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    show(client, None)?;
    Ok(0)
}

fn seconds(what: &str, v: Option<f64>) -> Result<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => bail!("{what} takes a positive number of seconds (got {s})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts() -> Counts {
        Counts {
            functions: 61,
            calls: 16,
            filtered: 2,
            elapsed_ns: 1_500_000_000,
            memory: 4880,
            entries: vec![
                FunctionCount {
                    name: "vfs_read".into(),
                    addr: 0xffff_ffff_8130_0000,
                    calls: 12,
                    errors: 0,
                    total_ns: 0,
                },
                FunctionCount {
                    name: "vfs_open".into(),
                    addr: 0xffff_ffff_8130_1000,
                    calls: 1,
                    errors: 0,
                    total_ns: 0,
                },
                FunctionCount {
                    name: "ext4_file_open [ext4]".into(),
                    addr: 0xffff_ffff_c000_1000,
                    calls: 3,
                    errors: 1,
                    total_ns: 4_500,
                },
            ],
            latency: vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 1],
            latency_missed: 1,
            next: None,
        }
    }

    #[test]
    fn the_histogram_draws_the_used_buckets_as_funclatency() {
        let h = histogram(&counts());
        let rows: Vec<&str> = h.lines().collect();
        assert!(
            rows[0].contains("nsecs") && rows[0].contains("distribution"),
            "{h}"
        );
        assert!(
            rows[1].contains("512 -> 1023") && rows[1].contains(": 4 "),
            "{h}"
        );
        assert!(rows[1].contains(&format!("|{}|", "*".repeat(40))), "{h}");
        assert!(
            rows[2].contains("1024 -> 2047") && rows[2].contains(": 0 "),
            "{h}"
        );
        assert!(
            rows[3].contains("2048 -> 4095")
                && rows[3].contains(&format!("|{:<40}|", "*".repeat(10))),
            "{h}"
        );
        assert!(rows[4].starts_with("5 calls timed, 1 not"), "{h}");
        assert_eq!(rows.len(), 5, "{h}");
        let empty = histogram(&Counts::default());
        assert_eq!(empty.lines().count(), 2, "{empty}");
    }

    #[test]
    fn text_lists_the_most_called_last_and_keeps_the_top() {
        let t = text(&counts(), None);
        let rows: Vec<(&str, u64)> = t
            .lines()
            .skip(1)
            .take(3)
            .map(|l| {
                let (name, n) = l.rsplit_once(' ').unwrap();
                (name.trim(), n.parse().unwrap())
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("vfs_open", 1),
                ("ext4_file_open [ext4]", 3),
                ("vfs_read", 12)
            ]
        );
        assert!(t.starts_with("FUNC "), "{t}");
        assert!(
            t.contains("16 calls of 61 functions (3 called) in 1.500 s"),
            "{t}"
        );
        assert!(t.contains("2 calls left out by the filter"), "{t}");
        let top = text(&counts(), Some(1));
        assert_eq!(top.lines().count(), 3, "{top}");
        assert!(
            top.lines().nth(1).unwrap().starts_with("vfs_read "),
            "{top}"
        );
    }

    #[test]
    fn a_histogram_draws_as_bpftrace() {
        assert_eq!(bucket_label(0), "[0]");
        assert_eq!(bucket_label(1), "[1]");
        assert_eq!(bucket_label(2), "[2, 4)");
        assert_eq!(bucket_label(10), "[512, 1K)");
        assert_eq!(bucket_label(21), "[1M, 2M)");
        assert_eq!(bucket_label(63), "[4E, ...)");
        let h = Hists {
            rows: vec![
                HistRow {
                    key: "dd".into(),
                    buckets: vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 2],
                },
                HistRow {
                    key: "a\x1bb".into(),
                    buckets: vec![1],
                },
            ],
            overflow: 3,
            faults: 0,
            max_keys: 64,
        };
        let t = hist_text(&h);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "@[dd]:");
        assert!(
            lines[1].starts_with("[512, 1K)")
                && lines[1].contains(&format!("|{}|", "@".repeat(52))),
            "{t}"
        );
        assert!(
            lines[2].starts_with("[1K, 2K)") && lines[2].contains(" 0 |"),
            "{t}"
        );
        assert!(
            lines[4].starts_with("[4K, 8K)")
                && lines[4].contains(&format!("|{:<52}|", "@".repeat(26))),
            "{t}"
        );
        assert_eq!(lines[6], "@[a\\x1bb]:", "{t}");
        assert!(
            t.contains("2 keys (at most 64), 3 calls of further keys not placed"),
            "{t}"
        );
        let j = hist_json(&h);
        assert!(
            j.contains(r#"{"key":"dd","buckets_log2":[0,0,0,0,0,0,0,0,0,0,4,0,0,2]}"#),
            "{j}"
        );
        assert!(j.contains(r#""overflow":3"#), "{j}");
    }

    #[test]
    fn json_has_every_field() {
        let j = json_line(&counts());
        for needle in [
            r#""functions":61"#,
            r#""calls":16"#,
            r#""filtered":2"#,
            r#""memory":4880"#,
            r#"{"name":"ext4_file_open [ext4]","addr":18446744072635813888,"calls":3,"errors":1,"total_ns":4500}"#,
        ] {
            assert!(j.contains(needle), "{needle} in {j}");
        }
    }

    #[test]
    fn filters_are_checked_before_any_vm_is_asked() {
        assert!(filter(&[], None, None, false).is_err());
        assert!(filter(&[" ".into()], None, None, false).is_err());
        assert!(filter(&["vfs_*".into()], None, Some(""), false).is_err());
        assert!(filter(&["vfs_*".into()], None, Some("sixteen_bytes_xx"), false).is_err());
        let f = filter(&["vfs_*".into()], Some(7), Some("dd"), true).unwrap();
        assert_eq!(
            (f.pid, f.comm.as_deref(), f.latency),
            (Some(7), Some("dd"), true)
        );
        assert!(seconds("--interval", Some(0.0)).is_err());
        assert!(seconds("--interval", Some(f64::NAN)).is_err());
        assert_eq!(
            seconds("--interval", Some(0.5)).unwrap(),
            Some(Duration::from_millis(500))
        );
    }

    #[test]
    fn a_read_follows_the_pages_and_stops_a_cursor_that_does_not_move() {
        struct Pages(Vec<Option<u64>>);
        impl Control for Pages {
            fn request(&mut self, r: Request, _: Duration) -> Result<Response> {
                let Request::CountRead { cursor, .. } = r else {
                    panic!("{r:?}")
                };
                let next = self.0.remove(0);
                Ok(Response::Counts(protocol::CountPage {
                    functions: 2,
                    calls: 5,
                    filtered: 0,
                    elapsed_ns: 1,
                    memory: 8,
                    entries: vec![FunctionCount {
                        name: format!("f{cursor}"),
                        addr: cursor,
                        calls: 1,
                        errors: 0,
                        total_ns: 0,
                    }],
                    next,
                    latency: vec![],
                    latency_missed: 0,
                }))
            }
        }
        let c = read(&mut Pages(vec![Some(10), Some(20), None])).unwrap();
        let names: Vec<&str> = c.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["f0", "f10", "f20"]);
        assert!(read(&mut Pages(vec![Some(10), Some(10)])).is_err());
    }
}
