//! The program's hooked part, at kernel-text addresses: four functions that
//! start with the ftrace NOP5, as a kernel's do, a data word in their own
//! page, a `linux_banner`, and room for the kallsyms tables the host writes
//! in after linking. With these root's introspection finds the program as
//! it finds a kernel (from IA32_LSTAR, which points at `_stext`), and the
//! host can hook the functions while the program calls, reads and writes
//! their page.

use fuzz_guest::{HOOKED_LMA, HOOKED_VMA, KALLSYMS_ROOM};

core::arch::global_asm!(
    r#"
    .section .hooked.text, "ax"
    .balign 4096
    .global fz_stext
fz_stext:
    /* The text's first bytes are no function's (so a hit names its
       function, not _stext). */
    .skip 16, 0xCC
    /* 3 * arg + 1 */
    .global fz_hook_0
fz_hook_0:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
    lea rax, [rdi + rdi * 2]
    inc rax
    ret

    /* two nested calls of fz_hook_0, xor the argument */
    .balign 16
    .global fz_hook_1
fz_hook_1:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
    push rbx
    mov rbx, rdi
    call fz_hook_0
    mov rdi, rax
    call fz_hook_0
    xor rax, rbx
    pop rbx
    ret

    /* recursion: 1 + the sum of arg, arg - 1, ..., 1 (arg < 8) */
    .balign 16
    .global fz_hook_2
fz_hook_2:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
    test rdi, rdi
    jz 1f
    push rdi
    dec rdi
    call fz_hook_2
    pop rdi
    add rax, rdi
    ret
1:
    mov eax, 1
    ret

    /* adds arg to the data word in its own page, returns the sum */
    .balign 16
    .global fz_hook_3
fz_hook_3:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
    mov rax, qword ptr [rip + fz_hook_word]
    add rax, rdi
    mov qword ptr [rip + fz_hook_word], rax
    ret

    .balign 16
    .global fz_hook_word
fz_hook_word:
    .quad 0
    .global fz_hook_spare
fz_hook_spare:
    .quad 0
    .global fz_etext
fz_etext:
    .balign 4096

    .section .hooked.data, "aw"
    .balign 4096
    .global fz_linux_banner
fz_linux_banner:
    .asciz "Linux version 0.0.0-fuzz-guest (the hvtrace fuzzing guest)\n"
    .balign 4096
    .global fz_kallsyms
fz_kallsyms:
    .skip {room}
    .global fz_hooked_end
fz_hooked_end:
"#,
    room = const KALLSYMS_ROOM,
);

/// The addresses of the hooked part's symbols. The low image cannot name
/// them RIP-relative (they are over 2 GiB away): each is an absolute
/// 64-bit immediate.
macro_rules! high {
    ($name:literal) => {{
        let a: u64;
        // SAFETY: loads a link-time constant.
        unsafe { core::arch::asm!(concat!("movabs {}, offset ", $name), out(reg) a, options(nomem, nostack, pure)) };
        a
    }};
}

/// The hooked part's size.
pub fn len() -> u64 {
    high!("fz_hooked_end") - high!("fz_stext")
}

/// Maps the hooked part (2 MiB at `HOOKED_LMA`) at `HOOKED_VMA` in both
/// top tables, leaving the rest of that page directory empty: root takes
/// its highest empty entry for its trampolines.
pub fn map() {
    let pml4_index = ((HOOKED_VMA >> 39) & 0x1FF) as usize;
    let pdpt_index = ((HOOKED_VMA >> 30) & 0x1FF) as usize;
    let pd_index = ((HOOKED_VMA >> 21) & 0x1FF) as usize;
    // SAFETY: the boot CPU fills the program's own high tables before any
    // AP starts and before anything runs at the high addresses; the low
    // identity map that runs this code is not touched.
    unsafe {
        let pdpt = core::ptr::addr_of_mut!(crate::boot::fz_pdpt_hi);
        let pd = core::ptr::addr_of_mut!(crate::boot::fz_pd_hi);
        (*pd)[pd_index] = HOOKED_LMA | 0x83;
        (*pdpt)[pdpt_index] = pd as u64 | 3;
        (*core::ptr::addr_of_mut!(crate::boot::fz_pml4))[pml4_index] = pdpt as u64 | 3;
        (*core::ptr::addr_of_mut!(crate::boot::fz_pml4_copy))[pml4_index] = pdpt as u64 | 3;
        core::arch::asm!("mov {t}, cr3", "mov cr3, {t}", t = out(reg) _, options(nostack));
    }
}

/// Points IA32_LSTAR at `_stext`, where root's introspection starts.
pub fn set_lstar() {
    let at = high!("fz_stext");
    // SAFETY: the program never executes SYSCALL; LSTAR only tells root
    // where the "kernel" is.
    unsafe {
        core::arch::asm!("wrmsr", in("ecx") 0xC000_0082u32, in("eax") at as u32, in("edx") (at >> 32) as u32, options(nostack));
    }
}

/// Calls hooked function `f` (0..=3) with `arg`.
pub fn call(f: u8, arg: u64) -> u64 {
    let ret: u64;
    // SAFETY: the functions follow the C ABI and touch only their own
    // word; they run at their high addresses, through an absolute call
    // (out of a rel32's reach from the low image).
    unsafe {
        match f & 3 {
            0 => {
                core::arch::asm!("movabs rax, offset fz_hook_0", "call rax", inout("rdi") arg => _, out("rax") ret, clobber_abi("C"))
            }
            1 => {
                core::arch::asm!("movabs rax, offset fz_hook_1", "call rax", inout("rdi") arg => _, out("rax") ret, clobber_abi("C"))
            }
            2 => {
                core::arch::asm!("movabs rax, offset fz_hook_2", "call rax", inout("rdi") arg & 7 => _, out("rax") ret, clobber_abi("C"))
            }
            _ => {
                core::arch::asm!("movabs rax, offset fz_hook_3", "call rax", inout("rdi") arg => _, out("rax") ret, clobber_abi("C"))
            }
        }
    }
    ret
}

/// Reads 8 bytes of the hooked text at `offset` (its code included).
pub fn read(offset: u16) -> u64 {
    let at = high!("fz_stext") + u64::from(offset % (4096 - 8));
    // SAFETY: inside the hooked text page, mapped and readable.
    unsafe { core::ptr::read_unaligned(at as *const u64) }
}

/// Writes the spare word in the hooked text page and reads it back.
pub fn write(value: u64) -> u64 {
    let p = high!("fz_hook_spare") as *mut u64;
    // SAFETY: the program's own word, in the hooked page (mapped writable).
    unsafe {
        core::ptr::write_volatile(p, value);
        core::ptr::read_volatile(p)
    }
}

/// The data word `fz_hook_3` adds to.
pub fn word() -> u64 {
    let p = high!("fz_hook_word") as *const u64;
    // SAFETY: read of the program's own word.
    unsafe { core::ptr::read_volatile(p) }
}
