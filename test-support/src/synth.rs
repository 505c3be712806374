//! Synthetic kernel pieces for the tests: BTF blobs built type by type,
//! and kallsyms tables laid out the way scripts/kallsyms.c lays them out.
use crate::Rng;
use guest_introspect::btf::{Kind, BTF_MAGIC};

// BTF

/// Writes BTF types in id order (ids from 1).
pub struct Builder {
    pub types: Vec<u8>,
    pub strings: Vec<u8>,
    pub next_id: u32,
}

pub struct M<'a> {
    pub name: &'a str,
    pub ty: u32,
    pub bit_off: u32,
    pub bits: u32,
}

pub fn m(name: &str, ty: u32, byte_off: u32) -> M<'_> {
    M {
        name,
        ty,
        bit_off: byte_off * 8,
        bits: 0,
    }
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

impl Builder {
    pub fn new() -> Self {
        Self {
            types: vec![],
            strings: vec![0],
            next_id: 1,
        }
    }

    pub fn s(&mut self, name: &str) -> u32 {
        if name.is_empty() {
            return 0;
        }
        let off = self.strings.len() as u32;
        self.strings.extend_from_slice(name.as_bytes());
        self.strings.push(0);
        off
    }

    pub fn head(
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

    pub fn words(&mut self, ws: &[u32]) {
        for w in ws {
            self.types.extend_from_slice(&w.to_le_bytes());
        }
    }

    pub fn int(&mut self, name: &str, size: u32) -> u32 {
        let id = self.head(name, Kind::Int, 0, false, size);
        self.words(&[size * 8]);
        id
    }

    pub fn alias(&mut self, kind: Kind, name: &str, to: u32) -> u32 {
        self.head(name, kind, 0, false, to)
    }

    pub fn array(&mut self, elem: u32, index: u32, n: u32) -> u32 {
        let id = self.head("", Kind::Array, 0, false, 0);
        self.words(&[elem, index, n]);
        id
    }

    pub fn record(&mut self, kind: Kind, name: &str, size: u32, members: &[M<'_>]) -> u32 {
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

    pub fn enum_(&mut self, name: &str, values: &[(&str, u32)]) -> u32 {
        let id = self.head(name, Kind::Enum, values.len() as u32, false, 4);
        for (n, v) in values {
            let n = self.s(n);
            self.words(&[n, *v]);
        }
        id
    }

    pub fn blob(&self) -> Vec<u8> {
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
pub fn kernel_like(hot_prefix: u32) -> Vec<u8> {
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

// kallsyms

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Order {
    V61 { seqs: bool },
    V612,
}

pub struct Sym {
    pub kind: u8,
    pub name: String,
    pub addr: u64,
}

/// The 256 tokens: printable ASCII stands for itself, every other byte
/// value for a two-letter pair (so names compress a little).
pub fn tokens() -> Vec<Vec<u8>> {
    (0..256u32)
        .map(|k| {
            if (0x21..0x7f).contains(&k) {
                vec![k as u8]
            } else {
                vec![b'a' + (k % 26) as u8, b'a' + ((k / 26) % 26) as u8]
            }
        })
        .collect()
}

/// Greedy compression with the pair tokens.
pub fn compress(text: &[u8], pair: &std::collections::HashMap<[u8; 2], u8>) -> Vec<u8> {
    let mut out = vec![];
    let mut i = 0;
    while i < text.len() {
        if let Some(&k) = text.get(i..i + 2).and_then(|p| pair.get(p)) {
            out.push(k);
            i += 2;
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

pub fn align8(v: &mut Vec<u8>) {
    while !v.len().is_multiple_of(8) {
        v.push(0);
    }
}

/// Where each table landed, relative to the blob start.
#[derive(Debug, Default)]
pub struct Offsets {
    pub names: usize,
    pub markers: usize,
    pub token_table: usize,
    pub token_index: usize,
    pub offsets: usize,
    pub relative_base: usize,
}

pub fn generate(syms: &[Sym], order: Order, absolute_percpu: bool, rb: u64) -> (Vec<u8>, Offsets) {
    let toks = tokens();
    let pair: std::collections::HashMap<[u8; 2], u8> = toks
        .iter()
        .enumerate()
        .filter(|(_, t)| t.len() == 2)
        .map(|(k, t)| ([t[0], t[1]], k as u8))
        .collect();
    let n = syms.len();
    let mut names = vec![];
    let mut markers = vec![];
    for (i, s) in syms.iter().enumerate() {
        if i % 256 == 0 {
            markers.push(names.len() as u32);
        }
        let mut text = vec![s.kind];
        text.extend_from_slice(s.name.as_bytes());
        let c = compress(&text, &pair);
        if c.len() <= 0x7f {
            names.push(c.len() as u8);
        } else {
            names.push((c.len() as u8 & 0x7f) | 0x80);
            names.push((c.len() >> 7) as u8);
        }
        names.extend_from_slice(&c);
    }
    let mut table = vec![];
    let mut index = vec![];
    for t in &toks {
        index.push(table.len() as u16);
        table.extend_from_slice(t);
        table.push(0);
    }
    let offsets: Vec<i32> = syms
        .iter()
        .map(|s| {
            if !absolute_percpu {
                (s.addr - rb) as u32 as i32
            } else if s.kind == b'A' {
                s.addr as i32
            } else {
                (rb as i64 - s.addr as i64 - 1) as i32
            }
        })
        .collect();
    let mut by_name: Vec<usize> = (0..n).collect();
    by_name.sort_by(|&a, &b| syms[a].name.cmp(&syms[b].name));
    let seqs: Vec<u8> = by_name
        .iter()
        .flat_map(|&i| [(i >> 16) as u8, (i >> 8) as u8, i as u8])
        .collect();

    let mut blob = vec![];
    let mut at = Offsets::default();
    let put_offsets = |blob: &mut Vec<u8>, at: &mut Offsets| {
        align8(blob);
        at.offsets = blob.len();
        for o in &offsets {
            blob.extend_from_slice(&o.to_le_bytes());
        }
        align8(blob);
        at.relative_base = blob.len();
        blob.extend_from_slice(&rb.to_le_bytes());
    };
    if matches!(order, Order::V61 { .. }) {
        put_offsets(&mut blob, &mut at);
    }
    align8(&mut blob);
    blob.extend_from_slice(&(n as u32).to_le_bytes());
    align8(&mut blob);
    at.names = blob.len();
    blob.extend_from_slice(&names);
    align8(&mut blob);
    at.markers = blob.len();
    for m in &markers {
        blob.extend_from_slice(&m.to_le_bytes());
    }
    if order == (Order::V61 { seqs: true }) {
        align8(&mut blob);
        blob.extend_from_slice(&seqs);
    }
    align8(&mut blob);
    at.token_table = blob.len();
    blob.extend_from_slice(&table);
    align8(&mut blob);
    at.token_index = blob.len();
    for i in &index {
        blob.extend_from_slice(&i.to_le_bytes());
    }
    if order == Order::V612 {
        put_offsets(&mut blob, &mut at);
        align8(&mut blob);
        blob.extend_from_slice(&seqs);
    }
    align8(&mut blob);
    (blob, at)
}

pub fn random_syms(rng: &mut Rng, n: usize, absolute_percpu: bool, rb: u64) -> Vec<Sym> {
    let mut syms = vec![];
    let percpu = if absolute_percpu { n / 10 } else { 0 };
    let mut addr = 0u64;
    for i in 0..percpu {
        addr += rng.below(64);
        syms.push(Sym {
            kind: b'A',
            name: format!("pcpu_{i}"),
            addr,
        });
    }
    let mut addr = rb;
    for i in percpu..n {
        // Aliases (same address) now and then.
        if rng.below(8) != 0 {
            addr += 1 + rng.below(400);
        }
        let len = match rng.below(20) {
            0 => 130 + rng.below(300) as usize, // two-byte length
            _ => 1 + rng.below(30) as usize,
        };
        let mut name = format!("f{i}_");
        while name.len() < len {
            name.push((b'a' + rng.below(26) as u8) as char);
        }
        let kind = *b"tTdDbBrR".get(rng.below(8) as usize).unwrap();
        syms.push(Sym { kind, name, addr });
    }
    syms
}
