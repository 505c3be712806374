//! The program's command line: `fuzz.seed=S fuzz.ops=N fuzz.cpus=C`, plus
//! `fuzz.window=W` (operations per digest line) and `fuzz.log=K` (print
//! every operation of window K with its outcome, as it runs).
//! `fuzz.record=1` keeps the outcomes of operations `fuzz.from=A` up to
//! `fuzz.until=E` (all by default) in memory and, after `end`, answers the
//! host's questions about them on COM1 ([`crate::query`]); the output
//! during the stream, and so its timing, stays that of a plain run. Other
//! words are ignored, so a loader's own additions do no harm.

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
    /// The first operation the record keeps.
    pub from: u64,
    /// The operation the record stops before (0: the stream's end).
    pub until: u64,
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
            window: 1000,
            ..Params::BASE
        }
    }
}

impl Params {
    /// Nothing asked: the fields a run leaves alone (`..Params::BASE`).
    pub const BASE: Params = Params {
        seed: 0,
        ops: 0,
        cpus: 1,
        window: 1,
        log: None,
        from: 0,
        until: 0,
        skip: 0,
        record: false,
        tracer: false,
    };

    /// The operations the record keeps: `from` up to `until`, or to the
    /// stream's end.
    pub fn recorded(&self) -> core::ops::Range<u64> {
        let end = if self.until == 0 {
            self.ops
        } else {
            self.until.min(self.ops)
        };
        self.from.min(end)..end
    }
}

/// The command line that asks for these parameters ([`parse`] reads it
/// back); fields at their [`Params::BASE`] value are left out.
impl core::fmt::Display for Params {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "fuzz.seed={} fuzz.ops={} fuzz.cpus={} fuzz.window={}",
            self.seed, self.ops, self.cpus, self.window
        )?;
        if let Some(w) = self.log {
            write!(f, " fuzz.log={w}")?;
        }
        if self.record {
            f.write_str(" fuzz.record=1")?;
        }
        if self.from != 0 {
            write!(f, " fuzz.from={}", self.from)?;
        }
        if self.until != 0 {
            write!(f, " fuzz.until={}", self.until)?;
        }
        if self.tracer {
            f.write_str(" fuzz.tracer=1")?;
        }
        if self.skip != 0 {
            write!(f, " fuzz.skip={:#x}", self.skip)?;
        }
        Ok(())
    }
}

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
            "from" => p.from = n,
            "until" => p.until = n,
            "tracer" => p.tracer = n != 0,
            "record" => p.record = n != 0,
            "skip" => p.skip = n,
            _ => return Err(word),
        }
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
                from: 0,
                until: 0,
                skip: 0,
                record: false,
                tracer: true,
            }
        );
        assert_eq!(parse("").unwrap(), Params::default());
    }

    #[test]
    fn a_command_line_written_reads_back_the_same() {
        let p = Params {
            seed: 88,
            ops: 200_000,
            cpus: 2,
            window: 50_000,
            log: Some(3),
            from: 150_000,
            until: 200_000,
            skip: 1 << 20,
            record: true,
            tracer: true,
        };
        extern crate std;
        use std::string::ToString;
        assert_eq!(parse(&p.to_string()), Ok(p));
        let base = Params {
            seed: 5,
            ops: 10,
            ..Params::BASE
        };
        assert_eq!(
            base.to_string(),
            "fuzz.seed=5 fuzz.ops=10 fuzz.cpus=1 fuzz.window=1"
        );
        assert_eq!(parse(&base.to_string()), Ok(base));
    }

    #[test]
    fn refuses_bad_values() {
        assert_eq!(parse("fuzz.cpus=9"), Err("fuzz.cpus=9"));
        assert_eq!(parse("fuzz.cpus=0"), Err("fuzz.cpus=0"));
        assert_eq!(parse("fuzz.window=0"), Err("fuzz.window=0"));
        assert_eq!(parse("fuzz.seed=x"), Err("fuzz.seed=x"));
        assert_eq!(parse("fuzz.what=1"), Err("fuzz.what=1"));
        assert_eq!(parse("fuzz.seed"), Err("fuzz.seed"));
        let p = parse("fuzz.ops=100 fuzz.record=1 fuzz.from=7 fuzz.until=20").unwrap();
        assert_eq!((p.record, p.recorded()), (true, 7..20));
        // Past the stream's end, the record stops at the end.
        assert_eq!(
            parse("fuzz.ops=10 fuzz.from=7 fuzz.until=20")
                .unwrap()
                .recorded(),
            7..10
        );
        assert_eq!(
            parse("fuzz.ops=10 fuzz.from=30").unwrap().recorded(),
            10..10
        );
        assert_eq!(parse("fuzz.ops=10").unwrap().recorded(), 0..10);
    }
}
