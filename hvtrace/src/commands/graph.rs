//! `hvtrace graph`: the function-graph tracer (ftrace's function_graph, run
//! from VMX root) on a detached VM.
//!
//! It checks the filter, starts a graph session ([`Request::GraphStart`];
//! the hypervisor runs several at once and numbers them), copies that
//! session's lines of the trace stream from that point on under `trace`'s
//! rules (until it goes quiet, or with `--follow` until Ctrl-C or the end
//! of the VM), then stops that session alone ([`Request::GraphStop`]). The
//! first Ctrl-C ends the read in progress at once; the session is stopped
//! and the output finished all the same, and the command exits with 130.
//! Should the command die without stopping its session, the supervisor
//! stops it when the connection closes, unless `--persist` asked it not to.
//! Probe and function-tracer lines, and other sessions' lines, are left
//! out. With `--format chrome` it reads JSON lines and writes a Chrome
//! trace ([`crate::output::chrome`]) at the end.
//!
//! The filter checks and the start and stop requests are shared with
//! `hvtrace run --graph`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use protocol::{GraphFilter, Request, Response, TraceFormat};

use crate::commands::cli::{GraphArgs, GraphFilterArgs, OutputFormatArg};
use crate::commands::ctl;
use crate::commands::timeouts::PROBE_TIMEOUT;
use crate::commands::trace_read::{self, CopyEnd, TraceOutput, TraceReader};
use crate::control::{response_error, Control};
use crate::sys;

/// The highest graph session number ([`Response::GraphStarted`]); 0 is
/// the source of the probes and the function tracer, not a session.
pub const MAX_SESSION: u32 = 15;

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

/// How a command spells the filter's options in its messages.
#[derive(Clone, Copy, Debug)]
pub struct Spelling {
    pub roots: &'static str,
    pub trace: &'static str,
    pub notrace: &'static str,
    pub comm: &'static str,
}

/// `hvtrace graph`'s spelling.
pub const GRAPH_SPELLING: Spelling = Spelling {
    roots: "--function",
    trace: "--trace",
    notrace: "--notrace",
    comm: "--comm",
};

/// `hvtrace run`'s spelling.
pub const RUN_SPELLING: Spelling = Spelling {
    roots: "--graph",
    trace: "--graph-trace",
    notrace: "--graph-ftrace-notrace",
    comm: "--graph-comm",
};

/// The filter of the roots `functions`, the options `f` and `pid`,
/// checked; errors name the options as `spell` says.
pub fn checked_filter(
    functions: &[String],
    f: &GraphFilterArgs,
    pid: Option<i32>,
    spell: Spelling,
) -> Result<GraphFilter> {
    for (option, globs) in [
        (spell.roots, functions),
        (spell.trace, &f.trace),
        (spell.notrace, &f.notrace),
        ("--graph-notrace", &f.graph_notrace),
    ] {
        for glob in globs {
            check_glob(option, glob)?;
        }
    }
    if let Some(comm) = &f.comm {
        check_comm(spell.comm, comm)?;
    }
    Ok(GraphFilter {
        functions: functions.to_vec(),
        trace: f.trace.clone(),
        notrace: f.notrace.clone(),
        graph_notrace: f.graph_notrace.clone(),
        max_depth: f.max_depth,
        pid,
        comm: f.comm.clone(),
        retval: f.retval,
        stack_frames: f.stack_frames,
        gate: false,
    })
}

/// The filter of `hvtrace graph`, checked.
pub fn filter(args: &GraphArgs) -> Result<GraphFilter> {
    checked_filter(&args.functions, &args.filter, args.pid, GRAPH_SPELLING)
}

/// A started function-graph session, as [`Response::GraphStarted`]
/// reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Started {
    /// The session's number (1 to [`MAX_SESSION`]): the source of its
    /// trace lines, and what [`stop`] takes.
    pub session: u32,
    /// Functions hooked for the graph.
    pub hooked: u32,
    /// Functions that start a tree.
    pub roots: u32,
    /// Matches that could not be hooked.
    pub skipped: u32,
}

impl Started {
    /// The line that reports it (`function graph session 2: 42 functions
    /// hooked, 1 root, 0 skipped`).
    pub fn line(&self) -> String {
        let s = |n: u32| if n == 1 { "" } else { "s" };
        format!(
            "function graph session {}: {} function{} hooked, {} root{}, {} skipped",
            self.session,
            self.hooked,
            s(self.hooked),
            self.roots,
            s(self.roots),
            self.skipped
        )
    }
}

/// The EPT views as `status` reports them: each vCPU's view switches and
/// time armed and quiet (nanoseconds), and the pages left quiet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Views {
    pub per_vcpu: Vec<(u64, u64, u64)>,
    pub quiet_pages: u32,
}

/// The views now, from `status` (`None` when it cannot be had: the
/// closing line then leaves them out).
pub fn views(control: &mut dyn Control) -> Option<Views> {
    match control.request(Request::Status, PROBE_TIMEOUT).ok()? {
        Response::Status(r) => Some(Views {
            per_vcpu: r
                .per_vcpu
                .iter()
                .map(|v| (v.view_switches, v.armed_ns, v.quiet_ns))
                .collect(),
            quiet_pages: r.tracer.quiet_pages,
        }),
        _ => None,
    }
}

/// What a session cost, from the views at its start and at its end: the
/// functions hooked, the pages left unhooked outside its roots, and per
/// vCPU the time armed (every hook) against quiet, and the view switches.
pub fn cost_line(started: &Started, start: &Views, end: &Views) -> String {
    let ms = |ns: u64| ns / 1_000_000;
    let mut line = format!(
        "function graph session {}: {} functions hooked, {} pages of them unhooked outside the roots",
        started.session, started.hooked, end.quiet_pages
    );
    for (i, (e, b)) in end.per_vcpu.iter().zip(&start.per_vcpu).enumerate() {
        let (switches, armed, quiet) = (
            e.0.saturating_sub(b.0),
            e.1.saturating_sub(b.1),
            e.2.saturating_sub(b.2),
        );
        line.push_str(&format!(
            "; vCPU {i}: armed {} ms, quiet {} ms, {switches} view switches",
            ms(armed),
            ms(quiet)
        ));
    }
    line
}

/// Starts a function-graph session.
pub fn start(control: &mut dyn Control, filter: GraphFilter) -> Result<Started> {
    match control.request(Request::GraphStart(filter), PROBE_TIMEOUT)? {
        Response::GraphStarted {
            session,
            hooked,
            roots,
            skipped,
        } => {
            if !(1..=MAX_SESSION).contains(&session) {
                bail!(
                    "the hypervisor started function graph session {session}, which is not a session number (1 to {MAX_SESSION})"
                );
            }
            Ok(Started {
                session,
                hooked,
                roots,
                skipped,
            })
        }
        other => Err(response_error(other)),
    }
}

/// Stops function-graph session `session`, and no other.
pub fn stop(control: &mut dyn Control, session: u32) -> Result<()> {
    let request = Request::GraphStop {
        session: Some(session),
    };
    match control.request(request, PROBE_TIMEOUT)? {
        Response::Ok => Ok(()),
        other => Err(response_error(other))
            .with_context(|| format!("cannot stop function graph session {session}")),
    }
}

/// `hvtrace graph`. The CLI catches Ctrl-C ([`sys::catch_interrupt`]):
/// the first one ends the reading (the read in progress at once); the
/// graph is stopped and the output finished all the same, and the exit
/// code is 130.
pub fn graph(socket: &Path, args: &GraphArgs) -> Result<u8> {
    // What can be checked without a VM, first.
    let filter = filter(args)?;
    // Checked before connecting; the output is made once connected.
    trace_read::trace_dat_path(
        args.format == OutputFormatArg::TraceDat,
        args.output.as_deref(),
    )?;
    let mut client = ctl::open_with(socket, args.persist)?;
    let output = TraceOutput::create(args.output.as_deref(), args.format)?;
    // One Ctrl-C ends one wait: either the read in progress takes it or
    // the check between reads does, never the stop that follows.
    let end = trace_session(
        &mut client,
        filter,
        args.format.protocol(),
        args.follow,
        output,
        &sys::take_interrupt,
    )?;
    Ok(match end {
        CopyEnd::Stopped => ctl::INTERRUPTED_EXIT,
        _ => 0,
    })
}

/// The work of `hvtrace graph` once connected: starts a session with
/// `filter`, copies its lines in `format` to `output` (as
/// [`trace_read::copy_trace`] does, with `follow` and `interrupted`), stops the
/// session and finishes the output. Returns how the copy ended; when it
/// was interrupted, says so on stderr last.
pub fn trace_session(
    control: &mut dyn Control,
    filter: GraphFilter,
    format: TraceFormat,
    follow: bool,
    mut output: TraceOutput,
    interrupted: &dyn Fn() -> bool,
) -> Result<CopyEnd> {
    // Only lines that come after the start: the stream may hold older ones.
    let reader = TraceReader::at_end(control, format)?;
    let started = start(control, filter).map_err(|e| {
        if sys::is_interrupted(&e) {
            e.context("a session that started meanwhile ends with this command's connection (unless --persist)")
        } else {
            e
        }
    })?;
    eprintln!("hvtrace: {}", started.line());
    let views_at_start = views(control);
    // Only this session's lines: probes, the function tracer and other
    // sessions may be writing to the stream too.
    let mut reader = reader.with_source(Some(started.session));
    output.learn(control);
    let copied = trace_read::copy_trace(
        control,
        &mut reader,
        follow,
        FOLLOW_WAIT_MS,
        &mut output,
        interrupted,
    );
    let mut cost = None;
    let stopped = match &copied {
        // Nothing left to stop.
        Ok(CopyEnd::VmEnded(why)) => {
            eprintln!("hvtrace: {}", crate::term::sanitize(why));
            Ok(())
        }
        _ => {
            if let (Some(a), Some(b)) = (&views_at_start, views(control)) {
                cost = Some(cost_line(&started, a, &b));
            }
            stop(control, started.session)
        }
    };
    let finished = output.finish(Some(control));
    let end = copied?;
    stopped?;
    match finished {
        Ok(Some(summary)) => eprintln!("hvtrace: {}", summary.line()),
        Ok(None) => {}
        // The reader of our output left (`| head`): nothing more to say.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => bail!("cannot write the trace: {e}"),
    }
    if let Some(line) = cost {
        eprintln!("hvtrace: {line}");
    }
    if end == CopyEnd::Stopped {
        let what = format!("function graph session {}", started.session);
        eprintln!("hvtrace: {}", ctl::interrupted_line(&what, reader.lines));
    }
    Ok(end)
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
        match crate::commands::cli::Cli::try_parse_from(full)
            .unwrap()
            .command
        {
            crate::commands::cli::Command::Graph(args) => args,
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
            "--graph-notrace",
            "schedule",
            "--graph-notrace",
            "*irq*",
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
                graph_notrace: vec!["schedule".into(), "*irq*".into()],
                max_depth: 3,
                pid: Some(90),
                comm: Some("dd".into()),
                retval: true,
                stack_frames: 0,
                gate: false,
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
            (
                &["--graph-notrace", ""][..],
                r#"--graph-notrace needs a glob (got "")"#,
            ),
            (
                &["--graph-notrace", "a b"][..],
                r#"--graph-notrace "a b": one glob per --graph-notrace (repeat the option for more)"#,
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
        let started = |session, hooked, roots, skipped| Started {
            session,
            hooked,
            roots,
            skipped,
        };
        assert_eq!(
            started(1, 42, 1, 0).line(),
            "function graph session 1: 42 functions hooked, 1 root, 0 skipped"
        );
        assert_eq!(
            started(15, 1, 3, 2).line(),
            "function graph session 15: 1 function hooked, 3 roots, 2 skipped"
        );
    }

    struct Canned {
        answers: VecDeque<Response>,
        seen: Vec<Request>,
    }

    impl Control for Canned {
        fn request(&mut self, request: Request, _timeout: Duration) -> Result<Response> {
            if request == Request::Status {
                // No status here: the closing line leaves the views out.
                return Ok(Response::error(ErrorKind::NotReady, "no status"));
            }
            self.seen.push(request);
            Ok(self.answers.pop_front().expect("no answer left"))
        }
    }

    #[test]
    fn the_cost_line_gives_each_vcpus_views_over_the_session() {
        let started = Started {
            session: 4,
            hooked: 37_657,
            roots: 1,
            skipped: 0,
        };
        let at = |v: Vec<(u64, u64, u64)>, quiet_pages| Views {
            per_vcpu: v,
            quiet_pages,
        };
        let line = cost_line(
            &started,
            &at(vec![(10, 5_000_000, 0), (0, 0, 0)], 0),
            &at(
                vec![(14, 7_000_000, 900_000_000), (2, 1_000_000, 30_000_000)],
                2_210,
            ),
        );
        assert_eq!(
            line,
            "function graph session 4: 37657 functions hooked, 2210 pages of them unhooked outside the roots; \
             vCPU 0: armed 2 ms, quiet 900 ms, 4 view switches; vCPU 1: armed 1 ms, quiet 30 ms, 2 view switches"
        );
    }

    #[test]
    fn start_and_stop_requests() {
        let mut c = Canned {
            answers: [
                Response::GraphStarted {
                    session: 2,
                    hooked: 12,
                    roots: 1,
                    skipped: 2,
                },
                Response::error(ErrorKind::NotFound, "no function matches vfs_nope"),
                Response::Ok,
                Response::error(ErrorKind::NotFound, "no graph session 7"),
                Response::GraphStarted {
                    session: 0,
                    hooked: 1,
                    roots: 1,
                    skipped: 0,
                },
                Response::GraphStarted {
                    session: 16,
                    hooked: 1,
                    roots: 1,
                    skipped: 0,
                },
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
            Started {
                session: 2,
                hooked: 12,
                roots: 1,
                skipped: 2
            }
        );
        assert_eq!(c.seen[0], Request::GraphStart(f.clone()));
        let e = start(&mut c, f.clone()).unwrap_err().to_string();
        assert_eq!(e, "no function matches vfs_nope");
        // Only the session named is stopped.
        stop(&mut c, 2).unwrap();
        assert_eq!(c.seen[2], Request::GraphStop { session: Some(2) });
        let e = format!("{:#}", stop(&mut c, 7).unwrap_err());
        assert_eq!(
            e,
            "cannot stop function graph session 7: no graph session 7"
        );
        assert_eq!(c.seen[3], Request::GraphStop { session: Some(7) });
        // A session number that is not one is refused: its lines could not
        // be told from the probes' (0), or it does not exist (16).
        for n in [0, 16] {
            let e = start(&mut c, f.clone()).unwrap_err().to_string();
            assert_eq!(
                e,
                format!("the hypervisor started function graph session {n}, which is not a session number (1 to 15)")
            );
        }
    }

    fn trace(next: u64, text: &str) -> Response {
        Response::Trace {
            next,
            text: text.into(),
            lost: 0,
        }
    }

    #[test]
    fn a_session_reads_and_stops_only_its_own() {
        let mut c = Canned {
            answers: [
                // The end of the buffer.
                trace(40, ""),
                Response::GraphStarted {
                    session: 3,
                    hooked: 5,
                    roots: 1,
                    skipped: 0,
                },
                trace(44, " 0)               |  vfs_read() {\n"),
                trace(47, " 0)   1.000 us    |  }\n"),
                // Quiet: the trace is over.
                trace(47, ""),
                Response::Ok,
            ]
            .into(),
            seen: Vec::new(),
        };
        let buf = crate::commands::trace_read::SharedBuf::default();
        let output = TraceOutput::copy(Box::new(buf.clone()));
        let f = GraphFilter {
            functions: vec!["vfs_read".into()],
            ..GraphFilter::default()
        };
        trace_session(&mut c, f.clone(), TraceFormat::Text, false, output, &|| {
            false
        })
        .unwrap();
        assert_eq!(
            buf.text(),
            " 0)               |  vfs_read() {\n 0)   1.000 us    |  }\n"
        );
        let read = |cursor, wait_ms, source| Request::TraceRead {
            cursor,
            format: TraceFormat::Text,
            wait_ms,
            source,
        };
        assert_eq!(
            c.seen,
            [
                read(u64::MAX, 0, None),
                Request::GraphStart(f),
                read(40, trace_read::FIRST_WAIT_MS, Some(3)),
                read(44, trace_read::DRAIN_WAIT_MS, Some(3)),
                read(47, trace_read::DRAIN_WAIT_MS, Some(3)),
                Request::GraphStop { session: Some(3) },
            ]
        );
    }

    #[test]
    fn a_chrome_trace_is_made_of_the_sessions_json_lines() {
        let entry = r#"{"ts":"1.000000","ts_ns":1000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","depth":0}"#;
        let ret = r#"{"ts":"1.000002","ts_ns":1000002000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":2000}"#;
        let mut c = Canned {
            answers: [
                trace(0, ""),
                Response::GraphStarted {
                    session: 1,
                    hooked: 1,
                    roots: 1,
                    skipped: 0,
                },
                trace(2, &format!("{entry}\n{ret}\n")),
                trace(2, ""),
                Response::Ok,
            ]
            .into(),
            seen: Vec::new(),
        };
        let buf = crate::commands::trace_read::SharedBuf::default();
        let output = TraceOutput::chrome(Box::new(buf.clone()));
        trace_session(
            &mut c,
            GraphFilter::default(),
            TraceFormat::Json,
            false,
            output,
            &|| false,
        )
        .unwrap();
        for request in &c.seen[2..4] {
            assert!(
                matches!(
                    request,
                    Request::TraceRead {
                        format: TraceFormat::Json,
                        source: Some(1),
                        ..
                    }
                ),
                "{request:?}"
            );
        }
        assert_eq!(c.seen[4], Request::GraphStop { session: Some(1) });
        let chrome = buf.text();
        assert!(chrome.contains(r#""name":"vfs_read""#), "{chrome}");
    }

    #[test]
    fn an_interrupted_session_is_stopped_all_the_same() {
        let mut c = Canned {
            answers: [
                trace(8, ""),
                Response::GraphStarted {
                    session: 4,
                    hooked: 1,
                    roots: 1,
                    skipped: 0,
                },
                Response::Ok,
            ]
            .into(),
            seen: Vec::new(),
        };
        let buf = crate::commands::trace_read::SharedBuf::default();
        let output = TraceOutput::copy(Box::new(buf.clone()));
        trace_session(
            &mut c,
            GraphFilter::default(),
            TraceFormat::Text,
            true,
            output,
            &|| true,
        )
        .unwrap();
        assert_eq!(c.seen.len(), 3);
        assert_eq!(c.seen[2], Request::GraphStop { session: Some(4) });
    }
}
