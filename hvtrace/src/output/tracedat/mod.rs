//! trace.dat (version 6) from the trace stream's JSON lines, for
//! `trace-cmd report` and KernelShark.
//!
//! Each line becomes the kernel's own event for it:
//!
//! | line `kind` | event |
//! |---|---|
//! | `function` | `ftrace/function` (ip, parent_ip) |
//! | `graph_entry` | `ftrace/funcgraph_entry` (func, depth) |
//! | `graph_return` | `ftrace/funcgraph_exit` (func, retval, depth, calltime = the return's time less the duration, rettime) |
//! | `kprobe` | `GROUP/EVENT` with `__probe_ip` and the fetch arguments |
//! | `kretprobe` | `GROUP/EVENT` with `__probe_func`, `__probe_ret_ip` and the arguments |
//! | `sched_switch` | `sched/sched_switch` (the outgoing task's event, as the kernel's) |
//! | `sched_wakeup` | `sched/sched_wakeup` (the waker's event, as the kernel's) |
//!
//! A probe's argument types come from its definition (the probes the VM
//! lists); a probe the list no longer has takes them from its values
//! (numbers as `u64`/`s64`, `0x` strings as `x64`, other strings as
//! strings). Symbols are stored as the strings the stream carries.
//!
//! Events are kept per CPU and put in time order per CPU (stably) when the
//! file is written, so that the pages' deltas never go backwards. A loss
//! the stream reports starts a new page on every CPU with the
//! missed-events flag set (the stream does not say which CPU lost what).
//! The pids and comms seen become the saved cmdlines (the last comm of a
//! pid wins). kallsyms is the guest's listing when the VM gives it; the
//! addresses and names the lines carry otherwise.

pub mod file;
pub mod format;
pub mod page;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use tracelang::kprobe::{IntType, ProbeSpec};

use self::format::{ArgField, EventFormat, FIRST_DYNAMIC_ID};
use self::page::PageWriter;
use crate::output::json::{self, Json};

/// A CPU's events waiting for their pages: the payloads end to end, and
/// per event its time, where its payload starts and how long it is (a
/// length of [`LOST`]: events were lost here).
#[derive(Debug, Default)]
struct CpuEvents {
    data: Vec<u8>,
    index: Vec<(u64, u32, u32)>,
}

/// The length that marks a loss in [`CpuEvents::index`].
const LOST: u32 = u32::MAX;

/// Most bytes of payloads held before the file is written; events past it
/// are counted as dropped (the guest decides how many events come).
pub const MAX_HELD: usize = 1 << 30;

impl CpuEvents {
    fn records(&self) -> u64 {
        self.index.iter().filter(|e| e.2 != LOST).count() as u64
    }

    fn lost(&mut self) {
        self.index.push((0, 0, LOST));
    }
}

/// A probe event's layout.
#[derive(Clone, Debug)]
struct ProbeLayout {
    id: u16,
    is_return: bool,
    args: Vec<(String, ArgField)>,
}

/// What a trace.dat holds, and what was left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceDatSummary {
    /// Events written.
    pub events: u64,
    /// CPUs in the file.
    pub cpus: u32,
    /// Bytes of the file.
    pub bytes: u64,
    /// Losses the stream reported.
    pub lost: u64,
    /// Lines of kinds with no event here, left out.
    pub other_lines: u64,
    /// Lines that are not JSON, or events without their fields.
    pub malformed: u64,
    /// Events dropped: past [`MAX_HELD`] bytes, or too long for a page.
    pub dropped: u64,
    /// String arguments shortened to fit their record in a page.
    pub shortened: u64,
}

impl TraceDatSummary {
    /// One line for people.
    pub fn line(&self) -> String {
        let mut s = format!(
            "trace.dat: {} events on {} CPU{}, {} bytes",
            self.events,
            self.cpus,
            if self.cpus == 1 { "" } else { "s" },
            self.bytes
        );
        if self.lost > 0 {
            s.push_str(&format!("; {} lost", self.lost));
        }
        if self.other_lines > 0 {
            s.push_str(&format!(
                "; {} lines of other kinds left out",
                self.other_lines
            ));
        }
        if self.malformed > 0 {
            s.push_str(&format!("; {} malformed lines", self.malformed));
        }
        if self.dropped > 0 {
            s.push_str(&format!(
                "; {} events dropped (too many or too long)",
                self.dropped
            ));
        }
        if self.shortened > 0 {
            s.push_str(&format!(
                "; {} strings shortened to fit a page",
                self.shortened
            ));
        }
        s
    }
}

/// Builds a trace.dat from JSON lines.
#[derive(Debug, Default)]
pub struct TraceDat {
    /// Probe definitions by `GROUP/EVENT`.
    specs: HashMap<String, ProbeSpec>,
    probes: BTreeMap<(String, String), ProbeLayout>,
    next_id: u16,
    cpus: Vec<CpuEvents>,
    /// Bytes of payloads held.
    held: usize,
    cmdlines: BTreeMap<i32, String>,
    /// Names of the addresses the lines carry (for a kallsyms of our own).
    seen_symbols: BTreeMap<u64, String>,
    used_function: bool,
    used_graph: bool,
    used_sched: bool,
    summary: TraceDatSummary,
    partial: String,
}

impl TraceDat {
    /// A builder that knows the probes `specs` (definitions in
    /// kprobe_events syntax, as the VM lists them; unparsable ones are
    /// skipped).
    pub fn new<'a>(specs: impl IntoIterator<Item = &'a str>) -> TraceDat {
        let mut t = TraceDat {
            next_id: FIRST_DYNAMIC_ID,
            ..TraceDat::default()
        };
        t.add_specs(specs);
        t
    }

    /// Learns more probe definitions (a probe's first event fixes its
    /// layout: definitions learnt after it change nothing).
    pub fn add_specs<'a>(&mut self, specs: impl IntoIterator<Item = &'a str>) {
        for text in specs {
            if let Ok(spec) = tracelang::kprobe::parse_probe(text) {
                self.specs
                    .insert(format!("{}/{}", spec.group, spec.event), spec);
            }
        }
    }

    /// Makes room for `n` CPUs at least (a CPU with no event still gets
    /// its (empty) buffer in the file).
    pub fn cpus_at_least(&mut self, n: usize) {
        // A CPU first seen after a loss starts with it: the stream does
        // not say whose events were lost.
        let lost = self.summary.lost > 0;
        while self.cpus.len() < n {
            let mut c = CpuEvents::default();
            if lost {
                c.lost();
            }
            self.cpus.push(c);
        }
    }

    /// Takes text holding complete lines (a line cut at the end is kept
    /// for the next call).
    pub fn push_text(&mut self, text: &str) {
        let mut buf = std::mem::take(&mut self.partial);
        buf.push_str(text);
        let mut rest = buf.as_str();
        while let Some(nl) = rest.find('\n') {
            let line = &rest[..nl];
            rest = &rest[nl + 1..];
            if !line.trim().is_empty() {
                self.push_line(line);
            }
        }
        self.partial = rest.to_string();
    }

    /// Marks `count` events lost here, on every CPU.
    pub fn lost(&mut self, count: u64) {
        if count == 0 {
            return;
        }
        self.summary.lost += count;
        for cpu in &mut self.cpus {
            cpu.lost();
        }
    }

    /// Takes one JSON line.
    pub fn push_line(&mut self, line: &str) {
        let Ok(v) = json::parse(line) else {
            self.summary.malformed += 1;
            return;
        };
        let kind = v.get("kind").and_then(Json::as_str).unwrap_or("");
        let ok = match kind {
            "function" => self.function(&v),
            "graph_entry" | "graph_return" => self.graph(&v, kind == "graph_return"),
            "kprobe" | "kretprobe" => self.probe(&v, kind == "kretprobe"),
            "sched_switch" => self.switch(&v),
            "sched_wakeup" => self.wakeup(&v),
            _ => {
                self.summary.other_lines += 1;
                return;
            }
        };
        if ok.is_none() {
            self.summary.malformed += 1;
        }
    }

    /// The context every line has: time, CPU, pid; the comm is saved.
    fn context(&mut self, v: &Json) -> Option<(u64, usize, i32)> {
        let ts = v.get("ts_ns")?.as_u64()?;
        let cpu = usize::try_from(v.get("cpu")?.as_u64()?).ok()?;
        if cpu >= 4096 {
            return None;
        }
        let pid = i32::try_from(v.get("pid")?.as_i64()?).ok()?;
        if let Some(comm) = v.get("comm").and_then(Json::as_str) {
            if pid != 0 {
                self.cmdlines.insert(pid, plain(comm));
            }
        }
        self.cpus_at_least(cpu + 1);
        Some((ts, cpu, pid))
    }

    fn record(&mut self, cpu: usize, ts: u64, payload: Vec<u8>) {
        if self.held + payload.len() > MAX_HELD || payload.len() > page::MAX_PAYLOAD {
            self.summary.dropped += 1;
            return;
        }
        if let Some(c) = self.cpus.get_mut(cpu) {
            let at = c.data.len() as u32;
            c.data.extend_from_slice(&payload);
            c.index.push((ts, at, payload.len() as u32));
            self.held += payload.len();
        }
    }

    fn function(&mut self, v: &Json) -> Option<()> {
        let ip = hex(v.get("ip")?)?;
        let parent = hex(v.get("parent_ip")?)?;
        let (ts, cpu, pid) = self.context(v)?;
        if let Some(f) = v.get("func").and_then(Json::as_str) {
            self.saw(ip, f);
        }
        if let Some(p) = v.get("parent").and_then(Json::as_str) {
            // `sym+0xOFF/0xSIZE`: the symbol starts OFF before the address.
            if let Some((name, off)) = split_offset(p) {
                self.saw(parent.wrapping_sub(off), name);
            }
        }
        self.used_function = true;
        let mut p = common(format::ID_FUNCTION, pid);
        p.extend_from_slice(&ip.to_le_bytes());
        p.extend_from_slice(&parent.to_le_bytes());
        self.record(cpu, ts, p);
        Some(())
    }

    fn graph(&mut self, v: &Json, is_return: bool) -> Option<()> {
        let func = v.get("func")?.as_str()?.to_string();
        let ip = v.get("ip").and_then(hex).unwrap_or(0);
        let depth = i32::try_from(v.get("depth")?.as_u64()?).ok()?;
        let (ts, cpu, pid) = self.context(v)?;
        if ip != 0 {
            self.saw(ip, &func);
        }
        self.used_graph = true;
        let p = if is_return {
            let duration = v.get("duration_ns")?.as_u64()?;
            let retval = v.get("retval").and_then(hex).unwrap_or(0);
            let mut p = common(format::ID_FUNCGRAPH_EXIT, pid);
            p.extend_from_slice(&ip.to_le_bytes());
            p.extend_from_slice(&retval.to_le_bytes());
            p.extend_from_slice(&depth.to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            p.extend_from_slice(&ts.saturating_sub(duration).to_le_bytes());
            p.extend_from_slice(&ts.to_le_bytes());
            p
        } else {
            let mut p = common(format::ID_FUNCGRAPH_ENTRY, pid);
            p.extend_from_slice(&ip.to_le_bytes());
            p.extend_from_slice(&depth.to_le_bytes());
            p
        };
        self.record(cpu, ts, p);
        Some(())
    }

    fn switch(&mut self, v: &Json) -> Option<()> {
        let str_of = |k: &str| v.get(k).and_then(Json::as_str);
        let int_of = |k: &str| {
            v.get(k)
                .and_then(Json::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        let prev_comm = str_of("prev_comm")?.to_string();
        let next_comm = str_of("next_comm")?.to_string();
        let (prev_pid, next_pid) = (int_of("prev_pid")?, int_of("next_pid")?);
        let (prev_prio, next_prio) = (int_of("prev_prio")?, int_of("next_prio")?);
        let state = tracelang::kprobe::state_of_letter(str_of("prev_state")?)?;
        let (ts, cpu, _) = self.context(v)?;
        if next_pid != 0 {
            self.cmdlines.insert(next_pid, plain(&next_comm));
        }
        self.used_sched = true;
        let mut p = common(format::ID_SCHED_SWITCH, prev_pid);
        p.extend_from_slice(&comm16(&prev_comm));
        p.extend_from_slice(&prev_pid.to_le_bytes());
        p.extend_from_slice(&prev_prio.to_le_bytes());
        p.extend_from_slice(&state.to_le_bytes());
        p.extend_from_slice(&comm16(&next_comm));
        p.extend_from_slice(&next_pid.to_le_bytes());
        p.extend_from_slice(&next_prio.to_le_bytes());
        self.record(cpu, ts, p);
        Some(())
    }

    fn wakeup(&mut self, v: &Json) -> Option<()> {
        let int_of = |k: &str| {
            v.get(k)
                .and_then(Json::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        let comm = v.get("target_comm").and_then(Json::as_str)?.to_string();
        let (pid, prio, target) = (
            int_of("target_pid")?,
            int_of("target_prio")?,
            int_of("target_cpu")?,
        );
        let (ts, cpu, waker) = self.context(v)?;
        if pid != 0 {
            self.cmdlines.insert(pid, plain(&comm));
        }
        let mut p = common(format::ID_SCHED_WAKEUP, waker);
        p.extend_from_slice(&comm16(&comm));
        p.extend_from_slice(&pid.to_le_bytes());
        p.extend_from_slice(&prio.to_le_bytes());
        p.extend_from_slice(&target.to_le_bytes());
        self.record(cpu, ts, p);
        Some(())
    }

    fn probe(&mut self, v: &Json, is_return: bool) -> Option<()> {
        let group = v.get("group")?.as_str()?.to_string();
        let event = v.get("event")?.as_str()?.to_string();
        let ip = hex(v.get("ip")?)?;
        let ret_ip = if is_return { hex(v.get("ret_ip")?)? } else { 0 };
        let empty = serde_json::Map::new();
        let args = v.get("args").and_then(Json::as_object).unwrap_or(&empty);
        if let Some(p) = v.get("probe").and_then(Json::as_str) {
            if let Some((name, off)) = split_offset(p) {
                self.saw(ip.wrapping_sub(off), name);
            }
        }
        let (ts, cpu, pid) = self.context(v)?;
        let layout = self.layout(&group, &event, is_return, args);
        let mut p = common(layout.id, pid);
        p.extend_from_slice(&ip.to_le_bytes());
        if is_return {
            p.extend_from_slice(&ret_ip.to_le_bytes());
        }
        // Strings go after the fixed part; their `__data_loc` says where.
        let mut tail: Vec<u8> = Vec::new();
        let fixed = p.len()
            + layout
                .args
                .iter()
                .map(|(_, f)| match f {
                    ArgField::Int(t) => t.size(),
                    ArgField::Str => 4,
                })
                .sum::<usize>();
        for (name, field) in &layout.args {
            let value = args.get(name.as_str());
            match field {
                ArgField::Int(t) => {
                    let n = value.map_or(0, |v| int_value(*t, v));
                    p.extend_from_slice(&n.to_le_bytes()[..t.size()]);
                }
                ArgField::Str => match value.and_then(Json::as_str) {
                    Some(s) => {
                        // What the page has room for, its NUL included
                        // (the guest chooses its strings' lengths).
                        let room = page::MAX_PAYLOAD.saturating_sub(fixed + tail.len() + 1);
                        let mut cut = s.len().min(room);
                        while !s.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        if cut < s.len() {
                            self.summary.shortened += 1;
                        }
                        let s = &s[..cut];
                        let at = fixed + tail.len();
                        let len = s.len() + 1;
                        let loc = ((len.min(0xffff) as u32) << 16) | (at.min(0xffff) as u32);
                        p.extend_from_slice(&loc.to_le_bytes());
                        tail.extend_from_slice(s.as_bytes());
                        tail.push(0);
                    }
                    // A fault: a string of no length, as the kernel stores it.
                    None => {
                        let loc = (fixed + tail.len()).min(0xffff) as u32;
                        p.extend_from_slice(&loc.to_le_bytes());
                    }
                },
            }
        }
        p.extend_from_slice(&tail);
        self.record(cpu, ts, p);
        Some(())
    }

    /// The layout of probe `group/event`, made on its first event.
    fn layout(
        &mut self,
        group: &str,
        event: &str,
        is_return: bool,
        args: &serde_json::Map<String, Json>,
    ) -> ProbeLayout {
        let key = (group.to_string(), event.to_string());
        if let Some(l) = self.probes.get(&key) {
            return l.clone();
        }
        let fields: Vec<(String, ArgField)> = match self.specs.get(&format!("{group}/{event}")) {
            Some(spec) => spec
                .args
                .iter()
                .map(|a| {
                    let f = if a.btf.is_some() && a.ty == tracelang::kprobe::ArgType::DEFAULT {
                        args.get(&a.name).map_or(ArgField::Int(IntType::X64), infer)
                    } else {
                        ArgField::of(a.ty)
                    };
                    (a.name.clone(), f)
                })
                .collect(),
            None => args.iter().map(|(k, v)| (k.clone(), infer(v))).collect(),
        };
        let layout = ProbeLayout {
            id: self.next_id,
            is_return,
            args: fields,
        };
        self.next_id = self.next_id.saturating_add(1);
        self.probes.insert(key, layout.clone());
        layout
    }

    fn saw(&mut self, addr: u64, name: &str) {
        if addr != 0 && !name.is_empty() && !name.starts_with("0x") {
            self.seen_symbols.entry(addr).or_insert_with(|| plain(name));
        }
    }

    /// The event formats the file needs.
    fn formats(&self) -> Vec<EventFormat> {
        let mut out = vec![format::function()];
        out.push(format::funcgraph_entry());
        out.push(format::funcgraph_exit());
        for ((group, event), l) in &self.probes {
            out.push(format::kprobe(group, event, l.id, l.is_return, &l.args));
        }
        out.push(format::sched_switch(format::ID_SCHED_SWITCH));
        out.push(format::sched_wakeup(format::ID_SCHED_WAKEUP));
        out
    }

    /// A kallsyms text of the addresses the lines named.
    pub fn seen_kallsyms(&self) -> String {
        let mut s = String::new();
        for (addr, name) in &self.seen_symbols {
            s.push_str(&format!("{addr:016x} t {name}\n"));
        }
        s
    }

    /// Events taken so far on each CPU.
    pub fn events_per_cpu(&self) -> Vec<u64> {
        self.cpus.iter().map(CpuEvents::records).collect()
    }

    /// Bytes of the events taken so far (their payloads and headers).
    pub fn payload_bytes(&self) -> u64 {
        self.held as u64 + 4 * self.events()
    }

    /// Losses the stream reported so far.
    pub fn lost_so_far(&self) -> u64 {
        self.summary.lost
    }

    /// Events taken so far.
    pub fn events(&self) -> u64 {
        self.cpus.iter().map(CpuEvents::records).sum()
    }

    /// Writes the file to `out`, with `kallsyms` (the guest's listing;
    /// `None`: the symbols the lines named).
    pub fn write(
        mut self,
        out: &mut dyn Write,
        kallsyms: Option<String>,
    ) -> io::Result<TraceDatSummary> {
        if !self.partial.trim().is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.push_line(&line);
        }
        self.cpus_at_least(1);
        let mut pages = Vec::with_capacity(self.cpus.len());
        let mut events = 0;
        for cpu in std::mem::take(&mut self.cpus) {
            let mut writer = PageWriter::new();
            // Stable: records with one timestamp keep their stream order.
            // A loss keeps its place before the records that follow it.
            for (i, run) in cpu.index.split(|e| e.2 == LOST).enumerate() {
                if i > 0 {
                    writer.lost(None);
                }
                let mut run = run.to_vec();
                run.sort_by_key(|e| e.0);
                for (ts, at, len) in run {
                    let payload = &cpu.data[at as usize..at as usize + len as usize];
                    if !writer.push(ts, payload) {
                        self.summary.dropped += 1;
                    }
                }
            }
            events += writer.events();
            pages.push(writer.finish());
        }
        let header = file::Header {
            formats: self.formats(),
            kallsyms: kallsyms.unwrap_or_else(|| self.seen_kallsyms()),
            cmdlines: std::mem::take(&mut self.cmdlines),
        };
        let bytes = file::write(out, &header, &pages)?;
        self.summary.events = events;
        self.summary.cpus = pages.len() as u32;
        self.summary.bytes = bytes;
        Ok(self.summary)
    }
}

/// The common fields of a record of event `id` for `pid` (no flags, no
/// preempt count: root does not read them).
fn common(id: u16, pid: i32) -> Vec<u8> {
    let mut p = Vec::with_capacity(48);
    p.extend_from_slice(&id.to_le_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(&pid.to_le_bytes());
    p
}

/// A name from the guest as one field of a text line (saved cmdlines,
/// kallsyms): its control characters and spaces, which would start a line
/// or a field of the guest's choosing, become `?`.
fn plain(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_control() || c == ' ' { '?' } else { c })
        .collect()
}

/// A comm as the kernel's `char[16]`: at most 15 bytes and a NUL.
fn comm16(s: &str) -> [u8; 16] {
    let mut c = [0u8; 16];
    for (to, from) in c.iter_mut().take(15).zip(s.bytes()) {
        *to = from;
    }
    c
}

/// A `0x` hex string or a number.
fn hex(v: &Json) -> Option<u64> {
    match v {
        Json::String(s) => u64::from_str_radix(s.strip_prefix("0x")?, 16).ok(),
        Json::Number(n) => n.as_u64().or_else(|| n.as_i64().map(|i| i as u64)),
        _ => None,
    }
}

/// `sym+0xOFF/0xSIZE` as (`sym`, OFF).
fn split_offset(s: &str) -> Option<(&str, u64)> {
    let (name, rest) = s.rsplit_once('+')?;
    let off = rest.split('/').next()?;
    Some((name, u64::from_str_radix(off.strip_prefix("0x")?, 16).ok()?))
}

/// An integer argument's value from its JSON form (a fault is 0).
fn int_value(t: IntType, v: &Json) -> u64 {
    match (t, v) {
        (IntType::Char, Json::String(s)) => u64::from(s.bytes().next().unwrap_or(0)),
        (_, Json::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i as u64))
            .unwrap_or(0),
        (_, v) => hex(v).unwrap_or(0),
    }
}

/// The field of an argument known only by a value.
fn infer(v: &Json) -> ArgField {
    match v {
        Json::Number(n) if n.as_u64().is_some() => ArgField::Int(IntType::U64),
        Json::Number(_) => ArgField::Int(IntType::S64),
        Json::String(s) if s.starts_with("0x") && hex(v).is_some() && s.len() > 2 => {
            ArgField::Int(IntType::X64)
        }
        Json::String(_) => ArgField::Str,
        _ => ArgField::Int(IntType::X64),
    }
}

#[cfg(test)]
mod tests;
