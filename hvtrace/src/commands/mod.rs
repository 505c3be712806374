//! The commands of the `hvtrace` binary: argument definitions, `run` (and
//! `run --detach` with the hidden `supervise`, which hand over to the
//! daemon), the control commands (`status`, `exec`, `syms`, `probe`,
//! `trace`, `stop`) and `graph`.

pub mod cli;
pub mod count;
pub mod ctl;
pub mod detach;
pub mod graph;
pub mod record;
pub mod run;
pub mod syscalls;
pub mod timeouts;
pub mod trace_read;
