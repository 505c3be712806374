//! The tracer's host-testable parts: the per-vCPU event ring and the site
//! logic of the EPT split view. The bare-metal glue that maps the
//! trampolines, edits EPT and serves the hypercalls is `src/tracer.rs` of
//! the hypervisor binary.

pub mod graph;
pub mod retstack;
pub mod ring;
pub mod site;
