//! Stopping the world: holding every other vCPU in root while one changes
//! what they all execute (the tracer's shadow pages and the EPT entries
//! every view shares).
//!
//! Each vCPU says where it is in [`PRESENCE`]: `in_guest` is cleared first
//! thing after every exit and set last thing before every entry, with a
//! check of [`HOLD`] after it (both sequentially consistent, so that a
//! vCPU either sees the hold before it enters or is seen in the guest by
//! the one holding). [`stop`] raises the hold and waits until no other
//! vCPU is in the guest; a vCPU parked in wait-for-SIPI executes nothing
//! and is not waited for (its SIPI exit brings it through the same entry
//! check). The preemption timer, which every vCPU has when there are
//! several, bounds the wait: a vCPU in the guest exits within a turn.
//!
//! While the world is stopped no vCPU executes guest code, so a shadow
//! page can be patched in place (no vCPU can fetch a torn `call`), and
//! each vCPU's guest RIP is known ([`World::rips`]) for the rule that a
//! site an interrupted RIP is inside is not patched. Every change to the
//! shared views bumps [`EPT_GENERATION`]; a vCPU whose last INVEPT is of
//! an older generation invalidates its view before it enters the guest,
//! so no vCPU ever runs on a stale translation of a changed entry.

use crate::arch::instructions as insn;
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use hypervisor::acpi::MAX_CPUS;
use hypervisor::tracer::machine::View;

/// Where one vCPU is.
struct Presence {
    /// In VMX non-root (or on its way in, past the hold check).
    in_guest: AtomicBool,
    /// Parked in wait-for-SIPI: it executes nothing.
    parked: AtomicBool,
    /// Its guest RIP at its last exit.
    rip: AtomicU64,
    /// Per view (armed, quiet): the EPT generation it was last
    /// invalidated at, and whether its own entries changed since
    /// ([`own_views_changed`]). Only the vCPU itself writes them.
    seen: [AtomicU64; 2],
    dirty: [AtomicBool; 2],
}

static PRESENCE: [Presence; MAX_CPUS] = [const {
    Presence {
        in_guest: AtomicBool::new(false),
        parked: AtomicBool::new(false),
        rip: AtomicU64::new(0),
        seen: [const { AtomicU64::new(0) }; 2],
        dirty: [const { AtomicBool::new(false) }; 2],
    }
}; MAX_CPUS];

/// Raised while one vCPU changes what all of them execute.
static HOLD: AtomicBool = AtomicBool::new(false);
/// Bumped by every change to the EPT entries the views share.
static EPT_GENERATION: AtomicU64 = AtomicU64::new(0);
/// vCPUs the VM has (set once, before the APs start).
static VCPUS: AtomicUsize = AtomicUsize::new(1);
/// How long [`stop`] waits for a vCPU to come to root: many turns of the
/// preemption timer.
const STOP_WAIT_MS: u64 = 2000;

/// Sets how many vCPUs the VM has.
pub fn set_vcpus(n: usize) {
    VCPUS.store(n.clamp(1, MAX_CPUS), SeqCst);
}

/// How many vCPUs the VM has.
pub fn vcpus() -> usize {
    VCPUS.load(SeqCst)
}

fn presence(index: usize) -> Option<&'static Presence> {
    PRESENCE.get(index)
}

/// Called first thing after each exit of vCPU `index`; `rip` reads its
/// guest RIP, which only a VM with other vCPUs to stop the world needs
/// (one VMREAD saved on every exit of a single vCPU).
pub fn left_guest(index: usize, rip: impl FnOnce() -> u64) {
    if let Some(p) = presence(index) {
        if vcpus() > 1 {
            // The RIP first: whoever sees the vCPU out of the guest reads it.
            p.rip.store(rip(), SeqCst);
        }
        p.in_guest.store(false, SeqCst);
    }
}

/// Called last thing before each entry of vCPU `index` on its view
/// `view` (its views' pointers are `eptps`; `parked` when it enters
/// wait-for-SIPI): waits out a hold, and invalidates the view it enters
/// on if the shared entries changed since that view's last INVEPT or its
/// own entries did. The other view is invalidated when the vCPU next
/// enters on it: its stale translations are tagged with its own EPT
/// pointer and unused until then. So a request's many changes cost one
/// INVEPT per entry at most, of one view (each is an exit to a nested
/// KVM, which drops its shadow EPT for it). Returns how many TSC ticks it
/// was held.
pub fn entering_guest(index: usize, eptps: [u64; 2], view: View, parked: bool) -> u64 {
    let Some(p) = presence(index) else {
        return 0;
    };
    let v = view as usize;
    let (Some(seen), Some(dirty), Some(&eptp)) = (p.seen.get(v), p.dirty.get(v), eptps.get(v))
    else {
        return 0;
    };
    let mut held = 0u64;
    loop {
        if HOLD.load(SeqCst) {
            let t0 = insn::rdtsc();
            while HOLD.load(SeqCst) {
                core::hint::spin_loop();
            }
            held = held.saturating_add(insn::rdtsc().saturating_sub(t0));
        }
        p.parked.store(parked, SeqCst);
        p.in_guest.store(true, SeqCst);
        if HOLD.load(SeqCst) {
            // A hold went up meanwhile: it may already have counted this
            // vCPU out of the guest; step back and wait.
            p.in_guest.store(false, SeqCst);
            continue;
        }
        // Seen in the guest from here: a hold raised now waits for this
        // vCPU's next exit before it changes anything, so the generation
        // read below is at least that of every change made before this
        // entry (read before `in_guest`, a whole hold could have come and
        // gone between the read and the entry, unseen).
        let generation = EPT_GENERATION.load(SeqCst);
        if seen.load(SeqCst) != generation || dirty.load(SeqCst) {
            dirty.store(false, SeqCst);
            if crate::vcpu::invept(index, eptp).is_ok() {
                seen.store(generation, SeqCst);
            } else {
                // Tried again at the next entry.
                dirty.store(true, SeqCst);
                log::warn!("vCPU {index}: INVEPT failed");
            }
        }
        return held;
    }
}

/// vCPU `index` changed entries of its own views (a step's page, a quiet
/// mapping, a task switch's CR3): each is invalidated before the vCPU
/// next enters on it ([`entering_guest`]).
pub fn own_views_changed(index: usize) {
    if let Some(p) = presence(index) {
        for d in &p.dirty {
            d.store(true, SeqCst);
        }
    }
}

/// A vCPU did not come to root within [`STOP_WAIT_MS`].
#[derive(Clone, Copy, Debug)]
pub struct Stalled {
    pub vcpu: usize,
}

/// The world stopped by vCPU `me`: every other vCPU is in root (or
/// parked) until this is dropped.
pub struct World {
    me: usize,
    changed: bool,
    /// When the hold went up (TSC), for the log.
    since: u64,
}

/// Stops the world for vCPU `me` (which holds the VM lock, so that only
/// one vCPU stops it at a time). With one vCPU there is nothing to wait
/// for.
pub fn stop(me: usize, tsc_hz: u64) -> Result<World, Stalled> {
    HOLD.store(true, SeqCst);
    let limit = tsc_hz.saturating_mul(STOP_WAIT_MS) / 1000;
    let t0 = insn::rdtsc();
    for (i, p) in PRESENCE.iter().enumerate().take(vcpus()) {
        if i == me {
            continue;
        }
        while p.in_guest.load(SeqCst) && !p.parked.load(SeqCst) {
            if insn::rdtsc().saturating_sub(t0) > limit {
                HOLD.store(false, SeqCst);
                return Err(Stalled { vcpu: i });
            }
            core::hint::spin_loop();
        }
    }
    Ok(World {
        me,
        changed: false,
        since: t0,
    })
}

impl World {
    /// TSC ticks since the hold went up.
    pub fn held_for(&self) -> u64 {
        insn::rdtsc().saturating_sub(self.since)
    }

    /// The guest RIPs of the other vCPUs, where they were stopped (a
    /// parked vCPU's is that of its last exit: checking it errs on the
    /// safe side).
    pub fn rips(&self) -> impl Iterator<Item = u64> + '_ {
        PRESENCE
            .iter()
            .enumerate()
            .take(vcpus())
            .filter(move |&(i, _)| i != self.me)
            .map(|(_, p)| p.rip.load(SeqCst))
    }

    /// The shared EPT entries or a shadow changed: every vCPU invalidates
    /// its view before it enters again (INVEPT also serializes it, which
    /// code changed under it calls for).
    pub fn ept_changed(&mut self) {
        self.changed = true;
    }
}

/// The shared EPT entries changed without the world stopped (a module's
/// unload whose hold did not come): every vCPU invalidates its views
/// before it next enters.
pub fn changed_unheld() {
    EPT_GENERATION.fetch_add(1, SeqCst);
}

impl Drop for World {
    fn drop(&mut self) {
        if self.changed {
            EPT_GENERATION.fetch_add(1, SeqCst);
        }
        HOLD.store(false, SeqCst);
    }
}
