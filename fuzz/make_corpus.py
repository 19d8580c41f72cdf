#!/usr/bin/env python3
"""Builds the fuzz seed corpora from real images made by qemu-img.

For each target it writes inputs in the layout the target expects (see fuzz_targets/*.rs):
  header            first cluster of each image
  l1_l2             selector byte + L1 table, selector byte + each L2 table
  refcount          order byte + refcount table, order byte + each refcount block
  snapshot_table    nb_snapshots (u16 BE) + cluster_bits-9 + snapshot table bytes
  bitmap_directory  nb_bitmaps (u16 BE) + cluster_bits-9 + bitmap directory bytes
  open_info         whole image files (small clusters keep them small)
  luks_header       the fixed LUKS header of encrypted images (the target pads the rest)

Usage: make_corpus.py CORPUS_DIR   (needs qemu-img and qemu-io; binary corpora are not
committed, this script recreates them).
"""

import os
import shutil
import struct
import subprocess
import sys
import tempfile

MAX_OPEN_INFO = 1 << 20  # libFuzzer inputs stay small; larger images seed the other targets


def run(*args, cwd):
    subprocess.run(args, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def make_images(d):
    """(name, create options, extra commands) for a spread of real layouts."""
    specs = [
        ("c512", "cluster_size=512", []),
        ("c1k-rc1", "cluster_size=1024,refcount_bits=1", []),
        ("c2k-rc2", "cluster_size=2048,refcount_bits=2", []),
        ("c4k-rc4", "cluster_size=4096,refcount_bits=4", []),
        ("c4k-rc8", "cluster_size=4096,refcount_bits=8", []),
        ("c4k-rc32", "cluster_size=4096,refcount_bits=32", []),
        ("c4k-rc64", "cluster_size=4096,refcount_bits=64", []),
        ("v2-c512", "compat=0.10,cluster_size=512", []),
        ("ext16k", "cluster_size=16384,extended_l2=on", []),
        ("zstd-c4k", "cluster_size=4096,compression_type=zstd", []),
        ("lazy-c1k", "cluster_size=1024,lazy_refcounts=on", []),
        ("snap-c512", "cluster_size=512", [["snapshot", "-c", "one", "{img}"], ["snapshot", "-c", "two", "{img}"]]),
        ("bm-c4k", "cluster_size=4096", [["bitmap", "--add", "{img}", "b0"], ["bitmap", "--add", "-g", "1M", "--disable", "{img}", "b1"]]),
        ("df-c4k", "cluster_size=4096,data_file=df-c4k.raw,data_file_raw=on", []),
        ("c64k", "", [["snapshot", "-c", "s", "{img}"], ["bitmap", "--add", "{img}", "b"]]),
    ]
    images = []
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "base.qcow2", "1M", cwd=d)
    for name, opts, cmds in specs:
        path = name + ".qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", "-o", opts or "cluster_size=65536", path, "1M", cwd=d)
        if not name.startswith("df"):
            run("qemu-io", "-f", "qcow2", "-c", "write -P 5 0 20k", "-c", "write -z 40k 8k", path, cwd=d)
            if "ext" in name:
                run("qemu-io", "-f", "qcow2", "-c", "write -P 6 65k 1k", path, cwd=d)
        for cmd in cmds:
            run("qemu-img", *[path if a == "{img}" else a for a in cmd], cwd=d)
        images.append(path)
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "-b", "base.qcow2", "-F", "qcow2",
        "top.qcow2", cwd=d)
    images.append("top.qcow2")
    run("qemu-img", "convert", "-c", "-O", "qcow2", "-o", "cluster_size=4096", "c4k-rc8.qcow2", "compressed.qcow2",
        cwd=d)
    images.append("compressed.qcow2")
    return images


def u32(b, o):
    return struct.unpack_from(">I", b, o)[0]


def u64(b, o):
    return struct.unpack_from(">Q", b, o)[0]


def seeds_for(data, name, out):
    def put(target, tag, payload):
        os.makedirs(os.path.join(out, target), exist_ok=True)
        with open(os.path.join(out, target, f"seed-{name}-{tag}"), "wb") as f:
            f.write(payload)

    cluster_bits = u32(data, 20)
    cs = 1 << cluster_bits
    version = u32(data, 4)
    incompat = u64(data, 72) if version >= 3 else 0
    refcount_order = u32(data, 96) if version >= 3 else 4
    extended = bool(incompat & 16)
    header_length = u32(data, 100) if version >= 3 else 72
    put("header", "first-cluster", data[:cs])
    if len(data) <= MAX_OPEN_INFO:
        put("open_info", "image", data)

    selector = (cluster_bits - 9) | (0x10 if extended else 0) | (0x20 if incompat & 4 else 0)
    l1_size, l1_off = u32(data, 36), u64(data, 40)
    l1 = data[l1_off:l1_off + 8 * l1_size]
    put("l1_l2", "l1", bytes([selector]) + l1)
    for i in range(l1_size):
        l2_off = u64(l1, 8 * i) & 0x00FFFFFFFFFFFE00
        if l2_off:
            put("l1_l2", f"l2-{i}", bytes([selector]) + data[l2_off:l2_off + cs])

    rt_off, rt_clusters = u64(data, 48), u32(data, 56)
    table = data[rt_off:rt_off + cs * rt_clusters]
    put("refcount", "table", bytes([refcount_order]) + table)
    for i in range(len(table) // 8):
        block = u64(table, 8 * i)
        if block:
            put("refcount", f"block-{i}", bytes([refcount_order]) + data[block:block + cs])

    nb_snapshots, snap_off = u32(data, 60), u64(data, 64)
    if nb_snapshots:
        end, pos = snap_off, snap_off
        for _ in range(nb_snapshots):
            extra = u32(data, pos + 36)
            id_len, name_len = struct.unpack_from(">HH", data, pos + 12)
            end = pos + 40 + extra + id_len + name_len
            pos = (end + 7) & ~7
        put("snapshot_table", "table",
            struct.pack(">HB", nb_snapshots, cluster_bits - 9) + data[snap_off:end])

    # Walk the header extensions for the bitmaps extension.
    pos = header_length
    while pos + 8 <= cs:
        magic, length = u32(data, pos), u32(data, pos + 4)
        if magic == 0:
            break
        if magic == 0x23852875 and length == 24:
            nb, dir_size, dir_off = u32(data, pos + 8), u64(data, pos + 16), u64(data, pos + 24)
            put("bitmap_directory", "dir",
                struct.pack(">HB", nb, cluster_bits - 9) + data[dir_off:dir_off + dir_size])
        pos += 8 + ((length + 7) & ~7)


REQUEST_MAGIC, EXTENDED_REQUEST_MAGIC = 0x25609513, 0x21E41C71


def luks_seeds(d, out):
    """The LUKS headers of encrypted images, default and other ciphers and hashes."""
    os.makedirs(os.path.join(out, "luks_header"), exist_ok=True)
    specs = [
        ("xts256", ""),
        ("cbc128-sha1", ",encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.hash-alg=sha1"),
        ("plain-sha512", ",encrypt.ivgen-alg=plain,encrypt.hash-alg=sha512"),
    ]
    for name, extra in specs:
        path = f"luks-{name}.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", "--object", "secret,id=s,data=password", "-o",
            "encrypt.format=luks,encrypt.key-secret=s,encrypt.iter-time=1" + extra, path, "1M", cwd=d)
        with open(os.path.join(d, path), "rb") as f:
            data = f.read()
        # The full-disk-encryption extension (0x0537be77) says where the LUKS area is.
        pos = u32(data, 100)
        while pos + 8 <= len(data):
            kind, length = u32(data, pos), u32(data, pos + 4)
            if kind == 0:
                break
            if kind == 0x0537BE77:
                offset = u64(data, pos + 8)
                with open(os.path.join(out, "luks_header", f"seed-{name}"), "wb") as f:
                    f.write(data[offset:offset + 592])
                break
            pos += 8 + (length + 7) // 8 * 8


def nbd_request(cmd, offset, length, flags=0, cookie=1, extended=False, payload=b""):
    if extended:
        head = struct.pack(">IHHQQQ", EXTENDED_REQUEST_MAGIC, flags, cmd, cookie, offset, length)
    else:
        head = struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, cookie, offset, length)
    return head + payload


def nbd_seeds(out):
    """Seeds for the NBD targets: valid request streams in each reply mode, and wire units."""
    def put(target, tag, payload):
        d = os.path.join(out, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, tag), "wb") as f:
            f.write(payload)
    for mode in range(3):
        ext = mode == 2
        reqs = [
            nbd_request(1, 4096, 8, cookie=1, extended=ext, payload=b"abcdefgh"),  # WRITE
            nbd_request(1, 0, 512, flags=1, cookie=2, extended=ext, payload=bytes(512)),  # FUA
            nbd_request(0, 0, 16384, cookie=3, extended=ext),  # READ
            nbd_request(0, 0, 8192, flags=4, cookie=4, extended=ext),  # READ, DF
            nbd_request(7, 0, 1 << 20, cookie=5, extended=ext),  # BLOCK_STATUS
            nbd_request(6, 8192, 4096, flags=2, cookie=6, extended=ext),  # WRITE_ZEROES
            nbd_request(4, 65536, 65536, cookie=7, extended=ext),  # TRIM
            nbd_request(5, 0, 4096, cookie=8, extended=ext),  # CACHE
            nbd_request(3, 0, 0, cookie=9, extended=ext),  # FLUSH
            nbd_request(0, (1 << 20) - 4, 8, cookie=10, extended=ext),  # READ past the end
        ]
        put("nbd_session", f"mode{mode}", bytes([mode]) + b"".join(reqs)
            + nbd_request(2, 0, 0, cookie=11, extended=ext))
        put("nbd_wire", f"request{mode}", bytes([1 if ext else 0]) + reqs[mode])
    # From the first byte: client flags, then OPT_LIST, OPT_INFO and OPT_ABORT.
    opt = lambda o, d=b"": struct.pack(">QII", 0x49484156454F5054, o, len(d)) + d
    info = struct.pack(">I", 0) + struct.pack(">H", 1) + struct.pack(">H", 3)
    meta = struct.pack(">I", 0) + struct.pack(">I", 1) + struct.pack(">I", 5) + b"qemu:"
    put("nbd_session", "options", bytes([3]) + struct.pack(">I", 3)
        + opt(3) + opt(6, info) + opt(9, meta) + opt(2))
    put("nbd_wire", "option_header", bytes([2]) + opt(6))
    put("nbd_wire", "info_request", bytes([4]) + info)
    put("nbd_wire", "meta_request", bytes([5]) + meta)
    put("nbd_wire", "block_status", bytes([10]) + struct.pack(">IIIII", 1, 4096, 0, 8192, 3))
    # A server's side of a listing, as ours answers `-L` (first byte: read size): greeting,
    # extended headers acknowledged, one export, its information and its contexts.
    rep = lambda o, t, d=b"": struct.pack(">QIII", 0x0003E889045565A9, o, t, len(d)) + d
    greeting = struct.pack(">QQH", 0x4E42444D41474943, 0x49484156454F5054, 3)
    export = struct.pack(">I", 4) + b"disk" + b"a disk"
    listing = (greeting + rep(11, 1) + rep(3, 2, export) + rep(3, 1)
               + rep(6, 3, struct.pack(">HQH", 0, 1 << 20, 0x4ED))
               + rep(6, 3, struct.pack(">HIII", 3, 1, 4096, 1 << 25)) + rep(6, 1)
               + rep(9, 4, struct.pack(">I", 0) + b"base:allocation") + rep(9, 1))
    put("nbd_list_reply", "listing", bytes([255]) + listing)
    put("nbd_list_reply", "bytewise", bytes([1]) + listing)
    put("nbd_list_reply", "tls_required", bytes([64]) + greeting + rep(11, 0x80000005)
        + rep(8, 0x80000005) + rep(3, 0x80000005, b"Option 0x3 not permitted before TLS"))
    # The image tools' client after a handshake (see nbd_client_reply.rs for the layout): a
    # read answered with a data and a hole chunk, block status, a write refused with an error
    # chunk, a flush; and the same requests with simple replies only.
    def client_setup(flags, n_ops, size_sectors=2048, context=1):
        return (bytes([flags, 9, 0]) + struct.pack(">IB", size_sectors, 0)
                + struct.pack(">I", context) + bytes([n_ops]))
    op = lambda kind, offset, length: struct.pack(">BHH", kind, offset // 512, length)
    chunk = lambda flags, kind, cookie, payload: (struct.pack(">IHHQI", 0x668E33EF, flags, kind,
                                                               cookie, len(payload)) + payload)
    simple = lambda cookie, errno=0: struct.pack(">IIQ", 0x67446698, errno, cookie)
    ops = op(0, 4096, 1024) + op(1, 0, 8) + op(2, 0, 512) + op(5, 0, 0)
    structured = (chunk(0, 1, 1, struct.pack(">Q", 4096) + bytes(range(256)) * 2)
                  + chunk(1, 2, 1, struct.pack(">QI", 4096 + 512, 512))
                  + chunk(1, 5, 2, struct.pack(">IIIII", 1, 1024, 3, 3072, 0))
                  + chunk(1, 0x8001, 3, struct.pack(">IH", 28, 5) + b"nospc")
                  + simple(4))
    put("nbd_client_reply", "structured", bytes([255]) + client_setup(0x47, 4) + ops + structured)
    put("nbd_client_reply", "bytewise", bytes([1]) + client_setup(0x47, 4) + ops + structured)
    # Without base:allocation no block status request is sent, so the write is request 2.
    plain = simple(1) + bytes(1024) + simple(2, 28) + simple(3)
    put("nbd_client_reply", "simple", bytes([255]) + client_setup(0x40, 4) + ops + plain)
    # Key files as psktool writes them, and with the variations the parser accepts.
    put("tls_psk_file", "psktool", b"alice:" + b"6f" * 32 + b"\n")
    put("tls_psk_file", "several", b"alice:00ff\r\n\nhost:port:0102\nbob:ABCD\n")
    # Control-socket sessions as ctl and socat send them (first byte: read sizes, see the target).
    put("qmp_framer", "session", bytes([3, 1, 7, 64]) + b'{"execute":"qmp_capabilities"}\r\n'
        b'{"execute":"block-export-add","arguments":{"id":"a","file":"x.qcow2","writable":true},'
        b'"id":1}{"execute":"query-stats"}\n')
    put("qmp_framer", "odd", bytes([0]) + b'  "s\\"}" 12 [1,{"a":"]"}] true {"a" oops\nnull\n')
    # Scrapes as Prometheus and curl send them (first byte: read size).
    put("metrics_request", "prometheus", bytes([5]) + b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Accept: text/plain;version=0.0.4\r\n\r\n")
    put("metrics_request", "head", bytes([0]) + b"HEAD /metrics?x=1 HTTP/1.0\n\n")


def name_seeds(out):
    """Seeds for the name readers: blkdebug configuration files and json: backing names."""
    def put(target, tag, payload):
        d = os.path.join(out, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, tag), "wb") as f:
            f.write(payload)
    put("blkdebug_rules", "inject", b"[inject-error]\nevent = \"write_aio\"\nerrno = \"28\"\n"
        b"once = \"on\"\n\n[set-state]\nevent = \"l2_load\"\nnew_state = \"2\"\n")
    put("blkdebug_rules", "pairs", b"event=read_aio,errno=5,sector=0,once=on,state=1")
    put("json_backing_name", "file",
        b'json:{"driver":"qcow2","file":{"driver":"file","filename":"base.qcow2"}}')
    put("json_backing_name", "dotted",
        b'json:{"driver":"raw","file.driver":"file","file.filename":"/b"}')
    put("json_backing_name", "blkdebug",
        b"json:{'driver':'qcow2','file':{'driver':'blkdebug','inject-error':[{'event':"
        b"'write_aio','errno':28,'once':true}],'image':{'driver':'file','filename':'/x/b'}}}")
    put("json_backing_name", "null", b'json:{"driver":"raw","file":{"filename":"null-co://"}}')


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    for tool in ("qemu-img", "qemu-io"):
        if shutil.which(tool) is None:
            sys.exit(f"make_corpus.py: {tool} not found; install qemu-utils")
    with tempfile.TemporaryDirectory() as d:
        for image in make_images(d):
            with open(os.path.join(d, image), "rb") as f:
                seeds_for(f.read(), image.removesuffix(".qcow2"), out)
        luks_seeds(d, out)
    nbd_seeds(out)
    name_seeds(out)
    counts = {t: len(os.listdir(os.path.join(out, t))) for t in sorted(os.listdir(out))
              if os.path.isdir(os.path.join(out, t))}
    print("seed corpora:", ", ".join(f"{t} {n}" for t, n in counts.items()))


if __name__ == "__main__":
    main()
