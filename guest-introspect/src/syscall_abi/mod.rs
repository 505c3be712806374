//! The x86 system call ABI as the kernel source declares it, in tables
//! generated at build time (by `examples/gen_syscall_abi.rs`, see
//! `scripts/gen-syscall-abi.sh`) from the kernel's own files:
//!
//! - numbers, names and entry points from
//!   `arch/x86/entry/syscalls/syscall_64.tbl` ([`x86_64::CALLS`]) and
//!   `syscall_32.tbl` ([`i386::CALLS`]);
//! - argument C types and names from the `sys_` prototypes of
//!   `include/linux/syscalls.h`, with `__user` dropped: every pointer
//!   argument of a system call is a user pointer.
//!
//! The guest's own `sys_call_table` always wins: [`crosscheck`] only
//! reports where it disagrees, and the table's arguments are the last
//! source [`crate::syscalls::table`] tries (`ArgSource::Table`), after the
//! guest's metadata and BTF.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use crate::fallible::{try_push, OutOfMemory};
use crate::syscalls::Syscall;

pub mod i386;
mod parse;
mod render;
pub mod x86_64;

pub use parse::{parse_prototypes, parse_tbl, Proto, TblEntry};
pub use render::{generate, kernel_version, Arch, PROTOTYPES};

/// One system call of a generated table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiCall {
    /// Its number.
    pub nr: u32,
    /// Its name in the ABI (`stat`).
    pub name: &'static str,
    /// The wrapper symbol its table slot points at (`__x64_sys_newstat`,
    /// `__ia32_compat_sys_open`).
    pub entry: &'static str,
    /// Whether `args` comes from a prototype; when false the arguments
    /// are unknown and `args` is empty.
    pub typed: bool,
    /// (C type as written, without `__user` and single spaced, name) of
    /// each argument, in order (`("const char *", "filename")`).
    pub args: &'static [(&'static str, &'static str)],
}

/// Wrapper prefixes, longest first, that [`AbiCall::sys_name`] strips.
const WRAPPERS: [&str; 3] = ["__ia32_compat_sys_", "__ia32_sys_", "__x64_sys_"];

impl AbiCall {
    /// The name its wrapper carries (`newstat` for `stat`), as
    /// [`crate::syscalls::table`] names the guest's calls.
    pub fn sys_name(&self) -> &'static str {
        WRAPPERS
            .iter()
            .find_map(|p| self.entry.strip_prefix(p))
            .unwrap_or(self.entry)
    }
}

/// The call named `name` in the ABI (`stat`, not `newstat`).
pub fn lookup<'a>(table: &'a [AbiCall], name: &str) -> Option<&'a AbiCall> {
    table.iter().find(|c| c.name == name)
}

/// The call whose table slot points at wrapper `entry`
/// (`__x64_sys_newstat`).
pub fn lookup_entry<'a>(table: &'a [AbiCall], entry: &str) -> Option<&'a AbiCall> {
    table.iter().find(|c| c.entry == entry)
}

/// The call numbered `nr`.
pub fn by_number(table: &[AbiCall], nr: u32) -> Option<&AbiCall> {
    table.iter().find(|c| c.nr == nr)
}

/// A guest call the ABI table places otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// The guest's number for it.
    pub nr: u32,
    /// The guest's name for it (its wrapper's).
    pub name: String,
    /// The table's call at that number (its ABI name), if any.
    pub table_name: Option<&'static str>,
    /// The table's number for that name, if any.
    pub table_nr: Option<u32>,
}

/// The guest's system calls against an ABI table. Data only: the guest's
/// numbers and names stand whatever the table says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Crosscheck {
    /// Numbers where both have the same call.
    pub agree: Vec<u32>,
    /// Guest calls at a number the table gives another call, or whose name
    /// the table numbers otherwise.
    pub differ: Vec<Mismatch>,
    /// (number, ABI name) of the table's calls at numbers where the guest
    /// has none (numbers the table gives `sys_ni_syscall` left out).
    pub missing: Vec<(u32, &'static str)>,
    /// (number, name) of guest calls whose number and name the table has
    /// neither of.
    pub unknown: Vec<(u32, String)>,
}

impl fmt::Display for Crosscheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} agree, {} differ, {} missing from the guest, {} unknown to the table",
            self.agree.len(),
            self.differ.len(),
            self.missing.len(),
            self.unknown.len()
        )
    }
}

/// [`crosscheck_with`] the x86-64 table, over the guest's calls from
/// [`crate::syscalls::table`].
pub fn crosscheck(calls: &[Syscall]) -> Result<Crosscheck, OutOfMemory> {
    crosscheck_with(x86_64::CALLS, calls.iter().map(|c| (c.nr, c.name.as_str())))
}

/// The guest's calls, (number, name as its wrapper spells it, `newstat`),
/// against `table`: a call agrees when the table's call at its number has
/// its name ([`AbiCall::sys_name`]).
pub fn crosscheck_with<'g, I>(table: &[AbiCall], guest: I) -> Result<Crosscheck, OutOfMemory>
where
    I: IntoIterator<Item = (u32, &'g str)>,
    I::IntoIter: Clone,
{
    let guest = guest.into_iter();
    let mut out = Crosscheck::default();
    for (nr, name) in guest.clone() {
        let at_nr = by_number(table, nr);
        if at_nr.is_some_and(|c| c.sys_name() == name) {
            try_push(&mut out.agree, nr)?;
            continue;
        }
        let named = table.iter().find(|c| c.sys_name() == name);
        if at_nr.is_none() && named.is_none() {
            try_push(&mut out.unknown, (nr, String::from(name)))?;
            continue;
        }
        try_push(
            &mut out.differ,
            Mismatch {
                nr,
                name: String::from(name),
                table_name: at_nr.map(|c| c.name),
                table_nr: named.map(|c| c.nr),
            },
        )?;
    }
    for c in table {
        // A number the ABI itself leaves unimplemented, as the guest's
        // table does.
        if c.sys_name() == "ni_syscall" {
            continue;
        }
        if !guest.clone().any(|(nr, _)| nr == c.nr) {
            try_push(&mut out.missing, (c.nr, c.name))?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
