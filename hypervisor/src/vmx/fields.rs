//! Typed VMCS fields (SDM Appendix B "Field encoding in VMCS").
//!
//! Each field is a constant carrying its encoding, its name (for dumps) and
//! its width as a type. Read-only fields (`Ro`) have no writer. Encodings come
//! from the `x86` crate. Access goes through [`VmcsIo`], which the hypervisor
//! implements with VMREAD/VMWRITE and the tests with a map; a failed access is
//! an error carrying the field, never a silent zero.

use super::shadow;
use core::marker::PhantomData;
use x86::vmx::vmcs::{control, guest, host, ro};

/// A VMREAD or VMWRITE that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmcsError {
    /// Encoding of the field.
    pub encoding: u32,
    /// Name of the field.
    pub name: &'static str,
    /// Whether it was a write.
    pub write: bool,
}

impl core::fmt::Display for VmcsError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let op = if self.write { "VMWRITE" } else { "VMREAD" };
        write!(f, "{op} of {} ({:#06x}) failed", self.name, self.encoding)
    }
}

/// Raw access to the current VMCS.
pub trait VmcsIo {
    /// Reads the field with `encoding`; `None` when the CPU refuses.
    fn read_raw(&self, encoding: u32) -> Option<u64>;
    /// Writes the field with `encoding`; `false` when the CPU refuses.
    fn write_raw(&mut self, encoding: u32, value: u64) -> bool;
    /// Told of each access to a field that a nested KVM does not shadow
    /// ([`super::shadow`]): under KVM, each is an exit to it. The
    /// hypervisor counts them per vCPU.
    fn unshadowed(&self, _encoding: u32, _write: bool) {}
}

/// A value width a VMCS field can have.
pub trait Width: Copy {
    /// Bits of the width.
    const BITS: u32;
    /// Truncates a raw VMREAD result to this width.
    fn from_raw(v: u64) -> Self;
    /// Widens for VMWRITE.
    fn to_raw(self) -> u64;
}

impl Width for u16 {
    const BITS: u32 = 16;
    fn from_raw(v: u64) -> Self {
        v as u16
    }
    fn to_raw(self) -> u64 {
        self as u64
    }
}
impl Width for u32 {
    const BITS: u32 = 32;
    fn from_raw(v: u64) -> Self {
        v as u32
    }
    fn to_raw(self) -> u64 {
        self as u64
    }
}
impl Width for u64 {
    const BITS: u32 = 64;
    fn from_raw(v: u64) -> Self {
        v
    }
    fn to_raw(self) -> u64 {
        self
    }
}

/// A read-write field of width `T`.
#[derive(Debug, Clone, Copy)]
pub struct Rw<T> {
    /// Encoding.
    pub encoding: u32,
    /// Name, as the SDM spells it.
    pub name: &'static str,
    /// Whether a nested KVM's shadow VMCS holds it for reads, and for
    /// writes (known at compile time, so the check costs nothing on a
    /// constant field).
    pub read_shadowed: bool,
    pub write_shadowed: bool,
    _w: PhantomData<T>,
}

/// A read-only (exit-information) field of width `T`.
#[derive(Debug, Clone, Copy)]
pub struct Ro<T> {
    /// Encoding.
    pub encoding: u32,
    /// Name, as the SDM spells it.
    pub name: &'static str,
    /// Whether a nested KVM's shadow VMCS holds it.
    pub read_shadowed: bool,
    _w: PhantomData<T>,
}

impl<T: Width> Rw<T> {
    const fn new(encoding: u32, name: &'static str) -> Self {
        Self {
            encoding,
            name,
            read_shadowed: shadow::read_shadowed(encoding),
            write_shadowed: shadow::write_shadowed(encoding),
            _w: PhantomData,
        }
    }
    /// VMREAD.
    pub fn read(self, io: &impl VmcsIo) -> Result<T, VmcsError> {
        if !self.read_shadowed {
            io.unshadowed(self.encoding, false);
        }
        io.read_raw(self.encoding)
            .map(T::from_raw)
            .ok_or(VmcsError {
                encoding: self.encoding,
                name: self.name,
                write: false,
            })
    }
    /// VMWRITE.
    pub fn write(self, io: &mut impl VmcsIo, v: T) -> Result<(), VmcsError> {
        if !self.write_shadowed {
            io.unshadowed(self.encoding, true);
        }
        if io.write_raw(self.encoding, v.to_raw()) {
            Ok(())
        } else {
            Err(VmcsError {
                encoding: self.encoding,
                name: self.name,
                write: true,
            })
        }
    }
}

impl<T: Width> Ro<T> {
    const fn new(encoding: u32, name: &'static str) -> Self {
        Self {
            encoding,
            name,
            read_shadowed: shadow::read_shadowed(encoding),
            _w: PhantomData,
        }
    }
    /// VMREAD.
    pub fn read(self, io: &impl VmcsIo) -> Result<T, VmcsError> {
        if !self.read_shadowed {
            io.unshadowed(self.encoding, false);
        }
        io.read_raw(self.encoding)
            .map(T::from_raw)
            .ok_or(VmcsError {
                encoding: self.encoding,
                name: self.name,
                write: false,
            })
    }
}

/// The width in bits that a field's encoding gives it (SDM Appendix B.1:
/// bits 14:13 are the width, 16-bit, 64-bit, 32-bit or natural; an access
/// to the high half of a 64-bit field, bit 0 set, is 32 bits; natural
/// width is 64 bits on x86-64).
pub const fn encoding_width(encoding: u32) -> u32 {
    match (encoding >> 13) & 3 {
        0 => 16,
        1 if encoding & 1 != 0 => 32,
        1 => 64,
        2 => 32,
        _ => 64,
    }
}

macro_rules! fields {
    ($( $(#[$m:meta])* $name:ident : $kind:ident<$t:ty> = $enc:expr; )*) => {
        $(
            $(#[$m])* pub const $name: $kind<$t> = $kind::<$t>::new($enc, stringify!($name));
            const _: () = assert!(
                encoding_width($enc) == <$t as Width>::BITS,
                concat!("the declared width of ", stringify!($name), " is not its encoding's")
            );
        )*
        /// Every field above as `(name, encoding)`, in declaration order, for dumps.
        pub const ALL: &[(&str, u32)] = &[$( (stringify!($name), $enc) ),*];
    };
}

fields! {
    VPID: Rw<u16> = control::VPID;
    GUEST_ES_SELECTOR: Rw<u16> = guest::ES_SELECTOR;
    GUEST_CS_SELECTOR: Rw<u16> = guest::CS_SELECTOR;
    GUEST_SS_SELECTOR: Rw<u16> = guest::SS_SELECTOR;
    GUEST_DS_SELECTOR: Rw<u16> = guest::DS_SELECTOR;
    GUEST_FS_SELECTOR: Rw<u16> = guest::FS_SELECTOR;
    GUEST_GS_SELECTOR: Rw<u16> = guest::GS_SELECTOR;
    GUEST_LDTR_SELECTOR: Rw<u16> = guest::LDTR_SELECTOR;
    GUEST_TR_SELECTOR: Rw<u16> = guest::TR_SELECTOR;
    HOST_ES_SELECTOR: Rw<u16> = host::ES_SELECTOR;
    HOST_CS_SELECTOR: Rw<u16> = host::CS_SELECTOR;
    HOST_SS_SELECTOR: Rw<u16> = host::SS_SELECTOR;
    HOST_DS_SELECTOR: Rw<u16> = host::DS_SELECTOR;
    HOST_FS_SELECTOR: Rw<u16> = host::FS_SELECTOR;
    HOST_GS_SELECTOR: Rw<u16> = host::GS_SELECTOR;
    HOST_TR_SELECTOR: Rw<u16> = host::TR_SELECTOR;

    IO_BITMAP_A: Rw<u64> = control::IO_BITMAP_A_ADDR_FULL;
    IO_BITMAP_B: Rw<u64> = control::IO_BITMAP_B_ADDR_FULL;
    MSR_BITMAP: Rw<u64> = control::MSR_BITMAPS_ADDR_FULL;
    EPT_POINTER: Rw<u64> = control::EPTP_FULL;
    VMCS_LINK_POINTER: Rw<u64> = guest::LINK_PTR_FULL;
    GUEST_IA32_DEBUGCTL: Rw<u64> = guest::IA32_DEBUGCTL_FULL;
    GUEST_IA32_PAT: Rw<u64> = guest::IA32_PAT_FULL;
    GUEST_IA32_EFER: Rw<u64> = guest::IA32_EFER_FULL;
    GUEST_PDPTE0: Rw<u64> = guest::PDPTE0_FULL;
    GUEST_PDPTE1: Rw<u64> = guest::PDPTE1_FULL;
    GUEST_PDPTE2: Rw<u64> = guest::PDPTE2_FULL;
    GUEST_PDPTE3: Rw<u64> = guest::PDPTE3_FULL;
    HOST_IA32_PAT: Rw<u64> = host::IA32_PAT_FULL;
    HOST_IA32_EFER: Rw<u64> = host::IA32_EFER_FULL;
    GUEST_PHYSICAL_ADDRESS: Ro<u64> = ro::GUEST_PHYSICAL_ADDR_FULL;

    PIN_BASED_CONTROLS: Rw<u32> = control::PINBASED_EXEC_CONTROLS;
    PRIMARY_PROC_CONTROLS: Rw<u32> = control::PRIMARY_PROCBASED_EXEC_CONTROLS;
    SECONDARY_PROC_CONTROLS: Rw<u32> = control::SECONDARY_PROCBASED_EXEC_CONTROLS;
    EXCEPTION_BITMAP: Rw<u32> = control::EXCEPTION_BITMAP;
    CR3_TARGET_COUNT: Rw<u32> = control::CR3_TARGET_COUNT;
    EXIT_CONTROLS: Rw<u32> = control::VMEXIT_CONTROLS;
    ENTRY_CONTROLS: Rw<u32> = control::VMENTRY_CONTROLS;
    ENTRY_INTERRUPTION_INFO: Rw<u32> = control::VMENTRY_INTERRUPTION_INFO_FIELD;
    ENTRY_EXCEPTION_ERROR_CODE: Rw<u32> = control::VMENTRY_EXCEPTION_ERR_CODE;
    ENTRY_INSTRUCTION_LEN: Rw<u32> = control::VMENTRY_INSTRUCTION_LEN;
    GUEST_ES_LIMIT: Rw<u32> = guest::ES_LIMIT;
    GUEST_CS_LIMIT: Rw<u32> = guest::CS_LIMIT;
    GUEST_SS_LIMIT: Rw<u32> = guest::SS_LIMIT;
    GUEST_DS_LIMIT: Rw<u32> = guest::DS_LIMIT;
    GUEST_FS_LIMIT: Rw<u32> = guest::FS_LIMIT;
    GUEST_GS_LIMIT: Rw<u32> = guest::GS_LIMIT;
    GUEST_LDTR_LIMIT: Rw<u32> = guest::LDTR_LIMIT;
    GUEST_TR_LIMIT: Rw<u32> = guest::TR_LIMIT;
    GUEST_GDTR_LIMIT: Rw<u32> = guest::GDTR_LIMIT;
    GUEST_IDTR_LIMIT: Rw<u32> = guest::IDTR_LIMIT;
    GUEST_ES_ACCESS_RIGHTS: Rw<u32> = guest::ES_ACCESS_RIGHTS;
    GUEST_CS_ACCESS_RIGHTS: Rw<u32> = guest::CS_ACCESS_RIGHTS;
    GUEST_SS_ACCESS_RIGHTS: Rw<u32> = guest::SS_ACCESS_RIGHTS;
    GUEST_DS_ACCESS_RIGHTS: Rw<u32> = guest::DS_ACCESS_RIGHTS;
    GUEST_FS_ACCESS_RIGHTS: Rw<u32> = guest::FS_ACCESS_RIGHTS;
    GUEST_GS_ACCESS_RIGHTS: Rw<u32> = guest::GS_ACCESS_RIGHTS;
    GUEST_LDTR_ACCESS_RIGHTS: Rw<u32> = guest::LDTR_ACCESS_RIGHTS;
    GUEST_TR_ACCESS_RIGHTS: Rw<u32> = guest::TR_ACCESS_RIGHTS;
    GUEST_INTERRUPTIBILITY: Rw<u32> = guest::INTERRUPTIBILITY_STATE;
    GUEST_ACTIVITY_STATE: Rw<u32> = guest::ACTIVITY_STATE;
    GUEST_IA32_SYSENTER_CS: Rw<u32> = guest::IA32_SYSENTER_CS;
    PREEMPTION_TIMER_VALUE: Rw<u32> = guest::VMX_PREEMPTION_TIMER_VALUE;
    HOST_IA32_SYSENTER_CS: Rw<u32> = host::IA32_SYSENTER_CS;
    VM_INSTRUCTION_ERROR: Ro<u32> = ro::VM_INSTRUCTION_ERROR;
    EXIT_REASON: Ro<u32> = ro::EXIT_REASON;
    EXIT_INTERRUPTION_INFO: Ro<u32> = ro::VMEXIT_INTERRUPTION_INFO;
    EXIT_INTERRUPTION_ERROR_CODE: Ro<u32> = ro::VMEXIT_INTERRUPTION_ERR_CODE;
    IDT_VECTORING_INFO: Ro<u32> = ro::IDT_VECTORING_INFO;
    IDT_VECTORING_ERROR_CODE: Ro<u32> = ro::IDT_VECTORING_ERR_CODE;
    EXIT_INSTRUCTION_LEN: Ro<u32> = ro::VMEXIT_INSTRUCTION_LEN;
    EXIT_INSTRUCTION_INFO: Ro<u32> = ro::VMEXIT_INSTRUCTION_INFO;

    CR0_GUEST_HOST_MASK: Rw<u64> = control::CR0_GUEST_HOST_MASK;
    CR4_GUEST_HOST_MASK: Rw<u64> = control::CR4_GUEST_HOST_MASK;
    CR0_READ_SHADOW: Rw<u64> = control::CR0_READ_SHADOW;
    CR4_READ_SHADOW: Rw<u64> = control::CR4_READ_SHADOW;
    EXIT_QUALIFICATION: Ro<u64> = ro::EXIT_QUALIFICATION;
    GUEST_LINEAR_ADDRESS: Ro<u64> = ro::GUEST_LINEAR_ADDR;
    GUEST_CR0: Rw<u64> = guest::CR0;
    GUEST_CR3: Rw<u64> = guest::CR3;
    GUEST_CR4: Rw<u64> = guest::CR4;
    GUEST_ES_BASE: Rw<u64> = guest::ES_BASE;
    GUEST_CS_BASE: Rw<u64> = guest::CS_BASE;
    GUEST_SS_BASE: Rw<u64> = guest::SS_BASE;
    GUEST_DS_BASE: Rw<u64> = guest::DS_BASE;
    GUEST_FS_BASE: Rw<u64> = guest::FS_BASE;
    GUEST_GS_BASE: Rw<u64> = guest::GS_BASE;
    GUEST_LDTR_BASE: Rw<u64> = guest::LDTR_BASE;
    GUEST_TR_BASE: Rw<u64> = guest::TR_BASE;
    GUEST_GDTR_BASE: Rw<u64> = guest::GDTR_BASE;
    GUEST_IDTR_BASE: Rw<u64> = guest::IDTR_BASE;
    GUEST_DR7: Rw<u64> = guest::DR7;
    GUEST_RSP: Rw<u64> = guest::RSP;
    GUEST_RIP: Rw<u64> = guest::RIP;
    GUEST_RFLAGS: Rw<u64> = guest::RFLAGS;
    GUEST_PENDING_DEBUG_EXCEPTIONS: Rw<u64> = guest::PENDING_DBG_EXCEPTIONS;
    GUEST_IA32_SYSENTER_ESP: Rw<u64> = guest::IA32_SYSENTER_ESP;
    GUEST_IA32_SYSENTER_EIP: Rw<u64> = guest::IA32_SYSENTER_EIP;
    HOST_CR0: Rw<u64> = host::CR0;
    HOST_CR3: Rw<u64> = host::CR3;
    HOST_CR4: Rw<u64> = host::CR4;
    HOST_FS_BASE: Rw<u64> = host::FS_BASE;
    HOST_GS_BASE: Rw<u64> = host::GS_BASE;
    HOST_TR_BASE: Rw<u64> = host::TR_BASE;
    HOST_GDTR_BASE: Rw<u64> = host::GDTR_BASE;
    HOST_IDTR_BASE: Rw<u64> = host::IDTR_BASE;
    HOST_IA32_SYSENTER_ESP: Rw<u64> = host::IA32_SYSENTER_ESP;
    HOST_IA32_SYSENTER_EIP: Rw<u64> = host::IA32_SYSENTER_EIP;
    HOST_RSP: Rw<u64> = host::RSP;
    HOST_RIP: Rw<u64> = host::RIP;
}

/// The four fields of a guest segment register.
#[derive(Debug, Clone, Copy)]
pub struct GuestSegment {
    /// Selector.
    pub selector: Rw<u16>,
    /// Base address.
    pub base: Rw<u64>,
    /// Limit.
    pub limit: Rw<u32>,
    /// Access rights (VMX format; bit 16 = unusable).
    pub access_rights: Rw<u32>,
}

macro_rules! guest_segments {
    ($($sel:ident $base:ident $limit:ident $ar:ident),*) => {
        [$(GuestSegment {
            selector: $sel,
            base: $base,
            limit: $limit,
            access_rights: $ar,
        }),*]
    };
}

/// The guest's segment registers in encoding order: ES, CS, SS, DS, FS, GS,
/// LDTR, TR.
pub const GUEST_SEGMENTS: [GuestSegment; 8] = guest_segments!(
    GUEST_ES_SELECTOR GUEST_ES_BASE GUEST_ES_LIMIT GUEST_ES_ACCESS_RIGHTS,
    GUEST_CS_SELECTOR GUEST_CS_BASE GUEST_CS_LIMIT GUEST_CS_ACCESS_RIGHTS,
    GUEST_SS_SELECTOR GUEST_SS_BASE GUEST_SS_LIMIT GUEST_SS_ACCESS_RIGHTS,
    GUEST_DS_SELECTOR GUEST_DS_BASE GUEST_DS_LIMIT GUEST_DS_ACCESS_RIGHTS,
    GUEST_FS_SELECTOR GUEST_FS_BASE GUEST_FS_LIMIT GUEST_FS_ACCESS_RIGHTS,
    GUEST_GS_SELECTOR GUEST_GS_BASE GUEST_GS_LIMIT GUEST_GS_ACCESS_RIGHTS,
    GUEST_LDTR_SELECTOR GUEST_LDTR_BASE GUEST_LDTR_LIMIT GUEST_LDTR_ACCESS_RIGHTS,
    GUEST_TR_SELECTOR GUEST_TR_BASE GUEST_TR_LIMIT GUEST_TR_ACCESS_RIGHTS
);
/// Indices into [`GUEST_SEGMENTS`].
pub const SEG_ES: usize = 0;
/// CS.
pub const SEG_CS: usize = 1;
/// SS.
pub const SEG_SS: usize = 2;
/// DS.
pub const SEG_DS: usize = 3;
/// FS.
pub const SEG_FS: usize = 4;
/// GS.
pub const SEG_GS: usize = 5;
/// LDTR.
pub const SEG_LDTR: usize = 6;
/// TR.
pub const SEG_TR: usize = 7;

/// Access rights (VMCS format, SDM 25.4.1) bit 13, L: a 64-bit code
/// segment.
pub const AR_L: u32 = 1 << 13;
/// Access rights bit 14, D/B: 32-bit default operand and address size
/// (code), a 32-bit stack pointer (stack).
pub const AR_DB: u32 = 1 << 14;
/// Access rights of TR as the checks of VM entry require them: present,
/// a system segment of type 11, a busy TSS.
pub const AR_TSS_BUSY: u32 = 0x8b;

impl GuestSegment {
    /// Writes all four fields.
    pub fn write(
        &self,
        io: &mut impl VmcsIo,
        selector: u16,
        base: u64,
        limit: u32,
        access_rights: u32,
    ) -> Result<(), VmcsError> {
        self.selector.write(io, selector)?;
        self.base.write(io, base)?;
        self.limit.write(io, limit)?;
        self.access_rights.write(io, access_rights)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn widths_come_from_the_encoding() {
        // SDM Appendix B: VPID 0x0000 (16-bit), the I/O bitmap A address
        // 0x2000 (64-bit; 0x2001 its high half), the VM-exit reason 0x4402
        // (32-bit), guest CR0 0x6800 (natural width).
        assert_eq!(encoding_width(0x0000), 16);
        assert_eq!(encoding_width(0x2000), 64);
        assert_eq!(encoding_width(0x2001), 32);
        assert_eq!(encoding_width(0x4402), 32);
        assert_eq!(encoding_width(0x6800), 64);
        // Every declared field passed the compile-time check; spot-check
        // a few through their constants.
        assert_eq!(encoding_width(VPID.encoding), 16);
        assert_eq!(encoding_width(EPT_POINTER.encoding), 64);
        assert_eq!(encoding_width(GUEST_CR0.encoding), 64);
    }

    /// An in-memory VMCS that refuses one encoding, to exercise errors.
    #[derive(Default)]
    pub(crate) struct FakeVmcs {
        pub(crate) fields: HashMap<u32, u64>,
        pub(crate) refuse: Option<u32>,
    }

    impl VmcsIo for FakeVmcs {
        fn read_raw(&self, e: u32) -> Option<u64> {
            if Some(e) == self.refuse {
                return None;
            }
            Some(*self.fields.get(&e).unwrap_or(&0))
        }
        fn write_raw(&mut self, e: u32, v: u64) -> bool {
            if Some(e) == self.refuse {
                return false;
            }
            self.fields.insert(e, v);
            true
        }
    }

    #[test]
    fn widths_truncate_and_round_trip() {
        let mut v = FakeVmcs::default();
        GUEST_CS_SELECTOR.write(&mut v, 0x10).unwrap();
        v.fields.insert(GUEST_CS_SELECTOR.encoding, 0x1_0010);
        assert_eq!(GUEST_CS_SELECTOR.read(&v).unwrap(), 0x10u16);
        GUEST_RIP.write(&mut v, 0xffff_ffff_8100_0000).unwrap();
        assert_eq!(GUEST_RIP.read(&v).unwrap(), 0xffff_ffff_8100_0000);
    }

    #[test]
    fn refused_access_is_a_named_error() {
        let mut v = FakeVmcs {
            refuse: Some(EXIT_REASON.encoding),
            ..Default::default()
        };
        let e = EXIT_REASON.read(&v).unwrap_err();
        assert_eq!(e.name, "EXIT_REASON");
        assert!(!e.write);
        v.refuse = Some(GUEST_RIP.encoding);
        let e = GUEST_RIP.write(&mut v, 1).unwrap_err();
        assert!(e.write);
        assert_eq!(format!("{e}"), "VMWRITE of GUEST_RIP (0x681e) failed");
    }

    #[test]
    fn encodings_match_the_sdm() {
        // Spot checks against SDM Appendix B.
        assert_eq!(GUEST_RIP.encoding, 0x681E);
        assert_eq!(HOST_RSP.encoding, 0x6C14);
        assert_eq!(HOST_RIP.encoding, 0x6C16);
        assert_eq!(EXIT_REASON.encoding, 0x4402);
        assert_eq!(GUEST_INTERRUPTIBILITY.encoding, 0x4824);
        assert_eq!(EPT_POINTER.encoding, 0x201A);
        assert_eq!(VMCS_LINK_POINTER.encoding, 0x2800);
        // Every field appears once in the dump list.
        let mut seen = std::collections::HashSet::new();
        for (name, enc) in ALL {
            assert!(seen.insert(*enc), "{name} listed twice");
        }
    }
}
