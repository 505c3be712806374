# shellcheck shell=bash
# Shared helpers for the hvtrace setup and guest-image scripts.
# Sourced, not executed. Every caller runs under `set -euo pipefail`.
#
# Conventions:
#   * progress goes to stderr, prefixed "[hvtrace-setup]";
#   * the one result (a path) goes to stdout;
#   * everything built or downloaded lives in the cache directory
#     ${HVTRACE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvtrace}, never in the repo;
#   * cache entries are written under a temporary name and renamed into place,
#     so an interrupted run never leaves a half-written entry behind.

# shellcheck disable=SC2034 # used by the scripts that source this file
HVTRACE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

log() {
    printf '[hvtrace-setup] %s\n' "$*" >&2
}

die() {
    log "ERROR: $*"
    exit 1
}

hv_cache_dir() {
    local dir="${HVTRACE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvtrace}"
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

# Short content hash of files and/or strings: hv_hash FILE... [-- STRING...]
hv_hash() {
    local f
    {
        while (($#)); do
            if [[ $1 == -- ]]; then
                shift
                printf '%s\n' "$@"
                break
            fi
            f=$1
            shift
            printf '== %s\n' "$(basename "$f")"
            cat "$f"
        done
    } | sha256sum | cut -c1-12
}

# Make a Debian version usable as a path component (no epoch, no odd characters).
hv_sanitize_version() {
    local v="${1#*:}"
    printf '%s' "$v" | tr -c 'A-Za-z0-9._+-' '_'
}

# Run a command as root: directly when we are root, else through sudo -n.
hv_as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        die "need root to run: $*"
    fi
}

hv_pkg_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" == installed ]]
}

HV_APT_UPDATED=0
hv_apt_update() {
    if ((HV_APT_UPDATED == 0)); then
        log "apt-get update"
        hv_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null >&2
        HV_APT_UPDATED=1
    fi
}

# True when apt knows an installable candidate for every package given.
hv_apt_has_candidates() {
    local p cand
    for p in "$@"; do
        cand="$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2; exit}')"
        if [[ -z $cand || $cand == "(none)" ]]; then
            return 1
        fi
    done
}

# Install the packages that are not installed yet. apt-get update runs at most
# once, and only when apt does not know a package or the install fails.
hv_apt_ensure() {
    local missing=() p
    for p in "$@"; do
        hv_pkg_installed "$p" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    log "installing Debian packages: ${missing[*]}"
    if ! hv_apt_has_candidates "${missing[@]}"; then
        hv_apt_update
    fi
    local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}")
    if ! hv_as_root "${install[@]}" </dev/null >&2; then
        if ((HV_APT_UPDATED == 0)); then
            log "install failed; refreshing package lists and retrying"
            hv_apt_update
            hv_as_root "${install[@]}" </dev/null >&2
        else
            die "apt-get install failed: ${missing[*]}"
        fi
    fi
    for p in "${missing[@]}"; do
        hv_pkg_installed "$p" || die "package $p is still not installed"
    done
}

# Candidate version apt would install for a package (empty when unknown).
hv_apt_candidate() {
    apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}' | sed 's/^(none)$//'
}

# Puts a finished cache directory in place: renames WORK (which holds its
# `done` marker) to DEST. When another run put DEST in place first, WORK
# goes and DEST stays, untouched; a DEST without its marker (an older
# layout's) is set aside and removed first.
hv_publish_dir() {
    local work=$1 dest=$2 stale
    if mv -T "$work" "$dest" 2>/dev/null; then
        return 0
    fi
    if [[ ! -f $dest/done ]]; then
        stale=$(mktemp -d "$dest.stale.XXXXXX")
        mv -T "$dest" "$stale/old" 2>/dev/null || true
        rm -rf "$stale"
        if mv -T "$work" "$dest" 2>/dev/null; then
            return 0
        fi
        [[ -f $dest/done ]] || die "cannot put $dest in place"
    fi
    rm -rf "$work"
}
