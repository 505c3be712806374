//! The guest's shell over the console: waiting for it to answer after
//! boot, running commands in it, and stopping the guest, by itself, by a
//! power-off or from the interactive console.

use std::io::{BufRead, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::console::{self, ExecResult};
use super::hvlog::FAULT_STOP;
use super::{Echo, StopReport, Vm};

/// How long the emulator gets to exit by itself after the guest stopped.
const EXIT_GRACE: Duration = Duration::from_secs(15);
/// How long one attempt to reach the shell waits before it sends again.
const SYNC_RETRY: Duration = Duration::from_secs(15);

impl Vm {
    /// Waits until the guest shell answers: the guest's ready line, then a
    /// marker echoed by the shell.
    pub fn wait_ready(&mut self) -> Result<()> {
        let ready = console::READY_LINE.as_bytes();
        let deadline = self.deadline;
        let ready_at = self.wait_for(
            "the guest to boot (HVTRACE-GUEST-READY)",
            deadline,
            |inner| {
                let c = &inner.console;
                console::find(c.bytes(), ready).map(|pos| c.start() + pos + ready.len())
            },
        )?;
        self.shared.echo.store(Echo::Off as u8, Ordering::Relaxed);
        self.shared
            .note("guest ready line seen; waiting for its shell");
        // Give the shell a moment to print its prompt before the first sync.
        let prompt_by = (Instant::now() + Duration::from_secs(10)).min(deadline);
        let prompt = console::PROMPT.as_bytes();
        let _ = self.wait_quietly(prompt_by, |inner| {
            console::find(inner.console.since(ready_at), prompt).map(|_| ())
        });
        let mut sent = Vec::new();
        let after = loop {
            self.seq += 1;
            sent.push(self.seq);
            let line = self.markers.sync_line(self.seq);
            self.send(line.as_bytes())?;
            let attempt_by = (Instant::now() + SYNC_RETRY).min(deadline);
            let markers = self.markers.clone();
            let numbers = sent.clone();
            let found = self.wait_quietly(attempt_by, |inner| {
                let c = &inner.console;
                markers
                    .find_sync(c.bytes(), c.index(ready_at), &numbers)
                    .map(|end| c.start() + end)
            })?;
            if let Some(after) = found {
                break after;
            }
            if Instant::now() >= deadline {
                return Err(self.fail(self.timeout_error("the guest shell to answer")));
            }
        };
        self.cursor = after;
        let boot = self.shared.start.elapsed();
        self.boot_time = Some(boot);
        self.shared.echo.store(Echo::Off as u8, Ordering::Relaxed);
        self.shared.note(&format!(
            "guest shell ready (boot took {:.1} s)",
            boot.as_secs_f64()
        ));
        Ok(())
    }

    /// Runs one shell command in the guest and returns its output and status.
    pub fn exec(&mut self, cmd: &str) -> Result<ExecResult> {
        let deadline = self.deadline;
        self.exec_until(cmd, deadline)
    }

    /// Like [`Vm::exec`], with its own time limit (never past the run's).
    pub fn exec_timeout(&mut self, cmd: &str, timeout: Duration) -> Result<ExecResult> {
        let deadline = (Instant::now() + timeout).min(self.deadline);
        self.exec_until(cmd, deadline)
    }

    fn exec_until(&mut self, cmd: &str, deadline: Instant) -> Result<ExecResult> {
        if self.boot_time.is_none() {
            bail!("the guest shell is not ready (call wait_ready first)");
        }
        if cmd.contains('\0') {
            bail!("the command holds a NUL byte, which no shell command can");
        }
        self.seq += 1;
        let n = self.seq;
        let line = self.markers.exec_line(n, cmd);
        if line.len() > console::MAX_LINE {
            bail!(
                "command too long for the guest tty ({} bytes as sent, control bytes and quotes escaped; at most {})",
                line.len(),
                console::MAX_LINE
            );
        }
        self.send(line.as_bytes())?;
        let markers = self.markers.clone();
        let from = self.cursor;
        let what = format!("`{cmd}` to finish");
        // Long outputs arrive in many small reads: search only what is new
        // (plus a margin for a marker line cut between reads), never the
        // whole output again, or waiting grows with the square of its size.
        // Positions are the console buffer's, which stay valid when it
        // drops old output.
        let scanned = std::cell::Cell::new(from);
        let (result, after) = self.wait_for(&what, deadline, |inner| {
            let c = &inner.console;
            let start = scanned.get();
            scanned.set(c.end().saturating_sub(console::MARKER_MARGIN).max(from));
            let (mut result, after) =
                markers.find_exec_from(c.bytes(), c.index(from), c.index(start), n)?;
            if c.start() > from
                && console::find(c.bytes(), markers.printed('B', n).as_bytes()).is_none()
            {
                // The output was longer than the console buffer keeps.
                result.output = format!(
                    "[hvtrace: the start of this output was dropped: the console buffer keeps the last {} bytes]\n{}",
                    c.keep(),
                    result.output
                );
            }
            Some((result, c.start() + after))
        })?;
        self.cursor = after;
        Ok(result)
    }

    /// Sends raw bytes to the guest console.
    pub fn send(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(stream) = self.serial.as_mut() else {
            bail!("the serial console is not connected");
        };
        if let Err(e) = stream.write_all(bytes).and_then(|_| stream.flush()) {
            return Err(self.fail(anyhow!("cannot write to the guest console: {e}")));
        }
        Ok(())
    }

    /// Interrupts the command the guest shell runs, as a Ctrl-C on its
    /// terminal would: sends the tty's interrupt character, which the line
    /// discipline turns into SIGINT for the foreground job; the shell then
    /// drops the rest of that command line (its end marker with it) and
    /// reads the next line. At the prompt it only gives a new prompt.
    pub fn interrupt_command(&mut self) -> Result<()> {
        self.send(b"\x03")
    }

    /// Powers the guest off (the shell exits, `/init` runs `poweroff -f`),
    /// waits for the stop and for the emulator to end.
    pub fn poweroff(mut self) -> Result<StopReport> {
        // The shell may be gone already; the stop is what counts.
        let _ = self.send(b"exit\n");
        self.wait_stop()
    }

    /// Waits for the guest to stop by itself (for example after `poweroff`
    /// sent by the caller), then for the emulator to end.
    pub fn wait_stop(mut self) -> Result<StopReport> {
        let deadline = self.deadline;
        let bare = !self.cfg.under_hypervisor();
        let from = self.cursor;
        let power_down = console::POWER_DOWN.as_bytes();
        // Wait for the stop: the hypervisor's line, or for a bare guest the
        // kernel's power-down message or the end of the emulator.
        let mut reason = None;
        loop {
            {
                let inner = self.shared.lock();
                if let Some(r) = &inner.hv.stopped {
                    reason = Some(r.clone());
                } else if let Some(e) = inner.hv.errors.first() {
                    let e = e.clone();
                    drop(inner);
                    return Err(self.fail(anyhow!("the hypervisor reported an error: {e}")));
                } else if bare && console::find(inner.console.since(from), power_down).is_some() {
                    reason = Some("power off".to_string());
                }
            }
            if reason.is_some() {
                break;
            }
            if let Some(status) = self.poll_exit()? {
                self.drain_readers();
                let inner = self.shared.lock();
                if let Some(r) = &inner.hv.stopped {
                    reason = Some(r.clone());
                } else if bare {
                    // Bochs exits with status 1 on an ACPI power-off too.
                    let acpi_off = inner.tail.iter().any(|l| l.contains("soft power off"));
                    if status.success() || acpi_off {
                        reason = Some("power off".to_string());
                    }
                }
                drop(inner);
                if reason.is_some() {
                    break;
                }
                let why = self.emulator_message();
                return Err(self.fail(anyhow!(
                    "{} exited ({status}) before the guest stopped{why}",
                    self.cfg.emulator
                )));
            }
            if crate::sys::take_interrupt() {
                // A Ctrl-C (caught by the CLI) while the guest runs on its
                // own, as on the interactive console, or shuts down: end
                // the shell's command and have the shell exit, which
                // powers the guest off.
                self.shared
                    .note("Ctrl-C: interrupting the guest's command and powering off");
                let _ = self.interrupt_command();
                std::thread::sleep(Duration::from_millis(300));
                let _ = self.send(b"exit\n");
            }
            if Instant::now() >= deadline {
                return Err(self.fail(self.timeout_error("the guest to stop")));
            }
            self.wait_event(deadline);
        }
        let mut reason = reason.unwrap_or_default();
        if reason == FAULT_STOP {
            // The fatal path's stop: say what the fault was.
            if let Some(e) = self.shared.lock().hv.errors.first() {
                reason = format!("{FAULT_STOP}: {e}");
            }
        }
        self.shared.note(&format!("guest stopped: {reason}"));
        let emulator_status = self.wait_exit(EXIT_GRACE)?;
        let inner = self.shared.lock();
        let report = StopReport {
            reason,
            exit_counts: inner.hv.exit_counts.clone(),
            hv_lines: inner.hv.lines.clone(),
            wall_time: self.shared.start.elapsed(),
            boot_time: self.boot_time,
            emulator_status,
        };
        drop(inner);
        self.finished = true;
        Ok(report)
    }

    /// Connects the terminal to the guest console until the guest stops:
    /// console output goes to stdout, stdin lines to the guest, and the end
    /// of stdin powers the guest off. The run's time limit does not apply.
    pub fn interact(mut self) -> Result<StopReport> {
        let Some(stream) = self.serial.as_ref() else {
            bail!("the serial console is not connected");
        };
        let mut to_guest = stream
            .try_clone()
            .context("cannot clone the serial socket")?;
        {
            // Show what the guest printed since the shell answered.
            let inner = self.shared.lock();
            let pending = inner.console.since(self.cursor);
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(pending).and_then(|_| out.flush());
            self.shared
                .echo
                .store(Echo::Stdout as u8, Ordering::Relaxed);
            self.cursor = inner.console.end();
        }
        let _ = to_guest.write_all(b"\n");
        // The thread ends with stdin's end or the socket's; it is not joined,
        // because a read of the terminal cannot be interrupted.
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            let mut line = String::new();
            loop {
                line.clear();
                match stdin.lock().read_line(&mut line) {
                    Ok(0) | Err(_) => {
                        let _ = to_guest.write_all(b"exit\n");
                        break;
                    }
                    Ok(_) => {
                        if to_guest.write_all(line.as_bytes()).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        self.deadline = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        self.wait_stop()
    }
}
