//! The turn: the control channel's and the tracer's share of root's time,
//! and the timer that brings it; a module load or unload seen at a hook.

use super::*;
use hypervisor::turns;

impl Vcpu<'_> {
    /// Root's guard counters, as the status reports them.
    pub(super) fn guard(&self) -> GuardReport {
        GuardReport {
            nmis_in_root: crate::fatal::nmis_in_root(),
            ..self.cpu.guard
        }
    }

    /// The preemption timer's value for the next turn (`turns::timer_value`).
    pub(super) fn timer_value(&self, busy: bool) -> u32 {
        turns::timer_value(self.vm.tsc_hz, busy, self.vm.cfg.timer_shift)
    }

    /// A module load or unload this vCPU saw at a hidden hook (see
    /// `hypervisor::tracer::modules`): the tracer arms or disarms what is
    /// on the module, holding the other vCPUs for its changes, before this
    /// vCPU runs the kernel function's body. A load walks the module list
    /// again first (the pending probes are looked up in the new module's
    /// symbols); an unload needs no walk (the going module's text is read
    /// from its own `struct module`).
    pub(super) fn module_event(&mut self, ev: ModuleEvent) -> Result<(), VmcsError> {
        let rip = f::GUEST_RIP.read(&Vmcs)?;
        let tsc_hz = self.vm.tsc_hz;
        let t0 = insn::rdtsc();
        if ev.hook == ModuleHook::Load {
            self.vm
                .introspection
                .refresh_modules_at_load(tsc_hz, ev.module);
        }
        let kernel = self.vm.introspection.take_kernel();
        if let Some(k) = kernel.as_ref() {
            with_world(&self.vm.cfg.views, self.cpu.index, rip, tsc_hz, |env| {
                let mut t = tracer!(self);
                t.module_event(ev, k, env);
                t.settle_views(Some(k), env);
            });
        }
        self.vm.introspection.put_kernel(kernel);
        // When the host reads the record rings, the new copy of the
        // modules' symbols starts before the module's code can record: its
        // first piece on the frame ring tells the host to hold the records
        // until the copy is whole.
        if tracer!(self).host_reads() {
            let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
            if let Some(c) = self.vm.control.as_mut() {
                c.module_loaded(kernel);
            }
        }
        log::info!(
            "module {:?} at {:#x} served in {} us of root time",
            ev.hook,
            ev.module,
            crate::clock::tsc_to_ns(insn::rdtsc().saturating_sub(t0), tsc_hz) / 1000
        );
        Ok(())
    }

    /// Gives the control channel and the tracer a turn and sets the next
    /// timer period.
    pub(super) fn service(&mut self) -> Result<Next, VmcsError> {
        let next = self.turn();
        // `turn` read the TSC first thing.
        let spent = insn::rdtsc().wrapping_sub(self.cpu.last_turn_tsc);
        if let Some(t) = crate::vcpu::root_time(self.cpu.index, RootWork::Turn) {
            t.add(spent);
        }
        // A hypercall whose exit took this turn is timed without it.
        if let Some((_, exit_tsc)) = &mut self.cpu.pending_time {
            *exit_tsc = exit_tsc.wrapping_add(spent);
        }
        next
    }

    /// The turn [`Self::service`] times.
    pub(super) fn turn(&mut self) -> Result<Next, VmcsError> {
        let mut stop = false;
        let mut busy = false;
        self.cpu.last_turn_tsc = insn::rdtsc();
        self.cpu.last_turn = self.vm.clock.update(self.cpu.last_turn_tsc);
        let now = self.now_ns();
        let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
        let done = with_env(&self.vm.cfg.views, self.cpu.index, self.cpu.view, |env| {
            Tracer::new(&mut self.vm.tracer, &mut self.cpu.tracer).turn(env, kernel, cpu_view, now)
        })?;
        if done.view_picked {
            // The sessions that filter by pid or comm changed: the view for
            // the task this vCPU runs now.
            switch_view(self.cpu)?;
        }
        // #DB exits follow the tracer: on every vCPU while a step ended by
        // force may have left TF in a context that resumes anywhere.
        if done.debug_exits != self.cpu.debug_exits {
            let bitmap = if done.debug_exits { 1 << DB } else { 0 };
            f::EXCEPTION_BITMAP.write(&mut Vmcs, bitmap)?;
            self.cpu.debug_exits = done.debug_exits;
        }
        if self.cpu.index == 0 {
            self.resend_sipis();
        }
        if self.cpu.index == 0 && self.vm.control.is_some() {
            // `now` is the turn's: the clock moved at its start only.
            let cpu = self.cpu_view()?;
            let rip = f::GUEST_RIP.read(&Vmcs)?;
            let guard = self.guard();
            let Some(c) = self.vm.control.as_mut() else {
                return Ok(Next::Resume);
            };
            let mut src = StatusSource {
                uptime_ns: now,
                memory_used: crate::frames::used(),
                memory_total: loader::layout::HV_RESERVED_SIZE,
                heap_used: crate::heap::used() as u64,
                introspection: &mut self.vm.introspection,
                cpu: cpu.clone(),
                tsc_hz: self.vm.tsc_hz,
                tracer: tracer!(self),
                views: &self.vm.cfg.views,
                vcpu: self.cpu.index,
                rip,
                guard,
                cpus: &self.vm.cpus,
            };
            stop = c.poll(&mut src) == Action::Stop;
            let kernel = self.vm.introspection.kernel().map(|k| k as &dyn KernelView);
            // A new copy of the modules' symbols goes before the records,
            // which may name the modules' code (the host renders them).
            c.export_turn(kernel);
            // When the host reads the record rings, the context goes out
            // in this turn whatever else is under way (see
            // `Stream::next_records`).
            let output = tracer!(self).stream_turn(c, kernel, &cpu, now);
            c.flush();
            busy = c.busy() || output;
        }
        self.cpu.turn_ticks = turns::period_ticks(self.vm.tsc_hz, busy);
        if self.vm.cfg.has_timer {
            let t = self.timer_value(busy);
            if t != self.cpu.timer {
                f::PREEMPTION_TIMER_VALUE.write(&mut Vmcs, t)?;
                self.cpu.timer = t;
            }
        }
        if self.cpu.index != 0 {
            return Ok(Next::Resume);
        }
        if stop && self.vm.stopping.is_none() {
            // Keep the guest running a few turns so that the acknowledgement
            // reaches the host before the machine goes away.
            self.vm.stopping = Some(STOP_DRAIN_TURNS);
        }
        if let Some(left) = self.vm.stopping {
            if !busy || left == 0 {
                return Ok(Next::Stop(StopReason::HostStop));
            }
            self.vm.stopping = Some(left - 1);
        }
        Ok(Next::Resume)
    }
}
