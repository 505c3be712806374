//! `hvtrace graph`: the function-graph tracer (ftrace's function_graph, run
//! from VMX root) on a detached VM.
//!
//! It checks the filter, starts the graph ([`Request::GraphStart`]), copies
//! the trace stream from that point on under `trace`'s rules (until it goes
//! quiet, or with `--follow` until Ctrl-C or the end of the VM), then stops
//! the graph ([`Request::GraphStop`]). With `--format chrome` it reads JSON
//! lines and writes a Chrome trace ([`crate::chrome`]) at the end.
//!
//! The filter checks and the start and stop requests are shared with
//! `hvtrace run --graph`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use protocol::{GraphFilter, Request, Response};

use crate::cli::GraphArgs;
use crate::client::{response_error, Control};
use crate::ctl::{self, CopyEnd, TraceOutput, TraceReader, PROBE_TIMEOUT};
use crate::sys;

/// Longest task name: the kernel's `TASK_COMM_LEN` less its NUL.
pub const MAX_COMM: usize = 15;

/// With `--follow`, each read waits this long for a line, so that a
/// Ctrl-C is acted on within it.
pub const FOLLOW_WAIT_MS: u32 = 1000;

/// Checks one glob option value: not empty, and one glob (ftrace's files
/// take a list separated by spaces; here each glob is its own option).
pub fn check_glob(option: &str, glob: &str) -> Result<()> {
    if glob.trim().is_empty() {
        bail!("{option} needs a glob (got {glob:?})");
    }
    if glob.contains(char::is_whitespace) {
        bail!("{option} {glob:?}: one glob per {option} (repeat the option for more)");
    }
    Ok(())
}

/// Checks a task name filter: a comm is 1 to [`MAX_COMM`] bytes, so a
/// longer name would match nothing.
pub fn check_comm(option: &str, comm: &str) -> Result<()> {
    if comm.is_empty() {
        bail!("{option} needs a task name");
    }
    if comm.len() > MAX_COMM {
        let mut cut = MAX_COMM;
        while !comm.is_char_boundary(cut) {
            cut -= 1;
        }
        bail!(
            "{option} {comm:?}: task names are at most {MAX_COMM} bytes (the kernel calls this one {:?})",
            &comm[..cut]
        );
    }
    Ok(())
}

/// The filter of `hvtrace graph`, checked.
pub fn filter(args: &GraphArgs) -> Result<GraphFilter> {
    for (option, globs) in [
        ("--function", &args.functions),
        ("--trace", &args.trace),
        ("--notrace", &args.notrace),
    ] {
        for glob in globs {
            check_glob(option, glob)?;
        }
    }
    if let Some(comm) = &args.comm {
        check_comm("--comm", comm)?;
    }
    Ok(GraphFilter {
        functions: args.functions.clone(),
        trace: args.trace.clone(),
        notrace: args.notrace.clone(),
        max_depth: args.max_depth,
        pid: args.pid,
        comm: args.comm.clone(),
        retval: args.retval,
    })
}

/// The line that reports a started graph.
pub fn started_line(hooked: u32, roots: u32, skipped: u32) -> String {
    let s = |n: u32| if n == 1 { "" } else { "s" };
    format!(
        "function graph on: {hooked} function{} hooked, {roots} root{}, {skipped} skipped",
        s(hooked),
        s(roots)
    )
}

/// Starts the function-graph tracer; returns [`started_line`].
pub fn start(control: &mut dyn Control, filter: GraphFilter) -> Result<String> {
    match control.request(Request::GraphStart(filter), PROBE_TIMEOUT)? {
        Response::GraphStarted {
            hooked,
            roots,
            skipped,
        } => Ok(started_line(hooked, roots, skipped)),
        other => Err(response_error(other)),
    }
}

/// Stops the function-graph tracer.
pub fn stop(control: &mut dyn Control) -> Result<()> {
    match control.request(Request::GraphStop, PROBE_TIMEOUT)? {
        Response::Ok => Ok(()),
        other => Err(response_error(other)).context("cannot stop the function graph"),
    }
}

/// `hvtrace graph`.
pub fn graph(socket: &Path, args: &GraphArgs) -> Result<u8> {
    // What can be checked without a VM, first.
    let filter = filter(args)?;
    let mut client = ctl::open(socket)?;
    let mut output = TraceOutput::create(args.output.as_deref(), args.format)?;
    // Only this graph's lines: the stream may hold older ones.
    let mut reader = TraceReader::at_end(&mut client, args.format.protocol())?;
    // From here on, a Ctrl-C ends the reading; the graph is stopped and
    // the output finished all the same.
    sys::catch_interrupt().context("cannot catch Ctrl-C")?;
    let started = start(&mut client, filter)?;
    eprintln!("hvtrace: {started}");
    let copied = ctl::copy_trace(
        &mut client,
        &mut reader,
        args.follow,
        FOLLOW_WAIT_MS,
        &mut output,
        &sys::interrupted,
    );
    let stopped = match &copied {
        // Nothing left to stop.
        Ok(CopyEnd::VmEnded(why)) => {
            eprintln!("hvtrace: {why}");
            Ok(())
        }
        _ => stop(&mut client),
    };
    let finished = output.finish();
    copied?;
    stopped?;
    match finished {
        Ok(Some(summary)) => eprintln!("hvtrace: {}", summary.line()),
        Ok(None) => {}
        // The reader of our output left (`| head`): nothing more to say.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => bail!("cannot write the trace: {e}"),
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use protocol::ErrorKind;
    use std::collections::VecDeque;
    use std::time::Duration;

    fn args(argv: &[&str]) -> GraphArgs {
        let mut full = vec!["hvtrace", "graph"];
        full.extend_from_slice(argv);
        match crate::cli::Cli::try_parse_from(full).unwrap().command {
            crate::cli::Command::Graph(args) => args,
            other => panic!("not graph: {other:?}"),
        }
    }

    #[test]
    fn the_filter_carries_every_option() {
        let f = filter(&args(&[
            "--function",
            "vfs_read",
            "--function",
            "vfs_write",
            "--trace",
            "vfs_*",
            "--notrace",
            "rw_verify_area",
            "--max-depth",
            "3",
            "--pid",
            "90",
            "--comm",
            "dd",
            "--retval",
        ]))
        .unwrap();
        assert_eq!(
            f,
            GraphFilter {
                functions: vec!["vfs_read".into(), "vfs_write".into()],
                trace: vec!["vfs_*".into()],
                notrace: vec!["rw_verify_area".into()],
                max_depth: 3,
                pid: Some(90),
                comm: Some("dd".into()),
                retval: true,
            }
        );
        assert_eq!(filter(&args(&[])).unwrap(), GraphFilter::default());
    }

    #[test]
    fn bad_filters_are_refused_locally() {
        for (argv, message) in [
            (
                &["--function", ""][..],
                r#"--function needs a glob (got "")"#,
            ),
            (
                &["--trace", "vfs_read vfs_write"][..],
                r#"--trace "vfs_read vfs_write": one glob per --trace (repeat the option for more)"#,
            ),
            (
                &["--notrace", " "][..],
                r#"--notrace needs a glob (got " ")"#,
            ),
            (&["--comm", ""][..], "--comm needs a task name"),
            (
                &["--comm", "systemd-journald"][..],
                r#"--comm "systemd-journald": task names are at most 15 bytes (the kernel calls this one "systemd-journal")"#,
            ),
        ] {
            let e = filter(&args(argv)).unwrap_err().to_string();
            assert_eq!(e, message, "{argv:?}");
        }
        assert!(check_comm("--comm", "systemd-journal").is_ok());
        // A cut never splits a character.
        let e = check_comm("--comm", "ééééééééé").unwrap_err().to_string();
        assert!(
            e.ends_with(r#"(the kernel calls this one "ééééééé")"#),
            "{e}"
        );
    }

    #[test]
    fn started_lines() {
        assert_eq!(
            started_line(42, 1, 0),
            "function graph on: 42 functions hooked, 1 root, 0 skipped"
        );
        assert_eq!(
            started_line(1, 3, 2),
            "function graph on: 1 function hooked, 3 roots, 2 skipped"
        );
    }

    struct Canned {
        answers: VecDeque<Response>,
        seen: Vec<Request>,
    }

    impl Control for Canned {
        fn request(&mut self, request: Request, _timeout: Duration) -> Result<Response> {
            self.seen.push(request);
            Ok(self.answers.pop_front().expect("no answer left"))
        }
    }

    #[test]
    fn start_and_stop_requests() {
        let mut c = Canned {
            answers: [
                Response::GraphStarted {
                    hooked: 12,
                    roots: 1,
                    skipped: 2,
                },
                Response::error(ErrorKind::NotFound, "no function matches vfs_nope"),
                Response::Ok,
                Response::error(ErrorKind::NotReady, "the graph is not running"),
            ]
            .into(),
            seen: Vec::new(),
        };
        let f = GraphFilter {
            functions: vec!["vfs_read".into()],
            ..GraphFilter::default()
        };
        assert_eq!(
            start(&mut c, f.clone()).unwrap(),
            "function graph on: 12 functions hooked, 1 root, 2 skipped"
        );
        assert_eq!(c.seen[0], Request::GraphStart(f.clone()));
        let e = start(&mut c, f).unwrap_err().to_string();
        assert_eq!(e, "no function matches vfs_nope");
        stop(&mut c).unwrap();
        assert_eq!(c.seen[2], Request::GraphStop);
        let e = format!("{:#}", stop(&mut c).unwrap_err());
        assert_eq!(
            e,
            "cannot stop the function graph: the graph is not running"
        );
    }
}
