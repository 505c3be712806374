//! The few C library calls that `std` does not wrap. Every `unsafe` block of
//! the crate is in this file.
//!
//! - `setsid(2)`: the detached supervisor leaves the terminal's session, so
//!   closing the terminal does not end the VM.
//! - `prctl(PR_SET_PDEATHSIG)`: an emulator dies with the process that
//!   started it, so a killed launcher never leaves Bochs or QEMU behind.
//! - `getuid(2)`: the default control socket name carries the user id.
//! - `setsockopt(TCP_QUICKACK)`: Bochs writes a serial port's output to its
//!   socket one byte per `write`, with Nagle's algorithm on, so every byte
//!   after the first of a burst waits for our ACK, which Linux delays by up
//!   to 40 ms. Acknowledging at once takes a control-channel round trip in
//!   Bochs from about 44 ms to about 2 ms.
//! - `signal(2)`: `hvtrace graph` catches the first Ctrl-C, so that it can
//!   stop the tracer and finish its output before it exits.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::raw::{c_int, c_uint, c_ulong, c_void};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

mod ffi {
    use std::os::raw::{c_int, c_uint, c_void};

    extern "C" {
        pub fn setsid() -> c_int;
        pub fn getuid() -> u32;
        pub fn getppid() -> c_int;
        pub fn prctl(option: c_int, ...) -> c_int;
        pub fn signal(signum: c_int, handler: usize) -> usize;
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

/// `PR_SET_PDEATHSIG` from `<linux/prctl.h>`.
const PR_SET_PDEATHSIG: c_int = 1;
/// `SIGKILL`.
const SIGKILL: c_ulong = 9;

/// `SIGINT`.
const SIGINT: c_int = 2;
/// `SIG_DFL`: the default action.
const SIG_DFL: usize = 0;
/// `SIG_ERR`: what `signal` returns when it fails.
const SIG_ERR: usize = usize::MAX;

/// Set by the first SIGINT once [`catch_interrupt`] ran.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_signum: c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    // SAFETY: signal is async-signal-safe (POSIX); SIG_DFL is a valid
    // disposition. The next SIGINT ends the process as usual.
    unsafe {
        ffi::signal(SIGINT, SIG_DFL);
    }
}

/// Catches the next SIGINT (Ctrl-C): instead of ending the process it sets
/// the flag that [`interrupted`] reads, and the one after it ends the
/// process as usual. Blocking calls go on (glibc restarts them), so a loop
/// that polls the flag notices it at its next turn.
pub fn catch_interrupt() -> io::Result<()> {
    let handler: extern "C" fn(c_int) = on_interrupt;
    // SAFETY: the handler only stores to an atomic and calls signal, both
    // async-signal-safe; a function pointer is what the C `sighandler_t`
    // holds.
    let previous = unsafe { ffi::signal(SIGINT, handler as usize) };
    if previous == SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True once a SIGINT caught by [`catch_interrupt`] arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The real user id of this process.
pub fn uid() -> u32 {
    // SAFETY: getuid takes no arguments, touches no memory of ours and
    // cannot fail (POSIX).
    unsafe { ffi::getuid() }
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

/// A TCP stream whose reads acknowledge at once ([`quick_ack`]): for the
/// emulator's serial sockets.
#[derive(Debug)]
pub struct QuickAckReader(pub TcpStream);

impl io::Read for QuickAckReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        quick_ack(&self.0);
        self.0.read(buf)
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
    fn quick_ack_on_a_socket() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        quick_ack(&stream);
    }

    #[test]
    fn the_first_interrupt_is_caught() {
        extern "C" {
            fn raise(signum: c_int) -> c_int;
        }
        catch_interrupt().unwrap();
        assert!(!interrupted());
        // SAFETY: raise delivers SIGINT to this thread, whose handler is
        // the one just installed.
        assert_eq!(unsafe { raise(SIGINT) }, 0);
        assert!(interrupted());
        // The handler put the default action back.
        // SAFETY: querying and restoring the disposition with signal.
        let now = unsafe { ffi::signal(SIGINT, SIG_DFL) };
        assert_eq!(now, SIG_DFL);
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
