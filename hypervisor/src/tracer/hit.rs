//! The hot path: the VMCALL of the entry and return trampolines. An entry
//! hit runs the site's probes, the function tracer and the graph sessions
//! that hooked it, in that order, and hands back the chain target (the
//! guest's own `call` at the site, if it has one); a return pops its frame
//! and hands back the original return address.
//!
//! A hit reads the VM's tracer state through `&VmState`, so hits on
//! different vCPUs run at the same time (root takes the VM lock's shared
//! side for them). What a hit changes is its own vCPU's ring, atomic
//! counters, and the return stacks under their own short lock.

use super::fgraph::Out;
use super::hit_stats::add;
use super::machine::{CpuView, Env, KernelView, Running, View};
use super::modules::ModuleEvent;
use super::probes::{store_parts, HitSink, VcpuMem};
use super::quiet::SwitchHook;
use super::region::Region;
use super::ring::EventRing;
use super::site::Patch;
use super::split::SiteUse;
use super::users::User;
use super::vm_state::VmState;
use super::{CpuState, Hypercall, Tracer};
use crate::addr::Gva;
use crate::guest_phys::GuestDoor;
use crate::stats::{add_own, RootWork};
use crate::vmx::regs::GuestRegs;
use alloc::vec::Vec;
use guest_introspect::paging::{self, Cr3};
use tracelang::kprobe::{self, EventHeader, FetchContext, GuestLayout, IndexSymbols};
use tracelang::render::FUNCTION_ID;
use trampolines::PtRegs;

impl Tracer<'_> {
    /// A VMCALL at guest `rip` in ring `cpl` (see [`Hit::hypercall`]).
    pub fn hypercall(
        &mut self,
        env: &mut Env<'_>,
        rip: u64,
        regs: &mut GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Hypercall {
        Hit::new(self.vm, self.cpu).hypercall(env, rip, regs, cpu, kernel, now_ns)
    }
}

/// The tracer serving one vCPU's hypercall: the VM's state shared with the
/// other vCPUs' hits, and this vCPU's own.
pub struct Hit<'a> {
    vm: &'a VmState,
    cpu: &'a mut CpuState,
}

impl<'a> Hit<'a> {
    /// A hit over the VM's state (shared) and the vCPU's.
    pub fn new(vm: &'a VmState, cpu: &'a mut CpuState) -> Self {
        Hit { vm, cpu }
    }

    /// A VMCALL at guest `rip` in ring `cpl`. Each is counted for its
    /// vCPU as exactly one of: a hit recorded, a return handed back, or
    /// refused (status's per-vCPU `hits`, `returns`, `refused`, which add up
    /// to its VMCALL exits).
    pub fn hypercall(
        &mut self,
        env: &mut Env<'_>,
        rip: u64,
        regs: &mut GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Hypercall {
        self.cpu.timed_entry = false;
        let (out, served) = self.serve(env, rip, regs, cpu, kernel, now_ns);
        self.cpu.served = Some(match served {
            Served::Hit => RootWork::Hit,
            Served::Return => RootWork::Return,
            Served::Refused => RootWork::Refused,
        });
        if let Some(c) = self.vm.hit.vcpus.get(self.cpu.index) {
            add_own(
                match served {
                    Served::Hit => &c.hits,
                    Served::Return => &c.returns,
                    Served::Refused => &c.refused,
                },
                1,
            );
        }
        out
    }

    /// [`Self::hypercall`], and what it was.
    fn serve(
        &mut self,
        env: &mut Env<'_>,
        rip: u64,
        regs: &mut GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> (Hypercall, Served) {
        let Some(region) = &self.vm.region else {
            add(&self.vm.hit.foreign_vmcalls, 1);
            return (Hypercall::Foreign, Served::Refused);
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
                let (chain, served) = match kernel {
                    Some(k) => self.on_entry(env, regs.rdi, regs.rsi, cpu, k, now_ns),
                    // No kernel recovered yet: nothing to record with.
                    None => (0, Served::Refused),
                };
                regs.rax = chain;
                (Hypercall::Handled, served)
            }
            Some(trampolines::Hypercall::Return)
                if regs.rax == u64::from(trampolines::abi::HYPERCALL_RETURN) =>
            {
                let tramp = Some(region.return_trampoline());
                let mut ring = self.vm.stream.rings.lock(self.cpu.index);
                let out = Out {
                    count: &self.vm.count,
                    probes: &self.vm.probes,
                    ring: &mut ring,
                    record: &mut self.cpu.record,
                    values: &mut self.cpu.values,
                    stats: &self.vm.hit,
                    vcpu: self.cpu.index as u32,
                };
                let left = self
                    .vm
                    .graph
                    .leave(env, out, tramp, regs, cpu, kernel, now_ns);
                drop(ring);
                match left {
                    Some(left) => {
                        regs.rax = left.ret;
                        let arming = self.vm.arming_users();
                        if left.users & arming != 0 && left.below & arming == 0 {
                            // Out of the last frame of a quiet session on
                            // this stack: the view for what runs now.
                            self.vm.pick_view(self.cpu, kernel, cpu, now_ns);
                        }
                        (Hypercall::Handled, Served::Return)
                    }
                    None => {
                        // No frame: nowhere to return to. The guest (or an
                        // attacker) jumped into the return trampoline.
                        add(&self.vm.hit.graph_orphans, 1);
                        (Hypercall::Foreign, Served::Refused)
                    }
                }
            }
            _ => {
                add(&self.vm.hit.foreign_vmcalls, 1);
                (Hypercall::Foreign, Served::Refused)
            }
        }
    }

    /// The entry hypercall's fast path (the kernel's ftrace has its own
    /// for an `ftrace_ops` alone on a record): a hit on a site whose users
    /// read no register and no guest memory of the call, i.e. a call count
    /// with no filter, histogram or timing, probes with no fetch argument,
    /// and the function tracer. `exit` is all root read of the VMCS beyond
    /// the exit reason; the frame's `ip` word (the forgery check) and the
    /// parent are read through the kernel's own page tables (`k.cr3()`,
    /// which map every kernel stack: no CR3 read), the running task through
    /// `gs` (GUEST_GS_BASE, read by the turn's first hit that records, kept
    /// until the next turn: [`CpuState::kernel_gs`]), and the clock
    /// through `now_ns` (read once, only by a hit that records). Counts,
    /// records and the vCPU's counters come out as [`Self::hypercall`]'s
    /// would. Returns the chain target for RAX when served; `None` when
    /// anything else applies (another user, a filter, an entry from
    /// elsewhere, a frame that does not read or does not prove the entry),
    /// with nothing counted or recorded: the general path then serves the
    /// hypercall from the start.
    pub fn fast_entry(
        &mut self,
        ram: &dyn GuestDoor,
        k: &dyn KernelView,
        exit: FastExit,
        regs: &GuestRegs,
        gs: fn() -> u64,
        now_ns: impl FnOnce() -> u64,
    ) -> Option<u64> {
        if exit.cpl != 0
            || self.vm.entry_vmcall() != Some(exit.rip)
            || regs.rax != u64::from(trampolines::abi::HYPERCALL_ENTRY)
            || regs.rdi != exit.rsp
        {
            return None;
        }
        let key = Gva(regs.rsi);
        let u = self.vm.view.sites.get(&key)?;
        let c = &self.vm.count;
        let counted = u.users.has(User::Count);
        if !u.users.fast()
            || (counted && (c.filters() || c.histogram.is_some()))
            || self.probes_fetch(u)
        {
            return None;
        }
        let cr3 = k.cr3();
        let mut ip = [0u8; 8];
        let at = exit
            .rsp
            .wrapping_add(core::mem::offset_of!(PtRegs, ip) as u64);
        self.cpu.walks.read_virt(ram, cr3, Gva(at), &mut ip).ok()?;
        if u64::from_le_bytes(ip) != key.0.wrapping_add(5) {
            return None;
        }
        if counted {
            add(u.users.calls(), 1);
        }
        let function = u.users.has(User::Function);
        if !u.users.probes().is_empty() || function {
            let base = *self.cpu.kernel_gs.get_or_insert_with(gs);
            let cpu = CpuView {
                cr3: cr3.0,
                cpl: 0,
                gs_base: super::machine::GuestGs::known(base),
                kernel_gs_base: 0,
                la57: false,
                rsp: exit.rsp,
            };
            let Running { pid, comm, .. } = k.current(&cpu).unwrap_or(Running::UNKNOWN);
            let mut header = EventHeader {
                probe_id: 0,
                cpu: k.cpu_number(&cpu).unwrap_or(self.cpu.index as u32),
                pid,
                timestamp_ns: now_ns(),
                ip: key.0,
                ret_ip: 0,
                comm,
            };
            let mut ring = self.vm.stream.rings.lock(self.cpu.index);
            for &id in u.users.probes() {
                let Some(p) = self.vm.probes.get(id) else {
                    continue;
                };
                if !p.admits(header.pid, &header.comm) {
                    continue;
                }
                header.probe_id = id;
                if store_parts(&mut ring, &mut self.cpu.record, &header, &[]) {
                    add(&p.hits, 1);
                } else {
                    add(&p.misses, 1);
                }
            }
            if function {
                let sp = exit.rsp.wrapping_add(trampolines::abi::ENTRY_SP_FROM_FRAME);
                let (walks, record) = (&mut self.cpu.walks, &mut self.cpu.record);
                let at = (ram, cr3, sp);
                record_function(walks, at, u.func.0, header, &mut ring, record);
            }
        }
        let chain = self.chain_of(u.page, key);
        self.cpu.timed_entry = false;
        self.cpu.served = Some(RootWork::Hit);
        if let Some(c) = self.vm.hit.vcpus.get(self.cpu.index) {
            add_own(&c.hits, 1);
        }
        Some(chain)
    }

    /// Whether a probe on the site fetches arguments (reads the frame's
    /// registers, and maybe guest memory).
    fn probes_fetch(&self, u: &SiteUse) -> bool {
        u.users.probes().iter().any(|&id| {
            self.vm
                .probes
                .get(id)
                .is_some_and(|p| !p.spec.args.is_empty())
        })
    }

    /// Whether a return probe on the site reads arguments as they were
    /// at the entry (saved in the call's return frame).
    fn returns_read_entry(&self, u: &SiteUse) -> bool {
        u.users.returns().iter().any(|&id| {
            u32::try_from(id)
                .ok()
                .and_then(|id| self.vm.probes.get(id))
                .is_some_and(|p| p.entry_args)
        })
    }

    /// Where the entry trampoline continues for hooked `site` on guest
    /// page `page`: the guest's own `call` target there, or 0.
    fn chain_of(&self, page: crate::addr::Gpa, site: Gva) -> u64 {
        self.vm
            .view
            .pages
            .get(&page)
            .and_then(|h| h.patches.iter().find(|p| p.site == site))
            .map_or(0, Patch::chain_target)
    }

    /// An entry hypercall from `site` with the pt_regs at `regs_gva`;
    /// returns the chain target, and whether the hit was recorded.
    fn on_entry(
        &mut self,
        env: &mut Env<'_>,
        regs_gva: u64,
        site: u64,
        cpu: &CpuView,
        k: &dyn KernelView,
        now_ns: u64,
    ) -> (u64, Served) {
        // The ABI's frame: RDI = RSP = &pt_regs, RSI a hooked site. A jump
        // into the trampoline with other registers is refused (and the
        // guest continues at whatever its forged pt_regs says: its own
        // memory, its own problem).
        let key = Gva(site);
        let Some(u) = self.vm.view.sites.get(&key).filter(|_| regs_gva == cpu.rsp) else {
            add(&self.vm.hit.forged_entries, 1);
            // A call that was in flight when its site was unhooked is
            // refused too: it continues as the site's own bytes say (the
            // guest's `call` there, if it has one).
            return (
                site_call_target(env.ram, Cr3(cpu.cr3), site),
                Served::Refused,
            );
        };
        let chain = self.chain_of(u.page, key);
        let cr3 = Cr3(cpu.cr3);
        // The whole frame only for a use that reads registers: fetch
        // arguments, a histogram's, the hooks that take the called
        // function's arguments, a return probe that reads the entry's
        // arguments (saved in the call's return frame below). Otherwise its
        // one word that proves the entry (ip), and `sp`, which the ABI
        // fixes from the frame.
        let entry_args_saved = self.returns_read_entry(u);
        let frame_needed = u.users.switch().is_some()
            || u.users.module().is_some()
            || (u.users.has(User::Count) && self.vm.count.histogram.is_some())
            || self.probes_fetch(u)
            || entry_args_saved;
        let regs = if frame_needed {
            let mut image = [0u8; trampolines::ptregs::PT_REGS_SIZE];
            self.cpu
                .walks
                .read_virt(env.ram, cr3, Gva(regs_gva), &mut image)
                .ok()
                .map(|()| PtRegs::from_le_bytes(&image))
        } else {
            let mut ip = [0u8; 8];
            let at = regs_gva.wrapping_add(core::mem::offset_of!(PtRegs, ip) as u64);
            self.cpu
                .walks
                .read_virt(env.ram, cr3, Gva(at), &mut ip)
                .ok()
                .map(|()| PtRegs {
                    ip: u64::from_le_bytes(ip),
                    sp: regs_gva.wrapping_add(trampolines::abi::ENTRY_SP_FROM_FRAME),
                    ..PtRegs::default()
                })
        };
        let Some(regs) = regs else {
            self.vm.stream.rings.lock(self.cpu.index).count_lost();
            return (chain, Served::Refused);
        };
        if regs.ip != site.wrapping_add(5) {
            // The trampoline stores the site call's own return address as
            // ip: anything else did not come from a call at this site.
            add(&self.vm.hit.forged_entries, 1);
            return (chain, Served::Refused);
        }
        // A dispatch over the site's users, in `Users::iter`'s order: root's
        // own hooks and the count decide what the call is, then what
        // records serves it (entry probes, the function tracer, and the
        // return hook's users together: one frame for them all).
        let users = &u.users;
        let mut counted_out = false;
        for user in users.iter() {
            match user {
                User::Switch(hook) => {
                    self.on_switch(hook, env, &regs, cpu, k, now_ns);
                    if users.only_switch() {
                        return (chain, Served::Hit);
                    }
                }
                // A module load or unload: served by the exit handler with
                // the whole VM, before this vCPU runs the function's body.
                User::Module(hook) => {
                    self.cpu.module_event = Some(ModuleEvent {
                        hook,
                        module: regs.di,
                    });
                }
                User::Count => counted_out = !self.on_count(u, env, &regs, cpu, k),
                User::Probe(_)
                | User::Function
                | User::Graph(_)
                | User::ReturnProbe(_)
                | User::CountTiming => break,
            }
        }
        // The count's own timing is all a left-out call would hijack its
        // return for.
        let only_timing = counted_out
            && users.probes().is_empty()
            && !users.has(User::Function)
            && !users.returns_beyond_timing();
        if !users.records() || only_timing {
            return (chain, Served::Hit);
        }
        let Running { task, pid, comm } = k.current(cpu).unwrap_or(Running::UNKNOWN);
        let header = EventHeader {
            probe_id: 0,
            cpu: k.cpu_number(cpu).unwrap_or(self.cpu.index as u32),
            pid,
            timestamp_ns: now_ns,
            ip: site,
            ret_ip: 0,
            comm,
        };
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
        let ctx = FetchContext {
            regs: &regs,
            comm: Some(&comm),
            layout: GuestLayout::X86_64_4LEVEL,
            entry_args: None,
        };
        let func = u.func.0;
        // The vCPU's ring, locked for the hit (only this vCPU records into
        // it; the drain waits for the VM to itself).
        let mut ring = self.vm.stream.rings.lock(self.cpu.index);
        let mut returns = false;
        for user in users.iter() {
            match user {
                User::Probe(id) => {
                    let mut mem = VcpuMem {
                        ram: env.ram,
                        cr3,
                        walks: Some(&mut self.cpu.walks),
                    };
                    let mut out = HitSink {
                        probes: &self.vm.probes.list,
                        ring: &mut ring,
                        record: &mut self.cpu.record,
                        values: &mut self.cpu.values,
                        heap: &*env.m,
                    };
                    out.hits(core::iter::once(id), header, &ctx, &mut mem, &syms);
                }
                User::Function => {
                    let (walks, record) = (&mut self.cpu.walks, &mut self.cpu.record);
                    let at = (env.ram, cr3, regs.sp);
                    record_function(walks, at, func, header, &mut ring, record);
                }
                User::Graph(_) | User::ReturnProbe(_) | User::CountTiming => returns = true,
                User::Switch(_) | User::Module(_) | User::Count => {}
            }
        }
        if !returns {
            return (chain, Served::Hit);
        }
        // The count times this call from its clock read on this entry.
        self.cpu.timed_entry = users.has(User::CountTiming);
        let entry_args =
            entry_args_saved.then_some([regs.di, regs.si, regs.dx, regs.cx, regs.r8, regs.r9]);
        let graph_state = &self.vm.graph;
        graph_state.refresh_stack_map(k, cpu, now_ns, &self.vm.hit);
        if let Some(tramp) = self.vm.region.as_ref().map(Region::return_trampoline) {
            let out = Out {
                count: &self.vm.count,
                probes: &self.vm.probes,
                ring: &mut ring,
                record: &mut self.cpu.record,
                values: &mut self.cpu.values,
                stats: &self.vm.hit,
                vcpu: self.cpu.index as u32,
            };
            let pushed = graph_state.enter(
                env,
                out,
                tramp,
                users.graphs(),
                users.returns(),
                entry_args.as_ref(),
                func,
                regs.sp,
                cr3,
                now_ns,
                header,
                task,
                k,
            );
            drop(ring);
            if pushed & self.vm.arming_users() != 0 {
                // Into a root (or deeper beneath one): armed.
                self.vm.set_view(self.cpu, View::Armed, now_ns);
            }
        }
        (chain, Served::Hit)
    }

    /// Root's view hook `hook` at an entry: a task comes in on this vCPU
    /// (the view its context wants), or the running task takes a new name.
    fn on_switch(
        &mut self,
        hook: SwitchHook,
        env: &Env<'_>,
        regs: &PtRegs,
        cpu: &CpuView,
        k: &dyn KernelView,
        now_ns: u64,
    ) {
        match hook {
            SwitchHook::Schedule => {
                self.vm.pick_view(self.cpu, Some(k), cpu, now_ns);
                if self.vm.quiet.sched_switch {
                    self.record_switch(regs, cpu, k, now_ns);
                }
            }
            // `__set_task_comm(tsk, buf, ...)`, the name not written yet:
            // armed if a filter admits the new name. Never quiet here: the
            // calls made under the old name up to the rename are still
            // its; the next switch picks the view for a name no filter
            // admits.
            SwitchHook::Wakeup => {
                if self.vm.quiet.sched_wakeup {
                    self.record_wakeup(regs, cpu, k, now_ns);
                }
            }
            SwitchHook::Comm => {
                let running = k.current(cpu);
                let mut name = [0u8; 16];
                let read = paging::read_virt(env.ram, Cr3(cpu.cr3), Gva(regs.si), &mut name);
                // The kernel keeps at most 15 bytes and a NUL.
                name[15] = 0;
                let filtering = self.vm.arming_users() & self.vm.graph.filter_users();
                let admitted = running.filter(|r| r.task == regs.di).is_some_and(|r| {
                    read.is_ok() && self.vm.graph.admitted_by(filtering, r.pid, &name)
                });
                if admitted {
                    self.vm.set_view(self.cpu, View::Armed, now_ns);
                }
            }
        }
    }

    /// A `sched_switch` event at the scheduler hook: `finish_task_switch`
    /// runs on the incoming task (`current`, the record's task) with the
    /// outgoing one as its first argument. The site is the record's ip.
    fn record_switch(&mut self, regs: &PtRegs, cpu: &CpuView, k: &dyn KernelView, now_ns: u64) {
        let running = k.current(cpu).unwrap_or(Running::UNKNOWN);
        let prev = k.task_sched(regs.di);
        let next = (running.task != 0)
            .then(|| k.task_sched(running.task))
            .flatten();
        let Some(prev_comm) = self.comm_of(&prev.map_or([0u8; 16], |p| p.comm)) else {
            return;
        };
        let values = tracelang::kprobe::SwitchValues {
            prev_pid: prev.map_or(-1, |p| p.pid),
            prev_comm,
            prev_prio: prev.and_then(|p| p.prio).unwrap_or(-1),
            prev_state: prev.and_then(|p| p.state).map_or(0, |state| {
                let exit = prev.and_then(|p| p.exit_state).unwrap_or(0);
                tracelang::kprobe::report_state(state, u64::from(exit))
            }),
            next_prio: next.and_then(|n| n.prio).unwrap_or(-1),
        };
        let id = tracelang::render::SCHED_SWITCH_ID;
        self.store_sched(id, (regs, cpu, k), &running, now_ns, &values.values());
    }

    /// A `sched_wakeup` event at `try_to_wake_up(p, state, flags)`'s entry,
    /// when `p` is in one of the states the call wakes (`p->__state &
    /// state`: the kernel's own test; a task not in them is not woken and
    /// has no event). The record's task is the waker (`current`); its
    /// values are the wakee's pid, comm, prio and CPU. The CPU is the one
    /// the task is on at the call, where the kernel reports the one it
    /// chose (the same unless the wakeup moves the task).
    fn record_wakeup(&mut self, regs: &PtRegs, cpu: &CpuView, k: &dyn KernelView, now_ns: u64) {
        let Some(p) = k.task_sched(regs.di) else {
            return;
        };
        if p.state.unwrap_or(0) & regs.si == 0 {
            return;
        }
        let running = k.current(cpu).unwrap_or(Running::UNKNOWN);
        let Some(wakee_comm) = self.comm_of(&p.comm) else {
            return;
        };
        let values = tracelang::kprobe::WakeupValues {
            pid: p.pid,
            comm: wakee_comm,
            prio: p.prio.unwrap_or(-1),
            target_cpu: p.cpu.map_or(-1, |c| c as i32),
        };
        let id = tracelang::render::SCHED_WAKEUP_ID;
        self.store_sched(id, (regs, cpu, k), &running, now_ns, &values.values());
    }

    /// A comm's bytes up to its NUL, in a vector the heap may refuse
    /// (then the record is counted lost and `None`).
    fn comm_of(&mut self, comm: &[u8; 16]) -> Option<alloc::vec::Vec<u8>> {
        let n = comm.iter().position(|&c| c == 0).unwrap_or(comm.len());
        let mut out = alloc::vec::Vec::new();
        let name = comm.get(..n).unwrap_or_default();
        if guest_introspect::fallible::try_extend_from_slice(&mut out, name).is_err() {
            self.vm.stream.rings.lock(self.cpu.index).count_lost();
            return None;
        }
        Some(out)
    }

    /// Stores a scheduler event `id` of the running task at root's hook
    /// (`regs`' site is its ip) with `values`.
    fn store_sched(
        &mut self,
        id: u32,
        (regs, cpu, k): (&PtRegs, &CpuView, &dyn KernelView),
        running: &Running,
        now_ns: u64,
        values: &[tracelang::kprobe::FetchedValue],
    ) {
        let header = EventHeader {
            probe_id: id,
            cpu: k.cpu_number(cpu).unwrap_or(self.cpu.index as u32),
            pid: running.pid,
            timestamp_ns: now_ns,
            ip: regs.ip.wrapping_sub(5),
            ret_ip: 0,
            comm: running.comm,
        };
        let mut ring = self.vm.stream.rings.lock(self.cpu.index);
        store_parts(&mut ring, &mut self.cpu.record, &header, values);
    }

    /// The count's entry of the call at site `u` (frame `regs`): counted,
    /// with its histogram's value, unless a filter leaves the running task
    /// out (then counted as filtered). Whether it was counted.
    fn on_count(
        &mut self,
        u: &SiteUse,
        env: &Env<'_>,
        regs: &PtRegs,
        cpu: &CpuView,
        k: &dyn KernelView,
    ) -> bool {
        let c = &self.vm.count;
        let keyed = c
            .histogram
            .as_ref()
            .is_some_and(|h| h.key != protocol::HistKey::Function);
        let running = (c.filters() || keyed).then(|| k.current(cpu).unwrap_or(Running::UNKNOWN));
        let counts = running.as_ref().is_none_or(|r| c.admits(r.pid, &r.comm));
        if !counts {
            add(&c.filtered, 1);
            return false;
        }
        add(u.users.calls(), 1);
        if let Some(h) = &c.histogram {
            let r = running.unwrap_or(Running::UNKNOWN);
            let ctx = FetchContext {
                regs,
                comm: Some(&r.comm),
                layout: GuestLayout::X86_64_4LEVEL,
                entry_args: None,
            };
            let mut mem = VcpuMem {
                ram: env.ram,
                cr3: Cr3(cpu.cr3),
                walks: Some(&mut self.cpu.walks),
            };
            let syms = IndexSymbols::new(k.index(), Some(k.modules()));
            let value = h.spec.args.first().and_then(|a| {
                match kprobe::fetch_one(a, &ctx, &mut mem, &syms) {
                    kprobe::FetchedValue::Int { value, .. }
                    | kprobe::FetchedValue::Symbol(value)
                    | kprobe::FetchedValue::SymStr(value) => Some(value),
                    _ => None,
                }
            });
            h.add(h.key_of(u.func.0, r.pid, &r.comm), value);
        }
        true
    }
}

/// Records the function tracer's event for a call of `func` with the hit's
/// `header`: the parent is the return address at `sp` (read through the
/// walk cache in the address space `cr3`; 0 when it does not read).
fn record_function(
    walks: &mut paging::WalkCache,
    (ram, cr3, sp): (&dyn GuestDoor, Cr3, u64),
    func: u64,
    mut header: EventHeader,
    ring: &mut EventRing,
    record: &mut Vec<u8>,
) {
    let mut ret = [0u8; 8];
    header.probe_id = FUNCTION_ID;
    header.ip = func;
    header.ret_ip = walks
        .read_virt(ram, cr3, Gva(sp), &mut ret)
        .map_or(0, |()| u64::from_le_bytes(ret));
    store_parts(ring, record, &header, &[]);
}

/// What root reads of the VMCS for [`Hit::fast_entry`], besides the exit
/// reason: 3 VMREADs, each of a field a nested KVM shadows.
#[derive(Clone, Copy, Debug)]
pub struct FastExit {
    /// GUEST_RIP: the VMCALL's address.
    pub rip: u64,
    /// The privilege level, from GUEST_SS_ACCESS_RIGHTS.
    pub cpl: u8,
    /// GUEST_RSP.
    pub rsp: u64,
}

/// What a hypercall was, for its vCPU's counts.
enum Served {
    /// An entry from a hooked site, recorded.
    Hit,
    /// A return through a frame, handed back.
    Return,
    /// Anything else: forged, foreign, orphan, or unreadable.
    Refused,
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
