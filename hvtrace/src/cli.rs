//! The command line: `hvtrace [--socket PATH] <command> ...`.
//!
//! `run` boots a VM; with `--detach` it leaves it running behind a control
//! socket. The control commands (`status`, `exec`, `stop`; later `syms`,
//! `probe`, `trace`, `graph`) talk to that VM over `--socket`, whose default
//! is `$XDG_RUNTIME_DIR/hvtrace.sock`, else `/tmp/hvtrace-$UID.sock`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{EmulatorChoice, Guest, DEFAULT_APPEND, DEFAULT_BOCHS_IPS, DEFAULT_MEMORY_MIB};

/// Trace an unmodified Linux kernel from a thin VMX hypervisor.
#[derive(Debug, Parser)]
#[command(name = "hvtrace", version, propagate_version = true)]
pub struct Cli {
    /// Control socket of a detached VM [default: $XDG_RUNTIME_DIR/hvtrace.sock,
    /// else /tmp/hvtrace-$UID.sock].
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
    /// Show the hypervisor's status: exits, memory, control channel.
    Status(StatusArgs),
    /// Run a shell command in the guest of a detached VM.
    Exec(ExecArgs),
    /// Stop a detached VM and show its final exit counts.
    Stop(StopArgs),
    /// List guest kernel symbols matching a glob, recovered from guest memory.
    Syms(SymsArgs),
    /// The supervisor of a detached VM (started by `run --detach`).
    #[command(hide = true)]
    Supervise(SuperviseArgs),
}

/// Options of `hvtrace status`.
#[derive(Clone, Debug, Args)]
pub struct StatusArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `hvtrace syms`.
#[derive(Clone, Debug, Args)]
pub struct SymsArgs {
    /// Glob over symbol names (`*` and `?`), e.g. `vfs_*`.
    #[arg(value_name = "GLOB", default_value = "*")]
    pub glob: String,
    /// Keep only these type letters (`tT` for text), as /proc/kallsyms prints them.
    #[arg(long, value_name = "LETTERS", default_value = "")]
    pub kinds: String,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `hvtrace exec`.
#[derive(Clone, Debug, Args)]
pub struct ExecArgs {
    /// The command line for the guest's shell (several words are joined with
    /// spaces). The exit code is the command's status.
    #[arg(value_name = "CMD", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// Options of `hvtrace stop`.
#[derive(Clone, Debug, Args)]
pub struct StopArgs {}

/// Options of the hidden `supervise` subcommand: a fully resolved `run`.
#[derive(Clone, Debug, Args)]
pub struct SuperviseArgs {
    /// The run directory (boot image, logs, state file).
    #[arg(long, value_name = "DIR")]
    pub run_dir: PathBuf,

    #[command(flatten)]
    pub run: RunArgs,
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

    /// Boot, then return once the guest shell is up, leaving the VM running
    /// behind the control socket (--socket) for `status`, `exec` and `stop`.
    #[arg(long, conflicts_with_all = ["exec", "bare"])]
    pub detach: bool,

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

    fn run_args(cli: Cli) -> RunArgs {
        match cli.command {
            Command::Run(args) => args,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn run_defaults() {
        let args = run_args(Cli::try_parse_from(["hvtrace", "run"]).unwrap());
        assert_eq!(args.guest, Guest::Debian);
        assert_eq!(args.emulator, EmulatorChoice::Auto);
        assert_eq!(args.append, DEFAULT_APPEND);
        assert_eq!(args.memory, 512);
        assert!(args.exec.is_empty() && !args.bare && !args.detach);
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
        let args = run_args(cli);
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
        for conflict in [["--detach", "--bare"], ["--detach", "--exec=true"]] {
            let err =
                Cli::try_parse_from(["hvtrace", "run", conflict[0], conflict[1]]).unwrap_err();
            assert!(
                one_line_error(&err).contains("cannot be used with"),
                "{conflict:?}"
            );
        }
    }

    #[test]
    fn control_commands() {
        let cli = Cli::try_parse_from(["hvtrace", "--socket", "/s", "status", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Status(StatusArgs { json: true })
        ));
        // The socket option goes anywhere on the line.
        let cli = Cli::try_parse_from(["hvtrace", "stop", "--socket", "/s"]).unwrap();
        assert_eq!(cli.socket.as_deref(), Some(std::path::Path::new("/s")));
        let cli = Cli::try_parse_from(["hvtrace", "exec", "cat", "/etc/hostname", "-n"]).unwrap();
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.command.join(" "), "cat /etc/hostname -n");
        assert!(Cli::try_parse_from(["hvtrace", "exec"]).is_err());
        let args = run_args(Cli::try_parse_from(["hvtrace", "run", "--detach"]).unwrap());
        assert!(args.detach);
    }

    #[test]
    fn supervise_is_hidden() {
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("supervise"), "{help}");
        assert!(help.contains("status") && help.contains("exec") && help.contains("stop"));
    }
}
