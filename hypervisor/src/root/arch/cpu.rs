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
    let tss = TSS_AREA.call_once(|| {
        let stacks = core::ptr::addr_of!(IST_STACKS) as u64;
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
    });
    let tss = tss as *const Tss as u64;
    let gdt = GDT.call_once(|| {
        let limit = (core::mem::size_of::<Tss>() - 1) as u64;
        // Available 64-bit TSS (type 9), present.
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
    });
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
    HostTables {
        gdt_base: gdt.as_ptr() as u64,
        tss_base: tss,
        idt_base: idt.as_ptr() as u64,
    }
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
