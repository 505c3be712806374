//! The supervisor's side of the hypervisor's events: the trace buffer
//! that the link's reader thread (and the log port's or the rings' reader)
//! fills, the renderer of root's records while the stream is in records,
//! and what becomes of every other event.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use protocol::{Event, TraceFormat};
use tracelang::kprobe::IndexSymbols;
use tracelang::render::RecordRenderer;

use crate::daemon::recording::{Noting, Recorder};
use crate::daemon::symbols::HostSymbols;
use crate::daemon::tracebuf::{TraceBuffer, TraceChunk, READ_BUDGET};

/// The trace buffer, shared with the link's reader thread, which fills it.
pub(super) struct TraceShared {
    buf: Mutex<TraceBuffer>,
    pub(super) cv: Condvar,
    /// Binary `Trace` events received (this supervisor reads rendered text).
    binary: AtomicU64,
    /// The host's copy of root's symbol index, once the VM started.
    pub(super) symbols: OnceLock<Arc<HostSymbols>>,
    /// The renderer of root's records, while the stream is in records.
    render: Mutex<Option<HostRender>>,
    /// Records that came with no renderer (dropped).
    unrendered: AtomicU64,
    /// The host takes the records out of root's rings itself (the channel
    /// is `SharedRings` and the stream is in records). Held by the ring
    /// reader while it takes records, so that root drains again only after
    /// the reader stopped ([`Supervisor::stop_host_reads`](super::Supervisor::stop_host_reads)).
    host_reads: Mutex<bool>,
    /// Root's doorbell rings ([`Event::TraceDoorbell`]): counted, and the
    /// ring reader woken.
    doorbell: Mutex<u64>,
    doorbell_cv: Condvar,

    /// The recording `HVTRACE_RECORD_STREAM` names, when it is set and
    /// could be opened: streams rendered here are then started as records
    /// and root's text ([`crate::daemon::recording`]).
    pub(super) recording: Option<Mutex<Recorder>>,
    /// The stream is records and root's text: root's `TraceText` goes to
    /// the recording, not to the buffer.
    pub(super) root_text_recorded: AtomicBool,
}

/// The stream rendered here: the renderer and the index it names with.
pub(super) struct HostRender {
    pub(super) renderer: RecordRenderer,
    pub(super) index: Arc<guest_introspect::kallsyms::SymbolIndex>,
}

impl TraceShared {
    pub(crate) fn new() -> TraceShared {
        TraceShared {
            buf: Mutex::new(TraceBuffer::new()),
            cv: Condvar::new(),
            binary: AtomicU64::new(0),
            symbols: OnceLock::new(),
            render: Mutex::new(None),
            unrendered: AtomicU64::new(0),
            host_reads: Mutex::new(false),
            doorbell: Mutex::new(0),
            doorbell_cv: Condvar::new(),
            recording: None,
            root_text_recorded: AtomicBool::new(false),
        }
    }

    pub(super) fn host_reads_lock(&self) -> MutexGuard<'_, bool> {
        self.host_reads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits up to `wait` for the doorbell after `seen` rings; returns the
    /// rings so far.
    pub(super) fn wait_doorbell(&self, seen: u64, wait: Duration) -> u64 {
        let rings = self.doorbell.lock().unwrap_or_else(|e| e.into_inner());
        if *rings != seen {
            return *rings;
        }
        *self
            .doorbell_cv
            .wait_timeout(rings, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// With the recording `HVTRACE_RECORD_STREAM` names, if any (a file
    /// that cannot be opened is noted through `note`, and nothing is
    /// recorded); `note` also hears that the recording is on.
    pub(super) fn with_recording(mut self, note: &dyn Fn(&str)) -> TraceShared {
        match Recorder::from_env() {
            Some(Ok(r)) => {
                note("the trace stream is recorded with root's own text");
                self.recording = Some(Mutex::new(r));
            }
            Some(Err(e)) => note(&format!("the stream recording cannot be opened: {e}")),
            None => {}
        }
        self
    }

    fn recorder(&self) -> Option<MutexGuard<'_, Recorder>> {
        self.recording
            .as_ref()
            .map(|r| r.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds text to the buffer (root's, or rendered here).
    fn buffer_text(&self, format: TraceFormat, source: u32, lost: u64, text: &str) {
        let mut buf = self.lock();
        buf.push_lost(lost);
        buf.push_text(format, source, text);
        drop(buf);
        self.cv.notify_all();
    }

    pub(super) fn render_lock(&self) -> MutexGuard<'_, Option<HostRender>> {
        self.render.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, TraceBuffer> {
        self.buf.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one event from the hypervisor.
    pub(super) fn on_event(&self, event: Event, note: &dyn Fn(&str)) {
        match event {
            Event::TraceText { .. } if self.root_text_recorded.load(Ordering::Relaxed) => {
                if let Some(mut r) = self.recorder() {
                    r.event("root", &event);
                }
            }
            Event::TraceText {
                format,
                source,
                lost,
                text,
            } => self.buffer_text(format, source, lost, &text),
            Event::Lost { count } => {
                self.lock().push_lost(count);
                self.cv.notify_all();
            }
            Event::Log { text } => note(&format!("hypervisor: {text}")),
            // The VM's control tap hands the fatal report to the VM's log
            // digest, where the log port's copy goes too.
            Event::Fatal { .. } => {}
            Event::SymbolChunk {
                id,
                part,
                total,
                offset,
                data,
            } => {
                if let Some(s) = self.symbols.get() {
                    s.chunk(id, part, total, offset, &data);
                }
            }
            Event::TraceContext(c) => {
                if let Some(mut r) = self.recorder() {
                    r.event("ctx", &Event::TraceContext(c.clone()));
                }
                if let Some(r) = self.render_lock().as_mut() {
                    r.renderer.context(&c);
                }
            }
            Event::TraceRecords { lost, now_ns, data } => {
                let mut recorder = self.recorder();
                if let Some(r) = recorder.as_mut() {
                    r.event(
                        "rec",
                        &Event::TraceRecords {
                            lost,
                            now_ns,
                            data: data.clone(),
                        },
                    );
                }
                let mut out = Vec::new();
                match self.render_lock().as_mut() {
                    Some(r) => {
                        let modules = self.symbols.get().and_then(|s| s.modules());
                        let syms = IndexSymbols::new(&r.index, modules.as_deref());
                        match recorder.as_mut() {
                            Some(rec) => {
                                let noting = Noting::new(&syms);
                                r.renderer.records(lost, now_ns, &data, &noting, &mut out);
                                rec.addresses(&noting.seen.borrow());
                            }
                            None => r.renderer.records(lost, now_ns, &data, &syms, &mut out),
                        }
                    }
                    None => {
                        if self.unrendered.fetch_add(1, Ordering::Relaxed) == 0 {
                            note("trace records came with no renderer; they are dropped");
                        }
                    }
                }
                for e in out {
                    if let Event::TraceText {
                        format,
                        source,
                        lost,
                        text,
                    } = e
                    {
                        if let Some(r) = recorder.as_mut() {
                            r.host_text(&text);
                        }
                        self.buffer_text(format, source, lost, &text);
                    }
                }
            }
            Event::TraceDoorbell => {
                *self.doorbell.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                self.doorbell_cv.notify_all();
            }
            Event::Trace { .. } => {
                if self.binary.fetch_add(1, Ordering::Relaxed) == 0 {
                    note("the hypervisor sends binary trace records, which this hvtrace does not read; they are dropped");
                }
            }
            other => note(&format!(
                "dropped an unknown event from the hypervisor: {other:?}"
            )),
        }
    }

    /// Reads from `cursor`, waiting up to `wait` for a line of `format`
    /// from `source` (`None`: any source); `ended` cuts the wait short.
    /// Losses alone do not end the wait: they come with the first line
    /// after them, or when the wait is over.
    pub(super) fn wait_read(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        wait: Duration,
        ended: &dyn Fn() -> bool,
    ) -> TraceChunk {
        let deadline = Instant::now() + wait;
        let mut buf = self.lock();
        let mut cursor = cursor;
        loop {
            let chunk = buf.read(cursor, format, source, READ_BUDGET);
            let left = deadline.saturating_duration_since(Instant::now());
            if !chunk.text.is_empty() || left.is_zero() || ended() {
                return chunk;
            }
            if chunk.lost == 0 {
                // Only lines of another format or source, if anything: go
                // on from there. With a loss to report, read from the cursor again.
                cursor = chunk.next;
            }
            // The end of the VM does not notify this condition variable;
            // short slices bound the delay.
            let slice = left.min(Duration::from_millis(200));
            buf = self
                .cv
                .wait_timeout(buf, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
