//! The serial ports' listeners take a connection only from the emulator the
//! run started: over TCP, the peer's socket must be in the kernel's TCP
//! table with our uid and among the expected process's open files; over a
//! unix socket, `SO_PEERCRED` must name that process. Here the test process
//! (or a child of it) plays the emulator.
//!
//! Run: `cargo test -p hvtrace --test emulator_peer`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hvtrace::sys;
use hvtrace::vm::channel::{verify_peer, Channel, Listener};

/// A child that kills itself when dropped.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Another process of ours, which holds no socket of the test.
fn bystander() -> Kid {
    Kid(Command::new("sleep")
        .arg("60")
        .stdin(Stdio::null())
        .spawn()
        .expect("cannot start sleep"))
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-peer-test-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn tcp_peer_is_checked_through_the_kernel_table() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (served, _) = listener.accept().unwrap();
    let served = Channel::Tcp(served);
    let us = std::process::id();
    let uid = sys::euid();

    assert_eq!(verify_peer(&served, us, uid), Ok(()));
    // Another process, even one of ours, does not hold the client's socket.
    let other = bystander();
    let e = verify_peer(&served, other.0.id(), uid).unwrap_err();
    assert!(e.contains("not held by process"), "{e}");
    // Pid 1 (whose open files we may not even see) is refused too.
    assert!(verify_peer(&served, 1, uid).is_err());
    // So is a uid that is not the socket's owner.
    let e = verify_peer(&served, us, uid.wrapping_add(1)).unwrap_err();
    assert!(e.contains("belongs to uid"), "{e}");

    // The stream still works after the checks.
    let mut served = served;
    client.write_all(b"x").unwrap();
    let mut byte = [0u8; 1];
    served.read_exact(&mut byte).unwrap();
    assert_eq!(&byte, b"x");
}

#[test]
fn unix_peer_is_checked_by_its_credentials() {
    let scratch = Scratch::new("unix");
    let path = scratch.path().join("s");
    let listener = UnixListener::bind(&path).unwrap();
    let _client = UnixStream::connect(&path).unwrap();
    let (served, _) = listener.accept().unwrap();
    let served = Channel::Unix(served);
    let us = std::process::id();
    let uid = sys::euid();
    assert_eq!(verify_peer(&served, us, uid), Ok(()));
    let e = verify_peer(&served, 1, uid).unwrap_err();
    assert!(e.contains("not the emulator"), "{e}");
    let e = verify_peer(&served, us, uid.wrapping_add(1)).unwrap_err();
    assert!(e.contains("runs as uid"), "{e}");
}

/// Waits, on a non-blocking listener, for a connection from `pid`.
fn accept_within(listener: &Listener, pid: u32, limit: Duration) -> Option<Channel> {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if let Some(channel) = listener.accept_from(pid, "the test port").unwrap() {
            return Some(channel);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn an_impostor_is_dropped_and_the_emulator_still_gets_in() {
    let Some(bash) = ["/bin/bash", "/usr/bin/bash"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        eprintln!("skipped: no bash for /dev/tcp");
        return;
    };
    let listener = Listener::tcp().unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.endpoint().unwrap().tcp_port().unwrap();

    // The "emulator": a child that connects and sends a line. It has not
    // connected yet; this process connects first.
    let mut impostor = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let emulator = Kid(Command::new(bash)
        .arg("-c")
        .arg(format!(
            "sleep 0.3; exec 3<>/dev/tcp/127.0.0.1/{port}; echo hello >&3; sleep 30"
        ))
        .stdin(Stdio::null())
        .spawn()
        .unwrap());
    let mut channel = accept_within(&listener, emulator.0.id(), Duration::from_secs(20))
        .expect("the emulator's connection was not taken");
    let mut line = [0u8; 6];
    channel.read_exact(&mut line).unwrap();
    assert_eq!(&line, b"hello\n");
    // The impostor's connection was closed.
    impostor
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert!(matches!(impostor.read(&mut byte), Ok(0) | Err(_)));
}

#[test]
fn a_unix_listener_drops_an_impostor() {
    let scratch = Scratch::new("unix-listener");
    let listener = Listener::unix(scratch.path(), "com1.sock").unwrap();
    listener.set_nonblocking(true).unwrap();
    let path = scratch.path().join("com1.sock");
    let mut impostor = UnixStream::connect(&path).unwrap();
    let other = bystander();
    assert!(listener
        .accept_from(other.0.id(), "the test port")
        .unwrap()
        .is_none());
    let mut byte = [0u8; 1];
    impostor
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(matches!(impostor.read(&mut byte), Ok(0) | Err(_)));
    // The listener goes on: our own next connection is taken.
    let _ours = UnixStream::connect(&path).unwrap();
    assert!(listener
        .accept_from(std::process::id(), "the test port")
        .unwrap()
        .is_some());
}
