//! Address newtypes. The EPT map is an identity map, so a guest-physical
//! address of guest RAM equals the host-physical one, but the types keep the
//! two roles apart in signatures.

/// A guest-physical address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Gpa(pub u64);

/// A host-physical address (what the hypervisor's own page tables and the
/// VMCS pointers hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Hpa(pub u64);

/// A guest-virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Gva(pub u64);

macro_rules! addr_impl {
    ($t:ident) => {
        impl $t {
            /// The raw address.
            pub const fn as_u64(self) -> u64 {
                self.0
            }
            /// Rounds down to a multiple of `align` (a power of two).
            pub const fn align_down(self, align: u64) -> Self {
                Self(self.0 & !(align - 1))
            }
            /// Whether the address is a multiple of `align` (a power of two).
            pub const fn is_aligned(self, align: u64) -> bool {
                self.0 & (align - 1) == 0
            }
        }
        impl core::fmt::LowerHex for $t {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                core::fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}
addr_impl!(Gpa);
addr_impl!(Hpa);
addr_impl!(Gva);
