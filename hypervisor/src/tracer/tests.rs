//! The tracer driven on the host with synthetic hits: a guest kernel of a
//! few functions in a sparse guest RAM behind the guarded door, with page
//! tables of its own and kallsyms tables laid out as the kernel lays them
//! out; a frame pool and a real EPT builder over tables in memory. Each
//! test issues the requests the host would send, then plays the guest's
//! side of a hit (the pt_regs the entry trampoline builds, the VMCALL's
//! registers) and checks what a guest and a user would see: bytes in guest
//! memory, EPT entries, the return address handed back, the rendered
//! trace.

use super::machine::{CpuView, Env, GuestGs, KernelView, Machine, Running, View, PAGE};
use super::{CpuState, DebugState, Hit, Hypercall, Tracer, Violation, VmState};
use crate::addr::{Gpa, Hpa};
use crate::ept::{self, Ept, EptError, Leaf, MemType, TableStore};
use crate::guest_phys::{GuestPhys, RawMemory};
use crate::vmx::regs::GuestRegs;
use guest_introspect::fallible::OutOfMemory;
use guest_introspect::kallsyms::{locate, LocateStats, SymbolIndex};
use guest_introspect::paging::Cr3;
use guest_introspect::stacks::StackMap;
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use loader::e820::{E820Entry, E820Kind, E820Map};
use protocol::{Event, GraphFilter, TraceFormat};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use trampolines::abi::{HYPERCALL_ENTRY, HYPERCALL_RETURN, RETURN_FRAME_RETP};
use trampolines::ptregs::PT_REGS_SIZE;
use trampolines::{HypercallMode, TrampolineRegion};

const MIB: u64 = 1 << 20;

// ----- the synthetic guest -----------------------------------------------

/// Guest RAM: 32 MiB to 40 MiB (above the hypervisor's reservation).
const RAM: (u64, u64) = (32 * MIB, 40 * MIB);
/// The guest's page tables.
const PML4: u64 = 32 * MIB;
const PDPT: u64 = PML4 + 0x1000;
const PD: u64 = PML4 + 0x2000;
const PT: u64 = PML4 + 0x3000;
/// `_stext`, mapped by PT (PD slot 8) to guest-physical `TEXT_GPA`.
const TEXT: u64 = 0xffff_ffff_8100_0000;
const TEXT_GPA: u64 = 33 * MIB;
/// The functions: a caller, and two callees on one page.
const CALLER: u64 = TEXT + 0x1000;
const FUNC: u64 = TEXT + 0x2000;
const OTHER: u64 = TEXT + 0x2100;
const FTRACE_CALLER: u64 = TEXT + 0x9000;
/// A function alone on its page, outside the `*_func` globs.
const QUIET_LEAF: u64 = TEXT + 0x4000;
/// The scheduler function root hooks for context switches, as GCC names
/// it.
const SWITCH: u64 = TEXT + 0x5000;
/// The kernel's renaming of a task.
const SET_COMM: u64 = TEXT + 0x6000;
/// Where a test puts a new task name.
const NAME_AT: u64 = STACK_BASE + 0x100;
/// A second task, whose kernel stack is `STACK_BASE_2`.
const TASK_2: u64 = TASK + 0x4000;
/// The kernel's module functions the hidden hooks go on.
const DO_INIT_MODULE: u64 = TEXT + 0x3000;
const FREE_MODULE: u64 = TEXT + 0x3100;
const FREEING_INIT: u64 = TEXT + 0x3200;
/// A module's `struct module`, and its text: outside the kernel's text,
/// inside the mapping the page tables have (module space, for the test).
const MOD_STRUCT: u64 = 0xffff_8880_0200_0000;
const MOD_TEXT: u64 = TEXT + 0x18_0000;
const MOD_FUNC: u64 = MOD_TEXT + 0x40;
/// Its init text, on another page, and its init function.
const MOD_INIT_TEXT: u64 = TEXT + 0x1a_0000;
const MOD_INIT_FUNC: u64 = MOD_INIT_TEXT + 0x10;
const ETEXT: u64 = TEXT + 0x10_0000;
/// A task's kernel stack (16 KiB) inside the same mapping.
const STACK_BASE: u64 = TEXT + 0x1f_0000;
/// The task running the hits.
const TASK: u64 = 0xffff_8880_0100_0000;
/// Where the caller's `call FUNC` returns to.
const CALLER_RET: u64 = CALLER + 0x15;
/// `NOP5` (`nopl 0x0(%rax,%rax,1)`), the fentry site of an idle kernel.
const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// Physical memory as root maps it, sparse, by page (behind a lock: the
/// hits of two vCPUs reach it from two threads).
#[derive(Default)]
struct SparseRam(Mutex<BTreeMap<u64, Box<[u8; PAGE]>>>);

impl SparseRam {
    fn put(&self, addr: u64, bytes: &[u8]) {
        assert!(RawMemory::write(self, addr, bytes));
    }
    fn get(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0; len];
        assert!(RawMemory::read(self, addr, &mut b));
        b
    }
    fn word(&self, addr: u64) -> u64 {
        u64::from_le_bytes(self.get(addr, 8).try_into().unwrap())
    }
}

impl RawMemory for SparseRam {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        let pages = self.0.lock().unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            let a = addr + i as u64;
            *b = pages
                .get(&(a & !0xfff))
                .map_or(0, |p| p[(a & 0xfff) as usize]);
        }
        true
    }
    fn write(&self, addr: u64, bytes: &[u8]) -> bool {
        let mut pages = self.0.lock().unwrap();
        for (i, &b) in bytes.iter().enumerate() {
            let a = addr + i as u64;
            pages
                .entry(a & !0xfff)
                .or_insert_with(|| Box::new([0; PAGE]))[(a & 0xfff) as usize] = b;
        }
        true
    }
}

impl RawMemory for &SparseRam {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        (**self).read(addr, buf)
    }
    fn write(&self, addr: u64, bytes: &[u8]) -> bool {
        (**self).write(addr, bytes)
    }
}

/// EPT tables in memory; "host-physical" addresses far above anything else.
#[derive(Default)]
struct MemTables(Vec<Box<[u64; 512]>>);

const TABLES_AT: u64 = 1 << 40;

impl TableStore for MemTables {
    fn alloc_table(&mut self) -> Option<Hpa> {
        self.0.push(Box::new([0; 512]));
        Some(Hpa(TABLES_AT + self.0.len() as u64 * 0x1000))
    }
    fn table(&mut self, hpa: Hpa) -> &mut [u64; 512] {
        &mut self.0[((hpa.0 - TABLES_AT) / 0x1000 - 1) as usize]
    }
}

/// vCPUs of the synthetic guest.
const VCPUS: usize = 2;

/// Root's resources: frames from the hypervisor's reservation, an EPT view
/// per vCPU over tables in memory, a heap budget.
struct FakeRoot {
    frames: BTreeMap<u64, Box<[u8; PAGE]>>,
    next_frame: u64,
    frame_limit: u64,
    tables: MemTables,
    views: Vec<Ept>,
    /// Each vCPU's quiet view, by index.
    quiet: Vec<Ept>,
    /// The vCPU the tracer works for, and the view it runs on.
    me: usize,
    active: View,
    /// Every vCPU's RIP, as `stop_others` would find them.
    rips: Vec<u64>,
    /// Whether the other vCPUs come to root when asked; and how often they
    /// were asked.
    others_come: bool,
    stops: u32,
    /// Holds asked for with `must_stop_others` (a module's unload).
    must_stops: u32,
    releases: u32,
    invepts: u32,
    heap_room: usize,
}

impl FakeRoot {
    fn new() -> Self {
        let mut tables = MemTables::default();
        let views: Vec<Ept> = (0..2 * VCPUS)
            .map(|_| {
                let ept = Ept::new(&mut tables).unwrap();
                // Guest RAM identity-mapped read/write/execute, as the
                // binary maps it.
                for page in (RAM.0..RAM.1).step_by(PAGE) {
                    ept.map_page(
                        &mut tables,
                        Gpa(page),
                        Hpa(page),
                        ept::RWX,
                        MemType::WriteBack,
                    )
                    .unwrap();
                }
                ept
            })
            .collect();
        let (views, quiet) = (views[..VCPUS].to_vec(), views[VCPUS..].to_vec());
        FakeRoot {
            quiet,
            active: View::Armed,
            frames: BTreeMap::new(),
            next_frame: loader::layout::HV_RESERVED.0 + 8 * MIB,
            frame_limit: 64,
            tables,
            views,
            me: 0,
            rips: vec![0],
            others_come: true,
            stops: 0,
            must_stops: 0,
            releases: 0,
            invepts: 0,
            heap_room: 64 << 20,
        }
    }

    /// The EPT leaf of `gpa` in the current vCPU's view.
    fn leaf(&mut self, gpa: u64) -> Option<Leaf> {
        self.leaf_in(self.me, gpa)
    }

    /// The EPT leaf of `gpa` in vCPU `view`'s armed view.
    fn leaf_in(&mut self, view: usize, gpa: u64) -> Option<Leaf> {
        self.views[view].translate(&mut self.tables, Gpa(gpa))
    }

    /// The EPT leaf of `gpa` in vCPU `vcpu`'s quiet view.
    fn quiet_leaf(&mut self, vcpu: usize, gpa: u64) -> Option<Leaf> {
        self.quiet[vcpu].translate(&mut self.tables, Gpa(gpa))
    }

    /// This vCPU's view `view`.
    fn own(&self, view: View) -> &Ept {
        match view {
            View::Armed => &self.views[self.me],
            View::Quiet => &self.quiet[self.me],
        }
    }
}

impl Machine for FakeRoot {
    fn alloc_frame(&mut self) -> Option<Hpa> {
        if self.frames.len() as u64 >= self.frame_limit {
            return None;
        }
        let f = self.next_frame;
        self.next_frame += PAGE as u64;
        self.frames.insert(f, Box::new([0; PAGE]));
        Some(Hpa(f))
    }
    fn frames_free(&self) -> u64 {
        (self.frame_limit - self.frames.len() as u64) * PAGE as u64 + (1 << 20) * 2
    }
    fn frame(&mut self, hpa: Hpa) -> &mut [u8; PAGE] {
        self.frames
            .get_mut(&hpa.0)
            .expect("a frame the tracer was given")
    }
    fn ept_map(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        let mut mine = 0;
        for (i, ept) in self.views.iter().enumerate() {
            let old = ept.map_page(&mut self.tables, gpa, hpa, perms, MemType::WriteBack)?;
            if i == self.me {
                mine = old;
            }
        }
        for ept in &self.quiet {
            ept.map_page(&mut self.tables, gpa, hpa, perms, MemType::WriteBack)?;
        }
        Ok(mine)
    }
    fn ept_unmap(&mut self, gpa: Gpa) -> Result<(), EptError> {
        for ept in self.views.iter().chain(&self.quiet) {
            ept.unmap(&mut self.tables, gpa, Gpa(gpa.0 + PAGE as u64))?;
        }
        Ok(())
    }
    fn ept_map_quiet(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<(), EptError> {
        for ept in &self.quiet {
            ept.map_page(&mut self.tables, gpa, hpa, perms, MemType::WriteBack)?;
        }
        Ok(())
    }
    fn ept_map_mine(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        let ept = *self.own(self.active);
        ept.map_page(&mut self.tables, gpa, hpa, perms, MemType::WriteBack)
    }
    fn ept_map_own(&mut self, view: View, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        let ept = *self.own(view);
        ept.map_page(&mut self.tables, gpa, hpa, perms, MemType::WriteBack)
    }
    fn ept_unmap_own(&mut self, view: View, gpa: Gpa) -> Result<(), EptError> {
        let ept = *self.own(view);
        ept.unmap(&mut self.tables, gpa, Gpa(gpa.0 + PAGE as u64))
    }
    fn invept(&mut self) {
        self.invepts += 1;
    }
    fn stop_others(&mut self) -> bool {
        self.stops += 1;
        self.others_come
    }
    fn must_stop_others(&mut self) -> bool {
        self.stops += 1;
        self.must_stops += 1;
        self.others_come
    }
    fn let_others_go(&mut self) {
        self.releases += 1;
    }
    fn rips(&self) -> &[u64] {
        &self.rips
    }
    fn heap_check(&self, bytes: usize) -> Result<(), OutOfMemory> {
        if bytes <= self.heap_room {
            Ok(())
        } else {
            Err(OutOfMemory { bytes })
        }
    }
    fn heap_room(&self) -> usize {
        self.heap_room
    }
}

/// The recovered kernel: a real symbol index over synthetic kallsyms
/// tables, and the task and stack answers a test sets.
struct FakeKernel {
    index: SymbolIndex,
    /// No modules.
    modules: guest_introspect::module::ModuleIndex,
    running: Running,
    /// `task_struct.stack` by task (absent: unreadable).
    task_stacks: BTreeMap<u64, u64>,
}

impl KernelView for FakeKernel {
    fn index(&self) -> &SymbolIndex {
        &self.index
    }
    fn modules(&self) -> &guest_introspect::module::ModuleIndex {
        &self.modules
    }
    fn module_text(
        &self,
        module: u64,
    ) -> Option<(guest_introspect::GvaRange, guest_introspect::GvaRange)> {
        self.modules
            .modules()
            .iter()
            .find(|m| m.addr.0 == module)
            .map(|m| (m.text, m.init_text))
    }
    fn cr3(&self) -> Cr3 {
        Cr3(PML4)
    }
    fn current(&self, _cpu: &CpuView) -> Option<Running> {
        Some(self.running)
    }
    fn stack_map(&self, _cpu: &CpuView) -> StackMap {
        StackMap::default()
    }
    fn cpu_number(&self, cpu: &CpuView) -> Option<u32> {
        GS_BASES
            .iter()
            .position(|&gs| gs == cpu.gs_base.get())
            .map(|i| GUEST_CPU[i])
    }
    fn log_stacks(&self, _map: &StackMap) {}
    fn task_stack(&self, task: u64) -> Option<u64> {
        self.task_stacks.get(&task).copied()
    }
}

/// A symbol index of `_stext`, `caller`, `my_func`, `other_func`, `_etext`.
fn index() -> SymbolIndex {
    use test_support::synth::{generate, Order, Sym};
    let sym = |kind: u8, name: &str, addr| Sym {
        kind,
        name: name.into(),
        addr,
    };
    let mut syms = vec![
        sym(b'T', "_stext", TEXT),
        sym(b'T', "caller", CALLER),
        sym(b'T', "my_func", FUNC),
        sym(b't', "other_func", OTHER),
        sym(b't', "do_init_module", DO_INIT_MODULE),
        sym(b't', "free_module", FREE_MODULE),
        sym(b'W', "module_arch_freeing_init", FREEING_INIT),
        sym(b't', "quiet_leaf", QUIET_LEAF),
        sym(b't', "finish_task_switch.isra.0", SWITCH),
        sym(b'T', "__set_task_comm", SET_COMM),
        sym(b'T', "ftrace_caller", FTRACE_CALLER),
        sym(b'T', "_etext", ETEXT),
    ];
    // Data after the text, as many as a kernel's tables need to be found.
    for i in 0..600u64 {
        syms.push(sym(
            b'd',
            &format!("data_{i:04}"),
            ETEXT + 0x1000 + i * 0x40,
        ));
    }
    let (blob, _) = generate(&syms, Order::V612, false, TEXT);
    // The tables between filler bytes, as in a kernel's rodata.
    let mut mem: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(7919) as u8) | 1)
        .collect();
    mem.extend_from_slice(&blob);
    mem.extend((0..4096u32).map(|i| (i.wrapping_mul(104_729) as u8) | 1));
    let base = 0xffff_ffff_8200_0000u64;
    let mut view = SegmentView::new();
    view.add(Gva(base), &mem, mem.len() as u64);
    let range = GvaRange::with_len(Gva(base), mem.len() as u64);
    let t = locate(&view, &[range], &mut LocateStats::default()).unwrap();
    SymbolIndex::build(&view, &t).unwrap()
}

/// Each vCPU's kernel GS base, by root's index.
const GS_BASES: [u64; VCPUS] = [0xffff_8880_7fa0_0000, 0xffff_8880_7fc0_0000];
/// The guest's number for each vCPU, by root's index (not the same: the
/// guest numbers its CPUs as it likes).
const GUEST_CPU: [u32; VCPUS] = [3, 1];

/// The guest: page tables, text and stack.
struct Guest {
    ram: &'static SparseRam,
    door: GuestPhys<&'static SparseRam>,
    root: FakeRoot,
    kernel: FakeKernel,
    vm: VmState,
    cpus: Vec<CpuState>,
    /// The vCPU that runs (root's index).
    on: usize,
    now_ns: u64,
}

const P: u64 = 1; // present
const RW: u64 = 2;

impl Guest {
    fn new() -> Guest {
        let ram: &'static SparseRam = Box::leak(Box::default());
        // PML4[511] -> PDPT; PDPT[510] -> PD; PD[8] -> PT (the text's 2 MiB).
        ram.put(PML4 + 511 * 8, &(PDPT | P | RW).to_le_bytes());
        ram.put(PDPT + 510 * 8, &(PD | P | RW).to_le_bytes());
        ram.put(PD + 8 * 8, &(PT | P | RW).to_le_bytes());
        for i in 0..512u64 {
            ram.put(
                PT + i * 8,
                &((TEXT_GPA + i * 0x1000) | P | RW).to_le_bytes(),
            );
        }
        // Every function starts with its fentry NOP5, then `ret`.
        for f in [
            CALLER,
            FUNC,
            OTHER,
            DO_INIT_MODULE,
            FREE_MODULE,
            FREEING_INIT,
            MOD_FUNC,
            MOD_INIT_FUNC,
            QUIET_LEAF,
            SWITCH,
            SET_COMM,
        ] {
            ram.put(gpa(f), &NOP5);
            ram.put(gpa(f) + 5, &[0xc3]);
        }
        let e820 =
            E820Map::from_entries(&[E820Entry::new(RAM.0, RAM.1 - RAM.0, E820Kind::Ram)]).unwrap();
        let door = GuestPhys::new(
            e820,
            loader::layout::HV_RESERVED.0..loader::layout::HV_RESERVED_END.0,
            ram,
        );
        Guest {
            ram,
            door,
            root: FakeRoot::new(),
            kernel: FakeKernel {
                index: index(),
                modules: Default::default(),
                running: Running {
                    task: TASK,
                    pid: 42,
                    comm: *b"sleeper\0\0\0\0\0\0\0\0\0",
                },
                task_stacks: BTreeMap::from([(TASK, STACK_BASE), (TASK_2, STACK_BASE_2)]),
            },
            vm: VmState::new(VCPUS),
            cpus: (0..VCPUS).map(CpuState::new).collect(),
            on: 0,
            now_ns: 1_000_000_000,
        }
    }

    /// The tracer over the VM's state and the vCPU's.
    fn tracer(&mut self) -> Tracer<'_> {
        Tracer::new(&mut self.vm, &mut self.cpus[self.on])
    }

    /// Runs `f` with the tracer, its environment and the kernel.
    fn with<R>(&mut self, f: impl FnOnce(&mut Tracer, &mut Env<'_>, &FakeKernel) -> R) -> R {
        self.root.me = self.on;
        // Root runs the vCPU on the view its tracer state names.
        self.root.active = self.cpus[self.on].view();
        let mut env = Env {
            ram: &self.door,
            m: &mut self.root,
        };
        f(
            &mut Tracer::new(&mut self.vm, &mut self.cpus[self.on]),
            &mut env,
            &self.kernel,
        )
    }

    fn probe(&mut self, spec: &str) -> Result<(String, u64), super::ReqError> {
        let added = self.with(|t, env, k| t.probe_add(spec, k, env))?;
        Ok((added.name, added.site))
    }

    /// The trampolines as the tracer built them (the layout is a function
    /// of the base alone).
    fn region(&mut self) -> TrampolineRegion {
        let base = Tracer::new(&mut self.vm, &mut self.cpus[self.on])
            .report()
            .trampolines;
        assert_ne!(base, 0, "no trampoline region");
        TrampolineRegion::build(Gva(base), HypercallMode::Vmcall).unwrap()
    }

    fn cpu(&self, rsp: u64) -> CpuView {
        CpuView {
            cr3: PML4,
            cpl: 0,
            rsp,
            gs_base: GuestGs::known(GS_BASES[self.on]),
            ..CpuView::default()
        }
    }

    /// The guest calls `func` from `caller` with `rdi`: the caller's `call`
    /// pushes `ret` at `retp`, the site's `call` enters the trampoline,
    /// which builds pt_regs below and issues the entry VMCALL. Returns the
    /// hypercall's outcome and RAX (the chain target).
    fn hit(&mut self, func: u64, retp: u64, ret: u64, rdi: u64) -> (Hypercall, u64) {
        self.hit_si(func, retp, ret, rdi, 0)
    }

    /// [`Self::hit`] with RSI too.
    fn hit_si(&mut self, func: u64, retp: u64, ret: u64, rdi: u64, rsi: u64) -> (Hypercall, u64) {
        self.ram.put(gpa(retp), &ret.to_le_bytes());
        // As the trampoline lays it out (`trampolines::abi`): the site
        // call's return slot right below `retp`, pt_regs right below it.
        self.ram.put(gpa(retp - 8), &(func + 5).to_le_bytes());
        let regs_at = retp - trampolines::abi::ENTRY_SP_FROM_FRAME;
        let mut image = pt_regs(func + 5, retp, rdi);
        image[13 * 8..14 * 8].copy_from_slice(&rsi.to_le_bytes());
        self.ram.put(gpa(regs_at), &image);
        self.entry_vmcall(regs_at, regs_at, func)
    }

    /// The entry VMCALL with RDI = `regs_at`, RSP = `rsp`, RSI = `site`.
    fn entry_vmcall(&mut self, regs_at: u64, rsp: u64, site: u64) -> (Hypercall, u64) {
        let rip = self.region().entry_vmcall().unwrap().0;
        self.vmcall(rip, rsp, HYPERCALL_ENTRY, regs_at, site)
    }

    /// The traced function returns into the return trampoline, whose frame
    /// has the return slot `retp`; it returns `retval`.
    fn ret(&mut self, retp: u64, retval: u64) -> (Hypercall, u64) {
        let rip = self.region().return_vmcall().unwrap().0;
        let frame = retp - RETURN_FRAME_RETP as u64;
        self.vmcall(rip, retp, HYPERCALL_RETURN, frame, retval)
    }

    /// A VMCALL at `rip` with RSP `rsp` and RAX, RDI, RSI as given; the
    /// hypercall's outcome and the RAX it hands back.
    fn vmcall(&mut self, rip: u64, rsp: u64, nr: u32, rdi: u64, rsi: u64) -> (Hypercall, u64) {
        let mut regs = GuestRegs {
            rax: u64::from(nr),
            rdi,
            rsi,
            ..GuestRegs::default()
        };
        let cpu = self.cpu(rsp);
        let now = self.now_ns;
        let out = self.with(|t, env, k| t.hypercall(env, rip, &mut regs, &cpu, Some(k), now));
        (out, regs.rax)
    }

    /// Everything the stream has, as (source, text) pairs.
    fn drain(&mut self) -> Vec<(u32, String)> {
        let mut out = Vec::new();
        let now = self.now_ns;
        while let Some(ev) =
            Tracer::new(&mut self.vm, &mut self.cpus[0]).next_text(1 << 20, Some(&self.kernel), now)
        {
            match ev {
                Event::TraceText { source, text, .. } => out.push((source, text)),
                other => panic!("unexpected event {other:?}"),
            }
        }
        out
    }

    fn text(&mut self) -> String {
        self.drain().into_iter().map(|(_, t)| t).collect()
    }
}

/// The guest-physical address of a text or stack address.
fn gpa(va: u64) -> u64 {
    assert!((TEXT..TEXT + 2 * MIB).contains(&va));
    TEXT_GPA + (va - TEXT)
}

/// A `struct pt_regs` image (the kernel's order: r15 .. ss) with `ip`,
/// `sp` and `di` set.
fn pt_regs(ip: u64, sp: u64, di: u64) -> Vec<u8> {
    let mut words = [0u64; 21];
    words[14] = di; // di
    words[15] = u64::MAX; // orig_ax
    words[16] = ip;
    words[17] = 0x10; // cs
    words[19] = sp;
    words[20] = 0x18; // ss
    let b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(b.len(), PT_REGS_SIZE);
    b
}

/// The byte pattern of `call target` at `site`.
fn call_bytes(site: u64, target: u64) -> [u8; 5] {
    let rel = (target.wrapping_sub(site + 5)) as i64 as i32;
    let r = rel.to_le_bytes();
    [0xe8, r[0], r[1], r[2], r[3]]
}

/// A return slot on the task's stack.
const RETP: u64 = STACK_BASE + 0x3f00;

// ----- the region and the split view -------------------------------------

#[test]
fn a_probe_builds_the_region_and_a_shadow_the_guest_cannot_read() {
    let mut g = Guest::new();
    let (name, site) = g.probe("p:myprobe my_func x=%di").unwrap();
    assert_eq!(name, "kprobes/myprobe");
    assert_eq!(site, FUNC);

    // The region: a free 2 MiB slot of the kernel-image PD (the highest),
    // pointing at a hypervisor frame, EPT read-only.
    let base = g.tracer().report().trampolines;
    assert_eq!(base, 0xffff_ffff_8000_0000 + 511 * 2 * MIB);
    let pde = g.ram.word(PD + 511 * 8);
    let table = pde & !0xfff;
    assert!((loader::layout::HV_RESERVED.0..loader::layout::HV_RESERVED_END.0).contains(&table));
    assert_eq!(g.root.leaf(table).unwrap().perms, ept::READ);
    // The PD page itself is write-watched.
    assert_eq!(g.root.leaf(PD).unwrap().perms, ept::READ | ept::EXEC);

    // The guest's own page is untouched; EPT executes a shadow with our call.
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.ram.get(gpa(FUNC), 5), NOP5);
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!(leaf.perms, ept::EXEC, "execute-only: guest reads fault");
    assert_ne!(leaf.hpa.0, page);
    let shadow = g.root.frames[&leaf.hpa.0].clone();
    let off = (FUNC & 0xfff) as usize;
    let entry = g.region().entry().0;
    assert_eq!(shadow[off..off + 5], call_bytes(FUNC, entry));
    // The rest of the shadow is the guest's page.
    assert_eq!(shadow[off + 5], 0xc3);
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], NOP5);
    assert!(g.root.invepts > 0);
}

#[test]
fn a_guest_write_to_a_hooked_page_is_stepped_and_merged_under_our_patch() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;

    // The guest writes to the page (its ftrace turning other_func's site
    // into a call): EPT faults, the page is opened for one instruction.
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (page, ept::RWX));
    assert!(g.tracer().wants_debug_exits());
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    // A second page touched by the same instruction widens the step.
    let v = g.with(|t, env, _| t.on_violation(loader::layout::HV_RESERVED.0, false, false, env));
    assert!(matches!(v, Violation::Widened));
    g.tracer().set_old_tf(false);
    assert_eq!(
        g.tracer().debug_state(),
        DebugState {
            stepping: true,
            guest_tf: false,
            stray_tf: false
        }
    );

    // The #DB: the shadow is rebuilt from the guest's page, our call stays.
    g.with(|t, env, _| t.finish_step(env));
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa, leaf.perms), (shadow_hpa, ept::EXEC));
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    // The hypervisor page went back to unmapped.
    assert!(g.root.leaf(loader::layout::HV_RESERVED.0).is_none());
    assert!(!g.tracer().wants_debug_exits());
    let r = g.tracer().report();
    assert_eq!((r.steps, r.steps_widened, r.guest_writes), (1, 1, 1));
}

#[test]
fn a_write_while_a_read_step_is_open_reaches_the_shadow_when_it_closes() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;
    // A read opens the page; before the step's #DB, something else on the
    // vCPU (an interrupt's handler, a softirq) writes it: the guest's
    // ftrace turns other_func's site into a call.
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    g.with(|t, env, _| t.finish_step(env));
    // The shadow has the write, behind our call.
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    let r = g.tracer().report();
    assert_eq!((r.steps, r.guest_writes), (1, 0));
}

#[test]
fn a_write_root_emulates_reaches_the_shadow() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow_hpa = g.root.leaf(page).unwrap().hpa;
    // An INS or a task switch root emulates writes the guest's frame
    // itself, not through EPT: no step sees it.
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    g.ram.put(gpa(OTHER) + 0x40, &[0x90, 0x90]);
    assert!(g.with(|t, env, _| t.emulated_write(gpa(OTHER) + 0x40, env)));
    let shadow = g.root.frames[&shadow_hpa.0].clone();
    assert_eq!(shadow[(OTHER & 0xfff) as usize..][..5], theirs);
    assert_eq!(
        shadow[((OTHER & 0xfff) + 0x40) as usize..][..2],
        [0x90, 0x90]
    );
    let entry = g.region().entry().0;
    assert_eq!(
        shadow[(FUNC & 0xfff) as usize..][..5],
        call_bytes(FUNC, entry)
    );
    // A page nobody hooks: nothing to do.
    assert!(!g.with(|t, env, _| t.emulated_write(RAM.0 + 0x10_0000, env)));
    // Every hooked page at once, when root does not know which.
    g.ram.put(gpa(OTHER) + 0x80, &[0xcc]);
    g.with(|t, env, _| t.resync_all(env));
    assert_eq!(
        g.root.frames[&shadow_hpa.0][((OTHER & 0xfff) + 0x80) as usize],
        0xcc
    );
}

#[test]
fn tf_left_by_a_forced_step_end_is_looked_for_on_every_vcpu() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    g.tracer().set_old_tf(false);
    // The stepped context was preempted: the step times out on vCPU 0.
    for _ in 0..8 {
        g.with(|t, env, _| t.on_turn(env));
    }
    assert!(!g.tracer().debug_state().stepping);
    // The context resumes on vCPU 1: its #DB is root's, not the guest's.
    g.on = 1;
    assert!(g.tracer().wants_debug_exits());
    assert!(g.tracer().debug_state().stray_tf);
    g.tracer().clear_stray_tf();
    assert!(!g.tracer().wants_debug_exits());
    g.on = 0;
    assert!(!g.tracer().wants_debug_exits());
}

#[test]
fn a_fetch_from_hypervisor_memory_is_refused_without_a_step() {
    let mut g = Guest::new();
    let hv = loader::layout::HV_RESERVED.0 + 0x7000;
    // A fetch would fault again and again from a scratch page mapped
    // without execute: it gets no step.
    let v = g.with(|t, env, _| t.on_violation(hv, false, true, env));
    assert!(matches!(v, Violation::FetchRefused { ended_tf: None }));
    assert!(g.root.leaf(hv).is_none());
    assert!(!g.tracer().wants_debug_exits());
    // An instruction being stepped that runs on into hypervisor memory:
    // its step ends, with the guest's TF handed back.
    g.probe("p:a my_func").unwrap();
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), false, false, env));
    assert!(matches!(v, Violation::Stepping));
    g.tracer().set_old_tf(true);
    let v = g.with(|t, env, _| t.on_violation(hv, false, true, env));
    assert!(matches!(
        v,
        Violation::FetchRefused {
            ended_tf: Some(true)
        }
    ));
    assert!(!g.tracer().debug_state().stepping);
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.root.leaf(page).unwrap().perms, ept::EXEC);
}

#[test]
fn a_hit_the_heap_cannot_hold_is_lost_not_allocated() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.probe("p:s my_func s=+0(%di):string n=%si").unwrap();
    let name = STACK_BASE + 0x200;
    g.ram.put(gpa(name), b"a string\0");
    g.hit(FUNC, RETP, CALLER_RET, name);
    assert!(g.text().contains("s=\"a string\""));
    // The heap has room for less than one string at its longest: the hit
    // is lost and counted, and nothing is fetched.
    g.root.heap_room = 1024;
    g.hit(FUNC, RETP, CALLER_RET, name);
    g.root.heap_room = 64 << 20;
    let list = g.tracer().probe_list();
    assert_eq!((list[0].hits, list[0].misses), (1, 1), "{list:?}");
    assert_eq!(g.tracer().report().lost, 1);
    assert!(!g.text().contains("a string"));
}

#[test]
fn a_guest_access_to_hypervisor_memory_sees_scratch() {
    let mut g = Guest::new();
    let hv = loader::layout::HV_RESERVED.0 + 0x5000;
    let v = g.with(|t, env, _| t.on_violation(hv, true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let leaf = g.root.leaf(hv).unwrap();
    assert_eq!(leaf.perms, ept::READ | ept::WRITE);
    assert_eq!(g.root.frames[&leaf.hpa.0][..16], [0xcc; 16]);
    g.with(|t, env, _| t.finish_step(env));
    assert!(g.root.leaf(hv).is_none());
    assert_eq!(g.tracer().report().blocked_writes, 1);
    // Guest RAM that is nobody's is not the tracer's business.
    let v = g.with(|t, env, _| t.on_violation(RAM.0 + 0x10_0000, true, false, env));
    assert!(matches!(v, Violation::NotOurs));
}

#[test]
fn a_changed_region_pde_is_put_back_on_the_next_turn() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let pde = g.ram.word(PD + 511 * 8);
    g.ram.put(PD + 511 * 8, &0u64.to_le_bytes());
    g.with(|t, env, _| t.on_turn(env));
    assert_eq!(g.ram.word(PD + 511 * 8), pde);
    assert_eq!(g.tracer().report().region_restores, 1);
}

#[test]
fn deleting_the_last_probe_gives_the_page_back() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.probe("p:b other_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    assert_ne!(
        g.root.leaf(page).unwrap().hpa.0,
        page,
        "other_func still hooked"
    );
    g.with(|t, env, _| t.probe_del("kprobes/b", env)).unwrap();
    let leaf = g.root.leaf(page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (page, ept::RWX));
    assert_eq!(g.tracer().report().sites, 0);
    let e = g.with(|t, env, _| t.probe_del("a", env)).unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotFound);
}

// ----- the entry hypercall -----------------------------------------------

#[test]
fn a_probe_hit_fetches_its_arguments_and_renders_as_kprobe_events() {
    let mut g = Guest::new();
    g.probe("p:myprobe my_func x=%di").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 42);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, 0, "a NOP site has no call to chain to");
    let text = g.text();
    assert!(
        text.contains("sleeper-42")
            && text.contains("myprobe: (my_func+0x0/")
            && text.contains("x=0x2a"),
        "{text}"
    );
    let r = g.tracer().report();
    assert_eq!((r.hits, r.forged_entries), (1, 0));
    assert_eq!(g.tracer().probe_list()[0].hits, 1);
}

#[test]
fn a_guest_ftrace_call_at_the_site_is_chained_to() {
    let mut g = Guest::new();
    // The guest's own ftrace has turned the site into `call ftrace_caller`:
    // the hook keeps it, and each hit hands it back as the chain target.
    g.ram.put(gpa(FUNC), &call_bytes(FUNC, FTRACE_CALLER));
    g.probe("p:a my_func").unwrap();
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FTRACE_CALLER);
    assert_eq!(g.tracer().report().hits, 1);
}

#[test]
fn forged_entries_are_refused_and_not_counted_as_hits() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // RDI != RSP: not the trampoline's frame.
    let regs_at = RETP - 0x200;
    g.ram.put(gpa(regs_at), &pt_regs(FUNC + 5, RETP, 0));
    let (out, _) = g.entry_vmcall(regs_at, regs_at + 8, FUNC);
    assert!(matches!(out, Hypercall::Handled));
    // A site that is not hooked.
    let (_, rax) = g.entry_vmcall(regs_at, regs_at, OTHER);
    assert_eq!(rax, 0);
    // pt_regs whose ip is not this site's call.
    g.ram.put(gpa(regs_at), &pt_regs(OTHER + 5, RETP, 0));
    g.entry_vmcall(regs_at, regs_at, FUNC);
    let r = g.tracer().report();
    assert_eq!((r.hits, r.forged_entries), (0, 3));
    assert_eq!(g.text(), "");
    // A VMCALL from anywhere else is foreign: #UD.
    let mut regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        ..GuestRegs::default()
    };
    let cpu = g.cpu(regs_at);
    let out = g.with(|t, env, k| t.hypercall(env, FUNC, &mut regs, &cpu, Some(k), 0));
    assert!(matches!(out, Hypercall::Foreign));
    assert_eq!(g.tracer().report().foreign_vmcalls, 1);
    // Every one of the four hypercalls is counted for vCPU 0, as refused.
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.returns, c.refused), (0, 0, 4));
}

#[test]
fn each_hypercall_says_once_what_it_was_for_roots_time() {
    use crate::stats::RootWork;
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.cpus[0].take_served(), None);
    // RDI != RSP: forged.
    g.entry_vmcall(RETP - 0x200, RETP - 0x1f8, FUNC);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Refused));
    // A return with no frame: an orphan, refused too.
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Refused));
}

#[test]
fn the_function_tracer_records_function_and_parent() {
    let mut g = Guest::new();
    let added = g
        .with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    assert_eq!((added.traced, added.skipped_total), (2, 0));
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(OTHER, RETP, CALLER_RET, 0);
    let text = g.text();
    assert!(text.contains("other_func <-caller"), "{text}");
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
}

#[test]
fn a_hits_stack_reads_share_one_walk_until_the_turn() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The frame and the parent are on one stack page: one walk, then the
    // parent through the cached leaf.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (1, 1));
    // The next hit walks nothing.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (3, 1));
    // A turn forgets it.
    g.with(|t, env, _| t.on_turn(env));
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].walks.counts(), (4, 2));
    let text = g.text();
    assert_eq!(text.matches("my_func <-caller").count(), 3, "{text}");
}

#[test]
fn a_count_counts_calls_in_root_records_nothing_and_keeps_other_uses() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into(), "other_*".into()],
        ..Default::default()
    };
    let added = g
        .with(|t, env, k| t.count_start(&filter, k, env, 1_000))
        .unwrap();
    assert_eq!((added.traced, added.skipped_total), (2, 0));
    // One count at a time.
    let again = g.with(|t, env, k| t.count_start(&filter, k, env, 1_000));
    assert_eq!(again.unwrap_err().kind, protocol::ErrorKind::AlreadyExists);
    for _ in 0..3 {
        g.hit(FUNC, RETP, CALLER_RET, 0);
    }
    g.hit(OTHER, RETP, CALLER_RET, 0);
    assert_eq!(g.text(), "", "a count records no event");
    assert_eq!(g.tracer().report().hits, 4);
    let read = |g: &mut Guest, cursor, limit| {
        g.with(|t, _, k| t.count_read(cursor, limit, k, 5_000))
            .unwrap()
    };
    let page = read(&mut g, 0, 100);
    let got: Vec<(String, u64)> = page
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.calls))
        .collect();
    assert_eq!(
        got,
        [("my_func".to_string(), 3), ("other_func".to_string(), 1)]
    );
    assert_eq!((page.functions, page.calls, page.filtered), (2, 4, 0));
    assert_eq!((page.elapsed_ns, page.next), (4_000, None));
    assert!(page.memory > 0);
    // Paged a function at a time, in address order.
    let first = read(&mut g, 0, 1);
    assert_eq!(first.entries.len(), 1);
    let second = read(&mut g, first.next.unwrap(), 1);
    assert_eq!(second.entries[0].name, "other_func");
    assert_eq!(second.next, None);

    // The function tracer on a counted function records, and counts go on.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(g.text().contains("my_func <-caller"));
    assert_eq!(read(&mut g, 0, 100).calls, 5);
    // Stopping the count keeps the function tracer's site, drops the rest.
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 1);
    let gone = g.with(|t, _, k| t.count_read(0, 10, k, 0).map(|_| ()));
    assert_eq!(gone.unwrap_err().kind, protocol::ErrorKind::NotFound);
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
}

impl Guest {
    /// Lays out an entry as [`Guest::hit`] does (ip = `ip`) and offers it
    /// to the fast path with the exit's `cpl`, RIP `rip` (the entry VMCALL
    /// when `None`), RAX `nr` and RSP = RDI = the frame; the chain target
    /// when served.
    fn fast(&mut self, func: u64, ip: u64, cpl: u8, rip: Option<u64>, nr: u32) -> Option<u64> {
        let regs_at = RETP - trampolines::abi::ENTRY_SP_FROM_FRAME;
        self.ram.put(gpa(RETP), &CALLER_RET.to_le_bytes());
        self.ram.put(gpa(RETP - 8), &ip.to_le_bytes());
        self.ram.put(gpa(regs_at), &pt_regs(ip, RETP, 0));
        let rip = rip.unwrap_or_else(|| self.region().entry_vmcall().unwrap().0);
        let regs = GuestRegs {
            rax: u64::from(nr),
            rdi: regs_at,
            rsi: func,
            ..GuestRegs::default()
        };
        let exit = super::FastExit {
            rip,
            cpl,
            rsp: regs_at,
        };
        self.fast_exit(exit, &regs)
    }

    /// The fast path on `exit` and `regs` as given.
    fn fast_exit(&mut self, exit: super::FastExit, regs: &GuestRegs) -> Option<u64> {
        let now = self.now_ns;
        Hit::new(&self.vm, &mut self.cpus[self.on]).fast_entry(
            &self.door,
            &self.kernel,
            exit,
            regs,
            gs_of_vcpu0,
            || now,
        )
    }

    /// The calls the count has, over every function.
    fn counted(&mut self) -> u64 {
        self.with(|t, _, k| t.count_read(0, 100, k, 0))
            .unwrap()
            .calls
    }
}

/// vCPU 0's GS base, as root's lazy GUEST_GS_BASE read gives it.
fn gs_of_vcpu0() -> u64 {
    GS_BASES[0]
}

#[test]
fn the_fast_path_reads_the_gs_base_once_a_turn() {
    static READS: AtomicU64 = AtomicU64::new(0);
    fn gs() -> u64 {
        READS.fetch_add(1, SeqCst);
        GS_BASES[0]
    }
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    let regs_at = RETP - trampolines::abi::ENTRY_SP_FROM_FRAME;
    g.ram.put(gpa(RETP), &CALLER_RET.to_le_bytes());
    g.ram.put(gpa(regs_at), &pt_regs(FUNC + 5, RETP, 0));
    let regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        rdi: regs_at,
        rsi: FUNC,
        ..GuestRegs::default()
    };
    let exit = super::FastExit {
        rip: g.region().entry_vmcall().unwrap().0,
        cpl: 0,
        rsp: regs_at,
    };
    let fast = |g: &mut Guest| {
        let (door, k) = (&g.door, &g.kernel);
        Hit::new(&g.vm, &mut g.cpus[0]).fast_entry(door, k, exit, &regs, gs, || 0)
    };
    for _ in 0..3 {
        assert_eq!(fast(&mut g), Some(0));
    }
    assert_eq!(
        READS.load(SeqCst),
        1,
        "one GUEST_GS_BASE read for the turn's hits"
    );
    assert_eq!(g.cpus[0].kernel_gs(), Some(GS_BASES[0]));
    g.with(|t, env, _| t.on_turn(env));
    assert_eq!(g.cpus[0].kernel_gs(), None, "forgotten at the turn");
    assert_eq!(fast(&mut g), Some(0));
    assert_eq!(READS.load(SeqCst), 2);
    // Each record names the task the GS base leads to.
    let text = g.text();
    assert_eq!(text.matches("sleeper-42").count(), 4, "{text}");
}

#[test]
fn the_fast_path_serves_counts_probes_and_functions_as_the_general_path_would() {
    use crate::stats::RootWork;
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The guest's own ftrace calls at FUNC: the chain target comes back.
    g.ram.put(gpa(FUNC), &call_bytes(FUNC, FTRACE_CALLER));
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into(), "other_*".into()],
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    assert_eq!(
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY),
        Some(FTRACE_CALLER)
    );
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), Some(0));
    // Served as the general path serves the same entry.
    let (out, rax) = g.hit(FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FTRACE_CALLER);
    assert_eq!(g.cpus[0].take_served(), Some(RootWork::Hit));
    assert_eq!(g.counted(), 3);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (3, 0));
    assert_eq!(g.tracer().report().hits, 3);
    assert_eq!(g.text(), "", "a count records no event");

    // Everything else is left to the general path, with nothing counted.
    let entry = g.region().entry_vmcall().unwrap().0;
    let ret = g.region().return_vmcall().unwrap().0;
    let refused = [
        // User mode.
        g.fast(FUNC, FUNC + 5, 3, None, HYPERCALL_ENTRY),
        // Another VMCALL: the return trampoline's, or one of the guest's.
        g.fast(FUNC, FUNC + 5, 0, Some(ret), HYPERCALL_ENTRY),
        g.fast(FUNC, FUNC + 5, 0, Some(entry + 3), HYPERCALL_ENTRY),
        // The wrong number.
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_RETURN),
        // A site nobody hooked.
        g.fast(CALLER, CALLER + 5, 0, None, HYPERCALL_ENTRY),
        // A frame whose ip is not the site's call: forged.
        g.fast(FUNC, OTHER + 5, 0, None, HYPERCALL_ENTRY),
    ];
    assert_eq!(refused, [None; 6]);
    assert_eq!(g.cpus[0].take_served(), None);
    // RDI that is not RSP.
    let mut regs = GuestRegs {
        rax: u64::from(HYPERCALL_ENTRY),
        rdi: RETP - 0x200,
        rsi: FUNC,
        ..GuestRegs::default()
    };
    let exit = super::FastExit {
        rip: entry,
        cpl: 0,
        rsp: RETP - 0x1f8,
    };
    assert_eq!(g.fast_exit(exit, &regs), None);
    // A frame that does not read (outside the guest's tables).
    regs.rdi = 0xffff_c900_0000_0000;
    let exit = super::FastExit {
        rsp: regs.rdi,
        ..exit
    };
    assert_eq!(g.fast_exit(exit, &regs), None);
    assert_eq!(g.counted(), 3);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (3, 0));
    assert_eq!(g.text(), "");

    // The function tracer and a probe with no argument on counted sites:
    // served, each recording what the general path records.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    g.probe("p:plain other_func").unwrap();
    assert_eq!(
        g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY),
        Some(FTRACE_CALLER)
    );
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), Some(0));
    let fast_text = g.text();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(OTHER, RETP, CALLER_RET, 0);
    let general_text = g.text();
    assert!(fast_text.contains("my_func <-caller"), "{fast_text}");
    assert!(fast_text.contains("plain: (other_func+0x0/"), "{fast_text}");
    assert!(fast_text.contains("sleeper-42"), "{fast_text}");
    assert_eq!(
        fast_text, general_text,
        "the fast path records as the general one"
    );
    assert_eq!(g.counted(), 7);
    assert_eq!(g.tracer().probe_list()[0].hits, 2);
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.refused), (7, 0));

    // A probe that fetches reads registers: general.
    g.probe("p:args other_func x=%di").unwrap();
    assert_eq!(g.fast(OTHER, OTHER + 5, 0, None, HYPERCALL_ENTRY), None);
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    // A count with a filter reads the task: general.
    let filtered = protocol::CountFilter {
        comm: Some("sleeper".into()),
        ..filter.clone()
    };
    g.with(|t, env, k| t.count_start(&filtered, k, env, 0))
        .unwrap();
    assert_eq!(g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY), None);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.counted(), 1);
    // A count that times its calls takes their returns: general.
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    let timed = protocol::CountFilter {
        latency: true,
        ..filter
    };
    g.with(|t, env, k| t.count_start(&timed, k, env, 0))
        .unwrap();
    assert_eq!(g.fast(FUNC, FUNC + 5, 0, None, HYPERCALL_ENTRY), None);
}

#[test]
fn a_count_with_latency_times_each_call_through_its_return() {
    let mut g = Guest::new();
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into()],
        comm: Some("sleeper".into()),
        latency: true,
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    // Three calls of 1, 1000 and 5000 ns; a fourth by another task is
    // neither counted nor hijacked.
    for d in [1u64, 1000, 5000] {
        g.now_ns += 10_000;
        g.hit(FUNC, RETP, CALLER_RET, 0);
        let tramp = g.region().return_trampoline().0;
        assert_eq!(g.ram.word(gpa(RETP)), tramp, "the return is hijacked");
        g.now_ns += d;
        let (_, rax) = g.ret(RETP, 0);
        assert_eq!(rax, CALLER_RET, "the call returns to its caller");
    }
    let me = g.kernel.running.comm;
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(
        g.ram.word(gpa(RETP)),
        CALLER_RET,
        "a left-out call is not hijacked"
    );
    g.kernel.running.comm = me;
    let page = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((page.calls, page.filtered, page.latency_missed), (3, 1, 0));
    // 1 ns: bucket 1; 1000 ns: bucket 10 (512..1023); 5000: 13 (4096..8191).
    let mut want = vec![0u64; 14];
    want[1] = 1;
    want[10] = 1;
    want[13] = 1;
    assert_eq!(page.latency, want);
    assert_eq!(super::count::latency_bucket(0), 0);
    assert_eq!(super::count::latency_bucket(u64::MAX), 63);
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.graph_frames), (0, 0));
}

#[test]
fn a_histogram_buckets_a_fetch_argument_by_key_in_bounded_rows() {
    let mut g = Guest::new();
    let hist = |key| protocol::CountFilter {
        hist: Some(protocol::HistFilter {
            spec: "p my_func n=%di:u64".into(),
            key,
        }),
        ..Default::default()
    };
    g.with(|t, env, k| t.count_start(&hist(protocol::HistKey::Comm), k, env, 0))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    for n in [512, 512, 4096, 0] {
        g.hit(FUNC, RETP, CALLER_RET, n);
    }
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 1);
    assert_eq!(g.text(), "", "a histogram records no event");
    let page = g.with(|t, _, k| t.hist_read(0, k)).unwrap();
    let rows: Vec<(String, Vec<u64>)> = page
        .rows
        .iter()
        .map(|r| (r.key.clone(), r.buckets.clone()))
        .collect();
    let mut sleeper = vec![0u64; 14];
    sleeper[0] = 1; // 0
    sleeper[10] = 2; // 512..1023
    sleeper[13] = 1; // 4096..8191
    assert_eq!(
        rows,
        [
            ("sleeper".to_string(), sleeper),
            ("other".to_string(), vec![0, 1])
        ]
    );
    assert_eq!((page.overflow, page.faults, page.next), (0, 0, None));
    g.with(|t, env, _| t.count_stop(env)).unwrap();

    // By pid: more pids than rows, the rest counted as overflow.
    g.with(|t, env, k| t.count_start(&hist(protocol::HistKey::Pid), k, env, 0))
        .unwrap();
    let keys = super::count::HIST_KEYS as i32;
    for pid in 0..keys + 3 {
        g.kernel.running.pid = 1000 + pid;
        g.hit(FUNC, RETP, CALLER_RET, 8);
    }
    let mut rows = Vec::new();
    let mut cursor = 0;
    let last = loop {
        let page = g.with(|t, _, k| t.hist_read(cursor, k)).unwrap();
        rows.extend(page.rows.iter().map(|r| r.key.clone()));
        match page.next {
            Some(n) => cursor = n,
            None => break page,
        }
    };
    assert_eq!(rows.len(), super::count::HIST_KEYS, "paged to the end");
    assert_eq!(rows[0], "1000");
    assert_eq!(last.overflow, 3);
    g.with(|t, env, _| t.count_stop(env)).unwrap();

    // A histogram takes an entry probe with an argument, and no globs.
    for (spec, globs) in [
        ("r my_func $retval", vec![]),
        ("p my_func", vec![]),
        ("p my_func n=%di", vec!["other_*".to_string()]),
        ("p: bad", vec![]),
        ("p my_func s=+0(%di):string n=%si", vec![]),
        ("p my_func s=$comm", vec![]),
        ("p my_func s=%di:symstr", vec![]),
    ] {
        let mut f = hist(protocol::HistKey::Function);
        f.functions = globs;
        if let Some(h) = f.hist.as_mut() {
            h.spec = spec.into();
        }
        let e = g
            .with(|t, env, k| t.count_start(&f, k, env, 0))
            .unwrap_err();
        assert_eq!(
            e.kind,
            protocol::ErrorKind::InvalidArgument,
            "{spec}: {}",
            e.message
        );
        if spec.contains("s=") {
            assert!(e.message.contains("is a string"), "{spec}: {}", e.message);
        }
    }
    assert_eq!(g.tracer().report().sites, 0);
}

#[test]
fn a_counts_comm_filter_counts_the_others_apart() {
    let mut g = Guest::new();
    let filter = protocol::CountFilter {
        functions: vec!["my_func".into()],
        comm: Some("sleeper".into()),
        ..Default::default()
    };
    let name = g.kernel.running.comm;
    assert!(name.starts_with(b"sleeper"), "the test task is sleeper");
    g.with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    let page = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((page.calls, page.filtered), (1, 2));
    for bad in ["", "sixteen_bytes_xx"] {
        let f = protocol::CountFilter {
            functions: vec!["my_func".into()],
            comm: Some(bad.into()),
            ..Default::default()
        };
        g.with(|t, env, _| t.count_stop(env)).ok();
        let e = g
            .with(|t, env, k| t.count_start(&f, k, env, 0))
            .unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument, "{bad:?}");
    }
    let none = protocol::CountFilter::default();
    let e = g
        .with(|t, env, k| t.count_start(&none, k, env, 0))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument);
}

#[test]
fn hits_on_two_vcpus_are_merged_by_time_with_the_guests_cpu_numbers() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Json));
    // vCPU 1 stores two hits before vCPU 0 stores the one between them.
    for (on, now) in [(1, 10_000), (1, 30_000), (0, 20_000)] {
        g.on = on;
        g.now_ns = now;
        g.hit(OTHER, RETP, CALLER_RET, 0);
    }
    g.on = 0;
    let text = g.text();
    let got: Vec<(u64, u64)> = text
        .lines()
        .map(|l| {
            let num = |key: &str| -> u64 {
                let at = l.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
                let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
                digits.parse().unwrap()
            };
            (num("ts_ns"), num("cpu"))
        })
        .collect();
    // Oldest first, each with the guest's number for its vCPU.
    assert_eq!(
        got,
        [
            (10_000, u64::from(GUEST_CPU[1])),
            (20_000, u64::from(GUEST_CPU[0])),
            (30_000, u64::from(GUEST_CPU[1]))
        ],
        "{text}"
    );
    // Losses are each vCPU's own.
    assert_eq!((g.vm.lost_of(0), g.vm.lost_of(1)), (0, 0));
}

#[test]
fn a_step_opens_the_page_in_its_own_vcpus_view_only() {
    let mut g = Guest::new();
    g.probe("p:a my_func").unwrap();
    let page = gpa(FUNC) & !0xfff;
    let shadow = g.root.leaf_in(0, page).unwrap();
    assert_eq!(
        (shadow.hpa, shadow.perms),
        (g.root.leaf_in(1, page).unwrap().hpa, ept::EXEC),
        "a hook is in every view"
    );
    // vCPU 1 writes the page: its view opens the guest's frame...
    g.on = 1;
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, TEXT + 0x8000);
    g.ram.put(gpa(OTHER), &theirs);
    let mine = g.root.leaf_in(1, page).unwrap();
    assert_eq!((mine.hpa.0, mine.perms), (page, ept::RWX));
    // ... while vCPU 0 keeps executing the shadow, with no step of its own.
    let other = g.root.leaf_in(0, page).unwrap();
    assert_eq!((other.hpa, other.perms), (shadow.hpa, ept::EXEC));
    g.on = 0;
    assert!(!g.tracer().wants_debug_exits());
    // The step ends on vCPU 1: both views execute the resynced shadow.
    g.on = 1;
    g.with(|t, env, _| t.finish_step(env));
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, page).unwrap();
        assert_eq!((l.hpa, l.perms), (shadow.hpa, ept::EXEC), "view {view}");
    }
    assert_eq!(
        g.root.frames[&shadow.hpa.0][(OTHER & 0xfff) as usize..][..5],
        theirs
    );
    // Unhooking returns the page to the guest in every view.
    g.on = 0;
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, page).unwrap();
        assert_eq!((l.hpa.0, l.perms), (page, ept::RWX), "view {view}");
    }
}

#[test]
fn a_site_any_vcpu_is_inside_is_not_patched() {
    let mut g = Guest::new();
    // vCPU 1 was stopped with its RIP inside my_func's site.
    g.root.rips = vec![0, FUNC + 2];
    let e = g
        .with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap_err();
    assert!(e.message.contains("inside the site"), "{e:?}");
    assert_eq!(g.tracer().report().sites, 0);
    g.root.rips = vec![0, FUNC + 5];
    g.with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap();
}

#[test]
fn nothing_changes_when_the_other_vcpus_do_not_come() {
    let mut g = Guest::new();
    g.root.others_come = false;
    let e = g
        .with(|t, env, k| t.probe_add("p:a my_func", k, env))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    let e = g
        .with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    let r = g.tracer().report();
    assert_eq!((r.sites, r.pages, r.trampolines), (0, 0, 0));
    for view in 0..VCPUS {
        let l = g.root.leaf_in(view, gpa(FUNC) & !0xfff).unwrap();
        assert_eq!(l.hpa.0, gpa(FUNC) & !0xfff, "view {view}");
    }
    // They come: the probe is made; they do not: its deletion is refused
    // and it stays.
    g.root.others_come = true;
    g.probe("p:a my_func").unwrap();
    g.root.others_come = false;
    let e = g.with(|t, env, _| t.probe_del("a", env)).unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotReady, "{e:?}");
    assert_eq!(g.tracer().report().sites, 1);
    assert_eq!(g.tracer().probe_list().len(), 1);
}

// ----- function graph ----------------------------------------------------

fn graph(functions: &[&str]) -> GraphFilter {
    GraphFilter {
        functions: functions.iter().map(|s| s.to_string()).collect(),
        trace: vec!["*_func".into()],
        ..GraphFilter::default()
    }
}

#[test]
fn graph_entry_hijacks_the_return_and_the_return_gives_it_back() {
    let mut g = Guest::new();
    let started = g
        .with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    assert_eq!((started.session, started.hooked, started.roots), (1, 2, 1));
    g.tracer().set_stream(Some(TraceFormat::Text));
    let tramp = g.region().return_trampoline().0;

    // Entry: the return slot now holds the return trampoline; one frame.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), tramp);
    let r = g.tracer().report();
    assert_eq!((r.graph_stacks, r.graph_frames), (1, 1));
    // A nested call of other_func, lower on the same stack.
    g.now_ns += 1_000;
    let inner = RETP - 0x100;
    g.hit(OTHER, inner, FUNC + 0x40, 0);
    assert_eq!(g.ram.word(gpa(inner)), tramp);
    assert_eq!(g.tracer().report().graph_frames, 2);

    // Returns, innermost first: each hands back its own return address.
    g.now_ns += 2_000;
    let (out, rax) = g.ret(inner, 7);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, FUNC + 0x40);
    g.now_ns += 3_000;
    let (_, rax) = g.ret(RETP, 0);
    assert_eq!(rax, CALLER_RET);
    assert_eq!(
        g.cpus[0].take_served(),
        Some(crate::stats::RootWork::Return)
    );
    let r = g.tracer().report();
    assert_eq!((r.graph_stacks, r.graph_frames), (0, 0));

    let text = g.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].ends_with("|  my_func() {"), "{text}");
    assert!(
        lines[1].contains("2.000 us") && lines[1].ends_with("|    other_func();"),
        "{text}"
    );
    assert!(
        lines[2].contains("6.000 us") && lines[2].ends_with("|  }"),
        "{text}"
    );
    // A return with no frame is an orphan: #UD.
    let (out, _) = g.ret(RETP, 0);
    assert!(matches!(out, Hypercall::Foreign));
    assert_eq!(g.tracer().report().graph_orphans, 1);
    // Two entries recorded, two returns handed back, the orphan refused.
    let c = g.vm.hypercalls_of(0, 0);
    assert_eq!((c.hits, c.returns, c.refused), (2, 2, 1));
}

#[test]
fn a_max_depth_1_session_hooks_only_its_roots() {
    let mut g = Guest::new();
    // The default trace set is every function: with max_depth 1 under a
    // root, none of it is hooked.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        max_depth: 1,
        ..GraphFilter::default()
    };
    let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    assert_eq!((started.hooked, started.roots), (1, 1));
    assert_eq!(g.tracer().report().sites, 1);
    g.tracer().set_stream(Some(TraceFormat::Text));
    let tramp = g.region().return_trampoline().0;
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), tramp);
    g.now_ns += 4_000;
    assert_eq!(g.ret(RETP, 0).1, CALLER_RET);
    let text = g.text();
    assert!(
        text.lines().count() == 1 && text.contains("4.000 us") && text.ends_with("|  my_func();\n"),
        "{text}"
    );
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    // max_depth 2, or no roots: the trace set is hooked as before.
    for f in [
        GraphFilter {
            functions: vec!["my_func".into()],
            max_depth: 2,
            ..GraphFilter::default()
        },
        GraphFilter {
            max_depth: 1,
            ..GraphFilter::default()
        },
    ] {
        let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
        assert!(started.hooked >= 3, "{}", started.hooked);
        g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    }
}

#[test]
fn calls_outside_the_roots_are_not_hijacked() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(OTHER, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET);
    assert_eq!(g.tracer().report().graph_frames, 0);
}

#[test]
fn max_depth_and_comm_filters_apply_at_the_root() {
    let mut g = Guest::new();
    let mut f = graph(&["my_func"]);
    f.max_depth = 1;
    f.comm = Some("sleeper".into());
    g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(OTHER, RETP - 0x100, FUNC + 0x40, 0);
    assert_eq!(g.tracer().report().graph_frames, 1, "depth 1 only");
    assert_eq!(g.ram.word(gpa(RETP - 0x100)), FUNC + 0x40);
    g.ret(RETP, 0);

    g.kernel.running.comm = *b"other\0\0\0\0\0\0\0\0\0\0\0";
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 0, "comm does not match");
}

#[test]
fn a_return_probe_sees_the_return_value() {
    let mut g = Guest::new();
    g.probe("r:myret my_func ret=$retval").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 1);
    let (_, rax) = g.ret(RETP, 0x1234);
    assert_eq!(rax, CALLER_RET);
    let text = g.text();
    assert!(
        text.contains("myret: (caller+0x15/0x1000 <- my_func)") && text.contains("ret=0x1234"),
        "{text}"
    );
}

#[test]
fn the_reaper_drops_the_stacks_of_dead_tasks_only() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.tracer().report().graph_frames, 1);
    let cpu = g.cpu(RETP);
    let reap = |g: &mut Guest| {
        g.now_ns += 1_000_000_000;
        Tracer::new(&mut g.vm, &mut g.cpus[0]).reap(Some(&g.kernel), &cpu, g.now_ns);
        let r = g.tracer().report();
        (r.graph_frames, r.graph_reaped)
    };
    // Alive (its stack is still its own) and running: kept.
    assert_eq!(reap(&mut g), (1, 0));
    // Its task_struct no longer points at the stack, but it is the task
    // running: kept.
    g.kernel.task_stacks.insert(TASK, 0);
    assert_eq!(reap(&mut g), (1, 0));
    // Another task runs, and the dead one's task_struct is unreadable:
    // not known dead, kept.
    g.kernel.running.task = TASK + 0x4000;
    g.kernel.task_stacks.remove(&TASK);
    assert_eq!(reap(&mut g), (1, 0));
    // Its stack pointer is cleared: its frames go.
    g.kernel.task_stacks.insert(TASK, 0);
    assert_eq!(reap(&mut g), (0, 1));
}

#[test]
fn graph_stop_keeps_frames_in_flight_returning() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    assert_eq!(g.tracer().report().sites, 0);
    // The hijacked return still comes back, and is handed its address.
    let (out, rax) = g.ret(RETP, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(rax, CALLER_RET);
}

/// A task's kernel stack for the second vCPU, below the first's.
const STACK_BASE_2: u64 = STACK_BASE - 0x4000;

#[test]
fn hits_on_two_vcpus_run_at_once_over_the_shared_state() {
    // The tracer's VM state is what root shares between the hits of its
    // vCPUs: it must be `Sync` as a type, not by root's say-so.
    fn sync<T: Sync>(_: &T) {}
    let mut g = Guest::new();
    sync(&g.vm);
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.with(|t, env, k| t.graph_start(graph(&["other_func"]), k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Json));
    let region = g.region();
    let entry_rip = region.entry_vmcall().unwrap().0;
    let return_rip = region.return_vmcall().unwrap().0;
    let tramp = region.return_trampoline().0;
    // Two vCPUs in two threads, each a task on its own kernel stack,
    // calling other_func N times: entry, then return, each time with a
    // nested call of my_func on top half of the time.
    const N: u64 = 1500;
    let clock = AtomicU64::new(1_000_000_000);
    let (vm, door, kernel, ram) = (&g.vm, &g.door, &g.kernel, g.ram);
    std::thread::scope(|s| {
        for (on, cpu_state) in g.cpus.iter_mut().enumerate() {
            let clock = &clock;
            s.spawn(move || {
                let mut root = FakeRoot::new();
                root.me = on;
                let base = [STACK_BASE, STACK_BASE_2][on];
                // One VMCALL of this vCPU at `rip` with RSP `rsp` and
                // RAX, RDI, RSI as given: its outcome and the RAX back.
                let vmcall = |root: &mut FakeRoot,
                              cpu_state: &mut CpuState,
                              rip: u64,
                              rsp: u64,
                              [rax, rdi, rsi]: [u64; 3]| {
                    let mut regs = GuestRegs {
                        rax,
                        rdi,
                        rsi,
                        ..GuestRegs::default()
                    };
                    let cpu = CpuView {
                        cr3: PML4,
                        rsp,
                        gs_base: GuestGs::known(GS_BASES[on]),
                        ..CpuView::default()
                    };
                    let mut env = Env { ram: door, m: root };
                    let now = clock.fetch_add(10, SeqCst);
                    let out = Hit::new(vm, cpu_state).hypercall(
                        &mut env,
                        rip,
                        &mut regs,
                        &cpu,
                        Some(kernel),
                        now,
                    );
                    (out, regs.rax)
                };
                let call = |root: &mut FakeRoot,
                            cpu_state: &mut CpuState,
                            func: u64,
                            retp: u64,
                            ret: u64,
                            i: u64| {
                    ram.put(gpa(retp), &ret.to_le_bytes());
                    ram.put(gpa(retp - 8), &(func + 5).to_le_bytes());
                    let regs_at = retp - trampolines::abi::ENTRY_SP_FROM_FRAME;
                    ram.put(gpa(regs_at), &pt_regs(func + 5, retp, i));
                    let regs = [u64::from(HYPERCALL_ENTRY), regs_at, func];
                    let (out, _) = vmcall(root, cpu_state, entry_rip, regs_at, regs);
                    assert!(matches!(out, Hypercall::Handled));
                    assert_eq!(ram.word(gpa(retp)), tramp, "vCPU {on} call {i}");
                };
                let ret = |root: &mut FakeRoot, cpu_state: &mut CpuState, retp: u64, i: u64| {
                    let frame = retp - RETURN_FRAME_RETP as u64;
                    let regs = [u64::from(HYPERCALL_RETURN), frame, i];
                    let (out, rax) = vmcall(root, cpu_state, return_rip, retp, regs);
                    assert!(matches!(out, Hypercall::Handled), "vCPU {on} return {i}");
                    rax
                };
                let outer = base + 0x3f00;
                let inner = outer - 0x100;
                for i in 0..N {
                    call(&mut root, cpu_state, OTHER, outer, CALLER_RET, i);
                    if i % 2 == 0 {
                        call(&mut root, cpu_state, FUNC, inner, OTHER + 0x40, i);
                        assert_eq!(ret(&mut root, cpu_state, inner, i), OTHER + 0x40);
                    }
                    assert_eq!(ret(&mut root, cpu_state, outer, i), CALLER_RET);
                }
            });
        }
    });
    let r = g.tracer().report();
    assert_eq!(r.hits, 2 * (N + N / 2));
    // Each vCPU's hypercalls: its entries and its returns, nothing else.
    for i in 0..2 {
        let c = g.vm.hypercalls_of(i, 0);
        assert_eq!((c.hits, c.returns, c.refused), (N + N / 2, N + N / 2, 0));
    }
    assert_eq!((r.graph_stacks, r.graph_frames), (0, 0));
    assert_eq!(
        (r.graph_misses, r.graph_dropped, r.graph_orphans),
        (0, 0, 0)
    );
    assert_eq!((g.vm.lost_of(0), g.vm.lost_of(1)), (0, 0));
    // Every record, merged oldest first, with the guest's CPU numbers:
    // per CPU, N + N/2 function-tracer lines and the graph's entries and
    // returns of other_func's trees (my_func nested in half of them).
    let text = g.text();
    let mut last_ts = 0;
    let mut per_cpu = BTreeMap::<u64, u64>::new();
    for l in text.lines() {
        let num = |key: &str| -> u64 {
            let at = l.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().unwrap()
        };
        let ts = num("ts_ns");
        assert!(ts >= last_ts, "out of order at {l}");
        last_ts = ts;
        *per_cpu.entry(num("cpu")).or_default() += 1;
    }
    let each = (N + N / 2) * 3;
    assert_eq!(
        per_cpu,
        BTreeMap::from([
            (u64::from(GUEST_CPU[0]), each),
            (u64::from(GUEST_CPU[1]), each)
        ]),
        "{}",
        text.lines().take(8).collect::<Vec<_>>().join("\n")
    );
}

// ----- modules that come and go ----------------------------------------

/// The module list as the kernel has it while `hvtarget` is coming: its
/// init text still in place, with `hvtarget_init` there.
fn modules_coming() -> guest_introspect::module::ModuleIndex {
    use guest_introspect::module::{ModuleIndex, ModuleStates, ModuleSymbol};
    let idx = modules(true);
    let states = ModuleStates {
        live: 0,
        coming: 1,
        going: 2,
        unformed: 3,
    };
    let mut list = idx.modules().to_vec();
    list[0].init_text = GvaRange::with_len(Gva(MOD_INIT_TEXT), 0x1000);
    list[0].symbols.push(ModuleSymbol {
        addr: MOD_INIT_FUNC,
        kind: b't',
        name: "hvtarget_init".into(),
    });
    ModuleIndex::new(list, states).unwrap()
}

/// The module list as the kernel has it with `hvtarget` loaded (or not).
fn modules(loaded: bool) -> guest_introspect::module::ModuleIndex {
    use guest_introspect::module::{Module, ModuleIndex, ModuleStates, ModuleSymbol};
    let states = ModuleStates {
        live: 0,
        coming: 1,
        going: 2,
        unformed: 3,
    };
    let list = if loaded {
        vec![Module {
            addr: Gva(MOD_STRUCT),
            name: "hvtarget".into(),
            state: states.coming,
            text: GvaRange::with_len(Gva(MOD_TEXT), 0x1000),
            init_text: GvaRange::new(Gva(0), Gva(0)),
            symbols: vec![ModuleSymbol {
                addr: MOD_FUNC,
                kind: b't',
                name: "hvtarget_sum".into(),
            }],
        }]
    } else {
        Vec::new()
    };
    ModuleIndex::new(list, states).unwrap()
}

impl Guest {
    /// The guest calls the kernel function `func` with `struct module *`
    /// `module`; the hidden hook there notes the event, which the exit
    /// handler then serves (with the module list as the kernel now has
    /// it). Returns the event seen.
    fn module_call(&mut self, func: u64, module: u64) -> Option<super::modules::ModuleEvent> {
        let (out, _) = self.hit(func, RETP, CALLER_RET, module);
        assert!(matches!(out, Hypercall::Handled));
        let ev = self.cpus[self.on].take_module_event()?;
        self.with(|t, env, k| t.module_event(ev, k, env));
        Some(ev)
    }

    fn sites_and_pages(&mut self) -> (u32, u32, u32) {
        let r = self.tracer().report();
        (r.sites, r.pages, r.module_hooks)
    }
}

#[test]
fn a_probe_on_a_module_not_loaded_is_armed_at_its_load_and_pending_again_at_its_unload() {
    use super::modules::{ModuleEvent, ModuleHook};
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // Pending: nothing of the module is hooked, but root's own hooks on
    // do_init_module and free_module are in.
    let (name, site) = g.probe("p:ms hvtarget:hvtarget_sum n=%di").unwrap();
    assert_eq!((name.as_str(), site), ("kprobes/ms", 0));
    let list = g.tracer().probe_list();
    assert!(list[0].pending && list[0].site == 0, "{list:?}");
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    assert_eq!(g.tracer().report().pending_probes, 1);
    let mod_page = gpa(MOD_FUNC) & !0xfff;
    assert!(g.root.leaf(mod_page).is_none_or(|l| l.hpa.0 == mod_page));
    // An unknown symbol of a loaded module is an error, not pending.
    g.kernel.modules = modules(true);
    let e = g.probe("p:nosuch hvtarget:hvtarget_nosuch").unwrap_err();
    assert_eq!(e.kind, protocol::ErrorKind::NotFound);
    assert!(e.message.contains("hvtarget_nosuch") && !e.message.contains('\n'));
    g.kernel.modules = modules(false);

    for round in 0..20u64 {
        // The module loads: the hook on do_init_module sees it before its
        // init runs, and the probe is armed at once.
        g.kernel.modules = modules(true);
        let ev = g.module_call(DO_INIT_MODULE, MOD_STRUCT);
        assert_eq!(
            ev,
            Some(ModuleEvent {
                hook: ModuleHook::Load,
                module: MOD_STRUCT
            })
        );
        let list = g.tracer().probe_list();
        assert!(!list[0].pending && list[0].site == MOD_FUNC, "{list:?}");
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
        let leaf = g.root.leaf(mod_page).unwrap();
        assert_eq!(leaf.perms, ept::EXEC);
        let shadow = g.root.frames[&leaf.hpa.0].clone();
        let off = (MOD_FUNC & 0xfff) as usize;
        assert_eq!(
            shadow[off..off + 5],
            call_bytes(MOD_FUNC, g.region().entry().0)
        );
        // Its init calls the function: the probe fires, shown as the
        // module's.
        g.hit(MOD_FUNC, RETP, CALLER_RET, 3 + round);
        let text = g.text();
        assert!(
            text.contains("ms: (hvtarget_sum+0x0/0xfc0 [hvtarget])")
                && text.contains(&format!("n={:#x}", 3 + round)),
            "{text}"
        );
        // The module goes: at free_module everything on its text is
        // unhooked and the guest's page mapped back, before the kernel
        // frees it; the probe is pending again.
        let ev = g.module_call(FREE_MODULE, MOD_STRUCT);
        assert_eq!(ev.map(|e| e.hook), Some(ModuleHook::Unload));
        g.kernel.modules = modules(false);
        let leaf = g.root.leaf(mod_page).unwrap();
        assert_eq!((leaf.hpa.0, leaf.perms), (mod_page, ept::RWX));
        assert_eq!(g.sites_and_pages(), (3, 1, 3), "round {round}");
        assert!(g.tracer().probe_list()[0].pending);
    }
    let r = g.tracer().report();
    assert_eq!(
        (
            r.module_loads,
            r.module_unloads,
            r.module_armed,
            r.module_unhooked
        ),
        (20, 20, 20, 20)
    );
    assert_eq!(g.tracer().probe_list()[0].hits, 20);
    // The last pending probe goes: so do root's hooks.
    g.with(|t, env, _| t.probe_del("ms", env)).unwrap();
    assert_eq!(g.sites_and_pages(), (0, 0, 0));
}

/// What the module's page maps to in vCPU `vcpu`'s armed and quiet views.
fn mod_page_leaves(g: &mut Guest, vcpu: usize) -> (Leaf, Leaf) {
    let page = gpa(MOD_FUNC) & !0xfff;
    (
        g.root.leaf_in(vcpu, page).unwrap(),
        g.root.quiet_leaf(vcpu, page).unwrap(),
    )
}

#[test]
fn a_counted_module_function_is_unhooked_at_its_unload_and_keeps_its_calls() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    let filter = protocol::CountFilter {
        functions: vec!["hvtarget:*".into()],
        latency: true,
        ..Default::default()
    };
    let added = g
        .with(|t, env, k| t.count_start(&filter, k, env, 0))
        .unwrap();
    assert_eq!(added.traced, 1);
    // The module's function and root's three hooks.
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    for n in 0..7 {
        g.hit(MOD_FUNC, RETP, CALLER_RET, n);
    }
    let page = gpa(MOD_FUNC) & !0xfff;
    assert_ne!(mod_page_leaves(&mut g, 0).0.hpa.0, page);
    assert_eq!(g.tracer().report().module_globs, 1);
    // The module goes: its site goes with it, whatever counts it, and the
    // guest's own frame is mapped back in every view before the kernel
    // frees it (a shadow left there would run our call over whatever
    // code the frame holds next).
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    // Root's own hooks stay: the count's module glob follows the loads.
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    for vcpu in 0..VCPUS {
        let (armed, quiet) = mod_page_leaves(&mut g, vcpu);
        assert_eq!((armed.hpa.0, armed.perms), (page, ept::RWX));
        assert_eq!((quiet.hpa.0, quiet.perms), (page, ept::RWX));
    }
    // The count keeps the calls, under the function's name marked
    // unloaded.
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!(read.calls, 7);
    let entries: Vec<_> = read
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.addr, e.calls))
        .collect();
    assert_eq!(
        entries,
        [("hvtarget_sum [hvtarget] (unloaded)", MOD_FUNC, 7)]
    );
    // Another module's code in the same frames runs as the guest wrote
    // it: a call there is no hit of ours.
    let (out, _) = g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
    assert_eq!(g.tracer().report().forged_entries, 1);
    // The module loads again: its function is counted again from its
    // load on, and its calls add up over the unloads.
    g.kernel.modules = modules(true);
    g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    for n in 0..3 {
        g.hit(MOD_FUNC, RETP, CALLER_RET, n);
    }
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    let entries: Vec<_> = read
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.calls))
        .collect();
    assert_eq!(
        (read.calls, entries),
        (
            10,
            vec![
                ("hvtarget_sum [hvtarget]", 3),
                ("hvtarget_sum [hvtarget] (unloaded)", 7)
            ]
        )
    );
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let read = g.with(|t, _, k| t.count_read(0, 10, k, 0)).unwrap();
    assert_eq!((read.calls, read.entries.len()), (10, 1));
    assert_eq!(read.entries[0].calls, 10);
    g.with(|t, env, _| t.count_stop(env)).unwrap();
    assert_eq!(g.sites_and_pages(), (0, 0, 0));
}

#[test]
fn an_unload_unhooks_even_when_the_other_vcpus_do_not_come() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    g.with(|t, env, k| t.function_add("hvtarget_*", k, env))
        .unwrap();
    g.probe("p:ms hvtarget:hvtarget_sum").unwrap();
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    // Another vCPU is stuck in the guest: a request would change nothing,
    // but the kernel frees the text as soon as the unload hook returns.
    g.root.others_come = false;
    let asked = g.root.must_stops;
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert!(g.root.must_stops > asked);
    let page = gpa(MOD_FUNC) & !0xfff;
    for vcpu in 0..VCPUS {
        let (armed, quiet) = mod_page_leaves(&mut g, vcpu);
        assert_eq!((armed.hpa.0, quiet.hpa.0), (page, page));
    }
    let r = g.tracer().report();
    assert_eq!((r.sites, r.pages, r.functions), (3, 1, 0), "{r:?}");
    assert!(g.tracer().probe_list()[0].pending);
}

#[test]
fn a_hidden_hook_on_a_quiet_page_is_hooked_in_the_quiet_views_at_once() {
    let mut g = Guest::new();
    // A session rooted at my_func whose trace set is the kernel's module
    // functions: their page is left to the guest in the quiet views.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["do_init_module".into(), "free_module".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let page = gpa(FREE_MODULE) & !0xfff;
    assert_eq!(g.root.quiet_leaf(1, page).unwrap().hpa.0, page);
    // A pending probe puts root's hooks on those functions: a vCPU on its
    // quiet view must see the next unload, before any settling.
    g.probe("p:ms hvtarget:hvtarget_sum").unwrap();
    for vcpu in 0..VCPUS {
        let armed = g.root.leaf_in(vcpu, page).unwrap();
        let quiet = g.root.quiet_leaf(vcpu, page).unwrap();
        assert_ne!(armed.hpa.0, page);
        assert_eq!((quiet.hpa, quiet.perms), (armed.hpa, ept::EXEC));
    }
}

#[test]
fn the_function_tracer_on_a_module_follows_its_unload() {
    let mut g = Guest::new();
    g.kernel.modules = modules(true);
    let added = g
        .with(|t, env, k| t.function_add("hvtarget_*", k, env))
        .unwrap();
    assert_eq!(added.traced, 1);
    // Root's hooks came in with the module's function.
    assert_eq!(g.sites_and_pages(), (4, 2, 3));
    assert_eq!(g.tracer().report().functions, 1);
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    let r = g.tracer().report();
    // Nothing left to follow: root's hooks went too.
    assert_eq!(
        (r.sites, r.pages, r.module_hooks, r.functions),
        (0, 0, 0, 0)
    );
    // The kernel's own functions are not the module's: an unload of a
    // module whose text is unknown touches nothing.
    g.with(|t, env, k| t.function_add("my_func", k, env))
        .unwrap();
    assert_eq!(g.sites_and_pages(), (1, 1, 0));
}

#[test]
fn a_module_glob_covers_the_module_at_each_load() {
    let mut g = Guest::new();
    // Malformed module globs are refused.
    for bad in [":x", "hvtarget:", "a:b:c"] {
        let e = g.with(|t, env, k| t.function_add(bad, k, env)).unwrap_err();
        assert_eq!(e.kind, protocol::ErrorKind::InvalidArgument, "{bad}");
    }
    // Not loaded: nothing traced yet, root's hooks in to follow loads.
    let added = g
        .with(|t, env, k| t.function_add("hvtarget:hvtarget_*", k, env))
        .unwrap();
    assert_eq!(added.traced, 0);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    assert_eq!(g.tracer().report().module_globs, 1);
    // A plain glob never matches a later module; the module glob does not
    // match the kernel's own functions.
    let plain = g.with(|t, env, k| t.function_add("my_*", k, env)).unwrap();
    assert_eq!(plain.traced, 1);
    assert_eq!(g.tracer().report().module_globs, 1);
    for round in 0..3 {
        g.kernel.modules = modules(true);
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        let r = g.tracer().report();
        assert_eq!(
            (r.sites, r.functions, r.module_followed),
            (5, 2, round + 1),
            "round {round}"
        );
        g.tracer().set_stream(Some(TraceFormat::Text));
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        let text = g.text();
        assert!(text.contains(": hvtarget_sum <-caller"), "{text}");
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        assert_eq!(g.tracer().report().functions, 1, "round {round}");
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
    }
    // Clearing the function tracer drops the glob, and root's hooks.
    g.with(|t, env, _| t.function_clear(env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.module_hooks, r.module_globs), (0, 0, 0));
}

#[test]
fn a_graph_session_rooted_in_a_module_glob_waits_for_the_module() {
    let mut g = Guest::new();
    let f = GraphFilter {
        functions: vec!["hvtarget:hvtarget_sum".into()],
        trace: vec!["*_func".into()],
        ..GraphFilter::default()
    };
    let started = g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    // No root yet: the kernel's functions do not start trees meanwhile.
    assert_eq!((started.roots, started.hooked), (0, 2));
    assert_eq!(g.tracer().report().module_hooks, 3);
    assert_eq!(g.tracer().report().module_globs, 1);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET, "not a root");
    let tramp = g.region().return_trampoline().0;
    for round in 0..2 {
        g.kernel.modules = modules(true);
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        // The module's function is a root now; under it the kernel's
        // functions nest.
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        assert_eq!(g.ram.word(gpa(RETP)), tramp, "round {round}");
        g.hit(FUNC, RETP - 0x100, MOD_FUNC + 0x40, 0);
        assert_eq!(g.ram.word(gpa(RETP - 0x100)), tramp, "round {round}");
        assert_eq!(g.ret(RETP - 0x100, 0).1, MOD_FUNC + 0x40);
        assert_eq!(g.ret(RETP, 0).1, CALLER_RET);
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        // Gone with its module: the kernel's function is no root.
        g.hit(FUNC, RETP, CALLER_RET, 0);
        assert_eq!(g.ram.word(gpa(RETP)), CALLER_RET, "round {round}");
        assert_eq!(g.tracer().report().graph_frames, 0);
    }
    // Stopping the session drops what followed the module.
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    let r = g.tracer().report();
    assert_eq!((r.sites, r.module_hooks, r.module_globs), (0, 0, 0));
}

#[test]
fn a_modules_init_text_is_traced_until_the_kernel_frees_it() {
    let mut g = Guest::new();
    g.tracer().set_stream(Some(TraceFormat::Text));
    // A probe on the init function, pending; the function tracer on all
    // the module's functions. The third hidden hook follows the freeing
    // of init text.
    g.probe("p:mi hvtarget:hvtarget_init n=%di").unwrap();
    let added = g
        .with(|t, env, k| t.function_add("hvtarget:*", k, env))
        .unwrap();
    assert_eq!(added.traced, 0);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let init_page = gpa(MOD_INIT_FUNC) & !0xfff;
    for round in 1..=3u64 {
        g.kernel.modules = modules_coming();
        g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
        // Armed before the init runs: the probe and both functions.
        let list = g.tracer().probe_list();
        assert!(
            !list[0].pending && list[0].site == MOD_INIT_FUNC,
            "{list:?}"
        );
        assert_eq!(g.sites_and_pages(), (5, 3, 3), "round {round}");
        assert_eq!(g.tracer().report().functions, 2);
        let leaf = g.root.leaf(init_page).unwrap();
        assert_eq!(leaf.perms, ept::EXEC);
        // The init runs, and calls the module's core function.
        g.hit(MOD_INIT_FUNC, RETP, CALLER_RET, round);
        g.hit(MOD_FUNC, RETP - 0x100, MOD_INIT_FUNC + 0x20, 0);
        let text = g.text();
        assert!(
            text.contains("mi: (hvtarget_init+0x0/0xff0 [hvtarget])")
                && text.contains(&format!("n={round:#x}"))
                && text.contains(": hvtarget_init <-caller")
                && text.contains(": hvtarget_sum <-hvtarget_init\n"),
            "{text}"
        );
        // The init returned: at module_arch_freeing_init the init text's
        // sites go, before the kernel frees it; the core text's stay.
        g.module_call(FREEING_INIT, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(true);
        let leaf = g.root.leaf(init_page).unwrap();
        assert_eq!((leaf.hpa.0, leaf.perms), (init_page, ept::RWX));
        assert_eq!(g.sites_and_pages(), (4, 2, 3), "round {round}");
        let r = g.tracer().report();
        assert_eq!(
            (r.functions, r.module_inits_freed, r.module_init_unhooked),
            (1, round, round)
        );
        assert!(g.tracer().probe_list()[0].pending);
        g.hit(MOD_FUNC, RETP, CALLER_RET, 0);
        assert!(g.text().contains(": hvtarget_sum <-caller"));
        // The module goes: its core text's site too.
        g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
        g.kernel.modules = modules(false);
        assert_eq!(g.sites_and_pages(), (3, 1, 3), "round {round}");
    }
    // An init that fails: free_module takes the init text's sites too.
    g.kernel.modules = modules_coming();
    g.module_call(DO_INIT_MODULE, MOD_STRUCT).unwrap();
    assert_eq!(g.sites_and_pages(), (5, 3, 3));
    g.module_call(FREE_MODULE, MOD_STRUCT).unwrap();
    g.kernel.modules = modules(false);
    assert_eq!(g.sites_and_pages(), (3, 1, 3));
    let leaf = g.root.leaf(init_page).unwrap();
    assert_eq!((leaf.hpa.0, leaf.perms), (init_page, ept::RWX));
    assert!(g.tracer().probe_list()[0].pending);
}

/// What rendering costs in CPU, the figure that moving it to the host
/// moves there: function-tracer and probe records rendered as trace_pipe
/// lines and as JSON lines by the renderers root runs today (the host
/// links the same code). Every record must come out as one line; the time
/// of the rendering alone is printed per record and per million.
#[test]
fn rendering_cost_per_million_records() {
    use std::time::{Duration, Instant};
    let target: u64 = if cfg!(debug_assertions) {
        20_000
    } else {
        400_000
    };
    const BATCH: u64 = 5_000;
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        g.with(|t, env, k| t.function_add("other_func", k, env))
            .unwrap();
        g.probe("p:bench my_func n=%di:u64 x=%di s=$stack1")
            .unwrap();
        g.tracer().set_stream(Some(format));
        let (mut records, mut lines, mut bytes) = (0u64, 0u64, 0usize);
        let mut spent = Duration::ZERO;
        while records < target {
            for i in 0..BATCH {
                let f = if i % 2 == 0 { FUNC } else { OTHER };
                g.hit(f, RETP, CALLER_RET, i);
            }
            records += BATCH;
            let t0 = Instant::now();
            let text = g.text();
            spent += t0.elapsed();
            lines += text.lines().count() as u64;
            bytes += text.len();
        }
        assert_eq!(lines, records, "{format:?}: a line per record");
        assert_eq!(g.tracer().report().lost, 0);
        let ns = spent.as_nanos() as f64 / records as f64;
        println!(
            "rendering {format:?}: {records} records ({} bytes of text) in {:.3} s: {ns:.0} ns a record, {:.2} CPU s per million",
            bytes,
            spent.as_secs_f64(),
            ns * 1e6 / 1e9
        );
    }
}

// ----- rendering on the host ---------------------------------------------

/// One run of a session with probes, the function tracer and graph
/// sessions, with the stream drained at set points by `drain`: the same
/// hits, deletions and stops whatever the format.
fn rendering_scenario(g: &mut Guest, format: TraceFormat, drain: &mut dyn FnMut(&mut Guest)) {
    g.with(|t, env, k| t.function_add("other_func", k, env))
        .unwrap();
    g.probe("p:a my_func n=%di:u64 b=+0(%di):x8").unwrap();
    g.probe("r:ra my_func ret=$retval").unwrap();
    let mut f = graph(&["my_func"]);
    f.retval = true;
    g.with(|t, env, k| t.graph_start(f, k, env)).unwrap();
    g.tracer().set_stream(Some(format));
    let inner = RETP - 0x100;
    // Hundreds of records of two sizes, drained at once: records end at
    // every place in the events that carry them.
    // The string probe's records grow a byte at a time, so that events
    // fill to every length.
    g.probe("p:str other_func s=+0(%di):string").unwrap();
    let text = RETP - 0x2000;
    for i in 0..400u64 {
        let f = if i % 3 == 0 { FUNC } else { OTHER };
        let len = (i % 97) as usize;
        g.ram.put(gpa(text), &vec![b'a' + (i % 26) as u8; len]);
        g.ram.put(gpa(text + len as u64), &[0]);
        g.hit(f, inner, FUNC + 0x40, text);
        g.now_ns += 10;
        if f == FUNC {
            g.ret(inner, i);
        }
    }
    drain(g);
    g.with(|t, env, _| t.probe_del("str", env)).unwrap();
    // A tree with a leaf; the probe and the function tracer on the way.
    g.hit(FUNC, RETP, CALLER_RET, CALLER);
    g.now_ns += 1_000;
    g.hit(OTHER, inner, FUNC + 0x40, 0);
    g.now_ns += 2_000;
    g.ret(inner, 7);
    g.now_ns += 3_000;
    g.ret(RETP, 0x10);
    drain(g);
    // A hit whose probe goes before the stream reads it: not printed.
    g.hit(FUNC, RETP, CALLER_RET, 5);
    g.now_ns += 1_000;
    g.ret(RETP, 1);
    g.with(|t, env, _| t.probe_del("a", env)).unwrap();
    drain(g);
    // An entry held back for a leaf when its session stops: printed open
    // once the rings are empty.
    g.hit(FUNC, RETP, CALLER_RET, 6);
    drain(g);
    g.with(|t, env, _| t.graph_stop(None, env)).unwrap();
    g.now_ns += 1_000;
    drain(g);
    g.ret(RETP, 2);
    // A new session (a new generation of number 1) whose entry waits for
    // longer than the hold: printed open, then its return closes it.
    g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
        .unwrap();
    g.hit(FUNC, RETP, CALLER_RET, 8);
    g.now_ns += 1_000;
    drain(g);
    g.now_ns += 2 * tracelang::render::LEAF_HOLD_NS;
    drain(g);
    g.now_ns += 1_000;
    g.ret(RETP, 3);
    drain(g);
}

/// The host's renderer, fed root's records and context, prints what root
/// prints from the same hits, byte for byte, as trace_pipe lines and as
/// JSON lines; records cut across events come back whole.
#[test]
fn the_host_renders_root_records_as_root_renders_them() {
    use tracelang::render::RecordRenderer;
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        let mut root_text = String::new();
        rendering_scenario(&mut g, format, &mut |g| root_text.push_str(&g.text()));

        let mut g = Guest::new();
        let mut renderer = RecordRenderer::new(format);
        let mut host_text = String::new();
        let mut events = 0;
        rendering_scenario(&mut g, TraceFormat::Records, &mut |g| {
            events += render_on_the_host(g, &mut renderer, &mut host_text);
        });
        assert!(root_text.lines().count() >= 8, "{root_text}");
        let probe_line = match format {
            TraceFormat::Json => r#""event":"a""#,
            _ => "a: (my_func",
        };
        assert!(root_text.contains(probe_line), "{root_text}");
        assert_eq!(host_text, root_text, "{format:?}: {events} events");
        assert_eq!(renderer.stats.bad_chunks, 0);
        assert_eq!(renderer.stats.bad_specs, 0);
    }
}

/// The host reading the vCPUs' rings itself
/// ([`protocol::TraceChannel::SharedRings`]): root sends only the context
/// and its clock, the host's reader takes the records from the rings'
/// memory (oldest first across the vCPUs, up to the mark it took before
/// the frames) and renders them as root renders them, byte for byte.
#[test]
fn the_host_reading_the_rings_renders_as_root_renders() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::{RecordRenderer, RingsReader};
    // The main scenario, then hits on two vCPUs stored out of time order.
    fn scenario(g: &mut Guest, format: TraceFormat, drain: &mut dyn FnMut(&mut Guest)) {
        rendering_scenario(g, format, drain);
        g.with(|t, env, k| t.function_add("*_func", k, env))
            .unwrap();
        for (on, step) in [
            (1, 10_000),
            (1, 20_000),
            (0, 5_000),
            (0, 30_000),
            (1, 1_000),
        ] {
            g.on = on;
            g.now_ns += step;
            g.hit(OTHER, RETP, CALLER_RET, 0);
        }
        g.on = 0;
        g.now_ns += 1_000;
        drain(g);
    }
    for format in [TraceFormat::Text, TraceFormat::Json] {
        let mut g = Guest::new();
        let mut root_text = String::new();
        scenario(&mut g, format, &mut |g| root_text.push_str(&g.text()));

        let mut g = Guest::new();
        let (regions, stamp_at) = g.tracer().record_rings();
        assert_eq!(regions.len(), VCPUS);
        g.tracer().set_host_reads(true);
        let rings = regions
            .iter()
            .map(|&(at, len)| {
                // SAFETY: the tracer's own rings, alive as long as `g`,
                // read as the host reads them from the RAM file.
                unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap()
            })
            .collect();
        let mut reader = RingsReader::new(rings, stamp_at as usize);
        let mut renderer = RecordRenderer::new(format);
        let mut host_text = String::new();
        let mut taken = 0;
        scenario(&mut g, TraceFormat::Records, &mut |g| {
            let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
            let mut out = Vec::new();
            // The mark, then the frames, then the records up to the mark.
            let mark = reader.mark();
            let mut idle = None;
            // No room at all: the context goes all the same.
            while let Some(ev) =
                Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(0, Some(&g.kernel), g.now_ns)
            {
                match ev {
                    Event::TraceContext(c) => renderer.context(&c),
                    Event::TraceRecords { data, now_ns, .. } if data.is_empty() => {
                        idle = Some(now_ns);
                    }
                    other => panic!("root sent {other:?} while the host reads the rings"),
                }
            }
            assert!(
                !Tracer::new(&mut g.vm, &mut g.cpus[0]).has_output(),
                "root waits for nothing"
            );
            let mut events = Vec::new();
            taken += reader.take(&mark, &mut events).unwrap();
            for ev in events {
                match ev {
                    Event::TraceRecords { lost, now_ns, data } => {
                        renderer.records(lost, now_ns, &data, &syms, &mut out)
                    }
                    other => panic!("the reader made {other:?}"),
                }
            }
            if let Some(now) = idle.filter(|_| reader.is_empty()) {
                renderer.records(0, now, &[], &syms, &mut out);
            }
            for e in out {
                if let Event::TraceText { text, .. } = e {
                    host_text.push_str(&text);
                }
            }
        });
        assert!(taken > 400, "{taken} records taken from the rings");
        assert!(reader.is_empty() && reader.lost() == 0);
        assert_eq!(host_text, root_text, "{format:?}");
        // The two vCPUs' hits came out in time order.
        let tail: Vec<&str> = root_text.lines().rev().take(5).collect();
        assert_eq!(tail.len(), 5);
        assert!(
            tail.iter().filter(|l| l.contains("other_func")).count() == 5,
            "{tail:?}"
        );
    }
}

/// A ring filling while the host reads the rings rings the doorbell, at
/// most every few milliseconds; root never rings it when it drains.
#[test]
fn a_filling_ring_rings_the_doorbell_when_the_host_reads() {
    let mut g = Guest::new();
    g.with(|t, env, k| t.function_add("*_func", k, env))
        .unwrap();
    g.tracer().set_stream(Some(TraceFormat::Records));
    // Enough hits to fill a quarter of vCPU 0's ring.
    let fill = |g: &mut Guest| {
        for _ in 0..12_000 {
            g.hit(OTHER, RETP, CALLER_RET, 0);
        }
    };
    fill(&mut g);
    let now = 10_000_000;
    assert!(!g.tracer().doorbell(now), "root drains: no doorbell");
    g.tracer().set_host_reads(true);
    assert!(g.tracer().doorbell(now));
    assert!(!g.tracer().doorbell(now + 1_000_000), "too soon");
    assert!(
        !g.tracer().doorbell(now + 6_000_000),
        "once per filling: a ring nobody empties does not keep ringing"
    );
    // Emptied by the host: quiet, and ready to ring again.
    let empty = |g: &mut Guest| {
        for (at, len) in g.tracer().record_rings().0 {
            // SAFETY: the tracer's own ring, read as the host reads it.
            let r = unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap();
            r.discard();
        }
    };
    empty(&mut g);
    assert!(!g.tracer().doorbell(now + 20_000_000));
    fill(&mut g);
    assert!(g.tracer().doorbell(now + 21_000_000), "filling again");
    // Nor without a stream.
    empty(&mut g);
    assert!(!g.tracer().doorbell(now + 30_000_000));
    fill(&mut g);
    g.tracer().set_stream(None);
    assert!(!g.tracer().doorbell(now + 40_000_000));
}

/// Records and root's text: the same records, in the same events, as
/// records alone, and beside them the text root renders alone; the host's
/// renderer turns the records into that text.
#[test]
fn records_and_text_carry_the_records_and_roots_own_text() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::RecordRenderer;
    let mut g = Guest::new();
    let mut root_text = String::new();
    rendering_scenario(&mut g, TraceFormat::Text, &mut |g| {
        root_text.push_str(&g.text())
    });
    let mut records_alone = Vec::new();
    let mut g = Guest::new();
    rendering_scenario(&mut g, TraceFormat::Records, &mut |g| {
        let now = g.now_ns;
        while let Some(ev) =
            Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
        {
            records_alone.push(ev);
        }
    });
    let mut records = Vec::new();
    let mut text = String::new();
    let mut host_text = String::new();
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let mut g = Guest::new();
    rendering_scenario(&mut g, TraceFormat::RecordsAndText, &mut |g| {
        let now = g.now_ns;
        while let Some(ev) =
            Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
        {
            let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
            let mut out = Vec::new();
            match &ev {
                Event::TraceText {
                    format: TraceFormat::Text,
                    lost: 0,
                    text: t,
                    ..
                } => {
                    text.push_str(t);
                    continue;
                }
                Event::TraceContext(c) => renderer.context(c),
                Event::TraceRecords { lost, now_ns, data } => {
                    renderer.records(*lost, *now_ns, data, &syms, &mut out)
                }
                other => panic!("unexpected event {other:?}"),
            }
            records.push(ev);
            for e in out {
                if let Event::TraceText { text, .. } = e {
                    host_text.push_str(&text);
                }
            }
        }
    });
    assert!(root_text.lines().count() >= 8, "{root_text}");
    assert_eq!(records, records_alone);
    assert_eq!(text, root_text);
    assert_eq!(host_text, root_text);
}

/// Records split across events (a long string fetch), losses reported,
/// and chunks out of place dropped without a panic.
#[test]
fn the_host_renderer_takes_split_records_and_refuses_misplaced_chunks() {
    use tracelang::kprobe::IndexSymbols;
    use tracelang::render::RecordRenderer;
    let mut g = Guest::new();
    g.probe("p:s my_func s=+0(%di):string").unwrap();
    let long = vec![b'x'; 3500];
    let at = RETP - 0x2000;
    g.ram.put(gpa(at), &long);
    g.ram.put(gpa(at + 3500), &[0]);
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, at);
    let root_text = g.text();
    g.tracer().set_stream(Some(TraceFormat::Records));
    g.hit(FUNC, RETP, CALLER_RET, at);
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let syms = IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
    let mut datas = Vec::new();
    let mut out = Vec::new();
    while let Some(ev) =
        Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), g.now_ns)
    {
        match ev {
            Event::TraceContext(c) => renderer.context(&c),
            Event::TraceRecords { lost, now_ns, data } => {
                datas.push(data.clone());
                renderer.records(lost, now_ns, &data, &syms, &mut out);
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(datas.len() >= 2, "the record was cut across events");
    let host: String = out
        .iter()
        .filter_map(|e| match e {
            Event::TraceText { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(root_text.contains("xxxxxxxx"), "{root_text}");
    assert_eq!(host, root_text);
    // The second piece alone: a continuation without its start.
    let before = renderer.stats.bad_chunks;
    let mut out = Vec::new();
    renderer.records(2, 0, &datas[1], &syms, &mut out);
    assert_eq!(renderer.stats.bad_chunks, before + 1);
    assert!(matches!(
        out.as_slice(),
        [Event::TraceText { lost: 2, text, .. }] if text.is_empty()
    ));
    // Garbage: a length past the end.
    renderer.records(0, 0, &[0xff, 0xff, 0, 0, 1], &syms, &mut Vec::new());
    assert_eq!(renderer.stats.bad_chunks, before + 2);
}

/// The host's reader passes root's clock on once nothing older is left in
/// the rings: under steady traffic the rings are seldom empty, and held
/// entries must still age.
#[test]
fn the_host_reader_passes_roots_clock_once_nothing_older_is_left() {
    use super::ring::Rings;
    use tracelang::render::RingsReader;
    let rec = |ts: u64| {
        let mut v = 0u64.to_le_bytes().to_vec();
        v.extend_from_slice(&ts.to_le_bytes());
        v
    };
    let mut rings = Rings::new(2, protocol::ring::RING_MIN, 8);
    rings.of(0).push(&rec(10));
    rings.of(1).push(&rec(30));
    let attached = rings
        .regions()
        .iter()
        .map(|&(at, len)| {
            // SAFETY: the rings' own memory, alive for the test.
            unsafe { protocol::ring::Ring::attach(at as *mut u8, len as usize) }.unwrap()
        })
        .collect();
    let mut reader = RingsReader::new(attached, 8);
    assert!(!reader.caught_up(20), "a record from before 20 is waiting");
    assert!(reader.caught_up(10));
    let mark = reader.mark();
    let mut out = Vec::new();
    assert_eq!(reader.take(&mark, &mut out).unwrap(), 2);
    assert!(reader.caught_up(20) && reader.is_empty());
    // Newer records do not hold the clock back.
    rings.of(1).push(&rec(25));
    assert!(reader.caught_up(20) && !reader.is_empty());
    assert!(!reader.caught_up(26));
}

/// A held entry ages at the same turn on the host as in root: root's text
/// mode prints an entry held longer than the hold open on the first turn
/// that finds the rings empty after it; records mode says every such turn
/// to the host while a session runs, so a return that comes after that
/// turn closes an open entry on both sides, never a leaf on one.
#[test]
fn a_held_entry_ages_at_the_same_turn_on_the_host() {
    use tracelang::render::RecordRenderer;
    let ms = 1_000_000;
    let scenario = |g: &mut Guest, format: TraceFormat, drain: &mut dyn FnMut(&mut Guest)| {
        g.with(|t, env, k| t.graph_start(graph(&["my_func"]), k, env))
            .unwrap();
        g.tracer().set_stream(Some(format));
        g.now_ns = 5 * ms;
        g.hit(FUNC, RETP, CALLER_RET, 8);
        // Empty turns every 20 ms: root prints the entry open at 120 ms
        // (held 115 ms); the return comes at 125 ms.
        for t in 1..=6 {
            g.now_ns = t * 20 * ms;
            drain(g);
        }
        g.now_ns = 125 * ms;
        g.ret(RETP, 3);
        g.now_ns = 140 * ms;
        drain(g);
    };
    let mut g = Guest::new();
    let mut root_text = String::new();
    scenario(&mut g, TraceFormat::Text, &mut |g| {
        root_text.push_str(&g.text())
    });
    assert!(root_text.contains("my_func() {"), "{root_text}");
    assert!(root_text.contains('}'), "{root_text}");

    let mut g = Guest::new();
    let mut renderer = RecordRenderer::new(TraceFormat::Text);
    let mut host_text = String::new();
    scenario(&mut g, TraceFormat::Records, &mut |g| {
        render_on_the_host(g, &mut renderer, &mut host_text);
    });
    assert_eq!(host_text, root_text);
}

/// Takes every event root's stream has now (records mode) and renders it
/// with the host's renderer into `text`; returns how many events.
fn render_on_the_host(
    g: &mut Guest,
    renderer: &mut tracelang::render::RecordRenderer,
    text: &mut String,
) -> usize {
    let now = g.now_ns;
    let mut events = 0;
    while let Some(ev) =
        Tracer::new(&mut g.vm, &mut g.cpus[0]).next_text(1 << 20, Some(&g.kernel), now)
    {
        events += 1;
        let syms = tracelang::kprobe::IndexSymbols::new(&g.kernel.index, Some(&g.kernel.modules));
        let mut out = Vec::new();
        match ev {
            Event::TraceContext(c) => renderer.context(&c),
            Event::TraceRecords { lost, now_ns, data } => {
                renderer.records(lost, now_ns, &data, &syms, &mut out)
            }
            other => panic!("unexpected event {other:?}"),
        }
        for e in out {
            if let Event::TraceText { text: t, .. } = e {
                text.push_str(&t);
            }
        }
    }
    events
}

// ----- the quiet views -----------------------------------------------------

/// A session rooted at my_func tracing quiet_leaf, with the views settled
/// as root settles them after each request.
fn quiet_session(g: &mut Guest) -> u32 {
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["quiet_leaf".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        let s = t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
        s.session
    })
}

/// Runs on vCPU `on` as task `task` (its stack `stack`): the scheduler
/// hook's hit as the task comes in.
fn switch_to(g: &mut Guest, on: usize, task: u64, stack: u64) {
    g.on = on;
    g.kernel.running.task = task;
    let retp = stack + 0x3e00;
    let (out, _) = g.hit(SWITCH, retp, CALLER_RET, 0);
    assert!(matches!(out, Hypercall::Handled));
}

#[test]
fn a_rooted_sessions_trace_set_is_unhooked_in_the_quiet_view_only() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    // Status per session: my_func and quiet_leaf hooked, one root, the
    // leaf left unhooked outside it.
    let s = g.tracer().graph_sessions();
    assert_eq!(
        s,
        [protocol::GraphSessionReport {
            session: 1,
            hooked: 2,
            roots: 1,
            quiet: 1
        }]
    );
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    for vcpu in 0..VCPUS {
        // The leaf's page: the shadow in the armed view, the guest's own
        // frame (execute-only) in the quiet one.
        let armed = g.root.leaf_in(vcpu, leaf).unwrap();
        let quiet = g.root.quiet_leaf(vcpu, leaf).unwrap();
        assert_ne!(armed.hpa.0, leaf);
        assert_eq!(armed.perms, ept::EXEC);
        assert_eq!((quiet.hpa.0, quiet.perms), (leaf, ept::EXEC));
        // The root's page and the scheduler hook's are hooked in both.
        for page in [gpa(FUNC) & !0xfff, gpa(SWITCH) & !0xfff] {
            let a = g.root.leaf_in(vcpu, page).unwrap();
            let q = g.root.quiet_leaf(vcpu, page).unwrap();
            assert_ne!(a.hpa.0, page);
            assert_eq!((q.hpa, q.perms), (a.hpa, ept::EXEC));
        }
    }
    // A probe on the leaf needs its hits on every view: hooked again.
    g.with(|t, env, k| {
        t.probe_add("p:leaf quiet_leaf", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    assert_eq!(g.tracer().report().quiet_pages, 0);
    assert_ne!(g.root.quiet_leaf(1, leaf).unwrap().hpa.0, leaf);
    g.with(|t, env, k| {
        t.probe_del("leaf", env).unwrap();
        t.settle_views(Some(k), env);
    });
    assert_eq!(g.root.quiet_leaf(1, leaf).unwrap().hpa.0, leaf);
    // The session stops: nothing is quiet, and the scheduler hook goes.
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    let r = g.tracer().report();
    assert_eq!(
        (r.quiet_pages, r.switch_hook, r.sites),
        (0, false, 0),
        "{r:?}"
    );
    let q = g.root.quiet_leaf(0, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::RWX));
}

#[test]
fn a_vcpu_is_armed_inside_a_root_and_quiet_outside() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    g.tracer().set_stream(Some(TraceFormat::Text));
    // A task outside the root comes in: quiet.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // The root's entry arms the vCPU; its callee is traced there.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    let inner = RETP - 0x100;
    g.hit(QUIET_LEAF, inner, FUNC + 0x40, 0);
    g.ret(inner, 0);
    // Still inside the root after its callee returned.
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    let text = g.text();
    assert!(
        text.contains("my_func() {") && text.contains("quiet_leaf();"),
        "{text}"
    );
    let c = g.vm.hypercalls_of(0, g.now_ns);
    assert_eq!(c.view_switches, 3);
    assert!(c.quiet);
}

#[test]
fn a_task_that_sleeps_in_a_root_arms_the_vcpu_it_wakes_on() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    g.tracer().set_stream(Some(TraceFormat::Text));
    switch_to(&mut g, 0, TASK, STACK_BASE);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // It sleeps: another task comes in on vCPU 0, which goes quiet.
    g.now_ns += 1_000;
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // It wakes on vCPU 1, quiet so far: the switch arms it there, before
    // its first call.
    switch_to(&mut g, 1, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    g.now_ns += 1_000;
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Armed);
    let inner = RETP - 0x100;
    g.hit(QUIET_LEAF, inner, FUNC + 0x40, 0);
    g.ret(inner, 0);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let text = g.text();
    assert!(text.contains("quiet_leaf();"), "{text}");
}

#[test]
fn a_root_entered_from_an_interrupt_returns_to_the_tasks_own_view() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    // An interrupt stack (its own block) on vCPU 0.
    let irq_retp = STACK_BASE - 0x8000 + 0x3f00;
    // On TASK_2, outside the session: the root in the interrupt arms the
    // vCPU, and its return finds TASK_2's own stack outside: quiet.
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    g.hit(FUNC, irq_retp, CALLER_RET, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(irq_retp, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // On TASK, inside the root: the interrupt's root returns, and the
    // task's own stack still holds its root's frame: armed.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.hit(FUNC, irq_retp, CALLER_RET, 0);
    g.ret(irq_retp, 0);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.ret(RETP, 0);
    assert_eq!(g.cpus[0].view(), View::Quiet);
}

#[test]
fn a_step_on_a_quiet_page_puts_both_views_back() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    let shadow = g.root.leaf_in(1, leaf).unwrap().hpa;
    // vCPU 1, quiet, writes the page: its quiet view opens it.
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let open = g.root.quiet_leaf(1, leaf).unwrap();
    assert_eq!((open.hpa.0, open.perms), (leaf, ept::RWX));
    assert_eq!(g.root.leaf_in(1, leaf).unwrap().hpa, shadow);
    g.with(|t, env, _| t.finish_step(env));
    let q = g.root.quiet_leaf(1, leaf).unwrap();
    let a = g.root.leaf_in(1, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::EXEC));
    assert_eq!((a.hpa, a.perms), (shadow, ept::EXEC));
}

#[test]
fn a_session_with_nothing_to_leave_quiet_costs_no_scheduler_hook() {
    let mut g = Guest::new();
    // Rooted at its whole trace set: every hooked site is a root.
    let f = GraphFilter {
        functions: vec!["my_func".into()],
        trace: vec!["my_func".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!(
        (r.quiet_pages, r.switch_hook, r.sites),
        (0, false, 1),
        "{r:?}"
    );
    // Its calls pick no view: the vCPU stays where it was.
    g.hit(FUNC, RETP, CALLER_RET, 0);
    g.ret(RETP, 0);
    assert_eq!(g.vm.hypercalls_of(0, g.now_ns).view_switches, 0);
}

/// A session without roots over quiet_leaf, filtered by `comm` or `pid`,
/// settled as root settles it.
fn filtered_session(g: &mut Guest, comm: Option<&str>, pid: Option<i32>) {
    let f = GraphFilter {
        trace: vec!["quiet_leaf".into()],
        comm: comm.map(Into::into),
        pid,
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
}

#[test]
fn a_comm_filter_arms_the_vcpu_while_its_task_runs_and_from_its_exec() {
    let mut g = Guest::new();
    filtered_session(&mut g, Some("worker"), None);
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.switch_hook), (1, true), "{r:?}");
    g.tracer().set_stream(Some(TraceFormat::Text));
    // The running task is "sleeper": quiet.
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    // It execs into "worker": renamed, it is armed before its next call.
    g.ram.put(gpa(NAME_AT), b"worker\0");
    g.hit_si(SET_COMM, RETP, CALLER_RET, TASK, NAME_AT);
    assert_eq!(g.cpus[0].view(), View::Armed);
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    g.hit(QUIET_LEAF, RETP, CALLER_RET, 0);
    g.ret(RETP, 0);
    assert!(g.text().contains("quiet_leaf();"));
    // The renaming of another task changes nothing here.
    g.ram.put(gpa(NAME_AT), b"idle\0");
    g.hit_si(SET_COMM, RETP, CALLER_RET, TASK_2, NAME_AT);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Another task comes in: quiet; the worker comes back on vCPU 1: armed.
    g.kernel.running.comm = *b"sleeper\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 0, TASK_2, STACK_BASE_2);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.kernel.running.comm = *b"worker\0\0\0\0\0\0\0\0\0\0";
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Armed);
}

#[test]
fn a_pid_filter_arms_the_running_task_at_the_next_turn_after_its_start() {
    let mut g = Guest::new();
    // vCPU 0 went quiet under an earlier session.
    filtered_session(&mut g, Some("worker"), None);
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    // A session on pid 42, which vCPU 0 runs now: no switch comes, but
    // the vCPU's next turn arms it.
    filtered_session(&mut g, None, Some(42));
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let due = g.with(|t, _, k| {
        let due = t.view_due();
        t.turn_view(Some(k), &cpu, now);
        due && !t.view_due()
    });
    assert!(due);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Its hooks: the scheduler's, no renaming hook (no comm filter).
    let r = g.tracer().report();
    assert_eq!((r.switch_hook, r.sites), (true, 2), "{r:?}");
}

#[test]
fn a_page_with_a_root_and_quiet_sites_gets_a_partial_quiet_shadow() {
    let mut g = Guest::new();
    // Room for a partial shadow beyond what hooks keep.
    g.root.frame_limit = 2048;
    // my_func (the root) and other_func (traced beneath it) share a page.
    g.with(|t, env, k| {
        t.graph_start(graph(&["my_func"]), k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 1), "{r:?}");
    let page = gpa(FUNC) & !0xfff;
    let armed = g.root.leaf_in(0, page).unwrap().hpa;
    let quiet = g.root.quiet_leaf(0, page).unwrap();
    assert!(quiet.hpa != armed && quiet.hpa.0 != page, "{quiet:?}");
    assert_eq!(quiet.perms, ept::EXEC);
    assert_eq!(g.root.quiet_leaf(1, page).unwrap().hpa, quiet.hpa);
    let at = |g: &Guest, frame: Hpa, va: u64| -> [u8; 5] {
        g.root.frames[&frame.0][(va & 0xfff) as usize..][..5]
            .try_into()
            .unwrap()
    };
    // The root's call in both shadows; other_func's only in the armed one.
    assert_eq!(at(&g, quiet.hpa, FUNC), at(&g, armed, FUNC));
    assert_ne!(at(&g, armed, FUNC), NOP5);
    assert_eq!(at(&g, quiet.hpa, OTHER), NOP5);
    assert_ne!(at(&g, armed, OTHER), NOP5);
    // A quiet vCPU's write to the page (the guest's ftrace at other_func)
    // reaches both shadows: the guest's call in the quiet one, ours kept
    // in the armed one.
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let v = g.with(|t, env, _| t.on_violation(gpa(OTHER), true, false, env));
    assert!(matches!(v, Violation::Stepping));
    let theirs = call_bytes(OTHER, FTRACE_CALLER);
    g.ram.put(gpa(OTHER), &theirs);
    g.with(|t, env, _| t.finish_step(env));
    assert_eq!(at(&g, quiet.hpa, OTHER), theirs);
    assert_ne!(at(&g, armed, OTHER), theirs);
    assert_eq!(at(&g, quiet.hpa, FUNC), at(&g, armed, FUNC));
    let q = g.root.quiet_leaf(1, page).unwrap();
    assert_eq!((q.hpa, q.perms), (quiet.hpa, ept::EXEC));
    // A probe on other_func: it matters everywhere, the page is hooked
    // whole in the quiet view again.
    g.with(|t, env, k| {
        t.probe_add("p:o other_func", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 0), "{r:?}");
    assert_eq!(g.root.quiet_leaf(0, page).unwrap().hpa, armed);
}

#[test]
fn a_new_user_of_a_quiet_page_is_hooked_there_even_without_a_frame_to_spare() {
    let mut g = Guest::new();
    // Rooted at quiet_leaf: my_func and other_func's page is all quiet.
    let f = GraphFilter {
        functions: vec!["quiet_leaf".into()],
        trace: vec!["*_func".into(), "quiet_leaf".into()],
        ..GraphFilter::default()
    };
    g.with(|t, env, k| {
        t.graph_start(f, k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let page = gpa(FUNC) & !0xfff;
    assert_eq!(g.root.quiet_leaf(0, page).unwrap().hpa.0, page);
    // A probe on other_func: its page wants a partial shadow, and the pool
    // has none to spare here; the whole shadow takes its place.
    g.with(|t, env, k| {
        t.probe_add("p:o other_func", k, env).unwrap();
        t.settle_views(Some(k), env);
    });
    let armed = g.root.leaf_in(0, page).unwrap().hpa;
    for vcpu in 0..VCPUS {
        assert_eq!(g.root.quiet_leaf(vcpu, page).unwrap().hpa, armed);
    }
    let r = g.tracer().report();
    assert_eq!((r.quiet_pages, r.quiet_partial), (0, 0), "{r:?}");
}

#[test]
fn a_step_open_on_one_view_opens_again_on_the_other() {
    let mut g = Guest::new();
    quiet_session(&mut g);
    switch_to(&mut g, 1, TASK, STACK_BASE);
    assert_eq!(g.cpus[1].view(), View::Quiet);
    let leaf = gpa(QUIET_LEAF) & !0xfff;
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, false, false, env));
    assert!(matches!(v, Violation::Stepping));
    // The stepped context comes back on the armed view (a step preempted,
    // its vCPU armed meanwhile): the same page faults there, and opens.
    g.cpus[1].view = View::Armed;
    let v = g.with(|t, env, _| t.on_violation(gpa(QUIET_LEAF) + 0x40, false, false, env));
    assert!(matches!(v, Violation::Widened));
    let a = g.root.leaf_in(1, leaf).unwrap();
    assert_eq!((a.hpa.0, a.perms), (leaf, ept::RWX));
    // The step's end puts both views back.
    g.with(|t, env, _| t.finish_step(env));
    let q = g.root.quiet_leaf(1, leaf).unwrap();
    assert_eq!((q.hpa.0, q.perms), (leaf, ept::EXEC));
    assert_ne!(g.root.leaf_in(1, leaf).unwrap().hpa.0, leaf);
}

// ----- the request door --------------------------------------------------

#[test]
fn the_request_door_serves_the_tracers_requests_with_what_they_need() {
    use super::door::{needs, Given, Needs};
    use protocol::{ErrorKind, Request, Response};
    let add = || Request::ProbeAdd {
        spec: "p:a my_func".into(),
    };
    // Root's own requests are not the tracer's.
    assert_eq!(needs(&Request::Status), None);
    assert_eq!(needs(&Request::Ping { nonce: 7 }), None);
    assert_eq!(needs(&Request::ProbeList), Some(Needs::State));
    assert_eq!(
        needs(&Request::CountRead {
            cursor: 0,
            limit: 10
        }),
        Some(Needs::Kernel)
    );
    assert_eq!(
        needs(&Request::ProbeDel { name: "a".into() }),
        Some(Needs::World)
    );
    assert_eq!(needs(&add()), Some(Needs::KernelAndWorld));

    let mut g = Guest::new();
    fn given<'a, 'e>(
        kernel: Option<&'a FakeKernel>,
        env: Option<&'a mut Env<'e>>,
    ) -> Given<'a, 'e> {
        Given {
            kernel: kernel.map(|k| k as &dyn KernelView),
            env,
            now_ns: 0,
        }
    }
    // A request that changes hooks, without the world: refused, and
    // nothing is hooked.
    let e = g
        .with(|t, _, k| t.request(add(), given(Some(k), None)))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    assert_eq!(g.tracer().report().sites, 0);
    // Without the kernel: refused too.
    let e = g
        .with(|t, env, _| t.request(add(), given(None, Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    assert_eq!(g.tracer().report().sites, 0);

    // With both: added and hooked, as `probe_add` does.
    let r = g
        .with(|t, env, k| t.request(add(), given(Some(k), Some(env))))
        .unwrap();
    assert_eq!(
        r,
        Response::ProbeAdded {
            name: "kprobes/a".into(),
            site: FUNC
        }
    );
    assert_eq!(g.tracer().report().sites, 1);
    let r = g
        .with(|t, _, _| t.request(Request::ProbeList, given(None, None)))
        .unwrap();
    let Response::Probes(list) = r else {
        panic!("not a probe list: {r:?}");
    };
    assert_eq!(
        list.iter().map(|p| (&*p.name, p.site)).collect::<Vec<_>>(),
        [("kprobes/a", FUNC)]
    );
    // The tracer's own errors come through with their kind.
    let e = g
        .with(|t, env, k| t.request(add(), given(Some(k), Some(env))))
        .unwrap_err();
    assert_ne!(e.kind, ErrorKind::Internal, "{e:?}");
    let del = || Request::ProbeDel { name: "a".into() };
    let r = g
        .with(|t, env, _| t.request(del(), given(None, Some(env))))
        .unwrap();
    assert_eq!(r, Response::Ok);
    assert_eq!(g.tracer().report().sites, 0);
    let e = g
        .with(|t, env, _| t.request(del(), given(None, Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    // A read that needs the kernel, without it; and a request that is not
    // the tracer's at all.
    let read = Request::CountRead {
        cursor: 0,
        limit: 10,
    };
    let e = g
        .with(|t, _, _| t.request(read, given(None, None)))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
    let e = g
        .with(|t, env, k| t.request(Request::Status, given(Some(k), Some(env))))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Internal);
}

// ----- the turn door -----------------------------------------------------

#[test]
fn the_turn_door_reads_the_vcpu_only_when_its_view_is_due() {
    let mut g = Guest::new();
    filtered_session(&mut g, Some("worker"), None);
    switch_to(&mut g, 0, TASK, STACK_BASE);
    assert_eq!(g.cpus[0].view(), View::Quiet);
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    // A session on pid 42, which vCPU 0 runs now: its next turn reads the
    // vCPU once and arms it.
    filtered_session(&mut g, None, Some(42));
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let mut reads = 0;
    let done = g
        .with(|t, env, k| {
            t.turn(
                env,
                Some(k),
                || {
                    reads += 1;
                    Ok::<_, ()>(cpu.clone())
                },
                now,
            )
        })
        .unwrap();
    assert!(done.view_picked && !done.debug_exits, "{done:?}");
    assert_eq!(reads, 1);
    assert_eq!(g.cpus[0].view(), View::Armed);
    // Nothing changed since: the vCPU is not read, and a read that would
    // fail does not matter.
    let done = g
        .with(|t, env, k| t.turn(env, Some(k), || Err("not read"), now))
        .unwrap();
    assert!(!done.view_picked);
    // A change again, and a read that fails: the error comes back, and the
    // view is left for the next turn.
    g.with(|t, env, _| {
        t.graph_stop(None, env).unwrap();
        t.settle_views(None, env);
    });
    let e = g
        .with(|t, env, k| t.turn(env, Some(k), || Err("VMREAD failed"), now))
        .unwrap_err();
    assert_eq!(e, "VMREAD failed");
    assert!(g.tracer().view_due());
}

/// The control channel as a test sees it.
#[derive(Default)]
struct TestOutbox {
    room: usize,
    sent: Vec<Event>,
    modules: bool,
    resend: bool,
}

impl super::turn::Outbox for TestOutbox {
    fn room(&self) -> usize {
        self.room
    }
    fn send(&mut self, event: Event) {
        self.sent.push(event);
    }
    fn sending_modules(&self) -> bool {
        self.modules
    }
    fn take_context_resend(&mut self) -> bool {
        core::mem::take(&mut self.resend)
    }
}

#[test]
fn the_stream_turn_waits_for_the_modules_then_sends_what_fits() {
    let mut g = Guest::new();
    g.probe("p:myprobe my_func x=%di").unwrap();
    g.tracer().set_stream(Some(TraceFormat::Text));
    g.hit(FUNC, RETP, CALLER_RET, 42);
    let cpu = g.cpu(RETP);
    let now = g.now_ns;
    let mut out = TestOutbox {
        room: 1 << 20,
        modules: true,
        ..TestOutbox::default()
    };
    // A copy of the modules' symbols on its way: the records wait, and
    // the turns stay busy.
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    assert!(out.sent.is_empty(), "{:?}", out.sent);
    assert!(waiting);
    // No room: still nothing.
    out.modules = false;
    out.room = 0;
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    assert!(out.sent.is_empty() && waiting);
    // Room: the probe's line goes out, and nothing waits any more.
    out.room = 1 << 20;
    let waiting = g.with(|t, _, k| t.stream_turn(&mut out, Some(k), &cpu, now));
    let text: String = out
        .sent
        .iter()
        .map(|e| match e {
            Event::TraceText { text, .. } => text.clone(),
            other => panic!("unexpected event {other:?}"),
        })
        .collect();
    assert!(
        text.contains("sleeper-42") && text.contains("myprobe: (my_func+0x0/"),
        "{text}"
    );
    assert!(!waiting);
}
