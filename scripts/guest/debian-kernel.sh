#!/usr/bin/env bash
# Fetch Debian's current stock kernel, unmodified, for use as an hvtrace guest.
#
# The linux-image-amd64 meta package is resolved to the kernel package it
# currently depends on (linux-image-6.1.0-NN-amd64 on bookworm; NN follows the
# security updates, so it is never pinned here). That .deb is downloaded into
# the cache (not installed) and its boot/vmlinuz-* is taken out.
#
# Output directory: $CACHE/debian-<package version>/
#   bzImage   the stock vmlinuz, byte for byte
#   vmlinux   the ELF inside it (stripped, no symbols; see extract-vmlinux.sh)
#   config    the kernel's build configuration (boot/config-*)
#   release   the kernel release string, as `uname -r` prints it in the guest
#   package   "<package name> <package version>"
#   format    version of this layout (internal)
# Prints the bzImage path on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

META=linux-image-amd64
# Bump when the contents of the output directory change, to redo cached ones.
FORMAT=2
CACHE=$(hv_cache_dir)

meta_version=$(hv_apt_candidate "$META")
if [[ -z $meta_version ]]; then
    hv_apt_update
    meta_version=$(hv_apt_candidate "$META")
fi
[[ -n $meta_version ]] || die "apt knows no candidate for $META"

pkg=$(apt-cache show "$META=$meta_version" |
    awk '/^Depends:/ { sub(/^Depends:/, ""); n = split($0, d, ","); for (i = 1; i <= n; i++) print d[i]; exit }' |
    awk '{ print $1 }' | grep -E '^linux-image-[0-9].*-amd64$' | head -n1 || true)
[[ -n $pkg ]] || die "cannot find the kernel package that $META $meta_version depends on"
pkg_version=$(hv_apt_candidate "$pkg")
[[ -n $pkg_version ]] || die "apt knows no candidate for $pkg"
release=${pkg#linux-image-}
log "current Debian kernel: $pkg $pkg_version (via $META $meta_version)"

out=$CACHE/debian-$(hv_sanitize_version "$pkg_version")
if [[ -f $out/bzImage && -f $out/vmlinux && -f $out/release &&
    "$(cat "$out/format" 2>/dev/null)" == "$FORMAT" ]]; then
    log "cached: $out"
    printf '%s\n' "$out/bzImage"
    exit 0
fi

work=$(mktemp -d "$CACHE/.debian-kernel.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Keep the .deb so that a rebuild of the output needs no second download.
debs=$CACHE/downloads
mkdir -p "$debs"
deb=$(find "$debs" -maxdepth 1 -name "${pkg}_$(hv_sanitize_version "$pkg_version")_amd64.deb" -print -quit)
if [[ -z $deb ]]; then
    log "downloading $pkg=$pkg_version (about 70 MB)"
    dl=(apt-get download -q "$pkg=$pkg_version")
    # As root, apt would warn that its _apt user cannot write a private temp dir.
    if [[ $(id -u) -eq 0 ]]; then
        dl=(apt-get -o APT::Sandbox::User=root download -q "$pkg=$pkg_version")
    fi
    (cd "$work" && "${dl[@]}" </dev/null >&2)
    got=$(find "$work" -maxdepth 1 -name '*.deb' -print -quit)
    [[ -n $got ]] || die "apt-get download produced no .deb"
    # Re-name from the real version so an epoch's ':' (%3a) never lands in a path.
    deb=$debs/${pkg}_$(hv_sanitize_version "$pkg_version")_amd64.deb
    mv -f "$got" "$deb"
else
    log "using downloaded $deb"
fi

log "extracting boot/vmlinuz-$release"
stage=$work/out
mkdir -p "$stage" "$work/x"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/x" --wildcards './boot/vmlinuz-*' './boot/config-*'
[[ -f $work/x/boot/vmlinuz-$release ]] || die "$deb has no boot/vmlinuz-$release"
cp "$work/x/boot/vmlinuz-$release" "$stage/bzImage"
cp "$work/x/boot/config-$release" "$stage/config"
printf '%s\n' "$release" >"$stage/release"
printf '%s %s\n' "$pkg" "$pkg_version" >"$stage/package"
printf '%s\n' "$FORMAT" >"$stage/format"
"$(dirname "${BASH_SOURCE[0]}")/extract-vmlinux.sh" "$stage/bzImage" "$stage/vmlinux" >/dev/null

rm -rf "$out"
mv -T "$stage" "$out"
log "ready: $out (release $release)"
printf '%s\n' "$out/bzImage"
