//! Sessions that cost only what they trace: each vCPU's quiet EPT view.
//!
//! A function-graph session with roots records a call of its trace set
//! only beneath one of its roots (one filtered by pid or comm, only for
//! the tasks it admits), yet every call of a hooked function exits
//! wherever it runs. So each vCPU has two views (`View`): the armed one
//! hooks everything, and the quiet one leaves unhooked the sites that
//! matter only there ([`SiteUse::quiet_ok`](super::split::SiteUse::quiet_ok)):
//! a page of such sites alone is mapped to the guest's own frame
//! (execute-only: the guest's reads and writes still step, and the shadow
//! is resynced), a page with other sites too to a partial shadow with our
//! calls at those only (`QuietMap`). Probes and return probes behind the
//! gate of such a session (`ProbeGate`: they record only for the tasks its
//! filter admits) are quiet there too; open probes, the function tracer,
//! counts, hidden hooks and the roots themselves stay hooked in both.
//!
//! A vCPU runs on the armed view while its context is inside such a root
//! (`Graph::inside_roots`) or runs a task such a filter admits, on the
//! quiet one otherwise:
//! - a root's entry (a frame of such a session pushed) arms it;
//! - a return that pops the last such frame of its stack looks at the
//!   stack it runs on, the current task's own stack and its CPU's stacks,
//!   and goes quiet when none holds such a frame (a root entered from an
//!   interrupt on a task outside the session returns to the task's state);
//! - root's own hook on `finish_task_switch` (which every task runs first
//!   thing when it comes in on a CPU, a new task too) picks the view for
//!   the task coming in: a task that sleeps inside a root and wakes on
//!   another vCPU is armed there before its first call. Reading `current`
//!   at a later exit would be too late: the quiet view takes none;
//! - root's hook on `__set_task_comm` picks it for a task renamed (an exec
//!   into a filtered name), with the new name read from its argument;
//! - each vCPU's next timer turn after a filtering session starts or stops
//!   picks it for the task running then.
//!
//! Root moves a vCPU to the view its tracer state names after each
//! hypercall (a VMCS write of the EPT pointer; each view's translations
//! are tagged by its own pointer, and a change to the entries both share
//! invalidates both).
//!
//! [`Tracer::settle_views`] runs after every request and module event
//! that can change who uses a site: it installs or removes root's hooks
//! and sets each page's quiet mapping, with the other vCPUs held.

use super::machine::{CpuView, Env, KernelView};
use super::retstack::MAX_USERS;
use super::site::Patch;
use super::split::{page_bytes, remap_quiet, QuietMap, SiteUse, SplitView};
pub use super::users::SwitchHook;
use super::users::User;
use super::{site, symbols, Tracer};
use crate::addr::{Gpa, Gva};
use crate::ept;
use guest_introspect::fentry::FentrySite;
use guest_introspect::view::PagedView;

/// The quiet views' state.
#[derive(Default)]
pub(super) struct QuietState {
    /// The scheduler hook's site, while installed.
    pub(super) switch_site: Option<Gva>,
    /// The renaming hook's site, while a session filters by comm.
    pub(super) comm_site: Option<Gva>,
    /// Bumped when the sessions that filter by pid or comm change: each
    /// vCPU picks its view again at its next turn (a task that runs when
    /// such a session starts is known then, not at its next switch).
    pub(super) epoch: u64,
    /// The filtering sessions as of the last settling.
    pub(super) filtering: u16,
    /// Whether views switched as of the last settling.
    pub(super) on: bool,
    /// The scheduler hook could not be installed, and the log said so
    /// (every page then stays hooked in both views).
    pub(super) unavailable: bool,
    /// Pages the quiet views map to the guest's frames, and to partial
    /// shadows.
    pub(super) pages: u32,
    pub(super) partial: u32,
    /// Pages left as they were because a vCPU was inside one of their
    /// sites when they would have changed.
    pub(super) busy: u64,
    /// Task switches are recorded as `sched_switch` events
    /// ([`protocol::Request::Sched`]): the scheduler hook stays in for
    /// them too.
    pub(super) sched_switch: bool,
    /// Wakeups are recorded as `sched_wakeup` events: root's hook on
    /// `try_to_wake_up` is in while they are.
    pub(super) sched_wakeup: bool,
    /// That hook's site, while installed.
    pub(super) wakeup_site: Option<Gva>,
}

/// Whether the site patched by `p` matters everywhere (it is not
/// `quiet_ok` for the quiet sessions `users`): the quiet views hook it.
fn matters_everywhere(
    sites: &alloc::collections::BTreeMap<Gva, SiteUse>,
    p: &Patch,
    users: u16,
    is_root: impl Fn(u16, Gva) -> bool,
    gate_of: impl Fn(u32) -> u16,
    count_gate: u16,
) -> bool {
    !sites
        .get(&p.site)
        .is_some_and(|u| u.quiet_ok(users, is_root, gate_of, count_gate))
}

/// What the quiet views should map a page to.
#[derive(Clone, Copy)]
enum Want {
    Shadow,
    Guest,
    Partial,
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
    /// Each graph session's hooked functions, roots, and functions the
    /// quiet views leave unhooked, for `status`.
    pub fn graph_sessions(&self) -> alloc::vec::Vec<protocol::GraphSessionReport> {
        let graph = &self.vm.graph;
        let users = graph.quiet_users();
        let quiet_on = self.vm.quiet.on;
        let is_root = |g: u16, f: Gva| graph.is_root_of(g, f);
        let probes = &self.vm.probes;
        let gate_of = |id: u32| probes.gate_bit(id);
        let count_gate = self.vm.count.gate_bit();
        // One pass over the sites: (hooked, quiet) by session number.
        let mut counts = [(0u32, 0u32); MAX_USERS];
        for u in self
            .vm
            .view
            .sites
            .values()
            .filter(|u| u.users.graphs() != 0)
        {
            let quiet = u32::from(quiet_on && u.quiet_ok(users, is_root, gate_of, count_gate));
            for (n, c) in counts.iter_mut().enumerate() {
                if u.users.graphs() & (1 << n) != 0 {
                    c.0 += 1;
                    c.1 += quiet;
                }
            }
        }
        let mut out = alloc::vec::Vec::new();
        for ((n, g), &(hooked, quiet)) in graph.sessions.iter().enumerate().zip(&counts) {
            let Some(g) = g else {
                continue;
            };
            let r = protocol::GraphSessionReport {
                session: n as u32,
                hooked,
                roots: g.roots.len() as u32,
                quiet,
            };
            // At most 15 sessions: a status answer's worth.
            if guest_introspect::fallible::try_push(&mut out, r).is_err() {
                break;
            }
        }
        out
    }

    /// After a change to who uses the hooked sites: the scheduler hook is
    /// in exactly while a session's trace set can go quiet or switches are
    /// recorded (the wakeup hook while wakeups are), and each
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
            let probes = &self.vm.probes;
            let gate_of = |id: u32| probes.gate_bit(id);
            let count_gate = self.vm.count.gate_bit();
            users != 0
                && self
                    .vm
                    .view
                    .sites
                    .values()
                    .any(|u| u.quiet_ok(users, is_root, gate_of, count_gate))
        };
        let comm = any && self.vm.graph.comm_users(self.vm.graph.filter_users()) != 0;
        // The switch events want the hook too, without quiet views.
        let hook = any || self.vm.quiet.sched_switch;
        // Hooks off first (their sites may go with them), then on.
        if !hook && self.vm.quiet.switch_site.is_some() {
            self.remove_switch_hook(env, SwitchHook::Schedule);
        }
        if !comm && self.vm.quiet.comm_site.is_some() {
            self.remove_switch_hook(env, SwitchHook::Comm);
        }
        if let (true, None, Some(k)) = (hook, self.vm.quiet.switch_site, k) {
            self.install_switch_hook(k, env, SwitchHook::Schedule);
        }
        let wakeups = self.vm.quiet.sched_wakeup;
        if !wakeups && self.vm.quiet.wakeup_site.is_some() {
            self.remove_switch_hook(env, SwitchHook::Wakeup);
        }
        if let (true, None, Some(k)) = (wakeups, self.vm.quiet.wakeup_site, k) {
            self.install_switch_hook(k, env, SwitchHook::Wakeup);
        }
        // Renames matter only while views switch at all.
        let switching = self.vm.quiet.switch_site.is_some();
        if let (true, true, None, Some(k)) = (comm, switching, self.vm.quiet.comm_site, k) {
            self.install_switch_hook(k, env, SwitchHook::Comm);
        }
        let armed = any && switching;
        let filtering = if armed {
            self.vm.graph.filter_users()
        } else {
            0
        };
        let mut repick = armed != self.vm.quiet.on || filtering != self.vm.quiet.filtering;
        self.vm.quiet.on = armed;
        self.vm.quiet.filtering = filtering;
        let graph = &self.vm.graph;
        let is_root = |g: u16, f: Gva| graph.is_root_of(g, f);
        let probes = &self.vm.probes;
        let gate_of = |id: u32| probes.gate_bit(id);
        let count_gate = self.vm.count.gate_bit();
        let view = &mut self.vm.view;
        let quiet = &mut self.vm.quiet;
        let (mut guest_pages, mut partial_pages, mut flips) = (0u32, 0u32, 0usize);
        let mut count = |m: QuietMap| match m {
            QuietMap::Guest => guest_pages += 1,
            QuietMap::Partial(_) => partial_pages += 1,
            QuietMap::Shadow => {}
        };
        // A cursor rather than an iterator: pages change on the way.
        let mut next = view.pages.keys().next().copied();
        while let Some(page) = next {
            next = view.pages.range(Gpa(page.0 + 1)..).next().map(|(&p, _)| p);
            let SplitView { pages, sites, .. } = &mut *view;
            let Some(h) = pages.get(&page) else {
                continue;
            };
            let loud =
                |p: &Patch| matters_everywhere(sites, p, users, is_root, gate_of, count_gate);
            let n_loud = h.patches.iter().filter(|p| loud(p)).count();
            let want = if !armed || n_loud == h.patches.len() {
                Want::Shadow
            } else if n_loud == 0 {
                Want::Guest
            } else {
                Want::Partial
            };
            let was = h.quiet;
            let same = match (want, was) {
                (Want::Shadow, QuietMap::Shadow) | (Want::Guest, QuietMap::Guest) => true,
                (Want::Partial, QuietMap::Partial(_)) => {
                    h.patches.iter().all(|p| p.in_quiet == loud(p))
                }
                _ => false,
            };
            if same {
                count(was);
                continue;
            }
            // A site that now matters everywhere and the quiet views do
            // not hook yet: if the page cannot take its new mapping, it
            // takes the shadow (always right, if dearer).
            let louder = match was {
                QuietMap::Shadow => false,
                QuietMap::Guest => n_loud > 0,
                QuietMap::Partial(_) => h.patches.iter().any(|p| loud(p) && !p.in_quiet),
            };
            let shadow = h.shadow;
            // With every vCPU held, none inside a site of the page.
            let held = env.m.stop_others();
            let rips = env.m.rips();
            let inside = h
                .patches
                .iter()
                .any(|p| rips.iter().any(|&rip| site::rip_inside(p.site, rip)));
            if !held || inside {
                quiet.busy += 1;
                if louder {
                    log::warn!(
                        "tracer: page {page:#x} is not hooked in the quiet views for its new users yet ({}); the next request tries again",
                        if held { "a vCPU is inside one of its sites" } else { super::split::STALLED }
                    );
                }
                count(was);
                continue;
            }
            let mut now = match want {
                Want::Shadow => QuietMap::Shadow,
                Want::Guest => QuietMap::Guest,
                Want::Partial => {
                    // Rebuilt whole, with every vCPU held: the guest's
                    // page, and our calls at the sites that matter
                    // everywhere.
                    let frame = match was {
                        QuietMap::Partial(q) => Some(q),
                        _ => view.alloc_quiet_shadow(env),
                    };
                    match (frame, page_bytes(env.ram, page)) {
                        (Some(q), Some(orig)) => {
                            let SplitView { pages, sites, .. } = &mut *view;
                            let bytes = env.m.frame(q);
                            bytes.copy_from_slice(&orig);
                            if let Some(h) = pages.get_mut(&page) {
                                for p in h.patches.iter_mut() {
                                    p.in_quiet = matters_everywhere(
                                        sites, p, users, is_root, gate_of, count_gate,
                                    );
                                    let at = usize::from(p.offset);
                                    let slot = bytes.get_mut(at..at + trampolines::patch::SITE_LEN);
                                    if let (true, Some(slot)) = (p.in_quiet, slot) {
                                        slot.copy_from_slice(&p.ours);
                                    }
                                }
                            }
                            QuietMap::Partial(q)
                        }
                        (frame, _) => {
                            if let (Some(q), false) = (frame, matches!(was, QuietMap::Partial(_))) {
                                view.free_shadow(q);
                            }
                            // No frame to spare (or the page unreadable):
                            // the whole shadow is right.
                            QuietMap::Shadow
                        }
                    }
                }
            };
            let hpa = |m: QuietMap| match m {
                QuietMap::Shadow => shadow,
                QuietMap::Guest => page.identity_hpa(),
                QuietMap::Partial(q) => q,
            };
            if !remap_quiet(env, page, hpa(now), ept::EXEC) {
                if let (QuietMap::Partial(q), false) = (now, matches!(was, QuietMap::Partial(_))) {
                    view.free_shadow(q);
                }
                // The shadow's entry exists (the page is mapped): mapping
                // it again allocates nothing.
                now = if louder && remap_quiet(env, page, shadow, ept::EXEC) {
                    QuietMap::Shadow
                } else {
                    count(was);
                    continue;
                };
            }
            if let Some(h) = view.pages.get_mut(&page) {
                h.quiet = now;
                if !matches!(now, QuietMap::Partial(_)) {
                    for p in h.patches.iter_mut() {
                        p.in_quiet = false;
                    }
                }
            }
            if let (QuietMap::Partial(q), false) = (was, matches!(now, QuietMap::Partial(_))) {
                view.free_shadow(q);
            }
            flips += 1;
            count(now);
        }
        quiet.pages = guest_pages;
        quiet.partial = partial_pages;
        if flips != 0 {
            env.m.invept();
            repick = true;
            log::info!(
                "tracer: {flips} pages changed in the quiet views; {guest_pages} left to the guest, {partial_pages} with a partial shadow"
            );
        }
        if repick {
            // Every vCPU picks its view again at its next turn (one that
            // stays on a view meanwhile misses nothing a hit would have
            // armed it for, but for a task that was inside a root or
            // admitted by a filter before the pages went quiet).
            quiet.epoch += 1;
        }
    }

    /// Whether the quiet views changed (the pages, the filtering
    /// sessions, switching on or off) since this vCPU last picked its view
    /// at a turn ([`Self::turn_view`]).
    pub fn view_due(&self) -> bool {
        self.cpu.epoch != self.vm.quiet.epoch
    }

    /// A timer turn of this vCPU: if the quiet views changed since it last
    /// looked, it picks its view for the task it runs.
    pub fn turn_view(&mut self, kernel: Option<&dyn KernelView>, cpu: &CpuView, now_ns: u64) {
        if self.cpu.epoch != self.vm.quiet.epoch {
            self.cpu.epoch = self.vm.quiet.epoch;
            self.vm.pick_view(self.cpu, kernel, cpu, now_ns);
        }
    }

    /// Installs root's hook `hook`; on failure, says why once (without
    /// the scheduler hook every page stays hooked in both views; without
    /// the renaming hook a task that execs into a filtered name is armed
    /// at its next switch).
    fn install_switch_hook(&mut self, k: &dyn KernelView, env: &mut Env<'_>, hook: SwitchHook) {
        let name = hook.function();
        let hooked = match hook_site(self, k, env, name) {
            None => Err(alloc::format!("the kernel's {name} has no fentry site")),
            Some(fs) => self
                .ensure_region(k, env)
                .map_err(|e| e.message)
                .and_then(|()| {
                    let region = self.vm.region.as_ref();
                    self.vm
                        .view
                        .hook(k, env, region, fs.site, fs.func)
                        .map_err(|e| alloc::format!("{name} could not be hooked: {e}"))
                })
                .map(|()| fs.site),
        };
        match hooked {
            Ok(site) => {
                if let Some(u) = self.vm.view.sites.get_mut(&site) {
                    // A slot: joining needs no room.
                    let _ = u.users.join(User::Switch(hook));
                }
                // It picks views from the quiet view too, from now on.
                let _ = self.vm.view.make_loud(env, site);
                match hook {
                    SwitchHook::Schedule => {
                        self.vm.quiet.switch_site = Some(site);
                        self.vm.quiet.unavailable = false;
                    }
                    SwitchHook::Comm => self.vm.quiet.comm_site = Some(site),
                    SwitchHook::Wakeup => self.vm.quiet.wakeup_site = Some(site),
                }
                env.m.invept();
                log::info!("tracer: {name} hooked at {:#x} for root", site.0);
            }
            Err(why) => {
                if hook == SwitchHook::Schedule {
                    if !self.vm.quiet.unavailable {
                        log::warn!("tracer: {why}: sessions with roots or filters hook their trace sets on every vCPU");
                    }
                    self.vm.quiet.unavailable = true;
                } else if hook == SwitchHook::Wakeup {
                    log::warn!("tracer: {why}: no sched_wakeup events");
                    // Asked once: the next request does not try again.
                    self.vm.quiet.sched_wakeup = false;
                } else {
                    log::warn!("tracer: {why}: a task renamed into a comm filter is armed at its next switch");
                }
            }
        }
    }

    /// Takes root's hook `hook` off (its site stays hooked while others
    /// use it).
    fn remove_switch_hook(&mut self, env: &mut Env<'_>, hook: SwitchHook) {
        let slot = match hook {
            SwitchHook::Schedule => &mut self.vm.quiet.switch_site,
            SwitchHook::Comm => &mut self.vm.quiet.comm_site,
            SwitchHook::Wakeup => &mut self.vm.quiet.wakeup_site,
        };
        let Some(site) = slot.take() else {
            return;
        };
        if let Some(u) = self.vm.view.sites.get_mut(&site) {
            u.users.leave(User::Switch(hook));
        }
        self.vm.view.unhook_if_unused(env, site);
        env.m.invept();
    }
}

/// The fentry site of the kernel function `name`, by its name or one
/// with a compiler's suffix (`name.isra.0`).
fn hook_site(t: &Tracer<'_>, k: &dyn KernelView, env: &Env<'_>, name: &str) -> Option<FentrySite> {
    let view = PagedView::new(env.ram, k.cr3());
    let classifier = t.classifier(k);
    let index = k.index();
    let exact = index.lookup(name);
    let suffixed = || index.glob(&alloc::format!("{name}.*")).next();
    exact.or_else(suffixed).and_then(|id| {
        symbols::SymRef::Core(id)
            .classify(k, &classifier, &view)
            .ok()
    })
}
