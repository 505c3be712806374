//! The split view's shared half: hooked sites and the pages that hold
//! them. A hooked code page executes from a shadow frame, the guest's page
//! with our `call` over each hooked site, mapped execute-only; the guest's
//! reads and writes of the page fault in EPT and are stepped against its
//! own frame ([`super::step`], per vCPU). Shared by every vCPU.

use super::machine::{Env, KernelView, View, PAGE};
use super::region::Region;
use super::site::{self, Patch, PatchError};
use super::users::Users;
use crate::addr::Gva;
use crate::addr::{Gpa, Hpa};
use crate::ept;
use crate::guest_phys::GuestDoor;
use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use guest_introspect::fallible::{self, btree_entry_bytes, OutOfMemory};
use guest_introspect::paging;
use trampolines::patch::SITE_LEN;

/// Sites hooked at most (Debian's kernel has about 38,000 traceable
/// functions). With a heap check before each new one, this bounds the
/// site and page maps, which cannot reserve.
pub(super) const MAX_SITES: usize = 1 << 16;
/// Frames kept free for everything else when shadows are allocated.
const FRAME_RESERVE: u64 = 1 << 20;
/// Frames kept free beyond that for hooks when partial quiet shadows are
/// allocated.
const QUIET_RESERVE: u64 = 4 << 20;
/// Heap one more hooked site may take: its `sites` entry, a `pages` entry
/// and a patch.
pub(super) const SITE_BYTES: usize = btree_entry_bytes::<u64, SiteUse>()
    + btree_entry_bytes::<u64, Hooked>()
    + core::mem::size_of::<Patch>();
/// Sites released per pass when unhooking (a fixed buffer on root's stack:
/// a release never allocates).
const RELEASE_BATCH: usize = 256;

/// Why a hook or an unhook could not be made.
pub(super) const STALLED: &str = "the other vCPUs did not come to root in time";

/// Why a probe could not be put on its site.
pub(super) enum AttachError {
    /// The site could not be hooked.
    Hook(PatchError),
    /// The site's list of users could not grow.
    Memory(OutOfMemory),
}

/// A hooked site: where it is, and who uses it.
pub(super) struct SiteUse {
    pub(super) page: Gpa,
    pub(super) func: Gva,
    pub(super) users: Users,
}

impl SiteUse {
    /// Whether the site matters only beneath a root of the sessions in
    /// `rooted` (see [`Users::quiet_ok`]).
    pub(super) fn quiet_ok(
        &self,
        rooted: u16,
        is_root: impl Fn(u16, Gva) -> bool,
        gate_of: impl Fn(u32) -> u16,
        count_gate: u16,
    ) -> bool {
        self.users
            .quiet_ok(rooted, self.func, is_root, gate_of, count_gate)
    }
}

/// A hooked code page: its shadow frame and our patches on it.
pub(super) struct Hooked {
    pub(super) shadow: Hpa,
    pub(super) patches: Vec<Patch>,
    /// What the quiet views map the page to.
    pub(super) quiet: QuietMap,
}

/// What the quiet views map a hooked page to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QuietMap {
    /// The shadow, as the armed views: every site on the page matters
    /// everywhere (or nothing is quiet).
    Shadow,
    /// The guest's own frame: every site on the page matters only beneath
    /// a session's roots or for its tasks.
    Guest,
    /// A partial shadow of its own, with our patches only at the sites
    /// that matter everywhere (`Patch::in_quiet`).
    Partial(Hpa),
}

impl Hooked {
    /// What view `view` maps the page `page` to while no step has it open.
    pub(super) fn mapping(&self, view: View, page: Gpa) -> Hpa {
        match (view, self.quiet) {
            (View::Armed, _) | (View::Quiet, QuietMap::Shadow) => self.shadow,
            (View::Quiet, QuietMap::Guest) => page.identity_hpa(),
            (View::Quiet, QuietMap::Partial(q)) => q,
        }
    }
}

/// The hooked sites and pages.
#[derive(Default)]
pub(super) struct SplitView {
    /// Sites by guest-virtual address.
    pub(super) sites: BTreeMap<Gva, SiteUse>,
    /// Hooked pages by guest-physical address.
    pub(super) pages: BTreeMap<Gpa, Hooked>,
    free_shadows: Vec<Hpa>,
    /// The page a guest access to hypervisor memory is stepped against.
    pub(super) scratch: Option<Hpa>,
}

/// Points the EPT entry of guest page `page` at `hpa` with `perms`. A
/// failure (EPT tables exhausted) leaves the old entry, which is safe: the
/// page keeps its previous view.
pub(super) fn remap(env: &mut Env<'_>, page: Gpa, hpa: Hpa, perms: u64) {
    if let Err(e) = env.m.ept_map(page, hpa, perms) {
        log::warn!("tracer: EPT entry of {page:#x} not changed: {e:?}");
    }
}

/// [`remap`] in every vCPU's quiet view only; whether it was changed.
pub(super) fn remap_quiet(env: &mut Env<'_>, page: Gpa, hpa: Hpa, perms: u64) -> bool {
    match env.m.ept_map_quiet(page, hpa, perms) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("tracer: quiet EPT entry of {page:#x} not changed: {e:?}");
            false
        }
    }
}

/// [`remap`] in the view this vCPU runs on only (a step opens its pages).
pub(super) fn remap_mine(env: &mut Env<'_>, page: Gpa, hpa: Hpa, perms: u64) {
    if let Err(e) = env.m.ept_map_mine(page, hpa, perms) {
        log::warn!("tracer: EPT entry of {page:#x} not changed: {e:?}");
    }
}

/// [`remap`] in this vCPU's view `view` only (a step closes its pages in
/// both of its vCPU's views: the vCPU may have changed view since it
/// opened them, when a step was ended by force).
pub(super) fn remap_own(env: &mut Env<'_>, view: View, page: Gpa, hpa: Hpa, perms: u64) {
    if let Err(e) = env.m.ept_map_own(view, page, hpa, perms) {
        log::warn!("tracer: EPT entry of {page:#x} not changed: {e:?}");
    }
}

/// The guest's own bytes of page `gpa`.
pub(super) fn page_bytes(ram: &dyn GuestDoor, page: Gpa) -> Option<[u8; PAGE]> {
    let mut b = [0u8; PAGE];
    ram.read(page.0, &mut b).ok().map(|()| b)
}

/// Whether `gpa` is root's memory: the hypervisor's, or the AP start-up
/// page (neither is in the guest's e820, and EPT maps neither).
pub(super) fn in_hypervisor(gpa: u64) -> bool {
    use loader::layout::{AP_TRAMPOLINE, HV_RESERVED, HV_RESERVED_END, PAGE_SIZE};
    (HV_RESERVED.0..HV_RESERVED_END.0).contains(&gpa)
        || (AP_TRAMPOLINE.0..AP_TRAMPOLINE.0 + PAGE_SIZE).contains(&gpa)
}

impl SplitView {
    /// A frame for a partial quiet shadow, only while the pool has
    /// [`QUIET_RESERVE`] to spare: it saves exits, and hooks come first.
    pub(super) fn alloc_quiet_shadow(&mut self, env: &mut Env<'_>) -> Option<Hpa> {
        if env.m.frames_free() < FRAME_RESERVE + QUIET_RESERVE {
            return None;
        }
        self.alloc_shadow(env).ok()
    }

    /// Gives a frame back for another shadow.
    pub(super) fn free_shadow(&mut self, frame: Hpa) {
        self.free_shadows.push(frame);
    }

    fn alloc_shadow(&mut self, env: &mut Env<'_>) -> Result<Hpa, PatchError> {
        if let Some(f) = self.free_shadows.pop() {
            return Ok(f);
        }
        let left = env.m.frames_free();
        if left < FRAME_RESERVE {
            return Err(PatchError::Perm(
                "hypervisor memory for shadow pages is exhausted",
            ));
        }
        env.m.alloc_frame().ok_or(PatchError::Perm(
            "hypervisor memory for shadow pages is exhausted",
        ))
    }

    /// Hooks the fentry site `site` of function `func` (no-op if hooked).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hook(
        &mut self,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        region: Option<&Region>,
        site: Gva,
        func: Gva,
    ) -> Result<(), PatchError> {
        if self.sites.contains_key(&site) {
            return Ok(());
        }
        // The maps cannot reserve: bound them, and check the heap before
        // anything changes.
        if self.sites.len() >= MAX_SITES {
            return Err(PatchError::Perm("the table of hooked sites is full"));
        }
        if env.m.heap_check(SITE_BYTES).is_err() {
            return Err(PatchError::Perm(
                "out of hypervisor memory for the table of hooked sites",
            ));
        }
        let Some(region) = region else {
            return Err(PatchError::Perm("no trampoline region"));
        };
        if !site::site_fits_page(site) {
            return Err(PatchError::Perm("the site crosses a page boundary"));
        }
        if !env.m.stop_others() {
            return Err(PatchError::Perm(STALLED));
        }
        if env.m.rips().iter().any(|&rip| site::rip_inside(site, rip)) {
            return Err(PatchError::Busy);
        }
        let t = paging::translate(env.ram, k.cr3(), site).map_err(|_| PatchError::Fault)?;
        let gpa = t.gpa.0;
        if in_hypervisor(gpa) {
            return Err(PatchError::Perm("the site is not in guest memory"));
        }
        let page = Gpa(gpa).align_down(PAGE as u64);
        let offset = (gpa - page.0) as usize;
        let mut guest = [0u8; SITE_LEN];
        if env.ram.read(gpa, &mut guest).is_err() {
            return Err(PatchError::Fault);
        }
        site::check_guest_site(site, &guest)?;
        let ours = region
            .tramp
            .site_patch(site)
            .map_err(|_| PatchError::Perm("the trampolines are out of reach of a call"))?;
        let new_page = !self.pages.contains_key(&page);
        if new_page {
            let shadow = self.alloc_shadow(env)?;
            let Some(orig) = page_bytes(env.ram, page) else {
                self.free_shadows.push(shadow);
                return Err(PatchError::Fault);
            };
            env.m.frame(shadow).copy_from_slice(&orig);
            self.pages.insert(
                page,
                Hooked {
                    shadow,
                    patches: Vec::new(),
                    quiet: QuietMap::Shadow,
                },
            );
        }
        let Some(h) = self.pages.get_mut(&page) else {
            return Err(PatchError::Fault);
        };
        if fallible::try_grow(&mut h.patches, 1).is_err() {
            if new_page {
                if let Some(h) = self.pages.remove(&page) {
                    self.free_shadows.push(h.shadow);
                }
            }
            return Err(PatchError::Perm(
                "out of hypervisor memory for the page's patches",
            ));
        }
        // The shadow holds the guest's bytes here (copied, or re-synced on
        // the guest's last write): check them, then write ours.
        let shadow = env.m.frame(h.shadow);
        site::write_checked(shadow, offset, &guest, &ours)?;
        h.patches.push(Patch {
            offset: offset as u16,
            site,
            ours,
            guest,
            // Not in a partial quiet shadow until the views are settled.
            in_quiet: false,
        });
        if new_page {
            if let Err(e) = env.m.ept_map(page, h.shadow, ept::EXEC) {
                log::warn!("tracer: EPT map of {page:#x} failed: {e:?}");
                // Nothing maps the shadow: give it back with the page.
                if let Some(h) = self.pages.remove(&page) {
                    self.free_shadows.push(h.shadow);
                }
                return Err(PatchError::Perm("EPT tables exhausted"));
            }
        }
        // The caller flushes EPT once for the whole request.
        self.sites.insert(
            site,
            SiteUse {
                page,
                func,
                users: Users::default(),
            },
        );
        Ok(())
    }

    /// Removes our patch from `site` if nothing uses it any more.
    pub(super) fn unhook_if_unused(&mut self, env: &mut Env<'_>, site: Gva) {
        let Some(u) = self.sites.get(&site) else {
            return;
        };
        if !u.users.is_empty() {
            return;
        }
        if !env.m.stop_others() {
            // Left hooked with no users (a hit records nothing); the next
            // release tries again.
            log::warn!("tracer: {site:#x} not unhooked: {STALLED}");
            return;
        }
        self.unhook(env, site);
    }

    /// Removes our patch from `site` whatever uses it: the caller has
    /// taken its users off and held the other vCPUs, or must go on without
    /// them (a module's text about to be freed, see
    /// [`Machine::must_stop_others`](super::machine::Machine::must_stop_others)).
    pub(super) fn unhook(&mut self, env: &mut Env<'_>, site: Gva) {
        let Some(page) = self.sites.remove(&site).map(|u| u.page) else {
            return;
        };
        let Some(h) = self.pages.get_mut(&page) else {
            return;
        };
        if let Some(i) = h.patches.iter().position(|p| p.site == site) {
            let p = h.patches.swap_remove(i);
            let shadow = env.m.frame(h.shadow);
            if let Err(e) = site::write_checked(shadow, p.offset as usize, &p.ours, &p.guest) {
                log::warn!("tracer: unpatching {site:#x}: {e}");
            }
            if let (QuietMap::Partial(q), true) = (h.quiet, p.in_quiet) {
                let quiet = env.m.frame(q);
                if let Err(e) = site::write_checked(quiet, p.offset as usize, &p.ours, &p.guest) {
                    log::warn!("tracer: unpatching {site:#x} in its quiet shadow: {e}");
                }
            }
        }
        if h.patches.is_empty() {
            let (shadow, quiet) = (h.shadow, h.quiet);
            self.pages.remove(&page);
            remap(env, page, page.identity_hpa(), ept::RWX);
            self.free_shadows.push(shadow);
            if let QuietMap::Partial(q) = quiet {
                self.free_shadows.push(q);
            }
        }
        // The caller flushes EPT once for the whole request.
    }

    /// Puts our `call` at `site` into the quiet views too, at once: a
    /// user that must matter everywhere (root's own hooks) joined a page
    /// the quiet views leave to the guest or to a partial shadow. Made
    /// with the other vCPUs held, in the same call as the hook, so that no
    /// vCPU on its quiet view runs the guest's NOP there until the views
    /// settle. False when the quiet views could not be changed (the
    /// settling after the request tries again).
    pub(super) fn make_loud(&mut self, env: &mut Env<'_>, site: Gva) -> bool {
        let Some(page) = self.sites.get(&site).map(|u| u.page) else {
            return false;
        };
        let Some(h) = self.pages.get_mut(&page) else {
            return false;
        };
        let partial = match h.quiet {
            QuietMap::Shadow => return true,
            QuietMap::Guest => None,
            QuietMap::Partial(q) => {
                let Some(p) = h.patches.iter_mut().find(|p| p.site == site) else {
                    return false;
                };
                if p.in_quiet {
                    return true;
                }
                if !env.m.stop_others() {
                    return false;
                }
                // The partial shadow holds the guest's bytes at the site.
                let quiet = env.m.frame(q);
                if site::write_checked(quiet, usize::from(p.offset), &p.guest, &p.ours).is_ok() {
                    p.in_quiet = true;
                    return true;
                }
                Some(q)
            }
        };
        // The page left to the guest, or a partial shadow without the
        // bytes expected: the whole shadow is right.
        if !remap_quiet(env, page, h.shadow, ept::EXEC) {
            return false;
        }
        h.quiet = QuietMap::Shadow;
        for p in h.patches.iter_mut() {
            p.in_quiet = false;
        }
        if let Some(q) = partial {
            self.free_shadows.push(q);
        }
        true
    }

    /// Takes one user off every site (`release` does it, through
    /// [`Users::leave`], and says whether the site had that user) and
    /// unhooks the sites nothing else uses.
    /// A release never allocates: the sites to unhook are taken a fixed
    /// batch at a time.
    pub(super) fn release(
        &mut self,
        env: &mut Env<'_>,
        mut release: impl FnMut(&mut Users) -> bool,
    ) {
        let mut any = false;
        for u in self.sites.values_mut() {
            any |= release(&mut u.users);
        }
        if any {
            self.unhook_unused(env);
        }
        env.m.invept();
    }

    /// Unhooks every site nothing uses any more.
    fn unhook_unused(&mut self, env: &mut Env<'_>) {
        let mut from = Gva(0);
        loop {
            let mut batch = [Gva(0); RELEASE_BATCH];
            let mut n = 0;
            let mut next = None;
            for (&s, u) in self.sites.range(from..) {
                let Some(slot) = batch.get_mut(n) else {
                    // The batch is full: the next one starts here.
                    next = Some(s);
                    break;
                };
                if u.users.is_empty() {
                    *slot = s;
                    n += 1;
                }
            }
            for &s in batch.iter().take(n) {
                self.unhook_if_unused(env, s);
            }
            if next.is_some() {
                // Let the other vCPUs run between batches (the next
                // unhook holds them again).
                env.m.invept();
                env.m.let_others_go();
            }
            match next {
                Some(s) => from = s,
                None => return,
            }
        }
    }
}
