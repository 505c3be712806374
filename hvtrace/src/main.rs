//! The `hvtrace` command.

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;

use hvtrace::cli::{one_line_error, Cli, Command, DetailedError, ProbeCommand};

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
    let socket = hvtrace::socket::resolve(cli.socket.as_deref());
    let result = match &cli.command {
        Command::Run(args) if args.detach => hvtrace::detach::run(args, &socket),
        Command::Run(args) => hvtrace::run::run(args),
        Command::Status(args) => hvtrace::ctl::status(&socket, args),
        Command::Exec(args) => hvtrace::ctl::exec(&socket, args),
        Command::Stop(args) => hvtrace::ctl::stop(&socket, args),
        Command::Syms(args) => hvtrace::ctl::syms(&socket, args),
        Command::Probe(probe) => match &probe.command {
            ProbeCommand::Add(args) => hvtrace::ctl::probe_add(&socket, args),
            ProbeCommand::Del(args) => hvtrace::ctl::probe_del(&socket, args),
            ProbeCommand::List(args) => hvtrace::ctl::probe_list(&socket, args),
        },
        Command::Trace(args) => hvtrace::ctl::trace(&socket, args),
        Command::Graph(args) => hvtrace::graph::graph(&socket, args),
        Command::Supervise(args) => hvtrace::supervisor::supervise(&socket, args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("hvtrace: error: {}", one_line(&format!("{e:#}")));
            // The picture under the line, for errors that have one.
            if let Some(d) = e.chain().find_map(|c| c.downcast_ref::<DetailedError>()) {
                eprint!("{}", d.detail);
            }
            ExitCode::from(1)
        }
    }
}

/// Joins the lines of a message, so every error is one line.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
