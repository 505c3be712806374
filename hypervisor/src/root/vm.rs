//! The VM's state in root: what every vCPU shares. Today one vCPU runs;
//! with more, this is what they reach under a lock, and
//! [`crate::cpu_state::CpuState`] is what each keeps for itself.

use crate::control::Control;
use crate::introspect::Introspection;
use crate::vcpu::VmConfig;
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
}

impl Vm {
    /// A VM with `cfg`, served on `control`, its TSC at `tsc_hz`; root's
    /// clock starts at `tsc_now`.
    pub fn new(cfg: VmConfig, control: Option<Control>, tsc_hz: u64, tsc_now: u64) -> Self {
        Vm {
            cfg,
            control,
            tsc_hz,
            clock: MonoTsc::starting_at(tsc_now),
            stopping: None,
            introspection: Introspection::default(),
            tracer: tracer::VmState::default(),
            pci_address: 0,
        }
    }
}
