//! `hvtrace syscalls`: a system-wide system-call tracer from outside the
//! guest. The guest's own `sys_call_table` gives the numbers and names,
//! its syscall metadata (or BTF) the arguments' names and C types
//! (`Request::Syscalls`); each traced call gets two probes on its
//! `__x64_sys_NAME` wrapper, whose one argument is the caller's `struct
//! pt_regs *`: an entry probe that reads the arguments from it (di, si,
//! dx, r10, r8, r9; user strings at the entry, before an `execve` replaces
//! them) and a return probe for the value. The host pairs the two per
//! task and prints one line per call in the shape of the kernel's
//! syscall events, with the strings read and the common flags decoded:
//!
//! ```text
//! cat-97 [000] 129.620001: sys_openat(dfd: AT_FDCWD, filename: "/etc/hostname", flags: O_RDONLY, mode: 0) = 3
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use protocol::{Request, Response, SyscallInfo, TraceFormat};
use serde_json::Value;

use super::cli::SyscallsArgs;
use super::ctl::{add_probe, open, INTERRUPTED_EXIT};
use super::timeouts::{EXEC_TIMEOUT, PROBE_TIMEOUT, STATUS_TIMEOUT};
use super::trace_read::{copy_trace, CopyEnd, TraceOutput, TraceReader, FOLLOW_WAIT_MS};
use crate::control::{response_error, Control};
use crate::output::term;
use crate::sys;

/// The probes' group.
pub const GROUP: &str = "hvsys";

/// Byte offsets in x86-64 `struct pt_regs` of the six argument registers
/// of a system call (di, si, dx, r10, r8, r9).
pub const ARG_REGS: [(u32, &str); 6] = [
    (112, "di"),
    (104, "si"),
    (96, "dx"),
    (56, "r10"),
    (72, "r8"),
    (64, "r9"),
];

/// The same for a 32-bit call of IA32 emulation (bx, cx, dx, si, di, bp),
/// whose values the entry code zero-extended into the 64-bit slots.
pub const ARG_REGS_IA32: [(u32, &str); 6] = [
    (40, "bx"),
    (88, "cx"),
    (96, "dx"),
    (104, "si"),
    (112, "di"),
    (32, "bp"),
];

/// The event of call `s`: `sys_openat`, or `sys32_open` for a 32-bit
/// call.
pub fn event_name(s: &SyscallInfo) -> String {
    if s.compat {
        format!("sys32_{}", s.name)
    } else {
        format!("sys_{}", s.name)
    }
}

/// The call of event `event` ([`event_name`]): whether it is a 32-bit
/// call, and its name; `None` for another event.
fn parse_event(event: &str) -> Option<(bool, &str)> {
    match event.strip_prefix("sys32_") {
        Some(name) => Some((true, name)),
        None => event.strip_prefix("sys_").map(|name| (false, name)),
    }
}

/// A call's name in `--summary` and the tallies: a 32-bit call's marked.
fn summary_name(name: &str, compat: bool) -> String {
    if compat {
        format!("{name} (ia32)")
    } else {
        name.to_string()
    }
}

/// A fetch type at the width a 32-bit caller passed (`long` and pointers
/// are 32 bits there).
fn compat_type(t: &str) -> &'static str {
    match t {
        "s32" | "s64" => "s32",
        "x64" => "x32",
        _ => "u32",
    }
}

/// Calls that do not return to their caller.
const NO_RETURN: [&str; 2] = ["exit", "exit_group"];

/// The guest's calls, every page.
pub fn table(control: &mut dyn Control) -> Result<Vec<SyscallInfo>> {
    let mut out = Vec::new();
    let mut cursor = 0;
    loop {
        match control.request(Request::Syscalls { cursor }, STATUS_TIMEOUT)? {
            Response::Syscalls { next, calls, .. } => {
                out.extend(calls);
                match next {
                    Some(n) if n > cursor => cursor = n,
                    _ => return Ok(out),
                }
            }
            other => return Err(response_error(other)),
        }
    }
}

/// The guest's numbers against the ABI tables generated from the kernel
/// source (`guest_introspect::syscall_abi`), one line for each ABI the
/// guest has: where they disagree, the guest's number is the one used.
pub fn crosscheck_lines(table: &[SyscallInfo]) -> Vec<String> {
    use guest_introspect::syscall_abi::{crosscheck_with, i386, x86_64};
    let mut out = Vec::new();
    for (compat, abi, calls) in [
        (false, "x86-64", x86_64::CALLS),
        (true, "i386", i386::CALLS),
    ] {
        let guest: Vec<(u32, &str)> = table
            .iter()
            .filter(|s| s.compat == compat)
            .map(|s| (s.nr, s.name.as_str()))
            .collect();
        if guest.is_empty() {
            continue;
        }
        let Ok(c) = crosscheck_with(calls, guest.iter().copied()) else {
            continue;
        };
        let mut line = format!("the guest's {abi} calls against the ABI table: {c}");
        for m in c.differ.iter().take(4) {
            let table = match (m.table_name, m.table_nr) {
                (Some(n), _) => format!("the table has {n} there"),
                (None, Some(nr)) => format!("the table numbers it {nr}"),
                (None, None) => "the table has neither".to_string(),
            };
            line.push_str(&format!(
                "; {} is {} in the guest ({table}, the guest's used)",
                m.name, m.nr
            ));
        }
        out.push(line);
    }
    out
}

/// The calls named (`openat` or `sys_openat`: the 64-bit call and the
/// 32-bit one of that name, where the guest has them), or every call.
pub fn select<'a>(table: &'a [SyscallInfo], names: &[String]) -> Result<Vec<&'a SyscallInfo>> {
    if names.is_empty() {
        return Ok(table.iter().collect());
    }
    let mut out = Vec::new();
    for n in names
        .iter()
        .flat_map(|n| n.split(','))
        .filter(|n| !n.is_empty())
    {
        let want = n.strip_prefix("sys_").unwrap_or(n);
        let before = out.len();
        out.extend(table.iter().filter(|s| s.name == want));
        if out.len() == before {
            bail!("the guest has no system call {n:?} (`hvtrace syscalls --list` lists its calls)");
        }
    }
    Ok(out)
}

/// A C type as written in metadata, without `__user` and with single
/// spaces (`const char *`).
fn plain_c_type(ctype: &str) -> String {
    ctype
        .replace("__user", "")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The fetch type of an argument of C type `ctype`.
fn fetch_type(ctype: &str) -> &'static str {
    let t = plain_c_type(ctype);
    if t.contains('*') {
        return "x64";
    }
    let base = t
        .trim_start_matches("const ")
        .trim_start_matches("volatile ");
    match base {
        "int" | "pid_t" | "key_t" | "clockid_t" | "timer_t" | "mqd_t" | "key_serial_t"
        | "rwf_t" | "__s32" | "s32" => "s32",
        "unsigned int" | "unsigned" | "u32" | "__u32" | "uid_t" | "gid_t" | "qid_t" | "mode_t"
        | "umode_t" | "old_uid_t" | "old_gid_t" | "fmode_t" => "u32",
        "long"
        | "off_t"
        | "loff_t"
        | "ssize_t"
        | "__kernel_old_time_t"
        | "time_t"
        | "s64"
        | "__s64" => "s64",
        "unsigned long" | "size_t" | "u64" | "__u64" | "aio_context_t" => "u64",
        _ => "x64",
    }
}

/// Whether argument `name` of C type `ctype` is a string the caller
/// passes in: a `const char *` that names something (a path, a name). A
/// `const char *` buffer (`write`'s `buf`) is bytes, not a string.
fn is_input_string(ctype: &str, name: &str) -> bool {
    const NAMES: [&str; 12] = [
        "filename",
        "pathname",
        "path",
        "oldname",
        "newname",
        "name",
        "dev_name",
        "dir_name",
        "type",
        "specialfile",
        "library",
        "symlink",
    ];
    plain_c_type(ctype) == "const char *" && NAMES.contains(&name)
}

/// Most `argv` strings read of an `execve`.
pub const MAX_ARGV: usize = 8;

/// Whether argument `name` of C type `ctype` is an exec's `argv` (`const
/// char *const *`).
fn is_argv(ctype: &str, name: &str) -> bool {
    name == "argv" && plain_c_type(ctype).replace(' ', "") == "constchar*const*"
}

/// How the entry probe's fields of call `s` fold back into its
/// arguments: `argv` strings into a list, struct members into an object.
#[derive(Clone, Debug, Default)]
pub struct Folds {
    /// The argument that is an `argv`.
    argv: Option<String>,
    /// (argument, (field as probed, member name)) of each struct read.
    structs: Vec<(String, Vec<(String, String)>)>,
}

impl Folds {
    /// The folds of call `s`, named as [`specs`] names the fields.
    pub fn of(s: &SyscallInfo) -> Folds {
        let mut f = Folds::default();
        if s.compat {
            return f;
        }
        for (i, (ctype, name)) in s.args.iter().enumerate() {
            let arg = arg_name(name);
            if is_argv(ctype, name) {
                f.argv = Some(arg.clone());
            }
            for st in s.structs.iter().filter(|st| usize::from(st.arg) == i) {
                let fields = st
                    .fields
                    .iter()
                    .map(|m| (arg_name(&format!("{arg}_{}", m.name)), m.name.clone()))
                    .collect();
                f.structs.push((arg.clone(), fields));
            }
        }
        f
    }

    /// Folds `args` (the entry probe's fields) in place.
    fn apply(&self, args: &mut serde_json::Map<String, Value>) {
        if let Some(argv) = &self.argv {
            let mut list = Vec::new();
            let mut ended = false;
            for k in 0..MAX_ARGV {
                match args.remove(&format!("{argv}_{k}")) {
                    Some(Value::String(s)) if !ended => list.push(Value::String(s)),
                    _ => ended = true,
                }
            }
            let more = args.remove(&format!("{argv}_more"));
            if !ended && more.is_some_and(|m| m.as_str().is_some_and(|m| m != "0x0")) {
                list.push(Value::from("..."));
            }
            // A pointer that did not read (null, a fault) stays a pointer.
            if !list.is_empty() {
                args.insert(argv.clone(), Value::Array(list));
            }
        }
        for (arg, fields) in &self.structs {
            let mut o = serde_json::Map::new();
            for (probed, member) in fields {
                if let Some(v) = args.remove(probed).filter(|v| !v.is_null()) {
                    o.insert(member.clone(), v);
                }
            }
            if o.len() == fields.len() {
                args.insert(arg.clone(), Value::Object(o));
            }
        }
    }
}

/// The entry and return probes of call `s`.
pub fn specs(s: &SyscallInfo) -> (String, String) {
    let event = event_name(s);
    let mut entry = format!("p:{GROUP}/{event} {}", s.entry);
    let regs = if s.compat { ARG_REGS_IA32 } else { ARG_REGS };
    let width = |t: &'static str| if s.compat { compat_type(t) } else { t };
    // A call the guest describes as taking no argument shows none; one it
    // does not describe shows its six registers.
    if s.args.is_empty() && s.source == "none" {
        for (i, (off, _)) in regs.iter().enumerate() {
            entry.push_str(&format!(" arg{}=+{off}($arg1):{}", i + 1, width("x64")));
        }
    } else {
        for (i, ((ctype, name), (off, _))) in s.args.iter().zip(regs).enumerate() {
            let string = is_input_string(ctype, name);
            // A 32-bit caller's arrays and structs have its own layout:
            // their pointers are shown.
            let argv = is_argv(ctype, name) && !s.compat;
            let name = arg_name(name);
            if string {
                entry.push_str(&format!(" {name}=+0(+{off}($arg1)):ustring"));
                continue;
            }
            entry.push_str(&format!(
                " {name}=+{off}($arg1):{}",
                width(fetch_type(ctype))
            ));
            if s.compat {
                continue;
            }
            if argv {
                // The strings up to the first null pointer (the host cuts
                // there), and whether there are more.
                for k in 0..MAX_ARGV {
                    entry.push_str(&format!(
                        " {name}_{k}=+0(+{}(+{off}($arg1))):ustring",
                        8 * k
                    ));
                }
                entry.push_str(&format!(
                    " {name}_more=+{}(+{off}($arg1)):x64",
                    8 * MAX_ARGV
                ));
            }
            for st in s.structs.iter().filter(|st| usize::from(st.arg) == i) {
                for f in &st.fields {
                    let t = format!(
                        "{}{}",
                        if f.signed { 's' } else { 'u' },
                        8 * u32::from(f.size)
                    );
                    entry.push_str(&format!(
                        " {}=+{}(+{off}($arg1)):{t}",
                        arg_name(&format!("{name}_{}", f.name)),
                        f.offset
                    ));
                }
            }
        }
    }
    let ret = format!("r:{GROUP}/{event}_ret {} ret=$retval:s64", s.entry);
    (entry, ret)
}

/// An argument name the probe language takes (a C identifier, not a
/// reserved field name).
fn arg_name(name: &str) -> String {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    if !ok || tracelang::kprobe::RESERVED_ARG_NAMES.contains(&name) {
        format!(
            "a_{}",
            name.chars()
                .filter(char::is_ascii_alphanumeric)
                .collect::<String>()
        )
    } else {
        name.to_string()
    }
}

/// `errno` names of the values a call returns negated.
pub fn errno_name(e: i64) -> Option<&'static str> {
    const NAMES: [&str; 41] = [
        "",
        "EPERM",
        "ENOENT",
        "ESRCH",
        "EINTR",
        "EIO",
        "ENXIO",
        "E2BIG",
        "ENOEXEC",
        "EBADF",
        "ECHILD",
        "EAGAIN",
        "ENOMEM",
        "EACCES",
        "EFAULT",
        "ENOTBLK",
        "EBUSY",
        "EEXIST",
        "EXDEV",
        "ENODEV",
        "ENOTDIR",
        "EISDIR",
        "EINVAL",
        "ENFILE",
        "EMFILE",
        "ENOTTY",
        "ETXTBSY",
        "EFBIG",
        "ENOSPC",
        "ESPIPE",
        "EROFS",
        "EMLINK",
        "EPIPE",
        "EDOM",
        "ERANGE",
        "EDEADLK",
        "ENAMETOOLONG",
        "ENOLCK",
        "ENOSYS",
        "ENOTEMPTY",
        "ELOOP",
    ];
    match e {
        1..=40 => NAMES.get(e as usize).copied(),
        61 => Some("ENODATA"),
        75 => Some("EOVERFLOW"),
        95 => Some("EOPNOTSUPP"),
        110 => Some("ETIMEDOUT"),
        512 => Some("ERESTARTSYS"),
        513 => Some("ERESTARTNOINTR"),
        514 => Some("ERESTARTNOHAND"),
        516 => Some("ERESTART_RESTARTBLOCK"),
        _ => None,
    }
}

/// `O_*` flags of an open.
pub fn open_flags(v: u64) -> String {
    const BITS: [(u64, &str); 16] = [
        (0o100, "O_CREAT"),
        (0o200, "O_EXCL"),
        (0o400, "O_NOCTTY"),
        (0o1000, "O_TRUNC"),
        (0o2000, "O_APPEND"),
        (0o4000, "O_NONBLOCK"),
        (0o4010000, "O_SYNC"),
        (0o10000, "O_DSYNC"),
        (0o20000, "O_ASYNC"),
        (0o40000, "O_DIRECT"),
        (0o100000, "O_LARGEFILE"),
        (0o200000, "O_DIRECTORY"),
        (0o400000, "O_NOFOLLOW"),
        (0o1000000, "O_NOATIME"),
        (0o2000000, "O_CLOEXEC"),
        (0o10000000, "O_PATH"),
    ];
    let mut parts = vec![match v & 3 {
        0 => "O_RDONLY".to_string(),
        1 => "O_WRONLY".to_string(),
        2 => "O_RDWR".to_string(),
        _ => "O_ACCMODE".to_string(),
    }];
    let mut left = v & !3;
    for (bit, name) in BITS {
        if left & bit == bit && bit != 0 {
            parts.push(name.to_string());
            left &= !bit;
        }
    }
    if left != 0 {
        parts.push(format!("{left:#o}"));
    }
    parts.join("|")
}

/// `AT_*` flags of the `*at` calls.
pub fn at_flags(v: u64) -> String {
    const BITS: [(u64, &str); 5] = [
        (0x100, "AT_SYMLINK_NOFOLLOW"),
        (0x200, "AT_REMOVEDIR"),
        (0x400, "AT_SYMLINK_FOLLOW"),
        (0x800, "AT_NO_AUTOMOUNT"),
        (0x1000, "AT_EMPTY_PATH"),
    ];
    if v == 0 {
        return "0".into();
    }
    let mut parts = Vec::new();
    let mut left = v;
    for (bit, name) in BITS {
        if left & bit != 0 {
            parts.push(name.to_string());
            left &= !bit;
        }
    }
    if left != 0 {
        parts.push(format!("{left:#x}"));
    }
    parts.join("|")
}

/// `RESOLVE_*` flags of `openat2` (include/uapi/linux/openat2.h).
pub fn resolve_flags(v: u64) -> String {
    const BITS: [(u64, &str); 6] = [
        (0x01, "RESOLVE_NO_XDEV"),
        (0x02, "RESOLVE_NO_MAGICLINKS"),
        (0x04, "RESOLVE_NO_SYMLINKS"),
        (0x08, "RESOLVE_BENEATH"),
        (0x10, "RESOLVE_IN_ROOT"),
        (0x20, "RESOLVE_CACHED"),
    ];
    if v == 0 {
        return "0".into();
    }
    let mut parts: Vec<String> = BITS
        .iter()
        .filter(|(b, _)| v & b != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let left = v & !0x3f;
    if left != 0 {
        parts.push(format!("{left:#x}"));
    }
    parts.join("|")
}

/// One argument as the text line shows it.
fn show_arg(call: &str, name: &str, v: &Value) -> String {
    match v {
        Value::Null => "(fault)".into(),
        Value::String(s) if s.starts_with("0x") => s.clone(),
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) => {
            let i = n.as_i64().unwrap_or(0);
            let u = n.as_u64().unwrap_or(i as u64);
            let is_at = call.ends_with("at") || call.ends_with("at2") || call == "statx";
            match name {
                "dfd" | "olddfd" | "newdfd" | "fd" if i == -100 => "AT_FDCWD".into(),
                "flags" if matches!(call, "open" | "openat") => open_flags(u),
                "resolve" if call == "openat2" => resolve_flags(u),
                "flag" | "flags" if is_at => at_flags(u),
                _ => n.to_string(),
            }
        }
        Value::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(|v| match v.as_str() {
                    Some("...") => "...".to_string(),
                    _ => show_arg(call, "", v),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Object(fields) => format!(
            "{{{}}}",
            fields
                .iter()
                .map(|(k, v)| {
                    let shown = match (k.as_str(), v.as_u64()) {
                        ("flags", Some(u)) if call == "openat2" => open_flags(u),
                        _ => show_arg(call, k, v),
                    };
                    format!("{k}: {shown}")
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// A call's entry, waiting for its return.
struct Entry {
    ts: String,
    cpu: u64,
    comm: String,
    call: String,
    args: serde_json::Map<String, Value>,
}

/// Calls and errors of one call, for `--summary`.
#[derive(Default, Clone, Copy)]
pub struct Tally {
    pub calls: u64,
    pub errors: u64,
}

/// Turns the probes' JSON lines into one line per call.
pub struct Pairer {
    json: bool,
    comm: Option<String>,
    pid: Option<i64>,
    failed: bool,
    /// Each task's call in flight.
    open: HashMap<i64, Entry>,
    /// Per call: calls and errors (of the calls the filters keep), for the
    /// line a run ends with.
    pub tally: BTreeMap<String, Tally>,
    nr: HashMap<String, u32>,
    /// Per call (`sys_openat2`): how its fields fold.
    folds: HashMap<String, Folds>,
    pending: Vec<u8>,
    out: Box<dyn Write + Send>,
}

impl Pairer {
    pub fn new(
        args: &SyscallsArgs,
        nr: HashMap<String, u32>,
        folds: HashMap<String, Folds>,
        out: Box<dyn Write + Send>,
    ) -> Pairer {
        Pairer {
            json: args.json,
            comm: args.comm.clone(),
            pid: args.pid.map(i64::from),
            failed: args.failed,
            open: HashMap::new(),
            tally: BTreeMap::new(),
            nr,
            folds,
            pending: Vec::new(),
            out,
        }
    }

    /// One JSON line of the probes' stream.
    fn line(&mut self, line: &str) -> std::io::Result<()> {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            return Ok(());
        };
        if v.get("group").and_then(Value::as_str) != Some(GROUP) {
            return Ok(());
        }
        let event = v.get("event").and_then(Value::as_str).unwrap_or("");
        let pid = v.get("pid").and_then(Value::as_i64).unwrap_or(-1);
        let args = v
            .get("args")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        if let Some(call) = event.strip_suffix("_ret") {
            let Some(e) = self.open.remove(&pid).filter(|e| e.call == call) else {
                return Ok(());
            };
            let ret = args.get("ret").and_then(Value::as_i64).unwrap_or(0);
            return self.emit(pid, e, Some(ret));
        }
        let Some((_, call)) = parse_event(event) else {
            return Ok(());
        };
        let mut args = args;
        if let Some(f) = self.folds.get(event) {
            f.apply(&mut args);
        }
        let e = Entry {
            ts: v
                .get("ts")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            cpu: v.get("cpu").and_then(Value::as_u64).unwrap_or(0),
            comm: v
                .get("comm")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            call: event.to_string(),
            args,
        };
        if NO_RETURN.contains(&call) {
            return self.emit(pid, e, None);
        }
        // A call whose return never came (the task died in it) is shown
        // without a value when its task makes the next one.
        if let Some(old) = self.open.insert(pid, e) {
            self.emit(pid, old, None)?;
        }
        Ok(())
    }

    fn emit(&mut self, pid: i64, e: Entry, ret: Option<i64>) -> std::io::Result<()> {
        let (compat, name) = parse_event(&e.call).unwrap_or((false, &e.call));
        let name = name.to_string();
        let error = ret.filter(|&r| (-4095..0).contains(&r)).map(|r| -r);
        if self.comm.as_ref().is_some_and(|c| *c != e.comm)
            || self.pid.is_some_and(|p| p != pid)
            || (self.failed && error.is_none())
        {
            return Ok(());
        }
        let t = self.tally.entry(summary_name(&name, compat)).or_default();
        t.calls += 1;
        t.errors += u64::from(error.is_some());
        let mut s = String::new();
        if self.json {
            let mut o = serde_json::Map::new();
            o.insert("ts".into(), Value::from(e.ts.clone()));
            o.insert("cpu".into(), Value::from(e.cpu));
            o.insert("pid".into(), Value::from(pid));
            o.insert("comm".into(), Value::from(e.comm.clone()));
            o.insert("syscall".into(), Value::from(name.clone()));
            o.insert(
                "abi".into(),
                Value::from(if compat { "ia32" } else { "x64" }),
            );
            if let Some(nr) = self.nr.get(&e.call) {
                o.insert("nr".into(), Value::from(*nr));
            }
            o.insert("args".into(), Value::Object(e.args.clone()));
            o.insert("ret".into(), ret.map_or(Value::Null, Value::from));
            if let Some(err) = error {
                o.insert(
                    "error".into(),
                    errno_name(err).map_or(Value::from(err), Value::from),
                );
            }
            s = Value::Object(o).to_string();
        } else {
            let args: Vec<String> = e
                .args
                .iter()
                .map(|(k, v)| format!("{k}: {}", show_arg(&name, k, v)))
                .collect();
            let tail = match (ret, error) {
                (None, _) => " = ?".to_string(),
                (Some(r), Some(err)) => match errno_name(err) {
                    Some(n) => format!(" = {r} {n}"),
                    None => format!(" = {r}"),
                },
                (Some(r), None) if !(-0xffff..=0xffff).contains(&r) => format!(" = {r:#x}"),
                (Some(r), None) => format!(" = {r}"),
            };
            s.push_str(&term::sanitize(&format!(
                "{}-{pid} [{:03}] {}: {}sys_{name}({}){tail}",
                e.comm,
                e.cpu,
                e.ts,
                if compat { "ia32 " } else { "" },
                args.join(", ")
            )));
        }
        s.push('\n');
        self.out.write_all(s.as_bytes())
    }
}

/// A writer of the probes' JSON lines that pairs them ([`Pairer`]).
struct PairWriter(Arc<Mutex<Pairer>>);

impl Write for PairWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut p = self
            .0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?;
        p.pending.extend_from_slice(buf);
        while let Some(nl) = p.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = p.pending.drain(..=nl).collect();
            let text = String::from_utf8_lossy(&line);
            p.line(text.trim_end())?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .out
            .flush()
    }
}

/// Deletes the probes `names` (each `GROUP/EVENT`), quietly.
fn delete(control: &mut dyn Control, names: &[String]) {
    for name in names {
        let _ = control.request(Request::ProbeDel { name: name.clone() }, PROBE_TIMEOUT);
    }
}

/// The probes of the calls chosen, added.
pub struct Armed {
    /// The probes added (`GROUP/EVENT`), to delete at the end.
    pub added: Vec<String>,
    /// Number of each call traced, by event (`sys_openat`, `sys32_open`).
    pub nr: HashMap<String, u32>,
    /// How each call's fields fold (by event, `sys_openat2`).
    pub folds: HashMap<String, Folds>,
}

/// Adds the entry and return probes of the calls `names` (every call when
/// empty) of the guest's `table`, and says on stderr how many and where
/// their arguments came from. `None`: a Ctrl-C came first (what was added
/// is deleted).
pub fn arm(
    control: &mut dyn Control,
    table: &[SyscallInfo],
    names: &[String],
) -> Result<Option<Armed>> {
    let chosen = select(table, names)?;
    let mut added = Vec::new();
    let mut skipped = Vec::new();
    let t0 = Instant::now();
    for s in &chosen {
        if sys::interrupted() {
            delete(control, &added);
            return Ok(None);
        }
        let (entry, ret) = specs(s);
        match add_probe(control, &entry) {
            Ok((name, _)) => added.push(name),
            Err(e) => {
                skipped.push(format!("{}: {e:#}", s.name));
                continue;
            }
        }
        match add_probe(control, &ret) {
            Ok((name, _)) => added.push(name),
            Err(e) => skipped.push(format!("{} (return): {e:#}", s.name)),
        }
    }
    for line in crosscheck_lines(table) {
        eprintln!("hvtrace: {}", term::sanitize(&line));
    }
    let sources = |src: &str| chosen.iter().filter(|s| s.source == src).count();
    let compat = chosen.iter().filter(|s| s.compat).count();
    if compat > 0 {
        eprintln!("hvtrace: {compat} of the calls are IA32 emulation's (32-bit callers)");
    }
    eprintln!(
        "hvtrace: tracing {} system calls ({} with the guest's metadata, {} from BTF, {} from the ABI table, {} raw) in {:.1} s",
        chosen.len() - skipped.len().min(chosen.len()),
        sources("metadata"),
        sources("btf"),
        sources("table"),
        sources("none"),
        t0.elapsed().as_secs_f64()
    );
    for s in skipped.iter().take(8) {
        eprintln!("hvtrace: skipped {}", term::sanitize(s));
    }
    if added.is_empty() {
        bail!("no system call could be traced");
    }
    Ok(Some(Armed {
        added,
        nr: chosen.iter().map(|s| (event_name(s), s.nr)).collect(),
        folds: chosen
            .iter()
            .map(|s| (event_name(s), Folds::of(s)))
            .collect(),
    }))
}

/// A writer that takes the probes' JSON lines and writes one line per
/// call to the pairer's output.
pub fn pair_writer(pairer: Arc<Mutex<Pairer>>) -> Box<dyn Write + Send> {
    Box::new(PairWriter(pairer))
}

/// With a task filter (`--comm`, `--pid`): a gate session with that
/// filter, and every probe [`arm`] added put behind it, so that root
/// records only those tasks' calls and leaves the calls' wrappers unhooked
/// on the vCPUs that run other tasks (the quiet views). Returns the
/// session, to stop at the end; `None` without a filter, or when root
/// cannot gate (then the filter runs on the host alone, and every task's
/// calls still exit).
pub fn gate(
    control: &mut dyn Control,
    armed: &Armed,
    pid: Option<i32>,
    comm: Option<&str>,
) -> Option<u32> {
    let session = super::count::gate_session(control, pid, comm)?;
    for name in &armed.added {
        let gated = control.request(
            Request::ProbeGate {
                name: name.clone(),
                session: Some(session),
            },
            PROBE_TIMEOUT,
        );
        if !matches!(gated, Ok(Response::Ok)) {
            eprintln!(
                "hvtrace: note: {} records every task's calls (the host filters them)",
                term::sanitize(name)
            );
        }
    }
    Some(session)
}

/// Stops the gate session [`gate`] started, quietly.
pub fn ungate(control: &mut dyn Control, session: Option<u32>) {
    if let Some(s) = session {
        let _ = control.request(Request::GraphStop { session: Some(s) }, PROBE_TIMEOUT);
    }
}

/// Most calls `--summary` names one by one (a count's globs); more, and
/// it counts every call and shows those named.
const SUMMARY_NAMED: usize = 32;

/// `--summary`: calls, errors and time per call, counted in VMX root (a
/// count of the calls' `__x64_sys_` entries, timed through their returns,
/// filtered there by pid and comm); no call is recorded.
fn summary(socket: &Path, table: &[SyscallInfo], args: &SyscallsArgs) -> Result<u8> {
    let chosen = select(table, &args.names)?;
    let every = args.names.is_empty() || chosen.len() > SUMMARY_NAMED;
    let functions = if every {
        let mut g = vec!["__x64_sys_*".to_string()];
        if chosen.iter().any(|s| s.compat) {
            g.extend([
                "__ia32_sys_*".to_string(),
                "__ia32_compat_sys_*".to_string(),
            ]);
        }
        g
    } else {
        chosen.iter().map(|s| s.entry.clone()).collect()
    };
    let wanted: HashMap<&str, String> = chosen
        .iter()
        .map(|s| (s.entry.as_str(), summary_name(&s.name, s.compat)))
        .collect();
    let filter = super::count::filter(&functions, args.pid, args.comm.as_deref(), true)?;
    let o = crate::commands::cli::AggregateArgs {
        pid: args.pid,
        comm: args.comm.clone(),
        interval: None,
        duration: args.duration,
        exec: args.exec.clone(),
        json: args.json,
    };
    let json = args.json;
    super::count::aggregate(socket, filter, "syscalls: ", &o, true, &mut |c, _| {
        let counts = super::count::read(c)?;
        let rows: Vec<SummaryRow> = counts
            .entries
            .iter()
            .filter_map(|e| {
                let name = wanted.get(e.name.as_str())?;
                Some(SummaryRow {
                    name: name.to_string(),
                    calls: e.calls,
                    errors: e.errors,
                    ns: e.total_ns,
                })
            })
            .collect();
        if json {
            println!("{}", summary_json(&rows));
        } else {
            print!("{}", summary_text(&rows));
        }
        Ok(())
    })
}

/// One call's line of `--summary`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SummaryRow {
    pub name: String,
    pub calls: u64,
    pub errors: u64,
    /// Time in the call, summed over its returns (ns).
    pub ns: u64,
}

/// `--summary` as `strace -c` prints it: most time first.
pub fn summary_text(rows: &[SummaryRow]) -> String {
    let mut rows: Vec<&SummaryRow> = rows.iter().collect();
    rows.sort_by(|a, b| {
        b.ns.cmp(&a.ns)
            .then(b.calls.cmp(&a.calls))
            .then(a.name.cmp(&b.name))
    });
    let total_ns: u64 = rows.iter().map(|r| r.ns).sum();
    let rule = format!(
        "{:-<6} {:-<11} {:-<11} {:-<9} {:-<9} {:-<16}\n",
        "", "", "", "", "", ""
    );
    let mut s = format!(
        "{:>6} {:>11} {:>11} {:>9} {:>9} syscall\n",
        "% time", "seconds", "usecs/call", "calls", "errors"
    );
    s.push_str(&rule);
    let pct = |ns: u64| {
        if total_ns == 0 {
            0.0
        } else {
            100.0 * ns as f64 / total_ns as f64
        }
    };
    let errors = |e: u64| if e == 0 { String::new() } else { e.to_string() };
    for r in &rows {
        s.push_str(&format!(
            "{:>6.2} {:>11.6} {:>11} {:>9} {:>9} {}\n",
            pct(r.ns),
            r.ns as f64 / 1e9,
            (r.ns / 1000).checked_div(r.calls).unwrap_or(0),
            r.calls,
            errors(r.errors),
            r.name
        ));
    }
    s.push_str(&rule);
    let calls: u64 = rows.iter().map(|r| r.calls).sum();
    let errs: u64 = rows.iter().map(|r| r.errors).sum();
    s.push_str(&format!(
        "{:>6.2} {:>11.6} {:>11} {:>9} {:>9} total\n",
        if total_ns == 0 { 0.0 } else { 100.0 },
        total_ns as f64 / 1e9,
        (total_ns / 1000).checked_div(calls).unwrap_or(0),
        calls,
        errors(errs)
    ));
    s
}

/// `--summary --json`: one object, a row per call.
pub fn summary_json(rows: &[SummaryRow]) -> String {
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "syscall": r.name,
                "calls": r.calls,
                "errors": r.errors,
                "ns": r.ns,
            })
        })
        .collect();
    serde_json::json!({ "summary": rows }).to_string()
}

/// `hvtrace syscalls`.
pub fn syscalls(socket: &Path, args: &SyscallsArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let table = table(&mut client)?;
    if args.list {
        for s in &table {
            let a: Vec<String> = s.args.iter().map(|(t, n)| format!("{t} {n}")).collect();
            let abi = if s.compat { "ia32 " } else { "" };
            println!(
                "{:>4} {abi}{}({}) [{}]",
                s.nr,
                s.name,
                a.join(", "),
                s.source
            );
        }
        for line in crosscheck_lines(&table) {
            eprintln!("hvtrace: {}", term::sanitize(&line));
        }
        return Ok(0);
    }
    if args.summary {
        drop(client);
        return summary(socket, &table, args);
    }
    // The stream from now on: the calls the probes below will record.
    let mut reader = TraceReader::at_end(&mut client, TraceFormat::Json)?.with_source(Some(0));
    super::count::check_comm(args.comm.as_deref())?;
    let Some(armed) = arm(&mut client, &table, &args.names)? else {
        return Ok(INTERRUPTED_EXIT);
    };
    let gated = gate(&mut client, &armed, args.pid, args.comm.as_deref());
    let added = armed.added.clone();
    let (nr, folds) = (armed.nr, armed.folds);
    let pairer = Arc::new(Mutex::new(Pairer::new(
        args,
        nr,
        folds,
        Box::new(std::io::stdout()),
    )));
    let mut out = match &args.trace_dat {
        Some(path) => {
            // The probes' lines go to the file, and on to the pairer.
            let mut out =
                TraceOutput::trace_dat(path)?.with_json_copy(Box::new(PairWriter(pairer.clone())));
            out.learn(&mut client);
            out
        }
        None => TraceOutput::copy(Box::new(PairWriter(pairer.clone()))),
    };
    let start = Instant::now();
    let duration = args.duration.map(Duration::from_secs_f64);
    let end = if let Some(cmd) = &args.exec {
        let reply = client.call(
            Request::Exec {
                command: cmd.clone(),
            },
            EXEC_TIMEOUT,
        );
        if let Ok(r) = &reply {
            if let Response::Exec { output, .. } = &r.response {
                eprint!("{}", term::sanitize(output));
            }
        }
        copy_trace(
            &mut client,
            &mut reader,
            false,
            FOLLOW_WAIT_MS,
            &mut out,
            &sys::interrupted,
        )
    } else {
        let stop = || sys::interrupted() || duration.is_some_and(|d| start.elapsed() >= d);
        copy_trace(
            &mut client,
            &mut reader,
            true,
            FOLLOW_WAIT_MS,
            &mut out,
            &stop,
        )
    };
    // The file is written while the VM and its probes are still there.
    let vm_alive = !matches!(end, Ok(CopyEnd::VmEnded(_)));
    let written = out.finish(vm_alive.then_some(&mut client as &mut dyn Control));
    delete(&mut client, &added);
    ungate(&mut client, gated);
    drop(pairer);
    if let Some(summary) = written? {
        eprintln!("hvtrace: {}", summary.line());
    }
    match end? {
        CopyEnd::VmEnded(why) => {
            eprintln!("hvtrace: {}", term::sanitize(&why));
            Ok(1)
        }
        CopyEnd::Stopped if duration.is_none_or(|d| start.elapsed() < d) => Ok(INTERRUPTED_EXIT),
        _ => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn openat() -> SyscallInfo {
        SyscallInfo {
            nr: 257,
            name: "openat".into(),
            entry: "__x64_sys_openat".into(),
            args: vec![
                ("int".into(), "dfd".into()),
                ("const char *".into(), "filename".into()),
                ("int".into(), "flags".into()),
                ("umode_t".into(), "mode".into()),
            ],
            source: "metadata".into(),
            structs: vec![],
            compat: false,
        }
    }

    #[test]
    fn the_probes_read_the_callers_registers() {
        let (entry, ret) = specs(&openat());
        assert_eq!(
            entry,
            "p:hvsys/sys_openat __x64_sys_openat dfd=+112($arg1):s32 \
             filename=+0(+104($arg1)):ustring flags=+96($arg1):s32 mode=+56($arg1):u32"
        );
        assert_eq!(
            ret,
            "r:hvsys/sys_openat_ret __x64_sys_openat ret=$retval:s64"
        );
        // Both parse as the probe language wants.
        for s in [&entry, &ret] {
            tracelang::kprobe::parse_probe(s).unwrap();
        }
        let raw = SyscallInfo {
            args: vec![],
            source: "none".into(),
            ..openat()
        };
        let (entry, _) = specs(&raw);
        assert!(entry.ends_with("arg6=+64($arg1):x64"), "{entry}");
        // getpid takes nothing: nothing is read.
        let none = SyscallInfo {
            args: vec![],
            ..openat()
        };
        assert_eq!(specs(&none).0, "p:hvsys/sys_openat __x64_sys_openat");
        // write's buffer is bytes, its pointer is shown.
        let write = SyscallInfo {
            name: "write".into(),
            entry: "__x64_sys_write".into(),
            args: vec![
                ("unsigned int".into(), "fd".into()),
                ("const char *".into(), "buf".into()),
                ("size_t".into(), "count".into()),
            ],
            ..openat()
        };
        let (entry, _) = specs(&write);
        assert!(entry.contains(" buf=+104($arg1):x64 "), "{entry}");
        tracelang::kprobe::parse_probe(&entry).unwrap();
    }

    #[test]
    fn flags_and_errors_are_named() {
        assert_eq!(open_flags(0), "O_RDONLY");
        assert_eq!(
            open_flags(0o2000000 | 0o100 | 1),
            "O_WRONLY|O_CREAT|O_CLOEXEC"
        );
        assert_eq!(at_flags(0x100), "AT_SYMLINK_NOFOLLOW");
        assert_eq!(errno_name(2), Some("ENOENT"));
        assert_eq!(errno_name(13), Some("EACCES"));
    }

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn args(json: bool, failed: bool) -> SyscallsArgs {
        SyscallsArgs {
            names: vec![],
            comm: None,
            pid: None,
            failed,
            json,
            trace_dat: None,
            summary: false,
            list: false,
            duration: None,
            exec: None,
        }
    }

    #[test]
    fn entries_and_returns_pair_per_task() {
        let sink = Sink::default();
        let mut p = Pairer::new(
            &args(false, false),
            HashMap::new(),
            HashMap::new(),
            Box::new(sink.clone()),
        );
        let lines = [
            r#"{"ts":"129.620001","ts_ns":1,"cpu":0,"pid":97,"comm":"cat","group":"hvsys","event":"sys_openat","kind":"kprobe","ip":"0x1","probe":"x","args":{"dfd":-100,"filename":"/etc/hostname","flags":0,"mode":0}}"#,
            r#"{"ts":"129.620002","ts_ns":2,"cpu":0,"pid":98,"comm":"sh","group":"hvsys","event":"sys_openat","kind":"kprobe","ip":"0x1","probe":"x","args":{"dfd":-100,"filename":"/nope","flags":524288,"mode":0}}"#,
            r#"{"ts":"129.620003","ts_ns":3,"cpu":0,"pid":97,"comm":"cat","group":"hvsys","event":"sys_openat_ret","kind":"kretprobe","ip":"0x1","probe":"x","args":{"ret":3}}"#,
            r#"{"ts":"129.620004","ts_ns":4,"cpu":0,"pid":98,"comm":"sh","group":"hvsys","event":"sys_openat_ret","kind":"kretprobe","ip":"0x1","probe":"x","args":{"ret":-2}}"#,
        ];
        for l in lines {
            p.line(l).unwrap();
        }
        let out = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            out,
            "cat-97 [000] 129.620001: sys_openat(dfd: AT_FDCWD, filename: \"/etc/hostname\", flags: O_RDONLY, mode: 0) = 3\n\
             sh-98 [000] 129.620002: sys_openat(dfd: AT_FDCWD, filename: \"/nope\", flags: O_RDONLY|O_CLOEXEC, mode: 0) = -2 ENOENT\n"
        );
        let t = p.tally["openat"];
        assert_eq!((t.calls, t.errors), (2, 1));
        // --failed keeps the failure only; JSON carries every field typed.
        let sink = Sink::default();
        let mut p = Pairer::new(
            &args(true, true),
            [("sys_openat".to_string(), 257)].into(),
            HashMap::new(),
            Box::new(sink.clone()),
        );
        for l in lines {
            p.line(l).unwrap();
        }
        let out = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["nr"], 257);
        assert_eq!(v["ret"], -2);
        assert_eq!(v["error"], "ENOENT");
        assert_eq!(v["args"]["filename"], "/nope");
        assert_eq!(out.lines().count(), 1);
    }

    #[test]
    fn argv_and_input_structs_fold_into_their_argument() {
        let execve = SyscallInfo {
            nr: 59,
            name: "execve".into(),
            entry: "__x64_sys_execve".into(),
            args: vec![
                ("const char *".into(), "filename".into()),
                ("const char *const *".into(), "argv".into()),
                ("const char *const *".into(), "envp".into()),
            ],
            source: "metadata".into(),
            structs: vec![],
            compat: false,
        };
        let (entry, _) = specs(&execve);
        assert!(
            entry.contains(" argv=+104($arg1):x64 argv_0=+0(+0(+104($arg1))):ustring argv_1=+0(+8(+104($arg1))):ustring"),
            "{entry}"
        );
        assert!(
            entry.contains(" argv_more=+64(+104($arg1)):x64 envp=+96($arg1):x64"),
            "{entry}"
        );
        assert!(!entry.contains("envp_0"), "{entry}");
        tracelang::kprobe::parse_probe(&entry).unwrap();
        let field = |name: &str, offset| protocol::SyscallField {
            name: name.into(),
            offset,
            size: 8,
            signed: false,
        };
        let openat2 = SyscallInfo {
            nr: 437,
            name: "openat2".into(),
            entry: "__x64_sys_openat2".into(),
            args: vec![
                ("int".into(), "dfd".into()),
                ("const char *".into(), "filename".into()),
                ("struct open_how *".into(), "how".into()),
                ("size_t".into(), "usize".into()),
            ],
            source: "metadata".into(),
            structs: vec![protocol::SyscallStruct {
                arg: 2,
                name: "open_how".into(),
                fields: vec![field("flags", 0), field("mode", 8), field("resolve", 16)],
            }],
            compat: false,
        };
        let (entry, _) = specs(&openat2);
        assert!(
            entry.contains(" how=+96($arg1):x64 how_flags=+0(+96($arg1)):u64 how_mode=+8(+96($arg1)):u64 how_resolve=+16(+96($arg1)):u64 usize="),
            "{entry}"
        );
        tracelang::kprobe::parse_probe(&entry).unwrap();

        let sink = Sink::default();
        let folds = [
            ("sys_execve".to_string(), Folds::of(&execve)),
            ("sys_openat2".to_string(), Folds::of(&openat2)),
        ]
        .into();
        let mut p = Pairer::new(
            &args(false, false),
            HashMap::new(),
            folds,
            Box::new(sink.clone()),
        );
        let lines = [
            // argv ends at its null pointer: the read of argv[2]'s string faults.
            r#"{"ts":"1.000001","cpu":0,"pid":7,"comm":"sh","group":"hvsys","event":"sys_execve","args":{"filename":"/bin/hvbench","argv":"0x7ffd0010","argv_0":"hvbench","argv_1":"exec-child","argv_2":null,"argv_3":"junk","argv_4":null,"argv_5":null,"argv_6":null,"argv_7":null,"argv_more":"0x1234","envp":"0x7ffd0040"}}"#,
            r#"{"ts":"1.000002","cpu":0,"pid":7,"comm":"hvbench","group":"hvsys","event":"sys_execve_ret","args":{"ret":0}}"#,
            r#"{"ts":"1.000003","cpu":0,"pid":7,"comm":"hvbench","group":"hvsys","event":"sys_openat2","args":{"dfd":-100,"filename":"/etc/hostname","how":"0x7ffd0100","how_flags":524288,"how_mode":0,"how_resolve":4,"usize":24}}"#,
            r#"{"ts":"1.000004","cpu":0,"pid":7,"comm":"hvbench","group":"hvsys","event":"sys_openat2_ret","args":{"ret":3}}"#,
            // A null `how`: every member faults, the pointer stays.
            r#"{"ts":"1.000005","cpu":0,"pid":7,"comm":"hvbench","group":"hvsys","event":"sys_openat2","args":{"dfd":-100,"filename":"/x","how":"0x0","how_flags":null,"how_mode":null,"how_resolve":null,"usize":24}}"#,
            r#"{"ts":"1.000006","cpu":0,"pid":7,"comm":"hvbench","group":"hvsys","event":"sys_openat2_ret","args":{"ret":-14}}"#,
        ];
        for l in lines {
            p.line(l).unwrap();
        }
        let out = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let want = "sh-7 [000] 1.000001: sys_execve(filename: \"/bin/hvbench\", argv: [\"hvbench\", \"exec-child\"], envp: 0x7ffd0040) = 0\n\
             hvbench-7 [000] 1.000003: sys_openat2(dfd: AT_FDCWD, filename: \"/etc/hostname\", how: {flags: O_RDONLY|O_CLOEXEC, mode: 0, resolve: RESOLVE_NO_SYMLINKS}, usize: 24) = 3\n\
             hvbench-7 [000] 1.000005: sys_openat2(dfd: AT_FDCWD, filename: \"/x\", how: 0x0, usize: 24) = -14 EFAULT\n";
        assert_eq!(out, want);
    }

    #[test]
    fn the_summary_reads_as_strace_c() {
        let rows = [
            SummaryRow {
                name: "openat".into(),
                calls: 4,
                errors: 1,
                ns: 3_000_000,
            },
            SummaryRow {
                name: "read".into(),
                calls: 2,
                errors: 0,
                ns: 1_000_000,
            },
        ];
        let want = "\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
\x2075.00    0.003000         750         4         1 openat
\x2025.00    0.001000         500         2           read
------ ----------- ----------- --------- --------- ----------------
100.00    0.004000         666         6         1 total
";
        assert_eq!(summary_text(&rows), want);
        let v: Value = serde_json::from_str(&summary_json(&rows)).unwrap();
        assert_eq!(v["summary"][0]["errors"], 1);
        assert_eq!(v["summary"][1]["calls"], 2);
    }

    #[test]
    fn a_32_bit_call_reads_its_registers_at_32_bits() {
        let open = SyscallInfo {
            nr: 5,
            name: "open".into(),
            entry: "__ia32_compat_sys_open".into(),
            args: vec![
                ("const char *".into(), "filename".into()),
                ("int".into(), "flags".into()),
                ("umode_t".into(), "mode".into()),
            ],
            source: "metadata".into(),
            structs: vec![],
            compat: true,
        };
        let (entry, ret) = specs(&open);
        assert_eq!(
            entry,
            "p:hvsys/sys32_open __ia32_compat_sys_open filename=+0(+40($arg1)):ustring \
             flags=+88($arg1):s32 mode=+96($arg1):u32"
        );
        assert_eq!(
            ret,
            "r:hvsys/sys32_open_ret __ia32_compat_sys_open ret=$retval:s64"
        );
        for s in [&entry, &ret] {
            tracelang::kprobe::parse_probe(s).unwrap();
        }
        let sink = Sink::default();
        let mut p = Pairer::new(
            &args(false, false),
            [("sys32_open".to_string(), 5)].into(),
            HashMap::new(),
            Box::new(sink.clone()),
        );
        for l in [
            r#"{"ts":"2.000001","cpu":0,"pid":9,"comm":"hvcompat","group":"hvsys","event":"sys32_open","args":{"filename":"/etc/hostname","flags":0,"mode":0}}"#,
            r#"{"ts":"2.000002","cpu":0,"pid":9,"comm":"hvcompat","group":"hvsys","event":"sys32_open_ret","args":{"ret":3}}"#,
        ] {
            p.line(l).unwrap();
        }
        let out = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            out,
            "hvcompat-9 [000] 2.000001: ia32 sys_open(filename: \"/etc/hostname\", flags: O_RDONLY, mode: 0) = 3\n"
        );
        assert_eq!(p.tally["open (ia32)"].calls, 1);
    }

    #[test]
    fn a_task_filter_puts_every_probe_behind_a_gate() {
        use crate::client::testing::Canned;
        let armed = Armed {
            added: vec!["hvsys/sys_openat".into(), "hvsys/sys_openat_ret".into()],
            nr: HashMap::new(),
            folds: HashMap::new(),
        };
        let mut c = Canned {
            answers: [
                Ok(Response::GraphStarted {
                    session: 3,
                    hooked: 0,
                    roots: 0,
                    skipped: 0,
                }),
                Ok(Response::Ok),
                Ok(Response::Ok),
                Ok(Response::Ok),
            ]
            .into(),
            seen: vec![],
        };
        assert_eq!(gate(&mut c, &armed, None, Some("cat")), Some(3));
        ungate(&mut c, Some(3));
        assert_eq!(
            c.seen,
            [
                Request::GraphStart(protocol::GraphFilter {
                    comm: Some("cat".into()),
                    gate: true,
                    ..protocol::GraphFilter::default()
                }),
                Request::ProbeGate {
                    name: "hvsys/sys_openat".into(),
                    session: Some(3),
                },
                Request::ProbeGate {
                    name: "hvsys/sys_openat_ret".into(),
                    session: Some(3),
                },
                Request::GraphStop { session: Some(3) },
            ]
        );
        // No filter: no gate, nothing asked.
        let mut c = Canned {
            answers: [].into(),
            seen: vec![],
        };
        assert_eq!(gate(&mut c, &armed, None, None), None);
        ungate(&mut c, None);
        assert!(c.seen.is_empty());
        // A root that cannot gate: the host filters alone.
        let mut c = Canned {
            answers: [Ok(Response::error(
                protocol::ErrorKind::OutOfResources,
                "15 function-graph sessions already run",
            ))]
            .into(),
            seen: vec![],
        };
        assert_eq!(gate(&mut c, &armed, Some(7), None), None);
        assert_eq!(c.seen.len(), 1);
    }

    #[test]
    fn the_guests_numbers_are_checked_against_the_abi() {
        let call = |nr, name: &str, compat| SyscallInfo {
            nr,
            name: name.into(),
            entry: String::new(),
            args: vec![],
            source: "none".into(),
            structs: vec![],
            compat,
        };
        // read and openat where the ABI has them; write moved to 9.
        let lines = crosscheck_lines(&[
            call(0, "read", false),
            call(257, "openat", false),
            call(9, "write", false),
        ]);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0]
                .starts_with("the guest's x86-64 calls against the ABI table: 2 agree, 1 differ"),
            "{}",
            lines[0]
        );
        assert!(
            lines[0]
                .contains("; write is 9 in the guest (the table has mmap there, the guest's used)"),
            "{}",
            lines[0]
        );
        // A 32-bit call is checked against i386's numbers.
        let lines = crosscheck_lines(&[call(0, "read", false), call(5, "open", true)]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[1].contains("i386 calls against the ABI table: 1 agree, 0 differ"),
            "{}",
            lines[1]
        );
    }
}
