//! Host tests of the kprobe module: the parser over tables of valid and
//! invalid specs, the evaluator over a fake pt_regs and fake guest memory,
//! and rendering against literal kernel-format lines.

use alloc::borrow::Cow;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;

use guest_introspect::addr::Gva;
use trampolines::PtRegs;

use super::*;

// ---------------------------------------------------------------- fakes --

/// Guest memory made of whole 4 KiB pages; anything else faults.
#[derive(Default)]
pub(super) struct FakeMem {
    pages: BTreeMap<u64, Vec<u8>>,
    pub reads: usize,
}

impl FakeMem {
    pub fn map(&mut self, page: u64) -> &mut Vec<u8> {
        assert_eq!(page % 4096, 0);
        self.pages.entry(page).or_insert_with(|| vec![0; 4096])
    }

    /// Writes bytes, mapping the pages they touch.
    pub fn write(&mut self, addr: u64, bytes: &[u8]) {
        for (i, b) in bytes.iter().enumerate() {
            let a = addr + i as u64;
            self.map(a & !0xfff)[(a & 0xfff) as usize] = *b;
        }
    }

    pub fn write_u64(&mut self, addr: u64, v: u64) {
        self.write(addr, &v.to_le_bytes());
    }

    pub fn unmap(&mut self, page: u64) {
        self.pages.remove(&page);
    }
}

impl GuestMem for FakeMem {
    fn read(&mut self, gva: Gva, buf: &mut [u8]) -> Result<(), MemFault> {
        self.reads += 1;
        let page = gva.0 & !0xfff;
        let off = (gva.0 & 0xfff) as usize;
        assert!(
            off + buf.len() <= 4096,
            "the evaluator split a read across pages"
        );
        let p = self.pages.get(&page).ok_or(MemFault)?;
        buf.copy_from_slice(&p[off..off + buf.len()]);
        Ok(())
    }
}

/// A few kernel symbols.
pub(super) struct FakeSyms(pub Vec<(&'static str, u64, u64)>);

impl FakeSyms {
    pub fn kernel() -> Self {
        FakeSyms(vec![
            ("do_sys_openat2", 0xffff_ffff_8123_4560, 0x150),
            ("do_sys_open", 0xffff_ffff_8123_46b0, 0x90),
            ("__x64_sys_openat", 0xffff_ffff_8123_4800, 0x30),
            ("jiffies", 0xffff_ffff_8260_5000, 0x8),
            ("init_task", 0xffff_ffff_8261_0000, 0x1000),
        ])
    }
}

impl SymbolResolver for FakeSyms {
    fn lookup(&self, name: &str) -> Option<Gva> {
        self.0.iter().find(|s| s.0 == name).map(|s| Gva(s.1))
    }
    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
        self.0
            .iter()
            .find(|s| addr.0 >= s.1 && addr.0 < s.1 + s.2)
            .map(|s| SymbolAt {
                name: Cow::Borrowed(s.0),
                offset: addr.0 - s.1,
                size: s.2,
                module: None,
            })
    }
}

const KSTACK: u64 = 0xffff_c900_0001_0000; // a 16 KiB-aligned kernel stack
const KDATA: u64 = 0xffff_8880_0100_0000;
const USER: u64 = 0x0000_7ffd_1000_0000;

fn regs() -> PtRegs {
    PtRegs {
        di: 0xffff_ff9c,
        si: USER,
        dx: KDATA,
        cx: 0x44,
        r8: 0x55,
        r9: 0x66,
        ax: 0xfffffffffffffffe,
        bx: 0xb,
        bp: KSTACK + 0x3f00,
        sp: KSTACK + 0x3e00,
        ip: 0xffff_ffff_8123_4565,
        flags: 0x246,
        cs: 0x10,
        ss: 0x18,
        ..PtRegs::default()
    }
}

fn ctx(regs: &PtRegs) -> FetchContext<'_> {
    FetchContext {
        regs,
        comm: Some(b"cat\0\0\0\0\0\0\0\0\0\0\0\0\0"),
        layout: GuestLayout::X86_64_4LEVEL,
        entry_args: None,
    }
}

fn probe(spec: &str) -> ProbeSpec {
    match parse_probe(spec) {
        Ok(p) => p,
        Err(e) => panic!("{}", e.report(spec)),
    }
}

fn err(spec: &str) -> ParseError {
    match parse(spec) {
        Ok(c) => panic!("accepted {spec:?}: {c:?}"),
        Err(e) => e,
    }
}

/// Evaluates a one-argument spec's argument.
fn eval1(arg: &str, regs: &PtRegs, mem: &mut FakeMem) -> FetchedValue {
    let p = probe(&format!("p do_sys_openat2 {arg}"));
    let v = fetch(&p.args, &ctx(regs), mem, &FakeSyms::kernel());
    assert_eq!(v.len(), 1);
    v.into_iter().next().unwrap()
}

/// The text an argument prints as.
fn shown(v: &FetchedValue) -> String {
    let mut s = String::new();
    write_value(&mut s, &FakeSyms::kernel(), v);
    s
}

// --------------------------------------------------------- parser: valid --

#[test]
fn the_openat_probe() {
    let p = probe("p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string");
    assert_eq!(p.kind, ProbeKind::Entry);
    assert_eq!(
        (p.group.as_str(), p.event.as_str(), p.symbol.as_str()),
        ("kprobes", "myopen", "do_sys_openat2")
    );
    assert_eq!(p.args.len(), 2);
    assert_eq!(p.args[0].name, "dfd");
    assert_eq!(
        p.args[0].expr,
        FetchExpr {
            base: FetchBase::Reg(Reg::Di),
            derefs: vec![]
        }
    );
    assert_eq!(p.args[0].ty, ArgType::Int(IntType::X64));
    assert_eq!(p.args[1].name, "filename");
    assert_eq!(
        p.args[1].expr,
        FetchExpr {
            base: FetchBase::Reg(Reg::Si),
            derefs: vec![Deref {
                offset: 0,
                user: false
            }]
        }
    );
    assert_eq!(p.args[1].ty, ArgType::String);
    assert_eq!(
        p.to_string(),
        "p:kprobes/myopen do_sys_openat2 dfd=%di filename=+0(%si):string"
    );
}

/// Valid specs and the kernel's listing of each (`cat kprobe_events`).
const VALID: &[(&str, &str)] = &[
    ("p do_sys_openat2", "p:kprobes/p_do_sys_openat2_0 do_sys_openat2"),
    ("p do_sys_openat2+0", "p:kprobes/p_do_sys_openat2_0 do_sys_openat2"),
    ("p do_sys_openat2+0x0 %di", "p:kprobes/p_do_sys_openat2_0 do_sys_openat2 arg1=%di"),
    ("p do_sys_openat2-0", "p:kprobes/p_do_sys_openat2_0 do_sys_openat2"),
    ("p:ev foo.isra.0", "p:kprobes/ev foo.isra.0"),
    ("p foo.isra.0", "p:kprobes/p_foo_isra_0_0 foo.isra.0"),
    ("p:grp/ev foo", "p:grp/ev foo"),
    ("p:grp/ foo", "p:grp/p_foo_0 foo"),
    ("p:my-grp.ev foo", "p:my-grp/ev foo"),
    ("r foo", "r:kprobes/r_foo_0 foo"),
    ("r:ret foo $retval", "r:kprobes/ret foo arg1=$retval"),
    ("r10:g/ret foo rv=$retval:s32", "r10:g/ret foo rv=$retval:s32"),
    ("r0x10 foo", "r16:kprobes/r_foo_0 foo"),
    ("p:ev foo%return $retval", "r:kprobes/ev foo arg1=$retval"),
    ("p foo+0%return", "r:kprobes/r_foo_0 foo"),
    ("  p:ev\tfoo   a=%ax\n", "p:kprobes/ev foo a=%ax"),
    (
        "p foo %ax %bx %cx %dx %si %di %bp %sp %ip %flags %cs %ss %orig_ax",
        "p:kprobes/p_foo_0 foo arg1=%ax arg2=%bx arg3=%cx arg4=%dx arg5=%si arg6=%di arg7=%bp \
         arg8=%sp arg9=%ip arg10=%flags arg11=%cs arg12=%ss arg13=%orig_ax",
    ),
    (
        "p foo %r8 %r9 %r10 %r11 %r12 %r13 %r14 %r15",
        "p:kprobes/p_foo_0 foo arg1=%r8 arg2=%r9 arg3=%r10 arg4=%r11 arg5=%r12 arg6=%r13 arg7=%r14 \
         arg8=%r15",
    ),
    ("p foo @0xffffffff81000000 @jiffies @jiffies+0x10 @jiffies-8", "p:kprobes/p_foo_0 foo arg1=@0xffffffff81000000 arg2=@jiffies arg3=@jiffies+0x10 arg4=@jiffies-8"),
    ("p foo $stack $stack0 $stack3 $stack2048", "p:kprobes/p_foo_0 foo arg1=$stack arg2=$stack0 arg3=$stack3 arg4=$stack2048"),
    ("p foo $arg1 $arg6 $arg7 $comm $COMM", "p:kprobes/p_foo_0 foo arg1=$arg1 arg2=$arg6 arg3=$arg7 arg4=$comm arg5=$COMM"),
    ("p foo \\-5 \\0x10 \\010 \\+3 \\7:u8", "p:kprobes/p_foo_0 foo arg1=\\-5 arg2=\\0x10 arg3=\\010 arg4=\\+3 arg5=\\7:u8"),
    ("p foo s=\\\"hello\":string t=\\\"\"", "p:kprobes/p_foo_0 foo s=\\\"hello\":string t=\\\"\""),
    ("p foo +8(+0(%di)) -8(%bp) +0x10($stack) +u0(%si):string -u4(%si):u32", "p:kprobes/p_foo_0 foo arg1=+8(+0(%di)) arg2=-8(%bp) arg3=+0x10($stack) arg4=+u0(%si):string arg5=-u4(%si):u32"),
    ("p foo a=%di:u8 b=%di:u16 c=%di:u32 d=%di:u64", "p:kprobes/p_foo_0 foo a=%di:u8 b=%di:u16 c=%di:u32 d=%di:u64"),
    ("p foo a=%di:s8 b=%di:s16 c=%di:s32 d=%di:s64", "p:kprobes/p_foo_0 foo a=%di:s8 b=%di:s16 c=%di:s32 d=%di:s64"),
    ("p foo a=%di:x8 b=%di:x16 c=%di:x32 d=%di:x64", "p:kprobes/p_foo_0 foo a=%di:x8 b=%di:x16 c=%di:x32 d=%di:x64"),
    ("p foo a=%di:char b=%di:symbol c=%di:symstr d=+0(%di):symstr", "p:kprobes/p_foo_0 foo a=%di:char b=%di:symbol c=%di:symstr d=+0(%di):symstr"),
    ("p foo a=+0(%si):ustring b=\\0xffffffff82000000:string c=@jiffies:string d=$comm:string", "p:kprobes/p_foo_0 foo a=+0(%si):ustring b=\\0xffffffff82000000:string c=@jiffies:string d=$comm:string"),
    ("p foo a=+4(%di):b3@2/32 b=%di:b1@63/64", "p:kprobes/p_foo_0 foo a=+4(%di):b3@2/32 b=%di:b1@63/64"),
    ("p foo a=%di %si b=%dx", "p:kprobes/p_foo_0 foo a=%di arg2=%si b=%dx"),
    ("p foo ++8(%di) +-8(%di)", "p:kprobes/p_foo_0 foo arg1=++8(%di) arg2=+-8(%di)"),
    ("-:myopen", ""),
];

#[test]
fn valid_specs_parse_and_list_as_the_kernel_lists_them() {
    for (spec, listing) in VALID {
        match parse(spec) {
            Ok(Command::Add(p)) => {
                assert_eq!(p.to_string(), *listing, "{spec}");
                // The listing parses back to the same probe.
                assert_eq!(parse_probe(&p.to_string()).as_ref(), Ok(&p), "{spec}");
            }
            Ok(Command::Delete(_)) => assert!(listing.is_empty()),
            Err(e) => panic!("{}", e.report(spec)),
        }
    }
}

#[test]
fn every_fetcharg_form_has_its_meaning() {
    use FetchBase as B;
    let d = |offset, user| Deref { offset, user };
    let cases: &[(&str, FetchBase, Vec<Deref>, ArgType)] = &[
        ("%orig_ax", B::Reg(Reg::OrigAx), vec![], ArgType::DEFAULT),
        (
            "@0xffffffff81000000",
            B::Imm(0xffff_ffff_8100_0000),
            vec![d(0, false)],
            ArgType::DEFAULT,
        ),
        ("@010", B::Imm(8), vec![d(0, false)], ArgType::DEFAULT),
        (
            "@jiffies",
            B::Symbol {
                name: "jiffies".into(),
                offset: 0,
                resolved: None,
            },
            vec![d(0, false)],
            ArgType::DEFAULT,
        ),
        (
            "@sym+0x10",
            B::Symbol {
                name: "sym".into(),
                offset: 16,
                resolved: None,
            },
            vec![d(0, false)],
            ArgType::DEFAULT,
        ),
        (
            "@sym-8:u32",
            B::Symbol {
                name: "sym".into(),
                offset: -8,
                resolved: None,
            },
            vec![d(0, false)],
            ArgType::Int(IntType::U32),
        ),
        ("$stack", B::StackPointer, vec![], ArgType::DEFAULT),
        ("$stack3", B::StackEntry(3), vec![], ArgType::DEFAULT),
        ("$stack010", B::StackEntry(10), vec![], ArgType::DEFAULT),
        ("$arg1", B::Arg(1), vec![], ArgType::DEFAULT),
        ("$arg2048", B::Arg(2048), vec![], ArgType::DEFAULT),
        ("$comm", B::Comm, vec![], ArgType::String),
        ("\\-5", B::Imm(-5i64 as u64), vec![], ArgType::DEFAULT),
        ("\\+5", B::Imm(5), vec![], ArgType::DEFAULT),
        ("\\0x10:s8", B::Imm(16), vec![], ArgType::Int(IntType::S8)),
        (
            "\\\"a_b\"",
            B::ImmString("a_b".into()),
            vec![],
            ArgType::String,
        ),
        (
            "+8(+0(%di))",
            B::Reg(Reg::Di),
            vec![d(0, false), d(8, false)],
            ArgType::DEFAULT,
        ),
        (
            "-0x10(%bp):s32",
            B::Reg(Reg::Bp),
            vec![d(-16, false)],
            ArgType::Int(IntType::S32),
        ),
        (
            "+u8(+u0(%si)):ustring",
            B::Reg(Reg::Si),
            vec![d(0, true), d(8, true)],
            ArgType::UString,
        ),
        (
            "+0(\\0x1000)",
            B::Imm(0x1000),
            vec![d(0, false)],
            ArgType::DEFAULT,
        ),
        (
            "+0(@jiffies)",
            B::Symbol {
                name: "jiffies".into(),
                offset: 0,
                resolved: None,
            },
            vec![d(0, false), d(0, false)],
            ArgType::DEFAULT,
        ),
        (
            "+0($stack):b4@4/8",
            B::StackPointer,
            vec![d(0, false)],
            ArgType::Bitfield {
                width: 4,
                shift: 4,
                container: 1,
            },
        ),
    ];
    for (arg, base, derefs, ty) in cases {
        let p = probe(&format!("p foo {arg}"));
        let a = &p.args[0];
        assert_eq!(&a.expr.base, base, "{arg}");
        assert_eq!(&a.expr.derefs, derefs, "{arg}");
        assert_eq!(a.ty, *ty, "{arg}");
        assert_eq!(a.body, *arg);
        assert_eq!(a.name, "arg1");
    }
}

#[test]
fn return_probes_take_retval() {
    let p = probe("r5:g/e do_sys_openat2 ret=$retval:s64");
    assert_eq!(p.kind, ProbeKind::Return { maxactive: 5 });
    assert_eq!(p.args[0].expr.base, FetchBase::RetVal);
    assert!(p.kind.is_return());
}

#[test]
fn deletions() {
    let del = |s: &str| match parse(s) {
        Ok(Command::Delete(d)) => d,
        other => panic!("{s}: {other:?}"),
    };
    assert_eq!(
        del("-:myopen"),
        DeleteSpec {
            group: None,
            event: Some("myopen".into())
        }
    );
    assert_eq!(
        del("-:grp/ev"),
        DeleteSpec {
            group: Some("grp".into()),
            event: Some("ev".into())
        }
    );
    assert_eq!(
        del(" -:grp/ "),
        DeleteSpec {
            group: Some("grp".into()),
            event: None
        }
    );
    assert_eq!(
        parse_probe("-:ev").unwrap_err().kind,
        ParseErrorKind::BadCommand
    );
}

#[test]
fn fourteen_nested_dereferences_is_the_limit() {
    let nest = |n: usize, inner: &str| format!("{}{}{}", "+0(".repeat(n), inner, ")".repeat(n));
    let p = probe(&format!("p foo {}", nest(14, "%di")));
    assert_eq!(p.args[0].expr.derefs.len(), 14);
    // One more: within the 63 characters, past the kernel's 16 instructions.
    let spec = format!("p foo {}", nest(15, "%di"));
    assert_eq!(nest(15, "%di").len(), 63);
    assert_eq!(err(&spec).kind, ParseErrorKind::TooDeep);
    // @SYM costs two instructions, a bitfield one more.
    let p = probe(&format!("p foo {}", nest(12, "@j")));
    assert_eq!(p.args[0].expr.derefs.len(), 13);
    assert_eq!(
        err(&format!("p foo {}", nest(13, "@j"))).kind,
        ParseErrorKind::TooDeep
    );
    assert_eq!(
        err(&format!("p foo {}:b1@0/8", nest(12, "@j"))).kind,
        ParseErrorKind::TooDeep
    );
    probe(&format!("p foo {}:b1@0/8", nest(11, "@j")));
    probe(&format!("p foo {}:b1@0/8", nest(13, "%ax")));
    assert_eq!(
        err(&format!("p foo {}:b1@0/8", nest(14, "%di"))).kind,
        ParseErrorKind::ArgTooLong
    );
}

#[test]
fn argument_limits() {
    let many: Vec<String> = (0..128).map(|i| format!("a{i}=%di")).collect();
    let p = probe(&format!("p foo {}", many.join(" ")));
    assert_eq!(p.args.len(), 128);
    let spec = format!("p foo {} %si", many.join(" "));
    let e = err(&spec);
    assert_eq!(e.kind, ParseErrorKind::TooManyArgs);
    assert_eq!(e.token, "%si");
    // 32-character names, 63-character bodies.
    let name32 = "n".repeat(32);
    probe(&format!("p foo {name32}=%di"));
    assert_eq!(
        err(&format!("p foo {name32}x=%di")).kind,
        ParseErrorKind::ArgNameTooLong
    );
    let body63 = format!("+{}(%di)", "0".repeat(57));
    assert_eq!(body63.len(), 63);
    probe(&format!("p foo {body63}"));
    assert_eq!(
        err(&format!("p foo +0{}", &body63[1..])).kind,
        ParseErrorKind::ArgTooLong
    );
    // 63-character event and group names.
    let ev63 = "e".repeat(63);
    probe(&format!("p:{ev63}/{ev63} foo"));
    assert_eq!(
        err(&format!("p:{ev63}e foo")).kind,
        ParseErrorKind::EventTooLong
    );
    assert_eq!(
        err(&format!("p:{ev63}g/e foo")).kind,
        ParseErrorKind::GroupTooLong
    );
}

#[test]
fn default_event_names_are_cut_to_63() {
    let sym = "s".repeat(80);
    let p = probe(&format!("p {sym}"));
    assert_eq!(p.event.len(), 63);
    assert!(p.event.starts_with("p_sss"));
}

// ------------------------------------------------------- parser: invalid --

/// Invalid specs: the error kind, the token's byte offset and length, and
/// the one-line message.
const INVALID: &[(&str, ParseErrorKind, usize, usize, &str)] = {
    use ParseErrorKind::*;
    &[
        (
            "p:myopen do_sys_openat2 dfd=%dj",
            BadRegName { suggestion: None },
            28,
            3,
            "bad register name \"%dj\" at column 29",
        ),
        (
            "p:myopen do_sys_openat2 dfd=%rax",
            BadRegName { suggestion: Some(Reg::Ax) },
            28,
            4,
            "bad register name \"%rax\" at column 29 (kprobe_events calls it %ax)",
        ),
        (
            "p do_sys_openat2+8",
            NotFunctionEntry,
            16,
            2,
            "only function entry can be probed (SYM or SYM+0), not an offset into it \"+8\" at column 17",
        ),
        (
            "p do_sys_openat2+0x10 %di",
            NotFunctionEntry,
            16,
            5,
            "only function entry can be probed (SYM or SYM+0), not an offset into it \"+0x10\" at column 17",
        ),
        (
            "r do_sys_openat2+4",
            NotFunctionEntry,
            16,
            2,
            "only function entry can be probed (SYM or SYM+0), not an offset into it \"+4\" at column 17",
        ),
        ("p foo-4", BadProbeOffset, 5, 2, "bad probe offset \"-4\" at column 6"),
        ("p foo+x", BadProbeOffset, 5, 2, "bad probe offset \"+x\" at column 6"),
        (
            "p 0xffffffff81000000",
            AddressProbe,
            2,
            18,
            "probing a raw address is not supported, name the function \"0xffffffff81000000\" at column 3",
        ),
        (
            "p ext!4:ext4_sync_file",
            ModuleSymbol,
            2,
            5,
            "bad module name (MOD:SYM) \"ext!4\" at column 3",
        ),
        (":ext4_sync_file", BadCommand, 0, 1, "probe definition must start with 'p', 'r' or '-:' \":\" at column 1"),
        ("p :ext4_sync_file", ModuleSymbol, 2, 0, "bad module name (MOD:SYM) at column 3"),
        ("p ext4:", BadSymbol, 2, 5, "bad symbol name \"ext4:\" at column 3"),
        ("p /bin/sh:0x10", UprobeSpec, 2, 12, "uprobes are not supported \"/bin/sh:0x10\" at column 3"),
        ("p foo%ret", BadProbeSuffix, 5, 4, "bad probe point suffix (only %return) \"%ret\" at column 6"),
        ("p 1foo", BadSymbol, 2, 4, "bad symbol name \"1foo\" at column 3"),
        ("p %return", BadSymbol, 2, 7, "bad symbol name \"%return\" at column 3"),
        ("x foo", BadCommand, 0, 1, "probe definition must start with 'p', 'r' or '-:' \"x\" at column 1"),
        ("px foo", BadCommand, 1, 1, "probe definition must start with 'p', 'r' or '-:' \"x\" at column 2"),
        ("p5 foo", MaxactiveOnEntry, 1, 1, "maxactive is only for return probes \"5\" at column 2"),
        ("r0 foo", BadMaxactive, 1, 1, "bad maxactive number \"0\" at column 2"),
        ("r5x:e foo", BadMaxactive, 1, 2, "bad maxactive number \"5x\" at column 2"),
        ("r5000 foo", MaxactiveTooBig, 1, 4, "maxactive is too big (at most 4096) \"5000\" at column 2"),
        ("p:/ev foo", NoGroupName, 2, 0, "group name is not specified at column 3"),
        ("p: foo", NoEventName, 2, 0, "event name is not specified at column 3"),
        ("p:1ev foo", BadEventName, 2, 3, "event name must be a C identifier \"1ev\" at column 3"),
        ("p:g/e-v foo", BadEventName, 4, 3, "event name must be a C identifier \"e-v\" at column 5"),
        ("p:g!/ev foo", BadGroupName, 2, 2, "group name must be a C identifier \"g!\" at column 3"),
        ("p", MissingSymbol, 1, 0, "missing probe point (a function name) at column 2"),
        ("p:ev  ", MissingSymbol, 4, 0, "missing probe point (a function name) at column 5"),
        ("p foo =%di", NoArgName, 6, 1, "argument name is not specified \"=\" at column 7"),
        ("p foo 1x=%di", BadArgName, 6, 2, "argument name must be a C identifier \"1x\" at column 7"),
        (
            "p foo a=%di a=%si",
            UsedArgName,
            12,
            1,
            "argument name is reserved or already used \"a\" at column 13",
        ),
        (
            "p foo common_pid=%di",
            UsedArgName,
            6,
            10,
            "argument name is reserved or already used \"common_pid\" at column 7",
        ),
        (
            "p foo arg2=%di %si",
            UsedArgName,
            15,
            3,
            "argument name is reserved or already used \"arg2\" at column 16",
        ),
        ("p foo a=", NoArgBody, 8, 0, "no argument expression at column 9"),
        ("p foo %di:u7", BadType, 10, 2, "unknown type \"u7\" at column 11"),
        ("p foo %di:", BadType, 10, 0, "unknown type at column 11"),
        ("p foo +0(%di):x8[4]", ArrayType, 16, 3, "array types are not supported \"[4]\" at column 17"),
        (
            "p foo $comm:u32",
            NeedStringType,
            12,
            3,
            "$comm and immediate strings only take the string type \"u32\" at column 13",
        ),
        (
            "p foo \\\"x\":ustring",
            NeedStringType,
            11,
            7,
            "$comm and immediate strings only take the string type \"ustring\" at column 12",
        ),
        (
            "p foo %di:string",
            BadString,
            10,
            6,
            "string types need a memory fetch such as +0(%si) \"string\" at column 11",
        ),
        (
            "p foo $stack:ustring",
            BadString,
            13,
            7,
            "string types need a memory fetch such as +0(%si) \"ustring\" at column 14",
        ),
        (
            "p foo $stack:symstr",
            BadSymStr,
            13,
            6,
            "symstr does not take immediates, $stack, $comm or user memory \"symstr\" at column 14",
        ),
        (
            "p foo +u0(%di):symstr",
            BadSymStr,
            15,
            6,
            "symstr does not take immediates, $stack, $comm or user memory \"symstr\" at column 16",
        ),
        (
            "p foo %di:b9@0/8",
            BadBitfield,
            10,
            6,
            "bad bitfield (b<width>@<shift>/<container bits>) \"b9@0/8\" at column 11",
        ),
        (
            "p foo %di:b0@0/8",
            BadBitfield,
            10,
            6,
            "bad bitfield (b<width>@<shift>/<container bits>) \"b0@0/8\" at column 11",
        ),
        ("p foo %di:b4@0/12", BadType, 10, 7, "unknown type \"b4@0/12\" at column 11"),
        (
            "p foo $retval",
            RetvalOnEntry,
            6,
            7,
            "$retval is only available on return probes \"$retval\" at column 7",
        ),
        ("r foo $retvalx", BadVar, 6, 8, "bad $-variable \"$retvalx\" at column 7"),
        (
            "p foo $stack2049",
            BadStackNum,
            6,
            10,
            "bad stack number (at most 2048) \"$stack2049\" at column 7",
        ),
        ("p foo $stackx", BadVar, 6, 7, "bad $-variable \"$stackx\" at column 7"),
        ("p foo $stack0x1", BadVar, 6, 9, "bad $-variable \"$stack0x1\" at column 7"),
        ("p foo $arg0", BadArgNum, 6, 5, "bad argument number (1 to 2048) \"$arg0\" at column 7"),
        ("p foo $arg", BadVar, 6, 4, "bad $-variable \"$arg\" at column 7"),
        ("p foo x=$arg*", ArgStar, 8, 5, "$arg* takes no name, type or member access \"$arg*\" at column 9"),
        ("p foo $arg*:u8", ArgStar, 6, 5, "$arg* takes no name, type or member access \"$arg*\" at column 7"),
        ("p foo $arg*->x", ArgStar, 6, 8, "$arg* takes no name, type or member access \"$arg*->x\" at column 7"),
        ("p foo $foo", BadVar, 6, 4, "bad $-variable \"$foo\" at column 7"),
        ("p foo @0xzz", BadMemAddr, 6, 5, "bad memory address \"@0xzz\" at column 7"),
        ("p foo @", BadMemAddr, 6, 1, "bad memory address \"@\" at column 7"),
        ("p foo @sym+x", BadMemAddr, 10, 2, "bad memory address \"+x\" at column 11"),
        ("p foo @+10", FileOffset, 6, 4, "file offsets (@+OFFS) are only for uprobes \"@+10\" at column 7"),
        ("p foo \\abc", BadImm, 7, 3, "bad immediate value \"abc\" at column 8"),
        ("p foo \\", BadImm, 7, 0, "bad immediate value at column 8"),
        ("p foo \\\"abc", ImmStrNoClose, 11, 0, "immediate string is not closed with '\"' at column 12"),
        ("p foo +0%di", DerefNeedBrace, 6, 5, "dereference needs '(' \"+0%di\" at column 7"),
        ("p foo +x(%di)", BadDerefOffset, 7, 1, "bad dereference offset \"x\" at column 8"),
        ("p foo +(%di)", BadDerefOffset, 6, 2, "bad dereference offset \"+(\" at column 7"),
        ("p foo -+8(%di)", BadDerefOffset, 7, 2, "bad dereference offset \"+8\" at column 8"),
        ("p foo +0(%di", DerefOpenBrace, 12, 0, "dereference '(' is not closed at column 13"),
        ("p foo +0(%di)x", TrailingText, 13, 1, "unexpected text after ')' \"x\" at column 14"),
        (
            "p foo +0($comm)",
            CommCantDeref,
            9,
            5,
            "$comm and immediate strings can not be dereferenced \"$comm\" at column 10",
        ),
        (
            "p foo +0(\\\"s\")",
            CommCantDeref,
            9,
            4,
            "$comm and immediate strings can not be dereferenced \"\\\\\\\"s\\\"\" at column 10",
        ),
        ("p foo +0()", BadFetchArg, 9, 0, "bad fetch argument at column 10"),
        ("p foo #", BadFetchArg, 6, 1, "bad fetch argument \"#\" at column 7"),
        ("p foo a-b", BadHyphen, 7, 1, "'-' must be part of '->' \"-\" at column 8"),
        ("p foo a->1x", BadMemberName, 9, 2, "member name must be a C identifier \"1x\" at column 10"),
        ("p foo a.b", DotOnArg, 7, 1, "'.' on a function argument is not supported, use '->' \".\" at column 8"),
        ("p foo $retval->x", RetvalOnEntry, 6, 7, "$retval is only available on return probes \"$retval\" at column 7"),
        (
            "p foo +8(+0(%dj))",
            BadRegName { suggestion: None },
            12,
            3,
            "bad register name \"%dj\" at column 13",
        ),
        ("-:ev extra", DeleteExtra, 5, 5, "unexpected text after the event to delete \"extra\" at column 6"),
        ("-x", BadCommand, 0, 1, "probe definition must start with 'p', 'r' or '-:' \"-\" at column 1"),
        ("-:", NoEventName, 2, 0, "event name is not specified at column 3"),
        ("-:/ev", NoGroupName, 2, 0, "group name is not specified at column 3"),
        ("", Empty, 0, 0, "empty probe definition at column 1"),
        ("  \t ", Empty, 0, 0, "empty probe definition at column 1"),
    ]
};

#[test]
fn invalid_specs_point_at_the_bad_token() {
    for (spec, kind, pos, len, msg) in INVALID {
        let e = err(spec);
        assert_eq!((e.kind, e.pos, e.len), (*kind, *pos, *len), "{spec}: {e}");
        assert_eq!(e.to_string(), *msg, "{spec}");
        // (An unnamed argument's clash names the generated name.)
        if *len > 0 && e.token != "arg2" {
            assert_eq!(
                spec.get(*pos..*pos + *len),
                Some(e.token.as_str()),
                "{spec}"
            );
        }
        // One line, and the caret never panics.
        assert!(!e.to_string().contains('\n'));
        let caret = e.caret(spec);
        assert_eq!(caret.lines().count(), 2, "{spec}");
    }
}

#[test]
fn caret_lines() {
    let spec = "p:myopen do_sys_openat2 dfd=%dj";
    let e = err(spec);
    assert_eq!(
        e.caret(spec),
        "p:myopen do_sys_openat2 dfd=%dj\n                            ^~~"
    );
    assert_eq!(
        e.report(spec),
        "bad register name \"%dj\" at column 29\np:myopen do_sys_openat2 dfd=%dj\n                            ^~~"
    );
    // Tabs are kept so the caret lines up; a missing token gets a lone caret.
    let spec = "p\tfoo\t+0(%di";
    assert_eq!(err(spec).caret(spec), "p\tfoo\t+0(%di\n \t   \t      ^");
    // Characters, not bytes, before the token.
    let spec = "p:é foo";
    let e = err(spec);
    assert_eq!(e.kind, ParseErrorKind::BadEventName);
    assert_eq!(e.column(spec), 3);
    assert_eq!(e.caret(spec), "p:é foo\n  ^");
}

// ------------------------------------------------------------ evaluator --

#[test]
fn registers_and_default_types() {
    let r = regs();
    let mut m = FakeMem::default();
    assert_eq!(
        eval1("%di", &r, &mut m),
        FetchedValue::Int {
            ty: IntType::X64,
            value: 0xffff_ff9c
        }
    );
    assert_eq!(shown(&eval1("%di", &r, &mut m)), "0xffffff9c");
    assert_eq!(shown(&eval1("%di:s32", &r, &mut m)), "-100");
    assert_eq!(shown(&eval1("%di:u32", &r, &mut m)), "4294967196");
    assert_eq!(shown(&eval1("%di:x16", &r, &mut m)), "0xff9c");
    assert_eq!(shown(&eval1("%di:s8", &r, &mut m)), "-100");
    assert_eq!(shown(&eval1("%di:u8", &r, &mut m)), "156");
    assert_eq!(shown(&eval1("%ax:s64", &r, &mut m)), "-2");
    assert_eq!(shown(&eval1("%ax:u64", &r, &mut m)), "18446744073709551614");
    assert_eq!(shown(&eval1("%ax", &r, &mut m)), "0xfffffffffffffffe");
    assert_eq!(shown(&eval1("%flags:x16", &r, &mut m)), "0x246");
    assert_eq!(shown(&eval1("%cx:char", &r, &mut m)), "'D'");
    assert_eq!(
        shown(&eval1("$stack", &r, &mut m)),
        format!("{:#x}", KSTACK + 0x3e00)
    );
    assert_eq!(m.reads, 0);
}

#[test]
fn immediates() {
    let r = regs();
    let mut m = FakeMem::default();
    assert_eq!(shown(&eval1("\\-5", &r, &mut m)), "0xfffffffffffffffb");
    assert_eq!(shown(&eval1("\\-5:s32", &r, &mut m)), "-5");
    assert_eq!(shown(&eval1("\\010:u8", &r, &mut m)), "8");
    assert_eq!(shown(&eval1("\\\"hi_there\"", &r, &mut m)), "\"hi_there\"");
    assert_eq!(shown(&eval1("$comm", &r, &mut m)), "\"cat\"");
}

#[test]
fn arguments_follow_the_calling_convention() {
    let r = regs();
    let mut m = FakeMem::default();
    m.write_u64(r.sp, 0xffff_ffff_8123_4810); // return address
    m.write_u64(r.sp + 8, 0x77);
    m.write_u64(r.sp + 16, 0x88);
    let got: Vec<String> = (1..=8)
        .map(|n| shown(&eval1(&format!("$arg{n}"), &r, &mut m)))
        .collect();
    assert_eq!(
        got,
        [
            "0xffffff9c",
            &format!("{USER:#x}"),
            &format!("{KDATA:#x}"),
            "0x44",
            "0x55",
            "0x66",
            "0x77",
            "0x88"
        ]
    );
    assert_eq!(
        shown(&eval1("$stack0:symbol", &r, &mut m)),
        "__x64_sys_openat+0x10/0x30"
    );
    assert_eq!(shown(&eval1("$stack1", &r, &mut m)), "0x77");
    assert_eq!(shown(&eval1("$stack3", &r, &mut m)), "0x0"); // mapped, zero
}

#[test]
fn stack_slots_outside_the_stack_or_unreadable_are_zero() {
    // regs_get_kernel_stack_nth: 0, not a fault.
    let r = regs();
    let mut m = FakeMem::default();
    m.write_u64(r.sp, 1);
    // sp + 8*64 crosses the 16 KiB stack's end.
    let past = (KSTACK + 0x4000 - r.sp) / 8;
    m.write_u64(r.sp + 8 * past, 0xdead);
    assert_eq!(
        eval1(&format!("$stack{past}"), &r, &mut m),
        FetchedValue::Int {
            ty: IntType::X64,
            value: 0
        }
    );
    assert_eq!(
        eval1(&format!("$stack{}", past - 1), &r, &mut m),
        FetchedValue::Int {
            ty: IntType::X64,
            value: 0
        }
    );
    m.write_u64(r.sp + 8 * (past - 1), 0xbeef);
    assert_eq!(
        shown(&eval1(&format!("$stack{}", past - 1), &r, &mut m)),
        "0xbeef"
    );
    // An unmapped stack reads as zero too.
    let mut empty = FakeMem::default();
    assert_eq!(shown(&eval1("$stack2", &r, &mut empty)), "0x0");
    assert_eq!(shown(&eval1("$arg9", &r, &mut empty)), "0x0");
}

#[test]
fn the_openat_probe_fetches_the_filename() {
    let r = regs();
    let mut m = FakeMem::default();
    m.write(USER, b"/etc/hostname\0");
    let p = probe("p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string");
    let v = fetch(&p.args, &ctx(&r), &mut m, &FakeSyms::kernel());
    assert_eq!(
        v,
        vec![
            FetchedValue::Int {
                ty: IntType::X64,
                value: 0xffff_ff9c
            },
            FetchedValue::Str(b"/etc/hostname".to_vec())
        ]
    );
}

#[test]
fn fetching_into_the_last_values_reuses_their_room_and_strings() {
    use crate::kprobe::try_fetch_into;
    let r = regs();
    let mut m = FakeMem::default();
    m.write(USER, b"/etc/hostname\0");
    let p = probe("p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string c=$comm");
    let syms = FakeSyms::kernel();
    let mut values = Vec::new();
    try_fetch_into(&p.args, &ctx(&r), &mut m, &syms, &mut values).unwrap();
    assert_eq!(values, fetch(&p.args, &ctx(&r), &mut m, &syms));
    let buffers = |v: &[FetchedValue]| -> Vec<(*const u8, usize)> {
        v.iter()
            .filter_map(|x| match x {
                FetchedValue::Str(b) => Some((b.as_ptr(), b.capacity())),
                _ => None,
            })
            .collect()
    };
    let (room, before) = (values.as_ptr(), buffers(&values));
    assert_eq!(before.len(), 2);
    // A shorter name next: the same buffers, no allocation.
    m.write(USER, b"/tmp\0");
    try_fetch_into(&p.args, &ctx(&r), &mut m, &syms, &mut values).unwrap();
    assert_eq!(values[1], FetchedValue::Str(b"/tmp".to_vec()));
    assert_eq!((values.as_ptr(), buffers(&values)), (room, before));
    assert_eq!(values, fetch(&p.args, &ctx(&r), &mut m, &syms));
    // Fewer arguments (another probe) leave fewer values; more add some.
    let one = probe("p:one do_sys_openat2 filename=+0(%si):string");
    try_fetch_into(&one.args, &ctx(&r), &mut m, &syms, &mut values).unwrap();
    assert_eq!(values, [FetchedValue::Str(b"/tmp".to_vec())]);
    try_fetch_into(&p.args, &ctx(&r), &mut m, &syms, &mut values).unwrap();
    assert_eq!(values, fetch(&p.args, &ctx(&r), &mut m, &syms));
    // A string that faults is a fault, in its place.
    let r2 = PtRegs {
        si: USER + 0x10_0000,
        ..r
    };
    try_fetch_into(&p.args, &ctx(&r2), &mut m, &syms, &mut values).unwrap();
    assert_eq!(values[1], FetchedValue::Fault);
    assert_eq!(values.len(), 3);
}

/// A chain of pointers: di -> A, *(A+0) = B, *(B+16) = C, *(C+8) = 42.
fn chain() -> (PtRegs, FakeMem, [u64; 3]) {
    let a = KDATA + 0x1000;
    let b = KDATA + 0x3000;
    let c = KDATA + 0x5000;
    let mut m = FakeMem::default();
    m.write_u64(a, b);
    m.write_u64(b + 16, c);
    m.write_u64(b + 24, c + 16);
    m.write_u64(c + 8, 42);
    let r = PtRegs { di: a, ..regs() };
    (r, m, [a, b, c])
}

#[test]
fn nested_dereferences() {
    let (r, mut m, [a, b, c]) = chain();
    assert_eq!(shown(&eval1("+0(%di)", &r, &mut m)), format!("{b:#x}"));
    assert_eq!(shown(&eval1("+16(+0(%di))", &r, &mut m)), format!("{c:#x}"));
    assert_eq!(shown(&eval1("+8(+16(+0(%di))):u32", &r, &mut m)), "42");
    assert_eq!(shown(&eval1("-8(+24(+0(%di))):u8", &r, &mut m)), "42");
    let _ = a;
}

#[test]
fn a_fault_at_each_level_is_a_fault() {
    let arg = "+8(+16(+0(%di))):u64";
    for level in 0..3 {
        let (r, mut m, ptrs) = chain();
        m.unmap(ptrs[level] & !0xfff);
        assert_eq!(eval1(arg, &r, &mut m), FetchedValue::Fault, "level {level}");
        assert_eq!(shown(&eval1(arg, &r, &mut m)), "(fault)");
    }
    // A null pointer at the base.
    let (mut r, mut m, _) = chain();
    r.di = 0;
    assert_eq!(eval1(arg, &r, &mut m), FetchedValue::Fault);
    // Faults in one argument leave the others alone.
    let (r, mut m, _) = chain();
    let p = probe("p foo a=+0(%ax) b=%di c=+0(%di):string");
    let v = fetch(&p.args, &ctx(&r), &mut m, &FakeSyms::kernel());
    assert_eq!(v[0], FetchedValue::Fault);
    assert_eq!(
        v[1],
        FetchedValue::Int {
            ty: IntType::X64,
            value: r.di
        }
    );
    assert!(matches!(v[2], FetchedValue::Str(_)));
}

#[test]
fn maximum_nesting_evaluates() {
    // A self-referencing pointer: each level reads the same address.
    let p = KDATA + 0x800;
    let mut m = FakeMem::default();
    m.write_u64(p, p);
    let r = PtRegs { di: p, ..regs() };
    let nest = format!("{}%di{}", "+0(".repeat(14), ")".repeat(14));
    assert_eq!(shown(&eval1(&nest, &r, &mut m)), format!("{p:#x}"));
    assert_eq!(m.reads, 14);
}

#[test]
fn strings_up_to_the_kernel_bound() {
    let r = regs();
    let mut m = FakeMem::default();
    // 5000 bytes without a terminator: cut to 4095, as the kernel does.
    m.write(KDATA, &[b'x'; 5000]);
    let v = eval1("+0(%dx):string", &r, &mut m);
    assert_eq!(v, FetchedValue::Str(vec![b'x'; MAX_STRING_SIZE - 1]));
    // Exactly 4095 bytes and a terminator.
    m.write(KDATA + 4095, &[0]);
    assert_eq!(
        eval1("+0(%dx):string", &r, &mut m),
        FetchedValue::Str(vec![b'x'; 4095])
    );
    // Empty.
    m.write(KDATA, &[0]);
    assert_eq!(shown(&eval1("+0(%dx):string", &r, &mut m)), "\"\"");
}

#[test]
fn a_string_running_into_unmapped_memory_faults() {
    let r = regs();
    let mut m = FakeMem::default();
    let page_end = KDATA + 0x1000;
    m.write(page_end - 5, b"abcde"); // no terminator before the page ends
    let r = PtRegs {
        dx: page_end - 5,
        ..r
    };
    assert_eq!(eval1("+0(%dx):string", &r, &mut m), FetchedValue::Fault);
    // Terminated before the boundary: fine, and the next page is not read.
    m.write(page_end - 2, b"\0");
    assert_eq!(
        eval1("+0(%dx):string", &r, &mut m),
        FetchedValue::Str(b"abc".to_vec())
    );
    // Crossing into a mapped page: fine.
    m.write(page_end - 2, b"z");
    m.write(page_end, b"yz\0");
    assert_eq!(
        eval1("+0(%dx):string", &r, &mut m),
        FetchedValue::Str(b"abczeyz".to_vec())
    );
}

#[test]
fn integers_read_only_their_width() {
    let page_end = KDATA + 0x1000;
    let mut m = FakeMem::default();
    m.write(page_end - 1, &[0xab]);
    let r = PtRegs {
        dx: page_end - 1,
        ..regs()
    };
    assert_eq!(shown(&eval1("+0(%dx):x8", &r, &mut m)), "0xab");
    assert_eq!(eval1("+0(%dx):x16", &r, &mut m), FetchedValue::Fault);
    // A u64 across two mapped pages is read in two pieces.
    m.write(page_end, &[0; 7]);
    assert_eq!(shown(&eval1("+0(%dx)", &r, &mut m)), "0xab");
}

#[test]
fn the_kernels_address_rules() {
    let r = regs();
    let mut m = FakeMem::default();
    m.write(USER, b"user\0");
    m.write(KDATA, b"kern\0");
    // A kernel read of a user address is a user read (x86-64).
    assert_eq!(shown(&eval1("+0(%si):string", &r, &mut m)), "\"user\"");
    assert_eq!(shown(&eval1("+0(%si):ustring", &r, &mut m)), "\"user\"");
    assert_eq!(shown(&eval1("+u0(%si):string", &r, &mut m)), "\"user\"");
    assert_eq!(shown(&eval1("+u0(%si):u8", &r, &mut m)), "117");
    // A user read of a kernel address faults.
    assert_eq!(eval1("+0(%dx):ustring", &r, &mut m), FetchedValue::Fault);
    assert_eq!(eval1("+u0(%dx):u8", &r, &mut m), FetchedValue::Fault);
    assert_eq!(shown(&eval1("+0(%dx):string", &r, &mut m)), "\"kern\"");
    // The guard page above user space, non-canonical addresses and the
    // vsyscall page fault even when something is mapped there.
    for bad in [
        (1u64 << 47) - 4096,
        1u64 << 47,
        0x8000_0000_0000_0000,
        0xffff_ffff_ff60_0000,
    ] {
        m.write(bad, b"x\0");
        let r = PtRegs { dx: bad, ..regs() };
        assert_eq!(
            eval1("+0(%dx):string", &r, &mut m),
            FetchedValue::Fault,
            "{bad:#x}"
        );
        assert_eq!(
            eval1("+0(%dx):u8", &r, &mut m),
            FetchedValue::Fault,
            "{bad:#x}"
        );
    }
    // The first kernel address past the canonical hole is readable.
    let ok = 0xffff_8000_0000_0000;
    m.write(ok, b"k\0");
    let r2 = PtRegs { dx: ok, ..regs() };
    assert_eq!(shown(&eval1("+0(%dx):string", &r2, &mut m)), "\"k\"");
    // With 5-level paging user space reaches 2^56; with 4 levels 2^50 is
    // not canonical.
    let p = probe("p foo +0(%dx):u8");
    let mut m5 = FakeMem::default();
    m5.write(1u64 << 50, &[9]);
    let r5 = PtRegs {
        dx: 1 << 50,
        ..regs()
    };
    let c5 = FetchContext {
        regs: &r5,
        comm: None,
        layout: GuestLayout::X86_64_5LEVEL,
        entry_args: None,
    };
    assert_eq!(
        fetch(&p.args, &c5, &mut m5, &NoSymbols),
        vec![FetchedValue::Int {
            ty: IntType::U8,
            value: 9
        }]
    );
    let c4 = FetchContext {
        layout: GuestLayout::X86_64_4LEVEL,
        entry_args: None,
        ..c5
    };
    assert_eq!(
        fetch(&p.args, &c4, &mut m5, &NoSymbols),
        vec![FetchedValue::Fault]
    );
}

#[test]
fn symbols() {
    let r = regs();
    let mut m = FakeMem::default();
    m.write_u64(0xffff_ffff_8260_5000, 0x1_0000_2710);
    m.write_u64(0xffff_ffff_8261_0010, 0xffff_ffff_8123_4570);
    assert_eq!(shown(&eval1("@jiffies", &r, &mut m)), "0x100002710");
    assert_eq!(shown(&eval1("@jiffies:u32", &r, &mut m)), "10000");
    assert_eq!(
        shown(&eval1("@init_task+0x10:symbol", &r, &mut m)),
        "do_sys_openat2+0x10/0x150"
    );
    assert_eq!(
        shown(&eval1("@init_task+16:symstr", &r, &mut m)),
        "\"do_sys_openat2+0x10/0x150\""
    );
    assert_eq!(
        shown(&eval1("@0xffffffff82605000:x32", &r, &mut m)),
        "0x2710"
    );
    assert_eq!(
        shown(&eval1("%ip:symbol", &r, &mut m)),
        "do_sys_openat2+0x5/0x150"
    );
    assert_eq!(shown(&eval1("%bx:symbol", &r, &mut m)), "0xb");
    assert_eq!(shown(&eval1("\\0:symbol", &r, &mut m)), "0x0");
    // An unknown symbol faults at fetch time and fails resolution up front.
    assert_eq!(eval1("@no_such_symbol", &r, &mut m), FetchedValue::Fault);
    let mut p = probe("p foo a=@jiffies b=@no_such_symbol");
    assert_eq!(
        p.resolve_symbols(&FakeSyms::kernel()),
        Err("no_such_symbol".to_string())
    );
    // Resolved once, fetched without the resolver.
    let mut p = probe("p foo a=@jiffies-8:u8 b=+0(@jiffies):u8");
    p.resolve_symbols(&FakeSyms::kernel()).unwrap();
    m.write(0xffff_ffff_8260_4ff8, &[7]);
    m.write_u64(0xffff_ffff_8260_5000, 0xffff_ffff_8260_4ff8);
    let v = fetch(&p.args, &ctx(&r), &mut m, &NoSymbols);
    assert_eq!(v.iter().map(shown).collect::<Vec<_>>(), ["7", "7"]);
}

#[test]
fn bitfields() {
    let r = PtRegs {
        di: 0b1011_0110,
        ..regs()
    };
    let mut m = FakeMem::default();
    assert_eq!(shown(&eval1("%di:b3@2/8", &r, &mut m)), "5");
    assert_eq!(shown(&eval1("%di:b1@7/8", &r, &mut m)), "1");
    assert_eq!(shown(&eval1("%di:b8@0/8", &r, &mut m)), "182");
    m.write(KDATA + 4, &0xdead_beef_u32.to_le_bytes());
    assert_eq!(shown(&eval1("+4(%dx):b16@16/32", &r, &mut m)), "57005");
    assert_eq!(
        shown(&eval1("%ax:b64@0/64", &r, &mut m)),
        "18446744073709551614"
    );
}

#[test]
fn comm_edge_cases() {
    let r = regs();
    let p = probe("p foo $comm");
    let mut m = FakeMem::default();
    let full = FetchContext {
        comm: Some(b"0123456789abcdefXYZ"),
        ..ctx(&r)
    };
    assert_eq!(
        fetch(&p.args, &full, &mut m, &NoSymbols),
        vec![FetchedValue::Str(b"0123456789abcdef".to_vec())]
    );
    let none = FetchContext {
        comm: None,
        ..ctx(&r)
    };
    assert_eq!(
        fetch(&p.args, &none, &mut m, &NoSymbols),
        vec![FetchedValue::Fault]
    );
}

// ------------------------------------------------------------ rendering --

fn event(probe_id: u32, values: Vec<FetchedValue>) -> RawEvent {
    let mut header = EventHeader {
        probe_id,
        cpu: 0,
        pid: 123,
        timestamp_ns: 12_345_678_000,
        ip: 0xffff_ffff_8123_4560,
        ret_ip: 0,
        comm: [0; 16],
    };
    header.set_comm(b"cat");
    RawEvent { header, values }
}

#[test]
fn function_tracer_lines_in_the_kernels_format() {
    let syms = FakeSyms::kernel();
    let mut ev = event(0, Vec::new());
    ev.header.ip = 0xffff_ffff_8123_4560; // do_sys_openat2
    ev.header.ret_ip = 0xffff_ffff_8123_481d; // in __x64_sys_openat
    let (ev, _) = RawEvent::decode(&ev.encode()).unwrap();
    let mut text = String::new();
    write_function_text(&mut text, &ev, &syms);
    assert_eq!(
        text,
        "             cat-123     [000]     12.345678: do_sys_openat2 <-__x64_sys_openat"
    );
    let mut json = String::new();
    write_function_json(&mut json, &ev, &syms);
    assert_eq!(
        json,
        r#"{"ts":"12.345678","ts_ns":12345678000,"cpu":0,"pid":123,"comm":"cat","kind":"function","func":"do_sys_openat2","parent":"__x64_sys_openat+0x1d/0x30","ip":"0xffffffff81234560","parent_ip":"0xffffffff8123481d"}"#
    );
    // An unknown caller prints as an address.
    ev_with_parent(&syms, 0x1000);
}

fn ev_with_parent(syms: &FakeSyms, parent: u64) {
    let mut ev = event(0, Vec::new());
    ev.header.ip = 0xffff_ffff_8123_4560;
    ev.header.ret_ip = parent;
    let mut text = String::new();
    write_function_text(&mut text, &ev, syms);
    assert!(
        text.ends_with(&format!("do_sys_openat2 <-0x{parent:08x}")),
        "{text}"
    );
}

#[test]
fn the_openat_line_in_the_kernels_format() {
    let r = regs();
    let mut m = FakeMem::default();
    m.write(USER, b"/etc/hostname\0");
    let p = probe("p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string");
    let syms = FakeSyms::kernel();
    let ev = event(1, fetch(&p.args, &ctx(&r), &mut m, &syms));
    // Through the ring format and back, as the host sees it.
    let (ev, _) = RawEvent::decode(&ev.encode()).unwrap();
    assert_eq!(
        text_line(&p, &ev, &syms),
        "             cat-123     [000]     12.345678: myopen: (do_sys_openat2+0x0/0x150) \
         dfd=0xffffff9c filename=\"/etc/hostname\""
    );
    assert_eq!(
        json_line(&p, &ev, &syms),
        r#"{"ts":"12.345678","ts_ns":12345678000,"cpu":0,"pid":123,"comm":"cat","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81234560","probe":"do_sys_openat2+0x0/0x150","args":{"dfd":"0xffffff9c","filename":"/etc/hostname"}}"#
    );
}

#[test]
fn context_columns_pad_as_the_kernel_pads() {
    let p = probe("p:ev do_sys_openat2");
    let syms = FakeSyms::kernel();
    let mut ev = event(1, vec![]);
    ev.header.set_comm(b"systemd-journal");
    ev.header.pid = 1234567;
    ev.header.cpu = 12;
    ev.header.timestamp_ns = 123_456_789_012_345;
    assert_eq!(
        text_line(&p, &ev, &syms),
        " systemd-journal-1234567 [012]  123456.789012: ev: (do_sys_openat2+0x0/0x150)"
    );
    // pid 0 is <idle>; the timestamp rounds to the microsecond.
    ev.header.pid = 0;
    ev.header.set_comm(b"swapper/1");
    ev.header.timestamp_ns = 999_999_500;
    ev.header.cpu = 1;
    assert_eq!(
        text_line(&p, &ev, &syms),
        "          <idle>-0       [001]      1.000000: ev: (do_sys_openat2+0x0/0x150)"
    );
    assert!(json_line(&p, &ev, &syms).contains(r#""comm":"swapper/1""#));
}

#[test]
fn every_value_kind_prints_as_the_kernel_prints_it() {
    let p = probe("p:ev do_sys_openat2 a=%di:u8 b=%di:s16 c=%di:x32 d=%di:char e=%di:symbol f=%di:symstr g=+0(%di):string h=+0(%di)");
    let syms = FakeSyms::kernel();
    let ev = event(
        1,
        vec![
            FetchedValue::Int {
                ty: IntType::U8,
                value: 255,
            },
            FetchedValue::Int {
                ty: IntType::S16,
                value: 0xfffe,
            },
            FetchedValue::Int {
                ty: IntType::X32,
                value: 0,
            },
            FetchedValue::Int {
                ty: IntType::Char,
                value: b'A' as u64,
            },
            FetchedValue::Symbol(0xffff_ffff_8123_46b0),
            FetchedValue::SymStr(0x1234),
            FetchedValue::Fault,
            FetchedValue::Fault,
        ],
    );
    let line = text_line(&p, &ev, &syms);
    assert!(
        line.ends_with(
            "ev: (do_sys_openat2+0x0/0x150) a=255 b=-2 c=0x0 d='A' e=do_sys_open+0x0/0x90 f=\"0x1234\" \
             g=(fault) h=(fault)"
        ),
        "{line}"
    );
    let json = json_line(&p, &ev, &syms);
    assert!(
        json.ends_with(
            r#""args":{"a":255,"b":-2,"c":"0x0","d":"A","e":"do_sys_open+0x0/0x90","f":"0x1234","g":null,"h":null}}"#
        ),
        "{json}"
    );
}

#[test]
fn return_probe_lines() {
    let p = probe("r:myret do_sys_openat2 ret=$retval:s32");
    let syms = FakeSyms::kernel();
    let mut ev = event(
        2,
        vec![FetchedValue::Int {
            ty: IntType::S32,
            value: 3,
        }],
    );
    ev.header.ret_ip = 0xffff_ffff_8123_46cb;
    assert_eq!(
        text_line(&p, &ev, &syms),
        "             cat-123     [000]     12.345678: myret: (do_sys_open+0x1b/0x90 <- do_sys_openat2) ret=3"
    );
    ev.header.ip = 0x1000;
    assert!(text_line(&p, &ev, &syms).contains("(do_sys_open+0x1b/0x90 <- 0x00001000)"));
    let json = json_line(&p, &ev, &syms);
    assert!(
        json.contains(r#""kind":"kretprobe","ip":"0x1000","ret_ip":"0xffffffff812346cb""#),
        "{json}"
    );
}

#[test]
fn unknown_locations_and_odd_bytes() {
    let p = probe("p:ev do_sys_openat2 s=+0(%di):string");
    let mut ev = event(1, vec![FetchedValue::Str(b"a\"b\n\xff".to_vec())]);
    ev.header.ip = 0xffff_ffff_9000_0000;
    assert_eq!(
        text_line(&p, &ev, &NoSymbols),
        "             cat-123     [000]     12.345678: ev: (0xffffffff90000000) s=\"a\"b\n\u{fffd}\""
    );
    assert!(json_line(&p, &ev, &NoSymbols)
        .contains(r#""s":"a\"b\n\ufffd""#.replace("\\ufffd", "\u{fffd}").as_str()));
    ev.header.ip = 0;
    assert!(text_line(&p, &ev, &NoSymbols).contains("ev: (0) s="));
    // More values than the probe has arguments: named by position.
    ev.values.push(FetchedValue::Int {
        ty: IntType::U8,
        value: 1,
    });
    assert!(text_line(&p, &ev, &NoSymbols).ends_with(" arg2=1"));
}

#[test]
fn module_symbols_show_the_module() {
    struct Mod;
    impl SymbolResolver for Mod {
        fn lookup(&self, _: &str) -> Option<Gva> {
            None
        }
        fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
            Some(SymbolAt {
                name: Cow::Owned("ext4_sync_file".to_string()),
                offset: addr.0 & 0xf,
                size: 0x40,
                module: Some(Cow::Borrowed("ext4")),
            })
        }
    }
    let mut s = String::new();
    write_symbol(&mut s, &Mod, 0xffff_ffff_c000_0003);
    assert_eq!(s, "ext4_sync_file+0x3/0x40 [ext4]");
}

/// `MOD:SYM` names the module; the event name Linux makes for it, and the
/// spec as listed, keep the module.
#[test]
fn module_probe_points() {
    let p = probe("p:myopen ext4:ext4_file_open +0(%si):u32");
    assert_eq!(p.module.as_deref(), Some("ext4"));
    assert_eq!(p.symbol, "ext4_file_open");
    assert_eq!(p.event, "myopen");
    assert_eq!(
        p.to_string(),
        "p:kprobes/myopen ext4:ext4_file_open arg1=+0(%si):u32"
    );
    assert_eq!(probe(&p.to_string()), p);
    let r = probe("r hvtarget:hvtarget_sum+0 $retval");
    assert_eq!(r.event, "r_hvtarget_hvtarget_sum_0");
    assert_eq!(r.module.as_deref(), Some("hvtarget"));
    let plain = probe("p vfs_read");
    assert_eq!(plain.module, None);
}

#[test]
fn scheduler_events_in_the_kernels_format() {
    let switch = SwitchValues {
        prev_pid: 52,
        prev_comm: b"sh".to_vec(),
        prev_prio: 120,
        prev_state: report_state(1, 0),
        next_prio: 100,
    };
    // The record's task is the incoming one (`cat`, 123).
    let (ev, _) = RawEvent::decode(&event(0xffff_fd01, switch.values().to_vec()).encode()).unwrap();
    assert_eq!(SwitchValues::of(&ev), Some(switch));
    let mut text = String::new();
    write_switch_text(&mut text, &ev);
    assert_eq!(
        text,
        "              sh-52      [000]     12.345678: sched_switch: prev_comm=sh prev_pid=52 prev_prio=120 prev_state=S ==> next_comm=cat next_pid=123 next_prio=100"
    );
    let mut json = String::new();
    write_switch_json(&mut json, &ev);
    assert_eq!(
        json,
        r#"{"ts":"12.345678","ts_ns":12345678000,"cpu":0,"pid":52,"comm":"sh","kind":"sched_switch","prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"S","next_comm":"cat","next_pid":123,"next_prio":100}"#
    );
    let wakeup = WakeupValues {
        pid: 52,
        comm: b"sh".to_vec(),
        prio: 120,
        target_cpu: 1,
    };
    // The record's task is the waker.
    let (ev, _) = RawEvent::decode(&event(0xffff_fd02, wakeup.values().to_vec()).encode()).unwrap();
    assert_eq!(WakeupValues::of(&ev), Some(wakeup));
    let mut text = String::new();
    write_wakeup_text(&mut text, &ev);
    assert_eq!(
        text,
        "             cat-123     [000]     12.345678: sched_wakeup: comm=sh pid=52 prio=120 target_cpu=001"
    );
    let mut json = String::new();
    write_wakeup_json(&mut json, &ev);
    assert_eq!(
        json,
        r#"{"ts":"12.345678","ts_ns":12345678000,"cpu":0,"pid":123,"comm":"cat","kind":"sched_wakeup","target_comm":"sh","target_pid":52,"target_prio":120,"target_cpu":1}"#
    );
    // Records of another shape render nothing.
    let odd = event(0xffff_fd01, vec![FetchedValue::Fault]);
    let mut text = String::new();
    write_switch_text(&mut text, &odd);
    write_wakeup_json(&mut text, &odd);
    assert!(text.is_empty());
}

#[test]
fn states_are_reported_as_the_kernel_reports_them() {
    // Running, interruptible, uninterruptible.
    assert_eq!(report_state(0, 0), 0);
    assert_eq!(report_state(0x1, 0), 0x1);
    assert_eq!(report_state(0x2, 0), 0x2);
    // TASK_IDLE (uninterruptible and no load) is its own letter.
    assert_eq!(report_state(0x402, 0), 0x80);
    assert_eq!(state_letter(report_state(0x402, 0)), "I");
    // A dead task: its exit state (zombie) counts, TASK_DEAD does not.
    assert_eq!(report_state(0x80, 0x20), 0x20);
    assert_eq!(state_letter(0x20), "Z");
    // Several bits: the highest reportable.
    assert_eq!(report_state(0x1 | 0x4, 0), 0x4);
    // An rtlock wait is uninterruptible.
    assert_eq!(report_state(0x1000, 0), 0x2);
    for s in [0u64, 1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80] {
        assert_eq!(state_of_letter(state_letter(s)), Some(s));
    }
    assert_eq!(state_of_letter("W"), None);
}
