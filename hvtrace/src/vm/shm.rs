//! The host's end of root's trace ring under QEMU: guest RAM comes from a
//! file the host maps too (`-object memory-backend-file,...,share=on`), and
//! root's ring lives in hypervisor memory inside that RAM, outside the
//! guest's e820 and absent from EPT, so the guest never sees it. The ring
//! itself (layout, indices, the producer's and the consumer's rules) is
//! `protocol::ring`, the code root writes with.
//!
//! Where a guest-physical address lies in the file depends on the machine
//! type: QEMU puts the RAM below the PCI hole first, and the rest from
//! 4 GiB up ([`file_offset`]).

use anyhow::{bail, Context, Result};
use protocol::ring::{Ring, RingError};
use protocol::Event;
use std::borrow::Borrow;
use tracelang::render::RingsReader;

/// QEMU's machine types, for the RAM layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MachineType {
    /// `q35`: RAM below 4 GiB is all of it when under 2.75 GiB, else 2 GiB.
    Q35,
    /// `pc` (i440FX): all of it when under 3.5 GiB, else 3.5 GiB.
    Pc,
}

const GIB: u64 = 1 << 30;

impl MachineType {
    /// Bytes of RAM QEMU maps below 4 GiB for `ram` bytes of RAM.
    pub fn below_4g(self, ram: u64) -> u64 {
        let (limit, split) = match self {
            MachineType::Q35 => (0xb000_0000, 0x8000_0000),
            MachineType::Pc => (0xe000_0000, 0xe000_0000),
        };
        if ram >= limit {
            split
        } else {
            ram
        }
    }
}

/// The offset in the RAM file of guest-physical address `gpa`, for a
/// machine of `ram` bytes; `None` when no RAM is there (the PCI hole,
/// past the end).
pub fn file_offset(machine: MachineType, ram: u64, gpa: u64) -> Option<u64> {
    let low = machine.below_4g(ram);
    if gpa < low {
        return Some(gpa);
    }
    let high = gpa.checked_sub(4 * GIB)?;
    let offset = low.checked_add(high)?;
    (offset < ram).then_some(offset)
}

/// Takes every record the ring holds, oldest first; returns how many.
pub fn drain(ring: &Ring, buf: &mut Vec<u8>, mut f: impl FnMut(&[u8])) -> Result<usize> {
    let mut n = 0;
    loop {
        match ring.pop(buf) {
            Ok(true) => {
                f(buf);
                n += 1;
            }
            Ok(false) => return Ok(n),
            Err(RingError::Corrupt) => bail!("the trace ring holds a record that cannot be right"),
            Err(RingError::NotARing) => bail!("not a trace ring"),
        }
    }
}

/// The host's side of [`protocol::TraceChannel::SharedRings`]: root's
/// frame ring and the vCPUs' record rings, read in the order that keeps
/// each record after the context it needs: [`RingsPoll::frames`] takes the
/// record rings' marks, then reads the frames; [`RingsPoll::records`] then
/// takes the records up to those marks, oldest first across the vCPUs, and
/// passes on root's last clock once the rings are empty.
pub struct RingsPoll<R: Borrow<Ring>> {
    frames: R,
    reader: RingsReader<R>,
    buf: Vec<u8>,
    decoder: protocol::FrameDecoder,
    frames_lost: u64,
    /// Root's clock from its last idle event, not passed on yet.
    idle: Option<u64>,
    /// The frame ring dropped frames: records wait for a whole context
    /// again (root sends one once the ring has room), since when.
    context_wait: Option<std::time::Instant>,
}

/// How long records wait for a whole context after the frame ring dropped
/// frames, at most.
const CONTEXT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl<R: Borrow<Ring>> RingsPoll<R> {
    /// A reader of `frames` and of `records` (root's vCPU order), whose
    /// records carry their timestamp at `stamp_at`.
    pub fn new(frames: R, records: Vec<R>, stamp_at: usize) -> Self {
        RingsPoll {
            frames,
            reader: RingsReader::new(records, stamp_at),
            buf: Vec::new(),
            decoder: protocol::FrameDecoder::new(),
            frames_lost: 0,
            idle: None,
            context_wait: None,
        }
    }

    /// Whether records should wait: the frame ring dropped frames and no
    /// whole context came since (for [`CONTEXT_WAIT`] at most).
    pub fn waiting_for_context(&mut self) -> bool {
        match self.context_wait {
            Some(since) if since.elapsed() < CONTEXT_WAIT => true,
            _ => {
                self.context_wait = None;
                false
            }
        }
    }

    /// Takes the record rings' marks, then every frame: the events the
    /// stream carries go to `out`, frames the ring dropped as `Lost`; root's
    /// idle events are kept for [`Self::records`] when the host takes the
    /// records (`consuming`), and go to `out` at once when root drains the
    /// rings itself. Returns the marks.
    pub fn frames(&mut self, consuming: bool, out: &mut dyn FnMut(Event)) -> Result<Vec<u64>> {
        let mark = self.reader.mark();
        let decoder = &mut self.decoder;
        let idle = &mut self.idle;
        let context_wait = &mut self.context_wait;
        if !consuming {
            // Held over from when the host took the records.
            if let Some(now_ns) = idle.take() {
                out(Event::TraceRecords {
                    lost: 0,
                    now_ns,
                    data: Vec::new(),
                });
            }
        }
        drain(self.frames.borrow(), &mut self.buf, |record| {
            for frame in decoder.feed(record).flatten() {
                match frame.body {
                    protocol::Body::Event(Event::TraceRecords { now_ns, data, .. })
                        if data.is_empty() && consuming =>
                    {
                        *idle = Some(now_ns);
                    }
                    protocol::Body::Event(
                        ev @ (Event::TraceText { .. }
                        | Event::TraceRecords { .. }
                        | Event::TraceContext(_)
                        | Event::SymbolChunk { .. }),
                    ) => {
                        if matches!(ev, Event::TraceContext(protocol::RenderContext::End)) {
                            *context_wait = None;
                        }
                        out(ev)
                    }
                    _ => {}
                }
            }
        })
        .context("the shared frame ring")?;
        let lost = self.frames.borrow().lost();
        if lost > self.frames_lost {
            self.context_wait = Some(std::time::Instant::now());
            out(Event::Lost {
                count: lost - self.frames_lost,
            });
            self.frames_lost = lost;
        }
        Ok(mark)
    }

    /// Whether every record ring is empty now.
    pub fn reader_is_empty(&self) -> bool {
        self.reader.is_empty()
    }

    /// Records the record rings dropped (full), in all.
    pub fn records_lost(&self) -> u64 {
        self.reader.lost()
    }

    /// Takes the records written before `mark` into `out` as
    /// `TraceRecords` events, then root's last clock as an empty one once
    /// nothing older is left in the rings ([`RingsReader::caught_up`]).
    /// Returns how many records.
    pub fn records(&mut self, mark: &[u64], out: &mut dyn FnMut(Event)) -> Result<usize> {
        let mut events = Vec::new();
        let taken = self.reader.take(mark, &mut events);
        for ev in events {
            out(ev);
        }
        let n = taken.map_err(|e| anyhow::anyhow!("the record rings: {e:?}"))?;
        if let Some(now_ns) = self.idle.filter(|&t| self.reader.caught_up(t)) {
            self.idle = None;
            out(Event::TraceRecords {
                lost: 0,
                now_ns,
                data: Vec::new(),
            });
        }
        Ok(n)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sys::SharedMap;
    use std::time::{Duration, Instant};

    #[test]
    fn ram_file_offsets_around_the_pci_hole() {
        let mib = 1 << 20;
        // Small machines: RAM is where it is.
        for m in [MachineType::Q35, MachineType::Pc] {
            assert_eq!(file_offset(m, 512 * mib, 2 * mib), Some(2 * mib));
            assert_eq!(file_offset(m, 512 * mib, 512 * mib), None);
        }
        // q35 with 4 GiB: 2 GiB below, 2 GiB from 4 GiB up.
        let q = MachineType::Q35;
        assert_eq!(file_offset(q, 4 * GIB, 2 * GIB - 1), Some(2 * GIB - 1));
        assert_eq!(file_offset(q, 4 * GIB, 3 * GIB), None, "the PCI hole");
        assert_eq!(file_offset(q, 4 * GIB, 4 * GIB), Some(2 * GIB));
        assert_eq!(file_offset(q, 4 * GIB, 6 * GIB - 1), Some(4 * GIB - 1));
        assert_eq!(file_offset(q, 4 * GIB, 6 * GIB), None);
        // q35 just under its limit keeps all of it low.
        assert_eq!(q.below_4g(0xafff_0000), 0xafff_0000);
        // pc with 4 GiB: 3.5 GiB below.
        let p = MachineType::Pc;
        assert_eq!(file_offset(p, 4 * GIB, 3 * GIB), Some(3 * GIB));
        assert_eq!(file_offset(p, 4 * GIB, 0xe000_0000), None);
        assert_eq!(file_offset(p, 4 * GIB, 4 * GIB), Some(0xe000_0000));
    }

    /// A record of the writer: its number, then bytes that follow from it.
    fn record(seq: u64) -> Vec<u8> {
        let len = 8 + (seq * 7919 % 600) as usize;
        let mut r = seq.to_le_bytes().to_vec();
        r.extend((8..len).map(|i| (seq as usize).wrapping_mul(31).wrapping_add(i) as u8));
        r
    }

    /// A file of `len` bytes in a directory of its own, for a test's
    /// shared ring(s): the directory, and the file open.
    pub(crate) fn shared_file(name: &str, len: usize) -> (std::path::PathBuf, std::fs::File) {
        let dir = std::env::temp_dir().join(format!("hvtrace-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("ram"))
            .unwrap();
        file.set_len(len as u64).unwrap();
        (dir, file)
    }

    /// This test binary again, running test `test` alone as the writer
    /// (told the file through `env`), its output piped.
    fn spawn_writer(test: &str, env: &str, dir: &std::path::Path) -> std::process::Child {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env, dir.join("ram"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The writer's closing line (`TAG ... N dropped`), after it ended
    /// well: the line and N.
    fn writer_dropped(
        child: &mut std::process::Child,
        status: Option<std::process::ExitStatus>,
        tag: &str,
    ) -> (String, u64) {
        assert!(status.unwrap().success());
        let mut text = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut text).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.find(tag).map(|at| l[at..].to_string()))
            .unwrap_or_else(|| panic!("no writer line in {text}"));
        let dropped = line
            .split_whitespace()
            .rev()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap();
        (line, dropped)
    }

    const WRITER_ENV: &str = "HVTRACE_TEST_RING_WRITER";
    const RECORDS: u64 = 200_000;
    const RING_LEN: usize = 64 + 64 * 1024;

    /// The other process: writes RECORDS records in bursts of 1000 with a
    /// pause between them, counting what did not fit, then says so.
    fn writer(path: &str) {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let map = SharedMap::map(&file, RING_LEN).unwrap();
        let ring = map.ring(0, RING_LEN, false).unwrap();
        let mut dropped = 0u64;
        for seq in 0..RECORDS {
            if !ring.push(&record(seq)) {
                dropped += 1;
            }
            if seq % 1000 == 999 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        println!("ring writer: {RECORDS} pushed, {dropped} dropped");
    }

    #[test]
    fn a_writer_and_a_reader_in_two_processes_share_the_ring() {
        if let Ok(path) = std::env::var(WRITER_ENV) {
            writer(&path);
            return;
        }
        let (dir, file) = shared_file("ring", RING_LEN);
        let map = SharedMap::map(&file, RING_LEN).unwrap();
        let ring = map.ring(0, RING_LEN, true).unwrap();
        let child = spawn_writer(
            "vm::shm::tests::a_writer_and_a_reader_in_two_processes_share_the_ring",
            WRITER_ENV,
            &dir,
        );
        let mut got = 0u64;
        let mut last: Option<u64> = None;
        let mut buf = Vec::new();
        let start = Instant::now();
        let mut slow = true;
        let mut child = child;
        let mut status = None;
        loop {
            let n = drain(&ring, &mut buf, |r| {
                let seq = u64::from_le_bytes(r[..8].try_into().unwrap());
                assert_eq!(r, record(seq).as_slice(), "record {seq} torn");
                assert!(last.is_none_or(|l| seq > l), "record {seq} after {last:?}");
                last = Some(seq);
                got += 1;
            })
            .unwrap();
            if n == 0 {
                if status.is_none() {
                    status = child.try_wait().unwrap();
                }
                // The writer is done and the ring is empty.
                if status.is_some() && got + ring.lost() >= RECORDS {
                    break;
                }
            }
            // A slow reader for the first half second, then a fast one.
            if slow {
                std::thread::sleep(Duration::from_millis(2));
                slow = start.elapsed() < Duration::from_millis(500);
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the writer stalled"
            );
        }
        let (line, dropped) = writer_dropped(&mut child, status, "ring writer:");
        println!(
            "ring: {got} records read whole and in order, {dropped} lost (slow reader first), in {:.2} s",
            start.elapsed().as_secs_f64()
        );
        // Every record arrived whole or was counted lost, by both sides.
        assert_eq!(ring.lost(), dropped, "{line}");
        assert_eq!(got + dropped, RECORDS, "{line}");
        assert_eq!(ring.records(), got);
        assert!(dropped > 0, "the slow reader lost records ({line})");
        assert!(
            got > RECORDS / 10,
            "the fast reader kept up for a while ({line})"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    const RINGS_ENV: &str = "HVTRACE_TEST_RINGS_WRITER";
    /// Records each "vCPU" writes.
    const PER_VCPU: u64 = 60_000;
    const VCPUS: usize = 2;
    const FRAMES_LEN: usize = 64 + 16 * 1024;
    const RECORD_RING_LEN: usize = 64 + 32 * 1024;
    const STAMP_AT: usize = 8;

    fn rings_layout() -> (usize, Vec<usize>, usize) {
        let records: Vec<usize> = (0..VCPUS)
            .map(|i| FRAMES_LEN + i * RECORD_RING_LEN)
            .collect();
        (0, records, FRAMES_LEN + VCPUS * RECORD_RING_LEN)
    }

    /// A record of vCPU `cpu`: its number, the shared clock, then bytes
    /// that follow from both.
    fn stamped(cpu: u64, seq: u64, ts: u64) -> Vec<u8> {
        let len = 16 + (seq * 131 % 200) as usize;
        let mut r = ((cpu << 56) | seq).to_le_bytes().to_vec();
        r.extend_from_slice(&ts.to_le_bytes());
        r.extend((16..len).map(|i| (seq as usize ^ i) as u8));
        r
    }

    /// The other process: root as the tracer runs it, in miniature. Each
    /// vCPU thread writes its own record ring, stamping records from one
    /// clock; every 5,000 records vCPU 0 writes an idle event (root's
    /// clock) to the frame ring, as root's turns do.
    fn rings_writer(path: &str) {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let (frames_at, records_at, total) = rings_layout();
        let map = SharedMap::map(&file, total).unwrap();
        let clock = std::sync::atomic::AtomicU64::new(1);
        let frames = map.ring(frames_at, FRAMES_LEN, false).unwrap();
        let dropped: Vec<u64> = std::thread::scope(|scope| {
            let handles: Vec<_> = records_at
                .iter()
                .enumerate()
                .map(|(cpu, &at)| {
                    let map = &map;
                    let clock = &clock;
                    let frames = &frames;
                    scope.spawn(move || {
                        let ring = map.ring(at, RECORD_RING_LEN, false).unwrap();
                        let mut dropped = 0;
                        let mut wire = Vec::new();
                        for seq in 0..PER_VCPU {
                            let ts = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            if !ring.push(&stamped(cpu as u64, seq, ts)) {
                                dropped += 1;
                            }
                            if seq % 100 == 99 {
                                std::thread::sleep(Duration::from_millis(3));
                            }
                            if cpu == 0 && seq % 5000 == 4999 {
                                let idle = protocol::Frame::event(
                                    (seq / 5000) as u32,
                                    Event::TraceRecords {
                                        lost: 0,
                                        now_ns: ts,
                                        data: Vec::new(),
                                    },
                                );
                                wire.clear();
                                protocol::encode(&idle, &mut wire).unwrap();
                                assert!(frames.push(&wire));
                            }
                        }
                        dropped
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        println!(
            "rings writer: {} records, {} dropped",
            PER_VCPU * VCPUS as u64,
            dropped.iter().sum::<u64>()
        );
    }

    /// The host's reader of root's record rings (the one the supervisor
    /// runs) against rings written by the same ring code in another
    /// process: each vCPU's records arrive whole and in its order, each
    /// take is merged oldest first across the vCPUs, root's clock comes
    /// through once the rings are empty, and every record the reader did
    /// not get is counted lost by the writer.
    #[test]
    fn the_host_reads_every_vcpus_ring_from_another_process() {
        if let Ok(path) = std::env::var(RINGS_ENV) {
            rings_writer(&path);
            return;
        }
        let (frames_at, records_at, total) = rings_layout();
        let (dir, file) = shared_file("rings", total);
        let map = SharedMap::map(&file, total).unwrap();
        let frames = map.ring(frames_at, FRAMES_LEN, true).unwrap();
        let rings: Vec<_> = records_at
            .iter()
            .map(|&at| map.ring(at, RECORD_RING_LEN, true).unwrap())
            .collect();
        let child = spawn_writer(
            "vm::shm::tests::the_host_reads_every_vcpus_ring_from_another_process",
            RINGS_ENV,
            &dir,
        );
        let mut child = child;
        let mut poll = RingsPoll::new(frames, rings, STAMP_AT);
        let mut next = [0u64; VCPUS];
        let mut got = [0u64; VCPUS];
        let mut idles = Vec::new();
        let mut takes_merged = 0;
        let start = Instant::now();
        let mut status = None;
        loop {
            let mark = poll
                .frames(true, &mut |ev| panic!("unexpected frame {ev:?}"))
                .unwrap();
            let mut stamps = Vec::new();
            let mut events = Vec::new();
            poll.records(&mark, &mut |ev| events.push(ev)).unwrap();
            let mut lost = 0;
            for ev in events {
                match ev {
                    Event::TraceRecords { data, now_ns, .. } if data.is_empty() => {
                        idles.push(now_ns)
                    }
                    Event::TraceRecords { data, lost: l, .. } => {
                        lost += l;
                        let mut rest = data.as_slice();
                        while let Some((head, tail)) = rest.split_first_chunk::<4>() {
                            let len = u32::from_le_bytes(*head) as usize;
                            let (r, tail) = tail.split_at(len);
                            rest = tail;
                            let id = u64::from_le_bytes(r[..8].try_into().unwrap());
                            let (cpu, seq) = ((id >> 56) as usize, id & ((1 << 56) - 1));
                            let ts = u64::from_le_bytes(r[8..16].try_into().unwrap());
                            assert_eq!(r, stamped(cpu as u64, seq, ts).as_slice(), "torn");
                            assert!(seq >= next[cpu], "vCPU {cpu}: {seq} after {}", next[cpu]);
                            next[cpu] = seq + 1;
                            got[cpu] += 1;
                            stamps.push(ts);
                        }
                    }
                    Event::Lost { count } => lost += count,
                    other => panic!("the reader made {other:?}"),
                }
            }
            let _ = lost;
            assert!(stamps.is_sorted(), "one take is merged oldest first");
            if stamps.len() > 1 {
                takes_merged += 1;
            }
            if stamps.is_empty() {
                if status.is_none() {
                    status = child.try_wait().unwrap();
                }
                if status.is_some() && poll.reader_is_empty() {
                    // One more look at the frames, for the last idle event.
                    let mark = poll.frames(true, &mut |ev| panic!("{ev:?}")).unwrap();
                    poll.records(&mark, &mut |ev| {
                        if let Event::TraceRecords { now_ns, .. } = ev {
                            idles.push(now_ns)
                        }
                    })
                    .unwrap();
                    break;
                }
            }
            // A slow reader for the first half second, then a fast one.
            let slow = start.elapsed() < Duration::from_millis(500);
            std::thread::sleep(Duration::from_millis(if slow { 20 } else { 1 }));
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the writer stalled"
            );
        }
        let (line, dropped) = writer_dropped(&mut child, status, "rings writer:");
        let read: u64 = got.iter().sum();
        println!(
            "rings: {read} records read from {VCPUS} rings, {dropped} lost (slow reader first), {takes_merged} merged takes, {} idle events, in {:.2} s",
            idles.len(),
            start.elapsed().as_secs_f64()
        );
        assert_eq!(read + dropped, PER_VCPU * VCPUS as u64, "{line}");
        assert_eq!(
            poll.records_lost(),
            dropped,
            "both sides count the same losses"
        );
        assert!(dropped > 0, "the slow reader lost records ({line})");
        assert!(got.iter().all(|&g| g > PER_VCPU / 10), "{got:?}");
        assert!(!idles.is_empty() && idles.is_sorted(), "{idles:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
