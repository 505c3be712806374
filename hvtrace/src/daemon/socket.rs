//! The control socket: where it lives, whether a VM owns it, and claiming it.
//!
//! A detached VM's supervisor serves one unix socket; whoever can connect
//! can run commands in the guest and stop it. By default it is
//! `$XDG_RUNTIME_DIR/hvtrace/hvtrace.sock` when `$XDG_RUNTIME_DIR` is a
//! private directory of ours, else `/tmp/hvtrace-$UID/hvtrace.sock`
//! (`$HVTRACE_TMPDIR/hvtrace-$UID/hvtrace.sock` when that variable names an
//! absolute path: a test points the fallback at a scratch directory of its
//! own with it, away from a VM the user may be running). Its
//! directory is created with mode 0700 when a VM starts; one that is there
//! already must be a real directory (not a symbolic link) of ours with mode
//! 0700, or hvtrace refuses it (anyone can create `/tmp/hvtrace-$UID`
//! first). A `--socket` path is used as given, as long as nobody else can
//! put a socket there: its directory belongs to us or root and is not
//! writable by others unless sticky (as `/tmp` is), and a socket file
//! already there belongs to us or root.
//!
//! The socket is bound with umask 077 and made 0600. On top of that both
//! ends check each other with `SO_PEERCRED`: the supervisor serves only its
//! own user and root, and a client talks only to a server of its own user
//! or root ([`peer_allowed`]).

use std::ffi::OsString;
use std::fs::DirBuilder;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::sys;

// The directory rule that socket paths and run directories share lives
// with the run directories; it stays reachable here under its old path.
pub use crate::vm::image::others_may_replace;

/// The socket's file name inside its directory.
pub const SOCKET_NAME: &str = "hvtrace.sock";
/// The default socket's directory inside `$XDG_RUNTIME_DIR`.
pub const RUNTIME_SUBDIR: &str = "hvtrace";
/// Where the default socket's directory is without a usable
/// `$XDG_RUNTIME_DIR`: `hvtrace-$UID` in here.
pub const TMP_BASE: &str = "/tmp";
/// The environment variable that names another base than [`TMP_BASE`] for
/// the fallback; only an absolute path counts ([`tmp_base_from`]).
pub const TMP_BASE_ENV: &str = "HVTRACE_TMPDIR";
/// The mode of the default socket's directory: its owner's alone.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// The mode of the socket file.
pub const SOCKET_MODE: u32 = 0o600;
/// The umask the socket is bound under, so that it is never reachable by
/// anyone else, not even before [`SOCKET_MODE`] is set.
pub const BIND_UMASK: u32 = 0o077;

/// What a command does with the control socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Serves it (`run --detach`, the supervisor): the default directory is
    /// created when missing.
    Serve,
    /// Connects to it: a missing default directory means no VM.
    Connect,
}

/// The default socket's directory, given `$XDG_RUNTIME_DIR`, our effective
/// user id and the base for the fallback ([`TMP_BASE`]). The runtime
/// directory counts only when it is absolute (the XDG base directory
/// specification says to ignore a relative one) and
/// [`runtime_dir_usable`].
pub fn default_dir_from(runtime_dir: Option<OsString>, euid: u32, tmp: &Path) -> PathBuf {
    match runtime_dir.map(PathBuf::from) {
        Some(dir) if dir.is_absolute() && runtime_dir_usable(&dir, euid) => {
            dir.join(RUNTIME_SUBDIR)
        }
        _ => tmp.join(format!("hvtrace-{euid}")),
    }
}

/// The base of the fallback directory, given `$HVTRACE_TMPDIR`
/// ([`TMP_BASE_ENV`]): that path when it is absolute, else [`TMP_BASE`]. The
/// directory made in it is checked as the one in `/tmp` is
/// ([`check_private_dir`]), whoever owns the base.
pub fn tmp_base_from(var: Option<OsString>) -> PathBuf {
    match var.map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir,
        _ => PathBuf::from(TMP_BASE),
    }
}

/// True when `dir` is a directory (not a symbolic link) owned by `euid`,
/// with no permission for group or others: a place only we can reach.
pub fn runtime_dir_usable(dir: &Path, euid: u32) -> bool {
    match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta.is_dir() && meta.uid() == euid && meta.mode() & 0o077 == 0,
        Err(_) => false,
    }
}

/// Checks that `dir` is a private directory of `euid`: a real directory
/// (not a symbolic link), owned by `euid`, mode exactly
/// [`PRIVATE_DIR_MODE`]. Returns false when there is nothing at `dir`;
/// fails, saying what is wrong, when something else is there.
pub fn check_private_dir(dir: &Path, euid: u32) -> Result<bool> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => bail!(
            "cannot check the control socket directory {}: {e}",
            dir.display()
        ),
    };
    let d = dir.display();
    if meta.file_type().is_symlink() {
        bail!("the control socket directory {d} is a symbolic link, not a directory of yours; remove it or pass --socket");
    }
    if !meta.is_dir() {
        bail!("the control socket directory {d} is not a directory; remove it or pass --socket");
    }
    if meta.uid() != euid {
        bail!(
            "the control socket directory {d} is owned by uid {}, not you (uid {euid}); remove it or pass --socket",
            meta.uid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode != PRIVATE_DIR_MODE {
        bail!(
            "the control socket directory {d} has mode {mode:04o}, not {PRIVATE_DIR_MODE:04o}; `chmod {PRIVATE_DIR_MODE:o} {d}` or pass --socket"
        );
    }
    Ok(true)
}

/// Makes sure `dir` is a private directory of `euid`
/// ([`check_private_dir`]); a missing one is created (mode
/// [`PRIVATE_DIR_MODE`]) when `create`, else left missing.
pub fn ensure_private_dir(dir: &Path, euid: u32, create: bool) -> Result<()> {
    if check_private_dir(dir, euid)? || !create {
        return Ok(());
    }
    match DirBuilder::new().mode(PRIVATE_DIR_MODE).create(dir) {
        Ok(()) => {
            // The umask may have taken bits away; nobody else can have
            // touched a 0700 directory of ours meanwhile.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(PRIVATE_DIR_MODE))
                .with_context(|| format!("cannot restrict {}", dir.display()))?;
        }
        // Someone made it just now: it has to pass the check all the same.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => bail!(
            "cannot create the control socket directory {}: {e}",
            dir.display()
        ),
    }
    if !check_private_dir(dir, euid)? {
        bail!("the control socket directory {} vanished", dir.display());
    }
    Ok(())
}

/// The default control socket for this user, its directory checked (and,
/// to serve, created).
pub fn default_path(usage: Use) -> Result<PathBuf> {
    let euid = sys::euid();
    let dir = default_dir_from(
        std::env::var_os("XDG_RUNTIME_DIR"),
        euid,
        &tmp_base_from(std::env::var_os(TMP_BASE_ENV)),
    );
    ensure_private_dir(&dir, euid, usage == Use::Serve)?;
    Ok(dir.join(SOCKET_NAME))
}

/// The socket given with `--socket` (as it is: [`check_path`] checks it
/// where it is used), else the default.
pub fn resolve(given: Option<&Path>, usage: Use) -> Result<PathBuf> {
    match given {
        Some(path) => Ok(path.to_path_buf()),
        None => default_path(usage),
    }
}

/// The directory a socket path is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Checks that nobody but `euid` and root can have put something at the
/// socket path `path`, or can replace it: its directory is owned by us or
/// root and not writable by others unless sticky, and whatever is at the
/// path already is ours or root's. A missing directory passes (binding or
/// connecting says so).
pub fn check_path(path: &Path, euid: u32) -> Result<()> {
    let dir = parent_dir(path);
    let p = path.display();
    let d = dir.display();
    match std::fs::metadata(&dir) {
        Ok(meta) => {
            if !meta.is_dir() {
                bail!("cannot use the control socket {p}: {d} is not a directory");
            }
            if meta.uid() != euid && meta.uid() != 0 {
                bail!(
                    "refusing the control socket {p}: its directory {d} is owned by uid {}, not you (uid {euid}), who could replace the socket",
                    meta.uid()
                );
            }
            let mode = meta.mode() & 0o7777;
            if others_may_replace(mode) {
                bail!(
                    "refusing the control socket {p}: its directory {d} is writable by others (mode {mode:04o}) without the sticky bit, so anyone could replace the socket"
                );
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => bail!("cannot check the directory {d} of the control socket {p}: {e}"),
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.uid() != euid && meta.uid() != 0 => bail!(
            "refusing the control socket {p}: it is owned by uid {}, not you (uid {euid})",
            meta.uid()
        ),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => bail!("cannot check the control socket {p}: {e}"),
    }
}

/// Whether the process at the other end of the control socket, user
/// `peer`, may be served by (or may serve) user `ours`: the same user, or
/// root.
pub fn peer_allowed(peer: u32, ours: u32) -> bool {
    peer == ours || peer == 0
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

/// Fails unless `path` is safe ([`check_path`]) and free for a new VM:
/// nothing there, or a stale socket. Returns whether a stale socket is
/// there.
pub fn check_free(path: &Path) -> Result<bool> {
    check_path(path, sys::euid())?;
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
    /// Binds `path` for a new VM: refuses an unsafe path ([`check_path`]),
    /// a live socket and anything that is not a socket, replaces a stale
    /// one; binds under umask [`BIND_UMASK`] and makes the file
    /// [`SOCKET_MODE`].
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
        let bound = sys::with_umask(BIND_UMASK, || UnixListener::bind(path));
        let listener = bound.map_err(|e| match e.kind() {
            io::ErrorKind::AddrInUse => anyhow::anyhow!(
                "another VM claimed the control socket {} just now",
                path.display()
            ),
            _ => anyhow::anyhow!("cannot create the control socket {}: {e}", path.display()),
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
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

    fn set_mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A uid that is neither ours nor root's.
    fn stranger() -> u32 {
        let euid = sys::euid();
        if euid == 4242 {
            4243
        } else {
            4242
        }
    }

    #[test]
    fn the_default_directory() {
        let euid = sys::euid();
        let dir = scratch("default");
        let tmp = dir.join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let fallback = tmp.join(format!("hvtrace-{euid}"));
        let runtime = dir.join("runtime");
        std::fs::create_dir(&runtime).unwrap();
        set_mode(&runtime, 0o700);
        assert_eq!(
            default_dir_from(Some(runtime.clone().into()), euid, &tmp),
            runtime.join("hvtrace")
        );
        // Not usable: fall back to the private directory in the temp base.
        assert_eq!(default_dir_from(None, euid, &tmp), fallback);
        assert_eq!(default_dir_from(Some("".into()), euid, &tmp), fallback);
        assert_eq!(
            default_dir_from(Some("relative/dir".into()), euid, &tmp),
            fallback
        );
        // Someone else's.
        assert_eq!(
            default_dir_from(Some(runtime.clone().into()), stranger(), &tmp),
            tmp.join(format!("hvtrace-{}", stranger()))
        );
        // Open to the group.
        set_mode(&runtime, 0o750);
        assert_eq!(
            default_dir_from(Some(runtime.clone().into()), euid, &tmp),
            fallback
        );
        // A symbolic link to a private directory.
        set_mode(&runtime, 0o700);
        let link = dir.join("link");
        std::os::unix::fs::symlink(&runtime, &link).unwrap();
        assert!(!runtime_dir_usable(&link, euid));
        assert_eq!(default_dir_from(Some(link.into()), euid, &tmp), fallback);
        // Missing.
        assert_eq!(
            default_dir_from(Some(dir.join("nope").into()), euid, &tmp),
            fallback
        );

        // The fallback's base: an absolute `$HVTRACE_TMPDIR`, else /tmp.
        assert_eq!(tmp_base_from(Some(tmp.clone().into())), tmp);
        for ignored in [None, Some("".into()), Some("relative/tmp".into())] {
            assert_eq!(tmp_base_from(ignored), Path::new(TMP_BASE));
        }

        // Connecting leaves a missing directory missing; serving creates it.
        ensure_private_dir(&fallback, euid, false).unwrap();
        assert!(!fallback.exists());
        ensure_private_dir(&fallback, euid, true).unwrap();
        let meta = std::fs::symlink_metadata(&fallback).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700);
        assert_eq!(meta.uid(), euid);
        // Once there, it is checked, not changed.
        ensure_private_dir(&fallback, euid, true).unwrap();
        assert!(check_private_dir(&fallback, euid).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_default_directory_is_refused() {
        let euid = sys::euid();
        let dir = scratch("baddefault");
        let private = dir.join("hvtrace-x");

        // Too open.
        std::fs::create_dir(&private).unwrap();
        set_mode(&private, 0o755);
        for create in [false, true] {
            let e = format!(
                "{:#}",
                ensure_private_dir(&private, euid, create).unwrap_err()
            );
            assert!(e.contains("has mode 0755, not 0700"), "{e}");
            assert!(e.contains(&private.display().to_string()), "{e}");
        }
        set_mode(&private, 0o1700);
        let e = format!("{:#}", check_private_dir(&private, euid).unwrap_err());
        assert!(e.contains("has mode 1700"), "{e}");

        // Owned by someone else (as seen by another uid).
        set_mode(&private, 0o700);
        let e = format!("{:#}", check_private_dir(&private, stranger()).unwrap_err());
        assert!(
            e.contains(&format!(
                "is owned by uid {euid}, not you (uid {})",
                stranger()
            )),
            "{e}"
        );
        if euid == 0 {
            // Root can hand it to another user for real.
            std::os::unix::fs::chown(&private, Some(stranger()), None).unwrap();
            let e = format!("{:#}", ensure_private_dir(&private, 0, true).unwrap_err());
            assert!(e.contains(&format!("owned by uid {}", stranger())), "{e}");
        }
        std::fs::remove_dir(&private).unwrap();

        // A symbolic link, even to a good directory.
        let target = dir.join("target");
        std::fs::create_dir(&target).unwrap();
        set_mode(&target, 0o700);
        std::os::unix::fs::symlink(&target, &private).unwrap();
        let e = format!(
            "{:#}",
            ensure_private_dir(&private, euid, true).unwrap_err()
        );
        assert!(e.contains("is a symbolic link"), "{e}");
        std::fs::remove_file(&private).unwrap();

        // Not a directory.
        std::fs::write(&private, b"x").unwrap();
        let e = format!(
            "{:#}",
            ensure_private_dir(&private, euid, true).unwrap_err()
        );
        assert!(e.contains("is not a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn explicit_paths_are_checked() {
        let euid = sys::euid();
        let dir = scratch("explicit");
        let sock = dir.join("s.sock");
        set_mode(&dir, 0o755);
        check_path(&sock, euid).unwrap();
        // Writable by others without the sticky bit: refused.
        for mode in [0o777, 0o775, 0o757] {
            set_mode(&dir, mode);
            let e = format!("{:#}", check_path(&sock, euid).unwrap_err());
            assert!(e.contains("writable by others"), "{mode:o}: {e}");
            assert!(e.contains(&format!("mode {mode:04o}")), "{e}");
            let e = format!("{:#}", check_free(&sock).unwrap_err());
            assert!(e.contains("writable by others"), "{e}");
            let e = format!("{:#}", ClaimedSocket::claim(&sock).unwrap_err());
            assert!(e.contains("writable by others"), "{e}");
            assert!(!sock.exists());
        }
        // With the sticky bit, as /tmp: entries are their owners' alone.
        set_mode(&dir, 0o1777);
        check_path(&sock, euid).unwrap();
        set_mode(&dir, 0o700);
        check_path(&sock, euid).unwrap();
        // A directory of someone else's (neither ours nor root's).
        if euid != 0 {
            let e = format!("{:#}", check_path(&sock, stranger()).unwrap_err());
            assert!(e.contains(&format!("owned by uid {euid}")), "{e}");
        }
        // A missing directory passes here; binding says what is wrong.
        check_path(&dir.join("no/such/s.sock"), euid).unwrap();
        check_path(Path::new("bare-name.sock"), euid).unwrap();

        // A socket file already there must be ours (or root's). In a
        // sticky directory of root's, as /tmp, only the file's owner
        // counts. Root makes one in the scratch directory; anyone else
        // needs a directory of root's, so uses /tmp itself.
        let sticky = if euid == 0 {
            let sticky = dir.join("sticky");
            std::fs::create_dir(&sticky).unwrap();
            set_mode(&sticky, 0o1777);
            sticky
        } else {
            PathBuf::from("/tmp")
        };
        let in_tmp = sticky.join(format!(
            "hvtrace-socket-test-{}-owner.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&in_tmp);
        drop(UnixListener::bind(&in_tmp).unwrap());
        check_path(&in_tmp, euid).unwrap();
        let as_whom = if euid == 0 {
            std::os::unix::fs::chown(&in_tmp, Some(stranger()), None).unwrap();
            0
        } else {
            stranger()
        };
        let owner = std::fs::symlink_metadata(&in_tmp).unwrap().uid();
        let e = format!("{:#}", check_path(&in_tmp, as_whom).unwrap_err());
        assert!(
            e.contains(&format!(
                "it is owned by uid {owner}, not you (uid {as_whom})"
            )),
            "{e}"
        );
        let _ = std::fs::remove_file(&in_tmp);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn who_may_talk_to_whom() {
        assert!(peer_allowed(1000, 1000));
        assert!(peer_allowed(0, 1000));
        assert!(peer_allowed(0, 0));
        assert!(!peer_allowed(1001, 1000));
        assert!(!peer_allowed(1000, 0));
        assert!(!peer_allowed(65534, 1000));
        assert!(others_may_replace(0o777));
        assert!(others_may_replace(0o770));
        assert!(!others_may_replace(0o1777));
        assert!(!others_may_replace(0o755));
        assert!(!others_may_replace(0o700));
    }

    #[test]
    fn a_claimed_socket_is_private_and_sees_its_clients() {
        let dir = scratch("private");
        let path = dir.join("ctl.sock");
        let claimed = ClaimedSocket::claim(&path).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o7777, SOCKET_MODE);
        assert_eq!(meta.uid(), sys::euid());
        let client = UnixStream::connect(&path).unwrap();
        let (served, _) = claimed.listener().accept().unwrap();
        // Each end sees the other as us.
        let seen_by_server = sys::peer_uid(&served).unwrap();
        let seen_by_client = sys::peer_uid(&client).unwrap();
        assert_eq!(seen_by_server, sys::euid());
        assert_eq!(seen_by_client, sys::euid());
        assert!(peer_allowed(seen_by_server, sys::euid()));
        drop(claimed);
        let _ = std::fs::remove_dir_all(&dir);
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
