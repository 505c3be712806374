//! Building the hypervisor image.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::vm::guest::repo_root;

/// The bare-metal target of the hypervisor image.
pub const TARGET: &str = "x86_64-unknown-none";

/// The arguments of the cargo command that builds the image.
pub fn cargo_args() -> Vec<&'static str> {
    vec![
        "build",
        "-p",
        "hypervisor",
        "--release",
        "--target",
        TARGET,
        "--features",
        "bare-metal",
    ]
}

/// Where that cargo command puts the image, for a workspace at `root`.
pub fn image_path(root: &Path) -> PathBuf {
    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    };
    target_dir.join(TARGET).join("release").join("hypervisor")
}

/// Builds the hypervisor image with cargo in the repository root (cargo's
/// progress goes to our stderr) and returns its path.
pub fn build() -> Result<PathBuf> {
    let root = repo_root();
    let args = cargo_args();
    eprintln!("hvtrace: building the hypervisor: cargo {}", args.join(" "));
    let status = Command::new("cargo")
        .args(&args)
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .context("cannot run cargo to build the hypervisor")?;
    if !status.success() {
        bail!("building the hypervisor failed ({status}); see cargo's messages above");
    }
    let image = image_path(&root);
    if !image.is_file() {
        bail!(
            "cargo built the hypervisor but {} does not exist",
            image.display()
        );
    }
    Ok(image)
}

/// Builds the hypervisor image with the dev profile (debug assertions and
/// integer-overflow checks on, as the tests want at least one VM run
/// with them) into `target_dir`, and returns its path.
pub fn build_debug(target_dir: &Path) -> Result<PathBuf> {
    let root = repo_root();
    let args = [
        "build",
        "-p",
        "hypervisor",
        "--target",
        TARGET,
        "--features",
        "bare-metal",
    ];
    eprintln!(
        "hvtrace: building the debug hypervisor: cargo {} (target dir {})",
        args.join(" "),
        target_dir.display()
    );
    let status = Command::new("cargo")
        .args(args)
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .context("cannot run cargo to build the debug hypervisor")?;
    if !status.success() {
        bail!("building the debug hypervisor failed ({status}); see cargo's messages above");
    }
    let image = target_dir.join(TARGET).join("debug").join("hypervisor");
    if !image.is_file() {
        bail!(
            "cargo built the debug hypervisor but {} does not exist",
            image.display()
        );
    }
    Ok(image)
}
