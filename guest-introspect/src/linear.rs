//! The kernel's linear maps: address ranges where a guest-virtual address
//! is its guest-physical address plus a constant, so that a read there needs
//! no page walk.
//!
//! x86-64 Linux keeps two (Documentation/arch/x86/x86_64/mm.rst):
//! - the **direct map** of all physical memory at `page_offset_base`
//!   (`0xffff888000000000` unless the memory layout is randomized, when the
//!   variable `page_offset_base` holds it). Slab objects live there:
//!   `task_struct`, and on most kernels the per-CPU areas.
//! - the **kernel image** at `__START_KERNEL_map`, `_text` to `_end`, at
//!   the physical address it was loaded at.
//!
//! Vmalloc memory (task stacks with `VMAP_STACK`, modules) is in neither and
//! is still walked.
//!
//! A window is used only after walks through the guest's own page tables
//! agreed with it at several addresses ([`LinearMaps::find`]). The shortcut
//! changes how an address is translated, never where a read may land: the
//! physical read goes through the same [`GuestMemory`] as a walk's. A guest
//! that remaps its own direct map later reads, through hvtrace, the memory
//! the kernel's own layout says; it misleads only its own trace.

use alloc::vec::Vec;

use crate::addr::{Gpa, Gva};
use crate::mem::GuestMemory;
use crate::paging::{self, Cr3};
use crate::view::{ViewError, VirtMemory};

/// The direct map's base when the memory layout is not randomized
/// (`__PAGE_OFFSET_BASE_L4`, 4-level paging).
pub const DEFAULT_PAGE_OFFSET: u64 = 0xffff_8880_0000_0000;
/// The longest direct map with 4-level paging (64 TiB).
pub const DIRECT_MAP_SPAN: u64 = 64 << 40;

/// Addresses `start..end` at guest-physical `gva - delta`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearWindow {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `gva - gpa` for every address of the window.
    pub delta: u64,
}

impl LinearWindow {
    /// Where `len` bytes at `gva` are, if all of them are in the window.
    #[inline]
    pub fn gpa(&self, gva: Gva, len: usize) -> Option<Gpa> {
        let end = gva.0.checked_add(len as u64)?;
        (gva.0 >= self.start && end <= self.end).then(|| Gpa(gva.0.wrapping_sub(self.delta)))
    }
}

/// Why a window was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearError {
    /// A symbol it needs is missing.
    NoSymbol(&'static str),
    /// A walk at a sample address failed.
    Unmapped(Gva),
    /// A walk at a sample address gave another physical address.
    Disagrees {
        /// The sample.
        gva: Gva,
        /// What the window says.
        window: Gpa,
        /// What the walk says.
        walk: Gpa,
    },
}

impl core::fmt::Display for LinearError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            LinearError::NoSymbol(s) => write!(f, "no {s} symbol"),
            LinearError::Unmapped(g) => write!(f, "{:#x} does not translate", g.0),
            LinearError::Disagrees { gva, window, walk } => write!(
                f,
                "{:#x} walks to {:#x}, not {:#x}",
                gva.0, walk.0, window.0
            ),
        }
    }
}

/// The checked windows (at most two: the direct map, the image).
#[derive(Clone, Debug, Default)]
pub struct LinearMaps {
    windows: Vec<LinearWindow>,
}

/// What [`LinearMaps::find`] found, window by window.
#[derive(Clone, Debug)]
pub struct LinearFound {
    /// The windows taken.
    pub maps: LinearMaps,
    /// The direct map, or why not.
    pub direct: Result<LinearWindow, LinearError>,
    /// The kernel image, or why not.
    pub image: Result<LinearWindow, LinearError>,
}

impl LinearMaps {
    /// The windows.
    pub fn windows(&self) -> &[LinearWindow] {
        &self.windows
    }

    /// Where `len` bytes at `gva` are, if a window holds all of them.
    #[inline]
    pub fn gpa(&self, gva: Gva, len: usize) -> Option<Gpa> {
        self.windows.iter().find_map(|w| w.gpa(gva, len))
    }

    /// Finds the direct map and the kernel image in the address space at
    /// `cr3`: `page_offset_base` is the address of the kernel variable of
    /// that name (`None`: the layout is not randomized), `image` is
    /// `_text..=_end`. Each window is taken only if walks agree with it at
    /// its start, its end and between (for the direct map: where the
    /// image's own pages are, and the page after them).
    pub fn find<M: GuestMemory + ?Sized>(
        mem: &M,
        cr3: Cr3,
        page_offset_base: Option<Gva>,
        image: Option<(Gva, Gva)>,
    ) -> LinearFound {
        let walk = |gva: Gva| {
            paging::translate(mem, cr3, gva)
                .map(|t| t.gpa)
                .map_err(|_| LinearError::Unmapped(gva))
        };
        let check = |w: LinearWindow, samples: &[u64]| -> Result<LinearWindow, LinearError> {
            for &s in samples {
                let gva = Gva(s);
                let window = Gpa(s.wrapping_sub(w.delta));
                let walked = walk(gva)?;
                if walked != window {
                    return Err(LinearError::Disagrees {
                        gva,
                        window,
                        walk: walked,
                    });
                }
            }
            Ok(w)
        };
        let image = match image {
            None => Err(LinearError::NoSymbol("_text/_end")),
            Some((text, end)) if end.0 <= text.0 => Err(LinearError::NoSymbol("_end")),
            Some((text, end)) => walk(text).and_then(|pa| {
                let w = LinearWindow {
                    start: text.0,
                    end: end.0,
                    delta: text.0.wrapping_sub(pa.0),
                };
                let mid = text.0.wrapping_add(((end.0 - text.0) / 2) & !0xfff);
                check(w, &[text.0, mid, end.0 - 1])
            }),
        };
        let direct = {
            let base = match page_offset_base {
                None => Ok(DEFAULT_PAGE_OFFSET),
                Some(at) => {
                    let mut b = [0u8; 8];
                    paging::read_virt(mem, cr3, at, &mut b)
                        .map(|()| u64::from_le_bytes(b))
                        .map_err(|_| LinearError::Unmapped(at))
                }
            };
            base.and_then(|base| {
                let w = LinearWindow {
                    start: base,
                    end: base.saturating_add(DIRECT_MAP_SPAN),
                    delta: base,
                };
                // The image's pages are RAM, so the direct map maps them.
                let img = image?;
                let pa = img.start.wrapping_sub(img.delta);
                let at = |off: u64| base.wrapping_add(off);
                check(
                    w,
                    &[at(pa), at(pa.wrapping_add(0x1000)), at(pa | 0x1f_f000)],
                )
            })
        };
        let windows = [direct, image].iter().filter_map(|w| w.ok()).collect();
        LinearFound {
            maps: LinearMaps { windows },
            direct,
            image,
        }
    }
}

/// A view that reads through a linear window where one holds the whole
/// read, and walks the page tables at `cr3` otherwise (and where the
/// window's physical read fails, so that a hole reads as a walk says).
pub struct LinearView<'m, M: GuestMemory + ?Sized> {
    mem: &'m M,
    cr3: Cr3,
    maps: &'m LinearMaps,
}

impl<'m, M: GuestMemory + ?Sized> LinearView<'m, M> {
    /// The view over `mem` at `cr3` with `maps`.
    pub fn new(mem: &'m M, cr3: Cr3, maps: &'m LinearMaps) -> Self {
        Self { mem, cr3, maps }
    }
}

impl<M: GuestMemory + ?Sized> VirtMemory for LinearView<'_, M> {
    #[inline]
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        if let Some(gpa) = self.maps.gpa(gva, buf.len()) {
            if self.mem.read_phys(gpa, buf).is_ok() {
                return Ok(());
            }
        }
        paging::read_virt(self.mem, self.cr3, gva, buf).map_err(ViewError::from)
    }
}
