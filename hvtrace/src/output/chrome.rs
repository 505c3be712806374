//! Function-graph JSON lines to a Chrome trace: the Trace Event Format's
//! JSON object form (`{"traceEvents":[...],"displayTimeUnit":"ns"}`), which
//! Perfetto and chrome://tracing load.
//!
//! The input is the hypervisor's JSON trace stream, one object per line.
//! Only `graph_entry` and `graph_return` objects are used:
//!
//! ```text
//! {"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","depth":0}
//! {"ts":"5.000002","ts_ns":5000001500,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":1500,"retval":"0x10"}
//! ```
//!
//! Each entry becomes a `B` (begin) event and each return an `E` (end)
//! event, with `ts` in microseconds (`ts_ns / 1000`, so nanoseconds are the
//! decimals) and `pid` = `tid` = the task's pid; one `M` (`thread_name`)
//! event per task names it with its comm (the last one seen, so a task that
//! `exec`s is named after what it became). Lines of other kinds (kprobe and
//! function tracer events) are counted and left out.
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
//! Linux runs one idle task per CPU, all with pid 0; their events are kept
//! apart as threads of process 0 whose tid is the CPU number.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use crate::output::json::{self, Json};

/// The category of every event written.
const CATEGORY: &str = "graph";

/// Which graph event a line is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Entry,
    Return,
}

/// One graph event, its strings interned.
#[derive(Clone, Debug)]
struct GraphEvent {
    ts_ns: u64,
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
    /// Tasks with at least one call.
    pub tasks: u64,
    /// Returns dropped because no open call matched them.
    pub unmatched_returns: u64,
    /// Open calls closed early, when a call they were inside returned.
    pub closed_early: u64,
    /// Calls still open at the end, closed there.
    pub closed_at_end: u64,
    /// JSON lines of other kinds (kprobe, function), left out.
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
                "{} of other tracers left out",
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
        let kind = match value.get("kind").and_then(Json::as_str) {
            Some("graph_entry") => Kind::Entry,
            Some("graph_return") => Kind::Return,
            _ => {
                self.other_lines += 1;
                return;
            }
        };
        let ts_ns = value.get("ts_ns").and_then(Json::as_u64);
        let pid = value.get("pid").and_then(Json::as_i64);
        let func = value.get("func").and_then(Json::as_str);
        let (Some(ts_ns), Some(pid), Some(func)) = (ts_ns, pid, func) else {
            self.malformed += 1;
            return;
        };
        let cpu = value.get("cpu").and_then(Json::as_u64).unwrap_or(0);
        let comm = value.get("comm").and_then(Json::as_str).unwrap_or("");
        let event = GraphEvent {
            ts_ns,
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

        let mut doc = Document::begin(out)?;
        // The names first: each task's last comm, for the tasks that have
        // a call to show.
        let mut names: BTreeMap<TaskKey, (usize, bool)> = BTreeMap::new();
        for e in &events {
            let name = names.entry(e.task).or_insert((e.comm, false));
            if !self.strings[e.comm].is_empty() {
                name.0 = e.comm;
            }
            name.1 |= e.kind == Kind::Entry;
        }
        for (task, (comm, has_calls)) in &names {
            if !has_calls {
                continue;
            }
            summary.tasks += 1;
            let comm = &self.strings[*comm];
            let name = if comm.is_empty() {
                format!("pid {}", task.pid)
            } else {
                comm.clone()
            };
            doc.event(&json::object([
                ("name", json::str("thread_name")),
                ("ph", json::str("M")),
                ("pid", json::int(task.pid)),
                ("tid", json::int(task.tid())),
                ("args", json::object([("name", Json::String(name))])),
            ]))?;
        }

        let mut tasks: BTreeMap<TaskKey, TaskState> = BTreeMap::new();
        for e in events {
            let task = tasks.entry(e.task).or_default();
            task.last_ts = task.last_ts.max(e.ts_ns);
            let ts = task.last_ts;
            let func = &self.strings[e.func];
            match e.kind {
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
        doc.end()?;
        Ok(summary)
    }
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
            if ph == "M" {
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
            .filter(|e| e["ph"] == "M")
            .map(|e| {
                assert_eq!(e["name"], "thread_name");
                assert_eq!(e["pid"], e["tid"]);
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
        // A task with returns only gets no name.
        let (text, summary) = convert(&ret(5, 8, "x", "f", 0, 1));
        let doc = parse(&text);
        assert!(events(&doc).is_empty(), "{text}");
        assert_eq!(summary.tasks, 0);
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
            .map(|e| (e["tid"].as_i64().unwrap(), e["args"]["name"].clone()))
            .collect();
        assert_eq!(names, [(0, "swapper/0".into()), (1, "swapper/1".into())]);
    }

    #[test]
    fn other_lines_are_left_out_and_counted() {
        let lines = [
            r#"{"ts":"1.000000","ts_ns":1000000000,"cpu":0,"pid":1,"comm":"sh","kind":"kprobe","event":"kprobes/p_vfs_read_0"}"#.to_string(),
            r#"{"ts":"1.000000","ts_ns":1000000000,"cpu":0,"pid":1,"comm":"sh","kind":"function","func":"vfs_read","parent":"ksys_read"}"#.to_string(),
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
            "chrome trace: 1 call in 1 task; 2 lines of other tracers left out; 3 lines unreadable"
        );
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
