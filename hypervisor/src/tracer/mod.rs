//! The tracer: the trampoline region in the guest's kernel address space,
//! hooked fentry sites behind an EPT split view, the entry hypercall with
//! its kprobe, function-tracer and function-graph handlers, the event ring
//! and its stream. It reaches root's frames, EPT and heap and the guest's
//! memory only through [`machine::Machine`] and [`machine::Env`], and the
//! recovered kernel through [`machine::KernelView`], so that all of it
//! runs in host tests (`tests.rs`) as well as in VMX root.

mod core;
pub mod graph;
pub mod machine;
pub mod retstack;
pub mod ring;
pub mod site;
#[cfg(test)]
mod tests;

pub use self::core::{GraphStarted, Hypercall, ReqError, Tracer, Violation};
