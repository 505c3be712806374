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
# threads only parallelize the host tests. --workspace brings in the VM
# suite (`tests`), which plain `cargo test` leaves out; the features, the
# tests over the real kernel images.
#
# guest-introspect's tests run on their own, in the `test-release` profile
# (release with integer-overflow checks, see Cargo.toml): the corruption
# tests must see an overflow as a panic, not as a wrapped value. The
# hypervisor image above keeps the plain release profile.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --exclude guest-introspect --release --no-fail-fast \
    --features loader/real-kernels "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
cargo test -p guest-introspect --profile test-release --no-fail-fast \
    --features real-kernels "$@" 2>&1 | tee -a "$log"
rc_introspect=${PIPESTATUS[0]}
[[ $rc -ne 0 ]] || rc=$rc_introspect
set -e

# Each test binary's time, slowest first.
echo "hvtrace: time per test binary:"
awk '/^ *Running /{p=$NF; gsub(/[()]/, "", p); n=split(p, a, "/"); bin=a[n]; sub(/-[0-9a-f]+$/, "", bin)
                    name=bin " (" $2 ($2=="unittests" ? " " $3 : "") ")"}
     /^ *Doc-tests /{name="doc-tests " $2}
     /^test result:/{for(i=1;i<=NF;i++) if($i=="in"){t=$(i+1); sub(/s$/,"",t); printf "%10.1f s  %s\n", t, name}}' "$log" |
    sort -rn | head -n 25
[[ $rc -eq 0 ]] || { echo "hvtrace: tests failed (cargo test exit $rc)"; exit "$rc"; }

echo "hvtrace: all tests finished in $(( $(date +%s) - start )) s"
