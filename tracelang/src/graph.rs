//! Rendering function-graph events: the kernel's function_graph text form
//! (Documentation/trace/ftrace.rst, "function_graph") and JSON lines.
//!
//! Events come in the order the vCPU produced them: an entry event (one
//! value: the depth) and a return event (depth, duration in ns, return
//! value). The text form needs one event of look-ahead: an entry directly
//! followed by its own return is a leaf, `func();`, with the duration on
//! the same line; otherwise the entry opens `func() {` and the return
//! closes `}` with the duration.
//!
//! ```text
//!  0)               |  vfs_read() {
//!  0)   0.812 us    |    rw_verify_area();
//!  0) + 15.062 us   |  }
//! ```
//!
//! The duration column carries ftrace's markers: `+` over 10 us, `!` over
//! 100 us, `#` over 1 ms, `*` over 10 ms, `@` over 100 ms, `$` over 1 s.
//! A change of task prints ftrace's `=>` separator.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use crate::kprobe::json;
use crate::kprobe::{FetchedValue, RawEvent, SymbolResolver};

/// Width of the duration column between `N)` and `|`.
const DURATION_WIDTH: usize = 15;

/// Which graph event a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphKind {
    /// A traced call began.
    Entry,
    /// It returned.
    Return,
}

/// The probe id a function-graph event carries: its kind, and the session
/// it belongs to, by number (1 to 15; a number is reused after a stop) and
/// generation (4 bits, which tell an old session's events still in the
/// ring from a new one's under the same number).
///
/// ```text
///   31        8 7     4 3      0
///  | kind base | gen   | number |   base: 0xffffff00 entry, 0xfffffe00 return
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphEventId {
    /// Entry or return.
    pub kind: GraphKind,
    /// The session's number (its return-stack user), 0..=15.
    pub number: u8,
    /// The session's generation, 0..=15.
    pub generation: u8,
}

impl GraphEventId {
    /// The id base of entry events.
    pub const ENTRY_BASE: u32 = 0xffff_ff00;
    /// The id base of return events.
    pub const RETURN_BASE: u32 = 0xffff_fe00;
    /// Bits of the number and of the generation.
    const FIELD_MASK: u32 = 0xf;
    /// Where the generation starts.
    const GENERATION_SHIFT: u32 = 4;

    /// The probe id (number and generation cut to their 4 bits).
    pub const fn pack(self) -> u32 {
        let base = match self.kind {
            GraphKind::Entry => Self::ENTRY_BASE,
            GraphKind::Return => Self::RETURN_BASE,
        };
        base | (self.generation as u32 & Self::FIELD_MASK) << Self::GENERATION_SHIFT
            | (self.number as u32 & Self::FIELD_MASK)
    }

    /// The graph event a probe id names, if it names one.
    pub const fn unpack(id: u32) -> Option<Self> {
        let kind = match id & !0xff {
            Self::ENTRY_BASE => GraphKind::Entry,
            Self::RETURN_BASE => GraphKind::Return,
            _ => return None,
        };
        Some(Self {
            kind,
            number: (id & Self::FIELD_MASK) as u8,
            generation: ((id >> Self::GENERATION_SHIFT) & Self::FIELD_MASK) as u8,
        })
    }
}

/// The numbers of a graph event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphValues {
    /// Nesting depth on the task's stack (0 = the tree's root).
    pub depth: u64,
    /// Return events: nanoseconds from entry to return.
    pub duration_ns: u64,
    /// Return events: the function's return value (RAX).
    pub retval: u64,
}

impl GraphValues {
    /// Reads the values of an entry (`[depth]`) or return
    /// (`[depth, duration, retval]`) event.
    pub fn of(kind: GraphKind, ev: &RawEvent) -> Option<GraphValues> {
        let int = |i: usize| match ev.values.get(i) {
            Some(FetchedValue::Int { value, .. }) => Some(*value),
            _ => None,
        };
        Some(match kind {
            GraphKind::Entry => GraphValues {
                depth: int(0)?,
                duration_ns: 0,
                retval: 0,
            },
            GraphKind::Return => GraphValues {
                depth: int(0)?,
                duration_ns: int(1)?,
                retval: int(2)?,
            },
        })
    }
}

/// ftrace's duration marker.
pub fn duration_mark(ns: u64) -> char {
    match ns {
        n if n > 1_000_000_000 => '$',
        n if n > 100_000_000 => '@',
        n if n > 10_000_000 => '*',
        n if n > 1_000_000 => '#',
        n if n > 100_000 => '!',
        n if n > 10_000 => '+',
        _ => ' ',
    }
}

/// `%ps`: the function's name, with ` [module]` for a module's.
fn name(out: &mut String, syms: &dyn SymbolResolver, addr: u64) {
    match syms.symbolize(guest_introspect::addr::Gva(addr)) {
        Some(s) => {
            out.push_str(&s.name);
            if let Some(m) = s.module {
                let _ = write!(out, " [{m}]");
            }
        }
        None => {
            let _ = write!(out, "0x{addr:x}");
        }
    }
}

/// The function_graph text renderer. Like the kernel's, it keeps its
/// state per CPU: each CPU's entry held back for a leaf line, and each
/// CPU's last pid (for the context-switch marker). The stream hands it
/// every CPU's events merged in time order, so one CPU's calls may
/// interleave with another's without breaking either's leaves.
#[derive(Debug, Default)]
pub struct GraphText {
    /// Entries held back, at most one per CPU.
    pending: Vec<(RawEvent, GraphValues)>,
    /// The last pid printed, per CPU.
    last_pid: Vec<(u32, i32)>,
    /// Print return values (`funcgraph-retval`).
    pub retval: bool,
}

impl GraphText {
    /// A renderer; `retval` as the funcgraph-retval option.
    pub fn new(retval: bool) -> Self {
        Self {
            pending: Vec::new(),
            last_pid: Vec::new(),
            retval,
        }
    }

    fn prefix(out: &mut String, cpu: u32, duration: Option<u64>) {
        let _ = write!(out, " {cpu})");
        let start = out.len();
        if let Some(ns) = duration {
            let us = ns / 1000;
            let frac = ns % 1000;
            let _ = write!(out, " {} {us}.{frac:03} us", duration_mark(ns));
        }
        while out.len() - start < DURATION_WIDTH {
            out.push(' ');
        }
        if !out.ends_with(' ') {
            out.push(' ');
        }
        out.push_str("|  ");
    }

    fn indent(out: &mut String, depth: u64) {
        for _ in 0..depth.min(64) {
            out.push_str("  ");
        }
    }

    fn switch(&mut self, out: &mut String, ev: &RawEvent) {
        let pid = ev.header.pid;
        let cpu = ev.header.cpu;
        match self.last_pid.iter_mut().find(|(c, _)| *c == cpu) {
            Some((_, last)) => {
                if *last != pid {
                    let mut comm = String::new();
                    crate::kprobe::push_lossy(&mut comm, ev.header.comm_bytes());
                    let _ = write!(
                        out,
                        " ------------------------------------------\n {cpu})  pid {last} => {comm}-{pid}\n ------------------------------------------\n\n",
                    );
                }
                *last = pid;
            }
            // A CPU's first line has no marker; the list is bounded by the
            // CPUs the guest has (a CPU number is the guest's, at most
            // 16 values root reports; an unknown one falls back to root's
            // index).
            None => self.last_pid.push((cpu, pid)),
        }
    }

    fn open(&mut self, out: &mut String, ev: &RawEvent, v: GraphValues, syms: &dyn SymbolResolver) {
        Self::prefix(out, ev.header.cpu, None);
        Self::indent(out, v.depth);
        name(out, syms, ev.header.ip);
        out.push_str("() {\n");
    }

    /// Takes CPU `cpu`'s held entry.
    fn take_pending(&mut self, cpu: u32) -> Option<(RawEvent, GraphValues)> {
        let i = self.pending.iter().position(|(p, _)| p.header.cpu == cpu)?;
        Some(self.pending.swap_remove(i))
    }

    /// Appends the lines `ev` completes (possibly none: an entry waits for
    /// the next event of its CPU).
    pub fn push(
        &mut self,
        out: &mut String,
        kind: GraphKind,
        ev: &RawEvent,
        syms: &dyn SymbolResolver,
    ) {
        let Some(v) = GraphValues::of(kind, ev) else {
            return;
        };
        let cpu = ev.header.cpu;
        match kind {
            GraphKind::Entry => {
                if let Some((p, pv)) = self.take_pending(cpu) {
                    self.switch(out, &p);
                    self.open(out, &p, pv, syms);
                }
                self.pending.push((ev.clone(), v));
            }
            GraphKind::Return => {
                let leaf = match self.take_pending(cpu) {
                    Some((p, pv))
                        if p.header.ip == ev.header.ip
                            && pv.depth == v.depth
                            && p.header.pid == ev.header.pid =>
                    {
                        self.switch(out, &p);
                        true
                    }
                    Some((p, pv)) => {
                        self.switch(out, &p);
                        self.open(out, &p, pv, syms);
                        false
                    }
                    None => false,
                };
                if !leaf {
                    self.switch(out, ev);
                }
                Self::prefix(out, cpu, Some(v.duration_ns));
                Self::indent(out, v.depth);
                if leaf {
                    name(out, syms, ev.header.ip);
                    out.push_str("();");
                    if self.retval {
                        let _ = write!(out, " /* = 0x{:x} */", v.retval);
                    }
                } else {
                    out.push('}');
                    if self.retval {
                        out.push_str(" /* ");
                        name(out, syms, ev.header.ip);
                        let _ = write!(out, " = 0x{:x} */", v.retval);
                    }
                }
                out.push('\n');
            }
        }
    }

    /// Prints the held entries as open calls, oldest first (the stream
    /// paused there).
    pub fn flush(&mut self, out: &mut String, syms: &dyn SymbolResolver) {
        self.pending.sort_by_key(|(p, _)| p.header.timestamp_ns);
        for (p, pv) in core::mem::take(&mut self.pending) {
            self.switch(out, &p);
            self.open(out, &p, pv, syms);
        }
    }

    /// Whether an entry is held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The time of the oldest entry held back, if any.
    pub fn pending_since(&self) -> Option<u64> {
        self.pending
            .iter()
            .map(|(p, _)| p.header.timestamp_ns)
            .min()
    }
}

/// One graph event as a JSON object (no newline):
/// `{"ts":..,"ts_ns":..,"cpu":..,"pid":..,"comm":..,"kind":"graph_entry",
/// "func":"vfs_read","ip":"0x..","depth":0,"session":1}`; returns add `"duration_ns"` and
/// `"retval"`.
pub fn write_graph_json(
    out: &mut String,
    kind: GraphKind,
    ev: &RawEvent,
    session: u32,
    syms: &dyn SymbolResolver,
) {
    let Some(v) = GraphValues::of(kind, ev) else {
        return;
    };
    let h = &ev.header;
    let us = h.timestamp_ns.saturating_add(500) / 1000;
    let mut scratch = String::new();
    let _ = write!(scratch, "{}.{:06}", us / 1_000_000, us % 1_000_000);
    let mut func = String::new();
    name(&mut func, syms, h.ip);
    let mut o = json::Object::begin(out);
    o.str("ts", &scratch)
        .u64("ts_ns", h.timestamp_ns)
        .u64("cpu", u64::from(h.cpu))
        .i64("pid", i64::from(h.pid))
        .bytes("comm", h.comm_bytes())
        .str(
            "kind",
            match kind {
                GraphKind::Entry => "graph_entry",
                GraphKind::Return => "graph_return",
            },
        )
        .str("func", &func);
    scratch.clear();
    let _ = write!(scratch, "{:#x}", h.ip);
    o.str("ip", &scratch)
        .u64("depth", v.depth)
        .u64("session", u64::from(session));
    if kind == GraphKind::Return {
        scratch.clear();
        let _ = write!(scratch, "0x{:x}", v.retval);
        o.u64("duration_ns", v.duration_ns).str("retval", &scratch);
    }
    o.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_event_ids_round_trip_and_keep_to_their_bits() {
        for kind in [GraphKind::Entry, GraphKind::Return] {
            for number in 0..16u8 {
                for generation in 0..16u8 {
                    let id = GraphEventId {
                        kind,
                        number,
                        generation,
                    };
                    assert_eq!(GraphEventId::unpack(id.pack()), Some(id));
                }
            }
        }
        let e = GraphEventId {
            kind: GraphKind::Entry,
            number: 3,
            generation: 2,
        };
        assert_eq!(e.pack(), 0xffff_ff23);
        let r = GraphEventId {
            kind: GraphKind::Return,
            number: 15,
            generation: 15,
        };
        assert_eq!(r.pack(), 0xffff_feff);
        // Out-of-range fields are cut, never spill into the base.
        let wide = GraphEventId {
            kind: GraphKind::Entry,
            number: 0x13,
            generation: 0x21,
        };
        assert_eq!(wide.pack(), 0xffff_ff13);
        // Probe and function ids are not graph events.
        assert_eq!(GraphEventId::unpack(0), None);
        assert_eq!(GraphEventId::unpack(7), None);
        assert_eq!(GraphEventId::unpack(0xffff_fd00), None);
    }
    use crate::kprobe::{EventHeader, IntType, SymbolAt};
    use alloc::borrow::Cow;
    use alloc::vec;
    use alloc::vec::Vec;
    use guest_introspect::addr::Gva;

    struct Syms;
    impl SymbolResolver for Syms {
        fn lookup(&self, _: &str) -> Option<Gva> {
            None
        }
        fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
            let name = match addr.0 {
                0x1000 => "vfs_read",
                0x2000 => "rw_verify_area",
                0x3000 => "ext4_file_read_iter",
                0x4000 => "do_nanosleep",
                _ => return None,
            };
            Some(SymbolAt {
                name: Cow::Borrowed(name),
                offset: 0,
                size: 0x100,
                module: None,
            })
        }
    }

    fn ev(kind: GraphKind, pid: i32, func: u64, vals: &[u64]) -> RawEvent {
        let mut header = EventHeader {
            probe_id: 0,
            cpu: 0,
            pid,
            timestamp_ns: 5_000_000_000,
            ip: func,
            ret_ip: 0,
            comm: [0; 16],
        };
        header.set_comm(if pid == 90 { b"dd" } else { b"sleeper" });
        let _ = kind;
        RawEvent {
            header,
            values: vals
                .iter()
                .map(|&v| FetchedValue::Int {
                    ty: IntType::U64,
                    value: v,
                })
                .collect::<Vec<_>>(),
        }
    }

    fn render(events: &[(GraphKind, RawEvent)], retval: bool) -> String {
        let mut g = GraphText::new(retval);
        let mut out = String::new();
        for (k, e) in events {
            g.push(&mut out, *k, e, &Syms);
        }
        g.flush(&mut out, &Syms);
        out
    }

    use GraphKind::{Entry as E, Return as R};

    #[test]
    fn nesting_leaves_and_markers_as_ftrace_prints_them() {
        let out = render(
            &[
                (E, ev(E, 90, 0x1000, &[0])),
                (E, ev(E, 90, 0x2000, &[1])),
                (R, ev(R, 90, 0x2000, &[1, 812, 0])),
                (E, ev(E, 90, 0x3000, &[1])),
                (R, ev(R, 90, 0x3000, &[1, 103_160, 14])),
                (R, ev(R, 90, 0x1000, &[0, 115_062, 14])),
            ],
            false,
        );
        assert_eq!(
            out,
            " 0)               |  vfs_read() {\n\
             \x20\x200)   0.812 us    |    rw_verify_area();\n\
             \x20\x200) ! 103.160 us  |    ext4_file_read_iter();\n\
             \x20\x200) ! 115.062 us  |  }\n"
                .replace("\n  0)", "\n 0)")
        );
    }

    #[test]
    fn retval_and_open_calls() {
        let out = render(
            &[
                (E, ev(E, 90, 0x1000, &[0])),
                (E, ev(E, 90, 0x2000, &[1])),
                (R, ev(R, 90, 0x2000, &[1, 20_000, 0])),
                (R, ev(R, 90, 0x1000, &[0, 2_000_000, 0xe])),
                (E, ev(E, 90, 0x4000, &[0])),
            ],
            true,
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            vec![
                " 0)               |  vfs_read() {",
                " 0) + 20.000 us   |    rw_verify_area(); /* = 0x0 */",
                " 0) # 2000.000 us |  } /* vfs_read = 0xe */",
                " 0)               |  do_nanosleep() {",
            ]
        );
    }

    #[test]
    fn a_task_switch_is_marked_and_sleepers_nest_per_task() {
        // The sleeper enters do_nanosleep and sleeps; dd runs a tree; the
        // sleeper returns.
        let out = render(
            &[
                (E, ev(E, 7, 0x4000, &[0])),
                (E, ev(E, 90, 0x1000, &[0])),
                (R, ev(R, 90, 0x1000, &[0, 3_000, 0])),
                (R, ev(R, 7, 0x4000, &[0, 300_000_000, 0])),
            ],
            false,
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], " 0)               |  do_nanosleep() {");
        assert!(lines[2].contains("pid 7 => dd-90"), "{out}");
        assert_eq!(lines[5], " 0)   3.000 us    |  vfs_read();");
        assert!(lines[7].contains("pid 90 => sleeper-7"), "{out}");
        assert_eq!(lines[10], " 0) @ 300000.000 us |  }");
    }

    #[test]
    fn calls_on_two_cpus_interleave_and_keep_their_leaves() {
        let on = |cpu: u32, mut e: RawEvent| {
            e.header.cpu = cpu;
            e
        };
        // A sleeper on CPU 1 and dd on CPU 0, their events merged in time.
        let out = render(
            &[
                (E, on(1, ev(E, 7, 0x4000, &[0]))),
                (E, on(0, ev(E, 90, 0x1000, &[0]))),
                (E, on(0, ev(E, 90, 0x2000, &[1]))),
                (R, on(1, ev(R, 7, 0x4000, &[0, 300_000, 0]))),
                (R, on(0, ev(R, 90, 0x2000, &[1, 812, 0]))),
                (R, on(0, ev(R, 90, 0x1000, &[0, 5_000, 0]))),
            ],
            false,
        );
        let lines: Vec<&str> = out.lines().collect();
        // Each CPU's leaf is a leaf, its tree nests, and no switch marker
        // appears (each CPU ran one task).
        assert_eq!(
            lines,
            vec![
                " 0)               |  vfs_read() {",
                " 1) ! 300.000 us  |  do_nanosleep();",
                " 0)   0.812 us    |    rw_verify_area();",
                " 0)   5.000 us    |  }",
            ],
            "{out}"
        );
    }

    #[test]
    fn json_lines() {
        let mut out = String::new();
        write_graph_json(&mut out, R, &ev(R, 90, 0x1000, &[2, 1500, 0x10]), 3, &Syms);
        assert_eq!(
            out,
            r#"{"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","ip":"0x1000","depth":2,"session":3,"duration_ns":1500,"retval":"0x10"}"#
        );
        out.clear();
        write_graph_json(&mut out, E, &ev(E, 90, 0x1000, &[0]), 1, &Syms);
        assert!(out.ends_with(
            r#""kind":"graph_entry","func":"vfs_read","ip":"0x1000","depth":0,"session":1}"#
        ));
        // A malformed record renders nothing.
        out.clear();
        write_graph_json(&mut out, R, &ev(R, 90, 0x1000, &[2]), 1, &Syms);
        assert!(out.is_empty());
    }

    #[test]
    fn markers() {
        assert_eq!(duration_mark(10_000), ' ');
        assert_eq!(duration_mark(10_001), '+');
        assert_eq!(duration_mark(100_001), '!');
        assert_eq!(duration_mark(1_000_001), '#');
        assert_eq!(duration_mark(10_000_001), '*');
        assert_eq!(duration_mark(100_000_001), '@');
        assert_eq!(duration_mark(1_000_000_001), '$');
    }
}
