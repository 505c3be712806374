//! VM exits, decoded once into a typed value (SDM 28.2 "Recording VM-exit
//! information", Appendix C "VMX basic exit reasons").
//!
//! The binary reads the raw exit-information fields into [`RawExit`] right
//! after each exit; [`decode`] turns that into a [`VmExit`]. Everything after
//! that point works on the typed value, so exit handling can be tested on the
//! host with synthetic exits.

/// Basic exit reasons we name (SDM Appendix C).
pub mod reason {
    pub const EXCEPTION_OR_NMI: u16 = 0;
    pub const EXTERNAL_INTERRUPT: u16 = 1;
    pub const TRIPLE_FAULT: u16 = 2;
    pub const INIT: u16 = 3;
    pub const SIPI: u16 = 4;
    pub const INTERRUPT_WINDOW: u16 = 7;
    pub const NMI_WINDOW: u16 = 8;
    pub const TASK_SWITCH: u16 = 9;
    pub const CPUID: u16 = 10;
    pub const GETSEC: u16 = 11;
    pub const HLT: u16 = 12;
    pub const INVD: u16 = 13;
    pub const VMCALL: u16 = 18;
    pub const VMCLEAR: u16 = 19;
    pub const VMLAUNCH: u16 = 20;
    pub const VMPTRLD: u16 = 21;
    pub const VMPTRST: u16 = 22;
    pub const VMREAD: u16 = 23;
    pub const VMRESUME: u16 = 24;
    pub const VMWRITE: u16 = 25;
    pub const VMXOFF: u16 = 26;
    pub const VMXON: u16 = 27;
    pub const CR_ACCESS: u16 = 28;
    pub const IO_INSTRUCTION: u16 = 30;
    pub const RDMSR: u16 = 31;
    pub const WRMSR: u16 = 32;
    pub const INVALID_GUEST_STATE: u16 = 33;
    pub const MSR_LOADING: u16 = 34;
    pub const MACHINE_CHECK: u16 = 41;
    pub const EPT_VIOLATION: u16 = 48;
    pub const EPT_MISCONFIG: u16 = 49;
    pub const INVEPT: u16 = 50;
    pub const PREEMPTION_TIMER: u16 = 52;
    pub const INVVPID: u16 = 53;
    pub const XSETBV: u16 = 55;
    pub const INVPCID: u16 = 58;
    pub const VMFUNC: u16 = 59;
    /// One past the largest basic reason the counters track.
    pub const COUNT: usize = 80;
}

/// Name of a basic exit reason, for logs and counters.
pub fn reason_name(r: u16) -> &'static str {
    use reason::*;
    match r {
        EXCEPTION_OR_NMI => "EXCEPTION_NMI",
        EXTERNAL_INTERRUPT => "EXTERNAL_INTERRUPT",
        TRIPLE_FAULT => "TRIPLE_FAULT",
        INIT => "INIT",
        SIPI => "SIPI",
        5 => "IO_SMI",
        6 => "OTHER_SMI",
        INTERRUPT_WINDOW => "INTERRUPT_WINDOW",
        NMI_WINDOW => "NMI_WINDOW",
        TASK_SWITCH => "TASK_SWITCH",
        CPUID => "CPUID",
        GETSEC => "GETSEC",
        HLT => "HLT",
        INVD => "INVD",
        14 => "INVLPG",
        15 => "RDPMC",
        16 => "RDTSC",
        17 => "RSM",
        VMCALL => "VMCALL",
        VMCLEAR => "VMCLEAR",
        VMLAUNCH => "VMLAUNCH",
        VMPTRLD => "VMPTRLD",
        VMPTRST => "VMPTRST",
        VMREAD => "VMREAD",
        VMRESUME => "VMRESUME",
        VMWRITE => "VMWRITE",
        VMXOFF => "VMXOFF",
        VMXON => "VMXON",
        CR_ACCESS => "CR_ACCESS",
        29 => "DR_ACCESS",
        IO_INSTRUCTION => "IO_INSTRUCTION",
        RDMSR => "MSR_READ",
        WRMSR => "MSR_WRITE",
        INVALID_GUEST_STATE => "INVALID_GUEST_STATE",
        MSR_LOADING => "MSR_LOADING",
        36 => "MWAIT",
        37 => "MONITOR_TRAP_FLAG",
        39 => "MONITOR",
        40 => "PAUSE",
        MACHINE_CHECK => "MACHINE_CHECK",
        43 => "TPR_BELOW_THRESHOLD",
        44 => "APIC_ACCESS",
        45 => "VIRTUALIZED_EOI",
        46 => "GDTR_IDTR_ACCESS",
        47 => "LDTR_TR_ACCESS",
        EPT_VIOLATION => "EPT_VIOLATION",
        EPT_MISCONFIG => "EPT_MISCONFIG",
        INVEPT => "INVEPT",
        51 => "RDTSCP",
        PREEMPTION_TIMER => "PREEMPTION_TIMER",
        INVVPID => "INVVPID",
        54 => "WBINVD",
        XSETBV => "XSETBV",
        56 => "APIC_WRITE",
        57 => "RDRAND",
        INVPCID => "INVPCID",
        VMFUNC => "VMFUNC",
        60 => "ENCLS",
        61 => "RDSEED",
        62 => "PML_FULL",
        63 => "XSAVES",
        64 => "XRSTORS",
        _ => "UNKNOWN",
    }
}

/// The exit-information fields and the guest registers an exit needs,
/// read once after the exit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawExit {
    /// EXIT_REASON (bit 31: VM-entry failure).
    pub reason: u32,
    /// EXIT_QUALIFICATION.
    pub qualification: u64,
    /// GUEST_PHYSICAL_ADDRESS (EPT exits).
    pub guest_physical: u64,
    /// GUEST_LINEAR_ADDRESS.
    pub guest_linear: u64,
    /// EXIT_INTERRUPTION_INFO.
    pub interruption_info: u32,
    /// Guest RAX, RCX, RDX at the exit (RDMSR/WRMSR/XSETBV operands).
    pub rax: u64,
    pub rcx: u64,
    pub rdx: u64,
}

/// Kinds of control-register access (SDM Table 28-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrAccess {
    /// MOV to CRn from a general-purpose register (index as in ModRM: 0 = RAX .. 15 = R15).
    MovTo { cr: u8, gpr: u8 },
    /// MOV from CRn to a general-purpose register.
    MovFrom { cr: u8, gpr: u8 },
    /// CLTS.
    Clts,
    /// LMSW with its 16-bit source.
    Lmsw { source: u16 },
}

/// An I/O instruction (SDM Table 28-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoAccess {
    /// Port number.
    pub port: u16,
    /// Access size in bytes: 1, 2 or 4.
    pub size: u8,
    /// IN (true) or OUT (false).
    pub input: bool,
    /// INS/OUTS.
    pub string: bool,
    /// REP prefix.
    pub rep: bool,
}

/// An EPT violation (SDM Table 28-7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EptViolation {
    /// The guest-physical address accessed.
    pub gpa: u64,
    /// The guest-linear address, when bit 7 says it is valid.
    pub gla: Option<u64>,
    /// Data read.
    pub read: bool,
    /// Data write.
    pub write: bool,
    /// Instruction fetch.
    pub fetch: bool,
    /// Permissions the translation had: bit 0 read, 1 write, 2 execute.
    pub allowed: u8,
}

/// A decoded VM exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum VmExit {
    /// An exception hit the exception bitmap.
    Exception { vector: u8, info: u32 },
    /// An NMI arrived while the guest ran ("NMI exiting" is on).
    Nmi,
    /// The guest can take an NMI now ("NMI-window exiting" was on).
    NmiWindow,
    /// A task switch (CALL/JMP/IRET to a TSS or task gate, or an event
    /// through a task gate) with its qualification.
    TaskSwitch { qualification: u64 },
    /// GETSEC.
    Getsec,
    /// An external interrupt (only when external-interrupt exiting is on).
    ExternalInterrupt,
    /// The guest triple-faulted.
    TripleFault,
    /// INIT signal.
    Init,
    /// Start-up IPI with its vector.
    Sipi { vector: u8 },
    /// CPUID with the guest's leaf and subleaf.
    Cpuid { leaf: u32, subleaf: u32 },
    /// HLT (only with HLT exiting).
    Hlt,
    /// INVD.
    Invd,
    /// VMCALL.
    Vmcall,
    /// Any other VMX instruction in the guest.
    VmxInstruction(u16),
    /// Control-register access.
    Cr(CrAccess),
    /// I/O instruction on an intercepted port.
    Io(IoAccess),
    /// RDMSR of an intercepted MSR.
    MsrRead { msr: u32 },
    /// WRMSR of an intercepted MSR.
    MsrWrite { msr: u32, value: u64 },
    /// VM entry failed after the checks on guest state, MSR loading or a machine check.
    EntryFailure { reason: u16, qualification: u64 },
    /// EPT violation.
    EptViolation(EptViolation),
    /// EPT misconfiguration at a guest-physical address.
    EptMisconfig { gpa: u64 },
    /// The VMX preemption timer expired.
    PreemptionTimer,
    /// XSETBV with its XCR index and value.
    Xsetbv { xcr: u32, value: u64 },
    /// A basic reason we do not decode.
    Unknown(u16),
}

impl VmExit {
    /// The basic exit reason this value came from.
    pub fn basic_reason(raw: &RawExit) -> u16 {
        raw.reason as u16
    }
}

/// Decodes the raw fields of one exit.
pub fn decode(raw: &RawExit) -> VmExit {
    use reason::*;
    let basic = raw.reason as u16;
    let q = raw.qualification;
    if raw.reason & (1 << 31) != 0 {
        return VmExit::EntryFailure {
            reason: basic,
            qualification: q,
        };
    }
    match basic {
        EXCEPTION_OR_NMI
            if (raw.interruption_info >> 8) & 7 == crate::vmx::event::TYPE_NMI as u32 =>
        {
            VmExit::Nmi
        }
        EXCEPTION_OR_NMI => VmExit::Exception {
            vector: raw.interruption_info as u8,
            info: raw.interruption_info,
        },
        NMI_WINDOW => VmExit::NmiWindow,
        TASK_SWITCH => VmExit::TaskSwitch { qualification: q },
        GETSEC => VmExit::Getsec,
        EXTERNAL_INTERRUPT => VmExit::ExternalInterrupt,
        TRIPLE_FAULT => VmExit::TripleFault,
        INIT => VmExit::Init,
        SIPI => VmExit::Sipi { vector: q as u8 },
        CPUID => VmExit::Cpuid {
            leaf: raw.rax as u32,
            subleaf: raw.rcx as u32,
        },
        HLT => VmExit::Hlt,
        INVD => VmExit::Invd,
        VMCALL => VmExit::Vmcall,
        VMCLEAR | VMLAUNCH | VMPTRLD | VMPTRST | VMREAD | VMRESUME | VMWRITE | VMXOFF | VMXON
        | INVEPT | INVVPID | VMFUNC => VmExit::VmxInstruction(basic),
        CR_ACCESS => {
            let cr = (q & 0xf) as u8;
            let gpr = ((q >> 8) & 0xf) as u8;
            VmExit::Cr(match (q >> 4) & 3 {
                0 => CrAccess::MovTo { cr, gpr },
                1 => CrAccess::MovFrom { cr, gpr },
                2 => CrAccess::Clts,
                _ => CrAccess::Lmsw {
                    source: (q >> 16) as u16,
                },
            })
        }
        IO_INSTRUCTION => VmExit::Io(IoAccess {
            size: ((q & 7) + 1) as u8,
            input: q & (1 << 3) != 0,
            string: q & (1 << 4) != 0,
            rep: q & (1 << 5) != 0,
            port: (q >> 16) as u16,
        }),
        RDMSR => VmExit::MsrRead {
            msr: raw.rcx as u32,
        },
        WRMSR => VmExit::MsrWrite {
            msr: raw.rcx as u32,
            value: (raw.rax & 0xffff_ffff) | (raw.rdx << 32),
        },
        EPT_VIOLATION => VmExit::EptViolation(EptViolation {
            gpa: raw.guest_physical,
            gla: if q & (1 << 7) != 0 {
                Some(raw.guest_linear)
            } else {
                None
            },
            read: q & 1 != 0,
            write: q & 2 != 0,
            fetch: q & 4 != 0,
            allowed: ((q >> 3) & 7) as u8,
        }),
        EPT_MISCONFIG => VmExit::EptMisconfig {
            gpa: raw.guest_physical,
        },
        PREEMPTION_TIMER => VmExit::PreemptionTimer,
        XSETBV => VmExit::Xsetbv {
            xcr: raw.rcx as u32,
            value: (raw.rax & 0xffff_ffff) | (raw.rdx << 32),
        },
        other => VmExit::Unknown(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(reason: u32, q: u64) -> RawExit {
        RawExit {
            reason,
            qualification: q,
            ..Default::default()
        }
    }

    #[test]
    fn nmis_windows_task_switches_and_getsec_are_named() {
        // An NMI exit is reason 0 with interruption type 2.
        let nmi = RawExit {
            reason: 0,
            interruption_info: 0x8000_0202,
            ..Default::default()
        };
        assert_eq!(decode(&nmi), VmExit::Nmi);
        // A #DB exit is reason 0 with type 3.
        let db = RawExit {
            reason: 0,
            interruption_info: 0x8000_0301,
            ..Default::default()
        };
        assert_eq!(
            decode(&db),
            VmExit::Exception {
                vector: 1,
                info: 0x8000_0301
            }
        );
        assert_eq!(decode(&raw(8, 0)), VmExit::NmiWindow);
        assert_eq!(
            decode(&raw(9, 0x4000_0028)),
            VmExit::TaskSwitch {
                qualification: 0x4000_0028
            }
        );
        assert_eq!(decode(&raw(11, 0)), VmExit::Getsec);
        assert_eq!(reason_name(8), "NMI_WINDOW");
    }

    #[test]
    fn cpuid_and_msr_operands_come_from_registers() {
        let r = RawExit {
            reason: 10,
            rax: 0xffff_ffff_0000_0001,
            rcx: 0x1_0000_0002,
            ..Default::default()
        };
        assert_eq!(
            decode(&r),
            VmExit::Cpuid {
                leaf: 1,
                subleaf: 2
            }
        );
        let r = RawExit {
            reason: 32,
            rcx: 0x3a,
            rax: 0xdead_0000_0000_0005,
            rdx: 0x1,
            ..Default::default()
        };
        assert_eq!(
            decode(&r),
            VmExit::MsrWrite {
                msr: 0x3a,
                value: 0x1_0000_0005
            }
        );
        let r = RawExit {
            reason: 55,
            rcx: 0,
            rax: 7,
            rdx: 0,
            ..Default::default()
        };
        assert_eq!(decode(&r), VmExit::Xsetbv { xcr: 0, value: 7 });
    }

    #[test]
    fn cr_access_qualification() {
        // MOV to CR4 from RBX (gpr 3).
        assert_eq!(
            decode(&raw(28, 0x0304)),
            VmExit::Cr(CrAccess::MovTo { cr: 4, gpr: 3 })
        );
        // MOV from CR0 to R12.
        assert_eq!(
            decode(&raw(28, 0x0c10)),
            VmExit::Cr(CrAccess::MovFrom { cr: 0, gpr: 12 })
        );
        assert_eq!(decode(&raw(28, 0x20)), VmExit::Cr(CrAccess::Clts));
        assert_eq!(
            decode(&raw(28, 0x0001_0030)),
            VmExit::Cr(CrAccess::Lmsw { source: 1 })
        );
    }

    #[test]
    fn io_qualification() {
        // inb from 0x2fd.
        let e = decode(&raw(30, (0x2fd << 16) | 0x8));
        assert_eq!(
            e,
            VmExit::Io(IoAccess {
                port: 0x2fd,
                size: 1,
                input: true,
                string: false,
                rep: false
            })
        );
        // rep outsw to 0x2f8.
        let e = decode(&raw(30, (0x2f8 << 16) | 0x31));
        assert_eq!(
            e,
            VmExit::Io(IoAccess {
                port: 0x2f8,
                size: 2,
                input: false,
                string: true,
                rep: true
            })
        );
    }

    #[test]
    fn ept_violation_and_entry_failure() {
        let r = RawExit {
            reason: 48,
            qualification: 0x82 | (1 << 3),
            guest_physical: 0x200_0000,
            guest_linear: 0xffff_8880_0200_0000,
            ..Default::default()
        };
        let VmExit::EptViolation(v) = decode(&r) else {
            panic!("not an EPT violation")
        };
        assert!(v.write && !v.read && !v.fetch);
        assert_eq!(v.allowed, 1);
        assert_eq!(v.gla, Some(0xffff_8880_0200_0000));
        assert_eq!(
            decode(&raw(0x8000_0021, 2)),
            VmExit::EntryFailure {
                reason: 33,
                qualification: 2
            }
        );
    }

    #[test]
    fn unknown_reasons_are_kept() {
        assert_eq!(decode(&raw(63, 0)), VmExit::Unknown(63));
        assert_eq!(reason_name(63), "XSAVES");
        assert_eq!(reason_name(200), "UNKNOWN");
        assert_eq!(decode(&raw(18, 0)), VmExit::Vmcall);
        assert_eq!(decode(&raw(27, 0)), VmExit::VmxInstruction(27));
    }
}
