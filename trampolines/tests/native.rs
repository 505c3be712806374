//! Runs the generated trampolines natively on the (x86-64 Linux) host.
//!
//! The region is built in call-hook mode, so each VMCALL becomes a call of a
//! Rust `extern "C"` hook that records what it was given and optionally
//! writes values back. A harness in assembly loads every GPR and RFLAGS
//! with known values, calls a fake traced function whose first instruction
//! is the hooked site (`call entry_trampoline`), and captures every register
//! when it returns.
//!
//! Memory: one mapping of three pages.
//!
//! ```text
//! page 0  the trampoline region (read + execute)
//! page 1  fake traced functions (read + execute)
//!           +0x00  site: call entry ; mov byte [marker], 1 ; ret
//!           +0x40  endbr64 ; site: call entry ; mov byte [marker], 1 ; ret
//!           +0x80  alternative ip: mov byte [marker], 2 ; ret
//! page 2  data: the marker byte (read + write)
//! ```
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use core::arch::global_asm;
use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::mem::offset_of;
use std::sync::{Mutex, MutexGuard};

use trampolines::patch::{self, ENDBR64};
use trampolines::ptregs::{KERNEL_CS, KERNEL_SS};
use trampolines::region::{ENTRY_OFFSET, RETURN_OFFSET};
use trampolines::{Gva, HypercallMode, PtRegs, ReturnFrame, TrampolineRegion};

// ---- mmap, by hand ----

const PROT_READ: i32 = 1;
const PROT_WRITE: i32 = 2;
const PROT_EXEC: i32 = 4;
const MAP_PRIVATE: i32 = 0x02;
const MAP_ANONYMOUS: i32 = 0x20;
const PAGE: usize = 4096;

extern "C" {
    fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64)
        -> *mut c_void;
    fn mprotect(addr: *mut c_void, len: usize, prot: i32) -> i32;
    fn munmap(addr: *mut c_void, len: usize) -> i32;
}

// ---- State shared with the assembly and the hooks ----

/// A static the assembly and the hooks write. Tests are serialised by
/// [`lock`], and the hooks and the assembly run on the test's own thread
/// while it holds no reference into the cell.
#[repr(transparent)]
struct Shared<T>(UnsafeCell<T>);
// SAFETY: every access happens under `TEST_LOCK` (see `lock`).
unsafe impl<T> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    fn get(&self) -> T {
        // SAFETY: serialised by `TEST_LOCK`; no reference is live across the read.
        unsafe { self.0.get().read_volatile() }
    }
    fn set(&self, v: T) {
        // SAFETY: as for `get`.
        unsafe { self.0.get().write_volatile(v) }
    }
}

static TEST_LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Register values, in the order the assembly uses (index * 8).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Gprs {
    rax: u64,
    rbx: u64,
    rcx: u64,
    rdx: u64,
    rsi: u64,
    rdi: u64,
    rbp: u64,
    r8: u64,
    r9: u64,
    r10: u64,
    r11: u64,
    r12: u64,
    r13: u64,
    r14: u64,
    r15: u64,
    flags: u64,
}
const _: () = assert!(offset_of!(Gprs, r15) == 14 * 8 && offset_of!(Gprs, flags) == 15 * 8);

/// What the harness is given and what it captures.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Ctx {
    /// Loaded into the registers (and RFLAGS) before the call.
    input: Gprs,
    /// RFLAGS as actually in effect at the call (bits user mode cannot set differ).
    in_flags: u64,
    /// RSP right before the `call` instruction.
    call_rsp: u64,
    /// The function to call.
    target: u64,
    /// Nonzero: misalign the stack by 8 before the call.
    pad: u64,
    /// Every register after the function returned.
    output: Gprs,
    /// RSP after the function returned.
    out_rsp: u64,
    /// The harness's own RSP (for its epilogue).
    harness_rsp: u64,
}

/// What the fake guest call target captured.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ChainCapture {
    regs: Gprs,
    rsp: u64,
    /// `[rsp]` on entry: where it will return.
    ret: u64,
    hits: u64,
}

static CHAIN_CAP: Shared<ChainCapture> = Shared(UnsafeCell::new(ChainCapture {
    regs: Gprs {
        rax: 0,
        rbx: 0,
        rcx: 0,
        rdx: 0,
        rsi: 0,
        rdi: 0,
        rbp: 0,
        r8: 0,
        r9: 0,
        r10: 0,
        r11: 0,
        r12: 0,
        r13: 0,
        r14: 0,
        r15: 0,
        flags: 0,
    },
    rsp: 0,
    ret: 0,
    hits: 0,
}));

/// Set by the return victim: the return address it replaced, and where it was.
static VICTIM_ORIG: Shared<u64> = Shared(UnsafeCell::new(0));
static VICTIM_RETP: Shared<u64> = Shared(UnsafeCell::new(0));
/// Read by the return victim: what to write over its return address.
static VICTIM_HIJACK: Shared<u64> = Shared(UnsafeCell::new(0));

global_asm!(
    // void hvt_harness(Ctx *ctx)
    ".pushsection .text.hvt_harness,\"ax\",@progbits",
    ".globl hvt_harness",
    ".p2align 4",
    "hvt_harness:",
    "push rbp",
    "push rbx",
    "push r12",
    "push r13",
    "push r14",
    "push r15",
    "mov [rdi + {hrsp}], rsp",
    "test qword ptr [rdi + {pad}], 1",
    "jz 2f",
    "sub rsp, 8",
    "2:",
    "push rdi",
    "push qword ptr [rdi + {target}]",
    "mov [rdi + {call_rsp}], rsp",
    "push qword ptr [rdi + {inp} + 15*8]",
    "popfq",
    "pushfq",
    "pop rax",
    "mov [rdi + {in_flags}], rax",
    "mov rax, [rdi + {inp} + 0*8]",
    "mov rbx, [rdi + {inp} + 1*8]",
    "mov rcx, [rdi + {inp} + 2*8]",
    "mov rdx, [rdi + {inp} + 3*8]",
    "mov rsi, [rdi + {inp} + 4*8]",
    "mov rbp, [rdi + {inp} + 6*8]",
    "mov r8, [rdi + {inp} + 7*8]",
    "mov r9, [rdi + {inp} + 8*8]",
    "mov r10, [rdi + {inp} + 9*8]",
    "mov r11, [rdi + {inp} + 10*8]",
    "mov r12, [rdi + {inp} + 11*8]",
    "mov r13, [rdi + {inp} + 12*8]",
    "mov r14, [rdi + {inp} + 13*8]",
    "mov r15, [rdi + {inp} + 14*8]",
    "mov rdi, [rdi + {inp} + 5*8]",
    "call qword ptr [rsp]",
    // [rsp] = target slot, [rsp + 8] = ctx
    "push rdi",
    "mov rdi, [rsp + 16]",
    "mov [rdi + {out} + 0*8], rax",
    "mov [rdi + {out} + 1*8], rbx",
    "mov [rdi + {out} + 2*8], rcx",
    "mov [rdi + {out} + 3*8], rdx",
    "mov [rdi + {out} + 4*8], rsi",
    "mov [rdi + {out} + 6*8], rbp",
    "mov [rdi + {out} + 7*8], r8",
    "mov [rdi + {out} + 8*8], r9",
    "mov [rdi + {out} + 9*8], r10",
    "mov [rdi + {out} + 10*8], r11",
    "mov [rdi + {out} + 11*8], r12",
    "mov [rdi + {out} + 12*8], r13",
    "mov [rdi + {out} + 13*8], r14",
    "mov [rdi + {out} + 14*8], r15",
    "pushfq",
    "pop rax",
    "mov [rdi + {out} + 15*8], rax",
    "pop rax",
    "mov [rdi + {out} + 5*8], rax",
    "mov [rdi + {out_rsp}], rsp",
    "mov rsp, [rdi + {hrsp}]",
    "pop r15",
    "pop r14",
    "pop r13",
    "pop r12",
    "pop rbx",
    "pop rbp",
    // The caller expects DF clear; the tests never set it.
    "ret",
    ".popsection",
    hrsp = const offset_of!(Ctx, harness_rsp),
    pad = const offset_of!(Ctx, pad),
    target = const offset_of!(Ctx, target),
    call_rsp = const offset_of!(Ctx, call_rsp),
    inp = const offset_of!(Ctx, input),
    in_flags = const offset_of!(Ctx, in_flags),
    out = const offset_of!(Ctx, output),
    out_rsp = const offset_of!(Ctx, out_rsp),
);

global_asm!(
    // The guest's own call target at a site (its ftrace_regs_caller, say):
    // records every register, RFLAGS, RSP and [RSP], changes nothing, returns.
    ".pushsection .text.hvt_chain_target,\"ax\",@progbits",
    ".globl hvt_chain_target",
    ".p2align 4",
    "hvt_chain_target:",
    "mov [rip + {cap} + 0*8], rax",
    "mov [rip + {cap} + 1*8], rbx",
    "mov [rip + {cap} + 2*8], rcx",
    "mov [rip + {cap} + 3*8], rdx",
    "mov [rip + {cap} + 4*8], rsi",
    "mov [rip + {cap} + 5*8], rdi",
    "mov [rip + {cap} + 6*8], rbp",
    "mov [rip + {cap} + 7*8], r8",
    "mov [rip + {cap} + 8*8], r9",
    "mov [rip + {cap} + 9*8], r10",
    "mov [rip + {cap} + 10*8], r11",
    "mov [rip + {cap} + 11*8], r12",
    "mov [rip + {cap} + 12*8], r13",
    "mov [rip + {cap} + 13*8], r14",
    "mov [rip + {cap} + 14*8], r15",
    "pushfq",
    "pop rax",
    "mov [rip + {cap} + 15*8], rax",
    "mov [rip + {cap} + {c_rsp}], rsp",
    "mov rax, [rsp]",
    "mov [rip + {cap} + {c_ret}], rax",
    "mov rax, [rip + {cap} + {c_hits}]",
    "lea rax, [rax + 1]",
    "mov [rip + {cap} + {c_hits}], rax",
    "mov rax, [rip + {cap} + 0*8]",
    "ret",
    ".popsection",
    cap = sym CHAIN_CAP,
    c_rsp = const offset_of!(ChainCapture, rsp),
    c_ret = const offset_of!(ChainCapture, ret),
    c_hits = const offset_of!(ChainCapture, hits),
);

global_asm!(
    // A traced function whose return address the graph tracer replaced:
    // saves the original, writes the hijack value over it, and returns with
    // the harness's RAX/RDX as its return value. Clobbers R11 (caller-saved).
    ".pushsection .text.hvt_ret_victim,\"ax\",@progbits",
    ".globl hvt_ret_victim",
    ".p2align 4",
    "hvt_ret_victim:",
    "mov r11, [rsp]",
    "mov [rip + {orig}], r11",
    "mov r11, [rip + {hijack}]",
    "mov [rsp], r11",
    "mov [rip + {retp}], rsp",
    "ret",
    ".popsection",
    orig = sym VICTIM_ORIG,
    hijack = sym VICTIM_HIJACK,
    retp = sym VICTIM_RETP,
);

extern "C" {
    fn hvt_harness(ctx: *mut Ctx);
    fn hvt_chain_target();
    fn hvt_ret_victim();
}

// ---- The hooks standing in for VMX root ----

#[derive(Clone, Copy)]
struct HookState {
    // Entry hypercall.
    entry_calls: u64,
    regs_ptr: u64,
    regs: PtRegs,
    site: u64,
    /// `[pt_regs.sp]` as seen by the hook: the traced function's return address.
    ret_at_sp: u64,
    edit: Option<fn(&mut PtRegs)>,
    chain: u64,
    /// Graph hijack on entry: replace `[pt_regs.sp]` with this, saving the original.
    hijack_with: u64,
    hijacked_orig: u64,
    // Return hypercall.
    ret_calls: u64,
    frame_ptr: u64,
    frame: ReturnFrame,
    ret_ax: u64,
    ret_dx: u64,
    ret_edit: Option<fn(&mut ReturnFrame)>,
}

const HOOK_INIT: HookState = HookState {
    entry_calls: 0,
    regs_ptr: 0,
    regs: PtRegs {
        r15: 0,
        r14: 0,
        r13: 0,
        r12: 0,
        bp: 0,
        bx: 0,
        r11: 0,
        r10: 0,
        r9: 0,
        r8: 0,
        ax: 0,
        cx: 0,
        dx: 0,
        si: 0,
        di: 0,
        orig_ax: 0,
        ip: 0,
        cs: 0,
        flags: 0,
        sp: 0,
        ss: 0,
    },
    site: 0,
    ret_at_sp: 0,
    edit: None,
    chain: 0,
    hijack_with: 0,
    hijacked_orig: 0,
    ret_calls: 0,
    frame_ptr: 0,
    frame: ReturnFrame {
        ax: 0,
        dx: 0,
        ret: 0,
    },
    ret_ax: 0,
    ret_dx: 0,
    ret_edit: None,
};

static HOOK: Shared<HookState> = Shared(UnsafeCell::new(HOOK_INIT));

/// Stands in for VMX root's entry handler. Must not panic (it is called
/// from generated code).
extern "C" fn entry_hook(regs: *mut PtRegs, site: u64) -> u64 {
    let mut st = HOOK.get();
    st.entry_calls += 1;
    st.regs_ptr = regs as u64;
    // SAFETY: the trampoline passes a live pt_regs on this thread's stack.
    let regs = unsafe { &mut *regs };
    st.regs = *regs;
    st.site = site;
    let ret_slot = regs.sp as *mut u64;
    // SAFETY: pt_regs.sp is the traced function's entry RSP, which points at
    // its return address on this thread's stack.
    st.ret_at_sp = unsafe { ret_slot.read() };
    if st.hijack_with != 0 {
        st.hijacked_orig = st.ret_at_sp;
        // SAFETY: as above; this is the graph tracer's return hijack.
        unsafe { ret_slot.write(st.hijack_with) };
    }
    if let Some(edit) = st.edit {
        edit(regs);
    }
    HOOK.set(st);
    st.chain
}

/// Stands in for VMX root's return handler.
extern "C" fn return_hook(frame: *mut ReturnFrame, ax: u64, dx: u64) -> u64 {
    let mut st = HOOK.get();
    st.ret_calls += 1;
    st.frame_ptr = frame as u64;
    // SAFETY: the trampoline passes a live frame on this thread's stack.
    let frame = unsafe { &mut *frame };
    st.frame = *frame;
    st.ret_ax = ax;
    st.ret_dx = dx;
    if let Some(edit) = st.ret_edit {
        edit(frame);
    }
    // The original return address: saved by the entry hook's hijack, or
    // by the return victim, which hijacks itself.
    let to = if st.hijacked_orig != 0 {
        st.hijacked_orig
    } else {
        VICTIM_ORIG.get()
    };
    HOOK.set(st);
    to
}

// ---- The test rig ----

const FN_PLAIN: usize = 0x00;
const FN_ENDBR: usize = 0x40;
const FN_ALT: usize = 0x80;

struct Rig {
    map: *mut u8,
    region: TrampolineRegion,
}

impl Rig {
    fn new() -> Rig {
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let map = unsafe {
            mmap(
                core::ptr::null_mut(),
                3 * PAGE,
                PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map as isize, -1, "mmap failed");
        let map = map.cast::<u8>();
        let base = map as u64;
        let region = TrampolineRegion::build(
            Gva(base),
            HypercallMode::CallHook {
                entry_hook: entry_hook as *const () as u64,
                return_hook: return_hook as *const () as u64,
            },
        )
        .unwrap();

        let mut code = [0xccu8; PAGE];
        let funcs = base + PAGE as u64;
        let marker = base + 2 * PAGE as u64;
        // `mov byte [rip + marker], v ; ret` at `at`.
        let mut body = |at: usize, v: u8| {
            let end = funcs + at as u64 + 7;
            let disp = i32::try_from(marker as i64 - end as i64).unwrap();
            code[at] = 0xc6;
            code[at + 1] = 0x05;
            code[at + 2..at + 6].copy_from_slice(&disp.to_le_bytes());
            code[at + 6] = v;
            code[at + 7] = 0xc3;
        };
        body(FN_PLAIN + 5, 1);
        body(FN_ENDBR + 9, 1);
        body(FN_ALT, 2);
        code[FN_ENDBR..FN_ENDBR + 4].copy_from_slice(&ENDBR64);
        for f in [FN_PLAIN, FN_ENDBR] {
            let func = Gva(funcs + f as u64);
            let site = patch::fentry_site(func, &code[f..f + 4]);
            let off = (site.0 - funcs) as usize;
            assert_eq!(off, f + if f == FN_ENDBR { 4 } else { 0 });
            let call = region.site_patch(site).unwrap();
            assert_eq!(patch::decode_call_rel32(site, &call), Some(region.entry()));
            code[off..off + 5].copy_from_slice(&call);
        }

        // SAFETY: the mapping is 3 pages of RW memory owned by this rig.
        unsafe {
            core::ptr::copy_nonoverlapping(region.bytes().as_ptr(), map, PAGE);
            core::ptr::copy_nonoverlapping(code.as_ptr(), map.add(PAGE), PAGE);
        }
        // SAFETY: changes the protection of our own two code pages only.
        let rc = unsafe { mprotect(map.cast(), 2 * PAGE, PROT_READ | PROT_EXEC) };
        assert_eq!(rc, 0, "mprotect failed");
        Rig { map, region }
    }

    fn func(&self, f: usize) -> u64 {
        self.map as u64 + (PAGE + f) as u64
    }

    fn site(&self, f: usize) -> u64 {
        self.func(f) + if f == FN_ENDBR { 4 } else { 0 }
    }

    fn marker(&self) -> u8 {
        // SAFETY: the data page is mapped RW for the rig's lifetime.
        unsafe { self.map.add(2 * PAGE).read_volatile() }
    }

    fn clear_marker(&self) {
        // SAFETY: as for `marker`.
        unsafe { self.map.add(2 * PAGE).write_volatile(0) }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping this rig created; nothing else uses it.
        unsafe { munmap(self.map.cast(), 3 * PAGE) };
    }
}

// RFLAGS bits user mode can set and clear freely (status flags only: DF
// must stay clear for the Rust hook, TF/AC would trap).
const CF: u64 = 1 << 0;
const PF: u64 = 1 << 2;
const AF: u64 = 1 << 4;
const ZF: u64 = 1 << 6;
const SF: u64 = 1 << 7;
const OF: u64 = 1 << 11;
const IF: u64 = 1 << 9;
const FIXED1: u64 = 1 << 1;

/// Distinct, recognisable register values.
fn known_input(flags: u64) -> Gprs {
    let v = |i: u64| 0x5eed_0000_0000_0000 | (i << 40) | (i * 0x0101_0101);
    Gprs {
        rax: v(1),
        rbx: v(2),
        rcx: v(3),
        rdx: v(4),
        rsi: v(5),
        rdi: v(6),
        rbp: v(7),
        r8: v(8),
        r9: v(9),
        r10: v(10),
        r11: v(11),
        r12: v(12),
        r13: v(13),
        r14: v(14),
        r15: v(15),
        flags,
    }
}

fn gprs_of(r: &PtRegs) -> Gprs {
    Gprs {
        rax: r.ax,
        rbx: r.bx,
        rcx: r.cx,
        rdx: r.dx,
        rsi: r.si,
        rdi: r.di,
        rbp: r.bp,
        r8: r.r8,
        r9: r.r9,
        r10: r.r10,
        r11: r.r11,
        r12: r.r12,
        r13: r.r13,
        r14: r.r14,
        r15: r.r15,
        flags: r.flags,
    }
}

/// Calls `target` through the harness with `input` loaded.
fn run(target: u64, input: Gprs, pad: bool) -> Ctx {
    let mut ctx = Ctx {
        input,
        target,
        pad: pad as u64,
        ..Ctx::default()
    };
    // SAFETY: the harness saves and restores every callee-saved register and
    // RSP, calls `target` (generated code or one of the assembly helpers
    // above, which all return normally) and writes only into `ctx`. The
    // input flags are status flags only.
    unsafe { hvt_harness(&mut ctx) };
    assert_eq!(ctx.out_rsp, ctx.call_rsp, "stack not balanced");
    ctx
}

fn reset_hooks(f: impl FnOnce(&mut HookState)) {
    let mut st = HOOK_INIT;
    f(&mut st);
    HOOK.set(st);
    CHAIN_CAP.set(ChainCapture::default());
}

/// Checks every pt_regs field the entry hook saw against what the harness loaded.
fn check_pt_regs(rig: &Rig, f: usize, ctx: &Ctx) {
    let st = HOOK.get();
    let r = st.regs;
    let mut want = ctx.input;
    want.flags = ctx.in_flags;
    assert_eq!(gprs_of(&r), want, "GPRs and flags in pt_regs");
    assert_eq!(r.cs, KERNEL_CS);
    assert_eq!(r.ss, KERNEL_SS);
    assert_eq!(r.orig_ax, 0);
    assert_eq!(r.ip, rig.site(f) + 5, "ip = site + 5");
    assert_eq!(st.site, rig.site(f), "site argument");
    // The traced function's entry RSP: the harness's RSP before its call,
    // minus the return address that call pushed.
    assert_eq!(r.sp, ctx.call_rsp - 8, "sp = the function's entry RSP");
    // pt_regs sits directly below the site call's return slot.
    assert_eq!(st.regs_ptr, r.sp - 8 - size_of::<PtRegs>() as u64);
    assert_eq!(
        st.regs.sp,
        st.regs_ptr + trampolines::abi::ENTRY_SP_FROM_FRAME
    );
    // [sp] is the traced function's return address: back into the harness.
    let h = hvt_harness as *const () as u64;
    assert!(
        st.ret_at_sp > h && st.ret_at_sp < h + 0x400,
        "[sp] is the return address"
    );
}

const IN_FLAGS: u64 = FIXED1 | IF | CF | ZF | OF | AF;

#[test]
fn entry_saves_complete_pt_regs_and_continues_past_nop5() {
    let _g = lock();
    let rig = Rig::new();
    for f in [FN_PLAIN, FN_ENDBR] {
        for pad in [false, true] {
            reset_hooks(|_| {});
            rig.clear_marker();
            let ctx = run(rig.func(f), known_input(IN_FLAGS), pad);
            assert_eq!(ctx.in_flags & (CF | ZF | OF | AF), CF | ZF | OF | AF);
            assert_eq!(HOOK.get().entry_calls, 1);
            check_pt_regs(&rig, f, &ctx);
            // The traced function's body ran, with every register intact.
            assert_eq!(rig.marker(), 1);
            let mut want = ctx.input;
            want.flags = ctx.in_flags;
            assert_eq!(ctx.output, want);
            assert_eq!(CHAIN_CAP.get().hits, 0);
        }
    }
}

#[test]
fn entry_flags_with_other_values() {
    let _g = lock();
    let rig = Rig::new();
    for flags in [
        FIXED1 | IF,
        FIXED1 | IF | PF | SF,
        FIXED1 | IF | CF | PF | AF | ZF | SF | OF,
    ] {
        reset_hooks(|_| {});
        let ctx = run(rig.func(FN_PLAIN), known_input(flags), false);
        assert_eq!(ctx.in_flags & 0x8d5, flags & 0x8d5);
        check_pt_regs(&rig, FN_PLAIN, &ctx);
        assert_eq!(ctx.output.flags, ctx.in_flags);
    }
}

fn edit_all(r: &mut PtRegs) {
    let x = 0x00ff_00ff_00ff_00ff;
    r.ax ^= x;
    r.bx ^= x;
    r.cx ^= x;
    r.dx ^= x;
    r.si ^= x;
    r.di ^= x;
    r.bp ^= x;
    r.r8 ^= x;
    r.r9 ^= x;
    r.r10 ^= x;
    r.r11 ^= x;
    r.r12 ^= x;
    r.r13 ^= x;
    r.r14 ^= x;
    r.r15 ^= x;
    r.flags ^= CF | PF | ZF | SF;
}

fn edited(ctx: &Ctx) -> Gprs {
    let mut r = PtRegs {
        ax: ctx.input.rax,
        bx: ctx.input.rbx,
        cx: ctx.input.rcx,
        dx: ctx.input.rdx,
        si: ctx.input.rsi,
        di: ctx.input.rdi,
        bp: ctx.input.rbp,
        r8: ctx.input.r8,
        r9: ctx.input.r9,
        r10: ctx.input.r10,
        r11: ctx.input.r11,
        r12: ctx.input.r12,
        r13: ctx.input.r13,
        r14: ctx.input.r14,
        r15: ctx.input.r15,
        flags: ctx.in_flags,
        ..PtRegs::default()
    };
    edit_all(&mut r);
    gprs_of(&r)
}

#[test]
fn entry_honours_written_back_gprs_and_flags() {
    let _g = lock();
    let rig = Rig::new();
    for pad in [false, true] {
        reset_hooks(|s| s.edit = Some(edit_all));
        rig.clear_marker();
        let ctx = run(rig.func(FN_PLAIN), known_input(IN_FLAGS), pad);
        check_pt_regs(&rig, FN_PLAIN, &ctx);
        assert_eq!(rig.marker(), 1);
        let want = edited(&ctx);
        assert_ne!(want.flags, ctx.in_flags);
        assert_eq!(ctx.output, want);
    }
}

static ALT_IP: Shared<u64> = Shared(UnsafeCell::new(0));

fn edit_ip(r: &mut PtRegs) {
    r.ip = ALT_IP.get();
}

fn edit_ignored_fields(r: &mut PtRegs) {
    r.sp = 0x1234;
    r.cs = 0x33;
    r.ss = 0x2b;
    r.orig_ax = 0xdead;
}

#[test]
fn entry_honours_written_back_ip() {
    let _g = lock();
    let rig = Rig::new();
    ALT_IP.set(rig.func(FN_ALT));
    for f in [FN_PLAIN, FN_ENDBR] {
        reset_hooks(|s| s.edit = Some(edit_ip));
        rig.clear_marker();
        let ctx = run(rig.func(f), known_input(IN_FLAGS), false);
        check_pt_regs(&rig, f, &ctx);
        // Execution continued at the new ip (with the function's entry RSP,
        // so its `ret` went back to the harness).
        assert_eq!(rig.marker(), 2);
        let mut want = ctx.input;
        want.flags = ctx.in_flags;
        assert_eq!(ctx.output, want);
    }
}

#[test]
fn entry_ignores_sp_cs_ss_orig_ax_writes() {
    let _g = lock();
    let rig = Rig::new();
    reset_hooks(|s| s.edit = Some(edit_ignored_fields));
    rig.clear_marker();
    let ctx = run(rig.func(FN_PLAIN), known_input(IN_FLAGS), false);
    assert_eq!(rig.marker(), 1);
    let mut want = ctx.input;
    want.flags = ctx.in_flags;
    assert_eq!(ctx.output, want);
}

fn chain_target() -> u64 {
    hvt_chain_target as *const () as u64
}

#[test]
fn entry_chains_into_the_guests_own_call_target() {
    let _g = lock();
    let rig = Rig::new();
    for f in [FN_PLAIN, FN_ENDBR] {
        for pad in [false, true] {
            reset_hooks(|s| s.chain = chain_target());
            rig.clear_marker();
            let ctx = run(rig.func(f), known_input(IN_FLAGS), pad);
            check_pt_regs(&rig, f, &ctx);
            let cap = CHAIN_CAP.get();
            assert_eq!(cap.hits, 1);
            // The target runs as if called from the site: RSP = the
            // function's entry RSP - 8, [RSP] = site + 5, every register and
            // flag as the traced function had them.
            assert_eq!(cap.rsp, ctx.call_rsp - 16);
            assert_eq!(cap.ret, rig.site(f) + 5);
            let mut want = ctx.input;
            want.flags = ctx.in_flags;
            assert_eq!(cap.regs, want);
            // Then the traced function ran and returned normally.
            assert_eq!(rig.marker(), 1);
            assert_eq!(ctx.output, want);
        }
    }
}

#[test]
fn entry_chain_sees_written_back_state() {
    let _g = lock();
    let rig = Rig::new();
    reset_hooks(|s| {
        s.chain = chain_target();
        s.edit = Some(edit_all);
    });
    rig.clear_marker();
    let ctx = run(rig.func(FN_PLAIN), known_input(IN_FLAGS), false);
    let cap = CHAIN_CAP.get();
    let want = edited(&ctx);
    assert_eq!(cap.hits, 1);
    assert_eq!(cap.regs, want);
    assert_eq!(cap.ret, rig.site(FN_PLAIN) + 5);
    assert_eq!(rig.marker(), 1);
    assert_eq!(ctx.output, want);
}

#[test]
fn entry_chain_with_new_ip_returns_to_new_ip() {
    let _g = lock();
    let rig = Rig::new();
    ALT_IP.set(rig.func(FN_ALT));
    reset_hooks(|s| {
        s.chain = chain_target();
        s.edit = Some(edit_ip);
    });
    rig.clear_marker();
    let ctx = run(rig.func(FN_PLAIN), known_input(IN_FLAGS), false);
    let cap = CHAIN_CAP.get();
    assert_eq!(cap.hits, 1);
    assert_eq!(cap.rsp, ctx.call_rsp - 16);
    assert_eq!(cap.ret, rig.func(FN_ALT));
    assert_eq!(rig.marker(), 2);
}

#[test]
fn many_hits_keep_the_stack_balanced() {
    let _g = lock();
    let rig = Rig::new();
    reset_hooks(|_| {});
    for i in 0..1000u64 {
        let mut input = known_input(IN_FLAGS);
        input.rdi = i;
        let ctx = run(rig.func(FN_PLAIN), input, i % 2 == 1);
        assert_eq!(ctx.output.rdi, i);
    }
    assert_eq!(HOOK.get().entry_calls, 1000);
}

/// Callee-saved registers (System V) the return trampoline must keep.
fn callee_saved(g: &Gprs) -> [u64; 6] {
    [g.rbx, g.rbp, g.r12, g.r13, g.r14, g.r15]
}

#[test]
fn return_trampoline_resumes_at_original_address() {
    let _g = lock();
    let rig = Rig::new();
    VICTIM_HIJACK.set(rig.region.return_trampoline().0);
    for pad in [false, true] {
        reset_hooks(|_| {});
        VICTIM_ORIG.set(0);
        let input = known_input(IN_FLAGS);
        let ctx = run(hvt_ret_victim as *const () as u64, input, pad);
        let st = HOOK.get();
        assert_eq!(st.entry_calls, 0);
        assert_eq!(st.ret_calls, 1);
        // The hook gets the frame whose `ret` is the hijacked slot.
        let retp = VICTIM_RETP.get();
        assert_eq!(retp, ctx.call_rsp - 8);
        assert_eq!(
            st.frame_ptr + trampolines::abi::RETURN_FRAME_RETP as u64,
            retp
        );
        assert_eq!(st.frame.ret, rig.region.return_trampoline().0);
        assert_eq!((st.frame.ax, st.frame.dx), (input.rax, input.rdx));
        assert_eq!((st.ret_ax, st.ret_dx), (input.rax, input.rdx));
        // Back in the harness (the stack check in `run`), return value intact.
        assert_eq!((ctx.output.rax, ctx.output.rdx), (input.rax, input.rdx));
        assert_eq!(callee_saved(&ctx.output), callee_saved(&input));
    }
}

fn edit_retval(f: &mut ReturnFrame) {
    f.ax = 0xfeed_face;
    f.dx = 0xcafe_d00d;
}

#[test]
fn return_trampoline_honours_written_back_return_value() {
    let _g = lock();
    let rig = Rig::new();
    VICTIM_HIJACK.set(rig.region.return_trampoline().0);
    reset_hooks(|s| s.ret_edit = Some(edit_retval));
    let input = known_input(IN_FLAGS);
    let ctx = run(hvt_ret_victim as *const () as u64, input, false);
    let st = HOOK.get();
    assert_eq!(st.ret_calls, 1);
    assert_eq!((st.ret_ax, st.ret_dx), (input.rax, input.rdx));
    assert_eq!((ctx.output.rax, ctx.output.rdx), (0xfeed_face, 0xcafe_d00d));
    assert_eq!(callee_saved(&ctx.output), callee_saved(&input));
}

#[test]
fn entry_hijack_then_return_trampoline_round_trip() {
    // The function-graph flow end to end: the entry handler replaces the
    // traced function's return address with the return trampoline; the
    // function runs and returns into it; the return handler gives back the
    // original; the caller sees the function's return value.
    let _g = lock();
    let rig = Rig::new();
    for pad in [false, true] {
        reset_hooks(|s| s.hijack_with = rig.region.return_trampoline().0);
        rig.clear_marker();
        let input = known_input(IN_FLAGS);
        let ctx = run(rig.func(FN_PLAIN), input, pad);
        let st = HOOK.get();
        assert_eq!((st.entry_calls, st.ret_calls), (1, 1));
        assert_eq!(rig.marker(), 1);
        // retp is pt_regs.sp: the frame's return slot.
        assert_eq!(
            st.frame_ptr + trampolines::abi::RETURN_FRAME_RETP as u64,
            st.regs.sp
        );
        assert_eq!(st.frame.ret, rig.region.return_trampoline().0);
        assert_eq!((st.ret_ax, st.ret_dx), (input.rax, input.rdx));
        assert_eq!((ctx.output.rax, ctx.output.rdx), (input.rax, input.rdx));
        assert_eq!(callee_saved(&ctx.output), callee_saved(&input));
    }
}

#[test]
fn hook_mode_differs_from_vmcall_mode_only_in_the_hypercall() {
    // What runs natively here is the VMCALL code with the VMCALL swapped:
    // every other byte of both trampolines is identical.
    let _g = lock();
    let base = Gva(0xffff_ffff_a000_0000);
    let vm = TrampolineRegion::build(base, HypercallMode::Vmcall).unwrap();
    let hk = TrampolineRegion::build(
        base,
        HypercallMode::CallHook {
            entry_hook: 1,
            return_hook: 2,
        },
    )
    .unwrap();
    let seq_len = hk.entry_len() - vm.entry_len() + 3;
    assert_eq!(hk.return_len() - vm.return_len() + 3, seq_len);
    for (start, vm_len, hk_len, vmcall) in [
        (
            ENTRY_OFFSET,
            vm.entry_len(),
            hk.entry_len(),
            vm.entry_vmcall(),
        ),
        (
            RETURN_OFFSET,
            vm.return_len(),
            hk.return_len(),
            vm.return_vmcall(),
        ),
    ] {
        let at = (vmcall.unwrap().0 - base.0) as usize;
        let (v, h) = (vm.bytes(), hk.bytes());
        assert_eq!(v[start..at], h[start..at]);
        assert_eq!(v[at + 3..start + vm_len], h[at + seq_len..start + hk_len]);
    }
}
