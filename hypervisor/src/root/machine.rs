//! Root's side of the tracer's [`Machine`]: the frame pool, the vCPUs' EPT
//! views (two each, armed and quiet, with INVEPT), the heap, and the
//! guarded door to guest RAM.
//!
//! Two environments: [`with_env`] for what one vCPU does to its own view
//! (a single step, a hypercall, a turn), and [`with_world`] for a request
//! that may change what every vCPU executes (hooking, unhooking), which
//! holds the other vCPUs in root from its first change on
//! (`crate::world`).

use crate::arch::instructions as insn;
use crate::frames::{self, PoolTables};
use crate::world::{self, Stalled, World};
use crate::{heap, phys};
use guest_introspect::fallible::OutOfMemory;
use hypervisor::acpi::MAX_CPUS;
use hypervisor::addr::{Gpa, Hpa};
use hypervisor::ept::{Ept, EptError, MemType};
use hypervisor::tracer::machine::{Env, Machine, View, PAGE};

/// The tracer's machine over the VM's EPT views, for vCPU `me`, which
/// runs on its view `view`. vCPU `i`'s two views are `views[2 * i]` (armed)
/// and `views[2 * i + 1]` (quiet): see [`view_index`].
struct Root<'a> {
    views: &'a [Ept],
    me: usize,
    view: View,
    /// May this environment hold the other vCPUs (a host request), and at
    /// what TSC rate it counts its wait.
    may_stop: Option<u64>,
    /// The other vCPUs, once held.
    world: Option<World>,
    /// A hold that did not come in time (not tried again in this request).
    stalled: bool,
    /// Changes to every view go on without the hold (a module's unload
    /// whose hold did not come: `Machine::must_stop_others`).
    forced: bool,
    /// Every vCPU's guest RIP: this vCPU's, then the others' once held.
    rips: [u64; MAX_CPUS],
    n_rips: usize,
    /// Root's clock and the TSC rate, for a hypercall's timing.
    clock: Option<(hypervisor::mono::MonoTsc, u64)>,
}

impl<'a> Root<'a> {
    fn new(views: &'a [Ept], me: usize, view: View, rip: u64, may_stop: Option<u64>) -> Self {
        let mut rips = [0u64; MAX_CPUS];
        rips[0] = rip;
        Root {
            views,
            me,
            view,
            may_stop,
            world: None,
            stalled: false,
            forced: false,
            rips,
            n_rips: 1,
            clock: None,
        }
    }

    fn mine(&self) -> Result<&Ept, EptError> {
        self.own(self.view)
    }

    fn own(&self, view: View) -> Result<&Ept, EptError> {
        self.views
            .get(view_index(self.me, view))
            .ok_or(EptError::OutOfTables)
    }

    /// Every view, for a change they must all see: only with the other
    /// vCPUs held (or none to hold).
    fn shared(&mut self) -> Result<&[Ept], EptError> {
        if !self.stop_others() && !self.forced {
            return Err(EptError::Stalled);
        }
        if let Some(w) = self.world.as_mut() {
            w.ept_changed();
        }
        Ok(self.views)
    }
}

impl Machine for Root<'_> {
    fn alloc_frame(&mut self) -> Option<Hpa> {
        frames::alloc()
    }

    fn frames_free(&self) -> u64 {
        loader::layout::HV_RESERVED_SIZE.saturating_sub(frames::used())
    }

    fn frame(&mut self, hpa: Hpa) -> &mut [u8; PAGE] {
        // A frame written while the world is stopped may be a shadow the
        // others execute: they serialize (INVEPT) before they run again.
        if let Some(w) = self.world.as_mut() {
            w.ept_changed();
        }
        // SAFETY: the tracer passes only frames `alloc_frame` gave it, each
        // used by one owner (a trampoline page, a shadow, the scratch page),
        // and holds the reference for one copy or patch; a frame other
        // vCPUs may execute (a shadow) is patched only while the world is
        // stopped (or, when a module's unload could not stop it, over text
        // the kernel is about to free, which no vCPU executes), and
        // resynced after a guest write the same way the guest's own write
        // changed its page. The frame is plain memory either way: a racing
        // fetch sees old or new bytes, never root's state.
        unsafe { phys::frame_bytes_mut(hpa) }
    }

    fn ept_map(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        let me = view_index(self.me, self.view);
        let views = self.shared()?;
        let mut olds = [0u64; 2 * MAX_CPUS];
        map_every(views.iter(), gpa, hpa, perms, &mut olds)?;
        Ok(olds.get(me).copied().unwrap_or(0))
    }

    fn ept_unmap(&mut self, gpa: Gpa) -> Result<(), EptError> {
        let end = Gpa(gpa.0.saturating_add(PAGE as u64));
        let mut out = Ok(());
        for ept in self.shared()? {
            out = out.and(ept.unmap(&mut PoolTables, gpa, end));
        }
        out
    }

    fn ept_map_quiet(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<(), EptError> {
        let views = self.shared()?;
        let quiet = views.iter().skip(View::Quiet as usize).step_by(2);
        map_every(quiet, gpa, hpa, perms, &mut [0u64; MAX_CPUS])
    }

    fn ept_map_mine(&mut self, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        self.mine()?
            .map_page(&mut PoolTables, gpa, hpa, perms, MemType::WriteBack)
    }

    fn ept_map_own(&mut self, view: View, gpa: Gpa, hpa: Hpa, perms: u64) -> Result<u64, EptError> {
        self.own(view)?
            .map_page(&mut PoolTables, gpa, hpa, perms, MemType::WriteBack)
    }

    fn ept_unmap_own(&mut self, view: View, gpa: Gpa) -> Result<(), EptError> {
        self.own(view)?
            .unmap(&mut PoolTables, gpa, Gpa(gpa.0.saturating_add(PAGE as u64)))
    }

    fn invept(&mut self) {
        // Batched: each view is invalidated before this vCPU next enters
        // on it, once however many changes came before.
        world::own_views_changed(self.me);
    }

    fn stop_others(&mut self) -> bool {
        if self.views.len() <= 2 || self.world.is_some() {
            return true;
        }
        let Some(tsc_hz) = self.may_stop.filter(|_| !self.stalled) else {
            return false;
        };
        match world::stop(self.me, tsc_hz) {
            Ok(w) => {
                for (slot, rip) in self.rips.iter_mut().skip(1).zip(w.rips()) {
                    *slot = rip;
                    self.n_rips += 1;
                }
                self.world = Some(w);
                true
            }
            Err(Stalled { vcpu }) => {
                log::warn!("vCPU {vcpu} did not come to root in time for a change to every view");
                self.stalled = true;
                false
            }
        }
    }

    fn must_stop_others(&mut self) -> bool {
        if self.world.is_some() || self.views.len() <= 2 {
            return true;
        }
        if self.may_stop.is_none() {
            self.forced = true;
            return false;
        }
        for _ in 0..MUST_STOP_TRIES {
            self.stalled = false;
            if self.stop_others() {
                return true;
            }
        }
        log::error!(
            "the other vCPUs did not come to root for a module's unload: its sites are unhooked without them"
        );
        self.forced = true;
        false
    }

    fn let_others_go(&mut self) {
        if let Some(w) = self.world.take() {
            drop(w);
            self.n_rips = 1;
        }
    }

    fn rips(&self) -> &[u64] {
        self.rips.get(..self.n_rips).unwrap_or(&self.rips)
    }

    fn clock_ns(&self) -> Option<u64> {
        self.clock
            .map(|(c, hz)| crate::clock::tsc_to_ns(c.peek(insn::rdtsc()), hz))
    }

    fn heap_check(&self, bytes: usize) -> Result<(), OutOfMemory> {
        heap::check(bytes)
    }

    fn heap_room(&self) -> usize {
        heap::room()
    }
}

/// Holds [`Machine::must_stop_others`] tries before it goes on without the
/// other vCPUs (each waits `world::STOP_WAIT_MS`).
const MUST_STOP_TRIES: u32 = 4;

/// Maps the guest page `gpa` to `hpa` with `perms` (write-back) in every
/// view of `each`, or in none: on a failure the views mapped so far get
/// their old entry back (their tables exist now, so putting it back
/// allocates nothing). The entries that were there go into `olds`, by
/// position.
fn map_every<'v>(
    each: impl Iterator<Item = &'v Ept> + Clone,
    gpa: Gpa,
    hpa: Hpa,
    perms: u64,
    olds: &mut [u64],
) -> Result<(), EptError> {
    for (i, ept) in each.clone().enumerate() {
        match ept.map_page(&mut PoolTables, gpa, hpa, perms, MemType::WriteBack) {
            Ok(old) => {
                if let Some(o) = olds.get_mut(i) {
                    *o = old;
                }
            }
            Err(e) => {
                for (ept, &old) in each.zip(olds.iter()).take(i) {
                    let _ = ept.restore_page(&mut PoolTables, gpa, old);
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

pub use crate::vcpu::view_index;

/// Runs `f` with the tracer's environment over root's resources and vCPU
/// `me`'s EPT views (it runs on `view`), for what it does on its own (a
/// step, a turn, a hypercall): nothing there changes every view.
pub fn with_env<R>(views: &[Ept], me: usize, view: View, f: impl FnOnce(&mut Env<'_>) -> R) -> R {
    let mut m = Root::new(views, me, view, 0, None);
    f(&mut Env {
        ram: phys::guest_ram(),
        m: &mut m,
    })
}

/// [`with_env`] for a hypercall, with root's clock (`clock` at `tsc_hz`)
/// for the tracer to read (`Machine::clock_ns`).
pub fn with_env_clocked<R>(
    views: &[Ept],
    me: usize,
    view: View,
    clock: hypervisor::mono::MonoTsc,
    tsc_hz: u64,
    f: impl FnOnce(&mut Env<'_>) -> R,
) -> R {
    let mut m = Root::new(views, me, view, 0, None);
    m.clock = Some((clock, tsc_hz));
    f(&mut Env {
        ram: phys::guest_ram(),
        m: &mut m,
    })
}

/// Runs a host request that may change what every vCPU executes: the
/// environment holds the other vCPUs in root from its first hook or
/// unhook to the end of `f` (`Machine::stop_others`), so the work before
/// runs with them still running; `rip` is vCPU `me`'s guest RIP. (A
/// request opens no page for a step: its view is the armed one.)
pub fn with_world<R>(
    views: &[Ept],
    me: usize,
    rip: u64,
    tsc_hz: u64,
    f: impl FnOnce(&mut Env<'_>) -> R,
) -> R {
    let mut m = Root::new(views, me, View::Armed, rip, Some(tsc_hz));
    let r = f(&mut Env {
        ram: phys::guest_ram(),
        m: &mut m,
    });
    // Dropping the world lets the others go; each invalidates its view
    // before it enters again if a shared entry changed.
    if m.forced {
        world::changed_unheld();
    }
    if let Some(w) = m.world.take() {
        log::info!(
            "the other vCPUs were held {} us for a change to every view",
            crate::clock::tsc_to_ns(w.held_for(), tsc_hz) / 1000
        );
    }
    r
}
