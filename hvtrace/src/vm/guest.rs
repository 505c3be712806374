//! The built-in guest: kernels and initramfs from the scripts in
//! `scripts/guest/`, found relative to the repository root.
//!
//! Each script builds or downloads its output on first use (into a cache
//! outside the repository), logs progress on stderr and prints one path on
//! stdout. Next to each bzImage lies a file `release` with what `uname -r`
//! prints in the guest.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::vm::config::Guest;

/// The repository root: `$HVTRACE_ROOT` when set, else the parent of this
/// crate's directory at build time.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("HVTRACE_ROOT") {
        if !root.is_empty() {
            return PathBuf::from(root);
        }
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Runs one of the path-printing scripts (relative to the repository root)
/// and returns the path it printed. Its stderr goes to ours.
pub fn run_script(relative: &str) -> Result<PathBuf> {
    let root = repo_root();
    let script = root.join(relative);
    if !script.is_file() {
        bail!(
            "{} not found (set HVTRACE_ROOT to the hvtrace repository)",
            script.display()
        );
    }
    let output = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run bash {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{relative} failed ({}); see its messages above",
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let Some(line) = stdout.lines().rev().map(str::trim).find(|l| !l.is_empty()) else {
        bail!("{relative} printed no path");
    };
    let path = PathBuf::from(line);
    if !path.is_file() {
        bail!("{relative} printed {}, which is not a file", path.display());
    }
    Ok(path)
}

/// The bzImage of a built-in guest.
pub fn kernel(guest: Guest) -> Result<PathBuf> {
    run_script(guest.script())
}

/// The guest initramfs.
pub fn initrd() -> Result<PathBuf> {
    run_script("scripts/guest/initramfs.sh")
}

/// The kernel release recorded next to a bzImage (`release`), trimmed.
pub fn release_of(kernel: &Path) -> Result<String> {
    let file = kernel.with_file_name("release");
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let release = text.trim();
    if release.is_empty() {
        bail!("{} is empty", file.display());
    }
    Ok(release.to_string())
}
