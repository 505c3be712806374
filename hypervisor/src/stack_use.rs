//! How deep root's stacks have been used.
//!
//! Each root stack (the boot processor's, from the boot stub, and each
//! AP's, from the frame pool) is filled with [`PATTERN`] before it is run
//! on, except the part in use at that moment. A stack grows down, so the
//! lowest word that no longer holds the pattern marks the deepest point
//! ever reached ([`used`]): what `status` reports per vCPU and root logs
//! when the guest stops. A guard page under every stack catches an
//! overflow; the high-water mark tells how close the run came to it.

/// The fill of an unused stack word.
pub const PATTERN: u64 = 0x57AC_C0DE_57AC_C0DE;

/// The bytes of a stack of `words` 8-byte words (index 0 its lowest
/// address) that have been used: from the lowest word that does not hold
/// [`PATTERN`] to the top. `read(i)` reads word `i`.
pub fn used(words: usize, read: impl Fn(usize) -> u64) -> u64 {
    let untouched = (0..words).take_while(|&i| read(i) == PATTERN).count();
    (words - untouched) as u64 * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deepest_write_sets_the_mark() {
        let mut stack = vec![PATTERN; 1024];
        let read = |s: &[u64]| used(s.len(), |i| s[i]);
        assert_eq!(read(&stack), 0);
        // The top frames, then a deeper call that returned: its words stay
        // written, and the mark stays at the deepest.
        for w in &mut stack[1000..] {
            *w = 0;
        }
        assert_eq!(read(&stack), 24 * 8);
        stack[700] = 1;
        assert_eq!(read(&stack), 324 * 8);
        // A word that happens to hold the pattern above the deepest write
        // does not move the mark.
        stack[800] = PATTERN;
        assert_eq!(read(&stack), 324 * 8);
        // Down to the last word: all of it.
        stack[0] = 7;
        assert_eq!(read(&stack), 1024 * 8);
        assert_eq!(used(0, |_| 0), 0);
    }
}
