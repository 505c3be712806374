//! Address newtypes: the loader's, one definition for the workspace. The
//! EPT map is an identity map, so a guest-physical address of guest RAM
//! equals the host-physical one, but the types keep the two roles apart in
//! signatures; a guest-virtual address is the guest kernel's.

pub use loader::layout::{Gpa, Gva, Hpa};
