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
//! let cfg = RunConfig::for_guest(Guest::Fast)?.with_hypervisor(hvtrace::vm::hv_image::build()?);
//! let mut vm = launch(cfg)?;
//! let uname = vm.exec("uname -r")?;
//! let report = vm.poweroff()?;
//! assert!(report.clean());
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod client;
pub mod commands;
pub mod control;
pub mod daemon;
pub mod output;
pub mod sys;
pub mod term;
pub mod vm;

pub use vm::config::{Emulator, EmulatorChoice, Guest, RunConfig};
pub use vm::console::ExecResult;
pub use vm::hvlog::{ExitCounts, HvEvent, HvLog};
pub use vm::{launch, StopReport, Vm, VmWatch};
