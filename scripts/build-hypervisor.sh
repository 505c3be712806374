#!/usr/bin/env bash
# Builds the bare-metal hypervisor image and prints its path.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build -q -p hypervisor --release --target x86_64-unknown-none --features bare-metal >&2
printf '%s\n' "$PWD/target/x86_64-unknown-none/release/hypervisor"
