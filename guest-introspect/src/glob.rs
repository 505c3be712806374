//! Shell-style globs over byte strings: `*` matches any run (empty
//! included), `?` any one byte, everything else itself. No character classes
//! or escapes (kernel symbol names contain neither `*` nor `?`).
//!
//! Greedy matching with one backtrack point (the last `*`): O(pattern x
//! text) in the worst case, linear for the usual `prefix*` / `*suffix`.

/// Whether `text` matches `pattern` as a whole.
pub fn matches(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0usize, 0usize);
    // Where to resume after the last `*`: (pattern index after it, text
    // index it currently absorbs up to).
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                p += 1;
                star = Some((p, t));
            }
            Some(&c) if c == b'?' || text.get(t) == Some(&c) => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern.iter().skip(p).all(|&c| c == b'*')
}

/// Whether `pattern` has a wildcard at all (else it is an exact name).
pub fn is_glob(pattern: &[u8]) -> bool {
    pattern.iter().any(|&c| c == b'*' || c == b'?')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases() {
        let m = |p: &str, t: &str| matches(p.as_bytes(), t.as_bytes());
        assert!(m("", ""));
        assert!(!m("", "a"));
        assert!(m("*", ""));
        assert!(m("*", "vfs_read"));
        assert!(m("vfs_*", "vfs_read"));
        assert!(!m("vfs_*", "do_vfs_read"));
        assert!(m("*_read", "vfs_read"));
        assert!(m("*vfs*", "do_vfs_read"));
        assert!(m("v?s_read", "vfs_read"));
        assert!(!m("v?s_read", "vs_read"));
        assert!(m("a*b*c", "aXXbYYbc"));
        assert!(!m("a*b*c", "aXXbYYbd"));
        assert!(m("**a**", "a"));
        assert!(m("*?", "x"));
        assert!(!m("*?", ""));
        assert!(is_glob(b"a*") && !is_glob(b"abc"));
    }
}
