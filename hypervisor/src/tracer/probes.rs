//! The probes (kprobe_events specs resolved to a hooked site) and what a
//! hit of one records: its fetch arguments, read through the vCPU's page
//! tables, encoded into the vCPU's ring. Shared by every vCPU, but for the
//! ring a hit writes to.

use super::machine::Machine;
use super::ring::EventRing;
use crate::addr::Gva;
use crate::guest_phys::GuestDoor;
use alloc::format;
use alloc::string::ToString;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use guest_introspect::paging::{self, Cr3, WalkCache};
use protocol::ProbeInfo;
use tracelang::kprobe::{
    self, EventHeader, FetchContext, GuestMem, IndexSymbols, MemFault, ProbeSpec,
};

/// Probes defined at most.
pub(super) const MAX_PROBES: usize = 1024;

/// A probe.
pub(super) struct Probe {
    pub(super) id: u32,
    pub(super) spec: ProbeSpec,
    /// The hooked site; `None` while the probe waits for its module to
    /// load (pending).
    pub(super) site: Option<Gva>,
    /// The module the probed function is in (named in the spec, or where
    /// the name was found), if not the kernel image.
    pub(super) module: Option<alloc::string::String>,
    /// Hits recorded and hits lost: counted on the hit path, where other
    /// vCPUs count theirs at the same time.
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    /// The heap one hit may take at most (`kprobe::worst_case_bytes`).
    pub(super) heap: usize,
    /// A return probe that reads arguments as they were at the entry:
    /// its entries save them.
    pub(super) entry_args: bool,
    /// The session that gates it (`ProbeGate`): it records only for the
    /// tasks that session admits.
    pub(super) gate: Option<Gate>,
}

/// A probe's gate: a graph session's task filter, copied.
pub(super) struct Gate {
    /// The session (1 to 15).
    pub(super) session: u8,
    /// Only this thread id.
    pub(super) pid: Option<i32>,
    /// Only this comm (its bytes, at most 15).
    pub(super) comm: Option<Vec<u8>>,
}

impl Gate {
    /// Whether a hit by (`pid`, `comm`) records.
    #[inline]
    pub(super) fn admits(&self, pid: i32, comm: &[u8; 16]) -> bool {
        super::fgraph::task_admitted(self.pid, self.comm.as_deref(), pid, comm)
    }
}

impl Probe {
    /// Whether a hit of this probe by (`pid`, `comm`) records.
    #[inline]
    pub(super) fn admits(&self, pid: i32, comm: &[u8; 16]) -> bool {
        self.gate.as_ref().is_none_or(|g| g.admits(pid, comm))
    }
}

/// Whether `spec` reads arguments saved at the entry (`$argN` or a
/// parameter at a return probe).
pub(super) fn reads_entry_args(spec: &ProbeSpec) -> bool {
    spec.args
        .iter()
        .any(|a| matches!(a.expr.base, tracelang::kprobe::FetchBase::EntryArg(_)))
}

/// A hit whose arguments may take more heap than this (any string) has
/// the heap's room checked first; a probe of a few integers allocates a
/// few hundred bytes, fallibly: no check, and no lock of the allocator's
/// for it.
const CHECKED_HIT_BYTES: usize = 4 << 10;

/// The probes and the function tracer's count.
pub(super) struct Probes {
    pub(super) list: Vec<Probe>,
    /// The next probe's id (probes count from 1; 0 is the function tracer).
    pub(super) next_id: u32,
    /// Functions the function tracer has hooked.
    pub(super) functions: u32,
}

impl Default for Probes {
    fn default() -> Self {
        Probes {
            list: Vec::new(),
            next_id: 1,
            functions: 0,
        }
    }
}

impl Probes {
    /// The probe named `name` (`EVENT` or `GROUP/EVENT`), by index.
    pub(super) fn position(&self, name: &str) -> Option<usize> {
        let (group, event) = match name.split_once('/') {
            Some((g, e)) => (Some(g), e),
            None => (None, name),
        };
        self.list
            .iter()
            .position(|p| p.spec.event == event && group.is_none_or(|g| g == p.spec.group))
    }

    /// The probe with id `id`.
    pub(super) fn get(&self, id: u32) -> Option<&Probe> {
        self.list.iter().find(|p| p.id == id)
    }

    /// The session bit (1 << N) of the gate of probe `id`, 0 when open.
    pub(super) fn gate_bit(&self, id: u32) -> u16 {
        self.get(id)
            .and_then(|p| p.gate.as_ref())
            .map_or(0, |g| super::users::graph_bit(g.session))
    }

    /// Return probes defined.
    pub(super) fn returns(&self) -> u32 {
        self.list.iter().filter(|p| p.spec.kind.is_return()).count() as u32
    }

    /// Counts a missed hit on each return probe of a call that could not
    /// be hijacked (kretprobe's nmissed).
    pub(super) fn retprobes_missed(&self, ids: &[u64]) {
        for p in self.list.iter().filter(|p| ids.contains(&u64::from(p.id))) {
            p.misses.fetch_add(1, Relaxed);
        }
    }

    /// `probe list`.
    pub(super) fn infos(&self) -> Vec<ProbeInfo> {
        self.list
            .iter()
            .map(|p| ProbeInfo {
                name: format!("{}/{}", p.spec.group, p.spec.event),
                spec: p.spec.to_string(),
                symbol: p.spec.symbol.clone(),
                site: p.site.map_or(0, |s| s.0),
                pending: p.site.is_none(),
                hits: p.hits.load(Relaxed),
                misses: p.misses.load(Relaxed),
            })
            .collect()
    }
}

/// Guest-virtual memory through the vCPU's page tables.
pub(super) struct VcpuMem<'a> {
    pub(super) ram: &'a dyn GuestDoor,
    pub(super) cr3: Cr3,
    /// The vCPU's walk cache, where the caller has it.
    pub(super) walks: Option<&'a mut WalkCache>,
}

impl GuestMem for VcpuMem<'_> {
    fn read(&mut self, gva: Gva, buf: &mut [u8]) -> Result<(), MemFault> {
        match &mut self.walks {
            Some(w) => w.read_virt(self.ram, self.cr3, gva, buf),
            None => paging::read_virt(self.ram, self.cr3, gva, buf),
        }
        .map_err(|_| MemFault)
    }
}

/// Encodes an event given by parts into the ring (no `RawEvent`, no
/// allocation but for a record that wraps the ring).
pub(super) fn store_parts(
    ring: &mut EventRing,
    scratch: &mut Vec<u8>,
    header: &EventHeader,
    values: &[kprobe::FetchedValue],
) -> bool {
    // Encoded straight into the ring; through `scratch` (within what the
    // heap gives: a record's length follows guest data) only where the
    // record would wrap.
    let len = kprobe::encoded_len(values);
    ring.push_with(len, scratch, |buf| {
        kprobe::encode_parts(header, values, buf) == Some(len)
    })
}

/// Where probe hits go: the probes (for their counters) and the ring.
pub(super) struct HitSink<'a> {
    pub(super) probes: &'a [Probe],
    pub(super) ring: &'a mut EventRing,
    pub(super) record: &'a mut Vec<u8>,
    /// The vCPU's fetched values, kept from hit to hit: their room and
    /// their strings' buffers serve the next hit (no heap per hit).
    pub(super) values: &'a mut Vec<kprobe::FetchedValue>,
    /// The heap's room, checked before a hit fetches (see [`Self::hits`]).
    pub(super) heap: &'a dyn Machine,
}
impl HitSink<'_> {
    /// Records a hit of each probe in `ids` (entry or return), its
    /// arguments fetched in `ctx`; a probe no longer defined is skipped.
    pub(super) fn hits(
        &mut self,
        ids: impl Iterator<Item = u32>,
        mut header: EventHeader,
        ctx: &FetchContext<'_>,
        mem: &mut VcpuMem<'_>,
        syms: &IndexSymbols<'_>,
    ) {
        for id in ids {
            let Some(p) = self.probes.iter().find(|p| p.id == id) else {
                continue;
            };
            if !p.admits(header.pid, &header.comm) {
                continue;
            }
            header.probe_id = id;
            // Hits run on every vCPU at once, each fetching up to
            // MAX_TRACE_ARGS strings the guest chooses: one that the
            // heap's room beyond its reserve cannot hold at its longest is
            // lost, and so is one whose allocation is refused all the same
            // (a race with another vCPU's hit): never a failed allocation
            // in root.
            let room = p.heap <= CHECKED_HIT_BYTES || self.heap.heap_check(p.heap).is_ok();
            let fetched =
                room && kprobe::try_fetch_into(&p.spec.args, ctx, mem, syms, self.values).is_ok();
            if !fetched {
                self.ring.count_lost();
                p.misses.fetch_add(1, Relaxed);
                continue;
            }
            if store_parts(self.ring, self.record, &header, self.values) {
                p.hits.fetch_add(1, Relaxed);
            } else {
                p.misses.fetch_add(1, Relaxed);
            }
        }
    }
}
