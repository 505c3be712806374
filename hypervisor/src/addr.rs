//! Address newtypes. `Gpa` and `Hpa` are the loader's (one definition for the
//! whole boot path); the EPT map is an identity map, so a guest-physical
//! address of guest RAM equals the host-physical one, but the types keep the
//! two roles apart in signatures.

pub use loader::layout::{Gpa, Hpa};

pub use guest_introspect::addr::Gva;
