#!/usr/bin/env bash
# Side by side with qemu-nbd: builds the release binary, makes images with qemu-img,
# serves identical copies with `qemu-nbd` and `qcow2-nbd serve` under equivalent settings
# (O_DIRECT, io_uring, the same cache sizes), drives both with `fio --ioengine=nbd` in
# alternating rounds (A B, B A, ...; medians), measures a raw file exported by our own server as
# the physical limit, and prints a markdown table.
#
#   benches/compare.sh            # full run, about 25 minutes on 2 cores
#   QUICK=1 benches/compare.sh    # smoke run, about 3 minutes (1 round, short runs)
#
# Every server runs on a Unix socket and is started fresh for each measurement, so each run
# starts with cold metadata caches and the peak RSS (VmHWM) belongs to that run alone.
#
# Environment (defaults in brackets; QUICK=1 changes the defaults marked *):
#   ROUNDS [3*]          alternating rounds per scenario (the median is reported)
#   RUNTIME [6*]         seconds per time-based fio run (plus 1 s of ramp-up)
#   ALLOC_BACKING_MIB [2048*]  fully written raw backing file of the allocation scenarios
#   ALLOC_IOS [3000*]    allocating writes per run (capped by the units the image has)
#   ALLOC_QD [1]         queue depth of the allocation runs
#   DATA_MIB [1024*]     allocated image for random/sequential I/O
#   L2_GIB [40]          image of the L2-cache table (64 KiB clusters, preallocation=metadata:
#                        40 GiB needs 5 MiB of L2 tables)
#   L2_RUNTIME [4*]      seconds per L2-cache run
#   CHAIN_MIB [256*]     guest size of the chain images
#   CHAIN_DEPTH [300]    depth of the long chain
#   CLEAN_INTERVAL [2]   cache-clean-interval (seconds) of the RSS scenario
#   RSS_L2_CACHE [4M]    l2-cache-size of the RSS scenario
#   BENCH_DIR [/var/tmp] where the scratch directory goes (not a tmpfs: O_DIRECT)
#   QEMU_AIO [io_uring]  qemu-nbd --aio mode (io_uring or native)
#   CARGO_TARGET_DIR     where cargo builds (default: target/ in the repository)
#   SKIP_BUILD=1         use the existing release binary
#   QCOW2_NBD_BIN        the server binary to measure (default: the release build)
#   TLS_PORT [10899]     loopback TCP port of the tls group (must be free)
#   QD32_MIB [16384]     image of the qd32 group (its backing file, fully written, takes as much disk)
#   QD32_IOS [20000*]    allocating writes per qd32 run
#   QD32_CONFIGS, QD32_MODES   the qd32 group's rows (see benches/lib.sh)
#   ONLY="alloc alloc32 qd32 mt metrics io bitmap l2 chain rss tls tools"   run a subset of the groups
#   MT_MIB [1024]        image of the mt and metrics groups (on TOOLS_DIR, a tmpfs)
#   METRICS_PORT [10900] loopback TCP port of our --metrics endpoint in the metrics group
#   TOOLS_DIR [/dev/shm], TOOLS_MIB [2048]   where and how big the tools group's images are
#   TOOLS_ROUNDS [7*]    rounds of the quick tool rows (convert -c keeps ROUNDS)
#
# The tls group serves over TCP loopback (127.0.0.1:TLS_PORT) instead of the Unix socket, with
# x509 credentials that it makes with GnuTLS certtool (gnutls-bin), and needs nbdinfo
# (libnbd-bin) to check them: `ONLY=tls benches/compare.sh`.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$REPO/benches/lib.sh"
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then
    d_rounds=1 d_runtime=2 d_alloc_mib=512 d_alloc_ios=600 d_data_mib=256 d_l2_runtime=2
    d_chain_mib=64 d_qd32_ios=5000
else
    d_rounds=3 d_runtime=6 d_alloc_mib=2048 d_alloc_ios=3000 d_data_mib=1024 d_l2_runtime=4
    d_chain_mib=256 d_qd32_ios=20000
fi
ROUNDS=${ROUNDS:-$d_rounds}
RUNTIME=${RUNTIME:-$d_runtime}
ALLOC_BACKING_MIB=${ALLOC_BACKING_MIB:-$d_alloc_mib}
ALLOC_IOS=${ALLOC_IOS:-$d_alloc_ios}
ALLOC_QD=${ALLOC_QD:-1}
DATA_MIB=${DATA_MIB:-$d_data_mib}
L2_GIB=${L2_GIB:-40}
L2_RUNTIME=${L2_RUNTIME:-$d_l2_runtime}
CHAIN_MIB=${CHAIN_MIB:-$d_chain_mib}
CHAIN_DEPTH=${CHAIN_DEPTH:-300}
CLEAN_INTERVAL=${CLEAN_INTERVAL:-2}
RSS_L2_CACHE=${RSS_L2_CACHE:-4M}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
QEMU_AIO=${QEMU_AIO:-io_uring}
TLS_PORT=${TLS_PORT:-10899}
QD32_MIB=${QD32_MIB:-16384}
QD32_IOS=${QD32_IOS:-$d_qd32_ios}
ONLY=${ONLY:-"alloc alloc32 qd32 mt metrics io bitmap l2 chain rss tls tools"}
METRICS_PORT=${METRICS_PORT:-10900}

for tool in qemu-img qemu-io qemu-nbd fio cargo shuf; do
    command -v "$tool" >/dev/null || die "$tool is required but not installed"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio lacks the nbd engine (needs libnbd)"
case " $ONLY " in *" tls "*)
    for tool in certtool nbdinfo ss; do
        command -v "$tool" >/dev/null || die "$tool is required by the tls group but not installed"
    done ;;
esac

# ---------------------------------------------------------------------------------------------
# Build
build_binary

# ---------------------------------------------------------------------------------------------
# Scratch space and cleanup: no server and no image outlives the script.
WORK=$(mktemp -d "$BENCH_DIR/qcow2-nbd-compare.XXXXXX")
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "$(stat -f -c %T "$WORK")" = tmpfs ]; then
    die "$WORK is on tmpfs, where O_DIRECT fails; set BENCH_DIR"
fi
SOCK=$WORK/nbd.sock
RESULTS=$WORK/results.tsv
CLK_TCK=$(getconf CLK_TCK)
: >"$RESULTS"

# ---------------------------------------------------------------------------------------------
# 1. Allocation (alloc_scenarios in lib.sh): 4 KiB writes into an empty overlay over a fully
# written raw backing file, each to a fresh allocation unit, the same order for both servers.
ALLOC_CONFIGS="std-64k:64k:off std-128k:128k:off std-2m:2M:off ext-64k/2k:64k:on
ext-128k/4k:128k:on ext-256k/8k:256k:on ext-2m/64k:2M:on"

# alloc32: the same allocating writes at queue depth 32, standard and extended L2 64 KiB.
alloc32_scenarios() {
    ALLOC_CONFIGS="std-64k:64k:off ext-64k/2k:64k:on" ALLOC_QD=32 ALLOC_KEY="alloc32" \
        alloc_scenarios
}

# qd32: allocation at QD32 into an empty QD32_MIB image, standard 64 KiB and extended L2
# 128 KiB/4 KiB and 2 MiB/64 KiB, with and without backing file, with disk use after the run
# and fio into a sparse raw file as the limit in the same rounds (qd32_scenarios in lib.sh).

# ---------------------------------------------------------------------------------------------
# 1b. CPU-bound: a fully written image on tmpfs (no disk wait at all), 4 connections x QD16
# of 4 KiB random reads and writes (fio numjobs=4, one NBD connection each), both servers
# multi-conn (-e 0) with the page cache (cache=writeback) and io_uring; ours with one thread
# and with two (--threads 2). The raw column is our server on the raw data, one thread.
MT_SCENARIOS="randread:read randwrite:write"
MT_MIB=${MT_MIB:-1024}

mt_scenarios() {
    local d=$TOOLS_DIR/qcow2-nbd-mt.$$ r kind sc label dir stats iops cpu disk
    mkdir -p "$d"
    log "tmpfs: writing a ${MT_MIB} MiB image in $d"
    fio --name=fill --filename="$d/data.raw" --rw=write --bs=1M --size="$((MT_MIB << 20))" \
        --refill_buffers --output-format=terse >/dev/null
    qemu-img convert -f raw -O qcow2 "$d/data.raw" "$d/data.qcow2"
    local fio_args=(--bs=4k --iodepth=16 --numjobs=4 --group_reporting --size="$((MT_MIB << 20))"
        --runtime="$RUNTIME" --time_based --ramp_time=1)
    for r in $(seq 1 "$ROUNDS"); do
        for sc in $MT_SCENARIOS; do
            IFS=: read -r label dir <<<"$sc"
            for kind in $(order "$r") ours2 raw; do
                case $kind in
                qemu | ours) start_server "$kind" "$d/data.qcow2" cache=writeback shared=0 ;;
                ours2) start_server ours "$d/data.qcow2" cache=writeback shared=0 threads=2 ;;
                raw) start_server raw "$d/data.raw" cache=writeback shared=0 ;;
                esac
                stats=$(run_fio "$dir" --rw="$label" "${fio_args[@]}")
                read -r iops _ _ cpu disk <<<"$stats"
                stop_server
                case $kind in
                ours2) record "mt2 $label" ours "$iops"; record_usage "mt2 $label" ours "$cpu" "$disk" ;;
                qemu) for k in "mt $label" "mt2 $label"; do
                        record "$k" qemu "$iops"; record_usage "$k" qemu "$cpu" "$disk"; done ;;
                *) record "mt $label" "$kind" "$iops"; record_usage "mt $label" "$kind" "$cpu" "$disk" ;;
                esac
                log "tmpfs $label round $r $kind: $iops IOPS, $cpu µs/req"
            done
        done
    done
    rm -rf "$d"
}

# ---------------------------------------------------------------------------------------------
# 1c. The cost of statistics: the mt group's tmpfs randread (4 connections x QD16, 4 KiB, one
# thread) on our server with --metrics against without, alternating which goes first, while
# curl scrapes the endpoint once a second (far more often than Prometheus would).
metrics_scenarios() {
    local d=$TOOLS_DIR/qcow2-nbd-metrics.$$ r kind stats iops cpu disk scraper
    [ -z "$(ss -Hltn "sport = :$METRICS_PORT")" ] || die "METRICS_PORT $METRICS_PORT is in use"
    command -v curl >/dev/null || die "curl is required by the metrics group"
    mkdir -p "$d"
    log "tmpfs: writing a ${MT_MIB} MiB image in $d"
    fio --name=fill --filename="$d/data.raw" --rw=write --bs=1M --size="$((MT_MIB << 20))" \
        --refill_buffers --output-format=terse >/dev/null
    qemu-img convert -f raw -O qcow2 "$d/data.raw" "$d/data.qcow2"
    rm -f "$d/data.raw"
    for r in $(seq 1 "$ROUNDS"); do
        local kinds="off on"
        [ $((r % 2)) = 0 ] && kinds="on off"
        for kind in $kinds; do
            scraper=""
            if [ "$kind" = on ]; then
                start_server ours "$d/data.qcow2" cache=writeback shared=0 \
                    metrics="127.0.0.1:$METRICS_PORT"
                (while sleep 1; do
                    curl -s -o /dev/null "http://127.0.0.1:$METRICS_PORT/metrics" || true
                done) &
                scraper=$!
            else
                start_server ours "$d/data.qcow2" cache=writeback shared=0
            fi
            stats=$(run_fio read --rw=randread --bs=4k --iodepth=16 --numjobs=4 --group_reporting \
                --size="$((MT_MIB << 20))" --runtime="$RUNTIME" --time_based --ramp_time=1)
            read -r iops _ _ cpu disk <<<"$stats"
            if [ -n "$scraper" ]; then kill "$scraper" 2>/dev/null || true; wait "$scraper" 2>/dev/null || true; fi
            stop_server
            record "metrics $kind randread" ours "$iops"
            record_usage "metrics $kind randread" ours "$cpu" "$disk"
            log "metrics $kind round $r: $iops IOPS, $cpu µs/req"
        done
    done
    rm -rf "$d"
}

# ---------------------------------------------------------------------------------------------
# 2. Random and sequential I/O on a fully allocated image (qemu-img convert of random data, so
# every cluster is allocated with data), one copy per server, and the raw data as the limit.
IO_SCENARIOS="randread-4k-qd1:read:randread:4k:1 randread-4k-qd32:read:randread:4k:32
randwrite-4k-qd1:write:randwrite:4k:1 randwrite-4k-qd32:write:randwrite:4k:32
seqread-1m-qd1:read:read:1M:1 seqwrite-1m-qd1:write:write:1M:1"

# make_data_image: $WORK/data.raw (DATA_MIB of random data) and the same data as a fully
# allocated qcow2 image per server, $WORK/data-qemu.qcow2 and $WORK/data-ours.qcow2.
make_data_image() {
    local size=$((DATA_MIB << 20))
    fio --name=fill --filename="$WORK/data.raw" --rw=write --bs=1M --size="$size" --direct=1 \
        --refill_buffers --output-format=terse >/dev/null
    qemu-img convert -f raw -O qcow2 "$WORK/data.raw" "$WORK/data-qemu.qcow2"
    cp "$WORK/data-qemu.qcow2" "$WORK/data-ours.qcow2"
}

io_scenarios() {
    local size=$((DATA_MIB << 20))
    log "random/sequential I/O: making a ${DATA_MIB} MiB allocated image"
    make_data_image
    local sc label dirn rw bs qd r kind iops bw image cpu disk
    for sc in $IO_SCENARIOS; do
        IFS=: read -r label dirn rw bs qd <<<"$sc"
        for r in $(seq 1 "$ROUNDS"); do
            for kind in $(order "$r") raw; do
                case $kind in
                qemu) image=$WORK/data-qemu.qcow2 ;; ours) image=$WORK/data-ours.qcow2 ;;
                raw) image=$WORK/data.raw ;;
                esac
                start_server "$kind" "$image"
                stats=$(run_fio "$dirn" --rw="$rw" --bs="$bs" --iodepth="$qd" \
                    --size="$size" --runtime="$RUNTIME" --time_based --ramp_time=1)
                read -r iops bw _ cpu disk <<<"$stats"
                stop_server
                record_usage "$label" "$kind" "$cpu" "$disk"
                if [ "$bs" = 1M ]; then record "$label" "$kind" "$bw"; else
                    record "$label" "$kind" "$iops"; fi
                log "$label round $r $kind: $iops IOPS, $bw MiB/s"
            done
        done
    done
    qemu-img check -q "$WORK/data-ours.qcow2" || die "our server left a corrupt image"
    rm -f "$WORK/data.raw" "$WORK/data-qemu.qcow2" "$WORK/data-ours.qcow2"
}

# ---------------------------------------------------------------------------------------------
# 2b. Dirty-bitmap tracking: 4 KiB random writes (QD32) on the allocated image with no bitmap
# and with one enabled persistent bitmap, each server on its own copies; the cost of tracking
# is each server's ratio between the two.
bitmap_scenarios() {
    local size=$((DATA_MIB << 20))
    log "bitmap tracking: making a ${DATA_MIB} MiB allocated image with and without a bitmap"
    make_data_image
    local k
    for k in qemu ours; do
        cp "$WORK/data-$k.qcow2" "$WORK/bm-$k.qcow2"
        qemu-img bitmap --add "$WORK/bm-$k.qcow2" tracking
    done
    local r kind bm image iops cpu disk
    for r in $(seq 1 "$ROUNDS"); do
        for bm in none one; do
            for kind in $(order "$r"); do
                if [ "$bm" = one ]; then image=$WORK/bm-$kind.qcow2; else image=$WORK/data-$kind.qcow2; fi
                start_server "$kind" "$image"
                stats=$(run_fio write --rw=randwrite --bs=4k --iodepth=32 \
                    --size="$size" --runtime="$RUNTIME" --time_based --ramp_time=1)
                read -r iops _ _ cpu disk <<<"$stats"
                stop_server
                record "bitmap $bm" "$kind" "$iops"
                record_usage "bitmap $bm" "$kind" "$cpu" "$disk"
                log "bitmap $bm round $r $kind: $iops IOPS"
            done
        done
    done
    for k in qemu ours; do
        qemu-img check -q "$WORK/bm-$k.qcow2" || die "$k left a corrupt image"
        qemu-img info "$WORK/bm-$k.qcow2" | grep -q tracking || die "$k lost the bitmap"
    done
    rm -f "$WORK/data.raw" "$WORK"/data-*.qcow2 "$WORK"/bm-*.qcow2
}

# ---------------------------------------------------------------------------------------------
# 3. L2 cache: 4 KiB random reads (QD1) over an image whose clusters are all allocated
# (preallocation=metadata), with 1/3/5 MiB caches and 4/16/64 KiB slices, read-only.
l2_scenarios() {
    log "L2 cache: making a ${L2_GIB} GiB image with preallocation=metadata"
    qemu-img create -q -f qcow2 -o preallocation=metadata "$WORK/l2-qemu.qcow2" "${L2_GIB}G"
    copy_image "$WORK/l2-qemu.qcow2" "$WORK/l2-ours.qcow2"
    local cache slice r kind iops image cpu disk
    for cache in 1M 3M 5M; do
        for slice in 4k 16k 64k; do
            for r in $(seq 1 "$ROUNDS"); do
                for kind in $(order "$r"); do
                    image=$WORK/l2-$kind.qcow2
                    start_server "$kind" "$image" l2="$cache" slice="$slice" ro=1
                    stats=$(run_fio read --rw=randread --bs=4k --iodepth=1 \
                        --runtime="$L2_RUNTIME" --time_based --ramp_time=1)
                    read -r iops _ _ cpu disk <<<"$stats"
                    stop_server
                    record "l2 cache $cache slice $slice" "$kind" "$iops"
                    record_usage "l2 cache $cache slice $slice" "$kind" "$cpu" "$disk"
                    log "l2 $cache/$slice round $r $kind: $iops IOPS"
                done
            done
        done
    done
    rm -f "$WORK/l2-qemu.qcow2" "$WORK/l2-ours.qcow2"
}

# ---------------------------------------------------------------------------------------------
# 4. Chains: the same guest data through one image and through CHAIN_DEPTH layers (layer k
# holds every cluster i with i % depth == k). A full sequential read (1 MiB, QD1), its time and
# the server's peak RSS (VmHWM, a fresh server per read).
chain_scenarios() {
    log "chains: building depth $CHAIN_DEPTH and depth 1 with the same $CHAIN_MIB MiB of data"
    build_chain "$WORK/chain" "$CHAIN_DEPTH" "$CHAIN_MIB"
    qemu-img convert -f qcow2 -O qcow2 "$WORK/chain/top.qcow2" "$WORK/flat.qcow2"
    local size=$((CHAIN_MIB << 20)) r kind image label ms hwm depth cpu disk
    for r in $(seq 1 "$ROUNDS"); do
        for depth in 1 "$CHAIN_DEPTH"; do
            if [ "$depth" = 1 ]; then image=$WORK/flat.qcow2; else image=$WORK/chain/top.qcow2; fi
            for kind in $(order "$r"); do
                start_server "$kind" "$image" ro=1
                stats=$(run_fio read --rw=read --bs=1M --iodepth=1 --size="$size")
                read -r _ _ ms cpu disk <<<"$stats"
                hwm=$(status_kib VmHWM)
                stop_server
                record "chain $depth read ms" "$kind" "$ms"
                record_usage "chain $depth read ms" "$kind" "$cpu" "$disk"
                record "chain $depth peak rss MiB" "$kind" "$(awk -v k="$hwm" 'BEGIN { printf "%.1f", k / 1024 }')"
                log "chain depth $depth round $r $kind: $ms ms, VmHWM $hwm KiB"
            done
        done
    done
    rm -rf "$WORK/chain" "$WORK/flat.qcow2"
}

# ---------------------------------------------------------------------------------------------
# 5. Memory: server RSS at rest (just started), after random reads over the whole L2-cache
# image have filled a RSS_L2_CACHE L2 cache, and after CLEAN_INTERVAL has emptied it again.
rss_scenarios() {
    log "RSS: ${L2_GIB} GiB image, l2-cache-size=$RSS_L2_CACHE, cache-clean-interval=$CLEAN_INTERVAL"
    qemu-img create -q -f qcow2 -o preallocation=metadata "$WORK/rss-qemu.qcow2" "${L2_GIB}G"
    copy_image "$WORK/rss-qemu.qcow2" "$WORK/rss-ours.qcow2"
    local r kind rest loaded cleaned hwm
    for r in $(seq 1 "$ROUNDS"); do
        for kind in $(order "$r"); do
            start_server "$kind" "$WORK/rss-$kind.qcow2" l2="$RSS_L2_CACHE" \
                clean="$CLEAN_INTERVAL" ro=1
            sleep 0.5
            rest=$(status_kib VmRSS)
            run_fio read --rw=randread --bs=4k --iodepth=32 --runtime="$RUNTIME" \
                --time_based >/dev/null
            loaded=$(status_kib VmRSS)
            hwm=$(status_kib VmHWM)
            sleep $((2 * CLEAN_INTERVAL + 1))
            cleaned=$(status_kib VmRSS)
            stop_server
            record "rss at rest MiB" "$kind" "$(awk -v k="$rest" 'BEGIN { printf "%.1f", k / 1024 }')"
            record "rss loaded MiB" "$kind" "$(awk -v k="$loaded" 'BEGIN { printf "%.1f", k / 1024 }')"
            record "rss peak MiB" "$kind" "$(awk -v k="$hwm" 'BEGIN { printf "%.1f", k / 1024 }')"
            record "rss after clean MiB" "$kind" "$(awk -v k="$cleaned" 'BEGIN { printf "%.1f", k / 1024 }')"
            log "rss round $r $kind: rest $rest KiB, loaded $loaded KiB, peak $hwm KiB, cleaned $cleaned KiB"
        done
    done
    rm -f "$WORK/rss-qemu.qcow2" "$WORK/rss-ours.qcow2"
    long_read_scenarios
}

# 5b. Peak RSS of one full sequential read (1 MiB requests, QD1 and QD4) of the allocated
# DATA_MIB image, recorded with its throughput and CPU per request.
long_read_scenarios() {
    log "RSS of a long read: ${DATA_MIB} MiB allocated image"
    make_data_image
    local r qd kind iops bw cpu disk
    for r in $(seq 1 "$ROUNDS"); do
        for qd in 1 4; do
            for kind in $(order "$r"); do
                start_server "$kind" "$WORK/data-$kind.qcow2" ro=1
                read -r iops bw _ cpu disk < <(run_fio read --rw=read --bs=1M --iodepth="$qd")
                record "long read qd$qd peak rss MiB" "$kind" "$(hwm_mib)"
                stop_server
                record "long read qd$qd" "$kind" "$bw"
                record_usage "long read qd$qd" "$kind" "$cpu" "$disk"
                log "long read qd$qd round $r $kind: $bw MiB/s, $iops IOPS"
            done
        done
    done
    rm -f "$WORK/data.raw" "$WORK/data-qemu.qcow2" "$WORK/data-ours.qcow2"
}

# ---------------------------------------------------------------------------------------------
# 6. TLS: sequential 1 MiB reads (QD8) and 4 KiB random reads (QD32) on the allocated image
# over TCP loopback, both servers requiring TLS with the same x509 credentials (made here with
# certtool: a CA and a cert for localhost/127.0.0.1, RSA 2048), and our server without TLS on
# the same TCP port as the plaintext reference (the cost of TLS is ours TLS / ours plaintext).
#
# Client: fio's nbd engine (libnbd) with nbds:// URIs. fio calls nbd_connect_uri without
# nbd_set_uri_allow_local_file, so libnbd refuses `?tls-certificates=DIR` ("local file access
# (tls-certificates) is not allowed"), and as root its default CA directory is /etc/pki/libnbd,
# which a benchmark must not touch; so fio connects with `?tls-verify-peer=false`. That skips
# only the one-time check of the server's certificate: the handshake and the encryption of
# every request and reply, what these rows measure, are the same. Before the runs, nbdinfo
# checks each server's certificate against the CA with `?tls-certificates=CLIENTDIR`.
TLS_SCENARIOS="seqread-1m-qd8:read:1M:8 randread-4k-qd32:randread:4k:32"

make_tls_creds() { # $WORK/tls/server (CA cert, server cert and key) and $WORK/tls/client (CA)
    local d=$WORK/tls
    mkdir -p "$d/server" "$d/client"
    certtool --generate-privkey --key-type=rsa --bits=2048 --outfile "$d/ca-key.pem" 2>/dev/null
    printf '%s\n' 'cn = qcow2-nbd compare.sh CA' ca cert_signing_key 'expiration_days = 7' \
        >"$d/ca.info"
    certtool --generate-self-signed --load-privkey "$d/ca-key.pem" --template "$d/ca.info" \
        --outfile "$d/server/ca-cert.pem" 2>/dev/null
    certtool --generate-privkey --key-type=rsa --bits=2048 \
        --outfile "$d/server/server-key.pem" 2>/dev/null
    printf '%s\n' 'cn = localhost' 'dns_name = localhost' 'ip_address = 127.0.0.1' \
        tls_www_server encryption_key signing_key 'expiration_days = 7' >"$d/server.info"
    certtool --generate-certificate --load-privkey "$d/server/server-key.pem" \
        --load-ca-certificate "$d/server/ca-cert.pem" --load-ca-privkey "$d/ca-key.pem" \
        --template "$d/server.info" --outfile "$d/server/server-cert.pem" 2>/dev/null
    cp "$d/server/ca-cert.pem" "$d/client/ca-cert.pem"
}

tls_scenarios() {
    local size=$((DATA_MIB << 20))
    [ -z "$(ss -Hltn "sport = :$TLS_PORT")" ] || die "TLS_PORT $TLS_PORT is in use"
    log "TLS: making x509 credentials and a ${DATA_MIB} MiB allocated image"
    make_tls_creds
    make_data_image
    local sdir=$WORK/tls/server cdir=$WORK/tls/client kind image
    for kind in qemu ours; do # the certificate verifies and TLS is required, on both servers
        start_server "$kind" "$WORK/data-$kind.qcow2" tcp="$TLS_PORT" tls="$sdir"
        nbdinfo "nbds://localhost:$TLS_PORT/?tls-certificates=$cdir" >/dev/null 2>"$WORK/nbdinfo.err" || {
            cat "$WORK/nbdinfo.err" "$WORK/server.log" >&2
            die "$kind: TLS connection with the CA-checked certificate failed"
        }
        ! nbdinfo "nbd://localhost:$TLS_PORT/" >/dev/null 2>&1 || die "$kind served without TLS"
        stop_server
    done
    local sc label rw bs qd r name iops bw cpu disk
    for sc in $TLS_SCENARIOS; do
        IFS=: read -r label rw bs qd <<<"$sc"
        for r in $(seq 1 "$ROUNDS"); do
            for kind in $(order "$r") plain; do
                if [ "$kind" = plain ]; then
                    image=$WORK/data-ours.qcow2 NBD_URI="nbd://localhost:$TLS_PORT/"
                    start_server ours "$image" tcp="$TLS_PORT"
                else
                    image=$WORK/data-$kind.qcow2
                    NBD_URI="nbds://localhost:$TLS_PORT/?tls-verify-peer=false"
                    start_server "$kind" "$image" tcp="$TLS_PORT" tls="$sdir"
                fi
                stats=$(run_fio read --rw="$rw" --bs="$bs" --iodepth="$qd" \
                    --size="$size" --runtime="$RUNTIME" --time_based --ramp_time=1)
                read -r iops bw _ cpu disk <<<"$stats"
                stop_server
                NBD_URI=""
                if [ "$kind" = plain ]; then name="plain $label" kind=ours; else name="tls $label"; fi
                record_usage "$name" "$kind" "$cpu" "$disk"
                if [ "$bs" = 1M ]; then record "$name" "$kind" "$bw"; else
                    record "$name" "$kind" "$iops"; fi
                log "$name round $r $kind: $iops IOPS, $bw MiB/s, $cpu CPU µs/req"
            done
        done
    done
    rm -rf "$WORK/tls" "$WORK/data.raw" "$WORK/data-qemu.qcow2" "$WORK/data-ours.qcow2"
}

# ---------------------------------------------------------------------------------------------
# 7. Image tools on tmpfs (CPU-bound): convert a 2 GiB half-allocated qcow2 (1 MiB of data
# every other MiB, taken from the system's own files so it compresses as real disks do) to
# qcow2, to raw, and to qcow2 with -c, against `qemu-img convert`; `cp --sparse=always` of the
# raw equivalent is the physical limit. check on a 2 GiB fully allocated image and on a
# 20 GiB image preallocated with metadata (every L2 table and refcount block present, no
# data) against `qemu-img check`. compare of the half-allocated image with a copy of itself,
# and with a copy differing in one byte near its end, against `qemu-img compare`. Wall time
# and CPU time (user + system) per run, medians of alternating rounds; each convert output is
# compared with the source by `qemu-img compare` once.
TOOLS_DIR=${TOOLS_DIR:-/dev/shm}
TOOLS_MIB=${TOOLS_MIB:-2048}
# The quick tool runs swing the most on this kind of machine (a copy into fresh tmpfs pages
# sometimes takes 2-4 times the CPU, for qemu-img and for us alike), so they get more
# rounds; `convert -c` (half a minute for qemu-img) keeps ROUNDS.
if [ "$QUICK" = 1 ]; then d_tools_rounds=$ROUNDS; else d_tools_rounds=$((ROUNDS > 7 ? ROUNDS : 7)); fi
TOOLS_ROUNDS=${TOOLS_ROUNDS:-$d_tools_rounds}

make_tools_images() { # $1: directory
    local d=$1
    python3 - "$d/src.raw" "$TOOLS_MIB" <<'PY'
import os, sys, tarfile, io
path, mib = sys.argv[1], int(sys.argv[2])
def files():
    for root in ("/usr/lib", "/usr/bin", "/usr/share"):
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = os.path.join(dirpath, n)
                if os.path.isfile(p) and not os.path.islink(p):
                    yield p
chunk = 1 << 20
with open(path, "wb") as out:
    out.truncate(mib << 20)
    buf, slot = b"", 0
    for p in files():
        try:
            with open(p, "rb") as f:
                buf += f.read(4 << 20)
        except OSError:
            continue
        while len(buf) >= chunk and slot < mib:
            out.seek(slot << 20)
            out.write(buf[:chunk])
            buf, slot = buf[chunk:], slot + 2
        if slot >= mib:
            break
PY
    qemu-img convert -f raw -O qcow2 "$d/src.raw" "$d/src.qcow2"
    qemu-img create -q -f qcow2 -o preallocation=falloc "$d/full.qcow2" "$((TOOLS_MIB))M"
    qemu-img create -q -f qcow2 -o preallocation=metadata "$d/sparse20.qcow2" 20G
    # compare: the image against a copy of itself, and against a copy with one byte changed
    # in the last data MiB (so the whole image is read before the difference).
    cp "$d/src.qcow2" "$d/same.qcow2"
    cp "$d/src.qcow2" "$d/onebyte.qcow2"
    qemu-io -f qcow2 -c "write -P 0xa5 $(((TOOLS_MIB - 2) * 1048576 + 777)) 1" \
        "$d/onebyte.qcow2" >/dev/null
    # commit and rebase: top.qcow2 holds data in the other half of the slots (its clusters
    # half allocated) over src.qcow2 as its base.
    dd if="$d/src.raw" of="$d/top.raw" bs=1M seek=1 count=$((TOOLS_MIB - 1)) conv=sparse status=none
    truncate -s "${TOOLS_MIB}M" "$d/top.raw"
    qemu-img convert -f raw -O qcow2 "$d/top.raw" "$d/top.qcow2"
    rm -f "$d/top.raw"
    qemu-img rebase -u -b src.qcow2 -F qcow2 "$d/top.qcow2"
}

# exits CODE CMD...: runs CMD and succeeds when it exits with CODE (compare exits 1 on a
# difference, which is the result expected there, not a failure).
exits() {
    local want=$1 rc=0
    shift
    "$@" || rc=$?
    [ "$rc" = "$want" ]
}

# chain_copy DIR: a fresh top-c.qcow2 over base-c.qcow2 for one commit or rebase run.
chain_copy() {
    local d=$1
    cp --sparse=always "$d/src.qcow2" "$d/base-c.qcow2"
    cp --sparse=always "$d/top.qcow2" "$d/top-c.qcow2"
    qemu-img rebase -u -b base-c.qcow2 -F qcow2 "$d/top-c.qcow2"
}

# timed LABEL KIND CMD...: runs CMD, records its wall and CPU time in ms under LABEL.
timed() {
    local label=$1 kind=$2 t
    shift 2
    t=$( { TIMEFORMAT='%R %U %S'; time "$@" >/dev/null 2>&1; } 2>&1 ) || die "$label ($kind) failed: $*"
    read -r wall user sys <<<"$t"
    record "$label ms" "$kind" "$(awk -v w="$wall" 'BEGIN { printf "%.0f", w * 1000 }')"
    record "$label cpu ms" "$kind" "$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.0f", (u + s) * 1000 }')"
}

tools_scenarios() {
    local d=$TOOLS_DIR/qcow2-nbd-tools.$$ r kind out sc fmt comp
    mkdir -p "$d"
    log "tools: making a ${TOOLS_MIB} MiB half-allocated image and check images in $d"
    make_tools_images "$d"
    for r in $(seq 1 "$TOOLS_ROUNDS"); do
        for sc in qcow2 raw qcow2-c; do
            [ "$sc" = qcow2-c ] && [ "$r" -gt "$ROUNDS" ] && continue
            fmt=${sc%-c}
            comp=()
            [ "$sc" = qcow2-c ] && comp=(-c)
            for kind in $(order "$r"); do
                out=$d/out-$kind.$fmt
                rm -f "$out"
                if [ "$kind" = qemu ]; then
                    timed "convert $sc" qemu qemu-img convert -f qcow2 -O "$fmt" "${comp[@]}" "$d/src.qcow2" "$out"
                else
                    timed "convert $sc" ours "$BIN" convert -q -f qcow2 -O "$fmt" "${comp[@]}" "$d/src.qcow2" "$out"
                fi
                if [ "$r" = 1 ]; then
                    qemu-img compare -q -f qcow2 -F "$fmt" "$d/src.qcow2" "$out" ||
                        die "convert $sc ($kind): the output differs from the source"
                fi
                rm -f "$out"
            done
            rm -f "$d/out-raw.raw"
            timed "convert $sc" raw cp --sparse=always "$d/src.raw" "$d/out-raw.raw"
            rm -f "$d/out-raw.raw"
            log "convert $sc round $r done"
        done
        for sc in full sparse20; do
            for kind in $(order "$r"); do
                if [ "$kind" = qemu ]; then
                    timed "check $sc" qemu qemu-img check -f qcow2 "$d/$sc.qcow2"
                else
                    timed "check $sc" ours "$BIN" check "$d/$sc.qcow2"
                fi
            done
            log "check $sc round $r done"
        done
        for sc in same onebyte; do
            local want=0
            [ "$sc" = onebyte ] && want=1
            for kind in $(order "$r"); do
                if [ "$kind" = qemu ]; then
                    timed "compare $sc" qemu exits "$want" qemu-img compare -f qcow2 -F qcow2 "$d/src.qcow2" "$d/$sc.qcow2"
                else
                    timed "compare $sc" ours exits "$want" "$BIN" compare -f qcow2 -F qcow2 "$d/src.qcow2" "$d/$sc.qcow2"
                fi
            done
            log "compare $sc round $r done"
        done
        for sc in commit rebase; do
            for kind in $(order "$r"); do
                chain_copy "$d"
                local tool=qemu-img
                [ "$kind" = ours ] && tool=$BIN
                if [ "$sc" = commit ]; then
                    timed "$sc" "$kind" "$tool" commit -q "$d/top-c.qcow2"
                    out=$d/base-c.qcow2
                else
                    timed "$sc" "$kind" "$tool" rebase -q -b "" "$d/top-c.qcow2"
                    out=$d/top-c.qcow2
                fi
                if [ "$r" = 1 ]; then
                    qemu-img compare -q -f qcow2 -F qcow2 "$d/top.qcow2" "$out" ||
                        die "$sc ($kind): the result reads differently from the chain"
                fi
            done
            rm -f "$d/base-c.qcow2" "$d/top-c.qcow2"
            log "$sc round $r done"
        done
    done
    rm -rf "$d"
}

# ---------------------------------------------------------------------------------------------
START=$(date +%s)
for group in $ONLY; do
    case $group in
    alloc) alloc_scenarios ;; io) io_scenarios ;; bitmap) bitmap_scenarios ;;
    l2) l2_scenarios ;; chain) chain_scenarios ;; rss) rss_scenarios ;; tls) tls_scenarios ;;
    tools) tools_scenarios ;; alloc32) alloc32_scenarios ;; mt) mt_scenarios ;;
    metrics) metrics_scenarios ;; qd32) qd32_scenarios ;;
    *) die "unknown scenario group $group (alloc alloc32 qd32 mt metrics io bitmap l2 chain rss tls tools)" ;;
    esac
done
ELAPSED=$(($(date +%s) - START))

# ---------------------------------------------------------------------------------------------
# The table. ratio = ours / qemu-nbd for rates (higher is better) and qemu-nbd / ours for
# times and memory (so above 1 always means we are better); "raw" is our server on a raw file.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "-" || b == "-" || b == 0) print "-"; else printf "%.2f\n", a / b }'; }

row() { # scenario label unit higher_is_better
    local sc=$1 label=$2 unit=$3 better=$4 q o w rt
    q=$(median "$sc" qemu)
    o=$(median "$sc" ours)
    [ "$q" = - ] && [ "$o" = - ] && return 0
    if [ "$better" = higher ]; then rt=$(ratio "$o" "$q"); else rt=$(ratio "$q" "$o"); fi
    w=$(median "$sc" raw)
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$label" "$unit" "$q" "$o" "$rt" "$w" \
        "$(usage "$sc")"
}

usage() { # SCENARIO: the servers' median CPU and disk cost per request, "qemu / ours" each
    [ "$(median "cpu $1" qemu)$(median "cpu $1" ours)" = -- ] && { printf -- '- | -'; return; }
    printf '%s / %s | %s / %s' "$(median "cpu $1" qemu)" "$(median "cpu $1" ours)" \
        "$(median "disk $1" qemu)" "$(median "disk $1" ours)"
}

{
    echo
    echo "qcow2-nbd vs qemu-nbd $(qemu-nbd --version | head -1 | awk '{print $2}'), $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, Linux $(uname -r), ROUNDS=$ROUNDS RUNTIME=${RUNTIME}s QUICK=$QUICK, ${ELAPSED}s"
    echo
    echo "| scenario | unit | qemu-nbd | ours | ratio | raw (ours) | CPU µs/req | disk KiB/req |"
    echo "|---|---|---:|---:|---:|---:|---:|---:|"
    raw_alloc=$(median "alloc raw" raw)
    for cfg in $ALLOC_CONFIGS; do
        IFS=: read -r label _ _ <<<"$cfg"
        q=$(median "alloc $label" qemu)
        o=$(median "alloc $label" ours)
        [ "$q" = - ] && continue
        printf '| alloc 4k randwrite %s (QD%s) | IOPS | %s | %s | %s | %s | %s |\n' "$label" \
            "$ALLOC_QD" "$q" "$o" "$(ratio "$o" "$q")" "$raw_alloc" "$(usage "alloc $label")"
    done
    raw_alloc32=$(median "alloc32 raw" raw)
    for cfg in "std-64k" "ext-64k/2k"; do
        q=$(median "alloc32 $cfg" qemu)
        o=$(median "alloc32 $cfg" ours)
        [ "$q" = - ] && continue
        printf '| alloc 4k randwrite %s (QD32) | IOPS | %s | %s | %s | %s | %s |\n' "$cfg" \
            "$q" "$o" "$(ratio "$o" "$q")" "$raw_alloc32" "$(usage "alloc32 $cfg")"
    done
    for sc in $MT_SCENARIOS; do
        IFS=: read -r label _ <<<"$sc"
        row "mt $label" "tmpfs $label-4k 4 conns x QD16" IOPS higher
        row "mt2 $label" "  same, ours --threads 2" IOPS higher
    done
    row "metrics off randread" "tmpfs randread-4k 4 conns x QD16, ours without --metrics" IOPS higher
    row "metrics on randread" "  same, ours with --metrics, scraped every second" IOPS higher
    for sc in $IO_SCENARIOS; do
        IFS=: read -r label _ _ bs _ <<<"$sc"
        if [ "$bs" = 1M ]; then row "$label" "$label" MiB/s higher; else
            row "$label" "$label" IOPS higher; fi
    done
    row "bitmap none" "randwrite-4k-qd32, no bitmap" IOPS higher
    row "bitmap one" "randwrite-4k-qd32, one enabled bitmap" IOPS higher
    for cache in 1M 3M 5M; do
        for slice in 4k 16k 64k; do
            row "l2 cache $cache slice $slice" "L2 ${L2_GIB}G: cache $cache, slice $slice" IOPS higher
        done
    done
    for depth in 1 "$CHAIN_DEPTH"; do
        row "chain $depth read ms" "chain depth $depth: full read" ms lower
    done
    for depth in 1 "$CHAIN_DEPTH"; do
        row "chain $depth peak rss MiB" "chain depth $depth: peak RSS" MiB lower
    done
    row "rss at rest MiB" "RSS at rest" MiB lower
    row "rss loaded MiB" "RSS after random reads (l2 $RSS_L2_CACHE)" MiB lower
    row "rss peak MiB" "peak RSS (l2 $RSS_L2_CACHE)" MiB lower
    row "rss after clean MiB" "RSS after cache-clean-interval" MiB lower
    for qd in 1 4; do
        row "long read qd$qd" "full sequential read, 1M QD$qd" MiB/s higher
        row "long read qd$qd peak rss MiB" "full sequential read, 1M QD$qd: peak RSS" MiB lower
    done
    for sc in $TLS_SCENARIOS; do
        IFS=: read -r label _ bs _ <<<"$sc"
        unit=IOPS
        [ "$bs" = 1M ] && unit=MiB/s
        row "tls $label" "TLS (TCP) $label" "$unit" higher
        row "plain $label" "no TLS (TCP, ours only) $label" "$unit" higher
    done
    for sc in qcow2 raw qcow2-c; do
        row "convert $sc ms" "convert ${TOOLS_MIB} MiB half-allocated qcow2 -> $sc (raw: cp --sparse)" ms lower
        row "convert $sc cpu ms" "  CPU time (user + system)" ms lower
    done
    for sc in full sparse20; do
        label="check ${TOOLS_MIB} MiB fully allocated"
        [ "$sc" = sparse20 ] && label="check 20 GiB, metadata preallocated"
        row "check $sc ms" "$label" ms lower
        row "check $sc cpu ms" "  CPU time (user + system)" ms lower
    done
    row "compare same ms" "compare ${TOOLS_MIB} MiB half-allocated qcow2 with a copy" ms lower
    row "compare same cpu ms" "  CPU time (user + system)" ms lower
    row "compare onebyte ms" "  same, one byte changed near the end" ms lower
    row "compare onebyte cpu ms" "  CPU time (user + system)" ms lower
    row "commit ms" "commit ${TOOLS_MIB} MiB, half of the clusters allocated over the base" ms lower
    row "commit cpu ms" "  CPU time (user + system)" ms lower
    row "rebase ms" "rebase -b \"\" of the same (copies the base's half)" ms lower
    row "rebase cpu ms" "  CPU time (user + system)" ms lower
    case " $ONLY " in *" qd32 "*)
        echo
        qd32_table
        echo
        echo "qd32: $QD32_IOS writes per run; limit: fio (io_uring, O_DIRECT, QD32) writing as many random"
        echo "4 KiB blocks into a fresh sparse raw file of the same size, in the same rounds; disk use: the"
        echo "image (or the limit's raw file) after the run, medians. Over a backing file each write must"
        echo "write its whole allocation unit (the bytes copied around its own 4 KiB): the unit-sized limit"
        echo "is fio writing as many blocks of that size the same way, where the unit is above 4 KiB;"
        echo "the copy limit, fio reading as many unit-sized blocks of the backing file while it writes"
        echo "them (QD16 each), pairs per second. Limit through NBD: our server exporting a fresh sparse"
        echo "raw file, the same writes by the same client: what the NBD hop leaves of the limit."
        ;;
    esac
    echo
    echo "ratio: ours/qemu-nbd for rates, qemu-nbd/ours for times and memory (above 1 = ours better)."
    echo "CPU µs/req and disk KiB/req: the server's CPU time (all threads) and storage bytes read"
    echo "plus written per request, medians, qemu-nbd / ours (the disk's speed does not move them)."
    # Tracking cost: each server with one enabled bitmap against itself without.
    for k in ours qemu; do
        n=$(median "bitmap none" "$k")
        b=$(median "bitmap one" "$k")
        [ "$n" = - ] || echo "$k: randwrite 4k QD32 IOPS with one enabled bitmap / without = $(ratio "$b" "$n")"
    done
    # Chain targets are about our server against itself.
    c1=$(median "chain 1 read ms" ours)
    cn=$(median "chain $CHAIN_DEPTH read ms" ours)
    m1=$(median "chain 1 peak rss MiB" ours)
    mn=$(median "chain $CHAIN_DEPTH peak rss MiB" ours)
    if [ "$c1" != - ]; then
        echo "ours: chain $CHAIN_DEPTH / chain 1 read time = $(ratio "$cn" "$c1"), peak RSS growth = $(awk -v a="$mn" -v b="$m1" 'BEGIN { printf "%.1f", a - b }') MiB"
        q1=$(median "chain 1 read ms" qemu)
        qn=$(median "chain $CHAIN_DEPTH read ms" qemu)
        qm1=$(median "chain 1 peak rss MiB" qemu)
        qmn=$(median "chain $CHAIN_DEPTH peak rss MiB" qemu)
        echo "qemu-nbd: chain $CHAIN_DEPTH / chain 1 read time = $(ratio "$qn" "$q1"), peak RSS growth = $(awk -v a="$qmn" -v b="$qm1" 'BEGIN { printf "%.1f", a - b }') MiB"
    fi
    # The cost of statistics to our server: with --metrics against without.
    on=$(median "metrics on randread" ours)
    off=$(median "metrics off randread" ours)
    [ "$on" = - ] || echo "ours: tmpfs randread 4k 4x QD16 with --metrics / without = $(ratio "$on" "$off"), CPU µs/req $(median "cpu metrics off randread" ours) -> $(median "cpu metrics on randread" ours)"
    # The cost of TLS to our server: TLS against plaintext, same port, image and workload.
    for sc in $TLS_SCENARIOS; do
        IFS=: read -r label _ _ _ <<<"$sc"
        t=$(median "tls $label" ours)
        p=$(median "plain $label" ours)
        [ "$t" = - ] || echo "ours: $label with TLS / without = $(ratio "$t" "$p"), CPU µs/req $(median "cpu plain $label" ours) -> $(median "cpu tls $label" ours)"
    done
}
