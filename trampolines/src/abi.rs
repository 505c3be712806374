//! The hypercall ABI between the trampolines and VMX root.
//!
//! Two hypercalls exist, each issued by exactly one `VMCALL` instruction in
//! the trampoline region. VMX root identifies a hypercall by **both** the
//! guest RIP of the VMCALL ([`TrampolineRegion::hypercall_at`]) and the
//! number in RAX; a VMCALL anywhere else, or with the wrong number, is not
//! ours and gets #UD as on a CPU without VMX. After handling, VMX root
//! resumes the guest at the instruction after the VMCALL (RIP + 3, the
//! exit's instruction length).
//!
//! # Entry hypercall ([`HYPERCALL_ENTRY`])
//!
//! Issued by the entry trampoline after a hooked fentry site called it.
//!
//! | register | at the VMCALL |
//! |---|---|
//! | RAX | [`HYPERCALL_ENTRY`] |
//! | RDI | guest-virtual address of a complete [`PtRegs`] (equal to RSP) |
//! | RSI | the fentry site (the `call` instruction's address = `pt_regs.ip - 5`) |
//! | RBX, RCX, RDX, RBP, R8-R15 | still the traced function's values, equal to those saved in `pt_regs` |
//!
//! The `pt_regs` is filled as Linux's `ftrace_regs_caller`
//! (arch/x86/kernel/ftrace_64.S) fills it: every GPR, `flags` from `pushfq`
//! at trampoline entry, `cs` = 0x10, `ss` = 0x18, `sp` = the traced
//! function's entry RSP (the address of its return address), `ip` = site + 5,
//! `orig_ax` = 0.
//!
//! On return from the VMCALL:
//!
//! | register | meaning |
//! |---|---|
//! | RAX | the **chain target**: 0 to continue at `pt_regs.ip`, or the guest-virtual address of the guest's own `call` target at this site |
//! | RSP | must be unchanged |
//! | all others | ignored: the trampoline reloads every GPR from `pt_regs` |
//!
//! What VMX root may write in guest memory: any GPR field of `pt_regs`,
//! `ip` and `flags`; all of these take effect. Writes to `orig_ax`, `cs`,
//! `sp` and `ss` are ignored (as in `ftrace_regs_caller`, which honours
//! neither). Nothing else on the guest stack may be written.
//!
//! Continuing:
//! - **RAX = 0** (the guest's own instruction at the site is the NOP5): all
//!   GPRs and `flags` are restored from `pt_regs` and execution continues at
//!   `pt_regs.ip` with RSP = `pt_regs.sp` as captured, exactly as if the site
//!   had executed its NOP5 and then jumped to `ip`.
//! - **RAX = target** (the guest turned the site into `call target`, its own
//!   ftrace or a direct trampoline): the trampoline restores everything the
//!   same way and then enters `target` as the guest's own `call` would have:
//!   RSP = the traced function's entry RSP - 8 and `[RSP]` = `pt_regs.ip`
//!   (site + 5 unless VMX root changed `ip`). When `target` returns, the
//!   traced function runs. VMX root that redirects `ip` should normally
//!   return 0, because the guest's tracer would see the call as coming from
//!   the new `ip`.
//!
//! # Return hypercall ([`HYPERCALL_RETURN`])
//!
//! Issued by the return trampoline, which a traced function reached by
//! `ret` because VMX root replaced its return address (the function-graph
//! hijack). The trampoline builds a [`ReturnFrame`] whose `ret` field **is**
//! the hijacked return slot (`retp`, where the return address was).
//!
//! | register | at the VMCALL |
//! |---|---|
//! | RAX | [`HYPERCALL_RETURN`] |
//! | RDI | guest-virtual address of the [`ReturnFrame`]; `retp` = RDI + [`RETURN_FRAME_RETP`] |
//! | RSI | the function's return value (its RAX, also in `frame.ax`) |
//! | RDX | the function's RDX (also in `frame.dx`) |
//! | RBX, RBP, R12-R15 | the function's values (the caller's callee-saved registers) |
//!
//! On return from the VMCALL, RAX must hold the original return address;
//! the trampoline stores it into the return slot, reloads RAX and RDX from
//! the frame (so VMX root may override the return value by writing
//! `frame.ax`/`frame.dx`) and returns there with RSP = `retp` + 8, as the
//! function's own `ret` would have. RSP, RBX, RBP and R12-R15 must be
//! unchanged. The trampoline itself clobbers RDI and RSI (caller-saved, dead
//! at a function return under the System V ABI, as Linux's own
//! `return_to_handler` assumes).
//!
//! # Stacks
//!
//! The traced kernel is built with `-mno-red-zone`, so nothing below RSP is
//! live and the trampolines may push freely; they never read or write below
//! RSP, so an interrupt or NMI arriving at any instruction finds a
//! consistent stack. The kernel aligns its stack to 8 bytes only
//! (`-mpreferred-stack-boundary=3`, arch/x86/Makefile); the entry trampoline
//! enters a chained target with exactly the RSP a direct call from the site
//! would have produced, so alignment is whatever the guest's own call gives.
//!
//! [`TrampolineRegion::hypercall_at`]: crate::TrampolineRegion::hypercall_at
//! [`PtRegs`]: crate::PtRegs

use core::mem::{offset_of, size_of};

/// RAX at the entry trampoline's VMCALL: ASCII "HVT" and call number 1.
pub const HYPERCALL_ENTRY: u32 = 0x4856_5401;
/// RAX at the return trampoline's VMCALL: ASCII "HVT" and call number 2.
pub const HYPERCALL_RETURN: u32 = 0x4856_5402;

/// Which of our hypercalls a VMCALL is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hypercall {
    /// A hooked fentry site was hit: RDI points at a `pt_regs`.
    Entry,
    /// A hijacked function returned: RDI points at a [`ReturnFrame`].
    Return,
}

impl Hypercall {
    /// The number the trampoline puts in RAX.
    pub const fn number(self) -> u32 {
        match self {
            Hypercall::Entry => HYPERCALL_ENTRY,
            Hypercall::Return => HYPERCALL_RETURN,
        }
    }

    /// The hypercall with number `rax` (all 64 bits compared), if any.
    pub const fn from_number(rax: u64) -> Option<Self> {
        if rax == HYPERCALL_ENTRY as u64 {
            Some(Hypercall::Entry)
        } else if rax == HYPERCALL_RETURN as u64 {
            Some(Hypercall::Return)
        } else {
            None
        }
    }
}

/// Length of the trampolines' `VMCALL` (0F 01 C1, no prefix): VMX root
/// resumes a served hypercall at its address plus this.
pub const VMCALL_LEN: u64 = 3;

/// `pt_regs.sp` at an entry hypercall, from the frame's address (RDI =
/// RSP): the frame sits right below the site call's return slot, and `sp`
/// is the traced function's entry RSP just above that slot. VMX root may
/// take it from here rather than read it off the stack.
pub const ENTRY_SP_FROM_FRAME: u64 = crate::ptregs::PT_REGS_SIZE as u64 + 8;

/// What the return trampoline saves on the guest stack.
///
/// ```text
///   retp + 8  -> caller's stack (RSP at return-trampoline entry)
///   retp      -> ret   the hijacked return slot; the original return
///                      address is stored here before the final `ret`
///   retp - 8  -> dx    the function's RDX
///   retp - 16 -> ax    the function's RAX          <- RDI at the VMCALL
/// ```
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReturnFrame {
    /// The function's RAX (return value); reloaded after the VMCALL.
    pub ax: u64,
    /// The function's RDX (second return register); reloaded after the VMCALL.
    pub dx: u64,
    /// The return slot (`retp`). At the VMCALL it still holds the hijacked
    /// value (the return trampoline's address).
    pub ret: u64,
}

/// Offset of the return slot in [`ReturnFrame`]: `retp` = frame + this.
pub const RETURN_FRAME_RETP: usize = offset_of!(ReturnFrame, ret);

const _: () = assert!(offset_of!(ReturnFrame, ax) == 0);
const _: () = assert!(offset_of!(ReturnFrame, dx) == 8);
const _: () = assert!(offset_of!(ReturnFrame, ret) == 16);
// The return slot must be the frame's last word: the frame sits directly
// below the caller's stack.
const _: () = assert!(RETURN_FRAME_RETP + 8 == size_of::<ReturnFrame>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_round_trip() {
        for h in [Hypercall::Entry, Hypercall::Return] {
            assert_eq!(Hypercall::from_number(h.number() as u64), Some(h));
        }
        assert_eq!(Hypercall::from_number(0), None);
        // The upper half must be clear too.
        assert_eq!(
            Hypercall::from_number((1 << 32) | HYPERCALL_ENTRY as u64),
            None
        );
    }
}
