//! JSON through serde_json: the CLI's `--json` output (one line per value,
//! members in the order written: the `preserve_order` feature) and the
//! JSON lines the hypervisor streams. These helpers build values in the
//! project's shapes: integers as they are, floats with at most 3 decimals.

pub use serde_json::Value as Json;

/// An object from `(key, value)` pairs, members in this order.
pub fn object<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Json {
    Json::Object(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

/// An integer value.
pub fn int(n: impl Into<serde_json::Number>) -> Json {
    Json::Number(n.into())
}

/// A string value.
pub fn str(s: impl Into<String>) -> Json {
    Json::String(s.into())
}

/// A float rounded to 3 decimals (written without a fraction when it has
/// none); a value that is not finite is `null`.
pub fn float3(x: f64) -> Json {
    if !x.is_finite() {
        return Json::Null;
    }
    let r = (x * 1000.0).round() / 1000.0;
    // Whole values up to 2^53 are exact as integers.
    if r.fract() == 0.0 && r.abs() < 9_007_199_254_740_992.0 {
        return int(r as i64);
    }
    serde_json::Number::from_f64(r).map_or(Json::Null, Json::Number)
}

/// Parses one JSON text.
pub fn parse(text: &str) -> serde_json::Result<Json> {
    serde_json::from_str(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_in_order_with_escapes_and_short_floats() {
        let v = object([
            ("a", int(1u64)),
            ("b", str("x\"y\\z\n\u{1}é")),
            (
                "c",
                Json::Array(vec![Json::Null, Json::Bool(true), float3(1.5)]),
            ),
            ("d", float3(2.0)),
            ("e", float3(f64::NAN)),
            ("f", object(Vec::<(String, Json)>::new())),
            ("g", float3(0.0004)),
            ("h", float3(1234.567)),
            ("i", float3(-0.25)),
        ]);
        assert_eq!(
            v.to_string(),
            r#"{"a":1,"b":"x\"y\\z\n\u0001é","c":[null,true,1.5],"d":2,"e":null,"f":{},"g":0,"h":1234.567,"i":-0.25}"#
        );
        // Members keep the order written, not sorted.
        assert_eq!(
            object([("z", int(1)), ("a", int(2))]).to_string(),
            r#"{"z":1,"a":2}"#
        );
    }

    #[test]
    fn parses_what_it_renders() {
        let v = object([
            ("a", int(-12)),
            ("b", str("x\"y\\z\n\u{1}é\u{1f600}")),
            (
                "c",
                Json::Array(vec![Json::Null, Json::Bool(true), Json::Bool(false)]),
            ),
            ("d", object([("e", Json::Array(vec![]))])),
            ("big", int(u64::MAX)),
        ]);
        assert_eq!(parse(&v.to_string()).unwrap(), v);
    }

    #[test]
    fn parses_a_graph_line() {
        let line = r#"{"ts":"5.000000","ts_ns":5000000000,"cpu":0,"pid":90,"comm":"dd","kind":"graph_return","func":"vfs_read","depth":0,"duration_ns":1500,"retval":"0x10"}"#;
        let v = parse(line).unwrap();
        assert_eq!(v.get("ts_ns").and_then(Json::as_u64), Some(5_000_000_000));
        assert_eq!(v.get("pid").and_then(Json::as_i64), Some(90));
        assert_eq!(v.get("kind").and_then(Json::as_str), Some("graph_return"));
        assert_eq!(v.get("retval").and_then(Json::as_str), Some("0x10"));
        assert_eq!(v.get("missing"), None);
        assert_eq!(v.get("pid").and_then(Json::as_str), None);
        assert_eq!(int(-1).as_u64(), None);
    }

    #[test]
    fn refuses_what_is_not_json() {
        for text in [
            "",
            "{",
            r#"{"a" 1}"#,
            "[1 2]",
            "01",
            "1.",
            "tru",
            r#""abc"#,
            "{} x",
        ] {
            assert!(parse(text).is_err(), "{text:?}");
        }
    }
}
