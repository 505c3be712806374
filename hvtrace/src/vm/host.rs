//! Facts about the host machine.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// True when QEMU can run the hypervisor with KVM and nested VMX: `/dev/kvm`
/// exists and the CPU flags in `/proc/cpuinfo` include `vmx`.
pub fn has_kvm_vmx() -> bool {
    if !Path::new("/dev/kvm").exists() {
        return false;
    }
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|text| cpuinfo_has_flag(&text, "vmx"))
        .unwrap_or(false)
}

/// True when a `flags` line of a `/proc/cpuinfo` text lists `flag`.
pub fn cpuinfo_has_flag(cpuinfo: &str, flag: &str) -> bool {
    cpuinfo.lines().any(|line| {
        let mut parts = line.splitn(2, ':');
        let key = parts.next().unwrap_or("").trim();
        let value = parts.next().unwrap_or("");
        key == "flags" && value.split_whitespace().any(|f| f == flag)
    })
}

/// Finds a program in `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Fails with a hint naming the Debian package when `program` is missing.
pub fn require_program(program: &str, package: &str) -> Result<PathBuf> {
    match which(program) {
        Some(path) => Ok(path),
        None => bail!(
            "{program} not found in PATH (Debian package {package}; scripts/setup.sh installs it)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags() {
        let text = "processor\t: 0\nflags\t\t: fpu vme vmx sse\nbugs\t\t: vmx_x\n";
        assert!(cpuinfo_has_flag(text, "vmx"));
        assert!(!cpuinfo_has_flag(text, "svm"));
        assert!(!cpuinfo_has_flag("bugs : vmx\n", "vmx"));
    }
}
