#!/usr/bin/env bash
# What a traced call costs the guest: hvtrace's probe, count, function
# tracer and function graph on one function, against the guest kernel's own
# kprobes and function_graph on the same function, in one boot.
#
#   bash scripts/bench.sh [--guest fast|debian] [--cpus 1|2] [--rounds R]
#                         [--calls N] [--phases ID,ID...] [--output FILE]
#
# It boots the guest once under the hypervisor in Bochs (`hvtrace run
# --detach`, KASLR on) and starts one `hvbench rounds` process per vCPU in
# it (pinned with taskset, or by hvbench itself where taskset is missing).
# Each process serves rounds from a FIFO: a line `getppid TAG` (or `openat
# TAG PATH`) runs N calls in a loop and answers with the loop's guest time.
# The phases run in interleaved rounds (every phase once per round, the
# order rotated from round to round), so each phase's samples are spread
# over the whole run; between two rounds the script switches the tracer
# with `hvtrace` commands and the guest's tracefs, while the same processes
# keep running. Around each round it takes `hvtrace status --json`.
#
# For each phase it prints, and writes to target/bench/hit-cost.json: the
# median, min and max over the rounds of the guest instructions per call
# above the phase's baseline loop in the same round (`none`: getppid with
# no probe; `none_open`: openat with no probe; the baseline rows give their
# loop's own instructions per call), and per call: VM exits, VMCALL exits
# and the vCPUs' counters of what a nested hypervisor would add
# (`vmcs_unshadowed`, `invept`, and any counter named like vmreads,
# vmwrites or locked_ops that the status reports), and root's own time
# as the status reports it (`root_instr`: root on the hypercalls, from
# each exit to the next entry less turns; `turns_instr`: root's turns,
# where the trace stream's drain runs), in instructions per call.
#
# Guest time is CLOCK_MONOTONIC in the guest. Bochs runs with `clock:
# sync=none` at 50 million instructions per emulated second, so 1 emulated
# instruction = 20 ns, on each vCPU; root's work on a hit is emulated
# instructions too and counts. The trace stream is on throughout (started
# before the first round, as any reader of the trace starts it): root
# sends every record to the host while the guest waits, which in Bochs
# (the log port) costs about as much as the hit itself.
#
# A phase that cannot be measured (a tracer that did not see the loop's
# calls, a guest kprobe that was not placed as its row says, a round that
# failed) stops the script with a message and a non-zero exit; the VM is
# stopped on every way out.
#
# Environment: HVTRACE_HYPERVISOR: boot this hypervisor image instead of
# building it.
set -euo pipefail
invoked_from=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.cargo/bin:$PATH"

ALL_PHASES=(none probe count function graph_call guest_function_graph_call
    guest_kprobe_ftrace guest_kprobe_int3 none_open probe_string guest_kprobe_string)
# Bochs's instructions per emulated second (`hvtrace run --bochs-ips`).
IPS=50000000
# The file the openat phases open, and the string probes fetch.
OPEN_PATH=/etc/hostname
# Longest round, in guest seconds (the guest's `timeout`) and in host
# seconds (`hvtrace exec` waits at most 600 s for a guest command).
ROUND_GUEST_TIMEOUT=540
ROUND_HOST_TIMEOUT=620
# Longest any other hvtrace command may take (seconds).
CMD_TIMEOUT=300

guest=fast
cpus=1
rounds=5
calls=10000
phases_arg=
output=target/bench/hit-cost.json

usage() {
    cat <<EOF
usage: bash scripts/bench.sh [options]
  --guest fast|debian   the fast-lane kernel (default) or Debian's stock kernel
  --cpus 1|2            vCPUs; with 2, the same loop runs on both CPUs at once
  --rounds R            rounds per phase, at least 5 (default $rounds)
  --calls N             calls per loop per round (default $calls)
  --phases ID,...       only these phases (their baseline loops are added)
                        [default: ${ALL_PHASES[*]}]
  --output FILE         where the JSON goes (default $output)
EOF
}

die() {
    printf 'bench: %s\n' "$*" >&2
    exit 1
}

while (($#)); do
    case $1 in
    --guest) guest=${2:-}; shift 2 || die "--guest needs a value" ;;
    --cpus) cpus=${2:-}; shift 2 || die "--cpus needs a value" ;;
    --rounds) rounds=${2:-}; shift 2 || die "--rounds needs a value" ;;
    --calls) calls=${2:-}; shift 2 || die "--calls needs a value" ;;
    --phases) phases_arg=${2:-}; shift 2 || die "--phases needs a value" ;;
    --output)
        output=${2:-}
        shift 2 || die "--output needs a value"
        [[ $output == /* ]] || output=$invoked_from/$output
        ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
    esac
done
[[ $guest == fast || $guest == debian ]] || die "--guest is fast or debian (got '$guest')"
[[ $cpus == 1 || $cpus == 2 ]] || die "--cpus is 1 or 2 (got '$cpus')"
if ! [[ $rounds =~ ^[0-9]+$ ]] || ((rounds < 5 || rounds > 1000)); then
    die "--rounds takes 5 to 1000 (a median of fewer rounds says little; got '$rounds')"
fi
if ! [[ $calls =~ ^[0-9]+$ ]] || ((calls < 100 || calls > 10000000)); then
    die "--calls takes 100 to 10000000 (got '$calls')"
fi

# The phases to run, in ALL_PHASES order, with the baselines they need.
declare -A wanted=()
if [[ -n $phases_arg ]]; then
    IFS=, read -r -a asked <<<"$phases_arg"
    for p in "${asked[@]}"; do
        [[ " ${ALL_PHASES[*]} " == *" $p "* ]] || die "unknown phase '$p' (phases: ${ALL_PHASES[*]})"
        wanted[$p]=1
    done
else
    for p in "${ALL_PHASES[@]}"; do wanted[$p]=1; done
fi
op_of() {
    case $1 in
    none_open | probe_string | guest_kprobe_string) echo openat ;;
    *) echo getppid ;;
    esac
}
for p in "${!wanted[@]}"; do
    if [[ $(op_of "$p") == openat ]]; then wanted[none_open]=1; else wanted[none]=1; fi
done
phases=()
for p in "${ALL_PHASES[@]}"; do
    [[ -n ${wanted[$p]:-} ]] && phases+=("$p")
done

command -v python3 >/dev/null || die "python3 is needed (scripts/setup.sh installs it)"
command -v timeout >/dev/null || die "timeout (coreutils) is needed"

start_s=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/hvtrace-bench.XXXXXX")
sock=$work/hvtrace.sock
supervisor=
bg_pid=
finished=
HV=

# Stops the VM (and a `graph` or `count` command of a round, if one is
# running) on every way out.
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n $bg_pid ]] && kill -0 "$bg_pid" 2>/dev/null; then
        kill -INT "$bg_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$bg_pid" 2>/dev/null || break; sleep 0.2; done
        kill -TERM "$bg_pid" 2>/dev/null || true
    fi
    if [[ -n $HV && -S $sock ]]; then
        timeout -k 10 120 "$HV" --socket "$sock" stop >"$work/stop.log" 2>&1 || true
    fi
    if [[ -n $supervisor ]]; then
        for _ in $(seq 100); do kill -0 "$supervisor" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$supervisor" 2>/dev/null; then
            printf 'bench: the VM did not stop; ending its supervisor (pid %s) and emulator\n' "$supervisor" >&2
            local children
            children=$(ps -o pid= --ppid "$supervisor" 2>/dev/null || true)
            # shellcheck disable=SC2086 # one pid per word
            kill -TERM "$supervisor" $children 2>/dev/null || true
            sleep 2
            # shellcheck disable=SC2086
            kill -KILL "$supervisor" $children 2>/dev/null || true
        fi
    fi
    if [[ -n $finished ]]; then
        rm -rf "$work"
    else
        printf 'bench: logs kept in %s\n' "$work" >&2
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log() {
    printf 'bench: %s\n' "$*" >&2
}

# --- build what the run needs, as scripts/demo.sh and scripts/test.sh do ---
log "setting up (packages, kernel, initramfs, hypervisor, CLI)"
bash scripts/setup.sh >/dev/null
bash scripts/guest/initramfs.sh >/dev/null
if [[ $guest == fast ]]; then
    bash scripts/guest/fast-kernel.sh >/dev/null
else
    bash scripts/guest/debian-kernel.sh >/dev/null
    bash scripts/guest/debian-modules.sh >/dev/null
fi
if [[ -n ${HVTRACE_HYPERVISOR:-} ]]; then
    image=$HVTRACE_HYPERVISOR
    [[ -f $image ]] || die "HVTRACE_HYPERVISOR=$image is not a file"
else
    image=$(bash scripts/build-hypervisor.sh)
fi
cargo build -q --release -p hvtrace
HV=${CARGO_TARGET_DIR:-target}/release/hvtrace
[[ -x $HV ]] || die "$HV was not built"

# One hvtrace command on our VM, bounded in time.
hv() {
    timeout -k 10 "$CMD_TIMEOUT" "$HV" --socket "$sock" "$@"
}

# A guest shell command; its output on stdout. Fails when it fails.
gexec() {
    local out
    if ! out=$(hv exec "$1" 2>"$work/exec.err"); then
        printf '%s\n' "$out" >&2
        cat "$work/exec.err" >&2
        die "guest command failed: $1"
    fi
    printf '%s\n' "${out//$'\r'/}"
}

status_json() {
    hv status --json >"$1" 2>"$work/status.err" || {
        cat "$work/status.err" >&2
        die "hvtrace status failed"
    }
}

# The helper that checks each round and writes the report.
cat >"$work/bench.py" <<'PY'
import json, re, statistics, sys

def load(path):
    with open(path) as f:
        return json.load(f)

def fail(msg):
    print("bench: " + msg, file=sys.stderr)
    sys.exit(1)

OURS = {"probe": 1, "count": 1, "function": 1, "graph_call": 2, "probe_string": 1}
BASELINE = {"none": None, "none_open": None}
GUEST_KPROBES = ("guest_kprobe_ftrace", "guest_kprobe_int3", "guest_kprobe_string")
# Per-vCPU counters reported per hit when the status has them.
NAMED = ("vmcs_unshadowed", "invept")
PATTERN = re.compile(r"vmread|vmwrite|locked")

def baseline_of(phase):
    if phase in BASELINE:
        return None
    return "none_open" if phase in ("probe_string", "guest_kprobe_string") else "none"

def exits_by_name(status):
    return {e["name"]: e["count"] for e in status.get("exits", [])}

def vcpu_counters(before, after):
    """Deltas of the per-vCPU counters of NAMED and PATTERN, summed over vCPUs."""
    out = {}
    keys = set()
    for v in after.get("per_vcpu", []):
        for k, x in v.items():
            if type(x) is int and (k in NAMED or PATTERN.search(k)):
                keys.add(k)
    for k in sorted(keys):
        a = sum(v.get(k, 0) for v in after.get("per_vcpu", []))
        b = sum(v.get(k, 0) for v in before.get("per_vcpu", []))
        out[k] = a - b
    # Root's own time (status's root_* of each vCPU, in ns): on the
    # hypercalls, and on the turns (the stream's drain among them).
    for name, kinds in (("root_ns", ("root_hit", "root_return", "root_refused")), ("turns_ns", ("root_turns",))):
        if all(k in v for v in after.get("per_vcpu", []) for k in kinds):
            total = lambda s: sum(v.get(k, {}).get("sum_ns", 0) for v in s.get("per_vcpu", []) for k in kinds)
            out[name] = total(after) - total(before)
    return out

def per_vcpu_sum(status, key):
    return sum(v.get(key, 0) for v in status.get("per_vcpu", []))

def record(args):
    (out, phase, rnd, calls, cpus, sa, sb, reply), extra = args[:8], args[8:]
    calls, cpus = int(calls), int(cpus)
    extra = dict(e.split("=", 1) for e in extra)
    tag = f"r{rnd}-{phase}"
    a, b = load(sa), load(sb)
    lines = []
    with open(reply, errors="replace") as f:
        for line in f:
            words = line.replace("\r", "").split()
            if words and words[0] == tag:
                lines.append(dict(w.split("=", 1) for w in words[1:] if "=" in w))
    if len(lines) != cpus:
        fail(f"{phase}, round {rnd}: {len(lines)} answers from the loops, expected {cpus} (see {reply})")
    for l in lines:
        if "error" in l:
            fail(f"{phase}, round {rnd}: the loop failed: {l['error']}")
        if int(l.get("calls", -1)) != calls:
            fail(f"{phase}, round {rnd}: the loop made {l.get('calls')} calls, expected {calls}")
    if cpus > 1 and sorted(int(l["cpu"]) for l in lines) != list(range(cpus)):
        fail(f"{phase}, round {rnd}: the loops ran on CPUs {[l['cpu'] for l in lines]}, expected one on each")
    ns = [int(l["ns"]) / calls for l in lines]
    ea, eb = exits_by_name(a), exits_by_name(b)
    exits = b["exits_total"] - a["exits_total"]
    vmcalls = eb.get("VMCALL", 0) - ea.get("VMCALL", 0)
    lost = b["tracer"]["lost"] - a["tracer"]["lost"]
    n = calls * cpus
    if phase in OURS:
        want = OURS[phase] * n
        if vmcalls < want:
            fail(f"{phase}, round {rnd}: {vmcalls} VMCALL exits for {n} calls (at least {want} expected): the tracer did not see the loop")
    else:
        if a["tracer"]["sites"] != 0 or vmcalls > 10:
            fail(f"{phase}, round {rnd}: hvtrace still hooks {a['tracer']['sites']} sites ({vmcalls} VMCALL exits): a previous phase was not undone")
    if phase == "count":
        got = int(extra.get("count_calls", -1))
        if got < n:
            fail(f"count, round {rnd}: the count read {got} calls, at least {n} expected")
    if phase in GUEST_KPROBES:
        got = int(extra.get("guest_hits", -1))
        if got < n:
            fail(f"{phase}, round {rnd}: the guest's kprobe was hit {got} times, at least {n} expected")
    if phase == "guest_function_graph_call" and int(extra.get("guest_lines", 0)) < 1:
        fail(f"{phase}, round {rnd}: the guest's function_graph trace holds no line of the function")
    rec = {
        "phase": phase, "round": int(rnd), "calls": calls, "cpus": cpus,
        "ns_per_call": ns, "exits": exits, "vmcalls": vmcalls, "lost": lost,
        "counters": vcpu_counters(a, b), "flags": extra.get("flags", ""),
    }
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    mean = sum(ns) / len(ns)
    print(f"bench: round {rnd} {phase:<26} {mean:>10.0f} ns/call  {exits / n:6.2f} exits/call"
          + (f"  ({lost} records lost)" if lost else ""), file=sys.stderr)

def report(args):
    (jsonl, out, kernel, guest, cpus, rounds, calls, func, ips, order), notes = args[:10], args[10:]
    ns_per_instr = 1e9 / int(ips)
    recs = [json.loads(l) for l in open(jsonl)]
    by = {}
    for r in recs:
        by.setdefault(r["phase"], {})[r["round"]] = r
    phases = {}
    rows = []
    for phase in order.split(","):
        rs = by.get(phase, {})
        if len(rs) != int(rounds):
            fail(f"{phase}: {len(rs)} rounds measured, {rounds} expected")
        base = baseline_of(phase)
        samples, loop = [], []
        for rnd, r in sorted(rs.items()):
            v = sum(r["ns_per_call"]) / len(r["ns_per_call"]) / ns_per_instr
            loop.append(v)
            if base is None:
                samples.append(v)
            else:
                b = by[base][rnd]
                samples.append(v - sum(b["ns_per_call"]) / len(b["ns_per_call"]) / ns_per_instr)
        n = [r["calls"] * r["cpus"] for _, r in sorted(rs.items())]
        per_hit = lambda key: statistics.median(
            (r[key] if key in r else r["counters"][key]) / k for (_, r), k in zip(sorted(rs.items()), n))
        row = {
            "median": round(statistics.median(samples), 1),
            "min": round(min(samples), 1),
            "max": round(max(samples), 1),
            "exits_per_hit": round(per_hit("exits"), 3),
            "vmcalls_per_hit": round(per_hit("vmcalls"), 3),
        }
        counters = sorted(set().union(*(r["counters"].keys() for r in rs.values())))
        for k in counters:
            if all(k in r["counters"] for r in rs.values()):
                if k.endswith("_ns"):
                    # Root's time, as instructions per call.
                    row[f"{k[:-3]}_instr_per_hit"] = round(per_hit(k) / ns_per_instr, 1)
                else:
                    row[f"{k}_per_hit"] = round(per_hit(k), 3)
        row["baseline"] = base
        row["loop_median"] = round(statistics.median(loop), 1)
        row["samples"] = [round(s, 1) for s in samples]
        if int(cpus) > 1:
            # Each loop's own figure (the loop on CPU i against the baseline's loop on CPU i).
            per_cpu = []
            for i in range(int(cpus)):
                v = []
                for rnd, r in sorted(rs.items()):
                    x = r["ns_per_call"][i] / ns_per_instr
                    if base is not None:
                        x -= by[base][rnd]["ns_per_call"][i] / ns_per_instr
                    v.append(x)
                per_cpu.append(round(statistics.median(v), 1))
            row["per_cpu_median"] = per_cpu
        lost = sum(r["lost"] for r in rs.values())
        if lost:
            row["lost_records"] = lost
            notes.append(f"{phase}: {lost} trace records lost (ring full): its hits cost less than they would have")
        ident = phase
        if phase == "guest_kprobe_int3" and any("OPTIMIZED" in r["flags"] for r in rs.values()):
            ident = "guest_kprobe_optprobe"
            notes.append("the guest's kprobe past the fentry site was optimized (a jump, not an int3) in some rounds")
        phases[ident] = row
        rows.append((ident, phase, row))
    doc = {
        "kernel": kernel, "guest": guest, "cpus": int(cpus), "rounds": int(rounds),
        "calls_per_round": int(calls), "function": func,
        "ns_per_instruction": ns_per_instr, "notes": notes, "phases": phases,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    extra_keys = []
    for _, _, row in rows:
        for k in row:
            if k.endswith("_per_hit") and k not in ("exits_per_hit", "vmcalls_per_hit") and k not in extra_keys:
                extra_keys.append(k)
    cpu_s = "1 vCPU" if int(cpus) == 1 else f"{cpus} vCPUs, one loop on each at once"
    print(f"hit cost: {guest} guest, kernel {kernel}, {cpu_s}; {rounds} interleaved rounds of {calls} calls per phase")
    print(f"guest instructions per call above the phase's baseline loop (baseline rows: the loop's own), "
          f"1 instruction = {ns_per_instr:g} ns; function {func}")
    head = f"  {'phase':<27} {'median':>8} {'min':>8} {'max':>8} {'exits/hit':>10} {'VMCALLs/hit':>12}"
    for k in extra_keys:
        head += f" {k[:-len('_per_hit')] + '/hit':>{max(12, len(k) - 3)}}"
    if int(cpus) > 1:
        head += "  median per CPU"
    print(head)
    for ident, phase, row in rows:
        line = f"  {ident:<27} {row['median']:>8.0f} {row['min']:>8.0f} {row['max']:>8.0f} {row['exits_per_hit']:>10.2f} {row['vmcalls_per_hit']:>12.2f}"
        for k in extra_keys:
            w = max(12, len(k) - 3)
            line += f" {row[k]:>{w}.2f}" if k in row else f" {'-':>{w}}"
        if "per_cpu_median" in row:
            line += "  " + " / ".join(f"{x:.0f}" for x in row["per_cpu_median"])
        print(line)
    for n in notes:
        print("  note: " + n)
    print(f"written to {out}")

def site_offset(args):
    """The function's address and its fentry site's offset."""
    (path,) = args
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        s = json.loads(line)
        if s.get("site"):
            addr = int(s["addr"], 16)
            print(f"{addr:x} {int(s['site'], 16) - addr}")
            return
    fail(f"no fentry site in {path}")

def count_calls(args):
    (path,) = args
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            print(json.loads(line).get("calls", -1))
            return
    print(-1)

{"record": record, "report": report, "site": site_offset, "count-calls": count_calls}[sys.argv[1]](sys.argv[2:])
PY
bench_py() {
    python3 "$work/bench.py" "$@"
}

# --- boot ---
log "booting the $guest guest ($cpus vCPU(s)) under the hypervisor in Bochs"
if ! "$HV" --socket "$sock" run --detach --quiet --emulator bochs --bochs-ips "$IPS" \
    --guest "$guest" --cpus "$cpus" --timeout 86400 --hypervisor "$image" \
    </dev/null >"$work/run.out" 2>"$work/run.err"; then
    cat "$work/run.err" >&2
    die "hvtrace run --detach failed"
fi
supervisor=$(sed -n 's/.*supervisor pid \([0-9]*\).*/\1/p' "$work/run.err" | head -n1)
[[ -n $supervisor ]] || log "warning: run --detach did not say the supervisor's pid"
grep -m1 'VM ready' "$work/run.err" >&2 || true

# --- the guest side ---
# shellcheck disable=SC2016 # expanded by the guest's shell
tracefs=$(gexec 'echo "${HVTRACE_TRACEFS:-/sys/kernel/tracing}"' | tail -n1)
kernel=$(gexec 'uname -r' | tail -n1)
gexec "[ -e $tracefs/kprobe_events ] && [ -e $tracefs/set_graph_function ]" >/dev/null ||
    die "the guest's tracefs ($tracefs) has no kprobe_events or set_graph_function"
# The function ftrace lists for the getppid system call's body (6.12 lists
# __do_sys_getppid, which the wrapper __x64_sys_getppid aliases; 6.1 lists
# the wrapper): the guest's function_graph takes that name only.
func=$(gexec "grep -m1 -E '^(__do_sys|__x64_sys)_getppid\$' $tracefs/available_filter_functions" | tail -n1)
[[ -n $func ]] || die "the guest lists no getppid function in available_filter_functions"
hv syms "$func" --json >"$work/syms.json" || die "hvtrace syms $func failed"
read -r func_addr site_off < <(bench_py site "$work/syms.json") || die "no fentry site for $func"
[[ -n $site_off ]] || die "no fentry site for $func"
# The guest's int3 kprobe goes past the fentry call, as the kprobes VM
# test puts it.
int3_off=$((site_off + 5))
int3_at=$(printf '%s+0x%x' "$func" "$int3_off")
log "kernel $kernel; function $func (fentry site at +$site_off; the guest's int3 kprobe at $int3_at)"

# Kprobes past a function's first instruction may be optimized into a
# jump (optprobes); the int3 row measures an int3, so optimization is off.
optimization=$(gexec 'cat /proc/sys/debug/kprobes-optimization 2>/dev/null || echo none' | tail -n1)
notes=("the trace stream was on in every phase (root sends each record to the host while the guest waits)")
if [[ $optimization != none ]]; then
    gexec 'echo 0 > /proc/sys/debug/kprobes-optimization' >/dev/null
    notes+=("guest kprobe optimization turned off (debug.kprobes-optimization was $optimization, now 0)")
    log "${notes[-1]}"
fi
gexec '[ -r /sys/kernel/debug/kprobes/list ]' >/dev/null ||
    die "the guest has no /sys/kernel/debug/kprobes/list: the placement of its kprobes cannot be checked"

# The loops: one hvbench process per vCPU, pinned to it.
have_taskset=$(gexec 'command -v taskset >/dev/null && echo yes || echo no' | tail -n1)
start_loops="mkdir -p /tmp/hvbench && cd /tmp/hvbench && rm -f in* out* err*"
for ((i = 0; i < cpus; i++)); do
    pin=""
    arg=""
    if ((cpus > 1)); then
        if [[ $have_taskset == yes ]]; then pin="taskset $((1 << i)) "; else arg=" $i"; fi
    fi
    start_loops+=" && mkfifo in$i out$i && { ${pin}hvbench rounds $calls /tmp/hvbench/in$i$arg 1<>/tmp/hvbench/out$i 2>/tmp/hvbench/err$i </dev/null & }"
done
gexec "$start_loops" >/dev/null
# /tmp/hvbench/go OP TAG [PATH]: hands the line to every loop, then prints
# their answers (each loop waits a moment before its timed loop, so this
# shell is asleep in `read` by then).
go_lines=(
    'i=0'
    "while [ \$i -lt $cpus ]; do echo \"\$*\" > /tmp/hvbench/in\$i || exit 1; i=\$((i+1)); done"
    'i=0'
    "while [ \$i -lt $cpus ]; do read -r l < /tmp/hvbench/out\$i || exit 1; echo \"\$l\"; i=\$((i+1)); done"
)
go_cmd="printf '%s\\n'"
for l in "${go_lines[@]}"; do go_cmd+=" '$l'"; done
gexec "$go_cmd > /tmp/hvbench/go" >/dev/null
gexec "timeout 60 sh /tmp/hvbench/go ping hello" >"$work/hello.out"
[[ $(grep -c '^hello op=ping' "$work/hello.out") == "$cpus" ]] || {
    cat "$work/hello.out" >&2
    gexec 'cat /tmp/hvbench/err*' >&2 || true
    die "the guest's hvbench loops did not answer"
}

# Start the trace stream (and make sure no function is traced): every
# phase runs with it on.
hv trace --clear-functions >/dev/null 2>"$work/trace.err" || {
    cat "$work/trace.err" >&2
    die "hvtrace trace failed"
}

# --- the phases ---
probe_string_spec='filename=+0(%si):string'
trigger() { # OP TAG: the guest command that runs one round
    if [[ $1 == openat ]]; then
        printf 'timeout %s sh /tmp/hvbench/go openat %s %s' "$ROUND_GUEST_TIMEOUT" "$2" "$OPEN_PATH"
    else
        printf 'timeout %s sh /tmp/hvbench/go getppid %s' "$ROUND_GUEST_TIMEOUT" "$2"
    fi
}

# The guest's kprobe event NAME's hits (kprobe_profile).
guest_hits() {
    gexec "grep -w '$1' $tracefs/kprobe_profile" | awk -v n="$1" '$1 == n { print $2 }' | tail -n1
}

# The flags (`[FTRACE]`, `[OPTIMIZED]`...) /sys/kernel/debug/kprobes/list
# shows for the probe at OFFSET past the function (found by its address,
# or by the name the list gives it).
kprobe_flags() {
    local addr l
    addr=$(printf '%x' $((0x$func_addr + $1)))
    l=$(gexec "grep -i -e '^0*$addr ' -e ' $func+0x$(printf %x "$1") ' /sys/kernel/debug/kprobes/list || true" | head -n1)
    [[ -n $l ]] || die "the guest's kprobes/list shows no probe at $func+$1 ($addr)"
    l=${l##*+0x}
    l=${l#* }
    echo "${l//[[:space:]]/}"
}

guest_kprobe_on() { # NAME PLACE [FETCH]
    gexec "echo 'p:$1 $2${3:+ $3}' >> $tracefs/kprobe_events && echo 1 > $tracefs/events/kprobes/$1/enable" >/dev/null
}
guest_kprobe_off() { # NAME
    gexec "echo 0 > $tracefs/events/kprobes/$1/enable; echo '-:$1' >> $tracefs/kprobe_events" >/dev/null
}

# bg_start FILE TEXT ARGS...: runs `hvtrace ARGS...` in the background
# (stdout to FILE.out, stderr to FILE.err) and waits until its stderr says
# TEXT (the session or the count has started).
bg_start() {
    local file=$1 text=$2
    shift 2
    "$HV" --socket "$sock" "$@" >"$file.out" 2>"$file.err" </dev/null &
    bg_pid=$!
    for _ in $(seq 600); do
        grep -qs "$text" "$file.err" && return 0
        kill -0 "$bg_pid" 2>/dev/null || break
        sleep 0.2
    done
    die "hvtrace $1 did not start: $(cat "$file.err")"
}

# bg_stop: ends the background command as Ctrl-C does (it stops what it
# started and prints its result) and waits for it.
bg_stop() {
    local rc=0
    kill -INT "$bg_pid" 2>/dev/null || true
    timeout 120 tail --pid="$bg_pid" -f /dev/null || rc=$?
    ((rc == 0)) || die "hvtrace did not end after Ctrl-C (pid $bg_pid)"
    rc=0
    wait "$bg_pid" || rc=$?
    bg_pid=
    return "$rc"
}

run_round() { # PHASE ROUND
    local phase=$1 r=$2 tag="r$2-$1" op extra=() rc
    local sa="$work/$tag.a.json" sb="$work/$tag.b.json" reply="$work/$tag.reply"
    op=$(op_of "$phase")
    local cmd
    cmd=$(trigger "$op" "$tag")
    case $phase in
    probe) hv probe add "p:hvb_probe $func" >/dev/null || die "probe add failed" ;;
    probe_string) hv probe add "p:hvb_string do_sys_openat2 $probe_string_spec" >/dev/null || die "probe add failed" ;;
    function) hv trace --function "$func" >/dev/null 2>"$work/trace.err" || die "trace --function failed: $(cat "$work/trace.err")" ;;
    count) bg_start "$work/$tag.count" 'counting ' count "$func" --json ;;
    graph_call)
        bg_start "$work/$tag.graph" 'function graph session' \
            graph --function "$func" --trace "$func" --follow
        ;;
    guest_function_graph_call)
        gexec "cd $tracefs && echo $func > set_ftrace_filter && echo $func > set_graph_function && echo function_graph > current_tracer" >/dev/null
        ;;
    guest_kprobe_ftrace) guest_kprobe_on hvb_ftrace "$func" ;;
    guest_kprobe_int3) guest_kprobe_on hvb_int3 "$int3_at" ;;
    guest_kprobe_string) guest_kprobe_on hvb_string do_sys_openat2 "$probe_string_spec" ;;
    esac

    status_json "$sa"
    rc=0
    timeout -k 10 "$ROUND_HOST_TIMEOUT" "$HV" --socket "$sock" exec "$cmd" >"$reply" 2>&1 || rc=$?
    ((rc == 0)) || die "$phase round $r failed ($rc): $(cat "$reply")"
    status_json "$sb"

    case $phase in
    probe) hv probe del hvb_probe >/dev/null || die "probe del failed" ;;
    probe_string) hv probe del hvb_string >/dev/null || die "probe del failed" ;;
    function) hv trace --clear-functions >/dev/null 2>"$work/trace.err" || die "trace --clear-functions failed" ;;
    count)
        bg_stop || die "hvtrace count failed: $(cat "$work/$tag.count.err")"
        extra+=("count_calls=$(bench_py count-calls "$work/$tag.count.out")")
        ;;
    graph_call)
        # Ctrl-C: exit code 130 once the session is stopped.
        bg_stop || true
        grep -q 'stopped by Ctrl-C' "$work/$tag.graph.err" ||
            die "hvtrace graph did not stop its session: $(cat "$work/$tag.graph.err")"
        ;;
    guest_function_graph_call)
        extra+=("guest_lines=$(gexec "grep -m1 -c '$func' $tracefs/trace || true" | tail -n1)")
        gexec "cd $tracefs && echo nop > current_tracer && echo > set_graph_function && echo > set_ftrace_filter" >/dev/null
        ;;
    guest_kprobe_ftrace | guest_kprobe_int3 | guest_kprobe_string)
        local name place
        case $phase in
        guest_kprobe_ftrace) name=hvb_ftrace place=$site_off ;;
        guest_kprobe_int3) name=hvb_int3 place=$int3_off ;;
        *) name=hvb_string place="" ;;
        esac
        extra+=("guest_hits=$(guest_hits "$name")")
        if [[ -n $place ]]; then
            local flags
            flags=$(kprobe_flags "$place")
            extra+=("flags=$flags")
            if [[ $phase == guest_kprobe_ftrace && $flags != *FTRACE* ]]; then
                die "the guest's kprobe on $func is not on ftrace (kprobes/list: '$flags')"
            fi
            if [[ $phase == guest_kprobe_int3 && $flags == *FTRACE* ]]; then
                die "the guest's kprobe at $int3_at is on ftrace, not an int3 (kprobes/list: '$flags')"
            fi
        fi
        guest_kprobe_off "$name"
        ;;
    esac
    bench_py record "$work/rounds.jsonl" "$phase" "$r" "$calls" "$cpus" "$sa" "$sb" "$reply" "${extra[@]}"
}

log "${#phases[@]} phases x $rounds rounds of $calls calls: ${phases[*]}"
for ((r = 1; r <= rounds; r++)); do
    # The order rotates from round to round.
    for ((k = 0; k < ${#phases[@]}; k++)); do
        run_round "${phases[$(((k + r - 1) % ${#phases[@]}))]}" "$r"
    done
done

mkdir -p "$(dirname "$output")"
order=$(IFS=,; echo "${phases[*]}")
bench_py report "$work/rounds.jsonl" "$output" "$kernel" "$guest" "$cpus" "$rounds" "$calls" "$func" "$IPS" "$order" "${notes[@]}"
finished=1
log "done in $(($(date +%s) - start_s)) s"
