//! The host-testable logic of the hvtrace hypervisor.
//!
//! The bare-metal binary (`src/root/`, built only with the `bare-metal`
//! feature for `x86_64-unknown-none`) holds root's VMCS and `asm!` glue,
//! its run loop and its machinery (frames, heap, stacks, SMP bring-up, the
//! consoles); its decisions are here: the typed VMCS fields, the exit
//! decoder and where each exit goes (`vmx::route`), the exits the policy
//! answers (`vmx::handle`), control-register and port exits (`vmx::cr`,
//! `vmx::port`), the EPT builder, the CPUID, MSR, CR and I/O policy, PCI
//! filtering, the APIC store decoder, the task-switch emulation, ACPI
//! table lookups, the exit counters and the tracer (the kprobe_events
//! language it runs is the `tracelang` crate, which the host CLI shares).
//! None of them executes a privileged instruction; they reach
//! hardware only through the small traits they define (among them
//! `VmcsIo`, `HostCpu`, `CrRegs`, `RawMemory`, `TableStore`, `GuestDoor`,
//! `tracer::machine::Machine` and `tracer::machine::KernelView`), which
//! the tests implement in memory.
#![cfg_attr(not(test), no_std)]
#![cfg_attr(
    not(test),
    warn(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic
    )
)]

extern crate alloc;

pub mod acpi;
pub mod addr;
pub mod apic;
pub mod cpuid;
pub mod ept;
pub mod guest_phys;
pub mod host_paging;
pub mod irq;
pub mod mono;
pub mod outq;
pub mod pci;
pub mod policy;
pub mod selftest;
pub mod stack_use;
pub mod stats;
pub mod task_switch;
pub mod tracer;
pub mod turns;
pub mod vm_lock;
pub mod vmx;
