//! The VM's state in root: what every vCPU shares, reached under one
//! reader-writer lock ([`shared`]); [`crate::cpu_state::CpuState`] is
//! what each vCPU keeps for itself.
//!
//! The lock is taken once per VM exit that needs the VM, after the exit is
//! read and before it is handled, and let go before the next entry: it is
//! held for one exit handler, never across guest execution.
//! - The tracer's hypercalls (every traced call's entry and return) take
//!   its shared side ([`Shared::read`]): hits on several vCPUs run at the
//!   same time, page walks of the guest included. What a hit changes has
//!   a lock or an atomic of its own (see `hypervisor::tracer::Hit`).
//! - Every other exit that touches the VM (requests on COM2, turns, steps,
//!   start-up IPIs, port and MSR exits root emulates) takes it whole
//!   ([`Shared::lock`]).
//!
//! A vCPU that waits for the whole lock keeps new readers out until it has
//! it, so that hits on the other vCPUs cannot starve the control channel.
//! Each vCPU counts the TSC ticks it waited on either side (`status`
//! reports them).

use crate::control::Control;
use crate::introspect::{Introspection, Kernel};
use crate::smp::ApSlot;
use crate::vcpu::VmConfig;
use alloc::vec::Vec;
use hypervisor::ept::Ept;
use hypervisor::mono::MonoTsc;
use hypervisor::tracer;
use hypervisor::vm_lock::VmLock;

/// The VM's state across exits.
pub struct Vm {
    /// The VM's configuration: fixed VMCS bits, ACPI, EPT, timer.
    pub cfg: VmConfig,
    /// The control channel (COM2), when there is a UART.
    pub control: Option<Control>,
    pub tsc_hz: u64,
    /// Root's clock: the TSC made monotonic (the guest can rewind the TSC).
    pub clock: MonoTsc,
    /// Turns left before a host-requested stop, while its acknowledgement drains.
    pub stopping: Option<u32>,
    /// The recovered guest kernel.
    pub introspection: Introspection,
    /// The tracer's shared state: region, sites, probes, graph sessions.
    pub tracer: tracer::VmState,
    /// The guest's PCI configuration address (the last dword it wrote to 0xCF8).
    pub pci_address: u32,
    /// Every vCPU's start-up state and APIC ID, by index (0: the boot
    /// processor).
    pub cpus: Vec<ApSlot>,
    /// The local APIC's MMIO base (read-only to the guest in EPT, so that
    /// root sees its interrupt command register writes).
    pub lapic_base: u64,
    /// The interrupt windows whose guest stores exit (the local APIC's
    /// page, the I/O APICs', the MSI MiB), with more than one vCPU.
    pub windows: Option<hypervisor::irq::Windows>,
}

/// The VM behind its lock (writers first: see `hypervisor::vm_lock`).
pub struct Shared(VmLock<Vm>);

// SAFETY: the VM is only ever reached through the lock. Whole, one vCPU
// at a time. Shared, several vCPUs at once, each only through
// [`Shared::read`]'s guard, of which root uses nothing but
// [`Vm::hit_view`]: a [`HitView`], which the compiler checks is `Sync`
// (below). The types inside the VM that are not `Send` (the
// reference-counted state of an introspection in progress) are outside
// that view, and are shared only among parts of the VM itself, never
// handed out past the lock, so they move between CPUs with the VM as a
// whole.
unsafe impl Sync for Shared {}
// SAFETY: as above: everything inside moves with the VM.
unsafe impl Send for Shared {}

static VM: spin::Once<Shared> = spin::Once::new();

/// Publishes the VM (the boot processor, once, before its first entry).
pub fn publish(vm: Vm) {
    VM.call_once(|| Shared(VmLock::new(vm)));
}

/// The VM, waiting until it is published.
pub fn shared() -> &'static Shared {
    VM.wait()
}

impl Shared {
    /// Takes the whole lock, adding the ticks spent waiting to `wait`.
    pub fn lock(&self, wait: &mut u64) -> spin::RwLockWriteGuard<'_, Vm> {
        self.0.write(wait, crate::arch::instructions::rdtsc)
    }

    /// The whole lock for an AP's turn: after the hits inside, but not
    /// after another vCPU's exit handler (a request, a turn rendering the
    /// stream, a kernel recovery can hold it long); `None` then.
    pub fn lock_for_turn(&self, wait: &mut u64) -> Option<spin::RwLockWriteGuard<'_, Vm>> {
        self.0
            .write_unless_written(wait, crate::arch::instructions::rdtsc)
    }

    /// Takes the shared side (after any vCPU waiting for the whole lock),
    /// adding the ticks spent waiting to `wait`.
    pub fn read(&self, wait: &mut u64) -> spin::RwLockReadGuard<'_, Vm> {
        self.0.read(wait, crate::arch::instructions::rdtsc)
    }
}

/// What a hit reaches of the VM under the lock's shared side, which
/// several vCPUs hold at once: the tracer's state (what a hit changes
/// there is behind locks of its own or atomic), the recovered kernel, the
/// EPT views (to make the tracer's environment; a hit changes no entry),
/// and the clock and TSC rate, read.
pub struct HitView<'a> {
    pub tracer: &'a tracer::VmState,
    pub kernel: Option<&'a Kernel>,
    pub views: &'a [Ept],
    pub clock: MonoTsc,
    pub tsc_hz: u64,
}

/// The view is shared between vCPUs: everything in it must be `Sync`.
const _: fn() = || {
    fn shared_between_vcpus<T: Sync>() {}
    shared_between_vcpus::<HitView<'static>>();
};

impl Vm {
    /// What a hit may reach (see [`HitView`]).
    pub fn hit_view(&self) -> HitView<'_> {
        HitView {
            tracer: &self.tracer,
            kernel: self.introspection.kernel(),
            views: &self.cfg.views,
            clock: self.clock,
            tsc_hz: self.tsc_hz,
        }
    }

    /// A VM with `cfg`, served on `control`, its TSC at `tsc_hz`; root's
    /// clock starts at `tsc_now`.
    pub fn new(
        cfg: VmConfig,
        control: Option<Control>,
        tsc_hz: u64,
        tsc_now: u64,
        cpus: Vec<ApSlot>,
        lapic_base: u64,
        windows: Option<hypervisor::irq::Windows>,
    ) -> Self {
        Vm {
            cfg,
            control,
            tsc_hz,
            clock: MonoTsc::starting_at(tsc_now),
            stopping: None,
            introspection: Introspection::default(),
            tracer: tracer::VmState::new(cpus.len()),
            pci_address: 0,
            cpus,
            lapic_base,
            windows,
        }
    }
}
