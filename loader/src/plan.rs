//! Where the guest kernel goes.
//!
//! The 64-bit boot protocol lets a relocatable kernel be loaded at any
//! `kernel_alignment`-aligned address with `init_size` bytes of RAM from
//! there on (boot.rst, "64-bit Boot Protocol"). The initrd stays where the
//! boot loader put it; the caller passes its range (and every other module,
//! the bzImage itself included) in `avoid`.

use crate::bootparams::BootError;
use crate::bzimage::BzImage;
use crate::e820::E820Map;
use crate::layout::{Gpa, FOUR_GIB, LARGE_PAGE_SIZE, ONE_MIB};

/// Offset of the 64-bit entry point from the load address of the
/// protected-mode kernel.
pub const ENTRY_OFFSET_64: u64 = 0x200;

/// The 64-bit entry point of a kernel loaded at `load`.
pub fn entry_point(load: Gpa) -> Gpa {
    Gpa(load.as_u64().wrapping_add(ENTRY_OFFSET_64))
}

/// The alignment we load the kernel at: its `kernel_alignment` rounded up to
/// a power of two, and at least 2 MiB (the kernel's page tables map it with
/// large pages, and our EPT works in 2 MiB units).
pub fn kernel_load_alignment(img: &BzImage<'_>) -> u64 {
    u64::from(img.kernel_alignment())
        .next_power_of_two()
        .max(LARGE_PAGE_SIZE)
}

/// Bytes the kernel needs from its load address: `init_size`, or the
/// protected-mode part if that is larger.
pub fn kernel_footprint(img: &BzImage<'_>) -> u64 {
    u64::from(img.init_size()).max(img.protected_mode().len() as u64)
}

/// Chooses the guest-physical load address of the protected-mode kernel:
/// aligned per [`kernel_load_alignment`], with [`kernel_footprint`] bytes
/// inside one RAM entry of `e820`, below 4 GiB (the reach of the guest's
/// boot page tables), clear of every `(base, len)` in `avoid`. The lowest
/// such address at or above `pref_address` wins; failing that, the lowest
/// one above 1 MiB.
pub fn plan_kernel_load(
    img: &BzImage<'_>,
    e820: &E820Map,
    avoid: &[(u64, u64)],
) -> Result<Gpa, BootError> {
    let align = kernel_load_alignment(img);
    let size = kernel_footprint(img);
    let preferred = img.pref_address().max(ONE_MIB);
    e820.find_ram(size, align, preferred, FOUR_GIB, avoid)
        .or_else(|| e820.find_ram(size, align, ONE_MIB, FOUR_GIB, avoid))
        .map(Gpa)
        .ok_or(BootError::NoRoomForKernel { size, align })
}
