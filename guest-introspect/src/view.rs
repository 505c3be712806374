//! Memory views: guest-virtual memory as the kernel sees it, whatever backs
//! it.
//!
//! The kallsyms, fentry and BTF code only speaks [`VirtMemory`]. In the
//! hypervisor the view is [`PagedView`] (the guest's own page tables over
//! guest RAM); on the host it is [`SegmentView`], a vmlinux ELF's `PT_LOAD`
//! segments placed at their virtual addresses (see [`crate::elf`]).

use alloc::vec::Vec;
use core::fmt;

use crate::addr::{Gva, GvaRange};
use crate::mem::GuestMemory;
use crate::paging::{self, Cr3, WalkError};

/// Why a guest-virtual read failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ViewError {
    /// `gva` has no backing in this view. `resume` is the first address
    /// after the hole that might be backed, when the view knows it; a
    /// scanner can jump there.
    Unmapped {
        /// The first byte that could not be read.
        gva: Gva,
        /// Where backing may start again.
        resume: Option<Gva>,
    },
    /// The page walk failed in another way (malformed entry, a table outside
    /// guest RAM).
    Walk(WalkError),
    /// The read was refused: the work budget of the search is spent
    /// ([`crate::budget::Metered`]). Not a hole: a scan must stop here.
    OverBudget {
        /// The first byte asked for.
        gva: Gva,
    },
}

impl ViewError {
    /// The first byte that could not be read.
    pub fn gva(&self) -> Gva {
        match *self {
            Self::Unmapped { gva, .. } => gva,
            Self::Walk(e) => e.gva(),
            Self::OverBudget { gva } => gva,
        }
    }
}

impl fmt::Display for ViewError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Unmapped { gva, .. } => write!(f, "{gva} is not mapped"),
            Self::Walk(e) => write!(f, "{e}"),
            Self::OverBudget { gva } => {
                write!(f, "read at {gva} refused: the work budget is spent")
            }
        }
    }
}

impl From<WalkError> for ViewError {
    fn from(e: WalkError) -> Self {
        match e {
            WalkError::NotPresent { gva, .. } | WalkError::NonCanonical { gva } => Self::Unmapped {
                gva,
                resume: e.resume_at(),
            },
            other => Self::Walk(other),
        }
    }
}

/// Read access to guest-virtual memory.
pub trait VirtMemory {
    /// Fills `buf` from `[gva, gva + buf.len())`. On error `buf` may be
    /// partly written.
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError>;
}

impl<T: VirtMemory + ?Sized> VirtMemory for &T {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        (**self).read_virt(gva, buf)
    }
}

/// Reads `N` bytes at `gva`.
pub fn read_array<V: VirtMemory + ?Sized, const N: usize>(
    view: &V,
    gva: Gva,
) -> Result<[u8; N], ViewError> {
    let mut b = [0u8; N];
    view.read_virt(gva, &mut b)?;
    Ok(b)
}

/// Reads a little-endian `u16`.
pub fn read_u16<V: VirtMemory + ?Sized>(view: &V, gva: Gva) -> Result<u16, ViewError> {
    read_array(view, gva).map(u16::from_le_bytes)
}

/// Reads a little-endian `u32`.
pub fn read_u32<V: VirtMemory + ?Sized>(view: &V, gva: Gva) -> Result<u32, ViewError> {
    read_array(view, gva).map(u32::from_le_bytes)
}

/// Reads a little-endian `u64`.
pub fn read_u64<V: VirtMemory + ?Sized>(view: &V, gva: Gva) -> Result<u64, ViewError> {
    read_array(view, gva).map(u64::from_le_bytes)
}

/// Reads `len` bytes at `gva` into a new vector. `len` comes from the caller
/// after it has bounded it (a guest-supplied length must be checked first).
pub fn read_vec<V: VirtMemory + ?Sized>(
    view: &V,
    gva: Gva,
    len: usize,
) -> Result<Vec<u8>, ViewError> {
    let mut v = alloc::vec![0u8; len];
    view.read_virt(gva, &mut v)?;
    Ok(v)
}

/// The guest's virtual memory through its own page tables: the view the
/// hypervisor uses. Every read walks the tables rooted at `cr3` (one walk per
/// page crossed, four 8-byte table reads per walk).
#[derive(Clone, Copy, Debug)]
pub struct PagedView<'m, M: GuestMemory + ?Sized> {
    mem: &'m M,
    cr3: Cr3,
}

impl<'m, M: GuestMemory + ?Sized> PagedView<'m, M> {
    /// A view of the address space rooted at `cr3`.
    pub fn new(mem: &'m M, cr3: Cr3) -> Self {
        Self { mem, cr3 }
    }

    /// The CR3 this view walks from.
    pub fn cr3(&self) -> Cr3 {
        self.cr3
    }
}

impl<M: GuestMemory + ?Sized> VirtMemory for PagedView<'_, M> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        paging::read_virt(self.mem, self.cr3, gva, buf).map_err(ViewError::from)
    }
}

/// One mapped piece of a [`SegmentView`]: `data` at `base`, followed by
/// zeroes up to `mem_size` (an ELF segment's `.bss`).
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    /// Virtual address of the first byte.
    pub base: Gva,
    /// The initialised bytes.
    pub data: &'a [u8],
    /// Total size in memory, at least `data.len()`.
    pub mem_size: u64,
}

impl Segment<'_> {
    /// The addresses this segment covers.
    pub fn range(&self) -> GvaRange {
        GvaRange::with_len(self.base, self.mem_size)
    }
}

/// Borrowed byte slices placed at virtual addresses. Reads may cross from
/// one segment into an adjacent one; a byte in no segment is
/// [`ViewError::Unmapped`] with `resume` at the next segment.
#[derive(Clone, Debug, Default)]
pub struct SegmentView<'a> {
    /// Sorted by base, non-overlapping.
    segments: Vec<Segment<'a>>,
}

impl<'a> SegmentView<'a> {
    /// An empty view.
    pub fn new() -> Self {
        Self {
            segments: Vec::new(),
        }
    }

    /// Adds a segment. Returns `false` (and adds nothing) if it overlaps one
    /// already present, wraps the address space, or has `mem_size` smaller
    /// than its data.
    pub fn add(&mut self, base: Gva, data: &'a [u8], mem_size: u64) -> bool {
        if mem_size < data.len() as u64 || base.checked_add(mem_size).is_none() {
            return false;
        }
        let seg = Segment {
            base,
            data,
            mem_size,
        };
        let r = seg.range();
        if self.segments.iter().any(|s| {
            let o = s.range();
            r.start < o.end && o.start < r.end
        }) {
            return false;
        }
        let at = self.segments.partition_point(|s| s.base < base);
        self.segments.insert(at, seg);
        true
    }

    /// The segments, sorted by address.
    pub fn segments(&self) -> &[Segment<'a>] {
        &self.segments
    }

    /// The same bytes, every segment moved by `slide` bytes (a KASLR slide:
    /// two's complement, so a "negative" slide wraps). `None` if a moved
    /// segment would wrap the address space.
    pub fn slid(&self, slide: u64) -> Option<Self> {
        let mut out = Self::new();
        for s in &self.segments {
            if !out.add(s.base.wrapping_add(slide), s.data, s.mem_size) {
                return None;
            }
        }
        Some(out)
    }

    /// The address ranges covered, one per segment.
    pub fn ranges(&self) -> impl Iterator<Item = GvaRange> + '_ {
        self.segments.iter().map(Segment::range)
    }
}

impl VirtMemory for SegmentView<'_> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = gva.checked_add(done as u64).ok_or(ViewError::Unmapped {
                gva: Gva(u64::MAX),
                resume: None,
            })?;
            // The last segment starting at or below `at`.
            let i = self.segments.partition_point(|s| s.base <= at);
            let seg = match i.checked_sub(1).and_then(|i| self.segments.get(i)) {
                Some(s) if s.range().contains(at) => s,
                _ => {
                    let resume = self.segments.get(i).map(|s| s.base);
                    return Err(ViewError::Unmapped { gva: at, resume });
                }
            };
            let off = at.0 - seg.base.0;
            let n = core::cmp::min((buf.len() - done) as u64, seg.mem_size - off) as usize;
            // `n` fits what is left of `buf`: the error is never returned.
            let out = buf.get_mut(done..done + n).ok_or(ViewError::Unmapped {
                gva: at,
                resume: None,
            })?;
            // Initialised part, then zeroes.
            let init = usize::try_from(off)
                .ok()
                .and_then(|off| seg.data.get(off..))
                .unwrap_or_default();
            let m = core::cmp::min(n, init.len());
            match (out.split_at_mut_checked(m), init.get(..m)) {
                (Some((head, tail)), Some(src)) => {
                    head.copy_from_slice(src);
                    tail.fill(0);
                }
                _ => out.fill(0),
            }
            done += n;
        }
        Ok(())
    }
}

/// Pages a [`PageCache`] keeps.
const CACHED_PAGES: usize = 4;
/// Bytes of a page.
const PAGE: u64 = 4096;

/// A view that keeps the last few whole pages it read from another view,
/// for a walk that reads several tables piece by piece (a module's symtab,
/// strtab and typetab: a few bytes at a time from each of three places).
/// A read within a kept page is a copy; any other reads its whole page
/// once (or, when the whole page cannot be read, just the bytes asked
/// for, uncached). The pages are a snapshot: for one walk, not to keep.
pub struct PageCache<'a, V: ?Sized> {
    inner: &'a V,
    /// `CACHED_PAGES` pages, and which page each holds (`u64::MAX`: none).
    bytes: core::cell::RefCell<Vec<u8>>,
    tags: core::cell::RefCell<[u64; CACHED_PAGES]>,
    /// The slot the next miss replaces (round robin).
    next: core::cell::Cell<usize>,
}

impl<'a, V: VirtMemory + ?Sized> PageCache<'a, V> {
    /// A cache over `inner`; without the heap for its pages it passes
    /// every read through.
    pub fn new(inner: &'a V) -> Self {
        let bytes = crate::fallible::try_vec(0u8, CACHED_PAGES * PAGE as usize).unwrap_or_default();
        Self {
            inner,
            bytes: core::cell::RefCell::new(bytes),
            tags: core::cell::RefCell::new([u64::MAX; CACHED_PAGES]),
            next: core::cell::Cell::new(0),
        }
    }

    /// Copies `[gva, gva + buf.len())`, all within one page, from the cache,
    /// reading the page first if it is not kept.
    fn read_in_page(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let page = gva.0 & !(PAGE - 1);
        let off = (gva.0 - page) as usize;
        let mut bytes = self.bytes.borrow_mut();
        if bytes.is_empty() {
            return self.inner.read_virt(gva, buf);
        }
        let mut tags = self.tags.borrow_mut();
        let slot = match tags.iter().position(|&t| t == page) {
            Some(s) => s,
            None => {
                let s = self.next.get() % CACHED_PAGES;
                let dst = bytes
                    .get_mut(s * PAGE as usize..(s + 1) * PAGE as usize)
                    .ok_or(ViewError::Unmapped { gva, resume: None })?;
                if self.inner.read_virt(Gva(page), dst).is_err() {
                    // Part of the page is not readable (or the budget is
                    // nearly spent): read what was asked for alone.
                    if let Some(t) = tags.get_mut(s) {
                        *t = u64::MAX;
                    }
                    return self.inner.read_virt(gva, buf);
                }
                if let Some(t) = tags.get_mut(s) {
                    *t = page;
                }
                self.next.set(s + 1);
                s
            }
        };
        let from = bytes
            .get(slot * PAGE as usize + off..slot * PAGE as usize + off + buf.len())
            .ok_or(ViewError::Unmapped { gva, resume: None })?;
        buf.copy_from_slice(from);
        Ok(())
    }
}

impl<V: VirtMemory + ?Sized> VirtMemory for PageCache<'_, V> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = gva
                .0
                .checked_add(done as u64)
                .ok_or(ViewError::Unmapped { gva, resume: None })?;
            let in_page = (PAGE - (at & (PAGE - 1))) as usize;
            let n = in_page.min(buf.len() - done);
            let piece = buf
                .get_mut(done..done + n)
                .ok_or(ViewError::Unmapped { gva, resume: None })?;
            self.read_in_page(Gva(at), piece)?;
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cross_and_holes() {
        let a = [1u8, 2, 3, 4];
        let b = [5u8, 6];
        let mut v = SegmentView::new();
        assert!(v.add(Gva(0x1000), &a, 6)); // 1 2 3 4 0 0
        assert!(v.add(Gva(0x1006), &b, 2));
        assert!(!v.add(Gva(0x1005), &b, 2), "overlap refused");
        let mut buf = [0xffu8; 8];
        v.read_virt(Gva(0x1000), &mut buf).unwrap();
        assert_eq!(buf, [1, 2, 3, 4, 0, 0, 5, 6]);
        let e = v.read_virt(Gva(0x1004), &mut [0u8; 8]).unwrap_err();
        assert_eq!(
            e,
            ViewError::Unmapped {
                gva: Gva(0x1008),
                resume: None
            }
        );
        let e = v.read_virt(Gva(0x10), &mut [0u8; 1]).unwrap_err();
        assert_eq!(
            e,
            ViewError::Unmapped {
                gva: Gva(0x10),
                resume: Some(Gva(0x1000))
            }
        );
        let s = v.slid(0x20_0000).unwrap();
        assert_eq!(read_u16(&s, Gva(0x20_1006)), Ok(0x0605));
        assert!(v.slid(u64::MAX - 0x1000).is_none());
    }
}
