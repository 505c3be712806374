//! Carrying out one operation and recording its outcome.

use fuzz_guest::known::{Outcome, NO_FAULT};
use fuzz_guest::ops::{self, FaultKind, IpiKind, Op, PtKind};
use fuzz_guest::SCRATCH_BASE;

use crate::apic;
use crate::boot;
use crate::exec::{self, run, stub, Done, Regs};
use crate::percpu;

/// Executable bytes the VMCALL operation writes its instruction into.
#[repr(C, align(4096))]
struct CodePage([u8; 4096]);

static mut VMCALL_PAGE: [CodePage; crate::MAX_CPUS] =
    [const { CodePage([0xCC; 4096]) }; crate::MAX_CPUS];

/// The variable the data-breakpoint operation watches.
static mut WATCHED: [u64; crate::MAX_CPUS] = [0; crate::MAX_CPUS];

fn outcome(d: &Done, vals: [u64; 4]) -> Outcome {
    match d.fault {
        Some((vector, error, addr)) => Outcome {
            vector,
            error,
            addr,
            vals,
        },
        None => Outcome {
            vector: NO_FAULT,
            error: 0,
            addr: 0,
            vals,
        },
    }
}

fn regs(rax: u64, rcx: u64, rdx: u64) -> Regs {
    Regs {
        rax,
        rcx,
        rdx,
        ..Regs::default()
    }
}

fn read_msr(msr: u32) -> Done {
    run(stub(exec::fz_s_rdmsr), regs(0, u64::from(msr), 0))
}

fn write_msr(msr: u32, v: u64) -> Done {
    run(
        stub(exec::fz_s_wrmsr),
        regs(v & 0xFFFF_FFFF, u64::from(msr), v >> 32),
    )
}

fn msr_value(d: &Done) -> u64 {
    (d.regs.rdx & 0xFFFF_FFFF) << 32 | (d.regs.rax & 0xFFFF_FFFF)
}

fn fault_vector(d: &Done) -> u64 {
    d.fault.map_or(u64::from(NO_FAULT), |f| u64::from(f.0))
}

fn invlpg(addr: u64) {
    // SAFETY: invalidates one TLB entry.
    unsafe { core::arch::asm!("invlpg [{}]", in(reg) addr, options(nostack)) };
}

fn read_cr(target: unsafe extern "C" fn()) -> u64 {
    run(stub(target), Regs::default()).regs.rax
}

/// A stored value of `width` bytes.
fn store(width: u8) -> u64 {
    match width {
        1 => stub(exec::fz_s_st8),
        2 => stub(exec::fz_s_st16),
        4 => stub(exec::fz_s_st32),
        _ => stub(exec::fz_s_st64),
    }
}

fn load(width: u8) -> u64 {
    match width {
        1 => stub(exec::fz_s_ld8),
        2 => stub(exec::fz_s_ld16),
        4 => stub(exec::fz_s_ld32),
        _ => stub(exec::fz_s_ld64),
    }
}

fn mask(width: u8, v: u64) -> u64 {
    match width {
        1 => v & 0xFF,
        2 => v & 0xFFFF,
        4 => v & 0xFFFF_FFFF,
        _ => v,
    }
}

/// Carries out `op` on this vCPU.
pub fn execute(op: &Op, cpu: usize) -> Outcome {
    let no = [0u64; 4];
    match *op {
        Op::Cpuid { leaf, sub } => {
            let d = run(
                stub(exec::fz_s_cpuid),
                regs(u64::from(leaf), u64::from(sub), 0),
            );
            let r = d.regs;
            outcome(
                &d,
                [
                    r.rax & 0xFFFF_FFFF,
                    r.rbx & 0xFFFF_FFFF,
                    r.rcx & 0xFFFF_FFFF,
                    r.rdx & 0xFFFF_FFFF,
                ],
            )
        }
        Op::Rdmsr { msr } => {
            let d = read_msr(msr);
            let v = if ops::volatile_msr(msr) || d.fault.is_some() {
                0
            } else {
                msr_value(&d)
            };
            outcome(&d, [v, 0, 0, 0])
        }
        Op::Wrmsr { msr, value } => {
            let old = read_msr(msr);
            let w = write_msr(msr, value);
            let back = read_msr(msr);
            if w.fault.is_none() && old.fault.is_none() {
                write_msr(msr, msr_value(&old));
            }
            let v = if ops::volatile_msr(msr) || back.fault.is_some() {
                0
            } else {
                msr_value(&back)
            };
            outcome(&w, [fault_vector(&old), fault_vector(&back), v, 0])
        }
        Op::In { port, width } => {
            let s = match width {
                1 => stub(exec::fz_s_in8),
                2 => stub(exec::fz_s_in16),
                _ => stub(exec::fz_s_in32),
            };
            let d = run(s, regs(0, 0, u64::from(port)));
            let v = if ops::volatile_port(port, width) {
                0
            } else {
                mask(width, d.regs.rax)
            };
            outcome(&d, [v, 0, 0, 0])
        }
        Op::Out { port, width, value } => {
            let s = match width {
                1 => stub(exec::fz_s_out8),
                2 => stub(exec::fz_s_out16),
                _ => stub(exec::fz_s_out32),
            };
            let d = run(s, regs(u64::from(value), 0, u64::from(port)));
            outcome(&d, no)
        }
        Op::Cr0 { flip } => {
            let old = read_cr(exec::fz_s_rdcr0);
            let w = run(stub(exec::fz_s_wrcr0), regs(old ^ flip, 0, 0));
            let back = read_cr(exec::fz_s_rdcr0);
            run(stub(exec::fz_s_wrcr0), regs(old, 0, 0));
            outcome(&w, [back, 0, 0, 0])
        }
        Op::Cr3 { bits } => {
            let old = read_cr(exec::fz_s_rdcr3);
            let w = run(stub(exec::fz_s_wrcr3), regs((old & !0xFFF) | bits, 0, 0));
            let back = read_cr(exec::fz_s_rdcr3);
            run(stub(exec::fz_s_wrcr3), regs(old, 0, 0));
            outcome(&w, [back, 0, 0, 0])
        }
        Op::Cr4 { flip } => {
            let old = read_cr(exec::fz_s_rdcr4);
            let w = run(stub(exec::fz_s_wrcr4), regs(old ^ flip, 0, 0));
            let back = read_cr(exec::fz_s_rdcr4);
            run(stub(exec::fz_s_wrcr4), regs(old, 0, 0));
            outcome(&w, [back, 0, 0, 0])
        }
        Op::Xsetbv { xcr, value } => {
            let old = run(stub(exec::fz_s_xgetbv), regs(0, 0, 0));
            let w = run(
                stub(exec::fz_s_xsetbv),
                regs(value & 0xFFFF_FFFF, u64::from(xcr), value >> 32),
            );
            let back = run(stub(exec::fz_s_xgetbv), regs(0, 0, 0));
            if old.fault.is_none() {
                run(stub(exec::fz_s_xsetbv), regs(old.regs.rax, 0, old.regs.rdx));
            }
            outcome(&w, [fault_vector(&back), msr_value(&back), 0, 0])
        }
        Op::Invlpg { addr } => {
            let d = run(stub(exec::fz_s_invlpg), regs(addr, 0, 0));
            outcome(&d, no)
        }
        Op::Invpcid { kind, pcid, addr } => {
            let desc = [pcid, addr];
            let d = run(
                stub(exec::fz_s_invpcid),
                Regs {
                    rax: kind,
                    rbx: desc.as_ptr() as u64,
                    ..Regs::default()
                },
            );
            outcome(&d, no)
        }
        Op::Vmcall {
            rax,
            rbx,
            rcx,
            rdx,
            offset,
        } => {
            let page = core::ptr::addr_of_mut!(VMCALL_PAGE);
            // SAFETY: this vCPU's own page; `offset` + 4 is inside it.
            let at = unsafe { (*page)[cpu].0.as_mut_ptr().add(usize::from(offset)) };
            // SAFETY: as above: VMCALL; RET.
            unsafe { core::ptr::copy_nonoverlapping([0x0F, 0x01, 0xC1, 0xC3].as_ptr(), at, 4) };
            let d = run(
                at as u64,
                Regs {
                    rax,
                    rbx,
                    rcx,
                    rdx,
                    ..Regs::default()
                },
            );
            let r = d.regs;
            outcome(&d, [r.rax, r.rbx, r.rcx, r.rdx])
        }
        Op::ApicStore {
            offset,
            form,
            value,
        } => {
            let at = apic::BASE + u64::from(offset);
            let s = match form {
                0 => stub(exec::fz_s_st32),
                1 => stub(exec::fz_s_st32imm),
                _ => stub(exec::fz_s_xchg32),
            };
            let d = run(
                s,
                Regs {
                    rax: u64::from(value),
                    rdi: at,
                    ..Regs::default()
                },
            );
            let back = run(
                load(4),
                Regs {
                    rdi: at,
                    ..Regs::default()
                },
            );
            let v = if ops::volatile_apic(offset) {
                0
            } else {
                back.regs.rax
            };
            // XCHG's old value is a read of the register too.
            let old = if form == 2 && !ops::volatile_apic(offset) {
                d.regs.rax & 0xFFFF_FFFF
            } else {
                0
            };
            // The error status: a store to a register that does not exist
            // sets "illegal register address".
            apic::write(apic::ESR, 0);
            let esr = u64::from(apic::read(apic::ESR));
            outcome(&d, [fault_vector(&back), v, old, esr])
        }
        Op::ApicLoad { offset, width } => {
            let d = run(
                load(width),
                Regs {
                    rdi: apic::BASE + u64::from(offset),
                    ..Regs::default()
                },
            );
            let v = if ops::volatile_apic(offset) {
                0
            } else {
                mask(width, d.regs.rax)
            };
            outcome(&d, [v, 0, 0, 0])
        }
        Op::MmioStore {
            offset,
            width,
            value,
        } => {
            let at = apic::BASE + u64::from(offset);
            let d = run(
                store(width),
                Regs {
                    rax: value,
                    rdi: at,
                    ..Regs::default()
                },
            );
            let back = run(
                load(width),
                Regs {
                    rdi: at,
                    ..Regs::default()
                },
            );
            outcome(&d, [fault_vector(&back), mask(width, back.regs.rax), 0, 0])
        }
        Op::Ipi(kind) => ipi(kind),
        Op::Dr { reg, value } => {
            let r = u64::from(reg);
            let rd = stub(exec::fz_s_rddr) + 8 * r;
            let wr = stub(exec::fz_s_wrdr) + 8 * r;
            let old = run(rd, Regs::default());
            let w = run(wr, regs(value, 0, 0));
            let back = run(rd, Regs::default());
            if old.fault.is_none() {
                run(wr, regs(old.regs.rax, 0, 0));
            }
            // DR7 off again whatever happened (DR4/DR5 may alias it).
            run(stub(exec::fz_s_wrdr) + 8 * 7, regs(0x400, 0, 0));
            outcome(&w, [fault_vector(&back), back.regs.rax, 0, 0])
        }
        Op::Step => {
            let d = run(stub(exec::fz_s_step), Regs::default());
            outcome(&d, no)
        }
        Op::Watch { len, rw } => {
            let var = core::ptr::addr_of_mut!(WATCHED);
            // SAFETY: this vCPU's own slot.
            let at = unsafe { core::ptr::addr_of_mut!((*var)[cpu]) } as u64;
            run(stub(exec::fz_s_wrdr), regs(at, 0, 0));
            let dr7 = 1 | u64::from(rw) << 16 | u64::from(len) << 18;
            run(stub(exec::fz_s_wrdr) + 8 * 7, regs(dr7, 0, 0));
            let d = run(
                store(8),
                Regs {
                    rax: 0x5A5A,
                    rdi: at,
                    ..Regs::default()
                },
            );
            run(stub(exec::fz_s_wrdr) + 8 * 7, regs(0x400, 0, 0));
            run(stub(exec::fz_s_wrdr), regs(0, 0, 0));
            outcome(&d, no)
        }
        Op::Hlt { timer, vector } => {
            let pc = percpu::this();
            pc.last_irq = 0;
            if timer {
                apic::write(apic::TIMER_DIV, 0xB);
                apic::write(apic::LVT_TIMER, u32::from(vector));
                apic::write(apic::TIMER_INIT, 2000);
            } else {
                apic::ipi(0, 0x4_0000 | u32::from(vector));
            }
            // Another vCPU's IPI may wake the HLT first: again until ours.
            let mut d = run(stub(exec::fz_s_hlt), Regs::default());
            for _ in 0..1000 {
                if percpu::this().last_irq != 0 {
                    break;
                }
                d = run(stub(exec::fz_s_hlt), Regs::default());
            }
            apic::write(apic::LVT_TIMER, 0x1_0000);
            apic::write(apic::TIMER_INIT, 0);
            let got = percpu::this().last_irq;
            outcome(&d, [got, 0, 0, 0])
        }
        Op::Fault(kind) => {
            let d = match kind {
                FaultKind::Ud2 => run(stub(exec::fz_s_ud2), Regs::default()),
                FaultKind::NonCanonical => run(
                    load(8),
                    Regs {
                        rdi: 0x8000_0000_0000,
                        ..Regs::default()
                    },
                ),
                FaultKind::Unmapped => run(
                    load(8),
                    Regs {
                        rdi: 0x2_0000_1000 + 8 * cpu as u64 + (1 << 33),
                        ..Regs::default()
                    },
                ),
                FaultKind::ReadOnly => run(
                    store(1),
                    Regs {
                        rdi: SCRATCH_BASE,
                        ..Regs::default()
                    },
                ),
                FaultKind::Divide => run(stub(exec::fz_s_div), Regs::default()),
                FaultKind::Breakpoint => run(stub(exec::fz_s_int3), Regs::default()),
                FaultKind::SoftInt(n) => run(
                    stub(exec::fz_s_softint) + 4 * u64::from(n.saturating_sub(0x30) & 0xF),
                    Regs::default(),
                ),
            };
            outcome(&d, no)
        }
        Op::Fetch { addr } => {
            let d = run(addr, Regs::default());
            outcome(&d, no)
        }
        Op::PageTable(kind) => page_table(kind, cpu),
        Op::HookCall { f, arg } => {
            let ret = crate::hooked::call(f, arg);
            let word = if f == 3 { crate::hooked::word() } else { 0 };
            Outcome {
                vector: NO_FAULT,
                error: 0,
                addr: 0,
                vals: [ret, word, 0, 0],
            }
        }
        Op::Trampoline { offset, run: go } => {
            let at = fuzz_guest::TRAMPOLINE_PAGE + u64::from(offset);
            let d = if go {
                exec::run_foreign(at)
            } else {
                run(
                    load(8),
                    Regs {
                        rdi: at,
                        ..Regs::default()
                    },
                )
            };
            let v = if go { 0 } else { d.regs.rax };
            outcome(&d, [v, 0, 0, 0])
        }
        Op::HookRead { offset } => Outcome {
            vector: NO_FAULT,
            error: 0,
            addr: 0,
            vals: [crate::hooked::read(offset), 0, 0, 0],
        },
        Op::HookWrite { value } => Outcome {
            vector: NO_FAULT,
            error: 0,
            addr: 0,
            vals: [crate::hooked::write(value), 0, 0, 0],
        },
        Op::Far { bits, leaf } => {
            let s = if bits == 32 {
                stub(exec::fz_s_far32)
            } else {
                stub(exec::fz_s_far16)
            };
            let d = run(s, regs(u64::from(leaf), 0, 0));
            let r = d.regs;
            outcome(
                &d,
                [
                    r.rax & 0xFFFF_FFFF,
                    r.rbx & 0xFFFF_FFFF,
                    r.rcx & 0xFFFF_FFFF,
                    r.rdx & 0xFFFF_FFFF,
                ],
            )
        }
    }
}

fn ipi(kind: IpiKind) -> Outcome {
    let pc = percpu::this();
    let me = apic::id();
    let nmis = pc.nmis;
    pc.last_irq = 0;
    match kind {
        IpiKind::FixedSelf(v) => {
            apic::ipi(0, 0x4_0000 | u32::from(v));
            run(stub(exec::fz_s_sti), Regs::default());
        }
        IpiKind::NmiSelf => {
            apic::ipi(me, 0x400);
            for _ in 0..1000 {
                core::hint::spin_loop();
            }
        }
        IpiKind::InitNobody(id) => apic::ipi(u32::from(id), 0x4500),
        IpiKind::SipiSelf(v) => apic::ipi(me, 0x600 | u32::from(v)),
        IpiKind::InitDeassertAll => apic::ipi(0, 0x8_8500),
        IpiKind::FixedNobody(id, v) => apic::ipi(u32::from(id), u32::from(v)),
        IpiKind::FixedOthers(v) => apic::ipi(0, 0xC_0000 | u32::from(v)),
        IpiKind::FixedAll(v) => {
            apic::ipi(0, 0x8_0000 | u32::from(v));
            run(stub(exec::fz_s_sti), Regs::default());
        }
        IpiKind::NmiOthers => apic::ipi(0, 0xC_0400),
    }
    apic::write(apic::ESR, 0);
    let esr = u64::from(apic::read(apic::ESR));
    let pc = percpu::this();
    Outcome {
        vector: NO_FAULT,
        error: 0,
        addr: 0,
        // Whether an NMI came (not how many: another vCPU's may come too,
        // and NMIs pending together merge).
        vals: [pc.last_irq, u64::from(pc.nmis > nmis), esr, 0],
    }
}

fn page_table(kind: PtKind, cpu: usize) -> Outcome {
    let pt = core::ptr::addr_of_mut!(boot::fz_scratch_pt);
    let page = |i: u16| SCRATCH_BASE + u64::from(i) * 4096 + 64 * cpu as u64;
    // SAFETY (all the PTE accesses below): the scratch page table is the
    // program's own; each vCPU plays with its own pages (indices drawn
    // from its stream; a shared page only sees equal PTE values restored)
    // and invalidates what it changed.
    let get = |i: u16| unsafe { (*pt)[usize::from(i)] };
    let set = |i: u16, v: u64| unsafe { (*pt)[usize::from(i)] = v };
    match kind {
        PtKind::NotPresent(i) => {
            let old = get(i);
            set(i, old & !1);
            invlpg(page(i));
            let d = run(
                load(8),
                Regs {
                    rdi: page(i),
                    ..Regs::default()
                },
            );
            set(i, old);
            invlpg(page(i));
            outcome(&d, [0; 4])
        }
        PtKind::ReadOnly(i) => {
            let old = get(i);
            set(i, old & !2);
            invlpg(page(i));
            let d = run(
                store(8),
                Regs {
                    rdi: page(i),
                    rax: 7,
                    ..Regs::default()
                },
            );
            set(i, old);
            invlpg(page(i));
            outcome(&d, [0; 4])
        }
        PtKind::Alias(a, b) => {
            let old = get(a);
            set(a, (get(b) & !0xFFF) | 3);
            invlpg(page(a));
            let value = 0x1234_0000 | u64::from(a) << 16 | u64::from(b);
            run(
                store(8),
                Regs {
                    rdi: page(a),
                    rax: value,
                    ..Regs::default()
                },
            );
            set(a, old);
            invlpg(page(a));
            let d = run(
                load(8),
                Regs {
                    rdi: page(b),
                    ..Regs::default()
                },
            );
            outcome(&d, [d.regs.rax, 0, 0, 0])
        }
        PtKind::OwnCode => {
            let pd = core::ptr::addr_of_mut!(boot::fz_pd);
            let i = (fuzz_guest::LINK_BASE >> 21) as usize;
            // SAFETY: the entry that maps this code, rewritten with the
            // same frame and rights.
            unsafe { (*pd)[i] &= !0x60 };
            invlpg(fuzz_guest::LINK_BASE);
            // SAFETY: as above.
            let back = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*pd)[i])) };
            Outcome {
                vector: NO_FAULT,
                error: 0,
                addr: 0,
                vals: [back & !0x60, 0, 0, 0],
            }
        }
        PtKind::CopyCr3 => {
            let old = read_cr(exec::fz_s_rdcr3);
            // SAFETY: the copy of the top table maps the same tables.
            let copy = core::ptr::addr_of!(boot::fz_pml4_copy) as u64;
            let d = run(stub(exec::fz_s_wrcr3), regs(copy | (old & 0xFFF), 0, 0));
            let now = read_cr(exec::fz_s_rdcr3);
            run(stub(exec::fz_s_wrcr3), regs(old, 0, 0));
            outcome(&d, [now.wrapping_sub(copy), 0, 0, 0])
        }
    }
}
