//! Rendering events as the kernel's trace_pipe lines, and as JSON lines.
//!
//! The text form is the kernel's with the `irq-info` option off (the
//! `d..1.` column needs the guest's preempt count, which we do not read):
//!
//! ```text
//! trace_print_context:   "%16s-%-7d " "[%03d] " " %5lu.%06lu" ": "
//! print_kprobe_event:    "%s: (" %pS ")"  then " name=value" per argument
//! print_kretprobe_event: "%s: (" %pS " <- " name ")" ...
//! ```
//!
//! Values print as `probe_fetch_types` prints them (trace_probe.c): `u*`
//! as `%u`, `s*` as `%d`, `x*` as `0x%x`, `char` as `'%c'`, `symbol` as
//! `%pS`, strings quoted, and a failed read as `(fault)`.

use alloc::string::String;
use core::fmt::Write;

use guest_introspect::addr::Gva;

use super::event::RawEvent;
use super::fetch::{FetchedValue, SymbolResolver};
use super::json;
use super::spec::{IntType, ProbeKind, ProbeSpec};

/// The kernel's `FAULT_STRING`.
pub const FAULT_STRING: &str = "(fault)";

/// Appends bytes as text; invalid UTF-8 becomes U+FFFD (the kernel would
/// pass the bytes through).
pub fn push_lossy(out: &mut String, b: &[u8]) {
    for chunk in b.utf8_chunks() {
        out.push_str(chunk.valid());
        if !chunk.invalid().is_empty() {
            out.push('\u{fffd}');
        }
    }
}

/// `%pS`: `name+0xoff/0xsize`, ` [module]` for module symbols, or `0xaddr`
/// when no symbol contains the address (`sprint_symbol`).
pub fn write_symbol(out: &mut String, syms: &dyn SymbolResolver, addr: u64) {
    match syms.symbolize(Gva(addr)) {
        Some(s) => {
            let _ = write!(out, "{}+{:#x}/{:#x}", s.name, s.offset, s.size);
            if let Some(m) = s.module {
                let _ = write!(out, " [{m}]");
            }
        }
        None => {
            let _ = write!(out, "{addr:#x}");
        }
    }
}

/// `seq_print_ip_sym`: `0` for a null address; with `offset`, the `%pS`
/// form; without, the bare symbol name or `0x%08lx`.
fn write_ip_sym(out: &mut String, syms: &dyn SymbolResolver, ip: u64, offset: bool) {
    if ip == 0 {
        out.push('0');
    } else if offset {
        write_symbol(out, syms, ip);
    } else {
        match syms.symbolize(Gva(ip)) {
            Some(s) => out.push_str(&s.name),
            None => {
                let _ = write!(out, "0x{ip:08x}");
            }
        }
    }
}

fn sign_extend(ty: IntType, v: u64) -> i64 {
    match ty.size() {
        1 => v as u8 as i8 as i64,
        2 => v as u16 as i16 as i64,
        4 => v as u32 as i32 as i64,
        _ => v as i64,
    }
}

/// One value as trace_pipe prints it.
pub fn write_value(out: &mut String, syms: &dyn SymbolResolver, v: &FetchedValue) {
    match v {
        FetchedValue::Int { ty, value } => {
            let value = ty.truncate(*value);
            let _ = match ty {
                IntType::U8 | IntType::U16 | IntType::U32 | IntType::U64 => write!(out, "{value}"),
                IntType::S8 | IntType::S16 | IntType::S32 | IntType::S64 => {
                    write!(out, "{}", sign_extend(*ty, value))
                }
                IntType::X8 | IntType::X16 | IntType::X32 | IntType::X64 => {
                    write!(out, "0x{value:x}")
                }
                IntType::Char => {
                    out.push('\'');
                    push_lossy(out, &[value as u8]);
                    out.push('\'');
                    Ok(())
                }
            };
        }
        FetchedValue::Str(s) => {
            out.push('"');
            push_lossy(out, s);
            out.push('"');
        }
        FetchedValue::Symbol(a) => write_symbol(out, syms, *a),
        FetchedValue::SymStr(a) => {
            out.push('"');
            write_symbol(out, syms, *a);
            out.push('"');
        }
        FetchedValue::Fault => out.push_str(FAULT_STRING),
    }
}

/// The comm column: the kernel shows `<idle>` for pid 0.
fn comm_of(ev: &RawEvent) -> String {
    let mut s = String::new();
    if ev.header.pid == 0 {
        s.push_str("<idle>");
    } else {
        push_lossy(&mut s, ev.header.comm_bytes());
    }
    s
}

/// `ns2usecs` (rounded to the nearest microsecond), as seconds and the
/// remaining microseconds.
fn secs_usecs(ns: u64) -> (u64, u64) {
    let us = ns.saturating_add(500) / 1000;
    (us / 1_000_000, us % 1_000_000)
}

/// The probe location: `(sym+0x0/0xsize)` or `(ret+0x1b/0x1d <- func)`.
fn write_location(out: &mut String, kind: ProbeKind, ev: &RawEvent, syms: &dyn SymbolResolver) {
    match kind {
        ProbeKind::Entry => write_ip_sym(out, syms, ev.header.ip, true),
        ProbeKind::Return { .. } => {
            write_ip_sym(out, syms, ev.header.ret_ip, true);
            out.push_str(" <- ");
            write_ip_sym(out, syms, ev.header.ip, false);
        }
    }
}

/// Appends one trace_pipe line for `ev`, a hit of `probe` (no newline).
///
/// ```text
///              cat-123     [000]     12.345678: myopen: (do_sys_openat2+0x0/0x150) dfd=0xffffff9c filename="/etc/hostname"
/// ```
pub fn write_text(out: &mut String, probe: &ProbeSpec, ev: &RawEvent, syms: &dyn SymbolResolver) {
    write_context(out, ev);
    let _ = write!(out, "{}: (", probe.event);
    write_location(out, probe.kind, ev, syms);
    out.push(')');
    for (i, v) in ev.values.iter().enumerate() {
        out.push(' ');
        match probe.args.get(i) {
            Some(a) => out.push_str(&a.name),
            None => {
                let _ = write!(out, "arg{}", i + 1);
            }
        }
        out.push('=');
        write_value(out, syms, v);
    }
}

/// `trace_print_context` without irq-info: `COMM-PID [CPU]  SECS.USECS: `.
fn write_context(out: &mut String, ev: &RawEvent) {
    let h = &ev.header;
    let comm = comm_of(ev);
    // %16s pads by bytes.
    for _ in comm.len()..16 {
        out.push(' ');
    }
    out.push_str(&comm);
    let (secs, usecs) = secs_usecs(h.timestamp_ns);
    let _ = write!(
        out,
        "-{:<7} [{:03}]  {:>5}.{:06}: ",
        h.pid, h.cpu, secs, usecs
    );
}

/// Appends one line of the plain function tracer for `ev`, whose header
/// `ip` is the traced function and `ret_ip` its caller's return address
/// (no newline), as the kernel's `function` tracer prints it:
///
/// ```text
///              cat-123     [000]     12.345678: do_sys_openat2 <-__x64_sys_openat
/// ```
pub fn write_function_text(out: &mut String, ev: &RawEvent, syms: &dyn SymbolResolver) {
    write_context(out, ev);
    write_ip_sym(out, syms, ev.header.ip, false);
    out.push_str(" <-");
    write_ip_sym(out, syms, ev.header.ret_ip, false);
}

/// What a scheduler switch record holds besides its header (whose task is
/// the incoming one, `next`): the outgoing task's pid, comm, prio and
/// state as the kernel's `sched_switch` reports it (one `TASK_REPORT` bit:
/// [`report_state`]), and the incoming task's prio. A prio that did not
/// read is -1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwitchValues {
    /// The outgoing task's pid.
    pub prev_pid: i32,
    /// Its comm.
    pub prev_comm: alloc::vec::Vec<u8>,
    /// Its prio.
    pub prev_prio: i32,
    /// Its state, as [`report_state`] makes it.
    pub prev_state: u64,
    /// The incoming task's prio.
    pub next_prio: i32,
}

impl SwitchValues {
    /// The record's values, in order.
    pub fn values(&self) -> [FetchedValue; 5] {
        let int = |ty, value| FetchedValue::Int { ty, value };
        [
            int(IntType::S32, u64::from(self.prev_pid as u32)),
            FetchedValue::Str(self.prev_comm.clone()),
            int(IntType::S32, u64::from(self.prev_prio as u32)),
            int(IntType::X64, self.prev_state),
            int(IntType::S32, u64::from(self.next_prio as u32)),
        ]
    }

    /// The record as the outgoing task's: the kernel emits the event
    /// before the switch, so its context (pid, comm) is `prev`'s.
    pub fn outgoing(&self, ev: &RawEvent) -> RawEvent {
        let mut comm = [0u8; 16];
        for (to, from) in comm.iter_mut().take(15).zip(&self.prev_comm) {
            *to = *from;
        }
        RawEvent {
            header: super::event::EventHeader {
                pid: self.prev_pid,
                comm,
                ..ev.header
            },
            values: alloc::vec::Vec::new(),
        }
    }

    /// The values of a record, when they are a switch's.
    pub fn of(ev: &RawEvent) -> Option<SwitchValues> {
        let int = |v: &FetchedValue| match v {
            FetchedValue::Int { value, .. } => Some(*value),
            _ => None,
        };
        match ev.values.as_slice() {
            [pid, FetchedValue::Str(comm), prio, state, next_prio] => Some(SwitchValues {
                prev_pid: int(pid)? as u32 as i32,
                prev_comm: comm.clone(),
                prev_prio: int(prio)? as u32 as i32,
                prev_state: int(state)?,
                next_prio: int(next_prio)? as u32 as i32,
            }),
            _ => None,
        }
    }
}

/// What a scheduler wakeup record holds besides its header (whose task is
/// the waker): the woken task's pid, comm, prio and CPU, as the kernel's
/// `sched_wakeup` reports them. A prio or CPU that did not read is -1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WakeupValues {
    /// The woken task's pid.
    pub pid: i32,
    /// Its comm.
    pub comm: alloc::vec::Vec<u8>,
    /// Its prio.
    pub prio: i32,
    /// Its CPU.
    pub target_cpu: i32,
}

impl WakeupValues {
    /// The record's values, in order.
    pub fn values(&self) -> [FetchedValue; 4] {
        let int = |value: i32| FetchedValue::Int {
            ty: IntType::S32,
            value: u64::from(value as u32),
        };
        [
            int(self.pid),
            FetchedValue::Str(self.comm.clone()),
            int(self.prio),
            int(self.target_cpu),
        ]
    }

    /// The values of a record, when they are a wakeup's.
    pub fn of(ev: &RawEvent) -> Option<WakeupValues> {
        let int = |v: &FetchedValue| match v {
            FetchedValue::Int { value, .. } => Some(*value as u32 as i32),
            _ => None,
        };
        match ev.values.as_slice() {
            [pid, FetchedValue::Str(comm), prio, cpu] => Some(WakeupValues {
                pid: int(pid)?,
                comm: comm.clone(),
                prio: int(prio)?,
                target_cpu: int(cpu)?,
            }),
            _ => None,
        }
    }
}

/// A wakeup as the kernel's `sched_wakeup` prints in trace_pipe, in the
/// waker's context (no newline):
///
/// ```text
///               sh-52      [000]     14.785078: sched_wakeup: comm=dd pid=55 prio=120 target_cpu=000
/// ```
pub fn write_wakeup_text(out: &mut String, ev: &RawEvent) {
    let Some(v) = WakeupValues::of(ev) else {
        return;
    };
    write_context(out, ev);
    out.push_str("sched_wakeup: comm=");
    push_lossy(out, &v.comm);
    let _ = write!(
        out,
        " pid={} prio={} target_cpu={:03}",
        v.pid, v.prio, v.target_cpu
    );
}

/// A wakeup as one JSON object (no newline):
/// `{"ts":..,"ts_ns":..,"cpu":..,"pid":..,"comm":..,"kind":"sched_wakeup",
/// "target_comm":"dd","target_pid":55,"target_prio":120,"target_cpu":0}`
/// (`pid` and `comm` are the waker's, as in the kernel's event).
pub fn write_wakeup_json(out: &mut String, ev: &RawEvent) {
    let Some(v) = WakeupValues::of(ev) else {
        return;
    };
    let mut scratch = String::new();
    let mut o = json::Object::begin(out);
    json_context(&mut o, ev, &mut scratch);
    o.str("kind", "sched_wakeup");
    o.bytes("target_comm", &v.comm)
        .i64("target_pid", i64::from(v.pid))
        .i64("target_prio", i64::from(v.prio))
        .i64("target_cpu", i64::from(v.target_cpu));
    o.end();
}

/// A task's scheduler state as the kernel's `sched_switch` stores it
/// (`__trace_sched_switch_state` without preemption, which root cannot
/// see), from its `__state` and `exit_state`: one bit, that of the highest
/// reportable state (0x7f) of the two; `TASK_IDLE` reports as 0x80 (`I`),
/// an rtlock wait as uninterruptible; 0 for a runnable task.
pub fn report_state(state: u64, exit_state: u64) -> u64 {
    // TASK_UNINTERRUPTIBLE | TASK_NOLOAD
    const TASK_IDLE: u64 = 0x402;
    const TASK_RTLOCK_WAIT: u64 = 0x1000;
    let mut s = (state | exit_state) & 0x7f;
    if state & TASK_IDLE == TASK_IDLE {
        s = 0x80;
    }
    if state & TASK_RTLOCK_WAIT != 0 {
        s = 0x02;
    }
    if s == 0 {
        0
    } else {
        1 << (63 - s.leading_zeros())
    }
}

/// The letter of a reported state, as `sched_switch` prints it.
pub fn state_letter(report: u64) -> &'static str {
    match report {
        0 => "R",
        0x01 => "S",
        0x02 => "D",
        0x04 => "T",
        0x08 => "t",
        0x10 => "X",
        0x20 => "Z",
        0x40 => "P",
        0x80 => "I",
        _ => "?",
    }
}

/// The reported state a letter stands for (see [`state_letter`]).
pub fn state_of_letter(letter: &str) -> Option<u64> {
    [0u64, 1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80]
        .into_iter()
        .find(|&s| state_letter(s) == letter)
}

/// A scheduler switch as the kernel's `sched_switch` event prints in
/// trace_pipe, in the outgoing task's context (no newline):
///
/// ```text
///               sh-52      [000]     14.785078: sched_switch: prev_comm=sh prev_pid=52 prev_prio=120 prev_state=S ==> next_comm=dd next_pid=55 next_prio=120
/// ```
pub fn write_switch_text(out: &mut String, ev: &RawEvent) {
    let Some(v) = SwitchValues::of(ev) else {
        return;
    };
    write_context(out, &v.outgoing(ev));
    out.push_str("sched_switch: prev_comm=");
    push_lossy(out, &v.prev_comm);
    let _ = write!(
        out,
        " prev_pid={} prev_prio={} prev_state={} ==> next_comm=",
        v.prev_pid,
        v.prev_prio,
        state_letter(v.prev_state)
    );
    push_lossy(out, ev.header.comm_bytes());
    let _ = write!(out, " next_pid={} next_prio={}", ev.header.pid, v.next_prio);
}

/// A scheduler switch as one JSON object (no newline):
/// `{"ts":..,"ts_ns":..,"cpu":..,"pid":..,"comm":..,"kind":"sched_switch",
/// "prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"S",
/// "next_comm":"dd","next_pid":55,"next_prio":120}` (`pid` and `comm` are
/// the outgoing task's, as in the kernel's event).
pub fn write_switch_json(out: &mut String, ev: &RawEvent) {
    let Some(v) = SwitchValues::of(ev) else {
        return;
    };
    let mut scratch = String::new();
    let mut o = json::Object::begin(out);
    json_context(&mut o, &v.outgoing(ev), &mut scratch);
    o.str("kind", "sched_switch");
    o.bytes("prev_comm", &v.prev_comm)
        .i64("prev_pid", i64::from(v.prev_pid))
        .i64("prev_prio", i64::from(v.prev_prio))
        .str("prev_state", state_letter(v.prev_state));
    o.bytes("next_comm", ev.header.comm_bytes())
        .i64("next_pid", i64::from(ev.header.pid))
        .i64("next_prio", i64::from(v.next_prio));
    o.end();
}

/// The fields every JSON line starts with: `ts`, `ts_ns`, `cpu`, `pid`, `comm`.
fn json_context(o: &mut json::Object<'_>, ev: &RawEvent, scratch: &mut String) {
    let h = &ev.header;
    let (secs, usecs) = secs_usecs(h.timestamp_ns);
    scratch.clear();
    let _ = write!(scratch, "{secs}.{usecs:06}");
    o.str("ts", scratch);
    o.u64("ts_ns", h.timestamp_ns)
        .u64("cpu", u64::from(h.cpu))
        .i64("pid", i64::from(h.pid));
    o.bytes("comm", h.comm_bytes());
}

/// The function tracer's event as one JSON object (no newline):
/// `{"ts":..,"ts_ns":..,"cpu":..,"pid":..,"comm":..,"kind":"function",
/// "func":"do_sys_openat2","parent":"__x64_sys_openat+0x5d/0xa0",
/// "ip":"0x..","parent_ip":"0x.."}`.
pub fn write_function_json(out: &mut String, ev: &RawEvent, syms: &dyn SymbolResolver) {
    let h = &ev.header;
    let mut scratch = String::new();
    let mut o = json::Object::begin(out);
    json_context(&mut o, ev, &mut scratch);
    o.str("kind", "function");
    scratch.clear();
    write_ip_sym(&mut scratch, syms, h.ip, false);
    o.str("func", &scratch);
    scratch.clear();
    write_ip_sym(&mut scratch, syms, h.ret_ip, true);
    o.str("parent", &scratch);
    scratch.clear();
    let _ = write!(scratch, "{:#x}", h.ip);
    o.str("ip", &scratch);
    scratch.clear();
    let _ = write!(scratch, "{:#x}", h.ret_ip);
    o.str("parent_ip", &scratch);
    o.end();
}

/// [`write_text`] into a new string.
pub fn text_line(probe: &ProbeSpec, ev: &RawEvent, syms: &dyn SymbolResolver) -> String {
    let mut s = String::new();
    write_text(&mut s, probe, ev, syms);
    s
}

/// Appends one JSON object for `ev` (no newline):
///
/// ```text
/// {"ts":"12.345678","ts_ns":12345678000,"cpu":0,"pid":123,"comm":"cat",
///  "group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81234560",
///  "probe":"do_sys_openat2+0x0/0x150","args":{"dfd":"0xffffff9c","filename":"/etc/hostname"}}
/// ```
///
/// `u*`/`s*` values are JSON numbers; `x*` values, characters, symbols and
/// strings are JSON strings spelled as in the text form (strings without
/// the quotes); a fault is `null`. `comm` is the task's own name (the text
/// form shows `<idle>` for pid 0). Return probes have `"kind":"kretprobe"`
/// and a `ret_ip`.
pub fn write_json(out: &mut String, probe: &ProbeSpec, ev: &RawEvent, syms: &dyn SymbolResolver) {
    let h = &ev.header;
    let mut scratch = String::new();
    let mut o = json::Object::begin(out);
    json_context(&mut o, ev, &mut scratch);
    o.str("group", &probe.group).str("event", &probe.event);
    let is_return = probe.kind.is_return();
    o.str("kind", if is_return { "kretprobe" } else { "kprobe" });
    scratch.clear();
    let _ = write!(scratch, "{:#x}", h.ip);
    o.str("ip", &scratch);
    if is_return {
        scratch.clear();
        let _ = write!(scratch, "{:#x}", h.ret_ip);
        o.str("ret_ip", &scratch);
    }
    scratch.clear();
    write_location(&mut scratch, probe.kind, ev, syms);
    o.str("probe", &scratch);
    let mut args = o.object("args");
    let mut name = String::new();
    for (i, v) in ev.values.iter().enumerate() {
        name.clear();
        match probe.args.get(i) {
            Some(a) => name.push_str(&a.name),
            None => {
                let _ = write!(name, "arg{}", i + 1);
            }
        }
        match v {
            FetchedValue::Fault => {
                args.null(&name);
            }
            FetchedValue::Int { ty, value }
                if !matches!(
                    ty,
                    IntType::X8 | IntType::X16 | IntType::X32 | IntType::X64 | IntType::Char
                ) =>
            {
                let value = ty.truncate(*value);
                if matches!(ty, IntType::S8 | IntType::S16 | IntType::S32 | IntType::S64) {
                    args.i64(&name, sign_extend(*ty, value));
                } else {
                    args.u64(&name, value);
                }
            }
            FetchedValue::Int {
                ty: IntType::Char,
                value,
            } => {
                args.bytes(&name, &[*value as u8]);
            }
            FetchedValue::Str(s) => {
                args.bytes(&name, s);
            }
            FetchedValue::SymStr(a) | FetchedValue::Symbol(a) => {
                scratch.clear();
                write_symbol(&mut scratch, syms, *a);
                args.str(&name, &scratch);
            }
            other => {
                scratch.clear();
                write_value(&mut scratch, syms, other);
                args.str(&name, &scratch);
            }
        }
    }
    args.end();
    o.end();
}

/// [`write_json`] into a new string.
pub fn json_line(probe: &ProbeSpec, ev: &RawEvent, syms: &dyn SymbolResolver) -> String {
    let mut s = String::new();
    write_json(&mut s, probe, ev, syms);
    s
}
