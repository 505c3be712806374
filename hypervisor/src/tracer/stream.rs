//! The stream: the vCPUs' event rings, and the rendering of their records,
//! merged oldest first, into `TraceText` events for the control channel,
//! in the format the host asked for. Each vCPU stores into its own ring;
//! the stream, the renderers it uses (probe specs, graph sessions) and the
//! control channel are the VM's.

use super::fgraph::{Graph, Retired};
use super::machine::KernelView;
use super::probes::Probes;
use super::ring::Rings;
use alloc::string::String;
use alloc::vec::Vec;
use protocol::TraceFormat;
use tracelang::graph::{self as graph_fmt, GraphEventId};
use tracelang::kprobe::{self, IndexSymbols};
use tracelang::render::{cut_line, LEAF_HOLD_NS, TRACE_TEXT_BUDGET};

/// Bytes of all the vCPUs' event rings together (one vCPU has them all).
const RING_BYTES: usize = 2 << 20;
/// Bytes of one vCPU's ring at least, however many vCPUs share
/// [`RING_BYTES`].
const RING_BYTES_MIN: usize = 256 << 10;
/// Output queue the drain leaves for responses.
const TX_HEADROOM: usize = 8 * 1024;
/// Record bytes (chunk headers included) per `TraceRecords` event, so that
/// a frame stays under `MAX_FRAME`.
const RECORDS_BUDGET: usize = 3000;

/// Root time between two of the idle events a running graph session asks
/// for, at least: root's idle turns come this far apart (200 a second),
/// and busy turns would otherwise send one each.
const IDLE_FLOOR_NS: u64 = 5_000_000;
/// A ring this full (in 1/256ths of its size) rings the host's doorbell
/// when the host reads the rings.
const DOORBELL_FILL: usize = 64;
/// The doorbell rings at most this often (hypervisor time).
const DOORBELL_EVERY_NS: u64 = 5_000_000;

/// A rendered line that did not fit the last `TraceText`, and its source.
#[derive(Default)]
struct HeldLine {
    source: u32,
    text: String,
}

/// The vCPUs' rings and the stream's state.
pub(super) struct Stream {
    pub(super) rings: Rings,
    /// The record being rendered.
    record: Vec<u8>,
    /// The streaming format, once the host asked for the stream.
    format: Option<TraceFormat>,
    lost_reported: u64,
    /// A rendered line that did not fit the last `TraceText`, and its
    /// source.
    pending_line: Option<HeldLine>,
    /// Records mode: the rest of a record cut at the end of the last
    /// `TraceRecords`.
    record_rest: Vec<u8>,
    /// Records mode: the rendering context's fingerprint last sent, and
    /// the context events still to send.
    context_sent: Option<u64>,
    context: alloc::collections::VecDeque<protocol::Event>,
    /// Records mode: records went out since the last idle event, and when
    /// that was.
    sent_since_idle: bool,
    last_idle_ns: u64,
    /// The host reads the record rings itself in records mode
    /// ([`protocol::TraceChannel::SharedRings`]); root sends the context
    /// and its clock only.
    host_reads: bool,
    /// When the doorbell last rang.
    last_doorbell_ns: u64,
    /// The turn (its root time) whose context could not be built for want
    /// of heap: not tried again in that turn.
    context_failed_at: Option<u64>,
    /// The doorbell rang for the ring's fill, and no ring has gone below
    /// half the mark since: it does not ring again until one has.
    doorbell_rung: bool,
    /// Records-and-text mode: root's own rendering of the records sent,
    /// as `TraceText` events waiting to go.
    texts: alloc::collections::VecDeque<protocol::Event>,
}

impl Default for Stream {
    fn default() -> Self {
        Stream::new(1)
    }
}

impl Stream {
    /// The stream of a VM with `cpus` vCPUs: a ring each.
    pub(super) fn new(cpus: usize) -> Self {
        let each = (RING_BYTES / cpus.max(1)).max(RING_BYTES_MIN);
        Stream {
            rings: Rings::new(cpus, each, kprobe::TIMESTAMP_AT),
            record: Vec::with_capacity(512),
            format: None,
            lost_reported: 0,
            pending_line: None,
            record_rest: Vec::new(),
            context_sent: None,
            context: alloc::collections::VecDeque::new(),
            sent_since_idle: false,
            last_idle_ns: 0,
            host_reads: false,
            last_doorbell_ns: 0,
            context_failed_at: None,
            doorbell_rung: false,
            texts: alloc::collections::VecDeque::new(),
        }
    }

    /// Whether root takes the records out of the rings (it does unless the
    /// host reads them: records mode with [`Self::set_host_reads`]).
    fn root_drains(&self) -> bool {
        !(self.host_reads && self.format == Some(TraceFormat::Records))
    }

    /// See [`super::Tracer::resend_context`].
    pub(super) fn resend_context(&mut self) {
        self.context_sent = None;
        self.context.clear();
    }

    /// See [`super::Tracer::host_reads`].
    pub(super) fn host_reads(&self) -> bool {
        !self.root_drains()
    }

    /// See [`super::Tracer::set_host_reads`].
    pub(super) fn set_host_reads(&mut self, on: bool) {
        if self.host_reads != on {
            // The whole context goes again, on the new path.
            self.resend_context();
            self.record_rest.clear();
        }
        self.host_reads = on;
    }

    /// See [`super::Tracer::doorbell`].
    pub(super) fn doorbell(&mut self, now_ns: u64) -> bool {
        if self.root_drains() || self.format.is_none() {
            return false;
        }
        // Once per filling: a ring that stays full (nobody reads) does not
        // keep ringing.
        let fill = self.rings.fullest();
        if fill < DOORBELL_FILL / 2 {
            self.doorbell_rung = false;
        }
        if self.doorbell_rung
            || fill < DOORBELL_FILL
            || now_ns.saturating_sub(self.last_doorbell_ns) < DOORBELL_EVERY_NS
        {
            return false;
        }
        self.doorbell_rung = true;
        self.last_doorbell_ns = now_ns;
        true
    }

    /// The stream's next `TraceText`, when there is output and the
    /// control channel's output queue has `room` bytes free: the exit loop
    /// sends it, and asks again while it has room. One `TraceText` carries
    /// lines of one source (0: probes and the function tracer; N: graph
    /// session N).
    pub(super) fn next_text(
        &mut self,
        room: usize,
        kernel: Option<&dyn KernelView>,
        now_ns: u64,
        probes: &Probes,
        graph: &mut Graph,
    ) -> Option<protocol::Event> {
        let format = self.format?;
        if format == TraceFormat::Records {
            return self.next_records(room, now_ns, probes, graph, None);
        }
        let k = kernel?;
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
        if format == TraceFormat::RecordsAndText {
            return self.next_records(room, now_ns, probes, graph, Some(&syms));
        }
        {
            if room < TX_HEADROOM + protocol::MAX_WIRE_FRAME {
                return None;
            }
            let HeldLine {
                mut source,
                mut text,
            } = self.pending_line.take().unwrap_or_default();
            while text.len() < TRACE_TEXT_BUDGET {
                if self.rings.pop_oldest(&mut self.record).is_none() {
                    // The ring is empty: retired renderers print what they
                    // hold back and go. An entry held back for a leaf is
                    // printed open once it is older than LEAF_HOLD_NS (its
                    // call is long, or sleeps); counting time, not turns,
                    // because another session's events may have kept the
                    // ring busy while this one's children are not traced.
                    if text.is_empty() {
                        let aged = format == TraceFormat::Text;
                        flush_held(&mut text, &mut source, &syms, graph, aged, now_ns);
                    }
                    break;
                }
                let mut line = String::new();
                let src = render(&self.record, &mut line, format, &syms, probes, graph);
                if line.is_empty() {
                    continue;
                }
                cut_line(&mut line, TRACE_TEXT_BUDGET);
                if !line.ends_with('\n') {
                    line.push('\n');
                }
                if text.is_empty() {
                    source = src;
                }
                if !text.is_empty()
                    && (src != source || text.len() + line.len() > TRACE_TEXT_BUDGET)
                {
                    self.pending_line = Some(HeldLine {
                        source: src,
                        text: line,
                    });
                    break;
                }
                text.push_str(&line);
            }
            let lost = self.rings.lost() - self.lost_reported;
            if text.is_empty() && lost == 0 {
                return None;
            }
            self.lost_reported = self.rings.lost();
            Some(protocol::Event::TraceText {
                format,
                source,
                lost,
                text,
            })
        }
    }

    /// Records mode: the next context event, `TraceRecords` of the
    /// oldest records (a record that does not fit goes on in the next
    /// one), or, the rings being empty, one that says so (after records
    /// went out, and on every turn while a graph session runs).
    ///
    /// With `text` (records-and-text mode), root also renders each record
    /// it sends, as it renders trace_pipe text, into `TraceText` events
    /// that go after the records, and prints what the graph sessions hold
    /// back when the rings are empty, at the same points as then.
    fn next_records(
        &mut self,
        room: usize,
        now_ns: u64,
        probes: &Probes,
        graph: &mut Graph,
        text: Option<&IndexSymbols<'_>>,
    ) -> Option<protocol::Event> {
        // When the host reads the rings, the context goes out in the turn
        // that changed it, whatever the room: the turn holds the VM to
        // itself, so no record that needs the change is in a ring before
        // it (the host reads the rings' positions before it reads the
        // frames).
        if self.root_drains() && room < TX_HEADROOM + protocol::MAX_WIRE_FRAME {
            return None;
        }
        if text.is_none() {
            // Root renders nothing here: what stopped sessions held back
            // is the host's to print.
            graph.retired.clear();
        }
        let print = context_fingerprint(probes, graph);
        if self.context_sent != Some(print) && self.context_failed_at != Some(now_ns) {
            self.context = context_events(probes, graph);
            if self.context.is_empty() {
                // No room to build it: tried again on a later turn.
                self.context_failed_at = Some(now_ns);
            } else {
                self.context_sent = Some(print);
                // A stopped session's held entries print at the next idle
                // event: make one due.
                self.sent_since_idle = true;
            }
        }
        if let Some(ev) = self.context.pop_front() {
            return Some(ev);
        }
        if !self.root_drains() {
            // Root's clock, for the host to age what it holds back once it
            // finds the rings empty (after records were written, after a
            // context change, and while a graph session runs; one a turn
            // at most);
            // the losses are in the rings' headers.
            if !self.rings.is_empty() {
                self.sent_since_idle = true;
            }
            if now_ns <= self.last_idle_ns || !self.idle_due(now_ns, graph) {
                return None;
            }
            return Some(self.idle(now_ns));
        }
        if let Some(ev) = self.texts.pop_front() {
            return Some(ev);
        }
        let mut data = Vec::new();
        if data.try_reserve(RECORDS_BUDGET).is_err() {
            return None;
        }
        // What is left of a record here was cut at the end of the last
        // event: its first chunk now continues it.
        let mut rest = core::mem::take(&mut self.record_rest);
        let mut continues = !rest.is_empty();
        // Records-and-text mode: root's lines of this turn, and their
        // source; whether the rings were found empty.
        let mut lines = String::new();
        let mut source = 0;
        let mut emptied = false;
        loop {
            // Room is looked at before a record is taken, so that a record
            // is only ever left here after a piece of it went out.
            let room = RECORDS_BUDGET.saturating_sub(data.len() + 4);
            if room == 0 {
                break;
            }
            if rest.is_empty() && text.is_none() {
                // A record that fits goes straight from its ring to the
                // event, behind its chunk header (whole: no flags).
                let header = |n: usize| (n as u32 & protocol::RECORD_LEN_MASK).to_le_bytes();
                match self.rings.pop_oldest_append(&mut data, room, header) {
                    None => {
                        emptied = true;
                        break;
                    }
                    Some(n) if n <= room => continue,
                    // Longer than the room: cut below.
                    Some(_) => {}
                }
            }
            if rest.is_empty() {
                if self.rings.pop_oldest(&mut self.record).is_none() {
                    emptied = true;
                    break;
                }
                rest = core::mem::take(&mut self.record);
                continues = false;
                if let Some(syms) = text {
                    let mut line = String::new();
                    let src = render(&rest, &mut line, TraceFormat::Text, syms, probes, graph);
                    self.gather_text(&mut lines, &mut source, src, line);
                }
            }
            let n = rest.len().min(room);
            let more = n < rest.len();
            let mut header = n as u32 & protocol::RECORD_LEN_MASK;
            if continues {
                header |= protocol::RECORD_CONTINUES;
            }
            if more {
                header |= protocol::RECORD_MORE;
            }
            data.extend_from_slice(&header.to_le_bytes());
            data.extend_from_slice(rest.get(..n).unwrap_or_default());
            if more {
                rest.drain(..n);
                break;
            }
            // The buffer serves the next record.
            rest.clear();
            self.record = core::mem::take(&mut rest);
        }
        self.record_rest = rest;
        if let Some(syms) = text {
            // As root rendering text does on a turn that found the rings
            // empty and printed nothing.
            if emptied && lines.is_empty() {
                flush_held(&mut lines, &mut source, syms, graph, true, now_ns);
            }
            if !lines.is_empty() {
                self.texts.push_back(text_event(source, lines));
            }
        }
        let lost = self.rings.lost() - self.lost_reported;
        self.lost_reported = self.rings.lost();
        if data.is_empty() && lost == 0 {
            if !self.idle_due(now_ns, graph) {
                return None;
            }
            return Some(self.idle(now_ns));
        }
        self.sent_since_idle = true;
        Some(protocol::Event::TraceRecords { lost, now_ns, data })
    }

    /// Whether the rings being empty is worth saying: after records went
    /// out, after a context change, and on every turn while a graph
    /// session runs (IDLE_FLOOR_NS apart at least), as root's own text
    /// mode ages its held entries on every such turn: the host ages them
    /// at the same turns, with the same clock (idle turns come
    /// IDLE_FLOOR_NS apart anyway).
    fn idle_due(&self, now_ns: u64, graph: &Graph) -> bool {
        self.sent_since_idle
            || (graph.running() > 0 && now_ns.saturating_sub(self.last_idle_ns) >= IDLE_FLOOR_NS)
    }

    /// The empty `TraceRecords` that says the rings were empty at
    /// `now_ns`.
    fn idle(&mut self, now_ns: u64) -> protocol::Event {
        self.sent_since_idle = false;
        self.last_idle_ns = now_ns;
        protocol::Event::TraceRecords {
            lost: 0,
            now_ns,
            data: Vec::new(),
        }
    }

    /// Records-and-text mode: adds a rendered `line` of source `src` to
    /// the turn's `lines` of `source`, queueing what was gathered first as
    /// a `TraceText` when the source changes or the event is full (the
    /// rule of text mode's turns). An empty line adds nothing.
    fn gather_text(&mut self, lines: &mut String, source: &mut u32, src: u32, mut line: String) {
        if line.is_empty() {
            return;
        }
        cut_line(&mut line, TRACE_TEXT_BUDGET);
        if !line.ends_with('\n') {
            line.push('\n');
        }
        if !lines.is_empty() && (src != *source || lines.len() + line.len() > TRACE_TEXT_BUDGET) {
            self.texts
                .push_back(text_event(*source, core::mem::take(lines)));
        }
        if lines.is_empty() {
            *source = src;
        }
        lines.push_str(&line);
    }

    /// `TraceStart` / `TraceStop`.
    pub(super) fn set_format(&mut self, format: Option<TraceFormat>, graph: &mut Graph) {
        if self.format != format {
            self.pending_line = None;
            graph.flush_held();
            // A records stream starts with the whole context.
            self.record_rest.clear();
            self.context_sent = None;
            self.context.clear();
            self.texts.clear();
        }
        self.format = format;
    }

    /// Whether output is waiting (the stream wants busy turns).
    pub(super) fn has_output(&self) -> bool {
        self.format.is_some()
            && ((self.root_drains() && !self.rings.is_empty())
                || self.pending_line.is_some()
                || !self.record_rest.is_empty()
                || !self.context.is_empty()
                || !self.texts.is_empty())
    }
}

/// The rings being empty: the first stopped session that holds entries
/// back prints them and goes; with `aged`, when nothing was printed, the
/// first session holding an entry for a leaf longer than
/// [`LEAF_HOLD_NS`](tracelang::render::LEAF_HOLD_NS) prints it open. Counting time, not turns, because
/// another session's events may have kept the ring busy while this one's
/// children are not traced.
fn flush_held(
    text: &mut String,
    source: &mut u32,
    syms: &IndexSymbols<'_>,
    graph: &mut Graph,
    aged: bool,
    now_ns: u64,
) {
    while let Some(Retired {
        number: user,
        text: mut t,
        ..
    }) = graph.retired.pop()
    {
        if t.has_pending() {
            t.flush(text, syms);
            *source = user;
            break;
        }
    }
    if !text.is_empty() || !aged {
        return;
    }
    for (user, g) in graph.sessions.iter_mut().enumerate() {
        let Some(g) = g else { continue };
        let old = g
            .text
            .pending_since()
            .is_some_and(|t| now_ns.saturating_sub(t) > LEAF_HOLD_NS);
        if old {
            g.text.flush(text, syms);
            *source = user as u32;
            break;
        }
    }
}

/// Root's own lines as the stream's `TraceText` (records-and-text mode:
/// losses go with the records).
fn text_event(source: u32, text: String) -> protocol::Event {
    protocol::Event::TraceText {
        format: TraceFormat::Text,
        source,
        lost: 0,
        text,
    }
}

/// Changes when what renders the records does: the probes (by id) and the
/// graph sessions (by number and generation).
fn context_fingerprint(probes: &Probes, graph: &Graph) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |v: u64| h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
    for p in &probes.list {
        feed(u64::from(p.id));
    }
    feed(u64::MAX);
    for (user, g) in graph.sessions.iter().enumerate() {
        if let Some(g) = g {
            let generation = graph.generations.get(user).copied().unwrap_or(0);
            feed(((user as u64) << 8) | u64::from(generation));
            feed(u64::from(g.text.retval));
        }
    }
    h
}

/// The whole rendering context, as the events that carry it.
fn context_events(probes: &Probes, graph: &Graph) -> alloc::collections::VecDeque<protocol::Event> {
    use protocol::{Event::TraceContext, RenderContext};
    let mut out = alloc::collections::VecDeque::new();
    let n = probes.list.len() + graph.sessions.len() + 2;
    if out.try_reserve(n).is_err() {
        return out;
    }
    out.push_back(TraceContext(RenderContext::Begin));
    for p in &probes.list {
        out.push_back(TraceContext(RenderContext::Probe {
            id: p.id,
            spec: p.spec.render_form(),
        }));
    }
    for (user, g) in graph.sessions.iter().enumerate() {
        if let Some(g) = g {
            out.push_back(TraceContext(RenderContext::Graph {
                number: user as u8,
                generation: graph.generations.get(user).copied().unwrap_or(0),
                retval: g.text.retval,
            }));
        }
    }
    out.push_back(TraceContext(RenderContext::End));
    out
}

/// Renders `record`; returns its source.
fn render(
    record: &[u8],
    out: &mut String,
    format: TraceFormat,
    syms: &IndexSymbols<'_>,
    probes: &Probes,
    graph: &mut Graph,
) -> u32 {
    let Some(ev) = tracelang::render::decode_or_say(record, out) else {
        return 0;
    };
    let id = ev.header.probe_id;
    if let Some(GraphEventId {
        kind,
        number,
        generation: gen,
    }) = GraphEventId::unpack(id)
    {
        let user = usize::from(number);
        if format == TraceFormat::Json {
            graph_fmt::write_graph_json(out, kind, &ev, user as u32, syms);
            return user as u32;
        }
        let live = graph.generations.get(user) == Some(&gen);
        let text = match graph.sessions.get_mut(user).and_then(Option::as_mut) {
            Some(g) if live => Some(&mut g.text),
            _ => graph
                .retired
                .iter_mut()
                .find(|r| r.number as usize == user && r.generation == gen)
                .map(|r| &mut r.text),
        };
        // No renderer: a session stopped long ago; nothing to print.
        if let Some(t) = text {
            t.push(out, kind, &ev, syms);
        }
        return user as u32;
    }
    tracelang::render::write_plain(out, format, &ev, probes.get(id).map(|p| &p.spec), syms);
    0
}
