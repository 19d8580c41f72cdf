//! nbdcopy out of and into `qcow2-nbd serve` with four connections (multi-conn, `-e 4`; the
//! server's log confirms four were made and none failed): copying a backed image out gives
//! QEMU's view of it byte for byte, and copying data in leaves an image that passes
//! `qemu-img check` and equals the source, its zero runs sent as WRITE_ZEROES.

use std::process::Command;

use crate::support::Server;
use test_support::{
    assert_check_clean, assert_same_bytes, assert_same_contents, qemu_contents, qemu_img, require,
    run_ok, Dir, Rng,
};

/// Deterministic bytes with runs of zeroes, so nbdcopy both writes and zeroes.
pub(crate) fn source_bytes(len: usize) -> Vec<u8> {
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
    let server = Server::unix_reporting(&["-t", "-r", "-e", "4", top.to_str().unwrap()]);
    let out = images.path("out.raw");
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .args(["--connections=4", "--threads=4", &server.uri()])
            .arg(&out),
    );
    let report = server.stop_report();
    assert!(report.connections >= 4, "{report:?}");
    assert_same_bytes(
        &std::fs::read(&out).unwrap(),
        &qemu_contents(&top, &["-f", "qcow2"]),
        "the copy against QEMU's view of the image",
    );
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
    let server =
        Server::unix_reporting(&["-t", "-e", "4", "--discard=unmap", top.to_str().unwrap()]);
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .args(["--connections=4", "--threads=4", "--flush"])
            .arg(&source)
            .arg(server.uri()),
    );
    let report = server.stop_report();
    assert!(report.connections >= 4, "{report:?}");
    assert_eq!(report.failed_connections, 0, "{report:?}");
    assert_check_clean(&top);
    assert_same_contents(&top, "qcow2", &source, "raw");
    // Written zeroes would be data clusters (the server does not detect zeroes by default):
    // zero clusters of the top image mean the zero runs arrived as WRITE_ZEROES.
    let map: serde_json::Value =
        serde_json::from_str(&qemu_img(&["map", "--output=json", top.to_str().unwrap()])).unwrap();
    let zeroed: u64 = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["depth"] == 0 && e["zero"] == true && e["data"] == false)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert!(zeroed > 0, "no zero clusters in the top image: {map}");
}
