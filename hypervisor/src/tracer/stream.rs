//! The stream: the vCPUs' event rings, and the rendering of their records,
//! merged oldest first, into `TraceText` events for the control channel,
//! in the format the host asked for. Each vCPU stores into its own ring;
//! the stream, the renderers it uses (probe specs, graph sessions) and the
//! control channel are the VM's.

use super::fgraph::{Graph, Retired};
use super::graph::{self as graph_fmt, GraphEventId};
use super::machine::KernelView;
use super::probes::Probes;
use super::ring::Rings;
use crate::kprobe::{self, IndexSymbols, RawEvent};
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;
use protocol::TraceFormat;

/// Bytes of all the vCPUs' event rings together (one vCPU has them all).
const RING_BYTES: usize = 2 << 20;
/// Bytes of one vCPU's ring at least, however many vCPUs share
/// [`RING_BYTES`].
const RING_BYTES_MIN: usize = 256 << 10;
/// The probe id of function-tracer events (probes count from 1).
pub(super) const FUNCTION_ID: u32 = 0;
/// Text per `TraceText` event, so that a frame stays under `MAX_FRAME`.
const TRACE_TEXT_BUDGET: usize = 2800;
/// How long (hypervisor time) a graph entry is held back for a leaf line
/// once the ring has nothing more: a call without a return by then is
/// printed open.
const LEAF_HOLD_NS: u64 = 100_000_000;
/// Output queue the drain leaves for responses.
const TX_HEADROOM: usize = 8 * 1024;

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
        }
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
        let k = kernel?;
        let syms = IndexSymbols::new(k.index(), Some(k.modules()));
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
                        while let Some(Retired {
                            number: user,
                            text: mut t,
                            ..
                        }) = graph.retired.pop()
                        {
                            if t.has_pending() {
                                t.flush(&mut text, &syms);
                                source = user;
                                break;
                            }
                        }
                    }
                    if text.is_empty() && format == TraceFormat::Text {
                        for (user, g) in graph.sessions.iter_mut().enumerate() {
                            let Some(g) = g else { continue };
                            let old = g
                                .text
                                .pending_since()
                                .is_some_and(|t| now_ns.saturating_sub(t) > LEAF_HOLD_NS);
                            if old {
                                g.text.flush(&mut text, &syms);
                                source = user as u32;
                                break;
                            }
                        }
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

    /// `TraceStart` / `TraceStop`.
    pub(super) fn set_format(&mut self, format: Option<TraceFormat>, graph: &mut Graph) {
        if self.format != format {
            self.pending_line = None;
            graph.flush_held();
        }
        self.format = format;
    }

    /// Whether rendered output is waiting (the stream wants busy turns).
    pub(super) fn has_output(&self) -> bool {
        self.format.is_some() && (!self.rings.is_empty() || self.pending_line.is_some())
    }
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
    let Ok((ev, _)) = RawEvent::decode(record) else {
        let _ = write!(out, "(undecodable record of {} bytes)", record.len());
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
    if id == FUNCTION_ID {
        match format {
            TraceFormat::Json => kprobe::write_function_json(out, &ev, syms),
            _ => kprobe::write_function_text(out, &ev, syms),
        }
        return 0;
    }
    // A probe deleted since the hit is no longer printable: skip it.
    let Some(p) = probes.get(id) else {
        return 0;
    };
    match format {
        TraceFormat::Json => kprobe::write_json(out, &p.spec, &ev, syms),
        _ => kprobe::write_text(out, &p.spec, &ev, syms),
    }
    0
}

/// Cuts an over-long line at a character boundary.
fn cut_line(line: &mut String, max: usize) {
    if line.len() > max {
        let mut end = max;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
}
