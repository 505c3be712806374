//! The hypervisor's own GDT, TSS and IDT. VM exits load the host state from
//! the VMCS, which needs a non-null TR selector (SDM 27.2.3), so VMX root runs
//! on these tables rather than on the boot stub's.
//!
//! The IDT lives in hypervisor memory and is loaded both here and, through
//! HOST_IDTR_BASE, at every VM exit: an exception or NMI taken in VMX root
//! runs root's own stubs, never a gate the guest could write. NMI, #DF and
//! #MC switch to stacks of their own (IST), so a fault on a bad root stack
//! is still reported.

use super::instructions::{self as insn, DescriptorTablePointer};
use spin::Once;

/// Host code selector.
pub const CODE: u16 = 0x08;
/// Host data selector.
pub const DATA: u16 = 0x10;
/// Host TSS selector.
pub const TSS: u16 = 0x18;

/// 64-bit TSS (SDM 8.7): no privilege-level stacks (root runs at CPL 0
/// only), three interrupt stacks.
#[repr(C, packed)]
struct Tss {
    reserved0: u32,
    rsp: [u64; 3],
    reserved1: u64,
    ist: [u64; 7],
    reserved2: u64,
    reserved3: u16,
    iomap_base: u16,
}

const _: () = assert!(core::mem::size_of::<Tss>() == 104);

/// IST slots (1-based, as the gate's IST field names them).
pub const IST_NMI: u8 = 1;
/// #DF: a fault while delivering a fault, e.g. on an overflowed stack.
pub const IST_DOUBLE_FAULT: u8 = 2;
/// #MC.
pub const IST_MACHINE_CHECK: u8 = 3;

const IST_STACK_SIZE: usize = 16 * 1024;

#[repr(C, align(16))]
struct IstStacks([[u8; IST_STACK_SIZE]; 3]);

/// The interrupt stacks. Only the CPU touches them (through the TSS), so
/// Rust never forms a reference to them.
static mut IST_STACKS: IstStacks = IstStacks([[0; IST_STACK_SIZE]; 3]);

static TSS_AREA: Once<Tss> = Once::new();

/// One 64-bit interrupt gate (SDM 6.14.1).
#[repr(C)]
#[derive(Clone, Copy)]
struct Gate {
    offset_low: u16,
    selector: u16,
    ist: u8,
    attributes: u8,
    offset_mid: u16,
    offset_high: u32,
    reserved: u32,
}

const _: () = assert!(core::mem::size_of::<Gate>() == 16);

impl Gate {
    const ABSENT: Gate = Gate {
        offset_low: 0,
        selector: 0,
        ist: 0,
        attributes: 0,
        offset_mid: 0,
        offset_high: 0,
        reserved: 0,
    };

    /// A present, DPL 0 interrupt gate (type 0xE: IF cleared on entry).
    fn interrupt(handler: u64, ist: u8) -> Gate {
        Gate {
            offset_low: handler as u16,
            selector: CODE,
            ist,
            attributes: 0x8e,
            offset_mid: (handler >> 16) as u16,
            offset_high: (handler >> 32) as u32,
            reserved: 0,
        }
    }
}

/// 256 gates: the 32 exception vectors point at root's stubs, the rest are
/// absent (root runs with IF clear, so no external interrupt arrives; any
/// stray vector faults with #NP, which is reported).
static IDT: Once<[Gate; 256]> = Once::new();

/// Where the tables ended up, for the VMCS host-state fields.
#[derive(Clone, Copy)]
pub struct HostTables {
    /// GDTR base.
    pub gdt_base: u64,
    /// TR base.
    pub tss_base: u64,
    /// IDTR base.
    pub idt_base: u64,
}

static GDT: Once<[u64; 5]> = Once::new();

/// Installs the host GDT and TSS and reloads the segment registers.
pub fn init() -> HostTables {
    let tss = TSS_AREA.call_once(|| tss_with_stacks(core::ptr::addr_of!(IST_STACKS) as u64));
    let tss = tss as *const Tss as u64;
    let gdt = GDT.call_once(|| gdt_for(tss));
    let ptr = DescriptorTablePointer {
        limit: (core::mem::size_of_val(gdt) - 1) as u16,
        base: gdt.as_ptr() as u64,
    };
    // SAFETY: the GDT is a 'static holding valid code, data and TSS
    // descriptors with the selectors reloaded right after.
    unsafe {
        insn::lgdt(&ptr);
        insn::reload_segments(CODE, DATA);
        insn::ltr(TSS);
    }
    let idt = IDT.call_once(|| {
        let mut idt = [Gate::ABSENT; 256];
        for (v, gate) in idt.iter_mut().enumerate().take(32) {
            let ist = match v {
                2 => IST_NMI,
                8 => IST_DOUBLE_FAULT,
                18 => IST_MACHINE_CHECK,
                _ => 0,
            };
            *gate = Gate::interrupt(insn::trap_entry(v), ist);
        }
        idt
    });
    load_idt(idt);
    set_this_cpu(0);
    HostTables {
        gdt_base: gdt.as_ptr() as u64,
        tss_base: tss,
        idt_base: idt.as_ptr() as u64,
    }
}

/// A TSS whose NMI, #DF and #MC stacks are the three `IST_STACK_SIZE`
/// stacks from `stacks` up, in that order.
fn tss_with_stacks(stacks: u64) -> Tss {
    let top = |i: u64| stacks + (i + 1) * IST_STACK_SIZE as u64;
    // IST n is slot n - 1 of the TSS's seven.
    let mut ist = [0u64; 7];
    for (n, stack) in [(IST_NMI, 0), (IST_DOUBLE_FAULT, 1), (IST_MACHINE_CHECK, 2)] {
        if let Some(slot) = ist.get_mut(usize::from(n).wrapping_sub(1)) {
            *slot = top(stack);
        }
    }
    Tss {
        reserved0: 0,
        rsp: [0; 3],
        reserved1: 0,
        ist,
        reserved2: 0,
        reserved3: 0,
        iomap_base: 104,
    }
}

/// Root's GDT with the TSS at `tss`: null, 64-bit code, data, and the
/// two-slot descriptor of an available 64-bit TSS (type 9), present.
fn gdt_for(tss: u64) -> [u64; 5] {
    let limit = (core::mem::size_of::<Tss>() - 1) as u64;
    let low = (limit & 0xffff)
        | ((tss & 0xff_ffff) << 16)
        | (0x89 << 40)
        | (((limit >> 16) & 0xf) << 48)
        | (((tss >> 24) & 0xff) << 56);
    [
        0,
        0x00af_9a00_0000_ffff,
        0x00cf_9200_0000_ffff,
        low,
        tss >> 32,
    ]
}

/// The room an AP's tables and interrupt stacks take: one page for its
/// GDT and TSS, then its three IST stacks.
pub const AP_TABLES_SIZE: u64 = 4096 + 3 * IST_STACK_SIZE as u64;

/// Installs an AP's own GDT and TSS, built in `area` (a zeroed,
/// page-aligned region of [`AP_TABLES_SIZE`] bytes that the AP owns for
/// good), with the IDT every CPU shares; records `index` as this CPU's
/// (see [`this_cpu`]).
///
/// # Safety
/// `area` must be identity-mapped hypervisor memory that nothing else uses.
pub unsafe fn init_ap(area: u64, index: usize) -> HostTables {
    let tss_addr = area + 64;
    let tss = tss_with_stacks(area + 4096);
    let gdt = gdt_for(tss_addr);
    // SAFETY: the caller gives this AP the area for good; the GDT (40
    // bytes at its start) and the TSS (104 bytes at +64) do not overlap,
    // and both are written before they are loaded.
    unsafe {
        core::ptr::write(area as *mut [u64; 5], gdt);
        core::ptr::write_unaligned(tss_addr as *mut Tss, tss);
    }
    let ptr = DescriptorTablePointer {
        limit: (core::mem::size_of::<[u64; 5]>() - 1) as u16,
        base: area,
    };
    // SAFETY: the GDT just written holds valid code, data and TSS
    // descriptors with the selectors reloaded right after.
    unsafe {
        insn::lgdt(&ptr);
        insn::reload_segments(CODE, DATA);
        insn::ltr(TSS);
    }
    reload_root_idt();
    set_this_cpu(index);
    HostTables {
        gdt_base: area,
        tss_base: tss_addr,
        idt_base: IDT.get().map_or(0, |idt| idt.as_ptr() as u64),
    }
}

/// Records this CPU's index in IA32_GS_BASE (root uses no GS otherwise;
/// the VMCS's HOST_GS_BASE holds the same value, so every exit keeps it).
pub fn set_this_cpu(index: usize) {
    // SAFETY: IA32_GS_BASE exists on every x86-64 CPU and takes any
    // canonical value; root never addresses through GS.
    unsafe { insn::wrmsr(x86::msr::IA32_GS_BASE, index as u64) };
}

/// The index of the CPU this runs on (0 for the boot processor).
pub fn this_cpu() -> usize {
    // SAFETY: see `set_this_cpu`.
    unsafe { insn::rdmsr(x86::msr::IA32_GS_BASE) as usize }
}

/// Loads root's IDT with its own limit.
fn load_idt(idt: &'static [Gate; 256]) {
    let idtr = DescriptorTablePointer {
        limit: (core::mem::size_of_val(idt) - 1) as u16,
        base: idt.as_ptr() as u64,
    };
    // SAFETY: the IDT is a 'static whose 32 present gates point at the
    // exception stubs with the code selector `init` loaded; the IST slots
    // they name are set in the TSS `init` loaded.
    unsafe { insn::lidt(&idtr) };
}

/// Loads root's IDT again, for the fatal path before it halts: whatever
/// ran last (a VM exit sets the IDTR limit to 0xFFFF), an NMI that wakes
/// the halted CPU then goes through root's own gates. Does nothing before
/// [`init`] built the table (there is no IDT of root's yet).
pub fn reload_root_idt() {
    if let Some(idt) = IDT.get() {
        load_idt(idt);
    }
}
