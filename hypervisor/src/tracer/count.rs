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
use super::{FunctionsAdded, ReqError, Tracer};
use crate::addr::Gva;
use crate::kprobe::{IndexSymbols, SymbolResolver};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use guest_introspect::fallible;
use guest_introspect::kallsyms::SymbolId;
use protocol::{CountFilter, ErrorKind, FunctionCount};

/// Most globs a count takes.
pub const MAX_COUNT_GLOBS: usize = 32;
/// Name bytes per `Counts` answer, so that a page fits one frame.
const PAGE_BUDGET: usize = 2800;

/// The running count.
#[derive(Default)]
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
}

impl CountState {
    /// Whether the filter needs the running task.
    pub(super) fn filters(&self) -> bool {
        self.pid.is_some() || self.comm.is_some()
    }

    /// Whether a call by (`pid`, `comm`) is counted.
    pub(super) fn admits(&self, pid: i32, comm: &[u8; 16]) -> bool {
        let pid_ok = self.pid.is_none_or(|p| p == pid);
        let comm_ok = self.comm.as_deref().is_none_or(|c| {
            // The name ends at the first NUL, or fills the array.
            let name = comm.split(|&b| b == 0).next().unwrap_or(comm);
            c == name
        });
        pid_ok && comm_ok
    }
}

/// One page of counts.
pub struct CountPage {
    pub functions: u32,
    pub calls: u64,
    pub filtered: u64,
    pub elapsed_ns: u64,
    pub memory: u64,
    pub entries: Vec<FunctionCount>,
    pub next: Option<u64>,
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
        if filter.functions.is_empty() || filter.functions.len() > MAX_COUNT_GLOBS {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                format!("a count takes 1 to {MAX_COUNT_GLOBS} globs"),
            ));
        }
        for g in &filter.functions {
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
        let globs: Vec<&str> = filter.functions.iter().map(String::as_str).collect();
        let matches = self.traceable_matches(&globs, k, env)?;
        // Counters start at zero: a site counted before (and still hooked
        // for another use) starts again.
        // The name that matched, for each function of the kernel image:
        // of several aliases at one address, the user's.
        let mut names = Vec::new();
        let added = self.hook_matches(matches, k, env, |u, id| {
            u.counted = true;
            u.calls.store(0, Relaxed);
            if let symbols::SymRef::Core(id) = id {
                // Without room the name is looked up by address instead.
                let _ = fallible::try_push(&mut names, (u.func.0, id));
            }
        })?;
        names.sort_unstable_by_key(|&(a, _)| a);
        let c = &mut self.vm.count;
        c.on = true;
        c.pid = filter.pid;
        c.comm = comm;
        c.functions = added.traced;
        c.started_ns = now_ns;
        c.names = names;
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
        for (&site, u) in &self.vm.view.sites {
            if !u.counted {
                continue;
            }
            counted += 1;
            let n = u.calls.load(Relaxed);
            calls += n;
            if n == 0 || u.func.0 < cursor || next.is_some() {
                continue;
            }
            let matched = c
                .names
                .binary_search_by_key(&u.func.0, |&(a, _)| a)
                .ok()
                .and_then(|i| c.names.get(i));
            let name = match matched {
                Some(&(_, id)) => k.index().name(id),
                None => name_of(&syms, u.func, site),
            };
            if entries.len() >= limit.max(1) as usize || bytes + name.len() > PAGE_BUDGET {
                next = Some(u.func.0);
                continue;
            }
            bytes += name.len() + 24;
            let entry = FunctionCount {
                name,
                addr: u.func.0,
                calls: n,
            };
            if fallible::try_push(&mut entries, entry).is_err() {
                next = Some(u.func.0);
            }
        }
        Ok(CountPage {
            functions: c.functions,
            calls,
            filtered: c.filtered.load(Relaxed),
            elapsed_ns: now_ns.saturating_sub(c.started_ns),
            memory: counted * super::split::SITE_BYTES as u64
                + (c.names.capacity() * core::mem::size_of::<(u64, SymbolId)>()) as u64,
            entries,
            next,
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
            .release(env, |u| core::mem::take(&mut u.counted));
        self.vm.count = CountState::default();
        self.release_module_hooks_if_idle(env);
        Ok(())
    }
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
