//! Sessions that cost only what they trace: each vCPU's quiet EPT view.
//!
//! A function-graph session with roots records a call of its trace set
//! only beneath one of its roots, yet every call of a hooked function
//! exits wherever it runs. So each vCPU has two views (`View`): the
//! armed one hooks everything, and the quiet one maps to the guest's own
//! frame (execute-only: the guest's reads and writes still step, and the
//! shadow is resynced) every page whose sites matter only beneath such
//! roots ([`SiteUse::quiet_ok`](super::split::SiteUse::quiet_ok)). Probes,
//! the function tracer, counts, return probes, hidden hooks and the roots
//! themselves keep their pages hooked in both.
//!
//! A vCPU runs on the armed view while its context is inside such a root
//! (`Graph::inside_roots`), on the quiet one otherwise:
//! - a root's entry (a frame of such a session pushed) arms it;
//! - a return that pops such a frame looks at the stack it runs on, the
//!   current task's own stack and its CPU's stacks, and goes quiet when
//!   none holds such a frame (a root entered from an interrupt on a task
//!   outside the session returns to the task's state);
//! - root's own hook on `finish_task_switch` (which every task runs first
//!   thing when it comes in on a CPU, a new task too) picks the view for
//!   the task coming in: a task that sleeps inside a root and wakes on
//!   another vCPU is armed there before its first call. Reading `current`
//!   at a later exit would be too late: the quiet view takes none.
//!
//! Root moves a vCPU to the view its tracer state names after each
//! hypercall (a VMCS write of the EPT pointer; each view's translations
//! are tagged by its own pointer, and a change to the entries both share
//! invalidates both).
//!
//! [`Tracer::settle_views`] runs after every request and module event
//! that can change who uses a site: it installs or removes the scheduler
//! hook and sets each page's quiet mapping, with the other vCPUs held.

use super::machine::{Env, KernelView};
use super::split::remap_quiet;
use super::{site, symbols, Tracer};
use crate::addr::Gva;
use crate::ept;
use guest_introspect::fentry::FentrySite;
use guest_introspect::view::PagedView;

/// The scheduler function root hooks to learn of context switches: it
/// runs on the incoming task after every switch. Compilers may rename it
/// with a suffix (`finish_task_switch.isra.0`).
pub const SWITCH_FUNCTION: &str = "finish_task_switch";

/// The quiet views' state.
#[derive(Default)]
pub(super) struct QuietState {
    /// The scheduler hook's site, while installed.
    pub(super) switch_site: Option<Gva>,
    /// Why the hook could not be installed, once (then every page stays
    /// hooked in both views).
    pub(super) unavailable: Option<&'static str>,
    /// Pages the quiet views map to the guest's frames.
    pub(super) pages: u32,
    /// Pages left as they were because a vCPU was inside one of their
    /// sites when they would have changed.
    pub(super) busy: u64,
}

impl super::VmState {
    /// The sessions whose frames pick a vCPU's view: those of
    /// `Graph::quiet_users` while the scheduler hook is in (without it
    /// nothing is quiet, and the view does not matter).
    pub(super) fn arming_users(&self) -> u16 {
        if self.quiet.switch_site.is_some() {
            self.graph.quiet_users()
        } else {
            0
        }
    }
}

impl Tracer<'_> {
    /// After a change to who uses the hooked sites: the scheduler hook is
    /// in exactly while a session's trace set can go quiet, and each
    /// hooked page is quiet exactly when all its sites are
    /// [`quiet_ok`](super::split::SiteUse::quiet_ok). `k` is needed only to
    /// install the hook (without it, nothing goes quiet until a request
    /// that has it). Holds the other vCPUs for any change.
    pub fn settle_views(&mut self, k: Option<&dyn KernelView>, env: &mut Env<'_>) {
        let users = self.vm.graph.quiet_users();
        // The hook costs an exit per context switch: only while some site
        // can go quiet (a session rooted at its whole trace set has none).
        let any = {
            let graph = &self.vm.graph;
            let is_root = |g: u16, f: Gva| graph.is_root_of(g, f);
            users != 0
                && self
                    .vm
                    .view
                    .sites
                    .values()
                    .any(|u| u.quiet_ok(users, is_root))
        };
        if any && self.vm.quiet.switch_site.is_none() {
            if let Some(k) = k {
                self.install_switch_hook(k, env);
            }
        }
        let armed = any && self.vm.quiet.switch_site.is_some();
        let graph = &self.vm.graph;
        let is_root = |g: u16, f: Gva| graph.is_root_of(g, f);
        let view = &mut self.vm.view;
        let quiet = &mut self.vm.quiet;
        let mut quiet_pages = 0u32;
        let mut flips = 0usize;
        // A cursor rather than an iterator: pages change on the way.
        let mut next = view.pages.keys().next().copied();
        while let Some(page) = next {
            next = view
                .pages
                .range(crate::addr::Gpa(page.0 + 1)..)
                .next()
                .map(|(&p, _)| p);
            let Some(h) = view.pages.get(&page) else {
                continue;
            };
            let want = armed
                && !h.patches.is_empty()
                && h.patches.iter().all(|p| {
                    view.sites
                        .get(&p.site)
                        .is_some_and(|u| u.quiet_ok(users, is_root))
                });
            if want == h.quiet {
                quiet_pages += u32::from(want);
                continue;
            }
            // A page that cannot change now stays as it was: hooked in
            // both views is always safe; a quiet page that a new user
            // needs hooked is logged, and the next request tries again.
            if !env.m.stop_others() {
                log::warn!(
                    "tracer: quiet view of {page:#x} not changed: {}",
                    super::split::STALLED
                );
                quiet_pages += u32::from(h.quiet);
                continue;
            }
            let rips = env.m.rips();
            let inside = h
                .patches
                .iter()
                .any(|p| rips.iter().any(|&rip| site::rip_inside(p.site, rip)));
            let hpa = if want { page.identity_hpa() } else { h.shadow };
            if inside || !remap_quiet(env, page, hpa, ept::EXEC) {
                quiet.busy += u64::from(inside);
                quiet_pages += u32::from(h.quiet);
                continue;
            }
            if let Some(h) = view.pages.get_mut(&page) {
                h.quiet = want;
            }
            flips += 1;
            quiet_pages += u32::from(want);
        }
        quiet.pages = quiet_pages;
        if flips != 0 {
            env.m.invept();
            log::info!("tracer: {flips} pages changed in the quiet views; {quiet_pages} are quiet");
        }
        if !any && self.vm.quiet.switch_site.is_some() {
            self.remove_switch_hook(env);
        }
    }

    /// Hooks [`SWITCH_FUNCTION`] for root; on failure, says why once and
    /// leaves every page hooked in both views.
    fn install_switch_hook(&mut self, k: &dyn KernelView, env: &mut Env<'_>) {
        let Some(fs) = switch_site(self, k, env) else {
            let why = "the kernel's finish_task_switch has no fentry site";
            if self.vm.quiet.unavailable.is_none() {
                log::warn!(
                    "tracer: {why}: sessions with roots hook their trace sets on every vCPU"
                );
            }
            self.vm.quiet.unavailable = Some(why);
            return;
        };
        if self.ensure_region(k, env).is_err() {
            return;
        }
        if !env.m.stop_others() {
            return;
        }
        let region = self.vm.region.as_ref();
        match self.vm.view.hook(k, env, region, fs.site, fs.func) {
            Ok(()) => {
                if let Some(u) = self.vm.view.sites.get_mut(&fs.site) {
                    u.switch = true;
                }
                self.vm.quiet.switch_site = Some(fs.site);
                self.vm.quiet.unavailable = None;
                env.m.invept();
                log::info!("tracer: context switches seen at {:#x}", fs.site.0);
            }
            Err(e) => {
                log::warn!("tracer: cannot hook finish_task_switch ({e}): sessions with roots hook their trace sets on every vCPU");
                self.vm.quiet.unavailable = Some("finish_task_switch could not be hooked");
            }
        }
    }

    /// Takes root's scheduler hook off (its site stays hooked while others
    /// use it).
    fn remove_switch_hook(&mut self, env: &mut Env<'_>) {
        let Some(site) = self.vm.quiet.switch_site.take() else {
            return;
        };
        if let Some(u) = self.vm.view.sites.get_mut(&site) {
            u.switch = false;
        }
        self.vm.view.unhook_if_unused(env, site);
        env.m.invept();
    }
}

/// The fentry site of [`SWITCH_FUNCTION`], by its name or a suffixed one.
fn switch_site(t: &Tracer<'_>, k: &dyn KernelView, env: &Env<'_>) -> Option<FentrySite> {
    let view = PagedView::new(env.ram, k.cr3());
    let classifier = t.classifier(k);
    let index = k.index();
    let exact = index.lookup(SWITCH_FUNCTION);
    let suffixed = || {
        let mut pattern = alloc::string::String::from(SWITCH_FUNCTION);
        pattern.push_str(".*");
        let found = index.glob(&pattern).next();
        found
    };
    exact.or_else(suffixed).and_then(|id| {
        symbols::SymRef::Core(id)
            .classify(k, &classifier, &view)
            .ok()
    })
}
