//! Call counts in VMX root (bcc's funccount): each counted function's
//! site carries its own counter, which a hit adds one to and nothing else.
//! No event is recorded and nothing crosses the channel until the host
//! reads the counters, so nothing is lost however hot the functions are.
//!
//! One count runs at a time. Its memory is a counter and a flag in each
//! counted site's use (the sites themselves are bounded by
//! [`super::split::MAX_SITES`]); `CountRead` reports it. A module unloaded
//! while counted takes its functions' counts with it, as its sites go.

use super::machine::{Env, KernelView};
use super::symbols;
use super::users::User;
pub(super) use super::users::LATENCY_ID;
use super::{FunctionsAdded, ReqError, Tracer};
use crate::addr::Gva;
use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use guest_introspect::fallible;
use guest_introspect::kallsyms::SymbolId;
use protocol::{
    CountFilter, CountPage, ErrorKind, FunctionCount, HistFilter, HistKey, HistRow, LATENCY_BUCKETS,
};
use tracelang::kprobe::{self, Command, ProbeSpec};
use tracelang::kprobe::{IndexSymbols, SymbolResolver};

/// Most keys a histogram holds; calls of further keys are counted in
/// `overflow`.
pub const HIST_KEYS: usize = 64;
/// Row bytes per `Hist` answer, so that a page fits one frame.
const HIST_PAGE_BUDGET: usize = 2400;

/// A histogram of a fetch argument, a row per key (bpftrace's `hist()`).
pub(super) struct Hist {
    /// The entry probe whose first argument is the value.
    pub(super) spec: ProbeSpec,
    pub(super) key: HistKey,
    /// The rows, at most [`HIST_KEYS`], their room reserved at the start
    /// (a hit never allocates).
    rows: spin::Mutex<Vec<HistSlot>>,
    overflow: AtomicU64,
    faults: AtomicU64,
}

struct HistSlot {
    key: [u8; 16],
    buckets: [u64; LATENCY_BUCKETS],
}

impl Hist {
    /// One call: `value` (or a fault) under `key`.
    pub(super) fn add(&self, key: [u8; 16], value: Option<u64>) {
        let Some(v) = value else {
            self.faults.fetch_add(1, Relaxed);
            return;
        };
        let b = latency_bucket(v);
        let mut rows = self.rows.lock();
        let slot = match rows.iter().position(|r| r.key == key) {
            Some(i) => rows.get_mut(i),
            None if rows.len() < rows.capacity() => {
                rows.push(HistSlot {
                    key,
                    buckets: [0; LATENCY_BUCKETS],
                });
                rows.last_mut()
            }
            None => None,
        };
        match slot.and_then(|r| r.buckets.get_mut(b)) {
            Some(n) => *n += 1,
            None => {
                self.overflow.fetch_add(1, Relaxed);
            }
        }
    }

    /// The key of a call.
    pub(super) fn key_of(&self, func: u64, pid: i32, comm: &[u8; 16]) -> [u8; 16] {
        let mut k = [0u8; 16];
        match self.key {
            HistKey::Comm => k = *comm,
            HistKey::Pid => k[..4].copy_from_slice(&pid.to_le_bytes()),
            _ => k[..8].copy_from_slice(&func.to_le_bytes()),
        }
        k
    }
}

/// One entry of a count's read: a live counted site (its site and use),
/// or a function whose module went (its name and calls).
enum Counted<'a> {
    Live(Gva, &'a super::split::SiteUse),
    Gone(&'a str, u64),
}

/// A page of histogram rows.
pub struct HistPage {
    pub rows: Vec<HistRow>,
    pub next: Option<u32>,
    pub overflow: u64,
    pub faults: u64,
    pub max_keys: u32,
}

/// Most globs a count takes.
pub const MAX_COUNT_GLOBS: usize = 32;
/// Name bytes per `Counts` answer, so that a page fits one frame.
const PAGE_BUDGET: usize = 2800;

/// The running count.
pub(super) struct CountState {
    pub(super) on: bool,
    /// Only this thread id.
    pub(super) pid: Option<i32>,
    /// Only this comm (its bytes, at most 15).
    pub(super) comm: Option<Vec<u8>>,
    /// Functions hooked for the count.
    pub(super) functions: u32,
    /// Root time when it started.
    pub(super) started_ns: u64,
    /// Calls of counted functions the filter left out.
    pub(super) filtered: AtomicU64,
    /// (function, the kernel symbol that matched), by address.
    pub(super) names: Vec<(u64, SymbolId)>,
    /// Calls are timed too.
    pub(super) latency: bool,
    /// Timed calls by duration: log2 buckets of nanoseconds.
    pub(super) times: [AtomicU64; LATENCY_BUCKETS],
    /// Calls that could not be timed.
    pub(super) missed: AtomicU64,
    /// With latency: each counted function's errors and time, by
    /// function address (the functions hooked at the start; a module's
    /// function that loads later is timed in `times` only).
    pub(super) tallies: Vec<ReturnTally>,
    /// The histogram of a fetch argument, when asked for.
    pub(super) histogram: Option<Hist>,
    /// Counted functions whose module was unloaded: their calls until
    /// then, summed over the loads, under their names marked unloaded,
    /// in the order of the address each had when it first went (at most
    /// [`MAX_UNLOADED`]; the calls of further ones are in
    /// `unloaded_other`).
    pub(super) unloaded: BTreeMap<u64, (String, u64)>,
    pub(super) unloaded_other: u64,
    /// The count's module globs (`MOD:GLOB`): they also count the
    /// functions of the modules that load later (as the function tracer's
    /// do).
    pub(super) globs: Vec<String>,
    /// The gate session (`CountFilter::gate`): the count's sites are quiet
    /// where that session's tasks do not run.
    pub(super) gate: Option<u8>,
}

/// What the timed returns of one counted function add up to.
pub(super) struct ReturnTally {
    /// The function's address.
    pub(super) func: u64,
    /// Returns of an errno (-4095..-1 as a `long`).
    pub(super) errors: AtomicU64,
    /// Their durations, summed (ns).
    pub(super) ns: AtomicU64,
}

/// Whether a function's return value is an errno, as the kernel's
/// `IS_ERR_VALUE` sees one.
pub fn is_errno(retval: u64) -> bool {
    (-4095..0).contains(&(retval as i64))
}

/// Unloaded functions a count keeps by name.
pub const MAX_UNLOADED: usize = 4096;

/// What the name of a counted function whose module went ends with.
pub const UNLOADED_MARK: &str = " (unloaded)";

/// The log2 bucket of a duration: 0 for 0 ns, N for 2^(N-1) to 2^N - 1,
/// the last one from 2^62 up.
pub fn latency_bucket(ns: u64) -> usize {
    ((u64::BITS - ns.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

impl Default for CountState {
    fn default() -> Self {
        CountState {
            on: false,
            pid: None,
            comm: None,
            functions: 0,
            started_ns: 0,
            filtered: AtomicU64::new(0),
            names: Vec::new(),
            latency: false,
            times: core::array::from_fn(|_| AtomicU64::new(0)),
            missed: AtomicU64::new(0),
            tallies: Vec::new(),
            histogram: None,
            unloaded: BTreeMap::new(),
            unloaded_other: 0,
            globs: Vec::new(),
            gate: None,
        }
    }
}

impl CountState {
    /// A loading module's function that a module glob of the count names:
    /// counted (and timed, with latency) from its first call on.
    pub(super) fn follow(&mut self, u: &mut super::split::SiteUse) {
        if !self.on {
            return;
        }
        // The count has no list to grow: it always joins.
        let _ = u.users.join(User::Count);
        if self.latency && u.users.join(User::CountTiming).is_err() {
            self.missed.fetch_add(1, Relaxed);
        }
        self.functions += 1;
    }

    /// The counted function at `func` (site `site`) is going with its
    /// module after `calls` calls: the count keeps them under its name,
    /// marked unloaded (a later function at the same address is another
    /// one). Allocates only when the heap has `room` for a name; without
    /// it, or past [`MAX_UNLOADED`], the calls are kept without a name.
    pub(super) fn unloaded(
        &mut self,
        k: &dyn KernelView,
        func: Gva,
        site: Gva,
        calls: u64,
        room: bool,
    ) {
        if !self.on {
            return;
        }
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
        let name = room.then(|| {
            let mut n = name_of(&syms, func, site);
            n.push_str(UNLOADED_MARK);
            n
        });
        let Some(name) = name else {
            self.unloaded_other = self.unloaded_other.saturating_add(calls);
            return;
        };
        // The same function of an earlier load (elsewhere, perhaps).
        if let Some(e) = self.unloaded.values_mut().find(|e| e.0 == name) {
            e.1 = e.1.saturating_add(calls);
            return;
        }
        let free = self.unloaded.len() < MAX_UNLOADED && !self.unloaded.contains_key(&func.0);
        if free {
            self.unloaded.insert(func.0, (name, calls));
        } else {
            self.unloaded_other = self.unloaded_other.saturating_add(calls);
        }
    }

    /// The session bit (1 << N) of the count's gate, 0 without one.
    pub(super) fn gate_bit(&self) -> u16 {
        self.gate.map_or(0, super::users::graph_bit)
    }

    /// Whether the filter needs the running task.
    pub(super) fn filters(&self) -> bool {
        self.pid.is_some() || self.comm.is_some()
    }

    /// A timed call of `func` by (`pid`, `comm`) returned `retval` after
    /// `ns`.
    pub(super) fn returned(&self, pid: i32, comm: &[u8; 16], func: u64, retval: u64, ns: u64) {
        if self.latency && self.admits(pid, comm) {
            if let Some(b) = self.times.get(latency_bucket(ns)) {
                b.fetch_add(1, Relaxed);
            }
            if let Some(t) = self.tally(func) {
                t.errors.fetch_add(u64::from(is_errno(retval)), Relaxed);
                t.ns.fetch_add(ns, Relaxed);
            }
        }
    }

    /// A call whose return could not be hijacked, with its return probes'
    /// ids.
    pub(super) fn not_timed(&self, ids: &[u64]) {
        if ids.contains(&LATENCY_ID) {
            self.missed.fetch_add(1, Relaxed);
        }
    }

    /// Whether a call by (`pid`, `comm`) is counted.
    pub(super) fn admits(&self, pid: i32, comm: &[u8; 16]) -> bool {
        super::fgraph::task_admitted(self.pid, self.comm.as_deref(), pid, comm)
    }

    /// The tally of counted function `func`, when it has one.
    fn tally(&self, func: u64) -> Option<&ReturnTally> {
        let i = self.tallies.binary_search_by_key(&func, |t| t.func).ok()?;
        self.tallies.get(i)
    }
}

impl Tracer<'_> {
    /// `CountStart`: hooks every traceable function matching the globs
    /// and counts their calls from now on.
    pub fn count_start(
        &mut self,
        filter: &CountFilter,
        k: &dyn KernelView,
        env: &mut Env<'_>,
        now_ns: u64,
    ) -> Result<FunctionsAdded, ReqError> {
        if self.vm.count.on {
            return Err(ReqError::new(
                ErrorKind::AlreadyExists,
                "a count runs already; stop it first",
            ));
        }
        let gate = match filter.gate {
            None => None,
            Some(n) => Some(self.gating_session(n)?.0),
        };
        let histogram = match &filter.hist {
            Some(h) if filter.functions.is_empty() => Some(hist_of(h, k, env)?),
            Some(_) => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    "a histogram counts its probe's function: give no globs with it",
                ))
            }
            None => None,
        };
        let spec_glob;
        let globs: Vec<&str> = match &histogram {
            Some(h) => {
                spec_glob = match &h.spec.module {
                    Some(m) => format!("{m}:{}", h.spec.symbol),
                    None => h.spec.symbol.clone(),
                };
                alloc::vec![spec_glob.as_str()]
            }
            None => filter.functions.iter().map(String::as_str).collect(),
        };
        if globs.is_empty() || globs.len() > MAX_COUNT_GLOBS {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                format!("a count takes 1 to {MAX_COUNT_GLOBS} globs"),
            ));
        }
        for g in &globs {
            symbols::check_glob(g).map_err(|e| ReqError::new(ErrorKind::InvalidArgument, e))?;
        }
        let comm = match &filter.comm {
            Some(c) if c.is_empty() || c.len() > 15 || c.contains('\0') => {
                return Err(ReqError::new(
                    ErrorKind::InvalidArgument,
                    "a comm is 1 to 15 bytes, without NUL",
                ))
            }
            Some(c) => Some(
                fallible::try_string(c)
                    .map_err(|e| super::out_of_memory(env, "the count's comm", e))?
                    .into_bytes(),
            ),
            None => None,
        };
        let matches = self.traceable_matches(&globs, k, env)?;
        // Counters start at zero: a site counted before (and still hooked
        // for another use) starts again.
        // The name that matched, for each function of the kernel image:
        // of several aliases at one address, the user's.
        let mut names = Vec::new();
        let mut tallies = Vec::new();
        let mut untimed = 0u32;
        let latency = filter.latency;
        let added = self.hook_matches(matches, k, env, |u, id| {
            let _ = u.users.join(User::Count);
            if latency && u.users.join(User::CountTiming).is_err() {
                untimed += 1;
            }
            if latency {
                let t = ReturnTally {
                    func: u.func.0,
                    errors: AtomicU64::new(0),
                    ns: AtomicU64::new(0),
                };
                // Without room the function is timed in the histogram only.
                let _ = fallible::try_push(&mut tallies, t);
            }
            if let symbols::SymRef::Core(id) = id {
                // Without room the name is looked up by address instead.
                let _ = fallible::try_push(&mut names, (u.func.0, id));
            }
        })?;
        names.sort_unstable_by_key(|&(a, _)| a);
        tallies.sort_unstable_by_key(|t| t.func);
        tallies.dedup_by_key(|t| t.func);
        let c = &mut self.vm.count;
        c.on = true;
        c.pid = filter.pid;
        c.comm = comm;
        c.functions = added.traced;
        c.started_ns = now_ns;
        c.names = names;
        c.tallies = tallies;
        c.gate = gate;
        c.latency = latency;
        c.histogram = histogram;
        // Module globs follow the modules' loads (a histogram's function
        // does not: its probe is resolved once).
        let mut module_globs = Vec::new();
        if c.histogram.is_none() {
            for g in filter
                .functions
                .iter()
                .filter(|g| symbols::module_glob(g).is_some())
            {
                if fallible::try_string(g)
                    .and_then(|g| fallible::try_push(&mut module_globs, g))
                    .is_err()
                {
                    log::warn!("tracer: the count does not follow {g}: out of memory");
                }
            }
        }
        c.globs = module_globs;
        if !self.vm.count.globs.is_empty() {
            if let Err(e) = self.ensure_module_hooks(k, env, true) {
                log::warn!(
                    "tracer: the count does not follow module loads: {}",
                    e.message
                );
                self.vm.count.globs.clear();
            }
        }
        let c = &mut self.vm.count;
        if untimed > 0 {
            log::warn!("tracer: {untimed} counted functions are not timed: out of memory");
        }
        c.filtered = AtomicU64::new(0);
        log::info!(
            "tracer: counting {} functions ({} skipped)",
            added.traced,
            added.skipped_total
        );
        Ok(added)
    }

    /// `CountRead`: the functions called at least once from `cursor` on,
    /// in address order, up to `limit` and a frame's worth of names.
    pub fn count_read(
        &self,
        cursor: u64,
        limit: u32,
        k: &dyn KernelView,
        now_ns: u64,
    ) -> Result<CountPage, ReqError> {
        let c = &self.vm.count;
        if !c.on {
            return Err(ReqError::new(ErrorKind::NotFound, "no count runs"));
        }
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
        let mut entries = Vec::new();
        let mut calls = 0u64;
        let mut counted = 0u64;
        let mut bytes = 0usize;
        let mut next = None;
        // The live counted sites and the functions whose module went, one
        // sequence in address order (a site's function is just below it).
        let live = self
            .vm
            .view
            .sites
            .iter()
            .filter(|(_, u)| u.users.has(User::Count))
            .map(|(&site, u)| (u.func.0, Counted::Live(site, u)));
        let gone = c
            .unloaded
            .iter()
            .map(|(&func, (name, n))| (func, Counted::Gone(name, *n)));
        let mut live = live.peekable();
        let mut gone = gone.peekable();
        let merged = core::iter::from_fn(|| match (live.peek(), gone.peek()) {
            (Some(l), Some(g)) if l.0 > g.0 => gone.next(),
            (Some(_), _) => live.next(),
            (None, _) => gone.next(),
        });
        calls = calls.saturating_add(c.unloaded_other);
        for (func, entry) in merged {
            let n = match entry {
                Counted::Live(_, u) => {
                    counted += 1;
                    u.users.calls().load(Relaxed)
                }
                Counted::Gone(_, n) => n,
            };
            calls += n;
            if n == 0 || func < cursor || next.is_some() {
                continue;
            }
            let name = match entry {
                Counted::Gone(name, _) => match fallible::try_string(name) {
                    Ok(n) => n,
                    Err(_) => {
                        next = Some(func);
                        continue;
                    }
                },
                Counted::Live(site, u) => {
                    let matched = c
                        .names
                        .binary_search_by_key(&u.func.0, |&(a, _)| a)
                        .ok()
                        .and_then(|i| c.names.get(i));
                    match matched {
                        Some(&(_, id)) => k.index().name(id),
                        None => name_of(&syms, u.func, site),
                    }
                }
            };
            if entries.len() >= limit.max(1) as usize || bytes + name.len() > PAGE_BUDGET {
                next = Some(func);
                continue;
            }
            bytes += name.len() + 24;
            let (errors, total_ns) = c
                .tally(func)
                .map_or((0, 0), |t| (t.errors.load(Relaxed), t.ns.load(Relaxed)));
            let entry = FunctionCount {
                name,
                addr: func,
                calls: n,
                errors,
                total_ns,
            };
            if fallible::try_push(&mut entries, entry).is_err() {
                next = Some(func);
            }
        }
        let mut latency = Vec::new();
        if c.latency {
            let used = c
                .times
                .iter()
                .rposition(|b| b.load(Relaxed) != 0)
                .map_or(0, |i| i + 1);
            latency = fallible::try_collect(c.times.iter().take(used).map(|b| b.load(Relaxed)))
                .map_err(|_| {
                    ReqError::new(ErrorKind::OutOfResources, "no memory for the histogram")
                })?;
        }
        Ok(CountPage {
            latency,
            latency_missed: c.missed.load(Relaxed),
            functions: c.functions,
            calls,
            filtered: c.filtered.load(Relaxed),
            elapsed_ns: now_ns.saturating_sub(c.started_ns),
            memory: counted * super::split::SITE_BYTES as u64
                + (c.names.capacity() * core::mem::size_of::<(u64, SymbolId)>()) as u64
                + (c.tallies.capacity() * core::mem::size_of::<ReturnTally>()) as u64,
            entries,
            next,
        })
    }

    /// `HistRead`: the histogram's rows from `cursor` on.
    pub fn hist_read(&self, cursor: u32, k: &dyn KernelView) -> Result<HistPage, ReqError> {
        let Some(h) = self.vm.count.histogram.as_ref() else {
            return Err(ReqError::new(ErrorKind::NotFound, "no histogram runs"));
        };
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
        let slots = h.rows.lock();
        let mut rows = Vec::new();
        let mut bytes = 0;
        let mut next = None;
        for (i, slot) in slots.iter().enumerate().skip(cursor as usize) {
            let key = match h.key {
                HistKey::Comm => {
                    let name = slot.key.split(|&b| b == 0).next().unwrap_or(&slot.key);
                    String::from_utf8_lossy(name).into_owned()
                }
                HistKey::Pid => {
                    let mut p = [0u8; 4];
                    p.copy_from_slice(slot.key.get(..4).unwrap_or(&[0; 4]));
                    format!("{}", i32::from_le_bytes(p))
                }
                _ => {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(slot.key.get(..8).unwrap_or(&[0; 8]));
                    let func = u64::from_le_bytes(a);
                    name_of(&syms, Gva(func), Gva(func))
                }
            };
            let used = slot
                .buckets
                .iter()
                .rposition(|&n| n != 0)
                .map_or(0, |i| i + 1);
            let size = key.len() + used * 10 + 8;
            if !rows.is_empty() && bytes + size > HIST_PAGE_BUDGET {
                next = Some(i as u32);
                break;
            }
            bytes += size;
            let buckets = fallible::try_collect(slot.buckets.iter().take(used).copied());
            match buckets.and_then(|b| fallible::try_push(&mut rows, HistRow { key, buckets: b })) {
                Ok(()) => {}
                Err(_) => {
                    return Err(ReqError::new(
                        ErrorKind::OutOfResources,
                        "no memory for the histogram's page",
                    ))
                }
            }
        }
        Ok(HistPage {
            rows,
            next,
            overflow: h.overflow.load(Relaxed),
            faults: h.faults.load(Relaxed),
            max_keys: HIST_KEYS as u32,
        })
    }

    /// `CountStop`: unhooks what only the count used.
    pub fn count_stop(&mut self, env: &mut Env<'_>) -> Result<(), ReqError> {
        if !self.vm.count.on {
            return Err(ReqError::new(ErrorKind::NotFound, "no count runs"));
        }
        super::stop_others(env)?;
        self.vm
            .view
            .release(env, |u| u.leave(User::Count) | u.leave(User::CountTiming));
        self.vm.count = CountState::default();
        self.release_module_hooks_if_idle(env);
        Ok(())
    }
}

/// The histogram of `h`: its spec parsed (an entry probe with a fetch
/// argument), its `@SYM` bases resolved, the room for its rows reserved.
fn hist_of(h: &HistFilter, k: &dyn KernelView, env: &mut Env<'_>) -> Result<Hist, ReqError> {
    let bad = |m: String| ReqError::new(ErrorKind::InvalidArgument, m);
    let mut spec = match kprobe::parse(&h.spec) {
        Ok(Command::Add(s)) => s,
        Ok(Command::Delete(_)) => {
            return Err(bad("a histogram needs a probe, not a delete".into()))
        }
        Err(e) => return Err(bad(format!("{e}"))),
    };
    if spec.kind.is_return() {
        return Err(bad(
            "a histogram takes an entry probe (p), not a return probe".into(),
        ));
    }
    super::btf_args::resolve(&mut spec, &h.spec, k, env)?;
    if spec.args.is_empty() {
        return Err(bad(
            "a histogram needs a fetch argument in its probe (p vfs_read count=%dx:u64)".into(),
        ));
    }
    if let Some(first) = spec.args.first() {
        if matches!(
            first.ty,
            kprobe::ArgType::String | kprobe::ArgType::UString | kprobe::ArgType::SymStr
        ) {
            return Err(bad(format!(
                "a histogram buckets a number: the first fetch argument {}={} is a string",
                first.name, first.body
            )));
        }
    }
    symbols::resolve_fetch_symbols(&mut spec, k)?;
    let mut rows = Vec::new();
    fallible::try_reserve(&mut rows, HIST_KEYS)
        .map_err(|e| super::out_of_memory(env, "the histogram's rows", e))?;
    Ok(Hist {
        spec,
        key: h.key,
        rows: spin::Mutex::new(rows),
        overflow: AtomicU64::new(0),
        faults: AtomicU64::new(0),
    })
}

/// `name` or `name [module]` of the function at `func`.
fn name_of(syms: &IndexSymbols<'_>, func: Gva, site: Gva) -> String {
    match syms.symbolize(func) {
        Some(at) => match at.module {
            Some(m) => format!("{} [{}]", at.name, m),
            None => String::from(at.name),
        },
        None => format!("{:#x}", site.0),
    }
}
