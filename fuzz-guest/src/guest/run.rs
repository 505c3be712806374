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

/// A load of `width` bytes at `at`, under the recovery point.
fn load_at(width: u8, at: u64) -> Done {
    run(
        load(width),
        Regs {
            rdi: at,
            ..Regs::default()
        },
    )
}

/// A store of `width` bytes of `value` at `at`, under the recovery point.
fn store_at(width: u8, at: u64, value: u64) -> Done {
    run(
        store(width),
        Regs {
            rax: value,
            rdi: at,
            ..Regs::default()
        },
    )
}

/// The stub that stores `width` bytes.
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
            let back = load_at(4, at);
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
            let d = load_at(width, apic::BASE + u64::from(offset));
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
            let d = store_at(width, at, value);
            let back = load_at(width, at);
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
            let d = store_at(8, at, 0x5A5A);
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
                FaultKind::NonCanonical => load_at(8, 0x8000_0000_0000),
                FaultKind::Unmapped => load_at(8, 0x2_0000_1000 + 8 * cpu as u64 + (1 << 33)),
                FaultKind::ReadOnly => store_at(1, SCRATCH_BASE, 0),
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
                load_at(8, at)
            };
            let v = if go { 0 } else { d.regs.rax };
            outcome(&d, [v, 0, 0, 0])
        }
        Op::TaskSwitch { call, regs, flags } => task_switch(call, regs, flags, cpu),
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

/// A 32-bit TSS (SDM Figure 9-2), as the task switches read and write it.
#[repr(C, align(128))]
#[derive(Clone, Copy, Default)]
struct Tss32 {
    link: u32,
    stacks: [u32; 6],
    cr3: u32,
    eip: u32,
    eflags: u32,
    gprs: [u32; 8],
    segs: [u32; 6],
    ldt: u32,
    trap: u16,
    iomap: u16,
}

const _: () = assert!(core::mem::offset_of!(Tss32, eip) == 0x20);
const _: () = assert!(core::mem::offset_of!(Tss32, gprs) == 0x28);
const _: () = assert!(core::mem::offset_of!(Tss32, segs) == 0x48);
const _: () = assert!(core::mem::offset_of!(Tss32, iomap) == 0x66);

/// Each vCPU's two tasks, and task 2's stack (its registers land there).
static mut TASKS: [[Tss32; 2]; crate::MAX_CPUS] = [[Tss32 {
    link: 0,
    stacks: [0; 6],
    cr3: 0,
    eip: 0,
    eflags: 0,
    gprs: [0; 8],
    segs: [0; 6],
    ldt: 0,
    trap: 0,
    iomap: 0,
}; 2]; crate::MAX_CPUS];
static mut TASK_STACKS: [[u32; 64]; crate::MAX_CPUS] = [[0; 64]; crate::MAX_CPUS];

fn fold32(words: &[u32]) -> u64 {
    let mut d = fuzz_guest::digest::Digest::new();
    for w in words {
        d.add(u64::from(*w));
    }
    d.0
}

fn task_switch(call: bool, regs: [u32; 4], flags: u32, cpu: usize) -> Outcome {
    let tasks = core::ptr::addr_of_mut!(TASKS);
    let stacks = core::ptr::addr_of_mut!(TASK_STACKS);
    let gdt = core::ptr::addr_of_mut!(boot::fz_gdt);
    let sel1 = 0x70 + 16 * cpu as u16;
    let sel2 = sel1 + 8;
    let cr3 = read_cr(exec::fz_s_rdcr3);
    // SAFETY: this vCPU's own TSSs, stack and GDT slots, set up before the
    // switch (all below 4 GiB, as legacy mode needs) and read after it.
    unsafe {
        let stack = &mut (*stacks)[cpu];
        *stack = [0; 64];
        // Task 2 returns (when jumped to) through the far pointer at its
        // initial stack top: offset 0, task 1's selector.
        stack[60] = 0;
        stack[61] = u32::from(sel1);
        let top = core::ptr::addr_of!(stack[60]) as u64;
        let t = &mut (*tasks)[cpu];
        t[0] = Tss32 {
            iomap: 104,
            ..Tss32::default()
        };
        t[1] = Tss32 {
            cr3: cr3 as u32,
            eip: core::ptr::addr_of!(exec::fz_task2_entry) as u32,
            eflags: 0x2 | flags,
            gprs: [
                regs[0],
                regs[1],
                regs[2],
                regs[3],
                top as u32,
                0,
                0x1000 | regs[0] >> 16,
                regs[1] >> 8,
            ],
            segs: [0x10, 0x18, 0x10, 0x10, 0x10, 0x10],
            iomap: 104,
            ..Tss32::default()
        };
        for (k, sel) in [(0usize, sel1), (1, sel2)] {
            let base = core::ptr::addr_of!(t[k]) as u64;
            (*gdt)[usize::from(sel) / 8] =
                103 | (base & 0xFF_FFFF) << 16 | 0x89 << 40 | ((base >> 24) & 0xFF) << 56;
        }
    }
    let d = run(
        stub(exec::fz_s_task),
        Regs {
            rax: u64::from(call),
            rbx: u64::from(sel1),
            rcx: u64::from(sel2),
            ..Regs::default()
        },
    );
    // Back in long mode: our own TSS again (its busy bit cleared first).
    crate::traps::reload_tss(cpu);
    // SAFETY: as above, after the switches.
    let (t1, t2, pushed, types) = unsafe {
        let t = &(*tasks)[cpu];
        let words = |x: &Tss32| {
            let mut v = [0u32; 26];
            v[0] = x.link;
            v[1] = x.eip;
            v[2] = x.eflags;
            v[3..11].copy_from_slice(&x.gprs);
            v[11..17].copy_from_slice(&x.segs);
            v
        };
        let stack = &(*stacks)[cpu];
        let types = ((*gdt)[usize::from(sel1) / 8] >> 40) & 0xF
            | (((*gdt)[usize::from(sel2) / 8] >> 40) & 0xF) << 4;
        (
            fold32(&words(&t[0])),
            fold32(&words(&t[1])),
            fold32(&stack[52..60]),
            types,
        )
    };
    outcome(&d, [t1, t2, pushed, types])
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
        // For an NMI to itself, whether one came (not how many: another
        // vCPU's may come too, and NMIs pending together merge); for the
        // others nothing, another vCPU's NMI may come at any time.
        vals: [
            pc.last_irq,
            u64::from(matches!(kind, IpiKind::NmiSelf) && pc.nmis > nmis),
            esr,
            0,
        ],
    }
}

fn page_table(kind: PtKind, cpu: usize) -> Outcome {
    let pt = core::ptr::addr_of_mut!(boot::fz_scratch_pt);
    let entry = |i: u16| usize::from(fuzz_guest::scratch_entry(i, cpu as u32));
    let page = |i: u16| SCRATCH_BASE + entry(i) as u64 * 4096 + 64 * cpu as u64;
    let get = |i: u16| {
        // SAFETY: the scratch page table is the program's own; each vCPU
        // plays with entries of its own (`scratch_entry`) and invalidates
        // what it changed.
        unsafe { (*pt)[entry(i)] }
    };
    let set = |i: u16, v: u64| {
        // SAFETY: as `get`.
        unsafe { (*pt)[entry(i)] = v }
    };
    match kind {
        PtKind::NotPresent(i) => {
            let old = get(i);
            set(i, old & !1);
            invlpg(page(i));
            let d = load_at(8, page(i));
            set(i, old);
            invlpg(page(i));
            outcome(&d, [0; 4])
        }
        PtKind::ReadOnly(i) => {
            let old = get(i);
            set(i, old & !2);
            invlpg(page(i));
            let d = store_at(8, page(i), 7);
            set(i, old);
            invlpg(page(i));
            outcome(&d, [0; 4])
        }
        PtKind::Alias(a, b) => {
            let old = get(a);
            set(a, (get(b) & !0xFFF) | 3);
            invlpg(page(a));
            let value = 0x1234_0000 | u64::from(a) << 16 | u64::from(b);
            store_at(8, page(a), value);
            set(a, old);
            invlpg(page(a));
            let d = load_at(8, page(b));
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
