//! [`choose`] over real profiles: Bochs 2.7's, where root's words must not
//! change, and the nested profile KVM gives an L1 hypervisor under host
//! kernels 5.10, 6.1 and 6.12.
//!
//! Each profile is a table of MSR values read through [`CapProfile::read`],
//! legacy control MSRs included, so the tests also check that the TRUE
//! ones are the ones used.

use super::*;
use std::collections::HashMap;

/// A control MSR from its allowed-0 settings (low half: bits that must
/// be 1) and allowed-1 settings (high half: bits that may be 1).
const fn ctls(allowed0: u32, allowed1: u32) -> u64 {
    ((allowed1 as u64) << 32) | allowed0 as u64
}

/// The legacy control MSRs force these bits to 1 (SDM A.2, the "default1"
/// class); the TRUE ones may clear some of them.
const PIN_DEFAULT1: u64 = 0x16;
const PROC_DEFAULT1: u64 = 0x0401_e172;
const EXIT_DEFAULT1: u64 = 0x0003_6dff;
const ENTRY_DEFAULT1: u64 = 0x11ff;

/// One CPU's capability MSRs, TRUE control MSRs as the profile's words.
#[derive(Clone, Copy)]
struct Caps {
    basic: u64,
    pin: u64,
    proc1: u64,
    proc2: u64,
    exit: u64,
    entry: u64,
    misc: u64,
    ept_vpid: u64,
}

impl Caps {
    /// The MSRs as the CPU answers RDMSR: each legacy control MSR is its
    /// TRUE one with the default1 bits forced (how real CPUs, Bochs and
    /// KVM's `vmx_get_vmx_msr` all report them).
    fn msrs(&self) -> HashMap<u32, u64> {
        HashMap::from([
            (msr::IA32_VMX_BASIC, self.basic),
            (msr::IA32_VMX_TRUE_PINBASED_CTLS, self.pin),
            (msr::IA32_VMX_PINBASED_CTLS, self.pin | PIN_DEFAULT1),
            (msr::IA32_VMX_TRUE_PROCBASED_CTLS, self.proc1),
            (msr::IA32_VMX_PROCBASED_CTLS, self.proc1 | PROC_DEFAULT1),
            (msr::IA32_VMX_TRUE_EXIT_CTLS, self.exit),
            (msr::IA32_VMX_EXIT_CTLS, self.exit | EXIT_DEFAULT1),
            (msr::IA32_VMX_TRUE_ENTRY_CTLS, self.entry),
            (msr::IA32_VMX_ENTRY_CTLS, self.entry | ENTRY_DEFAULT1),
            (msr::IA32_VMX_PROCBASED_CTLS2, self.proc2),
            (msr::IA32_VMX_EPT_VPID_CAP, self.ept_vpid),
            (msr::IA32_VMX_MISC, self.misc),
        ])
    }

    /// Root's reading of these MSRs.
    fn profile(&self) -> CapProfile {
        let msrs = self.msrs();
        CapProfile::read(|m| match msrs.get(&m) {
            Some(v) => *v,
            None => panic!("RDMSR {m:#x}: no such MSR here"),
        })
    }

    fn choose(&self) -> Result<Chosen, Refusal> {
        choose(&self.profile())
    }
}

// ---------------------------------------------------------------------
// Bochs 2.7 (tag REL_2_7_FINAL): cpu/vmx.h builds each MSR from the
// features cpu/vmcs.cc `init_vmx_capabilities` enables for the model
// (cpu/cpudb/intel/*.cc `get_vmx_extensions_bitmask`).
// ---------------------------------------------------------------------

/// `corei7_haswell_4770`, the model the VM tests run on.
const BOCHS_HASWELL: Caps = Caps {
    // Revision 0x2b (BX_VMX_VMCS_REVISION_ID), 4 KiB region, WB,
    // INS/OUTS information (54), TRUE controls (55).
    basic: 0x00d8_1000_0000_002b,
    // External interrupts, NMI exiting, virtual NMIs, preemption timer.
    pin: ctls(0x16, 0x7f),
    // Everything but the monitor trap flag (not implemented in 2.7) and
    // the tertiary controls.
    proc1: ctls(0x0400_6172, 0xf7f9_fffe),
    // Bits 0-14 and #VE (18): no RDSEED, PML, XSAVES or TSC scaling.
    proc2: ctls(0, 0x0004_7fff),
    exit: ctls(0x0003_6dfb, 0x007f_ffff),
    entry: ctls(0x11fb, 0xffff),
    // Timer rate 0; IA32E-mode store (5); HLT, shutdown, wait-for-SIPI
    // (6-8); 4 CR3 targets; VMWRITE to exit fields (29).
    misc: 0x2004_01e0,
    // Root logs this value on Bochs.
    ept_vpid: 0x0000_0f01_0633_4141,
};

/// `corei7_icelake_u`: BASIC, PROCBASED_CTLS2 and EPT_VPID_CAP as
/// measured (the brief's facts); the rest from the same source as
/// haswell, plus the monitor trap flag and zero-length injection.
const BOCHS_ICELAKE_U: Caps = Caps {
    basic: 0x00d8_1000_0000_0004,
    proc1: ctls(0x0400_6172, 0xfff9_fffe),
    proc2: ctls(0, 0x0297_7fff),
    misc: 0x6004_01e0,
    ..BOCHS_HASWELL
};

/// The words root logs on Bochs haswell today
/// ("VMX: revision 0x2b, pin 0x7e proc 0x96006172 proc2 0x10aa exit
/// 0x3f6fff entry 0xd3ff"): the refactor must keep them.
#[test]
fn bochs_haswell_gives_todays_words() {
    let c = BOCHS_HASWELL.choose().unwrap();
    assert_eq!(
        (c.pin, c.proc1, c.proc2, c.exit, c.entry),
        (0x7e, 0x9600_6172, 0x10aa, 0x003f_6fff, 0xd3ff)
    );
    assert!(c.preemption_timer);
    assert_eq!(c.timer_shift, 0);
    assert!(c.wait_for_sipi);
    assert!(c.ins_outs_info);
    assert!(c.vpid());
    assert!(c.exit_saves_pat() && c.exit_loads_pat() && c.entry_loads_pat());
    assert_eq!(c.ept, EptVpidCap(0xf0106334141));
    assert_eq!(c.check_vcpus(2), Ok(()));
}

#[test]
fn bochs_icelake_u_adds_xsaves() {
    let c = BOCHS_ICELAKE_U.choose().unwrap();
    assert_eq!(
        (c.pin, c.proc1, c.proc2, c.exit, c.entry),
        (0x7e, 0x9600_6172, 0x0010_10aa, 0x003f_6fff, 0xd3ff)
    );
    assert_eq!(c.timer_shift, 0);
    assert!(c.wait_for_sipi);
}

// ---------------------------------------------------------------------
// KVM's nested profile: what `-cpu host,+vmx` gives root when L0 runs
// kvm_intel with nested=1 and default parameters. The values are those
// `nested_vmx_setup_ctls_msrs` (arch/x86/kvm/vmx/nested.c) computes and
// `vmx_get_vmx_msr` reports, on a host CPU that allows every control
// KVM lets through (an Ice Lake or Sapphire Rapids class part; where a
// real part lacks one, e.g. MPX's BNDCFGS controls, only bits root does
// not look at change).
//
// 5.10 masks the host's raw VMX MSRs; 6.1 and 6.12 mask KVM's own
// `vmcs_config` (`setup_vmcs_config` in vmx.c: the host's MSRs and
// KVM_REQUIRED_* | KVM_OPTIONAL_*). 6.1 does it in one function, 6.12 in
// `nested_vmx_setup_{pinbased,exit,entry,cpubased,secondary}_ctls`,
// `_misc_data` and `_basic`. QEMU's `-cpu host` is taken to hand these
// bits on unchanged (it rebuilds the MSRs from its own feature names,
// which cover every bit root reads).
// ---------------------------------------------------------------------

/// IA32_VMX_BASIC, all three versions: VMCS12_REVISION 0x11e57ed0,
/// VMCS12_SIZE 0x1000, WB, TRUE controls always (bit 55), INS/OUTS
/// information (54) from the host's BASIC.
const KVM_BASIC: u64 = 0x00d8_1000_11e5_7ed0;

/// Pin-based, all three: allowed-0 PIN_BASED_ALWAYSON_WITHOUT_TRUE_MSR;
/// allowed-1 the host's external-interrupt and NMI exiting, virtual NMIs
/// and (with APICv) posted interrupts, plus the preemption timer, which
/// KVM always offers (it emulates it).
const KVM_PIN: u64 = ctls(0x16, 0xff);

/// Primary, all three: allowed-0 CPU_BASED_ALWAYSON_WITHOUT_TRUE_MSR less
/// CR3-load/store exiting ("free control of CR3 access interception");
/// allowed-1 the host's exiting controls, I/O bitmaps, monitor trap
/// flag, TPR shadow, NMI-window exiting and secondary controls, plus MSR
/// bitmaps always. No tertiary controls.
const KVM_PROC: u64 = ctls(0x0400_6172, 0xfff9_fffe);

/// VM-exit, all three: allowed-0 VM_EXIT_ALWAYSON_WITHOUT_TRUE_MSR less
/// "save debug controls" (free control of it); allowed-1 the host's
/// 64-bit host, PAT save/load and BNDCFGS clearing, plus EFER save/load,
/// timer save, acknowledge interrupt and PERF_GLOBAL_CTRL load (6.x
/// always, 5.10 from the host). Bits 0-23.
const KVM_EXIT: u64 = ctls(0x0003_6dfb, 0x00ff_ffff);

/// VM-entry, all three: allowed-0 VM_ENTRY_ALWAYSON_WITHOUT_TRUE_MSR less
/// "load debug controls"; allowed-1 the host's IA-32e guest, PAT and
/// BNDCFGS load, plus EFER load and PERF_GLOBAL_CTRL load (as for exit).
const KVM_ENTRY: u64 = ctls(0x11fb, 0x0001_f3ff);

/// EPT_VPID_CAP, all three: the host's execute-only (0), 4- and 5-level
/// walks (6, 7), WB (14) and INVEPT (20); always 2M and 1G pages (16,
/// 17), single- and all-context INVEPT (25, 26); A/D bits (21) with
/// enable_ept_ad_bits; INVVPID and all its types (32, 40-43).
const KVM_EPT_VPID: u64 = 0x0000_0f01_0633_40c1;

/// IA32_VMX_MISC, 5.10: the host's "store IA32E mode" (5), emulated
/// timer rate 5 (VMX_MISC_EMULATED_PREEMPTION_TIMER_RATE), HLT (6), VMWRITE
/// to exit fields (29). No wait-for-SIPI: it came with 5.11 ("KVM: x86:
/// emulate wait-for-SIPI and SIPI-VMExit").
const KVM_5_10_MISC: u64 = 0x2000_0065;

/// IA32_VMX_MISC, 6.1 (`nested_vmx_setup_ctls_msrs`) and 6.12
/// (`nested_vmx_setup_misc_data`): as 5.10, plus wait-for-SIPI (8).
const KVM_6_MISC: u64 = 0x2000_0165;

/// PROCBASED_CTLS2, 5.10: the host's descriptor-table exiting, RDTSCP,
/// x2APIC virtualization, WBINVD exiting, APIC-register virtualization,
/// virtual-interrupt delivery, RDRAND/RDSEED exiting, INVPCID, XSAVES;
/// VMCS shadowing always; EPT and PML (with A/D bits), VMFUNC (host has
/// it), VPID, unrestricted guest, APIC-access virtualization.
const KVM_5_10_PROC2: u64 = ctls(0, 0x0013_7bff);

/// PROCBASED_CTLS2, 6.1 (`nested_vmx_setup_ctls_msrs`) and 6.12
/// (`nested_vmx_setup_secondary_ctls`): as 5.10, plus TSC scaling (25),
/// user wait/pause (26) and, with SGX, ENCLS exiting (15).
const KVM_6_PROC2: u64 = ctls(0, 0x0613_fbff);

const KVM_5_10: Caps = Caps {
    basic: KVM_BASIC,
    pin: KVM_PIN,
    proc1: KVM_PROC,
    proc2: KVM_5_10_PROC2,
    exit: KVM_EXIT,
    entry: KVM_ENTRY,
    misc: KVM_5_10_MISC,
    ept_vpid: KVM_EPT_VPID,
};

const KVM_6_1: Caps = Caps {
    proc2: KVM_6_PROC2,
    misc: KVM_6_MISC,
    ..KVM_5_10
};

/// 6.12's nested profile has the same values as 6.1's on such a host.
const KVM_6_12: Caps = KVM_6_1;

/// The words root chooses under every KVM version above: Bochs haswell's,
/// with XSAVES.
const KVM_WORDS: (u32, u32, u32, u32, u32) = (0x7e, 0x9600_6172, 0x0010_10aa, 0x003f_6fff, 0xd3ff);

fn words(c: &Chosen) -> (u32, u32, u32, u32, u32) {
    (c.pin, c.proc1, c.proc2, c.exit, c.entry)
}

#[test]
fn kvm_5_10_runs_one_vcpu_and_refuses_more() {
    let c = KVM_5_10.choose().unwrap();
    assert_eq!(words(&c), KVM_WORDS);
    assert!(c.preemption_timer);
    assert_eq!(c.timer_shift, 5);
    assert!(!c.wait_for_sipi);
    assert!(c.ins_outs_info && c.vpid());
    assert!(c.exit_saves_pat() && c.exit_loads_pat() && c.entry_loads_pat());
    assert_eq!(c.check_vcpus(1), Ok(()));
    let e = c.check_vcpus(2).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the CPU lacks required VMX activity states (wait-for-SIPI) controls 0x00000100"
    );
}

#[test]
fn kvm_6_1_runs_every_vcpu() {
    let c = KVM_6_1.choose().unwrap();
    assert_eq!(words(&c), KVM_WORDS);
    assert_eq!(c.timer_shift, 5);
    assert!(c.preemption_timer && c.wait_for_sipi && c.ins_outs_info && c.vpid());
    assert_eq!(c.ept, EptVpidCap(KVM_EPT_VPID));
    assert_eq!(c.check_vcpus(4), Ok(()));
}

#[test]
fn kvm_6_12_runs_every_vcpu() {
    let c = KVM_6_12.choose().unwrap();
    assert_eq!(words(&c), KVM_WORDS);
    assert_eq!(c.timer_shift, 5);
    assert!(c.preemption_timer && c.wait_for_sipi && c.ins_outs_info && c.vpid());
    assert_eq!(c.check_vcpus(2), Ok(()));
}

/// KVM passes execute-only EPT on only where the host has it.
#[test]
fn kvm_on_a_host_without_execute_only_ept_is_refused() {
    for kvm in [KVM_5_10, KVM_6_1, KVM_6_12] {
        let host = Caps {
            ept_vpid: kvm.ept_vpid & !1,
            ..kvm
        };
        let e = host.choose().unwrap_err();
        assert_eq!(
            e,
            Refusal::Ept("execute-only translations (hooked pages execute from their shadow)")
        );
        assert_eq!(
            e.to_string(),
            "EPT lacks execute-only translations (hooked pages execute from their shadow)"
        );
    }
}

/// kvm_intel's module parameters take controls root needs away.
#[test]
fn kvm_without_a_required_control_is_refused_by_name() {
    // unrestricted_guest=0: no unrestricted-guest bit (7) in PROCBASED_CTLS2.
    let no_ug = Caps {
        proc2: KVM_6_PROC2 & !(1 << (32 + 7)),
        ..KVM_6_12
    };
    assert_eq!(
        no_ug.choose().unwrap_err().to_string(),
        "the CPU lacks required VMX secondary processor-based controls 0x00000080"
    );
    // ept=0: no EPT bit and EPT_VPID_CAP has only the VPID half.
    let no_ept = Caps {
        proc2: KVM_6_PROC2 & !(1 << (32 + 1)),
        ept_vpid: KVM_EPT_VPID & !0xffff_ffff,
        ..KVM_6_12
    };
    assert_eq!(
        no_ept.choose().unwrap_err().to_string(),
        "EPT lacks 4-level write-back paging structures"
    );
}

/// A change to a profile, and the refusal it should bring.
type Case = (fn(&mut Caps), &'static str);

#[test]
fn each_word_names_its_own_missing_bits() {
    let cases: [Case; 6] = [
        (
            |c| c.pin &= !(1 << (32 + 5)),
            "the CPU lacks required VMX pin-based controls 0x00000020",
        ),
        (
            |c| c.proc1 &= !(1 << (32 + 22)),
            "the CPU lacks required VMX primary processor-based controls 0x00400000",
        ),
        (
            |c| c.proc1 &= !(1 << (32 + 28)),
            "the CPU lacks required VMX primary processor-based controls 0x10000000",
        ),
        (
            |c| c.proc2 &= !(1 << (32 + 1)),
            "the CPU lacks required VMX secondary processor-based controls 0x00000002",
        ),
        (
            |c| c.exit &= !(1 << (32 + 2)),
            "the CPU lacks required VMX VM-exit controls 0x00000004",
        ),
        (
            |c| c.entry &= !(1 << (32 + 15)),
            "the CPU lacks required VMX VM-entry controls 0x00008000",
        ),
    ];
    for (take, message) in cases {
        let mut c = KVM_6_12;
        take(&mut c);
        assert_eq!(c.choose().unwrap_err().to_string(), message);
    }
}

/// Optional controls are dropped, not refused; forced bits are kept.
#[test]
fn optional_controls_follow_the_cpu() {
    let lean = Caps {
        pin: KVM_PIN & !(1 << (32 + 6)),
        proc2: KVM_6_PROC2 & !((1 << (32 + 5)) | (1 << (32 + 20))),
        exit: KVM_EXIT & !(1 << (32 + 19)),
        entry: KVM_ENTRY & !(1 << (32 + 14)),
        ..KVM_6_12
    };
    let c = lean.choose().unwrap();
    assert_eq!(words(&c), (0x3e, 0x9600_6172, 0x108a, 0x0037_6fff, 0x93ff));
    assert!(!c.preemption_timer && !c.vpid());
    assert!(c.exit_saves_pat() && !c.exit_loads_pat() && !c.entry_loads_pat());
    // No timer: one vCPU only, refused as root refuses it today.
    assert_eq!(c.check_vcpus(1), Ok(()));
    assert_eq!(
        c.check_vcpus(2).unwrap_err().to_string(),
        "the CPU lacks required VMX pin-based (the VMX preemption timer, needed with more than one vCPU) controls 0x00000040"
    );
}

/// Without TRUE controls the legacy MSRs are read, default1 bits and all;
/// without secondary controls neither PROCBASED_CTLS2 nor EPT_VPID_CAP is
/// touched (the table has neither, and reading one would panic).
#[test]
fn read_touches_only_the_msrs_the_cpu_has() {
    let legacy = Caps {
        basic: KVM_BASIC & !(1 << 55),
        ..KVM_6_12
    };
    let p = legacy.profile();
    assert_eq!(p.procbased, KVM_PROC | PROC_DEFAULT1);
    let c = choose(&p).unwrap();
    // CR3-load/store exiting (15, 16) are forced on there.
    assert_eq!(c.proc1, 0x9601_e172);

    let mut msrs = KVM_6_12.msrs();
    let no_secondary = ctls(0x0400_6172, 0x7ff9_fffe);
    msrs.insert(msr::IA32_VMX_TRUE_PROCBASED_CTLS, no_secondary);
    msrs.remove(&msr::IA32_VMX_PROCBASED_CTLS2);
    msrs.remove(&msr::IA32_VMX_EPT_VPID_CAP);
    let p = CapProfile::read(|m| match msrs.get(&m) {
        Some(v) => *v,
        None => panic!("RDMSR {m:#x}: no such MSR here"),
    });
    assert_eq!((p.procbased2, p.ept_vpid_cap), (0, 0));
    assert_eq!(
        choose(&p).unwrap_err().to_string(),
        "EPT lacks 4-level write-back paging structures"
    );
}
