//! The application processors: taking each into VMX before the guest
//! runs, and carrying out the guest's INIT and SIPI to them.
//!
//! Bring-up (boot processor, before the guest's first instruction): for
//! every processor the MADT lists, root gives the AP a stack (with a guard
//! page under it), tables and interrupt stacks of its own, sends it
//! INIT-SIPI-SIPI at the trampoline (`arch::ap_start`), and waits until
//! the AP has entered VMX non-root parked in wait-for-SIPI
//! ([`hypervisor::vmx::ap`]). An AP that does not answer is reported and
//! the VM does not start: a processor left outside VMX would run whatever
//! the guest pointed it at.
//!
//! Start-up IPIs from the guest: root takes the guest's writes to the
//! local APIC's interrupt command register (the APIC page is read-only in
//! EPT; see `exits`), and an INIT or SIPI to an AP only changes that AP's
//! [`ApSlot`]. The AP acts on its slot under the VM lock at its next exit
//! (an INIT to a running AP waits for its next preemption-timer turn); a
//! SIPI to a parked AP is also sent to it as a physical SIPI, which wakes
//! it from wait-for-SIPI with a SIPI exit. A physical SIPI that lands
//! while the AP is in root is lost, so every turn of the boot processor
//! sends again the SIPIs still waiting.

use crate::arch::ap_start;
use crate::arch::cpu;
use crate::arch::instructions as insn;
use crate::{frames, phys};
use core::sync::atomic::{AtomicU8, Ordering};
use hypervisor::acpi::{Cpus, MAX_CPUS};
use hypervisor::host_paging;
use hypervisor::vmx::ap::ApLife;
use loader::layout;

/// Each AP's root stack (the boot processor keeps the boot stub's). The
/// deepest direct-call chain an AP runs (the exit loop, view settling and
/// the switch hook's region build) takes about 37 KiB in the release
/// image; the rest is room for calls through trait objects, which a
/// static count misses, and for growth. `status` reports each vCPU's
/// deepest use (`rootstack::used`), and the smp VM test holds it to half.
const AP_STACK_SIZE: u64 = 128 * 1024;
/// ICR words (SDM 11.6.1): INIT, level-triggered, assert; STARTUP.
const ICR_INIT_ASSERT: u32 = 0x0000_c500;
const ICR_STARTUP: u32 = 0x0000_0600;

/// Where an AP is in its start, as it reports it to the boot processor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Stage {
    NotStarted = 0,
    /// Running root code on its own stack.
    Alive = 1,
    /// In VMX non-root, parked.
    Parked = 2,
    /// Its VMX set-up failed.
    Failed = 3,
}

static STAGE: [AtomicU8; MAX_CPUS] = [const { AtomicU8::new(0) }; MAX_CPUS];

fn stage(index: usize) -> Stage {
    match STAGE.get(index).map(|s| s.load(Ordering::Acquire)) {
        Some(1) => Stage::Alive,
        Some(2) => Stage::Parked,
        Some(3) => Stage::Failed,
        _ => Stage::NotStarted,
    }
}

fn set_stage(index: usize, s: Stage) {
    if let Some(slot) = STAGE.get(index) {
        slot.store(s as u8, Ordering::Release);
    }
}

/// An AP's resources, handed to it at start.
#[derive(Clone, Copy)]
struct ApBoot {
    stack_top: u64,
    tables: u64,
}

static AP_BOOT: spin::Mutex<[Option<ApBoot>; MAX_CPUS]> = spin::Mutex::new([None; MAX_CPUS]);

/// One vCPU as the others see it: its APIC ID, root's account of its
/// start-up state, and its counters for `status`. Index 0 is the boot
/// processor.
#[derive(Clone, Debug)]
pub struct ApSlot {
    pub apic_id: u32,
    /// Parked or running (the boot processor is always running).
    pub life: ApLife,
    /// An INIT waits for the AP's next exit.
    pub init: bool,
    /// A SIPI's vector waits for the AP to be parked.
    pub sipi: Option<u8>,
    /// Its INIT exits (none come from a guest that sends INIT through
    /// the ICR): past a few in a second, the AP stays parked.
    pub init_limiter: hypervisor::irq::InitLimiter,
    /// Its exits, by reason (recorded under the VM lock).
    pub counters: hypervisor::stats::ExitCounters,
    /// TSC ticks it waited for the VM lock, and how often it took it.
    pub lock_wait_ticks: u64,
    pub lock_takes: u64,
    /// The same for the lock's shared side (the tracer's hypercalls).
    pub shared_wait_ticks: u64,
    pub shared_takes: u64,
    /// TSC ticks held in root while another vCPU had the world stopped.
    pub held_ticks: u64,
}

impl ApSlot {
    /// A vCPU with `apic_id` in `life`, nothing counted yet.
    pub fn new(apic_id: u32, life: ApLife) -> Self {
        ApSlot {
            apic_id,
            life,
            init: false,
            sipi: None,
            init_limiter: hypervisor::irq::InitLimiter::default(),
            counters: hypervisor::stats::ExitCounters::new(),
            lock_wait_ticks: 0,
            lock_takes: 0,
            shared_wait_ticks: 0,
            shared_takes: 0,
            held_ticks: 0,
        }
    }
}

/// Why the APs could not all be taken.
#[derive(Debug)]
pub enum SmpError {
    /// Pool memory for stacks or tables ran out.
    OutOfMemory,
    /// Root's page tables could not be extended (guard pages).
    Paging(host_paging::GuardError),
    /// The AP at this APIC ID did not answer, or failed to enter VMX.
    NoAnswer(u32),
    /// VMX set-up failed on the AP.
    ApFailed(u32),
    /// Root's page tables lie above 4 GiB.
    HighTables,
}

impl core::fmt::Display for SmpError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::OutOfMemory => write!(f, "out of hypervisor memory for the APs"),
            Self::Paging(e) => write!(f, "AP stack guard pages: {e}"),
            Self::NoAnswer(id) => write!(
                f,
                "the processor with APIC ID {id} did not start; it is not in VMX, so the guest cannot run"
            ),
            Self::ApFailed(id) => write!(f, "VMX set-up failed on the processor with APIC ID {id}"),
            Self::HighTables => write!(f, "root's page tables lie above 4 GiB"),
        }
    }
}

/// Gives every AP that `cpus` lists (all but the boot processor, whose
/// APIC ID is `bsp_apic_id`) a stack with a guard page under it, and its
/// tables; loads root's page tables without the guard pages. Runs before
/// any VMCS records HOST_CR3. Returns the APs' APIC IDs.
pub fn prepare(cpus: &Cpus, bsp_apic_id: u32) -> Result<alloc::vec::Vec<u32>, SmpError> {
    let aps: alloc::vec::Vec<u32> = cpus
        .apic_ids()
        .iter()
        .copied()
        .filter(|&id| id != bsp_apic_id)
        .collect();
    if aps.is_empty() {
        return Ok(aps);
    }
    // Stacks with a guard page each, taken out of root's page tables
    // before any AP loads them.
    let mut cr3 = insn::read_cr3();
    {
        let mut boot = AP_BOOT.lock();
        for (i, _) in aps.iter().enumerate() {
            let index = i + 1;
            let region = frames::alloc_region(4096 + AP_STACK_SIZE).ok_or(SmpError::OutOfMemory)?;
            let tables = frames::alloc_region(cpu::AP_TABLES_SIZE).ok_or(SmpError::OutOfMemory)?;
            let read = |pa: u64| {
                let mut entry = [0u8; 8];
                phys::read(pa, &mut entry).then(|| u64::from_le_bytes(entry))
            };
            cr3 = host_paging::unmap_guard_page(&mut frames::PoolTables, read, cr3, region.0)
                .map_err(SmpError::Paging)?;
            let (bottom, top) = (region.0 + 4096, region.0 + 4096 + AP_STACK_SIZE);
            crate::rootstack::register(index, bottom, top);
            // SAFETY: the stack is this AP's, fresh from the pool, and
            // the AP has not started.
            unsafe { crate::rootstack::fill(bottom, top) };
            if let Some(slot) = boot.get_mut(index) {
                *slot = Some(ApBoot {
                    stack_top: region.0 + 4096 + AP_STACK_SIZE,
                    tables: tables.0,
                });
            }
        }
    }
    // SAFETY: the new hierarchy maps every address as the current one does
    // except the APs' guard pages, which nothing uses; its tables are pool
    // frames, never freed.
    unsafe { insn::write_cr3(cr3) };
    Ok(aps)
}

/// Takes the APs [`prepare`] readied into VMX, parked in wait-for-SIPI,
/// one at a time. Must run after the VMX template exists
/// ([`crate::vcpu::TEMPLATE`]). Returns the slots of all vCPUs, the boot
/// processor first.
pub fn start_aps(
    lapic: u64,
    aps: &[u32],
    bsp_apic_id: u32,
    tsc_hz: u64,
) -> Result<alloc::vec::Vec<ApSlot>, SmpError> {
    let mut slots = alloc::vec::Vec::new();
    slots.push(ApSlot::new(bsp_apic_id, ApLife::Running { vector: 0 }));
    let cr3 = insn::read_cr3();
    let page = layout::AP_TRAMPOLINE;
    phys::write(page.as_u64(), ap_start::trampoline());
    let vector = (page.as_u64() >> 12) as u32;
    for (i, &id) in aps.iter().enumerate() {
        let index = i + 1;
        let Some(b) = AP_BOOT.lock().get(index).copied().flatten() else {
            return Err(SmpError::OutOfMemory);
        };
        ap_start::prepare(cr3, b.stack_top, index).map_err(|()| SmpError::HighTables)?;
        set_stage(index, Stage::NotStarted);
        ap_start::send_ipi(lapic, id, ICR_INIT_ASSERT);
        delay(tsc_hz, 10_000);
        for _ in 0..2 {
            ap_start::send_ipi(lapic, id, ICR_STARTUP | vector);
            if wait_for(tsc_hz, 200_000, || stage(index) != Stage::NotStarted) {
                break;
            }
        }
        if !wait_for(tsc_hz, 2_000_000, || {
            matches!(stage(index), Stage::Parked | Stage::Failed)
        }) {
            return Err(SmpError::NoAnswer(id));
        }
        if stage(index) == Stage::Failed {
            return Err(SmpError::ApFailed(id));
        }
        log::info!("AP {index} (APIC ID {id}) parked in wait-for-SIPI");
        slots.push(ApSlot::new(id, ApLife::Parked));
    }
    // The trampoline page stays root's (outside the guest's e820, absent
    // from EPT); clear it all the same.
    phys::zero(page.as_u64(), 4096);
    Ok(slots)
}

/// Spins for `us` microseconds of TSC time.
fn delay(tsc_hz: u64, us: u64) {
    let end = insn::rdtsc().saturating_add(tsc_hz / 1_000_000 * us);
    while insn::rdtsc() < end {
        core::hint::spin_loop();
    }
}

/// Spins until `done` or `us` microseconds pass; whether `done` held.
fn wait_for(tsc_hz: u64, us: u64, done: impl Fn() -> bool) -> bool {
    let end = insn::rdtsc().saturating_add(tsc_hz / 1_000_000 * us);
    loop {
        if done() {
            return true;
        }
        if insn::rdtsc() >= end {
            return false;
        }
        core::hint::spin_loop();
    }
}

/// Sends a physical SIPI to a parked AP, to wake it into its SIPI exit.
pub fn wake(lapic: u64, apic_id: u32, vector: u8) {
    ap_start::send_ipi(lapic, apic_id, ICR_STARTUP | u32::from(vector));
}

/// Where an AP starts in 64-bit root code (from the trampoline), on its
/// own stack, with its index.
#[unsafe(no_mangle)]
extern "C" fn hv_ap_entry64(index: u64) -> ! {
    let index = index as usize;
    set_stage(index, Stage::Alive);
    let Some(b) = AP_BOOT.lock().get(index).copied().flatten() else {
        set_stage(index, Stage::Failed);
        insn::halt_forever()
    };
    // SAFETY: the boot processor gave this AP the tables area for good.
    let host = unsafe { cpu::init_ap(b.tables, index) };
    crate::rootstack::ap_overflow_hook(index);
    let Some(t) = crate::vcpu::TEMPLATE.get() else {
        set_stage(index, Stage::Failed);
        insn::halt_forever()
    };
    let regs = match crate::vcpu::setup_ap(&host, t, index) {
        Ok(regs) => regs,
        Err(e) => {
            crate::hvprintln!("error: AP {index}: {e}");
            set_stage(index, Stage::Failed);
            insn::halt_forever()
        }
    };
    set_stage(index, Stage::Parked);
    crate::run_ap(index, regs)
}
