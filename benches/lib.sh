# Shell shared by benches/compare.sh and benches/seeds.sh (sourced, not run): the servers
# started the same way on both sides, fio over NBD with the server's CPU and storage counters,
# the results file and its medians, the allocation runs and the chain builder.
#
# The sourcing script sets, before calling anything here: WORK (scratch directory), SOCK (Unix
# socket path), BIN (our binary), QEMU_AIO, RESULTS (the results file), CLK_TCK, ROUNDS,
# RUNTIME and SERVER_PID="" (its cleanup stops that server).

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Builds the release binary unless SKIP_BUILD=1 and sets BIN to it (QCOW2_NBD_BIN overrides).
build_binary() {
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
        log "building release binary"
        (cd "$REPO" && cargo build --release --quiet --bin qcow2-nbd)
    fi
    BIN=${QCOW2_NBD_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/qcow2-nbd}
    [ -x "$BIN" ] || die "no release binary at $BIN"
}

# ---------------------------------------------------------------------------------------------
# Servers. start_server KIND IMAGE [SETTINGS...]: KIND is qemu, ours or raw (our server with
# -f raw); SETTINGS are key=value pairs applied to both servers the same way: l2=SIZE,
# slice=SIZE, clean=SECONDS, ro=1, tcp=PORT (listen on 127.0.0.1:PORT instead of $SOCK),
# tls=DIR (require TLS with the x509 server credentials in DIR, no client certificate),
# cache=MODE (default none: O_DIRECT), shared=N (-e N); threads=N and metrics=ADDR:PORT are
# ours only (--threads, --metrics).
start_server() {
    local kind=$1 image=$2
    shift 2
    local l2="" slice="" clean="" ro=0 tcp="" tls="" cache=none shared=1 threads=1 metrics="" kv
    for kv in "$@"; do
        case $kv in
        l2=*) l2=${kv#l2=} ;;
        slice=*) slice=${kv#slice=} ;;
        clean=*) clean=${kv#clean=} ;;
        ro=*) ro=${kv#ro=} ;;
        tcp=*) tcp=${kv#tcp=} ;;
        tls=*) tls=${kv#tls=} ;;
        cache=*) cache=${kv#cache=} ;;
        shared=*) shared=${kv#shared=} ;;
        threads=*) threads=${kv#threads=} ;;
        metrics=*) metrics=${kv#metrics=} ;;
        *) die "unknown server setting $kv" ;;
        esac
    done
    rm -f "$SOCK" "$WORK/server.pid"
    # Where to listen and TLS: the same flags for both servers.
    local endpoint=(-k "$SOCK")
    [ -n "$tcp" ] && endpoint=(-b 127.0.0.1 -p "$tcp")
    local tlsargs=()
    [ -n "$tls" ] && tlsargs=(--object "tls-creds-x509,id=tls0,dir=$tls,endpoint=server,verify-peer=off"
        --tls-creds tls0)
    local args=()
    case $kind in
    qemu)
        local opts="driver=qcow2,file.driver=file,file.filename=$image"
        [ -n "$l2" ] && opts+=",l2-cache-size=$l2"
        [ -n "$slice" ] && opts+=",l2-cache-entry-size=$slice"
        [ -n "$clean" ] && opts+=",cache-clean-interval=$clean"
        args=(qemu-nbd -t "${endpoint[@]}" "${tlsargs[@]}" --cache="$cache" --aio="$QEMU_AIO"
            -e "$shared" --pid-file="$WORK/server.pid")
        [ "$ro" = 1 ] && args+=(-r)
        args+=(--image-opts "$opts")
        ;;
    ours | raw)
        args=("$BIN" serve -t "${endpoint[@]}" "${tlsargs[@]}" --cache "$cache" --aio io_uring
            -e "$shared" --threads "$threads" --pid-file "$WORK/server.pid")
        if [ "$kind" = raw ]; then args+=(-f raw); else args+=(-f qcow2); fi
        [ -n "$l2" ] && args+=(--l2-cache-size "$l2")
        [ -n "$slice" ] && args+=(--l2-cache-entry-size "$slice")
        [ -n "$clean" ] && args+=(--cache-clean-interval "$clean")
        [ "$ro" = 1 ] && args+=(-r)
        [ -n "$metrics" ] && args+=(--metrics "$metrics")
        args+=("$image")
        ;;
    *) die "unknown server kind $kind" ;;
    esac
    "${args[@]}" >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    local i
    for i in $(seq 1 600); do
        if [ -n "$tcp" ]; then
            [ -s "$WORK/server.pid" ] && [ -n "$(ss -Hltn "sport = :$tcp")" ] && return 0
        elif [ -S "$SOCK" ] && [ -s "$WORK/server.pid" ]; then return 0; fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.05
    done
    cat "$WORK/server.log" >&2
    die "$kind server did not start: ${args[*]}"
}

stop_server() {
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}

# status_kib FIELD: a /proc/PID/status field of the running server, in KiB.
status_kib() { awk -v f="$1:" '$1 == f { print $2 }' "/proc/$SERVER_PID/status"; }

# The URI fio connects to: NBD_URI when a group sets it (tls), else the Unix socket.
NBD_URI=""
URI() { if [ -n "$NBD_URI" ]; then printf '%s' "$NBD_URI"; else printf 'nbd+unix:///?socket=%s' "$SOCK"; fi; }

# server_usage: the running server's CPU time in clock ticks (all its threads, exited ones
# included) and the bytes it read and wrote on storage (O_DIRECT and io_uring I/O included).
server_usage() {
    local stat
    stat=$(<"/proc/$SERVER_PID/stat")
    stat=${stat##*) } # fields after "pid (comm) ": utime and stime are the 12th and 13th
    awk '{ printf "%d ", $12 + $13 }' <<<"$stat"
    awk '$1 == "read_bytes:" { r = $2 } $1 == "write_bytes:" { w = $2 } END { print r + w }' \
        "/proc/$SERVER_PID/io"
}

# run_fio DIRECTION ARGS...: runs fio against the server and prints the job's
# "IOPS MiB/s runtime_ms cpu_us_per_request disk_kib_per_request" for DIRECTION (read or
# write), from fio's terse output (v3) and the server's /proc counters. With a ramp time the
# counters start when the ramp ends (timed from the server accepting fio's connection, seen as
# a new descriptor), so they cover the requests fio counts.
run_fio() {
    local dir=$1 ramp=0 arg snap="" out after fds
    shift
    for arg in "$@"; do case $arg in --ramp_time=*) ramp=${arg#--ramp_time=} ;; esac; done
    server_usage >"$WORK/usage.before"
    if [ "$ramp" != 0 ]; then
        fds=$(find "/proc/$SERVER_PID/fd" -mindepth 1 | wc -l)
        (
            for _ in $(seq 1 1000); do
                [ "$(find "/proc/$SERVER_PID/fd" -mindepth 1 | wc -l)" -gt "$fds" ] && break
                sleep 0.005
            done
            sleep "$ramp" && server_usage >"$WORK/usage.before"
        ) &
        snap=$!
    fi
    out=$(fio --name=bench --ioengine=nbd --uri="$(URI)" --output-format=terse \
        --terse-version=3 "$@" 2>"$WORK/fio.err") || {
        cat "$WORK/fio.err" >&2
        die "fio failed: $*"
    }
    after=$(server_usage)
    [ -n "$snap" ] && wait "$snap"
    # terse v3 (the nbd engine also prints a line of its own): read kb/bw(KiB/s)/iops/
    # runtime(ms) at fields 6..9, write at 47..50.
    echo "$out" | awk -F';' -v d="$dir" -v hz="$CLK_TCK" -v before="$(<"$WORK/usage.before")" \
        -v after="$after" '$1 == "3" {
        if (d == "read") { iops = $8; bw = $7 / 1024; ms = $9 }
        else { iops = $49; bw = $48 / 1024; ms = $50 }
        split(before, b, " "); split(after, a, " ")
        n = iops * ms / 1000
        if (n < 1) { cpu = "-"; disk = "-" }
        else { cpu = sprintf("%.1f", (a[1] - b[1]) * 1e6 / hz / n)
               disk = sprintf("%.1f", (a[2] - b[2]) / 1024 / n) }
        printf "%s %.1f %s %s %s\n", iops, bw, ms, cpu, disk }'
}

record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"; } # scenario, server, value

# record_usage SCENARIO KIND CPU DISK: the server's cost per request in this run.
record_usage() {
    record "cpu $1" "$2" "$3"
    record "disk $1" "$2" "$4"
}

median() { # median of the values recorded for (scenario, server)
    awk -F'\t' -v s="$1" -v k="$2" '$1 == s && $2 == k && $3 != "-" { print $3 }' "$RESULTS" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2];
              else printf "%.6g\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# order ROUND: the alternation, qemu first in odd rounds and ours first in even ones.
order() { if [ $(($1 % 2)) = 1 ]; then echo "qemu ours"; else echo "ours qemu"; fi; }

copy_image() { cp --sparse=always "$1" "$2"; }

# hwm_mib: the running server's peak RSS (VmHWM) in MiB.
hwm_mib() { awk '$1 == "VmHWM:" { printf "%.1f\n", $2 / 1024 }' "/proc/$SERVER_PID/status"; }

bytes() { # 64k -> 65536
    local v=$1
    case $v in
    *k | *K) echo $((${v%?} << 10)) ;; *M) echo $((${v%M} << 20)) ;; *G) echo $((${v%G} << 30)) ;;
    *) echo "$v" ;;
    esac
}

# ---------------------------------------------------------------------------------------------
# Allocation: 4 KiB writes into an empty image, each to a fresh allocation unit (a cluster, or
# a subcluster with extended L2; at least 4 KiB), in the same random order for both servers (a
# replayed fio iolog). ALLOC_CONFIGS lists LABEL:CLUSTER:EXTENDED_L2 entries. By default the
# image is an overlay over a fully written raw backing file of ALLOC_BACKING_MIB; with
# ALLOC_BACKING=none it has no backing file (the same size) and lives in ALLOC_DIR (default
# WORK), served with ALLOC_CACHE (default none). Records under "ALLOC_KEY LABEL" (default
# alloc): IOPS, CPU and disk per request, and each server's peak RSS as "hwm ALLOC_KEY LABEL";
# the physical limit, our server writing 4 KiB at random to a raw file of the same kind, as
# "ALLOC_KEY raw".
alloc_scenarios() {
    local dir=${ALLOC_DIR:-$WORK} cache=${ALLOC_CACHE:-none} size=$((ALLOC_BACKING_MIB << 20))
    local backing=$dir/backing.raw key=${ALLOC_KEY:-alloc} mode=${ALLOC_BACKING:-raw}
    if [ "$mode" = none ]; then
        truncate -s "$size" "$backing" # the limit's target: a sparse raw file
    else
        log "allocation: writing a ${ALLOC_BACKING_MIB} MiB backing file"
        fio --name=fill --filename="$backing" --rw=write --bs=1M --size="$size" --direct=1 \
            --refill_buffers --output-format=terse >/dev/null
    fi
    local cfg label cluster ext unit units n r kind cpu disk hwm
    for cfg in $ALLOC_CONFIGS; do
        IFS=: read -r label cluster ext <<<"$cfg"
        cluster=$(bytes "$cluster")
        if [ "$ext" = on ]; then unit=$((cluster / 32)); else unit=$cluster; fi
        [ "$unit" -lt 4096 ] && unit=4096
        units=$((size / unit))
        n=$((ALLOC_IOS < units ? ALLOC_IOS : units))
        alloc_iolog "$label" "$unit" "$n" "$units" $((ALLOC_QD > 1 ? 2 * ALLOC_QD : 0)) \
            >"$WORK/alloc.iolog"
        for r in $(seq 1 "$ROUNDS"); do
            for kind in $(order "$r"); do
                if [ "$mode" = none ]; then
                    qemu-img create -q -f qcow2 -o cluster_size="$cluster",extended_l2="$ext" \
                        "$dir/overlay.qcow2" "$size"
                else
                    qemu-img create -q -f qcow2 -b backing.raw -F raw \
                        -o cluster_size="$cluster",extended_l2="$ext" "$dir/overlay.qcow2"
                fi
                start_server "$kind" "$dir/overlay.qcow2" cache="$cache"
                stats=$(run_fio write --read_iolog="$WORK/alloc.iolog" \
                    --size="$size" --iodepth="$ALLOC_QD")
                read -r iops _ _ cpu disk <<<"$stats"
                hwm=$(hwm_mib)
                stop_server
                qemu-img check -q "$dir/overlay.qcow2" ||
                    die "$kind left a corrupt overlay ($label)"
                record "$key $label" "$kind" "$iops"
                record_usage "$key $label" "$kind" "$cpu" "$disk"
                record "hwm $key $label" "$kind" "$hwm"
                log "$key $label round $r $kind: $iops IOPS ($n writes), peak RSS $hwm MiB"
                rm -f "$dir/overlay.qcow2"
            done
        done
    done
    # The physical limit: random 4 KiB writes to the raw file itself through our server (the
    # backing file is no longer needed, so it is the target: no second copy on disk).
    for r in $(seq 1 "$ROUNDS"); do
        start_server raw "$backing" cache="$cache"
        stats=$(run_fio write --rw=randwrite --bs=4k --iodepth="$ALLOC_QD" \
            --size="$size" --runtime="$RUNTIME" --time_based --ramp_time=1)
        read -r iops _ _ cpu disk <<<"$stats"
        hwm=$(hwm_mib)
        stop_server
        record "$key raw" raw "$iops"
        record_usage "$key raw" raw "$cpu" "$disk"
        record "hwm $key raw" raw "$hwm"
        log "$key raw limit round $r: $iops IOPS"
    done
    rm -f "$backing"
}

# ---------------------------------------------------------------------------------------------
# Allocation at queue depth 32 against the disk's own limit: 4 KiB writes into an empty image
# of QD32_MIB, each to a fresh allocation unit in the same random order for both servers (as
# in alloc_scenarios), for each QD32_CONFIGS entry (LABEL:CLUSTER:EXTENDED_L2), without
# backing file and over a fully written raw backing file of the same size (QD32_MODES, "none
# backing"). Beside the two servers in every round and row, the physical limit: fio writing as
# many 4 KiB blocks at random (O_DIRECT, io_uring, QD32) into a fresh sparse raw file of the
# same size whose length was set first, allocating writes that do not extend the file.
# Records under "qd32 LABEL MODE": IOPS (the limit as kind raw), CPU and disk per request, the
# image's disk use after the run in MiB ("du qd32 ...") and peak RSS ("hwm qd32 ...").
QD32_CONFIGS=${QD32_CONFIGS:-"std-64k:64k:off ext-128k/4k:128k:on ext-2m/64k:2M:on"}
QD32_MODES=${QD32_MODES:-"none backing"}

# alloc_iolog LABEL UNIT N UNITS [TAIL]: the fio iolog of N 4 KiB writes, each at the start
# of a distinct one of UNITS allocation units of UNIT bytes, in an order fixed by LABEL
# (offsets printed with %.0f: mawk's %d stops at 2 GiB), then TAIL 4 KiB reads of the first
# write's place. At queue depth, fio disconnects as the log ends without waiting for what is
# in flight, and qemu-nbd drops some of those requests where ours carries them out: the
# reads (of data already written, changing nothing on disk) are what is left in flight
# then, so both servers carry out every write, and disk use compares the same work.
alloc_iolog() {
    echo "fio version 2 iolog"
    echo "nbd add"
    echo "nbd open"
    shuf -i 0-$(($4 - 1)) -n "$3" --random-source=<(yes "$1") |
        awk -v u="$2" -v tail="${5:-0}" '{ printf "nbd write %.0f 4096\n", $1 * u }
            NR == 1 { first = $1 * u }
            END { for (i = 0; i < tail; i++) printf "nbd read %.0f 4096\n", first }'
    echo "nbd close"
}

du_mib() { awk -v b="$(($(stat -c '%b * %B' "$1")))" 'BEGIN { printf "%.1f\n", b / 1048576 }'; }

# qd32_limit FILE SIZE N [BS]: fio's rate of N random BS-byte (default 4 KiB) O_DIRECT writes
# at QD32 into a fresh sparse raw FILE of SIZE bytes (its length set beforehand).
qd32_limit() {
    local bs=${4:-4096}
    rm -f "$1"
    truncate -s "$2" "$1"
    fio --name=limit --filename="$1" --ioengine=io_uring --direct=1 --rw=randwrite --bs="$bs" \
        --iodepth=32 --size="$2" --io_size=$(($3 * bs)) --output-format=terse \
        --terse-version=3 2>"$WORK/fio.err" | awk -F';' '$1 == "3" { print $49 }'
}

# qd32_copy_limit BACKING SPARSE SIZE N UNIT: the rate of N copy-on-write pairs of UNIT bytes
# any server could reach over BACKING: fio reading N random UNIT-sized blocks of BACKING and
# writing as many into a fresh sparse raw file SPARSE of SIZE bytes at the same time (O_DIRECT,
# io_uring, QD16 each: 32 in flight in all), pairs per second by the slower of the two.
qd32_copy_limit() {
    local bs=$5
    rm -f "$2"
    truncate -s "$3" "$2"
    fio --ioengine=io_uring --direct=1 --bs="$bs" --iodepth=16 --size="$3" \
        --io_size=$(($4 * bs)) --output-format=terse --terse-version=3 \
        --name=read --filename="$1" --rw=randread \
        --name=write --filename="$2" --rw=randwrite 2>"$WORK/fio.err" |
        awk -F';' -v n="$4" '$1 == "3" { ms = $9 > $50 ? $9 : $50; if (ms > max) max = ms }
            END { if (max > 0) printf "%.0f\n", n * 1000 / max; else print "-" }'
    rm -f "$2"
}

qd32_scenarios() {
    local size=$((QD32_MIB << 20)) n=$QD32_IOS mode cfg label cluster ext unit units r kind
    local key img stats iops cpu disk hwm
    local backing=$WORK/qd32-backing.raw
    for mode in $QD32_MODES; do
        if [ "$mode" = backing ]; then
            log "qd32: writing a ${QD32_MIB} MiB backing file"
            fio --name=fill --filename="$backing" --rw=write --bs=1M --size="$size" --direct=1 \
                --refill_buffers --output-format=terse >/dev/null
        fi
        for r in $(seq 1 "$ROUNDS"); do
            for cfg in $QD32_CONFIGS; do
                IFS=: read -r label cluster ext <<<"$cfg"
                cluster=$(bytes "$cluster")
                if [ "$ext" = on ]; then unit=$((cluster / 32)); else unit=$cluster; fi
                [ "$unit" -lt 4096 ] && unit=4096
                units=$((size / unit))
                alloc_iolog "$label" "$unit" $((n < units ? n : units)) "$units" 64 \
                    >"$WORK/qd32.iolog"
                key="qd32 $label $mode"
                for kind in $(order "$r") raw; do
                    img=$WORK/qd32.qcow2
                    if [ "$kind" = raw ]; then
                        iops=$(qd32_limit "$WORK/qd32-limit.raw" "$size" "$n")
                        record "$key" raw "$iops"
                        record "du $key" raw "$(du_mib "$WORK/qd32-limit.raw")"
                        rm -f "$WORK/qd32-limit.raw"
                        log "$key round $r limit (fio, sparse raw): $iops IOPS"
                        # The same writes through NBD: our server exporting a fresh sparse raw
                        # file, fio's nbd engine as for the two servers. What the client and
                        # the NBD hop leave of the limit, with no qcow2 in the way.
                        truncate -s "$size" "$WORK/qd32-limit.raw"
                        start_server raw "$WORK/qd32-limit.raw"
                        read -r iops _ <<<"$(run_fio write --read_iolog="$WORK/qd32.iolog" \
                            --size="$size" --iodepth=32)"
                        stop_server
                        rm -f "$WORK/qd32-limit.raw"
                        record "$key" export "$iops"
                        log "$key round $r limit (our raw export of a sparse raw file): $iops IOPS"
                        if [ "$mode" = backing ] && [ "$unit" -gt 4096 ]; then
                            # Over a backing file each write must write its whole allocation
                            # unit (the copied bytes around its own): the same count of
                            # unit-sized writes bounds any server from above.
                            iops=$(qd32_limit "$WORK/qd32-limit.raw" "$size" "$n" "$unit")
                            record "$key" cow "$iops"
                            rm -f "$WORK/qd32-limit.raw"
                            log "$key round $r limit for $unit-byte writes: $iops IOPS"
                            # And the copy itself: the unit read from the backing file too.
                            iops=$(qd32_copy_limit "$backing" "$WORK/qd32-limit.raw" "$size" \
                                "$n" "$unit")
                            record "$key" copy "$iops"
                            log "$key round $r limit for $unit-byte copies: $iops per second"
                        fi
                        continue
                    fi
                    if [ "$mode" = backing ]; then
                        qemu-img create -q -f qcow2 -b qd32-backing.raw -F raw \
                            -o cluster_size="$cluster",extended_l2="$ext" "$img"
                    else
                        qemu-img create -q -f qcow2 -o cluster_size="$cluster",extended_l2="$ext" \
                            "$img" "$size"
                    fi
                    start_server "$kind" "$img"
                    stats=$(run_fio write --read_iolog="$WORK/qd32.iolog" --size="$size" \
                        --iodepth=32)
                    read -r iops _ _ cpu disk <<<"$stats"
                    hwm=$(hwm_mib)
                    stop_server
                    qemu-img check -q "$img" || die "$kind left a corrupt image ($key)"
                    record "$key" "$kind" "$iops"
                    record_usage "$key" "$kind" "$cpu" "$disk"
                    record "du $key" "$kind" "$(du_mib "$img")"
                    record "hwm $key" "$kind" "$hwm"
                    log "$key round $r $kind: $iops IOPS, $cpu µs/req, $(du_mib "$img") MiB on disk"
                    rm -f "$img"
                done
            done
        done
        rm -f "$backing"
    done
}

# qd32_table: the markdown table of qd32_scenarios' medians.
qd32_table() {
    local mode cfg label q o w c p x
    echo "| 4 KiB random writes, QD32, empty ${QD32_MIB} MiB image | qemu-nbd IOPS | ours IOPS | ours / qemu-nbd | limit: fio, sparse raw | ours / limit | limit through NBD: our raw export | ours / it | limit, unit-sized writes | ours / it | limit, unit-sized copies | ours / it | CPU µs/req q / o | disk use MiB q / o / limit |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for mode in $QD32_MODES; do
        for cfg in $QD32_CONFIGS; do
            IFS=: read -r label _ _ <<<"$cfg"
            local key="qd32 $label $mode"
            q=$(median "$key" qemu) o=$(median "$key" ours) w=$(median "$key" raw)
            c=$(median "$key" cow) p=$(median "$key" copy) x=$(median "$key" export)
            [ "$q$o" = -- ] && continue
            printf '| %s, %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s / %s |\n' "$label" \
                "$([ "$mode" = backing ] && echo "over a backing file" || echo "no backing file")" \
                "$q" "$o" "$(qd32_ratio "$o" "$q")" "$w" "$(qd32_ratio "$o" "$w")" \
                "$x" "$(qd32_ratio "$o" "$x")" \
                "$c" "$(qd32_ratio "$o" "$c")" "$p" "$(qd32_ratio "$o" "$p")" \
                "$(median "cpu $key" qemu)" "$(median "cpu $key" ours)" \
                "$(median "du $key" qemu)" "$(median "du $key" ours)" "$(median "du $key" raw)"
        done
    done
}
qd32_ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/ || b == 0) print "-"; else printf "%.2f\n", a / b }'; }

# ---------------------------------------------------------------------------------------------
# build_chain DIR DEPTH MIB: a chain of DEPTH qcow2 layers (64 KiB clusters) of MIB MiB in DIR,
# DIR/top.qcow2 its top. Layer k holds every cluster i with i % DEPTH == k, written with
# pattern i % 251 + 1, so every depth reads as the same guest data.
build_chain() {
    local dir=$1 depth=$2 mib=$3 k i prev="" cmds name
    local clusters=$(((mib << 20) / 65536))
    mkdir -p "$dir"
    # One empty layer, copied: creating 1000 images one by one costs a process each.
    qemu-img create -q -f qcow2 "$dir/empty.qcow2" "${mib}M"
    for k in $(seq 0 $((depth - 1))); do
        name=$(printf 'layer%04d.qcow2' "$k")
        # The layer is written with no backing, then pointed at the one below (unsafe rebase:
        # only the header changes), so building stays linear in the depth.
        cp "$dir/empty.qcow2" "$dir/$name"
        cmds=()
        for ((i = k; i < clusters; i += depth)); do
            cmds+=(-c "write -q -P $((i % 251 + 1)) $((i * 65536)) 64k")
        done
        [ ${#cmds[@]} -gt 0 ] && qemu-io -f qcow2 "${cmds[@]}" "$dir/$name" >/dev/null
        [ -n "$prev" ] && qemu-img rebase -u -f qcow2 -b "$prev" -F qcow2 "$dir/$name"
        prev=$name
    done
    rm -f "$dir/empty.qcow2"
    ln -sf "$prev" "$dir/top.qcow2"
}
