//! fio's libnbd engine against `qcow2-nbd serve`: four jobs, each its own connection, queue
//! depth 32, random writes of mixed sizes over a backed extended-L2 image, every byte read
//! back and verified with crc32c, and no connection failed; the image then passes
//! `qemu-img check`.

use std::process::Command;

use crate::support::Server;
use test_support::{assert_check_clean, require, run_ok, Dir};

#[test]
fn fio_four_jobs_queue_depth_32_verifies_every_byte() {
    let images = Dir::new();
    images.create("base.qcow2", "qcow2", "", None, "64M");
    images.qemu_io("qcow2", "base.qcow2", &["write -P 0x5a 0 64M"]);
    let top = images.create(
        "top.qcow2",
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        Some(("base.qcow2", "qcow2")),
        "64M",
    );
    let server = Server::unix_reporting(&["-t", "-e", "0", top.to_str().unwrap()]);
    let report = images.path("fio.json");
    // fio leaves its verify state files in the working directory.
    run_ok(
        Command::new(require("fio", "fio"))
            .current_dir(images.root())
            .args([
                "--name=serve",
                "--ioengine=nbd",
                &format!("--uri={}", server.uri()),
                "--rw=randwrite",
                "--bsrange=512-64k",
                "--iodepth=32",
                "--numjobs=4",
                "--size=16m",
                "--offset_increment=16m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--group_reporting",
                "--output-format=json",
                &format!("--output={}", report.display()),
            ]),
    );
    let counts = server.stop_report();
    // fio also opens a short connection per job to learn the size.
    assert!(counts.connections >= 4, "{counts:?}");
    assert_eq!(counts.failed_connections, 0, "{counts:?}");
    let text = std::fs::read_to_string(&report).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text[text.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("fio JSON output: {e}\n{text}"));
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    assert_eq!(written, 64 << 20, "four jobs of 16 MiB each");
    assert_eq!(
        verified, written,
        "every written byte was read back and verified"
    );
    assert_check_clean(&top);
}
