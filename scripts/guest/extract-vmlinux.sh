#!/usr/bin/env bash
# Extract the vmlinux ELF that an x86 bzImage carries as its compressed payload.
#
#   scripts/guest/extract-vmlinux.sh BZIMAGE [OUT]
#
# Reads payload_offset / payload_length from the boot-protocol setup header
# (protocol >= 2.08), recognises the compression from the payload's magic bytes
# (xz, gzip, zstd, lz4, lzma, bzip2, or none), decompresses it and checks that
# the result is an ELF file whose size matches the size the kernel build
# appended to the payload. The result is a stripped vmlinux (no symbol table):
# the decompressor's input, loadable at its PT_LOAD physical addresses. The
# KASLR relocation table that follows the ELF in the payload is dropped.
# OUT defaults to vmlinux next to BZIMAGE. Prints OUT on stdout.
set -euo pipefail

# shellcheck source=scripts/guest/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(($# >= 1 && $# <= 2)) || die "usage: $0 BZIMAGE [OUT]"
bz=$1
out=${2:-$(dirname "$bz")/vmlinux}
[[ -f $bz ]] || die "no such file: $bz"

# Little-endian unsigned integer of WIDTH bytes at OFFSET.
le() {
    od -An -v -tu"$2" -j "$1" -N "$2" --endian=little "$bz" | tr -d ' \n'
}

[[ "$(dd if="$bz" bs=1 skip=$((0x202)) count=4 status=none)" == HdrS ]] ||
    die "$bz: no HdrS signature, not a bzImage"
version=$(le $((0x206)) 2)
((version >= 0x208)) || die "$bz: boot protocol $(printf '%#x' "$version") has no payload fields"
setup_sects=$(le $((0x1f1)) 1)
if ((setup_sects == 0)); then setup_sects=4; fi
payload_offset=$(le $((0x248)) 4)
payload_length=$(le $((0x24c)) 4)
start=$(((setup_sects + 1) * 512 + payload_offset))
((payload_length > 0)) || die "$bz: empty payload"

payload() {
    # $1: how many bytes of the payload to emit
    dd if="$bz" bs=1M iflag=skip_bytes,count_bytes skip="$start" count="$1" status=none
}

magic=$(payload 8 | od -An -v -tx1 | tr -d ' \n')
case $magic in
    fd377a585a00*) fmt=xz ;;
    1f8b*) fmt=gzip ;;
    28b52ffd*) fmt=zstd ;;
    02214c18*) fmt=lz4 ;;
    5d0000*) fmt=lzma ;;
    425a68*) fmt=bzip2 ;;
    894c5a4f*) fmt=lzo ;;
    7f454c46*) fmt=none ;;
    *) die "$bz: unknown payload magic $magic" ;;
esac

# Every format except gzip and none gets the decompressed size appended as a
# 32-bit little-endian word (scripts/Makefile.lib, size_append).
expect_size=
body_length=$payload_length
case $fmt in
    gzip | none) ;;
    *)
        body_length=$((payload_length - 4))
        expect_size=$(le $((start + body_length)) 4)
        ;;
esac

case $fmt in
    xz) decomp=(xz -dc --single-stream) ;;
    gzip) decomp=(gzip -dc) ;;
    zstd) decomp=(zstd -dcq) ;;
    lz4) decomp=(lz4 -dc) ;;
    lzma) decomp=(xz -dc --format=lzma) ;;
    bzip2) decomp=(bzip2 -dc) ;;
    lzo) decomp=(lzop -dc) ;;
    none) decomp=(cat) ;;
esac
command -v "${decomp[0]}" >/dev/null 2>&1 || die "$bz: payload is $fmt but ${decomp[0]} is not installed"

log "extracting vmlinux from $(basename "$bz") ($fmt payload, $payload_length bytes at offset $start)"
mkdir -p "$(dirname "$out")"
tmp=$(mktemp "$out.tmp.XXXXXX")
trap 'rm -f "$tmp"' EXIT
payload "$body_length" | "${decomp[@]}" >"$tmp"

[[ "$(head -c 4 "$tmp" | od -An -tx1 | tr -d ' \n')" == 7f454c46 ]] ||
    die "$bz: decompressed payload is not an ELF file"
size=$(stat -c %s "$tmp")
if [[ -n $expect_size && $size -ne $expect_size ]]; then
    die "$bz: decompressed $size bytes, the image says $expect_size"
fi
# With KASLR the payload is the ELF followed by its relocation table
# (vmlinux.relocs); cut the file at the end of the ELF section headers.
elf_end=$(($(od -An -v -tu8 -j 40 -N 8 --endian=little "$tmp" | tr -d ' \n') +
    $(od -An -v -tu2 -j 58 -N 2 --endian=little "$tmp" | tr -d ' \n') *
    $(od -An -v -tu2 -j 60 -N 2 --endian=little "$tmp" | tr -d ' \n')))
if ((elf_end < size)); then
    log "dropping $((size - elf_end)) bytes of relocation data after the ELF"
    truncate -s "$elf_end" "$tmp"
    size=$elf_end
fi
chmod 644 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
log "vmlinux: $size bytes, $(file -b "$out" | cut -d, -f1-2)"
printf '%s\n' "$out"
