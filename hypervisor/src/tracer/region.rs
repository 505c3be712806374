//! The trampoline region: one code page (the entry and return
//! trampolines) and one page table, both hypervisor frames outside the
//! guest's e820. EPT shows the code page read+execute and the page table
//! read-only, so the guest can use them but never change them. The page
//! table is hung into the guest's kernel page tables at a free 2 MiB slot
//! of the kernel-image mapping (`0xffffffff80000000` + 1 GiB, PUD 510),
//! which no kernel code allocates from after boot: within 2 GiB of kernel
//! text and of module space. The PDE lives in guest memory, so it is
//! checked on every turn and restored (and counted) when the guest has
//! changed it. Shared by every vCPU.

use super::machine::{Env, KernelView, PAGE};
use super::ReqError;
use crate::addr::Gva;
use crate::addr::{Gpa, Hpa};
use crate::ept;
use alloc::format;
use alloc::string::{String, ToString};
use guest_introspect::paging;
use protocol::ErrorKind;
use trampolines::{HypercallMode, TrampolineRegion};

/// Start of the kernel-image mapping (`__START_KERNEL_map`) and its size
/// (`KERNEL_IMAGE_SIZE` with KASLR): PML4 511, PDPT 510.
const KERNEL_MAP: u64 = 0xffff_ffff_8000_0000;
const PML4_KERNEL: u64 = 511;
const PDPT_KERNEL_IMAGE: u64 = 510;
const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_A: u64 = 1 << 5;
const PTE_PS: u64 = 1 << 7;
const PTE_G: u64 = 1 << 8;

/// The region, once built.
pub(super) struct Region {
    pub(super) tramp: TrampolineRegion,
    /// The guest page-table page holding our PDE: write-protected in EPT,
    /// so that a change to the PDE is seen (and undone) at once.
    pub(super) pd_page: u64,
    /// Guest-physical address of the guest PDE we own, and its value.
    pde_gpa: u64,
    pde: u64,
}

impl Region {
    /// Builds the region in the kernel-image mapping of the kernel's own
    /// page tables.
    pub(super) fn build(k: &dyn KernelView, env: &mut Env<'_>) -> Result<Region, ReqError> {
        let internal = |m: String| ReqError::new(ErrorKind::Internal, m);
        let cr3 = k.cr3();
        let pml4e = env
            .ram
            .read_word(cr3.pml4().0 + PML4_KERNEL * 8)
            .unwrap_or(0);
        if pml4e & PTE_P == 0 || pml4e & PTE_PS != 0 {
            return Err(internal(format!("unexpected kernel PML4 entry {pml4e:#x}")));
        }
        let pdpt = pml4e & paging::ADDR_MASK;
        let pdpte = env.ram.read_word(pdpt + PDPT_KERNEL_IMAGE * 8).unwrap_or(0);
        if pdpte & PTE_P == 0 || pdpte & PTE_PS != 0 {
            return Err(internal(format!(
                "unexpected kernel-image PDPT entry {pdpte:#x}"
            )));
        }
        let pd = pdpte & paging::ADDR_MASK;
        // The table is the guest's: it must be a page of guest RAM, or we
        // would write our entry into (and map read+execute) whatever page
        // a forged PDPT entry names, hypervisor memory or MMIO included.
        if !env.ram.is_ram(pd, PAGE as u64) {
            return Err(internal(format!(
                "the kernel-image page directory at {pd:#x} is not guest RAM"
            )));
        }
        // The highest free 2 MiB slot: above the kernel's image and brk.
        let slot = (0..512u64)
            .rev()
            .find(|i| env.ram.read_word(pd + i * 8).is_ok_and(|e| e & PTE_P == 0))
            .ok_or_else(|| internal("no free slot in the kernel-image mapping".into()))?;
        let base = KERNEL_MAP + slot * (2 << 20);
        let tramp = TrampolineRegion::build(Gva(base), HypercallMode::Vmcall)
            .map_err(|e| internal(format!("trampolines: {e:?}")))?;
        let code = env.m.alloc_frame().ok_or_else(|| {
            ReqError::new(
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        let table = env.m.alloc_frame().ok_or_else(|| {
            ReqError::new(
                ErrorKind::OutOfResources,
                "no hypervisor memory for the trampolines".to_string(),
            )
        })?;
        env.m.frame(code).copy_from_slice(tramp.bytes());
        // Present, read-only, supervisor, global, executable; A preset so
        // the CPU never needs to write the (EPT read-only) table.
        let pte = code.0 | PTE_P | PTE_A | PTE_G;
        let t = env.m.frame(table);
        t.fill(0);
        t[..8].copy_from_slice(&pte.to_le_bytes());
        let map = |env: &mut Env<'_>, gpa: Hpa, perms| {
            env.m
                .ept_map(Gpa(gpa.0), gpa, perms)
                .map_err(|e| internal(format!("EPT: {e:?}")))
        };
        map(env, code, ept::READ | ept::EXEC)?;
        map(env, table, ept::READ)?;
        env.m.invept();
        let pde = table.0 | PTE_P | PTE_RW | PTE_A;
        let pde_gpa = pd + slot * 8;
        env.ram
            .write_word(pde_gpa, pde)
            .map_err(|e| internal(format!("writing the trampolines' PDE: {e}")))?;
        map(env, Hpa(pd), ept::READ | ept::EXEC)?;
        env.m.invept();
        log::info!(
            "tracer: trampolines at {base:#x} (PD slot {slot}, code frame {:#x}, entry {} bytes)",
            code.0,
            tramp.entry_len()
        );
        Ok(Region {
            tramp,
            pd_page: pd,
            pde_gpa,
            pde,
        })
    }

    /// Puts our PDE back if the guest changed it; true when it had.
    pub(super) fn restore_pde(&self, env: &mut Env<'_>) -> bool {
        if env.ram.read_word(self.pde_gpa).ok() == Some(self.pde) {
            return false;
        }
        let _ = env.ram.write_word(self.pde_gpa, self.pde);
        log::warn!("tracer: the guest changed the trampolines' PDE; restored");
        true
    }

    /// The return trampoline's address.
    pub(super) fn return_trampoline(&self) -> u64 {
        self.tramp.return_trampoline().0
    }
}
