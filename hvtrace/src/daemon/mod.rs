//! The daemon side: the supervisor of a detached VM, its control socket,
//! client sessions, and the link to the hypervisor on COM2.

pub mod detach;
pub mod link;
pub mod local;
pub mod owners;
pub mod recording;
pub mod segment;
pub mod serve;
pub mod session;
pub mod socket;
pub mod supervisor;
pub mod symbols;
pub mod tracebuf;
