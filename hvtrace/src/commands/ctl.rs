//! The control commands: `status`, `exec`, `stop`, `syms`, `probe add|del|list`
//! and `trace`, each a client of a running VM's control socket
//! ([`crate::client`]). Each opens its session with `Hello`, which checks
//! that both ends speak this protocol version, then makes one or more calls
//! and renders the answers. (`graph` is in [`crate::commands::graph`].)
//!
//! The steps that `hvtrace run` shares when it traces (adding probes and
//! functions, reading the trace) take any [`Control`], so that they work
//! the same over the socket and in-process.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use ::hypervisor::kprobe;
use anyhow::{anyhow, bail, Context, Result};
use protocol::{
    ErrorKind, Event, GuestState, ProbeInfo, Request, Response, StatusReport, TraceFormat,
};

use crate::client::{response_error, Client, Control, SupervisorGone};
use crate::commands::cli::{
    DetailedError, ExecArgs, OutputFormatArg, ProbeAddArgs, ProbeDelArgs, ProbeListArgs,
    StatusArgs, StopArgs, SymsArgs, TraceArgs,
};
use crate::output::chrome::{Chrome, ChromeSummary};
use crate::output::json::Json;
use crate::output::term::{self, Mode};
use crate::sys;
use crate::vm::hvlog::{self, HvEvent};

/// How long a status report may take: the hypervisor answers within
/// [`crate::daemon::link::DEFAULT_TIMEOUT`] (stretched by the emulator's pace), or
/// the supervisor says why not before this.
pub const STATUS_TIMEOUT: Duration = crate::daemon::link::longest_wait(
    crate::daemon::link::DEFAULT_TIMEOUT,
    Duration::from_secs(30),
);
/// How long a guest command may take, a little past the supervisor's own
/// limit so that its error arrives first.
pub const EXEC_TIMEOUT: Duration =
    Duration::from_secs(crate::daemon::supervisor::EXEC_TIMEOUT.as_secs() + 30);
/// How long a stop may take.
pub const STOP_TIMEOUT: Duration =
    Duration::from_secs(crate::daemon::supervisor::STOP_TIMEOUT.as_secs() + 30);

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

/// A status report and how long it took to get.
#[derive(Clone, Debug)]
pub struct Status {
    /// The hypervisor's report.
    pub report: StatusReport,
    /// The request's round trip, client to hypervisor and back.
    pub round_trip: Duration,
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
        term::sanitize_json(&(status_json(&status).render() + "\n")).into_owned()
    } else {
        term::sanitize(&status_text(&status)).into_owned()
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(0)
}

/// The guest state's name.
pub fn guest_state_name(state: GuestState) -> &'static str {
    match state {
        GuestState::Booting => "booting",
        GuestState::Running => "running",
        GuestState::Stopped => "stopped",
        _ => "unknown",
    }
}

/// Exit counts, largest first (ties by name).
pub fn sorted_exits(report: &StatusReport) -> Vec<(String, u16, u64)> {
    let mut exits: Vec<(String, u16, u64)> = report
        .exits
        .iter()
        .map(|e| (e.name.clone(), e.reason, e.count))
        .collect();
    exits.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    exits
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The status report for people.
pub fn status_text(status: &Status) -> String {
    let r = &status.report;
    let mut out = String::new();
    let mut line = |key: &str, value: String| {
        out.push_str(&format!("{key:<12} {value}\n"));
    };
    line(
        "hypervisor",
        format!("{} (protocol {})", r.hypervisor_version, r.protocol_version),
    );
    line("vcpus", r.vcpus.to_string());
    line("uptime", format!("{:.1} s", r.uptime_ns as f64 / 1e9));
    line("guest", guest_state_name(r.guest_state).to_string());
    if let Some(k) = &r.kernel {
        line(
            "kernel",
            format!(
                "{}, KASLR slide {}{:#x}, {} symbols ({} text, {} traceable)",
                k.release,
                if k.kaslr_slide < 0 { "-" } else { "" },
                k.kaslr_slide.unsigned_abs(),
                k.symbols,
                k.text_symbols,
                k.traceable
            ),
        );
    }
    if let Some(task) = &r.current_task {
        line(
            "task",
            format!("{} (pid {}) on cpu {}", task.comm, task.pid, task.cpu),
        );
    }
    line(
        "memory",
        format!(
            "{} used of {}",
            mib(r.hv_memory_used),
            mib(r.hv_memory_total)
        ),
    );
    line("exits", format!("{} in all", r.exits_total));
    let exits = sorted_exits(r);
    let width = exits.iter().map(|e| e.0.len()).max().unwrap_or(0);
    for (name, reason, count) in &exits {
        out.push_str(&format!(
            "  {name:<width$} {count:>12}  (reason {reason})\n"
        ));
    }
    let t = &r.tracer;
    if *t != protocol::TracerReport::default() {
        out.push_str(&format!(
            "{:<12} {} probes, {} functions, {} sites on {} pages, {} hits, {} lost\n",
            "tracer", t.probes, t.functions, t.sites, t.pages, t.hits, t.lost
        ));
        out.push_str(&format!(
            "{:<12} {} steps, {} guest writes, {} region restores, {} foreign VMCALLs, {} forged entries, {} blocked writes\n",
            "", t.steps, t.guest_writes, t.region_restores, t.foreign_vmcalls, t.forged_entries, t.blocked_writes
        ));
        if t.trampolines != 0 {
            out.push_str(&format!("{:<12} trampolines at {:#x}\n", "", t.trampolines));
        }
        if t.graph_sessions != 0
            || t.retprobes != 0
            || t.graph_stacks + t.graph_misses + t.graph_dropped + t.graph_orphans + t.graph_reaped
                != 0
        {
            out.push_str(&format!(
                "{:<12} {} sessions, {} return probes; {} frames on {} stacks ({} B), {} misses, {} dropped, {} reaped, {} orphan returns\n",
                "graph",
                t.graph_sessions,
                t.retprobes,
                t.graph_frames,
                t.graph_stacks,
                t.graph_bytes,
                t.graph_misses,
                t.graph_dropped,
                t.graph_reaped,
                t.graph_orphans
            ));
        }
    }
    let c = &r.channel;
    out.push_str(&format!(
        "{:<12} in {} B ({} frames), out {} B ({} frames), {} bad frames, {} dropped\n",
        "channel", c.bytes_in, c.frames_in, c.bytes_out, c.frames_out, c.bad_frames, c.dropped
    ));
    out.push_str(&format!(
        "{:<12} {:.1} ms\n",
        "round trip",
        status.round_trip.as_secs_f64() * 1e3
    ));
    out
}

/// The status report as one JSON object.
pub fn status_json(status: &Status) -> Json {
    let r = &status.report;
    let exits = sorted_exits(r)
        .into_iter()
        .map(|(name, reason, count)| {
            Json::object([
                ("name", Json::str(name)),
                ("reason", Json::int(reason)),
                ("count", Json::int(count)),
            ])
        })
        .collect();
    let task = match &r.current_task {
        Some(t) => Json::object([
            ("pid", Json::int(t.pid)),
            ("comm", Json::str(t.comm.clone())),
            ("cpu", Json::int(t.cpu)),
        ]),
        None => Json::Null,
    };
    let kernel = match &r.kernel {
        Some(k) => Json::object([
            ("release", Json::str(k.release.clone())),
            ("kaslr_slide", Json::int(k.kaslr_slide)),
            ("symbols", Json::int(k.symbols)),
            ("text_symbols", Json::int(k.text_symbols)),
            ("traceable", Json::int(k.traceable)),
            ("index_bytes", Json::int(k.index_bytes)),
            ("recovery_ns", Json::int(k.recovery_ns)),
            (
                "task_layout_error",
                match &k.task_layout_error {
                    Some(e) => Json::str(e.clone()),
                    None => Json::Null,
                },
            ),
        ]),
        None => Json::Null,
    };
    let c = &r.channel;
    let t = &r.tracer;
    let tracer = Json::object([
        ("probes", Json::int(t.probes)),
        ("functions", Json::int(t.functions)),
        ("sites", Json::int(t.sites)),
        ("pages", Json::int(t.pages)),
        ("hits", Json::int(t.hits)),
        ("lost", Json::int(t.lost)),
        ("steps", Json::int(t.steps)),
        ("guest_writes", Json::int(t.guest_writes)),
        ("region_restores", Json::int(t.region_restores)),
        ("foreign_vmcalls", Json::int(t.foreign_vmcalls)),
        ("forged_entries", Json::int(t.forged_entries)),
        ("blocked_writes", Json::int(t.blocked_writes)),
        ("graph_frames", Json::int(t.graph_frames)),
        ("graph_stacks", Json::int(t.graph_stacks)),
        ("graph_bytes", Json::int(t.graph_bytes)),
        ("graph_misses", Json::int(t.graph_misses)),
        ("graph_dropped", Json::int(t.graph_dropped)),
        ("graph_orphans", Json::int(t.graph_orphans)),
        ("graph_reaped", Json::int(t.graph_reaped)),
        ("graph_sessions", Json::int(u64::from(t.graph_sessions))),
        ("retprobes", Json::int(u64::from(t.retprobes))),
        (
            "trampolines",
            match t.trampolines {
                0 => Json::Null,
                addr => Json::Str(format!("{addr:#x}")),
            },
        ),
    ]);
    Json::object([
        (
            "hypervisor_version",
            Json::str(r.hypervisor_version.clone()),
        ),
        ("protocol_version", Json::int(r.protocol_version)),
        ("vcpus", Json::int(r.vcpus)),
        ("uptime_ns", Json::int(r.uptime_ns)),
        ("guest_state", Json::str(guest_state_name(r.guest_state))),
        ("kernel", kernel),
        ("current_task", task),
        ("exits_total", Json::int(r.exits_total)),
        ("exits", Json::Array(exits)),
        ("hv_memory_used", Json::int(r.hv_memory_used)),
        ("hv_memory_total", Json::int(r.hv_memory_total)),
        (
            "channel",
            Json::object([
                ("bytes_in", Json::int(c.bytes_in)),
                ("bytes_out", Json::int(c.bytes_out)),
                ("frames_in", Json::int(c.frames_in)),
                ("frames_out", Json::int(c.frames_out)),
                ("bad_frames", Json::int(c.bad_frames)),
                ("dropped", Json::int(c.dropped)),
            ]),
        ),
        ("tracer", tracer),
        (
            "round_trip_ms",
            Json::Float(status.round_trip.as_secs_f64() * 1e3),
        ),
    ])
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

/// One symbol as text (`ffffffff81234560 00000150 T vfs_read site=ffffffff81234564`)
/// or as a JSON object.
pub fn symbol_line(s: &protocol::SymbolInfo, json: bool) -> String {
    let kind = char::from(s.kind);
    if json {
        let mut fields = vec![
            ("name", Json::Str(s.name.clone())),
            ("addr", Json::Str(format!("{:#x}", s.addr))),
            ("size", Json::int(s.size)),
            ("type", Json::Str(kind.to_string())),
            ("traceable", Json::Bool(s.site.is_some())),
        ];
        match s.site {
            Some(site) => fields.push(("site", Json::Str(format!("{site:#x}")))),
            None => fields.push(("not_traceable", Json::Str(s.not_traceable.clone()))),
        }
        return Json::object(fields).render();
    }
    let trace = match s.site {
        Some(site) => format!("site={site:016x}"),
        None => format!("not traceable: {}", s.not_traceable),
    };
    format!("{:016x} {:08x} {kind} {} {trace}", s.addr, s.size, s.name)
}

/// How long a probe, function or graph request may take: the hypervisor
/// answers within [`crate::daemon::link::HOOK_TIMEOUT`] (stretched by the
/// emulator's pace), or the supervisor says why not before this.
pub const PROBE_TIMEOUT: Duration =
    crate::daemon::link::longest_wait(crate::daemon::link::HOOK_TIMEOUT, Duration::from_secs(30));

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

/// The line that reports an added probe.
pub fn added_line(name: &str, site: u64) -> String {
    format!("added {name} at {site:#x}")
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

/// One probe as text (`  kprobes/myopen    12    0  p:kprobes/myopen ...`)
/// or as a JSON object.
pub fn probe_line(p: &ProbeInfo, json: bool) -> String {
    if json {
        return Json::object([
            ("name", Json::str(p.name.clone())),
            ("hits", Json::int(p.hits)),
            ("misses", Json::int(p.misses)),
            ("symbol", Json::str(p.symbol.clone())),
            ("site", Json::Str(format!("{:#x}", p.site))),
            ("spec", Json::str(p.spec.clone())),
        ])
        .render();
    }
    format!(
        "  {:<44} {:>15} {:>15}  {}",
        p.name, p.hits, p.misses, p.spec
    )
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

/// How many functions matching `glob` are traced and which were skipped,
/// for the terminal (the symbol names come from the guest: control
/// characters are escaped).
pub fn function_summary(glob: &str, traced: u32, skipped: &[String], skipped_total: u32) -> String {
    let mut line = format!("function tracer on {glob}: {traced} traced");
    if skipped_total > 0 {
        line.push_str(&format!(", {skipped_total} skipped"));
        if !skipped.is_empty() {
            line.push_str(" (");
            line.push_str(&skipped.join("; "));
            let more = (skipped_total as usize).saturating_sub(skipped.len());
            if more > 0 {
                line.push_str(&format!("; {more} more"));
            }
            line.push(')');
        }
    }
    term::sanitize(&line).into_owned()
}

/// Starts the trace stream in `format`.
pub fn start_trace(control: &mut dyn Control, format: TraceFormat) -> Result<()> {
    match control.request(Request::TraceStart { format }, PROBE_TIMEOUT)? {
        Response::Ok => Ok(()),
        other => Err(response_error(other)),
    }
}

/// What one trace read brought.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceRead {
    /// Complete lines.
    pub text: String,
    /// Lines or events lost since the previous read.
    pub lost: u64,
}

/// How a trace read ended without lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceEnd {
    /// The VM has ended (the message says how); the trace is complete.
    VmEnded(String),
}

/// Reads the supervisor's trace buffer from a cursor
/// ([`Request::TraceRead`]).
#[derive(Clone, Debug)]
pub struct TraceReader {
    /// Where the next read starts.
    pub cursor: u64,
    /// The format asked for.
    pub format: TraceFormat,
    /// The source asked for ([`protocol::Event::TraceText`]: 0 for probes
    /// and the function tracer, N for function-graph session N); `None`:
    /// every source.
    pub source: Option<u32>,
    /// Lines read so far.
    pub lines: u64,
    /// Losses reported so far.
    pub lost: u64,
}

impl TraceReader {
    /// A reader of every source from the start of the buffer.
    pub fn new(format: TraceFormat) -> TraceReader {
        TraceReader {
            cursor: 0,
            format,
            source: None,
            lines: 0,
            lost: 0,
        }
    }

    /// The same reader, reading only the lines of `source` (`None`: of
    /// every source) from its cursor on.
    pub fn with_source(mut self, source: Option<u32>) -> TraceReader {
        self.source = source;
        self
    }

    /// A reader (of every source) from the end of the buffer as it is now:
    /// it gets the lines that arrive from here on. Its one read (a cursor
    /// past the end reads from the end, without waiting) also starts the
    /// stream in `format` if it is not. Fails when the VM has ended.
    pub fn at_end(control: &mut dyn Control, format: TraceFormat) -> Result<TraceReader> {
        let mut reader = TraceReader::new(format);
        reader.cursor = u64::MAX;
        match reader.read(control, 0)? {
            Ok(_) => {}
            Err(TraceEnd::VmEnded(why)) => bail!("{why}"),
        }
        if reader.cursor == u64::MAX {
            bail!("the trace buffer did not say where it ends");
        }
        reader.lines = 0;
        reader.lost = 0;
        Ok(reader)
    }

    /// One read, waiting up to `wait_ms` for a line. Losses are reported on
    /// stderr (`hvtrace: N events lost`). The end of the VM is `Err(end)`
    /// inside the `Ok`; other failures are errors.
    pub fn read(
        &mut self,
        control: &mut dyn Control,
        wait_ms: u32,
    ) -> Result<std::result::Result<TraceRead, TraceEnd>> {
        let request = Request::TraceRead {
            cursor: self.cursor,
            format: self.format,
            wait_ms,
            source: self.source,
        };
        // The wait, a stream start forwarded to the hypervisor, and margin.
        let timeout = Duration::from_millis(u64::from(wait_ms))
            + crate::daemon::link::DEFAULT_TIMEOUT
            + Duration::from_secs(30);
        let response = match control.request(request, timeout) {
            Ok(response) => response,
            Err(e) if e.downcast_ref::<SupervisorGone>().is_some() => {
                return Ok(Err(TraceEnd::VmEnded(e.to_string())));
            }
            Err(e) => return Err(e),
        };
        match response {
            Response::Trace { next, text, lost } => {
                self.cursor = next;
                self.lines += text.bytes().filter(|&b| b == b'\n').count() as u64;
                self.lost += lost;
                if lost > 0 {
                    eprintln!("hvtrace: {lost} events lost");
                }
                Ok(Ok(TraceRead { text, lost }))
            }
            Response::Error {
                kind: ErrorKind::NotReady,
                message,
            } if message.starts_with("the VM has ended") => Ok(Err(TraceEnd::VmEnded(message))),
            other => Err(response_error(other)),
        }
    }
}

/// `trace --follow`: each read waits this long for a line.
pub const FOLLOW_WAIT_MS: u32 = 5000;
/// `trace`: the first read waits this long (the stream may only start
/// with it).
pub const FIRST_WAIT_MS: u32 = 3000;
/// `trace`: a read that brings nothing after this long ends the trace. A
/// full frame takes about 0.36 s on the serial line, so this is well above.
pub const DRAIN_WAIT_MS: u32 = 1000;

/// Where trace lines go: copied to a writer as they come, or collected
/// for a Chrome trace that is written when the trace ends.
pub struct TraceOutput {
    out: Box<dyn Write + Send>,
    chrome: Option<Chrome>,
}

impl TraceOutput {
    /// Lines are copied to `out` as they come.
    pub fn copy(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput { out, chrome: None }
    }

    /// Lines (JSON) are collected; [`TraceOutput::finish`] writes the
    /// Chrome trace to `out`.
    pub fn chrome(out: Box<dyn Write + Send>) -> TraceOutput {
        TraceOutput {
            out,
            chrome: Some(Chrome::new()),
        }
    }

    /// The output for `format`, into `path` (created now) or stdout (with
    /// control characters escaped: [`stdout_for`]).
    pub fn create(path: Option<&Path>, format: OutputFormatArg) -> Result<TraceOutput> {
        let out: Box<dyn Write + Send> = match path {
            Some(path) => Box::new(BufWriter::new(
                File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
            )),
            None => stdout_for(format.protocol()),
        };
        Ok(match format {
            OutputFormatArg::Chrome => TraceOutput::chrome(out),
            OutputFormatArg::Text | OutputFormatArg::Json => TraceOutput::copy(out),
        })
    }

    /// Takes complete lines.
    pub fn write(&mut self, text: &str) -> std::io::Result<()> {
        match &mut self.chrome {
            Some(chrome) => {
                chrome.push_text(text);
                Ok(())
            }
            None => {
                self.out.write_all(text.as_bytes())?;
                self.out.flush()
            }
        }
    }

    /// Ends the output: writes the Chrome trace, if that is what it is
    /// (and says what it holds), and flushes.
    pub fn finish(mut self) -> std::io::Result<Option<ChromeSummary>> {
        let summary = match self.chrome.take() {
            Some(chrome) => Some(chrome.write(&mut self.out)?),
            None => None,
        };
        self.out.flush()?;
        Ok(summary)
    }
}

/// Stdout for trace lines in `format`: the lines quote the guest (task
/// names, string arguments, symbols), so the characters a terminal acts on
/// are escaped, as text or as JSON escapes ([`term::Sanitizing`]).
pub fn stdout_for(format: TraceFormat) -> Box<dyn Write + Send> {
    let mode = match format {
        TraceFormat::Text => Mode::Text,
        _ => Mode::Json,
    };
    Box::new(term::Sanitizing::new(std::io::stdout(), mode))
}

/// A writer whose bytes tests read back ([`TraceOutput::copy`] into it).
#[cfg(test)]
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedBuf(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

#[cfg(test)]
impl SharedBuf {
    /// What was written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[cfg(test)]
impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How [`copy_trace`] ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyEnd {
    /// A read stayed empty (without `follow`).
    Quiet,
    /// The VM has ended (the message says how).
    VmEnded(String),
    /// `stop` said so (an interrupt).
    Stopped,
    /// The reader of the output left (a broken pipe).
    ReaderLeft,
}

/// Copies the trace from `reader` to `out`: until a read stays empty, or
/// with `follow` until `stop` says so or the VM ends. The first read waits
/// [`FIRST_WAIT_MS`] and the next ones [`DRAIN_WAIT_MS`]; with `follow`
/// each waits `follow_wait_ms`. `stop` is asked before each read; a read
/// that a Ctrl-C ended ([`sys::Interrupted`]) stops the copy too.
pub fn copy_trace(
    control: &mut dyn Control,
    reader: &mut TraceReader,
    follow: bool,
    follow_wait_ms: u32,
    out: &mut TraceOutput,
    stop: &dyn Fn() -> bool,
) -> Result<CopyEnd> {
    let mut wait = if follow {
        follow_wait_ms
    } else {
        FIRST_WAIT_MS
    };
    loop {
        if stop() {
            return Ok(CopyEnd::Stopped);
        }
        let read = match reader.read(control, wait) {
            Ok(Ok(read)) => read,
            Ok(Err(TraceEnd::VmEnded(why))) => return Ok(CopyEnd::VmEnded(why)),
            Err(e) if sys::is_interrupted(&e) => return Ok(CopyEnd::Stopped),
            Err(e) => return Err(e),
        };
        if !follow {
            wait = DRAIN_WAIT_MS;
        }
        if !read.text.is_empty() {
            match out.write(&read.text) {
                Ok(()) => {}
                // The reader of our output left (`| head`): done.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    return Ok(CopyEnd::ReaderLeft)
                }
                Err(e) => return Err(anyhow!("cannot write the trace: {e}")),
            }
        } else if read.lost == 0 && !follow {
            return Ok(CopyEnd::Quiet);
        }
    }
}

/// `hvtrace trace`: adds the --function globs, then copies the trace to
/// stdout: until a read stays empty, or with --follow until interrupted or
/// the VM ends. A Ctrl-C ends the copy at once (exit code 130); what was
/// read is out already.
pub fn trace(socket: &Path, args: &TraceArgs) -> Result<u8> {
    let mut client = open(socket)?;
    for glob in &args.functions {
        let summary = add_functions(&mut client, glob)?;
        eprintln!("hvtrace: {summary}");
    }
    // Probe, return-probe and function-tracer lines only: graph sessions
    // are read by `hvtrace graph`.
    let mut reader = TraceReader::new(args.format.protocol()).with_source(Some(0));
    let mut out = TraceOutput::copy(stdout_for(args.format.protocol()));
    let end = copy_trace(
        &mut client,
        &mut reader,
        args.follow,
        FOLLOW_WAIT_MS,
        &mut out,
        &sys::interrupted,
    )?;
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

/// The hypervisor's last log lines, as `stop` prints them.
pub fn render_stop(events: &[Event]) -> String {
    let mut out = String::new();
    for event in events {
        let Event::Log { text } = event else {
            continue;
        };
        match hvlog::classify(text) {
            HvEvent::ExitCounts(counts) => {
                let total: u64 = counts.values().sum();
                out.push_str(&format!("exits: {total} in all\n"));
                let mut counts: Vec<_> = counts.into_iter().collect();
                counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                let width = counts.iter().map(|c| c.0.len()).max().unwrap_or(0);
                for (name, count) in counts {
                    out.push_str(&format!("  {name:<width$} {count:>12}\n"));
                }
            }
            HvEvent::GuestStopped(reason) => out.push_str(&format!("guest stopped: {reason}\n")),
            _ => out.push_str(&format!("{text}\n")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{ChannelReport, ExitCount};

    fn report() -> StatusReport {
        StatusReport {
            hypervisor_version: "0.1.0".into(),
            protocol_version: 1,
            vcpus: 1,
            uptime_ns: 12_345_000_000,
            guest_state: GuestState::Running,
            exits: vec![
                ExitCount {
                    reason: 10,
                    name: "CPUID".into(),
                    count: 1066,
                },
                ExitCount {
                    reason: 52,
                    name: "PREEMPTION_TIMER".into(),
                    count: 5000,
                },
                ExitCount {
                    reason: 55,
                    name: "XSETBV".into(),
                    count: 2,
                },
            ],
            exits_total: 6068,
            hv_memory_used: 8 * 1024 * 1024,
            hv_memory_total: 30 * 1024 * 1024,
            current_task: None,
            channel: ChannelReport {
                bytes_in: 100,
                bytes_out: 2000,
                frames_in: 5,
                frames_out: 5,
                bad_frames: 1,
                dropped: 0,
            },
            kernel: None,
            tracer: protocol::TracerReport::default(),
            guard: protocol::GuardReport::default(),
        }
    }

    #[test]
    fn text_sorts_exits() {
        let s = status_text(&Status {
            report: report(),
            round_trip: Duration::from_micros(23_400),
        });
        let timer = s.find("PREEMPTION_TIMER").unwrap();
        let cpuid = s.find("CPUID").unwrap();
        let xsetbv = s.find("XSETBV").unwrap();
        assert!(timer < cpuid && cpuid < xsetbv, "{s}");
        assert!(s.contains("vcpus        1\n"), "{s}");
        assert!(s.contains("6068 in all"), "{s}");
        assert!(s.contains("8.0 MiB used of 30.0 MiB"), "{s}");
        assert!(s.contains("1 bad frames"), "{s}");
        assert!(s.contains("round trip   23.4 ms"), "{s}");
    }

    #[test]
    fn kernel_and_task() {
        let mut r = report();
        r.kernel = Some(protocol::KernelReport {
            release: "6.12.57".into(),
            kaslr_slide: 0x1a00_0000,
            symbols: 30000,
            text_symbols: 20000,
            traceable: 15000,
            index_bytes: 1 << 20,
            recovery_ns: 5_000_000,
            task_layout_error: None,
        });
        r.current_task = Some(protocol::TaskInfo {
            pid: 1,
            comm: "sh".into(),
            cpu: 0,
        });
        let status = Status {
            report: r,
            round_trip: Duration::from_millis(1),
        };
        let s = status_text(&status);
        assert!(
            s.contains("6.12.57, KASLR slide 0x1a000000, 30000 symbols"),
            "{s}"
        );
        assert!(s.contains("sh (pid 1) on cpu 0"), "{s}");
        let j = status_json(&status).render();
        assert!(
            j.contains(r#""kernel":{"release":"6.12.57","kaslr_slide":436207616"#),
            "{j}"
        );
        assert!(
            j.contains(r#""current_task":{"pid":1,"comm":"sh","cpu":0}"#),
            "{j}"
        );
    }

    #[test]
    fn json_has_every_field() {
        let j = status_json(&Status {
            report: report(),
            round_trip: Duration::from_millis(12),
        })
        .render();
        for needle in [
            r#""protocol_version":1"#,
            r#""vcpus":1"#,
            r#""exits_total":6068"#,
            r#""exits":[{"name":"PREEMPTION_TIMER","reason":52,"count":5000},"#,
            r#""current_task":null"#,
            r#""kernel":null"#,
            r#""bad_frames":1"#,
            r#""round_trip_ms":12"#,
            r#""guest_state":"running""#,
        ] {
            assert!(j.contains(needle), "{needle} not in {j}");
        }
        assert!(!j.contains('\n'));
    }

    #[test]
    fn tracer_counters_show_when_there_are_any() {
        let quiet = status_text(&Status {
            report: report(),
            round_trip: Duration::from_millis(1),
        });
        assert!(!quiet.contains("tracer"), "{quiet}");
        let j = status_json(&Status {
            report: report(),
            round_trip: Duration::from_millis(1),
        })
        .render();
        assert!(
            j.contains(r#""hits":0"#) && j.contains(r#""trampolines":null"#),
            "{j}"
        );
        let mut r = report();
        r.tracer = protocol::TracerReport {
            probes: 2,
            functions: 40,
            sites: 42,
            pages: 9,
            hits: 12345,
            lost: 6,
            steps: 7,
            guest_writes: 1,
            region_restores: 0,
            foreign_vmcalls: 3,
            blocked_writes: 4,
            trampolines: 0xffff_ffff_c000_0000,
            ..Default::default()
        };
        let status = Status {
            report: r,
            round_trip: Duration::from_millis(1),
        };
        let s = status_text(&status);
        assert!(
            s.contains(
                "tracer       2 probes, 40 functions, 42 sites on 9 pages, 12345 hits, 6 lost\n"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "7 steps, 1 guest writes, 0 region restores, 3 foreign VMCALLs, 0 forged entries, 4 blocked writes\n"
            ),
            "{s}"
        );
        let j = status_json(&status).render();
        assert!(
            j.contains(r#""tracer":{"probes":2,"functions":40,"sites":42,"pages":9,"hits":12345,"lost":6,"steps":7,"guest_writes":1,"region_restores":0,"foreign_vmcalls":3,"forged_entries":0,"blocked_writes":4,"graph_frames":0,"graph_stacks":0,"graph_bytes":0,"graph_misses":0,"graph_dropped":0,"graph_orphans":0,"graph_reaped":0,"graph_sessions":0,"retprobes":0,"trampolines":"0xffffffffc0000000"}"#),
            "{j}"
        );
        // The graph line shows once there is graph state.
        assert!(!s.contains("\ngraph "), "{s}");
        let mut r = status.report.clone();
        r.tracer.graph_sessions = 2;
        r.tracer.retprobes = 1;
        r.tracer.graph_frames = 3;
        r.tracer.graph_stacks = 1;
        r.tracer.graph_bytes = 1280;
        r.tracer.graph_reaped = 30;
        let s = status_text(&Status {
            report: r,
            round_trip: Duration::from_millis(1),
        });
        assert!(
            s.contains("graph        2 sessions, 1 return probes; 3 frames on 1 stacks (1280 B), 0 misses, 0 dropped, 30 reaped, 0 orphan returns\n"),
            "{s}"
        );
    }

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
        // The parser's own rules still hold: no $argN on a return.
        let e = check_probe_spec("r vfs_read $arg1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("only available on entry probes"), "{e}");
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
    fn probe_lines() {
        let p = ProbeInfo {
            name: "kprobes/myopen".into(),
            spec: "p:kprobes/myopen do_sys_openat2 dfd=%di".into(),
            symbol: "do_sys_openat2".into(),
            site: 0xffff_ffff_8123_4564,
            hits: 12,
            misses: 1,
        };
        let text = probe_line(&p, false);
        assert_eq!(
            text,
            format!(
                "  {:<44} {:>15} {:>15}  p:kprobes/myopen do_sys_openat2 dfd=%di",
                "kprobes/myopen", 12, 1
            )
        );
        let json = probe_line(&p, true);
        assert_eq!(
            json,
            r#"{"name":"kprobes/myopen","hits":12,"misses":1,"symbol":"do_sys_openat2","site":"0xffffffff81234564","spec":"p:kprobes/myopen do_sys_openat2 dfd=%di"}"#
        );
        assert_eq!(
            added_line("kprobes/myopen", 0xffff_ffff_8123_4564),
            "added kprobes/myopen at 0xffffffff81234564"
        );
    }

    #[test]
    fn function_summaries() {
        assert_eq!(
            function_summary("vfs_*", 42, &[], 0),
            "function tracer on vfs_*: 42 traced"
        );
        let skipped = ["vfs_a: notrace".to_string(), "vfs_b: no fentry".to_string()];
        assert_eq!(
            function_summary("vfs_*", 40, &skipped, 5),
            "function tracer on vfs_*: 40 traced, 5 skipped (vfs_a: notrace; vfs_b: no fentry; 3 more)"
        );
        assert_eq!(
            function_summary("x", 0, &skipped, 2),
            "function tracer on x: 0 traced, 2 skipped (vfs_a: notrace; vfs_b: no fentry)"
        );
    }

    /// Answers each request with the next canned response, recording the
    /// requests.
    struct Canned {
        answers: std::collections::VecDeque<Result<Response>>,
        seen: Vec<Request>,
    }

    impl Control for Canned {
        fn request(&mut self, request: Request, _timeout: Duration) -> Result<Response> {
            self.seen.push(request);
            self.answers.pop_front().expect("no answer left")
        }
    }

    #[test]
    fn the_reader_follows_the_cursor_and_counts() {
        let mut c = Canned {
            answers: [
                Ok(Response::Trace {
                    next: 2,
                    text: "a\nb\n".into(),
                    lost: 0,
                }),
                Ok(Response::Trace {
                    next: 9,
                    text: "c\n".into(),
                    lost: 4,
                }),
                Ok(Response::error(
                    ErrorKind::NotReady,
                    "the VM has ended (guest stopped: power off)",
                )),
                Err(anyhow::Error::new(SupervisorGone)),
                Ok(Response::error(ErrorKind::Unsupported, "no trace here")),
            ]
            .into(),
            seen: Vec::new(),
        };
        let mut r = TraceReader::new(TraceFormat::Json);
        let first = r.read(&mut c, 10).unwrap().unwrap();
        assert_eq!(first.text, "a\nb\n");
        let second = r.read(&mut c, 10).unwrap().unwrap();
        assert_eq!((second.text.as_str(), second.lost), ("c\n", 4));
        assert_eq!((r.cursor, r.lines, r.lost), (9, 3, 4));
        assert_eq!(
            r.read(&mut c, 10).unwrap(),
            Err(TraceEnd::VmEnded(
                "the VM has ended (guest stopped: power off)".into()
            ))
        );
        assert!(matches!(
            r.read(&mut c, 10).unwrap(),
            Err(TraceEnd::VmEnded(_))
        ));
        let e = r.read(&mut c, 10).unwrap_err().to_string();
        assert_eq!(e, "no trace here");
        assert_eq!(
            c.seen[1],
            Request::TraceRead {
                cursor: 2,
                format: TraceFormat::Json,
                wait_ms: 10,
                source: None,
            }
        );
    }

    #[test]
    fn a_reader_asks_for_its_source() {
        let trace = |next: u64| {
            Ok(Response::Trace {
                next,
                text: String::new(),
                lost: 0,
            })
        };
        let mut c = Canned {
            answers: [trace(5), trace(7), trace(9), trace(9)].into(),
            seen: Vec::new(),
        };
        // From the end of the buffer, then only session 3's lines.
        let mut r = TraceReader::at_end(&mut c, TraceFormat::Text).unwrap();
        assert_eq!((r.cursor, r.source), (5, None));
        r = r.with_source(Some(3));
        r.read(&mut c, 100).unwrap().unwrap();
        r.read(&mut c, 100).unwrap().unwrap();
        assert_eq!(
            c.seen,
            [
                Request::TraceRead {
                    cursor: u64::MAX,
                    format: TraceFormat::Text,
                    wait_ms: 0,
                    source: None,
                },
                Request::TraceRead {
                    cursor: 5,
                    format: TraceFormat::Text,
                    wait_ms: 100,
                    source: Some(3),
                },
                Request::TraceRead {
                    cursor: 7,
                    format: TraceFormat::Text,
                    wait_ms: 100,
                    source: Some(3),
                },
            ]
        );
        // Back to every source.
        let mut r = TraceReader::new(TraceFormat::Json)
            .with_source(Some(0))
            .with_source(None);
        r.read(&mut c, 1).unwrap().unwrap();
        assert!(matches!(
            c.seen.last(),
            Some(Request::TraceRead { source: None, .. })
        ));
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
    }

    #[test]
    fn stop_lines() {
        let text = render_stop(&[
            Event::Log {
                text: "exit counts: CPUID=3 PREEMPTION_TIMER=10".into(),
            },
            Event::Log {
                text: "guest stopped: stopped by the host".into(),
            },
        ]);
        assert!(
            text.starts_with("exits: 13 in all\n  PREEMPTION_TIMER"),
            "{text}"
        );
        assert!(
            text.ends_with("guest stopped: stopped by the host\n"),
            "{text}"
        );
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
