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
//!
//! This module holds the [`Vm`], its reports and what it shares with its
//! threads; starting one is in `start`, the guest's shell (the wait for it
//! after boot, commands, the stop) in `shell`, the waits on the emulator
//! in `wait`, and the threads that read the emulator in `readers`.

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

mod readers;
mod shell;
mod start;
mod wait;

use std::collections::{BTreeMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use self::channel::Channel;
use self::config::{Emulator, RunConfig};
use self::console::{ConsoleBuffer, Markers};
use self::hvlog::HvLog;

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
    /// How many times the emulator was started (more than 1 when Bochs'
    /// display found no port to listen on).
    start_attempts: u32,
}

/// Starts the emulator and waits until the guest shell answers.
pub fn launch(cfg: RunConfig) -> Result<Vm> {
    let mut vm = Vm::start(cfg)?;
    vm.wait_ready()?;
    Ok(vm)
}

impl Vm {
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

    /// How many times [`Vm::start`] started the emulator: 1, or more when
    /// Bochs' display found no port to listen on and the start waited.
    pub fn start_attempts(&self) -> u32 {
        self.start_attempts
    }

    /// A handle that tells, from any thread, whether the VM has ended.
    pub fn watch(&self) -> VmWatch {
        VmWatch {
            shared: self.shared.clone(),
        }
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
