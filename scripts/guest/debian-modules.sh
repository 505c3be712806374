#!/usr/bin/env bash
# Build the Debian guest's initramfs: scripts/guest/initramfs.sh's, with
# modules of the stock kernel package under /lib/modules/<release>/ and a
# modules.dep made by depmod, so that busybox `modprobe ext4` and
# `mount -o loop` work in the guest. The modules come unmodified from the
# same linux-image .deb the Debian guest kernel comes from
# (scripts/guest/debian-kernel.sh).
#
# Usage: debian-modules.sh [MODULE...]   the initramfs: DEFAULT_MODULES
#                                        below, the MODULEs named, and what
#                                        they need; prints its path
#        debian-modules.sh --index       the package's module index; prints
#                                        the path of its modules.dep
#
# What a module needs is taken from the whole package, never listed by
# hand: its dependencies from depmod's modules.dep over every module of
# the package, and its soft dependencies (modules.softdep: `ext4 pre:
# crypto-crc32c`, which the kernel asks for by that alias when ext4
# mounts) through modules.alias; then what those need, and so on. depmod is
# run again over the modules taken, and its modules.dep must give every
# module the same dependencies as the whole package's does.
#
# Cache entries (each written under a temporary name and renamed into
# place; a finished one is never rewritten):
#   $CACHE/debian-modindex-<hash>/  the package's modules.dep,
#       modules.alias, modules.softdep and modules.builtin, keyed by the
#       package version;
#   $CACHE/debian-modules-<hash>/   the module tree, keyed by the package
#       version and the modules it carries;
#   the initramfs itself is initramfs.sh's, keyed by the tree's contents,
#   and uncompressed (a bare cpio archive).
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# The modules the Debian guest carries by default: the usual file systems
# of an image or a stick (ext4; vfat with the code page and character sets
# its mount asks for by default; isofs; squashfs), overlay, and loop to
# mount an image file. Their dependencies come with them.
DEFAULT_MODULES=(ext4 vfat nls_cp437 nls_ascii nls_utf8 isofs squashfs overlay loop)
# Bump when the index's files change.
INDEX_LAYOUT=1
# Bump when the module tree's layout changes.
TREE_LAYOUT=2

index_only=0
requested=("${DEFAULT_MODULES[@]}")
for arg in "$@"; do
    case $arg in
        --index) index_only=1 ;;
        -*) die "unknown option $arg (usage: debian-modules.sh [--index] [MODULE...])" ;;
        *) requested+=("$arg") ;;
    esac
done

hv_apt_ensure kmod python3
kdir=$(dirname "$("$HVTRACE_REPO/scripts/guest/debian-kernel.sh")")
CACHE=$(hv_cache_dir)
read -r pkg pkg_version <"$kdir/package"
release=$(cat "$kdir/release")
deb=$CACHE/downloads/${pkg}_$(hv_sanitize_version "$pkg_version")_amd64.deb
[[ -f $deb ]] || die "the kernel package $deb is not in the cache"
moddir=lib/modules/$release

work=""
trap '[[ -z $work ]] || rm -rf "$work"' EXIT
# The package's modules, all of them, when this run had to take them out
# (for the index); the tree below is then copied from there.
full=""

index=$CACHE/debian-modindex-$(hv_hash -- "package $pkg $pkg_version" "layout $INDEX_LAYOUT")
if [[ ! -f $index/done ]]; then
    log "indexing the modules of $pkg $pkg_version"
    work=$(mktemp -d "$CACHE/.debian-modules.XXXXXX")
    mkdir -p "$work/all" "$work/index"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/all" "./$moddir" ||
        die "cannot take $moddir out of $deb"
    depmod -b "$work/all" "$release" || die "depmod failed over $pkg's modules"
    for f in modules.dep modules.alias modules.softdep modules.builtin; do
        [[ -f $work/all/$moddir/$f ]] || die "depmod made no $f"
        cp "$work/all/$moddir/$f" "$work/index/$f"
    done
    grep -q '^kernel/fs/ext4/ext4.ko:' "$work/index/modules.dep" ||
        die "the index of $pkg has no ext4"
    printf '%s %s\n%s\n' "$pkg" "$pkg_version" "$release" >"$work/index/package"
    touch "$work/index/done"
    hv_publish_dir "$work/index" "$index"
    full=$work/all/$moddir
    log "module index: $index"
fi
if ((index_only)); then
    printf '%s\n' "$index/modules.dep"
    exit 0
fi

# The modules to carry, as paths under lib/modules/<release>, one a line.
resolved=$(python3 - "$index" "$pkg $pkg_version" "${requested[@]}" <<'PY'
import fnmatch, os, re, sys

index, package, names = sys.argv[1], sys.argv[2], sys.argv[3:]

def name_of(path):
    base = os.path.basename(path)
    for ext in (".ko", ".ko.xz", ".ko.zst", ".ko.gz"):
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    return base.replace("-", "_")

deps = {}
by_name = {}
with open(os.path.join(index, "modules.dep")) as fh:
    for line in fh:
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[name_of(path)] = path
with open(os.path.join(index, "modules.builtin")) as fh:
    builtin = {name_of(line.strip()) for line in fh if line.strip()}
aliases = []
with open(os.path.join(index, "modules.alias")) as fh:
    for line in fh:
        words = line.split()
        if len(words) == 3 and words[0] == "alias":
            aliases.append((words[1], words[2].replace("-", "_")))
softdeps = {}
with open(os.path.join(index, "modules.softdep")) as fh:
    for line in fh:
        words = line.split()
        if len(words) >= 2 and words[0] == "softdep":
            words_ = [w for w in words[2:] if w not in ("pre:", "post:")]
            softdeps.setdefault(words[1].replace("-", "_"), []).extend(words_)

def providers(word):
    """The modules a soft dependency names: a module, or an alias's."""
    name = word.replace("-", "_")
    if name in by_name:
        return [name]
    found = set()
    for pattern, m in aliases:
        # Most patterns are long globs over device ids: their literal
        # start rules them out before a glob is compiled.
        literal = re.split(r"[*?[]", pattern, maxsplit=1)[0]
        if word.startswith(literal) and m in by_name and fnmatch.fnmatchcase(word, pattern):
            found.add(m)
    return sorted(found)

unknown = []
todo = []
for n in names:
    name = n.replace("-", "_")
    if name in by_name:
        todo.append(name)
    elif name in builtin:
        print(f"[hvtrace-setup] {n} is built into the kernel: nothing to add", file=sys.stderr)
    else:
        unknown.append(n)
if unknown:
    what = "no module named" if len(unknown) == 1 else "no modules named"
    print(f"[hvtrace-setup] ERROR: {what} {', '.join(unknown)} in {package}", file=sys.stderr)
    sys.exit(3)

carried = set()
while todo:
    name = todo.pop()
    if name in carried:
        continue
    carried.add(name)
    path = by_name[name]
    todo.extend(name_of(d) for d in deps[path])
    for word in softdeps.get(name, []):
        found = providers(word)
        if not found:
            print(f"[hvtrace-setup] {name}'s soft dependency {word}: no module (built in, or not in {package})", file=sys.stderr)
        todo.extend(found)
for path in sorted(by_name[n] for n in carried):
    print(path)
PY
) || exit
mapfile -t paths <<<"$resolved"
[[ ${#paths[@]} -gt 0 && -n ${paths[0]} ]] || die "no modules resolved"
names=()
for p in "${paths[@]}"; do
    n=$(basename "$p" .ko)
    names+=("${n//-/_}")
done

# modules.dep's lines as sets: each line's dependencies sorted, then the
# lines (depmod lists a module's dependencies in load order, which
# follows the modules around it).
dep_sets() {
    local key deps
    while read -r key deps; do
        printf '%s %s\n' "$key" "$(tr ' ' '\n' <<<"$deps" | sort | xargs)"
    done | sort
}
tree=$CACHE/debian-modules-$(hv_hash -- "package $pkg $pkg_version" "modules ${paths[*]}" "layout $TREE_LAYOUT")
if [[ ! -f $tree/done ]]; then
    log "taking ${#paths[@]} modules out of $pkg $pkg_version: ${names[*]}"
    if [[ -z $work ]]; then
        work=$(mktemp -d "$CACHE/.debian-modules.XXXXXX")
    fi
    mkdir -p "$work/tree/$moddir"
    for f in "${paths[@]}" modules.builtin modules.builtin.modinfo modules.order; do
        if [[ -n $full ]]; then
            mkdir -p "$(dirname "$work/tree/$moddir/$f")"
            cp "$full/$f" "$work/tree/$moddir/$f"
        else
            printf './%s/%s\n' "$moddir" "$f"
        fi
    done >"$work/members"
    if [[ -z $full ]]; then
        dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/tree" -T "$work/members" ||
            die "cannot take the modules out of $deb"
    fi
    # modules.order, for the modules carried only (depmod orders by it).
    order=$work/tree/$moddir/modules.order
    grep -Fx -f <(printf '%s\n' "${paths[@]}") "$order" >"$order.new" || true
    mv -f "$order.new" "$order"
    depmod -b "$work/tree" "$release" || die "depmod failed"
    # Every module carried has the dependencies it has in the whole
    # package: nothing it needs was left out.
    if ! diff <(awk -F: 'NR == FNR { want[$0]; next } $1 in want' <(printf '%s\n' "${paths[@]}") \
        "$index/modules.dep" | dep_sets) <(dep_sets <"$work/tree/$moddir/modules.dep") >&2; then
        die "the modules taken do not have the dependencies they have in $pkg"
    fi
    touch "$work/tree/done"
    hv_publish_dir "$work/tree" "$tree"
    log "module tree: $tree ($(du -sk "$tree" | cut -f1) KiB)"
fi
# Uncompressed: GRUB would spend about 7 s of a Bochs boot unpacking the
# modules' 4 MB (see initramfs.sh).
HVTRACE_INITRAMFS_TREE=$tree HVTRACE_INITRAMFS_COMPRESS=none "$HVTRACE_REPO/scripts/guest/initramfs.sh"
