//! fio's libnbd engine: four jobs, each its own connection (multi-conn), queue depth 32,
//! random writes verified with crc32c.

use std::process::Command;

use nbd::MemExport;
use test_support::nbd_server::{mem_server, Opts};
use test_support::{require, run_ok};

#[test]
fn fio_with_four_connections_and_queue_depth_32_verifies() {
    let server = mem_server(Opts::default(), || MemExport::new(64 << 20));
    let fio = require("fio", "fio");
    let report_file = server.dir().join("fio.json");
    // fio leaves its verify state files in the working directory.
    run_ok(Command::new(fio).current_dir(server.dir()).args([
        "--name=multiconn",
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
        &format!("--output={}", report_file.display()),
    ]));
    let text = std::fs::read_to_string(&report_file).expect("fio report");
    // fio may print notes before the JSON document.
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
    let (report, snaps) = server.stop();
    // fio also opens a short connection per job to learn the size.
    assert!(report.connections >= 4, "{report:?}");
    assert_eq!(report.failed_connections, 0);
    assert!(snaps[0].stats.writes > 0);
}
