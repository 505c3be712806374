//! The tracer's turn door: what a timer turn does for the tracer on every
//! vCPU ([`Tracer::turn`]) and, on the boot processor, for the stream
//! ([`Tracer::stream_turn`], through root's control channel as an
//! [`Outbox`]).

use super::machine::{CpuView, Env, KernelView};
use super::Tracer;
use protocol::Event;

/// What root does after a vCPU's turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnDone {
    /// The vCPU picked its view again (root loads the view's EPT pointer).
    pub view_picked: bool,
    /// #DB must stay intercepted: a step is in flight on this vCPU, or one
    /// ended by force may have left TF in a context that can resume on any.
    pub debug_exits: bool,
}

/// Root's control channel as the stream's turn sends through it.
pub trait Outbox {
    /// Bytes the output queue has free.
    fn room(&self) -> usize;
    /// Queues an event for the host.
    fn send(&mut self, event: Event);
    /// Whether a copy of the modules' symbols is on its way: the stream
    /// then waits (unless the host reads the rings itself), since records
    /// may name the modules' code.
    fn sending_modules(&self) -> bool;
    /// Whether the host asked for the rendering context again (the ask is
    /// taken).
    fn take_context_resend(&mut self) -> bool;
}

impl Tracer<'_> {
    /// The vCPU's turn: the region kept mapped, the turn's caches dropped,
    /// steps that did not finish ended ([`Self::on_turn`]); the view picked
    /// again when the quiet views changed since the vCPU last looked, with
    /// the vCPU's state from `cpu` (read only then).
    pub fn turn<E>(
        &mut self,
        env: &mut Env<'_>,
        kernel: Option<&dyn KernelView>,
        cpu: impl FnOnce() -> Result<CpuView, E>,
        now_ns: u64,
    ) -> Result<TurnDone, E> {
        self.on_turn(env);
        let view_picked = self.view_due();
        if view_picked {
            self.turn_view(kernel, &cpu()?, now_ns);
        }
        Ok(TurnDone {
            view_picked,
            debug_exits: self.wants_debug_exits(),
        })
    }

    /// The boot processor's turn for the stream: the return stacks of
    /// dead tasks dropped, the stream's next events sent while `out` has
    /// room, the rendering context sent again when the host asked, the
    /// doorbell rung when a ring the host reads is filling. Whether output
    /// still waits (the turns stay busy).
    pub fn stream_turn(
        &mut self,
        out: &mut dyn Outbox,
        kernel: Option<&dyn KernelView>,
        cpu: &CpuView,
        now_ns: u64,
    ) -> bool {
        self.reap(kernel, cpu, now_ns);
        if !out.sending_modules() || self.host_reads() {
            while let Some(ev) = self.next_text(out.room(), kernel, now_ns) {
                out.send(ev);
            }
        }
        if out.take_context_resend() {
            self.resend_context();
        }
        if self.doorbell(now_ns) {
            out.send(Event::TraceDoorbell);
        }
        self.has_output()
    }
}
