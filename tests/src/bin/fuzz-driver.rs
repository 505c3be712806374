//! `fuzz-driver` (run it through `scripts/fuzz-guest.sh`): runs the fuzzing
//! guest bare and under the hypervisor in Bochs, compares the digests and
//! says where they part.
//!
//! ```text
//! fuzz-driver --seed S --ops N --cpus C [--window W] [--timeout SECS]
//!             [--minimize] [--only bare|hv] [--keep DIR]
//! fuzz-driver --seed S --cpus C --show INDEX     (prints operation INDEX)
//! ```
//!
//! Exit status: 0 when the runs agree outside the documented differences;
//! 1 on a main-digest difference, a root error, fault, panic or hang (no
//! answer on COM2), or a program that did not finish; 2 on bad arguments.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use hvtrace_tests::fuzz::{self, compare, digests, Params, RunResult};

struct Args {
    params: Params,
    timeout: Duration,
    minimize: bool,
    only: Option<bool>,
    keep: Option<PathBuf>,
    no_record: bool,
}

/// The most guest memory the outcomes of a run may take by default.
const RECORD_LIMIT: u64 = 256 << 20;

fn parse_args() -> Result<Args> {
    let mut p = Params {
        seed: 1,
        ops: 20_000,
        cpus: 1,
        window: 1000,
        record: false,
        tracer: false,
        ..Params::BASE
    };
    let mut a = Args {
        params: p,
        timeout: Duration::ZERO,
        minimize: false,
        only: None,
        keep: None,
        no_record: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| anyhow!("{name} needs a value"));
        let num =
            |s: String| fuzz_guest::cmdline::number(&s).ok_or_else(|| anyhow!("not a number: {s}"));
        match arg.as_str() {
            "--seed" => p.seed = num(value("--seed")?)?,
            "--ops" => p.ops = num(value("--ops")?)?,
            "--cpus" => {
                p.cpus = u32::try_from(num(value("--cpus")?)?)?;
                if !(1..=fuzz_guest::MAX_CPUS as u32).contains(&p.cpus) {
                    bail!("--cpus must be 1 to {}", fuzz_guest::MAX_CPUS);
                }
            }
            "--window" => {
                p.window = num(value("--window")?)?;
                if p.window == 0 {
                    bail!("--window must be at least 1");
                }
            }
            "--log" => p.log = Some(num(value("--log")?)?),
            "--timeout" => a.timeout = Duration::from_secs(num(value("--timeout")?)?.max(1)),
            "--minimize" => a.minimize = true,
            "--tracer" => p.tracer = true,
            "--only" => {
                a.only = Some(match value("--only")?.as_str() {
                    "bare" => false,
                    "hv" => true,
                    other => bail!("--only takes bare or hv, not {other}"),
                })
            }
            "--show" => {
                let n = num(value("--show")?)?;
                for cpu in 0..p.cpus {
                    println!("cpu {cpu} op {n}: {:?}", fuzz::op(&p, cpu, n));
                }
                std::process::exit(0);
            }
            "--keep" => a.keep = Some(PathBuf::from(value("--keep")?)),
            "--no-record" => a.no_record = true,
            "-h" | "--help" => {
                println!("usage: fuzz-guest.sh --seed S --ops N --cpus C [--window W] [--timeout SECS] [--minimize] [--only bare|hv] [--keep DIR] [--no-record]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    // Keep every outcome in the guest (so a differing window is explained
    // from the runs that showed it) while that takes at most 256 MiB.
    p.record = !a.no_record
        && p.log.is_none()
        && fuzz_guest::query::record_bytes(p.ops, p.cpus).is_some_and(|b| b <= RECORD_LIMIT);
    a.params = p;
    if a.timeout.is_zero() {
        // Bochs runs about 5,000 operations a second on each vCPU at the
        // slowest (under root, all vCPUs in one thread): room for that
        // plus the boot.
        a.timeout = Duration::from_secs(120 + p.ops * u64::from(p.cpus) / 2000);
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fuzz: {e:#}");
            return ExitCode::from(2);
        }
    };
    match drive(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fuzz: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn hypervisor() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("HVTRACE_HYPERVISOR").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    hvtrace::vm::hv_image::build()
}

/// Runs bare and under the hypervisor side by side.
fn both(p: &Params, timeout: Duration) -> Result<(RunResult, RunResult)> {
    let hv = hypervisor()?;
    fuzz::guest_files()?;
    let (bare, under) = fuzz::run_pair(p, &hv, timeout);
    Ok((bare?, under?))
}

fn report_run(name: &str, r: &RunResult) {
    let secs = r.fuzz_time.map_or(0.0, |d| d.as_secs_f64());
    eprintln!(
        "fuzz: {name}: {} in {:.1} s ({:.1} s of operations){}",
        if r.finished {
            "finished"
        } else {
            "did NOT finish"
        },
        r.wall.as_secs_f64(),
        secs,
        r.failure
            .as_ref()
            .map(|f| format!(": {f}"))
            .unwrap_or_default()
    );
}

/// One comparison: true when the runs agree outside the documented list.
fn drive(a: &Args) -> Result<bool> {
    let p = a.params;
    eprintln!(
        "fuzz: seed {} ops {} cpus {} window {}",
        p.seed, p.ops, p.cpus, p.window
    );
    if let Some(under) = a.only {
        let hv = if under { Some(hypervisor()?) } else { None };
        let r = fuzz::run_once(&p, hv.as_deref(), a.timeout)?;
        report_run(if under { "hypervisor" } else { "bare" }, &r);
        for l in &r.lines {
            println!("{l}");
        }
        return Ok(r.finished && r.failure.is_none());
    }
    let (bare, hv) = both(&p, a.timeout)?;
    if let Some(dir) = &a.keep {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        fuzz::write_lines(&dir.join("bare.txt"), &bare.lines)?;
        fuzz::write_lines(&dir.join("hv.txt"), &hv.lines)?;
    }
    report_run("bare", &bare);
    report_run("hypervisor", &hv);
    let mut ok = bare.finished && hv.finished && hv.failure.is_none();
    if !bare.finished {
        eprintln!("fuzz: the bare run did not finish: the program itself is at fault (or Bochs)");
    }
    if let Some(exits) = &hv.exits {
        let total: u64 = exits.values().sum();
        let secs = hv.fuzz_time.map_or(1.0, |d| d.as_secs_f64().max(0.001));
        let ops = p.ops * u64::from(p.cpus);
        eprintln!(
            "fuzz: {ops} operations, {total} VM exits; {:.0} operations/s and {:.0} exits/s under the hypervisor",
            ops as f64 / secs,
            total as f64 / secs
        );
        if let Some(t) = &hv.tracer {
            eprintln!(
                "fuzz: tracer: {} arm/disarm cycles; {} probe, {} function, {} graph lines; {} lost{}",
                t.cycles,
                t.probe_lines,
                t.function_lines,
                t.graph_lines,
                t.lost,
                if t.errors.is_empty() { String::new() } else { format!("; errors: {:?}", t.errors) }
            );
            for l in &t.sample {
                eprintln!("fuzz:   {l}");
            }
            if !t.errors.is_empty()
                || t.probe_lines == 0
                || t.function_lines == 0
                || t.graph_lines == 0
            {
                ok = false;
                eprintln!(
                    "fuzz: the tracer failed: a request was refused or a hook never reported"
                );
            }
        }
        let listed: Vec<String> = exits
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        eprintln!("fuzz: exits by reason: {}", listed.join(" "));
    }
    let (db, dh) = (digests(&bare.lines), digests(&hv.lines));
    let c = compare(&db, &dh);
    eprintln!(
        "fuzz: {} windows compared; documented differences: e820{}{}",
        c.windows,
        if c.e820_differs {
            " (differs)"
        } else {
            " (same)"
        },
        c.known
            .iter()
            .map(|(k, n)| format!(", {k} ({n} windows)"))
            .collect::<String>()
    );
    if let Some(&(cpu, win)) = c.main_diffs.first() {
        ok = false;
        eprintln!(
            "fuzz: DIFFERENCE: {} windows differ outside the documented list; the first is cpu {cpu} window {win} (operations {}..{})",
            c.main_diffs.len(),
            win * p.window,
            (win + 1) * p.window
        );
        if bare.finished && hv.finished {
            let search = fuzz::explain(&p, cpu, win, (&bare, &hv), &hypervisor()?, a.timeout)?;
            for step in &search.steps {
                eprintln!("fuzz: narrowing: {step}");
            }
            match search.first {
                Some((b, h)) => {
                    eprintln!(
                        "fuzz: first differing operation:\n  bare:       {b}\n  hypervisor: {h}"
                    );
                }
                None => eprintln!("fuzz: the difference did not come back when narrowed"),
            }
        }
        if a.minimize {
            minimize(&p, a.timeout)?;
        }
    }
    if !ok {
        eprintln!(
            "fuzz: reproduce with: scripts/fuzz-guest.sh --seed {} --ops {} --cpus {} --window {}{}",
            p.seed,
            p.ops,
            p.cpus,
            p.window,
            if p.tracer { " --tracer" } else { "" }
        );
    }
    Ok(ok)
}

/// Bisects the operation count for the shortest run that still differs.
fn minimize(p: &Params, timeout: Duration) -> Result<()> {
    let differs = |ops: u64| -> Result<bool> {
        let q = Params {
            seed: p.seed,
            ops,
            cpus: p.cpus,
            window: ops.max(1),
            tracer: p.tracer,
            ..Params::BASE
        };
        let (b, h) = both(&q, timeout)?;
        let c = compare(&digests(&b.lines), &digests(&h.lines));
        Ok(!c.main_diffs.is_empty() || !h.finished || h.failure.is_some())
    };
    let (mut lo, mut hi) = (0u64, p.ops);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if differs(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
        eprintln!("fuzz: minimize: first difference within {hi} operations");
    }
    eprintln!(
        "fuzz: minimized: {hi} operations per vCPU show it; the last one drawn is vCPU 0's {:?}",
        fuzz::op(p, 0, hi - 1)
    );
    Ok(())
}
