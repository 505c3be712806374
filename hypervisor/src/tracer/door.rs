//! The tracer's request door: which control requests the tracer serves,
//! what root must hand it for each ([`needs`]), and the answer
//! ([`Tracer::request`]). Root keeps what is its own (recovering the
//! kernel, holding the other vCPUs, the channels the stream takes) and
//! does not name the tracer's requests one by one.

use super::machine::{Env, KernelView};
use super::{FunctionsAdded, GraphStarted, ProbeAdded, ReqError, Tracer};
use protocol::{ErrorKind, Request, Response};

/// What root provides for a tracer request before the tracer serves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// The tracer's state alone.
    State,
    /// The recovered kernel (names, symbols, the running task).
    Kernel,
    /// The other vCPUs held from the request's first change on (it
    /// changes hooks), and the quiet views settled after it.
    World,
    /// The recovered kernel and the world.
    KernelAndWorld,
}

/// What a tracer request needs from root; `None` for a request the tracer
/// does not serve.
pub fn needs(req: &Request) -> Option<Needs> {
    Some(match req {
        Request::ProbeList | Request::TraceStart { .. } | Request::TraceStop => Needs::State,
        Request::CountRead { .. } | Request::HistRead { .. } => Needs::Kernel,
        Request::ProbeDel { .. }
        | Request::FunctionClear
        | Request::CountStop
        | Request::GraphStop { .. } => Needs::World,
        Request::ProbeAdd { .. }
        | Request::ProbeGate { .. }
        | Request::FunctionAdd { .. }
        | Request::CountStart(_)
        | Request::GraphStart(_)
        | Request::Sched { .. } => Needs::KernelAndWorld,
        _ => return None,
    })
}

/// What root hands the tracer for one request: what [`needs`] asked for.
pub struct Given<'a, 'e> {
    /// The recovered kernel.
    pub kernel: Option<&'a dyn KernelView>,
    /// The world, the other vCPUs held.
    pub env: Option<&'a mut Env<'e>>,
    /// Root's clock.
    pub now_ns: u64,
}

impl Given<'_, '_> {
    fn kernel(&self) -> Result<&dyn KernelView, ReqError> {
        self.kernel.ok_or_else(|| missing("the guest kernel"))
    }
}

/// The error for a request root served without what it needs.
fn missing(what: &str) -> ReqError {
    ReqError::new(
        ErrorKind::Internal,
        alloc::format!("the tracer's request came without {what}"),
    )
}

impl Tracer<'_> {
    /// Serves the tracer request `req` with what root was asked for
    /// ([`needs`]). A request the tracer does not serve, or one that
    /// comes without what it needs, is an internal error.
    pub fn request(
        &mut self,
        req: Request,
        mut given: Given<'_, '_>,
    ) -> Result<Response, ReqError> {
        let now_ns = given.now_ns;
        match req {
            Request::ProbeList => Ok(Response::Probes(self.probe_list())),
            Request::TraceStart { format } => {
                self.set_stream(Some(format));
                Ok(Response::Ok)
            }
            Request::TraceStop => {
                self.set_stream(None);
                Ok(Response::Ok)
            }
            Request::CountRead { cursor, limit } => {
                let page = self.count_read(cursor, limit, given.kernel()?, now_ns)?;
                Ok(Response::Counts(page))
            }
            Request::HistRead { cursor } => {
                let p = self.hist_read(cursor, given.kernel()?)?;
                Ok(Response::Hist {
                    rows: p.rows,
                    next: p.next,
                    overflow: p.overflow,
                    faults: p.faults,
                    max_keys: p.max_keys,
                })
            }
            req => {
                let k = given.kernel;
                let env = given.env.take().ok_or_else(|| missing("the world"))?;
                self.world_request(req, k, env, now_ns)
            }
        }
    }

    /// The requests that change hooks, the other vCPUs held.
    fn world_request(
        &mut self,
        req: Request,
        k: Option<&dyn KernelView>,
        env: &mut Env<'_>,
        now_ns: u64,
    ) -> Result<Response, ReqError> {
        let kernel = || k.ok_or_else(|| missing("the guest kernel"));
        match req {
            Request::ProbeAdd { spec } => {
                let ProbeAdded { name, site } = self.probe_add(&spec, kernel()?, env)?;
                Ok(Response::ProbeAdded { name, site })
            }
            Request::ProbeDel { name } => self.probe_del(&name, env).map(|()| Response::Ok),
            Request::ProbeGate { name, session } => {
                self.probe_gate(&name, session, env).map(|()| Response::Ok)
            }
            Request::FunctionAdd { glob } => {
                let FunctionsAdded {
                    traced,
                    skipped,
                    skipped_total,
                } = self.function_add(&glob, kernel()?, env)?;
                Ok(Response::FunctionAdded {
                    traced,
                    skipped,
                    skipped_total,
                })
            }
            Request::FunctionClear => self.function_clear(env).map(|()| Response::Ok),
            // The settling that follows puts the scheduler hook in or out.
            Request::Sched { switch, wakeup } => {
                self.vm.quiet.sched_switch = switch;
                self.vm.quiet.sched_wakeup = wakeup;
                Ok(Response::Ok)
            }
            Request::CountStart(filter) => {
                let a = self.count_start(&filter, kernel()?, env, now_ns)?;
                Ok(Response::CountStarted {
                    functions: a.traced,
                    skipped: a.skipped,
                    skipped_total: a.skipped_total,
                })
            }
            Request::CountStop => self.count_stop(env).map(|()| Response::Ok),
            Request::GraphStart(filter) => {
                let GraphStarted {
                    session,
                    hooked,
                    roots,
                    skipped,
                } = self.graph_start(filter, kernel()?, env)?;
                Ok(Response::GraphStarted {
                    session,
                    hooked,
                    roots,
                    skipped,
                })
            }
            Request::GraphStop { session } => self.graph_stop(session, env).map(|()| Response::Ok),
            _ => Err(ReqError::new(
                ErrorKind::Internal,
                "not a request of the tracer's",
            )),
        }
    }
}

impl Tracer<'_> {
    /// The tracer's part of `status`: in each vCPU's row (by its index)
    /// the hypercalls by what they were, the EPT view moves and times at
    /// `now_ns`, and the records its ring lost; and its own counters and
    /// graph sessions. Root fills the rest of the report.
    pub fn status_part(
        &self,
        vcpus: &mut [protocol::VcpuReport],
        now_ns: u64,
    ) -> (
        protocol::TracerReport,
        alloc::vec::Vec<protocol::GraphSessionReport>,
    ) {
        for row in vcpus.iter_mut() {
            let i = row.index as usize;
            let h = self.hypercalls_of(i, now_ns);
            row.hits = h.hits;
            row.returns = h.returns;
            row.refused = h.refused;
            row.view_switches = h.view_switches;
            row.armed_ns = h.armed_ns;
            row.quiet_ns = h.quiet_ns;
            row.quiet = h.quiet;
            row.lost = self.lost_of(i);
        }
        (self.report(), self.graph_sessions())
    }
}
