//! The emulator's serial ports, COM1 (the guest console) and COM2 (the
//! hypervisor's control channel): each is a listener of the run, to which
//! the emulator connects as a client, and whose accepted connection is
//! used only once it is shown to come from the emulator this run started.
//!
//! - Unix socket (QEMU): bound in the run directory, mode 0600; the
//!   connection's `SO_PEERCRED` must name the emulator's process and our
//!   user. The socket file goes with its listener, once the connection
//!   is taken.
//! - TCP on 127.0.0.1 (Bochs, whose serial ports have no unix socket
//!   client; QEMU when the run directory's path is too long for a socket
//!   address): the peer's socket is looked up in the kernel's TCP table
//!   ([`crate::vm::tcp_table`]); its owner must be us and its inode one of the
//!   emulator process's open sockets.
//!
//! The emulator is a child of this process that is not reaped while it is
//! awaited, so its process id cannot pass to another process meanwhile.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::sys;

/// The file name of COM1's socket in the run directory.
pub const SERIAL_SOCKET: &str = "com1.sock";
/// The file name of COM2's socket in the run directory.
pub const CONTROL_SOCKET: &str = "com2.sock";

/// The longest path a unix socket address holds (`sun_path` is 108 bytes,
/// with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The umask for binding a serial socket: the file is created mode 0600.
const BIND_UMASK: u32 = 0o177;

/// One connected serial port.
#[derive(Debug)]
pub enum Channel {
    /// A TCP connection on 127.0.0.1. Its reads acknowledge at once
    /// ([`sys::quick_ack`]): Bochs writes a byte at a time with Nagle's
    /// algorithm on, so a delayed ACK would stall every burst.
    Tcp(TcpStream),
    /// A unix socket connection.
    Unix(UnixStream),
}

impl Channel {
    /// A second handle on the same connection (for a reader thread).
    pub fn try_clone(&self) -> io::Result<Channel> {
        Ok(match self {
            Channel::Tcp(s) => Channel::Tcp(s.try_clone()?),
            Channel::Unix(s) => Channel::Unix(s.try_clone()?),
        })
    }

    /// Shuts down one or both directions of the connection.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Channel::Tcp(s) => s.shutdown(how),
            Channel::Unix(s) => s.shutdown(how),
        }
    }
}

impl Read for Channel {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Channel::Tcp(s) => {
                sys::quick_ack(s);
                s.read(buf)
            }
            Channel::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Channel {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Channel::Tcp(s) => s.write(buf),
            Channel::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Channel::Tcp(s) => s.flush(),
            Channel::Unix(s) => s.flush(),
        }
    }
}

/// Where the emulator connects a serial port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// TCP to this port on 127.0.0.1.
    Tcp(u16),
    /// The unix socket of this file name in the run directory (the
    /// emulator's working directory).
    Unix(String),
}

impl Endpoint {
    /// The TCP port, for a TCP endpoint.
    pub fn tcp_port(&self) -> Option<u16> {
        match self {
            Endpoint::Tcp(port) => Some(*port),
            Endpoint::Unix(_) => None,
        }
    }
}

/// True when a unix socket can be bound at `dir/name` (the path fits a
/// socket address).
pub fn unix_path_fits(dir: &Path, name: &str) -> bool {
    dir.join(name).as_os_str().len() <= MAX_SOCKET_PATH
}

/// A serial port's listener.
#[derive(Debug)]
pub enum Listener {
    /// On 127.0.0.1, a port the kernel picked.
    Tcp(TcpListener),
    /// At `path`, which is removed when the listener is dropped.
    Unix {
        listener: UnixListener,
        path: PathBuf,
        name: String,
    },
}

impl Listener {
    /// Listens on 127.0.0.1, on a port the kernel picks.
    pub fn tcp() -> io::Result<Listener> {
        TcpListener::bind("127.0.0.1:0").map(Listener::Tcp)
    }

    /// Listens on the unix socket `dir/name`, mode 0600. A socket file left
    /// there by an earlier run is replaced; anything else there is an error.
    pub fn unix(dir: &Path, name: &str) -> Result<Listener> {
        let path = dir.join(name);
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            bail!(
                "the socket path {} is longer than a unix socket address holds ({MAX_SOCKET_PATH} bytes)",
                path.display()
            );
        }
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove the old socket {}", path.display()))?,
            Ok(_) => bail!("{} exists and is not a socket", path.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => bail!("cannot check {}: {e}", path.display()),
        }
        let listener = sys::with_umask(BIND_UMASK, || UnixListener::bind(&path))
            .with_context(|| format!("cannot listen on {}", path.display()))?;
        Ok(Listener::Unix {
            listener,
            path,
            name: name.to_string(),
        })
    }

    /// Where the emulator is to connect.
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        Ok(match self {
            Listener::Tcp(l) => Endpoint::Tcp(l.local_addr()?.port()),
            Listener::Unix { name, .. } => Endpoint::Unix(name.clone()),
        })
    }

    /// Makes [`Listener::accept`] return `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(nonblocking),
            Listener::Unix { listener, .. } => listener.set_nonblocking(nonblocking),
        }
    }

    /// Takes the next connection, which blocks on reads and writes whatever
    /// the listener's mode, with Nagle's algorithm off on TCP: commands and
    /// frames are short. It is not verified yet ([`verify_peer`]).
    pub fn accept(&self) -> io::Result<Channel> {
        match self {
            Listener::Tcp(l) => {
                let (stream, _) = l.accept()?;
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                Ok(Channel::Tcp(stream))
            }
            Listener::Unix { listener, .. } => {
                let (stream, _) = listener.accept()?;
                stream.set_nonblocking(false)?;
                Ok(Channel::Unix(stream))
            }
        }
    }

    /// Takes the next connection that comes from process `pid` of our user.
    /// Every connection before it that came from someone else is closed and
    /// reported on stderr, one line each (`what` names the port). On a
    /// non-blocking listener, `Ok(None)` once nobody else is waiting.
    pub fn accept_from(&self, pid: u32, what: &str) -> io::Result<Option<Channel>> {
        loop {
            let channel = match self.accept() {
                Ok(channel) => channel,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            };
            match verify_peer(&channel, pid, sys::euid()) {
                Ok(()) => return Ok(Some(channel)),
                Err(why) => {
                    let _ = channel.shutdown(Shutdown::Both);
                    eprintln!(
                        "hvtrace: warning: refused a connection to {what}: {}",
                        crate::term::sanitize(&why)
                    );
                }
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Checks that `channel` was connected by process `pid` of user `uid`:
/// `SO_PEERCRED` for a unix socket, the kernel's TCP table and the process's
/// open files for TCP. The error says why not.
pub fn verify_peer(channel: &Channel, pid: u32, uid: u32) -> Result<(), String> {
    match channel {
        Channel::Tcp(stream) => crate::vm::tcp_table::verify_peer(stream, pid, uid),
        Channel::Unix(stream) => {
            let cred = sys::peer_cred(stream)
                .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
            if cred.uid != uid {
                return Err(format!(
                    "the peer (process {}) runs as uid {}, not {uid}",
                    cred.pid, cred.uid
                ));
            }
            if cred.pid != pid {
                return Err(format!(
                    "the peer is process {}, not the emulator (process {pid})",
                    cred.pid
                ));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-channel-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn unix_listener_is_private_and_cleans_up() {
        use std::os::unix::fs::MetadataExt;
        let dir = scratch("unix");
        // A socket file left behind by an earlier run is replaced.
        drop(UnixListener::bind(dir.join(SERIAL_SOCKET)).unwrap());
        let listener = Listener::unix(&dir, SERIAL_SOCKET).unwrap();
        let path = dir.join(SERIAL_SOCKET);
        assert_eq!(
            std::fs::symlink_metadata(&path).unwrap().mode() & 0o777,
            0o600
        );
        assert_eq!(
            listener.endpoint().unwrap(),
            Endpoint::Unix(SERIAL_SOCKET.to_string())
        );
        let mut client = UnixStream::connect(&path).unwrap();
        let mut served = listener
            .accept_from(std::process::id(), "a test port")
            .unwrap()
            .expect("our own connection is accepted");
        client.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        served.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        drop(listener);
        assert!(std::fs::symlink_metadata(&path).is_err());
        // Anything but a socket is left alone.
        std::fs::write(dir.join(CONTROL_SOCKET), b"").unwrap();
        let e = Listener::unix(&dir, CONTROL_SOCKET).unwrap_err();
        assert!(format!("{e:#}").contains("not a socket"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn socket_paths_that_do_not_fit() {
        let dir = PathBuf::from(format!("/tmp/{}", "d".repeat(100)));
        assert!(!unix_path_fits(&dir, SERIAL_SOCKET));
        let e = Listener::unix(&dir, SERIAL_SOCKET).unwrap_err();
        assert!(format!("{e:#}").contains("longer than"), "{e:#}");
        assert!(unix_path_fits(
            Path::new("/tmp/hvtrace-run-1-2-3"),
            SERIAL_SOCKET
        ));
        let exact = PathBuf::from(format!("/{}", "d".repeat(MAX_SOCKET_PATH - 11)));
        assert_eq!(exact.join(SERIAL_SOCKET).as_os_str().len(), MAX_SOCKET_PATH);
        assert!(unix_path_fits(&exact, SERIAL_SOCKET));
    }

    #[test]
    fn tcp_endpoint_and_nonblocking_accept() {
        let listener = Listener::tcp().unwrap();
        let port = listener.endpoint().unwrap().tcp_port().unwrap();
        assert_ne!(port, 0);
        listener.set_nonblocking(true).unwrap();
        assert!(listener
            .accept_from(std::process::id(), "x")
            .unwrap()
            .is_none());
        assert_eq!(Endpoint::Unix("a".into()).tcp_port(), None);
    }
}
