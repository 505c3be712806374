//! The two kernel files the ABI tables are generated from, parsed: the
//! `syscall_*.tbl` lists (numbers, names, entry points) and the
//! `asmlinkage long sys_NAME(...);` prototypes of `include/linux/syscalls.h`
//! (argument types and names). Pure functions over text, for the generator
//! and the tests; nothing here reads the guest.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;

/// One line of a `syscall_*.tbl`:
/// `<number> <abi> <name> <entry point> [<compat entry point> [noreturn]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TblEntry {
    /// The call's number.
    pub nr: u32,
    /// Its ABI column (`common`, `64`, `x32`, `i386`).
    pub abi: String,
    /// Its name (`stat`).
    pub name: String,
    /// Its entry point (`sys_newstat`).
    pub entry: String,
    /// Its compat entry point (`compat_sys_open`), when the line has one
    /// (`-` is none).
    pub compat: Option<String>,
    /// Whether the line marks the call `noreturn`.
    pub noreturn: bool,
}

impl TblEntry {
    /// The wrapper symbol the kernel's table points at: `prefix` (`__x64_`,
    /// `__ia32_`) and the compat entry point when there is one, else the
    /// entry point (`__ia32_compat_sys_open`, `__x64_sys_read`).
    pub fn symbol(&self, prefix: &str) -> String {
        let mut s = String::from(prefix);
        s.push_str(self.compat.as_deref().unwrap_or(&self.entry));
        s
    }
}

/// The lines of a `syscall_*.tbl` whose ABI is one of `abis`, in file
/// order. Comments, blank lines, lines whose number does not parse and
/// numbers reserved without an entry point are left out.
pub fn parse_tbl(text: &str, abis: &[&str]) -> Vec<TblEntry> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut f = line.split_whitespace();
        let (Some(nr), Some(abi), Some(name)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let Ok(nr) = nr.parse::<u32>() else {
            continue;
        };
        if !abis.contains(&abi) {
            continue;
        }
        let Some(entry) = f.next().filter(|e| *e != "-") else {
            continue;
        };
        let compat = f.next();
        let noreturn = f.next() == Some("noreturn");
        out.push(TblEntry {
            nr,
            abi: String::from(abi),
            name: String::from(name),
            entry: String::from(entry),
            compat: compat.filter(|c| *c != "-").map(String::from),
            noreturn,
        });
    }
    out
}

/// One `asmlinkage long sys_NAME(...);` prototype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proto {
    /// The function (`sys_openat`).
    pub name: String,
    /// (C type, name) of each parameter: `__user` dropped, words single
    /// spaced, a space before a run of `*` and none after it (`const char
    /// *const *`), an array parameter as the pointer it is (`int *`).
    pub args: Vec<(String, String)>,
    /// Later declarations of the same function (under other `#if`
    /// branches), ignored: the first one is kept.
    pub duplicates: u32,
    /// Whether one of those declares other parameters (or does not parse):
    /// then the one kept holds only for some configurations.
    pub differs: bool,
}

/// The `sys_` prototypes of `syscalls.h`, in file order, the first of each
/// name. Comments and preprocessor lines are ignored; a declaration may
/// span lines. A declaration that does not parse to named parameters of
/// plain types (an unnamed parameter, a function pointer, a body) gives no
/// entry, and neither do later ones of its name.
pub fn parse_prototypes(text: &str) -> Vec<Proto> {
    let code = strip_preprocessor(&strip_comments(text));
    let toks = tokens(&code);
    let mut out: Vec<Proto> = Vec::new();
    // name -> its entry in `out`, None when its first declaration was odd.
    let mut seen: BTreeMap<String, Option<usize>> = BTreeMap::new();
    let mut i = 0;
    while i < toks.len() {
        if toks.get(i) != Some(&"asmlinkage") {
            i += 1;
            continue;
        }
        // The declaration: up to `;`, `{` or the next `asmlinkage`.
        let start = i + 1;
        let mut end = start;
        while let Some(&t) = toks.get(end) {
            if t == ";" || t == "{" || t == "asmlinkage" {
                break;
            }
            end += 1;
        }
        let terminated = toks.get(end) == Some(&";");
        let decl = toks.get(start..end).unwrap_or(&[]);
        i = end;
        let Some(name) = function_name(decl) else {
            continue;
        };
        if !name.starts_with("sys_") {
            continue;
        }
        let args = if terminated { parameters(decl) } else { None };
        match seen.get(name) {
            Some(kept) => {
                if let Some(p) = kept.and_then(|k| out.get_mut(k)) {
                    p.duplicates += 1;
                    if args.as_ref() != Some(&p.args) {
                        p.differs = true;
                    }
                }
            }
            None => {
                let kept = args.map(|args| {
                    out.push(Proto {
                        name: String::from(name),
                        args,
                        duplicates: 0,
                        differs: false,
                    });
                    out.len() - 1
                });
                seen.insert(String::from(name), kept);
            }
        }
    }
    out
}

/// `text` with its `/* */` and `//` comments replaced by a space (string
/// and character literals kept as they are).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    // Keep the line structure for the preprocessor pass.
                    if c == '\n' {
                        out.push('\n');
                    }
                    prev = c;
                }
                out.push(' ');
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '"' | '\'' => {
                out.push(c);
                let mut escaped = false;
                for d in chars.by_ref() {
                    out.push(d);
                    if escaped {
                        escaped = false;
                    } else if d == '\\' {
                        escaped = true;
                    } else if d == c || d == '\n' {
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// `text` without its preprocessor directives (a `#` line and the lines it
/// continues with a trailing backslash).
fn strip_preprocessor(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut continued = false;
    for line in text.lines() {
        let directive = continued || line.trim_start().starts_with('#');
        continued = directive && line.trim_end().ends_with('\\');
        if !directive {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// C tokens: identifiers and numbers whole, every other non-blank
/// character alone.
fn tokens(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(c) = rest.chars().next() {
        let len = if c.is_ascii_alphanumeric() || c == '_' {
            rest.find(|d: char| !(d.is_ascii_alphanumeric() || d == '_'))
                .unwrap_or(rest.len())
        } else {
            c.len_utf8()
        };
        let (tok, tail) = rest.split_at(len);
        if !c.is_whitespace() {
            out.push(tok);
        }
        rest = tail;
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
}

/// The declared function: the identifier before the first `(`, after at
/// least one word of return type.
fn function_name<'a>(decl: &[&'a str]) -> Option<&'a str> {
    let open = decl.iter().position(|&t| t == "(")?;
    let name = *decl.get(open.checked_sub(1)?)?;
    let ret = decl.get(..open - 1)?;
    (is_ident(name) && !ret.is_empty() && ret.iter().all(|&t| is_ident(t) || t == "*"))
        .then_some(name)
}

/// The parameters of `decl` (`ret NAME ( params )`), or None when the
/// list is not one of named parameters of plain types.
fn parameters(decl: &[&str]) -> Option<Vec<(String, String)>> {
    let open = decl.iter().position(|&t| t == "(")?;
    let inner = decl.get(open + 1..)?;
    let close = inner.iter().position(|&t| t == ")")?;
    // Nothing after the `)` (an attribute, a second declarator), no nested
    // parenthesis (a function pointer).
    if close + 1 != inner.len() {
        return None;
    }
    let list = inner.get(..close)?;
    if list.contains(&"(") {
        return None;
    }
    if list == ["void"] {
        return Some(Vec::new());
    }
    if list.is_empty() {
        return None;
    }
    list.split(|&t| t == ",").map(parameter).collect()
}

/// Words that end a type, never a parameter name.
const TYPE_WORDS: &[&str] = &[
    "void", "char", "short", "int", "long", "signed", "unsigned", "float", "double", "_Bool",
    "const", "volatile", "restrict", "struct", "union", "enum",
];
/// Words that qualify a type without being one.
const QUALIFIERS: &[&str] = &["const", "volatile", "restrict"];

/// (type, name) of one parameter, or None when it has no name or is not a
/// plain (possibly array) declaration.
fn parameter(toks: &[&str]) -> Option<(String, String)> {
    let mut t: Vec<&str> = toks.iter().copied().filter(|&t| t != "__user").collect();
    // `T name[N]` is `T *name`.
    let mut array = false;
    if t.last() == Some(&"]") {
        let open = t.iter().position(|&x| x == "[")?;
        let dim = t.get(open + 1..t.len() - 1)?;
        if dim.len() > 1
            || dim
                .iter()
                .any(|d| !d.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        {
            return None;
        }
        t.truncate(open);
        array = true;
    }
    let (&name, ty) = t.split_last()?;
    if !is_ident(name) || TYPE_WORDS.contains(&name) {
        return None;
    }
    if matches!(ty.last(), Some(&"struct" | &"union" | &"enum")) {
        return None;
    }
    if !ty.iter().any(|w| is_ident(w) && !QUALIFIERS.contains(w)) {
        return None;
    }
    if !ty.iter().all(|&w| is_ident(w) || w == "*") {
        return None;
    }
    let mut s = String::new();
    let mut prev_star = false;
    for &w in ty.iter().chain(array.then_some(&"*")) {
        let star = w == "*";
        if !s.is_empty() && !prev_star {
            s.push(' ');
        }
        s.push_str(w);
        prev_star = star;
    }
    Some((s, String::from(name)))
}
