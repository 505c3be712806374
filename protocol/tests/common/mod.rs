//! Shared by the integration tests and the benchmark: sample messages and a
//! small deterministic RNG.
#![allow(dead_code)]

use protocol::{
    encode, Body, ErrorKind, Event, ExitCount, Frame, GuestState, Request, Response, StatusReport,
    TaskInfo, TraceFormat, PROTOCOL_VERSION,
};

pub use test_support::Rng;

/// A status report shaped like a real one: a dozen exit reasons.
pub fn status_report() -> StatusReport {
    let reasons: [(u16, &str, u64); 12] = [
        (0, "EXCEPTION_NMI", 12),
        (1, "EXTERNAL_INTERRUPT", 1_234_567),
        (7, "INTERRUPT_WINDOW", 4_321),
        (10, "CPUID", 98_765),
        (12, "HLT", 55_555),
        (18, "VMCALL", 987_654_321),
        (28, "CR_ACCESS", 4_444),
        (30, "IO_INSTRUCTION", 3_141_592),
        (31, "MSR_READ", 2_718),
        (32, "MSR_WRITE", 27_182),
        (48, "EPT_VIOLATION", 16_180),
        (52, "PREEMPTION_TIMER", 10_000_000),
    ];
    StatusReport {
        hypervisor_version: "hvtrace 0.1.0".into(),
        protocol_version: PROTOCOL_VERSION,
        vcpus: 2,
        uptime_ns: 123_456_789_012,
        guest_state: GuestState::Running,
        exits: reasons
            .iter()
            .map(|&(reason, name, count)| ExitCount {
                reason,
                name: name.into(),
                count,
            })
            .collect(),
        exits_total: reasons.iter().map(|r| r.2).sum(),
        hv_memory_used: 3 << 20,
        hv_memory_total: 64 << 20,
        hv_heap_used: 3 << 20,
        current_task: Some(TaskInfo {
            pid: 4242,
            comm: "kworker/0:1".into(),
            cpu: 1,
        }),
        channel: protocol::ChannelReport {
            bytes_in: 4096,
            bytes_out: 65_536,
            frames_in: 40,
            frames_out: 41,
            bad_frames: 2,
            dropped: 0,
            bulk_frames: 7,
            bulk_bytes: 21_000,
        },
        kernel: None,
        tracer: protocol::TracerReport::default(),
        per_vcpu: vec![protocol::VcpuReport {
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
            view_switches: 4,
            armed_ns: 1_000,
            quiet_ns: 9_000,
            quiet: true,
            root_stack_used: 52_224,
            root_stack_size: 524_288,
            vmcs_unshadowed: 3,
            invept: 1,
            root_hit: protocol::RootTime {
                count: 2,
                sum_ns: 48_000,
                min_ns: 23_000,
                max_ns: 25_000,
            },
            root_return: protocol::RootTime::default(),
            root_refused: protocol::RootTime {
                count: 1,
                sum_ns: 9_000,
                min_ns: 9_000,
                max_ns: 9_000,
            },
            root_turns: protocol::RootTime::default(),
        }],
        graph_sessions: vec![protocol::GraphSessionReport {
            session: 1,
            hooked: 4,
            roots: 0,
            quiet: 3,
        }],
        guard: protocol::GuardReport::default(),
    }
}

/// One of each message, with varied field values.
pub fn sample_bodies() -> Vec<Body> {
    let mut bodies = vec![
        Body::Request(Request::Hello {
            version: PROTOCOL_VERSION,
            client: "hvtrace-cli 0.1".into(),
        }),
        Body::Request(Request::Status),
        Body::Request(Request::Stop),
        Body::Request(Request::Ping { nonce: 0 }),
        Body::Request(Request::Ping { nonce: u64::MAX }),
        Body::Request(Request::Syms {
            glob: "vfs_*".into(),
            kinds: "tT".into(),
            module: String::new(),
            cursor: 40,
            limit: 20,
        }),
        Body::Request(Request::ProbeAdd {
            spec: "p:myprobe do_sys_open dfd=%di".into(),
        }),
        Body::Request(Request::ProbeDel {
            name: "myprobe".into(),
        }),
        Body::Request(Request::ProbeList),
        Body::Request(Request::TraceStart {
            format: TraceFormat::Text,
        }),
        Body::Request(Request::TraceStop),
        Body::Request(Request::TraceStart {
            format: TraceFormat::Json,
        }),
        Body::Request(Request::FunctionAdd {
            glob: "vfs_*".into(),
        }),
        Body::Request(Request::FunctionClear),
        Body::Request(Request::TraceRead {
            cursor: 12,
            format: TraceFormat::Text,
            wait_ms: 500,
            source: None,
        }),
        Body::Request(Request::TraceRead {
            cursor: 0,
            format: TraceFormat::Json,
            wait_ms: 0,
            source: Some(3),
        }),
        Body::Response(Response::ProbeAdded {
            name: "kprobes/myopen".into(),
            site: 0xffff_ffff_8123_4564,
        }),
        Body::Response(Response::Probes(vec![protocol::ProbeInfo {
            name: "kprobes/myopen".into(),
            spec: "p:kprobes/myopen do_sys_openat2 dfd=%di".into(),
            symbol: "do_sys_openat2".into(),
            site: 0xffff_ffff_8123_4564,
            hits: 3,
            misses: 1,
            pending: false,
        }])),
        Body::Response(Response::FunctionAdded {
            traced: 40,
            skipped: vec!["vfs_x: site crosses a page".into()],
            skipped_total: 1,
        }),
        Body::Response(Response::Trace {
            next: 99,
            text: "cat-1 [000] 1.000000: myopen: (do_sys_openat2+0x4/0x150)\n".into(),
            lost: 0,
        }),
        Body::Request(Request::GraphStart(protocol::GraphFilter {
            functions: vec!["vfs_read".into()],
            trace: vec![],
            notrace: vec!["rcu_*".into()],
            graph_notrace: vec!["schedule".into()],
            max_depth: 8,
            pid: Some(42),
            comm: Some("dd".into()),
            retval: true,
            stack_frames: 4,
            gate: false,
        })),
        Body::Request(Request::GraphStop { session: None }),
        Body::Request(Request::GraphStop { session: Some(2) }),
        Body::Response(Response::GraphStarted {
            session: 1,
            hooked: 19_804,
            roots: 1,
            skipped: 18,
        }),
        Body::Event(Event::TraceText {
            format: TraceFormat::Text,
            source: 1,
            lost: 2,
            text: "x\n".into(),
        }),
        Body::Response(Response::Hello {
            version: PROTOCOL_VERSION,
            hypervisor: "hvtrace 0.1.0".into(),
        }),
        Body::Response(Response::Status(status_report())),
        Body::Response(Response::Pong { nonce: 0xDEAD_BEEF }),
        Body::Response(Response::Ok),
        Body::Response(Response::error(ErrorKind::Unsupported, "not yet")),
        Body::Response(Response::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: 7,
        }),
        Body::Event(Event::Log {
            text: "vcpu0: guest booted".into(),
        }),
        Body::Event(Event::Lost { count: 17 }),
        Body::Event(Event::Trace {
            cpu: 1,
            timestamp_ns: 99,
            payload: (0..=255).collect(),
        }),
        Body::Event(Event::Trace {
            cpu: 0,
            timestamp_ns: 0,
            payload: vec![0; 300],
        }),
    ];
    let mut idle = status_report();
    idle.exits.clear();
    idle.current_task = None;
    idle.guest_state = GuestState::Booting;
    bodies.push(Body::Response(Response::Status(idle)));
    bodies
}

/// A random frame whose payload fits in `MAX_FRAME`.
pub fn random_frame(rng: &mut Rng) -> Frame {
    let seq = rng.next() as u32;
    let body = match rng.index(8) {
        0 => Body::Request(Request::Ping { nonce: rng.next() }),
        1 => Body::Request(Request::ProbeAdd {
            spec: rng.text_upto(80),
        }),
        2 => Body::Response(Response::Pong { nonce: rng.next() }),
        3 => Body::Response(Response::error(ErrorKind::NotFound, rng.text_upto(60))),
        4 => Body::Event(Event::Log {
            text: rng.text_upto(120),
        }),
        5 => Body::Event(Event::Lost {
            count: rng.next() >> rng.index(64),
        }),
        6 => {
            let len = rng.index(600);
            Body::Event(Event::Trace {
                cpu: rng.index(4) as u32,
                timestamp_ns: rng.next(),
                payload: rng.bytes(len),
            })
        }
        _ => Body::Response(Response::Status(status_report())),
    };
    Frame::new(seq, body)
}

/// `frame` on the wire.
pub fn wire(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    encode(frame, &mut out).expect("sample frames encode");
    out
}

/// A wire frame around an arbitrary payload (header + body), with a correct
/// CRC: for feeding hostile bodies past the CRC check.
pub fn wire_from_payload(payload: &[u8]) -> Vec<u8> {
    let mut raw = payload.to_vec();
    raw.extend_from_slice(&protocol::crc32::crc32(payload).to_le_bytes());
    let mut out = vec![0];
    protocol::cobs::encode(&raw, &mut out);
    out.push(0);
    out
}

/// The payload (header + body) of a wire frame made by `encode`.
pub fn payload_of(wire: &[u8]) -> Vec<u8> {
    let inner = &wire[1..wire.len() - 1];
    let mut raw = Vec::new();
    protocol::cobs::decode(inner, &mut raw).expect("a wire frame");
    raw.truncate(raw.len() - protocol::CRC_LEN);
    raw
}

/// Feeds `bytes` in one go and collects every result.
pub fn decode_all(bytes: &[u8]) -> Vec<Result<Frame, protocol::DecodeError>> {
    let mut dec = protocol::FrameDecoder::new();
    dec.feed(bytes).collect()
}
