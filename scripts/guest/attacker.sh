#!/usr/bin/env bash
# Build the test modules of guest/attacker against the fast-lane kernel:
# the hostile hvattack.c and the tracing target hvtarget.c. Then build an
# initramfs for the fast lane that carries them as /lib/hvattack.ko and
# /lib/hvtarget.ko, and the kernel's own modules (its fragment's =m
# options) as /lib/modules/RELEASE with modules.dep, for busybox modprobe
# (scripts/guest/initramfs.sh with the modules added).
#
# The modules are cached in $CACHE/hvattack-<hash>/, keyed by their sources
# and the fast kernel's release and config. Prints the initramfs path on
# stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MOD_DIR=$HVTRACE_REPO/guest/attacker
MODULES=(hvattack hvtarget)
for m in "${MODULES[@]}"; do
    [[ -f $MOD_DIR/$m.c ]] || die "missing $MOD_DIR/$m.c"
done
[[ -f $MOD_DIR/Kbuild ]] || die "missing $MOD_DIR/Kbuild"

kernel=$("$HVTRACE_REPO/scripts/guest/fast-kernel.sh")
kdir=$(dirname "$kernel")
CACHE=$(hv_cache_dir)
release=$(cat "$kdir/release")
sources=()
for m in "${MODULES[@]}"; do
    sources+=("$MOD_DIR/$m.c")
done
hash=$(hv_hash "${sources[@]}" "$MOD_DIR/Kbuild" "$kdir/.config" -- "release $release" "modules ${MODULES[*]}")
out=$CACHE/hvattack-$hash
kos=$(printf "$out/%s.ko:" "${MODULES[@]}")
kos=${kos%:}
if [[ -f $out/done ]]; then
    log "cached: $out"
    HVTRACE_INITRAMFS_MODULES=$kos HVTRACE_INITRAMFS_TREE=$kdir/modules \
        exec "$HVTRACE_REPO/scripts/guest/initramfs.sh"
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
for m in "${MODULES[@]}"; do
    cp "$MOD_DIR/$m.c" "$work/"
done
cp "$MOD_DIR/Kbuild" "$work/"
log "building ${MODULES[*]} against $release"
# The tree has no Module.symvers (only bzImage was built) and the kernel
# has no module versioning, so unresolved-symbol warnings are expected.
if ! make -C "${src%/}" O="$build" ARCH=x86_64 M="$work" KBUILD_MODPOST_WARN=1 modules \
    >"$work/build.log" 2>&1; then
    tail -n 30 "$work/build.log" >&2
    die "building the test modules failed"
fi
mkdir -p "$out"
for m in "${MODULES[@]}"; do
    [[ -f $work/$m.ko ]] || die "$m.ko not produced"
    cp "$work/$m.ko" "$out/$m.ko.tmp"
    mv -f "$out/$m.ko.tmp" "$out/$m.ko"
done
touch "$out/done"
log "built: $out"
rm -rf "$work"
trap - EXIT
HVTRACE_INITRAMFS_MODULES=$kos HVTRACE_INITRAMFS_TREE=$kdir/modules \
    exec "$HVTRACE_REPO/scripts/guest/initramfs.sh"
