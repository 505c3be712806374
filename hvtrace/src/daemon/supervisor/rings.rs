//! The trace stream's own paths, far faster than COM2: the hypervisor's
//! log port, which the VM reads, and, under QEMU with KVM, the rings in
//! guest RAM (root's frame ring and every vCPU's record ring), which a
//! thread of the supervisor reads from the file behind the guest's RAM.
//! A ring that cannot be trusted is given back to root, and the stream
//! goes back to COM2.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{Event, Request, Response, TraceChannel};

use super::{note_at, Supervisor};
use crate::vm::VmWatch;

/// How often the ring reader looks at root's rings without a doorbell.
pub(super) const RING_POLL: Duration = Duration::from_millis(10);
/// How often the reader of the frame ring alone (root drains its rings
/// into it, and rings no doorbell) looks at it.
const FRAME_RING_POLL: Duration = Duration::from_millis(2);
/// How long records wait for a copy of the modules' symbols at most.
const MODULES_HOLD: Duration = Duration::from_secs(2);
/// How long records wait in a row at most (copies after copies).
const HOLD_IN_A_ROW: Duration = Duration::from_secs(10);

impl Supervisor {
    /// Asks the hypervisor to send the trace stream on the log port, which
    /// this process reads (far faster than COM2); on any failure the
    /// stream stays on COM2.
    pub(super) fn use_log_port(&self, watch: VmWatch) {
        let Some(link) = self.link.get() else {
            return;
        };
        match link.request(Request::TraceChannel {
            channel: TraceChannel::LogPort,
        }) {
            Ok(Response::Ok) => {
                let _ = self.trace_port.set(watch);
                self.bulk.store(true, Ordering::Relaxed);
                self.note("the trace stream takes the log port");
            }
            Ok(other) => self.note(&format!(
                "the trace stream stays on the control channel: the hypervisor answered {other:?}"
            )),
            Err(e) => self.note(&format!(
                "the trace stream stays on the control channel: {e}"
            )),
        }
    }

    /// Asks the hypervisor to put the trace stream in a ring in its memory,
    /// which this process reads from the file behind the guest's RAM, and
    /// starts the thread that drains it. On any failure the caller falls
    /// back to the log port.
    pub(super) fn use_ring(
        self: &Arc<Self>,
        file: &std::fs::File,
        machine: crate::vm::shm::MachineType,
        ram: u64,
        watch: VmWatch,
    ) -> bool {
        let Some(link) = self.link.get() else {
            return false;
        };
        let rings = link.request(Request::TraceChannel {
            channel: TraceChannel::SharedRings,
        });
        match rings {
            Ok(Response::TraceRings {
                frames,
                records,
                stamp_at,
            }) if !records.is_empty() => match self.read_rings(
                file,
                machine,
                ram,
                frames,
                &records,
                stamp_at,
                watch.clone(),
            ) {
                Ok(()) => return true,
                Err(e) => self.note(&format!("the record rings cannot be read: {e}")),
            },
            other => self.note(&format!("no record rings to read: {other:?}")),
        }
        // The frame ring alone: root drains its rings into it.
        let frames = match link.request(Request::TraceChannel {
            channel: TraceChannel::SharedRing,
        }) {
            Ok(Response::TraceRing { gpa, len }) => protocol::RingAt { gpa, len },
            other => {
                self.note(&format!("no shared trace ring: {other:?}"));
                return false;
            }
        };
        match self.read_rings(file, machine, ram, frames, &[], 0, watch) {
            Ok(()) => true,
            Err(e) => {
                self.note(&format!("the shared trace ring cannot be read: {e}"));
                false
            }
        }
    }

    /// Reads root's frame ring and every vCPU's record ring from the RAM
    /// file ([`TraceChannel::SharedRings`]): a thread takes, each time the
    /// doorbell rings or every [`RING_POLL`], the rings' marks, then the
    /// frames, then (while the stream is in records and no copy of the
    /// modules' symbols is on its way) the records up to the marks. With
    /// no record ring ([`TraceChannel::SharedRing`]: root drains its rings
    /// into the frame ring) it reads the frames alone, every
    /// [`FRAME_RING_POLL`].
    #[allow(clippy::too_many_arguments)]
    fn read_rings(
        self: &Arc<Self>,
        file: &std::fs::File,
        machine: crate::vm::shm::MachineType,
        ram: u64,
        frames: protocol::RingAt,
        records: &[protocol::RingAt],
        stamp_at: u32,
        watch: VmWatch,
    ) -> Result<(), String> {
        let map = crate::sys::SharedMap::map(file, ram as usize)
            .map_err(|e| format!("cannot map the guest's RAM file: {e}"))?;
        let place = |r: &protocol::RingAt| -> Result<(usize, usize), String> {
            let at = crate::vm::shm::file_offset(machine, ram, r.gpa)
                .filter(|&at| at.checked_add(r.len).is_some_and(|end| end <= ram))
                .ok_or_else(|| format!("the ring at {:#x} is not in the RAM file", r.gpa))?;
            map.ring(at as usize, r.len as usize, false)
                .map_err(|e| format!("no ring at {:#x}: {e:?}", r.gpa))?;
            Ok((at as usize, r.len as usize))
        };
        let frames_at = place(&frames)?;
        let records_at = records.iter().map(place).collect::<Result<Vec<_>, _>>()?;
        let trace = self.trace.clone();
        let start = self.start;
        let n = records_at.len();
        self.bulk.store(true, Ordering::Relaxed);
        self.rings_reader.store(n > 0, Ordering::Relaxed);
        self.channel_rings.store(n > 0, Ordering::Relaxed);
        let every = if n > 0 { RING_POLL } else { FRAME_RING_POLL };
        let sup = Arc::downgrade(self);
        self.frame_reader.store(true, Ordering::Relaxed);
        std::thread::spawn(move || {
            let note = |m: &str| note_at(start, m);
            let ring = |(at, len): (usize, usize)| map.ring(at, len, false);
            let Ok(frames) = ring(frames_at) else { return };
            let Ok(rings) = records_at
                .into_iter()
                .map(ring)
                .collect::<Result<Vec<_>, _>>()
            else {
                return;
            };
            let mut poll = crate::vm::shm::RingsPoll::new(frames, rings, stamp_at as usize);
            let mut rung = 0;
            let mut on = |ev: Event| trace.on_event(ev, &note);
            let failed = |why: String| {
                note(&format!("{why}; the rings are no longer read"));
                *trace.host_reads_lock() = false;
                if let Some(sup) = sup.upgrade() {
                    sup.give_up_rings();
                }
            };
            // The copy of the modules' symbols records wait for, and since
            // when; and since when they have waited without a break.
            let mut held: Option<(u32, Instant)> = None;
            let mut holding_since: Option<Instant> = None;
            loop {
                let ended = watch.ended().is_some();
                // The consumer's lock is held from the marks to the last
                // record taken: records are taken only against marks
                // taken while this process was the consumer.
                let mut consume = trace.host_reads_lock();
                let host = *consume;
                let mark = match poll.frames(host, &mut on) {
                    Ok(mark) => mark,
                    Err(e) => {
                        drop(consume);
                        return failed(format!("{e:#}"));
                    }
                };
                // Records naming a module's code wait for its symbols,
                // whose first piece came before them on the frame ring (2 s
                // a copy, 10 s in a row at most: a copy that never ends, or
                // a guest loading modules without pause, holds nothing for
                // good); and for a whole context after frames were lost.
                let coming = trace.symbols.get().and_then(|s| s.modules_coming());
                let now = Instant::now();
                let module_hold = match (coming, held) {
                    (None, _) => {
                        held = None;
                        false
                    }
                    (Some(id), Some((was, since))) if id == was => since + MODULES_HOLD > now,
                    (Some(id), _) => {
                        held = Some((id, now));
                        true
                    }
                };
                let hold = (module_hold || poll.waiting_for_context())
                    && *holding_since.get_or_insert(now) + HOLD_IN_A_ROW > now;
                if !(module_hold || poll.waiting_for_context()) {
                    holding_since = None;
                }
                if host && !hold {
                    if let Err(e) = poll.records(&mark, &mut on) {
                        *consume = false;
                        drop(consume);
                        return failed(format!("{e:#}"));
                    }
                }
                drop(consume);
                if ended {
                    return;
                }
                rung = trace.wait_doorbell(rung, every);
            }
        });
        self.note(&format!(
            "the trace stream takes a frame ring at {:#x} ({} bytes) and reads {n} record rings in the guest RAM file",
            frames.gpa, frames.len
        ));
        Ok(())
    }

    /// The ring reader stopped on a ring it cannot trust: root drains the
    /// rings again and renders the stream on COM2 (restarted at once).
    fn give_up_rings(&self) {
        let stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        self.stop_host_reads();
        self.rings_reader.store(false, Ordering::Relaxed);
        self.frame_reader.store(false, Ordering::Relaxed);
        self.channel_rings.store(false, Ordering::Relaxed);
        self.bulk.store(false, Ordering::Relaxed);
        let back = self.forward(Request::TraceChannel {
            channel: TraceChannel::Control,
        });
        self.note(&format!(
            "the trace stream goes back to the control channel: {back:?}"
        ));
        if let Some(format) = *stream {
            let restarted = self.start_stream(format);
            if restarted != Response::Ok {
                self.note(&format!("the stream did not start again: {restarted:?}"));
            }
        }
    }
}
