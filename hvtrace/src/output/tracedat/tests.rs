//! The writer against a reader written here from the format's
//! description alone (trace-cmd.dat.v6(5), the kernel's header_page and
//! header_event texts), not from the writer's code.

use super::page::{PageWriter, PAGE_SIZE};
use super::*;

/// A little-endian cursor.
struct Cur<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn cstr(&mut self) -> String {
        let end = self.b[self.at..].iter().position(|&c| c == 0).unwrap();
        let s = String::from_utf8(self.b[self.at..self.at + end].to_vec()).unwrap();
        self.at += end + 1;
        s
    }
    fn text(&mut self, n: usize) -> String {
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
}

/// One event read back from a page.
#[derive(Debug, Clone, PartialEq)]
struct Read {
    ts: u64,
    data: Vec<u8>,
}

/// A page's events, and whether it says events were missed (and how many
/// when stored).
fn read_page(page: &[u8]) -> PageRead {
    let mut c = Cur { b: page, at: 0 };
    let mut ts = c.u64();
    let commit = c.u64();
    let size = (commit & ((1 << 27) - 1)) as usize;
    let missed = if commit & (1 << 31) != 0 {
        if commit & (1 << 30) != 0 {
            Some(Some(u64::from_le_bytes(
                page[16 + size..24 + size].try_into().unwrap(),
            )))
        } else {
            Some(None)
        }
    } else {
        None
    };
    let mut out = Vec::new();
    while c.at < 16 + size {
        let head = c.u32();
        let type_len = head & 31;
        let delta = u64::from(head >> 5);
        match type_len {
            29 => {
                // Padding: the length follows.
                let len = c.u32() as usize;
                c.at += len.saturating_sub(4);
                ts += delta;
            }
            30 => {
                let high = u64::from(c.u32());
                ts += (high << 27) + delta;
            }
            31 => {
                let high = u64::from(c.u32());
                ts = (high << 27) + delta;
            }
            0 => {
                let len = c.u32() as usize - 4;
                ts += delta;
                let data = c.take(len).to_vec();
                c.at += (4 - len % 4) % 4;
                out.push(Read { ts, data });
            }
            n => {
                ts += delta;
                let data = c.take(n as usize * 4).to_vec();
                out.push(Read { ts, data });
            }
        }
    }
    (out, missed)
}

fn read_pages(pages: &[u8]) -> Vec<PageRead> {
    assert_eq!(pages.len() % PAGE_SIZE, 0);
    pages.chunks(PAGE_SIZE).map(read_page).collect()
}

#[test]
fn pages_round_trip_with_extends_long_records_and_losses() {
    let mut w = PageWriter::new();
    let mut expect = Vec::new();
    let mut ts = 1_000u64;
    for i in 0..500u64 {
        // Gaps past 2^27 ns now and then, and payloads from 1 to 300
        // bytes (over 112 takes the long form).
        ts += if i % 37 == 0 {
            (1 << 27) + i * 1_000_003
        } else {
            i * 13
        };
        let len = 1 + (i as usize * 7) % 300;
        let payload: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
        assert!(w.push(ts, &payload));
        expect.push((ts, payload));
    }
    // An event before the previous one is written at the previous time.
    assert!(w.push(ts - 5, b"late"));
    expect.push((ts, b"late".to_vec()));
    w.lost(Some(7));
    ts += 10;
    assert!(w.push(ts, b"after a loss"));
    expect.push((ts, b"after a loss".to_vec()));
    w.lost(None);
    ts += 1 << 40;
    assert!(w.push(ts, b"after an unknown loss, far later"));
    expect.push((ts, b"after an unknown loss, far later".to_vec()));
    // An empty payload: one zero word, as the kernel stores it.
    assert!(w.push(ts, b""));
    expect.push((ts, Vec::new()));
    // Too long for a page.
    assert!(!w.push(ts, &vec![0u8; PAGE_SIZE]));
    assert_eq!((w.events(), w.refused()), (expect.len() as u64, 1));
    let pages = w.finish();
    let read = read_pages(&pages);
    assert!(read.len() > 5, "{} pages", read.len());
    let mut got = Vec::new();
    let mut losses = Vec::new();
    for (i, (events, missed)) in read.iter().enumerate() {
        if let Some(m) = missed {
            losses.push((i, *m, events.first().map(|e| e.data.clone())));
        }
        for e in events {
            got.push((e.ts, e.data.clone()));
        }
    }
    // Payloads come back padded to 4 bytes.
    assert_eq!(got.len(), expect.len());
    for ((gt, gd), (et, ed)) in got.iter().zip(&expect) {
        assert_eq!(gt, et);
        assert_eq!(&gd[..ed.len()], &ed[..]);
        assert!(gd[ed.len()..].iter().all(|&b| b == 0));
        assert!(gd.len() - ed.len() < 4 || (ed.is_empty() && gd.len() == 4));
    }
    assert_eq!(
        losses,
        [
            (read.len() - 2, Some(7), Some(b"after a loss".to_vec())),
            (
                read.len() - 1,
                None,
                Some(b"after an unknown loss, far later\0\0\0\0".to_vec()[..32].to_vec())
            )
        ]
    );
}

#[test]
fn the_reader_takes_padding_and_absolute_stamps() {
    // A page written by hand: a padding record in the middle (a discarded
    // event), an absolute timestamp, then a small event.
    let mut page = vec![0u8; PAGE_SIZE];
    let mut data = Vec::new();
    data.extend_from_slice(&((1u32 << 5) | 2).to_le_bytes()); // 8 bytes, +1
    data.extend_from_slice(b"abcdefgh");
    data.extend_from_slice(&((3u32 << 5) | 29).to_le_bytes()); // padding, +3
    data.extend_from_slice(&12u32.to_le_bytes());
    data.extend_from_slice(&[0xee; 8]);
    data.extend_from_slice(&((5u32 << 5) | 31).to_le_bytes()); // stamp
    data.extend_from_slice(&1u32.to_le_bytes()); // (1 << 27) + 5
    data.extend_from_slice(&((2u32 << 5) | 1).to_le_bytes());
    data.extend_from_slice(b"wxyz");
    page[..8].copy_from_slice(&100u64.to_le_bytes());
    page[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
    page[16..16 + data.len()].copy_from_slice(&data);
    let (events, missed) = read_page(&page);
    assert_eq!(missed, None);
    assert_eq!(
        events,
        [
            Read {
                ts: 101,
                data: b"abcdefgh".to_vec()
            },
            Read {
                ts: (1 << 27) + 7,
                data: b"wxyz".to_vec()
            }
        ]
    );
}

/// A field as a format text gives it: (type, name, offset, size, signed).
type FieldText = (String, String, usize, usize, bool);

/// A page read back: its events, and its missed-events mark.
type PageRead = (Vec<Read>, Option<Option<u64>>);

/// A format text's fields: (type, name, offset, size, signed).
fn parse_format(text: &str) -> (String, u16, Vec<FieldText>, String) {
    let mut name = String::new();
    let mut id = 0;
    let mut fields = Vec::new();
    let mut fmt = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name: ") {
            name = n.into();
        } else if let Some(n) = line.strip_prefix("ID: ") {
            id = n.parse().unwrap();
        } else if let Some(f) = line.strip_prefix("print fmt: ") {
            fmt = f.into();
        } else if let Some(f) = line.strip_prefix("\tfield:") {
            let parts: Vec<&str> = f.split(";\t").collect();
            assert_eq!(parts.len(), 4, "{line:?}");
            let decl = parts[0];
            let (ty, nm) = decl.rsplit_once(' ').unwrap();
            let num = |p: &str, key: &str| -> usize {
                p.trim_end_matches(';')
                    .strip_prefix(key)
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            fields.push((
                ty.to_string(),
                nm.to_string(),
                num(parts[1], "offset:"),
                num(parts[2], "size:"),
                num(parts[3], "signed:") == 1,
            ));
        } else {
            assert!(line.is_empty() || line == "format:", "{line:?}");
        }
    }
    (name, id, fields, fmt)
}

#[test]
fn format_texts_parse_as_tracefs_writes_them() {
    // ftrace/function as the kernel shows it.
    let f = format::function().text();
    assert_eq!(
        f,
        "name: function\nID: 1\nformat:\n\
         \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
         \tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;\n\
         \tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;\n\
         \tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\
         \tfield:unsigned long ip;\toffset:8;\tsize:8;\tsigned:0;\n\
         \tfield:unsigned long parent_ip;\toffset:16;\tsize:8;\tsigned:0;\n\n\
         print fmt: \" %ps <-- %ps\", (void *)REC->ip, (void *)REC->parent_ip\n"
    );
    let (_, _, exit, _) = parse_format(&format::funcgraph_exit().text());
    let own: Vec<_> = exit[4..].iter().map(|f| (f.1.as_str(), f.2, f.3)).collect();
    assert_eq!(
        own,
        [
            ("func", 8, 8),
            ("retval", 16, 8),
            ("depth", 24, 4),
            ("overrun", 28, 4),
            ("calltime", 32, 8),
            ("rettime", 40, 8)
        ]
    );
    // A kprobe with every kind of argument, packed after __probe_ip.
    let args = [
        ("dfd".to_string(), ArgField::Int(IntType::X32)),
        ("name".to_string(), ArgField::Str),
        ("n".to_string(), ArgField::Int(IntType::S16)),
        ("c".to_string(), ArgField::Int(IntType::Char)),
    ];
    let k = format::kprobe("kprobes", "myopen", 300, false, &args);
    let (name, id, fields, fmt) = parse_format(&k.text());
    assert_eq!((name.as_str(), id), ("myopen", 300));
    let own: Vec<_> = fields[4..]
        .iter()
        .map(|f| (f.0.as_str(), f.1.as_str(), f.2, f.3, f.4))
        .collect();
    assert_eq!(
        own,
        [
            ("unsigned long", "__probe_ip", 8, 8, false),
            ("u32", "dfd", 16, 4, false),
            ("__data_loc char[]", "name", 20, 4, true),
            ("s16", "n", 24, 2, true),
            ("u8", "c", 26, 1, false)
        ]
    );
    assert_eq!(
        fmt,
        "\"(%lx) dfd=0x%x name=\\\"%s\\\" n=%d c='%c'\", REC->__probe_ip, REC->dfd, \
         __get_str(name), REC->n, REC->c"
    );
    let r = format::kprobe("kprobes", "r", 301, true, &[]);
    assert_eq!(
        r.print_fmt,
        "\"(%lx <- %lx)\", REC->__probe_func, REC->__probe_ret_ip"
    );
    let (_, _, sw, _) = parse_format(&format::sched_switch(302).text());
    let own: Vec<_> = sw[4..].iter().map(|f| (f.1.as_str(), f.2, f.3)).collect();
    assert_eq!(
        own,
        [
            ("prev_comm[16]", 8, 16),
            ("prev_pid", 24, 4),
            ("prev_prio", 28, 4),
            ("prev_state", 32, 8),
            ("next_comm[16]", 40, 16),
            ("next_pid", 56, 4),
            ("next_prio", 60, 4)
        ]
    );
}

/// A whole file read back: formats by id, kallsyms, cmdlines, options,
/// per-CPU events.
struct File {
    formats: HashMap<u16, (String, String, Vec<FieldText>)>,
    kallsyms: String,
    cmdlines: String,
    options: Vec<(u16, Vec<u8>)>,
    cpus: Vec<Vec<PageRead>>,
}

fn read_file(b: &[u8]) -> File {
    let mut c = Cur { b, at: 0 };
    assert_eq!(c.take(10), b"\x17\x08\x44tracing");
    assert_eq!(c.cstr(), "6");
    assert_eq!(c.take(2), [0, 8]);
    assert_eq!(c.u32(), 4096);
    assert_eq!(c.cstr(), "header_page");
    let n = c.u64() as usize;
    assert!(c
        .text(n)
        .contains("field: char data;\toffset:16;\tsize:4080;"));
    assert_eq!(c.cstr(), "header_event");
    let n = c.u64() as usize;
    assert!(c.text(n).contains("time_extend : type == 30"));
    let mut formats = HashMap::new();
    let mut add = |system: &str, text: String| {
        let (name, id, fields, _) = parse_format(&text);
        assert!(formats
            .insert(id, (system.to_string(), name, fields))
            .is_none());
    };
    for _ in 0..c.u32() {
        let n = c.u64() as usize;
        add("ftrace", c.text(n));
    }
    for _ in 0..c.u32() {
        let system = c.cstr();
        for _ in 0..c.u32() {
            let n = c.u64() as usize;
            add(&system, c.text(n));
        }
    }
    let n = c.u32() as usize;
    let kallsyms = c.text(n);
    assert_eq!(c.u32(), 0); // printk
    let n = c.u64() as usize;
    let cmdlines = c.text(n);
    let ncpus = c.u32() as usize;
    assert_eq!(c.take(10), b"options  \0");
    let mut options = Vec::new();
    loop {
        let id = c.u16();
        if id == 0 {
            break;
        }
        let n = c.u32() as usize;
        options.push((id, c.take(n).to_vec()));
    }
    assert_eq!(c.take(10), b"flyrecord\0");
    let mut cpus = Vec::new();
    let mut table = Vec::new();
    for _ in 0..ncpus {
        table.push((c.u64() as usize, c.u64() as usize));
    }
    for (off, size) in table {
        assert_eq!(off % 4096, 0);
        cpus.push(read_pages(&b[off..off + size]));
    }
    File {
        formats,
        kallsyms,
        cmdlines,
        options,
        cpus,
    }
}

/// A record's fields by the format's layout: numbers, or strings for a
/// `__data_loc`.
fn fields_of(f: &File, data: &[u8]) -> (String, BTreeMap<String, String>) {
    let id = u16::from_le_bytes([data[0], data[1]]);
    let (system, name, fields) = &f.formats[&id];
    let mut out = BTreeMap::new();
    for (ty, nm, off, size, _) in fields {
        let raw = &data[*off..*off + *size];
        let v = if ty.starts_with("__data_loc") {
            let loc = u32::from_le_bytes(raw.try_into().unwrap());
            let (at, len) = ((loc & 0xffff) as usize, (loc >> 16) as usize);
            if len == 0 {
                "(fault)".into()
            } else {
                String::from_utf8(data[at..at + len - 1].to_vec()).unwrap()
            }
        } else if *size > 8 {
            // A char array: its bytes up to the NUL.
            String::from_utf8(raw.iter().take_while(|&&c| c != 0).copied().collect()).unwrap()
        } else {
            let mut b = [0u8; 8];
            b[..*size].copy_from_slice(raw);
            format!("{:#x}", u64::from_le_bytes(b))
        };
        out.insert(nm.clone(), v);
    }
    (format!("{system}/{name}"), out)
}

#[test]
fn json_lines_become_the_kernels_events() {
    let spec = "p:kprobes/myopen do_sys_openat2 dfd=%di:s32 filename=+0(%si):string flags=%dx:x32";
    let mut t = TraceDat::new([spec, "not a probe"]);
    let lines = [
        r#"{"ts":"1.0","ts_ns":1000000000,"cpu":1,"pid":90,"comm":"dd","kind":"function","func":"vfs_read","parent":"ksys_read+0x6d/0xf0","ip":"0xffffffff81200000","parent_ip":"0xffffffff8120106d"}"#,
        r#"{"ts":"1.0","ts_ns":1000000500,"cpu":0,"pid":91,"comm":"cat","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81300000","probe":"do_sys_openat2+0x0/0x150","args":{"dfd":-100,"filename":"/etc/hostname","flags":"0x8000"}}"#,
        r#"{"ts":"1.0","ts_ns":1000000600,"cpu":0,"pid":91,"comm":"cat","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81300000","probe":"do_sys_openat2+0x0/0x150","args":{"dfd":3,"filename":null,"flags":"0x0"}}"#,
        r#"{"ts":"1.0","ts_ns":1000002000,"cpu":1,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","ip":"0xffffffff81200000","depth":0,"session":1,"duration_ns":1500,"retval":"0x10"}"#,
        r#"{"ts":"1.0","ts_ns":1000000500,"cpu":1,"pid":90,"comm":"dd","kind":"graph_entry","func":"vfs_read","ip":"0xffffffff81200000","depth":0,"session":1}"#,
        r#"{"ts":"1.0","ts_ns":1000003000,"cpu":1,"pid":90,"comm":"dd","group":"kprobes","event":"ret","kind":"kretprobe","ip":"0xffffffff81200000","ret_ip":"0xffffffff8120106d","probe":"vfs_read+0x0/0x200","args":{"arg1":"0x10","who":"x"}}"#,
        r#"{"kind":"count","calls":3}"#,
        "not json",
    ];
    let text = lines.join("\n") + "\n";
    // Fed in two pieces cut mid-line.
    t.push_text(&text[..100]);
    t.push_text(&text[100..]);
    t.lost(4);
    let mut out = Vec::new();
    let summary = t.write(&mut out, None).unwrap();
    assert_eq!(
        summary,
        TraceDatSummary {
            events: 6,
            cpus: 2,
            bytes: out.len() as u64,
            lost: 4,
            other_lines: 1,
            malformed: 1,
            dropped: 0,
            shortened: 0,
        }
    );
    let f = read_file(&out);
    assert_eq!(f.cmdlines, "90 dd\n91 cat\n");
    assert!(f.kallsyms.contains("ffffffff81200000 t vfs_read\n"));
    assert!(f.kallsyms.contains("ffffffff81201000 t ksys_read\n"));
    assert!(f.kallsyms.contains("ffffffff81300000 t do_sys_openat2\n"));
    assert_eq!(
        f.options,
        [
            (4, b"[local] global\n".to_vec()),
            (8, 2u32.to_le_bytes().to_vec())
        ]
    );
    let cpu = |n: usize| -> Vec<(u64, String, BTreeMap<String, String>)> {
        f.cpus[n]
            .iter()
            .flat_map(|(evs, _)| evs)
            .map(|e| {
                let (name, fields) = fields_of(&f, &e.data);
                (e.ts, name, fields)
            })
            .collect()
    };
    let get = |m: &BTreeMap<String, String>, k: &str| m[k].clone();
    let c0 = cpu(0);
    assert_eq!(c0.len(), 2);
    assert_eq!(c0[0].1, "kprobes/myopen");
    assert_eq!(c0[0].0, 1_000_000_500);
    assert_eq!(get(&c0[0].2, "common_pid"), "0x5b");
    assert_eq!(get(&c0[0].2, "__probe_ip"), "0xffffffff81300000");
    assert_eq!(get(&c0[0].2, "dfd"), "0xffffff9c");
    assert_eq!(get(&c0[0].2, "filename"), "/etc/hostname");
    assert_eq!(get(&c0[0].2, "flags"), "0x8000");
    assert_eq!(get(&c0[1].2, "filename"), "(fault)");
    // CPU 1 in time order: the entry came after its return in the stream.
    let c1 = cpu(1);
    let names: Vec<&str> = c1.iter().map(|e| e.1.as_str()).collect();
    assert_eq!(
        names,
        [
            "ftrace/function",
            "ftrace/funcgraph_entry",
            "ftrace/funcgraph_exit",
            "kprobes/ret"
        ]
    );
    assert_eq!(get(&c1[0].2, "parent_ip"), "0xffffffff8120106d");
    assert_eq!(get(&c1[1].2, "func"), "0xffffffff81200000");
    assert_eq!(
        get(&c1[2].2, "calltime"),
        format!("{:#x}", 1_000_000_500u64)
    );
    assert_eq!(get(&c1[2].2, "rettime"), format!("{:#x}", 1_000_002_000u64));
    assert_eq!(get(&c1[2].2, "retval"), "0x10");
    assert_eq!(get(&c1[3].2, "__probe_func"), "0xffffffff81200000");
    assert_eq!(get(&c1[3].2, "__probe_ret_ip"), "0xffffffff8120106d");
    // A probe the VM did not list: types from its values.
    assert_eq!(get(&c1[3].2, "arg1"), "0x10");
    assert_eq!(get(&c1[3].2, "who"), "x");
    // The loss: a last page on each CPU flagged, with no count.
    for n in 0..2 {
        assert_eq!(f.cpus[n].last().unwrap().1, Some(None));
    }
}

#[test]
fn the_guest_listing_is_used_when_given() {
    let mut t = TraceDat::new([]);
    t.cpus_at_least(3);
    t.push_line(r#"{"ts_ns":5,"cpu":0,"pid":0,"comm":"swapper/0","kind":"graph_entry","func":"f","depth":0}"#);
    let mut out = Vec::new();
    let s = t
        .write(&mut out, Some("ffffffff81000000 T _stext\n".into()))
        .unwrap();
    assert_eq!((s.events, s.cpus), (1, 3));
    let f = read_file(&out);
    assert_eq!(f.kallsyms, "ffffffff81000000 T _stext\n");
    // The idle task is not a saved cmdline.
    assert_eq!(f.cmdlines, "");
    assert!(f.cpus[1].is_empty() && f.cpus[2].is_empty());
}

#[test]
fn scheduler_events_become_the_kernels() {
    let mut t = TraceDat::new([]);
    t.push_text(concat!(
        r#"{"ts":"0","ts_ns":1000,"cpu":1,"pid":52,"comm":"sh","kind":"sched_switch","prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"S","next_comm":"a-very-long-name-x","next_pid":55,"next_prio":100}"#,
        "\n",
        r#"{"ts":"0","ts_ns":2000,"cpu":1,"pid":55,"comm":"dd","kind":"sched_wakeup","target_comm":"sh","target_pid":52,"target_prio":120,"target_cpu":1}"#,
        "\n",
        r#"{"ts":"0","ts_ns":3000,"cpu":1,"pid":52,"comm":"sh","kind":"sched_switch","prev_comm":"sh","prev_pid":52,"prev_prio":120,"prev_state":"nonsense","next_comm":"dd","next_pid":55,"next_prio":100}"#,
        "\n"
    ));
    let mut out = Vec::new();
    let s = t.write(&mut out, None).unwrap();
    // The switch with an unknown state is refused.
    assert_eq!((s.events, s.malformed), (2, 1));
    let f = read_file(&out);
    let events: Vec<(String, BTreeMap<String, String>)> = f.cpus[1]
        .iter()
        .flat_map(|(evs, _)| evs)
        .map(|e| fields_of(&f, &e.data))
        .collect();
    let (name, sw) = &events[0];
    assert_eq!(name, "sched/sched_switch");
    assert_eq!(sw["common_pid"], "0x34");
    assert_eq!(sw["prev_comm[16]"], "sh");
    assert_eq!(sw["prev_state"], "0x1");
    // 15 bytes and the NUL, as the kernel keeps a comm.
    assert_eq!(sw["next_comm[16]"], "a-very-long-nam");
    assert_eq!(
        (sw["next_pid"].as_str(), sw["next_prio"].as_str()),
        ("0x37", "0x64")
    );
    let (name, wk) = &events[1];
    assert_eq!(name, "sched/sched_wakeup");
    assert_eq!(wk["common_pid"], "0x37");
    assert_eq!(
        (wk["comm[16]"].as_str(), wk["pid"].as_str()),
        ("sh", "0x34")
    );
    assert_eq!(
        (wk["prio"].as_str(), wk["target_cpu"].as_str()),
        ("0x78", "0x1")
    );
    // The last comm seen of each pid: 55 woke 52 as dd.
    assert_eq!(f.cmdlines, "52 sh\n55 dd\n");
}

/// The guest chooses its strings and names: a string too long for a page
/// is shortened to fit (and counted), and a comm or symbol with a newline
/// or a space cannot add lines or fields to saved_cmdlines or kallsyms.
#[test]
fn guest_text_cannot_break_the_file() {
    let spec = "p:kprobes/myopen do_sys_openat2 filename=+0(%si):string";
    let mut t = TraceDat::new([spec]);
    let long = "/x".repeat(3000);
    t.push_line(&format!(
        r#"{{"ts_ns":1,"cpu":0,"pid":9,"comm":"evil\n1 init","group":"kprobes","event":"myopen","kind":"kprobe","ip":"0xffffffff81300000","probe":"do_sys_openat2+0x0/0x150","args":{{"filename":"{long}"}}}}"#
    ));
    t.push_line(r#"{"ts_ns":2,"cpu":0,"pid":10,"comm":"x","kind":"function","func":"f\nffffffff81000000 T fake","parent":"g+0x1/0x2","ip":"0x1000","parent_ip":"0x2001"}"#);
    let mut out = Vec::new();
    let s = t.write(&mut out, None).unwrap();
    assert_eq!((s.events, s.shortened, s.dropped), (2, 1, 0));
    let f = read_file(&out);
    assert_eq!(f.cmdlines, "9 evil?1?init\n10 x\n");
    assert!(
        !f.kallsyms
            .lines()
            .any(|l| l.starts_with("ffffffff81000000 T"))
            && f.kallsyms.contains(" f?ffffffff81000000?T?fake\n"),
        "{}",
        f.kallsyms
    );
    let events: Vec<_> = f.cpus[0].iter().flat_map(|(e, _)| e).collect();
    let (_, fields) = fields_of(&f, &events[0].data);
    let name = &fields["filename"];
    assert!(
        name.len() < long.len() && long.starts_with(name.as_str()),
        "{}",
        name.len()
    );
    assert!(events[0].data.len() <= page::MAX_PAYLOAD + 4);
}
