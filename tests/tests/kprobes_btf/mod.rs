//! BTF arguments from VMX root against the guest's own kprobe_events, on
//! the kprobes test's boot (`btf_args`):
//!
//! - the same workload (`cat /etc/hostname`, a `dd` of it in 3-byte
//!   blocks) under our probes and under the guest's: a member chain to a
//!   string (`file->f_path.dentry->d_name.name`, and `%pD`), `$arg*` on
//!   `vfs_read`, a typed `$retval`, a bitfield of `struct linux_binprm`,
//!   an enum parameter, an entry argument read at the return, and (fast
//!   lane) a function of the module binfmt_misc through its split BTF;
//! - our lines for the workload's tasks equal the guest's. On 6.12 the
//!   guest takes the same specs (its kprobe_events has BTF arguments);
//!   6.1 predates them, so its probes are the plain fetches the host
//!   resolves from the same kernel's BTF (the offsets read from the
//!   vmlinux image, as root reads them from guest memory);
//! - `dd`'s byte count equals the sum of its reads' return values, the
//!   file's name is `hostname`, and the bitfield reads 1
//!   (`point_of_no_return` is set before `setup_new_exec`);
//! - errors: an unknown member and a `:string` on a non-string are
//!   refused with a caret under the token, before anything is hooked.

use guest_introspect::btf::Btf;
use guest_introspect::elf::Elf;
use guest_introspect::Gva;
use hvtrace::client::Client;
use hvtrace_tests::{
    guest_exec as exec, hv_call as call, parse_trace_lines as parse_all, Checks, Stream,
    TraceLine as Line, TRACEFS,
};
use protocol::{ErrorKind, Request, Response};
use tracelang::kprobe::{parse_probe, resolve_btf};

/// (event, spec) of our probes; the guest's have the same names.
const SPECS: &[(&str, &str)] = &[
    // At vfs_open's entry the file's f_path is not set yet (vfs_open
    // sets it): the path names the file there, the file at vfs_read.
    (
        "bopen",
        "p:hvbtf/bopen vfs_open name=path->dentry->d_name.name:string n2=path->dentry:%pd",
    ),
    (
        "bfile",
        "p:hvbtf/bfile vfs_read name=file->f_path.dentry->d_name.name:string n2=file:%pD",
    ),
    ("bread", "p:hvbtf/bread vfs_read $arg*"),
    ("bret", "r:hvbtf/bret vfs_read $retval"),
    (
        "bexec",
        "p:hvbtf/bexec setup_new_exec nr=bprm->point_of_no_return fname=bprm->filename:string",
    ),
    ("bpid", "p:hvbtf/bpid __task_pid_nr_ns type"),
    ("bentry", "r:hvbtf/bentry vfs_read count $retval"),
];
/// The fast lane's module function, through binfmt_misc's split BTF.
const MODULE_SPEC: (&str, &str) = (
    "bmisc",
    "p:hvbtf/bmisc binfmt_misc:load_misc_binary fname=bprm->filename:string",
);
/// The guest's: its BTF lookup takes the function's bare name.
const GUEST_MODULE_SPEC: &str = "p:hvbtf/bmisc load_misc_binary fname=bprm->filename:string";

/// The probes `spec` becomes in a 6.1 guest: the same, resolved against
/// Debian's BTF on the host and written as plain fetches.
fn plain_for_61(spec: &str) -> String {
    let dir = hvtrace::vm::guest::run_script("scripts/guest/debian-kernel.sh")
        .expect("the Debian kernel")
        .parent()
        .expect("its directory")
        .to_path_buf();
    let vmlinux = std::fs::read(dir.join("vmlinux")).expect("Debian's vmlinux");
    let elf = Elf::parse(&vmlinux).expect("vmlinux is ELF64");
    let view = elf
        .load_segments(Gva::is_kernel_image)
        .expect("vmlinux segments");
    let at = elf.section(".BTF").expect(".BTF").addr;
    let btf = Btf::parse(&view, Gva(at)).expect("Debian's BTF");
    let mut p = parse_probe(spec).expect("spec parses");
    resolve_btf(&mut p, Ok(&btf)).unwrap_or_else(|e| panic!("{}", e.report(spec)));
    p.render_form()
}

fn workload() -> &'static str {
    "for i in 1 2 3; do cat /etc/hostname >/dev/null; done; \
     dd if=/etc/hostname of=/dev/null bs=3 2>&1; echo \"file bytes $(wc -c < /etc/hostname)\""
}

/// The workload's tasks: the pids that ran `cat` or `dd` (before its
/// exec a task still has its shell's name, and its exec's events are its
/// own).
fn workload_pids(lines: &[Line]) -> std::collections::BTreeSet<i32> {
    lines
        .iter()
        .filter(|l| l.comm == "cat" || l.comm == "dd")
        .map(|l| l.pid)
        .collect()
}

/// Lines of the tasks `pids` for our events, sorted.
fn of_workload(lines: &[Line], pids: &std::collections::BTreeSet<i32>, events: &[&str]) -> Vec<Line> {
    let mut v: Vec<Line> = lines
        .iter()
        .filter(|l| pids.contains(&l.pid))
        .filter(|l| events.iter().any(|e| l.body.starts_with(&format!("{e}: "))))
        .cloned()
        .collect();
    v.sort();
    v
}

/// Event `e`'s lines as (pid, body), sorted. The comm is left out: the
/// guest prints each pid's latest name (its saved cmdlines), ours the name
/// at the hit (`sh` before an exec). At a return the caller is left out
/// too: with the guest's kretprobe and our return hook on the same call,
/// each sees the other's trampoline as the return address.
fn keys(lines: &[Line], e: &str) -> Vec<(i32, String)> {
    let mut v: Vec<(i32, String)> = lines
        .iter()
        .filter(|l| l.body.starts_with(&format!("{e}: ")))
        .map(|l| {
            let body = match (l.body.find(" <- "), l.body.find(": (")) {
                (Some(arrow), Some(open)) if open < arrow => {
                    format!("{}({}", &l.body[..open + 2], &l.body[arrow + 1..])
                }
                _ => l.body.clone(),
            };
            (l.pid, body)
        })
        .collect();
    v.sort();
    v
}

/// The value of `name=` in a line's body.
fn field<'a>(l: &'a Line, name: &str) -> Option<&'a str> {
    let at = l.body.find(&format!(" {name}="))? + name.len() + 2;
    let rest = &l.body[at..];
    Some(match rest.strip_prefix('"') {
        Some(q) => &q[..q.find('"').unwrap_or(q.len())],
        None => rest.split(' ').next().unwrap_or(rest),
    })
}

pub fn btf_args(ck: &mut Checks, c: &mut Client, stream: &mut Stream, fast_lane: bool) {
    refusals(ck, c);
    let mut specs: Vec<(&str, &str)> = SPECS.to_vec();
    if fast_lane {
        let out = exec(c, "modprobe binfmt_misc && echo loaded");
        ck.check(out.contains("loaded"), format!("modprobe binfmt_misc: {out}"));
        specs.push(MODULE_SPEC);
    }
    let t0 = std::time::Instant::now();
    for (_, spec) in &specs {
        match call(c, Request::ProbeAdd { spec: (*spec).into() }) {
            Response::ProbeAdded { name, site } => {
                println!("btf: {name} at {site:#x}");
            }
            other => ck.check(false, format!("{spec}: {other:?}")),
        }
    }
    println!("btf: {} probes added in {:?}", specs.len(), t0.elapsed());
    // The guest's probes: the same specs on 6.12; on 6.1 the plain
    // fetches, without the entry arguments at a return (6.9+).
    let guest_specs: Vec<String> = specs
        .iter()
        .filter(|(e, _)| fast_lane || *e != "bentry")
        .map(|(e, s)| {
            if fast_lane && *e == "bmisc" {
                GUEST_MODULE_SPEC.to_string()
            } else if fast_lane {
                (*s).to_string()
            } else {
                plain_for_61(s)
            }
        })
        .collect();
    for s in &guest_specs {
        println!("btf: guest probe {s}");
    }
    let define: String = guest_specs
        .iter()
        .map(|s| format!("echo '{s}' >> kprobe_events; "))
        .collect();
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > trace && {define} echo 1 > events/hvbtf/enable; \
             {} ; echo 0 > events/hvbtf/enable; grep -E ' b[a-z]+: ' trace; \
             echo \"defined $(grep -c hvbtf/ kprobe_events)\"",
            workload()
        ),
    );
    let ours = stream.read(c);
    ck.check(
        guest.contains(&format!("defined {}", guest_specs.len())),
        format!("the guest took every probe: {}", guest.lines().last().unwrap_or("")),
    );
    let compared: Vec<&str> = specs
        .iter()
        .map(|(e, _)| *e)
        .filter(|e| fast_lane || *e != "bentry")
        .collect();
    let (ours_all, guest_all) = (parse_all(&ours), parse_all(&guest));
    let mut pids = workload_pids(&ours_all);
    pids.extend(workload_pids(&guest_all));
    let o = of_workload(&ours_all, &pids, &compared);
    let g = of_workload(&guest_all, &pids, &compared);
    println!("btf: the workload's lines: ours {}, guest {}", o.len(), g.len());
    for e in &compared {
        let first = |v: &[Line]| {
            v.iter()
                .find(|l| l.body.starts_with(&format!("{e}: ")))
                .map(|l| l.body.clone())
        };
        println!("  ours:  {:?}\n  guest: {:?}", first(&o), first(&g));
        let mine = keys(&o, e);
        let theirs = keys(&g, e);
        ck.check(!mine.is_empty(), format!("{e}: the workload hit it"));
        ck.eq(&format!("{e}: our events equal the guest's (pid, values)"), &mine, &theirs);
    }
    ck.eq("stream losses", stream.lost, 0);

    // What the values must be, whoever computed them.
    let ev = |e: &str| -> Vec<&Line> {
        o.iter().filter(|l| l.body.starts_with(&format!("{e}: "))).collect()
    };
    // cat opens the file (and copies it with sendfile); dd reads it.
    for (e, who) in [("bopen", "cat"), ("bfile", "dd")] {
        ck.check(
            ev(e).iter().any(|l| {
                l.comm == who
                    && field(l, "name") == Some("hostname")
                    && field(l, "n2") == Some("hostname")
            }),
            format!("{e}: {who}'s /etc/hostname is named hostname (the chain and %pd/%pD)"),
        );
    }
    let copied: Option<u64> = guest
        .lines()
        .find_map(|l| l.strip_prefix("file bytes "))
        .and_then(|n| n.trim().parse().ok());
    let read: u64 = ev("bret")
        .iter()
        .filter(|l| l.comm == "dd")
        .filter_map(|l| field(l, "arg1")?.parse::<i64>().ok())
        .filter(|&n| n > 0)
        .map(|n| n as u64)
        .sum();
    ck.check(copied.is_some(), format!("the file's size: {guest}"));
    ck.check(
        guest.contains("+1 records in"),
        "dd read the file in 3-byte blocks and a short last one",
    );
    ck.eq("the bytes dd read equal the sum of its reads' $retval", Some(read), copied);
    let exec_lines = ev("bexec");
    ck.check(
        !exec_lines.is_empty() && exec_lines.iter().all(|l| field(l, "nr") == Some("1")),
        format!("point_of_no_return reads 1 at setup_new_exec: {exec_lines:?}"),
    );
    // The entry's count at the return is the count the entry saw.
    let counts = |e: &str, name: &str| -> Vec<String> {
        let mut v: Vec<String> = ev(e)
            .iter()
            .filter(|l| l.comm == "dd")
            .filter_map(|l| field(l, name).map(str::to_string))
            .collect();
        v.sort();
        v
    };
    ck.eq(
        "the return's saved count equals the entry's",
        counts("bentry", "count"),
        counts("bread", "count"),
    );
    if fast_lane {
        // The module's view of each exec names what the kernel's own
        // setup_new_exec then names, task by task.
        let by_pid = |e: &str| -> Vec<(i32, String)> {
            let mut v: Vec<(i32, String)> = ev(e)
                .iter()
                .filter_map(|l| Some((l.pid, field(l, "fname")?.to_string())))
                .collect();
            v.sort();
            v
        };
        let misc = by_pid("bmisc");
        // busybox runs its applets through /proc/self/exe.
        ck.check(
            misc.len() >= 3 && misc.iter().all(|(_, f)| f.starts_with('/')),
            format!("load_misc_binary names the programs it is asked to load: {misc:?}"),
        );
        ck.eq("load_misc_binary's names equal setup_new_exec's", misc, by_pid("bexec"));
    }
    let names: Vec<&str> = specs.iter().map(|(e, _)| *e).collect();
    for e in &names {
        let _ = call(
            c,
            Request::ProbeDel {
                name: format!("hvbtf/{e}"),
            },
        );
    }
    exec(
        c,
        &format!(
            "cd {TRACEFS} && for e in {}; do echo \"-:hvbtf/$e\" >> kprobe_events; done; echo > trace",
            names.join(" ")
        ),
    );
    if fast_lane {
        let out = exec(c, "rmmod binfmt_misc && echo unloaded");
        ck.check(out.contains("unloaded"), format!("rmmod binfmt_misc: {out}"));
    }
}

/// BTF errors come back as the parser's do: a message and a caret under
/// the token, with nothing hooked.
fn refusals(ck: &mut Checks, c: &mut Client) {
    let cases = [
        ("p:hvbtf/bad vfs_open file->f_nope", "no such member", "f_nope"),
        (
            "p:hvbtf/bad vfs_read count:string",
            "string types need a char * or char[] value",
            "string",
        ),
        (
            "p:hvbtf/bad vfs_read file->f_path->dentry",
            "'->' needs a pointer to a struct or union",
            "->dentry",
        ),
    ];
    for (spec, message, token) in cases {
        match call(c, Request::ProbeAdd { spec: spec.into() }) {
            Response::Error { kind, message: m } => {
                ck.eq(&format!("{spec}: kind"), kind, ErrorKind::InvalidArgument);
                let lines: Vec<&str> = m.lines().collect();
                let caret_ok = match (lines.get(1), lines.get(2)) {
                    (Some(s), Some(caret)) => {
                        let col = caret.find('^').unwrap_or(usize::MAX);
                        s.get(col..).is_some_and(|t| t.starts_with(token))
                    }
                    _ => false,
                };
                ck.check(
                    m.contains(message) && caret_ok,
                    format!("{spec}: a message and a caret under {token:?}: {m}"),
                );
            }
            other => ck.check(false, format!("{spec} was not refused: {other:?}")),
        }
    }
    ck.check(
        !matches!(call(c, Request::ProbeList), Response::Probes(p) if p.iter().any(|p| p.name == "hvbtf/bad")),
        "no refused probe is listed",
    );
}
