//! Waiting on a VM: for what the guest console or the hypervisor says,
//! for the emulator's end, and the errors a wait ends with (a hypervisor
//! error, a guest stop, the emulator's end, the deadline, a Ctrl-C).

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use super::{bochs, Inner, Vm};

impl Vm {
    /// Waits until `check` gives a value. Fails on a hypervisor error, a guest
    /// stop, the emulator's end or the deadline, and with
    /// [`crate::sys::Interrupted`] on the first Ctrl-C once the CLI catches
    /// it ([`crate::sys::take_interrupt`]; never in a process that does not).
    pub(super) fn wait_for<T>(
        &mut self,
        what: &str,
        deadline: Instant,
        mut check: impl FnMut(&Inner) -> Option<T>,
    ) -> Result<T> {
        loop {
            if crate::sys::take_interrupt() {
                return Err(self.fail(
                    anyhow::Error::new(crate::sys::Interrupted)
                        .context(format!("while waiting for {what}")),
                ));
            }
            {
                let inner = self.shared.lock();
                if let Some(value) = check(&inner) {
                    return Ok(value);
                }
                if let Some(e) = inner.hv.errors.first() {
                    let e = e.clone();
                    drop(inner);
                    return Err(self.fail(anyhow!("the hypervisor reported an error: {e}")));
                }
                if let Some(reason) = &inner.hv.stopped {
                    let reason = reason.clone();
                    drop(inner);
                    return Err(self.fail(anyhow!(
                        "the guest stopped ({reason}) while waiting for {what}"
                    )));
                }
            }
            if let Some(status) = self.poll_exit()? {
                self.drain_readers();
                if let Some(value) = check(&self.shared.lock()) {
                    return Ok(value);
                }
                let error = self.shared.lock().hv.errors.first().cloned();
                if let Some(e) = error {
                    return Err(self.fail(anyhow!("the hypervisor reported an error: {e}")));
                }
                let why = self.emulator_message();
                return Err(self.fail(anyhow!(
                    "{} exited ({status}) while waiting for {what}{why}",
                    self.cfg.emulator
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.fail(self.timeout_error(what)));
            }
            self.wait_event(deadline);
        }
    }

    /// Like [`Vm::wait_for`], but returns `Ok(None)` at `until` instead of
    /// failing (the other failures still fail).
    pub(super) fn wait_quietly<T>(
        &mut self,
        until: Instant,
        mut check: impl FnMut(&Inner) -> Option<T>,
    ) -> Result<Option<T>> {
        let far = self.deadline.max(until) + Duration::from_secs(1);
        self.wait_for("the guest", far, |inner| {
            if let Some(v) = check(inner) {
                return Some(Some(v));
            }
            if Instant::now() >= until {
                return Some(None);
            }
            None
        })
    }

    /// Sleeps until a reader reports something or a short tick passes.
    pub(super) fn wait_event(&self, deadline: Instant) {
        let tick = Duration::from_millis(200);
        let left = deadline.saturating_duration_since(Instant::now()).min(tick);
        let inner = self.shared.lock();
        let _ = self.shared.cv.wait_timeout(inner, left);
    }

    pub(super) fn poll_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .context("cannot check the emulator process")?;
        }
        Ok(self.status)
    }

    /// Waits up to `grace` for the emulator to end, then kills it.
    pub(super) fn wait_exit(&mut self, grace: Duration) -> Result<Option<ExitStatus>> {
        let until = Instant::now() + grace;
        loop {
            if let Some(status) = self.poll_exit()? {
                self.drain_readers();
                return Ok(Some(status));
            }
            if Instant::now() >= until {
                self.shared.note(&format!(
                    "{} did not exit within {} s; killing it",
                    self.cfg.emulator,
                    grace.as_secs()
                ));
                self.kill();
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Gives the reader threads a moment to take the last output of an
    /// emulator that ended.
    pub(super) fn drain_readers(&mut self) {
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            {
                let inner = self.shared.lock();
                if inner.stdout_eof && inner.stderr_eof && inner.control_eof {
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let done: Vec<_> = self.readers.iter().map(|r| r.is_finished()).collect();
        let mut keep = Vec::new();
        for (reader, finished) in self.readers.drain(..).zip(done) {
            if finished {
                let _ = reader.join();
            } else {
                keep.push(reader);
            }
        }
        self.readers = keep;
    }

    /// `: <message>` from the emulator's last words, or nothing.
    pub(super) fn emulator_message(&self) -> String {
        let inner = self.shared.lock();
        let message = bochs::exit_message(inner.tail.iter().map(String::as_str)).or_else(|| {
            inner
                .tail
                .iter()
                .rev()
                .map(|l| l.trim())
                .find(|l| !l.is_empty() && !l.starts_with("==="))
                .map(str::to_string)
        });
        match message {
            Some(m) => format!(": {m}"),
            None => String::new(),
        }
    }

    pub(super) fn timeout_error(&self, what: &str) -> anyhow::Error {
        anyhow!(
            "timed out after {} s waiting for {what} (limit {} s, see --timeout)",
            self.shared.start.elapsed().as_secs(),
            self.cfg.timeout.as_secs()
        )
    }

    /// Marks the run as failed (its directory is kept) and passes `e` on.
    pub(super) fn fail(&mut self, e: anyhow::Error) -> anyhow::Error {
        self.finished = false;
        e
    }
}
