//! Unit tests of the whole codec: every message round-trips, and the
//! malformed-frame errors come out as documented.

use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;

use crate::codec::{
    encode, encode_fatal, DecodeError, EncodeError, FrameDecoder, FATAL_SEQ, FATAL_WIRE_MAX,
    MAX_FATAL_REASON, MAX_FRAME, MAX_WIRE_FRAME,
};
use crate::message::*;
use crate::ModulesReport;
use crate::PROTOCOL_VERSION;

fn status() -> StatusReport {
    StatusReport {
        hypervisor_version: "hvtrace 0.1.0".into(),
        protocol_version: PROTOCOL_VERSION,
        vcpus: 4,
        uptime_ns: u64::MAX,
        guest_state: GuestState::Running,
        exits: vec![
            ExitCount {
                reason: 18,
                name: "VMCALL".into(),
                count: 1 << 40,
            },
            ExitCount {
                reason: 48,
                name: "EPT_VIOLATION".into(),
                count: 3,
            },
        ],
        exits_total: (1 << 40) + 3,
        hv_memory_used: 1 << 20,
        hv_heap_used: 1 << 16,
        hv_memory_total: 1 << 26,
        current_task: Some(TaskInfo {
            pid: -1,
            comm: "swapper/0".into(),
            cpu: 3,
        }),
        channel: ChannelReport {
            bytes_in: 1,
            bytes_out: u64::MAX,
            frames_in: 2,
            frames_out: 3,
            bad_frames: 4,
            dropped: 5,
            bulk_frames: 6,
            bulk_bytes: 1 << 33,
        },
        kernel: Some(KernelReport {
            release: "6.1.0-57-amd64".into(),
            kaslr_slide: -0x1c00000,
            symbols: 94_266,
            text_symbols: 49_503,
            traceable: 37_655,
            index_bytes: 2 << 20,
            recovery_ns: 1_200_000_000,
            task_layout_error: None,
            modules: ModulesReport {
                walks: 3,
                modules: 2,
                symbols: 4_021,
                index_bytes: 300_000,
                walk_ns: 45_000_000,
                error: Some("module list: unreadable guest memory at 0x10".into()),
            },
        }),
        tracer: TracerReport {
            probes: 2,
            functions: 19_000,
            sites: 19_002,
            pages: 1_500,
            hits: u64::MAX,
            lost: 7,
            steps: 8,
            steps_widened: 1,
            guest_writes: 9,
            region_restores: 1,
            foreign_vmcalls: 2,
            forged_entries: 1,
            blocked_writes: 3,
            trampolines: 0xffff_ffff_bfe0_0000,
            graph_frames: 12,
            graph_stacks: 3,
            graph_bytes: 3840,
            graph_misses: 1,
            graph_dropped: 2,
            graph_orphans: 0,
            graph_reaped: 4,
            graph_sessions: 2,
            retprobes: 1,
            stack_lock_waits: 4,
            module_hooks: 2,
            module_loads: 21,
            module_unloads: 20,
            module_armed: 21,
            module_unhooked: 40,
            pending_probes: 1,
            module_globs: 2,
            module_followed: 6,
            module_inits_freed: 3,
            module_init_unhooked: 1,
            quiet_pages: 810,
            quiet_partial: 3,
            switch_hook: true,
            quiet_busy: 1,
        },
        per_vcpu: vec![crate::VcpuReport {
            index: 0,
            apic_id: 0,
            parked: false,
            exits_total: 7,
            lock_wait_ns: 0,
            held_ns: 0,
            lost: 0,
            vmcalls: 0,
            lock_takes: 7,
            shared_takes: 3,
            shared_wait_ns: 9,
            hits: 2,
            returns: 1,
            refused: 0,
            view_switches: 12,
            armed_ns: 5_000,
            quiet_ns: 70_000,
            quiet: false,
            root_stack_used: 40_960,
            root_stack_size: 131_072,
            vmcs_unshadowed: 2,
            invept: 5,
            root_hit: crate::RootTime {
                count: 2,
                sum_ns: 48_000,
                min_ns: 23_000,
                max_ns: 25_000,
            },
            root_return: crate::RootTime::default(),
            root_refused: crate::RootTime {
                count: 1,
                sum_ns: 9_000,
                min_ns: 9_000,
                max_ns: 9_000,
            },
            root_turns: crate::RootTime::default(),
        }],
        graph_sessions: vec![crate::GraphSessionReport {
            session: 3,
            hooked: 19_855,
            roots: 1,
            quiet: 19_850,
        }],
        guard: crate::GuardReport {
            nmi_exits: 5,
            nmis_in_root: 3,
            nmis_injected: 8,
            nmi_windows: 1,
            events_reinjected: 2,
            debug_port_writes: 40,
            xsetbv_refused: 1,
            cr_writes_refused: 2,
            apic_moves_refused: 1,
            pci_writes_refused: 2,
            dma_port_writes_blocked: 3,
            string_io_emulated: 4,
            task_switches: 1,
        },
    }
}

/// At least one of every variant of every message enum.
fn samples() -> Vec<Body> {
    let mut stopped = status();
    stopped.guest_state = GuestState::Stopped;
    stopped.current_task = None;
    let mut booting = status();
    booting.guest_state = GuestState::Booting;
    booting.exits.clear();
    let mut bodies = vec![
        Body::Request(Request::Hello {
            version: PROTOCOL_VERSION,
            client: "cli".into(),
        }),
        Body::Request(Request::Status),
        Body::Request(Request::Stop),
        Body::Request(Request::Ping {
            nonce: 0x0123_4567_89AB_CDEF,
        }),
        Body::Request(Request::Syms {
            glob: "*".into(),
            kinds: String::new(),
            module: "ext4".into(),
            cursor: 0,
            limit: 100,
        }),
        Body::Request(Request::Syscalls { cursor: 17 }),
        Body::Request(Request::ProbeGate {
            name: "hvsys/sys_openat".into(),
            session: Some(3),
        }),
        Body::Request(Request::Kallsyms { offset: 4000 }),
        Body::Request(Request::Sched {
            switch: true,
            wakeup: false,
        }),
        Body::Response(Response::Kallsyms {
            text: "ffffffff81000000 T _stext\nffffffffc0000000 t f\t[ext4]\n".into(),
            next: Some(4057),
            total: 90_000,
        }),
        Body::Response(Response::Syscalls {
            total: 346,
            next: Some(20),
            calls: vec![SyscallInfo {
                nr: 257,
                name: "openat".into(),
                entry: "__x64_sys_openat".into(),
                args: vec![
                    ("int".into(), "dfd".into()),
                    ("const char *".into(), "filename".into()),
                ],
                source: "metadata".into(),
                structs: vec![SyscallStruct {
                    arg: 2,
                    name: "open_how".into(),
                    fields: vec![SyscallField {
                        name: "flags".into(),
                        offset: 0,
                        size: 8,
                        signed: false,
                    }],
                }],
                compat: false,
            }],
        }),
        Body::Request(Request::ProbeAdd {
            spec: "p:p1 vfs_read".into(),
        }),
        Body::Request(Request::ProbeDel { name: "p1".into() }),
        Body::Request(Request::ProbeList),
        Body::Request(Request::TraceStart {
            format: TraceFormat::Text,
        }),
        Body::Request(Request::TraceStart {
            format: TraceFormat::Records,
        }),
        Body::Request(Request::TraceStart {
            format: TraceFormat::RecordsAndText,
        }),
        Body::Request(Request::TraceStop),
        Body::Request(Request::TraceChannel {
            channel: TraceChannel::LogPort,
        }),
        Body::Request(Request::TraceChannel {
            channel: TraceChannel::Control,
        }),
        Body::Request(Request::CountStart(CountFilter {
            functions: vec!["vfs_*".into(), "ext4:*".into()],
            pid: Some(42),
            comm: Some("dd".into()),
            latency: true,
            hist: Some(HistFilter {
                spec: "p vfs_read count=%dx:u64".into(),
                key: HistKey::Comm,
            }),
            gate: Some(2),
        })),
        Body::Request(Request::HistRead { cursor: 3 }),
        Body::Request(Request::SymbolsExport),
        Body::Response(Response::SymbolsExport {
            id: 2,
            bytes: 1_603_833,
            symbols: 94_266,
        }),
        Body::Request(Request::TraceChannel {
            channel: TraceChannel::SharedRing,
        }),
        Body::Response(Response::TraceRing {
            gpa: 0x1c0_0000,
            len: 1 << 20,
        }),
        Body::Request(Request::TraceChannel {
            channel: TraceChannel::SharedRings,
        }),
        Body::Response(Response::TraceRings {
            frames: RingAt {
                gpa: 0x1c0_0000,
                len: (1 << 20) + 64,
            },
            records: vec![
                RingAt {
                    gpa: 0x1e0_0000,
                    len: (1 << 20) + 64,
                },
                RingAt {
                    gpa: 0x1f0_1000,
                    len: (1 << 20) + 64,
                },
            ],
            stamp_at: 8,
        }),
        Body::Event(Event::TraceDoorbell),
        Body::Response(Response::Hist {
            rows: vec![HistRow {
                key: "dd".into(),
                buckets: vec![0, 0, 5, u64::MAX],
            }],
            next: Some(1),
            overflow: 2,
            faults: 1,
            max_keys: 64,
        }),
        Body::Request(Request::CountRead {
            cursor: 0xffff_ffff_8100_0000,
            limit: 100,
        }),
        Body::Request(Request::CountStop),
        Body::Response(Response::CountStarted {
            functions: 61,
            skipped: vec!["vfs_x: the site crosses a page boundary".into()],
            skipped_total: 1,
        }),
        Body::Response(Response::Counts(CountPage {
            functions: 61,
            calls: u64::MAX,
            filtered: 7,
            elapsed_ns: 1 << 40,
            memory: 4096,
            entries: vec![FunctionCount {
                name: "ext4_file_read_iter [ext4]".into(),
                addr: 0xffff_ffff_c000_1000,
                calls: 12,
                errors: 0,
                total_ns: 0,
            }],
            next: Some(0xffff_ffff_c000_1001),
            latency: vec![0, 1, u64::MAX, 3],
            latency_missed: 2,
        })),
        Body::Request(Request::Exec {
            command: "cat /etc/hostname; echo $?".into(),
        }),
        Body::Response(Response::Hello {
            version: PROTOCOL_VERSION,
            hypervisor: "hv".into(),
        }),
        Body::Response(Response::Status(status())),
        Body::Response(Response::Status(stopped)),
        Body::Response(Response::Status(booting)),
        Body::Response(Response::Pong { nonce: 1 }),
        Body::Response(Response::Ok),
        Body::Response(Response::VersionMismatch {
            ours: 1,
            theirs: u16::MAX,
        }),
        Body::Response(Response::Syms {
            total: Some(2),
            next: None,
            symbols: vec![SymbolInfo {
                name: "vfs_read".into(),
                addr: 0xffff_ffff_8130_0000,
                size: 0x1a0,
                kind: b'T',
                site: Some(0xffff_ffff_8130_0004),
                not_traceable: String::new(),
                module: "hvtarget".into(),
            }],
        }),
        Body::Response(Response::Exec {
            output: "hvtrace-guest\n0\n".into(),
            status: -1,
        }),
        Body::Event(Event::Log {
            text: "ünïcødé ✓".into(),
        }),
        Body::Event(Event::Lost { count: u64::MAX }),
        Body::Event(Event::Trace {
            cpu: 7,
            timestamp_ns: 5,
            payload: vec![0, 1, 0, 255],
        }),
        Body::Event(Event::Trace {
            cpu: 0,
            timestamp_ns: 0,
            payload: vec![],
        }),
        Body::Event(Event::SymbolChunk {
            id: 2,
            part: SymbolsPart::Modules,
            total: 1 << 20,
            offset: 2800,
            data: vec![0, 1, 0xff, 0],
        }),
        Body::Event(Event::TraceRecords {
            lost: 3,
            now_ns: 1_000_000,
            data: vec![4, 0, 0, 0x80, 1, 2, 3, 4],
        }),
        Body::Event(Event::TraceContext(RenderContext::Probe {
            id: 7,
            spec: "p:kprobes/a vfs_read n=%dx:u64".into(),
        })),
        Body::Event(Event::Fatal {
            reason: "hypervisor panic: panicked at src/main.rs:1:1: ✗".into(),
        }),
    ];
    for kind in ERROR_KINDS {
        bodies.push(Body::Response(Response::error(kind, kind.to_string())));
    }
    bodies
}

const ERROR_KINDS: [ErrorKind; 8] = [
    ErrorKind::Unsupported,
    ErrorKind::Malformed,
    ErrorKind::InvalidArgument,
    ErrorKind::NotFound,
    ErrorKind::AlreadyExists,
    ErrorKind::NotReady,
    ErrorKind::OutOfResources,
    ErrorKind::Internal,
];

/// The variant of a body, as a name. The matches have no wildcard, so a new
/// variant does not compile until it is named here, and
/// `samples_cover_every_variant` then wants a sample of it.
fn variant(body: &Body) -> String {
    let name = match body {
        Body::Request(r) => match r {
            Request::Hello { .. } => "Request::Hello",
            Request::Status => "Request::Status",
            Request::Stop => "Request::Stop",
            Request::Ping { .. } => "Request::Ping",
            Request::Syms { .. } => "Request::Syms",
            Request::ProbeAdd { .. } => "Request::ProbeAdd",
            Request::ProbeDel { .. } => "Request::ProbeDel",
            Request::ProbeList => "Request::ProbeList",
            Request::TraceStart { .. } => "Request::TraceStart",
            Request::TraceStop => "Request::TraceStop",
            Request::Exec { .. } => "Request::Exec",
            Request::FunctionAdd { .. } => "Request::FunctionAdd",
            Request::FunctionClear => "Request::FunctionClear",
            Request::TraceRead { .. } => "Request::TraceRead",
            Request::GraphStart(_) => "Request::GraphStart",
            Request::GraphStop { .. } => "Request::GraphStop",
            Request::TraceChannel { .. } => "Request::TraceChannel",
            Request::CountStart(_) => "Request::CountStart",
            Request::CountRead { .. } => "Request::CountRead",
            Request::CountStop => "Request::CountStop",
            Request::HistRead { .. } => "Request::HistRead",
            Request::SymbolsExport => "Request::SymbolsExport",
            Request::Syscalls { .. } => "Request::Syscalls",
            Request::ProbeGate { .. } => "Request::ProbeGate",
            Request::Kallsyms { .. } => "Request::Kallsyms",
            Request::Sched { .. } => "Request::Sched",
        },
        Body::Response(r) => match r {
            Response::Hello { .. } => "Response::Hello",
            Response::Status(s) => {
                return alloc::format!(
                    "Response::Status/{}",
                    match s.guest_state {
                        GuestState::Booting => "Booting",
                        GuestState::Running => "Running",
                        GuestState::Stopped => "Stopped",
                    }
                )
            }
            Response::Pong { .. } => "Response::Pong",
            Response::Ok => "Response::Ok",
            Response::Error { kind, .. } => return alloc::format!("Response::Error/{kind:?}"),
            Response::VersionMismatch { .. } => "Response::VersionMismatch",
            Response::Exec { .. } => "Response::Exec",
            Response::Syms { .. } => "Response::Syms",
            Response::ProbeAdded { .. } => "Response::ProbeAdded",
            Response::Probes(_) => "Response::Probes",
            Response::FunctionAdded { .. } => "Response::FunctionAdded",
            Response::CountStarted { .. } => "Response::CountStarted",
            Response::Counts(_) => "Response::Counts",
            Response::Hist { .. } => "Response::Hist",
            Response::TraceRing { .. } => "Response::TraceRing",
            Response::TraceRings { .. } => "Response::TraceRings",
            Response::SymbolsExport { .. } => "Response::SymbolsExport",
            Response::Syscalls { .. } => "Response::Syscalls",
            Response::Trace { .. } => "Response::Trace",
            Response::GraphStarted { .. } => "Response::GraphStarted",
            Response::Kallsyms { .. } => "Response::Kallsyms",
        },
        Body::Event(e) => match e {
            Event::Log { .. } => "Event::Log",
            Event::Lost { .. } => "Event::Lost",
            Event::Trace { .. } => "Event::Trace",
            Event::TraceText { .. } => "Event::TraceText",
            Event::SymbolChunk { .. } => "Event::SymbolChunk",
            Event::TraceRecords { .. } => "Event::TraceRecords",
            Event::TraceContext(_) => "Event::TraceContext",
            Event::Fatal { .. } => "Event::Fatal",
            Event::TraceDoorbell => "Event::TraceDoorbell",
        },
    };
    name.into()
}

/// Keep in step with the matches of `variant` (and with `ERROR_KINDS`, whose
/// `match` below has no wildcard either).
/// 11 requests, 6 plain responses, a status per guest state, one error per
/// kind, 4 events; then `TraceChannel` with `TraceRing`, and the count's 4
/// requests and 3 responses; then the symbol export's request, answer and
/// event; then the records and their context; then the per-vCPU rings'
/// answer and doorbell; then the system calls' request and answer; then
/// the probes' gate; then the kallsyms listing's request and answer; then
/// the scheduler events' request.
const VARIANTS: usize = 11 + 6 + 3 + 8 + 4 + 1 + 8 + 3 + 2 + 2 + 2 + 1 + 2 + 1;

#[test]
fn samples_cover_every_variant() {
    // ErrorKind: exhaustive match, so a new kind must be listed.
    for kind in ERROR_KINDS {
        match kind {
            ErrorKind::Unsupported
            | ErrorKind::Malformed
            | ErrorKind::InvalidArgument
            | ErrorKind::NotFound
            | ErrorKind::AlreadyExists
            | ErrorKind::NotReady
            | ErrorKind::OutOfResources
            | ErrorKind::Internal => {}
        }
    }
    let mut names: Vec<String> = samples().iter().map(variant).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), VARIANTS, "{names:#?}");
}

/// Each trace format keeps its number on the wire: a new one goes at the
/// end of the enum, so the older formats encode as they did.
#[test]
fn trace_formats_keep_their_wire_numbers() {
    let formats = [
        (TraceFormat::Text, 0u8),
        (TraceFormat::Json, 1),
        (TraceFormat::Records, 2),
        (TraceFormat::RecordsAndText, 3),
    ];
    for (format, number) in formats {
        let bytes = postcard::to_allocvec(&format).expect("encodes");
        assert_eq!(bytes, [number], "{format:?}");
        let back: TraceFormat = postcard::from_bytes(&bytes).expect("decodes");
        assert_eq!(back, format);
        let frame = Frame::request(7, Request::TraceStart { format });
        let decoded = decode_all(&encode_one(&frame));
        assert!(
            matches!(decoded.as_slice(), [Ok(f)] if *f == frame),
            "{decoded:?}"
        );
    }
}

fn encode_one(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out).expect("encodes");
    out
}

fn decode_all(bytes: &[u8]) -> Vec<Result<Frame, DecodeError>> {
    FrameDecoder::new().feed(bytes).collect()
}

#[test]
fn every_variant_roundtrips() {
    for (i, body) in samples().into_iter().enumerate() {
        let frame = Frame::new(i as u32 * 0x0101_0101, body);
        let wire = encode_one(&frame);
        assert_eq!(wire.first(), Some(&0));
        assert_eq!(wire.last(), Some(&0));
        assert!(
            !wire[1..wire.len() - 1].contains(&0),
            "interior zero in {frame:?}"
        );
        assert!(wire.len() <= MAX_WIRE_FRAME);
        assert_eq!(decode_all(&wire), vec![Ok(frame.clone())], "{frame:?}");

        // Byte by byte, the frame comes out at the final delimiter.
        let mut dec = FrameDecoder::new();
        let (last, head) = wire.split_last().unwrap();
        for &b in head {
            assert_eq!(dec.push_byte(b), None);
        }
        assert_eq!(dec.push_byte(*last), Some(Ok(frame)));
    }
}

#[test]
fn all_samples_in_one_stream() {
    let frames: Vec<Frame> = samples()
        .into_iter()
        .enumerate()
        .map(|(i, b)| Frame::new(i as u32, b))
        .collect();
    let mut wire = Vec::new();
    for f in &frames {
        encode(f, &mut wire).unwrap();
    }
    let got: Vec<Frame> = decode_all(&wire).into_iter().map(Result::unwrap).collect();
    assert_eq!(got, frames);
}

#[test]
fn encode_appends() {
    let mut out = vec![0xAA];
    encode(&Frame::request(1, Request::Status), &mut out).unwrap();
    assert_eq!(out[0], 0xAA);
    assert_eq!(
        decode_all(&out[1..]),
        vec![Ok(Frame::request(1, Request::Status))]
    );
}

#[test]
fn frame_overhead() {
    // A Ping: body = Body tag, Request tag, 1-byte varint nonce.
    let wire = encode_one(&Frame::request(0, Request::Ping { nonce: 5 }));
    let body = 3;
    assert_eq!(wire.len(), body + 13);
    // The worst case: a nonce of 10 varint bytes.
    let wire = encode_one(&Frame::request(0, Request::Ping { nonce: u64::MAX }));
    assert_eq!(wire.len(), 2 + 10 + 13);
}

/// A Trace event whose payload (header + body) is exactly `len` bytes.
fn trace_of_payload_len(len: usize) -> Frame {
    // header 6, Body tag 1, Event tag 1, cpu 1, timestamp 1, vec length
    // varint (2 bytes for 128..16384), then the bytes.
    let data = len - 6 - 4 - 2;
    Frame::event(
        9,
        Event::Trace {
            cpu: 0,
            timestamp_ns: 0,
            payload: vec![0x5A; data],
        },
    )
}

#[test]
fn max_frame_is_accepted_and_one_more_byte_is_not() {
    let frame = trace_of_payload_len(MAX_FRAME);
    let wire = encode_one(&frame);
    assert_eq!(
        wire.len(),
        MAX_WIRE_FRAME,
        "incompressible payload is the worst case"
    );
    assert_eq!(decode_all(&wire), vec![Ok(frame)]);

    let mut out = vec![1, 2, 3];
    let too_long = trace_of_payload_len(MAX_FRAME + 1);
    assert_eq!(
        encode(&too_long, &mut out),
        Err(EncodeError::TooLong { len: MAX_FRAME + 1 })
    );
    assert_eq!(
        out,
        [1, 2, 3],
        "a failed encode leaves the output as it was"
    );

    let huge = Frame::event(
        0,
        Event::Trace {
            cpu: 0,
            timestamp_ns: 0,
            payload: vec![1; 100_000],
        },
    );
    assert!(matches!(encode(&huge, &mut out), Err(EncodeError::TooLong { len }) if len > 100_000));
    assert_eq!(out, [1, 2, 3]);
}

#[test]
fn oversized_frame_is_reported_once_and_skipped() {
    // Build a correctly encoded frame one byte beyond the limit by hand.
    let payload = vec![0x11u8; MAX_FRAME + 1];
    let mut raw = payload.clone();
    raw.extend_from_slice(&crate::crc32::crc32(&payload).to_le_bytes());
    let mut wire = vec![0];
    crate::cobs::encode(&raw, &mut wire);
    wire.push(0);
    let good = Frame::request(3, Request::Status);
    wire.extend(encode_one(&good));
    let results = decode_all(&wire);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(
        matches!(results[0], Err(DecodeError::TooLong { .. })),
        "{results:?}"
    );
    assert_eq!(results[1], Ok(good));
}

#[test]
fn wrong_version_is_rejected_before_the_body() {
    // The body bytes after a future version's header are garbage to us.
    for version in [0, PROTOCOL_VERSION + 1, u16::MAX] {
        let mut payload = Vec::new();
        payload.extend_from_slice(&version.to_le_bytes());
        payload.extend_from_slice(&77u32.to_le_bytes());
        payload.extend_from_slice(&[0xFF; 40]);
        let mut raw = payload.clone();
        raw.extend_from_slice(&crate::crc32::crc32(&payload).to_le_bytes());
        let mut wire = vec![0];
        crate::cobs::encode(&raw, &mut wire);
        wire.push(0);
        assert_eq!(
            decode_all(&wire),
            vec![Err(DecodeError::UnsupportedVersion {
                found: version,
                seq: 77
            })]
        );
    }
    // A frame built with another version by `encode` too.
    let other = PROTOCOL_VERSION + 1;
    let frame = Frame {
        version: other,
        seq: 5,
        body: Body::Request(Request::Status),
    };
    assert_eq!(
        decode_all(&encode_one(&frame)),
        vec![Err(DecodeError::UnsupportedVersion {
            found: other,
            seq: 5
        })]
    );
}

fn wire_from_payload(payload: &[u8]) -> Vec<u8> {
    let mut raw = payload.to_vec();
    raw.extend_from_slice(&crate::crc32::crc32(payload).to_le_bytes());
    let mut wire = vec![0];
    crate::cobs::encode(&raw, &mut wire);
    wire.push(0);
    wire
}

fn header(seq: u32) -> Vec<u8> {
    let mut h = PROTOCOL_VERSION.to_le_bytes().to_vec();
    h.extend_from_slice(&seq.to_le_bytes());
    h
}

#[test]
fn each_malformed_input_has_its_error() {
    // Shorter than header + CRC.
    for len in 1..10usize {
        let mut wire = vec![0];
        crate::cobs::encode(&vec![7u8; len], &mut wire);
        wire.push(0);
        assert_eq!(decode_all(&wire), vec![Err(DecodeError::Truncated { len })]);
    }
    // A COBS block cut by the delimiter.
    assert!(matches!(
        decode_all(&[0, 0x09, 1, 2, 0]).as_slice(),
        [Err(DecodeError::Cobs(crate::cobs::CobsError::Truncated {
            missing: 6
        }))]
    ));
    // A CRC that does not match.
    let mut payload = header(1);
    payload.extend_from_slice(&[0, 1]); // Request::Status
    let mut raw = payload.clone();
    let crc = crate::crc32::crc32(&payload);
    raw.extend_from_slice(&(crc ^ 1).to_le_bytes());
    let mut wire = vec![0];
    crate::cobs::encode(&raw, &mut wire);
    wire.push(0);
    assert_eq!(
        decode_all(&wire),
        vec![Err(DecodeError::Crc {
            expected: crc ^ 1,
            found: crc
        })]
    );
    // A good CRC over a body of an unknown variant.
    let mut payload = header(1);
    payload.extend_from_slice(&[0, 99]);
    assert!(
        matches!(
            decode_all(&wire_from_payload(&payload)).as_slice(),
            [Err(DecodeError::Postcard(postcard::Error::SerdeDeCustom))]
        ),
        "{:?}",
        decode_all(&wire_from_payload(&payload))
    );
    // A body cut short.
    let mut payload = header(1);
    payload.extend_from_slice(&[0, 3]); // Ping without its nonce
    assert!(matches!(
        decode_all(&wire_from_payload(&payload)).as_slice(),
        [Err(DecodeError::Postcard(
            postcard::Error::DeserializeUnexpectedEnd
        ))]
    ));
    // No body at all.
    assert!(matches!(
        decode_all(&wire_from_payload(&header(1))).as_slice(),
        [Err(DecodeError::Postcard(_))]
    ));
    // Bytes after a complete body.
    let mut payload = header(1);
    payload.extend_from_slice(&[0, 1, 0xAB, 0xCD]);
    assert_eq!(
        decode_all(&wire_from_payload(&payload)),
        vec![Err(DecodeError::TrailingBytes { count: 2 })]
    );
    // Invalid UTF-8 in a string.
    let mut payload = header(1);
    payload.extend_from_slice(&[2, 0, 2, 0xC3, 0x28]); // Event::Log, bad UTF-8
    assert!(matches!(
        decode_all(&wire_from_payload(&payload)).as_slice(),
        [Err(DecodeError::Postcard(
            postcard::Error::DeserializeBadUtf8
        ))]
    ));
}

#[test]
fn errors_display_as_one_line() {
    let errors = [
        DecodeError::Cobs(crate::cobs::CobsError::Truncated { missing: 3 }),
        DecodeError::Cobs(crate::cobs::CobsError::Empty),
        DecodeError::Cobs(crate::cobs::CobsError::ZeroByte { offset: 3 }),
        DecodeError::TooLong { len: MAX_FRAME + 5 },
        DecodeError::Truncated { len: 3 },
        DecodeError::Crc {
            expected: 0xDEAD_BEEF,
            found: 0x1234,
        },
        DecodeError::UnsupportedVersion { found: 9, seq: 4 },
        DecodeError::Postcard(postcard::Error::DeserializeBadVarint),
        DecodeError::TrailingBytes { count: 1 },
    ];
    for e in errors {
        let s = e.to_string();
        assert!(!s.is_empty() && !s.contains('\n'), "{s:?}");
    }
    assert_eq!(
        DecodeError::Crc {
            expected: 0xDEAD_BEEF,
            found: 0x1234
        }
        .to_string(),
        "frame CRC mismatch: frame says 0xdeadbeef, contents hash to 0x00001234"
    );
    assert!(EncodeError::TooLong { len: 5000 }
        .to_string()
        .contains("5000"));
}

#[test]
fn decoder_reset_drops_the_partial_frame() {
    let good = Frame::request(1, Request::Stop);
    let wire = encode_one(&good);
    let mut dec = FrameDecoder::new();
    assert_eq!(dec.feed(&wire[..wire.len() / 2]).count(), 0);
    assert!(dec.buffered() > 0);
    dec.reset();
    assert_eq!(dec.buffered(), 0);
    // The tail alone is garbage; then the frame again decodes.
    let tail: Vec<_> = dec.feed(&wire[wire.len() / 2..]).collect();
    assert!(tail.iter().all(Result::is_err));
    assert_eq!(dec.feed(&wire).collect::<Vec<_>>(), vec![Ok(good)]);
}

#[test]
fn feed_remainder_keeps_unread_bytes() {
    let a = Frame::request(1, Request::Status);
    let b = Frame::request(2, Request::Stop);
    let mut wire = encode_one(&a);
    wire.extend(encode_one(&b));
    let mut dec = FrameDecoder::new();
    let mut it = dec.feed(&wire);
    assert_eq!(it.next(), Some(Ok(a)));
    let rest = it.remainder();
    assert!(!rest.is_empty());
    assert_eq!(dec.feed(rest).collect::<Vec<_>>(), vec![Ok(b)]);
}

#[test]
fn overhead_matches_the_documented_bound() {
    const _: () = assert!(MAX_WIRE_FRAME == 4119);
    for data_len in 0..=MAX_FRAME - 12 {
        let frame = Frame::event(
            u32::MAX,
            Event::Trace {
                cpu: 1,
                timestamp_ns: 1,
                payload: vec![0xA5; data_len],
            },
        );
        let body = postcard::to_allocvec(&frame.body).unwrap().len();
        let wire = encode_one(&frame).len();
        if body <= 244 {
            assert_eq!(wire - body, 13, "body {body}");
        }
        assert!(
            wire - body <= 13 + (body + 10) / 254,
            "body {body}: wire {wire}"
        );
    }
}

/// `reason` as `encode_fatal` sends it: cut to `MAX_FATAL_REASON` bytes at
/// a character boundary.
fn fatal_frame(reason: &str) -> Frame {
    let mut cut = reason.len().min(MAX_FATAL_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    Frame::event(
        FATAL_SEQ,
        Event::Fatal {
            reason: reason[..cut].into(),
        },
    )
}

fn fatal_wire(reason: &str) -> Vec<u8> {
    let mut wire = Vec::new();
    let n = encode_fatal(reason, |b| wire.push(b));
    assert_eq!(n, wire.len());
    wire
}

#[test]
fn the_fatal_encoder_writes_what_encode_writes() {
    // As docs/MACHINE.md (Fatal path) states it.
    const _: () = assert!(FATAL_WIRE_MAX == 498);
    let mut reasons: Vec<String> = vec![
        String::new(),
        "x".into(),
        "hypervisor panic: panicked at hypervisor/src/main.rs:70:9: self-test".into(),
        "nul \0 and \u{0} inside".into(),
        "é".repeat(MAX_FATAL_REASON),
        "✓".repeat(MAX_FATAL_REASON / 3 + 1),
    ];
    // Around COBS block boundaries and the varint's one/two byte boundary.
    for len in [
        120, 126, 127, 128, 129, 236, 237, 238, 240, 250, 254, 255, 300, 479, 480, 481, 1000,
    ] {
        reasons.push("r".repeat(len));
    }
    for reason in &reasons {
        let frame = fatal_frame(reason);
        let wire = fatal_wire(reason);
        assert_eq!(wire, encode_one(&frame), "reason of {} bytes", reason.len());
        assert!(
            wire.len() <= FATAL_WIRE_MAX,
            "{} > {FATAL_WIRE_MAX}",
            wire.len()
        );
        assert_eq!(decode_all(&wire), vec![Ok(frame)]);
        let Body::Event(Event::Fatal { reason: sent }) = &fatal_frame(reason).body else {
            unreachable!()
        };
        assert!(sent.len() <= MAX_FATAL_REASON && reason.starts_with(sent.as_str()));
    }
    // The bound is reached, not just respected, by the longest reason.
    let longest = fatal_wire(&"\0".repeat(MAX_FATAL_REASON));
    assert!(longest.len() <= FATAL_WIRE_MAX);
    assert!(fatal_wire(&"r".repeat(MAX_FATAL_REASON)).len() >= FATAL_WIRE_MAX - 3);
}

/// The fatal path may interrupt a frame half written (the output queue was
/// mid-frame): whatever came before, the fatal frame decodes, with at most
/// one error for the cut frame before it.
#[test]
fn a_fatal_frame_after_a_cut_in_half_frame_decodes() {
    let fatal = fatal_frame("hypervisor fault in VMX root: #GP");
    let fatal_bytes = fatal_wire("hypervisor fault in VMX root: #GP");
    let cut_me = encode_one(&Frame::event(
        7,
        Event::TraceText {
            format: TraceFormat::Text,
            source: 0,
            lost: 0,
            text: "x-1 [000] d.... 1.0: vfs_read: (vfs_read+0x0/0x1)\n".repeat(20),
        },
    ));
    // Exactly in half, then at every other point of the frame.
    let half = cut_me.len() / 2;
    let points = core::iter::once(half).chain(1..cut_me.len() - 1);
    for cut in points {
        let mut stream = cut_me[..cut].to_vec();
        stream.extend_from_slice(&fatal_bytes);
        let got = decode_all(&stream);
        let (last, before) = got.split_last().expect("a frame");
        assert_eq!(last, &Ok(fatal.clone()), "cut at {cut}");
        assert!(before.len() <= 1, "cut at {cut}: {got:?}");
        assert!(before.iter().all(Result::is_err), "cut at {cut}: {got:?}");
    }
    // The frame cut in half alone is lost, not mistaken for anything.
    let mut dec = FrameDecoder::new();
    assert_eq!(dec.feed(&cut_me[..half]).count(), 0);
    let got: Vec<_> = dec.feed(&fatal_bytes).collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].is_err());
    assert_eq!(got[1], Ok(fatal));
}
