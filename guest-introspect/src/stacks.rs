//! Where the guest kernel's stacks are: every task's kernel stack (one
//! `THREAD_SIZE` block, aligned to its size), each CPU's hardirq stack, and
//! each CPU's exception (IST) stacks in its `cpu_entry_area`.
//!
//! The function-graph tracer keeps one return stack per guest stack, and
//! drops frames below a new call's return slot as dead. That is only sound
//! within one stack: two stacks that share a key would let a call on one
//! (an NMI, say) drop the live frames of the other (the #DB it interrupted,
//! or a task). So a return slot is keyed by the stack it is really on,
//! found from the guest's own data:
//!
//! - `THREAD_SIZE` from kallsyms: `init_stack` (or `__start_init_stack`,
//!   `__start_init_task`) to `__end_init_stack` (`__end_init_task` before
//!   6.2) is exactly one `THREAD_SIZE`. KASAN kernels double it. Without
//!   those symbols, `sizeof(struct irq_stack)` from BTF (equal to it on
//!   x86-64), else 16 KiB.
//! - The hardirq stack: the per-cpu pointer `hardirq_stack_ptr` (6.1) or
//!   `pcpu_hot.hardirq_stack_ptr` (6.2 to 6.14), which holds the stack's
//!   top minus 8; its size is `sizeof(struct irq_stack)`.
//! - The exception stacks: the per-cpu pointer `cea_exception_stacks` to a
//!   `struct cea_exception_stacks`, whose `*_stack` members (DF, NMI, DB,
//!   MCE, and VC, VC2 when built) are the stacks and whose `*_guard`
//!   members are unmapped guard pages. Offsets and sizes come from BTF;
//!   without BTF, the layout every x86-64 kernel since 5.2 uses (4 KiB
//!   guards, stacks of half a `THREAD_SIZE`) for DF, NMI, DB and MCE.
//!
//! Anything else is keyed as a task stack: its `THREAD_SIZE`-aligned block.

use crate::btf::{Btf, Kind};
use crate::budget::Budget;
use crate::kallsyms::SymbolIndex;
use crate::view::{read_array, VirtMemory};
use alloc::vec::Vec;

/// `THREAD_SIZE` when nothing in the guest says otherwise (x86-64 without
/// KASAN).
pub const DEFAULT_THREAD_SIZE: u64 = 16 * 1024;
/// Smallest and largest `THREAD_SIZE` believed (x86-64 has 16 KiB, or 32
/// KiB with KASAN; anything outside this is not a stack size).
const THREAD_SIZE_RANGE: core::ops::RangeInclusive<u64> = 8 * 1024..=256 * 1024;
/// CPUs whose stacks are read at most.
pub const MAX_CPUS: u32 = 1024;
/// The exception stacks of `struct cea_exception_stacks`, in its order.
const EXCEPTION_STACKS: [&str; 6] = [
    "DF_stack",
    "NMI_stack",
    "DB_stack",
    "MCE_stack",
    "VC_stack",
    "VC2_stack",
];

/// Where a number came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// kallsyms symbols.
    Kallsyms,
    /// BTF.
    Btf,
    /// Not found in the guest: the x86-64 default.
    Assumed,
}

impl Source {
    /// A word for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kallsyms => "kallsyms",
            Self::Btf => "BTF",
            Self::Assumed => "assumed",
        }
    }
}

/// An exception stack inside `struct cea_exception_stacks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExceptionStack {
    /// Its short name: "DF", "NMI", "DB", "MCE", "VC", "VC2".
    pub name: &'static str,
    /// Byte offset in the struct.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
}

/// What is known of the guest's stacks, before reading any CPU's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackLayout {
    /// `THREAD_SIZE`: a task stack's size and alignment.
    pub thread_size: u64,
    /// Where `thread_size` came from.
    pub thread_size_source: Source,
    /// Per-cpu offset of the hardirq stack pointer.
    pub irq_ptr: Option<u64>,
    /// Size of a hardirq stack.
    pub irq_size: u64,
    /// Per-cpu offset of the `cea_exception_stacks` pointer.
    pub exception_ptr: Option<u64>,
    /// The exception stacks in that struct.
    pub exception_stacks: Vec<ExceptionStack>,
    /// Where `exception_stacks` came from.
    pub exception_source: Source,
}

impl Default for StackLayout {
    fn default() -> Self {
        Self {
            thread_size: DEFAULT_THREAD_SIZE,
            thread_size_source: Source::Assumed,
            irq_ptr: None,
            irq_size: DEFAULT_THREAD_SIZE,
            exception_ptr: None,
            exception_stacks: Vec::new(),
            exception_source: Source::Assumed,
        }
    }
}

fn plausible(size: u64) -> bool {
    size.is_power_of_two() && THREAD_SIZE_RANGE.contains(&size)
}

/// `THREAD_SIZE` from the init task's stack symbols, if they agree on one.
fn thread_size_from_symbols(index: &SymbolIndex) -> Option<u64> {
    let start = ["__start_init_stack", "__start_init_task", "init_stack"]
        .iter()
        .find_map(|n| index.addr_of(n))?;
    let end = ["__end_init_stack", "__end_init_task"]
        .iter()
        .find_map(|n| index.addr_of(n))?;
    let size = end.0.checked_sub(start.0)?;
    plausible(size).then_some(size)
}

/// The default `struct cea_exception_stacks` layout for `thread_size`:
/// a 4 KiB guard before each stack, stacks of `thread_size / 2`.
fn default_exception_stacks(thread_size: u64) -> Vec<ExceptionStack> {
    let size = (thread_size / 2) as u32;
    let mut offset = 0u32;
    let mut out = Vec::new();
    for name in &EXCEPTION_STACKS[..4] {
        offset += 4096;
        out.push(ExceptionStack {
            name: short(name),
            offset,
            size,
        });
        offset += size;
    }
    out
}

fn short(member: &'static str) -> &'static str {
    member.strip_suffix("_stack").unwrap_or(member)
}

/// Byte size of the member `ty` (an array of 1-byte elements, as the
/// exception stacks are declared).
async fn array_bytes<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    ty: u32,
    pace: &Budget,
) -> Option<u32> {
    let t = btf.resolve_paced(ty, pace).await.ok()?;
    let (elem, count) = btf.array(&t).ok()?;
    let e = btf.resolve_paced(elem, pace).await.ok()?;
    if e.kind != Kind::Int {
        return None;
    }
    count.checked_mul(e.size_or_type)
}

/// Finds the stack layout from kallsyms and, when there is one, BTF.
/// Never fails: what is not found is assumed (and says so).
pub async fn layout_paced<V: VirtMemory + ?Sized>(
    index: &SymbolIndex,
    btf: Option<&Btf<'_, V>>,
    pace: &Budget,
) -> StackLayout {
    let mut l = StackLayout::default();
    let irq_struct = match btf {
        Some(b) => b.find_paced(Kind::Struct, "irq_stack", pace).await.ok(),
        None => None,
    };
    let irq_btf_size = irq_struct
        .map(|t| u64::from(t.size_or_type))
        .filter(|&s| plausible(s));
    if let Some(ts) = thread_size_from_symbols(index) {
        l.thread_size = ts;
        l.thread_size_source = Source::Kallsyms;
    } else if let Some(ts) = irq_btf_size {
        l.thread_size = ts;
        l.thread_size_source = Source::Btf;
    }
    l.irq_size = irq_btf_size.unwrap_or(l.thread_size);
    l.irq_ptr = match index.addr_of("hardirq_stack_ptr") {
        Some(a) => Some(a.0),
        None => match (index.addr_of("pcpu_hot"), btf) {
            (Some(hot), Some(b)) => match b.find_paced(Kind::Struct, "pcpu_hot", pace).await {
                Ok(t) => b
                    .member_paced(&t, "hardirq_stack_ptr", pace)
                    .await
                    .ok()
                    .and_then(|m| m.byte_offset())
                    .map(|off| hot.0.wrapping_add(u64::from(off))),
                Err(_) => None,
            },
            _ => None,
        },
    };
    l.exception_ptr = index.addr_of("cea_exception_stacks").map(|a| a.0);
    if let Some(b) = btf {
        if let Ok(t) = b
            .find_paced(Kind::Struct, "cea_exception_stacks", pace)
            .await
        {
            let mut found = Vec::new();
            for name in EXCEPTION_STACKS {
                let Ok(m) = b.member_paced(&t, name, pace).await else {
                    continue;
                };
                let (Some(offset), Some(size)) =
                    (m.byte_offset(), array_bytes(b, m.type_id, pace).await)
                else {
                    continue;
                };
                if size == 0 || u64::from(offset) + u64::from(size) > u64::from(t.size_or_type) {
                    continue;
                }
                found.push(ExceptionStack {
                    name: short(name),
                    offset,
                    size,
                });
            }
            if !found.is_empty() {
                l.exception_stacks = found;
                l.exception_source = Source::Btf;
            }
        }
    }
    if l.exception_stacks.is_empty() {
        l.exception_stacks = default_exception_stacks(l.thread_size);
    }
    l
}

/// What kind of stack a range is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackKind {
    /// A task's kernel stack (or anything not known to be another kind).
    Task,
    /// A CPU's hardirq stack.
    Irq,
    /// A CPU's exception stack, by its short name.
    Exception(&'static str),
}

/// One stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackRange {
    /// Its lowest address.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
    /// What it is.
    pub kind: StackKind,
    /// The CPU it belongs to (tasks: none).
    pub cpu: Option<u32>,
}

impl StackRange {
    /// Whether `addr` is on it.
    pub fn contains(&self, addr: u64) -> bool {
        addr.wrapping_sub(self.base) < self.size
    }
}

/// The guest's per-CPU stacks as read, and `THREAD_SIZE` for the rest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackMap {
    thread_size: u64,
    /// Per-CPU stacks, sorted by base, not overlapping.
    special: Vec<StackRange>,
}

impl Default for StackMap {
    fn default() -> Self {
        Self::tasks_only(DEFAULT_THREAD_SIZE)
    }
}

impl StackMap {
    /// A map that knows no per-CPU stack: everything is keyed by its
    /// `thread_size` block.
    pub fn tasks_only(thread_size: u64) -> Self {
        Self {
            thread_size: if plausible(thread_size) {
                thread_size
            } else {
                DEFAULT_THREAD_SIZE
            },
            special: Vec::new(),
        }
    }

    /// Adds a per-CPU stack; refused (false) when it is empty, wraps, or
    /// overlaps one already known (the guest's pointers cannot be trusted
    /// to be sane).
    pub fn add(&mut self, r: StackRange) -> bool {
        if r.size == 0 || r.base.checked_add(r.size).is_none() {
            return false;
        }
        let at = self.special.partition_point(|s| s.base < r.base);
        let clash = |s: &StackRange| s.base < r.base + r.size && r.base < s.base + s.size;
        let before = at.checked_sub(1).and_then(|i| self.special.get(i));
        if before.is_some_and(clash) || self.special.get(at).is_some_and(clash) {
            return false;
        }
        if self.special.try_reserve(1).is_err() {
            return false;
        }
        self.special.insert(at, r);
        true
    }

    /// Reads the per-CPU stacks of every CPU in `percpu_bases` (each CPU's
    /// per-cpu offset) through `view`. CPUs whose pointers are unset (not
    /// brought up yet) or unreadable contribute nothing. Ranges that
    /// overlap one already taken are dropped, exception stacks (whose
    /// layout is the struct's) taken before IRQ stacks (one pointer each).
    pub fn read<V: VirtMemory + ?Sized>(
        layout: &StackLayout,
        view: &V,
        percpu_bases: &[u64],
    ) -> Self {
        let mut map = Self::tasks_only(layout.thread_size);
        let mut found: Vec<StackRange> = Vec::new();
        let per_cpu = layout.exception_stacks.len() + 1;
        let cpus = percpu_bases.len().min(MAX_CPUS as usize);
        if found.try_reserve(cpus * per_cpu).is_err() {
            return map;
        }
        for (cpu, &base) in percpu_bases.iter().enumerate().take(cpus) {
            let cpu = Some(cpu as u32);
            let ptr = |off: u64| -> Option<u64> {
                let v =
                    u64::from_le_bytes(read_array(view, crate::Gva(base.wrapping_add(off))).ok()?);
                (v != 0).then_some(v)
            };
            if let Some(estacks) = layout.exception_ptr.and_then(ptr) {
                for e in &layout.exception_stacks {
                    found.push(StackRange {
                        base: estacks.wrapping_add(u64::from(e.offset)),
                        size: u64::from(e.size),
                        kind: StackKind::Exception(e.name),
                        cpu,
                    });
                }
            }
            if let Some(top) = layout.irq_ptr.and_then(ptr) {
                // The pointer holds the top minus 8 (6.x) or the top itself:
                // either way the page boundary at or just above it is the top.
                let top = top.wrapping_add(8) & !0xfff;
                found.push(StackRange {
                    base: top.wrapping_sub(layout.irq_size),
                    size: layout.irq_size,
                    kind: StackKind::Irq,
                    cpu,
                });
            }
        }
        // One sort and one sweep per priority (no quadratic inserts).
        for pass in [true, false] {
            let mut batch: Vec<StackRange> = Vec::new();
            if batch.try_reserve(found.len()).is_err() {
                return map;
            }
            batch.extend(
                found
                    .iter()
                    .filter(|r| matches!(r.kind, StackKind::Exception(_)) == pass),
            );
            batch.sort_unstable_by_key(|r| r.base);
            for r in batch {
                map.add(r);
            }
        }
        map
    }

    /// `THREAD_SIZE`.
    pub fn thread_size(&self) -> u64 {
        self.thread_size
    }

    /// The per-CPU stacks known.
    pub fn per_cpu(&self) -> &[StackRange] {
        &self.special
    }

    /// The stack `addr` is on: a known per-CPU stack, else the task stack
    /// block that holds it.
    pub fn stack_of(&self, addr: u64) -> StackRange {
        let at = self.special.partition_point(|s| s.base <= addr);
        let before = at.checked_sub(1).and_then(|i| self.special.get(i));
        if let Some(&s) = before.filter(|s| s.contains(addr)) {
            return s;
        }
        StackRange {
            base: addr & !(self.thread_size - 1),
            size: self.thread_size,
            kind: StackKind::Task,
            cpu: None,
        }
    }

    /// The key of the stack `addr` is on: its base.
    pub fn key(&self, addr: u64) -> u64 {
        self.stack_of(addr).base
    }
}

/// The per-cpu offsets of the guest's possible CPUs: `__per_cpu_offset[0 ..
/// nr_cpu_ids]`, read through `view` (at most [`MAX_CPUS`]). Empty when the
/// kernel has no such symbols (a uniprocessor build) or they are
/// unreadable; the caller then uses the running CPU's GS base.
pub fn percpu_offsets<V: VirtMemory + ?Sized>(index: &SymbolIndex, view: &V) -> Vec<u64> {
    let (Some(arr), Some(nr)) = (
        index.addr_of("__per_cpu_offset"),
        index.addr_of("nr_cpu_ids"),
    ) else {
        return Vec::new();
    };
    let Ok(n) = read_array::<_, 4>(view, nr).map(u32::from_le_bytes) else {
        return Vec::new();
    };
    let n = n.min(MAX_CPUS);
    let mut out = Vec::new();
    if out.try_reserve(n as usize).is_err() {
        return Vec::new();
    }
    for i in 0..u64::from(n) {
        match read_array::<_, 8>(view, arr.wrapping_add(8 * i)) {
            Ok(b) => out.push(u64::from_le_bytes(b)),
            Err(_) => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const NMI_TOP: u64 = 0xfffffe0000010000;

    /// The 6.1 / 6.12 x86-64 layout (4 KiB guards, 8 KiB stacks), at a
    /// cea base where DF..MCE span several 16 KiB windows.
    fn cea_layout() -> StackLayout {
        StackLayout {
            thread_size: 16 * 1024,
            thread_size_source: Source::Kallsyms,
            irq_ptr: Some(0x2000),
            irq_size: 16 * 1024,
            exception_ptr: Some(0x1bca8),
            exception_stacks: default_exception_stacks(16 * 1024),
            exception_source: Source::Assumed,
        }
    }

    fn map_with(base: u64) -> StackMap {
        let mut m = StackMap::tasks_only(16 * 1024);
        for e in &cea_layout().exception_stacks {
            assert!(m.add(StackRange {
                base: base + u64::from(e.offset),
                size: u64::from(e.size),
                kind: StackKind::Exception(e.name),
                cpu: Some(0),
            }));
        }
        m
    }

    #[test]
    fn default_exception_layout_matches_the_kernels_struct() {
        // struct cea_exception_stacks as pahole prints it for 6.1 and 6.12.
        let l = default_exception_stacks(16 * 1024);
        let got: Vec<_> = l.iter().map(|e| (e.name, e.offset, e.size)).collect();
        assert_eq!(
            got,
            [
                ("DF", 4096, 8192),
                ("NMI", 16384, 8192),
                ("DB", 28672, 8192),
                ("MCE", 40960, 8192)
            ]
        );
    }

    #[test]
    fn exception_stacks_in_one_window_get_their_own_keys() {
        // NMI [16K, 24K) and the low half of DB [28K, 36K) share the 16 KiB
        // window [16K, 32K): a window key would make a #DB call nested over
        // NMI frames (or the reverse) drop the other's live frames.
        let base = NMI_TOP - 0x10000;
        let m = map_with(base);
        let nmi = base + 16384 + 100;
        let db_low = base + 28672 + 100;
        let db_high = base + 36864 - 8;
        assert_eq!(nmi & !0x3fff, db_low & !0x3fff, "the windows do collide");
        assert_ne!(m.key(nmi), m.key(db_low));
        assert_eq!(m.key(db_low), m.key(db_high), "one DB stack, one key");
        assert_eq!(m.stack_of(nmi).kind, StackKind::Exception("NMI"));
        assert_eq!(m.stack_of(db_high).kind, StackKind::Exception("DB"));
        // A guard page is no stack: keyed as the window (never a live
        // frame there anyway).
        assert_eq!(m.stack_of(base + 100).kind, StackKind::Task);
    }

    #[test]
    fn task_stacks_follow_the_guests_thread_size() {
        let m = StackMap::tasks_only(32 * 1024);
        // A KASAN kernel's 32 KiB stack: its two 16 KiB halves are one stack.
        let base = 0xffffc90000040000;
        assert_eq!(m.key(base + 0x100), base);
        assert_eq!(m.key(base + 0x7ff8), base);
        assert_eq!(
            StackMap::tasks_only(12345).thread_size(),
            DEFAULT_THREAD_SIZE
        );
    }

    #[test]
    fn overlapping_or_wrapping_ranges_are_refused() {
        let mut m = StackMap::tasks_only(16 * 1024);
        let r = |base, size| StackRange {
            base,
            size,
            kind: StackKind::Irq,
            cpu: Some(0),
        };
        assert!(m.add(r(0x10000, 0x4000)));
        assert!(!m.add(r(0x13000, 0x4000)), "overlaps the first");
        assert!(!m.add(r(0xe000, 0x4000)), "overlaps from below");
        assert!(!m.add(r(u64::MAX - 0xfff, 0x2000)), "wraps");
        assert!(!m.add(r(0x20000, 0)), "empty");
        assert!(m.add(r(0x14000, 0x4000)), "adjacent is fine");
        assert_eq!(m.per_cpu().len(), 2);
    }

    /// A view over a few words.
    struct Words(Vec<(u64, u64)>);
    impl VirtMemory for Words {
        fn read_virt(&self, gva: crate::Gva, buf: &mut [u8]) -> Result<(), crate::ViewError> {
            for (at, v) in &self.0 {
                if *at == gva.0 && buf.len() == 8 {
                    buf.copy_from_slice(&v.to_le_bytes());
                    return Ok(());
                }
            }
            Err(crate::ViewError::Unmapped { gva, resume: None })
        }
    }

    #[test]
    fn per_cpu_pointers_give_the_ranges() {
        let l = cea_layout();
        let pcpu = 0xffff88800f600000u64;
        let irq_top = 0xffffc90000004000u64;
        let cea = 0xfffffe0000001000u64;
        let view = Words(vec![(pcpu + 0x2000, irq_top - 8), (pcpu + 0x1bca8, cea)]);
        // CPU 1 is not up: its pointers are unreadable.
        let m = StackMap::read(&l, &view, &[pcpu, 0xffff88800f800000]);
        let irq = m.stack_of(irq_top - 8);
        assert_eq!(
            (irq.base, irq.size, irq.kind),
            (irq_top - 0x4000, 0x4000, StackKind::Irq)
        );
        assert_eq!(irq.cpu, Some(0));
        let nmi = m.stack_of(cea + 16384 + 8);
        assert_eq!(
            (nmi.base, nmi.kind),
            (cea + 16384, StackKind::Exception("NMI"))
        );
        assert_eq!(m.per_cpu().len(), 5);
        // A hostile pointer that makes the IRQ stack overlap the exception
        // stacks is refused, not merged.
        let view = Words(vec![
            (pcpu + 0x1bca8, cea),
            (pcpu + 0x2000, cea + 16384 + 0x1000),
        ]);
        let m = StackMap::read(&l, &view, &[pcpu]);
        assert_eq!(
            m.stack_of(cea + 16384 + 8).kind,
            StackKind::Exception("NMI")
        );
        assert_eq!(m.per_cpu().len(), 4);
    }
}
