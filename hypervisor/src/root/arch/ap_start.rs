//! Starting an application processor: the real-mode trampoline that a
//! SIPI points it at, the climb to long mode on root's page tables, and
//! the local APIC's interrupt command register that sends the INIT and
//! SIPI.
//!
//! The trampoline is 36 bytes of position-independent 16-bit code that
//! `install_trampoline` copies to a page below 1 MiB (the SIPI vector is
//! that page's number). It only loads a GDT that lives in the hypervisor
//! image (its pointer holds an absolute address, fixed at link time) and
//! jumps to 32-bit code in the image; from there everything is addressed
//! absolutely, as the boot stub does: PAE, root's CR3 (`AP_CR3`), EFER.LME,
//! paging, then 64-bit code that takes its stack (`AP_STACK`) and index
//! (`AP_INDEX`) and calls `hv_ap_entry64`. The BSP starts one AP at a time
//! and waits for it, so the three variables serve every AP in turn.
//!
//! The page the trampoline is copied to is root's for good: outside the
//! guest's e820 and absent from EPT, because a guest that could write it
//! would choose the code an AP runs before it enters VMX.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use hypervisor::apic::{X2APIC_ICR_MSR, XAPIC_ICR_HIGH, XAPIC_ICR_LOW};

/// Root's CR3 for the AP (the page tables must lie below 4 GiB).
#[unsafe(no_mangle)]
static HV_AP_CR3: AtomicU32 = AtomicU32::new(0);
/// The top of the starting AP's stack.
#[unsafe(no_mangle)]
static HV_AP_STACK: AtomicU64 = AtomicU64::new(0);
/// The starting AP's index (its vCPU number).
#[unsafe(no_mangle)]
static HV_AP_INDEX: AtomicU64 = AtomicU64::new(0);

core::arch::global_asm!(
    r#"
    .section .text.hv_ap, "ax"
    .code16
    .global hv_ap_real_start
hv_ap_real_start:
    /* cli; cld; mov ax, cs; mov ds, ax */
    .byte 0xfa, 0xfc, 0x8c, 0xc8, 0x8e, 0xd8
    /* lgdt with a 32-bit base: o32 lgdt [disp16] */
    .byte 0x66, 0x0f, 0x01, 0x16
    .word hv_ap_gdt_ptr - hv_ap_real_start
    /* mov eax, cr0; or eax, 1; mov cr0, eax */
    .byte 0x0f, 0x20, 0xc0, 0x66, 0x83, 0xc8, 0x01, 0x0f, 0x22, 0xc0
    /* o32 jmp far 0x08:hv_ap_start32 */
    .byte 0x66, 0xea
    .long hv_ap_start32
    .word 0x08
    .balign 2
hv_ap_gdt_ptr:
    .word hv_ap_gdt_end - hv_ap_gdt - 1
    .long hv_ap_gdt
    .global hv_ap_real_end
hv_ap_real_end:

    .code32
hv_ap_start32:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov esp, dword ptr [{stack}]
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, dword ptr [{cr3}]
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    /* INIT left caching off (CD, NW): root runs with it on. */
    and eax, 0x9fffffff
    or eax, 0x80000001
    mov cr0, eax
    mov eax, 0x18
    push eax
    mov eax, offset hv_ap_start64
    push eax
    retf

    .code64
hv_ap_start64:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    xor eax, eax
    mov fs, ax
    mov gs, ax
    mov rsp, qword ptr [rip + {stack}]
    mov rdi, qword ptr [rip + {index}]
    xor ebp, ebp
    call hv_ap_entry64
2:
    cli
    hlt
    jmp 2b

    .section .rodata.hv_ap, "a"
    .balign 16
hv_ap_gdt:
    .quad 0
    .quad 0x00CF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00AF9A000000FFFF
hv_ap_gdt_end:
"#,
    cr3 = sym HV_AP_CR3,
    stack = sym HV_AP_STACK,
    index = sym HV_AP_INDEX,
);

extern "C" {
    static hv_ap_real_start: u8;
    static hv_ap_real_end: u8;
}

/// The trampoline's bytes, to be copied to the start-up page.
pub fn trampoline() -> &'static [u8] {
    let start = core::ptr::addr_of!(hv_ap_real_start);
    let end = core::ptr::addr_of!(hv_ap_real_end);
    let len = (end as usize).saturating_sub(start as usize);
    // SAFETY: both symbols delimit the trampoline in the image's text,
    // which is mapped, read-only to Rust, and never changes.
    unsafe { core::slice::from_raw_parts(start, len) }
}

/// Sets what the next AP to start takes: root's page tables, its stack
/// top and its index.
pub fn prepare(cr3: u64, stack_top: u64, index: usize) -> Result<(), ()> {
    let cr3 = u32::try_from(cr3).map_err(|_| ())?;
    HV_AP_CR3.store(cr3, Ordering::SeqCst);
    HV_AP_STACK.store(stack_top, Ordering::SeqCst);
    HV_AP_INDEX.store(index as u64, Ordering::SeqCst);
    Ok(())
}

/// IA32_APIC_BASE bit 10: the local APIC is in x2APIC mode.
const APIC_BASE_EXTD: u64 = 1 << 10;
/// ICR bit 12: the previous IPI is still being sent (xAPIC only).
const ICR_BUSY: u32 = 1 << 12;

/// Sends an IPI from this CPU's local APIC: `low` is the ICR's low word
/// (vector, delivery mode, level, trigger, shorthand), `dest` the APIC ID.
/// `lapic` is the xAPIC's MMIO base; in x2APIC mode the MSR is used.
/// The ICR's high word is given back its old value, so that a guest write
/// sequence that root interrupted between its two halves still holds.
pub fn send_ipi(lapic: u64, dest: u32, low: u32) {
    // SAFETY: IA32_APIC_BASE exists on every CPU with a local APIC, which
    // the MADT said this one has.
    let base = unsafe { super::instructions::rdmsr(x86::msr::IA32_APIC_BASE) };
    if base & APIC_BASE_EXTD != 0 {
        // SAFETY: the x2APIC ICR takes any value; a bad one is an APIC
        // error, not a fault.
        unsafe {
            super::instructions::wrmsr(X2APIC_ICR_MSR, (u64::from(dest) << 32) | u64::from(low))
        };
        return;
    }
    let high = (lapic + XAPIC_ICR_HIGH) as *mut u32;
    let lo = (lapic + XAPIC_ICR_LOW) as *mut u32;
    // SAFETY: `lapic` is the local APIC's MMIO window, identity-mapped
    // (uncacheable by the firmware's MTRRs) in root's page tables; the
    // ICR registers are 32-bit and aligned, and writing them only sends
    // an IPI.
    unsafe {
        let mut spins = 0u32;
        while core::ptr::read_volatile(lo) & ICR_BUSY != 0 && spins < 1_000_000 {
            spins += 1;
            core::hint::spin_loop();
        }
        let old = core::ptr::read_volatile(high);
        core::ptr::write_volatile(high, dest << 24);
        core::ptr::write_volatile(lo, low);
        core::ptr::write_volatile(high, old);
    }
}

/// Reads the 32-bit local APIC register at `offset` (xAPIC MMIO).
pub fn apic_read(lapic: u64, offset: u64) -> u32 {
    let reg = (lapic + (offset & 0xff0)) as *const u32;
    // SAFETY: the APIC window is identity-mapped in root's page tables;
    // its registers are 16-byte aligned 32-bit words, and a read has no
    // effect beyond what the guest's own read of it would have.
    unsafe { core::ptr::read_volatile(reg) }
}

/// Writes the 32-bit local APIC register at `offset` (xAPIC MMIO), on the
/// guest's behalf.
pub fn apic_write(lapic: u64, offset: u64, value: u32) {
    let reg = (lapic + (offset & 0xff0)) as *mut u32;
    // SAFETY: as in `apic_read`; the value is the one the guest stored,
    // which the guest could have written itself, except INIT and SIPI,
    // which root's caller keeps for itself.
    unsafe { core::ptr::write_volatile(reg, value) }
}

/// Reads the 32-bit word at physical address `addr` (rounded down to 4
/// bytes) in an interrupt window other than the local APIC's page: an I/O
/// APIC's registers or the MSI MiB (`hypervisor::irq::Windows`).
pub fn window_read(addr: u64) -> u32 {
    let reg = (addr & !3) as *const u32;
    // SAFETY: the windows lie in the MMIO hole below 4 GiB, which root's
    // page tables identity-map (`hypervisor::irq::Windows` keeps to it);
    // the word is aligned, and a read has no effect beyond what the
    // guest's own read of it (which EPT lets through) would have.
    unsafe { core::ptr::read_volatile(reg) }
}

/// Writes the 32-bit word at physical address `addr` (rounded down to 4
/// bytes) in an interrupt window other than the local APIC's page, on the
/// guest's behalf.
pub fn window_write(addr: u64, value: u32) {
    let reg = (addr & !3) as *mut u32;
    // SAFETY: as in `window_read`; the value is the one the guest stored,
    // which root's caller has checked (`hypervisor::irq`).
    unsafe { core::ptr::write_volatile(reg, value) }
}
