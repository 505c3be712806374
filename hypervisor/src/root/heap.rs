//! The hypervisor heap: a fixed region of the frame pool handed to a
//! first-fit allocator. Only VMX root uses it; the guest never sees it.
//!
//! # One heap budget
//! Every allocation whose size follows guest or host data is fallible
//! (`guest_introspect::fallible`, `try_reserve`) and checked against
//! [`room`]: what is free beyond [`RESERVE`], which is kept for the control
//! channel's frames and the small fixed
//! structures. The big consumers check before they allocate: the symbol
//! index is built within [`room`] at the time of recovery, the tracer's
//! site and page maps and its graph sessions' sets check [`check`] before
//! each new entry, and a return stack that finds no room is a counted miss.
//!
//! A hit fetches its probe's arguments only when [`room`] holds them at
//! their longest (`MAX_TRACE_ARGS` strings of `MAX_STRING_SIZE`), through
//! fallible allocations: a hit that does not fit is a counted loss, on
//! whichever of the vCPUs it runs.
//!
//! The allocations left infallible are bounded by construction (a frame
//! of at most `protocol::MAX_FRAME` bytes, fixed-size search buffers) and
//! fit in [`RESERVE`]. Should one still fail, the allocation
//! error handler of a `no_std` binary (Rust's default since 1.68) panics
//! with "memory allocation of N bytes failed", and the panic handler
//! reports that with the heap's state ([`report`]) and powers the machine
//! off: a clear report, never a silent halt.

use crate::frames;
use guest_introspect::fallible::OutOfMemory;
use linked_list_allocator::LockedHeap;

/// Heap size. The control channel and the symbol index are the main users.
pub const HEAP_SIZE: u64 = 16 << 20;

/// Heap kept free for what is allocated infallibly (see the module
/// documentation): budgets are computed from what is free beyond it.
pub const RESERVE: usize = 2 << 20;

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

/// Bytes of the heap free (in total: a first-fit heap may still refuse one
/// block of that size when the free space is fragmented, which the
/// fallible allocations report).
pub fn free() -> usize {
    HEAP.lock().free()
}

/// Bytes a new guest- or host-sized structure may take: what is free
/// beyond [`RESERVE`].
pub fn room() -> usize {
    free().saturating_sub(RESERVE)
}

/// `Ok` when `bytes` more fit in [`room`].
pub fn check(bytes: usize) -> Result<(), OutOfMemory> {
    if bytes <= room() {
        Ok(())
    } else {
        Err(OutOfMemory { bytes })
    }
}

/// (used, free) bytes, unless the heap's lock is held (a report from a
/// panic or fault must not wait on it).
pub fn report() -> Option<(usize, usize)> {
    HEAP.try_lock().map(|h| (h.used(), h.free()))
}
