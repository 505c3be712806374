//! Introspection from VMX root against the guest's own view of itself, on
//! both kernels with KASLR on. One detached boot per kernel:
//!
//! - the hypervisor's symbol table (recovered from guest memory alone) is
//!   compared with the guest's `/proc/kallsyms`, text symbols by name and
//!   address: at least 99.9 % must match, mismatches are reported by class;
//! - the traceable-function count is compared with the guest's own
//!   `available_filter_functions`;
//! - the current task seen through `status` while a guest shell spins is the
//!   pid and comm the guest reports for it;
//! - recovery time, symbols per second and index memory are printed.
//!
//! Run: `cargo test -p hvtrace-tests --test introspection -- --nocapture`

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use hvtrace::client::Client;
use hvtrace::Guest;
use hvtrace_tests::{
    guest_exec as exec, hv_status as status, hvtrace_bin, vm_lock, Checks, Detached,
};
use protocol::{Request, Response, SymbolInfo};

const CALL: Duration = Duration::from_secs(60);

/// Every symbol of the given kinds, page by page.
fn all_symbols(c: &mut Client, kinds: &str) -> (Vec<SymbolInfo>, Option<u32>) {
    let mut cursor = 0;
    let mut total = None;
    let mut out = Vec::new();
    loop {
        let req = Request::Syms {
            glob: "*".into(),
            kinds: kinds.into(),
            module: String::new(),
            cursor,
            limit: 1000,
        };
        match c.call(req, CALL).expect("syms failed").response {
            Response::Syms {
                total: t,
                next,
                symbols,
            } => {
                if cursor == 0 {
                    total = t;
                }
                out.extend(symbols);
                match next {
                    Some(n) => cursor = n,
                    None => return (out, total),
                }
            }
            other => panic!("unexpected answer to syms: {other:?}"),
        }
    }
}

/// The guest's own /proc/kallsyms text lines (compressed in the guest, so
/// that the serial console carries a third of the bytes).
fn guest_kallsyms(c: &mut Client, dir: &Path) -> Vec<(u64, char, String)> {
    let b64 = exec(c, "grep -E ' [tT] ' /proc/kallsyms | gzip -1 | base64");
    let enc = dir.join("kallsyms.b64");
    std::fs::write(&enc, b64.replace('\r', "")).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("base64 -d '{}' | gzip -dc", enc.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cannot decode the guest's kallsyms: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(kallsyms_line)
        .collect()
}

/// A `/proc/kallsyms` line as (address, type, name); a module's `[name]`
/// after it is left out.
fn kallsyms_line(l: &str) -> Option<(u64, char, String)> {
    let mut it = l.split_whitespace();
    let addr = u64::from_str_radix(it.next()?, 16).ok()?;
    let kind = it.next()?.chars().next()?;
    let name = it.next()?.to_string();
    Some((addr, kind, name))
}

fn check_kernel(guest: Guest, name: &str) {
    let _vm = vm_lock();
    let dir =
        std::env::temp_dir().join(format!("hvtrace-introspect-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let vm = Detached::start(name, "introspect");
    let mut c = vm.client();
    let mut checks = Checks::new();
    let _ = guest;

    // The hypervisor's table first (the first request runs recovery).
    let t0 = Instant::now();
    let first = status(&mut c);
    let first_wall = t0.elapsed();
    let Some(kernel) = first.kernel.clone() else {
        panic!("the hypervisor found no kernel: {first:?}");
    };
    let t1 = Instant::now();
    let (ours, total) = all_symbols(&mut c, "tT");
    let dump_wall = t1.elapsed();
    checks.eq("syms total", total, Some(ours.len() as u32));

    // The guest's own view.
    let uname = exec(&mut c, "uname -r");
    checks.eq(
        "release from the banner",
        kernel.release.as_str(),
        uname.trim(),
    );
    let theirs = guest_kallsyms(&mut c, &dir);
    checks.check(
        theirs.len() > 10_000,
        format!(
            "only {} text lines in the guest's /proc/kallsyms",
            theirs.len()
        ),
    );

    // Compare by (name, address): names repeat (static functions), so as multisets.
    let mut hv: BTreeMap<(String, u64), usize> = BTreeMap::new();
    for s in &ours {
        *hv.entry((s.name.clone(), s.addr)).or_default() += 1;
    }
    let hv_names: BTreeSet<&str> = ours.iter().map(|s| s.name.as_str()).collect();
    let (mut matched, mut wrong_addr, mut missing) = (0usize, Vec::new(), Vec::new());
    for (addr, _kind, sym) in &theirs {
        match hv.get_mut(&(sym.clone(), *addr)) {
            Some(n) if *n > 0 => {
                *n -= 1;
                matched += 1;
            }
            _ if hv_names.contains(sym.as_str()) => wrong_addr.push(format!("{sym}@{addr:#x}")),
            _ => missing.push(format!("{sym}@{addr:#x}")),
        }
    }
    let extra: usize = hv.values().sum();
    let rate = matched as f64 / theirs.len().max(1) as f64;
    println!(
        "{name}: kernel {} KASLR slide {:#x}",
        kernel.release, kernel.kaslr_slide
    );
    println!(
        "{name}: text symbols: guest {} hypervisor {} matched {} ({:.4} %); address differs {}; missing {}; extra in ours {}",
        theirs.len(),
        ours.len(),
        matched,
        rate * 100.0,
        wrong_addr.len(),
        missing.len(),
        extra
    );
    if !wrong_addr.is_empty() || !missing.is_empty() {
        println!(
            "{name}: first mismatches: {:?} {:?}",
            &wrong_addr[..wrong_addr.len().min(5)],
            &missing[..missing.len().min(5)]
        );
    }
    checks.check(
        rate >= 0.999,
        format!("only {:.4} % of text symbols match", rate * 100.0),
    );
    checks.check(kernel.kaslr_slide != 0, "KASLR slide is 0: was KASLR on?");

    // The host's copy of the index: asked for when the trace stream first
    // starts on the log port, rebuilt by the supervisor with the modules'
    // after it, listed in the run directory as /proc/kallsyms prints them.
    // Its text lines must be the guest's own, in the guest's order.
    let t2 = Instant::now();
    let started = c.call(
        Request::TraceStart {
            format: protocol::TraceFormat::Text,
        },
        CALL,
    );
    checks.check(
        matches!(&started, Ok(r) if r.response == Response::Ok),
        format!("trace start: {started:?}"),
    );
    let listing = vm.run_dir.as_ref().map(|d| d.join("kallsyms"));
    let mut host = None;
    while t2.elapsed() < Duration::from_secs(180) {
        if let Some(text) = listing
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
        {
            host = Some(text);
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let export_wall = t2.elapsed();
    let _ = c.call(Request::TraceStop, CALL);
    match host {
        None => checks.check(
            false,
            format!("no host symbol listing in {listing:?} after {export_wall:?}"),
        ),
        Some(text) => {
            // Module lines end in a tab and `[module]`, as the guest's do.
            let host_text: Vec<(u64, char, String)> = text
                .lines()
                .filter_map(kallsyms_line)
                .filter(|(_, k, _)| matches!(k, 't' | 'T'))
                .collect();
            let modules = text.lines().filter(|l| l.ends_with(']')).count();
            let image = &theirs;
            let first_diff = host_text
                .iter()
                .zip(image)
                .position(|(a, b)| a != b)
                .map(|i| format!("line {i}: host {:?}, guest {:?}", host_text[i], image[i]));
            println!(
                "{name}: host symbol index over the log port: {} lines ({} text, {modules} of modules) in {:.1} s wall, against {:.1} s for the text symbols over the control channel",
                text.lines().count(),
                host_text.len(),
                export_wall.as_secs_f64(),
                dump_wall.as_secs_f64()
            );
            checks.check(
                host_text.len() == image.len() && first_diff.is_none(),
                format!(
                    "host listing: {} text lines, the guest's /proc/kallsyms {}; {first_diff:?}",
                    host_text.len(),
                    image.len()
                ),
            );
        }
    }

    // The CLI: `hvtrace syms GLOB` prints the guest's own address for a
    // function, with its fentry site; no match exits 1.
    let want = theirs
        .iter()
        .find(|(_, _, n)| n == "do_sys_openat2")
        .map(|(a, _, _)| *a);
    let cli = Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(&vm.socket)
        .args(["syms", "do_sys_openat2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&cli.stdout).to_string();
    match want {
        Some(addr) => checks.check(
            cli.status.success()
                && text.starts_with(&format!("{addr:016x} "))
                && text.contains(" do_sys_openat2 site="),
            format!("hvtrace syms do_sys_openat2 printed {text:?} (guest address {addr:#x})"),
        ),
        None => checks.check(false, "the guest's kallsyms has no do_sys_openat2"),
    }
    let none = Command::new(hvtrace_bin())
        .arg("--socket")
        .arg(&vm.socket)
        .args(["syms", "no_such_symbol_*"])
        .output()
        .unwrap();
    checks.eq(
        "exit code of syms with no match",
        none.status.code(),
        Some(1),
    );

    // Traceable functions against the guest's own ftrace.
    // Since 6.0 the list also shows the records ftrace disabled (weak
    // functions overridden at link time) as `__ftrace_invalid_address___N`;
    // they are not functions, so they are not counted.
    let aff = exec(
        &mut c,
        "grep -vc '^__ftrace_invalid_address__' /sys/kernel/tracing/available_filter_functions",
    );
    let aff: u64 = aff.trim().parse().unwrap_or(0);
    let diff = (kernel.traceable as i64 - aff as i64).unsigned_abs();
    println!("{name}: traceable: hypervisor {} guest available_filter_functions {aff} (difference {diff})", kernel.traceable);
    checks.check(aff > 0, "the guest lists no available_filter_functions");
    checks.check(
        (diff as f64) <= aff as f64 * 0.001,
        format!(
            "traceable count {} differs from the guest's {aff} by more than 0.1 %",
            kernel.traceable
        ),
    );

    // The current task while a guest shell spins.
    let pid = exec(
        &mut c,
        "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!",
    );
    let pid: i32 = pid.trim().parse().expect("no pid from the guest");
    let mut seen = Vec::new();
    for _ in 0..20 {
        if let Some(t) = status(&mut c).current_task {
            seen.push((t.pid, t.comm));
        }
    }
    let _ = exec(&mut c, &format!("kill {pid}"));
    println!("{name}: current tasks seen while pid {pid} spins: {seen:?}");
    checks.check(
        seen.iter().any(|(p, comm)| *p == pid && comm == "sh"),
        format!("status never showed the spinning shell (pid {pid}, comm sh): {seen:?}"),
    );
    checks.check(
        kernel.task_layout_error.is_none(),
        format!("task layout: {:?}", kernel.task_layout_error),
    );

    let rec_s = kernel.recovery_ns as f64 / 1e9;
    println!(
        "{name}: recovery {:.3} s of guest time ({:.0} symbols/s), first status {:.2} s wall; index {} KiB ({:.1} B/symbol); {} symbols, {} text",
        rec_s,
        kernel.symbols as f64 / rec_s.max(1e-9),
        first_wall.as_secs_f64(),
        kernel.index_bytes >> 10,
        kernel.index_bytes as f64 / kernel.symbols.max(1) as f64,
        kernel.symbols,
        kernel.text_symbols
    );
    println!(
        "{name}: symbol dump over the control channel: {} symbols in {:.1} s",
        ours.len(),
        dump_wall.as_secs_f64()
    );
    drop(c);
    drop(vm);
    let _ = std::fs::remove_dir_all(&dir);
    checks.finish();
}

#[test]
fn fast_6_12_symbols_match_the_guest() {
    check_kernel(Guest::Fast, "fast");
}

#[test]
fn debian_6_1_symbols_match_the_guest() {
    check_kernel(Guest::Debian, "debian");
}
