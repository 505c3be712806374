//! The hot path: the VMCALL of the entry and return trampolines. An entry
//! hit runs the site's probes, the function tracer and the graph sessions
//! that hooked it, in that order, and hands back the chain target (the
//! guest's own `call` at the site, if it has one); a return pops its frame
//! and hands back the original return address.

use super::fgraph::Out;
use super::machine::{CpuView, Env, KernelView, Running};
use super::probes::{store, HitSink, VcpuMem};
use super::region::Region;
use super::site::Patch;
use super::stream::FUNCTION_ID;
use super::{Hypercall, Tracer};
use crate::addr::Gva;
use crate::guest_phys::GuestDoor;
use crate::kprobe::{EventHeader, FetchContext, GuestLayout, IndexSymbols, RawEvent};
use crate::vmx::regs::GuestRegs;
use alloc::vec::Vec;
use guest_introspect::paging::{self, Cr3};
use trampolines::PtRegs;

impl Tracer<'_> {
    /// A VMCALL at guest `rip` in ring `cpl`.
    pub fn hypercall(
        &mut self,
        env: &mut Env<'_>,
        rip: u64,
        regs: &mut GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Hypercall {
        let Some(region) = &self.vm.region else {
            self.vm.stats.foreign_vmcalls += 1;
            return Hypercall::Foreign;
        };
        let which = if cpu.cpl == 0 {
            region.tramp.hypercall_at(Gva(rip))
        } else {
            None
        };
        match which {
            Some(trampolines::Hypercall::Entry)
                if regs.rax == u64::from(trampolines::abi::HYPERCALL_ENTRY) =>
            {
                regs.rax = match kernel {
                    Some(k) => self.on_entry(env, regs.rdi, regs.rsi, cpu, k, now_ns),
                    None => 0,
                };
                Hypercall::Handled
            }
            Some(trampolines::Hypercall::Return)
                if regs.rax == u64::from(trampolines::abi::HYPERCALL_RETURN) =>
            {
                let tramp = Some(region.return_trampoline());
                let out = Out {
                    probes: &mut self.vm.probes,
                    ring: self.vm.stream.rings.of(self.cpu.index),
                    record: &mut self.cpu.record,
                    stats: &mut self.vm.stats,
                    vcpu: self.cpu.index as u32,
                };
                match self
                    .vm
                    .graph
                    .leave(env, out, tramp, regs, cpu, kernel, now_ns)
                {
                    Some(ret) => {
                        regs.rax = ret;
                        Hypercall::Handled
                    }
                    None => {
                        // No frame: nowhere to return to. The guest (or an
                        // attacker) jumped into the return trampoline.
                        self.vm.stats.graph_orphans += 1;
                        Hypercall::Foreign
                    }
                }
            }
            _ => {
                self.vm.stats.foreign_vmcalls += 1;
                Hypercall::Foreign
            }
        }
    }

    /// An entry hypercall from `site` with the pt_regs at `regs_gva`;
    /// returns the chain target.
    fn on_entry(
        &mut self,
        env: &mut Env<'_>,
        regs_gva: u64,
        site: u64,
        cpu: &CpuView,
        k: &dyn KernelView,
        now_ns: u64,
    ) -> u64 {
        // The ABI's frame: RDI = RSP = &pt_regs, RSI a hooked site. A jump
        // into the trampoline with other registers is refused (and the
        // guest continues at whatever its forged pt_regs says: its own
        // memory, its own problem).
        let key = Gva(site);
        let Some(u) = self.vm.view.sites.get(&key).filter(|_| regs_gva == cpu.rsp) else {
            self.vm.stats.forged_entries += 1;
            // A call that was in flight when its site was unhooked is
            // refused too: it continues as the site's own bytes say (the
            // guest's `call` there, if it has one).
            return site_call_target(env.ram, Cr3(cpu.cr3), site);
        };
        let chain = self
            .vm
            .view
            .pages
            .get(&u.page)
            .and_then(|h| h.patches.iter().find(|p| p.site == key))
            .map_or(0, Patch::chain_target);
        let cr3 = Cr3(cpu.cr3);
        let mut image = [0u8; trampolines::ptregs::PT_REGS_SIZE];
        if paging::read_virt(env.ram, cr3, Gva(regs_gva), &mut image).is_err() {
            self.vm.stream.rings.of(self.cpu.index).count_lost();
            return chain;
        }
        let regs = PtRegs::from_le_bytes(&image);
        if regs.ip != site.wrapping_add(5) {
            // The trampoline stores the site call's own return address as
            // ip: anything else did not come from a call at this site.
            self.vm.stats.forged_entries += 1;
            return chain;
        }
        self.vm.stats.hits += 1;
        let Running { task, pid, comm } = k.current(cpu).unwrap_or(Running::UNKNOWN);
        let mut header = EventHeader {
            probe_id: 0,
            cpu: k.cpu_number(cpu).unwrap_or(self.cpu.index as u32),
            pid,
            timestamp_ns: now_ns,
            ip: site,
            ret_ip: 0,
            comm,
        };
        let syms = IndexSymbols(k.index());
        let mut mem = VcpuMem { ram: env.ram, cr3 };
        let ctx = FetchContext {
            regs: &regs,
            comm: Some(&comm),
            layout: GuestLayout::X86_64_4LEVEL,
        };
        let function = u.function;
        let graph = u.graph;
        let func = u.func.0;
        let has_retprobes = !u.retprobes.is_empty();
        let mut out = HitSink {
            probes: &mut self.vm.probes.list,
            ring: self.vm.stream.rings.of(self.cpu.index),
            record: &mut self.cpu.record,
        };
        out.hits(u.probes.iter().copied(), header, &ctx, &mut mem, &syms);
        if function {
            let mut ret = [0u8; 8];
            let parent = paging::read_virt(env.ram, cr3, Gva(regs.sp), &mut ret)
                .map_or(0, |()| u64::from_le_bytes(ret));
            header.probe_id = FUNCTION_ID;
            header.ip = func;
            header.ret_ip = parent;
            let ev = RawEvent {
                header,
                values: Vec::new(),
            };
            store(
                self.vm.stream.rings.of(self.cpu.index),
                &mut self.cpu.record,
                &ev,
            );
        }
        if graph != 0 || has_retprobes {
            self.vm.graph.refresh_stack_map(k, cpu, now_ns);
            // The ids are lent out of the site for the call (no copy).
            let retprobes = if has_retprobes {
                self.vm
                    .view
                    .sites
                    .get_mut(&key)
                    .map(|u| core::mem::take(&mut u.retprobes))
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            if let Some(tramp) = self.vm.region.as_ref().map(Region::return_trampoline) {
                let out = Out {
                    probes: &mut self.vm.probes,
                    ring: self.vm.stream.rings.of(self.cpu.index),
                    record: &mut self.cpu.record,
                    stats: &mut self.vm.stats,
                    vcpu: self.cpu.index as u32,
                };
                self.vm.graph.enter(
                    env, out, tramp, graph, &retprobes, func, regs.sp, cr3, now_ns, header, task, k,
                );
            }
            if let Some(u) = self.vm.view.sites.get_mut(&key).filter(|_| has_retprobes) {
                u.retprobes = retprobes;
            }
        }
        chain
    }
}

/// The guest-virtual target of a `call rel32` at `site` in the guest's own
/// bytes (its frame, not our shadow), or 0: not a call, or unreadable.
fn site_call_target(ram: &dyn GuestDoor, cr3: Cr3, site: u64) -> u64 {
    let mut b = [0u8; 5];
    if paging::read_virt(ram, cr3, Gva(site), &mut b).is_err() || b[0] != 0xe8 {
        return 0;
    }
    let rel = i32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    site.wrapping_add(5).wrapping_add(rel as i64 as u64)
}
