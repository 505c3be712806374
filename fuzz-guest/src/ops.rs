//! The operations and how the seeded stream draws them.
//!
//! Each operation is one privileged action with random operands, chosen so
//! that the program survives it on the bare CPU: ports that reset, power
//! off or start DMA are never written, the APIC is never told to INIT a
//! running CPU, and every state change (CRs, XCR0, MSRs, debug registers,
//! page tables) is undone by the same operation. Everything else is fair
//! game, faults included: the program's handlers record them and resume.

use crate::rng::Rng;

/// Data widths in bytes.
pub const WIDTHS: [u8; 3] = [1, 2, 4];

/// The kinds of faults the program raises on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// `ud2`.
    Ud2,
    /// A load from a non-canonical address (#GP).
    NonCanonical,
    /// A load from an unmapped address (#PF).
    Unmapped,
    /// A store to the read-only scratch page (#PF).
    ReadOnly,
    /// `div` by zero (#DE).
    Divide,
    /// `int3` (#BP, a trap).
    Breakpoint,
    /// `int 0x30..0x3f`, a software interrupt through the IDT.
    SoftInt(u8),
}

/// Inter-processor interrupts the program sends without harming itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpiKind {
    /// A fixed vector to itself (shorthand self), then taken with STI.
    FixedSelf(u8),
    /// An NMI to itself.
    NmiSelf,
    /// An INIT to an APIC ID no CPU has.
    InitNobody(u8),
    /// A SIPI to itself (ignored: it is running).
    SipiSelf(u8),
    /// An INIT level de-assert to all (ignored by modern APICs).
    InitDeassertAll,
    /// A fixed vector to an APIC ID no CPU has.
    FixedNobody(u8, u8),
    /// A fixed vector (0xF0..0xFE: the other vCPUs count it apart) to all
    /// but itself.
    FixedOthers(u8),
    /// The same to all, itself included.
    FixedAll(u8),
    /// An NMI to all but itself.
    NmiOthers,
}

/// Vectors from here up are the ones vCPUs send each other: their arrival
/// is counted apart and never reaches a digest (it depends on timing).
pub const FOREIGN_VECTORS: u8 = 0xF0;

/// The page-table games.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtKind {
    /// Clear a scratch page's present bit and load from it.
    NotPresent(u16),
    /// Make a scratch page read-only and store to it.
    ReadOnly(u16),
    /// Map scratch page `a` onto page `b`'s frame, store through `a`, load
    /// through `b`.
    Alias(u16, u16),
    /// Rewrite the page-directory entry that maps the running code (the
    /// accessed and dirty bits cleared), then invalidate it.
    OwnCode,
    /// Switch CR3 to an identical copy of the top table and back.
    CopyCr3,
}

/// One operation with its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// CPUID with EAX = `leaf`, ECX = `sub`.
    Cpuid { leaf: u32, sub: u32 },
    /// RDMSR.
    Rdmsr { msr: u32 },
    /// WRMSR, read back, then the old value written again.
    Wrmsr { msr: u32, value: u64 },
    /// IN of `width` bytes.
    In { port: u16, width: u8 },
    /// OUT of `width` bytes.
    Out { port: u16, width: u8, value: u32 },
    /// MOV to CR0 of CR0 ^ `flip`, read back, restore.
    Cr0 { flip: u64 },
    /// MOV to CR3 of the program's own top table with `low` in the low and
    /// high bits, read back, restore.
    Cr3 { bits: u64 },
    /// MOV to CR4 of CR4 ^ `flip`, read back, restore.
    Cr4 { flip: u64 },
    /// XSETBV (with CR4.OSXSAVE set), XGETBV back, restore.
    Xsetbv { xcr: u32, value: u64 },
    /// INVLPG.
    Invlpg { addr: u64 },
    /// INVPCID with a descriptor.
    Invpcid { kind: u64, pcid: u64, addr: u64 },
    /// VMCALL with random registers, from `offset` in an executable page.
    Vmcall {
        rax: u64,
        rbx: u64,
        rcx: u64,
        rdx: u64,
        offset: u16,
    },
    /// An aligned 32-bit store to an APIC register, by MOV from a
    /// register (`form` 0), MOV of an immediate (1) or XCHG (2), then a
    /// load of the register back. (Bochs itself stops on any other width
    /// or alignment, so the bare oracle cannot run those.)
    ApicStore { offset: u16, form: u8, value: u32 },
    /// A load from the APIC page within one register's first dword.
    ApicLoad { offset: u16, width: u8 },
    /// A store and a load in the rest of the 0xFEE00000 MiB.
    MmioStore { offset: u32, width: u8, value: u64 },
    /// An interrupt command.
    Ipi(IpiKind),
    /// MOV to DR`reg`, read back, restore (DR7 cleared after).
    Dr { reg: u8, value: u64 },
    /// One single step over a NOP with RFLAGS.TF.
    Step,
    /// A data breakpoint (DR0, `len`, `rw`) on a variable, then a store.
    Watch { len: u8, rw: u8 },
    /// HLT woken by a self IPI (`timer` false) or the APIC timer.
    Hlt { timer: bool, vector: u8 },
    /// A fault on purpose.
    Fault(FaultKind),
    /// A call to an address where no RAM is: the hole above RAM below
    /// 4 GiB, and above 4 GiB.
    Fetch { addr: u64 },
    /// A page-table game.
    PageTable(PtKind),
    /// A call of hooked function `f` (at kernel-text addresses; the host
    /// may have hooked it).
    HookCall { f: u8, arg: u64 },
    /// A read of 8 bytes of the hooked text page (its code included).
    HookRead { offset: u16 },
    /// A store to a word in the hooked text page, read back.
    HookWrite { value: u64 },
    /// A hardware task switch from legacy protected mode (one vCPU only:
    /// the program has no 32-bit IDT, and another vCPU's NMI there would
    /// end it): JMP (`call` false) or CALL to a second task whose registers
    /// (`regs`) and arithmetic flags (`flags`) come from its TSS, and back
    /// (by JMP, or IRET through the back link).
    TaskSwitch {
        call: bool,
        regs: [u32; 4],
        flags: u32,
    },
    /// In tracer mode: a load from (`run` false) or a call into (`run`
    /// true) root's trampoline page at `offset`, where root maps it with
    /// hooks in ([`crate::TRAMPOLINE_PAGE`]); the middle of its code too.
    Trampoline { offset: u16, run: bool },
    /// A far jump into 32-bit (`bits` 32) or 16-bit compatibility-mode code
    /// that runs CPUID with `leaf` (32-bit only) and jumps back.
    Far { bits: u8, leaf: u32 },
}

/// Where the draw stands: the program's shape, so that ops can be kept
/// safe and per-vCPU.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// vCPU index (0 is the boot CPU).
    pub cpu: u32,
    /// How many vCPUs run.
    pub cpus: u32,
    /// Tracer mode (IA32_LSTAR is never written).
    pub tracer: bool,
}

/// A number per operation kind (`fuzz.skip` takes a mask of them).
pub fn kind(op: &Op) -> u32 {
    match op {
        Op::Cpuid { .. } => 0,
        Op::Rdmsr { .. } => 1,
        Op::Wrmsr { .. } => 2,
        Op::In { .. } => 3,
        Op::Out { .. } => 4,
        Op::Cr0 { .. } => 5,
        Op::Cr3 { .. } => 6,
        Op::Cr4 { .. } => 7,
        Op::Xsetbv { .. } => 8,
        Op::Invlpg { .. } => 9,
        Op::Invpcid { .. } => 10,
        Op::Vmcall { .. } => 11,
        Op::ApicStore { .. } => 12,
        Op::ApicLoad { .. } => 13,
        Op::MmioStore { .. } => 14,
        Op::Ipi(_) => 15,
        Op::Dr { .. } => 16,
        Op::Step => 17,
        Op::Watch { .. } => 18,
        Op::Hlt { .. } => 19,
        Op::Fault(_) => 20,
        Op::Fetch { .. } => 21,
        Op::PageTable(_) => 22,
        Op::Far { .. } => 23,
        Op::HookCall { .. } => 24,
        Op::HookRead { .. } => 25,
        Op::HookWrite { .. } => 26,
        Op::Trampoline { .. } => 27,
        Op::TaskSwitch { .. } => 28,
    }
}

/// MSRs worth trying: the ones root intercepts or emulates, the
/// architectural ones around them and a few ranges nobody uses.
pub const MSRS: &[u32] = &[
    0x10,
    0x1B,
    0x3A,
    0x48,
    0x49,
    0x8B,
    0xE7,
    0xE8,
    0xFE,
    0x174,
    0x175,
    0x176,
    0x179,
    0x17A,
    0x1A0,
    0x1D9,
    0x200,
    0x201,
    0x250,
    0x277,
    0x2FF,
    0x400,
    0x401,
    0x480,
    0x481,
    0x482,
    0x483,
    0x484,
    0x485,
    0x486,
    0x487,
    0x488,
    0x489,
    0x48A,
    0x48B,
    0x48C,
    0x48D,
    0x48E,
    0x48F,
    0x490,
    0x491,
    0x6E0,
    0x802,
    0x80F,
    0x830,
    0xC000_0080,
    0xC000_0081,
    0xC000_0082,
    0xC000_0083,
    0xC000_0084,
    0xC000_0100,
    0xC000_0101,
    0xC000_0102,
    0xC000_0103,
    0x4000_0000,
    0x4000_0001,
    0x4B56_4D00,
    0x4B56_4D01,
];

/// MSRs the program never writes, because the bare machine would not
/// survive it or the write is not undone: the APIC base (moves or disables
/// the APIC), EFER (long mode), microcode loads and the TSC (time moves for
/// the rest of the run).
pub const MSR_NEVER_WRITTEN: &[u32] = &[0x10, 0x1B, 0x79, 0xC000_0080, 0x3B, 0x6E0];

/// IA32_LSTAR: in tracer mode it must keep pointing at the hooked text.
pub const LSTAR: u32 = 0xC000_0082;

/// Ports root watches or that are worth a try with every width.
pub const PORTS: &[u16] = &[
    0xCF8, 0xCFA, 0xCFC, 0xCFD, 0xCFE, 0xCFF, 0x2F8, 0x2F9, 0x2FA, 0x2FB, 0x2FC, 0x2FD, 0x2FE,
    0x2FF, 0xE9, 0x3F8, 0x3FD, 0x3FF, 0x402, 0x80, 0x61,
];

/// Whether an OUT to `port` of `width` bytes is kept out of the program:
/// resets (0x64, 0x92, 0xCF9), the PIC (it would unmask interrupts), SMI
/// (0xB2), Bochs' shutdown and debugger ports and its BIOS's and VGA
/// BIOS's message ports (a write to their panic port stops Bochs), the ACPI PM block (power
/// off), the DMA controllers, the floppy controller and the CMOS clock
/// (DMA, and Bochs stops on a command or divider it does not expect), COM1 (the digests' line; its scratch register is allowed), the
/// IDE command blocks and every PCI I/O BAR at 0xC000 and up (DMA).
pub fn out_forbidden(port: u16, width: u8) -> bool {
    let last = u32::from(port) + u32::from(width) - 1;
    let hits = |lo: u32, hi: u32| u32::from(port) <= hi && last >= lo;
    hits(0x00, 0x1F)
        || hits(0x20, 0x21)
        || hits(0x60, 0x64)
        || hits(0x70, 0x71)
        || hits(0x81, 0x8F)
        || hits(0xC0, 0xDF)
        || hits(0x3F0, 0x3F7)
        || hits(0x92, 0x92)
        || hits(0xA0, 0xA1)
        || hits(0xB2, 0xB3)
        || hits(0x170, 0x177)
        || hits(0x1F0, 0x1F7)
        || hits(0x370, 0x377)
        || hits(0x3F6, 0x3F6)
        || hits(0x3F8, 0x3FE)
        || hits(0x400, 0x4FF)
        || hits(0x500, 0x503)
        || hits(0x8900, 0x8900)
        || (hits(0xCF9, 0xCF9) && !(port == 0xCF8 && width == 4))
        || hits(0xCFC, 0xCFF)
        || last >= 0xB000
        || last > 0xFFFF
}

/// Ports whose reads change with time or with output timing (the PICs'
/// requests, timers, refresh toggles, status bits, the serial lines): their values are
/// left out of the digests, their faults are not.
pub fn volatile_port(port: u16, width: u8) -> bool {
    let last = u32::from(port) + u32::from(width) - 1;
    let hits = |lo: u32, hi: u32| u32::from(port) <= hi && last >= lo;
    // The PICs' request registers: the timer's line comes and goes (and
    // COM2's is root's).
    hits(0x20, 0x20)
        || hits(0xA0, 0xA0)
        || hits(0x40, 0x43)
        || hits(0x60, 0x64)
        || hits(0x61, 0x61)
        || hits(0x70, 0x71)
        || hits(0x170, 0x177)
        || hits(0x1F0, 0x1F7)
        || hits(0x2F8, 0x2FF)
        || hits(0x376, 0x376)
        || hits(0x3B0, 0x3DF)
        || hits(0x3F6, 0x3F6)
        || hits(0x3F8, 0x3FF)
        || last >= 0xB000
}

/// MSRs whose values move with time.
pub fn volatile_msr(msr: u32) -> bool {
    matches!(msr, 0x10 | 0xE7 | 0xE8 | 0x6E0 | 0x3B)
}

/// APIC registers (offsets) that are never stored to at random: the ID
/// (IPIs find CPUs by it), the task priority (it blocks the HLT
/// operation's wake-up), the spurious vector (it disables the APIC), the
/// ICR (the IPI operations own it), the LVTs (unmasked, they deliver) and
/// the timer.
pub fn apic_store_forbidden(offset: u16) -> bool {
    matches!(
        offset & !0xF,
        0x20 | 0x80 | 0xF0 | 0x2F0 | 0x300 | 0x310 | 0x320..=0x370 | 0x380 | 0x3E0
    )
}

/// APIC registers whose reads move with time or with interrupts from the
/// other vCPUs: the arbitration and processor priorities (they follow the
/// requests pending), the timer's current count, and the ISR/TMR/IRR words.
pub fn volatile_apic(offset: u16) -> bool {
    let reg = offset & !0xF;
    matches!(reg, 0x90 | 0xA0 | 0x390 | 0x100..=0x270 | 0x280 | 0x300)
}

/// Draws the next operation.
pub fn draw(r: &mut Rng, shape: Shape) -> Op {
    // Weights: (weight, kind). Port I/O and PCI are shared machine state,
    // so only the boot CPU touches them; every other op is per-vCPU.
    let boot = shape.cpu == 0;
    let total = if boot { 106 } else { 92 }
        + if shape.tracer { 2 } else { 0 }
        + if shape.cpus == 1 { 2 } else { 0 };
    let mut roll = r.below(total);
    let mut take = |w: u64| {
        if roll < w {
            true
        } else {
            roll -= w;
            false
        }
    };
    if take(12) {
        return Op::Cpuid {
            leaf: match r.below(4) {
                0 => r.below(0x24) as u32,
                1 => 0x4000_0000 + r.below(0x12) as u32,
                2 => 0x8000_0000 + r.below(0x24) as u32,
                _ => r.next_u64() as u32,
            },
            sub: if r.chance(1, 2) {
                r.below(4) as u32
            } else {
                r.next_u64() as u32
            },
        };
    }
    if take(9) {
        return Op::Rdmsr { msr: msr(r) };
    }
    if take(8) {
        let mut m = msr(r);
        while MSR_NEVER_WRITTEN.contains(&m) || (shape.tracer && m == LSTAR) {
            m = msr(r);
        }
        return Op::Wrmsr {
            msr: m,
            value: msr_value(r),
        };
    }
    if take(4) {
        return Op::Cr0 {
            flip: pick_bits(r, &[1, 2, 3, 4, 5, 16, 18, 29, 30], &[0, 31]),
        };
    }
    if take(2) {
        return Op::Cr3 {
            bits: match r.below(3) {
                0 => r.below(0x1000),
                1 => 1 << (52 + r.below(12)),
                _ => 1 << 63 | r.below(0x1000),
            },
        };
    }
    if take(5) {
        return Op::Cr4 {
            flip: pick_bits(
                r,
                &[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 14, 16, 18, 20, 21, 22],
                &[5, 12, 13, 15, 17, 19, 23, 24, 25, 31, 40],
            ),
        };
    }
    if take(3) {
        return Op::Xsetbv {
            xcr: if r.chance(3, 4) { 0 } else { r.below(3) as u32 },
            value: if r.chance(1, 2) {
                r.below(0x100)
            } else {
                r.bits()
            },
        };
    }
    if take(2) {
        return Op::Invlpg { addr: r.bits() };
    }
    if take(2) {
        return Op::Invpcid {
            kind: if r.chance(3, 4) { r.below(4) } else { r.bits() },
            pcid: if r.chance(3, 4) {
                r.below(0x1000)
            } else {
                r.bits()
            },
            addr: r.bits(),
        };
    }
    if take(5) {
        return Op::Vmcall {
            rax: r.bits(),
            rbx: r.bits(),
            rcx: r.bits(),
            rdx: r.bits(),
            offset: r.below(4096 - 4) as u16,
        };
    }
    if take(7) {
        let mut offset = (r.below(0x40) as u16) << 4;
        while apic_store_forbidden(offset) {
            offset = (r.below(0x40) as u16) << 4;
        }
        return Op::ApicStore {
            offset,
            form: r.below(3) as u8,
            value: r.bits() as u32,
        };
    }
    if take(4) {
        let width = r.pick(&[1u8, 2, 4]);
        let reg = (r.below(0x40) as u16) << 4;
        let within = match width {
            1 => r.below(4) as u16,
            2 => 2 * r.below(2) as u16,
            _ => 0,
        };
        return Op::ApicLoad {
            offset: reg + within,
            width,
        };
    }
    if take(2) {
        return Op::MmioStore {
            offset: 0x1000 + r.below(0xF_F000 - 8) as u32,
            width: r.pick(&[1u8, 2, 4, 8]),
            value: r.bits(),
        };
    }
    if take(4) {
        let v = 0x40 + r.below(0xB0) as u8;
        let foreign = FOREIGN_VECTORS + r.below(0xF) as u8;
        return Op::Ipi(match r.below(9) {
            6 => IpiKind::FixedOthers(foreign),
            7 => IpiKind::FixedAll(foreign),
            8 => IpiKind::NmiOthers,
            0 => IpiKind::FixedSelf(v),
            1 => IpiKind::NmiSelf,
            2 => IpiKind::InitNobody(0x80 + r.below(0x7F) as u8),
            3 => IpiKind::SipiSelf(r.next_u64() as u8),
            4 => IpiKind::InitDeassertAll,
            _ => IpiKind::FixedNobody(0x80 + r.below(0x7F) as u8, v),
        });
    }
    if take(3) {
        let reg = r.pick(&[0u8, 1, 2, 3, 4, 5, 6, 7]);
        return Op::Dr {
            reg,
            value: if reg == 7 || reg == 5 {
                // Enables with random conditions, never GD (bit 13).
                r.bits() & !(1 << 13)
            } else {
                r.bits()
            },
        };
    }
    if take(2) {
        return Op::Step;
    }
    if take(2) {
        return Op::Watch {
            len: r.pick(&[0u8, 1, 3]),
            rw: r.pick(&[1u8, 3]),
        };
    }
    if take(2) {
        return Op::Hlt {
            timer: r.chance(1, 2),
            vector: 0x40 + r.below(0xB0) as u8,
        };
    }
    if take(5) {
        return Op::Fault(match r.below(7) {
            0 => FaultKind::Ud2,
            1 => FaultKind::NonCanonical,
            2 => FaultKind::Unmapped,
            3 => FaultKind::ReadOnly,
            4 => FaultKind::Divide,
            5 => FaultKind::Breakpoint,
            _ => FaultKind::SoftInt(0x30 + r.below(0x10) as u8),
        });
    }
    if take(2) {
        return Op::Fetch {
            // (Not the MMIO pages near the APICs: Bochs itself stops on a
            // fetch from some of them.)
            addr: match r.below(2) {
                // Above RAM, below the PCI hole's devices.
                0 => 0xC000_0000 + (r.below(0x1000_0000) & !0xF),
                // Above 4 GiB, where the guest has no RAM.
                _ => 0x1_0000_0000 + (r.below(0x4000_0000) & !0xF),
            },
        };
    }
    if take(3) {
        let p = |r: &mut Rng| 1 + r.below(510) as u16;
        return Op::PageTable(match r.below(5) {
            0 => PtKind::NotPresent(p(r)),
            1 => PtKind::ReadOnly(p(r)),
            2 => PtKind::Alias(p(r), p(r)),
            3 => PtKind::OwnCode,
            _ => PtKind::CopyCr3,
        });
    }
    if take(6) {
        // The word fz_hook_3 and the store use are the boot CPU's alone.
        return match r.below(if boot { 4 } else { 2 }) {
            0 | 1 => Op::HookCall {
                f: r.below(if boot { 4 } else { 3 }) as u8,
                arg: r.below(1 << 20),
            },
            2 => Op::HookRead {
                offset: r.below(4096 - 8) as u16,
            },
            _ => Op::HookWrite {
                value: r.next_u64(),
            },
        };
    }
    if shape.cpus == 1 && take(2) {
        // CF, PF, AF, ZF, SF, DF, OF and AC at random; never IF, TF or NT.
        let arith = 0x1 | 0x4 | 0x10 | 0x40 | 0x80 | 0x400 | 0x800 | 0x4_0000;
        return Op::TaskSwitch {
            call: r.chance(1, 2),
            regs: [
                r.next_u64() as u32,
                r.next_u64() as u32,
                r.next_u64() as u32,
                r.next_u64() as u32,
            ],
            flags: (r.next_u64() as u32) & arith,
        };
    }
    if shape.tracer && take(2) {
        return Op::Trampoline {
            offset: r.below(0x200) as u16,
            run: r.chance(1, 2),
        };
    }
    if take(3) {
        return Op::Far {
            bits: if r.chance(1, 2) { 32 } else { 16 },
            leaf: r.below(0x20) as u32,
        };
    }
    // The boot CPU's share: port I/O.
    let width = r.pick(&WIDTHS);
    let port = if r.chance(1, 2) {
        r.pick(PORTS)
    } else {
        r.below(0x1_0000 - 4) as u16
    };
    if r.chance(1, 2) {
        Op::In { port, width }
    } else {
        let mut port = port;
        while out_forbidden(port, width) {
            port = if r.chance(1, 2) {
                r.pick(PORTS)
            } else {
                r.below(0xB000) as u16
            };
        }
        Op::Out {
            port,
            width,
            value: r.next_u64() as u32,
        }
    }
}

/// An MSR number: a listed one, or from the architectural and extended
/// ranges, or anything.
fn msr(r: &mut Rng) -> u32 {
    match r.below(4) {
        0 | 1 => r.pick(MSRS),
        2 => {
            if r.chance(1, 2) {
                r.below(0x1000) as u32
            } else {
                0xC000_0000 + r.below(0x200) as u32
            }
        }
        _ => r.next_u64() as u32,
    }
}

/// A value for WRMSR: small, a single bit, non-canonical, or random.
fn msr_value(r: &mut Rng) -> u64 {
    match r.below(4) {
        0 => r.below(0x100),
        1 => 0x8000_0000_0000 | r.below(0x1_0000),
        2 => 0xFFFF_8000_0000_0000 | r.below(0x1_0000_0000),
        _ => r.bits(),
    }
}

/// One or two bits from `common`, now and then one from `rare`.
fn pick_bits(r: &mut Rng, common: &[u64], rare: &[u64]) -> u64 {
    let mut v = 1 << r.pick(common);
    if r.chance(1, 3) {
        v |= 1 << r.pick(common);
    }
    if r.chance(1, 8) {
        v |= 1 << r.pick(rare);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_reproducible_and_varied() {
        let shape = Shape {
            cpu: 0,
            cpus: 1,
            tracer: false,
        };
        let mut a = Rng::new(5, 0);
        let mut b = Rng::new(5, 0);
        let mut kinds = [0u32; 32];
        // (Trampoline ops only come in tracer mode.)
        for _ in 0..20_000 {
            let op = draw(&mut a, shape);
            assert_eq!(op, draw(&mut b, shape));
            let k = kind(&op) as usize;
            kinds[k] += 1;
        }
        assert!(kinds[..27].iter().all(|&n| n > 50), "{kinds:?}");
        assert!(kinds[28] > 50, "{kinds:?}");
    }

    #[test]
    fn drawn_ops_respect_the_safety_lists() {
        for cpu in 0..2 {
            let shape = Shape {
                cpu,
                cpus: 2,
                tracer: cpu == 1,
            };
            let mut r = Rng::new(9, cpu);
            for _ in 0..50_000 {
                match draw(&mut r, shape) {
                    Op::Out { port, width, .. } => {
                        assert_eq!(cpu, 0);
                        assert!(!out_forbidden(port, width), "{port:#x}/{width}");
                    }
                    Op::In { .. } => assert_eq!(cpu, 0),
                    Op::Wrmsr { msr, .. } => {
                        assert!(!MSR_NEVER_WRITTEN.contains(&msr));
                        assert!(!(shape.tracer && msr == LSTAR));
                    }
                    Op::HookCall { f: 3, .. } | Op::HookWrite { .. } => assert_eq!(cpu, 0),
                    Op::ApicStore { offset, .. } => {
                        assert!(!apic_store_forbidden(offset));
                        assert_eq!(offset % 16, 0);
                    }
                    Op::ApicLoad { offset, width } => {
                        // Bochs stops on a load that spans a dword.
                        assert_eq!(offset / 4, (offset + u16::from(width) - 1) / 4);
                        assert!(offset % 16 < 4);
                    }
                    Op::Dr { reg: 7, value } => assert_eq!(value & (1 << 13), 0),
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn forbidden_ports_cover_the_machine_killers() {
        for (port, width) in [
            (0x64, 1),
            (0x92, 1),
            (0xCF9, 1),
            (0xCF8, 2),
            (0xB2, 1),
            (0x8900, 2),
            (0xB004, 2),
            (0x3F8, 1),
            (0x21, 1),
            (0x502, 1),
            (0x377, 1),
            (0xCF8, 2),
            (0x1F7, 1),
            (0xC000, 1),
        ] {
            assert!(out_forbidden(port, width), "{port:#x}/{width}");
        }
        for (port, width) in [(0xCF8, 4), (0x3FF, 1), (0x2F8, 1), (0xE9, 1), (0x80, 1)] {
            assert!(!out_forbidden(port, width), "{port:#x}/{width}");
        }
    }
}
