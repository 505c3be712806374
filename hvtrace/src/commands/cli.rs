//! The command line: `hvtrace [--socket PATH] <command> ...`.
//!
//! `run` boots a VM; with `--detach` it leaves it running behind a control
//! socket. The control commands (`status`, `exec`, `stop`, `syms`, `probe`,
//! `trace`, `graph`) talk to that VM over `--socket`, whose default is
//! `$XDG_RUNTIME_DIR/hvtrace/hvtrace.sock`, else
//! `/tmp/hvtrace-$UID/hvtrace.sock` (see [`crate::daemon::socket`]).
//!
//! `run` with `--probe`, `--function` or `--graph` traces its `--exec`
//! commands in one go: boot, add the probes, run the commands, write the
//! trace, stop.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::{value_parser, ArgGroup, Args, Parser, Subcommand};

use crate::vm::config::{
    self, Emulator, EmulatorChoice, Guest, RunConfig, DEFAULT_APPEND, DEFAULT_BOCHS_IPS,
    DEFAULT_CPUS, DEFAULT_MEMORY_MIB, MAX_CPUS,
};
use crate::vm::{guest, hv_image};

/// Trace an unmodified Linux kernel from a thin VMX hypervisor.
#[derive(Debug, Parser)]
#[command(name = "hvtrace", version, propagate_version = true)]
pub struct Cli {
    /// Control socket of a detached VM [default:
    /// $XDG_RUNTIME_DIR/hvtrace/hvtrace.sock, else /tmp/hvtrace-$UID/hvtrace.sock].
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
    /// Add, remove and list probes (kprobe_events syntax).
    Probe(ProbeArgs),
    /// Print the trace (probe and function-tracer lines) from the start of
    /// the stream.
    Trace(TraceArgs),
    /// Trace call trees with the function-graph tracer (ftrace's
    /// function_graph) until the trace goes quiet, then stop it.
    Graph(GraphArgs),
    /// Count calls per function in VMX root (as bcc's funccount): every
    /// function matching a glob is hooked and counted, and only the counts
    /// cross to the host, so nothing is lost however hot the functions.
    Count(CountArgs),
    /// Time the calls of the functions matching the globs in VMX root, through
    /// the return hijack, and print a log2 histogram of their durations (as
    /// bcc's funclatency). Takes the options of `count`.
    Latency(CountArgs),
    /// A histogram of one fetch argument of an entry probe, in VMX root (as
    /// bpftrace's `hist()`), keyed by function, comm or pid:
    /// `hvtrace hist p vfs_read count=%dx:u64 --key comm`.
    Hist(HistArgs),
    /// Trace system calls from outside the guest, system-wide, one line
    /// per call in the shape of the kernel's syscall events, with names,
    /// argument names and types from the guest itself (its sys_call_table,
    /// its syscall metadata or BTF): `hvtrace syscalls openat read --comm cat`.
    Syscalls(SyscallsArgs),
    /// Record a detached VM's trace into a trace.dat for `trace-cmd report`
    /// and KernelShark, as `trace-cmd record` does, until Ctrl-C, the
    /// duration or the VM's end: `hvtrace record -o trace.dat --function
    /// 'vfs_*' --duration 10`.
    Record(RecordArgs),
    /// Convert JSON lines (`--format json` output) into a trace.dat.
    Convert(ConvertArgs),
    /// The supervisor of a detached VM (started by `run --detach`).
    #[command(hide = true)]
    Supervise(SuperviseArgs),
}

/// Options of `hvtrace syscalls`.
#[derive(Clone, Debug, Args)]
pub struct SyscallsArgs {
    /// The calls to trace (`openat`, `sys_openat`, or `openat,read`)
    /// [default: every call of the guest].
    #[arg(value_name = "NAME")]
    pub names: Vec<String>,
    /// Only the calls of tasks with this name (comm).
    #[arg(long, value_name = "NAME")]
    pub comm: Option<String>,
    /// Only the calls of this thread id.
    #[arg(long, value_name = "PID", value_parser = value_parser!(i32).range(0..))]
    pub pid: Option<i32>,
    /// Only the calls that fail.
    #[arg(long)]
    pub failed: bool,
    /// Print JSON objects instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write the calls' entry and return events to FILE as a
    /// trace.dat (`hvsys/sys_NAME` and `hvsys/sys_NAME_ret`, with the
    /// arguments as read, strings included).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["summary", "list"])]
    pub trace_dat: Option<PathBuf>,
    /// At the end, count calls and errors per call (as `strace -c`).
    #[arg(long)]
    pub summary: bool,
    /// List the guest's calls, their arguments and where those came from.
    #[arg(long)]
    pub list: bool,
    /// End after SECS seconds [default: at Ctrl-C].
    #[arg(long, value_name = "SECS", conflicts_with = "exec")]
    pub duration: Option<f64>,
    /// Run this guest command, then end.
    #[arg(long, value_name = "CMD")]
    pub exec: Option<String>,
}

/// Options of `hvtrace hist`.
#[derive(Clone, Debug, Args)]
pub struct HistArgs {
    /// An entry probe in kprobe_events syntax whose first fetch argument is
    /// the value (several words are joined with spaces).
    #[arg(value_name = "SPEC", required = true, num_args = 1..)]
    pub spec: Vec<String>,
    /// What the calls are grouped by.
    #[arg(long, value_enum, default_value_t = HistKeyArg::Func)]
    pub key: HistKeyArg,
    #[command(flatten)]
    pub run: AggregateArgs,
}

/// The options `count`, `latency` and `hist` share: which calls, how long,
/// how the result is printed.
#[derive(Clone, Debug, Args)]
pub struct AggregateArgs {
    /// Only the calls of this thread id.
    #[arg(long, value_name = "PID", value_parser = value_parser!(i32).range(0..))]
    pub pid: Option<i32>,
    /// Only the calls of tasks with this name (comm).
    #[arg(long, value_name = "NAME")]
    pub comm: Option<String>,
    /// Print the result so far every SECS seconds too.
    #[arg(long, value_name = "SECS")]
    pub interval: Option<f64>,
    /// End after SECS seconds [default: at Ctrl-C].
    #[arg(long, value_name = "SECS", conflicts_with = "exec")]
    pub duration: Option<f64>,
    /// Run this guest command, then end.
    #[arg(long, value_name = "CMD")]
    pub exec: Option<String>,
    /// Print JSON objects instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The key of `hvtrace hist`'s rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HistKeyArg {
    /// The probed function.
    Func,
    /// The task's comm.
    Comm,
    /// The thread id.
    Pid,
}

impl HistKeyArg {
    /// The wire form.
    pub fn protocol(self) -> protocol::HistKey {
        match self {
            HistKeyArg::Func => protocol::HistKey::Function,
            HistKeyArg::Comm => protocol::HistKey::Comm,
            HistKeyArg::Pid => protocol::HistKey::Pid,
        }
    }
}

/// Options of `hvtrace count`.
#[derive(Clone, Debug, Args)]
pub struct CountArgs {
    /// Globs of the functions counted (`vfs_*`, `ext4:*`).
    #[arg(value_name = "GLOB", required = true)]
    pub globs: Vec<String>,
    #[command(flatten)]
    pub run: AggregateArgs,
    /// Print only the N most called functions.
    #[arg(long, value_name = "N")]
    pub top: Option<usize>,
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
    /// Keep only this loaded module's symbols (`ext4`).
    #[arg(long, value_name = "NAME", default_value = "")]
    pub module: String,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `hvtrace probe ...`.
#[derive(Clone, Debug, Args)]
pub struct ProbeArgs {
    #[command(subcommand)]
    pub command: ProbeCommand,
}

/// The `probe` subcommands.
#[derive(Clone, Debug, Subcommand)]
pub enum ProbeCommand {
    /// Add a probe: `p[:[GROUP/]EVENT] FUNCTION [FETCHARGS]`, or a return
    /// probe `r[:[GROUP/]EVENT] FUNCTION [FETCHARGS]` (or `FUNCTION%return`),
    /// as in the kernel's kprobe_events (e.g. `p:myopen do_sys_openat2
    /// dfd=%di path=+0(%si):string`, `r vfs_read $retval`).
    Add(ProbeAddArgs),
    /// Remove a probe: EVENT or GROUP/EVENT.
    Del(ProbeDelArgs),
    /// List the probes: name, hits, misses, definition.
    List(ProbeListArgs),
}

/// Options of `hvtrace probe add`.
#[derive(Clone, Debug, Args)]
pub struct ProbeAddArgs {
    /// The probe definition (several words are joined with spaces).
    #[arg(value_name = "SPEC", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub spec: Vec<String>,
}

/// Options of `hvtrace probe del`.
#[derive(Clone, Debug, Args)]
pub struct ProbeDelArgs {
    /// The probe's name: EVENT, or GROUP/EVENT.
    #[arg(value_name = "NAME")]
    pub name: String,
}

/// Options of `hvtrace probe list`.
#[derive(Clone, Debug, Args)]
pub struct ProbeListArgs {
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How trace lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormatArg {
    /// trace_pipe lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
    /// A trace.dat for `trace-cmd report` and KernelShark, written to
    /// --output when the trace ends.
    TraceDat,
}

impl TraceFormatArg {
    /// The protocol's name for it (a trace.dat is made from JSON lines).
    pub fn protocol(self) -> protocol::TraceFormat {
        match self {
            TraceFormatArg::Text => protocol::TraceFormat::Text,
            TraceFormatArg::Json | TraceFormatArg::TraceDat => protocol::TraceFormat::Json,
        }
    }
}

/// How a traced run or `graph` writes its trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormatArg {
    /// trace_pipe lines (function_graph lines for the graph).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
    /// A Chrome trace of the function-graph calls (for Perfetto or
    /// chrome://tracing), written when the trace ends.
    Chrome,
    /// A trace.dat (version 6) for `trace-cmd report` and KernelShark,
    /// written to --output when the trace ends.
    TraceDat,
}

impl OutputFormatArg {
    /// The format to ask the hypervisor for (a Chrome trace is made from
    /// JSON lines).
    pub fn protocol(self) -> protocol::TraceFormat {
        match self {
            OutputFormatArg::Text => protocol::TraceFormat::Text,
            OutputFormatArg::Json | OutputFormatArg::Chrome | OutputFormatArg::TraceDat => {
                protocol::TraceFormat::Json
            }
        }
    }
}

/// Options of `hvtrace trace`.
#[derive(Clone, Debug, Args)]
pub struct TraceArgs {
    /// Keep reading as lines arrive, until Ctrl-C (exit code 130) or the VM
    /// ends; without it, stop once no line came for a moment.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Output format.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = TraceFormatArg::Text)]
    pub format: TraceFormatArg,
    /// Write the trace to FILE instead of stdout (a trace.dat needs it).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Trace every traceable function matching GLOB first, with the
    /// function tracer (repeatable).
    #[arg(long = "function", value_name = "GLOB")]
    pub functions: Vec<String>,
    /// Take the function tracer off every function first (as writing
    /// `nop` to ftrace's current_tracer), before any --function.
    #[arg(long)]
    pub clear_functions: bool,
    /// Record the scheduler's task switches (sched_switch events) from
    /// now on, until `trace --no-sched`; one VM exit per switch.
    #[arg(long, conflicts_with = "no_sched")]
    pub sched: bool,
    /// Stop recording the scheduler's task switches first.
    #[arg(long)]
    pub no_sched: bool,
}

/// The function-graph filter's options: one definition, flattened into
/// `hvtrace graph` and `hvtrace run` (where they need `--graph`). Each has
/// the `--graph-` spelling of `run`; where `graph` spelled it without the
/// prefix, that spelling is an alias. The roots (`graph --function`,
/// `run --graph`) and the pid filter (`graph` only) are the commands' own.
#[derive(Clone, Debug, Default, Args)]
pub struct GraphFilterArgs {
    /// Hook only the functions matching GLOB, as ftrace's
    /// set_ftrace_filter (repeatable) [default: every traceable function].
    #[arg(long = "graph-trace", visible_alias = "trace", value_name = "GLOB")]
    pub trace: Vec<String>,
    /// Do not hook the functions matching GLOB, as ftrace's
    /// set_ftrace_notrace (repeatable): they do not show, but what they
    /// call still does, under the nearest traced caller.
    #[arg(
        long = "graph-ftrace-notrace",
        visible_alias = "notrace",
        value_name = "GLOB"
    )]
    pub notrace: Vec<String>,
    /// Leave the functions matching GLOB, and everything they call, out of
    /// the call trees, as ftrace's set_graph_notrace (repeatable).
    #[arg(long = "graph-notrace", value_name = "GLOB")]
    pub graph_notrace: Vec<String>,
    /// Show calls at most N levels deep, as ftrace's max_graph_depth
    /// (0: no limit).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_depth: u32,
    /// Frames each guest kernel stack's return stack holds (1 to 256;
    /// 0: the hypervisor's default, 32). Calls nested deeper are not traced
    /// and count as misses. Refused while another session runs with
    /// another size.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = value_parser!(u32).range(0..=256))]
    pub stack_frames: u32,
    /// Only the tasks with this name (comm).
    #[arg(long = "graph-comm", visible_alias = "comm", value_name = "NAME")]
    pub comm: Option<String>,
    /// Show return values, as ftrace's funcgraph-retval.
    #[arg(long = "graph-retval", visible_alias = "retval")]
    pub retval: bool,
}

impl GraphFilterArgs {
    /// Whether any filter option was given (`run` needs `--graph` then).
    pub fn any(&self) -> bool {
        !self.trace.is_empty()
            || !self.notrace.is_empty()
            || !self.graph_notrace.is_empty()
            || self.max_depth != 0
            || self.stack_frames != 0
            || self.comm.is_some()
            || self.retval
    }
}

/// Options of `hvtrace graph`.
#[derive(Clone, Debug, Args)]
pub struct GraphArgs {
    /// Trace the call trees of the functions matching GLOB, as ftrace's
    /// set_graph_function (repeatable) [default: every hooked function
    /// starts a tree].
    #[arg(long = "function", value_name = "GLOB")]
    pub functions: Vec<String>,
    #[command(flatten)]
    pub filter: GraphFilterArgs,
    /// Only the task with this pid (thread id).
    #[arg(long, value_name = "PID", allow_hyphen_values = true, value_parser = value_parser!(i32).range(0..))]
    pub pid: Option<i32>,
    /// Output format.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = OutputFormatArg::Text)]
    pub format: OutputFormatArg,
    /// Write the trace to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Keep reading as lines arrive, until Ctrl-C or the VM ends; without
    /// it, stop once no line came for a moment. The first Ctrl-C stops the
    /// session, finishes the output and exits with 130; a second one ends
    /// the command at once.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Leave the session running should this command die without stopping
    /// it (killed, a second Ctrl-C): by default the supervisor stops the
    /// sessions of a client whose connection closes. The command itself
    /// still stops its session when it ends.
    #[arg(long)]
    pub persist: bool,
}

/// Options of `hvtrace record`.
#[derive(Clone, Debug, Args)]
pub struct RecordArgs {
    /// The trace.dat to write (written beside it first, then renamed).
    #[arg(long, short = 'o', value_name = "FILE", default_value = "trace.dat")]
    pub output: PathBuf,
    /// Add a probe for the recording, in kprobe_events syntax (repeatable);
    /// it is deleted at the end.
    #[arg(long = "probe", value_name = "SPEC")]
    pub probes: Vec<String>,
    /// Trace every traceable function matching GLOB with the function
    /// tracer (repeatable); the function tracer is taken off at the end.
    #[arg(long = "function", value_name = "GLOB")]
    pub functions: Vec<String>,
    /// Record the call trees of the functions matching GLOB with a
    /// function-graph session (repeatable), stopped at the end.
    #[arg(long = "graph", value_name = "GLOB")]
    pub graphs: Vec<String>,
    #[command(flatten)]
    pub graph_filter: GraphFilterArgs,
    /// End after SECS seconds [default: at Ctrl-C or the VM's end].
    #[arg(long, value_name = "SECS")]
    pub duration: Option<f64>,
    /// Also write the JSON lines recorded to FILE, as they come.
    #[arg(long, value_name = "FILE")]
    pub also_json: Option<PathBuf>,
    /// Leave out the scheduler's task switches (recorded by default, as
    /// sched_switch events: one VM exit per switch).
    #[arg(long)]
    pub no_sched: bool,
}

/// Options of `hvtrace convert`.
#[derive(Clone, Debug, Args)]
pub struct ConvertArgs {
    /// The JSON lines to convert.
    #[arg(value_name = "JSONL")]
    pub input: PathBuf,
    /// The trace.dat to write.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: PathBuf,
    /// The guest's /proc/kallsyms text (a run directory's `kallsyms`)
    /// [default: the functions the lines name].
    #[arg(long, value_name = "FILE")]
    pub kallsyms: Option<PathBuf>,
    /// A probe definition, for its argument types (repeatable) [default:
    /// types from the values].
    #[arg(long = "probe", value_name = "SPEC")]
    pub probes: Vec<String>,
    /// CPUs in the file at least (a CPU with no event gets an empty
    /// buffer).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = value_parser!(u32).range(1..=4096))]
    pub cpus: u32,
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
#[command(group(ArgGroup::new("tracing").args(["probes", "functions", "graphs", "syscalls", "sched"]).multiple(true).requires("exec")))]
#[command(group(ArgGroup::new("aggregate").args(["counts", "hist", "syscalls"]).multiple(true)))]
#[command(group(ArgGroup::new("formatted").args(["probes", "functions", "graphs", "counts", "hist", "syscalls", "sched"]).multiple(true)))]
#[command(group(ArgGroup::new("graph_filter").args(["trace", "notrace", "graph_notrace", "max_depth", "stack_frames", "comm", "retval"]).multiple(true).requires("graphs")))]
pub struct RunArgs {
    /// Built-in guest kernel (built or downloaded on first use).
    #[arg(long, value_enum, default_value_t = Guest::Debian)]
    pub guest: Guest,

    /// Guest bzImage [default: the --guest kernel].
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<PathBuf>,

    /// Guest initramfs [default: the hvtrace busybox initramfs; the Debian
    /// guest's carries modules of its kernel package: ext4, vfat, isofs,
    /// squashfs, overlay, loop and what they need].
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,

    /// Debian guest: add these modules of Debian's kernel package, with what
    /// they need, to the initramfs (comma-separated names, repeatable);
    /// `modprobe NAME` loads them in the guest.
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_module_name,
          conflicts_with_all = ["initrd", "kernel"])]
    pub modules: Vec<String>,

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

    /// vCPUs of the guest VM (Bochs `cpu: count`, QEMU `-smp`); default 1,
    /// as QEMU's own default: one vCPU keeps Bochs at full speed and a trace
    /// readable; trace SMP behaviour with 2 or more.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CPUS, allow_negative_numbers = true, value_parser = parse_cpus)]
    pub cpus: u32,

    /// Run CMD in the guest shell and print its output (repeatable; on
    /// stderr when tracing); without any, the terminal is connected to the
    /// guest console.
    #[arg(long = "exec", value_name = "CMD")]
    pub exec: Vec<String>,

    /// Boot, then return once the guest shell is up, leaving the VM running
    /// behind the control socket (--socket) for `status`, `exec` and `stop`.
    #[arg(long, conflicts_with_all = ["exec", "bare", "probes", "functions", "graphs"])]
    pub detach: bool,

    /// Count the calls of every function matching GLOB in VMX root while
    /// the --exec commands run, then print the counts as `hvtrace count`
    /// does (repeatable).
    #[arg(long = "count", value_name = "GLOB", conflicts_with_all = ["bare", "probes", "functions", "graphs"])]
    pub counts: Vec<String>,

    /// With --count, --hist or --syscalls: only the calls of tasks with
    /// this name (comm).
    #[arg(long, value_name = "NAME", requires = "aggregate")]
    pub count_comm: Option<String>,

    /// With --count: time each call too (through the return hijack) and
    /// print the histogram of durations, as `hvtrace latency` does.
    #[arg(long, requires = "counts")]
    pub count_latency: bool,

    /// Keep a histogram of the first fetch argument of this entry probe
    /// (kprobe_events syntax) in VMX root while the --exec commands run,
    /// then print it as `hvtrace hist` does.
    #[arg(long = "hist", value_name = "SPEC", conflicts_with_all = ["bare", "probes", "functions", "graphs", "counts"])]
    pub hist: Option<String>,

    /// With --hist: what the histogram's rows are grouped by [default: func].
    #[arg(long, value_enum, value_name = "KEY", requires = "hist")]
    pub hist_key: Option<HistKeyArg>,

    /// Trace these system calls (`openat,read`; every call of the guest
    /// when no list is given) while the --exec commands run, one line per
    /// call as `hvtrace syscalls` prints them (text, or JSON with
    /// `--format json`), to stdout or --output.
    #[arg(long = "syscalls", value_name = "NAMES", num_args = 0..=1, default_missing_value = "",
          conflicts_with_all = ["bare", "probes", "functions", "graphs", "counts", "hist"])]
    pub syscalls: Option<String>,

    /// Add this probe (kprobe_events syntax) before the --exec commands run,
    /// and write the trace of the commands to stdout or --output (repeatable).
    #[arg(long = "probe", value_name = "SPEC", conflicts_with = "bare")]
    pub probes: Vec<String>,

    /// Trace every traceable function matching GLOB with the function
    /// tracer while the --exec commands run (repeatable).
    #[arg(long = "function", value_name = "GLOB", conflicts_with = "bare")]
    pub functions: Vec<String>,

    /// Record the scheduler's task switches as sched_switch events while
    /// the --exec commands run (one VM exit per switch).
    #[arg(long, conflicts_with = "bare")]
    pub sched: bool,

    /// Trace the call trees of the functions matching GLOB with the
    /// function-graph tracer while the --exec commands run (repeatable).
    #[arg(long = "graph", value_name = "GLOB", conflicts_with = "bare")]
    pub graphs: Vec<String>,

    /// Output format (with --probe, --function, --graph or --sched; with
    /// --count or --hist: text, json, or chrome for counter tracks sampled
    /// while the commands run) [default: text].
    #[arg(long, value_enum, value_name = "FORMAT", requires = "formatted")]
    pub format: Option<OutputFormatArg>,

    /// Write the trace to FILE instead of stdout (with --probe, --function,
    /// --graph, --sched or --syscalls, or a Chrome trace of --count or
    /// --hist).
    #[arg(long, value_name = "FILE", requires = "formatted")]
    pub output: Option<PathBuf>,

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

    /// The most bytes of guest console output the run keeps (4 KiB to
    /// 64 MiB): console.log stops there (its last line says how much it
    /// dropped), and the buffer that command output is read from keeps at
    /// most this much (and at most 8 MiB).
    #[arg(long, value_name = "BYTES", default_value_t = crate::vm::bounded::LOG_CAP,
          value_parser = clap::value_parser!(u64).range(4096..=crate::vm::bounded::LOG_CAP))]
    pub console_cap: u64,

    /// The function-graph filter, for --graph.
    #[command(flatten, next_help_heading = "Function-graph options (with --graph)")]
    pub graph_filter: GraphFilterArgs,
}

/// Parses `--cpus`: a count from 1 to [`MAX_CPUS`].
fn parse_cpus(value: &str) -> Result<u32, String> {
    match value.trim().parse::<u32>() {
        Ok(n) if (1..=MAX_CPUS).contains(&n) => Ok(n),
        _ => Err(format!("--cpus must be between 1 and {MAX_CPUS}")),
    }
}

/// Parses one name of `--modules`.
fn parse_module_name(value: &str) -> Result<String, String> {
    guest::check_module_name(value)?;
    Ok(value.to_string())
}

impl RunArgs {
    /// True when the run traces its commands (`--probe`, `--function`,
    /// `--graph`).
    pub fn traces(&self) -> bool {
        !self.probes.is_empty()
            || !self.functions.is_empty()
            || !self.graphs.is_empty()
            || self.sched
    }

    /// Turns the options into a configuration: checks the given files first,
    /// then resolves the defaults (which may build the kernel, the initramfs or
    /// the hypervisor).
    pub fn resolve(&self) -> Result<RunConfig> {
        let args = self;
        if !args.allow_nokaslr && config::disables_kaslr(&args.append) {
            bail!("--append contains `nokaslr`, but hvtrace keeps KASLR on (pass --allow-nokaslr to boot without it anyway)");
        }
        if args.timeout == 0 {
            bail!("--timeout must be at least 1 second");
        }
        guest::check_modules_guest(args.guest, &args.modules)?;
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
        config::check_emulator(emulator, !args.bare, args.no_kvm)?;

        let kernel = match &args.kernel {
            Some(kernel) => kernel.clone(),
            None => guest::kernel(args.guest)?,
        };
        // The built-in guest's own initramfs goes with its own kernel; a
        // kernel of the user's gets the plain one (the Debian package's
        // modules would not load into it).
        let initrd = match (&args.initrd, &args.kernel) {
            (Some(initrd), _) => initrd.clone(),
            (None, None) => guest::default_initrd(args.guest, &args.modules)?,
            (None, Some(_)) => guest::initrd()?,
        };
        let mut cfg = RunConfig::new(kernel, initrd).with_emulator(emulator);
        cfg.append = args.append.clone();
        cfg.memory_mib = args.memory;
        cfg.cpus = args.cpus;
        cfg.timeout = Duration::from_secs(args.timeout);
        cfg.keep_dir = args.keep_dir;
        cfg.progress = true;
        cfg.echo_boot_console = !args.quiet;
        cfg.bochs_ips = args.bochs_ips;
        cfg.console_cap = args.console_cap;
        cfg.validate()?;
        config::check_kernel(&cfg.kernel)?;
        config::check_initrd(&cfg.initrd)?;
        cfg.hypervisor = if args.bare {
            None
        } else {
            Some(match &args.hypervisor {
                Some(hv) => hv.clone(),
                None => hv_image::build()?,
            })
        };
        Ok(cfg)
    }
}

/// An error with more to show than its one line: `hvtrace` prints the line
/// as `hvtrace: error: ...`, then `detail` as it is (a caret under a bad
/// token, for example).
#[derive(Debug)]
pub struct DetailedError {
    /// The one-line message.
    pub message: String,
    /// Lines to print after it.
    pub detail: String,
}

impl std::fmt::Display for DetailedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DetailedError {}

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
    fn aggregation_commands_take_their_options_after_the_spec_or_globs() {
        let cli = Cli::try_parse_from([
            "hvtrace",
            "hist",
            "p vfs_read count=%dx:u64",
            "--key",
            "comm",
            "--exec",
            "dd bs=1",
            "--json",
        ])
        .unwrap();
        let Command::Hist(h) = cli.command else {
            panic!("not hist")
        };
        assert_eq!(h.spec, ["p vfs_read count=%dx:u64"]);
        assert_eq!(h.key, HistKeyArg::Comm);
        assert_eq!(h.run.exec.as_deref(), Some("dd bs=1"));
        assert!(h.run.json);
        let cli = Cli::try_parse_from(["hvtrace", "hist", "p", "vfs_read", "n=%dx"]).unwrap();
        let Command::Hist(h) = cli.command else {
            panic!("not hist")
        };
        assert_eq!(
            (h.spec.join(" ").as_str(), h.key),
            ("p vfs_read n=%dx", HistKeyArg::Func)
        );
        let cli =
            Cli::try_parse_from(["hvtrace", "latency", "vfs_*", "ext4:*", "--comm", "dd"]).unwrap();
        let Command::Latency(c) = cli.command else {
            panic!("not latency")
        };
        assert_eq!((c.globs.len(), c.run.comm.as_deref()), (2, Some("dd")));
        // --duration and --exec are one or the other.
        assert!(Cli::try_parse_from([
            "hvtrace",
            "count",
            "f",
            "--duration",
            "1",
            "--exec",
            "true"
        ])
        .is_err());
        let run = run_args(
            Cli::try_parse_from(["hvtrace", "run", "--count", "vfs_*", "--count-latency"]).unwrap(),
        );
        assert!(run.count_latency && run.counts == ["vfs_*"]);
        assert!(Cli::try_parse_from(["hvtrace", "run", "--count-latency"]).is_err());
        let run = run_args(
            Cli::try_parse_from([
                "hvtrace",
                "run",
                "--hist",
                "p vfs_read count=%dx:u64",
                "--hist-key",
                "comm",
                "--count-comm",
                "dd",
                "--format",
                "json",
            ])
            .unwrap(),
        );
        assert_eq!(run.hist.as_deref(), Some("p vfs_read count=%dx:u64"));
        assert!(
            Cli::try_parse_from(["hvtrace", "run", "--count", "f", "--format", "json"]).is_ok()
        );
        assert!(Cli::try_parse_from(["hvtrace", "run", "--format", "json"]).is_err());
        assert_eq!(run.hist_key, Some(HistKeyArg::Comm));
        assert_eq!(run.count_comm.as_deref(), Some("dd"));
        for bad in [
            &["hvtrace", "run", "--hist-key", "comm"][..],
            &["hvtrace", "run", "--count-comm", "dd"],
            &["hvtrace", "run", "--hist", "p f", "--count", "g"],
            &["hvtrace", "run", "--hist", "p f", "--probe", "p g"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn run_defaults() {
        let args = run_args(Cli::try_parse_from(["hvtrace", "run"]).unwrap());
        assert_eq!(args.guest, Guest::Debian);
        assert_eq!(args.emulator, EmulatorChoice::Auto);
        assert_eq!(args.append, DEFAULT_APPEND);
        assert_eq!(args.memory, 512);
        assert_eq!(args.cpus, 1);
        assert!(args.exec.is_empty() && !args.bare && !args.detach);
    }

    #[test]
    fn modules_option() {
        let run = run_args(Cli::try_parse_from(["hvtrace", "run"]).unwrap());
        assert!(run.modules.is_empty());
        let run = run_args(
            Cli::try_parse_from([
                "hvtrace",
                "run",
                "--modules",
                "xfs,nls_iso8859-1",
                "--modules=nbd",
                "--detach",
            ])
            .unwrap(),
        );
        assert_eq!(run.modules, ["xfs", "nls_iso8859-1", "nbd"]);
        for bad in [
            ["--modules", "xfs", "--initrd", "i"],
            ["--modules", "xfs", "--kernel", "k"],
        ] {
            let mut argv = vec!["hvtrace", "run"];
            argv.extend(bad);
            assert!(Cli::try_parse_from(argv).is_err(), "{bad:?}");
        }
        assert!(Cli::try_parse_from(["hvtrace", "run", "--modules", "fs/xfs.ko"]).is_err());
    }

    #[test]
    fn cpus_option() {
        let args = run_args(Cli::try_parse_from(["hvtrace", "run", "--cpus", "2"]).unwrap());
        assert_eq!(args.cpus, 2);
        let args = run_args(Cli::try_parse_from(["hvtrace", "run", "--cpus=16"]).unwrap());
        assert_eq!(args.cpus, 16);
        // With --detach, and with a one-shot trace.
        let args =
            run_args(Cli::try_parse_from(["hvtrace", "run", "--detach", "--cpus", "4"]).unwrap());
        assert!(args.detach && args.cpus == 4);
        let args = run_args(
            Cli::try_parse_from([
                "hvtrace", "run", "--cpus", "2", "--graph", "vfs_read", "--exec", "true",
            ])
            .unwrap(),
        );
        assert!(args.traces() && args.cpus == 2);
    }

    #[test]
    fn bad_cpu_counts_are_one_line() {
        for bad in ["0", "17", "100", "-1", "two", ""] {
            let err = Cli::try_parse_from(["hvtrace", "run", "--cpus", bad]).unwrap_err();
            let line = one_line_error(&err);
            assert!(!line.contains('\n'));
            assert!(
                line.contains("--cpus must be between 1 and 16"),
                "{bad:?}: {line}"
            );
        }
        let err = Cli::try_parse_from(["hvtrace", "run", "--cpus"]).unwrap_err();
        assert!(one_line_error(&err).contains("--cpus <N>"));
    }

    #[test]
    fn cpus_help() {
        let run = help_of(&["run"]);
        assert!(
            run.contains("--cpus <N> vCPUs of the guest VM (Bochs `cpu: count`, QEMU `-smp`); default 1, as QEMU's own default: one vCPU keeps Bochs at full speed and a trace readable; trace SMP behaviour with 2 or more"),
            "{run}"
        );
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
    fn probe_commands() {
        let cli = Cli::try_parse_from([
            "hvtrace",
            "--socket",
            "/s",
            "probe",
            "add",
            "p:myopen do_sys_openat2 dfd=%di",
        ])
        .unwrap();
        let Command::Probe(ProbeArgs {
            command: ProbeCommand::Add(add),
        }) = cli.command
        else {
            panic!("not probe add")
        };
        assert_eq!(add.spec, ["p:myopen do_sys_openat2 dfd=%di"]);
        // Unquoted words are one spec; a removal parses (and is refused later).
        let cli =
            Cli::try_parse_from(["hvtrace", "probe", "add", "p", "vfs_read", "-5(%di)"]).unwrap();
        let Command::Probe(ProbeArgs {
            command: ProbeCommand::Add(add),
        }) = cli.command
        else {
            panic!("not probe add")
        };
        assert_eq!(add.spec.join(" "), "p vfs_read -5(%di)");
        assert!(Cli::try_parse_from(["hvtrace", "probe", "add", "-:myopen"]).is_ok());
        assert!(Cli::try_parse_from(["hvtrace", "probe", "add"]).is_err());

        let cli = Cli::try_parse_from(["hvtrace", "probe", "del", "kprobes/myopen"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Probe(ProbeArgs { command: ProbeCommand::Del(ProbeDelArgs { ref name }) })
                if name == "kprobes/myopen"
        ));
        assert!(Cli::try_parse_from(["hvtrace", "probe", "del"]).is_err());
        let cli = Cli::try_parse_from(["hvtrace", "probe", "list", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Probe(ProbeArgs {
                command: ProbeCommand::List(ProbeListArgs { json: true })
            })
        ));
        let err = Cli::try_parse_from(["hvtrace", "probe", "frob"]).unwrap_err();
        assert!(one_line_error(&err).contains("frob"));
    }

    #[test]
    fn trace_command() {
        let cli = Cli::try_parse_from(["hvtrace", "trace"]).unwrap();
        let Command::Trace(args) = cli.command else {
            panic!("not trace")
        };
        assert!(!args.follow && args.functions.is_empty());
        assert_eq!(args.format, TraceFormatArg::Text);
        let cli = Cli::try_parse_from([
            "hvtrace",
            "trace",
            "-f",
            "--format",
            "json",
            "--function",
            "vfs_*",
            "--function",
            "ksys_read",
        ])
        .unwrap();
        let Command::Trace(args) = cli.command else {
            panic!("not trace")
        };
        assert!(args.follow);
        assert_eq!(args.format.protocol(), protocol::TraceFormat::Json);
        assert_eq!(args.functions, ["vfs_*", "ksys_read"]);
        let err = Cli::try_parse_from(["hvtrace", "trace", "--format", "xml"]).unwrap_err();
        assert!(one_line_error(&err).contains("invalid value 'xml'"));
    }

    #[test]
    fn traced_runs() {
        let args = run_args(
            Cli::try_parse_from([
                "hvtrace",
                "run",
                "--probe",
                "p vfs_read",
                "--probe",
                "r vfs_read $retval",
                "--function",
                "ksys_*",
                "--exec",
                "cat /etc/hostname",
                "--format",
                "json",
                "--output",
                "/tmp/trace.json",
            ])
            .unwrap(),
        );
        assert!(args.traces());
        assert_eq!(args.probes, ["p vfs_read", "r vfs_read $retval"]);
        assert_eq!(args.functions, ["ksys_*"]);
        assert_eq!(args.format, Some(OutputFormatArg::Json));
        assert_eq!(
            args.output.as_deref(),
            Some(std::path::Path::new("/tmp/trace.json"))
        );
        let plain = run_args(Cli::try_parse_from(["hvtrace", "run", "--exec", "true"]).unwrap());
        assert!(!plain.traces());
    }

    #[test]
    fn bad_tracing_combinations_are_one_line() {
        let cases: [(&[&str], &str); 7] = [
            (&["--probe", "p vfs_read"], "--exec"),
            (&["--function", "vfs_*"], "--exec"),
            (
                &["--bare", "--probe", "p vfs_read", "--exec", "true"],
                "cannot be used with",
            ),
            (
                &["--bare", "--function", "x", "--exec", "true"],
                "cannot be used with",
            ),
            (&["--detach", "--function", "x"], "cannot be used with"),
            (&["--format", "json", "--exec", "true"], "--probe"),
            (&["--output", "/tmp/x", "--exec", "true"], "--function"),
        ];
        for (extra, needle) in cases {
            let mut argv = vec!["hvtrace", "run"];
            argv.extend_from_slice(extra);
            let err = Cli::try_parse_from(&argv).unwrap_err();
            let line = one_line_error(&err);
            assert!(!line.contains('\n'));
            assert!(line.contains(needle), "{argv:?}: {line}");
        }
    }

    fn graph_args(argv: &[&str]) -> GraphArgs {
        let mut full = vec!["hvtrace", "graph"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).unwrap().command {
            Command::Graph(args) => args,
            other => panic!("not graph: {other:?}"),
        }
    }

    #[test]
    fn graph_command() {
        let args = graph_args(&[]);
        assert!(
            args.functions.is_empty()
                && args.filter.trace.is_empty()
                && args.filter.notrace.is_empty()
        );
        assert!(args.filter.graph_notrace.is_empty());
        assert_eq!(args.filter.max_depth, 0);
        assert_eq!(args.filter.stack_frames, 0);
        assert_eq!((args.pid, args.filter.comm.as_deref()), (None, None));
        assert!(!args.filter.retval && !args.follow);
        assert_eq!(args.format, OutputFormatArg::Text);
        assert_eq!(args.output, None);

        let cli = Cli::try_parse_from([
            "hvtrace",
            "graph",
            "--function",
            "vfs_read",
            "--function",
            "vfs_write",
            "--trace",
            "vfs_*",
            "--trace",
            "rw_verify_area",
            "--notrace",
            "*fsnotify*",
            "--graph-notrace",
            "schedule",
            "--graph-notrace",
            "*irq*",
            "--max-depth",
            "4",
            "--stack-frames",
            "8",
            "--pid",
            "90",
            "--comm",
            "dd",
            "--retval",
            "--format",
            "chrome",
            "--output",
            "/tmp/graph.json",
            "-f",
            "--socket",
            "/s",
        ])
        .unwrap();
        assert_eq!(cli.socket.as_deref(), Some(std::path::Path::new("/s")));
        let Command::Graph(args) = cli.command else {
            panic!("not graph")
        };
        assert_eq!(args.functions, ["vfs_read", "vfs_write"]);
        assert_eq!(args.filter.trace, ["vfs_*", "rw_verify_area"]);
        assert_eq!(args.filter.notrace, ["*fsnotify*"]);
        assert_eq!(args.filter.graph_notrace, ["schedule", "*irq*"]);
        assert_eq!(args.filter.max_depth, 4);
        assert_eq!(args.filter.stack_frames, 8);
        assert!(Cli::try_parse_from(["hvtrace", "graph", "--stack-frames", "257"]).is_err());
        assert_eq!(args.pid, Some(90));
        assert_eq!(args.filter.comm.as_deref(), Some("dd"));
        assert!(args.filter.retval && args.follow);
        assert_eq!(args.format, OutputFormatArg::Chrome);
        assert_eq!(
            args.output.as_deref(),
            Some(std::path::Path::new("/tmp/graph.json"))
        );
        assert!(graph_args(&["--follow"]).follow);
        assert!(!graph_args(&["--follow"]).persist);
        assert!(graph_args(&["--persist"]).persist);
        assert_eq!(
            graph_args(&["--format", "json"]).format.protocol(),
            protocol::TraceFormat::Json
        );
        // A Chrome trace is made from JSON lines.
        assert_eq!(
            OutputFormatArg::Chrome.protocol(),
            protocol::TraceFormat::Json
        );
        assert_eq!(
            OutputFormatArg::Text.protocol(),
            protocol::TraceFormat::Text
        );
    }

    #[test]
    fn bad_graph_options_are_one_line() {
        let cases: [(&[&str], &str); 7] = [
            (&["--format", "xml"], "invalid value 'xml'"),
            (&["--format", "xml"], "chrome"),
            (&["--pid", "-1"], "-1 is not in 0..="),
            (&["--pid", "dd"], "invalid value 'dd' for '--pid <PID>'"),
            (
                &["--max-depth", "lots"],
                "invalid value 'lots' for '--max-depth <N>'",
            ),
            (
                &["--function"],
                "a value is required for '--function <GLOB>'",
            ),
            (&["vfs_read"], "unexpected argument 'vfs_read'"),
        ];
        for (extra, needle) in cases {
            let mut argv = vec!["hvtrace", "graph"];
            argv.extend_from_slice(extra);
            let err = Cli::try_parse_from(&argv).unwrap_err();
            let line = one_line_error(&err);
            assert!(!line.contains('\n'));
            assert!(line.contains(needle), "{argv:?}: {line}");
        }
    }

    #[test]
    fn graphed_runs() {
        let args = run_args(
            Cli::try_parse_from([
                "hvtrace",
                "run",
                "--graph",
                "vfs_read",
                "--graph",
                "vfs_write",
                "--graph-trace",
                "vfs_*",
                "--graph-notrace",
                "rw_verify_area",
                "--graph-ftrace-notrace",
                "*fsnotify*",
                "--graph-ftrace-notrace",
                "security_*",
                "--graph-comm",
                "dd",
                "--graph-retval",
                "--max-depth",
                "3",
                "--exec",
                "dd if=/etc/hostname of=/dev/null",
                "--format",
                "chrome",
                "--output",
                "/tmp/graph.json",
            ])
            .unwrap(),
        );
        assert!(args.traces());
        assert_eq!(args.graphs, ["vfs_read", "vfs_write"]);
        assert_eq!(args.graph_filter.trace, ["vfs_*"]);
        assert_eq!(args.graph_filter.graph_notrace, ["rw_verify_area"]);
        assert_eq!(args.graph_filter.notrace, ["*fsnotify*", "security_*"]);
        assert_eq!(args.graph_filter.comm.as_deref(), Some("dd"));
        assert!(args.graph_filter.retval);
        assert_eq!(args.graph_filter.max_depth, 3);
        assert_eq!(args.format, Some(OutputFormatArg::Chrome));
        // With probes and the function tracer in the same run.
        let args = run_args(
            Cli::try_parse_from([
                "hvtrace",
                "run",
                "--probe",
                "p vfs_read",
                "--function",
                "ksys_*",
                "--graph",
                "vfs_read",
                "--exec",
                "true",
            ])
            .unwrap(),
        );
        assert!(
            args.traces() && args.graph_filter.trace.is_empty() && args.graph_filter.max_depth == 0
        );
        assert!(args.graph_filter.graph_notrace.is_empty() && args.graph_filter.notrace.is_empty());
        assert!(!args.graph_filter.retval && args.graph_filter.comm.is_none());
    }

    #[test]
    fn bad_graph_combinations_are_one_line() {
        let cases: [(&[&str], &str); 10] = [
            (&["--graph", "vfs_read"], "--exec"),
            (
                &["--bare", "--graph", "vfs_read", "--exec", "true"],
                "cannot be used with",
            ),
            (&["--detach", "--graph", "vfs_read"], "cannot be used with"),
            (&["--graph-trace", "vfs_*", "--exec", "true"], "--graph"),
            (&["--graph-notrace", "x", "--exec", "true"], "--graph"),
            (
                &["--graph-ftrace-notrace", "x", "--exec", "true"],
                "--graph",
            ),
            (&["--graph-comm", "dd", "--exec", "true"], "--graph"),
            (&["--graph-retval", "--exec", "true"], "--graph"),
            (&["--max-depth", "2", "--exec", "true"], "--graph"),
            // A format needs something to trace or count.
            (&["--format", "chrome", "--exec", "true"], "--probe"),
        ];
        for (extra, needle) in cases {
            let mut argv = vec!["hvtrace", "run"];
            argv.extend_from_slice(extra);
            let err = Cli::try_parse_from(&argv).unwrap_err();
            let line = one_line_error(&err);
            assert!(!line.contains('\n'));
            assert!(line.contains(needle), "{argv:?}: {line}");
        }
        // Text and JSON stay open to every tracer.
        for format in ["text", "json"] {
            assert!(Cli::try_parse_from([
                "hvtrace",
                "run",
                "--format",
                format,
                "--probe",
                "p vfs_read",
                "--exec",
                "true"
            ])
            .is_ok());
        }
        assert!(Cli::try_parse_from([
            "hvtrace", "run", "--format", "chrome", "--graph", "f", "--exec", "true"
        ])
        .is_ok());
    }

    /// The long help of a subcommand, joined into one line.
    fn help_of(path: &[&str]) -> String {
        let mut cmd = Cli::command();
        for name in path {
            cmd = cmd.find_subcommand(name).unwrap().clone();
        }
        let help = cmd.render_long_help().to_string();
        help.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn the_notrace_options_say_which_ftrace_file_they_are() {
        // One definition serves both commands: the same text in both helps,
        // `graph` keeping its short spellings as aliases, and `run` listing
        // them under a heading that says they need --graph.
        let graph = help_of(&["graph"]);
        let run = help_of(&["run"]);
        for help in [&graph, &run] {
            assert!(
                help.contains("--graph-ftrace-notrace <GLOB> Do not hook the functions matching GLOB, as ftrace's set_ftrace_notrace (repeatable): they do not show, but what they call still does"),
                "{help}"
            );
            assert!(
                help.contains("--graph-notrace <GLOB> Leave the functions matching GLOB, and everything they call, out of the call trees, as ftrace's set_graph_notrace"),
                "{help}"
            );
        }
        assert!(graph.contains("[alias: --notrace]"), "{graph}");
        assert!(
            run.contains("Function-graph options (with --graph):"),
            "{run}"
        );
        // Return probes are documented.
        let add = help_of(&["probe", "add"]);
        assert!(add.contains("r vfs_read $retval"), "{add}");
    }

    #[test]
    fn supervise_is_hidden() {
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("supervise"), "{help}");
        assert!(help.contains("status") && help.contains("exec") && help.contains("stop"));
        assert!(help.contains("probe") && help.contains("trace") && help.contains("graph"));
    }

    #[test]
    fn record_and_convert_parse() {
        let cli = Cli::try_parse_from(["hvtrace", "record"]).unwrap();
        let Command::Record(args) = cli.command else {
            panic!("not record");
        };
        assert_eq!(args.output, PathBuf::from("trace.dat"));
        assert!(!args.no_sched && args.duration.is_none() && args.also_json.is_none());
        let cli = Cli::try_parse_from([
            "hvtrace",
            "record",
            "-o",
            "x.dat",
            "--probe",
            "p vfs_read",
            "--function",
            "vfs_*",
            "--graph",
            "vfs_read",
            "--graph-comm",
            "dd",
            "--no-sched",
            "--duration",
            "2.5",
        ])
        .unwrap();
        let Command::Record(args) = cli.command else {
            panic!("not record");
        };
        assert_eq!(
            (
                args.output.to_str(),
                args.probes.len(),
                args.functions.len()
            ),
            (Some("x.dat"), 1, 1)
        );
        assert_eq!(args.graph_filter.comm.as_deref(), Some("dd"));
        assert!(args.no_sched && args.duration == Some(2.5));
        let cli = Cli::try_parse_from([
            "hvtrace", "convert", "l.jsonl", "-o", "t.dat", "--cpus", "4",
        ])
        .unwrap();
        let Command::Convert(args) = cli.command else {
            panic!("not convert");
        };
        assert_eq!((args.cpus, args.kallsyms), (4, None));
        // convert needs its output.
        assert!(Cli::try_parse_from(["hvtrace", "convert", "l.jsonl"]).is_err());
        // trace: --sched and --no-sched exclude each other.
        assert!(Cli::try_parse_from(["hvtrace", "trace", "--sched", "--no-sched"]).is_err());
        // syscalls --trace-dat does not go with --summary.
        assert!(
            Cli::try_parse_from(["hvtrace", "syscalls", "--summary", "--trace-dat", "x"]).is_err()
        );
        let cli = Cli::try_parse_from([
            "hvtrace",
            "run",
            "--sched",
            "--format",
            "trace-dat",
            "--output",
            "r.dat",
            "--exec",
            "true",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run");
        };
        assert!(args.sched && args.traces());
        assert_eq!(args.format, Some(OutputFormatArg::TraceDat));
    }
}
