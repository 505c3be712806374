//! Bochs' display takes the first free TCP port of 5900-5949 and ends at
//! once when it cannot listen on any: when all are taken, and when
//! another Bochs starting at the same moment bound the same port first
//! (the fuzzing test's side-by-side starts failed a CI run that way). The
//! launcher must wait and start Bochs again, not fail.
//!
//! The test takes every free port of the range itself, starts the
//! fast-lane kernel bare in Bochs, gives the ports back a few seconds
//! later, and checks that the run then starts and boots. It runs alone
//! (scripts/test.sh): another lane's emulators come and go on these ports.
//!
//! Run: `cargo test -p hvtrace-tests --test display_ports -- --nocapture`

use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use hvtrace::vm::bochs::RFB_PORTS;
use hvtrace::{Emulator, Guest, Vm};
use hvtrace_tests::{expected_release, guest_config, must, vm_lock, Checks};

/// How long the ports stay taken after the start begins.
const HOLD: Duration = Duration::from_secs(4);

#[test]
fn a_start_waits_for_a_free_display_port() {
    let _vm = vm_lock();
    let cfg = guest_config(Guest::Fast, Duration::from_secs(300))
        .bare()
        .with_emulator(Emulator::Bochs);
    let release = expected_release(&cfg.kernel);
    let mut checks = Checks::new();

    // Every port the range has free, taken as Bochs takes it (any address).
    let held: Vec<TcpListener> = RFB_PORTS
        .filter_map(|port| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).ok())
        .collect();
    assert!(
        !held.is_empty(),
        "no port of {RFB_PORTS:?} was free to take: the test cannot show anything"
    );
    eprintln!("holding {} of the display ports for {HOLD:?}", held.len());
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(HOLD);
        drop(held);
    });

    let began = Instant::now();
    let started = Vm::start(cfg);
    let waited = began.elapsed();
    releaser
        .join()
        .expect("the thread that gives the ports back");
    let mut vm = must(started, "starting Bochs while its display ports are taken");
    eprintln!(
        "started after {:.1} s, in {} attempts",
        waited.as_secs_f64(),
        vm.start_attempts()
    );
    checks.check(
        vm.start_attempts() >= 2,
        format!(
            "Bochs started at the first attempt ({} attempts) with every display port taken",
            vm.start_attempts()
        ),
    );
    checks.check(
        waited >= HOLD,
        format!("the start returned after {waited:?}, before the ports came free ({HOLD:?})"),
    );
    if checks.ok("the guest shell", vm.wait_ready()).is_some() {
        if let Some(uname) = checks.ok("uname -r", vm.exec("uname -r")) {
            checks.eq("uname -r", uname.output.trim(), release.as_str());
        }
        checks.ok("power off", vm.poweroff());
    }
    checks.finish();
}
