//! hvtrace, the host side: builds boot images, launches Bochs or QEMU with
//! the hypervisor and a Linux guest, drives the guest's shell over the serial
//! console, reads the hypervisor's log port, and keeps a detached VM behind a
//! unix control socket whose supervisor speaks the control protocol to
//! clients and to the hypervisor (COM2).
//!
//! The library is what the `hvtrace` binary and the VM test suite share:
//!
//! ```no_run
//! use hvtrace::{launch, Guest, RunConfig};
//! let cfg = RunConfig::for_guest(Guest::Fast)?.with_hypervisor(hvtrace::hypervisor::build()?);
//! let mut vm = launch(cfg)?;
//! let uname = vm.exec("uname -r")?;
//! let report = vm.poweroff()?;
//! assert!(report.clean());
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod bochs;
pub mod bounded;
pub mod channel;
pub mod chrome;
pub mod cli;
pub mod client;
pub mod config;
pub mod console;
pub mod ctl;
pub mod detach;
pub mod graph;
pub mod guest;
pub mod host;
pub mod hvlog;
pub mod hypervisor;
pub mod image;
pub mod json;
pub mod link;
pub mod owners;
pub mod qemu;
pub mod run;
pub mod segment;
pub mod session;
pub mod socket;
pub mod supervisor;
pub mod sys;
pub mod tcp_table;
pub mod term;
pub mod tracebuf;
pub mod vm;

pub use config::{Emulator, EmulatorChoice, Guest, RunConfig};
pub use console::ExecResult;
pub use hvlog::{ExitCounts, HvEvent, HvLog};
pub use vm::{launch, StopReport, Vm, VmWatch};
