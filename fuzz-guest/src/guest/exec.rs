//! Running one instruction under the recovery point: `fz_exec` loads the
//! registers, calls a stub (a few instructions and `ret`, or any address
//! at all), and stores the registers back, whether the stub returned or a
//! fault resumed at the recovery label. This module owns the program's
//! instruction stubs.

use crate::percpu::{RECOVER_RIP, RECOVER_RSP, STACK_SIZE};

/// The registers a stub sees and leaves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Regs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
}

core::arch::global_asm!(
    r#"
    .text
    .global fz_exec
fz_exec:
    push rbx
    push rbp
    push r12
    push r13
    push r14
    push r15
    push rdi
    mov rax, rsp
    and rax, -{stack}
    lea rcx, [rip + 1f]
    mov qword ptr [rax + {rip}], rcx
    mov qword ptr [rax + {rsp}], rsp
    mov r11, rsi
    mov rax, qword ptr [rdi]
    mov rbx, qword ptr [rdi + 8]
    mov rcx, qword ptr [rdi + 16]
    mov rdx, qword ptr [rdi + 24]
    mov rsi, qword ptr [rdi + 32]
    mov rdi, qword ptr [rdi + 40]
    call r11
1:
    xchg rdi, qword ptr [rsp]
    mov qword ptr [rdi], rax
    mov qword ptr [rdi + 8], rbx
    mov qword ptr [rdi + 16], rcx
    mov qword ptr [rdi + 24], rdx
    mov qword ptr [rdi + 32], rsi
    pop rax
    mov qword ptr [rdi + 40], rax
    mov rax, rsp
    and rax, -{stack}
    mov qword ptr [rax + {rip}], 0
    pop r15
    pop r14
    pop r13
    pop r12
    pop rbp
    pop rbx
    ret

    /* The same, with the target jumped to on a sacrificial stack (rdx:
       its top) instead of called: for foreign code, which may pop, return
       or switch stacks anywhere. It only ends by a fault. */
    .global fz_exec_foreign
fz_exec_foreign:
    push rbx
    push rbp
    push r12
    push r13
    push r14
    push r15
    push rdi
    mov rax, rsp
    and rax, -{stack}
    lea rcx, [rip + 1b]
    mov qword ptr [rax + {rip}], rcx
    mov qword ptr [rax + {rsp}], rsp
    mov r11, rsi
    mov rsp, rdx
    xor eax, eax
    xor ebx, ebx
    xor ecx, ecx
    xor edx, edx
    xor esi, esi
    xor edi, edi
    xor ebp, ebp
    xor r8d, r8d
    xor r9d, r9d
    xor r10d, r10d
    xor r12d, r12d
    xor r13d, r13d
    xor r14d, r14d
    xor r15d, r15d
    jmp r11

    .global fz_s_cpuid
fz_s_cpuid: cpuid
    ret
    .global fz_s_rdmsr
fz_s_rdmsr: rdmsr
    ret
    .global fz_s_wrmsr
fz_s_wrmsr: wrmsr
    ret
    .global fz_s_in8
fz_s_in8: in al, dx
    ret
    .global fz_s_in16
fz_s_in16: in ax, dx
    ret
    .global fz_s_in32
fz_s_in32: in eax, dx
    ret
    .global fz_s_out8
fz_s_out8: out dx, al
    ret
    .global fz_s_out16
fz_s_out16: out dx, ax
    ret
    .global fz_s_out32
fz_s_out32: out dx, eax
    ret
    .global fz_s_rdcr0
fz_s_rdcr0: mov rax, cr0
    ret
    .global fz_s_wrcr0
fz_s_wrcr0: mov cr0, rax
    ret
    .global fz_s_rdcr3
fz_s_rdcr3: mov rax, cr3
    ret
    .global fz_s_wrcr3
fz_s_wrcr3: mov cr3, rax
    ret
    .global fz_s_rdcr4
fz_s_rdcr4: mov rax, cr4
    ret
    .global fz_s_wrcr4
fz_s_wrcr4: mov cr4, rax
    ret
    .global fz_s_xsetbv
fz_s_xsetbv: xsetbv
    ret
    .global fz_s_xgetbv
fz_s_xgetbv: xgetbv
    ret
    .global fz_s_invlpg
fz_s_invlpg: invlpg [rax]
    ret
    .global fz_s_invpcid
fz_s_invpcid: invpcid rax, [rbx]
    ret
    .global fz_s_st8
fz_s_st8: mov byte ptr [rdi], al
    ret
    .global fz_s_st16
fz_s_st16: mov word ptr [rdi], ax
    ret
    .global fz_s_st32
fz_s_st32: mov dword ptr [rdi], eax
    ret
    .global fz_s_st64
fz_s_st64: mov qword ptr [rdi], rax
    ret
    .global fz_s_st32imm
fz_s_st32imm: mov dword ptr [rdi], 0x5A5AA5A5
    ret
    .global fz_s_xchg32
fz_s_xchg32: xchg dword ptr [rdi], eax
    ret
    .global fz_s_ld8
fz_s_ld8: movzx eax, byte ptr [rdi]
    ret
    .global fz_s_ld16
fz_s_ld16: movzx eax, word ptr [rdi]
    ret
    .global fz_s_ld32
fz_s_ld32: mov eax, dword ptr [rdi]
    ret
    .global fz_s_ld64
fz_s_ld64: mov rax, qword ptr [rdi]
    ret
    .global fz_s_step
fz_s_step: pushfq
    or qword ptr [rsp], 0x100
    popfq
    nop
    nop
    ret
    .global fz_s_ud2
fz_s_ud2: ud2
    .global fz_s_div
fz_s_div: xor edx, edx
    xor eax, eax
    xor ecx, ecx
    div rcx
    ret
    .global fz_s_int3
fz_s_int3: int3
    ret
    .global fz_s_hlt
fz_s_hlt: sti
    hlt
    cli
    ret
    .global fz_s_sti
fz_s_sti: sti
    nop
    nop
    cli
    ret
    .balign 4
    .global fz_s_softint
fz_s_softint:
    .set fz_n, 0x30
    .rept 16
    .balign 4
    .byte 0xCD, fz_n
    ret
    .set fz_n, fz_n + 1
    .endr
    .balign 8
    .global fz_s_wrdr
fz_s_wrdr:
    mov dr0, rax
    ret
    .balign 8
    mov dr1, rax
    ret
    .balign 8
    mov dr2, rax
    ret
    .balign 8
    mov dr3, rax
    ret
    .balign 8
    mov dr4, rax
    ret
    .balign 8
    mov dr5, rax
    ret
    .balign 8
    mov dr6, rax
    ret
    .balign 8
    mov dr7, rax
    ret
    .balign 8
    .global fz_s_rddr
fz_s_rddr:
    mov rax, dr0
    ret
    .balign 8
    mov rax, dr1
    ret
    .balign 8
    mov rax, dr2
    ret
    .balign 8
    mov rax, dr3
    ret
    .balign 8
    mov rax, dr4
    ret
    .balign 8
    mov rax, dr5
    ret
    .balign 8
    mov rax, dr6
    ret
    .balign 8
    mov rax, dr7
    ret

    /* A hardware task switch, from legacy protected mode: compatibility
       mode, paging off (IA-32e off), TR = task 1's TSS (rbx), then JMP
       (rax = 0) or CALL to task 2's TSS (rcx), and back: paging on, 64-bit
       code. Task 2 stores its registers on its stack and returns by IRET
       when it was called (NT), else by a JMP through the far pointer at
       its initial stack top. */
    .global fz_s_task
fz_s_task:
    sub rsp, 16
    mov dword ptr [rsp], 0
    mov word ptr [rsp + 4], cx
    mov esi, eax
    jmp fword ptr [rip + fz_task32_ptr]
    .code32
fz_task32:
    mov eax, cr0
    and eax, 0x7FFFFFFF
    mov cr0, eax
    ltr bx
    test esi, esi
    jnz 2f
    jmp fword ptr [esp]
    jmp 3f
2:
    call fword ptr [esp]
3:
    mov eax, cr0
    or eax, 0x80000000
    mov cr0, eax
    .byte 0xEA
    .long fz_task_back64
    .word 0x08
    .global fz_task2_entry
fz_task2_entry:
    pushfd
    push eax
    push ecx
    push edx
    push ebx
    push esi
    push edi
    push ebp
    test dword ptr [esp + 28], 0x4000
    jnz 4f
    jmp fword ptr [esp + 32]
4:
    iretd
    .code64
fz_task_back64:
    mov esp, esp
    add rsp, 16
    ret
    .balign 8
fz_task32_ptr:
    .long fz_task32
    .word 0x18

    /* Far jumps into compatibility mode and back. */
    .global fz_s_far32
fz_s_far32:
    jmp fword ptr [rip + fz_far32_ptr]
    .code32
fz_compat32:
    xor ecx, ecx
    cpuid
    .byte 0xEA
    .long fz_back64
    .word 0x08
    .code64
fz_back64:
    ret
    .global fz_s_far16
fz_s_far16:
    jmp fword ptr [rip + fz_far16_ptr]
    .balign 16
    .global fz_code16
fz_code16:
    .code16
    xor ecx, ecx
    cpuid
    .byte 0x66, 0xEA
    .long fz_back64
    .word 0x08
    .code64
    .balign 8
fz_far32_ptr:
    .long fz_compat32
    .word 0x18
    .balign 8
fz_far16_ptr:
    .long 0
    .word 0x20
"#,
    stack = const STACK_SIZE,
    rip = const RECOVER_RIP,
    rsp = const RECOVER_RSP,
);

extern "C" {
    fn fz_exec(regs: *mut Regs, target: u64);
    fn fz_exec_foreign(regs: *mut Regs, target: u64, stack_top: u64);
    pub fn fz_s_cpuid();
    pub fn fz_s_rdmsr();
    pub fn fz_s_wrmsr();
    pub fn fz_s_in8();
    pub fn fz_s_in16();
    pub fn fz_s_in32();
    pub fn fz_s_out8();
    pub fn fz_s_out16();
    pub fn fz_s_out32();
    pub fn fz_s_rdcr0();
    pub fn fz_s_wrcr0();
    pub fn fz_s_rdcr3();
    pub fn fz_s_wrcr3();
    pub fn fz_s_rdcr4();
    pub fn fz_s_wrcr4();
    pub fn fz_s_xsetbv();
    pub fn fz_s_xgetbv();
    pub fn fz_s_invlpg();
    pub fn fz_s_invpcid();
    pub fn fz_s_st8();
    pub fn fz_s_st16();
    pub fn fz_s_st32();
    pub fn fz_s_st64();
    pub fn fz_s_st32imm();
    pub fn fz_s_xchg32();
    pub fn fz_s_ld8();
    pub fn fz_s_ld16();
    pub fn fz_s_ld32();
    pub fn fz_s_ld64();
    pub fn fz_s_step();
    pub fn fz_s_ud2();
    pub fn fz_s_div();
    pub fn fz_s_int3();
    pub fn fz_s_hlt();
    pub fn fz_s_sti();
    pub fn fz_s_softint();
    pub fn fz_s_wrdr();
    pub fn fz_s_rddr();
    pub fn fz_s_far32();
    pub fn fz_s_far16();
    pub fn fz_s_task();
    pub static fz_task2_entry: u8;
    pub static fz_code16: u8;
}

/// The address of a stub.
pub fn stub(f: unsafe extern "C" fn()) -> u64 {
    f as usize as u64
}

/// What one guarded call came to.
#[derive(Clone, Copy, Debug)]
pub struct Done {
    /// The registers after it.
    pub regs: Regs,
    /// The fault that ended it: (vector, error code, CR2 or DR6).
    pub fault: Option<(u8, u64, u64)>,
}

/// What a guarded call came to: its registers, and the fault the handler
/// recorded, if one came (`vector` was 0xFF before the call).
fn done(regs: Regs) -> Done {
    let pc = crate::percpu::this();
    let fault = (pc.vector != 0xFF).then_some((pc.vector as u8, pc.error, pc.addr));
    Done { regs, fault }
}

/// Runs the code at `target` with `regs` under the recovery point.
pub fn run(target: u64, mut regs: Regs) -> Done {
    let pc = crate::percpu::this();
    pc.vector = 0xFF;
    // SAFETY: `fz_exec` saves the callee-saved registers, arms the
    // recovery point, calls `target` and restores everything; a fault in
    // the target resumes at the recovery label on the same stack. Each
    // target is a stub of this module, or an address chosen to fault.
    unsafe { fz_exec(&mut regs, target) };
    done(regs)
}

/// Jumps to foreign code at `target` (root's trampolines) on this vCPU's
/// sacrificial stack, every register 0, until it faults.
///
/// The task priority is at its highest (CR8 = 15) while the foreign code
/// runs, so that the local APIC holds every fixed interrupt until it is
/// back where it was. That code may load RFLAGS from anywhere: entered at
/// its `popfq` with RSP in the first page it popped a real-mode vector
/// (0xF000FF53: IF and TF set), and another vCPU's IPI was then taken on
/// a stack near address 0. Its delivery faulted, as it would on any CPU,
/// the interrupt stayed in service without its handler, and the vCPU
/// later waited forever for one of its own. NMIs and exceptions have
/// stacks of their own (IST) and are recorded as before.
///
/// What that code can reach is the fill: it starts with RSP in the middle
/// of the sacrificial stack (4 KiB of fill either way) and every general
/// register 0, and the first 2 MiB are not mapped (`boot::guard_null`).
/// Started near the top, popping a saved frame took it past the fill into
/// zeros, and its RET went to address 0: the real-mode vectors ran as
/// code, or a return address left further up sent it into the program's
/// boot code (found by the long runs on two vCPUs under fire as a read of
/// root's AP page, a triple fault and a stall).
///
/// It may also halt with IF clear or loop: with more than one vCPU, one
/// whose stream ended names this one as stalled and sends an NMI, whose
/// handler takes it back to the recovery point (`traps::stalled`).
pub fn run_foreign(target: u64) -> Done {
    let pc = crate::percpu::this();
    pc.vector = 0xFF;
    let block = pc as *mut _ as u64;
    let low = block + (crate::percpu::SACRIFICIAL - crate::percpu::SACRIFICIAL_LEN) as u64;
    for i in 0..crate::percpu::SACRIFICIAL_LEN as u64 / 8 {
        // SAFETY: the sacrificial part of this vCPU's own stack block.
        unsafe {
            core::ptr::write_volatile((low + 8 * i) as *mut u64, crate::percpu::SACRIFICIAL_FILL)
        };
    }
    let mut regs = Regs::default();
    let tpr: u64;
    // SAFETY: CR8 is this vCPU's own task priority; 15 blocks every fixed
    // interrupt, which stay pending in the APIC (restored below).
    unsafe {
        core::arch::asm!("mov {}, cr8", out(reg) tpr, options(nomem, nostack, preserves_flags));
        core::arch::asm!("mov cr8, {}", in(reg) 15u64, options(nomem, nostack, preserves_flags));
    }
    pc.foreign = 1;
    // SAFETY: as `run`; the target runs on the sacrificial stack with the
    // recovery point armed, and its exceptions land on IST stacks in this
    // vCPU's block: any fault comes back to the recovery label with our
    // stack.
    unsafe {
        fz_exec_foreign(
            &mut regs,
            target,
            block + crate::percpu::SACRIFICIAL as u64 - crate::percpu::SACRIFICIAL_LEN as u64 / 2,
        )
    };
    crate::percpu::this().foreign = 0;
    // SAFETY: the task priority it had before.
    unsafe {
        core::arch::asm!("mov cr8, {}", in(reg) tpr, options(nomem, nostack, preserves_flags))
    };
    done(regs)
}

/// Points the 16-bit code segment (GDT entry 4) at `fz_code16` (the far
/// pointer's offset is 0).
pub fn init_code16() {
    // SAFETY: only the address of the code is taken.
    let base = core::ptr::addr_of!(fz_code16) as u64;
    let desc = 0x0000_9A00_0000_FFFFu64 | (base & 0xFF_FFFF) << 16 | ((base >> 24) & 0xFF) << 56;
    // SAFETY: the boot CPU patches the GDT before any vCPU uses entry 4.
    unsafe {
        let gdt = core::ptr::addr_of_mut!(crate::boot::fz_gdt);
        (*gdt)[4] = desc;
    }
}
