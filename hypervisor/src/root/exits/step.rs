//! The single step that lets the guest read and write a hooked page: its
//! arming, the guest's TF around it, interrupts in it, and #DB.

use super::guest_mem::GuardedPhys;
use super::*;
use hypervisor::tracer::exit::{StepDone, StepExit};

impl Vcpu<'_> {
    /// The instruction that exited on an EPT violation did not complete, so
    /// no single-step is due for it; Bochs 2.7 still saves BS in the
    /// pending-debug-exceptions field when TF was set, and would deliver a
    /// #DB at the next entry before the instruction runs (ending a step
    /// that never happened, over and over).
    pub(super) fn clear_stale_step(&mut self) -> Result<(), VmcsError> {
        let v = &mut Vmcs;
        let pending = f::GUEST_PENDING_DEBUG_EXCEPTIONS.read(v)?;
        if pending & debug::PENDING_BS != 0 {
            f::GUEST_PENDING_DEBUG_EXCEPTIONS.write(v, pending & !debug::PENDING_BS)?;
        }
        Ok(())
    }

    /// An EPT violation the tracer does not own: a hypervisor bug.
    pub(super) fn bad_violation(
        &mut self,
        e: hypervisor::vmx::exit::EptViolation,
    ) -> Result<Next, VmcsError> {
        hvprintln!(
            "error: EPT violation: gpa {:#x} gla {:?} read={} write={} fetch={} allowed={:#x}",
            e.gpa,
            e.gla,
            e.read,
            e.write,
            e.fetch,
            e.allowed
        );
        let at = crate::machine::view_index(self.cpu.index, self.cpu.view);
        let leaf = self.vm.cfg.views.get(at).and_then(|ept| {
            ept.translate(
                &mut crate::frames::PoolTables,
                hypervisor::addr::Gpa(e.gpa & !0xfff),
            )
        });
        hvprintln!("error: EPT entry for that page: {leaf:?}");
        dump_vmcs();
        Ok(Next::Stop(StopReason::EptViolation { gpa: e.gpa }))
    }

    /// Lets the guest execute one instruction against the page the tracer
    /// just remapped: TF on, #DB intercepted. STI/MOV-SS blocking is
    /// dropped (an entry with TF and such blocking would need a pending
    /// single-step, which would trap before the instruction ran).
    pub(super) fn arm_step(&mut self) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        tracer!(self).set_old_tf(rflags & RFLAGS_TF != 0);
        f::GUEST_RFLAGS.write(v, rflags | RFLAGS_TF)?;
        let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
        if intr & event::BLOCKING_BY_STI_OR_MOV_SS != 0 {
            f::GUEST_INTERRUPTIBILITY.write(v, intr & !event::BLOCKING_BY_STI_OR_MOV_SS)?;
        }
        if !self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(v, 1 << DB)?;
            self.cpu.debug_exits = true;
        }
        self.step_irq_exits(hypervisor::vmx::debug::step_interrupt_exits(rflags))?;
        Ok(Next::Resume)
    }

    /// Root's emulation wrote the guest pages `phys` noted, straight to
    /// the guest's frames: a hooked one's shadows take the write (every
    /// hooked page when more pages were written than were noted).
    pub(super) fn emulated_writes(&mut self, phys: &GuardedPhys) {
        let pages = phys.pages();
        with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
            let mut t = tracer!(self);
            match pages {
                Some(pages) => {
                    for &page in pages {
                        t.emulated_write(page, env);
                    }
                }
                None => t.resync_all(env),
            }
        });
    }

    /// Puts the guest's own TF back after root's step ended without its
    /// #DB (the step's TF must not ride into an event's frame).
    pub(super) fn restore_guest_tf(&mut self, guest_tf: bool) -> Result<(), VmcsError> {
        self.set_guest_tf(guest_tf)?;
        self.step_irq_exits(false)
    }

    /// Sets RFLAGS.TF to `tf` and drops a pending single-step (BS) that
    /// root's own TF left.
    pub(super) fn set_guest_tf(&mut self, tf: bool) -> Result<(), VmcsError> {
        let v = &mut Vmcs;
        let rflags = f::GUEST_RFLAGS.read(v)?;
        let want = if tf {
            rflags | RFLAGS_TF
        } else {
            rflags & !RFLAGS_TF
        };
        if want != rflags {
            f::GUEST_RFLAGS.write(v, want)?;
        }
        self.clear_stale_step()
    }

    /// External-interrupt exiting on while a step is armed, off otherwise
    /// (without acknowledge on exit: the interrupt stays pending in the
    /// local APIC, and root runs with interrupts off). Without it, an
    /// interrupt pending at the step's entry would be delivered before the
    /// stepped instruction, and its handler, softirqs and whatever the
    /// scheduler picks next would run with the step's pages open.
    pub(super) fn step_irq_exits(&mut self, on: bool) -> Result<(), VmcsError> {
        if self.cpu.irq_exits == on || (on && !irq_exiting_allowed()) {
            return Ok(());
        }
        let v = &mut Vmcs;
        let pin = f::PIN_BASED_CONTROLS.read(v)?;
        let pin = if on {
            pin | PIN_EXTERNAL_INTERRUPT_EXITING
        } else {
            pin & !PIN_EXTERNAL_INTERRUPT_EXITING
        };
        f::PIN_BASED_CONTROLS.write(v, pin)?;
        self.cpu.irq_exits = on;
        Ok(())
    }

    /// An external interrupt while a step was armed. The stepped
    /// instruction has not run (its single-step #DB would have come before
    /// any interrupt), so the step ends here, unfinished: its pages close,
    /// the guest's own TF goes back, and the guest takes the interrupt at
    /// the next entry in its own state. When the handler returns to the
    /// instruction, it faults into a new step.
    pub(super) fn interrupt_in_step(&mut self) -> Result<Next, VmcsError> {
        let done = self.step_exit(StepExit::Interrupt);
        if let Some(tf) = done.tf {
            self.restore_guest_tf(tf)?;
        }
        self.step_irq_exits(false)?;
        self.keep_debug_exits(done.debug_exits)?;
        Ok(Next::Resume)
    }

    /// Hands the step's exit `exit` to the tracer (`Tracer::step_exit`).
    pub(super) fn step_exit(&mut self, exit: StepExit) -> StepDone {
        with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
            tracer!(self).step_exit(env, exit)
        })
    }

    /// Stops intercepting #DB once the tracer no longer wants it.
    pub(super) fn keep_debug_exits(&mut self, wanted: bool) -> Result<(), VmcsError> {
        if !wanted && self.cpu.debug_exits {
            f::EXCEPTION_BITMAP.write(&mut Vmcs, 0)?;
            self.cpu.debug_exits = false;
        }
        Ok(())
    }

    /// #DB: the end of the tracer's step, the guest's own, or both
    /// (`hypervisor::vmx::debug::decide`): root's single-step is swallowed,
    /// the guest's breakpoints and single-steps are delivered, INT1 goes
    /// back as INT1.
    pub(super) fn debug_exception(&mut self, info: u32) -> Result<Next, VmcsError> {
        let v = &mut Vmcs;
        let qual = f::EXIT_QUALIFICATION.read(v)?;
        let int1 = event::info_type(info) == event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION;
        let act = self.step_exit(StepExit::Debug {
            qualification: qual,
            int1,
        });
        if act.ended {
            self.step_irq_exits(false)?;
        }
        if let Some(tf) = act.tf {
            // Bochs 2.7 leaves a stale BS here after a TF step, and the next
            // entry fails on it; the guest's other pending conditions stay.
            self.set_guest_tf(tf)?;
        }
        let next = match act.reflect {
            Some(bits) => {
                // The CPU did not update DR6 for an intercepted #DB (SDM
                // 27.1): do it as delivery would, then deliver.
                let dr6 = (insn::read_dr6() & !0xf) | bits | 0xffff_0ff0;
                insn::write_dr6(dr6);
                if act.as_int1 {
                    self.cpu.inject = Some(Event {
                        vector: DB,
                        kind: event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION,
                        error_code: None,
                        instruction_len: f::EXIT_INSTRUCTION_LEN.read(v)?,
                    });
                    Next::Resume
                } else {
                    self.inject(DB, None)?
                }
            }
            None => Next::Resume,
        };
        self.keep_debug_exits(act.debug_exits)?;
        Ok(next)
    }
}
