//! The control channel in VMX root: framed requests from the host arrive on
//! the COM2 UART, are answered from the hypervisor's own state, and the
//! answers go back the same way. Served on the hypervisor's turns (the
//! preemption timer), never by waiting: the guest is not stalled for the host.
//!
//! Guest introspection runs one slice per turn ([`Introspection::turn`]).
//! A request that needs the recovered kernel while recovery is under way is
//! held (not answered, the channel still served) until recovery ends or
//! [`PARK_NS`] of root time have passed, then answered as usual: with the
//! kernel, or with recovery's progress or failure.

use crate::introspect::{CpuView, Introspection};
use crate::machine::with_world;
use crate::uart::Uart;
use alloc::collections::VecDeque;
use alloc::string::String;
use alloc::vec::Vec;
use hypervisor::outq::{Lane, OutQueue};
use hypervisor::stats::RootWork;
use hypervisor::tracer::door::{self, Needs};
use hypervisor::tracer::machine::KernelView;
use hypervisor::tracer::turn::Outbox;
use hypervisor::tracer::{ReqError, Tracer};
use protocol::{
    Body, ChannelReport, DecodeError, ErrorKind, Event, ExitCount, Frame, FrameDecoder, GuestState,
    Request, Response, RingAt, StatusReport, SymbolsPart, TraceChannel, TraceFormat,
};

/// What the rest of the hypervisor must do after a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// The host asked to power the guest off.
    Stop,
}

/// Hypervisor state the answers are built from.
pub struct StatusSource<'a> {
    pub uptime_ns: u64,
    pub memory_used: u64,
    pub memory_total: u64,
    pub heap_used: u64,
    pub introspection: &'a mut Introspection,
    pub cpu: CpuView,
    pub tsc_hz: u64,
    pub tracer: Tracer<'a>,
    /// Every vCPU's EPT view.
    pub views: &'a [hypervisor::ept::Ept],
    /// The vCPU serving the channel.
    pub vcpu: usize,
    /// Its guest RIP (sites a vCPU is executing inside are not patched).
    pub rip: u64,
    /// Root's guard counters.
    pub guard: protocol::GuardReport,
    /// Every vCPU (running or parked), the boot processor first, with its
    /// exit counts.
    pub cpus: &'a [crate::smp::ApSlot],
}

/// Name bytes per `Syms` answer, so that a page fits one frame.
const SYMS_PAGE_BUDGET: usize = 3000;

/// Upper bound on queued output; past it new responses are dropped (and
/// counted) rather than growing without end when nobody reads.
const TX_LIMIT: usize = 64 * 1024;

/// Longest a request waits for a recovery in progress, in root time: a real
/// kernel's recovery takes 1 to 3 s in Bochs, well inside it, and the host
/// gives up on an answer after 10 s of wall time.
pub const PARK_NS: u64 = 5_000_000_000;
/// Most requests held at once; more are answered at once.
const PARK_LIMIT: usize = 8;

/// Bytes of trace frames one turn writes to the log port at most: the
/// guest waits while root writes, and Bochs hands each byte to the host
/// as a write of its own (about 1 us of wall time per byte).
const BULK_TURN_BYTES: usize = 32 * 1024;

/// Bytes of the trace ring in hypervisor memory
/// ([`TraceChannel::SharedRing`]): header and data.
const RING_BYTES: u64 = (1 << 20) + protocol::ring::RING_HEADER as u64;

/// Where trace frames go besides COM2.
enum BulkPath {
    /// The log port.
    Port,
    /// The ring the host reads from the guest RAM file.
    Ring(protocol::ring::Ring),
}

/// The log port or the shared ring as the trace stream's path.
struct Bulk {
    path: BulkPath,
    /// Sequence number of the next frame on the log port (a sequence of
    /// its own: the host counts gaps on each path apart).
    seq: u32,
    /// Bytes written on this turn.
    turn_bytes: usize,
    /// The frame being encoded (kept, so that a turn allocates nothing).
    wire: Vec<u8>,
    /// Frames for the log port, numbered and in order, not encoded yet:
    /// the boot processor encodes and writes them after it lets the VM
    /// lock go ([`Control::take_queued`]), so that the other vCPUs' hits
    /// do not wait for a drain's encoding (most of its cost).
    queued: Vec<Frame>,
}

/// The boot processor's hold of frames taken from the log port's queue
/// ([`Control::take_queued`]), to encode and write outside the VM lock
/// ([`Self::write`]) and count ([`Control::settle`]). It keeps its own
/// frame buffer from turn to turn.
#[derive(Default)]
pub struct QueuedBulk {
    frames: Vec<Frame>,
    wire: Vec<u8>,
    /// Frames written, their bytes, and frames dropped, not counted yet.
    written: (u64, u64, u64),
}

impl QueuedBulk {
    /// Encodes and writes the frames, in order, to the log port (between
    /// whole log lines, [`crate::logger::write_frame`]); with no room for
    /// the frame buffer they are dropped and counted.
    pub fn write(&mut self) {
        if self.wire.capacity() < protocol::MAX_WIRE_FRAME
            && self.wire.try_reserve(protocol::MAX_WIRE_FRAME).is_err()
        {
            self.written.2 += self.frames.len() as u64;
            self.frames.clear();
            return;
        }
        for frame in self.frames.drain(..) {
            self.wire.clear();
            if protocol::encode(&frame, &mut self.wire).is_err() {
                self.written.2 += 1;
                continue;
            }
            crate::logger::write_frame(&self.wire);
            self.written.0 += 1;
            self.written.1 += self.wire.len() as u64;
        }
    }
}

/// What one queued frame adds to a turn's bytes on the log port, before
/// it is encoded: its payload and the encoding's overhead at most.
fn queued_estimate(event: &Event) -> usize {
    let payload = match event {
        Event::TraceRecords { data, .. } => data.len(),
        Event::TraceText { text, .. } => text.len(),
        Event::SymbolChunk { data, .. } => data.len(),
        _ => 512,
    };
    payload + payload / 254 + 64
}

/// Bytes of index per [`Event::SymbolChunk`], so that a frame stays
/// under `MAX_FRAME`.
const SYMBOL_CHUNK: usize = 3072;

/// Bytes of the symbol export sent per turn at most, besides the
/// stream's [`BULK_TURN_BYTES`].
const EXPORT_TURN_BYTES: usize = 16 * 1024;

/// A symbol export under way ([`Request::SymbolsExport`]).
struct SymbolExport {
    id: u32,
    part: SymbolsPart,
    /// The modules' packed index (the kernel image's is read from the
    /// index itself, a piece at a time).
    modules: Vec<u8>,
    /// Bytes sent.
    offset: usize,
    /// Bytes in all.
    total: usize,
    /// The piece being sent (kept, so that a turn allocates nothing).
    piece: Vec<u8>,
}

/// A request held until recovery ends.
struct Parked {
    seq: u32,
    request: Request,
    /// Answered by this root time whatever recovery's state.
    until_ns: u64,
}

pub struct Control {
    uart: Uart,
    decoder: FrameDecoder,
    /// Output, whole frames: answers go ahead of the trace stream's events,
    /// so that a request is answered within one event frame of UART time
    /// however much trace output is queued.
    tx: OutQueue,
    pub stats: ChannelReport,
    /// Bytes arrived on the last turn: more are likely (Bochs hands the
    /// UART one byte at a time), so take the next turns sooner even before a
    /// frame has visibly started (its first bytes are delimiters).
    rx_recent: bool,
    /// Sequence number of the next event frame.
    event_seq: u32,
    /// Requests waiting for recovery, oldest first.
    parked: VecDeque<Parked>,
    /// Recovery was under way at the end of the last poll.
    recovering: bool,
    /// Trace text goes to the log port or the shared ring instead of COM2.
    bulk: Option<Bulk>,
    /// The shared ring's place once made (it is made once, and kept).
    ring_at: Option<(u64, u64)>,
    /// A frame could not be written on the full shared ring (see
    /// [`Self::take_context_resend`]).
    frames_dropped: bool,
    /// The symbol export under way, if any.
    export: Option<SymbolExport>,
    /// Id of the last export started.
    export_id: u32,
    /// The host asked for the symbols: the modules' index follows the
    /// kernel image's, and again whenever the modules change.
    exporting: bool,
    /// The modules' fingerprint last sent (or that could not be packed).
    modules_sent: Option<u64>,
}

impl Control {
    /// Serves the control channel on `uart` (programmed by [`Uart::init`]).
    pub fn new(uart: Uart) -> Self {
        Self {
            uart,
            decoder: FrameDecoder::new(),
            tx: OutQueue::default(),
            stats: ChannelReport::default(),
            rx_recent: false,
            event_seq: 0,
            parked: VecDeque::new(),
            recovering: false,
            bulk: None,
            ring_at: None,
            frames_dropped: false,
            export: None,
            export_id: 0,
            exporting: false,
            modules_sent: None,
        }
    }

    /// Whether output is still queued or in the UART, a frame is half
    /// received, or a recovery runs a slice per turn (the caller polls
    /// sooner then).
    pub fn busy(&self) -> bool {
        self.rx_recent
            || self.recovering
            || !self.parked.is_empty()
            || !self.tx.is_empty()
            || self.decoder.buffered() != 0
            || !self.uart.tx_idle()
            || self.export.is_some()
    }

    /// Moves bytes both ways and answers complete requests.
    pub fn poll(&mut self, src: &mut StatusSource<'_>) -> Action {
        let mut action = Action::None;
        let mut buf = [0u8; 64];
        self.rx_recent = false;
        if let Some(b) = self.bulk.as_mut() {
            b.turn_bytes = 0;
        }
        loop {
            let n = self.uart.read_available(&mut buf);
            if n == 0 {
                break;
            }
            self.rx_recent = true;
            self.stats.bytes_in += n as u64;
            for &b in buf.iter().take(n) {
                match self.decoder.push_byte(b) {
                    None => {}
                    Some(Ok(frame)) => {
                        self.stats.frames_in += 1;
                        if self.answer(frame, src) == Action::Stop {
                            action = Action::Stop;
                        }
                    }
                    Some(Err(e)) => {
                        self.stats.bad_frames += 1;
                        self.reject(e);
                    }
                }
            }
        }
        self.release_parked(src);
        src.introspection.turn(&src.cpu, src.tsc_hz, src.uptime_ns);
        self.recovering = src.introspection.in_progress();
        self.flush();
        action
    }

    /// Answers the held requests whose wait is over: recovery ended, or
    /// their time is up.
    fn release_parked(&mut self, src: &mut StatusSource<'_>) {
        while let Some(p) = self.parked.front() {
            if src.introspection.in_progress() && src.uptime_ns < p.until_ns {
                break;
            }
            if let Some(p) = self.parked.pop_front() {
                // None of the requests held can stop the VM.
                let _ = self.dispatch(p.seq, p.request, src, false);
            }
        }
    }

    /// Pushes queued output into the UART's FIFO.
    pub fn flush(&mut self) {
        let uart = &mut self.uart;
        self.stats.bytes_out += self.tx.write_to(|b| uart.write_some(b)) as u64;
    }

    /// Room left for trace events, in bytes: in the output queue, or on
    /// the log port for the rest of this turn.
    pub fn tx_room(&self) -> usize {
        match &self.bulk {
            Some(b) if b.turn_bytes < BULK_TURN_BYTES => TX_LIMIT,
            Some(_) => 0,
            None => TX_LIMIT.saturating_sub(self.tx.queued(Lane::Events)),
        }
    }

    /// Queues an unsolicited event (dropped and counted when it does not
    /// fit); trace text goes to the log port at once when it is the
    /// stream's path.
    pub fn send_event(&mut self, event: Event) {
        let bulk = matches!(
            event,
            Event::TraceText { .. } | Event::TraceRecords { .. } | Event::TraceContext(_)
        );
        if self.bulk.is_some() && bulk {
            self.bulk_write(event);
            return;
        }
        let seq = self.event_seq;
        self.event_seq = self.event_seq.wrapping_add(1);
        self.send_on(Lane::Events, &Frame::event(seq, event));
    }

    /// Writes `event` whole along the bulk path (when there is one) and
    /// hands it back, so that its buffers can serve again.
    fn bulk_write(&mut self, event: Event) -> Option<Event> {
        let b = self.bulk.as_mut()?;
        if matches!(b.path, BulkPath::Port) {
            // Queued, numbered now: written in order by the boot
            // processor outside the VM lock (a frame that cannot be queued
            // is dropped and counted, and the host sees its number
            // missing).
            let estimate = queued_estimate(&event);
            if b.queued.try_reserve(1).is_err() {
                b.seq = b.seq.wrapping_add(1);
                self.stats.dropped += 1;
                return None;
            }
            b.queued.push(Frame::event(b.seq, event));
            b.seq = b.seq.wrapping_add(1);
            b.turn_bytes += estimate;
            return None;
        }
        let frame = Frame::event(b.seq, event);
        b.wire.clear();
        if protocol::encode(&frame, &mut b.wire).is_err() {
            self.stats.dropped += 1;
        } else {
            b.seq = b.seq.wrapping_add(1);
            match &b.path {
                BulkPath::Port => crate::logger::write_frame(&b.wire),
                // A full ring drops the frame and counts it in its header,
                // where the host reads it; the host then holds the records
                // until a whole context comes again, which the stream
                // sends once the ring has room ([`Self::take_context_resend`]).
                BulkPath::Ring(r) => {
                    if !r.push(&b.wire) {
                        self.frames_dropped = true;
                    }
                }
            }
            b.turn_bytes += b.wire.len();
            self.stats.bulk_frames += 1;
            self.stats.bulk_bytes += b.wire.len() as u64;
        }
        match frame.body {
            protocol::Body::Event(e) => Some(e),
            _ => None,
        }
    }

    /// The log port's queued frames, for the caller to write once it lets
    /// the VM lock go ([`QueuedBulk::write`]) and to hand back with
    /// [`Self::settle`]; only the boot processor takes them, so they reach
    /// the port in their order.
    /// Moves the queued frames into `q` (whose written frames are gone,
    /// its queue's room coming back here); whether there were any.
    pub fn take_queued(&mut self, q: &mut QueuedBulk) -> bool {
        let Some(b) = self.bulk.as_mut() else {
            return false;
        };
        if b.queued.is_empty() || !q.frames.is_empty() {
            return false;
        }
        core::mem::swap(&mut b.queued, &mut q.frames);
        true
    }

    /// Counts the frames `q` wrote since the last call.
    pub fn settle(&mut self, q: &mut QueuedBulk) {
        let (frames, bytes, dropped) = core::mem::take(&mut q.written);
        self.stats.bulk_frames += frames;
        self.stats.bulk_bytes += bytes;
        self.stats.dropped += dropped;
    }

    /// Writes the queued frames now, under the VM lock (the channel
    /// changes, or the VM stops), with the bulk path's own frame buffer.
    pub fn write_queued(&mut self) {
        let Some(b) = self.bulk.as_mut() else {
            return;
        };
        if b.queued.is_empty() {
            return;
        }
        let mut q = QueuedBulk {
            frames: core::mem::take(&mut b.queued),
            wire: core::mem::take(&mut b.wire),
            written: (0, 0, 0),
        };
        q.write();
        self.settle(&mut q);
        if let Some(b) = self.bulk.as_mut() {
            b.wire = q.wire;
            b.queued = q.frames;
        }
    }

    /// Whether the stream should send its whole context again: a frame
    /// was dropped on the full shared ring (the host cannot tell which, and
    /// holds the records until a whole context comes), and the ring has
    /// room again (not every turn while it stays full).
    pub fn take_context_resend(&mut self) -> bool {
        let room = match self.bulk.as_ref().map(|b| &b.path) {
            Some(BulkPath::Ring(r)) => r.used() < r.size() / 2,
            _ => true,
        };
        if self.frames_dropped && room {
            self.frames_dropped = false;
            return true;
        }
        false
    }

    fn send(&mut self, frame: &Frame) {
        self.send_on(Lane::Answers, frame);
    }

    fn send_on(&mut self, lane: Lane, frame: &Frame) {
        let mut out = Vec::new();
        if protocol::encode(frame, &mut out).is_err()
            || self.tx.queued(lane) + out.len() > TX_LIMIT
            || self.tx.try_reserve(lane).is_err()
        {
            self.stats.dropped += 1;
            return;
        }
        self.stats.frames_out += 1;
        self.tx.push(lane, out);
    }

    fn reject(&mut self, e: DecodeError) {
        // A frame of another version is answered so that the host can say
        // clearly what is wrong; other damage is only counted (the sender
        // times out and retries), since its sequence number is unknown.
        if let DecodeError::UnsupportedVersion { found, seq } = e {
            let mut f = Frame::response(
                seq,
                Response::VersionMismatch {
                    ours: protocol::PROTOCOL_VERSION,
                    theirs: found,
                },
            );
            f.version = protocol::PROTOCOL_VERSION;
            self.send(&f);
        }
    }

    fn answer(&mut self, frame: Frame, src: &mut StatusSource<'_>) -> Action {
        let seq = frame.seq;
        let Body::Request(req) = frame.body else {
            self.send(&Frame::response(
                seq,
                Response::error(ErrorKind::Malformed, "expected a request"),
            ));
            return Action::None;
        };
        self.dispatch(seq, req, src, true)
    }

    /// Answers `req`, or (when `may_park`) holds it while recovery runs if
    /// it needs the recovered kernel.
    fn dispatch(
        &mut self,
        seq: u32,
        req: Request,
        src: &mut StatusSource<'_>,
        may_park: bool,
    ) -> Action {
        if may_park && needs_kernel(&req) && self.parked.len() < PARK_LIMIT {
            // Starts recovery, or runs this turn's slice of it.
            let _ = src
                .introspection
                .ensure(&src.cpu, src.tsc_hz, src.uptime_ns);
            if src.introspection.in_progress() {
                self.parked.push_back(Parked {
                    seq,
                    request: req,
                    until_ns: src.uptime_ns.saturating_add(PARK_NS),
                });
                return Action::None;
            }
        }
        let (resp, action) = match req {
            Request::Hello { version, .. } if version != protocol::PROTOCOL_VERSION => (
                Response::VersionMismatch {
                    ours: protocol::PROTOCOL_VERSION,
                    theirs: version,
                },
                Action::None,
            ),
            Request::Hello { .. } => (
                Response::Hello {
                    version: protocol::PROTOCOL_VERSION,
                    hypervisor: alloc::format!("hvtrace hypervisor {}", crate::VERSION),
                },
                Action::None,
            ),
            Request::Ping { nonce } => (Response::Pong { nonce }, Action::None),
            Request::Status => (Response::Status(status(src, self.stats)), Action::None),
            Request::Stop => (Response::Ok, Action::Stop),
            Request::Syms {
                glob,
                kinds,
                module,
                cursor,
                limit,
            } => (
                syms(src, &glob, &kinds, &module, cursor, limit),
                Action::None,
            ),
            Request::TraceStart { format }
                if matches!(format, TraceFormat::Records | TraceFormat::RecordsAndText)
                    && self.bulk.is_none() =>
            {
                let why = "records go only on the log port or the shared ring (TraceChannel)";
                (Response::error(ErrorKind::NotReady, why), Action::None)
            }
            Request::TraceChannel { channel } => {
                let resp = self.set_channel(channel, &mut src.tracer);
                (resp, Action::None)
            }
            Request::SymbolsExport => {
                let resp = with_kernel(src, |_, k| self.start_export(KernelView::index(k)));
                (resp, Action::None)
            }
            Request::Syscalls { cursor } => (syscalls(src, cursor), Action::None),
            other => match door::needs(&other) {
                Some(needs) => (tracer_request(src, other, needs), Action::None),
                None => (
                    Response::error(
                        ErrorKind::Unsupported,
                        alloc::format!(
                            "{} is not supported by this hypervisor yet",
                            request_name(&other)
                        ),
                    ),
                    Action::None,
                ),
            },
        };
        self.send(&Frame::response(seq, resp));
        action
    }
}

impl Control {
    /// `SymbolsExport`: starts sending the index along the stream's path
    /// (a new export replaces one under way), the modules' after it.
    fn start_export(
        &mut self,
        index: &guest_introspect::kallsyms::SymbolIndex,
    ) -> Result<Response, hypervisor::tracer::ReqError> {
        if self.bulk.is_none() {
            return Err(ReqError::new(
                ErrorKind::NotReady,
                "the symbol export needs the log port or the shared ring as the trace path",
            ));
        }
        let mut piece = Vec::new();
        if piece.try_reserve_exact(SYMBOL_CHUNK).is_err() {
            return Err(ReqError::new(
                ErrorKind::OutOfResources,
                "no memory for the symbol export's buffer",
            ));
        }
        self.export_id = self.export_id.wrapping_add(1);
        let total = index.packed_len();
        self.export = Some(SymbolExport {
            id: self.export_id,
            part: SymbolsPart::Kernel,
            modules: Vec::new(),
            offset: 0,
            total,
            piece,
        });
        self.exporting = true;
        self.modules_sent = None;
        Ok(Response::SymbolsExport {
            id: self.export_id,
            bytes: total as u64,
            symbols: index.len() as u32,
        })
    }

    /// Starts sending the modules' index when the host has the kernel's
    /// and the modules changed since the last copy it got.
    fn start_module_export(&mut self, modules: &guest_introspect::module::ModuleIndex) {
        // Asked each turn: the fingerprint (a pass over the module list)
        // only once the host takes copies and none is on its way.
        if !self.exporting || self.export.is_some() {
            return;
        }
        let print = modules.fingerprint();
        if self.modules_sent == Some(print) {
            return;
        }
        // Tried once per change: a heap without room for the copy leaves
        // the host with the modules it had.
        self.modules_sent = Some(print);
        let mut piece = Vec::new();
        let packed = modules.pack();
        let (Ok(packed), Ok(())) = (packed, piece.try_reserve_exact(SYMBOL_CHUNK)) else {
            log::warn!("control: no memory to send the host the modules' symbols");
            return;
        };
        self.export_id = self.export_id.wrapping_add(1);
        self.export = Some(SymbolExport {
            id: self.export_id,
            part: SymbolsPart::Modules,
            total: packed.len(),
            modules: packed,
            offset: 0,
            piece,
        });
    }

    /// A module was loaded: a copy of the modules' symbols still on its
    /// way is dropped (it was taken before the load) and a new one starts
    /// at once, its first piece in this call, so that the host, which
    /// reads the records itself, holds them until the new copy is whole.
    pub fn module_loaded(&mut self, kernel: Option<&dyn KernelView>) {
        if self.sending_modules() {
            self.export = None;
        }
        self.export_turn(kernel);
    }

    /// A copy of the modules' symbols is on its way: the stream's records
    /// wait for it.
    pub fn sending_modules(&self) -> bool {
        self.export
            .as_ref()
            .is_some_and(|x| x.part == SymbolsPart::Modules)
    }

    /// Sends up to [`EXPORT_TURN_BYTES`] of the symbol exports on this
    /// turn, after the stream's frames (a busy stream does not starve
    /// them).
    pub fn export_turn(&mut self, kernel: Option<&dyn KernelView>) {
        let Some(kernel) = kernel else { return };
        if self.bulk.is_none() {
            self.export = None;
            return;
        }
        let mut sent = 0;
        while sent < EXPORT_TURN_BYTES {
            if self.export.is_none() {
                self.start_module_export(kernel.modules());
            }
            let Some(x) = self.export.as_mut() else {
                return;
            };
            x.piece.clear();
            if x.piece.try_reserve_exact(SYMBOL_CHUNK).is_err() {
                self.export = None;
                return;
            }
            x.piece.resize(SYMBOL_CHUNK, 0);
            let n = match x.part {
                SymbolsPart::Kernel => kernel.index().packed_at(x.offset, &mut x.piece),
                _ => {
                    let rest = x.modules.get(x.offset..).unwrap_or_default();
                    let n = rest.len().min(SYMBOL_CHUNK);
                    if let (Some(dst), Some(src)) = (x.piece.get_mut(..n), rest.get(..n)) {
                        dst.copy_from_slice(src);
                    }
                    n
                }
            };
            x.piece.truncate(n);
            if n == 0 {
                self.export = None;
                continue;
            }
            let (id, part, total, offset) = (x.id, x.part, x.total as u64, x.offset as u64);
            x.offset += n;
            sent += n;
            let done = x.offset >= x.total;
            // The event takes the buffer for its frame and gives it back.
            let data = core::mem::take(&mut x.piece);
            let back = self.bulk_write(Event::SymbolChunk {
                id,
                part,
                total,
                offset,
                data,
            });
            if let (Some(Event::SymbolChunk { data, .. }), Some(x)) = (back, self.export.as_mut()) {
                x.piece = data;
            }
            if done {
                self.export = None;
            }
        }
    }

    /// Sends trace frames along `path` from now on; `false` when there is
    /// no memory for the frame buffer.
    fn bulk_to(&mut self, path: BulkPath) -> bool {
        // What the log port holds goes before anything on the new path.
        self.write_queued();
        if let Some(b) = self.bulk.as_mut() {
            b.path = path;
            return true;
        }
        let mut wire = Vec::new();
        if wire.try_reserve(protocol::MAX_WIRE_FRAME).is_err() {
            return false;
        }
        self.bulk = Some(Bulk {
            path,
            seq: 0,
            turn_bytes: 0,
            wire,
            queued: Vec::new(),
        });
        true
    }

    /// `TraceChannel`: where trace text goes from now on. Frames already
    /// queued on COM2 still go there.
    fn set_channel(&mut self, channel: TraceChannel, tracer: &mut Tracer<'_>) -> Response {
        // Root drains the record rings again unless the answer below says
        // where they are.
        tracer.set_host_reads(false);
        match channel {
            TraceChannel::Control => {
                self.write_queued();
                self.bulk = None;
                Response::Ok
            }
            TraceChannel::LogPort if self.bulk_to(BulkPath::Port) => Response::Ok,
            TraceChannel::LogPort => no_frame_buffer(),
            TraceChannel::SharedRings => {
                let frames = self.set_channel(TraceChannel::SharedRing, tracer);
                let Response::TraceRing { gpa, len } = frames else {
                    return frames;
                };
                let (rings, stamp_at) = tracer.record_rings();
                let mut records = Vec::new();
                if records.try_reserve_exact(rings.len()).is_err() {
                    return no_frame_buffer();
                }
                records.extend(rings.into_iter().map(|(gpa, len)| RingAt { gpa, len }));
                tracer.set_host_reads(true);
                Response::TraceRings {
                    frames: RingAt { gpa, len },
                    records,
                    stamp_at,
                }
            }
            TraceChannel::SharedRing => {
                let (gpa, len, fresh) = match self.ring_at {
                    Some((gpa, len)) => (gpa, len, false),
                    None => {
                        let Some(hpa) = crate::frames::alloc_region(RING_BYTES) else {
                            return Response::error(
                                ErrorKind::OutOfResources,
                                "no hypervisor memory for the trace ring",
                            );
                        };
                        (hpa.0, RING_BYTES, true)
                    }
                };
                // SAFETY: the region is ours alone (the frame pool never
                // hands it out again), identity-mapped in root, outside the
                // guest's e820 and absent from EPT; 4 KiB aligned. The host
                // maps it from the RAM file: the ring trusts nothing it
                // reads there but checks it (a position that cannot be
                // right drops what is written). Asked again, the ring goes
                // on as it is, its size from this side's own `len`
                // (formatting it again would move its positions under the
                // reader).
                let ring = unsafe {
                    if fresh {
                        protocol::ring::Ring::format(gpa as *mut u8, len as usize)
                    } else {
                        protocol::ring::Ring::resume(gpa as *mut u8, len as usize)
                    }
                };
                let Some(ring) = ring else {
                    return Response::error(ErrorKind::Internal, "the trace ring cannot be used");
                };
                self.ring_at = Some((gpa, len));
                if self.bulk_to(BulkPath::Ring(ring)) {
                    Response::TraceRing { gpa, len }
                } else {
                    no_frame_buffer()
                }
            }
            _ => Response::error(ErrorKind::Unsupported, "unknown trace channel"),
        }
    }
}

fn no_frame_buffer() -> Response {
    Response::error(
        ErrorKind::OutOfResources,
        "no memory for the trace frames' buffer",
    )
}

/// Requests answered from the recovered kernel.
fn needs_kernel(r: &Request) -> bool {
    matches!(
        r,
        Request::Status
            | Request::Syms { .. }
            | Request::ProbeAdd { .. }
            | Request::ProbeGate { .. }
            | Request::Sched { .. }
            | Request::FunctionAdd { .. }
            | Request::CountStart(_)
            | Request::CountRead { .. }
            | Request::HistRead { .. }
            | Request::GraphStart(_)
            | Request::SymbolsExport
            | Request::Syscalls { .. }
    )
}

/// Runs `f` with the recovered kernel (recovering it first if needed).
/// Runs a tracer request that may change who uses the hooked sites (the
/// other vCPUs held from its first change on, as `with_world` does), then
/// settles the quiet views to it (`Tracer::settle_views`; `k` lets it
/// install the scheduler hook they need).
fn world_request<R>(
    src: &mut StatusSource<'_>,
    k: Option<&crate::introspect::Kernel>,
    f: impl FnOnce(&mut Tracer<'_>, &mut hypervisor::tracer::machine::Env<'_>) -> R,
) -> R {
    let tracer = &mut src.tracer;
    with_world(src.views, src.vcpu, src.rip, src.tsc_hz, |env| {
        let r = f(tracer, env);
        tracer.settle_views(k.map(|k| k as &dyn KernelView), env);
        r
    })
}

/// The control channel as the stream's turn sends through it.
impl Outbox for Control {
    fn room(&self) -> usize {
        self.tx_room()
    }

    fn send(&mut self, event: Event) {
        self.send_event(event);
    }

    fn sending_modules(&self) -> bool {
        Control::sending_modules(self)
    }

    fn take_context_resend(&mut self) -> bool {
        Control::take_context_resend(self)
    }
}

/// A request the tracer serves, through its door, with what it needs:
/// the recovered kernel, the other vCPUs held, or both.
fn tracer_request(src: &mut StatusSource<'_>, req: Request, needs: Needs) -> Response {
    let now_ns = src.uptime_ns;
    let served = match needs {
        Needs::State => {
            let given = door::Given {
                kernel: None,
                env: None,
                now_ns,
            };
            src.tracer.request(req, given)
        }
        Needs::World => world_request(src, None, |t, env| {
            let given = door::Given {
                kernel: None,
                env: Some(env),
                now_ns,
            };
            t.request(req, given)
        }),
        Needs::Kernel => {
            return with_kernel(src, |src, k| {
                let given = door::Given {
                    kernel: Some(k),
                    env: None,
                    now_ns,
                };
                src.tracer.request(req, given)
            });
        }
        Needs::KernelAndWorld => {
            return with_kernel(src, |src, k| {
                world_request(src, Some(k), |t, env| {
                    let given = door::Given {
                        kernel: Some(k),
                        env: Some(env),
                        now_ns,
                    };
                    t.request(req, given)
                })
            });
        }
    };
    served.unwrap_or_else(|e| Response::error(e.kind, e.message))
}

fn with_kernel(
    src: &mut StatusSource<'_>,
    f: impl FnOnce(
        &mut StatusSource<'_>,
        &crate::introspect::Kernel,
    ) -> Result<Response, hypervisor::tracer::ReqError>,
) -> Response {
    if let Some(r) = not_recovered(src) {
        return r;
    }
    // Every such request looks functions up: in the modules loaded now.
    src.introspection.refresh_modules(src.tsc_hz);
    // The recovered kernel lives as long as the VM; take it out of `src`
    // for the call so that the tracer can be borrowed mutably beside it.
    let kernel = src.introspection.take_kernel();
    let resp = match kernel.as_ref() {
        Some(k) => f(src, k).unwrap_or_else(|e| Response::error(e.kind, e.message)),
        None => Response::error(ErrorKind::Internal, "introspection lost its kernel"),
    };
    src.introspection.put_kernel(kernel);
    resp
}

fn request_name(r: &Request) -> &'static str {
    match r {
        Request::Syms { .. } => "syms",
        Request::Syscalls { .. } => "syscalls",
        Request::TraceRead { .. } => "trace read (served by the host launcher)",
        Request::Exec { .. } => "exec (served by the host launcher)",
        _ => "this request",
    }
}

fn syms(
    src: &mut StatusSource<'_>,
    glob: &str,
    kinds: &str,
    module: &str,
    cursor: u32,
    limit: u32,
) -> Response {
    if let Some(r) = not_recovered(src) {
        return r;
    }
    if cursor == 0 {
        // A listing starts with the modules loaded now; its later pages
        // go on through the same walk's.
        src.introspection.refresh_modules(src.tsc_hz);
    }
    match src.introspection.kernel() {
        Some(k) => {
            let (total, next, symbols) =
                k.symbols(glob, kinds, module, cursor, limit, SYMS_PAGE_BUDGET);
            Response::Syms {
                total,
                next,
                symbols,
            }
        }
        None => Response::error(ErrorKind::Internal, "introspection lost its kernel"),
    }
}

/// Recovers the guest kernel if it is not yet; the answer to send when it
/// cannot be.
fn not_recovered(src: &mut StatusSource<'_>) -> Option<Response> {
    src.introspection
        .ensure(&src.cpu, src.tsc_hz, src.uptime_ns)
        .err()
        .map(|e| {
            Response::error(
                ErrorKind::NotReady,
                alloc::format!("guest kernel not found yet: {e}"),
            )
        })
}

/// Bytes of calls one `Syscalls` answer carries at most (a frame is 4 KiB).
const SYSCALLS_PAGE_BYTES: usize = 3_000;

/// `Syscalls`: a page of the guest's system calls from index `cursor`.
fn syscalls(src: &mut StatusSource<'_>, cursor: u32) -> Response {
    if let Some(r) = not_recovered(src) {
        return r;
    }
    let table = match src.introspection.syscalls(cursor == 0) {
        Some(Ok(t)) => t,
        Some(Err(e)) => return Response::error(ErrorKind::NotFound, e),
        None => return Response::error(ErrorKind::Internal, "introspection lost its kernel"),
    };
    let mut calls = Vec::new();
    let mut bytes = 0usize;
    let mut next = None;
    for (i, e) in table.iter().enumerate().skip(cursor as usize) {
        let s = &e.call;
        let size = 24
            + s.name.len()
            + s.entry.len()
            + s.args
                .iter()
                .map(|(t, n)| t.len() + n.len() + 4)
                .sum::<usize>()
            + e.structs
                .iter()
                .map(|st| {
                    8 + st.name.len() + st.fields.iter().map(|f| f.name.len() + 12).sum::<usize>()
                })
                .sum::<usize>();
        if bytes + size > SYSCALLS_PAGE_BYTES && !calls.is_empty() {
            next = u32::try_from(i).ok();
            break;
        }
        if calls.try_reserve(1).is_err() {
            return Response::error(ErrorKind::OutOfResources, "no memory for the calls' page");
        }
        bytes += size;
        calls.push(protocol::SyscallInfo {
            nr: s.nr,
            name: s.name.clone(),
            entry: s.entry.clone(),
            args: s.args.clone(),
            source: match s.source {
                guest_introspect::syscalls::ArgSource::Metadata => "metadata",
                guest_introspect::syscalls::ArgSource::Btf => "btf",
                guest_introspect::syscalls::ArgSource::Table => "table",
                guest_introspect::syscalls::ArgSource::None => "none",
            }
            .into(),
            compat: s.abi == guest_introspect::syscalls::Abi::Ia32,
            structs: e
                .structs
                .iter()
                .map(|st| protocol::SyscallStruct {
                    arg: st.arg,
                    name: st.name.clone(),
                    fields: st
                        .fields
                        .iter()
                        .map(|f| protocol::SyscallField {
                            name: f.name.clone(),
                            offset: f.offset,
                            size: f.size,
                            signed: f.signed,
                        })
                        .collect(),
                })
                .collect(),
        });
    }
    Response::Syscalls {
        total: u32::try_from(table.len()).unwrap_or(u32::MAX),
        next,
        calls,
    }
}

fn status(src: &mut StatusSource<'_>, channel: ChannelReport) -> StatusReport {
    // Recovery starts on the first status after boot, so that the current
    // task can be shown; until the kernel is recovered this reports none
    // (a status held while recovery ran and whose wait is over included).
    let _ = src
        .introspection
        .ensure(&src.cpu, src.tsc_hz, src.uptime_ns);
    // The VM's exits: every vCPU's, summed.
    let mut exits = hypervisor::stats::ExitCounters::new();
    for c in src.cpus {
        exits.add(&c.counters);
    }
    let mut per_vcpu: Vec<protocol::VcpuReport> = src
        .cpus
        .iter()
        .enumerate()
        .map(|(i, c)| (i, c, crate::rootstack::used(i).unwrap_or((0, 0))))
        .map(|(i, c, stack)| (i, c, stack, crate::vcpu::NestedCost::of(i)))
        .map(
            |(i, c, (root_stack_used, root_stack_size), (vmcs_unshadowed, invept))| {
                protocol::VcpuReport {
                    index: i as u32,
                    apic_id: c.apic_id,
                    parked: c.life.is_parked(),
                    exits_total: c.counters.total(),
                    lock_wait_ns: crate::clock::tsc_to_ns(c.lock_wait_ticks, src.tsc_hz),
                    lock_takes: c.lock_takes,
                    shared_takes: c.shared_takes,
                    shared_wait_ns: crate::clock::tsc_to_ns(c.shared_wait_ticks, src.tsc_hz),
                    held_ns: crate::clock::tsc_to_ns(c.held_ticks, src.tsc_hz),
                    vmcalls: c.counters.get(hypervisor::vmx::exit::reason::VMCALL),
                    // The tracer's figures: `Tracer::status_part`, below.
                    lost: 0,
                    hits: 0,
                    returns: 0,
                    refused: 0,
                    view_switches: 0,
                    armed_ns: 0,
                    quiet_ns: 0,
                    quiet: false,
                    root_stack_used,
                    root_stack_size,
                    vmcs_unshadowed,
                    invept,
                    root_hit: root_time(i, RootWork::Hit, src.tsc_hz),
                    root_return: root_time(i, RootWork::Return, src.tsc_hz),
                    root_refused: root_time(i, RootWork::Refused, src.tsc_hz),
                    root_turns: root_time(i, RootWork::Turn, src.tsc_hz),
                }
            },
        )
        .collect();
    let (tracer, graph_sessions) = src.tracer.status_part(&mut per_vcpu, src.uptime_ns);
    StatusReport {
        hypervisor_version: String::from(crate::VERSION),
        protocol_version: protocol::PROTOCOL_VERSION,
        vcpus: src.cpus.len() as u32,
        uptime_ns: src.uptime_ns,
        guest_state: GuestState::Running,
        exits: exits
            .nonzero_with_reason()
            .map(|(reason, name, count)| ExitCount {
                reason,
                name: String::from(name),
                count,
            })
            .collect(),
        exits_total: exits.total(),
        per_vcpu,
        hv_memory_used: src.memory_used,
        hv_heap_used: src.heap_used,
        hv_memory_total: src.memory_total,
        current_task: src.introspection.current_task(&src.cpu),
        channel,
        kernel: src.introspection.report().cloned(),
        tracer,
        guard: src.guard,
        graph_sessions,
    }
}

/// vCPU `cpu`'s time on `work`, for the status report.
fn root_time(cpu: usize, work: RootWork, tsc_hz: u64) -> protocol::RootTime {
    let (count, sum, min, max) =
        crate::vcpu::root_time(cpu, work).map_or((0, 0, 0, 0), |t| t.read());
    let ns = |ticks| crate::clock::tsc_to_ns(ticks, tsc_hz);
    protocol::RootTime {
        count,
        sum_ns: ns(sum),
        min_ns: ns(min),
        max_ns: ns(max),
    }
}
