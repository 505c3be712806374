//! What each hooked fentry site should be, kept apart from the code that
//! writes bytes (the bare-metal glue), and the checks made before every
//! write.
//!
//! A hooked code page executes from a **shadow** copy: the guest's page with
//! our `call` over each hooked site. The guest's own page stays what the
//! guest wrote; reads and writes go there. After a guest write the shadow is
//! rebuilt from the guest's page and our patches are put back on top, and
//! the guest's bytes at each of our sites are recorded: they say whether
//! the guest's own tracer has turned the site into a call, which the entry
//! trampoline then chains into.

use core::fmt;

use crate::addr::Gva;
use trampolines::patch::{classify_site, decode_call_rel32, SiteInsn, NOP5, SITE_LEN};

/// Bytes in a page.
pub const PAGE_SIZE: usize = 4096;

/// Why a site cannot be patched, in the classes the kernel's `ftrace_bug`
/// reports (kernel/trace/ftrace.c): a fault reading the site (`-EFAULT`),
/// bytes other than expected (`-EINVAL`), or a site we may not write
/// (`-EPERM`); plus the two cases our split view adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchError {
    /// The site could not be read or translated ("faulted on reading").
    Fault,
    /// The bytes at the site are neither the NOP5 nor a `call`
    /// ("failed to modify": expected and found bytes).
    Invalid {
        /// What we expected to find.
        expected: [u8; SITE_LEN],
        /// What was there.
        found: [u8; SITE_LEN],
    },
    /// The site may not be patched: it crosses a page boundary, or lies
    /// outside kernel text.
    Perm(&'static str),
    /// A vCPU is executing inside the 5 bytes; try again later.
    Busy,
}

impl fmt::Display for PatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PatchError::Fault => f.write_str("faulted on reading the site"),
            PatchError::Invalid { expected, found } => {
                f.write_str("failed to modify the site: expected")?;
                for b in expected {
                    write!(f, " {b:02x}")?;
                }
                f.write_str(", found")?;
                for b in found {
                    write!(f, " {b:02x}")?;
                }
                Ok(())
            }
            PatchError::Perm(why) => write!(f, "may not patch the site: {why}"),
            PatchError::Busy => f.write_str("a vCPU is executing inside the site"),
        }
    }
}

/// Checks what the guest has at `site` before we hook it: its NOP5, or a
/// `call` of its own (its ftrace is on there). Anything else is refused.
pub fn check_guest_site(site: Gva, bytes: &[u8; SITE_LEN]) -> Result<SiteInsn, PatchError> {
    match classify_site(site, bytes) {
        SiteInsn::Other => Err(PatchError::Invalid {
            expected: NOP5,
            found: *bytes,
        }),
        insn => Ok(insn),
    }
}

/// Whether `[site, site + 5)` lies within one page.
pub fn site_fits_page(site: Gva) -> bool {
    (site.0 as usize % PAGE_SIZE) + SITE_LEN <= PAGE_SIZE
}

/// Whether an instruction pointer is strictly inside the site, where
/// replacing the instruction would tear it.
pub fn rip_inside(site: Gva, rip: u64) -> bool {
    rip > site.0 && rip < site.0 + SITE_LEN as u64
}

/// Writes `new` over the site at `offset` of `page`, but only if the bytes
/// there are `expected` (the site table's belief).
pub fn write_checked(
    page: &mut [u8; PAGE_SIZE],
    offset: usize,
    expected: &[u8; SITE_LEN],
    new: &[u8; SITE_LEN],
) -> Result<(), PatchError> {
    let slot = page
        .get_mut(offset..offset + SITE_LEN)
        .ok_or(PatchError::Perm("crosses a page boundary"))?;
    if slot != expected {
        let mut found = [0; SITE_LEN];
        found.copy_from_slice(slot);
        return Err(PatchError::Invalid {
            expected: *expected,
            found,
        });
    }
    slot.copy_from_slice(new);
    Ok(())
}

/// One of our patches on a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patch {
    /// Offset of the site in its page.
    pub offset: u16,
    /// The site's guest-virtual address.
    pub site: Gva,
    /// Our bytes (`call` to the entry trampoline).
    pub ours: [u8; SITE_LEN],
    /// The guest's bytes at the site, as of the last sync.
    pub guest: [u8; SITE_LEN],
    /// Our bytes are in the page's partial quiet shadow too (the site
    /// matters outside a graph session's roots, on a page with sites that
    /// do not).
    pub in_quiet: bool,
}

impl Patch {
    /// Where the entry trampoline continues for this site: the guest's own
    /// `call` target, or 0 (the guest has its NOP5, or an instruction in
    /// the middle of being rewritten, which is not ours to run).
    pub fn chain_target(&self) -> u64 {
        decode_call_rel32(self.site, &self.guest).map_or(0, |t| t.0)
    }
}

/// Brings `shadow` up to the guest's `original` page under our
/// `patches`, recording the guest's bytes at each site. Returns how many
/// sites the guest had changed since the last sync.
///
/// Other vCPUs may be executing the shadow meanwhile, so only the bytes
/// that differ outside our sites are written, one by one: that replays the
/// guest's own write (whose cross-modifying protocol, int3 first, holds
/// for the shadow as for its page), and our `call`s are never touched, so
/// no vCPU can fetch one half rewritten.
pub fn resync(
    shadow: &mut [u8; PAGE_SIZE],
    original: &[u8; PAGE_SIZE],
    patches: &mut [Patch],
) -> usize {
    resync_where(shadow, original, patches, |_| true)
}

/// [`resync`] for a shadow that holds only the patches for which `here`
/// holds (a quiet view's partial shadow): the other sites are the guest's
/// bytes there, and are synced as such.
pub fn resync_where(
    shadow: &mut [u8; PAGE_SIZE],
    original: &[u8; PAGE_SIZE],
    patches: &mut [Patch],
    here: impl Fn(&Patch) -> bool,
) -> usize {
    let mut ours = [0u64; PAGE_SIZE / 64];
    let mut changed = 0;
    for p in patches.iter_mut() {
        let o = p.offset as usize;
        let Some(guest) = original.get(o..o + SITE_LEN) else {
            continue;
        };
        if guest != p.guest {
            changed += 1;
            p.guest.copy_from_slice(guest);
        }
        if !here(p) {
            continue;
        }
        for i in o..o + SITE_LEN {
            if let Some(w) = ours.get_mut(i / 64) {
                *w |= 1 << (i % 64);
            }
        }
        // Our bytes are there already (written when the site was hooked);
        // a slot that somehow is not gets them back.
        if let Some(slot) = shadow.get_mut(o..o + SITE_LEN) {
            if slot != p.ours {
                slot.copy_from_slice(&p.ours);
            }
        }
    }
    // 64 bytes at a time: a block without our bytes that equals the
    // guest's is one comparison (the common case: a step that read the
    // page, which every step's close now resyncs), and only a block that
    // differs is walked byte by byte.
    for ((s, g), &mask) in shadow
        .chunks_exact_mut(64)
        .zip(original.chunks_exact(64))
        .zip(ours.iter())
    {
        if mask == 0 && same_block(s, g) {
            continue;
        }
        for (i, (s, &g)) in s.iter_mut().zip(g.iter()).enumerate() {
            if mask & (1 << i) == 0 && *s != g {
                *s = g;
            }
        }
    }
    changed
}

/// Whether two 64-byte blocks hold the same bytes, a word at a time with
/// no call (a page's resync compares 64 of them at each step's end).
#[inline]
fn same_block(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && a.chunks_exact(8).zip(b.chunks_exact(8)).all(|(x, y)| {
            let mut wx = [0u8; 8];
            let mut wy = [0u8; 8];
            wx.copy_from_slice(x);
            wy.copy_from_slice(y);
            u64::from_ne_bytes(wx) == u64::from_ne_bytes(wy)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use trampolines::patch::call_rel32;

    const BASE: u64 = 0xffff_ffff_8120_0000;

    fn page_with_sites(offsets: &[usize]) -> [u8; PAGE_SIZE] {
        let mut p = [0xcc; PAGE_SIZE];
        for &o in offsets {
            p[o..o + 5].copy_from_slice(&NOP5);
        }
        p
    }

    #[test]
    fn only_nop5_or_a_call_is_accepted() {
        let site = Gva(BASE + 0x44);
        assert_eq!(check_guest_site(site, &NOP5), Ok(SiteInsn::Nop5));
        let call = call_rel32(site, Gva(BASE + 0x9000)).unwrap();
        assert_eq!(
            check_guest_site(site, &call),
            Ok(SiteInsn::Call(Gva(BASE + 0x9000)))
        );
        // text_poke_bp's transient int3 over the first byte.
        let mid = [0xcc, 0x1f, 0x44, 0x00, 0x00];
        let e = check_guest_site(site, &mid).unwrap_err();
        assert_eq!(
            e,
            PatchError::Invalid {
                expected: NOP5,
                found: mid
            }
        );
        assert_eq!(
            e.to_string(),
            "failed to modify the site: expected 0f 1f 44 00 00, found cc 1f 44 00 00"
        );
    }

    #[test]
    fn writes_check_the_bytes_first() {
        let mut page = page_with_sites(&[0x10]);
        let ours = call_rel32(Gva(BASE + 0x10), Gva(BASE - 0x1000)).unwrap();
        write_checked(&mut page, 0x10, &NOP5, &ours).unwrap();
        assert_eq!(&page[0x10..0x15], &ours);
        // The same write again: the bytes are no longer the NOP5.
        assert!(matches!(
            write_checked(&mut page, 0x10, &NOP5, &ours),
            Err(PatchError::Invalid { found, .. }) if found == ours
        ));
        // Nothing outside the site changed.
        assert!(page[..0x10].iter().chain(&page[0x15..]).all(|&b| b == 0xcc));
        assert!(write_checked(&mut page, PAGE_SIZE - 2, &NOP5, &ours).is_err());
    }

    #[test]
    fn site_geometry() {
        assert!(site_fits_page(Gva(BASE + 0xffb)));
        assert!(!site_fits_page(Gva(BASE + 0xffc)));
        assert!(!rip_inside(Gva(BASE), BASE));
        assert!(rip_inside(Gva(BASE), BASE + 1));
        assert!(rip_inside(Gva(BASE), BASE + 4));
        assert!(!rip_inside(Gva(BASE), BASE + 5));
    }

    /// Our patches at `offsets` of the page at `BASE`, over the NOP5.
    fn patches_at(offsets: &[usize]) -> alloc::vec::Vec<Patch> {
        let entry = Gva(BASE - 0x20_0000);
        offsets
            .iter()
            .map(|&o| {
                let site = Gva(BASE + o as u64);
                Patch {
                    offset: o as u16,
                    site,
                    ours: call_rel32(site, entry).unwrap(),
                    guest: NOP5,
                    in_quiet: false,
                }
            })
            .collect()
    }

    #[test]
    fn resync_keeps_our_patches_and_records_the_guests_bytes() {
        let offsets = [0x4, 0x804];
        let original = page_with_sites(&offsets);
        let mut patches = patches_at(&offsets);
        let mut shadow = [0; PAGE_SIZE];
        assert_eq!(resync(&mut shadow, &original, &mut patches), 0);
        for p in &patches {
            let o = p.offset as usize;
            assert_eq!(shadow[o..o + 5], p.ours);
            assert_eq!(p.chain_target(), 0);
        }
        // The guest's ftrace turns the second site into a call of its own
        // and writes elsewhere on the page.
        let mut changed = original;
        let theirs = call_rel32(Gva(BASE + 0x804), Gva(BASE + 0x10_0000)).unwrap();
        changed[0x804..0x809].copy_from_slice(&theirs);
        changed[0x900] = 0x90;
        assert_eq!(resync(&mut shadow, &changed, &mut patches), 1);
        assert_eq!(shadow[0x900], 0x90);
        assert_eq!(shadow[0x804..0x809], patches[1].ours);
        assert_eq!(patches[1].guest, theirs);
        assert_eq!(patches[1].chain_target(), BASE + 0x10_0000);
        assert_eq!(patches[0].chain_target(), 0);
        // Everything but our sites equals the guest's page.
        for (i, (&s, &g)) in shadow.iter().zip(changed.iter()).enumerate() {
            let ours = offsets.iter().any(|&o| (o..o + 5).contains(&i));
            assert!(ours || s == g, "byte {i:#x}");
        }
    }

    /// The byte-by-byte rule the block-wise resync must equal: every byte
    /// outside our patches becomes the guest's, our patches stay.
    fn naive(shadow: &mut [u8; PAGE_SIZE], original: &[u8; PAGE_SIZE], patches: &[Patch]) {
        for (i, (s, &g)) in shadow.iter_mut().zip(original.iter()).enumerate() {
            let mine = patches
                .iter()
                .any(|p| (p.offset as usize..p.offset as usize + SITE_LEN).contains(&i));
            if !mine {
                *s = g;
            }
        }
    }

    #[test]
    fn blocks_differ_at_any_byte() {
        let a = [0x5au8; 64];
        assert!(same_block(&a, &a));
        for i in 0..64 {
            let mut b = a;
            b[i] ^= 0x80;
            assert!(!same_block(&a, &b), "byte {i}");
        }
        assert!(!same_block(&a, &a[..63]));
    }

    #[test]
    fn resync_block_by_block_equals_byte_by_byte() {
        let offsets = [0x3c, 0x40, 0x7fd, 0xffb];
        let original = page_with_sites(&offsets);
        let patches = patches_at(&offsets);
        let mut shadow = [0; PAGE_SIZE];
        let mut ps = patches.clone();
        resync(&mut shadow, &original, &mut ps);
        // Guest writes at block edges, beside our sites, inside blocks
        // with and without sites, one at a time and all at once.
        let spots = [
            0,
            1,
            0x3b,
            0x3f,
            0x41 + 4,
            0x45,
            0x80,
            0x7fc,
            0x802,
            0xfff,
            0xffa,
        ];
        let mut all = original;
        for &at in &spots {
            let mut changed = original;
            changed[at] ^= 0x5a;
            all[at] ^= 0x5a;
            for page in [changed, all] {
                let mut fast = shadow;
                let mut want = shadow;
                let mut ps = patches.clone();
                resync(&mut fast, &page, &mut ps);
                naive(&mut want, &page, &patches);
                assert_eq!(fast, want, "a write at {at:#x}");
            }
        }
    }
}
