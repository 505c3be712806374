//! The tracer's VMCALL: the fast path's VMCS reads, the general path, and
//! the switch of EPT view a hit may ask for.

use super::*;

/// The vCPU state the tracer and introspection need, from the current
/// VMCS.
pub(super) fn cpu_view() -> Result<CpuView, VmcsError> {
    CpuView::read(&Vmcs, read_kernel_gs_base, read_gs_base)
}

/// IA32_KERNEL_GS_BASE, the guest's while root runs (VMX does not switch
/// it), for a view taken in user mode.
pub(super) fn read_kernel_gs_base() -> u64 {
    // SAFETY: IA32_KERNEL_GS_BASE exists on every x86-64 CPU.
    unsafe { insn::rdmsr(x86::msr::IA32_KERNEL_GSBASE) }
}

/// GUEST_GS_BASE for a view's lazy read: 0 (no task found there) when the
/// VMREAD fails, which is logged.
pub(super) fn read_gs_base() -> u64 {
    f::GUEST_GS_BASE.read(&Vmcs).unwrap_or_else(|e| {
        log::warn!("{e}: the running task is not known");
        0
    })
}

/// A VMCALL exit, under one take of the lock's shared side (the other
/// vCPUs' hits run too): the entry fast path ([`Hit::fast_entry`]: three
/// VMREADs after the exit reason, RIP among them unless the exit already
/// read it (`rip`), and one VMWRITE) when it serves, otherwise the general
/// hypercall ([`hypercall`]) at the same RIP.
#[inline]
pub(super) fn vmcall_exit(
    shared: &crate::vm::Shared,
    cpu: &mut CpuState,
    exit_tsc: u64,
    rip: Option<u64>,
) -> Result<Next, VmcsError> {
    let vm = shared.read(&mut cpu.shared_wait_ticks);
    cpu.shared_takes += 1;
    let hv = vm.hit_view();
    let rip = match rip {
        Some(r) => r,
        None => f::GUEST_RIP.read(&Vmcs)?,
    };
    let exit = match hv.tracer.entry_vmcall() {
        Some(vmcall) => entry::fast_entry_at(&Vmcs, rip, vmcall)?,
        None => None,
    };
    let chain = match (exit, hv.kernel) {
        (Some(exit), Some(k)) => {
            let (clock, tsc_hz) = (hv.clock, hv.tsc_hz);
            Hit::new(hv.tracer, &mut cpu.tracer).fast_entry(
                phys::guest_ram(),
                k,
                exit,
                &cpu.regs,
                read_gs_base,
                || crate::clock::tsc_to_ns(clock.peek(insn::rdtsc()), tsc_hz),
            )
        }
        _ => None,
    };
    let next = match (exit, chain) {
        (Some(exit), Some(chain)) => {
            drop(vm);
            cpu.regs.rax = chain;
            entry::fast_entry_end(&mut Vmcs, &exit)?;
            Next::Resume
        }
        _ => {
            // The fast path's reads (CPL, RSP) serve the general one.
            let view = match exit {
                Some(x) => {
                    CpuView::read_rest(&Vmcs, x.cpl, x.rsp, read_kernel_gs_base, read_gs_base)?
                }
                None => cpu_view()?,
            };
            let next = hypercall(hv, cpu, rip, view);
            drop(vm);
            next?
        }
    };
    cpu.pending_time = cpu.tracer.take_served().map(|work| (work, exit_tsc));
    Ok(next)
}

/// The tracer's hypercall (a VMCALL from its trampolines, or anyone's: #UD
/// then) with the VM shared: nothing here changes the VM but through what
/// `hypervisor::tracer::Hit` locks or counts atomically.
pub(super) fn hypercall(
    vm: HitView<'_>,
    cpu: &mut CpuState,
    rip: u64,
    mut view: CpuView,
) -> Result<Next, VmcsError> {
    // The kernel's GS base as this turn's hits read it (CPL 0 only: in
    // user mode the kernel's is IA32_KERNEL_GS_BASE).
    if view.cpl == 0 {
        if let Some(base) = cpu.tracer.kernel_gs() {
            view.gs_base = GuestGs::known(base);
        }
    }
    let now = crate::clock::tsc_to_ns(vm.clock.peek(insn::rdtsc()), vm.tsc_hz);
    let kernel = vm.kernel.map(|k| k as &dyn KernelView);
    let mut hit = Hit::new(vm.tracer, &mut cpu.tracer);
    let regs = &mut cpu.regs;
    let served = with_env_clocked(vm.views, cpu.index, cpu.view, vm.clock, vm.tsc_hz, |env| {
        hit.hypercall(env, rip, regs, &view, kernel, now)
    });
    if let (0, Some(base)) = (view.cpl, view.gs_base.peek()) {
        cpu.tracer.keep_kernel_gs(base);
    }
    switch_view(cpu)?;
    if let Some(ud) = entry::hypercall_end(&mut Vmcs, rip, matches!(served, Hypercall::Handled))? {
        cpu.inject = Some(ud);
    }
    Ok(Next::Resume)
}

/// Moves the vCPU to the EPT view its tracer state names, if it is not
/// there (`hypervisor::tracer::quiet`). No INVEPT: each view's
/// translations are tagged by its own EPT pointer, and a change to a view
/// invalidates it (`crate::world`, `Machine::invept`).
pub(super) fn switch_view(cpu: &mut CpuState) -> Result<(), VmcsError> {
    let want = cpu.tracer.view();
    if want != cpu.view {
        let eptp = cpu.eptp_of(want);
        f::EPT_POINTER.write(&mut Vmcs, eptp)?;
        cpu.view = want;
    }
    Ok(())
}

impl Vcpu<'_> {
    /// A VMCALL: the tracer's entry hypercall, or #UD. (The exit loop
    /// serves them under the lock's shared side; see [`hypercall`].)
    pub(super) fn vmcall(&mut self) -> Result<Next, VmcsError> {
        let rip = f::GUEST_RIP.read(&Vmcs)?;
        hypercall(self.vm.hit_view(), self.cpu, rip, cpu_view()?)
    }
}
