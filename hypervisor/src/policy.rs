//! What the hypervisor does for each intercepted guest operation, as pure
//! functions: CPUID filtering, control-register writes under the guest/host
//! masks, the MSRs we intercept and the I/O ports we own.

/// CPUID.1:ECX.VMX (SDM Vol. 2A, CPUID).
pub const CPUID_1_ECX_VMX: u32 = 1 << 5;

/// Filters a CPUID result before the guest sees it: VMX is hidden, so the
/// guest neither tries to use it nor trips over CR4.VMXE.
pub fn filter_cpuid(leaf: u32, _subleaf: u32, mut r: [u32; 4]) -> [u32; 4] {
    match leaf {
        1 => r[2] &= !CPUID_1_ECX_VMX,
        // Bochs 2.7 advertises APERF/MPERF but does not implement the MSRs;
        // Linux then reads them on every tick and Bochs logs each failed
        // read (tens of MB a minute). The guest loses only its frequency
        // estimate without them.
        6 => r[2] &= !CPUID_6_ECX_APERFMPERF,
        _ => {}
    }
    r
}

/// CPUID.6:ECX.APERFMPERF.
pub const CPUID_6_ECX_APERFMPERF: u32 = 1 << 0;

/// CR0.PE.
pub const CR0_PE: u64 = 1 << 0;
/// CR0.NE.
pub const CR0_NE: u64 = 1 << 5;
/// CR0.PG.
pub const CR0_PG: u64 = 1 << 31;
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

/// The host-owned bits of CR4: everything VMX fixes to 1 (VMXE).
pub const fn cr4_host_mask(fixed0: u64) -> u64 {
    fixed0 | CR4_VMXE
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
/// the real register keeps the bits VMX needs.
pub fn cr0_write(value: u64, fixed0: u64, fixed1: u64) -> CrWrite {
    if value >> 32 != 0 || (value & CR0_PG != 0 && value & CR0_PE == 0) {
        return CrWrite::Fault;
    }
    let actual = (value | cr0_host_mask(fixed0)) & fixed1;
    CrWrite::Load {
        actual,
        shadow: value,
    }
}

/// A guest MOV to CR4: VMXE is hidden from the guest, so setting it faults
/// as on a CPU without VMX.
pub fn cr4_write(value: u64, fixed0: u64, fixed1: u64) -> CrWrite {
    if value & CR4_VMXE != 0 || value & !(fixed1 | CR4_VMXE) != 0 {
        return CrWrite::Fault;
    }
    CrWrite::Load {
        actual: (value | cr4_host_mask(fixed0)) & fixed1,
        shadow: value,
    }
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
pub const MSR_FEATURE_CONTROL: u32 = 0x3a;
/// First and last VMX capability MSRs (IA32_VMX_BASIC .. IA32_VMX_VMFUNC).
pub const MSR_VMX_FIRST: u32 = 0x480;
/// Last VMX capability MSR we hide.
pub const MSR_VMX_LAST: u32 = 0x491;

/// MSRs whose reads exit.
pub const INTERCEPTED_MSR_READS: &[(u32, u32)] = &[
    (MSR_FEATURE_CONTROL, MSR_FEATURE_CONTROL),
    (MSR_VMX_FIRST, MSR_VMX_LAST),
];
/// MSRs whose writes exit.
pub const INTERCEPTED_MSR_WRITES: &[(u32, u32)] = &[
    (MSR_FEATURE_CONTROL, MSR_FEATURE_CONTROL),
    (MSR_VMX_FIRST, MSR_VMX_LAST),
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

/// An intercepted WRMSR: every MSR we intercept is read-only or absent for
/// the guest (FEATURE_CONTROL is locked), so writes fault.
pub fn msr_write_faults(_msr: u32) -> bool {
    true
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
        bitmap[base + off + idx / 8] |= 1 << (idx % 8);
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
        bm[i / 8] |= 1 << (i % 8);
    }
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

    #[test]
    fn cpuid_hides_vmx_and_aperfmperf() {
        let r = filter_cpuid(1, 0, [1, 2, 0xffff_ffff, 4]);
        assert_eq!(r, [1, 2, 0xffff_ffdf, 4]);
        assert_eq!(
            filter_cpuid(7, 0, [1, 2, 0xffff_ffff, 4]),
            [1, 2, 0xffff_ffff, 4]
        );
        assert_eq!(filter_cpuid(6, 0, [0, 0, 0x9, 0]), [0, 0, 0x8, 0]);
    }

    #[test]
    fn cr0_keeps_ne_but_lets_the_guest_turn_paging_off() {
        assert_eq!(cr0_host_mask(CR0_F0), CR0_NE);
        // Decompressor: paging off, protection on.
        assert_eq!(
            cr0_write(0x11, CR0_F0, CR0_F1),
            CrWrite::Load {
                actual: 0x31,
                shadow: 0x11
            }
        );
        assert_eq!(cr0_write(CR0_PG | 0x10, CR0_F0, CR0_F1), CrWrite::Fault);
        assert_eq!(cr0_write(1 << 40, CR0_F0, CR0_F1), CrWrite::Fault);
    }

    #[test]
    fn cr4_hides_vmxe() {
        assert_eq!(
            cr4_write(0x20, CR4_F0, CR4_F1),
            CrWrite::Load {
                actual: 0x2020,
                shadow: 0x20
            }
        );
        assert_eq!(cr4_write(0x2020, CR4_F0, CR4_F1), CrWrite::Fault);
        assert_eq!(cr4_write(1 << 30, CR4_F0, CR4_F1), CrWrite::Fault);
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
}
