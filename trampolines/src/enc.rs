//! A tiny x86-64 encoder for the handful of instructions the trampolines use.
//!
//! Encodings follow the Intel SDM, Vol. 2 (2.1 instruction format, 2.2.1
//! REX prefixes, Table 2-2 32-bit addressing forms with the ModR/M byte,
//! Table 2-3 with the SIB byte). Only what the generator needs is here:
//! 64-bit moves between a register and `[base + disp]`, `lea`, immediate
//! moves and arithmetic on a register, `push`/`pop`, `pushfq`/`popfq`,
//! `test`, a forward `jnz rel32`, `ret`, `ret imm16`, `vmcall` and
//! `call [rip + disp32]`.
//!
//! The emitter never panics: writing past the end of its buffer sets a flag
//! that [`Asm::finish`] reports.

/// A general-purpose register, numbered as in the ModR/M `reg` field with
/// REX.R/REX.B as bit 3 (SDM Vol. 2, 2.2.1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Reg {
    Rax = 0,
    Rcx = 1,
    Rdx = 2,
    Rbx = 3,
    Rsp = 4,
    Rbp = 5,
    Rsi = 6,
    Rdi = 7,
    R8 = 8,
    R9 = 9,
    R10 = 10,
    R11 = 11,
    R12 = 12,
    R13 = 13,
    R14 = 14,
    R15 = 15,
}

impl Reg {
    fn low(self) -> u8 {
        self as u8 & 7
    }
    fn high(self) -> u8 {
        (self as u8 >> 3) & 1
    }
}

/// One instruction being assembled (at most 15 bytes, SDM Vol. 2, 2.3.11).
struct Insn {
    b: [u8; 15],
    len: usize,
}

impl Insn {
    fn new() -> Self {
        Insn { b: [0; 15], len: 0 }
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        if self.len < self.b.len() {
            self.b[self.len] = v;
        }
        self.len += 1;
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        for x in v.to_le_bytes() {
            self.u8(x);
        }
        self
    }
    fn i32(&mut self, v: i32) -> &mut Self {
        for x in v.to_le_bytes() {
            self.u8(x);
        }
        self
    }
    /// REX with W=1 and the R and B extensions of `reg` and `rm`.
    fn rex_w(&mut self, reg: u8, rm: u8) -> &mut Self {
        self.u8(0x48 | ((reg >> 3) & 1) << 2 | ((rm >> 3) & 1))
    }
    /// ModR/M (+SIB, +displacement) for `[base + disp]`.
    ///
    /// `mod` = 00 when there is no displacement (not possible with RBP/R13
    /// as base, whose 00 form means RIP-relative or disp32), 01 for a disp8,
    /// 10 for a disp32. A base of RSP/R12 needs a SIB byte with no index
    /// (0x24).
    fn mem(&mut self, reg: u8, base: Reg, disp: i32) -> &mut Self {
        let rm = base.low();
        let md = if disp == 0 && rm != 5 {
            0b00
        } else if i8::try_from(disp).is_ok() {
            0b01
        } else {
            0b10
        };
        self.u8(md << 6 | (reg & 7) << 3 | rm);
        if rm == 4 {
            self.u8(0x24);
        }
        match md {
            0b01 => self.u8(disp as i8 as u8),
            0b10 => self.i32(disp),
            _ => self,
        }
    }
    /// ModR/M for a register-direct operand (`mod` = 11).
    fn direct(&mut self, reg: u8, rm: Reg) -> &mut Self {
        self.u8(0xc0 | (reg & 7) << 3 | rm.low())
    }
}

/// A forward `jnz rel32` whose target is bound later.
#[must_use]
pub(crate) struct Fixup {
    /// Offset of the rel32 field in the buffer.
    at: usize,
}

/// Appends instructions to a byte buffer and counts them.
pub(crate) struct Asm<'a> {
    buf: &'a mut [u8],
    pos: usize,
    insns: u32,
    overflow: bool,
}

impl<'a> Asm<'a> {
    /// An assembler writing `buf` from offset `start`.
    pub(crate) fn new(buf: &'a mut [u8], start: usize) -> Self {
        let overflow = start > buf.len();
        Asm {
            buf,
            pos: start,
            insns: 0,
            overflow,
        }
    }

    /// The offset of the next instruction.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Instructions emitted so far.
    pub(crate) fn insns(&self) -> u32 {
        self.insns
    }

    /// The end offset, or `None` if the code did not fit.
    pub(crate) fn finish(self) -> Option<usize> {
        (!self.overflow).then_some(self.pos)
    }

    fn emit(&mut self, i: &Insn) {
        let end = self.pos + i.len;
        if i.len > i.b.len() || end > self.buf.len() {
            self.overflow = true;
        } else {
            self.buf[self.pos..end].copy_from_slice(&i.b[..i.len]);
        }
        self.pos = end;
        self.insns += 1;
    }

    /// `mov qword [base + disp], src` (REX.W 89 /r).
    pub(crate) fn store(&mut self, base: Reg, disp: i32, src: Reg) {
        let mut i = Insn::new();
        i.rex_w(src as u8, base as u8)
            .u8(0x89)
            .mem(src as u8, base, disp);
        self.emit(&i);
    }

    /// `mov dst, qword [base + disp]` (REX.W 8B /r).
    pub(crate) fn load(&mut self, dst: Reg, base: Reg, disp: i32) {
        let mut i = Insn::new();
        i.rex_w(dst as u8, base as u8)
            .u8(0x8b)
            .mem(dst as u8, base, disp);
        self.emit(&i);
    }

    /// `lea dst, [base + disp]` (REX.W 8D /r). Leaves RFLAGS alone.
    pub(crate) fn lea(&mut self, dst: Reg, base: Reg, disp: i32) {
        let mut i = Insn::new();
        i.rex_w(dst as u8, base as u8)
            .u8(0x8d)
            .mem(dst as u8, base, disp);
        self.emit(&i);
    }

    /// `mov qword [base + disp], imm32` sign-extended (REX.W C7 /0 id).
    pub(crate) fn store_imm(&mut self, base: Reg, disp: i32, imm: i32) {
        let mut i = Insn::new();
        i.rex_w(0, base as u8).u8(0xc7).mem(0, base, disp).i32(imm);
        self.emit(&i);
    }

    /// `mov dst, src` (REX.W 89 /r).
    pub(crate) fn mov(&mut self, dst: Reg, src: Reg) {
        let mut i = Insn::new();
        i.rex_w(src as u8, dst as u8)
            .u8(0x89)
            .direct(src as u8, dst);
        self.emit(&i);
    }

    /// `mov dst32, imm32`, zero-extended to 64 bits (B8+rd id).
    pub(crate) fn mov_imm32(&mut self, dst: Reg, imm: u32) {
        let mut i = Insn::new();
        if dst.high() != 0 {
            i.u8(0x41);
        }
        i.u8(0xb8 + dst.low()).i32(imm as i32);
        self.emit(&i);
    }

    /// A group-1 operation `op dst, imm` (REX.W 83 /op ib or 81 /op id).
    fn group1(&mut self, op: u8, dst: Reg, imm: i32) {
        let mut i = Insn::new();
        i.rex_w(0, dst as u8);
        if let Ok(b) = i8::try_from(imm) {
            i.u8(0x83).direct(op, dst).u8(b as u8);
        } else {
            i.u8(0x81).direct(op, dst).i32(imm);
        }
        self.emit(&i);
    }

    /// `add dst, imm` (writes RFLAGS).
    pub(crate) fn add_imm(&mut self, dst: Reg, imm: i32) {
        self.group1(0, dst, imm);
    }

    /// `sub dst, imm` (writes RFLAGS).
    pub(crate) fn sub_imm(&mut self, dst: Reg, imm: i32) {
        self.group1(5, dst, imm);
    }

    /// `and dst, imm` (writes RFLAGS).
    #[cfg(any(test, feature = "call-hook"))]
    pub(crate) fn and_imm(&mut self, dst: Reg, imm: i32) {
        self.group1(4, dst, imm);
    }

    /// `test a, b` (REX.W 85 /r).
    pub(crate) fn test(&mut self, a: Reg, b: Reg) {
        let mut i = Insn::new();
        i.rex_w(b as u8, a as u8).u8(0x85).direct(b as u8, a);
        self.emit(&i);
    }

    /// `push r` (50+rd, REX.B for R8-R15).
    #[cfg(any(test, feature = "call-hook"))]
    pub(crate) fn push(&mut self, r: Reg) {
        let mut i = Insn::new();
        if r.high() != 0 {
            i.u8(0x41);
        }
        i.u8(0x50 + r.low());
        self.emit(&i);
    }

    /// `pop r` (58+rd, REX.B for R8-R15).
    #[cfg(any(test, feature = "call-hook"))]
    pub(crate) fn pop(&mut self, r: Reg) {
        let mut i = Insn::new();
        if r.high() != 0 {
            i.u8(0x41);
        }
        i.u8(0x58 + r.low());
        self.emit(&i);
    }

    /// `pushfq` (9C).
    pub(crate) fn pushfq(&mut self) {
        let mut i = Insn::new();
        i.u8(0x9c);
        self.emit(&i);
    }

    /// `popfq` (9D).
    pub(crate) fn popfq(&mut self) {
        let mut i = Insn::new();
        i.u8(0x9d);
        self.emit(&i);
    }

    /// `ret` (C3).
    pub(crate) fn ret(&mut self) {
        let mut i = Insn::new();
        i.u8(0xc3);
        self.emit(&i);
    }

    /// `ret imm16` (C2 iw): pop the return address, then `imm` more bytes.
    pub(crate) fn ret_pop(&mut self, imm: u16) {
        let mut i = Insn::new();
        i.u8(0xc2).u16(imm);
        self.emit(&i);
    }

    /// `vmcall` (0F 01 C1; SDM Vol. 2, VMCALL).
    pub(crate) fn vmcall(&mut self) {
        let mut i = Insn::new();
        i.u8(0x0f).u8(0x01).u8(0xc1);
        self.emit(&i);
    }

    /// `call qword [rip + disp32]` (FF /2 with ModR/M 0x15) reading the
    /// 8-byte slot at buffer offset `slot`.
    #[cfg(any(test, feature = "call-hook"))]
    pub(crate) fn call_rip_slot(&mut self, slot: usize) {
        // The displacement is relative to the end of this 6-byte instruction.
        let disp = slot as i64 - (self.pos as i64 + 6);
        let Ok(disp) = i32::try_from(disp) else {
            self.overflow = true;
            return;
        };
        let mut i = Insn::new();
        i.u8(0xff).u8(0x15).i32(disp);
        self.emit(&i);
    }

    /// `jnz rel32` (0F 85 cd) to a label bound later with [`Asm::bind`].
    pub(crate) fn jnz_forward(&mut self) -> Fixup {
        let mut i = Insn::new();
        i.u8(0x0f).u8(0x85).i32(0);
        self.emit(&i);
        Fixup { at: self.pos - 4 }
    }

    /// Points `f` at the current position.
    pub(crate) fn bind(&mut self, f: Fixup) {
        let rel = self.pos as i64 - (f.at as i64 + 4);
        match i32::try_from(rel) {
            Ok(rel) if f.at + 4 <= self.buf.len() => {
                self.buf[f.at..f.at + 4].copy_from_slice(&rel.to_le_bytes());
            }
            _ => self.overflow = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(f: impl FnOnce(&mut Asm)) -> ([u8; 32], usize) {
        let mut buf = [0u8; 32];
        let mut a = Asm::new(&mut buf, 0);
        f(&mut a);
        assert_eq!(a.insns(), 1);
        let n = a.finish().unwrap();
        (buf, n)
    }

    fn check(f: impl FnOnce(&mut Asm), want: &[u8]) {
        let (buf, n) = one(f);
        assert_eq!(&buf[..n], want);
    }

    // Expected bytes checked against the GNU assembler (Intel syntax).
    #[test]
    fn stores_and_loads() {
        check(
            |a| a.store(Reg::Rsp, 0, Reg::R15),
            &[0x4c, 0x89, 0x3c, 0x24],
        );
        check(
            |a| a.store(Reg::Rsp, 8, Reg::R14),
            &[0x4c, 0x89, 0x74, 0x24, 0x08],
        );
        check(
            |a| a.store(Reg::Rsp, 80, Reg::Rax),
            &[0x48, 0x89, 0x44, 0x24, 0x50],
        );
        check(
            |a| a.store(Reg::Rsp, 152, Reg::Rax),
            &[0x48, 0x89, 0x84, 0x24, 0x98, 0, 0, 0],
        );
        check(
            |a| a.store(Reg::Rbp, 0, Reg::Rax),
            &[0x48, 0x89, 0x45, 0x00],
        );
        check(|a| a.store(Reg::R13, 0, Reg::R8), &[0x4d, 0x89, 0x45, 0x00]);
        check(
            |a| a.store(Reg::R12, 16, Reg::Rdi),
            &[0x49, 0x89, 0x7c, 0x24, 0x10],
        );
        check(|a| a.store(Reg::Rax, 0, Reg::Rbx), &[0x48, 0x89, 0x18]);
        check(
            |a| a.load(Reg::Rdi, Reg::Rsp, 112),
            &[0x48, 0x8b, 0x7c, 0x24, 0x70],
        );
        check(
            |a| a.load(Reg::Rax, Reg::Rsp, 168),
            &[0x48, 0x8b, 0x84, 0x24, 0xa8, 0, 0, 0],
        );
        check(
            |a| a.load(Reg::R11, Reg::Rsp, 48),
            &[0x4c, 0x8b, 0x5c, 0x24, 0x30],
        );
        check(|a| a.load(Reg::R9, Reg::Rcx, -8), &[0x4c, 0x8b, 0x49, 0xf8]);
    }

    #[test]
    fn lea_and_immediates() {
        check(|a| a.lea(Reg::Rsi, Reg::Rax, -5), &[0x48, 0x8d, 0x70, 0xfb]);
        check(
            |a| a.lea(Reg::Rsp, Reg::Rsp, -16),
            &[0x48, 0x8d, 0x64, 0x24, 0xf0],
        );
        check(
            |a| a.lea(Reg::Rax, Reg::Rsp, 176),
            &[0x48, 0x8d, 0x84, 0x24, 0xb0, 0, 0, 0],
        );
        check(
            |a| a.store_imm(Reg::Rsp, 120, 0),
            &[0x48, 0xc7, 0x44, 0x24, 0x78, 0, 0, 0, 0],
        );
        check(
            |a| a.store_imm(Reg::Rsp, 136, 0x10),
            &[0x48, 0xc7, 0x84, 0x24, 0x88, 0, 0, 0, 0x10, 0, 0, 0],
        );
        check(|a| a.mov(Reg::Rdi, Reg::Rsp), &[0x48, 0x89, 0xe7]);
        check(|a| a.mov(Reg::Rsp, Reg::Rbx), &[0x48, 0x89, 0xdc]);
        check(|a| a.mov(Reg::R8, Reg::Rax), &[0x49, 0x89, 0xc0]);
        check(
            |a| a.mov_imm32(Reg::Rax, 0x4856_5401),
            &[0xb8, 0x01, 0x54, 0x56, 0x48],
        );
        check(|a| a.mov_imm32(Reg::R9, 1), &[0x41, 0xb9, 1, 0, 0, 0]);
        check(
            |a| a.sub_imm(Reg::Rsp, 144),
            &[0x48, 0x81, 0xec, 0x90, 0, 0, 0],
        );
        check(|a| a.sub_imm(Reg::Rsp, 8), &[0x48, 0x83, 0xec, 0x08]);
        check(
            |a| a.add_imm(Reg::Rsp, 144),
            &[0x48, 0x81, 0xc4, 0x90, 0, 0, 0],
        );
        check(|a| a.and_imm(Reg::Rsp, -16), &[0x48, 0x83, 0xe4, 0xf0]);
        check(|a| a.test(Reg::Rax, Reg::Rax), &[0x48, 0x85, 0xc0]);
        check(|a| a.test(Reg::R10, Reg::Rcx), &[0x49, 0x85, 0xca]);
    }

    #[test]
    fn stack_and_control() {
        check(|a| a.push(Reg::Rbx), &[0x53]);
        check(|a| a.push(Reg::R15), &[0x41, 0x57]);
        check(|a| a.pop(Reg::Rbx), &[0x5b]);
        check(|a| a.pop(Reg::R12), &[0x41, 0x5c]);
        check(|a| a.pushfq(), &[0x9c]);
        check(|a| a.popfq(), &[0x9d]);
        check(|a| a.ret(), &[0xc3]);
        check(|a| a.ret_pop(16), &[0xc2, 0x10, 0x00]);
        check(|a| a.vmcall(), &[0x0f, 0x01, 0xc1]);
        // call [rip + 0x10]: slot 0x16 seen from an instruction at 0 ending at 6.
        check(|a| a.call_rip_slot(0x16), &[0xff, 0x15, 0x10, 0, 0, 0]);
    }

    #[test]
    fn forward_branch() {
        let mut buf = [0u8; 32];
        let mut a = Asm::new(&mut buf, 0);
        let f = a.jnz_forward();
        a.ret();
        a.bind(f);
        a.ret();
        assert_eq!(a.insns(), 3);
        assert_eq!(a.finish(), Some(8));
        assert_eq!(&buf[..8], &[0x0f, 0x85, 1, 0, 0, 0, 0xc3, 0xc3]);
    }

    #[test]
    fn overflow_is_reported_not_panicked() {
        let mut buf = [0u8; 4];
        let mut a = Asm::new(&mut buf, 0);
        a.vmcall();
        a.vmcall();
        assert_eq!(a.finish(), None);
        let mut buf = [0u8; 4];
        let a = Asm::new(&mut buf, 5);
        assert_eq!(a.finish(), None);
    }
}
