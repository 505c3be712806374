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

use anyhow::{anyhow, bail, Result};
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

/// The calls named (`openat` or `sys_openat`), or every call.
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
        match table.iter().find(|s| s.name == want) {
            Some(s) => out.push(s),
            None => bail!(
                "the guest has no system call {n:?} (`hvtrace syscalls --list` lists its calls)"
            ),
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

/// The entry and return probes of call `s`.
pub fn specs(s: &SyscallInfo) -> (String, String) {
    let mut entry = format!("p:{GROUP}/sys_{} {}", s.name, s.entry);
    if s.args.is_empty() {
        for (i, (off, _)) in ARG_REGS.iter().enumerate() {
            entry.push_str(&format!(" arg{}=+{off}($arg1):x64", i + 1));
        }
    } else {
        for ((ctype, name), (off, _)) in s.args.iter().zip(ARG_REGS) {
            let string = is_input_string(ctype, name);
            let name = arg_name(name);
            if string {
                entry.push_str(&format!(" {name}=+0(+{off}($arg1)):ustring"));
            } else {
                entry.push_str(&format!(" {name}=+{off}($arg1):{}", fetch_type(ctype)));
            }
        }
    }
    let ret = format!("r:{GROUP}/sys_{}_ret {} ret=$retval:s64", s.name, s.entry);
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
                "flag" | "flags" if is_at => at_flags(u),
                _ => n.to_string(),
            }
        }
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
    /// Per call: calls and errors (of the calls the filters keep).
    pub tally: BTreeMap<String, Tally>,
    nr: HashMap<String, u32>,
    pending: Vec<u8>,
    out: Box<dyn Write + Send>,
}

impl Pairer {
    pub fn new(
        args: &SyscallsArgs,
        nr: HashMap<String, u32>,
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
        let Some(call) = event.strip_prefix("sys_") else {
            return Ok(());
        };
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
        let name = e.call.strip_prefix("sys_").unwrap_or(&e.call).to_string();
        let error = ret.filter(|&r| (-4095..0).contains(&r)).map(|r| -r);
        if self.comm.as_ref().is_some_and(|c| *c != e.comm)
            || self.pid.is_some_and(|p| p != pid)
            || (self.failed && error.is_none())
        {
            return Ok(());
        }
        let t = self.tally.entry(name.clone()).or_default();
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
            if let Some(nr) = self.nr.get(&name) {
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
                "{}-{pid} [{:03}] {}: sys_{name}({}){tail}",
                e.comm,
                e.cpu,
                e.ts,
                args.join(", ")
            )));
        }
        s.push('\n');
        self.out.write_all(s.as_bytes())
    }

    /// `--summary`: calls and errors per call, most called first.
    pub fn summary(&self) -> String {
        let mut rows: Vec<(&String, &Tally)> = self.tally.iter().collect();
        rows.sort_by(|a, b| b.1.calls.cmp(&a.1.calls).then(a.0.cmp(b.0)));
        let mut s = format!("{:>9} {:>9} syscall\n", "calls", "errors");
        s.push_str(&format!("{:-<9} {:-<9} {:-<16}\n", "", "", ""));
        let (mut calls, mut errors) = (0, 0);
        for (name, t) in rows {
            let e = if t.errors == 0 {
                String::new()
            } else {
                t.errors.to_string()
            };
            s.push_str(&format!("{:>9} {:>9} {name}\n", t.calls, e));
            calls += t.calls;
            errors += t.errors;
        }
        s.push_str(&format!("{:-<9} {:-<9} {:-<16}\n", "", "", ""));
        s.push_str(&format!("{calls:>9} {errors:>9} total\n"));
        s
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

/// `hvtrace syscalls`.
pub fn syscalls(socket: &Path, args: &SyscallsArgs) -> Result<u8> {
    let mut client = open(socket)?;
    let table = table(&mut client)?;
    if args.list {
        for s in &table {
            let a: Vec<String> = s.args.iter().map(|(t, n)| format!("{t} {n}")).collect();
            println!("{:>4} {}({}) [{}]", s.nr, s.name, a.join(", "), s.source);
        }
        return Ok(0);
    }
    let chosen = select(&table, &args.names)?;
    // The stream from now on: the calls the probes below will record.
    let mut reader = TraceReader::at_end(&mut client, TraceFormat::Json)?.with_source(Some(0));
    let nr: HashMap<String, u32> = chosen.iter().map(|s| (s.name.clone(), s.nr)).collect();
    let mut added = Vec::new();
    let mut skipped = Vec::new();
    let t0 = Instant::now();
    for s in &chosen {
        if sys::interrupted() {
            delete(&mut client, &added);
            return Ok(INTERRUPTED_EXIT);
        }
        let (entry, ret) = specs(s);
        match add_probe(&mut client, &entry) {
            Ok((name, _)) => added.push(name),
            Err(e) => {
                skipped.push(format!("{}: {e:#}", s.name));
                continue;
            }
        }
        match add_probe(&mut client, &ret) {
            Ok((name, _)) => added.push(name),
            Err(e) => skipped.push(format!("{} (return): {e:#}", s.name)),
        }
    }
    let sources = |src: &str| chosen.iter().filter(|s| s.source == src).count();
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
        eprintln!("hvtrace: skipped {s}");
    }
    if added.is_empty() {
        bail!("no system call could be traced");
    }
    let pairer = Arc::new(Mutex::new(Pairer::new(
        args,
        nr,
        Box::new(std::io::stdout()),
    )));
    let mut out = TraceOutput::copy(Box::new(PairWriter(pairer.clone())));
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
    delete(&mut client, &added);
    let p = pairer
        .lock()
        .map_err(|_| anyhow!("the trace writer failed"))?;
    if args.summary {
        print!("{}", p.summary());
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
            ..openat()
        };
        let (entry, _) = specs(&raw);
        assert!(entry.ends_with("arg6=+64($arg1):x64"), "{entry}");
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
            summary: false,
            list: false,
            duration: None,
            exec: None,
        }
    }

    #[test]
    fn entries_and_returns_pair_per_task() {
        let sink = Sink::default();
        let mut p = Pairer::new(&args(false, false), HashMap::new(), Box::new(sink.clone()));
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
        // The summary counts what the filters keep.
        assert!(
            p.summary().contains("        2         1 openat"),
            "{}",
            p.summary()
        );
        // --failed keeps the failure only; JSON carries every field typed.
        let sink = Sink::default();
        let mut p = Pairer::new(
            &args(true, true),
            [("openat".to_string(), 257)].into(),
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
}
