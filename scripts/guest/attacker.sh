#!/usr/bin/env bash
# Build the hostile test module guest/attacker/hvattack.c against the
# fast-lane kernel, and an initramfs for the fast lane that carries it as
# /lib/hvattack.ko (scripts/guest/initramfs.sh with the module added).
#
# The module is cached as $CACHE/hvattack-<hash>.ko, keyed by its source and
# the fast kernel's release and config. Prints the initramfs path on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MOD_DIR=$HVTRACE_REPO/guest/attacker
[[ -f $MOD_DIR/hvattack.c && -f $MOD_DIR/Kbuild ]] || die "missing $MOD_DIR/hvattack.c or Kbuild"

kernel=$("$HVTRACE_REPO/scripts/guest/fast-kernel.sh")
kdir=$(dirname "$kernel")
CACHE=$(hv_cache_dir)
release=$(cat "$kdir/release")
hash=$(hv_hash "$MOD_DIR/hvattack.c" "$MOD_DIR/Kbuild" "$kdir/.config" -- "release $release")
ko=$CACHE/hvattack-$hash/hvattack.ko
if [[ -f $ko ]]; then
    log "cached: $ko"
    HVTRACE_INITRAMFS_MODULE=$ko exec "$HVTRACE_REPO/scripts/guest/initramfs.sh"
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

mkdir -p "$(dirname "$ko")"
cp "$work/hvattack.ko" "$ko.tmp"
mv -f "$ko.tmp" "$ko"
log "built: $ko"
rm -rf "$work"
trap - EXIT
HVTRACE_INITRAMFS_MODULE=$ko exec "$HVTRACE_REPO/scripts/guest/initramfs.sh"
