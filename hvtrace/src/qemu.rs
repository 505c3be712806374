//! Running the hypervisor under QEMU.
//!
//! QEMU loads the hypervisor as a Multiboot kernel with `-kernel`; `-initrd
//! "bzImage <cmdline>,initrd"` passes the guest files as modules, whose
//! strings are `bzImage <cmdline>` and `initrd` because the files are staged
//! under those names in the run directory (QEMU's working directory). QEMU
//! splits that option at commas; a comma inside a module string is written
//! `,,`. The log port 0xE9 (`-debugcon stdio`) is QEMU's only stdout; COM1
//! connects as a TCP client to the listener of the run, and so does COM2, the
//! hypervisor's control channel (a `-chardev socket` client; users who drive
//! QEMU themselves give it `path=...,server=on,wait=off` for a unix socket).

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

/// The TCP ports on 127.0.0.1 that the serial ports connect to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    /// COM1, the guest console.
    pub serial: u16,
    /// COM2, the hypervisor's control channel.
    pub control: u16,
}

/// The QEMU arguments for a run whose files are staged in its working
/// directory (`bzImage`, `initrd`, and `hypervisor` unless bare).
pub fn args(cfg: &RunConfig, kvm: bool, hypervisor: Option<&Path>, ports: Ports) -> Vec<String> {
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
    let serial = format!("tcp:127.0.0.1:{}", ports.serial);
    let control = format!("socket,id=ctl,host=127.0.0.1,port={}", ports.control);
    push(&[
        "-debugcon",
        "stdio",
        "-serial",
        &serial,
        // The second serial port is COM2 (0x2F8), the control channel.
        "-chardev",
        &control,
        "-serial",
        "chardev:ctl",
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
    ports: Ports,
) -> Result<Command> {
    host::require_program(PROGRAM, "qemu-system-x86")?;
    let mut cmd = Command::new(PROGRAM);
    cmd.args(args(cfg, kvm, hypervisor, ports)).current_dir(dir);
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
        let ports = Ports {
            serial: 5,
            control: 6,
        };
        let kvm = args(&cfg, true, Some(Path::new("/x/hypervisor")), ports);
        assert_eq!(&kvm[..3], ["-enable-kvm", "-cpu", "host,+vmx"]);
        assert!(kvm.windows(2).any(|w| w == ["-kernel", "/x/hypervisor"]));
        // COM1 first, then COM2 (the order of -serial gives the port).
        let serials: Vec<&str> = kvm
            .windows(2)
            .filter(|w| w[0] == "-serial")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(serials, ["tcp:127.0.0.1:5", "chardev:ctl"]);
        assert!(kvm
            .windows(2)
            .any(|w| w == ["-chardev", "socket,id=ctl,host=127.0.0.1,port=6"]));
        let tcg = args(&cfg, false, None, ports);
        assert_eq!(&tcg[..4], ["-accel", "tcg", "-cpu", "max"]);
        assert!(tcg.windows(2).any(|w| w == ["-kernel", "bzImage"]));
        assert!(tcg
            .windows(2)
            .any(|w| w[0] == "-append" && w[1] == cfg.append));
    }
}
