//! Modules that come and go: root learns of each load and unload in time
//! from hidden hooks of its own on the kernel's module code, and arms and
//! disarms the probes and hooks on a module's functions there.
//!
//! - **Load**: `do_init_module(mod)` runs once a module is formed (its text
//!   in place and executable, its symbols readable, state
//!   `MODULE_STATE_COMING`) and before it calls the module's init. Its
//!   entry hits our hidden hook; the vCPU that loads the module stays in
//!   root while root walks the module list again and hooks the pending
//!   probes on the module's functions, so they fire from the init on.
//! - **Unload**: `free_module(mod)` runs after a module's exit (or its
//!   failed init) and before the kernel frees its memory. At its entry
//!   root unhooks every site in the module's text (core and init): the
//!   probes there go back to pending, the function tracer and graph
//!   sessions lose those functions, and no shadow page stays mapped over
//!   a page the kernel is about to free.
//! - **Init text**: once a module's init has returned, `do_init_module`
//!   calls `module_arch_freeing_init(mod)` (the init text still in place)
//!   and only then hands that text to a work item that frees it. At that
//!   entry root unhooks every site in the module's init text, as at an
//!   unload. A module's init functions are traceable only while this
//!   third hook is in (a kernel without a site there keeps them
//!   untraceable).
//!
//! The hit on a hidden hook only notes the event for its vCPU
//! ([`CpuState::take_module_event`]); the exit handler serves it with the
//! whole VM lock, before the vCPU enters the guest again: that is what
//! makes it in time. The hidden hooks are installed while something needs
//! them (a pending probe, or a hooked site outside the kernel's text) and
//! removed when nothing does.

use super::fgraph;
use super::machine::{Env, KernelView};
use super::split::AttachError;
use super::split::MAX_SITES;
pub use super::users::ModuleHook;
use super::users::{User, MAX_GRAPH_SESSION};
use super::{stop_others, symbols, ReqError, Tracer};
use crate::addr::Gva;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use guest_introspect::fallible::{self, btree_entry_bytes, OutOfMemory};
use guest_introspect::fentry::{Classifier, FentrySite};
use guest_introspect::view::{PagedView, VirtMemory};
use guest_introspect::GvaRange;
use protocol::ErrorKind;

/// A load or unload seen at a hidden hook, for the exit handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleEvent {
    /// Which hook.
    pub hook: ModuleHook,
    /// The `struct module *` the function was called with (RDI).
    pub module: u64,
}

/// The hidden hooks and what they did.
#[derive(Default)]
pub(super) struct ModuleTrack {
    /// The sites of the hidden hooks, while installed.
    pub(super) hooks: Vec<Gva>,
    /// Init texts freed (after a successful init) and the sites unhooked
    /// there.
    pub(super) inits_freed: u64,
    pub(super) init_unhooked: u64,
    /// Loads and unloads seen.
    pub(super) loads: u64,
    pub(super) unloads: u64,
    /// Probes armed at a load, sites unhooked at an unload.
    pub(super) armed: u64,
    pub(super) unhooked: u64,
    /// The kernel image's text, as of the last request: a hooked site
    /// outside it is in a module.
    pub(super) core_text: Option<GvaRange>,
    /// The function tracer's module globs (`MOD:GLOB`): they also cover
    /// the modules that load later.
    pub(super) function_globs: Vec<String>,
    /// Functions hooked at loads for module globs (the function tracer's
    /// and graph sessions').
    pub(super) followed: u64,
}

/// Heap a counted function's name takes when its module goes (the
/// longest kernel symbol, its module's name and the mark).
const UNLOADED_NAME_BYTES: usize = 512 + 64 + 16;

/// The function tracer's user bit in a loading module's plan.
const FUNCTION_BIT: u32 = 1 << 0;

/// The graph sessions' user bits in a loading module's plan: session N's
/// is bit N, for N from 1 to 15.
const GRAPH_BITS: u32 = 0xfffe;

/// The count's user bit in a loading module's plan (past the function
/// tracer's bit 0 and the graph sessions' bits 1 to 15).
const COUNT_BIT: u32 = 1 << 16;

/// Sites an unload takes per pass (a fixed buffer on root's stack).
const UNLOAD_BATCH: usize = 128;

/// Module globs the function tracer keeps at most.
pub(super) const MAX_FUNCTION_GLOBS: usize = 64;

/// Whether `site` is outside the kernel image's text `core` (in a
/// module).
pub(super) fn outside_core(core: Option<GvaRange>, site: Gva) -> bool {
    !core.is_some_and(|t| t.contains(site))
}

impl Tracer<'_> {
    /// Whether anything needs the hidden hooks: a pending probe, or a
    /// user's hook outside the kernel's text.
    fn modules_needed(&self) -> bool {
        let core = self.vm.modules.core_text;
        self.vm.probes.list.iter().any(|p| p.site.is_none())
            || !self.vm.modules.function_globs.is_empty()
            || !self.vm.count.globs.is_empty()
            || self
                .vm
                .graph
                .sessions
                .iter()
                .flatten()
                .any(|g| g.follows_modules())
            || self
                .vm
                .view
                .sites
                .iter()
                .any(|(&s, u)| u.users.module().is_none() && outside_core(core, s))
    }

    /// Installs the hidden hooks if they are not in and something needs
    /// them, or `about_to` (a request is about to hook module functions).
    /// An error when the kernel's module functions cannot be hooked: then
    /// module functions cannot be traced safely.
    pub(super) fn ensure_module_hooks(
        &mut self,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        about_to: bool,
    ) -> Result<(), ReqError> {
        self.vm.modules.core_text = k.index().text();
        if !self.vm.modules.hooks.is_empty() || !(about_to || self.modules_needed()) {
            return Ok(());
        }
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = Classifier::new(k.index());
        let site_of = |hook: ModuleHook| {
            symbols::lookup(k, None, hook.function())
                .ok()
                .filter(|s| matches!(s, symbols::SymRef::Core(_)))
                .and_then(|s| s.classify(k, &classifier, &view).ok())
        };
        let mut found = Vec::new();
        for hook in [ModuleHook::Load, ModuleHook::Unload] {
            let site = site_of(hook).ok_or_else(|| {
                ReqError::new(
                    ErrorKind::Unsupported,
                    format!(
                        "this kernel's {} has no fentry site: module loads and unloads cannot be followed, so module functions cannot be traced",
                        hook.function()
                    ),
                )
            })?;
            found.push((hook, site));
        }
        // Optional: without it a module's init text is not traced.
        let init = site_of(ModuleHook::InitFreeing);
        self.ensure_region(k, env)?;
        stop_others(env)?;
        for (hook, fs) in found {
            if let Err(e) = self.hidden_hook(k, env, hook, &fs) {
                self.drop_module_hooks(env);
                return Err(ReqError::new(
                    ErrorKind::Unsupported,
                    format!("cannot hook {} to follow modules: {e}", hook.function()),
                ));
            }
        }
        match init.map(|fs| self.hidden_hook(k, env, ModuleHook::InitFreeing, &fs)) {
            Some(Ok(())) => {}
            Some(Err(e)) => log::warn!(
                "tracer: cannot hook module_arch_freeing_init ({e}): module init text is not traced"
            ),
            None => log::warn!(
                "tracer: module_arch_freeing_init has no fentry site: module init text is not traced"
            ),
        }
        env.m.invept();
        log::info!(
            "tracer: following module loads and unloads at do_init_module and free_module{}",
            if self.follows_init_text() {
                ", and the freeing of init text at module_arch_freeing_init"
            } else {
                ""
            }
        );
        Ok(())
    }

    /// Hooks the kernel function of `hook` at `fs` as a hidden hook.
    fn hidden_hook(
        &mut self,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        hook: ModuleHook,
        fs: &FentrySite,
    ) -> Result<(), super::site::PatchError> {
        self.vm
            .view
            .hook(k, env, self.vm.region.as_ref(), fs.site, fs.func)?;
        if let Some(u) = self.vm.view.sites.get_mut(&fs.site) {
            // A slot: joining needs no room.
            let _ = u.users.join(User::Module(hook));
        }
        self.vm.modules.hooks.push(fs.site);
        // A vCPU on its quiet view must not load or unload a module unseen.
        if !self.vm.view.make_loud(env, fs.site) {
            log::warn!(
                "tracer: {} is not hooked in the quiet views yet",
                hook.function()
            );
        }
        Ok(())
    }

    /// The classifier of the tracer's requests: a module's init text is
    /// traceable while root follows its freeing.
    pub(super) fn classifier<'k>(&self, k: &'k dyn KernelView) -> Classifier<'k> {
        Classifier::new(k.index()).with_module_init(self.follows_init_text())
    }

    /// Whether the hook on `module_arch_freeing_init` is among the hidden
    /// hooks: only then is a module's init text traceable.
    fn follows_init_text(&self) -> bool {
        self.vm.modules.hooks.iter().any(|s| {
            self.vm
                .view
                .sites
                .get(s)
                .is_some_and(|u| u.users.has(User::Module(ModuleHook::InitFreeing)))
        })
    }

    /// Removes the hidden hooks when nothing needs them any more.
    pub(super) fn release_module_hooks_if_idle(&mut self, env: &mut Env<'_>) {
        if !self.vm.modules.hooks.is_empty() && !self.modules_needed() {
            self.drop_module_hooks(env);
        }
    }

    fn drop_module_hooks(&mut self, env: &mut Env<'_>) {
        for site in core::mem::take(&mut self.vm.modules.hooks) {
            if let Some(u) = self.vm.view.sites.get_mut(&site) {
                if let Some(hook) = u.users.module() {
                    u.users.leave(User::Module(hook));
                }
            }
            self.vm.view.unhook_if_unused(env, site);
        }
        env.m.invept();
    }

    /// Serves a load or unload seen at a hidden hook; for a load, with the
    /// module index of a walk made just now. Runs with the whole VM lock,
    /// the vCPU that hit still in root.
    pub fn module_event(&mut self, ev: ModuleEvent, k: &dyn KernelView, env: &mut Env<'_>) {
        match ev.hook {
            ModuleHook::Load => self.module_loaded(ev.module, k, env),
            ModuleHook::Unload => self.module_unloading(ev.module, k, env),
            ModuleHook::InitFreeing => self.module_init_freeing(ev.module, k, env),
        }
        self.release_module_hooks_if_idle(env);
        env.m.invept();
    }

    /// Arms the pending probes on the module at `module`.
    fn module_loaded(&mut self, module: u64, k: &dyn KernelView, env: &mut Env<'_>) {
        self.vm.modules.loads += 1;
        let Some(name) = k
            .modules()
            .modules()
            .iter()
            .find(|m| m.addr.0 == module)
            .map(|m| m.name.clone())
        else {
            log::warn!(
                "tracer: a module at {module:#x} is loading, but the module list does not show it"
            );
            return;
        };
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = self.classifier(k);
        let mut armed = 0u32;
        for i in 0..self.vm.probes.list.len() {
            let Some(p) = self.vm.probes.list.get(i) else {
                break;
            };
            if p.site.is_some() || p.module.as_deref() != Some(name.as_str()) {
                continue;
            }
            let fs = match symbols::lookup(k, Some(&name), &p.spec.symbol).and_then(|s| {
                s.classify(k, &classifier, &view)
                    .map_err(|e| format!("{e}"))
            }) {
                Ok(fs) => fs,
                Err(e) => {
                    log::warn!(
                        "tracer: probe {}/{} stays pending: {e}",
                        p.spec.group,
                        p.spec.event
                    );
                    continue;
                }
            };
            let id = p.id;
            let is_return = p.spec.kind.is_return();
            match self.attach_probe(k, env, &fs, id, is_return) {
                Ok(()) => {}
                Err(AttachError::Hook(e)) => {
                    log::warn!(
                        "tracer: probe {id} stays pending: cannot hook {:#x}: {e}",
                        fs.site.0
                    );
                    continue;
                }
                Err(AttachError::Memory(e)) => {
                    log::warn!("tracer: probe {id} stays pending: {e}");
                    continue;
                }
            }
            if let Some(p) = self.vm.probes.list.get_mut(i) {
                p.site = Some(fs.site);
            }
            armed += 1;
        }
        self.vm.modules.armed += u64::from(armed);
        let followed = self.follow_module(&name, k, env, &view, &classifier);
        log::info!(
            "tracer: module {name} is loading: {armed} pending probes armed, {followed} functions hooked for module globs"
        );
    }

    /// Hooks the functions of the module `name`, loading, that the
    /// function tracer's module globs and the running graph sessions'
    /// name, so they are traced from its init on. Returns the functions
    /// hooked.
    fn follow_module<V: VirtMemory + ?Sized>(
        &mut self,
        name: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        view: &V,
        classifier: &Classifier<'_>,
    ) -> u32 {
        match self.follow_plan(name, k, env, view, classifier) {
            Ok((want, extra)) => self.follow_hook(want, extra, k, env),
            Err(e) => {
                log::warn!("tracer: module {name}: its functions are not followed: {e}");
                0
            }
        }
    }

    /// What [`Self::follow_module`] hooks: each site with its function and
    /// users ([`FUNCTION_BIT`]: the function tracer; bit N of
    /// [`GRAPH_BITS`]: graph session N; [`COUNT_BIT`]: the count), and the
    /// graph sessions' new roots and `set_graph_notrace` functions (user,
    /// function, root).
    #[allow(clippy::type_complexity)]
    fn follow_plan<V: VirtMemory + ?Sized>(
        &self,
        name: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        view: &V,
        classifier: &Classifier<'_>,
    ) -> Result<(BTreeMap<u64, (u64, u32)>, Vec<(usize, u64, bool)>), OutOfMemory> {
        // The module's functions that `globs` name (only the module globs
        // among them if `only_modules`).
        let sites = |globs: &[String], only_modules: bool| {
            fallible::try_collect(
                globs
                    .iter()
                    .filter(|g| !only_modules || symbols::module_glob(g).is_some())
                    .flat_map(|g| symbols::glob_in_module(k, g, name))
                    .filter_map(|id| id.classify(k, classifier, view).ok()),
            )
        };
        let mut want: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
        let mut add = |env: &mut Env<'_>, fs: &FentrySite, bit: u32| {
            if let Some(e) = want.get_mut(&fs.site.0) {
                e.1 |= bit;
                return Ok(());
            }
            if want.len() >= MAX_SITES {
                return Err(OutOfMemory::of::<(u64, u64, u32)>(1));
            }
            env.m.heap_check(btree_entry_bytes::<u64, (u64, u32)>())?;
            want.insert(fs.site.0, (fs.func.0, bit));
            Ok(())
        };
        for g in &self.vm.modules.function_globs {
            for fs in sites(core::slice::from_ref(g), true)? {
                add(env, &fs, FUNCTION_BIT)?;
            }
        }
        for g in &self.vm.count.globs {
            for fs in sites(core::slice::from_ref(g), true)? {
                add(env, &fs, COUNT_BIT)?;
            }
        }
        let mut extra = Vec::new();
        for (user, g) in self.vm.graph.sessions.iter().enumerate() {
            let Some(g) = g.as_ref().filter(|g| g.follows_modules()) else {
                continue;
            };
            let bit = 1u32 << user;
            let f = &g.filter;
            let notrace = sites(&f.notrace, false)?;
            let kept = |fs: &FentrySite| !notrace.iter().any(|n| n.site == fs.site);
            for fs in sites(&f.functions, true)?.iter().filter(|fs| kept(fs)) {
                add(env, fs, bit)?;
                fallible::try_push(&mut extra, (user, fs.func.0, true))?;
            }
            for fs in sites(fgraph::hooked_trace(f), true)?
                .iter()
                .filter(|fs| kept(fs))
            {
                add(env, fs, bit)?;
            }
            // A set_graph_notrace function is hooked even outside the
            // trace set: its frame hides its callees.
            for fs in sites(&f.graph_notrace, false)?.iter().filter(|fs| kept(fs)) {
                add(env, fs, bit)?;
                fallible::try_push(&mut extra, (user, fs.func.0, false))?;
            }
        }
        Ok((want, extra))
    }

    /// Hooks what [`Self::follow_plan`] found; returns the functions
    /// hooked.
    fn follow_hook(
        &mut self,
        want: BTreeMap<u64, (u64, u32)>,
        extra: Vec<(usize, u64, bool)>,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> u32 {
        let mut hooked = 0u32;
        for (site, (func, bits)) in want {
            let (site, func) = (Gva(site), Gva(func));
            if let Err(e) = self
                .vm
                .view
                .hook(k, env, self.vm.region.as_ref(), site, func)
            {
                log::warn!("tracer: cannot hook {:#x} of a loading module: {e}", site.0);
                continue;
            }
            let Some(u) = self.vm.view.sites.get_mut(&site) else {
                continue;
            };
            // Joining a flag needs no room.
            if bits & FUNCTION_BIT != 0 && u.users.join(User::Function).unwrap_or(false) {
                self.vm.probes.functions += 1;
            }
            if bits & COUNT_BIT != 0 && !u.users.has(User::Count) {
                self.vm.count.follow(u);
            }
            for n in 1..=MAX_GRAPH_SESSION {
                if bits & GRAPH_BITS & 1 << n != 0 {
                    let _ = u.users.join(User::Graph(n));
                }
            }
            hooked += 1;
        }
        for (user, func, root) in extra {
            let Some(Some(g)) = self.vm.graph.sessions.get_mut(user) else {
                continue;
            };
            let set = if root { &mut g.roots } else { &mut g.notrace };
            if env.m.heap_check(btree_entry_bytes::<u64, ()>()).is_err() {
                log::warn!(
                    "tracer: graph session {user}: out of memory for a loading module's function"
                );
                continue;
            }
            set.insert(func);
        }
        self.vm.modules.followed += u64::from(hooked);
        hooked
    }

    /// Unhooks everything in the text of the module at `module`.
    fn module_unloading(&mut self, module: u64, k: &dyn KernelView, env: &mut Env<'_>) {
        self.vm.modules.unloads += 1;
        let Some((text, init)) = k.module_text(module) else {
            log::warn!("tracer: a module at {module:#x} is going, but its text cannot be read");
            return;
        };
        let core = k.index().text();
        let (sites, pending) = self.unhook_text(
            |s| (text.contains(s) || init.contains(s)) && outside_core(core, s),
            k,
            env,
        );
        log::info!(
            "tracer: a module at {module:#x} is going ({:#x}-{:#x}): {sites} sites unhooked, {pending} probes pending again",
            text.start.0,
            text.end.0,
        );
    }

    /// Unhooks everything in the init text of the module at `module`: its
    /// init has returned, and the kernel is about to free that text.
    fn module_init_freeing(&mut self, module: u64, k: &dyn KernelView, env: &mut Env<'_>) {
        let Some((_, init)) = k.module_text(module) else {
            log::warn!(
                "tracer: a module at {module:#x} is freeing its init text, but its text cannot be read"
            );
            return;
        };
        // free_module calls it too, after its own hook took everything
        // (the init text is empty by then, unless the init failed).
        if init.is_empty() {
            return;
        }
        self.vm.modules.inits_freed += 1;
        let core = k.index().text();
        let (sites, pending) =
            self.unhook_text(|s| init.contains(s) && outside_core(core, s), k, env);
        self.vm.modules.init_unhooked += u64::from(sites);
        if sites > 0 {
            log::info!(
                "tracer: a module at {module:#x} frees its init text ({:#x}-{:#x}): {sites} sites unhooked, {pending} probes pending again",
                init.start.0,
                init.end.0,
            );
        }
    }

    /// Unhooks every site for which `inside` holds, whatever its users
    /// (not root's own hooks): the kernel is about to free that text, and
    /// the frames may hold other code next. Each user learns its sites
    /// went: its probes go back to pending, the function tracer and the
    /// graph sessions lose them, the sessions' roots and
    /// `set_graph_notrace` functions there go (another module may load at
    /// the same addresses), and the count keeps their calls under their
    /// names, marked unloaded. The other vCPUs are held however long that
    /// takes, and the sites go even if one does not come
    /// ([`Machine::must_stop_others`](super::machine::Machine::must_stop_others)).
    /// Returns the sites unhooked and the probes pending again.
    fn unhook_text(
        &mut self,
        inside: impl Fn(Gva) -> bool,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> (u32, u32) {
        let gone = |s: Gva, u: &super::split::SiteUse| {
            inside(s) && u.users.module().is_none() && u.users.switch().is_none()
        };
        let mut unhooked = 0u32;
        let mut pending = 0u32;
        let mut held = false;
        // A fixed batch at a time (an unload never allocates): each batch's
        // sites leave the map, so the next scan finds the rest.
        loop {
            let mut batch = [Gva(0); UNLOAD_BATCH];
            let mut n = 0;
            for (&s, u) in &self.vm.view.sites {
                let Some(slot) = batch.get_mut(n) else {
                    break;
                };
                if gone(s, u) {
                    *slot = s;
                    n += 1;
                }
            }
            if n == 0 {
                break;
            }
            if !held {
                // Root logs it when a vCPU does not come: the sites go
                // all the same.
                held = true;
                let _ = env.m.must_stop_others();
            }
            for &site in batch.iter().take(n) {
                let Some(u) = self.vm.view.sites.get_mut(&site) else {
                    continue;
                };
                // Every user leaves, and learns that the site went.
                let func = u.func;
                let users = core::mem::take(&mut u.users);
                let calls = users.calls().load(core::sync::atomic::Ordering::Relaxed);
                for user in users.iter() {
                    pending += self.site_left(user, site, func, calls, k, env);
                }
                self.vm.view.unhook(env, site);
                unhooked += 1;
            }
        }
        for g in self.vm.graph.sessions.iter_mut().flatten() {
            g.roots.retain(|&f| !inside(Gva(f)));
            g.notrace.retain(|&f| !inside(Gva(f)));
        }
        self.vm.modules.unhooked += u64::from(unhooked);
        (unhooked, pending)
    }

    /// Tells `user` that the module text under its site `site` (of
    /// function `func`) is going: a probe goes back to pending (returns
    /// 1), the function tracer loses a function, the count keeps the
    /// site's `calls` under the function's name, marked unloaded. A graph
    /// session keeps nothing per site (its roots and `set_graph_notrace`
    /// functions go after the sites), and root's own hooks are never in
    /// a module's text.
    fn site_left(
        &mut self,
        user: User,
        site: Gva,
        func: Gva,
        calls: u64,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> u32 {
        match user {
            User::Probe(id) | User::ReturnProbe(id) => {
                let probe = self.vm.probes.list.iter_mut().find(|p| p.id == id);
                match probe {
                    Some(p) if p.site == Some(site) => {
                        p.site = None;
                        1
                    }
                    _ => 0,
                }
            }
            User::Function => {
                self.vm.probes.functions = self.vm.probes.functions.saturating_sub(1);
                0
            }
            User::Count => {
                let room = env
                    .m
                    .heap_check(UNLOADED_NAME_BYTES + btree_entry_bytes::<u64, (String, u64)>())
                    .is_ok();
                self.vm.count.unloaded(k, func, site, calls, room);
                0
            }
            User::Graph(_) | User::CountTiming | User::Module(_) | User::Switch(_) => 0,
        }
    }
}
