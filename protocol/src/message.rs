//! The messages of the control channel.
//!
//! Bodies are serialized with postcard, which encodes an enum variant as its
//! index (a varint) and a struct as its fields in declaration order. So:
//! **append new variants and fields at the end only, and bump
//! [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION) for any change that an older
//! peer would read differently** (a new field, a reordered or retyped one, a
//! new variant that an old peer would receive).
//!
//! Enums are `#[non_exhaustive]` so that adding a variant does not break the
//! code that matches on them in other crates.

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// One frame: the unit that is encoded, checked and delimited on the wire.
///
/// Both directions use it, so one decoder serves the hypervisor and the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Wire-format version of the sender, normally
    /// [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION). Frames of any other
    /// version fail to decode with
    /// [`DecodeError::UnsupportedVersion`](crate::DecodeError::UnsupportedVersion).
    pub version: u16,
    /// Sequence number. For a request it is chosen by the client, and the
    /// response to it carries the same number. Events carry the sender's own
    /// event counter (wrapping), which lets the receiver spot gaps.
    pub seq: u32,
    /// What the frame says.
    pub body: Body,
}

impl Frame {
    /// A frame of the current [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
    pub const fn new(seq: u32, body: Body) -> Self {
        Self {
            version: crate::PROTOCOL_VERSION,
            seq,
            body,
        }
    }

    /// A request frame of the current version.
    pub const fn request(seq: u32, request: Request) -> Self {
        Self::new(seq, Body::Request(request))
    }

    /// A response frame of the current version. `seq` is the request's.
    pub const fn response(seq: u32, response: Response) -> Self {
        Self::new(seq, Body::Response(response))
    }

    /// An event frame of the current version.
    pub const fn event(seq: u32, event: Event) -> Self {
        Self::new(seq, Body::Event(event))
    }
}

/// The three kinds of traffic. Not `#[non_exhaustive]`: a fourth kind would be
/// a new protocol, not an extension of this one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
// Frames are decoded, handled and dropped one at a time; boxing the large
// status report would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Body {
    /// CLI to hypervisor.
    Request(Request),
    /// Hypervisor to CLI, answering the request with the same `seq`.
    Response(Response),
    /// Hypervisor to CLI, unsolicited (log lines, trace records).
    Event(Event),
}

/// A command from the CLI to the hypervisor. Each gets exactly one
/// [`Response`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Request {
    /// Opens a session. Answered by [`Response::Hello`], or by
    /// [`Response::VersionMismatch`] when `version` is not the hypervisor's.
    Hello {
        /// The client's [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
        version: u16,
        /// Free-form client name and version, for logs.
        client: String,
    },
    /// Asks for a [`StatusReport`].
    Status,
    /// Stops the guest: its vCPUs are no longer resumed.
    Stop,
    /// Answered by [`Response::Pong`] with the same nonce.
    Ping {
        /// Any value; echoed back.
        nonce: u64,
    },
    /// Looks up guest kernel symbols matching a glob (`vfs_*`), one page
    /// at a time: answered by [`Response::Syms`] with at most `limit`
    /// matches, scanning the symbol table (in address order) from `cursor`
    /// (0 for the first page, then the answer's `next`).
    Syms {
        /// The glob pattern.
        glob: String,
        /// Type letters to keep (`"tT"`); empty keeps every type.
        kinds: String,
        /// Keep only this module's symbols; empty keeps the kernel image's
        /// and every module's.
        module: String,
        /// Where to resume the scan.
        cursor: u32,
        /// Most matches wanted in this answer (the hypervisor may send fewer
        /// to stay within a frame).
        limit: u32,
    },
    /// Adds a probe, in kprobe_events syntax.
    ProbeAdd {
        /// The probe definition.
        spec: String,
    },
    /// Removes the probe with this name.
    ProbeDel {
        /// The probe's name.
        name: String,
    },
    /// Lists the probes.
    ProbeList,
    /// Starts streaming trace events, rendered in `format`: the
    /// hypervisor drains its per-vCPU rings into [`Event::TraceText`]
    /// frames. Events recorded before the stream started are kept in the
    /// rings (up to their size) and come first.
    TraceStart {
        /// How the hypervisor renders each event.
        format: TraceFormat,
    },
    /// Stops streaming; events stay in the rings (and are lost, and
    /// counted, once a ring is full).
    TraceStop,
    /// Runs a shell command in the guest. Served by the host-side launcher,
    /// which owns the guest console; the hypervisor answers `Unsupported`.
    Exec {
        /// The command line for the guest's shell.
        command: String,
    },
    /// Adds the plain function tracer (`func <-parent` lines) on every
    /// traceable function matching the glob. Answered by
    /// [`Response::FunctionAdded`].
    FunctionAdd {
        /// The glob (`vfs_*`, `*`).
        glob: String,
    },
    /// Removes the function tracer from every function.
    FunctionClear,
    /// Reads the trace lines the host launcher has buffered, from `cursor`
    /// (0 at first, then the answer's `next`), waiting up to `wait_ms` for
    /// the first one. Served by the host-side launcher, which subscribes to
    /// the hypervisor's stream; the hypervisor answers `Unsupported`.
    TraceRead {
        /// Where to continue.
        cursor: u64,
        /// The format wanted; the stream is switched to it if needed.
        format: TraceFormat,
        /// Longest wait for a first line, in milliseconds.
        wait_ms: u32,
        /// Only lines of this source (see [`Event::TraceText`]); `None`:
        /// every source.
        source: Option<u32>,
    },
    /// Starts a function-graph session (returns hijacked in VMX root).
    /// Up to 15 sessions, each with its own filter, run at once and share
    /// the return frames. Answered by [`Response::GraphStarted`].
    GraphStart(GraphFilter),
    /// Stops one session (`None`: all of them): no new calls are hijacked
    /// for it; calls in flight still return through the hypervisor.
    GraphStop {
        /// The session, as [`Response::GraphStarted`] named it.
        session: Option<u32>,
    },
    /// Chooses the path of [`Event::TraceText`]: the control channel
    /// (the default), or the hypervisor's log port, which the host that
    /// launched the emulator captures. Sent by that host once the
    /// hypervisor is up; a host that does not read the log port never
    /// sends it.
    TraceChannel {
        /// The path.
        channel: TraceChannel,
    },
    /// Starts counting calls (bcc's funccount) in VMX root: every function
    /// matching a glob is hooked, and each call adds one to the function's
    /// counter; no event is recorded, so nothing is lost however hot the
    /// functions are. One count runs at a time. Answered by
    /// [`Response::CountStarted`].
    CountStart(CountFilter),
    /// Reads the counters (they keep counting): the functions called at
    /// least once, in address order from `cursor` (0 for the first page,
    /// then the answer's `next`). Answered by [`Response::Counts`].
    CountRead {
        /// Where to resume (a function's address).
        cursor: u64,
        /// Most functions wanted in this answer (the hypervisor may send
        /// fewer to stay within a frame).
        limit: u32,
    },
    /// Stops counting and unhooks what only the count used.
    CountStop,
    /// Reads the count's histograms ([`CountFilter::hist`]), a key per
    /// row, from row `cursor` (0 for the first page, then the answer's
    /// `next`). Answered by [`Response::Hist`].
    HistRead {
        /// Where to resume.
        cursor: u32,
    },
    /// Sends the host a copy of root's kernel symbol index (the guest's
    /// kallsyms tables in their own encoding, behind a header) along the
    /// trace stream's path ([`TraceChannel::LogPort`] or
    /// [`TraceChannel::SharedRing`]): answered by
    /// [`Response::SymbolsExport`], then [`Event::SymbolChunk`]s in order
    /// on that path, some each hypervisor turn after the stream's own
    /// frames; then the modules' index, and a new copy of it whenever the
    /// loaded modules change. A new request starts over (new ids).
    SymbolsExport,
    /// The guest's system calls (its `sys_call_table`, with argument names
    /// and types from its own metadata or BTF), from number index `cursor`
    /// (0 for the first page, then the answer's `next`). Answered by
    /// [`Response::Syscalls`].
    Syscalls {
        /// Where to resume.
        cursor: u32,
    },
    /// Gates probe `name` on graph session `session` (a gate session,
    /// [`GraphFilter::gate`], or any session that filters by pid or comm
    /// without roots): the probe then records only for the tasks the
    /// session's filter admits, and its site is left unhooked on the quiet
    /// views, where no such task runs. `None` opens the gate again: the
    /// probe records for every task. A stopped session opens the gates of
    /// its probes. Answered by [`Response::Ok`].
    ProbeGate {
        /// The probe's name (`GROUP/EVENT` or `EVENT`).
        name: String,
        /// The session.
        session: Option<u32>,
    },
    /// The guest's symbols as `/proc/kallsyms` prints them (the kernel
    /// image's, then the modules' with `[module]`), from byte `offset` of
    /// that text: answered by the supervisor from its copy of root's
    /// index ([`Response::Kallsyms`]), which the trace stream brings.
    Kallsyms {
        /// Where this page starts.
        offset: u64,
    },
    /// Records the scheduler's task switches (`switch`) and wakeups
    /// (`wakeup`), as the kernel's `sched/sched_switch` and
    /// `sched/sched_wakeup` events, from root's hooks on the scheduler's
    /// switch path (the quiet views' hook, placed for this too) and on
    /// `try_to_wake_up`: one VM exit per switch, and one per wakeup call,
    /// while on. Answered by [`Response::Ok`].
    Sched {
        /// Switches on or off.
        switch: bool,
        /// Wakeups on or off.
        wakeup: bool,
    },
}

/// A histogram of one fetch argument (bpftrace's `hist()`), kept in root
/// for each key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistFilter {
    /// An entry probe in kprobe_events syntax whose first fetch argument
    /// is the value (`p vfs_read count=%dx:u64`); its function is the one
    /// counted.
    pub spec: String,
    /// What the calls are grouped by.
    pub key: HistKey,
}

/// The key of a histogram's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum HistKey {
    /// The probed function (one row).
    Function,
    /// The calling task's comm.
    Comm,
    /// The calling thread's id.
    Pid,
}

/// One key's histogram.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistRow {
    /// The key as text: a function's name, a comm, a pid.
    pub key: String,
    /// Calls by value, in the [`LATENCY_BUCKETS`] log2 buckets (bucket 0:
    /// the value 0; N: 2^(N-1) to 2^N - 1), trailing empty buckets left
    /// out.
    pub buckets: Vec<u64>,
}

/// What [`Request::CountStart`] counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountFilter {
    /// Globs of the functions counted (`vfs_*`, `ext4:*`).
    pub functions: Vec<String>,
    /// Only calls made by this thread id.
    pub pid: Option<i32>,
    /// Only calls made by tasks with this comm.
    pub comm: Option<String>,
    /// Also time each call, through the return hijack (bcc's
    /// funclatency): a log2 histogram of the durations over every
    /// counted function.
    pub latency: bool,
    /// A histogram of a fetch argument instead of globs: `functions` is
    /// left empty, and the spec's function is counted.
    pub hist: Option<HistFilter>,
    /// A session that filters tasks without roots (a gate,
    /// [`GraphFilter::gate`], with the count's own `pid` and `comm`): the
    /// counted functions are then left unhooked on the vCPUs that run
    /// other tasks (the quiet views), so that those tasks' calls cost
    /// nothing. The count still applies its own filter.
    pub gate: Option<u32>,
}

/// Buckets of a latency histogram: bucket 0 holds durations of 0 ns,
/// bucket N (1 to 62) those of 2^(N-1) to 2^N - 1 ns, bucket 63 the rest.
pub const LATENCY_BUCKETS: usize = 64;

/// One function's count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCount {
    /// Its name, with `[module]` for a module's function.
    pub name: String,
    /// Its address.
    pub addr: u64,
    /// Calls counted.
    pub calls: u64,
    /// With [`CountFilter::latency`]: the timed calls that returned an
    /// errno (a value from -4095 to -1 as a `long`, as system calls and
    /// `ERR_PTR` do); 0 otherwise.
    pub errors: u64,
    /// With [`CountFilter::latency`]: the timed calls' durations, summed,
    /// in nanoseconds; 0 otherwise.
    pub total_ns: u64,
}

/// The path trace events take to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TraceChannel {
    /// COM2, with the answers (about 11.5 KB/s in Bochs).
    Control,
    /// The log port (I/O port 0xE9: Bochs `port_e9_hack`, QEMU
    /// `-debugcon`): each frame is written whole, between `0x00`
    /// delimiters, among the log's text lines (which never hold `0x00`),
    /// with no baud pacing. Frames on it have their own event sequence.
    LogPort,
    /// A ring in hypervisor memory ([`crate::ring`]) that the host reads
    /// from the file backing the guest's RAM (QEMU's
    /// `memory-backend-file,share=on`): each frame, as the control channel
    /// encodes it, is one record. Answered by [`Response::TraceRing`].
    SharedRing,
    /// As [`TraceChannel::SharedRing`] for frames, and the host reads
    /// the vCPUs' record rings themselves (each written by its vCPU in
    /// root, [`crate::ring`] layout) once the stream is in
    /// [`TraceFormat::Records`]: root then sends no record, only the
    /// context, its clock and the symbols on the frame ring, and
    /// [`Event::TraceDoorbell`] on COM2 when a record ring fills. Answered
    /// by [`Response::TraceRings`].
    SharedRings,
}

/// What the function-graph tracer traces, in the ftrace names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphFilter {
    /// `set_graph_function`: globs of the functions whose call trees are
    /// traced. Empty: every hooked function starts a tree.
    pub functions: Vec<String>,
    /// `set_ftrace_filter`: globs of the functions hooked beneath them.
    /// Empty: every traceable function (`*`).
    pub trace: Vec<String>,
    /// `set_ftrace_notrace`: globs never hooked (their callees still show,
    /// as children of the nearest traced caller).
    pub notrace: Vec<String>,
    /// `set_graph_notrace`: globs whose calls, and everything beneath
    /// them, are left out of the session's trees.
    pub graph_notrace: Vec<String>,
    /// `max_graph_depth`; 0 = unlimited.
    pub max_depth: u32,
    /// Only this thread id.
    pub pid: Option<i32>,
    /// Only tasks with this comm.
    pub comm: Option<String>,
    /// `funcgraph-retval`: print return values.
    pub retval: bool,
    /// Frames each guest kernel stack's return stack holds, 1 to 256.
    /// Deeper calls are not hijacked and count as misses. The return
    /// stacks are shared: while another session runs or frames are in
    /// flight, 0 keeps the size in use and another size is refused;
    /// otherwise 0 is the default, 32.
    pub stack_frames: u32,
    /// A gate: the session hooks and records nothing (no globs may be
    /// given); its pid or comm filter gates the probes put behind it
    /// ([`Request::ProbeGate`]), and picks the views of their sites.
    pub gate: bool,
}

/// How trace events are rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TraceFormat {
    /// trace_pipe lines.
    Text,
    /// One JSON object per line.
    Json,
    /// Raw records ([`Event::TraceRecords`]) with what renders them
    /// ([`Event::TraceContext`]), for the host to render: taken only on
    /// the log port or the shared ring.
    Records,
    /// [`TraceFormat::Records`], and root's own rendering of the same
    /// records as trace_pipe and function_graph text (`TraceText` in
    /// [`TraceFormat::Text`]) beside them: for recording a stream and
    /// checking the host's renderer against root's. Taken only on the log
    /// port or the shared ring.
    RecordsAndText,
}

/// The hypervisor's answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
// A status report is much larger than the other answers; responses are
// built, encoded and dropped one at a time, so boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Response {
    /// Session accepted.
    Hello {
        /// The hypervisor's [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
        version: u16,
        /// Free-form hypervisor name and version.
        hypervisor: String,
    },
    /// Answer to [`Request::Status`].
    Status(StatusReport),
    /// Answer to [`Request::Ping`].
    Pong {
        /// The request's nonce.
        nonce: u64,
    },
    /// The request was carried out and has nothing to report.
    Ok,
    /// The request failed.
    Error {
        /// The class of failure, for programs.
        kind: ErrorKind,
        /// One line for people.
        message: String,
    },
    /// The peer speaks another protocol version; nothing else it sent was
    /// understood.
    VersionMismatch {
        /// The version of the side that answers.
        ours: u16,
        /// The version the other side announced.
        theirs: u16,
    },
    /// Answer to [`Request::Syms`].
    Syms {
        /// Matches in all; counted on the first page (cursor 0) only.
        total: Option<u32>,
        /// The cursor for the next page; `None` after the last one.
        next: Option<u32>,
        /// The matches of this page.
        symbols: Vec<SymbolInfo>,
    },
    /// Answer to [`Request::Exec`].
    Exec {
        /// What the command printed (stdout and stderr interleaved).
        output: String,
        /// Its exit status.
        status: i32,
    },
    /// Answer to [`Request::ProbeAdd`]: the probe is armed.
    ProbeAdded {
        /// `GROUP/EVENT`.
        name: String,
        /// The fentry site it is attached to.
        site: u64,
    },
    /// Answer to [`Request::ProbeList`].
    Probes(Vec<ProbeInfo>),
    /// Answer to [`Request::FunctionAdd`].
    FunctionAdded {
        /// Functions that matched the glob and are now traced.
        traced: u32,
        /// Matches that were not traced, and why (the first few).
        skipped: Vec<String>,
        /// All matches that were not traced.
        skipped_total: u32,
    },
    /// Answer to [`Request::GraphStart`].
    GraphStarted {
        /// The session's number (1 to 15): its lines carry it as their
        /// source, and [`Request::GraphStop`] takes it.
        session: u32,
        /// Functions hooked for the graph.
        hooked: u32,
        /// Functions matching `functions` (the tree roots).
        roots: u32,
        /// Matches that could not be hooked.
        skipped: u32,
    },
    /// Answer to [`Request::CountStart`].
    CountStarted {
        /// Functions hooked for the count.
        functions: u32,
        /// Matches that could not be hooked, and why (the first few).
        skipped: Vec<String>,
        /// All matches that could not be hooked.
        skipped_total: u32,
    },
    /// Answer to [`Request::CountRead`].
    Counts(CountPage),
    /// Answer to [`Request::TraceChannel`] with
    /// [`TraceChannel::SharedRing`]: where the ring is.
    TraceRing {
        /// Its guest-physical address (the start of its header).
        gpa: u64,
        /// Its bytes, header included.
        len: u64,
    },
    /// Answer to [`Request::HistRead`].
    Hist {
        /// The rows of this page.
        rows: Vec<HistRow>,
        /// The cursor for the next page; `None` after the last one.
        next: Option<u32>,
        /// Calls whose key found no room (the keys are bounded), counted
        /// and not placed.
        overflow: u64,
        /// Calls whose value could not be read (`(fault)`).
        faults: u64,
        /// Most keys the histogram holds.
        max_keys: u32,
    },
    /// Answer to [`Request::TraceRead`].
    Trace {
        /// The cursor to read on from.
        next: u64,
        /// Complete lines, each ending in a newline.
        text: String,
        /// Lines lost between `cursor` and `next` (the launcher's buffer is
        /// bounded, and the hypervisor reports its own losses inline).
        lost: u64,
    },
    /// Answer to [`Request::SymbolsExport`]: the export is under way.
    SymbolsExport {
        /// Its id, which its chunks carry.
        id: u32,
        /// Bytes it has in all.
        bytes: u64,
        /// Symbols in it.
        symbols: u32,
    },
    /// Answer to [`Request::TraceChannel`] with
    /// [`TraceChannel::SharedRings`]: where the rings are.
    TraceRings {
        /// The frame ring (as [`Response::TraceRing`]).
        frames: RingAt,
        /// The record rings, one per vCPU, in root's vCPU order.
        records: Vec<RingAt>,
        /// Byte offset of each record's little-endian `u64` timestamp
        /// (root's clock, nanoseconds): the rings merge on it.
        stamp_at: u32,
    },
    /// Answer to [`Request::Syscalls`]: one page of the guest's calls.
    Syscalls {
        /// Calls in all.
        total: u32,
        /// The cursor of the next page; `None` after the last one.
        next: Option<u32>,
        /// This page's calls, in number order.
        calls: Vec<SyscallInfo>,
    },
    /// Answer to [`Request::Kallsyms`]: one page of the listing.
    Kallsyms {
        /// Whole lines from the offset asked for.
        text: String,
        /// Where the next page starts; `None` after the last one.
        next: Option<u64>,
        /// Bytes of the whole listing.
        total: u64,
    },
}

/// Where a ring is in guest-physical memory (in hypervisor memory there:
/// outside the guest's e820 and absent from its EPT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingAt {
    /// The start of its header.
    pub gpa: u64,
    /// Its bytes, header included.
    pub len: u64,
}

/// One probe, as `probe list` shows it (in the manner of kprobe_profile).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeInfo {
    /// `GROUP/EVENT`.
    pub name: String,
    /// The definition as the kernel would print it in kprobe_events.
    pub spec: String,
    /// The probed function.
    pub symbol: String,
    /// The fentry site (0 while pending).
    pub site: u64,
    /// Hits recorded.
    pub hits: u64,
    /// Hits not recorded (the ring was full).
    pub misses: u64,
    /// The probe waits for its module to load (or to load again).
    pub pending: bool,
}

/// What VMX root did to keep the guest out and its events whole, in a
/// [`StatusReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuardReport {
    /// NMIs that arrived while the guest ran (NMI exits).
    pub nmi_exits: u64,
    /// NMIs that arrived while root itself ran (taken through root's IDT).
    pub nmis_in_root: u64,
    /// NMIs injected into the guest.
    pub nmis_injected: u64,
    /// NMI-window exits (an NMI waited for the guest to unblock NMIs).
    pub nmi_windows: u64,
    /// Events whose delivery an exit interrupted, delivered again.
    pub events_reinjected: u64,
    /// Guest writes to the hypervisor's log port, dropped.
    pub debug_port_writes: u64,
    /// Guest XSETBV values refused with #GP.
    pub xsetbv_refused: u64,
    /// Guest control-register values refused with #GP.
    pub cr_writes_refused: u64,
    /// Guest moves of the local APIC's window into hypervisor memory,
    /// refused with #GP.
    pub apic_moves_refused: u64,
    /// PCI configuration writes refused or changed: bus mastering, a
    /// memory window over hypervisor memory, the protected IDE I/O BAR.
    pub pci_writes_refused: u64,
    /// Guest writes to the bus-master IDE registers, dropped.
    pub dma_port_writes_blocked: u64,
    /// String I/O (INS/OUTS) elements on intercepted ports, emulated.
    pub string_io_emulated: u64,
    /// Task switches (legacy protected mode), emulated.
    pub task_switches: u64,
}

/// The tracer's counters, in a [`StatusReport`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TracerReport {
    /// Probes defined.
    pub probes: u32,
    /// Functions under the function tracer.
    pub functions: u32,
    /// fentry sites patched (in shadow pages).
    pub sites: u32,
    /// Code pages executing from a shadow copy.
    pub pages: u32,
    /// Entry hypercalls served: from a hooked site, with the trampoline's
    /// frame. Refused entries are `forged_entries`; an entry whose frame
    /// could not be read counts as a lost event only.
    pub hits: u64,
    /// Events lost because a ring was full.
    pub lost: u64,
    /// Guest reads and writes of hooked pages that were single-stepped.
    pub steps: u64,
    /// Further pages opened within one stepped instruction (an instruction
    /// touching two watched pages).
    pub steps_widened: u64,
    /// Guest writes to hooked pages (shadow re-synced after each).
    pub guest_writes: u64,
    /// Times the trampoline region's page-table entry had to be restored.
    pub region_restores: u64,
    /// VMCALLs from outside the trampolines (answered with #UD).
    pub foreign_vmcalls: u64,
    /// Entry hypercalls refused: the frame was not at RSP, the site is not
    /// hooked, or `pt_regs.ip` is not the site + 5 (a jump into the entry
    /// trampoline with forged registers; also a call that was in flight
    /// when its site was unhooked). No event is recorded for them.
    pub forged_entries: u64,
    /// Guest writes to hypervisor-owned pages, discarded.
    pub blocked_writes: u64,
    /// Guest-virtual address of the trampoline page (0 until the first
    /// probe or function is added).
    pub trampolines: u64,
    /// Function-graph: frames live on the return stacks now.
    pub graph_frames: u64,
    /// Function-graph: guest kernel stacks with a return stack.
    pub graph_stacks: u64,
    /// Function-graph: bytes of hypervisor memory the return stacks hold.
    pub graph_bytes: u64,
    /// Function-graph: calls not hijacked because a return stack was full.
    pub graph_misses: u64,
    /// Function-graph: frames dropped because their call never returned
    /// (the stack unwound past them, or the task died).
    pub graph_dropped: u64,
    /// Function-graph: returns through the trampoline with no frame (#UD).
    pub graph_orphans: u64,
    /// Function-graph: frames reclaimed because their task died (its kernel
    /// stack was released).
    pub graph_reaped: u64,
    /// Function-graph sessions running.
    pub graph_sessions: u32,
    /// Return probes (`r:`), also counted in `probes`.
    pub retprobes: u32,
    /// Hits that found the return stacks' lock held by another vCPU (the
    /// tracer's only lock that hits on different vCPUs share, besides the
    /// heap's and the log's; it is never held across a guest memory
    /// access).
    pub stack_lock_waits: u64,
    /// Root's hidden hooks on the kernel's module code (0 or 2), also
    /// counted in `sites`.
    pub module_hooks: u32,
    /// Module loads seen at them.
    pub module_loads: u64,
    /// Module unloads seen at them.
    pub module_unloads: u64,
    /// Probes armed when their module loaded.
    pub module_armed: u64,
    /// Sites unhooked when their module was going.
    pub module_unhooked: u64,
    /// Probes waiting for their module.
    pub pending_probes: u32,
    /// Module globs (`MOD:GLOB`) that also cover modules loaded later:
    /// the function tracer's, and one per graph session that has some.
    pub module_globs: u32,
    /// Functions hooked at module loads for those globs.
    pub module_followed: u64,
    /// Modules' init texts freed after their init returned, seen at the
    /// hidden hook that follows it (none: init text is not traced).
    pub module_inits_freed: u64,
    /// Sites unhooked there (also counted in `module_unhooked`).
    pub module_init_unhooked: u64,
    /// Hooked pages the quiet EPT views map to the guest's own frames:
    /// every site on them matters only beneath a graph session's roots,
    /// and a vCPU inside none of those roots runs them unhooked.
    pub quiet_pages: u32,
    /// Hooked pages the quiet views map to partial shadows of their own:
    /// hooked there only at the sites that matter everywhere.
    pub quiet_partial: u32,
    /// Whether root's hook on the scheduler's switch path (which picks a
    /// vCPU's view for the task coming in) is installed.
    pub switch_hook: bool,
    /// Page changes in the quiet views put off because a vCPU was inside
    /// one of the page's sites.
    pub quiet_busy: u64,
}

impl Response {
    /// A [`Response::Error`].
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Response::Error {
            kind,
            message: message.into(),
        }
    }
}

/// One page of the call count's counters ([`Response::Counts`]). The host
/// merges the pages of one read into one, with `next` left `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountPage {
    /// Functions counted (hooked), called or not.
    pub functions: u32,
    /// Calls counted over every function.
    pub calls: u64,
    /// Calls of counted functions left out by the pid or comm filter.
    pub filtered: u64,
    /// Root time since the count started, in nanoseconds.
    pub elapsed_ns: u64,
    /// Bytes of hypervisor memory the count holds.
    pub memory: u64,
    /// The functions of this page called at least once.
    pub entries: Vec<FunctionCount>,
    /// The cursor for the next page; `None` after the last one.
    pub next: Option<u64>,
    /// With `latency`: calls timed, by duration, in the
    /// [`LATENCY_BUCKETS`] log2 buckets (trailing empty buckets left
    /// out); empty otherwise.
    pub latency: Vec<u64>,
    /// Calls that could not be timed (their return could not be
    /// hijacked: a return stack full, no room for one).
    pub latency_missed: u64,
}

/// Classes of failure in [`Response::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The hypervisor does not implement this request (yet).
    Unsupported,
    /// The request frame could not be decoded.
    Malformed,
    /// The request is well-formed but its arguments are not acceptable.
    InvalidArgument,
    /// What the request names does not exist (symbol, probe).
    NotFound,
    /// What the request would create already exists.
    AlreadyExists,
    /// The request cannot be served in the current state (guest not booted).
    NotReady,
    /// A fixed-size table or the hypervisor heap is full.
    OutOfResources,
    /// A bug in the hypervisor.
    Internal,
}

impl core::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Malformed => "malformed request",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::NotReady => "not ready",
            ErrorKind::OutOfResources => "out of resources",
            ErrorKind::Internal => "internal error",
        })
    }
}

/// The hypervisor's state, answering [`Request::Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Free-form hypervisor name and version.
    pub hypervisor_version: String,
    /// The hypervisor's [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
    pub protocol_version: u16,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Time since the hypervisor started, in nanoseconds.
    pub uptime_ns: u64,
    /// What the guest is doing.
    pub guest_state: GuestState,
    /// VM-exit counts by basic exit reason, the reasons that occurred only.
    pub exits: Vec<ExitCount>,
    /// All VM exits.
    pub exits_total: u64,
    /// Hypervisor memory in use (frames handed out, heap included), in bytes.
    pub hv_memory_used: u64,
    /// Hypervisor memory reserved in all, in bytes.
    pub hv_memory_total: u64,
    /// Bytes of the hypervisor's heap in use (the heap is one fixed
    /// region of `hv_memory_used`).
    pub hv_heap_used: u64,
    /// The task running on the reporting vCPU, once introspection knows it.
    pub current_task: Option<TaskInfo>,
    /// The control channel's own counters, as the hypervisor sees them.
    pub channel: ChannelReport,
    /// What introspection found in guest memory, once it ran.
    pub kernel: Option<KernelReport>,
    /// The tracer's counters.
    pub tracer: TracerReport,
    /// VMX root's own guard counters.
    pub guard: GuardReport,
    /// Each vCPU, the boot processor first.
    pub per_vcpu: Vec<VcpuReport>,
    /// Each function-graph session running, by number.
    pub graph_sessions: Vec<GraphSessionReport>,
}

/// One function-graph session in [`StatusReport::graph_sessions`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphSessionReport {
    /// Its number (1 to 15).
    pub session: u32,
    /// Functions hooked for it.
    pub hooked: u32,
    /// Its roots (0: it has none, and every hooked function starts a
    /// tree).
    pub roots: u32,
    /// Its hooked functions the quiet EPT views leave unhooked (they
    /// matter only beneath its roots, or for the tasks its filter admits).
    pub quiet: u32,
}

/// One vCPU in [`StatusReport::per_vcpu`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuReport {
    /// Root's index of the vCPU (0: the boot processor).
    pub index: u32,
    /// Its local APIC ID.
    pub apic_id: u32,
    /// Parked in wait-for-SIPI: not started by the guest yet, or offline
    /// after an INIT.
    pub parked: bool,
    /// Its VM exits.
    pub exits_total: u64,
    /// Time it waited for the VM lock, in nanoseconds, and how often it
    /// took the lock.
    pub lock_wait_ns: u64,
    /// How often it took the VM lock.
    pub lock_takes: u64,
    /// Time it was held in root while another vCPU changed what every
    /// vCPU executes (hooking, unhooking), in nanoseconds.
    pub held_ns: u64,
    /// Trace records its ring lost (full, or a hit that could not be
    /// recorded).
    pub lost: u64,
    /// Its VMCALL exits (one per traced call's entry, one per return
    /// through a graph or return-probe frame).
    pub vmcalls: u64,
    /// Hypercalls it served under the VM lock's shared side, with other
    /// vCPUs' hits running at the same time.
    pub shared_takes: u64,
    /// Time it waited to take the shared side, in nanoseconds.
    pub shared_wait_ns: u64,
    /// Its hypercalls, each exactly one of: an entry from a hooked site
    /// recorded (`hits`), a return through a frame handed back
    /// (`returns`), or anything else (`refused`: forged, foreign, orphan
    /// returns, unreadable frames). Counted as they happen; `vmcalls`
    /// (the exit counter) is published at the vCPU's turns.
    pub hits: u64,
    /// See `hits`.
    pub returns: u64,
    /// See `hits`.
    pub refused: u64,
    /// Its moves between the armed EPT view (every hook) and the quiet
    /// one (no hook that matters only beneath a graph session's roots).
    pub view_switches: u64,
    /// Time on the armed view and on the quiet one since its first move,
    /// in nanoseconds.
    pub armed_ns: u64,
    /// See `armed_ns`.
    pub quiet_ns: u64,
    /// Whether it runs on the quiet view now.
    pub quiet: bool,
    /// The deepest its VMX-root stack has been used, in bytes (the
    /// stack is filled with a pattern before root runs on it), and the
    /// stack's size.
    pub root_stack_used: u64,
    /// See `root_stack_used`.
    pub root_stack_size: u64,
    /// What its exits would cost a nested KVM beyond the exits
    /// themselves: VMREADs and VMWRITEs of fields KVM's shadow VMCS does
    /// not hold, and INVEPTs (each an exit to KVM). Counted in Bochs too.
    pub vmcs_unshadowed: u64,
    /// See `vmcs_unshadowed`.
    pub invept: u64,
    /// Root's time on its hypercalls, by what each was (see `hits`): from
    /// the VM exit to the next entry, less any turn taken on the way. In
    /// Bochs, whose TSC advances one tick an instruction at 50 M
    /// instructions a second, 20 ns is one instruction.
    pub root_hit: RootTime,
    /// See `root_hit`.
    pub root_return: RootTime,
    /// See `root_hit`.
    pub root_refused: RootTime,
    /// Root's time on its turns: the control channel, the trace stream's
    /// drain, introspection, whatever exit they follow.
    pub root_turns: RootTime,
}

/// How long root spent on one kind of work, over its occurrences.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootTime {
    /// Occurrences.
    pub count: u64,
    /// Their time together, in nanoseconds.
    pub sum_ns: u64,
    /// The shortest and the longest (0 when there was none).
    pub min_ns: u64,
    /// See `min_ns`.
    pub max_ns: u64,
}

/// The guest kernel as recovered from its memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelReport {
    /// The release from the banner (`6.1.0-57-amd64`).
    pub release: String,
    /// `_text` minus its link address.
    pub kaslr_slide: i64,
    /// Symbols recovered from kallsyms.
    pub symbols: u32,
    /// Text symbols (t/T/w/W in text) among them.
    pub text_symbols: u32,
    /// Functions with an fentry site.
    pub traceable: u32,
    /// Heap bytes the symbol index uses.
    pub index_bytes: u64,
    /// Time the recovery took in VMX root (guest time), nanoseconds.
    pub recovery_ns: u64,
    /// Why the task layout (pid/comm) is unknown, if it is.
    pub task_layout_error: Option<String>,
    /// The loaded modules as of the last walk of the module list (at the
    /// last request that looked symbols up).
    pub modules: ModulesReport,
}

/// What the last walk of the guest's module list found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModulesReport {
    /// Walks done.
    pub walks: u32,
    /// Modules on the list.
    pub modules: u32,
    /// Their symbols, over all modules.
    pub symbols: u32,
    /// Heap bytes the module index takes in root.
    pub index_bytes: u64,
    /// Root time the last walk took (guest time), nanoseconds.
    pub walk_ns: u64,
    /// Why the last walk failed (no module symbols are known then) or
    /// module symbols are unavailable, if so.
    pub error: Option<String>,
}

/// A record chunk's header bit: the chunk goes on with the record of the
/// chunk before it ([`Event::TraceRecords`]).
pub const RECORD_CONTINUES: u32 = 1 << 30;
/// A record chunk's header bit: the record goes on in the next chunk.
pub const RECORD_MORE: u32 = 1 << 31;
/// The bytes of a record chunk, in its header.
pub const RECORD_LEN_MASK: u32 = RECORD_CONTINUES - 1;

/// One piece of the rendering context ([`Event::TraceContext`]): a
/// `Begin`, the probes and graph sessions, an `End`; the host renders
/// with the new context from the `End` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RenderContext {
    /// A new context starts.
    Begin,
    /// A probe: its id in the records and its definition as
    /// `kprobe_events` prints it.
    Probe {
        /// The id its records carry.
        id: u32,
        /// The definition.
        spec: String,
    },
    /// A function-graph session.
    Graph {
        /// Its number (1 to 15).
        number: u8,
        /// Its generation (0 to 15), which its records carry.
        generation: u8,
        /// Whether its lines show return values.
        retval: bool,
    },
    /// The context is whole.
    End,
}

/// What a [`Event::SymbolChunk`] is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SymbolsPart {
    /// The kernel image's symbol index (the guest's kallsyms tables,
    /// packed).
    Kernel,
    /// The loaded modules and their symbols, packed.
    Modules,
}

/// One system call of a [`Response::Syscalls`] answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyscallInfo {
    /// Its number (its index in the guest's `sys_call_table`).
    pub nr: u32,
    /// Its name (`openat`).
    pub name: String,
    /// The function the table points at (`__x64_sys_openat`), whose one
    /// argument is the caller's `struct pt_regs *`.
    pub entry: String,
    /// (C type, name) of each argument (empty when the guest describes
    /// none: then its six argument registers are traced raw).
    pub args: Vec<(String, String)>,
    /// Where the arguments came from: `metadata` (the guest's ftrace
    /// syscall metadata), `btf` (`__do_sys_NAME`'s prototype), `table`
    /// (the kernel source's syscalls.h prototype, from hvtrace's generated
    /// ABI table) or `none`.
    pub source: String,
    /// The structs the call reads from its caller (`openat2`'s `struct
    /// open_how`), laid out from the guest's BTF.
    pub structs: Vec<SyscallStruct>,
    /// A 32-bit call of IA32 emulation (`__ia32_sys_*`,
    /// `__ia32_compat_sys_*`; its number is the i386 ABI's, its
    /// arguments in bx, cx, dx, si, di, bp).
    pub compat: bool,
}

/// A struct a system call reads from its caller, by a user pointer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyscallStruct {
    /// The pointer argument's index (0 for the first).
    pub arg: u8,
    /// The struct's name (`open_how`).
    pub name: String,
    /// Its scalar members, in order.
    pub fields: Vec<SyscallField>,
}

/// A scalar member of a [`SyscallStruct`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyscallField {
    /// Its name.
    pub name: String,
    /// Its byte offset.
    pub offset: u32,
    /// Its bytes: 1, 2, 4 or 8.
    pub size: u8,
    /// Whether it is a signed integer.
    pub signed: bool,
}

/// One symbol of a [`Response::Syms`] answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SymbolInfo {
    /// Name.
    pub name: String,
    /// Runtime (KASLR) address.
    pub addr: u64,
    /// Size up to the next symbol, when known.
    pub size: u64,
    /// Type letter, as /proc/kallsyms prints it.
    pub kind: u8,
    /// The fentry site, for traceable functions.
    pub site: Option<u64>,
    /// Why the symbol cannot be traced, when it cannot (empty when it can).
    pub not_traceable: String,
    /// The module the symbol belongs to (empty for the kernel image's own).
    pub module: String,
}

/// Control-channel counters kept by the hypervisor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelReport {
    /// Bytes received from the host.
    pub bytes_in: u64,
    /// Bytes sent to the host.
    pub bytes_out: u64,
    /// Well-formed frames received.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Malformed frames received (garbage, cut frames, bad CRC, other
    /// versions); each was skipped and decoding resumed at the next delimiter.
    pub bad_frames: u64,
    /// Responses dropped because the output queue was full.
    pub dropped: u64,
    /// Trace frames written to the log port ([`TraceChannel::LogPort`]).
    pub bulk_frames: u64,
    /// Bytes of those frames, delimiters included.
    pub bulk_bytes: u64,
}

/// The guest's life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GuestState {
    /// Started, the kernel not yet found in memory.
    Booting,
    /// The kernel is running.
    Running,
    /// Halted by [`Request::Stop`] or by a fatal exit.
    Stopped,
}

/// How many VM exits of one reason there were.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitCount {
    /// Basic exit reason (SDM Appendix C).
    pub reason: u16,
    /// Its name (`EPT_VIOLATION`), so the CLI needs no table of its own.
    pub name: String,
    /// Exits with this reason.
    pub count: u64,
}

/// A guest task, as introspection sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    /// `task_struct.pid` (the thread id).
    pub pid: i32,
    /// `task_struct.comm`.
    pub comm: String,
    /// The vCPU it runs on.
    pub cpu: u32,
}

/// An unsolicited message from the hypervisor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Event {
    /// A log line of the hypervisor.
    Log {
        /// The line, without newline.
        text: String,
    },
    /// Events were dropped (ring or channel full) since the last `Lost`.
    Lost {
        /// How many.
        count: u64,
    },
    /// Trace records from one vCPU's ring. The payload layout is defined by
    /// the tracer; this variant only carries it.
    Trace {
        /// The vCPU.
        cpu: u32,
        /// Time of the first record, in nanoseconds since the hypervisor started.
        timestamp_ns: u64,
        /// The records.
        #[serde(with = "crate::bytes")]
        payload: Vec<u8>,
    },
    /// Rendered trace events (after [`Request::TraceStart`]).
    TraceText {
        /// The format of `text`.
        format: TraceFormat,
        /// Who produced the lines: 0 for probes, return probes and the
        /// function tracer, N for function-graph session N.
        source: u32,
        /// Events the hypervisor lost since the previous `TraceText`.
        lost: u64,
        /// Complete lines, each ending in a newline.
        text: String,
    },
    /// VMX root hit a fatal condition (a panic, an exception in root) and
    /// is powering the machine off: the last frame of this hypervisor. It
    /// is sent by the fatal path itself, without locks or allocation
    /// ([`encode_fatal`](crate::codec::encode_fatal)), so it carries
    /// [`FATAL_SEQ`](crate::codec::FATAL_SEQ) rather than a place in the
    /// event sequence, and a reason of at most
    /// [`MAX_FATAL_REASON`](crate::codec::MAX_FATAL_REASON) bytes. The same
    /// text goes to the log port as an `error:` line.
    Fatal {
        /// What went wrong, one line (`hypervisor panic: ...`).
        reason: String,
    },
    /// A piece of a symbol export: the kernel image's index, once, after
    /// [`Request::SymbolsExport`]; the modules' index then, and again
    /// whenever the loaded modules change.
    SymbolChunk {
        /// The export's id (one sequence for both parts).
        id: u32,
        /// Which index.
        part: SymbolsPart,
        /// Bytes of the export in all.
        total: u64,
        /// Where the piece starts in the export.
        offset: u64,
        /// Its bytes.
        #[serde(with = "crate::bytes")]
        data: Vec<u8>,
    },
    /// Trace records ([`TraceFormat::Records`]), oldest first, as the
    /// vCPUs' rings hold them, each in one or more chunks: a
    /// little-endian `u32` header (bits 0-29 the chunk's bytes, bit 30
    /// [`RECORD_CONTINUES`]: it goes on with the record of the last chunk
    /// before it, bit 31 [`RECORD_MORE`]: the record goes on in the next
    /// chunk), then the bytes. An event without records says the rings
    /// were empty at `now_ns`.
    TraceRecords {
        /// Records the hypervisor lost since the last `TraceRecords`.
        lost: u64,
        /// Root's clock when the event was made, in nanoseconds.
        now_ns: u64,
        /// The chunks.
        #[serde(with = "crate::bytes")]
        data: Vec<u8>,
    },
    /// What renders the records that follow ([`TraceFormat::Records`]):
    /// sent whole whenever it changes, before any record that needs the
    /// change.
    TraceContext(RenderContext),
    /// On COM2 ([`TraceChannel::SharedRings`]): a record ring is filling;
    /// read the rings now.
    TraceDoorbell,
}
