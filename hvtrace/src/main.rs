//! The `hvtrace` command.

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;

use hvtrace::commands::cli::{one_line_error, Cli, Command, DetailedError, ProbeCommand};
use hvtrace::daemon::socket::Use;
use hvtrace::term::sanitize;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            return match e.kind() {
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2))
                }
                _ => {
                    eprintln!("hvtrace: error: {}", one_line_error(&e));
                    ExitCode::from(2)
                }
            };
        }
    };
    // The socket is found (and its default directory checked, or created
    // to serve) only for the commands that use it.
    let serve = matches!(&cli.command, Command::Run(a) if a.detach)
        || matches!(&cli.command, Command::Supervise(_));
    let usage = if serve { Use::Serve } else { Use::Connect };
    let socket = || hvtrace::daemon::socket::resolve(cli.socket.as_deref(), usage);
    // The first Ctrl-C ends the wait in progress: each command stops what
    // it started and exits with 130; a second Ctrl-C ends it at once. The
    // supervisor runs in a session of its own and is not concerned.
    if !matches!(cli.command, Command::Supervise(_)) {
        if let Err(e) = hvtrace::sys::catch_interrupt() {
            eprintln!("hvtrace: error: cannot catch Ctrl-C: {e}");
            return ExitCode::from(1);
        }
    }
    let result = match &cli.command {
        Command::Run(args) if args.detach => {
            socket().and_then(|s| hvtrace::commands::detach::run(args, &s))
        }
        Command::Run(args) => hvtrace::commands::run::run(args),
        Command::Status(args) => socket().and_then(|s| hvtrace::commands::ctl::status(&s, args)),
        Command::Exec(args) => socket().and_then(|s| hvtrace::commands::ctl::exec(&s, args)),
        Command::Stop(args) => socket().and_then(|s| hvtrace::commands::ctl::stop(&s, args)),
        Command::Syms(args) => socket().and_then(|s| hvtrace::commands::ctl::syms(&s, args)),
        Command::Probe(probe) => socket().and_then(|s| match &probe.command {
            ProbeCommand::Add(args) => hvtrace::commands::ctl::probe_add(&s, args),
            ProbeCommand::Del(args) => hvtrace::commands::ctl::probe_del(&s, args),
            ProbeCommand::List(args) => hvtrace::commands::ctl::probe_list(&s, args),
        }),
        Command::Trace(args) => socket().and_then(|s| hvtrace::commands::ctl::trace(&s, args)),
        Command::Syscalls(args) => {
            socket().and_then(|s| hvtrace::commands::syscalls::syscalls(&s, args))
        }
        Command::Graph(args) => socket().and_then(|s| hvtrace::commands::graph::graph(&s, args)),
        Command::Count(args) => {
            socket().and_then(|s| hvtrace::commands::count::count(&s, args, false))
        }
        Command::Hist(args) => socket().and_then(|s| hvtrace::commands::count::hist(&s, args)),
        Command::Latency(args) => {
            socket().and_then(|s| hvtrace::commands::count::count(&s, args, true))
        }
        Command::Record(args) => socket().and_then(|s| hvtrace::commands::record::record(&s, args)),
        Command::Convert(args) => hvtrace::commands::record::convert(args),
        Command::Supervise(args) => {
            socket().and_then(|s| hvtrace::commands::detach::supervise(&s, args))
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) if hvtrace::sys::is_interrupted(&e) || hvtrace::sys::interrupted() => {
            eprintln!("hvtrace: {}", sanitize(&interrupted_line(&e)));
            ExitCode::from(hvtrace::commands::ctl::INTERRUPTED_EXIT)
        }
        Err(e) => {
            // Errors may quote the guest or the hypervisor: no control
            // characters reach the terminal.
            eprintln!("hvtrace: error: {}", sanitize(&one_line(&format!("{e:#}"))));
            // The picture under the line, for errors that have one.
            if let Some(d) = e.chain().find_map(|c| c.downcast_ref::<DetailedError>()) {
                eprint!("{}", sanitize(&d.detail));
            }
            ExitCode::from(1)
        }
    }
}

/// The line for a command that a Ctrl-C ended: `interrupted (Ctrl-C)`,
/// then what the command says about what it leaves behind, or the error
/// it ended with.
fn interrupted_line(e: &anyhow::Error) -> String {
    let mut line = hvtrace::sys::Interrupted.to_string();
    for cause in e.chain() {
        if cause.is::<hvtrace::sys::Interrupted>() {
            continue;
        }
        line.push_str("; ");
        line.push_str(&one_line(&cause.to_string()));
    }
    line
}

/// Joins the lines of a message, so every error is one line.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
