//! The few C library calls that `std` does not wrap. Every `unsafe` block of
//! the crate is in this file.
//!
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
use std::os::fd::AsRawFd;
use std::os::raw::{c_int, c_uint, c_ulong, c_void};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

mod ffi {
    use std::os::raw::{c_int, c_uint, c_void};

    extern "C" {
        pub fn setsid() -> c_int;
        pub fn getuid() -> u32;
        pub fn geteuid() -> u32;
        pub fn umask(mask: u32) -> u32;
        pub fn getsockopt(
            fd: c_int,
            level: c_int,
            name: c_int,
            value: *mut c_void,
            len: *mut c_uint,
        ) -> c_int;
        pub fn getppid() -> c_int;
        pub fn prctl(option: c_int, ...) -> c_int;
        pub fn sigaction(
            signum: c_int,
            action: *const super::SigAction,
            old: *mut super::SigAction,
        ) -> c_int;
        pub fn setsockopt(
            fd: c_int,
            level: c_int,
            name: c_int,
            value: *const c_void,
            len: c_uint,
        ) -> c_int;
    }
}

/// `IPPROTO_TCP`.
const IPPROTO_TCP: c_int = 6;
/// `TCP_QUICKACK` from `<linux/tcp.h>`.
const TCP_QUICKACK: c_int = 12;

/// `SOL_SOCKET`.
const SOL_SOCKET: c_int = 1;
/// `SO_PEERCRED` from `<asm-generic/socket.h>`.
const SO_PEERCRED: c_int = 17;

/// `struct ucred` from `<sys/socket.h>`: what `SO_PEERCRED` fills in.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Ucred {
    pid: i32,
    uid: u32,
    gid: u32,
}

/// `PR_SET_PDEATHSIG` from `<linux/prctl.h>`.
const PR_SET_PDEATHSIG: c_int = 1;
/// `SIGKILL`.
const SIGKILL: c_ulong = 9;

/// `SIGINT`.
const SIGINT: c_int = 2;
/// `SIG_DFL`: the default action.
const SIG_DFL: usize = 0;
/// `SA_RESETHAND` from `<asm-generic/signal.h>`: the default action is put
/// back as the signal is delivered.
const SA_RESETHAND: c_int = 0x8000_0000_u32 as c_int;

/// `struct sigaction` as the C library takes it on Linux (glibc and musl,
/// x86-64 and arm64): the handler, the mask of 1024 signals, the flags,
/// then the restorer, which the library fills in.
#[repr(C)]
#[derive(Clone, Copy)]
struct SigAction {
    handler: usize,
    mask: [u64; 16],
    flags: c_int,
    restorer: usize,
}

impl SigAction {
    fn new(handler: usize, flags: c_int) -> SigAction {
        SigAction {
            handler,
            mask: [0; 16],
            flags,
            restorer: 0,
        }
    }
}

/// Sets the action for `signum`; returns the previous one.
fn set_action(signum: c_int, action: &SigAction) -> io::Result<SigAction> {
    let mut old = SigAction::new(SIG_DFL, 0);
    // SAFETY: both pointers are to live `struct sigaction`s of the C
    // layout; the kernel and the C library only read `action` and write
    // `old`.
    let rc = unsafe { ffi::sigaction(signum, action, &mut old) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
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
    let handler: extern "C" fn(c_int) = on_interrupt;
    set_action(SIGINT, &SigAction::new(handler as usize, SA_RESETHAND))?;
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
    // SAFETY: getuid takes no arguments, touches no memory of ours and
    // cannot fail (POSIX).
    unsafe { ffi::getuid() }
}

/// The effective user id of this process: whose files it may touch, and
/// whom the control socket belongs to.
pub fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and
    // cannot fail (POSIX).
    unsafe { ffi::geteuid() }
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
    let mut cred = Ucred::default();
    let mut len = std::mem::size_of::<Ucred>() as c_uint;
    // SAFETY: the descriptor belongs to `stream`, which outlives the call;
    // the value points at a live, writable ucred whose size is in `len`,
    // which points at a live c_uint.
    let rc = unsafe {
        ffi::getsockopt(
            stream.as_raw_fd(),
            SOL_SOCKET,
            SO_PEERCRED,
            (&mut cred as *mut Ucred).cast::<c_void>(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<Ucred>() {
        return Err(io::Error::other("SO_PEERCRED returned a short answer"));
    }
    let pid =
        u32::try_from(cred.pid).map_err(|_| io::Error::other("SO_PEERCRED gave no process id"))?;
    Ok(PeerCred { pid, uid: cred.uid })
}

/// Serializes the umask changes of [`with_umask`]: the mask is the
/// process's, so two threads must not swap it at the same time.
static UMASK_LOCK: Mutex<()> = Mutex::new(());

/// Runs `f` with the file mode creation mask set to `mask`, then puts the
/// previous mask back. The mask is process-wide: files other threads create
/// meanwhile get it too, which can only make them more private.
pub fn with_umask<T>(mask: u32, f: impl FnOnce() -> T) -> T {
    let _guard = UMASK_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: umask cannot fail and touches no memory of ours (POSIX).
    let previous = unsafe { ffi::umask(mask) };
    let result = f();
    // SAFETY: as above; this restores the mask read by the first call.
    unsafe {
        ffi::umask(previous);
    }
    result
}

/// Asks the kernel to acknowledge what arrives on `stream` at once instead
/// of delaying the ACK. Linux leaves quick-ACK mode by itself, so call this
/// before every read. Errors are ignored: a delayed ACK is only slower.
pub fn quick_ack(stream: &TcpStream) {
    let one: c_int = 1;
    // SAFETY: the descriptor belongs to `stream`, which outlives the call;
    // the option value points at a live c_int whose size is passed along.
    unsafe {
        ffi::setsockopt(
            stream.as_raw_fd(),
            IPPROTO_TCP,
            TCP_QUICKACK,
            (&one as *const c_int).cast::<c_void>(),
            std::mem::size_of::<c_int>() as c_uint,
        );
    }
}

/// Makes the child started by `cmd` the leader of a new session (and process
/// group), without a controlling terminal.
pub fn detach_session(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and calls
    // only setsid, which is async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if ffi::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes the child started by `cmd` receive SIGKILL when the thread that
/// spawns it ends (Linux delivers the parent-death signal when the spawning
/// *thread* exits), so an emulator never outlives its launcher.
pub fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as c_int;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only prctl and getppid, which are async-signal-safe; it allocates
    // nothing. prctl(PR_SET_PDEATHSIG, sig) reads its second argument as an
    // unsigned long, which is what is passed.
    unsafe {
        cmd.pre_exec(move || {
            if ffi::prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl.
            if ffi::getppid() != parent {
                return Err(io::Error::other("the launcher exited"));
            }
            Ok(())
        });
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
        // SAFETY: umask cannot fail; the second call puts back the mask
        // the first one returned.
        unsafe {
            let mask = ffi::umask(0o077);
            ffi::umask(mask);
            mask
        }
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
    }

    /// The signal tests change the process's SIGINT action and flags:
    /// one at a time.
    static SIGNAL_LOCK: Mutex<()> = Mutex::new(());

    /// The current SIGINT action, left as it is.
    fn current_action() -> SigAction {
        let mut old = SigAction::new(SIG_DFL, 0);
        // SAFETY: a null action only queries; `old` is a live sigaction.
        let rc = unsafe { ffi::sigaction(SIGINT, std::ptr::null(), &mut old) };
        assert_eq!(rc, 0);
        old
    }

    fn reset() {
        set_action(SIGINT, &SigAction::new(SIG_DFL, 0)).unwrap();
        INTERRUPTED.store(false, Ordering::SeqCst);
        PENDING.store(false, Ordering::SeqCst);
    }

    #[test]
    fn the_first_interrupt_is_caught() {
        extern "C" {
            fn raise(signum: c_int) -> c_int;
        }
        let _lock = SIGNAL_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        reset();
        catch_interrupt().unwrap();
        assert!(!interrupted());
        assert!(!take_interrupt());
        let installed = current_action();
        assert_eq!(installed.flags & SA_RESETHAND, SA_RESETHAND);
        // Without SA_RESTART (0x10000000), blocking calls are not restarted.
        assert_eq!(installed.flags & 0x1000_0000, 0);
        // SAFETY: raise delivers SIGINT to this thread, whose handler is
        // the one just installed.
        assert_eq!(unsafe { raise(SIGINT) }, 0);
        assert!(interrupted());
        // One wait takes it; the next ones do not see it again.
        assert!(take_interrupt());
        assert!(!take_interrupt());
        assert!(interrupted());
        // The default action is back: the next Ctrl-C ends the process.
        assert_eq!(current_action().handler, SIG_DFL);
        reset();
    }

    #[test]
    fn an_interrupt_ends_a_blocking_read() {
        use std::io::Read;
        use std::os::unix::thread::JoinHandleExt;
        use std::time::{Duration, Instant};
        extern "C" {
            fn pthread_kill(thread: std::os::unix::thread::RawPthread, signum: c_int) -> c_int;
        }
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
            // SAFETY: the thread is not joined yet, so its handle is valid
            // (a thread that just ended makes this fail with ESRCH, which is
            // harmless); SIGINT is caught by our handler.
            unsafe {
                pthread_kill(thread, SIGINT);
            }
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
