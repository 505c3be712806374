//! The two entries of the bzImage and the AP start-up code, all in one
//! `global_asm!`, with the descriptor tables and page tables they build.
//!
//! - `fz_entry32` (offset 0): GRUB's 32-bit boot protocol, flat protected
//!   mode, paging off, `boot_params` in ESI.
//! - `fz_entry64` (offset 0x200): root's 64-bit boot protocol, long mode on
//!   the loader's identity map, `boot_params` in RSI.
//! - `fz_ap16`: copied below 1 MiB; an AP's SIPI lands there in real mode.
//!
//! Both entries copy the image to its link address if it was loaded
//! elsewhere, zero the bss, build the program's own page tables (the low
//! 8 GiB identity-mapped with 2 MiB pages, the scratch region with 4 KiB
//! pages) and its GDT, and call `fz_main(boot_params, cpu 0)`.

use crate::percpu::STACK_SIZE;

core::arch::global_asm!(
    r#"
    .section .text.entry, "ax"
    .code32
    .global fz_entry32
fz_entry32:
    cli
    cld
    /* code32_start in boot_params holds where GRUB put us. */
    mov eax, dword ptr [esi + 0x214]
    mov edi, offset __image_start
    cmp eax, edi
    je 1f
    mov ebx, esi
    mov esi, eax
    mov ecx, offset __image_end
    sub ecx, edi
    rep movsb
    mov esi, ebx
1:
    mov eax, offset fz_high32
    jmp eax

    .balign 0x200, 0xCC
    .code64
    .global fz_entry64
fz_entry64:
    cli
    cld
    lea rax, [rip + fz_entry32]
    mov rdi, offset __image_start
    cmp rax, rdi
    je 1f
    mov rbx, rsi
    mov rsi, rax
    mov rcx, offset __image_end
    sub rcx, rdi
    rep movsb
    mov rsi, rbx
1:
    mov rax, offset fz_high64
    jmp rax

    .code32
fz_high32:
    mov ebx, esi
    mov edi, offset __bss_start
    mov ecx, offset __bss_end
    sub ecx, edi
    xor eax, eax
    rep stosb
    mov esi, ebx
    call fz_tables32
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, offset fz_pml4
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    or eax, 0x80000001
    mov cr0, eax
    lgdt [fz_gdt_ptr]
    push 0x08
    mov eax, offset fz_long
    push eax
    retf

    /* Builds the page tables (32-bit code, paging off). */
fz_tables32:
    mov eax, offset fz_pdpt
    or eax, 3
    mov dword ptr [fz_pml4], eax
    mov eax, offset fz_pml4_copy
    mov edx, offset fz_pdpt
    or edx, 3
    mov dword ptr [eax], edx
    xor ecx, ecx
2:
    mov eax, ecx
    shl eax, 12
    add eax, offset fz_pd
    or eax, 3
    mov dword ptr [fz_pdpt + ecx * 8], eax
    inc ecx
    cmp ecx, 8
    jb 2b
    /* 4096 entries of 2 MiB: 8 GiB. */
    xor ecx, ecx
3:
    mov eax, ecx
    shl eax, 21
    or eax, 0x83
    mov dword ptr [fz_pd + ecx * 8], eax
    mov eax, ecx
    shr eax, 11
    mov dword ptr [fz_pd + ecx * 8 + 4], eax
    inc ecx
    cmp ecx, 4096
    jb 3b
    /* The scratch region: 512 pages of 4 KiB. */
    xor ecx, ecx
4:
    mov eax, ecx
    shl eax, 12
    add eax, {scratch}
    or eax, 3
    mov dword ptr [fz_scratch_pt + ecx * 8], eax
    inc ecx
    cmp ecx, 512
    jb 4b
    mov eax, offset fz_scratch_pt
    or eax, 3
    mov dword ptr [fz_pd + ({scratch} >> 21) * 8], eax
    ret

    .code64
fz_long:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    xor eax, eax
    mov fs, ax
    mov gs, ax
    mov rsp, offset fz_stacks + {stack}
    mov edi, esi
    xor esi, esi
    call fz_main
5:
    cli
    hlt
    jmp 5b

fz_high64:
    mov rbx, rsi
    mov rdi, offset __bss_start
    mov rcx, offset __bss_end
    sub rcx, rdi
    xor eax, eax
    rep stosb
    mov rsi, rbx
    /* The same tables, built in 64-bit code on the loader's map. */
    lea rax, [rip + fz_pdpt]
    or rax, 3
    mov qword ptr [rip + fz_pml4], rax
    mov qword ptr [rip + fz_pml4_copy], rax
    xor ecx, ecx
6:
    mov rax, rcx
    shl rax, 12
    lea rdx, [rip + fz_pd]
    add rax, rdx
    or rax, 3
    lea rdx, [rip + fz_pdpt]
    mov qword ptr [rdx + rcx * 8], rax
    inc ecx
    cmp ecx, 8
    jb 6b
    xor ecx, ecx
    lea rdx, [rip + fz_pd]
7:
    mov rax, rcx
    shl rax, 21
    or rax, 0x83
    mov qword ptr [rdx + rcx * 8], rax
    inc ecx
    cmp ecx, 4096
    jb 7b
    xor ecx, ecx
    lea rdx, [rip + fz_scratch_pt]
8:
    mov rax, rcx
    shl rax, 12
    add rax, {scratch}
    or rax, 3
    mov qword ptr [rdx + rcx * 8], rax
    inc ecx
    cmp ecx, 512
    jb 8b
    lea rax, [rip + fz_scratch_pt]
    or rax, 3
    lea rdx, [rip + fz_pd]
    mov qword ptr [rdx + ({scratch} >> 21) * 8], rax
    /* Our CR3, our GDT, then a far return into our code segment. */
    mov rax, cr4
    or rax, 0x20
    mov cr4, rax
    lea rax, [rip + fz_pml4]
    mov cr3, rax
    lgdt [rip + fz_gdt_ptr]
    push 0x08
    lea rax, [rip + fz_long]
    push rax
    retfq

    /* An AP's start: real mode at fz_ap16's copy (page-aligned below
       1 MiB, the copy's segment in CS), then the boot CPU's tables. The
       copy's last 16 bytes hold the stack top and the CPU index. */
    .code16
    .balign 16
    .global fz_ap16
fz_ap16:
    cli
    cld
    mov ax, cs
    mov ds, ax
    /* Patch the 32-bit far pointer with the copy's linear address. */
    xor ebx, ebx
    mov bx, ax
    shl ebx, 4
    lea eax, [ebx + FZ_AP32_OFF]
    mov dword ptr [FZ_AP_FAR_OFF], eax
    lea eax, [ebx + FZ_AP_GDT_OFF]
    mov dword ptr [FZ_AP_GDTP_OFF + 2], eax
    lgdt [FZ_AP_GDTP_OFF]
    mov eax, cr0
    or eax, 1
    mov cr0, eax
    .byte 0x66, 0xFF, 0x2E
    .word FZ_AP_FAR_OFF
    .code32
fz_ap32:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov eax, cr4
    or eax, 0x20
    mov cr4, eax
    mov eax, offset fz_pml4
    mov cr3, eax
    mov ecx, 0xC0000080
    rdmsr
    or eax, 0x100
    wrmsr
    mov eax, cr0
    or eax, 0x80000001
    mov cr0, eax
    lgdt [fz_gdt_ptr]
    /* ebx: the copy's base, where the boot CPU left the stack and index. */
    mov esp, dword ptr [ebx + {ap_stack}]
    mov esi, dword ptr [ebx + {ap_cpu}]
    push 0x08
    mov eax, offset fz_ap_long
    push eax
    retf
    .balign 8
fz_ap_far:
    .long 0
    .word 0x18
    .balign 8
fz_ap_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF
    .quad 0x00CF92000000FFFF
    .quad 0x00CF9A000000FFFF
fz_ap_gdt_ptr:
    .word 31
    .long 0
    .global fz_ap16_end
fz_ap16_end:
    .set FZ_AP32_OFF, fz_ap32 - fz_ap16
    .set FZ_AP_FAR_OFF, fz_ap_far - fz_ap16
    .set FZ_AP_GDT_OFF, fz_ap_gdt - fz_ap16
    .set FZ_AP_GDTP_OFF, fz_ap_gdt_ptr - fz_ap16

    .code64
fz_ap_long:
    mov ax, 0x10
    mov ds, ax
    mov es, ax
    mov ss, ax
    xor eax, eax
    mov fs, ax
    mov gs, ax
    mov esp, esp
    mov esi, esi
    xor edi, edi
    call fz_main
9:
    cli
    hlt
    jmp 9b

    .section .data.gdt, "aw"
    .balign 16
    .global fz_gdt
fz_gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF  /* 0x08 64-bit code */
    .quad 0x00CF92000000FFFF  /* 0x10 data */
    .quad 0x00CF9A000000FFFF  /* 0x18 32-bit code */
    .quad 0x00009A000000FFFF  /* 0x20 16-bit code (base patched) */
    .quad 0x000092000000FFFF  /* 0x28 16-bit data */
    .quad 0, 0, 0, 0          /* 0x30.. one TSS (16 bytes) per vCPU */
    .quad 0, 0, 0, 0
    .quad 0, 0, 0, 0          /* 0x70.. two 32-bit TSSs per vCPU (the */
    .quad 0, 0, 0, 0          /* task-switch operation's) */
fz_gdt_end:
    .global fz_gdt_ptr
fz_gdt_ptr:
    .word fz_gdt_end - fz_gdt - 1
    .quad fz_gdt

    .section .bss.tables, "aw", @nobits
    .balign 4096
    .global fz_pml4
fz_pml4:
    .skip 4096
    .global fz_pml4_copy
fz_pml4_copy:
    .skip 4096
fz_pdpt:
    .skip 4096
    .global fz_pd
fz_pd:
    .skip 8 * 4096
    .global fz_scratch_pt
fz_scratch_pt:
    .skip 4096
    .global fz_pdpt_hi
fz_pdpt_hi:
    .skip 4096
    .global fz_pd_hi
fz_pd_hi:
    .skip 4096
    .balign {stack}
    .global fz_stacks
fz_stacks:
    .skip {stack} * {max_cpus}

    .text
    "#,
    scratch = const fuzz_guest::SCRATCH_BASE,
    stack = const STACK_SIZE,
    max_cpus = const fuzz_guest::MAX_CPUS,
    ap_stack = const AP_STACK_SLOT,
    ap_cpu = const AP_CPU_SLOT,
);

/// Where, from the start of the AP page, the boot CPU leaves the next AP's
/// stack top (u32).
pub const AP_STACK_SLOT: usize = 0xFF0;
/// Where it leaves the next AP's index (u32).
pub const AP_CPU_SLOT: usize = 0xFF4;

extern "C" {
    pub static fz_entry32: u8;
    pub static fz_ap16: u8;
    pub static fz_ap16_end: u8;
    pub static mut fz_gdt: [u64; 22];
    pub static mut fz_pml4_copy: [u64; 512];
    pub static mut fz_pd: [u64; 4096];
    pub static mut fz_scratch_pt: [u64; 512];
    pub static mut fz_pml4: [u64; 512];
    pub static mut fz_pdpt_hi: [u64; 512];
    pub static mut fz_pd_hi: [u64; 512];
    pub static mut fz_stacks: u8;
}

/// Unmaps the first 2 MiB once every vCPU runs (each flushes its TLB as
/// it starts its stream): nothing of the program lies there after its
/// start, and a jump to a null or small address faults at once, where
/// the real-mode vectors would otherwise run as code.
pub fn guard_null() {
    // SAFETY: the program's own page directory; entry 0 maps [0, 2 MiB),
    // which it no longer uses (the APs came in through their start page
    // there and are in `fz_main`).
    unsafe { (*core::ptr::addr_of_mut!(fz_pd))[0] = 0 };
    flush_tlb();
}

/// Drops this vCPU's TLB (no entry of the program's is global).
pub fn flush_tlb() {
    // SAFETY: CR3 written with its own value.
    unsafe { core::arch::asm!("mov {t}, cr3", "mov cr3, {t}", t = out(reg) _, options(nostack)) };
}

/// Where the boot code lies: both entries and the boot CPU's way into
/// `fz_main` (up to the APs' start code, which stays).
pub fn boot_code() -> core::ops::Range<u64> {
    core::ptr::addr_of!(fz_entry32) as u64..core::ptr::addr_of!(fz_ap16) as u64
}

/// Fills the boot code with INT3 once every vCPU runs: no operation may
/// reach it, and one that did would run it in 64-bit mode, wiping the
/// program's tables and GDT (a triple fault, with nothing left to tell
/// why). The trap handler names what reached it instead.
pub fn trip_wire() {
    let code = boot_code();
    for a in code {
        // SAFETY: the boot code, finished: the boot CPU runs in `fz_main`
        // and the APs came in through `fz_ap16`, outside this range. The
        // identity map is writable.
        unsafe { core::ptr::write_volatile(a as *mut u8, 0xCC) };
    }
}

extern "C" {
    static __image_start: u8;
    static __bss_end: u8;
}

/// The program's memory: its image and its bss.
pub fn image() -> core::ops::Range<u64> {
    core::ptr::addr_of!(__image_start) as u64..core::ptr::addr_of!(__bss_end) as u64
}
