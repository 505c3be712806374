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
bash scripts/guest/debian-modules.sh >/dev/null
bash scripts/build-hypervisor.sh >/dev/null

features=guest-introspect/real-kernels,loader/real-kernels,tracelang/real-kernels
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0

if [[ $# -gt 0 ]]; then
    # Arguments (a test binary or a name filter) go to one sequential run
    # over the whole workspace, VM suite included (in the plain release
    # profile).
    set +e
    cargo test --workspace --release --no-fail-fast --features "$features" "$@" 2>&1 |
        tee "$logs/all.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    set -e
else
    # 1. Every crate's host tests (the tests over the real kernel images
    #    included, through the features): the workspace without the VM
    #    suite. guest-introspect's run on their own in the `test-release`
    #    profile (release with integer-overflow checks, see Cargo.toml): its
    #    corruption tests must see an overflow as a panic, not as a wrapped
    #    value. The hypervisor image keeps the plain release profile.
    set +e
    cargo test --workspace --exclude guest-introspect --exclude hvtrace-tests --release \
        --no-fail-fast --features loader/real-kernels,tracelang/real-kernels 2>&1 | tee "$logs/host.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    cargo test -p guest-introspect --profile test-release --no-fail-fast \
        --features real-kernels 2>&1 | tee "$logs/introspect.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    # The VM suite's own library: the fuzzing guest's host half (its
    # bzImage, kallsyms, digests and seed corpus), no emulator.
    cargo test -p hvtrace-tests --release --lib --no-fail-fast 2>&1 | tee "$logs/suite-lib.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    set -e

    # 2. The VM suite. An emulator runs its CPUs in one host thread, so two
    #    test binaries run at once, one per core, in two lanes of about
    #    equal length; the tests that time the emulator against itself (the
    #    boot cost, the control channel's pace) run alone after them. Within
    #    a binary the tests take the VM lock and run one at a time.
    lane_a=(graph vm_boot debug_build bare_boot malformed_kernel qemu_novmx smp tracedat)
    lane_b=(introspection kprobes hardening oneshot root_panic root_stack_guard smp_debian)
    alone=(control boot_cost fuzz display_ports)
    # Every VM test binary runs in exactly one lane: a new one must be added.
    for f in tests/tests/*.rs; do
        t=$(basename "$f" .rs)
        [[ " ${lane_a[*]} ${lane_b[*]} ${alone[*]} " == *" $t "* ]] ||
            { echo "hvtrace: tests/tests/$t.rs is in no lane of scripts/test.sh" >&2; exit 1; }
    done
    cargo test -p hvtrace-tests --release --no-run
    lane() {
        local name=$1
        shift
        local args=()
        for t in "$@"; do args+=(--test "$t"); done
        cargo test -p hvtrace-tests --release --no-fail-fast "${args[@]}" >"$logs/$name.log" 2>&1
    }
    lane a "${lane_a[@]}" &
    pid_a=$!
    lane b "${lane_b[@]}" &
    pid_b=$!
    wait "$pid_a" || status=1
    wait "$pid_b" || status=1
    lane alone "${alone[@]}" || status=1
    for l in a b alone; do
        echo "hvtrace: VM lane $l:"
        cat "$logs/$l.log"
    done
fi

# Each test binary's time, slowest first.
echo "hvtrace: time per test binary:"
cat "$logs"/*.log |
    awk '/^ *Running /{p=$NF; gsub(/[()]/, "", p); n=split(p, a, "/"); bin=a[n]; sub(/-[0-9a-f]+$/, "", bin)
                    name=bin " (" $2 ($2=="unittests" ? " " $3 : "") ")"}
     /^ *Doc-tests /{name="doc-tests " $2}
     /^test result:/{for(i=1;i<=NF;i++) if($i=="in"){t=$(i+1); sub(/s$/,"",t); printf "%10.1f s  %s\n", t, name}}' |
    sort -rn | head -n 30
[[ $status -eq 0 ]] || { echo "hvtrace: tests failed"; exit 1; }

echo "hvtrace: all tests finished in $(( $(date +%s) - start )) s"
