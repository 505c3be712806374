#!/usr/bin/env bash
# Runs every hvtrace test on a fresh Debian machine: installs the packages,
# fetches and builds the guest kernels and the initramfs (cached outside the
# repository), builds the hypervisor image, then runs the host unit tests and
# the VM test suite (Bochs, QEMU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.cargo/bin:$PATH"
start=$(date +%s)

bash scripts/setup.sh >/dev/null
bash scripts/guest/initramfs.sh >/dev/null
bash scripts/guest/fast-kernel.sh >/dev/null
bash scripts/guest/debian-kernel.sh >/dev/null
bash scripts/build-hypervisor.sh >/dev/null

# VM tests boot emulators; they serialize themselves, so the default test
# threads only parallelize the host tests.
cargo test --workspace --release "$@"

echo "hvtrace: all tests finished in $(( $(date +%s) - start )) s"
