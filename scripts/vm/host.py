#!/usr/bin/env python3
"""The host side of scripts/vm-tests.sh (which fetches the kernel and builds the initramfs,
then runs this): starts the servers, boots the guests, drives the checks and prints one line
per check and a summary. Every check runs against our server and qemu-nbd in the same run."""

import argparse
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

MIB = 1 << 20
# Each guest command has this long unless it says otherwise; a guest that does not answer in
# time is killed (the watchdog) and the checks left count as failed.
COMMAND_TIMEOUT = 60
BOOT_TIMEOUT = 60


class Hung(Exception):
    """The guest did not answer in time."""


class Results:
    def __init__(self):
        self.rows = []

    def check(self, kind, name, ok, detail=""):
        self.rows.append((kind, name, ok, detail))
        word = "PASS" if ok else "FAIL"
        print(f"{word} [{kind}] {name}" + (f": {detail}" if detail else ""), flush=True)
        return ok

    def summary(self):
        passed = sum(1 for r in self.rows if r[2])
        failed = len(self.rows) - passed
        print(f"{passed} passed, {failed} failed", flush=True)
        return failed


def run(cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def wait_for(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


class Server:
    """One NBD server on a Unix socket: ours (`qcow2-nbd serve`) or qemu-nbd, with the same
    options. The request log (ours: --log trace; qemu-nbd: its nbd_receive_request trace
    event) counts the commands and flags that arrived."""

    def __init__(self, kind, binary, image, sock, log, shared=1, readonly=False, trace=False, export="disk"):
        self.kind, self.image, self.sock, self.log = kind, image, sock, log
        common = ["-k", sock, "-t", "-e", str(shared), "-f", "qcow2"]
        common += ["-x", export] if export else []
        common += ["-r"] if readonly else []
        if kind == "ours":
            self.cmd = [binary, "serve", *common, "--handshake-limit", "300"]
            # info: each connection's end is logged, for a check that hangs.
            self.cmd += ["--log", "trace" if trace else "info"]
        else:
            self.cmd = ["qemu-nbd", *common, "--handshake-limit=300"]
            self.cmd += ["--trace", f"enable=nbd_receive_request,file={log}.trace"] if trace else []
        self.cmd.append(image)
        self.proc = None

    def start(self):
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        wait_for(lambda: self._listening() or self.proc.poll() is not None, 10, f"{self.sock} listening")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{' '.join(self.cmd)} exited with {self.proc.returncode}: {open(self.log).read()[-500:]}")

    def _listening(self):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.sock)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def stop(self, sig=signal.SIGTERM, timeout=15):
        """Sends SIG and waits for the exit; returns (exit status, seconds taken)."""
        if self.proc is None or self.proc.poll() is not None:
            return None, 0.0
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        return rc, time.monotonic() - t0

    def requests(self):
        """(command, flags) of every request logged so far."""
        out = []
        if self.kind == "ours":
            text = open(self.log, errors="replace").read()
            for m in re.finditer(r"flags: (\d+), command: (\w+)", text):
                out.append((m.group(2).lower(), int(m.group(1))))
        else:
            path = self.log + ".trace"
            text = open(path, errors="replace").read() if os.path.exists(path) else ""
            names = {0: "read", 1: "write", 2: "disc", 3: "flush", 4: "trim", 5: "cache", 6: "writezeroes", 7: "blockstatus"}
            for m in re.finditer(r"\.flags = 0x([0-9a-f]+), \.type = 0x([0-9a-f]+)", text):
                out.append((names.get(int(m.group(2), 16), m.group(2)), int(m.group(1), 16)))
        return [(c.replace("_", ""), f) for c, f in out]


class Guest:
    """A TCG guest with no network device: virtio-serial ports only, one named "ctl" for
    commands and results, the others each a connection to a server's Unix socket."""

    def __init__(self, args, name, ports, extra=(), smp=2, mem=512):
        self.name = name
        self.dir = args.scratch
        self.ctl_path = os.path.join(self.dir, f"{name}-ctl.sock")
        self.console = os.path.join(self.dir, f"{name}-console.log")
        cmd = ["qemu-system-x86_64", "-machine", "pc,accel=tcg", "-cpu", "max", "-smp", str(smp),
               "-m", str(mem), "-nodefaults", "-no-reboot", "-nographic", "-nic", "none",
               "-kernel", args.kernel, "-initrd", args.initrd,
               "-append", "console=ttyS0 panic=-1 quiet loglevel=4",
               "-serial", f"file:{self.console}",
               "-device", "virtio-serial-pci,id=vs0,max_ports=31",
               "-chardev", f"socket,id=ctl,path={self.ctl_path},server=on,wait=off",
               "-device", "virtserialport,bus=vs0.0,chardev=ctl,name=ctl"]
        for i, (port, sock) in enumerate(ports):
            # reconnect-ms: when the server closes a connection (a detach, a restart), QEMU
            # connects again, and the guest sees the port's host side come back.
            cmd += ["-chardev", f"socket,id=p{i},path={sock},reconnect-ms=100",
                    "-device", f"virtserialport,bus=vs0.0,chardev=p{i},name={port}"]
        self.cmd = cmd + list(extra)
        self.proc = None
        self.sock = None
        self.buf = b""
        self.boot_seconds = None

    def start(self):
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=open(os.path.join(self.dir, f"{self.name}-qemu.log"), "w"),
                                     stderr=subprocess.STDOUT)
        # The socket file can appear before QEMU listens on it.
        wait_for(lambda: self._connect() or self.proc.poll() is not None, 20, "QEMU's ctl socket")
        if self.proc.poll() is not None:
            raise RuntimeError(f"QEMU exited: {open(os.path.join(self.dir, self.name + '-qemu.log')).read()[-800:]}")
        line = self._line(BOOT_TIMEOUT)
        if not line.startswith("READY"):
            raise RuntimeError(f"guest said {line!r} first")
        self.boot_seconds = time.monotonic() - t0
        return line

    def _connect(self):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.ctl_path)
        except OSError:
            s.close()
            return False
        self.sock = s
        return True

    def _line(self, timeout):
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise Hung(f"no answer within {timeout} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                raise Hung("the guest closed its control port")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace").rstrip("\r")

    def send(self, command):
        self.sock.sendall(command.encode() + b"\n")

    def answer(self, timeout=COMMAND_TIMEOUT):
        out = []
        while True:
            line = self._line(timeout)
            if line.startswith("OUT "):
                out.append(line[4:])
            elif line.startswith("END "):
                return int(line[4:]), "\n".join(out)

    def sh(self, command, timeout=COMMAND_TIMEOUT):
        """Runs COMMAND in the guest's shell; returns (exit status, output)."""
        self.send(command)
        return self.answer(timeout)

    def stop(self):
        """Asks the guest to power off, and kills it if it does not within 20 s."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.sock is not None:
                self.send("poweroff")
                self.proc.wait(20)
        except (OSError, subprocess.TimeoutExpired, Hung):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.sock is not None:
            self.sock.close()

    def dmesg_tail(self):
        try:
            return open(self.console, errors="replace").read()[-1500:]
        except OSError:
            return ""


def qemu_img(*args):
    return run(["qemu-img", *args])


def create_image(path, size, extended_l2=True):
    opts = "extended_l2=on,cluster_size=128k" if extended_l2 else "cluster_size=64k"
    qemu_img("create", "-q", "-f", "qcow2", "-o", opts, path, str(size))


def host_sums(image, names, scratch):
    """sha256 of each file NAME of the ext4 file system in IMAGE, read on the host: QEMU's
    qemu-img turns the image into raw, debugfs (e2fsprogs) reads the file out of it."""
    raw = os.path.join(scratch, "readback.raw")
    qemu_img("convert", "-U", "-f", "qcow2", "-O", "raw", image, raw)
    sums = {}
    for name in names:
        out = os.path.join(scratch, "readback.file")
        run(["debugfs", "-R", f"dump /{name} {out}", raw])
        with open(out, "rb") as f:
            sums[name] = hashlib.sha256(f.read()).hexdigest()
        os.unlink(out)
    os.unlink(raw)
    return sums


def parse_sums(text):
    sums = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([0-9a-f]{64})\s+(\S+)", line.strip())
        if m:
            sums[m.group(2)] = m.group(1)
    return sums


def image_check(image):
    r = run(["qemu-img", "check", "-U", "-f", "qcow2", image], check=False)
    return r.returncode == 0, (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--initrd", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--only", default="ours,qemu")
    ap.add_argument("--skip-qemu-guest", action="store_true")
    ap.add_argument("--skip-kernel-restart", action="store_true")
    args = ap.parse_args()
    # A SIGTERM (CI's timeout) unwinds like an error: every guest and server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = Results()
    import checks  # noqa: E402  (scripts/vm/checks.py, beside this file)

    t0 = time.monotonic()
    counts = {kind: checks.kernel_client(args, kind, results) for kind in args.only.split(",")}
    if counts.get("ours") and counts.get("qemu"):
        results.check("ours", "FLUSH and FUA counts identical to qemu-nbd's", counts["ours"] == counts["qemu"],
                      f"(writes, with FUA, flushes): ours {counts['ours']}, qemu-nbd {counts['qemu']}")
    print(f"vm-tests: {time.monotonic() - t0:.0f} s", flush=True)
    sys.exit(1 if results.summary() else 0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
