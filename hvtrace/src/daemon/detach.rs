//! `hvtrace run --detach`: start a supervisor that keeps the VM, and return
//! once the guest shell is up.
//!
//! The parent resolves everything first (kernel, initramfs, hypervisor image,
//! emulator), so that the supervisor gets explicit absolute paths, then
//! re-runs its own binary as `hvtrace --socket PATH supervise --run-dir DIR
//! ...` in a new session, with stdin closed and stdout and stderr in
//! `DIR/supervisor.log`. It copies that log to its stderr while the guest
//! boots and returns when the supervisor's state file says `ready`, or fails
//! with the supervisor's own error line when it exits first. A Ctrl-C
//! while it waits kills the supervisor, and with it the VM it was booting.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::daemon::serve::{read_state, LOG_FILE};
use crate::vm::config::{Emulator, RunConfig};
use crate::{daemon::socket, sys, vm::image};

/// How much longer than the boot's own limit the parent waits.
const MARGIN: Duration = Duration::from_secs(60);

/// What a successful detach reports.
#[derive(Clone, Debug)]
pub struct Detached {
    /// The control socket.
    pub socket: PathBuf,
    /// The supervisor's process id.
    pub pid: u32,
    /// The run directory (boot image, logs).
    pub run_dir: PathBuf,
    /// From the start to the guest shell answering, as the supervisor saw it.
    pub boot_secs: Option<f64>,
}

/// What `run --detach` takes from its command line besides the VM's
/// configuration (the command line's argument structs stay with the
/// commands, which convert them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DetachOptions {
    /// Accept `nokaslr` in the guest command line (`--allow-nokaslr`); the
    /// supervisor is told so too.
    pub allow_nokaslr: bool,
    /// Keep the run directory (`--keep-dir`); the supervisor is told so.
    pub keep_dir: bool,
    /// Do not copy the supervisor's log to stderr while the guest boots
    /// (`--quiet`).
    pub quiet: bool,
}

/// The arguments that make the supervisor boot exactly `cfg`.
pub fn supervisor_args(
    cfg: &RunConfig,
    opts: &DetachOptions,
    run_dir: &Path,
) -> Result<Vec<String>> {
    let abs = |what: &str, p: &Path| -> Result<String> {
        let p = std::path::absolute(p)
            .with_context(|| format!("cannot resolve {what} {}", p.display()))?;
        p.into_os_string()
            .into_string()
            .map_err(|p| anyhow!("{what} path {} is not UTF-8", PathBuf::from(p).display()))
    };
    let Some(hypervisor) = &cfg.hypervisor else {
        bail!("--detach needs the hypervisor (it serves the control channel)");
    };
    let mut out = vec![
        "supervise".to_string(),
        "--run-dir".to_string(),
        abs("run directory", run_dir)?,
        "--kernel".to_string(),
        abs("kernel", &cfg.kernel)?,
        "--initrd".to_string(),
        abs("initrd", &cfg.initrd)?,
        "--hypervisor".to_string(),
        abs("hypervisor image", hypervisor)?,
        format!("--append={}", cfg.append),
        format!("--memory={}", cfg.memory_mib),
        format!("--cpus={}", cfg.cpus),
        format!("--timeout={}", cfg.timeout.as_secs().max(1)),
        format!("--bochs-ips={}", cfg.bochs_ips),
        format!("--console-cap={}", cfg.console_cap),
        "--quiet".to_string(),
    ];
    match cfg.emulator {
        Emulator::Bochs => out.push("--emulator=bochs".to_string()),
        Emulator::Qemu { kvm } => {
            out.push("--emulator=qemu".to_string());
            if !kvm {
                out.push("--no-kvm".to_string());
            }
        }
    }
    if opts.allow_nokaslr {
        out.push("--allow-nokaslr".to_string());
    }
    if opts.keep_dir {
        out.push("--keep-dir".to_string());
    }
    Ok(out)
}

/// Runs `hvtrace run --detach`; returns the process exit code. `resolve`
/// gives the VM's configuration ([`detach`] says when it is called).
pub fn run(
    opts: &DetachOptions,
    resolve: impl FnOnce() -> Result<RunConfig>,
    socket_path: &Path,
) -> Result<u8> {
    let detached = detach(opts, resolve, socket_path)?;
    let sock = detached.socket.display();
    match detached.boot_secs {
        Some(secs) => eprintln!("hvtrace: VM ready (guest shell up after {secs:.1} s)"),
        None => eprintln!("hvtrace: VM ready"),
    }
    eprintln!(
        "hvtrace: supervisor pid {}; run directory {}",
        detached.pid,
        detached.run_dir.display()
    );
    eprintln!("hvtrace: control socket {sock}");
    eprintln!(
        "hvtrace: next: `hvtrace --socket {sock} status`, `hvtrace --socket {sock} exec CMD`, `hvtrace --socket {sock} stop`"
    );
    Ok(0)
}

/// Starts the supervisor and waits until the guest shell is up. `resolve`
/// gives the VM's configuration; it is called once the socket path has
/// passed its checks, so that a taken socket is refused before anything is
/// built.
pub fn detach(
    opts: &DetachOptions,
    resolve: impl FnOnce() -> Result<RunConfig>,
    socket_path: &Path,
) -> Result<Detached> {
    // Refuse early, before building anything; the supervisor checks again
    // when it binds.
    socket::check_free(socket_path)?;
    if let Some(parent) = socket_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            bail!(
                "cannot create the control socket {}: directory {} does not exist",
                socket_path.display(),
                parent.display()
            );
        }
    }
    let socket_path = std::path::absolute(socket_path)
        .with_context(|| format!("cannot resolve {}", socket_path.display()))?;
    let cfg = resolve()?;
    let dir = image::create_run_dir()?;
    let log_path = dir.join(LOG_FILE);
    let log =
        File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the hvtrace binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("--socket")
        .arg(&socket_path)
        .args(supervisor_args(&cfg, opts, &dir)?)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().context("cannot share the log file")?)
        .stderr(log);
    sys::detach_session(&mut cmd);
    let mut child = cmd.spawn().context("cannot start the supervisor")?;
    let pid = child.id();

    let deadline = Instant::now() + cfg.timeout + MARGIN;
    let mut tail = LogTail::new(&log_path);
    loop {
        if !opts.quiet {
            tail.copy_to(&mut std::io::stderr());
        }
        if let Some(state) = read_state(&dir) {
            if let Some(rest) = state.strip_prefix("ready") {
                return Ok(Detached {
                    socket: socket_path,
                    pid,
                    run_dir: dir,
                    boot_secs: rest.trim().parse().ok(),
                });
            }
        }
        if let Some(status) = child.try_wait().context("cannot check the supervisor")? {
            if !opts.quiet {
                tail.copy_rest_to(&mut std::io::stderr());
            }
            let why = last_error(&log_path)
                .unwrap_or_else(|| format!("the supervisor exited ({status})"));
            bail!(
                "the VM did not come up: {why} (log: {})",
                log_path.display()
            );
        }
        if sys::take_interrupt() {
            // What this command started goes with it: the emulator dies
            // with the supervisor, and the state file says why.
            let _ = child.kill();
            let _ = child.wait();
            crate::daemon::serve::write_state(&dir, "failed: interrupted (Ctrl-C) while booting");
            return Err(anyhow::Error::new(sys::Interrupted).context(format!(
                "the supervisor (pid {pid}) and its VM were stopped (log: {})",
                log_path.display()
            )));
        }
        if Instant::now() >= deadline {
            bail!(
                "the guest shell was not up after {} s; the supervisor (pid {pid}) goes on (log: {})",
                (cfg.timeout + MARGIN).as_secs(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How much of the end of the supervisor's log [`last_error`] reads.
pub const LAST_ERROR_WINDOW: u64 = 64 * 1024;
/// The most bytes [`LogTail`] copies at once.
const TAIL_CHUNK: u64 = 1024 * 1024;

/// The message of the last `hvtrace: error:` line of a log (in its last
/// [`LAST_ERROR_WINDOW`] bytes).
pub fn last_error(log: &Path) -> Option<String> {
    let mut file = File::open(log).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(LAST_ERROR_WINDOW)))
        .ok()?;
    let mut bytes = Vec::new();
    file.take(LAST_ERROR_WINDOW).read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("hvtrace: error: "))
        .map(|m| m.trim().to_string())
}

/// Follows a growing file, copying its lines with control characters
/// escaped ([`crate::term::sanitize`]): the supervisor's log quotes the
/// guest and the hypervisor.
struct LogTail {
    path: PathBuf,
    offset: u64,
}

impl LogTail {
    fn new(path: &Path) -> LogTail {
        LogTail {
            path: path.to_path_buf(),
            offset: 0,
        }
    }

    /// Copies the complete lines appended since the last call (at most
    /// [`TAIL_CHUNK`] bytes, or one cut line that long).
    fn copy_to(&mut self, out: &mut dyn Write) {
        self.copy(out, false);
    }

    /// Copies everything appended since the last call, a last line without
    /// its newline too.
    fn copy_rest_to(&mut self, out: &mut dyn Write) {
        while self.copy(out, true) {}
    }

    /// Copies what was appended; returns whether it copied anything.
    fn copy(&mut self, out: &mut dyn Write, all: bool) -> bool {
        let Ok(mut file) = File::open(&self.path) else {
            return false;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return false;
        }
        let mut buf = Vec::new();
        if file.take(TAIL_CHUNK).read_to_end(&mut buf).is_err() || buf.is_empty() {
            return false;
        }
        let full = buf.len() as u64 == TAIL_CHUNK;
        let end = match buf.iter().rposition(|&b| b == b'\n') {
            Some(i) => i + 1,
            None if all || full => buf.len(),
            None => return false,
        };
        let end = if all { buf.len() } else { end };
        self.offset += end as u64;
        let text = String::from_utf8_lossy(&buf[..end]);
        let _ = out
            .write_all(crate::term::sanitize(&text).as_bytes())
            .and_then(|_| out.flush());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_line_from_the_log() {
        let dir = std::env::temp_dir().join(format!("hvtrace-detach-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        std::fs::write(
            &log,
            "[ 1.0s] starting\nhvtrace: error: first\nnoise\nhvtrace: error: bochs exited\n",
        )
        .unwrap();
        assert_eq!(last_error(&log).as_deref(), Some("bochs exited"));
        std::fs::write(&log, "nothing\n").unwrap();
        assert_eq!(last_error(&log), None);
        let mut tail = LogTail::new(&log);
        let mut out = Vec::new();
        tail.copy_to(&mut out);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .unwrap()
            .write_all(b"more\n")
            .unwrap();
        tail.copy_to(&mut out);
        assert_eq!(out, b"nothing\nmore\n");
        // Control characters are escaped; a line is copied once complete.
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(b"[  2.0s] hypervisor: \x1b]0;owned\x07 title\npart")
            .unwrap();
        let mut out = Vec::new();
        tail.copy_to(&mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[  2.0s] hypervisor: \\x1b]0;owned\\x07 title\n"
        );
        let mut out = Vec::new();
        tail.copy_to(&mut out);
        assert!(out.is_empty());
        file.write_all(b"ial").unwrap();
        tail.copy_rest_to(&mut out);
        assert_eq!(out, b"partial");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_last_error_is_found_in_a_long_log() {
        let dir = std::env::temp_dir().join(format!("hvtrace-detach-long-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        let mut text = String::from("hvtrace: error: too early\n");
        text.push_str(&"noise\n".repeat(100_000));
        text.push_str("hvtrace: error: the last one\nafter\n");
        std::fs::write(&log, &text).unwrap();
        assert_eq!(last_error(&log).as_deref(), Some("the last one"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
