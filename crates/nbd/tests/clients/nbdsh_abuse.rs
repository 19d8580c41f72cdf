//! Abuse through libnbd (nbdsh's Python bindings) with strict mode off, so every bad
//! request reaches the server: each gets the spec's error and the connection goes on.

use std::process::Command;

use nbd::MemExport;
use test_support::nbd_server::{mem_server, Opts};
use test_support::{python_with_libnbd, require, run_ok, stdout};

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
# zeroing are fine.
expect(errno.EINVAL, "64 MiB read", lambda: h.pread(64 * MiB, 0))
expect(errno.EINVAL, "64 MiB write", lambda: h.pwrite(bytearray(64 * MiB), 0))
h.zero(size, 0)
expect(errno.EINVAL, "4 GiB trim", lambda: h.trim((4 << 30) - 1, 0))

# A fast zero that would have to write bytes fails fast.
expect(errno.ENOTSUP, "slow fast zero", lambda: h.zero(100, 1, flags=nbd.CMD_FLAG_FAST_ZERO))

# After all that the connection still works.
h.pwrite(b"still alive", 4096)
assert h.pread(11, 4096) == b"still alive"
h.flush()
h.shutdown()
print(f"checked {checked}")
"#;

#[test]
fn every_bad_request_gets_the_spec_error_and_the_server_keeps_serving() {
    let server = mem_server(Opts::default(), || MemExport::new(128 << 20));
    let python = python_with_libnbd();
    let out = stdout(&run_ok(Command::new(python).args([
        "-c",
        SCRIPT,
        &server.uri(),
    ])));
    assert_eq!(out.trim(), "checked 18");
    // A second client is served as usual.
    let size = stdout(&run_ok(
        Command::new(require("nbdinfo", "libnbd-bin")).args(["--size", &server.uri()]),
    ));
    assert_eq!(size.trim(), (128u64 << 20).to_string());
    let (report, snaps) = server.stop();
    assert_eq!((report.connections, report.failed_connections), (2, 0));
    assert_eq!(&snaps[0].contents[4096..4107], b"still alive");
    assert_eq!(snaps[0].stats.fast_zero_refusals, 1);
}
