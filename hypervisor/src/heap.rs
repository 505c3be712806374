//! The hypervisor heap: a fixed region of the frame pool handed to a
//! first-fit allocator. Only VMX root uses it; the guest never sees it.

use crate::frames;
use linked_list_allocator::LockedHeap;

/// Heap size. The control channel and the symbol index are the main users.
pub const HEAP_SIZE: u64 = 16 << 20;

#[global_allocator]
static HEAP: LockedHeap = LockedHeap::empty();

/// Carves the heap out of the frame pool. Returns its size, or `None` when
/// the pool is too small.
pub fn init() -> Option<u64> {
    let base = frames::alloc_region(HEAP_SIZE)?;
    // SAFETY: the region is fresh, exclusively owned, identity-mapped pool
    // memory that is never freed or handed to the guest; `init` runs once.
    unsafe { HEAP.lock().init(base.0 as *mut u8, HEAP_SIZE as usize) };
    Some(HEAP_SIZE)
}

/// Bytes of the heap in use.
pub fn used() -> usize {
    HEAP.lock().used()
}
