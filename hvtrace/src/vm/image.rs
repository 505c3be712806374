//! The run directory and the GRUB boot image for Bochs.
//!
//! Bochs boots a CD: GRUB loads the hypervisor as a Multiboot kernel with the
//! guest bzImage and initramfs as modules. GRUB passes the rest of a `module`
//! line (after the file) as the module string, which the hypervisor reads as
//! `bzImage <guest cmdline>`; QEMU's `-initrd "bzImage <cmdline>,initrd"`
//! yields the same strings. With `--bare` GRUB boots the kernel itself.

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};

use crate::vm::config::RunConfig;
use crate::vm::host;

/// File names of the guest files inside the run directory and the image.
pub const KERNEL_NAME: &str = "bzImage";
/// See [`KERNEL_NAME`].
pub const INITRD_NAME: &str = "initrd";
/// See [`KERNEL_NAME`].
pub const HYPERVISOR_NAME: &str = "hypervisor";

/// The mode of a run directory: the owner's alone. It holds the guest's
/// console log and the supervisor's state file.
pub const RUN_DIR_MODE: u32 = 0o700;

/// Creates a fresh, empty run directory under the system temp directory,
/// mode [`RUN_DIR_MODE`]. A directory already there under the same name is
/// not taken over: that is an error; so is a temp directory where others
/// could replace it ([`check_parent`]).
pub fn create_run_dir() -> Result<PathBuf> {
    create_run_dir_in(&std::env::temp_dir(), crate::sys::euid())
}

/// [`create_run_dir`] in `parent`, for user `euid`.
fn create_run_dir_in(parent: &Path, euid: u32) -> Result<PathBuf> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    check_parent(parent, euid, "the run directory")?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let name = format!(
        "hvtrace-run-{}-{}-{:08x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        nanos
    );
    let dir = parent.join(name);
    DirBuilder::new()
        .mode(RUN_DIR_MODE)
        .create(&dir)
        .with_context(|| format!("cannot create run directory {}", dir.display()))?;
    make_private_as(&dir, euid)?;
    Ok(dir)
}

/// Makes sure the run directory `dir` (given by the caller) exists: one
/// that is missing is created with mode [`RUN_DIR_MODE`] (and its missing
/// parents too); one that is there is used as it is when it is ours and
/// nobody else may write in it. Either way its directory must be one where
/// nobody but us and root can put another in its place ([`check_parent`]),
/// and so must a symbolic link's, when `dir` is one.
pub fn ensure_run_dir(dir: &Path) -> Result<()> {
    ensure_run_dir_as(dir, crate::sys::euid())
}

/// [`ensure_run_dir`] for user `euid`.
fn ensure_run_dir_as(dir: &Path, euid: u32) -> Result<()> {
    let d = dir.display();
    let what = format!("the run directory {d}");
    match std::fs::symlink_metadata(dir) {
        Ok(link) => {
            if !dir.is_dir() {
                bail!("run directory {d} is not a directory");
            }
            if link.file_type().is_symlink() {
                // Where the link is: whoever may replace it may point it
                // elsewhere.
                if link.uid() != euid && link.uid() != 0 {
                    bail!(
                        "refusing the run directory {d}: it is a symbolic link of uid {}, neither you (uid {euid}) nor root",
                        link.uid()
                    );
                }
                check_parent(&parent_of(dir), euid, &what)?;
            }
            let real = std::fs::canonicalize(dir)
                .with_context(|| format!("cannot resolve run directory {d}"))?;
            check_parent(&parent_of(&real), euid, &what)?;
            let meta = std::fs::metadata(&real)
                .with_context(|| format!("cannot check run directory {d}"))?;
            let mode = meta.mode() & 0o7777;
            if meta.uid() != euid {
                bail!(
                    "refusing the run directory {d}: it belongs to uid {}, not you (uid {euid})",
                    meta.uid()
                );
            }
            if mode & 0o022 != 0 {
                bail!("refusing the run directory {d}: others may write in it (mode {mode:04o})");
            }
            Ok(())
        }
        Err(_) => {
            DirBuilder::new()
                .recursive(true)
                .mode(RUN_DIR_MODE)
                .create(dir)
                .with_context(|| format!("cannot create run directory {d}"))?;
            make_private_as(dir, euid)?;
            let real = std::fs::canonicalize(dir)
                .with_context(|| format!("cannot resolve run directory {d}"))?;
            check_parent(&parent_of(&real), euid, &what)
        }
    }
}

/// The directory `path` is in: `.` for a bare name, `path` itself for the
/// root.
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if p.as_os_str().is_empty() => PathBuf::from("."),
        Some(p) => p.to_path_buf(),
        None => path.to_path_buf(),
    }
}

/// Checks that nobody but user `euid` and root can replace an entry of
/// directory `dir`, where `what` (named in the error) goes or is: `dir`
/// belongs to one of them and is not writable by others unless sticky (as
/// `/tmp` and `/dev/shm` are, mode 1777, where entries are their owners'
/// alone). Anyone else could swap a directory of their own in for ours
/// there. The error is one line naming `dir` and why.
pub fn check_parent(dir: &Path, euid: u32, what: &str) -> Result<()> {
    let d = dir.display();
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("cannot check {d}, the directory of {what}"))?;
    if !meta.is_dir() {
        bail!("cannot use {d} for {what}: it is not a directory");
    }
    if meta.uid() != euid && meta.uid() != 0 {
        bail!(
            "refusing {d} for {what}: it belongs to uid {}, neither you (uid {euid}) nor root, who could put a directory of their own in place of hvtrace's",
            meta.uid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if others_may_replace(mode) {
        bail!(
            "refusing {d} for {what}: it is writable by others (mode {mode:04o}) without the sticky bit, so anyone could put a directory of their own in place of hvtrace's"
        );
    }
    Ok(())
}

/// True when `mode` lets others than the owner create or remove entries:
/// group- or world-writable without the sticky bit. Run directories' parents
/// ([`check_parent`]) and control socket directories are held to it.
pub fn others_may_replace(mode: u32) -> bool {
    mode & 0o022 != 0 && mode & 0o1000 == 0
}

/// Gives a directory this process just created (for user `euid`) mode
/// [`RUN_DIR_MODE`], whatever the umask took away, and checks that it is
/// theirs.
fn make_private_as(dir: &Path, euid: u32) -> Result<()> {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(RUN_DIR_MODE))
        .with_context(|| format!("cannot restrict run directory {}", dir.display()))?;
    let meta = std::fs::symlink_metadata(dir)
        .with_context(|| format!("cannot check run directory {}", dir.display()))?;
    let mode = meta.mode() & 0o7777;
    if !meta.is_dir() || meta.uid() != euid || mode != RUN_DIR_MODE {
        bail!(
            "run directory {} is not a private directory of ours (uid {}, mode {mode:o})",
            dir.display(),
            meta.uid()
        );
    }
    Ok(())
}

/// Copies `from` to `dir/name`.
pub fn stage_file(from: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
    let to = dir.join(name);
    std::fs::copy(from, &to)
        .with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    Ok(to)
}

/// Copies an ELF image without its debug sections (GRUB reads every byte of
/// a module from the emulated CD, at about 23 M emulated instructions per
/// MiB), or unchanged when objcopy is missing or fails.
pub fn stage_stripped(from: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
    let to = dir.join(name);
    if host::which("objcopy").is_some() {
        let stripped = Command::new("objcopy")
            .arg("--strip-debug")
            .arg(from)
            .arg(&to)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if stripped && to.is_file() {
            return Ok(to);
        }
    }
    stage_file(from, dir, name)
}

/// Quotes one word for GRUB's script parser: plain words stay as they are,
/// others go in single quotes (GRUB, like a shell, has no escapes inside them).
pub fn grub_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=,./:+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The guest command line as GRUB words.
fn grub_args(append: &str) -> String {
    append
        .split_whitespace()
        .map(grub_quote)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The grub.cfg that boots the hypervisor with the guest as modules, or with
/// `bare` the guest kernel itself. `hv_cmdline` is the hypervisor's own
/// command line (test hooks; usually empty).
pub fn grub_cfg(append: &str, bare: bool, hv_cmdline: &str) -> String {
    let args = grub_args(append);
    let sep = if args.is_empty() { "" } else { " " };
    let body = if bare {
        format!("    linux /boot/{KERNEL_NAME}{sep}{args}\n    initrd /boot/{INITRD_NAME}\n")
    } else {
        let hv_args = grub_args(hv_cmdline);
        let hv_sep = if hv_args.is_empty() { "" } else { " " };
        format!(
            "    multiboot /boot/{HYPERVISOR_NAME}{hv_sep}{hv_args}\n    module /boot/{KERNEL_NAME} {KERNEL_NAME}{sep}{args}\n    module /boot/{INITRD_NAME} {INITRD_NAME}\n"
        )
    };
    let title = if bare { "linux (bare)" } else { "hvtrace" };
    format!("set timeout=0\nset default=0\nmenuentry \"{title}\" {{\n{body}    boot\n}}\n")
}

/// Builds `dir/boot.iso` for the run: GRUB plus the hypervisor (unless bare),
/// the kernel and the initramfs.
pub fn build_iso(dir: &Path, cfg: &RunConfig) -> Result<PathBuf> {
    host::require_program(
        "grub-mkrescue",
        "grub-pc-bin, grub-common, xorriso and mtools",
    )?;
    let tree = dir.join("iso");
    let boot = tree.join("boot");
    std::fs::create_dir_all(boot.join("grub"))
        .with_context(|| format!("cannot create {}", boot.display()))?;
    stage_file(&cfg.kernel, &boot, KERNEL_NAME)?;
    stage_file(&cfg.initrd, &boot, INITRD_NAME)?;
    if let Some(hv) = &cfg.hypervisor {
        stage_stripped(hv, &boot, HYPERVISOR_NAME)?;
    }
    let grub_cfg_path = boot.join("grub").join("grub.cfg");
    std::fs::write(
        &grub_cfg_path,
        grub_cfg(
            &cfg.append,
            cfg.hypervisor.is_none(),
            &cfg.hypervisor_cmdline,
        ),
    )
    .with_context(|| format!("cannot write {}", grub_cfg_path.display()))?;

    let iso = dir.join("boot.iso");
    let output = Command::new("grub-mkrescue")
        .args(["--locales=", "--fonts=", "--themes=", "-o"])
        .arg(&iso)
        .arg(&tree)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .context("cannot run grub-mkrescue")?;
    let log = dir.join("grub-mkrescue.log");
    let mut text = output.stdout.clone();
    text.extend_from_slice(&output.stderr);
    // The log is only for diagnosis; failing to write it changes nothing.
    let _ = std::fs::write(&log, &text);
    if !output.status.success() || !iso.is_file() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("no message");
        bail!("grub-mkrescue failed ({}): {last}", output.status);
    }
    // The tree is no longer needed; the ISO holds copies of its files.
    let _ = std::fs::remove_dir_all(&tree);
    Ok(iso)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private directory of the test's own in the system temp
    /// directory, empty: the run directories of a test are made in it,
    /// never beside those of real runs.
    fn scratch(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hvtrace-image-test-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        DirBuilder::new().mode(RUN_DIR_MODE).create(&dir).unwrap();
        set_mode(&dir, RUN_DIR_MODE);
        dir
    }

    #[test]
    fn run_directories_are_private() {
        let euid = crate::sys::euid();
        let parent = scratch("private");
        let dir = create_run_dir_in(&parent, euid).unwrap();
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700);
        assert_eq!(meta.uid(), euid);
        let other = create_run_dir_in(&parent, euid).unwrap();
        assert_ne!(dir, other);

        // A given directory that is missing is created private, parents too.
        let nested = dir.join("a/b");
        ensure_run_dir(&nested).unwrap();
        for d in [dir.join("a"), nested.clone()] {
            let mode = std::fs::symlink_metadata(&d).unwrap().mode() & 0o7777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
        // One that is there is left as it is; a file is refused.
        std::fs::set_permissions(&nested, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_run_dir(&nested).unwrap();
        let mode = std::fs::symlink_metadata(&nested).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o755);
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = format!("{:#}", ensure_run_dir(&file).unwrap_err());
        assert!(e.contains("is not a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&parent);
    }

    /// A user who is neither us nor root.
    const STRANGER: u32 = 65534;

    fn set_mode(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A run directory given by the caller is refused when it, or the
    /// directory it is in, lets someone else swap it: in a directory of
    /// another user's, or one writable by others without the sticky bit;
    /// or when it is not ours or others may write in it. A sticky parent
    /// of root's, as /tmp, is fine.
    #[test]
    fn a_run_directory_others_could_swap_is_refused() {
        let euid = crate::sys::euid();
        let base = scratch("swap");
        let parent = base.join("parent");
        let run = parent.join("run");
        std::fs::create_dir_all(&run).unwrap();
        set_mode(&run, 0o700);
        let err = |dir: &Path, as_whom: u32| {
            format!("{:#}", ensure_run_dir_as(dir, as_whom).unwrap_err())
        };
        ensure_run_dir_as(&run, euid).unwrap();

        // The parent writable by others, without the sticky bit: refused,
        // whether the run directory is there or to be made.
        let p = parent.display().to_string();
        for mode in [0o777, 0o770, 0o757] {
            set_mode(&parent, mode);
            let e = err(&run, euid);
            assert!(
                e.contains(&format!("refusing {p} for the run directory")),
                "{e}"
            );
            assert!(
                e.contains(&format!(
                    "writable by others (mode {mode:04o}) without the sticky bit"
                )),
                "{e}"
            );
            assert!(!e.contains('\n'), "one line: {e}");
            let e = err(&parent.join("new"), euid);
            assert!(e.contains("writable by others"), "{e}");
        }
        // Sticky, as /tmp: fine.
        set_mode(&parent, 0o1777);
        ensure_run_dir_as(&run, euid).unwrap();
        set_mode(&parent, 0o755);

        // The run directory itself writable by others: refused.
        for mode in [0o770, 0o707, 0o1777] {
            set_mode(&run, mode);
            let e = err(&run, euid);
            assert!(
                e.contains(&format!("others may write in it (mode {mode:04o})")),
                "{e}"
            );
        }
        set_mode(&run, 0o755);
        ensure_run_dir_as(&run, euid).unwrap();

        if euid == 0 {
            // Root hands the parent to another user: refused, sticky or not.
            for mode in [0o755, 0o1777] {
                std::os::unix::fs::chown(&parent, Some(STRANGER), None).unwrap();
                set_mode(&parent, mode);
                let e = err(&run, euid);
                assert!(
                    e.contains(&format!(
                        "it belongs to uid {STRANGER}, neither you (uid 0) nor root"
                    )),
                    "{e}"
                );
            }
            std::os::unix::fs::chown(&parent, Some(0), None).unwrap();
            set_mode(&parent, 0o755);
            // A run directory of another user's: refused.
            std::os::unix::fs::chown(&run, Some(STRANGER), None).unwrap();
            let e = err(&run, euid);
            assert!(
                e.contains(&format!("it belongs to uid {STRANGER}, not you (uid 0)")),
                "{e}"
            );
            std::os::unix::fs::chown(&run, Some(0), None).unwrap();
            // A link, in a good directory, to the run directory: fine; a
            // link of another user's: refused.
            let link = base.join("link");
            std::os::unix::fs::symlink(&run, &link).unwrap();
            ensure_run_dir_as(&link, euid).unwrap();
            std::os::unix::fs::lchown(&link, Some(STRANGER), None).unwrap();
            let e = err(&link, euid);
            assert!(
                e.contains(&format!("symbolic link of uid {STRANGER}")),
                "{e}"
            );
        } else {
            // Seen as another user: the run directory is not theirs.
            let e = err(&run, STRANGER);
            assert!(e.contains(&format!("it belongs to uid {euid}")), "{e}");
        }

        // A fresh run directory is made only in a good place.
        set_mode(&parent, 0o777);
        let e = format!("{:#}", create_run_dir_in(&parent, euid).unwrap_err());
        assert!(e.contains("writable by others (mode 0777)"), "{e}");
        set_mode(&parent, 0o1777);
        let fresh = create_run_dir_in(&parent, euid).unwrap();
        assert!(fresh.starts_with(&parent));
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn quoting() {
        assert_eq!(grub_quote("console=ttyS0,115200"), "console=ttyS0,115200");
        assert_eq!(grub_quote("panic=-1"), "panic=-1");
        assert_eq!(grub_quote("a$b"), "'a$b'");
        assert_eq!(grub_quote("it's"), r"'it'\''s'");
        assert_eq!(grub_quote("x;y"), "'x;y'");
    }

    #[test]
    fn hypervisor_entry() {
        let cfg = grub_cfg("console=ttyS0,115200 panic=-1", false, "");
        assert!(cfg.starts_with("set timeout=0\nset default=0\n"));
        assert!(cfg.contains("    multiboot /boot/hypervisor\n"));
        assert!(cfg.contains("    module /boot/bzImage bzImage console=ttyS0,115200 panic=-1\n"));
        assert!(cfg.contains("    module /boot/initrd initrd\n    boot\n}"));
        assert!(!cfg.contains("linux "));
        // The hypervisor's own command line goes on its multiboot line.
        let hooked = grub_cfg("quiet", false, "hvtrace.selftest=stack-overflow");
        assert!(hooked.contains("    multiboot /boot/hypervisor hvtrace.selftest=stack-overflow\n"));
        assert!(hooked.contains("    module /boot/bzImage bzImage quiet\n"));
    }

    #[test]
    fn bare_entry() {
        let cfg = grub_cfg("console=ttyS0 quiet", true, "");
        assert!(cfg.contains("    linux /boot/bzImage console=ttyS0 quiet\n"));
        assert!(cfg.contains("    initrd /boot/initrd\n"));
        assert!(!cfg.contains("multiboot"));
        let empty = grub_cfg("", true, "");
        assert!(empty.contains("    linux /boot/bzImage\n"));
    }
}
