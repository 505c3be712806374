//! A small explicit JSON writer: objects with string, number, null and
//! nested-object members, strings escaped per RFC 8259.

use alloc::string::String;
use core::fmt::Write;

/// Appends `s` as a JSON string literal, quotes included.
pub fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Appends bytes as a JSON string: invalid UTF-8 becomes U+FFFD.
pub fn write_bytes(out: &mut String, b: &[u8]) {
    let mut s = String::with_capacity(b.len());
    super::render::push_lossy(&mut s, b);
    write_str(out, &s);
}

/// An object being written; [`Object::end`] closes it.
pub struct Object<'a> {
    out: &'a mut String,
    empty: bool,
}

impl<'a> Object<'a> {
    /// Opens an object at the end of `out`.
    pub fn begin(out: &'a mut String) -> Self {
        out.push('{');
        Self { out, empty: true }
    }

    fn key(&mut self, k: &str) {
        if !self.empty {
            self.out.push(',');
        }
        self.empty = false;
        write_str(self.out, k);
        self.out.push(':');
    }

    /// `"k":"v"`.
    pub fn str(&mut self, k: &str, v: &str) -> &mut Self {
        self.key(k);
        write_str(self.out, v);
        self
    }

    /// `"k":"v"` from bytes.
    pub fn bytes(&mut self, k: &str, v: &[u8]) -> &mut Self {
        self.key(k);
        write_bytes(self.out, v);
        self
    }

    /// `"k":123`.
    pub fn u64(&mut self, k: &str, v: u64) -> &mut Self {
        self.key(k);
        let _ = write!(self.out, "{v}");
        self
    }

    /// `"k":-123`.
    pub fn i64(&mut self, k: &str, v: i64) -> &mut Self {
        self.key(k);
        let _ = write!(self.out, "{v}");
        self
    }

    /// `"k":null`.
    pub fn null(&mut self, k: &str) -> &mut Self {
        self.key(k);
        self.out.push_str("null");
        self
    }

    /// `"k":{...}`: a nested object, closed by its own `end`.
    pub fn object(&mut self, k: &str) -> Object<'_> {
        self.key(k);
        Object::begin(self.out)
    }

    /// Closes the object.
    pub fn end(self) {
        self.out.push('}');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes() {
        let mut s = String::new();
        write_str(&mut s, "a\"b\\c\nd\te\u{1}f\u{7f}é");
        assert_eq!(s, r#""a\"b\\c\nd\te\u0001f"#.to_string() + "\u{7f}é\"");
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        let mut s = String::new();
        write_bytes(&mut s, b"a\xffb");
        assert_eq!(s, "\"a\u{fffd}b\"");
    }

    #[test]
    fn nested_objects() {
        let mut s = String::new();
        let mut o = Object::begin(&mut s);
        o.str("a", "x").u64("b", 1).i64("c", -2).null("d");
        let mut inner = o.object("e");
        inner.str("f", "g");
        inner.end();
        o.object("h").end();
        o.end();
        assert_eq!(s, r#"{"a":"x","b":1,"c":-2,"d":null,"e":{"f":"g"},"h":{}}"#);
    }
}
