//! Property tests of the kprobe spec parser and everything downstream of
//! it, over mutated specs: nothing panics, every error points inside the
//! spec at the token it names, every accepted probe lists as a spec that
//! parses back to itself, and fetching, encoding, decoding and rendering
//! an accepted probe over random registers and memory never panics; and
//! bytes decoded as event records give back exactly the record they hold,
//! or the reason they are not one.

use std::borrow::Cow;
use std::collections::BTreeMap;

use guest_introspect::addr::Gva;
use tracelang::kprobe::*;
use trampolines::PtRegs;

use test_support::Rng;

const SEEDS: &[&str] = &[
    "p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string",
    "p do_sys_openat2+0 %di %si:u32 $stack3 $arg7",
    "r10:grp/ev foo $retval:s32 +8(+0(%di)):x16",
    "p:ev foo%return $retval",
    "p foo @jiffies @sym+0x10 @sym-8:u8 @0xffffffff81000000",
    "p foo \\-5 \\0x10:s8 \\\"str\" $comm $COMM",
    "p foo +u0(%si):ustring -u4(%bp):b3@2/32 %ip:symbol +0(%di):symstr %cx:char",
    "p foo +0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(%di))))))))))))))",
    "-:grp/ev",
    "-:myopen",
    "r:g.e f a=$stack:x64 b=$stack0:symbol",
];

/// Characters the grammar cares about, and some it does not.
const ALPHABET: &[&str] = &[
    "%",
    "$",
    "@",
    "+",
    "-",
    "u",
    "(",
    ")",
    "\\",
    "\"",
    ":",
    "/",
    "=",
    ".",
    "0",
    "x",
    "9",
    "8",
    " ",
    "\t",
    "a",
    "p",
    "r",
    "di",
    "si",
    "stack",
    "arg",
    "retval",
    "comm",
    "string",
    "symbol",
    "b",
    "[",
    "]",
    "*",
    "é",
    "\u{1f600}",
    "\0",
    "0x10",
    "return",
    "%return",
    "ax",
    "orig_ax",
    "s64",
    "x8",
];

fn mutate(rng: &mut Rng, s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let at = rng.index(chars.len() + 1);
    let (a, b) = chars.split_at(at);
    let a: String = a.iter().collect();
    let b: String = b.iter().collect();
    match rng.index(7) {
        0 => format!("{a}{}{b}", rng.pick(ALPHABET)),
        1 => format!(
            "{a}{}",
            b.chars().skip(1 + rng.index(3)).collect::<String>()
        ),
        2 => a,
        3 => format!("{a}{a}{b}"),
        4 => {
            let other = rng.pick(SEEDS);
            let cut = other
                .char_indices()
                .map(|(i, _)| i)
                .nth(rng.index(other.len()))
                .unwrap_or(0);
            format!("{a}{}", &other[cut..])
        }
        5 => {
            let mut words: Vec<&str> = s.split(' ').collect();
            if words.len() > 1 {
                let i = rng.index(words.len());
                let j = rng.index(words.len());
                words.swap(i, j);
            }
            words.join(" ")
        }
        _ => format!("{a}{}{}{b}", rng.pick(ALPHABET), rng.pick(ALPHABET)),
    }
}

/// Memory that answers from a small map and faults elsewhere.
struct RandMem(BTreeMap<u64, u8>);

impl GuestMem for RandMem {
    fn read(&mut self, gva: Gva, buf: &mut [u8]) -> Result<(), MemFault> {
        assert!(
            (gva.0 & 0xfff) as usize + buf.len() <= 4096,
            "read crosses a page"
        );
        for (i, b) in buf.iter_mut().enumerate() {
            *b = *self.0.get(&gva.0.wrapping_add(i as u64)).ok_or(MemFault)?;
        }
        Ok(())
    }
}

struct Syms;

impl SymbolResolver for Syms {
    fn lookup(&self, name: &str) -> Option<Gva> {
        name.len()
            .is_multiple_of(2)
            .then_some(Gva(0xffff_8880_0000_1000))
    }
    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
        (addr.0 & 1 == 0).then_some(SymbolAt {
            name: Cow::Borrowed("sym"),
            offset: addr.0 & 0xff,
            size: 0x100,
            module: None,
        })
    }
}

fn check_error(spec: &str, e: &ParseError) {
    assert!(e.pos <= spec.len(), "{spec:?}: {e:?}");
    assert!(e.pos + e.len <= spec.len(), "{spec:?}: {e:?}");
    assert!(
        spec.is_char_boundary(e.pos) && spec.is_char_boundary(e.pos + e.len),
        "{spec:?}: {e:?}"
    );
    if e.kind != ParseErrorKind::UsedArgName {
        assert_eq!(&spec[e.pos..e.pos + e.len], e.token, "{spec:?}: {e:?}");
    }
    let line = e.to_string();
    assert!(!line.contains('\n'), "{spec:?}: {line}");
    let _ = e.caret(spec);
    let _ = e.report(spec);
    let _ = e.column(spec);
}

fn exercise(rng: &mut Rng, p: &ProbeSpec) {
    // Listing round trip.
    let listed = p.to_string();
    assert_eq!(parse_probe(&listed).as_ref(), Ok(p), "{listed}");

    // Fetch over random registers and memory.
    let mut mem = RandMem(BTreeMap::new());
    let bases = [
        0x7ffd_0000_1000u64,
        0xffff_8880_0000_1000,
        0xffff_c900_0000_3f00,
        0xffff_8880_0000_1ffc,
    ];
    for _ in 0..64 {
        let a = rng.pick(&bases).wrapping_add(rng.index(64) as u64);
        let v = if rng.index(2) == 0 {
            *rng.pick(&bases)
        } else {
            rng.next() & 0xff
        };
        mem.0.insert(a, v as u8);
    }
    let mut regs = PtRegs::default();
    for r in [
        &mut regs.di,
        &mut regs.si,
        &mut regs.dx,
        &mut regs.ax,
        &mut regs.bp,
        &mut regs.sp,
    ] {
        *r = match rng.index(3) {
            0 => *rng.pick(&bases),
            1 => rng.next(),
            _ => 0,
        };
    }
    let layout = if rng.index(2) == 0 {
        GuestLayout::X86_64_4LEVEL
    } else {
        GuestLayout::X86_64_5LEVEL
    };
    let ctx = FetchContext {
        regs: &regs,
        comm: (rng.index(4) != 0).then_some(b"sh".as_slice()),
        layout,
        entry_args: None,
    };
    let values = fetch(&p.args, &ctx, &mut mem, &Syms);
    assert_eq!(values.len(), p.args.len());

    // Ring record round trip and rendering.
    let mut ev = RawEvent {
        header: EventHeader {
            pid: rng.index(3) as i32,
            ip: rng.next(),
            ..Default::default()
        },
        values,
    };
    ev.header.set_comm(b"sh");
    let bytes = ev.encode();
    let (back, n) = RawEvent::decode(&bytes).expect("own record decodes");
    assert_eq!((back.clone(), n), (ev, bytes.len()));
    let text = text_line(p, &back, &Syms);
    assert!(text.contains(&format!(" {}: (", p.event)), "{text}");
    let json = json_line(p, &back, &Syms);
    assert!(json.starts_with('{') && json.ends_with('}'), "{json}");
}

#[test]
fn mutated_specs_never_panic_and_errors_point_into_the_spec() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for &seed in SEEDS {
        let mut spec = seed.to_string();
        for i in 0..4000 {
            if i % 50 == 0 {
                spec = seed.to_string();
            }
            spec = mutate(&mut rng, &spec);
            match parse(&spec) {
                Ok(Command::Add(p)) => {
                    accepted += 1;
                    exercise(&mut rng, &p);
                }
                Ok(Command::Delete(d)) => {
                    accepted += 1;
                    assert!(d.group.is_some() || d.event.is_some());
                }
                Err(e) => {
                    refused += 1;
                    check_error(&spec, &e);
                }
            }
        }
    }
    // Both sides of the grammar were exercised.
    assert!(
        accepted > 1000 && refused > 1000,
        "accepted {accepted}, refused {refused}"
    );
}

#[test]
fn every_short_argument_over_the_alphabet() {
    let atoms: Vec<&str> = ALPHABET
        .iter()
        .copied()
        .filter(|a| !a.contains([' ', '\t']))
        .collect();
    let mut rng = Rng(7);
    let mut n = 0;
    for a in &atoms {
        for b in &atoms {
            for c in &atoms {
                let spec = format!("p foo {a}{b}{c}");
                match parse(&spec) {
                    Ok(Command::Add(p)) => exercise(&mut rng, &p),
                    Ok(Command::Delete(_)) => unreachable!(),
                    Err(e) => check_error(&spec, &e),
                }
                n += 1;
            }
        }
    }
    assert!(n > 50_000);
}

/// A random event whose values read back as written: integers within their
/// width, strings far shorter than a record's limit.
fn random_event(rng: &mut Rng) -> RawEvent {
    let values = (0..rng.index(6))
        .map(|_| match rng.index(5) {
            0 => FetchedValue::Fault,
            1 => {
                let ty = *rng.pick(&IntType::ALL);
                let value = rng.next() & (u64::MAX >> (64 - 8 * ty.size()));
                FetchedValue::Int { ty, value }
            }
            2 => FetchedValue::Str((0..rng.index(24)).map(|_| rng.next() as u8).collect()),
            3 => FetchedValue::Symbol(rng.next()),
            _ => FetchedValue::SymStr(rng.next()),
        })
        .collect();
    let mut ev = RawEvent {
        header: EventHeader {
            probe_id: rng.next() as u32,
            cpu: rng.index(4) as u32,
            pid: rng.next() as i32,
            timestamp_ns: rng.next(),
            ip: rng.next(),
            ret_ip: rng.next(),
            ..Default::default()
        },
        values,
    };
    ev.header.set_comm(b"kworker/0:1");
    ev
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Bytes read as records: random ones (half of them behind a plausible
/// header), and records of random events with a few bytes changed, cut
/// short or followed by more. Decoding never panics, and an event's record
/// decodes to it. What decoding accepts is the record the bytes hold: the
/// header's length, within the bytes, nothing past it read, the header's
/// fields and value count; and that event encodes to a record that decodes
/// to it again. A refusal names the first check of the header that fails,
/// or else a bad value.
#[test]
fn bytes_as_records_decode_to_what_they_hold() {
    let mut rng = Rng(42);
    let (mut accepted, mut refused) = (0usize, 0usize);
    for i in 0..20_000 {
        let b = if i % 2 == 0 {
            let len = rng.index(200);
            let mut b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if len >= 8 && rng.index(2) == 0 {
                // Plausible headers reach the value decoder.
                b[0] = EVENT_VERSION;
                let total = (len as u32) & !7;
                b[4..8].copy_from_slice(&total.to_le_bytes());
            }
            b
        } else {
            let ev = random_event(&mut rng);
            let mut b = ev.encode();
            assert_eq!(RawEvent::decode(&b), Ok((ev, b.len())));
            for _ in 0..rng.index(3) {
                let at = rng.index(b.len());
                b[at] = rng.next() as u8;
            }
            match rng.index(4) {
                0 => b.truncate(rng.index(b.len() + 1)),
                1 => b.extend((0..rng.index(40)).map(|_| rng.next() as u8)),
                _ => {}
            }
            b
        };
        match RawEvent::decode(&b) {
            Ok((ev, n)) => {
                accepted += 1;
                assert_eq!(b[0], EVENT_VERSION);
                assert_eq!(Some(n as u32), u32_at(&b, 4));
                assert!(
                    n >= HEADER_LEN && n.is_multiple_of(8) && n <= b.len(),
                    "a record of {n} bytes out of {}",
                    b.len()
                );
                assert_eq!(
                    ev.values.len(),
                    usize::from(u16::from_le_bytes([b[2], b[3]]))
                );
                assert_eq!(Some(ev.header.probe_id), u32_at(&b, 8));
                let ts = u64::from_le_bytes(b[TIMESTAMP_AT..TIMESTAMP_AT + 8].try_into().unwrap());
                assert_eq!(ev.header.timestamp_ns, ts);
                assert_eq!(RawEvent::decode(&b[..n]), Ok((ev.clone(), n)));
                let again = ev.encode();
                assert!(
                    again.len() <= n,
                    "{} bytes re-encoded from {n}",
                    again.len()
                );
                assert_eq!(RawEvent::decode(&again), Ok((ev, again.len())));
            }
            Err(e) => {
                refused += 1;
                let header = match (b.first(), u32_at(&b, 4)) {
                    (None, _) => Some(DecodeError::Truncated),
                    (Some(&v), _) if v != EVENT_VERSION => Some(DecodeError::Version(v)),
                    (_, None) => Some(DecodeError::Truncated),
                    (_, Some(total)) if (total as usize) < HEADER_LEN || total % 8 != 0 => {
                        Some(DecodeError::BadLength)
                    }
                    (_, Some(total)) if total as usize > b.len() => Some(DecodeError::Truncated),
                    _ => None,
                };
                match header {
                    Some(want) => assert_eq!(e, want, "{b:02x?}"),
                    None => assert!(
                        matches!(e, DecodeError::BadTag(_) | DecodeError::Overrun),
                        "{e:?} for a sound header: {b:02x?}"
                    ),
                }
            }
        }
    }
    // Both sides were exercised.
    assert!(
        accepted > 1000 && refused > 1000,
        "accepted {accepted}, refused {refused}"
    );
}
