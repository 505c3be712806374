//! Who a #DB belongs to when root single-steps the guest (SDM 18.2.3 "Debug
//! status register", 28.2.1 exit qualification for debug exceptions).
//!
//! Root steps one guest instruction with RFLAGS.TF and #DB intercepted
//! (Bochs 2.7 has no working monitor trap flag). The #DB that ends the step
//! may carry the guest's own debug events as well: a hardware breakpoint
//! (B0-B3) or a general-detect (BD) hit by the stepped instruction, or the
//! guest's own single-step when it had TF set itself (a debugger, or a
//! kprobe stepping an instruction). Those must reach the guest; only root's
//! single-step is swallowed. An INT1 (ICEBP) is a privileged software
//! exception and goes back as one.

/// DR6 / exit qualification: breakpoint conditions B0-B3.
pub const DR6_B0_B3: u64 = 0xf;
/// General detect (a debug-register access with DR7.GD set).
pub const DR6_BD: u64 = 1 << 13;
/// Single step.
pub const DR6_BS: u64 = 1 << 14;
/// RTM region.
pub const DR6_RTM: u64 = 1 << 16;

/// Pending-debug-exceptions field: BS (bit 14), kept stale by Bochs 2.7.
pub const PENDING_BS: u64 = 1 << 14;

/// RFLAGS.IF.
pub const RFLAGS_IF: u64 = 1 << 9;

/// Whether root's single step, armed with the guest's RFLAGS `rflags`,
/// takes external-interrupt exits. They are there so that an interrupt
/// the guest would take before the stepped instruction ends the step
/// instead of running its handler with the step's pages open. With IF
/// clear the guest takes none, and the exits would do harm: they come for
/// interrupts the guest has masked too, which stay pending, so every new
/// step of the same instruction would end at once, and the guest would
/// never get past it.
pub fn step_interrupt_exits(rflags: u64) -> bool {
    rflags & RFLAGS_IF != 0
}

/// What root does with one intercepted #DB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebugAction {
    /// End root's step (put its pages back).
    pub end_step: bool,
    /// RFLAGS.TF to leave in the guest, when root decides it.
    pub tf: Option<bool>,
    /// Deliver a #DB to the guest with these DR6 condition bits.
    pub reflect: Option<u64>,
    /// Deliver it as INT1 (privileged software exception) rather than as a
    /// hardware exception.
    pub as_int1: bool,
}

/// Decides an intercepted #DB.
///
/// - `qual`: the exit qualification (DR6-like condition bits);
/// - `int1`: the exit's interruption type says privileged software
///   exception (the guest executed INT1);
/// - `stepping`: root has a step in flight; `guest_tf`: the guest had TF
///   set itself when that step began;
/// - `stray_tf`: a step of root's was ended without its #DB, so the TF now
///   in RFLAGS may be root's.
pub fn decide(
    qual: u64,
    int1: bool,
    stepping: bool,
    guest_tf: bool,
    stray_tf: bool,
) -> DebugAction {
    let guest_bits = qual & (DR6_B0_B3 | DR6_BD | DR6_RTM);
    if int1 {
        // INT1 is not a single-step of ours even mid-step (an instruction
        // that raises an exception never completes the step), but the
        // step's pages must still close: the handler may run long.
        return DebugAction {
            end_step: stepping,
            tf: stepping.then_some(guest_tf),
            reflect: Some(guest_bits),
            as_int1: true,
        };
    }
    if stepping {
        let guest_step = if guest_tf { qual & DR6_BS } else { 0 };
        let reflect = guest_bits | guest_step;
        return DebugAction {
            end_step: true,
            tf: Some(guest_tf),
            reflect: (reflect != 0).then_some(reflect),
            as_int1: false,
        };
    }
    if stray_tf && qual & DR6_BS != 0 {
        // Root's leftover TF trapped: clear it; pass on anything else.
        return DebugAction {
            end_step: false,
            tf: Some(false),
            reflect: (guest_bits != 0).then_some(guest_bits),
            as_int1: false,
        };
    }
    DebugAction {
        end_step: false,
        tf: None,
        reflect: Some(qual & (DR6_B0_B3 | DR6_BD | DR6_BS | DR6_RTM)),
        as_int1: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the fuzzing guest on two vCPUs with hooks under fire
    /// (seed 404): a vCPU reading a hooked page with IF clear while
    /// another vCPU's fixed IPI waited in its APIC never got past the read
    /// (each step ended at once on the interrupt exit), until the step
    /// was ended by force and root's TF later trapped in the guest.
    #[test]
    fn a_step_with_interrupts_masked_takes_no_interrupt_exits() {
        assert!(!step_interrupt_exits(0x2));
        assert!(!step_interrupt_exits(0x2 | 1 << 8));
        assert!(step_interrupt_exits(0x2 | RFLAGS_IF));
    }

    #[test]
    fn roots_own_step_is_swallowed() {
        let a = decide(DR6_BS, false, true, false, false);
        assert_eq!(
            a,
            DebugAction {
                end_step: true,
                tf: Some(false),
                reflect: None,
                as_int1: false
            }
        );
    }

    #[test]
    fn a_guest_breakpoint_during_the_step_reaches_the_guest() {
        // The stepped instruction hit DR1's data breakpoint.
        let a = decide(DR6_BS | 0b10, false, true, false, false);
        assert!(a.end_step);
        assert_eq!(a.reflect, Some(0b10));
        assert_eq!(a.tf, Some(false));
        // A general-detect too.
        assert_eq!(
            decide(DR6_BS | DR6_BD, false, true, false, false).reflect,
            Some(DR6_BD)
        );
    }

    #[test]
    fn the_guests_own_single_step_is_kept() {
        // The guest was single-stepping (TF set before root's step): its
        // #DB is delivered with BS, and its TF stays.
        let a = decide(DR6_BS, false, true, true, false);
        assert_eq!(a.reflect, Some(DR6_BS));
        assert_eq!(a.tf, Some(true));
        let a = decide(DR6_BS | 1, false, true, true, false);
        assert_eq!(a.reflect, Some(DR6_BS | 1));
    }

    #[test]
    fn int1_goes_back_as_int1() {
        let a = decide(0, true, false, false, false);
        assert!(a.as_int1);
        assert_eq!(a.reflect, Some(0));
        assert!(!a.end_step);
        let a = decide(0, true, true, true, false);
        assert!(a.as_int1 && a.end_step);
        assert_eq!(a.tf, Some(true));
    }

    #[test]
    fn a_stray_tf_is_cleared_without_losing_breakpoints() {
        let a = decide(DR6_BS, false, false, false, true);
        assert_eq!((a.tf, a.reflect), (Some(false), None));
        let a = decide(DR6_BS | 0b100, false, false, false, true);
        assert_eq!((a.tf, a.reflect), (Some(false), Some(0b100)));
    }

    #[test]
    fn everything_else_is_the_guests() {
        let a = decide(DR6_BS | 1, false, false, false, false);
        assert_eq!(a.reflect, Some(DR6_BS | 1));
        assert_eq!(a.tf, None);
        assert!(!a.end_step);
    }
}
