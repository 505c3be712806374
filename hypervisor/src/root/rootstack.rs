//! Root's stack: the guard page under it, and the self-test that runs into
//! it.
//!
//! The boot stub leaves a 4 KiB page between the boot page directory and
//! the stack; [`install_guard`] switches root to page tables without that
//! page (built by `hypervisor::host_paging`). An overflow then writes to a
//! page that is not present: the #PF cannot be delivered on that stack, the
//! CPU raises #DF, which switches to its own IST stack (`arch::cpu`), and
//! `fatal` reports it and powers off. HOST_CR3 is read after the switch, so
//! every VM exit comes back to these tables.

use crate::arch::instructions as insn;
use crate::{fatal, frames, hvprintln, phys};
use hypervisor::host_paging::{self, GuardError};

/// Takes the guard page out of root's page tables and loads them; returns
/// the guard's address. On an error nothing changed.
pub fn install_guard() -> Result<u64, GuardError> {
    let guard = loader::entry::stack_guard();
    let read = |pa: u64| {
        let mut entry = [0u8; 8];
        phys::read(pa, &mut entry).then(|| u64::from_le_bytes(entry))
    };
    let cr3 =
        host_paging::unmap_guard_page(&mut frames::PoolTables, read, insn::read_cr3(), guard)?;
    // SAFETY: the new hierarchy translates every address exactly as the
    // boot stub's does except the guard page, which root only reaches by
    // overflowing its stack; its tables are pool frames, never freed or
    // handed out again.
    unsafe { insn::write_cr3(cr3) };
    Ok(guard)
}

/// The `hvtrace.selftest=stack-overflow` hook (`hypervisor::selftest`):
/// recurses until the stack runs into the guard page. Never returns: the
/// fault is reported by `fatal` as #DF, then the machine powers off.
pub fn overflow() -> ! {
    let top = loader::entry::stack_top();
    hvprintln!(
        "self-test: overflowing root's stack ({:#x}..{top:#x}, guard page at {:#x})",
        top - loader::entry::STACK_SIZE,
        loader::entry::stack_guard()
    );
    let depth = recurse(0);
    fatal::die(format_args!(
        "self-test stack-overflow: the recursion ended at depth {depth} without a fault"
    ))
}

/// One level of the overflow: a 512-byte frame the optimizer must keep
/// (`black_box` sees its address), and a call that is not a tail call
/// (the result is used after it). The stop condition never holds, but the
/// compiler cannot know that.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let mut frame = [0u8; 512];
    if let Some(b) = frame.get_mut((depth % 512) as usize) {
        *b = depth as u8;
    }
    let frame = core::hint::black_box(&mut frame);
    if core::hint::black_box(depth) == u64::MAX {
        return 0;
    }
    let deeper = recurse(depth + 1);
    let b = frame.get((depth % 512) as usize).copied().unwrap_or(0);
    deeper.wrapping_add(u64::from(b))
}
