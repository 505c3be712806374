#!/usr/bin/env bash
# Build the hostile test module guest/attacker/hvattack.c against the
# fast-lane kernel, and an initramfs for the fast lane that carries it:
# the base initramfs (scripts/guest/initramfs.sh) followed by a second cpio
# archive holding /lib/hvattack.ko (the kernel unpacks concatenated
# archives in order).
#
# Output: $CACHE/initramfs-attacker-<hash>.cpio.gz, keyed by the module
# source, the fast kernel's release and config, and the base initramfs.
# Prints the archive path on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MOD_DIR=$HVTRACE_REPO/guest/attacker
[[ -f $MOD_DIR/hvattack.c && -f $MOD_DIR/Kbuild ]] || die "missing $MOD_DIR/hvattack.c or Kbuild"

kernel=$("$HVTRACE_REPO/scripts/guest/fast-kernel.sh")
kdir=$(dirname "$kernel")
base=$("$HVTRACE_REPO/scripts/guest/initramfs.sh")
CACHE=$(hv_cache_dir)
release=$(cat "$kdir/release")
hash=$(hv_hash "$MOD_DIR/hvattack.c" "$MOD_DIR/Kbuild" "$kdir/.config" -- "release $release" "base $(basename "$base")")
out=$CACHE/initramfs-attacker-$hash.cpio.gz
if [[ -f $out ]]; then
    log "cached: $out"
    printf '%s\n' "$out"
    exit 0
fi

# The fast-lane build tree the kernel came from (kept by fast-kernel.sh).
build=$(ls -d "$CACHE"/build/fast-6.12-*/ 2>/dev/null | head -n 1)
build=${build%/}
[[ -n $build && -f $build/.config ]] || die "no fast-lane build tree in $CACHE/build"
cmp -s "$build/.config" "$kdir/.config" ||
    die "the build tree $build was configured for another fast-lane config; rebuild with scripts/guest/fast-kernel.sh after removing $kdir"
src=$(sed -n 's/^MAKEARGS := -C \(.*\) -f .*/\1/p' "$build/Makefile" | head -n 1)
[[ -n $src ]] || src=$(ls -d "$CACHE"/src/linux-source-6.12-*/ | head -n 1)
[[ -f ${src%/}/Makefile ]] || die "kernel source for $build not found"

# The build tree is shared with fast-kernel.sh: take its lock.
exec 9>"$CACHE/.fast-kernel.lock"
flock 9
if [[ ! -f $build/scripts/module.lds ]]; then
    log "preparing $build for external modules"
    make -C "${src%/}" O="$build" ARCH=x86_64 modules_prepare >"$CACHE/build/modules_prepare.log" 2>&1 ||
        die "make modules_prepare failed (log: $CACHE/build/modules_prepare.log)"
fi

work=$(mktemp -d "$CACHE/.attacker.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp "$MOD_DIR/hvattack.c" "$MOD_DIR/Kbuild" "$work/"
log "building hvattack.ko against $release"
# The tree has no Module.symvers (only bzImage was built) and the kernel
# has no module versioning, so unresolved-symbol warnings are expected.
if ! make -C "${src%/}" O="$build" ARCH=x86_64 M="$work" KBUILD_MODPOST_WARN=1 modules \
    >"$work/build.log" 2>&1; then
    tail -n 30 "$work/build.log" >&2
    die "building hvattack.ko failed"
fi
[[ -f $work/hvattack.ko ]] || die "hvattack.ko not produced"

python3 - "$work/hvattack.ko" "$work/extra.cpio.gz" <<'PY'
import gzip, sys

ko, out = sys.argv[1:3]
entries = [("lib", 0o040755, b""), ("lib/hvattack.ko", 0o100644, open(ko, "rb").read())]

def pad4(n):
    return (4 - n % 4) % 4

blob = bytearray()
for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], 1):
    nlink = 2 if mode & 0o170000 == 0o040000 else 1
    if name == "TRAILER!!!":
        ino = nlink = 0
    fields = [ino + 1000, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
    hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
    blob += hdr + name.encode() + b"\0"
    blob += b"\0" * pad4(len(hdr) + len(name) + 1)
    blob += data + b"\0" * pad4(len(data))
blob += b"\0" * pad4(len(blob))
with open(out, "wb") as fh:
    fh.write(gzip.compress(bytes(blob), compresslevel=9, mtime=0))
PY
cat "$base" "$work/extra.cpio.gz" >"$work/combined.cpio.gz"
mv -f "$work/combined.cpio.gz" "$out"
log "ready: $out"
printf '%s\n' "$out"
