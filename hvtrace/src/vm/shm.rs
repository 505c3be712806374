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

use anyhow::{bail, Result};
use protocol::ring::{Ring, RingError};

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

#[cfg(test)]
mod tests {
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
        let dir = std::env::temp_dir().join(format!("hvtrace-ring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ram");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(RING_LEN as u64).unwrap();
        let map = SharedMap::map(&file, RING_LEN).unwrap();
        let ring = map.ring(0, RING_LEN, true).unwrap();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "vm::shm::tests::a_writer_and_a_reader_in_two_processes_share_the_ring",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WRITER_ENV, &path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
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
        assert!(status.unwrap().success());
        let mut text = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut text).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.find("ring writer:").map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("no writer line in {text}"));
        let dropped: u64 = line
            .split_whitespace()
            .rev()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap();
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
}
