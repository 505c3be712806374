//! The guest's inter-processor interrupts, as VMX root sees them (SDM Vol. 3A
//! chapter 11 "Advanced Programmable Interrupt Controller (APIC)").
//!
//! Root intercepts the guest's writes to its local APIC's interrupt command
//! register (ICR) so that INIT and start-up IPIs (SIPI) to application
//! processors are carried out by root itself: the emulator the VM runs on
//! would otherwise latch a guest INIT forever. Every other IPI is forwarded
//! to the APIC unchanged.
//!
//! The ICR is reached two ways:
//! - xAPIC: the APIC's MMIO page, low half at offset [`XAPIC_ICR_LOW`]
//!   (writing it sends the IPI) and destination at [`XAPIC_ICR_HIGH`]
//!   (SDM 11.6.1 "Interrupt Command Register (ICR)"). Root write-protects
//!   that page in EPT; on the EPT violation it decodes the guest's store
//!   ([`decode_store`]) to learn the value written and the instruction
//!   length to skip.
//! - x2APIC: one 64-bit WRMSR to [`X2APIC_ICR_MSR`] (SDM 11.12.9 "ICR
//!   Operation in x2APIC Mode"), whose upper half is a 32-bit destination.
//!
//! [`Icr`] is the decoded register, [`classify`] says what root does with
//! it and [`targets`] which of the VM's vCPUs an INIT or SIPI reaches.
//! [`register_write`] says what root does with a store to any other
//! register of the page (LVT entries with an INIT, SMI or reserved
//! delivery mode are dropped: [`routed_mode_allowed`]), and
//! [`guest_store`] whether root may decode a store at all (not one made by
//! an event's delivery, and only in 64-bit mode on 4-level paging).
//!
//! Nothing here touches hardware; the exit handlers feed in the values.

/// Offset of the ICR's low half (bits 0..=31) in the xAPIC MMIO page.
pub const XAPIC_ICR_LOW: u64 = 0x300;
/// Offset of the ICR's high half (bits 32..=63, destination) in the xAPIC
/// MMIO page.
pub const XAPIC_ICR_HIGH: u64 = 0x310;
/// The x2APIC ICR MSR (SDM 11.12.1, table 11-6).
pub const X2APIC_ICR_MSR: u32 = 0x830;
/// The x2APIC's LVT MSRs, as inclusive ranges (SDM table 11-6): CMCI
/// (0x82F); timer, thermal, performance counters, LINT0, LINT1, error
/// (0x832..=0x837).
pub const X2APIC_LVT_MSRS: [(u32, u32); 2] = [(0x82F, 0x82F), (0x832, 0x837)];

/// The xAPIC page offset of the register an x2APIC LVT MSR names (MSR
/// 0x800 + offset / 16, SDM 11.12.1), for [`register_write`]; `None` for
/// any other MSR.
pub fn x2apic_lvt_offset(msr: u32) -> Option<u64> {
    X2APIC_LVT_MSRS
        .iter()
        .any(|&(lo, hi)| (lo..=hi).contains(&msr))
        .then(|| u64::from(msr - 0x800) << 4)
}

/// ICR bits 8..=10, the delivery mode (SDM 11.6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryMode {
    /// 000: the vector to the destination.
    Fixed,
    /// 001: the vector to the lowest-priority destination.
    LowestPriority,
    /// 010: a system management interrupt.
    Smi,
    /// 100: a non-maskable interrupt.
    Nmi,
    /// 101: INIT (assert, or level de-assert).
    Init,
    /// 110: start-up IPI; the vector is the start page number.
    Startup,
    /// 011 or 111: reserved encodings, with the raw field value.
    Reserved(u8),
}

impl DeliveryMode {
    /// The mode of a three-bit field value (only bits 0..=2 count).
    fn from_bits(bits: u8) -> Self {
        match bits & 0b111 {
            0 => Self::Fixed,
            1 => Self::LowestPriority,
            2 => Self::Smi,
            4 => Self::Nmi,
            5 => Self::Init,
            6 => Self::Startup,
            other => Self::Reserved(other),
        }
    }
}

/// ICR bits 18..=19, the destination shorthand (SDM 11.6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shorthand {
    /// 00: the destination field says who.
    None,
    /// 01: the sender only.
    SelfOnly,
    /// 10: every processor, the sender included.
    AllIncludingSelf,
    /// 11: every processor but the sender.
    AllExcludingSelf,
}

impl Shorthand {
    /// The shorthand of a two-bit field value (only bits 0..=1 count).
    fn from_bits(bits: u8) -> Self {
        match bits & 0b11 {
            0 => Self::None,
            1 => Self::SelfOnly,
            2 => Self::AllIncludingSelf,
            _ => Self::AllExcludingSelf,
        }
    }
}

/// A decoded interrupt command register value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Icr {
    /// Bits 0..=7: the vector (for a SIPI, the start page number).
    pub vector: u8,
    /// Bits 8..=10: the delivery mode.
    pub mode: DeliveryMode,
    /// Bit 11: destination mode, set for logical, clear for physical.
    pub logical: bool,
    /// Bit 14: level, set for assert, clear for de-assert.
    pub level_assert: bool,
    /// Bit 15: trigger mode, set for level, clear for edge.
    pub level_triggered: bool,
    /// Bits 18..=19: the destination shorthand.
    pub shorthand: Shorthand,
    /// The destination: ICR bits 56..=63 (high half bits 24..=31) for the
    /// xAPIC, bits 32..=63 for the x2APIC.
    pub dest: u32,
    /// Whether the value came from the x2APIC MSR (32-bit destinations).
    pub x2apic: bool,
}

impl Icr {
    /// Decodes the fields common to both forms from the low 32 bits.
    fn from_low(low: u32, dest: u32, x2apic: bool) -> Icr {
        let bit = |n: u32| low & (1 << n) != 0;
        Icr {
            vector: (low & 0xff) as u8,
            mode: DeliveryMode::from_bits(((low >> 8) & 0b111) as u8),
            logical: bit(11),
            level_assert: bit(14),
            level_triggered: bit(15),
            shorthand: Shorthand::from_bits(((low >> 18) & 0b11) as u8),
            dest,
            x2apic,
        }
    }

    /// Decodes an xAPIC ICR from its two MMIO halves: `low` at offset
    /// [`XAPIC_ICR_LOW`], `high` at [`XAPIC_ICR_HIGH`] (destination in bits
    /// 24..=31, SDM 11.6.1).
    pub fn from_xapic(low: u32, high: u32) -> Icr {
        Self::from_low(low, high >> 24, false)
    }

    /// Decodes the 64-bit value written to the x2APIC ICR MSR (destination
    /// in bits 32..=63, SDM 11.12.9).
    pub fn from_x2apic(value: u64) -> Icr {
        Self::from_low(value as u32, (value >> 32) as u32, true)
    }

    /// The destination value that means "every processor" for this form.
    fn broadcast(&self) -> u32 {
        if self.x2apic {
            0xFFFF_FFFF
        } else {
            0xFF
        }
    }
}

/// What root does with an ICR write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpiAction {
    /// Hand the write to the APIC unchanged.
    Forward,
    /// Put the target vCPUs into wait-for-SIPI.
    Init,
    /// Start the waiting target vCPUs at the page with this number
    /// (real-mode CS:IP = vector << 8 : 0).
    Startup(u8),
    /// Drop the write: it has no effect on any processor root supports.
    Ignore,
}

/// What root does with a guest ICR write.
///
/// INIT level de-assert (mode Init, level_triggered, !level_assert) ->
/// Ignore (a no-op on every CPU since the Pentium 4, SDM 11.6.1);
/// other Init -> Init; Startup -> Startup(vector); SMI and the reserved
/// modes -> Ignore (an SMI runs the firmware's handler outside VMX
/// non-root, which no guest root serves needs; Linux sends none);
/// everything else -> Forward.
pub fn classify(icr: &Icr) -> IpiAction {
    match icr.mode {
        DeliveryMode::Init if icr.level_triggered && !icr.level_assert => IpiAction::Ignore,
        DeliveryMode::Smi | DeliveryMode::Reserved(_) => IpiAction::Ignore,
        DeliveryMode::Init => IpiAction::Init,
        DeliveryMode::Startup => IpiAction::Startup(icr.vector),
        _ => IpiAction::Forward,
    }
}

/// The most vCPUs [`targets`] considers (one bit each in its mask).
const MAX_TARGETS: usize = 32;

/// The indices into `ids` (APIC IDs of the VM's vCPUs, index 0 is the boot
/// CPU) that an INIT or SIPI with this ICR reaches, as a bit mask (bit i =
/// ids[i]); `me` is the sender's index.
///
/// Physical destination: the CPU whose APIC ID equals `dest`; broadcast
/// dest (0xFF for xAPIC, 0xFFFF_FFFF for x2APIC) = all. Shorthands:
/// SelfOnly = me (INIT/SIPI to self is not allowed by the SDM: return 0 for
/// them), AllIncludingSelf = all, AllExcludingSelf = all but me. Logical
/// destination mode without a shorthand: 0 (root does not model logical IDs
/// for start-up IPIs; Linux sends them physically). With a shorthand the
/// destination mode and field are ignored, as the APIC ignores them. At most
/// 32 ids are considered; a `me` beyond them excludes no one.
pub fn targets(icr: &Icr, me: usize, ids: &[u32]) -> u32 {
    let n = ids.len().min(MAX_TARGETS);
    let all = if n >= MAX_TARGETS {
        u32::MAX
    } else {
        (1u32 << n) - 1
    };
    let me_bit = if me < n { 1u32 << me } else { 0 };
    match icr.shorthand {
        Shorthand::SelfOnly => 0,
        Shorthand::AllIncludingSelf => all,
        Shorthand::AllExcludingSelf => all & !me_bit,
        Shorthand::None if icr.logical => 0,
        Shorthand::None if icr.dest == icr.broadcast() => all,
        Shorthand::None => ids
            .iter()
            .take(n)
            .enumerate()
            .filter(|&(_, &id)| id == icr.dest)
            .fold(0, |mask, (i, _)| mask | (1u32 << i)),
    }
}

/// The value a decoded store writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreValue {
    /// The low 32 bits of a general register: x86 GPR number 0..=15 (0 rax,
    /// 1 rcx, 2 rdx, 3 rbx, 4 rsp, 5 rbp, 6 rsi, 7 rdi, 8..=15 r8..r15),
    /// REX.R applied.
    Reg(u8),
    /// An immediate.
    Imm(u32),
}

/// A decoded 32-bit store to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Store {
    /// The instruction's length in bytes, prefixes included.
    pub len: u8,
    /// What is stored.
    pub value: StoreValue,
    /// Whether it is XCHG: the register also receives the old memory value.
    pub xchg: bool,
}

/// The architectural limit on an instruction's length (SDM Vol. 2A 2.3.11).
const MAX_INSN_LEN: usize = 15;

/// Decodes the instruction at the start of `bytes` (up to 15 bytes fetched
/// from the guest's RIP; may be shorter than 15 if the fetch was cut at a
/// page end) when it is a 32-bit store to memory of one of the forms: 0x89 /r
/// (MOV r/m32, r32), 0xC7 /0 (MOV r/m32, imm32), 0x87 /r (XCHG r/m32, r32).
///
/// 64-bit mode encoding (SDM Vol. 2A chapter 2 "Instruction Format"):
/// - prefixes: segment overrides 0x26 0x2E 0x36 0x3E 0x64 0x65, LOCK 0xF0
///   and address-size 0x67 are accepted (none changes the length); one REX
///   prefix 0x40..=0x4F must come immediately before the opcode (REX.W set
///   -> None: a 64-bit store; REX.R extends the reg field). Operand-size
///   0x66 (a 16-bit store) and REP 0xF2/0xF3 -> None; so is any other byte
///   where a prefix or the opcode is expected.
/// - ModRM: mod == 3 (register operand) -> None; rm 100 -> SIB byte, whose
///   base 101 with mod 00 adds a disp32; mod 00 rm 101 -> RIP-relative
///   disp32; mod 01 -> disp8; mod 10 -> disp32.
/// - 0xC7 takes an imm32, and its reg field must be 0, else None.
///
/// Returns None when `bytes` are too few for the decoded length, or the
/// total length is over 15.
pub fn decode_store(bytes: &[u8]) -> Option<Store> {
    let mut at = 0usize;
    let mut rex = 0u8;
    // Legacy prefixes, then at most one REX, then the opcode.
    let opcode = loop {
        let b = *bytes.get(at)?;
        at += 1;
        if at > MAX_INSN_LEN {
            return None;
        }
        match b {
            0x26 | 0x2E | 0x36 | 0x3E | 0x64 | 0x65 | 0xF0 | 0x67 if rex == 0 => {}
            0x40..=0x4F if rex == 0 => rex = b,
            0x89 | 0xC7 | 0x87 => break b,
            _ => return None,
        }
    };
    if rex & 0x08 != 0 {
        return None;
    }

    let modrm = *bytes.get(at)?;
    at += 1;
    let mode = modrm >> 6;
    let reg = (modrm >> 3) & 0b111;
    let rm = modrm & 0b111;
    if mode == 0b11 {
        return None;
    }
    if rm == 0b100 {
        let sib = *bytes.get(at)?;
        at += 1;
        if mode == 0b00 && sib & 0b111 == 0b101 {
            at += 4;
        }
    } else if mode == 0b00 && rm == 0b101 {
        at += 4;
    }
    match mode {
        0b01 => at += 1,
        0b10 => at += 4,
        _ => {}
    }

    let (value, xchg) = match opcode {
        0xC7 => {
            if reg != 0 {
                return None;
            }
            let imm = bytes.get(at..)?.first_chunk::<4>()?;
            at += 4;
            (StoreValue::Imm(u32::from_le_bytes(*imm)), false)
        }
        _ => {
            let gpr = reg | if rex & 0x04 != 0 { 8 } else { 0 };
            (StoreValue::Reg(gpr), opcode == 0x87)
        }
    };
    if at > MAX_INSN_LEN || at > bytes.len() {
        return None;
    }
    Some(Store {
        len: u8::try_from(at).ok()?,
        value,
        xchg,
    })
}

/// The delivery-mode field (bits 8..=10) of an LVT entry, an I/O APIC
/// redirection entry or an MSI's data word: 000 fixed, 001 lowest
/// priority, 010 SMI, 100 NMI, 101 INIT, 111 ExtINT, 011 and 110 reserved
/// (SDM 11.5.1, 11.11.2; 82093AA I/O APIC datasheet 3.2.4).
pub fn routed_mode(value: u32) -> u8 {
    ((value >> 8) & 0b111) as u8
}

/// Whether the guest may program the delivery mode of `value` (an LVT
/// entry, a redirection entry, an MSI's data) into a route that reaches
/// the processors without passing root: fixed, lowest priority, NMI and
/// ExtINT. INIT (which resets a vCPU behind root's back, and which Bochs
/// 2.7 latches), SMI (firmware code outside VMX non-root), and the
/// reserved encodings (start-up among them, which some emulators deliver)
/// are not: Linux programs none of them there.
pub fn routed_mode_allowed(value: u32) -> bool {
    matches!(routed_mode(value), 0b000 | 0b001 | 0b100 | 0b111)
}

/// The xAPIC's LVT registers (SDM 11.5.1, table 11-1): CMCI, timer,
/// thermal, performance counters, LINT0, LINT1, error.
const XAPIC_LVTS: [u64; 7] = [0x2F0, 0x320, 0x330, 0x340, 0x350, 0x360, 0x370];

/// The xAPIC registers a guest store may change besides the LVTs (SDM
/// table 11-1): TPR, EOI, LDR, DFR, SVR, ESR, the ICR's two halves, the
/// timer's initial count and divide configuration.
const XAPIC_WRITABLE: [u64; 10] = [
    0x080,
    0x0B0,
    0x0D0,
    0x0E0,
    0x0F0,
    0x280,
    XAPIC_ICR_LOW,
    XAPIC_ICR_HIGH,
    0x380,
    0x3E0,
];

/// What root does with a guest store to a register of the xAPIC page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterWrite {
    /// Write the value to the CPU's APIC. (For the ICR's low word the
    /// caller first takes INIT and SIPI for itself: see [`classify`].)
    Carry,
    /// Drop the store: the register is read-only or reserved (a store has
    /// no effect on hardware, or, at offset 0 under QEMU's emulated APIC,
    /// sends an MSI), or it is the APIC ID (root routes start-up IPIs by
    /// the MADT's IDs).
    Ignore,
    /// Drop the store: an LVT entry with a delivery mode the guest may not
    /// program ([`routed_mode_allowed`]).
    Refuse,
}

/// What root does with a guest store of `value` at `offset` (16-byte
/// aligned) in the xAPIC page.
pub fn register_write(offset: u64, value: u32) -> RegisterWrite {
    if XAPIC_LVTS.contains(&offset) {
        if routed_mode_allowed(value) {
            RegisterWrite::Carry
        } else {
            RegisterWrite::Refuse
        }
    } else if XAPIC_WRITABLE.contains(&offset) {
        RegisterWrite::Carry
    } else {
        RegisterWrite::Ignore
    }
}

/// The guest's mode at an exit, as far as [`guest_store`] needs it: the
/// guest's CR0, CR4, IA32_EFER and CS access rights from the VMCS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestMode {
    pub cr0: u64,
    pub cr4: u64,
    pub efer: u64,
    pub cs_access_rights: u32,
}

/// CR0.PG.
const CR0_PG: u64 = 1 << 31;
/// CR4.PAE.
const CR4_PAE: u64 = 1 << 5;
/// CR4.LA57.
const CR4_LA57: u64 = 1 << 12;
/// IA32_EFER.LMA.
const EFER_LMA: u64 = 1 << 10;
/// Segment access rights bit 13: L, a 64-bit code segment.
const CS_L: u32 = 1 << 13;

impl GuestMode {
    /// 64-bit mode on 4-level paging: CR0.PG, CR4.PAE and EFER.LMA set,
    /// CR4.LA57 clear, and a 64-bit code segment (CS.L). Only there do
    /// the decoder's encoding ([`decode_store`]: REX prefixes, RIP-relative
    /// addressing) and root's 4-level walk of RIP hold.
    pub fn long_4level(&self) -> bool {
        self.cr0 & CR0_PG != 0
            && self.cr4 & CR4_PAE != 0
            && self.cr4 & CR4_LA57 == 0
            && self.efer & EFER_LMA != 0
            && self.cs_access_rights & CS_L != 0
    }
}

/// Why root does not carry out a guest store that exited on an interrupt
/// window (the APIC page, the I/O APIC's, the MSI window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The store was part of an event's delivery (the IDT-vectoring
    /// information of the exit is valid): the instruction at RIP is not
    /// what stored.
    DuringDelivery,
    /// Not 64-bit mode on 4-level paging ([`GuestMode::long_4level`]).
    NotLong4Level,
    /// The instruction could not be fetched, or is not one
    /// [`decode_store`] knows.
    Undecodable,
}

/// Decides whether root may carry out a guest store that exited, and
/// decodes it: refused during an event's delivery, outside 64-bit mode on
/// 4-level paging, and when the bytes `fetch` reads at the guest's RIP
/// (into the buffer; it returns how many it read, 0 when none) are not a
/// store [`decode_store`] knows. `fetch` runs only when the first two
/// checks pass, so root never walks the guest's page tables in a mode they
/// do not have.
pub fn guest_store(
    mode: &GuestMode,
    during_delivery: bool,
    fetch: impl FnOnce(&mut [u8; MAX_INSN_LEN]) -> usize,
) -> Result<Store, Refusal> {
    if during_delivery {
        return Err(Refusal::DuringDelivery);
    }
    if !mode.long_4level() {
        return Err(Refusal::NotLong4Level);
    }
    let mut bytes = [0u8; MAX_INSN_LEN];
    let got = fetch(&mut bytes).min(MAX_INSN_LEN);
    bytes
        .get(..got)
        .and_then(decode_store)
        .ok_or(Refusal::Undecodable)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-bit kernel's mode: CR0.PG|PE, CR4.PAE, EFER.LME|LMA, CS 0xa09b.
    const LONG: GuestMode = GuestMode {
        cr0: 0x8005_0033,
        cr4: 0x0030_06f0,
        efer: 0xd01,
        cs_access_rights: 0xa09b,
    };

    /// `mov [rip+0x10], eax`'s bytes, as a fetch at RIP.
    fn fetch_mov(buf: &mut [u8; MAX_INSN_LEN]) -> usize {
        let insn = [0x89, 0x05, 0x10, 0x00, 0x00, 0x00];
        buf[..insn.len()].copy_from_slice(&insn);
        insn.len()
    }

    #[test]
    fn a_store_during_event_delivery_is_refused_without_a_fetch() {
        assert_eq!(
            guest_store(&LONG, false, fetch_mov),
            Ok(Store {
                len: 6,
                value: StoreValue::Reg(0),
                xchg: false
            })
        );
        // The delivery of an event (a push onto a stack the guest pointed
        // into the APIC page) exited: RIP is not the store's, and nothing
        // is read there.
        assert_eq!(
            guest_store(&LONG, true, |_| panic!("fetched during delivery")),
            Err(Refusal::DuringDelivery)
        );
    }

    #[test]
    fn only_64_bit_mode_on_4_level_paging_is_decoded() {
        assert!(LONG.long_4level());
        let refused = |m: GuestMode| guest_store(&m, false, |_| panic!("fetched in {m:x?}"));
        for m in [
            GuestMode { cr0: 0x11, ..LONG }, // paging off
            GuestMode {
                cr4: 0x6f0 & !0x20,
                ..LONG
            }, // no PAE
            GuestMode {
                cr4: 0x6f0 | CR4_LA57,
                ..LONG
            }, // 5-level paging
            GuestMode {
                efer: 0x100,
                ..LONG
            }, // LME without LMA
            GuestMode { efer: 0, ..LONG },   // legacy mode
            GuestMode {
                cs_access_rights: 0xc09b,
                ..LONG
            }, // compatibility mode
        ] {
            assert!(!m.long_4level(), "{m:x?}");
            assert_eq!(refused(m), Err(Refusal::NotLong4Level));
        }
        // Undecodable or unreadable bytes at RIP.
        assert_eq!(guest_store(&LONG, false, |_| 0), Err(Refusal::Undecodable));
        assert_eq!(
            guest_store(&LONG, false, |b| {
                b[0] = 0x88;
                2
            }),
            Err(Refusal::Undecodable)
        );
        // A fetch that claims more than the buffer holds is cut to it.
        assert!(guest_store(&LONG, false, |b| {
            fetch_mov(b);
            usize::MAX
        })
        .is_ok());
    }

    #[test]
    fn lvt_entries_with_init_and_other_dangerous_modes_are_refused() {
        for lvt in XAPIC_LVTS {
            // Linux: masked fixed, NMI on LINT1, ExtINT on LINT0.
            for ok in [
                0x0001_00ef,
                0x0000_0400,
                0x0000_0700,
                0x0000_00ec,
                0x0001_0100,
            ] {
                assert_eq!(
                    register_write(lvt, ok),
                    RegisterWrite::Carry,
                    "{lvt:#x} {ok:#x}"
                );
            }
            // INIT (level or edge, masked or not), SMI, start-up, reserved.
            for bad in [
                0x0000_0500,
                0x0000_8500,
                0x0001_0500,
                0x0000_0200,
                0x0000_0600,
                0x0000_0300,
            ] {
                assert_eq!(
                    register_write(lvt, bad),
                    RegisterWrite::Refuse,
                    "{lvt:#x} {bad:#x}"
                );
            }
        }
        assert!(routed_mode_allowed(0x0000_0100));
        assert!(!routed_mode_allowed(0xffff_f5ff));
    }

    #[test]
    fn x2apic_lvt_msrs_name_the_xapic_lvts() {
        let offsets: Vec<u64> = (0x800..0x900).filter_map(x2apic_lvt_offset).collect();
        assert_eq!(offsets, XAPIC_LVTS);
        assert_eq!(x2apic_lvt_offset(0x835), Some(0x350));
        assert_eq!(x2apic_lvt_offset(X2APIC_ICR_MSR), None);
        assert_eq!(x2apic_lvt_offset(0x838), None);
    }

    #[test]
    fn only_writable_registers_are_carried() {
        for reg in [
            0x080, 0x0B0, 0x0D0, 0x0E0, 0x0F0, 0x280, 0x300, 0x310, 0x380, 0x3E0,
        ] {
            assert_eq!(
                register_write(reg, 0x0000_0500),
                RegisterWrite::Carry,
                "{reg:#x}"
            );
        }
        // Offset 0 (QEMU sends an MSI for it), the APIC ID, the version,
        // APR, PPR, ISR/TMR/IRR, the current count, the x2APIC-only
        // self-IPI, and the rest of the page.
        for reg in [
            0x000, 0x010, 0x020, 0x030, 0x090, 0x0A0, 0x0C0, 0x100, 0x270, 0x390, 0x3F0, 0x400,
            0xFF0,
        ] {
            assert_eq!(register_write(reg, 0), RegisterWrite::Ignore, "{reg:#x}");
        }
    }

    #[test]
    fn linux_init_assert() {
        let icr = Icr::from_xapic(0x0000_C500, 0x0100_0000);
        assert_eq!(icr.mode, DeliveryMode::Init);
        assert!(icr.level_assert);
        assert!(icr.level_triggered);
        assert!(!icr.logical);
        assert_eq!(icr.shorthand, Shorthand::None);
        assert_eq!(icr.dest, 1);
        assert!(!icr.x2apic);
        assert_eq!(classify(&icr), IpiAction::Init);
    }

    #[test]
    fn linux_init_deassert_is_ignored() {
        let icr = Icr::from_xapic(0x0000_8500, 0x0100_0000);
        assert_eq!(icr.mode, DeliveryMode::Init);
        assert!(!icr.level_assert);
        assert!(icr.level_triggered);
        assert_eq!(classify(&icr), IpiAction::Ignore);
    }

    #[test]
    fn edge_init_is_init() {
        // Edge-triggered INIT (trigger mode 0): not a de-assert.
        let icr = Icr::from_xapic(0x0000_0500, 0x0200_0000);
        assert_eq!(classify(&icr), IpiAction::Init);
        assert_eq!(icr.dest, 2);
    }

    #[test]
    fn linux_sipi() {
        let icr = Icr::from_xapic(0x0000_0699, 0x0100_0000);
        assert_eq!(icr.mode, DeliveryMode::Startup);
        assert_eq!(icr.vector, 0x99);
        assert_eq!(classify(&icr), IpiAction::Startup(0x99));
    }

    #[test]
    fn fixed_and_nmi_are_forwarded() {
        let fixed = Icr::from_xapic(0x0000_00FB, 0x0300_0000);
        assert_eq!(fixed.mode, DeliveryMode::Fixed);
        assert_eq!(fixed.vector, 0xFB);
        assert_eq!(classify(&fixed), IpiAction::Forward);

        let nmi = Icr::from_xapic(0x0000_0400, 0);
        assert_eq!(nmi.mode, DeliveryMode::Nmi);
        assert_eq!(classify(&nmi), IpiAction::Forward);
    }

    #[test]
    fn every_mode_and_shorthand() {
        let modes = [
            DeliveryMode::Fixed,
            DeliveryMode::LowestPriority,
            DeliveryMode::Smi,
            DeliveryMode::Reserved(3),
            DeliveryMode::Nmi,
            DeliveryMode::Init,
            DeliveryMode::Startup,
            DeliveryMode::Reserved(7),
        ];
        for (bits, mode) in modes.iter().enumerate() {
            assert_eq!(Icr::from_xapic((bits as u32) << 8, 0).mode, *mode);
        }
        let shorthands = [
            Shorthand::None,
            Shorthand::SelfOnly,
            Shorthand::AllIncludingSelf,
            Shorthand::AllExcludingSelf,
        ];
        for (bits, sh) in shorthands.iter().enumerate() {
            assert_eq!(Icr::from_xapic((bits as u32) << 18, 0).shorthand, *sh);
        }
        assert!(Icr::from_xapic(1 << 11, 0).logical);
        // SMI and the reserved modes reach no CPU.
        for low in [0x0000_0200, 0x0000_0300, 0x0000_0700, 0x000c_0200] {
            assert_eq!(classify(&Icr::from_xapic(low, 0)), IpiAction::Ignore);
        }
        assert_eq!(
            classify(&Icr::from_xapic(0x0000_0100, 0)),
            IpiAction::Forward
        );
    }

    #[test]
    fn xapic_dest_uses_high_byte_only() {
        assert_eq!(Icr::from_xapic(0, 0xAB12_3456).dest, 0xAB);
    }

    #[test]
    fn x2apic_icr() {
        let icr = Icr::from_x2apic((3u64 << 32) | 0x4500);
        assert_eq!(icr.dest, 3);
        assert!(icr.x2apic);
        assert_eq!(icr.mode, DeliveryMode::Init);
        assert!(icr.level_assert);
        assert!(!icr.level_triggered);
        assert_eq!(classify(&icr), IpiAction::Init);

        let sipi = Icr::from_x2apic((0x1234_5678u64 << 32) | 0x0608);
        assert_eq!(sipi.dest, 0x1234_5678);
        assert_eq!(classify(&sipi), IpiAction::Startup(0x08));
    }

    fn phys(dest: u32) -> Icr {
        Icr::from_xapic(0x0000_4500, dest << 24)
    }

    #[test]
    fn targets_physical() {
        let ids = [0, 1, 2];
        assert_eq!(targets(&phys(2), 0, &ids), 0b100);
        assert_eq!(targets(&phys(0), 1, &ids), 0b001);
        assert_eq!(targets(&phys(7), 0, &ids), 0);
        assert_eq!(targets(&phys(0xFF), 0, &ids), 0b111);
        // Non-contiguous APIC IDs.
        assert_eq!(targets(&phys(6), 0, &[0, 2, 4, 6]), 0b1000);
        assert_eq!(targets(&phys(1), 0, &[]), 0);
        assert_eq!(targets(&phys(0xFF), 0, &[]), 0);
    }

    #[test]
    fn targets_shorthands() {
        let ids = [0, 1, 2];
        let sh = |bits: u32| Icr::from_xapic(0x0000_4500 | (bits << 18), 0);
        assert_eq!(targets(&sh(0b11), 1, &ids), 0b101);
        assert_eq!(targets(&sh(0b10), 1, &ids), 0b111);
        assert_eq!(targets(&sh(0b01), 1, &ids), 0);
        // A sender beyond the list excludes no one.
        assert_eq!(targets(&sh(0b11), 40, &ids), 0b111);
        // The destination mode does not matter with a shorthand.
        let logical_all_but_self = Icr::from_xapic(0x000C_4D00, 0);
        assert!(logical_all_but_self.logical);
        assert_eq!(targets(&logical_all_but_self, 0, &ids), 0b110);
    }

    #[test]
    fn targets_logical() {
        let icr = Icr::from_xapic(0x0000_4D00, 0x0100_0000);
        assert!(icr.logical);
        assert_eq!(targets(&icr, 0, &[0, 1, 2]), 0);
        let bcast = Icr::from_xapic(0x0000_4D00, 0xFF00_0000);
        assert_eq!(targets(&bcast, 0, &[0, 1, 2]), 0);
    }

    #[test]
    fn targets_x2apic() {
        let ids = [0, 1, 2, 3];
        let all = Icr::from_x2apic((0xFFFF_FFFFu64 << 32) | 0x4500);
        assert_eq!(targets(&all, 0, &ids), 0b1111);
        // 0xFF is an ordinary x2APIC ID, not a broadcast.
        let ff = Icr::from_x2apic((0xFFu64 << 32) | 0x4500);
        assert_eq!(targets(&ff, 0, &ids), 0);
        assert_eq!(targets(&ff, 0, &[0, 0xFF]), 0b10);
        let three = Icr::from_x2apic((3u64 << 32) | 0x4500);
        assert_eq!(targets(&three, 0, &ids), 0b1000);
    }

    #[test]
    fn targets_at_most_32() {
        let ids: Vec<u32> = (0..40).collect();
        assert_eq!(targets(&phys(0xFF), 0, &ids), u32::MAX);
        assert_eq!(targets(&phys(31), 0, &ids), 1 << 31);
        assert_eq!(targets(&phys(35), 0, &ids), 0);
        let all_but_self = Icr::from_xapic(0x000C_4500, 0);
        assert_eq!(targets(&all_but_self, 31, &ids), u32::MAX >> 1);
        let ids32: Vec<u32> = (0..32).collect();
        assert_eq!(targets(&phys(0xFF), 0, &ids32), u32::MAX);
    }

    fn store(len: u8, value: StoreValue, xchg: bool) -> Option<Store> {
        Some(Store { len, value, xchg })
    }

    #[test]
    fn mov_reg_forms() {
        use StoreValue::Reg;
        let abs = [0x89, 0x04, 0x25, 0x00, 0x03, 0x5f, 0xff];
        assert_eq!(decode_store(&abs), store(7, Reg(0), false));
        // REX.B selects r12 as the base; the source stays eax.
        assert_eq!(
            decode_store(&[0x41, 0x89, 0x04, 0x24]),
            store(4, Reg(0), false)
        );
        // REX.R: r9d.
        assert_eq!(
            decode_store(&[0x44, 0x89, 0x0c, 0x25, 0x00, 0x03, 0x5f, 0xff]),
            store(8, Reg(9), false)
        );
        assert_eq!(decode_store(&[0x89, 0x43, 0x08]), store(3, Reg(0), false));
        assert_eq!(
            decode_store(&[0x89, 0x83, 0x00, 0x03, 0x00, 0x00]),
            store(6, Reg(0), false)
        );
        assert_eq!(
            decode_store(&[0x89, 0x44, 0x24, 0x08]),
            store(4, Reg(0), false)
        );
        // SIB with base and disp32.
        assert_eq!(
            decode_store(&[0x89, 0x94, 0x24, 0x00, 0x03, 0x00, 0x00]),
            store(7, Reg(2), false)
        );
        // mod 00 with a plain register base: no displacement.
        assert_eq!(decode_store(&[0x89, 0x3e]), store(2, Reg(7), false));
        // RIP-relative.
        assert_eq!(
            decode_store(&[0x89, 0x1d, 0x10, 0x00, 0x00, 0x00]),
            store(6, Reg(3), false)
        );
    }

    #[test]
    fn mov_imm_forms() {
        use StoreValue::Imm;
        let rip = [0xc7, 0x05, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00];
        assert_eq!(decode_store(&rip), store(10, Imm(0), false));
        let abs = [
            0xc7, 0x04, 0x25, 0xb0, 0x00, 0x5f, 0xff, 0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(decode_store(&abs), store(11, Imm(0), false));
        let disp8 = [0xc7, 0x40, 0x08, 0x99, 0x06, 0x00, 0x00];
        assert_eq!(decode_store(&disp8), store(7, Imm(0x699), false));
        // REX.B (r8 base) is fine for C7; REX.R does not matter either.
        let rex = [0x45, 0xc7, 0x00, 0x00, 0xc5, 0x00, 0x00];
        assert_eq!(decode_store(&rex), store(7, Imm(0xc500), false));
    }

    #[test]
    fn xchg_form() {
        let x = [0x87, 0x04, 0x25, 0x00, 0x03, 0x5f, 0xff];
        assert_eq!(decode_store(&x), store(7, StoreValue::Reg(0), true));
        let rex_r = [0x44, 0x87, 0x38];
        assert_eq!(decode_store(&rex_r), store(3, StoreValue::Reg(15), true));
    }

    #[test]
    fn prefixes() {
        let gs = [0x65, 0x89, 0x04, 0x25, 0x00, 0x03, 0x5f, 0xff];
        assert_eq!(decode_store(&gs), store(8, StoreValue::Reg(0), false));
        let many = [0x2e, 0x3e, 0xf0, 0x67, 0x41, 0x89, 0x04, 0x24];
        assert_eq!(decode_store(&many), store(8, StoreValue::Reg(0), false));
        // A REX followed by a legacy prefix is not "immediately before".
        assert_eq!(decode_store(&[0x41, 0x65, 0x89, 0x00]), None);
        // Two REX prefixes.
        assert_eq!(decode_store(&[0x41, 0x44, 0x89, 0x00]), None);
    }

    #[test]
    fn rejects() {
        let tail = [0x04, 0x25, 0x00, 0x03, 0x5f, 0xff];
        let with = |pre: &[u8]| -> Vec<u8> { pre.iter().chain(tail.iter()).copied().collect() };
        assert_eq!(decode_store(&with(&[0x66, 0x89])), None);
        assert_eq!(decode_store(&with(&[0x48, 0x89])), None);
        assert_eq!(decode_store(&with(&[0x4c, 0x87])), None);
        assert_eq!(decode_store(&with(&[0xf3, 0x89])), None);
        assert_eq!(decode_store(&with(&[0xf2, 0x89])), None);
        assert_eq!(decode_store(&[0x89, 0xc0]), None);
        assert_eq!(decode_store(&[0xc7, 0xc0, 0, 0, 0, 0]), None);
        assert_eq!(decode_store(&[0xc7, 0x48, 0x08, 0, 0, 0, 0]), None);
        assert_eq!(decode_store(&[0x89, 0x04, 0x25, 0x00, 0x03]), None);
        assert_eq!(decode_store(&[0xc7, 0x05, 0x10, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(decode_store(&[0x89]), None);
        assert_eq!(decode_store(&[0x65]), None);
        assert_eq!(decode_store(&[0x41]), None);
        assert_eq!(decode_store(&[]), None);
        // Other opcodes: byte store, load, 16-byte vector store.
        assert_eq!(decode_store(&[0x88, 0x00]), None);
        assert_eq!(decode_store(&[0x8b, 0x00]), None);
        assert_eq!(decode_store(&[0x0f, 0x11, 0x00]), None);
    }

    #[test]
    fn length_limit() {
        // 8 prefixes + 7 bytes = 15: accepted.
        let mut ok = vec![0x3e; 8];
        ok.extend([0x89, 0x04, 0x25, 0x00, 0x03, 0x5f, 0xff]);
        assert_eq!(decode_store(&ok), store(15, StoreValue::Reg(0), false));
        // One more prefix: 16 bytes, over the limit.
        let mut long = vec![0x3e; 9];
        long.extend([0x89, 0x04, 0x25, 0x00, 0x03, 0x5f, 0xff]);
        assert_eq!(decode_store(&long), None);
        // A run of prefixes with no opcode inside 15 bytes.
        assert_eq!(decode_store(&[0x65; 40]), None);
        // Bytes past the instruction do not matter.
        let mut trailing = vec![0x89, 0x43, 0x08];
        trailing.extend([0xcc; 20]);
        assert_eq!(decode_store(&trailing), store(3, StoreValue::Reg(0), false));
    }

    /// A small linear congruential generator (Knuth's MMIX constants).
    struct Lcg(u64);

    impl Lcg {
        fn byte(&mut self) -> u8 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 56) as u8
        }
    }

    #[test]
    fn never_panics_on_random_bytes() {
        let mut rng = Lcg(0x5eed);
        // Bytes that lead into the accepted forms, to reach deep paths often.
        let lead = [0x89, 0xc7, 0x87, 0x41, 0x44, 0x65, 0xf0];
        for first in 0..=255u8 {
            for round in 0..64 {
                let mut buf = [0u8; 15];
                buf[0] = first;
                for (i, b) in buf.iter_mut().enumerate().skip(1) {
                    *b = if round % 2 == 1 && i == 1 {
                        lead[usize::from(rng.byte()) % lead.len()]
                    } else {
                        rng.byte()
                    };
                }
                for cut in 0..=buf.len() {
                    let bytes = &buf[..cut];
                    if let Some(s) = decode_store(bytes) {
                        let len = usize::from(s.len);
                        assert!((1..=15).contains(&len), "{bytes:02x?}");
                        assert!(len <= bytes.len(), "{bytes:02x?}");
                        // The decode depends only on the instruction's own
                        // bytes, and needs all of them.
                        assert_eq!(decode_store(&bytes[..len]), Some(s));
                        assert_eq!(decode_store(&bytes[..len - 1]), None);
                    }
                }
            }
        }
    }
}
