//! Hostile and broken clients against `qcow2-nbd serve` on a qcow2 image: libnbd with strict
//! mode off (so every bad request reaches the server) gets the spec's error for each, and
//! raw sockets that cut requests short or hang up mid-payload are dropped cleanly. Through
//! all of it other clients keep being served, and the image stays consistent.

use std::process::Command;

use crate::support::kernel_client::{KernelClient, CMD_READ, CMD_WRITE, EINVAL, EPERM};
use crate::support::Server;
use test_support::{
    assert_check_clean, python_with_libnbd, qemu_contents, qemu_io, run_ok, stdout, Dir,
};

const SCRIPT: &str = r#"
import errno, sys
import nbd

h = nbd.NBD()
h.set_strict_mode(0)
h.add_meta_context("base:allocation")
h.connect_uri(sys.argv[1])
size = h.get_size()
MiB = 1 << 20
checked = 0

def expect(want, what, fn):
    global checked
    try:
        fn()
    except nbd.Error as e:
        # libnbd's Python binding reports the errno by name ("EINVAL").
        got = e.errno if isinstance(e.errno, str) else errno.errorcode.get(e.errno)
        if got != errno.errorcode[want]:
            sys.exit(f"{what}: got errno {e.errno} ({e}), want {want}")
    else:
        sys.exit(f"{what}: succeeded, want errno {want}")
    checked += 1

def status(*args):
    h.block_status(*args, lambda *a: 0)

# Past the end: EINVAL for reads, trims, cache and status; ENOSPC for writes and zeroing.
expect(errno.EINVAL, "read past end", lambda: h.pread(512, size - 256))
expect(errno.EINVAL, "read beyond end", lambda: h.pread(512, size + MiB))
expect(errno.ENOSPC, "write past end", lambda: h.pwrite(b"x" * 512, size - 1))
expect(errno.ENOSPC, "zero past end", lambda: h.zero(4096, size))
expect(errno.EINVAL, "trim past end", lambda: h.trim(4096, size))
expect(errno.EINVAL, "cache past end", lambda: h.cache(4096, size))
expect(errno.EINVAL, "status past end", lambda: status(4096, size))
expect(errno.EINVAL, "read at 2^63", lambda: h.pread(1, 1 << 63))

# Unknown flags, and flags that do not belong to the command.
expect(errno.EINVAL, "unknown read flag", lambda: h.pread(512, 0, flags=1 << 9))
expect(errno.EINVAL, "DF on write", lambda: h.pwrite(b"x", 0, flags=nbd.CMD_FLAG_DF))
expect(errno.EINVAL, "REQ_ONE on trim", lambda: h.trim(512, 0, flags=nbd.CMD_FLAG_REQ_ONE))
expect(errno.EINVAL, "NO_HOLE on flush", lambda: h.flush(flags=nbd.CMD_FLAG_NO_HOLE))
expect(errno.EINVAL, "FAST_ZERO on read", lambda: h.pread(1, 0, flags=nbd.CMD_FLAG_FAST_ZERO))

# Zero lengths: harmless, except block status which needs a length.
assert h.pread(0, 0) == b""
h.pwrite(b"", 0)
h.trim(0, 0)
h.zero(0, 0)
h.cache(0, 0)
expect(errno.EINVAL, "status of nothing", lambda: status(0, 0))

# Huge lengths: above the 32 MiB maximum payload for reads and writes; effect lengths of
# zeroing and trimming are fine up to the end of the disk, and refused past it.
expect(errno.EINVAL, "64 MiB read", lambda: h.pread(64 * MiB, 0))
expect(errno.EINVAL, "64 MiB write", lambda: h.pwrite(bytearray(64 * MiB), 0))
h.pwrite(b"\x5a" * 65536, 0)
h.zero(size, 0)
assert h.pread(65536, 0) == bytes(65536)
h.trim(size, 0)
expect(errno.EINVAL, "4 GiB trim", lambda: h.trim((4 << 30) - 1, 0))
h.cache(size, 0)
status(size, 0)

# A fast zero that would have to write bytes into allocated data fails fast.
h.pwrite(b"\x5a" * 65536, 0)
expect(errno.ENOTSUP, "slow fast zero", lambda: h.zero(100, 1, flags=nbd.CMD_FLAG_FAST_ZERO))
assert h.pread(65536, 0) == b"\x5a" * 65536, "a refused fast zero changed nothing"

# After all that the connection still works.
h.pwrite(b"still alive", 4096)
assert h.pread(11, 4096) == b"still alive"
h.flush()
h.shutdown()
print(f"checked {checked}")
"#;

#[test]
fn every_bad_request_gets_the_spec_error_and_the_connection_goes_on() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "extended_l2=on", None, "128M");
    let server = Server::unix_reporting(&["-t", "--discard=unmap", img.to_str().unwrap()]);
    let out = stdout(&run_ok(Command::new(python_with_libnbd()).args([
        "-c",
        SCRIPT,
        &server.uri(),
    ])));
    assert_eq!(out.trim(), "checked 18");
    // Another client is served as usual and sees the surviving write.
    let survivors = [
        "read -P 0x5a 0 4096",
        "read -P 0x73 4096 1",
        "read -P 0x5a 4107 61429",
        "read -P 0 65536 1M",
    ];
    qemu_io("raw", &server.uri(), &survivors);
    let report = server.stop_report();
    assert_eq!(
        (report.connections, report.failed_connections),
        (2, 0),
        "bad requests never end a connection"
    );
    assert_check_clean(&img);
    qemu_io("qcow2", img.to_str().unwrap(), &survivors);
    let contents = qemu_contents(&img, &["-f", "qcow2"]);
    assert_eq!(&contents[4096..4107], b"still alive");
}

#[test]
fn writes_to_a_read_only_export_fail_with_eperm() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 0x21 0 64k"]);
    let server = Server::unix(&["-t", "-r", img.to_str().unwrap()]);
    let mut c = KernelClient::connect(&server.socket, "");
    assert_eq!(c.call(CMD_WRITE, 0, 0, 4, b"nope").error, EPERM);
    for cmd in [4u16, 6] {
        // TRIM and WRITE_ZEROES.
        assert_eq!(c.call(cmd, 0, 0, 4096, &[]).error, EPERM, "command {cmd}");
    }
    assert_eq!(c.read(0, 4), [0x21; 4]);
    c.disconnect();
    server.stop_ok();
    assert_check_clean(&img);
}

#[test]
fn broken_clients_are_dropped_and_others_keep_being_served() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "16M");
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 0x11 0 1M"]);
    let server = Server::unix(&["-t", "-e", "0", img.to_str().unwrap()]);
    let socket = server.socket.clone();

    // A well-behaved client that stays connected through everything below.
    let mut good = KernelClient::connect(&socket, "");
    assert_eq!(good.call(CMD_WRITE, 0, 0, 4, b"good").error, 0);

    // Garbage instead of a handshake.
    let mut garbage = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut garbage, &mut greeting).unwrap();
    std::io::Write::write_all(&mut garbage, b"GARBAGE!GARBAGE!GARBAGE!").unwrap();
    drop(garbage);
    // Garbage request magic after a good handshake: the server hangs up.
    let mut bad_magic = KernelClient::connect(&socket, "");
    bad_magic.send_raw(&[0xde; 28]);
    assert!(bad_magic.is_closed());
    // A request header cut short, then hang up.
    let mut cut = KernelClient::connect(&socket, "");
    cut.send_raw(&[0x25, 0x60, 0x95, 0x13, 0, 0, 0, 1, 0, 0]);
    drop(cut);
    // A write whose payload stops halfway, then hang up: never applied.
    let mut half = KernelClient::connect(&socket, "");
    half.send(CMD_WRITE, 0, 9, 2 << 20, 65536, &[0x55; 30000]);
    drop(half);
    // An unknown command and an unknown flag: EINVAL, and the connection stays usable.
    let mut odd = KernelClient::connect(&socket, "");
    assert_eq!(odd.call(200, 0, 0, 0, &[]).error, EINVAL);
    assert_eq!(odd.call(CMD_READ, 1 << 14, 0, 1, &[]).error, EINVAL);
    assert_eq!(odd.read(0, 4), b"good");
    odd.disconnect();

    // The first client never noticed; a new one is served too.
    assert_eq!(good.read(0, 8), b"good\x11\x11\x11\x11");
    good.disconnect();
    let mut fresh = KernelClient::connect(&socket, "");
    assert_eq!(
        fresh.read(2 << 20, 65536),
        vec![0; 65536],
        "a half-sent write is never applied"
    );
    fresh.disconnect();
    server.stop_ok();
    assert_check_clean(&img);
}
