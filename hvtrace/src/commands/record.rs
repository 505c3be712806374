//! `hvtrace record`: records a detached VM's trace into a trace.dat, as
//! `trace-cmd record` does, until Ctrl-C, the duration, or the VM's end;
//! and `hvtrace convert`: JSON lines saved earlier into a trace.dat.
//!
//! `record` adds its probes and function-tracer globs and starts its graph
//! session, reads the stream's JSON lines from its end (every source),
//! and prints a progress line on stderr every few seconds: events per CPU,
//! bytes so far, and the losses root counted per vCPU since the start. At
//! the end it stops its session, deletes its probes, takes the function
//! tracer off if it put it on, and writes the file (beside the path, then
//! renamed). The guest's kallsyms is taken at the start (the stream brings
//! root's index) and again at the end if it changed, so a VM that ends
//! first still leaves a file that names its functions.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use protocol::{Request, Response, TraceFormat};

use super::cli::{ConvertArgs, RecordArgs};
use super::ctl::{self, INTERRUPTED_EXIT};
use super::graph;
use super::timeouts::{PROBE_TIMEOUT, STATUS_TIMEOUT};
use super::trace_read::{self, TraceEnd, TraceOutput, TraceReader};
use crate::control::Control;
use crate::output::term;
use crate::output::tracedat::TraceDat;
use crate::sys;

/// How often the progress line is printed.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Each read waits at most this long for a line.
const READ_WAIT_MS: u32 = 500;

/// `hvtrace record`.
pub fn record(socket: &Path, args: &RecordArgs) -> Result<u8> {
    // What can be checked without a VM, first.
    for spec in &args.probes {
        ctl::check_probe_spec(spec).with_context(|| format!("--probe {spec:?}"))?;
    }
    if let Some(glob) = args.functions.iter().find(|g| g.trim().is_empty()) {
        bail!("--function needs a glob (got {glob:?})");
    }
    if args.duration.is_some_and(|d| !(d.is_finite() && d > 0.0)) {
        bail!("--duration needs a number of seconds above 0");
    }
    let filter = if args.graphs.is_empty() {
        if args.graph_filter.any() {
            bail!("the graph options need --graph GLOB");
        }
        None
    } else {
        Some(graph::checked_filter(
            &args.graphs,
            &args.graph_filter,
            None,
            graph::RUN_SPELLING,
        )?)
    };
    let mut out = TraceOutput::trace_dat(&args.output)?;
    if let Some(path) = &args.also_json {
        out = out.with_json_copy(trace_read::sink(Some(path), TraceFormat::Json)?);
    }
    let mut client = ctl::open(socket)?;
    let format = TraceFormat::Json;
    // Only what comes from here on.
    let mut reader = TraceReader::at_end(&mut client, format)?;
    let mut armed = Armed::default();
    let result = arm(&mut client, args, filter, &mut armed).and_then(|()| {
        trace_read::start_trace(&mut client, format).context("cannot start the trace")?;
        out.learn(&mut client);
        eprintln!(
            "hvtrace: recording to {}; {}",
            term::sanitize(&args.output.display().to_string()),
            match args.duration {
                Some(d) => format!("for {d} s (or until Ctrl-C)"),
                None => "Ctrl-C ends it".to_string(),
            }
        );
        copy(&mut client, &mut reader, &mut out, args.duration)
    });
    let vm_alive = !matches!(result, Ok(Ended::Vm(_)));
    if vm_alive {
        armed.disarm(&mut client);
    }
    // A recording that never ran (a probe refused, the trace not started)
    // writes no file, and leaves an earlier one as it was.
    if let Err(e) = &result {
        if !out.recorded() {
            drop(out);
            return Err(anyhow::anyhow!("{e:#}"));
        }
    }
    let summary = out
        .finish(vm_alive.then_some(&mut client as &mut dyn Control))
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    let end = result?;
    if let Some(s) = summary {
        eprintln!(
            "hvtrace: {} to {}",
            s.line(),
            term::sanitize(&args.output.display().to_string())
        );
    }
    Ok(match end {
        // The file is whole: the end of the VM ends the recording.
        Ended::Vm(why) => {
            eprintln!(
                "hvtrace: note: {} during the recording; the file holds the events recorded until then",
                term::sanitize(&why)
            );
            0
        }
        Ended::Interrupted => INTERRUPTED_EXIT,
        Ended::Duration => 0,
    })
}

/// What `record` put on, to take off at the end.
#[derive(Debug, Default)]
struct Armed {
    probes: Vec<String>,
    functions: bool,
    session: Option<u32>,
    sched: bool,
}

impl Armed {
    fn disarm(&mut self, control: &mut dyn Control) {
        if let Some(session) = self.session.take() {
            if let Err(e) = graph::stop(control, session) {
                eprintln!("hvtrace: note: {}", term::sanitize(&format!("{e:#}")));
            }
        }
        for name in self.probes.drain(..) {
            let _ = control.request(Request::ProbeDel { name }, PROBE_TIMEOUT);
        }
        if std::mem::take(&mut self.functions) {
            let _ = ctl::clear_functions(control);
        }
        if std::mem::take(&mut self.sched) {
            let _ = ctl::sched_events(control, false);
        }
    }
}

fn arm(
    control: &mut dyn Control,
    args: &RecordArgs,
    filter: Option<protocol::GraphFilter>,
    armed: &mut Armed,
) -> Result<()> {
    for spec in &args.probes {
        let (name, site) =
            ctl::add_probe(control, spec).with_context(|| format!("--probe {spec:?}"))?;
        eprintln!(
            "hvtrace: {}",
            term::sanitize(&crate::output::report::added_line(&name, site))
        );
        armed.probes.push(name);
    }
    for glob in &args.functions {
        let summary =
            ctl::add_functions(control, glob).with_context(|| format!("--function {glob:?}"))?;
        armed.functions = true;
        eprintln!("hvtrace: {summary}");
    }
    if let Some(filter) = filter {
        let started = graph::start(control, filter).context("--graph")?;
        eprintln!("hvtrace: {}", started.line());
        armed.session = Some(started.session);
    }
    if !args.no_sched {
        eprintln!("hvtrace: {}", ctl::sched_events(control, true)?);
        armed.sched = true;
    }
    Ok(())
}

/// How a recording ended.
#[derive(Debug)]
enum Ended {
    Duration,
    Interrupted,
    Vm(String),
}

/// Reads until Ctrl-C, `duration` or the VM's end, with a progress line
/// every [`PROGRESS_EVERY`].
fn copy(
    control: &mut dyn Control,
    reader: &mut TraceReader,
    out: &mut TraceOutput,
    duration: Option<f64>,
) -> Result<Ended> {
    let start = Instant::now();
    let duration = duration.map(Duration::from_secs_f64);
    let lost_at_start = vcpu_losses(control);
    let mut last_progress = Instant::now();
    loop {
        if sys::interrupted() {
            return Ok(Ended::Interrupted);
        }
        if duration.is_some_and(|d| start.elapsed() >= d) {
            return Ok(Ended::Duration);
        }
        let read = match reader.read(control, READ_WAIT_MS) {
            Ok(Ok(read)) => read,
            Ok(Err(TraceEnd::VmEnded(why))) => return Ok(Ended::Vm(why)),
            Err(e) if sys::is_interrupted(&e) => return Ok(Ended::Interrupted),
            Err(e) => return Err(e),
        };
        out.lost(read.lost);
        out.write(&read.text)
            .map_err(|e| anyhow::anyhow!("cannot keep the trace: {e}"))?;
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            let lost = vcpu_losses(control)
                .zip(lost_at_start.clone())
                .map(|(now, then)| {
                    now.iter()
                        .zip(then.iter().chain(std::iter::repeat(&0)))
                        .map(|(a, b)| a.saturating_sub(*b))
                        .collect::<Vec<_>>()
                });
            eprintln!(
                "hvtrace: {}",
                progress_line(out, start.elapsed(), lost.as_deref())
            );
        }
    }
}

/// Each vCPU's lost records as root counts them (`None` when the status
/// cannot be read).
fn vcpu_losses(control: &mut dyn Control) -> Option<Vec<u64>> {
    match control.request(Request::Status, STATUS_TIMEOUT) {
        Ok(Response::Status(s)) => Some(s.per_vcpu.iter().map(|v| v.lost).collect()),
        _ => None,
    }
}

/// `record: 12.0 s, cpu0 1200 events, cpu1 40 events; 49152 bytes; lost
/// cpu0 0, cpu1 3`.
pub fn progress_line(out: &TraceOutput, elapsed: Duration, lost: Option<&[u64]>) -> String {
    let per_cpu = out.events_per_cpu().unwrap_or_default();
    let mut line = format!("record: {:.1} s", elapsed.as_secs_f64());
    for (cpu, n) in per_cpu.iter().enumerate() {
        line.push_str(&format!(
            ", cpu{cpu} {n} event{}",
            if *n == 1 { "" } else { "s" }
        ));
    }
    line.push_str(&format!("; {} bytes", out.bytes().unwrap_or(0)));
    if let Some(lost) = lost {
        let parts: Vec<String> = lost
            .iter()
            .enumerate()
            .map(|(cpu, n)| format!("cpu{cpu} {n}"))
            .collect();
        line.push_str(&format!("; lost {}", parts.join(", ")));
    }
    line
}

/// `hvtrace convert`: JSON lines (`--format json` output) into a trace.dat.
pub fn convert(args: &ConvertArgs) -> Result<u8> {
    let text = std::fs::read_to_string(&args.input)
        .with_context(|| format!("cannot read {}", args.input.display()))?;
    let kallsyms = match &args.kallsyms {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?,
        ),
        None => None,
    };
    let mut builder = TraceDat::new(args.probes.iter().map(String::as_str));
    builder.cpus_at_least(args.cpus as usize);
    builder.push_text(&text);
    if !text.ends_with('\n') {
        builder.push_text("\n");
    }
    let summary = crate::commands::trace_read::write_trace_dat(builder, &args.output, kallsyms)?;
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "hvtrace: {} to {}",
        summary.line(),
        term::sanitize(&args.output.display().to_string())
    );
    Ok(0)
}
