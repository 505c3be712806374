//! BTF arguments resolved over a synthetic BTF blob laid out as the kernel
//! lays its types out: a `struct file` whose `f_path` sits in an anonymous
//! union (as on 6.12), `struct dentry` and `struct qstr`, typedefs, a
//! bitfield struct, an enum, and the prototypes of a few functions.

use guest_introspect::btf::{Btf, BtfError, Kind};
use guest_introspect::view::SegmentView;
use guest_introspect::Gva;
use test_support::synth::{m, Builder, M};
use tracelang::kprobe::{
    needs_btf, parse_probe, resolve_btf, ArgType, Deref, FetchBase, IntType, ParseErrorKind,
    ProbeSpec,
};

const AT: u64 = 0xffff_ffff_8240_0000;

/// An integer with an encoding (1: signed).
fn int(b: &mut Builder, name: &str, size: u32, signed: bool) -> u32 {
    let id = b.head(name, Kind::Int, 0, false, size);
    b.words(&[(u32::from(signed) << 24) | (size * 8)]);
    id
}

fn func(b: &mut Builder, name: &str, ret: u32, params: &[(&str, u32)]) -> u32 {
    let proto = b.head("", Kind::FuncProto, params.len() as u32, false, ret);
    let words: Vec<u32> = params
        .iter()
        .flat_map(|&(n, t)| {
            let off = b.s(n);
            [off, t]
        })
        .collect();
    b.words(&words);
    b.head(name, Kind::Func, 0, false, proto)
}

fn bits(name: &str, ty: u32, bit_off: u32, n: u32) -> M<'_> {
    M {
        name,
        ty,
        bit_off,
        bits: n,
    }
}

/// The blob: ids are assigned in order, forward references by number.
fn blob() -> Vec<u8> {
    let mut b = Builder::new();
    let int_t = int(&mut b, "int", 4, true); // 1
    let uint = int(&mut b, "unsigned int", 4, false); // 2
    let long = int(&mut b, "long", 8, true); // 3
    let ulong = int(&mut b, "long unsigned int", 8, false); // 4
    let uchar = int(&mut b, "unsigned char", 1, false); // 5
    let schar = int(&mut b, "signed char", 1, true); // 6
    let cuchar = b.alias(Kind::Const, "", uchar); // 7
    let p_cuchar = b.alias(Kind::Ptr, "", cuchar); // 8
    let hash = b.record(
        Kind::Struct,
        "",
        8,
        &[m("hash", uint, 0), m("len", uint, 4)],
    ); // 9
    let hash_u = b.record(
        Kind::Union,
        "",
        8,
        &[m("", hash, 0), m("hash_len", ulong, 0)],
    ); // 10
    let qstr = b.record(
        Kind::Struct,
        "qstr",
        16,
        &[m("", hash_u, 0), m("name", p_cuchar, 8)],
    ); // 11
    let dentry = b.record(
        Kind::Struct,
        "dentry",
        64,
        &[m("d_flags", uint, 0), m("d_name", qstr, 32)],
    ); // 12
    let p_dentry = b.alias(Kind::Ptr, "", dentry); // 13
    let void_p = b.alias(Kind::Ptr, "", 0); // 14
    let path = b.record(
        Kind::Struct,
        "path",
        16,
        &[m("mnt", void_p, 0), m("dentry", p_dentry, 8)],
    ); // 15
    let path_u = b.record(
        Kind::Union,
        "",
        16,
        &[m("f_path", path, 0), m("f_u", ulong, 0)],
    ); // 16
    let name_arr = b.array(uchar, int_t, 16); // 17
    let sname_arr = b.array(schar, int_t, 8); // 18
    let file = b.record(
        Kind::Struct,
        "file",
        128,
        &[
            m("f_count", long, 0),
            m("", path_u, 64),
            m("f_comm", name_arr, 96),
            m("f_tag", sname_arr, 112),
        ],
    ); // 19
    let p_file = b.alias(Kind::Ptr, "", file); // 20
    let cpath = b.alias(Kind::Const, "", path); // 21
    let p_cpath = b.alias(Kind::Ptr, "", cpath); // 22
    let kind = b.enum_("kind", &[("KIND_A", 0), ("KIND_B", 1)]); // 23
    let flags = b.record(
        Kind::Struct,
        "flags",
        8,
        &[
            bits("a", uint, 0, 3),
            bits("b", uint, 3, 5),
            bits("st", kind, 8, 4),
            bits("wide", ulong, 20, 40),
            bits("whole", uint, 32, 0),
        ],
    ); // 24
    let p_flags = b.alias(Kind::Ptr, "", flags); // 25
    let ssize_t = b.alias(Kind::Typedef, "ssize_t", long); // 26
    let size_t = b.alias(Kind::Typedef, "size_t", ulong); // 27
    let loff_t = b.alias(Kind::Typedef, "loff_t", long); // 28
    let p_loff = b.alias(Kind::Ptr, "", loff_t); // 29
    let char_t = int(&mut b, "char", 1, false); // 30
    let p_char = b.alias(Kind::Ptr, "", char_t); // 31
    func(
        &mut b,
        "vfs_open",
        int_t,
        &[("path", p_cpath), ("file", p_file)],
    );
    func(
        &mut b,
        "vfs_read",
        ssize_t,
        &[
            ("file", p_file),
            ("buf", p_char),
            ("count", size_t),
            ("pos", p_loff),
        ],
    );
    func(&mut b, "void_fn", 0, &[("f", p_flags)]);
    func(&mut b, "takes_enum", int_t, &[("k", kind), ("f", p_flags)]);
    b.blob()
}

fn resolved(spec: &str) -> Result<ProbeSpec, (ParseErrorKind, usize)> {
    let bytes = blob();
    let mut v = SegmentView::new();
    assert!(v.add(Gva(AT), &bytes, bytes.len() as u64));
    let btf = Btf::parse(&v, Gva(AT)).unwrap();
    let mut p = parse_probe(spec).map_err(|e| (e.kind, e.pos))?;
    resolve_btf(&mut p, Ok(&btf)).map_err(|e| {
        eprintln!("{}", e.report(spec));
        (e.kind, e.pos)
    })?;
    assert!(!needs_btf(&p));
    Ok(p)
}

fn d(offsets: &[i64]) -> Vec<Deref> {
    offsets
        .iter()
        .map(|&offset| Deref {
            offset,
            user: false,
        })
        .collect()
}

#[test]
fn a_member_chain_through_an_anonymous_union_to_a_string() {
    let p = resolved("p vfs_open file->f_path.dentry->d_name.name:string").unwrap();
    let a = &p.args[0];
    assert_eq!(a.name, "arg1");
    assert_eq!(a.expr.base, FetchBase::Arg(2));
    // f_path at 64 (in the union), dentry 8 into it; d_name at 32, name 8
    // into it; then the char pointer's own dereference.
    assert_eq!(a.expr.derefs, d(&[72, 40, 0]));
    assert_eq!(a.ty, ArgType::String);
    // %pD says the same from the file pointer, %pd from the dentry.
    let p = resolved("p vfs_open n=file:%pD m=+8(path):%pd").unwrap();
    assert_eq!(p.args[0].expr.derefs, d(&[72, 40, 0]));
    assert_eq!(p.args[0].ty, ArgType::String);
    assert_eq!(p.args[1].expr.base, FetchBase::Arg(1));
    assert_eq!(p.args[1].expr.derefs, d(&[8, 40, 0]));
}

#[test]
fn parameters_by_name_are_named_and_typed() {
    let p = resolved("p vfs_read count pos file buf:string").unwrap();
    let names: Vec<&str> = p.args.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["count", "pos", "file", "buf"]);
    assert_eq!(p.args[0].expr.base, FetchBase::Arg(3));
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::U64));
    assert_eq!(p.args[1].ty, ArgType::Int(IntType::X64));
    assert_eq!(p.args[2].expr.base, FetchBase::Arg(1));
    // A char pointer parameter as a string: one dereference at 0.
    assert_eq!(p.args[3].expr.derefs, d(&[0]));
    // $arg* expands to all four, named after them.
    let p = resolved("p vfs_read $arg*").unwrap();
    let names: Vec<&str> = p.args.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["file", "buf", "count", "pos"]);
    assert_eq!(p.args[2].expr.base, FetchBase::Arg(3));
    // A written type wins over BTF's.
    let p = resolved("p vfs_read count:x32").unwrap();
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::X32));
    // A char array member is read in place, signed chars (6.1's `char`)
    // as well.
    let p = resolved("p vfs_read file->f_comm:string").unwrap();
    assert_eq!(p.args[0].expr.derefs, d(&[96]));
    let p = resolved("p vfs_read file->f_tag:string").unwrap();
    assert_eq!(p.args[0].expr.derefs, d(&[112]));
}

#[test]
fn return_values_and_entry_arguments_at_a_return() {
    let p = resolved("r vfs_read $retval count $arg4").unwrap();
    assert_eq!(p.args[0].expr.base, FetchBase::RetVal);
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::S64));
    assert_eq!(p.args[1].expr.base, FetchBase::EntryArg(3));
    assert_eq!(p.args[2].expr.base, FetchBase::EntryArg(4));
    let p = resolved("r vfs_open $retval").unwrap();
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::S32));
    assert_eq!(
        resolved("r void_fn $retval").unwrap_err().0,
        ParseErrorKind::NoRetval
    );
    assert_eq!(
        resolved("p vfs_read $retval").unwrap_err().0,
        ParseErrorKind::RetvalOnEntry
    );
    // $argN with a member access is typed through its parameter.
    let p = resolved("p vfs_read $arg1->f_count").unwrap();
    assert_eq!(p.args[0].expr.derefs, d(&[0]));
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::S64));
}

#[test]
fn bitfields_and_enums() {
    let p = resolved("p void_fn f->a f->b f->st f->wide f->whole").unwrap();
    let t: Vec<(ArgType, Vec<Deref>)> = p
        .args
        .iter()
        .map(|a| (a.ty, a.expr.derefs.clone()))
        .collect();
    let bf = |width, shift, container| ArgType::Bitfield {
        width,
        shift,
        container,
    };
    assert_eq!(t[0], (bf(3, 0, 4), d(&[0])));
    assert_eq!(t[1], (bf(5, 3, 4), d(&[0])));
    // The enum bitfield starts a byte: its byte, 4 bits.
    assert_eq!(t[2], (bf(4, 0, 4), d(&[1])));
    // 40 bits from bit 20: byte 2, shift 4, past a u64's... no: 44 bits of 64.
    assert_eq!(t[3], (bf(40, 4, 8), d(&[2])));
    // A kflag struct's ordinary member: no bitfield.
    assert_eq!(t[4], (ArgType::Int(IntType::U32), d(&[4])));
    let p = resolved("p takes_enum k").unwrap();
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::S32));
}

#[test]
fn refusals_name_the_token() {
    use ParseErrorKind::*;
    let cases: &[(&str, ParseErrorKind, usize)] = &[
        ("p vfs_open file->nope", NoBtfField, 17),
        ("p vfs_open file->f_path->dentry", NoPtrStruct, 23),
        (
            "p vfs_open file->f_path.dentry.d_name",
            DotThroughPointer,
            30,
        ),
        ("p vfs_open path.dentry", DotOnArg, 15),
        ("p vfs_open file:string", BadTypeForString, 16),
        ("p vfs_read file->f_count:string", BadTypeForString, 25),
        ("p vfs_open nosuch", NoBtfArg, 11),
        ("p nofunc x", NoBtfEntry, 9),
        ("p vfs_open file-f_path", BadHyphen, 15),
        ("p vfs_open file->", BadMemberName, 17),
        ("p vfs_open x=$arg*", ArgStar, 13),
        ("p vfs_read $arg5->x", NoBtfArg, 11),
        ("p vfs_read count->x", NoPtrStruct, 16),
    ];
    for &(spec, kind, pos) in cases {
        assert_eq!(resolved(spec).unwrap_err(), (kind, pos), "{spec}");
    }
}

#[test]
fn without_btf_a_btf_argument_is_refused_and_plain_ones_pass() {
    let bytes = blob();
    let mut v = SegmentView::new();
    assert!(v.add(Gva(AT), &bytes, bytes.len() as u64));
    let mut p = parse_probe("p vfs_read x=%di count").unwrap();
    assert!(needs_btf(&p));
    let e = resolve_btf::<SegmentView<'_>>(&mut p, Err(BtfError::Absent)).unwrap_err();
    assert_eq!((e.kind, e.pos), (ParseErrorKind::NoBtf, 17));
    let mut plain = parse_probe("p vfs_read x=%di").unwrap();
    assert!(!needs_btf(&plain));
    resolve_btf::<SegmentView<'_>>(&mut plain, Err(BtfError::Absent)).unwrap();
}

#[test]
fn the_render_form_parses_to_the_same_names_and_types() {
    for spec in [
        "p vfs_open file->f_path.dentry->d_name.name:string n=file:%pD",
        "p void_fn f->a f->b f->st f->wide f->whole",
        "r vfs_read $retval count $arg4 c=$comm",
        "p vfs_read $arg* s=@jiffies+8:u32",
    ] {
        let p = resolved(spec).unwrap();
        let again = parse_probe(&p.render_form()).unwrap();
        assert!(!needs_btf(&again), "{}", p.render_form());
        let shape = |p: &ProbeSpec| -> Vec<(String, ArgType)> {
            p.args.iter().map(|a| (a.name.clone(), a.ty)).collect()
        };
        assert_eq!(shape(&again), shape(&p), "{}", p.render_form());
        // Short enough to be written out in full, they are the same fetch.
        for (a, b) in again.args.iter().zip(&p.args) {
            assert_eq!(a.expr.derefs, b.expr.derefs, "{}", p.render_form());
        }
    }
}
