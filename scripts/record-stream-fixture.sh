#!/usr/bin/env bash
# Records a real trace stream of the fast-lane guest under Bochs and keeps
# it as the fixture of the host renderer's test
# (tracelang/tests/stream_fixture.rs): the records root sent, root's own
# rendering of them, and the guest symbols they need.
#
#   bash scripts/record-stream-fixture.sh [FIXTURE_DIR]
#
# FIXTURE_DIR defaults to tracelang/tests/fixtures/stream. The supervisor
# records the stream when HVTRACE_RECORD_STREAM names a file (see
# hvtrace/src/daemon/recording.rs); the workload: an entry probe with
# fetch arguments and a return probe on do_sys_openat2, a function-tracer
# window on two functions, a function_graph session on vfs_read over dd.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
out=${1:-$repo/tracelang/tests/fixtures/stream}
target=${CARGO_TARGET_DIR:-$repo/target}

cargo build -q -p hypervisor --release --target x86_64-unknown-none --features bare-metal
cargo build -q --release -p hvtrace
image=$target/x86_64-unknown-none/release/hypervisor
hvtrace=$target/release/hvtrace

work=$(mktemp -d "${TMPDIR:-/tmp}/hvtrace-fixture.XXXXXX")
sock=$work/hvtrace.sock
rec=$work/stream.rec
h() { "$hvtrace" --socket "$sock" "$@"; }
stop() { h stop >/dev/null 2>&1 || true; }
trap stop EXIT

echo "booting the fast-lane guest (work directory $work)" >&2
HVTRACE_RECORD_STREAM=$rec "$hvtrace" run --detach --quiet --emulator bochs --guest fast \
    --timeout 1800 --socket "$sock" --hypervisor "$image" </dev/null 2>"$work/run.err" ||
    { cat "$work/run.err" >&2; exit 1; }
run_dir=$(sed -n 's/.*; run directory //p' "$work/run.err" | head -n 1)
[ -d "$run_dir" ] || { echo "no run directory in: $(cat "$work/run.err")" >&2; exit 1; }

# Probes: one with fetch arguments (a string among them), one on the return.
h probe add 'p:fx/open do_sys_openat2 dfd=%di:s32 path=+0(%si):string flags=%dx:x32' >/dev/null
h probe add 'r:fx/openret do_sys_openat2 ret=$retval:s64' >/dev/null
# The first read starts the stream.
h trace >"$work/trace.0"
h exec 'for i in 1 2 3 4 5 6 7 8 9 10 11 12; do cat /etc/hostname /proc/version >/dev/null; done; cat /nonexistent 2>/dev/null; ls / >/dev/null' >/dev/null
h trace >"$work/trace.1"
# A function-tracer window on two functions the workload calls.
h trace --function vfs_statx --function do_faccessat >"$work/trace.2"
h exec 'for i in 1 2 3 4 5 6 7 8 9 10; do stat / /proc >/dev/null; test -r /etc/hostname; done' >/dev/null
h trace >"$work/trace.3"
h trace --clear-functions >/dev/null
# A function_graph session on vfs_read over dd.
h graph --function vfs_read --comm dd --max-depth 4 --follow --output "$work/graph.txt" \
    2>"$work/graph.err" &
graph=$!
sleep 15
h exec 'for i in 1 2 3; do dd if=/etc/hostname of=/dev/null bs=16 count=2 2>/dev/null; done; dd if=/proc/version of=/dev/null bs=64 count=1 2>/dev/null' >/dev/null
sleep 5
# A background job ignores SIGINT; closing the connection stops the session.
kill -TERM "$graph"
wait "$graph" || true
h probe del fx/open >/dev/null
h probe del fx/openret >/dev/null
h trace >"$work/trace.4"
cp "$run_dir/kallsyms" "$work/kallsyms"
stop
trap - EXIT

if ! cmp -s "$rec.root.txt" "$rec.host.txt"; then
    echo "the host's text differs from root's:" >&2
    diff "$rec.root.txt" "$rec.host.txt" | head -n 40 >&2 || true
fi

mkdir -p "$out"
# The events, without the addresses (they choose the symbols below).
grep -E '^(# |ctx |rec |root )' "$rec" >"$out/stream.rec"
# The symbols: for each address the host resolved, the symbols at the
# address of the one containing it and at the next address above, plus
# the text's bounds; in the listing's order. Addresses compare as strings
# of 16 hex digits.
grep '^sym ' "$rec" | cut -d' ' -f2 | LC_ALL=C sort -u >"$work/addrs"
LC_ALL=C sort -s -k1,1 "$work/kallsyms" | LC_ALL=C awk -v addrs="$work/addrs" '
    BEGIN { while ((getline a < addrs) > 0) want[++nw] = "x" a }
    {
        n++; addr[n] = "x" $1; line[n] = $0
        if ($3 == "_stext" || $3 == "_etext" || $3 == "_sinittext" || $3 == "_einittext") keep_addr["x" $1] = 1
    }
    END {
        i = 1
        for (w = 1; w <= nw; w++) {
            while (i < n && addr[i + 1] <= want[w]) i++
            if (addr[i] > want[w]) continue
            keep_addr[addr[i]] = 1
            for (j = i + 1; j <= n; j++) if (addr[j] > addr[i]) { keep_addr[addr[j]] = 1; break }
        }
        for (k = 1; k <= n; k++) if (addr[k] in keep_addr) print line[k]
    }' >"$out/kallsyms"
cp "$rec.root.txt" "$out/root.txt"
echo "fixture in $out: $(grep -c '^rec ' "$out/stream.rec") records events, $(grep -c '^ctx ' "$out/stream.rec") context events, $(grep -c '^root ' "$out/stream.rec") root text events, $(wc -l <"$out/root.txt") lines of text, $(wc -l <"$out/kallsyms") symbols; $(du -sh "$out" | cut -f1)" >&2
