//! Outcomes, and the documented differences between root and the bare CPU.
//!
//! Each operation's outcome goes into the window's main digest, except the
//! part that a documented difference covers: that part goes into the
//! digest of its class instead. The host compares main digests for
//! equality (any difference is a bug) and reports each class's digests as
//! a known difference, which its tests expect to see where root really
//! differs. The classes and their reasons are in docs/ARCHITECTURE.md
//! ("Threat model", the fuzzing guest's differences).

use crate::digest::Digest;
use crate::ops::{IpiKind, Op};

/// `Outcome::vector` when nothing faulted.
pub const NO_FAULT: u8 = 0xFF;

/// What one operation came to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The exception vector that ended it, or [`NO_FAULT`].
    pub vector: u8,
    /// Its error code.
    pub error: u64,
    /// CR2 for #PF, DR6 for #DB.
    pub addr: u64,
    /// Result values, per operation (registers, read-backs).
    pub vals: [u64; 4],
}

impl core::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.vector == NO_FAULT {
            write!(f, "ok")?;
        } else {
            write!(
                f,
                "#{} err={:#x} addr={:#x}",
                self.vector, self.error, self.addr
            )?;
        }
        write!(
            f,
            " [{:#x} {:#x} {:#x} {:#x}]",
            self.vals[0], self.vals[1], self.vals[2], self.vals[3]
        )
    }
}

/// The documented differences, by name (the digest line's keys).
pub const CLASSES: [&str; 8] = [
    "cpuid-filter",
    "com2-logport",
    "ide-busmaster",
    "msr-refused",
    "apic-refused",
    "cr4-vmxe",
    "init-sipi",
    "trampoline",
];

/// "cpuid-filter": root's CPUID filter (VMX, SMX, the debug store and the
/// hypervisor bit hidden; leaves it does not know read 0).
pub const CPUID_FILTER: usize = 0;
/// "com2-logport": COM2 (root's control line) and the log port, which
/// root owns: the guest reads 0xFF and its writes go nowhere.
pub const COM2_LOGPORT: usize = 1;
/// "ide-busmaster": the IDE bus-master block, which root hides (no DMA
/// into its memory).
pub const IDE_BUSMASTER: usize = 2;
/// "msr-refused": the MSRs root refuses or answers itself.
pub const MSR_REFUSED: usize = 3;
/// "apic-refused": with more than one vCPU, APIC stores root does not
/// carry out.
pub const APIC_REFUSED: usize = 4;
/// "cr4-vmxe": CR4.VMXE, which root keeps for itself (#GP on setting it).
pub const CR4_VMXE: usize = 5;

/// "init-sipi": with more than one vCPU, INIT and SIPI IPIs are root's
/// (it starts and parks the APs itself): they never reach the APIC, so
/// its error status (send accept) and ICR do not show them.
pub const INIT_SIPI: usize = 6;

/// "trampoline": with hooks in, root maps its trampoline page in the
/// guest's kernel page directory (read-only, executable): the guest can
/// read it and run it (root refuses its hypercalls from there with #UD),
/// where the bare machine has nothing mapped.
pub const TRAMPOLINE: usize = 7;

/// What the classification needs to know of the machine.
#[derive(Clone, Copy, Debug, Default)]
pub struct Env {
    /// vCPUs running (root only intercepts the APIC with more than one).
    pub cpus: u32,
    /// The IDE bus-master block's first port (0: none found).
    pub ide_busmaster: u16,
}

/// COM2's ports.
pub const COM2: core::ops::RangeInclusive<u16> = 0x2F8..=0x2FF;
/// Root's log port.
pub const LOG_PORT: u16 = 0xE9;

/// Leaf 1 ECX bits root passes (it hides DTES64, DS-CPL, VMX, SMX, bits
/// 10, 11, 16 and 18, and the hypervisor bit).
pub const LEAF1_ECX_PASSED: u64 = 0xFFFF_FFFF
    & !(1 << 2 | 1 << 4 | 1 << 5 | 1 << 6 | 1 << 10 | 1 << 11 | 1 << 16 | 1 << 18 | 1 << 31);
/// Leaf 1 EDX bits root passes (it hides bits 10, 18, 20, 21 (the debug
/// store) and 30).
pub const LEAF1_EDX_PASSED: u64 = 0xFFFF_FFFF & !(1 << 10 | 1 << 18 | 1 << 20 | 1 << 21 | 1 << 30);

/// Leaves root passes unchanged.
fn cpuid_passed(leaf: u32) -> bool {
    matches!(
        leaf,
        2 | 4 | 5 | 0xA | 0xB | 0x8000_0002..=0x8000_0004 | 0x8000_0006
    )
}

/// MSRs whose access root refuses or answers itself: the feature control
/// and VMX capability MSRs (a VMX the guest does not get), the APIC base
/// (its writes), the PEBS, RTIT and DS controls it keeps at 0, the x2APIC
/// ICR and LVTs (routed by root), and every MSR outside the two ranges
/// the MSR bitmap covers, which root refuses with #GP (Bochs' default
/// `ignore_bad_msrs` reads 0 and ignores writes there).
pub fn msr_refused(msr: u32) -> bool {
    matches!(msr, 0x1B | 0x3A | 0x3F1 | 0x480..=0x491 | 0x570 | 0x600 | 0x82F..=0x837)
        || !matches!(msr, 0..=0x1FFF | 0xC000_0000..=0xC000_1FFF)
}

/// APIC registers whose stores root carries out with more than one vCPU
/// (LVTs and the ICR go through its own checks, which pass the values the
/// program writes).
pub fn apic_carried_out(offset: u16) -> bool {
    matches!(
        offset & !0xF,
        0x80 | 0xB0 | 0xD0 | 0xE0 | 0xF0 | 0x280 | 0x300 | 0x310 | 0x320
            ..=0x370 | 0x2F0 | 0x380 | 0x3E0
    )
}

fn port_in(port: u16, width: u8, lo: u16, hi: u16) -> bool {
    let last = u32::from(port) + u32::from(width) - 1;
    u32::from(port) <= u32::from(hi) && last >= u32::from(lo)
}

fn port_is_roots(port: u16, width: u8) -> bool {
    port_in(port, width, *COM2.start(), *COM2.end()) || port_in(port, width, LOG_PORT, LOG_PORT)
}

/// Splits `out` into the part every run must agree on and, for an
/// operation a documented difference covers, that class and the part it
/// covers.
pub fn split(op: &Op, out: &Outcome, env: &Env) -> (Outcome, Option<(usize, Outcome)>) {
    // The far jumps run CPUID in compatibility mode: the same filter.
    if let Op::Far { leaf, .. } = *op {
        return split(&Op::Cpuid { leaf, sub: 0 }, out, env);
    }
    match *op {
        Op::Cpuid { leaf: 1, .. } if out.vector == NO_FAULT => {
            let mut main = *out;
            main.vals[2] &= LEAF1_ECX_PASSED;
            main.vals[3] &= LEAF1_EDX_PASSED;
            let mut known = blank();
            known.vals[2] = out.vals[2] & !LEAF1_ECX_PASSED;
            known.vals[3] = out.vals[3] & !LEAF1_EDX_PASSED;
            (main, Some((CPUID_FILTER, known)))
        }
        Op::Cpuid { leaf, .. } if !cpuid_passed(leaf) => (blank(), Some((CPUID_FILTER, *out))),
        Op::In { port, width } | Op::Out { port, width, .. } if port_is_roots(port, width) => {
            (blank(), Some((COM2_LOGPORT, *out)))
        }
        Op::In { port, width } | Op::Out { port, width, .. }
            if env.ide_busmaster != 0
                && port_in(port, width, env.ide_busmaster, env.ide_busmaster + 15) =>
        {
            (blank(), Some((IDE_BUSMASTER, *out)))
        }
        Op::Rdmsr { msr } | Op::Wrmsr { msr, .. } if msr_refused(msr) => {
            (blank(), Some((MSR_REFUSED, *out)))
        }
        Op::ApicStore { offset, .. } if env.cpus > 1 && !apic_carried_out(offset) => {
            (blank(), Some((APIC_REFUSED, *out)))
        }
        Op::MmioStore { .. } if env.cpus > 1 => (blank(), Some((APIC_REFUSED, *out))),
        Op::Cr4 { flip } if flip & (1 << 13) != 0 => (blank(), Some((CR4_VMXE, *out))),
        Op::Trampoline { .. } => (blank(), Some((TRAMPOLINE, *out))),
        Op::Ipi(IpiKind::InitNobody(_) | IpiKind::SipiSelf(_) | IpiKind::InitDeassertAll)
            if env.cpus > 1 =>
        {
            (blank(), Some((INIT_SIPI, *out)))
        }
        _ => (*out, None),
    }
}

fn blank() -> Outcome {
    Outcome {
        vector: NO_FAULT,
        error: 0,
        addr: 0,
        vals: [0; 4],
    }
}

fn add(d: &mut Digest, index: u64, o: &Outcome) {
    d.add(index);
    d.add(u64::from(o.vector));
    d.add(o.error);
    d.add(o.addr);
    for v in o.vals {
        d.add(v);
    }
}

/// Adds the part of operation `index`'s outcome every run must agree on
/// to `d` (a block digest: the same part a window's main digest takes).
pub fn fold_main(index: u64, op: &Op, out: &Outcome, d: &mut Digest, env: &Env) {
    add(d, index, &split(op, out, env).0);
}

/// Adds operation `index`'s outcome to the window's digests.
pub fn fold(
    index: u64,
    op: &Op,
    out: &Outcome,
    main: &mut Digest,
    classes: &mut [Digest; CLASSES.len()],
    seen: &mut [bool; CLASSES.len()],
    env: &Env,
) {
    let (m, k) = split(op, out, env);
    add(main, index, &m);
    if let Some((c, o)) = k {
        add(&mut classes[c], index, &o);
        seen[c] = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(vals: [u64; 4]) -> Outcome {
        Outcome {
            vector: NO_FAULT,
            error: 0,
            addr: 0,
            vals,
        }
    }

    const ONE: Env = Env {
        cpus: 1,
        ide_busmaster: 0xC000,
    };

    #[test]
    fn the_vmx_bit_goes_to_its_class_and_the_rest_of_leaf_1_does_not() {
        let op = Op::Cpuid { leaf: 1, sub: 0 };
        // Bochs' haswell leaf 1, bare and as root's filter leaves it.
        let bare = ok([0x306C3, 0x800, 0x7FFA_F3BF, 0xBFEB_FBFF]);
        let root = ok([0x306C3, 0x800, 0x7FFA_F38B, 0xBFCB_FBFF]);
        let (mb, kb) = split(&op, &bare, &ONE);
        let (mr, kr) = split(&op, &root, &ONE);
        assert_eq!(mb, mr, "the filtered bits must not reach the main digest");
        assert_ne!(kb, kr, "but their class must see them");
        // Any other bit of leaf 1 is a bug, not a known difference.
        let mut other = bare;
        other.vals[2] ^= 1 << 0;
        assert_ne!(split(&op, &other, &ONE).0, mb);
        other = bare;
        other.vals[1] ^= 1;
        assert_ne!(split(&op, &other, &ONE).0, mb);
        // A leaf root passes whole stays in the main digest.
        let op4 = Op::Cpuid { leaf: 4, sub: 0 };
        assert_ne!(split(&op4, &bare, &ONE).0, split(&op4, &root, &ONE).0);
        assert!(split(&op4, &bare, &ONE).1.is_none());
    }

    #[test]
    fn roots_ports_and_msrs_go_to_their_classes() {
        let com2 = Op::In {
            port: 0x2FD,
            width: 1,
        };
        let (m, k) = split(&com2, &ok([0x60, 0, 0, 0]), &ONE);
        assert_eq!(m, blank());
        assert_eq!(k.unwrap().0, COM2_LOGPORT);
        // A dword at 0x2F5 touches COM2; at 0x2F4 or 0x300 it does not.
        assert!(port_is_roots(0x2F5, 4));
        assert!(!port_is_roots(0x2F4, 4));
        assert!(!port_is_roots(0x300, 4));
        let bm = Op::In {
            port: 0xC00F,
            width: 1,
        };
        assert_eq!(split(&bm, &ok([0; 4]), &ONE).1.unwrap().0, IDE_BUSMASTER);
        let past = Op::In {
            port: 0xC010,
            width: 1,
        };
        assert!(split(&past, &ok([0; 4]), &ONE).1.is_none());
        let vmx = Op::Rdmsr { msr: 0x480 };
        assert_eq!(
            split(&vmx, &ok([5, 0, 0, 0]), &ONE).1.unwrap().0,
            MSR_REFUSED
        );
        let far = Op::Rdmsr { msr: 0x1234_5678 };
        assert_eq!(split(&far, &ok([0; 4]), &ONE).1.unwrap().0, MSR_REFUSED);
        let pat = Op::Rdmsr { msr: 0x277 };
        assert!(split(&pat, &ok([5, 0, 0, 0]), &ONE).1.is_none());
    }

    #[test]
    fn apic_stores_are_only_refused_with_several_vcpus() {
        let two = Env { cpus: 2, ..ONE };
        let reserved = Op::ApicStore {
            offset: 0x40,
            form: 0,
            value: 1,
        };
        assert!(split(&reserved, &ok([0; 4]), &ONE).1.is_none());
        assert_eq!(
            split(&reserved, &ok([0; 4]), &two).1.unwrap().0,
            APIC_REFUSED
        );
        let eoi = Op::ApicStore {
            offset: 0xB0,
            form: 0,
            value: 0,
        };
        assert!(split(&eoi, &ok([0; 4]), &two).1.is_none());
        let vmxe = Op::Cr4 {
            flip: 1 << 13 | 1 << 7,
        };
        assert_eq!(split(&vmxe, &ok([0; 4]), &ONE).1.unwrap().0, CR4_VMXE);
        assert!(split(&Op::Cr4 { flip: 1 << 7 }, &ok([0; 4]), &ONE)
            .1
            .is_none());
    }

    #[test]
    fn folding_depends_on_index_and_outcome() {
        let op = Op::Cpuid { leaf: 4, sub: 0 };
        let mut classes = [Digest::new(); CLASSES.len()];
        let mut seen = [false; CLASSES.len()];
        let mut a = Digest::new();
        fold(
            0,
            &op,
            &ok([1, 2, 3, 4]),
            &mut a,
            &mut classes,
            &mut seen,
            &ONE,
        );
        let mut b = Digest::new();
        fold(
            1,
            &op,
            &ok([1, 2, 3, 4]),
            &mut b,
            &mut classes,
            &mut seen,
            &ONE,
        );
        let mut c = Digest::new();
        fold(
            0,
            &op,
            &ok([1, 2, 3, 5]),
            &mut c,
            &mut classes,
            &mut seen,
            &ONE,
        );
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert!(!seen.iter().any(|&s| s));
    }
}
