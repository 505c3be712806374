//! The split view's per-vCPU half: the single step that lets the guest
//! read or write a hooked page. A guest access to a hooked page faults in
//! EPT; the page is then mapped to the guest's own frame (read/write/
//! execute) for exactly one instruction, stepped with RFLAGS.TF and an
//! intercepted #DB (Bochs 2.7's monitor trap flag does not work), after
//! which the shadow is put back; after a write it is first rebuilt from the
//! guest's page, so the guest's own changes (its ftrace turning a site into
//! a call) take effect behind our patches. Guest accesses to hypervisor
//! memory get the same single step with the page mapped to a scratch
//! frame: writes are discarded, reads see 0xCC, and the guest keeps
//! running. The page table holding the region's PDE is stepped the same
//! way, and the PDE checked after.
//!
//! The step belongs to one vCPU: one instruction of one vCPU. The pages it
//! opens are opened in the EPT view that vCPU runs on
//! (`Machine::ept_map_mine`), and closed in both of its views, each back
//! to what the tracer says it maps (the views differ on quiet pages):
//! the other vCPUs keep executing what they did, and their own reads and
//! writes of the page keep faulting into steps of their own, so every
//! write to a hooked page is seen and resynced.

use super::machine::{Env, View, PAGE};
use super::region::Region;
use super::site;
use super::split::{in_hypervisor, page_bytes, remap_mine, remap_own, Hooked, QuietMap, SplitView};
use crate::addr::{Gpa, Hpa};
use crate::ept;
use guest_introspect::paging;
use protocol::TracerReport;

/// A step not finished after this many timer turns is ended by force (the
/// stepped context was preempted; its stale TF is swallowed later).
const STEP_TIMEOUT_TURNS: u32 = 4;

/// What an EPT violation was.
pub enum Violation {
    /// A hooked page or hypervisor memory: a step was set up; resume.
    Stepping,
    /// One more page of the instruction already being stepped was opened;
    /// the step is armed already.
    Widened,
    /// An instruction fetch from hypervisor memory: no step (a fetch from
    /// a scratch page mapped without execute would fault again forever);
    /// the guest gets #UD, as for bytes that are no instruction. A step in
    /// flight was ended: `ended_tf` is the guest's own TF from before it.
    FetchRefused { ended_tf: Option<bool> },
    /// Nothing of the tracer's.
    NotOurs,
}

/// What a #DB means to the tracer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DebugState {
    /// A step is in flight.
    pub stepping: bool,
    /// The guest's own TF when the step began.
    pub guest_tf: bool,
    /// A TF of ours may be left in RFLAGS (a step ended by force).
    pub stray_tf: bool,
}

#[derive(Clone, Copy)]
enum StepKind {
    /// A hooked code page, mapped to the guest's own frame for the step.
    Hooked { write: bool },
    /// A hypervisor page, mapped to the scratch frame; `restore` is the EPT
    /// entry to put back (0: absent).
    Discard { restore: u64 },
    /// The page table holding our PDE, mapped writable for the step.
    Watch,
}

/// The most pages one stepped instruction may hold open at once. One x86
/// instruction touches at most a few pages (its code, and source and
/// destination operands, each possibly crossing a page boundary, and the
/// descriptor and stack pages of an event it raises); past this, the step
/// starts over rather than growing.
const STEP_PAGES: usize = 8;

/// One instruction being single-stepped with some of its pages opened.
/// Every page the instruction touches joins the same step, so that an
/// instruction touching two watched pages opens both rather than making
/// the two steps alternate forever.
struct Step {
    pages: [(Gpa, StepKind); STEP_PAGES],
    open: usize,
    old_tf: bool,
    turns: u32,
}

impl Step {
    fn pages(&self) -> &[(Gpa, StepKind)] {
        // `open` never passes STEP_PAGES; were it to, every page is open.
        self.pages.get(..self.open).unwrap_or(&self.pages)
    }
}

/// The shared state a step reads and changes.
pub(super) struct StepShared<'a> {
    pub(super) view: &'a mut SplitView,
    pub(super) region: Option<&'a Region>,
    pub(super) stats: &'a mut TracerReport,
}

impl StepShared<'_> {
    fn reborrow(&mut self) -> StepShared<'_> {
        StepShared {
            view: self.view,
            region: self.region,
            stats: self.stats,
        }
    }
}

/// Root's TF left behind by steps ended by force, for the whole VM: the
/// stepped context was preempted with our TF in its saved RFLAGS, and may
/// resume on any vCPU. While any may be left, every vCPU intercepts #DB,
/// and a single-step #DB that no step of root's explains is swallowed
/// (one per forced end); after [`STRAY_TURNS`] timer turns with none seen
/// the contexts are taken to be gone.
#[derive(Default)]
pub(super) struct StrayTf {
    /// Forced ends whose TF has not trapped yet.
    pub(super) left: u32,
    /// Turns since the last forced end.
    turns: u32,
}

/// Timer turns (of any vCPU) after which TF left by forced step ends is
/// no longer looked for.
const STRAY_TURNS: u32 = 4096;

impl StrayTf {
    /// A step was ended by force.
    pub(super) fn forced(&mut self) {
        self.left = self.left.saturating_add(1);
        self.turns = 0;
    }

    /// A timer turn of any vCPU.
    pub(super) fn on_turn(&mut self) {
        if self.left > 0 {
            self.turns += 1;
            if self.turns > STRAY_TURNS {
                self.left = 0;
            }
        }
    }

    /// One left-over TF trapped (or was found set) and is cleared.
    pub(super) fn take(&mut self) -> bool {
        let had = self.left > 0;
        self.left = self.left.saturating_sub(1);
        had
    }
}

/// A vCPU's step.
#[derive(Default)]
pub(super) struct Stepper {
    step: Option<Step>,
    /// Fetches from hypervisor memory refused (the first few are logged).
    fetches_refused: u64,
}

impl Stepper {
    /// A timer turn: a step that did not finish within
    /// [`STEP_TIMEOUT_TURNS`] is ended by force (true: its TF may be left
    /// in a saved context).
    pub(super) fn on_turn(&mut self, env: &mut Env<'_>, s: StepShared<'_>) -> bool {
        if let Some(st) = self.step.as_mut() {
            st.turns += 1;
            if st.turns > STEP_TIMEOUT_TURNS {
                self.end_step(env, s);
                return true;
            }
        }
        false
    }

    /// Whether a step is in flight.
    pub(super) fn stepping(&self) -> bool {
        self.step.is_some()
    }

    /// An EPT violation at `gpa`: a hooked page or hypervisor memory gets a
    /// single step; anything else is not the tracer's.
    pub(super) fn on_violation(
        &mut self,
        gpa: u64,
        write: bool,
        fetch: bool,
        env: &mut Env<'_>,
        mut s: StepShared<'_>,
    ) -> Violation {
        let page = Gpa(gpa).align_down(PAGE as u64);
        if fetch && in_hypervisor(page.0) {
            let ended_tf = self.step.as_ref().map(|st| st.old_tf);
            self.end_step(env, s.reborrow());
            self.fetches_refused = self.fetches_refused.saturating_add(1);
            if self.fetches_refused <= 4 {
                log::warn!("tracer: the guest fetched from hypervisor memory at {gpa:#x}: #UD");
            }
            return Violation::FetchRefused { ended_tf };
        }
        let widen = match self.step.as_ref() {
            // The instruction being stepped touched another page (or the
            // same page again for another kind of access): open it too.
            Some(s) if s.open < STEP_PAGES => true,
            Some(_) => {
                // More pages than one instruction can touch: start over.
                self.end_step(env, s.reborrow());
                false
            }
            None => false,
        };
        let open = self.step.as_ref().filter(|_| widen).and_then(|st| {
            st.pages()
                .iter()
                .find(|&&(p, _)| p == page)
                .map(|&(_, k)| k)
        });
        if let Some(kind) = open {
            // Already open: a hypervisor page mapped to scratch faults again
            // for another kind of access; any page faults again when the
            // vCPU moved to its other view since the step opened it, or a
            // request put the page's quiet mapping back meanwhile. Open it
            // again in the view the vCPU runs on (the same entry as before
            // where nothing changed).
            match kind {
                StepKind::Hooked { .. } | StepKind::Watch => {
                    remap_mine(env, page, page.identity_hpa(), ept::RWX);
                }
                StepKind::Discard { .. } => {
                    if let Some(scratch) = s.view.scratch {
                        let _ = env.m.ept_map_mine(page, scratch, ept::READ | ept::WRITE);
                    }
                }
            }
            env.m.invept();
            return Violation::Widened;
        }
        let watched = s.region.is_some_and(|r| r.pd_page == page.0);
        let kind = if watched {
            remap_mine(env, page, page.identity_hpa(), ept::RWX);
            StepKind::Watch
        } else if s.view.pages.contains_key(&page) {
            remap_mine(env, page, page.identity_hpa(), ept::RWX);
            StepKind::Hooked { write }
        } else if in_hypervisor(page.0) {
            let scratch = match s.view.scratch {
                Some(s) => s,
                None => match env.m.alloc_frame() {
                    Some(f) => {
                        s.view.scratch = Some(f);
                        f
                    }
                    None => return Violation::NotOurs,
                },
            };
            env.m.frame(scratch).fill(0xcc);
            let restore = match env.m.ept_map_mine(page, scratch, ept::READ | ept::WRITE) {
                Ok(old) => old,
                Err(_) => return Violation::NotOurs,
            };
            s.stats.blocked_writes += u64::from(write);
            StepKind::Discard { restore }
        } else {
            return Violation::NotOurs;
        };
        env.m.invept();
        if widen {
            // `widen` means the step had a free slot (open < STEP_PAGES).
            if let Some(st) = self.step.as_mut() {
                if let Some(slot) = st.pages.get_mut(st.open) {
                    *slot = (page, kind);
                    st.open += 1;
                    s.stats.steps_widened += 1;
                    return Violation::Widened;
                }
            }
        }
        s.stats.steps += 1;
        let mut pages = [(Gpa(0), StepKind::Watch); STEP_PAGES];
        pages[0] = (page, kind);
        self.step = Some(Step {
            pages,
            open: 1,
            old_tf: false,
            turns: 0,
        });
        Violation::Stepping
    }

    /// Ends the step in flight: every page it opened goes back.
    pub(super) fn end_step(&mut self, env: &mut Env<'_>, mut s: StepShared<'_>) {
        let Some(step) = self.step.take() else {
            return;
        };
        for &(page, kind) in step.pages() {
            close_page(page, kind, env, s.reborrow());
        }
        env.m.invept();
    }

    /// Records the guest's TF before the step set it (false for a TF
    /// left behind by a step of ours that ended without its #DB).
    pub(super) fn set_old_tf(&mut self, tf: bool) {
        if let Some(s) = self.step.as_mut() {
            s.old_tf = tf;
        }
    }

    /// What a #DB means to the tracer, with `stray` TF of root's possibly
    /// left in guest contexts.
    pub(super) fn debug_state(&self, stray: bool) -> DebugState {
        DebugState {
            stepping: self.step.is_some(),
            guest_tf: self.step.as_ref().is_some_and(|s| s.old_tf),
            stray_tf: stray,
        }
    }
}

/// Brings the shadows of the hooked page `page`, `h` (the shadow, and its
/// partial quiet shadow) up to the guest's own bytes, under our patches.
pub(super) fn resync_hooked(page: Gpa, h: &mut Hooked, env: &mut Env<'_>) {
    if let Some(orig) = page_bytes(env.ram, page) {
        let shadow = env.m.frame(h.shadow);
        site::resync(shadow, &orig, &mut h.patches);
        if let QuietMap::Partial(q) = h.quiet {
            let quiet = env.m.frame(q);
            site::resync_where(quiet, &orig, &mut h.patches, |p| p.in_quiet);
        }
    }
}

/// Puts one page of a finished step back to its watched mapping.
fn close_page(page: Gpa, kind: StepKind, env: &mut Env<'_>, s: StepShared<'_>) {
    match kind {
        StepKind::Hooked { write } => {
            // Resynced whatever opened the page: while it was open, this
            // instruction, an event it raised or another context on this
            // vCPU may have written it (the resync writes only the bytes
            // that differ).
            if let Some(h) = s.view.pages.get_mut(&page) {
                s.stats.guest_writes += u64::from(write);
                resync_hooked(page, h, env);
                for view in View::BOTH {
                    remap_own(env, view, page, h.mapping(view, page), ept::EXEC);
                }
            } else {
                // Unhooked meanwhile: the identity mapping stays.
            }
        }
        StepKind::Watch => {
            if s.region.is_some_and(|r| r.restore_pde(env)) {
                s.stats.region_restores += 1;
            }
            for view in View::BOTH {
                remap_own(env, view, page, page.identity_hpa(), ept::READ | ept::EXEC);
            }
        }
        StepKind::Discard { restore } => {
            // Hypervisor memory is mapped alike in both views.
            for view in View::BOTH {
                if restore & ept::RWX == 0 {
                    let _ = env.m.ept_unmap_own(view, page);
                } else {
                    let hpa = Hpa(restore & paging::ADDR_MASK);
                    let _ = env.m.ept_map_own(view, page, hpa, restore & ept::RWX);
                }
            }
        }
    }
}
