//! Facts about the host machine.

use std::path::PathBuf;

use anyhow::{bail, Result};

/// True when QEMU can run the hypervisor with KVM and nested VMX (see
/// [`kvm_vmx`]).
pub fn has_kvm_vmx() -> bool {
    kvm_vmx().is_ok()
}

/// Whether QEMU can run the hypervisor with KVM and nested VMX here: the
/// CPU flags in `/proc/cpuinfo` include `vmx`, `kvm_intel` offers nested
/// VMX (`/sys/module/kvm_intel/parameters/nested`), and `/dev/kvm` opens
/// for reading and writing. Otherwise, why not, in words for the user.
pub fn kvm_vmx() -> std::result::Result<(), String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let nested = std::fs::read_to_string("/sys/module/kvm_intel/parameters/nested").ok();
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(|_| ())
        .map_err(|e| e.to_string());
    kvm_vmx_from(&cpuinfo, nested.as_deref(), dev)
}

/// [`kvm_vmx`] over what the host says: its `/proc/cpuinfo`, the
/// `kvm_intel` module's `nested` parameter (`None`: not loaded), and the
/// opening of `/dev/kvm`.
pub fn kvm_vmx_from(
    cpuinfo: &str,
    nested: Option<&str>,
    dev: std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    if !cpuinfo_has_flag(cpuinfo, "vmx") {
        return Err(
            "this CPU has no VMX (KVM's nested VMX needs an Intel CPU with VT-x and EPT)".into(),
        );
    }
    match nested.map(str::trim) {
        None => return Err("the kvm_intel module is not loaded (modprobe kvm_intel nested=1)".into()),
        Some("Y" | "y" | "1") => {}
        Some(other) => {
            return Err(format!(
                "kvm_intel's nested VMX is off (nested={other}): modprobe -r kvm_intel && modprobe kvm_intel nested=1"
            ))
        }
    }
    dev.map_err(|e| format!("/dev/kvm cannot be opened for reading and writing ({e}): add yourself to the kvm group"))
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
    fn nested_kvm_is_checked_before_it_is_picked() {
        let vmx = "flags\t\t: fpu vmx sse\n";
        assert_eq!(kvm_vmx_from(vmx, Some("Y\n"), Ok(())), Ok(()));
        assert_eq!(kvm_vmx_from(vmx, Some("1\n"), Ok(())), Ok(()));
        let off = kvm_vmx_from(vmx, Some("N\n"), Ok(())).unwrap_err();
        assert!(
            off.contains("nested=N") && off.contains("modprobe kvm_intel nested=1"),
            "{off}"
        );
        let unloaded = kvm_vmx_from(vmx, None, Ok(())).unwrap_err();
        assert!(unloaded.contains("not loaded"), "{unloaded}");
        let denied = kvm_vmx_from(vmx, Some("Y"), Err("Permission denied".into())).unwrap_err();
        assert!(
            denied.contains("/dev/kvm") && denied.contains("Permission denied"),
            "{denied}"
        );
        let amd = kvm_vmx_from("flags\t\t: fpu svm sse\n", Some("Y"), Ok(())).unwrap_err();
        assert!(amd.contains("no VMX"), "{amd}");
        for e in [off, unloaded, denied, amd] {
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn flags() {
        let text = "processor\t: 0\nflags\t\t: fpu vme vmx sse\nbugs\t\t: vmx_x\n";
        assert!(cpuinfo_has_flag(text, "vmx"));
        assert!(!cpuinfo_has_flag(text, "svm"));
        assert!(!cpuinfo_has_flag("bugs : vmx\n", "vmx"));
    }
}
