//! The kprobe_events parser.
//!
//! It follows `__trace_kprobe_create` (kernel/trace/trace_kprobe.c) and
//! `traceprobe_parse_probe_arg` (kernel/trace/trace_probe.c): the same
//! tokens, defaults, limits and refusals, restricted to what a probe at a
//! function's fentry site can do. See the module documentation of
//! [`crate::kprobe`] for the accepted syntax and every deviation.
//!
//! Errors carry the byte offset and length of the offending token in the
//! spec as given (the kernel's `error_log` caret counts in the re-joined
//! command instead; the two agree when words are separated by one space).

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use super::num::{kstrtoll, kstrtoull, negate};
use super::spec::*;

/// What is wrong with a spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseErrorKind {
    /// Nothing but whitespace.
    Empty,
    /// The command is not `p`, `r` or `-:`.
    BadCommand,
    /// `p<N>`: MAXACTIVE is only for return probes.
    MaxactiveOnEntry,
    /// `r<N>` with N not a positive number.
    BadMaxactive,
    /// `r<N>` with N above 4096.
    MaxactiveTooBig,
    /// `p:/EVENT`.
    NoGroupName,
    /// Group name of 64 characters or more.
    GroupTooLong,
    /// Group name not an identifier.
    BadGroupName,
    /// `p:` with nothing after the colon.
    NoEventName,
    /// Event name of 64 characters or more.
    EventTooLong,
    /// Event name not an identifier.
    BadEventName,
    /// No probe point after the command.
    MissingSymbol,
    /// A raw address as probe point.
    AddressProbe,
    /// `MOD:SYM` whose `MOD` is not a module name.
    ModuleSymbol,
    /// A uprobe (`PATH:OFFSET`).
    UprobeSpec,
    /// Not a kernel symbol name.
    BadSymbol,
    /// `SYM%something` other than `%return`.
    BadProbeSuffix,
    /// `SYM+x` with x not a non-negative number.
    BadProbeOffset,
    /// `SYM+N` with N != 0.
    NotFunctionEntry,
    /// More than 128 fetch arguments.
    TooManyArgs,
    /// `=FETCHARG`.
    NoArgName,
    /// Argument name longer than 32.
    ArgNameTooLong,
    /// Argument name not an identifier.
    BadArgName,
    /// Argument name reserved or already used.
    UsedArgName,
    /// `NAME=` with nothing after it.
    NoArgBody,
    /// Argument longer than 63 characters.
    ArgTooLong,
    /// Unknown `:TYPE`.
    BadType,
    /// `:TYPE[N]`.
    ArrayType,
    /// `$comm` or `\"..."` with a type other than `string`.
    NeedStringType,
    /// `:string` on something that is not a memory fetch.
    BadString,
    /// `:symstr` on an immediate, `$stack`, `$comm` or a user dereference.
    BadSymStr,
    /// Malformed `b<width>@<shift>/<container>`.
    BadBitfield,
    /// `$retval` on an entry probe.
    RetvalOnEntry,
    /// `$stackN` with N above 2048.
    BadStackNum,
    /// `$argN` with N zero or above 2048.
    BadArgNum,
    /// `$arg*` with a name, a type or a member access.
    ArgStar,
    /// Unknown `$` variable.
    BadVar,
    /// Unknown register; the kernel's name of an assembler register name
    /// is suggested.
    BadRegName {
        /// `%ax` for `%rax`, and so on.
        suggestion: Option<Reg>,
    },
    /// `@x` with x not an address or symbol.
    BadMemAddr,
    /// `@+OFFS` (a uprobe file offset).
    FileOffset,
    /// `\x` with x not a number.
    BadImm,
    /// `\"...` without the closing quote.
    ImmStrNoClose,
    /// Too many nested dereferences.
    TooDeep,
    /// `+OFFS` without `(`.
    DerefNeedBrace,
    /// `+x(` with x not a number.
    BadDerefOffset,
    /// `+OFFS(...` without `)`.
    DerefOpenBrace,
    /// Text after the closing `)`.
    TrailingText,
    /// `+OFFS($comm)` or `+OFFS(\"...")`.
    CommCantDeref,
    /// Not a fetch argument at all.
    BadFetchArg,
    /// A `-` that does not start `->` in a BTF argument.
    BadHyphen,
    /// A member name that is empty or not a C identifier.
    BadMemberName,
    /// `.` right after a function's parameter (it is a pointer or a
    /// scalar: a struct passed by value is not supported, as in Linux).
    DotOnArg,
    /// A BTF argument on a kernel without BTF.
    NoBtf,
    /// The function has no prototype in BTF.
    NoBtfEntry,
    /// The function has no parameter of that name (or number).
    NoBtfArg,
    /// `$retval` of a function that returns `void`.
    NoRetval,
    /// `->` on something that is not a pointer to a struct or union.
    NoPtrStruct,
    /// `.` on a pointer (write `->`), or on something that is not a
    /// struct or union.
    DotThroughPointer,
    /// The struct or union has no member of that name.
    NoBtfField,
    /// `:string`/`:ustring` on a BTF value that is not `char *` or
    /// `char[]`.
    BadTypeForString,
    /// `%pd`/`%pD` on a kernel whose BTF lacks `struct dentry` or
    /// `struct file` as the kernel lays them out.
    NoNameLayout,
    /// The guest's BTF could not be read (the token says why).
    BtfUnreadable,
    /// `-:EVENT` followed by more words.
    DeleteExtra,
}

impl ParseErrorKind {
    /// The message, lower case, without the token.
    pub fn message(self) -> &'static str {
        use ParseErrorKind::*;
        match self {
            Empty => "empty probe definition",
            BadCommand => "probe definition must start with 'p', 'r' or '-:'",
            MaxactiveOnEntry => "maxactive is only for return probes",
            BadMaxactive => "bad maxactive number",
            MaxactiveTooBig => "maxactive is too big (at most 4096)",
            NoGroupName => "group name is not specified",
            GroupTooLong => "group name is too long (at most 63 characters)",
            BadGroupName => "group name must be a C identifier",
            NoEventName => "event name is not specified",
            EventTooLong => "event name is too long (at most 63 characters)",
            BadEventName => "event name must be a C identifier",
            MissingSymbol => "missing probe point (a function name)",
            AddressProbe => "probing a raw address is not supported, name the function",
            ModuleSymbol => "bad module name (MOD:SYM)",
            UprobeSpec => "uprobes are not supported",
            BadSymbol => "bad symbol name",
            BadProbeSuffix => "bad probe point suffix (only %return)",
            BadProbeOffset => "bad probe offset",
            NotFunctionEntry => {
                "only function entry can be probed (SYM or SYM+0), not an offset into it"
            }
            TooManyArgs => "too many arguments (at most 128)",
            NoArgName => "argument name is not specified",
            ArgNameTooLong => "argument name is too long (at most 32 characters)",
            BadArgName => "argument name must be a C identifier",
            UsedArgName => "argument name is reserved or already used",
            NoArgBody => "no argument expression",
            ArgTooLong => "argument expression is too long (at most 63 characters)",
            BadType => "unknown type",
            ArrayType => "array types are not supported",
            NeedStringType => "$comm and immediate strings only take the string type",
            BadString => "string types need a memory fetch such as +0(%si)",
            BadSymStr => "symstr does not take immediates, $stack, $comm or user memory",
            BadBitfield => "bad bitfield (b<width>@<shift>/<container bits>)",
            RetvalOnEntry => "$retval is only available on return probes",
            BadStackNum => "bad stack number (at most 2048)",
            BadArgNum => "bad argument number (1 to 2048)",
            ArgStar => "$arg* takes no name, type or member access",
            BadVar => "bad $-variable",
            BadRegName { .. } => "bad register name",
            BadMemAddr => "bad memory address",
            FileOffset => "file offsets (@+OFFS) are only for uprobes",
            BadImm => "bad immediate value",
            ImmStrNoClose => "immediate string is not closed with '\"'",
            TooDeep => "dereference is nested too deep",
            DerefNeedBrace => "dereference needs '('",
            BadDerefOffset => "bad dereference offset",
            DerefOpenBrace => "dereference '(' is not closed",
            TrailingText => "unexpected text after ')'",
            CommCantDeref => "$comm and immediate strings can not be dereferenced",
            BadFetchArg => "bad fetch argument",
            BadHyphen => "'-' must be part of '->'",
            BadMemberName => "member name must be a C identifier",
            DotOnArg => "'.' on a function argument is not supported, use '->'",
            NoBtf => "the kernel has no BTF, so no BTF arguments",
            NoBtfEntry => "BTF has no prototype for the probed function",
            NoBtfArg => "the probed function has no such parameter",
            NoRetval => "the probed function returns void",
            NoPtrStruct => "'->' needs a pointer to a struct or union",
            DotThroughPointer => "'.' needs a struct or union, not a pointer (use '->')",
            NoBtfField => "no such member",
            BadTypeForString => "string types need a char * or char[] value",
            NoNameLayout => "BTF has no dentry name layout for %pd/%pD",
            BtfUnreadable => "the guest's BTF could not be read",
            DeleteExtra => "unexpected text after the event to delete",
        }
    }
}

/// A refused spec: what is wrong and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Byte offset of the offending token in the spec.
    pub pos: usize,
    /// Its length in bytes (0 for "something is missing here").
    pub len: usize,
    /// What is wrong.
    pub kind: ParseErrorKind,
    /// The offending token's text (empty when something is missing).
    pub token: String,
}

impl ParseError {
    pub(crate) fn new(kind: ParseErrorKind, pos: usize, token: &str) -> Self {
        Self {
            pos,
            len: token.len(),
            kind,
            token: token.to_string(),
        }
    }

    fn missing(kind: ParseErrorKind, pos: usize) -> Self {
        Self {
            pos,
            len: 0,
            kind,
            token: String::new(),
        }
    }

    /// 1-based column of the token in `spec` (in characters).
    pub fn column(&self, spec: &str) -> usize {
        let before = spec.get(..self.pos.min(spec.len())).unwrap_or(spec);
        before.chars().count() + 1
    }

    /// Two lines: the spec, and a caret under the offending token, in the
    /// manner of the kernel's `error_log`:
    ///
    /// ```text
    /// p:myopen do_sys_openat2 dfd=%dj
    ///                             ^~~
    /// ```
    pub fn caret(&self, spec: &str) -> String {
        let mut out = String::with_capacity(spec.len() * 2 + 2);
        // Whitespace other than tabs would break the alignment.
        for c in spec.chars() {
            out.push(if c.is_whitespace() && c != '\t' {
                ' '
            } else {
                c
            });
        }
        out.push('\n');
        let pos = self.pos.min(spec.len());
        for c in spec.get(..pos).unwrap_or("").chars() {
            out.push(if c == '\t' { '\t' } else { ' ' });
        }
        out.push('^');
        let width = spec
            .get(pos..pos + self.len)
            .map_or(0, |t| t.chars().count());
        for _ in 1..width {
            out.push('~');
        }
        out
    }

    /// The one-line message followed by the caret lines.
    pub fn report(&self, spec: &str) -> String {
        format!("{}\n{}", self, self.caret(spec))
    }
}

/// `bad register name "%dj" at column 29`: the message, the token, and
/// where it starts (1-based; the column counts bytes here, as the spec is
/// not at hand; [`ParseError::column`] counts characters).
impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.message())?;
        if !self.token.is_empty() {
            write!(f, " \"{}\"", self.token.escape_debug())?;
        }
        write!(f, " at column {}", self.pos + 1)?;
        if let ParseErrorKind::BadRegName {
            suggestion: Some(r),
        } = self.kind
        {
            write!(f, " (kprobe_events calls it %{})", r.name())?;
        }
        Ok(())
    }
}

impl core::error::Error for ParseError {}

/// A word of the spec and its byte offset.
#[derive(Clone, Copy)]
struct Tok<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Tok<'a> {
    /// `text[from..to]` with its position (empty off a char boundary; the
    /// parser only cuts next to ASCII bytes).
    fn sub(self, from: usize, to: usize) -> Tok<'a> {
        let text = self.text.get(from..to).unwrap_or("");
        Tok {
            text,
            pos: self.pos + from,
        }
    }

    fn from(self, from: usize) -> Tok<'a> {
        self.sub(from, self.text.len())
    }

    fn err(self, kind: ParseErrorKind) -> ParseError {
        ParseError::new(kind, self.pos, self.text)
    }

    fn end(self) -> usize {
        self.pos + self.text.len()
    }
}

/// The kernel splits on `isspace`: space, \t, \n, \v, \f, \r.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

fn split(spec: &str) -> Vec<Tok<'_>> {
    let b = spec.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if is_space(c) {
            i += 1;
            continue;
        }
        let start = i;
        while b.get(i).is_some_and(|&c| !is_space(c)) {
            i += 1;
        }
        // Splits fall on ASCII bytes, so these are char boundaries.
        if let Some(text) = spec.get(start..i) {
            toks.push(Tok { text, pos: start });
        }
    }
    toks
}

/// Parses one kprobe_events command.
pub fn parse(spec: &str) -> Result<Command, ParseError> {
    let toks = split(spec);
    let Some((&head, rest)) = toks.split_first() else {
        return Err(ParseError::missing(ParseErrorKind::Empty, 0));
    };
    match head.text.as_bytes().first().copied().unwrap_or(0) {
        b'p' | b'r' => parse_add(spec, head, rest).map(Command::Add),
        b'-' => parse_delete(head, rest).map(Command::Delete),
        _ => Err(head.sub(0, 1).err(ParseErrorKind::BadCommand)),
    }
}

/// Parses a probe definition; a deletion is refused.
pub fn parse_probe(spec: &str) -> Result<ProbeSpec, ParseError> {
    match parse(spec)? {
        Command::Add(p) => Ok(p),
        Command::Delete(_) => {
            let pos = spec.len()
                - spec
                    .trim_start_matches(|c: char| c.is_ascii() && is_space(c as u8))
                    .len();
            Err(ParseError::new(ParseErrorKind::BadCommand, pos, "-"))
        }
    }
}

fn parse_delete(head: Tok<'_>, rest: &[Tok<'_>]) -> Result<DeleteSpec, ParseError> {
    if head.text.as_bytes().get(1) != Some(&b':') {
        return Err(head.sub(0, 1).err(ParseErrorKind::BadCommand));
    }
    let names = head.from(2);
    let (group, event) = match names.text.find('/') {
        Some(slash) => {
            let g = names.sub(0, slash);
            if g.text.is_empty() {
                return Err(ParseError::missing(ParseErrorKind::NoGroupName, g.pos));
            }
            let e = names.from(slash + 1);
            (
                Some(g.text.to_string()),
                (!e.text.is_empty()).then(|| e.text.to_string()),
            )
        }
        None if names.text.is_empty() => {
            return Err(ParseError::missing(ParseErrorKind::NoEventName, names.pos));
        }
        None => (None, Some(names.text.to_string())),
    };
    if let Some(extra) = rest.first() {
        return Err(extra.err(ParseErrorKind::DeleteExtra));
    }
    Ok(DeleteSpec { group, event })
}

fn parse_add(spec: &str, head: Tok<'_>, rest: &[Tok<'_>]) -> Result<ProbeSpec, ParseError> {
    use ParseErrorKind as K;
    let mut is_return = head.text.starts_with('r');

    // p[:...] / r[MAXACTIVE][:...]
    let colon = head.text.find(':');
    let mid = head.sub(1, colon.unwrap_or(head.text.len()));
    let mut maxactive = 0;
    if !mid.text.is_empty() {
        let digit = mid.text.as_bytes().first().is_some_and(u8::is_ascii_digit);
        if !digit {
            return Err(mid.err(K::BadCommand));
        }
        if !is_return {
            return Err(mid.err(K::MaxactiveOnEntry));
        }
        match super::num::kstrtouint(mid.text, 0) {
            Some(0) | None => return Err(mid.err(K::BadMaxactive)),
            Some(n) if n > MAX_MAXACTIVE => return Err(mid.err(K::MaxactiveTooBig)),
            Some(n) => maxactive = n,
        }
    }

    // The probe point.
    let Some(&point) = rest.first() else {
        return Err(ParseError::missing(K::MissingSymbol, spec.trim_end().len()));
    };
    let (module, symbol) = parse_probe_point(point, &mut is_return)?;

    // The event name.
    let (group, event) = match colon {
        Some(c) => parse_event_name(head.from(c + 1))?,
        None => (None, None),
    };
    let event = event.unwrap_or_else(|| match &module {
        Some(m) => default_event_name(is_return, &format!("{m}:{symbol}")),
        None => default_event_name(is_return, &symbol),
    });
    let group = group.unwrap_or_else(|| DEFAULT_GROUP.to_string());

    let args_toks = rest.get(1..).unwrap_or(&[]);
    if let Some(extra) = args_toks.get(MAX_TRACE_ARGS) {
        return Err(extra.err(K::TooManyArgs));
    }
    let mut args: Vec<FetchArg> = Vec::with_capacity(args_toks.len());
    for (i, &tok) in args_toks.iter().enumerate() {
        let arg = parse_arg(tok, i, is_return, &args)?;
        args.push(arg);
    }

    let kind = if is_return {
        ProbeKind::Return { maxactive }
    } else {
        ProbeKind::Entry
    };
    Ok(ProbeSpec {
        kind,
        group,
        event,
        module,
        symbol,
        args,
    })
}

/// `[MOD:]SYM`, `[MOD:]SYM+0`, `[MOD:]SYM%return`, `[MOD:]SYM+0%return`:
/// the module, when named, and the symbol.
fn parse_probe_point(
    point: Tok<'_>,
    is_return: &mut bool,
) -> Result<(Option<String>, String), ParseError> {
    use ParseErrorKind as K;
    let text = point.text;
    if kstrtoull(text, 0).is_some() {
        return Err(point.err(K::AddressProbe));
    }
    if text.contains('/') && text.contains(':') {
        return Err(point.err(K::UprobeSpec));
    }
    let mut sym = point;
    if let Some(pct) = text.find('%') {
        let suffix = point.from(pct);
        if suffix.text != "%return" {
            return Err(suffix.err(K::BadProbeSuffix));
        }
        *is_return = true;
        sym = point.sub(0, pct);
    }
    if let Some(sign) = sym.text.find(['+', '-']) {
        let off = sym.from(sign);
        match kstrtoll(off.text, 0) {
            Some(0) => {}
            Some(n) if n > 0 => return Err(off.err(K::NotFunctionEntry)),
            _ => return Err(off.err(K::BadProbeOffset)),
        }
        sym = sym.sub(0, sign);
    }
    let mut module = None;
    if let Some(colon) = sym.text.find(':') {
        let m = sym.sub(0, colon);
        if !is_module_name(m.text) {
            return Err(m.err(K::ModuleSymbol));
        }
        module = Some(m.text.to_string());
        sym = sym.from(colon + 1);
    }
    if !is_symbol_name(sym.text) {
        return Err(if sym.text.is_empty() {
            point.err(K::BadSymbol)
        } else {
            sym.err(K::BadSymbol)
        });
    }
    Ok((module, sym.text.to_string()))
}

/// A module name as the kernel keeps it (`MODULE_NAME_LEN`: at most 55
/// bytes): letters, digits, `_` and `-`.
fn is_module_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() < 56
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
}

/// A kernel symbol: C identifier characters plus the `.` of compiler
/// suffixes (`foo.isra.0`, `bar.cold`).
fn is_symbol_name(s: &str) -> bool {
    let b = s.as_bytes();
    match b.first() {
        Some(c) if c.is_ascii_alphabetic() || *c == b'_' || *c == b'.' => {}
        _ => return false,
    }
    b.iter()
        .all(|c| c.is_ascii_alphanumeric() || *c == b'_' || *c == b'.')
}

/// `[GRP/][EVENT]` after the colon (`traceprobe_parse_event_name`; `.`
/// separates the group too when there is no `/`).
fn parse_event_name(t: Tok<'_>) -> Result<(Option<String>, Option<String>), ParseError> {
    use ParseErrorKind as K;
    let slash = t.text.find('/').or_else(|| t.text.find('.'));
    let (group, ev) = match slash {
        Some(s) => {
            let g = t.sub(0, s);
            if g.text.is_empty() {
                return Err(ParseError::missing(K::NoGroupName, g.pos));
            }
            if g.text.len() + 1 > MAX_EVENT_NAME_LEN {
                return Err(g.err(K::GroupTooLong));
            }
            if !is_good_group_name(g.text) {
                return Err(g.err(K::BadGroupName));
            }
            (Some(g.text.to_string()), t.from(s + 1))
        }
        None => (None, t),
    };
    if ev.text.is_empty() {
        if group.is_some() {
            return Ok((group, None));
        }
        return Err(ParseError::missing(K::NoEventName, ev.pos));
    }
    if ev.text.len() >= MAX_EVENT_NAME_LEN {
        return Err(ev.err(K::EventTooLong));
    }
    if !is_good_name(ev.text) {
        return Err(ev.err(K::BadEventName));
    }
    Ok((group, Some(ev.text.to_string())))
}

/// `p_SYM_0` / `r_SYM_0`, with `:`, `.` and `*` made `_`, cut to 63 bytes
/// (`snprintf` into `MAX_EVENT_NAME_LEN`, then `sanitize_event_name`).
fn default_event_name(is_return: bool, symbol: &str) -> String {
    let full = format!("{}_{}_0", if is_return { 'r' } else { 'p' }, symbol);
    let mut name = String::with_capacity(MAX_EVENT_NAME_LEN);
    for c in full.chars() {
        if name.len() + c.len_utf8() > MAX_EVENT_NAME_LEN - 1 {
            break;
        }
        name.push(if matches!(c, ':' | '.' | '*') { '_' } else { c });
    }
    name
}

/// `[NAME=]FETCHARG[:TYPE]`, the `idx`-th argument.
fn parse_arg(
    tok: Tok<'_>,
    idx: usize,
    is_return: bool,
    earlier: &[FetchArg],
) -> Result<FetchArg, ParseError> {
    use ParseErrorKind as K;
    let (name, body) = match tok.text.find('=') {
        Some(0) => return Err(tok.sub(0, 1).err(K::NoArgName)),
        Some(eq) => {
            let name = tok.sub(0, eq);
            if name.text.len() > MAX_ARG_NAME_LEN {
                return Err(name.err(K::ArgNameTooLong));
            }
            if !is_good_name(name.text) {
                return Err(name.err(K::BadArgName));
            }
            (name, tok.from(eq + 1))
        }
        None => (tok.sub(0, 0), tok),
    };
    if body.text.is_empty() {
        return Err(ParseError::missing(K::NoArgBody, body.pos));
    }
    if body.text.len() > MAX_ARGSTR_LEN {
        return Err(body.err(K::ArgTooLong));
    }

    // The type is everything after the first ':'.
    let (expr_tok, type_tok) = match body.text.find(':') {
        Some(c) => (body.sub(0, c), Some(body.from(c + 1))),
        None => (body, None),
    };
    // An unnamed argument that is a bare name (a BTF parameter) is named
    // after it (`generate_probe_arg_name`).
    let name_text = if !name.text.is_empty() {
        name.text.to_string()
    } else if is_good_name(expr_tok.text) {
        expr_tok.text.to_string()
    } else {
        format!("arg{}", idx + 1)
    };
    if RESERVED_ARG_NAMES.contains(&name_text.as_str())
        || earlier.iter().any(|a| a.name == name_text)
    {
        let at = if name.text.is_empty() { tok } else { name };
        return Err(ParseError::new(K::UsedArgName, at.pos, &name_text).with_len(at.text.len()));
    }
    let stringy = matches!(expr_tok.text, "$comm" | "$COMM") || expr_tok.text.starts_with("\\\"");
    let mut name_of = None;
    let ty = match type_tok {
        Some(t) => {
            if let Some(b) = t.text.find('[') {
                return Err(t.from(b).err(K::ArrayType));
            }
            let ty = match t.text {
                "%pd" => {
                    name_of = Some(NameOf::Dentry);
                    ArgType::String
                }
                "%pD" => {
                    name_of = Some(NameOf::File);
                    ArgType::String
                }
                _ => parse_type(t)?,
            };
            if stringy && (ty != ArgType::String || name_of.is_some()) {
                return Err(t.err(K::NeedStringType));
            }
            ty
        }
        None if stringy => ArgType::String,
        None => ArgType::DEFAULT,
    };

    let mut btf = None;
    let expr = parse_expr(expr_tok, 0, is_return, &mut btf)?;
    if let Some(b) = btf.as_mut() {
        b.typed = type_tok.is_some();
        b.type_pos = type_tok.map_or(body.end(), |t| t.pos);
        b.name_of = name_of;
        if b.var == Some(BtfVar::All) && (!name.text.is_empty() || type_tok.is_some()) {
            return Err(expr_tok.err(K::ArgStar));
        }
    }
    // A written type leaves BTF nothing to refine.
    if btf.as_ref().is_some_and(|b| b.optional && b.typed) {
        btf = None;
    }
    if btf.is_some() {
        // Checked once BTF has said what the value is.
    } else if let (Some(n), Some(t)) = (name_of, type_tok) {
        // `%pd`/`%pD` over a plain fetch: only the names' layout needs BTF.
        btf = Some(BtfArg {
            var: None,
            pos: t.pos,
            len: t.text.len(),
            fields: Vec::new(),
            typed: true,
            type_pos: t.pos,
            name_of: Some(n),
            optional: false,
        });
    } else {
        check_type_fits(&expr, ty, type_tok.unwrap_or(body))?;
        if fetch_insns(&expr, ty) > FETCH_INSN_MAX - 1 {
            return Err(expr_tok.err(K::TooDeep));
        }
    }
    Ok(FetchArg {
        name: name_text,
        body: body.text.to_string(),
        expr,
        ty,
        btf,
    })
}

impl ParseError {
    fn with_len(mut self, len: usize) -> Self {
        self.len = len;
        self
    }
}

/// `:TYPE`.
fn parse_type(t: Tok<'_>) -> Result<ArgType, ParseError> {
    use ParseErrorKind as K;
    Ok(match t.text {
        "string" => ArgType::String,
        "ustring" => ArgType::UString,
        "symbol" => ArgType::Symbol,
        "symstr" => ArgType::SymStr,
        s if s.starts_with('b') => parse_bitfield(t)?,
        s => ArgType::Int(IntType::from_name(s).ok_or_else(|| t.err(K::BadType))?),
    })
}

/// `b<width>@<shift>/<container bits>`; the container must be 8, 16, 32 or
/// 64 bits and hold the field.
fn parse_bitfield(t: Tok<'_>) -> Result<ArgType, ParseError> {
    use ParseErrorKind as K;
    let s = t.text;
    // The kernel looks for the container first and calls a bad one an
    // unknown type.
    let Some(slash) = s.find('/') else {
        return Err(t.err(K::BadType));
    };
    let container = match s.get(slash + 1..).and_then(|c| kstrtoull(c, 0)) {
        Some(8) => 1u8,
        Some(16) => 2,
        Some(32) => 4,
        Some(64) => 8,
        _ => return Err(t.err(K::BadType)),
    };
    let bad = || t.err(K::BadBitfield);
    let at = s.find('@').filter(|&a| a < slash).ok_or_else(bad)?;
    let width = s.get(1..at).and_then(|w| kstrtoull(w, 0)).ok_or_else(bad)?;
    let shift = s
        .get(at + 1..slash)
        .and_then(|o| kstrtoull(o, 0))
        .ok_or_else(bad)?;
    let bits = u64::from(container) * 8;
    if width == 0 || width.saturating_add(shift) > bits {
        return Err(bad());
    }
    Ok(ArgType::Bitfield {
        width: width as u8,
        shift: shift as u8,
        container,
    })
}

/// The `string`/`symstr` checks of `finalize_fetch_insn`.
fn check_type_fits(expr: &FetchExpr, ty: ArgType, at: Tok<'_>) -> Result<(), ParseError> {
    use ParseErrorKind as K;
    let ok = match ty {
        ArgType::String | ArgType::UString => {
            !expr.derefs.is_empty()
                || matches!(
                    expr.base,
                    FetchBase::Imm(_) | FetchBase::Comm | FetchBase::ImmString(_)
                )
        }
        ArgType::SymStr => match expr.derefs.last() {
            Some(d) => !d.user,
            None => matches!(
                expr.base,
                FetchBase::Reg(_)
                    | FetchBase::StackEntry(_)
                    | FetchBase::RetVal
                    | FetchBase::Arg(_)
            ),
        },
        _ => true,
    };
    if ok {
        Ok(())
    } else if ty == ArgType::SymStr {
        Err(at.err(K::BadSymStr))
    } else {
        Err(at.err(K::BadString))
    }
}

/// How many fetch instructions the kernel compiles this into, `END` not
/// counted: the load (two for `@SYM`: a symbol placeholder and the
/// immediate), one per dereference, a store unless the last dereference
/// becomes it, and the bitfield modifier.
pub(crate) fn fetch_insns(expr: &FetchExpr, ty: ArgType) -> usize {
    let load = if matches!(expr.base, FetchBase::Symbol { .. }) {
        2
    } else {
        1
    };
    let store = match ty {
        ArgType::SymStr => 1,
        _ => usize::from(expr.derefs.is_empty()),
    };
    let modify = usize::from(matches!(ty, ArgType::Bitfield { .. }));
    load + expr.derefs.len() + store + modify
}

/// Recursion guard; the 63-character limit keeps real nesting far below.
const MAX_PARSE_DEPTH: usize = 32;

/// A fetch argument without its name and type (`parse_probe_arg`). A BTF
/// variable found in it (at the top or inside dereferences) goes to `btf`.
fn parse_expr(
    t: Tok<'_>,
    depth: usize,
    is_return: bool,
    btf: &mut Option<BtfArg>,
) -> Result<FetchExpr, ParseError> {
    use ParseErrorKind as K;
    let plain = |base| {
        Ok(FetchExpr {
            base,
            derefs: Vec::new(),
        })
    };
    let b = t.text.as_bytes();
    let Some(&first) = b.first() else {
        return Err(ParseError::missing(K::BadFetchArg, t.pos));
    };
    match first {
        b'$' if t.text.starts_with("$retval") && t.text.len() > "$retval".len() => {
            parse_btf_var(t, is_return, btf)
        }
        b'$' if t.text == "$arg*" => parse_btf_var(t, is_return, btf),
        b'$' if t.text.starts_with("$arg") && t.text.contains(['-', '.']) => {
            parse_btf_var(t, is_return, btf)
        }
        b'$' if t.text == "$retval" && is_return => {
            // Typed from the return type when BTF has the function.
            *btf = Some(BtfArg {
                var: Some(BtfVar::RetVal),
                pos: t.pos,
                len: t.text.len(),
                fields: Vec::new(),
                typed: false,
                type_pos: t.end(),
                name_of: None,
                optional: true,
            });
            plain(FetchBase::RetVal)
        }
        b'$' => plain(parse_var(t, is_return)?),
        b'%' => {
            let name = t.from(1).text;
            match Reg::from_name(name) {
                Some(r) => plain(FetchBase::Reg(r)),
                None => Err(t.err(K::BadRegName {
                    suggestion: Reg::suggest(name),
                })),
            }
        }
        b'@' => {
            let rest = t.from(1);
            let base = match rest.text.as_bytes().first() {
                Some(c) if c.is_ascii_digit() => {
                    FetchBase::Imm(kstrtoull(rest.text, 0).ok_or_else(|| t.err(K::BadMemAddr))?)
                }
                Some(b'+') => return Err(t.err(K::FileOffset)),
                None => return Err(t.err(K::BadMemAddr)),
                Some(_) => {
                    let (name, offset) = match rest.text.find(['+', '-']) {
                        Some(s) => {
                            let off = rest.from(s);
                            let v = kstrtoll(off.text, 0).ok_or_else(|| off.err(K::BadMemAddr))?;
                            (rest.sub(0, s), v)
                        }
                        None => (rest, 0),
                    };
                    if !is_symbol_name(name.text) {
                        return Err(name.err(K::BadSymbol).with_len(name.text.len()));
                    }
                    FetchBase::Symbol {
                        name: name.text.to_string(),
                        offset,
                        resolved: None,
                    }
                }
            };
            Ok(FetchExpr {
                base,
                derefs: alloc::vec![Deref {
                    offset: 0,
                    user: false
                }],
            })
        }
        b'+' | b'-' => parse_deref(t, depth, is_return, btf),
        b'\\' => {
            if b.get(1) == Some(&b'"') {
                let s = t.from(2).text;
                match s.strip_suffix('"') {
                    Some(content) => plain(FetchBase::ImmString(content.to_string())),
                    None => Err(ParseError::missing(K::ImmStrNoClose, t.end())),
                }
            } else {
                let imm = t.from(1);
                let v = match imm.text.as_bytes().first() {
                    Some(c) if c.is_ascii_digit() => kstrtoull(imm.text, 0),
                    Some(b'-') => kstrtoll(imm.text, 0).map(|v| v as u64),
                    Some(b'+') => imm
                        .text
                        .get(1..)
                        .and_then(|s| kstrtoll(s, 0))
                        .map(|v| v as u64),
                    _ => None,
                };
                match v {
                    Some(v) => plain(FetchBase::Imm(v)),
                    None if imm.text.is_empty() => Err(ParseError::missing(K::BadImm, imm.pos)),
                    None => Err(imm.err(K::BadImm)),
                }
            }
        }
        c if c.is_ascii_alphabetic() || c == b'_' => parse_btf_var(t, is_return, btf),
        _ => Err(t.err(K::BadFetchArg)),
    }
}

/// A BTF variable and its member accesses: `NAME`, `NAME->a.b->c`,
/// `$retval->a`, `$argN->a`, `$arg*` (`parse_btf_arg` and
/// `split_next_field`). The base is a placeholder until
/// [`super::resolve_btf`] finds the parameter.
fn parse_btf_var(
    t: Tok<'_>,
    is_return: bool,
    btf: &mut Option<BtfArg>,
) -> Result<FetchExpr, ParseError> {
    use ParseErrorKind as K;
    let text = t.text;
    let var_end = text.find(['-', '.']).unwrap_or(text.len());
    let var_tok = t.sub(0, var_end);
    let (var, base) = match var_tok.text {
        "$retval" => {
            if !is_return {
                return Err(var_tok.err(K::RetvalOnEntry));
            }
            (BtfVar::RetVal, FetchBase::RetVal)
        }
        "$arg*" => (BtfVar::All, FetchBase::Arg(1)),
        v if v.starts_with('$') => match parse_var(var_tok, is_return)? {
            FetchBase::Arg(n) => (BtfVar::Arg(n), FetchBase::Arg(n)),
            FetchBase::EntryArg(n) => (BtfVar::Arg(n), FetchBase::EntryArg(n)),
            _ => return Err(var_tok.err(K::BadVar)),
        },
        v if is_good_name(v) => (BtfVar::Param(v.to_string()), FetchBase::Arg(1)),
        _ => return Err(var_tok.err(K::BadFetchArg)),
    };
    let mut fields = Vec::new();
    let mut at = var_end;
    while at < text.len() {
        let rest = &text[at..];
        let (arrow, skip) = if rest.starts_with("->") {
            (true, 2)
        } else if rest.starts_with('.') {
            (false, 1)
        } else {
            return Err(t.sub(at, at + 1).err(K::BadHyphen));
        };
        let start = at + skip;
        let end = text[start..]
            .find(['-', '.'])
            .map_or(text.len(), |e| start + e);
        let member = t.sub(start, end);
        if !is_good_name(member.text) {
            return Err(if member.text.is_empty() {
                ParseError::missing(K::BadMemberName, member.pos)
            } else {
                member.err(K::BadMemberName)
            });
        }
        if !arrow && fields.is_empty() {
            // A struct or union passed by value is not supported.
            return Err(t.sub(at, at + 1).err(K::DotOnArg));
        }
        if var == BtfVar::All {
            return Err(t.err(K::ArgStar));
        }
        fields.push(BtfField {
            name: member.text.to_string(),
            arrow,
            pos: member.pos,
        });
        at = end;
    }
    *btf = Some(BtfArg {
        var: Some(var),
        pos: var_tok.pos,
        len: var_tok.text.len(),
        fields,
        typed: false,
        type_pos: t.end(),
        name_of: None,
        optional: false,
    });
    Ok(FetchExpr {
        base,
        derefs: Vec::new(),
    })
}

/// `+|-[u]OFFS(FETCHARG)`.
fn parse_deref(
    t: Tok<'_>,
    depth: usize,
    is_return: bool,
    btf: &mut Option<BtfArg>,
) -> Result<FetchExpr, ParseError> {
    use ParseErrorKind as K;
    let b = t.text.as_bytes();
    let negative = b.first() == Some(&b'-');
    let user = b.get(1) == Some(&b'u');
    let digits_at = if user { 2 } else { 1 };
    let Some(open) = t.text.find('(') else {
        return Err(t.err(K::DerefNeedBrace));
    };
    if open < digits_at {
        return Err(t.sub(0, open + 1).err(K::BadDerefOffset));
    }
    let off = t.sub(digits_at, open);
    // As the kernel: skip a '+', hand "-digits" to kstrtol.
    let offset = if negative {
        digits_negative(off.text)
    } else {
        kstrtoll(off.text, 0)
    };
    let Some(offset) = offset else {
        let at = if off.text.is_empty() {
            t.sub(0, open + 1)
        } else {
            off
        };
        return Err(at.err(K::BadDerefOffset));
    };
    let close = match t.text.rfind(')') {
        Some(c) if c > open => c,
        _ => return Err(ParseError::missing(K::DerefOpenBrace, t.end())),
    };
    let trailing = t.from(close + 1);
    if !trailing.text.is_empty() {
        return Err(trailing.err(K::TrailingText));
    }
    if depth + 1 > MAX_PARSE_DEPTH {
        return Err(t.err(K::TooDeep));
    }
    let inner = t.sub(open + 1, close);
    let mut expr = parse_expr(inner, depth + 1, is_return, btf)?;
    if expr.derefs.is_empty() && matches!(expr.base, FetchBase::Comm | FetchBase::ImmString(_)) {
        return Err(inner.err(K::CommCantDeref));
    }
    expr.derefs.push(Deref { offset, user });
    Ok(expr)
}

/// The offset of a `-` dereference: the kernel passes "-" plus the digits
/// to `kstrtol`, which takes no second sign.
fn digits_negative(digits: &str) -> Option<i64> {
    if digits.starts_with(['+', '-']) {
        return None;
    }
    negate(kstrtoull(digits, 0)?)
}

/// `$retval`, `$stack`, `$stackN`, `$comm`, `$argN` (`parse_probe_vars`).
fn parse_var(t: Tok<'_>, is_return: bool) -> Result<FetchBase, ParseError> {
    use ParseErrorKind as K;
    let v = t.from(1).text;
    if v == "retval" {
        return if is_return {
            Ok(FetchBase::RetVal)
        } else {
            Err(t.err(K::RetvalOnEntry))
        };
    }
    if let Some(n) = v.strip_prefix("stack") {
        if n.is_empty() {
            return Ok(FetchBase::StackPointer);
        }
        if !n.as_bytes().first().is_some_and(u8::is_ascii_digit) {
            return Err(t.err(K::BadVar));
        }
        return match kstrtoull(n, 10) {
            None => Err(t.err(K::BadVar)),
            Some(n) if n > u64::from(MAX_STACK_INDEX) => Err(t.err(K::BadStackNum)),
            Some(n) => Ok(FetchBase::StackEntry(n as u32)),
        };
    }
    if v == "comm" || v == "COMM" {
        return Ok(FetchBase::Comm);
    }
    if let Some(n) = v.strip_prefix("arg") {
        if n.starts_with('*') {
            return Err(t.err(K::ArgStar));
        }
        return match kstrtoull(n, 10) {
            None => Err(t.err(K::BadVar)),
            Some(n) if n == 0 || n > u64::from(MAX_STACK_INDEX) => Err(t.err(K::BadArgNum)),
            // At a return: the value saved at the entry (Linux 6.9+).
            Some(n) if is_return => Ok(FetchBase::EntryArg(n as u32)),
            Some(n) => Ok(FetchBase::Arg(n as u32)),
        };
    }
    Err(t.err(K::BadVar))
}
