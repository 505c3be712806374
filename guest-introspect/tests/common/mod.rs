//! Shared helpers for the tests over real kernel images. The images come
//! from the project's guest scripts (cached outside the repository); if a
//! script fails, the test fails with its stderr.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use guest_introspect::elf::Elf;
use guest_introspect::view::{SegmentView, ViewError, VirtMemory};
use guest_introspect::Gva;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `scripts/guest/<script>` from the repository root and returns the
/// directory of the bzImage path it prints.
fn image_dir(script: &str) -> PathBuf {
    let path = repo_root().join("scripts/guest").join(script);
    let out = Command::new(&path)
        .current_dir(repo_root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{} failed ({}):\n{stderr}",
        path.display(),
        out.status
    );
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        !printed.is_empty(),
        "{} printed no path\n{stderr}",
        path.display()
    );
    Path::new(&printed)
        .parent()
        .unwrap_or_else(|| panic!("{printed} has no directory"))
        .to_path_buf()
}

/// A kernel build: its vmlinux bytes and the directory it came from.
pub struct Image {
    pub dir: PathBuf,
    pub vmlinux: Vec<u8>,
    pub release: String,
}

impl Image {
    fn load(script: &str) -> Self {
        let dir = image_dir(script);
        let vmlinux = std::fs::read(dir.join("vmlinux"))
            .unwrap_or_else(|e| panic!("cannot read {}/vmlinux: {e}", dir.display()));
        let release = std::fs::read_to_string(dir.join("release"))
            .unwrap_or_else(|e| panic!("cannot read {}/release: {e}", dir.display()))
            .trim()
            .to_owned();
        Self {
            dir,
            vmlinux,
            release,
        }
    }

    pub fn elf(&self) -> Elf<'_> {
        Elf::parse(&self.vmlinux).expect("vmlinux is ELF64")
    }

    /// The kernel-half PT_LOAD segments at their link addresses, as the
    /// running kernel maps them without KASLR.
    pub fn view(&self) -> SegmentView<'_> {
        self.elf()
            .load_segments(Gva::is_kernel_image)
            .expect("vmlinux segments")
    }
}

/// Debian's stock 6.1 kernel (stripped: no symbol table; BTF present).
pub fn debian() -> &'static Image {
    static I: OnceLock<Image> = OnceLock::new();
    I.get_or_init(|| Image::load("debian-kernel.sh"))
}

/// The fast-lane 6.12 kernel (full symbols, System.map).
pub fn fast() -> &'static Image {
    static I: OnceLock<Image> = OnceLock::new();
    I.get_or_init(|| Image::load("fast-kernel.sh"))
}

/// One System.map line.
#[derive(Clone, Debug)]
pub struct MapSym {
    pub addr: u64,
    pub kind: char,
    pub name: String,
}

/// The fast-lane build's System.map.
pub fn fast_system_map() -> &'static [MapSym] {
    static M: OnceLock<Vec<MapSym>> = OnceLock::new();
    M.get_or_init(|| {
        let path = fast().dir.join("System.map");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        text.lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                let kind = it.next()?.chars().next()?;
                let name = it.next()?.to_owned();
                Some(MapSym { addr, kind, name })
            })
            .collect()
    })
}

/// name -> address for the System.map (first occurrence).
pub fn fast_map_by_name() -> HashMap<&'static str, u64> {
    let mut m = HashMap::new();
    for s in fast_system_map() {
        m.entry(s.name.as_str()).or_insert(s.addr);
    }
    m
}

/// A view that overrides some bytes of another (a relocated
/// relative_base, a corrupted table).
pub struct Patched<V> {
    pub inner: V,
    pub patches: Vec<(u64, Vec<u8>)>,
}

impl<V: VirtMemory> VirtMemory for Patched<V> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        self.inner.read_virt(gva, buf)?;
        let (s, e) = (gva.0, gva.0 + buf.len() as u64);
        for (at, bytes) in &self.patches {
            let (ps, pe) = (*at, *at + bytes.len() as u64);
            let (lo, hi) = (s.max(ps), e.min(pe));
            if lo < hi {
                buf[(lo - s) as usize..(hi - s) as usize]
                    .copy_from_slice(&bytes[(lo - ps) as usize..(hi - ps) as usize]);
            }
        }
        Ok(())
    }
}

/// A view limited to one address window (reads outside are unmapped).
pub struct Window<V> {
    pub inner: V,
    pub start: u64,
    pub end: u64,
}

impl<V: VirtMemory> VirtMemory for Window<V> {
    fn read_virt(&self, gva: Gva, buf: &mut [u8]) -> Result<(), ViewError> {
        let e = gva
            .0
            .checked_add(buf.len() as u64)
            .ok_or(ViewError::Unmapped { gva, resume: None })?;
        if gva.0 < self.start {
            return Err(ViewError::Unmapped {
                gva,
                resume: Some(Gva(self.start)),
            });
        }
        if e > self.end {
            return Err(ViewError::Unmapped {
                gva: Gva(self.end.max(gva.0)),
                resume: None,
            });
        }
        self.inner.read_virt(gva, buf)
    }
}

/// A guest's memory as the hypervisor sees it: the image's kernel-half
/// segments copied to guest-physical `vaddr - __START_KERNEL_map`, mapped at
/// `vaddr + slide` by 2 MiB pages in page tables of the guest's own, with
/// `kallsyms_relative_base` relocated as KASLR's relocation pass does.
pub struct PagedGuest {
    pub mem: guest_introspect::VecMemory,
    pub cr3: guest_introspect::Cr3,
    pub slide: u64,
}

impl PagedGuest {
    pub fn new(img: &Image, slide: u64, relative_base_at: u64) -> Self {
        use guest_introspect::paging::{PTE_LARGE, PTE_NX, PTE_PRESENT, PTE_WRITABLE};
        use guest_introspect::{Cr3, Gpa, VecMemory};
        const MAP: u64 = 0xffff_ffff_8000_0000;
        const TWO_MIB: u64 = 1 << 21;
        let view = img.view();
        let end = view
            .segments()
            .iter()
            .map(|s| s.base.0 + s.mem_size - MAP)
            .max()
            .unwrap();
        let image_end = (end + TWO_MIB - 1) & !(TWO_MIB - 1);
        // Page tables after the image: PML4, PDPT, two PDs.
        let tables = image_end;
        let mut mem = VecMemory::new(Gpa(0), (tables + 0x4000) as usize);
        for s in view.segments() {
            mem.write(Gpa(s.base.0 - MAP), s.data).unwrap();
        }
        let rb = u64::from_le_bytes(
            mem_read(&mem, relative_base_at - MAP, 8)
                .try_into()
                .unwrap(),
        );
        mem.write_u64(Gpa(relative_base_at - MAP), rb + slide)
            .unwrap();
        let (pml4, pdpt, pd0) = (tables, tables + 0x1000, tables + 0x2000);
        let p = PTE_PRESENT | PTE_WRITABLE;
        mem.write_u64(Gpa(pml4 + 8 * 511), pdpt | p).unwrap();
        mem.write_u64(Gpa(pdpt + 8 * 510), pd0 | p).unwrap();
        mem.write_u64(Gpa(pdpt + 8 * 511), (pd0 + 0x1000) | p)
            .unwrap();
        let mut phys = 0;
        while phys < image_end {
            let va = MAP + slide + phys;
            let pd = if (va >> 30) & 0x1ff == 510 {
                pd0
            } else {
                pd0 + 0x1000
            };
            let e = phys | p | PTE_LARGE | if phys < 0x100_0000 { PTE_NX } else { 0 };
            mem.write_u64(Gpa(pd + 8 * ((va >> 21) & 0x1ff)), e)
                .unwrap();
            phys += TWO_MIB;
        }
        Self {
            mem,
            cr3: Cr3(pml4),
            slide,
        }
    }

    pub fn view(&self) -> guest_introspect::PagedView<'_, guest_introspect::VecMemory> {
        guest_introspect::PagedView::new(&self.mem, self.cr3)
    }
}

fn mem_read(mem: &guest_introspect::VecMemory, gpa: u64, len: usize) -> Vec<u8> {
    use guest_introspect::GuestMemory;
    let mut b = vec![0u8; len];
    mem.read_phys(guest_introspect::Gpa(gpa), &mut b).unwrap();
    b
}
