//! `hvtrace run --detach` and the hidden `supervise` subcommand: their
//! arguments become the daemon's own options ([`DetachOptions`],
//! [`SuperviseOptions`]), and the daemon gets the VM's configuration by
//! calling back into [`RunArgs::resolve`] when it is ready for it.

use std::path::Path;

use anyhow::Result;

use crate::commands::cli::{RunArgs, SuperviseArgs};
use crate::daemon::detach::{self, DetachOptions};
use crate::daemon::serve::{self, SuperviseOptions};

impl From<&RunArgs> for DetachOptions {
    fn from(args: &RunArgs) -> DetachOptions {
        DetachOptions {
            allow_nokaslr: args.allow_nokaslr,
            keep_dir: args.keep_dir,
            quiet: args.quiet,
        }
    }
}

impl From<&SuperviseArgs> for SuperviseOptions {
    fn from(args: &SuperviseArgs) -> SuperviseOptions {
        SuperviseOptions {
            run_dir: args.run_dir.clone(),
        }
    }
}

/// `hvtrace run --detach` ([`detach::run`]); returns the process exit code.
pub fn run(args: &RunArgs, socket: &Path) -> Result<u8> {
    detach::run(&DetachOptions::from(args), || args.resolve(), socket)
}

/// The hidden `supervise` subcommand ([`serve::supervise`]); returns the
/// process exit code once the VM has ended.
pub fn supervise(socket: &Path, args: &SuperviseArgs) -> Result<u8> {
    serve::supervise(socket, &SuperviseOptions::from(args), || args.run.resolve())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::cli::{Cli, Command};
    use crate::daemon::detach::supervisor_args;
    use crate::vm::config::{Emulator, RunConfig};
    use clap::Parser;

    #[test]
    fn supervisor_gets_explicit_absolute_paths() {
        let cli = Cli::try_parse_from(["hvtrace", "run", "--detach"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        let mut cfg = RunConfig::new("k/bzImage", "/i/initrd").with_hypervisor("hv");
        cfg.emulator = Emulator::Qemu { kvm: false };
        cfg.append = "console=ttyS0,115200 quiet".into();
        cfg.cpus = 3;
        let opts = DetachOptions::from(&args);
        let a = supervisor_args(&cfg, &opts, Path::new("/run/x")).unwrap();
        assert_eq!(&a[..3], ["supervise", "--run-dir", "/run/x"]);
        let kernel = &a[a.iter().position(|x| x == "--kernel").unwrap() + 1];
        assert!(
            kernel.starts_with('/') && kernel.ends_with("k/bzImage"),
            "{kernel}"
        );
        assert!(a.contains(&"--append=console=ttyS0,115200 quiet".to_string()));
        assert!(a.contains(&"--emulator=qemu".to_string()) && a.contains(&"--no-kvm".to_string()));
        assert!(a.contains(&"--cpus=3".to_string()), "{a:?}");
        // The child parses what the parent builds.
        let mut argv = vec!["hvtrace".to_string(), "--socket".into(), "/s".into()];
        argv.extend(a);
        let child = Cli::try_parse_from(argv).unwrap();
        let Command::Supervise(s) = child.command else {
            panic!("not supervise")
        };
        assert_eq!(s.run.append, "console=ttyS0,115200 quiet");
        assert_eq!(s.run.cpus, 3);
        assert_eq!(s.run_dir, Path::new("/run/x"));
        assert!(s.run.quiet && s.run.no_kvm);
        assert_eq!(SuperviseOptions::from(&s).run_dir, Path::new("/run/x"));
        // A bare run has no control channel to detach from.
        assert!(supervisor_args(&cfg.clone().bare(), &opts, Path::new("/r")).is_err());
    }

    #[test]
    fn run_options_carry_over() {
        let cli = Cli::try_parse_from([
            "hvtrace",
            "run",
            "--detach",
            "--allow-nokaslr",
            "--keep-dir",
            "--quiet",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        assert_eq!(
            DetachOptions::from(&args),
            DetachOptions {
                allow_nokaslr: true,
                keep_dir: true,
                quiet: true,
            }
        );
    }
}
