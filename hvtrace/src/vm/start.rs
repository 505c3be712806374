//! Starting a VM: the run directory, the serial listeners, the emulator
//! process with its output readers, and the wait for the emulator to
//! connect the guest console (COM1) and the control channel (COM2).

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::channel::{self, Channel, Endpoint, Listener};
use super::config::{vcpus, Emulator, RunConfig};
use super::console::{self, ConsoleBuffer, Markers};
use super::readers::{spawn_control_tap, spawn_line_reader, spawn_serial_reader};
use super::{bochs, image, qemu, BulkTap, Echo, Inner, Shared, TapCopy, Vm};

/// How long the emulator gets to connect to the serial listeners.
const SERIAL_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a start waits, at most, for one of Bochs' display ports to come
/// free (within the run's own time limit).
const DISPLAY_PORTS_WAIT: Duration = Duration::from_secs(300);

/// Bochs ended at start because its display found no port of
/// [`bochs::RFB_PORTS`] to listen on: another Bochs that started at the
/// same moment took the one it bound, or all are taken. The start is
/// tried again: the race does not repeat (the pause differs), and taken
/// ports come free as their processes end.
#[derive(Debug)]
struct DisplayPortsBusy(String);

impl std::fmt::Display for DisplayPortsBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DisplayPortsBusy {}

/// The pause before start `attempt` (2, 3, ...) after Bochs' display
/// found no port: 1, 2, 4, 8 s, then 10 s, plus up to 0.5 s taken
/// from the clock, so that two launchers that failed together (the bare
/// and the hypervisor run of one comparison) do not retry together.
fn display_retry_pause(attempt: u32) -> Duration {
    let base =
        Duration::from_secs(1u64 << attempt.saturating_sub(2).min(4)).min(Duration::from_secs(10));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos());
    let spread = u64::from(nanos % 500_000_000);
    base + Duration::from_nanos(spread)
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
    ///
    /// Bochs' display takes the first free TCP port of
    /// [`bochs::RFB_PORTS`], and Bochs ends at once when it cannot listen
    /// on any (all taken, or lost to another Bochs starting at the same
    /// moment). The start then says so and tries again, for up to
    /// [`DISPLAY_PORTS_WAIT`] within the run's time limit.
    pub fn start(cfg: RunConfig) -> Result<Vm> {
        cfg.validate()?;
        let start = Instant::now();
        let wait = DISPLAY_PORTS_WAIT.min(cfg.timeout);
        let mut attempt = 1;
        loop {
            match Vm::start_once(cfg.clone(), start) {
                Ok(mut vm) => {
                    vm.start_attempts = attempt;
                    return Ok(vm);
                }
                Err(e) if e.is::<DisplayPortsBusy>() && start.elapsed() < wait => {
                    attempt += 1;
                    let pause = display_retry_pause(attempt);
                    eprintln!(
                        "hvtrace: warning: {e}; starting {} again in {:.1} s (attempt {attempt}, for up to {} s)",
                        cfg.emulator,
                        pause.as_secs_f64(),
                        wait.as_secs()
                    );
                    std::thread::sleep(pause);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One try of [`Vm::start`], whose first try began at `start`.
    fn start_once(cfg: RunConfig, start: Instant) -> Result<Vm> {
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
            start_attempts: 1,
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
                if matches!(self.cfg.emulator, Emulator::Bochs) && bochs::display_ports_busy(&why) {
                    // Nothing of the guest ran: a run directory made for
                    // this try goes with it.
                    self.finished = self.cfg.run_dir.is_none();
                    return Err(anyhow::Error::new(DisplayPortsBusy(format!(
                        "{} exited ({status}) at start: its display found no port of {}-{} to listen on (another Bochs starting at the same moment bound the same one, or all are taken)",
                        self.cfg.emulator,
                        bochs::RFB_PORTS.start(),
                        bochs::RFB_PORTS.end()
                    ))));
                }
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

/// The bytes of console output a run keeps in memory: its console cap, at
/// most [`console::CONSOLE_KEEP`].
fn console_keep(cfg: &RunConfig) -> usize {
    usize::try_from(cfg.console_cap)
        .unwrap_or(usize::MAX)
        .min(console::CONSOLE_KEEP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_after_busy_display_ports_back_off_and_spread() {
        let secs = |a| display_retry_pause(a).as_secs();
        assert_eq!([2, 3, 4, 5, 6, 7, 40].map(secs), [1, 2, 4, 8, 10, 10, 10]);
        let spread = display_retry_pause(2) - Duration::from_secs(1);
        assert!(spread < Duration::from_millis(500), "{spread:?}");
    }
}
