//! The function-graph tracer's state: the sessions (numbered 1 to 15,
//! each with its filter, roots and renderer), the return stacks keyed by
//! guest kernel stack, their owners, and the generations that tell a
//! session's events from those of an earlier session with its number.
//! Shared by every vCPU: a task that sleeps in a traced function on one
//! CPU and wakes on another pops its frames from the same stack.
//!
//! # Locking
//!
//! The sessions, generations and frame size change only through
//! `&mut Graph` (a request, with no hit in flight), and hits read them
//! freely. What hits change, the return stacks with their owners and the
//! map of the guest's stacks, is in [`Stacks`] behind a spin lock of its
//! own, held only for the map and frame work of one entry or return:
//! never across a read or write of guest memory. An entry takes it twice
//! (to decide, then to push, with the read of the return slot between);
//! in between no other vCPU can change that stack, for a guest kernel
//! stack is only ever used by the one CPU running on it.

use super::count::{CountState, LATENCY_ID};
use super::hit_stats::{add, HitStats};
use super::machine::{CpuView, Env, KernelView, Running};
use super::probes::{store_parts, HitSink, Probes, VcpuMem};
use super::retstack::{PopResult, PushError, RetStack, MAX_USERS};
use super::ring::EventRing;
use super::split::in_hypervisor;
use crate::addr::Gva;
use crate::vmx::regs::GuestRegs;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use guest_introspect::fallible::{self, btree_entry_bytes};
use guest_introspect::paging::{self, Cr3};
use guest_introspect::stacks::StackMap;
use protocol::{GraphFilter, TracerReport};
use tracelang::graph::{GraphEventId, GraphKind, GraphText};
use tracelang::kprobe::{self, EventHeader, FetchContext, GuestLayout, IndexSymbols};
use trampolines::ptregs::{KERNEL_CS, KERNEL_SS};
use trampolines::PtRegs;

/// The return-stack user of return probes; graph sessions are users 1..15.
pub(super) const RETPROBE_USER: u8 = 0;
/// Arguments a return probe's entry saves: di, si, dx, cx, r8, r9.
pub(super) const ENTRY_ARGS: usize = 6;
/// Words of the return probes' block at most: ids, the mark, and the
/// saved arguments (more ids than fit save no arguments: those probes'
/// entry arguments then fault).
const RETPROBE_BLOCK: usize = 64;
/// Separates the return probes' ids from the arguments saved at the entry
/// (no id is this large: ids are 32-bit, and the count's latency id is
/// 1 << 32).
const ENTRY_MARK: u64 = u64::from_le_bytes(*b"entryarg");
/// A generation no event carries (generations are 4 bits).
const RETIRED_GEN: u8 = 0xff;
/// The first word of a session's data block on a frame of one of its
/// `set_graph_notrace` functions: nothing beneath it is traced for the
/// session, and the frame's own return is silent.
const NOTRACE_MARK: u64 = u64::from_le_bytes(*b"notrace\0");
/// `Graph::map_read_ns` before the map of the guest's stacks is first read.
const NEVER: u64 = u64::MAX;
/// How often the map of the guest's stacks is read again (a CPU brought
/// up later gets its IRQ and exception stacks then).
const STACK_MAP_EVERY_NS: u64 = 1_000_000_000;
/// Frames per return stack by default: 32 frames without data (5 words
/// each), 1280 B.
pub(super) const STACK_FRAMES: u32 = 32;
/// Most frames a session may ask for per stack.
pub(super) const MAX_STACK_FRAMES: u32 = 256;
/// Words of a frame without data: the frame and its tag.
const FRAME_TAGGED: usize = super::retstack::FRAME_WORDS + 1;
/// Kernel stacks tracked at most; calls on more are not hijacked (misses).
const MAX_STACKS: usize = 4096;
/// Hypervisor heap the return stacks may hold at most, were they all full:
/// with a session's `stack_frames`, fewer stacks are tracked.
const STACK_BUDGET: usize = 3 << 20;
/// Return stacks of dead tasks are looked for this often (hypervisor
/// time); each look reads two words of every tracked task.
const REAP_EVERY_NS: u64 = 100_000_000;
/// Heap one more tracked return stack may take (its entry; the frames are
/// reserved fallibly by the stack itself).
const STACK_ENTRY_BYTES: usize =
    btree_entry_bytes::<u64, Tracked>() + btree_entry_bytes::<u64, Owner>();
/// Retired text renderers kept at most: each start and stop of a session
/// (the host's requests) retires one, and without a stream none is drained.
const MAX_RETIRED: usize = 64;

/// A function-graph session's settings, resolved to addresses, and its
/// renderer.
pub(super) struct GraphSession {
    pub(super) filter: GraphFilter,
    /// Functions that start a tree, when `rooted`.
    pub(super) roots: BTreeSet<u64>,
    /// Whether the session has roots (`filter.functions`); else every
    /// hooked function starts a tree. A session rooted by module globs
    /// alone may have no roots yet: it waits for its modules.
    pub(super) rooted: bool,
    /// `set_graph_notrace` functions.
    pub(super) notrace: BTreeSet<u64>,
    /// The function_graph text renderer (it holds one entry back).
    pub(super) text: GraphText,
}

impl GraphSession {
    /// [`follows_modules`] for the session's filter.
    pub(super) fn follows_modules(&self) -> bool {
        follows_modules(&self.filter)
    }
}

/// Whether a graph session with `filter` hooks functions beneath its
/// roots: not when it has roots and `max_depth` 1, since then only the
/// roots' own calls are shown (the kernel's function_graph still takes an
/// entry for every traced callee and drops it; root need not see them).
pub(super) fn hooks_callees(filter: &GraphFilter) -> bool {
    filter.max_depth != 1 || filter.functions.is_empty()
}

/// The trace globs a session with `filter` hooks: its own, or none when
/// it does not hook beneath its roots ([`hooks_callees`]). An empty trace
/// set still means `*` to a session that does.
pub(super) fn hooked_trace(filter: &GraphFilter) -> &[String] {
    if hooks_callees(filter) {
        &filter.trace
    } else {
        &[]
    }
}

/// Whether a session with `filter` names module globs (`MOD:GLOB`) among
/// its roots or the trace globs it hooks: those also cover modules that
/// load later.
pub(super) fn follows_modules(filter: &GraphFilter) -> bool {
    filter
        .functions
        .iter()
        .chain(hooked_trace(filter))
        .any(|g| super::symbols::module_glob(g).is_some())
}

/// Whether a task with `pid` and `comm` passes the pid and comm filters
/// of `f`.
pub(super) fn admits(f: &GraphFilter, pid: i32, comm: &[u8; 16]) -> bool {
    task_admitted(f.pid, f.comm.as_deref().map(str::as_bytes), pid, comm)
}

/// Whether a task with `pid` and `comm` (the kernel's array: the name ends
/// at the first NUL, or fills it) passes a pid filter and a comm filter
/// (`None`: no filter). The graph sessions', the count's and the probes'
/// gates' filter.
pub(super) fn task_admitted(
    want_pid: Option<i32>,
    want_comm: Option<&[u8]>,
    pid: i32,
    comm: &[u8; 16],
) -> bool {
    want_pid.is_none_or(|p| p == pid)
        && want_comm.is_none_or(|c| c == comm.split(|&b| b == 0).next().unwrap_or(comm))
}

/// A return handed back: where to, the users of the frame popped, and the
/// users of the frames left below it on its stack.
pub(super) struct Left {
    pub(super) ret: u64,
    pub(super) users: u16,
    pub(super) below: u16,
}

/// A return stack and the task last seen calling on its kernel stack.
struct Tracked {
    st: RetStack,
    task: u64,
    pid: i32,
    /// The stack is `task`'s own kernel stack (not an IRQ or exception
    /// stack it borrowed): only then can the task's death reap it.
    own: bool,
}

/// A stopped session's renderer, kept for its events still in the ring.
pub(super) struct Retired {
    /// The session's number.
    pub(super) number: u32,
    /// Its generation ([`RETIRED_GEN`] for one retired by a format switch).
    pub(super) generation: u8,
    pub(super) text: GraphText,
}

/// Who was last seen calling on a stack, and whether it is that task's own
/// kernel stack.
#[derive(Clone, Copy)]
struct Owner {
    task: u64,
    pid: i32,
    own: bool,
}

/// Where a hit's records and counts go: the probes (return probes count
/// their misses), the vCPU's ring, and the counters.
pub(super) struct Out<'a> {
    pub(super) probes: &'a Probes,
    /// The call count, which times calls through their returns.
    pub(super) count: &'a CountState,
    pub(super) ring: &'a mut EventRing,
    pub(super) record: &'a mut Vec<u8>,
    /// The vCPU's fetched values, kept from hit to hit.
    pub(super) values: &'a mut Vec<kprobe::FetchedValue>,
    pub(super) stats: &'a HitStats,
    /// The CPU number events carry when the guest's is not known: root's
    /// index of the vCPU.
    pub(super) vcpu: u32,
}

impl Out<'_> {
    /// A call with return probes `ids` whose return could not be hijacked.
    fn missed(&self, ids: &[u64]) {
        self.probes.retprobes_missed(ids);
        self.count.not_timed(ids);
    }
}

/// Keeps a stopped session's renderer for its events still in the ring:
/// at most [`MAX_RETIRED`] (the oldest goes first, as a renderer of a
/// session stopped long ago does once drained), and none when the heap has
/// no room (its events then print nothing, as for the oldest).
fn retire(retired: &mut Vec<Retired>, r: Retired) {
    if retired.len() >= MAX_RETIRED {
        retired.remove(0);
    }
    if fallible::try_push(retired, r).is_err() {
        log::warn!("tracer: out of hypervisor memory for a stopped session's renderer");
    }
}

/// What hits change: the return stacks, their owners, and the map of the
/// guest's stacks they are keyed by.
#[derive(Default)]
struct Stacks {
    /// Return stacks by guest kernel stack base. They outlive the users
    /// while calls are in flight.
    by_base: BTreeMap<u64, Tracked>,
    /// Ownership checks by stack: (task, pid, own). A task whose calls
    /// keep emptying and re-creating its return stack is checked once,
    /// not on every call; a new owner of the stack is checked again.
    owners: BTreeMap<u64, Owner>,
    /// The guest's stacks: return stacks are kept per stack, keyed by its
    /// base (a task's `THREAD_SIZE` block, or a CPU's IRQ or exception
    /// stack), so that frames on one stack never count as dead because of
    /// a call on another.
    map: StackMap,
}

/// Whether an entry must learn if its stack is its task's own.
enum OwnerCheck {
    /// The stack's owner is the calling task already.
    Same,
    /// A new owner, checked before: the answer.
    Known(bool),
    /// A new owner: read `task_struct.stack` (outside the lock).
    Read,
}

/// The function-graph state.
pub(super) struct Graph {
    /// Function-graph sessions by return-stack user number (0 is the
    /// return probes' user and never a session).
    pub(super) sessions: Vec<Option<GraphSession>>,
    /// What hits change, behind its own lock (see the module's notes).
    stacks: spin::Mutex<Stacks>,
    /// When the stacks' map was read ([`NEVER`]: not yet); written under
    /// the stacks' lock, read without it.
    map_read_ns: AtomicU64,
    /// Frames each new return stack holds.
    pub(super) stack_frames: u32,
    /// Each session number's generation (see [`GraphEventId`]).
    pub(super) generations: [u8; MAX_USERS],
    /// Text renderers of stopped sessions, by number and generation: the
    /// session's events still in the ring are rendered with them, then
    /// what they hold back is printed open and they go. (A renderer
    /// retired by a format switch gets a generation no event has.)
    pub(super) retired: Vec<Retired>,
    /// When the reaper last looked.
    last_reap_ns: u64,
}

impl Default for Graph {
    fn default() -> Self {
        Graph {
            sessions: (0..MAX_USERS).map(|_| None).collect(),
            stacks: spin::Mutex::new(Stacks::default()),
            map_read_ns: AtomicU64::new(NEVER),
            stack_frames: STACK_FRAMES,
            generations: [0; MAX_USERS],
            retired: Vec::new(),
            last_reap_ns: 0,
        }
    }
}

/// The return stacks' figures for `status`.
pub(super) struct StackFigures {
    pub(super) stacks: u64,
    pub(super) frames: u64,
    pub(super) bytes: u64,
}

impl Graph {
    /// A free session number.
    pub(super) fn free_number(&self) -> Option<usize> {
        (1..MAX_USERS).find(|&u| self.sessions.get(u).is_some_and(Option::is_none))
    }

    /// Whether session `user` runs.
    pub(super) fn runs(&self, user: usize) -> bool {
        self.sessions.get(user).is_some_and(Option::is_some)
    }

    /// Session `user`'s generation ([`RETIRED_GEN`] for a number that is
    /// none).
    fn generation(&self, user: usize) -> u8 {
        self.generations.get(user).copied().unwrap_or(RETIRED_GEN)
    }

    /// Whether sessions run or their frames are in flight.
    pub(super) fn busy(&mut self) -> bool {
        !self.stacks.get_mut().by_base.is_empty() || self.sessions.iter().any(Option::is_some)
    }

    /// The return stacks, locked for a hit; a take that had to wait for
    /// another vCPU is counted.
    fn lock_stacks(&self, stats: &HitStats) -> spin::MutexGuard<'_, Stacks> {
        if let Some(g) = self.stacks.try_lock() {
            return g;
        }
        add(&stats.stack_lock_waits, 1);
        self.stacks.lock()
    }

    /// Sessions running.
    pub(super) fn running(&self) -> u32 {
        self.sessions.iter().flatten().count() as u32
    }

    /// The return stacks' figures.
    pub(super) fn figures(&self) -> StackFigures {
        let s = self.stacks.lock();
        StackFigures {
            stacks: s.by_base.len() as u64,
            frames: s.by_base.values().map(|t| t.st.depth() as u64).sum(),
            bytes: s.by_base.values().map(|t| t.st.heap_bytes() as u64).sum(),
        }
    }

    /// Starts session `user`, a [`Self::free_number`] (its number's
    /// generation moves on).
    pub(super) fn start(&mut self, user: usize, session: GraphSession) {
        if let (Some(generation), Some(slot)) =
            (self.generations.get_mut(user), self.sessions.get_mut(user))
        {
            *generation = (*generation + 1) & 0xf;
            *slot = Some(session);
        }
    }

    /// Stops the sessions of `users` (bit N: session N): their renderers
    /// retire, and frames in flight stay (their returns must pop) but no
    /// longer count for them, whose numbers a new session may take.
    pub(super) fn stop(&mut self, users: u16) {
        let numbered = self.sessions.iter_mut().zip(self.generations);
        for (u, (session, generation)) in (0..MAX_USERS as u32).zip(numbered).skip(1) {
            if users & (1 << u) == 0 {
                continue;
            }
            if let Some(g) = session.take() {
                retire(
                    &mut self.retired,
                    Retired {
                        number: u,
                        generation,
                        text: g.text,
                    },
                );
            }
        }
        for t in self.stacks.get_mut().by_base.values_mut() {
            t.st.clear_users(users);
        }
    }

    /// The sessions (bit N: session N) whose trace sets matter only
    /// beneath their roots: sessions with roots that hook callees. The
    /// quiet views leave their sites unhooked (`super::quiet`).
    pub(super) fn quiet_users(&self) -> u16 {
        self.users_where(|g| g.rooted && hooks_callees(&g.filter)) | self.filter_users()
    }

    /// The sessions without roots that trace only the tasks their pid or
    /// comm filter admits: quiet too, armed while such a task runs.
    pub(super) fn filter_users(&self) -> u16 {
        self.users_where(|g| !g.rooted && (g.filter.pid.is_some() || g.filter.comm.is_some()))
    }

    /// The sessions in `users` that filter by comm.
    pub(super) fn comm_users(&self, users: u16) -> u16 {
        users & self.users_where(|g| g.filter.comm.is_some())
    }

    /// Whether the filter of one of the sessions in `users` admits a task
    /// with `pid` and `comm`.
    pub(super) fn admitted_by(&self, users: u16, pid: i32, comm: &[u8; 16]) -> bool {
        self.sessions_in(users)
            .any(|g| admits(&g.filter, pid, comm))
    }

    /// The running sessions among `users` (bit N: session N).
    fn sessions_in(&self, users: u16) -> impl Iterator<Item = &GraphSession> {
        (0..MAX_USERS)
            .zip(&self.sessions)
            .filter(move |&(u, _)| users & (1 << u) != 0)
            .filter_map(|(_, g)| g.as_ref())
    }

    /// The running sessions for which `pick` holds.
    fn users_where(&self, pick: impl Fn(&GraphSession) -> bool) -> u16 {
        (0..MAX_USERS as u16)
            .zip(&self.sessions)
            .skip(1)
            .filter(|(_, g)| g.as_ref().is_some_and(&pick))
            .fold(0, |m, (u, _)| m | 1 << u)
    }

    /// Whether `func` is a root of one of the sessions in `users`.
    pub(super) fn is_root_of(&self, users: u16, func: Gva) -> bool {
        self.sessions_in(users).any(|g| g.roots.contains(&func.0))
    }

    /// Whether the vCPU described by `cpu`, running `task`, is inside a
    /// root of one of the sessions in `users`: a frame of theirs is on the
    /// stack it runs on, on `task`'s own kernel stack (`task_stack`: a
    /// root entered from an interrupt returns to the task's state), or on
    /// one of its CPU's own stacks (guest CPU `cpu_number`).
    pub(super) fn inside_roots(
        &self,
        users: u16,
        cpu: &CpuView,
        task_stack: Option<u64>,
        cpu_number: Option<u32>,
        stats: &HitStats,
    ) -> bool {
        if users == 0 {
            return false;
        }
        let s = self.lock_stacks(stats);
        let has = |key: u64| {
            s.by_base
                .get(&key)
                .is_some_and(|t| t.st.frames().any(|f| f.users & users != 0))
        };
        if has(s.map.key(cpu.rsp)) || task_stack.is_some_and(has) {
            return true;
        }
        cpu_number.is_some_and(|n| {
            s.map
                .per_cpu()
                .iter()
                .filter(|r| r.cpu == Some(n))
                .any(|r| has(r.base))
        })
    }

    /// The return half of an entry hit: for the sessions and return probes
    /// that want this call, push one shared frame and hijack the return.
    /// Returns the users of the frame pushed (0: none).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enter(
        &self,
        env: &mut Env<'_>,
        out: Out<'_>,
        tramp: u64,
        sessions: u16,
        retprobes: &[u64],
        entry_args: Option<&[u64; ENTRY_ARGS]>,
        func: u64,
        retp: u64,
        cr3: Cr3,
        now_ns: u64,
        header: EventHeader,
        task: u64,
        k: &dyn KernelView,
    ) -> u16 {
        let comm = &header.comm;
        let mut users = 0u16;
        let mut entries: [(u8, u16); MAX_USERS] = [(0, 0); MAX_USERS];
        // The return probes' block: their ids, then the arguments saved
        // for those that read them at the return (when they fit).
        // (Filled only when arguments are saved: a graph entry does not pay
        // for clearing it.)
        let mut block: [u64; RETPROBE_BLOCK];
        let ids_and_args = match entry_args {
            Some(a) if retprobes.len() + 1 + ENTRY_ARGS <= RETPROBE_BLOCK => {
                block = [0u64; RETPROBE_BLOCK];
                let n = retprobes.len();
                let words = retprobes
                    .iter()
                    .chain(core::iter::once(&ENTRY_MARK))
                    .chain(a.iter());
                for (slot, &w) in block.iter_mut().zip(words) {
                    *slot = w;
                }
                block.get(..n + 1 + ENTRY_ARGS).unwrap_or(retprobes)
            }
            _ => retprobes,
        };
        let mut n_entries = 0;
        // Data blocks: a mark for each session entering one of its
        // graph_notrace functions, then the return probes' ids.
        let mut data: [(u8, &[u64]); MAX_USERS] = [(0, &[]); MAX_USERS];
        let mut n_data = 0;
        let stack_bytes = self.stack_frames as usize * FRAME_TAGGED * 8;
        let max_stacks = (STACK_BUDGET / stack_bytes.max(1)).min(MAX_STACKS);
        // First take: what the call is owed, from the stack as it is.
        let (key, owner) = {
            let mut s = self.lock_stacks(out.stats);
            let key = s.map.key(retp);
            // Frames below this call's return slot can never return (on
            // this stack: the key is the stack's own).
            if let Some(t) = s.by_base.get_mut(&key) {
                add(&out.stats.graph_dropped, t.st.reclaim_below(retp) as u64);
                if t.st.is_empty() {
                    s.by_base.remove(&key);
                }
            }
            let stack = s.by_base.get(&key).map(|t| &t.st);
            for (user, g) in (0..MAX_USERS as u8).zip(&self.sessions).skip(1) {
                if sessions & (1 << user) == 0 {
                    continue;
                }
                let Some(g) = g else {
                    continue;
                };
                let (depth, hidden) = stack.map_or((0, false), |s| s.user_view(user, NOTRACE_MARK));
                if hidden {
                    continue;
                }
                let f = &g.filter;
                if depth == 0 {
                    let root_ok = !g.rooted || g.roots.contains(&func);
                    if !(root_ok && admits(f, header.pid, comm)) {
                        continue;
                    }
                }
                if f.max_depth != 0 && depth >= f.max_depth as usize {
                    continue;
                }
                users |= 1 << user;
                // Each of the MAX_USERS - 1 sessions adds at most one entry
                // or one data block, the return probes one more data block:
                // both arrays always have room.
                if g.notrace.contains(&func) {
                    if let Some(d) = data.get_mut(n_data) {
                        *d = (user, core::slice::from_ref(&NOTRACE_MARK));
                        n_data += 1;
                    }
                } else if let Some(e) = entries.get_mut(n_entries) {
                    *e = (user, depth as u16);
                    n_entries += 1;
                }
            }
            if !retprobes.is_empty() {
                users |= 1 << RETPROBE_USER;
                if let Some(d) = data.get_mut(n_data) {
                    *d = (RETPROBE_USER, ids_and_args);
                    n_data += 1;
                }
            }
            if users == 0 {
                return 0;
            }
            if !s.by_base.contains_key(&key)
                && (s.by_base.len() >= max_stacks || env.m.heap_check(STACK_ENTRY_BYTES).is_err())
            {
                add(&out.stats.graph_misses, 1);
                out.missed(retprobes);
                return 0;
            }
            let owner = match (s.by_base.get(&key), s.owners.get(&key)) {
                (Some(t), _) if (t.task, t.pid) == (task, header.pid) => OwnerCheck::Same,
                (_, Some(o)) if (o.task, o.pid) == (task, header.pid) => OwnerCheck::Known(o.own),
                _ => OwnerCheck::Read,
            };
            (key, owner)
        };
        // Between the takes, with the lock free: the guest's memory.
        let mut slot = [0u8; 8];
        let Ok(t) = paging::translate(env.ram, cr3, Gva(retp)) else {
            return 0;
        };
        if !retp.is_multiple_of(8)
            || in_hypervisor(t.gpa.0)
            || env.ram.read(t.gpa.0, &mut slot).is_err()
        {
            return 0;
        }
        let ret = u64::from_le_bytes(slot);
        // A new owner (or a first one): is this its own stack?
        let read_own = match owner {
            OwnerCheck::Read => Some(k.task_stack(task) == Some(key)),
            _ => None,
        };
        // Second take: the push.
        {
            let mut s = self.lock_stacks(out.stats);
            let s = &mut *s;
            if let Some(own) = read_own {
                if s.owners.len() >= 2 * MAX_STACKS {
                    s.owners.clear();
                }
                s.owners.insert(
                    key,
                    Owner {
                        task,
                        pid: header.pid,
                        own,
                    },
                );
            }
            if !s.by_base.contains_key(&key) && s.by_base.len() >= max_stacks {
                // Other vCPUs took the last room between the takes.
                add(&out.stats.graph_misses, 1);
                out.missed(retprobes);
                return 0;
            }
            let tracked = s.by_base.entry(key).or_insert_with(|| Tracked {
                st: RetStack::new(self.stack_frames as usize * FRAME_TAGGED),
                task: 0,
                pid: 0,
                own: false,
            });
            if tracked.task != task || tracked.pid != header.pid {
                tracked.own = match owner {
                    OwnerCheck::Known(own) => own,
                    OwnerCheck::Read => read_own.unwrap_or(false),
                    // The task owned the stack at the first take, and its
                    // return stack went since (another vCPU's return
                    // found a frame on it): what the check said then, or
                    // "borrowed", which only keeps the reaper off it (no
                    // guest read under this lock).
                    OwnerCheck::Same => s
                        .owners
                        .get(&key)
                        .is_some_and(|o| (o.task, o.pid) == (task, header.pid) && o.own),
                };
                tracked.task = task;
                tracked.pid = header.pid;
            }
            // A frame at this very slot is the caller of a tail call: the
            // callee stacks on it. (The slot may hold our trampoline, or
            // the return handler of the guest's own function_graph, which
            // hijacks after us; so the slot's value cannot tell a dead
            // frame from a live one. A dead frame at the same slot pops
            // harmlessly below the new one, or goes with the next call
            // from a higher slot.)
            if ret == tramp && tracked.st.top_retp() != Some(retp) {
                // Our trampoline in a slot we have no frame for: never
                // stack on it.
                if tracked.st.is_empty() {
                    s.by_base.remove(&key);
                }
                return 0;
            }
            // A call timed for the count starts now, not at the exit:
            // root's work on the entry is not the function's.
            let calltime = if retprobes.contains(&LATENCY_ID) {
                env.m.clock_ns().unwrap_or(now_ns).max(now_ns)
            } else {
                now_ns
            };
            let pushed = tracked.st.push(
                ret,
                func,
                calltime,
                retp,
                users,
                data.get(..n_data).unwrap_or(&[]),
            );
            let empty = tracked.st.is_empty();
            if let Err(e) = pushed {
                if e == PushError::Full {
                    add(&out.stats.graph_misses, 1);
                }
                if empty {
                    s.by_base.remove(&key);
                }
                out.missed(retprobes);
                return 0;
            }
        }
        if env.ram.write_word(t.gpa.0, tramp).is_err() {
            return 0;
        }
        for &(user, depth) in entries.iter().take(n_entries) {
            let h = EventHeader {
                probe_id: GraphEventId {
                    kind: GraphKind::Entry,
                    number: user,
                    generation: self.generation(usize::from(user)),
                }
                .pack(),
                ip: func,
                ret_ip: ret,
                ..header
            };
            let values = [kprobe::FetchedValue::Int {
                ty: kprobe::IntType::U64,
                value: u64::from(depth),
            }];
            store_parts(out.ring, out.record, &h, &values);
        }
        users
    }

    /// A return through the trampoline: the original return address, the
    /// users of the frame it popped and of the frames below it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn leave(
        &self,
        env: &mut Env<'_>,
        out: Out<'_>,
        tramp: Option<u64>,
        regs: &GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Option<Left> {
        let retp = regs
            .rdi
            .checked_add(trampolines::abi::RETURN_FRAME_RETP as u64)?;
        let retval = regs.rsi;
        // Each session's depth of the frame: its frames left below it.
        let mut depths = [0usize; MAX_USERS];
        let (frame, caller, below) = {
            let mut s = self.lock_stacks(out.stats);
            let mut key = s.map.key(retp);
            if s.by_base
                .get(&key)
                .is_none_or(|t| t.st.top_retp() != Some(retp))
            {
                // The map changed since the entry (a CPU came up, or the
                // guest moved a per-CPU stack pointer): find the frame
                // where it was pushed, rather than leave the call with
                // nowhere to return.
                if let Some((&k, _)) = s
                    .by_base
                    .iter()
                    .find(|(_, t)| t.st.top_retp() == Some(retp))
                {
                    key = k;
                }
            }
            let t = s.by_base.get_mut(&key)?;
            let PopResult::Found { frame, dropped } = t.st.pop(retp) else {
                return None;
            };
            add(&out.stats.graph_dropped, dropped as u64);
            for (user, d) in depths.iter_mut().enumerate().skip(1) {
                if frame.users & (1 << user) != 0 {
                    *d = t.st.user_view(user as u8, NOTRACE_MARK).0;
                }
            }
            // A tail-called function's frame holds our trampoline as its
            // return address; its real caller is in the frame below, at
            // the same slot.
            let caller = match t.st.frames().next() {
                Some(below) if Some(frame.ret) == tramp && below.retp == retp => below.ret,
                _ => frame.ret,
            };
            let below = t.st.frames().fold(0, |m, f| m | f.users);
            if t.st.is_empty() {
                s.by_base.remove(&key);
            }
            (frame, caller, below)
        };
        let Running { pid, comm, .. } = kernel
            .and_then(|k| k.current(cpu))
            .unwrap_or(Running::UNKNOWN);
        let header = EventHeader {
            probe_id: 0,
            cpu: kernel.and_then(|k| k.cpu_number(cpu)).unwrap_or(out.vcpu),
            pid,
            timestamp_ns: now_ns,
            ip: frame.func,
            ret_ip: frame.ret,
            comm,
        };
        for (user, &depth) in depths.iter().enumerate().skip(1) {
            if frame.users & (1 << user) == 0 || !self.runs(user) {
                continue;
            }
            let marked = frame
                .data
                .iter()
                .any(|(u, d)| usize::from(*u) == user && d.first() == Some(&NOTRACE_MARK));
            if marked {
                continue;
            }
            let h = EventHeader {
                probe_id: GraphEventId {
                    kind: GraphKind::Return,
                    number: user as u8,
                    generation: self.generation(user),
                }
                .pack(),
                ..header
            };
            let values = [
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: depth as u64,
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::U64,
                    value: now_ns.saturating_sub(frame.calltime),
                },
                kprobe::FetchedValue::Int {
                    ty: kprobe::IntType::X64,
                    value: retval,
                },
            ];
            store_parts(out.ring, out.record, &h, &values);
        }
        if frame.data_lost {
            // Its return probes and notrace marks could not be read back.
            add(&out.stats.graph_misses, 1);
        }
        let block = frame
            .data
            .iter()
            .find(|(u, _)| *u == RETPROBE_USER)
            .map(|(_, d)| d.as_slice())
            .unwrap_or(&[]);
        let (ids, entry_args) = match block.iter().position(|&w| w == ENTRY_MARK) {
            Some(i) => (
                block.get(..i).unwrap_or(&[]),
                block.get(i + 1..i + 1 + ENTRY_ARGS),
            ),
            None => (block, None),
        };
        if ids.contains(&LATENCY_ID) {
            out.count.returned(
                header.pid,
                &header.comm,
                frame.func,
                retval,
                now_ns.saturating_sub(frame.calltime),
            );
        }
        if let (false, Some(k)) = (ids.is_empty(), kernel) {
            let at = RetprobeAt {
                regs,
                retp,
                caller,
                entry_args,
            };
            retprobe_hits(env, out, ids, &at, header, cpu, k);
        }
        Some(Left {
            ret: frame.ret,
            users: frame.users,
            below,
        })
    }

    /// Drops the return stacks of tasks that died: a task that exits
    /// inside traced functions (`do_exit` never returns) leaves frames
    /// that no return will pop. A task's own kernel stack is released once
    /// its `task_struct.stack` no longer points at it: the kernel clears
    /// it when it frees a dead task's stack (and a reused `task_struct`
    /// points at its new task's stack). A live task's stack pointer never
    /// changes, even when its pid does (a thread that execs takes the
    /// leader's pid). Borrowed (IRQ) stacks and the running task's stack
    /// are never touched here; their dead frames go when a later call or
    /// return on the same stack passes them. Runs every REAP_EVERY_NS.
    pub(super) fn reap(
        &mut self,
        kernel: Option<&dyn KernelView>,
        cpu: &CpuView,
        now_ns: u64,
        stats: &mut TracerReport,
    ) {
        let Some(k) = kernel else {
            return;
        };
        let s = self.stacks.get_mut();
        if s.by_base.is_empty() || now_ns.saturating_sub(self.last_reap_ns) < REAP_EVERY_NS {
            return;
        }
        self.last_reap_ns = now_ns;
        let running = k.current(cpu).map(|c| c.task);
        let dead: Vec<u64> = s
            .by_base
            .iter()
            .filter(|(&base, t)| {
                t.own && Some(t.task) != running && k.task_stack(t.task).is_some_and(|s| s != base)
            })
            .map(|(&base, _)| base)
            .collect();
        for base in dead {
            if let Some(t) = s.by_base.remove(&base) {
                stats.graph_reaped += t.st.depth() as u64;
            }
            s.owners.remove(&base);
        }
    }

    /// Reads the guest's stacks again when the map is older than
    /// [`STACK_MAP_EVERY_NS`]; logs it when it changes (recovery logs the
    /// first). The read and the log run with the stacks' lock free, and a
    /// hit with a fresh map takes no lock here at all.
    pub(super) fn refresh_stack_map(
        &self,
        k: &dyn KernelView,
        cpu: &CpuView,
        now_ns: u64,
        stats: &HitStats,
    ) {
        let due = |read: u64| read == NEVER || now_ns.saturating_sub(read) >= STACK_MAP_EVERY_NS;
        if !due(self.map_read_ns.load(Relaxed)) {
            return;
        }
        let map = k.stack_map(cpu);
        let changed = {
            let mut s = self.lock_stacks(stats);
            // Another vCPU may have read it meanwhile: one reading is
            // enough.
            let read = self.map_read_ns.load(Relaxed);
            if !due(read) {
                return;
            }
            let changed = read != NEVER && map != s.map;
            s.map = map;
            self.map_read_ns.store(now_ns, Relaxed);
            changed.then(|| s.map.clone())
        };
        if let Some(map) = changed {
            k.log_stacks(&map);
        }
    }

    /// Retires the text renderers that hold an entry back (the stream is
    /// switching format): the next drain prints those entries as open
    /// calls.
    pub(super) fn flush_held(&mut self) {
        for (user, g) in self.sessions.iter_mut().enumerate() {
            let Some(g) = g else { continue };
            if g.text.has_pending() {
                let fresh = GraphText::new(g.filter.retval);
                let old = core::mem::replace(&mut g.text, fresh);
                retire(
                    &mut self.retired,
                    Retired {
                        number: user as u32,
                        generation: RETIRED_GEN,
                        text: old,
                    },
                );
            }
        }
    }
}

/// Records the return probes `ids` of a returning call: their fetch
/// arguments see the registers at the return, as a kretprobe's do (`ip`
/// the original return address, `sp` just above the return slot).
#[allow(clippy::too_many_arguments)]
/// Where a return probe's call returned: the registers at the return,
/// the return slot, the caller, and the arguments saved at the entry.
#[derive(Clone, Copy)]
struct RetprobeAt<'a> {
    regs: &'a GuestRegs,
    retp: u64,
    caller: u64,
    entry_args: Option<&'a [u64]>,
}

fn retprobe_hits(
    env: &mut Env<'_>,
    out: Out<'_>,
    ids: &[u64],
    at: &RetprobeAt<'_>,
    mut header: EventHeader,
    cpu: &CpuView,
    k: &dyn KernelView,
) {
    let RetprobeAt {
        regs: g,
        retp,
        caller,
        entry_args,
    } = *at;
    header.ret_ip = caller;
    let regs = PtRegs {
        r15: g.r15,
        r14: g.r14,
        r13: g.r13,
        r12: g.r12,
        bp: g.rbp,
        bx: g.rbx,
        r11: g.r11,
        r10: g.r10,
        r9: g.r9,
        r8: g.r8,
        ax: g.rsi,
        cx: g.rcx,
        dx: g.rdx,
        si: g.rsi,
        di: g.rdi,
        orig_ax: u64::MAX,
        ip: caller,
        cs: KERNEL_CS,
        flags: 0,
        sp: retp.wrapping_add(8),
        ss: KERNEL_SS,
    };
    let syms = IndexSymbols::new(k.index(), Some(k.modules()));
    let mut mem = VcpuMem {
        ram: env.ram,
        cr3: Cr3(cpu.cr3),
        walks: None,
    };
    let ctx = FetchContext {
        regs: &regs,
        comm: Some(&header.comm),
        layout: GuestLayout::X86_64_4LEVEL,
        entry_args,
    };
    // Ids of probes deleted while the call was in flight find nothing.
    let ids = ids.iter().filter_map(|&i| u32::try_from(i).ok());
    let mut sink = HitSink {
        probes: &out.probes.list,
        ring: out.ring,
        record: out.record,
        values: out.values,
        heap: &*env.m,
    };
    sink.hits(ids, header, &ctx, &mut mem, &syms);
}
