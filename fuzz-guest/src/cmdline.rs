//! The program's command line: `fuzz.seed=S fuzz.ops=N fuzz.cpus=C`, plus
//! `fuzz.window=W` (operations per digest line) and `fuzz.log=K` (print
//! every operation of window K with its outcome, as it runs). `fuzz.blocks=B`
//! keeps a digest per B operations from operation `fuzz.from=A` on (the
//! first [`BLOCKS_MAX`] blocks) and prints them after the stream, and
//! `fuzz.hold=K` keeps the outcomes of block K's operations and prints them
//! after the stream too: the output during the stream, and so its timing,
//! stays that of a plain run. `fuzz.record=1` keeps every operation's
//! outcome in memory and, after `end`, answers the host's questions about
//! them on COM1 ([`crate::query`]): the run that showed a difference tells
//! which operation, with no second run. Other words are ignored, so a
//! loader's own additions do no harm.

/// What the command line asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// The seed of every vCPU's stream.
    pub seed: u64,
    /// Operations per vCPU.
    pub ops: u64,
    /// vCPUs to run on (1..=[`crate::MAX_CPUS`]).
    pub cpus: u32,
    /// Operations per digest window.
    pub window: u64,
    /// The window whose operations are printed one by one.
    pub log: Option<u64>,
    /// Operations per block digest, printed after the stream (0: none).
    pub blocks: u64,
    /// The first operation of block 0.
    pub from: u64,
    /// The block whose operations are printed after the stream (needs
    /// `blocks`, at most [`HOLD_MAX`] of them).
    pub hold: Option<u64>,
    /// Operation kinds (bits by `ops::kind`) drawn but not carried out:
    /// to find which kind a failure needs. Their outcome is blank.
    pub skip: u64,
    /// Keep every outcome and answer questions after the stream.
    pub record: bool,
    /// Tracer mode: the host hooks the program's functions while it runs.
    /// The program waits for a byte on COM1 before its stream, and never
    /// writes IA32_LSTAR (where root's introspection starts).
    pub tracer: bool,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            seed: 1,
            ops: 10_000,
            cpus: 1,
            window: 1000,
            log: None,
            blocks: 0,
            from: 0,
            hold: None,
            skip: 0,
            record: false,
            tracer: false,
        }
    }
}

/// The most operations `fuzz.hold` keeps per vCPU.
pub const HOLD_MAX: u64 = 2048;

/// The most block digests `fuzz.blocks` keeps per vCPU (later blocks are
/// not kept).
pub const BLOCKS_MAX: u64 = 64;

/// Parses a decimal or `0x` hexadecimal number.
pub fn number(s: &str) -> Option<u64> {
    if let Some(hex) = s.strip_prefix("0x") {
        u64::from_str_radix(hex, 16).ok()
    } else {
        s.parse().ok()
    }
}

/// Reads the parameters; the first bad value is returned as the error.
pub fn parse(line: &str) -> Result<Params, &str> {
    let mut p = Params::default();
    for word in line.split_ascii_whitespace() {
        let Some(rest) = word.strip_prefix("fuzz.") else {
            continue;
        };
        let Some((key, value)) = rest.split_once('=') else {
            return Err(word);
        };
        let n = number(value).ok_or(word)?;
        match key {
            "seed" => p.seed = n,
            "ops" => p.ops = n,
            "cpus" if (1..=crate::MAX_CPUS as u64).contains(&n) => p.cpus = n as u32,
            "window" if n > 0 => p.window = n,
            "log" => p.log = Some(n),
            "blocks" => p.blocks = n,
            "from" => p.from = n,
            "hold" => p.hold = Some(n),
            "tracer" => p.tracer = n != 0,
            "record" => p.record = n != 0,
            "skip" => p.skip = n,
            _ => return Err(word),
        }
    }
    if p.hold.is_some() && !(1..=HOLD_MAX).contains(&p.blocks) {
        return Err("fuzz.hold");
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_words_and_ignores_others() {
        let p = parse(
            "console=ttyS0 fuzz.seed=0x10 fuzz.ops=500 fuzz.cpus=2 fuzz.window=50 fuzz.log=3 fuzz.tracer=1",
        )
        .unwrap();
        assert_eq!(
            p,
            Params {
                seed: 16,
                ops: 500,
                cpus: 2,
                window: 50,
                log: Some(3),
                blocks: 0,
                from: 0,
                hold: None,
                skip: 0,
                record: false,
                tracer: true,
            }
        );
        assert_eq!(parse("").unwrap(), Params::default());
    }

    #[test]
    fn refuses_bad_values() {
        assert_eq!(parse("fuzz.cpus=9"), Err("fuzz.cpus=9"));
        assert_eq!(parse("fuzz.cpus=0"), Err("fuzz.cpus=0"));
        assert_eq!(parse("fuzz.window=0"), Err("fuzz.window=0"));
        assert_eq!(parse("fuzz.seed=x"), Err("fuzz.seed=x"));
        assert_eq!(parse("fuzz.what=1"), Err("fuzz.what=1"));
        assert_eq!(parse("fuzz.seed"), Err("fuzz.seed"));
        // A held block needs a block size the program can keep.
        assert_eq!(parse("fuzz.hold=2"), Err("fuzz.hold"));
        assert_eq!(parse("fuzz.blocks=4096 fuzz.hold=2"), Err("fuzz.hold"));
        let p = parse("fuzz.blocks=500 fuzz.from=7 fuzz.hold=2").unwrap();
        assert_eq!((p.blocks, p.from, p.hold), (500, 7, Some(2)));
    }
}
