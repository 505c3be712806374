//! The fuzzing guest (fuzz-guest/) against the bare CPU, in Bochs: the
//! seed corpus (each seed reproduces a bug the fuzzer found in root) and
//! fixed seeds on one and two vCPUs. Each run boots the program bare and
//! under the hypervisor side by side and compares the digests of every
//! window of operations: they must agree outside the documented
//! differences, and the documented differences must show where root
//! really differs (root hides VMX from CPUID, refuses the VMX MSRs, takes
//! its memory out of the e820, and with two vCPUs owns INIT and SIPI and
//! the APIC stores it does not carry out).
//!
//! Runs on one and two vCPUs go with hooks under fire: while the program
//! runs, a probe, the function tracer and a graph session on its own
//! functions are armed and disarmed every 300 ms, and each must report.
//!
//! Run: `cargo test --release -p hvtrace-tests --test fuzz -- --nocapture`

use std::time::{Duration, Instant};

use hvtrace_tests::fuzz::{self, compare, digests, Params, RunResult};
use hvtrace_tests::{hypervisor_image, vm_lock, Checks};

/// Each run's limit.
const TIMEOUT: Duration = Duration::from_secs(120);

/// One comparison: the runs, the digests compared.
struct Pair {
    bare: RunResult,
    hv: RunResult,
    cmp: fuzz::Comparison,
}

fn pair(p: &Params, checks: &mut Checks) -> Option<Pair> {
    let (bare, hv) = fuzz::run_pair(p, &hypervisor_image(), TIMEOUT);
    let hv = checks.ok("the run under the hypervisor", hv);
    let bare = checks.ok("the bare run", bare);
    let (bare, hv) = (bare?, hv?);
    let cmp = compare(&digests(&bare.lines), &digests(&hv.lines));
    Some(Pair { bare, hv, cmp })
}

/// Checks what every comparison must show; returns the number of
/// operations both runs carried out.
fn agree(label: &str, p: &Params, r: &Pair, checks: &mut Checks) -> u64 {
    checks.check(
        r.bare.finished && r.bare.failure.is_none(),
        format!("{label}: the bare run did not finish: {:?}", r.bare.failure),
    );
    checks.check(
        r.hv.finished && r.hv.failure.is_none(),
        format!(
            "{label}: the run under the hypervisor did not finish: {:?} (last lines {:?})",
            r.hv.failure,
            r.hv.lines.iter().rev().take(3).collect::<Vec<_>>()
        ),
    );
    checks.check(
        r.hv.hv_errors.is_empty(),
        format!("{label}: root reported {:?}", r.hv.hv_errors),
    );
    let exits = r.hv.exits.clone().unwrap_or_default();
    checks.check(
        r.hv.exits.is_some(),
        format!("{label}: root did not answer a status request after the program's end"),
    );
    let windows = p.ops.div_ceil(p.window) * u64::from(p.cpus);
    checks.eq(
        &format!("{label}: windows compared"),
        r.cmp.windows,
        windows,
    );
    if let Some(&(cpu, win)) = r.cmp.main_diffs.first() {
        // Say which operation, as the driver would.
        let detail =
            match fuzz::explain(p, cpu, win, (&r.bare, &r.hv), &hypervisor_image(), TIMEOUT) {
                Ok(search) => format!(
                    "{:?}; first differing operation {:?}",
                    search.steps, search.first
                ),
                Err(e) => format!("(naming the operation failed: {e:#})"),
            };
        checks.check(
            false,
            format!(
                "{label}: {} windows differ outside the documented list, first cpu {cpu} window {win}: {detail}",
                r.cmp.main_diffs.len()
            ),
        );
    }
    // The documented differences are real: root hides VMX (and more) from
    // CPUID, refuses the VMX capability MSRs and takes its memory and the
    // AP page out of the e820.
    checks.check(
        r.cmp.e820_differs,
        format!("{label}: the e820 tables agree, but root takes its memory out"),
    );
    for class in ["cpuid-filter", "msr-refused"] {
        checks.check(
            r.cmp.known.get(class).copied().unwrap_or(0) > 0,
            format!(
                "{label}: the documented difference {class} never showed: {:?}",
                r.cmp.known
            ),
        );
    }
    if p.cpus > 1 {
        for class in ["apic-refused", "init-sipi"] {
            checks.check(
                r.cmp.known.get(class).copied().unwrap_or(0) > 0,
                format!(
                    "{label}: the documented difference {class} never showed: {:?}",
                    r.cmp.known
                ),
            );
        }
        checks.check(
            exits.get("EPT_VIOLATION").copied().unwrap_or(0) > 0,
            format!("{label}: no APIC store exited with two vCPUs: {exits:?}"),
        );
    }
    for reason in [
        "CPUID",
        "MSR_READ",
        "MSR_WRITE",
        "IO_INSTRUCTION",
        "CR_ACCESS",
        "XSETBV",
        "VMCALL",
    ] {
        checks.check(
            exits.get(reason).copied().unwrap_or(0) > 0,
            format!("{label}: no {reason} exit: {exits:?}"),
        );
    }
    if p.tracer {
        // The hooks were there, and reported, while the program ran.
        match &r.hv.tracer {
            Some(t) => {
                checks.check(
                    t.recovered,
                    format!("{label}: root never found the program's symbols"),
                );
                checks.check(t.cycles >= 1, format!("{label}: the hooks were never taken off and put on again while the program ran"));
                checks.check(
                    t.errors.is_empty(),
                    format!("{label}: tracer requests failed: {:?}", t.errors),
                );
                checks.check(
                    t.probe_lines > 0 && t.function_lines > 0 && t.graph_lines > 0,
                    format!("{label}: a hook never reported: {t:?}"),
                );
                checks.eq(&format!("{label}: trace events lost"), t.lost, 0);
                // The probe fetches its argument: a line says `arg=0x...`.
                checks.check(
                    t.sample
                        .iter()
                        .any(|l| l.contains("h0: (fz_hook_0+0x0/") && l.contains(" arg=0x")),
                    format!(
                        "{label}: no probe line names fz_hook_0 with its argument: {:?}",
                        t.sample
                    ),
                );
                eprintln!(
                    "{label}: tracer: {} cycles, {} probe, {} function, {} graph lines",
                    t.cycles, t.probe_lines, t.function_lines, t.graph_lines
                );
            }
            None => checks.check(false, format!("{label}: no tracer report")),
        }
    }
    let done = digests(&r.hv.lines).done.len();
    checks.eq(
        &format!("{label}: vCPUs that finished under the hypervisor"),
        done,
        p.cpus as usize,
    );
    let total: u64 = exits.values().sum();
    eprintln!(
        "{label}: {} operations, {total} exits, {:.1} s of operations under the hypervisor; documented differences {:?}",
        p.ops * u64::from(p.cpus),
        r.hv.fuzz_time.unwrap_or_default().as_secs_f64(),
        r.cmp.known
    );
    if r.bare.finished && r.hv.finished && r.cmp.main_diffs.is_empty() {
        p.ops * u64::from(p.cpus)
    } else {
        0
    }
}

#[test]
fn the_fuzzing_guest_sees_root_as_the_bare_cpu() {
    let _vm = vm_lock();
    let started = Instant::now();
    let mut checks = Checks::new();
    let mut ops = 0;
    for (label, p) in fuzz::CORPUS.iter().chain(fuzz::CI_SEEDS.iter()) {
        if let Some(r) = pair(p, &mut checks) {
            ops += agree(label, p, &r, &mut checks);
        }
    }
    checks.check(
        ops >= 100_000,
        format!("only {ops} operations agreed (at least 100,000 wanted)"),
    );
    eprintln!(
        "fuzz: {ops} operations agreed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    checks.finish();
}

/// The driver's way to name a differing operation, checked on a difference
/// made on purpose: two bare runs of one stream, the second drawing the
/// faults (`Op::Fault`: each raises its exception, and leaves no state
/// behind) but not carrying them out. Asked about the second window, the
/// runs must name its first fault, which the
/// host draws itself (two rounds of block digests narrow 20,000
/// operations first); both runs answer from their own records, so
/// nothing runs twice.
#[test]
fn a_differing_operation_is_named_from_the_runs_that_showed_it() {
    let _vm = vm_lock();
    let mut checks = Checks::new();
    let p = Params {
        seed: 5,
        ops: 40_000,
        cpus: 1,
        window: 20_000,
        record: true,
        // The record of the asked window only, as a run again without a
        // whole record keeps (`fuzz::first_differing_op`).
        from: 20_000,
        until: 40_000,
        tracer: false,
        ..Params::BASE
    };
    let stream = fuzz::stream(&p);
    let first = stream
        .iter()
        .skip(p.window as usize)
        .position(|op| matches!(op, fuzz_guest::ops::Op::Fault(_)))
        .expect("a fault in the second window") as u64
        + p.window;
    let kind = fuzz_guest::ops::kind(&stream[first as usize]);
    let q = Params {
        skip: 1 << kind,
        ..p
    };
    let other = std::thread::spawn(move || fuzz::run_in_thread(&q, None, TIMEOUT));
    let a = checks.ok(
        "the run that switches tasks",
        fuzz::run_once(&p, None, TIMEOUT),
    );
    let b = checks.ok(
        "the run that skips them",
        other
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the run panicked"))),
    );
    if let (Some(a), Some(b)) = (a, b) {
        checks.check(
            a.kept.is_some() && b.kept.is_some(),
            "both finished runs kept their VMs to be asked",
        );
        let cmp = compare(&digests(&a.lines), &digests(&b.lines));
        checks.eq(
            "the differing windows",
            cmp.main_diffs.clone(),
            vec![(0, 0), (0, 1)],
        );
        match fuzz::explain(&p, 0, 1, (&a, &b), &hypervisor_image(), TIMEOUT) {
            Ok(search) => {
                eprintln!(
                    "fuzz: seed {}, the second window's first fault {first}: {:?}",
                    p.seed, search.steps
                );
                checks.check(
                    search.steps.len() >= 3,
                    format!(
                        "two rounds of block digests, then the operations: {:?}",
                        search.steps
                    ),
                );
                let (x, y) = search.first.clone().unwrap_or_default();
                let prefix = format!("op 0 {first} Fault(");
                checks.check(
                    x.starts_with(&prefix) && y.starts_with(&prefix),
                    format!(
                        "the window's first fault is operation {first}, but the answer was {x:?} / {y:?} ({:?})",
                        search.steps
                    ),
                );
                let blank = "=> ok [0x0 0x0 0x0 0x0]";
                checks.check(
                    y.contains(blank) && !x.contains(blank),
                    format!(
                        "the skipped switch reads blank and the real one does not: {x:?} / {y:?}"
                    ),
                );
            }
            Err(e) => checks.check(false, format!("naming the operation failed: {e:#}")),
        }
    }
    checks.finish();
}
