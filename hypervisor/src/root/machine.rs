//! Root's side of the tracer's [`Machine`]: the frame pool, the EPT (with
//! INVEPT), the heap, and the guarded door to guest RAM.

use crate::arch::instructions as insn;
use crate::frames::{self, PoolTables};
use crate::{heap, phys};
use guest_introspect::fallible::OutOfMemory;
use hypervisor::addr::{Gpa, Hpa};
use hypervisor::ept::{Ept, EptError, MemType};
use hypervisor::tracer::machine::{Env, Machine, PAGE};

/// The tracer's machine over the VM's EPT.
struct Root<'a> {
    ept: &'a Ept,
}

impl Machine for Root<'_> {
    fn alloc_frame(&mut self) -> Option<Hpa> {
        frames::alloc()
    }

    fn frames_free(&self) -> u64 {
        loader::layout::HV_RESERVED_SIZE.saturating_sub(frames::used())
    }

    fn frame(&mut self, hpa: Hpa) -> &mut [u8; PAGE] {
        // SAFETY: the tracer passes only frames `alloc_frame` gave it, each
        // used by one owner (a trampoline page, a shadow, the scratch page),
        // and holds the reference for one copy or patch.
        unsafe { phys::frame_bytes_mut(hpa) }
    }

    fn ept_map(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        self.ept
            .map_page(&mut PoolTables, gpa, hpa, perms, MemType::WriteBack)
    }

    fn ept_unmap(&mut self, gpa: Gpa) -> Result<(), EptError> {
        self.ept
            .unmap(&mut PoolTables, gpa, Gpa(gpa.0.saturating_add(PAGE as u64)))
    }

    fn invept(&mut self) {
        if insn::invept_single(self.ept.eptp()).is_err() {
            log::warn!("INVEPT failed");
        }
    }

    fn heap_check(&self, bytes: usize) -> Result<(), OutOfMemory> {
        heap::check(bytes)
    }

    fn heap_room(&self) -> usize {
        heap::room()
    }
}

/// Runs `f` with the tracer's environment over root's resources and the
/// VM's EPT.
pub fn with_env<R>(ept: &Ept, f: impl FnOnce(&mut Env<'_>) -> R) -> R {
    let mut m = Root { ept };
    f(&mut Env {
        ram: phys::guest_ram(),
        m: &mut m,
    })
}
