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
/// The scheduler's wakeup.
const WAKE: u64 = TEXT + 0x7000;
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
    /// Other tasks' scheduler view by task (absent: unreadable).
    tasks: BTreeMap<u64, guest_introspect::facts::TaskSched>,
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
    fn task_sched(&self, task: u64) -> Option<guest_introspect::facts::TaskSched> {
        self.tasks.get(&task).copied()
    }

    fn btf(&self) -> Result<&guest_introspect::btf::BtfIndex, guest_introspect::btf::BtfError> {
        Err(guest_introspect::btf::BtfError::Absent)
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
        sym(b'T', "try_to_wake_up", WAKE),
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
            WAKE,
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
                tasks: BTreeMap::new(),
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

// The tests by topic; the graph's and the quiet views' set-ups serve the
// others too.
mod doors;
mod entry;
mod graph;
mod modules;
mod quiet;
mod render;
mod split_view;
use self::graph::*;
use self::quiet::*;
