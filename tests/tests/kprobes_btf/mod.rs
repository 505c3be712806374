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

/// The probes `specs` become in a 6.1 guest: the same, resolved against
/// Debian's BTF on the host and written as plain fetches.
fn plain_for_61(specs: &[&str]) -> Vec<String> {
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
    specs
        .iter()
        .map(|spec| {
            let mut p = parse_probe(spec).expect("spec parses");
            resolve_btf(&mut p, Ok(&btf)).unwrap_or_else(|e| panic!("{}", e.report(spec)));
            p.render_form()
        })
        .collect()
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
fn of_workload(
    lines: &[Line],
    pids: &std::collections::BTreeSet<i32>,
    events: &[&str],
) -> Vec<Line> {
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
        ck.check(
            out.contains("loaded"),
            format!("modprobe binfmt_misc: {out}"),
        );
        specs.push(MODULE_SPEC);
    }
    let t0 = std::time::Instant::now();
    for (_, spec) in &specs {
        match call(
            c,
            Request::ProbeAdd {
                spec: (*spec).into(),
            },
        ) {
            Response::ProbeAdded { name, site } => {
                println!("btf: {name} at {site:#x}");
            }
            other => ck.check(false, format!("{spec}: {other:?}")),
        }
    }
    println!("btf: {} probes added in {:?}", specs.len(), t0.elapsed());
    // The guest's probes: the same specs on 6.12; on 6.1 the plain
    // fetches, without the entry arguments at a return (6.9+).
    let oracle: Vec<(&str, &str)> = specs
        .iter()
        .copied()
        .filter(|(e, _)| fast_lane || *e != "bentry")
        .collect();
    let guest_specs: Vec<String> = if fast_lane {
        oracle
            .iter()
            .map(|(e, s)| {
                if *e == "bmisc" {
                    GUEST_MODULE_SPEC.to_string()
                } else {
                    (*s).to_string()
                }
            })
            .collect()
    } else {
        plain_for_61(&oracle.iter().map(|(_, s)| *s).collect::<Vec<_>>())
    };
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
        format!(
            "the guest took every probe: {}",
            guest.lines().last().unwrap_or("")
        ),
    );
    let compared: Vec<&str> = specs
        .iter()
        .map(|(e, _)| *e)
        .filter(|e| fast_lane || *e != "bentry")
        .collect();
    let (ours_all, guest_all) = (parse_all(&ours), parse_all(&guest));
    let mut pids = workload_pids(&ours_all);
    pids.extend(workload_pids(&guest_all));
    // Ours keeps every event (6.1 has no guest oracle for one of them).
    let all: Vec<&str> = specs.iter().map(|(e, _)| *e).collect();
    let o = of_workload(&ours_all, &pids, &all);
    let g = of_workload(&guest_all, &pids, &compared);
    println!(
        "btf: the workload's lines: ours {}, guest {}",
        o.len(),
        g.len()
    );
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
        ck.eq(
            &format!("{e}: our events equal the guest's (pid, values)"),
            &mine,
            &theirs,
        );
    }
    ck.eq("stream losses", stream.lost, 0);

    // What the values must be, whoever computed them.
    let ev = |e: &str| -> Vec<&Line> {
        o.iter()
            .filter(|l| l.body.starts_with(&format!("{e}: ")))
            .collect()
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
    ck.eq(
        "the bytes dd read equal the sum of its reads' $retval",
        Some(read),
        copied,
    );
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
        ck.eq(
            "load_misc_binary's names equal setup_new_exec's",
            misc,
            by_pid("bexec"),
        );
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
        ck.check(
            out.contains("unloaded"),
            format!("rmmod binfmt_misc: {out}"),
        );
    }
}

/// BTF errors come back as the parser's do: a message and a caret under
/// the token, with nothing hooked.
fn refusals(ck: &mut Checks, c: &mut Client) {
    let cases = [
        (
            "p:hvbtf/bad vfs_open file->f_nope",
            "no such member",
            "f_nope",
        ),
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

/// Debian's ext4.ko as the guest's initramfs carries it (the module tree
/// `debian-modules.sh` builds in the cache, for the kernel `release`).
fn debian_ext4_ko(release: &str) -> Vec<u8> {
    let cache = std::env::var_os("HVTRACE_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|x| std::path::Path::new(&x).join("hvtrace"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/hvtrace"))
        })
        .expect("a cache directory");
    let found = std::fs::read_dir(&cache)
        .expect("the cache directory")
        .filter_map(Result::ok)
        .filter(|d| {
            d.file_name()
                .to_string_lossy()
                .starts_with("debian-modules-")
        })
        .map(|d| {
            d.path()
                .join(format!("lib/modules/{release}/kernel/fs/ext4/ext4.ko"))
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no ext4.ko for {release} under {}", cache.display()));
    std::fs::read(found).expect("ext4.ko")
}

/// Debian: a function of ext4 through ext4's split BTF (its `.BTF` over
/// the kernel's, as the kernel keeps it in `btf_modules`), against the
/// guest's own probe with the plain fetches the host resolves from the
/// same two blobs.
pub fn btf_ext4(ck: &mut Checks, c: &mut Client, stream: &mut Stream) {
    const SPEC: &str = "p:hvbtf/bext ext4:ext4_file_open ino=inode->i_ino name=filp:%pD";
    const MOUNT: &str = "mkdir -p /mnt/ext && mount -t ext4 -o loop /tmp/ext.img /mnt/ext";
    let up = exec(
        c,
        &format!("modprobe ext4 && modprobe loop && {MOUNT} && echo mounted"),
    );
    ck.check(up.contains("mounted"), format!("ext4 mounted: {up}"));
    let dir = hvtrace::vm::guest::run_script("scripts/guest/debian-kernel.sh")
        .expect("the Debian kernel")
        .parent()
        .expect("its directory")
        .to_path_buf();
    let release = std::fs::read_to_string(dir.join("release")).expect("release");
    let vmlinux = std::fs::read(dir.join("vmlinux")).expect("Debian's vmlinux");
    let ko = debian_ext4_ko(release.trim());
    let elf = Elf::parse(&vmlinux).expect("vmlinux is ELF64");
    let mut view = elf
        .load_segments(Gva::is_kernel_image)
        .expect("vmlinux segments");
    let ko_elf = Elf::parse(&ko).expect("ext4.ko is ELF64");
    let data = ko_elf
        .data(&ko_elf.section(".BTF").expect("ext4.ko has .BTF"))
        .expect("its bytes");
    const AT: u64 = 0xffff_ffff_c000_0000;
    assert!(view.add(Gva(AT), data, data.len() as u64));
    let base = Btf::parse(&view, Gva(elf.section(".BTF").expect(".BTF").addr)).expect("BTF");
    let split = Btf::parse_split(&view, &base, Gva(AT), None).expect("ext4's BTF");
    let mut p = parse_probe(SPEC).expect("spec parses");
    resolve_btf(&mut p, Ok(&split)).unwrap_or_else(|e| panic!("{}", e.report(SPEC)));
    let guest_spec = p.render_form();
    println!("btf: ext4 guest probe {guest_spec}");
    match call(c, Request::ProbeAdd { spec: SPEC.into() }) {
        Response::ProbeAdded { name, site } => println!("btf: {name} at {site:#x}"),
        other => ck.check(false, format!("{SPEC}: {other:?}")),
    }
    let _ = stream.read(c);
    let guest = exec(
        c,
        &format!(
            "cd {TRACEFS} && echo > trace && echo '{guest_spec}' >> kprobe_events && \
             echo 1 > events/hvbtf/bext/enable && cat /mnt/ext/f && cat /mnt/ext/f >/dev/null; \
             echo 0 > events/hvbtf/bext/enable; grep ' bext: ' trace; echo '-:hvbtf/bext' >> kprobe_events; \
             ls -i /mnt/ext/f; umount /mnt/ext"
        ),
    );
    let ours = stream.read(c);
    let (o, g) = (
        keys(&parse_all(&ours), "bext"),
        keys(&parse_all(&guest), "bext"),
    );
    println!("btf: ext4: ours {o:?}\n  guest {g:?}");
    let inode: Option<&str> = guest
        .lines()
        .find(|l| l.trim_end().ends_with("/mnt/ext/f"))
        .and_then(|l| l.split_whitespace().next());
    ck.check(
        o.len() >= 2
            && o.iter().all(|(_, b)| {
                b.contains("name=\"f\"") && inode.is_some_and(|i| b.contains(&format!("ino={i} ")))
            }),
        format!("ext4_file_open names f and its inode ({inode:?}): {o:?}"),
    );
    ck.eq("ext4: our events equal the guest's (pid, values)", &o, &g);
    let _ = call(
        c,
        Request::ProbeDel {
            name: "hvbtf/bext".into(),
        },
    );
}
