//! What root runs the guest with, chosen from the CPU's VMX capability
//! MSRs (SDM Appendix A): the five control words, EPT, and what the
//! preemption timer and the activity states allow.
//!
//! Root reads the MSRs once ([`CapProfile::read`]) and [`choose`] decides;
//! the host tests feed it Bochs 2.7's values and the nested profile that
//! KVM gives an L1 hypervisor (`nested_vmx_setup_ctls_msrs` in
//! `arch/x86/kvm/vmx/nested.c`), in `profile/tests.rs`.

use super::ap::MISC_WAIT_FOR_SIPI;
use super::caps::{adjust_controls, EptVpidCap, MissingControls, VmxBasic};
use x86::msr;
use x86::vmx::vmcs::control::{
    EntryControls, ExitControls, PinbasedControls, PrimaryControls, SecondaryControls,
};

/// Pin-based controls root cannot run without: NMIs exit (root must never
/// take one through a table the guest wrote, and the guest must still get
/// each one), and virtual NMIs let root track the guest's NMI blocking.
pub const PIN_REQUIRED: u32 =
    PinbasedControls::NMI_EXITING.bits() | PinbasedControls::VIRTUAL_NMIS.bits();
/// Pin-based, when offered: the VMX preemption timer (root's periodic
/// turns; needed with more than one vCPU, see [`Chosen::check_vcpus`]).
pub const PIN_OPTIONAL: u32 = PinbasedControls::VMX_PREEMPTION_TIMER.bits();
/// Primary control that must exist though root switches it on only while
/// an NMI waits for the guest: NMI-window exiting. Not set in the word.
pub const PROC_MUST_EXIST: u32 = PrimaryControls::NMI_WINDOW_EXITING.bits();
/// Primary processor-based controls root needs: I/O and MSR bitmaps, and
/// the secondary controls.
pub const PROC_REQUIRED: u32 = PrimaryControls::USE_IO_BITMAPS.bits()
    | PrimaryControls::USE_MSR_BITMAPS.bits()
    | PrimaryControls::SECONDARY_CONTROLS.bits();
/// Secondary controls root needs: EPT, and unrestricted guest (the 6.1
/// decompressor turns paging off; APs start in real mode).
pub const PROC2_REQUIRED: u32 =
    SecondaryControls::ENABLE_EPT.bits() | SecondaryControls::UNRESTRICTED_GUEST.bits();
/// Secondary, when offered: VPID, and RDTSCP, INVPCID and XSAVES, which
/// the guest would take #UD on otherwise.
pub const PROC2_OPTIONAL: u32 = SecondaryControls::ENABLE_VPID.bits()
    | SecondaryControls::ENABLE_RDTSCP.bits()
    | SecondaryControls::ENABLE_INVPCID.bits()
    | SecondaryControls::ENABLE_XSAVES_XRSTORS.bits();
/// VM-exit controls root needs: a 64-bit host, DR7 and IA32_DEBUGCTL
/// saved (every exit sets DR7 to 0x400, SDM 28.5.1: without saving and
/// loading them each exit would wipe the guest's hardware breakpoints),
/// and EFER saved and loaded.
pub const EXIT_REQUIRED: u32 = ExitControls::HOST_ADDRESS_SPACE_SIZE.bits()
    | ExitControls::SAVE_DEBUG_CONTROLS.bits()
    | ExitControls::SAVE_IA32_EFER.bits()
    | ExitControls::LOAD_IA32_EFER.bits();
/// VM-exit, when offered: PAT saved and loaded.
pub const EXIT_OPTIONAL: u32 =
    ExitControls::SAVE_IA32_PAT.bits() | ExitControls::LOAD_IA32_PAT.bits();
/// VM-entry controls root needs: an IA-32e guest, debug controls and EFER
/// loaded.
pub const ENTRY_REQUIRED: u32 = EntryControls::IA32E_MODE_GUEST.bits()
    | EntryControls::LOAD_DEBUG_CONTROLS.bits()
    | EntryControls::LOAD_IA32_EFER.bits();
/// VM-entry, when offered: PAT loaded.
pub const ENTRY_OPTIONAL: u32 = EntryControls::LOAD_IA32_PAT.bits();

/// IA32_VMX_MISC bits 4:0: the preemption timer counts down once every
/// 2^rate TSC ticks (SDM A.6).
const MISC_TIMER_RATE: u64 = 0x1f;

/// The raw capability MSRs [`choose`] decides from, as the CPU (or the
/// hypervisor under root) reports them. An MSR the CPU does not have is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapProfile {
    /// IA32_VMX_BASIC (0x480).
    pub basic: u64,
    /// IA32_VMX_TRUE_PINBASED_CTLS (0x48D) when BASIC bit 55 says the
    /// TRUE MSRs exist, else IA32_VMX_PINBASED_CTLS (0x481).
    pub pinbased: u64,
    /// IA32_VMX_TRUE_PROCBASED_CTLS (0x48E), else IA32_VMX_PROCBASED_CTLS
    /// (0x482).
    pub procbased: u64,
    /// IA32_VMX_TRUE_EXIT_CTLS (0x48F), else IA32_VMX_EXIT_CTLS (0x483).
    pub exit: u64,
    /// IA32_VMX_TRUE_ENTRY_CTLS (0x490), else IA32_VMX_ENTRY_CTLS (0x484).
    pub entry: u64,
    /// IA32_VMX_PROCBASED_CTLS2 (0x48B).
    pub procbased2: u64,
    /// IA32_VMX_EPT_VPID_CAP (0x48C).
    pub ept_vpid_cap: u64,
    /// IA32_VMX_MISC (0x485).
    pub misc: u64,
}

impl CapProfile {
    /// Reads the profile through `rdmsr`, touching only MSRs the CPU
    /// has: the TRUE control MSRs only when BASIC says they exist,
    /// PROCBASED_CTLS2 only when secondary controls may be 1, and
    /// EPT_VPID_CAP only when EPT or VPID may be (SDM A.3.3, A.10).
    pub fn read(mut rdmsr: impl FnMut(u32) -> u64) -> Self {
        let basic = rdmsr(msr::IA32_VMX_BASIC);
        let t = VmxBasic(basic).has_true_controls();
        let pick = |true_msr, legacy| if t { true_msr } else { legacy };
        let pinbased = rdmsr(pick(
            msr::IA32_VMX_TRUE_PINBASED_CTLS,
            msr::IA32_VMX_PINBASED_CTLS,
        ));
        let procbased = rdmsr(pick(
            msr::IA32_VMX_TRUE_PROCBASED_CTLS,
            msr::IA32_VMX_PROCBASED_CTLS,
        ));
        let exit = rdmsr(pick(msr::IA32_VMX_TRUE_EXIT_CTLS, msr::IA32_VMX_EXIT_CTLS));
        let entry = rdmsr(pick(
            msr::IA32_VMX_TRUE_ENTRY_CTLS,
            msr::IA32_VMX_ENTRY_CTLS,
        ));
        let secondary = u64::from(PrimaryControls::SECONDARY_CONTROLS.bits()) << 32;
        let procbased2 = if procbased & secondary != 0 {
            rdmsr(msr::IA32_VMX_PROCBASED_CTLS2)
        } else {
            0
        };
        let ept_or_vpid =
            u64::from(SecondaryControls::ENABLE_EPT.bits() | SecondaryControls::ENABLE_VPID.bits())
                << 32;
        let ept_vpid_cap = if procbased2 & ept_or_vpid != 0 {
            rdmsr(msr::IA32_VMX_EPT_VPID_CAP)
        } else {
            0
        };
        let misc = rdmsr(msr::IA32_VMX_MISC);
        Self {
            basic,
            pinbased,
            procbased,
            exit,
            entry,
            procbased2,
            ept_vpid_cap,
            misc,
        }
    }
}

/// What [`choose`] settled on: the control words every vCPU's VMCS gets
/// and what root may rely on beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen {
    /// Pin-based VM-execution controls.
    pub pin: u32,
    /// Primary processor-based VM-execution controls.
    pub proc1: u32,
    /// Secondary processor-based VM-execution controls.
    pub proc2: u32,
    /// VM-exit controls.
    pub exit: u32,
    /// VM-entry controls (an AP starts with IA-32e mode cleared).
    pub entry: u32,
    /// The EPT capabilities, already checked against what root needs.
    pub ept: EptVpidCap,
    /// The VMX preemption timer is on in `pin`.
    pub preemption_timer: bool,
    /// IA32_VMX_MISC[4:0]: the timer counts TSC >> this.
    pub timer_shift: u32,
    /// IA32_VMX_MISC bit 8: VM entry into wait-for-SIPI works, which every
    /// AP needs (root parks each one there).
    pub wait_for_sipi: bool,
    /// IA32_VMX_BASIC bit 54: INS/OUTS exits report the instruction
    /// information.
    pub ins_outs_info: bool,
}

impl Chosen {
    /// Each vCPU has its own VPID.
    pub const fn vpid(&self) -> bool {
        self.proc2 & SecondaryControls::ENABLE_VPID.bits() != 0
    }
    /// The guest's PAT is saved at exit.
    pub const fn exit_saves_pat(&self) -> bool {
        self.exit & ExitControls::SAVE_IA32_PAT.bits() != 0
    }
    /// Root's PAT is loaded at exit (HOST_IA32_PAT is written).
    pub const fn exit_loads_pat(&self) -> bool {
        self.exit & ExitControls::LOAD_IA32_PAT.bits() != 0
    }
    /// The guest's PAT is loaded at entry (GUEST_IA32_PAT is written).
    pub const fn entry_loads_pat(&self) -> bool {
        self.entry & EntryControls::LOAD_IA32_PAT.bits() != 0
    }

    /// Whether `vcpus` vCPUs can run on these controls, with the refusal
    /// root gives when not: an AP's INIT is carried out at its next exit,
    /// so with APs the preemption timer must be on, and each AP is parked
    /// in wait-for-SIPI. The boot processor checks both before it starts
    /// any AP (each AP checks wait-for-SIPI again at its own set-up).
    pub fn check_vcpus(&self, vcpus: usize) -> Result<(), Refusal> {
        if vcpus <= 1 {
            Ok(())
        } else if !self.preemption_timer {
            Err(Refusal::Controls(MissingControls {
                word: "pin-based (the VMX preemption timer, needed with more than one vCPU)",
                missing: PinbasedControls::VMX_PREEMPTION_TIMER.bits(),
            }))
        } else if !self.wait_for_sipi {
            Err(Refusal::Controls(WAIT_FOR_SIPI_MISSING))
        } else {
            Ok(())
        }
    }
}

/// The refusal of a CPU without the wait-for-SIPI activity state, which
/// every AP is parked in (the boot processor's [`Chosen::check_vcpus`],
/// and each AP's own check).
pub const WAIT_FOR_SIPI_MISSING: MissingControls = MissingControls {
    word: "activity states (wait-for-SIPI)",
    missing: MISC_WAIT_FOR_SIPI as u32,
};

/// Why root will not run on a profile: the first need it lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A control word lacks required bits.
    Controls(MissingControls),
    /// EPT lacks something root relies on ([`EptVpidCap::missing`]).
    Ept(&'static str),
}

impl From<MissingControls> for Refusal {
    fn from(m: MissingControls) -> Self {
        Self::Controls(m)
    }
}

impl core::fmt::Display for Refusal {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Controls(m) => write!(f, "{m}"),
            Self::Ept(m) => write!(f, "EPT lacks {m}"),
        }
    }
}

/// Chooses root's controls from a capability profile: every required
/// control or refuses, naming the first one missing (EPT first, then the
/// words in the order pin-based, primary, secondary, exit, entry); each
/// optional one where allowed; and every bit the CPU forces to 1.
pub fn choose(p: &CapProfile) -> Result<Chosen, Refusal> {
    let ept = EptVpidCap(p.ept_vpid_cap);
    if let Some(missing) = ept.missing() {
        return Err(Refusal::Ept(missing));
    }
    let pin = adjust_controls("pin-based", PIN_REQUIRED, PIN_OPTIONAL, p.pinbased)?;
    adjust_controls("primary processor-based", PROC_MUST_EXIST, 0, p.procbased)?;
    let proc1 = adjust_controls("primary processor-based", PROC_REQUIRED, 0, p.procbased)?;
    let proc2 = adjust_controls(
        "secondary processor-based",
        PROC2_REQUIRED,
        PROC2_OPTIONAL,
        p.procbased2,
    )?;
    let exit = adjust_controls("VM-exit", EXIT_REQUIRED, EXIT_OPTIONAL, p.exit)?;
    let entry = adjust_controls("VM-entry", ENTRY_REQUIRED, ENTRY_OPTIONAL, p.entry)?;
    Ok(Chosen {
        pin,
        proc1,
        proc2,
        exit,
        entry,
        ept,
        preemption_timer: pin & PinbasedControls::VMX_PREEMPTION_TIMER.bits() != 0,
        timer_shift: (p.misc & MISC_TIMER_RATE) as u32,
        wait_for_sipi: p.misc & MISC_WAIT_FOR_SIPI != 0,
        ins_outs_info: VmxBasic(p.basic).ins_outs_info(),
    })
}

#[cfg(test)]
mod tests;
