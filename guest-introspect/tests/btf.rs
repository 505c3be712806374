//! BTF over blobs built here: nested anonymous members (6.12's `pcpu_hot`,
//! randomized `task_struct` layouts), bitfields, typedef chains, and
//! corruptions.

mod common;

use common::Rng;
use guest_introspect::btf::{self, Btf, BtfError, Kind, BTF_MAGIC};
use guest_introspect::scan::ScanStats;
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};

/// Writes BTF types in id order (ids from 1).
struct Builder {
    types: Vec<u8>,
    strings: Vec<u8>,
    next_id: u32,
}

struct M<'a> {
    name: &'a str,
    ty: u32,
    bit_off: u32,
    bits: u32,
}

fn m(name: &str, ty: u32, byte_off: u32) -> M<'_> {
    M {
        name,
        ty,
        bit_off: byte_off * 8,
        bits: 0,
    }
}

impl Builder {
    fn new() -> Self {
        Self {
            types: vec![],
            strings: vec![0],
            next_id: 1,
        }
    }

    fn s(&mut self, name: &str) -> u32 {
        if name.is_empty() {
            return 0;
        }
        let off = self.strings.len() as u32;
        self.strings.extend_from_slice(name.as_bytes());
        self.strings.push(0);
        off
    }

    fn head(
        &mut self,
        name: &str,
        kind: Kind,
        vlen: u32,
        kind_flag: bool,
        size_or_type: u32,
    ) -> u32 {
        let n = self.s(name);
        let info = vlen | ((kind as u32) << 24) | ((kind_flag as u32) << 31);
        for w in [n, info, size_or_type] {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
        self.next_id += 1;
        self.next_id - 1
    }

    fn words(&mut self, ws: &[u32]) {
        for w in ws {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
    }

    fn int(&mut self, name: &str, size: u32) -> u32 {
        let id = self.head(name, Kind::Int, 0, false, size);
        self.words(&[size * 8]);
        id
    }

    fn alias(&mut self, kind: Kind, name: &str, to: u32) -> u32 {
        self.head(name, kind, 0, false, to)
    }

    fn array(&mut self, elem: u32, index: u32, n: u32) -> u32 {
        let id = self.head("", Kind::Array, 0, false, 0);
        self.words(&[elem, index, n]);
        id
    }

    fn record(&mut self, kind: Kind, name: &str, size: u32, members: &[M<'_>]) -> u32 {
        let flag = members.iter().any(|m| m.bits != 0);
        let id = self.head(name, kind, members.len() as u32, flag, size);
        for mm in members {
            let n = self.s(mm.name);
            let off = if flag {
                (mm.bits << 24) | mm.bit_off
            } else {
                mm.bit_off
            };
            self.words(&[n, mm.ty, off]);
        }
        id
    }

    fn enum_(&mut self, name: &str, values: &[(&str, u32)]) -> u32 {
        let id = self.head(name, Kind::Enum, values.len() as u32, false, 4);
        for (n, v) in values {
            let n = self.s(n);
            self.words(&[n, *v]);
        }
        id
    }

    fn blob(&self) -> Vec<u8> {
        let mut b = vec![];
        b.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        b.extend_from_slice(&[1, 0]);
        for w in [
            24u32,
            0,
            self.types.len() as u32,
            self.types.len() as u32,
            self.strings.len() as u32,
        ] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&self.types);
        b.extend_from_slice(&self.strings);
        b
    }
}

/// A 6.12-like world: pcpu_hot with current_task inside an anonymous struct
/// inside an anonymous union, and a task_struct whose pid sits in a
/// randomized anonymous struct after some bitfields.
fn kernel_like(hot_prefix: u32) -> Vec<u8> {
    let mut b = Builder::new();
    let int = b.int("int", 4); // 1
    let uchar = b.int("unsigned char", 1); // 2
    let char_ = b.int("char", 1); // 3
    let kpid = b.alias(Kind::Typedef, "__kernel_pid_t", int); // 4
    let pid_t = b.alias(Kind::Typedef, "pid_t", kpid); // 5
    let task_fwd = b.head("task_struct", Kind::Fwd, 0, false, 0); // 6
    let task_ptr = b.alias(Kind::Ptr, "", task_fwd); // 7
    let comm = b.array(char_, int, 16); // 8
    let pad = b.array(uchar, int, 64); // 9
    let _e = b.enum_("pid_type", &[("PIDTYPE_PID", 0), ("PIDTYPE_TGID", 1)]); // 10
                                                                              // struct { struct task_struct *current_task; int preempt_count; int cpu_number; }
    let inner = b.record(
        Kind::Struct,
        "",
        16,
        &[
            m("current_task", task_ptr, 0),
            m("preempt_count", int, 8),
            m("cpu_number", int, 12),
        ],
    ); // 11
    let un = b.record(Kind::Union, "", 64, &[m("", inner, 0), m("pad", pad, 0)]); // 12
    let mut hot = vec![];
    if hot_prefix > 0 {
        hot.push(m("before", int, 0));
    }
    hot.push(m("", un, hot_prefix));
    b.record(Kind::Struct, "pcpu_hot", 64 + hot_prefix, &hot); // 13
                                                               // Randomized part: struct { unsigned bitfields...; pid_t pid; pid_t tgid; }
    let cpid = b.alias(Kind::Const, "", pid_t); // 14
    let rand = b.record(
        Kind::Struct,
        "",
        24,
        &[
            M {
                name: "sched_reset_on_fork",
                ty: int,
                bit_off: 0,
                bits: 1,
            },
            M {
                name: "sched_migrated",
                ty: int,
                bit_off: 1,
                bits: 1,
            },
            m("pid", cpid, 8),
            m("tgid", pid_t, 12),
        ],
    ); // 15
    b.record(
        Kind::Struct,
        "task_struct",
        4096,
        &[
            m("__state", int, 0),
            m("", rand, 0x900),
            m("comm", comm, 0xba0),
        ],
    ); // 16
    b.blob()
}

fn view_of(bytes: &[u8], at: u64) -> SegmentView<'_> {
    let mut v = SegmentView::new();
    assert!(v.add(Gva(at), bytes, bytes.len() as u64));
    v
}

const AT: u64 = 0xffff_ffff_8240_0000;

#[test]
fn nested_anonymous_members() {
    for prefix in [0u32, 8] {
        let blob = kernel_like(prefix);
        let view = view_of(&blob, AT);
        let b = Btf::parse(&view, Gva(AT)).unwrap();
        assert_eq!(b.type_count(), 16);
        assert_eq!(btf::pcpu_hot_current_task(&b), Ok(prefix));
        let t = btf::task_layout(&b).unwrap();
        assert_eq!(
            t,
            btf::TaskLayout {
                pid: 0x908,
                comm: 0xba0,
                comm_len: 16,
                size: 4096,
                stack: None,
            }
        );
        // A bitfield member reports its width and has no byte offset.
        let task = b.find(Kind::Struct, "task_struct").unwrap();
        let bf = b.member(&task, "sched_migrated").unwrap();
        assert_eq!(
            (bf.bit_offset, bf.bitfield_bits, bf.byte_offset()),
            (0x900 * 8 + 1, 1, None)
        );
        assert_eq!(
            b.member(&task, "nothing"),
            Err(BtfError::NoMember("nothing"))
        );
        assert_eq!(
            b.find(Kind::Union, "task_struct"),
            Err(BtfError::NoType("task_struct"))
        );
    }
}

#[test]
fn wrong_member_types_are_refused() {
    let mut b = Builder::new();
    let int = b.int("int", 4);
    let long = b.int("long", 8);
    let ch = b.int("char", 1);
    let comm = b.array(ch, int, 16);
    b.record(
        Kind::Struct,
        "task_struct",
        100,
        &[m("pid", long, 0), m("comm", comm, 16)],
    );
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let parsed = Btf::parse(&view, Gva(AT)).unwrap();
    assert_eq!(
        btf::task_layout(&parsed),
        Err(BtfError::UnexpectedType("pid"))
    );
}

#[test]
fn located_by_header_scan() {
    let blob = kernel_like(0);
    let mut mem: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + 3) as u8).collect();
    // A decoy: the magic and header prefix with impossible lengths.
    mem[1000..1008].copy_from_slice(&[0x9f, 0xeb, 1, 0, 24, 0, 0, 0]);
    mem[1008..1024].copy_from_slice(&[0xff; 16]);
    let at = 20_000;
    mem[at..at + blob.len()].copy_from_slice(&blob);
    let view = view_of(&mem, AT);
    let mut st = ScanStats::default();
    let found = btf::locate(
        &view,
        None,
        &[GvaRange::with_len(Gva(AT), mem.len() as u64)],
        &mut st,
    );
    assert_eq!(found, Ok(Gva(AT + at as u64)));
    let none = btf::locate(&view, None, &[GvaRange::with_len(Gva(AT), 10_000)], &mut st);
    assert_eq!(none, Err(BtfError::Absent));
}

#[test]
fn corrupted_blobs_never_panic() {
    let good = kernel_like(0);
    let mut rng = Rng(common::seed());
    let mut ok = 0;
    for _ in 0..3000 {
        let mut blob = good.clone();
        for _ in 0..1 + rng.below(4) {
            let p = rng.below(blob.len() as u64) as usize;
            blob[p] = rng.next() as u8;
        }
        if rng.below(5) == 0 {
            blob.truncate(rng.below(blob.len() as u64) as usize);
        }
        if blob.is_empty() {
            continue;
        }
        let view = view_of(&blob, AT);
        if let Ok(b) = Btf::parse(&view, Gva(AT)) {
            let _ = btf::pcpu_hot_current_task(&b);
            if btf::task_layout(&b).is_ok() {
                ok += 1;
            }
            for id in 0..=b.type_count() + 1 {
                let _ = b.resolve(id);
            }
        }
    }
    eprintln!("3000 corrupted blobs: task layout still found in {ok}");
}

/// Self-referencing typedefs and deeply nested anonymous members end in an
/// error, not a hang.
#[test]
fn cycles_are_bounded() {
    let mut b = Builder::new();
    let int = b.int("int", 4); // 1
    let _loop = b.alias(Kind::Typedef, "loop", 2); // 2 -> itself
                                                   // 3: anonymous struct containing itself anonymously.
    b.record(Kind::Struct, "", 8, &[m("", 3, 0)]);
    b.record(
        Kind::Struct,
        "task_struct",
        64,
        &[m("", 3, 0), m("pid", 2, 4), m("x", int, 8)],
    ); // 4
       // 5: an anonymous union of three anonymous copies of itself: 3^16
       // paths if only the depth were bounded.
    b.record(Kind::Union, "", 8, &[m("", 5, 0), m("", 5, 0), m("", 5, 0)]);
    b.record(Kind::Struct, "pcpu_hot", 8, &[m("", 5, 0)]); // 6
    let blob = b.blob();
    let view = view_of(&blob, AT);
    let parsed = Btf::parse(&view, Gva(AT)).unwrap();
    assert!(parsed.resolve(2).is_err());
    assert!(btf::task_layout(&parsed).is_err());
    let t0 = std::time::Instant::now();
    assert!(btf::pcpu_hot_current_task(&parsed).is_err());
    assert!(t0.elapsed().as_secs() < 5);
}
