//! PCI configuration mechanism #1 (ports 0xCF8 and 0xCFC-0xCFF), as VMX
//! root filters it.
//!
//! A device that masters the bus writes physical memory without the CPU,
//! so EPT does not stop it: without an IOMMU, the only way to keep a
//! guest's devices out of hypervisor memory is to keep the guest from
//! pointing them there. Root intercepts configuration space and:
//! - refuses the Bus Master Enable bit of every function: the devices of
//!   the machines hvtrace builds (the i440FX host bridge, the PIIX ISA, IDE,
//!   USB and ACPI functions) are not needed for DMA by the guest, which
//!   boots from memory;
//! - refuses a memory BAR (or expansion ROM base) placed over hypervisor
//!   memory, so no device window can shadow root's memory;
//! - refuses moving the I/O BAR of a function whose bus-master registers
//!   root keeps the guest away from (see [`PciFilter::blocked_io`]).
//!
//! The decisions are pure functions here; the exit handler does the port
//! I/O.

/// The configuration address port.
pub const CONFIG_ADDRESS: u16 = 0xcf8;
/// The configuration data ports.
pub const CONFIG_DATA: core::ops::RangeInclusive<u16> = 0xcfc..=0xcff;

/// The command register's Bus Master Enable bit.
pub const COMMAND_BUS_MASTER: u32 = 1 << 2;

/// A decoded CONFIG_ADDRESS value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigAddress {
    /// Bit 31: configuration cycles enabled.
    pub enabled: bool,
    /// Bus, device, function.
    pub bdf: (u8, u8, u8),
    /// Register offset (dword aligned).
    pub register: u8,
}

impl ConfigAddress {
    /// The value to write to 0xCF8 for this address.
    pub const fn encode(self) -> u32 {
        (self.enabled as u32) << 31
            | (self.bdf.0 as u32) << 16
            | (self.bdf.1 as u32 & 0x1f) << 11
            | (self.bdf.2 as u32 & 7) << 8
            | (self.register as u32 & 0xfc)
    }

    /// Decodes the value written to 0xCF8.
    pub fn decode(v: u32) -> ConfigAddress {
        ConfigAddress {
            enabled: v & (1 << 31) != 0,
            bdf: (
                (v >> 16) as u8,
                ((v >> 11) & 0x1f) as u8,
                ((v >> 8) & 7) as u8,
            ),
            register: (v & 0xfc) as u8,
        }
    }
}

/// What to do with a configuration write, once merged into a whole dword.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigWrite {
    /// Write this dword (possibly changed from what the guest wrote).
    Write(u32),
    /// Drop the write; the register keeps its old value.
    Drop,
    /// Write it, then check where the BAR landed with [`bar_overlaps`]
    /// (the size is only known by probing the device).
    WriteThenCheckBar,
}

/// Merges a write of `size` bytes at byte `offset` (0..4) of a dword into
/// its old value.
pub fn merge(old: u32, offset: u8, size: u8, value: u32) -> u32 {
    let bits = u32::from(size.min(4)) * 8;
    let mask = if bits >= 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    };
    let shift = u32::from(offset & 3) * 8;
    let mask = mask.checked_shl(shift).unwrap_or(0);
    (old & !mask) | (value.checked_shl(shift).unwrap_or(0) & mask)
}

/// Decides a write of the dword `new` to `register` of a type-0 function
/// (`blocked_io_bar`: the register of an I/O BAR root keeps in place).
pub fn config_write(register: u8, new: u32, blocked_io_bar: Option<u8>) -> ConfigWrite {
    match register {
        // Command (low half) and status (high half: write-1-to-clear bits).
        0x04 => ConfigWrite::Write(new & !COMMAND_BUS_MASTER),
        r if Some(r) == blocked_io_bar => ConfigWrite::Drop,
        0x10..=0x24 | 0x30 => ConfigWrite::WriteThenCheckBar,
        _ => ConfigWrite::Write(new),
    }
}

/// Whether a BAR whose register reads `value` after the write, and whose
/// size probe read back `probe` (all ones written), puts a memory window
/// over `reserved`. `upper` is the next register for a 64-bit BAR.
/// I/O BARs and disabled ROM bases never do.
pub fn bar_overlaps(
    register: u8,
    value: u32,
    probe: u32,
    upper: Option<u32>,
    reserved: &core::ops::Range<u64>,
) -> bool {
    let (base, size_mask) = if register == 0x30 {
        if value & 1 == 0 {
            return false; // ROM decoding off
        }
        (u64::from(value & 0xffff_f800), probe & 0xffff_f800)
    } else {
        if value & 1 != 0 {
            return false; // I/O space
        }
        let high = if (value >> 1) & 3 == 2 {
            u64::from(upper.unwrap_or(0)) << 32
        } else {
            0
        };
        (high | u64::from(value & 0xffff_fff0), probe & 0xffff_fff0)
    };
    if size_mask == 0 {
        return false; // not implemented
    }
    let size = u64::from(!size_mask) + 1;
    base < reserved.end && base.saturating_add(size) > reserved.start
}

#[cfg(test)]
mod tests {
    use super::*;

    const HV: core::ops::Range<u64> = 0x20_0000..0x200_0000;

    #[test]
    fn addresses_decode() {
        let a = ConfigAddress::decode(0x8000_0920);
        assert_eq!(
            a,
            ConfigAddress {
                enabled: true,
                bdf: (0, 1, 1),
                register: 0x20
            }
        );
        assert!(!ConfigAddress::decode(0x0000_0904).enabled);
        // Encoding is decoding's inverse (the low two bits are not kept).
        for v in [0x8000_0920u32, 0x0000_0904, 0x80ff_f8fc, 0x8000_0800] {
            assert_eq!(ConfigAddress::decode(v).encode(), v);
        }
        let bm = ConfigAddress {
            enabled: true,
            bdf: (0, 1, 1),
            register: 0x20,
        };
        assert_eq!(bm.encode(), 0x8000_0920);
    }

    #[test]
    fn partial_writes_merge_into_the_dword() {
        assert_eq!(merge(0x1122_3344, 0, 4, 0xaabb_ccdd), 0xaabb_ccdd);
        assert_eq!(merge(0x1122_3344, 0, 2, 0xaabb_ccdd), 0x1122_ccdd);
        assert_eq!(merge(0x1122_3344, 2, 2, 0xccdd), 0xccdd_3344);
        assert_eq!(merge(0x1122_3344, 1, 1, 0xdd), 0x1122_dd44);
        assert_eq!(merge(0x1122_3344, 3, 1, 0xdd), 0xdd22_3344);
    }

    #[test]
    fn bus_mastering_is_never_enabled() {
        // I/O + memory + bus master asked: bus master dropped, the rest kept.
        assert_eq!(
            config_write(0x04, 0x0280_0007, None),
            ConfigWrite::Write(0x0280_0003)
        );
        assert_eq!(config_write(0x04, 0x0000_0001, None), ConfigWrite::Write(1));
        // Other registers go through, BARs are checked after, the
        // protected I/O BAR stays put.
        assert_eq!(
            config_write(0x3c, 0x0000_010b, None),
            ConfigWrite::Write(0x10b)
        );
        assert_eq!(
            config_write(0x10, 0x100_0000, None),
            ConfigWrite::WriteThenCheckBar
        );
        assert_eq!(config_write(0x20, 0xc001, Some(0x20)), ConfigWrite::Drop);
        assert_eq!(
            config_write(0x30, 0x100_0001, None),
            ConfigWrite::WriteThenCheckBar
        );
    }

    #[test]
    fn memory_windows_over_hypervisor_memory_are_found() {
        // A 4 KiB 32-bit memory BAR at 16 MiB: inside.
        assert!(bar_overlaps(0x10, 0x100_0000, 0xffff_f000, None, &HV));
        // 1 MiB BAR at 1 MiB ends exactly at 2 MiB: outside; a 64 MiB BAR
        // at 0 covers all of it.
        assert!(!bar_overlaps(0x10, 0x10_0000, 0xfff0_0000, None, &HV));
        assert!(bar_overlaps(0x10, 0x0, 0xfc00_0000, None, &HV));
        // At the usual PCI hole: outside.
        assert!(!bar_overlaps(0x10, 0xfebf_0000, 0xffff_f000, None, &HV));
        // 64-bit BAR: the upper half moves it above 4 GiB.
        assert!(!bar_overlaps(0x10, 0x100_0004, 0xffff_f00c, Some(1), &HV));
        assert!(bar_overlaps(0x10, 0x100_0004, 0xffff_f00c, Some(0), &HV));
        // I/O BARs and a disabled ROM never; an enabled ROM at 4 MiB does.
        assert!(!bar_overlaps(0x20, 0xc001, 0xffff_fff1, None, &HV));
        assert!(!bar_overlaps(0x30, 0x40_0000, 0xffff_f801, None, &HV));
        assert!(bar_overlaps(0x30, 0x40_0001, 0xffff_f801, None, &HV));
        // An unimplemented BAR (probe reads 0).
        assert!(!bar_overlaps(0x14, 0x100_0000, 0, None, &HV));
    }
}
