//! Moves to and from the control registers, CLTS and LMSW: the rules are
//! `hypervisor::policy`'s; this is their VMCS glue.

use super::*;

impl Vcpu<'_> {
    /// A control-register value the CPU would refuse: #GP(0), counted.
    pub(super) fn refuse_cr(&mut self) -> Result<Next, VmcsError> {
        self.cpu.guard.cr_writes_refused += 1;
        self.inject(GP, Some(0))
    }

    pub(super) fn cr_access(&mut self, access: CrAccess) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let (f0, f1) = self.vm.cfg.fixed.cr0;
        let (f40, f41) = self.vm.cfg.fixed.cr4;
        match access {
            CrAccess::MovTo { cr, gpr: g } => {
                let value = match gpr(&mut self.cpu.regs, g) {
                    Some(r) => *r,
                    None => f::GUEST_RSP.read(v)?,
                };
                match cr {
                    0 => {
                        let cr4 = f::CR4_READ_SHADOW.read(v)?;
                        let efer = f::GUEST_IA32_EFER.read(v)?;
                        match policy::cr0_write(value, f0, f1, cr4, efer) {
                            CrWrite::Load { actual, shadow } => {
                                let old = f::GUEST_CR0.read(v)?;
                                f::GUEST_CR0.write(v, actual)?;
                                f::CR0_READ_SHADOW.write(v, shadow)?;
                                if (old ^ actual) & policy::CR0_PG != 0 {
                                    let efer = policy::efer_after_cr0(efer, actual);
                                    f::GUEST_IA32_EFER.write(v, efer)?;
                                    let mut ctl = f::ENTRY_CONTROLS.read(v)?;
                                    ctl &= !EntryControls::IA32E_MODE_GUEST.bits();
                                    if efer & policy::EFER_LMA != 0 {
                                        ctl |= EntryControls::IA32E_MODE_GUEST.bits();
                                    }
                                    f::ENTRY_CONTROLS.write(v, ctl)?;
                                }
                                self.advance()
                            }
                            CrWrite::Fault => self.refuse_cr(),
                        }
                    }
                    4 => {
                        let old = f::CR4_READ_SHADOW.read(v)?;
                        let lma = f::GUEST_IA32_EFER.read(v)? & policy::EFER_LMA != 0;
                        match policy::cr4_write(value, old, f40, f41, lma) {
                            CrWrite::Load { actual, shadow } => {
                                f::GUEST_CR4.write(v, actual)?;
                                f::CR4_READ_SHADOW.write(v, shadow)?;
                                self.advance()
                            }
                            CrWrite::Fault => self.refuse_cr(),
                        }
                    }
                    3 => {
                        f::GUEST_CR3.write(v, value)?;
                        self.advance()
                    }
                    8 => {
                        // The task-priority register; bits 63:4 are reserved.
                        if value >> 4 != 0 {
                            return self.inject(GP, Some(0));
                        }
                        // SAFETY: root runs with interrupts off, so the TPR
                        // (the guest's, with no TPR shadow) is the guest's alone.
                        unsafe { insn::write_cr8(value) };
                        self.advance()
                    }
                    _ => self.inject(UD, None),
                }
            }
            CrAccess::MovFrom { cr, gpr: g } => {
                let value = match cr {
                    0 => f::CR0_READ_SHADOW.read(v)?,
                    3 => f::GUEST_CR3.read(v)?,
                    4 => f::CR4_READ_SHADOW.read(v)?,
                    8 => insn::read_cr8(),
                    _ => return self.inject(UD, None),
                };
                match gpr(&mut self.cpu.regs, g) {
                    Some(r) => *r = value,
                    None => f::GUEST_RSP.write(v, value)?,
                }
                self.advance()
            }
            CrAccess::Clts => {
                let ts = 1u64 << 3;
                let c = f::GUEST_CR0.read(v)?;
                f::GUEST_CR0.write(v, c & !ts)?;
                let s = f::CR0_READ_SHADOW.read(v)?;
                f::CR0_READ_SHADOW.write(v, s & !ts)?;
                self.advance()
            }
            CrAccess::Lmsw { source } => {
                // LMSW loads CR0[3:0] but cannot clear PE.
                let s = f::CR0_READ_SHADOW.read(v)?;
                let new = (s & !0xe) | (source as u64 & 0xf);
                let cr4 = f::CR4_READ_SHADOW.read(v)?;
                let efer = f::GUEST_IA32_EFER.read(v)?;
                match policy::cr0_write(new, f0, f1, cr4, efer) {
                    CrWrite::Load { actual, shadow } => {
                        f::GUEST_CR0.write(v, actual)?;
                        f::CR0_READ_SHADOW.write(v, shadow)?;
                        self.advance()
                    }
                    CrWrite::Fault => self.refuse_cr(),
                }
            }
        }
    }
}
