//! Root's own port I/O beyond the consoles: the PCI configuration
//! mechanism, the bus-master IDE function's discovery, and the writes root
//! makes on the guest's behalf.

use crate::arch::instructions as insn;
use hypervisor::pci;

/// Reads configuration dword `address` (a CONFIG_ADDRESS value).
pub fn pci_read(address: u32) -> u32 {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    // SAFETY: a configuration read; the address latch was just set.
    unsafe { insn::inl(*pci::CONFIG_DATA.start()) }
}

/// Writes `size` bytes of configuration space at data port `port` under
/// `address`, as the guest asked.
pub fn pci_data_write(address: u32, port: u16, size: u8, value: u32) {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    forward_out(port, size, value);
}

/// Writes configuration dword `address`.
pub fn pci_write(address: u32, value: u32) {
    forward_out(pci::CONFIG_ADDRESS, 4, address & !3);
    forward_out(*pci::CONFIG_DATA.start(), 4, value);
}

/// A bus-master IDE function and its bus-master register block (BAR4).
#[derive(Debug, Clone)]
pub struct DmaBlock {
    /// Bus, device, function.
    pub bdf: (u8, u8, u8),
    /// The configuration register of the I/O BAR (0x20).
    pub bar: u8,
    /// The ports it decodes.
    pub ports: core::ops::RangeInclusive<u16>,
}

/// Finds the bus-master IDE function on bus 0 (PIIX in Bochs and QEMU's
/// i440FX machines), before the guest runs: its bus-master registers can
/// make the controller write any physical address, hypervisor memory
/// included, so root keeps the guest away from them (and from moving them).
pub fn find_bus_master_ide() -> Option<DmaBlock> {
    for dev in 0..32u32 {
        for func in 0..8u32 {
            let address = pci::ConfigAddress {
                enabled: true,
                bdf: (0, dev as u8, func as u8),
                register: 0,
            }
            .encode();
            let id = pci_read(address);
            if id & 0xffff == 0xffff {
                if func == 0 {
                    break;
                }
                continue;
            }
            let class = pci_read(address | 0x08) >> 8;
            // Mass storage, IDE, bus-master capable (prog-if bit 7).
            if class >> 8 == 0x0101 && class & 0x80 != 0 {
                let bar = pci_read(address | 0x20);
                if bar & 1 == 1 && bar & 0xfffc != 0 {
                    let base = (bar & 0xfff0) as u16;
                    return Some(DmaBlock {
                        bdf: (0, dev as u8, func as u8),
                        bar: 0x20,
                        ports: base..=base + 15,
                    });
                }
            }
        }
    }
    None
}

/// Performs an IN of `size` bytes on behalf of the guest.
pub fn forward_in(port: u16, size: u8) -> u32 {
    // SAFETY: the guest asked for exactly this read of a port the platform
    // answers for it (the callers keep root's own ports out).
    unsafe {
        match size {
            1 => u32::from(insn::inb(port)),
            2 => u32::from(insn::inw(port)),
            _ => insn::inl(port),
        }
    }
}

/// Performs an OUT on behalf of the guest.
pub fn forward_out(port: u16, size: u8, value: u32) {
    // SAFETY: the guest asked for exactly this write to a port it owns
    // (the ACPI PM1 control block).
    unsafe {
        match size {
            1 => insn::outb(port, value as u8),
            2 => insn::outw(port, value as u16),
            _ => insn::outl(port, value),
        }
    }
}
