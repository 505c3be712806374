//! The guest's routes to the processors' INIT, SMI and interrupt pins that
//! do not go through the local APIC's interrupt command register (which
//! [`crate::apic`] covers): the local APIC's LVT entries, the I/O APIC's
//! redirection entries, and message-signalled interrupts written by the
//! CPU into the MiB at 0xFEE00000 (QEMU turns a store anywhere in that MiB
//! beyond the local APIC's page, and at its offset 0, into an MSI; KVM's
//! QEMU does the same for the part beyond the page).
//!
//! With more than one vCPU, root makes every store to those windows exit
//! ([`Windows::protect`]: the local APIC's page, the rest of the MSI MiB
//! and each I/O APIC's page read-only in EPT; reads and fetches go through
//! as before), decodes the store ([`crate::apic::guest_store`]) and carries
//! it out unless it would program a delivery mode the guest may not use
//! ([`crate::apic::routed_mode_allowed`]: INIT, SMI, the reserved ones).
//! Write-protecting rather than unmapping keeps the loads that Linux does
//! (the I/O APIC's window, the APIC's registers) free of exits and of a
//! load emulator.
//!
//! INIT exits should then never happen once the guest runs (root carries
//! out the guest's INIT itself, from its ICR stores). One that still does
//! (a route not known here) is counted by [`InitLimiter`]: Bochs 2.7 keeps
//! an INIT pending for good, so the AP it reached exits on it again at
//! every start; beyond a few in a second root keeps that AP parked.

use crate::addr::Gpa;
use crate::apic::routed_mode_allowed;
use crate::ept::{Ept, EptError, MemType, TableStore, EXEC, READ};
use core::ops::Range;

/// The MiB whose stores are interrupt messages (SDM 11.11.1: address bits
/// 31..=20 are 0xFEE). The local APIC's page is usually its first page.
pub const MSI_WINDOW: Range<u64> = 0xFEE0_0000..0xFEF0_0000;
/// Where PC chipsets decode I/O APICs (the 82093AA's relocatable range);
/// an I/O APIC the MADT places elsewhere is not watched.
pub const IOAPIC_RANGE: Range<u64> = 0xFEC0_0000..0xFED0_0000;
/// The most I/O APICs root watches.
pub const MAX_IOAPICS: usize = 8;
/// The I/O APIC's register select (index) register, its data window, and
/// the EOI register of version 0x20 (82093AA datasheet 3.1; QEMU's and
/// KVM's I/O APIC).
pub const IOREGSEL: u64 = 0x00;
pub const IOWIN: u64 = 0x10;
pub const IOAPIC_EOI: u64 = 0x40;
/// The first redirection table register (entry 0, low dword).
const IOREDTBL0: u32 = 0x10;

const PAGE: u64 = 0x1000;

/// A guest-physical address inside one of the windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// The local APIC's page, at this offset.
    LocalApic { offset: u64 },
    /// The page of the I/O APIC whose registers start at `base`, at
    /// `offset`.
    IoApic { base: u64, offset: u64 },
    /// The MSI MiB outside the local APIC's page: a store here is an
    /// interrupt message to this address.
    Msi { address: u64 },
}

/// The windows root watches: the local APIC's page, the I/O APICs'
/// pages, the MSI MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    lapic: u64,
    ioapics: [u64; MAX_IOAPICS],
    count: usize,
}

impl Windows {
    /// The windows of the local APIC page at `lapic` and of the I/O APICs
    /// at `ioapics` (each's page; those outside [`IOAPIC_RANGE`], repeated,
    /// or past [`MAX_IOAPICS`] are left out).
    pub fn new(lapic: u64, ioapics: &[u64]) -> Self {
        let mut w = Windows {
            lapic: lapic & !(PAGE - 1),
            ioapics: [0; MAX_IOAPICS],
            count: 0,
        };
        for &base in ioapics {
            let page = base & !(PAGE - 1);
            if !IOAPIC_RANGE.contains(&page) || w.ioapics().contains(&page) {
                continue;
            }
            if let Some(slot) = w.ioapics.get_mut(w.count) {
                *slot = page;
                w.count += 1;
            }
        }
        w
    }

    /// The local APIC's page.
    pub fn lapic(&self) -> u64 {
        self.lapic
    }

    /// The I/O APICs' pages.
    pub fn ioapics(&self) -> &[u64] {
        self.ioapics.get(..self.count).unwrap_or(&[])
    }

    /// Which window `gpa` is in, if any.
    pub fn classify(&self, gpa: u64) -> Option<Window> {
        let page = gpa & !(PAGE - 1);
        let offset = gpa & (PAGE - 1);
        if page == self.lapic {
            return Some(Window::LocalApic { offset });
        }
        if self.ioapics().contains(&page) {
            return Some(Window::IoApic { base: page, offset });
        }
        MSI_WINDOW
            .contains(&gpa)
            .then_some(Window::Msi { address: gpa })
    }

    /// The guest-physical ranges whose stores must exit, page aligned.
    pub fn ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        core::iter::once(self.lapic..self.lapic + PAGE)
            .chain(core::iter::once(MSI_WINDOW))
            .chain(self.ioapics().iter().map(|&p| p..p + PAGE))
    }

    /// Maps every window in `ept` to itself, readable and executable but
    /// not writable, uncacheable (MMIO): a guest store there exits as an
    /// EPT violation, a load does not. 2 MiB leaves around them are split.
    pub fn protect(&self, ept: &Ept, store: &mut impl TableStore) -> Result<(), EptError> {
        for r in self.ranges() {
            ept.map_identity(
                store,
                Gpa(r.start),
                Gpa(r.end),
                READ | EXEC,
                MemType::Uncacheable,
                false,
            )?;
        }
        Ok(())
    }
}

/// What root does with a guest store to an I/O APIC's page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoApicWrite {
    /// Write the value to the I/O APIC.
    Carry,
    /// Drop the store: not a register.
    Ignore,
    /// Drop the store: a redirection entry with a delivery mode the guest
    /// may not program.
    Refuse,
}

/// What root does with a guest store of `value` at `offset` in an I/O
/// APIC's page, whose register select holds `select` (read back from the
/// I/O APIC before the store to the data window). The low dword of each
/// redirection entry (even registers from 0x10) holds the delivery mode.
pub fn ioapic_write(offset: u64, select: u32, value: u32) -> IoApicWrite {
    match offset {
        IOREGSEL | IOAPIC_EOI => IoApicWrite::Carry,
        IOWIN => {
            let reg = select & 0xff;
            let low_dword = reg >= IOREDTBL0 && (reg - IOREDTBL0).is_multiple_of(2);
            if low_dword && !routed_mode_allowed(value) {
                IoApicWrite::Refuse
            } else {
                IoApicWrite::Carry
            }
        }
        _ => IoApicWrite::Ignore,
    }
}

/// Whether root carries out a guest store of `data` into the MSI window
/// (an interrupt message with that data word).
pub fn msi_write(data: u32) -> bool {
    routed_mode_allowed(data)
}

/// A vCPU's INIT exits, counted per window of time. The first
/// [`InitLimiter::LIMIT`] in a window are carried out (the AP is parked, as
/// INIT does); one more and the AP is held parked for the rest of the run:
/// the guest's start-up IPIs to it are dropped. An INIT that Bochs 2.7
/// keeps pending would otherwise park the AP at every start, each start a
/// SIPI exit, an INIT exit and two log lines, for as long as the guest
/// sends SIPIs; no INIT exit comes from a guest that uses the ICR.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InitLimiter {
    window_start: Option<u64>,
    count: u32,
    held: bool,
}

/// What [`InitLimiter::on_init`] says about an INIT exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitVerdict {
    /// Park the AP, as INIT does.
    Park,
    /// Park it and keep it parked; `first` for the exit that passed the
    /// limit (the one to log).
    Hold { first: bool },
}

impl InitLimiter {
    /// INIT exits carried out per window.
    pub const LIMIT: u32 = 4;

    /// An INIT exit at `now` (root's clock), in windows of `window` ticks.
    pub fn on_init(&mut self, now: u64, window: u64) -> InitVerdict {
        if self.held {
            return InitVerdict::Hold { first: false };
        }
        match self.window_start {
            Some(start) if now >= start && now - start < window => {}
            // The first INIT exit, one after the window, or a clock that
            // went back (root's does not): a new window.
            _ => {
                self.window_start = Some(now);
                self.count = 0;
            }
        }
        self.count = self.count.saturating_add(1);
        if self.count <= Self::LIMIT {
            return InitVerdict::Park;
        }
        self.held = true;
        InitVerdict::Hold { first: true }
    }

    /// Whether the AP is held parked: start-up IPIs to it are dropped.
    pub fn holding(&self) -> bool {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::Hpa;
    use crate::ept::tests::VecStore;
    use crate::ept::RWX;

    /// The MMIO hole as root maps it before the windows: 2 MiB leaves,
    /// uncacheable, RWX.
    fn hole() -> (VecStore, Ept) {
        let mut s = VecStore::default();
        let ept = Ept::new(&mut s).unwrap();
        ept.map_identity(
            &mut s,
            Gpa(0xc000_0000),
            Gpa(0x1_0000_0000),
            RWX,
            MemType::Uncacheable,
            true,
        )
        .unwrap();
        (s, ept)
    }

    #[test]
    fn the_whole_apic_mib_and_the_ioapic_page_are_write_protected() {
        let (mut s, ept) = hole();
        let w = Windows::new(0xfee0_0000, &[0xfec0_0000]);
        w.protect(&ept, &mut s).unwrap();
        let perms = |s: &mut VecStore, gpa: u64| {
            let l = ept.translate(s, Gpa(gpa)).unwrap();
            assert_eq!((l.hpa, l.memtype), (Hpa(gpa), 0), "{gpa:#x}");
            l.perms
        };
        // The APIC page, the MSI part of the MiB to its last dword, the
        // I/O APIC's registers: no write.
        for gpa in [
            0xfee0_0000,
            0xfee0_0300,
            0xfee0_1000,
            0xfee0_100c,
            0xfee8_0000,
            0xfeef_fffc,
            0xfec0_0000,
            0xfec0_0010,
            0xfec0_0ff0,
        ] {
            assert_eq!(perms(&mut s, gpa), READ | EXEC, "{gpa:#x}");
        }
        // Their neighbours keep every right: the HPET, the rest of the
        // I/O APIC range, the BIOS above the MiB, the PCI hole below.
        for gpa in [
            0xfed0_0000,
            0xfec0_1000,
            0xfebf_f000,
            0xfedf_f000,
            0xfef0_0000,
            0xfeff_f000,
            0xffff_0000,
            0xc000_0000,
        ] {
            assert_eq!(perms(&mut s, gpa), RWX, "{gpa:#x}");
        }
    }

    #[test]
    fn a_moved_lapic_page_is_protected_besides_the_msi_mib() {
        let (mut s, ept) = hole();
        // The MADT's I/O APICs: one out of the chipset range (left out),
        // one repeated, one more in range.
        let w = Windows::new(
            0xfed4_0000,
            &[0xfec0_0000, 0xd000_0000, 0xfec0_0000, 0xfec2_0000],
        );
        assert_eq!(w.ioapics(), &[0xfec0_0000, 0xfec2_0000]);
        w.protect(&ept, &mut s).unwrap();
        for gpa in [0xfed4_0000, 0xfee0_0000, 0xfeef_f000, 0xfec2_0010] {
            assert_eq!(
                ept.translate(&mut s, Gpa(gpa)).unwrap().perms,
                READ | EXEC,
                "{gpa:#x}"
            );
        }
        assert_eq!(ept.translate(&mut s, Gpa(0xd000_0000)).unwrap().perms, RWX);
        assert_eq!(ept.translate(&mut s, Gpa(0xfed4_1000)).unwrap().perms, RWX);
    }

    #[test]
    fn addresses_are_classified_by_window() {
        let w = Windows::new(0xfee0_0000, &[0xfec0_0000]);
        assert_eq!(w.lapic(), 0xfee0_0000);
        assert_eq!(
            w.classify(0xfee0_0300),
            Some(Window::LocalApic { offset: 0x300 })
        );
        assert_eq!(
            w.classify(0xfee0_0000),
            Some(Window::LocalApic { offset: 0 })
        );
        assert_eq!(
            w.classify(0xfee0_1000),
            Some(Window::Msi {
                address: 0xfee0_1000
            })
        );
        assert_eq!(
            w.classify(0xfeef_fffc),
            Some(Window::Msi {
                address: 0xfeef_fffc
            })
        );
        assert_eq!(
            w.classify(0xfec0_0010),
            Some(Window::IoApic {
                base: 0xfec0_0000,
                offset: 0x10
            })
        );
        for gpa in [0xfef0_0000, 0xfedf_ffff, 0xfec0_1000, 0x1000, 0xfebf_ffff] {
            assert_eq!(w.classify(gpa), None, "{gpa:#x}");
        }
        // Too many I/O APICs: the first MAX_IOAPICS are watched.
        let many: Vec<u64> = (0..12).map(|i| 0xfec0_0000 + i * 0x1000).collect();
        assert_eq!(
            Windows::new(0xfee0_0000, &many).ioapics().len(),
            MAX_IOAPICS
        );
    }

    #[test]
    fn redirection_entries_with_init_are_refused() {
        // Linux's entries: fixed, lowest priority, masked, level; NMI;
        // ExtINT (the 8259's pin through the I/O APIC).
        for ok in [
            0x0000_0030,
            0x0001_a130,
            0x0000_0400,
            0x0000_0700,
            0x0000_8931,
        ] {
            for reg in [0x10, 0x12, 0x3e, 0xfe] {
                assert_eq!(
                    ioapic_write(IOWIN, reg, ok),
                    IoApicWrite::Carry,
                    "{reg:#x} {ok:#x}"
                );
            }
        }
        for bad in [
            0x0000_0500,
            0x0001_0500,
            0x0000_8530,
            0x0000_0200,
            0x0000_0630,
            0x0000_0300,
        ] {
            for reg in [0x10, 0x12, 0x3e, 0x110] {
                assert_eq!(
                    ioapic_write(IOWIN, reg, bad),
                    IoApicWrite::Refuse,
                    "{reg:#x} {bad:#x}"
                );
            }
            // The same value in the ID, the version, a destination (high)
            // dword: no delivery mode there.
            for reg in [0x00, 0x01, 0x02, 0x11, 0x3f] {
                assert_eq!(
                    ioapic_write(IOWIN, reg, bad),
                    IoApicWrite::Carry,
                    "{reg:#x} {bad:#x}"
                );
            }
            // The select register and EOI take any value.
            assert_eq!(ioapic_write(IOREGSEL, 0x10, bad), IoApicWrite::Carry);
            assert_eq!(ioapic_write(IOAPIC_EOI, 0x10, bad), IoApicWrite::Carry);
        }
        for offset in [0x20, 0x30, 0x50, 0xff0] {
            assert_eq!(
                ioapic_write(offset, 0x10, 0),
                IoApicWrite::Ignore,
                "{offset:#x}"
            );
        }
    }

    #[test]
    fn msis_with_init_smi_or_reserved_modes_are_refused() {
        for ok in [0x0000_4031, 0x0000_0131, 0x0000_0400, 0x0000_0700] {
            assert!(msi_write(ok), "{ok:#x}");
        }
        for bad in [
            0x0000_0500,
            0x0000_c500,
            0x0000_0200,
            0x0000_0300,
            0x0000_0699,
        ] {
            assert!(!msi_write(bad), "{bad:#x}");
        }
    }

    #[test]
    fn repeated_init_exits_hold_the_ap_after_the_limit() {
        let window = 1000;
        // Spread out: every one carried out.
        let mut l = InitLimiter::default();
        for i in 0..20u64 {
            assert_eq!(l.on_init(i * window, window), InitVerdict::Park);
            assert!(!l.holding());
        }
        // A burst: the limit, then one more holds the AP, logged once.
        let mut l = InitLimiter::default();
        for i in 0..InitLimiter::LIMIT {
            assert_eq!(l.on_init(10 + u64::from(i), window), InitVerdict::Park);
            assert!(!l.holding());
        }
        assert_eq!(l.on_init(1009, window), InitVerdict::Hold { first: true });
        assert!(l.holding());
        assert_eq!(l.on_init(1010, window), InitVerdict::Hold { first: false });
        assert_eq!(
            l.on_init(99_999, window),
            InitVerdict::Hold { first: false }
        );
        assert!(l.holding());
        // The window is counted from its first exit: the limit spread
        // over the end of one window and the start of the next is fine.
        let mut l = InitLimiter::default();
        for t in [0, 900, 950, 999, 1000, 1001, 1002] {
            assert_eq!(l.on_init(t, window), InitVerdict::Park, "{t}");
        }
        // A clock that went back (root's does not) starts a new window.
        assert_eq!(l.on_init(5, window), InitVerdict::Park);
    }
}
