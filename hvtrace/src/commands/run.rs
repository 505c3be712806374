//! `hvtrace run`: boot, run the --exec commands (or hand the console to the
//! user), power off, report.
//!
//! With `--probe`, `--function` or `--graph` the run traces its commands:
//! it runs the VM under an in-process supervisor ([`LocalVm`], the code a
//! detached VM runs under) and is its client. Once the guest shell is up it
//! adds the probes, the function tracer and the function graph through the
//! control channel, starts the trace stream and runs the commands (their
//! output goes to stderr), while a second thread copies the trace to stdout
//! or `--output` (or collects it, for a Chrome trace written at the end).
//! The trace is one stream: the probe and function-tracer lines, the
//! scheduler's switches and the graph session's, as they came, in every
//! format ([`trace_source`]). The run ends when no trace line came for
//! [`TRACE_QUIET`] after the last command (at most [`TRACE_DRAIN_LIMIT`]
//! after it); then the graph session is stopped and the hypervisor stops
//! the guest.
//!
//! The first Ctrl-C ends the command in progress (and the ones after it
//! are not run), then the run ends as it would after its last command: a
//! traced run stops its graph session, finishes its output and has the
//! hypervisor stop the guest; an untraced one interrupts the guest's
//! command and powers the guest off. The exit code is then 130. A Ctrl-C
//! during the boot kills the emulator. A second Ctrl-C ends hvtrace at
//! once (and the emulator with it).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use protocol::GraphFilter;

use crate::commands::cli::{OutputFormatArg, RunArgs, SyscallsArgs};
use crate::commands::trace_read::{self, TraceEnd, TraceOutput, TraceReader};
use crate::commands::{count, ctl, syscalls};
use crate::control::Control;
use crate::daemon::local::LocalVm;
use crate::daemon::supervisor::Ending;
use crate::output::report;
use crate::vm::config::{Emulator, RunConfig};
use crate::vm::{StopReport, Vm};
use crate::{commands::graph, sys, term};

/// How long the guest shell gets to take in a Ctrl-C before the line that
/// powers it off follows.
const INTERRUPT_PAUSE: Duration = Duration::from_millis(300);

/// A traced run ends once no trace line came for this long after its last
/// command.
pub const TRACE_QUIET: Duration = Duration::from_secs(2);
/// A traced run collects trace lines for at most this long after its last
/// command.
pub const TRACE_DRAIN_LIMIT: Duration = Duration::from_secs(60);
/// Each read of the trace waits at most this long for a line.
const TRACE_POLL_MS: u32 = 250;

/// Says so when QEMU cannot run the hypervisor.
fn note_tcg(cfg: &RunConfig) {
    if cfg.emulator == (Emulator::Qemu { kvm: false }) && cfg.under_hypervisor() {
        eprintln!(
            "hvtrace: note: QEMU runs TCG (--no-kvm), which cannot emulate VMX: the hypervisor will refuse to start"
        );
    }
}

/// Runs `hvtrace run`; returns the process exit code.
pub fn run(args: &RunArgs) -> Result<u8> {
    if !args.counts.is_empty() {
        return run_counted(args);
    }
    if let Some(spec) = &args.hist {
        return run_hist(args, spec);
    }
    if let Some(names) = &args.syscalls {
        return run_syscalls(args, names);
    }
    if args.traces() {
        return run_traced(args);
    }
    let cfg = args.resolve()?;
    note_tcg(&cfg);
    let mut vm = Vm::start(cfg)?;
    vm.wait_ready()?;
    if args.exec.is_empty() {
        eprintln!("hvtrace: connected to the guest console; end input (Ctrl-D) or type `exit` to power off");
        let report = vm.interact()?;
        // A Ctrl-C there powers the guest off (see [`Vm::wait_stop`]).
        let code = if sys::interrupted() {
            ctl::INTERRUPTED_EXIT
        } else {
            0
        };
        return finish(&report, code);
    }

    let mut failed = 0usize;
    for cmd in &args.exec {
        // A Ctrl-C between two commands: the next one is not sent.
        if sys::take_interrupt() {
            eprintln!("hvtrace: Ctrl-C: the commands left are not run; powering the guest off");
            let report = vm.poweroff()?;
            return finish(&report, ctl::INTERRUPTED_EXIT);
        }
        eprintln!("hvtrace: $ {cmd}");
        let result = match vm.exec(cmd) {
            Ok(result) => result,
            Err(e) if sys::is_interrupted(&e) => {
                eprintln!("hvtrace: Ctrl-C: interrupting `{cmd}` and powering the guest off");
                // The shell drops the rest of the command's line, then
                // reads the `exit` that powers the guest off.
                vm.interrupt_command()?;
                std::thread::sleep(INTERRUPT_PAUSE);
                let report = vm.poweroff()?;
                return finish(&report, ctl::INTERRUPTED_EXIT);
            }
            Err(e) => return Err(e),
        };
        // On a terminal, the guest's output cannot drive it.
        let output = term::for_stream(&result.output, term::stdout_is_terminal());
        let mut out = std::io::stdout().lock();
        out.write_all(output.as_bytes())?;
        out.flush()?;
        if result.rc != 0 {
            eprintln!("hvtrace: `{cmd}` exited with status {}", result.rc);
            failed += 1;
        }
    }
    let report = vm.poweroff()?;
    if failed > 0 && args.fail_on_exec_error {
        finish(&report, 1)?;
        bail!("{failed} of {} commands failed", args.exec.len());
    }
    finish(&report, 0)
}

/// What the commands and the trace of a traced run came to.
struct Traced {
    /// Commands that exited non-zero.
    failed: usize,
    /// Trace lines written.
    lines: u64,
    /// Lines or events lost.
    lost: u64,
    /// The graph session, with `--graph`.
    session: Option<u32>,
    /// A Ctrl-C ended the commands.
    interrupted: bool,
}

/// The source of the trace lines a traced run writes
/// ([`protocol::Event::TraceText`]), given its graph session: without a
/// graph, the probes' and the function tracer's (0); with one, every
/// source (the run's own VM has no source but 0 and its session). Every
/// format keeps every line.
pub fn trace_source(session: Option<u32>) -> Option<u32> {
    match session {
        None => Some(0),
        Some(_) => None,
    }
}

/// The function-graph filter of a traced run, checked; `None` without
/// `--graph`.
pub fn graph_filter(args: &RunArgs) -> Result<Option<GraphFilter>> {
    if args.graphs.is_empty() {
        return Ok(None);
    }
    graph::checked_filter(&args.graphs, &args.graph_filter, None, graph::RUN_SPELLING).map(Some)
}

/// `hvtrace run --probe/--function/--graph ... --exec ...`.
fn run_traced(args: &RunArgs) -> Result<u8> {
    // What can be checked without a VM, first.
    for spec in &args.probes {
        ctl::check_probe_spec(spec).with_context(|| format!("--probe {spec:?}"))?;
    }
    if let Some(glob) = args.functions.iter().find(|g| g.trim().is_empty()) {
        bail!("--function needs a glob (got {glob:?})");
    }
    let graph = graph_filter(args)?;
    let output_format = args.format.unwrap_or_default();
    let mut out = TraceOutput::create(args.output.as_deref(), output_format)?;
    let cfg = args.resolve()?;
    note_tcg(&cfg);
    let vm = LocalVm::start(cfg)?;
    // On failure the VM is dropped, which kills it; what was traced is
    // written all the same.
    let traced = match trace_commands(&vm, args, graph, output_format, &mut out) {
        Ok(traced) => traced,
        Err(e) => {
            let _ = out.finish(None);
            return Err(e);
        }
    };
    if let Some(session) = traced.session {
        // The guest is stopped next, so a graph left running does no harm;
        // say so and go on.
        if let Err(e) = graph::stop(&mut vm.control(), session) {
            eprintln!("hvtrace: note: {}", term::sanitize(&format!("{e:#}")));
        }
    }
    let chrome = out
        .finish(Some(&mut vm.control()))
        .context("cannot write the trace")?;
    let report = vm.stop()?;
    let to = match &args.output {
        Some(path) => format!(" to {}", path.display()),
        None => String::new(),
    };
    let lost = match traced.lost {
        0 => String::new(),
        n => format!(", {n} events lost"),
    };
    match chrome {
        Some(summary) => eprintln!("hvtrace: {}{to}{lost}", summary.line()),
        None => {
            let plural = if traced.lines == 1 { "" } else { "s" };
            eprintln!("hvtrace: trace: {} line{plural}{to}{lost}", traced.lines);
        }
    }
    end_of_commands(
        &report,
        args,
        traced.failed,
        traced.interrupted || sys::interrupted(),
    )
}

/// The exit of a run that ran its `--exec` commands: 130 after a Ctrl-C,
/// an error when `failed` commands failed and that counts, else 0.
fn end_of_commands(
    report: &StopReport,
    args: &RunArgs,
    failed: usize,
    interrupted: bool,
) -> Result<u8> {
    if interrupted {
        return finish(report, ctl::INTERRUPTED_EXIT);
    }
    if failed > 0 && args.fail_on_exec_error {
        finish(report, 1)?;
        bail!("{} of {} commands failed", failed, args.exec.len());
    }
    finish(report, 0)
}

/// `hvtrace run --count GLOB ... --exec ...`: counts the calls while the
/// commands run, prints the counts (stdout, or JSON with `--format json`),
/// stops the VM.
fn run_counted(args: &RunArgs) -> Result<u8> {
    let filter = count::filter(
        &args.counts,
        None,
        args.count_comm.as_deref(),
        args.count_latency,
    )?;
    run_aggregated(args, filter, "", &mut |control, json| {
        let counts = count::read(control)?;
        if json && args.format == Some(OutputFormatArg::Chrome) {
            return Ok(());
        }
        if json {
            println!("{}", count::json_line(&counts));
        } else {
            print!("{}", count::text(&counts, None));
            if args.count_latency {
                print!("{}", count::histogram(&counts));
            }
        }
        Ok(())
    })
}

/// `hvtrace run --hist SPEC --exec ...`: keeps the histogram while the
/// commands run, prints it (stdout, or JSON with `--format json`), stops
/// the VM.
fn run_hist(args: &RunArgs, spec: &str) -> Result<u8> {
    let key = args
        .hist_key
        .unwrap_or(crate::commands::cli::HistKeyArg::Func);
    let filter = count::hist_filter(spec, key, None, args.count_comm.as_deref())
        .with_context(|| format!("--hist {spec:?}"))?;
    run_aggregated(args, filter, "histogram: ", &mut |control, json| {
        let h = count::read_hist(control)?;
        if json && args.format == Some(OutputFormatArg::Chrome) {
            return Ok(());
        }
        if json {
            println!("{}", count::hist_json(&h));
        } else {
            print!("{}", count::hist_text(&h));
        }
        Ok(())
    })
}

/// A one-shot aggregation: boots, starts it with `filter` (its summary
/// line on stderr after `label`), runs the commands, prints the result
/// with `show` (JSON with `--format json`), stops the VM.
fn run_aggregated(
    args: &RunArgs,
    filter: protocol::CountFilter,
    label: &str,
    show: &mut dyn FnMut(&mut dyn crate::control::Control, bool) -> Result<()>,
) -> Result<u8> {
    let chrome = match args.format {
        Some(OutputFormatArg::Chrome) => Some(trace_read::sink(
            args.output.as_deref(),
            protocol::TraceFormat::Json,
        )?),
        Some(OutputFormatArg::TraceDat) => {
            bail!("--count and --hist print text, json or chrome, not a trace.dat")
        }
        _ => None,
    };
    let json = matches!(
        args.format,
        Some(OutputFormatArg::Json | OutputFormatArg::Chrome)
    );
    let cfg = args.resolve()?;
    note_tcg(&cfg);
    let vm = LocalVm::start(cfg)?;
    let mut control = vm.control();
    let is_hist = filter.hist.is_some();
    let line = count::start(&mut control, filter)?;
    eprintln!("hvtrace: {label}{}", term::sanitize(&line));
    let abort = AtomicBool::new(false);
    let (failed, interrupted) = match chrome {
        None => run_commands(&vm, &args.exec, &abort)?,
        Some(mut out) => {
            // Sampled while the commands run, and once after them.
            let mut timeline = crate::output::chrome::Chrome::new();
            let done = AtomicBool::new(false);
            let start = Instant::now();
            let ran = std::thread::scope(|scope| {
                let sampler = scope.spawn(|| {
                    let mut control = vm.control();
                    let mut samples = Vec::new();
                    loop {
                        let last = done.load(Ordering::Relaxed);
                        let at = start.elapsed().as_nanos() as u64;
                        match sample(&mut control, is_hist) {
                            Ok(rows) => samples.push((at, rows)),
                            Err(e) => {
                                eprintln!("hvtrace: note: a count sample failed: {e:#}");
                                break;
                            }
                        }
                        if last {
                            break;
                        }
                        let until = Instant::now() + COUNT_SAMPLE;
                        while Instant::now() < until && !done.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                    samples
                });
                let ran = run_commands(&vm, &args.exec, &abort);
                done.store(true, Ordering::Relaxed);
                let samples = sampler.join().unwrap_or_default();
                (ran, samples)
            });
            let (ran, samples) = ran;
            for (at, rows) in samples {
                for (name, value) in rows {
                    timeline.counter(at, &name, crate::output::json::int(value));
                }
            }
            let summary = timeline
                .write(&mut out)
                .context("cannot write the Chrome trace")?;
            eprintln!("hvtrace: {}", summary.line());
            ran?
        }
    };
    show(&mut control, json)?;
    let report = vm.stop()?;
    end_of_commands(&report, args, failed, interrupted)
}

/// How often `run --count/--hist --format chrome` samples the counts.
pub const COUNT_SAMPLE: Duration = Duration::from_millis(500);

/// One sample of the count (calls per function) or of the histogram
/// (calls per key, all buckets), nonzero rows only.
fn sample(control: &mut dyn crate::control::Control, hist: bool) -> Result<Vec<(String, u64)>> {
    Ok(if hist {
        count::read_hist(control)?
            .rows
            .into_iter()
            .map(|r| (r.key, r.buckets.iter().sum::<u64>()))
            .filter(|(_, n)| *n > 0)
            .collect()
    } else {
        count::read(control)?
            .entries
            .into_iter()
            .filter(|e| e.calls > 0)
            .map(|e| (e.name, e.calls))
            .collect()
    })
}

/// Adds the probes and functions, starts the graph and the trace, runs the
/// commands and collects the trace until it is quiet.
fn trace_commands(
    vm: &LocalVm,
    args: &RunArgs,
    graph: Option<GraphFilter>,
    output_format: OutputFormatArg,
    out: &mut TraceOutput,
) -> Result<Traced> {
    let format = output_format.protocol();
    let mut control = vm.control();
    for spec in &args.probes {
        let (name, site) =
            ctl::add_probe(&mut control, spec).with_context(|| format!("--probe {spec:?}"))?;
        eprintln!(
            "hvtrace: {}",
            term::sanitize(&report::added_line(&name, site))
        );
    }
    for glob in &args.functions {
        let summary = ctl::add_functions(&mut control, glob)
            .with_context(|| format!("--function {glob:?}"))?;
        eprintln!("hvtrace: {summary}");
    }
    if args.sched {
        eprintln!("hvtrace: {}", ctl::sched_events(&mut control, true)?);
    }
    let mut session = None;
    if let Some(filter) = graph {
        let started = graph::start(&mut control, filter).context("--graph")?;
        eprintln!("hvtrace: {}", started.line());
        session = Some(started.session);
    }
    trace_read::start_trace(&mut control, format).context("cannot start the trace")?;
    out.learn(&mut control);
    let reader = TraceReader::new(format).with_source(trace_source(session));
    trace_while_running(vm, &args.exec, control, reader, out, session, args.sched)
}

/// Copies the trace from `reader` to `out` while the commands run, and
/// until it is quiet after them.
fn trace_while_running(
    vm: &LocalVm,
    commands: &[String],
    control: crate::daemon::local::LocalControl,
    reader: TraceReader,
    out: &mut TraceOutput,
    session: Option<u32>,
    sched: bool,
) -> Result<Traced> {
    let done = OnceLock::new();
    let abort = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let collector = scope.spawn(|| {
            let mut control = control;
            let result = collect(&mut control, reader, out, &done, &abort);
            // A trace that cannot be read or written ends the commands too.
            abort.store(true, Ordering::Relaxed);
            result
        });
        let commands = run_commands(vm, commands, &abort);
        // An error or a Ctrl-C: the trace goes no further either.
        if !matches!(commands, Ok((_, false))) {
            abort.store(true, Ordering::Relaxed);
        }
        // The scheduler switches on an idle guest go on for ever: they end
        // with the commands, so that the trace can go quiet.
        if sched {
            if let Err(e) = ctl::sched_events(&mut vm.control(), false) {
                eprintln!("hvtrace: note: {}", term::sanitize(&format!("{e:#}")));
            }
        }
        let _ = done.set(Instant::now());
        let collected = collector
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the trace reader panicked")));
        let (failed, interrupted) = commands?;
        let reader = collected?;
        Ok(Traced {
            failed,
            lines: reader.lines,
            lost: reader.lost,
            session,
            interrupted,
        })
    })
}

/// `hvtrace run --syscalls [NAMES] --exec ...`: traces the system calls
/// while the commands run, one line per call as `hvtrace syscalls`
/// prints them; then stops the VM.
fn run_syscalls(args: &RunArgs, names: &str) -> Result<u8> {
    // A trace.dat goes to --output; the lines then go to stdout.
    let dat = args.format == Some(OutputFormatArg::TraceDat);
    let json = match args.format {
        None | Some(OutputFormatArg::Text | OutputFormatArg::TraceDat) => false,
        Some(OutputFormatArg::Json) => true,
        Some(other) => bail!("--syscalls prints text, json or a trace.dat, not {other:?}"),
    };
    let format = if json {
        protocol::TraceFormat::Json
    } else {
        protocol::TraceFormat::Text
    };
    let dat_out = match trace_read::trace_dat_path(dat, args.output.as_deref())? {
        Some(path) => Some(TraceOutput::trace_dat(path)?),
        None => None,
    };
    let sink = trace_read::sink(if dat { None } else { args.output.as_deref() }, format)?;
    let shown = SyscallsArgs {
        names: vec![names.to_string()],
        comm: args.count_comm.clone(),
        pid: None,
        failed: false,
        json,
        summary: false,
        list: false,
        duration: None,
        exec: None,
        trace_dat: None,
    };
    count::check_comm(shown.comm.as_deref())?;
    let cfg = args.resolve()?;
    note_tcg(&cfg);
    let vm = LocalVm::start(cfg)?;
    let mut control = vm.control();
    let table = syscalls::table(&mut control)?;
    let Some(armed) = syscalls::arm(&mut control, &table, &shown.names)? else {
        let report = vm.stop()?;
        return finish(&report, ctl::INTERRUPTED_EXIT);
    };
    // The VM stops at the end: the gate goes with it.
    let _ = syscalls::gate(&mut control, &armed, None, shown.comm.as_deref());
    let pairer = Arc::new(Mutex::new(syscalls::Pairer::new(
        &shown,
        armed.nr.clone(),
        armed.folds.clone(),
        sink,
    )));
    let format = protocol::TraceFormat::Json;
    trace_read::start_trace(&mut control, format).context("cannot start the trace")?;
    let mut out = match dat_out {
        Some(out) => {
            let mut out = out.with_json_copy(syscalls::pair_writer(pairer.clone()));
            out.learn(&mut control);
            out
        }
        None => TraceOutput::copy(syscalls::pair_writer(pairer.clone())),
    };
    let reader = TraceReader::new(format).with_source(Some(0));
    let traced = trace_while_running(&vm, &args.exec, control, reader, &mut out, None, false);
    if let Some(summary) = out
        .finish(Some(&mut vm.control()))
        .context("cannot write the trace")?
    {
        eprintln!("hvtrace: {}", summary.line());
    }
    let traced = traced?;
    let calls: u64 = pairer
        .lock()
        .map_err(|_| anyhow!("the trace writer failed"))?
        .tally
        .values()
        .map(|t| t.calls)
        .sum();
    let report = vm.stop()?;
    let lost = match traced.lost {
        0 => String::new(),
        n => format!(", {n} events lost"),
    };
    eprintln!("hvtrace: {calls} system calls{lost}");
    end_of_commands(
        &report,
        args,
        traced.failed,
        traced.interrupted || sys::interrupted(),
    )
}

/// Runs the commands in the guest shell, each announced on stderr and its
/// output copied there, until `abort` or a Ctrl-C; returns how many exited
/// non-zero, and whether a Ctrl-C ended them (the hypervisor stops the
/// guest next, so a command it interrupted needs nothing more).
fn run_commands(vm: &LocalVm, commands: &[String], abort: &AtomicBool) -> Result<(usize, bool)> {
    let mut failed = 0;
    for cmd in commands {
        if abort.load(Ordering::Relaxed) {
            break;
        }
        if sys::take_interrupt() {
            eprintln!("hvtrace: Ctrl-C: the commands left are not run");
            return Ok((failed, true));
        }
        eprintln!("hvtrace: $ {cmd}");
        let result = match vm.exec(cmd) {
            Ok(result) => result,
            // The wait for the command's end took the Ctrl-C.
            Err(_) if sys::interrupted() => {
                eprintln!("hvtrace: Ctrl-C: `{cmd}` interrupted; the commands left are not run");
                return Ok((failed, true));
            }
            Err(e) => return Err(e),
        };
        let output = term::for_stream(&result.output, term::stderr_is_terminal());
        let mut err = std::io::stderr().lock();
        err.write_all(output.as_bytes())?;
        err.flush()?;
        if result.rc != 0 {
            eprintln!("hvtrace: `{cmd}` exited with status {}", result.rc);
            failed += 1;
        }
    }
    Ok((failed, false))
}

/// Copies the trace from `reader` to `out` until `done` is set and no line
/// came for [`TRACE_QUIET`] since (or [`TRACE_DRAIN_LIMIT`] passed), or
/// `abort`, or a Ctrl-C.
fn collect(
    control: &mut dyn Control,
    mut reader: TraceReader,
    out: &mut TraceOutput,
    done: &OnceLock<Instant>,
    abort: &AtomicBool,
) -> Result<TraceReader> {
    let mut last_line = Instant::now();
    // A Ctrl-C ends the collection too (within one read).
    while !abort.load(Ordering::Relaxed) && !sys::interrupted() {
        match reader.read(control, TRACE_POLL_MS)? {
            Ok(read) if !read.text.is_empty() => {
                out.write(&read.text).context("cannot write the trace")?;
                last_line = Instant::now();
            }
            Ok(_) => {}
            Err(TraceEnd::VmEnded(why)) => bail!("{why}"),
        }
        if let Some(&done_at) = done.get() {
            let now = Instant::now();
            if now.duration_since(done_at.max(last_line)) >= TRACE_QUIET {
                break;
            }
            if now.duration_since(done_at) >= TRACE_DRAIN_LIMIT {
                eprintln!(
                    "hvtrace: the trace still went on {} s after the last command; stopping it there",
                    TRACE_DRAIN_LIMIT.as_secs()
                );
                break;
            }
        }
    }
    Ok(reader)
}

/// Prints the summary of a stop; fails unless the guest powered off or
/// the host stopped it.
fn finish(report: &StopReport, code: u8) -> Result<u8> {
    if let Some(counts) = &report.exit_counts {
        let text: Vec<String> = counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("hvtrace: exits: {}", term::sanitize(&text.join(" ")));
    }
    let boot = report
        .boot_time
        .map(|b| format!("boot {:.1} s, ", b.as_secs_f64()))
        .unwrap_or_default();
    eprintln!(
        "hvtrace: {boot}total {:.1} s; guest stopped: {}",
        report.wall_time.as_secs_f64(),
        term::sanitize(&report.reason)
    );
    if !Ending::from_report(report).clean {
        return Err(anyhow!(
            "the guest did not power off cleanly: {}",
            report.reason
        ));
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn run_args(argv: &[&str]) -> RunArgs {
        let mut full = vec!["hvtrace", "run"];
        full.extend_from_slice(argv);
        match crate::commands::cli::Cli::try_parse_from(full)
            .unwrap()
            .command
        {
            crate::commands::cli::Command::Run(args) => args,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn a_run_traces_the_system_calls_named_or_all() {
        assert_eq!(
            run_args(&["--syscalls", "--exec", "true"])
                .syscalls
                .as_deref(),
            Some("")
        );
        let a = run_args(&[
            "--syscalls=openat,read",
            "--count-comm",
            "cat",
            "--format",
            "json",
            "--exec",
            "cat /etc/hostname",
        ]);
        assert_eq!(a.syscalls.as_deref(), Some("openat,read"));
        assert_eq!(a.count_comm.as_deref(), Some("cat"));
        assert_eq!(run_args(&["--exec", "true"]).syscalls, None);
        let parse = |argv: &[&str]| {
            let mut full = vec!["hvtrace", "run"];
            full.extend_from_slice(argv);
            crate::commands::cli::Cli::try_parse_from(full).is_ok()
        };
        // A one-shot: it needs commands, and traces nothing else at once.
        assert!(!parse(&["--syscalls"]));
        assert!(!parse(&[
            "--syscalls",
            "--probe",
            "p vfs_read",
            "--exec",
            "true"
        ]));
        assert!(!parse(&["--syscalls", "--bare", "--exec", "true"]));
    }

    #[test]
    fn the_graph_filter_of_a_run() {
        assert_eq!(
            graph_filter(&run_args(&["--probe", "p vfs_read", "--exec", "true"])).unwrap(),
            None
        );
        let f = graph_filter(&run_args(&[
            "--graph",
            "vfs_read",
            "--graph",
            "vfs_write",
            "--graph-trace",
            "vfs_*",
            "--graph-notrace",
            "schedule",
            "--graph-ftrace-notrace",
            "rw_verify_area",
            "--graph-ftrace-notrace",
            "*fsnotify*",
            "--graph-comm",
            "dd",
            "--graph-retval",
            "--max-depth",
            "2",
            "--exec",
            "true",
        ]))
        .unwrap();
        assert_eq!(
            f,
            Some(GraphFilter {
                functions: vec!["vfs_read".into(), "vfs_write".into()],
                trace: vec!["vfs_*".into()],
                notrace: vec!["rw_verify_area".into(), "*fsnotify*".into()],
                graph_notrace: vec!["schedule".into()],
                max_depth: 2,
                pid: None,
                comm: Some("dd".into()),
                retval: true,
                stack_frames: 0,
                gate: false,
            })
        );
        let defaults = graph_filter(&run_args(&["--graph", "f", "--exec", "true"])).unwrap();
        assert_eq!(
            defaults,
            Some(GraphFilter {
                functions: vec!["f".into()],
                ..GraphFilter::default()
            })
        );
        let e = graph_filter(&run_args(&[
            "--graph",
            "f",
            "--graph-notrace",
            "a b",
            "--exec",
            "true",
        ]))
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            r#"--graph-notrace "a b": one glob per --graph-notrace (repeat the option for more)"#
        );
        let e = graph_filter(&run_args(&[
            "--graph",
            "f",
            "--graph-ftrace-notrace",
            "",
            "--exec",
            "true",
        ]))
        .unwrap_err()
        .to_string();
        assert_eq!(e, r#"--graph-ftrace-notrace needs a glob (got "")"#);
    }

    #[test]
    fn the_source_a_run_reads() {
        // Probes and the function tracer only.
        assert_eq!(trace_source(None), Some(0));
        // With a graph: one stream, probes and graph as they came (a
        // Chrome trace and a trace.dat keep every event too).
        assert_eq!(trace_source(Some(2)), None);
        assert_eq!(trace_source(Some(15)), None);
    }

    /// Answers every trace read with one line and asks the collector to
    /// stop after `reads` reads.
    struct Lines<'a> {
        abort: &'a AtomicBool,
        reads: usize,
        seen: Vec<protocol::Request>,
    }

    impl Control for Lines<'_> {
        fn request(
            &mut self,
            request: protocol::Request,
            _timeout: Duration,
        ) -> Result<protocol::Response> {
            self.seen.push(request);
            if self.seen.len() >= self.reads {
                self.abort.store(true, Ordering::Relaxed);
            }
            Ok(protocol::Response::Trace {
                next: self.seen.len() as u64 * 2,
                text: format!("line {}\n", self.seen.len()),
                lost: 0,
            })
        }
    }

    #[test]
    fn the_collector_reads_its_source() {
        let abort = AtomicBool::new(false);
        let mut control = Lines {
            abort: &abort,
            reads: 2,
            seen: Vec::new(),
        };
        let buf = crate::commands::trace_read::SharedBuf::default();
        let mut out = TraceOutput::copy(Box::new(buf.clone()));
        let reader = TraceReader::new(protocol::TraceFormat::Json).with_source(Some(3));
        let done = OnceLock::new();
        let reader = collect(&mut control, reader, &mut out, &done, &abort).unwrap();
        assert_eq!(buf.text(), "line 1\nline 2\n");
        assert_eq!((reader.lines, reader.cursor), (2, 4));
        assert_eq!(
            control.seen,
            [
                protocol::Request::TraceRead {
                    cursor: 0,
                    format: protocol::TraceFormat::Json,
                    wait_ms: TRACE_POLL_MS,
                    source: Some(3),
                },
                protocol::Request::TraceRead {
                    cursor: 2,
                    format: protocol::TraceFormat::Json,
                    wait_ms: TRACE_POLL_MS,
                    source: Some(3),
                },
            ]
        );
    }
}
