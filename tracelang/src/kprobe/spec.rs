//! The parsed form of a kprobe_events line.
//!
//! A fetch argument is kept the way the kernel compiles it in
//! `kernel/trace/trace_probe.c` (`parse_probe_arg`): one *base* fetch (a
//! register, a stack slot, an immediate, ...) followed by a chain of memory
//! dereferences applied innermost first. `+8(+0(%di))` is the base `%di` with
//! the chain `[+0, +8]`; `@jiffies` is the base "address of `jiffies`" with
//! the chain `[+0]`. The last link of the chain is the read that produces the
//! value (its width is the argument's type), every earlier link reads a
//! pointer.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use guest_introspect::addr::Gva;
use trampolines::PtRegs;

/// The group a probe lands in when the spec names none (`KPROBE_EVENT_SYSTEM`).
pub const DEFAULT_GROUP: &str = "kprobes";
/// Most fetch arguments one probe may have (`MAX_TRACE_ARGS`).
pub const MAX_TRACE_ARGS: usize = 128;
/// Longest fetch-argument body, `NAME=` excluded (`MAX_ARGSTR_LEN`).
pub const MAX_ARGSTR_LEN: usize = 63;
/// Longest argument name (`MAX_ARG_NAME_LEN`).
pub const MAX_ARG_NAME_LEN: usize = 32;
/// Group and event names are shorter than this (`MAX_EVENT_NAME_LEN`).
pub const MAX_EVENT_NAME_LEN: usize = 64;
/// Largest `r<MAXACTIVE>` (`KRETPROBE_MAXACTIVE_MAX`).
pub const MAX_MAXACTIVE: u32 = 4096;
/// Largest `$stackN` / `$argN` index: `THREAD_SIZE / sizeof(long)` for a
/// 16 KiB x86-64 kernel stack (`PARAM_MAX_STACK`).
pub const MAX_STACK_INDEX: u32 = 2048;
/// The kernel compiles each argument into at most this many fetch
/// instructions, the final `END` included (`FETCH_INSN_MAX`); that is what
/// bounds the nesting of dereferences (14 levels below a register).
pub const FETCH_INSN_MAX: usize = 16;

/// Field names a fetch argument may not take: the common event fields and
/// the kprobe's own (`reserved_field_names` in trace_probe.c).
pub const RESERVED_ARG_NAMES: [&str; 8] = [
    "common_type",
    "common_flags",
    "common_preempt_count",
    "common_pid",
    "common_tgid",
    "__probe_ip",
    "__probe_ret_ip",
    "__probe_func",
];

/// One kprobe_events command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `p...` / `r...`: define a probe.
    Add(ProbeSpec),
    /// `-:[GRP/]EVENT`: remove probes.
    Delete(DeleteSpec),
}

/// `-:[GRP/][EVENT]`. A missing group matches every group; a missing event
/// (`-:GRP/`) matches every event of the group, as the kernel's
/// `dyn_event_release` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteSpec {
    /// The group, when given.
    pub group: Option<String>,
    /// The event, when given. At least one of the two is present.
    pub event: Option<String>,
}

impl DeleteSpec {
    /// Whether this deletion covers the probe `group/event`.
    pub fn matches(&self, group: &str, event: &str) -> bool {
        self.group.as_deref().is_none_or(|g| g == group)
            && self.event.as_deref().is_none_or(|e| e == event)
    }
}

/// Where the probe fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    /// At function entry (`p`).
    Entry,
    /// At function return (`r[MAXACTIVE]`, or `p ... SYM%return`).
    /// `maxactive` is 0 when not given.
    Return {
        /// Concurrent instances the kernel would reserve; kept for listing.
        maxactive: u32,
    },
}

impl ProbeKind {
    /// Whether this is a return probe.
    pub fn is_return(self) -> bool {
        matches!(self, ProbeKind::Return { .. })
    }
}

/// A probe definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Entry or return.
    pub kind: ProbeKind,
    /// The event group (`kprobes` unless given).
    pub group: String,
    /// The event name (`p_SYM_0` / `r_SYM_0` unless given).
    pub event: String,
    /// The module named in `MOD:SYM`, if any: the function is looked up
    /// there only.
    pub module: Option<String>,
    /// The probed function.
    pub symbol: String,
    /// The fetch arguments, in order.
    pub args: Vec<FetchArg>,
}

impl ProbeSpec {
    /// Resolves every `@SYM` base through `syms`, so that fetching does not
    /// look names up on each hit. Fails with the first unknown symbol, as
    /// the kernel refuses to register such a probe.
    pub fn resolve_symbols(
        &mut self,
        syms: &dyn crate::kprobe::SymbolResolver,
    ) -> Result<(), String> {
        for arg in &mut self.args {
            if let FetchBase::Symbol { name, resolved, .. } = &mut arg.expr.base {
                match syms.lookup(name) {
                    Some(a) => *resolved = Some(a),
                    None => return Err(name.clone()),
                }
            }
        }
        Ok(())
    }
}

impl ProbeSpec {
    /// The spec with each argument written as the plain fetch it was
    /// resolved to (`name=+0(+40(+24(%si))):string` for a BTF chain), so
    /// that parsing it gives the same names and types without BTF: what
    /// the host renders records with. An argument whose plain form is
    /// longer than the kernel allows is written as a short fetch of the
    /// same type (only its name and type matter to rendering).
    pub fn render_form(&self) -> String {
        use core::fmt::Write;
        let mut out = String::new();
        let _ = match self.kind {
            ProbeKind::Entry => write!(out, "p"),
            ProbeKind::Return { maxactive: 0 } => write!(out, "r"),
            ProbeKind::Return { maxactive } => write!(out, "r{maxactive}"),
        };
        let _ = write!(out, ":{}/{} ", self.group, self.event);
        if let Some(m) = &self.module {
            let _ = write!(out, "{m}:");
        }
        out.push_str(&self.symbol);
        for a in &self.args {
            let body = lowered(&a.expr, a.ty)
                .filter(|b| b.len() <= MAX_ARGSTR_LEN && a.btf.is_none())
                .unwrap_or_else(|| short_of(a.ty));
            let _ = write!(out, " {}={}", a.name, body);
        }
        out
    }
}

/// `expr:ty` in the probe language, when it has a written form.
fn lowered(expr: &FetchExpr, ty: ArgType) -> Option<String> {
    use core::fmt::Write;
    let mut inner = String::new();
    let mut derefs = expr.derefs.as_slice();
    match &expr.base {
        FetchBase::Reg(r) => write!(inner, "%{}", r.name()).ok()?,
        FetchBase::StackEntry(n) => write!(inner, "$stack{n}").ok()?,
        FetchBase::StackPointer => inner.push_str("$stack"),
        FetchBase::Arg(n) | FetchBase::EntryArg(n) => write!(inner, "$arg{n}").ok()?,
        FetchBase::RetVal => inner.push_str("$retval"),
        FetchBase::Comm => inner.push_str("$comm"),
        FetchBase::Imm(v) => write!(inner, "\\{v}").ok()?,
        FetchBase::ImmString(t) => write!(inner, "\\\"{t}\"").ok()?,
        FetchBase::Symbol { name, offset, .. } => {
            // `@SYM` carries its own first read.
            let (first, rest) = derefs.split_first()?;
            if first.offset != 0 || first.user {
                return None;
            }
            derefs = rest;
            match *offset {
                0 => write!(inner, "@{name}").ok()?,
                o if o > 0 => write!(inner, "@{name}+{o}").ok()?,
                o => write!(inner, "@{name}{o}").ok()?,
            }
        }
    }
    for d in derefs {
        let u = if d.user { "u" } else { "" };
        inner = if d.offset < 0 {
            format!("-{u}{}({inner})", d.offset.unsigned_abs())
        } else {
            format!("+{u}{}({inner})", d.offset)
        };
    }
    Some(format!("{inner}:{ty}"))
}

/// A short fetch of type `ty`.
fn short_of(ty: ArgType) -> String {
    match ty {
        ArgType::String | ArgType::UString => format!("+0(%di):{ty}"),
        _ => format!("%di:{ty}"),
    }
}

/// The kprobe_events listing form: `p:GRP/EVENT SYM NAME=BODY ...`, which
/// is what the kernel prints when `kprobe_events` is read (every argument
/// shown with its name, the default ones included). Parsing it gives the
/// same spec back.
impl fmt::Display for ProbeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ProbeKind::Entry => f.write_str("p")?,
            ProbeKind::Return { maxactive: 0 } => f.write_str("r")?,
            ProbeKind::Return { maxactive } => write!(f, "r{maxactive}")?,
        }
        write!(f, ":{}/{} ", self.group, self.event)?;
        if let Some(m) = &self.module {
            write!(f, "{m}:")?;
        }
        f.write_str(&self.symbol)?;
        for a in &self.args {
            if a.btf.as_ref().is_some_and(|b| b.var == Some(BtfVar::All)) {
                // Not expanded yet: it takes no name.
                write!(f, " {}", a.body)?;
            } else {
                write!(f, " {}={}", a.name, a.body)?;
            }
        }
        Ok(())
    }
}

/// One fetch argument: `[NAME=]FETCHARG[:TYPE]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchArg {
    /// The argument name (`argN`, 1-based by position, unless given; a
    /// bare BTF name names itself, as the kernel's BTF arguments do).
    pub name: String,
    /// The source text after `NAME=`, type included (for listing).
    pub body: String,
    /// What to fetch. With [`Self::btf`] set, the part written around
    /// the BTF variable only: `derefs` are the dereferences outside it
    /// (`+8(file)`), until [`super::resolve_btf`] puts the variable's
    /// own in front of them.
    pub expr: FetchExpr,
    /// How to store and print it (the default until BTF says, when
    /// [`Self::btf`] is set and no type was written).
    pub ty: ArgType,
    /// What of the argument needs the guest's BTF, until it is resolved
    /// at probe add ([`super::resolve_btf`]).
    pub btf: Option<BtfArg>,
}

/// The BTF part of a fetch argument, as written. Two are equal when they
/// say the same, wherever in a spec they were written.
#[derive(Debug, Clone, Eq)]
pub struct BtfArg {
    /// The variable, when the fetch names one (`None`: only the type
    /// needs BTF, `%pd` or `%pD` over a plain fetch).
    pub var: Option<BtfVar>,
    /// Byte offset of the variable in the spec (of the type for `%pd`
    /// and `%pD` over a plain fetch).
    pub pos: usize,
    /// Its length in the spec.
    pub len: usize,
    /// The member accesses after the variable, in order.
    pub fields: Vec<BtfField>,
    /// Whether a type was written (`:TYPE`): BTF then only checks that a
    /// string type fits.
    pub typed: bool,
    /// Byte offset of the written type in the spec.
    pub type_pos: usize,
    /// `%pd` or `%pD`: the name of the dentry or file the value points to.
    pub name_of: Option<NameOf>,
    /// BTF only refines the argument (a bare `$retval`): without BTF for
    /// the function it stays the plain fetch, as in the kernel.
    pub optional: bool,
}

/// What a BTF argument starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BtfVar {
    /// A parameter of the probed function, by name.
    Param(String),
    /// `$argN` with a member access after it: parameter N (1-based).
    Arg(u32),
    /// `$retval` (return probes), typed from the return type.
    RetVal,
    /// `$arg*`: every parameter, each an argument named after it.
    All,
}

impl PartialEq for BtfArg {
    fn eq(&self, o: &Self) -> bool {
        self.var == o.var
            && self.fields == o.fields
            && self.typed == o.typed
            && self.name_of == o.name_of
            && self.optional == o.optional
    }
}

/// `->NAME` or `.NAME` (equal by what they say, not where).
#[derive(Debug, Clone, Eq)]
pub struct BtfField {
    /// The member's name.
    pub name: String,
    /// `->` (through a pointer) rather than `.` (into an embedded struct
    /// or union).
    pub arrow: bool,
    /// Byte offset of the name in the spec.
    pub pos: usize,
}

impl PartialEq for BtfField {
    fn eq(&self, o: &Self) -> bool {
        self.name == o.name && self.arrow == o.arrow
    }
}

/// `%pd` and `%pD`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameOf {
    /// `%pd`: a `struct dentry *`, printed as its name.
    Dentry,
    /// `%pD`: a `struct file *`, printed as its dentry's name.
    File,
}

/// A base fetch and its dereference chain (innermost first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchExpr {
    /// The first-stage fetch.
    pub base: FetchBase,
    /// Memory reads applied to the base value, innermost first.
    pub derefs: Vec<Deref>,
}

/// `+OFFS(...)`, `-OFFS(...)`, `+uOFFS(...)`: read at `value + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deref {
    /// Signed byte offset added to the inner value.
    pub offset: i64,
    /// `u`: the address must be a user-space address.
    pub user: bool,
}

/// The first stage of a fetch (the kernel's `FETCH_OP_*` load ops).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchBase {
    /// `%REG`.
    Reg(Reg),
    /// `$stackN`: the N-th long on the stack (`$stack0` is the return
    /// address at function entry).
    StackEntry(u32),
    /// `$stack`: the stack pointer.
    StackPointer,
    /// `$argN`, 1-based, by the x86-64 calling convention.
    Arg(u32),
    /// `$retval` (return probes): `ax`.
    RetVal,
    /// `$argN` at a return probe: argument N (1-based) as it was at the
    /// function's entry, saved then (Linux 6.9+ does the same).
    EntryArg(u32),
    /// `$comm`: the current task's name (a string).
    Comm,
    /// `\IMM`, and the address of `@ADDR`.
    Imm(u64),
    /// `\"TEXT"`: an immediate string.
    ImmString(String),
    /// The address of `@SYM[+|-off]` (a dereference follows).
    Symbol {
        /// Symbol name.
        name: String,
        /// Offset added to the symbol's address.
        offset: i64,
        /// Filled by [`ProbeSpec::resolve_symbols`].
        resolved: Option<Gva>,
    },
}

/// The type of a fetch argument (`:TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgType {
    /// A fixed-width integer, printed as the [`IntType`] says.
    Int(IntType),
    /// `string`: NUL-terminated, read from kernel memory (user addresses
    /// are read as user memory, as x86 kernels do).
    String,
    /// `ustring`: NUL-terminated, read from user memory.
    UString,
    /// `symbol`: a long printed as `sym+0xoff/0xsize`.
    Symbol,
    /// `symstr`: like `symbol`, but stored and printed as a string.
    SymStr,
    /// `b<width>@<shift>/<container bits>`: a bitfield, printed unsigned.
    Bitfield {
        /// Width in bits, 1..=container.
        width: u8,
        /// Offset of the field's lowest bit in the container.
        shift: u8,
        /// Container width in bytes: 1, 2, 4 or 8.
        container: u8,
    },
}

impl ArgType {
    /// The type a fetch argument gets when none is written: `x64`, the
    /// native long in hex (`DEFAULT_FETCH_TYPE`, x86-64).
    pub const DEFAULT: ArgType = ArgType::Int(IntType::X64);

    /// Whether the value is a string in the trace.
    pub fn is_string(self) -> bool {
        matches!(self, ArgType::String | ArgType::UString | ArgType::SymStr)
    }

    /// Bytes the value occupies when read from memory (strings: the pointer).
    pub fn size(self) -> usize {
        match self {
            ArgType::Int(t) => t.size(),
            ArgType::Bitfield { container, .. } => container as usize,
            ArgType::String | ArgType::UString | ArgType::Symbol | ArgType::SymStr => 8,
        }
    }
}

impl fmt::Display for ArgType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgType::Int(t) => f.write_str(t.name()),
            ArgType::String => f.write_str("string"),
            ArgType::UString => f.write_str("ustring"),
            ArgType::Symbol => f.write_str("symbol"),
            ArgType::SymStr => f.write_str("symstr"),
            ArgType::Bitfield {
                width,
                shift,
                container,
            } => {
                write!(f, "b{width}@{shift}/{}", u32::from(*container) * 8)
            }
        }
    }
}

/// Integer types and how the kernel prints them (`probe_fetch_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum IntType {
    /// `%u`.
    U8 = 1,
    /// `%u`.
    U16 = 2,
    /// `%u`.
    U32 = 3,
    /// `%Lu`.
    U64 = 4,
    /// `%d`.
    S8 = 5,
    /// `%d`.
    S16 = 6,
    /// `%d`.
    S32 = 7,
    /// `%Ld`.
    S64 = 8,
    /// `0x%x`.
    X8 = 9,
    /// `0x%x`.
    X16 = 10,
    /// `0x%x`.
    X32 = 11,
    /// `0x%Lx`.
    X64 = 12,
    /// `'%c'`.
    Char = 13,
}

impl IntType {
    /// Every integer type, in tag order.
    pub const ALL: [IntType; 13] = [
        IntType::U8,
        IntType::U16,
        IntType::U32,
        IntType::U64,
        IntType::S8,
        IntType::S16,
        IntType::S32,
        IntType::S64,
        IntType::X8,
        IntType::X16,
        IntType::X32,
        IntType::X64,
        IntType::Char,
    ];

    /// Width in bytes.
    pub fn size(self) -> usize {
        match self {
            IntType::U8 | IntType::S8 | IntType::X8 | IntType::Char => 1,
            IntType::U16 | IntType::S16 | IntType::X16 => 2,
            IntType::U32 | IntType::S32 | IntType::X32 => 4,
            IntType::U64 | IntType::S64 | IntType::X64 => 8,
        }
    }

    /// The spelling in a spec.
    pub fn name(self) -> &'static str {
        match self {
            IntType::U8 => "u8",
            IntType::U16 => "u16",
            IntType::U32 => "u32",
            IntType::U64 => "u64",
            IntType::S8 => "s8",
            IntType::S16 => "s16",
            IntType::S32 => "s32",
            IntType::S64 => "s64",
            IntType::X8 => "x8",
            IntType::X16 => "x16",
            IntType::X32 => "x32",
            IntType::X64 => "x64",
            IntType::Char => "char",
        }
    }

    /// By spelling.
    pub fn from_name(name: &str) -> Option<IntType> {
        IntType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The unsigned type of `bytes` width (a bitfield's container).
    pub fn unsigned_of(bytes: u8) -> IntType {
        match bytes {
            1 => IntType::U8,
            2 => IntType::U16,
            4 => IntType::U32,
            _ => IntType::U64,
        }
    }

    /// `value` cut to this width.
    pub fn truncate(self, value: u64) -> u64 {
        match self.size() {
            1 => value & 0xff,
            2 => value & 0xffff,
            4 => value & 0xffff_ffff,
            _ => value,
        }
    }

    /// The wire tag.
    pub fn tag(self) -> u8 {
        self as u8
    }

    /// By wire tag.
    pub fn from_tag(tag: u8) -> Option<IntType> {
        IntType::ALL.into_iter().find(|t| t.tag() == tag)
    }
}

/// The x86-64 `struct pt_regs` registers, by the names `%REG` takes
/// (`regoffset_table` in arch/x86/kernel/ptrace.c). Linux takes no `r`- or
/// `e`-prefixed names: `%ax`, never `%rax`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reg {
    /// `%r15`.
    R15,
    /// `%r14`.
    R14,
    /// `%r13`.
    R13,
    /// `%r12`.
    R12,
    /// `%r11`.
    R11,
    /// `%r10`.
    R10,
    /// `%r9`.
    R9,
    /// `%r8`.
    R8,
    /// `%bx`.
    Bx,
    /// `%cx`.
    Cx,
    /// `%dx`.
    Dx,
    /// `%si`.
    Si,
    /// `%di`.
    Di,
    /// `%bp`.
    Bp,
    /// `%ax`.
    Ax,
    /// `%orig_ax`.
    OrigAx,
    /// `%ip`.
    Ip,
    /// `%cs`.
    Cs,
    /// `%flags`.
    Flags,
    /// `%sp`.
    Sp,
    /// `%ss`.
    Ss,
}

impl Reg {
    /// Every register, in the kernel's table order.
    pub const ALL: [Reg; 21] = [
        Reg::R15,
        Reg::R14,
        Reg::R13,
        Reg::R12,
        Reg::R11,
        Reg::R10,
        Reg::R9,
        Reg::R8,
        Reg::Bx,
        Reg::Cx,
        Reg::Dx,
        Reg::Si,
        Reg::Di,
        Reg::Bp,
        Reg::Ax,
        Reg::OrigAx,
        Reg::Ip,
        Reg::Cs,
        Reg::Flags,
        Reg::Sp,
        Reg::Ss,
    ];

    /// The name after `%`.
    pub fn name(self) -> &'static str {
        match self {
            Reg::R15 => "r15",
            Reg::R14 => "r14",
            Reg::R13 => "r13",
            Reg::R12 => "r12",
            Reg::R11 => "r11",
            Reg::R10 => "r10",
            Reg::R9 => "r9",
            Reg::R8 => "r8",
            Reg::Bx => "bx",
            Reg::Cx => "cx",
            Reg::Dx => "dx",
            Reg::Si => "si",
            Reg::Di => "di",
            Reg::Bp => "bp",
            Reg::Ax => "ax",
            Reg::OrigAx => "orig_ax",
            Reg::Ip => "ip",
            Reg::Cs => "cs",
            Reg::Flags => "flags",
            Reg::Sp => "sp",
            Reg::Ss => "ss",
        }
    }

    /// By the name after `%` (exact, case-sensitive, as the kernel's strcmp).
    pub fn from_name(name: &str) -> Option<Reg> {
        Reg::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The kernel's name for a register written the assembler's way
    /// (`rax`, `eax`, `rip`, `rflags`, `r8d`), for error hints.
    pub fn suggest(name: &str) -> Option<Reg> {
        let lower = name.as_bytes();
        let strip = |p: u8| lower.first() == Some(&p) && lower.len() == 3;
        let core = if strip(b'r') || strip(b'e') {
            name.get(1..)?
        } else {
            name
        };
        if let Some(r) = Reg::from_name(core) {
            return Some(r);
        }
        match name {
            "rflags" | "eflags" => Some(Reg::Flags),
            _ => {
                // r8d / r8w / r8b style sub-registers.
                let trimmed = name.trim_end_matches(['d', 'w', 'b']);
                if trimmed.len() != name.len() && trimmed.starts_with('r') {
                    Reg::from_name(trimmed)
                } else {
                    None
                }
            }
        }
    }

    /// The register's value in `regs`.
    pub fn get(self, regs: &PtRegs) -> u64 {
        match self {
            Reg::R15 => regs.r15,
            Reg::R14 => regs.r14,
            Reg::R13 => regs.r13,
            Reg::R12 => regs.r12,
            Reg::R11 => regs.r11,
            Reg::R10 => regs.r10,
            Reg::R9 => regs.r9,
            Reg::R8 => regs.r8,
            Reg::Bx => regs.bx,
            Reg::Cx => regs.cx,
            Reg::Dx => regs.dx,
            Reg::Si => regs.si,
            Reg::Di => regs.di,
            Reg::Bp => regs.bp,
            Reg::Ax => regs.ax,
            Reg::OrigAx => regs.orig_ax,
            Reg::Ip => regs.ip,
            Reg::Cs => regs.cs,
            Reg::Flags => regs.flags,
            Reg::Sp => regs.sp,
            Reg::Ss => regs.ss,
        }
    }
}

/// A kernel "good name" for events and fields: a C identifier
/// (`is_good_name` in kernel/trace/trace.h).
pub fn is_good_name(name: &str) -> bool {
    let b = name.as_bytes();
    match b.first() {
        Some(c) if c.is_ascii_alphabetic() || *c == b'_' => {}
        _ => return false,
    }
    b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// A good group name: a C identifier that may also contain `-`
/// (`is_good_system_name`).
pub fn is_good_group_name(name: &str) -> bool {
    let b = name.as_bytes();
    match b.first() {
        Some(c) if c.is_ascii_alphabetic() || *c == b'_' || *c == b'-' => {}
        _ => return false,
    }
    b.iter()
        .all(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_register_name_agrees_with_pt_regs() {
        let mut regs = PtRegs::default();
        // Distinct values per field, so a mix-up shows.
        let fields: [&mut u64; 21] = [
            &mut regs.r15,
            &mut regs.r14,
            &mut regs.r13,
            &mut regs.r12,
            &mut regs.bp,
            &mut regs.bx,
            &mut regs.r11,
            &mut regs.r10,
            &mut regs.r9,
            &mut regs.r8,
            &mut regs.ax,
            &mut regs.cx,
            &mut regs.dx,
            &mut regs.si,
            &mut regs.di,
            &mut regs.orig_ax,
            &mut regs.ip,
            &mut regs.cs,
            &mut regs.flags,
            &mut regs.sp,
            &mut regs.ss,
        ];
        for (i, f) in fields.into_iter().enumerate() {
            *f = 0x1000 + i as u64;
        }
        for r in Reg::ALL {
            assert_eq!(regs.by_name(r.name()), Some(r.get(&regs)), "{}", r.name());
        }
        let mut seen: Vec<u64> = Reg::ALL.iter().map(|r| r.get(&regs)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 21);
    }

    #[test]
    fn suggestions_for_assembler_names() {
        assert_eq!(Reg::suggest("rax"), Some(Reg::Ax));
        assert_eq!(Reg::suggest("eax"), Some(Reg::Ax));
        assert_eq!(Reg::suggest("rip"), Some(Reg::Ip));
        assert_eq!(Reg::suggest("rsp"), Some(Reg::Sp));
        assert_eq!(Reg::suggest("rflags"), Some(Reg::Flags));
        assert_eq!(Reg::suggest("r8d"), Some(Reg::R8));
        assert_eq!(Reg::suggest("dj"), None);
        assert_eq!(Reg::suggest("é"), None);
    }

    #[test]
    fn int_tags_round_trip() {
        for t in IntType::ALL {
            assert_eq!(IntType::from_tag(t.tag()), Some(t));
            assert_eq!(IntType::from_name(t.name()), Some(t));
        }
        assert_eq!(IntType::from_tag(0), None);
        assert_eq!(IntType::from_tag(14), None);
    }

    #[test]
    fn names() {
        assert!(is_good_name("myopen"));
        assert!(is_good_name("_x1"));
        assert!(!is_good_name("1x"));
        assert!(!is_good_name(""));
        assert!(!is_good_name("a-b"));
        assert!(is_good_group_name("my-grp"));
        assert!(!is_good_group_name("my grp"));
    }

    #[test]
    fn delete_matching() {
        let d = DeleteSpec {
            group: None,
            event: Some("ev".into()),
        };
        assert!(d.matches("kprobes", "ev"));
        assert!(d.matches("other", "ev"));
        assert!(!d.matches("kprobes", "ev2"));
        let d = DeleteSpec {
            group: Some("g".into()),
            event: None,
        };
        assert!(d.matches("g", "anything"));
        assert!(!d.matches("h", "anything"));
    }
}
