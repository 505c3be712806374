//! The commands of the `hvtrace` binary: argument definitions, `run`, the
//! control commands (`status`, `exec`, `syms`, `probe`, `trace`, `stop`) and
//! `graph`.

pub mod cli;
pub mod count;
pub mod ctl;
pub mod graph;
pub mod run;
pub mod timeouts;
pub mod trace_read;
