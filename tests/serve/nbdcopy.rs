//! nbdcopy out of and into `qcow2-nbd serve` with four connections (multi-conn, `-e 4`):
//! copying a backed image out gives QEMU's view of it byte for byte, and copying data in
//! leaves an image that passes `qemu-img check` and equals the source.

use std::process::Command;

use crate::support::Server;
use test_support::{
    assert_check_clean, assert_same_contents, qemu_contents, require, run_ok, Dir, Rng,
};

/// Deterministic bytes with runs of zeroes, so nbdcopy both writes and zeroes.
fn source_bytes(len: usize) -> Vec<u8> {
    let mut out = Rng(0x9e37_79b9_7f4a_7c15).bytes(len);
    // Every fourth 256 KiB block is zeroes.
    for (i, block) in out.chunks_mut(256 << 10).enumerate() {
        if i % 4 == 3 {
            block.fill(0);
        }
    }
    out
}

#[test]
fn nbdcopy_out_with_four_connections_matches_qemu() {
    let images = Dir::new();
    images.create("base.qcow2", "qcow2", "", None, "24M");
    images.qemu_io(
        "qcow2",
        "base.qcow2",
        &["write -P 0x31 0 8M", "write -P 0x32 20M 1M"],
    );
    let top = images.create(
        "top.qcow2",
        "qcow2",
        "extended_l2=on",
        Some(("base.qcow2", "qcow2")),
        "24M",
    );
    images.qemu_io(
        "qcow2",
        "top.qcow2",
        &[
            "write -P 0x41 4M 6M",
            "write -z 1M 1M",
            "write -P 0x42 12345 6789",
        ],
    );
    let server = Server::unix(&["-t", "-r", "-e", "4", top.to_str().unwrap()]);
    let out = images.path("out.raw");
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .args(["--connections=4", "--threads=4", &server.uri()])
            .arg(&out),
    );
    server.stop_ok();
    let ours = std::fs::read(&out).unwrap();
    let theirs = qemu_contents(&top, &["-f", "qcow2"]);
    assert_eq!(ours.len(), theirs.len());
    let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
    assert_eq!(first, None, "first difference at byte {first:?}");
}

#[test]
fn nbdcopy_in_with_four_connections_writes_every_byte() {
    let images = Dir::new();
    let source = images.path("source.raw");
    std::fs::write(&source, source_bytes(32 << 20)).unwrap();
    images.create("base.qcow2", "qcow2", "", None, "32M");
    images.qemu_io("qcow2", "base.qcow2", &["write -P 0x99 0 32M"]);
    let top = images.create(
        "top.qcow2",
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        Some(("base.qcow2", "qcow2")),
        "32M",
    );
    let server = Server::unix(&["-t", "-e", "4", "--discard=unmap", top.to_str().unwrap()]);
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .args(["--connections=4", "--threads=4", "--flush"])
            .arg(&source)
            .arg(server.uri()),
    );
    server.stop_ok();
    assert_check_clean(&top);
    assert_same_contents(&top, "qcow2", &source, "raw");
}
