//! The tracer's door for the exits of its single step: #DB, an external
//! interrupt that comes before the stepped instruction ran, and INIT
//! parking the vCPU ([`Tracer::step_exit`]). The tracer decides with its
//! step's state (`crate::vmx::debug::decide` for #DB) and ends the step
//! where it must; root applies the answer to RFLAGS, DR6 and the event to
//! deliver.

use super::machine::Env;
use super::Tracer;
use crate::vmx::debug;

/// An exit of the tracer's single step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepExit {
    /// #DB with its exit qualification (DR6-like bits); `int1`: the guest
    /// executed INT1.
    Debug {
        /// The exit qualification.
        qualification: u64,
        /// An INT1 (privileged software exception), not a trap.
        int1: bool,
    },
    /// An external interrupt exit: a step armed has not run its
    /// instruction (its #DB would have come first).
    Interrupt,
    /// INIT resets the vCPU: a step in flight must not stay open while
    /// it sleeps.
    Init,
}

/// What root does after a step's exit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepDone {
    /// The step in flight ended: its pages are closed (root stops the
    /// interrupt exits it took).
    pub ended: bool,
    /// The TF RFLAGS must hold now (the guest's own back after a step),
    /// if it must change.
    pub tf: Option<bool>,
    /// A #DB for the guest with these DR6 condition bits; `None`: the
    /// exit was root's alone.
    pub reflect: Option<u64>,
    /// Deliver it as INT1 (a privileged software exception).
    pub as_int1: bool,
    /// #DB must stay intercepted.
    pub debug_exits: bool,
}

impl Tracer<'_> {
    /// The step's exit `exit` on this vCPU: the step ends where it must,
    /// and the answer says what becomes of TF and of a #DB.
    pub fn step_exit(&mut self, env: &mut Env<'_>, exit: StepExit) -> StepDone {
        let state = self.debug_state();
        let mut done = match exit {
            StepExit::Debug {
                qualification,
                int1,
            } => {
                let act = debug::decide(
                    qualification,
                    int1,
                    state.stepping,
                    state.guest_tf,
                    state.stray_tf,
                );
                if act.end_step {
                    self.finish_step(env);
                } else if state.stray_tf && act.tf == Some(false) {
                    self.clear_stray_tf();
                }
                StepDone {
                    ended: act.end_step,
                    tf: act.tf,
                    reflect: act.reflect,
                    as_int1: act.as_int1,
                    debug_exits: false,
                }
            }
            StepExit::Interrupt | StepExit::Init => {
                if state.stepping {
                    self.finish_step(env);
                }
                StepDone {
                    ended: state.stepping,
                    tf: (exit == StepExit::Interrupt && state.stepping).then_some(state.guest_tf),
                    ..StepDone::default()
                }
            }
        };
        done.debug_exits = self.wants_debug_exits();
        done
    }
}
