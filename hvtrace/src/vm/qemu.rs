//! Running the hypervisor under QEMU.
//!
//! QEMU loads the hypervisor as a Multiboot kernel with `-kernel`; `-initrd
//! "bzImage <cmdline>,initrd"` passes the guest files as modules, whose
//! strings are `bzImage <cmdline>` and `initrd` because the files are staged
//! under those names in the run directory (QEMU's working directory). QEMU
//! splits that option at commas; a comma inside a module string is written
//! `,,`. The log port 0xE9 (`-debugcon stdio`) is QEMU's only stdout
//! (unless [`RunConfig::log_port`] is off: then there is no debug console).
//!
//! `-nodefaults` leaves out every device QEMU would add by itself (network
//! card, VGA, floppy and CD-ROM drives, default serial and parallel ports,
//! monitor); what the run needs is listed: the two serial ports, in order
//! COM1 (0x3F8) and COM2 (0x2F8), and the log port. No exit device
//! (`isa-debug-exit`): a guest could end QEMU through it with a status of
//! its choosing. The hypervisor ends QEMU as the guest does, by ACPI
//! power-off through PM1a (S5, which the `pc` machine implements), and
//! reports a fault in root on the log port and COM2 first. Both
//! serial ports are `-chardev socket` clients of the run's listeners: unix
//! sockets in the run directory, named relative to it, or TCP on 127.0.0.1
//! when the directory's path is too long for a socket address (see
//! [`crate::vm::channel`]). COM1 is the guest console, COM2 the hypervisor's
//! control channel (users who drive QEMU themselves give it
//! `path=...,server=on,wait=off` for a unix socket that QEMU serves).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::vm::channel::Endpoint;
use crate::vm::config::RunConfig;
use crate::vm::host;
use crate::vm::image::{self, INITRD_NAME, KERNEL_NAME};

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

/// Where the serial ports connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports<'a> {
    /// COM1, the guest console.
    pub serial: &'a Endpoint,
    /// COM2, the hypervisor's control channel.
    pub control: &'a Endpoint,
    /// The file that backs the guest's RAM (runs with the hypervisor):
    /// [`ram_file`].
    pub ram: &'a Path,
}

/// The file in the run directory that backs the guest's RAM (runs with the
/// hypervisor).
pub const RAM_FILE: &str = "guest-ram";

/// Bytes a tmpfs must have free beyond the guest's RAM to take its file.
const RAM_MARGIN: u64 = 64 << 20;

/// Where the file that backs the guest's RAM (`bytes` of it) goes for the
/// run in `run_dir`, as an absolute path: in a new directory of its own
/// (0700, a name nobody had) under `/dev/shm` when that is a tmpfs with
/// room for it and a margin (guest RAM then never meets disk writeback),
/// else in the run directory. `HVTRACE_RAM_DIR` names another parent.
///
/// Whoever can replace entries of that parent could put a directory of
/// their own in place of ours and get a writable mapping of the guest's
/// and the hypervisor's memory: the parent must be ours or root's, and not
/// writable by others unless sticky (as `/dev/shm`, mode 1777, is;
/// [`image::check_parent`]). A `/dev/shm` that is not is passed over for
/// the run directory, with a line on stderr; a named parent is refused.
pub fn place_ram(run_dir: &Path, bytes: u64) -> Result<std::path::PathBuf> {
    let parent = match std::env::var_os("HVTRACE_RAM_DIR") {
        Some(p) => RamParent::Named(std::path::PathBuf::from(p)),
        None => {
            let shm = std::path::PathBuf::from("/dev/shm");
            if crate::sys::is_tmpfs(&shm) {
                RamParent::Shm(shm)
            } else {
                RamParent::RunDir
            }
        }
    };
    place_ram_in(run_dir, bytes, parent, crate::sys::euid())
}

/// Where [`place_ram`] looks first for a directory of the RAM file's own.
#[derive(Clone, Debug)]
enum RamParent {
    /// `HVTRACE_RAM_DIR`: refused when others could replace its entries.
    Named(std::path::PathBuf),
    /// `/dev/shm`: passed over for the run directory when others could
    /// replace its entries.
    Shm(std::path::PathBuf),
    /// None: the run directory.
    RunDir,
}

/// [`place_ram`] with the parent chosen, for user `euid`.
fn place_ram_in(
    run_dir: &Path,
    bytes: u64,
    parent: RamParent,
    euid: u32,
) -> Result<std::path::PathBuf> {
    const WHAT: &str = "the guest's RAM";
    let room = |p: &Path| {
        crate::sys::free_bytes(p).is_some_and(|free| free >= bytes.saturating_add(RAM_MARGIN))
    };
    let parent = match parent {
        RamParent::Named(p) => {
            image::check_parent(&p, euid, WHAT)?;
            Some(p)
        }
        RamParent::Shm(p) => match image::check_parent(&p, euid, WHAT) {
            Ok(()) => Some(p),
            Err(e) => {
                eprintln!("hvtrace: {e:#}; it goes in the run directory instead");
                None
            }
        },
        RamParent::RunDir => None,
    };
    let file = match parent.filter(|p| room(p)) {
        Some(parent) => crate::sys::make_temp_dir(&parent, "hvtrace-ram-")
            .with_context(|| {
                format!(
                    "cannot make a directory for the guest's RAM in {}",
                    parent.display()
                )
            })?
            .join(RAM_FILE),
        None => run_dir.join(RAM_FILE),
    };
    std::path::absolute(&file).with_context(|| format!("{}", file.display()))
}

/// Removes the RAM file at `ram` and, when it is not the run directory
/// `run_dir`, the directory [`place_ram`] made for it.
pub fn remove_ram(run_dir: &Path, ram: &Path) {
    let _ = std::fs::remove_file(ram);
    let own = ram.parent().filter(|d| {
        std::path::absolute(run_dir).is_ok_and(|r| r != *d)
            && d.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("hvtrace-ram-"))
    });
    if let Some(dir) = own {
        let _ = std::fs::remove_dir(dir);
    }
}

/// The machine type QEMU runs, for the RAM file's layout. It stays `pc`
/// (i440FX): `q35` adds PCI Express's MMCONFIG window, through which the
/// guest would reach configuration space by memory stores that root's
/// filter of the 0xCF8/0xCFC ports never sees (bus mastering, BARs over
/// hypervisor memory).
pub const MACHINE: super::shm::MachineType = super::shm::MachineType::Pc;

/// The `-chardev` value of a socket client with id `id` connecting to
/// `endpoint` (a unix socket's name is relative to QEMU's working
/// directory, the run directory).
pub fn chardev_arg(id: &str, endpoint: &Endpoint) -> String {
    match endpoint {
        Endpoint::Tcp(port) => format!("socket,id={id},host=127.0.0.1,port={port}"),
        Endpoint::Unix(name) => format!("socket,id={id},path={}", escape_commas(name)),
    }
}

/// The guest kernel's command line for a run: `append`, and under KVM
/// `tsc=reliable` unless `append` sets `tsc=` itself. The TSC is
/// invariant there (`+invtsc`), and the guest then keeps it as its
/// clocksource without the watchdog, whose reads of a second clock
/// would each exit (to root, and from root to KVM).
pub fn guest_cmdline(append: &str, kvm: bool) -> String {
    if kvm && !append.split_whitespace().any(|w| w.starts_with("tsc=")) {
        format!("{append} tsc=reliable").trim_start().to_string()
    } else {
        append.to_string()
    }
}

/// The QEMU arguments for a run whose files are staged in its working
/// directory (`bzImage`, `initrd`, and `hypervisor` unless bare).
pub fn args(cfg: &RunConfig, kvm: bool, hypervisor: Option<&Path>, ports: Ports) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(|s| s.to_string()));
    // No device but those listed below: no network card (whose user-mode
    // network would reach the host's 127.0.0.1), no VGA, no drives.
    push(&["-nodefaults"]);
    if kvm {
        // The host's CPU with VMX for root, and the invariant TSC: without
        // it the guest's clocksource watchdog distrusts the TSC and falls
        // back to a timer QEMU emulates (each read an exit through root).
        push(&["-enable-kvm", "-cpu", "host,+vmx,+invtsc"]);
    } else {
        push(&["-accel", "tcg", "-cpu", "max"]);
    }
    let append = guest_cmdline(&cfg.append, kvm);
    let memory = cfg.memory_mib.to_string();
    let cpus = cfg.cpus.to_string();
    push(&["-m", &memory, "-smp", &cpus]);
    if hypervisor.is_some() {
        // Guest RAM from a file in the run directory (owner-only), shared,
        // so that the host can read the hypervisor's trace ring there
        // (`vm::shm`); the machine is named, since the file's layout is
        // the machine type's.
        // Allocated whole at start (prealloc): no page fault on the host
        // for a guest page's first touch, which under nested KVM is an
        // exit to the host kernel in the middle of a hit.
        let backend = format!(
            "memory-backend-file,id=ram,size={}M,mem-path={},share=on,prealloc=on",
            cfg.memory_mib,
            escape_commas(&ports.ram.to_string_lossy())
        );
        push(&["-object", &backend, "-machine", "pc,memory-backend=ram"]);
    }
    match hypervisor {
        Some(image) => {
            let image = image.to_string_lossy();
            let modules = modules_arg(&append);
            push(&["-kernel", &image, "-initrd", &modules]);
            // The hypervisor's own Multiboot command line (test hooks).
            if !cfg.hypervisor_cmdline.is_empty() {
                push(&["-append", &cfg.hypervisor_cmdline]);
            }
        }
        None => {
            push(&[
                "-kernel",
                KERNEL_NAME,
                "-initrd",
                INITRD_NAME,
                "-append",
                &append,
            ]);
        }
    }
    let serial = chardev_arg("con", ports.serial);
    let control = chardev_arg("ctl", ports.control);
    if cfg.log_port {
        push(&["-debugcon", "stdio"]);
    }
    push(&[
        // The order of -serial gives the port: COM1 (0x3F8), the console,
        // then COM2 (0x2F8), the control channel.
        "-chardev",
        &serial,
        "-serial",
        "chardev:con",
        "-chardev",
        &control,
        "-serial",
        "chardev:ctl",
        // No exit device: QEMU ends at the machine's ACPI power-off.
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
    fn guest_ram_goes_to_a_private_directory_of_its_own() {
        let base = std::env::temp_dir().join(format!("hvtrace-ramtest-{}", std::process::id()));
        let run = base.join("run.abc");
        std::fs::create_dir_all(&run).unwrap();
        // A parent with room: a fresh 0700 directory each time, never the
        // same for two runs (even of the same run directory's name).
        let mib = 1 << 20;
        let dir_of = |p: &Path| p.parent().unwrap().to_path_buf();
        let euid = crate::sys::euid();
        let named = || RamParent::Named(base.clone());
        let a = place_ram_in(&run, mib, named(), euid).unwrap();
        let b = place_ram_in(&run, mib, named(), euid).unwrap();
        assert_ne!(dir_of(&a), dir_of(&b));
        assert!(a.is_absolute() && a.starts_with(&base), "{a:?}");
        assert!(dir_of(&a)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("hvtrace-ram-"));
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir_of(&a)).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o700);
        // A parent without room for it (none this large exists), or none:
        // the run directory, as an absolute path.
        let in_run = std::path::absolute(run.join(RAM_FILE)).unwrap();
        assert_eq!(
            place_ram_in(&run, u64::MAX / 2, named(), euid).unwrap(),
            in_run
        );
        let placed = place_ram_in(&run, mib, RamParent::RunDir, euid).unwrap();
        assert_eq!(placed, in_run);
        // Removing takes the file, and its own directory but never the run
        // directory.
        std::fs::write(&a, b"x").unwrap();
        remove_ram(&run, &a);
        assert!(!dir_of(&a).exists());
        remove_ram(&run, &b);
        std::fs::write(run.join(RAM_FILE), b"x").unwrap();
        remove_ram(&run, &placed);
        assert!(!placed.exists() && run.exists());
        // A comma in the path is escaped for QEMU's option parser.
        let cfg = RunConfig::new("k", "i");
        let (serial, control) = (Endpoint::Tcp(5), Endpoint::Tcp(6));
        let odd = Path::new("/dev/shm/hvtrace-ram-a,b/guest-ram");
        let args = args(
            &cfg,
            true,
            Some(Path::new("/x/hypervisor")),
            Ports {
                serial: &serial,
                control: &control,
                ram: odd,
            },
        );
        assert!(
            values(&args, "-object")[0]
                .contains("mem-path=/dev/shm/hvtrace-ram-a,,b/guest-ram,share=on"),
            "{args:?}"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A parent for the RAM's directory where others could put their own
    /// in its place is refused when named (`HVTRACE_RAM_DIR`) and passed
    /// over for the run directory when it is `/dev/shm`: one of another
    /// user's (sticky or not), or one writable by others without the
    /// sticky bit. A sticky one of root's, as `/dev/shm`, is used.
    #[test]
    fn a_ram_parent_others_could_swap_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let euid = crate::sys::euid();
        let base = std::env::temp_dir().join(format!("hvtrace-ramparent-{}", std::process::id()));
        let run = base.join("run");
        let parent = base.join("parent");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&parent).unwrap();
        let set_mode = |mode: u32| {
            std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        let in_run = std::path::absolute(run.join(RAM_FILE)).unwrap();
        let mib = 1 << 20;
        let p = parent.display().to_string();
        let mut bad = vec![(0o777, euid), (0o770, euid), (0o757, euid)];
        if euid == 0 {
            // Another user's, with or without the sticky bit.
            bad.extend([(0o755, 65534), (0o1777, 65534), (0o700, 65534)]);
        }
        for (mode, owner) in bad {
            std::os::unix::fs::chown(&parent, Some(owner), None).unwrap();
            set_mode(mode);
            let named = place_ram_in(&run, mib, RamParent::Named(parent.clone()), euid);
            let e = format!("{:#}", named.unwrap_err());
            assert!(
                e.contains(&format!("refusing {p} for the guest's RAM")),
                "{e}"
            );
            let why = if owner == euid {
                format!("writable by others (mode {mode:04o}) without the sticky bit")
            } else {
                format!("it belongs to uid {owner}, neither you (uid {euid}) nor root")
            };
            assert!(e.contains(&why), "{mode:o} {owner}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
            let shm = place_ram_in(&run, mib, RamParent::Shm(parent.clone()), euid).unwrap();
            assert_eq!(shm, in_run, "{mode:o} {owner}");
            assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 0);
        }
        // Root's (or ours) and sticky, as /dev/shm, or not writable by
        // others: a directory of the RAM's own there.
        std::os::unix::fs::chown(&parent, Some(euid), None).unwrap();
        for mode in [0o1777, 0o755, 0o700] {
            set_mode(mode);
            for how in [
                RamParent::Named(parent.clone()),
                RamParent::Shm(parent.clone()),
            ] {
                let placed = place_ram_in(&run, mib, how, euid).unwrap();
                assert!(placed.starts_with(&parent), "{mode:o}: {placed:?}");
                remove_ram(&run, &placed);
            }
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn modules_escape_commas() {
        assert_eq!(
            modules_arg("console=ttyS0,115200  panic=-1"),
            "bzImage console=ttyS0,,115200 panic=-1,initrd"
        );
        assert_eq!(modules_arg(""), "bzImage,initrd");
    }

    /// The values of every `flag` in `args`.
    fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn kvm_and_tcg_flags() {
        let cfg = RunConfig::new("k", "i");
        let (serial, control) = (Endpoint::Tcp(5), Endpoint::Tcp(6));
        let ports = Ports {
            serial: &serial,
            control: &control,
            ram: Path::new(RAM_FILE),
        };
        let kvm = args(&cfg, true, Some(Path::new("/x/hypervisor")), ports);
        assert_eq!(
            &kvm[..4],
            ["-nodefaults", "-enable-kvm", "-cpu", "host,+vmx,+invtsc"]
        );
        assert!(kvm.windows(2).any(|w| w == ["-kernel", "/x/hypervisor"]));
        // The guest's command line travels as the module string, with
        // tsc=reliable under KVM.
        let modules = values(&kvm, "-initrd");
        assert_eq!(modules.len(), 1);
        assert!(modules[0].ends_with(" tsc=reliable,initrd"), "{modules:?}");
        assert!(modules[0].starts_with("bzImage "), "{modules:?}");
        let tcg = args(&cfg, false, None, ports);
        assert_eq!(&tcg[..5], ["-nodefaults", "-accel", "tcg", "-cpu", "max"]);
        assert!(tcg.windows(2).any(|w| w == ["-kernel", "bzImage"]));
        assert!(tcg
            .windows(2)
            .any(|w| w[0] == "-append" && w[1] == cfg.append));
        assert!(!cfg.append.contains("tsc="));
        // A bare run under KVM gets it too.
        let bare_kvm = args(&cfg, true, None, ports);
        assert_eq!(
            values(&bare_kvm, "-append"),
            [format!("{} tsc=reliable", cfg.append)]
        );
    }

    /// COM1 and COM2 as the run directory's unix sockets.
    fn unix_sockets() -> (Endpoint, Endpoint) {
        (
            Endpoint::Unix("com1.sock".into()),
            Endpoint::Unix("com2.sock".into()),
        )
    }

    /// The command line README's "Running under QEMU with nested KVM"
    /// shows is the one built for a default run (in its run directory).
    #[test]
    fn the_readme_shows_the_kvm_line_built() {
        let cfg = RunConfig::new("k", "i");
        let (serial, control) = unix_sockets();
        let ports = Ports {
            serial: &serial,
            control: &control,
            ram: Path::new("/dev/shm/hvtrace-ram-XXXXXX/guest-ram"),
        };
        let line = args(&cfg, true, Some(Path::new("hypervisor")), ports)
            .iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("\"{a}\"")
                } else {
                    a.clone()
                }
            })
            .collect::<Vec<_>>()
            .join(" ");
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
        let shown: String = readme
            .split("```sh\nqemu-system-x86_64 ")
            .nth(1)
            .and_then(|rest| rest.split("\n```").next())
            .unwrap_or_default()
            .replace(" \\\n   ", "");
        assert_eq!(shown, line, "README's KVM line");
    }

    #[test]
    fn tsc_reliable_only_under_kvm_and_only_once() {
        assert_eq!(
            guest_cmdline("console=ttyS0", true),
            "console=ttyS0 tsc=reliable"
        );
        assert_eq!(guest_cmdline("", true), "tsc=reliable");
        assert_eq!(guest_cmdline("console=ttyS0", false), "console=ttyS0");
        // The user's own choice stays.
        assert_eq!(
            guest_cmdline("tsc=unstable quiet", true),
            "tsc=unstable quiet"
        );
    }

    #[test]
    fn only_the_devices_the_run_needs() {
        let cfg = RunConfig::new("k", "i");
        let (serial, control) = unix_sockets();
        let ports = Ports {
            serial: &serial,
            control: &control,
            ram: Path::new(RAM_FILE),
        };
        for args in [
            args(&cfg, true, Some(Path::new("/x/hypervisor")), ports),
            args(&cfg, false, None, ports),
        ] {
            assert_eq!(args.iter().filter(|a| *a == "-nodefaults").count(), 1);
            for flag in [
                "-net",
                "-nic",
                "-netdev",
                "-hda",
                "-cdrom",
                "-fda",
                "-drive",
                "-usb",
                "-vga",
                "-parallel",
            ] {
                assert!(!args.iter().any(|a| a == flag), "{flag} in {args:?}");
            }
            // COM1 then COM2 (the order of -serial gives the port), each a
            // socket client of the run's unix socket.
            assert_eq!(values(&args, "-serial"), ["chardev:con", "chardev:ctl"]);
            assert_eq!(
                values(&args, "-chardev"),
                [
                    "socket,id=con,path=com1.sock",
                    "socket,id=ctl,path=com2.sock"
                ]
            );
            assert_eq!(values(&args, "-debugcon"), ["stdio"]);
            // No device of any kind: in particular no exit device, through
            // which the guest could end QEMU with a status of its choosing.
            assert!(values(&args, "-device").is_empty(), "{args:?}");
            assert!(!args.iter().any(|a| a.contains("debug-exit")), "{args:?}");
            assert_eq!(values(&args, "-display"), ["none"]);
            assert_eq!(values(&args, "-monitor"), ["none"]);
        }
        // With the hypervisor, guest RAM comes from the shared file.
        let hv = args(&cfg, true, Some(Path::new("/x/hypervisor")), ports);
        assert_eq!(
            values(&hv, "-object"),
            ["memory-backend-file,id=ram,size=512M,mem-path=guest-ram,share=on,prealloc=on"]
        );
        assert_eq!(values(&hv, "-machine"), ["pc,memory-backend=ram"]);
        let bare = args(&cfg, false, None, ports);
        assert!(values(&bare, "-object").is_empty(), "{bare:?}");
        // Without the log port: no debug console at all (with -nodefaults,
        // writes to port 0xE9 then go nowhere).
        let cfg = RunConfig {
            log_port: false,
            ..cfg
        };
        let args = args(&cfg, false, Some(Path::new("/x/hypervisor")), ports);
        assert!(values(&args, "-debugcon").is_empty(), "{args:?}");
        assert_eq!(values(&args, "-serial"), ["chardev:con", "chardev:ctl"]);
    }

    #[test]
    fn smp_is_the_cpu_count() {
        let (serial, control) = (Endpoint::Tcp(5), Endpoint::Tcp(6));
        let ports = Ports {
            serial: &serial,
            control: &control,
            ram: Path::new(RAM_FILE),
        };
        let one = RunConfig::new("k", "i");
        for args in [
            args(&one, true, Some(Path::new("/x/hypervisor")), ports),
            args(&one, false, None, ports),
        ] {
            assert_eq!(values(&args, "-smp"), ["1"], "{args:?}");
        }
        let two = RunConfig {
            cpus: 2,
            ..RunConfig::new("k", "i")
        };
        for args in [
            args(&two, true, Some(Path::new("/x/hypervisor")), ports),
            args(&two, false, Some(Path::new("/x/hypervisor")), ports),
            args(&two, false, None, ports),
        ] {
            assert_eq!(values(&args, "-smp"), ["2"], "{args:?}");
            assert_eq!(values(&args, "-m"), ["512"], "{args:?}");
        }
    }

    #[test]
    fn serial_ports_over_tcp() {
        let cfg = RunConfig::new("k", "i");
        let (serial, control) = (Endpoint::Tcp(5), Endpoint::Tcp(6));
        let ports = Ports {
            serial: &serial,
            control: &control,
            ram: Path::new(RAM_FILE),
        };
        let args = args(&cfg, false, None, ports);
        assert_eq!(values(&args, "-serial"), ["chardev:con", "chardev:ctl"]);
        assert_eq!(
            values(&args, "-chardev"),
            [
                "socket,id=con,host=127.0.0.1,port=5",
                "socket,id=ctl,host=127.0.0.1,port=6"
            ]
        );
        assert_eq!(
            chardev_arg("x", &Endpoint::Unix("a,b".into())),
            "socket,id=x,path=a,,b"
        );
    }
}
