//! Running the hypervisor under QEMU.
//!
//! QEMU loads the hypervisor as a Multiboot kernel with `-kernel`; `-initrd
//! "bzImage <cmdline>,initrd"` passes the guest files as modules, whose
//! strings are `bzImage <cmdline>` and `initrd` because the files are staged
//! under those names in the run directory (QEMU's working directory). QEMU
//! splits that option at commas; a comma inside a module string is written
//! `,,`. The log port 0xE9 (`-debugcon stdio`) is QEMU's only stdout; COM1
//! connects as a TCP client to the listener of the run.

use std::path::Path;
use std::process::Command;

use anyhow::Result;

use crate::config::RunConfig;
use crate::host;
use crate::image::{INITRD_NAME, KERNEL_NAME};

/// The QEMU binary.
pub const PROGRAM: &str = "qemu-system-x86_64";

/// Escapes a value for QEMU's comma-separated option syntax.
pub fn escape_commas(value: &str) -> String {
    value.replace(',', ",,")
}

/// The `-initrd` value that passes the guest to the hypervisor.
pub fn modules_arg(append: &str) -> String {
    let append = append.split_whitespace().collect::<Vec<_>>().join(" ");
    let cmdline = if append.is_empty() {
        KERNEL_NAME.to_string()
    } else {
        format!("{KERNEL_NAME} {append}")
    };
    format!("{},{INITRD_NAME}", escape_commas(&cmdline))
}

/// The QEMU arguments for a run whose files are staged in its working
/// directory (`bzImage`, `initrd`, and `hypervisor` unless bare).
pub fn args(
    cfg: &RunConfig,
    kvm: bool,
    hypervisor: Option<&Path>,
    serial_port: u16,
) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(|s| s.to_string()));
    if kvm {
        push(&["-enable-kvm", "-cpu", "host,+vmx"]);
    } else {
        push(&["-accel", "tcg", "-cpu", "max"]);
    }
    let memory = cfg.memory_mib.to_string();
    push(&["-m", &memory, "-smp", "1"]);
    match hypervisor {
        Some(image) => {
            let image = image.to_string_lossy();
            let modules = modules_arg(&cfg.append);
            push(&["-kernel", &image, "-initrd", &modules]);
        }
        None => {
            push(&[
                "-kernel",
                KERNEL_NAME,
                "-initrd",
                INITRD_NAME,
                "-append",
                &cfg.append,
            ]);
        }
    }
    let serial = format!("tcp:127.0.0.1:{serial_port}");
    push(&[
        "-debugcon",
        "stdio",
        "-serial",
        &serial,
        // Lets the hypervisor end QEMU: a write of N to port 0xf4 exits with
        // status 2N+1.
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=0x04",
        "-display",
        "none",
        "-monitor",
        "none",
        "-no-reboot",
    ]);
    args
}

/// The command that starts QEMU in `dir`.
pub fn prepare(
    dir: &Path,
    cfg: &RunConfig,
    kvm: bool,
    hypervisor: Option<&Path>,
    serial_port: u16,
) -> Result<Command> {
    host::require_program(PROGRAM, "qemu-system-x86")?;
    let mut cmd = Command::new(PROGRAM);
    cmd.args(args(cfg, kvm, hypervisor, serial_port))
        .current_dir(dir);
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_escape_commas() {
        assert_eq!(
            modules_arg("console=ttyS0,115200  panic=-1"),
            "bzImage console=ttyS0,,115200 panic=-1,initrd"
        );
        assert_eq!(modules_arg(""), "bzImage,initrd");
    }

    #[test]
    fn kvm_and_tcg_flags() {
        let cfg = RunConfig::new("k", "i");
        let kvm = args(&cfg, true, Some(Path::new("/x/hypervisor")), 5);
        assert_eq!(&kvm[..3], ["-enable-kvm", "-cpu", "host,+vmx"]);
        assert!(kvm.windows(2).any(|w| w == ["-kernel", "/x/hypervisor"]));
        assert!(kvm.windows(2).any(|w| w == ["-serial", "tcp:127.0.0.1:5"]));
        let tcg = args(&cfg, false, None, 5);
        assert_eq!(&tcg[..4], ["-accel", "tcg", "-cpu", "max"]);
        assert!(tcg.windows(2).any(|w| w == ["-kernel", "bzImage"]));
        assert!(tcg
            .windows(2)
            .any(|w| w[0] == "-append" && w[1] == cfg.append));
    }
}
