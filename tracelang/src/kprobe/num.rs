//! Integer parsing with the kernel's `kstrto*` rules (lib/kstrtox.c), so a
//! number the kernel takes in a kprobe spec is taken here, and one it
//! refuses is refused.
//!
//! Base 0 picks the radix from the prefix: `0x`/`0X` followed by a hex digit
//! is hex, a leading `0` is octal, anything else decimal. The whole string
//! must be digits; overflow is an error.

/// `_kstrtoull`: digits only, no sign.
fn parse_digits(s: &str, base: u32) -> Option<u64> {
    let b = s.as_bytes();
    let (radix, digits) = if base == 0 {
        match b {
            [b'0', x, hex @ ..]
                if (*x | 0x20) == b'x' && hex.first().is_some_and(u8::is_ascii_hexdigit) =>
            {
                (16, hex)
            }
            [b'0', ..] => (8, b),
            _ => (10, b),
        }
    } else {
        (base, b)
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &c in digits {
        let d = (c as char).to_digit(radix)?;
        v = v.checked_mul(u64::from(radix))?.checked_add(u64::from(d))?;
    }
    Some(v)
}

/// `kstrtoull` / `kstrtoul`: an optional leading `+`, then digits.
pub fn kstrtoull(s: &str, base: u32) -> Option<u64> {
    parse_digits(s.strip_prefix('+').unwrap_or(s), base)
}

/// `kstrtouint`.
pub fn kstrtouint(s: &str, base: u32) -> Option<u32> {
    kstrtoull(s, base).and_then(|v| u32::try_from(v).ok())
}

/// `kstrtoll` / `kstrtol`: `-digits`, or what `kstrtoull` takes, within
/// the signed range.
pub fn kstrtoll(s: &str, base: u32) -> Option<i64> {
    match s.strip_prefix('-') {
        Some(rest) => negate(parse_digits(rest, base)?),
        None => i64::try_from(kstrtoull(s, base)?).ok(),
    }
}

/// `-v` as an i64, if it fits (`-(2^63)` does).
pub fn negate(v: u64) -> Option<i64> {
    if v <= i64::MAX as u64 {
        Some(-(v as i64))
    } else if v == 1u64 << 63 {
        Some(i64::MIN)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn radix_prefixes() {
        assert_eq!(kstrtoull("10", 0), Some(10));
        assert_eq!(kstrtoull("0x10", 0), Some(16));
        assert_eq!(kstrtoull("0X1f", 0), Some(31));
        assert_eq!(kstrtoull("010", 0), Some(8));
        assert_eq!(kstrtoull("0", 0), Some(0));
        assert_eq!(kstrtoull("+7", 0), Some(7));
        assert_eq!(kstrtoull("010", 10), Some(10));
    }

    #[test]
    fn refusals() {
        assert_eq!(kstrtoull("", 0), None);
        assert_eq!(kstrtoull("0x", 0), None);
        assert_eq!(kstrtoull("0xg", 0), None);
        assert_eq!(kstrtoull("08", 0), None);
        assert_eq!(kstrtoull("12a", 0), None);
        assert_eq!(kstrtoull("-1", 0), None);
        assert_eq!(kstrtoull("++1", 0), None);
        assert_eq!(kstrtoull("18446744073709551616", 0), None);
        assert_eq!(kstrtoull("0x10", 10), None);
        assert_eq!(kstrtouint("4294967296", 0), None);
    }

    #[test]
    fn signed() {
        assert_eq!(kstrtoll("-5", 0), Some(-5));
        assert_eq!(kstrtoll("-0x10", 0), Some(-16));
        assert_eq!(kstrtoll("+0x10", 0), Some(16));
        assert_eq!(kstrtoll("-9223372036854775808", 0), Some(i64::MIN));
        assert_eq!(kstrtoll("-9223372036854775809", 0), None);
        assert_eq!(kstrtoll("9223372036854775808", 0), None);
        assert_eq!(kstrtoll("-+5", 0), None);
        assert_eq!(kstrtoll("+-5", 0), None);
        assert_eq!(kstrtoll("-", 0), None);
    }
}
