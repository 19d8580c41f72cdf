# Shared by smoke.sh and deep.sh (sourced, not run): the target list, the instrumented
# build, the seed corpora and one fuzzing run. Works in fuzz/.
#
# Targets build with debug assertions and overflow checks (cargo-fuzz's default) so any
# arithmetic overflow on untrusted values is a finding. The sanitizer is off: the crates under
# test contain no unsafe code, and without ASan each target runs several times faster.
cd "$(dirname "${BASH_SOURCE[0]}")"
export CARGO_TARGET_DIR="$PWD/target"
host=$(rustc -vV | sed -n 's/^host: //p')

# The instrumentation cargo-fuzz adds (its default build: optimized, with debug assertions
# and overflow checks), applied with plain cargo so CI needs no extra tool. With --target,
# RUSTFLAGS reach only the fuzz targets and their dependencies, not build scripts.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"

# Every fuzz target named in Cargo.toml.
fuzz_targets() {
    local t
    t=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^qcow2-fuzz$')
    [ -n "$t" ] || { echo "fuzz: no fuzz targets found in Cargo.toml" >&2; return 1; }
    echo "$t"
}

# Builds every target. Exits 0 (skipping everything) only when this toolchain cannot build
# libFuzzer targets at all; any other build failure is fatal.
build_fuzz_targets() {
    echo "== building fuzz targets"
    local log
    log=$(mktemp)
    if ! cargo build --release --locked --target "$host" --bins >"$log" 2>&1; then
        # Only a toolchain that cannot build libFuzzer (no C++ compiler for libfuzzer-sys) is
        # a reason to skip; anything else is a real failure.
        if grep -qE 'failed to run custom build command for .libfuzzer-sys|error occurred in cc-rs' "$log"; then
            tail -20 "$log"
            rm -f "$log"
            echo "== fuzzing SKIPPED: this toolchain cannot build libFuzzer targets"
            exit 0
        fi
        cat "$log" >&2
        rm -f "$log"
        echo "fuzz: building the fuzz targets failed" >&2
        exit 1
    fi
    rm -f "$log"
}

# Regenerates the seed corpora from real qemu-img images.
make_corpora() {
    echo "== generating seed corpora from qemu-img images"
    rm -rf corpus/*/
    python3 make_corpus.py corpus
}

# fuzz_run TARGET SECONDS LOG: fuzzes TARGET from its corpus for SECONDS; libFuzzer's whole
# output goes to LOG, a finding's input to artifacts/TARGET/. Returns the fuzzer's status:
# non-zero means it found something (crash, panic, overflow, hang over 10 s, or more than
# 2 GiB of memory).
fuzz_run() {
    local t=$1 secs=$2 log=$3
    mkdir -p "corpus/$t" "artifacts/$t"
    "target/$host/release/$t" "corpus/$t" -artifact_prefix="artifacts/$t/" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1
}

# The lines of a fuzz_run log worth showing: the outcome, not the progress.
fuzz_summary() {
    grep -E '^(stat::number_of_executed_units|Done|INFO: Seed|.*(panicked|ERROR|SUMMARY|Test unit written|Crash|deadly|timeout).*)' "$1" || true
}
