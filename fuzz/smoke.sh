#!/usr/bin/env bash
# Smoke-runs every fuzz target for SECONDS each (default 20), seeded with corpora made from
# real qemu-img images by make_corpus.py. Fails on any finding (crash, panic, overflow, hang
# over 10 s, or more than 2 GiB of memory). Skips, with exit 0, only when this toolchain cannot
# build libFuzzer targets at all.
#
#   fuzz/smoke.sh [SECONDS]
#
# Targets build with debug assertions and overflow checks (cargo-fuzz's default) so any
# arithmetic overflow on untrusted values is a finding. The sanitizer is off: the crates under
# test contain no unsafe code, and without ASan each target runs several times faster.
set -euo pipefail
secs=${1:-20}
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="$PWD/target"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

targets=$(cargo fuzz list)
[ -n "$targets" ] || { echo "smoke.sh: no fuzz targets found" >&2; exit 1; }

echo "== building fuzz targets"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo fuzz build --sanitizer none >"$log" 2>&1; then
    # Only a toolchain that cannot build libFuzzer (no C++ compiler for libfuzzer-sys, or no
    # -Z sanitizer-coverage support) is a reason to skip; anything else is a real failure.
    if grep -qE 'failed to run custom build command for .libfuzzer-sys|error occurred in cc-rs|unknown unstable option|-Z.*only accepted on the nightly' "$log"; then
        tail -20 "$log"
        echo "== fuzz smoke SKIPPED: this toolchain cannot build libFuzzer targets"
        exit 0
    fi
    cat "$log" >&2
    echo "smoke.sh: building the fuzz targets failed" >&2
    exit 1
fi

echo "== generating seed corpora from qemu-img images"
rm -rf corpus/*/
python3 make_corpus.py corpus

for t in $targets; do
    echo "== fuzzing $t for ${secs}s"
    mkdir -p "corpus/$t"
    set +e
    cargo fuzz run --sanitizer none "$t" "corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>&1 |
        grep -E '^(stat::number_of_executed_units|Done|INFO: Seed|.*(panicked|ERROR|SUMMARY|Test unit written|Crash|deadly|timeout).*)'
    status=${PIPESTATUS[0]}
    set -e
    # grep only hides libFuzzer's progress lines; what decides is cargo fuzz's exit status.
    if [ "$status" -ne 0 ]; then
        echo "smoke.sh: fuzz target $t found a problem; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
echo "== fuzz smoke passed"
