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
export CARGO_TARGET_DIR="$PWD/target"
host=$(rustc -vV | sed -n 's/^host: //p')

# The instrumentation cargo-fuzz adds (its default build: optimized, with debug assertions
# and overflow checks), applied with plain cargo so CI needs no extra tool. With --target,
# RUSTFLAGS reach only the fuzz targets and their dependencies, not build scripts.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"

targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^qcow2-fuzz$')
[ -n "$targets" ] || { echo "smoke.sh: no fuzz targets found" >&2; exit 1; }

echo "== building fuzz targets"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo build --release --locked --target "$host" --bins >"$log" 2>&1; then
    # Only a toolchain that cannot build libFuzzer (no C++ compiler for libfuzzer-sys) is a
    # reason to skip; anything else is a real failure.
    if grep -qE 'failed to run custom build command for .libfuzzer-sys|error occurred in cc-rs' "$log"; then
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
    mkdir -p "corpus/$t" "artifacts/$t"
    set +e
    "target/$host/release/$t" "corpus/$t" -artifact_prefix="artifacts/$t/" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>&1 |
        grep -E '^(stat::number_of_executed_units|Done|INFO: Seed|.*(panicked|ERROR|SUMMARY|Test unit written|Crash|deadly|timeout).*)'
    status=${PIPESTATUS[0]}
    set -e
    # grep only hides libFuzzer's progress lines; what decides is the fuzzer's exit status.
    if [ "$status" -ne 0 ]; then
        echo "smoke.sh: fuzz target $t found a problem; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
echo "== fuzz smoke passed"
