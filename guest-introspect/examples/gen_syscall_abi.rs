//! Writes the syscall ABI tables of `src/syscall_abi/` (`x86_64.rs`,
//! `i386.rs`) from a kernel source tree's `syscall_64.tbl`,
//! `syscall_32.tbl` and `include/linux/syscalls.h`.
//!
//! Usage: `gen_syscall_abi KERNEL_SOURCE [OUT_DIR]` (OUT_DIR defaults to
//! this crate's `src/syscall_abi`). `scripts/gen-syscall-abi.sh` finds the
//! cached source the guest scripts unpack.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use guest_introspect::syscall_abi::{generate, kernel_version, Arch, PROTOTYPES};

fn read(dir: &Path, file: &str) -> Result<String, String> {
    let path = dir.join(file);
    std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn run(src: &Path, out: &Path) -> Result<(), String> {
    let version = kernel_version(&read(src, "Makefile")?)
        .ok_or_else(|| format!("{}/Makefile has no kernel version", src.display()))?;
    let header = read(src, PROTOTYPES)?;
    for arch in Arch::ALL {
        let text = generate(arch, &read(src, arch.tbl())?, &header, &version);
        let path = out.join(arch.file());
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("wrote {} (Linux {version})", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (src, out) = match args.as_slice() {
        [src] => (
            PathBuf::from(src),
            Path::new(env!("CARGO_MANIFEST_DIR")).join("src/syscall_abi"),
        ),
        [src, out] => (PathBuf::from(src), PathBuf::from(out)),
        _ => {
            eprintln!("usage: gen_syscall_abi KERNEL_SOURCE [OUT_DIR]");
            return ExitCode::from(2);
        }
    };
    match run(&src, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gen_syscall_abi: {e}");
            ExitCode::FAILURE
        }
    }
}
