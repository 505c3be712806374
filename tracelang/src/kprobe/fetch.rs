//! Fetch-argument evaluation over a captured `struct pt_regs` and guest
//! memory, with the semantics of the kernel's `process_fetch_insn`
//! (kernel/trace/trace_kprobe.c, trace_probe_tmpl.h).
//!
//! Guest memory is read through [`GuestMem`]; a read that fails gives
//! [`FetchedValue::Fault`], never a panic. Before reading, an address is
//! checked the way an x86-64 kernel checks it in `probe_mem_read` and
//! `fetch_store_string` (trace_probe_kernel.h): an address below
//! `TASK_SIZE_MAX` is read as user memory (x86 selects
//! `ARCH_HAS_NON_OVERLAPPING_ADDRESS_SPACE`), the user guard page, the
//! vsyscall page and non-canonical addresses fault, and the `u`
//! dereference and `ustring` accept user addresses only.

use alloc::borrow::Cow;
use alloc::vec::Vec;
use guest_introspect::fallible::{self, OutOfMemory};

use guest_introspect::addr::Gva;
use trampolines::PtRegs;

use super::spec::{ArgType, FetchArg, FetchBase, FetchExpr, IntType};

/// The longest string fetched, terminator included: `MAX_STRING_SIZE`,
/// which is `PATH_MAX` in the kernel. A longer string is cut to 4095 bytes
/// as the kernel cuts it.
pub const MAX_STRING_SIZE: usize = 4096;

/// `TASK_COMM_LEN`.
pub const TASK_COMM_LEN: usize = 16;

const PAGE_SIZE: u64 = 4096;

/// Bytes read per guest-memory call when fetching a string.
const STRING_CHUNK: usize = 256;

/// The vsyscall page (`VSYSCALL_ADDR`), which the kernel never reads
/// through a probe.
const VSYSCALL_ADDR: u64 = 0xffff_ffff_ff60_0000;

/// A guest-virtual read failed (not present, not canonical, not guest RAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemFault;

/// Guest-virtual memory as the probed vCPU sees it (the hypervisor backs it
/// with its guest page walker over the vCPU's CR3).
pub trait GuestMem {
    /// Fills `buf` from `[gva, gva + buf.len())`. The evaluator never asks
    /// for a range that crosses a 4 KiB page boundary.
    fn read(&mut self, gva: Gva, buf: &mut [u8]) -> Result<(), MemFault>;
}

/// An address as `symbol+offset/size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SymbolAt<'a> {
    /// The symbol containing the address.
    pub name: Cow<'a, str>,
    /// How far into it the address is.
    pub offset: u64,
    /// The symbol's size.
    pub size: u64,
    /// The module it belongs to, if not the kernel image.
    pub module: Option<Cow<'a, str>>,
}

/// Kernel symbols: the addresses of `@SYM`, and the `%pS` form of
/// addresses for `:symbol`, `:symstr` and the probe location.
pub trait SymbolResolver {
    /// The address of `name` (`kallsyms_lookup_name`).
    fn lookup(&self, name: &str) -> Option<Gva>;
    /// The symbol containing `addr`.
    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>>;
}

/// A resolver that knows no symbol.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSymbols;

impl SymbolResolver for NoSymbols {
    fn lookup(&self, _: &str) -> Option<Gva> {
        None
    }
    fn symbolize(&self, _: Gva) -> Option<SymbolAt<'_>> {
        None
    }
}

/// The guest kernel's address-space constants that the kernel's own probe
/// reads depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestLayout {
    /// `TASK_SIZE_MAX`: the end of user space.
    pub task_size_max: u64,
    /// Implemented virtual-address bits (canonical form).
    pub virt_bits: u32,
    /// `THREAD_SIZE`: the size and alignment of a kernel stack, which
    /// bounds `$stackN`.
    pub thread_size: u64,
}

impl GuestLayout {
    /// 4-level paging, 16 KiB stacks.
    pub const X86_64_4LEVEL: GuestLayout = GuestLayout {
        task_size_max: (1 << 47) - PAGE_SIZE,
        virt_bits: 48,
        thread_size: 16384,
    };
    /// 5-level paging (CR4.LA57), 16 KiB stacks.
    pub const X86_64_5LEVEL: GuestLayout = GuestLayout {
        task_size_max: (1 << 56) - PAGE_SIZE,
        virt_bits: 57,
        thread_size: 16384,
    };

    fn canonical(&self, addr: u64) -> bool {
        let shift = 64u32.saturating_sub(self.virt_bits.clamp(1, 64));
        (((addr << shift) as i64) >> shift) as u64 == addr
    }

    /// Whether a kernel-mode read of `len` bytes at `addr` can be tried
    /// (`copy_from_kernel_nofault_allowed`, x86-64).
    fn kernel_ok(&self, addr: u64, len: u64) -> bool {
        addr >= self.task_size_max.saturating_add(PAGE_SIZE)
            && addr & !(PAGE_SIZE - 1) != VSYSCALL_ADDR
            && self.canonical(addr)
            && addr.checked_add(len).is_some()
    }

    /// Whether a user-mode read can be tried (`access_ok`).
    fn user_ok(&self, addr: u64, len: u64) -> bool {
        addr.checked_add(len)
            .is_some_and(|end| end <= self.task_size_max)
    }
}

impl Default for GuestLayout {
    fn default() -> Self {
        Self::X86_64_4LEVEL
    }
}

/// What a probe hit gives the evaluator besides memory and symbols.
#[derive(Debug, Clone, Copy)]
pub struct FetchContext<'a> {
    /// The registers at the fentry site (or at return, for return probes).
    pub regs: &'a PtRegs,
    /// `current->comm`, NUL-padded or not; `None` if it could not be read.
    pub comm: Option<&'a [u8]>,
    /// The guest's address-space constants.
    pub layout: GuestLayout,
    /// At a return: the first arguments (di, si, dx, cx, r8, r9) as they
    /// were at the function's entry, when they were saved.
    pub entry_args: Option<&'a [u64]>,
}

/// One fetched argument, ready to store in a ring and print later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchedValue {
    /// An integer, already cut to its width.
    Int {
        /// How to print it.
        ty: IntType,
        /// The value, zero-extended.
        value: u64,
    },
    /// `string`, `ustring`, `$comm`: the bytes before the terminator.
    Str(Vec<u8>),
    /// `symbol`: an address printed as `sym+0xoff/0xsize`.
    Symbol(u64),
    /// `symstr`: an address printed as a quoted `"sym+0xoff/0xsize"`.
    SymStr(u64),
    /// A read failed: printed `(fault)`.
    Fault,
}

/// Evaluates every argument of a probe (none when the heap refuses the
/// values: see [`try_fetch`]).
pub fn fetch(
    args: &[FetchArg],
    ctx: &FetchContext<'_>,
    mem: &mut dyn GuestMem,
    syms: &dyn SymbolResolver,
) -> Vec<FetchedValue> {
    try_fetch(args, ctx, mem, syms).unwrap_or_default()
}

/// Evaluates every argument of a probe, every allocation fallible: the
/// strings' lengths follow guest data, and hits run on many vCPUs at once,
/// so a refused allocation fails the whole event (the caller counts it
/// lost) rather than root.
pub fn try_fetch(
    args: &[FetchArg],
    ctx: &FetchContext<'_>,
    mem: &mut dyn GuestMem,
    syms: &dyn SymbolResolver,
) -> Result<Vec<FetchedValue>, OutOfMemory> {
    let mut out = Vec::new();
    try_fetch_into(args, ctx, mem, syms, &mut out)?;
    Ok(out)
}

/// [`try_fetch`] into `out`, which keeps what it holds from the last
/// call: its room, and the buffers of its strings, which this call's
/// strings are read into in the same order. A hit that fetches what the
/// last one did (the same probe, strings no longer than before) takes no
/// heap at all. On an error `out` is left empty.
pub fn try_fetch_into(
    args: &[FetchArg],
    ctx: &FetchContext<'_>,
    mem: &mut dyn GuestMem,
    syms: &dyn SymbolResolver,
    out: &mut Vec<FetchedValue>,
) -> Result<(), OutOfMemory> {
    if let Err(e) = fallible::try_reserve(out, args.len().saturating_sub(out.len())) {
        out.clear();
        return Err(e);
    }
    let mut r = Reader {
        mem,
        layout: ctx.layout,
        refused: None,
        spare: Vec::new(),
    };
    for (i, a) in args.iter().enumerate() {
        // The buffer of the string this slot held, for this one.
        r.spare = match out.get_mut(i) {
            Some(FetchedValue::Str(b)) => core::mem::take(b),
            _ => Vec::new(),
        };
        let v = eval(&a.expr, a.ty, ctx, &mut r, syms).unwrap_or(FetchedValue::Fault);
        if let Some(e) = r.refused.take() {
            out.clear();
            return Err(e);
        }
        match out.get_mut(i) {
            Some(slot) => *slot = v,
            // Within the room reserved above: no allocation.
            None => out.push(v),
        }
    }
    out.truncate(args.len());
    Ok(())
}

/// The heap one hit of a probe with `args` may take at most: its values,
/// each string at its longest, and the record they encode to.
pub fn worst_case_bytes(args: &[FetchArg]) -> usize {
    let strings = args
        .iter()
        .filter(|a| {
            matches!(a.ty, ArgType::String | ArgType::UString)
                || matches!(a.expr.base, FetchBase::Comm | FetchBase::ImmString(_))
        })
        .count();
    let values = args.len() * core::mem::size_of::<FetchedValue>();
    // The values' strings, then the record (each string again, and a
    // header and a few words per argument).
    2 * strings * MAX_STRING_SIZE + values + 64 * args.len() + 128
}

/// Evaluates one argument.
pub fn fetch_one(
    arg: &FetchArg,
    ctx: &FetchContext<'_>,
    mem: &mut dyn GuestMem,
    syms: &dyn SymbolResolver,
) -> FetchedValue {
    let mut r = Reader {
        mem,
        layout: ctx.layout,
        refused: None,
        spare: Vec::new(),
    };
    eval(&arg.expr, arg.ty, ctx, &mut r, syms).unwrap_or(FetchedValue::Fault)
}

struct Reader<'m> {
    mem: &'m mut dyn GuestMem,
    layout: GuestLayout,
    /// An allocation the heap refused (the value is then a fault, and the
    /// event lost).
    refused: Option<OutOfMemory>,
    /// A buffer a string may be read into (its contents are not kept).
    spare: Vec<u8>,
}

impl Reader<'_> {
    /// A buffer for a string: the spare one, emptied.
    fn buffer(&mut self) -> Vec<u8> {
        let mut v = core::mem::take(&mut self.spare);
        v.clear();
        v
    }

    /// `bytes` copied into a string, or `None` (noted) when the heap
    /// refuses it.
    fn string(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut v = self.buffer();
        match fallible::try_extend_from_slice(&mut v, bytes) {
            Ok(()) => Some(v),
            Err(e) => {
                self.refused = Some(e);
                None
            }
        }
    }
}

impl Reader<'_> {
    /// Reads `buf.len()` bytes, page by page, after the kernel's address
    /// checks. `user` is a `u` dereference or a `ustring`.
    fn read(&mut self, addr: u64, buf: &mut [u8], user: bool) -> Option<()> {
        let len = buf.len() as u64;
        let as_user = user || addr < self.layout.task_size_max;
        let ok = if as_user {
            self.layout.user_ok(addr, len)
        } else {
            self.layout.kernel_ok(addr, len)
        };
        if !ok {
            return None;
        }
        self.read_raw(addr, buf)
    }

    /// Reads without the address checks, split at page boundaries.
    fn read_raw(&mut self, addr: u64, buf: &mut [u8]) -> Option<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = addr.checked_add(done as u64)?;
            let in_page = (PAGE_SIZE - (at & (PAGE_SIZE - 1))) as usize;
            let n = in_page.min(buf.len() - done);
            let chunk = buf.get_mut(done..done + n)?;
            self.mem.read(Gva(at), chunk).ok()?;
            done += n;
        }
        Some(())
    }

    fn read_u64(&mut self, addr: u64, user: bool) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b, user)?;
        Some(u64::from_le_bytes(b))
    }

    /// A zero-extended little-endian integer of `size` bytes (1..=8).
    fn read_uint(&mut self, addr: u64, size: usize, user: bool) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, b.get_mut(..size.min(8))?, user)?;
        Some(u64::from_le_bytes(b))
    }

    /// A NUL-terminated string of at most [`MAX_STRING_SIZE`] bytes with its
    /// terminator (`fetch_store_strlen` + `strncpy_from_kernel_nofault`):
    /// a fault before the terminator faults the whole string, a string
    /// with no terminator in reach is cut to `MAX_STRING_SIZE - 1` bytes.
    fn read_string(&mut self, addr: u64, user: bool) -> Option<Vec<u8>> {
        let as_user = user || addr < self.layout.task_size_max;
        let mut out = self.buffer();
        // Small chunks: this runs on a VMX-root stack.
        let mut buf = [0u8; STRING_CHUNK];
        while out.len() < MAX_STRING_SIZE {
            let at = addr.checked_add(out.len() as u64)?;
            let in_page = (PAGE_SIZE - (at & (PAGE_SIZE - 1))) as usize;
            let n = in_page.min(STRING_CHUNK).min(MAX_STRING_SIZE - out.len());
            let ok = if as_user {
                self.layout.user_ok(at, n as u64)
            } else {
                self.layout.kernel_ok(at, n as u64)
            };
            if !ok {
                return None;
            }
            let chunk = buf.get_mut(..n)?;
            self.mem.read(Gva(at), chunk).ok()?;
            let nul = chunk.iter().position(|&c| c == 0);
            let part = chunk.get(..nul.unwrap_or(n))?;
            if let Err(e) = fallible::try_extend_from_slice(&mut out, part) {
                self.refused = Some(e);
                return None;
            }
            if nul.is_some() {
                return Some(out);
            }
        }
        out.truncate(MAX_STRING_SIZE - 1);
        Some(out)
    }

    /// `regs_get_kernel_stack_nth`: the N-th long above `sp`, or 0 when it
    /// lies outside the current kernel stack or cannot be read.
    fn stack_nth(&mut self, regs: &PtRegs, n: u64) -> u64 {
        let addr = regs.sp.wrapping_add(n.wrapping_mul(8));
        let mask = !(self.layout.thread_size.max(1) - 1);
        if addr & mask != regs.sp & mask {
            return 0;
        }
        let mut b = [0u8; 8];
        if !self.layout.kernel_ok(addr, 8) || self.read_raw(addr, &mut b).is_none() {
            return 0;
        }
        u64::from_le_bytes(b)
    }
}

/// The first stage: the base value.
fn load(
    base: &FetchBase,
    ctx: &FetchContext<'_>,
    r: &mut Reader<'_>,
    syms: &dyn SymbolResolver,
) -> Option<u64> {
    Some(match base {
        FetchBase::Reg(reg) => reg.get(ctx.regs),
        FetchBase::StackEntry(n) => r.stack_nth(ctx.regs, u64::from(*n)),
        FetchBase::StackPointer => ctx.regs.sp,
        // regs_get_kernel_argument: six registers, then the stack above the
        // return address.
        FetchBase::Arg(n) => match ctx.regs.arg(*n) {
            Some(v) => v,
            None => r.stack_nth(ctx.regs, u64::from(n.saturating_sub(6))),
        },
        FetchBase::RetVal => ctx.regs.ax,
        FetchBase::EntryArg(n) => *ctx
            .entry_args?
            .get(usize::try_from(n.checked_sub(1)?).ok()?)?,
        FetchBase::Imm(v) => *v,
        FetchBase::Symbol {
            name,
            offset,
            resolved,
        } => {
            let a = match resolved {
                Some(a) => *a,
                None => syms.lookup(name)?,
            };
            a.0.wrapping_add(*offset as u64)
        }
        // Strings without an address; handled by the caller.
        FetchBase::Comm | FetchBase::ImmString(_) => return None,
    })
}

fn eval(
    expr: &FetchExpr,
    ty: ArgType,
    ctx: &FetchContext<'_>,
    r: &mut Reader<'_>,
    syms: &dyn SymbolResolver,
) -> Option<FetchedValue> {
    // Values that are strings from the start.
    match &expr.base {
        FetchBase::Comm => {
            let comm = ctx.comm?;
            let comm = comm.get(..TASK_COMM_LEN).unwrap_or(comm);
            let end = comm.iter().position(|&c| c == 0).unwrap_or(comm.len());
            return r.string(comm.get(..end)?).map(FetchedValue::Str);
        }
        FetchBase::ImmString(s) => return r.string(s.as_bytes()).map(FetchedValue::Str),
        _ => {}
    }

    let mut v = load(&expr.base, ctx, r, syms)?;
    // Every dereference but the last reads a pointer; the last one is the
    // store, whose width the type sets (symstr excepted: it keeps the
    // dereference and stores the pointer read).
    let (last, chain) = match expr.derefs.split_last() {
        Some((l, c)) => (Some(*l), c),
        None => (None, &[][..]),
    };
    for d in chain {
        v = r.read_u64(v.wrapping_add(d.offset as u64), d.user)?;
    }

    match ty {
        ArgType::String | ArgType::UString => {
            let (addr, user) = match last {
                Some(d) => (v.wrapping_add(d.offset as u64), d.user),
                None => (v, false),
            };
            r.read_string(addr, user || ty == ArgType::UString)
                .map(FetchedValue::Str)
        }
        ArgType::SymStr => {
            if let Some(d) = last {
                v = r.read_u64(v.wrapping_add(d.offset as u64), d.user)?;
            }
            Some(FetchedValue::SymStr(v))
        }
        ArgType::Symbol => {
            if let Some(d) = last {
                v = r.read_u64(v.wrapping_add(d.offset as u64), d.user)?;
            }
            Some(FetchedValue::Symbol(v))
        }
        ArgType::Int(t) => {
            if let Some(d) = last {
                v = r.read_uint(v.wrapping_add(d.offset as u64), t.size(), d.user)?;
            }
            Some(FetchedValue::Int {
                ty: t,
                value: t.truncate(v),
            })
        }
        ArgType::Bitfield {
            width,
            shift,
            container,
        } => {
            let t = IntType::unsigned_of(container);
            if let Some(d) = last {
                v = r.read_uint(v.wrapping_add(d.offset as u64), t.size(), d.user)?;
            }
            let bits = u32::from(container) * 8;
            let (width, shift) = (u32::from(width), u32::from(shift));
            // fetch_apply_bitfield: shift left then right within the container.
            let lshift = bits.checked_sub(width + shift)?;
            let rshift = bits.checked_sub(width)?;
            let value = t
                .truncate(t.truncate(v).checked_shl(lshift).unwrap_or(0))
                .checked_shr(rshift)
                .unwrap_or(0);
            Some(FetchedValue::Int { ty: t, value })
        }
    }
}
