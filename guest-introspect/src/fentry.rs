//! fentry sites: where ftrace (and we) can hook each function.
//!
//! With `CONFIG_DYNAMIC_FTRACE` and `-mfentry`, every traceable function
//! starts with `call __fentry__` (arch/x86/kernel/ftrace.c,
//! scripts/recordmcount / `-mrecord-mcount`). The site is at the function's
//! address, or 4 bytes in after an `endbr64` with `CONFIG_X86_KERNEL_IBT`.
//! `ftrace_init` rewrites every site to the NOP5 `0f 1f 44 00 00`, and
//! `apply_seal_endbr` turns unused ENDBRs into the poison `66 0f 1f 00`
//! (arch/x86/include/asm/ibt.h, `gen_endbr_poison`).
//!
//! So at function address A the site is one of:
//!
//! ```text
//!   A:   0f 1f 44 00 00        NOP5 (after ftrace_init)
//!   A:   e8 <rel32>            call __fentry__ (before ftrace_init: a vmlinux file)
//!   A:   f3 0f 1e fa | 66 0f 1f 00   then either of the above at A+4
//! ```
//!
//! and, while the guest's own ftrace uses it, `call ftrace_caller`,
//! `call ftrace_regs_caller` or a call to a dynamic trampoline outside the
//! kernel image, or transiently an `int3` over the NOP5 (`text_poke_bp`).
//!
//! Bytes alone cannot tell a NOP5 fentry site from a jump-label NOP at the
//! start of a `notrace` function. In a booted guest, the authoritative list
//! is the kernel's own: [`ftrace_records`] walks `ftrace_pages_start`.

use alloc::vec::Vec;
use core::fmt;

use crate::addr::{Gva, GvaRange};
use crate::kallsyms::{SymbolId, SymbolIndex};
use crate::module::{is_code_letter, Module, ModuleSymbol};
use crate::view::{read_array, ViewError, VirtMemory};

/// The NOP5 `ftrace_init` writes over each site (`x86_nops[5]`).
pub const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];
/// `endbr64`.
pub const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
/// A sealed ENDBR (`gen_endbr_poison`: `osp nopl (%rax)`).
pub const ENDBR_POISON: [u8; 4] = [0x66, 0x0f, 0x1f, 0x00];
/// Opcode of `call rel32`.
pub const CALL_REL32: u8 = 0xe8;
/// Opcode of `int3`.
pub const INT3: u8 = 0xcc;

/// What precedes the site at the function's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endbr {
    /// Nothing: the site is the function's address.
    None,
    /// An `endbr64`: the site is at +4.
    Endbr64,
    /// A sealed ENDBR: the site is at +4.
    Sealed,
}

/// The state the 5 bytes of a site are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SiteState {
    /// NOP5: patched by `ftrace_init`, not in use.
    Nop,
    /// `call __fentry__`: not yet patched (a vmlinux file, or early boot).
    CallFentry,
    /// The guest's own ftrace is using the site: a call to `ftrace_caller`,
    /// `ftrace_regs_caller` or a trampoline outside the kernel image.
    GuestCall {
        /// Where the call goes.
        target: Gva,
    },
    /// `int3` over a NOP5: `text_poke_bp` is in the middle of changing it.
    Int3,
}

/// A function's fentry site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FentrySite {
    /// The function's address.
    pub func: Gva,
    /// The site: `func` or `func + 4`.
    pub site: Gva,
    /// What comes before the site.
    pub endbr: Endbr,
    /// What the site holds now.
    pub state: SiteState,
}

/// Why a symbol cannot be traced through an fentry site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotTraceable {
    /// The type letter says data (not `t`, `T`, `w`, `W`).
    DataSymbol,
    /// A code letter, but outside the kernel's text (`_stext.._etext`).
    NotText,
    /// In `.init.text`, which is freed after boot. `site` says whether it
    /// had one (so a vmlinux file's `__mcount_loc` can be matched).
    InitText {
        /// The site the function had, if any.
        site: Option<Gva>,
    },
    /// No fentry site at the start (`notrace`, `noinstr`, assembly, or a
    /// label inside a function).
    NoFentry,
    /// The function's first bytes could not be read.
    Unreadable(ViewError),
}

impl fmt::Display for NotTraceable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DataSymbol => f.write_str("data symbol"),
            Self::NotText => f.write_str("outside kernel text"),
            Self::InitText { .. } => f.write_str("init text (freed after boot)"),
            Self::NoFentry => f.write_str("no fentry site"),
            Self::Unreadable(e) => write!(f, "unreadable: {e}"),
        }
    }
}

/// Decodes the first 9 bytes of a function at `func` into its site, given
/// where `call` targets count as the kernel's (`fentry`, the guest's
/// ftrace callers) and the kernel image's text.
pub fn decode_site(bytes: &[u8; 9], func: Gva, targets: &SiteTargets) -> Option<FentrySite> {
    let [b0, b1, b2, b3, b4, b5, b6, b7, b8] = *bytes;
    // The 5 bytes of the site, after the ENDBR if there is one.
    let (endbr, at, insn) = match [b0, b1, b2, b3] {
        ENDBR64 => (Endbr::Endbr64, 4u64, [b4, b5, b6, b7, b8]),
        ENDBR_POISON => (Endbr::Sealed, 4, [b4, b5, b6, b7, b8]),
        _ => (Endbr::None, 0, [b0, b1, b2, b3, b4]),
    };
    let site = func.checked_add(at)?;
    let [op, operand @ ..] = insn;
    let [_, nop_tail @ ..] = NOP5;
    let state = if insn == NOP5 {
        SiteState::Nop
    } else if op == INT3 && operand == nop_tail {
        SiteState::Int3
    } else if op == CALL_REL32 {
        let rel = i32::from_le_bytes(operand);
        let target = Gva(site.0.wrapping_add(5).wrapping_add(rel as i64 as u64));
        if Some(target) == targets.fentry {
            SiteState::CallFentry
        } else if targets.ftrace_callers.contains(&Some(target))
            || targets
                .text
                .is_some_and(|t| !t.contains(target) && target.is_kernel_image())
        {
            SiteState::GuestCall { target }
        } else {
            return None;
        }
    } else {
        return None;
    };
    Some(FentrySite {
        func,
        site,
        endbr,
        state,
    })
}

/// What `call` targets mean at a site.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SiteTargets {
    /// `__fentry__`.
    pub fentry: Option<Gva>,
    /// `ftrace_caller` and `ftrace_regs_caller`.
    pub ftrace_callers: [Option<Gva>; 2],
    /// The kernel's text; a call from a site to elsewhere in the kernel
    /// image (module space, where ftrace and BPF allocate trampolines) is
    /// the guest's ftrace.
    pub text: Option<GvaRange>,
}

impl SiteTargets {
    /// From the symbols.
    pub fn from_index(index: &SymbolIndex) -> Self {
        Self {
            fentry: index.addr_of("__fentry__"),
            ftrace_callers: [
                index.addr_of("ftrace_caller"),
                index.addr_of("ftrace_regs_caller"),
            ],
            text: index.text(),
        }
    }
}

/// Classifies symbols by their fentry site.
#[derive(Clone, Copy, Debug)]
pub struct Classifier<'i> {
    index: &'i SymbolIndex,
    targets: SiteTargets,
    /// Whether a module's init text is traceable (see
    /// [`Classifier::with_module_init`]).
    module_init: bool,
}

impl<'i> Classifier<'i> {
    /// A classifier over `index`'s symbols.
    pub fn new(index: &'i SymbolIndex) -> Self {
        Self {
            index,
            targets: SiteTargets::from_index(index),
            module_init: false,
        }
    }

    /// The same, with a module's init text traceable (`yes`) or not. Only
    /// a caller that learns when the kernel is about to free a module's
    /// init text, and removes its hooks there first, may say yes. The
    /// kernel image's init text stays untraceable.
    pub fn with_module_init(self, yes: bool) -> Self {
        Self {
            module_init: yes,
            ..self
        }
    }

    /// The call targets it recognises.
    pub fn targets(&self) -> &SiteTargets {
        &self.targets
    }

    /// The fentry site of symbol `id`, or why it has none.
    pub fn classify<V: VirtMemory + ?Sized>(
        &self,
        view: &V,
        id: SymbolId,
    ) -> Result<FentrySite, NotTraceable> {
        let sym = self.index.symbol(id);
        if !(sym.kind.is_text() || sym.kind.is_weak()) {
            return Err(NotTraceable::DataSymbol);
        }
        let in_init = self.index.init_text().is_some_and(|r| r.contains(sym.addr));
        let in_text = match self.index.text() {
            Some(r) => r.contains(sym.addr),
            // Without _stext/_etext, trust the letter.
            None => sym.kind.is_text(),
        };
        if !in_text && !in_init {
            return Err(if sym.kind.is_weak() {
                NotTraceable::DataSymbol
            } else {
                NotTraceable::NotText
            });
        }
        site_at(view, &self.targets, sym.addr, in_init)
    }

    /// [`classify_module`] with this classifier's targets.
    pub fn classify_module<V: VirtMemory + ?Sized>(
        &self,
        view: &V,
        m: &Module,
        sym: &ModuleSymbol,
    ) -> Result<FentrySite, NotTraceable> {
        classify_module(view, &self.targets, m, sym, self.module_init)
    }

    /// The fentry site of the first function called `name`.
    pub fn site_of<V: VirtMemory + ?Sized>(
        &self,
        view: &V,
        name: &str,
    ) -> Option<Result<FentrySite, NotTraceable>> {
        self.index.lookup(name).map(|id| self.classify(view, id))
    }
}

/// The site of a function at `addr`, in init text or not.
fn site_at<V: VirtMemory + ?Sized>(
    view: &V,
    targets: &SiteTargets,
    addr: Gva,
    in_init: bool,
) -> Result<FentrySite, NotTraceable> {
    let site = match read_array::<_, 9>(view, addr) {
        Ok(bytes) => decode_site(&bytes, addr, targets),
        // Freed init text is usually unmapped in a booted guest.
        Err(_) if in_init => return Err(NotTraceable::InitText { site: None }),
        Err(e) => return Err(NotTraceable::Unreadable(e)),
    };
    if in_init {
        return Err(NotTraceable::InitText {
            site: site.map(|s| s.site),
        });
    }
    site.ok_or(NotTraceable::NoFentry)
}

/// The fentry site of symbol `sym` of module `m`, or why it has none: as
/// for the kernel's own functions, with the module's text in place of the
/// kernel's. Its init text (run once, then freed) is traceable only when
/// `init_ok`; otherwise a function there is [`NotTraceable::InitText`].
pub fn classify_module<V: VirtMemory + ?Sized>(
    view: &V,
    targets: &SiteTargets,
    m: &Module,
    sym: &ModuleSymbol,
    init_ok: bool,
) -> Result<FentrySite, NotTraceable> {
    if !is_code_letter(sym.kind) {
        return Err(NotTraceable::DataSymbol);
    }
    let addr = Gva(sym.addr);
    let in_init = m.init_text.contains(addr);
    if !m.text.contains(addr) && !in_init {
        return Err(NotTraceable::NotText);
    }
    site_at(view, targets, addr, in_init && !init_ok)
}

/// Counts over every symbol.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Survey {
    /// Symbols looked at.
    pub symbols: u64,
    /// Symbols with a site (aliases each count).
    pub traceable: u64,
    /// Distinct site addresses among them.
    pub unique_sites: u64,
    /// Traceable, by state: NOP5, call __fentry__, guest call, int3.
    pub by_state: [u64; 4],
    /// Traceable with an ENDBR (live or sealed) before the site.
    pub with_endbr: u64,
    /// Not traceable: data symbols.
    pub data: u64,
    /// Not traceable: code letters outside text.
    pub not_text: u64,
    /// Not traceable: init text (with and without a site).
    pub init_text: u64,
    /// Init-text functions that had a site.
    pub init_text_with_site: u64,
    /// Not traceable: text without a site.
    pub no_fentry: u64,
    /// Not traceable: unreadable.
    pub unreadable: u64,
    /// The distinct sites, sorted (includes init-text sites when
    /// `keep_init_sites` was asked for).
    pub sites: Vec<Gva>,
    /// Sites left out of [`Self::sites`] (and so of
    /// [`Self::unique_sites`]) because the heap refused room for them; the
    /// other counts are complete.
    pub sites_refused: u64,
}

/// Classifies every symbol of `index` (one 9-byte read per code symbol).
/// `keep_init_sites` adds the sites of init-text functions to
/// [`Survey::sites`] (to compare with a vmlinux's `__mcount_loc`).
pub fn survey<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    keep_init_sites: bool,
) -> Survey {
    crate::budget::block_on(survey_paced(
        view,
        index,
        keep_init_sites,
        &crate::budget::Budget::unlimited(),
    ))
}

/// [`survey`], pausing on `pace` between symbols. Through a
/// [`crate::budget::Metered`] view whose budget runs out, the symbols left
/// count as unreadable.
pub async fn survey_paced<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    keep_init_sites: bool,
    pace: &crate::budget::Budget,
) -> Survey {
    let c = Classifier::new(index);
    let mut s = Survey::default();
    for i in 0..index.len() as u32 {
        pace.pause().await;
        s.symbols += 1;
        match c.classify(view, SymbolId(i)) {
            Ok(site) => {
                s.traceable += 1;
                let [nop, call, guest, int3] = &mut s.by_state;
                *match site.state {
                    SiteState::Nop => nop,
                    SiteState::CallFentry => call,
                    SiteState::GuestCall { .. } => guest,
                    SiteState::Int3 => int3,
                } += 1;
                if site.endbr != Endbr::None {
                    s.with_endbr += 1;
                }
                keep_site(&mut s, site.site);
            }
            Err(NotTraceable::DataSymbol) => s.data += 1,
            Err(NotTraceable::NotText) => s.not_text += 1,
            Err(NotTraceable::InitText { site }) => {
                s.init_text += 1;
                if let Some(site) = site {
                    s.init_text_with_site += 1;
                    if keep_init_sites {
                        keep_site(&mut s, site);
                    }
                }
            }
            Err(NotTraceable::NoFentry) => s.no_fentry += 1,
            Err(NotTraceable::Unreadable(_)) => s.unreadable += 1,
        }
    }
    // Symbols are in address order, so sites nearly are; aliases repeat.
    s.sites.sort_unstable();
    s.sites.dedup();
    s.unique_sites = s.sites.len() as u64;
    s
}

/// Adds `site` to the survey's list, or counts it refused when the heap
/// has no room (a survey is a report: it never aborts for memory).
fn keep_site(s: &mut Survey, site: Gva) {
    if crate::fallible::try_push(&mut s.sites, site).is_err() {
        s.sites_refused += 1;
    }
}

/// Why the guest's ftrace records could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordsError {
    /// No `ftrace_pages_start` symbol.
    NoSymbol,
    /// `ftrace_pages_start` is NULL: `ftrace_init` has not run.
    NotInitialised,
    /// More pages or records than the bounds allow (a loop, or garbage).
    TooMany,
    /// A page or record is unreadable.
    Read(ViewError),
    /// The heap refused room for the records.
    OutOfMemory {
        /// Bytes asked for.
        bytes: usize,
    },
}

/// Bounds on the walk of guest-controlled lists.
const MAX_FTRACE_PAGES: usize = 1 << 16;

/// The guest's own list of fentry sites, after `ftrace_init`: the `ip` of
/// every `struct dyn_ftrace` in the `ftrace_pages_start` list
/// (kernel/trace/ftrace.c). Layouts, x86-64, 6.1 to 6.12:
///
/// ```text
/// struct ftrace_page { struct ftrace_page *next; struct dyn_ftrace *records;
///                      int index; int order; };           // next@0 records@8 index@16
/// struct dyn_ftrace  { unsigned long ip; unsigned long flags; };  // 16 bytes
///                      // (struct dyn_arch_ftrace is empty on x86)
/// ```
///
/// Freed init-text records are already gone from the list. The sites come
/// back sorted. `max_records` bounds the result (and so the heap it takes,
/// 8 bytes a record): twice the number of text symbols is ample.
pub fn ftrace_records<V: VirtMemory + ?Sized>(
    view: &V,
    index: &SymbolIndex,
    max_records: usize,
) -> Result<Vec<Gva>, RecordsError> {
    let head = index
        .addr_of("ftrace_pages_start")
        .ok_or(RecordsError::NoSymbol)?;
    let mut page = u64::from_le_bytes(read_array(view, head).map_err(RecordsError::Read)?);
    if page == 0 {
        return Err(RecordsError::NotInitialised);
    }
    let mut out = Vec::new();
    let mut pages = 0usize;
    while page != 0 {
        pages += 1;
        if pages > MAX_FTRACE_PAGES {
            return Err(RecordsError::TooMany);
        }
        // `struct ftrace_page`: next, records, index (an int).
        let mut raw = [[0u8; 8]; 3];
        view.read_virt(Gva(page), raw.as_flattened_mut())
            .map_err(RecordsError::Read)?;
        let [next, records, [c0, c1, c2, c3, ..]] = raw;
        let (next, records) = (u64::from_le_bytes(next), u64::from_le_bytes(records));
        let count = i32::from_le_bytes([c0, c1, c2, c3]);
        let count = usize::try_from(count).map_err(|_| RecordsError::TooMany)?;
        if out.len() + count > max_records {
            return Err(RecordsError::TooMany);
        }
        // In pieces: the count is the guest's.
        // 16-byte `struct dyn_ftrace` records: ip, flags.
        let mut buf = [[[0u8; 8]; 2]; 256];
        let mut done = 0usize;
        while done < count {
            let k = core::cmp::min(buf.len(), count - done);
            let at = Gva(records.wrapping_add(16 * done as u64));
            // `k` is at most the buffer's length: the error is never returned.
            let piece = buf.get_mut(..k).ok_or(RecordsError::TooMany)?;
            view.read_virt(at, piece.as_flattened_mut().as_flattened_mut())
                .map_err(RecordsError::Read)?;
            crate::fallible::try_grow(&mut out, k)
                .map_err(|e| RecordsError::OutOfMemory { bytes: e.bytes })?;
            out.extend(
                piece
                    .iter()
                    .map(|&[ip, _flags]| Gva(u64::from_le_bytes(ip))),
            );
            done += k;
        }
        page = next;
    }
    out.sort_unstable();
    Ok(out)
}
