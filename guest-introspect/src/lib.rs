//! Reading an unmodified Linux guest from outside, with no symbol file.
//!
//! - [`addr`]: [`Gva`] (and the loader's [`Gpa`]).
//! - [`mem`]: [`GuestMemory`], guest-physical reads; [`VecMemory`] for tests.
//! - [`paging`]: the guest's 4-level page tables walked in software.
//! - [`view`]: [`VirtMemory`], the guest-virtual "memory view" the rest reads
//!   through: [`PagedView`] in the hypervisor, [`SegmentView`] over a vmlinux
//!   on the host ([`elf`]).
//! - [`scan`]: hole-tolerant forward search.
//! - [`kallsyms`]: finding the kernel's symbol tables and a compact
//!   [`SymbolIndex`] over them.
//! - [`fentry`]: where each function's ftrace call site is, or why it has
//!   none.
//! - [`btf`]: the `.BTF` section, for `task_struct` member offsets.
//! - [`facts`]: the version banner, KASLR slide, `current` and the one-call
//!   [`facts::discover`] (and [`facts::discover_budgeted`], resumable).
//! - [`budget`]: the work budget of a recovery, and its slicing across
//!   calls.
//! - [`fallible`]: allocation that reports [`fallible::OutOfMemory`]
//!   instead of aborting, for every size that follows guest data.
//! - [`syscalls`]: the guest's system calls from its own `sys_call_table`,
//!   with argument names and types; [`syscall_abi`], the x86 system call
//!   ABI generated from the kernel source, their last source of arguments
//!   and a cross-check of the guest's numbers.
//!
//! Nothing here trusts guest memory: every length and offset read from the
//! guest is bounded before use, allocations of guest-chosen sizes are capped
//! ([`kallsyms::DEFAULT_MAX_INDEX_BYTES`], [`btf::MAX_BTF_BYTES`]) and
//! fallible (a refused allocation is an error, never an abort), the work
//! of one recovery is bounded by a [`budget::Budget`] shared by all of its
//! searches ([`budget::RECOVERY_BUDGET`]), and malformed tables give
//! errors, never panics.
//!
//! # Use from the hypervisor
//!
//! ```text
//! let view = PagedView::new(&guest_ram, Cr3(guest_cr3));     // a CR3 from CPL 0
//! let range = facts::ranges_from_lstar(Gva(guest_lstar))?;  // IA32_LSTAR = entry_SYSCALL_64
//! let kernel = facts::discover(&view, &[range])?;          // kallsyms, banner, KASLR, BTF, current
//! let sites = fentry::Classifier::new(&kernel.symbols);
//! let site = sites.site_of(&view, "vfs_read");             // Some(Ok(FentrySite { site, .. }))
//! ```
//!
//! - Search from IA32_LSTAR once the guest has set it (`syscall_init`); the
//!   tables are in `.rodata`, after `.text`, a few MiB above it.
//! - The CR3 must map the kernel: with PTI a CR3 read in user mode is the
//!   user PGD; see [`Cr3::pti_kernel`]. 5-level paging is not handled.
//! - [`GuestMemory`] must refuse hypervisor-owned memory: the walk follows
//!   the guest's own page tables.
//! - The index is a copy (names kept compressed, about 22 bytes a symbol:
//!   1 MiB for the fast-lane kernel, 2 MiB for Debian's); the guest can no
//!   longer change it once built.
//! - `current` is `*(kernel GS base + CurrentTask::percpu_offset)`: the
//!   kernel GS base is IA32_GS_BASE in kernel mode and IA32_KERNEL_GS_BASE
//!   while the guest runs user code.
//! - In a booted guest, sites are NOP5s; [`fentry::ftrace_records`] gives
//!   the guest's own list of sites to cross-check the bytes with.
//! - [`facts::discover`] does it all in one call, at most
//!   [`budget::RECOVERY_BUDGET`] units of work. To keep serving other work
//!   meanwhile, run [`facts::discover_budgeted`] (and
//!   [`fentry::survey_paced`]) over a [`budget::Metered`] view and poll it
//!   one slice at a time with [`budget::poll_slice`]: the result is the
//!   same.
// Unit tests use std's prelude; the library itself is no_std, which the
// x86_64-unknown-none build checks.
#![cfg_attr(not(test), no_std)]
// The library parses hostile guest memory and must never panic: indexing,
// unwrap, expect and panic! are flagged outside the tests. A remaining
// `allow` carries the reason its index cannot be out of bounds.
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

pub mod addr;
pub mod btf;
pub mod budget;
pub mod elf;
pub mod facts;
pub mod fallible;
pub mod fentry;
pub mod glob;
pub mod kallsyms;
pub mod linear;
pub mod mem;
pub mod module;
pub mod paging;
pub mod scan;
pub mod stacks;
pub mod syscall_abi;
pub mod syscall_structs;
pub mod syscalls;
pub mod view;

pub use addr::{Gpa, Gva, GvaRange};
pub use kallsyms::{KallsymsError, KallsymsTables, SymbolId, SymbolIndex};
pub use mem::{GuestMemory, MemError, VecMemory};
pub use paging::{Cr3, WalkError};
pub use view::{PagedView, SegmentView, ViewError, VirtMemory};
