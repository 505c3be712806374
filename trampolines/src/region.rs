//! The trampoline region: one 4 KiB code page holding the entry and return
//! trampolines, generated for the guest-virtual address it will be mapped at.
//!
//! # Layout
//!
//! ```text
//! offset  size    what
//! 0x000   <0x400  entry trampoline   (target of every hooked site's `call rel32`)
//! 0x400   <0x100  return trampoline  (written over hijacked return addresses)
//! 0x500   ...     int3 (0xCC) fill
//! 0xff0   8       entry hook slot    } call-hook mode only (host tests);
//! 0xff8   8       return hook slot   } int3 fill otherwise
//! ```
//!
//! There is no per-site data: the site is identified by the return address
//! of the site's `call` (`pt_regs.ip - 5`), and the one per-site decision
//! the trampoline needs (continue past the site, or enter the guest's own
//! `call` target there) comes back from VMX root in RAX, which owns the
//! site table. See [`crate::abi`] for the hypercall ABI.
//!
//! The generated code is position-independent; the base address fixes the
//! addresses VMX root checks VMCALLs against and the targets of site patches.
//!
//! # Entry trampoline
//!
//! Entered by `call rel32` from a site, so at entry `[rsp]` = site + 5 and
//! `[rsp + 8]` = the traced function's return address. With `R0` the RSP at
//! entry, `pt_regs` is built at `P = R0 - 168` (directly below the site's
//! return slot), as `ftrace_regs_caller` does:
//!
//! ```text
//!   R0 + 8   traced function's return address   <- pt_regs.sp points here
//!   R0       site + 5 (the site call's return)   = P + 168
//!   R0 - 8   pt_regs.ss                          = P + 160
//!   R0 - 16  pt_regs.sp   (continuation slot)    = P + 152
//!   R0 - 24  pt_regs.flags (stored by pushfq)    = P + 144
//!   ...
//!   R0 - 168 pt_regs.r15                         = P    <- RSP, RDI at the VMCALL
//! ```
//!
//! ```text
//!   lea  rsp, [rsp - 16]        ; so that pushfq lands on pt_regs.flags
//!   pushfq                      ; flags before anything changes them
//!   sub  rsp, 144               ; RSP = &pt_regs
//!   mov  [rsp + REG], reg       ; x15, every GPR
//!   mov  rax, [rsp + 168]       ; site + 5
//!   mov  [rsp + ip], rax
//!   lea  rsi, [rax - 5]         ; RSI = the site
//!   lea  rax, [rsp + 176]       ; the traced function's entry RSP
//!   mov  [rsp + sp], rax
//!   mov  qword [rsp + orig_ax], 0
//!   mov  qword [rsp + cs], 0x10
//!   mov  qword [rsp + ss], 0x18
//!   mov  rdi, rsp               ; RDI = &pt_regs
//!   mov  eax, HYPERCALL_ENTRY
//!   vmcall                      ; RAX = chain target or 0
//!   test rax, rax
//!   jnz  .chain
//!   mov  rax, [rsp + ip]        ; continue at the (possibly new) ip:
//!   mov  [rsp + sp], rax        ;   the slot right above flags
//!   mov  reg, [rsp + REG]       ; x15, RAX last
//!   add  rsp, 144               ; RSP = &pt_regs.flags
//!   popfq
//!   ret  16                     ; to ip, RSP = R0 + 8 (the function's entry RSP)
//! .chain:
//!   mov  [rsp + sp], rax        ; the chain target above flags
//!   mov  rax, [rsp + ip]
//!   mov  [rsp + 168], rax       ; the site call's return slot = ip
//!   mov  reg, [rsp + REG]       ; x15
//!   add  rsp, 144
//!   popfq
//!   ret  8                      ; to target, RSP = R0, [R0] = ip: as if the
//!                               ; site had executed `call target`
//! ```
//!
//! Every `pt_regs` offset comes from `offset_of!(PtRegs, ..)`; the two
//! `ret imm16` operands follow from the frame size and the position of
//! `sp` right after `flags`, both asserted at compile time.
//!
//! # Return trampoline
//!
//! Entered by `ret` from a function whose return address was replaced, so
//! RSP = `retp + 8` and RAX/RDX hold the return value.
//!
//! ```text
//!   lea  rsp, [rsp - 24]        ; RSP = &ReturnFrame, frame.ret = the return slot
//!   mov  [rsp + ax], rax
//!   mov  [rsp + dx], rdx
//!   mov  rsi, rax               ; RSI = return value
//!   mov  rdi, rsp               ; RDI = &ReturnFrame
//!   mov  eax, HYPERCALL_RETURN
//!   vmcall                      ; RAX = original return address
//!   mov  [rsp + ret], rax
//!   mov  rax, [rsp + ax]
//!   mov  rdx, [rsp + dx]
//!   lea  rsp, [rsp + 16]        ; RSP = retp
//!   ret                         ; RSP = retp + 8
//! ```
//!
//! # Call-hook mode
//!
//! With the `call-hook` feature, `HypercallMode::CallHook` replaces each
//! VMCALL by a call of a System V function through a slot in the page:
//!
//! ```text
//!   push rbx ; mov rbx, rsp ; and rsp, -16 ; call [rip + slot] ; mov rsp, rbx ; pop rbx
//! ```
//!
//! The hook gets the hypercall's RDI and RSI (and RDX) as its arguments and
//! returns what VMX root returns in RAX, so host tests can execute the
//! generated code natively. The alignment is for the hook's sake; the
//! kernel needs none.

use core::mem::{offset_of, size_of};

use crate::abi::{Hypercall, ReturnFrame, HYPERCALL_ENTRY, HYPERCALL_RETURN};
use crate::enc::{Asm, Reg};
use crate::patch::{self, OutOfRange};
use crate::ptregs::{PtRegs, KERNEL_CS, KERNEL_SS};
use crate::Gva;

/// Size of the trampoline region: one page.
pub const REGION_SIZE: usize = 4096;
/// Offset of the entry trampoline.
pub const ENTRY_OFFSET: usize = 0x000;
/// Offset of the return trampoline.
pub const RETURN_OFFSET: usize = 0x400;
/// End of the space reserved for the return trampoline.
const RETURN_END: usize = 0x500;
/// Offset of the entry hook slot (call-hook mode).
pub const ENTRY_HOOK_SLOT: usize = 0xff0;
/// Offset of the return hook slot (call-hook mode).
pub const RETURN_HOOK_SLOT: usize = 0xff8;
/// Filler for every byte that is not code: `int3`.
const FILL: u8 = 0xcc;

/// How the trampolines reach VMX root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HypercallMode {
    /// `VMCALL` (0f 01 c1): the real thing.
    Vmcall,
    /// `call [rip + slot]` to a System V function at the given address, in
    /// place of each VMCALL: for executing the trampolines natively on the
    /// host. The entry hook is `extern "C" fn(*mut PtRegs, site: u64) -> u64`
    /// (returns the chain target or 0), the return hook
    /// `extern "C" fn(*mut ReturnFrame, ax: u64, dx: u64) -> u64` (returns
    /// the original return address).
    #[cfg(feature = "call-hook")]
    CallHook {
        /// Address of the entry hook.
        entry_hook: u64,
        /// Address of the return hook.
        return_hook: u64,
    },
}

/// Why a region could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildError {
    /// The base is not 4 KiB aligned.
    Unaligned(Gva),
    /// The base is not canonical, or the region would cross out of the
    /// canonical half it starts in.
    NonCanonical(Gva),
    /// A trampoline outgrew its reserved space (a generator bug).
    CodeOverflow,
}

impl core::fmt::Display for BuildError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            BuildError::Unaligned(b) => write!(f, "trampoline base {:#x} is not page aligned", b.0),
            BuildError::NonCanonical(b) => {
                write!(f, "trampoline region at {:#x} is not canonical", b.0)
            }
            BuildError::CodeOverflow => f.write_str("trampoline code outgrew its space"),
        }
    }
}

/// Instruction counts of the generated paths, for cost accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathStats {
    /// Entry trampoline, from its first instruction through the VMCALL.
    pub entry_to_hypercall: u32,
    /// Entry trampoline after the VMCALL when continuing at `ip` (NOP5 path),
    /// through the final `ret`.
    pub entry_resume: u32,
    /// Entry trampoline after the VMCALL when entering the chain target,
    /// through the `ret` into it.
    pub entry_chain: u32,
    /// Return trampoline, from its first instruction through the VMCALL.
    pub return_to_hypercall: u32,
    /// Return trampoline after the VMCALL, through the final `ret`.
    pub return_resume: u32,
}

/// The generated region: bytes to map at `base`, and where things are.
#[derive(Clone)]
pub struct TrampolineRegion {
    base: Gva,
    bytes: [u8; REGION_SIZE],
    entry_len: usize,
    return_len: usize,
    entry_vmcall: Option<usize>,
    return_vmcall: Option<usize>,
    stats: PathStats,
}

impl core::fmt::Debug for TrampolineRegion {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TrampolineRegion")
            .field("base", &self.base)
            .field("entry_len", &self.entry_len)
            .field("return_len", &self.return_len)
            .field("entry_vmcall", &self.entry_vmcall)
            .field("return_vmcall", &self.return_vmcall)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

// ---- Offsets, all from the Linux layout in `ptregs.rs`. ----

const fn off(o: usize) -> i32 {
    o as i32
}

/// Bytes from `pt_regs` up to the site call's return slot (`R0 - P`).
const FRAME: i32 = size_of::<PtRegs>() as i32;
const IP: i32 = off(offset_of!(PtRegs, ip));
const FLAGS: i32 = off(offset_of!(PtRegs, flags));
const SP: i32 = off(offset_of!(PtRegs, sp));
const CS: i32 = off(offset_of!(PtRegs, cs));
const SS: i32 = off(offset_of!(PtRegs, ss));
const ORIG_AX: i32 = off(offset_of!(PtRegs, orig_ax));
/// The continuation slot: the word popped by `ret imm16` right after
/// `popfq` pops `flags`. It is `pt_regs.sp`, which is not honoured on
/// write-back, so it is free once VMX root is done.
const CONT: i32 = FLAGS + 8;
const _: () = assert!(offset_of!(PtRegs, sp) as i32 == CONT);
/// Room below the return slot before `pushfq`, so that it stores `flags`.
const PRE_PUSHF: i32 = FRAME - (FLAGS + 8);
/// `ret imm16` on the NOP5 path: from just above the continuation slot to
/// the traced function's entry RSP (`R0 + 8`).
const POP_RESUME: i32 = FRAME + 8 - (CONT + 8);
/// `ret imm16` on the chain path: to `R0`, leaving the site's return slot.
const POP_CHAIN: i32 = FRAME - (CONT + 8);
const _: () = assert!(PRE_PUSHF >= 0 && POP_CHAIN >= 0 && POP_RESUME < 0x1_0000);
const _: () = assert!(PRE_PUSHF == 16 && POP_RESUME == 16 && POP_CHAIN == 8);

/// The GPRs in `pt_regs` order; restored in reverse, so RAX (the scratch
/// register) comes last.
const GPRS: [(Reg, usize); 15] = [
    (Reg::R15, offset_of!(PtRegs, r15)),
    (Reg::R14, offset_of!(PtRegs, r14)),
    (Reg::R13, offset_of!(PtRegs, r13)),
    (Reg::R12, offset_of!(PtRegs, r12)),
    (Reg::Rbp, offset_of!(PtRegs, bp)),
    (Reg::Rbx, offset_of!(PtRegs, bx)),
    (Reg::R11, offset_of!(PtRegs, r11)),
    (Reg::R10, offset_of!(PtRegs, r10)),
    (Reg::R9, offset_of!(PtRegs, r9)),
    (Reg::R8, offset_of!(PtRegs, r8)),
    (Reg::Rdi, offset_of!(PtRegs, di)),
    (Reg::Rsi, offset_of!(PtRegs, si)),
    (Reg::Rdx, offset_of!(PtRegs, dx)),
    (Reg::Rcx, offset_of!(PtRegs, cx)),
    (Reg::Rax, offset_of!(PtRegs, ax)),
];

const RF_AX: i32 = off(offset_of!(ReturnFrame, ax));
const RF_DX: i32 = off(offset_of!(ReturnFrame, dx));
const RF_RET: i32 = off(offset_of!(ReturnFrame, ret));
/// The frame is built downwards from the return trampoline's entry RSP
/// (`retp + 8`), so that `ret` is the hijacked return slot itself.
const RF_SIZE: i32 = size_of::<ReturnFrame>() as i32;

/// The lowest canonical address of the upper half.
const UPPER_HALF: u64 = 0xffff_8000_0000_0000;
/// One past the highest canonical address of the lower half.
const LOWER_END: u64 = 0x0000_8000_0000_0000;

impl TrampolineRegion {
    /// Generates the region for mapping at `base` (page aligned, canonical).
    pub fn build(base: Gva, mode: HypercallMode) -> Result<Self, BuildError> {
        if !base.0.is_multiple_of(REGION_SIZE as u64) {
            return Err(BuildError::Unaligned(base));
        }
        let last = base.0.wrapping_add(REGION_SIZE as u64 - 1);
        let lower = base.0 < LOWER_END && last < LOWER_END;
        let upper = base.0 >= UPPER_HALF && last >= base.0;
        if !(lower || upper) {
            return Err(BuildError::NonCanonical(base));
        }

        let mut bytes = [FILL; REGION_SIZE];
        #[cfg(feature = "call-hook")]
        if let HypercallMode::CallHook {
            entry_hook,
            return_hook,
        } = mode
        {
            bytes[ENTRY_HOOK_SLOT..ENTRY_HOOK_SLOT + 8].copy_from_slice(&entry_hook.to_le_bytes());
            bytes[RETURN_HOOK_SLOT..RETURN_HOOK_SLOT + 8]
                .copy_from_slice(&return_hook.to_le_bytes());
        }

        let entry = gen_entry(&mut bytes[..RETURN_OFFSET], mode)?;
        let ret = gen_return(&mut bytes[..RETURN_END], mode)?;

        Ok(TrampolineRegion {
            base,
            bytes,
            entry_len: entry.end - ENTRY_OFFSET,
            return_len: ret.end - RETURN_OFFSET,
            entry_vmcall: entry.vmcall,
            return_vmcall: ret.vmcall,
            stats: PathStats {
                entry_to_hypercall: entry.to_hypercall,
                entry_resume: entry.resume,
                entry_chain: entry.chain,
                return_to_hypercall: ret.to_hypercall,
                return_resume: ret.resume,
            },
        })
    }

    /// Where the region is mapped.
    pub fn base(&self) -> Gva {
        self.base
    }

    /// The page to map at [`base`](Self::base), read and execute only.
    pub fn bytes(&self) -> &[u8; REGION_SIZE] {
        &self.bytes
    }

    /// The entry trampoline: what a hooked site's `call rel32` targets.
    pub fn entry(&self) -> Gva {
        Gva(self.base.0 + ENTRY_OFFSET as u64)
    }

    /// The return trampoline: what a hijacked return slot is set to.
    pub fn return_trampoline(&self) -> Gva {
        Gva(self.base.0 + RETURN_OFFSET as u64)
    }

    /// Bytes of generated code in the entry trampoline.
    pub fn entry_len(&self) -> usize {
        self.entry_len
    }

    /// Bytes of generated code in the return trampoline.
    pub fn return_len(&self) -> usize {
        self.return_len
    }

    /// Address of the entry trampoline's VMCALL (`None` in call-hook mode).
    pub fn entry_vmcall(&self) -> Option<Gva> {
        self.entry_vmcall.map(|o| Gva(self.base.0 + o as u64))
    }

    /// Address of the return trampoline's VMCALL (`None` in call-hook mode).
    pub fn return_vmcall(&self) -> Option<Gva> {
        self.return_vmcall.map(|o| Gva(self.base.0 + o as u64))
    }

    /// Which hypercall the VMCALL at `rip` is, or `None` if `rip` is not one
    /// of ours (the guest's own VMCALL, which gets #UD).
    pub fn hypercall_at(&self, rip: Gva) -> Option<Hypercall> {
        if Some(rip) == self.entry_vmcall() {
            Some(Hypercall::Entry)
        } else if Some(rip) == self.return_vmcall() {
            Some(Hypercall::Return)
        } else {
            None
        }
    }

    /// Whether `gva` lies in the region.
    pub fn contains(&self, gva: Gva) -> bool {
        gva.0.wrapping_sub(self.base.0) < REGION_SIZE as u64
    }

    /// The `call rel32` that hooks `site` (an error if the entry trampoline
    /// is more than 2 GiB away).
    pub fn site_patch(&self, site: Gva) -> Result<[u8; 5], OutOfRange> {
        patch::call_rel32(site, self.entry())
    }

    /// Instruction counts of each path.
    pub fn stats(&self) -> PathStats {
        self.stats
    }
}

/// What generating one trampoline gives.
struct Generated {
    end: usize,
    vmcall: Option<usize>,
    to_hypercall: u32,
    resume: u32,
    chain: u32,
}

/// Emits the hypercall itself (RAX, RDI, RSI, RDX already set); returns the
/// offset of the VMCALL, if one was emitted.
fn emit_hypercall(a: &mut Asm, mode: HypercallMode, _slot: usize) -> Option<usize> {
    match mode {
        HypercallMode::Vmcall => {
            let at = a.pos();
            a.vmcall();
            Some(at)
        }
        #[cfg(feature = "call-hook")]
        HypercallMode::CallHook { .. } => {
            // RBX is callee-saved in the System V ABI, so it survives the
            // hook; it is restored here because the return trampoline's
            // caller needs it.
            a.push(Reg::Rbx);
            a.mov(Reg::Rbx, Reg::Rsp);
            a.and_imm(Reg::Rsp, -16);
            a.call_rip_slot(_slot);
            a.mov(Reg::Rsp, Reg::Rbx);
            a.pop(Reg::Rbx);
            None
        }
    }
}

/// The entry trampoline's common tail: reload every GPR from pt_regs, point
/// RSP at `flags`, `popfq`, then `ret pop` into the continuation slot.
fn restore_and_return(a: &mut Asm, pop: u16) {
    for (r, o) in GPRS.iter().rev() {
        a.load(*r, Reg::Rsp, off(*o));
    }
    a.add_imm(Reg::Rsp, FLAGS);
    a.popfq();
    a.ret_pop(pop);
}

fn gen_entry(buf: &mut [u8], mode: HypercallMode) -> Result<Generated, BuildError> {
    let mut a = Asm::new(buf, ENTRY_OFFSET);

    // Save RFLAGS first, straight into pt_regs.flags.
    a.lea(Reg::Rsp, Reg::Rsp, -PRE_PUSHF);
    a.pushfq();
    a.sub_imm(Reg::Rsp, FLAGS);
    for (r, o) in GPRS {
        a.store(Reg::Rsp, off(o), r);
    }
    a.load(Reg::Rax, Reg::Rsp, FRAME); // site + 5
    a.store(Reg::Rsp, IP, Reg::Rax);
    a.lea(Reg::Rsi, Reg::Rax, -(patch::SITE_LEN as i32));
    a.lea(Reg::Rax, Reg::Rsp, FRAME + 8); // the traced function's entry RSP
    a.store(Reg::Rsp, SP, Reg::Rax);
    a.store_imm(Reg::Rsp, ORIG_AX, 0);
    a.store_imm(Reg::Rsp, CS, KERNEL_CS as i32);
    a.store_imm(Reg::Rsp, SS, KERNEL_SS as i32);
    a.mov(Reg::Rdi, Reg::Rsp);
    a.mov_imm32(Reg::Rax, HYPERCALL_ENTRY);
    let vmcall = emit_hypercall(&mut a, mode, ENTRY_HOOK_SLOT);
    let to_hypercall = a.insns();

    // RAX = 0: continue at pt_regs.ip.
    a.test(Reg::Rax, Reg::Rax);
    let chain = a.jnz_forward();
    a.load(Reg::Rax, Reg::Rsp, IP);
    a.store(Reg::Rsp, CONT, Reg::Rax);
    restore_and_return(&mut a, POP_RESUME as u16);
    let resume = a.insns() - to_hypercall;

    // RAX = target: enter it as the site's own `call target` would.
    a.bind(chain);
    let before_chain = a.insns();
    a.store(Reg::Rsp, CONT, Reg::Rax);
    a.load(Reg::Rax, Reg::Rsp, IP);
    a.store(Reg::Rsp, FRAME, Reg::Rax);
    restore_and_return(&mut a, POP_CHAIN as u16);
    // test + jnz, then the chain path.
    let chain = 2 + a.insns() - before_chain;

    let end = a.finish().ok_or(BuildError::CodeOverflow)?;
    Ok(Generated {
        end,
        vmcall,
        to_hypercall,
        resume,
        chain,
    })
}

fn gen_return(buf: &mut [u8], mode: HypercallMode) -> Result<Generated, BuildError> {
    let mut a = Asm::new(buf, RETURN_OFFSET);

    // RSP = retp + 8: the frame ends with the return slot.
    a.lea(Reg::Rsp, Reg::Rsp, -RF_SIZE);
    a.store(Reg::Rsp, RF_AX, Reg::Rax);
    a.store(Reg::Rsp, RF_DX, Reg::Rdx);
    a.mov(Reg::Rsi, Reg::Rax);
    a.mov(Reg::Rdi, Reg::Rsp);
    a.mov_imm32(Reg::Rax, HYPERCALL_RETURN);
    let vmcall = emit_hypercall(&mut a, mode, RETURN_HOOK_SLOT);
    let to_hypercall = a.insns();

    a.store(Reg::Rsp, RF_RET, Reg::Rax);
    a.load(Reg::Rax, Reg::Rsp, RF_AX);
    a.load(Reg::Rdx, Reg::Rsp, RF_DX);
    a.lea(Reg::Rsp, Reg::Rsp, RF_RET);
    a.ret();
    let resume = a.insns() - to_hypercall;

    let end = a.finish().ok_or(BuildError::CodeOverflow)?;
    Ok(Generated {
        end,
        vmcall,
        to_hypercall,
        resume,
        chain: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Gva = Gva(0xffff_ffff_a000_0000);

    fn region() -> TrampolineRegion {
        TrampolineRegion::build(BASE, HypercallMode::Vmcall).unwrap()
    }

    #[test]
    fn layout_and_accessors() {
        let r = region();
        assert_eq!(r.base(), BASE);
        assert_eq!(r.entry(), BASE);
        assert_eq!(r.return_trampoline(), Gva(BASE.0 + 0x400));
        assert!(r.entry_len() > 0 && ENTRY_OFFSET + r.entry_len() <= RETURN_OFFSET);
        assert!(r.return_len() > 0 && RETURN_OFFSET + r.return_len() <= RETURN_END);
        assert!(r.contains(BASE) && r.contains(Gva(BASE.0 + 4095)));
        assert!(!r.contains(Gva(BASE.0 + 4096)) && !r.contains(Gva(BASE.0 - 1)));
        // Everything that is not code is int3.
        let b = r.bytes();
        assert!(b[r.entry_len()..RETURN_OFFSET].iter().all(|&x| x == FILL));
        assert!(b[RETURN_OFFSET + r.return_len()..]
            .iter()
            .all(|&x| x == FILL));
    }

    #[test]
    fn vmcalls_are_found_and_classified() {
        let r = region();
        let e = r.entry_vmcall().unwrap();
        let x = r.return_vmcall().unwrap();
        for at in [e, x] {
            let o = (at.0 - BASE.0) as usize;
            // Root resumes past it by this length without reading the
            // exit's instruction length.
            let len = crate::abi::VMCALL_LEN as usize;
            assert_eq!(&r.bytes()[o..o + len], &[0x0f, 0x01, 0xc1]);
        }
        assert_eq!(r.hypercall_at(e), Some(Hypercall::Entry));
        assert_eq!(r.hypercall_at(x), Some(Hypercall::Return));
        assert_eq!(r.hypercall_at(Gva(e.0 + 3)), None);
        assert_eq!(r.hypercall_at(r.entry()), None);
        // Exactly two VMCALLs in the page.
        let n = r
            .bytes()
            .windows(3)
            .filter(|w| *w == [0x0f, 0x01, 0xc1])
            .count();
        assert_eq!(n, 2);
        // Each is preceded by `mov eax, NR`.
        for (at, nr) in [(e, HYPERCALL_ENTRY), (x, HYPERCALL_RETURN)] {
            let o = (at.0 - BASE.0) as usize;
            assert_eq!(r.bytes()[o - 5], 0xb8);
            assert_eq!(&r.bytes()[o - 4..o], &nr.to_le_bytes());
        }
    }

    #[test]
    fn instruction_counts() {
        let s = region().stats();
        assert_eq!(
            s,
            PathStats {
                entry_to_hypercall: 29,
                entry_resume: 22,
                entry_chain: 23,
                return_to_hypercall: 7,
                return_resume: 5,
            }
        );
    }

    #[test]
    fn bad_bases() {
        for b in [BASE.0 + 1, BASE.0 + 0x800] {
            assert_eq!(
                TrampolineRegion::build(Gva(b), HypercallMode::Vmcall).unwrap_err(),
                BuildError::Unaligned(Gva(b))
            );
        }
        for b in [
            0x0000_8000_0000_0000,
            0x1234_0000_0000_0000,
            0xffff_7fff_ffff_f000,
        ] {
            assert_eq!(
                TrampolineRegion::build(Gva(b), HypercallMode::Vmcall).unwrap_err(),
                BuildError::NonCanonical(Gva(b))
            );
        }
        // The very top and bottom pages are fine.
        assert!(TrampolineRegion::build(Gva(0xffff_ffff_ffff_f000), HypercallMode::Vmcall).is_ok());
        assert!(TrampolineRegion::build(Gva(0x7fff_ffff_f000), HypercallMode::Vmcall).is_ok());
        assert!(TrampolineRegion::build(Gva(0), HypercallMode::Vmcall).is_ok());
    }

    #[test]
    fn code_is_position_independent() {
        let a = region();
        let b = TrampolineRegion::build(Gva(0x1000), HypercallMode::Vmcall).unwrap();
        assert_eq!(a.bytes()[..], b.bytes()[..]);
    }

    #[test]
    fn site_patch_targets_entry() {
        let r = region();
        let site = Gva(0xffff_ffff_8123_4560);
        let p = r.site_patch(site).unwrap();
        assert_eq!(patch::decode_call_rel32(site, &p), Some(r.entry()));
        assert!(r.site_patch(Gva(0x1000)).is_err());
    }
}
