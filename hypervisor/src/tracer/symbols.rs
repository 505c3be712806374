//! The guest's functions as the tracer's requests find them: the kernel
//! image's own (kallsyms) and the loaded modules' (each module's own
//! symbol table, as of the last walk of the module list).

use super::machine::KernelView;
use super::ReqError;
use alloc::format;
use alloc::string::{String, ToString};
use guest_introspect::fentry::{Classifier, FentrySite, NotTraceable};
use guest_introspect::kallsyms::SymbolId;
use guest_introspect::module::ModuleSymbolId;
use guest_introspect::view::VirtMemory;
use protocol::ErrorKind;
use tracelang::kprobe::{self, IndexSymbols};

/// A symbol of the kernel image or of a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SymRef {
    /// In kallsyms.
    Core(SymbolId),
    /// In a module's own table.
    Module(ModuleSymbolId),
}

impl SymRef {
    /// Its name, with ` [module]` after a module's, as `/proc/kallsyms`
    /// shows it.
    pub fn name(self, k: &dyn KernelView) -> String {
        match self {
            SymRef::Core(id) => k.index().name(id),
            SymRef::Module(id) => match k.modules().get(id) {
                Some((m, s)) => alloc::format!("{} [{}]", s.name, m.name),
                None => "?".to_string(),
            },
        }
    }

    /// Its fentry site, or why it has none.
    pub fn classify<V: VirtMemory + ?Sized>(
        self,
        k: &dyn KernelView,
        classifier: &Classifier<'_>,
        view: &V,
    ) -> Result<FentrySite, NotTraceable> {
        match self {
            SymRef::Core(id) => classifier.classify(view, id),
            SymRef::Module(id) => match k.modules().get(id) {
                Some((m, s)) => classifier.classify_module(view, m, s),
                None => Err(NotTraceable::NotText),
            },
        }
    }
}

/// The parts of a module glob `MOD:GLOB` (each a glob), as `[MOD:]SYM`
/// names a probe's function: it matches the functions named by `GLOB` in
/// the modules named by `MOD`, those loaded now and those that load later.
/// `None` for a plain glob.
pub fn module_glob(glob: &str) -> Option<(&str, &str)> {
    glob.split_once(':')
}

/// Why a glob cannot be used: an empty part of `MOD:GLOB`.
pub fn check_glob(glob: &str) -> Result<(), String> {
    match module_glob(glob) {
        Some((m, f)) if m.is_empty() || f.is_empty() || f.contains(':') => Err(alloc::format!(
            "{glob}: a module glob is MODULE:FUNCTION, both parts non-empty"
        )),
        _ => Ok(()),
    }
}

fn matches(glob: &str, name: &str) -> bool {
    guest_introspect::glob::matches(glob.as_bytes(), name.as_bytes())
}

/// The symbols whose name matches `glob`: for a plain glob the kernel
/// image's, then each loaded module's; for `MOD:GLOB`, the loaded modules'
/// named by `MOD` alone.
pub fn glob<'a>(k: &'a dyn KernelView, glob: &'a str) -> impl Iterator<Item = SymRef> + 'a {
    let (module, name) = match module_glob(glob) {
        Some((m, f)) => (Some(m), f),
        None => (None, glob),
    };
    module
        .is_none()
        .then(|| k.index().glob(name))
        .into_iter()
        .flatten()
        .map(SymRef::Core)
        .chain(
            k.modules()
                .kallsyms_order()
                .filter(move |(_, m, s)| {
                    module.is_none_or(|g| matches(g, &m.name)) && matches(name, &s.name)
                })
                .map(|(id, _, _)| SymRef::Module(id)),
        )
}

/// The symbols of the loaded module named `module` that `glob` matches: a
/// plain glob by name, `MOD:GLOB` when `MOD` also matches the module.
pub fn glob_in_module<'a>(
    k: &'a dyn KernelView,
    glob: &'a str,
    module: &'a str,
) -> impl Iterator<Item = SymRef> + 'a {
    let (wanted, name) = match module_glob(glob) {
        Some((m, f)) => (matches(m, module), f),
        None => (true, glob),
    };
    k.modules()
        .kallsyms_order()
        .filter(move |(_, m, s)| wanted && m.name == module && matches(name, &s.name))
        .map(|(id, _, _)| SymRef::Module(id))
}

/// The function a probe names: `symbol` in `module` when one is named (a
/// module that is not loaded is an error here), else the kernel image's
/// first `symbol`, else the first loaded module's, as the kernel's own
/// name lookup goes.
pub fn lookup(k: &dyn KernelView, module: Option<&str>, symbol: &str) -> Result<SymRef, String> {
    match module {
        Some(m) => {
            if k.modules().module(m).is_none() {
                return Err(alloc::format!("module {m} is not loaded"));
            }
            k.modules()
                .lookup(Some(m), symbol)
                .map(SymRef::Module)
                .ok_or_else(|| alloc::format!("function {symbol} is not in module {m}'s symbols"))
        }
        None => k
            .index()
            .lookup(symbol)
            .map(SymRef::Core)
            .or_else(|| k.modules().lookup(None, symbol).map(SymRef::Module))
            .ok_or_else(|| {
                alloc::format!(
                    "function {symbol} is not in the guest's kallsyms nor in a loaded module"
                )
            }),
    }
}

/// Resolves the `@SYM` bases of `spec`'s fetch arguments in the guest's
/// symbols, as the kernel does when it registers a probe.
pub(super) fn resolve_fetch_symbols(
    spec: &mut kprobe::ProbeSpec,
    k: &dyn KernelView,
) -> Result<(), ReqError> {
    let syms = IndexSymbols::new(k.index(), Some(k.modules()));
    spec.resolve_symbols(&syms).map_err(|name| {
        ReqError::new(
            ErrorKind::NotFound,
            format!("symbol {name} is not in the guest's kallsyms"),
        )
    })
}
