//! Every privileged instruction the hypervisor executes, behind safe or
//! narrowly unsafe wrappers. No other module of the hypervisor contains `asm!`
//! (the boot stub lives in `loader/src/entry.rs`).
//!
//! VMX instructions report failure through RFLAGS (SDM 31.2 "Conventions"):
//! CF=1 is VMfailInvalid, ZF=1 is VMfailValid with the reason in the
//! VM-instruction error field. Each wrapper turns that into a [`VmFail`].

use core::arch::asm;

/// A failed VMX instruction (SDM 31.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmFail {
    /// CF=1: no current VMCS, or the operand was invalid.
    Invalid,
    /// ZF=1: the VM-instruction error field says why.
    Valid,
}

#[inline(always)]
fn vm_result(rflags: u64) -> Result<(), VmFail> {
    if rflags & 1 != 0 {
        Err(VmFail::Invalid)
    } else if rflags & (1 << 6) != 0 {
        Err(VmFail::Valid)
    } else {
        Ok(())
    }
}

/// Enters VMX operation with the VMXON region at physical address `region`.
///
/// # Safety
/// `region` must be a 4 KiB-aligned, zeroed-then-revision-stamped page owned by
/// the hypervisor for as long as VMX operation lasts, and CR4.VMXE must be set.
pub unsafe fn vmxon(region: u64) -> Result<(), VmFail> {
    let flags: u64;
    // SAFETY: the caller upholds the VMXON preconditions; the operand is a
    // stack slot holding the region's physical address.
    unsafe {
        asm!("vmxon [{0}]", "pushfq", "pop {1}", in(reg) &region, out(reg) flags);
    }
    vm_result(flags)
}

/// VMCLEAR: flushes and deactivates the VMCS at `vmcs`.
///
/// # Safety
/// `vmcs` must be the physical address of a VMCS region owned by the hypervisor.
pub unsafe fn vmclear(vmcs: u64) -> Result<(), VmFail> {
    let flags: u64;
    // SAFETY: per the caller's contract the operand names a hypervisor-owned VMCS.
    unsafe {
        asm!("vmclear [{0}]", "pushfq", "pop {1}", in(reg) &vmcs, out(reg) flags);
    }
    vm_result(flags)
}

/// VMPTRLD: makes the VMCS at `vmcs` current.
///
/// # Safety
/// `vmcs` must be the physical address of a cleared, revision-stamped VMCS region.
pub unsafe fn vmptrld(vmcs: u64) -> Result<(), VmFail> {
    let flags: u64;
    // SAFETY: per the caller's contract the operand names a valid VMCS region.
    unsafe {
        asm!("vmptrld [{0}]", "pushfq", "pop {1}", in(reg) &vmcs, out(reg) flags);
    }
    vm_result(flags)
}

/// VMREAD of `field` from the current VMCS.
pub fn vmread(field: u32) -> Result<u64, VmFail> {
    let value: u64;
    let flags: u64;
    // SAFETY: VMREAD only reads the current VMCS; with no current VMCS or a bad
    // encoding it fails with flags set, which we report, and touches no memory.
    unsafe {
        asm!("vmread {0}, {1}", "pushfq", "pop {2}", out(reg) value, in(reg) field as u64, out(reg) flags);
    }
    vm_result(flags).map(|()| value)
}

/// VMWRITE of `value` to `field` in the current VMCS.
///
/// # Safety
/// Writing host-state or control fields changes what the CPU does on the next
/// VM entry and exit; the caller must write values that keep the hypervisor sound.
pub unsafe fn vmwrite(field: u32, value: u64) -> Result<(), VmFail> {
    let flags: u64;
    // SAFETY: the caller vouches for the value; VMWRITE itself only writes the VMCS.
    unsafe {
        asm!("vmwrite {0}, {1}", "pushfq", "pop {2}", in(reg) field as u64, in(reg) value, out(reg) flags);
    }
    vm_result(flags)
}

/// Reads a model-specific register.
///
/// # Safety
/// Reading an MSR the CPU does not implement raises #GP.
pub unsafe fn rdmsr(msr: u32) -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller guarantees the MSR exists.
    unsafe {
        asm!("rdmsr", in("ecx") msr, out("eax") lo, out("edx") hi, options(nomem, nostack));
    }
    (lo as u64) | ((hi as u64) << 32)
}

/// Writes a model-specific register.
///
/// # Safety
/// The MSR must exist and the value must not break the hypervisor.
pub unsafe fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the caller guarantees the MSR and value are valid.
    unsafe {
        asm!("wrmsr", in("ecx") msr, in("eax") value as u32, in("edx") (value >> 32) as u32, options(nostack));
    }
}

/// Executes CPUID for `(leaf, subleaf)` and returns `[eax, ebx, ecx, edx]`.
pub fn cpuid(leaf: u32, subleaf: u32) -> [u32; 4] {
    let r = core::arch::x86_64::__cpuid_count(leaf, subleaf);
    [r.eax, r.ebx, r.ecx, r.edx]
}

/// XSETBV: loads XCR `index` with `value`.
///
/// # Safety
/// CR4.OSXSAVE must be set and the value must be valid for the CPU, or #GP.
pub unsafe fn xsetbv(index: u32, value: u64) {
    // SAFETY: the caller validated the value against CPUID leaf 0xD.
    unsafe {
        asm!("xsetbv", in("ecx") index, in("eax") value as u32, in("edx") (value >> 32) as u32, options(nostack));
    }
}

/// Reads CR0.
pub fn read_cr0() -> u64 {
    let v: u64;
    // SAFETY: reading a control register has no side effects in ring 0.
    unsafe { asm!("mov {}, cr0", out(reg) v, options(nomem, nostack)) };
    v
}

/// Writes CR0.
///
/// # Safety
/// The value must keep paging and protection as the hypervisor needs them.
pub unsafe fn write_cr0(v: u64) {
    // SAFETY: the caller guarantees the new value is consistent.
    unsafe { asm!("mov cr0, {}", in(reg) v, options(nostack)) };
}

/// Reads CR3.
pub fn read_cr3() -> u64 {
    let v: u64;
    // SAFETY: reading a control register has no side effects in ring 0.
    unsafe { asm!("mov {}, cr3", out(reg) v, options(nomem, nostack)) };
    v
}

/// Writes CR3: root switches to another page-table hierarchy (and drops
/// the non-global TLB entries).
///
/// # Safety
/// `v` must name a complete hierarchy that maps everything root uses
/// (code, data, stacks, the frame pool and the memory it reaches through
/// the identity map) as the current one does, and whose tables stay
/// allocated and unchanged for as long as it is loaded.
pub unsafe fn write_cr3(v: u64) {
    // SAFETY: the caller guarantees the new hierarchy; the asm has no
    // `nomem`, so the compiler does not move memory accesses across it.
    unsafe { asm!("mov cr3, {}", in(reg) v, options(nostack, preserves_flags)) };
}

/// Reads CR4.
pub fn read_cr4() -> u64 {
    let v: u64;
    // SAFETY: reading a control register has no side effects in ring 0.
    unsafe { asm!("mov {}, cr4", out(reg) v, options(nomem, nostack)) };
    v
}

/// Writes CR4.
///
/// # Safety
/// The value must keep PAE and every bit the hypervisor relies on.
pub unsafe fn write_cr4(v: u64) {
    // SAFETY: the caller guarantees the new value is consistent.
    unsafe { asm!("mov cr4, {}", in(reg) v, options(nostack)) };
}

/// Writes one byte to an I/O port.
///
/// # Safety
/// Port writes reach devices; the caller must own the port or be forwarding a
/// guest access.
pub unsafe fn outb(port: u16, v: u8) {
    // SAFETY: the caller owns the port.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack)) };
}

/// Writes `bytes` to an I/O port, one byte per iteration of one
/// `rep outsb` (the direction flag is clear in root).
///
/// # Safety
/// As [`outb`].
pub unsafe fn rep_outsb(port: u16, bytes: &[u8]) {
    // SAFETY: the caller owns the port; `rep outsb` reads `rcx` bytes from
    // `rsi` upwards (DF is clear: root never sets it), all within `bytes`.
    unsafe {
        asm!(
            "rep outsb",
            in("dx") port,
            inout("rsi") bytes.as_ptr() => _,
            inout("rcx") bytes.len() => _,
            options(readonly, nostack, preserves_flags)
        )
    };
}

/// Writes a 16-bit word to an I/O port.
///
/// # Safety
/// As [`outb`].
pub unsafe fn outw(port: u16, v: u16) {
    // SAFETY: the caller owns the port.
    unsafe { asm!("out dx, ax", in("dx") port, in("ax") v, options(nomem, nostack)) };
}

/// Writes a 32-bit word to an I/O port.
///
/// # Safety
/// As [`outb`].
pub unsafe fn outl(port: u16, v: u32) {
    // SAFETY: the caller owns the port.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack)) };
}

/// Reads one byte from an I/O port.
///
/// # Safety
/// Port reads can have side effects on devices.
pub unsafe fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: the caller owns the port.
    unsafe { asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack)) };
    v
}

/// Reads a 16-bit word from an I/O port.
///
/// # Safety
/// As [`inb`].
pub unsafe fn inw(port: u16) -> u16 {
    let v: u16;
    // SAFETY: the caller owns the port.
    unsafe { asm!("in ax, dx", in("dx") port, out("ax") v, options(nomem, nostack)) };
    v
}

/// Reads a 32-bit word from an I/O port.
///
/// # Safety
/// As [`inb`].
pub unsafe fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: the caller owns the port.
    unsafe { asm!("in eax, dx", in("dx") port, out("eax") v, options(nomem, nostack)) };
    v
}

/// INVEPT, single-context (type 1): drops the guest-physical and combined
/// translations derived from the EPT hierarchy `eptp`, after its entries
/// changed (SDM 29.4.3.1).
pub fn invept_single(eptp: u64) -> Result<(), VmFail> {
    let desc: [u64; 2] = [eptp, 0];
    let flags: u64;
    // SAFETY: INVEPT only invalidates cached translations; the descriptor is
    // a live stack array of the layout the SDM gives (EPTP, reserved zero).
    unsafe {
        asm!("invept {0}, [{1}]", "pushfq", "pop {2}", in(reg) 1u64, in(reg) desc.as_ptr(), out(reg) flags);
    }
    vm_result(flags)
}

/// Reads DR6 (the guest's: VMX does not switch it).
pub fn read_dr6() -> u64 {
    let v: u64;
    // SAFETY: reading a debug register at CPL 0 has no side effects.
    unsafe { asm!("mov {}, dr6", out(reg) v, options(nomem, nostack)) };
    v
}

/// Writes DR6, which the guest's #DB handler reads (VMX does not switch it).
pub fn write_dr6(v: u64) {
    // SAFETY: DR6 only reports debug conditions; the hypervisor itself uses
    // no debug features, so the value affects the guest alone.
    unsafe { asm!("mov dr6, {}", in(reg) v, options(nomem, nostack)) };
}

/// Reads the time-stamp counter.
pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC is unprivileged and has no side effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Stops the CPU for good: interrupts off, then HLT forever.
pub fn halt_forever() -> ! {
    loop {
        // SAFETY: CLI;HLT only stops this CPU.
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
    }
}

/// A descriptor-table register image for LGDT/LIDT/SGDT.
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
pub struct DescriptorTablePointer {
    /// Table size minus one.
    pub limit: u16,
    /// Linear base address.
    pub base: u64,
}

/// Loads the GDT register.
///
/// # Safety
/// The table must stay valid and contain the selectors currently loaded.
pub unsafe fn lgdt(p: &DescriptorTablePointer) {
    // SAFETY: the caller guarantees the table outlives its use.
    unsafe { asm!("lgdt [{}]", in(reg) p, options(readonly, nostack)) };
}

/// Loads the task register.
///
/// # Safety
/// `sel` must name an available 64-bit TSS descriptor in the current GDT.
pub unsafe fn ltr(sel: u16) {
    // SAFETY: the caller guarantees the descriptor is a valid TSS.
    unsafe { asm!("ltr {0:x}", in(reg) sel, options(nostack)) };
}

/// Reloads CS with `code` (by a far return) and the data segments with `data`.
///
/// # Safety
/// Both selectors must be valid in the current GDT.
pub unsafe fn reload_segments(code: u16, data: u16) {
    // SAFETY: the caller guarantees the selectors; the far return lands on the
    // next instruction with the same stack.
    unsafe {
        asm!(
            "push {code}",
            "lea {tmp}, [rip + 2f]",
            "push {tmp}",
            "retfq",
            "2:",
            "mov ds, {data:x}",
            "mov es, {data:x}",
            "mov ss, {data:x}",
            code = in(reg) code as u64,
            data = in(reg) data,
            tmp = out(reg) _,
        );
    }
}

pub use hypervisor::vmx::regs::GuestRegs;

/// Outcome of one [`vmx_run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOutcome {
    /// The guest ran and a VM exit brought us back.
    Exited,
    /// VMLAUNCH/VMRESUME itself failed (the guest never ran).
    EntryFailed(VmFail),
}

/// Enters the guest (VMLAUNCH when `launched` is false, else VMRESUME) with its
/// general-purpose registers from `regs`, and returns at the next VM exit with
/// them saved back into `regs`.
///
/// `host_rsp` is the HOST_RSP this VMCS holds (0 before its first entry):
/// HOST_RSP and HOST_RIP are written only when the stack pointer at entry
/// differs from it, and it is updated then. A vCPU enters from one loop,
/// so they are written once; a nested KVM shadows neither field, and each
/// write would be an exit to it on every entry.
///
/// # Safety
/// A VMCS must be current with complete, consistent guest, host and control
/// state; its HOST_RIP/HOST_RSP are set here. `host_rsp` must be this
/// VMCS's own, and nothing else may write the two fields.
pub unsafe fn vmx_run(regs: &mut GuestRegs, launched: bool, host_rsp: &mut u64) -> RunOutcome {
    // SAFETY: the caller guarantees a complete VMCS and a `host_rsp` that
    // says what its HOST_RSP holds; the trampoline keeps the System V
    // callee-saved registers and the stack balanced on both paths.
    let r = unsafe { vmx_run_raw(regs, launched as u64, host_rsp) };
    match r {
        0 => RunOutcome::Exited,
        1 => RunOutcome::EntryFailed(VmFail::Invalid),
        _ => RunOutcome::EntryFailed(VmFail::Valid),
    }
}

use core::mem::offset_of;

/// Returns 0 after a VM exit, 1 on VMfailInvalid, 2 on VMfailValid.
#[unsafe(naked)]
unsafe extern "C" fn vmx_run_raw(regs: *mut GuestRegs, launched: u64, host_rsp: *mut u64) -> u64 {
    core::arch::naked_asm!(
        // Callee-saved host registers, then the regs pointer at [rsp].
        "push rbp",
        "push rbx",
        "push r12",
        "push r13",
        "push r14",
        "push r15",
        "push rdi",
        // HOST_RSP = rsp, HOST_RIP = 3f (SDM 25.5 host-state area), when
        // rsp is not what the VMCS holds ([rdx]).
        "cmp rsp, [rdx]",
        "je 5f",
        "mov [rdx], rsp",
        "mov rax, {host_rsp}",
        "vmwrite rax, rsp",
        "lea rbx, [rip + 3f]",
        "mov rax, {host_rip}",
        "vmwrite rax, rbx",
        "5:",
        "test rsi, rsi",
        "mov rax, [rdi + {rax}]",
        "mov rbx, [rdi + {rbx}]",
        "mov rcx, [rdi + {rcx}]",
        "mov rdx, [rdi + {rdx}]",
        "mov rsi, [rdi + {rsi}]",
        "mov rbp, [rdi + {rbp}]",
        "mov r8, [rdi + {r8}]",
        "mov r9, [rdi + {r9}]",
        "mov r10, [rdi + {r10}]",
        "mov r11, [rdi + {r11}]",
        "mov r12, [rdi + {r12}]",
        "mov r13, [rdi + {r13}]",
        "mov r14, [rdi + {r14}]",
        "mov r15, [rdi + {r15}]",
        "mov rdi, [rdi + {rdi}]",
        "jnz 2f",
        "vmlaunch",
        "jmp 4f",
        "2:",
        "vmresume",
        // Entry failed: CF or ZF tells which.
        "4:",
        "mov eax, 1",
        "mov ecx, 2",
        "cmovz eax, ecx",
        "pop rdi",
        "pop r15",
        "pop r14",
        "pop r13",
        "pop r12",
        "pop rbx",
        "pop rbp",
        "ret",
        // VM exit: rsp = HOST_RSP, the regs pointer is at [rsp].
        "3:",
        "push rdi",
        "mov rdi, [rsp + 8]",
        "mov [rdi + {rax}], rax",
        "mov [rdi + {rbx}], rbx",
        "mov [rdi + {rcx}], rcx",
        "mov [rdi + {rdx}], rdx",
        "mov [rdi + {rsi}], rsi",
        "mov [rdi + {rbp}], rbp",
        "mov [rdi + {r8}], r8",
        "mov [rdi + {r9}], r9",
        "mov [rdi + {r10}], r10",
        "mov [rdi + {r11}], r11",
        "mov [rdi + {r12}], r12",
        "mov [rdi + {r13}], r13",
        "mov [rdi + {r14}], r14",
        "mov [rdi + {r15}], r15",
        "pop rax",
        "mov [rdi + {rdi}], rax",
        "pop rdi",
        "pop r15",
        "pop r14",
        "pop r13",
        "pop r12",
        "pop rbx",
        "pop rbp",
        "xor eax, eax",
        "ret",
        host_rsp = const 0x6C14u32,
        host_rip = const 0x6C16u32,
        rax = const offset_of!(GuestRegs, rax),
        rbx = const offset_of!(GuestRegs, rbx),
        rcx = const offset_of!(GuestRegs, rcx),
        rdx = const offset_of!(GuestRegs, rdx),
        rsi = const offset_of!(GuestRegs, rsi),
        rdi = const offset_of!(GuestRegs, rdi),
        rbp = const offset_of!(GuestRegs, rbp),
        r8 = const offset_of!(GuestRegs, r8),
        r9 = const offset_of!(GuestRegs, r9),
        r10 = const offset_of!(GuestRegs, r10),
        r11 = const offset_of!(GuestRegs, r11),
        r12 = const offset_of!(GuestRegs, r12),
        r13 = const offset_of!(GuestRegs, r13),
        r14 = const offset_of!(GuestRegs, r14),
        r15 = const offset_of!(GuestRegs, r15),
    );
}

/// Loads CR2, for a #PF that root injects into the guest (VMX does not
/// switch CR2: the guest sees the value root leaves in it).
pub fn write_cr2(value: u64) {
    // SAFETY: CR2 only records a fault address; root never reads it except
    // in its own fault reports, which come from a fault that rewrites it.
    unsafe { asm!("mov cr2, {}", in(reg) value, options(nomem, nostack, preserves_flags)) };
}

/// Reads CR2 (the faulting linear address of the last #PF).
pub fn read_cr2() -> u64 {
    let v: u64;
    // SAFETY: reading CR2 has no side effects.
    unsafe { asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// Loads the interrupt descriptor table register.
///
/// # Safety
/// The table must stay valid for as long as it is loaded, with every
/// present gate pointing at a handler that can run on the current stacks.
pub unsafe fn lidt(p: &DescriptorTablePointer) {
    // SAFETY: the caller guarantees the table outlives its use.
    unsafe { asm!("lidt [{}]", in(reg) p, options(readonly, nostack)) };
}

/// Executes an IRETQ to the next instruction, on the same stack: lifts
/// the NMI blocking of this CPU in root. Bochs 2.7 leaves NMIs blocked on
/// an AP after its SIPI exit (the exit cuts short the SIPI's own
/// unmasking), and only an IRET in root lifts that.
pub fn iret_to_self() {
    // SAFETY: the frame pushed is this very context (SS:RSP as they were,
    // RFLAGS, CS and the address right after IRETQ), so execution goes on
    // unchanged; the asm may use the stack, which the compiler allows for
    // (no `nostack`).
    unsafe {
        asm!(
            "mov {sp}, rsp",
            "mov {sel:e}, ss",
            "push {sel}",
            "push {sp}",
            "pushfq",
            "mov {sel:e}, cs",
            "push {sel}",
            "lea {sp}, [rip + 2f]",
            "push {sp}",
            "iretq",
            "2:",
            sp = out(reg) _,
            sel = out(reg) _,
        )
    };
}

/// Runs root's own NMI handler through `INT 2`. After a VM exit caused by
/// an NMI, physical NMIs stay blocked until an IRET executes in root (SDM
/// 28.x, "NMI exiting"); the handler's IRETQ is that IRET.
pub fn run_nmi_handler() {
    // SAFETY: vector 2 of root's IDT is the NMI stub, which only records
    // the NMI for the guest and returns with IRETQ on its IST stack.
    unsafe { asm!("int 2") };
}

/// The registers a root trap stub saves, in stack order (lowest address
/// first), followed by the vector, the error code (0 when the CPU pushes
/// none) and the CPU's own interrupt frame.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TrapFrame {
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rax: u64,
    pub vector: u64,
    pub error_code: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

// The stubs below push exactly these words; the CPU aligns RSP to 16 before
// its 5-word frame, so 16 words keep the call into Rust 16-byte aligned.
const _: () = assert!(core::mem::size_of::<TrapFrame>() == 16 * 8);
const _: () = assert!(core::mem::offset_of!(TrapFrame, vector) == 9 * 8);
const _: () = assert!(core::mem::offset_of!(TrapFrame, rip) == 11 * 8);

extern "C" {
    /// Entry points of the 32 exception stubs, by vector.
    static hv_trap_entries: [u64; 32];
}

extern "C" {
    /// Pairs of (faulting instruction, where to resume) for root's few
    /// instructions whose #GP is an expected outcome.
    static hv_fixups: [u64; 2];
    fn hv_wrmsr_safe(msr: u32, value: u64) -> u32;
}

/// Where to resume after a #GP at `rip`, if `rip` is an instruction whose
/// fault is expected (see [`wrmsr_safe`]).
pub fn fixup_for(rip: u64) -> Option<u64> {
    // SAFETY: a read-only pair of addresses emitted by the assembly below.
    let f = unsafe { core::ptr::addr_of!(hv_fixups).read() };
    (rip == f[0]).then_some(f[1])
}

/// WRMSR that returns `Err(())` where the CPU raises #GP (a reserved bit,
/// an invalid transition), instead of crashing root. For values that
/// come from the guest.
///
/// # Safety
/// A successful write must not break root: only MSRs whose effect is the
/// guest's alone (the guest's view of the platform) may be written.
pub unsafe fn wrmsr_safe(msr: u32, value: u64) -> Result<(), ()> {
    // SAFETY: the stub executes one WRMSR; a #GP on it is resumed at its
    // fixup by root's trap handler, which returns 1.
    match unsafe { hv_wrmsr_safe(msr, value) } {
        0 => Ok(()),
        _ => Err(()),
    }
}

/// The address of the stub for exception `vector` (0..32).
pub fn trap_entry(vector: usize) -> u64 {
    // SAFETY: a read-only table of 32 addresses emitted by the assembly below.
    unsafe {
        core::ptr::addr_of!(hv_trap_entries)
            .cast::<u64>()
            .add(vector % 32)
            .read()
    }
}

// Exception stubs: vectors 8, 10-14, 17, 21, 29 and 30 push an error code;
// the others push a 0 in its place. Each stub pushes its vector and jumps
// to the common path, which saves the caller-saved registers, calls
// `hv_root_trap(&TrapFrame)` and returns with IRETQ if the handler returns
// (it does so only for an NMI).
core::arch::global_asm!(
    r#"
    .section .text.hv_traps, "ax"
    .macro HV_TRAP vec, err
    .balign 16
hv_trap_\vec:
    .if \err == 0
    push 0
    .endif
    push \vec
    jmp hv_trap_common
    .endm

    HV_TRAP 0, 0
    HV_TRAP 1, 0
    HV_TRAP 2, 0
    HV_TRAP 3, 0
    HV_TRAP 4, 0
    HV_TRAP 5, 0
    HV_TRAP 6, 0
    HV_TRAP 7, 0
    HV_TRAP 8, 1
    HV_TRAP 9, 0
    HV_TRAP 10, 1
    HV_TRAP 11, 1
    HV_TRAP 12, 1
    HV_TRAP 13, 1
    HV_TRAP 14, 1
    HV_TRAP 15, 0
    HV_TRAP 16, 0
    HV_TRAP 17, 1
    HV_TRAP 18, 0
    HV_TRAP 19, 0
    HV_TRAP 20, 0
    HV_TRAP 21, 1
    HV_TRAP 22, 0
    HV_TRAP 23, 0
    HV_TRAP 24, 0
    HV_TRAP 25, 0
    HV_TRAP 26, 0
    HV_TRAP 27, 0
    HV_TRAP 28, 0
    HV_TRAP 29, 1
    HV_TRAP 30, 1
    HV_TRAP 31, 0

    .balign 16
hv_trap_common:
    push rax
    push rcx
    push rdx
    push rsi
    push rdi
    push r8
    push r9
    push r10
    push r11
    mov rdi, rsp
    cld
    call hv_root_trap
    pop r11
    pop r10
    pop r9
    pop r8
    pop rdi
    pop rsi
    pop rdx
    pop rcx
    pop rax
    add rsp, 16
    iretq

    // WRMSR whose #GP is a result, not a crash: the trap handler resumes
    // a #GP at hv_wrmsr_safe_insn at hv_wrmsr_safe_fixup (see
    // `fixup_for`). System V: edi = MSR, rsi = value; eax = 0 on success.
    .balign 16
    .global hv_wrmsr_safe
hv_wrmsr_safe:
    mov ecx, edi
    mov eax, esi
    mov rdx, rsi
    shr rdx, 32
hv_wrmsr_safe_insn:
    wrmsr
    xor eax, eax
    ret
hv_wrmsr_safe_fixup:
    mov eax, 1
    ret

    .section .rodata.hv_traps, "a"
    .balign 8
    .global hv_fixups
hv_fixups:
    .quad hv_wrmsr_safe_insn, hv_wrmsr_safe_fixup
    .global hv_trap_entries
hv_trap_entries:
    .quad hv_trap_0, hv_trap_1, hv_trap_2, hv_trap_3
    .quad hv_trap_4, hv_trap_5, hv_trap_6, hv_trap_7
    .quad hv_trap_8, hv_trap_9, hv_trap_10, hv_trap_11
    .quad hv_trap_12, hv_trap_13, hv_trap_14, hv_trap_15
    .quad hv_trap_16, hv_trap_17, hv_trap_18, hv_trap_19
    .quad hv_trap_20, hv_trap_21, hv_trap_22, hv_trap_23
    .quad hv_trap_24, hv_trap_25, hv_trap_26, hv_trap_27
    .quad hv_trap_28, hv_trap_29, hv_trap_30, hv_trap_31
    .text
    "#
);

/// Reads CR8 (the task-priority register).
pub fn read_cr8() -> u64 {
    let v: u64;
    // SAFETY: reading CR8 has no side effects.
    unsafe { asm!("mov {}, cr8", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// Writes CR8.
///
/// # Safety
/// `v` must be 0..=15; root runs with interrupts off, so only the guest
/// sees the new priority.
pub unsafe fn write_cr8(v: u64) {
    // SAFETY: the caller guarantees a valid priority.
    unsafe { asm!("mov cr8, {}", in(reg) v, options(nomem, nostack, preserves_flags)) };
}
