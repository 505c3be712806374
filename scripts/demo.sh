#!/usr/bin/env bash
# The main job on built-in defaults: boot Debian's stock kernel as a VMX
# guest of the hvtrace hypervisor (in Bochs here, QEMU+KVM where the host has
# nested VMX), probe do_sys_openat2 from VMX root while the guest runs two
# commands, and print the trace. Extra arguments go to `hvtrace run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$HOME/.cargo/bin:$PATH"

bash scripts/setup.sh >/dev/null
bash scripts/guest/initramfs.sh >/dev/null
# Debian's kernel, and the Debian guest's initramfs with its modules.
bash scripts/guest/debian-modules.sh >/dev/null

if [ "$#" -eq 0 ]; then
    set -- --probe 'p:myopen do_sys_openat2 dfd=%di filename=+0(%si):string' \
        --exec 'uname -a' --exec 'cat /etc/hostname'
fi
cargo run -q --release -p hvtrace -- run "$@"
