//! Who uses a hooked site: a typed set of users, in the way ftrace keeps,
//! behind each of its records, the `ftrace_ops` that want the function.
//!
//! Every feature joins a site with [`Users::join`] and leaves it with
//! [`Users::leave`], and keeps here what it needs per site (the count its
//! calls, the return probes the words their frames carry). The site
//! registry ([`super::split`]) never names a feature: it asks only whether
//! a site has users left. The entry handler ([`super::hit`]) and a
//! module's unload ([`super::modules`]) walk a site's users in
//! [`Users::iter`]'s order and dispatch on each.

use crate::addr::Gva;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use guest_introspect::fallible::{self, OutOfMemory};

/// The id a count with latency puts among a site's return probes: outside
/// every probe's (`u32`) id, so that the return-probe path skips it, and
/// the return hijack times the call for the count instead.
pub(super) const LATENCY_ID: u64 = 1 << 32;

/// Which of the kernel's module functions a hidden hook is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleHook {
    /// `do_init_module`: a module is about to run its init.
    Load,
    /// `free_module`: a module's memory is about to be freed.
    Unload,
    /// `module_arch_freeing_init`: a module's init has returned and its
    /// init text is about to go (freed later, from a work item).
    InitFreeing,
}

impl ModuleHook {
    /// The kernel function hooked.
    pub fn function(self) -> &'static str {
        match self {
            ModuleHook::Load => "do_init_module",
            ModuleHook::Unload => "free_module",
            ModuleHook::InitFreeing => "module_arch_freeing_init",
        }
    }
}

/// Root's own hooks on the scheduler and on tasks: those that pick a
/// vCPU's view, and the wakeups' events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwitchHook {
    /// The scheduler's `finish_task_switch`, which runs on the incoming
    /// task after every switch (compilers may name it with a suffix,
    /// `finish_task_switch.isra.0`): views, and `sched_switch` events.
    Schedule,
    /// `__set_task_comm`, which renames a task (at exec among others): a
    /// comm filter may admit it under its new name, or no longer.
    Comm,
    /// `try_to_wake_up(p, state, flags)`: `sched_wakeup` events.
    Wakeup,
}

impl SwitchHook {
    /// The kernel function hooked.
    pub fn function(self) -> &'static str {
        match self {
            SwitchHook::Schedule => "finish_task_switch",
            SwitchHook::Comm => "__set_task_comm",
            SwitchHook::Wakeup => "try_to_wake_up",
        }
    }
}

/// Graph sessions are numbered 1 to this (bit N of a mask: session N).
pub(super) const MAX_GRAPH_SESSION: u8 = 15;

/// One user of a hooked site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum User {
    /// Root's own hook that picks the vCPU's view (the scheduler's switch
    /// path, a task's change of name).
    Switch(SwitchHook),
    /// Root's own hook on the kernel's module code.
    Module(ModuleHook),
    /// The call count.
    Count,
    /// An entry probe, by id.
    Probe(u32),
    /// The function tracer.
    Function,
    /// A function-graph session, by number (1 to [`MAX_GRAPH_SESSION`]).
    Graph(u8),
    /// A return probe, by id.
    ReturnProbe(u32),
    /// The count's timing of each call, from its entry to its return.
    CountTiming,
}

/// The users of one hooked site, and what each keeps for it.
#[derive(Debug, Default)]
pub(super) struct Users {
    switch: Option<SwitchHook>,
    module: Option<ModuleHook>,
    count: bool,
    /// The count's calls here since it started (hits take the VM shared,
    /// so atomic).
    calls: AtomicU64,
    probes: Vec<u32>,
    function: bool,
    /// Bit N: graph session N.
    graph: u16,
    /// What the return hook's frame carries: return probe ids, and
    /// [`LATENCY_ID`] for the count's timing.
    returns: Vec<u64>,
}

/// The bit of graph session `n` in a mask, or 0 for a number out of range.
pub(super) fn graph_bit(n: u8) -> u16 {
    if (1..=MAX_GRAPH_SESSION).contains(&n) {
        1 << n
    } else {
        0
    }
}

impl Users {
    /// Adds `user`; whether it is new here. The count starts its calls
    /// here again from zero (a count that starts counts from its start).
    /// An error only when a list has no room for one more id.
    pub(super) fn join(&mut self, user: User) -> Result<bool, OutOfMemory> {
        Ok(match user {
            User::Switch(h) => self.switch.replace(h) != Some(h),
            User::Module(h) => self.module.replace(h) != Some(h),
            User::Count => {
                self.calls.store(0, Relaxed);
                !core::mem::replace(&mut self.count, true)
            }
            User::Probe(id) => push_new(&mut self.probes, id)?,
            User::Function => !core::mem::replace(&mut self.function, true),
            User::Graph(n) => {
                let bit = graph_bit(n);
                let new = bit != 0 && self.graph & bit == 0;
                self.graph |= bit;
                new
            }
            User::ReturnProbe(id) => push_new(&mut self.returns, u64::from(id))?,
            User::CountTiming => push_new(&mut self.returns, LATENCY_ID)?,
        })
    }

    /// Takes `user` off; whether it was here.
    pub(super) fn leave(&mut self, user: User) -> bool {
        match user {
            User::Switch(h) => take_if(&mut self.switch, h),
            User::Module(h) => take_if(&mut self.module, h),
            User::Count => core::mem::take(&mut self.count),
            User::Probe(id) => remove(&mut self.probes, id),
            User::Function => core::mem::take(&mut self.function),
            User::Graph(n) => {
                let bit = graph_bit(n);
                let had = self.graph & bit != 0;
                self.graph &= !bit;
                had
            }
            User::ReturnProbe(id) => remove(&mut self.returns, u64::from(id)),
            User::CountTiming => remove(&mut self.returns, LATENCY_ID),
        }
    }

    /// Takes every graph session of `mask` (bit N: session N) off; whether
    /// one was here.
    pub(super) fn leave_graphs(&mut self, mask: u16) -> bool {
        let had = self.graph & mask != 0;
        self.graph &= !mask;
        had
    }

    /// Whether `user` is here.
    #[inline]
    pub(super) fn has(&self, user: User) -> bool {
        match user {
            User::Switch(h) => self.switch == Some(h),
            User::Module(h) => self.module == Some(h),
            User::Count => self.count,
            User::Probe(id) => self.probes.contains(&id),
            User::Function => self.function,
            User::Graph(n) => self.graph & graph_bit(n) != 0,
            User::ReturnProbe(id) => self.returns.contains(&u64::from(id)),
            User::CountTiming => self.returns.contains(&LATENCY_ID),
        }
    }

    /// The users, in the order the entry handler serves them: root's view
    /// hook, root's module hook, the count, the entry probes (in the order
    /// they joined), the function tracer, then what the return hook
    /// serves (graph sessions, return probes, the count's timing).
    pub(super) fn iter(&self) -> UsersIter<'_> {
        UsersIter {
            users: self,
            stage: Stage::Switch,
            at: 0,
            graphs: self.graph,
        }
    }

    /// No user at all: the site may be unhooked.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.switch.is_none() && self.module.is_none() && self.graph == 0 && self.only_root_views()
    }

    /// No user but, maybe, root's view hook and the graph sessions: no
    /// probe, return probe, function tracer, module hook or count.
    #[inline]
    fn only_root_views(&self) -> bool {
        self.probes.is_empty()
            && self.returns.is_empty()
            && !self.function
            && self.module.is_none()
            && !self.count
    }

    /// Whether root's view hook is all the site is for.
    #[inline]
    pub(super) fn only_switch(&self) -> bool {
        self.switch.is_some() && self.only_root_views() && self.graph == 0
    }

    /// Whether every user is one the entry fast path serves
    /// (`Hit::fast_entry`): the count with no timing of its calls, entry
    /// probes, the function tracer; and at least one of them.
    #[inline]
    pub(super) fn fast(&self) -> bool {
        (self.count || !self.probes.is_empty() || self.function)
            && self.returns.is_empty()
            && self.graph == 0
            && self.module.is_none()
            && self.switch.is_none()
    }

    /// Whether the site matters only beneath a root of the sessions in
    /// `rooted` (bit N: session N has roots, or filters the tasks), and is
    /// not such a root itself (`is_root` of the sessions and the site's
    /// function `func`): its graph sessions are among them, and so are the
    /// gates of its probes and return probes (`gate_of`: a probe's session
    /// bit, 0 when it records for every task). Then the quiet view need
    /// not hook it.
    pub(super) fn quiet_ok(
        &self,
        rooted: u16,
        func: Gva,
        is_root: impl Fn(u16, Gva) -> bool,
        gate_of: impl Fn(u32) -> u16,
        count_gate: u16,
    ) -> bool {
        let behind = |bit: u16| bit != 0 && bit & !rooted == 0;
        // The count's timing word is no probe's id: its gate is the count's.
        let returns_gated = self.returns.iter().all(|&w| {
            if w == LATENCY_ID {
                behind(count_gate)
            } else {
                u32::try_from(w).is_ok_and(|id| behind(gate_of(id)))
            }
        });
        (self.graph != 0 || !self.probes.is_empty() || !self.returns.is_empty() || self.count)
            && self.graph & !rooted == 0
            && self.probes.iter().all(|&id| behind(gate_of(id)))
            && returns_gated
            && (!self.count || behind(count_gate))
            && !self.function
            && self.module.is_none()
            && self.switch.is_none()
            && !is_root(self.graph, func)
    }

    /// Whether a user records events at entry or at return: an entry
    /// probe, the function tracer, a graph session or a return hook.
    #[inline]
    pub(super) fn records(&self) -> bool {
        !self.probes.is_empty() || self.function || self.graph != 0 || !self.returns.is_empty()
    }

    /// Whether a user other than the count's timing wants the return.
    #[inline]
    pub(super) fn returns_beyond_timing(&self) -> bool {
        self.graph != 0 || self.returns.iter().any(|&w| w != LATENCY_ID)
    }

    /// The entry probes' ids, in the order they joined.
    #[inline]
    pub(super) fn probes(&self) -> &[u32] {
        &self.probes
    }

    /// The words the return hook's frame carries (return probe ids, the
    /// count's timing).
    #[inline]
    pub(super) fn returns(&self) -> &[u64] {
        &self.returns
    }

    /// The graph sessions (bit N: session N).
    #[inline]
    pub(super) fn graphs(&self) -> u16 {
        self.graph
    }

    /// Root's view hook here, if any.
    #[inline]
    pub(super) fn switch(&self) -> Option<SwitchHook> {
        self.switch
    }

    /// Root's module hook here, if any.
    #[inline]
    pub(super) fn module(&self) -> Option<ModuleHook> {
        self.module
    }

    /// The count's calls here: its own per-site counter.
    #[inline]
    pub(super) fn calls(&self) -> &AtomicU64 {
        &self.calls
    }
}

/// Where [`UsersIter`] is in [`Users::iter`]'s order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Switch,
    Module,
    Count,
    Probes,
    Function,
    Graphs,
    Returns,
    Done,
}

/// The users of a site in [`Users::iter`]'s order: a state machine over
/// the set's parts, each looked at once (the hit path walks it).
pub(super) struct UsersIter<'a> {
    users: &'a Users,
    stage: Stage,
    /// The index in the current list (probes, return words).
    at: usize,
    /// Graph sessions not yielded yet (bit N: session N).
    graphs: u16,
}

impl Iterator for UsersIter<'_> {
    type Item = User;

    #[inline]
    fn next(&mut self) -> Option<User> {
        let u = self.users;
        loop {
            match self.stage {
                Stage::Switch => {
                    self.stage = Stage::Module;
                    if let Some(h) = u.switch {
                        return Some(User::Switch(h));
                    }
                }
                Stage::Module => {
                    self.stage = Stage::Count;
                    if let Some(h) = u.module {
                        return Some(User::Module(h));
                    }
                }
                Stage::Count => {
                    self.stage = Stage::Probes;
                    if u.count {
                        return Some(User::Count);
                    }
                }
                Stage::Probes => match u.probes.get(self.at) {
                    Some(&id) => {
                        self.at += 1;
                        return Some(User::Probe(id));
                    }
                    None => {
                        self.at = 0;
                        self.stage = Stage::Function;
                    }
                },
                Stage::Function => {
                    self.stage = Stage::Graphs;
                    if u.function {
                        return Some(User::Function);
                    }
                }
                Stage::Graphs => {
                    // Bit 0 is no session: `join` never sets it.
                    let rest = self.graphs & !1;
                    if rest == 0 {
                        self.stage = Stage::Returns;
                        continue;
                    }
                    let n = rest.trailing_zeros() as u8;
                    self.graphs = rest & !(1 << n);
                    return Some(User::Graph(n));
                }
                Stage::Returns => match u.returns.get(self.at) {
                    Some(&w) => {
                        self.at += 1;
                        return Some(if w == LATENCY_ID {
                            User::CountTiming
                        } else {
                            // Return probe ids are u32: the words were made
                            // from them.
                            User::ReturnProbe(w as u32)
                        });
                    }
                    None => self.stage = Stage::Done,
                },
                Stage::Done => return None,
            }
        }
    }
}

/// Pushes `v` unless it is in `list`; whether it was pushed.
fn push_new<T: PartialEq>(list: &mut Vec<T>, v: T) -> Result<bool, OutOfMemory> {
    if list.contains(&v) {
        return Ok(false);
    }
    fallible::try_push(list, v)?;
    Ok(true)
}

/// Removes every `v` from `list`; whether there was one.
fn remove<T: PartialEq>(list: &mut Vec<T>, v: T) -> bool {
    let before = list.len();
    list.retain(|x| *x != v);
    list.len() != before
}

/// Empties `slot` if it holds `v`; whether it did.
fn take_if<T: PartialEq + Copy>(slot: &mut Option<T>, v: T) -> bool {
    if *slot == Some(v) {
        *slot = None;
        true
    } else {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_join_and_leave_one_at_a_time() {
        let mut u = Users::default();
        assert!(u.is_empty());
        assert!(u.join(User::Probe(3)).unwrap());
        assert!(!u.join(User::Probe(3)).unwrap(), "a probe joins once");
        assert!(u.join(User::Graph(2)).unwrap());
        assert!(!u.join(User::Graph(0)).unwrap(), "session 0 does not exist");
        assert!(!u.join(User::Graph(16)).unwrap(), "nor does session 16");
        assert!(u.join(User::ReturnProbe(3)).unwrap());
        assert!(u.join(User::CountTiming).unwrap());
        assert!(u.join(User::Count).unwrap());
        assert!(u.join(User::Function).unwrap());
        assert!(u.join(User::Module(ModuleHook::Unload)).unwrap());
        assert!(u.join(User::Switch(SwitchHook::Comm)).unwrap());
        assert_eq!(
            u.iter().take(64).collect::<Vec<_>>(),
            [
                User::Switch(SwitchHook::Comm),
                User::Module(ModuleHook::Unload),
                User::Count,
                User::Probe(3),
                User::Function,
                User::Graph(2),
                User::ReturnProbe(3),
                User::CountTiming,
            ]
        );
        assert_eq!(u.returns(), [3, LATENCY_ID]);
        for user in u.iter().take(64).collect::<Vec<_>>() {
            assert!(u.has(user));
            assert!(!u.is_empty(), "{user:?} is still there");
            assert!(u.leave(user), "{user:?} was there");
            assert!(!u.has(user));
            assert!(!u.leave(user), "{user:?} leaves once");
        }
        assert!(u.is_empty());
        assert_eq!(u.iter().count(), 0);
    }

    #[test]
    fn a_hook_leaves_only_as_itself() {
        let mut u = Users::default();
        u.join(User::Module(ModuleHook::Load)).unwrap();
        assert!(!u.leave(User::Module(ModuleHook::Unload)));
        assert!(u.has(User::Module(ModuleHook::Load)));
        u.join(User::Switch(SwitchHook::Schedule)).unwrap();
        assert!(!u.leave(User::Switch(SwitchHook::Comm)));
        assert!(u.leave(User::Switch(SwitchHook::Schedule)));
    }

    #[test]
    fn the_count_restarts_its_calls_when_it_joins() {
        let mut u = Users::default();
        u.join(User::Count).unwrap();
        u.calls().fetch_add(5, Relaxed);
        assert!(!u.join(User::Count).unwrap());
        assert_eq!(u.calls().load(Relaxed), 0);
    }

    #[test]
    fn what_the_fast_path_and_the_quiet_views_see() {
        let mut u = Users::default();
        assert!(!u.fast(), "no user: nothing to serve");
        u.join(User::Count).unwrap();
        assert!(u.fast());
        assert!(!u.records());
        u.join(User::CountTiming).unwrap();
        assert!(!u.fast(), "the timing takes the return");
        assert!(u.records() && !u.returns_beyond_timing());
        u.leave(User::CountTiming);
        u.leave(User::Count);

        u.join(User::Graph(1)).unwrap();
        let not_root = |_: u16, _: Gva| false;
        let open = |_: u32| 0u16;
        assert!(u.quiet_ok(1 << 1, Gva(0x1000), not_root, open, 0));
        assert!(
            !u.quiet_ok(0, Gva(0x1000), not_root, open, 0),
            "session 1 has no roots"
        );
        assert!(
            !u.quiet_ok(1 << 1, Gva(0x1000), |_, _| true, open, 0),
            "a root itself"
        );
        // Probes: quiet only behind a quiet session's gate.
        u.join(User::Probe(7)).unwrap();
        u.join(User::ReturnProbe(7)).unwrap();
        assert!(!u.quiet_ok(1 << 1, Gva(0x1000), not_root, open, 0), "open");
        let behind_2 = |id: u32| if id == 7 { 1 << 2 } else { 0 };
        assert!(!u.quiet_ok(1 << 1, Gva(0x1000), not_root, behind_2, 0));
        assert!(u.quiet_ok(1 << 1 | 1 << 2, Gva(0x1000), not_root, behind_2, 0));
        u.leave(User::Graph(1));
        assert!(
            u.quiet_ok(1 << 2, Gva(0x1000), not_root, behind_2, 0),
            "probes alone"
        );
        u.join(User::CountTiming).unwrap();
        assert!(
            u.quiet_ok(1 << 2, Gva(0x1000), not_root, behind_2, 1 << 2),
            "a count's timing behind the same gate"
        );
        assert!(
            !u.quiet_ok(1 << 2, Gva(0x1000), not_root, behind_2, 0),
            "a count's timing"
        );
        u.leave(User::CountTiming);
        u.leave(User::Probe(7));
        u.leave(User::ReturnProbe(7));
        u.join(User::Graph(1)).unwrap();
        u.join(User::Switch(SwitchHook::Schedule)).unwrap();
        assert!(!u.quiet_ok(1 << 1, Gva(0x1000), not_root, open, 0));
        assert!(!u.only_switch(), "a session uses it too");
        assert!(u.leave_graphs(1 << 1 | 1 << 3));
        assert!(u.only_switch());
        assert!(!u.leave_graphs(1 << 1));
    }
}
