//! One running virtual machine: the emulator process, its log port, the
//! guest console (COM1) and the hypervisor's control channel (COM2), from
//! launch to power-off.
//!
//! A tap reads COM2 for the whole run: it looks for the hypervisor's fatal
//! report (`Event::Fatal`), which goes into the same digest as the log
//! port's lines ([`HvLog::push_fault`]), so that a run learns why the
//! hypervisor died even when the log port is not captured and nobody
//! speaks to the hypervisor; and it copies every byte, as it came, to
//! whoever took the channel ([`Vm::take_control`]).

pub mod bochs;
pub mod bounded;
pub mod channel;
pub mod config;
pub mod console;
pub mod guest;
pub mod host;
pub mod hv_image;
pub mod hvlog;
pub mod image;
pub mod logport;
pub mod qemu;
pub mod shm;
pub mod tcp_table;

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use self::bounded::CappedLog;
use self::channel::{Channel, Endpoint, Listener};
use self::config::{vcpus, Emulator, RunConfig};
use self::console::{ConsoleBuffer, ExecResult, Markers};
use self::hvlog::{HvEvent, HvLog, FAULT_STOP};

/// How long the emulator gets to connect to the serial listeners.
const SERIAL_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the emulator gets to exit by itself after the guest stopped.
const EXIT_GRACE: Duration = Duration::from_secs(15);
/// How long one attempt to reach the shell waits before it sends again.
const SYNC_RETRY: Duration = Duration::from_secs(15);
/// How many lines of the emulator's own output are kept for messages.
const TAIL_LINES: usize = 40;
/// How many hypervisor lines (other than the milestones and errors) are
/// shown as progress; the rest are only in `emulator.stdout.log`.
const MAX_NOTED_HV_LINES: u32 = 1000;

/// Where the reader thread copies the guest console.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Echo {
    Off = 0,
    Stderr = 1,
    Stdout = 2,
}

/// State shared with the reader threads.
struct Shared {
    inner: Mutex<Inner>,
    cv: Condvar,
    echo: AtomicU8,
    progress: bool,
    start: Instant,
    /// Trace frames from the log port, and who takes them.
    bulk: Mutex<BulkTap>,
}

/// What the log port carried as trace frames ([`Vm::set_trace_sink`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BulkStats {
    /// Frames decoded.
    pub frames: u64,
    /// Their bytes on the wire, delimiters included.
    pub bytes: u64,
    /// Segments that did not decode (each was one frame at most).
    pub bad: u64,
    /// Frames whose sequence numbers never came (lost or bad).
    pub missing: u64,
    /// Frames dropped: they came before anyone took them, or they were not
    /// trace text.
    pub unheard: u64,
}

/// Where the log port's trace frames go.
#[derive(Default)]
struct BulkTap {
    sink: Option<Box<dyn FnMut(protocol::Event) + Send>>,
    stats: BulkStats,
    last_seq: Option<u32>,
}

impl BulkTap {
    fn frame(&mut self, frame: protocol::Frame, wire_len: u64) {
        self.stats.frames += 1;
        self.stats.bytes += wire_len;
        if let Some(last) = self.last_seq {
            // A jump backwards (a new hypervisor) counts nothing.
            let ahead = frame.seq.wrapping_sub(last.wrapping_add(1));
            if ahead < 1 << 31 {
                self.stats.missing += u64::from(ahead);
            }
        }
        self.last_seq = Some(frame.seq);
        // Root sends the trace stream (text, or records and their context)
        // and its symbols there and nothing else; anything else is not
        // taken from this path.
        match (frame.body, self.sink.as_mut()) {
            (
                protocol::Body::Event(
                    event @ (protocol::Event::TraceText { .. }
                    | protocol::Event::TraceRecords { .. }
                    | protocol::Event::TraceContext(_)
                    | protocol::Event::SymbolChunk { .. }),
                ),
                Some(sink),
            ) => sink(event),
            _ => self.stats.unheard += 1,
        }
    }
}

#[derive(Default)]
struct Inner {
    /// What the guest wrote on the serial console (its last bytes: the
    /// run's console cap, at most [`console::CONSOLE_KEEP`]).
    console: ConsoleBuffer,
    stdout_eof: bool,
    stderr_eof: bool,
    /// The emulator closed COM2 (the control tap has read everything).
    control_eof: bool,
    hv: HvLog,
    /// The emulator's own last output lines (not the hypervisor's).
    tail: VecDeque<String>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A reader thread that panicked leaves consistent data behind.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the hypervisor's fatal report from the control channel.
    fn fault(&self, reason: &str) {
        let news = self.lock().hv.push_fault(reason);
        if news {
            self.note(&format!("hypervisor error (control channel): {reason}"));
        }
        self.cv.notify_all();
    }

    fn note(&self, message: &str) {
        if self.progress {
            eprintln!(
                "[{:7.1}s] {}",
                self.start.elapsed().as_secs_f64(),
                crate::term::sanitize(message)
            );
        }
    }
}

/// What the guest's stop looked like.
#[derive(Clone, Debug)]
pub struct StopReport {
    /// Why the guest stopped: the hypervisor's `guest stopped:` reason, or for
    /// a bare guest `power off` when it powered off.
    pub reason: String,
    /// The hypervisor's exit counts, when it printed them.
    pub exit_counts: Option<BTreeMap<String, u64>>,
    /// The hypervisor's lines, without the prefix (the last ones, within
    /// [`self::hvlog::MAX_LINES`] and [`self::hvlog::MAX_BYTES`]).
    pub hv_lines: Vec<String>,
    /// From launch to the end of the emulator.
    pub wall_time: Duration,
    /// From launch to the guest shell answering.
    pub boot_time: Option<Duration>,
    /// How the emulator process ended (`None`: killed after the grace period).
    pub emulator_status: Option<ExitStatus>,
}

impl StopReport {
    /// True when the guest powered off.
    pub fn clean(&self) -> bool {
        self.reason == "power off"
    }
}

/// A running emulator with the guest on its console.
pub struct Vm {
    cfg: RunConfig,
    dir: PathBuf,
    /// The file behind the guest's RAM (QEMU with the hypervisor), until
    /// it is claimed ([`Vm::ram_file`] opens it and takes it out of the
    /// file system: a crash then leaves no guest RAM behind).
    ram_path: Option<PathBuf>,
    /// The RAM file, open, once claimed.
    ram: Option<std::fs::File>,
    child: Child,
    status: Option<ExitStatus>,
    shared: Arc<Shared>,
    serial: Option<Channel>,
    /// COM2's way to the hypervisor, until [`Vm::take_control`].
    control: Option<Channel>,
    /// Where the control tap copies what the hypervisor sends.
    control_copy: Arc<Mutex<TapCopy>>,
    readers: Vec<JoinHandle<()>>,
    deadline: Instant,
    boot_time: Option<Duration>,
    markers: Markers,
    seq: u32,
    cursor: usize,
    /// The run ended as it should; the run directory may go.
    finished: bool,
}

/// Starts the emulator and waits until the guest shell answers.
pub fn launch(cfg: RunConfig) -> Result<Vm> {
    let mut vm = Vm::start(cfg)?;
    vm.wait_ready()?;
    Ok(vm)
}

impl Vm {
    /// Builds what the emulator needs in a fresh run directory (or in
    /// [`RunConfig::run_dir`]) and starts it. Returns once the emulator has
    /// connected the guest console and the control channel; use
    /// [`Vm::wait_ready`] to wait for the guest shell.
    ///
    /// The emulator is killed when the thread that calls this ends (Linux's
    /// parent-death signal follows the spawning thread), so that it never
    /// outlives its launcher: keep the `Vm` in the thread that started it.
    pub fn start(cfg: RunConfig) -> Result<Vm> {
        cfg.validate()?;
        let start = Instant::now();
        let dir = match &cfg.run_dir {
            Some(dir) => {
                image::ensure_run_dir(dir)?;
                dir.clone()
            }
            None => image::create_run_dir()?,
        };
        // Undoes what was made when the start fails before the emulator
        // runs: a run directory made here, the guest's RAM file.
        let undo = |ram: Option<&Path>| {
            if cfg.run_dir.is_none() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            if let Some(ram) = ram {
                qemu::remove_ram(&dir, ram);
            }
        };
        // QEMU connects its serial ports to unix sockets in the run
        // directory when their paths fit a socket address; Bochs has TCP
        // only. Either way a connection is used only once it is shown to
        // come from the emulator (see `channel`).
        let qemu = matches!(cfg.emulator, Emulator::Qemu { .. });
        let unix = qemu
            && channel::unix_path_fits(&dir, channel::SERIAL_SOCKET)
            && channel::unix_path_fits(&dir, channel::CONTROL_SOCKET);
        let bind = |name: &str, what: &str| -> Result<Listener> {
            if unix {
                Listener::unix(&dir, name).with_context(|| format!("cannot listen for {what}"))
            } else {
                Listener::tcp().with_context(|| format!("cannot listen for {what}"))
            }
        };
        let bound = bind(channel::SERIAL_SOCKET, "the serial console").and_then(|serial| {
            let control = bind(channel::CONTROL_SOCKET, "the control channel")?;
            Ok((serial, control))
        });
        let (listener, control_listener) = match bound {
            Ok(listeners) => listeners,
            Err(e) => {
                undo(None);
                return Err(e);
            }
        };
        let endpoints = listener
            .endpoint()
            .and_then(|serial| Ok((serial, control_listener.endpoint()?)))
            .context("cannot read the listeners' addresses")?;
        let ram_path = match cfg.emulator {
            Emulator::Qemu { .. } if cfg.hypervisor.is_some() => {
                match qemu::place_ram(&dir, u64::from(cfg.memory_mib) << 20) {
                    Ok(ram) => Some(ram),
                    Err(e) => {
                        undo(None);
                        return Err(e);
                    }
                }
            }
            _ => None,
        };
        let mut command = match prepare(&cfg, &dir, &endpoints.0, &endpoints.1, ram_path.as_deref())
        {
            Ok(command) => command,
            Err(e) => {
                // Nothing ran yet: the messages say all there is to know.
                undo(ram_path.as_deref());
                return Err(e);
            }
        };
        crate::sys::die_with_parent(&mut command);
        // A process group of its own: the Ctrl-C of the terminal goes to
        // hvtrace alone, which stops the guest as it should (the emulator
        // would otherwise die at once, or enter its debugger).
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                console: ConsoleBuffer::with_keep(console_keep(&cfg)),
                ..Inner::default()
            }),
            cv: Condvar::new(),
            bulk: Mutex::new(BulkTap::default()),
            echo: AtomicU8::new(if cfg.echo_boot_console {
                Echo::Stderr as u8
            } else {
                Echo::Off as u8
            }),
            progress: cfg.progress,
            start,
        });
        let what = if cfg.under_hypervisor() {
            "under the hypervisor"
        } else {
            "bare, without the hypervisor"
        };
        shared.note(&format!(
            "starting {} with {} ({what}); run directory {}",
            cfg.emulator,
            vcpus(cfg.cpus),
            dir.display()
        ));
        if qemu && !unix {
            shared.note(&format!(
                "the run directory's path is too long for a unix socket address ({} bytes at most): the serial ports use TCP on 127.0.0.1, with the peer checked",
                channel::MAX_SOCKET_PATH
            ));
        }

        let mut child = match command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                undo(ram_path.as_deref());
                bail!("cannot start {}: {e}", cfg.emulator);
            }
        };
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(spawn_line_reader(
                out,
                dir.join("emulator.stdout.log"),
                shared.clone(),
                true,
            ));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(spawn_line_reader(
                err,
                dir.join("emulator.stderr.log"),
                shared.clone(),
                false,
            ));
        }
        let deadline = start + cfg.timeout;
        let mut vm = Vm {
            cfg,
            dir: dir.clone(),
            ram_path,
            ram: None,
            child,
            status: None,
            shared,
            serial: None,
            control: None,
            readers,
            deadline,
            boot_time: None,
            markers: Markers::unique(),
            seq: 0,
            cursor: 0,
            finished: false,
            control_copy: Arc::new(Mutex::new(TapCopy::Waiting)),
        };
        let [stream, control] = vm.accept_serial([
            (&listener, "the serial console (COM1)"),
            (&control_listener, "the control channel (COM2)"),
        ])?;
        let reader_stream = stream
            .try_clone()
            .context("cannot clone the serial socket")?;
        vm.readers.push(spawn_serial_reader(
            reader_stream,
            dir.join("console.log"),
            vm.cfg.console_cap,
            vm.shared.clone(),
        ));
        let tap_stream = control
            .try_clone()
            .context("cannot clone the control channel socket")?;
        vm.readers.push(spawn_control_tap(
            tap_stream,
            vm.shared.clone(),
            vm.control_copy.clone(),
        ));
        vm.serial = Some(stream);
        vm.control = Some(control);
        Ok(vm)
    }

    /// Waits for the emulator to connect each serial port to its listener.
    /// A connection from any other process is closed and reported, and the
    /// listener waits on.
    fn accept_serial<const N: usize>(
        &mut self,
        listeners: [(&Listener, &str); N],
    ) -> Result<[Channel; N]> {
        for (listener, _) in &listeners {
            listener.set_nonblocking(true)?;
        }
        let until = (Instant::now() + SERIAL_CONNECT_TIMEOUT).min(self.deadline);
        let pid = self.child.id();
        let mut streams: [Option<Channel>; N] = std::array::from_fn(|_| None);
        loop {
            for ((listener, what), slot) in listeners.iter().zip(streams.iter_mut()) {
                if slot.is_some() {
                    continue;
                }
                match listener.accept_from(pid, what) {
                    Ok(channel) => *slot = channel,
                    Err(e) => return Err(self.fail(anyhow!("listener for {what} failed: {e}"))),
                }
            }
            if streams.iter().all(Option::is_some) {
                return Ok(streams.map(|s| s.expect("checked above")));
            }
            let missing = listeners
                .iter()
                .zip(streams.iter())
                .find(|(_, s)| s.is_none())
                .map(|((_, what), _)| *what)
                .unwrap_or("a serial port");
            if let Some(status) = self.poll_exit()? {
                self.drain_readers();
                let why = self.emulator_message();
                return Err(self.fail(anyhow!(
                    "{} exited ({status}) before connecting {missing}{why}",
                    self.cfg.emulator
                )));
            }
            if Instant::now() >= until {
                return Err(self.fail(anyhow!(
                    "{} did not connect {missing} within {} s",
                    self.cfg.emulator,
                    SERIAL_CONNECT_TIMEOUT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

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

    /// The hypervisor's lines so far, without the `hvtrace: ` prefix (the
    /// last ones, within [`self::hvlog::MAX_LINES`] and
    /// [`self::hvlog::MAX_BYTES`]).
    pub fn hv_lines(&self) -> Vec<String> {
        self.shared.lock().hv.lines.clone()
    }

    /// The hypervisor's `error:` messages so far.
    pub fn hv_errors(&self) -> Vec<String> {
        self.shared.lock().hv.errors.clone()
    }

    /// The hypervisor's fatal report as the control channel (COM2)
    /// delivered it, if it did (it is also among [`Vm::hv_errors`]).
    pub fn control_fault(&self) -> Option<String> {
        self.shared.lock().hv.control_fault.clone()
    }

    /// True once the hypervisor printed `guest started`.
    pub fn guest_started(&self) -> bool {
        self.shared.lock().hv.guest_started
    }

    /// The exit counts of the hypervisor's last `exit counts:` line.
    pub fn exit_counts(&self) -> Option<BTreeMap<String, u64>> {
        self.shared.lock().hv.exit_counts.clone()
    }

    /// What the guest console showed so far (its last bytes: the run's
    /// console cap, at most [`console::CONSOLE_KEEP`]).
    pub fn console_text(&self) -> String {
        String::from_utf8_lossy(self.shared.lock().console.bytes()).into_owned()
    }

    /// From launch to the guest shell answering, once it did.
    pub fn boot_time(&self) -> Option<Duration> {
        self.boot_time
    }

    /// Time since launch.
    pub fn elapsed(&self) -> Duration {
        self.shared.start.elapsed()
    }

    /// The run directory: boot image, emulator configuration and logs.
    pub fn run_dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration of this run.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    /// Waits for the emulator to end by itself (it does after a hypervisor
    /// error, for example) and returns its status; `None` when it was still
    /// running after `timeout` and was killed. Marks the run as failed, so the
    /// run directory is kept.
    pub fn wait_exit_or_kill(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        self.finished = false;
        self.wait_exit(timeout)
    }

    /// Ends a run whose failure was expected: kills the emulator and removes
    /// the run directory (unless `keep_dir`).
    pub fn close(mut self) {
        self.kill();
        self.finished = true;
    }

    /// Kills the emulator now.
    pub fn kill(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.serial = None;
        self.drain_readers();
    }

    /// Hands over COM2, the hypervisor's control channel (a byte stream
    /// carrying protocol frames): what the hypervisor sends from now on,
    /// copied by the control tap, and the way to it. Fails after the first
    /// call. What the hypervisor sent before the call was not kept: take
    /// the channel right after [`Vm::start`], before the hypervisor runs.
    /// Keep both open while the emulator runs.
    pub fn take_control(&mut self) -> Result<ControlChannel> {
        let writer = self
            .control
            .take()
            .context("the control channel was handed over already")?;
        let (ours, reader) =
            UnixStream::pair().context("cannot make a socket pair for the control channel")?;
        let mut copy = self.control_copy.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*copy, TapCopy::Closed) {
            *copy = TapCopy::To(ours);
        }
        // Closed: `ours` goes now, and the reader sees the channel's end.
        Ok(ControlChannel { reader, writer })
    }

    /// Lifts the run's time limit (`--timeout`), for a VM that runs until it
    /// is told to stop. Commands keep their own limits ([`Vm::exec_timeout`]).
    pub fn clear_deadline(&mut self) {
        self.deadline = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    }

    /// The emulator's process id.
    pub fn emulator_pid(&self) -> u32 {
        self.child.id()
    }

    /// Hands every trace event the hypervisor writes to its log port to
    /// `sink` (once asked to with `Request::TraceChannel`).
    pub fn set_trace_sink(&self, sink: impl FnMut(protocol::Event) + Send + 'static) {
        self.shared
            .bulk
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sink = Some(Box::new(sink));
    }

    /// Whether the hypervisor's log port reaches this process, so that it
    /// can carry the trace stream: a run with the hypervisor, whose log
    /// port is captured (Bochs always; QEMU unless told not to).
    pub fn reads_log_port(&self) -> bool {
        self.cfg.hypervisor.is_some() && (self.cfg.log_port || self.cfg.emulator == Emulator::Bochs)
    }

    /// Where the hypervisor's trace ring can be read, when guest RAM is a
    /// shared file: QEMU with KVM and the hypervisor (the file, the
    /// machine type, the RAM's bytes).
    ///
    /// The first call opens the file and removes it (and its directory)
    /// from the file system: QEMU keeps its mapping and this process the
    /// open file, and nothing of the guest's RAM outlives them.
    pub fn ram_file(&mut self) -> Option<(std::fs::File, shm::MachineType, u64)> {
        if !matches!(self.cfg.emulator, Emulator::Qemu { kvm: true }) {
            return None;
        }
        if self.ram.is_none() {
            let path = self.ram_path.take()?;
            let bytes = u64::from(self.cfg.memory_mib) << 20;
            let opened = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .and_then(|f| {
                    // A shorter file would fault the mapping past its end.
                    if f.metadata()?.len() < bytes {
                        return Err(std::io::Error::other(format!(
                            "shorter than the guest's {bytes} bytes of RAM"
                        )));
                    }
                    Ok(f)
                });
            qemu::remove_ram(&self.dir, &path);
            match opened {
                Ok(f) => self.ram = Some(f),
                Err(e) => {
                    self.shared
                        .note(&format!("the guest's RAM file {}: {e}", path.display()));
                    return None;
                }
            }
        }
        let file = self.ram.as_ref()?.try_clone().ok()?;
        Some((file, qemu::MACHINE, u64::from(self.cfg.memory_mib) << 20))
    }

    /// A handle that tells, from any thread, whether the VM has ended.
    pub fn watch(&self) -> VmWatch {
        VmWatch {
            shared: self.shared.clone(),
        }
    }

    // ----- internals -----

    /// Waits until `check` gives a value. Fails on a hypervisor error, a guest
    /// stop, the emulator's end or the deadline, and with
    /// [`crate::sys::Interrupted`] on the first Ctrl-C once the CLI catches
    /// it ([`crate::sys::take_interrupt`]; never in a process that does not).
    fn wait_for<T>(
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
    fn wait_quietly<T>(
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
    fn wait_event(&self, deadline: Instant) {
        let tick = Duration::from_millis(200);
        let left = deadline.saturating_duration_since(Instant::now()).min(tick);
        let inner = self.shared.lock();
        let _ = self.shared.cv.wait_timeout(inner, left);
    }

    fn poll_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .context("cannot check the emulator process")?;
        }
        Ok(self.status)
    }

    /// Waits up to `grace` for the emulator to end, then kills it.
    fn wait_exit(&mut self, grace: Duration) -> Result<Option<ExitStatus>> {
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
    fn drain_readers(&mut self) {
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
    fn emulator_message(&self) -> String {
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

    fn timeout_error(&self, what: &str) -> anyhow::Error {
        anyhow!(
            "timed out after {} s waiting for {what} (limit {} s, see --timeout)",
            self.shared.start.elapsed().as_secs(),
            self.cfg.timeout.as_secs()
        )
    }

    /// Marks the run as failed (its directory is kept) and passes `e` on.
    fn fail(&mut self, e: anyhow::Error) -> anyhow::Error {
        self.finished = false;
        e
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
        // The guest's RAM (QEMU with the hypervisor) is not a log: it goes
        // even from a run directory that is kept.
        if let Some(ram) = self.ram_path.take() {
            qemu::remove_ram(&self.dir, &ram);
        }
        if self.finished && !self.cfg.keep_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("hvtrace: run directory kept: {}", self.dir.display());
        }
    }
}

/// COM2 as [`Vm::take_control`] hands it over.
pub struct ControlChannel {
    /// What the hypervisor sends, byte for byte; its end is the channel's.
    pub reader: UnixStream,
    /// The way to the hypervisor.
    pub writer: Channel,
}

/// Where the control tap copies the hypervisor's bytes.
enum TapCopy {
    /// Nobody took the channel yet: the bytes are only looked at.
    Waiting,
    /// To the taker.
    To(UnixStream),
    /// The taker went away.
    Gone,
    /// The emulator closed the channel.
    Closed,
}

/// Reads COM2 for the whole run: hands the hypervisor's fatal report
/// (`Event::Fatal`) to the log digest and copies every byte to whoever took
/// the channel.
fn spawn_control_tap(
    mut stream: Channel,
    shared: Arc<Shared>,
    copy: Arc<Mutex<TapCopy>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut decoder = protocol::FrameDecoder::new();
        let mut buf = [0u8; 4096];
        while let Some(n) = read_some(&mut stream, &mut buf) {
            let data = &buf[..n];
            for result in decoder.feed(data) {
                if let Ok(protocol::Frame {
                    body: protocol::Body::Event(protocol::Event::Fatal { reason }),
                    ..
                }) = result
                {
                    shared.fault(&reason);
                }
            }
            let mut copy = copy.lock().unwrap_or_else(|e| e.into_inner());
            if let TapCopy::To(to) = &mut *copy {
                if to.write_all(data).is_err() {
                    *copy = TapCopy::Gone;
                }
            }
        }
        // Dropping the copy's socket ends the taker's reads.
        *copy.lock().unwrap_or_else(|e| e.into_inner()) = TapCopy::Closed;
        shared.lock().control_eof = true;
        shared.cv.notify_all();
    })
}

/// Watches a [`Vm`] from another thread, without access to the `Vm` itself.
#[derive(Clone)]
pub struct VmWatch {
    shared: Arc<Shared>,
}

impl VmWatch {
    /// A watch over no emulator, which never ends (host tests).
    #[cfg(test)]
    pub fn detached() -> VmWatch {
        VmWatch {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner::default()),
                cv: Condvar::new(),
                echo: AtomicU8::new(Echo::Off as u8),
                progress: false,
                start: Instant::now(),
                bulk: Mutex::new(BulkTap::default()),
            }),
        }
    }

    /// What the log port carried as trace frames so far.
    pub fn trace_port_stats(&self) -> BulkStats {
        self.shared
            .bulk
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stats
    }

    /// Why the VM is over, once it is: the hypervisor's `guest stopped:`
    /// reason, its first error, or the emulator's end (both of its output
    /// streams closed).
    pub fn ended(&self) -> Option<String> {
        let inner = self.shared.lock();
        if let Some(reason) = &inner.hv.stopped {
            return Some(format!("guest stopped: {reason}"));
        }
        if let Some(e) = inner.hv.errors.first() {
            return Some(format!("the hypervisor reported an error: {e}"));
        }
        if inner.stdout_eof && inner.stderr_eof {
            return Some("the emulator exited".to_string());
        }
        None
    }

    /// Sleeps until the VM's output changes or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let inner = self.shared.lock();
        let _ = self.shared.cv.wait_timeout(inner, timeout);
    }
}

/// Writes what the emulator needs into the run directory and returns the
/// command that starts it there. COM1 connects to `serial`, COM2 (the
/// control channel) to `control`.
fn prepare(
    cfg: &RunConfig,
    dir: &Path,
    serial: &Endpoint,
    control: &Endpoint,
    ram: Option<&Path>,
) -> Result<std::process::Command> {
    match cfg.emulator {
        Emulator::Bochs => {
            let (Some(serial_port), Some(control_port)) = (serial.tcp_port(), control.tcp_port())
            else {
                bail!("Bochs connects its serial ports over TCP only");
            };
            image::build_iso(dir, cfg)?;
            bochs::prepare(
                dir,
                &bochs::Machine {
                    iso: "boot.iso",
                    memory_mib: cfg.memory_mib,
                    ips: cfg.bochs_ips,
                    cpu_model: &cfg.bochs_cpu,
                    cpus: cfg.cpus,
                    serial_port,
                    control_port,
                },
            )
        }
        Emulator::Qemu { kvm } => {
            image::stage_file(&cfg.kernel, dir, image::KERNEL_NAME)?;
            image::stage_file(&cfg.initrd, dir, image::INITRD_NAME)?;
            let hv = match &cfg.hypervisor {
                Some(hv) => Some(image::stage_file(hv, dir, image::HYPERVISOR_NAME)?),
                None => None,
            };
            qemu::prepare(
                dir,
                cfg,
                kvm,
                hv.as_deref(),
                qemu::Ports {
                    serial,
                    control,
                    ram: ram.unwrap_or(Path::new(qemu::RAM_FILE)),
                },
            )
        }
    }
}

/// Reads the emulator's stdout or stderr: cuts it into lines (lines
/// longer than [`bounded::MAX_LINE`] in pieces) and, on stdout, the trace
/// frames of the log port ([`logport`]), which go to the trace sink; logs
/// the lines (up to [`bounded::LOG_CAP`]), feeds the hypervisor lines to
/// the log digest and keeps a tail of the rest.
fn spawn_line_reader(
    mut stream: impl Read + Send + 'static,
    log_path: PathBuf,
    shared: Arc<Shared>,
    is_stdout: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut log = CappedLog::create(&log_path, bounded::LOG_CAP).ok();
        let mut demux = logport::LogDemux::new(bounded::MAX_LINE);
        let mut buf = vec![0u8; 64 * 1024];
        let mut noted = 0u32;
        let mut piece = |p: logport::Piece<'_>| match p {
            logport::Piece::Line(line) => {
                if let Some(log) = log.as_mut() {
                    let _ = log.append(line);
                }
                take_line(&shared, line, &mut noted, &log_path);
            }
            logport::Piece::Frame(frame, wire_len) => {
                let mut bulk = shared.bulk.lock().unwrap_or_else(|e| e.into_inner());
                match *frame {
                    Ok(frame) if is_stdout => bulk.frame(frame, wire_len as u64),
                    _ => bulk.stats.bad += 1,
                }
            }
        };
        while let Some(n) = read_some(&mut stream, &mut buf) {
            demux.feed(&buf[..n], &mut piece);
            // Bochs writes the log port a byte per `write`: after a short
            // read, a millisecond lets the pipe fill, so that a busy trace
            // stream costs a read per kilobyte, not a read per byte (the
            // scale test's supervisor spent 37 CPU seconds on 53 MB
            // before).
            if n < SHORT_READ {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        demux.finish(&mut piece);
        let mut inner = shared.lock();
        if is_stdout {
            inner.stdout_eof = true;
        } else {
            inner.stderr_eof = true;
        }
        drop(inner);
        shared.cv.notify_all();
    })
}

/// One line of the emulator's output: the hypervisor's go to the digest
/// (and the first [`MAX_NOTED_HV_LINES`] to the progress notes), the
/// others to the tail.
fn take_line(shared: &Shared, raw: &[u8], noted: &mut u32, log_path: &Path) {
    let line = String::from_utf8_lossy(raw);
    let line = line.trim_end_matches(['\r', '\n']);
    let mut inner = shared.lock();
    let first = !inner.hv.alive();
    match inner.hv.push_line(line) {
        Some(event) => {
            drop(inner);
            if first {
                shared.note("hypervisor started");
            }
            match event {
                HvEvent::GuestStarted => shared.note("guest started"),
                HvEvent::Error(e) => shared.note(&format!("hypervisor error: {e}")),
                HvEvent::GuestStopped(_) | HvEvent::Repeated(_) => {}
                HvEvent::ExitCounts(_) | HvEvent::Text(_) => {
                    *noted = noted.saturating_add(1);
                    if *noted == MAX_NOTED_HV_LINES + 1 {
                        shared.note(&format!(
                            "more than {MAX_NOTED_HV_LINES} hypervisor lines; the rest are only in {}",
                            log_path.display()
                        ));
                    } else if *noted <= MAX_NOTED_HV_LINES {
                        if let Some(body) = self::hvlog::strip_prefix(line) {
                            shared.note(&format!("hypervisor: {body}"));
                        }
                    }
                }
            }
        }
        None => {
            inner.tail.push_back(line.to_string());
            if inner.tail.len() > TAIL_LINES {
                inner.tail.pop_front();
            }
            drop(inner);
        }
    }
    shared.cv.notify_all();
}

/// A read of fewer bytes than this from the emulator's output is followed
/// by a millisecond's pause ([`spawn_line_reader`]).
const SHORT_READ: usize = 512;

/// Reads what `stream` has into `buf`; `None` at its end or on an error.
/// A read interrupted by a signal (the CLI catches Ctrl-C, which may land
/// in a reader thread) is tried again.
fn read_some(stream: &mut impl Read, buf: &mut [u8]) -> Option<usize> {
    loop {
        match stream.read(buf) {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// The bytes of console output a run keeps in memory: its console cap, at
/// most [`console::CONSOLE_KEEP`].
fn console_keep(cfg: &RunConfig) -> usize {
    usize::try_from(cfg.console_cap)
        .unwrap_or(usize::MAX)
        .min(console::CONSOLE_KEEP)
}

/// Reads the guest console: logs it (up to `cap` bytes, the run's
/// [`RunConfig::console_cap`]), keeps its last bytes (the console buffer's
/// bound) and echoes it when asked.
fn spawn_serial_reader(
    mut stream: Channel,
    log_path: PathBuf,
    cap: u64,
    shared: Arc<Shared>,
) -> JoinHandle<()> {
    // A TCP channel acknowledges each read at once: Bochs sends the console
    // a byte per write, with Nagle's algorithm on.
    std::thread::spawn(move || {
        let mut log = CappedLog::create(&log_path, cap).ok();
        let mut buf = [0u8; 4096];
        while let Some(n) = read_some(&mut stream, &mut buf) {
            let data = &buf[..n];
            if let Some(log) = log.as_mut() {
                let _ = log.append(data);
            }
            match shared.echo.load(Ordering::Relaxed) {
                x if x == Echo::Stderr as u8 => {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(data).and_then(|_| err.flush());
                }
                x if x == Echo::Stdout as u8 => {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(data).and_then(|_| out.flush());
                }
                _ => {}
            }
            shared.lock().console.push(data);
            shared.cv.notify_all();
        }
        shared.cv.notify_all();
    })
}
