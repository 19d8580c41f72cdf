#!/usr/bin/env bash
# Writes build/hot-code.txt: the functions of the release binary that run when it starts,
# opens an image, converts a chain and serves a client, so that build.rs can have the linker
# place them side by side at the start of the code.
#
# Why: the kernel maps a program's code into memory 64 KiB around each first touch
# (fault-around), and a statically linked Rust binary's start-up and request path touch
# code spread over all of its text, so nearly all of it became resident. Placed together,
# that code fills a few such windows (benches/seeds.sh reports the peak RSS it leads to).
#
# The list names mangled symbols; a stale entry (code renamed or removed since) is skipped
# by the linker and only costs memory, never correctness. Run it again after large changes.
# Needs valgrind (callgrind) and qemu-io (and uses fio with its nbd engine where installed);
# takes about a minute.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
command -v valgrind >/dev/null || { echo "hot-code.sh: valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
command -v qemu-io >/dev/null || { echo "hot-code.sh: qemu-io is needed (qemu-utils)" >&2; exit 1; }
cargo build --release --manifest-path "$repo/Cargo.toml" --bin qcow2-nbd
bin="$repo/target/release/qcow2-nbd"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cg() { valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/cg.$1" "${@:2}"; }

qemu-img create -q -f qcow2 "$work/base.qcow2" 64M
qemu-io -f qcow2 -c 'write -P 0x11 0 4M' "$work/base.qcow2" >/dev/null
qemu-img create -q -f qcow2 -b "$work/base.qcow2" -F qcow2 "$work/top.qcow2" 64M
cg info "$bin" info "$work/top.qcow2" >/dev/null 2>&1
cg convert "$bin" convert -O qcow2 "$work/top.qcow2" "$work/copy.qcow2" >/dev/null 2>&1
# Each way the server does I/O runs its own code: the default (page cache, a thread pool),
# and O_DIRECT with io_uring (what a production export and benches/seeds.sh use), each on an
# image with and one without extended L2 entries.
qemu-img create -q -f qcow2 -o cluster_size=2M,extended_l2=on "$work/ext.qcow2" 64M
uri="nbd+unix:///?socket=$work/s.sock"
serve_start() { # NAME IMAGE SERVE-OPTIONS...: the server under callgrind, once it listens
    valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/cg.$1" \
        "$bin" serve -k "$work/s.sock" -t "${@:3}" "$2" 2>/dev/null &
    server=$!
    for _ in $(seq 120); do [ -S "$work/s.sock" ] && break; sleep 0.5; done
}
serve_stop() {
    kill -TERM "$server"
    wait "$server" || true
    rm -f "$work/s.sock"
}
serve_run() { # NAME IMAGE SERVE-OPTIONS...
    serve_start "$@"
    # Small writes scattered over the image, as a guest's random writes are: each allocates
    # and sends the allocator through its refcount and L2 updates and their write-backs.
    local scattered=()
    for i in $(seq 0 23); do scattered+=(-c "write -P 0x44 $((i * 2731))k 4k"); done
    qemu-io -f raw -c 'read 0 64k' -c 'write -P 0x22 1M 64k' -c 'write -P 0x33 4M 8k' \
        "${scattered[@]}" -c 'write -z 8M 1M' -c 'discard 1M 64k' -c 'flush' -c 'read 0 8M' \
        "$uri" >/dev/null
    qemu-img map --output=json -f raw "$uri" >/dev/null
    serve_stop
}
serve_run serve "$work/top.qcow2"
# libnbd's client (fio's nbd engine, what benches/compare.sh drives) negotiates otherwise
# than qemu-io, and the benchmarks serve read-only with the format given: their start-up and
# request path run functions of their own.
if command -v fio >/dev/null && fio --enghelp=nbd >/dev/null 2>&1; then
    serve_start fio "$work/base.qcow2" -r -f qcow2 -e 1 --threads 1 --cache=none --aio=io_uring
    for job in "--rw=read --bs=1M --iodepth=4" "--rw=randread --bs=4k --iodepth=4 --io_size=256k"; do
        # shellcheck disable=SC2086
        fio --name=hot --ioengine=nbd --uri="$uri" --size=4M $job >/dev/null
    done
    serve_stop
fi
serve_run direct "$work/top.qcow2" --cache=none --aio=io_uring
serve_run ext "$work/ext.qcow2" --cache=none --aio=io_uring

# Every function of the binary that ran, in the order callgrind first lists it, the server's
# runs first (O_DIRECT with io_uring leading, as production exports run): a function the
# server never calls placed among its code would make the server keep that page resident.
python3 - "$work" "$repo/build/hot-code.txt" <<'PY'
import os, re, sys
work, out = sys.argv[1], sys.argv[2]
seen, order = set(), []
for run in ["direct", "fio", "ext", "serve", "info", "convert"]:
    path = work + "/cg." + run
    if not os.path.exists(path):
        continue
    objs, names, current = {}, {}, None
    for line in open(path, errors="replace"):
        m = re.match(r"^c?ob=\((\d+)\)(?: (.*))?", line)
        if m and m.group(2):
            objs[m.group(1)] = m.group(2).strip()
        m = re.match(r"^ob=\((\d+)\)", line)
        if m:
            current = objs.get(m.group(1), "")
        m = re.match(r"^c?fn=\((\d+)\)(?: (.*))?", line)
        if m and m.group(2):
            names[m.group(1)] = m.group(2).strip()
        m = re.match(r"^fn=\((\d+)\)", line)
        if m and current and current.endswith("/qcow2-nbd"):
            name = names.get(m.group(1))
            if name and not name.startswith("0x") and name not in seen:
                seen.add(name)
                order.append(name)
with open(out, "w") as f:
    f.write("\n".join(order) + "\n")
print(f"hot-code.sh: {len(order)} functions written to {out}")
PY
