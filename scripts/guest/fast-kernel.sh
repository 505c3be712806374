#!/usr/bin/env bash
# Build the hvtrace fast-lane guest kernel: Debian's linux-source-6.12,
# `make tinyconfig` plus the fragment guest/fast-lane.config.
#
# Output directory: $CACHE/fast-6.12-<source package version>-<config hash>/
#   bzImage     arch/x86/boot/bzImage
#   vmlinux     the build tree's vmlinux, with the full symbol table
#   System.map  the build's System.map
#   .config     the final configuration (also reachable as `config`)
#   release     `make kernelrelease`, what `uname -r` prints in the guest
# Prints the bzImage path on stdout.
#
# The output is rebuilt only when the source package version or the fragment
# changes. The unpacked source ($CACHE/src/) and the build tree ($CACHE/build/)
# are kept, so a changed fragment rebuilds incrementally. Environment:
#   HVTRACE_JOBS            parallel make jobs (default: nproc)
#   HVTRACE_FAST_FRAGMENT   another fragment instead of guest/fast-lane.config
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SRC_PKG=linux-source-6.12
FRAGMENT=${HVTRACE_FAST_FRAGMENT:-$HVTRACE_REPO/guest/fast-lane.config}
# Bump when the way the kernel is built changes, to invalidate cached outputs.
RECIPE=2
# Options the tracer and the guest harness rely on. Checked in the final
# .config in addition to everything the fragment sets.
REQUIRED=(
    64BIT SMP PRINTK TTY SERIAL_8250 SERIAL_8250_CONSOLE
    BLK_DEV_INITRD RD_GZIP BINFMT_ELF BINFMT_SCRIPT
    PROC_FS SYSFS DEVTMPFS DEVTMPFS_MOUNT TMPFS
    FTRACE FUNCTION_TRACER FUNCTION_GRAPH_TRACER DYNAMIC_FTRACE
    KPROBES KPROBE_EVENTS KALLSYMS KALLSYMS_ALL MODULES
    RANDOMIZE_BASE RELOCATABLE X86_KERNEL_IBT ACPI PCI
    EARLY_PRINTK PRINTK_TIME MULTIUSER FUTEX EPOLL SHMEM POSIX_TIMERS
    HIGH_RES_TIMERS X86_TSC HPET_TIMER FILE_LOCKING UNIX
)

[[ -f $FRAGMENT ]] || die "missing $FRAGMENT"
hv_apt_ensure "$SRC_PKG" build-essential bc flex bison libelf-dev libssl-dev \
    lz4 xz-utils kmod python3

CACHE=$(hv_cache_dir)
src_version=$(hv_sanitize_version "$(dpkg-query -W -f='${Version}' "$SRC_PKG")")
tarball=/usr/src/$SRC_PKG.tar.xz
[[ -f $tarball ]] || die "$SRC_PKG is installed but $tarball is missing"
config_hash=$(hv_hash "$FRAGMENT" -- "recipe $RECIPE")
name=fast-6.12-$src_version-$config_hash
out=$CACHE/$name

complete() {
    local f
    for f in bzImage vmlinux System.map .config release modules/done; do
        [[ -f $1/$f ]] || return 1
    done
}

if complete "$out"; then
    log "cached: $out (release $(cat "$out/release"))"
    printf '%s\n' "$out/bzImage"
    exit 0
fi

# One build at a time per cache (the build tree is shared between configs).
exec 9>"$CACHE/.fast-kernel.lock"
if ! flock -n 9; then
    log "another fast-kernel build is running; waiting for it"
    flock 9
fi
if complete "$out"; then
    log "cached: $out (built meanwhile)"
    printf '%s\n' "$out/bzImage"
    exit 0
fi

# --- Unpack the source once per source version.
src=$CACHE/src/$SRC_PKG-$src_version
if [[ ! -f $src/Makefile ]]; then
    log "unpacking $tarball ($SRC_PKG $src_version)"
    mkdir -p "$CACHE/src"
    unpack=$(mktemp -d "$CACHE/src/.unpack.XXXXXX")
    trap 'rm -rf "$unpack"' EXIT
    tar -xf "$tarball" -C "$unpack"
    [[ -f $unpack/$SRC_PKG/Makefile ]] || die "$tarball does not hold $SRC_PKG/"
    rm -rf "$src"
    mv -T "$unpack/$SRC_PKG" "$src"
    rm -rf "$unpack"
    trap - EXIT
fi

build=$CACHE/build/fast-6.12-$src_version
mkdir -p "$build"
logfile=$CACHE/build/$name.log
: >"$logfile"
jobs=${HVTRACE_JOBS:-$(nproc)}
export KBUILD_BUILD_USER=hvtrace KBUILD_BUILD_HOST=hvtrace
kmake=(make -C "$src" O="$build" ARCH=x86_64)

# Run a command with its output in $logfile; show a progress line on stderr
# every 30 s (elapsed time and the latest output line). On failure, show the
# tail of the log.
run_logged() {
    local what=$1 start=$SECONDS rc=0
    shift
    {
        "$@" </dev/null 2>&1 || printf '\n__HVTRACE_RC=%s\n' "$?"
    } | progress_filter "$what" "$start" || rc=$?
    if ((rc != 0)); then
        log "$what FAILED; last lines of $logfile:"
        tail -n 40 "$logfile" | sed 's/^/    /' >&2
        exit 1
    fi
    log "$what: done in $((SECONDS - start)) s"
}

# Copy stdin to $logfile, report progress, exit with the status found in the
# "__HVTRACE_RC=" marker line.
progress_filter() {
    local what=$1 start=$2 last=$SECONDS line='' latest='' rc=0
    while :; do
        if IFS= read -r -t 5 line; then
            if [[ $line == __HVTRACE_RC=* ]]; then
                rc=${line#__HVTRACE_RC=}
                continue
            fi
            printf '%s\n' "$line" >>"$logfile"
            latest=$line
        elif (($? <= 128)); then
            break
        fi
        if ((SECONDS - last >= 30)); then
            last=$SECONDS
            log "$what: $((SECONDS - start)) s ... ${latest:0:100}"
        fi
    done
    return "$rc"
}

# --- Configure: tinyconfig, merge the fragment, resolve dependencies.
log "configuring $name (tinyconfig + $(basename "$FRAGMENT"))"
run_logged "tinyconfig" "${kmake[@]}" tinyconfig
run_logged "merge fragment" env -C "$build" "$src/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" "$FRAGMENT"
run_logged "olddefconfig" "${kmake[@]}" olddefconfig

# Every option must have the value asked for: olddefconfig silently drops an
# option whose dependencies are not met.
verify_config() {
    local cfg=$build/.config bad=() line opt o
    while IFS= read -r line; do
        if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
            grep -qxF -- "$line" "$cfg" || bad+=("$line (have: $(grep -E "^(# )?${BASH_REMATCH[1]}[= ]" "$cfg" || echo unset))")
        elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
            opt=${BASH_REMATCH[1]}
            if grep -qE "^$opt=" "$cfg"; then
                bad+=("$line (have: $(grep -E "^$opt=" "$cfg"))")
            fi
        fi
    done <"$FRAGMENT"
    for o in "${REQUIRED[@]}"; do
        grep -qx "CONFIG_$o=y" "$FRAGMENT" && continue # checked above
        grep -qx "CONFIG_$o=y" "$cfg" || bad+=("CONFIG_$o=y (required, not in the fragment)")
    done
    if ((${#bad[@]})); then
        log "ERROR: ${#bad[@]} option(s) did not end up as requested in $cfg:"
        printf '[hvtrace-setup]     %s\n' "${bad[@]}" >&2
        exit 1
    fi
    log "config check: all $(grep -cE '^(CONFIG_|# CONFIG_.* is not set)' "$FRAGMENT") fragment options and ${#REQUIRED[@]} required options are set"
}
verify_config

# --- Build.
log "building bzImage with $jobs jobs (a few minutes; log: $logfile)"
run_logged "build" "${kmake[@]}" -j"$jobs" bzImage
# The fragment's =m options: built and installed as a /lib/modules tree
# (with depmod's modules.dep), for the initramfs of the module tests.
run_logged "modules" "${kmake[@]}" -j"$jobs" modules
verify_config

release=$("${kmake[@]}" -s kernelrelease 2>/dev/null)
[[ -n $release ]] || die "make kernelrelease printed nothing"

stage=$(mktemp -d "$CACHE/.$name.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp "$build/arch/x86/boot/bzImage" "$stage/bzImage"
cp "$build/vmlinux" "$stage/vmlinux"
cp "$build/System.map" "$stage/System.map"
cp "$build/.config" "$stage/.config"
ln -s .config "$stage/config"
printf '%s\n' "$release" >"$stage/release"
run_logged "modules_install" "${kmake[@]}" INSTALL_MOD_PATH="$stage/modules" modules_install
rm -f "$stage/modules/lib/modules/$release/build" "$stage/modules/lib/modules/$release/source"
grep -q 'binfmt_misc.ko:' "$stage/modules/lib/modules/$release/modules.dep" ||
    die "modules_install made no modules.dep entry for binfmt_misc"
touch "$stage/modules/done"
chmod 755 "$stage"
rm -rf "$out"
mv -T "$stage" "$out"
trap - EXIT
log "ready: $out (release $release, bzImage $(stat -c %s "$out/bzImage") bytes)"
printf '%s\n' "$out/bzImage"
