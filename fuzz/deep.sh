#!/usr/bin/env bash
# Fuzzes every target for SECONDS each (default 1200) from the generated seed corpora and
# prints, as Markdown table rows, the executions and findings of each. Unlike smoke.sh it
# does not stop at a finding: every target gets its time, and the exit status is 1 if any
# found something (the inputs are in fuzz/artifacts/TARGET/, the logs in fuzz/logs/).
#
#   fuzz/deep.sh [SECONDS] [TARGET...]
set -euo pipefail
secs=${1:-1200}
shift || true
source "$(dirname "$0")/common.sh"
if [ $# -gt 0 ]; then
    targets="$*"
else
    targets=$(fuzz_targets)
fi
build_fuzz_targets
make_corpora
mkdir -p logs

rows=()
found=0
for t in $targets; do
    echo "== fuzzing $t for ${secs}s"
    log="logs/$t.log"
    mkdir -p "artifacts/$t"
    before=$(find "artifacts/$t" -type f | wc -l)
    status=0
    start=$(date +%s)
    fuzz_run "$t" "$secs" "$log" || status=$?
    took=$(( $(date +%s) - start ))
    fuzz_summary "$log" | grep -v '^INFO: Seed' || true
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    corpus=$(find "corpus/$t" -type f | wc -l)
    new=$(( $(find "artifacts/$t" -type f | wc -l) - before ))
    if [ "$status" -ne 0 ]; then
        found=1
        # A finding ends the run early; say which kind, and where its input is.
        kind=$(grep -m1 -oE 'deadly signal|panicked|timeout|out-of-memory|leak' "$log" || true)
        findings="$new (${kind:-exit $status}; artifacts/$t/)"
    else
        findings=0
    fi
    rows+=("| \`$t\` | ${took} s | ${execs:-?} | $corpus | $findings |")
done

echo
echo "| target | time | executions | corpus entries | findings |"
echo "|---|---:|---:|---:|---|"
printf '%s\n' "${rows[@]}"
exit "$found"
