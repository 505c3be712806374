//! The control commands: `status`, `exec` and `stop`, each a client of a
//! running VM's control socket ([`crate::client`]). Each opens its session
//! with `Hello`, which checks that both ends speak this protocol version.
//!
//! New commands (`syms`, `probe add|del|list`, `trace`, `graph`) follow the
//! same shape: connect, hello, one or more calls, render.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use protocol::{Event, GuestState, Request, Response, StatusReport};

use crate::cli::{ExecArgs, StatusArgs, StopArgs, SymsArgs};
use crate::client::{response_error, Client};
use crate::hvlog::{self, HvEvent};
use crate::json::Json;

/// How long a status report may take (the hypervisor answers within
/// [`crate::link::DEFAULT_TIMEOUT`], or the supervisor says why not).
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a guest command may take, a little past the supervisor's own
/// limit so that its error arrives first.
pub const EXEC_TIMEOUT: Duration =
    Duration::from_secs(crate::supervisor::EXEC_TIMEOUT.as_secs() + 30);
/// How long a stop may take.
pub const STOP_TIMEOUT: Duration =
    Duration::from_secs(crate::supervisor::STOP_TIMEOUT.as_secs() + 30);

/// Connects and opens the session.
pub fn open(socket: &Path) -> Result<Client> {
    let mut client = Client::connect(socket)?;
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
    let text = if args.json {
        status_json(&status).render() + "\n"
    } else {
        status_text(&status)
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
            writeln!(out, "{}", symbol_line(s, args.json))?;
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

/// `hvtrace exec`: prints the command's output; the exit code is its status.
pub fn exec(socket: &Path, args: &ExecArgs) -> Result<u8> {
    let command = args.command.join(" ");
    if command.trim().is_empty() {
        bail!("exec needs a command");
    }
    let mut client = open(socket)?;
    let reply = client.call(Request::Exec { command }, EXEC_TIMEOUT)?;
    match reply.response {
        Response::Exec { output, status } => {
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
    let reply = client.call(Request::Stop, STOP_TIMEOUT)?;
    match reply.response {
        Response::Ok => {}
        other => return Err(response_error(other)),
    }
    let text = render_stop(&reply.events);
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    // The supervisor removes the socket right after it answers; wait for
    // that, so that the next command finds no VM.
    let until = Instant::now() + Duration::from_secs(10);
    while socket.exists() && Instant::now() < until {
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
