//! BTF arguments resolved over the real BTF of both guest kernels
//! (Debian's 6.1 and the fast-lane 6.12) and of the fast lane's module
//! binfmt_misc (split BTF over the kernel's): the offsets a chain gives
//! must be the ones each kernel lays out, anonymous unions included.

#[path = "../../guest-introspect/tests/common/mod.rs"]
mod common;

use guest_introspect::btf::Btf;
use guest_introspect::elf::Elf;
use guest_introspect::view::SegmentView;
use guest_introspect::Gva;
use tracelang::kprobe::{parse_probe, resolve_btf, ArgType, FetchBase, IntType, ProbeSpec};

/// The image's BTF, parsed in its unslid view.
fn with_btf<R>(img: &common::Image, f: impl FnOnce(&Btf<'_, SegmentView<'_>>) -> R) -> R {
    let view = img.view();
    let sec = img.elf().section(".BTF").expect(".BTF section");
    let btf = Btf::parse(&view, Gva(sec.addr)).expect("BTF parses");
    f(&btf)
}

fn resolve(btf: &Btf<'_, SegmentView<'_>>, spec: &str) -> ProbeSpec {
    let mut p = parse_probe(spec).unwrap();
    resolve_btf(&mut p, Ok(btf)).unwrap_or_else(|e| panic!("{}", e.report(spec)));
    p
}

fn offsets(p: &ProbeSpec, i: usize) -> Vec<i64> {
    p.args[i].expr.derefs.iter().map(|d| d.offset).collect()
}

/// What both kernels must give; `f_path_dentry` is where each keeps
/// `file->f_path.dentry` (6.12 moved `f_path` into an anonymous union).
fn common_checks(btf: &Btf<'_, SegmentView<'_>>, f_path_dentry: i64) {
    let p = resolve(btf, "p vfs_open file->f_path.dentry->d_name.name:string");
    assert_eq!(p.args[0].expr.base, FetchBase::Arg(2));
    // d_name is the fifth member of struct dentry on both (after d_flags,
    // d_seq, d_hash and d_parent), `name` the second of struct qstr.
    assert_eq!(offsets(&p, 0), [f_path_dentry, 40, 0]);
    assert_eq!(p.args[0].ty, ArgType::String);
    let same = resolve(btf, "p vfs_open n=file:%pD");
    assert_eq!(offsets(&same, 0), offsets(&p, 0));

    let p = resolve(btf, "p vfs_read $arg*");
    let got: Vec<(&str, ArgType)> = p.args.iter().map(|a| (a.name.as_str(), a.ty)).collect();
    use IntType::*;
    assert_eq!(
        got,
        [
            ("file", ArgType::Int(X64)),
            ("buf", ArgType::Int(X64)),
            ("count", ArgType::Int(U64)),
            ("pos", ArgType::Int(X64)),
        ]
    );
    let p = resolve(btf, "r vfs_read $retval count");
    assert_eq!(p.args[0].ty, ArgType::Int(S64));
    assert_eq!(p.args[1].expr.base, FetchBase::EntryArg(3));
    // An enum parameter, and a one-bit field of task_struct.
    let p = resolve(btf, "p __task_pid_nr_ns type");
    assert_eq!(p.args[0].ty, ArgType::Int(S32));
    let p = resolve(btf, "p wake_up_process p->in_iowait");
    assert!(
        matches!(p.args[0].ty, ArgType::Bitfield { width: 1, .. }),
        "{:?}",
        p.args[0].ty
    );
    // A `char *` is a string whether `char` is signed (6.1) or not (6.2+).
    let p = resolve(btf, "p setup_new_exec f=bprm->filename:string");
    assert_eq!(p.args[0].ty, ArgType::String);
    assert_eq!(p.args[0].expr.derefs.len(), 2);
    // Errors name their token.
    let mut bad = parse_probe("p vfs_open file->f_nope").unwrap();
    let e = resolve_btf(&mut bad, Ok(btf)).unwrap_err();
    assert_eq!(e.pos, 17, "{e}");
}

#[test]
fn debian_6_1_chains() {
    with_btf(common::debian(), |b| common_checks(b, 24));
}

#[test]
fn fast_lane_6_12_chains() {
    with_btf(common::fast(), |b| common_checks(b, 72));
}

#[test]
fn a_module_function_resolves_through_the_modules_split_btf() {
    let img = common::fast();
    let ko_path = std::fs::read_dir(img.dir.join("modules/lib/modules"))
        .expect("the fast lane's module tree")
        .filter_map(Result::ok)
        .map(|d| d.path().join("kernel/fs/binfmt_misc.ko"))
        .find(|p| p.exists())
        .expect("binfmt_misc.ko");
    let ko = std::fs::read(&ko_path).unwrap();
    let elf = Elf::parse(&ko).expect("binfmt_misc.ko is ELF64");
    let sec = elf.section(".BTF").expect("the module has .BTF");
    let data = elf.data(&sec).unwrap();
    const AT: u64 = 0xffff_ffff_c000_0000;
    let mut view = img.view();
    assert!(view.add(Gva(AT), data, data.len() as u64));
    let vsec = img.elf().section(".BTF").unwrap();
    let base = Btf::parse(&view, Gva(vsec.addr)).unwrap();
    let split = Btf::parse_split(&view, &base, Gva(AT), None).unwrap();
    assert!(split.type_count() > base.type_count());
    // Its function is in its own blob; the parameter's type is the
    // kernel's struct linux_binprm.
    let mut p = parse_probe("p binfmt_misc:load_misc_binary bprm->filename:string bprm").unwrap();
    resolve_btf(&mut p, Ok(&split)).unwrap();
    assert_eq!(p.args[0].expr.base, FetchBase::Arg(1));
    assert_eq!(p.args[0].ty, ArgType::String);
    assert_eq!(
        p.args[0].expr.derefs.len(),
        2,
        "the member, then the char *"
    );
    assert_eq!(p.args[1].ty, ArgType::Int(IntType::X64));
    // The kernel's blob alone does not describe it.
    let mut p = parse_probe("p load_misc_binary bprm").unwrap();
    let e = resolve_btf(&mut p, Ok(&base)).unwrap_err();
    assert_eq!(e.kind, tracelang::kprobe::ParseErrorKind::NoBtfEntry);
}
