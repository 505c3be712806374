//! The tracer in VMX root: the trampoline region in the guest's kernel
//! address space, hooked fentry sites behind an EPT split view, the entry
//! hypercall with its kprobe and function-tracer handlers, the event ring,
//! and the single-step that lets the guest read and write hooked pages.
//!
//! # The region
//! One code page (the entry and return trampolines) and one page table,
//! both hypervisor frames outside the guest's e820. EPT shows the code page
//! read+execute and the page table read-only, so the guest can use them but
//! never change them. The page table is hung into the guest's kernel page
//! tables at a free 2 MiB slot of the kernel-image mapping
//! (`0xffffffff80000000` + 1 GiB, PUD 510), which no kernel code allocates
//! from after boot: within 2 GiB of kernel text and of module space. The
//! PDE lives in guest memory, so it is checked on every turn and restored
//! (and counted) when the guest has changed it.
//!
//! # The split view
//! A hooked code page executes from a shadow frame: the guest's page with
//! our `call` over each hooked site, mapped execute-only. A guest read or
//! write of the page faults in EPT; the page is then mapped to the guest's
//! own frame (read/write/execute) for exactly one instruction, stepped with
//! RFLAGS.TF and an intercepted #DB (Bochs 2.7's monitor trap flag does
//! not work), after which the shadow is put back; after a write it is first
//! rebuilt from the guest's page, so the guest's own changes (its ftrace
//! turning a site into a call) take effect behind our patches.
//!
//! Guest accesses to hypervisor memory get the same single step with the
//! page mapped to a scratch frame: writes are discarded, reads see 0xCC, and
//! the guest keeps running.

use super::graph::{self as graph_fmt, GraphEventId, GraphKind, GraphText};
use super::machine::{CpuView, Env, KernelView, Running};
use super::retstack::{PopResult, PushError, RetStack, MAX_USERS};
use super::ring::EventRing;
use super::site::{self, Patch, PatchError, PAGE_SIZE};
use crate::addr::{Gpa, Hpa};
use crate::ept;
use crate::guest_phys::GuestDoor;
use crate::kprobe::{
    self, Command, EventHeader, FetchContext, GuestLayout, GuestMem, IndexSymbols, MemFault,
    ProbeSpec, RawEvent,
};
use crate::vmx::regs::GuestRegs;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;
use guest_introspect::addr::Gva as KGva;
use guest_introspect::fallible::{self, btree_entry_bytes, OutOfMemory};
use guest_introspect::fentry::Classifier;
use guest_introspect::paging::{self, Cr3};
use guest_introspect::stacks::StackMap;
use guest_introspect::view::PagedView;
use protocol::{ErrorKind, GraphFilter, ProbeInfo, TraceFormat, TracerReport};
use trampolines::patch::SITE_LEN;
use trampolines::{HypercallMode, PtRegs, TrampolineRegion};

/// Bytes of the vCPU's event ring.
const RING_BYTES: usize = 2 << 20;
/// The probe id of function-tracer events (probes count from 1).
const FUNCTION_ID: u32 = 0;
/// The return-stack user of return probes; graph sessions are users 1..15.
const RETPROBE_USER: u8 = 0;
/// A generation no event carries (generations are 4 bits).
const RETIRED_GEN: u8 = 0xff;
/// The first word of a session's data block on a frame of one of its
/// `set_graph_notrace` functions: nothing beneath it is traced for the
/// session, and the frame's own return is silent.
const NOTRACE_MARK: u64 = u64::from_le_bytes(*b"notrace\0");
/// How often the map of the guest's stacks is read again (a CPU brought
/// up later gets its IRQ and exception stacks then).
const STACK_MAP_EVERY_NS: u64 = 1_000_000_000;
/// Frames per return stack by default: 32 frames without data (5 words
/// each), 1280 B.
const STACK_FRAMES: u32 = 32;
/// Most frames a session may ask for per stack.
const MAX_STACK_FRAMES: u32 = 256;
/// Words of a frame without data: the frame and its tag.
const FRAME_TAGGED: usize = super::retstack::FRAME_WORDS + 1;
/// Kernel stacks tracked at most; calls on more are not hijacked (misses).
const MAX_STACKS: usize = 4096;
/// Hypervisor heap the return stacks may hold at most, were they all full:
/// with a session's `stack_frames`, fewer stacks are tracked.
const STACK_BUDGET: usize = 3 << 20;
/// Return stacks of dead tasks are looked for this often (hypervisor
/// time); each look reads two words of every tracked task.
const REAP_EVERY_NS: u64 = 100_000_000;
/// Frames kept free for everything else when shadows are allocated.
const FRAME_RESERVE: u64 = 1 << 20;
/// A step not finished after this many timer turns is ended by force (the
/// stepped context was preempted; its stale TF is swallowed later).
const STEP_TIMEOUT_TURNS: u32 = 4;
/// Text per `TraceText` event, so that a frame stays under `MAX_FRAME`.
const TRACE_TEXT_BUDGET: usize = 2800;
/// How long (hypervisor time) a graph entry is held back for a leaf line
/// once the ring has nothing more: a call without a return by then is
/// printed open.
const LEAF_HOLD_NS: u64 = 100_000_000;
/// Output queue the drain leaves for responses.
const TX_HEADROOM: usize = 8 * 1024;
/// Sites hooked at most (Debian's kernel has about 38,000 traceable
/// functions). With [`heap::check`] before each new one, this bounds the
/// site and page maps, which cannot reserve.
const MAX_SITES: usize = 1 << 16;
/// Probes defined at most.
const MAX_PROBES: usize = 1024;
/// Heap one more hooked site may take: its `sites` entry, a `pages` entry
/// and a patch.
const SITE_BYTES: usize = btree_entry_bytes::<u64, SiteUse>()
    + btree_entry_bytes::<u64, Hooked>()
    + core::mem::size_of::<Patch>();
/// Heap one more tracked return stack may take (its entry; the frames are
/// reserved fallibly by the stack itself).
const STACK_ENTRY_BYTES: usize =
    btree_entry_bytes::<u64, Tracked>() + btree_entry_bytes::<u64, (u64, i32, bool)>();
/// Retired text renderers kept at most: each start and stop of a session
/// (the host's requests) retires one, and without a stream none is drained.
const MAX_RETIRED: usize = 64;
/// Sites released per pass when unhooking (a fixed buffer on root's stack:
/// a release never allocates).
const RELEASE_BATCH: usize = 256;

/// Start of the kernel-image mapping (`__START_KERNEL_map`) and its size
/// (`KERNEL_IMAGE_SIZE` with KASLR): PML4 511, PDPT 510.
const KERNEL_MAP: u64 = 0xffff_ffff_8000_0000;
const PML4_KERNEL: u64 = 511;
const PDPT_KERNEL_IMAGE: u64 = 510;
const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_A: u64 = 1 << 5;
const PTE_PS: u64 = 1 << 7;
const PTE_G: u64 = 1 << 8;

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

/// Keeps a stopped session's renderer for its events still in the ring:
/// at most [`MAX_RETIRED`] (the oldest goes first, as a renderer of a
/// session stopped long ago does once drained), and none when the heap has
/// no room (its events then print nothing, as for the oldest).
fn retire(retired: &mut Vec<(u32, u8, GraphText)>, r: (u32, u8, GraphText)) {
    if retired.len() >= MAX_RETIRED {
        retired.remove(0);
    }
    if fallible::try_push(retired, r).is_err() {
        log::warn!("tracer: out of hypervisor memory for a stopped session's renderer");
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

struct Region {
    tramp: TrampolineRegion,
    /// The guest page-table page holding our PDE: write-protected in EPT,
    /// so that a change to the PDE is seen (and undone) at once.
    pd_page: u64,
    /// Guest-physical address of the guest PDE we own, and its value.
    pde_gpa: u64,
    pde: u64,
}

struct Probe {
    id: u32,
    spec: ProbeSpec,
    site: u64,
    hits: u64,
    misses: u64,
}

/// Who uses a hooked site.
struct SiteUse {
    page: u64,
    func: u64,
    probes: Vec<u32>,
    /// Ids of the return probes on the function, as the words of the
    /// data block their frames carry.
    retprobes: Vec<u64>,
    function: bool,
    /// The graph sessions (bit N: session N) that hooked the function.
    graph: u16,
}

impl SiteUse {
    /// Nothing uses the site any more: it may be unhooked.
    fn unused(&self) -> bool {
        self.probes.is_empty() && self.retprobes.is_empty() && !self.function && self.graph == 0
    }
}

struct Hooked {
    shadow: Hpa,
    patches: Vec<Patch>,
}

#[derive(Clone, Copy)]
enum StepKind {
    /// A hooked code page, mapped to the guest's own frame for the step.
    Hooked { write: bool },
    /// A hypervisor page, mapped to the scratch frame; `restore` is the EPT
    /// entry to put back (0: absent).
    Discard { restore: u64 },
    /// The page table holding our PDE, mapped writable for the step.
    Watch,
}

/// The most pages one stepped instruction may hold open at once. One x86
/// instruction touches at most a few pages (its code, and source and
/// destination operands, each possibly crossing a page boundary, and the
/// descriptor and stack pages of an event it raises); past this, the step
/// starts over rather than growing.
const STEP_PAGES: usize = 8;

/// One instruction being single-stepped with some of its pages opened.
/// Every page the instruction touches joins the same step, so that an
/// instruction touching two watched pages opens both rather than making
/// the two steps alternate forever.
struct Step {
    pages: [(u64, StepKind); STEP_PAGES],
    open: usize,
    old_tf: bool,
    turns: u32,
}

impl Step {
    fn pages(&self) -> &[(u64, StepKind)] {
        &self.pages[..self.open]
    }
}

/// What the exit handler does with a VMCALL.
pub enum Hypercall {
    /// Ours: RAX is set; resume after the VMCALL.
    Handled,
    /// Not from our trampolines: #UD.
    Foreign,
}

/// What an EPT violation was.
pub enum Violation {
    /// A hooked page or hypervisor memory: a step was set up; resume.
    Stepping,
    /// One more page of the instruction already being stepped was opened;
    /// the step is armed already.
    Widened,
    /// Nothing of the tracer's.
    NotOurs,
}

/// The tracer's state for the VM (one vCPU).
pub struct Tracer {
    region: Option<Region>,
    probes: Vec<Probe>,
    next_id: u32,
    functions: u32,
    sites: BTreeMap<u64, SiteUse>,
    pages: BTreeMap<u64, Hooked>,
    free_shadows: Vec<Hpa>,
    scratch: Option<Hpa>,
    ring: EventRing,
    record: Vec<u8>,
    /// The streaming format, once the host asked for the stream.
    stream: Option<TraceFormat>,
    lost_reported: u64,
    /// A rendered line that did not fit the last `TraceText`, and its
    /// source.
    pending_line: Option<(u32, String)>,
    step: Option<Step>,
    /// A forced step end left TF in some saved guest context.
    stray_tf: bool,
    pub stats: TracerReport,
    /// Function-graph sessions by return-stack user number (0 is the
    /// return probes' user and never a session).
    sessions: Vec<Option<GraphSession>>,
    /// Return stacks by guest kernel stack base. They outlive the users
    /// while calls are in flight.
    stacks: BTreeMap<u64, Tracked>,
    /// Frames each new return stack holds.
    stack_frames: u32,
    /// Ownership checks by stack: (task, pid, own). A task whose calls
    /// keep emptying and re-creating its return stack is checked once,
    /// not on every call; a new owner of the stack is checked again.
    owners: BTreeMap<u64, (u64, i32, bool)>,
    /// Each session number's generation (see [`GraphEventId`]).
    generations: [u8; MAX_USERS],
    /// Text renderers of stopped sessions, by number and generation: the
    /// session's events still in the ring are rendered with them, then
    /// what they hold back is printed open and they go. (A renderer
    /// retired by a format switch gets a generation no event has.)
    retired: Vec<(u32, u8, GraphText)>,
    /// When the reaper last looked.
    last_reap_ns: u64,
    /// The guest's stacks: return stacks are kept per stack, keyed by its
    /// base (a task's `THREAD_SIZE` block, or a CPU's IRQ or exception
    /// stack), so that frames on one stack never count as dead because of
    /// a call on another.
    stack_map: StackMap,
    /// When `stack_map` was read (None: never).
    stack_map_ns: Option<u64>,
}

/// A function-graph session's settings, resolved to addresses, and its
/// renderer.
struct GraphSession {
    filter: GraphFilter,
    /// Functions that start a tree (empty: every hooked function).
    roots: BTreeSet<u64>,
    /// `set_graph_notrace` functions.
    notrace: BTreeSet<u64>,
    /// The function_graph text renderer (it holds one entry back).
    text: GraphText,
}

/// A return stack and the task last seen calling on its kernel stack.
struct Tracked {
    st: RetStack,
    task: u64,
    pid: i32,
    /// The stack is `task`'s own kernel stack (not an IRQ or exception
    /// stack it borrowed): only then can the task's death reap it.
    own: bool,
}

impl Default for Tracer {
    fn default() -> Self {
        Self::new()
    }
}

/// Guest-virtual memory through the vCPU's page tables.
struct VcpuMem<'a> {
    ram: &'a dyn GuestDoor,
    cr3: Cr3,
}

impl GuestMem for VcpuMem<'_> {
    fn read(&mut self, gva: KGva, buf: &mut [u8]) -> Result<(), MemFault> {
        paging::read_virt(self.ram, self.cr3, gva, buf).map_err(|_| MemFault)
    }
}

/// Points the EPT entry of guest page `page` at `hpa` with `perms`. A
/// failure (EPT tables exhausted) leaves the old entry, which is safe: the
/// page keeps its previous view.
fn remap(env: &mut Env<'_>, page: u64, hpa: Hpa, perms: u64) {
    if let Err(e) = env.m.ept_map(Gpa(page), hpa, perms) {
        log::warn!("tracer: EPT entry of {page:#x} not changed: {e:?}");
    }
}

fn page_bytes(ram: &dyn GuestDoor, gpa: u64) -> Option<[u8; PAGE_SIZE]> {
    let mut b = [0u8; PAGE_SIZE];
    ram.read(gpa, &mut b).ok().map(|()| b)
}

fn in_hypervisor(gpa: u64) -> bool {
    (loader::layout::HV_RESERVED.0..loader::layout::HV_RESERVED_END.0).contains(&gpa)
}

impl Tracer {
    pub fn new() -> Self {
        Self {
            region: None,
            probes: Vec::new(),
            next_id: 1,
            functions: 0,
            sites: BTreeMap::new(),
            pages: BTreeMap::new(),
            free_shadows: Vec::new(),
            scratch: None,
            ring: EventRing::new(RING_BYTES),
            record: Vec::with_capacity(512),
            stream: None,
            lost_reported: 0,
            pending_line: None,
            step: None,
            stray_tf: false,
            stats: TracerReport::default(),
            sessions: (0..MAX_USERS).map(|_| None).collect(),
            stacks: BTreeMap::new(),
            stack_frames: STACK_FRAMES,
            owners: BTreeMap::new(),
            generations: [0; MAX_USERS],
            retired: Vec::new(),
            last_reap_ns: 0,
            stack_map: StackMap::default(),
            stack_map_ns: None,
        }
    }

    /// The counters for `status`.
    pub fn report(&self) -> TracerReport {
        let mut r = self.stats;
        r.probes = self.probes.len() as u32;
        r.functions = self.functions;
        r.sites = self.sites.len() as u32;
        r.pages = self.pages.len() as u32;
        r.lost = self.ring.lost();
        r.trampolines = self.region.as_ref().map_or(0, |g| g.tramp.base().0);
        r.graph_stacks = self.stacks.len() as u64;
        r.graph_frames = self.stacks.values().map(|s| s.st.depth() as u64).sum();
        r.graph_bytes = self.stacks.values().map(|s| s.st.heap_bytes() as u64).sum();
        r.graph_sessions = self.sessions.iter().flatten().count() as u32;
        r.retprobes = self
            .probes
            .iter()
            .filter(|p| p.spec.kind.is_return())
            .count() as u32;
        r
    }

    // ----- the region -------------------------------------------------

    fn ensure_region(&mut self, k: &dyn KernelView, env: &mut Env<'_>) -> Result<(), ReqError> {
        if self.region.is_some() {
            return Ok(());
        }
        let internal = |m: String| ReqError::new(ErrorKind::Internal, m);
        let cr3 = k.cr3();
        let pml4e = env
            .ram
            .read_word(cr3.pml4().0 + PML4_KERNEL * 8)
            .unwrap_or(0);
        if pml4e & PTE_P == 0 || pml4e & PTE_PS != 0 {
            return Err(internal(format!("unexpected kernel PML4 entry {pml4e:#x}")));
        }
        let pdpt = pml4e & paging::ADDR_MASK;
        let pdpte = env.ram.read_word(pdpt + PDPT_KERNEL_IMAGE * 8).unwrap_or(0);
        if pdpte & PTE_P == 0 || pdpte & PTE_PS != 0 {
            return Err(internal(format!(
                "unexpected kernel-image PDPT entry {pdpte:#x}"
            )));
        }
        let pd = pdpte & paging::ADDR_MASK;
        // The table is the guest's: it must be a page of guest RAM, or we
        // would write our entry into (and map read+execute) whatever page
        // a forged PDPT entry names, hypervisor memory or MMIO included.
        if !env.ram.is_ram(pd, PAGE_SIZE as u64) {
            return Err(internal(format!(
                "the kernel-image page directory at {pd:#x} is not guest RAM"
            )));
        }
        // The highest free 2 MiB slot: above the kernel's image and brk.
        let slot = (0..512u64)
            .rev()
            .find(|i| env.ram.read_word(pd + i * 8).is_ok_and(|e| e & PTE_P == 0))
            .ok_or_else(|| internal("no free slot in the kernel-image mapping".into()))?;
        let base = KERNEL_MAP + slot * (2 << 20);
        let tramp = TrampolineRegion::build(trampolines::Gva(base), HypercallMode::Vmcall)
            .map_err(|e| internal(format!("trampolines: {e:?}")))?;
        let code = env.m.alloc_frame().ok_or_else(|| {
            ReqError::new(
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        let table = env.m.alloc_frame().ok_or_else(|| {
            ReqError::new(
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        env.m.frame(code).copy_from_slice(tramp.bytes());
        // Present, read-only, supervisor, global, executable; A preset so
        // the CPU never needs to write the (EPT read-only) table.
        let pte = code.0 | PTE_P | PTE_A | PTE_G;
        let t = env.m.frame(table);
        t.fill(0);
        t[..8].copy_from_slice(&pte.to_le_bytes());
        let map = |env: &mut Env<'_>, gpa: Hpa, perms| {
            env.m
                .ept_map(Gpa(gpa.0), gpa, perms)
                .map_err(|e| internal(format!("EPT: {e:?}")))
        };
        map(env, code, ept::READ | ept::EXEC)?;
        map(env, table, ept::READ)?;
        env.m.invept();
        let pde = table.0 | PTE_P | PTE_RW | PTE_A;
        let pde_gpa = pd + slot * 8;
        env.ram
            .write_word(pde_gpa, pde)
            .map_err(|e| internal(format!("writing the trampolines' PDE: {e}")))?;
        map(env, Hpa(pd), ept::READ | ept::EXEC)?;
        env.m.invept();
        log::info!(
            "tracer: trampolines at {base:#x} (PD slot {slot}, code frame {:#x}, entry {} bytes)",
            code.0,
            tramp.entry_len()
        );
        self.region = Some(Region {
            tramp,
            pd_page: pd,
            pde_gpa,
            pde,
        });
        Ok(())
    }

    /// Called on every timer turn: keeps the region mapped, and ends steps
    /// that did not finish.
    pub fn on_turn(&mut self, env: &mut Env<'_>) {
        self.check_pde(env);
        if let Some(s) = self.step.as_mut() {
            s.turns += 1;
            if s.turns > STEP_TIMEOUT_TURNS {
                self.end_step(env);
                self.stray_tf = true;
            }
        }
    }

    /// Puts our PDE back if the guest changed it.
    fn check_pde(&mut self, env: &mut Env<'_>) {
        if let Some(r) = &self.region {
            if env.ram.read_word(r.pde_gpa).ok() != Some(r.pde) {
                let _ = env.ram.write_word(r.pde_gpa, r.pde);
                self.stats.region_restores += 1;
                log::warn!("tracer: the guest changed the trampolines' PDE; restored");
            }
        }
    }

    // ----- sites -------------------------------------------------------

    fn alloc_shadow(&mut self, env: &mut Env<'_>) -> Result<Hpa, PatchError> {
        if let Some(f) = self.free_shadows.pop() {
            return Ok(f);
        }
        let left = env.m.frames_free();
        if left < FRAME_RESERVE {
            return Err(PatchError::Perm(
                "hypervisor memory for shadow pages is exhausted",
            ));
        }
        env.m.alloc_frame().ok_or(PatchError::Perm(
            "hypervisor memory for shadow pages is exhausted",
        ))
    }

    /// Hooks the fentry site `site` of function `func` (no-op if hooked).
    fn hook(
        &mut self,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        site: u64,
        func: u64,
        rip: u64,
    ) -> Result<(), PatchError> {
        if self.sites.contains_key(&site) {
            return Ok(());
        }
        // The maps cannot reserve: bound them, and check the heap before
        // anything changes.
        if self.sites.len() >= MAX_SITES {
            return Err(PatchError::Perm("the table of hooked sites is full"));
        }
        if env.m.heap_check(SITE_BYTES).is_err() {
            return Err(PatchError::Perm(
                "out of hypervisor memory for the table of hooked sites",
            ));
        }
        let Some(region) = &self.region else {
            return Err(PatchError::Perm("no trampoline region"));
        };
        if !site::site_fits_page(trampolines::Gva(site)) {
            return Err(PatchError::Perm("the site crosses a page boundary"));
        }
        if site::rip_inside(trampolines::Gva(site), rip) {
            return Err(PatchError::Busy);
        }
        let t = paging::translate(env.ram, k.cr3(), KGva(site)).map_err(|_| PatchError::Fault)?;
        let gpa = t.gpa.0;
        if in_hypervisor(gpa) {
            return Err(PatchError::Perm("the site is not in guest memory"));
        }
        let page = gpa & !(PAGE_SIZE as u64 - 1);
        let offset = (gpa - page) as usize;
        let mut guest = [0u8; SITE_LEN];
        if env.ram.read(gpa, &mut guest).is_err() {
            return Err(PatchError::Fault);
        }
        site::check_guest_site(trampolines::Gva(site), &guest)?;
        let ours = region
            .tramp
            .site_patch(trampolines::Gva(site))
            .map_err(|_| PatchError::Perm("the trampolines are out of reach of a call"))?;
        let new_page = !self.pages.contains_key(&page);
        if new_page {
            let shadow = self.alloc_shadow(env)?;
            let Some(orig) = page_bytes(env.ram, page) else {
                self.free_shadows.push(shadow);
                return Err(PatchError::Fault);
            };
            env.m.frame(shadow).copy_from_slice(&orig);
            self.pages.insert(
                page,
                Hooked {
                    shadow,
                    patches: Vec::new(),
                },
            );
        }
        let Some(h) = self.pages.get_mut(&page) else {
            return Err(PatchError::Fault);
        };
        if fallible::try_grow(&mut h.patches, 1).is_err() {
            if new_page {
                if let Some(h) = self.pages.remove(&page) {
                    self.free_shadows.push(h.shadow);
                }
            }
            return Err(PatchError::Perm(
                "out of hypervisor memory for the page's patches",
            ));
        }
        // The shadow holds the guest's bytes here (copied, or re-synced on
        // the guest's last write): check them, then write ours.
        let shadow = env.m.frame(h.shadow);
        site::write_checked(shadow, offset, &guest, &ours)?;
        h.patches.push(Patch {
            offset: offset as u16,
            site: trampolines::Gva(site),
            ours,
            guest,
        });
        if new_page {
            if let Err(e) = env.m.ept_map(Gpa(page), h.shadow, ept::EXEC) {
                log::warn!("tracer: EPT map of {page:#x} failed: {e:?}");
                // Nothing maps the shadow: give it back with the page.
                if let Some(h) = self.pages.remove(&page) {
                    self.free_shadows.push(h.shadow);
                }
                return Err(PatchError::Perm("EPT tables exhausted"));
            }
        }
        // The caller flushes EPT once for the whole request.
        self.sites.insert(
            site,
            SiteUse {
                page,
                func,
                probes: Vec::new(),
                function: false,
                retprobes: Vec::new(),
                graph: 0,
            },
        );
        Ok(())
    }

    /// Removes our patch from `site` if nothing uses it any more.
    fn unhook_if_unused(&mut self, env: &mut Env<'_>, site: u64) {
        let Some(u) = self.sites.get(&site) else {
            return;
        };
        if !u.unused() {
            return;
        }
        let page = u.page;
        self.sites.remove(&site);
        let Some(h) = self.pages.get_mut(&page) else {
            return;
        };
        if let Some(i) = h.patches.iter().position(|p| p.site.0 == site) {
            let p = h.patches.swap_remove(i);
            let shadow = env.m.frame(h.shadow);
            if let Err(e) = site::write_checked(shadow, p.offset as usize, &p.ours, &p.guest) {
                log::warn!("tracer: unpatching {site:#x}: {e}");
            }
        }
        if h.patches.is_empty() {
            let shadow = h.shadow;
            self.pages.remove(&page);
            remap(env, page, Hpa(page), ept::RWX);
            self.free_shadows.push(shadow);
        }
        // The caller flushes EPT once for the whole request.
    }

    // ----- requests ----------------------------------------------------

    /// `probe add`.
    pub fn probe_add(
        &mut self,
        text: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        rip: u64,
    ) -> Result<(String, u64), ReqError> {
        let mut spec = match kprobe::parse(text) {
            Ok(Command::Add(s)) => s,
            Ok(Command::Delete(_)) => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    "a delete command is not a probe: use probe del",
                ))
            }
            Err(e) => return Err(ReqError::new(ErrorKind::InvalidArgument, e.to_string())),
        };
        if self
            .probes
            .iter()
            .any(|p| p.spec.group == spec.group && p.spec.event == spec.event)
        {
            return Err(ReqError::new(
                ErrorKind::AlreadyExists,
                format!("probe {}/{} already exists", spec.group, spec.event),
            ));
        }
        if self.probes.len() >= MAX_PROBES {
            return Err(ReqError::new(
                ErrorKind::OutOfResources,
                format!("at most {MAX_PROBES} probes; delete one first"),
            ));
        }
        fallible::try_grow(&mut self.probes, 1).map_err(|e| out_of_memory(env, "a probe", e))?;
        let syms = IndexSymbols(k.index());
        spec.resolve_symbols(&syms).map_err(|name| {
            ReqError::new(
                ErrorKind::NotFound,
                format!("symbol {name} is not in the guest's kallsyms"),
            )
        })?;
        let id = k.index().lookup(&spec.symbol).ok_or_else(|| {
            ReqError::new(
                ErrorKind::NotFound,
                format!("function {} is not in the guest's kallsyms", spec.symbol),
            )
        })?;
        let view = PagedView::new(env.ram, k.cr3());
        let fs = Classifier::new(k.index())
            .classify(&view, id)
            .map_err(|e| {
                ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!("{} cannot be probed: {e}", spec.symbol),
                )
            })?;
        self.ensure_region(k, env)?;
        let site = fs.site.0;
        let hooked = self.hook(k, env, site, fs.func.0, rip);
        env.m.invept();
        hooked.map_err(|e| {
            ReqError::new(
                ErrorKind::InvalidArgument,
                format!("cannot hook {} at {site:#x}: {e}", spec.symbol),
            )
        })?;
        let pid = self.next_id;
        let pushed = match self.sites.get_mut(&site) {
            Some(u) if spec.kind.is_return() => {
                fallible::try_push(&mut u.retprobes, u64::from(pid))
            }
            Some(u) => fallible::try_push(&mut u.probes, pid),
            None => Ok(()),
        };
        if let Err(e) = pushed {
            // A site hooked for this probe alone goes again.
            self.unhook_if_unused(env, site);
            env.m.invept();
            return Err(out_of_memory(env, "the probe's site", e));
        }
        self.next_id += 1;
        let name = format!("{}/{}", spec.group, spec.event);
        log::info!("tracer: probe {name} on {} at {site:#x}", spec.symbol);
        self.probes.push(Probe {
            id: pid,
            spec,
            site,
            hits: 0,
            misses: 0,
        });
        Ok((name, site))
    }

    /// `probe del NAME` (`EVENT` or `GROUP/EVENT`).
    pub fn probe_del(&mut self, name: &str, env: &mut Env<'_>) -> Result<(), ReqError> {
        let (group, event) = match name.split_once('/') {
            Some((g, e)) => (Some(g), e),
            None => (None, name),
        };
        let Some(i) = self
            .probes
            .iter()
            .position(|p| p.spec.event == event && group.is_none_or(|g| g == p.spec.group))
        else {
            return Err(ReqError::new(
                ErrorKind::NotFound,
                format!("no probe named {name}"),
            ));
        };
        let p = self.probes.remove(i);
        if let Some(u) = self.sites.get_mut(&p.site) {
            u.probes.retain(|&x| x != p.id);
            u.retprobes.retain(|&x| x != u64::from(p.id));
        }
        self.unhook_if_unused(env, p.site);
        env.m.invept();
        Ok(())
    }

    /// `probe list`.
    pub fn probe_list(&self) -> Vec<ProbeInfo> {
        self.probes
            .iter()
            .map(|p| ProbeInfo {
                name: format!("{}/{}", p.spec.group, p.spec.event),
                spec: p.spec.to_string(),
                symbol: p.spec.symbol.clone(),
                site: p.site,
                hits: p.hits,
                misses: p.misses,
            })
            .collect()
    }

    /// The function tracer on every traceable function matching `glob`.
    /// Returns (traced, first skips, skipped).
    pub fn function_add(
        &mut self,
        glob: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        rip: u64,
    ) -> Result<(u32, Vec<String>, u32), ReqError> {
        self.ensure_region(k, env)?;
        let index = k.index();
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = Classifier::new(index);
        let mut traced = 0u32;
        let mut skipped = Vec::new();
        let mut skipped_total = 0u32;
        let mut seen = alloc::collections::BTreeSet::new();
        let ids = fallible::try_collect(index.glob(glob))
            .map_err(|e| out_of_memory(env, "the list of matching symbols", e))?;
        for id in ids {
            let Ok(fs) = classifier.classify(&view, id) else {
                continue; // not traceable: not a match for the tracer
            };
            if seen.contains(&fs.site.0) {
                continue; // an alias of a function already done
            }
            // The set cannot reserve: past the site table's bound (or the
            // heap's room) the rest could not be hooked anyway.
            if seen.len() >= MAX_SITES || env.m.heap_check(btree_entry_bytes::<u64, ()>()).is_err()
            {
                skipped_total += 1;
                if skipped.len() < 8 {
                    skipped.push(format!(
                        "{}: out of hypervisor memory for the request",
                        index.name(id)
                    ));
                }
                continue;
            }
            seen.insert(fs.site.0);
            match self.hook(k, env, fs.site.0, fs.func.0, rip) {
                Ok(()) => {
                    if let Some(u) = self.sites.get_mut(&fs.site.0) {
                        if !u.function {
                            u.function = true;
                            self.functions += 1;
                        }
                    }
                    traced += 1;
                }
                Err(e) => {
                    skipped_total += 1;
                    if skipped.len() < 8 {
                        skipped.push(format!("{}: {e}", index.name(id)));
                    }
                }
            }
        }
        env.m.invept();
        log::info!("tracer: function tracer on {glob}: {traced} traced, {skipped_total} skipped");
        Ok((traced, skipped, skipped_total))
    }

    /// Removes the function tracer everywhere.
    pub fn function_clear(&mut self, env: &mut Env<'_>) {
        self.release_sites(env, |u| core::mem::take(&mut u.function));
        self.functions = 0;
    }

    /// Takes one user off every site (`release` does it and says whether
    /// the site had that user) and unhooks the sites nothing else uses.
    /// A release never allocates: the sites to unhook are taken a fixed
    /// batch at a time.
    fn release_sites(&mut self, env: &mut Env<'_>, mut release: impl FnMut(&mut SiteUse) -> bool) {
        let mut any = false;
        for u in self.sites.values_mut() {
            any |= release(u);
        }
        if any {
            self.unhook_unused(env);
        }
        env.m.invept();
    }

    /// Unhooks every site nothing uses any more.
    fn unhook_unused(&mut self, env: &mut Env<'_>) {
        let mut from = 0u64;
        loop {
            let mut batch = [0u64; RELEASE_BATCH];
            let mut n = 0;
            let mut next = None;
            for (&s, u) in self.sites.range(from..) {
                if n == RELEASE_BATCH {
                    next = Some(s);
                    break;
                }
                if u.unused() {
                    batch[n] = s;
                    n += 1;
                }
            }
            for &s in &batch[..n] {
                self.unhook_if_unused(env, s);
            }
            match next {
                Some(s) => from = s,
                None => return,
            }
        }
    }

    /// Whether rendered output is waiting (the stream wants busy turns).
    pub fn has_output(&self) -> bool {
        self.stream.is_some() && (!self.ring.is_empty() || self.pending_line.is_some())
    }

    /// `TraceStart` / `TraceStop`.
    pub fn set_stream(&mut self, format: Option<TraceFormat>) {
        if self.stream != format {
            self.pending_line = None;
            self.flush_held();
        }
        self.stream = format;
    }

    /// Retires the text renderers that hold an entry back (the stream is
    /// switching format): the next drain prints those entries as open
    /// calls.
    fn flush_held(&mut self) {
        for (user, g) in self.sessions.iter_mut().enumerate() {
            let Some(g) = g else { continue };
            if g.text.has_pending() {
                let fresh = GraphText::new(g.filter.retval);
                let old = core::mem::replace(&mut g.text, fresh);
                retire(&mut self.retired, (user as u32, RETIRED_GEN, old));
            }
        }
    }

    // ----- the hot path ------------------------------------------------

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
        let Some(region) = &self.region else {
            self.stats.foreign_vmcalls += 1;
            return Hypercall::Foreign;
        };
        let which = if cpu.cpl == 0 {
            region.tramp.hypercall_at(trampolines::Gva(rip))
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
                match self.graph_return(env, regs, cpu, kernel, now_ns) {
                    Some(ret) => {
                        regs.rax = ret;
                        Hypercall::Handled
                    }
                    None => {
                        // No frame: nowhere to return to. The guest (or an
                        // attacker) jumped into the return trampoline.
                        self.stats.graph_orphans += 1;
                        Hypercall::Foreign
                    }
                }
            }
            _ => {
                self.stats.foreign_vmcalls += 1;
                Hypercall::Foreign
            }
        }
    }

    // ----- function graph ---------------------------------------------

    /// `GraphStart`: a new session; hooks its trace set and records its
    /// roots. Returns (session, hooked, roots, skipped).
    pub fn graph_start(
        &mut self,
        filter: GraphFilter,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        rip: u64,
    ) -> Result<GraphStarted, ReqError> {
        let Some(user) = (1..MAX_USERS).find(|&u| self.sessions[u].is_none()) else {
            return Err(ReqError::new(
                ErrorKind::OutOfResources,
                format!(
                    "{} function-graph sessions already run; stop one first",
                    MAX_USERS - 1
                ),
            ));
        };
        let busy = !self.stacks.is_empty() || self.sessions.iter().any(Option::is_some);
        let frames = match filter.stack_frames {
            0 if busy => self.stack_frames,
            0 => STACK_FRAMES,
            n if n > MAX_STACK_FRAMES => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!("at most {MAX_STACK_FRAMES} frames per stack"),
                ))
            }
            n if busy && n != self.stack_frames => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "the return stacks are in use with {} frames each; stop the other sessions and let their calls return first",
                        self.stack_frames
                    ),
                ))
            }
            n => n,
        };
        self.ensure_region(k, env)?;
        self.stack_frames = frames;
        let index = k.index();
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = Classifier::new(index);
        let site_of = |id| classifier.classify(&view, id).ok();
        // Each set is bounded ([`MAX_SITES`]) and checked against the
        // heap's room entry by entry: the globs are the host's, the
        // symbols the guest's.
        let oom = |e| out_of_memory(env, "the function-graph session's sets", e);
        let sites_of = |globs: &[String]| -> Result<BTreeMap<u64, u64>, ReqError> {
            let mut out = BTreeMap::new();
            for g in globs {
                for id in index.glob(g) {
                    if let Some(fs) = site_of(id) {
                        insert_site(env, &mut out, fs.site.0, fs.func.0).map_err(oom)?;
                    }
                }
            }
            Ok(out)
        };
        let notrace = sites_of(&filter.notrace)?;
        let mut graph_notrace = sites_of(&filter.graph_notrace)?;
        graph_notrace.retain(|s, _| !notrace.contains_key(s));
        let mut roots = BTreeSet::new();
        let mut wanted = BTreeMap::new();
        for (site, func) in sites_of(&filter.functions)? {
            if !notrace.contains_key(&site) {
                env.m
                    .heap_check(btree_entry_bytes::<u64, ()>())
                    .map_err(oom)?;
                roots.insert(func);
                insert_site(env, &mut wanted, site, func).map_err(oom)?;
            }
        }
        if !filter.functions.is_empty() && roots.is_empty() {
            return Err(ReqError::new(
                ErrorKind::NotFound,
                format!(
                    "no traceable function matches {}",
                    filter.functions.join(" ")
                ),
            ));
        }
        let every = [String::from("*")];
        let trace: &[String] = if filter.trace.is_empty() {
            &every
        } else {
            &filter.trace
        };
        for (site, func) in sites_of(trace)? {
            if !notrace.contains_key(&site) {
                insert_site(env, &mut wanted, site, func).map_err(oom)?;
            }
        }
        // A set_graph_notrace function is hooked even outside the trace
        // set: its frame is what hides its callees.
        for (&site, &func) in &graph_notrace {
            insert_site(env, &mut wanted, site, func).map_err(oom)?;
        }
        // The session keeps the graph_notrace functions as a set.
        env.m
            .heap_check(
                graph_notrace
                    .len()
                    .saturating_mul(btree_entry_bytes::<u64, ()>()),
            )
            .map_err(oom)?;
        let bit = 1u16 << user;
        let (mut hooked, mut skipped) = (0u32, 0u32);
        for (site, func) in wanted {
            match self.hook(k, env, site, func, rip) {
                Ok(()) => {
                    if let Some(u) = self.sites.get_mut(&site) {
                        u.graph |= bit;
                    }
                    hooked += 1;
                }
                Err(_) => skipped += 1,
            }
        }
        env.m.invept();
        let n_roots = roots.len() as u32;
        log::info!(
            "tracer: graph session {user}: {hooked} functions hooked, {n_roots} roots, {skipped} skipped"
        );
        self.generations[user] = (self.generations[user] + 1) & 0xf;
        self.sessions[user] = Some(GraphSession {
            text: GraphText::new(filter.retval),
            notrace: graph_notrace.into_values().collect(),
            filter,
            roots,
        });
        Ok(GraphStarted {
            session: user as u32,
            hooked,
            roots: n_roots,
            skipped,
        })
    }

    /// `GraphStop`: session `session` (`None`: every session) hijacks no
    /// new calls; frames in flight stay and still return through us.
    pub fn graph_stop(&mut self, session: Option<u32>, env: &mut Env<'_>) -> Result<(), ReqError> {
        let users: Vec<usize> = match session {
            None => (1..MAX_USERS)
                .filter(|&u| self.sessions[u].is_some())
                .collect(),
            Some(n) => {
                let u = n as usize;
                if !(1..MAX_USERS).contains(&u) || self.sessions[u].is_none() {
                    return Err(ReqError::new(
                        ErrorKind::NotFound,
                        format!("no function-graph session {n}"),
                    ));
                }
                alloc::vec![u]
            }
        };
        let mut mask = 0u16;
        for u in users {
            if let Some(g) = self.sessions[u].take() {
                retire(&mut self.retired, (u as u32, self.generations[u], g.text));
            }
            mask |= 1 << u;
        }
        // Frames in flight stay (their returns must pop) but no longer
        // count for the stopped sessions, whose numbers a new session may
        // take.
        for t in self.stacks.values_mut() {
            t.st.clear_users(mask);
        }
        if mask != 0 {
            self.release_sites(env, |s| {
                let had = s.graph & mask != 0;
                s.graph &= !mask;
                had
            });
        }
        Ok(())
    }

    /// The return half of an entry hit: for the sessions and return probes
    /// that want this call, push one shared frame and hijack the return.
    #[allow(clippy::too_many_arguments)]
    fn graph_enter(
        &mut self,
        env: &mut Env<'_>,
        sessions: u16,
        retprobes: &[u64],
        func: u64,
        retp: u64,
        cr3: Cr3,
        now_ns: u64,
        header: EventHeader,
        task: u64,
        k: &dyn KernelView,
    ) {
        let Some(tramp) = self.region.as_ref().map(|r| r.tramp.return_trampoline().0) else {
            return;
        };
        let key = self.stack_map.key(retp);
        // Frames below this call's return slot can never return (on this
        // stack: the key is the stack's own).
        if let Some(t) = self.stacks.get_mut(&key) {
            self.stats.graph_dropped += t.st.reclaim_below(retp) as u64;
            if t.st.is_empty() {
                self.stacks.remove(&key);
            }
        }
        let comm = &header.comm;
        let mut users = 0u16;
        let mut entries: [(u8, u16); MAX_USERS] = [(0, 0); MAX_USERS];
        let mut n_entries = 0;
        // Data blocks: a mark for each session entering one of its
        // graph_notrace functions, then the return probes' ids.
        let mut data: [(u8, &[u64]); MAX_USERS] = [(0, &[]); MAX_USERS];
        let mut n_data = 0;
        let stack = self.stacks.get(&key).map(|t| &t.st);
        for user in 1..MAX_USERS as u8 {
            if sessions & (1 << user) == 0 {
                continue;
            }
            let Some(g) = &self.sessions[usize::from(user)] else {
                continue;
            };
            let (depth, hidden) = stack.map_or((0, false), |s| s.user_view(user, NOTRACE_MARK));
            if hidden {
                continue;
            }
            let f = &g.filter;
            if depth == 0 {
                let root_ok = g.roots.is_empty() || g.roots.contains(&func);
                let pid_ok = f.pid.is_none_or(|p| p == header.pid);
                let comm_ok = f.comm.as_deref().is_none_or(|c| {
                    let n = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
                    c.as_bytes() == &comm[..n]
                });
                if !(root_ok && pid_ok && comm_ok) {
                    continue;
                }
            }
            if f.max_depth != 0 && depth >= f.max_depth as usize {
                continue;
            }
            users |= 1 << user;
            if g.notrace.contains(&func) {
                data[n_data] = (user, core::slice::from_ref(&NOTRACE_MARK));
                n_data += 1;
            } else {
                entries[n_entries] = (user, depth as u16);
                n_entries += 1;
            }
        }
        if !retprobes.is_empty() {
            users |= 1 << RETPROBE_USER;
            data[n_data] = (RETPROBE_USER, retprobes);
            n_data += 1;
        }
        if users == 0 {
            return;
        }
        let stack_bytes = self.stack_frames as usize * FRAME_TAGGED * 8;
        let max_stacks = (STACK_BUDGET / stack_bytes.max(1)).min(MAX_STACKS);
        if !self.stacks.contains_key(&key)
            && (self.stacks.len() >= max_stacks || env.m.heap_check(STACK_ENTRY_BYTES).is_err())
        {
            self.stats.graph_misses += 1;
            self.retprobes_missed(retprobes);
            return;
        }
        let mut slot = [0u8; 8];
        let Ok(t) = paging::translate(env.ram, cr3, KGva(retp)) else {
            return;
        };
        if !retp.is_multiple_of(8)
            || in_hypervisor(t.gpa.0)
            || env.ram.read(t.gpa.0, &mut slot).is_err()
        {
            return;
        }
        let ret = u64::from_le_bytes(slot);
        let tracked = self.stacks.entry(key).or_insert_with(|| Tracked {
            st: RetStack::new(self.stack_frames as usize * FRAME_TAGGED),
            task: 0,
            pid: 0,
            own: false,
        });
        if tracked.task != task || tracked.pid != header.pid {
            // A new owner (or a first one): is this its own stack?
            tracked.own = match self.owners.get(&key) {
                Some(&(t0, p0, own)) if (t0, p0) == (task, header.pid) => own,
                _ => {
                    let own = k.task_stack(task) == Some(key);
                    if self.owners.len() >= 2 * MAX_STACKS {
                        self.owners.clear();
                    }
                    self.owners.insert(key, (task, header.pid, own));
                    own
                }
            };
            tracked.task = task;
            tracked.pid = header.pid;
        }
        // A frame at this very slot is the caller of a tail call: the callee
        // stacks on it. (The slot may hold our trampoline, or the return
        // handler of the guest's own function_graph, which hijacks after
        // us; so the slot's value cannot tell a dead frame from a live one.
        // A dead frame at the same slot pops harmlessly below the new one, or
        // goes with the next call from a higher slot.)
        if ret == tramp && tracked.st.top_retp() != Some(retp) {
            // Our trampoline in a slot we have no frame for: never stack on it.
            if tracked.st.is_empty() {
                self.stacks.remove(&key);
            }
            return;
        }
        let pushed = tracked
            .st
            .push(ret, func, now_ns, retp, users, &data[..n_data]);
        let empty = tracked.st.is_empty();
        match pushed {
            Ok(_) => {}
            Err(e) => {
                if e == PushError::Full {
                    self.stats.graph_misses += 1;
                }
                if empty {
                    self.stacks.remove(&key);
                }
                self.retprobes_missed(retprobes);
                return;
            }
        }
        if env.ram.write_word(t.gpa.0, tramp).is_err() {
            return;
        }
        for &(user, depth) in &entries[..n_entries] {
            let h = EventHeader {
                probe_id: GraphEventId {
                    kind: GraphKind::Entry,
                    number: user,
                    generation: self.generations[usize::from(user)],
                }
                .pack(),
                ip: func,
                ret_ip: ret,
                ..header
            };
            let values = [kprobe::FetchedValue::Int {
                ty: kprobe::IntType::U64,
                value: u64::from(depth),
            }];
            store_parts(&mut self.ring, &mut self.record, &h, &values);
        }
    }

    /// Counts a missed hit on each return probe of a call that could not
    /// be hijacked (kretprobe's nmissed).
    fn retprobes_missed(&mut self, ids: &[u64]) {
        for p in self
            .probes
            .iter_mut()
            .filter(|p| ids.contains(&u64::from(p.id)))
        {
            p.misses += 1;
        }
    }

    /// A return through the trampoline: the original return address.
    fn graph_return(
        &mut self,
        env: &mut Env<'_>,
        regs: &GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Option<u64> {
        let retp = regs
            .rdi
            .checked_add(trampolines::abi::RETURN_FRAME_RETP as u64)?;
        let retval = regs.rsi;
        let mut key = self.stack_map.key(retp);
        if self
            .stacks
            .get(&key)
            .is_none_or(|t| t.st.top_retp() != Some(retp))
        {
            // The map changed since the entry (a CPU came up, or the guest
            // moved a per-CPU stack pointer): find the frame where it was
            // pushed, rather than leave the call with nowhere to return.
            if let Some((&k, _)) = self
                .stacks
                .iter()
                .find(|(_, t)| t.st.top_retp() == Some(retp))
            {
                key = k;
            }
        }
        let t = self.stacks.get_mut(&key)?;
        let PopResult::Found { frame, dropped } = t.st.pop(retp) else {
            return None;
        };
        self.stats.graph_dropped += dropped as u64;
        // Each session's depth of the frame: its frames left below it.
        let mut depths = [0usize; MAX_USERS];
        for (user, d) in depths.iter_mut().enumerate().skip(1) {
            if frame.users & (1 << user) != 0 {
                *d = t.st.user_view(user as u8, NOTRACE_MARK).0;
            }
        }
        // A tail-called function's frame holds our trampoline as its
        // return address; its real caller is in the frame below, at the
        // same slot.
        let tramp = self.region.as_ref().map(|r| r.tramp.return_trampoline().0);
        let caller = match t.st.frames().next() {
            Some(below) if Some(frame.ret) == tramp && below.retp == retp => below.ret,
            _ => frame.ret,
        };
        if t.st.is_empty() {
            self.stacks.remove(&key);
        }
        let Running { pid, comm, .. } = kernel
            .and_then(|k| k.current(cpu))
            .unwrap_or(Running::UNKNOWN);
        let header = EventHeader {
            probe_id: 0,
            cpu: 0,
            pid,
            timestamp_ns: now_ns,
            ip: frame.func,
            ret_ip: frame.ret,
            comm,
        };
        for (user, &depth) in depths.iter().enumerate().skip(1) {
            if frame.users & (1 << user) == 0 || self.sessions[user].is_none() {
                continue;
            }
            let marked = frame
                .data
                .iter()
                .any(|(u, d)| usize::from(*u) == user && d.first() == Some(&NOTRACE_MARK));
            if marked {
                continue;
            }
            let h = EventHeader {
                probe_id: GraphEventId {
                    kind: GraphKind::Return,
                    number: user as u8,
                    generation: self.generations[user],
                }
                .pack(),
                ..header
            };
            let values = [
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: depth as u64,
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: now_ns.saturating_sub(frame.calltime),
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::X64,
                    value: retval,
                },
            ];
            store_parts(&mut self.ring, &mut self.record, &h, &values);
        }
        let ids = frame
            .data
            .iter()
            .find(|(u, _)| *u == RETPROBE_USER)
            .map(|(_, d)| d.as_slice())
            .unwrap_or(&[]);
        if let (false, Some(k)) = (ids.is_empty(), kernel) {
            self.retprobe_hits(env, ids, regs, retp, caller, header, cpu, k);
        }
        Some(frame.ret)
    }

    /// Records the return probes `ids` of a returning call: their fetch
    /// arguments see the registers at the return, as a kretprobe's do (`ip`
    /// the original return address, `sp` just above the return slot).
    #[allow(clippy::too_many_arguments)]
    fn retprobe_hits(
        &mut self,
        env: &mut Env<'_>,
        ids: &[u64],
        g: &GuestRegs,
        retp: u64,
        caller: u64,
        mut header: EventHeader,
        cpu: &CpuView,
        k: &dyn KernelView,
    ) {
        header.ret_ip = caller;
        let regs = PtRegs {
            r15: g.r15,
            r14: g.r14,
            r13: g.r13,
            r12: g.r12,
            bp: g.rbp,
            bx: g.rbx,
            r11: g.r11,
            r10: g.r10,
            r9: g.r9,
            r8: g.r8,
            ax: g.rsi,
            cx: g.rcx,
            dx: g.rdx,
            si: g.rsi,
            di: g.rdi,
            orig_ax: u64::MAX,
            ip: caller,
            cs: 0x10,
            flags: 0,
            sp: retp.wrapping_add(8),
            ss: 0x18,
        };
        let syms = IndexSymbols(k.index());
        let mut mem = VcpuMem {
            ram: env.ram,
            cr3: Cr3(cpu.cr3),
        };
        let ctx = FetchContext {
            regs: &regs,
            comm: Some(&header.comm),
            layout: GuestLayout::X86_64_4LEVEL,
        };
        // Ids of probes deleted while the call was in flight find nothing.
        let ids = ids.iter().filter_map(|&i| u32::try_from(i).ok());
        let mut out = HitSink {
            probes: &mut self.probes,
            ring: &mut self.ring,
            record: &mut self.record,
        };
        out.hits(ids, header, &ctx, &mut mem, &syms);
    }

    /// Drops the return stacks of tasks that died: a task that exits
    /// inside traced functions (`do_exit` never returns) leaves frames
    /// that no return will pop. A task's own kernel stack is released once
    /// its `task_struct.stack` no longer points at it: the kernel clears
    /// it when it frees a dead task's stack (and a reused `task_struct`
    /// points at its new task's stack). A live task's stack pointer never
    /// changes, even when its pid does (a thread that execs takes the
    /// leader's pid). Borrowed (IRQ) stacks and the running task's stack
    /// are never touched here; their dead frames go when a later call or
    /// return on the same stack passes them. Runs every REAP_EVERY_NS.
    pub fn reap(&mut self, kernel: Option<&dyn KernelView>, cpu: &CpuView, now_ns: u64) {
        let Some(k) = kernel else {
            return;
        };
        if self.stacks.is_empty() || now_ns.saturating_sub(self.last_reap_ns) < REAP_EVERY_NS {
            return;
        }
        self.last_reap_ns = now_ns;
        let running = k.current(cpu).map(|c| c.task);
        let dead: Vec<u64> = self
            .stacks
            .iter()
            .filter(|(&base, t)| {
                t.own && Some(t.task) != running && k.task_stack(t.task).is_some_and(|s| s != base)
            })
            .map(|(&base, _)| base)
            .collect();
        for base in dead {
            if let Some(t) = self.stacks.remove(&base) {
                self.stats.graph_reaped += t.st.depth() as u64;
            }
            self.owners.remove(&base);
        }
    }

    /// Reads the guest's stacks again when the map is older than
    /// [`STACK_MAP_EVERY_NS`]; logs it when it changes (recovery logs the
    /// first).
    fn refresh_stack_map(&mut self, k: &dyn KernelView, cpu: &CpuView, now_ns: u64) {
        if self
            .stack_map_ns
            .is_some_and(|t| now_ns.saturating_sub(t) < STACK_MAP_EVERY_NS)
        {
            return;
        }
        let map = k.stack_map(cpu);
        if self.stack_map_ns.is_some() && map != self.stack_map {
            k.log_stacks(&map);
        }
        self.stack_map = map;
        self.stack_map_ns = Some(now_ns);
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
        let Some(u) = self.sites.get(&site).filter(|_| regs_gva == cpu.rsp) else {
            self.stats.forged_entries += 1;
            // A call that was in flight when its site was unhooked is
            // refused too: it continues as the site's own bytes say (the
            // guest's `call` there, if it has one).
            return site_call_target(env.ram, Cr3(cpu.cr3), site);
        };
        let chain = self
            .pages
            .get(&u.page)
            .and_then(|h| h.patches.iter().find(|p| p.site.0 == site))
            .map_or(0, Patch::chain_target);
        let cr3 = Cr3(cpu.cr3);
        let mut image = [0u8; trampolines::ptregs::PT_REGS_SIZE];
        if paging::read_virt(env.ram, cr3, KGva(regs_gva), &mut image).is_err() {
            self.ring.count_lost();
            return chain;
        }
        let regs = PtRegs::from_le_bytes(&image);
        if regs.ip != site.wrapping_add(5) {
            // The trampoline stores the site call's own return address as
            // ip: anything else did not come from a call at this site.
            self.stats.forged_entries += 1;
            return chain;
        }
        self.stats.hits += 1;
        let Running { task, pid, comm } = k.current(cpu).unwrap_or(Running::UNKNOWN);
        let mut header = EventHeader {
            probe_id: 0,
            cpu: 0,
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
        let func = u.func;
        let has_retprobes = !u.retprobes.is_empty();
        let mut out = HitSink {
            probes: &mut self.probes,
            ring: &mut self.ring,
            record: &mut self.record,
        };
        out.hits(u.probes.iter().copied(), header, &ctx, &mut mem, &syms);
        if function {
            let mut ret = [0u8; 8];
            let parent = paging::read_virt(env.ram, cr3, KGva(regs.sp), &mut ret)
                .map_or(0, |()| u64::from_le_bytes(ret));
            header.probe_id = FUNCTION_ID;
            header.ip = func;
            header.ret_ip = parent;
            let ev = RawEvent {
                header,
                values: Vec::new(),
            };
            store(&mut self.ring, &mut self.record, &ev);
        }
        if graph != 0 || has_retprobes {
            self.refresh_stack_map(k, cpu, now_ns);
            // The ids are lent out of the site for the call (no copy).
            let retprobes = if has_retprobes {
                self.sites
                    .get_mut(&site)
                    .map(|u| core::mem::take(&mut u.retprobes))
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            self.graph_enter(
                env, graph, &retprobes, func, regs.sp, cr3, now_ns, header, task, k,
            );
            if let Some(u) = self.sites.get_mut(&site).filter(|_| has_retprobes) {
                u.retprobes = retprobes;
            }
        }
        chain
    }

    // ----- the stream --------------------------------------------------

    /// The stream's next `TraceText`, when there is output and the
    /// control channel's output queue has `room` bytes free: the exit loop
    /// sends it, and asks again while it has room. One `TraceText` carries
    /// lines of one source (0: probes and the function tracer; N: graph
    /// session N).
    pub fn next_text(
        &mut self,
        room: usize,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Option<protocol::Event> {
        let format = self.stream?;
        let k = kernel?;
        let syms = IndexSymbols(k.index());
        {
            if room < TX_HEADROOM + protocol::MAX_WIRE_FRAME {
                return None;
            }
            let (mut source, mut text) = self.pending_line.take().unwrap_or_default();
            while text.len() < TRACE_TEXT_BUDGET {
                if !self.ring.pop(&mut self.record) {
                    // The ring is empty: retired renderers print what they
                    // hold back and go. An entry held back for a leaf is
                    // printed open once it is older than LEAF_HOLD_NS (its
                    // call is long, or sleeps); counting time, not turns,
                    // because another session's events may have kept the
                    // ring busy while this one's children are not traced.
                    if text.is_empty() {
                        while let Some((user, _, mut t)) = self.retired.pop() {
                            if t.has_pending() {
                                t.flush(&mut text, &syms);
                                source = user;
                                break;
                            }
                        }
                    }
                    if text.is_empty() && format == TraceFormat::Text {
                        for (user, g) in self.sessions.iter_mut().enumerate() {
                            let Some(g) = g else { continue };
                            let old = g
                                .text
                                .pending_since()
                                .is_some_and(|t| now_ns.saturating_sub(t) > LEAF_HOLD_NS);
                            if old {
                                g.text.flush(&mut text, &syms);
                                source = user as u32;
                                break;
                            }
                        }
                    }
                    break;
                }
                let mut line = String::new();
                let src = self.render(&mut line, format, &syms);
                if line.is_empty() {
                    continue;
                }
                cut_line(&mut line, TRACE_TEXT_BUDGET);
                if !line.ends_with('\n') {
                    line.push('\n');
                }
                if text.is_empty() {
                    source = src;
                }
                if !text.is_empty()
                    && (src != source || text.len() + line.len() > TRACE_TEXT_BUDGET)
                {
                    self.pending_line = Some((src, line));
                    break;
                }
                text.push_str(&line);
            }
            let lost = self.ring.lost() - self.lost_reported;
            if text.is_empty() && lost == 0 {
                return None;
            }
            self.lost_reported = self.ring.lost();
            Some(protocol::Event::TraceText {
                format,
                source,
                lost,
                text,
            })
        }
    }

    /// Renders the record in `self.record`; returns its source.
    fn render(&mut self, out: &mut String, format: TraceFormat, syms: &IndexSymbols<'_>) -> u32 {
        let Ok((ev, _)) = RawEvent::decode(&self.record) else {
            let _ = write!(out, "(undecodable record of {} bytes)", self.record.len());
            return 0;
        };
        let id = ev.header.probe_id;
        if let Some(GraphEventId {
            kind,
            number,
            generation: gen,
        }) = GraphEventId::unpack(id)
        {
            let user = usize::from(number);
            if format == TraceFormat::Json {
                graph_fmt::write_graph_json(out, kind, &ev, user as u32, syms);
                return user as u32;
            }
            let live = self.generations.get(user) == Some(&gen);
            let text = match self.sessions.get_mut(user).and_then(Option::as_mut) {
                Some(g) if live => Some(&mut g.text),
                _ => self
                    .retired
                    .iter_mut()
                    .find(|(u, g, _)| *u as usize == user && *g == gen)
                    .map(|(_, _, t)| t),
            };
            // No renderer: a session stopped long ago; nothing to print.
            if let Some(t) = text {
                t.push(out, kind, &ev, syms);
            }
            return user as u32;
        }
        if id == FUNCTION_ID {
            match format {
                TraceFormat::Json => kprobe::write_function_json(out, &ev, syms),
                _ => kprobe::write_function_text(out, &ev, syms),
            }
            return 0;
        }
        // A probe deleted since the hit is no longer printable: skip it.
        let Some(p) = self.probes.iter().find(|p| p.id == id) else {
            return 0;
        };
        match format {
            TraceFormat::Json => kprobe::write_json(out, &p.spec, &ev, syms),
            _ => kprobe::write_text(out, &p.spec, &ev, syms),
        }
        0
    }

    // ----- the split view's single step --------------------------------

    /// An EPT violation at `gpa`: a hooked page or hypervisor memory gets a
    /// single step; anything else is not the tracer's.
    pub fn on_violation(&mut self, gpa: u64, write: bool, env: &mut Env<'_>) -> Violation {
        let page = gpa & !(PAGE_SIZE as u64 - 1);
        let widen = match self.step.as_ref() {
            // The instruction being stepped touched another page (or the
            // same page again for another kind of access): open it too.
            Some(s) if s.open < STEP_PAGES => true,
            Some(_) => {
                // More pages than one instruction can touch: start over.
                self.end_step(env);
                false
            }
            None => false,
        };
        if widen
            && self
                .step
                .as_ref()
                .is_some_and(|s| s.pages().iter().any(|&(p, _)| p == page))
        {
            // Already open (a write after a read on a hooked page that is
            // now identity mapped RWX cannot fault again; a hypervisor page
            // mapped to scratch can only if the access kind differs).
            return Violation::Widened;
        }
        let watched = self.region.as_ref().is_some_and(|r| r.pd_page == page);
        let kind = if watched {
            remap(env, page, Hpa(page), ept::RWX);
            StepKind::Watch
        } else if self.pages.contains_key(&page) {
            remap(env, page, Hpa(page), ept::RWX);
            StepKind::Hooked { write }
        } else if in_hypervisor(page) {
            let scratch = match self.scratch {
                Some(s) => s,
                None => match env.m.alloc_frame() {
                    Some(s) => {
                        self.scratch = Some(s);
                        s
                    }
                    None => return Violation::NotOurs,
                },
            };
            env.m.frame(scratch).fill(0xcc);
            let restore = match env.m.ept_map(Gpa(page), scratch, ept::READ | ept::WRITE) {
                Ok(old) => old,
                Err(_) => return Violation::NotOurs,
            };
            self.stats.blocked_writes += u64::from(write);
            StepKind::Discard { restore }
        } else {
            return Violation::NotOurs;
        };
        env.m.invept();
        if widen {
            if let Some(s) = self.step.as_mut() {
                s.pages[s.open] = (page, kind);
                s.open += 1;
                self.stats.steps_widened += 1;
                return Violation::Widened;
            }
        }
        self.stats.steps += 1;
        let mut pages = [(0u64, StepKind::Watch); STEP_PAGES];
        pages[0] = (page, kind);
        self.step = Some(Step {
            pages,
            open: 1,
            old_tf: false,
            turns: 0,
        });
        Violation::Stepping
    }

    /// Records the guest's TF before the step set it. A TF left behind by
    /// a step of ours that ended without its #DB is not the guest's.
    pub fn set_old_tf(&mut self, tf: bool) {
        let stray = core::mem::take(&mut self.stray_tf);
        if let Some(s) = self.step.as_mut() {
            s.old_tf = tf && !stray;
        }
    }

    /// For a #DB: whether a step is in flight, the guest's own TF when it
    /// began, and whether a TF of ours may be left in RFLAGS.
    pub fn debug_state(&self) -> (bool, bool, bool) {
        (
            self.step.is_some(),
            self.step.as_ref().is_some_and(|s| s.old_tf),
            self.stray_tf,
        )
    }

    /// Ends the step in flight (its #DB arrived).
    pub fn finish_step(&mut self, env: &mut Env<'_>) {
        self.end_step(env);
    }

    /// Root's leftover TF has trapped and is cleared.
    pub fn clear_stray_tf(&mut self) {
        self.stray_tf = false;
    }

    /// Whether #DB must stay intercepted.
    pub fn wants_debug_exits(&self) -> bool {
        self.step.is_some() || self.stray_tf
    }

    fn end_step(&mut self, env: &mut Env<'_>) {
        let Some(s) = self.step.take() else {
            return;
        };
        for &(page, kind) in s.pages() {
            self.close_page(page, kind, env);
        }
        env.m.invept();
    }

    /// Puts one page of a finished step back to its watched mapping.
    fn close_page(&mut self, page: u64, kind: StepKind, env: &mut Env<'_>) {
        match kind {
            StepKind::Hooked { write } => {
                if let Some(h) = self.pages.get_mut(&page) {
                    if write {
                        self.stats.guest_writes += 1;
                        if let Some(orig) = page_bytes(env.ram, page) {
                            let shadow = env.m.frame(h.shadow);
                            site::resync(shadow, &orig, &mut h.patches);
                        }
                    }
                    remap(env, page, h.shadow, ept::EXEC);
                } else {
                    // Unhooked meanwhile: the identity mapping stays.
                }
            }
            StepKind::Watch => {
                self.check_pde(env);
                remap(env, page, Hpa(page), ept::READ | ept::EXEC);
            }
            StepKind::Discard { restore } => {
                if restore & ept::RWX == 0 {
                    let _ = env.m.ept_unmap(Gpa(page));
                } else {
                    let _ = env.m.ept_map(
                        Gpa(page),
                        Hpa(restore & paging::ADDR_MASK),
                        restore & ept::RWX,
                    );
                }
            }
        }
    }
}

/// Encodes `ev` into the ring.
fn store(ring: &mut EventRing, scratch: &mut Vec<u8>, ev: &RawEvent) -> bool {
    store_parts(ring, scratch, &ev.header, &ev.values)
}

/// [`store`] of an event given by parts (no `RawEvent`, no allocation).
fn store_parts(
    ring: &mut EventRing,
    scratch: &mut Vec<u8>,
    header: &EventHeader,
    values: &[kprobe::FetchedValue],
) -> bool {
    scratch.clear();
    scratch.resize(kprobe::encoded_len(values), 0);
    match kprobe::encode_parts(header, values, scratch) {
        Some(n) => ring.push(&scratch[..n]),
        None => {
            ring.count_lost();
            false
        }
    }
}

/// Where probe hits go: the probes (for their counters) and the ring.
struct HitSink<'a> {
    probes: &'a mut Vec<Probe>,
    ring: &'a mut EventRing,
    record: &'a mut Vec<u8>,
}

impl HitSink<'_> {
    /// Records a hit of each probe in `ids` (entry or return), its
    /// arguments fetched in `ctx`; a probe no longer defined is skipped.
    fn hits(
        &mut self,
        ids: impl Iterator<Item = u32>,
        mut header: EventHeader,
        ctx: &FetchContext<'_>,
        mem: &mut VcpuMem<'_>,
        syms: &IndexSymbols<'_>,
    ) {
        for id in ids {
            let Some(p) = self.probes.iter_mut().find(|p| p.id == id) else {
                continue;
            };
            header.probe_id = id;
            let ev = RawEvent {
                header,
                values: kprobe::fetch(&p.spec.args, ctx, mem, syms),
            };
            if store(self.ring, self.record, &ev) {
                p.hits += 1;
            } else {
                p.misses += 1;
            }
        }
    }
}

/// Cuts an over-long line at a character boundary.
fn cut_line(line: &mut String, max: usize) {
    if line.len() > max {
        let mut end = max;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
}

/// The guest-virtual target of a `call rel32` at `site` in the guest's own
/// bytes (its frame, not our shadow), or 0: not a call, or unreadable.
fn site_call_target(ram: &dyn GuestDoor, cr3: Cr3, site: u64) -> u64 {
    let mut b = [0u8; 5];
    if paging::read_virt(ram, cr3, KGva(site), &mut b).is_err() || b[0] != 0xe8 {
        return 0;
    }
    let rel = i32::from_le_bytes([b[1], b[2], b[3], b[4]]);
    site.wrapping_add(5).wrapping_add(rel as i64 as u64)
}
