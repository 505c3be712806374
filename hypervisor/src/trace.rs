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

use crate::arch::instructions as insn;
use crate::frames::{self, PoolTables};
use crate::introspect::{CpuView, GuestRam, Kernel};
use crate::phys;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;
use guest_introspect::addr::Gva as KGva;
use guest_introspect::fentry::Classifier;
use guest_introspect::paging::{self, Cr3};
use guest_introspect::view::PagedView;
use hypervisor::addr::{Gpa, Hpa};
use hypervisor::ept::{self, Ept, MemType};
use hypervisor::kprobe::{
    self, Command, EventHeader, FetchContext, GuestLayout, GuestMem, IndexSymbols, MemFault,
    ProbeSpec, RawEvent,
};
use hypervisor::tracer::graph::{self as graph_fmt, GraphKind, GraphText};
use hypervisor::tracer::retstack::{PopResult, PushError, RetStack};
use hypervisor::tracer::ring::EventRing;
use hypervisor::tracer::site::{self, Patch, PatchError, PAGE_SIZE};
use protocol::{ErrorKind, GraphFilter, ProbeInfo, TraceFormat, TracerReport};
use trampolines::patch::SITE_LEN;
use trampolines::{HypercallMode, PtRegs, TrampolineRegion};

/// Bytes of the vCPU's event ring.
const RING_BYTES: usize = 2 << 20;
/// The probe id of function-tracer events (probes count from 1).
const FUNCTION_ID: u32 = 0;
/// Probe ids of function-graph entry and return events.
const GRAPH_ENTRY_ID: u32 = u32::MAX;
const GRAPH_RETURN_ID: u32 = u32::MAX - 1;
/// The guest's kernel stack size and alignment (`THREAD_SIZE`, x86-64 with
/// 4-level paging and no KASAN): return stacks are kept per kernel stack.
const THREAD_SIZE: u64 = 16 * 1024;
/// Words per return stack: 32 frames without data (5 words each), 1280 B.
const RETSTACK_WORDS: usize = 32 * (hypervisor::tracer::retstack::FRAME_WORDS + 1);
/// Kernel stacks tracked at most; calls on more are not hijacked (misses).
const MAX_STACKS: usize = 4096;
/// Frames kept free for everything else when shadows are allocated.
const FRAME_RESERVE: u64 = 1 << 20;
/// A step not finished after this many timer turns is ended by force (the
/// stepped context was preempted; its stale TF is swallowed later).
const STEP_TIMEOUT_TURNS: u32 = 4;
/// Text per `TraceText` event, so that a frame stays under `MAX_FRAME`.
const TRACE_TEXT_BUDGET: usize = 2800;
/// Output queue the drain leaves for responses.
const TX_HEADROOM: usize = 8 * 1024;

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
/// Pending debug exceptions / exit qualification: single step (BS).
const DBG_BS: u64 = 1 << 14;

/// A request error for the control channel.
pub type ReqError = (ErrorKind, String);

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
    function: bool,
    /// Hooked for the function-graph tracer.
    graph: bool,
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

struct Step {
    page: u64,
    kind: StepKind,
    old_tf: bool,
    turns: u32,
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
    pending_line: Option<String>,
    step: Option<Step>,
    /// A forced step end left TF in some saved guest context.
    stray_tf: bool,
    pub stats: TracerReport,
    /// The function-graph tracer's filter, while it runs.
    graph: Option<GraphState>,
    /// Return stacks by guest kernel stack base. They outlive the graph
    /// tracer while calls are in flight.
    stacks: BTreeMap<u64, RetStack>,
    /// The function_graph text renderer (it holds one entry back).
    graph_text: GraphText,
    /// Drain turns the held entry has waited with nothing behind it.
    graph_idle_turns: u32,
}

/// The function-graph tracer's settings, resolved to addresses.
struct GraphState {
    filter: GraphFilter,
    /// Functions that start a tree (empty: every graph-hooked function).
    roots: BTreeSet<u64>,
}

impl Default for Tracer {
    fn default() -> Self {
        Self::new()
    }
}

/// Guest-virtual memory through the vCPU's page tables.
struct VcpuMem {
    cr3: Cr3,
}

impl GuestMem for VcpuMem {
    fn read(&mut self, gva: KGva, buf: &mut [u8]) -> Result<(), MemFault> {
        paging::read_virt(&GuestRam, self.cr3, gva, buf).map_err(|_| MemFault)
    }
}

/// Points the EPT entry of guest page `page` at `hpa` with `perms`. A
/// failure (EPT tables exhausted) leaves the old entry, which is safe: the
/// page keeps its previous view.
fn remap(ept: &Ept, page: u64, hpa: Hpa, perms: u64) {
    if let Err(e) = ept.map_page(&mut PoolTables, Gpa(page), hpa, perms, MemType::WriteBack) {
        log::warn!("tracer: EPT entry of {page:#x} not changed: {e:?}");
    }
}

fn invept(ept: &Ept) {
    if insn::invept_single(ept.eptp()).is_err() {
        log::warn!("INVEPT failed");
    }
}

fn page_bytes(gpa: u64) -> Option<[u8; PAGE_SIZE]> {
    let mut b = [0u8; PAGE_SIZE];
    phys::read(gpa, &mut b).then_some(b)
}

fn read_u64_phys(gpa: u64) -> Option<u64> {
    let mut b = [0u8; 8];
    phys::read(gpa, &mut b).then(|| u64::from_le_bytes(b))
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
            graph: None,
            stacks: BTreeMap::new(),
            graph_text: GraphText::new(false),
            graph_idle_turns: 0,
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
        r.graph_frames = self.stacks.values().map(|s| s.depth() as u64).sum();
        r.graph_bytes = self.stacks.values().map(|s| s.heap_bytes() as u64).sum();
        r
    }

    // ----- the region -------------------------------------------------

    fn ensure_region(&mut self, k: &Kernel, ept: &Ept) -> Result<(), ReqError> {
        if self.region.is_some() {
            return Ok(());
        }
        let internal = |m: String| (ErrorKind::Internal, m);
        let cr3 = k.cr3();
        let pml4e = read_u64_phys(cr3.pml4().0 + PML4_KERNEL * 8).unwrap_or(0);
        if pml4e & PTE_P == 0 || pml4e & PTE_PS != 0 {
            return Err(internal(format!("unexpected kernel PML4 entry {pml4e:#x}")));
        }
        let pdpt = pml4e & paging::ADDR_MASK;
        let pdpte = read_u64_phys(pdpt + PDPT_KERNEL_IMAGE * 8).unwrap_or(0);
        if pdpte & PTE_P == 0 || pdpte & PTE_PS != 0 {
            return Err(internal(format!(
                "unexpected kernel-image PDPT entry {pdpte:#x}"
            )));
        }
        let pd = pdpte & paging::ADDR_MASK;
        // The highest free 2 MiB slot: above the kernel's image and brk.
        let slot = (0..512u64)
            .rev()
            .find(|i| read_u64_phys(pd + i * 8).is_some_and(|e| e & PTE_P == 0))
            .ok_or_else(|| internal("no free slot in the kernel-image mapping".into()))?;
        let base = KERNEL_MAP + slot * (2 << 20);
        let tramp = TrampolineRegion::build(trampolines::Gva(base), HypercallMode::Vmcall)
            .map_err(|e| internal(format!("trampolines: {e:?}")))?;
        let code = frames::alloc().ok_or_else(|| {
            (
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        let table = frames::alloc().ok_or_else(|| {
            (
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        phys::frame_bytes_mut(code).copy_from_slice(tramp.bytes());
        // Present, read-only, supervisor, global, executable; A preset so the
        // CPU never needs to write the (EPT read-only) table.
        phys::frame_mut(table)[0] = code.0 | PTE_P | PTE_A | PTE_G;
        let map = |gpa: Hpa, perms| {
            ept.map_page(&mut PoolTables, Gpa(gpa.0), gpa, perms, MemType::WriteBack)
                .map_err(|e| internal(format!("EPT: {e:?}")))
        };
        map(code, ept::READ | ept::EXEC)?;
        map(table, ept::READ)?;
        invept(ept);
        let pde = table.0 | PTE_P | PTE_RW | PTE_A;
        let pde_gpa = pd + slot * 8;
        phys::write(pde_gpa, &pde.to_le_bytes());
        map(Hpa(pd), ept::READ | ept::EXEC)?;
        invept(ept);
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
    pub fn on_turn(&mut self, ept: &Ept) {
        self.check_pde();
        if let Some(s) = self.step.as_mut() {
            s.turns += 1;
            if s.turns > STEP_TIMEOUT_TURNS {
                self.end_step(ept);
                self.stray_tf = true;
            }
        }
    }

    /// Puts our PDE back if the guest changed it.
    fn check_pde(&mut self) {
        if let Some(r) = &self.region {
            if read_u64_phys(r.pde_gpa) != Some(r.pde) {
                phys::write(r.pde_gpa, &r.pde.to_le_bytes());
                self.stats.region_restores += 1;
                log::warn!("tracer: the guest changed the trampolines' PDE; restored");
            }
        }
    }

    // ----- sites -------------------------------------------------------

    fn alloc_shadow(&mut self) -> Result<Hpa, PatchError> {
        if let Some(f) = self.free_shadows.pop() {
            return Ok(f);
        }
        let left = loader::layout::HV_RESERVED_SIZE.saturating_sub(frames::used());
        if left < FRAME_RESERVE {
            return Err(PatchError::Perm(
                "hypervisor memory for shadow pages is exhausted",
            ));
        }
        frames::alloc().ok_or(PatchError::Perm(
            "hypervisor memory for shadow pages is exhausted",
        ))
    }

    /// Hooks the fentry site `site` of function `func` (no-op if hooked).
    fn hook(
        &mut self,
        k: &Kernel,
        ept: &Ept,
        site: u64,
        func: u64,
        rip: u64,
    ) -> Result<(), PatchError> {
        if self.sites.contains_key(&site) {
            return Ok(());
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
        let t = paging::translate(&GuestRam, k.cr3(), KGva(site)).map_err(|_| PatchError::Fault)?;
        let gpa = t.gpa.0;
        if in_hypervisor(gpa) {
            return Err(PatchError::Perm("the site is not in guest memory"));
        }
        let page = gpa & !(PAGE_SIZE as u64 - 1);
        let offset = (gpa - page) as usize;
        let mut guest = [0u8; SITE_LEN];
        if !phys::read(gpa, &mut guest) {
            return Err(PatchError::Fault);
        }
        site::check_guest_site(trampolines::Gva(site), &guest)?;
        let ours = region
            .tramp
            .site_patch(trampolines::Gva(site))
            .map_err(|_| PatchError::Perm("the trampolines are out of reach of a call"))?;
        let new_page = !self.pages.contains_key(&page);
        if new_page {
            let shadow = self.alloc_shadow()?;
            let Some(orig) = page_bytes(page) else {
                self.free_shadows.push(shadow);
                return Err(PatchError::Fault);
            };
            phys::frame_bytes_mut(shadow).copy_from_slice(&orig);
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
        // The shadow holds the guest's bytes here (copied, or re-synced on
        // the guest's last write): check them, then write ours.
        site::write_checked(phys::frame_bytes_mut(h.shadow), offset, &guest, &ours)?;
        h.patches.push(Patch {
            offset: offset as u16,
            site: trampolines::Gva(site),
            ours,
            guest,
        });
        if new_page {
            if let Err(e) = ept.map_page(
                &mut PoolTables,
                Gpa(page),
                h.shadow,
                ept::EXEC,
                MemType::WriteBack,
            ) {
                log::warn!("tracer: EPT map of {page:#x} failed: {e:?}");
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
                graph: false,
            },
        );
        Ok(())
    }

    /// Removes our patch from `site` if nothing uses it any more.
    fn unhook_if_unused(&mut self, ept: &Ept, site: u64) {
        let Some(u) = self.sites.get(&site) else {
            return;
        };
        if !u.probes.is_empty() || u.function || u.graph {
            return;
        }
        let page = u.page;
        self.sites.remove(&site);
        let Some(h) = self.pages.get_mut(&page) else {
            return;
        };
        if let Some(i) = h.patches.iter().position(|p| p.site.0 == site) {
            let p = h.patches.swap_remove(i);
            if let Err(e) = site::write_checked(
                phys::frame_bytes_mut(h.shadow),
                p.offset as usize,
                &p.ours,
                &p.guest,
            ) {
                log::warn!("tracer: unpatching {site:#x}: {e}");
            }
        }
        if h.patches.is_empty() {
            let shadow = h.shadow;
            self.pages.remove(&page);
            remap(ept, page, Hpa(page), ept::RWX);
            self.free_shadows.push(shadow);
        }
        // The caller flushes EPT once for the whole request.
    }

    // ----- requests ----------------------------------------------------

    /// `probe add`.
    pub fn probe_add(
        &mut self,
        text: &str,
        k: &Kernel,
        ept: &Ept,
        rip: u64,
    ) -> Result<(String, u64), ReqError> {
        let mut spec = match kprobe::parse(text) {
            Ok(Command::Add(s)) => s,
            Ok(Command::Delete(_)) => {
                return Err((
                    ErrorKind::InvalidArgument,
                    "a delete command is not a probe: use probe del".into(),
                ))
            }
            Err(e) => return Err((ErrorKind::InvalidArgument, e.to_string())),
        };
        if spec.kind.is_return() {
            return Err((
                ErrorKind::Unsupported,
                "return probes are not supported yet (they come with the function-graph tracer)"
                    .into(),
            ));
        }
        if self
            .probes
            .iter()
            .any(|p| p.spec.group == spec.group && p.spec.event == spec.event)
        {
            return Err((
                ErrorKind::AlreadyExists,
                format!("probe {}/{} already exists", spec.group, spec.event),
            ));
        }
        let syms = IndexSymbols(k.index());
        spec.resolve_symbols(&syms).map_err(|name| {
            (
                ErrorKind::NotFound,
                format!("symbol {name} is not in the guest's kallsyms"),
            )
        })?;
        let id = k.index().lookup(&spec.symbol).ok_or_else(|| {
            (
                ErrorKind::NotFound,
                format!("function {} is not in the guest's kallsyms", spec.symbol),
            )
        })?;
        let fs = k.classify(id).map_err(|e| {
            (
                ErrorKind::InvalidArgument,
                format!("{} cannot be probed: {e:?}", spec.symbol),
            )
        })?;
        self.ensure_region(k, ept)?;
        let site = fs.site.0;
        let hooked = self.hook(k, ept, site, fs.func.0, rip);
        invept(ept);
        hooked.map_err(|e| {
            (
                ErrorKind::InvalidArgument,
                format!("cannot hook {} at {site:#x}: {e}", spec.symbol),
            )
        })?;
        let pid = self.next_id;
        self.next_id += 1;
        if let Some(u) = self.sites.get_mut(&site) {
            u.probes.push(pid);
        }
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
    pub fn probe_del(&mut self, name: &str, ept: &Ept) -> Result<(), ReqError> {
        let (group, event) = match name.split_once('/') {
            Some((g, e)) => (Some(g), e),
            None => (None, name),
        };
        let Some(i) = self
            .probes
            .iter()
            .position(|p| p.spec.event == event && group.is_none_or(|g| g == p.spec.group))
        else {
            return Err((ErrorKind::NotFound, format!("no probe named {name}")));
        };
        let p = self.probes.remove(i);
        if let Some(u) = self.sites.get_mut(&p.site) {
            u.probes.retain(|&x| x != p.id);
        }
        self.unhook_if_unused(ept, p.site);
        invept(ept);
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
        k: &Kernel,
        ept: &Ept,
        rip: u64,
    ) -> Result<(u32, Vec<String>, u32), ReqError> {
        self.ensure_region(k, ept)?;
        let index = k.index();
        let view = PagedView::new(&GuestRam, k.cr3());
        let classifier = Classifier::new(index);
        let mut traced = 0u32;
        let mut skipped = Vec::new();
        let mut skipped_total = 0u32;
        let mut seen = alloc::collections::BTreeSet::new();
        let ids: Vec<_> = index.glob(glob).collect();
        for id in ids {
            let Ok(fs) = classifier.classify(&view, id) else {
                continue; // not traceable: not a match for the tracer
            };
            if !seen.insert(fs.site.0) {
                continue; // an alias of a function already done
            }
            match self.hook(k, ept, fs.site.0, fs.func.0, rip) {
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
        invept(ept);
        log::info!("tracer: function tracer on {glob}: {traced} traced, {skipped_total} skipped");
        Ok((traced, skipped, skipped_total))
    }

    /// Removes the function tracer everywhere.
    pub fn function_clear(&mut self, ept: &Ept) {
        self.release_sites(ept, |u| &mut u.function);
        self.functions = 0;
    }

    /// Clears one user's flag (`flag` picks it) on every site and unhooks
    /// the sites nothing else uses.
    fn release_sites(&mut self, ept: &Ept, flag: fn(&mut SiteUse) -> &mut bool) {
        let sites: Vec<u64> = self
            .sites
            .iter_mut()
            .filter_map(|(s, u)| core::mem::take(flag(u)).then_some(*s))
            .collect();
        for s in sites {
            self.unhook_if_unused(ept, s);
        }
        invept(ept);
    }

    /// Whether rendered output is waiting (the stream wants busy turns).
    pub fn has_output(&self) -> bool {
        self.stream.is_some() && (!self.ring.is_empty() || self.pending_line.is_some())
    }

    /// `TraceStart` / `TraceStop`.
    pub fn set_stream(&mut self, format: Option<TraceFormat>) {
        if self.stream != format {
            self.pending_line = None;
        }
        self.stream = format;
    }

    // ----- the hot path ------------------------------------------------

    /// A VMCALL at guest `rip` in ring `cpl`.
    pub fn hypercall(
        &mut self,
        rip: u64,
        regs: &mut crate::arch::instructions::GuestRegs,
        cpu: &CpuView,
        kernel: Option<&Kernel>,
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
                self.stats.hits += 1;
                regs.rax = match kernel {
                    Some(k) => self.on_entry(regs.rdi, regs.rsi, cpu, k, now_ns),
                    None => 0,
                };
                Hypercall::Handled
            }
            Some(trampolines::Hypercall::Return)
                if regs.rax == u64::from(trampolines::abi::HYPERCALL_RETURN) =>
            {
                match self.graph_return(regs.rdi, regs.rsi, cpu, kernel, now_ns) {
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

    /// `GraphStart`: hooks the trace set and records the roots.
    pub fn graph_start(
        &mut self,
        filter: GraphFilter,
        k: &Kernel,
        ept: &Ept,
        rip: u64,
    ) -> Result<(u32, u32, u32), ReqError> {
        self.ensure_region(k, ept)?;
        self.graph_stop(ept);
        let index = k.index();
        let view = PagedView::new(&GuestRam, k.cr3());
        let classifier = Classifier::new(index);
        let site_of = |id| classifier.classify(&view, id).ok();
        let mut notrace = BTreeSet::new();
        for g in &filter.notrace {
            for id in index.glob(g) {
                if let Some(fs) = site_of(id) {
                    notrace.insert(fs.site.0);
                }
            }
        }
        let mut roots = BTreeSet::new();
        let mut wanted = BTreeMap::new();
        for g in &filter.functions {
            for id in index.glob(g) {
                if let Some(fs) = site_of(id) {
                    if !notrace.contains(&fs.site.0) {
                        roots.insert(fs.func.0);
                        wanted.insert(fs.site.0, fs.func.0);
                    }
                }
            }
        }
        if !filter.functions.is_empty() && roots.is_empty() {
            return Err((
                ErrorKind::NotFound,
                format!(
                    "no traceable function matches {}",
                    filter.functions.join(" ")
                ),
            ));
        }
        let trace: Vec<String> = if filter.trace.is_empty() {
            alloc::vec![String::from("*")]
        } else {
            filter.trace.clone()
        };
        for g in &trace {
            for id in index.glob(g) {
                if let Some(fs) = site_of(id) {
                    if !notrace.contains(&fs.site.0) {
                        wanted.insert(fs.site.0, fs.func.0);
                    }
                }
            }
        }
        let (mut hooked, mut skipped) = (0u32, 0u32);
        for (site, func) in wanted {
            match self.hook(k, ept, site, func, rip) {
                Ok(()) => {
                    if let Some(u) = self.sites.get_mut(&site) {
                        u.graph = true;
                    }
                    hooked += 1;
                }
                Err(_) => skipped += 1,
            }
        }
        invept(ept);
        let n_roots = roots.len() as u32;
        log::info!(
            "tracer: function graph: {hooked} functions hooked, {n_roots} roots, {skipped} skipped"
        );
        self.graph_text = GraphText::new(filter.retval);
        self.graph = Some(GraphState { filter, roots });
        Ok((hooked, n_roots, skipped))
    }

    /// `GraphStop`: no new calls are hijacked; frames in flight stay.
    pub fn graph_stop(&mut self, ept: &Ept) {
        if self.graph.take().is_some() {
            self.release_sites(ept, |u| &mut u.graph);
        }
    }

    /// The graph half of an entry hit: push a frame and hijack the return.
    #[allow(clippy::too_many_arguments)]
    fn graph_enter(
        &mut self,
        func: u64,
        retp: u64,
        cr3: Cr3,
        pid: i32,
        comm: &[u8; 16],
        now_ns: u64,
        header: EventHeader,
    ) {
        let Some(g) = &self.graph else {
            return;
        };
        let Some(tramp) = self.region.as_ref().map(|r| r.tramp.return_trampoline().0) else {
            return;
        };
        let key = retp & !(THREAD_SIZE - 1);
        if !self.stacks.contains_key(&key) && self.stacks.len() >= MAX_STACKS {
            self.stats.graph_misses += 1;
            return;
        }
        let st = self
            .stacks
            .entry(key)
            .or_insert_with(|| RetStack::new(RETSTACK_WORDS));
        // Frames below this call's return slot can never return.
        self.stats.graph_dropped += st.reclaim_below(retp) as u64;
        let depth = st.depth();
        if depth == 0 {
            let f = &g.filter;
            let root_ok = g.roots.is_empty() || g.roots.contains(&func);
            let pid_ok = f.pid.is_none_or(|p| p == pid);
            let comm_ok = f.comm.as_deref().is_none_or(|c| {
                let n = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
                c.as_bytes() == &comm[..n]
            });
            if !(root_ok && pid_ok && comm_ok) {
                if st.is_empty() {
                    self.stacks.remove(&key);
                }
                return;
            }
        }
        if g.filter.max_depth != 0 && depth >= g.filter.max_depth as usize {
            return;
        }
        let mut slot = [0u8; 8];
        let Ok(t) = paging::translate(&GuestRam, cr3, KGva(retp)) else {
            return;
        };
        if !retp.is_multiple_of(8) || in_hypervisor(t.gpa.0) || !phys::read(t.gpa.0, &mut slot) {
            return;
        }
        let ret = u64::from_le_bytes(slot);
        // A frame at this very slot is the caller of a tail call: the callee
        // stacks on it. (The slot may hold our trampoline, or the return
        // handler of the guest's own function_graph, which hijacks after
        // us; so the slot's value cannot tell a dead frame from a live one.
        // A dead frame at the same slot pops harmlessly below the new one, or
        // goes with the next call from a higher slot.)
        if ret == tramp && st.top_retp() != Some(retp) {
            // Our trampoline in a slot we have no frame for: never stack on it.
            return;
        }
        match st.push(ret, func, now_ns, retp, 1, &[]) {
            Ok(_) => {}
            Err(PushError::Full) => {
                self.stats.graph_misses += 1;
                return;
            }
            Err(_) => return,
        }
        phys::write(t.gpa.0, &tramp.to_le_bytes());
        let ev = RawEvent {
            header: EventHeader {
                probe_id: GRAPH_ENTRY_ID,
                ip: func,
                ret_ip: ret,
                ..header
            },
            values: alloc::vec![kprobe::FetchedValue::Int {
                ty: kprobe::IntType::U64,
                value: depth as u64,
            }],
        };
        store(&mut self.ring, &mut self.record, &ev);
    }

    /// A return through the trampoline: the original return address.
    fn graph_return(
        &mut self,
        frame_gva: u64,
        retval: u64,
        cpu: &CpuView,
        kernel: Option<&Kernel>,
        now_ns: u64,
    ) -> Option<u64> {
        let retp = frame_gva.checked_add(trampolines::abi::RETURN_FRAME_RETP as u64)?;
        let key = retp & !(THREAD_SIZE - 1);
        let st = self.stacks.get_mut(&key)?;
        let PopResult::Found { frame, dropped } = st.pop(retp) else {
            return None;
        };
        self.stats.graph_dropped += dropped as u64;
        if st.is_empty() {
            self.stacks.remove(&key);
        }
        let (pid, comm) = kernel.and_then(|k| k.task(cpu)).unwrap_or((-1, [0; 16]));
        let ev = RawEvent {
            header: EventHeader {
                probe_id: GRAPH_RETURN_ID,
                cpu: 0,
                pid,
                timestamp_ns: now_ns,
                ip: frame.func,
                ret_ip: frame.ret,
                comm,
            },
            values: alloc::vec![
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: frame.depth as u64,
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: now_ns.saturating_sub(frame.calltime),
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::X64,
                    value: retval,
                },
            ],
        };
        store(&mut self.ring, &mut self.record, &ev);
        Some(frame.ret)
    }

    /// An entry hypercall from `site` with the pt_regs at `regs_gva`;
    /// returns the chain target.
    fn on_entry(
        &mut self,
        regs_gva: u64,
        site: u64,
        cpu: &CpuView,
        k: &Kernel,
        now_ns: u64,
    ) -> u64 {
        let Some(u) = self.sites.get(&site) else {
            return 0;
        };
        let chain = self
            .pages
            .get(&u.page)
            .and_then(|h| h.patches.iter().find(|p| p.site.0 == site))
            .map_or(0, Patch::chain_target);
        let cr3 = Cr3(cpu.cr3);
        let mut image = [0u8; trampolines::ptregs::PT_REGS_SIZE];
        if paging::read_virt(&GuestRam, cr3, KGva(regs_gva), &mut image).is_err() {
            self.ring.count_lost();
            return chain;
        }
        let regs = PtRegs::from_le_bytes(&image);
        let (pid, comm) = k.task(cpu).unwrap_or((-1, [0; 16]));
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
        let mut mem = VcpuMem { cr3 };
        let ctx = FetchContext {
            regs: &regs,
            comm: Some(&comm),
            layout: GuestLayout::X86_64_4LEVEL,
        };
        let function = u.function;
        let graph = u.graph;
        let func = u.func;
        for &id in &u.probes {
            let Some(p) = self.probes.iter_mut().find(|p| p.id == id) else {
                continue;
            };
            header.probe_id = id;
            let ev = RawEvent {
                header,
                values: kprobe::fetch(&p.spec.args, &ctx, &mut mem, &syms),
            };
            if store(&mut self.ring, &mut self.record, &ev) {
                p.hits += 1;
            } else {
                p.misses += 1;
            }
        }
        if function {
            let mut ret = [0u8; 8];
            let parent = paging::read_virt(&GuestRam, cr3, KGva(regs.sp), &mut ret)
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
        if graph {
            self.graph_enter(func, regs.sp, cr3, pid, &comm, now_ns, header);
        }
        chain
    }

    // ----- the stream --------------------------------------------------

    /// Moves rendered events into the control channel while it has room.
    pub fn drain(&mut self, control: &mut crate::control::Control, kernel: Option<&Kernel>) {
        let Some(format) = self.stream else {
            return;
        };
        let Some(k) = kernel else {
            return;
        };
        let syms = IndexSymbols(k.index());
        loop {
            if control.tx_room() < TX_HEADROOM + protocol::MAX_WIRE_FRAME {
                return;
            }
            let mut text = self.pending_line.take().unwrap_or_default();
            while text.len() < TRACE_TEXT_BUDGET {
                if !self.ring.pop(&mut self.record) {
                    // An entry held back for a leaf is printed open once
                    // nothing has followed it for a few turns.
                    if text.is_empty() && self.graph_text.has_pending() {
                        self.graph_idle_turns += 1;
                        if self.graph_idle_turns > 3 {
                            self.graph_text.flush(&mut text, &syms);
                        }
                    }
                    break;
                }
                self.graph_idle_turns = 0;
                let mut line = String::new();
                self.render(&mut line, format, &syms);
                if line.is_empty() {
                    continue;
                }
                cut_line(&mut line, TRACE_TEXT_BUDGET);
                if !line.ends_with('\n') {
                    line.push('\n');
                }
                if !text.is_empty() && text.len() + line.len() > TRACE_TEXT_BUDGET {
                    self.pending_line = Some(line);
                    break;
                }
                text.push_str(&line);
            }
            let lost = self.ring.lost() - self.lost_reported;
            if text.is_empty() && lost == 0 {
                return;
            }
            self.lost_reported = self.ring.lost();
            control.send_event(protocol::Event::TraceText { format, lost, text });
        }
    }

    fn render(&mut self, out: &mut String, format: TraceFormat, syms: &IndexSymbols<'_>) {
        let Ok((ev, _)) = RawEvent::decode(&self.record) else {
            let _ = write!(out, "(undecodable record of {} bytes)", self.record.len());
            return;
        };
        let graph = match ev.header.probe_id {
            GRAPH_ENTRY_ID => Some(GraphKind::Entry),
            GRAPH_RETURN_ID => Some(GraphKind::Return),
            _ => None,
        };
        if let Some(kind) = graph {
            match format {
                TraceFormat::Json => graph_fmt::write_graph_json(out, kind, &ev, syms),
                _ => self.graph_text.push(out, kind, &ev, syms),
            }
            return;
        }
        if ev.header.probe_id == FUNCTION_ID {
            match format {
                TraceFormat::Json => kprobe::write_function_json(out, &ev, syms),
                _ => kprobe::write_function_text(out, &ev, syms),
            }
            return;
        }
        // A probe deleted since the hit is no longer printable: skip it.
        let Some(p) = self.probes.iter().find(|p| p.id == ev.header.probe_id) else {
            return;
        };
        match format {
            TraceFormat::Json => kprobe::write_json(out, &p.spec, &ev, syms),
            _ => kprobe::write_text(out, &p.spec, &ev, syms),
        }
    }

    // ----- the split view's single step --------------------------------

    /// An EPT violation at `gpa`: a hooked page or hypervisor memory gets a
    /// single step; anything else is not the tracer's.
    pub fn on_violation(&mut self, gpa: u64, write: bool, ept: &Ept) -> Violation {
        let page = gpa & !(PAGE_SIZE as u64 - 1);
        if self.step.is_some() {
            // A second access within the stepped instruction (a page
            // crossing): end the first and start over with this one.
            self.end_step(ept);
        }
        let watched = self.region.as_ref().is_some_and(|r| r.pd_page == page);
        let kind = if watched {
            remap(ept, page, Hpa(page), ept::RWX);
            StepKind::Watch
        } else if self.pages.contains_key(&page) {
            remap(ept, page, Hpa(page), ept::RWX);
            StepKind::Hooked { write }
        } else if in_hypervisor(page) {
            let scratch = match self.scratch {
                Some(s) => s,
                None => match frames::alloc() {
                    Some(s) => {
                        self.scratch = Some(s);
                        s
                    }
                    None => return Violation::NotOurs,
                },
            };
            phys::frame_bytes_mut(scratch).fill(0xcc);
            let restore = match ept.map_page(
                &mut PoolTables,
                Gpa(page),
                scratch,
                ept::READ | ept::WRITE,
                MemType::WriteBack,
            ) {
                Ok(old) => old,
                Err(_) => return Violation::NotOurs,
            };
            self.stats.blocked_writes += u64::from(write);
            StepKind::Discard { restore }
        } else {
            return Violation::NotOurs;
        };
        invept(ept);
        self.stats.steps += 1;
        self.step = Some(Step {
            page,
            kind,
            old_tf: false,
            turns: 0,
        });
        Violation::Stepping
    }

    /// Records the guest's TF before the step set it.
    pub fn set_old_tf(&mut self, tf: bool) {
        if let Some(s) = self.step.as_mut() {
            s.old_tf = tf;
        }
    }

    /// A #DB with exit qualification `qual`: the end of our step (returns
    /// the TF to leave in RFLAGS), a stale TF of ours (clear it), or the
    /// guest's own (`None`: reflect it).
    pub fn on_debug(&mut self, qual: u64, ept: &Ept) -> Option<bool> {
        if let Some(s) = self.step.as_ref() {
            let tf = s.old_tf;
            self.end_step(ept);
            return Some(tf);
        }
        if self.stray_tf && qual & DBG_BS != 0 {
            self.stray_tf = false;
            return Some(false);
        }
        None
    }

    /// Whether #DB must stay intercepted.
    pub fn wants_debug_exits(&self) -> bool {
        self.step.is_some() || self.stray_tf
    }

    fn end_step(&mut self, ept: &Ept) {
        let Some(s) = self.step.take() else {
            return;
        };
        match s.kind {
            StepKind::Hooked { write } => {
                if let Some(h) = self.pages.get_mut(&s.page) {
                    if write {
                        self.stats.guest_writes += 1;
                        if let Some(orig) = page_bytes(s.page) {
                            site::resync(phys::frame_bytes_mut(h.shadow), &orig, &mut h.patches);
                        }
                    }
                    remap(ept, s.page, h.shadow, ept::EXEC);
                } else {
                    // Unhooked meanwhile: the identity mapping stays.
                }
            }
            StepKind::Watch => {
                self.check_pde();
                remap(ept, s.page, Hpa(s.page), ept::READ | ept::EXEC);
            }
            StepKind::Discard { restore } => {
                if restore & ept::RWX == 0 {
                    let _ = ept.unmap(&mut PoolTables, Gpa(s.page), Gpa(s.page + PAGE_SIZE as u64));
                } else {
                    let _ = ept.map_page(
                        &mut PoolTables,
                        Gpa(s.page),
                        Hpa(restore & paging::ADDR_MASK),
                        restore & ept::RWX,
                        MemType::WriteBack,
                    );
                }
            }
        }
        invept(ept);
    }
}

/// Encodes `ev` into the ring.
fn store(ring: &mut EventRing, scratch: &mut Vec<u8>, ev: &RawEvent) -> bool {
    scratch.clear();
    scratch.resize(ev.encoded_len(), 0);
    match ev.encode_into(scratch) {
        Some(n) => ring.push(&scratch[..n]),
        None => {
            ring.count_lost();
            false
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
