//! The trace stream as the supervisor runs it: starting, switching and
//! stopping root's stream (rendered here from root's records once the host
//! has root's symbols, else rendered by root), moving it to another
//! channel at a client's request, and serving `TraceRead` from the trace
//! buffer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{ErrorKind, Request, Response, TraceChannel, TraceFormat};
use tracelang::render::RecordRenderer;

use super::events::HostRender;
use super::{ended_message, Ending, Supervisor, MAX_TRACE_WAIT};

/// Most bytes of a `Kallsyms` page (a frame holds 4 KiB).
pub const KALLSYMS_PAGE: usize = 3072;

/// Where a page of at most `max` bytes of `text` ends: after its last
/// newline, or (a line longer than a page) at the last character boundary.
/// The listing quotes the guest's symbol names, whose bytes decide where
/// the characters are: nothing here slices inside one.
pub fn page_end(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    if let Some(nl) = text.as_bytes()[..max].iter().rposition(|&b| b == b'\n') {
        return nl + 1;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// How long a `Kallsyms` request waits for the symbol index to come.
pub const KALLSYMS_WAIT: Duration = Duration::from_secs(30);
use crate::daemon::tracebuf::{TraceChunk, READ_BUDGET};

/// How long a stream's start waits for root's symbols to reach the host
/// (asked for at the first start: recovering the kernel, if no request
/// did yet, and a few seconds of the log port); past it root renders this
/// stream, and the next start takes the symbols that came meanwhile.
const SYMBOLS_WAIT: Duration = Duration::from_secs(20);

impl Supervisor {
    /// Starts the trace stream in `format` (or switches it), and notes
    /// the format on success.
    pub(super) fn trace_start(&self, format: TraceFormat) -> Response {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let response = self.start_stream(format);
        if response == Response::Ok {
            *stream = Some(format);
        }
        response
    }

    /// Stops the ring reader taking records (it finishes the take under
    /// way first): before any request after which root drains the rings.
    pub(super) fn stop_host_reads(&self) {
        *self.trace.host_reads_lock() = false;
    }

    /// Starts root's stream for lines in `format`: as records rendered
    /// here once the host has root's symbols (the stream's path being the
    /// log port or the ring), else rendered by root. A switch of format
    /// keeps the records stream and its context.
    pub(super) fn start_stream(&self, format: TraceFormat) -> Response {
        self.stop_host_reads();
        if let Some(index) = self.host_index() {
            {
                let mut render = self.trace.render_lock();
                match render.as_mut() {
                    Some(r) => r.renderer.set_format(format),
                    None => {
                        *render = Some(HostRender {
                            renderer: RecordRenderer::new(format),
                            index,
                        })
                    }
                }
            }
            // Recording: root's own text comes beside the records.
            let recorded = self.trace.recording.is_some();
            let records = if recorded {
                TraceFormat::RecordsAndText
            } else {
                TraceFormat::Records
            };
            self.trace
                .root_text_recorded
                .store(recorded, Ordering::Relaxed);
            let response = self.forward(Request::TraceStart { format: records });
            if response == Response::Ok {
                // Root drains the rings itself when it renders beside them.
                let rings = self.channel_rings.load(Ordering::Relaxed) && !recorded;
                *self.trace.host_reads_lock() = rings;
                if !self.rendering_noted.swap(true, Ordering::Relaxed) {
                    self.note(if rings {
                        "the hypervisor's records are read from its rings and rendered here"
                    } else {
                        "the hypervisor streams records; they are rendered here"
                    });
                }
                return response;
            }
            *self.trace.render_lock() = None;
            self.trace
                .root_text_recorded
                .store(false, Ordering::Relaxed);
            self.note(&format!(
                "the stream is rendered by the hypervisor: records were refused: {response:?}"
            ));
        } else {
            *self.trace.render_lock() = None;
        }
        self.forward(Request::TraceStart { format })
    }

    /// Root's symbol index as the host has it, waiting for it while it
    /// comes; `None` without a path of the stream's own, or when the
    /// export failed (the stream is then rendered by root).
    fn host_index(&self) -> Option<Arc<guest_introspect::kallsyms::SymbolIndex>> {
        if !self.bulk.load(Ordering::Relaxed) || std::env::var_os("HVTRACE_ROOT_RENDERS").is_some()
        {
            return None;
        }
        let deadline = Instant::now() + SYMBOLS_WAIT;
        self.export_symbols();
        let symbols = self.trace.symbols.get()?;
        match symbols.wait(deadline.saturating_duration_since(Instant::now())) {
            Ok((index, _)) => Some(index),
            Err(why) => {
                self.note(&format!("the stream is rendered by the hypervisor: {why}"));
                None
            }
        }
    }

    /// Asks root for its symbol index once per boot, at the first start of
    /// a stream with a path of its own (the chunks come along that path).
    /// Not at boot: recovering the kernel waits for a request that needs
    /// it.
    fn export_symbols(&self) {
        let (Some(symbols), Some(link)) = (self.trace.symbols.get(), self.link.get()) else {
            return;
        };
        if !self.bulk.load(Ordering::Relaxed) || !symbols.start() {
            return;
        }
        // Root holds the request while it recovers the kernel, for a
        // while; a kernel still not found is asked about again.
        let deadline = Instant::now() + SYMBOLS_WAIT;
        loop {
            match link.request(Request::SymbolsExport) {
                Ok(Response::SymbolsExport {
                    id,
                    bytes,
                    symbols: n,
                }) => {
                    self.note(&format!(
                        "root sends its symbol index: {n} symbols in {bytes} bytes (export {id})"
                    ));
                    symbols.answered(id, bytes);
                }
                Ok(Response::Error {
                    kind: ErrorKind::NotReady,
                    message,
                }) if Instant::now() < deadline && self.ending().is_none() => {
                    self.note(&format!("symbol export: {message}; asking again"));
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                }
                Ok(other) => symbols.refused(format!("root answered {other:?}")),
                Err(e) => symbols.refused(e.to_string()),
            }
            break;
        }
    }

    /// `Kallsyms` from a client: a page of the guest's listing from
    /// `offset`, whole lines of at most [`KALLSYMS_PAGE`] bytes, made from
    /// the host's copy of root's index (asked for now if the stream has
    /// not asked yet; it comes only on a path of the stream's own).
    pub(super) fn kallsyms(&self, offset: u64) -> Response {
        let Some(symbols) = self.trace.symbols.get() else {
            return Response::error(ErrorKind::Unsupported, "this VM keeps no symbol index here");
        };
        self.export_symbols();
        let text = match symbols.listing_text(KALLSYMS_WAIT) {
            Ok(text) => text,
            Err(why) => {
                return Response::error(ErrorKind::NotReady, format!("no symbol listing: {why}"))
            }
        };
        let total = text.len() as u64;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(text.len());
        let Some(rest) = text.get(start..) else {
            return Response::error(ErrorKind::InvalidArgument, "offset inside a character");
        };
        let end = page_end(rest, KALLSYMS_PAGE);
        let next = start + end;
        Response::Kallsyms {
            text: rest.get(..end).unwrap_or_default().to_string(),
            next: (next < text.len()).then_some(next as u64),
            total,
        }
    }

    /// `TraceChannel` from a client: forwarded; records go only on a path
    /// of the stream's own, so a running stream is started again, as
    /// records on the log port or the ring, rendered by root on COM2.
    pub(super) fn trace_channel(&self, channel: TraceChannel) -> Response {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        // Nothing goes where nobody reads it.
        let unread = match channel {
            TraceChannel::SharedRings => !self.rings_reader.load(Ordering::Relaxed),
            TraceChannel::SharedRing => !self.frame_reader.load(Ordering::Relaxed),
            TraceChannel::LogPort => self.trace_port.get().is_none(),
            _ => false,
        };
        if unread {
            return Response::error(
                ErrorKind::Unsupported,
                "nothing reads that trace channel here (the shared rings: QEMU with KVM; the log port: a VM this supervisor launched)",
            );
        }
        self.stop_host_reads();
        // Whatever root answers (or if no answer comes), it drains the
        // rings itself unless it says where they are below.
        self.channel_rings.store(false, Ordering::Relaxed);
        let response = self.forward(Request::TraceChannel { channel });
        if response != Response::Ok
            && !matches!(
                response,
                Response::TraceRing { .. } | Response::TraceRings { .. }
            )
        {
            return response;
        }
        // Root now drains the rings itself unless this is `SharedRings`
        // and this process reads them (the rings stay where they were).
        self.channel_rings.store(
            matches!(response, Response::TraceRings { .. })
                && self.rings_reader.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let bulk = match channel {
            TraceChannel::Control => false,
            TraceChannel::LogPort => self.trace_port.get().is_some(),
            _ => true,
        };
        self.bulk.store(bulk, Ordering::Relaxed);
        if let Some(format) = *stream {
            let restarted = self.start_stream(format);
            if restarted != Response::Ok {
                self.note(&format!(
                    "the stream did not start again after the channel changed: {restarted:?}"
                ));
            }
        }
        response
    }

    pub(super) fn trace_stop(&self) -> Response {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        self.stop_host_reads();
        let response = self.forward(Request::TraceStop);
        if response == Response::Ok {
            *stream = None;
            *self.trace.render_lock() = None;
            self.trace
                .root_text_recorded
                .store(false, Ordering::Relaxed);
        }
        response
    }

    /// Serves `TraceRead`: starts or switches the stream when it is not in
    /// `format`, then reads the buffer (the lines of `source`, or of every
    /// source).
    pub(super) fn trace_read(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        wait_ms: u32,
    ) -> Response {
        {
            let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            if *stream != Some(format) {
                match self.start_stream(format) {
                    Response::Ok => *stream = Some(format),
                    other => return other,
                }
            }
        }
        let wait = Duration::from_millis(u64::from(wait_ms)).min(MAX_TRACE_WAIT);
        let chunk = self
            .trace
            .wait_read(cursor, format, source, wait, &|| self.ending().is_some());
        trace_response(chunk)
    }

    /// Serves `TraceRead` once the VM has ended: what is left in the buffer,
    /// then the end.
    pub(super) fn trace_read_after_end(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        end: &Ending,
    ) -> Response {
        let chunk = self.trace.lock().read(cursor, format, source, READ_BUDGET);
        if chunk.is_empty() {
            return Response::error(ErrorKind::NotReady, ended_message(end));
        }
        trace_response(chunk)
    }
}

fn trace_response(chunk: TraceChunk) -> Response {
    Response::Trace {
        next: chunk.next,
        text: chunk.text,
        lost: chunk.lost,
    }
}
