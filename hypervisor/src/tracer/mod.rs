//! The tracer's host-testable parts: the per-vCPU event ring, the site
//! logic of the EPT split view, the function-graph return stack and the
//! function_graph rendering. The bare-metal glue that maps the
//! trampolines, edits EPT and serves the hypercalls is `src/trace.rs`, a
//! module of the hypervisor binary (`src/main.rs`).

pub mod graph;
pub mod retstack;
pub mod ring;
pub mod site;
