//! Moves to and from the control registers, CLTS and LMSW: decided and
//! performed by `hypervisor::vmx::cr` over the VMCS ([`VmcsCr`]).

use super::*;
use hypervisor::policy;
use hypervisor::vmx::cr::{self, CrOutcome, CrReg, CrRegs, FixedCr};

/// The guest's control registers as the VMCS (and, for CR8, the CPU) hold
/// them.
struct VmcsCr;

impl CrRegs for VmcsCr {
    type Error = VmcsError;

    fn get(&mut self, reg: CrReg) -> Result<u64, VmcsError> {
        let v = &Vmcs;
        match reg {
            CrReg::Cr0 => f::GUEST_CR0.read(v),
            CrReg::Cr0Shadow => f::CR0_READ_SHADOW.read(v),
            CrReg::Cr3 => f::GUEST_CR3.read(v),
            CrReg::Cr4 => f::GUEST_CR4.read(v),
            CrReg::Cr4Shadow => f::CR4_READ_SHADOW.read(v),
            CrReg::Efer => f::GUEST_IA32_EFER.read(v),
            CrReg::EntryControls => f::ENTRY_CONTROLS.read(v).map(u64::from),
            CrReg::Cr8 => Ok(insn::read_cr8()),
            CrReg::Rsp => f::GUEST_RSP.read(v),
            CrReg::CsAccessRights => f::GUEST_CS_ACCESS_RIGHTS.read(v).map(u64::from),
            CrReg::CacheControl => Ok(insn::read_cr0() & (policy::CR0_CD | policy::CR0_NW)),
        }
    }

    fn set(&mut self, reg: CrReg, value: u64) -> Result<(), VmcsError> {
        let v = &mut Vmcs;
        match reg {
            CrReg::Cr0 => f::GUEST_CR0.write(v, value),
            CrReg::Cr0Shadow => f::CR0_READ_SHADOW.write(v, value),
            CrReg::Cr3 => f::GUEST_CR3.write(v, value),
            CrReg::Cr4 => f::GUEST_CR4.write(v, value),
            CrReg::Cr4Shadow => f::CR4_READ_SHADOW.write(v, value),
            CrReg::Efer => f::GUEST_IA32_EFER.write(v, value),
            // The controls are 32 bits wide; the rule changes one of them.
            CrReg::EntryControls => f::ENTRY_CONTROLS.write(v, value as u32),
            CrReg::Cr8 => {
                // SAFETY: root runs with interrupts off, so the TPR (the
                // guest's, with no TPR shadow) is the guest's alone; the
                // rule checked its reserved bits.
                unsafe { insn::write_cr8(value) };
                Ok(())
            }
            CrReg::Rsp => f::GUEST_RSP.write(v, value),
            // Never written: the rules only read it.
            CrReg::CsAccessRights => Ok(()),
            CrReg::CacheControl => {
                let bits = policy::CR0_CD | policy::CR0_NW;
                // SAFETY: only CD and NW change, to a combination the
                // rule checked (NW never without CD); paging and
                // protection stay as root runs with them.
                unsafe { insn::write_cr0((insn::read_cr0() & !bits) | (value & bits)) };
                Ok(())
            }
        }
    }
}

impl Vcpu<'_> {
    pub(super) fn cr_access(&mut self, access: CrAccess) -> Result<Next, VmcsError> {
        let fixed = FixedCr {
            cr0: self.vm.cfg.fixed.cr0,
            cr4: self.vm.cfg.fixed.cr4,
        };
        let outcome = cr::cr_access(
            access,
            &mut self.cpu.regs,
            &mut VmcsCr,
            fixed,
            &mut self.cpu.guard,
        )?;
        match outcome {
            CrOutcome::Advance => self.advance(),
            CrOutcome::Inject(vector, code) => self.inject(vector, code),
        }
    }
}
