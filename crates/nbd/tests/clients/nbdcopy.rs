//! nbdcopy out of and into the server with four connections: extents, zeroing and
//! multi-conn writes end up byte-identical. (nbdcopy caps connections at its thread
//! count, so both are set.)

use std::process::Command;

use nbd::MemExport;
use test_support::nbd_server::{mem_server, Opts};
use test_support::{require, run_ok};

const SIZE: usize = 8 << 20;

fn sample() -> Vec<u8> {
    let mut data = vec![0u8; SIZE];
    // Data islands separated by zero runs, some not granule-aligned.
    for (start, len, seed) in [
        (0usize, 65536usize, 1u8),
        (1 << 20, 4096, 2),
        (3 << 20, 300_000, 3),
        (SIZE - 512, 512, 4),
    ] {
        for (i, b) in data[start..start + len].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(7).wrapping_add(seed) | 1;
        }
    }
    data
}

#[test]
fn nbdcopy_out_with_four_connections_matches_the_export() {
    let data = sample();
    let fill = data.clone();
    let server = mem_server(Opts::default(), move || {
        let m = MemExport::new(SIZE as u64);
        m.fill(0, &fill);
        m
    });
    let out = server.dir().join("out.raw");
    let bin = require("nbdcopy", "libnbd-bin");
    run_ok(
        Command::new(bin)
            .args(["--connections=4", "--threads=4", &server.uri()])
            .arg(&out),
    );
    assert!(std::fs::read(&out).unwrap() == data, "copied image differs");
    let (report, _) = server.stop();
    assert!(report.connections >= 4, "{report:?}");
}

#[test]
fn nbdcopy_in_with_four_connections_writes_every_byte() {
    let data = sample();
    let server = mem_server(Opts::default(), || {
        let m = MemExport::new(SIZE as u64);
        // Stale contents the copy must overwrite or zero.
        m.fill(0, &vec![0xff; SIZE]);
        m
    });
    let input = server.dir().join("in.raw");
    std::fs::write(&input, &data).unwrap();
    let bin = require("nbdcopy", "libnbd-bin");
    run_ok(
        Command::new(bin)
            .args(["--connections=4", "--threads=4", "--flush"])
            .arg(&input)
            .arg(server.uri()),
    );
    let (report, snaps) = server.stop();
    assert_eq!(report.failed_connections, 0);
    assert!(report.connections >= 4, "{report:?}");
    assert!(snaps[0].contents == data, "written image differs");
    assert!(
        snaps[0].stats.zero_writes > 0,
        "zero runs were sent as WRITE_ZEROES"
    );
}
