//! BTF, the kernel's compact type information (`.BTF`, between `__start_BTF`
//! and `__stop_BTF`; `CONFIG_DEBUG_INFO_BTF`), read in place through a memory
//! view. Just enough to find struct members by name: the header, the type
//! section (walked once, keeping a checkpoint every 64 types) and the string
//! section (read one name at a time).
//!
//! Layouts from include/uapi/linux/btf.h:
//!
//! ```text
//! struct btf_header { u16 magic = 0xeB9F; u8 version = 1; u8 flags; u32 hdr_len;
//!                     u32 type_off, type_len, str_off, str_len; }  // offsets from the header's end
//! struct btf_type   { u32 name_off; u32 info; u32 size_or_type; }  // then per-kind data
//!   info: vlen = bits 0..15, kind = bits 24..28, kind_flag = bit 31
//! struct btf_member { u32 name_off; u32 type; u32 offset; }  // offset in bits; with
//!                     kind_flag: bitfield size in bits 24..31, bit offset in 0..23
//! struct btf_array  { u32 type; u32 index_type; u32 nelems; }
//! ```
//!
//! Type ids start at 1 (0 is `void`). A kernel built without BTF (the
//! fast-lane one: `CONFIG_DEBUG_INFO_BTF` needs pahole) has none of this;
//! [`BtfError::Absent`] says so, and the callers fall back or report it.
//!
//! The header's lengths are the guest's word: a header claiming more than
//! [`MAX_BTF_BYTES`] of sections, or sections past the range it was found
//! in, is refused before anything is walked. The walks (parse, type search,
//! member search) pause on a [`Budget`] between types, so that a caller can
//! run them a slice at a time; through a [`Metered`] view their reads are
//! charged to that budget, which bounds the work of a search over any
//! number of forged headers ([`locate_budgeted`]).

use alloc::borrow::Cow;
use alloc::vec::Vec;
use core::fmt;

pub mod typed;

use crate::addr::{Gva, GvaRange};
use crate::budget::{block_on, Budget, Metered, RECOVERY_BUDGET};
use crate::kallsyms::SymbolIndex;
use crate::scan::{ScanStats, ScanStep, Scanner};
use crate::view::{read_array, ViewError, VirtMemory};

/// `BTF_MAGIC`.
pub const BTF_MAGIC: u16 = 0xeb9f;
/// The start of every BTF blob the kernel emits: magic, version 1, flags 0,
/// `hdr_len` 24.
pub const BTF_PREFIX: [u8; 8] = [0x9f, 0xeb, 0x01, 0x00, 0x18, 0x00, 0x00, 0x00];
/// Most bytes of type and string sections together a header may claim
/// (Debian's 6.1 has 4.2 MiB, the fast-lane 6.12 2.4 MiB; a header claiming
/// more is refused unread).
pub const MAX_BTF_BYTES: u64 = 32 << 20;
/// Longest header accepted (the kernel's is 24 bytes).
const MAX_HEADER: u32 = 4096;
/// Most members one lookup ([`Btf::member`]) visits, anonymous ones
/// included (task_struct has a few hundred): past it the lookup fails with
/// [`BtfError::Malformed`]. Anonymous members may nest, or in a forged blob
/// contain themselves, so bounding the depth alone would leave the work
/// exponential. Each visit is one step of the lookup (one
/// [`Budget::pause`]), plus the steps of resolving an anonymous member's
/// type ([`MAX_RESOLVE_STEPS`]).
pub const MAX_MEMBERS_VISITED: u32 = 100_000;
/// Most typedefs and qualifiers [`Btf::resolve`] follows (one step, one
/// [`Budget::pause`], each) before it gives up with [`BtfError::BadId`]: a
/// forged typedef may name itself.
pub const MAX_RESOLVE_STEPS: u32 = 32;
/// Most anonymous structs and unions [`Btf::member`] looks into, one inside
/// the other.
pub const MAX_ANONYMOUS_DEPTH: usize = 16;
/// One checkpoint every this many type ids.
const CHECKPOINT_EVERY: u32 = 64;
/// Window of the sequential walks (parse, type search).
const WINDOW_SEQUENTIAL: u32 = 16 * 1024;
/// Window of the short lookups (one type, a struct's members): at most
/// `CHECKPOINT_EVERY` headers are read from a checkpoint, each perhaps far
/// from the last, so a big window would read mostly unused bytes.
const WINDOW_LOOKUP: u32 = 2 * 1024;

/// BTF kinds (`BTF_KIND_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// `BTF_KIND_INT`.
    Int = 1,
    /// `BTF_KIND_PTR`.
    Ptr = 2,
    /// `BTF_KIND_ARRAY`.
    Array = 3,
    /// `BTF_KIND_STRUCT`.
    Struct = 4,
    /// `BTF_KIND_UNION`.
    Union = 5,
    /// `BTF_KIND_ENUM`.
    Enum = 6,
    /// `BTF_KIND_FWD`.
    Fwd = 7,
    /// `BTF_KIND_TYPEDEF`.
    Typedef = 8,
    /// `BTF_KIND_VOLATILE`.
    Volatile = 9,
    /// `BTF_KIND_CONST`.
    Const = 10,
    /// `BTF_KIND_RESTRICT`.
    Restrict = 11,
    /// `BTF_KIND_FUNC`.
    Func = 12,
    /// `BTF_KIND_FUNC_PROTO`.
    FuncProto = 13,
    /// `BTF_KIND_VAR`.
    Var = 14,
    /// `BTF_KIND_DATASEC`.
    Datasec = 15,
    /// `BTF_KIND_FLOAT`.
    Float = 16,
    /// `BTF_KIND_DECL_TAG`.
    DeclTag = 17,
    /// `BTF_KIND_TYPE_TAG`.
    TypeTag = 18,
    /// `BTF_KIND_ENUM64`.
    Enum64 = 19,
}

impl Kind {
    fn from_raw(k: u32) -> Option<Self> {
        use Kind::*;
        Some(match k {
            1 => Int,
            2 => Ptr,
            3 => Array,
            4 => Struct,
            5 => Union,
            6 => Enum,
            7 => Fwd,
            8 => Typedef,
            9 => Volatile,
            10 => Const,
            11 => Restrict,
            12 => Func,
            13 => FuncProto,
            14 => Var,
            15 => Datasec,
            16 => Float,
            17 => DeclTag,
            18 => TypeTag,
            19 => Enum64,
            _ => return None,
        })
    }

    /// Bytes of kind-specific data after the 12-byte `btf_type`.
    fn extra(self, vlen: u32) -> u64 {
        let v = vlen as u64;
        match self {
            Kind::Int | Kind::Var | Kind::DeclTag => 4,
            Kind::Array => 12,
            Kind::Struct | Kind::Union | Kind::Datasec | Kind::Enum64 => 12 * v,
            Kind::Enum | Kind::FuncProto => 8 * v,
            _ => 0,
        }
    }

    /// Kinds that only qualify or rename another type.
    fn is_alias(self) -> bool {
        matches!(
            self,
            Kind::Typedef | Kind::Volatile | Kind::Const | Kind::Restrict | Kind::TypeTag
        )
    }
}

/// Why BTF could not be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BtfError {
    /// The kernel has no BTF: no `__start_BTF` symbol and no BTF header in
    /// the ranges searched (`CONFIG_DEBUG_INFO_BTF` off). The caller must
    /// fall back (or report that pid/comm are unavailable).
    Absent,
    /// The header is not a BTF v1 header, or its sections do not fit.
    BadHeader,
    /// The header claims more than [`MAX_BTF_BYTES`] of sections.
    TooLarge {
        /// Bytes it claims.
        bytes: u64,
    },
    /// The blob or its sections extend past the range it was found in (or
    /// `__start_BTF` is outside every range searched).
    OutOfRange,
    /// The work budget of the search was spent.
    OverBudget,
    /// A type runs past the type section, or has an unknown kind.
    Malformed {
        /// Byte offset in the type section.
        at: u32,
    },
    /// No type of that name and kind.
    NoType(&'static str),
    /// The struct has no member of that name.
    NoMember(&'static str),
    /// A member has an unexpected type.
    UnexpectedType(&'static str),
    /// A type id that does not exist.
    BadId(u32),
    /// The heap refused a buffer of the walk.
    OutOfMemory {
        /// Bytes asked for.
        bytes: usize,
    },
    /// The section could not be read.
    Read(ViewError),
}

impl fmt::Display for BtfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Absent => f.write_str("the kernel has no BTF (CONFIG_DEBUG_INFO_BTF is off)"),
            Self::BadHeader => f.write_str("bad BTF header"),
            Self::TooLarge { bytes } => write!(
                f,
                "a BTF header claiming {bytes} bytes of sections (more than {MAX_BTF_BYTES})"
            ),
            Self::OutOfRange => f.write_str("BTF outside the kernel image range searched"),
            Self::OverBudget => f.write_str("BTF search gave up: its work budget is spent"),
            Self::Malformed { at } => write!(f, "malformed BTF type at offset {at:#x}"),
            Self::NoType(t) => write!(f, "BTF has no type {t}"),
            Self::NoMember(m) => write!(f, "BTF struct has no member {m}"),
            Self::UnexpectedType(m) => write!(f, "BTF member {m} has an unexpected type"),
            Self::BadId(id) => write!(f, "BTF type id {id} does not exist"),
            Self::OutOfMemory { bytes } => write!(
                f,
                "out of hypervisor memory: BTF parsing needs {bytes} more bytes"
            ),
            Self::Read(e) => write!(f, "BTF unreadable: {e}"),
        }
    }
}

impl From<crate::fallible::OutOfMemory> for BtfError {
    fn from(e: crate::fallible::OutOfMemory) -> Self {
        Self::OutOfMemory { bytes: e.bytes }
    }
}

impl From<ViewError> for BtfError {
    fn from(e: ViewError) -> Self {
        match e {
            ViewError::OverBudget { .. } => Self::OverBudget,
            e => Self::Read(e),
        }
    }
}

/// A decoded `btf_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeInfo {
    /// Its id.
    pub id: u32,
    /// Its kind.
    pub kind: Kind,
    /// Offset of its name in the string section (0: anonymous).
    pub name_off: u32,
    /// `vlen`: members, enumerators, parameters.
    pub vlen: u32,
    /// `kind_flag`.
    pub kind_flag: bool,
    /// `size` (INT, STRUCT, UNION, ENUM, ...) or `type` (PTR, TYPEDEF, ...).
    pub size_or_type: u32,
    /// Offset of the kind-specific data in the type section.
    extra_at: u32,
}

/// A struct or union member, located.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Offset in bits from the start of the outermost struct asked about
    /// (anonymous members in between included).
    pub bit_offset: u64,
    /// Bitfield width, 0 for an ordinary member.
    pub bitfield_bits: u32,
    /// Its type id.
    pub type_id: u32,
}

impl Member {
    /// Byte offset, for a member that is not a bitfield.
    pub fn byte_offset(&self) -> Option<u32> {
        (self.bitfield_bits == 0 && self.bit_offset.is_multiple_of(8))
            .then_some((self.bit_offset / 8) as u32)
    }
}

/// A BTF blob in guest memory.
pub struct Btf<'v, V: ?Sized> {
    view: &'v V,
    /// The blob a split blob (a module's) extends: its types are ids
    /// `1..first_id`, its strings offsets `0..str_first`.
    parent: Option<&'v Btf<'v, V>>,
    /// The id of this blob's first type (1 unless split).
    first_id: u32,
    /// The string offset this blob's string section starts at (0 unless
    /// split).
    str_first: u32,
    base: Gva,
    types: Gva,
    types_len: u32,
    strings: Gva,
    strings_len: u32,
    count: u32,
    /// Offset of type `1 + 64 k` in the type section (borrowed from a
    /// [`BtfIndex`], or the walk's own).
    checkpoints: Cow<'v, [u32]>,
}

impl<V: ?Sized> fmt::Debug for Btf<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Btf")
            .field("types", &self.types)
            .field("types_len", &self.types_len)
            .field("strings_len", &self.strings_len)
            .field("count", &self.count)
            .finish()
    }
}

/// A walked base blob, without a view: where its sections are and a
/// checkpoint every 64 types ([`Btf::index`], [`Btf::from_index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BtfIndex {
    base: Gva,
    types: Gva,
    types_len: u32,
    strings: Gva,
    strings_len: u32,
    count: u32,
    checkpoints: Vec<u32>,
}

impl BtfIndex {
    /// Where the blob (its header) is.
    pub fn base(&self) -> Gva {
        self.base
    }

    /// Bytes of heap held.
    pub fn heap_bytes(&self) -> usize {
        self.checkpoints.capacity() * 4
    }
}

/// Reads of the type section through a window of `size` bytes.
struct Window<'v, V: ?Sized> {
    view: &'v V,
    base: Gva,
    len: u32,
    size: u32,
    buf: Vec<u8>,
    at: u32,
}

impl<V: ?Sized> Window<'_, V> {
    /// An empty window over the type section at `base`, `len` bytes long.
    fn new(view: &V, base: Gva, len: u32, size: u32) -> Window<'_, V> {
        Window {
            view,
            base,
            len,
            size,
            buf: Vec::new(),
            at: 0,
        }
    }
}

impl<V: VirtMemory + ?Sized> Window<'_, V> {
    /// The 12 bytes (a type or a member record) at section offset `off`.
    fn get(&mut self, off: u32) -> Result<[u8; 12], BtfError> {
        let n = 12;
        let end = off
            .checked_add(n)
            .filter(|&e| e <= self.len)
            .ok_or(BtfError::Malformed { at: off })?;
        if off < self.at || end > self.at + self.buf.len() as u32 {
            let take = core::cmp::min(self.size, self.len - off).max(n) as usize;
            // At most the window size (16 KiB), but fallible all the same.
            let more = take.saturating_sub(self.buf.len());
            crate::fallible::try_reserve(&mut self.buf, more)?;
            self.buf.resize(take, 0);
            self.view
                .read_virt(self.base.wrapping_add(off as u64), &mut self.buf)?;
            self.at = off;
        }
        // The window holds `[off, end)` now: the error is never returned.
        self.buf
            .get((off - self.at) as usize..)
            .and_then(<[u8]>::first_chunk)
            .copied()
            .ok_or(BtfError::Malformed { at: off })
    }
}

/// Offset of the type after the one at `off` (checked: the guest may change
/// its memory between two walks).
fn next_type(off: u32, kind: Kind, vlen: u32) -> Result<u32, BtfError> {
    u32::try_from(off as u64 + 12 + kind.extra(vlen)).map_err(|_| BtfError::Malformed { at: off })
}

/// The little-endian `u32` at `o` of a fixed-size record (every caller's
/// offset is a constant inside it; 0 past its end).
fn u32_le<const N: usize>(b: &[u8; N], o: usize) -> u32 {
    b.get(o..)
        .and_then(<[u8]>::first_chunk)
        .copied()
        .map_or(0, u32::from_le_bytes)
}

impl<'v, V: VirtMemory + ?Sized> Btf<'v, V> {
    /// Checks the header at `base` and walks the type section once. The
    /// header may claim at most [`MAX_BTF_BYTES`] of sections.
    pub fn parse(view: &'v V, base: Gva) -> Result<Self, BtfError> {
        block_on(Self::parse_paced(view, base, None, &Budget::unlimited()))
    }

    /// [`Self::parse`], refusing ([`BtfError::OutOfRange`]) a blob whose
    /// header or sections are not all inside `within`.
    pub fn parse_within(view: &'v V, base: Gva, within: GvaRange) -> Result<Self, BtfError> {
        block_on(Self::parse_paced(
            view,
            base,
            Some(within),
            &Budget::unlimited(),
        ))
    }

    /// [`Self::parse`] (and [`Self::parse_within`] when `within` is given),
    /// pausing on `pace` between types.
    pub async fn parse_paced(
        view: &'v V,
        base: Gva,
        within: Option<GvaRange>,
        pace: &Budget,
    ) -> Result<Self, BtfError> {
        if within.is_some_and(|r| !r.contains(base)) {
            return Err(BtfError::OutOfRange);
        }
        let h: [u8; 24] = read_array(view, base)?;
        let magic = u16::from_le_bytes([h[0], h[1]]);
        let hdr_len = u32_le(&h, 4);
        let (type_off, type_len, str_off, str_len) = (
            u32_le(&h, 8),
            u32_le(&h, 12),
            u32_le(&h, 16),
            u32_le(&h, 20),
        );
        if magic != BTF_MAGIC || h[2] != 1 || !(24..=MAX_HEADER).contains(&hdr_len) {
            return Err(BtfError::BadHeader);
        }
        // Sizes first: nothing of a guest-claimed length is walked before
        // it is known to be sane.
        let claimed = type_len as u64 + str_len as u64;
        if claimed > MAX_BTF_BYTES {
            return Err(BtfError::TooLarge { bytes: claimed });
        }
        let fits = |off: u32, len: u32| off as u64 + len as u64 <= MAX_BTF_BYTES;
        if !fits(type_off, type_len) || !fits(str_off, str_len) || !type_len.is_multiple_of(4) {
            return Err(BtfError::BadHeader);
        }
        // Section ends must not wrap the address space (reads wrap-check
        // too, but the arithmetic must not overflow first).
        let data = base
            .0
            .checked_add(hdr_len as u64)
            .ok_or(BtfError::BadHeader)?;
        let sections_end = core::cmp::max(
            type_off as u64 + type_len as u64,
            str_off as u64 + str_len as u64,
        );
        let end = data.checked_add(sections_end).ok_or(BtfError::BadHeader)?;
        if within.is_some_and(|r| end > r.end.0) {
            return Err(BtfError::OutOfRange);
        }
        let mut btf = Btf {
            view,
            parent: None,
            first_id: 1,
            str_first: 0,
            base,
            types: Gva(data + type_off as u64),
            types_len: type_len,
            strings: Gva(data + str_off as u64),
            strings_len: str_len,
            count: 0,
            checkpoints: Cow::Owned(Vec::new()),
        };
        let mut w = Window::new(view, btf.types, type_len, WINDOW_SEQUENTIAL);
        let mut off = 0u32;
        while off < type_len {
            pace.pause().await;
            if btf.count.is_multiple_of(CHECKPOINT_EVERY) {
                // One a `CHECKPOINT_EVERY` types: at most 170 KiB for
                // `MAX_BTF_BYTES` of 12-byte types, reserved fallibly.
                crate::fallible::try_push(btf.checkpoints.to_mut(), off)?;
            }
            let t = w.get(off)?;
            let info = u32_le(&t, 4);
            let kind =
                Kind::from_raw((info >> 24) & 0x1f).ok_or(BtfError::Malformed { at: off })?;
            let size = 12 + kind.extra(info & 0xffff);
            off = u32::try_from(off as u64 + size)
                .ok()
                .filter(|&e| e <= type_len)
                .ok_or(BtfError::Malformed { at: off })?;
            btf.count += 1;
        }
        Ok(btf)
    }

    /// A split blob (a module's `.BTF`) at `base`, extending `parent`:
    /// its types take the ids after the parent's, its string offsets
    /// continue the parent's string section, and its types may name the
    /// parent's. Checked and walked as [`Self::parse_paced`] does.
    pub async fn parse_split_paced(
        view: &'v V,
        parent: &'v Btf<'v, V>,
        base: Gva,
        within: Option<GvaRange>,
        pace: &Budget,
    ) -> Result<Self, BtfError> {
        let mut btf = Self::parse_paced(view, base, within, pace).await?;
        btf.first_id = parent
            .type_count()
            .checked_add(1)
            .ok_or(BtfError::BadHeader)?;
        btf.str_first = parent.str_first + parent.strings_len;
        btf.parent = Some(parent);
        Ok(btf)
    }

    /// [`Self::parse_split_paced`] at once.
    pub fn parse_split(
        view: &'v V,
        parent: &'v Btf<'v, V>,
        base: Gva,
        within: Option<GvaRange>,
    ) -> Result<Self, BtfError> {
        block_on(Self::parse_split_paced(
            view,
            parent,
            base,
            within,
            &Budget::unlimited(),
        ))
    }

    /// What the walk found, kept so that the blob can be used again
    /// without walking it ([`Self::from_index`]).
    pub fn index(&self) -> Result<BtfIndex, BtfError> {
        let mut checkpoints = Vec::new();
        crate::fallible::try_reserve(&mut checkpoints, self.checkpoints.len())?;
        checkpoints.extend_from_slice(&self.checkpoints);
        Ok(BtfIndex {
            base: self.base,
            types: self.types,
            types_len: self.types_len,
            strings: self.strings,
            strings_len: self.strings_len,
            count: self.count,
            checkpoints,
        })
    }

    /// The blob `index` describes, read through `view` (a base blob: a
    /// split one is parsed again over its parent). The guest may have
    /// changed the memory since: every read is checked as on the first
    /// walk.
    pub fn from_index(view: &'v V, index: &'v BtfIndex) -> Self {
        Btf {
            view,
            parent: None,
            first_id: 1,
            str_first: 0,
            base: index.base,
            types: index.types,
            types_len: index.types_len,
            strings: index.strings,
            strings_len: index.strings_len,
            count: index.count,
            checkpoints: Cow::Borrowed(&index.checkpoints),
        }
    }

    /// Where the blob (its header) is.
    pub fn base(&self) -> Gva {
        self.base
    }

    /// The last type id (ids 1..=last; a split blob's own types are the
    /// ids from its parent's last + 1).
    pub fn type_count(&self) -> u32 {
        self.first_id - 1 + self.count
    }

    /// The blob that holds type `id`: this one, or the blob it extends.
    fn owner(&self, id: u32) -> Result<&Btf<'v, V>, BtfError> {
        if id >= self.first_id {
            Ok(self)
        } else {
            self.parent.ok_or(BtfError::BadId(id))
        }
    }

    /// Bytes of heap held (the checkpoints).
    pub fn heap_bytes(&self) -> usize {
        match &self.checkpoints {
            Cow::Owned(v) => v.capacity() * 4,
            Cow::Borrowed(_) => 0,
        }
    }

    fn decode(&self, id: u32, off: u32, raw: &[u8; 12]) -> Result<TypeInfo, BtfError> {
        let info = u32_le(raw, 4);
        Ok(TypeInfo {
            id,
            kind: Kind::from_raw((info >> 24) & 0x1f).ok_or(BtfError::Malformed { at: off })?,
            name_off: u32_le(raw, 0),
            vlen: info & 0xffff,
            kind_flag: info >> 31 != 0,
            size_or_type: u32_le(raw, 8),
            extra_at: off + 12,
        })
    }

    /// A window over the whole type section, for short lookups.
    fn window(&self) -> Window<'v, V> {
        Window::new(self.view, self.types, self.types_len, WINDOW_LOOKUP)
    }

    /// Type `id` (1-based).
    pub fn type_info(&self, id: u32) -> Result<TypeInfo, BtfError> {
        if id == 0 || id > self.type_count() {
            return Err(BtfError::BadId(id));
        }
        if id < self.first_id {
            return self.owner(id)?.type_info(id);
        }
        let local = id - self.first_id + 1;
        let k = (local - 1) / CHECKPOINT_EVERY;
        // One checkpoint for every 64 types counted: `k` always has one.
        let mut off = *self
            .checkpoints
            .get(k as usize)
            .ok_or(BtfError::BadId(id))?;
        let mut w = self.window();
        for _ in 0..(local - 1) % CHECKPOINT_EVERY {
            let t = w.get(off)?;
            let info = u32_le(&t, 4);
            let kind =
                Kind::from_raw((info >> 24) & 0x1f).ok_or(BtfError::Malformed { at: off })?;
            off = next_type(off, kind, info & 0xffff)?;
        }
        let raw = w.get(off)?;
        self.decode(id, off, &raw)
    }

    /// Whether the string at `off` is `name`.
    pub fn name_is(&self, off: u32, name: &str) -> Result<bool, BtfError> {
        self.string_matches(off, name.as_bytes(), true)
    }

    /// The blob whose string section holds string offset `off` (a split
    /// blob's offsets continue its parent's), and the offset in it.
    fn strings_at(&self, off: u32) -> Option<(&Btf<'v, V>, u32)> {
        match off.checked_sub(self.str_first) {
            Some(local) => Some((self, local)),
            None => self.parent.and_then(|p| p.strings_at(off)),
        }
    }

    /// Whether the string at `off` starts with `want` (and ends there, when
    /// `whole`); false when those bytes are not all inside the string
    /// section.
    fn string_matches(&self, off: u32, want: &[u8], whole: bool) -> Result<bool, BtfError> {
        let Some((b, local)) = self.strings_at(off) else {
            return Ok(false);
        };
        let len = want.len() + usize::from(whole);
        if u64::from(local) + len as u64 > u64::from(b.strings_len) {
            return Ok(false);
        }
        let mut buf = alloc::vec![0u8; len];
        b.view
            .read_virt(b.strings.wrapping_add(u64::from(local)), &mut buf)?;
        Ok(buf.get(..want.len()) == Some(want) && (!whole || buf.last() == Some(&0)))
    }

    /// The first type of `kind` called `name` (one pass over the types).
    pub fn find(&self, kind: Kind, name: &'static str) -> Result<TypeInfo, BtfError> {
        block_on(self.find_paced(kind, name, &Budget::unlimited()))
    }

    /// [`Self::find`], pausing on `pace` between types.
    pub async fn find_paced(
        &self,
        kind: Kind,
        name: &'static str,
        pace: &Budget,
    ) -> Result<TypeInfo, BtfError> {
        self.find_named_paced(kind, name, pace)
            .await?
            .ok_or(BtfError::NoType(name))
    }

    /// The first type of `kind` called `name` among this blob's own types
    /// (a split blob's parent is not searched), or `None`.
    pub fn find_named(&self, kind: Kind, name: &str) -> Result<Option<TypeInfo>, BtfError> {
        block_on(self.find_named_paced(kind, name, &Budget::unlimited()))
    }

    /// [`Self::find_named`], pausing on `pace` between types.
    pub async fn find_named_paced(
        &self,
        kind: Kind,
        name: &str,
        pace: &Budget,
    ) -> Result<Option<TypeInfo>, BtfError> {
        let mut w = Window::new(self.view, self.types, self.types_len, WINDOW_SEQUENTIAL);
        let mut off = 0u32;
        for id in self.first_id..self.first_id + self.count {
            pace.pause().await;
            let raw = w.get(off)?;
            let t = self.decode(id, off, &raw)?;
            if t.kind == kind && t.name_off != 0 && self.name_is(t.name_off, name)? {
                return Ok(Some(t));
            }
            off = next_type(off, t.kind, t.vlen)?;
        }
        Ok(None)
    }

    /// Follows typedefs and qualifiers to the underlying type.
    pub fn resolve(&self, id: u32) -> Result<TypeInfo, BtfError> {
        block_on(self.resolve_paced(id, &Budget::unlimited()))
    }

    /// [`Self::resolve`], pausing on `pace` before each step (at most
    /// [`MAX_RESOLVE_STEPS`]).
    pub async fn resolve_paced(&self, mut id: u32, pace: &Budget) -> Result<TypeInfo, BtfError> {
        for _ in 0..MAX_RESOLVE_STEPS {
            pace.pause().await;
            let t = self.type_info(id)?;
            if !t.kind.is_alias() {
                return Ok(t);
            }
            id = t.size_or_type;
        }
        Err(BtfError::BadId(id))
    }

    /// The member `name` of struct or union `outer`, looking through
    /// anonymous struct and union members (depth-first, in declaration
    /// order, at most [`MAX_ANONYMOUS_DEPTH`] deep, visiting at most
    /// [`MAX_MEMBERS_VISITED`] members); the offset is from the start of
    /// `outer`.
    pub fn member(&self, outer: &TypeInfo, name: &'static str) -> Result<Member, BtfError> {
        block_on(self.member_paced(outer, name, &Budget::unlimited()))
    }

    /// [`Self::member`], pausing on `pace` before each member visited and
    /// each struct or union left.
    pub async fn member_paced(
        &self,
        outer: &TypeInfo,
        name: &'static str,
        pace: &Budget,
    ) -> Result<Member, BtfError> {
        self.member_named_paced(outer, name, pace)
            .await?
            .ok_or(BtfError::NoMember(name))
    }

    /// [`Self::member`] for any name: `None` when `outer` has no such
    /// member.
    pub fn member_named(&self, outer: &TypeInfo, name: &str) -> Result<Option<Member>, BtfError> {
        block_on(self.member_named_paced(outer, name, &Budget::unlimited()))
    }

    /// [`Self::member_named`], pausing on `pace` before each member
    /// visited and each struct or union left.
    pub async fn member_named_paced(
        &self,
        outer: &TypeInfo,
        name: &str,
        pace: &Budget,
    ) -> Result<Option<Member>, BtfError> {
        /// A struct or union being searched, and where in it.
        struct Frame {
            t: TypeInfo,
            next: u32,
            base_bits: u64,
        }
        let is_record = |t: &TypeInfo| matches!(t.kind, Kind::Struct | Kind::Union);
        let mut stack: Vec<Frame> = Vec::new();
        if is_record(outer) {
            stack.push(Frame {
                t: *outer,
                next: 0,
                base_bits: 0,
            });
        }
        // Anonymous members may nest (or, in a forged blob, repeat) without
        // end: bound the total work, not just the depth.
        let mut visits_left = MAX_MEMBERS_VISITED;
        // One window on each blob a split lookup may read.
        let mut w_own = self.window();
        let mut w_parent = self.parent.map(Btf::window);
        while let Some(top) = stack.last_mut() {
            pace.pause().await;
            if top.next >= top.t.vlen {
                stack.pop();
                continue;
            }
            let (t, i, base_bits) = (top.t, top.next, top.base_bits);
            top.next += 1;
            let w = match (&mut w_parent, t.id < self.first_id) {
                (Some(p), true) => p,
                _ => &mut w_own,
            };
            let m = w.get(
                t.extra_at
                    .checked_add(12 * i)
                    .ok_or(BtfError::Malformed { at: t.extra_at })?,
            )?;
            let (name_off, type_id, raw_off) = (u32_le(&m, 0), u32_le(&m, 4), u32_le(&m, 8));
            let (bits, bit_off) = if t.kind_flag {
                (raw_off >> 24, raw_off & 0xff_ffff)
            } else {
                (0, raw_off)
            };
            let at = base_bits + bit_off as u64;
            visits_left = visits_left
                .checked_sub(1)
                .ok_or(BtfError::Malformed { at: t.extra_at })?;
            if name_off == 0 {
                // The frame on top is at depth `stack.len() - 1`.
                let inner = self.resolve_paced(type_id, pace).await?;
                if is_record(&inner) && stack.len() <= MAX_ANONYMOUS_DEPTH {
                    stack.push(Frame {
                        t: inner,
                        next: 0,
                        base_bits: at,
                    });
                }
            } else if self.name_is(name_off, name)? {
                return Ok(Some(Member {
                    bit_offset: at,
                    bitfield_bits: bits,
                    type_id,
                }));
            }
        }
        Ok(None)
    }

    /// The value of enumerator `name` of enum type `t` (`BTF_KIND_ENUM`,
    /// 32-bit values, or `BTF_KIND_ENUM64`).
    pub fn enumerator(&self, t: &TypeInfo, name: &'static str) -> Result<i64, BtfError> {
        if t.id < self.first_id {
            return self.owner(t.id)?.enumerator(t, name);
        }
        let (stride, wide) = match t.kind {
            Kind::Enum => (8u32, false),
            Kind::Enum64 => (12u32, true),
            _ => return Err(BtfError::UnexpectedType("enum")),
        };
        for i in 0..t.vlen {
            let at = stride
                .checked_mul(i)
                .and_then(|o| t.extra_at.checked_add(o))
                .filter(|at| at.checked_add(stride).is_some_and(|e| e <= self.types_len))
                .ok_or(BtfError::Malformed { at: t.extra_at })?;
            let mut e = [0u8; 12];
            let entry = e
                .get_mut(..stride as usize)
                .ok_or(BtfError::Malformed { at })?;
            self.view
                .read_virt(self.types.wrapping_add(at as u64), entry)?;
            if self.name_is(u32_le(&e, 0), name)? {
                let lo = u32_le(&e, 4);
                return Ok(if wide {
                    ((u32_le(&e, 8) as u64) << 32 | lo as u64) as i64
                } else if t.kind_flag {
                    lo as i64
                } else {
                    lo as i32 as i64
                });
            }
        }
        Err(BtfError::NoMember(name))
    }

    /// `(element type id, element count)` of an array type.
    pub fn array(&self, t: &TypeInfo) -> Result<(u32, u32), BtfError> {
        if t.kind != Kind::Array {
            return Err(BtfError::UnexpectedType("array"));
        }
        let mut w = self.owner(t.id)?.window();
        let a = w.get(t.extra_at)?;
        Ok((u32_le(&a, 0), u32_le(&a, 8)))
    }
}

/// Where the BTF blob is: `__start_BTF` when kallsyms has it, else the first
/// valid BTF header found in `ranges` (8-byte prefix search, then a full
/// parse). [`BtfError::Absent`] when neither. The search may do
/// [`RECOVERY_BUDGET`] units of work (see [`locate_budgeted`]).
pub fn locate<V: VirtMemory + ?Sized>(
    view: &V,
    index: Option<&SymbolIndex>,
    ranges: &[GvaRange],
    stats: &mut ScanStats,
) -> Result<Gva, BtfError> {
    let budget = Budget::new(RECOVERY_BUDGET);
    let view = Metered::new(view, &budget);
    block_on(locate_budgeted(&view, index, ranges, stats)).map(|(at, _)| at)
}

/// A located blob and its parse (or why it does not parse).
pub type Located<'v, V> = (Gva, Result<Btf<'v, V>, BtfError>);

/// [`locate`], returning the blob parsed as well, with every read (the
/// header search, the walk of each candidate) charged to the view's budget
/// and pauses between steps.
///
/// A candidate header must be inside the range it was found in, with its
/// sections ([`Btf::parse_within`]); `__start_BTF` must be inside one of
/// `ranges` ([`BtfError::OutOfRange`] as the parse result otherwise). Any
/// number of forged headers before the real one cost at most the budget:
/// once it is spent the search ends with [`BtfError::OverBudget`].
pub async fn locate_budgeted<'v, 'm, V: VirtMemory + ?Sized>(
    view: &'v Metered<'m, V>,
    index: Option<&SymbolIndex>,
    ranges: &[GvaRange],
    stats: &mut ScanStats,
) -> Result<Located<'v, Metered<'m, V>>, BtfError> {
    let pace = view.budget();
    if let Some(at) = index.and_then(|i| i.addr_of("__start_BTF")) {
        let parsed = match ranges.iter().find(|r| r.contains(at)) {
            Some(&r) => Btf::parse_paced(view, at, Some(r), pace).await,
            None => Err(BtfError::OutOfRange),
        };
        return Ok((at, parsed));
    }
    for &r in ranges {
        let Some(mut scanner) = Scanner::new(r, &BTF_PREFIX) else {
            continue;
        };
        loop {
            pace.pause().await;
            match scanner.step(view, stats) {
                ScanStep::Hit(at) => {
                    if let Ok(b) = Btf::parse_paced(view, at, Some(r), pace).await {
                        if b.type_count() > 0 {
                            return Ok((at, Ok(b)));
                        }
                    }
                    if pace.exhausted() {
                        return Err(BtfError::OverBudget);
                    }
                }
                ScanStep::Read => {}
                ScanStep::Done => break,
                ScanStep::OverBudget => return Err(BtfError::OverBudget),
            }
        }
    }
    Err(BtfError::Absent)
}

/// What the tracer needs of `struct task_struct`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskLayout {
    /// Byte offset of `pid` (a 4-byte `pid_t`).
    pub pid: u32,
    /// Byte offset of `comm`.
    pub comm: u32,
    /// Elements of `comm` (`TASK_COMM_LEN`, 16).
    pub comm_len: u32,
    /// `sizeof(struct task_struct)`.
    pub size: u32,
    /// Byte offset of `stack` (the kernel stack's base, a pointer), when the
    /// type has it.
    pub stack: Option<u32>,
    /// Byte offset of `prio` (a 4-byte int), when the type has it.
    pub prio: Option<u32>,
    /// Byte offset and size (4 or 8) of the scheduler state: `__state`
    /// (5.14 on, an unsigned int) or `state` (a long before), when the
    /// type has one.
    pub state: Option<(u32, u32)>,
    /// Byte offset of `exit_state` (a 4-byte int), when the type has it.
    pub exit_state: Option<u32>,
    /// Byte offset of the CPU the task is on (`task_cpu()`): `cpu`, in
    /// `thread_info` on x86 since 5.16 and in `task_struct` before.
    pub cpu: Option<u32>,
}

/// `task_struct.pid` and `task_struct.comm`, checked: `pid` must be a 4-byte
/// integer, `comm` an array of 1-byte integers.
pub fn task_layout<V: VirtMemory + ?Sized>(btf: &Btf<'_, V>) -> Result<TaskLayout, BtfError> {
    block_on(task_layout_paced(btf, &Budget::unlimited()))
}

/// [`task_layout`], pausing on `pace` between steps.
pub async fn task_layout_paced<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    pace: &Budget,
) -> Result<TaskLayout, BtfError> {
    let task = btf.find_paced(Kind::Struct, "task_struct", pace).await?;
    let pid = btf.member_paced(&task, "pid", pace).await?;
    let pid_t = btf.resolve_paced(pid.type_id, pace).await?;
    if pid_t.kind != Kind::Int || pid_t.size_or_type != 4 {
        return Err(BtfError::UnexpectedType("pid"));
    }
    let comm = btf.member_paced(&task, "comm", pace).await?;
    let comm_t = btf.resolve_paced(comm.type_id, pace).await?;
    let (elem, comm_len) = btf.array(&comm_t)?;
    let elem = btf.resolve_paced(elem, pace).await?;
    if elem.kind != Kind::Int || elem.size_or_type != 1 {
        return Err(BtfError::UnexpectedType("comm"));
    }
    // An optional member: missing or not a pointer, it is None (a spent
    // budget is not hidden this way: the caller sees it on the budget).
    let stack = match btf.member_paced(&task, "stack", pace).await {
        Ok(m) => match btf.resolve_paced(m.type_id, pace).await {
            Ok(t) if t.kind == Kind::Ptr => m.byte_offset(),
            _ => None,
        },
        Err(_) => None,
    };
    // Optional too: integers of the sizes the kernel has used.
    let prio = int_member(btf, &task, "prio", &[4], pace)
        .await
        .map(|(off, _)| off);
    let state = match int_member(btf, &task, "__state", &[4], pace).await {
        Some(s) => Some(s),
        None => int_member(btf, &task, "state", &[8], pace).await,
    };
    let exit_state = int_member(btf, &task, "exit_state", &[4], pace)
        .await
        .map(|(off, _)| off);
    let cpu = match int_member(btf, &task, "cpu", &[4], pace).await {
        Some((off, _)) => Some(off),
        None => thread_info_cpu(btf, &task, pace).await,
    };
    Ok(TaskLayout {
        pid: pid.byte_offset().ok_or(BtfError::UnexpectedType("pid"))?,
        comm: comm.byte_offset().ok_or(BtfError::UnexpectedType("comm"))?,
        comm_len,
        size: task.size_or_type,
        stack,
        prio,
        state,
        exit_state,
        cpu,
    })
}

/// The offset of `task_struct.thread_info.cpu` (a 4-byte integer), when
/// the type has it.
async fn thread_info_cpu<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    task: &TypeInfo,
    pace: &Budget,
) -> Option<u32> {
    let ti = btf.member_paced(task, "thread_info", pace).await.ok()?;
    let ti_type = btf.resolve_paced(ti.type_id, pace).await.ok()?;
    if ti_type.kind != Kind::Struct {
        return None;
    }
    let (off, _) = int_member(btf, &ti_type, "cpu", &[4], pace).await?;
    ti.byte_offset()?.checked_add(off)
}

/// The offset and size of `ty`'s member `name` when it is an integer of
/// one of `sizes` bytes.
async fn int_member<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    ty: &TypeInfo,
    name: &'static str,
    sizes: &[u32],
    pace: &Budget,
) -> Option<(u32, u32)> {
    let m = btf.member_paced(ty, name, pace).await.ok()?;
    let t = btf.resolve_paced(m.type_id, pace).await.ok()?;
    if t.kind != Kind::Int || !sizes.contains(&t.size_or_type) {
        return None;
    }
    Some((m.byte_offset()?, t.size_or_type))
}

/// Byte offset of `current_task` in `struct pcpu_hot` (6.2 to 6.14), which
/// nests it in an anonymous struct inside an anonymous union.
pub fn pcpu_hot_current_task<V: VirtMemory + ?Sized>(btf: &Btf<'_, V>) -> Result<u32, BtfError> {
    block_on(pcpu_hot_current_task_paced(btf, &Budget::unlimited()))
}

/// [`pcpu_hot_current_task`], pausing on `pace` between steps.
pub async fn pcpu_hot_current_task_paced<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    pace: &Budget,
) -> Result<u32, BtfError> {
    let hot = btf.find_paced(Kind::Struct, "pcpu_hot", pace).await?;
    let m = btf.member_paced(&hot, "current_task", pace).await?;
    if btf.resolve_paced(m.type_id, pace).await?.kind != Kind::Ptr {
        return Err(BtfError::UnexpectedType("current_task"));
    }
    m.byte_offset()
        .ok_or(BtfError::UnexpectedType("current_task"))
}
