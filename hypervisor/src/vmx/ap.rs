//! Application processors under VMX: the state INIT leaves, the start at a
//! SIPI's vector, and what an AP's INIT and SIPI exits mean.
//!
//! Root enters every AP straight into the wait-for-SIPI activity state
//! before the guest's boot processor runs (SDM 26.4.2 "Guest non-register
//! state": activity state 3). From then on the guest's own start-up IPIs
//! drive it, as they would drive a bare CPU:
//!
//! - A SIPI to an AP in wait-for-SIPI is a VM exit (SDM 25.2, exit reason
//!   4) with the vector in the exit qualification. Root starts the AP in
//!   real mode at `vector << 12` ([`write_sipi_state`]).
//! - An INIT to an AP that runs (active or HLT) is a VM exit too (exit
//!   reason 3). Root does what INIT does to a bare CPU: the reset state,
//!   parked in wait-for-SIPI ([`write_init_state`]). That is how a CPU that
//!   the guest took offline comes back.
//! - An INIT to an AP in wait-for-SIPI is blocked (SDM 25.2).
//!
//! Bochs 2.7 gets several of these wrong (read in its source, tag
//! REL_2_7_FINAL):
//! - An INIT that reaches a CPU in VMX non-root stays pending for good:
//!   the INIT exit never clears it (only a CPU reset does), and every
//!   later entry exits on it again. An INIT to an AP parked in
//!   wait-for-SIPI is latched the same way and fires at the first entry
//!   after its SIPI. So the guest's start-up IPIs must never reach an AP
//!   as signals: root takes the guest's writes to the interrupt command
//!   register and carries INIT and SIPI out itself (`apic`), sending the
//!   AP a physical SIPI only while it is parked, which exits cleanly.
//! - The saved activity state after a SIPI exit says active, and blocking
//!   by NMI and by SMI are set (the next entry fails on the SMI bit). Both
//!   start states write the activity and the whole interruptibility field,
//!   never trusting what was saved, and root keeps its own account of
//!   each AP ([`ApLife`]).
//! - The SIPI exit also leaves NMIs blocked on the AP (its exit cuts short
//!   the SIPI's own unmasking), and only an IRET in root lifts that: root
//!   runs one to itself after each start.
//! - The preemption timer must not run while an AP is parked: the INIT
//!   state clears its pin-based control, and the SIPI state sets it back.

use super::fields::{self as f, VmcsError, VmcsIo, GUEST_SEGMENTS};
use super::regs::GuestRegs;
use crate::policy;
use crate::vmx::caps;

/// Activity states (SDM 25.4.2).
pub const ACTIVITY_ACTIVE: u32 = 0;
/// HLT.
pub const ACTIVITY_HLT: u32 = 1;
/// Wait-for-SIPI.
pub const ACTIVITY_WAIT_FOR_SIPI: u32 = 3;
/// Interruptibility bit 2: blocking by SMI.
pub const BLOCKING_BY_SMI: u32 = 1 << 2;
/// IA32_VMX_MISC bit 8: wait-for-SIPI is a supported activity state.
pub const MISC_WAIT_FOR_SIPI: u64 = 1 << 8;
/// Pin-based control bit 6: the VMX-preemption timer.
pub const PIN_PREEMPTION_TIMER: u32 = 1 << 6;
/// VM-entry control bit 9: IA-32e mode guest.
pub const ENTRY_IA32E_MODE: u32 = 1 << 9;

/// CR0 after INIT: CD, NW and ET set, protection and paging off (SDM Vol.
/// 3 table 10-1).
pub const INIT_CR0: u64 = 0x6000_0010;
/// RIP and CS after INIT: the reset vector F000:FFF0.
pub const INIT_RIP: u64 = 0xfff0;
const INIT_CS_SELECTOR: u16 = 0xf000;
const INIT_CS_BASE: u64 = 0xffff_0000;
/// Real-mode access rights: present, S, type 11 (code, read, accessed)
/// for CS, type 3 (data, write, accessed) for the others; LDTR type 2;
/// TR type 11 (busy TSS, as VM entry requires of TR: [`f::AR_TSS_BUSY`]).
const AR_CODE: u32 = 0x9b;
const AR_DATA: u32 = 0x93;
const AR_LDT: u32 = 0x82;
const REAL_LIMIT: u32 = 0xffff;

/// The fixed bits of CR0 and CR4 under VMX (IA32_VMX_CR0_FIXED0/1,
/// IA32_VMX_CR4_FIXED0/1).
#[derive(Debug, Clone, Copy)]
pub struct FixedCrs {
    /// CR0 FIXED0 and FIXED1.
    pub cr0: (u64, u64),
    /// CR4 FIXED0 and FIXED1.
    pub cr4: (u64, u64),
}

/// Writes the state that INIT leaves a processor in, parked in
/// wait-for-SIPI with no event to deliver and the preemption timer off.
/// `signature` is CPUID.1:EAX, which INIT leaves in EDX.
pub fn write_init_state(
    v: &mut impl VmcsIo,
    regs: &mut GuestRegs,
    fixed: FixedCrs,
    signature: u32,
) -> Result<(), VmcsError> {
    *regs = GuestRegs {
        rdx: u64::from(signature),
        ..GuestRegs::default()
    };
    let cr0_mask = policy::cr0_host_mask(fixed.cr0.0);
    f::GUEST_CR0.write(v, caps::apply_fixed(INIT_CR0, cr0_mask, fixed.cr0.1))?;
    f::CR0_READ_SHADOW.write(v, INIT_CR0)?;
    let cr4_mask = policy::cr4_host_mask(fixed.cr4.0);
    f::GUEST_CR4.write(v, caps::apply_fixed(0, cr4_mask, fixed.cr4.1))?;
    f::CR4_READ_SHADOW.write(v, 0)?;
    f::GUEST_CR3.write(v, 0)?;
    f::GUEST_DR7.write(v, 0x400)?;
    f::GUEST_RSP.write(v, 0)?;
    f::GUEST_RIP.write(v, INIT_RIP)?;
    f::GUEST_RFLAGS.write(v, 0x2)?;
    for (i, seg) in GUEST_SEGMENTS.iter().enumerate() {
        match i {
            f::SEG_CS => seg.write(v, INIT_CS_SELECTOR, INIT_CS_BASE, REAL_LIMIT, AR_CODE)?,
            f::SEG_LDTR => seg.write(v, 0, 0, REAL_LIMIT, AR_LDT)?,
            f::SEG_TR => seg.write(v, 0, 0, REAL_LIMIT, f::AR_TSS_BUSY)?,
            _ => seg.write(v, 0, 0, REAL_LIMIT, AR_DATA)?,
        }
    }
    f::GUEST_GDTR_BASE.write(v, 0)?;
    f::GUEST_GDTR_LIMIT.write(v, REAL_LIMIT)?;
    f::GUEST_IDTR_BASE.write(v, 0)?;
    f::GUEST_IDTR_LIMIT.write(v, REAL_LIMIT)?;
    f::GUEST_IA32_EFER.write(v, 0)?;
    f::GUEST_IA32_DEBUGCTL.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_CS.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_ESP.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_EIP.write(v, 0)?;
    f::GUEST_PENDING_DEBUG_EXCEPTIONS.write(v, 0)?;
    f::GUEST_INTERRUPTIBILITY.write(v, 0)?;
    f::ENTRY_INTERRUPTION_INFO.write(v, 0)?;
    let entry = f::ENTRY_CONTROLS.read(v)?;
    f::ENTRY_CONTROLS.write(v, entry & !ENTRY_IA32E_MODE)?;
    let pin = f::PIN_BASED_CONTROLS.read(v)?;
    f::PIN_BASED_CONTROLS.write(v, pin & !PIN_PREEMPTION_TIMER)?;
    f::GUEST_ACTIVITY_STATE.write(v, ACTIVITY_WAIT_FOR_SIPI)
}

/// Starts a parked AP at the SIPI's `vector`: real mode at
/// `(vector << 8):0000`, active, nothing blocked, the preemption timer
/// back on when the VM uses it. The rest stays as INIT left it.
pub fn write_sipi_state(v: &mut impl VmcsIo, vector: u8, timer: bool) -> Result<(), VmcsError> {
    let cs = &GUEST_SEGMENTS[f::SEG_CS];
    cs.write(
        v,
        u16::from(vector) << 8,
        u64::from(vector) << 12,
        REAL_LIMIT,
        AR_CODE,
    )?;
    f::GUEST_RIP.write(v, 0)?;
    f::GUEST_INTERRUPTIBILITY.write(v, 0)?;
    f::GUEST_PENDING_DEBUG_EXCEPTIONS.write(v, 0)?;
    if timer {
        let pin = f::PIN_BASED_CONTROLS.read(v)?;
        f::PIN_BASED_CONTROLS.write(v, pin | PIN_PREEMPTION_TIMER)?;
    }
    f::GUEST_ACTIVITY_STATE.write(v, ACTIVITY_ACTIVE)
}

/// Root's account of where an AP is in its life, kept because the saved
/// activity state cannot be trusted (see the module's notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApLife {
    /// Parked in wait-for-SIPI (from the start, or after an INIT).
    Parked,
    /// Started by a SIPI at `vector`.
    Running { vector: u8 },
}

impl ApLife {
    /// Whether the AP is parked in wait-for-SIPI (it runs no guest code).
    pub fn is_parked(self) -> bool {
        self == ApLife::Parked
    }

    /// A SIPI: `Some(vector)` to start the AP there, `None` when the AP
    /// runs (a SIPI to a running CPU is discarded, SDM 25.2).
    pub fn on_sipi(&mut self, vector: u8) -> Option<u8> {
        match *self {
            ApLife::Parked => {
                *self = ApLife::Running { vector };
                Some(vector)
            }
            ApLife::Running { .. } => None,
        }
    }

    /// An INIT: the AP is reset and parked, whatever it was doing.
    pub fn on_init(&mut self) {
        *self = ApLife::Parked;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmx::fields::tests::FakeVmcs;

    const FIXED: FixedCrs = FixedCrs {
        // Bochs' values: CR0 PE, NE, PG fixed to 1; CR4 VMXE.
        cr0: (0x8000_0021, 0xffff_ffff),
        cr4: (0x2000, 0x0037_27ff),
    };

    #[test]
    fn init_parks_the_ap_in_real_mode_at_the_reset_vector() {
        let mut v = FakeVmcs::default();
        f::ENTRY_CONTROLS
            .write(&mut v, ENTRY_IA32E_MODE | 0x1000)
            .unwrap();
        f::PIN_BASED_CONTROLS
            .write(&mut v, PIN_PREEMPTION_TIMER | 0x28)
            .unwrap();
        f::ENTRY_INTERRUPTION_INFO
            .write(&mut v, 0x8000_0302)
            .unwrap();
        f::GUEST_INTERRUPTIBILITY.write(&mut v, 0x4).unwrap();
        let mut regs = GuestRegs {
            rax: 5,
            r15: 9,
            ..GuestRegs::default()
        };
        write_init_state(&mut v, &mut regs, FIXED, 0x906a0).unwrap();
        assert_eq!((regs.rax, regs.r15, regs.rdx), (0, 0, 0x906a0));
        assert_eq!(
            f::GUEST_ACTIVITY_STATE.read(&v).unwrap(),
            ACTIVITY_WAIT_FOR_SIPI
        );
        // Paging and protection off (unrestricted guest), NE forced on,
        // the guest reads the architectural value.
        assert_eq!(f::GUEST_CR0.read(&v).unwrap(), INIT_CR0 | 0x20);
        assert_eq!(f::CR0_READ_SHADOW.read(&v).unwrap(), INIT_CR0);
        assert_eq!(f::GUEST_CR4.read(&v).unwrap(), 0x2000);
        assert_eq!(f::GUEST_CS_BASE.read(&v).unwrap(), 0xffff_0000);
        assert_eq!(f::GUEST_CS_SELECTOR.read(&v).unwrap(), 0xf000);
        assert_eq!(f::GUEST_RIP.read(&v).unwrap(), 0xfff0);
        assert_eq!(f::GUEST_TR_ACCESS_RIGHTS.read(&v).unwrap(), 0x8b);
        assert_eq!(f::GUEST_SS_ACCESS_RIGHTS.read(&v).unwrap(), 0x93);
        assert_eq!(f::GUEST_IA32_EFER.read(&v).unwrap(), 0);
        // No 64-bit entry, no event, no timer, nothing blocked.
        assert_eq!(f::ENTRY_CONTROLS.read(&v).unwrap(), 0x1000);
        assert_eq!(f::PIN_BASED_CONTROLS.read(&v).unwrap(), 0x28);
        assert_eq!(f::ENTRY_INTERRUPTION_INFO.read(&v).unwrap(), 0);
        assert_eq!(f::GUEST_INTERRUPTIBILITY.read(&v).unwrap(), 0);
    }

    #[test]
    fn sipi_starts_at_the_vector_and_clears_what_bochs_saves_wrongly() {
        let mut v = FakeVmcs::default();
        let mut regs = GuestRegs::default();
        write_init_state(&mut v, &mut regs, FIXED, 0).unwrap();
        // Bochs 2.7 saves blocking by SMI and by NMI after wait-for-SIPI.
        f::GUEST_INTERRUPTIBILITY.write(&mut v, 0xc).unwrap();
        write_sipi_state(&mut v, 0x9a, true).unwrap();
        assert_eq!(f::GUEST_CS_SELECTOR.read(&v).unwrap(), 0x9a00);
        assert_eq!(f::GUEST_CS_BASE.read(&v).unwrap(), 0x9a000);
        assert_eq!(f::GUEST_RIP.read(&v).unwrap(), 0);
        assert_eq!(f::GUEST_ACTIVITY_STATE.read(&v).unwrap(), ACTIVITY_ACTIVE);
        assert_eq!(f::GUEST_INTERRUPTIBILITY.read(&v).unwrap(), 0);
        assert_ne!(
            f::PIN_BASED_CONTROLS.read(&v).unwrap() & PIN_PREEMPTION_TIMER,
            0
        );
        // Without a timer in the VM, none is switched on.
        write_sipi_state(&mut v, 0x10, false).unwrap();
        write_init_state(&mut v, &mut regs, FIXED, 0).unwrap();
        write_sipi_state(&mut v, 0x10, false).unwrap();
        assert_eq!(
            f::PIN_BASED_CONTROLS.read(&v).unwrap() & PIN_PREEMPTION_TIMER,
            0
        );
    }

    #[test]
    fn init_and_sipi_follow_the_sdm() {
        let mut ap = ApLife::Parked;
        assert!(ap.is_parked());
        assert_eq!(ap.on_sipi(0x9a), Some(0x9a));
        // The second SIPI of INIT-SIPI-SIPI finds it running.
        assert_eq!(ap.on_sipi(0x9a), None);
        assert_eq!(ap, ApLife::Running { vector: 0x9a });
        // INIT parks it (CPU hot-unplug and plug), and a new SIPI starts it
        // wherever the guest says.
        ap.on_init();
        assert!(ap.is_parked());
        ap.on_init();
        assert!(ap.is_parked());
        assert_eq!(ap.on_sipi(0x20), Some(0x20));
    }
}
