#!/usr/bin/env bash
# Smoke-runs every fuzz target (or the TARGETs named) for SECONDS each (default 20), seeded
# with corpora made from real qemu-img images by make_corpus.py. Fails on the first finding (crash, panic, overflow,
# hang over 10 s, or more than 2 GiB of memory). Skips, with exit 0, only when this
# toolchain cannot build libFuzzer targets at all.
#
#   fuzz/smoke.sh [SECONDS] [TARGET...]
set -euo pipefail
secs=${1:-20}
shift || true
source "$(dirname "$0")/common.sh"
if [ $# -gt 0 ]; then
    targets="$*"
else
    targets=$(fuzz_targets)
fi
build_fuzz_targets
make_corpora

log=$(mktemp)
trap 'rm -f "$log"' EXIT
for t in $targets; do
    echo "== fuzzing $t for ${secs}s"
    status=0
    fuzz_run "$t" "$secs" "$log" || status=$?
    fuzz_summary "$log"
    if [ "$status" -ne 0 ]; then
        echo "smoke.sh: fuzz target $t found a problem; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
echo "== fuzz smoke passed"
