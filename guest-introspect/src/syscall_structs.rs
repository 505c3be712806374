//! The structs a system call reads from its caller (`openat2`'s `struct
//! open_how`, `clone3`'s `struct clone_args`, a sleep's `struct
//! __kernel_timespec`): their scalar members' names, offsets and sizes
//! from the guest's BTF, so that a tracer can read each member at the
//! call's entry through the user pointer. Only structs the call takes as
//! input are listed ([`INPUT_STRUCTS`], by struct and argument name: a
//! `struct __kernel_timespec *` is `nanosleep`'s request as `rqtp` and
//! its answer as `rmtp`): a struct the call fills in (`stat`'s buffer,
//! `clock_gettime`'s `tp`) holds nothing yet at the entry.

use alloc::string::String;
use alloc::vec::Vec;

use crate::btf::typed::Shape;
use crate::btf::{Btf, Kind};
use crate::view::VirtMemory;

/// Structs that system calls read from their caller: (BTF name, the
/// argument names under which the calls of include/linux/syscalls.h
/// pass it in).
pub const INPUT_STRUCTS: [(&str, &[&str]); 5] = [
    ("open_how", &["how"]),
    ("clone_args", &["uargs"]),
    ("mount_attr", &["uattr"]),
    ("rlimit64", &["new_rlim"]),
    (
        "__kernel_timespec",
        &["rqtp", "utime", "tsp", "timeout", "abs_timeout", "uts"],
    ),
];
/// Most members read of one struct.
pub const MAX_FIELDS: usize = 16;
/// Largest struct read.
pub const MAX_STRUCT_BYTES: u32 = 128;

/// One scalar member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StructField {
    /// Its name (`flags`).
    pub name: String,
    /// Its byte offset in the struct.
    pub offset: u32,
    /// Its bytes: 1, 2, 4 or 8.
    pub size: u8,
    /// Whether it is a signed integer.
    pub signed: bool,
}

/// A struct argument of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgStruct {
    /// The argument's index (0 for the first).
    pub arg: u8,
    /// The struct's name (`open_how`).
    pub name: String,
    /// Its scalar members, in order (members that are neither integers,
    /// enums nor pointers are left out, as are bitfields).
    pub fields: Vec<StructField>,
}

/// The struct name of argument `arg` of C type `ctype` when it passes
/// one of [`INPUT_STRUCTS`] in (`struct open_how *how`, `const struct
/// __kernel_timespec __user *rqtp`).
pub fn input_struct(ctype: &str, arg: &str) -> Option<&'static str> {
    let words: Vec<&str> = ctype
        .split(|c: char| c.is_whitespace() || c == '*')
        .filter(|w| !w.is_empty() && !matches!(*w, "const" | "__user" | "volatile"))
        .collect();
    if ctype.matches('*').count() != 1 {
        return None;
    }
    match words.as_slice() {
        ["struct", name] => INPUT_STRUCTS
            .iter()
            .find(|(s, args)| s == name && args.contains(&arg))
            .map(|(s, _)| *s),
        _ => None,
    }
}

/// The input structs among `args` ((C type, name) of each argument), with
/// their layouts from `btf`. A struct BTF lacks, or whose layout is
/// unreadable or larger than [`MAX_STRUCT_BYTES`], is left out.
pub fn input_structs<V: VirtMemory + ?Sized>(
    btf: &Btf<'_, V>,
    args: &[(String, String)],
) -> Vec<ArgStruct> {
    let mut out = Vec::new();
    for (i, (ctype, arg)) in args.iter().enumerate() {
        let Some(name) = input_struct(ctype, arg) else {
            continue;
        };
        let Ok(arg) = u8::try_from(i) else {
            continue;
        };
        let Some(fields) = layout(btf, name) else {
            continue;
        };
        if out.try_reserve(1).is_err() {
            break;
        }
        out.push(ArgStruct {
            arg,
            name: String::from(name),
            fields,
        });
    }
    out
}

/// The scalar members of struct `name`.
fn layout<V: VirtMemory + ?Sized>(btf: &Btf<'_, V>, name: &str) -> Option<Vec<StructField>> {
    let t = btf.find_named(Kind::Struct, name).ok()??;
    if t.size_or_type > MAX_STRUCT_BYTES {
        return None;
    }
    let mut out = Vec::new();
    for (name, m) in btf.fields(&t).ok()? {
        if out.len() >= MAX_FIELDS {
            break;
        }
        let Some(offset) = m.byte_offset() else {
            continue;
        };
        let (size, signed) = match btf.shape(m.type_id).ok()? {
            Shape::Int(t, i) => (t.size_or_type, i.signed()),
            Shape::Enum(t) => (t.size_or_type, false),
            Shape::Ptr { .. } => (8, false),
            _ => continue,
        };
        let Ok(size) = u8::try_from(size) else {
            continue;
        };
        if !matches!(size, 1 | 2 | 4 | 8) || offset + u32::from(size) > t.size_or_type {
            continue;
        }
        out.try_reserve(1).ok()?;
        out.push(StructField {
            name,
            offset,
            size,
            signed,
        });
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pointers_to_input_structs() {
        assert_eq!(input_struct("struct open_how *", "how"), Some("open_how"));
        assert_eq!(
            input_struct("const struct __kernel_timespec __user *", "rqtp"),
            Some("__kernel_timespec")
        );
        // The answer's buffer, filled by the call.
        assert_eq!(input_struct("struct __kernel_timespec *", "rmtp"), None);
        assert_eq!(input_struct("struct stat *", "statbuf"), None);
        assert_eq!(input_struct("struct open_how", "how"), None);
        assert_eq!(input_struct("struct open_how **", "how"), None);
        assert_eq!(input_struct("int", "how"), None);
    }
}
