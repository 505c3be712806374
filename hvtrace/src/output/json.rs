//! A minimal JSON writer for the CLI's `--json` output (objects, arrays,
//! strings, integers, floats, booleans and null, on one line), and a reader
//! for the JSON lines the hypervisor streams ([`Json::parse`]).

use std::fmt::Write;

/// A JSON value.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A float (written with up to 3 decimals; non-finite values as null).
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, keys in the given order.
    Object(Vec<(String, Json)>),
}

impl Json {
    /// An object from `(key, value)` pairs.
    pub fn object<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Json {
        Json::Object(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// An integer value.
    pub fn int(n: impl Into<i128>) -> Json {
        Json::Int(n.into())
    }

    /// A string value.
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    /// The value as compact JSON text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(n) => {
                let _ = write!(out, "{n}");
            }
            Json::Float(x) if x.is_finite() => {
                let text = format!("{x:.3}");
                let text = text.trim_end_matches('0').trim_end_matches('.');
                out.push_str(if text.is_empty() || text == "-" {
                    "0"
                } else {
                    text
                });
            }
            Json::Float(_) => out.push_str("null"),
            Json::Str(s) => write_string(s, out),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Json::Object(pairs) => {
                out.push('{');
                for (i, (key, value)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_string(key, out);
                    out.push(':');
                    value.write(out);
                }
                out.push('}');
            }
        }
    }
}

impl Json {
    /// Parses one JSON text (RFC 8259): a value with optional whitespace
    /// around it. Numbers without a fraction or exponent that fit an
    /// `i128` become [`Json::Int`], other numbers [`Json::Float`]. Objects
    /// keep their members in order, duplicates included ([`Json::get`]
    /// finds the first).
    pub fn parse(text: &str) -> Result<Json, JsonError> {
        let mut p = Parser {
            text,
            bytes: text.as_bytes(),
            pos: 0,
        };
        p.skip_ws();
        let value = p.value(0)?;
        p.skip_ws();
        if p.pos < p.bytes.len() {
            return Err(p.error("trailing characters after the value"));
        }
        Ok(value)
    }

    /// The member `key` of an object (the first, if it repeats).
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(pairs) => pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The text of a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An integer value that fits a `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        }
    }

    /// An integer value that fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Json::Int(n) => i64::try_from(*n).ok(),
            _ => None,
        }
    }
}

/// Why a text is not JSON, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonError {
    /// Byte offset of the problem in the text.
    pub offset: usize,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at byte {}", self.message, self.offset)
    }
}

impl std::error::Error for JsonError {}

/// Arrays and objects nest at most this deep, so that a hostile line cannot
/// exhaust the stack.
const MAX_DEPTH: usize = 128;

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, message: impl Into<String>) -> JsonError {
        JsonError {
            offset: self.pos,
            message: message.into(),
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// Consumes `word` (a literal) or fails.
    fn literal(&mut self, word: &str, value: Json) -> Result<Json, JsonError> {
        if self.bytes[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.error("unknown literal"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, JsonError> {
        match self.peek() {
            None => Err(self.error("unexpected end of the text")),
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') => self.literal("true", Json::Bool(true)),
            Some(b'f') => self.literal("false", Json::Bool(false)),
            Some(b'n') => self.literal("null", Json::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.error("unexpected character")),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Json, JsonError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        self.pos += 1;
        let mut pairs = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Json::Object(pairs));
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a member name"));
            }
            let key = self.string()?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected ':'"));
            }
            self.pos += 1;
            self.skip_ws();
            let value = self.value(depth)?;
            pairs.push((key, value));
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Json::Object(pairs));
                }
                _ => return Err(self.error("expected ',' or '}'")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Json, JsonError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Json::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Json::Array(items));
                }
                _ => return Err(self.error("expected ',' or ']'")),
            }
        }
    }

    /// A string, the opening quote at `pos`.
    fn string(&mut self) -> Result<String, JsonError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            // Copy the run of plain characters up to the next quote,
            // backslash or control character in one piece.
            let start = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // The stops are ASCII, so the run ends on a character boundary.
            out.push_str(&self.text[start..self.pos]);
            match self.peek() {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let escaped = self
                        .peek()
                        .ok_or_else(|| self.error("unterminated string"))?;
                    self.pos += 1;
                    match escaped {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{08}'),
                        b'f' => out.push('\u{0c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape()?),
                        _ => {
                            self.pos -= 1;
                            return Err(self.error("bad escape"));
                        }
                    }
                }
                Some(_) => return Err(self.error("control character in a string")),
            }
        }
    }

    /// Four hex digits at `pos`.
    fn hex4(&mut self) -> Result<u32, JsonError> {
        let mut value = 0;
        for i in 0..4 {
            let digit = self
                .bytes
                .get(self.pos + i)
                .and_then(|&b| char::from(b).to_digit(16))
                .ok_or_else(|| self.error("bad \\u escape"))?;
            value = value * 16 + digit;
        }
        self.pos += 4;
        Ok(value)
    }

    /// The character of a `\uXXXX` escape (after the `u`), joining a
    /// surrogate pair; a lone surrogate becomes U+FFFD.
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let first = self.hex4()?;
        if (0xd800..0xdc00).contains(&first) && self.bytes[self.pos..].starts_with(b"\\u") {
            let save = self.pos;
            self.pos += 2;
            let second = self.hex4()?;
            if (0xdc00..0xe000).contains(&second) {
                let c = 0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00);
                return Ok(char::from_u32(c).unwrap_or('\u{fffd}'));
            }
            // Not a low surrogate: leave it for the next escape.
            self.pos = save;
        }
        Ok(char::from_u32(first).unwrap_or('\u{fffd}'))
    }

    fn number(&mut self) -> Result<Json, JsonError> {
        let start = self.pos;
        let digits = |p: &mut Self| {
            let from = p.pos;
            while let Some(b'0'..=b'9') = p.peek() {
                p.pos += 1;
            }
            p.pos - from
        };
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let int_start = self.pos;
        let int_digits = digits(self);
        if int_digits == 0 {
            return Err(self.error("expected a digit"));
        }
        if int_digits > 1 && self.bytes[int_start] == b'0' {
            return Err(JsonError {
                offset: int_start,
                message: "leading zero in a number".into(),
            });
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.pos += 1;
            if digits(self) == 0 {
                return Err(self.error("expected a digit after '.'"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            integer = false;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if digits(self) == 0 {
                return Err(self.error("expected a digit in the exponent"));
            }
        }
        let text = &self.text[start..self.pos];
        if integer {
            if let Ok(n) = text.parse::<i128>() {
                return Ok(Json::Int(n));
            }
        }
        text.parse::<f64>().map(Json::Float).map_err(|_| JsonError {
            offset: start,
            message: "bad number".into(),
        })
    }
}

/// Writes `s` as a JSON string (RFC 8259 section 7), with the escaping the
/// hypervisor's own JSON lines use.
fn write_string(s: &str, out: &mut String) {
    hypervisor::kprobe::json::write_str(out, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders() {
        let v = Json::object([
            ("a", Json::int(1u64)),
            ("b", Json::str("x\"y\\z\n\u{1}é")),
            (
                "c",
                Json::Array(vec![Json::Null, Json::Bool(true), Json::Float(1.5)]),
            ),
            ("d", Json::Float(2.0)),
            ("e", Json::Float(f64::NAN)),
            ("f", Json::object(Vec::<(String, Json)>::new())),
            ("g", Json::Float(0.0004)),
        ]);
        assert_eq!(
            v.render(),
            r#"{"a":1,"b":"x\"y\\z\n\u0001é","c":[null,true,1.5],"d":2,"e":null,"f":{},"g":0}"#
        );
    }

    #[test]
    fn parses_what_it_renders() {
        let v = Json::object([
            ("a", Json::int(-12)),
            ("b", Json::str("x\"y\\z\n\u{1}é\u{1f600}")),
            (
                "c",
                Json::Array(vec![Json::Null, Json::Bool(true), Json::Bool(false)]),
            ),
            ("d", Json::object([("e", Json::Array(vec![]))])),
            ("big", Json::int(u64::MAX)),
        ]);
        assert_eq!(Json::parse(&v.render()).unwrap(), v);
    }

    #[test]
    fn parses_a_graph_line() {
        let line = r#"{"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":1500,"retval":"0x10"}"#;
        let v = Json::parse(line).unwrap();
        assert_eq!(v.get("ts_ns").and_then(Json::as_u64), Some(5_000_000_000));
        assert_eq!(v.get("pid").and_then(Json::as_i64), Some(90));
        assert_eq!(v.get("kind").and_then(Json::as_str), Some("graph_return"));
        assert_eq!(v.get("retval").and_then(Json::as_str), Some("0x10"));
        assert_eq!(v.get("missing"), None);
        assert_eq!(v.get("pid").and_then(Json::as_str), None);
        assert_eq!(Json::int(-1).as_u64(), None);
    }

    #[test]
    fn numbers_escapes_and_whitespace() {
        assert_eq!(
            Json::parse(" [0, -0, 1.5, -2e3, 1E+2, 340282366920938463463374607431768211456] ")
                .unwrap(),
            Json::Array(vec![
                Json::Int(0),
                Json::Int(0),
                Json::Float(1.5),
                Json::Float(-2000.0),
                Json::Float(100.0),
                Json::Float(3.402_823_669_209_385e38),
            ])
        );
        assert_eq!(
            Json::parse(r#""\/\b\f\n\r\t\u00e9\ud83d\ude00\ud800x""#).unwrap(),
            Json::str("/\u{8}\u{c}\n\r\té\u{1f600}\u{fffd}x")
        );
        // Duplicate members are kept; `get` finds the first.
        let v = Json::parse(r#"{"a":1,"a":2}"#).unwrap();
        assert_eq!(v.get("a"), Some(&Json::Int(1)));
    }

    #[test]
    fn refuses_what_is_not_json() {
        for (text, message) in [
            ("", "unexpected end of the text"),
            ("{", "expected a member name"),
            (r#"{"a" 1}"#, "expected ':'"),
            (r#"{"a":1,}"#, "expected a member name"),
            ("[1 2]", "expected ',' or ']'"),
            ("[1,]", "unexpected character"),
            ("01", "leading zero in a number"),
            ("1.", "expected a digit after '.'"),
            ("1e", "expected a digit in the exponent"),
            ("-", "expected a digit"),
            ("tru", "unknown literal"),
            (r#""abc"#, "unterminated string"),
            ("\"a\tb\"", "control character in a string"),
            (r#""\x""#, "bad escape"),
            (r#""\u12g4""#, "bad \\u escape"),
            ("{} x", "trailing characters after the value"),
            ("'a'", "unexpected character"),
        ] {
            let e = Json::parse(text).unwrap_err();
            assert_eq!(e.message, message, "{text:?}");
        }
        let e = Json::parse("[1, x]").unwrap_err();
        assert_eq!(e.offset, 4);
        assert_eq!(e.to_string(), "unexpected character at byte 4");
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert_eq!(Json::parse(&deep).unwrap_err().message, "nested too deeply");
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(Json::parse(&ok).is_ok());
    }
}
