//! The guest's recovered kallsyms, and its loaded modules' symbols, as the
//! probes' [`SymbolResolver`].

use alloc::borrow::Cow;

use guest_introspect::addr::Gva;
use guest_introspect::kallsyms::SymbolIndex;
use guest_introspect::module::ModuleIndex;

use super::fetch::{SymbolAt, SymbolResolver};

/// Resolves names and addresses through a [`SymbolIndex`] built from the
/// guest's memory and, when given, the modules' symbols.
#[derive(Clone, Copy)]
pub struct IndexSymbols<'a> {
    index: &'a SymbolIndex,
    modules: Option<&'a ModuleIndex>,
}

impl<'a> IndexSymbols<'a> {
    /// Over the kernel image's symbols and the modules'.
    pub fn new(index: &'a SymbolIndex, modules: Option<&'a ModuleIndex>) -> Self {
        Self { index, modules }
    }
}

impl SymbolResolver for IndexSymbols<'_> {
    fn lookup(&self, name: &str) -> Option<Gva> {
        self.index.addr_of(name).or_else(|| {
            let id = self.modules?.lookup(None, name)?;
            self.modules?.get(id).map(|(_, s)| Gva(s.addr))
        })
    }

    fn symbolize(&self, addr: Gva) -> Option<SymbolAt<'_>> {
        // Module text first: the kernel image's last symbol would
        // otherwise claim every address above it.
        if let Some(r) = self.modules.and_then(|m| m.resolve(addr)) {
            return Some(SymbolAt {
                name: Cow::Borrowed(r.name),
                offset: r.offset,
                size: r.size,
                module: Some(Cow::Borrowed(r.module)),
            });
        }
        let r = self.index.resolve(addr)?;
        Some(SymbolAt {
            name: Cow::Owned(self.index.name(r.id)),
            offset: r.offset,
            size: r.size.unwrap_or(0),
            module: None,
        })
    }
}
