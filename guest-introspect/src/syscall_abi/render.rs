//! The generator's output: one architecture's table as Rust source, laid
//! out as rustfmt lays it out, so that the committed files are both
//! rustfmt-clean and byte-for-byte what the generator writes.

use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use super::parse::{parse_prototypes, parse_tbl, Proto, TblEntry};

/// The file of `syscalls.h` under a kernel source tree.
pub const PROTOTYPES: &str = "include/linux/syscalls.h";

/// An architecture a table is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// x86-64 (`syscall_64.tbl`, ABIs `common` and `64`; `x32` left out).
    X86_64,
    /// i386 (`syscall_32.tbl`, ABI `i386`).
    I386,
}

impl Arch {
    /// Both, in the order the generator writes them.
    pub const ALL: [Arch; 2] = [Arch::X86_64, Arch::I386];

    /// Its table under a kernel source tree.
    pub fn tbl(self) -> &'static str {
        match self {
            Arch::X86_64 => "arch/x86/entry/syscalls/syscall_64.tbl",
            Arch::I386 => "arch/x86/entry/syscalls/syscall_32.tbl",
        }
    }

    /// The ABI column values kept.
    pub fn abis(self) -> &'static [&'static str] {
        match self {
            Arch::X86_64 => &["common", "64"],
            Arch::I386 => &["i386"],
        }
    }

    /// The prefix of the wrapper symbols (`__x64_`, `__ia32_`).
    pub fn prefix(self) -> &'static str {
        match self {
            Arch::X86_64 => "__x64_",
            Arch::I386 => "__ia32_",
        }
    }

    /// The generated file's name in `src/syscall_abi/`.
    pub fn file(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64.rs",
            Arch::I386 => "i386.rs",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86-64",
            Arch::I386 => "i386",
        }
    }
}

/// `VERSION.PATCHLEVEL.SUBLEVEL[EXTRAVERSION]` of a kernel's top Makefile.
pub fn kernel_version(makefile: &str) -> Option<String> {
    let var = |name: &str| -> Option<&str> {
        makefile.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == name).then(|| v.trim())
        })
    };
    let (v, p, s) = (var("VERSION")?, var("PATCHLEVEL")?, var("SUBLEVEL")?);
    if [v, p, s].iter().any(|x| x.is_empty()) {
        return None;
    }
    Some(format!("{v}.{p}.{s}{}", var("EXTRAVERSION").unwrap_or("")))
}

/// One generated entry, before layout.
struct Row<'a> {
    entry: &'a TblEntry,
    symbol: String,
    proto: Option<&'a Proto>,
}

/// The table of `arch` as Rust source: the lines of its `tbl` text, sorted
/// by number (the first line of a number kept), each with the arguments
/// of the prototype of its entry point in `syscalls_h` (its native one for
/// an i386 line with a compat entry point). `version` goes in the header.
pub fn generate(arch: Arch, tbl: &str, syscalls_h: &str, version: &str) -> String {
    let mut entries = parse_tbl(tbl, arch.abis());
    entries.sort_by_key(|e| e.nr);
    entries.dedup_by_key(|e| e.nr);
    let protos = parse_prototypes(syscalls_h);
    let by_name: BTreeMap<&str, &Proto> = protos.iter().map(|p| (p.name.as_str(), p)).collect();
    let rows: Vec<Row<'_>> = entries
        .iter()
        .map(|e| Row {
            entry: e,
            symbol: e.symbol(arch.prefix()),
            proto: by_name
                .get(e.entry.as_str())
                .copied()
                .filter(|p| !p.differs),
        })
        .collect();

    let mut out = String::new();
    header(&mut out, arch, version, &rows);
    out.push_str("\nuse super::AbiCall;\n\n");
    let _ = writeln!(
        out,
        "/// The {} system calls of Linux {version}, by number.",
        arch.title()
    );
    out.push_str("pub static CALLS: &[AbiCall] = &[\n");
    for r in &rows {
        out.push_str("    AbiCall {\n");
        let _ = writeln!(out, "        nr: {},", r.entry.nr);
        let _ = writeln!(out, "        name: \"{}\",", r.entry.name);
        let _ = writeln!(out, "        entry: \"{}\",", r.symbol);
        let _ = writeln!(out, "        typed: {},", r.proto.is_some());
        args(&mut out, r.proto.map(|p| p.args.as_slice()).unwrap_or(&[]));
        out.push_str("    },\n");
    }
    out.push_str("];\n");
    out
}

fn header(out: &mut String, arch: Arch, version: &str, rows: &[Row<'_>]) {
    let abis: Vec<String> = arch.abis().iter().map(|a| format!("`{a}`")).collect();
    let mut intro = format!(
        "The {} system calls of Linux {version}: numbers, names and entry points from `{}` \
         (ABI {}), argument types and names from the `sys_` prototypes of `{PROTOTYPES}`.",
        arch.title(),
        arch.tbl(),
        abis.join(", ")
    );
    if arch == Arch::I386 {
        intro.push_str(
            " An entry with a compat entry point is the compat wrapper \
             (`__ia32_compat_sys_open`), what a 64-bit kernel runs for a 32-bit caller; \
             its arguments are those of the native `sys_` prototype of the same line, \
             as a 32-bit kernel declares them (the compat prototypes, in \
             `include/linux/compat.h`, are not read).",
        );
    }
    wrap(out, "//! ", &intro, 80);
    out.push_str("//!\n");
    wrap(
        out,
        "//! ",
        "Generated by `scripts/gen-syscall-abi.sh` (`cargo run -p guest-introspect \
         --example gen_syscall_abi -- KERNEL_SOURCE`) from the kernel source; do not edit.",
        80,
    );
    let typed = rows.iter().filter(|r| r.proto.is_some()).count();
    let untyped: Vec<String> = rows
        .iter()
        .filter(|r| r.proto.is_none())
        .map(|r| format!("`{}`", r.entry.entry))
        .collect();
    out.push_str("//!\n");
    wrap(
        out,
        "//! ",
        &format!(
            "{} calls, {typed} with arguments (`typed`). The others have no prototype with \
             named parameters in syscalls.h, or one per configuration under `#if`: {}.",
            rows.len(),
            untyped.join(", ")
        ),
        80,
    );
}

/// `text` word-wrapped into lines of at most `width` columns, each begun
/// with `prefix`.
fn wrap(out: &mut String, prefix: &str, text: &str, width: usize) {
    let mut line = String::from(prefix);
    for w in text.split(' ') {
        if line.len() > prefix.len() && line.len() + 1 + w.len() > width {
            out.push_str(line.trim_end());
            out.push('\n');
            line = String::from(prefix);
        }
        if line.len() > prefix.len() {
            line.push(' ');
        }
        line.push_str(w);
    }
    if line.len() > prefix.len() {
        out.push_str(&line);
        out.push('\n');
    }
}

/// rustfmt's widths (its defaults): an array of tuples stays on one line
/// when its items take at most this many columns; a tuple when its
/// contents do.
const ONE_LINE: usize = 60;

fn tuple_inner(ty: &str, name: &str) -> String {
    format!("\"{ty}\", \"{name}\"")
}

/// The `args` field, as rustfmt lays it out.
fn args(out: &mut String, args: &[(String, String)]) {
    let tuples: Vec<String> = args
        .iter()
        .map(|(t, n)| format!("({})", tuple_inner(t, n)))
        .collect();
    let joined = tuples.join(", ");
    match args {
        [] => out.push_str("        args: &[],\n"),
        [(t, n)] => {
            if tuple_inner(t, n).len() <= ONE_LINE {
                let _ = writeln!(out, "        args: &[{joined}],");
            } else {
                let _ = writeln!(
                    out,
                    "        args: &[(\n            \"{t}\",\n            \"{n}\",\n        )],"
                );
            }
        }
        _ if joined.len() <= ONE_LINE => {
            let _ = writeln!(out, "        args: &[{joined}],");
        }
        _ => {
            out.push_str("        args: &[\n");
            for (t, n) in args {
                if tuple_inner(t, n).len() <= ONE_LINE {
                    let _ = writeln!(out, "            ({}),", tuple_inner(t, n));
                } else {
                    let _ = writeln!(
                        out,
                        "            (\n                \"{t}\",\n                \"{n}\",\n            ),"
                    );
                }
            }
            out.push_str("        ],\n");
        }
    }
}
