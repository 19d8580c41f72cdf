//! libnbd's nbdinfo against the server: flags, sizes and contexts in `--json` of a
//! read-only rotational export, the allocation maps of both contexts, and export listing.

use std::process::Command;
use std::rc::Rc;

use nbd::{ExportEntry, ExportFeatures, MemExport};
use serde_json::Value;
use test_support::nbd_server::{mem_server, snapshots, Opts, TestServer};
use test_support::{require, run_ok, stdout};

fn nbdinfo(args: &[&str]) -> String {
    let bin = require("nbdinfo", "libnbd-bin");
    stdout(&run_ok(Command::new(bin).args(args)))
}

/// A 1 MiB export over a backing layer: [0,64k) from the backing file, [64k,128k) written
/// on top, [128k,192k) allocated zeroes on top, the rest unallocated.
fn layered() -> MemExport {
    let base = MemExport::new(1 << 20);
    base.fill(0, &[7; 65536]);
    let top = MemExport::new(1 << 20).with_backing(base);
    top.fill(65536, &[9; 65536]);
    top.fill(131072, &[1; 65536]);
    top.zero(131072, 65536, false);
    top
}

#[test]
fn json_of_a_read_only_rotational_export() {
    let features = ExportFeatures {
        read_only: true,
        rotational: true,
        multi_conn: false,
        allocation_depth: false,
        cache: false,
        block_size: nbd::BlockSize {
            minimum: 512,
            preferred: 65536,
            maximum: 1 << 20,
        },
        ..ExportFeatures::default()
    };
    let server = mem_server(Opts::default(), move || {
        MemExport::new(1 << 20).with_features(features)
    });
    let v: Value = serde_json::from_str(&nbdinfo(&["--json", &server.uri()])).unwrap();
    let e = &v["exports"][0];
    for (key, want) in [
        ("is_read_only", true),
        ("is_rotational", true),
        ("can_trim", false),
        ("can_zero", false),
        ("can_fast_zero", false),
        ("can_multi_conn", false),
        ("can_cache", false),
    ] {
        assert_eq!(e[key], want, "{key} in {v}");
    }
    assert_eq!(e["block_size_minimum"], 512);
    assert_eq!(e["block_size_preferred"], 65536);
    assert_eq!(e["block_size_maximum"], 1 << 20);
    assert_eq!(e["contexts"], serde_json::json!(["base:allocation"]));
}

fn map_rows(out: &str) -> Vec<(u64, u64, u64, String)> {
    out.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
                f[3].to_owned(),
            )
        })
        .collect()
}

#[test]
fn map_of_base_allocation_and_allocation_depth() {
    let server = mem_server(Opts::default(), layered);
    let rows = map_rows(&nbdinfo(&["--map", &server.uri()]));
    assert_eq!(
        rows,
        [
            (0, 131072, 0, "data".to_owned()),
            (131072, 65536, 2, "zero".to_owned()),
            (196608, 851968, 3, "hole,zero".to_owned()),
        ]
    );
    // nbdinfo names depth 0 "absent", 1 "local" and N >= 2 "backing depth N".
    let out = nbdinfo(&["--map=qemu:allocation-depth", &server.uri()]);
    assert_eq!(
        map_rows(&out),
        [
            (0, 65536, 2, "backing".to_owned()),
            (65536, 131072, 1, "local".to_owned()),
            (196608, 851968, 0, "absent".to_owned()),
        ]
    );
    assert!(out.contains("backing depth 2"), "{out}");
    // The map agrees with the export's own view.
    let (_, snaps) = server.stop();
    let mut depths: Vec<(u64, u32)> = Vec::new();
    for e in &snaps[0].extents {
        match depths.last_mut() {
            Some(last) if last.1 == e.depth => last.0 += e.len,
            _ => depths.push((e.len, e.depth)),
        }
    }
    assert_eq!(depths, [(65536, 2), (131072, 1), (851968, 0)]);
}

#[test]
fn list_shows_every_export_with_its_description() {
    let server = TestServer::start_with(
        Opts::default(),
        || {
            vec![
                ExportEntry::new("disk1", Rc::new(MemExport::new(1 << 20)))
                    .with_description("first disk"),
                ExportEntry::new("disk2", Rc::new(MemExport::new(2 << 20))),
            ]
        },
        snapshots,
    );
    let out = nbdinfo(&["--list", "--json", &server.uri()]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let exports = v["exports"].as_array().unwrap();
    let names: Vec<&str> = exports
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["disk1", "disk2"]);
    assert_eq!(exports[0]["description"], "first disk");
    assert_eq!(exports[1]["export-size"], 2 << 20);
    // Named exports are reachable by their exact name only, as with qemu-nbd: the empty
    // name, another case or an unknown name is refused.
    let size = |uri: &str| nbdinfo(&["--size", uri]).trim().parse::<u64>().unwrap();
    assert_eq!(size(&server.uri_of("disk2")), 2 << 20);
    assert_eq!(size(&server.uri_of("disk1")), 1 << 20);
    for uri in [server.uri(), server.uri_of("nope"), server.uri_of("DISK1")] {
        let missing = Command::new(require("nbdinfo", "libnbd-bin"))
            .args(["--size", &uri])
            .output()
            .unwrap();
        assert!(!missing.status.success(), "{uri} was served");
        let err = String::from_utf8_lossy(&missing.stderr);
        assert!(err.contains("server has no export named"), "{uri}: {err}");
    }
}
