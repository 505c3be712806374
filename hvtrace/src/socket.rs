//! The control socket: where it lives, whether a VM owns it, and claiming it.
//!
//! A detached VM's supervisor serves one unix socket. By default it is
//! `$XDG_RUNTIME_DIR/hvtrace.sock` (a private per-user directory on systemd
//! machines), else `/tmp/hvtrace-$UID.sock`. The socket file is made
//! owner-only, since whoever can connect can run commands in the guest and
//! stop it.

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The socket's file name inside `$XDG_RUNTIME_DIR`.
pub const SOCKET_NAME: &str = "hvtrace.sock";

/// The default control socket for this user.
pub fn default_path() -> PathBuf {
    default_path_from(std::env::var_os("XDG_RUNTIME_DIR"), crate::sys::uid())
}

/// The default control socket, given `$XDG_RUNTIME_DIR` and the user id.
/// A relative or empty runtime directory is ignored, as the XDG base
/// directory specification asks.
pub fn default_path_from(runtime_dir: Option<OsString>, uid: u32) -> PathBuf {
    match runtime_dir.map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir.join(SOCKET_NAME),
        _ => PathBuf::from(format!("/tmp/hvtrace-{uid}.sock")),
    }
}

/// The socket given with `--socket`, else the default.
pub fn resolve(given: Option<&Path>) -> PathBuf {
    match given {
        Some(path) => path.to_path_buf(),
        None => default_path(),
    }
}

/// What is at a control socket path.
#[derive(Debug, PartialEq, Eq)]
pub enum SocketState {
    /// Nothing.
    Missing,
    /// A socket that accepts connections: a running VM's supervisor.
    Live,
    /// A socket file that nobody listens on (its supervisor died).
    Stale,
    /// Something that is not a socket.
    NotASocket,
    /// A socket that cannot be checked (the message says why).
    Unknown(String),
}

/// Finds out what is at `path`, connecting to it if it is a socket.
pub fn probe(path: &Path) -> SocketState {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return SocketState::Missing,
        Err(e) => return SocketState::Unknown(e.to_string()),
    };
    if !meta.file_type().is_socket() {
        return SocketState::NotASocket;
    }
    match UnixStream::connect(path) {
        Ok(_) => SocketState::Live,
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => SocketState::Stale,
        Err(e) if e.kind() == io::ErrorKind::NotFound => SocketState::Missing,
        Err(e) => SocketState::Unknown(e.to_string()),
    }
}

/// Fails unless `path` is free for a new VM: nothing there, or a stale
/// socket. Returns whether a stale socket is there.
pub fn check_free(path: &Path) -> Result<bool> {
    match probe(path) {
        SocketState::Missing => Ok(false),
        SocketState::Stale => Ok(true),
        SocketState::Live => bail!(
            "a running VM already owns the control socket {} (stop it with `hvtrace --socket {} stop`, or pass another --socket)",
            path.display(),
            path.display()
        ),
        SocketState::NotASocket => bail!(
            "{} exists and is not a socket; refusing to replace it (pass another --socket)",
            path.display()
        ),
        SocketState::Unknown(e) => bail!("cannot check the control socket {}: {e}", path.display()),
    }
}

/// A bound control socket. The file is removed when this is dropped, unless
/// something else has replaced it meanwhile.
#[derive(Debug)]
pub struct ClaimedSocket {
    path: PathBuf,
    listener: UnixListener,
    dev: u64,
    ino: u64,
}

impl ClaimedSocket {
    /// Binds `path` for a new VM: refuses a live socket and anything that is
    /// not a socket, replaces a stale one, makes the file owner-only.
    pub fn claim(path: &Path) -> Result<ClaimedSocket> {
        if check_free(path)? {
            std::fs::remove_file(path).with_context(|| {
                format!("cannot remove the stale control socket {}", path.display())
            })?;
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.is_dir() {
                bail!(
                    "cannot create the control socket {}: directory {} does not exist",
                    path.display(),
                    parent.display()
                );
            }
        }
        let listener = UnixListener::bind(path).map_err(|e| match e.kind() {
            io::ErrorKind::AddrInUse => anyhow::anyhow!(
                "another VM claimed the control socket {} just now",
                path.display()
            ),
            _ => anyhow::anyhow!("cannot create the control socket {}: {e}", path.display()),
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot restrict {}", path.display()))?;
        let meta = std::fs::symlink_metadata(path)
            .with_context(|| format!("cannot stat {}", path.display()))?;
        Ok(ClaimedSocket {
            path: path.to_path_buf(),
            listener,
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// The listener.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the socket file now (if it is still ours); new clients then
    /// find no VM. Idempotent.
    pub fn remove(&self) {
        if let Ok(meta) = std::fs::symlink_metadata(&self.path) {
            if meta.dev() == self.dev && meta.ino() == self.ino {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for ClaimedSocket {
    fn drop(&mut self) {
        self.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-socket-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn defaults() {
        assert_eq!(
            default_path_from(Some("/run/user/1000".into()), 1000),
            Path::new("/run/user/1000/hvtrace.sock")
        );
        assert_eq!(
            default_path_from(None, 1000),
            Path::new("/tmp/hvtrace-1000.sock")
        );
        assert_eq!(
            default_path_from(Some("".into()), 0),
            Path::new("/tmp/hvtrace-0.sock")
        );
        assert_eq!(
            default_path_from(Some("relative/dir".into()), 7),
            Path::new("/tmp/hvtrace-7.sock")
        );
        assert_eq!(
            resolve(Some(Path::new("/x/y.sock"))),
            Path::new("/x/y.sock")
        );
        assert!(default_path().is_absolute());
    }

    #[test]
    fn states_and_claiming() {
        let dir = scratch("states");
        let path = dir.join("ctl.sock");
        assert_eq!(probe(&path), SocketState::Missing);

        let claimed = ClaimedSocket::claim(&path).unwrap();
        assert_eq!(probe(&path), SocketState::Live);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let err = format!("{:#}", ClaimedSocket::claim(&path).unwrap_err());
        assert!(err.contains("already owns"), "{err}");
        drop(claimed);
        assert_eq!(probe(&path), SocketState::Missing);

        // A socket whose listener is gone without removing the file is stale
        // and is replaced.
        drop(UnixListener::bind(&path).unwrap());
        assert_eq!(probe(&path), SocketState::Stale);
        let claimed = ClaimedSocket::claim(&path).unwrap();
        assert_eq!(probe(&path), SocketState::Live);
        drop(claimed);

        std::fs::write(&path, b"not a socket").unwrap();
        assert_eq!(probe(&path), SocketState::NotASocket);
        let err = format!("{:#}", ClaimedSocket::claim(&path).unwrap_err());
        assert!(err.contains("is not a socket"), "{err}");
        assert!(path.is_file(), "a regular file must never be removed");

        let err = format!(
            "{:#}",
            ClaimedSocket::claim(&dir.join("no/such/dir.sock")).unwrap_err()
        );
        assert!(err.contains("does not exist"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_replaced_socket_is_left_alone() {
        let dir = scratch("replaced");
        let path = dir.join("ctl.sock");
        let first = ClaimedSocket::claim(&path).unwrap();
        // Someone else removes the file and binds their own there.
        std::fs::remove_file(&path).unwrap();
        let _other = UnixListener::bind(&path).unwrap();
        drop(first);
        assert_eq!(probe(&path), SocketState::Live);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
