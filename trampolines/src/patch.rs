//! The bytes at an fentry site: the NOP5 the kernel leaves there, the
//! `call rel32` we (or the guest's own ftrace) put there, and the ENDBR64
//! that precedes the site in kernels built with IBT.
//!
//! Linux sources: the NOP is `x86_nops[5]` (arch/x86/include/asm/nops.h,
//! `BYTES_NOP5`); the call is built by `text_gen_insn`
//! (arch/x86/include/asm/text-patching.h); `ENDBR64` and the sealing NOP
//! that `apply_seal_endbr` writes over unused ENDBRs are in
//! arch/x86/include/asm/ibt.h and arch/x86/kernel/alternative.c.

use core::fmt;

use crate::Gva;

/// The 5-byte NOP (`nopl 0x0(%rax,%rax,1)`) that `ftrace_init` writes over
/// each `call __fentry__`.
pub const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// Opcode of `call rel32`.
pub const CALL_REL32_OPCODE: u8 = 0xe8;

/// Length of a patched site: the NOP5 and `call rel32` are both 5 bytes.
pub const SITE_LEN: usize = 5;

/// `endbr64`.
pub const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// What an unused ENDBR64 becomes once sealed at boot (`nopw (%rax)`).
pub const SEALED_ENDBR: [u8; 4] = [0x66, 0x0f, 0x1f, 0x00];

/// How a function's first bytes begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryMarker {
    /// `endbr64`: the fentry site is 4 bytes in.
    Endbr64,
    /// A sealed ENDBR (`66 0f 1f 00`): the fentry site is 4 bytes in.
    SealedEndbr,
    /// Neither: the fentry site, if any, is the first byte.
    None,
}

impl EntryMarker {
    /// Bytes before the fentry site.
    pub const fn len(self) -> usize {
        match self {
            EntryMarker::Endbr64 | EntryMarker::SealedEndbr => 4,
            EntryMarker::None => 0,
        }
    }

    /// Whether there is no marker.
    pub const fn is_empty(self) -> bool {
        matches!(self, EntryMarker::None)
    }
}

/// Recognises an ENDBR64 or a sealed ENDBR at the start of `bytes` (a
/// function's first bytes; fewer than 4 gives [`EntryMarker::None`]).
pub fn entry_marker(bytes: &[u8]) -> EntryMarker {
    match bytes.get(..4) {
        Some(b) if b == ENDBR64 => EntryMarker::Endbr64,
        Some(b) if b == SEALED_ENDBR => EntryMarker::SealedEndbr,
        _ => EntryMarker::None,
    }
}

/// Where a function's fentry site is, from its address and first bytes:
/// after an ENDBR64 (sealed or not), otherwise at the function itself.
pub fn fentry_site(func: Gva, first_bytes: &[u8]) -> Gva {
    Gva(func.0.wrapping_add(entry_marker(first_bytes).len() as u64))
}

/// A `call rel32` cannot reach its target from the site: the displacement
/// from site + 5 does not fit in a signed 32-bit value (±2 GiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfRange {
    /// The site the call would be written at.
    pub site: Gva,
    /// The target it had to reach.
    pub target: Gva,
}

impl fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "call rel32 at {:#x} cannot reach {:#x} (more than 2 GiB away)",
            self.site.0, self.target.0
        )
    }
}

/// The rel32 for a `call` at `site` reaching `target`, computed exactly
/// (no wrap-around of the 64-bit address space is accepted).
fn rel32(site: Gva, target: Gva) -> Option<i32> {
    let next = site.0 as i128 + SITE_LEN as i128;
    i32::try_from(target.0 as i128 - next).ok()
}

/// Whether a `call rel32` at `site` can reach `target`.
pub fn call_reaches(site: Gva, target: Gva) -> bool {
    rel32(site, target).is_some()
}

/// Encodes `call target` for the 5 bytes at `site`.
pub fn call_rel32(site: Gva, target: Gva) -> Result<[u8; 5], OutOfRange> {
    let rel = rel32(site, target).ok_or(OutOfRange { site, target })?;
    let r = rel.to_le_bytes();
    Ok([CALL_REL32_OPCODE, r[0], r[1], r[2], r[3]])
}

/// The target of a `call rel32` at `site`, or `None` if `bytes` (at least
/// 5) do not start with one. The address arithmetic wraps as the CPU's
/// does.
pub fn decode_call_rel32(site: Gva, bytes: &[u8]) -> Option<Gva> {
    match bytes.get(..SITE_LEN)? {
        [CALL_REL32_OPCODE, r0, r1, r2, r3] => {
            let rel = i32::from_le_bytes([*r0, *r1, *r2, *r3]) as i64;
            Some(Gva(site
                .0
                .wrapping_add(SITE_LEN as u64)
                .wrapping_add(rel as u64)))
        }
        _ => None,
    }
}

/// What the 5 bytes at an fentry site are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SiteInsn {
    /// The NOP5: function tracing is off at this site.
    Nop5,
    /// `call target` (ftrace on, `__fentry__` at boot, or our trampoline).
    Call(Gva),
    /// Anything else (an int3 in the middle of `text_poke_bp`, or not a site).
    Other,
}

/// Classifies the bytes at `site` (fewer than 5 gives [`SiteInsn::Other`]).
pub fn classify_site(site: Gva, bytes: &[u8]) -> SiteInsn {
    match bytes.get(..SITE_LEN) {
        Some(b) if b == NOP5 => SiteInsn::Nop5,
        _ => decode_call_rel32(site, bytes).map_or(SiteInsn::Other, SiteInsn::Call),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: u64 = 0xffff_ffff_8100_0000;
    /// Low enough in the upper half that +-2 GiB does not wrap.
    const LOW: u64 = 0xffff_fff0_0000_0000;

    #[test]
    fn call_round_trips() {
        let cases = [
            (TEXT, TEXT + 0x1000),
            (TEXT + 0x1000, TEXT),
            (TEXT, TEXT + 5),             // rel32 = 0
            (TEXT + 0x40, TEXT + 0x40),   // calling itself: rel32 = -5
            (LOW, LOW + 5 + 0x7fff_ffff), // the farthest forward
            (LOW, LOW + 5 - 0x8000_0000), // the farthest back
            (0x1000, 0x2000),
        ];
        for (site, target) in cases {
            let b = call_rel32(Gva(site), Gva(target)).unwrap();
            assert_eq!(b[0], 0xe8);
            assert_eq!(decode_call_rel32(Gva(site), &b), Some(Gva(target)));
            assert_eq!(classify_site(Gva(site), &b), SiteInsn::Call(Gva(target)));
            assert!(call_reaches(Gva(site), Gva(target)));
        }
    }

    #[test]
    fn known_encoding() {
        // e8 fb 0f 00 00: 0x1000 - 5 forward.
        assert_eq!(
            call_rel32(Gva(TEXT), Gva(TEXT + 0x1000)).unwrap(),
            [0xe8, 0xfb, 0x0f, 0x00, 0x00]
        );
        // Backwards by 0x10 from site + 5.
        assert_eq!(
            call_rel32(Gva(TEXT + 0x10), Gva(TEXT + 5)).unwrap(),
            [0xe8, 0xf0, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn range_errors() {
        let far = [
            (LOW, LOW + 5 + 0x8000_0000),         // one past the farthest forward
            (LOW, LOW + 5 - 0x8000_0001),         // one past the farthest back
            (TEXT, 0x1000),                       // user space from kernel text
            (0x1000, TEXT),                       // and back
            (u64::MAX - 2, 0x10),                 // would only reach by wrapping
            (0xffff_ffff_c000_0000, 0x2000_0000), // module space to low memory
        ];
        for (site, target) in far {
            let err = call_rel32(Gva(site), Gva(target)).unwrap_err();
            assert_eq!(
                err,
                OutOfRange {
                    site: Gva(site),
                    target: Gva(target)
                }
            );
            assert!(!call_reaches(Gva(site), Gva(target)));
        }
        // Module space (-1 GiB .. ) reaches kernel text (-2 GiB ..).
        assert!(call_reaches(Gva(0xffff_ffff_c000_0000), Gva(TEXT)));
    }

    #[test]
    fn decode_rejects_non_calls() {
        assert_eq!(decode_call_rel32(Gva(TEXT), &NOP5), None);
        assert_eq!(decode_call_rel32(Gva(TEXT), &[0xe8, 0, 0, 0]), None);
        assert_eq!(decode_call_rel32(Gva(TEXT), &[0xe9, 0, 0, 0, 0]), None);
        // Extra bytes after the 5 are ignored.
        assert_eq!(
            decode_call_rel32(Gva(TEXT), &[0xe8, 0, 0, 0, 0, 0xcc]),
            Some(Gva(TEXT + 5))
        );
    }

    #[test]
    fn classify() {
        assert_eq!(classify_site(Gva(TEXT), &NOP5), SiteInsn::Nop5);
        assert_eq!(
            classify_site(Gva(TEXT), &[0xcc, 0x1f, 0x44, 0, 0]),
            SiteInsn::Other
        );
        assert_eq!(classify_site(Gva(TEXT), &NOP5[..4]), SiteInsn::Other);
        // A 5-byte NOP of another form is not the ftrace NOP.
        assert_eq!(
            classify_site(Gva(TEXT), &[0x66, 0x0f, 0x1f, 0x40, 0x00]),
            SiteInsn::Other
        );
    }

    #[test]
    fn endbr_recognition() {
        let f = Gva(TEXT + 0x100);
        let mut with_endbr = [0u8; 9];
        with_endbr[..4].copy_from_slice(&ENDBR64);
        with_endbr[4..].copy_from_slice(&NOP5);
        assert_eq!(entry_marker(&with_endbr), EntryMarker::Endbr64);
        assert_eq!(fentry_site(f, &with_endbr), Gva(f.0 + 4));

        let mut sealed = with_endbr;
        sealed[..4].copy_from_slice(&SEALED_ENDBR);
        assert_eq!(entry_marker(&sealed), EntryMarker::SealedEndbr);
        assert_eq!(fentry_site(f, &sealed), Gva(f.0 + 4));

        assert_eq!(entry_marker(&NOP5), EntryMarker::None);
        assert_eq!(fentry_site(f, &NOP5), f);
        assert_eq!(entry_marker(&ENDBR64[..3]), EntryMarker::None);
        assert!(EntryMarker::None.is_empty());
        assert!(!EntryMarker::Endbr64.is_empty());
        // An ENDBR32 is not an ENDBR64.
        assert_eq!(entry_marker(&[0xf3, 0x0f, 0x1e, 0xfb]), EntryMarker::None);
    }
}
