//! The guest's system calls from its own `sys_call_table`, with argument
//! names and types from its ftrace metadata (both kernels have
//! CONFIG_FTRACE_SYSCALLS), where BTF prototypes are the fallback. Numbers are the x86-64 ABI's, which no kernel renumbers.

use crate::common;
use guest_introspect::btf::Btf;
use guest_introspect::syscalls::{self, ArgSource, Syscall};
use guest_introspect::Gva;

pub fn table(img: &common::Image, index: &guest_introspect::kallsyms::SymbolIndex) -> Vec<Syscall> {
    let view = img.view();
    let sec = img.elf().section(".BTF").expect(".BTF section");
    let btf = Btf::parse(&view, Gva(sec.addr)).expect("BTF");
    syscalls::table(&view, index, Some(&btf)).expect("sys_call_table")
}

fn by_name<'a>(t: &'a [Syscall], name: &str) -> &'a Syscall {
    t.iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

/// The ABI's numbers (arch/x86/entry/syscalls/syscall_64.tbl).
fn abi_numbers(t: &[Syscall]) {
    for (nr, name) in [
        (0, "read"),
        (1, "write"),
        (3, "close"),
        (57, "fork"),
        (59, "execve"),
        (257, "openat"),
        (262, "newfstatat"),
        (437, "openat2"),
    ] {
        assert_eq!(by_name(t, name).nr, nr, "{name}");
    }
    assert!(t.len() > 300, "{} calls", t.len());
    assert!(t.iter().all(|s| s.entry == format!("__x64_sys_{}", s.name)));
}

#[test]
fn debian_calls_from_the_table_and_the_metadata() {
    let t = table(common::debian(), &crate::debian().index);
    abi_numbers(&t);
    let openat = by_name(&t, "openat");
    assert_eq!(openat.source, ArgSource::Metadata);
    let args: Vec<(&str, &str)> = openat
        .args
        .iter()
        .map(|(ty, n)| (ty.as_str(), n.as_str()))
        .collect();
    assert_eq!(
        args,
        [
            ("int", "dfd"),
            ("const char *", "filename"),
            ("int", "flags"),
            ("umode_t", "mode")
        ]
    );
    let meta = t.iter().filter(|s| s.source == ArgSource::Metadata).count();
    println!("Debian: {} calls, {meta} with metadata", t.len());
    assert!(meta * 10 >= t.len() * 9, "{meta} of {}", t.len());
}

#[test]
fn fast_lane_calls_from_the_table_and_the_metadata() {
    let t = table(common::fast(), &crate::fast().index);
    abi_numbers(&t);
    let counts = |s: ArgSource| t.iter().filter(|c| c.source == s).count();
    println!(
        "fast lane: {} calls, {} with metadata, {} with BTF prototypes, {} from the ABI table, {} raw",
        t.len(),
        counts(ArgSource::Metadata),
        counts(ArgSource::Btf),
        counts(ArgSource::Table),
        counts(ArgSource::None)
    );
    // Its config fragment turns CONFIG_FTRACE_SYSCALLS on; the calls a
    // tiny config leaves out (System V IPC, AIO, NUMA, inotify, ...) are
    // stubs that return -ENOSYS, with no metadata (77 of 358 here).
    assert!(counts(ArgSource::Metadata) * 4 >= t.len() * 3);
    for name in ["openat", "read", "write", "execve", "clone"] {
        assert_eq!(by_name(&t, name).source, ArgSource::Metadata, "{name}");
    }
    assert_eq!(by_name(&t, "openat").args.len(), 4);
}
