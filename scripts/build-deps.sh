#!/usr/bin/env bash
# What building the workspace needs beyond Rust: OpenSSL's headers and pkg-config (the
# `openssl` crate links the system libssl for the server's TLS). Installed from Debian's
# packages when missing and running as root; otherwise prints the command and fails.
set -euo pipefail

if command -v pkg-config >/dev/null 2>&1 && pkg-config --exists openssl; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "Building needs OpenSSL's headers: sudo apt-get install -y libssl-dev pkg-config" >&2
    exit 1
fi
echo "== installing libssl-dev pkg-config" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y libssl-dev pkg-config >/dev/null 2>&1 ||
    { apt-get update >/dev/null && apt-get install -y libssl-dev pkg-config >/dev/null; }
