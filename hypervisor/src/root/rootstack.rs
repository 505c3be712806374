//! Root's stacks: the guard page under each, how deep each has been used,
//! and the self-tests that run into a guard.
//!
//! The boot stub leaves a 4 KiB page between the boot page directory and
//! the boot processor's stack; [`install_guard`] switches root to page
//! tables without that page (built by `hypervisor::host_paging`). Each AP's
//! stack comes from the frame pool with a page under it that `smp` takes
//! out of the same tables. An overflow then writes to a page that is not
//! present: the #PF cannot be delivered on that stack, the CPU raises #DF,
//! which switches to its own IST stack (`arch::cpu`), and `fatal` reports
//! it, naming the guard of the CPU's stack ([`guard_hit`]), and powers
//! off. HOST_CR3 is read after the switch, so every VM exit comes back to
//! these tables.
//!
//! Every stack is registered here by CPU index ([`register`]) and filled
//! with `hypervisor::stack_use::PATTERN` before it is run on (the boot
//! processor's below the frames in use when it fills it), so that
//! [`used`] tells the deepest any CPU has gone: `status` reports it per
//! vCPU, and root logs it when the guest stops.

use crate::arch::instructions as insn;
use crate::{fatal, frames, hvprintln, phys};
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use hypervisor::acpi::MAX_CPUS;
use hypervisor::host_paging::{self, GuardError};
use hypervisor::stack_use::PATTERN;

/// A root stack: `[bottom, top)`, with its guard page right under
/// `bottom`. Zero while the CPU has none registered.
struct Stack {
    bottom: AtomicU64,
    top: AtomicU64,
}

static STACKS: [Stack; MAX_CPUS] = [const {
    Stack {
        bottom: AtomicU64::new(0),
        top: AtomicU64::new(0),
    }
}; MAX_CPUS];

/// Records CPU `index`'s stack `[bottom, top)` (its guard page is the
/// page under `bottom`).
pub fn register(index: usize, bottom: u64, top: u64) {
    if let Some(s) = STACKS.get(index) {
        s.bottom.store(bottom, Ordering::Release);
        s.top.store(top, Ordering::Release);
    }
}

/// CPU `index`'s stack, if registered.
pub fn stack(index: usize) -> Option<(u64, u64)> {
    let s = STACKS.get(index)?;
    let (bottom, top) = (
        s.bottom.load(Ordering::Acquire),
        s.top.load(Ordering::Acquire),
    );
    (bottom != 0 && top > bottom).then_some((bottom, top))
}

/// Fills `[from, to)` (8-byte aligned, part of a registered stack that
/// nothing runs on) with the pattern.
///
/// # Safety
/// The range must be root's memory, mapped, and unused by anyone while
/// this runs and until the stack's owner runs into it.
pub unsafe fn fill(from: u64, to: u64) {
    let mut at = from & !7;
    while at + 8 <= to {
        // SAFETY: the caller's promise: mapped, unused, aligned.
        unsafe { core::ptr::write_volatile(at as *mut u64, PATTERN) };
        at += 8;
    }
}

/// Fills the part of the running CPU's stack (`[bottom, ..)`) below the
/// frames in use now with the pattern. Not inlined: its own frame is a
/// few words, right under the marker whose address bounds the fill.
#[inline(never)]
pub fn fill_below_here(bottom: u64) {
    let marker = 0u8;
    let here = core::hint::black_box(&marker) as *const u8 as u64;
    // A margin for this function's own frame under the marker (root runs
    // without a red zone, and with interrupts off but NMIs, which take
    // their own IST stack).
    let end = here.saturating_sub(512) & !7;
    if end > bottom {
        // SAFETY: `[bottom, end)` is this CPU's stack under the frame of
        // this function, which calls nothing: no one uses it now.
        unsafe { fill(bottom, end) };
    }
}

/// The bytes of CPU `index`'s stack that have been used (from the deepest
/// word no longer holding the pattern to the top), and its size.
pub fn used(index: usize) -> Option<(u64, u64)> {
    let (bottom, top) = stack(index)?;
    let words = ((top - bottom) / 8) as usize;
    let read = |i: usize| {
        // SAFETY: a word of a registered stack, mapped in root's tables
        // and 8-byte aligned. Its CPU may be writing it meanwhile (the
        // high-water mark of a running CPU is a snapshot): the value read
        // is only compared with the pattern.
        unsafe { core::ptr::read_volatile((bottom + i as u64 * 8) as *const u64) }
    };
    Some((hypervisor::stack_use::used(words, read), top - bottom))
}

/// Logs how deep every registered root stack was used.
pub fn log_use() {
    for index in 0..MAX_CPUS {
        if let Some((used, size)) = used(index) {
            hvprintln!(
                "root stack of vCPU {index}: {} KiB of {} KiB used at the deepest",
                used.div_ceil(1024),
                size >> 10
            );
        }
    }
}

/// The guard page of the stack `rsp` or `cr2` points into or just under,
/// with that stack, when a fault looks like an overflow: the fault
/// address (CR2) in the guard page, or the interrupted RSP in it or at the
/// stack's very bottom (a #PF on the guard cannot be delivered on that
/// stack and becomes #DF, whose frame keeps the RSP of the overflowing
/// code). `(guard, bottom, top)`.
pub fn guard_hit(rsp: u64, cr2: u64) -> Option<(u64, u64, u64)> {
    (0..MAX_CPUS).find_map(|index| {
        let (bottom, top) = stack(index)?;
        let guard = bottom - 4096;
        ((guard..bottom).contains(&cr2) || (guard..=bottom).contains(&rsp))
            .then_some((guard, bottom, top))
    })
}

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

/// Set by the `hvtrace.selftest=ap-stack-overflow` hook: the first AP
/// overflows its stack once its own tables are in place.
static AP_OVERFLOW: AtomicBool = AtomicBool::new(false);

/// Arms the `hvtrace.selftest=ap-stack-overflow` hook.
pub fn arm_ap_overflow() {
    AP_OVERFLOW.store(true, Ordering::Release);
}

/// On AP `index` (from `smp`, right after its IDT and IST stacks are
/// installed, before VMX): when the hook is armed and this is the first
/// AP, recurses until its stack runs into its guard page. Like
/// [`overflow`], it never returns then: `fatal` reports the #DF and
/// powers off.
pub fn ap_overflow_hook(index: usize) {
    if index != 1 || !AP_OVERFLOW.load(Ordering::Acquire) {
        return;
    }
    if let Some((bottom, top)) = stack(index) {
        hvprintln!(
            "self-test: overflowing AP {index}'s root stack ({bottom:#x}..{top:#x}, guard page at {:#x})",
            bottom - 4096
        );
    }
    let depth = recurse(0);
    fatal::die(format_args!(
        "self-test ap-stack-overflow: the recursion ended at depth {depth} without a fault"
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
