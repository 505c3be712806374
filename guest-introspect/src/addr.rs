//! Address newtypes. [`Gpa`] is the loader's (one definition for the
//! workspace); [`Gva`] is the guest-virtual address this crate adds.

use core::fmt;

pub use loader::layout::Gpa;

/// A guest-virtual address, as the guest kernel's page tables translate it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct Gva(pub u64);

impl Gva {
    /// The raw address.
    #[inline]
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// `self + offset`, or `None` on overflow.
    #[inline]
    pub const fn checked_add(self, offset: u64) -> Option<Self> {
        match self.0.checked_add(offset) {
            Some(a) => Some(Self(a)),
            None => None,
        }
    }

    /// `self + offset`, wrapping around the 64-bit space (used for
    /// guest-supplied relative offsets, which may point anywhere).
    #[inline]
    pub const fn wrapping_add(self, offset: u64) -> Self {
        Self(self.0.wrapping_add(offset))
    }

    /// Rounds down to a multiple of `align` (a power of two; other values
    /// leave the address unchanged).
    #[inline]
    pub const fn align_down(self, align: u64) -> Self {
        if align.is_power_of_two() {
            Self(self.0 & !(align - 1))
        } else {
            self
        }
    }

    /// Rounds up to a multiple of `align` (a power of two), `None` on
    /// overflow or a bad alignment.
    #[inline]
    pub const fn align_up(self, align: u64) -> Option<Self> {
        match loader::layout::align_up(self.0, align) {
            Some(a) => Some(Self(a)),
            None => None,
        }
    }

    /// Whether the address is a multiple of `align` (a power of two).
    #[inline]
    pub const fn is_aligned(self, align: u64) -> bool {
        align.is_power_of_two() && self.0 & (align - 1) == 0
    }

    /// Whether the address is canonical for 4-level paging: bits 63..47
    /// all equal (SDM Vol. 1, 3.3.7.1 "Canonical Addressing").
    #[inline]
    pub const fn is_canonical(self) -> bool {
        let top = self.0 >> 47;
        top == 0 || top == 0x1_ffff
    }

    /// Whether the address lies in the top 2 GiB, where x86-64 Linux maps
    /// its kernel image (`__START_KERNEL_map`, with or without KASLR).
    #[inline]
    pub const fn is_kernel_image(self) -> bool {
        self.0 >= KERNEL_IMAGE_BASE
    }
}

/// Start of the x86-64 kernel image mapping, `__START_KERNEL_map`
/// (arch/x86/include/asm/page_64_types.h).
pub const KERNEL_IMAGE_BASE: u64 = 0xffff_ffff_8000_0000;

/// The address the kernel is linked at when `CONFIG_PHYSICAL_START` keeps its
/// default of 16 MiB: `__START_KERNEL_map + 0x100_0000`. The KASLR slide is
/// measured from here.
pub const DEFAULT_TEXT_BASE: Gva = Gva(KERNEL_IMAGE_BASE + 0x100_0000);

impl core::ops::Add<u64> for Gva {
    type Output = Self;
    /// Adds a byte offset. Panics on overflow in debug builds, like integer
    /// addition; use `checked_add` for guest-controlled values.
    #[inline]
    fn add(self, offset: u64) -> Self {
        Self(self.0 + offset)
    }
}

impl fmt::Debug for Gva {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gva({:#x})", self.0)
    }
}

impl fmt::LowerHex for Gva {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

impl fmt::Display for Gva {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A half-open range of guest-virtual addresses, `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GvaRange {
    /// First address in the range.
    pub start: Gva,
    /// First address after the range.
    pub end: Gva,
}

impl GvaRange {
    /// `[start, end)`.
    #[inline]
    pub const fn new(start: Gva, end: Gva) -> Self {
        Self { start, end }
    }

    /// `[start, start + len)`, clamped to the end of the address space.
    #[inline]
    pub const fn with_len(start: Gva, len: u64) -> Self {
        Self {
            start,
            end: Gva(start.0.saturating_add(len)),
        }
    }

    /// Whether `gva` is inside.
    #[inline]
    pub const fn contains(&self, gva: Gva) -> bool {
        self.start.0 <= gva.0 && gva.0 < self.end.0
    }

    /// Number of bytes in the range (0 when `end <= start`).
    #[inline]
    pub const fn len(&self) -> u64 {
        self.end.0.saturating_sub(self.start.0)
    }

    /// Whether the range holds no address.
    #[inline]
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical() {
        assert!(Gva(0).is_canonical());
        assert!(Gva(0x0000_7fff_ffff_ffff).is_canonical());
        assert!(!Gva(0x0000_8000_0000_0000).is_canonical());
        assert!(!Gva(0xffff_7fff_ffff_ffff).is_canonical());
        assert!(Gva(0xffff_8000_0000_0000).is_canonical());
        assert!(Gva(0xffff_ffff_8100_0000).is_kernel_image());
    }

    #[test]
    fn ranges() {
        let r = GvaRange::with_len(Gva(u64::MAX - 1), 10);
        assert_eq!(r.end, Gva(u64::MAX));
        assert!(r.contains(Gva(u64::MAX - 1)));
        assert!(!r.contains(Gva(u64::MAX)));
        assert!(GvaRange::new(Gva(5), Gva(2)).is_empty());
    }
}
