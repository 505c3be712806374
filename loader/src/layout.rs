//! The guest-physical memory map: every fixed address that the loader and the
//! hypervisor agree on lives in this one file.
//!
//! Our EPT is an identity map, so a guest-physical address and the
//! host-physical address behind it are the same number. We still keep two
//! types, [`Gpa`] and [`Hpa`], so that a signature says which view it means.
//!
//! ```text
//! 0x0000_0000 ┬ real-mode IVT and BIOS data area (left to the guest)
//! 0x0000_0500 ┼ guest GDT, 4 descriptors                    GDT
//! 0x0000_7000 ┼ zero page (struct boot_params, 4 KiB)        ZERO_PAGE
//! 0x0000_9000 ┼ guest boot page tables: PML4                 BOOT_PML4
//! 0x0000_A000 │   PDPT                                       BOOT_PDPT
//! 0x0000_B000 │   4 page directories (2 MiB pages, 4 GiB)    BOOT_PD
//! 0x0000_F000 ┼ AP start-up page: root's, not the guest's   AP_TRAMPOLINE
//! 0x0001_0000 ┼ (free)
//! 0x0002_0000 ┼ kernel command line, at most 64 KiB with NUL  CMDLINE
//! 0x0003_0000 ┼ (free)
//! 0x000A_0000 ┼ end of conventional RAM (VGA, option ROMs, BIOS above)
//! 0x0010_0000 ┼ 1 MiB: the guest kernel may go anywhere above this
//! 0x0020_0000 ┼ hypervisor image (HV_LOAD) ┐
//!             │ hypervisor heap, stacks,   │ HV_RESERVED: never in the
//!             │ trace rings ...            │ guest e820, absent from EPT
//! 0x0200_0000 ┴ 32 MiB ────────────────────┘
//! ```
//!
//! The guest kernel, its initrd and the rest of RAM are placed at run time
//! from the firmware memory map (see [`crate::plan`]).

use core::fmt;
use core::ops::{Add, RangeInclusive};

macro_rules! address_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The raw address.
            #[inline]
            pub const fn as_u64(self) -> u64 {
                self.0
            }

            /// Rounds up to a multiple of `align`, which must be a power of
            /// two (`0` counts as `1`). `None` when the result would not fit
            /// in 64 bits or `align` is not a power of two.
            #[inline]
            pub const fn align_up(self, align: u64) -> Option<Self> {
                match align_up(self.0, align) {
                    Some(a) => Some(Self(a)),
                    None => None,
                }
            }

            /// Rounds down to a multiple of `align` (a power of two; other
            /// values, 0 included, leave the address unchanged).
            #[inline]
            pub const fn align_down(self, align: u64) -> Self {
                if align.is_power_of_two() {
                    Self(self.0 & !(align - 1))
                } else {
                    self
                }
            }

            /// Whether the address is a multiple of `align` (a power of two).
            #[inline]
            pub const fn is_aligned(self, align: u64) -> bool {
                align.is_power_of_two() && self.0 & (align - 1) == 0
            }

            /// `self + offset`, or `None` on overflow.
            #[inline]
            pub const fn checked_add(self, offset: u64) -> Option<Self> {
                match self.0.checked_add(offset) {
                    Some(a) => Some(Self(a)),
                    None => None,
                }
            }
        }

        impl Add<u64> for $name {
            type Output = Self;
            /// Adds a byte offset. Like integer addition, this panics on
            /// overflow in debug builds; use `checked_add` for values that
            /// come from the guest or the boot loader.
            #[inline]
            fn add(self, offset: u64) -> Self {
                Self(self.0 + offset)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.0)
            }
        }

        impl fmt::LowerHex for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }
    };
}

address_type!(
    /// A guest-physical address.
    Gpa
);

address_type!(
    /// A host-physical address. With our identity EPT, `Hpa(x)` backs
    /// `Gpa(x)` for every guest RAM page; use [`Gpa::identity_hpa`] to say
    /// so explicitly where the two meet.
    Hpa
);

address_type!(
    /// A guest-virtual address, as the guest kernel's page tables translate
    /// it: one type for the whole workspace (introspection, the
    /// trampolines, the tracer).
    Gva
);

impl Gva {
    /// `self + offset`, wrapping around the 64-bit space (used for
    /// guest-supplied relative offsets, which may point anywhere).
    #[inline]
    pub const fn wrapping_add(self, offset: u64) -> Self {
        Self(self.0.wrapping_add(offset))
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

impl Gpa {
    /// The host-physical address behind this guest-physical one under the
    /// identity EPT.
    #[inline]
    pub const fn identity_hpa(self) -> Hpa {
        Hpa(self.0)
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two; `0` counts as
/// `1`). `None` on overflow or when `align` is not a power of two.
#[inline]
pub const fn align_up(value: u64, align: u64) -> Option<u64> {
    let align = if align == 0 { 1 } else { align };
    if !align.is_power_of_two() {
        return None;
    }
    match value.checked_add(align - 1) {
        Some(v) => Some(v & !(align - 1)),
        None => None,
    }
}

/// Size of a 4 KiB page.
pub const PAGE_SIZE: u64 = 0x1000;
/// Size of a 2 MiB large page.
pub const LARGE_PAGE_SIZE: u64 = 0x20_0000;
/// 1 MiB: the end of the real-mode address space.
pub const ONE_MIB: u64 = 0x10_0000;
/// 4 GiB: the end of the range our guest boot page tables map.
pub const FOUR_GIB: u64 = 0x1_0000_0000;

/// End of conventional RAM. Below this address the PC has ordinary RAM (minus
/// the BIOS data areas); from here to 1 MiB are the VGA window, option ROMs
/// and the BIOS.
pub const LOW_MEMORY_END: u64 = 0xA_0000;

// ---------------------------------------------------------------------------
// Guest boot structures, written by the hypervisor before the first VM entry.
// Linux copies what it needs from them early and reserves the first 1 MiB, so
// they may sit in memory the guest's e820 reports as RAM.
// ---------------------------------------------------------------------------

/// The guest's initial GDT (see [`crate::guest_tables::gdt_bytes`]):
/// null, null, 0x10 = 64-bit code, 0x18 = data, as the 64-bit boot protocol
/// requires (Documentation/arch/x86/boot.rst, "64-bit Boot Protocol").
pub const GDT: Gpa = Gpa(0x500);
/// Size of the guest GDT in bytes (4 descriptors of 8 bytes).
pub const GDT_SIZE: u64 = 32;
/// Selector of the 64-bit code segment in the guest GDT.
pub const GUEST_CODE_SELECTOR: u16 = 0x10;
/// Selector of the data segment in the guest GDT.
pub const GUEST_DATA_SELECTOR: u16 = 0x18;

/// The zero page: `struct boot_params`, whose address the guest kernel gets
/// in RSI (see [`crate::bootparams`]).
pub const ZERO_PAGE: Gpa = Gpa(0x7000);
/// Size of the zero page.
pub const ZERO_PAGE_SIZE: u64 = PAGE_SIZE;

/// The guest's initial PML4, loaded into its CR3 (see
/// [`crate::guest_tables::write_identity_tables`]).
pub const BOOT_PML4: Gpa = Gpa(0x9000);
/// The guest's initial page-directory-pointer table, right after the PML4.
pub const BOOT_PDPT: Gpa = Gpa(0xA000);
/// The first of [`BOOT_PD_COUNT`] page directories, consecutive after the
/// PDPT, each mapping 1 GiB with 2 MiB pages.
pub const BOOT_PD: Gpa = Gpa(0xB000);
/// Number of page directories: 4 x 1 GiB covers the first 4 GiB.
pub const BOOT_PD_COUNT: u64 = 4;
/// Size of the whole block of guest boot page tables (PML4, PDPT and the
/// page directories), which starts at [`BOOT_PML4`].
pub const BOOT_TABLES_SIZE: u64 = (2 + BOOT_PD_COUNT) * PAGE_SIZE;

/// The kernel command line, NUL-terminated.
pub const CMDLINE: Gpa = Gpa(0x2_0000);
/// Room for the command line, terminating NUL included. The kernel header's
/// `cmdline_size` is the tighter limit in practice (2047 bytes on 6.1).
pub const COMMAND_LINE_MAX: u64 = 0x1_0000;

// ---------------------------------------------------------------------------
// Hypervisor memory.
// ---------------------------------------------------------------------------

/// Link and load address of the hypervisor image (2 MiB).
pub const HV_LOAD: Hpa = Hpa(0x20_0000);
/// Start of the memory the hypervisor keeps for itself: its image, heap,
/// stacks and trace rings. It is never in the guest's e820 and absent from
/// the EPT, so the guest can neither see nor touch it.
pub const HV_RESERVED: Hpa = HV_LOAD;
/// Size of the hypervisor's reservation (30 MiB, so it ends at 32 MiB).
pub const HV_RESERVED_SIZE: u64 = 30 * 0x10_0000;
/// End (exclusive) of the hypervisor's reservation.
pub const HV_RESERVED_END: Hpa = Hpa(HV_RESERVED.0 + HV_RESERVED_SIZE);

// The trampoline region (guest-physical pages for the entry and return
// trampolines, outside the guest's e820 and read-only/execute-only in EPT)
// gets its address with the kprobe work; it will be declared here.

// ---------------------------------------------------------------------------
// I/O ports.
// ---------------------------------------------------------------------------

/// The control channel's UART (COM2). These ports trap to the hypervisor;
/// every other port passes through to the guest.
pub const CONTROL_PORTS: RangeInclusive<u16> = 0x2F8..=0x2FF;
/// First port of [`CONTROL_PORTS`] (the UART's base).
pub const CONTROL_PORT_BASE: u16 = 0x2F8;
/// Last port of [`CONTROL_PORTS`].
pub const CONTROL_PORT_LAST: u16 = 0x2FF;

/// The page the hypervisor's application processors start in (a SIPI
/// vector names a page below 1 MiB). It is root's for good: outside the
/// guest's e820 and absent from EPT, so the guest can never choose the
/// code an AP runs before it enters VMX.
pub const AP_TRAMPOLINE: Hpa = Hpa(0xF000);

/// The fixed low boot structures as `(base, size)`, for overlap checks and
/// for callers that must keep other data out of them.
pub const LOW_BOOT_STRUCTURES: [(u64, u64); 5] = [
    (GDT.0, GDT_SIZE),
    (AP_TRAMPOLINE.0, PAGE_SIZE),
    (ZERO_PAGE.0, ZERO_PAGE_SIZE),
    (BOOT_PML4.0, BOOT_TABLES_SIZE),
    (CMDLINE.0, COMMAND_LINE_MAX),
];

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte.
#[inline]
pub const fn ranges_overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    if a_len == 0 || b_len == 0 {
        return false;
    }
    // Compare in 128 bits so that ranges touching the top of the address
    // space do not wrap.
    (a as u128) < (b as u128 + b_len as u128) && (b as u128) < (a as u128 + a_len as u128)
}

const _: () = {
    // The boot structures fit in conventional RAM and do not overlap.
    let s = &LOW_BOOT_STRUCTURES;
    let mut i = 0;
    while i < s.len() {
        assert!(s[i].0 + s[i].1 <= LOW_MEMORY_END);
        assert!(s[i].0.is_multiple_of(8));
        let mut j = i + 1;
        while j < s.len() {
            assert!(!ranges_overlap(s[i].0, s[i].1, s[j].0, s[j].1));
            j += 1;
        }
        i += 1;
    }
    // Page tables are page aligned and consecutive: PML4, PDPT, PDs.
    assert!(BOOT_PML4.0.is_multiple_of(PAGE_SIZE));
    assert!(BOOT_PDPT.0 == BOOT_PML4.0 + PAGE_SIZE);
    assert!(BOOT_PD.0 == BOOT_PDPT.0 + PAGE_SIZE);
    assert!(BOOT_PD.0 + BOOT_PD_COUNT * PAGE_SIZE == BOOT_PML4.0 + BOOT_TABLES_SIZE);
    // The hypervisor's reservation is 2 MiB aligned (EPT can leave it out
    // with whole large pages), above the low structures and below 4 GiB.
    assert!(HV_RESERVED.0.is_multiple_of(LARGE_PAGE_SIZE));
    assert!(HV_RESERVED_SIZE.is_multiple_of(LARGE_PAGE_SIZE));
    assert!(HV_RESERVED.0 >= ONE_MIB);
    assert!(HV_RESERVED_END.0 == 0x200_0000);
    assert!(HV_RESERVED_END.0 <= FOUR_GIB);
    assert!(*CONTROL_PORTS.start() == CONTROL_PORT_BASE);
    assert!(*CONTROL_PORTS.end() == CONTROL_PORT_LAST);
};
