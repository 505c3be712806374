//! The few C library calls that `std` does not wrap, made through the `nix`
//! crate's wrappers: this file declares no C function or type of its own,
//! and takes its one constant pair (`TCP_QUICKACK`) from the `libc` crate
//! that `nix` re-exports. Every `unsafe` block of the crate is in this file:
//! installing the SIGINT handler and the two `pre_exec` hooks, which `nix`
//! and `std` can only offer as unsafe (and the `setsockopt` call inside the
//! expansion of `nix`'s `sockopt_impl!`).
//!
//! - `mmap(2)`, `munmap(2)`: the host maps the file behind a QEMU guest's
//!   RAM, shared, to read root's trace rings there.
//! - `setsid(2)`: the detached supervisor leaves the terminal's session, so
//!   closing the terminal does not end the VM.
//! - `prctl(PR_SET_PDEATHSIG)`: an emulator dies with the process that
//!   started it, so a killed launcher never leaves Bochs or QEMU behind.
//! - `getuid(2)`, `geteuid(2)`: the default control socket's directory
//!   carries the user id, and is checked to be ours.
//! - `getsockopt(SO_PEERCRED)`: who is at the other end of the control
//!   socket (the supervisor serves its owner and root only; a client talks
//!   only to a supervisor of its owner or root), and which process connected
//!   a serial port's unix socket (it must be the emulator of the run).
//! - `umask(2)`: the control socket is bound with no permission for group
//!   and others, so it is never reachable by them, not even for a moment.
//! - `setsockopt(TCP_QUICKACK)`: Bochs writes a serial port's output to its
//!   socket one byte per `write`, with Nagle's algorithm on, so every byte
//!   after the first of a burst waits for our ACK, which Linux delays by up
//!   to 40 ms. Acknowledging at once takes a control-channel round trip in
//!   Bochs from about 44 ms to about 2 ms.
//! - `sigaction(2)`: the CLI catches the first Ctrl-C, without
//!   `SA_RESTART`, so that a blocking wait returns at once and the command
//!   can stop what it started and finish its output before it exits; the
//!   handler is reset on delivery (`SA_RESETHAND`), so a second Ctrl-C ends
//!   the process as usual.

use std::io;
use std::net::TcpStream;
use std::os::raw::c_int;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nix::sys::prctl;
use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::sys::socket::{getsockopt, setsockopt, sockopt};
use nix::sys::stat::{umask, Mode};
use nix::unistd::{self, Pid};
// `sockopt_impl!` expands to calls of other nix macros and of `libc::`
// paths, which must be in scope where it is used.
use nix::libc;
use nix::{getsockopt_impl, setsockopt_impl, sockopt_impl};

sockopt_impl!(
    /// `TCP_QUICKACK` (Linux): acknowledge at once what arrives. `nix` has
    /// no option of its own for it; its `sockopt_impl!` makes one from the
    /// C library's constants, passed as a C `int`, 0 or 1.
    TcpQuickAck,
    Both,
    libc::IPPROTO_TCP,
    libc::TCP_QUICKACK,
    bool
);

/// An action for SIGINT: `handler`, with `flags`, blocking no other signal
/// while it runs.
fn sigint_action(handler: SigHandler, flags: SaFlags) -> SigAction {
    SigAction::new(handler, flags, SigSet::empty())
}

/// Sets the action for SIGINT; returns the previous one.
fn set_action(action: &SigAction) -> io::Result<SigAction> {
    // SAFETY: the handlers this module installs are the default action and
    // `on_interrupt`, which only stores to atomics (async-signal-safe). The
    // previous action nix reads back is the one the process started with
    // (exec leaves only the default or "ignore") or one installed here, so
    // it holds no handler pointer of unknown origin.
    let old = unsafe { signal::sigaction(Signal::SIGINT, action) }?;
    Ok(old)
}

/// Set by the first SIGINT once [`catch_interrupt`] ran, and kept.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Set by the same SIGINT, until a blocking wait takes it
/// ([`take_interrupt`]).
static PENDING: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_signum: c_int) {
    // Only stores to atomics: async-signal-safe. SA_RESETHAND already put
    // the default action back, so the next SIGINT ends the process.
    INTERRUPTED.store(true, Ordering::SeqCst);
    PENDING.store(true, Ordering::SeqCst);
}

/// Catches the next SIGINT (Ctrl-C): instead of ending the process it sets
/// the flags that [`interrupted`] and [`take_interrupt`] read, and the one
/// after it ends the process as usual. The handler is installed without
/// `SA_RESTART`: a blocking call in progress (a socket read, a wait) fails
/// with `EINTR` instead of going on, so the wait around it notices at once.
/// A signal that comes just before a blocking call starts is not seen by
/// it: waits also poll [`take_interrupt`] in short slices.
pub fn catch_interrupt() -> io::Result<()> {
    set_action(&sigint_action(
        SigHandler::Handler(on_interrupt),
        SaFlags::SA_RESETHAND,
    ))?;
    Ok(())
}

/// True once a SIGINT caught by [`catch_interrupt`] arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// True once per caught SIGINT: the first blocking wait that asks after it
/// gives up (with [`Interrupted`]); the waits after it (those that stop
/// what the command started) go on. [`interrupted`] stays true.
pub fn take_interrupt() -> bool {
    PENDING.swap(false, Ordering::SeqCst)
}

/// The error of a wait that a Ctrl-C ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted (Ctrl-C)")
    }
}

impl std::error::Error for Interrupted {}

/// True when `e` is, or was caused by, a wait that a Ctrl-C ended.
pub fn is_interrupted(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<Interrupted>())
}

/// The real user id of this process.
pub fn uid() -> u32 {
    unistd::getuid().as_raw()
}

/// Bytes free for an unprivileged user on the file system of `path`
/// (`statvfs(2)`).
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    s.blocks_available().checked_mul(s.fragment_size())
}

/// A new directory `PARENT/PREFIXxxxxxx` of this user's alone (mode 0700,
/// a name no other process had: `mkdtemp(3)`).
pub fn make_temp_dir(parent: &std::path::Path, prefix: &str) -> io::Result<std::path::PathBuf> {
    nix::unistd::mkdtemp(&parent.join(format!("{prefix}XXXXXX"))).map_err(io::Error::from)
}

/// Whether `path` is on a tmpfs (`statfs(2)`): what is written there
/// stays in memory.
pub fn is_tmpfs(path: &std::path::Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// The effective user id of this process: whose files it may touch, and
/// whom the control socket belongs to.
pub fn euid() -> u32 {
    unistd::geteuid().as_raw()
}

/// Who is at the other end of a unix socket, as the kernel recorded it
/// when the connection was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// The process that connected (or listened, seen from a client).
    pub pid: u32,
    /// Its effective user id then.
    pub uid: u32,
}

/// The user id of the process at the other end of a unix socket, as the
/// kernel recorded it when the connection was made (`SO_PEERCRED`).
pub fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    peer_cred(stream).map(|cred| cred.uid)
}

/// The process and user id at the other end of a unix socket
/// (`SO_PEERCRED`).
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    // The kernel always fills in the whole `struct ucred`; nix checks the
    // length it reports.
    let cred = getsockopt(stream, sockopt::PeerCredentials)?;
    // `pid_t` is signed: a negative value is refused. (A process that our
    // pid namespace cannot see is given as 0, which passes.)
    let pid = u32::try_from(cred.pid())
        .map_err(|_| io::Error::other("SO_PEERCRED gave no process id"))?;
    Ok(PeerCred {
        pid,
        uid: cred.uid(),
    })
}

/// Serializes the umask changes of [`with_umask`]: the mask is the
/// process's, so two threads must not swap it at the same time.
static UMASK_LOCK: Mutex<()> = Mutex::new(());

/// Runs `f` with the file mode creation mask set to `mask`, then puts the
/// previous mask back. The mask is process-wide: files other threads create
/// meanwhile get it too, which can only make them more private.
pub fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    let _guard = UMASK_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // umask(2) cannot fail; the kernel keeps the permission bits of `mask`.
    let previous = umask(Mode::from_bits_retain(mask));
    let result = f();
    umask(previous);
    result
}

/// Asks the kernel to acknowledge what arrives on `stream` at once instead
/// of delaying the ACK. Linux leaves quick-ACK mode by itself, so call this
/// before every read. Errors are ignored: a delayed ACK is only slower.
pub fn quick_ack(stream: &TcpStream) {
    let _ = setsockopt(stream, TcpQuickAck, &true);
}

/// Makes the child started by `cmd` the leader of a new session (and process
/// group), without a controlling terminal.
pub fn detach_session(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and calls
    // only setsid, which is async-signal-safe; it allocates nothing (an
    // errno becomes an `io::Error` without allocating).
    unsafe {
        cmd.pre_exec(|| {
            unistd::setsid()?;
            Ok(())
        });
    }
}

/// Makes the child started by `cmd` receive SIGKILL when the thread that
/// spawns it ends (Linux delivers the parent-death signal when the spawning
/// *thread* exits), so an emulator never outlives its launcher.
pub fn die_with_parent(cmd: &mut Command) {
    let parent = Pid::from_raw(std::process::id() as c_int);
    // SAFETY: the closure runs in the forked child before exec and calls
    // only prctl and getppid, which are async-signal-safe. It allocates
    // only when the launcher is already gone, to build that error (an
    // errno becomes an `io::Error` without allocating).
    unsafe {
        cmd.pre_exec(move || {
            prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The parent may have died between fork and prctl.
            if unistd::getppid() != parent {
                return Err(io::Error::other("the launcher exited"));
            }
            Ok(())
        });
    }
}

/// A file mapped shared, readable and writable (`mmap(2)` with
/// `MAP_SHARED`), unmapped when dropped: the host's view of the file that
/// backs a QEMU guest's RAM, where root's trace rings live.
pub struct SharedMap {
    ptr: std::ptr::NonNull<std::ffi::c_void>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; what is read
// or written through it is synchronized by the ring's atomics.
unsafe impl Send for SharedMap {}
// SAFETY: as above.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps the first `len` bytes of `file`.
    pub fn map(file: &std::fs::File, len: usize) -> io::Result<SharedMap> {
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let size = std::num::NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "an empty mapping"))?;
        // SAFETY: a fresh mapping chosen by the kernel (no address given),
        // of a file we opened; nothing else in this process refers to it.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                file,
                0,
            )
        }
        .map_err(io::Error::from)?;
        Ok(SharedMap { ptr, len })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped (never: a mapping has a length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ring at byte `offset` of the mapping, `len` bytes long, as its
    /// producer formatted it; or, with `format`, made empty here (the
    /// tests' writer does that).
    pub fn ring(
        &self,
        offset: usize,
        len: usize,
        format: bool,
    ) -> Result<MappedRing<'_>, protocol::ring::RingError> {
        use protocol::ring::{Ring, RingError};
        let end = offset.checked_add(len).ok_or(RingError::NotARing)?;
        if end > self.len {
            return Err(RingError::NotARing);
        }
        // SAFETY: `offset..end` lies within the mapping, which outlives the
        // returned ring (its lifetime is the map's); `attach` and `format`
        // check the alignment and the size they are given.
        let ring = unsafe {
            let base = self.ptr.as_ptr().cast::<u8>().add(offset);
            if format {
                Ring::format(base, len).ok_or(RingError::NotARing)
            } else {
                Ring::attach(base, len)
            }
        }?;
        Ok(MappedRing {
            ring,
            _map: std::marker::PhantomData,
        })
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made, unmapped once; every ring over it
        // borrowed `self`, so none is left.
        let _ = unsafe { nix::sys::mman::munmap(self.ptr, self.len) };
    }
}

/// A ring inside a [`SharedMap`].
pub struct MappedRing<'m> {
    ring: protocol::ring::Ring,
    _map: std::marker::PhantomData<&'m SharedMap>,
}

impl std::borrow::Borrow<protocol::ring::Ring> for MappedRing<'_> {
    fn borrow(&self) -> &protocol::ring::Ring {
        &self.ring
    }
}

impl std::ops::Deref for MappedRing<'_> {
    type Target = protocol::ring::Ring;
    fn deref(&self) -> &protocol::ring::Ring {
        &self.ring
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn uid_matches_proc() {
        let meta = std::fs::metadata("/proc/self/status").unwrap();
        assert_eq!(uid(), meta.uid());
    }

    #[test]
    fn euid_matches_proc() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        // Real, effective, saved, filesystem.
        let effective: u32 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
        assert_eq!(euid(), effective);
    }

    #[test]
    fn peer_of_a_socket_pair_is_us() {
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(peer_uid(&a).unwrap(), euid());
        assert_eq!(peer_uid(&b).unwrap(), euid());
        let us = PeerCred {
            pid: std::process::id(),
            uid: euid(),
        };
        assert_eq!(peer_cred(&a).unwrap(), us);
        assert_eq!(peer_cred(&b).unwrap(), us);
    }

    /// The current mask, without changing it (the caller holds
    /// [`UMASK_LOCK`]).
    fn read_umask() -> u32 {
        // umask cannot fail; the second call puts back the mask the first
        // one returned.
        let mask = umask(Mode::from_bits_retain(0o077));
        umask(mask);
        mask.bits()
    }

    #[test]
    fn umask_is_set_and_restored() {
        let before = {
            let _guard = UMASK_LOCK.lock().unwrap();
            read_umask()
        };
        let inside = with_umask(0o077, read_umask);
        assert_eq!(inside, 0o077);
        let inside = with_umask(0o027, read_umask);
        assert_eq!(inside, 0o027);
        let after = {
            let _guard = UMASK_LOCK.lock().unwrap();
            read_umask()
        };
        assert_eq!(after, before);
    }

    #[test]
    fn quick_ack_on_a_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        quick_ack(&stream);
        // The option is the kernel's TCP_QUICKACK: setting it succeeds, and
        // it reads back as set.
        setsockopt(&stream, TcpQuickAck, &true).unwrap();
        assert!(getsockopt(&stream, TcpQuickAck).unwrap());
    }

    /// The signal tests change the process's SIGINT action and flags:
    /// one at a time.
    static SIGNAL_LOCK: Mutex<()> = Mutex::new(());

    /// The current SIGINT action, put back as it was (the caller holds
    /// [`SIGNAL_LOCK`]; no SIGINT is sent meanwhile). nix sets an action
    /// whenever it reads one: this sets the default, then the one read.
    fn current_action() -> SigAction {
        let current = set_action(&sigint_action(SigHandler::SigDfl, SaFlags::empty())).unwrap();
        set_action(&current).unwrap();
        current
    }

    fn reset() {
        set_action(&sigint_action(SigHandler::SigDfl, SaFlags::empty())).unwrap();
        INTERRUPTED.store(false, Ordering::SeqCst);
        PENDING.store(false, Ordering::SeqCst);
    }

    #[test]
    fn the_first_interrupt_is_caught() {
        let _lock = SIGNAL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        reset();
        catch_interrupt().unwrap();
        assert!(!interrupted());
        assert!(!take_interrupt());
        let installed = current_action();
        assert!(installed.flags().contains(SaFlags::SA_RESETHAND));
        // Without SA_RESTART, blocking calls are not restarted.
        assert!(!installed.flags().contains(SaFlags::SA_RESTART));
        // raise delivers SIGINT to this thread, whose handler is the one
        // just installed.
        signal::raise(Signal::SIGINT).unwrap();
        assert!(interrupted());
        // One wait takes it; the next ones do not see it again.
        assert!(take_interrupt());
        assert!(!take_interrupt());
        assert!(interrupted());
        // The default action is back: the next Ctrl-C ends the process.
        assert!(matches!(current_action().handler(), SigHandler::SigDfl));
        reset();
    }

    #[test]
    fn an_interrupt_ends_a_blocking_read() {
        use std::io::Read;
        use std::os::unix::thread::JoinHandleExt;
        use std::time::{Duration, Instant};
        let _lock = SIGNAL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        reset();
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // A read with no time limit, on a socket nobody writes to.
        let reader = std::thread::spawn(move || {
            let mut byte = [0u8; 1];
            let result = ours.read(&mut byte);
            let _ = tx.send(result.map_err(|e| e.kind()));
        });
        let thread = reader.as_pthread_t();
        let start = Instant::now();
        let mut result = None;
        // The signal may reach the thread before its read starts; then send
        // it again (the handler is put back first, so it is always caught).
        for _ in 0..50 {
            catch_interrupt().unwrap();
            // The thread is not joined yet, so its handle is valid (a thread
            // that just ended makes this fail with ESRCH, which is
            // harmless); SIGINT is caught by our handler.
            let _ = nix::sys::pthread::pthread_kill(thread, Signal::SIGINT);
            if let Ok(r) = rx.recv_timeout(Duration::from_millis(100)) {
                result = Some(r);
                break;
            }
        }
        if result.is_none() {
            // Unblock the thread before failing.
            drop(theirs);
            let _ = reader.join();
            reset();
            panic!("the read went on after SIGINT");
        }
        reader.join().unwrap();
        assert_eq!(result, Some(Err(io::ErrorKind::Interrupted)));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(interrupted() && take_interrupt());
        drop(theirs);
        reset();
    }

    #[test]
    fn detached_child_leads_its_session() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "cut -d' ' -f6 /proc/self/stat; echo $$"]);
        detach_session(&mut cmd);
        die_with_parent(&mut cmd);
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let session: u32 = lines.next().unwrap().trim().parse().unwrap();
        let pid: u32 = lines.next().unwrap().trim().parse().unwrap();
        // `cut` runs in the shell's session, whose id is the shell's pid.
        assert_eq!(session, pid);
    }
}
