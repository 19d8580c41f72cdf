#!/usr/bin/env bash
# The seeds' study reproduced by one command: every table of the subcluster-allocation work
# (the 2019 mailing-list table, the 2020 blog post and KVM Forum talk), of the L2 slice patch
# ("qcow2: Default to 4KB for the qcow2 cache entry size") and of the 2020 qcow2 meeting's
# chain study, measured with qemu-nbd / qemu-img and with ours side by side in the same run
# (alternating rounds, medians), beside the figures the seeds published. Writes a markdown
# report and SVG plots (benches/seeds_plot.py, python3 only).
#
#   benches/seeds.sh --quick        # small sizes, one round: ~10 minutes, ~6 GiB of disk
#   benches/seeds.sh                # the seeds' sizes: 40 GiB images, hours, ~45 GiB of disk
#   benches/seeds.sh --size 8       # full rounds on 8 GiB images (slice caches scaled to match)
#
# Options (full-mode default, quick-mode default):
#   --quick             the quick defaults below
#   --out FILE          the report [target/seeds/REPORT.md]; plots go beside it
#   --dir DIR           scratch directory's parent, not a tmpfs (O_DIRECT) [/var/tmp]
#   --tmpfs DIR         tmpfs for the no-backing table [/dev/shm]
#   --size GIB          allocation and slice images [40, 1 (allocation) and 4 (slices)]
#   --ios N             allocating writes per run [3000, 300]
#   --noback-ios N      allocating writes per run without backing file [1000, 200]
#   --space-mb MB       MiB of 4 KiB random writes of the space table, on an image of
#                       40 GiB * MB / 100 (the seed: 100 MB on 40 GB) [100, 4]
#   --chain-mib MIB     guest size of the chain images [1024, 64]
#   --depths "D..."     chain depths ["1 300 1000"]
#   --rounds N          alternating rounds per measurement [3, 1]
#   --runtime S         seconds per time-based fio run, plus 1 s of ramp-up [10, 2]
#   --qd32-ios N        allocating writes per run of the qd32 table [20000, 2000]
#   --only "GROUPS"     a subset of: alloc nobacking qd32 slices space metadata chain criterion
#                       [all; quick mode leaves out criterion]
#
# The criterion group runs `cargo bench` of the four engine benches (in-process, no NBD;
# about 15 minutes with their build) and reports criterion's medians; outside quick mode it
# also rewrites the criterion table of benches/RESULTS.md, dated with the commit measured.
#   --no-drop-caches    do not drop the host page cache between the chain's two reads
#   --skip-build        use the existing release binary (QCOW2_NBD_BIN to name another)
#
# Needs qemu-img, qemu-io, qemu-nbd, fio with the nbd engine (libnbd), python3 and a built
# release binary (made here unless --skip-build). Everything runs on a Unix socket; every
# server is started fresh per measurement, so its peak RSS (VmHWM) belongs to that run.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$REPO/benches/lib.sh"

QUICK=0 OUT="" BENCH_DIR=/var/tmp TMPFS_DIR=/dev/shm ONLY=""
DROP_CACHES=1 SKIP_BUILD=0
o_size="" o_ios="" o_qd32="" o_noback="" o_space="" o_chain="" o_depths="" o_rounds="" o_runtime=""
while [ $# -gt 0 ]; do
    case $1 in
    --quick) QUICK=1 ;;
    --out) OUT=$2 && shift ;;
    --dir) BENCH_DIR=$2 && shift ;;
    --tmpfs) TMPFS_DIR=$2 && shift ;;
    --size) o_size=$2 && shift ;;
    --ios) o_ios=$2 && shift ;;
    --noback-ios) o_noback=$2 && shift ;;
    --qd32-ios) o_qd32=$2 && shift ;;
    --space-mb) o_space=$2 && shift ;;
    --chain-mib) o_chain=$2 && shift ;;
    --depths) o_depths=$2 && shift ;;
    --rounds) o_rounds=$2 && shift ;;
    --runtime) o_runtime=$2 && shift ;;
    --only) ONLY=$2 && shift ;;
    --no-drop-caches) DROP_CACHES=0 ;;
    --skip-build) SKIP_BUILD=1 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" && exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done
for v in "$o_size" "$o_ios" "$o_qd32" "$o_noback" "$o_space" "$o_chain" "$o_rounds" "$o_runtime"; do
    [ -z "$v" ] || [[ $v =~ ^[1-9][0-9]*$ ]] || die "option value $v is not a positive integer"
done
if [ "$QUICK" = 1 ]; then
    ALLOC_GIB=${o_size:-1} SLICE_GIB=${o_size:-4} ALLOC_IOS=${o_ios:-300} NOBACK_IOS=${o_noback:-200}
    SPACE_MB=${o_space:-4} CHAIN_MIB=${o_chain:-64} ROUNDS=${o_rounds:-1} RUNTIME=${o_runtime:-2}
    QD32_IOS=${o_qd32:-2000}
else
    ALLOC_GIB=${o_size:-40} SLICE_GIB=${o_size:-40} ALLOC_IOS=${o_ios:-3000} NOBACK_IOS=${o_noback:-1000}
    SPACE_MB=${o_space:-100} CHAIN_MIB=${o_chain:-1024} ROUNDS=${o_rounds:-3} RUNTIME=${o_runtime:-10}
    QD32_IOS=${o_qd32:-20000}
fi
DEPTHS=${o_depths:-"1 300 1000"}
if [ -z "$ONLY" ]; then
    ONLY="alloc nobacking qd32 slices space metadata chain"
    [ "$QUICK" = 1 ] || ONLY="$ONLY criterion"
fi
for d in $DEPTHS; do [[ $d =~ ^[1-9][0-9]*$ ]] || die "chain depth $d is not a positive integer"; done
OUT=${OUT:-$REPO/target/seeds/REPORT.md}
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
PLOT_DIR=$(dirname "$OUT")
QEMU_AIO=io_uring
ALLOC_QD=1

for tool in qemu-img qemu-io qemu-nbd fio cargo shuf python3; do
    command -v "$tool" >/dev/null || die "$tool is required but not installed"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio lacks the nbd engine (needs libnbd)"
# A 1000-deep chain is 1000 open files per server.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

build_binary

WORK=$(mktemp -d "$BENCH_DIR/qcow2-nbd-seeds.XXXXXX")
TMPW=""
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
    [ -z "$TMPW" ] || rm -rf "$TMPW"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
[ "$(stat -f -c %T "$WORK")" != tmpfs ] || die "$WORK is on tmpfs, where O_DIRECT fails; use --dir"
SOCK=$WORK/nbd.sock
RESULTS=$WORK/results.tsv
CLK_TCK=$(getconf CLK_TCK)
: >"$RESULTS"
NOTES=$WORK/notes.md # per-run remarks the report prints at the end
: >"$NOTES"
PLOT=$WORK/plot.tsv # plot, x, series, value (see seeds_plot.py)
: >"$PLOT"
note() { printf -- '- %s\n' "$*" >>"$NOTES"; }

CLUSTERS="4k 8k 16k 32k 64k 128k 256k 512k 1M 2M"
# The 2019 table (Alberto Garcia, qemu-devel, reply to Kevin Wolf, 27 Jun 2019): IOPS of 4 KiB
# random writes to an empty image over a fully written backing file, subclusters on / off.
# Its prototype split a cluster into 8 subclusters; the format that shipped has 32.
seed_alloc() { # CLUSTER on|off
    local t="4k:101:101 8k:299:420 16k:7555:3389 32k:13038:2476 64k:10613:1680 128k:4907:873
256k:2618:568 512k:1678:365 1M:863:212 2M:571:124" e c on off
    for e in $t; do
        IFS=: read -r c on off <<<"$e"
        [ "$c" = "$1" ] || continue
        if [ "$2" = on ]; then echo "$on"; else echo "$off"; fi
    done
}
# The slice patch's tables (QEMU commit "qcow2: Default to 4KB for the qcow2 cache entry
# size"): IOPS of 4 KiB random reads on fully populated 40 GB images. CLUSTER:CACHE:SLICE:IOPS.
SEED_SLICES="64k:1M:4k:6545 64k:3M:4k:12045 64k:5M:4k:55680 64k:1M:16k:5177 64k:3M:16k:9798
64k:5M:16k:56278 64k:1M:64k:2718 64k:3M:64k:5326 64k:5M:64k:57355
256k:512k:4k:8539 256k:1M:4k:21071 256k:1280k:4k:55417 256k:512k:64k:3598 256k:1M:64k:9772
256k:1280k:64k:57687 256k:512k:256k:1415 256k:1M:256k:4120 256k:1280k:256k:58001"

alloc_configs() { # every cluster size, extended L2 where the format allows it (>= 16 KiB)
    local c out=""
    for c in $CLUSTERS; do
        out+=" std-$c:$c:off"
        [ "$(bytes "$c")" -ge 16384 ] && out+=" ext-$c:$c:on"
    done
    echo "$out"
}

hs() { # bytes -> 512 B, 2 KiB, 1 MiB
    awk -v b="$1" 'BEGIN { if (b >= 1048576) printf "%g MiB", b / 1048576; else if (b >= 1024) printf "%g KiB", b / 1024; else printf "%d B", b }'
}
mib_of() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
fsname() { stat -f -c %T "$1"; }

# ---------------------------------------------------------------------------------------------
# 1. The headline: 4 KiB random writes, each to a fresh unit, into an empty ALLOC_GIB image
# over a fully written raw backing file, every cluster size, extended L2 off and on.
alloc_group() {
    ALLOC_CONFIGS=$(alloc_configs) ALLOC_BACKING_MIB=$((ALLOC_GIB << 10)) ALLOC_KEY=alloc \
        alloc_scenarios
}

# 2. The blog's caveat: the same without a backing file, on the scratch directory's file
# system (O_DIRECT) and on tmpfs (page cache: tmpfs has no O_DIRECT).
NOBACK_CONFIGS="std-4k:4k:off std-64k:64k:off ext-64k:64k:on ext-128k:128k:on std-2M:2M:off ext-2M:2M:on"
nobacking_group() {
    ALLOC_CONFIGS=$NOBACK_CONFIGS ALLOC_BACKING=none ALLOC_BACKING_MIB=$((ALLOC_GIB << 10)) \
        ALLOC_IOS=$NOBACK_IOS ALLOC_KEY="noback-disk" alloc_scenarios
    if [ "$(fsname "$TMPFS_DIR")" = tmpfs ]; then
        TMPW=$(mktemp -d "$TMPFS_DIR/qcow2-nbd-seeds.XXXXXX")
        ALLOC_CONFIGS=$NOBACK_CONFIGS ALLOC_BACKING=none ALLOC_BACKING_MIB=$((ALLOC_GIB << 10)) \
            ALLOC_IOS=$NOBACK_IOS ALLOC_KEY="noback-tmpfs" ALLOC_DIR=$TMPW ALLOC_CACHE=writeback \
            alloc_scenarios
        rm -rf "$TMPW"
        TMPW=""
    else
        note "no-backing table: $TMPFS_DIR is not a tmpfs, its rows were skipped"
    fi
}

# 2b. The seeds' case at queue depth: 4 KiB random writes at QD32 into an empty ALLOC_GIB image,
# standard 64 KiB clusters and extended L2 at 128 KiB and 2 MiB, with and without backing
# file, disk use after the run, and fio into a sparse raw file as the limit in the same rounds
# (qd32_scenarios in lib.sh).
qd32_group() {
    QD32_MIB=$((ALLOC_GIB << 10)) qd32_scenarios
}

# 3. L2 slices: 4 KiB random reads (QD1) on SLICE_GIB images whose every cluster holds data
# (preallocation=full writes the whole data area), the seed's cache sizes scaled by
# SLICE_GIB / 40 and rounded to whole slices; a cell whose cache holds fewer than two slices
# at this size is left out. Both servers read the same file read-only; our server exporting
# that file as raw is the limit (the same disk, no metadata at all).
slice_cache() { # SEED_CACHE SLICE -> the scaled cache in bytes, or nothing
    local s c
    s=$(bytes "$2")
    c=$(($(bytes "$1") * SLICE_GIB / 40))
    c=$(((c + s / 2) / s * s))
    [ "$c" -ge $((2 * s)) ] && echo "$c"
}

slices_group() {
    local cl img e c cache slice seed b r kind stats iops cpu disk hwm
    for cl in 64k 256k; do
        img=$WORK/slices-$cl.qcow2
        log "slices: writing a ${SLICE_GIB} GiB image with $cl clusters, every cluster holding data"
        qemu-img create -q -f qcow2 -o cluster_size="$cl",preallocation=full "$img" "${SLICE_GIB}G"
        for r in $(seq 1 "$ROUNDS"); do
            for e in $SEED_SLICES; do
                IFS=: read -r c cache slice seed <<<"$e"
                [ "$c" = "$cl" ] || continue
                b=$(slice_cache "$cache" "$slice") || continue
                for kind in $(order "$r"); do
                    start_server "$kind" "$img" l2="$b" slice="$slice" ro=1
                    stats=$(run_fio read --rw=randread --bs=4k --iodepth=1 \
                        --runtime="$RUNTIME" --time_based --ramp_time=1)
                    read -r iops _ _ cpu disk <<<"$stats"
                    hwm=$(hwm_mib)
                    stop_server
                    record "slice $cl $cache $slice" "$kind" "$iops"
                    record_usage "slice $cl $cache $slice" "$kind" "$cpu" "$disk"
                    record "hwm slice $cl $cache $slice" "$kind" "$hwm"
                    log "slices $cl cache $cache ($b B) slice $slice round $r $kind: $iops IOPS"
                done
            done
            start_server raw "$img" ro=1
            stats=$(run_fio read --rw=randread --bs=4k --iodepth=1 \
                --runtime="$RUNTIME" --time_based --ramp_time=1)
            read -r iops _ _ cpu disk <<<"$stats"
            hwm=$(hwm_mib)
            stop_server
            record "slice $cl raw" raw "$iops"
            record "hwm slice $cl raw" raw "$hwm"
            log "slices $cl raw limit round $r: $iops IOPS"
        done
        rm -f "$img"
    done
}

# 4. Space: SPACE_MB MiB of 4 KiB random writes (QD16, a fixed seed: the same offsets for both
# servers) into an empty image of 40 GiB * SPACE_MB / 100 without backing file; the image's
# size and its disk use afterwards, every cluster size, extended L2 off and on.
space_group() {
    local size=$(((40 << 30) / 100 * SPACE_MB / 1048576 * 1048576)) cfg label cl ext kind hwm
    for cfg in $(alloc_configs); do
        IFS=: read -r label cl ext <<<"$cfg"
        for kind in qemu ours; do
            qemu-img create -q -f qcow2 -o cluster_size="$cl",extended_l2="$ext" \
                "$WORK/space.qcow2" "$size"
            start_server "$kind" "$WORK/space.qcow2"
            run_fio write --rw=randwrite --bs=4k --iodepth=16 --io_size="${SPACE_MB}M" \
                --size="$size" --randseed=32 >/dev/null
            hwm=$(hwm_mib)
            stop_server
            record "space size $label" "$kind" "$(stat -c %s "$WORK/space.qcow2")"
            record "space du $label" "$kind" "$(($(stat -c '%b * %B' "$WORK/space.qcow2")))"
            record "hwm space $label" "$kind" "$hwm"
            log "space $label $kind: $(stat -c '%s bytes, %b blocks' "$WORK/space.qcow2")"
            rm -f "$WORK/space.qcow2"
        done
    done
}

# 5. Metadata for 1 TiB: `measure` (fully allocated size minus the guest size) by both tools,
# and the L2 tables that map the whole disk (what a cache must hold to cover it).
metadata_group() {
    local cfg label cl ext q o
    for cfg in $(alloc_configs); do
        IFS=: read -r label cl ext <<<"$cfg"
        q=$(qemu-img measure --size 1T -O qcow2 -o cluster_size="$cl",extended_l2="$ext" |
            awk '/fully allocated size/ { print $4 }')
        o=$("$BIN" measure --size 1T -O qcow2 -o cluster_size="$cl",extended_l2="$ext" |
            awk '/fully allocated size/ { print $4 }')
        record "meta $label" qemu $((q - (1 << 40)))
        record "meta $label" ours $((o - (1 << 40)))
    done
}

# 6. Chains at each depth of DEPTHS, the same CHAIN_MIB of guest data in each: per server, a
# fresh start (peak RSS idle), a full sequential read to fill the metadata caches, the host
# page cache dropped, a second full read (the timed one, as the seed's), the peak RSS after;
# our server exporting the same data as a raw file is the limit. Streaming: `convert` of the
# whole chain to a new qcow2 image, qemu-img against ours, wall time and peak RSS.
peak_run() { # CMD...: prints "wall_s cpu_s peak_rss_mib" of CMD (python3, no extra package)
    python3 -c 'import resource, subprocess, sys, time
t = time.monotonic()
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
w = time.monotonic() - t
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print("%.3f %.3f %.1f" % (w, r.ru_utime + r.ru_stime, r.ru_maxrss / 1024))
if rc < 0:
    print("%s: killed by signal %d" % (sys.argv[1], -rc), file=sys.stderr)
sys.exit(1 if rc else 0)' "$@"
}

drop_page_cache() {
    if [ "$DROP_CACHES" = 1 ] && [ -w /proc/sys/vm/drop_caches ]; then
        sync
        echo 1 >/proc/sys/vm/drop_caches 2>/dev/null && return 0
    fi
    return 1
}

# server_failed SCENARIO KIND: the running server died or failed a request; records it, notes
# how it ended (a signal shows as 128 + its number) and its last log line.
server_failed() {
    local rc=0
    if kill -0 "$SERVER_PID" 2>/dev/null; then kill -TERM "$SERVER_PID" 2>/dev/null || true; fi
    wait "$SERVER_PID" 2>/dev/null || rc=$?
    SERVER_PID=""
    record "fail $1" "$2" 1
    local last
    last=$(tail -n 1 "$WORK/server.log" | cut -c1-200)
    note "$1: the $2 server failed (exit status $rc$([ "$rc" -gt 128 ] && echo ", signal $((rc - 128))"))${last:+: $last}"
    log "$1 $2: the server failed (exit status $rc)"
}

chain_group() {
    local size=$((CHAIN_MIB << 20)) depth r kind img stats ms cpu idle after dropped=0 t
    for depth in $DEPTHS; do
        log "chain: building depth $depth ($CHAIN_MIB MiB)"
        build_chain "$WORK/chain$depth" "$depth" "$CHAIN_MIB"
    done
    qemu-img convert -f qcow2 -O raw "$WORK/chain${DEPTHS%% *}/top.qcow2" "$WORK/chain.raw"
    for r in $(seq 1 "$ROUNDS"); do
        for depth in $DEPTHS raw; do
            local kinds
            if [ "$depth" = raw ]; then kinds=raw img=$WORK/chain.raw; else
                kinds=$(order "$r") img=$WORK/chain$depth/top.qcow2; fi
            for kind in $kinds; do
                start_server "$kind" "$img" ro=1
                sleep 0.3
                idle=$(hwm_mib)
                # A server that dies under the load (qemu-nbd has crashed on deep chains) is
                # a result, not a reason to stop: it is recorded and the next run goes on.
                if stats=$(run_fio read --rw=read --bs=1M --iodepth=1 --size="$size") &&
                    { drop_page_cache && dropped=1 || true; } &&
                    stats=$(run_fio read --rw=read --bs=1M --iodepth=1 --size="$size"); then
                    read -r _ _ ms cpu _ <<<"$stats"
                    after=$(hwm_mib)
                    stop_server
                    record "chain $depth reread ms" "$kind" "$ms"
                    record "cpu chain $depth reread ms" "$kind" "$cpu"
                    record "hwm chain $depth idle" "$kind" "$idle"
                    record "hwm chain $depth read" "$kind" "$after"
                    log "chain $depth round $r $kind: re-read $ms ms, peak RSS idle $idle MiB, after $after MiB"
                else
                    server_failed "chain $depth" "$kind"
                fi
            done
        done
        for depth in $DEPTHS; do
            for kind in $(order "$r"); do
                rm -f "$WORK/stream.qcow2"
                local tool=("$BIN" convert -q)
                [ "$kind" = qemu ] && tool=(qemu-img convert)
                if ! t=$(peak_run "${tool[@]}" -f qcow2 -O qcow2 "$WORK/chain$depth/top.qcow2" \
                    "$WORK/stream.qcow2" 2>"$WORK/stream.err"); then
                    note "stream $depth: ${tool[*]} failed in round $r: $(tail -c 300 "$WORK/stream.err" | tr '\n' ' ')"
                    record "fail stream $depth" "$kind" 1
                    log "stream $depth round $r $kind: failed"
                    continue
                fi
                [ "$r" != 1 ] || qemu-img compare -q "$WORK/chain.raw" "$WORK/stream.qcow2" ||
                    die "convert of the depth-$depth chain by $kind differs from the chain"
                read -r wall _ hwm <<<"$t"
                record "stream $depth ms" "$kind" "$(awk -v w="$wall" 'BEGIN { printf "%.0f", w * 1000 }')"
                record "hwm stream $depth" "$kind" "$hwm"
                log "stream $depth round $r $kind: $wall s, peak RSS $hwm MiB"
            done
        done
    done
    if [ "$dropped" = 1 ]; then
        note "chain: the host page cache was dropped (drop_caches=1) between the two reads"
    else
        note "chain: the host page cache was NOT dropped between the two reads (not permitted or --no-drop-caches); both servers read with O_DIRECT, so only the file system's metadata stays cached"
    fi
    rm -rf "$WORK"/chain* "$WORK/stream.qcow2"
}

# 7. The criterion benches: the engine in-process, without NBD or a second server; criterion's
# medians of this run only (it keeps older results beside them).
CRITERION=$WORK/criterion.md
criterion_group() {
    local since
    since=$(date +%s)
    log "criterion: cargo bench (engine_alloc engine_l2_cache engine_chain engine_threads)"
    if ! (cd "$REPO" && cargo bench --bench engine_alloc --bench engine_l2_cache \
        --bench engine_chain --bench engine_threads) >"$WORK/criterion.log" 2>&1; then
        note "criterion: cargo bench failed: $(grep -m1 -E 'error|panicked' "$WORK/criterion.log")"
        return
    fi
    python3 "$REPO/benches/criterion_table.py" "$REPO/target/criterion" "$since" >"$CRITERION" ||
        note "criterion: no results were written"
}

# ---------------------------------------------------------------------------------------------
START=$(date +%s)
# The commit measured, taken before the run (the checkout may move while it runs).
COMMIT="$(git -C "$REPO" rev-parse --short HEAD)$(git -C "$REPO" diff --quiet HEAD -- . 2>/dev/null || echo "+changes")"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for group in $ONLY; do
    case $group in
    alloc) alloc_group ;; nobacking) nobacking_group ;; slices) slices_group ;;
    space) space_group ;; metadata) metadata_group ;; chain) chain_group ;;
    criterion) criterion_group ;; qd32) qd32_group ;;
    *) die "unknown group $group (alloc nobacking qd32 slices space metadata chain criterion)" ;;
    esac
done
ELAPSED=$(($(date +%s) - START))
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------------------------------------
# The report. Medians of the recorded rounds; "q / o" cells are qemu-nbd (or qemu-img) / ours.
m() { median "$1" "$2"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/ || b == 0) print "-"; else printf "%.2f\n", a / b }'; }
plot() { [ "$4" = - ] || printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$PLOT"; }
BEHIND=$WORK/behind.md # rows where ours is slower or larger, for the closing list
: >"$BEHIND"
behind() { printf -- '- %s\n' "$*" >>"$BEHIND"; }
# rss_cell KEY: "qemu / ours" peak RSS in MiB, ours marked when above qemu-nbd's.
rss_cell() {
    local q o
    q=$(m "hwm $1" qemu) o=$(m "hwm $1" ours)
    if awk -v q="$q" -v o="$o" 'BEGIN { exit !(q != "-" && o != "-" && o > q) }'; then
        behind "peak RSS, $1: ours $o MiB > qemu-nbd $q MiB"
        printf '%s / **%s**' "$q" "$o"
    else printf '%s / %s' "$q" "$o"; fi
}
check_rate() { # LABEL QEMU OURS: notes a row where our rate is below 0.95 of qemu-nbd's
    awk -v q="$2" -v o="$3" 'BEGIN { exit !(q != "-" && o != "-" && o < 0.95 * q) }' &&
        behind "$1: ours $3 < qemu-nbd $2" || true
}

alloc_table() { # KEY TITLE
    local key=$1 cfg label cl ext q o unit seed raw
    raw=$(m "$key raw" raw)
    echo "| cluster | ext. L2 | unit | seed 2019 | qemu-nbd | ours | ours/qemu | raw limit | CPU µs/req q / o | peak RSS MiB q / o |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    for cfg in ${ALLOC_CONFIGS_SHOWN:-$(alloc_configs)}; do
        IFS=: read -r label cl ext <<<"$cfg"
        q=$(m "$key $label" qemu) o=$(m "$key $label" ours)
        [ "$q$o" = -- ] && continue
        unit=$(hs "$(bytes "$cl")")
        [ "$ext" = on ] && unit=$(hs $(($(bytes "$cl") / 32)))
        seed=-
        [ "$key" = alloc ] && seed=$(seed_alloc "$cl" "$ext")
        echo "| $cl | $ext | $unit | $seed | $q | $o | $(ratio "$o" "$q") | $raw | $(m "cpu $key $label" qemu) / $(m "cpu $key $label" ours) | $(rss_cell "$key $label") |"
        check_rate "$key $label IOPS" "$q" "$o"
        plot "$key" "$cl" "qemu-nbd ext_l2=$ext" "$q"
        plot "$key" "$cl" "ours ext_l2=$ext" "$o"
        [ "$seed" = - ] || plot "$key" "$cl" "seed 2019 subclusters=$ext" "$seed"
    done
}

slice_table() { # CLUSTER
    local cl=$1 e c cache slice seed q o b
    echo "| L2 cache (seed) | used here | slice | seed IOPS | qemu-nbd | ours | ours/qemu | raw limit | CPU µs/req q / o | peak RSS MiB q / o |"
    echo "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    for e in $SEED_SLICES; do
        IFS=: read -r c cache slice seed <<<"$e"
        [ "$c" = "$cl" ] || continue
        b=$(slice_cache "$cache" "$slice") || b=""
        q=$(m "slice $cl $cache $slice" qemu) o=$(m "slice $cl $cache $slice" ours)
        if [ -z "$b" ]; then
            echo "| $cache | fewer than 2 slices at ${SLICE_GIB} GiB | $slice | $seed | - | - | - | - | - | - |"
            continue
        fi
        echo "| $cache | $(awk -v b="$b" 'BEGIN { printf "%g KiB", b / 1024 }') | $slice | $seed | $q | $o | $(ratio "$o" "$q") | $(m "slice $cl raw" raw) | $(m "cpu slice $cl $cache $slice" qemu) / $(m "cpu slice $cl $cache $slice" ours) | $(rss_cell "slice $cl $cache $slice") |"
        check_rate "slices $cl cache $cache slice $slice IOPS" "$q" "$o"
        plot "slices-$cl" "$cache/$slice" "seed (40 GB)" "$seed"
        plot "slices-$cl" "$cache/$slice" qemu-nbd "$q"
        plot "slices-$cl" "$cache/$slice" ours "$o"
    done
}

{
    echo "# The seeds' study, reproduced"
    echo
    echo "\`benches/seeds.sh$([ "$QUICK" = 1 ] && echo " --quick")\`, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT, ${ELAPSED} s."
    echo "$(nproc) CPUs, Linux $(uname -r), scratch on $(fsname "$WORK") ($BENCH_DIR), qemu-nbd $(qemu-nbd --version | head -1 | awk '{print $2}'),"
    echo "load average $LOAD_START at the start and $LOAD_END at the end. Rounds $ROUNDS, fio runs ${RUNTIME} s + 1 s ramp-up,"
    echo "allocation images ${ALLOC_GIB} GiB ($ALLOC_IOS writes per run, $NOBACK_IOS without backing), slice images ${SLICE_GIB} GiB,"
    echo "space table ${SPACE_MB} MiB of writes, chains of ${CHAIN_MIB} MiB at depths $DEPTHS."
    echo
    echo "Every cell is the median of alternating rounds (qemu-nbd first in odd rounds, ours first in even"
    echo "ones), each server started fresh per run, both with \`cache=none\` (O_DIRECT) and io_uring unless a"
    echo "section says otherwise. CPU µs/req: the server's CPU time (all threads) per request, from"
    echo "/proc/PID/stat. Peak RSS: the server's VmHWM at the end of the run; **bold** where ours is the"
    echo "higher. raw limit: our server exporting a raw file on the same storage (no qcow2 metadata)."
    [ "$QUICK" = 1 ] && echo && echo "Quick mode: sizes far below the seeds', one round; a smoke test of the method, not a measurement to quote."
    case " $ONLY " in *" alloc "*)
        echo
        echo "## Cluster and subcluster allocation with a backing file"
        echo
        echo "Seed: 4 KiB random writes to an empty 40 GB image over a fully populated backing file"
        echo "(qemu-devel, 27 Jun 2019; the blog post's chart, QEMU 5.2). \"Performance collapses for small"
        echo "cluster sizes, but it reaches record highs for small subclusters.\" The seed's prototype had 8"
        echo "subclusters per cluster (its 64 KiB row used 8 KiB subclusters), the format has 32 (64 KiB"
        echo "clusters have 2 KiB subclusters; extended L2 needs clusters of 16 KiB or more). Here: an"
        echo "empty ${ALLOC_GIB} GiB overlay over a fully written raw backing file, $ALLOC_IOS writes of 4 KiB,"
        echo "each to a fresh allocation unit (cluster or subcluster, at least 4 KiB), QD1, the same order"
        echo "for both servers. Limit: 4 KiB random writes to the raw backing file."
        echo
        alloc_table alloc
        ;;
    esac
    case " $ONLY " in *" nobacking "*)
        echo
        echo "## Allocation without a backing file"
        echo
        echo "Seed (blog): \"If the image does not have a backing file chances are that the allocation"
        echo "performance is equally fast, with or without extended L2 entries. This depends on the"
        echo "filesystem.\" The talk: QEMU fills the rest of a new cluster with fallocate where the file"
        echo "system supports it. Neither qemu-nbd nor our server has a switch to turn that off, so the"
        echo "two file systems stand for the two paths as far as they differ. $NOBACK_IOS writes per run into"
        echo "an empty ${ALLOC_GIB} GiB image. Limit: 4 KiB random writes into a sparse raw file on the same file system."
        echo
        echo "### $(fsname "$WORK") ($BENCH_DIR), cache=none"
        echo
        ALLOC_CONFIGS_SHOWN=$NOBACK_CONFIGS alloc_table noback-disk
        echo
        echo "### tmpfs ($TMPFS_DIR), cache=writeback (tmpfs has no O_DIRECT)"
        echo
        ALLOC_CONFIGS_SHOWN=$NOBACK_CONFIGS alloc_table noback-tmpfs
        ;;
    esac
    case " $ONLY " in *" qd32 "*)
        echo
        echo "## Allocation at queue depth 32, against the disk's limit"
        echo
        echo "The seeds' point is that subclusters make images both faster and smaller. Here at QD32:"
        echo "$QD32_IOS writes of 4 KiB, each to a fresh allocation unit, into an empty ${ALLOC_GIB} GiB image"
        echo "(the same order for both servers), without backing file and over a fully written raw one."
        echo "Limit: fio writing as many random 4 KiB blocks (io_uring, O_DIRECT, QD32) into a fresh sparse"
        echo "raw file whose length was set first, in the same rounds. Disk use: the image after the run."
        echo "Over a backing file each write must write its whole allocation unit (the bytes copied around"
        echo "its own 4 KiB): where that unit is above 4 KiB, the unit-sized limit is fio writing as many"
        echo "blocks of that size the same way, and the copy limit fio reading as many unit-sized blocks"
        echo "of the backing file while it writes them (QD16 each), pairs per second. The limit through"
        echo "NBD is our server exporting a fresh sparse raw file, the same writes by the same client."
        echo
        QD32_MIB=$((ALLOC_GIB << 10)) qd32_table
        for cfg in $QD32_CONFIGS; do
            IFS=: read -r label _ _ <<<"$cfg"
            for mode in $QD32_MODES; do
                check_rate "qd32 $label $mode IOPS" "$(m "qd32 $label $mode" qemu)" "$(m "qd32 $label $mode" ours)"
                awk -v q="$(m "du qd32 $label $mode" qemu)" -v o="$(m "du qd32 $label $mode" ours)" \
                    'BEGIN { exit !(q != "-" && o != "-" && o > q) }' &&
                    behind "qd32 $label $mode disk use: ours $(m "du qd32 $label $mode" ours) MiB > qemu-nbd $(m "du qd32 $label $mode" qemu) MiB" || true
            done
        done
        ;;
    esac
    case " $ONLY " in *" slices "*)
        echo
        echo "## L2 cache slices"
        echo
        echo "Seed: QEMU commit \"qcow2: Default to 4KB for the qcow2 cache entry size\": 4 KiB random reads"
        echo "on fully populated 40 GB images; smaller slices are faster unless the cache holds every L2"
        echo "table (the last column). Here: ${SLICE_GIB} GiB images made with \`preallocation=full\` (every"
        echo "cluster holds data on disk), QD1, ${RUNTIME} s per run, the seed's cache sizes scaled by"
        echo "${SLICE_GIB}/40 to cover the same share of the tables, rounded to whole slices."
        echo
        echo "### 64 KiB clusters"
        echo
        slice_table 64k
        echo
        echo "### 256 KiB clusters"
        echo
        slice_table 256k
        ;;
    esac
    case " $ONLY " in *" space "*)
        local_size=$(((40 << 30) / 100 * SPACE_MB / 1048576))
        echo
        echo "## Image size after random writes"
        echo
        echo "Seed (talk): 100 MB of 4 KiB random writes into an empty image give a 1.6 GB image with 64 KiB"
        echo "clusters and 29 GB with 2 MiB clusters (the figures fit a 40 GB image); with subclusters \"the end"
        echo "result is much much smaller\". Here: ${SPACE_MB} MiB of 4 KiB random writes (QD16, the same offsets"
        echo "for both servers) into an empty ${local_size} MiB image without backing file; the file's"
        echo "size and its disk use (allocated blocks) afterwards, in MB (10^6 bytes). Seed figures are"
        echo "scaled by ${SPACE_MB}/100 where given."
        echo
        echo "| cluster | ext. L2 | seed (scaled) | size qemu-nbd | size ours | disk use qemu-nbd | disk use ours | peak RSS MiB q / o |"
        echo "|---|---|---:|---:|---:|---:|---:|---:|"
        for cfg in $(alloc_configs); do
            IFS=: read -r label cl ext <<<"$cfg"
            sq=$(m "space size $label" qemu) so=$(m "space size $label" ours)
            [ "$sq$so" = -- ] && continue
            seed=-
            [ "$cl$ext" = 64koff ] && seed=$(awk -v s="$SPACE_MB" 'BEGIN { printf "%.1f", 1600 * s / 100 }')
            [ "$cl$ext" = 2Moff ] && seed=$(awk -v s="$SPACE_MB" 'BEGIN { printf "%.1f", 29000 * s / 100 }')
            mb() { awk -v b="$1" 'BEGIN { if (b == "-") print "-"; else printf "%.1f", b / 1e6 }'; }
            echo "| $cl | $ext | $seed | $(mb "$sq") | $(mb "$so") | $(mb "$(m "space du $label" qemu)") | $(mb "$(m "space du $label" ours)") | $(rss_cell "space $label") |"
            awk -v q="$sq" -v o="$so" 'BEGIN { exit !(o > 1.05 * q) }' && behind "space $label: our image $so B > qemu-nbd's $sq B" || true
        done
        ;;
    esac
    case " $ONLY " in *" metadata "*)
        echo
        echo "## Metadata for 1 TiB"
        echo
        echo "Seed (blog and talk): extended L2 gives \"sixteen times less metadata per unit of allocation\";"
        echo "a 1 TB image needs 128 MB of L2 cache with 64 KiB clusters and 8 MB with 2 MiB clusters of"
        echo "64 KiB subclusters. Here: \`measure --size 1T\` by both tools (fully allocated size minus"
        echo "1 TiB: L1, L2 and refcount metadata), and the L2 tables mapping the whole disk (the cache"
        echo "needed to cover it: one 8-byte entry per cluster, 16 bytes with extended L2)."
        echo
        echo "| cluster | ext. L2 | unit | seed L2 cache | L2 to cover 1 TiB | L2 bytes per unit | measure metadata qemu-img | measure metadata ours |"
        echo "|---|---|---:|---:|---:|---:|---:|---:|"
        for cfg in $(alloc_configs); do
            IFS=: read -r label cl ext <<<"$cfg"
            b=$(bytes "$cl")
            if [ "$ext" = on ]; then entry=16 unitb=$((b / 32)) per=0.5; else entry=8 unitb=$b per=8; fi
            seed=-
            [ "$cl$ext" = 64koff ] && seed="128 MB"
            [ "$cl$ext" = 2Mon ] && seed="8 MB"
            echo "| $cl | $ext | $(hs "$unitb") | $seed | $(mib_of $(((1 << 40) / b * entry))) MiB | $per | $(mib_of "$(m "meta $label" qemu)") MiB | $(mib_of "$(m "meta $label" ours)") MiB |"
        done
        ;;
    esac
    case " $ONLY " in *" chain "*)
        echo
        echo "## Backing chains"
        echo
        echo "Seed (qcow2 meeting, 2020): a VM reads its whole disk to fill the caches, drops its page"
        echo "cache and reads it again: 33 s at chain length 1, 53 s at 300; peak RSS grows with the chain;"
        echo "streaming the chain: 0.61 GB of peak RSS at length 1, 1.14 GB at 300. Here: chains of ${CHAIN_MIB} MiB"
        echo "with 64 KiB clusters, layer k holding every cluster i with i % depth = k (the same guest data"
        echo "at every depth). Re-read: a full sequential read (1 MiB, QD1) to fill the caches, the host"
        echo "page cache dropped, the timed second full read. Peak RSS idle: just started; after: after"
        echo "both reads. Streaming: \`convert -O qcow2\` of the chain's top, qemu-img against ours."
        echo
        echo "| depth | re-read ms qemu-nbd | ours | qemu/ours | raw limit | CPU µs/req q / o | peak RSS idle q / o | after reads q / o | stream ms qemu-img / ours | stream peak RSS q / o |"
        echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        for depth in $DEPTHS; do
            q=$(m "chain $depth reread ms" qemu) o=$(m "chain $depth reread ms" ours)
            # A server that failed every round shows as such (the notes say how).
            [ "$q" = - ] && [ "$(m "fail chain $depth" qemu)" != - ] && q="failed"
            [ "$o" = - ] && [ "$(m "fail chain $depth" ours)" != - ] && o="failed" && behind "chain $depth: our server failed"
            sq=$(m "stream $depth ms" qemu) so=$(m "stream $depth ms" ours)
            [ "$sq" = - ] && [ "$(m "fail stream $depth" qemu)" != - ] && sq="failed"
            [ "$so" = - ] && [ "$(m "fail stream $depth" ours)" != - ] && so="failed" && behind "stream $depth: our convert failed"
            echo "| $depth | $q | $o | $(ratio "$q" "$o") | $(m "chain raw reread ms" raw) | $(m "cpu chain $depth reread ms" qemu) / $(m "cpu chain $depth reread ms" ours) | $(rss_cell "chain $depth idle") | $(rss_cell "chain $depth read") | $sq / $so | $(rss_cell "stream $depth") |"
            awk -v q="$q" -v o="$o" 'BEGIN { exit !(q ~ /^[0-9.]+$/ && o ~ /^[0-9.]+$/ && o > 1.05 * q) }' && behind "chain $depth re-read: ours $o ms > qemu-nbd $q ms" || true
            awk -v q="$sq" -v o="$so" 'BEGIN { exit !(q ~ /^[0-9.]+$/ && o ~ /^[0-9.]+$/ && o > 1.05 * q) }' && behind "stream $depth: ours $so ms > qemu-img $sq ms" || true
            plot chain-time "depth $depth" "qemu-nbd re-read" "$q"
            plot chain-time "depth $depth" "ours re-read" "$o"
            plot chain-time "depth $depth" "qemu-img convert" "$(m "stream $depth ms" qemu)"
            plot chain-time "depth $depth" "ours convert" "$(m "stream $depth ms" ours)"
            plot chain-rss "depth $depth" "qemu-nbd idle" "$(m "hwm chain $depth idle" qemu)"
            plot chain-rss "depth $depth" "ours idle" "$(m "hwm chain $depth idle" ours)"
            plot chain-rss "depth $depth" "qemu-nbd after reads" "$(m "hwm chain $depth read" qemu)"
            plot chain-rss "depth $depth" "ours after reads" "$(m "hwm chain $depth read" ours)"
            plot chain-rss "depth $depth" "qemu-img convert" "$(m "hwm stream $depth" qemu)"
            plot chain-rss "depth $depth" "ours convert" "$(m "hwm stream $depth" ours)"
        done
        echo
        echo "CPU µs/req: the server's CPU time per 1 MiB request of the timed read. Peak RSS in MiB."
        ;;
    esac
    case " $ONLY " in *" criterion "*)
        echo
        echo "## Criterion benches (the engine in-process, no NBD)"
        echo
        echo "\`cargo bench\` of engine_alloc (4 KiB random allocating writes over a backing file), engine_l2_cache"
        echo "(4 KiB random reads, L2 cache and slice sizes), engine_chain (a full read of a chain) and"
        echo "engine_threads (requests on one and several threads): criterion's medians, ours only."
        echo
        if [ -s "$CRITERION" ]; then cat "$CRITERION"; else echo "Not measured: see the notes."; fi
        ;;
    esac
    echo
    echo "## Where ours is behind"
    echo
    if [ -s "$BEHIND" ]; then cat "$BEHIND"; else echo "Nowhere in this run (rates within 5%, times and sizes within 5%, peak RSS not above)."; fi
    if [ -s "$NOTES" ]; then
        echo
        echo "## Notes"
        echo
        cat "$NOTES"
    fi
    echo
    echo "## Plots"
    echo
    for f in alloc noback-disk noback-tmpfs slices-64k slices-256k chain-time chain-rss; do
        grep -q "^$f	" "$PLOT" && echo "![$f]($f.svg)"
    done
} >"$OUT"

python3 "$REPO/benches/seeds_plot.py" "$PLOT" "$PLOT_DIR"
if [ "$QUICK" = 0 ] && [ -s "$CRITERION" ]; then
    python3 "$REPO/benches/criterion_table.py" "$REPO/target/criterion" "$START" \
        --results "$REPO/benches/RESULTS.md" --stamp "Measured by \`benches/seeds.sh\` on \
$(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT, $(nproc) CPUs, load \
average $LOAD_START at the start of the run and $LOAD_END at its end." >/dev/null
    log "benches/RESULTS.md: criterion table rewritten"
fi
cp "$RESULTS" "${OUT%.md}.tsv"
log "report: $OUT (plots and raw results beside it), ${ELAPSED} s"
