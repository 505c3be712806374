//! The VMCS fields a nested KVM lets root reach without an exit.
//!
//! Under KVM with nested VMX, root's VMCS is KVM's `vmcs12`, and KVM
//! gives root a shadow VMCS holding a copy of a few fields: a VMREAD or
//! VMWRITE of one of them runs in hardware, and any other field's access
//! exits to KVM (thousands of cycles each, and on a write a resync of the
//! nested VMCS at the next entry). The list is KVM's
//! `arch/x86/kvm/vmx/vmcs_shadow_fields.h`, as it stands from Linux 5.3
//! (two-argument entries, pin-based controls shadowed) to 6.12; fields
//! KVM shadows read-only exit on a write.
//!
//! The paths paid per event (a hit, a return, a turn) stay inside this
//! list but for what each names and counts (`VmcsIo::unshadowed`, the
//! per-vCPU `vmcs_unshadowed` of the status report).

/// SDM encodings of the fields KVM shadows read-write.
pub const KVM_SHADOWED_RW: &[u32] = &[
    // 16-bit: guest interrupt status, PML index, host FS/GS selectors.
    0x0810, 0x0812, 0x0c08, 0x0c0a,
    // 32-bit: pin-based and primary controls, exception bitmap, entry
    // exception error code, entry interruption info, entry instruction
    // length, TPR threshold, interruptibility, preemption timer value.
    0x4000, 0x4002, 0x4004, 0x4018, 0x4016, 0x401a, 0x401c, 0x4824, 0x482e,
    // Natural width: guest RIP, RSP, CR0, CR3, CR4, RFLAGS; CR0 mask,
    // CR0 and CR4 read shadows; host FS and GS bases.
    0x681e, 0x681c, 0x6800, 0x6802, 0x6804, 0x6820, 0x6000, 0x6004, 0x6006, 0x6c06, 0x6c08,
];

/// SDM encodings of the fields KVM shadows read-only.
pub const KVM_SHADOWED_RO: &[u32] = &[
    // 32-bit exit information: reason, interruption info and error code,
    // IDT-vectoring info and error code, instruction length; guest CS and
    // SS access rights.
    0x4402, 0x4404, 0x4406, 0x4408, 0x440a, 0x440c, 0x4816, 0x4818,
    // Natural width: exit qualification, guest-linear address.
    0x6400, 0x640a, // 64-bit: guest-physical address, both halves.
    0x2400, 0x2401,
];

const fn contains(list: &[u32], encoding: u32) -> bool {
    let mut rest = list;
    while let [first, tail @ ..] = rest {
        if *first == encoding {
            return true;
        }
        rest = tail;
    }
    false
}

/// Whether a VMREAD of `encoding` runs without an exit under nested KVM.
pub const fn read_shadowed(encoding: u32) -> bool {
    contains(KVM_SHADOWED_RW, encoding) || contains(KVM_SHADOWED_RO, encoding)
}

/// Whether a VMWRITE of `encoding` runs without an exit under nested KVM.
pub const fn write_shadowed(encoding: u32) -> bool {
    contains(KVM_SHADOWED_RW, encoding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracer::machine::CpuView;
    use crate::vmx::entry::{self, Pending};
    use crate::vmx::fields::{self as f, VmcsIo};
    use crate::vmx::regs::GuestRegs;
    use std::cell::RefCell;
    use std::collections::{BTreeSet, HashMap};

    /// An in-memory VMCS that remembers every field touched, and which of
    /// them a nested KVM would have exited on.
    #[derive(Default)]
    struct Recording {
        fields: HashMap<u32, u64>,
        touched: RefCell<BTreeSet<(u32, bool)>>,
        exits: RefCell<Vec<(u32, bool)>>,
        /// VMREADs and VMWRITEs, each counted.
        accesses: RefCell<[u32; 2]>,
    }

    impl VmcsIo for Recording {
        fn read_raw(&self, e: u32) -> Option<u64> {
            self.touched.borrow_mut().insert((e, false));
            self.accesses.borrow_mut()[0] += 1;
            Some(*self.fields.get(&e).unwrap_or(&0))
        }
        fn write_raw(&mut self, e: u32, v: u64) -> bool {
            self.touched.borrow_mut().insert((e, true));
            self.accesses.borrow_mut()[1] += 1;
            self.fields.insert(e, v);
            true
        }
        fn unshadowed(&self, e: u32, write: bool) {
            self.exits.borrow_mut().push((e, write));
        }
    }

    impl Recording {
        /// Every field touched is one KVM shadows for that access.
        fn assert_all_shadowed(&self) {
            for &(e, write) in self.touched.borrow().iter() {
                let ok = if write {
                    write_shadowed(e)
                } else {
                    read_shadowed(e)
                };
                assert!(ok, "field {e:#x} (write: {write}) is not shadowed");
            }
        }
    }

    thread_local! {
        /// The VMCS a lazy GS read reaches (a `fn` cannot capture one).
        static GS_READS: RefCell<u32> = const { RefCell::new(0) };
    }

    fn read_gs() -> u64 {
        GS_READS.with(|n| *n.borrow_mut() += 1);
        0xffff_8880_7fc0_0000
    }

    /// One VMCALL exit as root takes it (`exits::run`, `vmcall_exit` and
    /// `hypercall`):
    /// the exit, the event it interrupted, the hypercall's RIP and view,
    /// what the hit asks of the view, the VMCALL skipped, the next entry.
    fn one_hit(v: &mut Recording, needs_current: bool, handled: bool) {
        v.fields.insert(f::EXIT_REASON.encoding, 18);
        v.fields.insert(f::EXIT_INSTRUCTION_LEN.encoding, 3);
        v.fields
            .insert(f::GUEST_RIP.encoding, 0xffff_ffff_c000_1000);
        let raw = entry::read_exit(v, &GuestRegs::default()).unwrap();
        assert_eq!(raw.reason, 18);
        assert_eq!(entry::read_vectoring_of(v, &raw).unwrap(), None);
        let rip = f::GUEST_RIP.read(v).unwrap();
        assert_eq!(rip, 0xffff_ffff_c000_1000);
        // Not the entry VMCALL here: the fast path reads nothing more.
        assert!(entry::fast_entry_at(v, rip, rip + 0x400).unwrap().is_none());
        let cpu = CpuView::read(v, || unreachable!("kernel mode"), read_gs).unwrap();
        if needs_current {
            assert_eq!(cpu.kernel_gs(), 0xffff_8880_7fc0_0000);
            assert_eq!(cpu.kernel_gs(), 0xffff_8880_7fc0_0000);
        }
        let mut pending = Pending {
            inject: entry::hypercall_end(v, rip, handled).unwrap(),
            ..Pending::default()
        };
        entry::prepare_entry(v, &mut pending, false).unwrap();
    }

    #[test]
    fn a_hit_touches_only_fields_a_nested_kvm_shadows() {
        // A count's hit: no field outside the shadow VMCS.
        let mut v = Recording::default();
        one_hit(&mut v, false, true);
        assert_eq!(*v.exits.borrow(), [], "a count's hit exits to KVM");
        // The reason, RIP, SS access rights, CR3, CR4, RSP, the
        // instruction length and the interruptibility; RIP written past
        // the VMCALL.
        assert_eq!(*v.accesses.borrow(), [8, 1], "VMREADs and VMWRITEs per hit");
        assert_eq!(f::GUEST_RIP.read(&v).unwrap(), 0xffff_ffff_c000_1003);
        v.assert_all_shadowed();
        // A hit that records the running task reads GUEST_GS_BASE once,
        // however often it asks.
        GS_READS.with(|n| *n.borrow_mut() = 0);
        let mut v = Recording::default();
        one_hit(&mut v, true, true);
        assert_eq!(GS_READS.with(|n| *n.borrow()), 1);
        // A foreign VMCALL: #UD injected at the next entry, RIP unmoved,
        // still nothing outside the shadow.
        let mut v = Recording::default();
        one_hit(&mut v, false, false);
        assert_eq!(*v.exits.borrow(), []);
        assert_eq!(f::GUEST_RIP.read(&v).unwrap(), 0xffff_ffff_c000_1000);
        assert_ne!(f::ENTRY_INTERRUPTION_INFO.read(&v).unwrap(), 0);
    }

    #[test]
    fn a_fast_hit_reads_four_shadowed_fields_and_writes_one() {
        // `exits::run` and `vmcall_exit`: the reason, the entry VMCALL's
        // RIP, SS access rights and RSP; RIP past the VMCALL; an entry with
        // nothing to deliver.
        const VMCALL: u64 = 0xffff_ffff_c000_1000;
        let mut v = Recording::default();
        v.fields.insert(f::EXIT_REASON.encoding, 18);
        v.fields.insert(f::GUEST_RIP.encoding, VMCALL);
        assert_eq!(f::EXIT_REASON.read(&v).unwrap(), 18);
        let rip = f::GUEST_RIP.read(&v).unwrap();
        let exit = entry::fast_entry_at(&v, rip, VMCALL).unwrap().unwrap();
        entry::fast_entry_end(&mut v, &exit).unwrap();
        entry::prepare_entry(&mut v, &mut Pending::default(), false).unwrap();
        assert_eq!(
            *v.accesses.borrow(),
            [4, 1],
            "VMREADs and VMWRITEs per fast hit"
        );
        assert_eq!(*v.exits.borrow(), [], "a fast hit exits to KVM");
        v.assert_all_shadowed();
        assert_eq!(f::GUEST_RIP.read(&v).unwrap(), VMCALL + 3);
    }

    #[test]
    fn unshadowed_fields_are_reported_on_each_access() {
        let mut v = Recording::default();
        f::GUEST_GS_BASE.read(&v).unwrap();
        f::HOST_RSP.write(&mut v, 1).unwrap();
        f::HOST_RIP.write(&mut v, 2).unwrap();
        f::EPT_POINTER.write(&mut v, 3).unwrap();
        // Shadowed read-only: a read is free, a write is not.
        f::GUEST_SS_ACCESS_RIGHTS.read(&v).unwrap();
        f::GUEST_SS_ACCESS_RIGHTS.write(&mut v, 0x93).unwrap();
        f::GUEST_RSP.write(&mut v, 4).unwrap();
        f::EXIT_REASON.read(&v).unwrap();
        assert_eq!(
            *v.exits.borrow(),
            [
                (f::GUEST_GS_BASE.encoding, false),
                (f::HOST_RSP.encoding, true),
                (f::HOST_RIP.encoding, true),
                (f::EPT_POINTER.encoding, true),
                (f::GUEST_SS_ACCESS_RIGHTS.encoding, true),
            ]
        );
    }

    #[test]
    fn the_lists_name_kvms_fields() {
        // Spot checks against the SDM's encodings of fields KVM names.
        for (field, rw) in [
            (f::GUEST_RIP.encoding, true),
            (f::GUEST_INTERRUPTIBILITY.encoding, true),
            (f::PREEMPTION_TIMER_VALUE.encoding, true),
            (f::PIN_BASED_CONTROLS.encoding, true),
            (f::HOST_GS_BASE.encoding, true),
            (f::EXIT_QUALIFICATION.encoding, false),
            (f::GUEST_PHYSICAL_ADDRESS.encoding, false),
            (f::GUEST_CS_ACCESS_RIGHTS.encoding, false),
        ] {
            assert!(read_shadowed(field), "{field:#x}");
            assert_eq!(write_shadowed(field), rw, "{field:#x}");
        }
        for field in [
            f::GUEST_GS_BASE.encoding,
            f::EPT_POINTER.encoding,
            f::HOST_RSP.encoding,
            f::GUEST_PENDING_DEBUG_EXCEPTIONS.encoding,
            f::SECONDARY_PROC_CONTROLS.encoding,
            f::ENTRY_CONTROLS.encoding,
        ] {
            assert!(!read_shadowed(field), "{field:#x}");
        }
        assert_eq!(KVM_SHADOWED_RW.len(), 24);
        assert_eq!(KVM_SHADOWED_RO.len(), 12);
        let all: BTreeSet<u32> = KVM_SHADOWED_RW
            .iter()
            .chain(KVM_SHADOWED_RO)
            .copied()
            .collect();
        assert_eq!(all.len(), 36, "a field listed twice");
    }
}
