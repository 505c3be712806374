//! The VM's state in root: what every vCPU shares, reached under one lock
//! ([`shared`]); [`crate::cpu_state::CpuState`] is what each vCPU keeps
//! for itself.
//!
//! The lock is taken once per VM exit, after the exit is read and before
//! it is handled, and let go before the next entry: it is held for one
//! exit handler, never across guest execution. Each vCPU counts the TSC
//! ticks it waited for it (`status` reports them).

use crate::control::Control;
use crate::introspect::Introspection;
use crate::smp::ApSlot;
use crate::vcpu::VmConfig;
use alloc::vec::Vec;
use hypervisor::mono::MonoTsc;
use hypervisor::tracer;

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
}

/// The VM behind its lock.
pub struct Shared(spin::Mutex<Vm>);

// SAFETY: the VM is only ever reached through the mutex, by one vCPU at a
// time. The types inside it that are not `Send` (the reference-counted
// state of an introspection in progress) are shared only among parts of
// the VM itself, never handed out past the lock, so they move between
// CPUs with the VM as a whole.
unsafe impl Sync for Shared {}
// SAFETY: as above: everything inside moves with the VM.
unsafe impl Send for Shared {}

static VM: spin::Once<Shared> = spin::Once::new();

/// Publishes the VM (the boot processor, once, before its first entry).
pub fn publish(vm: Vm) {
    VM.call_once(|| Shared(spin::Mutex::new(vm)));
}

/// The VM, waiting until it is published.
pub fn shared() -> &'static Shared {
    VM.wait()
}

impl Shared {
    /// The lock, if nobody holds it.
    pub fn try_lock(&self) -> Option<spin::MutexGuard<'_, Vm>> {
        self.0.try_lock()
    }

    /// Takes the lock, adding the ticks spent waiting to `wait`.
    pub fn lock(&self, wait: &mut u64) -> spin::MutexGuard<'_, Vm> {
        if let Some(g) = self.0.try_lock() {
            return g;
        }
        let t0 = crate::arch::instructions::rdtsc();
        let g = self.0.lock();
        *wait = wait.saturating_add(crate::arch::instructions::rdtsc().saturating_sub(t0));
        g
    }
}

impl Vm {
    /// A VM with `cfg`, served on `control`, its TSC at `tsc_hz`; root's
    /// clock starts at `tsc_now`.
    pub fn new(
        cfg: VmConfig,
        control: Option<Control>,
        tsc_hz: u64,
        tsc_now: u64,
        cpus: Vec<ApSlot>,
        lapic_base: u64,
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
        }
    }
}
