//! VMX capability arithmetic (SDM Appendix A "VMX capability reporting facility").

/// IA32_VMX_BASIC (MSR 0x480), SDM A.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmxBasic(pub u64);

impl VmxBasic {
    /// VMCS revision identifier, bits 30:0. Written into the first word of the
    /// VMXON and VMCS regions.
    pub const fn revision(self) -> u32 {
        (self.0 & 0x7fff_ffff) as u32
    }
    /// Size of the VMXON/VMCS regions in bytes, bits 44:32.
    pub const fn region_size(self) -> u32 {
        ((self.0 >> 32) & 0x1fff) as u32
    }
    /// Bit 54: INS/OUTS exits report the instruction information (address
    /// size, segment).
    pub const fn ins_outs_info(self) -> bool {
        self.0 & (1 << 54) != 0
    }
    /// Bit 55: the IA32_VMX_TRUE_*_CTLS MSRs exist and must be used.
    pub const fn has_true_controls(self) -> bool {
        self.0 & (1 << 55) != 0
    }
}

/// IA32_VMX_EPT_VPID_CAP (MSR 0x48C), SDM A.10.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EptVpidCap(pub u64);

impl EptVpidCap {
    /// Bit 0: execute-only EPT translations.
    pub const fn execute_only(self) -> bool {
        self.0 & 1 != 0
    }
    /// Bit 6: page-walk length 4.
    pub const fn walk_length_4(self) -> bool {
        self.0 & (1 << 6) != 0
    }
    /// Bit 14: write-back EPT paging structures.
    pub const fn write_back(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    /// Bit 16: 2 MiB EPT pages.
    pub const fn pages_2m(self) -> bool {
        self.0 & (1 << 16) != 0
    }
    /// Bit 17: 1 GiB EPT pages.
    pub const fn pages_1g(self) -> bool {
        self.0 & (1 << 17) != 0
    }
    /// Bit 20: INVEPT.
    pub const fn invept(self) -> bool {
        self.0 & (1 << 20) != 0
    }
    /// Bit 25: single-context INVEPT.
    pub const fn invept_single(self) -> bool {
        self.0 & (1 << 25) != 0
    }
    /// Bit 26: all-context INVEPT.
    pub const fn invept_all(self) -> bool {
        self.0 & (1 << 26) != 0
    }

    /// What root needs of EPT and this CPU lacks, first found, for the
    /// refusal "EPT lacks ...": 4-level write-back paging structures (the
    /// builder's), execute-only translations (hooked pages execute from
    /// their shadow while the guest's reads and writes fault), and
    /// single-context INVEPT (every change invalidates a vCPU's own
    /// views). `None` when all are there. A nested KVM offers them all
    /// when the host CPU has them (execute-only follows the host's).
    pub const fn missing(self) -> Option<&'static str> {
        if !self.walk_length_4() || !self.write_back() {
            Some("4-level write-back paging structures")
        } else if !self.execute_only() {
            Some("execute-only translations (hooked pages execute from their shadow)")
        } else if !self.invept() || !self.invept_single() {
            Some("single-context INVEPT")
        } else {
            None
        }
    }
}

/// A control word the CPU cannot give us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingControls {
    /// Which control word.
    pub word: &'static str,
    /// The wanted bits the CPU does not allow to be 1.
    pub missing: u32,
}

impl core::fmt::Display for MissingControls {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "the CPU lacks required VMX {} controls {:#010x}",
            self.word, self.missing
        )
    }
}

/// Combines the controls we need (`required`), those we would like
/// (`optional`, granted only where allowed) with a capability MSR value whose
/// low half is the allowed-0 settings (bits that must be 1) and whose high
/// half is the allowed-1 settings (bits that may be 1). SDM A.3.
pub fn adjust_controls(
    word: &'static str,
    required: u32,
    optional: u32,
    cap: u64,
) -> Result<u32, MissingControls> {
    let must_be_one = cap as u32;
    let may_be_one = (cap >> 32) as u32;
    let missing = required & !may_be_one;
    if missing != 0 {
        return Err(MissingControls { word, missing });
    }
    Ok((required | (optional & may_be_one) | must_be_one) & may_be_one)
}

/// Applies IA32_VMX_CR{0,4}_FIXED0 (bits that must be 1) and FIXED1 (bits
/// that may be 1) to a control-register value. SDM A.7 and A.8.
pub const fn apply_fixed(value: u64, fixed0: u64, fixed1: u64) -> u64 {
    (value | fixed0) & fixed1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_decodes_the_measured_bochs_value() {
        // FACTS.md: Bochs icelake_u IA32_VMX_BASIC.
        let b = VmxBasic(0x00d8_1000_0000_0004);
        assert_eq!(b.revision(), 4);
        assert_eq!(b.region_size(), 0x1000);
        assert!(b.has_true_controls());
    }

    #[test]
    fn ept_caps_decode_the_measured_bochs_value() {
        let c = EptVpidCap(0x0000_0f01_0633_4141);
        assert!(c.execute_only());
        assert!(c.walk_length_4());
        assert!(c.write_back());
        assert!(c.pages_2m());
        assert!(c.invept());
        assert!(c.invept_all());
    }

    #[test]
    fn controls_respect_allowed_settings() {
        // allowed-0 = 0x16 (bits that must be 1), allowed-1 = 0x7f.
        let cap = (0x7fu64 << 32) | 0x16;
        assert_eq!(adjust_controls("pin", 0x40, 0x100, cap), Ok(0x56));
        let e = adjust_controls("pin", 0x80, 0, cap).unwrap_err();
        assert_eq!(e.missing, 0x80);
        assert!(e.to_string().contains("pin"));
    }

    #[test]
    fn fixed_bits_apply() {
        assert_eq!(apply_fixed(0x20, 0x2000, 0x3ff7ff), 0x2020);
        assert_eq!(apply_fixed(0x40_0000, 0, 0x3f_ffff), 0);
    }

    #[test]
    fn ept_needs_are_named_one_at_a_time() {
        // Bochs 2.7's value, as root logs it.
        let bochs = EptVpidCap(0xf0106334141);
        assert_eq!(bochs.missing(), None);
        assert_eq!(
            EptVpidCap(bochs.0 & !1).missing(),
            Some("execute-only translations (hooked pages execute from their shadow)")
        );
        assert_eq!(
            EptVpidCap(bochs.0 & !(1 << 25)).missing(),
            Some("single-context INVEPT")
        );
        assert_eq!(
            EptVpidCap(bochs.0 & !(1 << 20)).missing(),
            Some("single-context INVEPT")
        );
        assert_eq!(
            EptVpidCap(bochs.0 & !(1 << 14)).missing(),
            Some("4-level write-back paging structures")
        );
    }
}
