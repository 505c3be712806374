//! The tracer in VMX root: the trampoline region in the guest's kernel
//! address space, hooked fentry sites behind an EPT split view, the entry
//! hypercall with its kprobe, function-tracer and function-graph handlers,
//! the event ring and its stream, and the single step that lets the guest
//! read and write hooked pages.
//!
//! It reaches root's frames, EPT and heap and the guest's memory only
//! through [`machine::Env`], and the recovered kernel through
//! [`machine::KernelView`], so that all of it runs in the host tests
//! (`tests.rs`) with synthetic hits as well as in VMX root.
//!
//! # Its parts, by the state each owns
//!
//! | part | state | whose |
//! |---|---|---|
//! | [`region`] | the trampolines' code page, page table and PDE | the VM's |
//! | [`split`] | hooked sites, their users, shadow pages | the VM's |
//! | [`probes`] | probe specs and (atomic) counters, the function tracer's count | the VM's |
//! | [`fgraph`] | graph sessions, generations; return stacks and owners behind their own lock | the VM's |
//! | [`stream`] | a ring per vCPU (each behind its own lock), the stream's format and held line | the VM's; a ring is its vCPU's |
//! | [`quiet`] | the scheduler hook, which pages the quiet views leave unhooked | the VM's |
//! | [`step`] | the single step in flight | the vCPU's |
//!
//! The VM's parts are gathered in [`VmState`] (`vm_state.rs`), which the
//! VM owns, and the vCPU's in [`CpuState`] (`cpu_state.rs`), which each
//! vCPU owns; a [`Tracer`] borrows one of each for one exit or one
//! request. `requests.rs` serves the host's requests (the VM's state, but
//! for the stream's format), `hit.rs` the hypercalls through [`Hit`],
//! which reads the VM's state shared (`&VmState`): hits on several vCPUs
//! run at the same time.

mod btf_args;
pub mod count;
mod cpu_state;
pub mod door;
pub mod exit;
mod fgraph;
mod hit;
mod hit_stats;
pub mod machine;
pub mod modules;
mod probes;
pub mod quiet;
mod region;
mod requests;
pub mod retstack;
pub mod ring;
pub mod site;
mod split;
mod step;
mod stream;
pub mod symbols;
#[cfg(test)]
mod tests;
pub mod turn;
mod users;
mod vm_state;

pub use cpu_state::CpuState;
pub use hit::{FastExit, Hit};
pub use hit_stats::HypercallCounts;
pub use step::{DebugState, Violation};
pub use vm_state::VmState;

use self::machine::{CpuView, Env, KernelView};
use self::region::Region;
use self::split::MAX_SITES;
use self::step::StepShared;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use guest_introspect::fallible::{self, btree_entry_bytes, OutOfMemory};
use protocol::{ErrorKind, ProbeInfo, TraceFormat, TracerReport};

/// A request error for the control channel: what kind, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReqError {
    /// The kind the answer carries.
    pub kind: ErrorKind,
    /// The message for the user.
    pub message: String,
}

impl ReqError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ReqError {
        ReqError {
            kind,
            message: message.into(),
        }
    }
}

/// A function-graph session that started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphStarted {
    /// Its number (1 to 15).
    pub session: u32,
    /// Functions hooked for it.
    pub hooked: u32,
    /// Functions matching its roots.
    pub roots: u32,
    /// Matches that could not be hooked.
    pub skipped: u32,
}

/// A probe that was added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeAdded {
    /// `GROUP/EVENT`.
    pub name: String,
    /// The fentry site hooked for it.
    pub site: u64,
}

/// The function tracer's answer to a glob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionsAdded {
    /// Functions traced.
    pub traced: u32,
    /// The first few that could not be, each with why.
    pub skipped: Vec<String>,
    /// All that could not be.
    pub skipped_total: u32,
}

/// What the exit handler does with a VMCALL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hypercall {
    /// Ours: RAX is set; resume after the VMCALL.
    Handled,
    /// Not from our trampolines: #UD.
    Foreign,
}

/// The request error for a refused allocation of `what`.
fn out_of_memory(env: &Env<'_>, what: &str, e: OutOfMemory) -> ReqError {
    ReqError::new(
        ErrorKind::OutOfResources,
        format!(
            "out of hypervisor memory: {what} needs {} bytes ({} KiB of the heap free beyond its reserve)",
            e.bytes,
            env.m.heap_room() >> 10
        ),
    )
}

/// Holds the other vCPUs in root for a change to what they execute; a
/// request error when one does not come in time (nothing is changed).
fn stop_others(env: &mut Env<'_>) -> Result<(), ReqError> {
    if env.m.stop_others() {
        Ok(())
    } else {
        Err(ReqError::new(
            ErrorKind::NotReady,
            format!("{}; nothing was changed, try again", self::split::STALLED),
        ))
    }
}

/// A map of guest sites (site -> function) for a request, at most
/// [`MAX_SITES`] entries and within the heap's room.
fn insert_site(
    env: &Env<'_>,
    map: &mut BTreeMap<u64, u64>,
    site: u64,
    func: u64,
) -> Result<(), OutOfMemory> {
    env.m.heap_check(btree_entry_bytes::<u64, u64>())?;
    fallible::try_insert(map, site, func, MAX_SITES).map(|_| ())
}

/// The tracer at work on one vCPU: the VM's state and that vCPU's,
/// borrowed for one exit or one request. The VM owns its [`VmState`], each
/// vCPU its [`CpuState`].
pub struct Tracer<'a> {
    vm: &'a mut VmState,
    cpu: &'a mut CpuState,
}

impl<'a> Tracer<'a> {
    /// The tracer over the VM's state and the vCPU's.
    pub fn new(vm: &'a mut VmState, cpu: &'a mut CpuState) -> Self {
        Tracer { vm, cpu }
    }

    /// The counters for `status`.
    pub fn report(&self) -> TracerReport {
        let vm = &*self.vm;
        let stacks = vm.graph.figures();
        vm.hit.fill(TracerReport {
            probes: vm.probes.list.len() as u32,
            functions: vm.probes.functions,
            sites: vm.view.sites.len() as u32,
            pages: vm.view.pages.len() as u32,
            lost: vm.stream.rings.lost(),
            trampolines: vm.region.as_ref().map_or(0, |g| g.tramp.base().0),
            graph_stacks: stacks.stacks,
            graph_frames: stacks.frames,
            graph_bytes: stacks.bytes,
            graph_sessions: vm.graph.running(),
            retprobes: vm.probes.returns(),
            module_hooks: vm.modules.hooks.len() as u32,
            module_loads: vm.modules.loads,
            module_unloads: vm.modules.unloads,
            module_armed: vm.modules.armed,
            module_unhooked: vm.modules.unhooked,
            pending_probes: vm.probes.list.iter().filter(|p| p.site.is_none()).count() as u32,
            module_globs: vm.modules.function_globs.len() as u32
                + vm.count.globs.len() as u32
                + vm.graph
                    .sessions
                    .iter()
                    .flatten()
                    .filter(|g| g.follows_modules())
                    .count() as u32,
            module_followed: vm.modules.followed,
            module_inits_freed: vm.modules.inits_freed,
            module_init_unhooked: vm.modules.init_unhooked,
            quiet_pages: vm.quiet.pages,
            quiet_partial: vm.quiet.partial,
            switch_hook: vm.quiet.switch_site.is_some(),
            quiet_busy: vm.quiet.busy,
            ..vm.stats
        })
    }

    /// The region, built on the first request that hooks (with the other
    /// vCPUs held: it changes every EPT view).
    fn ensure_region(&mut self, k: &dyn KernelView, env: &mut Env<'_>) -> Result<(), ReqError> {
        if self.vm.region.is_none() {
            stop_others(env)?;
            self.vm.region = Some(Region::build(k, env)?);
        }
        Ok(())
    }

    /// The step's view of the VM's state.
    fn step_shared(vm: &mut VmState) -> StepShared<'_> {
        StepShared {
            view: &mut vm.view,
            region: vm.region.as_ref(),
            stats: &mut vm.stats,
        }
    }

    /// Called on every timer turn: keeps the region mapped, and ends steps
    /// that did not finish.
    pub fn on_turn(&mut self, env: &mut Env<'_>) {
        self.cpu.walks.flush();
        self.cpu.kernel_gs = None;
        if let Some(r) = &self.vm.region {
            if r.restore_pde(env) {
                self.vm.stats.region_restores += 1;
            }
        }
        self.vm.stray.on_turn();
        if self.cpu.step.on_turn(env, Self::step_shared(self.vm)) {
            self.vm.stray.forced();
        }
    }

    /// Records vCPU `index`'s ring lost.
    pub fn lost_of(&self, index: usize) -> u64 {
        self.vm.lost_of(index)
    }

    /// vCPU `index`'s hypercalls, by what they were.
    pub fn hypercalls_of(&self, index: usize, now_ns: u64) -> HypercallCounts {
        self.vm.hypercalls_of(index, now_ns)
    }

    /// `probe list`.
    pub fn probe_list(&self) -> Vec<ProbeInfo> {
        self.vm.probes.infos()
    }

    /// Whether rendered output is waiting (the stream wants busy turns).
    pub fn has_output(&self) -> bool {
        self.vm.stream.has_output()
    }

    /// Where the vCPUs' record rings are (root's heap is identity-mapped:
    /// these are physical addresses), in vCPU order, and the offset of
    /// each record's timestamp.
    pub fn record_rings(&self) -> (Vec<(u64, u64)>, u32) {
        (
            self.vm.stream.rings.regions(),
            tracelang::kprobe::TIMESTAMP_AT as u32,
        )
    }

    /// Whether the host reads the record rings itself once the stream is
    /// in records ([`protocol::TraceChannel::SharedRings`]).
    pub fn set_host_reads(&mut self, on: bool) {
        self.vm.stream.set_host_reads(on);
    }

    /// Sends the whole rendering context again (a piece of it was
    /// dropped on its way).
    pub fn resend_context(&mut self) {
        self.vm.stream.resend_context();
    }

    /// Whether the host takes the records out of the rings (not root).
    pub fn host_reads(&self) -> bool {
        self.vm.stream.host_reads()
    }

    /// Whether to ring the host's doorbell now (the host reads the rings,
    /// and one of them is filling).
    pub fn doorbell(&mut self, now_ns: u64) -> bool {
        self.vm.stream.doorbell(now_ns)
    }

    /// `TraceStart` / `TraceStop`.
    pub fn set_stream(&mut self, format: Option<TraceFormat>) {
        self.vm.stream.set_format(format, &mut self.vm.graph);
    }

    /// The stream's next `TraceText`, when there is output and the
    /// control channel's output queue has `room` bytes free: the exit loop
    /// sends it, and asks again while it has room.
    pub fn next_text(
        &mut self,
        room: usize,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Option<protocol::Event> {
        self.vm
            .stream
            .next_text(room, kernel, now_ns, &self.vm.probes, &mut self.vm.graph)
    }

    /// Drops the return stacks of tasks that died (see [`fgraph`]).
    pub fn reap(&mut self, kernel: Option<&dyn KernelView>, cpu: &CpuView, now_ns: u64) {
        self.vm.graph.reap(kernel, cpu, now_ns, &mut self.vm.stats);
    }

    /// An EPT violation at `gpa` (a `write`, or an instruction `fetch`): a
    /// hooked page or hypervisor memory gets a single step; a fetch from
    /// hypervisor memory is refused; anything else is not the tracer's.
    pub fn on_violation(
        &mut self,
        gpa: u64,
        write: bool,
        fetch: bool,
        env: &mut Env<'_>,
    ) -> Violation {
        self.cpu
            .step
            .on_violation(gpa, write, fetch, env, Self::step_shared(self.vm))
    }

    /// Root wrote the guest-physical bytes at `gpa` on the guest's behalf
    /// (an instruction it emulates: INS, a task switch's TSS, descriptor
    /// and stack writes), straight to the guest's frame and not through
    /// EPT: a hooked page's shadows take the write as after a step. True
    /// when the page was hooked.
    pub fn emulated_write(&mut self, gpa: u64, env: &mut Env<'_>) -> bool {
        let page = crate::addr::Gpa(gpa).align_down(machine::PAGE as u64);
        let Some(h) = self.vm.view.pages.get_mut(&page) else {
            return false;
        };
        step::resync_hooked(page, h, env);
        self.vm.stats.guest_writes += 1;
        true
    }

    /// [`Self::emulated_write`] for every hooked page (root does not know
    /// which pages an emulated instruction wrote).
    pub fn resync_all(&mut self, env: &mut Env<'_>) {
        for (&page, h) in self.vm.view.pages.iter_mut() {
            step::resync_hooked(page, h, env);
        }
    }

    /// Records the guest's TF before the step set it. A TF that a step of
    /// ours ended by force may have left is taken as root's, once.
    pub fn set_old_tf(&mut self, tf: bool) {
        let stray = tf && self.vm.stray.take();
        self.cpu.step.set_old_tf(tf && !stray);
    }

    /// What a #DB means to the tracer.
    pub fn debug_state(&self) -> DebugState {
        self.cpu.step.debug_state(self.vm.stray.left > 0)
    }

    /// Ends the step in flight (its #DB arrived).
    pub fn finish_step(&mut self, env: &mut Env<'_>) {
        self.cpu.step.end_step(env, Self::step_shared(self.vm));
    }

    /// Root's leftover TF has trapped and is cleared.
    pub fn clear_stray_tf(&mut self) {
        self.vm.stray.take();
    }

    /// Whether #DB must stay intercepted: a step is in flight on this
    /// vCPU, or a step ended by force may have left TF in a context that
    /// can resume on any vCPU.
    pub fn wants_debug_exits(&self) -> bool {
        self.cpu.step.stepping() || self.vm.stray.left > 0
    }
}
