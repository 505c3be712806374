//! The supervisor against a fake hypervisor: its answers, the trace
//! buffer and stream, and the rings of a shared RAM file.

use super::rings::RING_POLL;
use super::*;
use protocol::{encode, TraceChannel};
use std::os::unix::net::UnixStream;

use std::collections::BTreeMap;

#[test]
fn ending_from_a_report() {
    let report = StopReport {
        reason: "stopped by the host".into(),
        exit_counts: Some(BTreeMap::new()),
        hv_lines: vec![
            "guest started".into(),
            "exit counts: CPUID=1".into(),
            "exit counts: CPUID=2 PREEMPTION_TIMER=9".into(),
            "guest stopped: stopped by the host".into(),
            "powering off".into(),
        ],
        wall_time: Duration::from_secs(1),
        boot_time: None,
        emulator_status: None,
    };
    let end = Ending::from_report(&report);
    assert!(end.clean);
    assert_eq!(end.reason, "guest stopped: stopped by the host");
    assert_eq!(
        end.lines,
        [
            "exit counts: CPUID=2 PREEMPTION_TIMER=9",
            "guest stopped: stopped by the host"
        ]
    );
    let crash = StopReport {
        reason: "triple fault".into(),
        ..report
    };
    assert!(!Ending::from_report(&crash).clean);
}

#[test]
fn long_exec_output_is_cut_into_frames() {
    let short = exec_reply("hello\n".into(), 3);
    assert!(short.events.is_empty());
    assert_eq!(
        short.response,
        Response::Exec {
            output: "hello\n".into(),
            status: 3
        }
    );

    // Multi-byte characters across the cut points.
    let long: String = "é-abc\n".repeat(2000);
    let reply = exec_reply(long.clone(), 0);
    assert!(reply.events.len() >= 4);
    let mut joined = String::new();
    for e in &reply.events {
        let Event::Log { text } = e else {
            panic!("{e:?}")
        };
        assert!(text.len() <= EXEC_CHUNK);
        joined.push_str(text);
    }
    let Response::Exec { output, status: 0 } = &reply.response else {
        panic!()
    };
    joined.push_str(output);
    assert_eq!(joined, long);
    // Every frame fits.
    for e in reply.events {
        encode(&Frame::event(0, e), &mut Vec::new()).unwrap();
    }
    encode(&Frame::response(1, reply.response), &mut Vec::new()).unwrap();
}

use protocol::io::{FrameReader, FrameWriter};

use protocol::{Body, TraceFormat};

/// A fake hypervisor behind a supervisor in the `Ready` phase: it
/// answers `TraceStart` with `Ok` and everything else with `Pong`, and
/// records the requests. The writer sends it events.
struct FakeHv {
    sup: Arc<Supervisor>,
    writer: Arc<Mutex<FrameWriter<UnixStream>>>,
    requests: Arc<Mutex<Vec<Request>>>,
    event_seq: u32,
}

impl FakeHv {
    fn new() -> FakeHv {
        FakeHv::answering(|_| None)
    }

    /// A fake hypervisor whose answers come from `answer` first.
    fn answering(answer: impl Fn(&Request) -> Option<Response> + Send + 'static) -> FakeHv {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let sup = Arc::new(Supervisor::new());
        sup.attach(ours.try_clone().unwrap(), ours, Duration::from_secs(5));
        sup.set_phase(Phase::Ready);
        let writer = Arc::new(Mutex::new(FrameWriter::new(theirs.try_clone().unwrap())));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (w, seen) = (writer.clone(), requests.clone());
        std::thread::spawn(move || {
            let mut r = FrameReader::new(theirs);
            while let Ok(frame) = r.read_frame() {
                let Body::Request(request) = frame.body else {
                    continue;
                };
                let answer = answer(&request).unwrap_or(match &request {
                    Request::TraceStart { .. } | Request::TraceStop => Response::Ok,
                    _ => Response::Pong { nonce: 0 },
                });
                seen.lock().unwrap().push(request);
                if w.lock()
                    .unwrap()
                    .write_frame(&Frame::response(frame.seq, answer))
                    .is_err()
                {
                    return;
                }
            }
        });
        FakeHv {
            sup,
            writer,
            requests,
            event_seq: 0,
        }
    }

    fn send(&mut self, event: Event) {
        self.event_seq += 1;
        self.writer
            .lock()
            .unwrap()
            .write_frame(&Frame::event(self.event_seq, event))
            .unwrap();
    }

    fn text(&mut self, format: TraceFormat, lost: u64, text: &str) {
        self.text_from(format, 0, lost, text);
    }

    fn text_from(&mut self, format: TraceFormat, source: u32, lost: u64, text: &str) {
        self.send(Event::TraceText {
            format,
            source,
            lost,
            text: text.to_string(),
        });
    }

    /// Waits until the buffer holds `n` entries.
    fn wait_entries(&self, n: u64) {
        let until = Instant::now() + Duration::from_secs(5);
        while self.sup.trace.lock().end() < n && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(self.sup.trace.lock().end(), n);
    }

    fn read(&self, cursor: u64, format: TraceFormat, wait_ms: u32) -> (u64, String, u64) {
        self.read_source(cursor, format, None, wait_ms)
    }

    fn read_source(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        wait_ms: u32,
    ) -> (u64, String, u64) {
        let request = Request::TraceRead {
            cursor,
            format,
            wait_ms,
            source,
        };
        match self.sup.serve(request).response {
            Response::Trace { next, text, lost } => (next, text, lost),
            other => panic!("{other:?}"),
        }
    }

    fn starts(&self) -> Vec<Request> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| matches!(r, Request::TraceStart { .. }))
            .cloned()
            .collect()
    }
}

#[test]
fn trace_read_starts_the_stream_once_and_reads_the_buffer() {
    let mut hv = FakeHv::new();
    // Nothing yet: the read starts the stream and waits in vain.
    let (next, text, lost) = hv.read(0, TraceFormat::Text, 50);
    assert_eq!((next, text.as_str(), lost), (0, "", 0));
    assert_eq!(
        hv.starts(),
        [Request::TraceStart {
            format: TraceFormat::Text
        }]
    );
    hv.text(TraceFormat::Text, 0, "one\ntwo\n");
    let (next, text, lost) = hv.read(0, TraceFormat::Text, 5000);
    assert_eq!((next, text.as_str(), lost), (2, "one\ntwo\n", 0));
    // Losses reported by the hypervisor, with the lines after them.
    hv.text(TraceFormat::Text, 3, "three\n");
    hv.send(Event::Lost { count: 2 });
    let until = Instant::now() + Duration::from_secs(5);
    while hv.sup.trace.lock().end() < 5 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let (next, text, lost) = hv.read(next, TraceFormat::Text, 1000);
    assert_eq!((next, text.as_str(), lost), (5, "three\n", 5));
    // The stream was started once.
    assert_eq!(hv.starts().len(), 1);
    // Another format switches the stream; the text lines are skipped.
    hv.read(5, TraceFormat::Json, 0);
    assert_eq!(
        hv.starts().last(),
        Some(&Request::TraceStart {
            format: TraceFormat::Json
        })
    );
    hv.text(TraceFormat::Json, 0, "{\"a\":1}\n");
    let (next, text, lost) = hv.read(5, TraceFormat::Json, 5000);
    assert_eq!((next, text.as_str(), lost), (6, "{\"a\":1}\n", 0));
}

#[test]
fn a_waiting_read_returns_when_a_line_arrives() {
    let hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    let start = Instant::now();
    let (next, text, _) = std::thread::scope(|s| {
        let reader = s.spawn(|| hv.read(0, TraceFormat::Text, 20_000));
        std::thread::sleep(Duration::from_millis(100));
        let line = Event::TraceText {
            format: TraceFormat::Text,
            source: 0,
            lost: 0,
            text: "late\n".into(),
        };
        let frame = Frame::event(1, line);
        hv.writer.lock().unwrap().write_frame(&frame).unwrap();
        reader.join().unwrap()
    });
    assert_eq!((next, text.as_str()), (1, "late\n"));
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_loss_alone_waits_for_the_next_line() {
    let mut hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    hv.send(Event::Lost { count: 4 });
    let until = Instant::now() + Duration::from_secs(5);
    while hv.sup.trace.lock().end() < 1 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The wait runs out: the loss is reported without text.
    let start = Instant::now();
    assert_eq!(hv.read(0, TraceFormat::Text, 300), (1, String::new(), 4));
    assert!(start.elapsed() >= Duration::from_millis(250));
    // A line arriving meanwhile comes with it.
    let (next, text, lost) = std::thread::scope(|s| {
        let reader = s.spawn(|| hv.read(0, TraceFormat::Text, 20_000));
        std::thread::sleep(Duration::from_millis(100));
        let line = Event::TraceText {
            format: TraceFormat::Text,
            source: 0,
            lost: 0,
            text: "after\n".into(),
        };
        hv.writer
            .lock()
            .unwrap()
            .write_frame(&Frame::event(2, line))
            .unwrap();
        reader.join().unwrap()
    });
    assert_eq!((next, text.as_str(), lost), (2, "after\n", 4));
}

#[test]
fn reads_keep_to_their_source() {
    let mut hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    hv.text_from(TraceFormat::Text, 0, 0, "p1\n");
    hv.text_from(TraceFormat::Text, 2, 0, "g1\ng2\n");
    hv.text_from(TraceFormat::Text, 0, 0, "p2\n");
    hv.wait_entries(4);
    let graph = hv.read_source(0, TraceFormat::Text, Some(2), 1000);
    assert_eq!(graph, (4, "g1\ng2\n".to_string(), 0));
    let probes = hv.read_source(0, TraceFormat::Text, Some(0), 1000);
    assert_eq!(probes, (4, "p1\np2\n".to_string(), 0));
    let all = hv.read_source(0, TraceFormat::Text, None, 1000);
    assert_eq!(all, (4, "p1\ng1\ng2\np2\n".to_string(), 0));
    // A loss from the hypervisor reaches every reader.
    hv.text_from(TraceFormat::Text, 0, 3, "p3\n");
    hv.wait_entries(6);
    let graph = hv.read_source(4, TraceFormat::Text, Some(2), 0);
    assert_eq!(graph, (6, String::new(), 3));
}

#[test]
fn a_waiting_read_is_not_woken_by_other_sources() {
    let hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    let (next, text, lost) = std::thread::scope(|s| {
        let reader = s.spawn(|| hv.read_source(0, TraceFormat::Text, Some(1), 20_000));
        let mut seq = 10;
        let mut send = |source: u32, text: &str| {
            seq += 1;
            let line = Event::TraceText {
                format: TraceFormat::Text,
                source,
                lost: 0,
                text: text.into(),
            };
            hv.writer
                .lock()
                .unwrap()
                .write_frame(&Frame::event(seq, line))
                .unwrap();
        };
        std::thread::sleep(Duration::from_millis(100));
        send(0, "probe\n");
        send(2, "other graph\n");
        std::thread::sleep(Duration::from_millis(300));
        // Still waiting: those lines were not its own.
        assert!(!reader.is_finished());
        send(1, "mine\n");
        reader.join().unwrap()
    });
    assert_eq!((next, text.as_str(), lost), (3, "mine\n", 0));
}

#[test]
fn after_the_end_reads_keep_to_their_source() {
    let mut hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    hv.text_from(TraceFormat::Text, 1, 0, "g\n");
    hv.text_from(TraceFormat::Text, 0, 0, "p\n");
    hv.wait_entries(2);
    hv.sup.set_phase(Phase::Ended(Ending {
        reason: "guest stopped: power off".into(),
        clean: true,
        lines: vec![],
    }));
    assert_eq!(
        hv.read_source(0, TraceFormat::Text, Some(0), 0),
        (2, "p\n".to_string(), 0)
    );
    assert_eq!(
        hv.read_source(0, TraceFormat::Text, Some(1), 0),
        (2, "g\n".to_string(), 0)
    );
    // Only another source's line after it: the end.
    let reply = hv.sup.serve(Request::TraceRead {
        cursor: 1,
        format: TraceFormat::Text,
        wait_ms: 0,
        source: Some(1),
    });
    assert_eq!(
        reply.response,
        Response::error(
            ErrorKind::NotReady,
            "the VM has ended (guest stopped: power off)"
        )
    );
}

#[test]
fn trace_start_and_stop_are_forwarded_and_noted() {
    let hv = FakeHv::new();
    let start = Request::TraceStart {
        format: TraceFormat::Json,
    };
    assert_eq!(hv.sup.serve(start).response, Response::Ok);
    assert_eq!(*hv.sup.stream.lock().unwrap(), Some(TraceFormat::Json));
    // A read in the same format does not start it again.
    hv.read(0, TraceFormat::Json, 0);
    assert_eq!(hv.starts().len(), 1);
    assert_eq!(hv.sup.serve(Request::TraceStop).response, Response::Ok);
    assert_eq!(*hv.sup.stream.lock().unwrap(), None);
    hv.read(0, TraceFormat::Json, 0);
    assert_eq!(hv.starts().len(), 2);
}

#[test]
fn after_the_end_the_buffer_is_read_out_then_the_end_reported() {
    let mut hv = FakeHv::new();
    hv.read(0, TraceFormat::Text, 0);
    hv.text(TraceFormat::Text, 0, "last\n");
    let until = Instant::now() + Duration::from_secs(5);
    while hv.sup.trace.lock().end() < 1 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    hv.sup.set_phase(Phase::Ended(Ending {
        reason: "guest stopped: stopped by the host".into(),
        clean: true,
        lines: vec![],
    }));
    let (next, text, _) = hv.read(0, TraceFormat::Text, 10_000);
    assert_eq!((next, text.as_str()), (1, "last\n"));
    let reply = hv.sup.serve(Request::TraceRead {
        cursor: next,
        format: TraceFormat::Text,
        wait_ms: 10_000,
        source: None,
    });
    assert_eq!(
        reply.response,
        Response::error(
            ErrorKind::NotReady,
            "the VM has ended (guest stopped: stopped by the host)"
        )
    );
    // Nothing else is forwarded once the VM has ended.
    let before = hv.requests.lock().unwrap().len();
    hv.sup.serve(Request::Ping { nonce: 1 });
    assert_eq!(hv.requests.lock().unwrap().len(), before);
}

#[test]
fn requests_before_the_vm_runs_get_a_clear_answer() {
    let sup = Supervisor::new();
    let reply = sup.serve(Request::Status);
    assert!(matches!(
        reply.response,
        Response::Error {
            kind: ErrorKind::NotReady,
            ..
        }
    ));
    let reply = sup.serve(Request::Exec {
        command: "true".into(),
    });
    assert!(
        matches!(&reply.response, Response::Error { kind: ErrorKind::NotReady, message } if message.contains("not up yet"))
    );
    sup.set_phase(Phase::Ended(Ending {
        reason: "guest stopped: power off".into(),
        clean: true,
        lines: vec![],
    }));
    let reply = sup.serve(Request::Ping { nonce: 1 });
    assert_eq!(
        reply.response,
        Response::error(
            ErrorKind::NotReady,
            "the VM has ended (guest stopped: power off)"
        )
    );
}

/// Under QEMU's shared RAM file: the supervisor reads root's frame ring
/// and every vCPU's record ring, renders two vCPUs' records merged by
/// time with the symbols root sent on the frame ring, and gives the
/// rings back to root at a channel change (no record is taken after
/// it); a client's `SharedRings` is passed on only while this process
/// reads the rings.
#[test]
fn the_supervisor_reads_the_vcpus_rings_and_gives_them_back() {
    use crate::sys::SharedMap;
    use protocol::{RenderContext, RingAt, SymbolsPart};
    use tracelang::kprobe::{EventHeader, RawEvent};
    const RAM: usize = 2 << 20;
    const LEN: u64 = 64 + 64 * 1024;
    let (frames_at, ring_at) = (0x1000u64, [0x40000u64, 0x80000]);
    let (dir, file) = crate::vm::shm::tests::shared_file("suprings", RAM);
    // Root's side: the rings formatted where it says they are.
    let root = Arc::new(SharedMap::map(&file, RAM).unwrap());
    root.ring(frames_at as usize, LEN as usize, true).unwrap();
    for at in ring_at {
        root.ring(at as usize, LEN as usize, true).unwrap();
    }
    let (idx, packed) = crate::daemon::symbols::tests::packed();
    let frame_seq = Arc::new(AtomicU32::new(0));
    // Root writes frames on its frame ring, as its turns do.
    let put_frame = {
        let (root, seq) = (root.clone(), frame_seq.clone());
        move |event: Event| {
            let frames = root.ring(frames_at as usize, LEN as usize, false).unwrap();
            let mut wire = Vec::new();
            let n = seq.fetch_add(1, Ordering::Relaxed);
            encode(&Frame::event(n, event), &mut wire).unwrap();
            assert!(frames.push(&wire));
        }
    };
    let symbols = idx.len() as u32;
    let func = idx
        .iter()
        .find(|s| s.kind.letter().eq_ignore_ascii_case(&'t'))
        .unwrap();
    let (func_at, name) = (func.addr.0, idx.name(func.id).to_string());
    let answer = {
        let put_frame = put_frame.clone();
        let packed = packed.clone();
        move |r: &Request| match r {
            Request::TraceChannel {
                channel: TraceChannel::SharedRings,
            } => Some(Response::TraceRings {
                frames: RingAt {
                    gpa: frames_at,
                    len: LEN,
                },
                records: ring_at
                    .iter()
                    .map(|&gpa| RingAt { gpa, len: LEN })
                    .collect(),
                stamp_at: tracelang::kprobe::TIMESTAMP_AT as u32,
            }),
            Request::TraceChannel {
                channel: TraceChannel::SharedRing,
            } => Some(Response::TraceRing {
                gpa: frames_at,
                len: LEN,
            }),
            Request::TraceChannel { .. } => Some(Response::Ok),
            // Root sends the context in the turn that starts the
            // stream, before any record can need it.
            Request::TraceStart {
                format: TraceFormat::Records,
            } => {
                put_frame(Event::TraceContext(RenderContext::Begin));
                put_frame(Event::TraceContext(RenderContext::Probe {
                    id: 1,
                    spec: format!("p:kprobes/hit {name}"),
                }));
                put_frame(Event::TraceContext(RenderContext::End));
                Some(Response::Ok)
            }
            Request::SymbolsExport => {
                for (k, piece) in packed.chunks(3000).enumerate() {
                    put_frame(Event::SymbolChunk {
                        id: 1,
                        part: SymbolsPart::Kernel,
                        total: packed.len() as u64,
                        offset: (k * 3000) as u64,
                        data: piece.to_vec(),
                    });
                }
                put_frame(Event::SymbolChunk {
                    id: 2,
                    part: SymbolsPart::Modules,
                    total: 0,
                    offset: 0,
                    data: Vec::new(),
                });
                Some(Response::SymbolsExport {
                    id: 1,
                    bytes: packed.len() as u64,
                    symbols,
                })
            }
            _ => None,
        }
    };
    let hv = FakeHv::answering(answer);
    let _ = hv.sup.trace.symbols.set(Arc::new(HostSymbols::new(None)));
    assert!(hv.sup.use_ring(
        &file,
        crate::vm::shm::MachineType::Pc,
        RAM as u64,
        VmWatch::detached()
    ));
    // Records of two vCPUs, out of time order between the rings,
    // written before the stream starts: nobody takes them yet.
    let record = |cpu: u32, pid: i32, ts: u64| {
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"task");
        RawEvent {
            header: EventHeader {
                probe_id: 1,
                cpu,
                pid,
                timestamp_ns: ts,
                ip: func_at,
                ret_ip: 0,
                comm,
            },
            values: Vec::new(),
        }
        .encode()
    };
    let rings: Vec<_> = ring_at
        .iter()
        .map(|&at| root.ring(at as usize, LEN as usize, false).unwrap())
        .collect();
    // Whether the host empties `ring` within 10 s.
    let emptied = |ring: &protocol::ring::Ring| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ring.is_empty() && Instant::now() < deadline {
            std::thread::sleep(RING_POLL);
        }
        ring.is_empty()
    };
    for (cpu, pid, ts) in [
        (1, 11, 2_000),
        (1, 12, 4_000),
        (0, 13, 3_000),
        (0, 14, 1_000),
    ] {
        assert!(rings[cpu as usize].push(&record(cpu, pid, ts)));
    }
    std::thread::sleep(RING_POLL * 3);
    assert!(
        rings.iter().all(|r| !r.is_empty()),
        "not taken before the stream"
    );
    assert_eq!(
        hv.sup
            .serve(Request::TraceStart {
                format: TraceFormat::Text
            })
            .response,
        Response::Ok
    );
    assert!(
        *hv.sup.trace.host_reads_lock(),
        "the host takes the records"
    );
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while text.lines().count() < 4 && Instant::now() < deadline {
        let chunk = hv.sup.trace.wait_read(
            0,
            TraceFormat::Text,
            None,
            Duration::from_millis(200),
            &|| false,
        );
        text = chunk.text;
    }
    let pids: Vec<&str> = text
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or(""))
        .collect();
    // Ring 1 holds 2,000 and 4,000, ring 0 3,000 then 1,000: one take
    // merges by time what each ring holds in its own order.
    assert_eq!(pids, ["task-11", "task-13", "task-14", "task-12"], "{text}");
    assert_eq!(text.matches("hit: (").count(), 4, "{text}");
    assert_eq!(text.matches("+0x0/").count(), 4, "{text}");
    assert!(rings.iter().all(|r| r.is_empty()), "the host took them");
    // A module's load: the first piece of the new modules' copy comes
    // on the frame ring before its code's records, which wait for the
    // copy to be whole.
    let copy = crate::daemon::symbols::tests::modules(&["m1", "m2"])
        .pack()
        .unwrap();
    let piece = |offset: usize, data: &[u8]| Event::SymbolChunk {
        id: 3,
        part: SymbolsPart::Modules,
        total: copy.len() as u64,
        offset: offset as u64,
        data: data.to_vec(),
    };
    put_frame(piece(0, &copy[..8]));
    assert!(rings[1].push(&record(1, 16, 4_500)));
    std::thread::sleep(RING_POLL * 5);
    assert!(!rings[1].is_empty(), "held while the modules' copy comes");
    put_frame(piece(8, &copy[8..]));
    assert!(emptied(&rings[1]), "taken once the copy is whole");
    // The listing, paged: whole lines, the kernel's then the modules'.
    let want = crate::daemon::symbols::listing(
        &idx,
        hv.sup.trace.symbols.get().unwrap().modules().as_deref(),
    );
    assert!(want.contains("\t[m2]\n"), "{want}");
    let (mut got, mut offset, mut pages) = (String::new(), Some(0u64), 0);
    while let Some(at) = offset {
        match hv.sup.serve(Request::Kallsyms { offset: at }).response {
            Response::Kallsyms { text, next, total } => {
                assert_eq!(total, want.len() as u64);
                assert!(text.len() <= super::stream::KALLSYMS_PAGE && text.ends_with('\n'));
                got.push_str(&text);
                offset = next;
                pages += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, want);
    assert!(pages > 1 || want.len() <= super::stream::KALLSYMS_PAGE);
    assert!(got.contains(&format!(" {}\n", idx.name(func.id))));
    // Past the end: an empty last page.
    assert_eq!(
        hv.sup.serve(Request::Kallsyms { offset: 1 << 40 }).response,
        Response::Kallsyms {
            text: String::new(),
            next: None,
            total: want.len() as u64
        }
    );
    // A channel change gives the rings back: records stay for root
    // (which drains them into the frame ring with `SharedRing`).
    assert!(matches!(
        hv.sup
            .serve(Request::TraceChannel {
                channel: TraceChannel::SharedRing
            })
            .response,
        Response::TraceRing { .. }
    ));
    assert!(!*hv.sup.trace.host_reads_lock());
    assert!(rings[0].push(&record(0, 15, 5_000)));
    std::thread::sleep(RING_POLL * 5);
    assert!(!rings[0].is_empty(), "no record taken once root drains");
    // SharedRings again: passed on, and the host reads again.
    assert!(matches!(
        hv.sup
            .serve(Request::TraceChannel {
                channel: TraceChannel::SharedRings
            })
            .response,
        Response::TraceRings { .. }
    ));
    assert!(emptied(&rings[0]), "the host reads the rings again");
    assert!(hv.requests.lock().unwrap().contains(&Request::TraceStart {
        format: TraceFormat::Records
    }));
    // A supervisor that reads no rings does not pass SharedRings on.
    let plain = FakeHv::new();
    let r = plain
        .sup
        .serve(Request::TraceChannel {
            channel: TraceChannel::SharedRings,
        })
        .response;
    assert!(
        matches!(
            r,
            Response::Error {
                kind: ErrorKind::Unsupported,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(plain.requests.lock().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A page of the listing ends after a newline, or inside a line too long
/// for a page at a character boundary: a name the guest chose (replaced
/// characters are three bytes) never makes the supervisor slice inside a
/// character.
#[test]
fn listing_pages_end_on_lines_or_characters() {
    use super::stream::page_end;
    assert_eq!(page_end("ab\ncd\n", 100), 6);
    assert_eq!(page_end("ab\ncd\nef", 7), 6);
    // A multi-byte character across the page's end, no newline before it.
    let long = format!("{}\u{fffd}tail\n", "x".repeat(9));
    for max in 9..=12 {
        let end = page_end(&long, max);
        assert!(
            long.is_char_boundary(end) && end <= max && end > 0,
            "{max}: {end}"
        );
    }
    // And with a newline before it: the line's end.
    let text = format!("abc\n{}\u{fffd}\n", "y".repeat(5));
    assert_eq!(page_end(&text, 10), 4);
}
