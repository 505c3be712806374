//! Output formats: JSON, Chrome traces, the control commands' reports.
//! The escaping of guest text for the terminal, which every part of the
//! crate uses (the VM's own progress lines too), is [`crate::term`]; it
//! stays reachable here as `output::term`.

pub mod chrome;
pub mod json;
pub mod report;
pub mod tracedat;

pub use crate::term;
