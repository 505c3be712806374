//! The exits root answers from policy alone: CPUID, RDMSR, WRMSR, XSETBV,
//! the VMX instructions and GETSEC, INVD, NMIs and their windows, a triple
//! fault and INIT. [`handle`] decides each (the rules are in
//! [`crate::policy`]), performs it through [`HostCpu`] and the guest's
//! registers, and says what the exit loop does next. The exits that need
//! root's own machinery (I/O, control registers, task switches, the
//! tracer's VMCALL and #DB, EPT, the timer) come back as
//! [`Outcome::Root`] for the binary's handlers.

use super::event::Event;
use super::exit::VmExit;
use super::regs::GuestRegs;
use crate::policy::{self, MsrRead, MsrWrite};
use protocol::GuardReport;

/// #DB.
pub const DB: u8 = 1;
/// #UD.
pub const UD: u8 = 6;
/// #GP.
pub const GP: u8 = 13;

/// The instructions [`handle`] runs on the host CPU on the guest's behalf.
pub trait HostCpu {
    /// CPUID of the host CPU.
    fn cpuid(&self, leaf: u32, subleaf: u32) -> [u32; 4];
    /// IA32_FEATURE_CONTROL.
    fn feature_control(&self) -> u64;
    /// WRMSR of a value policy lets through; `Err` when the CPU refuses it
    /// (#GP).
    fn write_msr(&mut self, msr: u32, value: u64) -> Result<(), MsrRefused>;
    /// XSETBV of a value policy checked.
    fn xsetbv(&mut self, xcr: u32, value: u64);
}

/// The CPU refused a WRMSR (it raised #GP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsrRefused;

/// What the exit loop does after [`handle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The instruction completed: skip it and resume.
    Advance,
    /// Deliver this event at the next entry (the instruction did not run).
    Inject(Event),
    /// Resume where the guest was.
    Resume,
    /// An NMI arrived in the guest: root marks it pending for the guest
    /// and resumes.
    Nmi,
    /// The guest cannot go on: it triple-faulted.
    TripleFault,
    /// The guest got INIT: it reset.
    Reset,
    /// Not decided here: root's own handler takes the exit.
    Root(VmExit),
}

/// Decides and performs the exits that policy alone answers; counts what
/// root refused in `guard`.
pub fn handle(
    exit: VmExit,
    regs: &mut GuestRegs,
    cpu: &mut impl HostCpu,
    guard: &mut GuardReport,
) -> Outcome {
    let gp = Outcome::Inject(Event::exception(GP, Some(0)));
    let ud = Outcome::Inject(Event::exception(UD, None));
    match exit {
        VmExit::Cpuid { leaf, subleaf } => {
            let r = policy::filter_cpuid(leaf, subleaf, cpu.cpuid(leaf, subleaf));
            regs.rax = u64::from(r[0]);
            regs.rbx = u64::from(r[1]);
            regs.rcx = u64::from(r[2]);
            regs.rdx = u64::from(r[3]);
            Outcome::Advance
        }
        VmExit::MsrRead { msr } => {
            let real = if msr == policy::MSR_FEATURE_CONTROL {
                cpu.feature_control()
            } else {
                0
            };
            match policy::msr_read(msr, real) {
                MsrRead::Value(val) => {
                    regs.rax = val & 0xffff_ffff;
                    regs.rdx = val >> 32;
                    Outcome::Advance
                }
                MsrRead::Fault => gp,
            }
        }
        VmExit::MsrWrite { msr, value } => {
            let hv = loader::layout::HV_RESERVED.as_u64()..loader::layout::HV_RESERVED_END.as_u64();
            match policy::msr_write(msr, value, hv) {
                MsrWrite::Forward => match cpu.write_msr(msr, value) {
                    Ok(()) => Outcome::Advance,
                    Err(MsrRefused) => gp,
                },
                MsrWrite::Fault => {
                    if msr == policy::MSR_APIC_BASE {
                        guard.apic_moves_refused += 1;
                    }
                    gp
                }
            }
        }
        VmExit::Xsetbv { xcr, value } => {
            let leaf = cpu.cpuid(0xd, 0);
            let supported = u64::from(leaf[0]) | (u64::from(leaf[3]) << 32);
            if policy::xsetbv_valid(xcr, value, supported) {
                cpu.xsetbv(xcr, value);
                Outcome::Advance
            } else {
                guard.xsetbv_refused += 1;
                gp
            }
        }
        // VMX is not offered to the guest, SMX is hidden and CR4.SMXE
        // refused: their instructions are #UD.
        VmExit::VmxInstruction(_) | VmExit::Getsec => ud,
        VmExit::Invd => Outcome::Advance,
        VmExit::Nmi => {
            guard.nmi_exits += 1;
            Outcome::Nmi
        }
        VmExit::NmiWindow => {
            // The entry that follows injects the pending NMI.
            guard.nmi_windows += 1;
            Outcome::Resume
        }
        VmExit::TripleFault => Outcome::TripleFault,
        VmExit::Init => Outcome::Reset,
        other => Outcome::Root(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmx::exit::CrAccess;

    /// A host CPU with XSAVE (x87, SSE, AVX) and a locked FEATURE_CONTROL.
    #[derive(Default)]
    struct Cpu {
        written: Vec<(u32, u64)>,
        xcr0: Option<u64>,
        refuse_writes: bool,
    }

    impl HostCpu for Cpu {
        fn cpuid(&self, leaf: u32, _subleaf: u32) -> [u32; 4] {
            match leaf {
                // Vendor "GenuineIntel", max leaf 0xd.
                0 => [0xd, 0x756e_6547, 0x6c65_746e, 0x4965_6e69],
                // VMX (ecx 5), SMX (6), XSAVE/OSXSAVE (26/27), and the
                // hypervisor bit (31), as under KVM.
                1 => [
                    0x000906ea,
                    0,
                    (1 << 5) | (1 << 6) | (1 << 26) | (1 << 27) | (1 << 31),
                    0,
                ],
                // LA57 (ecx 16) and UMIP (ecx 2), as `-cpu host` on an Ice
                // Lake-SP host offers them.
                7 => [0, 0, (1 << 16) | (1 << 2), 0],
                0xd => [0b111, 0, 0, 0],
                // KVM's signature leaf ("KVMKVMKVM") and its features
                // (kvmclock, PV EOI, PV IPIs, ...).
                0x4000_0000 => [0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x0000_004d],
                0x4000_0001 => [0x0100_7afb, 0, 0, 0],
                _ => [0; 4],
            }
        }
        fn feature_control(&self) -> u64 {
            0b101
        }
        fn write_msr(&mut self, msr: u32, value: u64) -> Result<(), MsrRefused> {
            if self.refuse_writes {
                return Err(MsrRefused);
            }
            self.written.push((msr, value));
            Ok(())
        }
        fn xsetbv(&mut self, _xcr: u32, value: u64) {
            self.xcr0 = Some(value);
        }
    }

    fn run(exit: VmExit, cpu: &mut Cpu) -> (Outcome, GuestRegs, GuardReport) {
        let mut regs = GuestRegs::default();
        let mut guard = GuardReport::default();
        let o = handle(exit, &mut regs, cpu, &mut guard);
        (o, regs, guard)
    }

    fn is_gp(o: Outcome) -> bool {
        o == Outcome::Inject(Event::exception(GP, Some(0)))
    }

    #[test]
    fn cpuid_is_filtered_into_the_guests_registers() {
        let mut cpu = Cpu::default();
        let (o, regs, _) = run(
            VmExit::Cpuid {
                leaf: 1,
                subleaf: 0,
            },
            &mut cpu,
        );
        assert_eq!(o, Outcome::Advance);
        let want = policy::filter_cpuid(1, 0, cpu.cpuid(1, 0));
        assert_eq!(regs.rcx, u64::from(want[2]));
        assert_eq!(regs.rcx & (1 << 5), 0, "VMX is hidden from the guest");
        assert_eq!(regs.rcx & (1 << 6), 0, "SMX is hidden with it");
        assert_eq!(regs.rcx & (3 << 26), 3 << 26, "XSAVE passes through");
        assert_eq!(regs.rax, 0x000906ea);
    }

    #[test]
    fn the_host_hypervisor_and_5_level_paging_are_hidden() {
        let mut cpu = Cpu::default();
        let mut leaf = |leaf, subleaf| {
            let (o, regs, _) = run(VmExit::Cpuid { leaf, subleaf }, &mut cpu);
            assert_eq!(o, Outcome::Advance);
            [regs.rax, regs.rbx, regs.rcx, regs.rdx]
        };
        assert_eq!(leaf(1, 0)[2] & (1 << 31), 0, "no hypervisor bit");
        let seven = leaf(7, 0);
        assert_eq!(seven[2] & (1 << 16), 0, "no LA57");
        assert_eq!(seven[2] & (1 << 2), 1 << 2, "UMIP passes through");
        for l in [0x4000_0000, 0x4000_0001, 0x4000_0100, 0x4fff_ffff] {
            assert_eq!(leaf(l, 0), [0; 4], "leaf {l:#x}");
        }
    }

    #[test]
    fn msr_reads_split_the_value_or_fault() {
        let mut cpu = Cpu::default();
        let (o, regs, _) = run(
            VmExit::MsrRead {
                msr: policy::MSR_FEATURE_CONTROL,
            },
            &mut cpu,
        );
        assert_eq!(o, Outcome::Advance);
        let MsrRead::Value(v) = policy::msr_read(policy::MSR_FEATURE_CONTROL, 0b101) else {
            panic!("FEATURE_CONTROL is readable");
        };
        assert_eq!((regs.rax, regs.rdx), (v & 0xffff_ffff, v >> 32));
        // A VMX capability MSR: the guest has no VMX.
        let (o, _, _) = run(VmExit::MsrRead { msr: 0x480 }, &mut cpu);
        assert!(is_gp(o));
    }

    #[test]
    fn the_apic_cannot_be_moved_into_hypervisor_memory() {
        let mut cpu = Cpu::default();
        let into_hv = loader::layout::HV_RESERVED.as_u64() | 0x900;
        let (o, _, guard) = run(
            VmExit::MsrWrite {
                msr: policy::MSR_APIC_BASE,
                value: into_hv,
            },
            &mut cpu,
        );
        assert!(is_gp(o));
        assert_eq!(guard.apic_moves_refused, 1);
        assert!(cpu.written.is_empty(), "nothing reached the CPU");
        // Its usual place is forwarded.
        let (o, _, _) = run(
            VmExit::MsrWrite {
                msr: policy::MSR_APIC_BASE,
                value: 0xfee0_0900,
            },
            &mut cpu,
        );
        assert_eq!(o, Outcome::Advance);
        assert_eq!(cpu.written, vec![(policy::MSR_APIC_BASE, 0xfee0_0900)]);
        // A value the CPU refuses is the guest's #GP.
        cpu.refuse_writes = true;
        let (o, _, _) = run(
            VmExit::MsrWrite {
                msr: policy::MSR_APIC_BASE,
                value: 0xfee0_0900,
            },
            &mut cpu,
        );
        assert!(is_gp(o));
    }

    #[test]
    fn xsetbv_takes_only_what_the_cpu_supports() {
        let mut cpu = Cpu::default();
        let (o, _, _) = run(
            VmExit::Xsetbv {
                xcr: 0,
                value: 0b111,
            },
            &mut cpu,
        );
        assert_eq!(o, Outcome::Advance);
        assert_eq!(cpu.xcr0, Some(0b111));
        // AVX-512 state the CPU does not have.
        let (o, _, guard) = run(
            VmExit::Xsetbv {
                xcr: 0,
                value: 0b1110_0111,
            },
            &mut cpu,
        );
        assert!(is_gp(o));
        assert_eq!(guard.xsetbv_refused, 1);
        assert_eq!(cpu.xcr0, Some(0b111), "unchanged");
    }

    #[test]
    fn vmx_and_smx_instructions_are_undefined() {
        let mut cpu = Cpu::default();
        for exit in [VmExit::VmxInstruction(27), VmExit::Getsec] {
            let (o, _, _) = run(exit, &mut cpu);
            assert_eq!(o, Outcome::Inject(Event::exception(UD, None)));
        }
    }

    #[test]
    fn nmis_triple_faults_and_init_are_told_to_root() {
        let mut cpu = Cpu::default();
        let (o, _, g) = run(VmExit::Nmi, &mut cpu);
        assert_eq!((o, g.nmi_exits), (Outcome::Nmi, 1));
        let (o, _, g) = run(VmExit::NmiWindow, &mut cpu);
        assert_eq!((o, g.nmi_windows), (Outcome::Resume, 1));
        assert_eq!(run(VmExit::TripleFault, &mut cpu).0, Outcome::TripleFault);
        assert_eq!(run(VmExit::Init, &mut cpu).0, Outcome::Reset);
        assert_eq!(run(VmExit::Invd, &mut cpu).0, Outcome::Advance);
        let cr = VmExit::Cr(CrAccess::Clts);
        assert_eq!(run(cr, &mut cpu).0, Outcome::Root(cr));
        assert_eq!(
            run(VmExit::Vmcall, &mut cpu).0,
            Outcome::Root(VmExit::Vmcall)
        );
    }
}
