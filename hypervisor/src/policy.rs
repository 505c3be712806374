//! What the hypervisor does for each intercepted guest operation, as pure
//! functions: control-register writes under the guest/host masks, XSETBV,
//! the MSRs we intercept and the I/O ports we own. What the guest reads
//! from CPUID is [`crate::cpuid`]'s whitelist.

/// CPUID.1:ECX.VMX (SDM Vol. 2A, CPUID): root's own check that the CPU
/// has VMX. The guest never sees it ([`crate::cpuid`]).
pub const CPUID_1_ECX_VMX: u32 = 1 << 5;

/// CR0.PE.
pub const CR0_PE: u64 = 1 << 0;
/// CR0.MP: monitor coprocessor.
pub const CR0_MP: u64 = 1 << 1;
/// CR0.EM: x87 emulation.
pub const CR0_EM: u64 = 1 << 2;
/// CR0.TS: task switched (CLTS clears it).
pub const CR0_TS: u64 = 1 << 3;
/// CR0.NE.
pub const CR0_NE: u64 = 1 << 5;
/// CR0.WP: supervisor writes honour read-only pages.
pub const CR0_WP: u64 = 1 << 16;
/// CR0.NW.
pub const CR0_NW: u64 = 1 << 29;
/// CR0.CD.
pub const CR0_CD: u64 = 1 << 30;
/// CR0.PG.
pub const CR0_PG: u64 = 1 << 31;
/// CR4.PSE: 4 MiB pages under 32-bit paging.
pub const CR4_PSE: u64 = 1 << 4;
/// CR4.PAE.
pub const CR4_PAE: u64 = 1 << 5;
/// CR4.LA57.
pub const CR4_LA57: u64 = 1 << 12;
/// CR4.SMXE.
pub const CR4_SMXE: u64 = 1 << 14;
/// CR4.PCIDE.
pub const CR4_PCIDE: u64 = 1 << 17;
/// CR4.SMAP: supervisor-mode access prevention.
pub const CR4_SMAP: u64 = 1 << 21;
/// RFLAGS.AC: alignment check, which with SMAP lets the kernel reach user pages.
pub const RFLAGS_AC: u64 = 1 << 18;
/// RFLAGS.DF: string instructions step down through memory.
pub const RFLAGS_DF: u64 = 1 << 10;
/// CR4.VMXE.
pub const CR4_VMXE: u64 = 1 << 13;
/// EFER.LME.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA.
pub const EFER_LMA: u64 = 1 << 10;

/// The host-owned bits of CR0: those VMX operation fixes to 1, except PE and
/// PG, which an unrestricted guest controls (SDM 26.8).
pub const fn cr0_host_mask(fixed0: u64) -> u64 {
    fixed0 & !(CR0_PE | CR0_PG)
}

/// The bits of CR4 root keeps at 1: everything VMX fixes to 1 (VMXE).
pub const fn cr4_host_mask(fixed0: u64) -> u64 {
    fixed0 | CR4_VMXE
}

/// The CR4 guest/host mask: the bits root keeps at 1
/// ([`cr4_host_mask`]), and LA57, which root keeps at 0 (the guest may
/// not set it: its MOV exits and faults in [`cr4_write`]).
pub const fn cr4_guest_host_mask(fixed0: u64) -> u64 {
    cr4_host_mask(fixed0) | CR4_LA57
}

/// Result of a guest MOV to CR0 or CR4 that exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrWrite {
    /// Load `actual` into the guest CR and `shadow` into the read shadow.
    Load { actual: u64, shadow: u64 },
    /// The value is invalid for the guest: inject #GP(0).
    Fault,
}

/// A guest MOV to CR0: the guest sees (through the shadow) what it wrote;
/// the real register keeps the bits VMX needs. Every value that the SDM's
/// MOV to CR0 refuses with #GP(0) is refused here too (SDM Vol. 2B, MOV to
/// control registers), because loading it would make the next VM entry
/// fail instead: reserved bits, PG without PE, NW without CD, and paging
/// turned on with EFER.LME set but CR4.PAE clear.
pub fn cr0_write(value: u64, fixed0: u64, fixed1: u64, cr4: u64, efer: u64) -> CrWrite {
    let pg_without_pe = value & CR0_PG != 0 && value & CR0_PE == 0;
    let nw_without_cd = value & CR0_NW != 0 && value & CR0_CD == 0;
    let long_without_pae = value & CR0_PG != 0 && efer & EFER_LME != 0 && cr4 & CR4_PAE == 0;
    if value >> 32 != 0 || pg_without_pe || nw_without_cd || long_without_pae {
        return CrWrite::Fault;
    }
    let actual = (value | cr0_host_mask(fixed0)) & fixed1;
    CrWrite::Load {
        actual,
        shadow: value,
    }
}

/// Whether a guest MOV of `value` to CR0 clears PG where the CPU refuses
/// that with #GP(0): in 64-bit mode (`cs_long`: CS.L of the running code)
/// or with CR4.PCIDE set (SDM Vol. 2B, MOV to control registers).
/// Leaving long mode is only done from compatibility mode.
pub fn cr0_clears_paging_in_64bit(value: u64, cr4: u64, cs_long: bool) -> bool {
    value & CR0_PG == 0 && (cs_long || cr4 & CR4_PCIDE != 0)
}

/// A guest MOV to CR4: VMXE, SMXE and LA57 are hidden from the guest, so
/// setting them faults as on a CPU without VMX, SMX and 5-level paging.
/// In IA-32e mode (`lma`), clearing PAE or changing LA57 faults, as the
/// SDM says.
pub fn cr4_write(value: u64, old: u64, fixed0: u64, fixed1: u64, lma: bool) -> CrWrite {
    let hidden = CR4_VMXE | CR4_SMXE | CR4_LA57;
    let long_mode_change = lma && (value & CR4_PAE == 0 || (value ^ old) & CR4_LA57 != 0);
    if value & hidden != 0 || value & !(fixed1 | CR4_VMXE) != 0 || long_mode_change {
        return CrWrite::Fault;
    }
    CrWrite::Load {
        actual: (value | cr4_host_mask(fixed0)) & fixed1,
        shadow: value,
    }
}

/// XCR0 bits with rules of their own (SDM Vol. 1, 13.3 "Enabling the
/// XSAVE feature set and XSAVE-enabled features"; XSETBV in Vol. 2D).
pub mod xcr0 {
    /// x87 state: must always be set.
    pub const X87: u64 = 1 << 0;
    /// SSE state.
    pub const SSE: u64 = 1 << 1;
    /// AVX (YMM upper halves): needs SSE.
    pub const AVX: u64 = 1 << 2;
    /// MPX bounds registers (BNDREGS, BNDCSR): both or neither.
    pub const MPX: u64 = 0b11 << 3;
    /// AVX-512 (opmask, ZMM_Hi256, Hi16_ZMM): all three or none, and AVX.
    pub const AVX512: u64 = 0b111 << 5;
    /// AMX (XTILECFG, XTILEDATA): both or neither.
    pub const AMX: u64 = 0b11 << 17;
}

/// Whether XSETBV of `value` into XCR `index` would succeed on a CPU whose
/// CPUID.(EAX=0DH,ECX=0) reports `supported` (EDX:EAX): for the guest,
/// what it reads there ([`crate::cpuid::xcr0_for_guest`]). Root executes the
/// XSETBV itself, so any value that would #GP must be refused first: a #GP
/// in VMX root is a hypervisor crash.
pub fn xsetbv_valid(index: u32, value: u64, supported: u64) -> bool {
    use xcr0::*;
    let all_or_none = |group: u64| value & group == 0 || value & group == group;
    index == 0
        && value & X87 != 0
        && value & !supported == 0
        && (value & AVX == 0 || value & SSE != 0)
        && all_or_none(MPX)
        && all_or_none(AVX512)
        && (value & AVX512 == 0 || value & AVX != 0)
        && all_or_none(AMX)
}

/// EFER after CR0.PG changes: LMA follows PG while LME is set (SDM 10.8.5).
pub fn efer_after_cr0(efer: u64, cr0: u64) -> u64 {
    if cr0 & CR0_PG != 0 && efer & EFER_LME != 0 {
        efer | EFER_LMA
    } else {
        efer & !EFER_LMA
    }
}

/// IA32_FEATURE_CONTROL.
pub const MSR_FEATURE_CONTROL: u32 = x86::msr::IA32_FEATURE_CONTROL;
/// First VMX capability MSR we hide (IA32_VMX_BASIC).
pub const MSR_VMX_FIRST: u32 = x86::msr::IA32_VMX_BASIC;
/// Last VMX capability MSR we hide (IA32_VMX_VMFUNC).
pub const MSR_VMX_LAST: u32 = x86::msr::IA32_VMX_VMFUNC;

/// MSRs whose reads exit.
pub const INTERCEPTED_MSR_READS: &[(u32, u32)] = &[
    (MSR_FEATURE_CONTROL, MSR_FEATURE_CONTROL),
    (MSR_VMX_FIRST, MSR_VMX_LAST),
];
/// IA32_APIC_BASE: where the local APIC's MMIO window sits.
pub const MSR_APIC_BASE: u32 = x86::msr::IA32_APIC_BASE;

/// IA32_PEBS_ENABLE, IA32_DS_AREA and IA32_RTIT_CTL: where the CPU
/// writes performance and trace records on its own, in root too.
pub const MSR_PEBS_ENABLE: u32 = 0x3f1;
pub const MSR_DS_AREA: u32 = 0x600;
pub const MSR_RTIT_CTL: u32 = 0x570;

/// MSRs whose writes exit.
pub const INTERCEPTED_MSR_WRITES: &[(u32, u32)] = &[
    (MSR_APIC_BASE, MSR_APIC_BASE),
    (MSR_FEATURE_CONTROL, MSR_FEATURE_CONTROL),
    (MSR_VMX_FIRST, MSR_VMX_LAST),
    (MSR_PEBS_ENABLE, MSR_PEBS_ENABLE),
    (MSR_RTIT_CTL, MSR_RTIT_CTL),
    (MSR_DS_AREA, MSR_DS_AREA),
];

/// What to do with an intercepted RDMSR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsrRead {
    /// Return this value in EDX:EAX.
    Value(u64),
    /// Inject #GP(0), as a CPU without the MSR does.
    Fault,
}

/// An intercepted RDMSR. `real` is the hardware value of the MSR.
pub fn msr_read(msr: u32, real: u64) -> MsrRead {
    match msr {
        // Locked, with both VMX-enable bits clear: the guest sees VMX off.
        MSR_FEATURE_CONTROL => MsrRead::Value((real | 1) & !0b110),
        MSR_VMX_FIRST..=MSR_VMX_LAST => MsrRead::Fault,
        _ => MsrRead::Fault,
    }
}

/// What to do with an intercepted WRMSR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsrWrite {
    /// Inject #GP(0).
    Fault,
    /// Write the value for the guest (root and guest share the MSR); the
    /// CPU's own checks still apply (a value it refuses is a #GP for the
    /// guest, never for root).
    Forward,
}

/// An intercepted WRMSR.
///
/// - IA32_APIC_BASE: the local APIC's MMIO window is decoded by the CPU
///   before memory, for root too, so a base inside `reserved` (hypervisor
///   memory) would put root's own memory behind the APIC's registers.
///   Such a write is refused with #GP; any other base is the guest's.
/// - FEATURE_CONTROL is locked and the VMX capability MSRs are absent for
///   the guest: writes fault.
/// - PEBS and the debug store (hidden from CPUID) and Processor Trace
///   (hidden too): the CPU writes their records itself, PEBS's by linear
///   address through IA32_DS_AREA whenever a counter overflows, root's
///   execution included (these MSRs are not switched at exits), and
///   Processor Trace's to physical addresses past EPT. Only 0 (off) is
///   taken; anything else faults, as on a CPU without them.
pub fn msr_write(msr: u32, value: u64, reserved: core::ops::Range<u64>) -> MsrWrite {
    match msr {
        MSR_PEBS_ENABLE | MSR_DS_AREA | MSR_RTIT_CTL if value == 0 => MsrWrite::Forward,
        MSR_APIC_BASE => {
            let base = value & 0x000f_ffff_ffff_f000;
            if base < reserved.end && base + 0x1000 > reserved.start {
                MsrWrite::Fault
            } else {
                MsrWrite::Forward
            }
        }
        _ => MsrWrite::Fault,
    }
}

/// Sets the bits of a 4 KiB VMX MSR bitmap (SDM 25.6.9) so that the given
/// reads and writes exit. Layout: read-low (MSRs 0..0x1fff) at 0, read-high
/// (0xc0000000..0xc0001fff) at 1024, write-low at 2048, write-high at 3072.
pub fn msr_bitmap(bitmap: &mut [u8; 4096], reads: &[(u32, u32)], writes: &[(u32, u32)]) {
    let mut set = |base: usize, msr: u32| {
        let (off, idx) = match msr {
            0..=0x1fff => (0, msr as usize),
            0xc000_0000..=0xc000_1fff => (1024, (msr - 0xc000_0000) as usize),
            _ => return,
        };
        // At most 2048 + 1024 + 0x1fff / 8 = 4095: always inside the page.
        if let Some(byte) = bitmap.get_mut(base + off + idx / 8) {
            *byte |= 1 << (idx % 8);
        }
    };
    for &(a, b) in reads {
        for m in a..=b {
            set(0, m);
        }
    }
    for &(a, b) in writes {
        for m in a..=b {
            set(2048, m);
        }
    }
}

/// The control channel's UART (COM2), owned by VMX root. The guest sees no
/// device here.
pub const CONTROL_PORTS: core::ops::RangeInclusive<u16> = 0x2f8..=0x2ff;

/// The hypervisor's log port (QEMU isa-debugcon, Bochs port_e9_hack). It is
/// root's alone: guest accesses exit, writes are dropped and counted, reads
/// see a floating bus.
pub const DEBUG_PORT: u16 = 0xe9;

/// Whether an access of `size` bytes at `port` touches any port of `range`
/// (an access covers `port .. port + size`, and the I/O bitmap makes it
/// exit when any of those ports is intercepted).
pub fn io_touches(port: u16, size: u8, range: &core::ops::RangeInclusive<u16>) -> bool {
    let end = u32::from(port) + u32::from(size.max(1)) - 1;
    u32::from(port) <= u32::from(*range.end()) && end >= u32::from(*range.start())
}

/// Sets the bits for `ports` in the two 4 KiB I/O bitmaps (A: 0..0x7fff,
/// B: 0x8000..0xffff, SDM 25.6.4).
pub fn io_bitmap_set(
    a: &mut [u8; 4096],
    b: &mut [u8; 4096],
    ports: core::ops::RangeInclusive<u16>,
) {
    for p in ports {
        let (bm, i) = if p < 0x8000 {
            (&mut *a, p as usize)
        } else {
            (&mut *b, (p - 0x8000) as usize)
        };
        // `i` is below 0x8000, so `i / 8` is inside the 4 KiB bitmap.
        if let Some(byte) = bm.get_mut(i / 8) {
            *byte |= 1 << (i % 8);
        }
    }
}

/// The ports through which software resets the machine: the keyboard
/// controller's command port, System Control Port A, and the PCI reset
/// control register. A reset would restart the emulated machine without
/// root (in Bochs its firmware would then honour the guest's CMOS
/// shutdown byte and jump to a vector the guest chose, outside VMX), so
/// root intercepts them and ends the VM instead, as it does for a triple
/// fault or an INIT of the boot processor.
pub const RESET_PORTS: [u16; 3] = [KBC_COMMAND, PORT_A, RESET_CONTROL];
/// The keyboard controller's command port.
pub const KBC_COMMAND: u16 = 0x64;
/// System Control Port A (bit 0: fast reset; bit 1: the A20 gate).
pub const PORT_A: u16 = 0x92;
/// The PIIX reset control register (bit 2: reset the CPU).
pub const RESET_CONTROL: u16 = 0xcf9;

/// Whether the guest's write of `size` bytes of `value` at `port` asks
/// for a reset: a keyboard-controller command that pulses output line 0
/// (0xF0 to 0xFF with bit 0 clear, 0xFE among them) or System Control
/// Port A with its fast-reset bit, in whichever byte of the access lands
/// there; the reset control register with its CPU-reset bit, in a byte
/// access to it alone (a wider access at 0xCF8 is the PCI configuration
/// address, which the chipset decodes as such).
pub fn resets(port: u16, size: u8, value: u32) -> bool {
    if port == RESET_CONTROL && size == 1 {
        return value & 0x04 != 0;
    }
    (0..size.min(4)).any(|i| {
        let byte = (value >> (8 * u32::from(i))) as u8;
        match port.checked_add(u16::from(i)) {
            Some(KBC_COMMAND) => byte & 0xf0 == 0xf0 && byte & 1 == 0,
            Some(PORT_A) => byte & 1 != 0,
            _ => false,
        }
    })
}

/// What a guest IN from a port we own returns: all ones, like an ISA bus
/// with nothing on it.
pub const fn floating_bus(size: u8) -> u32 {
    match size {
        1 => 0xff,
        2 => 0xffff,
        _ => 0xffff_ffff,
    }
}

/// The address-size mask of a string I/O instruction from its VM-exit
/// instruction information (bits 9:7: 0 = 16-bit, 1 = 32-bit, 2 = 64-bit;
/// SDM Table 28-8). RSI, RDI and RCX move within it.
pub const fn address_size_mask(info: u32) -> u64 {
    match (info >> 7) & 7 {
        0 => 0xffff,
        1 => 0xffff_ffff,
        _ => u64::MAX,
    }
}

/// The access a string I/O instruction makes to its memory operand, for
/// the page-permission checks the CPU would have made (SDM 4.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringAccess {
    /// INS writes memory; OUTS reads it.
    pub write: bool,
    /// CPL 3.
    pub user: bool,
    /// CR0.WP: supervisor writes honour read-only pages.
    pub write_protect: bool,
    /// CR4.SMAP with RFLAGS.AC clear, at CPL < 3: supervisor accesses to
    /// user pages fault.
    pub smap: bool,
}

/// #PF error code bits (SDM 4.7).
const PF_PRESENT: u32 = 1;
const PF_WRITE: u32 = 1 << 1;
const PF_USER: u32 = 1 << 2;

impl StringAccess {
    fn code(&self, present: bool) -> u32 {
        let bit = |on: bool, b: u32| if on { b } else { 0 };
        bit(present, PF_PRESENT) | bit(self.write, PF_WRITE) | bit(self.user, PF_USER)
    }

    /// The #PF error code for a page that is not mapped.
    pub fn not_present(&self) -> u32 {
        self.code(false)
    }

    /// The #PF error code when a present page with these permissions (each
    /// ANDed over the walk) refuses the access, or `None` when it allows it.
    pub fn denied(&self, writable: bool, user_page: bool) -> Option<u32> {
        let fault = (self.user && !user_page)
            || (self.write && !writable && (self.user || self.write_protect))
            || (!self.user && user_page && self.smap);
        fault.then(|| self.code(true))
    }
}

/// ACPI PM1 control: SLP_EN (bit 13) starts the sleep state in SLP_TYP
/// (bits 12:10). ACPI 6.4 section 4.8.3.2.1.
pub const PM1_SLP_EN: u32 = 1 << 13;

#[cfg(test)]
mod tests {
    use super::*;

    // Typical VMX fixed-bit MSRs (Bochs and recent Intel parts).
    const CR0_F0: u64 = 0x8000_0021;
    const CR0_F1: u64 = 0xffff_ffff;
    const CR4_F0: u64 = 0x2000;
    const CR4_F1: u64 = 0x3727ff;

    const LONG: u64 = EFER_LME | EFER_LMA;

    #[test]
    fn cr0_keeps_ne_but_lets_the_guest_turn_paging_off() {
        assert_eq!(cr0_host_mask(CR0_F0), CR0_NE);
        // Decompressor: paging off, protection on.
        assert_eq!(
            cr0_write(0x11, CR0_F0, CR0_F1, CR4_PAE, EFER_LME),
            CrWrite::Load {
                actual: 0x31,
                shadow: 0x11
            }
        );
        // Paging back on in long mode with PAE: fine.
        assert!(matches!(
            cr0_write(CR0_PG | 0x11, CR0_F0, CR0_F1, CR4_PAE, EFER_LME),
            CrWrite::Load { .. }
        ));
        assert_eq!(
            cr0_write(CR0_PG | 0x10, CR0_F0, CR0_F1, CR4_PAE, 0),
            CrWrite::Fault
        );
        assert_eq!(
            cr0_write(1 << 40, CR0_F0, CR0_F1, CR4_PAE, 0),
            CrWrite::Fault
        );
    }

    #[test]
    fn cr0_values_that_would_fail_vm_entry_fault_instead() {
        // NW without CD (SDM: #GP), and with CD it is a legal (if odd) mode.
        let base = CR0_PG | CR0_PE | CR0_NE;
        assert_eq!(
            cr0_write(base | CR0_NW, CR0_F0, CR0_F1, CR4_PAE, LONG),
            CrWrite::Fault
        );
        assert!(matches!(
            cr0_write(base | CR0_NW | CR0_CD, CR0_F0, CR0_F1, CR4_PAE, LONG),
            CrWrite::Load { .. }
        ));
        // PG with EFER.LME but no CR4.PAE.
        assert_eq!(cr0_write(base, CR0_F0, CR0_F1, 0, EFER_LME), CrWrite::Fault);
        // Found by the fuzzing guest (seed 1, operation 2512: CR0 ^=
        // PG | NE from 64-bit code): root loaded the value, paging went
        // off under 64-bit code and the guest triple-faulted; the CPU
        // refuses it with #GP(0).
        assert!(cr0_clears_paging_in_64bit(CR0_PE | 0x10, CR4_PAE, true));
        assert!(cr0_clears_paging_in_64bit(
            CR0_PE | 0x10,
            CR4_PAE | CR4_PCIDE,
            false
        ));
        assert!(
            !cr0_clears_paging_in_64bit(CR0_PE | 0x10, CR4_PAE, false),
            "compatibility mode may leave long mode"
        );
        assert!(!cr0_clears_paging_in_64bit(
            CR0_PE | CR0_PG,
            CR4_PAE | CR4_PCIDE,
            true
        ));
        // Without LME, 32-bit paging without PAE is fine.
        assert!(matches!(
            cr0_write(base, CR0_F0, CR0_F1, 0, 0),
            CrWrite::Load { .. }
        ));
    }

    #[test]
    fn cr4_hides_vmxe_and_smxe_and_keeps_long_mode_whole() {
        assert_eq!(
            cr4_write(0x20, 0x20, CR4_F0, CR4_F1, true),
            CrWrite::Load {
                actual: 0x2020,
                shadow: 0x20
            }
        );
        assert_eq!(
            cr4_write(0x2020, 0x20, CR4_F0, CR4_F1, false),
            CrWrite::Fault
        );
        assert_eq!(
            cr4_write(0x20 | CR4_SMXE, 0x20, CR4_F0, CR4_F1, false),
            CrWrite::Fault
        );
        assert_eq!(
            cr4_write(1 << 30, 0x20, CR4_F0, CR4_F1, false),
            CrWrite::Fault
        );
        // Clearing PAE in long mode faults; outside it, it is allowed.
        assert_eq!(cr4_write(0, 0x20, CR4_F0, CR4_F1, true), CrWrite::Fault);
        assert!(matches!(
            cr4_write(0, 0x20, CR4_F0, CR4_F1, false),
            CrWrite::Load { .. }
        ));
        // LA57 cannot change in long mode, and is hidden outside it too
        // (root walks guest memory with 4 levels).
        assert_eq!(
            cr4_write(0x20 | CR4_LA57, 0x20, CR4_F0, CR4_F1, true),
            CrWrite::Fault
        );
        assert_eq!(
            cr4_write(0x20 | CR4_LA57, 0x20, CR4_F0, CR4_F1 | CR4_LA57, false),
            CrWrite::Fault
        );
        assert_ne!(cr4_guest_host_mask(CR4_F0) & CR4_LA57, 0, "its writes exit");
        assert_eq!(cr4_host_mask(CR4_F0) & CR4_LA57, 0, "never forced on");
        match cr4_write(0x20, 0x20, CR4_F0, CR4_F1 | CR4_LA57, true) {
            CrWrite::Load { actual, .. } => assert_eq!(actual & CR4_LA57, 0),
            CrWrite::Fault => panic!("a plain CR4 write faulted"),
        }
    }

    #[test]
    fn xsetbv_follows_every_xcr0_rule() {
        // A CPU with x87, SSE, AVX, MPX, AVX-512 and AMX.
        let all = 0b111 | xcr0::MPX | xcr0::AVX512 | xcr0::AMX;
        assert!(xsetbv_valid(0, 0b111, all));
        assert!(xsetbv_valid(0, all, all));
        assert!(xsetbv_valid(0, 0b11 | xcr0::MPX, all));
        // XCR index other than 0, x87 clear, unsupported bits, AVX without SSE.
        assert!(!xsetbv_valid(1, 0b111, all));
        assert!(!xsetbv_valid(0, 0b110, all));
        assert!(!xsetbv_valid(0, 0b111 | 1 << 9, all));
        assert!(!xsetbv_valid(0, 0b101, all));
        // MPX: both bits or neither.
        assert!(!xsetbv_valid(0, 0b111 | 1 << 3, all));
        assert!(!xsetbv_valid(0, 0b111 | 1 << 4, all));
        // AVX-512: all three or none, and only with AVX.
        for partial in [1 << 5, 1 << 6, 1 << 7, 0b11 << 5, 0b101 << 5, 0b110 << 5] {
            assert!(!xsetbv_valid(0, 0b111 | partial, all), "{partial:#x}");
        }
        assert!(!xsetbv_valid(0, 0b011 | xcr0::AVX512, all));
        assert!(xsetbv_valid(0, 0b111 | xcr0::AVX512, all));
        // AMX: both bits or neither.
        assert!(!xsetbv_valid(0, 0b111 | 1 << 17, all));
        assert!(!xsetbv_valid(0, 0b111 | 1 << 18, all));
        // Haswell (no AVX-512): the AVX-512 bits are unsupported.
        assert!(!xsetbv_valid(0, 0b111 | xcr0::AVX512, 0b111));
    }

    #[test]
    fn accesses_that_straddle_owned_ports_are_seen() {
        let com2 = CONTROL_PORTS;
        assert!(io_touches(0x2f8, 1, &com2));
        assert!(io_touches(0x2f6, 4, &com2)); // 0x2f6..=0x2f9
        assert!(io_touches(0x2ff, 4, &com2)); // runs past the end
        assert!(!io_touches(0x2f4, 4, &com2)); // 0x2f4..=0x2f7
        assert!(!io_touches(0x300, 2, &com2));
        assert!(io_touches(0xe8, 2, &(DEBUG_PORT..=DEBUG_PORT)));
        assert!(io_touches(0xffff, 4, &(0xfffe..=0xffff)));
    }

    #[test]
    fn efer_lma_follows_paging() {
        assert_eq!(
            efer_after_cr0(EFER_LME, CR0_PG | CR0_PE),
            EFER_LME | EFER_LMA
        );
        assert_eq!(efer_after_cr0(EFER_LME | EFER_LMA, CR0_PE), EFER_LME);
        assert_eq!(efer_after_cr0(0, CR0_PG | CR0_PE), 0);
    }

    #[test]
    fn the_apic_window_never_moves_over_hypervisor_memory() {
        let hv = 0x20_0000..0x200_0000;
        let en = 1 << 11;
        // The architectural default, and anywhere outside [2 MiB, 32 MiB).
        assert_eq!(
            msr_write(MSR_APIC_BASE, 0xfee0_0000 | en | 1 << 8, hv.clone()),
            MsrWrite::Forward
        );
        assert_eq!(
            msr_write(MSR_APIC_BASE, 0x1f_f000 | en, hv.clone()),
            MsrWrite::Forward
        );
        assert_eq!(
            msr_write(MSR_APIC_BASE, 0x200_0000 | en, hv.clone()),
            MsrWrite::Forward
        );
        // Into the hypervisor: refused, at either end and in the middle.
        for base in [0x20_0000u64, 0x100_0000, 0x1ff_f000] {
            assert_eq!(
                msr_write(MSR_APIC_BASE, base | en, hv.clone()),
                MsrWrite::Fault,
                "{base:#x}"
            );
        }
        // Bits above the address do not hide the base.
        assert_eq!(
            msr_write(MSR_APIC_BASE, 1 << 63 | 0x100_0000, hv.clone()),
            MsrWrite::Fault
        );
        assert_eq!(msr_write(MSR_FEATURE_CONTROL, 5, hv), MsrWrite::Fault);
    }

    #[test]
    fn records_the_cpu_writes_itself_stay_off() {
        let hv = 0x100_0000..0x300_0000;
        for msr in [MSR_PEBS_ENABLE, MSR_DS_AREA, MSR_RTIT_CTL] {
            assert_eq!(msr_write(msr, 0, hv.clone()), MsrWrite::Forward);
            // A DS area inside root's memory, PEBS on counter 0, tracing.
            for value in [0x100_0000, 1, 1 << 63] {
                assert_eq!(msr_write(msr, value, hv.clone()), MsrWrite::Fault);
            }
        }
        let mut bm = [0u8; 4096];
        msr_bitmap(&mut bm, &[], INTERCEPTED_MSR_WRITES);
        for msr in [MSR_PEBS_ENABLE, MSR_DS_AREA, MSR_RTIT_CTL] {
            let i = 2048 + msr as usize / 8;
            assert_ne!(bm[i] & 1 << (msr % 8), 0, "{msr:#x} writes exit");
        }
    }

    #[test]
    fn feature_control_reads_locked_without_vmx() {
        assert_eq!(msr_read(MSR_FEATURE_CONTROL, 0x5), MsrRead::Value(0x1));
        assert_eq!(msr_read(0x480, 0), MsrRead::Fault);
    }

    #[test]
    fn bitmaps_mark_exactly_the_intercepted_entries() {
        let mut bm = [0u8; 4096];
        msr_bitmap(
            &mut bm,
            INTERCEPTED_MSR_READS,
            &[(0xc000_0080, 0xc000_0080)],
        );
        assert_eq!(bm[0x3a / 8], 1 << (0x3a % 8));
        let mut w = [0u8; 4096];
        msr_bitmap(&mut w, &[], INTERCEPTED_MSR_WRITES);
        assert_eq!(w[2048 + 0x1b / 8], 1 << (0x1b % 8));
        assert_eq!(bm[0x480 / 8], 0xff);
        assert_eq!(bm[0x490 / 8], 0b11);
        assert_eq!(bm[3072 + 0x80 / 8], 1);
        assert_eq!(bm.iter().map(|b| b.count_ones()).sum::<u32>(), 1 + 18 + 1);

        let (mut a, mut b) = ([0u8; 4096], [0u8; 4096]);
        io_bitmap_set(&mut a, &mut b, CONTROL_PORTS);
        io_bitmap_set(&mut a, &mut b, 0xb004..=0xb005);
        assert_eq!(a[0x2f8 / 8], 0xff);
        assert_eq!(a.iter().map(|b| b.count_ones()).sum::<u32>(), 8);
        assert_eq!(b[0x3004 / 8], 0b11_0000);
        assert_eq!(floating_bus(2), 0xffff);
    }
    #[test]
    fn string_io_address_size_follows_the_instruction_information() {
        assert_eq!(address_size_mask(0), 0xffff);
        assert_eq!(address_size_mask(1 << 7), 0xffff_ffff);
        assert_eq!(address_size_mask(2 << 7), u64::MAX);
        // Segment bits (17:15) do not change it.
        assert_eq!(address_size_mask(2 << 7 | 3 << 15), u64::MAX);
    }

    #[test]
    fn string_io_page_checks_follow_the_sdm() {
        let ins_kernel = StringAccess {
            write: true,
            user: false,
            write_protect: true,
            smap: false,
        };
        // Writable kernel page: allowed.
        assert_eq!(ins_kernel.denied(true, false), None);
        // Read-only page with CR0.WP: present + write.
        assert_eq!(ins_kernel.denied(false, false), Some(0b011));
        // Without WP the supervisor may write it.
        let no_wp = StringAccess {
            write_protect: false,
            ..ins_kernel
        };
        assert_eq!(no_wp.denied(false, false), None);
        // SMAP: a supervisor access to a user page faults.
        let smap = StringAccess {
            smap: true,
            ..ins_kernel
        };
        assert_eq!(smap.denied(true, true), Some(0b011));
        assert_eq!(ins_kernel.denied(true, true), None);
        // User mode: a kernel page faults with U set; a read-only user page
        // refuses INS even without WP.
        let outs_user = StringAccess {
            write: false,
            user: true,
            write_protect: false,
            smap: false,
        };
        assert_eq!(outs_user.denied(true, false), Some(0b101));
        assert_eq!(outs_user.denied(false, true), None);
        let ins_user = StringAccess {
            write: true,
            ..outs_user
        };
        assert_eq!(ins_user.denied(false, true), Some(0b111));
        assert_eq!(ins_user.not_present(), 0b110);
        assert_eq!(ins_kernel.not_present(), 0b010);
    }

    #[test]
    fn software_resets_are_seen_on_each_port() {
        assert!(resets(KBC_COMMAND, 1, 0xfe));
        assert!(resets(KBC_COMMAND, 1, 0xf0));
        // Other keyboard-controller commands (self-test, read the output
        // port, pulse other lines) are the keyboard's.
        for v in [0xaa, 0xd0, 0xd1, 0xff, 0xf1, 0x60] {
            assert!(!resets(KBC_COMMAND, 1, v), "{v:#x}");
        }
        assert!(resets(PORT_A, 1, 0x01) && resets(PORT_A, 1, 0x03));
        assert!(!resets(PORT_A, 1, 0x02), "the A20 gate alone");
        // A word write whose second byte lands on port A.
        assert!(resets(PORT_A - 1, 2, 0x0100));
        assert!(resets(RESET_CONTROL, 1, 0x06) && resets(RESET_CONTROL, 1, 0x0e));
        assert!(!resets(RESET_CONTROL, 1, 0x02), "the reset type alone");
        // The PCI configuration address, a dword at 0xCF8: never a reset,
        // whatever its second byte.
        assert!(!resets(0xcf8, 4, 0x8000_0400));
        assert!(!resets(0xcf8, 4, 0x8000_ff00));
        assert!(!resets(0x60, 1, 0xfe));
        let (mut a, mut b) = ([0u8; 4096], [0u8; 4096]);
        for p in RESET_PORTS {
            io_bitmap_set(&mut a, &mut b, p..=p);
        }
        assert_eq!(a[0x64 / 8] & (1 << (0x64 % 8)), 1 << 4);
        assert_eq!(a[0x92 / 8] & (1 << (0x92 % 8)), 1 << 2);
        assert_eq!(a[0xcf9 / 8] & (1 << (0xcf9 % 8)), 1 << 1);
    }
}
