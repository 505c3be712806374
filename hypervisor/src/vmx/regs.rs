//! The guest registers root saves at every exit.

/// Guest general-purpose registers that VMX does not keep in the VMCS
/// (RSP and RIP live there). Saved and restored by the
/// binary's `vmx_run`, which addresses the fields by `offset_of!`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GuestRegs {
    pub rax: u64,
    pub rbx: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub rbp: u64,
    pub r8: u64,
    pub r9: u64,
    pub r10: u64,
    pub r11: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
}

const _: () = assert!(core::mem::size_of::<GuestRegs>() == 15 * 8);
