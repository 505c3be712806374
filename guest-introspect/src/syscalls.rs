//! The guest's system calls: numbers and names from its own
//! `sys_call_table` (each entry is the `__x64_sys_NAME` wrapper of call
//! `NAME`, whose one argument is the caller's `struct pt_regs *`), and
//! argument names and C types from the best source the guest has:
//!
//! 1. its ftrace syscall metadata (`CONFIG_FTRACE_SYSCALLS`): the
//!    `struct syscall_metadata *` of each call, in the array the kernel
//!    keeps at `syscalls_metadata` once booted (the linker's array between
//!    `__start_syscalls_metadata` and `__stop_syscalls_metadata` is init
//!    data, read only from an image), whose layout (`name`, `nb_args`,
//!    `types`, `args`) comes from BTF;
//! 2. else the prototype of `__do_sys_NAME` in BTF, when the compiler kept
//!    it out of line;
//! 3. else the prototype in syscalls.h of the call the guest's table points
//!    at, from the x86-64 table generated from the kernel source
//!    ([`crate::syscall_abi::x86_64`]);
//! 4. else nothing: the call is traced with its six raw registers.
//!
//! The number is always the table's index (the guest wins over any table
//! of ours, which [`crate::syscall_abi::crosscheck`] compares it with);
//! metadata is matched to it by name, the generated table by wrapper
//! symbol. Every read goes through the view and is bounded; a table or
//! metadata array the guest forged costs at most [`MAX_SYSCALLS`] entries.
//! Without `sys_call_table` in kallsyms there are no calls: the generated
//! table never stands in for the guest's.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::addr::Gva;
use crate::btf::typed::Shape;
use crate::btf::{Btf, Kind, TypeInfo};
use crate::kallsyms::SymbolIndex;
use crate::view::{read_u32, read_u64, VirtMemory};

/// Most table entries or metadata pointers read.
pub const MAX_SYSCALLS: usize = 1024;
/// Most arguments a system call has.
pub const MAX_ARGS: usize = 6;
/// Longest name or type string read from metadata.
const MAX_TEXT: usize = 64;

/// Where a call's argument names and types came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgSource {
    /// The guest's ftrace syscall metadata.
    Metadata,
    /// The prototype of `__do_sys_NAME` in BTF.
    Btf,
    /// The `sys_NAME` prototype of the kernel source's syscalls.h, from
    /// the generated x86-64 table ([`crate::syscall_abi::x86_64::CALLS`]).
    Table,
    /// Neither: six raw registers.
    None,
}

/// The system-call ABIs of an x86-64 kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abi {
    /// 64-bit calls (`syscall`): `sys_call_table`, `__x64_sys_*`,
    /// arguments in di, si, dx, r10, r8, r9.
    X64,
    /// 32-bit calls of IA32 emulation (`int $0x80`, `sysenter`, 32-bit
    /// `syscall`): `ia32_sys_call_table`, `__ia32_sys_*` and
    /// `__ia32_compat_sys_*`, arguments in bx, cx, dx, si, di, bp.
    Ia32,
}

impl Abi {
    /// The kernel's table of the ABI's entries.
    pub fn table_symbol(self) -> &'static str {
        match self {
            Abi::X64 => "sys_call_table",
            Abi::Ia32 => "ia32_sys_call_table",
        }
    }

    /// The prefixes of its wrappers' names.
    pub fn prefixes(self) -> &'static [&'static str] {
        match self {
            Abi::X64 => &["__x64_sys_"],
            Abi::Ia32 => &["__ia32_compat_sys_", "__ia32_sys_"],
        }
    }

    /// The generated ABI table ([`crate::syscall_abi`]).
    fn abi_table(self) -> &'static [crate::syscall_abi::AbiCall] {
        match self {
            Abi::X64 => crate::syscall_abi::x86_64::CALLS,
            Abi::Ia32 => crate::syscall_abi::i386::CALLS,
        }
    }
}

/// One system call of the guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Syscall {
    /// Its ABI.
    pub abi: Abi,
    /// Its number (the index in its ABI's table).
    pub nr: u32,
    /// Its name (`openat`).
    pub name: String,
    /// The function the table points at (`__x64_sys_openat`).
    pub entry: String,
    /// (C type, name) of each argument, in order.
    pub args: Vec<(String, String)>,
    /// Where the arguments came from.
    pub source: ArgSource,
}

/// Why the table could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyscallError {
    /// kallsyms has no `sys_call_table`.
    NoTable,
    /// The table could not be read.
    Unreadable(Gva),
}

impl core::fmt::Display for SyscallError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoTable => f.write_str("kallsyms has no sys_call_table"),
            Self::Unreadable(at) => write!(f, "sys_call_table unreadable at {:#x}", at.0),
        }
    }
}

/// The guest's 64-bit system calls, in number order (unimplemented
/// numbers, `sys_ni_syscall`, left out).
pub fn table<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
) -> Result<Vec<Syscall>, SyscallError> {
    let src = Sources::read(view, index, btf);
    table_of(view, index, btf, &src, Abi::X64, &[])
}

/// [`table`], then the guest's 32-bit (IA32 emulation) system calls in
/// number order (none when the kernel has no IA32 emulation), the
/// argument sources read once for both. A 32-bit call whose wrapper is
/// also a 64-bit call's (the argument-less calls share one body under
/// both names, so that a hook there cannot tell the ABIs apart) is left
/// out: it is traced as the 64-bit call. A 32-bit table that cannot be
/// read leaves the 64-bit calls, and says why beside them.
pub fn tables<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
) -> Result<(Vec<Syscall>, Option<SyscallError>), SyscallError> {
    let src = Sources::read(view, index, btf);
    let mut calls = table_of(view, index, btf, &src, Abi::X64, &[])?;
    match compat_of(view, index, btf, &src, &calls) {
        Ok(compat) => {
            if calls.try_reserve(compat.len()).is_ok() {
                calls.extend(compat);
            }
            Ok((calls, None))
        }
        Err(e) => Ok((calls, Some(e))),
    }
}

/// The argument sources shared by every call: the metadata and the
/// `__do_sys_` prototypes BTF describes.
struct Sources {
    meta: Vec<(String, Vec<(String, String)>)>,
    funcs: Vec<(String, TypeInfo)>,
}

impl Sources {
    fn read<V: VirtMemory + ?Sized>(
        view: &V,
        index: &SymbolIndex,
        btf: Option<&Btf<'_, V>>,
    ) -> Sources {
        // The metadata array has a slot per 64-bit number, whichever the ABI.
        let native_n = index
            .lookup(Abi::X64.table_symbol())
            .and_then(|i| index.size(i))
            .map_or(MAX_SYSCALLS as u64, |b| (b / 8).min(MAX_SYSCALLS as u64));
        Sources {
            meta: metadata(view, index, btf, native_n),
            // Found in one pass over the types.
            funcs: btf
                .and_then(|b| b.funcs_with_prefix("__do_sys_").ok())
                .unwrap_or_default(),
        }
    }
}

/// The 32-bit calls; `native` are the 64-bit ones.
fn compat_of<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    src: &Sources,
    native: &[Syscall],
) -> Result<Vec<Syscall>, SyscallError> {
    match table_of(view, index, btf, src, Abi::Ia32, native) {
        // Since the indirect-call hardening (6.9, and its stable
        // backports: Debian's 6.1 has it) a kernel dispatches ia32 calls
        // through a switch,
        // `ia32_sys_call`, and keeps no table: the numbers come from the
        // generated i386 table, each call kept when the guest has its
        // wrapper.
        Err(SyscallError::NoTable) if index.lookup("ia32_sys_call").is_some() => {
            let abi = crate::syscall_abi::i386::CALLS;
            let slots = abi.iter().filter_map(|c| {
                let id = index.lookup(c.entry)?;
                Some((c.nr, index.symbol(id).addr))
            });
            describe(index, btf, src, Abi::Ia32, native, slots)
        }
        Err(SyscallError::NoTable) => Ok(Vec::new()),
        other => other,
    }
}

/// The calls of `abi`'s table, those whose wrapper is one of `shared`'s
/// left out.
fn table_of<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    src: &Sources,
    abi: Abi,
    shared: &[Syscall],
) -> Result<Vec<Syscall>, SyscallError> {
    let id = index
        .lookup(abi.table_symbol())
        .ok_or(SyscallError::NoTable)?;
    let at = index.symbol(id).addr;
    let n = (index.size(id).unwrap_or(0) / 8).min(MAX_SYSCALLS as u64) as u32;
    let mut slots = Vec::new();
    slots
        .try_reserve(n as usize)
        .map_err(|_| SyscallError::Unreadable(at))?;
    for nr in 0..n {
        let slot = at.wrapping_add(u64::from(nr) * 8);
        let f = read_u64(view, slot).map_err(|_| SyscallError::Unreadable(slot))?;
        slots.push((nr, Gva(f)));
    }
    describe(index, btf, src, abi, shared, slots.into_iter())
}

/// The calls at `slots` ((number, wrapper address)) of `abi`, named from
/// kallsyms and described from the best source; those whose wrapper is
/// one of `shared`'s left out.
fn describe<V: VirtMemory + ?Sized>(
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    src: &Sources,
    abi: Abi,
    shared: &[Syscall],
    slots: impl Iterator<Item = (u32, Gva)>,
) -> Result<Vec<Syscall>, SyscallError> {
    let (meta, funcs) = (&src.meta, &src.funcs);
    let mut out = Vec::new();
    for (nr, f) in slots.take(MAX_SYSCALLS) {
        let Some(r) = index.resolve(f).filter(|r| r.offset == 0) else {
            continue;
        };
        // A call without arguments is an alias of its `__do_sys_` body
        // (and of the other ABI's entry): the ABI's name among the
        // symbols at the address.
        let aliases = || {
            (r.id.0..)
                .take(8)
                .map(crate::kallsyms::SymbolId)
                .take_while(|&i| (i.0 as usize) < index.len() && index.symbol(i).addr == r.addr)
                .map(|i| index.name(i))
        };
        let Some((entry, name)) = aliases().find_map(|n| {
            let rest = abi.prefixes().iter().find_map(|p| n.strip_prefix(p))?;
            let rest = String::from(rest);
            Some((n, rest))
        }) else {
            continue;
        };
        let name = name.as_str();
        if name == "ni_syscall" {
            continue;
        }
        if aliases().any(|n| shared.iter().any(|s| s.entry == n)) {
            continue;
        }
        let (args, source) = match meta.iter().find(|(n, _)| n == name) {
            Some((_, a)) => (a.clone(), ArgSource::Metadata),
            None => match btf.and_then(|b| prototype(b, funcs, name)) {
                Some(a) => (a, ArgSource::Btf),
                None => match abi_args(abi, &entry) {
                    Some(a) => (a, ArgSource::Table),
                    None => (Vec::new(), ArgSource::None),
                },
            },
        };
        if out.try_reserve(1).is_err() {
            break;
        }
        out.push(Syscall {
            abi,
            nr,
            name: String::from(name),
            entry: entry.clone(),
            args,
            source,
        });
    }
    Ok(out)
}

/// (name without `sys_`, args) of each metadata entry (the kernel's own
/// array has one per call of the table's `calls`); empty without metadata
/// or BTF for its layout.
fn metadata<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    calls: u64,
) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    let Some(b) = btf else {
        return out;
    };
    let Some(layout) = MetaLayout::of(b) else {
        return out;
    };
    // The linker's array of pointers is init data, freed after boot; by
    // then the kernel has copied them into `syscalls_metadata`, an array
    // indexed by number (`init_ftrace_syscalls`). A kernel image not yet
    // booted has only the first.
    let runtime = index
        .addr_of("syscalls_metadata")
        .and_then(|v| read_u64(view, v).ok())
        .filter(|&p| p != 0)
        .map(|p| (Gva(p), calls));
    let linked = index
        .addr_of("__start_syscalls_metadata")
        .zip(index.addr_of("__stop_syscalls_metadata"))
        .map(|(start, stop)| {
            (
                start,
                (stop.0.saturating_sub(start.0) / 8).min(MAX_SYSCALLS as u64),
            )
        });
    let Some((start, n)) = runtime.or(linked) else {
        return out;
    };
    for i in 0..n {
        let Ok(m) = read_u64(view, start.wrapping_add(i * 8)) else {
            continue;
        };
        if m == 0 {
            continue;
        }
        let m = Gva(m);
        let field = |off: u64| read_u64(view, m.wrapping_add(off)).ok();
        let Some(name) = field(layout.name).and_then(|p| string(view, Gva(p))) else {
            continue;
        };
        let Ok(nb) = read_u32(view, m.wrapping_add(layout.nb_args)) else {
            continue;
        };
        let nb = (nb as usize).min(MAX_ARGS);
        let (Some(types), Some(args)) = (field(layout.types), field(layout.args)) else {
            continue;
        };
        let mut a = Vec::new();
        for k in 0..nb as u64 {
            let t = read_u64(view, Gva(types).wrapping_add(k * 8))
                .ok()
                .and_then(|p| string(view, Gva(p)));
            let n = read_u64(view, Gva(args).wrapping_add(k * 8))
                .ok()
                .and_then(|p| string(view, Gva(p)));
            match (t, n) {
                (Some(t), Some(n)) => a.push((t, n)),
                _ => break,
            }
        }
        if a.len() != nb {
            continue;
        }
        let name = name.strip_prefix("sys_").map(String::from).unwrap_or(name);
        if out.try_reserve(1).is_err() {
            break;
        }
        out.push((name, a));
    }
    out
}

/// Byte offsets in `struct syscall_metadata`.
struct MetaLayout {
    name: u64,
    nb_args: u64,
    types: u64,
    args: u64,
}

impl MetaLayout {
    fn of<V: VirtMemory + ?Sized>(b: &Btf<'_, V>) -> Option<MetaLayout> {
        let t = b.find_named(Kind::Struct, "syscall_metadata").ok()??;
        let off = |m: &str| -> Option<u64> {
            Some(u64::from(b.member_named(&t, m).ok()??.byte_offset()?))
        };
        Some(MetaLayout {
            name: off("name")?,
            nb_args: off("nb_args")?,
            types: off("types")?,
            args: off("args")?,
        })
    }
}

/// A NUL-terminated string of at most [`MAX_TEXT`] bytes, read a page
/// piece at a time.
fn string<V: VirtMemory + ?Sized>(view: &V, at: Gva) -> Option<String> {
    let mut out: Vec<u8> = Vec::new();
    let mut p = at;
    while out.len() < MAX_TEXT {
        let to_page_end = 0x1000 - (p.0 & 0xfff) as usize;
        let n = to_page_end.min(MAX_TEXT - out.len());
        let mut buf = [0u8; MAX_TEXT];
        let piece = buf.get_mut(..n)?;
        view.read_virt(p, piece).ok()?;
        if let Some(end) = piece.iter().position(|&c| c == 0) {
            out.extend_from_slice(piece.get(..end)?);
            return Some(String::from_utf8_lossy(&out).into_owned());
        }
        out.extend_from_slice(piece);
        p = p.wrapping_add(n as u64);
    }
    None
}

/// (type, name) of the arguments the generated table of `abi` gives the
/// call whose wrapper is `entry`, when it has its prototype.
fn abi_args(abi: Abi, entry: &str) -> Option<Vec<(String, String)>> {
    let call = crate::syscall_abi::lookup_entry(abi.abi_table(), entry).filter(|c| c.typed)?;
    let mut out = Vec::new();
    out.try_reserve(call.args.len()).ok()?;
    out.extend(
        call.args
            .iter()
            .map(|&(t, n)| (String::from(t), String::from(n))),
    );
    Some(out)
}

/// (type, name) of `__do_sys_NAME`'s parameters, when BTF has it.
fn prototype<V: VirtMemory + ?Sized>(
    b: &Btf<'_, V>,
    funcs: &[(String, TypeInfo)],
    name: &str,
) -> Option<Vec<(String, String)>> {
    let (_, func) = funcs
        .iter()
        .find(|(n, _)| n.strip_prefix("__do_sys_") == Some(name))?;
    let sig = b.signature_of(func).ok()?;
    sig.params
        .iter()
        .take(MAX_ARGS)
        .map(|p| Some((c_type(b, p.type_id, 0)?, p.name.clone())))
        .collect()
}

/// The C spelling of type `id` (`const char *`, `size_t`, `struct
/// open_how *`), as the kernel's syscall metadata writes it.
pub fn c_type<V: VirtMemory + ?Sized>(b: &Btf<'_, V>, id: u32, depth: u32) -> Option<String> {
    if depth > 8 {
        return None;
    }
    if id == 0 {
        return Some(String::from("void"));
    }
    let t = b.type_info(id).ok()?;
    let named = |prefix: &str| -> Option<String> {
        let n = b.name(t.name_off).ok()?;
        Some(if prefix.is_empty() {
            n
        } else {
            format!("{prefix} {n}")
        })
    };
    match t.kind {
        Kind::Int | Kind::Typedef | Kind::Float => named(""),
        Kind::Struct | Kind::Fwd if t.name_off != 0 => named("struct"),
        Kind::Union if t.name_off != 0 => named("union"),
        Kind::Enum | Kind::Enum64 if t.name_off != 0 => named("enum"),
        Kind::Ptr => Some(format!("{} *", c_type(b, t.size_or_type, depth + 1)?)),
        Kind::Const => Some(format!("const {}", c_type(b, t.size_or_type, depth + 1)?)),
        Kind::Volatile => Some(format!(
            "volatile {}",
            c_type(b, t.size_or_type, depth + 1)?
        )),
        Kind::Restrict | Kind::TypeTag => c_type(b, t.size_or_type, depth + 1),
        _ => match b.shape(id).ok()? {
            Shape::Array { elem, .. } => Some(format!("{} *", c_type(b, elem, depth + 1)?)),
            _ => Some(String::from("void *")),
        },
    }
}
