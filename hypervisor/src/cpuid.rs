//! What the guest reads from CPUID: a whitelist.
//!
//! Every CPUID exit is answered from the CPU's own CPUID, through
//! [`WHITELIST`]. A leaf (or subleaf) that is not in it reads zero, and so
//! does every bit of a feature register that its mask does not name. A bit
//! is named when its feature brings only state the guest owns and root
//! never touches (new instructions, vector registers, string-move hints,
//! the guest's own speculation controls), or when it has run here: Bochs
//! 2.7's `corei7_haswell_4770`, the model the VM tests run, offers it. That
//! model's CPUID passes unchanged, but for VMX and APERF/MPERF (below). A
//! feature a later CPU brings, or one not named yet, therefore stays hidden
//! until someone names it, instead of reaching the guest from a nested
//! KVM's `-cpu host` on the day the host gets it.
//!
//! The leaf counts agree with the table: leaf 0 and leaf 0x8000_0000 say
//! the highest leaf the whitelist passes (or the CPU's, if lower), and
//! (7,0):EAX the highest subleaf of leaf 7. A leaf above the CPU's own
//! highest reads zero rather than what the CPU returns there (Intel CPUs
//! repeat their highest basic leaf; Bochs 2.7 returns leaf 0xD's).
//!
//! The XSAVE leaf agrees with the features: (0xD,0) lists only the XCR0
//! components of features passed (x87, SSE, AVX, AVX-512), its ECX is the
//! size of those alone, the subleaves of the others read zero, and root's
//! XSETBV takes only those components ([`xcr0_for_guest`]). No supervisor
//! component passes: (0xD,1):ECX/EDX (what IA32_XSS may hold) read zero.
//!
//! Topology (leaves 4, 0xB, 0x1F) and the APIC IDs in leaf 1 pass as the
//! CPU reports them: each vCPU runs on the processor whose APIC ID the
//! guest's MADT gives it, and root executes the CPUID on that processor.
//!
//! Hidden system features, and what root would need before passing them:
//!
//! | feature | where | why hidden |
//! |---|---|---|
//! | VMX, SMX | `1:ECX[5,6]` | root owns VMX: VMX instructions and GETSEC are #UD for the guest, CR4.VMXE and SMXE are refused |
//! | hypervisor bit, leaves 0x4000_0000..=0x4FFF_FFFF | `1:ECX[31]` | under KVM they lead Linux to kvmclock's MSRs, PV IPIs and spinlock kicks (VMCALLs), none of which root serves (Debian's 6.1 hangs early dividing by kvmclock's zero rate) |
//! | debug store (BTS, PEBS) | `1:EDX[21]`, `1:ECX[2,4]` | PEBS writes its records by linear address through IA32_DS_AREA whenever a counter overflows, in root too, where the guest's address could name root's memory; root refuses non-zero writes to IA32_DS_AREA and IA32_PEBS_ENABLE |
//! | APERF/MPERF | `6:ECX[0]` | Bochs 2.7 offers them without the MSRs; Linux reads them on every tick and Bochs logs each failed read (tens of MB a minute) |
//! | HWP, HDC, HFI, HRESET | `6:EAX[7..]`, `7.1:EAX[22]`, leaf 0x20 | power-management MSRs and interrupts that have not run here |
//! | 5-level paging | `7.0:ECX[16]` | root walks guest memory with 4 levels and refuses CR4.LA57; 0x8000_0008 says 48 linear bits |
//! | FRED | `7.1:EAX[17]` | root injects and re-injects events by the IDT's rules and sets none of FRED's VMCS fields |
//! | LASS | `7.1:EAX[6]` | changes which linear accesses fault; root's checks of the guest accesses it emulates (string I/O) do not apply it |
//! | LAM | `7.1:EAX[26]` | tagged pointers: root's guest page walks refuse non-canonical addresses |
//! | PKU, PKS | `7.0:ECX[3,4,31]`, `XCR0[9]` | root's checks of the guest accesses it emulates do not apply protection keys |
//! | CET (shadow stacks, IBT) | `7.0:ECX[7]`, `7.0:EDX[20]`, `7.1:EDX[18]` | CR4.CET, its MSRs and XSS state are in none of root's VMCS controls, and the tracer's trampolines have never run under IBT |
//! | UINTR | `7.0:EDX[5]` | user interrupts: their MSRs, CR4 bit and XSS state have never run here |
//! | WAITPKG | `7.0:ECX[5]` | root does not set "enable user wait and pause": UMONITOR, UMWAIT and TPAUSE would be #UD |
//! | AMX | `7.0:EDX[22,24,25]`, `7.1:EAX[21]`, `7.1:EDX[8]`, `XCR0[17,18]`, leaves 0x1D, 0x1E | its first-use #NM through XFD (IA32_XFD, IA32_XFD_ERR) has never run here |
//! | APX | `7.1:EDX[21]`, `XCR0[19]` | 16 more general registers, outside the guest registers root saves and reads operands from |
//! | MPX | `7.0:EBX[14]`, `XCR0[3,4]` | gone from Linux (5.6) and from recent CPUs; never run here |
//! | Processor Trace | `7.0:EBX[25]`, leaf 0x14 | its output goes to physical addresses the guest picks, past EPT, and IA32_RTIT_CTL is not switched at exits |
//! | architectural LBRs | `7.0:EDX[19]`, leaf 0x1C | IA32_LBR_CTL is not switched at exits: the guest's LBRs would record root |
//! | SGX | `7.0:EBX[2]`, `7.0:ECX[30]`, leaf 0x12 | enclave memory and its MSRs are the host's; root neither maps nor virtualizes them |
//! | RDT | `7.0:EBX[12,15]`, leaves 0xF, 0x10 | IA32_PQR_ASSOC and the class masks are shared with root and not switched at exits |
//! | split-lock and bus-lock detection | `7.0:EDX[30]`, `7.0:ECX[24]` | split-lock #AC stays on in root (MSR_TEST_CTRL is not switched); a bus-lock #DB would reach root while it intercepts #DB to single-step |
//! | WRMSRNS, MSRLIST, MSR immediates, user MSRs | `7.1:EAX[19,27]`, `7.1:ECX[5]`, `7.1:EDX[15]` | new ways to reach the MSRs root intercepts, never run through root's exits |
//! | ENQCMD, Key Locker, TME, PCONFIG | `7.0:ECX[29,23,13]`, `7.0:EDX[18]` | a PASID, a per-CPU wrapping key, memory-encryption keys: state root does not manage (PCONFIG would be #UD: root does not enable it) |
//! | hybrid parts, perfmon extensions | `7.0:EDX[15]`, `7.1:EAX[8]`, leaves 0x1A, 0x23 | core types and PMU layouts that have not run here |
//!
//! The guest's other MSRs are not intercepted: hiding a feature stops a
//! guest that reads CPUID from using it, not one that writes its MSRs
//! regardless.
//!
//! OSXSAVE (`1:ECX[27]`) is the CPU's, which reflects the CR4 of the
//! processor executing CPUID: root's, which sets CR4.OSXSAVE on every CPU
//! with XSAVE. The guest sees it set before setting its own.

use crate::policy::xcr0;

/// A mask of the bits numbered in `list`. A number above 31 does not
/// compile.
const fn bits(mut list: &[u8]) -> u32 {
    let mut mask = 0u32;
    while let [bit, rest @ ..] = list {
        mask |= 1 << *bit;
        list = rest;
    }
    mask
}

/// Every bit of a register.
const ALL: u32 = u32::MAX;

/// CPUID.1:ECX. Hidden: DTES64 (2) and DS-CPL (4) with the debug store
/// (see `L1_EDX`), VMX (5) and SMX (6), which root owns (SMX goes
/// with VMX: GETSEC then raises #UD, as it must with CR4.SMXE clear, and
/// the guest never sets SMXE), CNXT-ID (10), silicon debug (11), DCA (18)
/// and the hypervisor bit (31).
const L1_ECX: u32 = bits(&[
    0,  // SSE3
    1,  // PCLMULQDQ
    3,  // MONITOR/MWAIT (Bochs)
    7,  // EST (Bochs)
    8,  // TM2 (Bochs)
    9,  // SSSE3
    12, // FMA
    13, // CMPXCHG16B
    14, // xTPR update control (Bochs)
    15, // PDCM (Bochs)
    17, // PCID (Bochs)
    19, // SSE4.1
    20, // SSE4.2
    21, // x2APIC (Bochs)
    22, // MOVBE
    23, // POPCNT
    24, // TSC deadline (Bochs)
    25, // AES
    26, // XSAVE
    27, // OSXSAVE
    28, // AVX
    29, // F16C
    30, // RDRAND
]);

/// CPUID.1:EDX: all Bochs offers, which is every defined bit but the
/// processor serial number (18) and the debug store (21): PEBS records
/// are written through IA32_DS_AREA by linear address, with whatever
/// paging is current when a counter overflows, root's included (root
/// refuses a non-zero IA32_DS_AREA, IA32_PEBS_ENABLE or IA32_RTIT_CTL,
/// `policy::msr_write`).
const L1_EDX: u32 = bits(&[
    0,  // FPU
    1,  // VME
    2,  // DE
    3,  // PSE
    4,  // TSC
    5,  // MSR
    6,  // PAE
    7,  // MCE
    8,  // CX8
    9,  // APIC
    11, // SYSENTER/SYSEXIT
    12, // MTRR
    13, // PGE
    14, // MCA
    15, // CMOV
    16, // PAT
    17, // PSE-36
    19, // CLFLUSH
    22, // ACPI thermal control (Bochs)
    23, // MMX
    24, // FXSR
    25, // SSE
    26, // SSE2
    27, // self snoop (Bochs)
    28, // HTT (Bochs)
    29, // TM (Bochs)
    31, // PBE (Bochs)
]);

/// CPUID.6:EAX: Bochs's thermal and power set. Hidden: HWP and its
/// relatives (7 and up), HDC (13), HFI (19).
const L6_EAX: u32 = bits(&[
    0, // digital thermal sensor
    1, // turbo
    2, // always-running APIC timer
    4, // power limit notification
    5, // clock modulation duty cycle extension
    6, // package thermal management
]);

/// CPUID.6:EBX: the number of interrupt thresholds (bits 3:0).
const L6_EBX: u32 = 0xf;

/// CPUID.6:ECX. Hidden: APERF/MPERF (0): Bochs 2.7 advertises the MSRs
/// but does not implement them; Linux then reads them on every tick and
/// Bochs logs each failed read (tens of MB a minute). The guest loses
/// only its frequency estimate without them.
const L6_ECX: u32 = bits(&[
    3, // energy performance bias (Bochs)
]);

/// CPUID.(7,0):EBX. Hidden: SGX (2), RDT monitoring (12), MPX (14), RDT
/// allocation (15), Processor Trace (25).
const L7_0_EBX: u32 = bits(&[
    0,  // FSGSBASE (Bochs)
    1,  // IA32_TSC_ADJUST (Bochs)
    3,  // BMI1
    4,  // HLE
    5,  // AVX2
    6,  // x87 FDP updated only on exceptions
    7,  // SMEP (Bochs)
    8,  // BMI2
    9,  // ERMS
    10, // INVPCID (Bochs)
    11, // RTM
    13, // FCS and FDS deprecated (Bochs)
    16, // AVX512F
    17, // AVX512DQ
    18, // RDSEED
    19, // ADX
    20, // SMAP (root's string I/O honours it)
    21, // AVX512_IFMA
    23, // CLFLUSHOPT
    24, // CLWB
    26, // AVX512PF
    27, // AVX512ER
    28, // AVX512CD
    29, // SHA
    30, // AVX512BW
    31, // AVX512VL
]);

/// CPUID.(7,0):ECX. Hidden: PKU and OSPKE (3, 4), WAITPKG (5), CET
/// shadow stacks (7), TME (13), 5-level paging (16: root's walks of guest
/// memory are 4-level, and CR4.LA57 is refused by `policy::cr4_write`),
/// MPX's address width (17-21), Key Locker (23), bus-lock detection
/// (24), ENQCMD (29), SGX launch control (30), PKS (31).
const L7_0_ECX: u32 = bits(&[
    0,  // PREFETCHWT1
    1,  // AVX512_VBMI
    2,  // UMIP (root emulates no descriptor-table instruction)
    6,  // AVX512_VBMI2
    8,  // GFNI
    9,  // VAES
    10, // VPCLMULQDQ
    11, // AVX512_VNNI
    12, // AVX512_BITALG
    14, // AVX512_VPOPCNTDQ
    22, // RDPID
    25, // CLDEMOTE
    27, // MOVDIRI
    28, // MOVDIR64B
]);

/// CPUID.(7,0):EDX. Hidden: SGX keys (1), UINTR (5), TSX force-abort
/// MSR (13), hybrid (15), PCONFIG (18), architectural LBRs (19), IBT
/// (20), AMX (22, 24, 25), IA32_CORE_CAPABILITIES (30).
const L7_0_EDX: u32 = bits(&[
    2,  // AVX512_4VNNIW
    3,  // AVX512_4FMAPS
    4,  // FSRM
    8,  // AVX512_VP2INTERSECT
    9,  // SRBDS mitigation control
    10, // MD_CLEAR
    11, // RTM always aborts
    14, // SERIALIZE
    16, // TSXLDTRK
    23, // AVX512_FP16
    26, // IBRS and IBPB
    27, // STIBP
    28, // L1D_FLUSH
    29, // IA32_ARCH_CAPABILITIES
    31, // SSBD
]);

/// CPUID.(7,1):EAX. Hidden: LASS (6), perfmon extensions (8), FRED (17),
/// WRMSRNS (19), AMX-FP16 (21), HRESET (22), LAM (26), MSRLIST (27).
const L7_1_EAX: u32 = bits(&[
    0,  // SHA512
    1,  // SM3
    2,  // SM4
    4,  // AVX_VNNI
    5,  // AVX512_BF16
    7,  // CMPCCXADD
    10, // fast zero-length REP MOVSB
    11, // fast short REP STOSB
    12, // fast short REP CMPSB/SCASB
    18, // LKGS
    23, // AVX_IFMA
]);

/// CPUID.(7,1):EDX. Hidden: AMX-COMPLEX (8), user MSRs (15), CET
/// supervisor shadow stacks (18), APX (21).
const L7_1_EDX: u32 = bits(&[
    4,  // AVX_VNNI_INT8
    5,  // AVX_NE_CONVERT
    10, // AVX_VNNI_INT16
    14, // PREFETCHI
    19, // AVX10 (its version in leaf 0x24)
]);

/// CPUID.(7,2):EDX: the guest's own speculation controls, bits of
/// IA32_SPEC_CTRL.
const L7_2_EDX: u32 = bits(&[
    0, // PSFD
    1, // IPRED_CTRL
    2, // RRSBA_CTRL
    3, // DDPD_U
    4, // BHI_CTRL
    5, // MCDT_NO
]);

/// CPUID.(0xD,1):EAX. Hidden: XFD (4), which goes with AMX.
const LD_1_EAX: u32 = bits(&[
    0, // XSAVEOPT
    1, // XSAVEC
    2, // XGETBV with ECX = 1
    3, // XSAVES (root enables it for the guest; no supervisor state passes)
]);

/// CPUID.(0x24,0):EBX: the AVX10 version (7:0) and vector lengths (16-18).
const L24_EBX: u32 = 0xff | bits(&[16, 17, 18]);

/// CPUID.0x8000_0001:ECX.
const LX1_ECX: u32 = bits(&[
    0, // LAHF/SAHF in 64-bit mode
    5, // LZCNT
    8, // PREFETCHW
]);

/// CPUID.0x8000_0001:EDX.
const LX1_EDX: u32 = bits(&[
    11, // SYSCALL/SYSRET
    20, // NX
    26, // 1 GiB pages
    27, // RDTSCP
    29, // Intel 64
]);

/// CPUID.0x8000_0007:EDX: the invariant TSC (Bochs).
const LX7_EDX: u32 = bits(&[8]);

/// The XCR0 components the guest may enable: those of the features
/// passed. AVX-512's state is the guest's alone (root never touches a
/// vector register), so it passes with AVX-512.
pub const XCR0_ALLOWED: u64 = xcr0::X87 | xcr0::SSE | xcr0::AVX | xcr0::AVX512;

/// The linear-address width 4-level paging gives, for 0x8000_0008:EAX.
const LINEAR_BITS_4_LEVEL: u32 = 48;

/// The legacy XSAVE area and its header: the least (0xD,0):ECX can be.
const XSAVE_LEGACY_AND_HEADER: u32 = 512 + 64;

/// How a leaf, or one of its subleaves, reaches the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// As the CPU reports it.
    Pass,
    /// Each register ANDed with its mask: EAX, EBX, ECX, EDX.
    Mask([u32; 4]),
    /// EAX is the highest leaf (leaf 0, leaf 0x8000_0000) or subleaf the
    /// guest may ask for, held to the highest [`WHITELIST`] passes; EBX,
    /// ECX and EDX ANDed with these masks.
    Highest([u32; 3]),
    /// (0xD,0): the XCR0 components of [`XCR0_ALLOWED`], and in ECX the
    /// size of an XSAVE area holding all of them.
    XsaveMain,
    /// (0xD,n), n >= 2: component n's size and offset, when it passes.
    XsaveComponent,
    /// 0x8000_0008: the physical width as the CPU says, the linear width
    /// at most 48 (4-level paging), nothing else.
    AddressSizes,
}

/// The subleaves a row covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sub {
    /// All: the leaf has none (the CPU ignores ECX), or passes them all.
    Any,
    /// This one.
    Is(u32),
    /// This one and every one above it.
    From(u32),
}

impl Sub {
    const fn covers(self, subleaf: u32) -> bool {
        match self {
            Sub::Any => true,
            Sub::Is(n) => subleaf == n,
            Sub::From(n) => subleaf >= n,
        }
    }
}

/// One leaf (or subleaf range) the guest sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// EAX of the CPUID.
    pub leaf: u32,
    /// ECX of the CPUID.
    pub sub: Sub,
    /// What the guest reads.
    pub rule: Rule,
}

const fn row(leaf: u32, sub: Sub, rule: Rule) -> Row {
    Row { leaf, sub, rule }
}

/// The leaves passed, in order. Anything else reads zero.
pub const WHITELIST: &[Row] = &[
    // Highest basic leaf, vendor.
    row(0x0, Sub::Any, Rule::Highest([ALL; 3])),
    // Signature, APIC ID and counts, features.
    row(0x1, Sub::Any, Rule::Mask([ALL, ALL, L1_ECX, L1_EDX])),
    // Cache and TLB descriptors.
    row(0x2, Sub::Any, Rule::Pass),
    // Cache parameters, per subleaf.
    row(0x4, Sub::Any, Rule::Pass),
    // MONITOR/MWAIT sizes and C-states.
    row(0x5, Sub::Any, Rule::Pass),
    row(0x6, Sub::Any, Rule::Mask([L6_EAX, L6_EBX, L6_ECX, 0])),
    row(
        0x7,
        Sub::Is(0),
        Rule::Highest([L7_0_EBX, L7_0_ECX, L7_0_EDX]),
    ),
    row(0x7, Sub::Is(1), Rule::Mask([L7_1_EAX, 0, 0, L7_1_EDX])),
    row(0x7, Sub::Is(2), Rule::Mask([0, 0, 0, L7_2_EDX])),
    // Architectural performance monitoring (Bochs offers version 3).
    row(0xa, Sub::Any, Rule::Pass),
    // Extended topology.
    row(0xb, Sub::Any, Rule::Pass),
    row(0xd, Sub::Is(0), Rule::XsaveMain),
    row(0xd, Sub::Is(1), Rule::Mask([LD_1_EAX, ALL, 0, 0])),
    row(0xd, Sub::From(2), Rule::XsaveComponent),
    // TSC and crystal clock, processor frequencies.
    row(0x15, Sub::Any, Rule::Pass),
    row(0x16, Sub::Any, Rule::Pass),
    // V2 extended topology.
    row(0x1f, Sub::Any, Rule::Pass),
    // AVX10: its version and vector lengths.
    row(0x24, Sub::Is(0), Rule::Highest([L24_EBX, 0, 0])),
    // Highest extended leaf.
    row(0x8000_0000, Sub::Any, Rule::Highest([ALL; 3])),
    row(0x8000_0001, Sub::Any, Rule::Mask([0, 0, LX1_ECX, LX1_EDX])),
    // Brand string.
    row(0x8000_0002, Sub::Any, Rule::Pass),
    row(0x8000_0003, Sub::Any, Rule::Pass),
    row(0x8000_0004, Sub::Any, Rule::Pass),
    // L2 cache.
    row(0x8000_0006, Sub::Any, Rule::Pass),
    row(0x8000_0007, Sub::Any, Rule::Mask([0, 0, 0, LX7_EDX])),
    row(0x8000_0008, Sub::Any, Rule::AddressSizes),
];

/// The first leaf of the range `leaf` is in: 0 or 0x8000_0000.
const fn range_base(leaf: u32) -> u32 {
    leaf & 0x8000_0000
}

/// The highest leaf of [`WHITELIST`] in the range starting at `base`.
const fn highest_leaf(base: u32) -> u32 {
    let mut highest = base;
    let mut rows = WHITELIST;
    while let [r, rest @ ..] = rows {
        if range_base(r.leaf) == base && r.leaf > highest {
            highest = r.leaf;
        }
        rows = rest;
    }
    highest
}

/// The highest subleaf of `leaf` that [`WHITELIST`] names.
const fn highest_subleaf(leaf: u32) -> u32 {
    let mut highest = 0;
    let mut rows = WHITELIST;
    while let [r, rest @ ..] = rows {
        if let (true, Sub::Is(n)) = (r.leaf == leaf, r.sub) {
            if n > highest {
                highest = n;
            }
        }
        rows = rest;
    }
    highest
}

/// The highest basic leaf the guest is told of.
pub const HIGHEST_BASIC: u32 = highest_leaf(0);
/// The highest extended leaf the guest is told of.
pub const HIGHEST_EXTENDED: u32 = highest_leaf(0x8000_0000);

/// The rule for `leaf`/`subleaf`, if the whitelist passes it.
pub fn rule(leaf: u32, subleaf: u32) -> Option<Rule> {
    WHITELIST
        .iter()
        .find(|r| r.leaf == leaf && r.sub.covers(subleaf))
        .map(|r| r.rule)
}

/// What the guest reads for CPUID `leaf`/`subleaf`, given `host`, the
/// CPU's own CPUID. `host` runs for the leaf itself, for its range's
/// highest leaf, and for (0xD,0) with components hidden for each
/// component passed; not at all for a leaf the whitelist does not pass.
pub fn for_guest(leaf: u32, subleaf: u32, host: impl Fn(u32, u32) -> [u32; 4]) -> [u32; 4] {
    let Some(rule) = rule(leaf, subleaf) else {
        return [0; 4];
    };
    let base = range_base(leaf);
    if leaf != base && leaf > host(base, 0)[0] {
        return [0; 4];
    }
    let [eax, ebx, ecx, edx] = host(leaf, subleaf);
    match rule {
        Rule::Pass => [eax, ebx, ecx, edx],
        Rule::Mask([a, b, c, d]) => [eax & a, ebx & b, ecx & c, edx & d],
        Rule::Highest([b, c, d]) => {
            let highest = if leaf == base {
                // Without extended leaves, 0x8000_0000 returns some basic
                // leaf's data instead of a count.
                if eax < base {
                    return [0; 4];
                }
                highest_leaf(base)
            } else {
                highest_subleaf(leaf)
            };
            [eax.min(highest), ebx & b, ecx & c, edx & d]
        }
        Rule::XsaveMain => {
            let cpu = (u64::from(edx) << 32) | u64::from(eax);
            let supported = cpu & XCR0_ALLOWED;
            // The CPU's size holds every component it has: recount it
            // when some are hidden.
            let size = if cpu == supported {
                ecx
            } else {
                xsave_size(supported, &host)
            };
            [supported as u32, ebx, size, (supported >> 32) as u32]
        }
        Rule::XsaveComponent => match 1u64.checked_shl(subleaf) {
            Some(bit) if XCR0_ALLOWED & bit != 0 => [eax, ebx, ecx, edx],
            _ => [0; 4],
        },
        Rule::AddressSizes => {
            let physical = eax & 0xff;
            let linear = ((eax >> 8) & 0xff).min(LINEAR_BITS_4_LEVEL);
            [physical | (linear << 8), 0, 0, 0]
        }
    }
}

/// The size of a standard-format XSAVE area holding the components of
/// `xcr0` (each one's offset plus size, from its subleaf of 0xD).
fn xsave_size(xcr0: u64, host: &impl Fn(u32, u32) -> [u32; 4]) -> u32 {
    (2..64)
        .filter(|i| xcr0 & (1u64 << i) != 0)
        .map(|i| {
            let [size, offset, ..] = host(0xd, i);
            offset.saturating_add(size)
        })
        .fold(XSAVE_LEGACY_AND_HEADER, u32::max)
}

/// The XCR0 bits the guest may set: what the CPU supports, of
/// [`XCR0_ALLOWED`], as (0xD,0) tells the guest. Root's XSETBV checks
/// the guest's value against this.
pub fn xcr0_for_guest(host: impl Fn(u32, u32) -> [u32; 4]) -> u64 {
    let [eax, _, _, edx] = host(0xd, 0);
    ((u64::from(edx) << 32) | u64::from(eax)) & XCR0_ALLOWED
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_ordered_and_each_subleaf_has_one_rule() {
        for pair in WHITELIST.windows(2) {
            let [a, b] = pair else { unreachable!() };
            assert!(a.leaf <= b.leaf, "{a:?} before {b:?}");
        }
        for r in WHITELIST {
            for s in 0..70 {
                let n = WHITELIST
                    .iter()
                    .filter(|o| o.leaf == r.leaf && o.sub.covers(s))
                    .count();
                assert!(n <= 1, "leaf {:#x} subleaf {s}: {n} rules", r.leaf);
            }
        }
        assert_eq!(HIGHEST_BASIC, 0x24);
        assert_eq!(HIGHEST_EXTENDED, 0x8000_0008);
        assert_eq!(highest_subleaf(7), 2);
        assert_eq!(highest_subleaf(0x24), 0);
    }

    #[test]
    fn xcr0_components_pass_with_their_features_and_only_then() {
        let has = |mask: u32, bit: u32| mask & (1 << bit) != 0;
        let xcr0 = |bits: u64| XCR0_ALLOWED & bits == bits;
        assert!(has(L1_ECX, 28) && xcr0(xcr0::AVX), "AVX");
        // AVX-512F (7.0:EBX[16]) and its three components.
        assert_eq!(has(L7_0_EBX, 16), xcr0(xcr0::AVX512));
        assert!(has(L7_0_EBX, 16));
        // Hidden features, hidden components: MPX (3, 4), PKRU (9), AMX
        // (17, 18), APX (19).
        assert!(!has(L7_0_EBX, 14) && XCR0_ALLOWED & xcr0::MPX == 0);
        assert!(!has(L7_0_ECX, 3) && XCR0_ALLOWED & 1 << 9 == 0);
        for amx in [22, 24, 25] {
            assert!(!has(L7_0_EDX, amx), "AMX bit {amx}");
        }
        assert!(!has(L7_1_EAX, 21) && !has(L7_1_EDX, 8) && !has(LD_1_EAX, 4));
        assert_eq!(XCR0_ALLOWED & xcr0::AMX, 0);
        assert!(!has(L7_1_EDX, 21) && XCR0_ALLOWED & 1 << 19 == 0);
        // Nothing above the AVX-512 components, and no supervisor state.
        assert_eq!(XCR0_ALLOWED >> 8, 0);
    }
}
