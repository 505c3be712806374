//! Guest memory as root's emulations reach it: every byte through the
//! guarded door ([`GuardedPhys`], which notes the pages written for the
//! split view), and operands' linear addresses through the guest's own
//! paging, long mode or legacy ([`OperandWalk`]).

use super::*;

/// Guest-physical memory through the guarded door, for the task-switch
/// emulation; it keeps the pages written, for the tracer's shadows.
#[derive(Default)]
pub(super) struct GuardedPhys {
    written: [u64; 8],
    n: usize,
    /// More pages written than `written` holds.
    more: bool,
}

impl GuardedPhys {
    /// Notes the pages of a write of `len` bytes at `gpa`.
    pub(super) fn note(&mut self, gpa: u64, len: usize) {
        let last = gpa.saturating_add(len.max(1) as u64 - 1);
        let mut page = gpa & !0xfff;
        while page <= last {
            if !self.written.iter().take(self.n).any(|&p| p == page) {
                match self.written.get_mut(self.n) {
                    Some(slot) => {
                        *slot = page;
                        self.n += 1;
                    }
                    None => self.more = true,
                }
            }
            page = match page.checked_add(0x1000) {
                Some(p) => p,
                None => break,
            };
        }
    }

    /// The pages written, when all of them are known.
    pub(super) fn pages(&self) -> Option<&[u64]> {
        (!self.more).then(|| self.written.get(..self.n).unwrap_or(&[]))
    }
}

impl hypervisor::task_switch::Phys for GuardedPhys {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        phys::guest_ram().read(gpa, buf).is_ok()
    }
    fn write(&mut self, gpa: u64, buf: &[u8]) -> bool {
        self.note(gpa, buf.len());
        phys::guest_ram().write(gpa, buf).is_ok()
    }
}

/// How a string instruction's memory operand is translated.
pub(super) enum OperandWalk {
    /// IA-32e paging (4-level) from this CR3.
    Long(Cr3),
    /// Legacy paging, or none.
    Legacy(LegacyPaging),
}

impl OperandWalk {
    /// The guest-physical address of `la` if `access` may touch it.
    pub(super) fn translate(
        &self,
        la: u64,
        access: policy::StringAccess,
    ) -> Result<u64, MemoryFault> {
        let (gpa, writable, user) = match self {
            Self::Long(cr3) => match paging::translate(&GuestRam, *cr3, Gva(la)) {
                Ok(t) => (t.gpa.0, t.writable, t.user),
                Err(WalkError::NonCanonical { .. }) => return Err(MemoryFault::General),
                Err(_) => return Err(MemoryFault::Page(la, access.not_present())),
            },
            Self::Legacy(p) => match p.walk(&GuardedPhys::default(), la as u32, access.write) {
                Ok(w) => (w.gpa, w.writable, w.user),
                Err(_) => return Err(MemoryFault::Page(la, access.not_present())),
            },
        };
        match access.denied(writable, user) {
            Some(code) => Err(MemoryFault::Page(la, code)),
            None => Ok(gpa),
        }
    }
}

/// The guest's legacy paging mode, from CR0.PG (set), CR4.PAE and PSE, and
/// the PDPTEs VMX keeps in the VMCS.
pub(super) fn legacy_paging(v: &Vmcs, cr3: u64, cr4: u64) -> Result<LegacyPaging, VmcsError> {
    Ok(if cr4 & policy::CR4_PAE != 0 {
        LegacyPaging::Pae {
            pdptes: [
                f::GUEST_PDPTE0.read(v)?,
                f::GUEST_PDPTE1.read(v)?,
                f::GUEST_PDPTE2.read(v)?,
                f::GUEST_PDPTE3.read(v)?,
            ],
        }
    } else {
        LegacyPaging::Bits32 {
            cr3: cr3 as u32,
            pse: cr4 & policy::CR4_PSE != 0,
        }
    })
}

/// Why an emulated memory access faults.
pub(super) enum MemoryFault {
    /// #PF at this linear address, with this error code.
    Page(u64, u32),
    /// #GP(0): a non-canonical address.
    General,
}
