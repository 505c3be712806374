//! The host's requests to the tracer: probes, the function tracer and
//! function-graph sessions. Each changes shared state only (sites, pages,
//! probes, sessions) and flushes EPT once before it answers.

use super::fgraph::{self, GraphSession, MAX_STACK_FRAMES, STACK_FRAMES};
use super::machine::{Env, KernelView};
use super::modules;
use super::probes::{Gate, Probe, MAX_PROBES};
use super::retstack::MAX_USERS;
use super::split::{AttachError, SiteUse, MAX_SITES};
use super::symbols;
use super::symbols::resolve_fetch_symbols;
use super::users::User;
use super::{
    insert_site, out_of_memory, stop_others, FunctionsAdded, GraphStarted, ProbeAdded, ReqError,
    Tracer,
};
use crate::addr::Gva;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::sync::atomic::AtomicU64;
use guest_introspect::fallible::{self, btree_entry_bytes};
use guest_introspect::fentry::FentrySite;
use guest_introspect::view::PagedView;
use protocol::{ErrorKind, GraphFilter};
use tracelang::graph::GraphText;
use tracelang::kprobe::{self, Command};

/// What a request found to hook ([`Tracer::traceable_matches`]).
#[derive(Default)]
pub(super) struct Matches {
    /// (symbol, site, function) of each traceable match.
    found: Vec<(symbols::SymRef, Gva, Gva)>,
    /// Why the first few matches cannot be hooked.
    skipped: Vec<String>,
    /// Matches that cannot be hooked.
    skipped_total: u32,
}

impl Matches {
    fn skip(&mut self, why: impl FnOnce() -> String) {
        self.skipped_total += 1;
        if self.skipped.len() < 8 {
            self.skipped.push(why());
        }
    }
}

/// Sites hooked per hold of the other vCPUs in a long request.
const HOOK_BATCH: usize = 512;

impl Tracer<'_> {
    /// `probe add`.
    pub fn probe_add(
        &mut self,
        text: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<ProbeAdded, ReqError> {
        let mut spec = match kprobe::parse(text) {
            Ok(Command::Add(s)) => s,
            Ok(Command::Delete(_)) => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    "a delete command is not a probe: use probe del",
                ))
            }
            Err(e) => return Err(ReqError::new(ErrorKind::InvalidArgument, e.to_string())),
        };
        if self
            .vm
            .probes
            .list
            .iter()
            .any(|p| p.spec.group == spec.group && p.spec.event == spec.event)
        {
            return Err(ReqError::new(
                ErrorKind::AlreadyExists,
                format!("probe {}/{} already exists", spec.group, spec.event),
            ));
        }
        if self.vm.probes.list.len() >= MAX_PROBES {
            return Err(ReqError::new(
                ErrorKind::OutOfResources,
                format!("at most {MAX_PROBES} probes; delete one first"),
            ));
        }
        fallible::try_grow(&mut self.vm.probes.list, 1)
            .map_err(|e| out_of_memory(env, "a probe", e))?;
        resolve_fetch_symbols(&mut spec, k)?;
        let sym = match symbols::lookup(k, spec.module.as_deref(), &spec.symbol) {
            Ok(sym) => sym,
            Err(_)
                if spec
                    .module
                    .as_deref()
                    .is_some_and(|m| k.modules().module(m).is_none()) =>
            {
                if kprobe::needs_btf(&spec) {
                    return Err(ReqError::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "BTF arguments need the module's BTF: load {} first",
                            spec.module.as_deref().unwrap_or("the module")
                        ),
                    ));
                }
                // Its module is not loaded: pending until it loads, as
                // the kernel keeps such a kprobe.
                return self.probe_add_pending(spec, k, env);
            }
            Err(m) => return Err(ReqError::new(ErrorKind::NotFound, m)),
        };
        // Offsets and types from the running guest's BTF, once, before
        // anything is hooked.
        super::btf_args::resolve(&mut spec, text, k, env)?;
        let module = match sym {
            symbols::SymRef::Module(id) => k.modules().get(id).map(|(m, _)| m.name.clone()),
            symbols::SymRef::Core(_) => None,
        };
        let view = PagedView::new(env.ram, k.cr3());
        let fs = sym.classify(k, &self.classifier(k), &view).map_err(|e| {
            ReqError::new(
                ErrorKind::InvalidArgument,
                format!("{} cannot be probed: {e}", sym.name(k)),
            )
        })?;
        self.ensure_region(k, env)?;
        if module.is_some() {
            // An unload must be seen before anything is hooked there.
            self.ensure_module_hooks(k, env, true)?;
        }
        stop_others(env)?;
        let site = fs.site;
        let pid = self.vm.probes.next_id;
        let attached = self.attach_probe(k, env, &fs, pid, spec.kind.is_return());
        env.m.invept();
        if let Err(e) = attached {
            self.release_module_hooks_if_idle(env);
            env.m.invept();
            return Err(match e {
                AttachError::Hook(e) => ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!("cannot hook {} at {site:#x}: {e}", spec.symbol),
                ),
                AttachError::Memory(e) => out_of_memory(env, "the probe's site", e),
            });
        }
        self.vm.probes.next_id += 1;
        let name = format!("{}/{}", spec.group, spec.event);
        log::info!("tracer: probe {name} on {} at {site:#x}", spec.symbol);
        self.vm.probes.list.push(Probe {
            id: pid,
            heap: kprobe::worst_case_bytes(&spec.args),
            entry_args: super::probes::reads_entry_args(&spec),
            spec,
            site: Some(site),
            module,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            gate: None,
        });
        Ok(ProbeAdded { name, site: site.0 })
    }

    /// Hooks the site `fs` for probe `id` (a return probe when
    /// `is_return`) and adds the probe to the site's users. A site hooked
    /// for it alone goes again when the probe cannot be added.
    pub(super) fn attach_probe(
        &mut self,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        fs: &FentrySite,
        id: u32,
        is_return: bool,
    ) -> Result<(), AttachError> {
        self.vm
            .view
            .hook(k, env, self.vm.region.as_ref(), fs.site, fs.func)
            .map_err(AttachError::Hook)?;
        let user = if is_return {
            User::ReturnProbe(id)
        } else {
            User::Probe(id)
        };
        let pushed = match self.vm.view.sites.get_mut(&fs.site) {
            Some(u) => u.users.join(user).map(|_| ()),
            None => Ok(()),
        };
        if let Err(e) = pushed {
            self.vm.view.unhook_if_unused(env, fs.site);
            return Err(AttachError::Memory(e));
        }
        Ok(())
    }

    /// A probe on a function of a module that is not loaded: kept pending,
    /// with the hidden hooks in to arm it when the module loads.
    fn probe_add_pending(
        &mut self,
        spec: kprobe::ProbeSpec,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<ProbeAdded, ReqError> {
        let module = spec.module.clone();
        let pid = self.vm.probes.next_id;
        let name = format!("{}/{}", spec.group, spec.event);
        self.vm.probes.list.push(Probe {
            id: pid,
            heap: kprobe::worst_case_bytes(&spec.args),
            entry_args: super::probes::reads_entry_args(&spec),
            spec,
            site: None,
            module,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            gate: None,
        });
        if let Err(e) = self
            .ensure_region(k, env)
            .and_then(|()| self.ensure_module_hooks(k, env, true))
        {
            self.vm.probes.list.pop();
            return Err(e);
        }
        self.vm.probes.next_id += 1;
        log::info!("tracer: probe {name} pending until its module loads");
        Ok(ProbeAdded { name, site: 0 })
    }

    /// `probe del NAME` (`EVENT` or `GROUP/EVENT`).
    pub fn probe_del(&mut self, name: &str, env: &mut Env<'_>) -> Result<(), ReqError> {
        let Some(i) = self.vm.probes.position(name) else {
            return Err(ReqError::new(
                ErrorKind::NotFound,
                format!("no probe named {name}"),
            ));
        };
        stop_others(env)?;
        let p = self.vm.probes.list.remove(i);
        if let Some(site) = p.site {
            if let Some(u) = self.vm.view.sites.get_mut(&site) {
                u.users.leave(User::Probe(p.id));
                u.users.leave(User::ReturnProbe(p.id));
            }
            self.vm.view.unhook_if_unused(env, site);
        }
        self.release_module_hooks_if_idle(env);
        env.m.invept();
        Ok(())
    }

    /// The function tracer on every traceable function matching `glob`.
    /// Returns (traced, first skips, skipped).
    pub fn function_add(
        &mut self,
        glob: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<FunctionsAdded, ReqError> {
        symbols::check_glob(glob).map_err(|e| ReqError::new(ErrorKind::InvalidArgument, e))?;
        let follows = symbols::module_glob(glob).is_some();
        if follows {
            self.follow_function_glob(glob, k, env)?;
        }
        let matches = self.traceable_matches(&[glob], k, env)?;
        let mut newly = 0;
        let added = self.hook_matches(matches, k, env, |u, _| {
            // A flag: joining needs no room.
            if u.users.join(User::Function).unwrap_or(false) {
                newly += 1;
            }
        })?;
        self.vm.probes.functions += newly;
        log::info!(
            "tracer: function tracer on {glob}: {} traced, {} skipped",
            added.traced,
            added.skipped_total
        );
        Ok(added)
    }

    /// The traceable functions matching any of `globs` (each once, aliases
    /// too), classified with every vCPU still running, and the matches
    /// that cannot be hooked, with why. Module functions are kept only
    /// while unloads are followed (the hidden hooks are put in here).
    pub(super) fn traceable_matches(
        &mut self,
        globs: &[&str],
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<Matches, ReqError> {
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = self.classifier(k);
        let mut m = Matches::default();
        let mut seen = alloc::collections::BTreeSet::new();
        for glob in globs {
            let ids = fallible::try_collect(symbols::glob(k, glob))
                .map_err(|e| out_of_memory(env, "the list of matching symbols", e))?;
            for id in ids {
                let Ok(fs) = id.classify(k, &classifier, &view) else {
                    continue; // not traceable: not a match for the tracer
                };
                if seen.contains(&fs.site.0) {
                    continue; // an alias of a function already done
                }
                // The set cannot reserve: past the site table's bound (or
                // the heap's room) the rest could not be hooked anyway.
                if seen.len() >= MAX_SITES
                    || env.m.heap_check(btree_entry_bytes::<u64, ()>()).is_err()
                    || fallible::try_push(&mut m.found, (id, fs.site, fs.func)).is_err()
                {
                    m.skip(|| format!("{}: out of hypervisor memory for the request", id.name(k)));
                    continue;
                }
                seen.insert(fs.site.0);
            }
        }
        let core = k.index().text();
        if m.found
            .iter()
            .any(|&(_, site, _)| modules::outside_core(core, site))
        {
            if let Err(e) = self.ensure_module_hooks(k, env, true) {
                let mut found = core::mem::take(&mut m.found);
                found.retain(|&(id, site, _)| {
                    if !modules::outside_core(core, site) {
                        return true;
                    }
                    m.skip(|| format!("{}: {}", id.name(k), e.message));
                    false
                });
                m.found = found;
            }
        }
        Ok(m)
    }

    /// Hooks `matches` (the other vCPUs held, a batch at a time) and marks
    /// each hooked site's use with `mark` (given the symbol that matched). Returns what was hooked and
    /// what was not.
    pub(super) fn hook_matches(
        &mut self,
        matches: Matches,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        mut mark: impl FnMut(&mut SiteUse, symbols::SymRef),
    ) -> Result<FunctionsAdded, ReqError> {
        let Matches {
            found,
            mut skipped,
            mut skipped_total,
        } = matches;
        let mut traced = 0u32;
        if !found.is_empty() {
            self.ensure_region(k, env)?;
            stop_others(env)?;
        }
        for (n, (id, site, func)) in found.into_iter().enumerate() {
            if n > 0 && n % HOOK_BATCH == 0 {
                // Let the other vCPUs run between batches.
                env.m.invept();
                env.m.let_others_go();
            }
            match self
                .vm
                .view
                .hook(k, env, self.vm.region.as_ref(), site, func)
            {
                Ok(()) => {
                    if let Some(u) = self.vm.view.sites.get_mut(&site) {
                        mark(u, id);
                    }
                    traced += 1;
                }
                Err(e) => {
                    skipped_total += 1;
                    if skipped.len() < 8 {
                        skipped.push(format!("{}: {e}", id.name(k)));
                    }
                }
            }
        }
        env.m.invept();
        Ok(FunctionsAdded {
            traced,
            skipped,
            skipped_total,
        })
    }

    /// Keeps the function tracer's module glob `glob`, with the hidden
    /// hooks in, so it covers the modules that load later too.
    fn follow_function_glob(
        &mut self,
        glob: &str,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<(), ReqError> {
        let globs = &self.vm.modules.function_globs;
        if !globs.iter().any(|g| g == glob) {
            if globs.len() >= modules::MAX_FUNCTION_GLOBS {
                return Err(ReqError::new(
                    ErrorKind::OutOfResources,
                    format!(
                        "the function tracer follows {} module globs already; clear it first",
                        modules::MAX_FUNCTION_GLOBS
                    ),
                ));
            }
            let kept = fallible::try_string(glob)
                .and_then(|g| fallible::try_push(&mut self.vm.modules.function_globs, g));
            if let Err(e) = kept {
                return Err(out_of_memory(env, "the function tracer's module globs", e));
            }
        }
        self.ensure_region(k, env)?;
        if let Err(e) = self.ensure_module_hooks(k, env, true) {
            self.vm.modules.function_globs.retain(|g| g != glob);
            return Err(e);
        }
        Ok(())
    }

    /// Removes the function tracer everywhere.
    pub fn function_clear(&mut self, env: &mut Env<'_>) -> Result<(), ReqError> {
        self.vm.modules.function_globs.clear();
        stop_others(env)?;
        self.vm.view.release(env, |u| u.leave(User::Function));
        self.vm.probes.functions = 0;
        self.release_module_hooks_if_idle(env);
        Ok(())
    }

    /// `GraphStart`: a new session; hooks its trace set and records its
    /// roots. Returns (session, hooked, roots, skipped).
    pub fn graph_start(
        &mut self,
        filter: GraphFilter,
        k: &dyn KernelView,
        env: &mut Env<'_>,
    ) -> Result<GraphStarted, ReqError> {
        let Some(user) = self.vm.graph.free_number() else {
            return Err(ReqError::new(
                ErrorKind::OutOfResources,
                format!(
                    "{} function-graph sessions already run; stop one first",
                    MAX_USERS - 1
                ),
            ));
        };
        if filter.gate {
            return self.gate_start(user, filter);
        }
        let busy = self.vm.graph.busy();
        let frames = match filter.stack_frames {
            0 if busy => self.vm.graph.stack_frames,
            0 => STACK_FRAMES,
            n if n > MAX_STACK_FRAMES => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!("at most {MAX_STACK_FRAMES} frames per stack"),
                ))
            }
            n if busy && n != self.vm.graph.stack_frames => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "the return stacks are in use with {} frames each; stop the other sessions and let their calls return first",
                        self.vm.graph.stack_frames
                    ),
                ))
            }
            n => n,
        };
        for g in filter
            .functions
            .iter()
            .chain(&filter.trace)
            .chain(&filter.notrace)
            .chain(&filter.graph_notrace)
        {
            symbols::check_glob(g).map_err(|e| ReqError::new(ErrorKind::InvalidArgument, e))?;
        }
        self.vm.graph.stack_frames = frames;
        let view = PagedView::new(env.ram, k.cr3());
        let classifier = self.classifier(k);
        let site_of = |id: symbols::SymRef| id.classify(k, &classifier, &view).ok();
        // Each set is bounded ([`MAX_SITES`]) and checked against the
        // heap's room entry by entry: the globs are the host's, the
        // symbols the guest's.
        let oom = |e| out_of_memory(env, "the function-graph session's sets", e);
        let sites_of = |globs: &[String]| -> Result<BTreeMap<u64, u64>, ReqError> {
            let mut out = BTreeMap::new();
            for g in globs {
                for id in symbols::glob(k, g) {
                    if let Some(fs) = site_of(id) {
                        insert_site(env, &mut out, fs.site.0, fs.func.0).map_err(oom)?;
                    }
                }
            }
            Ok(out)
        };
        let notrace = sites_of(&filter.notrace)?;
        let mut graph_notrace = sites_of(&filter.graph_notrace)?;
        graph_notrace.retain(|s, _| !notrace.contains_key(s));
        let mut roots = BTreeSet::new();
        let mut wanted = BTreeMap::new();
        for (site, func) in sites_of(&filter.functions)? {
            if !notrace.contains_key(&site) {
                env.m
                    .heap_check(btree_entry_bytes::<u64, ()>())
                    .map_err(oom)?;
                roots.insert(func);
                insert_site(env, &mut wanted, site, func).map_err(oom)?;
            }
        }
        // Module globs among the roots may match nothing yet: the session
        // waits for their modules.
        let waits = filter
            .functions
            .iter()
            .any(|g| symbols::module_glob(g).is_some());
        if !filter.functions.is_empty() && roots.is_empty() && !waits {
            return Err(ReqError::new(
                ErrorKind::NotFound,
                format!(
                    "no traceable function matches {}",
                    filter.functions.join(" ")
                ),
            ));
        }
        let every = [String::from("*")];
        let trace: &[String] = if !fgraph::hooks_callees(&filter) {
            // max_depth 1 under roots: nothing beneath a root is shown,
            // so only the roots are hooked.
            &[]
        } else if filter.trace.is_empty() {
            &every
        } else {
            &filter.trace
        };
        for (site, func) in sites_of(trace)? {
            if !notrace.contains_key(&site) {
                insert_site(env, &mut wanted, site, func).map_err(oom)?;
            }
        }
        // A set_graph_notrace function is hooked even outside the trace
        // set: its frame is what hides its callees.
        for (&site, &func) in &graph_notrace {
            insert_site(env, &mut wanted, site, func).map_err(oom)?;
        }
        // The session keeps the graph_notrace functions as a set.
        env.m
            .heap_check(
                graph_notrace
                    .len()
                    .saturating_mul(btree_entry_bytes::<u64, ()>()),
            )
            .map_err(oom)?;
        // Session numbers are 1 to 15 (`free_number`).
        let session = User::Graph(user as u8);
        // Module functions are hooked only while unloads are followed;
        // module globs need loads followed too.
        let core = k.index().text();
        let mut skipped = 0u32;
        if fgraph::follows_modules(&filter) {
            self.ensure_region(k, env)?;
            self.ensure_module_hooks(k, env, true)?;
        }
        if wanted.keys().any(|&s| modules::outside_core(core, Gva(s))) {
            if let Err(e) = self.ensure_module_hooks(k, env, true) {
                let before = wanted.len();
                wanted.retain(|&s, _| !modules::outside_core(core, Gva(s)));
                skipped += (before - wanted.len()) as u32;
                log::warn!(
                    "tracer: graph session {user}: module functions left out: {}",
                    e.message
                );
            }
        }
        // Matched with every vCPU running; hooked with the others held.
        self.ensure_region(k, env)?;
        stop_others(env)?;
        let mut hooked = 0u32;
        for (n, (site, func)) in wanted.into_iter().enumerate() {
            if n > 0 && n % HOOK_BATCH == 0 {
                env.m.invept();
                env.m.let_others_go();
            }
            match self
                .vm
                .view
                .hook(k, env, self.vm.region.as_ref(), Gva(site), Gva(func))
            {
                Ok(()) => {
                    if let Some(u) = self.vm.view.sites.get_mut(&Gva(site)) {
                        // A flag: joining needs no room.
                        let _ = u.users.join(session);
                    }
                    hooked += 1;
                }
                Err(_) => skipped += 1,
            }
        }
        env.m.invept();
        let n_roots = roots.len() as u32;
        log::info!(
            "tracer: graph session {user}: {hooked} functions hooked, {n_roots} roots, {skipped} skipped"
        );
        self.vm.graph.start(
            user,
            GraphSession {
                text: GraphText::new(filter.retval),
                notrace: graph_notrace.into_values().collect(),
                rooted: !filter.functions.is_empty(),
                filter,
                roots,
            },
        );
        Ok(GraphStarted {
            session: user as u32,
            hooked,
            roots: n_roots,
            skipped,
        })
    }

    /// A gate session ([`GraphFilter::gate`]): a task filter and nothing
    /// hooked; it gates probes (`ProbeGate`) and, being a session that
    /// filters without roots, picks the views of their sites.
    fn gate_start(&mut self, user: usize, filter: GraphFilter) -> Result<GraphStarted, ReqError> {
        if filter.pid.is_none() && filter.comm.is_none() {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                "a gate filters by pid or comm: give one",
            ));
        }
        let globs = [
            &filter.functions,
            &filter.trace,
            &filter.notrace,
            &filter.graph_notrace,
        ];
        if globs.iter().any(|g| !g.is_empty()) {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                "a gate hooks nothing: give it no globs",
            ));
        }
        log::info!("tracer: graph session {user}: a gate");
        self.vm.graph.start(
            user,
            GraphSession {
                text: GraphText::new(false),
                notrace: BTreeSet::new(),
                rooted: false,
                filter,
                roots: BTreeSet::new(),
            },
        );
        Ok(GraphStarted {
            session: user as u32,
            hooked: 0,
            roots: 0,
            skipped: 0,
        })
    }

    /// Session `n` (its number, and itself), when it can gate: it runs,
    /// has no roots and filters by pid or comm.
    pub(super) fn gating_session(&self, n: u32) -> Result<(u8, &GraphSession), ReqError> {
        let u = n as usize;
        let g = (1..MAX_USERS)
            .contains(&u)
            .then(|| self.vm.graph.sessions.get(u))
            .flatten()
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                ReqError::new(
                    ErrorKind::NotFound,
                    format!("no function-graph session {n}"),
                )
            })?;
        if g.rooted || (g.filter.pid.is_none() && g.filter.comm.is_none()) {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                format!("session {n} does not filter tasks without roots: it gates nothing"),
            ));
        }
        Ok((u as u8, g))
    }

    /// `ProbeGate`: probe `name` records only for the tasks session
    /// `session` admits (a session without roots that filters by pid or
    /// comm), or for every task again (`None`).
    pub fn probe_gate(
        &mut self,
        name: &str,
        session: Option<u32>,
        env: &mut Env<'_>,
    ) -> Result<(), ReqError> {
        let Some(i) = self.vm.probes.position(name) else {
            return Err(ReqError::new(
                ErrorKind::NotFound,
                format!("no probe named {name}"),
            ));
        };
        let gate = match session {
            None => None,
            Some(n) => {
                let (u, g) = self.gating_session(n)?;
                let comm = match &g.filter.comm {
                    Some(c) => Some(
                        fallible::try_collect(c.bytes().take(15))
                            .map_err(|e| out_of_memory(env, "a probe's gate", e))?,
                    ),
                    None => None,
                };
                Some(Gate {
                    session: u,
                    pid: g.filter.pid,
                    comm,
                })
            }
        };
        // Hits on the other vCPUs read the gate.
        stop_others(env)?;
        if let Some(p) = self.vm.probes.list.get_mut(i) {
            p.gate = gate;
        }
        Ok(())
    }

    /// `GraphStop`: session `session` (`None`: every session) hijacks no
    /// new calls; frames in flight stay and still return through us.
    pub fn graph_stop(&mut self, session: Option<u32>, env: &mut Env<'_>) -> Result<(), ReqError> {
        let users: Vec<usize> = match session {
            None => (1..MAX_USERS).filter(|&u| self.vm.graph.runs(u)).collect(),
            Some(n) => {
                let u = n as usize;
                if !(1..MAX_USERS).contains(&u) || !self.vm.graph.runs(u) {
                    return Err(ReqError::new(
                        ErrorKind::NotFound,
                        format!("no function-graph session {n}"),
                    ));
                }
                alloc::vec![u]
            }
        };
        stop_others(env)?;
        let mask = users.iter().fold(0u16, |m, &u| m | 1 << u);
        self.vm.graph.stop(mask);
        // The probes behind a stopped session's gate record for every task
        // again.
        for p in &mut self.vm.probes.list {
            if p.gate
                .as_ref()
                .is_some_and(|g| mask & super::users::graph_bit(g.session) != 0)
            {
                p.gate = None;
            }
        }
        if self.vm.count.gate_bit() & mask != 0 {
            self.vm.count.gate = None;
        }
        if mask != 0 {
            self.vm.view.release(env, |s| s.leave_graphs(mask));
        }
        self.release_module_hooks_if_idle(env);
        Ok(())
    }
}
