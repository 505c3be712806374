//! The command line: `hvtrace [--socket PATH] <command> ...`.
//!
//! `run` boots a VM. The control commands (`status`, `exec`, `stop`, `syms`,
//! `probe`, `trace`, `graph`) will talk to a running VM over `--socket`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{EmulatorChoice, Guest, DEFAULT_APPEND, DEFAULT_BOCHS_IPS, DEFAULT_MEMORY_MIB};

/// Trace an unmodified Linux kernel from a thin VMX hypervisor.
#[derive(Debug, Parser)]
#[command(name = "hvtrace", version, propagate_version = true)]
pub struct Cli {
    /// Control socket of a running VM (for the control commands).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot a Linux guest under the hypervisor (or bare) and run commands in it.
    Run(RunArgs),
}

/// Options of `hvtrace run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Built-in guest kernel (built or downloaded on first use).
    #[arg(long, value_enum, default_value_t = Guest::Debian)]
    pub guest: Guest,

    /// Guest bzImage [default: the --guest kernel].
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,

    /// Guest initramfs [default: the hvtrace busybox initramfs].
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,

    /// Guest kernel command line.
    #[arg(long, value_name = "STR", default_value = DEFAULT_APPEND)]
    pub append: String,

    /// Accept `nokaslr` in --append (the tracer is meant to work with KASLR on).
    #[arg(long)]
    pub allow_nokaslr: bool,

    /// Emulator: auto = QEMU+KVM with nested VMX where the host has it, else Bochs.
    #[arg(long, value_enum, default_value_t = EmulatorChoice::Auto)]
    pub emulator: EmulatorChoice,

    /// QEMU: use TCG even where KVM with VMX is available.
    #[arg(long)]
    pub no_kvm: bool,

    /// Guest RAM in MiB.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MEMORY_MIB)]
    pub memory: u32,

    /// Run CMD in the guest shell and print its output (repeatable); without
    /// any, the terminal is connected to the guest console.
    #[arg(long = "exec", value_name = "CMD")]
    pub exec: Vec<String>,

    /// Hypervisor image [default: build it with cargo].
    #[arg(long, value_name = "PATH", conflicts_with = "bare")]
    pub hypervisor: Option<PathBuf>,

    /// Boot the kernel directly, without the hypervisor (baseline runs).
    #[arg(long)]
    pub bare: bool,

    /// Give up (and kill the emulator) after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub timeout: u64,

    /// Keep the run directory (boot image, emulator config, logs).
    #[arg(long)]
    pub keep_dir: bool,

    /// Exit non-zero when an --exec command exits non-zero.
    #[arg(long)]
    pub fail_on_exec_error: bool,

    /// Do not copy the guest console to stderr while the guest boots.
    #[arg(long)]
    pub quiet: bool,

    /// Bochs: emulated instructions per emulated second.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_BOCHS_IPS)]
    pub bochs_ips: u64,
}

/// Renders a clap error as one line, without usage and hints.
pub fn one_line_error(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let mut parts = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("Usage:") || line.starts_with("For more information")
        {
            continue;
        }
        parts.push(line.strip_prefix("error: ").unwrap_or(line).to_string());
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_defaults() {
        let cli = Cli::try_parse_from(["hvtrace", "run"]).unwrap();
        let Command::Run(args) = cli.command;
        assert_eq!(args.guest, Guest::Debian);
        assert_eq!(args.emulator, EmulatorChoice::Auto);
        assert_eq!(args.append, DEFAULT_APPEND);
        assert_eq!(args.memory, 512);
        assert!(args.exec.is_empty() && !args.bare);
    }

    #[test]
    fn run_options() {
        let cli = Cli::try_parse_from([
            "hvtrace",
            "--socket",
            "/tmp/s",
            "run",
            "--guest",
            "fast",
            "--emulator",
            "bochs",
            "--exec",
            "uname -r",
            "--exec",
            "true",
            "--bare",
            "--timeout",
            "30",
        ])
        .unwrap();
        assert_eq!(cli.socket.as_deref(), Some(std::path::Path::new("/tmp/s")));
        let Command::Run(args) = cli.command;
        assert_eq!(args.exec, ["uname -r", "true"]);
        assert_eq!(args.guest, Guest::Fast);
        assert_eq!(args.emulator, EmulatorChoice::Bochs);
        assert_eq!(args.timeout, 30);
    }

    #[test]
    fn bad_values_are_one_line() {
        let err = Cli::try_parse_from(["hvtrace", "run", "--emulator", "vmware"]).unwrap_err();
        let line = one_line_error(&err);
        assert!(!line.contains('\n'));
        assert!(line.contains("invalid value 'vmware'"), "{line}");
        assert!(line.contains("bochs"), "{line}");
        let err =
            Cli::try_parse_from(["hvtrace", "run", "--bare", "--hypervisor", "x"]).unwrap_err();
        assert!(one_line_error(&err).contains("cannot be used with"));
    }
}
