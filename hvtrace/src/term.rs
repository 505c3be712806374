//! Guest-controlled text on the user's terminal.
//!
//! Task names, string arguments, symbol names, hypervisor lines and the
//! output of guest commands come from the guest, which may be hostile. A
//! terminal acts on control characters: an escape sequence can move the
//! cursor, rewrite what was printed before, change the window title or, on
//! some terminals, answer back as if typed. So text that reaches stdout or
//! stderr goes through [`sanitize`] first: the C0 controls other than
//! newline and tab, DEL and the C1 controls (U+0080 to U+009F) become
//! visible escapes (`\x1b`). JSON output keeps its meaning: there the same
//! characters become JSON escapes (`\u001b`, see [`sanitize_json`]), which a
//! JSON reader decodes to the same string.
//!
//! The interactive console (`hvtrace run` without `--exec`) is the guest's
//! terminal and stays raw.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::{self, IsTerminal, Write};

/// How a character that a terminal would act on is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Plain text: `\xNN`.
    Text,
    /// JSON text: `\u00NN`, a JSON escape for the same character (these
    /// characters can only stand, validly, inside JSON strings).
    Json,
}

/// True for the characters a terminal acts on, except newline and tab: the
/// C0 controls, DEL and the C1 controls.
pub fn is_control(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{8}' | '\u{b}'..='\u{1f}' | '\u{7f}'..='\u{9f}')
}

/// `text` with every [`is_control`] character written as `\xNN`.
pub fn sanitize(text: &str) -> Cow<'_, str> {
    sanitize_as(Mode::Text, text)
}

/// `text` with every [`is_control`] character written as the JSON escape
/// `\u00NN`; for a JSON document or JSON lines.
pub fn sanitize_json(text: &str) -> Cow<'_, str> {
    sanitize_as(Mode::Json, text)
}

/// `text` with every [`is_control`] character escaped as `mode` says.
pub fn sanitize_as(mode: Mode, text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    push_sanitized(&mut out, mode, text);
    Cow::Owned(out)
}

fn push_sanitized(out: &mut String, mode: Mode, text: &str) {
    for c in text.chars() {
        if is_control(c) {
            push_escape(out, mode, c as u32);
        } else {
            out.push(c);
        }
    }
}

fn push_escape(out: &mut String, mode: Mode, code: u32) {
    let _ = match mode {
        Mode::Text => write!(out, "\\x{code:02x}"),
        Mode::Json => write!(out, "\\u{code:04x}"),
    };
}

/// The output of a guest command for one of our streams: sanitized when
/// it goes to a terminal, as it is when it goes to a file or a pipe (where
/// the user asked for the bytes).
pub fn for_stream(text: &str, terminal: bool) -> Cow<'_, str> {
    if terminal {
        sanitize(text)
    } else {
        Cow::Borrowed(text)
    }
}

/// True when stdout is a terminal.
pub fn stdout_is_terminal() -> bool {
    io::stdout().is_terminal()
}

/// True when stderr is a terminal.
pub fn stderr_is_terminal() -> bool {
    io::stderr().is_terminal()
}

/// A writer that sanitizes everything written through it ([`sanitize_as`]).
/// Bytes that are not UTF-8 are written as `\xNN` (text) or as U+FFFD
/// (JSON); a character cut between two writes is put together first.
pub struct Sanitizing<W: Write> {
    inner: W,
    mode: Mode,
    /// The start of a character whose end has not been written yet.
    pending: Vec<u8>,
}

impl<W: Write> Sanitizing<W> {
    /// Sanitizes what goes to `inner`.
    pub fn new(inner: W, mode: Mode) -> Sanitizing<W> {
        Sanitizing {
            inner,
            mode,
            pending: Vec::new(),
        }
    }

    /// The text of `pending` that is complete, sanitized; keeps an
    /// unfinished character back. With `all`, that is written too.
    fn take(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        while !rest.is_empty() {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    push_sanitized(&mut out, self.mode, text);
                    rest = &[];
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    if let Ok(text) = std::str::from_utf8(good) {
                        push_sanitized(&mut out, self.mode, text);
                    }
                    let n = match e.error_len() {
                        Some(n) => n,
                        None if all => bad.len(),
                        // An unfinished character: wait for its end.
                        None => {
                            rest = bad;
                            break;
                        }
                    };
                    for &b in &bad[..n] {
                        match self.mode {
                            Mode::Text => push_escape(&mut out, Mode::Text, u32::from(b)),
                            Mode::Json => out.push(char::REPLACEMENT_CHARACTER),
                        }
                    }
                    rest = &bad[n..];
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}

impl<W: Write> Write for Sanitizing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        let text = self.take(false);
        self.inner.write_all(text.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W: Write> Drop for Sanitizing<W> {
    fn drop(&mut self) {
        if !self.pending.is_empty() {
            let text = self.take(true);
            let _ = self.inner.write_all(text.as_bytes());
            let _ = self.inner.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_become_visible() {
        assert_eq!(
            sanitize("a\u{1b}[2Jb\u{7}c\rd\u{0}"),
            "a\\x1b[2Jb\\x07c\\x0dd\\x00"
        );
        // Newline and tab stay, and so does everything printable.
        let plain = "line\n\tindented é 漢 \u{a0}\u{ff}~";
        assert!(matches!(sanitize(plain), Cow::Borrowed(_)));
        assert_eq!(sanitize(plain), plain);
        // DEL and the C1 controls (CSI, OSC, NEL).
        assert_eq!(
            sanitize("x\u{7f}\u{9b}31m\u{9d}0;t\u{85}y"),
            "x\\x7f\\x9b31m\\x9d0;t\\x85y"
        );
        for c in ['\u{1f}', '\u{80}', '\u{9f}', '\u{b}', '\u{c}'] {
            assert!(is_control(c), "{c:?}");
        }
        for c in ['\n', '\t', ' ', '\u{a0}', 'a'] {
            assert!(!is_control(c), "{c:?}");
        }
        // No control character survives, whatever the input.
        let all: String = (0u32..0x200).filter_map(char::from_u32).collect();
        assert!(!sanitize(&all).chars().any(is_control));
    }

    #[test]
    fn json_keeps_its_meaning() {
        let line = "{\"comm\":\"a\u{1b}]0;pwned\u{7}\u{9b}b\u{7f}\"}";
        let clean = sanitize_json(line);
        assert_eq!(clean, r#"{"comm":"a\u001b]0;pwned\u0007\u009bb\u007f"}"#);
        let parsed: serde_json::Value = serde_json::from_str(&clean).unwrap();
        assert_eq!(parsed["comm"], "a\u{1b}]0;pwned\u{7}\u{9b}b\u{7f}");
        assert_eq!(sanitize_json("{\"a\":1}\n"), "{\"a\":1}\n");
    }

    #[test]
    fn only_terminals_get_the_exec_output_sanitized() {
        assert_eq!(for_stream("a\u{1b}b", true), "a\\x1bb");
        assert_eq!(for_stream("a\u{1b}b", false), "a\u{1b}b");
    }

    #[test]
    fn the_writer_sanitizes_across_writes() {
        let mut out = Vec::new();
        {
            let mut w = Sanitizing::new(&mut out, Mode::Text);
            // CSI (U+009B, C2 9B in UTF-8) cut between two writes, an
            // escape, a lone invalid byte, then an unfinished character.
            w.write_all(b"a\xc2").unwrap();
            w.write_all(b"\x9bb\x1b[1m\xffc\n").unwrap();
            w.write_all("é".as_bytes()).unwrap();
            w.write_all(b"\xe6\xbc").unwrap();
            w.flush().unwrap();
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a\\x9bb\\x1b[1m\\xffc\né\\xe6\\xbc"
        );
        let mut out = Vec::new();
        {
            let mut w = Sanitizing::new(&mut out, Mode::Json);
            w.write_all(b"{\"s\":\"\x1b\xff\"}\n").unwrap();
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"s\":\"\\u001b\u{fffd}\"}\n"
        );
    }
}
