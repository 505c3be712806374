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

use anyhow::{bail, Result};
use protocol::{CountFilter, FunctionCount, Request, Response};

use crate::client::{response_error, Control};
use crate::commands::cli::CountArgs;
use crate::commands::ctl::{self, open, PROBE_TIMEOUT, STATUS_TIMEOUT};
use crate::output::json::{self, Json};
use crate::output::term;
use crate::sys;

/// Functions asked for per `CountRead` page.
const PAGE: u32 = 200;
/// Most pages one read takes (a guard against a cursor that never ends).
const MAX_PAGES: usize = 10_000;

/// The counters at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Functions counted (hooked).
    pub functions: u32,
    /// Calls counted over every function.
    pub calls: u64,
    /// Calls the pid or comm filter left out.
    pub filtered: u64,
    /// Root time since the count started.
    pub elapsed_ns: u64,
    /// Hypervisor memory the count holds.
    pub memory: u64,
    /// The functions called at least once, in address order.
    pub entries: Vec<FunctionCount>,
}

/// The filter of a count from its options, checked.
pub fn filter(globs: &[String], pid: Option<i32>, comm: Option<&str>) -> Result<CountFilter> {
    if globs.is_empty() {
        bail!("count needs at least one glob");
    }
    if let Some(g) = globs.iter().find(|g| g.trim().is_empty()) {
        bail!("count needs globs, not empty words (got {g:?})");
    }
    if let Some(c) = comm {
        if c.is_empty() || c.len() > 15 {
            bail!("--comm takes a name of 1 to 15 bytes (got {c:?})");
        }
    }
    Ok(CountFilter {
        functions: globs.to_vec(),
        pid,
        comm: comm.map(str::to_string),
    })
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
            Response::Counts {
                functions,
                calls,
                filtered,
                elapsed_ns,
                memory,
                entries,
                next,
            } => {
                out.functions = functions;
                out.calls = calls;
                out.filtered = filtered;
                out.elapsed_ns = elapsed_ns;
                out.memory = memory;
                out.entries.extend(entries);
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
    ])
    .to_string()
}

fn print(c: &Counts, args: &CountArgs, at: Option<Duration>) {
    if args.json {
        println!("{}", json_line(c));
    } else {
        if let Some(at) = at {
            println!("[{:.1} s]", at.as_secs_f64());
        }
        print!("{}", text(c, args.top));
        if at.is_some() {
            println!();
        }
    }
}

/// `hvtrace count`.
pub fn count(socket: &Path, args: &CountArgs) -> Result<u8> {
    let filter = filter(&args.globs, args.pid, args.comm.as_deref())?;
    let interval = seconds("--interval", args.interval)?;
    let duration = seconds("--duration", args.duration)?;
    let mut client = open(socket)?;
    let line = start(&mut client, filter)?;
    eprintln!("hvtrace: {}", term::sanitize(&line));
    let result = count_until_done(&mut client, args, interval, duration);
    // The count goes whatever happened; its error comes second.
    let stopped = stop(&mut client);
    let code = result?;
    stopped?;
    Ok(code)
}

fn count_until_done(
    client: &mut crate::client::Client,
    args: &CountArgs,
    interval: Option<Duration>,
    duration: Option<Duration>,
) -> Result<u8> {
    let t0 = Instant::now();
    if let Some(cmd) = &args.exec {
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
                print(&read(client)?, args, Some(at - t0));
                next_print = interval.map(|i| at + i);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    print(&read(client)?, args, None);
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
                },
                FunctionCount {
                    name: "vfs_open".into(),
                    addr: 0xffff_ffff_8130_1000,
                    calls: 1,
                },
                FunctionCount {
                    name: "ext4_file_open [ext4]".into(),
                    addr: 0xffff_ffff_c000_1000,
                    calls: 3,
                },
            ],
        }
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
    fn json_has_every_field() {
        let j = json_line(&counts());
        for needle in [
            r#""functions":61"#,
            r#""calls":16"#,
            r#""filtered":2"#,
            r#""memory":4880"#,
            r#"{"name":"ext4_file_open [ext4]","addr":18446744072635813888,"calls":3}"#,
        ] {
            assert!(j.contains(needle), "{needle} in {j}");
        }
    }

    #[test]
    fn filters_are_checked_before_any_vm_is_asked() {
        assert!(filter(&[], None, None).is_err());
        assert!(filter(&[" ".into()], None, None).is_err());
        assert!(filter(&["vfs_*".into()], None, Some("")).is_err());
        assert!(filter(&["vfs_*".into()], None, Some("sixteen_bytes_xx")).is_err());
        let f = filter(&["vfs_*".into()], Some(7), Some("dd")).unwrap();
        assert_eq!((f.pid, f.comm.as_deref()), (Some(7), Some("dd")));
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
                Ok(Response::Counts {
                    functions: 2,
                    calls: 5,
                    filtered: 0,
                    elapsed_ns: 1,
                    memory: 8,
                    entries: vec![FunctionCount {
                        name: format!("f{cursor}"),
                        addr: cursor,
                        calls: 1,
                    }],
                    next,
                })
            }
        }
        let c = read(&mut Pages(vec![Some(10), Some(20), None])).unwrap();
        let names: Vec<&str> = c.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["f0", "f10", "f20"]);
        assert!(read(&mut Pages(vec![Some(10), Some(10)])).is_err());
    }
}
