//! Typed questions to BTF, by names that are not known in advance: a
//! function's prototype, what a type is once its typedefs and qualifiers
//! are skipped, and strings by offset. The probe language's BTF arguments
//! (`file->f_path.dentry`) are built on these.
//!
//! Layouts from include/uapi/linux/btf.h:
//!
//! ```text
//! BTF_KIND_FUNC       size_or_type = its FUNC_PROTO
//! BTF_KIND_FUNC_PROTO size_or_type = return type (0: void), then vlen x
//!                     struct btf_param { u32 name_off; u32 type; }
//! BTF_KIND_INT        then u32: encoding bits 24..27 (SIGNED 1, CHAR 2,
//!                     BOOL 4), offset bits 16..23, bits 0..7
//! ```

use alloc::string::String;
use alloc::vec::Vec;

use super::{u32_le, Btf, BtfError, Kind, TypeInfo, MAX_RESOLVE_STEPS};
use crate::addr::{Gva, GvaRange};
use crate::view::{read_u32, read_u64, VirtMemory};

/// Longest name read ([`Btf::name`]): the kernel's `KSYM_NAME_LEN`.
pub const MAX_NAME: usize = 512;
/// Most functions [`Btf::funcs_with_prefix`] returns.
pub const MAX_PREFIXED: usize = 4096;
/// Most parameters a prototype may have (`MAX_BPF_FUNC_ARGS` is 12; a
/// forged blob may claim 65535).
pub const MAX_PARAMS: u32 = 64;

/// `BTF_INT_SIGNED`.
pub const INT_SIGNED: u8 = 1;
/// `BTF_INT_CHAR`.
pub const INT_CHAR: u8 = 2;
/// `BTF_INT_BOOL`.
pub const INT_BOOL: u8 = 4;

/// A function parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Its name (empty when BTF has none).
    pub name: String,
    /// Its type id.
    pub type_id: u32,
}

/// A function's prototype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// The `BTF_KIND_FUNC` type.
    pub func: TypeInfo,
    /// The parameters, in order.
    pub params: Vec<Param>,
    /// The return type id (0: `void`).
    pub ret: u32,
}

/// An integer type's `BTF_KIND_INT` data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntInfo {
    /// `BTF_INT_ENCODING`: [`INT_SIGNED`], [`INT_CHAR`], [`INT_BOOL`].
    pub encoding: u8,
    /// `BTF_INT_OFFSET`: bits before the value (an old-style bitfield).
    pub offset: u8,
    /// `BTF_INT_BITS`: bits of the value.
    pub bits: u8,
}

impl IntInfo {
    /// Whether the integer is signed.
    pub fn signed(&self) -> bool {
        self.encoding & INT_SIGNED != 0
    }
}

/// What a type is, typedefs and qualifiers skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `void` (type id 0).
    Void,
    /// An integer.
    Int(TypeInfo, IntInfo),
    /// A pointer to type `to` (its id; 0 for `void *`).
    Ptr {
        /// The pointer type itself.
        t: TypeInfo,
        /// The pointee's id.
        to: u32,
    },
    /// An array of `n` elements of type `elem`.
    Array {
        /// The array type.
        t: TypeInfo,
        /// The element's id.
        elem: u32,
        /// The element count.
        n: u32,
    },
    /// A struct or union.
    Record(TypeInfo),
    /// An enum (`BTF_KIND_ENUM`, up to 32 bits) or `BTF_KIND_ENUM64`.
    Enum(TypeInfo),
    /// Anything else (float, function prototype, forward declaration).
    Other(TypeInfo),
}

impl<V: VirtMemory + ?Sized> Btf<'_, V> {
    /// The string at offset `off` of the string section (a split blob's
    /// offsets continue its parent's), at most [`MAX_NAME`] bytes.
    pub fn name(&self, off: u32) -> Result<String, BtfError> {
        let (b, local) = self
            .strings_at(off)
            .ok_or(BtfError::Malformed { at: off })?;
        let left = b.strings_len.saturating_sub(local) as usize;
        let mut out = Vec::new();
        let mut at = local;
        let mut chunk = [0u8; 64];
        while out.len() < MAX_NAME.min(left) {
            let n = chunk.len().min(left - out.len());
            let buf = chunk.get_mut(..n).ok_or(BtfError::Malformed { at })?;
            b.view.read_virt(b.strings.wrapping_add(at as u64), buf)?;
            if let Some(end) = buf.iter().position(|&c| c == 0) {
                out.extend_from_slice(buf.get(..end).unwrap_or(&[]));
                return Ok(String::from_utf8_lossy(&out).into_owned());
            }
            crate::fallible::try_reserve(&mut out, n)?;
            out.extend_from_slice(buf);
            at += n as u32;
        }
        Err(BtfError::Malformed { at: off })
    }

    /// The prototype of function `name` among this blob's own types (a
    /// module's split blob holds its functions), or `None` when BTF does
    /// not describe it.
    pub fn signature(&self, name: &str) -> Result<Option<Signature>, BtfError> {
        match self.find_named(Kind::Func, name)? {
            Some(func) => self.signature_of(&func).map(Some),
            None => Ok(None),
        }
    }

    /// Every function of this blob whose name starts with `prefix`, and
    /// its name, in one pass over the types (at most [`MAX_PREFIXED`]).
    pub fn funcs_with_prefix(&self, prefix: &str) -> Result<Vec<(String, TypeInfo)>, BtfError> {
        let mut out = Vec::new();
        let mut w = super::Window::new(
            self.view,
            self.types,
            self.types_len,
            super::WINDOW_SEQUENTIAL,
        );
        let mut off = 0u32;
        for id in self.first_id..self.first_id + self.count {
            let raw = w.get(off)?;
            let t = self.decode(id, off, &raw)?;
            if t.kind == Kind::Func
                && t.name_off != 0
                && self.string_matches(t.name_off, prefix.as_bytes(), false)?
            {
                if out.len() >= MAX_PREFIXED {
                    break;
                }
                crate::fallible::try_reserve(&mut out, 1)?;
                out.push((self.name(t.name_off)?, t));
            }
            off = super::next_type(off, t.kind, t.vlen)?;
        }
        Ok(out)
    }

    /// The named direct members of struct or union `t` (anonymous ones
    /// left out), in order: (name, member), at most [`MAX_PARAMS`].
    pub fn fields(&self, t: &TypeInfo) -> Result<Vec<(String, super::Member)>, BtfError> {
        if !matches!(t.kind, Kind::Struct | Kind::Union) || t.vlen > MAX_PARAMS {
            return Err(BtfError::UnexpectedType("struct"));
        }
        let owner = self.owner(t.id)?;
        let mut out = Vec::new();
        crate::fallible::try_reserve(&mut out, t.vlen as usize)?;
        for i in 0..t.vlen {
            let at = t
                .extra_at
                .checked_add(12 * i)
                .filter(|a| a.checked_add(12).is_some_and(|e| e <= owner.types_len))
                .ok_or(BtfError::Malformed { at: t.extra_at })?;
            let mut m = [0u8; 12];
            owner
                .view
                .read_virt(owner.types.wrapping_add(at as u64), &mut m)?;
            let (name_off, type_id, raw) = (u32_le(&m, 0), u32_le(&m, 4), u32_le(&m, 8));
            if name_off == 0 {
                continue;
            }
            let (bits, bit_offset) = if t.kind_flag {
                (raw >> 24, raw & 0xff_ffff)
            } else {
                (0, raw)
            };
            out.push((
                self.name(name_off)?,
                super::Member {
                    bit_offset: u64::from(bit_offset),
                    bitfield_bits: bits,
                    type_id,
                },
            ));
        }
        Ok(out)
    }

    /// The prototype of function `func`.
    pub fn signature_of(&self, func: &TypeInfo) -> Result<Signature, BtfError> {
        let func = *func;
        let proto = self.resolve(func.size_or_type)?;
        if proto.kind != Kind::FuncProto || proto.vlen > MAX_PARAMS {
            return Err(BtfError::UnexpectedType("function prototype"));
        }
        let owner = self.owner(proto.id)?;
        let mut params = Vec::new();
        crate::fallible::try_reserve(&mut params, proto.vlen as usize)?;
        for i in 0..proto.vlen {
            let at = proto
                .extra_at
                .checked_add(8 * i)
                .filter(|a| a.checked_add(8).is_some_and(|e| e <= owner.types_len))
                .ok_or(BtfError::Malformed { at: proto.extra_at })?;
            let mut p = [0u8; 8];
            owner
                .view
                .read_virt(owner.types.wrapping_add(at as u64), &mut p)?;
            let (name_off, type_id) = (u32_le(&p, 0), u32_le(&p, 4));
            // `...` is a last parameter with neither name nor type.
            if name_off == 0 && type_id == 0 {
                break;
            }
            let name = if name_off == 0 {
                String::new()
            } else {
                self.name(name_off)?
            };
            params.push(Param { name, type_id });
        }
        Ok(Signature {
            func,
            params,
            ret: proto.size_or_type,
        })
    }

    /// What type `id` is, its typedefs, qualifiers and type tags skipped
    /// (at most [`MAX_RESOLVE_STEPS`] of them).
    pub fn shape(&self, id: u32) -> Result<Shape, BtfError> {
        let mut id = id;
        for _ in 0..MAX_RESOLVE_STEPS {
            if id == 0 {
                return Ok(Shape::Void);
            }
            let t = self.type_info(id)?;
            if t.kind.is_alias() {
                id = t.size_or_type;
                continue;
            }
            return Ok(match t.kind {
                Kind::Int => Shape::Int(t, self.int_info(&t)?),
                Kind::Ptr => Shape::Ptr {
                    t,
                    to: t.size_or_type,
                },
                Kind::Array => {
                    let (elem, n) = self.array(&t)?;
                    Shape::Array { t, elem, n }
                }
                Kind::Struct | Kind::Union => Shape::Record(t),
                Kind::Enum | Kind::Enum64 => Shape::Enum(t),
                _ => Shape::Other(t),
            });
        }
        Err(BtfError::BadId(id))
    }

    /// The `BTF_KIND_INT` data of `t`.
    pub fn int_info(&self, t: &TypeInfo) -> Result<IntInfo, BtfError> {
        if t.kind != Kind::Int {
            return Err(BtfError::UnexpectedType("int"));
        }
        let owner = self.owner(t.id)?;
        if t.extra_at
            .checked_add(4)
            .is_none_or(|e| e > owner.types_len)
        {
            return Err(BtfError::Malformed { at: t.extra_at });
        }
        let mut b = [0u8; 4];
        owner
            .view
            .read_virt(owner.types.wrapping_add(t.extra_at as u64), &mut b)?;
        let v = u32::from_le_bytes(b);
        Ok(IntInfo {
            encoding: ((v >> 24) & 0xf) as u8,
            offset: ((v >> 16) & 0xff) as u8,
            bits: (v & 0xff) as u8,
        })
    }

    /// Whether type `id` is an 8-bit integer: the characters of a string.
    /// The kernel's own test (6.5+) also wants it unsigned, which `char`
    /// is from 6.2 (`-funsigned-char`); before that `char` is signed, and
    /// a `char *` is a string all the same.
    pub fn is_string_char(&self, id: u32) -> Result<bool, BtfError> {
        Ok(matches!(self.shape(id)?, Shape::Int(_, i) if i.bits == 8))
    }
}

impl<V: VirtMemory + ?Sized> Btf<'_, V> {
    /// [`Btf::find_named`] over this blob, then over the blob it extends.
    pub fn find_any(&self, kind: Kind, name: &str) -> Result<Option<TypeInfo>, BtfError> {
        match self.find_named(kind, name)? {
            Some(t) => Ok(Some(t)),
            None => match self.parent {
                Some(p) => p.find_named(kind, name),
                None => Ok(None),
            },
        }
    }
}

/// Most entries of the kernel's `btf_modules` list walked (one per loaded
/// module with BTF; the kernel allows far fewer modules than this).
pub const MAX_BTF_MODULES: u32 = 4096;
/// Largest module BTF blob accepted.
pub const MAX_MODULE_BTF: u32 = 16 << 20;

/// Where the BTF blob of the module whose `struct module` is at `module`
/// is (`CONFIG_DEBUG_INFO_BTF_MODULES`): the kernel copies each module's
/// `.BTF` into a `struct btf` at load and lists it in `btf_modules` (a
/// static `struct list_head` in kernel/bpf/btf.c, listed by kallsyms with
/// `CONFIG_KALLSYMS_ALL`) as a `struct btf_module { list; module; btf;
/// ... }`. Every layout comes from `base` (the kernel's BTF).
/// `Ok(None)`: the module has no BTF in the list.
pub fn module_btf<V: VirtMemory + ?Sized>(
    view: &V,
    base: &Btf<'_, V>,
    btf_modules: Gva,
    module: Gva,
) -> Result<Option<GvaRange>, BtfError> {
    let off = |t: &TypeInfo, name: &'static str| -> Result<u64, BtfError> {
        base.member(t, name)?
            .byte_offset()
            .map(u64::from)
            .ok_or(BtfError::UnexpectedType(name))
    };
    let entry_t = base.find(Kind::Struct, "btf_module")?;
    let btf_t = base.find(Kind::Struct, "btf")?;
    let (list, owner, blob) = (
        off(&entry_t, "list")?,
        off(&entry_t, "module")?,
        off(&entry_t, "btf")?,
    );
    let (data, data_size) = (off(&btf_t, "data")?, off(&btf_t, "data_size")?);
    let mut next = read_u64(view, btf_modules)?;
    for _ in 0..MAX_BTF_MODULES {
        if next == btf_modules.0 {
            return Ok(None);
        }
        let entry = Gva(next.wrapping_sub(list));
        if read_u64(view, entry.wrapping_add(owner))? == module.0 {
            let b = Gva(read_u64(view, entry.wrapping_add(blob))?);
            let at = read_u64(view, b.wrapping_add(data))?;
            let size = read_u32(view, b.wrapping_add(data_size))?;
            if size > MAX_MODULE_BTF {
                return Err(BtfError::TooLarge {
                    bytes: u64::from(size),
                });
            }
            let end = at.checked_add(u64::from(size)).ok_or(BtfError::BadHeader)?;
            return Ok(Some(GvaRange {
                start: Gva(at),
                end: Gva(end),
            }));
        }
        next = read_u64(view, Gva(next))?;
    }
    Err(BtfError::Malformed { at: 0 })
}
