//! What the host test suites share: one small seeded PRNG, the seed taken
//! from the clock or `HVTRACE_SEED`, and synthetic kernel pieces (kallsyms
//! tables and BTF blobs laid out as the kernel lays them out).

pub mod synth;

/// A small deterministic PRNG (xorshift64*). Not for anything but tests.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// A generator from `seed` (any value; 0 is moved off the fixed point).
    pub fn new(seed: u64) -> Rng {
        Rng((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// An index in `0..n`; 0 when `n` is 0.
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// An element of `xs` (not empty).
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.index(xs.len())]
    }

    /// A random byte.
    pub fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }

    /// True once in `one_in` times on average.
    pub fn chance(&mut self, one_in: usize) -> bool {
        self.index(one_in) == 0
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.byte()).collect()
    }

    /// Text of `len` characters from a small alphabet (letters, digits,
    /// underscore, space).
    pub fn text(&mut self, len: usize) -> String {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz_0123456789 ";
        (0..len).map(|_| *self.pick(CHARS) as char).collect()
    }

    /// Text of fewer than `max` characters.
    pub fn text_upto(&mut self, max: usize) -> String {
        let len = self.index(max);
        self.text(len)
    }
}

/// A seed from the clock, printed so that a failure can be replayed with
/// `HVTRACE_SEED`.
pub fn seed() -> u64 {
    let s = std::env::var("HVTRACE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        });
    eprintln!("seed: HVTRACE_SEED={s}");
    s
}
