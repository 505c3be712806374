//! Control-register exits decided and performed: MOV to and from CR0, CR3,
//! CR4 and CR8, CLTS and LMSW (SDM 27.1.3 and Table 28-3). The rules for a
//! value are [`crate::policy`]'s ([`policy::cr0_write`],
//! [`policy::cr4_write`]); [`cr_access`] reads and writes the guest's
//! registers through [`CrRegs`], which root implements over the VMCS and
//! the host tests in memory.

use super::exit::CrAccess;
use super::handle::{GP, UD};
use super::regs::GuestRegs;
use crate::policy::{self, CrWrite};
use protocol::GuardReport;
use x86::vmx::vmcs::control::EntryControls;

/// The CR0 bits LMSW loads (PE, MP, EM, TS).
const LMSW_BITS: u64 = policy::CR0_PE | policy::CR0_MP | policy::CR0_EM | policy::CR0_TS;
/// The CR0 bits LMSW may clear (MP, EM, TS): it cannot clear PE.
const LMSW_CLEARS: u64 = LMSW_BITS & !policy::CR0_PE;
/// CR8 (the task-priority register) has bits 3:0 only.
const CR8_RESERVED: u64 = !0xf;

/// A guest register a control-register exit reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrReg {
    /// GUEST_CR0: the value the CPU runs with.
    Cr0,
    /// CR0_READ_SHADOW: what the guest reads.
    Cr0Shadow,
    /// GUEST_CR3.
    Cr3,
    /// GUEST_CR4.
    Cr4,
    /// CR4_READ_SHADOW.
    Cr4Shadow,
    /// GUEST_IA32_EFER.
    Efer,
    /// The VM-entry controls (their IA-32e mode guest bit follows EFER.LMA).
    EntryControls,
    /// The task-priority register (the guest's, with no TPR shadow).
    Cr8,
    /// GUEST_RSP (register 4 of an operand).
    Rsp,
    /// GUEST_CS_ACCESS_RIGHTS (bit 13 is CS.L: 64-bit code). Read only.
    CsAccessRights,
    /// CR0.CD and CR0.NW of the CPU itself. VM entry and exit leave these
    /// two bits alone (SDM 28.3.2.1, 29.5.1), so root and the guest share
    /// them: a guest write that exits changes them here, not in GUEST_CR0.
    /// Write only.
    CacheControl,
}

/// CS.L in the access rights: the code runs in 64-bit mode.
const CS_L: u64 = 1 << 13;

/// CR0.CD | CR0.NW: the bits VM entries and exits do not load.
const CACHE_BITS: u64 = policy::CR0_CD | policy::CR0_NW;

/// The guest's registers as [`cr_access`] reaches them.
pub trait CrRegs {
    /// Why an access failed (root's VMCS access error).
    type Error;
    /// Reads `reg`.
    fn get(&mut self, reg: CrReg) -> Result<u64, Self::Error>;
    /// Writes `reg`.
    fn set(&mut self, reg: CrReg, value: u64) -> Result<(), Self::Error>;
}

/// The fixed-bit MSRs' values: (fixed-0, fixed-1) of CR0 and of CR4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedCr {
    /// IA32_VMX_CR0_FIXED0 and IA32_VMX_CR0_FIXED1.
    pub cr0: (u64, u64),
    /// IA32_VMX_CR4_FIXED0 and IA32_VMX_CR4_FIXED1.
    pub cr4: (u64, u64),
}

/// What the exit loop does after [`cr_access`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrOutcome {
    /// Done: skip the instruction.
    Advance,
    /// Inject this exception (vector, error code) at the instruction.
    Inject(u8, Option<u32>),
}

/// The general-purpose register `n` of an operand (ModRM numbering), or
/// `None` for RSP (4), which lives in the VMCS.
pub fn gpr(regs: &mut GuestRegs, n: u8) -> Option<&mut u64> {
    Some(match n {
        0 => &mut regs.rax,
        1 => &mut regs.rcx,
        2 => &mut regs.rdx,
        3 => &mut regs.rbx,
        5 => &mut regs.rbp,
        6 => &mut regs.rsi,
        7 => &mut regs.rdi,
        8 => &mut regs.r8,
        9 => &mut regs.r9,
        10 => &mut regs.r10,
        11 => &mut regs.r11,
        12 => &mut regs.r12,
        13 => &mut regs.r13,
        14 => &mut regs.r14,
        15 => &mut regs.r15,
        _ => return None,
    })
}

/// CR4 as the guest has it: its read shadow for the bits root owns (the
/// guest/host mask), the real register for the rest, which the guest
/// changes without an exit (PAE, PGE, ...).
fn effective_cr4<C: CrRegs>(cpu: &mut C, fixed: FixedCr) -> Result<u64, C::Error> {
    let mask = policy::cr4_guest_host_mask(fixed.cr4.0);
    Ok((cpu.get(CrReg::Cr4)? & !mask) | (cpu.get(CrReg::Cr4Shadow)? & mask))
}

/// Decides and performs the control-register exit `access`; a value the
/// CPU would refuse is a #GP(0) counted in `guard.cr_writes_refused`.
pub fn cr_access<C: CrRegs>(
    access: CrAccess,
    regs: &mut GuestRegs,
    cpu: &mut C,
    fixed: FixedCr,
    guard: &mut GuardReport,
) -> Result<CrOutcome, C::Error> {
    let gp = CrOutcome::Inject(GP, Some(0));
    let ud = CrOutcome::Inject(UD, None);
    let mut refuse = || {
        guard.cr_writes_refused += 1;
        gp
    };
    match access {
        CrAccess::MovTo { cr, gpr: g } => {
            let value = match gpr(regs, g) {
                Some(r) => *r,
                None => cpu.get(CrReg::Rsp)?,
            };
            match cr {
                0 => {
                    let cr4 = effective_cr4(cpu, fixed)?;
                    let efer = cpu.get(CrReg::Efer)?;
                    // CS only matters to a write that clears PG.
                    let cs_long =
                        value & policy::CR0_PG == 0 && cpu.get(CrReg::CsAccessRights)? & CS_L != 0;
                    if policy::cr0_clears_paging_in_64bit(value, cr4, cs_long) {
                        return Ok(refuse());
                    }
                    match policy::cr0_write(value, fixed.cr0.0, fixed.cr0.1, cr4, efer) {
                        CrWrite::Load { actual, shadow } => {
                            let old = cpu.get(CrReg::Cr0)?;
                            cpu.set(CrReg::Cr0, actual)?;
                            cpu.set(CrReg::Cr0Shadow, shadow)?;
                            if (old ^ actual) & CACHE_BITS != 0 {
                                cpu.set(CrReg::CacheControl, actual & CACHE_BITS)?;
                            }
                            if (old ^ actual) & policy::CR0_PG != 0 {
                                paging_changed(cpu, efer, actual)?;
                            }
                            Ok(CrOutcome::Advance)
                        }
                        CrWrite::Fault => Ok(refuse()),
                    }
                }
                4 => {
                    let old = cpu.get(CrReg::Cr4Shadow)?;
                    let lma = cpu.get(CrReg::Efer)? & policy::EFER_LMA != 0;
                    match policy::cr4_write(value, old, fixed.cr4.0, fixed.cr4.1, lma) {
                        CrWrite::Load { actual, shadow } => {
                            cpu.set(CrReg::Cr4, actual)?;
                            cpu.set(CrReg::Cr4Shadow, shadow)?;
                            Ok(CrOutcome::Advance)
                        }
                        CrWrite::Fault => Ok(refuse()),
                    }
                }
                3 => {
                    cpu.set(CrReg::Cr3, value)?;
                    Ok(CrOutcome::Advance)
                }
                // Reserved bits of the TPR: the CPU's own #GP, not a
                // refusal of root's.
                8 if value & CR8_RESERVED != 0 => Ok(gp),
                8 => {
                    cpu.set(CrReg::Cr8, value)?;
                    Ok(CrOutcome::Advance)
                }
                _ => Ok(ud),
            }
        }
        CrAccess::MovFrom { cr, gpr: g } => {
            let value = match cr {
                0 => cpu.get(CrReg::Cr0Shadow)?,
                3 => cpu.get(CrReg::Cr3)?,
                4 => effective_cr4(cpu, fixed)?,
                8 => cpu.get(CrReg::Cr8)?,
                _ => return Ok(ud),
            };
            match gpr(regs, g) {
                Some(r) => *r = value,
                None => cpu.set(CrReg::Rsp, value)?,
            }
            Ok(CrOutcome::Advance)
        }
        CrAccess::Clts => {
            let c = cpu.get(CrReg::Cr0)?;
            cpu.set(CrReg::Cr0, c & !policy::CR0_TS)?;
            let s = cpu.get(CrReg::Cr0Shadow)?;
            cpu.set(CrReg::Cr0Shadow, s & !policy::CR0_TS)?;
            Ok(CrOutcome::Advance)
        }
        CrAccess::Lmsw { source } => {
            let s = cpu.get(CrReg::Cr0Shadow)?;
            let new = (s & !LMSW_CLEARS) | (u64::from(source) & LMSW_BITS);
            let cr4 = effective_cr4(cpu, fixed)?;
            let efer = cpu.get(CrReg::Efer)?;
            match policy::cr0_write(new, fixed.cr0.0, fixed.cr0.1, cr4, efer) {
                CrWrite::Load { actual, shadow } => {
                    cpu.set(CrReg::Cr0, actual)?;
                    cpu.set(CrReg::Cr0Shadow, shadow)?;
                    Ok(CrOutcome::Advance)
                }
                CrWrite::Fault => Ok(refuse()),
            }
        }
    }
}

/// CR0.PG changed to that of `cr0`: EFER.LMA follows (long mode is active
/// with paging and EFER.LME, SDM 10.8.5), and so does the entry controls'
/// IA-32e mode guest bit, which must equal it at the next entry.
fn paging_changed<C: CrRegs>(cpu: &mut C, efer: u64, cr0: u64) -> Result<(), C::Error> {
    let efer = policy::efer_after_cr0(efer, cr0);
    cpu.set(CrReg::Efer, efer)?;
    let ia32e = EntryControls::IA32E_MODE_GUEST.bits() as u64;
    let mut ctl = cpu.get(CrReg::EntryControls)? & !ia32e;
    if efer & policy::EFER_LMA != 0 {
        ctl |= ia32e;
    }
    cpu.set(CrReg::EntryControls, ctl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{CR0_PE, CR0_PG, CR0_TS, CR4_PAE, EFER_LMA, EFER_LME};
    use std::collections::BTreeMap;

    /// The guest's registers in memory, with every access logged.
    #[derive(Default)]
    struct Regs {
        r: BTreeMap<&'static str, u64>,
        writes: Vec<(CrReg, u64)>,
    }

    fn name(reg: CrReg) -> &'static str {
        match reg {
            CrReg::Cr0 => "cr0",
            CrReg::Cr0Shadow => "cr0s",
            CrReg::Cr3 => "cr3",
            CrReg::Cr4 => "cr4",
            CrReg::Cr4Shadow => "cr4s",
            CrReg::Efer => "efer",
            CrReg::EntryControls => "entry",
            CrReg::Cr8 => "cr8",
            CrReg::Rsp => "rsp",
            CrReg::CsAccessRights => "cs_ar",
            CrReg::CacheControl => "cache",
        }
    }

    impl CrRegs for Regs {
        type Error = ();
        fn get(&mut self, reg: CrReg) -> Result<u64, ()> {
            Ok(self.r.get(name(reg)).copied().unwrap_or(0))
        }
        fn set(&mut self, reg: CrReg, value: u64) -> Result<(), ()> {
            self.writes.push((reg, value));
            self.r.insert(name(reg), value);
            Ok(())
        }
    }

    /// Fixed bits as Bochs and KVM report them with unrestricted guest:
    /// CR0.NE must be 1; CR4.VMXE must be 1 (root hides it).
    const FIXED: FixedCr = FixedCr {
        cr0: (1 << 5, 0xffff_ffff),
        cr4: (1 << 13, 0x3f_ffff),
    };

    fn long_mode() -> Regs {
        let mut r = Regs::default();
        r.r.insert("cr0", CR0_PE | CR0_PG | 1 << 5);
        r.r.insert("cr0s", CR0_PE | CR0_PG);
        r.r.insert("cr4", CR4_PAE | 1 << 13);
        r.r.insert("cr4s", CR4_PAE);
        r.r.insert("efer", EFER_LME | EFER_LMA);
        r.r.insert(
            "entry",
            EntryControls::IA32E_MODE_GUEST.bits() as u64 | 0x11ff,
        );
        r
    }

    fn run(r: &mut Regs, regs: &mut GuestRegs, access: CrAccess) -> (CrOutcome, u64) {
        let mut guard = GuardReport::default();
        let out = cr_access(access, regs, r, FIXED, &mut guard).unwrap();
        (out, guard.cr_writes_refused)
    }

    #[test]
    fn a_move_to_cr3_loads_it_from_any_register_rsp_too() {
        let mut r = long_mode();
        let mut g = GuestRegs {
            r13: 0x1234_5000,
            ..GuestRegs::default()
        };
        let to = |gpr| CrAccess::MovTo { cr: 3, gpr };
        assert_eq!(run(&mut r, &mut g, to(13)), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr3"], 0x1234_5000);
        r.r.insert("rsp", 0x9000);
        assert_eq!(run(&mut r, &mut g, to(4)), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr3"], 0x9000);
    }

    #[test]
    fn a_move_from_a_cr_reads_the_shadows_and_writes_the_register() {
        let mut r = long_mode();
        let mut g = GuestRegs::default();
        let from = |cr, gpr| CrAccess::MovFrom { cr, gpr };
        run(&mut r, &mut g, from(0, 0));
        assert_eq!(g.rax, CR0_PE | CR0_PG, "the shadow, without NE");
        run(&mut r, &mut g, from(4, 4));
        assert_eq!(r.r["rsp"], CR4_PAE, "the shadow, without VMXE, into RSP");
        r.r.insert("cr8", 7);
        run(&mut r, &mut g, from(8, 15));
        assert_eq!(g.r15, 7);
        assert_eq!(
            run(&mut r, &mut g, from(2, 0)).0,
            CrOutcome::Inject(UD, None)
        );
        assert_eq!(
            run(&mut r, &mut g, from(5, 0)).0,
            CrOutcome::Inject(UD, None)
        );
    }

    /// Found by the fuzzing guest on two vCPUs: an AP set CR4.PAE (no
    /// exit: root does not own PAE), then its MOV to CR0 of PG | NE exited
    /// for NE, and root judged it with the read shadow's stale PAE = 0 as
    /// paging on in long mode without PAE: #GP. Linux's own APs escape it
    /// only by the order of their writes.
    #[test]
    fn cr0_writes_see_the_cr4_bits_the_guest_set_without_an_exit() {
        let mut r = Regs::default();
        r.r.insert("cr0", CR0_PE | 1 << 5);
        r.r.insert("cr0s", CR0_PE);
        r.r.insert("cr4", CR4_PAE | 1 << 13);
        r.r.insert("cr4s", 0);
        r.r.insert("efer", EFER_LME);
        let mut g = GuestRegs {
            rax: CR0_PE | CR0_PG | 1 << 5,
            ..GuestRegs::default()
        };
        let to0 = CrAccess::MovTo { cr: 0, gpr: 0 };
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        assert_eq!(r.r["efer"], EFER_LME | EFER_LMA);
        // A MOV from CR4 (were it to exit) reads PAE too, not VMXE.
        let from4 = CrAccess::MovFrom { cr: 4, gpr: 0 };
        assert_eq!(run(&mut r, &mut g, from4), (CrOutcome::Advance, 0));
        assert_eq!(g.rax, CR4_PAE);
    }

    #[test]
    fn cr0_writes_follow_the_policy_and_paging_carries_long_mode() {
        let mut r = long_mode();
        let mut g = GuestRegs::default();
        let to0 = CrAccess::MovTo { cr: 0, gpr: 0 };
        // Paging off in long mode: LMA and the IA-32e entry bit go.
        g.rax = CR0_PE;
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr0"], CR0_PE | 1 << 5, "NE forced on");
        assert_eq!(r.r["cr0s"], CR0_PE, "the guest reads what it wrote");
        assert_eq!(r.r["efer"], EFER_LME);
        let ia32e = EntryControls::IA32E_MODE_GUEST.bits() as u64;
        assert_eq!(r.r["entry"] & ia32e, 0);
        assert_eq!(r.r["entry"] & 0x11ff, 0x11ff, "other controls kept");
        // And on again.
        g.rax = CR0_PE | CR0_PG;
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        // Paging off from 64-bit code (CS.L): #GP(0), nothing written.
        r.r.insert("cs_ar", 0xA09B);
        r.writes.clear();
        g.rax = CR0_PE;
        assert_eq!(
            run(&mut r, &mut g, to0),
            (CrOutcome::Inject(GP, Some(0)), 1)
        );
        assert!(r.writes.is_empty());
        r.r.insert("cs_ar", 0xC09B);
        // Found by the fuzzing guest (seed 1, operation 63: CR0 ^= CD |
        // NE): the write exits for NE, and CD went only into GUEST_CR0,
        // which VM entry does not load CD from; the guest read CD back as
        // 0. The CPU's own CD and NW change instead.
        r.writes.clear();
        g.rax = CR0_PE | CR0_PG | policy::CR0_CD;
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        assert!(
            r.writes.contains(&(CrReg::CacheControl, policy::CR0_CD)),
            "{:?}",
            r.writes
        );
        r.writes.clear();
        g.rax = CR0_PE | CR0_PG;
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        assert!(
            r.writes.contains(&(CrReg::CacheControl, 0)),
            "{:?}",
            r.writes
        );
        assert_eq!(r.r["efer"], EFER_LME | EFER_LMA);
        assert_ne!(r.r["entry"] & ia32e, 0);
        // No change of PG: EFER and the controls are not touched.
        r.writes.clear();
        assert_eq!(run(&mut r, &mut g, to0), (CrOutcome::Advance, 0));
        assert!(r
            .writes
            .iter()
            .all(|(w, _)| matches!(w, CrReg::Cr0 | CrReg::Cr0Shadow)));
        // PG without PE: refused, counted, nothing written.
        r.writes.clear();
        g.rax = CR0_PG;
        assert_eq!(
            run(&mut r, &mut g, to0),
            (CrOutcome::Inject(GP, Some(0)), 1)
        );
        assert!(r.writes.is_empty());
    }

    #[test]
    fn cr4_writes_hide_vmx_and_refuse_what_the_cpu_would() {
        let mut r = long_mode();
        let mut g = GuestRegs {
            rbx: CR4_PAE | 1 << 7,
            ..GuestRegs::default()
        };
        let to4 = CrAccess::MovTo { cr: 4, gpr: 3 };
        assert_eq!(run(&mut r, &mut g, to4), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr4"], CR4_PAE | 1 << 7 | 1 << 13, "VMXE kept on");
        assert_eq!(r.r["cr4s"], CR4_PAE | 1 << 7);
        // The guest may not turn VMX on, nor PAE off in long mode.
        for bad in [CR4_PAE | 1 << 13, 1 << 7] {
            g.rbx = bad;
            r.writes.clear();
            assert_eq!(
                run(&mut r, &mut g, to4),
                (CrOutcome::Inject(GP, Some(0)), 1)
            );
            assert!(r.writes.is_empty(), "{bad:#x}");
        }
    }

    #[test]
    fn cr8_takes_four_bits_and_other_crs_are_undefined() {
        let mut r = long_mode();
        let mut g = GuestRegs {
            rcx: 9,
            ..GuestRegs::default()
        };
        let to8 = CrAccess::MovTo { cr: 8, gpr: 1 };
        assert_eq!(run(&mut r, &mut g, to8), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr8"], 9);
        g.rcx = 0x10;
        // The CPU's own #GP: not a refusal of root's.
        assert_eq!(
            run(&mut r, &mut g, to8),
            (CrOutcome::Inject(GP, Some(0)), 0)
        );
        assert_eq!(r.r["cr8"], 9);
        for cr in [1, 2, 5, 7, 9, 15] {
            let to = CrAccess::MovTo { cr, gpr: 1 };
            assert_eq!(run(&mut r, &mut g, to).0, CrOutcome::Inject(UD, None));
        }
    }

    #[test]
    fn clts_and_lmsw_touch_only_their_bits() {
        let mut r = long_mode();
        r.r.insert("cr0", CR0_PE | CR0_PG | 1 << 5 | CR0_TS);
        r.r.insert("cr0s", CR0_PE | CR0_PG | CR0_TS);
        let mut g = GuestRegs::default();
        assert_eq!(run(&mut r, &mut g, CrAccess::Clts), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr0"], CR0_PE | CR0_PG | 1 << 5);
        assert_eq!(r.r["cr0s"], CR0_PE | CR0_PG);
        // LMSW loads MP, EM, TS; it cannot clear PE, and high bits of its
        // source are ignored.
        let lmsw = CrAccess::Lmsw { source: 0xfff8 };
        assert_eq!(run(&mut r, &mut g, lmsw), (CrOutcome::Advance, 0));
        assert_eq!(r.r["cr0s"], CR0_PE | CR0_PG | CR0_TS);
        assert_eq!(r.r["cr0"], CR0_PE | CR0_PG | 1 << 5 | CR0_TS);
    }
}
