//! VMX bring-up and the VMCS of the one vCPU (SDM chapter 24 "Virtual machine
//! control structures", 25 "VMX non-root operation", 26 "VM entries").

use crate::arch::cpu::{self, HostTables};
use crate::arch::instructions::{self as insn, VmFail};
use crate::frames;
use crate::guest::{BootInfo, GuestEntry};
use crate::phys;
use core::fmt;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use hypervisor::acpi::Fadt;
use hypervisor::addr::Gpa;
use hypervisor::ept::{self, Ept, EptError, MemType};
use hypervisor::pci;
use hypervisor::policy;
use hypervisor::stats::{add_own, RootWork, TimeStat, ROOT_WORK_KINDS};
use hypervisor::tracer::machine::View;
use hypervisor::vmx::ap;
use hypervisor::vmx::caps::{self, EptVpidCap, MissingControls, VmxBasic};
use hypervisor::vmx::fields::{self as f, VmcsError, VmcsIo};
use hypervisor::vmx::profile::{choose, CapProfile, Chosen, Refusal, WAIT_FOR_SIPI_MISSING};
use hypervisor::vmx::regs::GuestRegs;
use loader::layout;
use x86::vmx::vmcs::control::{EntryControls, ExitControls, SecondaryControls};

// Architectural MSRs (SDM Vol. 4), as the x86 crate numbers them.
use x86::msr::{
    IA32_EFER, IA32_FEATURE_CONTROL, IA32_PAT, IA32_VMX_BASIC, IA32_VMX_CR0_FIXED0,
    IA32_VMX_CR0_FIXED1, IA32_VMX_CR4_FIXED0, IA32_VMX_CR4_FIXED1, IA32_VMX_MISC,
};

const CR4_OSXSAVE: u64 = 1 << 18;
/// Guest stack for the 64-bit entry: the kernel's startup code does a far
/// return before it sets up its own stack, so RSP must point at RAM. This is
/// the otherwise unused page between the zero page and the boot page tables.
const GUEST_BOOT_STACK: u64 = 0x8ff0;

/// Why VMX could not be set up.
#[derive(Debug)]
pub enum VmxError {
    /// CPUID.1:ECX.VMX is clear.
    NotSupported,
    /// IA32_FEATURE_CONTROL is locked with VMX off.
    DisabledByFirmware,
    /// A control we need is missing.
    Controls(MissingControls),
    /// A VMX instruction failed.
    Instruction(&'static str, VmFail, u32),
    /// A VMCS field access failed.
    Field(VmcsError),
    /// EPT construction failed.
    Ept(EptError),
    /// The frame pool is exhausted.
    OutOfMemory,
    /// EPT lacks something we rely on.
    EptCaps(&'static str),
}

impl fmt::Display for VmxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotSupported => write!(
                f,
                "VMX is not supported by this CPU; hvtrace needs Intel VT-x: run it under QEMU with nested KVM \
                 (kvm_intel nested=1, qemu-system-x86_64 -enable-kvm -cpu host,+vmx) or in Bochs with a VMX cpu model"
            ),
            Self::DisabledByFirmware => write!(f, "VMX is disabled by the firmware (IA32_FEATURE_CONTROL locked with VMX off)"),
            Self::Controls(m) => write!(f, "{m}"),
            Self::Instruction(i, e, code) => write!(f, "{i} failed ({e:?}, VM-instruction error {code})"),
            Self::Field(e) => write!(f, "{e}"),
            Self::Ept(e) => write!(f, "{e}"),
            Self::OutOfMemory => write!(f, "out of hypervisor memory"),
            Self::EptCaps(m) => write!(f, "EPT lacks {m}"),
        }
    }
}

impl From<VmcsError> for VmxError {
    fn from(e: VmcsError) -> Self {
        Self::Field(e)
    }
}
impl From<MissingControls> for VmxError {
    fn from(e: MissingControls) -> Self {
        Self::Controls(e)
    }
}
impl From<EptError> for VmxError {
    fn from(e: EptError) -> Self {
        Self::Ept(e)
    }
}

/// The current VMCS, reached through VMREAD/VMWRITE.
pub struct Vmcs;

impl VmcsIo for Vmcs {
    fn read_raw(&self, encoding: u32) -> Option<u64> {
        insn::vmread(encoding).ok()
    }
    fn write_raw(&mut self, encoding: u32, value: u64) -> bool {
        // SAFETY: this VMCS belongs to the one vCPU, and every write goes
        // through the typed fields of the setup and exit-handling code, which
        // keep host state and controls consistent.
        unsafe { insn::vmwrite(encoding, value).is_ok() }
    }
    fn unshadowed(&self, _encoding: u32, _write: bool) {
        NestedCost::add(cpu::this_cpu(), 1, 0);
    }
}

/// Per CPU, what would exit to a nested KVM beyond the exits themselves:
/// VMCS accesses outside its shadow VMCS (`hypervisor::vmx::shadow`) and
/// INVEPTs. Each CPU adds to its own; the status report reads them.
pub struct NestedCost {
    pub unshadowed: AtomicU64,
    pub invept: AtomicU64,
}

impl NestedCost {
    /// Adds to CPU `cpu`'s counts (only that CPU calls this for itself:
    /// a load and a store, no locked instruction).
    pub fn add(cpu: usize, unshadowed: u64, invept: u64) {
        if let Some(c) = NESTED_COST.get(cpu) {
            for (counter, n) in [(&c.unshadowed, unshadowed), (&c.invept, invept)] {
                if n != 0 {
                    add_own(counter, n);
                }
            }
        }
    }

    /// CPU `cpu`'s counts: unshadowed VMCS accesses, INVEPTs.
    pub fn of(cpu: usize) -> (u64, u64) {
        NESTED_COST.get(cpu).map_or((0, 0), |c| {
            (c.unshadowed.load(Relaxed), c.invept.load(Relaxed))
        })
    }
}

/// INVEPT (single-context) of `eptp` by vCPU `index`, counted in its
/// [`NestedCost`].
pub fn invept(index: usize, eptp: u64) -> Result<(), VmFail> {
    NestedCost::add(index, 0, 1);
    insn::invept_single(eptp)
}

/// Root's time per CPU by kind of work ([`hypervisor::stats::RootWork`]):
/// each CPU adds to its own row, the status report reads them.
pub static ROOT_TIME: [[TimeStat; ROOT_WORK_KINDS]; hypervisor::acpi::MAX_CPUS] =
    [const { [const { TimeStat::new() }; ROOT_WORK_KINDS] }; hypervisor::acpi::MAX_CPUS];

/// CPU `cpu`'s time on `work`, in ticks, when it has a row.
pub fn root_time(cpu: usize, work: RootWork) -> Option<&'static TimeStat> {
    ROOT_TIME.get(cpu)?.get(work as usize)
}

/// See [`NestedCost`].
pub static NESTED_COST: [NestedCost; hypervisor::acpi::MAX_CPUS] = [const {
    NestedCost {
        unshadowed: AtomicU64::new(0),
        invept: AtomicU64::new(0),
    }
}; hypervisor::acpi::MAX_CPUS];

fn msr(m: u32) -> u64 {
    // SAFETY: only called for architectural VMX MSRs after CPUID said VMX
    // exists, and for IA32_PAT / IA32_EFER, which every x86-64 CPU has.
    unsafe { insn::rdmsr(m) }
}

/// First check: does the CPU have VMX at all?
pub fn check_support() -> Result<(), VmxError> {
    if insn::cpuid(1, 0)[2] & policy::CPUID_1_ECX_VMX == 0 {
        return Err(VmxError::NotSupported);
    }
    Ok(())
}

/// Fixed-bit MSR values the exit handlers need.
#[derive(Clone, Copy)]
pub struct Fixed {
    pub cr0: (u64, u64),
    pub cr4: (u64, u64),
}

/// Enters VMX operation (SDM 24.7 "Enabling and entering VMX operation").
fn vmxon(basic: VmxBasic) -> Result<Fixed, VmxError> {
    let fc = msr(IA32_FEATURE_CONTROL);
    if fc & 1 == 0 {
        // SAFETY: the MSR is unlocked, so enabling VMX outside SMX and locking it is allowed.
        unsafe { insn::wrmsr(IA32_FEATURE_CONTROL, fc | 1 | 4) };
    } else if fc & 4 == 0 {
        return Err(VmxError::DisabledByFirmware);
    }
    let fixed = Fixed {
        cr0: (msr(IA32_VMX_CR0_FIXED0), msr(IA32_VMX_CR0_FIXED1)),
        cr4: (msr(IA32_VMX_CR4_FIXED0), msr(IA32_VMX_CR4_FIXED1)),
    };
    let mut cr4 = insn::read_cr4() | policy::CR4_VMXE;
    if insn::cpuid(1, 0)[2] & (1 << 26) != 0 {
        // XSAVE exists: let VMX root execute XSETBV for the guest.
        cr4 |= CR4_OSXSAVE;
    }
    // SAFETY: the fixed-bit MSRs say which CR0/CR4 values VMX operation
    // needs; applying them keeps paging and protection on.
    unsafe {
        insn::write_cr0(caps::apply_fixed(
            insn::read_cr0(),
            fixed.cr0.0,
            fixed.cr0.1,
        ));
        insn::write_cr4(caps::apply_fixed(cr4, fixed.cr4.0, fixed.cr4.1));
    }
    let region = frames::alloc().ok_or(VmxError::OutOfMemory)?;
    phys::write(region.0, &basic.revision().to_le_bytes());
    // SAFETY: the region is a zeroed, page-aligned pool frame stamped with
    // the revision, never freed; CR4.VMXE is set above.
    unsafe { insn::vmxon(region.0) }.map_err(|e| VmxError::Instruction("VMXON", e, 0))?;
    Ok(fixed)
}

/// Builds the identity EPT: guest RAM write-back, the rest of the low 4 GiB
/// (and anything else below the top of RAM) uncacheable, the space above
/// up to the physical width uncacheable in 1 GiB pages, hypervisor memory
/// absent.
fn build_ept(b: &BootInfo, cap: EptVpidCap) -> Result<Ept, VmxError> {
    if let Some(missing) = cap.missing() {
        return Err(VmxError::EptCaps(missing));
    }
    let mut store = frames::PoolTables;
    let ept = Ept::new(&mut store)?;
    let limit = ept::identity_limit(b.ram_top);
    let big = cap.pages_2m();
    let hv = (
        layout::HV_RESERVED.as_u64(),
        layout::HV_RESERVED_END.as_u64(),
    );
    // Everything uncacheable first, then RAM on top as write-back.
    ept.map_identity(
        &mut store,
        Gpa(0),
        Gpa(limit),
        ept::RWX,
        MemType::Uncacheable,
        big,
    )?;
    for e in b.e820.iter().filter(|e| e.is_ram()) {
        let start = e.addr & !0xfff;
        let end = (e.addr + e.size).next_multiple_of(0x1000).min(limit);
        if start < end {
            ept.map_identity(
                &mut store,
                Gpa(start),
                Gpa(end),
                ept::RWX,
                MemType::WriteBack,
                big,
            )?;
        }
    }
    // Above that, up to the guest's physical width, nothing: 1 GiB
    // uncacheable pages where the CPU has them, so that the guest finds no
    // device there (all-ones) as on the bare machine, not a stop.
    let phys_bits = (insn::cpuid(0x8000_0008, 0)[0] & 0xFF) as u8;
    if let Some((start, end)) = ept::beyond_limit(limit, phys_bits).filter(|_| cap.pages_1g()) {
        ept.map_identity_gib(
            &mut store,
            Gpa(start),
            Gpa(end),
            ept::RWX,
            MemType::Uncacheable,
        )?;
    }
    ept.unmap(&mut store, Gpa(hv.0), Gpa(hv.1))?;
    let ap = layout::AP_TRAMPOLINE.as_u64();
    ept.unmap(&mut store, Gpa(ap), Gpa(ap + layout::PAGE_SIZE))?;
    Ok(ept)
}

/// Makes the interrupt windows (the local APIC's page, the rest of the
/// MSI MiB, the I/O APICs' pages) read-only to the guest (uncacheable, as
/// MMIO) in every vCPU's view: their stores exit, so that root sees the
/// guest's start-up IPIs and every INIT it could route past them
/// (`hypervisor::irq`).
pub fn protect_windows(views: &[Ept], windows: &hypervisor::irq::Windows) -> Result<(), VmxError> {
    for ept in views {
        windows.protect(ept, &mut frames::PoolTables)?;
    }
    Ok(())
}

/// Every EPT view's pointer, by index (`view_index`): an
/// AP's VMCS takes its armed view's from here ([`setup_ap`]).
static EPTPS: spin::Once<alloc::vec::Vec<u64>> = spin::Once::new();

/// vCPU `index`'s two views' EPT pointers (armed, quiet).
pub fn eptps(index: usize) -> Option<[u64; 2]> {
    let all = EPTPS.get()?;
    let at = |v| all.get(view_index(index, v)).copied();
    Some([at(View::Armed)?, at(View::Quiet)?])
}

/// What the exit handlers need to know about the VM.
pub struct VmConfig {
    pub fixed: Fixed,
    pub fadt: Option<Fadt>,
    /// Each vCPU's two EPT views, armed and quiet, by
    /// `view_index`: the same identity map, built the same
    /// way; the tracer's shared changes go into every view, its quiet
    /// pages into the quiet views, a single step's into its vCPU's alone
    /// (see `crate::machine`).
    pub views: alloc::vec::Vec<Ept>,
    /// Whether the VMX preemption timer is on.
    pub has_timer: bool,
    /// IA32_VMX_MISC[4:0]: the timer counts TSC >> this.
    pub timer_shift: u32,
    /// The bus-master IDE registers root keeps the guest away from.
    pub dma_block: Option<crate::ports::DmaBlock>,
    /// IA32_VMX_BASIC bit 54: INS/OUTS exits report the instruction
    /// information (address size, segment).
    pub ins_outs_info: bool,
}

impl VmConfig {
    /// The ports an I/O exit is decided against
    /// (`hypervisor::vmx::port::Ports`).
    pub fn ports(&self) -> hypervisor::vmx::port::Ports {
        hypervisor::vmx::port::Ports {
            dma: self.dma_block.as_ref().map(|d| d.ports.clone()),
            pm1: self.fadt.map(|f| (f.pm1a_cnt, f.pm1b_cnt)),
        }
    }
}

/// What every vCPU's VMCS shares: the controls, the bitmaps, EPT and the
/// fixed bits, set by the boot processor's [`setup`] and read by each AP
/// ([`setup_ap`]).
#[derive(Clone, Copy)]
pub struct Template {
    pin: u32,
    proc1: u32,
    proc2: u32,
    exit: u32,
    entry: u32,
    io_a: u64,
    io_b: u64,
    msr_bitmap: u64,
    eptp: u64,
    host_cr3: u64,
    pub fixed: Fixed,
}

/// The template, once the boot processor has built it.
pub static TEMPLATE: spin::Once<Template> = spin::Once::new();

/// Writes what every vCPU's VMCS has: the controls (`entry` may differ
/// from the template's), bitmaps, EPT, the VPID and the host state of
/// this CPU (its own GDT and TSS, root's shared IDT and page tables).
fn fill_common(
    v: &mut Vmcs,
    t: &Template,
    entry: u32,
    host: &HostTables,
    index: usize,
) -> Result<(), VmxError> {
    f::PIN_BASED_CONTROLS.write(v, t.pin)?;
    f::PRIMARY_PROC_CONTROLS.write(v, t.proc1)?;
    f::SECONDARY_PROC_CONTROLS.write(v, t.proc2)?;
    f::EXIT_CONTROLS.write(v, t.exit)?;
    f::ENTRY_CONTROLS.write(v, entry)?;
    f::EXCEPTION_BITMAP.write(v, 0)?;
    f::CR3_TARGET_COUNT.write(v, 0)?;
    f::EPT_POINTER.write(v, t.eptp)?;
    if t.proc2 & SecondaryControls::ENABLE_VPID.bits() != 0 {
        // VPID 0 is root's; each vCPU gets its own.
        f::VPID.write(v, (index + 1) as u16)?;
    }
    f::IO_BITMAP_A.write(v, t.io_a)?;
    f::IO_BITMAP_B.write(v, t.io_b)?;
    f::MSR_BITMAP.write(v, t.msr_bitmap)?;

    // Host state (SDM 25.5, checked per 27.2.2/27.2.3).
    f::HOST_CR0.write(v, insn::read_cr0())?;
    f::HOST_CR3.write(v, t.host_cr3)?;
    f::HOST_CR4.write(v, insn::read_cr4())?;
    f::HOST_CS_SELECTOR.write(v, cpu::CODE)?;
    for s in [
        f::HOST_SS_SELECTOR,
        f::HOST_DS_SELECTOR,
        f::HOST_ES_SELECTOR,
        f::HOST_FS_SELECTOR,
        f::HOST_GS_SELECTOR,
    ] {
        s.write(v, cpu::DATA)?;
    }
    f::HOST_TR_SELECTOR.write(v, cpu::TSS)?;
    f::HOST_FS_BASE.write(v, 0)?;
    // Root's CPU index (`arch::cpu::this_cpu`).
    f::HOST_GS_BASE.write(v, index as u64)?;
    f::HOST_TR_BASE.write(v, host.tss_base)?;
    f::HOST_GDTR_BASE.write(v, host.gdt_base)?;
    f::HOST_IDTR_BASE.write(v, host.idt_base)?;
    f::HOST_IA32_SYSENTER_CS.write(v, 0)?;
    f::HOST_IA32_SYSENTER_ESP.write(v, 0)?;
    f::HOST_IA32_SYSENTER_EIP.write(v, 0)?;
    f::HOST_IA32_EFER.write(v, msr(IA32_EFER))?;
    if t.exit & ExitControls::LOAD_IA32_PAT.bits() != 0 {
        f::HOST_IA32_PAT.write(v, msr(IA32_PAT))?;
    }
    f::CR0_GUEST_HOST_MASK.write(v, policy::cr0_host_mask(t.fixed.cr0.0))?;
    f::CR4_GUEST_HOST_MASK.write(v, policy::cr4_guest_host_mask(t.fixed.cr4.0))?;
    if entry & EntryControls::LOAD_IA32_PAT.bits() != 0 {
        f::GUEST_IA32_PAT.write(v, 0x0007_0406_0007_0406)?;
    }
    f::VMCS_LINK_POINTER.write(v, u64::MAX)?;
    Ok(())
}

/// Creates a fresh VMCS in a pool frame and makes it current.
fn new_vmcs(basic: VmxBasic) -> Result<(), VmxError> {
    let vmcs = frames::alloc().ok_or(VmxError::OutOfMemory)?;
    phys::write(vmcs.0, &basic.revision().to_le_bytes());
    // SAFETY: a fresh revision-stamped pool frame.
    unsafe { insn::vmclear(vmcs.0) }.map_err(|e| VmxError::Instruction("VMCLEAR", e, 0))?;
    // SAFETY: the same frame, now clear.
    unsafe { insn::vmptrld(vmcs.0) }.map_err(|e| VmxError::Instruction("VMPTRLD", e, 0))?;
    Ok(())
}

/// Sets up VMX on an AP: VMXON, its own VMCS with the template's controls,
/// parked in wait-for-SIPI in the state INIT leaves
/// ([`hypervisor::vmx::ap`]). The AP then enters it and waits there for the
/// guest's start-up IPIs; returns its registers in that state.
pub fn setup_ap(host: &HostTables, t: &Template, index: usize) -> Result<GuestRegs, VmxError> {
    let basic = VmxBasic(msr(IA32_VMX_BASIC));
    if msr(IA32_VMX_MISC) & ap::MISC_WAIT_FOR_SIPI == 0 {
        return Err(VmxError::Controls(WAIT_FOR_SIPI_MISSING));
    }
    vmxon(basic)?;
    new_vmcs(basic)?;
    let v = &mut Vmcs;
    let entry = t.entry & !EntryControls::IA32E_MODE_GUEST.bits();
    fill_common(v, t, entry, host, index)?;
    // The AP's own EPT view (the boot processor made one per vCPU).
    let eptp = EPTPS
        .get()
        .and_then(|e| e.get(view_index(index, View::Armed)))
        .copied()
        .ok_or(VmxError::EptCaps("an EPT view for every vCPU"))?;
    f::EPT_POINTER.write(v, eptp)?;
    let mut regs = GuestRegs::default();
    let fixed = ap::FixedCrs {
        cr0: t.fixed.cr0,
        cr4: t.fixed.cr4,
    };
    ap::write_init_state(v, &mut regs, fixed, insn::cpuid(1, 0)[0])?;
    Ok(regs)
}

/// Creates and fills the VMCS for the guest described by `entry`, with an
/// EPT view for each of `vcpus` vCPUs.
pub fn setup(
    host: &HostTables,
    b: &BootInfo,
    entry: &GuestEntry,
    fadt: Option<Fadt>,
    vcpus: usize,
) -> Result<VmConfig, VmxError> {
    // Every capability MSR, read here once; `choose` decides from them
    // (the required and optional controls are listed in
    // `hypervisor::vmx::profile`).
    let profile = CapProfile::read(msr);
    let basic = VmxBasic(profile.basic);
    let fixed = vmxon(basic)?;
    // More than one vCPU needs the preemption timer and wait-for-SIPI
    // (KVM offers its nested guests the latter from 5.11): refused here,
    // once, before any AP starts.
    let chosen = choose(&profile)
        .and_then(|c| c.check_vcpus(vcpus).map(|()| c))
        .map_err(|r| match r {
            Refusal::Controls(m) => VmxError::Controls(m),
            Refusal::Ept(m) => VmxError::EptCaps(m),
        })?;
    let cap = chosen.ept;
    // Two views per vCPU, armed then quiet (`view_index`).
    let mut views = alloc::vec::Vec::new();
    for _ in 0..2 * vcpus.max(1) {
        views.push(build_ept(b, cap)?);
    }
    EPTPS.call_once(|| views.iter().map(Ept::eptp).collect());
    let ept = views
        .first()
        .ok_or(VmxError::EptCaps("at least one vCPU"))?;

    new_vmcs(basic)?;

    let Chosen {
        pin,
        proc1,
        proc2,
        exit,
        entry: entry_ctl,
        ..
    } = chosen;
    log::info!(
        "VMX: revision {:#x}, pin {pin:#x} proc {proc1:#x} proc2 {proc2:#x} exit {exit:#x} entry {entry_ctl:#x}, EPT/VPID caps {:#x}",
        basic.revision(),
        cap.0
    );

    let has_timer = chosen.preemption_timer;
    let timer_shift = chosen.timer_shift;

    // I/O bitmaps: the control UART, the log port, PCI configuration, the
    // bus-master IDE registers, and the ACPI PM1 control ports so that the
    // guest's power-off is seen.
    let dma_block = crate::ports::find_bus_master_ide();
    if let Some(d) = &dma_block {
        log::info!(
            "bus-master IDE at {:02x}:{:02x}.{}: ports {:#x}..={:#x} kept from the guest",
            d.bdf.0,
            d.bdf.1,
            d.bdf.2,
            d.ports.start(),
            d.ports.end()
        );
    }
    let (io_a, io_b) = (
        frames::alloc().ok_or(VmxError::OutOfMemory)?,
        frames::alloc().ok_or(VmxError::OutOfMemory)?,
    );
    {
        // SAFETY: two fresh, distinct pool frames owned here.
        let (a, b2) = unsafe { (phys::frame_bytes_mut(io_a), phys::frame_bytes_mut(io_b)) };
        policy::io_bitmap_set(a, b2, policy::CONTROL_PORTS);
        policy::io_bitmap_set(a, b2, policy::DEBUG_PORT..=policy::DEBUG_PORT);
        policy::io_bitmap_set(a, b2, pci::CONFIG_ADDRESS..=*pci::CONFIG_DATA.end());
        for p in policy::RESET_PORTS {
            policy::io_bitmap_set(a, b2, p..=p);
        }
        if let Some(d) = &dma_block {
            policy::io_bitmap_set(a, b2, d.ports.clone());
        }
        if let Some(fd) = fadt {
            policy::io_bitmap_set(a, b2, fd.pm1a_cnt..=fd.pm1a_cnt + 1);
            if let Some(p) = fd.pm1b_cnt {
                policy::io_bitmap_set(a, b2, p..=p + 1);
            }
        }
    }
    let msr_bm = frames::alloc().ok_or(VmxError::OutOfMemory)?;
    // SAFETY: a fresh pool frame owned here.
    let msr_bytes = unsafe { phys::frame_bytes_mut(msr_bm) };
    policy::msr_bitmap(
        msr_bytes,
        policy::INTERCEPTED_MSR_READS,
        policy::INTERCEPTED_MSR_WRITES,
    );
    // The x2APIC's interrupt command register: INIT and SIPI are root's
    // (`smp`); every other IPI is written through.
    let icr = hypervisor::apic::X2APIC_ICR_MSR;
    policy::msr_bitmap(msr_bytes, &[], &[(icr, icr)]);
    // The x2APIC's LVT entries: no INIT (or SMI) delivery mode.
    policy::msr_bitmap(msr_bytes, &[], &hypervisor::apic::X2APIC_LVT_MSRS);
    let template = Template {
        pin,
        proc1,
        proc2,
        exit,
        entry: entry_ctl,
        io_a: io_a.0,
        io_b: io_b.0,
        msr_bitmap: msr_bm.0,
        eptp: ept.eptp(),
        host_cr3: insn::read_cr3(),
        fixed,
    };
    let v = &mut Vmcs;
    fill_common(v, &template, entry_ctl, host, 0)?;
    TEMPLATE.call_once(|| template);

    // Guest state: 64-bit mode as the Linux 64-bit boot protocol wants it.
    let cr0 = policy::CR0_PG | policy::CR0_NE | (1 << 4) | policy::CR0_PE;
    f::GUEST_CR0.write(
        v,
        caps::apply_fixed(cr0, policy::cr0_host_mask(fixed.cr0.0), fixed.cr0.1),
    )?;
    f::CR0_READ_SHADOW.write(v, cr0)?;
    let cr4 = 1u64 << 5; // PAE
    f::GUEST_CR4.write(
        v,
        caps::apply_fixed(cr4, policy::cr4_host_mask(fixed.cr4.0), fixed.cr4.1),
    )?;
    f::CR4_READ_SHADOW.write(v, cr4)?;
    f::GUEST_CR3.write(v, entry.cr3)?;
    f::GUEST_DR7.write(v, 0x400)?;
    f::GUEST_RSP.write(v, GUEST_BOOT_STACK)?;
    f::GUEST_RIP.write(v, entry.rip)?;
    f::GUEST_RFLAGS.write(v, 0x2)?;

    let (code, data) = entry.selectors;
    // Access rights (SDM 25.4.1): type, S, DPL, P, L, D/B, G; bit 16 = unusable.
    const CODE64_AR: u32 = 0xa09b;
    const DATA_AR: u32 = 0xc093;
    let seg = &f::GUEST_SEGMENTS;
    seg[f::SEG_CS].write(v, code, 0, 0xffff_ffff, CODE64_AR)?;
    for i in [f::SEG_SS, f::SEG_DS, f::SEG_ES, f::SEG_FS, f::SEG_GS] {
        // In bounds: the indices are the named constants of GUEST_SEGMENTS.
        #[allow(clippy::indexing_slicing)]
        seg[i].write(v, data, 0, 0xffff_ffff, DATA_AR)?;
    }
    seg[f::SEG_LDTR].write(v, 0, 0, 0, hypervisor::task_switch::AR_UNUSABLE)?;
    seg[f::SEG_TR].write(v, 0, 0, 0x67, f::AR_TSS_BUSY)?;
    f::GUEST_GDTR_BASE.write(v, entry.gdt.0)?;
    f::GUEST_GDTR_LIMIT.write(v, entry.gdt.1 as u32)?;
    f::GUEST_IDTR_BASE.write(v, 0)?;
    f::GUEST_IDTR_LIMIT.write(v, 0)?;
    f::GUEST_IA32_EFER.write(v, policy::EFER_LME | policy::EFER_LMA)?;
    f::GUEST_IA32_DEBUGCTL.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_CS.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_ESP.write(v, 0)?;
    f::GUEST_IA32_SYSENTER_EIP.write(v, 0)?;
    f::GUEST_INTERRUPTIBILITY.write(v, 0)?;
    f::GUEST_ACTIVITY_STATE.write(v, 0)?;
    f::GUEST_PENDING_DEBUG_EXCEPTIONS.write(v, 0)?;

    Ok(VmConfig {
        fixed,
        fadt,
        views,
        has_timer,
        timer_shift,
        dma_block,
        ins_outs_info: chosen.ins_outs_info,
    })
}

/// Where vCPU `vcpu`'s view `view` is among the VM's views.
pub fn view_index(vcpu: usize, view: View) -> usize {
    2 * vcpu + view as usize
}
