//! The probe language's BTF arguments (`file->f_path.dentry`, `$arg*`,
//! a typed `$retval`, `%pd`), resolved once, when a probe or a histogram
//! is added, against the running guest's BTF: the kernel's, walked at
//! recovery, or for a module's function the module's own split BTF over
//! it. A hit then runs the plain fetch chain the resolution produced.

use super::machine::{Env, KernelView};
use super::symbols::{self, SymRef};
use super::ReqError;
use crate::guest_phys::GuestDoor;
use alloc::format;
use guest_introspect::btf::typed::module_btf;
use guest_introspect::btf::{Btf, BtfError};
use guest_introspect::view::PagedView;
use guest_introspect::Gva;
use protocol::ErrorKind;
use tracelang::kprobe::{self, ProbeSpec};

/// Resolves the BTF arguments of `spec`, whose text is `text` (for the
/// caret of an error). Nothing to do for a spec without any.
pub(super) fn resolve(
    spec: &mut ProbeSpec,
    text: &str,
    k: &dyn KernelView,
    env: &Env<'_>,
) -> Result<(), ReqError> {
    if !kprobe::needs_btf(spec) {
        return Ok(());
    }
    let view = PagedView::new(env.ram, k.cr3());
    let refused = |e: kprobe::ParseError| ReqError::new(ErrorKind::InvalidArgument, e.report(text));
    // Without the BTF it needs: an argument BTF only refines stays plain,
    // any other is refused.
    let without = |spec: &mut ProbeSpec, e: BtfError| {
        kprobe::resolve_btf::<PagedView<'_, dyn GuestDoor>>(spec, Err(e)).map_err(refused)
    };
    let index = match k.btf() {
        Ok(i) => i,
        Err(e) => return without(spec, e),
    };
    let base = Btf::from_index(&view, index);
    let Some((name, module)) = module_of(spec, k) else {
        return kprobe::resolve_btf(spec, Ok(&base)).map_err(refused);
    };
    // A module's function: its prototype is in the module's own BTF.
    let blob = match k.index().addr_of("btf_modules") {
        Some(list) => module_btf(&view, &base, list, module),
        None => Err(BtfError::NoType("btf_modules")),
    };
    let range = match blob {
        Ok(Some(r)) => r,
        Ok(None) => {
            return Err(ReqError::new(
                ErrorKind::InvalidArgument,
                format!(
                    "module {name} has no BTF (its kernel lacks CONFIG_DEBUG_INFO_BTF_MODULES), \
                     so no BTF arguments on {}",
                    spec.symbol
                ),
            ))
        }
        Err(e) => return without(spec, e),
    };
    match Btf::parse_split(&view, &base, range.start, Some(range)) {
        Ok(split) => kprobe::resolve_btf(spec, Ok(&split)).map_err(refused),
        Err(e) => without(spec, e),
    }
}

/// The module `spec`'s function is in (its name and `struct module`), or
/// `None` for the kernel's own.
fn module_of(spec: &ProbeSpec, k: &dyn KernelView) -> Option<(alloc::string::String, Gva)> {
    match symbols::lookup(k, spec.module.as_deref(), &spec.symbol).ok()? {
        SymRef::Core(_) => None,
        SymRef::Module(id) => k.modules().get(id).map(|(m, _)| (m.name.clone(), m.addr)),
    }
}
