//! Tests over the real kernel images: Debian's stock 6.1 (stripped, with BTF)
//! and the fast-lane 6.12 (full symbols, no BTF). The images come from the
//! project's guest scripts; a failing script fails the test.

#[path = "../common/mod.rs"]
mod common;

mod budget;
mod facts;
mod fentry;
mod guest_path;
mod kallsyms;
mod malformed;
mod stacks;
mod syscall_abi;
mod syscall_structs;
mod syscalls;

use std::sync::OnceLock;

use guest_introspect::kallsyms::{locate, KallsymsTables, LocateStats, SymbolIndex};
use guest_introspect::GvaRange;

/// Tables and index recovered from an image's unslid view, computed once per
/// test binary.
pub struct Recovered {
    pub tables: KallsymsTables,
    pub stats: LocateStats,
    pub index: SymbolIndex,
}

fn recover(img: &common::Image) -> Recovered {
    let view = img.view();
    let ranges: Vec<GvaRange> = view.ranges().collect();
    let mut stats = LocateStats::default();
    let tables =
        locate(&view, &ranges, &mut stats).unwrap_or_else(|e| panic!("{}: {e}", img.release));
    let index =
        SymbolIndex::build(&view, &tables).unwrap_or_else(|e| panic!("{}: {e}", img.release));
    Recovered {
        tables,
        stats,
        index,
    }
}

pub fn fast() -> &'static Recovered {
    static R: OnceLock<Recovered> = OnceLock::new();
    R.get_or_init(|| recover(common::fast()))
}

pub fn debian() -> &'static Recovered {
    static R: OnceLock<Recovered> = OnceLock::new();
    R.get_or_init(|| recover(common::debian()))
}
