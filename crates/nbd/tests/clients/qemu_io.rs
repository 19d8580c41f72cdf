//! QEMU's NBD client (qemu-io, which negotiates extended headers) against the server, over
//! a Unix socket and over TCP; the server's contents and allocation are then checked.

use nbd::{Extent, MemExport};
use std::process::Command;
use test_support::nbd_server::{mem_server, Opts, Snapshot};
use test_support::{require, run_ok, stdout};

const K: usize = 1024;
const SIZE: u64 = 1 << 20;

fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let bin = require("qemu-io", "qemu-utils");
    let mut cmd = Command::new(bin);
    cmd.args(["-f", "raw", uri]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    let out = stdout(&run_ok(&mut cmd));
    assert!(
        !out.contains("failed") && !out.contains("error"),
        "qemu-io reported a failure:\n{out}"
    );
    out
}

const SCRIPT: &[&str] = &[
    "write -P 0xab 0 64k",
    "read -P 0xab 0 64k",
    "write -P 0x12 64k 64k",
    "write -z 64k 64k",
    "read -P 0 64k 64k",
    "write -P 0xcd 128k 64k",
    "write -z -u 128k 64k",
    "read -P 0 128k 64k",
    "write -P 0xef 192k 64k",
    "discard 192k 64k",
    "flush",
    "write -f -P 0x11 256k 4k",
    "read -P 0x11 256k 4k",
    "write -P 0x33 300000 1000",
    "read -P 0x33 300000 1000",
    "read -P 0 512k 64k",
];

/// What the script leaves behind, byte for byte (the discarded range is unspecified).
fn expected() -> Vec<Option<u8>> {
    let mut m = vec![Some(0u8); SIZE as usize];
    let mut set = |off: usize, len: usize, v: Option<u8>| m[off..off + len].fill(v);
    set(0, 64 * K, Some(0xab));
    set(64 * K, 64 * K, Some(0));
    set(128 * K, 64 * K, Some(0));
    set(192 * K, 64 * K, None);
    set(256 * K, 4 * K, Some(0x11));
    set(300_000, 1000, Some(0x33));
    m
}

fn check(snap: &Snapshot) {
    for (i, want) in expected().iter().enumerate() {
        if let Some(w) = want {
            assert_eq!(snap.contents[i], *w, "byte {i}");
        }
    }
    let s = snap.stats;
    assert!(s.fua_writes >= 1, "write -f must arrive with FUA: {s:?}");
    assert!(s.trims >= 1, "discard must arrive as TRIM: {s:?}");
    assert!(s.flushes >= 2, "flush (plus the shutdown flush): {s:?}");
    assert!(s.zero_writes >= 2 && s.unmapping_zero_writes >= 1, "{s:?}");
    // `write -z` sends NO_HOLE: allocated zeroes; `write -z -u` may unmap: a hole.
    let at = |offset: u64| -> Extent {
        let mut pos = 0;
        for e in &snap.extents {
            if offset < pos + e.len {
                return *e;
            }
            pos += e.len;
        }
        panic!("offset {offset} not covered");
    };
    let z = at(64 * 1024);
    assert!(
        z.zero && !z.hole,
        "write -z keeps the range allocated: {z:?}"
    );
    let u = at(128 * 1024);
    assert!(u.zero && u.hole, "write -z -u unmaps: {u:?}");
    assert!(at(192 * 1024).hole, "discard deallocates whole granules");
}

#[test]
fn qemu_io_over_a_unix_socket() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    qemu_io(&server.uri(), SCRIPT);
    // A second, separate client sees what the first wrote.
    qemu_io(
        &server.uri(),
        &["read -P 0xab 0 64k", "read -P 0x11 256k 4k"],
    );
    let (report, snaps) = server.stop();
    assert_eq!(report.connections, 2);
    assert_eq!(report.failed_connections, 0);
    check(&snaps[0]);
}

#[test]
fn qemu_io_over_tcp() {
    let server = mem_server(
        Opts {
            tcp: true,
            ..Opts::default()
        },
        || MemExport::new(SIZE),
    );
    let addr = server.tcp.expect("tcp listener");
    qemu_io(&format!("nbd://{addr}"), SCRIPT);
    let (_, snaps) = server.stop();
    check(&snaps[0]);
}

#[test]
fn qemu_io_sees_read_errors_as_errors() {
    let server = mem_server(Opts::default(), || {
        let m = MemExport::new(SIZE);
        m.fail_range(4096, 1, nbd::Errno::Io);
        m
    });
    let bin = require("qemu-io", "qemu-utils");
    let out = Command::new(bin)
        .args([
            "-f",
            "raw",
            &server.uri(),
            "-c",
            "read 0 8k",
            "-c",
            "read -P 0 8k 8k",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error"), "{text}");
    assert!(
        text.contains("read 8192/8192 bytes at offset 8192"),
        "the connection survives: {text}"
    );
}
