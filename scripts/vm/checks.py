"""The checks of scripts/vm-tests.sh: the kernel's NBD client in one VM per server kind, and
a QEMU guest whose disk is the export. See host.py for the machinery."""

import hashlib
import json
import os
import re
import signal
import subprocess
import time

from host import (MIB, Guest, Hung, Server, create_image, host_sums, image_check, parse_sums,
                  qemu_img, run)

# Offsets in the O_DIRECT export: cluster 4 (128 KiB clusters of 32 subclusters of 4 KiB).
CLUSTER = 128 * 1024
SUB = 4096


class Setup:
    """The servers of one kind and the guest attached to them."""

    def __init__(self, args, kind):
        self.args, self.kind = args, kind
        d = os.path.join(args.scratch, kind)
        os.makedirs(d, exist_ok=True)
        self.dir = d
        self.servers = {}

    def server(self, name, size, shared=1, readonly=False, trace=False, image=None, export="disk"):
        if image is None:
            image = os.path.join(self.dir, f"{name}.qcow2")
            create_image(image, size)
        sock = os.path.join(self.dir, f"{name}.sock")
        s = Server(self.kind, self.args.bin, image, sock, os.path.join(self.dir, f"{name}.log"),
                   shared=shared, readonly=readonly, trace=trace, export=export)
        s.start()
        self.servers[name] = s
        return s

    def log_tails(self, lines=5):
        """The last LINES lines of each server's log, for a check that hung."""
        tails = {}
        for name, s in self.servers.items():
            try:
                tails[name] = open(s.log, errors="replace").read().splitlines()[-lines:]
            except OSError as e:
                tails[name] = [str(e)]
        return tails

    def stop_all(self):
        for s in self.servers.values():
            s.stop()


def readonly_image(setup):
    """An ext4 file system holding one file, made on the host (mkfs.ext4 -d) and turned into
    qcow2 by qemu-img; returns (image, the file's sha256)."""
    src = os.path.join(setup.dir, "ro-src")
    os.makedirs(src, exist_ok=True)
    data = os.urandom(300 * 1024)
    with open(os.path.join(src, "hello"), "wb") as f:
        f.write(data)
    raw = os.path.join(setup.dir, "ro.raw")
    run(["mkfs.ext4", "-q", "-F", "-d", src, raw, "32M"])
    image = os.path.join(setup.dir, "ro.qcow2")
    qemu_img("convert", "-q", "-f", "raw", "-O", "qcow2", raw, image)
    os.unlink(raw)
    return image, hashlib.sha256(data).hexdigest()


def kernel_client(args, kind, results):
    """One VM per server kind: the kernel's client on virtio-serial ports, and a virtio-blk
    disk on QEMU's own NBD client (unless --skip-qemu-guest), each export its own server."""
    setup = Setup(args, kind)
    guest = None
    try:
        setup.server("rw", 320 * MIB, shared=4)
        setup.server("raw", 64 * MIB, trace=True)
        ro_image, ro_sum = readonly_image(setup)
        # The default (empty) export name, as the README's quick start serves it.
        setup.server("ro", 0, readonly=True, image=ro_image, export="")
        setup.server("kill", 64 * MIB)
        setup.server("rs", 256 * MIB)
        ports = [(f"rw{i}", setup.servers["rw"].sock) for i in range(4)]
        ports += [(n + "0", setup.servers[n].sock) for n in ("raw", "ro", "kill", "rs")]
        extra = [] if args.skip_qemu_guest else qemu_disk_args(setup)
        guest = Guest(args, f"kernel-{kind}", ports, extra=extra)
        banner = guest.start()
        results.check(kind, "boot (TCG, no network device)", True,
                      f"{banner.split()[-1]} up in {guest.boot_seconds:.1f} s")
        steps = [attach_ext4, odirect_subclusters, discard_counts, flush_fua_counts, fio_verify,
                 multi_conn, xfs, read_only, sigterm_eio]
        steps += [] if args.skip_qemu_guest else [qemu_disk]
        steps += [] if args.skip_kernel_restart else [kernel_restart]
        for step in steps:
            t0 = time.monotonic()
            try:
                step(setup, guest, results, ro_sum=ro_sum)
            except Hung as e:
                results.check(kind, step.__name__, False, f"guest hung ({e}); console: {guest.dmesg_tail()[-400:]!r}"
                              f"; servers' logs: {setup.log_tails()!r}")
                break
            except (subprocess.CalledProcessError, RuntimeError, TimeoutError, OSError) as e:
                detail = getattr(e, "stderr", "") or ""
                results.check(kind, step.__name__, False, f"{e} {detail}".strip()[:400])
            finally:
                # Where the stage's time goes, for keeping it within CI's budget.
                print(f"vm-tests: [{kind}] {step.__name__} took {time.monotonic() - t0:.0f} s", flush=True)
        guest.stop()
        guest = None
        if not args.skip_qemu_guest and getattr(setup, "qemu_sums", None) is not None:
            qemu_disk_host(setup, results)
    except (Hung, RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as e:
        results.check(kind, "setup", False, str(e)[:400])
    finally:
        if guest is not None:
            guest.stop()
        setup.stop_all()
    return getattr(setup, "flush_fua", None)


def attach_ext4(setup, guest, results, **_):
    kind = setup.kind
    rc, out = guest.sh("bridge rw rw0 rw1 rw2 rw3 && attach rw /dev/nbd0 && cat /sys/block/nbd0/size")
    if not results.check(kind, "attach (nbd-client -unix, netlink)", rc == 0, out.splitlines()[-1:] and f"{int(out.splitlines()[-1]) * 512 // MIB} MiB" if rc == 0 else out):
        raise RuntimeError("not attached")
    rc, out = guest.sh("mkfs.ext4 -q -b 4096 /dev/nbd0 && mount /dev/nbd0 /mnt && gen /mnt 6 512 >/run/ext4.sums && "
                       "umount /mnt && e2fsck -fn /dev/nbd0 >/dev/null && cat /run/ext4.sums", 120)
    sums = parse_sums(out)
    results.check(kind, "ext4: mkfs, 6 files, e2fsck -fn", rc == 0 and len(sums) == 6, "" if rc == 0 else out[-300:])
    if len(sums) == 6:
        got = host_sums(setup.servers["rw"].image, sorted(sums), setup.dir)
        bad = [n for n in sums if got.get(n) != sums[n]]
        results.check(kind, "ext4: the files' checksums read back on the host (qemu-img convert, debugfs)",
                      not bad, f"differ: {bad}" if bad else "6 of 6 equal")
    ok, last = image_check(setup.servers["rw"].image)
    results.check(kind, "ext4: qemu-img check", ok, last[0])


def odirect_subclusters(setup, guest, results, **_):
    kind = setup.kind
    base = 4 * CLUSTER
    cmd = ("bridge raw raw0 && attach raw /dev/nbd1 && "
           "head -c 4096 /dev/zero | tr '\\000' '\\253' >/tmp/pat && "
           f"dd if=/tmp/pat of=/dev/nbd1 bs=4k count=1 seek={base // SUB} oflag=direct 2>/dev/null && "
           f"dd if=/tmp/pat of=/dev/nbd1 bs=4k count=1 seek={(base + 16 * SUB) // SUB} oflag=direct 2>/dev/null && "
           # 512-byte writes: a sector in the middle of a subcluster of the next cluster.
           f"dd if=/tmp/pat of=/dev/nbd1 bs=512 count=1 seek={(base + CLUSTER + 3 * SUB + 1024) // 512} oflag=direct 2>/dev/null && "
           f"dd if=/dev/nbd1 of=/tmp/back bs=4k count=1 skip={base // SUB} iflag=direct 2>/dev/null && cmp /tmp/pat /tmp/back && "
           f"dd if=/dev/nbd1 of=/tmp/back bs=512 count=1 skip={(base + CLUSTER + 3 * SUB + 1024) // 512} iflag=direct 2>/dev/null && "
           "head -c 512 /tmp/pat | cmp - /tmp/back && sync /dev/nbd1")
    rc, out = guest.sh(cmd)
    results.check(kind, "O_DIRECT writes and reads (4 KiB and 512 B)", rc == 0, out[-300:])
    image = setup.servers["raw"].image
    m = json.loads(qemu_img("map", "-U", "--output=json", "-f", "qcow2", image).stdout)
    data = [(e["start"], e["length"]) for e in m if e.get("data")]
    # Adjacent data extents are one: qemu-img map also splits where the host file ends.
    merged = []
    for start, length in data:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    want = [(base, SUB), (base + 16 * SUB, SUB), (base + CLUSTER + 3 * SUB, SUB)]
    results.check(kind, "qemu-img map: 4 KiB writes into an empty 128 KiB cluster are subclusters",
                  merged == want, f"data extents {data}")
    io = run(["qemu-io", "-r", "-U", "-f", "qcow2", "-c", f"read -P 0xab {base} 4096",
              "-c", f"read -P 0 {base + SUB} {15 * SUB}", "-c", f"read -P 0xab {base + CLUSTER + 3 * SUB + 1024} 512",
              "-c", f"read -P 0 {base + CLUSTER + 3 * SUB} 1024", image], check=False)
    ok = io.returncode == 0 and "Pattern verification failed" not in io.stdout
    results.check(kind, "qemu-io reads the patterns back on the host", ok, "" if ok else (io.stdout + io.stderr)[-300:])


def count_between(server, guest, command, timeout=60):
    """Runs COMMAND in the guest; returns (status, output, requests that arrived meanwhile)."""
    before = len(server.requests())
    rc, out = guest.sh(command, timeout)
    time.sleep(0.3)  # the log line of the last request may trail the reply
    return rc, out, server.requests()[before:]


def shown(reqs):
    """The requests other than reads, as "command/flags", and how many reads."""
    reads = sum(1 for c, _ in reqs if c == "read")
    return " ".join(f"{c}/{f}" for c, f in reqs if c != "read") + f" (+{reads} reads)"


def discard_counts(setup, guest, results, **_):
    kind, server = setup.kind, setup.servers["raw"]
    rc, out = guest.sh("dd if=/dev/urandom of=/dev/nbd1 bs=1M count=2 seek=1 oflag=direct 2>/dev/null && echo ok")
    rc, out, reqs = count_between(server, guest, "blkdiscard -o 1048576 -l 1048576 /dev/nbd1")
    trims = [r for r in reqs if r[0] == "trim"]
    results.check(kind, "blkdiscard: one TRIM", rc == 0 and len(trims) == 1, f"requests {shown(reqs)}")
    rc, out, reqs = count_between(server, guest, "blkdiscard -z -o 2097152 -l 1048576 /dev/nbd1 && sync /dev/nbd1 && "
                                  "cat /sys/block/nbd1/queue/write_zeroes_max_bytes")
    wz = [r for r in reqs if r[0] == "writezeroes"]
    results.check(kind, "blkdiscard -z: one WRITE_ZEROES", rc == 0 and len(wz) == 1,
                  f"requests {shown(reqs)}; write_zeroes_max_bytes {out.strip()}")
    io = run(["qemu-io", "-r", "-U", "-f", "qcow2", "-c", f"read -P 0 {2 * MIB} {MIB}", server.image], check=False)
    results.check(kind, "the zeroed range reads as zeroes on the host", io.returncode == 0 and "failed" not in io.stdout,
                  io.stdout[-200:] if io.returncode else "")


def flush_fua_counts(setup, guest, results, **_):
    kind, server = setup.kind, setup.servers["raw"]
    cmd = ("for i in 0 1 2 3; do dd if=/tmp/pat of=/dev/nbd1 bs=4k count=1 seek=$((1024 + i)) oflag=direct,dsync "
           "2>/dev/null || exit 1; done; dd if=/tmp/pat of=/dev/nbd1 bs=4k count=1 seek=1100 conv=fsync 2>/dev/null; "
           "cat /sys/block/nbd1/queue/fua /sys/block/nbd1/queue/write_cache")
    rc, out, reqs = count_between(server, guest, cmd)
    fua = sum(1 for c, f in reqs if c == "write" and f & 1)
    flush = sum(1 for c, _ in reqs if c == "flush")
    writes = sum(1 for c, _ in reqs if c == "write")
    setup.flush_fua = (writes, fua, flush)
    results.check(kind, "FUA and FLUSH: 4 O_DSYNC direct writes and a buffered write with fsync",
                  rc == 0 and fua == 4 and flush >= 1,
                  f"writes {writes}, with FUA {fua}, flushes {flush}; queue fua/write_cache: {' '.join(out.split())}")


def fio_verify(setup, guest, results, **_):
    cmd = ("fio --name=verify --filename=/dev/nbd1 --offset=8M --size=4M --ioengine=libaio --iodepth=16 "
           "--direct=1 --rw=randwrite --bsrange=4k-64k --verify=crc32c --verify_fatal=1 "
           "--output-format=terse --terse-version=3 >/tmp/fio.out 2>&1; rc=$?; "
           "cut -d';' -f1-10 /tmp/fio.out | tail -1; exit $rc")
    rc, out = guest.sh(cmd, 180)
    results.check(setup.kind, "fio --verify=crc32c, libaio queue depth 16, 4k-64k random writes",
                  rc == 0, out.strip()[-200:] if rc else "verified")
    guest.sh("detach /dev/nbd1")


def multi_conn(setup, guest, results, **_):
    kind = setup.kind
    cmd = ("detach /dev/nbd0 && attach rw /dev/nbd2 -C 4 && mount /dev/nbd2 /mnt && "
           "(cd /mnt && sha256sum -c /run/ext4.sums >/dev/null) && "
           "fio --name=mc --directory=/mnt --size=2M --numjobs=2 --cpus_allowed=0-1 --cpus_allowed_policy=split "
           "--rw=randwrite --bs=4k --direct=1 --ioengine=libaio --iodepth=8 --verify=crc32c --verify_fatal=1 "
           ">/tmp/fio.out 2>&1 && carried && umount /mnt && e2fsck -fn /dev/nbd2 >/dev/null && "
           "ls /sys/block/nbd2/mq | wc -l")
    rc, out = guest.sh(cmd, 300)
    lines = out.splitlines()
    carried = {l.split()[0]: int(l.split()[1]) for l in lines if re.fullmatch(r"vport\S+ \d+", l)}
    busy = [p for p, b in carried.items() if b > 256 * 1024]
    queues = lines[-1] if lines else "?"
    results.check(kind, "-C 4 on a multi-conn export, 2 vCPUs: checksums, fio verify, e2fsck",
                  rc == 0 and len(carried) == 4 and len(busy) >= 2,
                  f"{len(carried)} connections, bytes sent on each {sorted(carried.values())}, {queues} hardware queues"
                  if rc == 0 else out[-300:])
    guest.sh("detach /dev/nbd2")


def xfs(setup, guest, results, **_):
    cmd = ("attach rw /dev/nbd0 && mkfs.xfs -q -f /dev/nbd0 && mount /dev/nbd0 /mnt && "
           "gen /mnt 6 512 >/run/xfs.sums && umount /mnt && xfs_repair -n /dev/nbd0 >/tmp/xr 2>&1 && "
           "echo 3 >/proc/sys/vm/drop_caches && mount /dev/nbd0 /mnt && (cd /mnt && sha256sum -c /run/xfs.sums >/dev/null) && "
           "umount /mnt")
    rc, out = guest.sh(cmd, 180)
    results.check(setup.kind, "XFS: mkfs, 6 files, xfs_repair -n, checksums after a remount", rc == 0, out[-300:])
    guest.sh("detach /dev/nbd0")
    ok, last = image_check(setup.servers["rw"].image)
    results.check(setup.kind, "XFS: qemu-img check", ok, last[0])


def read_only(setup, guest, results, ro_sum, **_):
    cmd = ("bridge ro ro0 && attach ro /dev/nbd3 -N '' && blockdev --getro /dev/nbd3 && "
           "if dd if=/dev/zero of=/dev/nbd3 bs=4k count=1 oflag=direct 2>/dev/null; then echo written; exit 1; fi; "
           "mount /dev/nbd3 /mnt 2>/dev/null || mount -o ro /dev/nbd3 /mnt || exit 1; "
           "grep ' /mnt ' /proc/mounts | cut -d' ' -f4 | cut -d, -f1; "
           "if touch /mnt/new 2>/dev/null; then echo created; exit 1; fi; sha256sum /mnt/hello; umount /mnt")
    rc, out = guest.sh(cmd)
    lines = out.split()
    ok = rc == 0 and lines[:2] == ["1", "ro"] and ro_sum in out
    results.check(setup.kind, "read-only export (-N ''): device read-only, write refused, ext4 mounts ro, file intact",
                  ok, " ".join(lines[:2]) if ok else out[-300:])
    guest.sh("detach /dev/nbd3")


def sigterm_eio(setup, guest, results, **_):
    kind, server = setup.kind, setup.servers["kill"]
    # Without a request timeout (-timeout) the kernel waits for ever for the answer to a request
    # in flight on a connection that died; with one it fails it when the timeout passes.
    rc, out = guest.sh("bridge kill kill0 && attach kill /dev/nbd4 -timeout 3")
    if rc:
        results.check(kind, "SIGTERM while attached: EIO, no hang", False, out[-300:])
        return
    guest.send("eio_wait /dev/nbd4")
    time.sleep(1.0)
    t0 = time.monotonic()
    status, took = server.stop(signal.SIGTERM)
    rc, out = guest.answer(30)
    seen = time.monotonic() - t0
    results.check(kind, "SIGTERM while attached (-timeout 3) under reads: EIO, no hang",
                  rc == 0 and "failed" in out and seen < 10,
                  f"server exited {status} in {took:.2f} s; guest saw the error {seen:.2f} s after the signal ({out.strip()})")
    guest.sh("nbd-client -d /dev/nbd4")


def kernel_restart(setup, guest, results, **_):
    """SIGTERM the server under an ext4 write load on /dev/nbd5 and start it again on the same
    socket, --restarts times. nbd-client attaches through netlink with a request timeout;
    nbd-reconnect (scripts/vm/nbd-reconnect.c) sets the dead-connection timeout and hands the
    kernel a new connection after each restart. The guest must see no error."""
    kind, server, n = setup.kind, setup.servers["rs"], setup.args.restarts
    name = f"kernel client: {n} server restarts (SIGTERM, start again) under an ext4 write load (nbd-reconnect)"
    rc, out = guest.sh("dmesg -c >/dev/null; bridge rs rs0 && attach rs /dev/nbd5 -timeout 5 && "
                       "nbd-reconnect -d 60 /run/rs.sock disk /dev/nbd5 2>/run/reconnect.log && "
                       "mkfs.ext4 -q -b 4096 /dev/nbd5 && mkdir -p /run/rsm && mount /dev/nbd5 /run/rsm && "
                       "mkdir /run/rsm/l && rm -f /run/stop /run/load.done && cat /run/reconnect.log", 120)
    if rc:
        results.check(kind, name, False, out[-300:])
        return
    guest.sh("load /run/rsm/l </dev/null >/dev/null 2>&1 &")
    stops, resumed = [], []
    for i in range(n):
        # Each stop lands in the middle of the load, after it wrote a file over the new
        # connection (so a restart is never one the device had not noticed yet).
        rc, out = guest.sh("n=$(ls /run/rsm/l | wc -l); t=$(now_ms); until [ $(ls /run/rsm/l | wc -l) -gt $((n + 1)) ]; do "
                           "[ $(($(now_ms) - t)) -gt 60000 ] && exit 1; sleep 0.1; done; "
                           "cat /run/carry-$(basename $(port rs0)).pid", 90)
        if rc or not out.strip().isdigit():
            break
        status, took = server.stop(signal.SIGTERM)
        stops.append(f"{took:.2f}")
        # A virtio-serial port has no connections, only its host side's state: the guest's
        # bridge sees a close by polling it, and would miss one if the new server were
        # already connected by then (over a real socket the client sees the close at once).
        # So the new server starts once the bridge has closed the old connection.
        guest.sh(f"t=$(now_ms); while kill -0 {out.strip()} 2>/dev/null; do "
                 "[ $(($(now_ms) - t)) -gt 20000 ] && exit 1; sleep 0.05; done", 60)
        server.start()
        t0 = time.monotonic()
        rc, out = guest.sh(f"t=$(now_ms); until [ $(grep -c reconnected /run/reconnect.log) -ge {i + 1} ]; do "
                           "[ $(($(now_ms) - t)) -gt 60000 ] && exit 1; sleep 0.1; done", 90)
        resumed.append(time.monotonic() - t0)
        if rc:
            break
    rc, out = guest.sh("touch /run/stop; i=0; until [ -e /run/load.done ]; do i=$((i+1)); [ $i -gt 900 ] && break; "
                       "sleep 0.1; done; echo files $(wc -l </run/load.sums); cat /run/load.err; "
                       "dmesg | grep -i -E 'i/o error|ext4.*error|aborting journal|shut ?down' | tail -3; "
                       "echo 3 >/proc/sys/vm/drop_caches; "
                       "(cd /run/rsm/l && sha256sum -c /run/load.sums >/dev/null) || echo checksums-bad; "
                       "umount /run/rsm && e2fsck -fn /dev/nbd5 >/dev/null 2>&1 || echo fsck-bad; "
                       "cat /run/reconnect.log", 180)
    lines = out.splitlines()
    ms = [m.group(1) for m in re.finditer(r"reconnected after (\d+) ms", out)]
    reconnects = str(len(ms))
    log = [l for l in lines if l.startswith("nbd-reconnect")]
    lines = [l for l in lines if not l.startswith("nbd-reconnect")]
    bad = (rc != 0 or len(stops) != n or reconnects != str(n)
           or any(w in out for w in ("checksums-bad", "fsck-bad", "failed", "rror", "shut")))
    results.check(kind, name + ": no guest-visible error, checksums and e2fsck -fn clean", not bad,
                  f"server stops took {stops} s; new connection handed over after {ms} ms; "
                  f"{' | '.join(lines[:5])}; "
                  f"{reconnects} reconnects; longest wait for one {max(resumed, default=0):.1f} s"
                  + (f"; helper's log: {' | '.join(log[-4:])}" if bad else ""))
    guest.sh("nbd-client -d /dev/nbd5")


def qemu_disk_args(setup):
    """The QEMU-client disk: virtio-blk on `-blockdev driver=nbd` to its own server
    (reconnect-delay set, as for a server that may restart), and a local raw disk the guest
    copies it onto, for the host to compare with the image afterwards."""
    server = setup.server("disk", 256 * MIB, shared=4)
    setup.ref = os.path.join(setup.dir, "ref.raw")
    with open(setup.ref, "wb") as f:
        f.truncate(256 * MIB)
    return ["-blockdev", f"driver=nbd,node-name=nbd0,server.type=unix,server.path={server.sock},"
            "export=disk,reconnect-delay=20",
            "-device", "virtio-blk-pci,drive=nbd0,serial=nbd",
            "-blockdev", f"driver=raw,node-name=ref,file.driver=file,file.filename={setup.ref}",
            "-device", "virtio-blk-pci,drive=ref,serial=ref"]


def qemu_disk(setup, guest, results, **_):
    """The file-system workload on the disk QEMU's NBD client serves the guest, restarts of
    the server under a write load, e2fsck, then the copy onto the local disk."""
    kind, server = setup.kind, setup.servers["disk"]
    rc, out = guest.sh("mkfs.ext4 -q -b 4096 /dev/vda && mount /dev/vda /mnt && gen /mnt 6 512 >/run/q.sums && "
                       "fio --name=q --directory=/mnt --size=2M --rw=randwrite --bs=4k --direct=1 --ioengine=libaio "
                       "--iodepth=16 --verify=crc32c --verify_fatal=1 >/tmp/fio.out 2>&1 && "
                       "cat /run/q.sums", 240)
    sums = parse_sums(out)
    results.check(kind, "QEMU client (virtio-blk on -blockdev driver=nbd): ext4, files, fio verify",
                  rc == 0 and len(sums) == 6, "" if rc == 0 else out[-300:])
    qemu_guest_restart(setup, guest, server, results)
    rc, out = guest.sh("umount /mnt && e2fsck -fn /dev/vda >/dev/null && dd if=/dev/vda of=/dev/vdb bs=1M "
                       "2>/dev/null && sync /dev/vdb", 240)
    results.check(kind, "QEMU client: e2fsck -fn, disk copied", rc == 0, out[-300:])
    setup.qemu_sums = sums


def qemu_disk_host(setup, results):
    """After the VM: qemu-img check and compare, and the files read back on the host."""
    kind, server = setup.kind, setup.servers["disk"]
    server.stop()
    ok, last = image_check(server.image)
    results.check(kind, "QEMU client: qemu-img check", ok, last[0])
    cmp = run(["qemu-img", "compare", "-f", "qcow2", "-F", "raw", server.image, setup.ref], check=False)
    results.check(kind, "QEMU client: qemu-img compare with what the guest read", cmp.returncode == 0,
                  cmp.stdout.strip()[-200:])
    sums = setup.qemu_sums
    got = host_sums(server.image, sorted(sums), setup.dir) if sums else {}
    bad = [n for n in sums if got.get(n) != sums[n]]
    results.check(kind, "QEMU client: checksums read back on the host", bool(sums) and not bad,
                  f"differ: {bad}" if bad else f"{len(sums)} of 6")


def qemu_guest_restart(setup, guest, server, results):
    """SIGTERM the server under a write load on the mounted ext4 and start it again on the
    same socket, --restarts times; QEMU's client reconnects (reconnect-delay) and the guest
    must see no error."""
    kind, n = setup.kind, setup.args.restarts
    # dmesg -c: the errors of the earlier checks (the SIGTERM one's EIO) are not this one's.
    rc, out = guest.sh("dmesg -c >/dev/null; mkdir /mnt/l && rm -f /run/stop /run/load.done && "
                       "load /mnt/l </dev/null >/dev/null 2>&1 &")
    stops = []
    for _ in range(n):
        time.sleep(2.0)
        status, took = server.stop(signal.SIGTERM)
        stops.append(f"{took:.2f}")
        server.start()
    time.sleep(2.0)
    rc, out = guest.sh("touch /run/stop; i=0; until [ -e /run/load.done ]; do i=$((i+1)); [ $i -gt 900 ] && break; "
                       "sleep 0.1; done; echo files $(wc -l </run/load.sums); cat /run/load.err; "
                       "dmesg | grep -i -E 'i/o error|blk_update|ext4.*error' | tail -3; echo 3 >/proc/sys/vm/drop_caches; "
                       "(cd /mnt/l && sha256sum -c /run/load.sums >/dev/null) || echo checksums-bad", 180)
    bad = rc != 0 or any(w in out for w in ("checksums-bad", "failed", "rror"))
    results.check(kind, f"QEMU client: {n} server restarts (SIGTERM, start again) under an ext4 write load: "
                  "no guest-visible error, checksums clean", not bad,
                  f"server stops took {stops} s; {' | '.join(out.splitlines()[:6])}")
