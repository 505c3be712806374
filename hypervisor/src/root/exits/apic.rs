//! The guest's stores to the local APIC page that root decodes (its own
//! instruction decoder), the interrupt command register and the I/O APIC
//! and MSI windows: what reaches the hardware, and what is refused.

use super::*;

/// A decoded guest store to an interrupt window (the APIC page, an I/O
/// APIC's, the MSI MiB): the instruction and the value.
pub(super) struct ApicStore {
    store: hypervisor::apic::Store,
    value: u32,
}

/// Decodes the guest's store at RIP, through `hypervisor::apic::guest_store`:
/// refused when the exit interrupted an event's delivery (the store was
/// the delivery's, not the instruction's), outside 64-bit mode on 4-level
/// paging (the only mode the decoder and the walk of RIP know), and when
/// the instruction is not one root carries out.
pub(super) fn decode_apic_store(
    cpu: &mut CpuState,
) -> Result<Result<ApicStore, hypervisor::apic::Refusal>, VmcsError> {
    let v = &Vmcs;
    let mode = hypervisor::apic::GuestMode {
        cr0: f::GUEST_CR0.read(v)?,
        cr4: f::GUEST_CR4.read(v)?,
        efer: f::GUEST_IA32_EFER.read(v)?,
        cs_access_rights: f::GUEST_CS_ACCESS_RIGHTS.read(v)?,
    };
    let rip = f::GUEST_RIP.read(v)?;
    let cr3 = Cr3(f::GUEST_CR3.read(v)?);
    let decoded = hypervisor::apic::guest_store(&mode, cpu.vectoring.is_some(), |bytes| {
        // The instruction may end before a page it does not reach.
        let room = (0x1000 - (rip & 0xfff)).min(15) as usize;
        for len in [bytes.len(), room] {
            if let Some(b) = bytes.get_mut(..len) {
                if paging::read_virt(&GuestRam, cr3, Gva(rip), b).is_ok() {
                    return len;
                }
            }
        }
        0
    });
    let store = match decoded {
        Ok(store) => store,
        Err(why) => return Ok(Err(why)),
    };
    let value = match store.value {
        hypervisor::apic::StoreValue::Imm(x) => x,
        hypervisor::apic::StoreValue::Reg(4) => f::GUEST_RSP.read(v)? as u32,
        hypervisor::apic::StoreValue::Reg(n) => gpr(&mut cpu.regs, n).map_or(0, |r| *r as u32),
    };
    Ok(Ok(ApicStore { store, value }))
}

/// Refuses a guest store to an interrupt window with #GP(0). When the
/// store was part of an event's delivery, the #GP meets that event as the
/// SDM's double-fault rules say (`event::nested_fault`): a #DF after a
/// contributory exception or a #PF, a shutdown during a #DF's delivery, so
/// that a guest whose stack points into the window ends as it would on a
/// CPU that faulted there, never in a loop of refusals.
pub(super) fn refuse_store(cpu: &mut CpuState) -> Next {
    cpu.apic_refused += 1;
    match event::nested_fault(cpu.vectoring.as_ref(), Event::exception(GP, Some(0))) {
        event::Nested::Deliver(e) => {
            cpu.vectoring = None;
            cpu.inject = Some(e);
            Next::Resume
        }
        event::Nested::Shutdown => {
            log::warn!(
                "vCPU {}: a refused APIC store faulted while a double fault was delivered: shutdown",
                cpu.index
            );
            Next::Stop(StopReason::TripleFault)
        }
    }
}

/// Set once a guest store that would program INIT (or SMI, or a reserved
/// delivery mode) into an interrupt route was dropped: root logs the first.
pub(super) static ROUTE_REFUSED: core::sync::atomic::AtomicBool =
    core::sync::atomic::AtomicBool::new(false);

/// Counts a dropped store to an interrupt route (`what`, with `value`),
/// and logs the first of the VM.
pub(super) fn route_refused(cpu: &mut CpuState, what: &str, value: u64) {
    cpu.apic_refused += 1;
    if !ROUTE_REFUSED.swap(true, core::sync::atomic::Ordering::Relaxed) {
        log::info!(
            "vCPU {}: the guest's {what} {value:#x} (delivery mode {:#05b}) dropped: no INIT, SMI or reserved mode past root; further ones are counted only",
            cpu.index,
            hypervisor::apic::routed_mode(value as u32)
        );
    }
}

/// Completes a store root carried out: XCHG's register gets the old
/// value, and RIP moves past the instruction.
pub(super) fn complete_apic_store(
    cpu: &mut CpuState,
    s: &ApicStore,
    old: u32,
) -> Result<(), VmcsError> {
    if s.store.xchg {
        if let hypervisor::apic::StoreValue::Reg(n) = s.store.value {
            if n == 4 {
                f::GUEST_RSP.write(&mut Vmcs, u64::from(old))?;
            } else if let Some(r) = gpr(&mut cpu.regs, n) {
                *r = u64::from(old);
            }
        }
    }
    entry::advance_by(&mut Vmcs, u64::from(s.store.len))
}

/// A guest store to a register of the APIC page other than the ICR's low
/// word: root carries it out on this CPU's APIC, unless
/// `hypervisor::apic::register_write` drops it (a read-only or reserved
/// register, the APIC ID, an LVT entry with INIT, SMI or a reserved
/// delivery mode). A store it may not decode is refused ([`refuse_store`]).
pub(super) fn apic_store(cpu: &mut CpuState, offset: u64) -> Result<Next, VmcsError> {
    use hypervisor::apic::RegisterWrite;
    let s = match decode_apic_store(cpu)? {
        Ok(s) => s,
        Err(_) => return Ok(refuse_store(cpu)),
    };
    let lapic = cpu.lapic_base;
    // Only XCHG reads the register (a read can have effects of its own).
    let old = if s.store.xchg {
        crate::arch::ap_start::apic_read(lapic, offset)
    } else {
        0
    };
    match hypervisor::apic::register_write(offset, s.value) {
        RegisterWrite::Carry => crate::arch::ap_start::apic_write(lapic, offset, s.value),
        RegisterWrite::Ignore => {}
        RegisterWrite::Refuse => route_refused(cpu, "LVT entry", u64::from(s.value)),
    }
    complete_apic_store(cpu, &s, old)?;
    Ok(Next::Resume)
}

impl Vcpu<'_> {
    /// A guest store to the local APIC's interrupt command register
    /// (low word): root decodes it and takes INIT and SIPI for its own
    /// (`smp`); other IPIs are written through. A store root cannot decode
    /// is refused with #GP.
    pub(super) fn icr_write(&mut self) -> Result<Next, VmcsError> {
        let st = match decode_apic_store(self.cpu)? {
            Ok(st) => st,
            Err(_) => return Ok(refuse_store(self.cpu)),
        };
        use crate::arch::ap_start::{apic_read, apic_write};
        use hypervisor::apic::{XAPIC_ICR_HIGH, XAPIC_ICR_LOW};
        let lapic = self.cpu.lapic_base;
        let old = if st.store.xchg {
            apic_read(lapic, XAPIC_ICR_LOW)
        } else {
            0
        };
        let icr = hypervisor::apic::Icr::from_xapic(st.value, apic_read(lapic, XAPIC_ICR_HIGH));
        let value = st.value;
        self.guest_ipi(&icr, || apic_write(lapic, XAPIC_ICR_LOW, value));
        complete_apic_store(self.cpu, &st, old)?;
        Ok(Next::Resume)
    }

    /// A guest store to an I/O APIC's page or to the MSI MiB
    /// (`hypervisor::irq`): root carries it out, except a redirection
    /// entry or an interrupt message with INIT, SMI or a reserved delivery
    /// mode (dropped, counted) and a store to no register of the I/O APIC
    /// (dropped). A store that is not aligned to its register (16 bytes in
    /// the I/O APIC, 4 in the MSI MiB) or that root may not decode is
    /// refused ([`refuse_store`]). Under the VM lock: the I/O APIC's
    /// register select is one for all vCPUs, and root reads it back before
    /// a store to the data window.
    pub(super) fn window_store(
        &mut self,
        window: hypervisor::irq::Window,
    ) -> Result<Next, VmcsError> {
        use crate::arch::ap_start::{window_read, window_write};
        use hypervisor::irq::{IoApicWrite, Window};
        let (addr, aligned) = match window {
            Window::IoApic { base, offset } => (base + offset, offset & 0xf == 0),
            Window::Msi { address } => (address, address & 0x3 == 0),
            // The local APIC's page is `local_exit`'s and `icr_write`'s.
            Window::LocalApic { .. } => return Ok(refuse_store(self.cpu)),
        };
        if !aligned {
            return Ok(refuse_store(self.cpu));
        }
        let st = match decode_apic_store(self.cpu)? {
            Ok(st) => st,
            Err(_) => return Ok(refuse_store(self.cpu)),
        };
        let (verdict, what) = match window {
            Window::IoApic { base, offset } => {
                let select = if offset == hypervisor::irq::IOWIN {
                    window_read(base + hypervisor::irq::IOREGSEL)
                } else {
                    0
                };
                (
                    hypervisor::irq::ioapic_write(offset, select, st.value),
                    "I/O APIC redirection entry",
                )
            }
            _ if hypervisor::irq::msi_write(st.value) => (IoApicWrite::Carry, ""),
            _ => (IoApicWrite::Refuse, "interrupt message (MSI)"),
        };
        let old = if st.store.xchg { window_read(addr) } else { 0 };
        match verdict {
            IoApicWrite::Carry => window_write(addr, st.value),
            IoApicWrite::Ignore => {}
            IoApicWrite::Refuse => route_refused(self.cpu, what, u64::from(st.value)),
        }
        complete_apic_store(self.cpu, &st, old)?;
        Ok(Next::Resume)
    }

    /// An IPI the guest asked for: INIT and SIPI to APs go to their slots
    /// (and a SIPI to a parked AP wakes it); everything else is sent as
    /// the guest wrote it, by `forward`.
    pub(super) fn guest_ipi(&mut self, icr: &hypervisor::apic::Icr, forward: impl FnOnce()) {
        use hypervisor::apic::{classify, targets, IpiAction};
        let action = classify(icr);
        let (init, sipi) = match action {
            IpiAction::Forward => {
                forward();
                return;
            }
            IpiAction::Ignore => return,
            IpiAction::Init => (true, None),
            IpiAction::Startup(vector) => (false, Some(vector)),
        };
        let ids: Vec<u32> = self.vm.cpus.iter().map(|s| s.apic_id).collect();
        let mask = targets(icr, self.cpu.index, &ids);
        let lapic = self.vm.lapic_base;
        for (i, slot) in self.vm.cpus.iter_mut().enumerate() {
            if i >= 32 || mask & (1 << i) == 0 {
                continue;
            }
            if i == 0 {
                // Start-up IPIs to the boot processor: nothing root models.
                self.cpu.apic_refused += 1;
                continue;
            }
            if init {
                slot.sipi = None;
                // A parked AP is already in the state INIT leaves.
                slot.init = !slot.life.is_parked();
            } else if let Some(vector) = sipi {
                if slot.init_limiter.holding() {
                    // An AP an emulator's pending INIT would park again at
                    // once (`Vcpu::init_exit`).
                    self.cpu.apic_refused += 1;
                } else if slot.life.is_parked() || slot.init {
                    slot.sipi = Some(vector);
                    if !slot.init {
                        crate::smp::wake(lapic, slot.apic_id, vector);
                    }
                }
            }
        }
    }
}
