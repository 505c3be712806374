//! Port I/O exits decided. Root keeps some ports from the guest (its
//! control UART, the log port, the bus-master IDE registers); a write may
//! reset the machine or power it off; and an access is served whole (the
//! ACPI PM1 control registers, PCI configuration space) or a byte at a
//! time, root's ports floating. [`Ports::route`] and [`Ports::byte_out`]
//! decide; root's `exits/io.rs` performs the decisions with IN and OUT.

use super::exit::IoAccess;
use crate::policy;
use core::ops::RangeInclusive;
use protocol::GuardReport;

/// The ports an access is decided against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ports {
    /// The bus-master IDE function's register block, when there is one.
    pub dma: Option<RangeInclusive<u16>>,
    /// The ACPI PM1a and PM1b control ports, from the FADT.
    pub pm1: Option<(u16, Option<u16>)>,
}

/// Why a port write ends the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortStop {
    /// A software reset (port 0xCF9, the keyboard controller): it would
    /// restart the machine without root.
    Reset,
    /// SLP_EN written to a PM1 control register.
    PowerOff {
        /// The PM1 control port.
        port: u16,
        /// The value written.
        value: u32,
        /// Its size in bytes.
        size: u8,
    },
}

/// How a port access is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortRoute {
    /// The VM stops.
    Stop(PortStop),
    /// A read of a PM1 control register, forwarded at its size.
    Pm1Read,
    /// A write of a PM1 control register without SLP_EN, forwarded at its
    /// size.
    Pm1Write(u32),
    /// PCI configuration space (mechanism #1): the address latch or data,
    /// filtered (`crate::pci`).
    Pci,
    /// A byte at a time: root's ports float (reads all ones, writes
    /// dropped), the others go to the platform ([`Ports::byte_out`]).
    Bytes,
}

/// What becomes of one byte of a write served a byte at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteOut {
    /// Root's port: dropped.
    Drop,
    /// The platform's: written.
    Forward,
    /// The high byte of a PM1 control register with SLP_EN: the VM powers
    /// off, with the register's low byte at `base` read back.
    PowerOff {
        /// The PM1 control port.
        base: u16,
    },
    /// A byte that resets the machine ([`policy::resets`]): the VM stops.
    Reset,
}

impl Ports {
    /// Whether root keeps `port` from the guest: the control UART, the
    /// log port and the bus-master IDE registers.
    pub fn owns(&self, port: u16) -> bool {
        policy::CONTROL_PORTS.contains(&port)
            || port == policy::DEBUG_PORT
            || self.dma.as_ref().is_some_and(|d| d.contains(&port))
    }

    /// Whether any byte of the access is a port root keeps.
    pub fn touches_owned(&self, io: &IoAccess) -> bool {
        (0..u16::from(io.size.max(1))).any(|i| io.port.checked_add(i).is_some_and(|p| self.owns(p)))
    }

    /// Whether `port` is a PM1 control register.
    fn is_pm1(&self, port: u16) -> bool {
        self.pm1.is_some_and(|(a, b)| port == a || Some(port) == b)
    }

    /// How the IN or OUT `io` is served, the value of a write in `rax`;
    /// the guest's writes to the log port and to the bus-master registers
    /// are counted in `guard`.
    pub fn route(&self, io: &IoAccess, rax: u64, guard: &mut GuardReport) -> PortRoute {
        if !io.input {
            let debug = policy::DEBUG_PORT..=policy::DEBUG_PORT;
            if policy::io_touches(io.port, io.size, &debug) {
                guard.debug_port_writes += 1;
            }
            if self
                .dma
                .as_ref()
                .is_some_and(|d| policy::io_touches(io.port, io.size, d))
            {
                guard.dma_port_writes_blocked += 1;
            }
            if policy::resets(io.port, io.size, rax as u32) {
                return PortRoute::Stop(PortStop::Reset);
            }
        }
        if self.is_pm1(io.port) && !self.touches_owned(io) {
            if io.input {
                return PortRoute::Pm1Read;
            }
            let value = (rax & u64::from(policy::floating_bus(io.size))) as u32;
            if value & policy::PM1_SLP_EN != 0 {
                return PortRoute::Stop(PortStop::PowerOff {
                    port: io.port,
                    value,
                    size: io.size,
                });
            }
            return PortRoute::Pm1Write(value);
        }
        if io.port == crate::pci::CONFIG_ADDRESS || crate::pci::CONFIG_DATA.contains(&io.port) {
            return PortRoute::Pci;
        }
        PortRoute::Bytes
    }

    /// What becomes of `byte` written to `port` a byte at a time.
    pub fn byte_out(&self, port: u16, byte: u8) -> ByteOut {
        if self.owns(port) {
            return ByteOut::Drop;
        }
        if policy::resets(port, 1, u32::from(byte)) {
            return ByteOut::Reset;
        }
        let base = port.wrapping_sub(1);
        if self.is_pm1(base) && u32::from(byte) << 8 & policy::PM1_SLP_EN != 0 {
            return ByteOut::PowerOff { base };
        }
        ByteOut::Forward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wider OUT at 0xCF8 that is not the dword configuration address
    /// is split into bytes; the one that lands on the reset control
    /// register with its CPU-reset bit must stop the VM as a byte OUT to
    /// 0xCF9 does, not reach the platform (it reset Bochs under root).
    #[test]
    fn split_bytes_that_reset_stop_the_vm() {
        let ports = Ports::default();
        assert_eq!(ports.byte_out(0xCF9, 0x06), ByteOut::Reset);
        assert_eq!(ports.byte_out(0xCF9, 0x02), ByteOut::Forward);
        assert_eq!(ports.byte_out(0x64, 0xFE), ByteOut::Reset);
        assert_eq!(ports.byte_out(0x92, 0x01), ByteOut::Reset);
        assert_eq!(ports.byte_out(0xCF8, 0x06), ByteOut::Forward);
    }

    fn io(port: u16, size: u8, input: bool) -> IoAccess {
        IoAccess {
            port,
            size,
            input,
            string: false,
            rep: false,
        }
    }

    fn ports() -> Ports {
        Ports {
            dma: Some(0xc000..=0xc00f),
            pm1: Some((0x404, None)),
        }
    }

    #[test]
    fn root_keeps_its_uart_the_log_port_and_the_dma_block() {
        let p = ports();
        for port in [0x2f8, 0x2ff, 0xe9, 0xc000, 0xc00f] {
            assert!(p.owns(port), "{port:#x}");
        }
        for port in [0x2f7, 0x300, 0x3f8, 0xe8, 0xea, 0xbfff, 0xc010] {
            assert!(!p.owns(port), "{port:#x}");
        }
        assert!(!Ports::default().owns(0xc000), "no DMA block found");
        // An access owns the port if any of its bytes does.
        assert!(p.touches_owned(&io(0xe8, 2, false)));
        assert!(p.touches_owned(&io(0x2f6, 4, true)));
        assert!(!p.touches_owned(&io(0x2f4, 4, true)));
        assert!(
            !p.touches_owned(&io(0xffff, 4, true)),
            "no wrap past 0xffff"
        );
    }

    #[test]
    fn writes_to_roots_ports_are_counted_and_served_a_byte_at_a_time() {
        let p = ports();
        let mut g = GuardReport::default();
        assert_eq!(p.route(&io(0xe9, 1, false), 0x41, &mut g), PortRoute::Bytes);
        assert_eq!(
            p.route(&io(0xe8, 2, false), 0x4141, &mut g),
            PortRoute::Bytes
        );
        assert_eq!(p.route(&io(0xe9, 1, true), 0, &mut g), PortRoute::Bytes);
        assert_eq!(g.debug_port_writes, 2, "reads are not counted");
        assert_eq!(p.route(&io(0xc004, 4, false), 0, &mut g), PortRoute::Bytes);
        assert_eq!(g.dma_port_writes_blocked, 1);
        assert_eq!(p.byte_out(0xe9, 0x41), ByteOut::Drop);
        assert_eq!(p.byte_out(0xc004, 1), ByteOut::Drop);
        assert_eq!(p.byte_out(0x80, 1), ByteOut::Forward);
    }

    #[test]
    fn resets_and_sleep_stop_the_vm_and_pm1_is_served_whole() {
        let p = ports();
        let mut g = GuardReport::default();
        assert_eq!(
            p.route(&io(0xcf9, 1, false), 0x06, &mut g),
            PortRoute::Stop(PortStop::Reset)
        );
        assert_eq!(
            p.route(&io(0xcf9, 1, false), 0x02, &mut g),
            PortRoute::Bytes
        );
        assert_eq!(
            p.route(&io(0x64, 1, false), 0xfe, &mut g),
            PortRoute::Stop(PortStop::Reset)
        );
        let sleep = 0x2000 | 5 << 10;
        assert_eq!(
            p.route(&io(0x404, 2, false), 0xffff_0000 | sleep, &mut g),
            PortRoute::Stop(PortStop::PowerOff {
                port: 0x404,
                value: sleep as u32,
                size: 2
            })
        );
        assert_eq!(
            p.route(&io(0x404, 2, false), 0x0001, &mut g),
            PortRoute::Pm1Write(1)
        );
        assert_eq!(p.route(&io(0x404, 2, true), 0, &mut g), PortRoute::Pm1Read);
        // Its high byte alone, a byte at a time.
        assert_eq!(
            p.route(&io(0x405, 1, false), 0x20, &mut g),
            PortRoute::Bytes
        );
        assert_eq!(p.byte_out(0x405, 0x20), ByteOut::PowerOff { base: 0x404 });
        assert_eq!(p.byte_out(0x405, 0x01), ByteOut::Forward);
        // No FADT: no PM1.
        let none = Ports::default();
        assert_eq!(
            none.route(&io(0x404, 2, false), sleep, &mut g),
            PortRoute::Bytes
        );
        assert_eq!(none.byte_out(0x405, 0x20), ByteOut::Forward);
    }

    #[test]
    fn pci_configuration_is_filtered_and_the_rest_goes_bytewise() {
        let p = ports();
        let mut g = GuardReport::default();
        for port in [0xcf8, 0xcfc, 0xcfd, 0xcfe, 0xcff] {
            assert_eq!(
                p.route(&io(port, 1, true), 0, &mut g),
                PortRoute::Pci,
                "{port:#x}"
            );
        }
        for port in [0x80, 0x3f8, 0x70, 0xcfb] {
            assert_eq!(
                p.route(&io(port, 1, false), 0, &mut g),
                PortRoute::Bytes,
                "{port:#x}"
            );
        }
        assert_eq!(g, GuardReport::default(), "nothing of root's was written");
    }
}
