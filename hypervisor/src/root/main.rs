//! The hvtrace hypervisor image (x86_64-unknown-none, Multiboot v1).
//!
//! Flow: the loader's boot stub enters `hv_entry64` in long mode; we set up
//! our own descriptor tables, frame pool and the guard page under root's
//! stack (`rootstack`), take the control UART (COM2, so that a fatal report
//! reaches the host from then on), run a self-test if the hypervisor's own
//! command line asks for one (`hypervisor::selftest`), refuse clearly if the CPU lacks
//! VMX, load the guest kernel through the 64-bit boot protocol, build EPT and
//! the VMCS, and run the guest until it powers off or dies.
#![no_std]
#![no_main]
// VMX root never panics on what the guest or the host sends: indexing,
// unwrap and explicit panics need a local allow with the reason.
#![warn(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

extern crate alloc;

mod arch;
mod clock;
mod control;
mod cpu_state;
mod exits;
mod fatal;
mod frames;
mod guest;
mod heap;
mod introspect;
mod logger;
mod machine;
mod phys;
mod ports;
mod rootstack;
mod smp;
mod uart;
mod vcpu;
mod vm;
mod world;

use arch::instructions as insn;
use exits::StopReason;
use hypervisor::acpi;
use hypervisor::selftest::SelfTest;

/// Version reported in the log and, later, over the control channel.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

extern "C" {
    fn _start32();
}

/// Keeps the loader's boot stub (and with it the multiboot header) linked.
#[used]
static BOOT_ENTRY: unsafe extern "C" fn() = _start32;

/// Called by the boot stub in 64-bit mode with the Multiboot magic and info address.
#[unsafe(no_mangle)]
pub extern "C" fn hv_entry64(magic: u32, mbi: u32) -> ! {
    logger::init();
    hvprintln!("hypervisor {VERSION} starting");
    let host = arch::cpu::init();
    let (pool_start, pool_end) = frames::init();
    log::info!("frame pool {pool_start:#x}..{pool_end:#x}");
    if heap::init().is_none() {
        fatal::die(format_args!("hypervisor memory too small for the heap"));
    }
    // Firmware tables first: they tell us how to power the machine off on
    // any outcome below.
    let rsdp = guest::find_rsdp();
    let fadt = rsdp.and_then(|r| acpi::find_fadt(&phys::Phys, r));
    fatal::set_power_off_port(fadt.map(|f| f.pm1a_cnt));
    // Before anything deep runs on root's stack: from here an overflow
    // faults on the guard page and is reported (HOST_CR3, read later by
    // `vcpu::setup`, is these tables).
    match rootstack::install_guard() {
        Ok(guard) => log::info!("root stack guard page at {guard:#x}"),
        Err(e) => fatal::die(format_args!("root stack guard page: {e}")),
    }
    // How deep root's stack goes (`status`, and the log at the end).
    let stack_bottom = loader::entry::stack_top() - loader::entry::STACK_SIZE;
    rootstack::register(0, stack_bottom, loader::entry::stack_top());
    rootstack::fill_below_here(stack_bottom);
    // The control channel's UART, before anything can fail on its way to
    // the guest (a missing VMX, a bad kernel): from here a fatal report
    // reaches the host on COM2 too, not only on the log port.
    let uart = uart::Uart::init(loader::layout::CONTROL_PORT_BASE);
    fatal::set_control_port(uart.is_some().then_some(loader::layout::CONTROL_PORT_BASE));
    match SelfTest::from_cmdline(guest::own_cmdline(magic, mbi)) {
        Some(SelfTest::StackOverflow) => rootstack::overflow(),
        Some(SelfTest::ApStackOverflow) => rootstack::arm_ap_overflow(),
        Some(SelfTest::Panic) => {
            hvprintln!("self-test: panicking in VMX root");
            // The self-test asked for it: the VM test checks the report a
            // panic in root sends over COM2.
            #[allow(clippy::panic)]
            {
                panic!("self-test: a deliberate panic in VMX root");
            }
        }
        None => {}
    }
    let Err(e) = run(magic, mbi, &host, rsdp, fadt, uart);
    hvprintln!("error: {e}");
    power_off(fadt);
    insn::halt_forever()
}

/// The end of the VM, on whichever vCPU saw it: the vCPU's exit counts and
/// the reason, then the machine powers off (as the guest asked, or
/// through ACPI).
pub fn finish(cpu: &cpu_state::CpuState, reason: StopReason) -> ! {
    if cpu.index == 0 {
        // The log port's frames still queued (a turn that stopped the VM
        // returned before writing them), unless another vCPU holds the
        // VM to itself.
        let mut ticks = 0;
        if let Some(mut vm) = vm::shared().lock_for_turn(&mut ticks) {
            if let Some(c) = vm.control.as_mut() {
                c.write_queued();
            }
        }
    }
    hvprintln!("exit counts: {}", cpu.counters);
    if cpu.index != 0 || cpu.lock_wait_ticks != 0 {
        hvprintln!(
            "vCPU {}: VM lock taken {} times, {} TSC ticks waiting",
            cpu.index,
            cpu.lock_takes,
            cpu.lock_wait_ticks
        );
    }
    rootstack::log_use();
    if matches!(reason, StopReason::TripleFault) {
        // The guest's state at its end, for whoever reads why (the VMCS is
        // this vCPU's, still current here).
        hvprintln!(
            "vCPU {}: triple fault; the event root saw in delivery: {:?}",
            cpu.index,
            cpu.vectoring
        );
        exits::dump_vmcs();
    }
    hvprintln!("guest stopped: {reason}");
    if let StopReason::PowerOff { port, value, size } = reason {
        // Let the platform power off as the guest asked.
        ports::forward_out(port, size, value);
        insn::halt_forever()
    }
    fatal::power_off_and_halt()
}

/// Powers the machine off through ACPI (S5 with SLP_TYP 0, as QEMU's and
/// Bochs' firmware define it), or just halts when there is no FADT.
fn power_off(fadt: Option<acpi::Fadt>) {
    if let Some(f) = fadt {
        ports::forward_out(f.pm1a_cnt, 2, hypervisor::policy::PM1_SLP_EN);
    }
}

/// A fatal error before the guest runs.
enum Fatal {
    Vmx(vcpu::VmxError),
    Load(guest::LoadError),
    /// The machine has processors that root does not take into VMX: the
    /// guest could start them outside VMX, with the run of the machine.
    UntakenCpus(usize),
    /// An AP could not be taken into VMX.
    Smp(smp::SmpError),
    /// No readable MADT: the processors cannot be known.
    NoMadt,
    /// The local APIC is not where the MADT says, or above 4 GiB.
    ApicBase(u64, u64),
}

impl core::fmt::Display for Fatal {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Vmx(e) => write!(f, "{e}"),
            Self::Load(e) => write!(f, "{e}"),
            Self::Smp(e) => write!(f, "{e}"),
            Self::NoMadt => write!(
                f,
                "no readable ACPI MADT: the hypervisor cannot know the machine's processors, so it cannot keep them from the guest"
            ),
            Self::ApicBase(real, madt) => write!(
                f,
                "the local APIC is at {real:#x} but the MADT says {madt:#x} (or it lies above 4 GiB): the guest's start-up IPIs cannot be watched"
            ),
            Self::UntakenCpus(n) => write!(
                f,
                "the machine has {n} processors and this hypervisor takes only one into VMX; \
                 the guest could start the others outside it: start the machine with one CPU"
            ),
        }
    }
}

impl From<vcpu::VmxError> for Fatal {
    fn from(e: vcpu::VmxError) -> Self {
        Self::Vmx(e)
    }
}
impl From<guest::LoadError> for Fatal {
    fn from(e: guest::LoadError) -> Self {
        Self::Load(e)
    }
}

/// Loads the guest, then runs it under VMX until it stops. The guest is
/// loaded (and its kernel image checked) before VMX is looked at, so a bad
/// kernel is reported the same way on every platform.
fn run(
    magic: u32,
    mbi: u32,
    host: &arch::cpu::HostTables,
    rsdp: Option<u64>,
    fadt: Option<acpi::Fadt>,
    uart: Option<uart::Uart>,
) -> Result<core::convert::Infallible, Fatal> {
    let boot = guest::boot_info(magic, mbi)?;
    let entry = guest::load(&boot, rsdp)?;
    // From here on, guest memory is reached only through the guarded door.
    phys::set_guest_ram(boot.e820.clone());
    log::info!(
        "guest kernel loaded at {:#x}, entry {:#x}, RAM {} MiB, RSDP {:?}",
        entry.load,
        entry.rip,
        boot.e820.total_ram() >> 20,
        rsdp
    );
    if let Some(f) = fadt {
        log::info!("ACPI PM1a control at port {:#x}", f.pm1a_cnt);
    }
    vcpu::check_support()?;
    // Every processor must be root's before the guest runs: one left in
    // the firmware's hands would run whatever the guest's start-up IPI
    // points it at, outside VMX. Without a readable MADT root cannot know
    // them, and the guest could still reach them (a broadcast INIT-SIPI
    // needs no list), so the VM does not start.
    let c = rsdp
        .and_then(|r| acpi::find_cpus(&phys::Phys, r))
        .ok_or(Fatal::NoMadt)?;
    log::info!(
        "MADT: {} processor(s), local APIC at {:#x}",
        c.apic_ids().len() + c.ignored,
        c.lapic_base
    );
    if c.ignored > 0 {
        return Err(Fatal::UntakenCpus(c.apic_ids().len() + c.ignored));
    }
    let cpus = Some(c);
    let tsc_hz = clock::calibrate_tsc();
    let bsp_apic_id = insn::cpuid(1, 0)[1] >> 24;
    // The APs' guard pages change root's page tables: they go in before
    // any VMCS records HOST_CR3.
    let aps = match &cpus {
        Some(c) => smp::prepare(c, bsp_apic_id).map_err(Fatal::Smp)?,
        None => alloc::vec::Vec::new(),
    };
    let cfg = vcpu::setup(host, &boot, &entry, fadt, aps.len() + 1)?;
    // The APIC page root watches is the one this CPU really decodes; the
    // MADT must agree, and root's page tables must map it (below 4 GiB).
    // SAFETY: IA32_APIC_BASE exists on every CPU with a local APIC.
    let lapic_base = unsafe { insn::rdmsr(x86::msr::IA32_APIC_BASE) } & 0x000f_ffff_ffff_f000;
    if !aps.is_empty() {
        let madt = cpus.map_or(0, |c| c.lapic_base);
        if lapic_base != madt || lapic_base >= loader::layout::FOUR_GIB {
            return Err(Fatal::ApicBase(lapic_base, madt));
        }
    }
    let slots = match aps.is_empty() {
        false => smp::start_aps(lapic_base, &aps, bsp_apic_id, tsc_hz).map_err(Fatal::Smp)?,
        true => alloc::vec![smp::ApSlot::new(
            bsp_apic_id,
            hypervisor::vmx::ap::ApLife::Running { vector: 0 },
        )],
    };
    let (lapic_base, windows) = if slots.len() > 1 {
        // The guest's start-up IPIs are root's to carry out: its stores to
        // the APIC page exit (`exits::local_exit`, `Vcpu::icr_write`), and
        // so do those to the other routes to an INIT (the I/O APICs, the
        // MSI MiB; `hypervisor::irq`).
        let ioapics = cpus.map(|c| c.ioapics().to_vec()).unwrap_or_default();
        let ioapics = if ioapics.is_empty() {
            alloc::vec![hypervisor::irq::IOAPIC_RANGE.start]
        } else {
            ioapics
        };
        let windows = hypervisor::irq::Windows::new(lapic_base, &ioapics);
        if windows.ioapics().len() != ioapics.len() {
            log::info!(
                "I/O APICs {ioapics:x?}: only {:x?} are watched",
                windows.ioapics()
            );
        }
        vcpu::protect_windows(&cfg.views, &windows)?;
        (lapic_base, Some(windows))
    } else {
        // One vCPU: the APIC page is the guest's alone, and not watched
        // (an INIT can only reset the boot processor, which stops the VM).
        (0, None)
    };
    log::info!(
        "VMX ready, hypervisor memory in use {} KiB (heap {} of {} KiB)",
        frames::used() >> 10,
        heap::used() >> 10,
        heap::HEAP_SIZE >> 10
    );

    let control = uart.map(control::Control::new);
    log::info!(
        "TSC {} MHz; control channel {}",
        tsc_hz / 1_000_000,
        if control.is_some() {
            "on COM2"
        } else {
            "absent (no UART at COM2)"
        }
    );
    let vcpus = slots.len();
    world::set_vcpus(vcpus);
    vm::publish(vm::Vm::new(
        cfg,
        control,
        tsc_hz,
        insn::rdtsc(),
        slots,
        lapic_base,
        windows,
    ));
    let mut cpu = cpu_state::CpuState::new(0);
    cpu.regs.rsi = entry.boot_params;
    cpu.lapic_base = lapic_base;
    if vcpus > 1 {
        log::info!("{vcpus} vCPUs: the boot processor runs, the APs wait for the guest's SIPIs");
    }
    hvprintln!("guest started");
    let reason = exits::run(&mut cpu);
    finish(&cpu, reason)
}

/// An application processor runs vCPU `index` from `regs` (its state as
/// set up, parked until the guest's SIPI) until the VM stops.
pub fn run_ap(index: usize, regs: hypervisor::vmx::regs::GuestRegs) -> ! {
    let mut cpu = cpu_state::CpuState::new(index);
    cpu.regs = regs;
    let reason = exits::run(&mut cpu);
    finish(&cpu, reason)
}

/// A panic ends the VM cleanly: one `error:` line on the log port and an
/// `Event::Fatal` frame on COM2 for the host, then a power-off (never a
/// silent halt); see `fatal`. An infallible allocation the heap refused
/// ends here too (the default allocation error handler panics with
/// "memory allocation of N bytes failed"), so the line carries the heap's
/// state.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    match heap::report() {
        Some((used, free)) => fatal::die(format_args!(
            "hypervisor panic: {info} (heap: {} KiB used, {} KiB free of {} KiB)",
            used >> 10,
            free >> 10,
            heap::HEAP_SIZE >> 10
        )),
        None => fatal::die(format_args!("hypervisor panic: {info}")),
    }
}
