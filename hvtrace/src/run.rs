//! `hvtrace run`: boot, run the --exec commands (or hand the console to the
//! user), power off, report.

use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use crate::cli::RunArgs;
use crate::config::{self, Emulator, RunConfig};
use crate::vm::{StopReport, Vm};
use crate::{guest, hypervisor};

/// Turns the options into a configuration: checks the given files first,
/// then resolves the defaults (which may build the kernel, the initramfs or
/// the hypervisor).
pub fn resolve(args: &RunArgs) -> Result<RunConfig> {
    if !args.allow_nokaslr && config::disables_kaslr(&args.append) {
        bail!("--append contains `nokaslr`, but hvtrace keeps KASLR on (pass --allow-nokaslr to boot without it anyway)");
    }
    if args.timeout == 0 {
        bail!("--timeout must be at least 1 second");
    }
    if let Some(kernel) = &args.kernel {
        config::check_file("kernel", kernel)?;
    }
    if let Some(initrd) = &args.initrd {
        config::check_file("initrd", initrd)?;
    }
    if let Some(hv) = &args.hypervisor {
        config::check_file("hypervisor image", hv)?;
    }
    let emulator = match args.emulator.resolve() {
        Emulator::Qemu { .. } if args.no_kvm => Emulator::Qemu { kvm: false },
        emulator => emulator,
    };

    let kernel = match &args.kernel {
        Some(kernel) => kernel.clone(),
        None => guest::kernel(args.guest)?,
    };
    let initrd = match &args.initrd {
        Some(initrd) => initrd.clone(),
        None => guest::initrd()?,
    };
    let mut cfg = RunConfig::new(kernel, initrd).with_emulator(emulator);
    cfg.append = args.append.clone();
    cfg.memory_mib = args.memory;
    cfg.timeout = Duration::from_secs(args.timeout);
    cfg.keep_dir = args.keep_dir;
    cfg.progress = true;
    cfg.echo_boot_console = !args.quiet;
    cfg.bochs_ips = args.bochs_ips;
    cfg.validate()?;
    cfg.hypervisor = if args.bare {
        None
    } else {
        Some(match &args.hypervisor {
            Some(hv) => hv.clone(),
            None => hypervisor::build()?,
        })
    };
    Ok(cfg)
}

/// Runs `hvtrace run`; returns the process exit code.
pub fn run(args: &RunArgs) -> Result<u8> {
    let cfg = resolve(args)?;
    if cfg.emulator == (Emulator::Qemu { kvm: false }) && cfg.under_hypervisor() {
        eprintln!(
            "hvtrace: note: no KVM with VMX on this host; QEMU runs TCG, which cannot emulate VMX"
        );
    }
    let mut vm = Vm::start(cfg)?;
    vm.wait_ready()?;
    if args.exec.is_empty() {
        eprintln!("hvtrace: connected to the guest console; end input (Ctrl-D) or type `exit` to power off");
        let report = vm.interact()?;
        return finish(&report, 0);
    }

    let mut failed = 0usize;
    for cmd in &args.exec {
        eprintln!("hvtrace: $ {cmd}");
        let result = vm.exec(cmd)?;
        let mut out = std::io::stdout().lock();
        out.write_all(result.output.as_bytes())?;
        out.flush()?;
        if result.rc != 0 {
            eprintln!("hvtrace: `{cmd}` exited with status {}", result.rc);
            failed += 1;
        }
    }
    let report = vm.poweroff()?;
    if failed > 0 && args.fail_on_exec_error {
        finish(&report, 1)?;
        bail!("{failed} of {} commands failed", args.exec.len());
    }
    finish(&report, 0)
}

/// Prints the summary of a stop; fails unless the guest powered off.
fn finish(report: &StopReport, code: u8) -> Result<u8> {
    if let Some(counts) = &report.exit_counts {
        let text: Vec<String> = counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        eprintln!("hvtrace: exits: {}", text.join(" "));
    }
    let boot = report
        .boot_time
        .map(|b| format!("boot {:.1} s, ", b.as_secs_f64()))
        .unwrap_or_default();
    eprintln!(
        "hvtrace: {boot}total {:.1} s; guest stopped: {}",
        report.wall_time.as_secs_f64(),
        report.reason
    );
    if !report.clean() {
        return Err(anyhow!(
            "the guest did not power off cleanly: {}",
            report.reason
        ));
    }
    Ok(code)
}
