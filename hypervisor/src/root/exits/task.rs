//! Task switches through a TSS, emulated by `hypervisor::task_switch`
//! over guest memory that every access reaches through the guarded door.

use super::guest_mem::{legacy_paging, GuardedPhys};
use super::*;

impl Vcpu<'_> {
    /// Injects a fault the task-switch emulation raised.
    pub(super) fn task_fault(
        &mut self,
        fault: hypervisor::task_switch::Fault,
    ) -> Result<Next, VmcsError> {
        match fault {
            hypervisor::task_switch::Fault::Pf(la, code) => self.page_fault(u64::from(la), code),
            other => {
                let (vector, code) = other.vector_and_code();
                self.inject(vector, Some(code))
            }
        }
    }

    /// A task switch (legacy protected mode only): emulated as the CPU
    /// would have done it (`hypervisor::task_switch`), the state copied
    /// from and back to the VMCS. An event that was being delivered
    /// through a task gate is consumed by the switch, not delivered again.
    pub(super) fn task_switch(&mut self, q: u64) -> Result<Next, VmcsError> {
        use hypervisor::task_switch::{self as ts, Outcome, Seg, Source, TaskCpu};
        let v = &mut Vmcs;
        if f::GUEST_IA32_EFER.read(v)? & policy::EFER_LMA != 0 {
            // IA-32e mode raises #GP before a task switch could exit.
            hvprintln!("error: a task switch exit in IA-32e mode: {q:#x}");
            return Ok(Next::Stop(StopReason::Unhandled(9)));
        }
        self.cpu.guard.task_switches += 1;
        let source = Source::from_qualification(q);
        let rip = f::GUEST_RIP.read(v)?;
        let len = u64::from(f::EXIT_INSTRUCTION_LEN.read(v)?);
        let event = if source == Source::Gate {
            self.cpu.vectoring.take()
        } else {
            None
        };
        let software = event.is_some_and(|e| {
            matches!(
                e.kind,
                event::TYPE_SOFTWARE_INTERRUPT
                    | event::TYPE_PRIVILEGED_SOFTWARE_EXCEPTION
                    | event::TYPE_SOFTWARE_EXCEPTION
            )
        });
        let return_eip = if source != Source::Gate || software {
            rip.wrapping_add(len)
        } else {
            rip
        };
        let mut segs = [Seg::default(); 8];
        for (s, fields) in segs.iter_mut().zip(&f::GUEST_SEGMENTS) {
            *s = Seg {
                selector: fields.selector.read(v)?,
                base: fields.base.read(v)? as u32,
                limit: fields.limit.read(v)?,
                ar: fields.access_rights.read(v)?,
            };
        }
        let r = &self.cpu.regs;
        let mut cpu = TaskCpu {
            gpr: [
                r.rax as u32,
                r.rcx as u32,
                r.rdx as u32,
                r.rbx as u32,
                f::GUEST_RSP.read(v)? as u32,
                r.rbp as u32,
                r.rsi as u32,
                r.rdi as u32,
            ],
            eip: rip as u32,
            eflags: f::GUEST_RFLAGS.read(v)? as u32,
            seg: [segs[0], segs[1], segs[2], segs[3], segs[4], segs[5]],
            ldtr: segs[f::SEG_LDTR],
            tr: segs[f::SEG_TR],
            gdtr: (
                f::GUEST_GDTR_BASE.read(v)? as u32,
                f::GUEST_GDTR_LIMIT.read(v)?,
            ),
            cr0: f::GUEST_CR0.read(v)? as u32,
            cr3: f::GUEST_CR3.read(v)? as u32,
        };
        let cr4 = f::GUEST_CR4.read(v)?;
        let paging = if u64::from(cpu.cr0) & policy::CR0_PG == 0 {
            LegacyPaging::Off
        } else {
            legacy_paging(v, u64::from(cpu.cr3), cr4)?
        };
        let old_cr3 = cpu.cr3;
        let mut phys = GuardedPhys::default();
        let mut mem = ts::LegacyLinear {
            paging,
            phys: &mut phys,
            pdptes_changed: false,
        };
        let req = ts::Request {
            selector: q as u16,
            source,
            return_eip: return_eip as u32,
            error_code: event.and_then(|e| e.error_code),
        };
        let outcome = ts::switch(&mut cpu, &mut mem, req);
        let (pdptes_changed, paging) = (mem.pdptes_changed, mem.paging);
        self.emulated_writes(&phys);
        if let Outcome::FaultBefore(fault) = outcome {
            return self.task_fault(fault);
        }
        // The new task's state, loaded (all of it, or up to a fault that
        // the new task takes).
        let [es, cs, ss, ds, fs, gs] = cpu.seg;
        for (s, fields) in [es, cs, ss, ds, fs, gs, cpu.ldtr, cpu.tr]
            .iter()
            .zip(&f::GUEST_SEGMENTS)
        {
            fields.write(v, s.selector, u64::from(s.base), s.limit, s.ar)?;
        }
        let g = cpu.gpr.map(u64::from);
        self.cpu.regs.rax = g[0];
        self.cpu.regs.rcx = g[1];
        self.cpu.regs.rdx = g[2];
        self.cpu.regs.rbx = g[3];
        f::GUEST_RSP.write(v, g[4])?;
        self.cpu.regs.rbp = g[5];
        self.cpu.regs.rsi = g[6];
        self.cpu.regs.rdi = g[7];
        f::GUEST_RIP.write(v, u64::from(cpu.eip))?;
        f::GUEST_RFLAGS.write(v, u64::from(cpu.eflags))?;
        f::GUEST_CR0.write(v, u64::from(cpu.cr0))?;
        f::GUEST_CR3.write(v, u64::from(cpu.cr3))?;
        if cpu.cr3 != old_cr3 {
            // A MOV to CR3 would have flushed the old address space's
            // translations; with VPID, VM entry does not. Both views: the
            // vCPU may move to the other one before its next CR3 load.
            self.cpu.invalidate_views();
        }
        if let (true, LegacyPaging::Pae { pdptes }) = (pdptes_changed, paging) {
            f::GUEST_PDPTE0.write(v, pdptes[0])?;
            f::GUEST_PDPTE1.write(v, pdptes[1])?;
            f::GUEST_PDPTE2.write(v, pdptes[2])?;
            f::GUEST_PDPTE3.write(v, pdptes[3])?;
        }
        // The instruction that switched completed: no STI/MOV SS blocking.
        let intr = f::GUEST_INTERRUPTIBILITY.read(v)?;
        let nmi = event.is_some_and(|e| e.kind == event::TYPE_NMI);
        let mut intr = intr & !event::BLOCKING_BY_STI_OR_MOV_SS;
        if nmi {
            intr |= event::BLOCKING_BY_NMI;
        }
        if source == Source::Iret {
            // IRET unblocks NMIs (virtual NMIs: root keeps the blocking).
            intr &= !event::BLOCKING_BY_NMI;
        }
        f::GUEST_INTERRUPTIBILITY.write(v, intr)?;
        // A task switch clears the local breakpoint enables (L0..L3).
        let dr7 = f::GUEST_DR7.read(v)?;
        f::GUEST_DR7.write(v, dr7 & !DR7_LOCAL_ENABLES)?;
        match outcome {
            Outcome::FaultAfter(fault) => self.task_fault(fault),
            Outcome::Switched { debug_trap: true } => {
                // The new TSS's T flag: a #DB that DR6.BT names.
                insn::write_dr6(insn::read_dr6() | DR6_BT);
                self.inject(DB, None)
            }
            _ => Ok(Next::Resume),
        }
    }
}
