//! The syscall metadata reader over a synthetic kernel: kallsyms tables
//! laid out as scripts/kallsyms.c does, a `sys_call_table`, the runtime
//! `syscalls_metadata` array, and a `struct syscall_metadata` whose
//! members BTF puts in an order no kernel uses, so that only a reader that
//! takes the layout from BTF finds the names and types. A call without
//! metadata falls back to the generated ABI table; `sys_ni_syscall` is
//! left out; an argument-less call that is an alias of its `__do_sys_`
//! body is found under its `__x64_sys_` name.

use guest_introspect::btf::{Btf, Kind};
use guest_introspect::kallsyms::{locate, LocateStats, SymbolIndex};
use guest_introspect::syscalls::{self, Abi, ArgSource};
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use test_support::synth::{generate, m, Builder, Order, Sym};

const RB: u64 = 0xffff_ffff_8100_0000;
/// Where the kallsyms tables are.
const TABLES: u64 = 0xffff_ffff_8160_0000;
/// The kernel data: the call table, the metadata and its strings.
const DATA: u64 = RB + 0x20_0000;
/// The BTF blob.
const BTF_AT: u64 = 0xffff_ffff_8180_0000;

/// (C type, name) of each argument.
type Args<'a> = &'a [(&'a str, &'a str)];
/// (number, name, entry, source, arguments) of a call as found.
type Found<'a> = (u32, &'a str, &'a str, ArgSource, Vec<(&'a str, &'a str)>);

fn sym(kind: u8, name: &str, addr: u64) -> Sym {
    Sym {
        kind,
        name: name.into(),
        addr,
    }
}

/// Writes `bytes` at `at` (an address in the data segment).
fn put(data: &mut [u8], at: u64, bytes: &[u8]) {
    let o = (at - DATA) as usize;
    data[o..o + bytes.len()].copy_from_slice(bytes);
}

/// A string in the data segment, at `*next`; its address.
fn string(data: &mut [u8], next: &mut u64, s: &str) -> u64 {
    let at = *next;
    let mut b = s.as_bytes().to_vec();
    b.push(0);
    put(data, at, &b);
    *next += b.len() as u64;
    at
}

#[test]
fn metadata_names_and_types_through_a_btf_layout() {
    // Text: the wrappers (getpid's alias first, as kallsyms sorts equal
    // addresses by name).
    let read = RB + 0x1000;
    let write = RB + 0x1100;
    let ni = RB + 0x1200;
    let openat = RB + 0x1300;
    let getpid = RB + 0x1400;
    let table = DATA;
    let meta_ptr = DATA + 5 * 8;
    let syms = vec![
        sym(b'T', "__x64_sys_read", read),
        sym(b'T', "__x64_sys_write", write),
        sym(b'T', "sys_ni_syscall", ni),
        sym(b'T', "__x64_sys_openat", openat),
        sym(b'T', "__do_sys_getpid", getpid),
        sym(b'T', "__x64_sys_getpid", getpid),
        sym(b't', "text_end", RB + 0x1500),
        sym(b'D', "sys_call_table", table),
        sym(b'D', "syscalls_metadata", meta_ptr),
        sym(b'D', "data_end", meta_ptr + 8),
    ];
    let (blob, _) = generate(&syms, Order::V612, false, RB);
    let mut tables = blob.clone();
    tables.extend(std::iter::repeat_n(0u8, 4096));

    // BTF: struct syscall_metadata { const char **args; const char *name;
    // const char **types; int syscall_nr; int nb_args; } (the kernel has
    // name, syscall_nr, nb_args, types, args).
    let mut b = Builder::new();
    let int = b.int("int", 4);
    let ch = b.int("char", 1);
    let cch = b.alias(Kind::Const, "", ch);
    let pch = b.alias(Kind::Ptr, "", cch);
    let ppch = b.alias(Kind::Ptr, "", pch);
    b.record(
        Kind::Struct,
        "syscall_metadata",
        40,
        &[
            m("args", ppch, 0),
            m("name", pch, 8),
            m("types", ppch, 16),
            m("syscall_nr", int, 24),
            m("nb_args", int, 28),
        ],
    );
    let btf_blob = b.blob();

    // Data: the table, the metadata array (by number), each call's
    // metadata and its strings.
    let mut data = vec![0u8; 0x4000];
    let mut next = DATA + 0x2000;
    for (nr, f) in [read, write, ni, openat, getpid].iter().enumerate() {
        put(&mut data, table + 8 * nr as u64, &f.to_le_bytes());
    }
    let array = DATA + 0x100;
    put(&mut data, meta_ptr, &array.to_le_bytes());
    let calls: [(u64, &str, Args<'_>); 4] = [
        (
            0,
            "sys_read",
            &[
                ("unsigned int", "fd"),
                ("char *", "buf"),
                ("size_t", "count"),
            ],
        ),
        // write (1) has none: the generated table stands in.
        (
            3,
            "sys_openat",
            &[
                ("int", "dfd"),
                ("const char *", "filename"),
                ("int", "flags"),
                ("umode_t", "mode"),
            ],
        ),
        (4, "sys_getpid", &[]),
        // A metadata entry for a number the table does not have.
        (7, "sys_bogus", &[("int", "x")]),
    ];
    let mut at = DATA + 0x400;
    for (nr, name, args) in calls {
        let md = at;
        at += 0x100;
        put(&mut data, array + 8 * nr, &md.to_le_bytes());
        let name_at = string(&mut data, &mut next, name);
        let types = at;
        let names = at + 0x40;
        at += 0x80;
        for (i, (t, n)) in args.iter().enumerate() {
            let t = string(&mut data, &mut next, t);
            let n = string(&mut data, &mut next, n);
            put(&mut data, types + 8 * i as u64, &t.to_le_bytes());
            put(&mut data, names + 8 * i as u64, &n.to_le_bytes());
        }
        put(&mut data, md, &names.to_le_bytes());
        put(&mut data, md + 8, &name_at.to_le_bytes());
        put(&mut data, md + 16, &types.to_le_bytes());
        put(&mut data, md + 24, &(nr as u32).to_le_bytes());
        put(&mut data, md + 28, &(args.len() as u32).to_le_bytes());
    }
    // `sys_bogus` (7) is past the table's 5 slots, where the reader never
    // looks.
    let mut view = SegmentView::new();
    view.add(Gva(TABLES), &tables, tables.len() as u64);
    view.add(Gva(DATA), &data, data.len() as u64);
    view.add(Gva(BTF_AT), &btf_blob, btf_blob.len() as u64);
    let range = GvaRange::with_len(Gva(TABLES), tables.len() as u64);
    let t = locate(&view, &[range], &mut LocateStats::default()).unwrap();
    let idx = SymbolIndex::build(&view, &t).unwrap();
    let btf = Btf::parse(&view, Gva(BTF_AT)).unwrap();

    let calls = syscalls::table(&view, &idx, Some(&btf)).unwrap();
    let got: Vec<Found<'_>> = calls
        .iter()
        .map(|s| {
            (
                s.nr,
                s.name.as_str(),
                s.entry.as_str(),
                s.source,
                s.args
                    .iter()
                    .map(|(t, n)| (t.as_str(), n.as_str()))
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                0,
                "read",
                "__x64_sys_read",
                ArgSource::Metadata,
                vec![
                    ("unsigned int", "fd"),
                    ("char *", "buf"),
                    ("size_t", "count")
                ]
            ),
            (
                1,
                "write",
                "__x64_sys_write",
                ArgSource::Table,
                vec![
                    ("unsigned int", "fd"),
                    ("const char *", "buf"),
                    ("size_t", "count")
                ]
            ),
            (
                3,
                "openat",
                "__x64_sys_openat",
                ArgSource::Metadata,
                vec![
                    ("int", "dfd"),
                    ("const char *", "filename"),
                    ("int", "flags"),
                    ("umode_t", "mode")
                ]
            ),
            (4, "getpid", "__x64_sys_getpid", ArgSource::Metadata, vec![]),
        ]
    );
    assert!(calls.iter().all(|s| s.abi == Abi::X64));

    // Without BTF there is no layout for the metadata: the table's
    // prototypes (getpid's empty list is the table's too).
    let bare = syscalls::table(&view, &idx, None).unwrap();
    assert!(
        bare.iter().all(|s| s.source == ArgSource::Table),
        "{bare:?}"
    );
    assert_eq!(bare.len(), 4);

    // A metadata array whose entry points nowhere: that call falls back,
    // the others keep theirs.
    let mut broken = data.clone();
    let o = (array - DATA) as usize;
    broken[o..o + 8].copy_from_slice(&0xffff_8000_dead_0000u64.to_le_bytes());
    let mut view2 = SegmentView::new();
    view2.add(Gva(TABLES), &tables, tables.len() as u64);
    view2.add(Gva(DATA), &broken, broken.len() as u64);
    view2.add(Gva(BTF_AT), &btf_blob, btf_blob.len() as u64);
    let btf2 = Btf::parse(&view2, Gva(BTF_AT)).unwrap();
    let calls = syscalls::table(&view2, &idx, Some(&btf2)).unwrap();
    let sources: Vec<(&str, ArgSource)> =
        calls.iter().map(|s| (s.name.as_str(), s.source)).collect();
    assert_eq!(
        sources,
        [
            ("read", ArgSource::Table),
            ("write", ArgSource::Table),
            ("openat", ArgSource::Metadata),
            ("getpid", ArgSource::Metadata)
        ]
    );
}
