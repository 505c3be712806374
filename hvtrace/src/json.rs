//! A minimal JSON writer for the CLI's `--json` output (objects, arrays,
//! strings, integers, floats, booleans and null, on one line).

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

/// Writes `s` as a JSON string (RFC 8259 section 7).
fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
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
}
