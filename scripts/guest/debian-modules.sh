#!/usr/bin/env bash
# Build an initramfs for the Debian guest that carries some of the stock
# kernel package's own modules: ext4 on a loop device, with what they
# depend on, under /lib/modules/<release>/ with a modules.dep made by
# depmod, so that busybox `modprobe ext4` and `mount -o loop` work in the
# guest. The modules come unmodified from the same linux-image .deb the
# Debian guest kernel comes from (scripts/guest/debian-kernel.sh).
#
# The module tree is cached as $CACHE/debian-modules-<hash>/, keyed by the
# package version and the module list; the initramfs is
# scripts/guest/initramfs.sh's, with the tree added. Prints the initramfs
# path on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# ext4 and its dependencies, the crc32c drivers it asks for, and loop.
MODULES=(
    kernel/fs/ext4/ext4.ko
    kernel/fs/jbd2/jbd2.ko
    kernel/fs/mbcache.ko
    kernel/lib/crc16.ko
    kernel/lib/libcrc32c.ko
    kernel/crypto/crc32c_generic.ko
    kernel/drivers/block/loop.ko
)

hv_apt_ensure kmod
kdir=$(dirname "$("$HVTRACE_REPO/scripts/guest/debian-kernel.sh")")
CACHE=$(hv_cache_dir)
read -r pkg pkg_version <"$kdir/package"
release=$(cat "$kdir/release")
deb=$CACHE/downloads/${pkg}_$(hv_sanitize_version "$pkg_version")_amd64.deb
[[ -f $deb ]] || die "the kernel package $deb is not in the cache"

hash=$(hv_hash -- "package $pkg $pkg_version" "modules ${MODULES[*]}" "layout 1")
tree=$CACHE/debian-modules-$hash
if [[ ! -f $tree/done ]]; then
    log "taking ${#MODULES[@]} modules out of $pkg $pkg_version"
    work=$(mktemp -d "$CACHE/.debian-modules.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    moddir=lib/modules/$release
    members=()
    for m in "${MODULES[@]}" modules.order modules.builtin modules.builtin.modinfo; do
        members+=("./$moddir/$m")
    done
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work" "${members[@]}" ||
        die "$deb lacks one of: ${MODULES[*]}"
    depmod -b "$work" "$release" || die "depmod failed"
    grep -q '^kernel/fs/ext4/ext4.ko:' "$work/$moddir/modules.dep" ||
        die "depmod made no entry for ext4"
    touch "$work/done"
    rm -rf "$tree"
    mv -T "$work" "$tree"
    trap - EXIT
    log "module tree: $tree"
fi
HVTRACE_INITRAMFS_TREE=$tree exec "$HVTRACE_REPO/scripts/guest/initramfs.sh"
