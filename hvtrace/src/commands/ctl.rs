//! The control commands: `status`, `exec`, `stop`, `syms`, `probe add|del|list`
//! and `trace`, each a client of a running VM's control socket
//! ([`crate::client`]). Each opens its session with `Hello`, which checks
//! that both ends speak this protocol version, then makes one or more calls
//! and renders the answers ([`crate::output::report`]). (`graph` is in
//! [`crate::commands::graph`]; reading the trace in
//! [`crate::commands::trace_read`].)
//!
//! The steps that `hvtrace run` shares when it traces (adding probes and
//! functions, reading the trace) take any [`Control`], so that they work
//! the same over the socket and in-process.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use protocol::{Request, Response};
use tracelang::kprobe;

use crate::client::Client;
use crate::commands::cli::{
    DetailedError, ExecArgs, ProbeAddArgs, ProbeDelArgs, ProbeListArgs, StatusArgs, StopArgs,
    SymsArgs, TraceArgs,
};
use crate::commands::trace_read::{copy_trace, CopyEnd, TraceOutput, TraceReader, FOLLOW_WAIT_MS};
use crate::control::{response_error, Control};
use crate::output::report::{
    added_line, function_summary, probe_line, render_stop, status_json, status_text, symbol_line,
    Status,
};
use crate::sys;
use crate::term::{self, Mode};

// The request deadlines live in `timeouts`, which the trace reader uses
// too; they stay reachable here under their old paths.
pub use crate::commands::timeouts::{EXEC_TIMEOUT, PROBE_TIMEOUT, STATUS_TIMEOUT, STOP_TIMEOUT};

/// Connects and opens the session. The first Ctrl-C (once
/// [`sys::catch_interrupt`] ran) ends the wait for an answer in progress
/// with [`sys::Interrupted`].
pub fn open(socket: &Path) -> Result<Client> {
    open_with(socket, false)
}

/// [`open`]; with `persist`, the supervisor leaves the function-graph
/// sessions of this connection running when it closes
/// ([`Client::persist_graph_sessions`]).
pub fn open_with(socket: &Path, persist: bool) -> Result<Client> {
    let mut client = Client::connect(socket)?;
    client.wake_when(sys::take_interrupt);
    if persist {
        client.persist_graph_sessions();
    }
    client.hello()?;
    Ok(client)
}

/// Asks for a status report.
pub fn fetch_status(client: &mut Client) -> Result<Status> {
    let reply = client.call(Request::Status, STATUS_TIMEOUT)?;
    match reply.response {
        Response::Status(report) => Ok(Status {
            report,
            round_trip: reply.round_trip,
        }),
        other => Err(response_error(other)),
    }
}

/// `hvtrace status`.
pub fn status(socket: &Path, args: &StatusArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let status = fetch_status(&mut client)?;
    // The report quotes the guest (task name, kernel release).
    let text = if args.json {
        term::sanitize_json(&(status_json(&status).to_string() + "\n")).into_owned()
    } else {
        term::sanitize(&status_text(&status)).into_owned()
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(0)
}

/// Symbols per `Syms` page asked for (the hypervisor sends fewer when a
/// page would not fit one frame).
const SYMS_PAGE: u32 = 1000;

/// `hvtrace syms GLOB`: one line per matching symbol, in address order:
/// address, size, type letter, name, and the fentry site or why the symbol
/// cannot be traced. Exits 1 when nothing matches.
pub fn syms(socket: &Path, args: &SymsArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let mut out = std::io::stdout().lock();
    let mut cursor = 0;
    let mut printed = 0u64;
    loop {
        let request = Request::Syms {
            glob: args.glob.clone(),
            kinds: args.kinds.clone(),
            module: args.module.clone(),
            cursor,
            limit: SYMS_PAGE,
        };
        let reply = client.call(request, STATUS_TIMEOUT)?;
        let Response::Syms { next, symbols, .. } = reply.response else {
            return Err(response_error(reply.response));
        };
        for s in &symbols {
            let line = symbol_line(s, args.json);
            let mode = if args.json { Mode::Json } else { Mode::Text };
            writeln!(out, "{}", term::sanitize_as(mode, &line))?;
            printed += 1;
        }
        match next {
            Some(n) => cursor = n,
            None => break,
        }
    }
    out.flush()?;
    Ok(if printed == 0 { 1 } else { 0 })
}

/// Checks a probe definition locally, before anything is sent: a malformed
/// one fails with the parser's message (`probe spec: bad register name
/// "%dj" at column 29`) and, as detail, the spec with a caret under the bad
/// token; a removal (`-:EVENT`) is refused with a pointer to `probe del`.
pub fn check_probe_spec(spec: &str) -> Result<()> {
    match kprobe::parse(spec) {
        Ok(kprobe::Command::Add(_)) => Ok(()),
        Ok(kprobe::Command::Delete(d)) => {
            let name = match (&d.group, &d.event) {
                (Some(g), Some(e)) => format!("{g}/{e}"),
                (None, Some(e)) => e.clone(),
                _ => "NAME".to_string(),
            };
            bail!(
                "probe spec {:?} removes probes; use `hvtrace probe del {name}` to remove one",
                spec.trim()
            )
        }
        Err(e) => {
            let report = e.report(spec);
            let (first, caret) = report.split_once('\n').unwrap_or((&report, ""));
            let detail = caret
                .lines()
                .map(|l| format!("  {l}\n"))
                .collect::<String>();
            Err(DetailedError {
                message: format!("probe spec: {first}"),
                detail,
            }
            .into())
        }
    }
}

/// Adds one probe: checks it ([`check_probe_spec`]), then asks the
/// hypervisor. Returns its name (`GROUP/EVENT`) and fentry site.
pub fn add_probe(control: &mut dyn Control, spec: &str) -> Result<(String, u64)> {
    check_probe_spec(spec)?;
    let request = Request::ProbeAdd {
        spec: spec.to_string(),
    };
    match control.request(request, PROBE_TIMEOUT)? {
        Response::ProbeAdded { name, site } => Ok((name, site)),
        other => Err(response_error(other)),
    }
}

/// `hvtrace probe add SPEC`.
pub fn probe_add(socket: &Path, args: &ProbeAddArgs) -> Result<u8> {
    let spec = args.spec.join(" ");
    // Before connecting: a typo needs no VM to be reported.
    check_probe_spec(&spec)?;
    let mut client = open(socket)?;
    let (name, site) = add_probe(&mut client, &spec).map_err(|e| {
        if sys::is_interrupted(&e) {
            e.context("the probe may have been added (`hvtrace probe list` shows it)")
        } else {
            e
        }
    })?;
    println!("{}", term::sanitize(&added_line(&name, site)));
    Ok(0)
}

/// `hvtrace probe del NAME`.
pub fn probe_del(socket: &Path, args: &ProbeDelArgs) -> Result<u8> {
    let name = args.name.trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        bail!(
            "probe del takes one probe name, EVENT or GROUP/EVENT (got {:?})",
            args.name
        );
    }
    let mut client = open(socket)?;
    let request = Request::ProbeDel {
        name: name.to_string(),
    };
    match client.request(request, PROBE_TIMEOUT)? {
        Response::Ok => {
            println!("removed {name}");
            Ok(0)
        }
        other => Err(response_error(other)),
    }
}

/// `hvtrace probe list`: one line per probe, as the kernel's
/// kprobe_profile has them (name, hits, misses), then the definition.
pub fn probe_list(socket: &Path, args: &ProbeListArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let probes = match client.request(Request::ProbeList, PROBE_TIMEOUT)? {
        Response::Probes(probes) => probes,
        other => return Err(response_error(other)),
    };
    let mut out = std::io::stdout().lock();
    let mode = if args.json { Mode::Json } else { Mode::Text };
    for p in &probes {
        writeln!(
            out,
            "{}",
            term::sanitize_as(mode, &probe_line(p, args.json))
        )?;
    }
    out.flush()?;
    Ok(0)
}

/// Puts the function tracer on every function matching `glob`; returns the
/// one-line summary (`vfs_*: 42 functions traced, 2 skipped (...)`).
pub fn add_functions(control: &mut dyn Control, glob: &str) -> Result<String> {
    let request = Request::FunctionAdd {
        glob: glob.to_string(),
    };
    match control.request(request, PROBE_TIMEOUT)? {
        Response::FunctionAdded {
            traced,
            skipped,
            skipped_total,
        } => Ok(function_summary(glob, traced, &skipped, skipped_total)),
        other => Err(response_error(other)),
    }
}

/// Turns the scheduler's switch and wakeup events on or off; returns the
/// one-line summary.
pub fn sched_events(control: &mut dyn Control, on: bool) -> Result<String> {
    let request = Request::Sched {
        switch: on,
        wakeup: on,
    };
    match control.request(request, PROBE_TIMEOUT)? {
        // The hooks go in after the answer: say so if the switch path's
        // could not (the hypervisor's log says why).
        Response::Ok if on => match control.request(Request::Status, STATUS_TIMEOUT)? {
            Response::Status(s) if !s.tracer.switch_hook => {
                bail!("the scheduler's switch path could not be hooked (the hypervisor's log says why)")
            }
            _ => Ok("scheduler switches and wakeups recorded".to_string()),
        },
        Response::Ok => Ok("scheduler switches and wakeups no longer recorded".to_string()),
        other => Err(response_error(other)),
    }
}

/// Takes the function tracer off every function it is on; returns the
/// one-line summary.
pub fn clear_functions(control: &mut dyn Control) -> Result<String> {
    match control.request(Request::FunctionClear, PROBE_TIMEOUT)? {
        Response::Ok => Ok("function tracer off".to_string()),
        other => Err(response_error(other)),
    }
}

/// `hvtrace trace`: clears the function tracer (--clear-functions), adds
/// the --function globs, then copies the trace to
/// stdout: until a read stays empty, or with --follow until interrupted or
/// the VM ends. A Ctrl-C ends the copy at once (exit code 130); what was
/// read is out already.
pub fn trace(socket: &Path, args: &TraceArgs) -> Result<u8> {
    let dat = crate::commands::trace_read::trace_dat_path(
        args.format == crate::commands::cli::TraceFormatArg::TraceDat,
        args.output.as_deref(),
    )?;
    let mut client = open(socket)?;
    if args.clear_functions {
        eprintln!("hvtrace: {}", clear_functions(&mut client)?);
    }
    for glob in &args.functions {
        let summary = add_functions(&mut client, glob)?;
        eprintln!("hvtrace: {summary}");
    }
    if args.sched || args.no_sched {
        eprintln!("hvtrace: {}", sched_events(&mut client, args.sched)?);
    }
    // Probe, return-probe and function-tracer lines only: graph sessions
    // are read by `hvtrace graph`.
    let mut reader = TraceReader::new(args.format.protocol()).with_source(Some(0));
    let mut out = match dat {
        Some(path) => {
            let mut out = TraceOutput::trace_dat(path)?;
            out.learn(&mut client);
            out
        }
        None => TraceOutput::copy(crate::commands::trace_read::sink(
            args.output.as_deref(),
            args.format.protocol(),
        )?),
    };
    let copied = copy_trace(
        &mut client,
        &mut reader,
        args.follow,
        FOLLOW_WAIT_MS,
        &mut out,
        &sys::interrupted,
    );
    let vm_alive = !matches!(copied, Ok(CopyEnd::VmEnded(_)));
    let finished = out.finish(vm_alive.then_some(&mut client as &mut dyn Control));
    let end = copied?;
    if let Some(summary) = anyhow::Context::context(finished, "cannot write the trace")? {
        eprintln!("hvtrace: {}", summary.line());
    }
    match end {
        CopyEnd::VmEnded(why) => eprintln!("hvtrace: {}", term::sanitize(&why)),
        CopyEnd::Stopped => {
            eprintln!("hvtrace: {}", interrupted_line("trace", reader.lines));
            return Ok(INTERRUPTED_EXIT);
        }
        CopyEnd::Quiet | CopyEnd::ReaderLeft => {}
    }
    Ok(0)
}

/// The exit code of a command that a Ctrl-C ended (128 + SIGINT, as a
/// shell reports a process that SIGINT killed).
pub const INTERRUPTED_EXIT: u8 = 130;

/// The closing line of a trace that a Ctrl-C ended:
/// `trace stopped by Ctrl-C after 12 lines`.
pub fn interrupted_line(what: &str, lines: u64) -> String {
    let s = if lines == 1 { "" } else { "s" };
    format!("{what} stopped by Ctrl-C after {lines} line{s}")
}

/// `hvtrace exec`: prints the command's output; the exit code is its status.
pub fn exec(socket: &Path, args: &ExecArgs) -> Result<u8> {
    let command = args.command.join(" ");
    if command.trim().is_empty() {
        bail!("exec needs a command");
    }
    let mut client = open(socket)?;
    let reply = client
        .call(Request::Exec { command }, EXEC_TIMEOUT)
        .map_err(|e| {
            if sys::is_interrupted(&e) {
                e.context(format!(
                    "the command goes on in the guest until it ends (the supervisor gives it at most {} s)",
                    crate::daemon::supervisor::EXEC_TIMEOUT.as_secs()
                ))
            } else {
                e
            }
        })?;
    match reply.response {
        Response::Exec { output, status } => {
            // On a terminal, the guest's output cannot drive it.
            let output = term::for_stream(&output, term::stdout_is_terminal());
            let mut out = std::io::stdout().lock();
            out.write_all(output.as_bytes())?;
            out.flush()?;
            Ok(exit_code(status))
        }
        other => Err(response_error(other)),
    }
}

/// Runs `command` in the guest; returns its output and status.
pub fn run_in_guest(client: &mut Client, command: &str) -> Result<(String, i32)> {
    let reply = client.call(
        Request::Exec {
            command: command.to_string(),
        },
        EXEC_TIMEOUT,
    )?;
    match reply.response {
        Response::Exec { output, status } => Ok((output, status)),
        other => Err(response_error(other)),
    }
}

/// A guest command's status as a process exit code.
pub fn exit_code(status: i32) -> u8 {
    u8::try_from(status).unwrap_or(255)
}

/// `hvtrace stop`: stops the guest, waits for the VM to end, prints the
/// final exit counts and the stop reason.
pub fn stop(socket: &Path, _args: &StopArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let reply = client.call(Request::Stop, STOP_TIMEOUT).map_err(|e| {
        if sys::is_interrupted(&e) {
            e.context("the stop was sent; the VM goes on stopping without this command")
        } else {
            e
        }
    })?;
    match reply.response {
        Response::Ok => {}
        other => return Err(response_error(other)),
    }
    let text = render_stop(&reply.events);
    let text = term::sanitize(&text);
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    // The supervisor removes the socket right after it answers; wait for
    // that, so that the next command finds no VM.
    let until = Instant::now() + Duration::from_secs(10);
    while socket.exists() && Instant::now() < until && !sys::interrupted() {
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::testing::Canned;
    use protocol::ErrorKind;

    #[test]
    fn bad_probe_specs_point_at_the_token() {
        let spec = "p:myopen do_sys_openat2 dfd=%dj";
        let e = check_probe_spec(spec).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"probe spec: bad register name "%dj" at column 29"#
        );
        let d = e.downcast_ref::<DetailedError>().unwrap();
        assert_eq!(
            d.detail,
            "  p:myopen do_sys_openat2 dfd=%dj\n                              ^~~\n"
        );
        assert!(check_probe_spec("p:myopen do_sys_openat2 dfd=%di").is_ok());
        assert!(check_probe_spec("r vfs_read $retval").is_ok());
        let e = check_probe_spec("").unwrap_err().to_string();
        assert!(e.starts_with("probe spec: empty probe definition"), "{e}");
    }

    #[test]
    fn return_probes_are_not_refused_locally() {
        let specs = [
            "r vfs_read",
            "r:myret vfs_read $retval",
            "r:grp/ev vfs_read ret=$retval:s32",
            "r10 vfs_read",
            "p:myret2 vfs_read%return $retval",
            "p vfs_read+0%return",
        ];
        for spec in specs {
            check_probe_spec(spec).unwrap_or_else(|e| panic!("{spec:?}: {e:#}"));
        }
        // They go to the hypervisor as they are.
        let mut c = Canned {
            answers: specs
                .iter()
                .map(|_| {
                    Ok(Response::ProbeAdded {
                        name: "kprobes/r".into(),
                        site: 1,
                    })
                })
                .collect(),
            seen: Vec::new(),
        };
        for spec in specs {
            add_probe(&mut c, spec).unwrap();
        }
        let sent: Vec<Request> = specs
            .iter()
            .map(|s| Request::ProbeAdd {
                spec: s.to_string(),
            })
            .collect();
        assert_eq!(c.seen, sent);
        // The parser's own rules still hold: no $retval at an entry
        // ($argN at a return reads the entry's saved value, as in Linux
        // 6.9+, and BTF names are checked by root against the guest's BTF).
        check_probe_spec("r vfs_read $arg1 count file->f_pos").unwrap();
        let e = check_probe_spec("p vfs_read $retval")
            .unwrap_err()
            .to_string();
        assert!(e.contains("only available on return probes"), "{e}");
        let e = check_probe_spec("p vfs_read file-f_pos")
            .unwrap_err()
            .to_string();
        assert!(e.contains("'-' must be part of '->'"), "{e}");
    }

    #[test]
    fn removals_are_refused_with_a_hint() {
        let e = check_probe_spec("-:myopen").unwrap_err().to_string();
        assert!(e.contains("hvtrace probe del myopen"), "{e}");
        let e = check_probe_spec("-:grp/ev").unwrap_err().to_string();
        assert!(e.contains("hvtrace probe del grp/ev"), "{e}");
        assert!(!e.contains('\n'));
    }

    #[test]
    fn probe_and_function_requests() {
        let mut c = Canned {
            answers: [
                Ok(Response::ProbeAdded {
                    name: "kprobes/p_vfs_read_0".into(),
                    site: 0x1234,
                }),
                Ok(Response::error(ErrorKind::NotFound, "no function vfs_nope")),
                Ok(Response::FunctionAdded {
                    traced: 3,
                    skipped: vec![],
                    skipped_total: 0,
                }),
            ]
            .into(),
            seen: Vec::new(),
        };
        assert_eq!(
            add_probe(&mut c, "p vfs_read").unwrap(),
            ("kprobes/p_vfs_read_0".to_string(), 0x1234)
        );
        let e = add_probe(&mut c, "p vfs_nope").unwrap_err().to_string();
        assert_eq!(e, "no function vfs_nope");
        // A bad spec is refused before anything is sent.
        assert!(add_probe(&mut c, "p vfs_read %zz").is_err());
        assert_eq!(c.seen.len(), 2);
        assert_eq!(
            add_functions(&mut c, "vfs_*").unwrap(),
            "function tracer on vfs_*: 3 traced"
        );
        let mut c = Canned {
            answers: [
                Ok(Response::Ok),
                Ok(Response::error(ErrorKind::NotReady, "the VM is starting")),
            ]
            .into(),
            seen: Vec::new(),
        };
        assert_eq!(clear_functions(&mut c).unwrap(), "function tracer off");
        let e = clear_functions(&mut c).unwrap_err().to_string();
        assert!(e.contains("the VM is starting"), "{e}");
        assert_eq!(c.seen, [Request::FunctionClear, Request::FunctionClear]);
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(0), 0);
        assert_eq!(exit_code(3), 3);
        assert_eq!(exit_code(255), 255);
        assert_eq!(exit_code(-1), 255);
        assert_eq!(exit_code(256), 255);
    }
}
