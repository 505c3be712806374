//! Rendering of the control answers for people and programs: the status
//! report as text and JSON, symbol, probe and function-tracer lines, and
//! the hypervisor's last lines at a stop.

use std::time::Duration;

use protocol::{Event, GuestState, ProbeInfo, StatusReport};

use crate::output::json::{self, Json};
use crate::term;
use crate::vm::hvlog::{self, HvEvent};

/// A status report and how long it took to get.
#[derive(Clone, Debug)]
pub struct Status {
    /// The hypervisor's report.
    pub report: StatusReport,
    /// The request's round trip, client to hypervisor and back.
    pub round_trip: Duration,
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
            "{} used of {} (heap: {} KiB in use)",
            mib(r.hv_memory_used),
            mib(r.hv_memory_total),
            r.hv_heap_used >> 10
        ),
    );
    let stacks: Vec<String> = r
        .per_vcpu
        .iter()
        .filter(|c| c.root_stack_size != 0)
        .map(|c| {
            format!(
                "vCPU {} {} of {} KiB",
                c.index,
                c.root_stack_used.div_ceil(1024),
                c.root_stack_size >> 10
            )
        })
        .collect();
    if !stacks.is_empty() {
        line("root stack", format!("{} (deepest use)", stacks.join(", ")));
    }
    let nested: Vec<String> = r
        .per_vcpu
        .iter()
        .map(|c| {
            format!(
                "vCPU {} {} unshadowed VMCS accesses, {} INVEPT",
                c.index, c.vmcs_unshadowed, c.invept
            )
        })
        .collect();
    if !nested.is_empty() {
        // What nested KVM would add to the exits below: each is an exit
        // to it.
        line("nested cost", nested.join(", "));
    }
    let root: Vec<String> = r
        .per_vcpu
        .iter()
        .filter_map(|c| {
            let kinds = [
                ("hits", &c.root_hit),
                ("returns", &c.root_return),
                ("refused", &c.root_refused),
                ("turns", &c.root_turns),
            ];
            let parts: Vec<String> = kinds
                .iter()
                .filter(|(_, t)| t.count != 0)
                .map(|(what, t)| format!("{what} {}", root_time_text(t)))
                .collect();
            (!parts.is_empty()).then(|| format!("vCPU {} {}", c.index, parts.join(", ")))
        })
        .collect();
    if !root.is_empty() {
        // Root's own time per hypercall (exit to next entry, turns apart)
        // and per turn.
        line("root time", root.join("; "));
    }
    line("exits", format!("{} in all", r.exits_total));
    if r.per_vcpu.len() > 1 {
        for c in &r.per_vcpu {
            out.push_str(&format!(
                "  vCPU {} (APIC ID {}): {}, {} exits, {} hits, {} returns, {} refused; waited {} us for the VM lock over {} takes and {} us for its shared side over {} hypercalls, held {} us for patching, {} trace records lost\n",
                c.index,
                c.apic_id,
                if c.parked { "parked" } else { "running" },
                c.exits_total,
                c.hits,
                c.returns,
                c.refused,
                c.lock_wait_ns / 1000,
                c.lock_takes,
                c.shared_wait_ns / 1000,
                c.shared_takes,
                c.held_ns / 1000,
                c.lost
            ));
        }
    }
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
        if t.switch_hook || t.quiet_pages != 0 || r.per_vcpu.iter().any(|c| c.view_switches != 0) {
            out.push_str(&format!(
                "{:<12} {} pages quiet (hooked only inside a graph root), {} partly, scheduler hook {}{}\n",
                "views",
                t.quiet_pages,
                t.quiet_partial,
                if t.switch_hook { "in" } else { "out" },
                if t.quiet_busy != 0 {
                    format!(", {} page changes put off", t.quiet_busy)
                } else {
                    String::new()
                }
            ));
            for g in &r.graph_sessions {
                out.push_str(&format!(
                    "{:<12} graph session {}: {} functions hooked, {} left unhooked outside its {}\n",
                    "",
                    g.session,
                    g.hooked,
                    g.quiet,
                    match g.roots {
                        0 => "tasks".to_string(),
                        1 => "root".to_string(),
                        n => format!("{n} roots"),
                    }
                ));
            }
            for c in &r.per_vcpu {
                out.push_str(&format!(
                    "{:<12} vCPU {}: on the {} view, {} switches, armed {} ms, quiet {} ms\n",
                    "",
                    c.index,
                    if c.quiet { "quiet" } else { "armed" },
                    c.view_switches,
                    c.armed_ns / 1_000_000,
                    c.quiet_ns / 1_000_000
                ));
            }
        }
        if t.graph_sessions != 0
            || t.retprobes != 0
            || t.graph_stacks + t.graph_misses + t.graph_dropped + t.graph_orphans + t.graph_reaped
                != 0
        {
            out.push_str(&format!(
                "{:<12} {} sessions, {} return probes; {} frames on {} stacks ({} B), {} misses, {} dropped, {} reaped, {} orphan returns, {} waits for the stacks' lock\n",
                "graph",
                t.graph_sessions,
                t.retprobes,
                t.graph_frames,
                t.graph_stacks,
                t.graph_bytes,
                t.graph_misses,
                t.graph_dropped,
                t.graph_reaped,
                t.graph_orphans,
                t.stack_lock_waits
            ));
        }
        if t.module_hooks > 0
            || t.module_loads > 0
            || t.module_unloads > 0
            || t.pending_probes > 0
            || t.module_globs > 0
        {
            out.push_str(&format!(
                "{:<12} {} hidden hooks; {} loads ({} probes armed, {} functions hooked for {} module globs), {} init texts freed ({} sites unhooked), {} unloads ({} sites unhooked); {} probes pending\n",
                "modules",
                t.module_hooks,
                t.module_loads,
                t.module_armed,
                t.module_followed,
                t.module_globs,
                t.module_inits_freed,
                t.module_init_unhooked,
                t.module_unloads,
                t.module_unhooked,
                t.pending_probes
            ));
        }
    }
    let c = &r.channel;
    out.push_str(&format!(
        "{:<12} in {} B ({} frames), out {} B ({} frames), {} bad frames, {} dropped\n",
        "channel", c.bytes_in, c.frames_in, c.bytes_out, c.frames_out, c.bad_frames, c.dropped
    ));
    if c.bulk_frames > 0 {
        out.push_str(&format!(
            "{:<12} {} trace frames ({} B) on the log port\n",
            "", c.bulk_frames, c.bulk_bytes
        ));
    }
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
            json::object([
                ("name", json::str(name)),
                ("reason", json::int(reason)),
                ("count", json::int(count)),
            ])
        })
        .collect();
    let task = match &r.current_task {
        Some(t) => json::object([
            ("pid", json::int(t.pid)),
            ("comm", json::str(t.comm.clone())),
            ("cpu", json::int(t.cpu)),
        ]),
        None => Json::Null,
    };
    let kernel = match &r.kernel {
        Some(k) => json::object([
            ("release", json::str(k.release.clone())),
            ("kaslr_slide", json::int(k.kaslr_slide)),
            ("symbols", json::int(k.symbols)),
            ("text_symbols", json::int(k.text_symbols)),
            ("traceable", json::int(k.traceable)),
            ("index_bytes", json::int(k.index_bytes)),
            ("recovery_ns", json::int(k.recovery_ns)),
            (
                "task_layout_error",
                match &k.task_layout_error {
                    Some(e) => json::str(e.clone()),
                    None => Json::Null,
                },
            ),
        ]),
        None => Json::Null,
    };
    let c = &r.channel;
    let t = &r.tracer;
    let tracer = json::object([
        ("probes", json::int(t.probes)),
        ("functions", json::int(t.functions)),
        ("sites", json::int(t.sites)),
        ("pages", json::int(t.pages)),
        ("hits", json::int(t.hits)),
        ("lost", json::int(t.lost)),
        ("steps", json::int(t.steps)),
        ("guest_writes", json::int(t.guest_writes)),
        ("region_restores", json::int(t.region_restores)),
        ("foreign_vmcalls", json::int(t.foreign_vmcalls)),
        ("forged_entries", json::int(t.forged_entries)),
        ("blocked_writes", json::int(t.blocked_writes)),
        ("graph_frames", json::int(t.graph_frames)),
        ("graph_stacks", json::int(t.graph_stacks)),
        ("graph_bytes", json::int(t.graph_bytes)),
        ("graph_misses", json::int(t.graph_misses)),
        ("graph_dropped", json::int(t.graph_dropped)),
        ("graph_orphans", json::int(t.graph_orphans)),
        ("graph_reaped", json::int(t.graph_reaped)),
        ("graph_sessions", json::int(u64::from(t.graph_sessions))),
        ("retprobes", json::int(u64::from(t.retprobes))),
        ("stack_lock_waits", json::int(t.stack_lock_waits)),
        ("module_hooks", json::int(u64::from(t.module_hooks))),
        ("module_loads", json::int(t.module_loads)),
        ("module_unloads", json::int(t.module_unloads)),
        ("module_armed", json::int(t.module_armed)),
        ("module_unhooked", json::int(t.module_unhooked)),
        ("pending_probes", json::int(u64::from(t.pending_probes))),
        ("module_globs", json::int(u64::from(t.module_globs))),
        ("module_followed", json::int(t.module_followed)),
        ("module_inits_freed", json::int(t.module_inits_freed)),
        ("module_init_unhooked", json::int(t.module_init_unhooked)),
        ("quiet_pages", json::int(u64::from(t.quiet_pages))),
        ("quiet_partial", json::int(u64::from(t.quiet_partial))),
        ("switch_hook", Json::Bool(t.switch_hook)),
        ("quiet_busy", json::int(t.quiet_busy)),
        (
            "trampolines",
            match t.trampolines {
                0 => Json::Null,
                addr => Json::String(format!("{addr:#x}")),
            },
        ),
    ]);
    json::object([
        (
            "hypervisor_version",
            json::str(r.hypervisor_version.clone()),
        ),
        ("protocol_version", json::int(r.protocol_version)),
        ("vcpus", json::int(r.vcpus)),
        ("uptime_ns", json::int(r.uptime_ns)),
        ("guest_state", json::str(guest_state_name(r.guest_state))),
        ("kernel", kernel),
        ("current_task", task),
        ("exits_total", json::int(r.exits_total)),
        (
            "per_vcpu",
            Json::Array(
                r.per_vcpu
                    .iter()
                    .map(|c| {
                        json::object([
                            ("index", json::int(c.index)),
                            ("apic_id", json::int(c.apic_id)),
                            ("parked", Json::Bool(c.parked)),
                            ("exits_total", json::int(c.exits_total)),
                            ("lock_wait_ns", json::int(c.lock_wait_ns)),
                            ("lock_takes", json::int(c.lock_takes)),
                            ("shared_wait_ns", json::int(c.shared_wait_ns)),
                            ("shared_takes", json::int(c.shared_takes)),
                            ("held_ns", json::int(c.held_ns)),
                            ("lost", json::int(c.lost)),
                            ("vmcalls", json::int(c.vmcalls)),
                            ("hits", json::int(c.hits)),
                            ("returns", json::int(c.returns)),
                            ("refused", json::int(c.refused)),
                            ("view_switches", json::int(c.view_switches)),
                            ("armed_ns", json::int(c.armed_ns)),
                            ("quiet_ns", json::int(c.quiet_ns)),
                            ("quiet", Json::Bool(c.quiet)),
                            ("root_stack_used", json::int(c.root_stack_used)),
                            ("root_stack_size", json::int(c.root_stack_size)),
                            ("vmcs_unshadowed", json::int(c.vmcs_unshadowed)),
                            ("invept", json::int(c.invept)),
                            ("root_hit", root_time_json(&c.root_hit)),
                            ("root_return", root_time_json(&c.root_return)),
                            ("root_refused", root_time_json(&c.root_refused)),
                            ("root_turns", root_time_json(&c.root_turns)),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("exits", Json::Array(exits)),
        (
            "graph_sessions",
            Json::Array(
                r.graph_sessions
                    .iter()
                    .map(|g| {
                        json::object([
                            ("session", json::int(g.session)),
                            ("hooked", json::int(g.hooked)),
                            ("roots", json::int(g.roots)),
                            ("quiet", json::int(g.quiet)),
                        ])
                    })
                    .collect(),
            ),
        ),
        ("hv_memory_used", json::int(r.hv_memory_used)),
        ("hv_memory_total", json::int(r.hv_memory_total)),
        ("hv_heap_used", json::int(r.hv_heap_used)),
        (
            "channel",
            json::object([
                ("bytes_in", json::int(c.bytes_in)),
                ("bytes_out", json::int(c.bytes_out)),
                ("frames_in", json::int(c.frames_in)),
                ("frames_out", json::int(c.frames_out)),
                ("bad_frames", json::int(c.bad_frames)),
                ("dropped", json::int(c.dropped)),
                ("bulk_frames", json::int(c.bulk_frames)),
                ("bulk_bytes", json::int(c.bulk_bytes)),
            ]),
        ),
        ("tracer", tracer),
        (
            "round_trip_ms",
            json::float3(status.round_trip.as_secs_f64() * 1e3),
        ),
    ])
}

/// One symbol as text (`ffffffff81234560 00000150 T vfs_read site=ffffffff81234564`,
/// with ` [module]` after a module symbol's name, as `/proc/kallsyms` puts
/// it) or as a JSON object.
pub fn symbol_line(s: &protocol::SymbolInfo, json: bool) -> String {
    let kind = char::from(s.kind);
    if json {
        let mut fields = vec![
            ("name", Json::String(s.name.clone())),
            ("addr", Json::String(format!("{:#x}", s.addr))),
            ("size", json::int(s.size)),
            ("type", Json::String(kind.to_string())),
            ("traceable", Json::Bool(s.site.is_some())),
        ];
        if !s.module.is_empty() {
            fields.push(("module", Json::String(s.module.clone())));
        }
        match s.site {
            Some(site) => fields.push(("site", Json::String(format!("{site:#x}")))),
            None => fields.push(("not_traceable", Json::String(s.not_traceable.clone()))),
        }
        return json::object(fields).to_string();
    }
    let trace = match s.site {
        Some(site) => format!("site={site:016x}"),
        None => format!("not traceable: {}", s.not_traceable),
    };
    if s.module.is_empty() {
        format!("{:016x} {:08x} {kind} {} {trace}", s.addr, s.size, s.name)
    } else {
        format!(
            "{:016x} {:08x} {kind} {} [{}] {trace}",
            s.addr, s.size, s.name, s.module
        )
    }
}

/// The line that reports an added probe.
pub fn added_line(name: &str, site: u64) -> String {
    if site == 0 {
        // A probe on a module that is not loaded: armed when it loads.
        format!("added {name}, pending until its module loads")
    } else {
        format!("added {name} at {site:#x}")
    }
}

/// One probe as text (`  kprobes/myopen    12    0  p:kprobes/myopen ...`)
/// or as a JSON object.
pub fn probe_line(p: &ProbeInfo, json: bool) -> String {
    if json {
        return json::object([
            ("name", json::str(p.name.clone())),
            ("hits", json::int(p.hits)),
            ("misses", json::int(p.misses)),
            ("symbol", json::str(p.symbol.clone())),
            ("site", Json::String(format!("{:#x}", p.site))),
            ("pending", Json::Bool(p.pending)),
            ("spec", json::str(p.spec.clone())),
        ])
        .to_string();
    }
    let pending = if p.pending {
        "  (pending: its module is not loaded)"
    } else {
        ""
    };
    format!(
        "  {:<44} {:>15} {:>15}  {}{pending}",
        p.name, p.hits, p.misses, p.spec
    )
}

/// How many functions matching `glob` are traced and which were skipped,
/// for the terminal (the symbol names come from the guest: control
/// characters are escaped).
pub fn function_summary(glob: &str, traced: u32, skipped: &[String], skipped_total: u32) -> String {
    let mut line = format!("function tracer on {glob}: {traced} traced");
    if let Some((module, _)) = glob.split_once(':') {
        line.push_str(&format!(
            " now, and the matching functions of modules {module} as they load"
        ));
    }
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

/// `N x mean us (min .. max)` of a [`protocol::RootTime`].
fn root_time_text(t: &protocol::RootTime) -> String {
    let us = |ns: u64| ns as f64 / 1000.0;
    format!(
        "{} x {:.2} us ({:.2} .. {:.2})",
        t.count,
        us(t.sum_ns / t.count.max(1)),
        us(t.min_ns),
        us(t.max_ns)
    )
}

/// A [`protocol::RootTime`] as JSON.
fn root_time_json(t: &protocol::RootTime) -> Json {
    json::object(vec![
        ("count", json::int(t.count)),
        ("sum_ns", json::int(t.sum_ns)),
        ("min_ns", json::int(t.min_ns)),
        ("max_ns", json::int(t.max_ns)),
    ])
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
            hv_heap_used: 512 * 1024,
            current_task: None,
            channel: ChannelReport {
                bytes_in: 100,
                bytes_out: 2000,
                frames_in: 5,
                frames_out: 5,
                bad_frames: 1,
                dropped: 0,
                bulk_frames: 3,
                bulk_bytes: 9000,
            },
            kernel: None,
            tracer: protocol::TracerReport::default(),
            per_vcpu: vec![protocol::VcpuReport {
                index: 0,
                apic_id: 0,
                parked: false,
                exits_total: 7,
                lock_wait_ns: 0,
                held_ns: 0,
                lost: 0,
                vmcalls: 0,
                lock_takes: 7,
                shared_takes: 0,
                shared_wait_ns: 0,
                hits: 0,
                returns: 0,
                refused: 0,
                view_switches: 0,
                armed_ns: 0,
                quiet_ns: 0,
                quiet: false,
                root_stack_used: 0,
                root_stack_size: 0,
                vmcs_unshadowed: 0,
                invept: 0,
                root_hit: protocol::RootTime {
                    count: 4,
                    sum_ns: 100_000,
                    min_ns: 20_000,
                    max_ns: 40_000,
                },
                root_return: protocol::RootTime::default(),
                root_refused: protocol::RootTime::default(),
                root_turns: protocol::RootTime::default(),
            }],
            graph_sessions: Vec::new(),
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
        assert!(
            s.contains("8.0 MiB used of 30.0 MiB (heap: 512 KiB in use)"),
            "{s}"
        );
        assert!(s.contains("1 bad frames"), "{s}");
        assert!(s.contains("round trip   23.4 ms"), "{s}");
        assert!(!s.contains("root stack"), "{s}");
        let mut r = report();
        r.per_vcpu[0].root_stack_used = 40_000;
        r.per_vcpu[0].root_stack_size = 512 << 10;
        let s = status_text(&Status {
            report: r,
            round_trip: Duration::from_micros(23_400),
        });
        assert!(s.contains("vCPU 0 40 of 512 KiB (deepest use)"), "{s}");
        assert!(
            s.contains("root time    vCPU 0 hits 4 x 25.00 us (20.00 .. 40.00)\n"),
            "{s}"
        );
        let j = status_json(&Status {
            report: report(),
            round_trip: Duration::from_micros(1),
        })
        .to_string();
        assert!(
            j.contains(r#""root_hit":{"count":4,"sum_ns":100000,"min_ns":20000,"max_ns":40000}"#),
            "{j}"
        );
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
            modules: Default::default(),
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
        let j = status_json(&status).to_string();
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
        .to_string();
        for needle in [
            r#""protocol_version":1"#,
            r#""vcpus":1"#,
            r#""exits_total":6068"#,
            r#""exits":[{"name":"PREEMPTION_TIMER","reason":52,"count":5000},"#,
            r#""current_task":null"#,
            r#""kernel":null"#,
            r#""bad_frames":1"#,
            r#""bulk_frames":3,"bulk_bytes":9000"#,
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
        .to_string();
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
        let j = status_json(&status).to_string();
        assert!(
            j.contains(r#""tracer":{"probes":2,"functions":40,"sites":42,"pages":9,"hits":12345,"lost":6,"steps":7,"guest_writes":1,"region_restores":0,"foreign_vmcalls":3,"forged_entries":0,"blocked_writes":4,"graph_frames":0,"graph_stacks":0,"graph_bytes":0,"graph_misses":0,"graph_dropped":0,"graph_orphans":0,"graph_reaped":0,"graph_sessions":0,"retprobes":0,"stack_lock_waits":0,"module_hooks":0,"module_loads":0,"module_unloads":0,"module_armed":0,"module_unhooked":0,"pending_probes":0,"module_globs":0,"module_followed":0,"module_inits_freed":0,"module_init_unhooked":0,"quiet_pages":0,"quiet_partial":0,"switch_hook":false,"quiet_busy":0,"trampolines":"0xffffffffc0000000"}"#),
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
        r.tracer.stack_lock_waits = 5;
        let s = status_text(&Status {
            report: r,
            round_trip: Duration::from_millis(1),
        });
        assert!(
            s.contains("graph        2 sessions, 1 return probes; 3 frames on 1 stacks (1280 B), 0 misses, 0 dropped, 30 reaped, 0 orphan returns, 5 waits for the stacks' lock\n"),
            "{s}"
        );
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
            pending: false,
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
            r#"{"name":"kprobes/myopen","hits":12,"misses":1,"symbol":"do_sys_openat2","site":"0xffffffff81234564","pending":false,"spec":"p:kprobes/myopen do_sys_openat2 dfd=%di"}"#
        );
        let pending = ProbeInfo {
            site: 0,
            pending: true,
            spec: "p:kprobes/modsum hvtarget:hvtarget_sum".into(),
            ..p.clone()
        };
        assert!(probe_line(&pending, false).ends_with(
            "p:kprobes/modsum hvtarget:hvtarget_sum  (pending: its module is not loaded)"
        ));
        assert_eq!(
            added_line("kprobes/myopen", 0xffff_ffff_8123_4564),
            "added kprobes/myopen at 0xffffffff81234564"
        );
        assert_eq!(
            added_line("kprobes/modsum", 0),
            "added kprobes/modsum, pending until its module loads"
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
        assert_eq!(
            function_summary("ext4:ext4_file_*", 0, &[], 0),
            "function tracer on ext4:ext4_file_*: 0 traced now, and the matching functions of modules ext4 as they load"
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
}
