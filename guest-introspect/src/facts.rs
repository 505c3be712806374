//! Kernel facts: the version banner, the KASLR slide, where `current` is,
//! and [`discover`], which finds everything in one call.
//!
//! Where to search in a booted guest: IA32_LSTAR holds the address of
//! `entry_SYSCALL_64`, which is in the kernel's `.text`; `.rodata`, with the
//! kallsyms tables and the banner, follows `.text`. [`ranges_from_lstar`]
//! turns the MSR value into the range to scan: from the 2 MiB page of
//! `entry_SYSCALL_64` up to the end of the kernel image mapping.

use alloc::string::String;
use core::fmt;

use crate::addr::{Gva, GvaRange, DEFAULT_TEXT_BASE, KERNEL_IMAGE_BASE};
use crate::btf::{self, Btf, BtfError, TaskLayout};
use crate::budget::{block_on, Budget, Metered, RECOVERY_BUDGET};
use crate::kallsyms::{self, KallsymsError, KallsymsTables, LocateStats, SymbolIndex};
use crate::module::ModuleLayout;
use crate::scan::{ScanStats, ScanStep, Scanner};
use crate::stacks::StackLayout;
use crate::view::{read_array, ViewError, VirtMemory};

/// `KERNEL_IMAGE_SIZE` with KASLR (arch/x86/include/asm/page_64_types.h):
/// the image mapping spans 1 GiB from `__START_KERNEL_map`.
pub const KERNEL_IMAGE_SIZE: u64 = 1 << 30;

/// The range to search for the kernel's tables, from the guest's IA32_LSTAR
/// (`entry_SYSCALL_64`): its 2 MiB page up to the end of the image mapping.
/// `None` when LSTAR is not in the kernel image mapping.
pub fn ranges_from_lstar(lstar: Gva) -> Option<GvaRange> {
    let end = Gva(KERNEL_IMAGE_BASE + KERNEL_IMAGE_SIZE);
    (lstar.is_kernel_image() && lstar < end).then(|| GvaRange::new(lstar.align_down(1 << 21), end))
}

/// The start of the banner `linux_banner` holds (init/version-timestamp.c).
pub const BANNER_PREFIX: &[u8] = b"Linux version ";
/// Longest banner read.
const MAX_BANNER: usize = 512;

/// The kernel's version banner, `Linux version 6.1.0-... (...) #1 SMP ...`,
/// without the trailing newline: from `linux_banner` when the symbol is
/// known, else the first well-formed one found by scanning `ranges`.
pub fn banner<V: VirtMemory + ?Sized>(
    view: &V,
    index: Option<&SymbolIndex>,
    ranges: &[GvaRange],
    stats: &mut ScanStats,
) -> Option<String> {
    block_on(banner_paced(
        view,
        index,
        ranges,
        stats,
        &Budget::unlimited(),
    ))
}

/// [`banner`], pausing on `pace` between steps of the scan. Stops (with
/// what it has) when the view refuses a read for budget.
pub async fn banner_paced<V: VirtMemory + ?Sized>(
    view: &V,
    index: Option<&SymbolIndex>,
    ranges: &[GvaRange],
    stats: &mut ScanStats,
    pace: &Budget,
) -> Option<String> {
    if let Some(at) = index.and_then(|i| i.addr_of("linux_banner")) {
        if let Some(b) = banner_at(view, at) {
            return Some(b);
        }
    }
    // A kernel may carry a second, unused banner whose version has no build
    // number ("#" alone: the weak `linux_banner` left in init/version.o);
    // prefer the one with "#<digits>".
    let mut fallback = None;
    for &r in ranges {
        let Some(mut scanner) = Scanner::new(r, BANNER_PREFIX) else {
            continue;
        };
        loop {
            pace.pause().await;
            match scanner.step(view, stats) {
                ScanStep::Hit(at) => {
                    if let Some(b) = banner_at(view, at) {
                        if has_build_number(&b) {
                            return Some(b);
                        }
                        fallback.get_or_insert(b);
                    }
                }
                ScanStep::Read => {}
                ScanStep::Done => break,
                ScanStep::OverBudget => return fallback,
            }
        }
    }
    fallback
}

/// Whether the banner has a `#<digit>` build number (UTS_VERSION).
fn has_build_number(banner: &str) -> bool {
    banner
        .as_bytes()
        .windows(2)
        .any(|w| matches!(w, [b'#', d] if d.is_ascii_digit()))
}

/// A well-formed banner at `at`: the prefix, then printable ASCII up to a
/// newline or NUL.
fn banner_at<V: VirtMemory + ?Sized>(view: &V, at: Gva) -> Option<String> {
    let mut buf = [0u8; MAX_BANNER];
    // The banner may end near the end of a mapping: shrink until it reads.
    let mut n = MAX_BANNER;
    loop {
        match view.read_virt(at, buf.get_mut(..n)?) {
            Ok(()) => break,
            Err(ViewError::OverBudget { .. }) => return None,
            Err(_) => {}
        }
        n /= 2;
        if n < BANNER_PREFIX.len() + 8 {
            return None;
        }
    }
    let s = buf.get(..n)?;
    if !s.starts_with(BANNER_PREFIX) {
        return None;
    }
    let end = s.iter().position(|&c| c == b'\n' || c == 0)?;
    let line = s.get(..end)?;
    // A release word and more after it.
    if !line.iter().all(|&c| (0x20..0x7f).contains(&c)) || line.len() < BANNER_PREFIX.len() + 2 {
        return None;
    }
    core::str::from_utf8(line).ok().map(String::from)
}

/// The release (`uname -r`) in a banner: the word after "Linux version ".
pub fn release_of(banner: &str) -> Option<&str> {
    banner
        .strip_prefix("Linux version ")?
        .split(' ')
        .next()
        .filter(|r| !r.is_empty())
}

/// Where the running task pointer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CurrentSource {
    /// The per-cpu variable `current_task` (up to 6.1).
    CurrentTask,
    /// `pcpu_hot.current_task`, member offset from BTF (6.2 to 6.14).
    PcpuHotBtf,
    /// `pcpu_hot.current_task` without BTF: the member is the first one in
    /// every kernel that has `pcpu_hot` (arch/x86/include/asm/current.h,
    /// 6.2 to 6.14), so its offset is 0.
    PcpuHotFirstMember,
}

/// How to find `current`: `*(GS_BASE + percpu_offset)` on the vCPU, with
/// GS_BASE the kernel's (IA32_GS_BASE while in the kernel, IA32_KERNEL_GS_BASE
/// while in user mode, before `swapgs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CurrentTask {
    /// Offset of the task pointer in the per-cpu area.
    pub percpu_offset: u64,
    /// How it was found.
    pub source: CurrentSource,
}

/// Why `current` cannot be located.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CurrentError {
    /// Neither `current_task` nor `pcpu_hot` is a symbol (a 6.15+ kernel
    /// keeps `current_task` again but as a plain per-cpu variable; it would
    /// be found as such).
    NoSymbol,
    /// `pcpu_hot` exists, BTF does, but the member lookup failed.
    Btf(BtfError),
}

impl fmt::Display for CurrentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoSymbol => f.write_str("neither current_task nor pcpu_hot is a kallsyms symbol"),
            Self::Btf(e) => write!(f, "pcpu_hot.current_task: {e}"),
        }
    }
}

/// Locates the per-cpu task pointer.
pub fn current_task<V: VirtMemory + ?Sized>(
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
) -> Result<CurrentTask, CurrentError> {
    block_on(current_task_paced(index, btf, &Budget::unlimited()))
}

/// [`current_task`], pausing on `pace` in the BTF lookup.
pub async fn current_task_paced<V: VirtMemory + ?Sized>(
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    pace: &Budget,
) -> Result<CurrentTask, CurrentError> {
    if let Some(a) = index.addr_of("current_task") {
        return Ok(CurrentTask {
            percpu_offset: a.0,
            source: CurrentSource::CurrentTask,
        });
    }
    let hot = index.addr_of("pcpu_hot").ok_or(CurrentError::NoSymbol)?;
    match btf {
        Some(b) => {
            let off = btf::pcpu_hot_current_task_paced(b, pace)
                .await
                .map_err(CurrentError::Btf)?;
            Ok(CurrentTask {
                percpu_offset: hot.0.wrapping_add(off as u64),
                source: CurrentSource::PcpuHotBtf,
            })
        }
        None => Ok(CurrentTask {
            percpu_offset: hot.0,
            source: CurrentSource::PcpuHotFirstMember,
        }),
    }
}

/// The task running on a vCPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningTask {
    /// `current`.
    pub task: Gva,
    /// `current->pid` (the thread id).
    pub pid: i32,
    /// `current->comm`, NUL-padded.
    pub comm: [u8; 16],
}

impl RunningTask {
    /// `comm` up to its first NUL.
    pub fn comm_bytes(&self) -> &[u8] {
        // The first of the pieces between NULs (`split` yields one at least).
        self.comm
            .split(|&c| c == 0)
            .next()
            .unwrap_or(self.comm.as_slice())
    }
}

/// Reads `current`, its pid and comm, given the vCPU's kernel GS base.
pub fn running_task<V: VirtMemory + ?Sized>(
    view: &V,
    gs_base: Gva,
    current: &CurrentTask,
    layout: &TaskLayout,
) -> Result<RunningTask, ViewError> {
    let slot = gs_base.wrapping_add(current.percpu_offset);
    let task = Gva(u64::from_le_bytes(read_array(view, slot)?));
    let pid = i32::from_le_bytes(read_array(view, task.wrapping_add(layout.pid as u64))?);
    let mut comm = [0u8; 16];
    let n = core::cmp::min(layout.comm_len as usize, comm.len());
    // `n` is at most 16: the slice is always there.
    let out = comm.get_mut(..n).unwrap_or_default();
    view.read_virt(task.wrapping_add(layout.comm as u64), out)?;
    Ok(RunningTask { task, pid, comm })
}

/// What the scheduler's events say of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskSched {
    /// Its pid.
    pub pid: i32,
    /// Its comm, NUL-padded.
    pub comm: [u8; 16],
    /// Its `prio`, when the layout has it and it reads.
    pub prio: Option<i32>,
    /// Its scheduler state (`__state`, or `state` before 5.14), when the
    /// layout has it and it reads.
    pub state: Option<u64>,
    /// Its `exit_state` (zombie, dead), when the layout has it and it
    /// reads.
    pub exit_state: Option<u32>,
    /// The CPU it is on (`task_cpu()`), when the layout has it and it
    /// reads.
    pub cpu: Option<u32>,
}

/// Reads the task at `task`: pid and comm (which must read), prio and
/// state (which may not).
pub fn task_sched<V: VirtMemory + ?Sized>(
    view: &V,
    task: Gva,
    layout: &TaskLayout,
) -> Result<TaskSched, ViewError> {
    let pid = i32::from_le_bytes(read_array(view, task.wrapping_add(layout.pid as u64))?);
    let mut comm = [0u8; 16];
    let n = core::cmp::min(layout.comm_len as usize, comm.len());
    // `n` is at most 16: the slice is always there.
    let out = comm.get_mut(..n).unwrap_or_default();
    view.read_virt(task.wrapping_add(layout.comm as u64), out)?;
    let prio = layout.prio.and_then(|off| {
        read_array(view, task.wrapping_add(u64::from(off)))
            .ok()
            .map(i32::from_le_bytes)
    });
    let state = layout.state.and_then(|(off, size)| {
        let at = task.wrapping_add(u64::from(off));
        if size == 8 {
            read_array(view, at).ok().map(u64::from_le_bytes)
        } else {
            read_array(view, at)
                .ok()
                .map(|b| u64::from(u32::from_le_bytes(b)))
        }
    });
    let exit_state = layout.exit_state.and_then(|off| {
        read_array(view, task.wrapping_add(u64::from(off)))
            .ok()
            .map(u32::from_le_bytes)
    });
    let cpu = layout.cpu.and_then(|off| {
        read_array(view, task.wrapping_add(u64::from(off)))
            .ok()
            .map(u32::from_le_bytes)
    });
    Ok(TaskSched {
        pid,
        comm,
        prio,
        state,
        exit_state,
        cpu,
    })
}

/// Everything [`discover`] finds.
#[derive(Debug)]
pub struct KernelFacts {
    /// Where the kallsyms tables are.
    pub tables: KallsymsTables,
    /// What finding them cost.
    pub locate_stats: LocateStats,
    /// The symbols.
    pub symbols: SymbolIndex,
    /// The version banner, if found.
    pub banner: Option<String>,
    /// `_text` at run time.
    pub text_base: Option<Gva>,
    /// `_text` minus its default link address (`0xffffffff81000000`): the
    /// virtual KASLR slide (0 without KASLR).
    pub kaslr_slide: Option<i64>,
    /// Where the BTF blob is, or why there is none.
    pub btf: Result<Gva, BtfError>,
    /// The blob walked: what makes it usable again without a walk (the
    /// probe language's BTF arguments), or why there is none.
    pub btf_index: Result<btf::BtfIndex, BtfError>,
    /// `task_struct` pid/comm offsets, or why they are unknown.
    pub task: Result<TaskLayout, BtfError>,
    /// Where `current` is.
    pub current: Result<CurrentTask, CurrentError>,
    /// `THREAD_SIZE` and where the per-CPU stacks are.
    pub stacks: StackLayout,
    /// `struct module`'s layout, or why it is unknown (no BTF, or a
    /// kernel without modules).
    pub modules: Result<ModuleLayout, BtfError>,
}

/// Finds the kernel in `ranges` of `view`: kallsyms, the symbol index, the
/// banner, the KASLR slide, BTF, the task layout and `current`. Only a
/// failure to find kallsyms (or a spent budget) is an error; the rest is
/// reported per field.
pub fn discover<V: VirtMemory + ?Sized>(
    view: &V,
    ranges: &[GvaRange],
) -> Result<KernelFacts, KallsymsError> {
    discover_limited(view, ranges, kallsyms::DEFAULT_MAX_INDEX_BYTES)
}

/// [`discover`] with the symbol index capped at `max_index_bytes` of heap
/// (the table sizes come from guest memory; a hypervisor heap is small),
/// doing at most [`RECOVERY_BUDGET`] units of work.
pub fn discover_limited<V: VirtMemory + ?Sized>(
    view: &V,
    ranges: &[GvaRange],
    max_index_bytes: usize,
) -> Result<KernelFacts, KallsymsError> {
    let budget = Budget::new(RECOVERY_BUDGET);
    block_on(discover_budgeted(
        &Metered::new(view, &budget),
        ranges,
        max_index_bytes,
    ))
}

/// [`discover_limited`] with every step charged to the view's budget: the
/// kallsyms search and validation, the index build, the banner and BTF
/// searches and the BTF walks share it, so that the whole does bounded work
/// whatever the guest plants. Pauses on the budget between bounded steps:
/// polled a slice at a time ([`crate::budget::poll_slice`]) it gives the
/// same result as run to the end at once. Names each stage on the budget
/// ([`Budget::stage`]).
///
/// [`KallsymsError::BudgetExhausted`] when the budget ran out, at whatever
/// stage (the partial results are dropped: a guest that can make one
/// stage exhaust it can make any).
pub async fn discover_budgeted<V: VirtMemory + ?Sized>(
    view: &Metered<'_, V>,
    ranges: &[GvaRange],
    max_index_bytes: usize,
) -> Result<KernelFacts, KallsymsError> {
    let budget = view.budget();
    let spent = |r: Result<KernelFacts, KallsymsError>| {
        if budget.exhausted() {
            Err(KallsymsError::BudgetExhausted)
        } else {
            r
        }
    };
    let mut locate_stats = LocateStats::default();
    budget.set_stage("kallsyms search");
    let tables = kallsyms::locate_budgeted(view, ranges, &mut locate_stats).await?;
    budget.set_stage("symbol index");
    let symbols = SymbolIndex::build_budgeted(view, &tables, max_index_bytes).await?;
    budget.set_stage("banner");
    let mut scan_stats = ScanStats::default();
    let banner = banner_paced(view, Some(&symbols), ranges, &mut scan_stats, budget).await;
    let text_base = symbols
        .addr_of("_text")
        .or_else(|| symbols.addr_of("_stext"));
    let kaslr_slide = text_base.map(|t| t.0.wrapping_sub(DEFAULT_TEXT_BASE.0) as i64);
    // With data symbols in kallsyms (KALLSYMS_ALL: `linux_banner` is one),
    // a kernel with BTF lists `__start_BTF`; its absence then means no BTF,
    // and the range need not be scanned for a header.
    budget.set_stage("BTF");
    let (btf_at, parsed) =
        if symbols.lookup("linux_banner").is_some() && symbols.lookup("__start_BTF").is_none() {
            (Err(BtfError::Absent), Err(BtfError::Absent))
        } else {
            match btf::locate_budgeted(view, Some(&symbols), ranges, &mut scan_stats).await {
                Ok((at, parsed)) => (Ok(at), parsed),
                Err(e) => (Err(e), Err(e)),
            }
        };
    let task = match &parsed {
        Ok(b) => btf::task_layout_paced(b, budget).await,
        Err(e) => Err(*e),
    };
    budget.set_stage("module layout");
    let modules = match &parsed {
        Ok(b) => crate::module::module_layout_paced(b, budget).await,
        Err(e) => Err(*e),
    };
    let btf_index = match &parsed {
        Ok(b) => b.index(),
        Err(e) => Err(*e),
    };
    let current = current_task_paced(&symbols, parsed.as_ref().ok(), budget).await;
    budget.set_stage("stacks");
    let stacks = crate::stacks::layout_paced(&symbols, parsed.as_ref().ok(), budget).await;
    spent(Ok(KernelFacts {
        tables,
        locate_stats,
        symbols,
        banner,
        text_base,
        kaslr_slide,
        btf: btf_at,
        btf_index,
        task,
        current,
        stacks,
        modules,
    }))
}
