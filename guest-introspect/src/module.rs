//! Loadable modules as the kernel keeps them: what root needs of
//! `struct module` to walk the `modules` list, find each module's code and
//! read its own kallsyms, with every offset from the guest's BTF.
//!
//! Two layouts of a module's memory exist:
//! - up to 6.3, `core_layout` and `init_layout` (`struct module_layout`:
//!   `base`, `size`, `text_size`, ...), the text at the start of each;
//! - from 6.4, `mem[MOD_MEM_NUM_TYPES]` (`struct module_memory`: `base`,
//!   `size`, ...), indexed by `enum mod_mem_type` (`MOD_TEXT`,
//!   `MOD_INIT_TEXT`, ...).
//!
//! Which one a kernel has, and every offset and index, come from its BTF;
//! nothing here assumes a version's numbers.

use crate::btf::{Btf, BtfError, Kind};
use crate::budget::{block_on, Budget, Metered};
use crate::fallible::OutOfMemory;
use crate::view::{read_array, PageCache, ViewError, VirtMemory};
use crate::{Gva, GvaRange};
use alloc::string::String;
use alloc::vec::Vec;

/// What root reads of `struct module`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleLayout {
    /// `sizeof(struct module)`.
    pub size: u32,
    /// Byte offset of `state` (a 4-byte `enum module_state`).
    pub state: u32,
    /// Byte offset of `list` (a `struct list_head`: `next`, then `prev`).
    pub list: u32,
    /// Byte offset of `name` (a NUL-terminated `char` array).
    pub name: u32,
    /// Its length (`MODULE_NAME_LEN`).
    pub name_len: u32,
    /// Where its code and data are.
    pub memory: ModuleMemory,
    /// Byte offset of `kallsyms` (a `struct mod_kallsyms *`), and that
    /// struct's layout; `None` without `CONFIG_KALLSYMS`.
    pub kallsyms: Option<(u32, ModKallsyms)>,
    /// `enum module_state`'s values.
    pub states: ModuleStates,
}

/// Where a module's memory is described.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleMemory {
    /// Up to 6.3: two `struct module_layout`s.
    Layouts {
        /// Byte offset of `core_layout`.
        core: u32,
        /// Byte offset of `init_layout`.
        init: u32,
        /// Byte offset of `base` (a pointer) in `struct module_layout`.
        base: u32,
        /// Byte offset of `size` (4-byte).
        size: u32,
        /// Byte offset of `text_size` (4-byte; the text starts at `base`).
        text_size: u32,
    },
    /// From 6.4: an array of `struct module_memory`.
    Regions {
        /// Byte offset of `mem`.
        mem: u32,
        /// Its elements (`MOD_MEM_NUM_TYPES`).
        count: u32,
        /// `sizeof(struct module_memory)`.
        stride: u32,
        /// Byte offset of `base` (a pointer) in `struct module_memory`.
        base: u32,
        /// Byte offset of `size` (4-byte).
        size: u32,
        /// Index of the text region (`MOD_TEXT`).
        text: u32,
        /// Index of the init text region (`MOD_INIT_TEXT`).
        init_text: u32,
    },
}

/// `struct mod_kallsyms`: a module's own symbol table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModKallsyms {
    /// Byte offset of `symtab` (an `Elf64_Sym *`).
    pub symtab: u32,
    /// Byte offset of `num_symtab` (an unsigned int).
    pub num_symtab: u32,
    /// Byte offset of `strtab` (a `char *`).
    pub strtab: u32,
    /// Byte offset of `typetab` (a `char *`: each symbol's `nm` type),
    /// where the kernel has it.
    pub typetab: Option<u32>,
}

/// `enum module_state`'s values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleStates {
    /// `MODULE_STATE_LIVE`: initialized.
    pub live: i64,
    /// `MODULE_STATE_COMING`: loaded, its init about to run.
    pub coming: i64,
    /// `MODULE_STATE_GOING`: being removed (or its init failed).
    pub going: i64,
    /// `MODULE_STATE_UNFORMED`: still being set up.
    pub unformed: i64,
}

/// The layout of `struct module` in the kernel whose BTF is `btf`.
pub fn module_layout<V: VirtMemory + ?Sized>(btf: &Btf<'_, V>) -> Result<ModuleLayout, BtfError> {
    block_on(module_layout_paced(btf, &Budget::unlimited()))
}

/// Checks that member `name` of `outer` resolves to `kind`; its offset.
async fn typed<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    outer: &crate::btf::TypeInfo,
    name: &'static str,
    kind: Kind,
    pace: &Budget,
) -> Result<u32, BtfError> {
    let m = btf.member_paced(outer, name, pace).await?;
    if btf.resolve_paced(m.type_id, pace).await?.kind != kind {
        return Err(BtfError::UnexpectedType(name));
    }
    m.byte_offset().ok_or(BtfError::UnexpectedType(name))
}

/// [`module_layout`], pausing on `pace` between steps.
pub async fn module_layout_paced<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    pace: &Budget,
) -> Result<ModuleLayout, BtfError> {
    let module = btf.find_paced(Kind::Struct, "module", pace).await?;
    let state = btf.member_paced(&module, "state", pace).await?;
    let state_t = btf.resolve_paced(state.type_id, pace).await?;
    if state_t.kind != Kind::Enum || state_t.size_or_type != 4 {
        return Err(BtfError::UnexpectedType("state"));
    }
    let states = ModuleStates {
        live: btf.enumerator(&state_t, "MODULE_STATE_LIVE")?,
        coming: btf.enumerator(&state_t, "MODULE_STATE_COMING")?,
        going: btf.enumerator(&state_t, "MODULE_STATE_GOING")?,
        unformed: btf.enumerator(&state_t, "MODULE_STATE_UNFORMED")?,
    };
    let list = typed(btf, &module, "list", Kind::Struct, pace).await?;
    let name = btf.member_paced(&module, "name", pace).await?;
    let name_t = btf.resolve_paced(name.type_id, pace).await?;
    let (elem, name_len) = btf.array(&name_t)?;
    let elem = btf.resolve_paced(elem, pace).await?;
    if elem.kind != Kind::Int || elem.size_or_type != 1 || name_len == 0 {
        return Err(BtfError::UnexpectedType("name"));
    }
    let memory = match btf.member_paced(&module, "mem", pace).await {
        Ok(mem) => {
            let mem_t = btf.resolve_paced(mem.type_id, pace).await?;
            let (elem, count) = btf.array(&mem_t)?;
            let elem = btf.resolve_paced(elem, pace).await?;
            if elem.kind != Kind::Struct || count == 0 {
                return Err(BtfError::UnexpectedType("mem"));
            }
            let kinds = btf.find_paced(Kind::Enum, "mod_mem_type", pace).await?;
            let index = |name| -> Result<u32, BtfError> {
                let v = btf.enumerator(&kinds, name)?;
                u32::try_from(v)
                    .ok()
                    .filter(|&i| i < count)
                    .ok_or(BtfError::UnexpectedType(name))
            };
            ModuleMemory::Regions {
                mem: mem.byte_offset().ok_or(BtfError::UnexpectedType("mem"))?,
                count,
                stride: elem.size_or_type,
                base: typed(btf, &elem, "base", Kind::Ptr, pace).await?,
                size: typed(btf, &elem, "size", Kind::Int, pace).await?,
                text: index("MOD_TEXT")?,
                init_text: index("MOD_INIT_TEXT")?,
            }
        }
        Err(BtfError::NoMember(_)) => {
            let core = btf.member_paced(&module, "core_layout", pace).await?;
            let layout = btf.resolve_paced(core.type_id, pace).await?;
            if layout.kind != Kind::Struct {
                return Err(BtfError::UnexpectedType("core_layout"));
            }
            ModuleMemory::Layouts {
                core: core
                    .byte_offset()
                    .ok_or(BtfError::UnexpectedType("core_layout"))?,
                init: typed(btf, &module, "init_layout", Kind::Struct, pace).await?,
                base: typed(btf, &layout, "base", Kind::Ptr, pace).await?,
                size: typed(btf, &layout, "size", Kind::Int, pace).await?,
                text_size: typed(btf, &layout, "text_size", Kind::Int, pace).await?,
            }
        }
        Err(e) => return Err(e),
    };
    let kallsyms = match btf.member_paced(&module, "kallsyms", pace).await {
        Ok(m) => {
            let at = m
                .byte_offset()
                .ok_or(BtfError::UnexpectedType("kallsyms"))?;
            let ptr = btf.resolve_paced(m.type_id, pace).await?;
            if ptr.kind != Kind::Ptr {
                return Err(BtfError::UnexpectedType("kallsyms"));
            }
            let ks = btf.resolve_paced(ptr.size_or_type, pace).await?;
            if ks.kind != Kind::Struct {
                return Err(BtfError::UnexpectedType("mod_kallsyms"));
            }
            let typetab = match typed(btf, &ks, "typetab", Kind::Ptr, pace).await {
                Ok(o) => Some(o),
                Err(BtfError::NoMember(_)) => None,
                Err(e) => return Err(e),
            };
            Some((
                at,
                ModKallsyms {
                    symtab: typed(btf, &ks, "symtab", Kind::Ptr, pace).await?,
                    num_symtab: typed(btf, &ks, "num_symtab", Kind::Int, pace).await?,
                    strtab: typed(btf, &ks, "strtab", Kind::Ptr, pace).await?,
                    typetab,
                },
            ))
        }
        Err(BtfError::NoMember(_)) => None,
        Err(e) => return Err(e),
    };
    Ok(ModuleLayout {
        size: module.size_or_type,
        state: state
            .byte_offset()
            .ok_or(BtfError::UnexpectedType("state"))?,
        list,
        name: name.byte_offset().ok_or(BtfError::UnexpectedType("name"))?,
        name_len,
        memory,
        kallsyms,
        states,
    })
}

/// Modules walked at most (a list that does not come back to its head
/// within this many is refused: a cycle, or a guest in the middle of
/// changing it).
pub const MAX_MODULES: usize = 4096;
/// Symbols read per module at most.
pub const MAX_MODULE_SYMBOLS: u32 = 1 << 18;
/// Symbol table entries one walk reads at most, over all its modules (a
/// rewalk's kept symbols count as read): a quarter of a million, as many
/// as one module may have. A list whose tables claim more is refused
/// ([`ModuleError::TooManyWalkSymbols`]) before the table that would pass
/// the cap is read.
pub const MAX_WALK_SYMBOLS: u32 = 1 << 18;
/// Work units one walk of the module list may spend
/// ([`walk_modules_budgeted`]): every read the walk makes is charged
/// ([`crate::budget::read_cost`]), cached or not, and so is every page the
/// cache reads underneath. A named symbol costs some 300 units (three
/// reads and its share of the pages), so the budget stops a walk at about
/// 220,000 of them; nameless entries (two reads) cost less, and
/// [`MAX_WALK_SYMBOLS`] stops those first.
pub const MODULE_WALK_BUDGET: u64 = 64 << 20;
/// Bytes of a symbol name at most (`KSYM_NAME_LEN`).
pub const MAX_SYMBOL_NAME: usize = 512;
/// `sizeof(Elf64_Sym)`: `st_name` (u32), `st_info`, `st_other` (u8),
/// `st_shndx` (u16), `st_value`, `st_size` (u64).
const ELF64_SYM: u64 = 24;

/// A loaded module, as read from guest memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Module {
    /// Its `struct module`.
    pub addr: Gva,
    /// Its name.
    pub name: String,
    /// Its `state` (see [`ModuleStates`]).
    pub state: i64,
    /// Its core text (empty when it has none).
    pub text: GvaRange,
    /// Its init text (empty once freed, or when it has none).
    pub init_text: GvaRange,
    /// Its own symbols, as `/proc/kallsyms` lists them: named, in symtab
    /// order.
    pub symbols: Vec<ModuleSymbol>,
}

/// A module's symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleSymbol {
    /// Its address (`st_value`).
    pub addr: u64,
    /// Its `nm` type (`t`, `T`, `d`, ...; `?` without a type table).
    pub kind: u8,
    /// Its name.
    pub name: String,
}

/// Why the module list could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleError {
    /// A read of guest memory failed at this address.
    Read(Gva),
    /// The list did not come back to its head within [`MAX_MODULES`].
    TooLong,
    /// A module claims more symbols than [`MAX_MODULE_SYMBOLS`].
    TooManySymbols(u32),
    /// The modules' tables claim more symbols than [`MAX_WALK_SYMBOLS`]
    /// in all (the total they claim, up to the module that passed it).
    TooManyWalkSymbols(u64),
    /// The walk's work budget is spent ([`walk_modules_budgeted`]).
    OverBudget,
    /// The heap refused the walk's memory.
    OutOfMemory(OutOfMemory),
}

impl From<OutOfMemory> for ModuleError {
    fn from(e: OutOfMemory) -> Self {
        ModuleError::OutOfMemory(e)
    }
}

impl core::fmt::Display for ModuleError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Read(at) => write!(f, "module list: unreadable guest memory at {:#x}", at.0),
            Self::TooLong => write!(
                f,
                "module list: no way back to its head within {MAX_MODULES} modules"
            ),
            Self::TooManySymbols(n) => write!(f, "a module claims {n} symbols"),
            Self::TooManyWalkSymbols(n) => write!(
                f,
                "module list: the modules claim {n} symbols, more than the {MAX_WALK_SYMBOLS} a walk reads"
            ),
            Self::OverBudget => write!(
                f,
                "module list: the walk spent its work budget before the end of the list"
            ),
            Self::OutOfMemory(e) => write!(f, "module list: out of memory ({} bytes)", e.bytes),
        }
    }
}

/// Adds `n` symbol table entries to a walk's count: refused past
/// [`MAX_WALK_SYMBOLS`].
fn count_entries(entries: &mut u64, n: usize) -> Result<(), ModuleError> {
    *entries = entries.saturating_add(n as u64);
    if *entries > u64::from(MAX_WALK_SYMBOLS) {
        return Err(ModuleError::TooManyWalkSymbols(*entries));
    }
    Ok(())
}

/// The walk's error for a failed read at `at`: a spent budget is not
/// unreadable memory.
fn read_error(e: ViewError, at: u64) -> ModuleError {
    match e {
        ViewError::OverBudget { .. } => ModuleError::OverBudget,
        _ => ModuleError::Read(Gva(at)),
    }
}

/// Reads `N` bytes at `at`.
fn read<V: VirtMemory + ?Sized, const N: usize>(view: &V, at: u64) -> Result<[u8; N], ModuleError> {
    read_array::<V, N>(view, Gva(at)).map_err(|e| read_error(e, at))
}

fn u64_at<V: VirtMemory + ?Sized>(view: &V, at: u64) -> Result<u64, ModuleError> {
    read::<V, 8>(view, at).map(u64::from_le_bytes)
}

fn u32_at<V: VirtMemory + ?Sized>(view: &V, at: u64) -> Result<u32, ModuleError> {
    read::<V, 4>(view, at).map(u32::from_le_bytes)
}

/// A NUL-terminated string of at most `max` bytes at `at` (cut there when
/// it has no NUL), read in small pieces so that a string ending just
/// before an unmapped page reads whole.
fn c_string<V: VirtMemory + ?Sized>(view: &V, at: u64, max: usize) -> Result<String, ModuleError> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 32];
    while out.len() < max {
        let addr = at.wrapping_add(out.len() as u64);
        // Up to the end of the page, 32 bytes at most.
        let room = (0x1000 - (addr & 0xfff)).min(32) as usize;
        let piece = chunk
            .get_mut(..room.min(max - out.len()))
            .ok_or(ModuleError::Read(Gva(addr)))?;
        view.read_virt(Gva(addr), piece)
            .map_err(|e| read_error(e, addr))?;
        let end = piece.iter().position(|&b| b == 0);
        let take = end.unwrap_or(piece.len());
        crate::fallible::try_reserve(&mut out, take)?;
        out.extend_from_slice(piece.get(..take).unwrap_or_default());
        if end.is_some() {
            break;
        }
    }
    // Kernel and module names are ASCII: anything else becomes `?` in
    // place, so the bytes become the string without another allocation.
    for b in &mut out {
        if !b.is_ascii() {
            *b = b'?';
        }
    }
    Ok(String::from_utf8(out).unwrap_or_default())
}

impl ModuleLayout {
    /// The core and init text of the module at `m`.
    fn text<V: VirtMemory + ?Sized>(
        &self,
        view: &V,
        m: u64,
    ) -> Result<(GvaRange, GvaRange), ModuleError> {
        let range = |base: u64, len: u64| GvaRange::with_len(Gva(base), len);
        Ok(match self.memory {
            ModuleMemory::Layouts {
                core,
                init,
                base,
                text_size,
                ..
            } => {
                let at = |l: u32, f: u32| m.wrapping_add(u64::from(l) + u64::from(f));
                (
                    range(
                        u64_at(view, at(core, base))?,
                        u64::from(u32_at(view, at(core, text_size))?),
                    ),
                    range(
                        u64_at(view, at(init, base))?,
                        u64::from(u32_at(view, at(init, text_size))?),
                    ),
                )
            }
            ModuleMemory::Regions {
                mem,
                stride,
                base,
                size,
                text,
                init_text,
                ..
            } => {
                let at = |i: u32, f: u32| {
                    m.wrapping_add(u64::from(mem) + u64::from(i) * u64::from(stride) + u64::from(f))
                };
                (
                    range(
                        u64_at(view, at(text, base))?,
                        u64::from(u32_at(view, at(text, size))?),
                    ),
                    range(
                        u64_at(view, at(init_text, base))?,
                        u64::from(u32_at(view, at(init_text, size))?),
                    ),
                )
            }
        })
    }

    /// The named symbols of the module at `m`, from its `mod_kallsyms`.
    fn symbols<V: VirtMemory + ?Sized>(
        &self,
        view: &V,
        m: u64,
        charge: &mut impl FnMut(usize) -> Result<(), ModuleError>,
        entries: &mut u64,
    ) -> Result<Vec<ModuleSymbol>, ModuleError> {
        let mut out = Vec::new();
        let Some((at, ks)) = self.kallsyms else {
            return Ok(out);
        };
        let p = u64_at(view, m.wrapping_add(u64::from(at)))?;
        if p == 0 {
            return Ok(out);
        }
        let field = |f: u32| p.wrapping_add(u64::from(f));
        let symtab = u64_at(view, field(ks.symtab))?;
        let n = u32_at(view, field(ks.num_symtab))?;
        let strtab = u64_at(view, field(ks.strtab))?;
        let typetab = match ks.typetab {
            Some(t) => Some(u64_at(view, field(t))?),
            None => None,
        };
        if n > MAX_MODULE_SYMBOLS {
            return Err(ModuleError::TooManySymbols(n));
        }
        count_entries(entries, n as usize)?;
        for i in 0..u64::from(n) {
            let sym = read::<V, 24>(view, symtab.wrapping_add(i * ELF64_SYM))?;
            let word = |o: usize| {
                sym.get(o..o + 8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u64::from_le_bytes)
            };
            let st_name = word(0) as u32;
            let name = c_string(
                view,
                strtab.wrapping_add(u64::from(st_name)),
                MAX_SYMBOL_NAME,
            )?;
            if name.is_empty() {
                continue;
            }
            charge(core::mem::size_of::<ModuleSymbol>() + name.len())?;
            let kind = match typetab {
                Some(t) => read::<V, 1>(view, t.wrapping_add(i))?[0],
                None => b'?',
            };
            crate::fallible::try_push(
                &mut out,
                ModuleSymbol {
                    addr: word(8),
                    kind,
                    name,
                },
            )?;
        }
        Ok(out)
    }
}

/// The modules on the kernel's `modules` list, whose head is at `head`, in
/// list order (the most recently loaded first, as the kernel adds them at
/// the head). A module still being set up (`MODULE_STATE_UNFORMED`) is
/// listed with its name and state only: its memory is not settled yet.
/// At most [`MAX_MODULES`] modules and [`MAX_WALK_SYMBOLS`] symbol table
/// entries in all are read; a list that claims more is an error.
pub fn walk_modules<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    head: Gva,
) -> Result<Vec<Module>, ModuleError> {
    walk_modules_limited(view, layout, head, usize::MAX)
}

/// [`walk_modules`], refusing (as out of memory) a walk whose modules and
/// symbols would take more than `max_bytes` of heap: the counts and names
/// are the guest's.
pub fn walk_modules_limited<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    head: Gva,
    max_bytes: usize,
) -> Result<Vec<Module>, ModuleError> {
    walk(view, layout, head, max_bytes, Vec::new(), None)
}

/// [`walk_modules_limited`] at a module's load, reusing the symbols of an
/// earlier walk's modules (`old`) that are unchanged: same `struct
/// module` address, name, state and text. The module at `loading` is
/// always read in full. Each module's header is still read, so the list
/// order and every module's state are the kernel's now; only the symbol
/// tables of unchanged modules are not read again (a module's symbols
/// change only with its state: from all of them while it is coming to its
/// core ones once live).
///
/// Only for a caller that sees every load (then a module unloaded and
/// loaded again at the same place since the earlier walk was read at that
/// load): a module's text and header alone do not prove its symbols.
pub fn rewalk_modules_at_load<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    head: Gva,
    max_bytes: usize,
    old: Vec<Module>,
    loading: Gva,
) -> Result<Vec<Module>, ModuleError> {
    walk(view, layout, head, max_bytes, old, Some(loading))
}

/// The walk root makes: [`walk_modules_limited`], or
/// [`rewalk_modules_at_load`] when `loading` is given, through a
/// [`PageCache`] (whole pages, kept, cost one page walk each), charging
/// `budget` for every read the walk makes, whether the cache has its page
/// or not, and for every page the cache reads: a list that keeps hitting
/// a few cached pages pays for its reads all the same. The walk fails with
/// [`ModuleError::OverBudget`] once the budget is spent.
pub fn walk_modules_budgeted<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    head: Gva,
    max_bytes: usize,
    old: Vec<Module>,
    loading: Option<Gva>,
    budget: &Budget,
) -> Result<Vec<Module>, ModuleError> {
    // Charged twice over: below the cache for the pages it reads, above
    // it for every read the walk makes.
    let pages = Metered::new(view, budget);
    let cached = PageCache::new(&pages);
    let reads = Metered::new(&cached, budget);
    walk(&reads, layout, head, max_bytes, old, loading)
}

fn walk<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    head: Gva,
    max_bytes: usize,
    mut old: Vec<Module>,
    loading: Option<Gva>,
) -> Result<Vec<Module>, ModuleError> {
    let mut out = Vec::new();
    let mut used = 0usize;
    let mut charge = |bytes: usize| -> Result<(), ModuleError> {
        used = used.saturating_add(bytes);
        if used > max_bytes {
            return Err(ModuleError::OutOfMemory(OutOfMemory { bytes: used }));
        }
        Ok(())
    };
    // Symbol table entries read (or kept) so far, over all modules.
    let mut entries = 0u64;
    let mut next = u64_at(view, head.0)?;
    while next != head.0 {
        if out.len() >= MAX_MODULES {
            return Err(ModuleError::TooLong);
        }
        let m = next.wrapping_sub(u64::from(layout.list));
        charge(core::mem::size_of::<Module>() + layout.name_len as usize)?;
        let name = c_string(
            view,
            m.wrapping_add(u64::from(layout.name)),
            layout.name_len as usize,
        )?;
        let state = i64::from(u32_at(view, m.wrapping_add(u64::from(layout.state)))? as i32);
        let (text, init_text, symbols) = if state == layout.states.unformed {
            let none = GvaRange::new(Gva(0), Gva(0));
            (none, none, Vec::new())
        } else {
            let (t, i) = layout.text(view, m)?;
            let same = |o: &Module| {
                o.addr.0 == m
                    && o.name == name
                    && o.state == state
                    && o.text == t
                    && o.init_text == i
            };
            let symbols = match old.iter().position(same) {
                Some(at) if loading.is_some_and(|l| l.0 != m) => {
                    let o = old.swap_remove(at);
                    count_entries(&mut entries, o.symbols.len())?;
                    let bytes = o.symbols.capacity() * core::mem::size_of::<ModuleSymbol>()
                        + o.symbols.iter().map(|s| s.name.capacity()).sum::<usize>();
                    charge(bytes)?;
                    o.symbols
                }
                _ => layout.symbols(view, m, &mut charge, &mut entries)?,
            };
            (t, i, symbols)
        };
        crate::fallible::try_push(
            &mut out,
            Module {
                addr: Gva(m),
                name,
                state,
                text,
                init_text,
                symbols,
            },
        )?;
        next = u64_at(view, next)?;
    }
    Ok(out)
}

/// The core and init text of the module whose `struct module` is at `m`,
/// read now (for a module that is going, whatever the list shows).
pub fn module_text<V: VirtMemory + ?Sized>(
    view: &V,
    layout: &ModuleLayout,
    m: Gva,
) -> Result<(GvaRange, GvaRange), ModuleError> {
    layout.text(view, m.0)
}

/// Whether an `nm` type letter is a function's (`t`, `T`, `w`, `W`).
pub fn is_code_letter(kind: u8) -> bool {
    matches!(kind, b't' | b'T' | b'w' | b'W')
}

/// A module symbol by position: its module's index in [`ModuleIndex`]'s
/// list and its own in that module's symbols.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ModuleSymbolId {
    /// Index of the module.
    pub module: u32,
    /// Index of the symbol in the module's symbols.
    pub symbol: u32,
}

/// An address inside a module's text, resolved as `%pS` would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleResolved<'a> {
    /// The module's name.
    pub module: &'a str,
    /// The closest symbol at or before the address.
    pub name: &'a str,
    /// The symbol's address.
    pub addr: u64,
    /// Bytes from the symbol to the address.
    pub offset: u64,
    /// Bytes to the next symbol, or to the end of the text.
    pub size: u64,
}

/// The loaded modules as of one walk of the `modules` list, with their
/// symbols in `/proc/kallsyms` order and an address-sorted table of their
/// functions for lookups from a return address or a site.
#[derive(Clone, Debug, Default)]
pub struct ModuleIndex {
    modules: Vec<Module>,
    /// The kernel's module state values.
    states: ModuleStates,
    /// Functions in module text, sorted by address.
    by_addr: Vec<(u64, ModuleSymbolId)>,
    /// Heap the index takes.
    bytes: usize,
}

impl ModuleIndex {
    /// The modules, taken out of the index (for
    /// [`rewalk_modules_at_load`]).
    pub fn into_modules(self) -> Vec<Module> {
        self.modules
    }

    /// Indexes the modules of a walk (in list order); fails only when the
    /// heap refuses the address table.
    pub fn new(modules: Vec<Module>, states: ModuleStates) -> Result<Self, OutOfMemory> {
        let mut by_addr = Vec::new();
        let n: usize = modules
            .iter()
            .map(|m| m.symbols.iter().filter(|s| is_code_letter(s.kind)).count())
            .sum();
        crate::fallible::try_reserve(&mut by_addr, n)?;
        let mut bytes = modules.capacity() * core::mem::size_of::<Module>();
        for (mi, m) in modules.iter().enumerate() {
            bytes +=
                m.name.capacity() + m.symbols.capacity() * core::mem::size_of::<ModuleSymbol>();
            for (si, s) in m.symbols.iter().enumerate() {
                bytes += s.name.capacity();
                if is_code_letter(s.kind)
                    && (m.text.contains(Gva(s.addr)) || m.init_text.contains(Gva(s.addr)))
                {
                    by_addr.push((
                        s.addr,
                        ModuleSymbolId {
                            module: mi as u32,
                            symbol: si as u32,
                        },
                    ));
                }
            }
        }
        by_addr.sort_unstable();
        bytes += by_addr.capacity() * core::mem::size_of::<(u64, ModuleSymbolId)>();
        Ok(Self {
            modules,
            states,
            by_addr,
            bytes,
        })
    }

    /// The modules, in list order (the most recently loaded first).
    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// Heap bytes the index takes (modules, names, symbols and the address
    /// table).
    pub fn heap_bytes(&self) -> usize {
        self.bytes
    }

    /// Symbols over all modules.
    pub fn symbol_count(&self) -> usize {
        self.modules.iter().map(|m| m.symbols.len()).sum()
    }

    /// The module and symbol of `id`.
    pub fn get(&self, id: ModuleSymbolId) -> Option<(&Module, &ModuleSymbol)> {
        let m = self.modules.get(id.module as usize)?;
        Some((m, m.symbols.get(id.symbol as usize)?))
    }

    /// The module called `name` that is set up (not `MODULE_STATE_UNFORMED`).
    pub fn module(&self, name: &str) -> Option<(u32, &Module)> {
        self.modules
            .iter()
            .enumerate()
            .find(|(_, m)| m.name == name && m.state != self.states.unformed)
            .map(|(i, m)| (i as u32, m))
    }

    /// Every symbol in `/proc/kallsyms` order: module by module in list
    /// order, each in its symtab order; modules still being set up are
    /// left out, as the kernel leaves them out.
    pub fn kallsyms_order(
        &self,
    ) -> impl Iterator<Item = (ModuleSymbolId, &Module, &ModuleSymbol)> + '_ {
        let unformed = self.states.unformed;
        self.modules
            .iter()
            .enumerate()
            .filter(move |(_, m)| m.state != unformed)
            .flat_map(|(mi, m)| {
                m.symbols.iter().enumerate().map(move |(si, s)| {
                    (
                        ModuleSymbolId {
                            module: mi as u32,
                            symbol: si as u32,
                        },
                        m,
                        s,
                    )
                })
            })
    }

    /// The symbol called `name`: in the module called `module` when given,
    /// else in the first module (list order) that has it.
    pub fn lookup(&self, module: Option<&str>, name: &str) -> Option<ModuleSymbolId> {
        self.kallsyms_order()
            .find(|(_, m, s)| module.is_none_or(|want| m.name == want) && s.name == name)
            .map(|(id, _, _)| id)
    }

    /// The function of module text that `addr` is in: the closest function
    /// symbol at or before it in the same module, sized up to the next
    /// symbol or the end of the text it is in.
    pub fn resolve(&self, addr: Gva) -> Option<ModuleResolved<'_>> {
        let i = self.by_addr.partition_point(|&(a, _)| a <= addr.0);
        let at = self.by_addr.get(i.checked_sub(1)?)?.0;
        // Of aliases, the first in symtab order, as the kernel picks.
        let first = self.by_addr.partition_point(|&(a, _)| a < at);
        let (m, s) = self.get(self.by_addr.get(first)?.1)?;
        let region = [m.text, m.init_text]
            .into_iter()
            .find(|r| r.contains(addr) && r.contains(Gva(at)))?;
        let next = self
            .by_addr
            .get(i)
            .map(|&(a, _)| a)
            .filter(|&a| region.contains(Gva(a)))
            .unwrap_or(region.end.0);
        Some(ModuleResolved {
            module: &m.name,
            name: &s.name,
            addr: at,
            offset: addr.0 - at,
            size: next - at,
        })
    }

    /// Whether `addr` is in the text (core or init) of a module.
    pub fn in_text(&self, addr: Gva) -> bool {
        self.modules
            .iter()
            .any(|m| m.text.contains(addr) || m.init_text.contains(addr))
    }
}

/// The first bytes of a packed module index (and its format's version).
pub const MODULES_MAGIC: [u8; 8] = *b"HVMODS\x00\x01";

impl ModuleIndex {
    /// The module index as one byte string, for the host (VMX root sends it
    /// in pieces; [`ModuleIndex::unpack`] rebuilds it). Little-endian:
    /// [`MODULES_MAGIC`], the four state values (`i64`), the module count
    /// (`u32`), then per module its `struct module` address, state, core
    /// text and init text (`u64` start and end each), name (`u16` length
    /// and bytes), symbol count (`u32`) and symbols (address `u64`, type
    /// letter, name as `u16` length and bytes). The buffer is reserved
    /// fallibly: a heap without the room gives [`OutOfMemory`].
    pub fn pack(&self) -> Result<Vec<u8>, OutOfMemory> {
        let mut len = 8 + 4 * 8 + 4;
        for m in &self.modules {
            len += 6 * 8 + 2 + m.name.len().min(u16::MAX as usize) + 4;
            for s in &m.symbols {
                len += 8 + 1 + 2 + s.name.len().min(u16::MAX as usize);
            }
        }
        let mut out = Vec::new();
        crate::fallible::try_reserve(&mut out, len)?;
        out.extend_from_slice(&MODULES_MAGIC);
        for v in [
            self.states.live,
            self.states.coming,
            self.states.going,
            self.states.unformed,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let name = |out: &mut Vec<u8>, n: &str| {
            let b = n.as_bytes();
            let b = b.get(..b.len().min(u16::MAX as usize)).unwrap_or_default();
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        };
        out.extend_from_slice(&(self.modules.len() as u32).to_le_bytes());
        for m in &self.modules {
            for v in [
                m.addr.0,
                m.state as u64,
                m.text.start.0,
                m.text.end.0,
                m.init_text.start.0,
                m.init_text.end.0,
            ] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            name(&mut out, &m.name);
            out.extend_from_slice(&(m.symbols.len() as u32).to_le_bytes());
            for s in &m.symbols {
                out.extend_from_slice(&s.addr.to_le_bytes());
                out.push(s.kind);
                name(&mut out, &s.name);
            }
        }
        Ok(out)
    }

    /// Rebuilds an index from the bytes of [`ModuleIndex::pack`], checking
    /// every length against what is left and the counts against
    /// [`MAX_MODULES`] and [`MAX_MODULE_SYMBOLS`]; `Err` says what was
    /// wrong.
    pub fn unpack(bytes: &[u8]) -> Result<ModuleIndex, &'static str> {
        struct Reader<'a>(&'a [u8]);
        impl<'a> Reader<'a> {
            fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
                let (head, rest) = self.0.split_at_checked(n).ok_or("cut short")?;
                self.0 = rest;
                Ok(head)
            }
            fn u64(&mut self) -> Result<u64, &'static str> {
                let b = self.take(8)?;
                Ok(u64::from_le_bytes(b.try_into().map_err(|_| "cut short")?))
            }
            fn u32(&mut self) -> Result<u32, &'static str> {
                let b = self.take(4)?;
                Ok(u32::from_le_bytes(b.try_into().map_err(|_| "cut short")?))
            }
            fn name(&mut self) -> Result<String, &'static str> {
                let b = self.take(2)?;
                let n = u16::from_le_bytes(b.try_into().map_err(|_| "cut short")?);
                let b = self.take(usize::from(n))?;
                core::str::from_utf8(b)
                    .map(String::from)
                    .map_err(|_| "a name is not UTF-8")
            }
        }
        let mut r = Reader(bytes);
        if r.take(8)? != MODULES_MAGIC {
            return Err("not a packed module index of this version");
        }
        let states = ModuleStates {
            live: r.u64()? as i64,
            coming: r.u64()? as i64,
            going: r.u64()? as i64,
            unformed: r.u64()? as i64,
        };
        let count = r.u32()? as usize;
        if count > MAX_MODULES {
            return Err("more modules than taken");
        }
        let mut modules = Vec::new();
        crate::fallible::try_reserve(&mut modules, count).map_err(|_| "out of memory")?;
        for _ in 0..count {
            let addr = Gva(r.u64()?);
            let state = r.u64()? as i64;
            let text = GvaRange::new(Gva(r.u64()?), Gva(r.u64()?));
            let init_text = GvaRange::new(Gva(r.u64()?), Gva(r.u64()?));
            let name = r.name()?;
            let n = r.u32()?;
            if n > MAX_MODULE_SYMBOLS {
                return Err("a module with more symbols than taken");
            }
            // Each symbol takes 11 bytes at least: a count beyond what is
            // left is refused before anything is reserved for it.
            if (n as usize).saturating_mul(11) > r.0.len() {
                return Err("cut short");
            }
            let mut symbols = Vec::new();
            crate::fallible::try_reserve(&mut symbols, n as usize).map_err(|_| "out of memory")?;
            for _ in 0..n {
                let addr = r.u64()?;
                let kind = *r.take(1)?.first().ok_or("cut short")?;
                let name = r.name()?;
                symbols.push(ModuleSymbol { addr, kind, name });
            }
            modules.push(Module {
                addr,
                name,
                state,
                text,
                init_text,
                symbols,
            });
        }
        if !r.0.is_empty() {
            return Err("bytes after the last module");
        }
        ModuleIndex::new(modules, states).map_err(|_| "out of memory")
    }

    /// The state values the index was made with.
    pub fn states(&self) -> ModuleStates {
        self.states
    }

    /// Changes when the modules do (their `struct module`s, states, text
    /// and symbol counts): root sends the host a new copy when it does.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |v: u64| {
            h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
        };
        feed(self.modules.len() as u64);
        for m in &self.modules {
            feed(m.addr.0);
            feed(m.state as u64);
            feed(m.text.start.0);
            feed(m.init_text.end.0);
            feed(m.symbols.len() as u64);
        }
        h
    }
}
