//! The hypervisor built with the dev profile (debug assertions and
//! integer-overflow checks on) runs the real guest: one fast-lane boot in
//! Bochs, introspection, a probe whose events are checked against the
//! workload, the function tracer, and a clean stop. An arithmetic overflow
//! or a failed assertion anywhere on these paths is a panic in root, which
//! ends the VM with `hvtrace: error: hypervisor panic` and fails the test.
//!
//! Run: `cargo test --release -p hvtrace-tests --test debug_build -- --nocapture`

use hvtrace_tests::{
    guest_exec as exec, hv_call as call, hv_status as status, vm_lock, Checks, Detached, Stream,
};
use std::time::{Duration, Instant};

use protocol::{Request, Response};

#[test]
fn debug_hypervisor_traces_the_fast_lane() {
    let _l = vm_lock();
    let root = hvtrace::vm::guest::repo_root();
    let image = hvtrace::vm::hv_image::build_debug(&root.join("target").join("debug-hypervisor"))
        .expect("building the debug hypervisor failed");
    let vm = Detached::start_image("fast", "debug-build", &image, &[]);
    let mut c = vm.client();
    let mut ck = Checks::new();
    // Recovery is many times slower without optimization: ask until it is
    // done, each answer bounded by the link's own limit.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut recovered = false;
    while Instant::now() < deadline {
        match c
            .call(Request::Status, Duration::from_secs(60))
            .map(|r| r.response)
        {
            Ok(Response::Status(st)) if st.kernel.is_some() => {
                recovered = true;
                break;
            }
            Ok(_) | Err(_) => std::thread::sleep(Duration::from_secs(2)),
        }
    }
    ck.check(recovered, "the debug build recovered the kernel");
    match call(
        &mut c,
        Request::ProbeAdd {
            spec: "p:dbgopen do_sys_openat2 dfd=%di filename=+0(%si):string".into(),
        },
    ) {
        Response::ProbeAdded { .. } => {}
        other => ck.check(false, format!("probe add: {other:?}")),
    }
    let mut stream = Stream::new();
    let _ = stream.read(&mut c);
    exec(&mut c, "for i in 1 2 3; do cat /etc/hostname; done");
    let text = stream.read(&mut c);
    let opens = text
        .lines()
        .filter(|l| l.contains("dbgopen:") && l.contains("filename=\"/etc/hostname\""))
        .count();
    ck.eq("probe events for three opens of /etc/hostname", opens, 3);
    let t = status(&mut c).tracer;
    ck.check(t.hits >= 3, format!("hits counted: {}", t.hits));
    let alive = exec(&mut c, "echo alive");
    ck.eq("guest healthy", alive.trim(), "alive");
    let (rc, out, err) = vm.cli(&["stop"]);
    let text = format!("{out}{err}");
    ck.eq("stop succeeds", rc, 0);
    ck.check(
        text.contains("stopped by the host") && !text.contains("panic"),
        format!("the debug build stopped cleanly: {text:?}"),
    );
    ck.finish();
}
