//! Questions the host asks a recording program (`fuzz.record=1`) after its
//! stream, one per line on COM1, about the outcomes it kept:
//!
//! ```text
//! b <cpu> <from> <len> <n>   ->  blk <cpu> <k> <digest>   (k < n: the main digest
//!                                of operations from + k*len .. + len)
//! o <cpu> <from> <count>     ->  op <cpu> <index> <op> => <outcome> [| <class>: <part>]
//! ```
//!
//! Each answer ends with `qdone`; a question the program cannot read gets
//! `qerr <why>` and `qdone`. The program says `serving` once it listens.

use core::ops::Range;

use crate::cmdline::number;

/// Where the kept outcomes start (128 MiB: above the program, its bss and
/// the page-table scratch region).
pub const RECORD_BASE: u64 = 0x800_0000;
/// Words kept per outcome: vector, error, address, four values.
pub const RECORD_WORDS: u64 = 7;
/// The most operations a question may cover (blocks times their length,
/// or operations printed).
pub const MAX_SPAN: u64 = 1 << 24;
/// The most block digests one question may ask for.
pub const MAX_BLOCKS: u64 = 256;

/// Bytes the outcomes of `ops` operations on each of `cpus` vCPUs take.
pub fn record_bytes(ops: u64, cpus: u32) -> Option<u64> {
    ops.checked_mul(u64::from(cpus))?
        .checked_mul(RECORD_WORDS * 8)
}

/// Where outcome `index` (inside `kept`, the operations the record keeps)
/// of vCPU `cpu` lies.
pub fn record_at(kept: &Range<u64>, cpu: u32, index: u64) -> u64 {
    let len = kept.end - kept.start;
    RECORD_BASE + (u64::from(cpu) * len + index - kept.start) * RECORD_WORDS * 8
}

/// One question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Query {
    /// Main digests of `n` blocks of `len` operations from `from`.
    Blocks {
        cpu: u32,
        from: u64,
        len: u64,
        n: u64,
    },
    /// The operations `from .. from + count`, one line each.
    Ops { cpu: u32, from: u64, count: u64 },
}

/// Reads a question, for a program of `cpus` vCPUs whose record keeps
/// operations `kept`; ranges past its end are cut to it.
pub fn parse(line: &str, cpus: u32, kept: &Range<u64>) -> Result<Query, &'static str> {
    let mut w = line.split_ascii_whitespace();
    let kind = w.next().ok_or("empty question")?;
    let mut num = || {
        w.next()
            .and_then(number)
            .ok_or("a number is missing or bad")
    };
    let cpu = num()?;
    if cpu >= u64::from(cpus) {
        return Err("no such vCPU");
    }
    let cpu = cpu as u32;
    let from = num()?;
    if !kept.contains(&from) {
        return Err("outside the record");
    }
    match kind {
        "b" => {
            let len = num()?;
            let n = num()?;
            if len == 0 || n == 0 || n > MAX_BLOCKS || len.saturating_mul(n) > MAX_SPAN {
                return Err("bad block size or count");
            }
            Ok(Query::Blocks { cpu, from, len, n })
        }
        "o" => {
            let count = num()?.min(kept.end - from);
            if count == 0 || count > MAX_SPAN {
                return Err("bad operation count");
            }
            Ok(Query::Ops { cpu, from, count })
        }
        _ => Err("unknown question"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_are_read_and_bounded() {
        assert_eq!(
            parse("b 1 150000 782 64", 2, &(0..200_000)),
            Ok(Query::Blocks {
                cpu: 1,
                from: 150_000,
                len: 782,
                n: 64
            })
        );
        assert_eq!(
            parse("o 0 199990 100", 2, &(150_000..200_000)),
            Ok(Query::Ops {
                cpu: 0,
                from: 199_990,
                count: 10
            })
        );
        let all = 0..10;
        assert_eq!(parse("o 2 0 1", 2, &all), Err("no such vCPU"));
        assert_eq!(parse("o 0 10 1", 2, &all), Err("outside the record"));
        assert_eq!(parse("o 0 4 1", 2, &(5..10)), Err("outside the record"));
        assert_eq!(parse("b 0 0 0 4", 2, &all), Err("bad block size or count"));
        assert_eq!(
            parse("b 0 0 1 257", 2, &all),
            Err("bad block size or count")
        );
        assert_eq!(parse("x 0 0 1", 2, &all), Err("unknown question"));
        assert_eq!(parse("b 0", 2, &all), Err("a number is missing or bad"));
        assert_eq!(parse("", 2, &all), Err("empty question"));
    }

    #[test]
    fn outcomes_are_laid_out_per_vcpu() {
        assert_eq!(record_at(&(0..100), 0, 0), RECORD_BASE);
        assert_eq!(record_at(&(0..100), 1, 0), RECORD_BASE + 100 * 56);
        assert_eq!(record_at(&(0..100), 1, 2), RECORD_BASE + 102 * 56);
        // A record of a range starts at its first operation.
        assert_eq!(record_at(&(50..150), 0, 50), RECORD_BASE);
        assert_eq!(record_at(&(50..150), 1, 52), RECORD_BASE + 102 * 56);
        assert_eq!(record_bytes(1_000_000, 2), Some(112_000_000));
        assert_eq!(record_bytes(u64::MAX, 2), None);
    }
}
