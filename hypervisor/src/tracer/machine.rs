//! What the tracer needs from VMX root and from introspection, as traits.
//!
//! The tracer runs in the bare-metal binary, over the guest's memory, the
//! hypervisor's frame pool, its EPT and its heap. It reaches all of them
//! through [`Machine`], and the recovered kernel through [`KernelView`], so
//! that the host tests drive it with a buffer for guest RAM, a vector of
//! frames and an in-memory EPT, as they drive the exit decoder through
//! `VmcsIo`.

use crate::addr::{Gpa, Hpa};
use crate::ept::EptError;
use crate::guest_phys::GuestDoor;
use guest_introspect::fallible::OutOfMemory;
use guest_introspect::kallsyms::SymbolIndex;
use guest_introspect::module::ModuleIndex;
use guest_introspect::paging::Cr3;
use guest_introspect::stacks::StackMap;
use guest_introspect::GvaRange;

/// Bytes of a page (and of a frame).
pub const PAGE: usize = 4096;

/// What the tracer works with in one call: guest RAM through the guarded
/// door, and root's frames, EPT and heap. The door is a shared reference
/// of its own, so that a walk of the guest's page tables can run while a
/// frame or an EPT entry is being changed.
pub struct Env<'a> {
    /// The one guarded door to guest-physical memory.
    pub ram: &'a dyn GuestDoor,
    /// Frames, EPT and heap.
    pub m: &'a mut dyn Machine,
}

/// Root's resources, as the tracer uses them. One per VM: each vCPU has
/// its two EPT views ([`View`]), which root keeps alike but where the
/// tracer says otherwise.
pub trait Machine {
    /// A hypervisor frame for the tracer (a trampoline page, a shadow, the
    /// scratch page), or `None` when the pool is exhausted.
    fn alloc_frame(&mut self) -> Option<Hpa>;
    /// Bytes of the frame pool not yet handed out.
    fn frames_free(&self) -> u64;
    /// The bytes of a frame [`Self::alloc_frame`] gave the tracer.
    fn frame(&mut self, hpa: Hpa) -> &mut [u8; PAGE];
    /// Points the EPT entry of the guest page `gpa` at `hpa` with `perms`
    /// (write-back) in every vCPU's view; returns the entry that was there
    /// in this vCPU's. Root makes such a change with every other vCPU held
    /// in root, and each of them invalidates its view before it enters the
    /// guest again.
    fn ept_map(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError>;
    /// Removes the EPT entry of the guest page `gpa` in every vCPU's view.
    fn ept_unmap(&mut self, gpa: Gpa) -> Result<(), EptError>;
    /// Like [`Self::ept_map`], in every vCPU's quiet view only (a page
    /// whose hooks matter only inside a session's roots; see [`View`]).
    fn ept_map_quiet(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<(), EptError>;
    /// Like [`Self::ept_map`], in the view this vCPU runs on only (a
    /// single step opens a page for one instruction of one vCPU).
    fn ept_map_mine(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError>;
    /// Like [`Self::ept_map`], in this vCPU's view `view` only (a step
    /// puts a page back in both of its vCPU's views).
    fn ept_map_own(&mut self, view: View, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError>;
    /// Like [`Self::ept_unmap`], in this vCPU's view `view` only.
    fn ept_unmap_own(&mut self, view: View, gpa: Gpa) -> Result<(), EptError>;
    /// Makes the EPT changes so far visible to this vCPU: both its views
    /// are invalidated, each before the vCPU next runs on it (root
    /// batches them at its entry); the others' are root's to invalidate,
    /// see [`Self::ept_map`].
    fn invept(&mut self);
    /// Holds every other vCPU in root for the rest of the request, if they
    /// are not held yet: a hook or an unhook changes what every vCPU
    /// executes, and is made only while no other vCPU runs guest code (no
    /// torn `call`, no stale translation; see [`Self::ept_map`]). False
    /// when a vCPU did not come in time: nothing may be changed then. The
    /// work before (parsing, globs, classifying sites) runs with every vCPU
    /// still running.
    fn stop_others(&mut self) -> bool;
    /// Holds every other vCPU in root for a change that cannot wait for a
    /// later request: a module's text is freed as soon as root's hook on
    /// the kernel's unload returns, so its sites must be unhooked now.
    /// Unlike [`Self::stop_others`] it tries again past a stall. False when
    /// a vCPU still did not come: the changes are then made all the same
    /// (every view's entries, each vCPU invalidating its views before it
    /// enters again), since leaving a shadow mapped over freed text is
    /// worse than a vCPU that is stuck in the guest seeing the change late.
    fn must_stop_others(&mut self) -> bool;
    /// Lets the other vCPUs go again after a batch of changes (each
    /// invalidates its view before it enters); the next
    /// [`Self::stop_others`] holds them again. A long request (hooking
    /// thousands of functions) hooks in batches, so that no vCPU is held
    /// for the whole of it.
    fn let_others_go(&mut self);
    /// Every vCPU's guest RIP, known once [`Self::stop_others`] held them
    /// (this vCPU's always): a site one of them is inside is not patched.
    fn rips(&self) -> &[u64];
    /// Root's time now, on the clock of the hit's `now_ns` (which is the
    /// time its exit was taken), where the machine has a clock: a call
    /// timed from here leaves out root's own work on its entry.
    fn clock_ns(&self) -> Option<u64> {
        None
    }
    /// `Ok` when `bytes` more fit in the heap's room.
    fn heap_check(&self, bytes: usize) -> Result<(), OutOfMemory>;
    /// Bytes the heap has beyond its reserve.
    fn heap_room(&self) -> usize;
}

/// Which of a vCPU's two EPT views. Both map guest memory the same way
/// and every hooked page to its shadow, but for the pages whose hooks
/// matter only inside a function-graph session's roots: the quiet view
/// maps those to the guest's own frames (execute-only, so that reads and
/// writes still step), and a vCPU runs on it while it is inside none of
/// those roots (`super::quiet`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// Every hook executes.
    Armed = 0,
    /// The hooks of the roots' trace sets do not.
    Quiet = 1,
}

impl View {
    /// Both views.
    pub const BOTH: [View; 2] = [View::Armed, View::Quiet];
}

/// The guest's GS base at an exit, read from the VMCS the first time
/// something asks: a nested KVM does not shadow GUEST_GS_BASE (each read
/// is an exit to it), and only a hit that needs the running task asks.
#[derive(Clone, Debug, Default)]
pub struct GuestGs {
    value: core::cell::OnceCell<u64>,
    read: Option<fn() -> u64>,
}

impl GuestGs {
    /// A base already known.
    pub fn known(base: u64) -> Self {
        let value = core::cell::OnceCell::new();
        let _ = value.set(base);
        Self { value, read: None }
    }

    /// A base `read` gives when first asked for (0 if `read` fails).
    pub fn lazy(read: fn() -> u64) -> Self {
        Self {
            value: core::cell::OnceCell::new(),
            read: Some(read),
        }
    }

    /// The base, read now if it has not been.
    pub fn get(&self) -> u64 {
        *self.value.get_or_init(|| self.read.map_or(0, |r| r()))
    }

    /// The base if it is known (given, or read already), without reading.
    pub fn peek(&self) -> Option<u64> {
        self.value.get().copied()
    }
}

/// The vCPU state the tracer and introspection need, read at an exit.
#[derive(Clone, Debug, Default)]
pub struct CpuView {
    pub cr3: u64,
    /// Current privilege level (SS.DPL).
    pub cpl: u8,
    /// GUEST_GS_BASE from the VMCS, when first asked for.
    pub gs_base: GuestGs,
    /// IA32_KERNEL_GS_BASE (not switched by VMX, so the guest's value is
    /// live in root); read only when `cpl` is not 0, else 0.
    pub kernel_gs_base: u64,
    /// Whether the guest runs with 5-level paging (CR4.LA57).
    pub la57: bool,
    /// The guest's RSP at the exit.
    pub rsp: u64,
}

impl CpuView {
    /// Reads the view from the current VMCS at an exit: SS access rights,
    /// CR3, CR4 and RSP (all shadowed by a nested KVM), the kernel's GS
    /// base from `kernel_gs_base` only in user mode (IA32_KERNEL_GS_BASE
    /// is not in the VMCS), and GUEST_GS_BASE through `gs` only when
    /// asked for ([`GuestGs`]).
    pub fn read(
        v: &impl crate::vmx::fields::VmcsIo,
        kernel_gs_base: impl FnOnce() -> u64,
        gs: fn() -> u64,
    ) -> Result<Self, crate::vmx::fields::VmcsError> {
        use crate::vmx::fields as f;
        let cpl = crate::vmx::event::cpl_from_ss_ar(f::GUEST_SS_ACCESS_RIGHTS.read(v)?);
        Self::read_rest(v, cpl, f::GUEST_RSP.read(v)?, kernel_gs_base, gs)
    }

    /// [`Self::read`] for an exit whose privilege level and RSP the caller
    /// has read (the entry fast path's [`crate::tracer::FastExit`]): CR3
    /// and CR4 only.
    pub fn read_rest(
        v: &impl crate::vmx::fields::VmcsIo,
        cpl: u8,
        rsp: u64,
        kernel_gs_base: impl FnOnce() -> u64,
        gs: fn() -> u64,
    ) -> Result<Self, crate::vmx::fields::VmcsError> {
        use crate::vmx::fields as f;
        Ok(CpuView {
            cr3: f::GUEST_CR3.read(v)?,
            cpl,
            gs_base: GuestGs::lazy(gs),
            kernel_gs_base: if cpl == 0 { 0 } else { kernel_gs_base() },
            la57: f::GUEST_CR4.read(v)? & crate::policy::CR4_LA57 != 0,
            rsp,
        })
    }

    /// The kernel's GS base: GS_BASE in kernel mode, KERNEL_GS_BASE in
    /// user mode.
    pub fn kernel_gs(&self) -> u64 {
        if self.cpl == 0 {
            self.gs_base.get()
        } else {
            self.kernel_gs_base
        }
    }

    /// One of [`Self::kernel_cr3s`]: 0 the CR3 as it is, anything else the
    /// kernel half.
    pub fn kernel_cr3(&self, which: usize) -> Cr3 {
        let [as_is, kernel] = self.kernel_cr3s();
        if which == 0 {
            as_is
        } else {
            kernel
        }
    }

    /// The CR3 to walk kernel memory with (the kernel half of a PTI pair
    /// when the guest was interrupted in user mode).
    pub fn kernel_cr3s(&self) -> [Cr3; 2] {
        let c = Cr3(self.cr3);
        if self.cpl == 0 {
            [c, c]
        } else {
            [c, c.pti_kernel()]
        }
    }
}

/// The task running on a vCPU, as an event records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Running {
    /// Its `task_struct`'s address.
    pub task: u64,
    /// Its pid.
    pub pid: i32,
    /// Its comm, NUL-padded.
    pub comm: [u8; 16],
}

impl Running {
    /// What an event carries when the task is not known: no task, pid -1,
    /// an empty comm.
    pub const UNKNOWN: Running = Running {
        task: 0,
        pid: -1,
        comm: [0; 16],
    };
}

/// The recovered guest kernel, as the tracer asks about it.
pub trait KernelView {
    /// The symbol index (kallsyms).
    fn index(&self) -> &SymbolIndex;
    /// The loaded modules and their symbols, as of the last walk of the
    /// kernel's module list.
    fn modules(&self) -> &ModuleIndex;
    /// The core and init text of the module whose `struct module` is at
    /// `module`, read from guest memory now (`None` when unreadable or
    /// the layout is unknown).
    fn module_text(&self, module: u64) -> Option<(GvaRange, GvaRange)>;
    /// The kernel's own top-level page table, valid for the VM's life.
    fn cr3(&self) -> Cr3;
    /// The task running on the vCPU described by `cpu`.
    fn current(&self, cpu: &CpuView) -> Option<Running>;
    /// The guest's stacks as they are now.
    fn stack_map(&self, cpu: &CpuView) -> StackMap;
    /// The guest's own number for the CPU described by `cpu` (what its
    /// trace_pipe prints), when the kernel's per-cpu offsets say.
    fn cpu_number(&self, cpu: &CpuView) -> Option<u32>;
    /// Logs a stack map that changed.
    fn log_stacks(&self, map: &StackMap);
    /// `task_struct.stack` of the task at `task`: the base of its kernel
    /// stack, which the kernel clears when it frees a dead task's stack.
    fn task_stack(&self, task: u64) -> Option<u64>;
    /// The kernel's BTF as recovery walked it, or why there is none.
    fn btf(&self) -> Result<&guest_introspect::btf::BtfIndex, guest_introspect::btf::BtfError>;
    /// The pid, comm, prio and state of the task at `task`, read now
    /// (`None` when unreadable or the layout is unknown).
    fn task_sched(&self, task: u64) -> Option<guest_introspect::facts::TaskSched>;
}
