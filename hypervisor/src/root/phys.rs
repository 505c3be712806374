//! Raw access to physical memory. The boot stub identity-maps the first
//! 4 GiB, so a physical address below that is also a pointer. All the
//! pointer casting of the binary is here.
//!
//! Raw reads and writes serve the hypervisor's own frames and the loading
//! of the guest before it runs. Once the guest runs, every access to its
//! memory goes through [`guest_ram`], which refuses anything that is not
//! guest RAM.

use hypervisor::acpi::PhysRead;
use hypervisor::addr::Hpa;
use hypervisor::guest_phys::{GuestPhys, RawMemory};
use spin::Once;

/// Highest physical address (exclusive) the hypervisor's page tables map.
pub const MAPPED_LIMIT: u64 = 1 << 32;

fn check(addr: u64, len: usize) -> bool {
    addr.checked_add(len as u64)
        .is_some_and(|e| e <= MAPPED_LIMIT)
}

/// Copies `buf.len()` bytes from physical `addr`; `false` when out of the mapped range.
pub fn read(addr: u64, buf: &mut [u8]) -> bool {
    if !check(addr, buf.len()) {
        return false;
    }
    if let Ok(word) = <&mut [u8; 8]>::try_from(&mut *buf) {
        // A page-table entry or a stack word, the most common read: one
        // load rather than a copy loop.
        // SAFETY: as below, for 8 bytes at any alignment.
        *word = unsafe { core::ptr::read_unaligned(addr as *const [u8; 8]) };
        return true;
    }
    // SAFETY: the range is identity mapped (checked above); it is read with
    // volatile-free byte copies into a buffer we own, and firmware or guest
    // memory has no Rust aliasing rules we could break by reading it.
    unsafe { core::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), buf.len()) };
    true
}

/// Copies `bytes` to physical `addr`; `false` when out of the mapped range.
pub fn write(addr: u64, bytes: &[u8]) -> bool {
    if !check(addr, bytes.len()) {
        return false;
    }
    // SAFETY: the range is identity mapped; callers only write guest memory
    // before the guest runs or frames of their own.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
    true
}

/// Zeroes `len` bytes at physical `addr` (inside the mapped range).
pub fn zero(addr: u64, len: usize) {
    if check(addr, len) {
        // SAFETY: identity mapped, and owned by the caller.
        unsafe { core::ptr::write_bytes(addr as *mut u8, 0, len) };
    }
}

/// A borrowed view of physical memory, e.g. a boot module.
///
/// The caller must not let the guest run while the slice is alive.
pub fn slice(addr: u64, len: usize) -> Option<&'static [u8]> {
    if !check(addr, len) {
        return None;
    }
    // SAFETY: identity mapped; the memory is not written while the slice is
    // used (the guest has not started, and the hypervisor only reads it).
    Some(unsafe { core::slice::from_raw_parts(addr as *const u8, len) })
}

/// Root's identity map as raw memory, for [`GuestPhys`] only.
pub struct Identity;

impl RawMemory for Identity {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        read(addr, buf)
    }
    fn write(&self, addr: u64, bytes: &[u8]) -> bool {
        write(addr, bytes)
    }
}

static GUEST_RAM: Once<GuestPhys<Identity>> = Once::new();
static NO_RAM: GuestPhys<Identity> = GuestPhys::refusing_all(Identity);

/// Fixes what guest RAM is (the guest's e820, hypervisor memory excluded)
/// for the VM's life. Until then every guest access is refused.
pub fn set_guest_ram(map: loader::e820::E820Map) {
    GUEST_RAM.call_once(|| {
        GuestPhys::new(
            map,
            loader::layout::HV_RESERVED.as_u64()..loader::layout::HV_RESERVED_END.as_u64(),
            Identity,
        )
    });
}

/// The one door to guest-physical memory once the guest runs: every
/// access outside guest RAM is refused.
pub fn guest_ram() -> &'static GuestPhys<Identity> {
    GUEST_RAM.get().unwrap_or(&NO_RAM)
}

/// A hypervisor-owned frame as a table of 512 words.
///
/// # Safety
/// `hpa` must be a frame of the hypervisor's pool that the caller owns and
/// uses as one table (no other live reference to it).
pub unsafe fn frame_mut(hpa: Hpa) -> &'static mut [u64; 512] {
    assert!(
        hpa.0.is_multiple_of(4096) && check(hpa.0, 4096),
        "frame {:#x} outside mapped memory",
        hpa.0
    );
    // SAFETY: frames come from the hypervisor's pool (page aligned, identity
    // mapped, never given to the guest); each is used as one table by one owner.
    unsafe { &mut *(hpa.0 as *mut [u64; 512]) }
}

/// A hypervisor-owned frame as bytes.
///
/// # Safety
/// As for [`frame_mut`].
pub unsafe fn frame_bytes_mut(hpa: Hpa) -> &'static mut [u8; 4096] {
    assert!(
        hpa.0.is_multiple_of(4096) && check(hpa.0, 4096),
        "frame {:#x} outside mapped memory",
        hpa.0
    );
    // SAFETY: as for `frame_mut`.
    unsafe { &mut *(hpa.0 as *mut [u8; 4096]) }
}

/// Physical memory as seen by the ACPI readers.
pub struct Phys;

impl PhysRead for Phys {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        read(addr, buf)
    }
}
