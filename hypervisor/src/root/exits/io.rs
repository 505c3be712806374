//! Port I/O: root's own ports, PCI configuration space, the bus-master
//! IDE registers, forwarded ports and string I/O through the guest's page
//! tables.

use super::guest_mem::{legacy_paging, GuardedPhys, MemoryFault, OperandWalk};
use super::*;
use hypervisor::vmx::port::{ByteOut, PortRoute, PortStop, Ports};

impl Vcpu<'_> {
    /// A guest access to PCI configuration space (mechanism #1): the address
    /// latch is forwarded and remembered; data reads are forwarded; data
    /// writes are merged into the dword and filtered (`hypervisor::pci`).
    pub(super) fn pci_config(
        &mut self,
        io: IoAccess,
        ports: &Ports,
    ) -> Result<Option<StopReason>, VmcsError> {
        let mask = policy::floating_bus(io.size);
        if io.port == pci::CONFIG_ADDRESS && io.size == 4 {
            if io.input {
                // SAFETY: the configuration address register, read for the guest.
                let v = unsafe { insn::inl(pci::CONFIG_ADDRESS) };
                self.cpu.regs.rax = (self.cpu.regs.rax & !0xffff_ffff) | u64::from(v);
            } else {
                let v = self.cpu.regs.rax as u32;
                self.vm.pci_address = v;
                forward_out(pci::CONFIG_ADDRESS, 4, v);
            }
            return Ok(None);
        }
        let addr = pci::ConfigAddress::decode(self.vm.pci_address);
        if !pci::CONFIG_DATA.contains(&io.port) || !addr.enabled {
            // 0xCF9 (reset control) and friends, or data with cycles off:
            // the platform's, byte by byte.
            return Ok(self.io_bytes(io, ports));
        }
        let offset = (io.port - pci::CONFIG_DATA.start()) as u8;
        if io.input {
            // A configuration read for the guest, at the address it set.
            forward_out(pci::CONFIG_ADDRESS, 4, self.vm.pci_address);
            self.read_for_guest(io);
            return Ok(None);
        }
        // Decide on the whole dword, but write only the bytes the guest
        // wrote, at its size: a read-modify-write of the dword would write
        // back neighbouring registers (write-1-to-clear status bits, chipset
        // controls) that the guest never touched.
        let old = pci_read(self.vm.pci_address);
        let new = pci::merge(old, offset, io.size, self.cpu.regs.rax as u32);
        let shift = u32::from(offset) * 8;
        let guest_bytes = |dword: u32| (dword >> shift) & mask;
        let blocked = self
            .vm
            .cfg
            .dma_block
            .as_ref()
            .filter(|d| d.bdf == addr.bdf)
            .map(|d| d.bar);
        match pci::config_write(addr.register, new, blocked) {
            pci::ConfigWrite::Write(v) => {
                if v != new {
                    self.cpu.guard.pci_writes_refused += 1;
                }
                pci_data_write(self.vm.pci_address, io.port, io.size, guest_bytes(v));
            }
            pci::ConfigWrite::Drop => self.cpu.guard.pci_writes_refused += 1,
            pci::ConfigWrite::WriteThenCheckBar => {
                pci_data_write(self.vm.pci_address, io.port, io.size, guest_bytes(new));
                let value = pci_read(self.vm.pci_address);
                pci_write(self.vm.pci_address, u32::MAX);
                let probe = pci_read(self.vm.pci_address);
                pci_write(self.vm.pci_address, value);
                let upper = (addr.register < 0x24 && (value & 7) == 4)
                    .then(|| pci_read(self.vm.pci_address + 4));
                let hv =
                    loader::layout::HV_RESERVED.as_u64()..loader::layout::HV_RESERVED_END.as_u64();
                if pci::bar_overlaps(addr.register, value, probe, upper, &hv) {
                    pci_write(self.vm.pci_address, old);
                    self.cpu.guard.pci_writes_refused += 1;
                }
            }
        }
        Ok(None)
    }

    pub(super) fn io(&mut self, io: IoAccess) -> Result<Next, VmcsError> {
        if io.string {
            return self.string_io(io);
        }
        let stop = self.port(io)?;
        self.advance()?;
        Ok(stop.map_or(Next::Resume, Next::Stop))
    }

    /// One IN or OUT of `io.size` bytes with the value in (or for) RAX, as
    /// the platform would answer it with root's policy applied
    /// (`hypervisor::vmx::port::Ports::route`): root's ports float, PM1 writes of SLP_EN stop
    /// the VM, PCI configuration is filtered, the rest goes to the
    /// platform. Does not move RIP.
    pub(super) fn port(&mut self, io: IoAccess) -> Result<Option<StopReason>, VmcsError> {
        let ports = self.vm.cfg.ports();
        match ports.route(&io, self.cpu.regs.rax, &mut self.cpu.guard) {
            PortRoute::Stop(PortStop::Reset) => {
                log::info!(
                    "vCPU {}: the guest reset the machine through port {:#x}",
                    self.cpu.index,
                    io.port
                );
                Ok(Some(StopReason::Reset))
            }
            PortRoute::Stop(PortStop::PowerOff { port, value, size }) => {
                Ok(Some(StopReason::PowerOff { port, value, size }))
            }
            PortRoute::Pm1Read => {
                // The guest's own read of its PM1 control register.
                self.read_for_guest(io);
                Ok(None)
            }
            PortRoute::Pm1Write(value) => {
                forward_out(io.port, io.size, value);
                Ok(None)
            }
            PortRoute::Pci => self.pci_config(io, &ports),
            // Everything else, straddles of root's ports included, byte by byte.
            PortRoute::Bytes => Ok(self.io_bytes(io, &ports)),
        }
    }

    /// INS or OUTS (with or without REP) on an intercepted port: one
    /// element per exit, through [`Self::port`], with its memory operand
    /// read or written through the guest's page tables and the guarded
    /// door. A REP instruction stays at its RIP with RCX and RSI/RDI moved
    /// on, and exits again for the next element, as the CPU would have
    /// let an interrupt in between. A memory operand the guest may not
    /// access gets #PF at that element; one that is not guest RAM floats
    /// (reads all ones, writes dropped).
    pub(super) fn string_io(&mut self, io: IoAccess) -> Result<Next, VmcsError> {
        let v = &Vmcs;
        let linear = f::GUEST_LINEAR_ADDRESS.read(v)?;
        let efer = f::GUEST_IA32_EFER.read(v)?;
        let cs_ar = f::GUEST_CS_ACCESS_RIGHTS.read(v)?;
        // The address size: from the instruction information when the CPU
        // reports it for INS/OUTS (IA32_VMX_BASIC bit 54), else from the
        // code segment (an address-size prefix is then not seen).
        let mask = if self.vm.cfg.ins_outs_info {
            policy::address_size_mask(f::EXIT_INSTRUCTION_INFO.read(v)?)
        } else if efer & policy::EFER_LMA != 0 && cs_ar & f::AR_L != 0 {
            u64::MAX
        } else if cs_ar & f::AR_DB != 0 {
            0xffff_ffff
        } else {
            0xffff
        };
        if io.rep && self.cpu.regs.rcx & mask == 0 {
            return self.advance();
        }
        self.cpu.guard.string_io_emulated += 1;
        let cpu = self.cpu_view()?;
        let cr0 = f::GUEST_CR0.read(v)?;
        let cr4 = f::GUEST_CR4.read(v)?;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        let size = usize::from(io.size.clamp(1, 4));
        let access = policy::StringAccess {
            write: io.input,
            user: cpu.cpl == 3,
            write_protect: cr0 & policy::CR0_WP != 0,
            smap: cr4 & policy::CR4_SMAP != 0 && rflags & policy::RFLAGS_AC == 0 && cpu.cpl < 3,
        };
        let walk = if cr0 & policy::CR0_PG == 0 {
            OperandWalk::Legacy(LegacyPaging::Off)
        } else if efer & policy::EFER_LMA != 0 {
            OperandWalk::Long(Cr3(cpu.cr3))
        } else {
            OperandWalk::Legacy(legacy_paging(v, cpu.cr3, cr4)?)
        };
        // Every byte is translated and checked before the port is touched:
        // a fault must not lose what a port read consumed.
        let mut gpas = [0u64; 4];
        for (i, gpa) in gpas.iter_mut().take(size).enumerate() {
            match walk.translate(linear.wrapping_add(i as u64), access) {
                Ok(g) => *gpa = g,
                Err(fault) => return self.memory_fault(fault),
            }
        }
        let ram = phys::guest_ram();
        let saved = self.cpu.regs.rax;
        if !io.input {
            let mut bytes = [0xffu8; 4];
            for (b, &gpa) in bytes.iter_mut().zip(&gpas).take(size) {
                if ram.read(gpa, core::slice::from_mut(b)).is_err() {
                    *b = 0xff;
                }
            }
            self.cpu.regs.rax = u64::from(u32::from_le_bytes(bytes));
        }
        let stop = self.port(IoAccess {
            string: false,
            rep: false,
            ..io
        })?;
        if io.input {
            let bytes = (self.cpu.regs.rax as u32).to_le_bytes();
            let mut written = GuardedPhys::default();
            for (b, &gpa) in bytes.iter().zip(&gpas).take(size) {
                // Not guest RAM (MMIO, a hole, hypervisor memory): dropped.
                if ram.write(gpa, core::slice::from_ref(b)).is_ok() {
                    written.note(gpa, 1);
                }
            }
            self.emulated_writes(&written);
        }
        self.cpu.regs.rax = saved;
        let step = if rflags & policy::RFLAGS_DF != 0 {
            (size as u64).wrapping_neg()
        } else {
            size as u64
        };
        // 16-bit writes keep the register's upper bits; 32-bit writes
        // zero-extend (in 64-bit mode; outside it the upper half is not
        // visible).
        let set = |reg: &mut u64, value: u64| {
            *reg = if mask == 0xffff {
                (*reg & !mask) | (value & mask)
            } else {
                value & mask
            };
        };
        let index = if io.input {
            &mut self.cpu.regs.rdi
        } else {
            &mut self.cpu.regs.rsi
        };
        set(index, index.wrapping_add(step));
        let last = if io.rep {
            let left = (self.cpu.regs.rcx & mask).wrapping_sub(1) & mask;
            set(&mut self.cpu.regs.rcx, left);
            left == 0
        } else {
            true
        };
        if last || stop.is_some() {
            self.advance()?;
        }
        Ok(stop.map_or(Next::Resume, Next::Stop))
    }

    /// Injects the fault of an emulated memory access.
    pub(super) fn memory_fault(&mut self, fault: MemoryFault) -> Result<Next, VmcsError> {
        match fault {
            MemoryFault::Page(linear, code) => self.page_fault(linear, code),
            MemoryFault::General => self.inject(GP, Some(0)),
        }
    }

    /// Injects #PF at `linear`. Root loads CR2 itself (CR2 is not in the
    /// VMCS) before the entry delivers the fault.
    pub(super) fn page_fault(&mut self, linear: u64, code: u32) -> Result<Next, VmcsError> {
        insn::write_cr2(linear);
        self.inject(PF, Some(code))
    }

    /// The guest's IN `io`, done by root at its size, into the guest's
    /// RAX (the bytes it did not read kept).
    fn read_for_guest(&mut self, io: IoAccess) {
        let mask = u64::from(policy::floating_bus(io.size));
        let v = u64::from(forward_in(io.port, io.size));
        self.cpu.regs.rax = (self.cpu.regs.rax & !mask) | (v & mask);
    }

    /// A port access outside root's special cases: a read that touches
    /// none of root's ports goes to the platform whole; anything else byte
    /// by byte, root's ports floating (reads all ones, writes dropped) and
    /// the others going to the platform, as a bus would split it; a byte
    /// that resets or writes SLP_EN to PM1 still stops the VM
    /// (`Ports::byte_out`).
    pub(super) fn io_bytes(&mut self, io: IoAccess, ports: &Ports) -> Option<StopReason> {
        let owned = (0..io.size.min(4)).any(|i| {
            io.port
                .checked_add(u16::from(i))
                .is_none_or(|p| ports.owns(p))
        });
        if io.input && !owned {
            // A read that touches none of root's ports: the platform
            // answers it whole, as it answers the bare guest (a dword IN at
            // 0xCFA reads all ones there, not two registers' bytes).
            self.read_for_guest(io);
            return None;
        }
        let mut value = 0u32;
        let out = self.cpu.regs.rax as u32;
        for i in 0..io.size.min(4) {
            let Some(p) = io.port.checked_add(u16::from(i)) else {
                break;
            };
            let shift = 8 * u32::from(i);
            if io.input {
                let byte = if ports.owns(p) {
                    0xff
                } else {
                    // SAFETY: a port the guest owns, read on its behalf.
                    unsafe { insn::inb(p) }
                };
                value |= u32::from(byte) << shift;
                continue;
            }
            let byte = (out >> shift) as u8;
            match ports.byte_out(p, byte) {
                ByteOut::Drop => {}
                ByteOut::Forward => forward_out(p, 1, u32::from(byte)),
                ByteOut::Reset => {
                    log::info!(
                        "vCPU {}: the guest reset the machine through port {p:#x}",
                        self.cpu.index
                    );
                    return Some(StopReason::Reset);
                }
                ByteOut::PowerOff { base } => {
                    // SAFETY: the guest's own PM1 register, read back.
                    let low = u32::from(unsafe { insn::inb(base) });
                    return Some(StopReason::PowerOff {
                        port: base,
                        value: low | u32::from(byte) << 8,
                        size: 2,
                    });
                }
            }
        }
        if io.input {
            let mask = policy::floating_bus(io.size) as u64;
            self.cpu.regs.rax = (self.cpu.regs.rax & !mask) | (u64::from(value) & mask);
        }
        None
    }
}
