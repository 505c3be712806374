//! The host end of COM2, the hypervisor's control channel.
//!
//! One request is in flight at a time: [`HvLink`] holds a lock from the
//! moment a request is written until its answer arrives or the time limit
//! passes. Requests carry the link's own sequence numbers, so whatever
//! numbers the clients use, an answer is matched to the request it belongs
//! to. A reader thread decodes everything the hypervisor sends; a late
//! answer to a request that timed out is dropped before the next request
//! goes out.
//!
//! Unsolicited events (log lines, rendered trace text, loss counts) go to
//! the event sink given to [`HvLink::with_events`], called on the reader
//! thread as each event arrives, whether a request is in flight or not.

use std::fmt;
use std::io::{Read, Write};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use protocol::{encode, Body, Event, Frame, FrameDecoder, Request, Response};

/// How long the hypervisor gets to answer one request. A status report of
/// 2 KiB takes about 0.2 s at the UART's pace; the rest is margin for a slow
/// emulator on a loaded host.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The least time allowed for a request that hooks or unhooks fentry sites
/// (probes, the function tracer, function-graph sessions): VMX root patches
/// and flushes every site before it answers. Hooking all 37,657 traceable
/// functions of Debian's 6.1 kernel takes 10 to 11 s of wall time in Bochs
/// on an idle host (measured); this leaves four times that, and
/// [`Pace`] stretches it further when the emulator runs slower than its
/// best.
pub const HOOK_TIMEOUT: Duration = Duration::from_secs(45);

/// The longest the supervisor waits for an answer to a request whose plain
/// limit is `limit` (stretched as far as [`Pace`] goes), plus `margin`: a
/// client that waits this long hears the supervisor's own error, not a
/// timeout of its own.
pub const fn longest_wait(limit: Duration, margin: Duration) -> Duration {
    limit
        .saturating_mul(Pace::MAX_STRETCH_TIMES)
        .saturating_add(margin)
}

/// How long the hypervisor may take to answer `request` on a link whose
/// own limit is `base`.
pub fn timeout_for(request: &Request, base: Duration) -> Duration {
    match request {
        Request::ProbeAdd { .. }
        | Request::ProbeDel { .. }
        | Request::FunctionAdd { .. }
        | Request::FunctionClear
        | Request::GraphStart(_)
        | Request::GraphStop { .. }
        | Request::CountStart(_)
        | Request::CountStop
        | Request::Syscalls { cursor: 0 } => base.max(HOOK_TIMEOUT),
        _ => base,
    }
}

/// The emulator's pace: emulated nanoseconds (the hypervisor's uptime in
/// its status reports) per wall nanosecond, measured between status
/// reports at least [`Pace::MIN_SPAN`] apart. A host that is loaded, or
/// an emulator that shares it with another, runs slower than the best pace
/// seen; the link's deadlines stretch by the same factor (up to
/// [`Pace::MAX_STRETCH`]), so that a slow host gives slow answers rather
/// than false timeouts. Before two reports exist there is no measurement:
/// the deadlines are stretched by [`Pace::UNMEASURED_STRETCH`], since the
/// first request of a boot is the one that waits longest (it may be held
/// while recovery runs, up to 5 s of the hypervisor's time) and a loaded
/// host would otherwise fail it falsely.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pace {
    last: Option<(Instant, u64)>,
    /// The latest measured pace.
    current: Option<f64>,
    /// The best pace measured on this link.
    best: Option<f64>,
}

impl Pace {
    /// Shortest span between two samples that counts as a measurement.
    pub const MIN_SPAN: Duration = Duration::from_secs(1);
    /// Most a deadline is stretched, as a whole factor.
    pub const MAX_STRETCH_TIMES: u32 = 8;
    /// Most a deadline is stretched.
    pub const MAX_STRETCH: f64 = Self::MAX_STRETCH_TIMES as f64;
    /// The stretch before the pace is measured.
    pub const UNMEASURED_STRETCH: f64 = 3.0;

    /// Notes a status report's uptime, received at `at`.
    pub fn sample(&mut self, at: Instant, uptime_ns: u64) {
        match self.last {
            Some((t0, u0)) if uptime_ns >= u0 => {
                let wall = at.saturating_duration_since(t0);
                if wall < Self::MIN_SPAN {
                    return;
                }
                let pace = (uptime_ns - u0) as f64 / wall.as_nanos() as f64;
                if pace > 0.0 {
                    self.current = Some(pace);
                    self.best = Some(self.best.map_or(pace, |b| b.max(pace)));
                }
                self.last = Some((at, uptime_ns));
            }
            // The first sample, or a new hypervisor (its uptime restarted).
            _ => self.last = Some((at, uptime_ns)),
        }
    }

    /// `limit`, stretched by how much slower than its best the emulator
    /// runs now.
    pub fn stretch(&self, limit: Duration) -> Duration {
        match (self.current, self.best) {
            (Some(now), Some(best)) if now > 0.0 => {
                limit.mul_f64((best / now).clamp(1.0, Self::MAX_STRETCH))
            }
            _ => limit.mul_f64(Self::UNMEASURED_STRETCH),
        }
    }
}

/// Why a request got no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkError {
    /// No answer within the time limit.
    Timeout(Duration),
    /// The channel is closed (the emulator ended) or a write failed.
    Closed(String),
}

impl fmt::Display for LinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkError::Timeout(t) => write!(
                f,
                "the hypervisor did not answer within {:.1} s",
                t.as_secs_f64()
            ),
            LinkError::Closed(why) => write!(f, "the control channel is closed: {why}"),
        }
    }
}

impl std::error::Error for LinkError {}

/// Counters of the host end, for the supervisor's log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Requests sent with the link's own sequence numbers.
    pub requests: u64,
    /// Raw segments forwarded (other versions, garbage, cut frames).
    pub forwarded: u64,
    /// Bytes written to the channel.
    pub bytes_out: u64,
    /// Bytes read from the channel.
    pub bytes_in: u64,
    /// Frames read from the channel.
    pub frames_in: u64,
    /// Bytes from the hypervisor that did not decode.
    pub bad_frames_in: u64,
    /// Answers that matched no request in flight (late or unexpected).
    pub stale: u64,
    /// Requests that timed out.
    pub timeouts: u64,
    /// Events received.
    pub events: u64,
    /// Event frames that never arrived, going by the gaps in the
    /// hypervisor's event sequence numbers.
    pub event_gaps: u64,
    /// Events received without a sink to take them.
    pub events_unheard: u64,
}

/// Where the hypervisor's events go: called on the link's reader thread, in
/// arrival order, with each event frame's sequence number. It should not
/// block for long, since nothing else is read meanwhile.
pub type EventSink = Box<dyn FnMut(u32, Event) + Send>;

/// Sequence numbers for requests: wrapping, starting at 1.
#[derive(Clone, Copy, Debug)]
pub struct SeqCounter(u32);

impl Default for SeqCounter {
    fn default() -> Self {
        SeqCounter(1)
    }
}

impl SeqCounter {
    /// Starts at `first`.
    pub fn starting_at(first: u32) -> SeqCounter {
        SeqCounter(first)
    }

    /// The next number.
    pub fn next_seq(&mut self) -> u32 {
        let seq = self.0;
        self.0 = self.0.wrapping_add(1);
        seq
    }
}

enum FromHv {
    Frame(Box<Frame>),
    Closed(String),
}

struct Inner {
    writer: Box<dyn Write + Send>,
    rx: Receiver<FromHv>,
    seq: SeqCounter,
    closed: Option<String>,
    buf: Vec<u8>,
}

/// The host end of the control channel.
pub struct HvLink {
    inner: Mutex<Inner>,
    /// The emulator's measured pace, for the deadlines.
    pace: Mutex<Pace>,
    stats: Arc<Mutex<LinkStats>>,
    /// Set by the reader thread when the stream ends.
    eof: Arc<Mutex<Option<String>>>,
    timeout: Duration,
    _reader: JoinHandle<()>,
}

impl HvLink {
    /// Starts the link over a byte stream (its two halves), with a reader
    /// thread. `timeout` bounds each request. Events are counted and
    /// dropped; see [`HvLink::with_events`].
    pub fn start<R, W>(reader: R, writer: W, timeout: Duration) -> HvLink
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        Self::launch(reader, writer, timeout, None)
    }

    /// Like [`HvLink::start`], and hands every event the hypervisor sends
    /// to `sink`.
    pub fn with_events<R, W>(
        reader: R,
        writer: W,
        timeout: Duration,
        sink: impl FnMut(u32, Event) + Send + 'static,
    ) -> HvLink
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        Self::launch(reader, writer, timeout, Some(Box::new(sink)))
    }

    fn launch<R, W>(reader: R, writer: W, timeout: Duration, sink: Option<EventSink>) -> HvLink
    where
        R: Read + Send + 'static,
        W: Write + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(LinkStats::default()));
        let eof = Arc::new(Mutex::new(None));
        let reader = spawn_reader(reader, tx, sink, stats.clone(), eof.clone());
        HvLink {
            pace: Mutex::new(Pace::default()),
            inner: Mutex::new(Inner {
                writer: Box::new(writer),
                rx,
                seq: SeqCounter::default(),
                closed: None,
                buf: Vec::new(),
            }),
            stats,
            eof,
            timeout,
            _reader: reader,
        }
    }

    /// Sends `request` under the link's own sequence number and waits for the
    /// hypervisor's answer to it.
    pub fn request(&self, request: Request) -> Result<Response, LinkError> {
        let mut inner = self.lock()?;
        self.drain_stale(&mut inner)?;
        let seq = inner.seq.next_seq();
        inner.buf.clear();
        let limit = self.stretched(timeout_for(&request, self.timeout));
        let frame = Frame::request(seq, request);
        if let Err(e) = encode(&frame, &mut inner.buf) {
            return Err(LinkError::Closed(format!("cannot encode the request: {e}")));
        }
        let wire = std::mem::take(&mut inner.buf);
        let written = self.write(&mut inner, &wire);
        inner.buf = wire;
        written?;
        self.bump(|s| s.requests += 1);
        let frame = self.wait(&mut inner, seq, limit)?;
        match frame.body {
            Body::Response(response) => Ok(response),
            // `wait` only returns responses.
            _ => Err(LinkError::Closed("unexpected frame".to_string())),
        }
    }

    /// Writes a client's frame of another protocol version as it is and
    /// waits for the hypervisor's answer under the frame's own `seq`.
    pub fn forward_expecting(&self, wire: &[u8], seq: u32) -> Result<Frame, LinkError> {
        let mut inner = self.lock()?;
        self.drain_stale(&mut inner)?;
        self.write(&mut inner, wire)?;
        self.bump(|s| s.forwarded += 1);
        let limit = self.stretched(self.timeout);
        self.wait(&mut inner, seq, limit)
    }

    /// Writes bytes that are not a frame as they are; nothing answers them.
    pub fn forward(&self, wire: &[u8]) -> Result<(), LinkError> {
        let mut inner = self.lock()?;
        self.write(&mut inner, wire)?;
        self.bump(|s| s.forwarded += 1);
        Ok(())
    }

    /// The counters so far.
    pub fn stats(&self) -> LinkStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the emulator closed the channel, once it did. Does not wait for
    /// a request in flight.
    pub fn closed(&self) -> Option<String> {
        self.eof.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    // ----- internals -----

    fn lock(&self) -> Result<MutexGuard<'_, Inner>, LinkError> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &inner.closed {
            return Err(LinkError::Closed(why.clone()));
        }
        Ok(inner)
    }

    fn bump(&self, f: impl FnOnce(&mut LinkStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn write(&self, inner: &mut Inner, wire: &[u8]) -> Result<(), LinkError> {
        let result = inner
            .writer
            .write_all(wire)
            .and_then(|_| inner.writer.flush());
        if let Err(e) = result {
            let why = format!("write failed: {e}");
            inner.closed = Some(why.clone());
            return Err(LinkError::Closed(why));
        }
        let n = wire.len() as u64;
        self.bump(|s| s.bytes_out += n);
        Ok(())
    }

    /// Drops whatever arrived while no request was in flight; fails if the
    /// channel closed meanwhile.
    fn drain_stale(&self, inner: &mut Inner) -> Result<(), LinkError> {
        loop {
            match inner.rx.try_recv() {
                Ok(FromHv::Frame(_)) => self.bump(|s| s.stale += 1),
                Ok(FromHv::Closed(why)) => {
                    inner.closed = Some(why.clone());
                    return Err(LinkError::Closed(why));
                }
                Err(_) => return Ok(()),
            }
        }
    }

    /// Waits for the response with sequence number `seq`.
    /// `limit` stretched by the emulator's measured pace.
    fn stretched(&self, limit: Duration) -> Duration {
        self.pace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stretch(limit)
    }

    fn wait(&self, inner: &mut Inner, seq: u32, limit: Duration) -> Result<Frame, LinkError> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match inner.rx.recv_timeout(left) {
                Ok(FromHv::Frame(frame)) => {
                    if let Body::Response(Response::Status(report)) = &frame.body {
                        self.pace
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .sample(Instant::now(), report.uptime_ns);
                    }
                    if frame.seq == seq && matches!(frame.body, Body::Response(_)) {
                        return Ok(*frame);
                    }
                    // A late answer to a request that timed out, or one
                    // the hypervisor should not have sent.
                    self.bump(|s| s.stale += 1);
                }
                Ok(FromHv::Closed(why)) => {
                    inner.closed = Some(why.clone());
                    return Err(LinkError::Closed(why));
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.bump(|s| s.timeouts += 1);
                    return Err(LinkError::Timeout(limit));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let why = "the reader stopped".to_string();
                    inner.closed = Some(why.clone());
                    return Err(LinkError::Closed(why));
                }
            }
        }
    }
}

/// Follows the hypervisor's event sequence numbers.
#[derive(Clone, Copy, Debug, Default)]
struct EventSeq {
    last: Option<u32>,
}

impl EventSeq {
    /// Notes the number of an event frame; returns how many frames before
    /// it never arrived. A jump backwards, or too far ahead to be a gap,
    /// means the counter restarted (a new hypervisor) and counts nothing.
    fn next(&mut self, seq: u32) -> u64 {
        let missing = match self.last {
            Some(last) => {
                let ahead = seq.wrapping_sub(last.wrapping_add(1));
                if ahead < 1 << 31 {
                    u64::from(ahead)
                } else {
                    0
                }
            }
            None => 0,
        };
        self.last = Some(seq);
        missing
    }
}

/// Decodes what the hypervisor sends: responses go to the request waiting
/// for them, events to the sink.
fn spawn_reader<R: Read + Send + 'static>(
    mut reader: R,
    tx: Sender<FromHv>,
    mut sink: Option<EventSink>,
    stats: Arc<Mutex<LinkStats>>,
    eof: Arc<Mutex<Option<String>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut decoder = FrameDecoder::new();
        let mut event_seq = EventSeq::default();
        let mut buf = [0u8; 4096];
        let why = loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break "the emulator closed it".to_string(),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break format!("read failed: {e}"),
            };
            let mut frames = Vec::new();
            let mut bad = 0u64;
            for result in decoder.feed(&buf[..n]) {
                match result {
                    Ok(frame) => frames.push(frame),
                    Err(_) => bad += 1,
                }
            }
            {
                let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
                s.bytes_in += n as u64;
                s.frames_in += frames.len() as u64;
                s.bad_frames_in += bad;
            }
            for frame in frames {
                let seq = frame.seq;
                let event = match frame.body {
                    Body::Event(event) => event,
                    body => {
                        let frame = Frame { body, ..frame };
                        if tx.send(FromHv::Frame(Box::new(frame))).is_err() {
                            return;
                        }
                        continue;
                    }
                };
                // The fatal frame takes no place in the event sequence.
                let missing = if matches!(event, Event::Fatal { .. }) {
                    0
                } else {
                    event_seq.next(seq)
                };
                {
                    let mut s = stats.lock().unwrap_or_else(|e| e.into_inner());
                    s.events += 1;
                    s.event_gaps += missing;
                    if sink.is_none() {
                        s.events_unheard += 1;
                    }
                }
                if let Some(sink) = sink.as_mut() {
                    sink(seq, event);
                }
            }
        };
        *eof.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
        let _ = tx.send(FromHv::Closed(why));
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::io::{FrameReader, FrameWriter};
    use protocol::{DecodeError, PROTOCOL_VERSION};
    use std::os::unix::net::UnixStream;

    /// A fake hypervisor on the other end of a socket pair; `answer` decides
    /// what goes back for each decoded frame (or decode error). Returns the
    /// link and the sequence numbers the fake saw.
    fn fake_hv(
        answer: impl Fn(Result<&Frame, &DecodeError>) -> Vec<Frame> + Send + 'static,
    ) -> (HvLink, Arc<Mutex<Vec<u32>>>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let reader = ours.try_clone().unwrap();
        let link = HvLink::start(reader, ours, Duration::from_millis(500));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            let mut r = FrameReader::new(theirs.try_clone().unwrap());
            let mut w = FrameWriter::new(theirs);
            loop {
                let frames = match r.read_frame() {
                    Ok(f) => {
                        record.lock().unwrap().push(f.seq);
                        answer(Ok(&f))
                    }
                    Err(protocol::io::ReadError::Decode(e)) => answer(Err(&e)),
                    Err(_) => break,
                };
                for f in frames {
                    if w.write_frame(&f).is_err() {
                        return;
                    }
                }
            }
        });
        (link, seen)
    }

    fn pong(f: Result<&Frame, &DecodeError>) -> Vec<Frame> {
        match f {
            Ok(Frame {
                seq,
                body: Body::Request(Request::Ping { nonce }),
                ..
            }) => vec![Frame::response(*seq, Response::Pong { nonce: *nonce })],
            Ok(f) => vec![Frame::response(f.seq, Response::Ok)],
            Err(DecodeError::UnsupportedVersion { found, seq }) => vec![Frame::response(
                *seq,
                Response::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: *found,
                },
            )],
            Err(_) => vec![],
        }
    }

    #[test]
    fn requests_use_the_links_own_numbers() {
        let (link, seen) = fake_hv(pong);
        for nonce in 0..5 {
            assert_eq!(
                link.request(Request::Ping { nonce }).unwrap(),
                Response::Pong { nonce }
            );
        }
        assert_eq!(*seen.lock().unwrap(), [1, 2, 3, 4, 5]);
    }

    #[test]
    fn answers_for_other_numbers_are_skipped() {
        let (link, _hv) = fake_hv(|f| match f {
            Ok(f) => vec![
                Frame::response(f.seq.wrapping_add(1000), Response::Ok),
                Frame::event(3, protocol::Event::Lost { count: 1 }),
                Frame::response(f.seq, Response::Pong { nonce: 1 }),
            ],
            Err(_) => vec![],
        });
        assert_eq!(
            link.request(Request::Ping { nonce: 1 }).unwrap(),
            Response::Pong { nonce: 1 }
        );
        // The stray answer is stale; the event, without a sink, is unheard.
        let stats = link.stats();
        assert_eq!((stats.stale, stats.events, stats.events_unheard), (1, 1, 1));
    }

    #[test]
    fn events_reach_the_sink_with_or_without_a_request() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = mpsc::channel();
        let link = HvLink::with_events(
            ours.try_clone().unwrap(),
            ours,
            Duration::from_millis(500),
            move |seq, event| {
                let _ = tx.send((seq, event));
            },
        );
        let mut r = FrameReader::new(theirs.try_clone().unwrap());
        let mut w = FrameWriter::new(theirs);
        // Unsolicited, with no request in flight; 12 and 13 never arrive.
        let text = |t: &str| protocol::Event::TraceText {
            format: protocol::TraceFormat::Text,
            source: 0,
            lost: 0,
            text: t.to_string(),
        };
        w.write_frame(&Frame::event(10, text("a\n"))).unwrap();
        w.write_frame(&Frame::event(11, protocol::Event::Lost { count: 4 }))
            .unwrap();
        w.write_frame(&Frame::event(14, text("b\n"))).unwrap();
        let got: Vec<_> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(
            got,
            [
                (10, text("a\n")),
                (11, protocol::Event::Lost { count: 4 }),
                (14, text("b\n"))
            ]
        );
        // A request still gets its answer, with an event in between.
        let answer = std::thread::spawn(move || {
            let f = r.read_frame().unwrap();
            w.write_frame(&Frame::event(
                15,
                protocol::Event::Log { text: "hi".into() },
            ))
            .unwrap();
            w.write_frame(&Frame::response(f.seq, Response::Ok))
                .unwrap();
        });
        assert_eq!(link.request(Request::TraceStop).unwrap(), Response::Ok);
        answer.join().unwrap();
        let (seq, event) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(seq, 15);
        assert_eq!(event, protocol::Event::Log { text: "hi".into() });
        let stats = link.stats();
        assert_eq!(
            (
                stats.events,
                stats.event_gaps,
                stats.events_unheard,
                stats.stale
            ),
            (4, 2, 0, 0)
        );
    }

    #[test]
    fn event_sequence_gaps() {
        let mut s = EventSeq::default();
        assert_eq!(s.next(100), 0);
        assert_eq!(s.next(101), 0);
        assert_eq!(s.next(104), 2);
        // Wrapping is no gap.
        let mut s = EventSeq::default();
        assert_eq!(s.next(u32::MAX), 0);
        assert_eq!(s.next(0), 0);
        // A restart (backwards) counts nothing.
        assert_eq!(s.next(0), 0);
        assert_eq!(s.next(1), 0);
    }

    #[test]
    fn hooking_requests_get_the_longer_limit() {
        let base = Duration::from_millis(500);
        for r in [
            Request::GraphStart(protocol::GraphFilter::default()),
            Request::GraphStop { session: None },
            Request::FunctionAdd { glob: "*".into() },
            Request::FunctionClear,
            Request::ProbeAdd { spec: "p f".into() },
            Request::ProbeDel { name: "f".into() },
        ] {
            assert_eq!(timeout_for(&r, base), HOOK_TIMEOUT, "{r:?}");
        }
        assert_eq!(timeout_for(&Request::Status, base), base);
        assert_eq!(timeout_for(&Request::ProbeList, base), base);
        // A link with a longer limit keeps it.
        let long = Duration::from_secs(60);
        assert_eq!(timeout_for(&Request::FunctionClear, long), long);
    }

    #[test]
    fn timeout_then_the_late_answer_is_dropped() {
        // The first request is answered only after the second arrives.
        let held = Arc::new(Mutex::new(None::<Frame>));
        let h = held.clone();
        let (link, _hv) = fake_hv(move |f| {
            let Ok(f) = f else { return vec![] };
            let mut held = h.lock().unwrap();
            match held.take() {
                None if f.seq == 1 => {
                    *held = Some(Frame::response(1, Response::Pong { nonce: 1 }));
                    vec![]
                }
                Some(late) => vec![late, Frame::response(f.seq, Response::Pong { nonce: 2 })],
                None => vec![Frame::response(f.seq, Response::Pong { nonce: 2 })],
            }
        });
        let err = link.request(Request::Ping { nonce: 1 }).unwrap_err();
        assert!(matches!(err, LinkError::Timeout(_)));
        // 0.5 s, stretched: no pace is measured yet.
        assert!(
            err.to_string().contains("did not answer within 1.5 s"),
            "{err}"
        );
        assert_eq!(
            link.request(Request::Ping { nonce: 2 }).unwrap(),
            Response::Pong { nonce: 2 }
        );
        assert_eq!(link.stats().timeouts, 1);
        assert_eq!(link.stats().stale, 1);
    }

    #[test]
    fn wrong_version_is_answered_under_its_own_number() {
        let (link, _hv) = fake_hv(pong);
        let mut old = Frame::request(4242, Request::Status);
        old.version = PROTOCOL_VERSION + 7;
        let mut wire = Vec::new();
        encode(&old, &mut wire).unwrap();
        let answer = link.forward_expecting(&wire, 4242).unwrap();
        assert_eq!(answer.seq, 4242);
        assert_eq!(
            answer.body,
            Body::Response(Response::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: PROTOCOL_VERSION + 7
            })
        );
        // Garbage is written and nothing waits for it; the next request works.
        link.forward(b"\x00noise\x00").unwrap();
        assert_eq!(
            link.request(Request::Ping { nonce: 3 }).unwrap(),
            Response::Pong { nonce: 3 }
        );
        assert_eq!(link.stats().forwarded, 2);
    }

    #[test]
    fn closed_channel_fails_fast() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let link = HvLink::start(ours.try_clone().unwrap(), ours, Duration::from_secs(30));
        drop(theirs);
        let start = Instant::now();
        let err = link.request(Request::Status).unwrap_err();
        assert!(matches!(err, LinkError::Closed(_)), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
        let until = Instant::now() + Duration::from_secs(5);
        while link.closed().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(link.closed().is_some());
        assert!(matches!(link.forward(b"x"), Err(LinkError::Closed(_))));
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut s = SeqCounter::starting_at(u32::MAX);
        assert_eq!(s.next_seq(), u32::MAX);
        assert_eq!(s.next_seq(), 0);
        assert_eq!(s.next_seq(), 1);
    }

    #[test]
    fn deadlines_stretch_when_the_emulator_slows_down() {
        let t0 = Instant::now();
        let mut p = Pace::default();
        let limit = Duration::from_secs(25);
        // No measurement yet: a generous limit.
        let unmeasured = limit.mul_f64(Pace::UNMEASURED_STRETCH);
        assert_eq!(p.stretch(limit), unmeasured);
        // 2 s of emulated time per wall second, then half that.
        p.sample(t0, 0);
        assert_eq!(p.stretch(limit), unmeasured);
        p.sample(t0 + Duration::from_secs(2), 4_000_000_000);
        assert_eq!(p.stretch(limit), limit);
        p.sample(t0 + Duration::from_secs(4), 6_000_000_000);
        assert_eq!(p.stretch(limit), limit * 2);
        // Samples closer than MIN_SPAN are not measurements.
        p.sample(t0 + Duration::from_millis(4100), 6_000_000_001);
        assert_eq!(p.stretch(limit), limit * 2);
        // Back at full speed: back to the plain limit.
        p.sample(t0 + Duration::from_secs(6), 10_000_000_000);
        assert_eq!(p.stretch(limit), limit);
        // A crawl is capped.
        p.sample(t0 + Duration::from_secs(106), 10_000_000_001);
        assert_eq!(p.stretch(limit), limit.mul_f64(Pace::MAX_STRETCH));
        // A new hypervisor (uptime restarts) starts a new span.
        p.sample(t0 + Duration::from_secs(107), 5);
        assert_eq!(p.stretch(limit), limit.mul_f64(Pace::MAX_STRETCH));
    }
}
