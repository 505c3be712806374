#!/usr/bin/env bash
# Build the hvtrace guest initramfs: Debian's static busybox plus
# guest/initramfs/init and guest/tools/hvbench.c (built static) and guest/tools/hvcompat.S (32-bit, binutils), as a gzip-compressed newc cpio archive
# (or a bare one, see HVTRACE_INITRAMFS_COMPRESS below).
#
# Output: $CACHE/initramfs-<busybox version>-<hash>.cpio.gz (.cpio when
# uncompressed, see below), where the hash covers the init script, the
# busybox binary and the archive layout below.
# The archive is written without needing root (device nodes and owners come
# from the archive writer, not from the file system) and is reproducible:
# every entry is owned by root with a fixed timestamp.
# Prints the archive path on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

INIT=$HVTRACE_REPO/guest/initramfs/init
# The guest side of the tests and benchmarks, built static with the host's gcc.
BENCH_SRC=$HVTRACE_REPO/guest/tools/hvbench.c
COMPAT_SRC=$HVTRACE_REPO/guest/tools/hvcompat.S
BUSYBOX=/bin/busybox
# Bump when the archive layout in write_cpio below changes.
LAYOUT=2
# Optional: kernel modules to carry as /lib/<name>, colon-separated (the
# test modules of the VM tests, see scripts/guest/attacker.sh).
EXTRA_MODULES=${HVTRACE_INITRAMFS_MODULES:-}
# Optional: a directory whose files are added at the same paths under the
# archive's root (the Debian kernel's modules, see
# scripts/guest/debian-modules.sh); its `done` marker is left out.
EXTRA_TREE=${HVTRACE_INITRAMFS_TREE:-}
# Optional: `none` writes the archive uncompressed, for the archives that
# carry megabytes of modules. GRUB unpacks a gzip-compressed multiboot
# module itself, in code that Bochs emulates slowly (about 2 s of boot per
# MB unpacked); the kernel takes a bare archive as it is.
COMPRESS=${HVTRACE_INITRAMFS_COMPRESS:-gzip}
case $COMPRESS in
    gzip) suffix=.cpio.gz ;;
    none) suffix=.cpio ;;
    *) die "HVTRACE_INITRAMFS_COMPRESS must be gzip or none, not $COMPRESS" ;;
esac

[[ -f $INIT ]] || die "missing $INIT"
[[ -f $BENCH_SRC ]] || die "missing $BENCH_SRC"
hv_apt_ensure busybox-static python3 gcc libc6-dev
[[ -x $BUSYBOX ]] || die "$BUSYBOX not found (package busybox-static)"
# The dynamically linked busybox (package busybox) would not run in the guest.
if ! file -b "$BUSYBOX" | grep -q 'statically linked'; then
    die "$BUSYBOX is not statically linked; install busybox-static"
fi

CACHE=$(hv_cache_dir)
bb_version=$(dpkg-query -W -f='${Version}' busybox-static)
gcc_version=$(gcc -dumpfullversion)
extra=()
kind=""
if [[ -n $EXTRA_MODULES ]]; then
    IFS=: read -r -a extra <<<"$EXTRA_MODULES"
    for m in "${extra[@]}"; do
        [[ -f $m ]] || die "missing $m"
    done
    kind=-$(basename "${extra[0]}" .ko)
fi
tree_files=()
if [[ -n $EXTRA_TREE ]]; then
    [[ -d $EXTRA_TREE ]] || die "missing $EXTRA_TREE"
    mapfile -t tree_files < <(cd "$EXTRA_TREE" && find . -type f ! -name 'done' | LC_ALL=C sort)
    ((${#tree_files[@]} > 0)) || die "$EXTRA_TREE has no files"
    kind=$kind-tree
fi
tree_hash=$(cd "${EXTRA_TREE:-/}" && if ((${#tree_files[@]})); then sha256sum "${tree_files[@]}"; fi | sha256sum | cut -c1-12)
hash=$(hv_hash "$INIT" "$BUSYBOX" "$BENCH_SRC" "$COMPAT_SRC" "${extra[@]}" -- "layout $LAYOUT" "busybox $bb_version" "gcc $gcc_version" "tree $tree_hash")
out=$CACHE/initramfs-$(hv_sanitize_version "$bb_version")$kind-$hash$suffix

if [[ -f $out ]]; then
    log "cached: $out"
    printf '%s\n' "$out"
    exit 0
fi

log "building initramfs (busybox $bb_version, init $(sha256sum "$INIT" | cut -c1-12))"
tmp=$(mktemp "$out.tmp.XXXXXX")
bench=$(mktemp "$out.hvbench.XXXXXX")
compat=$(mktemp "$out.hvcompat.XXXXXX")
trap 'rm -f "$tmp" "$bench" "$compat" "$compat.o"' EXIT
gcc -static -O2 -Wall -Werror -o "$bench" "$BENCH_SRC" || die "building hvbench failed"
# A 32-bit program, for the kernels with IA32 emulation: binutils alone.
as --32 -o "$compat.o" "$COMPAT_SRC" && ld -m elf_i386 -o "$compat" "$compat.o" ||
    die "building hvcompat failed"

python3 - "$BUSYBOX" "$INIT" "$tmp" "$bench" "$EXTRA_MODULES" "$EXTRA_TREE" "$COMPRESS" "$compat" <<'PY'
import gzip, os, sys

busybox, init, out, bench, modules, tree, compress, compat = sys.argv[1:9]
entries = []  # (name, mode, data, rdev_major, rdev_minor)

def d(name, mode=0o755):
    entries.append((name, 0o040000 | mode, b"", 0, 0))

def f(name, data, mode=0o644):
    entries.append((name, 0o100000 | mode, data, 0, 0))

def l(name, target):
    entries.append((name, 0o120000 | 0o777, target.encode(), 0, 0))

def c(name, major, minor, mode=0o600):
    entries.append((name, 0o020000 | mode, b"", major, minor))

for name in ["bin", "sbin", "usr", "usr/bin", "usr/sbin", "dev", "proc", "sys",
             "run", "root", "etc", "mnt"]:
    d(name)
d("tmp", 0o1777)
c("dev/console", 5, 1)
c("dev/null", 1, 3, 0o666)
c("dev/ttyS0", 4, 64, 0o660)
f("bin/busybox", open(busybox, "rb").read(), 0o755)
l("bin/sh", "busybox")
f("init", open(init, "rb").read(), 0o755)
f("bin/hvbench", open(bench, "rb").read(), 0o755)
f("bin/hvcompat", open(compat, "rb").read(), 0o755)
if modules:
    d("lib")
    for module in modules.split(":"):
        f("lib/" + os.path.basename(module), open(module, "rb").read())
if tree:
    have = {name for name, *_ in entries}
    for top, dirs, files in sorted(os.walk(tree)):
        dirs.sort()
        rel = os.path.relpath(top, tree)
        if rel != "." and rel not in have:
            d(rel)
            have.add(rel)
        for name in sorted(files):
            if rel == "." and name == "done":
                continue
            path = name if rel == "." else rel + "/" + name
            f(path, open(os.path.join(top, name), "rb").read())
f("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
f("etc/group", b"root:x:0:\n")
f("etc/hostname", b"hvtrace-guest\n")

def pad4(n):
    return (4 - n % 4) % 4

blob = bytearray()
for ino, (name, mode, data, rmaj, rmin) in enumerate(entries + [("TRAILER!!!", 0, b"", 0, 0)], 1):
    nlink = 2 if mode & 0o170000 == 0o040000 else 1
    if name == "TRAILER!!!":
        ino = nlink = 0
    fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmaj, rmin, len(name) + 1, 0]
    hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
    blob += hdr + name.encode() + b"\0"
    blob += b"\0" * pad4(len(hdr) + len(name) + 1)
    blob += data + b"\0" * pad4(len(data))
blob += b"\0" * pad4(len(blob))

with open(out, "wb") as fh:
    if compress == "none":
        fh.write(bytes(blob))
    else:
        fh.write(gzip.compress(bytes(blob), compresslevel=9, mtime=0))
PY

chmod 644 "$tmp"
mv -f "$tmp" "$out"
rm -f "$bench"
trap - EXIT
log "ready: $out ($(stat -c %s "$out") bytes)"
printf '%s\n' "$out"
