#!/usr/bin/env bash
# The project's test command: makes sure the tools the tests use as oracles are installed,
# then runs the whole suite. Extra arguments go to `cargo test` (e.g. a test name filter).
#
# The tests drive the real QEMU tools (qemu-img, qemu-io, qemu-nbd) and real NBD clients
# (nbdinfo, nbdcopy, nbdsh with its Python binding, fio's nbd engine, nbd-client), and
# GnuTLS's certtool/psktool/gnutls-cli to make TLS credentials and speak TLS. Missing
# ones are installed from Debian's packages when running as root; otherwise this prints the
# exact command to run and stops, rather than letting dozens of tests fail one by one.
set -euo pipefail
cd "$(dirname "$0")/.."

has() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }

missing=()
has qemu-img && has qemu-io && has qemu-nbd || missing+=(qemu-utils)
has nbdinfo && has nbdcopy && has nbdsh || missing+=(libnbd-bin)
/usr/bin/python3 -c 'import nbd' 2>/dev/null || missing+=(python3-libnbd)
has fio || missing+=(fio)
has nbd-client || missing+=(nbd-client)
has certtool && has psktool && has gnutls-cli || missing+=(gnutls-bin)

if ((${#missing[@]})); then
    if [ "$(id -u)" -ne 0 ]; then
        echo "The tests need: ${missing[*]}. Install them with:" >&2
        echo "  sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "== installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update >/dev/null && apt-get install -y "${missing[@]}" >/dev/null; }
fi

scripts/build-deps.sh
# cargo prints one "test result:" line per test binary (about thirty); the last line adds
# them up so that a run ends with one total. cargo's own exit status is the script's.
set +e
cargo test --workspace --locked "$@" 2>&1 | awk '
    { print; fflush() }
    /^test result: / {
        for (i = 1; i <= NF; i++) {
            if ($(i + 1) ~ /^passed;?$/) passed += $i
            if ($(i + 1) ~ /^failed;?$/) failed += $i
            if ($(i + 1) ~ /^ignored;?$/) ignored += $i
        }
    }
    END { printf "total: %d passed, %d failed, %d ignored\n", passed, failed, ignored }'
status=${PIPESTATUS[0]}
exit "$status"
