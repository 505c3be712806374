//! Allocation failure is an error, never an abort: tables that claim more
//! than the heap can give are refused with `OutOfMemory`, under an
//! allocator that refuses (as the hypervisor's small heap would) every
//! block above a per-thread limit.

mod common;
use test_support::synth;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use guest_introspect::btf::{Btf, BtfError};
use guest_introspect::kallsyms::{locate, KallsymsError, LocateStats, SymbolIndex};
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};
use synth::{generate, kernel_like, random_syms, Order};
use test_support::Rng;

thread_local! {
    /// The largest block this thread may allocate.
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn limit() -> usize {
    LIMIT.try_with(Cell::get).unwrap_or(usize::MAX)
}

/// The system allocator, refusing blocks above the thread's [`LIMIT`].
struct Capped;

// SAFETY: every call is forwarded to `System` unchanged, or answered with
// null, which `GlobalAlloc` allows for any refusal.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > limit() {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > limit() {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > limit() {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from `System` through this allocator; the rest
        // is the caller's contract for `realloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

/// Limits this thread's blocks to `bytes` until dropped.
struct Limited;

impl Limited {
    fn to(bytes: usize) -> Self {
        LIMIT.with(|l| l.set(bytes));
        Limited
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        LIMIT.with(|l| l.set(usize::MAX));
    }
}

const BASE: u64 = 0xffff_ffff_8160_0000;

#[test]
fn the_limit_refuses_large_blocks() {
    let _l = Limited::to(1 << 20);
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(2 << 20).is_err());
    assert!(v.try_reserve_exact(4096).is_ok());
}

/// A names length of 4 GiB (forged) within an unlimited index budget: the
/// heap refuses the copy, the build says so.
#[test]
fn a_forged_names_length_is_an_out_of_memory_error() {
    let mut rng = Rng(test_support::seed());
    let rb = 0xffff_ffff_8100_0000;
    let syms = random_syms(&mut rng, 300, false, rb);
    let (blob, _) = generate(&syms, Order::V612, false, rb);
    // Behind filler, as in memory (the search reads past the tables).
    let lead = 8 * (1 + rng.below(512) as usize);
    let mut mem: Vec<u8> = (0..lead).map(|_| rng.next() as u8 | 1).collect();
    mem.extend_from_slice(&blob);
    mem.extend((0..4096).map(|_| rng.next() as u8 | 1));
    let mut view = SegmentView::new();
    view.add(Gva(BASE), &mem, mem.len() as u64);
    let range = GvaRange::with_len(Gva(BASE), mem.len() as u64);
    let mut t = locate(&view, &[range], &mut LocateStats::default()).unwrap();

    // The genuine tables build under the limit.
    {
        let _l = Limited::to(1 << 20);
        let index = SymbolIndex::build_limited(&view, &t, usize::MAX).unwrap();
        assert_eq!(index.len(), 300);
    }

    t.names_len = !7u32; // 4 GiB less 8
    let needs = SymbolIndex::size_for(&t);
    let _l = Limited::to(64 << 20);
    let e = SymbolIndex::build_limited(&view, &t, usize::MAX).unwrap_err();
    assert_eq!(e, KallsymsError::OutOfMemory { bytes: needs });
    assert_eq!(
        e.to_string(),
        format!("out of hypervisor memory: the symbol index needs {needs} bytes")
    );
    // Within a smaller budget it is refused before any allocation.
    assert_eq!(
        SymbolIndex::build_limited(&view, &t, 10 << 20).unwrap_err(),
        KallsymsError::TooLarge { bytes: needs }
    );
}

/// A BTF walk that gets no heap at all ends in an error at its first
/// allocation (the first checkpoint), and works once the heap is back.
#[test]
fn btf_without_heap_is_an_out_of_memory_error() {
    const AT: u64 = 0xffff_ffff_8240_0000;
    let blob = kernel_like(0);
    let mut view = SegmentView::new();
    assert!(view.add(Gva(AT), &blob, blob.len() as u64));
    {
        let _l = Limited::to(0);
        let e = Btf::parse(&view, Gva(AT)).err();
        assert_eq!(e, Some(BtfError::OutOfMemory { bytes: 4 }));
    }
    assert_eq!(Btf::parse(&view, Gva(AT)).unwrap().type_count(), 16);
}
