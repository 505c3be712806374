//! The guest's recovered kallsyms as the probes' [`SymbolResolver`].

use alloc::borrow::Cow;

use guest_introspect::addr::Gva;
use guest_introspect::kallsyms::SymbolIndex;

use super::fetch::{SymbolAt, SymbolResolver};

/// Resolves names and addresses through a [`SymbolIndex`] built from the
/// guest's memory.
#[derive(Clone, Copy)]
pub struct IndexSymbols<'a>(pub &'a SymbolIndex);

impl SymbolResolver for IndexSymbols<'_> {
    fn lookup(&self, name: &str) -> Option<Gva> {
        self.0.addr_of(name)
    }

    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
        let r = self.0.resolve(addr)?;
        Some(SymbolAt {
            name: Cow::Owned(self.0.name(r.id)),
            offset: r.offset,
            size: r.size.unwrap_or(0),
            module: None,
        })
    }
}
