//! The Multiboot v1 header and the 32-to-64-bit entry of the hypervisor image.
//!
//! Both GRUB (`multiboot`) and QEMU (`-kernel`) enter at `_start32` in 32-bit
//! protected mode with paging off, EAX = 0x2BADB002 and EBX = the physical
//! address of the multiboot information structure. The header uses the a.out
//! kludge (flag bit 16) so that loaders take the load addresses from it rather
//! than from the ELF program headers: QEMU refuses 64-bit ELF images otherwise.
//!
//! The stub builds an identity map of the first 4 GiB with 2 MiB pages, enters
//! long mode and calls `hv_entry64(magic, mbi)`, which the hypervisor binary
//! defines, on a 512 KiB stack with a guard page under it ([`stack_guard`]).
//! This file and `hypervisor/src/arch/instructions.rs` are the only places
//! in the project with assembly.

/// Size of root's stack (the boot stub's, which root keeps). The release
/// build needs far less, but a debug build (no inlining, the recovery state
/// machine's large futures) overflowed 64 KiB into the guard page during
/// introspection.
pub const STACK_SIZE: u64 = 512 * 1024;

extern "C" {
    static hv_boot_stack_guard: u8;
    static hv_boot_stack_top: u8;
}

/// The 4 KiB page directly under root's stack, page aligned. The boot stub
/// maps it like the rest of the image; the hypervisor takes it out of its
/// page tables early in its start-up, so that a stack overflow faults
/// instead of writing over the boot page tables below it.
pub fn stack_guard() -> u64 {
    // Only the symbol's address is taken, never its value.
    core::ptr::addr_of!(hv_boot_stack_guard) as u64
}

/// The top (exclusive end) of root's stack; the stack itself is the
/// [`STACK_SIZE`] bytes under it, right above [`stack_guard`].
pub fn stack_top() -> u64 {
    // Only the symbol's address is taken, never its value.
    core::ptr::addr_of!(hv_boot_stack_top) as u64
}

/// Multiboot v1 header magic.
pub const MULTIBOOT_HEADER_MAGIC: u32 = 0x1BAD_B002;
/// Header flags: page-align modules (bit 0), memory map wanted (bit 1),
/// load addresses in the header (bit 16, the a.out kludge).
pub const MULTIBOOT_HEADER_FLAGS: u32 = (1 << 0) | (1 << 1) | (1 << 16);

core::arch::global_asm!(
    r#"
    .section .multiboot, "a"
    .balign 4
hv_multiboot_header:
    .long {magic}
    .long {flags}
    .long {checksum}
    .long hv_multiboot_header
    .long __load_start
    .long __load_end
    .long __reserved_end
    .long _start32

    .section .text.boot, "ax"
    .code32
    .global _start32
_start32:
    cli
    cld
    mov edi, eax
    mov esi, ebx
    mov esp, offset hv_boot_stack_top

    /* PML4[0] -> PDPT */
    mov eax, offset hv_boot_pdpt
    or eax, 3
    mov dword ptr [hv_boot_pml4], eax
    mov dword ptr [hv_boot_pml4 + 4], 0

    /* PDPT[0..4] -> the four page directories */
    xor ecx, ecx
2:
    mov eax, ecx
    shl eax, 12
    add eax, offset hv_boot_pd
    or eax, 3
    mov dword ptr [hv_boot_pdpt + ecx * 8], eax
    mov dword ptr [hv_boot_pdpt + ecx * 8 + 4], 0
    inc ecx
    cmp ecx, 4
    jb 2b

    /* 2048 PD entries of 2 MiB: present | writable | large */
    xor ecx, ecx
3:
    mov eax, ecx
    shl eax, 21
    or eax, 0x83
    mov dword ptr [hv_boot_pd + ecx * 8], eax
    mov dword ptr [hv_boot_pd + ecx * 8 + 4], 0
    inc ecx
    cmp ecx, 2048
    jb 3b

    /* CR4.PAE, CR3, EFER.LME, then CR0.PG | CR0.PE */
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, offset hv_boot_pml4
    mov cr3, eax
    mov ebx, edi
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov edi, ebx
    mov eax, cr0
    or eax, 0x80000001
    mov cr0, eax

    lgdt [hv_boot_gdt_ptr]
    mov eax, 0x08
    push eax
    mov eax, offset hv_start64
    push eax
    retf

    .code64
hv_start64:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    xor eax, eax
    mov fs, ax
    mov gs, ax
    mov rsp, offset hv_boot_stack_top
    mov edi, edi
    mov esi, esi
    xor ebp, ebp
    call hv_entry64
4:
    cli
    hlt
    jmp 4b

    .section .rodata.boot, "a"
    .balign 16
hv_boot_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
hv_boot_gdt_ptr:
    .word 23
    .long hv_boot_gdt

    .section .bss.boot, "aw", @nobits
    .balign 4096
hv_boot_pml4:
    .skip 4096
hv_boot_pdpt:
    .skip 4096
hv_boot_pd:
    .skip 4 * 4096
    /* Root's stack, with a page of its own under it that the hypervisor
       unmaps (see `stack_guard`): an overflow faults there instead of
       running into the page directory. */
    .balign 4096
    .global hv_boot_stack_guard
hv_boot_stack_guard:
    .skip 4096
hv_boot_stack:
    .skip {stack_size}
    .global hv_boot_stack_top
hv_boot_stack_top:

    .text
    "#,
    magic = const MULTIBOOT_HEADER_MAGIC,
    flags = const MULTIBOOT_HEADER_FLAGS,
    stack_size = const STACK_SIZE,
    checksum = const (0u32.wrapping_sub(MULTIBOOT_HEADER_MAGIC.wrapping_add(MULTIBOOT_HEADER_FLAGS))),
);
