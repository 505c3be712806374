//! The exits root answers from policy alone: CPUID, RDMSR, WRMSR, XSETBV,
//! the VMX instructions and GETSEC, INVD, NMIs and their windows, a triple
//! fault and INIT. [`handle`] decides each (the rules are in
//! [`crate::policy`], and CPUID's whitelist in [`crate::cpuid`]), performs
//! it through [`HostCpu`] and the guest's registers, and says what the
//! exit loop does next. The exits that need root's own machinery (I/O,
//! control registers, task switches, the tracer's VMCALL and #DB, EPT, the
//! timer) come back as [`Outcome::Root`] for the binary's handlers.

use super::event::Event;
use super::exit::VmExit;
use super::regs::GuestRegs;
use crate::cpuid;
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
            let r = cpuid::for_guest(leaf, subleaf, |l, s| cpu.cpuid(l, s));
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
            // What the guest reads in (0xD,0): the components of the
            // features it is not shown are refused like unsupported ones.
            let supported = cpuid::xcr0_for_guest(|l, s| cpu.cpuid(l, s));
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

    /// A CPU's CPUID: leaf, subleaf to EAX, EBX, ECX, EDX.
    type Leaves = fn(u32, u32) -> [u32; 4];

    /// A host CPU with a locked FEATURE_CONTROL and the CPUID of `leaves`
    /// (by default [`kvm_ice_lake`]: XSAVE with x87, SSE and AVX).
    struct Cpu {
        leaves: Leaves,
        written: Vec<(u32, u64)>,
        xcr0: Option<u64>,
        refuse_writes: bool,
    }

    impl Default for Cpu {
        fn default() -> Self {
            Cpu::with(kvm_ice_lake)
        }
    }

    impl Cpu {
        fn with(leaves: Leaves) -> Self {
            Cpu {
                leaves,
                written: Vec::new(),
                xcr0: None,
                refuse_writes: false,
            }
        }
    }

    /// "GenuineIntel" in EBX, ECX, EDX.
    const INTEL: [u32; 3] = [0x756e_6547, 0x6c65_746e, 0x4965_6e69];
    /// KVM's signature leaf: its highest leaf and "KVMKVMKVM".
    const KVM_SIGNATURE: [u32; 4] = [0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x0000_004d];

    /// A guest of nested KVM with `-cpu host` on an Ice Lake-SP host: VMX
    /// (ECX 5), SMX (6), XSAVE and OSXSAVE (26, 27), the hypervisor bit
    /// (31), LA57 and UMIP in (7,0):ECX (16, 2), 57-bit linear addresses,
    /// and KVM's own leaves (kvmclock, PV EOI, PV IPIs, ...).
    fn kvm_ice_lake(leaf: u32, _subleaf: u32) -> [u32; 4] {
        let [b, c, d] = INTEL;
        match leaf {
            0 => [0xd, b, c, d],
            1 => [
                0x0006_06a6,
                0,
                (1 << 5) | (1 << 6) | (1 << 26) | (1 << 27) | (1 << 31),
                0,
            ],
            7 => [0, 0, (1 << 16) | (1 << 2), 0],
            0xd => [0b111, 0, 0, 0],
            0x4000_0000 => KVM_SIGNATURE,
            0x4000_0001 => [0x0100_7afb, 0, 0, 0],
            0x8000_0000 => [0x8000_0008, 0, 0, 0],
            // 46 physical and 57 linear address bits.
            0x8000_0008 => [0x0000_392e, 0, 0, 0],
            _ => [0; 4],
        }
    }

    /// A Sapphire Rapids host under nested KVM's `-cpu host`, with what
    /// later parts add: every feature register all ones (SPR's ISA, and
    /// FRED, LAM, LASS, UINTR, CET, PKS, WAITPKG, PT, SGX, AMX, APX and
    /// bits nothing defines yet), every other leaf all ones, the highest
    /// leaves 0x30 and 0x8000_0028, 5 subleaves of leaf 7, SPR's XSAVE
    /// layout (AVX-512, PKRU, AMX; PT, CET and LBR in IA32_XSS) and KVM's
    /// signature.
    fn sapphire_rapids(leaf: u32, subleaf: u32) -> [u32; 4] {
        let [b, c, d] = INTEL;
        match (leaf, subleaf) {
            (0, _) => [0x30, b, c, d],
            (1, _) => [0x0008_06f8, 0x0080_0800, !0, !0],
            (7, 0) => [5, !0, !0, !0],
            // x87, SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM, PKRU, XTILECFG,
            // XTILEDATA; 11008 bytes with all of them.
            (0xd, 0) => [0x0006_02e7, 0x2b00, 0x2b00, 0],
            // XSAVEOPT, XSAVEC, XGETBV1, XSAVES, XFD; IA32_XSS may hold PT
            // (8), CET_U (11), CET_S (12) and LBR (15).
            (0xd, 1) => [0x1f, 0x2b00, 0x9900, 0],
            // Each component: size, offset, flags.
            (0xd, 2) => [256, 576, 0, 0],
            (0xd, 5) => [64, 1088, 0, 0],
            (0xd, 6) => [512, 1152, 0, 0],
            (0xd, 7) => [1024, 1664, 0, 0],
            (0xd, 8) => [128, 0, 1, 0],
            (0xd, 9) => [8, 2688, 0, 0],
            (0xd, 11) => [16, 0, 1, 0],
            (0xd, 12) => [24, 0, 1, 0],
            (0xd, 15) => [808, 0, 1, 0],
            (0xd, 17) => [64, 2752, 2, 0],
            (0xd, 18) => [8192, 2816, 6, 0],
            (0xd, _) => [0; 4],
            (0x4000_0000, _) => KVM_SIGNATURE,
            (0x8000_0000, _) => [0x8000_0028, 0, 0, 0],
            _ => [!0; 4],
        }
    }

    /// Bochs 2.7's `corei7_haswell_4770` with one CPU, as root reads it:
    /// the leaves Bochs logs at start-up, with CR4.OSXSAVE set (1:ECX[27])
    /// and long mode on (0x8000_0001:EDX[11]), and the subleaves and the
    /// leaves it does not log from its model's source. Bochs answers every
    /// leaf it does not know (above 0xD, 0x4000_0000, above 0x8000_0008)
    /// with the XSAVE leaf.
    fn bochs_haswell(leaf: u32, subleaf: u32) -> [u32; 4] {
        let [b, c, d] = INTEL;
        match (leaf, subleaf) {
            (0, _) => [0xd, b, c, d],
            (1, _) => [0x0003_06c3, 0x0001_0800, 0x7ffa_f3bf, 0xbfeb_fbff],
            (2, _) => [0x7603_6301, 0x00f0_b5ff, 0, 0x00c1_0000],
            (3 | 8 | 9 | 0xc, _) => [0; 4],
            (4, 0) => [0x1c00_4121, 0x01c0_003f, 0x3f, 0],
            (4, 1) => [0x1c00_4122, 0x01c0_003f, 0x3f, 0],
            (4, 2) => [0x1c00_4143, 0x01c0_003f, 0x1ff, 0],
            (4, 3) => [0x1c03_c163, 0x03c0_003f, 0x1fff, 6],
            (4, _) => [0; 4],
            (5, _) => [0x40, 0x40, 3, 0x0004_2120],
            (6, _) => [0x77, 2, 9, 0],
            (7, 0) => [0, 0x27ab, 0, 0],
            (7, _) => [0; 4],
            (0xa, _) => [0x0730_0403, 0, 0, 0x603],
            (0xb, 0) => [1, 1, 0, 0],
            (0xb, s) => [0, 0, s, 0],
            (0x8000_0000, _) => [0x8000_0008, 0, 0, 0],
            (0x8000_0001, _) => [0, 0, 0x21, 0x2c10_0800],
            (0x8000_0002, _) => [0x6574_6e49, 0x2952_286c, 0x726f_4320, 0x4d54_2865],
            (0x8000_0003, _) => [0x3769_2029, 0x3737_342d, 0x5043_2030, 0x2040_2055],
            (0x8000_0004, _) => [0x3034_2e33, 0x007a_4847, 0, 0],
            (0x8000_0005, _) => [0; 4],
            (0x8000_0006, _) => [0, 0, 0x0100_6040, 0],
            (0x8000_0007, _) => [0, 0, 0, 0x100],
            (0x8000_0008, _) => [0x3028, 0, 0, 0],
            // The XSAVE leaf, with XCR0 = x87 | SSE | AVX.
            (_, 0) => [0b111, 0x340, 0x340, 0],
            (_, 1) => [1, 0, 0, 0],
            (_, 2) => [0x100, 0x240, 0, 0],
            _ => [0; 4],
        }
    }

    impl HostCpu for Cpu {
        fn cpuid(&self, leaf: u32, subleaf: u32) -> [u32; 4] {
            (self.leaves)(leaf, subleaf)
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

    /// The guest's EAX, EBX, ECX, EDX after a CPUID exit.
    fn guest_cpuid(cpu: &mut Cpu, leaf: u32, subleaf: u32) -> [u32; 4] {
        let (o, regs, _) = run(VmExit::Cpuid { leaf, subleaf }, cpu);
        assert_eq!(o, Outcome::Advance);
        [regs.rax, regs.rbx, regs.rcx, regs.rdx]
            .map(|r| u32::try_from(r).expect("CPUID clears the upper halves"))
    }

    /// The mask of the bits numbered in `list`.
    fn bits(list: &[u32]) -> u32 {
        list.iter().fold(0, |m, b| m | 1 << b)
    }

    #[test]
    fn cpuid_is_filtered_into_the_guests_registers() {
        let mut cpu = Cpu::default();
        let [eax, _, ecx, _] = guest_cpuid(&mut cpu, 1, 0);
        assert_eq!(ecx & (1 << 5), 0, "VMX is hidden from the guest");
        assert_eq!(ecx & (1 << 6), 0, "SMX is hidden with it");
        assert_eq!(ecx, 3 << 26, "XSAVE and OSXSAVE pass through");
        assert_eq!(eax, 0x0006_06a6);
    }

    #[test]
    fn kvm_and_5_level_paging_are_hidden() {
        let mut cpu = Cpu::default();
        assert_eq!(
            guest_cpuid(&mut cpu, 1, 0)[2] & (1 << 31),
            0,
            "no hypervisor bit"
        );
        let seven = guest_cpuid(&mut cpu, 7, 0);
        assert_eq!(seven[2] & (1 << 16), 0, "no LA57");
        assert_eq!(seven[2] & (1 << 2), 1 << 2, "UMIP passes through");
        for leaf in [0x4000_0000, 0x4000_0001, 0x4000_0100, 0x4fff_ffff] {
            for subleaf in [0, 1] {
                assert_eq!(
                    guest_cpuid(&mut cpu, leaf, subleaf),
                    [0; 4],
                    "leaf {leaf:#x}"
                );
            }
        }
        // 4-level paging's 48 linear bits, the CPU's 46 physical ones.
        assert_eq!(guest_cpuid(&mut cpu, 0x8000_0008, 0), [0x302e, 0, 0, 0]);
        // The CPU's highest leaves are below the whitelist's: they stand.
        assert_eq!(guest_cpuid(&mut cpu, 0, 0)[0], 0xd);
        assert_eq!(guest_cpuid(&mut cpu, 0x8000_0000, 0)[0], 0x8000_0008);
    }

    #[test]
    fn sapphire_rapids_passes_its_isa_and_none_of_its_system_features() {
        let mut cpu = Cpu::with(sapphire_rapids);
        let mut leaf = |leaf, subleaf| guest_cpuid(&mut cpu, leaf, subleaf);

        // Highest leaves: the whitelist's (0x24, 0x8000_0008, subleaf 2).
        let [b, c, d] = INTEL;
        assert_eq!(leaf(0, 0), [0x24, b, c, d]);
        assert_eq!(leaf(0x8000_0000, 0), [0x8000_0008, 0, 0, 0]);

        // Leaf 1: all but DTES64, DS-CPL, VMX, SMX, CNXT-ID, SDBG,
        // reserved 16, DCA and the hypervisor bit; EDX all but reserved
        // 10, 20, 30, the serial number (18) and the debug store (21).
        let [eax, ebx, ecx, edx] = leaf(1, 0);
        assert_eq!((eax, ebx), (0x0008_06f8, 0x0080_0800));
        assert_eq!(ecx, !bits(&[2, 4, 5, 6, 10, 11, 16, 18, 31]));
        assert_eq!(edx, !bits(&[10, 18, 20, 21, 30]));

        // (7,0): the ISA, none of the system features.
        let [eax, ebx, ecx, edx] = leaf(7, 0);
        assert_eq!(eax, 2, "subleaves 0 to 2");
        for (name, reg, bit) in [
            ("SGX", ebx, 2),
            ("PT", ebx, 25),
            ("MPX", ebx, 14),
            ("PKU", ecx, 3),
            ("WAITPKG", ecx, 5),
            ("CET_SS", ecx, 7),
            ("LA57", ecx, 16),
            ("PKS", ecx, 31),
            ("UINTR", edx, 5),
            ("ARCH_LBR", edx, 19),
            ("CET_IBT", edx, 20),
            ("AMX_BF16", edx, 22),
            ("AMX_TILE", edx, 24),
            ("AMX_INT8", edx, 25),
            ("CORE_CAPABILITIES", edx, 30),
        ] {
            assert_eq!(reg & (1 << bit), 0, "{name} is hidden");
        }
        for (name, reg, bit) in [
            ("BMI1", ebx, 3),
            ("AVX2", ebx, 5),
            ("BMI2", ebx, 8),
            ("ERMS", ebx, 9),
            ("AVX512F", ebx, 16),
            ("RDSEED", ebx, 18),
            ("ADX", ebx, 19),
            ("SMAP", ebx, 20),
            ("SHA", ebx, 29),
            ("AVX512VL", ebx, 31),
            ("GFNI", ecx, 8),
            ("VAES", ecx, 9),
            ("RDPID", ecx, 22),
            ("MOVDIR64B", ecx, 28),
            ("FSRM", edx, 4),
            ("SERIALIZE", edx, 14),
            ("AVX512_FP16", edx, 23),
            ("IBRS_IBPB", edx, 26),
        ] {
            assert_ne!(reg & (1 << bit), 0, "{name} passes");
        }
        // And nothing else: the reserved and unknown bits read zero.
        assert_eq!(ebx, !bits(&[2, 12, 14, 15, 22, 25]));
        assert_eq!(
            ecx,
            !bits(&[3, 4, 5, 7, 13, 15, 16, 17, 18, 19, 20, 21, 23, 24, 26, 29, 30, 31])
        );
        assert_eq!(
            edx,
            !bits(&[0, 1, 5, 6, 7, 12, 13, 15, 17, 18, 19, 20, 21, 22, 24, 25, 30])
        );

        // (7,1): FRED (EAX 17), LAM (26), LASS (6), AMX-FP16 (21),
        // AMX-COMPLEX (EDX 8) and APX (EDX 21) are hidden with every bit
        // not named; AVX-VNNI, AVX512_BF16, AVX10 and the like pass.
        let [eax, ebx, ecx, edx] = leaf(7, 1);
        for (name, reg, bit) in [
            ("FRED", eax, 17),
            ("LAM", eax, 26),
            ("LASS", eax, 6),
            ("WRMSRNS", eax, 19),
            ("AMX_FP16", eax, 21),
            ("AMX_COMPLEX", edx, 8),
            ("APX", edx, 21),
        ] {
            assert_eq!(reg & (1 << bit), 0, "{name} is hidden");
        }
        assert_eq!(eax, bits(&[0, 1, 2, 4, 5, 7, 10, 11, 12, 18, 23]));
        assert_eq!(edx, bits(&[4, 5, 10, 14, 19]));
        assert_eq!((ebx, ecx), (0, 0));
        // (7,2): the speculation controls alone; (7,3) is past the count.
        assert_eq!(leaf(7, 2), [0, 0, 0, 0x3f]);
        assert_eq!(leaf(7, 3), [0; 4]);

        // Thermal and power: Bochs's set, without APERF/MPERF and HWP.
        assert_eq!(leaf(6, 0), [0x77, 0xf, 0x8, 0]);
        // AVX10's version and vector lengths.
        assert_eq!(leaf(0x24, 0), [0, 0x0007_00ff, 0, 0]);
        assert_eq!(leaf(0x24, 1), [0; 4]);
        // Extended features and address sizes.
        assert_eq!(leaf(0x8000_0001, 0), [0, 0, 0x121, 0x2c10_0800]);
        assert_eq!(leaf(0x8000_0007, 0), [0, 0, 0, 0x100]);
        assert_eq!(leaf(0x8000_0008, 0), [0x30ff, 0, 0, 0]);

        // Leaves of hidden features, leaves not named, KVM's, and one past
        // every count, all ones on the CPU: zero.
        for l in [
            3,
            8,
            9,
            0xc,
            0xe,
            0xf,
            0x10,
            0x12,
            0x14,
            0x17,
            0x18,
            0x19,
            0x1a,
            0x1b,
            0x1c,
            0x1d,
            0x1e,
            0x20,
            0x21,
            0x23,
            0x25,
            0x30,
            0x31,
            0x4000_0000,
            0x8000_0005,
            0x8000_0009,
            0x8000_0021,
            0x8000_0028,
            0x8000_0029,
        ] {
            assert_eq!(leaf(l, 0), [0; 4], "leaf {l:#x}");
            assert_eq!(leaf(l, 1), [0; 4], "leaf {l:#x}");
        }
        // Topology, caches, frequencies, the PMU and the brand pass as
        // the CPU reports them.
        for (l, s) in [
            (2, 0),
            (4, 3),
            (5, 0),
            (0xa, 0),
            (0xb, 1),
            (0x15, 0),
            (0x16, 0),
            (0x1f, 2),
            (0x8000_0002, 0),
            (0x8000_0006, 0),
        ] {
            assert_eq!(leaf(l, s), [!0; 4], "leaf {l:#x}.{s}");
        }
    }

    #[test]
    fn hidden_xsave_components_leave_leaf_0xd_and_xsetbv() {
        let mut cpu = Cpu::with(sapphire_rapids);
        // x87, SSE, AVX and AVX-512's three; no PKRU, no AMX; ECX the
        // size of those alone (Hi16_ZMM ends at 2688).
        assert_eq!(guest_cpuid(&mut cpu, 0xd, 0), [0xe7, 0x2b00, 2688, 0]);
        // No XFD, and nothing IA32_XSS may hold.
        assert_eq!(guest_cpuid(&mut cpu, 0xd, 1), [0xf, 0x2b00, 0, 0]);
        for c in [2, 5, 6, 7] {
            assert_eq!(
                guest_cpuid(&mut cpu, 0xd, c),
                sapphire_rapids(0xd, c),
                "{c}"
            );
        }
        for c in [3, 4, 8, 9, 10, 11, 12, 15, 17, 18, 19, 63, 64, 0xffff_ffff] {
            assert_eq!(guest_cpuid(&mut cpu, 0xd, c), [0; 4], "component {c}");
        }

        // XSETBV agrees: AVX-512 is taken, PKRU and AMX refused like
        // components the CPU lacks.
        let avx512 = 0xe7;
        let (o, _, _) = run(
            VmExit::Xsetbv {
                xcr: 0,
                value: avx512,
            },
            &mut cpu,
        );
        assert_eq!(o, Outcome::Advance);
        assert_eq!(cpu.xcr0, Some(avx512));
        for hidden in [avx512 | 1 << 9, avx512 | 0b11 << 17, 0x0006_02e7] {
            let (o, _, guard) = run(
                VmExit::Xsetbv {
                    xcr: 0,
                    value: hidden,
                },
                &mut cpu,
            );
            assert!(is_gp(o), "{hidden:#x}");
            assert_eq!(guard.xsetbv_refused, 1);
        }
        assert_eq!(cpu.xcr0, Some(avx512), "unchanged");
    }

    #[test]
    fn bochs_haswell_reads_as_before_but_for_vmx_and_aperfmperf() {
        let mut cpu = Cpu::with(bochs_haswell);
        let leaves = (0..=0x30)
            .chain(0x4000_0000..=0x4000_0002)
            .chain(0x8000_0000..=0x8000_000a);
        for leaf in leaves {
            for subleaf in 0..=64 {
                let mut want = bochs_haswell(leaf, subleaf);
                match leaf {
                    // VMX is root's; the debug store is hidden.
                    1 => {
                        want[2] &= !(1 << 5 | 1 << 4 | 1 << 2);
                        want[3] &= !(1 << 21);
                    }
                    // APERF/MPERF, which Bochs does not implement.
                    6 => want[2] &= !1,
                    0..=0xd | 0x8000_0000..=0x8000_0008 => {}
                    // Past Bochs's highest leaves, where it repeats the
                    // XSAVE leaf (which the guest read there before).
                    _ => want = [0; 4],
                }
                assert_eq!(
                    guest_cpuid(&mut cpu, leaf, subleaf),
                    want,
                    "leaf {leaf:#x}.{subleaf}"
                );
            }
        }
        // The leaves Linux reads, spelled out.
        assert_eq!(guest_cpuid(&mut cpu, 1, 0)[2], 0x7ffa_f39f & !0b10100);
        assert_eq!(guest_cpuid(&mut cpu, 7, 0), [0, 0x27ab, 0, 0]);
        assert_eq!(guest_cpuid(&mut cpu, 0xd, 0), [0b111, 0x340, 0x340, 0]);
        assert_eq!(
            guest_cpuid(&mut cpu, 0x8000_0001, 0),
            [0, 0, 0x21, 0x2c10_0800]
        );
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
