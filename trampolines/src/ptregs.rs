//! `struct pt_regs` as x86-64 Linux lays it out
//! (arch/x86/include/asm/ptrace.h; identical in 6.1 and 6.12).
//!
//! The entry trampoline fills one of these exactly as the kernel's
//! `ftrace_regs_caller` does, so kprobe handlers see what a kprobe on ftrace
//! sees inside the guest.

/// The saved register frame. Field order and offsets are the kernel's.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PtRegs {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub bp: u64,
    pub bx: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub ax: u64,
    pub cx: u64,
    pub dx: u64,
    pub si: u64,
    pub di: u64,
    /// The syscall number on syscall entry; 0 from an ftrace site.
    pub orig_ax: u64,
    /// From an ftrace site: the fentry site + 5.
    pub ip: u64,
    pub cs: u64,
    pub flags: u64,
    /// From an ftrace site: the traced function's entry RSP (its return address).
    pub sp: u64,
    pub ss: u64,
}

macro_rules! assert_offset {
    ($field:ident, $off:expr) => {
        const _: () = assert!(core::mem::offset_of!(PtRegs, $field) == $off);
    };
}

assert_offset!(r15, 0);
assert_offset!(r14, 8);
assert_offset!(r13, 16);
assert_offset!(r12, 24);
assert_offset!(bp, 32);
assert_offset!(bx, 40);
assert_offset!(r11, 48);
assert_offset!(r10, 56);
assert_offset!(r9, 64);
assert_offset!(r8, 72);
assert_offset!(ax, 80);
assert_offset!(cx, 88);
assert_offset!(dx, 96);
assert_offset!(si, 104);
assert_offset!(di, 112);
assert_offset!(orig_ax, 120);
assert_offset!(ip, 128);
assert_offset!(cs, 136);
assert_offset!(flags, 144);
assert_offset!(sp, 152);
assert_offset!(ss, 160);
const _: () = assert!(core::mem::size_of::<PtRegs>() == 168);

/// Size of `struct pt_regs` in bytes.
pub const PT_REGS_SIZE: usize = 168;
/// The kernel code selector ftrace stores in `cs`.
pub const KERNEL_CS: u64 = 0x10;
/// The kernel data selector ftrace stores in `ss`.
pub const KERNEL_SS: u64 = 0x18;

impl PtRegs {
    /// The structure from its guest-memory image (little-endian, the field
    /// order above), as VMX root reads it off the guest stack.
    pub fn from_le_bytes(b: &[u8; PT_REGS_SIZE]) -> PtRegs {
        let mut w = [0u64; PT_REGS_SIZE / 8];
        for (word, chunk) in w.iter_mut().zip(b.chunks_exact(8)) {
            let mut le = [0u8; 8];
            le.copy_from_slice(chunk);
            *word = u64::from_le_bytes(le);
        }
        let [r15, r14, r13, r12, bp, bx, r11, r10, r9, r8, ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss] =
            w;
        PtRegs {
            r15,
            r14,
            r13,
            r12,
            bp,
            bx,
            r11,
            r10,
            r9,
            r8,
            ax,
            cx,
            dx,
            si,
            di,
            orig_ax,
            ip,
            cs,
            flags,
            sp,
            ss,
        }
    }

    /// Register by its kprobe_events name (`ax`, `r8`, `ip`, ...), as `%NAME` takes it.
    pub fn by_name(&self, name: &str) -> Option<u64> {
        Some(match name {
            "r15" => self.r15,
            "r14" => self.r14,
            "r13" => self.r13,
            "r12" => self.r12,
            "bp" => self.bp,
            "bx" => self.bx,
            "r11" => self.r11,
            "r10" => self.r10,
            "r9" => self.r9,
            "r8" => self.r8,
            "ax" => self.ax,
            "cx" => self.cx,
            "dx" => self.dx,
            "si" => self.si,
            "di" => self.di,
            "orig_ax" => self.orig_ax,
            "ip" => self.ip,
            "cs" => self.cs,
            "flags" => self.flags,
            "sp" => self.sp,
            "ss" => self.ss,
            _ => return None,
        })
    }

    /// The n-th integer argument under the x86-64 System V convention
    /// (`$argN`, 1-based: di, si, dx, cx, r8, r9).
    pub fn arg(&self, n: u32) -> Option<u64> {
        Some(match n {
            1 => self.di,
            2 => self.si,
            3 => self.dx,
            4 => self.cx,
            5 => self.r8,
            6 => self.r9,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod image_tests {
    use super::*;

    #[test]
    fn from_le_bytes_follows_the_field_offsets() {
        let mut b = [0u8; PT_REGS_SIZE];
        for (i, chunk) in b.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&(0x1000 + i as u64).to_le_bytes());
        }
        let r = PtRegs::from_le_bytes(&b);
        let at = |off: usize| 0x1000 + (off / 8) as u64;
        assert_eq!(r.r15, at(core::mem::offset_of!(PtRegs, r15)));
        assert_eq!(r.di, at(core::mem::offset_of!(PtRegs, di)));
        assert_eq!(r.ip, at(core::mem::offset_of!(PtRegs, ip)));
        assert_eq!(r.flags, at(core::mem::offset_of!(PtRegs, flags)));
        assert_eq!(r.sp, at(core::mem::offset_of!(PtRegs, sp)));
        assert_eq!(r.ss, at(core::mem::offset_of!(PtRegs, ss)));
    }
}
