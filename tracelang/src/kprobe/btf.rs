//! BTF arguments: parameter names, `$arg*`, member chains, `$retval`
//! typed from the return type, and `%pd`/`%pD`, resolved once, at probe
//! add, against the running guest's BTF ([`resolve_btf`]), into the plain
//! fetch chain a hit runs: a base, dereferences and a type. This follows
//! `parse_btf_arg`, `parse_btf_field`, `fetch_type_from_btf_type`,
//! `check_prepare_btf_string_fetch` and `parse_btf_bitfield` in the
//! kernel's kernel/trace/trace_probe.c (6.12):
//!
//! - `->` needs a pointer to a struct or union; `.` goes into an embedded
//!   one; each `->` group becomes one dereference at the sum of the
//!   group's member offsets (anonymous structs and unions included).
//! - Without a written type the value's type decides: signed and unsigned
//!   integers by width, an enum as `s32` (`s64` for a 64-bit one), a
//!   pointer as `x64`, a bitfield (or an odd-width integer) by shift and
//!   mask over the bytes at its offset, anything else `x64`.
//! - `:string`/`:ustring` need `char[]` (read in place) or `char *` (one
//!   more dereference); the characters must be 8-bit (signed too: `char`
//!   is signed before 6.2, where the kernel's own check would refuse it).
//! - `$argN` and a parameter at a return probe read the value saved at
//!   the entry.
//! - `%pd` reads `dentry->d_name.name`, `%pD` `file->f_path.dentry` first;
//!   both offsets come from BTF too.
//!
//! A dereference written around a BTF variable (`+8(file)`) makes the
//! value untyped again, as in the kernel.

use alloc::format;
use alloc::string::ToString;
use alloc::vec::Vec;

use guest_introspect::btf::typed::{Shape, Signature};
use guest_introspect::btf::{Btf, BtfError, Kind};
use guest_introspect::view::VirtMemory;

use super::parse::{fetch_insns, ParseError, ParseErrorKind as K};
use super::spec::*;

/// Whether any argument of `spec` needs the guest's BTF before it can be
/// fetched.
pub fn needs_btf(spec: &ProbeSpec) -> bool {
    spec.args.iter().any(|a| a.btf.is_some())
}

/// Resolves every BTF argument of `spec` against `btf` (the kernel's, or
/// for a module's function the module's split BTF over it; `Err` when the
/// guest has none or it cannot be read). On success no argument needs
/// BTF any more; on failure `spec` is left as it was and the error names
/// the offending token.
pub fn resolve_btf<V: VirtMemory + ?Sized>(
    spec: &mut ProbeSpec,
    btf: Result<&Btf<'_, V>, BtfError>,
) -> Result<(), ParseError> {
    let Some((pos, len)) = spec
        .args
        .iter()
        .find_map(|a| a.btf.as_ref())
        .map(|b| (b.pos, b.len))
    else {
        return Ok(());
    };
    // Without BTF for the function, the arguments BTF only refines stay
    // as they are written.
    let plain_without = |spec: &mut ProbeSpec| {
        if spec
            .args
            .iter()
            .all(|a| a.btf.as_ref().is_none_or(|b| b.optional))
        {
            for a in &mut spec.args {
                a.btf = None;
            }
            return true;
        }
        false
    };
    let btf = match btf {
        Ok(b) => b,
        Err(_) if plain_without(spec) => return Ok(()),
        Err(BtfError::Absent) => return Err(err_at(K::NoBtf, pos, len, "")),
        Err(e) => return Err(err_at(K::BtfUnreadable, pos, len, &e.to_string())),
    };
    // The prototype, looked up once (a walk over the types).
    let sig = match btf.signature(&spec.symbol) {
        Ok(s) => s,
        Err(_) if plain_without(spec) => return Ok(()),
        Err(e) => return Err(err_at(K::BtfUnreadable, pos, len, &e.to_string())),
    };
    let has_function = sig.is_some();
    if !has_function && plain_without(spec) {
        return Ok(());
    }
    let r = Resolver {
        btf,
        symbol: &spec.symbol,
        is_return: spec.kind.is_return(),
        sig,
    };
    let mut out: Vec<FetchArg> = Vec::with_capacity(spec.args.len());
    for (i, arg) in spec.args.iter().enumerate() {
        let Some(b) = arg.btf.clone() else {
            out.push(arg.clone());
            continue;
        };
        if b.optional && !has_function {
            let mut a = arg.clone();
            a.btf = None;
            out.push(a);
            continue;
        }
        if b.var == Some(BtfVar::All) {
            let sig = r.signature(&b)?;
            if sig.params.is_empty() {
                return Err(err_at(K::NoBtfArg, b.pos, b.len, "$arg*"));
            }
            for (n, p) in sig.params.iter().enumerate() {
                let (name, var) = if p.name.is_empty() {
                    (format!("arg{}", n + 1), BtfVar::Arg(n as u32 + 1))
                } else {
                    (p.name.clone(), BtfVar::Param(p.name.clone()))
                };
                let clash = RESERVED_ARG_NAMES.contains(&name.as_str())
                    || out.iter().any(|a| a.name == name)
                    || spec
                        .args
                        .get(i + 1..)
                        .is_some_and(|l| l.iter().any(|a| a.name == name));
                if clash {
                    return Err(err_at(K::UsedArgName, b.pos, b.len, &name));
                }
                let one = FetchArg {
                    body: name.clone(),
                    name,
                    expr: FetchExpr {
                        base: FetchBase::Arg(n as u32 + 1),
                        derefs: Vec::new(),
                    },
                    ty: ArgType::DEFAULT,
                    btf: Some(BtfArg {
                        var: Some(var),
                        fields: Vec::new(),
                        ..b.clone()
                    }),
                };
                out.push(r.resolve(one)?);
            }
            if out.len() > MAX_TRACE_ARGS {
                return Err(err_at(K::TooManyArgs, b.pos, b.len, "$arg*"));
            }
        } else {
            out.push(r.resolve(arg.clone())?);
        }
    }
    spec.args = out;
    Ok(())
}

fn err_at(kind: K, pos: usize, len: usize, token: &str) -> ParseError {
    let mut e = ParseError::new(kind, pos, token);
    e.len = len;
    e
}

struct Resolver<'a, 'b, 'v, V: ?Sized> {
    btf: &'b Btf<'v, V>,
    symbol: &'a str,
    is_return: bool,
    sig: Option<Signature>,
}

impl<V: VirtMemory + ?Sized> Resolver<'_, '_, '_, V> {
    fn read<T>(&self, r: Result<T, BtfError>, b: &BtfArg) -> Result<T, ParseError> {
        r.map_err(|e| err_at(K::BtfUnreadable, b.pos, b.len, &e.to_string()))
    }

    /// The probed function's prototype.
    fn signature(&self, b: &BtfArg) -> Result<&Signature, ParseError> {
        self.sig
            .as_ref()
            .ok_or_else(|| err_at(K::NoBtfEntry, b.pos, b.len, self.symbol))
    }

    /// One argument with a BTF part, made a plain fetch.
    fn resolve(&self, mut arg: FetchArg) -> Result<FetchArg, ParseError> {
        let Some(b) = arg.btf.take() else {
            return Ok(arg);
        };
        let outer = core::mem::take(&mut arg.expr.derefs);
        let mut derefs = Vec::new();
        // The BTF type of the value, while no written dereference hides it.
        let mut typed: Option<(u32, u64, u32)> = None;
        if let Some(var) = &b.var {
            let (base, tid) = self.variable(var, &b)?;
            arg.expr.base = base;
            let (tid, bitoffs, bitsize) = self.members(tid, &b, &mut derefs)?;
            if outer.is_empty() {
                typed = Some((tid, bitoffs, bitsize));
            }
        }
        derefs.extend(outer);
        arg.expr.derefs = derefs;
        if let Some((tid, bitoffs, bitsize)) = typed {
            if !b.typed {
                arg.ty = self.type_of(tid, bitoffs, bitsize, &b)?;
            } else if matches!(arg.ty, ArgType::String | ArgType::UString) && b.name_of.is_none() {
                self.string_fetch(tid, &mut arg, &b)?;
            }
        }
        if let Some(n) = b.name_of {
            self.name_of(n, &mut arg.expr, &b)?;
        }
        let fits = match arg.ty {
            ArgType::String | ArgType::UString => !arg.expr.derefs.is_empty(),
            ArgType::SymStr => arg.expr.derefs.last().is_none_or(|d| !d.user),
            _ => true,
        };
        if !fits {
            let kind = if arg.ty == ArgType::SymStr {
                K::BadSymStr
            } else {
                K::BadString
            };
            return Err(err_at(kind, b.type_pos, 0, ""));
        }
        if fetch_insns(&arg.expr, arg.ty) > FETCH_INSN_MAX - 1 {
            return Err(err_at(K::TooDeep, b.pos, b.len, &arg.body));
        }
        Ok(arg)
    }

    /// The variable's base fetch and BTF type id.
    fn variable(&self, var: &BtfVar, b: &BtfArg) -> Result<(FetchBase, u32), ParseError> {
        let sig = self.signature(b)?;
        let arg_base = |n: u32| {
            if self.is_return {
                FetchBase::EntryArg(n)
            } else {
                FetchBase::Arg(n)
            }
        };
        match var {
            BtfVar::RetVal => {
                if sig.ret == 0 {
                    return Err(err_at(K::NoRetval, b.pos, b.len, "$retval"));
                }
                Ok((FetchBase::RetVal, sig.ret))
            }
            BtfVar::Param(name) => {
                let (i, p) = sig
                    .params
                    .iter()
                    .enumerate()
                    .find(|(_, p)| &p.name == name)
                    .ok_or_else(|| err_at(K::NoBtfArg, b.pos, b.len, name))?;
                Ok((arg_base(i as u32 + 1), p.type_id))
            }
            BtfVar::Arg(n) => {
                let p = n
                    .checked_sub(1)
                    .and_then(|i| sig.params.get(i as usize))
                    .ok_or_else(|| err_at(K::NoBtfArg, b.pos, b.len, &format!("$arg{n}")))?;
                Ok((arg_base(*n), p.type_id))
            }
            BtfVar::All => Err(err_at(K::ArgStar, b.pos, b.len, "$arg*")),
        }
    }

    /// Walks the member accesses from a value of type `tid`, one
    /// dereference per `->` group; the last member's type, bit offset in
    /// its byte and bitfield width.
    fn members(
        &self,
        mut tid: u32,
        b: &BtfArg,
        derefs: &mut Vec<Deref>,
    ) -> Result<(u32, u64, u32), ParseError> {
        let mut bitoffs = 0u64;
        let mut bitsize = 0u32;
        let mut i = 0;
        while let Some(f) = b.fields.get(i) {
            // `->`: the value must point to a struct or union.
            let arrow_at = f.pos.saturating_sub(2);
            let to = match self.read(self.btf.shape(tid), b)? {
                Shape::Ptr { to, .. } => to,
                _ => return Err(err_at(K::NoPtrStruct, arrow_at, f.name.len() + 2, &f.name)),
            };
            let mut record = self.read(self.btf.shape(to), b)?;
            let mut group_bits = 0u64;
            while let Some(f) = b.fields.get(i) {
                let rt = match record {
                    Shape::Record(t) => t,
                    Shape::Ptr { .. } if !f.arrow => {
                        return Err(err_at(
                            K::DotThroughPointer,
                            f.pos.saturating_sub(1),
                            f.name.len() + 1,
                            &f.name,
                        ));
                    }
                    _ if !f.arrow => {
                        return Err(err_at(
                            K::DotThroughPointer,
                            f.pos.saturating_sub(1),
                            f.name.len() + 1,
                            &f.name,
                        ));
                    }
                    _ => return Err(err_at(K::NoPtrStruct, arrow_at, f.name.len() + 2, &f.name)),
                };
                let m = self
                    .read(self.btf.member_named(&rt, &f.name), b)?
                    .ok_or_else(|| err_at(K::NoBtfField, f.pos, f.name.len(), &f.name))?;
                group_bits += m.bit_offset;
                bitsize = m.bitfield_bits;
                tid = m.type_id;
                i += 1;
                match b.fields.get(i) {
                    Some(next) if !next.arrow => record = self.read(self.btf.shape(tid), b)?,
                    _ => break,
                }
            }
            let offset = i64::try_from(group_bits / 8)
                .map_err(|_| err_at(K::NoBtfField, f.pos, f.name.len(), &f.name))?;
            derefs.push(Deref {
                offset,
                user: false,
            });
            bitoffs = group_bits % 8;
        }
        Ok((tid, bitoffs, bitsize))
    }

    /// The fetch type BTF gives a value of type `tid` whose last member
    /// starts `bitoffs` bits into its byte and is `bitsize` bits wide (0:
    /// not a bitfield).
    fn type_of(
        &self,
        tid: u32,
        mut bitoffs: u64,
        mut bitsize: u32,
        b: &BtfArg,
    ) -> Result<ArgType, ParseError> {
        use IntType::*;
        let int = match self.read(self.btf.shape(tid), b)? {
            Shape::Enum(t) if t.kind == Kind::Enum64 => S64,
            Shape::Enum(_) => S32,
            Shape::Ptr { .. } => X64,
            Shape::Int(_, i) => match (i.signed(), i.bits) {
                (true, 8) => S8,
                (true, 16) => S16,
                (true, 32) => S32,
                (true, 64) => S64,
                (false, 8) => U8,
                (false, 16) => U16,
                (false, 32) => U32,
                (false, 64) => U64,
                (true, _) => X64,
                // An odd width: a bitfield whose size is in the type.
                (false, bits) => {
                    bitsize = u32::from(bits);
                    bitoffs += u64::from(i.offset);
                    U64
                }
            },
            _ => X64,
        };
        if (bitsize.is_multiple_of(8) && bitoffs == 0) || bitsize == 0 {
            return Ok(ArgType::Int(int));
        }
        let width = u8::try_from(bitsize).unwrap_or(64).min(64);
        let shift = u8::try_from(bitoffs).unwrap_or(0);
        let size = int.size() as u8;
        // The bytes the type stores, unless the field runs past them.
        let container = if u32::from(shift) + u32::from(width) <= u32::from(size) * 8 {
            size
        } else {
            8
        };
        if u32::from(shift) + u32::from(width) > 64 {
            return Err(err_at(K::BadBitfield, b.pos, b.len, ""));
        }
        Ok(ArgType::Bitfield {
            width,
            shift,
            container,
        })
    }

    /// `:string`/`:ustring` on a typed value: `char[]` is read in place,
    /// `char *` needs one more dereference.
    fn string_fetch(&self, tid: u32, arg: &mut FetchArg, b: &BtfArg) -> Result<(), ParseError> {
        let bad = || err_at(K::BadTypeForString, b.type_pos, 0, "");
        match self.read(self.btf.shape(tid), b)? {
            Shape::Array { elem, .. } if self.read(self.btf.is_string_char(elem), b)? => Ok(()),
            Shape::Ptr { to, .. } if to != 0 && self.read(self.btf.is_string_char(to), b)? => {
                arg.expr.derefs.push(Deref {
                    offset: 0,
                    user: arg.ty == ArgType::UString,
                });
                Ok(())
            }
            _ => Err(bad()),
        }
    }

    /// `%pd`/`%pD`: from the pointer to the name's characters.
    fn name_of(&self, n: NameOf, expr: &mut FetchExpr, b: &BtfArg) -> Result<(), ParseError> {
        let missing = || err_at(K::NoNameLayout, b.type_pos, 0, "");
        if n == NameOf::File {
            let at = self
                .path(b, "file", &["f_path", "dentry"])?
                .ok_or_else(missing)?;
            expr.derefs.push(Deref {
                offset: at,
                user: false,
            });
        }
        let at = self
            .path(b, "dentry", &["d_name", "name"])?
            .ok_or_else(missing)?;
        expr.derefs.push(Deref {
            offset: at,
            user: false,
        });
        expr.derefs.push(Deref {
            offset: 0,
            user: false,
        });
        Ok(())
    }

    /// Byte offset of `a.b...` in `struct name`, `None` when the layout
    /// has no such path of members.
    fn path(&self, b: &BtfArg, name: &str, members: &[&str]) -> Result<Option<i64>, ParseError> {
        let Some(mut t) = self.read(self.btf.find_any(Kind::Struct, name), b)? else {
            return Ok(None);
        };
        let mut bits = 0u64;
        for (k, m) in members.iter().enumerate() {
            let Some(found) = self.read(self.btf.member_named(&t, m), b)? else {
                return Ok(None);
            };
            bits += found.bit_offset;
            if k + 1 < members.len() {
                match self.read(self.btf.shape(found.type_id), b)? {
                    Shape::Record(inner) => t = inner,
                    _ => return Ok(None),
                }
            }
        }
        Ok(bits.is_multiple_of(8).then_some((bits / 8) as i64))
    }
}
