//! The hypervisor's own GDT and TSS. VM exits load the host state from the
//! VMCS, which needs a non-null TR selector (SDM 27.2.3), so VMX root runs on
//! these tables rather than on the boot stub's.

use super::instructions::{self as insn, DescriptorTablePointer};
use spin::Once;

/// Host code selector.
pub const CODE: u16 = 0x08;
/// Host data selector.
pub const DATA: u16 = 0x10;
/// Host TSS selector.
pub const TSS: u16 = 0x18;

/// 64-bit TSS (SDM 8.7): only its existence matters, no stack switching.
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

static TSS_AREA: Tss = Tss {
    reserved0: 0,
    rsp: [0; 3],
    reserved1: 0,
    ist: [0; 7],
    reserved2: 0,
    reserved3: 0,
    iomap_base: 104,
};

/// Where the tables ended up, for the VMCS host-state fields.
#[derive(Clone, Copy)]
pub struct HostTables {
    /// GDTR base.
    pub gdt_base: u64,
    /// TR base.
    pub tss_base: u64,
}

static GDT: Once<[u64; 5]> = Once::new();

/// Installs the host GDT and TSS and reloads the segment registers.
pub fn init() -> HostTables {
    let tss = &TSS_AREA as *const Tss as u64;
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
    HostTables {
        gdt_base: gdt.as_ptr() as u64,
        tss_base: tss,
    }
}
