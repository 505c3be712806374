//! The supervisor in this process: what `hvtrace run` uses when it traces.
//! The caller is its only client and calls it directly instead of through
//! a socket ([`LocalControl`]); the VM runs in a thread of its own.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use protocol::{Event, Request, Response};

use crate::control::{response_error, Control};
use crate::daemon::session::Backend;
use crate::daemon::supervisor::{run_vm, Ending, Phase, Supervisor};
use crate::vm::config::RunConfig;
use crate::vm::console::ExecResult;
use crate::vm::StopReport;

/// A VM and its supervisor in this process: what `hvtrace run` uses when
/// it traces. The caller is the supervisor's only client; it calls it
/// directly ([`LocalVm::control`], [`LocalVm::exec`]) instead of through a
/// socket. The VM runs in a thread of its own, which it never outlives.
pub struct LocalVm {
    sup: Arc<Supervisor>,
    thread: Option<JoinHandle<Result<StopReport>>>,
}

/// A handle on a [`LocalVm`]'s supervisor for other threads of the caller.
#[derive(Clone)]
pub struct LocalControl {
    sup: Arc<Supervisor>,
}

impl LocalVm {
    /// Starts the VM and returns once its guest shell is up.
    pub fn start(cfg: RunConfig) -> Result<LocalVm> {
        let sup = Arc::new(Supervisor::new());
        let thread = {
            let sup = sup.clone();
            std::thread::Builder::new()
                .name("vm".to_string())
                .spawn(move || {
                    let result = run_vm(&sup, cfg, false, &|_| {});
                    let ending = match &result {
                        Ok(report) => Ending::from_report(report),
                        Err(e) => Ending {
                            reason: format!("{e:#}"),
                            clean: false,
                            lines: Vec::new(),
                        },
                    };
                    sup.set_phase(Phase::Ended(ending));
                    result
                })
                .context("cannot start the VM thread")?
        };
        let mut local = LocalVm {
            sup,
            thread: Some(thread),
        };
        if let Err(end) = local.sup.wait_ready() {
            return Err(match local.join() {
                Some(Err(e)) => e,
                _ => anyhow!("the VM ended before its shell was up ({})", end.reason),
            });
        }
        Ok(local)
    }

    /// A handle for requests, usable from any thread.
    pub fn control(&self) -> LocalControl {
        LocalControl {
            sup: self.sup.clone(),
        }
    }

    /// Runs a command in the guest's shell, as `hvtrace run --exec` does
    /// (in the console's shell itself, not in a subshell).
    pub fn exec(&self, command: &str) -> Result<ExecResult> {
        self.sup
            .exec_command(command, false)
            .map_err(|refusal| response_error(refusal.response()))
    }

    /// Stops the guest through the hypervisor and waits for the VM to end.
    pub fn stop(mut self) -> Result<StopReport> {
        let reply = self.sup.stop();
        if self.sup.ending().is_none() {
            // The stop did not go through: end the VM the hard way.
            self.kill();
        }
        match self.join() {
            Some(Ok(report)) => Ok(report),
            Some(Err(e)) => Err(match reply.response {
                Response::Ok => e,
                other => response_error(other),
            }),
            None => Err(anyhow!("the VM thread is gone")),
        }
    }

    /// Kills the emulator, if the VM is still there.
    fn kill(&self) {
        let vm = self.sup.vm().take();
        if let Some(mut vm) = vm {
            vm.kill();
        }
    }

    /// Waits for the VM thread and returns its result (once).
    fn join(&mut self) -> Option<Result<StopReport>> {
        let thread = self.thread.take()?;
        Some(
            thread
                .join()
                .unwrap_or_else(|_| Err(anyhow!("the VM thread panicked"))),
        )
    }
}

impl Drop for LocalVm {
    /// A VM that was not stopped is killed.
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.kill();
            let _ = self.join();
        }
    }
}

impl Control for LocalControl {
    fn request(&mut self, request: Request, _timeout: Duration) -> Result<Response> {
        // Every request is bounded on the supervisor's side.
        let reply = self.sup.serve(request);
        Ok(match reply.response {
            Response::Exec { output, status } => {
                let mut whole: String = reply
                    .events
                    .iter()
                    .filter_map(|e| match e {
                        Event::Log { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                whole.push_str(&output);
                Response::Exec {
                    output: whole,
                    status,
                }
            }
            other => other,
        })
    }
}
