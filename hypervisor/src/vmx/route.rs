//! Where root's exit loop sends each exit. [`early`] takes the exits that
//! root carries out before the policy exits ([`super::handle`]) can see
//! them: an AP's INIT and SIPI, the guest's interrupt commands and stores
//! to the interrupt windows, x2APIC LVT and ICR writes, moves of the APIC
//! page. [`late`] names root's own handler for what the policy leaves
//! ([`super::handle::Outcome::Root`]). Root's exit loop follows both; the
//! host tests walk every exit through them.

use super::exit::{CrAccess, EptViolation, IoAccess, VmExit};
use crate::apic;
use crate::irq::{Window, Windows};
use crate::policy;

/// The IA32_APIC_BASE bits that place the APIC page.
pub const APIC_BASE_ADDRESS: u64 = 0x000f_ffff_ffff_f000;

/// What [`early`] decides on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Context {
    /// The exit is an application processor's (not the boot processor's).
    pub ap: bool,
    /// vCPUs in the VM.
    pub vcpus: usize,
    /// The guest-physical base of this vCPU's APIC page, where root
    /// watches its interrupt commands (0: none).
    pub lapic: u64,
    /// The APIC page every vCPU's APIC base must keep with more than one
    /// vCPU.
    pub vm_lapic: u64,
    /// The interrupt windows root watches, when it watches them.
    pub windows: Option<Windows>,
}

/// An exit root carries out before the policy exits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Early {
    /// An AP's start-up IPI: root starts the AP at the guest's vector.
    ApSipi,
    /// An AP's INIT: root parks or resets it.
    ApInit,
    /// A store to the xAPIC's interrupt command register.
    IcrStore,
    /// A store to an I/O APIC page or to the MSI window.
    WindowStore(Window),
    /// A write of an x2APIC LVT entry with a delivery mode root refuses
    /// (INIT, SMI or reserved): dropped and counted.
    LvtRefused {
        /// The value refused.
        value: u64,
    },
    /// A write of an x2APIC LVT entry the guest may make: performed on
    /// its behalf (the CPU's #GP, if any, goes to the guest).
    LvtWrite {
        /// The MSR.
        msr: u32,
        /// The value.
        value: u64,
    },
    /// A move of the APIC page with more than one vCPU: #GP, counted
    /// (root watches the start-up IPIs there).
    ApicBaseRefused,
    /// A write of the x2APIC's ICR: the guest's IPI, checked.
    X2apicIcr {
        /// The ICR value.
        value: u64,
    },
}

/// The exits root carries out before the policy exits see them; `None`
/// sends the exit on to [`super::handle::handle`].
pub fn early(exit: &VmExit, ctx: &Context) -> Option<Early> {
    match *exit {
        VmExit::Sipi { .. } if ctx.ap => Some(Early::ApSipi),
        VmExit::Init if ctx.ap => Some(Early::ApInit),
        VmExit::EptViolation(e) if e.write => {
            if ctx.lapic != 0 && e.gpa == ctx.lapic + apic::XAPIC_ICR_LOW {
                return Some(Early::IcrStore);
            }
            match ctx.windows.and_then(|w| w.classify(e.gpa)) {
                // Every other store to the APIC page is the local exit's.
                Some(Window::LocalApic { .. }) | None => None,
                Some(w) => Some(Early::WindowStore(w)),
            }
        }
        VmExit::MsrWrite { msr, value } => {
            if let Some(offset) = apic::x2apic_lvt_offset(msr) {
                // Bits 32..=63 are reserved: the CPU refuses them itself.
                let refused = value >> 32 == 0
                    && apic::register_write(offset, value as u32) == apic::RegisterWrite::Refuse;
                return Some(if refused {
                    Early::LvtRefused { value }
                } else {
                    Early::LvtWrite { msr, value }
                });
            }
            if msr == policy::MSR_APIC_BASE
                && ctx.vcpus > 1
                && value & APIC_BASE_ADDRESS != ctx.vm_lapic
            {
                return Some(Early::ApicBaseRefused);
            }
            (msr == apic::X2APIC_ICR_MSR).then_some(Early::X2apicIcr { value })
        }
        _ => None,
    }
}

/// Root's handler for an exit the policy left to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Late {
    /// A control-register access (`super::cr`).
    Cr(CrAccess),
    /// Port I/O (`super::port`).
    Io(IoAccess),
    /// A task switch (`crate::task_switch`).
    TaskSwitch(u64),
    /// The tracer's hypercall.
    Vmcall,
    /// #DB: the tracer's single step, or the guest's own.
    Debug(u32),
    /// An external interrupt during a step.
    ExternalInterrupt,
    /// The preemption timer: root's turn.
    Timer,
    /// An EPT violation: the tracer's split view, or memory not the
    /// guest's.
    EptViolation(EptViolation),
    /// The VM stops: an EPT misconfiguration or a failed entry is root's
    /// bug, and an exit root does not expect cannot be served.
    Stop,
}

/// Root's handler for `exit`, one the policy exits returned as their
/// `Outcome::Root`.
pub fn late(exit: &VmExit) -> Late {
    match *exit {
        VmExit::Cr(access) => Late::Cr(access),
        VmExit::Io(io) => Late::Io(io),
        VmExit::TaskSwitch { qualification } => Late::TaskSwitch(qualification),
        VmExit::Vmcall => Late::Vmcall,
        VmExit::Exception {
            vector: super::handle::DB,
            info,
        } => Late::Debug(info),
        VmExit::ExternalInterrupt => Late::ExternalInterrupt,
        VmExit::PreemptionTimer => Late::Timer,
        VmExit::EptViolation(e) => Late::EptViolation(e),
        _ => Late::Stop,
    }
}

#[cfg(test)]
mod tests {
    use super::super::handle::{self, HostCpu, MsrRefused, Outcome};
    use super::super::regs::GuestRegs;
    use super::*;
    use protocol::GuardReport;

    const LAPIC: u64 = 0xfee0_0000;

    fn ctx(ap: bool, vcpus: usize) -> Context {
        Context {
            ap,
            vcpus,
            lapic: LAPIC,
            vm_lapic: LAPIC,
            windows: Some(Windows::new(LAPIC, &[0xfec0_0000])),
        }
    }

    fn violation(gpa: u64, write: bool) -> VmExit {
        VmExit::EptViolation(EptViolation {
            gpa,
            read: !write,
            write,
            fetch: false,
            gla: None,
            allowed: 0,
        })
    }

    /// A CPU that refuses nothing and reports a plain Intel CPUID.
    struct Cpu;
    impl HostCpu for Cpu {
        fn cpuid(&self, _: u32, _: u32) -> [u32; 4] {
            [0; 4]
        }
        fn feature_control(&self) -> u64 {
            0
        }
        fn write_msr(&mut self, _: u32, _: u64) -> Result<(), MsrRefused> {
            Ok(())
        }
        fn xsetbv(&mut self, _: u32, _: u64) {}
    }

    /// Names every kind of exit with no catch-all: a new kind does not
    /// compile until [`every_exit`] has one of it.
    fn kind(e: &VmExit) -> u8 {
        match e {
            VmExit::Exception { .. } => 0,
            VmExit::Nmi => 1,
            VmExit::NmiWindow => 2,
            VmExit::TaskSwitch { .. } => 3,
            VmExit::Getsec => 4,
            VmExit::ExternalInterrupt => 5,
            VmExit::TripleFault => 6,
            VmExit::Init => 7,
            VmExit::Sipi { .. } => 8,
            VmExit::Cpuid { .. } => 9,
            VmExit::Hlt => 10,
            VmExit::Invd => 11,
            VmExit::Vmcall => 12,
            VmExit::VmxInstruction(_) => 13,
            VmExit::Cr(_) => 14,
            VmExit::Io(_) => 15,
            VmExit::MsrRead { .. } => 16,
            VmExit::MsrWrite { .. } => 17,
            VmExit::EntryFailure { .. } => 18,
            VmExit::EptViolation(_) => 19,
            VmExit::EptMisconfig { .. } => 20,
            VmExit::PreemptionTimer => 21,
            VmExit::Xsetbv { .. } => 22,
            VmExit::Unknown(_) => 23,
        }
    }
    const KINDS: u8 = 24;

    /// One exit of every kind the decoder makes.
    fn every_exit() -> Vec<VmExit> {
        let io = IoAccess {
            port: 0x3f8,
            size: 1,
            input: false,
            string: false,
            rep: false,
        };
        vec![
            VmExit::Exception {
                vector: handle::DB,
                info: 0x8000_0301,
            },
            VmExit::Exception {
                vector: 14,
                info: 0x8000_0b0e,
            },
            VmExit::Nmi,
            VmExit::NmiWindow,
            VmExit::TaskSwitch {
                qualification: 0x28,
            },
            VmExit::Getsec,
            VmExit::ExternalInterrupt,
            VmExit::TripleFault,
            VmExit::Init,
            VmExit::Sipi { vector: 0x9a },
            VmExit::Cpuid {
                leaf: 0,
                subleaf: 0,
            },
            VmExit::Hlt,
            VmExit::Invd,
            VmExit::Vmcall,
            VmExit::VmxInstruction(23),
            VmExit::Cr(CrAccess::Clts),
            VmExit::Io(io),
            VmExit::MsrRead { msr: 0x10 },
            VmExit::MsrWrite {
                msr: 0x10,
                value: 0,
            },
            VmExit::EntryFailure {
                reason: 33,
                qualification: 0,
            },
            violation(0x1000, false),
            VmExit::EptMisconfig { gpa: 0x1000 },
            VmExit::PreemptionTimer,
            VmExit::Xsetbv { xcr: 0, value: 1 },
            VmExit::Unknown(60),
        ]
    }

    #[test]
    fn every_exit_has_one_route() {
        let mut kinds: Vec<u8> = every_exit().iter().map(kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(
            kinds,
            (0..KINDS).collect::<Vec<_>>(),
            "an exit of every kind"
        );
        // The boot processor, one vCPU: nothing early but for the MSR
        // writes root watches; the policy answers what it knows; root's
        // handlers take the rest, and what none expects stops the VM.
        for exit in every_exit() {
            assert_eq!(early(&exit, &ctx(false, 1)), None, "{exit:?}");
            let mut regs = GuestRegs::default();
            let mut guard = GuardReport::default();
            let outcome = handle::handle(exit, &mut regs, &mut Cpu, &mut guard);
            let route = match outcome {
                Outcome::Root(e) => Some(late(&e)),
                _ => None,
            };
            let want = match exit {
                VmExit::Cr(a) => Some(Late::Cr(a)),
                VmExit::Io(io) => Some(Late::Io(io)),
                VmExit::TaskSwitch { qualification } => Some(Late::TaskSwitch(qualification)),
                VmExit::Vmcall => Some(Late::Vmcall),
                VmExit::Exception { vector: 1, info } => Some(Late::Debug(info)),
                VmExit::ExternalInterrupt => Some(Late::ExternalInterrupt),
                VmExit::PreemptionTimer => Some(Late::Timer),
                VmExit::EptViolation(e) => Some(Late::EptViolation(e)),
                VmExit::EptMisconfig { .. }
                | VmExit::EntryFailure { .. }
                | VmExit::Exception { .. }
                | VmExit::Hlt
                | VmExit::Unknown(_)
                | VmExit::Sipi { .. } => Some(Late::Stop),
                // The policy's own: CPUID, MSRs, XSETBV, VMX instructions,
                // GETSEC, INVD, NMIs and their window, a triple fault,
                // the boot processor's INIT.
                _ => None,
            };
            assert_eq!(route, want, "{exit:?} ({outcome:?})");
        }
    }

    #[test]
    fn an_aps_init_and_sipi_are_roots_the_boot_processors_are_not() {
        let ap = ctx(true, 2);
        assert_eq!(early(&VmExit::Init, &ap), Some(Early::ApInit));
        assert_eq!(
            early(&VmExit::Sipi { vector: 0x9a }, &ap),
            Some(Early::ApSipi)
        );
        let bsp = ctx(false, 2);
        assert_eq!(early(&VmExit::Init, &bsp), None);
        assert_eq!(early(&VmExit::Sipi { vector: 0x9a }, &bsp), None);
    }

    #[test]
    fn stores_to_the_icr_and_the_windows_are_roots_reads_are_not() {
        let c = ctx(true, 2);
        let icr = LAPIC + apic::XAPIC_ICR_LOW;
        assert_eq!(early(&violation(icr, true), &c), Some(Early::IcrStore));
        assert_eq!(early(&violation(icr, false), &c), None);
        // Another APIC register: the local exit's, not here.
        assert_eq!(early(&violation(LAPIC + 0x80, true), &c), None);
        assert_eq!(
            early(&violation(0xfec0_0010, true), &c),
            Some(Early::WindowStore(Window::IoApic {
                base: 0xfec0_0000,
                offset: 0x10
            }))
        );
        assert_eq!(
            early(&violation(0xfee0_1000, true), &c),
            Some(Early::WindowStore(Window::Msi {
                address: 0xfee0_1000
            }))
        );
        assert_eq!(early(&violation(0x10_0000, true), &c), None, "RAM");
        let unwatched = Context {
            lapic: 0,
            windows: None,
            ..c
        };
        assert_eq!(early(&violation(icr, true), &unwatched), None);
    }

    #[test]
    fn x2apic_writes_root_checks() {
        let c = ctx(false, 1);
        // LVT timer (0x832): fixed delivery passes, INIT is refused, a
        // reserved high half goes to the CPU (which faults it).
        let lvt = 0x832;
        let fixed = 0x30;
        assert_eq!(
            early(
                &VmExit::MsrWrite {
                    msr: lvt,
                    value: fixed
                },
                &c
            ),
            Some(Early::LvtWrite {
                msr: lvt,
                value: fixed
            })
        );
        let init = 5 << 8;
        assert_eq!(
            early(
                &VmExit::MsrWrite {
                    msr: lvt,
                    value: init
                },
                &c
            ),
            Some(Early::LvtRefused { value: init })
        );
        let high = 1 << 32 | init;
        assert_eq!(
            early(
                &VmExit::MsrWrite {
                    msr: lvt,
                    value: high
                },
                &c
            ),
            Some(Early::LvtWrite {
                msr: lvt,
                value: high
            })
        );
        assert_eq!(
            early(
                &VmExit::MsrWrite {
                    msr: apic::X2APIC_ICR_MSR,
                    value: 0x4500
                },
                &c
            ),
            Some(Early::X2apicIcr { value: 0x4500 })
        );
    }

    #[test]
    fn the_apic_page_stays_put_only_with_more_than_one_vcpu() {
        let base = |v| VmExit::MsrWrite {
            msr: policy::MSR_APIC_BASE,
            value: v,
        };
        let moved = 0xfed0_0000 | 1 << 11;
        assert_eq!(
            early(&base(moved), &ctx(false, 2)),
            Some(Early::ApicBaseRefused)
        );
        assert_eq!(
            early(&base(LAPIC | 1 << 11 | 1 << 10), &ctx(false, 2)),
            None
        );
        assert_eq!(
            early(&base(moved), &ctx(false, 1)),
            None,
            "one vCPU: policy's"
        );
    }
}
