//! A broken guest kernel is refused by the hypervisor with one clear error
//! line, and the machine powers off: no hang, no triple fault, no guest code.
//!
//! The hypervisor checks the kernel image before it looks at VMX, so QEMU TCG
//! (seconds per boot) covers every malformation; one case also runs in Bochs,
//! the VMX machine, to show the same path there.
//!
//! Run: `cargo test -p hvtrace-tests --test malformed_kernel`

use std::path::{Path, PathBuf};
use std::time::Duration;

use hvtrace::{Emulator, Guest, RunConfig, Vm};
use hvtrace_tests::{guest_config, hypervisor_image, must, vm_lock, Checks};

/// The real fast-lane kernel, from which the broken ones are derived.
fn real_kernel() -> Vec<u8> {
    let cfg = guest_config(Guest::Fast, Duration::from_secs(10));
    std::fs::read(&cfg.kernel)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cfg.kernel.display()))
}

fn write_variant(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("cannot write the test kernel");
    p
}

/// Boots `kernel` under the hypervisor and returns the hypervisor's error
/// lines after checking that the guest never started and that the emulator
/// ended by itself (the hypervisor powered the machine off).
fn refused(emulator: Emulator, kernel: &Path, checks: &mut Checks, label: &str) -> Vec<String> {
    let base = guest_config(Guest::Fast, Duration::from_secs(180));
    let cfg = RunConfig {
        kernel: kernel.to_path_buf(),
        ..base
    }
    .with_hypervisor(hypervisor_image())
    .with_emulator(emulator);
    let mut vm = must(Vm::start(cfg), &format!("starting the {label} run"));
    if vm.wait_ready().is_ok() {
        checks.check(
            false,
            format!("{label}: the guest shell came up with a broken kernel"),
        );
    }
    // The hypervisor powers off after its error: the emulator must end on
    // its own, well before this deadline.
    let status = vm.wait_exit_or_kill(Duration::from_secs(60));
    checks.check(
        matches!(status, Ok(Some(_))),
        format!("{label}: the emulator did not end by itself after the error ({status:?})"),
    );
    checks.check(
        !vm.guest_started(),
        format!("{label}: a `guest started` line appeared"),
    );
    let lines = vm.hv_lines();
    checks.check(
        !lines.iter().any(|l| l.contains("triple fault")),
        format!("{label}: triple fault reported: {lines:?}"),
    );
    let errors = vm.hv_errors();
    checks.check(
        errors.len() == 1,
        format!("{label}: expected exactly one error line, got {errors:?}"),
    );
    vm.close();
    errors
}

#[test]
fn broken_kernels_are_refused_under_qemu() {
    let _vm = vm_lock();
    let real = real_kernel();
    let dir = tempdir();
    let mut bad_magic = real.clone();
    bad_magic[0x202..0x206].copy_from_slice(b"HdrX");
    let mut old = real.clone();
    old[0x206..0x208].copy_from_slice(&0x020bu16.to_le_bytes());
    let mut no64 = real.clone();
    no64[0x236] &= !1;
    let mut bad_flag = real.clone();
    bad_flag[0x1fe] = 0;
    let cases: [(&str, Vec<u8>, &str); 6] = [
        ("bad-magic", bad_magic, "expected \"HdrS\""),
        ("protocol-2.11", old, "boot protocol 2.11 is too old"),
        ("no-64bit-entry", no64, "no 64-bit entry point"),
        (
            "bad-boot-flag",
            bad_flag,
            "boot flag 0xaa00, expected 0xAA55",
        ),
        (
            "truncated",
            real[..real.len() / 2].to_vec(),
            "image truncated",
        ),
        ("tiny", real[..300].to_vec(), "only 300 bytes"),
    ];
    let mut checks = Checks::new();
    for (name, bytes, expect) in cases {
        let k = write_variant(&dir, name, &bytes);
        let errors = refused(Emulator::Qemu { kvm: false }, &k, &mut checks, name);
        checks.check(
            errors
                .iter()
                .any(|e| e.starts_with("guest kernel:") && e.contains(expect)),
            format!("{name}: no `guest kernel:` error containing {expect:?}: {errors:?}"),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    checks.finish();
}

#[test]
fn bad_magic_is_refused_in_bochs() {
    let _vm = vm_lock();
    let mut bytes = real_kernel();
    bytes[0x202..0x206].copy_from_slice(b"XXXX");
    let dir = tempdir();
    let k = write_variant(&dir, "bad-magic", &bytes);
    let mut checks = Checks::new();
    let errors = refused(Emulator::Bochs, &k, &mut checks, "bochs bad-magic");
    checks.check(
        errors
            .iter()
            .any(|e| e.starts_with("guest kernel: not a bzImage (setup header magic 58 58 58 58")),
        format!("no bad-magic error line: {errors:?}"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    checks.finish();
}

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("hvtrace-badkernel-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("cannot create a temp dir");
    d
}
