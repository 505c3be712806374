//! The hypervisor's page-frame pool: the part of its reserved memory after
//! the image's bss, up to the end of the reservation. Frames are handed out
//! zeroed and never freed (everything allocated lives as long as the VM).

use crate::phys;
use hypervisor::addr::Hpa;
use hypervisor::ept::TableStore;
use spin::Mutex;

extern "C" {
    static __bss_end: u8;
    static __reserved_end: u8;
}

struct Pool {
    next: u64,
    end: u64,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { next: 0, end: 0 });

/// Bytes handed out so far, for status reports.
pub fn used() -> u64 {
    let p = POOL.lock();
    p.next.saturating_sub(pool_start())
}

fn pool_start() -> u64 {
    // Only the address of the linker symbol is taken, never its value.
    let s = core::ptr::addr_of!(__bss_end) as u64;
    s.next_multiple_of(4096)
}

/// Sets the pool up. Must run before any allocation.
pub fn init() -> (u64, u64) {
    let end = core::ptr::addr_of!(__reserved_end) as u64;
    let mut p = POOL.lock();
    p.next = pool_start();
    p.end = end;
    (p.next, p.end)
}

/// One zeroed 4 KiB frame.
pub fn alloc() -> Option<Hpa> {
    let mut p = POOL.lock();
    if p.next + 4096 > p.end {
        return None;
    }
    let f = p.next;
    p.next += 4096;
    drop(p);
    phys::zero(f, 4096);
    Some(Hpa(f))
}

/// `len` bytes of contiguous zeroed frames (rounded up to whole pages).
pub fn alloc_region(len: u64) -> Option<Hpa> {
    let len = len.next_multiple_of(4096);
    let mut p = POOL.lock();
    if p.next.checked_add(len)? > p.end {
        return None;
    }
    let start = p.next;
    p.next += len;
    drop(p);
    phys::zero(start, len as usize);
    Some(Hpa(start))
}

/// EPT tables come from the pool.
pub struct PoolTables;

impl TableStore for PoolTables {
    fn alloc_table(&mut self) -> Option<Hpa> {
        alloc()
    }
    fn table(&mut self, hpa: Hpa) -> &mut [u64; 512] {
        // SAFETY: the EPT asks only for tables it allocated from the pool,
        // and holds one reference to a table at a time.
        unsafe { phys::frame_mut(hpa) }
    }
}
