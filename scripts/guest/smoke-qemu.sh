#!/usr/bin/env bash
# Boot a guest kernel with the hvtrace initramfs bare in QEMU (TCG, no
# hypervisor involved) and check the guest contract: the ready line appears,
# the shell answers `uname -r` with the expected release, commands are not
# echoed, tracefs is mounted, and `exit` powers the machine off.
#
#   scripts/guest/smoke-qemu.sh BZIMAGE [INITRAMFS] [RELEASE]
#
# INITRAMFS defaults to the output of initramfs.sh; RELEASE defaults to the
# `release` file next to BZIMAGE. Prints the path of the console transcript.
# Environment: HVTRACE_SMOKE_TIMEOUT (seconds, default 180).
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(($# >= 1 && $# <= 3)) || die "usage: $0 BZIMAGE [INITRAMFS] [RELEASE]"
bz=$1
cpio=${2:-$("$(dirname "${BASH_SOURCE[0]}")/initramfs.sh")}
release=${3:-$(cat "$(dirname "$bz")/release")}
[[ -f $bz && -f $cpio ]] || die "missing kernel or initramfs"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (scripts/setup.sh)"

CACHE=$(hv_cache_dir)
mkdir -p "$CACHE/smoke"
transcript=$CACHE/smoke/$(basename "$(dirname "$bz")").log

log "booting $bz in QEMU TCG (expect release $release)"
python3 - "$bz" "$cpio" "$release" "$transcript" "${HVTRACE_SMOKE_TIMEOUT:-180}" <<'PY'
import os, selectors, subprocess, sys, time

bz, cpio, release, transcript, timeout = sys.argv[1:6]
deadline = time.monotonic() + float(timeout)
cmd = ["qemu-system-x86_64", "-accel", "tcg", "-m", "512", "-smp", "1",
       "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
       "-kernel", bz, "-initrd", cpio, "-append", "console=ttyS0 panic=-1"]
qemu = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
sel = selectors.DefaultSelector()
sel.register(qemu.stdout, selectors.EVENT_READ)
buf = b""
t0 = time.monotonic()

def log(msg):
    print(f"[hvtrace-setup] {msg}", file=sys.stderr, flush=True)

def fail(msg):
    log(f"SMOKE FAILED: {msg}; last console output:")
    for line in buf.decode(errors="replace").splitlines()[-25:]:
        print("    " + line, file=sys.stderr)
    qemu.kill()
    sys.exit(1)

def wait_for(needle, start=0):
    global buf
    while True:
        i = buf.find(needle, start)
        if i >= 0:
            return i + len(needle)
        if time.monotonic() > deadline:
            fail(f"timeout waiting for {needle!r}")
        if sel.select(timeout=0.5):
            chunk = os.read(qemu.stdout.fileno(), 65536)
            if not chunk:
                fail(f"QEMU exited (rc {qemu.wait()}) before {needle!r}")
            buf += chunk

def send(text):
    qemu.stdin.write(text.encode())
    qemu.stdin.flush()

try:
    ready = wait_for(b"HVTRACE-GUEST-READY")
    log(f"ready line after {time.monotonic() - t0:.1f} s")
    pos = wait_for(b"# ", ready)
    send("uname -r\n")
    pos = wait_for(b"\n# ", pos)
    reply = buf[ready:pos].decode(errors="replace")
    # No echo: the answer follows the prompt on the same line ("# 6.1.0-...").
    lines = [l.removeprefix("# ").strip() for l in reply.replace("\r", "").split("\n")]
    if release not in lines:
        fail(f"uname -r did not answer {release!r}")
    if "uname -r" in reply:
        fail("the command was echoed back")
    send("hostname; echo tracefs=$HVTRACE_TRACEFS; "
         "head -c 200 $HVTRACE_TRACEFS/available_tracers; echo; echo SMOKE-END\n")
    end = wait_for(b"SMOKE-END\r\n", pos)
    out = buf[pos:end].decode(errors="replace")
    if "hvtrace-guest" not in out:
        fail("hostname is not hvtrace-guest")
    if "tracefs=/sys/kernel/tracing" not in out:
        fail("tracefs is not mounted at /sys/kernel/tracing")
    tracers = [l for l in out.replace("\r", "").split("\n") if "nop" in l]
    log(f"uname -r = {release}; tracers: {tracers[0].strip() if tracers else '?'}")
    wait_for(b"# ", end)
    send("exit\n")
    try:
        rc = qemu.wait(timeout=max(5.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        fail("guest did not power off after the shell exited")
    buf += qemu.stdout.read()
    log(f"powered off (QEMU rc {rc}) after {time.monotonic() - t0:.1f} s")
finally:
    with open(transcript, "wb") as fh:
        fh.write(buf)
    if qemu.poll() is None:
        qemu.kill()
PY
log "smoke test passed; transcript: $transcript"
printf '%s\n' "$transcript"
