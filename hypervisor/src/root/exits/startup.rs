//! An application processor's INIT and SIPI as root carries them out:
//! parking, starting at the guest's vector, resetting, and the SIPIs sent
//! again.

use super::*;
use hypervisor::tracer::exit::StepExit;

impl Vcpu<'_> {
    /// Sends again the SIPIs that wait for parked APs (a physical SIPI
    /// that reached an AP while it was in root was lost).
    pub(super) fn resend_sipis(&mut self) {
        let lapic = self.vm.lapic_base;
        for slot in self.vm.cpus.iter().skip(1) {
            if let (Some(vector), true, false) = (slot.sipi, slot.life.is_parked(), slot.init) {
                crate::smp::wake(lapic, slot.apic_id, vector);
            }
        }
    }

    /// Starts this parked AP at the SIPI's `vector`, as a SIPI starts a
    /// CPU in wait-for-SIPI; a SIPI to a running AP is discarded.
    pub(super) fn ap_start(&mut self, vector: u8) -> Result<Next, VmcsError> {
        let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) else {
            return Ok(Next::Resume);
        };
        if slot.life.on_sipi(vector).is_none() {
            return Ok(Next::Resume);
        }
        slot.init = false;
        ap::write_sipi_state(&mut Vmcs, vector, self.vm.cfg.has_timer)?;
        self.cpu.lapic_base = self.vm.lapic_base;
        self.cpu.parked = false;
        self.forget_events()?;
        if self.vm.cfg.has_timer {
            let t = self.timer_value(false);
            f::PREEMPTION_TIMER_VALUE.write(&mut Vmcs, t)?;
            self.cpu.timer = t;
        }
        // EPT may have changed while the AP was parked.
        self.cpu.invalidate_views();
        // NMIs to this CPU were blocked by the way Bochs 2.7 takes the SIPI
        // exit; an IRET in root lets them through again (a no-op on a CPU
        // whose NMIs are not blocked).
        insn::iret_to_self();
        log::info!(
            "vCPU {} started at {:#x}",
            self.cpu.index,
            u64::from(vector) << 12
        );
        Ok(Next::Resume)
    }

    /// A SIPI exit that starts nothing: back to wait-for-SIPI (Bochs 2.7
    /// saves the activity as active, and blocking bits, after it).
    pub(super) fn stay_parked(&mut self) -> Result<Next, VmcsError> {
        if self
            .vm
            .cpus
            .get(self.cpu.index)
            .is_some_and(|s| s.life.is_parked())
        {
            f::GUEST_INTERRUPTIBILITY.write(&mut Vmcs, 0)?;
            f::GUEST_ACTIVITY_STATE.write(&mut Vmcs, ap::ACTIVITY_WAIT_FOR_SIPI)?;
        }
        Ok(Next::Resume)
    }

    /// Drops the events this vCPU carried (INIT and SIPI discard them): the
    /// event to inject, the interrupted one, a pending NMI and NMI-window
    /// exiting, in the VMCS as well as in root's copy.
    pub(super) fn forget_events(&mut self) -> Result<(), VmcsError> {
        self.cpu.inject = None;
        self.cpu.vectoring = None;
        crate::fatal::take_nmi(self.cpu.index);
        if self.cpu.nmi_window {
            let ctl = f::PRIMARY_PROC_CONTROLS.read(&Vmcs)?;
            f::PRIMARY_PROC_CONTROLS.write(&mut Vmcs, ctl & !NMI_WINDOW_EXITING)?;
            self.cpu.nmi_window = false;
        }
        Ok(())
    }

    /// Resets this AP as INIT does and parks it in wait-for-SIPI.
    pub(super) fn ap_park(&mut self) -> Result<Next, VmcsError> {
        self.ap_reset(true)
    }

    /// An INIT that reached this AP as a signal. None of the guest's
    /// should: root carries out the INITs the guest writes to its ICR,
    /// and drops those it would route past root (`hypervisor::irq`). One
    /// that still comes parks the AP as INIT does; when they keep coming
    /// (Bochs 2.7 keeps an INIT pending for good, so it parks the AP again
    /// at every start) the AP is held parked and its SIPIs are dropped
    /// (`hypervisor::irq::InitLimiter`), logged once.
    pub(super) fn init_exit(&mut self) -> Result<Next, VmcsError> {
        use hypervisor::irq::{InitLimiter, InitVerdict};
        let now = self.vm.clock.now();
        let window = self.vm.tsc_hz;
        let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) else {
            return self.ap_park();
        };
        match slot.init_limiter.on_init(now, window) {
            InitVerdict::Park => self.ap_park(),
            InitVerdict::Hold { first } => {
                slot.sipi = None;
                if first {
                    log::info!(
                        "vCPU {}: more than {} INIT exits in a second (an INIT the emulator keeps pending): it stays parked, and start-up IPIs to it are dropped",
                        self.cpu.index,
                        InitLimiter::LIMIT
                    );
                }
                self.ap_reset(false)
            }
        }
    }

    /// [`Self::ap_park`], with its log line when `log`.
    pub(super) fn ap_reset(&mut self, log: bool) -> Result<Next, VmcsError> {
        let fixed = ap::FixedCrs {
            cr0: self.vm.cfg.fixed.cr0,
            cr4: self.vm.cfg.fixed.cr4,
        };
        ap::write_init_state(&mut Vmcs, &mut self.cpu.regs, fixed, insn::cpuid(1, 0)[0])?;
        if let Some(slot) = self.vm.cpus.get_mut(self.cpu.index) {
            slot.life.on_init();
            slot.init = false;
        }
        // A step in flight ends: INIT resets RFLAGS, and the pages must
        // not stay open while the AP sleeps.
        self.step_exit(StepExit::Init);
        self.step_irq_exits(false)?;
        self.cpu.parked = true;
        self.forget_events()?;
        if self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, 0)?;
            self.cpu.debug_exits = false;
        }
        if log {
            log::info!("vCPU {} parked by INIT", self.cpu.index);
        }
        Ok(Next::Resume)
    }

    /// Before an AP's next entry: the INIT and SIPI that other vCPUs
    /// posted for it (`smp`).
    pub(super) fn ap_mailbox(&mut self) -> Result<(), VmcsError> {
        if self.cpu.index == 0 {
            return Ok(());
        }
        let Some(init) = self.vm.cpus.get(self.cpu.index).map(|s| s.init) else {
            return Ok(());
        };
        if init {
            self.ap_park()?;
        }
        let parked = self
            .vm
            .cpus
            .get(self.cpu.index)
            .is_some_and(|s| s.life.is_parked());
        if parked {
            if let Some(vector) = self
                .vm
                .cpus
                .get_mut(self.cpu.index)
                .and_then(|s| s.sipi.take())
            {
                self.ap_start(vector)?;
            }
        }
        Ok(())
    }
}
