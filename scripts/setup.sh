#!/usr/bin/env bash
# Install what building and testing hvtrace needs on a Debian bookworm host:
# the emulators (Bochs, QEMU), the ISO/GRUB tools, busybox for the guest
# initramfs, the kernel build dependencies, and the Rust bare-metal target.
#
# Idempotent: when every package is already installed nothing is touched, and
# `apt-get update` runs at most once, only when a package cannot be installed
# from the current lists. Works as root without a tty (CI); as another user it
# goes through `sudo -n`. Prints the repository root on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/guest/lib.sh"

PACKAGES=(
    bochs bochsbios vgabios
    grub-pc-bin grub-common xorriso mtools
    busybox-static cpio
    qemu-system-x86 socat
    xz-utils zstd lz4
    bc flex bison libelf-dev libssl-dev dwarves rsync kmod build-essential
    python3 file
    trace-cmd python3-jsonschema
)

command -v dpkg-query >/dev/null 2>&1 || die "this script expects a Debian-based host (dpkg-query not found)"

log "checking ${#PACKAGES[@]} Debian packages"
hv_apt_ensure "${PACKAGES[@]}"
log "Debian packages: all installed"

command -v rustup >/dev/null 2>&1 || die "rustup not found; install Rust through rustup first"
(
    cd "$HVTRACE_REPO"
    # Inside the repo rust-toolchain.toml selects the toolchain; the first
    # cargo call installs it (with its targets) when it is missing.
    log "rust toolchain: $(cargo --version </dev/null 2>&1 | tail -n1)"
    # Explicit as well, for toolchains installed before the target was listed.
    log "rustup target add x86_64-unknown-none"
    rustup target add x86_64-unknown-none </dev/null >&2
)

log "setup complete"
printf '%s\n' "$HVTRACE_REPO"
