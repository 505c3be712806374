//! Rendering records away from root: the host's side of
//! [`TraceFormat::Records`].
//!
//! Root sends the vCPUs' records as its rings hold them
//! ([`Event::TraceRecords`]), and, whenever it changes, what renders them
//! ([`Event::TraceContext`]: the probes' definitions and the graph
//! sessions). A [`RecordRenderer`] turns both into the `TraceText` events
//! root itself would have sent in the format asked for, with the renderers
//! root uses ([`crate::kprobe`], [`crate::graph`]): trace_pipe lines,
//! function_graph text with its held-back leaves, JSON lines. Nothing in
//! the input is trusted: a record that does not decode prints as root
//! prints one, a chunk out of place is counted and dropped, and the
//! held-back record is bounded.
//!
//! Root's own stream renders with the same pieces ([`decode_or_say`],
//! [`write_plain`], [`cut_line`]) and the same rules ([`FUNCTION_ID`],
//! [`TRACE_TEXT_BUDGET`], [`LEAF_HOLD_NS`]), so that the two print the
//! same bytes; and its rings and the host's [`RingsReader`] merge the
//! vCPUs' records by the same rule ([`oldest`]).

use crate::graph::{write_graph_json, GraphEventId, GraphText};
use crate::kprobe::{self, Command, ProbeSpec, RawEvent, SymbolResolver};
use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::borrow::Borrow;
use core::fmt::Write;
use protocol::ring::Ring;
use protocol::{Event, RenderContext, TraceFormat};

/// The probe id of function-tracer events (probes count from 1).
pub const FUNCTION_ID: u32 = 0;
/// The probe id of scheduler switch events ([`kprobe::SwitchValues`]):
/// outside the probes' ids and the graph events' (`0xffff_feXX` and up).
pub const SCHED_SWITCH_ID: u32 = 0xffff_fd01;
/// The probe id of scheduler wakeup events ([`kprobe::WakeupValues`]).
pub const SCHED_WAKEUP_ID: u32 = 0xffff_fd02;
/// Text per `TraceText` event, so that a frame stays under `MAX_FRAME`.
pub const TRACE_TEXT_BUDGET: usize = 2800;
/// How long (hypervisor time) a graph entry is held back for a leaf line
/// once the ring has nothing more: a call without a return by then is
/// printed open.
pub const LEAF_HOLD_NS: u64 = 100_000_000;

/// Bytes of text per `TraceText` the renderer makes, at most (a line
/// longer than this is cut, as root cuts it).
const TEXT_PER_EVENT: usize = 64 * 1024;
/// The generation of a renderer retired by a format switch (generations
/// are 4 bits: no record carries it).
const RETIRED_BY_SWITCH: u8 = 0xff;
/// Bytes of one record held across events, at most.
const MAX_RECORD: usize = 64 * 1024;

/// A graph session's renderer.
struct HostGraph {
    number: u8,
    generation: u8,
    text: GraphText,
    /// Stopped: it renders the session's last records, then what it holds
    /// back is printed open at the next idle event.
    retired: bool,
}

/// A context being received: probes by id, and graph sessions as (number,
/// generation, retval).
type NextContext = (BTreeMap<u32, ProbeSpec>, Vec<(u8, u8, bool)>);

/// What the renderer saw go wrong.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenderStats {
    /// Records rendered.
    pub records: u64,
    /// Chunks out of place (a lost frame in between), dropped.
    pub bad_chunks: u64,
    /// Probe definitions that did not parse.
    pub bad_specs: u64,
}

/// The host's renderer of a records stream.
pub struct RecordRenderer {
    format: TraceFormat,
    probes: BTreeMap<u32, ProbeSpec>,
    /// The context being received (between `Begin` and `End`).
    next: Option<NextContext>,
    graphs: Vec<HostGraph>,
    /// A record whose chunks are still coming.
    partial: Vec<u8>,
    /// The text being gathered, its source, and the losses it reports.
    text: String,
    source: u32,
    lost: u64,
    /// Counters.
    pub stats: RenderStats,
}

impl RecordRenderer {
    /// A renderer into `format` (text or JSON).
    pub fn new(format: TraceFormat) -> Self {
        RecordRenderer {
            format,
            probes: BTreeMap::new(),
            next: None,
            graphs: Vec::new(),
            partial: Vec::new(),
            text: String::new(),
            source: 0,
            lost: 0,
            stats: RenderStats::default(),
        }
    }

    /// The format it renders into.
    pub fn format(&self) -> TraceFormat {
        self.format
    }

    /// Renders into `format` from now on. As root does at a switch, the
    /// graph renderers start afresh, and what they held back is printed
    /// at the next idle event.
    pub fn set_format(&mut self, format: TraceFormat) {
        if format == self.format {
            return;
        }
        self.format = format;
        let mut fresh = Vec::new();
        for g in &mut self.graphs {
            if !g.retired {
                fresh.push(HostGraph {
                    number: g.number,
                    generation: g.generation,
                    text: GraphText::new(g.text.retval),
                    retired: false,
                });
                // No record carries this generation.
                g.generation = RETIRED_BY_SWITCH;
                g.retired = true;
            }
        }
        self.graphs.extend(fresh);
    }

    /// One piece of the context.
    pub fn context(&mut self, c: &RenderContext) {
        match c {
            RenderContext::Begin => self.next = Some((BTreeMap::new(), Vec::new())),
            RenderContext::Probe { id, spec } => {
                let Some((probes, _)) = self.next.as_mut() else {
                    return;
                };
                match kprobe::parse(spec) {
                    Ok(Command::Add(p)) => {
                        probes.insert(*id, p);
                    }
                    _ => self.stats.bad_specs += 1,
                }
            }
            RenderContext::Graph {
                number,
                generation,
                retval,
            } => {
                if let Some((_, graphs)) = self.next.as_mut() {
                    graphs.push((*number, *generation, *retval));
                }
            }
            RenderContext::End => {
                let Some((probes, graphs)) = self.next.take() else {
                    return;
                };
                self.probes = probes;
                for g in &mut self.graphs {
                    g.retired = !graphs
                        .iter()
                        .any(|&(n, gen, _)| n == g.number && gen == g.generation);
                }
                for (number, generation, retval) in graphs {
                    let known = self
                        .graphs
                        .iter()
                        .any(|g| g.number == number && g.generation == generation);
                    if !known {
                        self.graphs.push(HostGraph {
                            number,
                            generation,
                            text: GraphText::new(retval),
                            retired: false,
                        });
                    }
                }
            }
            _ => {}
        }
    }

    /// One `TraceRecords` event: appends the `TraceText` events root would
    /// have sent for these records to `out`.
    pub fn records(
        &mut self,
        lost: u64,
        now_ns: u64,
        data: &[u8],
        syms: &dyn SymbolResolver,
        out: &mut Vec<Event>,
    ) {
        self.lost += lost;
        let mut rest = data;
        while let Some((head, tail)) = rest.split_first_chunk::<4>() {
            let header = u32::from_le_bytes(*head);
            let len = (header & protocol::RECORD_LEN_MASK) as usize;
            let Some((bytes, tail)) = tail.split_at_checked(len) else {
                self.stats.bad_chunks += 1;
                break;
            };
            rest = tail;
            let continues = header & protocol::RECORD_CONTINUES != 0;
            let more = header & protocol::RECORD_MORE != 0;
            // A continuation needs a held record; a start needs none.
            if continues == self.partial.is_empty() {
                // A piece lost in between: what was held is dropped, and
                // a continuation without its start too.
                self.stats.bad_chunks += 1;
                self.partial.clear();
                if continues {
                    continue;
                }
            }
            if more || continues {
                if self.partial.len() + bytes.len() > MAX_RECORD {
                    self.stats.bad_chunks += 1;
                    self.partial.clear();
                    continue;
                }
                self.partial.extend_from_slice(bytes);
                if more {
                    continue;
                }
                let record = core::mem::take(&mut self.partial);
                self.render(&record, syms, out);
            } else {
                self.render(bytes, syms, out);
            }
        }
        if data.is_empty() {
            self.idle(now_ns, syms, out);
        }
        self.emit(out);
    }

    /// The rings were empty: stopped sessions print what they hold back
    /// and go; an entry held back for a leaf longer than root would hold
    /// it is printed open.
    fn idle(&mut self, now_ns: u64, syms: &dyn SymbolResolver, out: &mut Vec<Event>) {
        let mut i = 0;
        while i < self.graphs.len() {
            if self.graphs.get(i).is_some_and(|g| g.retired) {
                let mut g = self.graphs.swap_remove(i);
                if g.text.has_pending() {
                    let mut text = String::new();
                    g.text.flush(&mut text, syms);
                    self.push(u32::from(g.number), text, out);
                }
            } else {
                i += 1;
            }
        }
        if self.format != TraceFormat::Text {
            return;
        }
        let mut aged = Vec::new();
        for g in &mut self.graphs {
            let old = g
                .text
                .pending_since()
                .is_some_and(|t| now_ns.saturating_sub(t) > LEAF_HOLD_NS);
            if old {
                let mut text = String::new();
                g.text.flush(&mut text, syms);
                aged.push((u32::from(g.number), text));
            }
        }
        for (source, text) in aged {
            self.push(source, text, out);
        }
    }

    /// Renders one record into the gathered text.
    fn render(&mut self, record: &[u8], syms: &dyn SymbolResolver, out: &mut Vec<Event>) {
        self.stats.records += 1;
        let mut line = String::new();
        let source = self.render_one(record, &mut line, syms);
        if line.is_empty() {
            return;
        }
        cut_line(&mut line, TRACE_TEXT_BUDGET);
        if !line.ends_with('\n') {
            line.push('\n');
        }
        self.push(source, line, out);
    }

    /// Adds lines of `source` to the gathered text (sending what was
    /// gathered first when the source changes or the event is full).
    fn push(&mut self, source: u32, text: String, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        if !self.text.is_empty()
            && (source != self.source || self.text.len() + text.len() > TEXT_PER_EVENT)
        {
            self.emit(out);
        }
        if self.text.is_empty() {
            self.source = source;
        }
        self.text.push_str(&text);
    }

    /// Sends the gathered text (and the losses) as one `TraceText`.
    fn emit(&mut self, out: &mut Vec<Event>) {
        if self.text.is_empty() && self.lost == 0 {
            return;
        }
        out.push(Event::TraceText {
            format: self.format,
            source: self.source,
            lost: core::mem::take(&mut self.lost),
            text: core::mem::take(&mut self.text),
        });
    }

    /// Renders `record` as root does; returns its source.
    fn render_one(&mut self, record: &[u8], out: &mut String, syms: &dyn SymbolResolver) -> u32 {
        let Some(ev) = decode_or_say(record, out) else {
            return 0;
        };
        let id = ev.header.probe_id;
        if let Some(GraphEventId {
            kind,
            number,
            generation,
        }) = GraphEventId::unpack(id)
        {
            let user = u32::from(number);
            if self.format == TraceFormat::Json {
                write_graph_json(out, kind, &ev, user, syms);
                return user;
            }
            // No renderer: a session stopped long ago; nothing to print.
            if let Some(g) = self
                .graphs
                .iter_mut()
                .find(|g| g.number == number && g.generation == generation)
            {
                g.text.push(out, kind, &ev, syms);
            }
            return user;
        }
        write_plain(out, self.format, &ev, self.probes.get(&id), syms);
        0
    }
}

/// The record decoded; `None`, having said so in `out`, when it does not
/// decode.
pub fn decode_or_say(record: &[u8], out: &mut String) -> Option<RawEvent> {
    match RawEvent::decode(record) {
        Ok((ev, _)) => Some(ev),
        Err(_) => {
            let _ = write!(out, "(undecodable record of {} bytes)", record.len());
            None
        }
    }
}

/// A function-tracer record, or a probe's (`probe`: its definition), as a
/// trace_pipe or JSON line. A probe deleted since the hit is no longer
/// printable: nothing is written for it.
pub fn write_plain(
    out: &mut String,
    format: TraceFormat,
    ev: &RawEvent,
    probe: Option<&ProbeSpec>,
    syms: &dyn SymbolResolver,
) {
    if ev.header.probe_id == FUNCTION_ID {
        match format {
            TraceFormat::Json => kprobe::write_function_json(out, ev, syms),
            _ => kprobe::write_function_text(out, ev, syms),
        }
        return;
    }
    if ev.header.probe_id == SCHED_SWITCH_ID {
        match format {
            TraceFormat::Json => kprobe::write_switch_json(out, ev),
            _ => kprobe::write_switch_text(out, ev),
        }
        return;
    }
    if ev.header.probe_id == SCHED_WAKEUP_ID {
        match format {
            TraceFormat::Json => kprobe::write_wakeup_json(out, ev),
            _ => kprobe::write_wakeup_text(out, ev),
        }
        return;
    }
    let Some(p) = probe else {
        return;
    };
    match format {
        TraceFormat::Json => kprobe::write_json(out, p, ev, syms),
        _ => kprobe::write_text(out, p, ev, syms),
    }
}

/// Bytes of records per `TraceRecords` event a [`RingsReader`] makes, at
/// most (a longer record goes alone).
const READER_EVENT_BYTES: usize = 64 * 1024;

/// The host's reader of root's record rings
/// ([`protocol::TraceChannel::SharedRings`]): the vCPUs' rings, each
/// written by its vCPU in root and read here, merged oldest first by the
/// timestamp every record carries, into the `TraceRecords` events root
/// would have sent (whole records, never cut).
///
/// The order against the context: root writes a context change to the
/// frame ring in the turn that makes it, before any record that needs it
/// can be written. So the host takes [`RingsReader::mark`] first, then
/// reads the frame ring to its end, then takes the records up to the mark
/// ([`RingsReader::take`]): every record it takes was written after the
/// context it needs was on the frame ring.
pub struct RingsReader<R: Borrow<Ring>> {
    rings: Vec<R>,
    stamp_at: usize,
    lost_seen: u64,
    record: Vec<u8>,
}

impl<R: Borrow<Ring>> RingsReader<R> {
    /// A reader of `rings` (in root's vCPU order), whose records carry
    /// their timestamp at `stamp_at`.
    pub fn new(rings: Vec<R>, stamp_at: usize) -> RingsReader<R> {
        RingsReader {
            rings,
            stamp_at,
            lost_seen: 0,
            record: Vec::new(),
        }
    }

    /// The rings' producers' positions now.
    pub fn mark(&self) -> Vec<u64> {
        self.rings.iter().map(|r| r.borrow().head()).collect()
    }

    /// Whether every ring is empty now.
    pub fn is_empty(&self) -> bool {
        self.rings.iter().all(|r| r.borrow().is_empty())
    }

    /// Records the rings dropped (full), in all.
    pub fn lost(&self) -> u64 {
        self.rings.iter().map(|r| r.borrow().lost()).sum()
    }

    /// Whether nothing older than root's time `now_ns` is left in any ring
    /// (each is empty, or its oldest record is stamped at `now_ns` or
    /// later): the clock may then age what the renderer holds back, as
    /// root's own idle event does when its rings are empty.
    pub fn caught_up(&self, now_ns: u64) -> bool {
        self.rings.iter().all(|r| {
            let r = r.borrow();
            r.is_empty() || r.peek_u64(self.stamp_at).is_some_and(|ts| ts >= now_ns)
        })
    }

    /// Takes the records written before `mark`, oldest first across the
    /// rings, as `TraceRecords` events appended to `out` (the first
    /// carries the losses since the last call); returns how many records.
    /// A ring whose positions or lengths cannot be right is an error: the
    /// records before it in this call are in `out` already.
    pub fn take(
        &mut self,
        mark: &[u64],
        out: &mut Vec<Event>,
    ) -> Result<usize, protocol::ring::RingError> {
        let lost_now = self.lost();
        let mut lost = lost_now.saturating_sub(self.lost_seen);
        self.lost_seen = lost_now;
        let mut data = Vec::new();
        let mut n = 0;
        loop {
            // Each ring's oldest record, if it was written before the mark.
            let heads = self.rings.iter().zip(mark).map(|(r, &until)| {
                let r = r.borrow();
                let left = until.wrapping_sub(r.tail());
                (left != 0 && left <= r.size() as u64).then(|| r.peek_u64(self.stamp_at))
            });
            let Some(i) = oldest(heads) else {
                break;
            };
            let Some(r) = self.rings.get(i) else { break };
            match r.borrow().pop(&mut self.record) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    // What was taken before goes out all the same.
                    if !data.is_empty() {
                        out.push(Event::TraceRecords {
                            lost,
                            now_ns: 0,
                            data,
                        });
                    }
                    return Err(e);
                }
            }
            n += 1;
            if !data.is_empty() && data.len() + 4 + self.record.len() > READER_EVENT_BYTES {
                out.push(Event::TraceRecords {
                    lost: core::mem::take(&mut lost),
                    now_ns: 0,
                    data: core::mem::take(&mut data),
                });
            }
            let header = self.record.len() as u32 & protocol::RECORD_LEN_MASK;
            data.extend_from_slice(&header.to_le_bytes());
            data.extend_from_slice(&self.record);
        }
        if !data.is_empty() {
            out.push(Event::TraceRecords {
                lost,
                now_ns: 0,
                data,
            });
        } else if lost > 0 {
            // An empty `TraceRecords` would say the rings were empty.
            out.push(Event::Lost { count: lost });
        }
        Ok(n)
    }
}

/// The merge rule of the vCPUs' rings, root's and the host's: of the
/// rings' oldest records (`None`: a ring with nothing to take; a record
/// too short for a timestamp counts as oldest, so that it never blocks its
/// ring), the index of the one stamped first (the lowest index on a tie).
pub fn oldest(heads: impl Iterator<Item = Option<Option<u64>>>) -> Option<usize> {
    heads
        .enumerate()
        .filter_map(|(i, head)| head.map(|ts| (i, ts.unwrap_or(0))))
        .min_by_key(|&(_, ts)| ts)
        .map(|(i, _)| i)
}

/// Cuts an over-long line at a character boundary.
pub fn cut_line(line: &mut String, max: usize) {
    if line.len() > max {
        let mut end = max;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
}
