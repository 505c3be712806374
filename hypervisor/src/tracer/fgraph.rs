//! The function-graph tracer's state: the sessions (numbered 1 to 15,
//! each with its filter, roots and renderer), the return stacks keyed by
//! guest kernel stack, their owners, and the generations that tell a
//! session's events from those of an earlier session with its number.
//! Shared by every vCPU: a task that sleeps in a traced function on one
//! CPU and wakes on another pops its frames from the same stack.

use super::graph::{GraphEventId, GraphKind, GraphText};
use super::machine::{CpuView, Env, KernelView, Running};
use super::probes::{store_parts, HitSink, Probes, VcpuMem};
use super::retstack::{PopResult, PushError, RetStack, MAX_USERS};
use super::ring::EventRing;
use super::split::in_hypervisor;
use crate::addr::Gva;
use crate::kprobe::{self, EventHeader, FetchContext, GuestLayout, IndexSymbols};
use crate::vmx::regs::GuestRegs;
use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;
use guest_introspect::fallible::{self, btree_entry_bytes};
use guest_introspect::paging::{self, Cr3};
use guest_introspect::stacks::StackMap;
use protocol::{GraphFilter, TracerReport};
use trampolines::PtRegs;

/// The return-stack user of return probes; graph sessions are users 1..15.
pub(super) const RETPROBE_USER: u8 = 0;
/// A generation no event carries (generations are 4 bits).
const RETIRED_GEN: u8 = 0xff;
/// The first word of a session's data block on a frame of one of its
/// `set_graph_notrace` functions: nothing beneath it is traced for the
/// session, and the frame's own return is silent.
const NOTRACE_MARK: u64 = u64::from_le_bytes(*b"notrace\0");
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
    /// Functions that start a tree (empty: every hooked function).
    pub(super) roots: BTreeSet<u64>,
    /// `set_graph_notrace` functions.
    pub(super) notrace: BTreeSet<u64>,
    /// The function_graph text renderer (it holds one entry back).
    pub(super) text: GraphText,
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
    pub(super) probes: &'a mut Probes,
    pub(super) ring: &'a mut EventRing,
    pub(super) record: &'a mut Vec<u8>,
    pub(super) stats: &'a mut TracerReport,
    /// The CPU number events carry when the guest's is not known: root's
    /// index of the vCPU.
    pub(super) vcpu: u32,
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

/// The function-graph state.
pub(super) struct Graph {
    /// Function-graph sessions by return-stack user number (0 is the
    /// return probes' user and never a session).
    pub(super) sessions: Vec<Option<GraphSession>>,
    /// Return stacks by guest kernel stack base. They outlive the users
    /// while calls are in flight.
    stacks: BTreeMap<u64, Tracked>,
    /// Frames each new return stack holds.
    pub(super) stack_frames: u32,
    /// Ownership checks by stack: (task, pid, own). A task whose calls
    /// keep emptying and re-creating its return stack is checked once,
    /// not on every call; a new owner of the stack is checked again.
    owners: BTreeMap<u64, Owner>,
    /// Each session number's generation (see [`GraphEventId`]).
    pub(super) generations: [u8; MAX_USERS],
    /// Text renderers of stopped sessions, by number and generation: the
    /// session's events still in the ring are rendered with them, then
    /// what they hold back is printed open and they go. (A renderer
    /// retired by a format switch gets a generation no event has.)
    pub(super) retired: Vec<Retired>,
    /// When the reaper last looked.
    last_reap_ns: u64,
    /// The guest's stacks: return stacks are kept per stack, keyed by its
    /// base (a task's `THREAD_SIZE` block, or a CPU's IRQ or exception
    /// stack), so that frames on one stack never count as dead because of
    /// a call on another.
    stack_map: StackMap,
    /// When `stack_map` was read (None: never).
    stack_map_ns: Option<u64>,
}

impl Default for Graph {
    fn default() -> Self {
        Graph {
            sessions: (0..MAX_USERS).map(|_| None).collect(),
            stacks: BTreeMap::new(),
            stack_frames: STACK_FRAMES,
            owners: BTreeMap::new(),
            generations: [0; MAX_USERS],
            retired: Vec::new(),
            last_reap_ns: 0,
            stack_map: StackMap::default(),
            stack_map_ns: None,
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
    pub(super) fn busy(&self) -> bool {
        !self.stacks.is_empty() || self.sessions.iter().any(Option::is_some)
    }

    /// Sessions running.
    pub(super) fn running(&self) -> u32 {
        self.sessions.iter().flatten().count() as u32
    }

    /// The return stacks' figures.
    pub(super) fn figures(&self) -> StackFigures {
        StackFigures {
            stacks: self.stacks.len() as u64,
            frames: self.stacks.values().map(|s| s.st.depth() as u64).sum(),
            bytes: self.stacks.values().map(|s| s.st.heap_bytes() as u64).sum(),
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
        for t in self.stacks.values_mut() {
            t.st.clear_users(users);
        }
    }

    /// The return half of an entry hit: for the sessions and return probes
    /// that want this call, push one shared frame and hijack the return.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enter(
        &mut self,
        env: &mut Env<'_>,
        out: Out<'_>,
        tramp: u64,
        sessions: u16,
        retprobes: &[u64],
        func: u64,
        retp: u64,
        cr3: Cr3,
        now_ns: u64,
        header: EventHeader,
        task: u64,
        k: &dyn KernelView,
    ) {
        let key = self.stack_map.key(retp);
        // Frames below this call's return slot can never return (on this
        // stack: the key is the stack's own).
        if let Some(t) = self.stacks.get_mut(&key) {
            out.stats.graph_dropped += t.st.reclaim_below(retp) as u64;
            if t.st.is_empty() {
                self.stacks.remove(&key);
            }
        }
        let comm = &header.comm;
        let mut users = 0u16;
        let mut entries: [(u8, u16); MAX_USERS] = [(0, 0); MAX_USERS];
        let mut n_entries = 0;
        // Data blocks: a mark for each session entering one of its
        // graph_notrace functions, then the return probes' ids.
        let mut data: [(u8, &[u64]); MAX_USERS] = [(0, &[]); MAX_USERS];
        let mut n_data = 0;
        let stack = self.stacks.get(&key).map(|t| &t.st);
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
                let root_ok = g.roots.is_empty() || g.roots.contains(&func);
                let pid_ok = f.pid.is_none_or(|p| p == header.pid);
                let comm_ok = f.comm.as_deref().is_none_or(|c| {
                    // The name ends at the first NUL, or fills the array.
                    let name = comm.split(|&b| b == 0).next().unwrap_or(comm);
                    c.as_bytes() == name
                });
                if !(root_ok && pid_ok && comm_ok) {
                    continue;
                }
            }
            if f.max_depth != 0 && depth >= f.max_depth as usize {
                continue;
            }
            users |= 1 << user;
            // Each of the MAX_USERS - 1 sessions adds at most one entry or
            // one data block, the return probes one more data block: both
            // arrays always have room.
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
                *d = (RETPROBE_USER, retprobes);
                n_data += 1;
            }
        }
        if users == 0 {
            return;
        }
        let stack_bytes = self.stack_frames as usize * FRAME_TAGGED * 8;
        let max_stacks = (STACK_BUDGET / stack_bytes.max(1)).min(MAX_STACKS);
        if !self.stacks.contains_key(&key)
            && (self.stacks.len() >= max_stacks || env.m.heap_check(STACK_ENTRY_BYTES).is_err())
        {
            out.stats.graph_misses += 1;
            out.probes.retprobes_missed(retprobes);
            return;
        }
        let mut slot = [0u8; 8];
        let Ok(t) = paging::translate(env.ram, cr3, Gva(retp)) else {
            return;
        };
        if !retp.is_multiple_of(8)
            || in_hypervisor(t.gpa.0)
            || env.ram.read(t.gpa.0, &mut slot).is_err()
        {
            return;
        }
        let ret = u64::from_le_bytes(slot);
        let tracked = self.stacks.entry(key).or_insert_with(|| Tracked {
            st: RetStack::new(self.stack_frames as usize * FRAME_TAGGED),
            task: 0,
            pid: 0,
            own: false,
        });
        if tracked.task != task || tracked.pid != header.pid {
            // A new owner (or a first one): is this its own stack?
            tracked.own = match self.owners.get(&key) {
                Some(o) if (o.task, o.pid) == (task, header.pid) => o.own,
                _ => {
                    let own = k.task_stack(task) == Some(key);
                    if self.owners.len() >= 2 * MAX_STACKS {
                        self.owners.clear();
                    }
                    self.owners.insert(
                        key,
                        Owner {
                            task,
                            pid: header.pid,
                            own,
                        },
                    );
                    own
                }
            };
            tracked.task = task;
            tracked.pid = header.pid;
        }
        // A frame at this very slot is the caller of a tail call: the callee
        // stacks on it. (The slot may hold our trampoline, or the return
        // handler of the guest's own function_graph, which hijacks after
        // us; so the slot's value cannot tell a dead frame from a live one.
        // A dead frame at the same slot pops harmlessly below the new one, or
        // goes with the next call from a higher slot.)
        if ret == tramp && tracked.st.top_retp() != Some(retp) {
            // Our trampoline in a slot we have no frame for: never stack on it.
            if tracked.st.is_empty() {
                self.stacks.remove(&key);
            }
            return;
        }
        let pushed = tracked.st.push(
            ret,
            func,
            now_ns,
            retp,
            users,
            data.get(..n_data).unwrap_or(&[]),
        );
        let empty = tracked.st.is_empty();
        match pushed {
            Ok(_) => {}
            Err(e) => {
                if e == PushError::Full {
                    out.stats.graph_misses += 1;
                }
                if empty {
                    self.stacks.remove(&key);
                }
                out.probes.retprobes_missed(retprobes);
                return;
            }
        }
        if env.ram.write_word(t.gpa.0, tramp).is_err() {
            return;
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
    }

    /// A return through the trampoline: the original return address.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn leave(
        &mut self,
        env: &mut Env<'_>,
        out: Out<'_>,
        tramp: Option<u64>,
        regs: &GuestRegs,
        cpu: &CpuView,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
    ) -> Option<u64> {
        let retp = regs
            .rdi
            .checked_add(trampolines::abi::RETURN_FRAME_RETP as u64)?;
        let retval = regs.rsi;
        let mut key = self.stack_map.key(retp);
        if self
            .stacks
            .get(&key)
            .is_none_or(|t| t.st.top_retp() != Some(retp))
        {
            // The map changed since the entry (a CPU came up, or the guest
            // moved a per-CPU stack pointer): find the frame where it was
            // pushed, rather than leave the call with nowhere to return.
            if let Some((&k, _)) = self
                .stacks
                .iter()
                .find(|(_, t)| t.st.top_retp() == Some(retp))
            {
                key = k;
            }
        }
        let t = self.stacks.get_mut(&key)?;
        let PopResult::Found { frame, dropped } = t.st.pop(retp) else {
            return None;
        };
        out.stats.graph_dropped += dropped as u64;
        // Each session's depth of the frame: its frames left below it.
        let mut depths = [0usize; MAX_USERS];
        for (user, d) in depths.iter_mut().enumerate().skip(1) {
            if frame.users & (1 << user) != 0 {
                *d = t.st.user_view(user as u8, NOTRACE_MARK).0;
            }
        }
        // A tail-called function's frame holds our trampoline as its
        // return address; its real caller is in the frame below, at the
        // same slot.
        let caller = match t.st.frames().next() {
            Some(below) if Some(frame.ret) == tramp && below.retp == retp => below.ret,
            _ => frame.ret,
        };
        if t.st.is_empty() {
            self.stacks.remove(&key);
        }
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
            out.stats.graph_misses += 1;
        }
        let ids = frame
            .data
            .iter()
            .find(|(u, _)| *u == RETPROBE_USER)
            .map(|(_, d)| d.as_slice())
            .unwrap_or(&[]);
        if let (false, Some(k)) = (ids.is_empty(), kernel) {
            retprobe_hits(env, out, ids, regs, retp, caller, header, cpu, k);
        }
        Some(frame.ret)
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
        if self.stacks.is_empty() || now_ns.saturating_sub(self.last_reap_ns) < REAP_EVERY_NS {
            return;
        }
        self.last_reap_ns = now_ns;
        let running = k.current(cpu).map(|c| c.task);
        let dead: Vec<u64> = self
            .stacks
            .iter()
            .filter(|(&base, t)| {
                t.own && Some(t.task) != running && k.task_stack(t.task).is_some_and(|s| s != base)
            })
            .map(|(&base, _)| base)
            .collect();
        for base in dead {
            if let Some(t) = self.stacks.remove(&base) {
                stats.graph_reaped += t.st.depth() as u64;
            }
            self.owners.remove(&base);
        }
    }

    /// Reads the guest's stacks again when the map is older than
    /// [`STACK_MAP_EVERY_NS`]; logs it when it changes (recovery logs the
    /// first).
    pub(super) fn refresh_stack_map(&mut self, k: &dyn KernelView, cpu: &CpuView, now_ns: u64) {
        if self
            .stack_map_ns
            .is_some_and(|t| now_ns.saturating_sub(t) < STACK_MAP_EVERY_NS)
        {
            return;
        }
        let map = k.stack_map(cpu);
        if self.stack_map_ns.is_some() && map != self.stack_map {
            k.log_stacks(&map);
        }
        self.stack_map = map;
        self.stack_map_ns = Some(now_ns);
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
fn retprobe_hits(
    env: &mut Env<'_>,
    out: Out<'_>,
    ids: &[u64],
    g: &GuestRegs,
    retp: u64,
    caller: u64,
    mut header: EventHeader,
    cpu: &CpuView,
    k: &dyn KernelView,
) {
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
        cs: 0x10,
        flags: 0,
        sp: retp.wrapping_add(8),
        ss: 0x18,
    };
    let syms = IndexSymbols(k.index());
    let mut mem = VcpuMem {
        ram: env.ram,
        cr3: Cr3(cpu.cr3),
    };
    let ctx = FetchContext {
        regs: &regs,
        comm: Some(&header.comm),
        layout: GuestLayout::X86_64_4LEVEL,
    };
    // Ids of probes deleted while the call was in flight find nothing.
    let ids = ids.iter().filter_map(|&i| u32::try_from(i).ok());
    let mut sink = HitSink {
        probes: &mut out.probes.list,
        ring: out.ring,
        record: out.record,
    };
    sink.hits(ids, header, &ctx, &mut mem, &syms);
}
