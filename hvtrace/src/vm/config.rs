//! What to boot and how: the resolved configuration of one run.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::{vm::guest, vm::host};

// The built-in guests belong to `guest`; a configuration names one
// (`RunConfig::for_guest`), so the type is offered here too.
pub use crate::vm::guest::Guest;

/// The guest command line used when none is given.
pub const DEFAULT_APPEND: &str = "console=ttyS0,115200 panic=-1";
/// Guest RAM given to the emulator, in MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 512;
/// vCPUs of the guest VM when none is asked for: one, as QEMU's own
/// default. Bochs emulates every CPU in one host thread, so each extra vCPU
/// slows all of them; one vCPU also keeps a trace's lines in one stream.
pub const DEFAULT_CPUS: u32 = 1;
/// The most vCPUs a run may have: no more than the hypervisor takes into
/// VMX from the MADT (`hypervisor::acpi::MAX_CPUS`).
pub const MAX_CPUS: u32 = 16;
const _: () = assert!(MAX_CPUS as usize <= hypervisor::acpi::MAX_CPUS);
/// Wall-clock limit of a whole run.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Emulated instructions per second that Bochs assumes (its `ips`).
pub const DEFAULT_BOCHS_IPS: u64 = 50_000_000;
/// The Bochs CPU model: VMX with EPT, unrestricted guest and the preemption
/// timer, and none of the features whose emulation is broken in Bochs 2.7.
pub const DEFAULT_BOCHS_CPU: &str = "corei7_haswell_4770";

/// The emulator that runs the hypervisor, as resolved for this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulator {
    /// Bochs, the VMX machine where the host has no VMX.
    Bochs,
    /// QEMU; `kvm` selects `-enable-kvm -cpu host,+vmx` over TCG.
    Qemu { kvm: bool },
}

impl Emulator {
    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Emulator::Bochs => "bochs",
            Emulator::Qemu { kvm: true } => "qemu (kvm)",
            Emulator::Qemu { kvm: false } => "qemu (tcg)",
        }
    }
}

impl fmt::Display for Emulator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The emulator the user asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EmulatorChoice {
    /// QEMU with KVM when the host has usable VMX, otherwise Bochs.
    #[default]
    Auto,
    /// QEMU: KVM with nested VMX when the host has it, TCG otherwise.
    Qemu,
    /// Bochs.
    Bochs,
}

impl EmulatorChoice {
    /// Decides for this host.
    pub fn resolve(self) -> Emulator {
        let kvm = host::has_kvm_vmx();
        match self {
            EmulatorChoice::Auto if kvm => Emulator::Qemu { kvm: true },
            EmulatorChoice::Auto => Emulator::Bochs,
            EmulatorChoice::Qemu => Emulator::Qemu { kvm },
            EmulatorChoice::Bochs => Emulator::Bochs,
        }
    }
}

/// Refuses a run that cannot work: the hypervisor (`hypervisor`) under
/// QEMU without KVM's nested VMX, which TCG cannot emulate, unless the
/// user asked for TCG (`tcg_asked`: `--no-kvm`, to see the hypervisor
/// refuse a CPU without VMX). One line says what to do.
pub fn check_emulator(emulator: Emulator, hypervisor: bool, tcg_asked: bool) -> Result<()> {
    check_emulator_with(emulator, hypervisor, tcg_asked, host::kvm_vmx)
}

/// [`check_emulator`] with the host's answer (`kvm`) given.
pub fn check_emulator_with(
    emulator: Emulator,
    hypervisor: bool,
    tcg_asked: bool,
    kvm: impl FnOnce() -> std::result::Result<(), String>,
) -> Result<()> {
    if emulator != (Emulator::Qemu { kvm: false }) || !hypervisor || tcg_asked {
        return Ok(());
    }
    let why = kvm().err().unwrap_or_else(|| "KVM was not picked".into());
    bail!(
        "QEMU cannot run the hypervisor here: {why}; or run it in Bochs (--emulator bochs), or boot the guest alone (--bare)"
    )
}

/// Everything one run needs, with every default already resolved.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The guest's bzImage.
    pub kernel: PathBuf,
    /// The guest's initramfs.
    pub initrd: PathBuf,
    /// The guest kernel command line.
    pub append: String,
    /// The emulator to run.
    pub emulator: Emulator,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// vCPUs of the guest VM, 1 to [`MAX_CPUS`] (default [`DEFAULT_CPUS`]):
    /// Bochs' `cpu: count` (processors of one core and one thread each),
    /// QEMU's `-smp`.
    pub cpus: u32,
    /// The hypervisor image; `None` boots the kernel bare, without it.
    pub hypervisor: Option<PathBuf>,
    /// The hypervisor's own Multiboot command line, empty by default. It
    /// carries only test hooks (`hvtrace.selftest=...`, see the
    /// hypervisor's `selftest` module); the guest's command line is
    /// [`RunConfig::append`].
    pub hypervisor_cmdline: String,
    /// Wall-clock limit of the whole run, from launch to power-off.
    pub timeout: Duration,
    /// Keep the run directory (it is always kept when the run fails).
    pub keep_dir: bool,
    /// Print milestones and hypervisor lines on stderr.
    pub progress: bool,
    /// Copy the guest console to stderr while the guest boots.
    pub echo_boot_console: bool,
    /// Bochs `ips`: emulated instructions per emulated second.
    pub bochs_ips: u64,
    /// Bochs CPU model.
    pub bochs_cpu: String,
    /// The run directory to use (created if missing) instead of a fresh one
    /// under the temp directory.
    pub run_dir: Option<PathBuf>,
    /// Capture the hypervisor's log port 0xE9 (QEMU `-debugcon stdio`; on
    /// by default). Off, the run sees the hypervisor as a platform that
    /// does not capture the port would: its fatal report then reaches the
    /// host on the control channel only. Bochs always captures the port.
    pub log_port: bool,
    /// The most bytes of guest console output kept: the cap of
    /// `console.log`, and of the console buffer (with
    /// [`crate::vm::console::CONSOLE_KEEP`], whichever is lower).
    pub console_cap: u64,
}

impl RunConfig {
    /// A configuration with the defaults for everything but the guest files.
    /// Boots under Bochs, bare (set [`RunConfig::hypervisor`] to boot under
    /// the hypervisor).
    pub fn new(kernel: impl Into<PathBuf>, initrd: impl Into<PathBuf>) -> RunConfig {
        RunConfig {
            kernel: kernel.into(),
            initrd: initrd.into(),
            append: DEFAULT_APPEND.to_string(),
            emulator: Emulator::Bochs,
            memory_mib: DEFAULT_MEMORY_MIB,
            cpus: DEFAULT_CPUS,
            hypervisor: None,
            hypervisor_cmdline: String::new(),
            timeout: DEFAULT_TIMEOUT,
            keep_dir: false,
            progress: true,
            echo_boot_console: false,
            bochs_ips: DEFAULT_BOCHS_IPS,
            bochs_cpu: DEFAULT_BOCHS_CPU.to_string(),
            run_dir: None,
            log_port: true,
            console_cap: crate::vm::bounded::LOG_CAP,
        }
    }

    /// A configuration for one of the built-in guests, with the kernel and
    /// the guest's default initramfs from the guest scripts (which build
    /// them on first use): the Debian guest's carries modules of its
    /// kernel package ([`guest::default_initrd`]).
    pub fn for_guest(guest: Guest) -> Result<RunConfig> {
        let kernel = guest::kernel(guest)?;
        let initrd = guest::default_initrd(guest, &[])?;
        Ok(RunConfig::new(kernel, initrd))
    }

    /// Boots under the given hypervisor image.
    pub fn with_hypervisor(mut self, image: impl Into<PathBuf>) -> RunConfig {
        self.hypervisor = Some(image.into());
        self
    }

    /// Boots the kernel directly, without the hypervisor.
    pub fn bare(mut self) -> RunConfig {
        self.hypervisor = None;
        self
    }

    /// Runs on the given emulator.
    pub fn with_emulator(mut self, emulator: Emulator) -> RunConfig {
        self.emulator = emulator;
        self
    }

    /// True when the guest runs under the hypervisor.
    pub fn under_hypervisor(&self) -> bool {
        self.hypervisor.is_some()
    }

    /// Checks that every file exists and that the options fit together.
    pub fn validate(&self) -> Result<()> {
        check_file("kernel", &self.kernel)?;
        check_file("initrd", &self.initrd)?;
        if let Some(hv) = &self.hypervisor {
            check_file("hypervisor image", hv)?;
        }
        if self.memory_mib < 64 {
            bail!(
                "--memory {} MiB is too small (at least 64)",
                self.memory_mib
            );
        }
        if !(1..=MAX_CPUS).contains(&self.cpus) {
            bail!("--cpus must be between 1 and {MAX_CPUS}");
        }
        if self.append.contains(['\n', '\r']) {
            bail!("--append must be a single line");
        }
        if self.hypervisor_cmdline.contains(['\n', '\r']) {
            bail!("the hypervisor command line must be a single line");
        }
        if self.bochs_ips == 0 {
            bail!("the Bochs ips must be positive");
        }
        Ok(())
    }
}

/// Fails unless `path` is a 64-bit bzImage that the hypervisor's loader
/// would boot: the same parser (`loader::bzimage`), run on the host so that
/// a wrong file fails at once, in one line, instead of after an emulator
/// has started. The hypervisor keeps its own check.
pub fn check_kernel(path: &Path) -> Result<()> {
    let image =
        std::fs::read(path).with_context(|| format!("cannot read kernel {}", path.display()))?;
    if let Err(e) = loader::bzimage::parse(&image) {
        let why = e.to_string();
        bail!(
            "kernel {}: {}",
            path.display(),
            why.strip_prefix("guest kernel: ").unwrap_or(&why)
        );
    }
    Ok(())
}

/// The formats an initramfs may have: a newc cpio archive (`070701`, or
/// `070702` with checksums), bare or compressed with one of the kernel's
/// decompressors.
const INITRAMFS_MAGICS: [(&[u8], &str); 8] = [
    (b"070701", "cpio"),
    (b"070702", "cpio"),
    (&[0x1f, 0x8b], "gzip"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz"),
    (&[0x28, 0xb5, 0x2f, 0xfd], "zstd"),
    (&[0x02, 0x21, 0x4c, 0x18], "lz4"),
    (b"BZh", "bzip2"),
    (&[0x5d, 0, 0], "lzma"),
];

/// Fails unless `path` starts like an initramfs: a newc cpio archive, bare
/// or compressed with one of the kernel's decompressors.
pub fn check_initrd(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut head = Vec::with_capacity(8);
    std::fs::File::open(path)
        .and_then(|f| f.take(8).read_to_end(&mut head))
        .with_context(|| format!("cannot read initrd {}", path.display()))?;
    if !INITRAMFS_MAGICS.iter().any(|(m, _)| head.starts_with(m)) {
        bail!(
            "initrd {}: not an initramfs (expected a cpio archive, bare or compressed with {})",
            path.display(),
            INITRAMFS_MAGICS[2..]
                .iter()
                .map(|(_, name)| *name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// Fails unless `path` is an existing regular file.
pub fn check_file(what: &str, path: &Path) -> Result<()> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{what} {} not found", path.display()))?;
    if !meta.is_file() {
        bail!("{what} {} is not a regular file", path.display());
    }
    Ok(())
}

/// A vCPU count for messages: `1 vCPU`, `2 vCPUs`.
pub fn vcpus(count: u32) -> String {
    match count {
        1 => "1 vCPU".to_string(),
        n => format!("{n} vCPUs"),
    }
}

/// True when the command line turns KASLR off.
pub fn disables_kaslr(append: &str) -> bool {
    append.split_whitespace().any(|word| word == "nokaslr")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hypervisor_run_under_tcg_is_refused_unless_asked_for() {
        let tcg = Emulator::Qemu { kvm: false };
        let nested_off = || Err("kvm_intel's nested VMX is off (nested=N)".to_string());
        let e = check_emulator_with(tcg, true, false, nested_off).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("nested=N") && text.contains("--emulator bochs") && !text.contains('\n'),
            "{text}"
        );
        // --no-kvm asks for TCG; a bare guest runs under TCG; KVM and
        // Bochs run the hypervisor.
        assert!(check_emulator_with(tcg, true, true, nested_off).is_ok());
        assert!(check_emulator_with(tcg, false, false, nested_off).is_ok());
        assert!(check_emulator_with(Emulator::Qemu { kvm: true }, true, false, nested_off).is_ok());
        assert!(check_emulator_with(Emulator::Bochs, true, false, nested_off).is_ok());
    }

    #[test]
    fn kaslr_detection() {
        assert!(disables_kaslr("console=ttyS0 nokaslr"));
        assert!(disables_kaslr("nokaslr"));
        assert!(!disables_kaslr("console=ttyS0,115200 panic=-1"));
        assert!(!disables_kaslr("hvtrace_nokaslr_test=1"));
    }

    #[test]
    fn one_vcpu_by_default() {
        let cfg = RunConfig::new("k", "i");
        assert_eq!(cfg.cpus, 1);
        assert_eq!(DEFAULT_CPUS, 1);
        assert_eq!(vcpus(1), "1 vCPU");
        assert_eq!(vcpus(2), "2 vCPUs");
    }

    #[test]
    fn validate_bounds_the_cpu_count() {
        // Any existing regular file passes the file checks.
        let exe = std::env::current_exe().unwrap();
        let base = RunConfig::new(&exe, &exe);
        for cpus in [1, 2, MAX_CPUS] {
            let cfg = RunConfig {
                cpus,
                ..base.clone()
            };
            assert!(cfg.validate().is_ok(), "{cpus}");
        }
        for cpus in [0, MAX_CPUS + 1] {
            let cfg = RunConfig {
                cpus,
                ..base.clone()
            };
            let err = format!("{:#}", cfg.validate().unwrap_err());
            assert_eq!(err, "--cpus must be between 1 and 16");
        }
    }

    #[test]
    fn validate_reports_missing_files() {
        let cfg = RunConfig::new("/nonexistent/bzImage", "/nonexistent/initrd");
        let err = format!("{:#}", cfg.validate().unwrap_err());
        assert!(
            err.starts_with("kernel /nonexistent/bzImage not found"),
            "{err}"
        );
    }
}
