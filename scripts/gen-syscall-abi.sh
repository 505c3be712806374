#!/usr/bin/env bash
# Regenerates guest-introspect/src/syscall_abi/x86_64.rs and i386.rs from a
# kernel source tree's arch/x86/entry/syscalls/syscall_{64,32}.tbl and
# include/linux/syscalls.h (the generator is
# guest-introspect/examples/gen_syscall_abi.rs).
#
# Usage: scripts/gen-syscall-abi.sh [KERNEL_SOURCE]
# Without an argument: the linux-source-6.12 that scripts/guest/fast-kernel.sh
# unpacks into the cache (the first $CACHE/src/linux-source-6.12-*), the one
# the real-kernel tests compare the committed tables with.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/guest/lib.sh"
cd "$HVTRACE_REPO"
export PATH="$HOME/.cargo/bin:$PATH"

if (($# > 1)); then
    die "usage: $0 [KERNEL_SOURCE]"
elif (($# == 1)); then
    src=$1
else
    cache=$(hv_cache_dir)
    shopt -s nullglob
    dirs=("$cache"/src/linux-source-6.12-*)
    shopt -u nullglob
    ((${#dirs[@]})) ||
        die "no kernel source at $cache/src/linux-source-6.12-*: run scripts/guest/fast-kernel.sh, which unpacks it"
    src=${dirs[0]}
fi
for f in Makefile include/linux/syscalls.h arch/x86/entry/syscalls/syscall_64.tbl \
    arch/x86/entry/syscalls/syscall_32.tbl; do
    [[ -f $src/$f ]] || die "$src is not a kernel source tree (no $f)"
done

log "generating the syscall ABI tables from $src"
cargo run --quiet -p guest-introspect --example gen_syscall_abi -- "$src"
rustfmt --edition 2021 --check guest-introspect/src/syscall_abi/x86_64.rs \
    guest-introspect/src/syscall_abi/i386.rs ||
    die "the generated tables are not rustfmt-clean"
