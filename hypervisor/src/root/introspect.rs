//! Guest introspection in VMX root: the `guest-introspect` crate run over
//! the guest's own memory through its own page tables. Recovery (kallsyms,
//! banner, KASLR slide, BTF task layout, `current`, fentry survey) starts on
//! the first request that needs it after the kernel is up, and its result
//! is kept for the life of the VM.
//!
//! Recovery is resumable: it runs one slice of work per turn of the run
//! loop ([`TURN_SLICE`] units of its budget, [`Introspection::turn`] and
//! every [`Introspection::ensure`]), so that the control channel is served
//! between slices, and it does at most [`RECOVERY_BUDGET`] units in all,
//! whatever the guest plants in its memory. An attempt that fails (budget
//! spent, tables not found) is not retried before a back-off of root time
//! and turns has passed ([`Backoff`]: 10 s and 2,000 turns, doubling per
//! failure up to about 10 minutes).

use crate::arch::instructions as insn;
use crate::clock;
use crate::phys;
use alloc::boxed::Box;
use alloc::format;
use alloc::rc::Rc;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::cell::{Cell, RefCell};
use core::fmt::Write as _;
use core::future::Future;
use core::pin::Pin;
use core::task::Poll;
use guest_introspect::addr::{Gva, GvaRange};
use guest_introspect::budget::{self, Backoff, Budget, Metered, RECOVERY_BUDGET, TURN_SLICE};
use guest_introspect::facts::{self, KernelFacts};
use guest_introspect::fentry::{self, Classifier};
use guest_introspect::kallsyms::{KallsymsError, SymbolId};
use guest_introspect::linear::{LinearError, LinearMaps, LinearView, LinearWindow};
use guest_introspect::mem::{GuestMemory, MemError};
use guest_introspect::module::{self, ModuleIndex, MODULE_WALK_BUDGET};
use guest_introspect::paging::{self, Cr3};
use guest_introspect::stacks::{self, StackKind, StackMap};
use guest_introspect::view::PagedView;
use guest_introspect::view::{ViewError, VirtMemory};
use loader::layout::Gpa;
use protocol::{KernelReport, SymbolInfo, TaskInfo};

use x86::msr::IA32_LSTAR;

pub use hypervisor::tracer::machine::{CpuView, KernelView, Running};
/// Heap the symbol index may take at most; less when the heap has less
/// room ([`crate::heap::room`]) when recovery starts.
const MAX_INDEX_BYTES: usize = 10 << 20;
/// Heap the module index may take at most.
const MAX_MODULE_BYTES: usize = 8 << 20;

/// Guest RAM as introspection reads it: anything but hypervisor memory and
/// what the hypervisor's own page tables do not map.
pub struct GuestRam;

impl GuestMemory for GuestRam {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError> {
        phys::guest_ram().read_phys(gpa, buf)
    }
}

/// Recovery results.
pub struct Kernel {
    facts: KernelFacts,
    pub report: KernelReport,
    cr3: Cr3,
    /// `__per_cpu_offset[0 .. nr_cpu_ids]`: a CPU's GS base in kernel mode
    /// is its entry, so its position there is the guest's number for the
    /// CPU. Fixed once the kernel has set up its per-cpu areas, long
    /// before recovery runs.
    percpu: Vec<u64>,
    /// The loaded modules as of the last walk ([`Kernel::refresh_modules`]).
    modules: ModuleIndex,
    /// The direct map and the image's map, checked: `current`, its pid and
    /// its name are read through them without walks.
    linear: LinearMaps,
}

/// Introspection state across the VM's life.
#[derive(Default)]
pub struct Introspection {
    kernel: Option<Kernel>,
    /// Why there is no kernel yet: in progress, or the last failure.
    last_error: Option<String>,
    /// The recovery in progress.
    job: Option<Job>,
    /// A slice of the job ran since the last [`Self::turn`].
    stepped: bool,
    /// Turns seen ([`Self::turn`] calls).
    turns: u64,
    /// When a failed recovery may run again.
    backoff: Backoff,
    /// The guest's system calls, read at the first page of a listing
    /// ([`Self::syscalls`]) and kept for its later pages.
    syscalls: Option<Vec<SyscallEntry>>,
}

/// One of the guest's system calls, with the structs it reads from its
/// caller.
pub struct SyscallEntry {
    /// The call.
    pub call: guest_introspect::syscalls::Syscall,
    /// Its input structs' layouts
    /// ([`guest_introspect::syscall_structs::input_structs`]).
    pub structs: Vec<guest_introspect::syscall_structs::ArgStruct>,
}

impl Introspection {
    /// The guest's system calls: read again from its `sys_call_table`,
    /// metadata and BTF when `fresh` (a listing's first page) or never
    /// read, else as last read.
    pub fn syscalls(&mut self, fresh: bool) -> Option<Result<&[SyscallEntry], String>> {
        let k = self.kernel.as_ref()?;
        if fresh || self.syscalls.is_none() {
            match k.syscall_table() {
                Ok(t) => self.syscalls = Some(t),
                Err(e) => return Some(Err(e)),
            }
        }
        self.syscalls.as_deref().map(Ok)
    }

    /// The kernel report, once recovery ran.
    pub fn report(&self) -> Option<&KernelReport> {
        self.kernel.as_ref().map(|k| &k.report)
    }

    /// The recovered kernel, starting recovery or running one slice of it
    /// (at most one slice per turn) when there is none yet. Needs the guest
    /// to have set up its syscall entry (IA32_LSTAR), i.e. to have booted.
    /// While recovery runs, the error says how far it got; after a failed
    /// attempt it says why, and when the next attempt may start. `now_ns`
    /// is root's monotonic clock.
    pub fn ensure(&mut self, cpu: &CpuView, tsc_hz: u64, now_ns: u64) -> Result<&Kernel, String> {
        if self.kernel.is_none() {
            if self.job.is_none() {
                if !self.backoff.may_retry(now_ns, self.turns) {
                    let why = self.last_error.as_deref().unwrap_or("recovery failed");
                    return Err(format!(
                        "{why} (attempt {} failed; the next in {} s at the earliest)",
                        self.backoff.failures(),
                        self.backoff.wait_ns(now_ns).div_ceil(1_000_000_000)
                    ));
                }
                match Job::start(cpu) {
                    Ok(job) => {
                        log::info!(
                            "introspection: recovering the guest kernel from LSTAR {:#x}, {} Mi work units at most, {} Ki a turn",
                            job.lstar,
                            RECOVERY_BUDGET >> 20,
                            TURN_SLICE >> 10
                        );
                        self.job = Some(job);
                    }
                    Err(e) => {
                        // Cheap (no memory was searched): no back-off.
                        if self.last_error.as_deref() != Some(e.as_str()) {
                            log::info!("introspection not ready: {e}");
                        }
                        self.last_error = Some(e.clone());
                        return Err(e);
                    }
                }
            }
            if !self.stepped {
                self.step(cpu, tsc_hz, now_ns);
            }
        }
        match &self.kernel {
            Some(k) => Ok(k),
            None => Err(self
                .last_error
                .clone()
                .unwrap_or_else(|| "introspection failed".to_string())),
        }
    }

    /// Once per turn of the run loop, after the requests of the turn: runs
    /// a slice of the recovery in progress unless a request already did.
    pub fn turn(&mut self, cpu: &CpuView, tsc_hz: u64, now_ns: u64) {
        if self.job.is_some() && !self.stepped {
            self.step(cpu, tsc_hz, now_ns);
        }
        self.stepped = false;
        self.turns += 1;
    }

    /// Whether a recovery is under way (requests that need the kernel may
    /// wait for it).
    pub fn in_progress(&self) -> bool {
        self.job.is_some()
    }

    /// Runs one slice of the job.
    fn step(&mut self, cpu: &CpuView, tsc_hz: u64, now_ns: u64) {
        self.stepped = true;
        let Some(job) = self.job.as_mut() else {
            return;
        };
        *job.shared.cpu.borrow_mut() = cpu.clone();
        let t0 = insn::rdtsc();
        let poll = budget::poll_slice(job.fut.as_mut(), &job.shared.budget, TURN_SLICE);
        job.ticks = job.ticks.saturating_add(insn::rdtsc().saturating_sub(t0));
        let b = &job.shared.budget;
        match poll {
            Poll::Pending => {
                self.last_error = Some(format!(
                    "recovery in progress: {} of {} Mi work units after {} turns ({})",
                    Mi(b.used()),
                    b.limit() >> 20,
                    b.slices(),
                    b.stage()
                ));
            }
            Poll::Ready(Ok(mut k)) => {
                k.report.recovery_ns = clock::tsc_to_ns(job.ticks, tsc_hz);
                log::info!(
                    "introspection: {} ({} symbols, {} traceable, KASLR slide {:#x}) in {} ms of root time over {} turns, {} Mi work units ({} KiB read), index {} KiB",
                    k.report.release,
                    k.report.symbols,
                    k.report.traceable,
                    k.report.kaslr_slide,
                    k.report.recovery_ns / 1_000_000,
                    b.slices(),
                    Mi(b.used()),
                    b.bytes_read() >> 10,
                    k.report.index_bytes >> 10
                );
                if let Some(Running { pid, comm, .. }) = k.current(cpu) {
                    let name = comm.split(|&b| b == 0).next().unwrap_or_default();
                    log::info!(
                        "introspection: recovery ended in pid {pid} ({}), CR3 {:#x}",
                        core::str::from_utf8(name).unwrap_or("?"),
                        cpu.cr3
                    );
                }
                k.log_stacks(&k.stack_map(cpu));
                self.kernel = Some(k);
                self.last_error = None;
                self.backoff.succeeded();
                self.job = None;
            }
            Poll::Ready(Err(e)) => {
                let wait = self.backoff.failed(now_ns, self.turns);
                log::warn!(
                    "introspection: recovery failed after {} turns, {} Mi work units ({} KiB read): {e}; next attempt in {} s at the earliest",
                    b.slices(),
                    Mi(b.used()),
                    b.bytes_read() >> 10,
                    wait / 1_000_000_000
                );
                self.last_error = Some(e);
                self.job = None;
            }
        }
    }

    /// The recovered kernel, if recovery succeeded.
    pub fn kernel(&self) -> Option<&Kernel> {
        self.kernel.as_ref()
    }

    /// Walks the guest's module list again, once the kernel is recovered
    /// ([`Kernel::refresh_modules`]).
    pub fn refresh_modules(&mut self, tsc_hz: u64) {
        if let Some(k) = self.kernel.as_mut() {
            k.refresh_modules(tsc_hz, None);
        }
    }

    /// The same at the load of the module whose `struct module` is at
    /// `loading`, seen at the hidden hook on `do_init_module` (see
    /// [`Kernel::refresh_modules`]).
    pub fn refresh_modules_at_load(&mut self, tsc_hz: u64, loading: u64) {
        if let Some(k) = self.kernel.as_mut() {
            k.refresh_modules(tsc_hz, Some(Gva(loading)));
        }
    }

    /// Takes the kernel out for a call that needs it beside other mutable
    /// state; give it back with [`Self::put_kernel`].
    pub fn take_kernel(&mut self) -> Option<Kernel> {
        self.kernel.take()
    }

    /// Puts back what [`Self::take_kernel`] took.
    pub fn put_kernel(&mut self, k: Option<Kernel>) {
        if k.is_some() {
            self.kernel = k;
        }
    }

    /// pid/comm of the task running on the vCPU, when recovery knows how.
    pub fn current_task(&self, cpu: &CpuView) -> Option<TaskInfo> {
        let k = self.kernel.as_ref()?;
        let layout = k.facts.task.as_ref().ok()?;
        let current = k.facts.current.as_ref().ok()?;
        let view = PagedView::new(&GuestRam, k.cr3);
        let t = facts::running_task(&view, Gva(cpu.kernel_gs()), current, layout).ok()?;
        Some(TaskInfo {
            pid: t.pid,
            comm: String::from_utf8_lossy(t.comm_bytes()).into_owned(),
            cpu: k.cpu_number(cpu).unwrap_or(0),
        })
    }
}

/// Work units in Mi, one decimal (no floating point in root).
struct Mi(u64);

impl core::fmt::Display for Mi {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let tenths = (self.0 >> 20) * 10 + (((self.0 & 0xf_ffff) * 10) >> 20);
        write!(f, "{}.{}", tenths / 10, tenths % 10)
    }
}

/// What the recovery future and its driver share.
struct Shared {
    budget: Budget,
    /// The vCPU as of the current turn: reads walk that turn's kernel CR3
    /// (a CR3 kept from an earlier turn may belong to a task that has
    /// exited since, its tables freed).
    cpu: RefCell<CpuView>,
    /// Which of [`CpuView::kernel_cr3s`]: 0 the CR3 as it is, 1 the kernel
    /// half of a PTI pair.
    which: Cell<usize>,
}

/// Guest memory through the page tables of the current turn.
struct TurnView<'s> {
    shared: &'s Shared,
}

impl VirtMemory for TurnView<'_> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let cr3 = self.shared.cpu.borrow().kernel_cr3(self.shared.which.get());
        paging::read_virt(&GuestRam, cr3, gva, buf).map_err(ViewError::from)
    }
}

/// A recovery in progress.
struct Job {
    shared: Rc<Shared>,
    fut: Pin<Box<dyn Future<Output = Result<Kernel, String>>>>,
    /// Root time spent in its slices, in TSC ticks.
    ticks: u64,
    lstar: u64,
}

impl Job {
    /// Checks that the guest can be searched, and sets up the search. Reads
    /// nothing of guest memory yet.
    fn start(cpu: &CpuView) -> Result<Self, String> {
        if cpu.la57 {
            // Every walk here is 4-level; a 5-level guest would be misread.
            return Err(
                "the guest uses 5-level paging (CR4.LA57), which hvtrace does not support; \
                 boot it with no5lvl"
                    .to_string(),
            );
        }
        // SAFETY: IA32_LSTAR exists on every x86-64 CPU; VMX does not switch it,
        // so this is the guest's value.
        let lstar = unsafe { insn::rdmsr(IA32_LSTAR) };
        let range = facts::ranges_from_lstar(Gva(lstar)).ok_or_else(|| {
            format!("the guest has not set up its syscall entry yet (LSTAR {lstar:#x})")
        })?;
        let shared = Rc::new(Shared {
            budget: Budget::new(RECOVERY_BUDGET),
            cpu: RefCell::new(cpu.clone()),
            which: Cell::new(0),
        });
        Ok(Self {
            fut: Box::pin(recover(shared.clone(), range)),
            shared,
            ticks: 0,
            lstar,
        })
    }
}

/// Recovery, one budget for all of it. Pauses between bounded steps; the
/// driver polls it a slice at a time, each turn with that turn's CPU state.
///
/// A turn in user mode has the user CR3, which under PTI is the user half
/// of a pair and maps little of the kernel: the first attempt takes the CR3
/// as it is (right without PTI), and if that fails the second takes the
/// kernel half (right with PTI). Turns in kernel mode use their CR3 either
/// way.
async fn recover(shared: Rc<Shared>, range: GvaRange) -> Result<Kernel, String> {
    let view = TurnView { shared: &shared };
    let budget = &shared.budget;
    let m = Metered::new(&view, budget);
    let spent = |b: &Budget| {
        format!(
            "recovery gave up: its budget of {} Mi work units is spent (in the {} stage, {} KiB read); \
             the guest's memory holds more table-like data than a kernel",
            b.limit() >> 20,
            b.stage(),
            b.bytes_read() >> 10
        )
    };
    let mut last = String::new();
    for which in 0..2 {
        shared.which.set(which);
        // One heap budget: the index takes at most what is free beyond
        // the heap's reserve, checked before any of it is allocated.
        let room = crate::heap::room();
        let max_index = MAX_INDEX_BYTES.min(room);
        match facts::discover_budgeted(&m, &[range], max_index).await {
            Ok(f) => {
                budget.set_stage("fentry survey");
                let survey = fentry::survey_paced(&m, &f.symbols, false, budget).await;
                if budget.exhausted() {
                    return Err(spent(budget));
                }
                if survey.sites_refused > 0 {
                    log::warn!(
                        "introspection: out of hypervisor memory in the fentry survey: {} sites not counted",
                        survey.sites_refused
                    );
                }
                let text = f.symbols.iter().filter(|s| s.kind.is_text()).count() as u32;
                let release = f
                    .banner
                    .as_deref()
                    .and_then(facts::release_of)
                    .unwrap_or("unknown")
                    .to_string();
                let report = KernelReport {
                    release,
                    kaslr_slide: f.kaslr_slide.unwrap_or(0),
                    symbols: f.symbols.len() as u32,
                    text_symbols: text,
                    traceable: survey.unique_sites as u32,
                    index_bytes: f.symbols.heap_bytes() as u64,
                    // Root time over all slices; the driver fills it in.
                    recovery_ns: 0,
                    task_layout_error: f.task.as_ref().err().map(|e| e.to_string()),
                    modules: Default::default(),
                };
                let cr3 = shared.cpu.borrow().kernel_cr3(which);
                let root = kernel_pgd(&f, cr3);
                let percpu = stacks::percpu_offsets(&f.symbols, &PagedView::new(&GuestRam, root));
                let linear = linear_maps(&f, root);
                return Ok(Kernel {
                    facts: f,
                    report,
                    cr3: root,
                    percpu,
                    linear,
                    modules: ModuleIndex::default(),
                });
            }
            Err(KallsymsError::BudgetExhausted) => return Err(spent(budget)),
            Err(KallsymsError::TooLarge { bytes }) => {
                return Err(format!(
                    "out of hypervisor memory: the symbol index needs {bytes} bytes, {max_index} may be used ({} KiB of the heap free beyond its reserve, at most {} KiB for the index)",
                    room >> 10,
                    MAX_INDEX_BYTES >> 10
                ))
            }
            Err(e @ KallsymsError::OutOfMemory { .. }) => return Err(e.to_string()),
            Err(e) => last = format!("kallsyms not found: {e}"),
        }
    }
    Err(last)
}

/// The kernel's linear maps in the address space at `root`, each checked
/// against walks ([`LinearMaps::find`]); logged either way.
fn linear_maps(f: &KernelFacts, root: Cr3) -> LinearMaps {
    let s = &f.symbols;
    let image = s.addr_of("_text").zip(s.addr_of("_end"));
    let found = LinearMaps::find(&GuestRam, root, s.addr_of("page_offset_base"), image);
    let say = |w: &Result<LinearWindow, LinearError>| match w {
        Ok(w) => format!("{:#x}..{:#x} at -{:#x}", w.start, w.end, w.delta),
        Err(e) => format!("not used: {e}"),
    };
    log::info!(
        "introspection: linear maps: direct map {}; image {}",
        say(&found.direct),
        say(&found.image)
    );
    found.maps
}

/// The kernel's own top-level table (`init_top_pgt`), which outlives every
/// task, found through the CR3 recovery walked with. Falls back to that CR3
/// (with a warning) on a kernel without the symbol.
fn kernel_pgd(f: &KernelFacts, via: Cr3) -> Cr3 {
    let Some(pgd) = f.symbols.addr_of("init_top_pgt") else {
        log::warn!("introspection: no init_top_pgt symbol; kernel walks use the CR3 of recovery");
        return via;
    };
    let probes: Vec<Gva> = ["_text", "_stext", "init_task"]
        .iter()
        .filter_map(|n| f.symbols.addr_of(n))
        .collect();
    match guest_introspect::paging::kernel_root(&GuestRam, via, pgd, &probes) {
        Ok(root) => {
            log::info!(
                "introspection: kernel walks use init_top_pgt at guest-physical {:#x}",
                root.0
            );
            root
        }
        Err(e) => {
            log::warn!("introspection: init_top_pgt unusable ({e:?}); kernel walks use the CR3 of recovery");
            via
        }
    }
}

impl Kernel {
    /// The guest's system calls ([`guest_introspect::syscalls::tables`]),
    /// with BTF when the kernel has it, and their input structs.
    fn syscall_table(&self) -> Result<Vec<SyscallEntry>, String> {
        let view = PagedView::new(&GuestRam, self.cr3);
        let btf = self
            .facts
            .btf_index
            .as_ref()
            .ok()
            .map(|i| guest_introspect::btf::Btf::from_index(&view, i));
        // The 32-bit calls too, when the kernel has IA32 emulation.
        let (calls, compat_error) =
            guest_introspect::syscalls::tables(&view, &self.facts.symbols, btf.as_ref())
                .map_err(|e| alloc::format!("{e}"))?;
        if let Some(e) = compat_error {
            log::warn!("introspection: no 32-bit system calls: {e}");
        }
        let mut out = Vec::new();
        out.try_reserve(calls.len())
            .map_err(|_| alloc::string::String::from("no memory for the system calls"))?;
        for call in calls {
            let structs = btf
                .as_ref()
                .map(|b| guest_introspect::syscall_structs::input_structs(b, &call.args))
                .unwrap_or_default();
            out.push(SyscallEntry { call, structs });
        }
        Ok(out)
    }
}

impl KernelView for Kernel {
    /// The symbol index.
    fn index(&self) -> &guest_introspect::kallsyms::SymbolIndex {
        &self.facts.symbols
    }

    /// The loaded modules as of the last walk.
    fn modules(&self) -> &ModuleIndex {
        &self.modules
    }

    /// A module's core and init text, read through `init_top_pgt` now.
    fn module_text(&self, module: u64) -> Option<(GvaRange, GvaRange)> {
        let layout = self.facts.modules.as_ref().ok()?;
        let view = PagedView::new(&GuestRam, self.cr3);
        module::module_text(&view, layout, Gva(module)).ok()
    }

    /// The kernel's own top-level table (`init_top_pgt`), valid for the
    /// VM's life, unlike the CR3 of whichever task recovery interrupted.
    fn cr3(&self) -> Cr3 {
        self.cr3
    }

    /// The task running on the vCPU described by `cpu`.
    fn current(&self, cpu: &CpuView) -> Option<Running> {
        let layout = self.facts.task.as_ref().ok()?;
        let current = self.facts.current.as_ref().ok()?;
        let view = LinearView::new(&GuestRam, self.cr3, &self.linear);
        let t = facts::running_task(&view, Gva(cpu.kernel_gs()), current, layout).ok()?;
        let mut comm = [0u8; 16];
        for (to, &from) in comm.iter_mut().zip(t.comm_bytes()) {
            *to = from;
        }
        Some(Running {
            task: t.task.0,
            pid: t.pid,
            comm,
        })
    }

    /// The guest's number for the CPU: where its kernel GS base stands in
    /// `__per_cpu_offset` (CPU 0 on a kernel without per-cpu offsets,
    /// which has one CPU).
    fn cpu_number(&self, cpu: &CpuView) -> Option<u32> {
        if self.percpu.is_empty() {
            return Some(0);
        }
        let gs = cpu.kernel_gs();
        self.percpu
            .iter()
            .position(|&base| base == gs)
            .map(|i| i as u32)
    }

    /// The guest's stacks as they are now: every possible CPU's hardirq
    /// and exception stacks (read through `__per_cpu_offset`, or this
    /// vCPU's GS base on a kernel without it), and `THREAD_SIZE` for task
    /// stacks.
    fn stack_map(&self, cpu: &CpuView) -> StackMap {
        let view = PagedView::new(&GuestRam, self.cr3);
        let mut bases = stacks::percpu_offsets(&self.facts.symbols, &view);
        if bases.is_empty() {
            bases.push(cpu.kernel_gs());
        }
        StackMap::read(&self.facts.stacks, &view, &bases)
    }

    /// Logs the stack layout and the per-CPU stacks of `map`, one line.
    fn log_stacks(&self, map: &StackMap) {
        let l = &self.facts.stacks;
        let mut line = format!(
            "introspection: stacks: THREAD_SIZE {:#x} ({}), exception stacks ({})",
            l.thread_size,
            l.thread_size_source.as_str(),
            l.exception_source.as_str()
        );
        const SHOWN: usize = 16;
        for r in map.per_cpu().iter().take(SHOWN) {
            let what = match r.kind {
                StackKind::Irq => "irq",
                StackKind::Exception(n) => n,
                StackKind::Task => "task",
            };
            let _ = write!(
                line,
                "; cpu {} {what} {:#x}-{:#x}",
                r.cpu.unwrap_or(0),
                r.base,
                r.base.wrapping_add(r.size)
            );
        }
        if map.per_cpu().len() > SHOWN {
            let _ = write!(line, "; and {} more", map.per_cpu().len() - SHOWN);
        }
        log::info!("{line}");
    }

    /// `task_struct.stack` (the base of its kernel stack; the kernel
    /// clears it when a dead task's stack is freed) of the task at `task`.
    /// `None` when the guest's BTF did not give the layout, or the task is
    /// unreadable.
    fn btf(&self) -> Result<&guest_introspect::btf::BtfIndex, guest_introspect::btf::BtfError> {
        self.facts.btf_index.as_ref().map_err(|e| *e)
    }

    fn task_sched(&self, task: u64) -> Option<guest_introspect::facts::TaskSched> {
        let layout = self.facts.task.as_ref().ok()?;
        let view = LinearView::new(&GuestRam, self.cr3, &self.linear);
        facts::task_sched(&view, Gva(task), layout).ok()
    }

    fn task_stack(&self, task: u64) -> Option<u64> {
        let layout = self.facts.task.as_ref().ok()?;
        let off = layout.stack?;
        let view = PagedView::new(&GuestRam, self.cr3);
        let mut w = [0u8; 8];
        view.read_virt(Gva(task.wrapping_add(u64::from(off))), &mut w)
            .ok()?;
        Some(u64::from_le_bytes(w))
    }
}

impl Kernel {
    /// Walks the kernel's module list again and replaces the module index
    /// with what it finds: every request that looks symbols up starts
    /// here, so that it sees the modules loaded now. The walk spends at
    /// most [`MODULE_WALK_BUDGET`] units of work (every read charged,
    /// whether the page cache has its page or not), at most
    /// [`module::MAX_WALK_SYMBOLS`] symbol table entries, and keeps its
    /// heap within [`MAX_MODULE_BYTES`] (and half the heap's room): the
    /// list, counts and names are the guest's. The last walk's index is
    /// dropped first (its heap is the new one's), so a failed walk leaves
    /// no module symbols, and the report says why.
    ///
    /// At a load (`loading`: the module's `struct module`, from the hidden
    /// hook on `do_init_module`, which sees every load while it is in) the
    /// walk keeps the symbols of the modules that are unchanged since the
    /// last walk and reads only the others' (`module::rewalk_modules_at_load`):
    /// on Debian a load no longer re-reads ext4's 3,000 symbols.
    pub fn refresh_modules(&mut self, tsc_hz: u64, loading: Option<Gva>) {
        let t0 = insn::rdtsc();
        let r = &mut self.report.modules;
        r.walks = r.walks.saturating_add(1);
        let layout = match &self.facts.modules {
            Ok(l) => *l,
            Err(e) => {
                r.error = Some(format!("struct module's layout is unknown: {e}"));
                return;
            }
        };
        let Some(head) = self.facts.symbols.addr_of("modules") else {
            r.error = Some("the guest's kallsyms has no `modules` list head".to_string());
            return;
        };
        let budget = Budget::new(MODULE_WALK_BUDGET);
        let view = PagedView::new(&GuestRam, self.cr3);
        // The old index goes first: its heap is the new one's (at a load,
        // its modules are the rewalk's to keep).
        let mut old = core::mem::take(&mut self.modules).into_modules();
        if loading.is_none() {
            old = Vec::new();
        }
        let max = MAX_MODULE_BYTES.min(crate::heap::room() / 2);
        // Through a cache of whole pages (the tables are read a few bytes
        // at a time from three places), every read charged all the same.
        let walked =
            module::walk_modules_budgeted(&view, &layout, head, max, old, loading, &budget)
                .map_err(|e| e.to_string())
                .and_then(|ms| ModuleIndex::new(ms, layout.states).map_err(|e| e.to_string()));
        let r = &mut self.report.modules;
        r.walk_ns = clock::tsc_to_ns(insn::rdtsc().saturating_sub(t0), tsc_hz);
        match walked {
            Ok(index) => {
                r.modules = index.modules().len() as u32;
                r.symbols = index.symbol_count() as u32;
                r.index_bytes = index.heap_bytes() as u64;
                r.error = None;
                if r.walks == 1 {
                    log::info!(
                        "introspection: {} modules, {} symbols, index {} KiB, walked in {} us",
                        r.modules,
                        r.symbols,
                        r.index_bytes >> 10,
                        r.walk_ns / 1000
                    );
                }
                self.modules = index;
            }
            Err(e) => {
                let e = if budget.exhausted() {
                    format!(
                        "the module walk spent its budget of {} Mi units",
                        MODULE_WALK_BUDGET >> 20
                    )
                } else {
                    e
                };
                log::warn!("introspection: module list: {e}");
                r.modules = 0;
                r.symbols = 0;
                r.index_bytes = 0;
                r.error = Some(e);
            }
        }
    }

    /// One page of the symbols matching `glob` (and, when `kinds` is not
    /// empty, whose type letter is in it), in `/proc/kallsyms` order: the
    /// kernel image's by address, then the modules' (only module
    /// `module`'s when it is not empty). Scans from position
    /// `cursor` (the kernel image's symbols first, then the modules'),
    /// stopping at `limit` matches or when `budget` bytes of answer are
    /// reached, so that the page fits a frame. Returns the count of all
    /// matches (on the first page only), the next cursor and the page.
    pub fn symbols(
        &self,
        glob: &str,
        kinds: &str,
        module: &str,
        cursor: u32,
        limit: u32,
        budget: usize,
    ) -> (Option<u32>, Option<u32>, Vec<SymbolInfo>) {
        let index = &self.facts.symbols;
        let view = PagedView::new(&GuestRam, self.cr3);
        let classifier = Classifier::new(index);
        let mut name = Vec::with_capacity(64);
        let kind_ok = |k: u8| kinds.is_empty() || kinds.as_bytes().contains(&k);
        let matches = |id: SymbolId, name: &mut Vec<u8>| {
            if !module.is_empty() || !kind_ok(index.symbol(id).kind.letter() as u8) {
                return false;
            }
            name.clear();
            index.name_into(id, name);
            guest_introspect::glob::matches(glob.as_bytes(), name)
        };
        let module_matches = |m: &module::Module, s: &module::ModuleSymbol| {
            (module.is_empty() || m.name == module)
                && kind_ok(s.kind)
                && guest_introspect::glob::matches(glob.as_bytes(), s.name.as_bytes())
        };
        let core = index.len() as u32;
        let total = (cursor == 0).then(|| {
            let c = if module.is_empty() {
                (0..core)
                    .filter(|&i| matches(SymbolId(i), &mut name))
                    .count()
            } else {
                0
            };
            let m = self
                .modules
                .kallsyms_order()
                .filter(|(_, m, s)| module_matches(m, s))
                .count();
            (c + m) as u32
        });
        let mut out = Vec::new();
        let mut used = 0usize;
        // With a module named, the kernel image's symbols are passed over.
        let mut id = if module.is_empty() {
            cursor
        } else {
            cursor.max(core)
        };
        while id < core {
            if out.len() as u32 >= limit || used >= budget {
                return (total, Some(id), out);
            }
            if matches(SymbolId(id), &mut name) {
                let s = info(index, &classifier, &view, SymbolId(id));
                used += s.name.len() + s.not_traceable.len() + 32;
                out.push(s);
            }
            id += 1;
        }
        for (_, m, s) in self.modules.kallsyms_order().skip((id - core) as usize) {
            if out.len() as u32 >= limit || used >= budget {
                return (total, Some(id), out);
            }
            if module_matches(m, s) {
                let (site, not_traceable) = match classifier.classify_module(&view, m, s) {
                    Ok(site) => (Some(site.site.0), String::new()),
                    Err(e) => (None, format!("{e:?}")),
                };
                let size = self
                    .modules
                    .resolve(Gva(s.addr))
                    .filter(|r| r.addr == s.addr)
                    .map_or(0, |r| r.size);
                used += s.name.len() + m.name.len() + not_traceable.len() + 32;
                out.push(SymbolInfo {
                    name: s.name.clone(),
                    addr: s.addr,
                    size,
                    kind: s.kind,
                    site,
                    not_traceable,
                    module: m.name.clone(),
                });
            }
            id = id.saturating_add(1);
        }
        (total, None, out)
    }
}

fn info<V: guest_introspect::view::VirtMemory + ?Sized>(
    index: &guest_introspect::kallsyms::SymbolIndex,
    classifier: &Classifier<'_>,
    view: &V,
    id: SymbolId,
) -> SymbolInfo {
    let s = index.symbol(id);
    let (site, not_traceable) = match classifier.classify(view, id) {
        Ok(site) => (Some(site.site.0), String::new()),
        Err(e) => (None, format!("{e:?}")),
    };
    SymbolInfo {
        name: index.name(id),
        addr: s.addr.0,
        size: index.size(id).unwrap_or(0),
        kind: s.kind.letter() as u8,
        site,
        not_traceable,
        module: String::new(),
    }
}
