//! The trace stream's JSON lines to a Chrome trace: the Trace Event
//! Format's JSON object form (`{"traceEvents":[...],"displayTimeUnit":"ns"}`),
//! which Perfetto and chrome://tracing load. Every event of the stream is
//! kept:
//!
//! - function-graph calls become nested slices: each `graph_entry` a `B`
//!   (begin) event and each `graph_return` an `E` (end) event, with the
//!   return value and duration as the `E`'s args;
//! - probes (`kprobe`, `kretprobe`) and function-tracer hits (`function`)
//!   become thread-scoped instant events (`ph` `i`), with their arguments,
//!   location and parent as args;
//! - task switches (`sched_switch`) become a track per CPU in a process
//!   named `CPUs` (a complete `X` slice per task run, named after the task)
//!   and, for each task, a state track beside its calls (`Running`, or the
//!   state it was switched out in: `S`, `D`, `R` ...) from one switch to
//!   the next; a wakeup (`sched_wakeup`) is an instant on the woken task's
//!   state track, after which it is runnable;
//! - counts and histograms sampled over time ([`Chrome::counter`]) become
//!   counter tracks (`ph` `C`) in a process named `counts`.
//!
//! `ts` is in microseconds (`ts_ns / 1000`, so nanoseconds are the
//! decimals). Each task is a process and a thread of its own (`pid` = `tid`
//! = the task's pid, the stream having no thread group), named with `M`
//! (`process_name`, `thread_name`) events after its comm (the last one
//! seen, so a task that `exec`s is named after what it became).
//!
//! ```text
//! {"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","depth":0}
//! {"ts":"5.000002","ts_ns":5000001500,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":1500,"retval":"0x10"}
//! ```
//!
//! A viewer needs the `B` and `E` events of each thread to nest, which the
//! stream does not promise: it may start inside a call, lose events, or
//! hold frames the hypervisor dropped. So:
//!
//! - events are put in time order first (stably, so that events with the
//!   same timestamp keep their stream order; the stream is ordered per
//!   vCPU, and a task that migrates can have its return drained before its
//!   entry);
//! - a return closes the innermost open call of its task with the same
//!   function (and depth, when both have one). Calls opened inside it that
//!   are still open never returned as far as the trace knows; they are
//!   closed first, at the same time, with `"args":{"unfinished":true}`. A
//!   return that matches no open call (its entry came before the trace
//!   started, or was lost) is dropped;
//! - calls still open at the end are closed at the last timestamp seen for
//!   their task, also marked unfinished;
//! - timestamps never go backwards within a task (an earlier one is raised
//!   to the task's last).
//!
//! The CPU and state tracks are made of complete slices, which never
//! overlap on their track. Linux runs one idle task per CPU, all with pid
//! 0; their events are kept apart as threads of process 0 whose tid is the
//! CPU number.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use crate::output::json::{self, Json};

/// The category of the graph's slices.
const CATEGORY: &str = "graph";

/// The process of the CPU tracks (no task has this pid: the kernel's
/// largest is 2^22).
const CPUS_PID: i64 = 0x7fff_fff0;

/// The process of the counter tracks.
const COUNTS_PID: i64 = 0x7fff_fff1;

/// Added to a task's tid for its state track.
const STATE_TID: i64 = 1 << 32;

/// Which event a line is.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Entry,
    Return,
    /// A probe or function-tracer hit: its category and args.
    Instant(&'static str, Json),
    /// A task switch on a CPU.
    Switch(Switched),
    /// A task woken, with its comm and CPU.
    Wakeup(TaskKey, usize, i64),
}

/// A task switch: the tasks and the state the outgoing one left in.
#[derive(Clone, Debug, PartialEq)]
struct Switched {
    prev: TaskKey,
    prev_comm: usize,
    prev_state: String,
    next: TaskKey,
    next_comm: usize,
}

/// One event, its strings interned.
#[derive(Clone, Debug)]
struct GraphEvent {
    ts_ns: u64,
    cpu: u64,
    task: TaskKey,
    comm: usize,
    kind: Kind,
    func: usize,
    depth: Option<u64>,
    duration_ns: Option<u64>,
    retval: Option<Json>,
}

/// A task: its pid, and for the idle tasks (pid 0) the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct TaskKey {
    pid: i64,
    cpu: u64,
}

impl TaskKey {
    fn new(pid: i64, cpu: u64) -> TaskKey {
        TaskKey {
            pid,
            cpu: if pid == 0 { cpu } else { 0 },
        }
    }

    /// The Chrome thread id.
    fn tid(self) -> i64 {
        if self.pid == 0 {
            i64::try_from(self.cpu).unwrap_or(i64::MAX)
        } else {
            self.pid
        }
    }
}

/// What a conversion came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChromeSummary {
    /// Calls written (`B` events).
    pub calls: u64,
    /// Tasks with at least one event.
    pub tasks: u64,
    /// Probe and function-tracer hits written (instant events).
    pub instants: u64,
    /// Task switches.
    pub switches: u64,
    /// Wakeups.
    pub wakeups: u64,
    /// Counter samples.
    pub counters: u64,
    /// Returns dropped because no open call matched them.
    pub unmatched_returns: u64,
    /// Open calls closed early, when a call they were inside returned.
    pub closed_early: u64,
    /// Calls still open at the end, closed there.
    pub closed_at_end: u64,
    /// JSON lines of kinds with no event here, left out.
    pub other_lines: u64,
    /// Lines that are not JSON objects, or graph events without the
    /// fields needed.
    pub malformed: u64,
}

impl ChromeSummary {
    /// One line for people: `chrome trace: 120 calls in 3 tasks; ...`.
    pub fn line(&self) -> String {
        let plural = |n: u64, word: &str| {
            if n == 1 {
                format!("{n} {word}")
            } else {
                format!("{n} {word}s")
            }
        };
        let mut line = format!(
            "chrome trace: {} in {}",
            plural(self.calls, "call"),
            plural(self.tasks, "task")
        );
        if self.instants > 0 {
            line.push_str(&format!(
                ", {}",
                plural(self.instants, "probe or function hit")
            ));
        }
        if self.switches > 0 {
            line.push_str(
                &format!(", {}", plural(self.switches, "task switch"))
                    .replace("switchs", "switches"),
            );
        }
        if self.wakeups > 0 {
            line.push_str(&format!(", {}", plural(self.wakeups, "wakeup")));
        }
        if self.counters > 0 {
            line.push_str(&format!(", {}", plural(self.counters, "counter sample")));
        }
        let mut notes = Vec::new();
        if self.unmatched_returns > 0 {
            notes.push(format!(
                "{} without a traced call dropped",
                plural(self.unmatched_returns, "return")
            ));
        }
        let unfinished = self.closed_early + self.closed_at_end;
        if unfinished > 0 {
            notes.push(format!(
                "{} without a return closed",
                plural(unfinished, "call")
            ));
        }
        if self.other_lines > 0 {
            notes.push(format!(
                "{} of other kinds left out",
                plural(self.other_lines, "line")
            ));
        }
        if self.malformed > 0 {
            notes.push(format!("{} unreadable", plural(self.malformed, "line")));
        }
        if !notes.is_empty() {
            line.push_str("; ");
            line.push_str(&notes.join("; "));
        }
        line
    }
}

/// Collects graph events from JSON lines, then writes them as a Chrome
/// trace ([`Chrome::write`]). The events are kept (compactly) until then,
/// because they are put in time order before they are paired.
#[derive(Debug, Default)]
pub struct Chrome {
    events: Vec<GraphEvent>,
    /// Counter samples: time, track name, value.
    counters: Vec<(u64, String, Json)>,
    strings: Vec<String>,
    ids: HashMap<String, usize>,
    other_lines: u64,
    malformed: u64,
    /// The end of a line cut between two `push_text` calls.
    partial: String,
}

impl Chrome {
    /// An empty collector.
    pub fn new() -> Chrome {
        Chrome::default()
    }

    fn intern(&mut self, s: &str) -> usize {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.strings.len();
        self.strings.push(s.to_string());
        self.ids.insert(s.to_string(), id);
        id
    }

    /// Takes text of one or more lines. A last line without its newline is
    /// kept until the next call completes it (or [`Chrome::write`] ends the
    /// input).
    pub fn push_text(&mut self, text: &str) {
        let mut text = text;
        if !self.partial.is_empty() {
            match text.find('\n') {
                Some(nl) => {
                    let mut line = std::mem::take(&mut self.partial);
                    line.push_str(&text[..nl]);
                    self.push_line(&line);
                    text = &text[nl + 1..];
                }
                None => {
                    self.partial.push_str(text);
                    return;
                }
            }
        }
        let mut lines = text.split('\n');
        let last = lines.next_back().unwrap_or("");
        for line in lines {
            self.push_line(line);
        }
        self.partial.push_str(last);
    }

    /// A counter sample: track `name` had `value` at `ts_ns`.
    pub fn counter(&mut self, ts_ns: u64, name: &str, value: Json) {
        self.counters.push((ts_ns, name.to_string(), value));
    }

    /// Takes one line (without its newline). Blank lines are skipped.
    pub fn push_line(&mut self, line: &str) {
        let line = line.trim();
        if line.is_empty() {
            return;
        }
        let Ok(value) = json::parse(line) else {
            self.malformed += 1;
            return;
        };
        if !matches!(value, Json::Object(_)) {
            self.malformed += 1;
            return;
        }
        let str_of = |k: &str| value.get(k).and_then(Json::as_str);
        let (kind, name) = match str_of("kind") {
            Some("graph_entry") => (Kind::Entry, str_of("func")),
            Some("graph_return") => (Kind::Return, str_of("func")),
            Some("function") => {
                let args = json::object([
                    ("parent", value.get("parent").cloned().unwrap_or(Json::Null)),
                    ("ip", value.get("ip").cloned().unwrap_or(Json::Null)),
                ]);
                (Kind::Instant("function", args), str_of("func"))
            }
            Some(k @ ("kprobe" | "kretprobe")) => {
                let mut args = match value.get("args") {
                    Some(Json::Object(m)) => m.clone(),
                    _ => serde_json::Map::new(),
                };
                for key in ["probe", "ip", "ret_ip"] {
                    if let Some(v) = value.get(key) {
                        args.insert(key.to_string(), v.clone());
                    }
                }
                let cat = if k == "kprobe" { "kprobe" } else { "kretprobe" };
                (Kind::Instant(cat, Json::Object(args)), str_of("event"))
            }
            Some("sched_switch") => {
                let cpu = value.get("cpu").and_then(Json::as_u64).unwrap_or(0);
                let pid_of = |k: &str| value.get(k).and_then(Json::as_i64);
                let (Some(prev), Some(next)) = (pid_of("prev_pid"), pid_of("next_pid")) else {
                    self.malformed += 1;
                    return;
                };
                let prev_comm = self.intern(str_of("prev_comm").unwrap_or(""));
                let next_comm = self.intern(str_of("next_comm").unwrap_or(""));
                let switched = Switched {
                    prev: TaskKey::new(prev, cpu),
                    prev_comm,
                    prev_state: str_of("prev_state").unwrap_or("?").to_string(),
                    next: TaskKey::new(next, cpu),
                    next_comm,
                };
                (Kind::Switch(switched), Some("sched_switch"))
            }
            Some("sched_wakeup") => {
                let cpu = value.get("cpu").and_then(Json::as_u64).unwrap_or(0);
                let Some(pid) = value.get("target_pid").and_then(Json::as_i64) else {
                    self.malformed += 1;
                    return;
                };
                let comm = self.intern(str_of("target_comm").unwrap_or(""));
                let target = value.get("target_cpu").and_then(Json::as_i64).unwrap_or(-1);
                (
                    Kind::Wakeup(TaskKey::new(pid, cpu), comm, target),
                    Some("sched_wakeup"),
                )
            }
            _ => {
                self.other_lines += 1;
                return;
            }
        };
        let ts_ns = value.get("ts_ns").and_then(Json::as_u64);
        let pid = value.get("pid").and_then(Json::as_i64);
        let (Some(ts_ns), Some(pid), Some(func)) = (ts_ns, pid, name) else {
            self.malformed += 1;
            return;
        };
        let cpu = value.get("cpu").and_then(Json::as_u64).unwrap_or(0);
        let comm = str_of("comm").unwrap_or("");
        let event = GraphEvent {
            ts_ns,
            cpu,
            task: TaskKey::new(pid, cpu),
            comm: self.intern(comm),
            kind,
            func: self.intern(func),
            depth: value.get("depth").and_then(Json::as_u64),
            duration_ns: value.get("duration_ns").and_then(Json::as_u64),
            retval: value.get("retval").cloned(),
        };
        self.events.push(event);
    }

    /// Writes the Chrome trace document, one event per line, and says what
    /// it holds.
    pub fn write(mut self, out: &mut dyn Write) -> io::Result<ChromeSummary> {
        let partial = std::mem::take(&mut self.partial);
        self.push_line(&partial);
        let mut summary = ChromeSummary {
            other_lines: self.other_lines,
            malformed: self.malformed,
            ..ChromeSummary::default()
        };
        let mut events = std::mem::take(&mut self.events);
        events.sort_by_key(|e| e.ts_ns);
        let end_ns = events.last().map_or(0, |e| e.ts_ns);

        let mut doc = Document::begin(out)?;
        // The names first: each task's last comm (tasks met in switches
        // too), and whether it has a state track.
        let mut names: BTreeMap<TaskKey, (usize, bool)> = BTreeMap::new();
        {
            let strings = &self.strings;
            let mut note = |task: TaskKey, comm: usize, switched: bool| {
                let name = names.entry(task).or_insert((comm, false));
                if !strings[comm].is_empty() {
                    name.0 = comm;
                }
                name.1 |= switched;
            };
            for e in &events {
                match &e.kind {
                    Kind::Switch(sw) => {
                        note(sw.prev, sw.prev_comm, true);
                        note(sw.next, sw.next_comm, true);
                    }
                    Kind::Wakeup(task, comm, _) => {
                        note(e.task, e.comm, false);
                        note(*task, *comm, true);
                    }
                    _ => note(e.task, e.comm, false),
                }
            }
        }
        for (task, (comm, switched)) in &names {
            summary.tasks += 1;
            let comm = &self.strings[*comm];
            let name = if comm.is_empty() {
                format!("pid {}", task.pid)
            } else {
                comm.clone()
            };
            let process = if task.pid == 0 {
                "idle".to_string()
            } else {
                name.clone()
            };
            doc.event(&meta("process_name", task.pid, None, &process))?;
            doc.event(&meta("thread_name", task.pid, Some(task.tid()), &name))?;
            if *switched {
                let state = format!("{name} state");
                doc.event(&meta(
                    "thread_name",
                    task.pid,
                    Some(task.tid().saturating_add(STATE_TID)),
                    &state,
                ))?;
            }
        }
        let cpus: std::collections::BTreeSet<u64> = events
            .iter()
            .filter(|e| matches!(e.kind, Kind::Switch(_)))
            .map(|e| e.cpu)
            .collect();
        if !cpus.is_empty() {
            doc.event(&meta("process_name", CPUS_PID, None, "CPUs"))?;
            for cpu in &cpus {
                let tid = i64::try_from(*cpu).unwrap_or(i64::MAX);
                doc.event(&meta(
                    "thread_name",
                    CPUS_PID,
                    Some(tid),
                    &format!("CPU {cpu}"),
                ))?;
            }
        }

        let mut tasks: BTreeMap<TaskKey, TaskState> = BTreeMap::new();
        // Per CPU: the task running since when; per task: its state since
        // when.
        let mut on_cpu: BTreeMap<u64, (TaskKey, usize, u64)> = BTreeMap::new();
        let mut states: BTreeMap<TaskKey, (String, u64)> = BTreeMap::new();
        for e in events {
            if let Kind::Switch(sw) = &e.kind {
                summary.switches += 1;
                let ts = e.ts_ns;
                if let Some((task, comm, since)) = on_cpu.insert(e.cpu, (sw.next, sw.next_comm, ts))
                {
                    doc.event(&cpu_slice(&self.strings[comm], task, e.cpu, since, ts))?;
                }
                if let Some((state, since)) = states.insert(sw.prev, (sw.prev_state.clone(), ts)) {
                    doc.event(&state_slice(&state, sw.prev, since, ts))?;
                }
                if let Some((state, since)) = states.insert(sw.next, ("Running".into(), ts)) {
                    doc.event(&state_slice(&state, sw.next, since, ts))?;
                }
                continue;
            }
            if let Kind::Wakeup(woken, _, target_cpu) = &e.kind {
                summary.wakeups += 1;
                let ts = e.ts_ns;
                // Asleep until now, runnable from now.
                if let Some((state, since)) = states.get(woken).cloned() {
                    if state != "Running" {
                        doc.event(&state_slice(&state, *woken, since, ts))?;
                        states.insert(*woken, ("R".into(), ts));
                    }
                }
                let by = format!("{}-{}", self.strings[e.comm], e.task.pid);
                doc.event(&json::object([
                    ("name", json::str("wakeup")),
                    ("cat", json::str("sched")),
                    ("ph", json::str("i")),
                    ("s", json::str("t")),
                    ("ts", micros(ts)),
                    ("pid", json::int(woken.pid)),
                    ("tid", json::int(woken.tid().saturating_add(STATE_TID))),
                    (
                        "args",
                        json::object([
                            ("by", json::str(by)),
                            ("target_cpu", json::int(*target_cpu)),
                        ]),
                    ),
                ]))?;
                continue;
            }
            let task = tasks.entry(e.task).or_default();
            task.last_ts = task.last_ts.max(e.ts_ns);
            let ts = task.last_ts;
            let func = &self.strings[e.func];
            match e.kind {
                Kind::Switch(_) | Kind::Wakeup(..) => {}
                Kind::Instant(cat, args) => {
                    summary.instants += 1;
                    doc.event(&json::object([
                        ("name", json::str(func)),
                        ("cat", json::str(cat)),
                        ("ph", json::str("i")),
                        ("s", json::str("t")),
                        ("ts", micros(ts)),
                        ("pid", json::int(e.task.pid)),
                        ("tid", json::int(e.task.tid())),
                        ("args", args),
                    ]))?;
                }
                Kind::Entry => {
                    doc.event(&slice_event(func, "B", ts, e.task, None))?;
                    task.open.push((e.func, e.depth));
                    summary.calls += 1;
                }
                Kind::Return => {
                    let matching = task.open.iter().rposition(|&(f, d)| {
                        f == e.func && (d.is_none() || e.depth.is_none() || d == e.depth)
                    });
                    let Some(at) = matching else {
                        summary.unmatched_returns += 1;
                        continue;
                    };
                    while task.open.len() > at + 1 {
                        let (inner, _) = task.open.pop().unwrap_or_default();
                        let inner = &self.strings[inner];
                        doc.event(&slice_event(inner, "E", ts, e.task, Some(unfinished())))?;
                        summary.closed_early += 1;
                    }
                    task.open.pop();
                    let mut args = Vec::new();
                    if let Some(retval) = e.retval {
                        args.push(("retval", retval));
                    }
                    if let Some(ns) = e.duration_ns {
                        args.push(("duration_ns", json::int(ns)));
                    }
                    let args = (!args.is_empty()).then(|| json::object(args));
                    doc.event(&slice_event(func, "E", ts, e.task, args))?;
                }
            }
        }
        // What runs at the end runs until the last event.
        for (cpu, (task, comm, since)) in on_cpu {
            if end_ns > since {
                doc.event(&cpu_slice(&self.strings[comm], task, cpu, since, end_ns))?;
            }
        }
        for (task, (state, since)) in states {
            if end_ns > since {
                doc.event(&state_slice(&state, task, since, end_ns))?;
            }
        }
        for (key, mut task) in tasks {
            while let Some((func, _)) = task.open.pop() {
                let func = &self.strings[func];
                doc.event(&slice_event(
                    func,
                    "E",
                    task.last_ts,
                    key,
                    Some(unfinished()),
                ))?;
                summary.closed_at_end += 1;
            }
        }
        if !self.counters.is_empty() {
            doc.event(&meta("process_name", COUNTS_PID, None, "counts"))?;
        }
        for (ts, name, value) in std::mem::take(&mut self.counters) {
            summary.counters += 1;
            doc.event(&json::object([
                ("name", json::str(name)),
                ("cat", json::str("count")),
                ("ph", json::str("C")),
                ("ts", micros(ts)),
                ("pid", json::int(COUNTS_PID)),
                ("args", json::object([("value", value)])),
            ]))?;
        }
        doc.end()?;
        Ok(summary)
    }
}

/// A metadata event naming process `pid` or its thread `tid`.
fn meta(what: &str, pid: i64, tid: Option<i64>, name: &str) -> Json {
    let mut fields = vec![
        ("name", json::str(what)),
        ("ph", json::str("M")),
        ("pid", json::int(pid)),
    ];
    if let Some(tid) = tid {
        fields.push(("tid", json::int(tid)));
    }
    fields.push(("args", json::object([("name", json::str(name))])));
    json::object(fields)
}

/// A complete slice of `[from, to)` in nanoseconds.
fn complete(name: &str, cat: &str, pid: i64, tid: i64, from: u64, to: u64, args: Json) -> Json {
    json::object([
        ("name", json::str(name)),
        ("cat", json::str(cat)),
        ("ph", json::str("X")),
        ("ts", micros(from)),
        ("dur", micros(to.saturating_sub(from))),
        ("pid", json::int(pid)),
        ("tid", json::int(tid)),
        ("args", args),
    ])
}

/// `task` running on `cpu` over `[from, to)`, on the CPU's track.
fn cpu_slice(comm: &str, task: TaskKey, cpu: u64, from: u64, to: u64) -> Json {
    let name = if task.pid == 0 {
        "<idle>".to_string()
    } else if comm.is_empty() {
        format!("pid {}", task.pid)
    } else {
        comm.to_string()
    };
    let tid = i64::try_from(cpu).unwrap_or(i64::MAX);
    let args = json::object([("pid", json::int(task.pid))]);
    complete(&name, "sched", CPUS_PID, tid, from, to, args)
}

/// `task` in `state` (a `sched_switch` letter, or `Running`) over
/// `[from, to)`, on its state track.
fn state_slice(state: &str, task: TaskKey, from: u64, to: u64) -> Json {
    let name = match state {
        "Running" => "Running",
        "R" => "Runnable (R)",
        "S" => "Sleeping (S)",
        "D" => "Uninterruptible (D)",
        "I" => "Idle (I)",
        "T" => "Stopped (T)",
        "t" => "Traced (t)",
        "Z" => "Zombie (Z)",
        "X" => "Dead (X)",
        "P" => "Parked (P)",
        other => other,
    };
    let args = json::object(Vec::<(String, Json)>::new());
    complete(
        name,
        "sched",
        task.pid,
        task.tid().saturating_add(STATE_TID),
        from,
        to,
        args,
    )
}

/// A task while the events are paired.
#[derive(Debug, Default)]
struct TaskState {
    /// Open calls, innermost last: function and depth.
    open: Vec<(usize, Option<u64>)>,
    /// The latest timestamp of the task so far.
    last_ts: u64,
}

/// The args of an `E` that closes a call whose return was not seen.
fn unfinished() -> Json {
    json::object([("unfinished", Json::Bool(true))])
}

/// A `B` or `E` event.
fn slice_event(func: &str, phase: &str, ts_ns: u64, task: TaskKey, args: Option<Json>) -> Json {
    let mut fields = vec![
        ("name", json::str(func)),
        ("cat", json::str(CATEGORY)),
        ("ph", json::str(phase)),
        ("ts", micros(ts_ns)),
        ("pid", json::int(task.pid)),
        ("tid", json::int(task.tid())),
    ];
    if let Some(args) = args {
        fields.push(("args", args));
    }
    json::object(fields)
}

/// Nanoseconds as microseconds, the nanoseconds as three decimals.
fn micros(ns: u64) -> Json {
    json::float3(ns as f64 / 1000.0)
}

/// The document being written: the opening, events separated by commas,
/// the closing.
struct Document<'a> {
    out: &'a mut dyn Write,
    first: bool,
}

impl<'a> Document<'a> {
    fn begin(out: &'a mut dyn Write) -> io::Result<Document<'a>> {
        out.write_all(b"{\"traceEvents\":[")?;
        Ok(Document { out, first: true })
    }

    fn event(&mut self, event: &Json) -> io::Result<()> {
        let sep: &[u8] = if self.first { b"\n" } else { b",\n" };
        self.first = false;
        self.out.write_all(sep)?;
        self.out.write_all(event.to_string().as_bytes())
    }

    fn end(self) -> io::Result<()> {
        self.out.write_all(b"\n],\"displayTimeUnit\":\"ns\"}\n")?;
        self.out.flush()
    }
}

/// Converts function-graph JSON lines to a Chrome trace document.
pub fn convert(lines: &str) -> (String, ChromeSummary) {
    let mut chrome = Chrome::new();
    chrome.push_text(lines);
    let mut out = Vec::new();
    // Writing to memory cannot fail.
    let summary = chrome.write(&mut out).unwrap_or_default();
    (String::from_utf8_lossy(&out).into_owned(), summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn entry(ts_ns: u64, pid: i64, comm: &str, func: &str, depth: u64) -> String {
        format!(
            r#"{{"ts":"{}.{:06}","ts_ns":{ts_ns},"cpu":0,"pid":{pid},"comm":"{comm}","kind":"graph_entry","func":"{func}","depth":{depth}}}"#,
            ts_ns / 1_000_000_000,
            ts_ns / 1000 % 1_000_000
        )
    }

    fn ret(ts_ns: u64, pid: i64, comm: &str, func: &str, depth: u64, duration_ns: u64) -> String {
        format!(
            r#"{{"ts":"{}.{:06}","ts_ns":{ts_ns},"cpu":0,"pid":{pid},"comm":"{comm}","kind":"graph_return","func":"{func}","depth":{depth},"duration_ns":{duration_ns},"retval":"0x10"}}"#,
            ts_ns / 1_000_000_000,
            ts_ns / 1000 % 1_000_000
        )
    }

    /// Parses the document as JSON.
    fn parse(doc: &str) -> serde_json::Value {
        serde_json::from_str(doc).expect("the document is not JSON")
    }

    fn events(doc: &serde_json::Value) -> &Vec<serde_json::Value> {
        doc["traceEvents"].as_array().expect("no traceEvents array")
    }

    /// Checks that every thread's B and E events nest (each E closes the
    /// innermost open B of the same name, never earlier than it) and that
    /// nothing is left open; returns each thread's sequence as
    /// `B:name@ts` / `E:name@ts` strings.
    fn balanced(doc: &serde_json::Value) -> BTreeMap<(i64, i64), Vec<String>> {
        let mut open: BTreeMap<(i64, i64), Vec<(String, f64)>> = BTreeMap::new();
        let mut seqs: BTreeMap<(i64, i64), Vec<String>> = BTreeMap::new();
        for e in events(doc) {
            let ph = e["ph"].as_str().unwrap();
            // Names, instants, complete slices and counters do not nest.
            if matches!(ph, "M" | "i" | "X" | "C") {
                continue;
            }
            let key = (e["pid"].as_i64().unwrap(), e["tid"].as_i64().unwrap());
            let name = e["name"].as_str().unwrap().to_string();
            let ts = e["ts"].as_f64().unwrap();
            let stack = open.entry(key).or_default();
            match ph {
                "B" => stack.push((name.clone(), ts)),
                "E" => {
                    let (top, begun) = stack.pop().expect("an E without an open B");
                    assert_eq!(top, name, "E closes another call");
                    assert!(ts >= begun, "{name} ends before it begins");
                }
                other => panic!("unexpected phase {other}"),
            }
            seqs.entry(key)
                .or_default()
                .push(format!("{ph}:{name}@{ts}"));
        }
        for (key, stack) in open {
            assert!(stack.is_empty(), "{key:?} left open: {stack:?}");
        }
        seqs
    }

    fn thread_names(doc: &serde_json::Value) -> BTreeMap<i64, String> {
        events(doc)
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            // The tasks' own threads (not the idle tasks', the CPUs' or
            // the state tracks).
            .filter(|e| e["pid"] == e["tid"])
            .map(|e| {
                (
                    e["tid"].as_i64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn two_interleaved_tasks_nest_per_thread() {
        let lines = [
            entry(1_000, 90, "dd", "vfs_read", 0),
            entry(1_500, 91, "cat", "vfs_read", 0),
            entry(2_000, 90, "dd", "rw_verify_area", 1),
            entry(2_100, 91, "cat", "rw_verify_area", 1),
            ret(2_500, 90, "dd", "rw_verify_area", 1, 500),
            entry(3_000, 90, "dd", "shmem_file_read_iter", 1),
            ret(3_200, 91, "cat", "rw_verify_area", 1, 1_100),
            entry(3_500, 90, "dd", "copy_page_to_iter", 2),
            ret(4_000, 90, "dd", "copy_page_to_iter", 2, 500),
            ret(4_100, 91, "cat", "vfs_read", 0, 2_600),
            ret(4_500, 90, "dd", "shmem_file_read_iter", 1, 1_500),
            ret(5_000_001_234, 90, "dd", "vfs_read", 0, 5_000_000_234),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let doc = parse(&text);
        assert_eq!(doc["displayTimeUnit"], "ns");
        let seqs = balanced(&doc);
        assert_eq!(
            seqs[&(90, 90)],
            [
                "B:vfs_read@1",
                "B:rw_verify_area@2",
                "E:rw_verify_area@2.5",
                "B:shmem_file_read_iter@3",
                "B:copy_page_to_iter@3.5",
                "E:copy_page_to_iter@4",
                "E:shmem_file_read_iter@4.5",
                "E:vfs_read@5000001.234",
            ]
        );
        assert_eq!(
            seqs[&(91, 91)],
            [
                "B:vfs_read@1.5",
                "B:rw_verify_area@2.1",
                "E:rw_verify_area@3.2",
                "E:vfs_read@4.1",
            ]
        );
        assert_eq!(
            thread_names(&doc),
            BTreeMap::from([(90, "dd".to_string()), (91, "cat".to_string())])
        );
        // A return carries its value and duration; the events carry the
        // category and the task.
        let last = events(&doc).last().unwrap();
        assert_eq!(last["args"]["retval"], "0x10");
        assert_eq!(last["args"]["duration_ns"], 5_000_000_234u64);
        assert_eq!(last["cat"], "graph");
        assert_eq!(
            summary,
            ChromeSummary {
                calls: 6,
                tasks: 2,
                ..ChromeSummary::default()
            }
        );
        assert_eq!(summary.line(), "chrome trace: 6 calls in 2 tasks");
    }

    #[test]
    fn a_return_without_its_entry_is_dropped() {
        // The trace began inside vfs_read: its return, and that of the
        // outer ksys_read, have no entry.
        let lines = [
            entry(1_000, 7, "sh", "rw_verify_area", 1),
            ret(1_400, 7, "sh", "rw_verify_area", 1, 400),
            ret(2_000, 7, "sh", "vfs_read", 0, 9_000),
            ret(2_500, 7, "sh", "ksys_read", 0, 9_900),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let doc = parse(&text);
        let seqs = balanced(&doc);
        assert_eq!(
            seqs[&(7, 7)],
            ["B:rw_verify_area@1", "E:rw_verify_area@1.4"]
        );
        assert_eq!(summary.unmatched_returns, 2);
        assert_eq!(summary.calls, 1);
        assert_eq!(
            summary.line(),
            "chrome trace: 1 call in 1 task; 2 returns without a traced call dropped"
        );
        // A task with returns only is named, and has no slice.
        let (text, summary) = convert(&ret(5, 8, "x", "f", 0, 1));
        let doc = parse(&text);
        assert!(events(&doc).iter().all(|e| e["ph"] == "M"), "{text}");
        assert_eq!(thread_names(&doc)[&8], "x");
        assert_eq!(summary.tasks, 1);
    }

    #[test]
    fn unclosed_calls_are_closed_at_the_task_s_last_timestamp() {
        let lines = [
            entry(1_000, 5, "sleeper", "do_nanosleep", 0),
            entry(1_200, 5, "sleeper", "hrtimer_start_range_ns", 1),
            ret(1_300, 5, "sleeper", "hrtimer_start_range_ns", 1, 100),
            entry(1_400, 5, "sleeper", "schedule", 1),
            entry(2_000, 6, "busy", "vfs_read", 0),
            ret(9_000, 6, "busy", "vfs_read", 0, 7_000),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let doc = parse(&text);
        let seqs = balanced(&doc);
        assert_eq!(
            seqs[&(5, 5)],
            [
                "B:do_nanosleep@1",
                "B:hrtimer_start_range_ns@1.2",
                "E:hrtimer_start_range_ns@1.3",
                "B:schedule@1.4",
                "E:schedule@1.4",
                "E:do_nanosleep@1.4",
            ]
        );
        assert_eq!(summary.closed_at_end, 2);
        let closers: Vec<_> = events(&doc)
            .iter()
            .filter(|e| e["args"]["unfinished"] == true)
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(closers, ["schedule", "do_nanosleep"]);
        assert!(summary
            .line()
            .ends_with("; 2 calls without a return closed"));
    }

    #[test]
    fn a_return_past_open_calls_closes_them_first() {
        // rw_verify_area's return was lost; vfs_read's return closes it.
        let lines = [
            entry(1_000, 9, "dd", "vfs_read", 0),
            entry(1_100, 9, "dd", "rw_verify_area", 1),
            ret(3_000, 9, "dd", "vfs_read", 0, 2_000),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let seqs = balanced(&parse(&text));
        assert_eq!(
            seqs[&(9, 9)],
            [
                "B:vfs_read@1",
                "B:rw_verify_area@1.1",
                "E:rw_verify_area@3",
                "E:vfs_read@3",
            ]
        );
        assert_eq!(summary.closed_early, 1);
    }

    #[test]
    fn recursion_and_depths_pair_the_right_frames() {
        let lines = [
            entry(1_000, 3, "kworker", "walk", 0),
            entry(1_100, 3, "kworker", "walk", 1),
            ret(1_200, 3, "kworker", "walk", 1, 100),
            // A return at a depth that no open frame has is not this call's.
            ret(1_250, 3, "kworker", "walk", 4, 10),
            ret(1_300, 3, "kworker", "walk", 0, 300),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let seqs = balanced(&parse(&text));
        assert_eq!(
            seqs[&(3, 3)],
            ["B:walk@1", "B:walk@1.1", "E:walk@1.2", "E:walk@1.3"]
        );
        assert_eq!(summary.unmatched_returns, 1);
    }

    #[test]
    fn events_are_put_in_time_order() {
        // A task moved from CPU 0 to CPU 1; CPU 1's ring was drained first.
        let lines = [
            ret(2_000, 4, "mv", "vfs_write", 0, 1_000).replace(r#""cpu":0"#, r#""cpu":1"#),
            entry(1_000, 4, "mv", "vfs_write", 0),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let seqs = balanced(&parse(&text));
        assert_eq!(seqs[&(4, 4)], ["B:vfs_write@1", "E:vfs_write@2"]);
        assert_eq!(summary.unmatched_returns, 0);
    }

    #[test]
    fn idle_tasks_are_one_thread_per_cpu() {
        let on = |line: String, cpu: u32| line.replace(r#""cpu":0"#, &format!(r#""cpu":{cpu}"#));
        let lines = [
            on(entry(1_000, 0, "swapper/0", "do_idle", 0), 0),
            on(entry(1_100, 0, "swapper/1", "do_idle", 0), 1),
            on(ret(1_500, 0, "swapper/0", "do_idle", 0, 500), 0),
            on(ret(1_600, 0, "swapper/1", "do_idle", 0, 500), 1),
        ]
        .join("\n");
        let (text, _) = convert(&lines);
        let doc = parse(&text);
        let seqs = balanced(&doc);
        assert_eq!(seqs[&(0, 0)], ["B:do_idle@1", "E:do_idle@1.5"]);
        assert_eq!(seqs[&(0, 1)], ["B:do_idle@1.1", "E:do_idle@1.6"]);
        let names: Vec<_> = events(&doc)
            .iter()
            .filter(|e| e["ph"] == "M")
            .map(|e| (e["tid"].as_i64(), e["args"]["name"].clone()))
            .collect();
        assert_eq!(
            names,
            [
                (None, "idle".into()),
                (Some(0), "swapper/0".into()),
                (None, "idle".into()),
                (Some(1), "swapper/1".into())
            ]
        );
    }

    #[test]
    fn other_lines_are_left_out_and_counted() {
        let lines = [
            r#"{"ts":"1.000000","ts_ns":1000000000,"cpu":0,"pid":1,"comm":"sh","kind":"count","calls":3}"#.to_string(),
            r#"{"ts":"1.000000","ts_ns":1000000000,"cpu":0,"pid":1,"comm":"sh","kind":"lost"}"#.to_string(),
            "not json".to_string(),
            "[1,2]".to_string(),
            r#"{"kind":"graph_entry","func":"x"}"#.to_string(),
            String::new(),
            entry(1_000, 1, "sh", "vfs_read", 0),
            // The comm changes with exec; the thread takes the last one.
            ret(2_000, 1, "sh2", "vfs_read", 0, 1_000),
        ]
        .join("\n");
        let (text, summary) = convert(&lines);
        let doc = parse(&text);
        balanced(&doc);
        assert_eq!(summary.other_lines, 2);
        assert_eq!(summary.malformed, 3);
        assert_eq!(thread_names(&doc)[&1], "sh2");
        assert_eq!(
            summary.line(),
            "chrome trace: 1 call in 1 task; 2 lines of other kinds left out; 3 lines unreadable"
        );
    }

    /// Probes, function-tracer hits, task switches and counter samples are
    /// kept: instants on their task's thread, a track per CPU and a state
    /// track per task of complete slices that never overlap, counters.
    #[test]
    fn every_event_is_kept() {
        let switch = |ts: u64, cpu: u32, prev: (i64, &str, &str), next: (i64, &str)| {
            format!(
                r#"{{"ts":"0","ts_ns":{ts},"cpu":{cpu},"pid":{},"comm":"{}","kind":"sched_switch","prev_comm":"{}","prev_pid":{},"prev_prio":120,"prev_state":"{}","next_comm":"{}","next_pid":{},"next_prio":120}}"#,
                prev.0, prev.1, prev.1, prev.0, prev.2, next.1, next.0
            )
        };
        let lines = [
            switch(1_000, 0, (0, "swapper/0", "R"), (90, "dd")),
            entry(1_100, 90, "dd", "vfs_read", 0),
            r#"{"ts":"0","ts_ns":1200,"cpu":0,"pid":90,"comm":"dd","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81300000","probe":"do_sys_openat2+0x0/0x150","args":{"dfd":-100,"filename":"/etc/hostname"}}"#.to_string(),
            r#"{"ts":"0","ts_ns":1300,"cpu":0,"pid":90,"comm":"dd","kind":"function","func":"vfs_open","parent":"path_openat+0x6d/0xf0","ip":"0x1","parent_ip":"0x2"}"#.to_string(),
            switch(1_400, 0, (90, "dd", "D"), (0, "swapper/0")),
            r#"{"ts":"0","ts_ns":1800,"cpu":0,"pid":0,"comm":"swapper/0","kind":"sched_wakeup","target_comm":"dd","target_pid":90,"target_prio":120,"target_cpu":0}"#.to_string(),
            switch(1_900, 0, (0, "swapper/0", "R"), (90, "dd")),
            ret(2_000, 90, "dd", "vfs_read", 0, 900),
            switch(2_500, 1, (0, "swapper/1", "R"), (91, "cat")),
        ]
        .join("\n");
        let mut chrome = Chrome::new();
        chrome.push_text(&lines);
        chrome.counter(1_500, "vfs_read", json::int(3u64));
        chrome.counter(2_500, "vfs_read", json::int(7u64));
        let mut out = Vec::new();
        let summary = chrome.write(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let doc = parse(&text);
        balanced(&doc);
        assert_eq!(
            (
                summary.calls,
                summary.instants,
                summary.switches,
                summary.counters
            ),
            (1, 2, 4, 2)
        );
        assert_eq!(
            summary.line(),
            "chrome trace: 1 call in 4 tasks, 2 probe or function hits, 4 task switches, 1 wakeup, 2 counter samples"
        );
        let of = |ph: &str| -> Vec<&serde_json::Value> {
            events(&doc).iter().filter(|e| e["ph"] == ph).collect()
        };
        let instants = of("i");
        assert_eq!(instants[0]["name"], "myopen");
        assert_eq!(instants[0]["cat"], "kprobe");
        assert_eq!(instants[0]["s"], "t");
        assert_eq!(instants[0]["tid"], 90);
        assert_eq!(instants[0]["args"]["filename"], "/etc/hostname");
        assert_eq!(instants[0]["args"]["dfd"], -100);
        assert_eq!(instants[0]["args"]["probe"], "do_sys_openat2+0x0/0x150");
        assert_eq!(instants[1]["name"], "vfs_open");
        assert_eq!(instants[1]["args"]["parent"], "path_openat+0x6d/0xf0");
        // The CPU tracks: what ran, from switch to switch, until the end.
        let slices: Vec<(i64, i64, String, f64, f64)> = of("X")
            .iter()
            .map(|e| {
                (
                    e["pid"].as_i64().unwrap(),
                    e["tid"].as_i64().unwrap(),
                    e["name"].as_str().unwrap().to_string(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                )
            })
            .collect();
        let cpu0: Vec<_> = slices
            .iter()
            .filter(|s| s.0 == CPUS_PID && s.1 == 0)
            .map(|s| (s.2.as_str(), s.3, s.4))
            .collect();
        assert_eq!(
            cpu0,
            [("dd", 1.0, 0.4), ("<idle>", 1.4, 0.5), ("dd", 1.9, 0.6)]
        );
        // dd's state: running, blocked in D, woken, running again.
        let dd: Vec<_> = slices
            .iter()
            .filter(|s| s.0 == 90 && s.1 == 90 + STATE_TID)
            .map(|s| (s.2.as_str(), s.3, s.4))
            .collect();
        assert_eq!(
            dd,
            [
                ("Running", 1.0, 0.4),
                ("Uninterruptible (D)", 1.4, 0.4),
                ("Runnable (R)", 1.8, 0.1),
                ("Running", 1.9, 0.6)
            ]
        );
        let wakeup = events(&doc).iter().find(|e| e["name"] == "wakeup").unwrap();
        assert_eq!(
            (wakeup["tid"].as_i64(), wakeup["args"]["by"].as_str()),
            (Some(90 + STATE_TID), Some("swapper/0-0"))
        );
        // No two slices of one track overlap.
        let mut tracks: BTreeMap<(i64, i64), Vec<(f64, f64)>> = BTreeMap::new();
        for s in &slices {
            tracks.entry((s.0, s.1)).or_default().push((s.3, s.3 + s.4));
        }
        for spans in tracks.values_mut() {
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert!(
                spans.windows(2).all(|w| w[0].1 <= w[1].0 + 1e-9),
                "{spans:?}"
            );
        }
        let counters = of("C");
        assert_eq!(counters[1]["name"], "vfs_read");
        assert_eq!(counters[1]["args"]["value"], 7);
        assert_eq!(counters[1]["pid"], COUNTS_PID);
        let names = thread_names(&doc);
        assert_eq!((names[&90].as_str(), names[&91].as_str()), ("dd", "cat"));
        assert!(text.contains(
            r#"{"name":"process_name","ph":"M","pid":2147483632,"args":{"name":"CPUs"}}"#
        ));
        assert!(text.contains(r#"{"name":"thread_name","ph":"M","pid":90,"tid":4294967386,"args":{"name":"dd state"}}"#));
    }

    #[test]
    fn empty_input_is_an_empty_trace() {
        let (text, summary) = convert("");
        assert_eq!(text, "{\"traceEvents\":[\n],\"displayTimeUnit\":\"ns\"}\n");
        assert!(events(&parse(&text)).is_empty());
        assert_eq!(summary, ChromeSummary::default());
        assert_eq!(summary.line(), "chrome trace: 0 calls in 0 tasks");
    }

    #[test]
    fn lines_may_arrive_in_pieces() {
        let whole = [
            entry(1_000, 2, "a", "f", 0),
            ret(2_000, 2, "a", "f", 0, 1_000),
        ]
        .join("\n");
        let mut chrome = Chrome::new();
        for piece in whole.as_bytes().chunks(7) {
            chrome.push_text(std::str::from_utf8(piece).unwrap());
        }
        let mut out = Vec::new();
        let summary = chrome.write(&mut out).unwrap();
        assert_eq!(summary.calls, 1);
        assert_eq!(String::from_utf8(out).unwrap(), convert(&whole).0);
    }

    #[test]
    fn timestamps_keep_nanoseconds() {
        let (text, _) = convert(
            &[
                entry(1_234_567_890_123, 2, "a", "f", 0),
                ret(1_234_567_890_124, 2, "a", "f", 0, 1),
            ]
            .join("\n"),
        );
        assert!(text.contains(r#""ts":1234567890.123,"#), "{text}");
        assert!(text.contains(r#""ts":1234567890.124,"#), "{text}");
    }
}
