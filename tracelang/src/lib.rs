//! The trace language of hvtrace, shared by VMX root and the host CLI.
//!
//! - [`kprobe`]: kprobe_events-style probe specs (parsing, the fetch plan
//!   root runs on a hit), the binary event record, and its trace_pipe and
//!   JSON lines.
//! - [`graph`]: function_graph events, in the kernel's text form and as
//!   JSON lines.
//! - [`render`]: the host's renderer of root's records, which prints what
//!   root prints from them, the rules and pieces root's own stream renders
//!   with, and the host's reader of root's record rings.
//!
//! The crate is `no_std` + alloc: the hypervisor's bare-metal image links
//! it, and the host builds and tests it as any other library. It touches
//! no hardware; guest memory and symbols come in through the traits
//! [`kprobe::GuestMem`] and [`kprobe::SymbolResolver`].
#![cfg_attr(not(test), no_std)]
#![cfg_attr(
    not(test),
    warn(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic
    )
)]

extern crate alloc;

pub mod graph;
pub mod kprobe;
pub mod render;
