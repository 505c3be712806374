//! The fuzzing guest's shared half: the seeded operation stream, the
//! outcome digests and the list of documented differences between root and
//! the bare CPU.
//!
//! The bare-metal program (`src/guest/`) draws its operations from here and
//! the host driver regenerates the same stream to name the operation behind
//! a differing window, so both sides agree by construction. Nothing here
//! touches hardware; it is all host-tested.
#![no_std]

pub mod cmdline;
pub mod digest;
pub mod known;
pub mod ops;
pub mod query;
pub mod rng;

/// The address the program is linked at and asks to be loaded at (64 MiB:
/// above the hypervisor's memory, inside the smallest guest RAM).
pub const LINK_BASE: u64 = 0x400_0000;

/// Where the hooked part of the program is loaded (physical) ...
pub const HOOKED_LMA: u64 = 0x420_0000;
/// ... and where it runs: kernel-text addresses, within a call's reach of
/// root's trampolines (one 2 MiB page maps it).
pub const HOOKED_VMA: u64 = 0xFFFF_FFFF_8020_0000;
/// Bytes the host may fill with kallsyms tables (`fz_kallsyms`).
pub const KALLSYMS_ROOM: usize = 0x8000;
/// The hooked functions, by name (the host hooks them; the program calls
/// them through [`ops::Op::HookCall`]).
pub const HOOKED_FUNCTIONS: [&str; 4] = ["fz_hook_0", "fz_hook_1", "fz_hook_2", "fz_hook_3"];

/// Where root maps its trampoline page when hooks are in: the highest
/// free entry of the page directory that maps [`HOOKED_VMA`] (the program
/// leaves all but its own entry free), i.e. entry 511.
pub const TRAMPOLINE_PAGE: u64 = 0xFFFF_FFFF_8000_0000 + 511 * 0x20_0000;

/// A 2 MiB region the program maps with 4 KiB pages to play with its own
/// page tables (identity-mapped like the rest of the low 4 GiB).
pub const SCRATCH_BASE: u64 = 0x600_0000;

/// The most vCPUs the program runs on.
pub const MAX_CPUS: usize = 4;

/// The scratch page-table entry that page-table game page `i` (1..=510,
/// as the stream draws it) is on vCPU `cpu`: every vCPU plays with entries
/// of its own. When they shared them, one vCPU's entry made not present
/// for a moment turned another's read-only store into a not-present
/// fault, or not, by the timing (seed 2009 on two vCPUs).
pub fn scratch_entry(i: u16, cpu: u32) -> u16 {
    let slots = 510 / MAX_CPUS as u16;
    1 + (i.saturating_sub(1) % slots) * MAX_CPUS as u16 + (cpu % MAX_CPUS as u32) as u16
}

/// The prefix of every line the program prints.
pub const LINE_PREFIX: &str = "fuzz: ";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vcpu_plays_with_scratch_entries_of_its_own() {
        let mut owner = [None; 512];
        for cpu in 0..MAX_CPUS as u32 {
            for i in 1..=510u16 {
                let e = scratch_entry(i, cpu);
                assert!((1..=510).contains(&e), "page {i} on cpu {cpu}: entry {e}");
                match owner[usize::from(e)] {
                    None => owner[usize::from(e)] = Some(cpu),
                    Some(c) => assert_eq!(c, cpu, "entry {e} shared by cpus {c} and {cpu}"),
                }
            }
        }
    }
}
