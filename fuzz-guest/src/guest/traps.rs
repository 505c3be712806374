//! The IDT and the one handler behind it.
//!
//! Exceptions and software interrupts during an operation resume at the
//! operation's recovery point with the vector, error code and CR2/DR6
//! recorded. NMIs and external interrupts are counted and return. A fault
//! outside an operation is a bug in the program: it prints it and stops.

use crate::percpu;
use crate::{apic, serial};

core::arch::global_asm!(
    r#"
    .text
    .balign 16
    .global fz_isr_table
fz_isr_table:
    .set fz_i, 0
    .rept 256
    .balign 16
    .if (fz_i == 8) || (fz_i == 10) || (fz_i == 11) || (fz_i == 12) || (fz_i == 13) || (fz_i == 14) || (fz_i == 17) || (fz_i == 21) || (fz_i == 29) || (fz_i == 30)
    .byte 0x6A, fz_i
    .else
    .byte 0x6A, 0
    .byte 0x6A, fz_i
    .endif
    jmp fz_isr_common
    .set fz_i, fz_i + 1
    .endr

fz_isr_common:
    push rax
    push rbx
    push rcx
    push rdx
    push rsi
    push rdi
    push rbp
    push r8
    push r9
    push r10
    push r11
    push r12
    push r13
    push r14
    push r15
    mov rdi, rsp
    cld
    call fz_trap
    pop r15
    pop r14
    pop r13
    pop r12
    pop r11
    pop r10
    pop r9
    pop r8
    pop rbp
    pop rdi
    pop rsi
    pop rdx
    pop rcx
    pop rbx
    pop rax
    add rsp, 16
    iretq
"#
);

/// What the stubs leave on the stack.
#[repr(C)]
pub struct Frame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rbp: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rbx: u64,
    pub rax: u64,
    pub vector: u64,
    pub error: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

/// Each stub's size in `fz_isr_table` (`.balign 16`).
const STUB: u64 = 16;

/// The IDT: 256 interrupt gates.
static mut IDT: [[u64; 2]; 256] = [[0; 2]; 256];

extern "C" {
    static fz_isr_table: u8;
}

/// A 64-bit TSS: only the interrupt stack table matters here.
#[repr(C, packed(4))]
struct Tss {
    _reserved0: u32,
    _rsp: [u64; 3],
    _reserved1: u64,
    ist: [u64; 7],
    _reserved2: u64,
    _reserved3: u16,
    iomap: u16,
}

const _: () = assert!(core::mem::size_of::<Tss>() == 104);

static mut TSS: [Tss; crate::MAX_CPUS] = [const {
    Tss {
        _reserved0: 0,
        _rsp: [0; 3],
        _reserved1: 0,
        ist: [0; 7],
        _reserved2: 0,
        _reserved3: 0,
        iomap: 104,
    }
}; crate::MAX_CPUS];

/// Gives vCPU `cpu` its TSS with the exception and NMI stacks inside its
/// own stack block (so that a handler finds its state from RSP even when
/// the code it interrupted had lost its stack) and loads it.
pub fn load_tss(cpu: usize) {
    let block = crate::percpu::this() as *mut _ as u64;
    let tss = core::ptr::addr_of_mut!(TSS);
    // SAFETY: this vCPU's own TSS and GDT slot, written before its LTR.
    unsafe {
        (*tss)[cpu].ist[0] = block + crate::percpu::IST_EXCEPTIONS as u64;
        (*tss)[cpu].ist[1] = block + crate::percpu::IST_NMI as u64;
        let base = core::ptr::addr_of!((*tss)[cpu]) as u64;
        let limit = 103u64;
        let low = limit | (base & 0xFF_FFFF) << 16 | 0x89 << 40 | ((base >> 24) & 0xFF) << 56;
        let gdt = core::ptr::addr_of_mut!(crate::boot::fz_gdt);
        (*gdt)[6 + 2 * cpu] = low;
        (*gdt)[7 + 2 * cpu] = base >> 32;
        let sel = (0x30 + 16 * cpu) as u16;
        core::arch::asm!("ltr {0:x}", in(reg) sel, options(nostack));
    }
}

/// Loads vCPU `cpu`'s own TSS again (after the task-switch operation left
/// another in TR): its descriptor made available first, as LTR wants.
pub fn reload_tss(cpu: usize) {
    let gdt = core::ptr::addr_of_mut!(crate::boot::fz_gdt);
    let sel = (0x30 + 16 * cpu) as u16;
    // SAFETY: this vCPU's own descriptor: type 0xB (busy) back to 0x9.
    unsafe {
        (*gdt)[6 + 2 * cpu] &= !(1 << 41);
        core::arch::asm!("ltr {0:x}", in(reg) sel, options(nostack));
    }
}

/// Fills and loads the IDT (each vCPU loads the same table): exceptions
/// and the program's software interrupts on IST1, NMIs on IST2, external
/// interrupts on the stack they come on.
pub fn load() {
    // SAFETY: the table is only the address of the stubs.
    let base = core::ptr::addr_of!(fz_isr_table) as u64;
    let idt = core::ptr::addr_of_mut!(IDT);
    for v in 0..256u64 {
        let at = base + v * STUB;
        let ist: u64 = match v {
            2 => 2,
            0..=0x1F | 0x30..=0x3F => 1,
            _ => 0,
        };
        let low = (at & 0xFFFF)
            | (0x08 << 16)
            | (ist << 32)
            | (0x8E00 << 32)
            | ((at >> 16) & 0xFFFF) << 48;
        let high = at >> 32;
        // SAFETY: in bounds; every vCPU writes the same values.
        unsafe { (*idt)[v as usize] = [low, high] };
    }
    let ptr: [u64; 2] = [(256 * 16 - 1) | (idt as u64) << 16, (idt as u64) >> 48];
    // SAFETY: the IDT is static and filled; the pointer's 10 bytes are read.
    unsafe {
        core::arch::asm!("lidt [{}]", in(reg) ptr.as_ptr().cast::<u8>().add(0), options(nostack))
    };
}

/// The stack's first words at `rsp`, where they lie in the program's memory.
fn stack_top(rsp: u64) -> [u64; 4] {
    let mut top = [0u64; 4];
    let image = crate::boot::image();
    for (i, w) in top.iter_mut().enumerate() {
        let at = rsp.wrapping_add(8 * i as u64);
        if image.contains(&at) && image.contains(&(at + 7)) {
            // SAFETY: inside the program's own image and bss.
            *w = unsafe { core::ptr::read_unaligned(at as *const u64) };
        }
    }
    top
}

/// Prints where a stalled vCPU is: its operation, the interrupted context,
/// and its local APIC's priority and in-service and request bits.
fn stalled(pc: &percpu::PerCpu, frame: &Frame) {
    let mut isr = [0u32; 8];
    let mut irr = [0u32; 8];
    for i in 0..8u32 {
        isr[i as usize] = apic::read(0x100 + 0x10 * i);
        irr[i as usize] = apic::read(0x200 + 0x10 * i);
    }
    serial::line(format_args!(
        "STALL cpu {} op {}: rip {:#x} cs {:#x} rflags {:#x} rsp {:#x} stack {:#x?}; ppr {:#x} isr {:x?} irr {:x?} last-irq {:#x}",
        pc.cpu,
        pc.op,
        frame.rip,
        frame.cs,
        frame.rflags,
        frame.rsp,
        stack_top(frame.rsp),
        apic::read(0xA0),
        isr,
        irr,
        pc.last_irq
    ));
}

/// Vectors the operations raise on purpose with `int n`.
const SOFT_INTS: core::ops::RangeInclusive<u64> = 0x30..=0x3F;

#[no_mangle]
extern "C" fn fz_trap(frame: &mut Frame) {
    let pc = percpu::of_sp(frame as *mut Frame as u64);
    // SAFETY: the handler runs on the vCPU's own stack, whose bottom holds
    // its state.
    let pc = unsafe { &mut *pc };
    let v = frame.vector & 0xFF;
    if v == 2 {
        pc.nmis += 1;
        let k = pc.cpu as usize % crate::MAX_CPUS;
        if crate::STALL_ASKED[k].swap(false, core::sync::atomic::Ordering::AcqRel) {
            if pc.foreign != 0 && pc.recover_rip != 0 {
                // Root's trampoline code halted with IF clear or looped
                // (`exec::run_foreign`): back to the recovery point, as
                // for a fault, the NMI as its vector.
                pc.rescued += 1;
                serial::line(format_args!(
                    "rescued cpu {} op {}: foreign code at {:#x} halted or looped",
                    pc.cpu, pc.op, frame.rip
                ));
                pc.vector = 2;
                pc.error = 0;
                pc.addr = 0;
                resume_at_recovery(pc, frame);
                return;
            }
            stalled(pc, frame);
        }
        return;
    }
    if v >= 0x40 {
        pc.irqs += 1;
        if v < u64::from(fuzz_guest::ops::FOREIGN_VECTORS) {
            pc.last_irq = v;
        }
        if v != 0xFF {
            apic::eoi();
        }
        return;
    }
    if v >= 0x20 && !SOFT_INTS.contains(&v) {
        pc.stray += 1;
        return;
    }
    if v == 3 && crate::boot::boot_code().contains(&frame.rip.wrapping_sub(1)) {
        // Something jumped into the finished boot code (`boot::trip_wire`).
        let top = stack_top(frame.rsp);
        serial::line(format_args!(
            "FATAL cpu {} reached the boot code at {:#x} in operation {} (rsp {:#x}, stack {:#x?}, rflags {:#x})",
            pc.cpu,
            frame.rip - 1,
            pc.op,
            frame.rsp,
            top,
            frame.rflags
        ));
        loop {
            // SAFETY: stops this vCPU.
            unsafe { core::arch::asm!("cli", "hlt", options(nomem, nostack)) };
        }
    }
    if pc.recover_rip == 0 {
        let cr2: u64;
        // SAFETY: reads CR2.
        unsafe { core::arch::asm!("mov {}, cr2", out(reg) cr2, options(nomem, nostack)) };
        serial::line(format_args!(
            "FATAL cpu {} vector {} error {:#x} rip {:#x} cr2 {:#x} rsp {:#x}",
            pc.cpu, v, frame.error, frame.rip, cr2, frame.rsp
        ));
        loop {
            // SAFETY: stops this vCPU.
            unsafe { core::arch::asm!("cli", "hlt", options(nomem, nostack)) };
        }
    }
    pc.vector = v;
    pc.error = frame.error;
    pc.addr = match v {
        14 => {
            let cr2: u64;
            // SAFETY: reads CR2.
            unsafe { core::arch::asm!("mov {}, cr2", out(reg) cr2, options(nomem, nostack)) };
            cr2
        }
        1 => {
            let dr6: u64;
            // SAFETY: reads DR6 and resets it to its fixed value, as a
            // handler must.
            unsafe {
                core::arch::asm!("mov {0}, dr6", "mov dr6, {1}", out(reg) dr6, in(reg) 0xFFFF_0FF0u64, options(nomem, nostack))
            };
            dr6
        }
        _ => 0,
    };
    resume_at_recovery(pc, frame);
}

/// Makes the handler's return go to the operation's recovery point, with
/// its stack, interrupts off; disarms it.
fn resume_at_recovery(pc: &mut percpu::PerCpu, frame: &mut Frame) {
    frame.rip = pc.recover_rip;
    frame.rsp = pc.recover_rsp;
    frame.cs = 0x08;
    frame.ss = 0x10;
    frame.rflags = 0x2;
    pc.recover_rip = 0;
}
