#!/usr/bin/env bash
# Runs the fuzzing guest bare and under the hypervisor in Bochs and compares
# what it saw (fuzz-guest/, tests/src/fuzz.rs):
#
#   bash scripts/fuzz-guest.sh --seed S --ops N --cpus C [--tracer]
#                              [--window W] [--timeout SECS] [--minimize]
#                              [--only bare|hv] [--keep DIR] [--show INDEX]
#                              [--no-record]
#
# --ops is per vCPU. --tracer arms and disarms probes, the function tracer
# and graph sessions on the program's own functions while it runs (under
# the hypervisor only; the bare run is the same program untraced). It
# prints each run's end, the operations and VM exits per second, the exit
# reasons, the documented differences that showed, and on any other
# difference the first window and operation that differ. Both runs keep
# every outcome in guest memory (up to 256 MiB of it; --no-record turns
# this off) and after their end answer the driver's questions about them,
# so the runs that showed the difference name its operation, whatever
# timing it needed. Without a record, both run again, whole and with the
# same output while they run, keeping the outcomes of that window only,
# and are asked the same way (--log K instead prints window K's operations
# as they run, which
# changes the timing). --minimize then bisects the
# operation count. --show INDEX prints operation INDEX of each vCPU's
# stream without running anything.
#
# Exit status: 0 when the runs agree outside the documented differences
# (docs/ARCHITECTURE.md, "The fuzzing guest's differences"); 1 on any
# other difference, a root error, fault, panic or hang (no answer on COM2
# after the program's end), or a program that did not finish; 2 on bad
# arguments. A long run: --ops 10000000.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh >&2
cargo build -q --release -p hvtrace-tests --bin fuzz-driver >&2
exec target/release/fuzz-driver "$@"
