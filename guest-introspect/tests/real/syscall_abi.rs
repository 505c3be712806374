//! The generated syscall ABI tables (`src/syscall_abi/`): regenerated from
//! the kernel source the fast-lane script unpacks, they must be what is
//! committed; cross-checked against both real guests, whose numbers are the
//! ABI's, and the arguments source of the calls neither metadata nor BTF
//! describes.

use std::path::{Path, PathBuf};

use guest_introspect::syscall_abi::{
    self, crosscheck, generate, i386, kernel_version, lookup, lookup_entry, x86_64, Arch,
    PROTOTYPES,
};
use guest_introspect::syscalls::{self, ArgSource, Syscall};
use guest_introspect::SymbolIndex;

use crate::common;

/// The unpacked `linux-source-6.12` of the guest scripts' cache (the
/// first `src/linux-source-6.12-*` in name order), which
/// `scripts/guest/fast-kernel.sh` unpacks.
fn kernel_source() -> PathBuf {
    let cache = std::env::var_os("HVTRACE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|x| Path::new(&x).join("hvtrace")))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/hvtrace")))
        .expect("neither HVTRACE_CACHE, XDG_CACHE_HOME nor HOME is set");
    let src = cache.join("src");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&src)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("linux-source-6.12-")
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.into_iter().next().unwrap_or_else(|| {
        panic!(
            "no kernel source at {}/linux-source-6.12-*: run scripts/guest/fast-kernel.sh, \
             which unpacks it",
            src.display()
        )
    })
}

fn read(dir: &Path, file: &str) -> String {
    let path = dir.join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn committed_tables_are_what_the_generator_writes() {
    let src = kernel_source();
    let version = kernel_version(&read(&src, "Makefile")).expect("kernel version");
    let header = read(&src, PROTOTYPES);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/syscall_abi");
    for arch in Arch::ALL {
        let tbl = read(&src, arch.tbl());
        let committed = read(&dir, arch.file());
        // Debian's linux-source-6.12 moves on with its stable updates: a
        // newer source whose ABI files give the same calls is not a stale
        // table, so it is generated under the version the committed file
        // names, and only the calls are compared.
        let named = committed
            .lines()
            .next()
            .and_then(|l| l.split("of Linux ").nth(1))
            .and_then(|r| r.split(':').next())
            .unwrap_or(&version)
            .to_string();
        if named != version {
            println!(
                "{}: generated from {named}, the source is {version}",
                arch.file()
            );
        }
        let fresh = generate(arch, &tbl, &header, &named);
        if fresh != committed {
            let line = fresh
                .lines()
                .zip(committed.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| fresh.lines().count().min(committed.lines().count()));
            panic!(
                "src/syscall_abi/{} is not what {} generates (first difference at line {}): \
                 run scripts/gen-syscall-abi.sh",
                arch.file(),
                src.display(),
                line + 1
            );
        }
        // Every line of the tbl with an entry point, once.
        let entries = syscall_abi::parse_tbl(&tbl, arch.abis());
        let table = match arch {
            Arch::X86_64 => x86_64::CALLS,
            Arch::I386 => i386::CALLS,
        };
        assert_eq!(table.len(), entries.len(), "{}", arch.file());
        let typed = table.iter().filter(|c| c.typed).count();
        println!(
            "{}: {} calls from Linux {version}, {typed} with arguments",
            arch.file(),
            table.len()
        );
    }
}

#[test]
fn known_calls() {
    let x = |name| lookup(x86_64::CALLS, name).unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(x("read").nr, 0);
    assert_eq!(x("read").entry, "__x64_sys_read");
    let openat = x("openat");
    assert_eq!(openat.nr, 257);
    assert!(openat.typed);
    assert_eq!(
        openat.args,
        [
            ("int", "dfd"),
            ("const char *", "filename"),
            ("int", "flags"),
            ("umode_t", "mode")
        ]
    );
    let execve = x("execve");
    assert_eq!(execve.nr, 59);
    assert_eq!(
        execve.args,
        [
            ("const char *", "filename"),
            ("const char *const *", "argv"),
            ("const char *const *", "envp")
        ]
    );
    assert_eq!(x("stat").entry, "__x64_sys_newstat");
    assert_eq!(x("getpid").args, []);
    assert!(x("getpid").typed);
    // Unnamed parameters in syscalls.h: no arguments rather than guesses.
    assert!(!x("socket").typed);
    // x32's numbers are left out.
    assert!(x86_64::CALLS.iter().all(|c| c.nr < 512));

    let i = |name| lookup(i386::CALLS, name).unwrap_or_else(|| panic!("no i386 {name}"));
    assert_eq!(i("write").nr, 4);
    assert_eq!(i("write").entry, "__ia32_sys_write");
    assert_eq!(i("open").nr, 5);
    assert_eq!(i("open").entry, "__ia32_compat_sys_open");
    assert_eq!(
        i("open").args,
        [
            ("const char *", "filename"),
            ("int", "flags"),
            ("umode_t", "mode")
        ]
    );
}

fn check_guest(what: &str, t: &[Syscall]) {
    let c = crosscheck(t).expect("crosscheck");
    let count = |s: ArgSource| t.iter().filter(|c| c.source == s).count();
    println!(
        "{what}: {} calls: {} with metadata, {} with BTF prototypes, {} from the ABI table, \
         {} raw; against the ABI table: {c}",
        t.len(),
        count(ArgSource::Metadata),
        count(ArgSource::Btf),
        count(ArgSource::Table),
        count(ArgSource::None),
    );
    let raw: Vec<&str> = t
        .iter()
        .filter(|c| c.source == ArgSource::None)
        .map(|c| c.name.as_str())
        .collect();
    println!("{what}: raw {raw:?}");
    println!("{what}: differ {:?}", c.differ);
    println!("{what}: missing {:?}", c.missing);
    println!("{what}: unknown {:?}", c.unknown);
    for name in ["read", "write", "openat", "execve", "exit_group"] {
        let g = t
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{what}: no {name}"));
        let a = lookup(x86_64::CALLS, name).unwrap_or_else(|| panic!("table: no {name}"));
        assert_eq!(g.nr, a.nr, "{what}: {name}");
        assert!(c.agree.contains(&g.nr), "{what}: {name}");
    }
    // The guest's metadata against the table's prototypes: the same
    // number of arguments always; names and spellings may differ (the
    // definition's `nset` is the declaration's `set`, `unsigned int` is
    // `unsigned`).
    let (mut both, mut same, mut same_types) = (0, 0, 0);
    for s in t.iter().filter(|s| s.source == ArgSource::Metadata) {
        let Some(a) = lookup_entry(x86_64::CALLS, &s.entry).filter(|a| a.typed) else {
            continue;
        };
        let args: Vec<(&str, &str)> = s
            .args
            .iter()
            .map(|(t, n)| (t.as_str(), n.as_str()))
            .collect();
        assert_eq!(
            args.len(),
            a.args.len(),
            "{what}: {}: {args:?} {:?}",
            s.name,
            a.args
        );
        both += 1;
        same += usize::from(args == a.args);
        same_types += usize::from(args.iter().zip(a.args).all(|(x, y)| x.0 == y.0));
    }
    if both > 0 {
        println!(
            "{what}: {both} calls with metadata and a prototype: {same} identical, \
             {same_types} with the same types"
        );
    }
    // x86-64 numbers are never reassigned: no guest call sits elsewhere.
    assert!(c.differ.is_empty(), "{what}: {:?}", c.differ);
    assert_eq!(c.agree.len() + c.unknown.len(), t.len());
    // The table is the third source: every call neither metadata nor BTF
    // describes gets its arguments when it has them.
    for s in t {
        match lookup_entry(x86_64::CALLS, &s.entry).filter(|a| a.typed) {
            Some(a) if !matches!(s.source, ArgSource::Metadata | ArgSource::Btf) => {
                assert_eq!(s.source, ArgSource::Table, "{what}: {}", s.name);
                let args: Vec<(&str, &str)> = s
                    .args
                    .iter()
                    .map(|(t, n)| (t.as_str(), n.as_str()))
                    .collect();
                assert_eq!(args, a.args, "{what}: {}", s.name);
            }
            Some(_) => {}
            None => assert_ne!(s.source, ArgSource::Table, "{what}: {}", s.name),
        }
    }
}

/// Without BTF (a kernel built without it) there is no metadata layout
/// either: the table is the only source of arguments.
fn without_btf(what: &str, img: &common::Image, index: &SymbolIndex) {
    let t = syscalls::table(&img.view(), index, None).expect("sys_call_table");
    let count = |s: ArgSource| t.iter().filter(|c| c.source == s).count();
    println!(
        "{what} without BTF: {} calls, {} from the ABI table, {} raw",
        t.len(),
        count(ArgSource::Table),
        count(ArgSource::None)
    );
    assert_eq!(count(ArgSource::Table) + count(ArgSource::None), t.len());
    check_guest(&format!("{what} without BTF"), &t);
}

#[test]
fn debian_against_the_abi_table() {
    let t = crate::syscalls::table(common::debian(), &crate::debian().index);
    check_guest("Debian", &t);
    without_btf("Debian", common::debian(), &crate::debian().index);
}

#[test]
fn fast_lane_against_the_abi_table() {
    let t = crate::syscalls::table(common::fast(), &crate::fast().index);
    check_guest("fast lane", &t);
    without_btf("fast lane", common::fast(), &crate::fast().index);
}
