//! The guest's system calls from its own `sys_call_table`, with argument
//! names and types from its ftrace metadata (both kernels have
//! CONFIG_FTRACE_SYSCALLS), where BTF prototypes are the fallback. Numbers are the x86-64 ABI's, which no kernel renumbers.

use crate::common;
use guest_introspect::btf::Btf;
use guest_introspect::syscalls::{self, ArgSource, Syscall};
use guest_introspect::view::SegmentView;
use guest_introspect::Gva;

/// Runs `f` over the image's unslid view and its `.BTF`.
pub fn with_btf<R>(
    img: &common::Image,
    f: impl FnOnce(&SegmentView<'_>, &Btf<'_, SegmentView<'_>>) -> R,
) -> R {
    let view = img.view();
    let sec = img.elf().section(".BTF").expect(".BTF section");
    let btf = Btf::parse(&view, Gva(sec.addr)).expect("BTF");
    f(&view, &btf)
}

pub fn table(img: &common::Image, index: &guest_introspect::kallsyms::SymbolIndex) -> Vec<Syscall> {
    with_btf(img, |view, btf| {
        syscalls::table(view, index, Some(btf)).expect("sys_call_table")
    })
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

fn compat(img: &common::Image, index: &guest_introspect::kallsyms::SymbolIndex) -> Vec<Syscall> {
    with_btf(img, |view, btf| {
        let (all, compat_error) = syscalls::tables(view, index, Some(btf)).expect("sys_call_table");
        assert_eq!(compat_error, None);
        all.into_iter()
            .filter(|s| s.abi == syscalls::Abi::Ia32)
            .collect()
    })
}

/// Debian's kernel has IA32 emulation: the i386 ABI's numbers
/// (arch/x86/entry/syscalls/syscall_32.tbl) and wrappers, compat ones
/// included; the argument-less calls, whose wrapper is the 64-bit one's
/// too, are left to the 64-bit table.
#[test]
fn debian_compat_calls() {
    let index = &crate::debian().index;
    // No table (the switch of the indirect-call hardening): the numbers
    // are the generated i386 table's, for the wrappers the guest has.
    assert!(index.lookup("ia32_sys_call_table").is_none());
    assert!(index.lookup("ia32_sys_call").is_some());
    let t = compat(common::debian(), index);
    let find = |name: &str| t.iter().find(|s| s.name == name);
    for (nr, name, entry) in [
        (3, "read", "__ia32_sys_read"),
        (4, "write", "__ia32_sys_write"),
        (5, "open", "__ia32_compat_sys_open"),
        (6, "close", "__ia32_sys_close"),
        (11, "execve", "__ia32_compat_sys_execve"),
    ] {
        let s = find(name).unwrap_or_else(|| panic!("no compat {name}"));
        assert_eq!(
            (s.nr, s.entry.as_str(), s.abi),
            (nr, entry, syscalls::Abi::Ia32)
        );
    }
    let open = find("open").unwrap();
    assert_eq!(open.args.len(), 3, "{:?}", open.args);
    assert_eq!(open.args[0].1, "filename");
    assert!(
        find("getpid").is_none(),
        "getpid's wrapper is the 64-bit one's"
    );
    println!("Debian: {} compat calls", t.len());
    assert!(t.len() > 300, "{}", t.len());
}

/// The fast lane is built without IA32 emulation: no compat calls.
#[test]
fn fast_lane_has_no_compat_calls() {
    assert!(compat(common::fast(), &crate::fast().index).is_empty());
}
