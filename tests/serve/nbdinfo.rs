//! libnbd's nbdinfo against `qcow2-nbd serve`: the flags, block sizes and contexts in
//! `--json` for the flag combinations that change them, export listing, and `--map` of both
//! contexts agreeing with `qemu-img map` on backing chains (raw and qcow2 layers, standard
//! and extended L2, zeroed and discarded clusters). `mem_export` covers what only an
//! in-memory export can show.

use std::process::Command;

use crate::support::qemu_nbd::QemuNbd;
use crate::support::Server;
use serde_json::Value;
use test_support::{nbdinfo, qemu_img, require, Dir};

fn export_json(server: &Server) -> Value {
    export_json_of(server, "")
}

fn export_json_of(server: &Server, name: &str) -> Value {
    let out = nbdinfo(&["--json", &server.uri_of(name)]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["protocol"], "newstyle-fixed", "{v}");
    assert_eq!(v["structured"], true, "{v}");
    v["exports"][0].clone()
}

fn assert_flags(e: &Value, flags: &[(&str, bool)]) {
    for (key, want) in flags {
        assert_eq!(e[*key], *want, "{key} in {e}");
    }
}

fn contexts(e: &Value) -> Vec<String> {
    e["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn json_shows_every_feature_of_a_writable_shared_export() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "3M");
    let server = Server::unix(&[
        "-t",
        "-A",
        "-e",
        "2",
        "-x",
        "disk",
        "-D",
        "a qcow2 disk",
        img.to_str().unwrap(),
    ]);
    let e = export_json_of(&server, "disk");
    assert_eq!(e["export-name"], "disk");
    assert_eq!(e["export-size"], 3 << 20);
    assert_flags(
        &e,
        &[
            ("is_read_only", false),
            ("is_rotational", false),
            ("can_cache", true),
            ("can_df", true),
            ("can_fast_zero", true),
            ("can_flush", true),
            ("can_fua", true),
            ("can_multi_conn", true),
            ("can_trim", true),
            ("can_zero", true),
        ],
    );
    assert_eq!(e["block_size_minimum"], 1);
    assert_eq!(e["block_size_preferred"], 65536, "the cluster size");
    assert_eq!(e["block_size_maximum"], 32 << 20);
    assert_eq!(contexts(&e), ["base:allocation", "qemu:allocation-depth"]);
    // The named export and its description, as a listing shows them.
    let list: Value = serde_json::from_str(&nbdinfo(&["--list", "--json", &server.uri()])).unwrap();
    let exports = list["exports"].as_array().unwrap();
    assert_eq!(exports.len(), 1, "{list}");
    assert_eq!(exports[0]["export-name"], "disk");
    assert_eq!(exports[0]["description"], "a qcow2 disk");
    let size = nbdinfo(&["--size", &server.uri_of("disk")]);
    assert_eq!(size.trim(), (3u64 << 20).to_string());
    server.stop_ok();
}

#[test]
fn json_of_a_read_only_export() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "cluster_size=4096", None, "1M");
    let server = Server::unix(&["-r", img.to_str().unwrap()]);
    let e = export_json(&server);
    assert_eq!(e["export-name"], "", "the default export");
    assert_flags(
        &e,
        &[
            ("is_read_only", true),
            ("can_trim", false),
            ("can_zero", false),
            ("can_fast_zero", false),
            // A read-only export is consistent across connections by nature.
            ("can_multi_conn", true),
            ("can_flush", true),
            ("can_cache", true),
        ],
    );
    assert_eq!(e["block_size_preferred"], 4096);
    assert_eq!(contexts(&e), ["base:allocation"], "no -A, no depth context");
    server.stop_ok();
}

#[test]
fn a_writable_export_for_one_client_does_not_advertise_multi_conn() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::unix(&[img.to_str().unwrap()]);
    let e = export_json(&server);
    assert_flags(&e, &[("can_multi_conn", false), ("can_trim", true)]);
    server.stop_ok();
}

#[test]
fn preferred_block_size_is_the_subcluster_within_4k_and_2m() {
    let images = Dir::new();
    for (opts, fmt, want) in [
        ("cluster_size=65536,extended_l2=on", "qcow2", 4096),
        ("cluster_size=2M,extended_l2=on", "qcow2", 65536),
        ("cluster_size=2M", "qcow2", 2 << 20),
        ("", "raw", 4096),
    ] {
        let name = format!("disk-{want}-{fmt}");
        let img = images.create(&name, fmt, opts, None, "4M");
        let server = Server::unix(&["-f", fmt, img.to_str().unwrap()]);
        let e = export_json(&server);
        assert_eq!(e["block_size_preferred"], want, "{opts} {fmt}: {e}");
        server.stop_ok();
    }
}

/// (granule index, value) for every 512-byte granule of a map.
type Granules = Vec<(u64, u64)>;

/// One qemu-img map extent, or one nbdinfo map row, cut into 512-byte granules.
fn granules(start: u64, len: u64, value: u64, out: &mut Granules) {
    assert!(start % 512 == 0 && len % 512 == 0, "{start} {len}");
    for g in 0..len / 512 {
        out.push((start / 512 + g, value));
    }
}

/// Per granule, what `qemu-img map` implies for `base:allocation` (NBD_STATE_HOLE = 1 when
/// not data, NBD_STATE_ZERO = 2) and for `qemu:allocation-depth` (0 absent, else depth + 1).
fn qemu_expectations(image: &str) -> (Granules, Granules) {
    let map: Value = serde_json::from_str(&qemu_img(&["map", "--output=json", image])).unwrap();
    let (mut alloc, mut depth) = (Vec::new(), Vec::new());
    for e in map.as_array().unwrap() {
        let (start, len) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
        let data = e["data"].as_bool().unwrap();
        let zero = e["zero"].as_bool().unwrap();
        let flags = u64::from(!data) | (u64::from(zero) << 1);
        granules(start, len, flags, &mut alloc);
        let d = if e["present"].as_bool().unwrap() {
            e["depth"].as_u64().unwrap() + 1
        } else {
            0
        };
        granules(start, len, d, &mut depth);
    }
    (alloc, depth)
}

/// `nbdinfo --map[=CONTEXT]` rows ("start length value description") as granules.
fn nbdinfo_map(server: &Server, context: Option<&str>) -> Granules {
    let flag = match context {
        Some(c) => format!("--map={c}"),
        None => "--map".to_owned(),
    };
    let out = nbdinfo(&[&flag, &server.uri()]);
    let mut g = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        granules(
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
            &mut g,
        );
    }
    g
}

fn assert_maps_agree(image: &str) {
    let (alloc, depth) = qemu_expectations(image);
    let server = Server::unix(&["-t", "-r", "-A", image]);
    let ours = nbdinfo_map(&server, None);
    let first = ours.iter().zip(&alloc).position(|(a, b)| a != b);
    assert!(
        ours.len() == alloc.len() && first.is_none(),
        "{image}: base:allocation differs from qemu-img map at granule {first:?} ({} vs {} granules)",
        ours.len(),
        alloc.len()
    );
    let ours = nbdinfo_map(&server, Some("qemu:allocation-depth"));
    let first = ours.iter().zip(&depth).position(|(a, b)| a != b);
    assert!(
        ours.len() == depth.len() && first.is_none(),
        "{image}: qemu:allocation-depth differs from qemu-img map at granule {first:?}"
    );
    server.stop_ok();
}

#[test]
fn maps_agree_with_qemu_img_on_a_raw_qcow2_extended_chain() {
    let images = Dir::new();
    // A fully written raw base (a sparse one would show its holes as zeroes in QEMU).
    images.create("base.raw", "raw", "", None, "4M");
    images.qemu_io("raw", "base.raw", &["write -P 0x55 0 4M"]);
    images.create("mid.qcow2", "qcow2", "", Some(("base.raw", "raw")), "4M");
    images.qemu_io(
        "qcow2",
        "mid.qcow2",
        &[
            "write -P 0x66 64k 192k",
            "write -z 512k 128k",
            "write -P 0x67 1M 64k",
        ],
    );
    images.create(
        "top.qcow2",
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        Some(("mid.qcow2", "qcow2")),
        "4M",
    );
    images.qemu_io(
        "qcow2",
        "top.qcow2",
        &[
            "write -P 0x77 0 2k",
            "write -P 0x78 6k 4k",
            "write -z 128k 6k",
            "write -z -u 1M 64k",
            "write -P 0x79 2M 100k",
            "discard 3M 64k",
        ],
    );
    assert_maps_agree(&images.s("top.qcow2"));
}

#[test]
fn maps_agree_with_qemu_img_on_a_qcow2_chain_with_absent_ranges() {
    let images = Dir::new();
    images.create("base.qcow2", "qcow2", "cluster_size=4096", None, "8M");
    images.qemu_io(
        "qcow2",
        "base.qcow2",
        &["write -P 1 0 1M", "write -z 2M 1M", "write -P 2 5M 12k"],
    );
    images.create(
        "top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "8M",
    );
    images.qemu_io(
        "qcow2",
        "top.qcow2",
        &["write -P 3 512k 1M", "write -z 4M 256k", "write -P 4 7M 4k"],
    );
    assert_maps_agree(&images.s("top.qcow2"));
    assert_maps_agree(&images.s("base.qcow2"));
}

/// Which of `asked` a server at `uri_of(name)` serves, by `nbdinfo --size`.
fn names_served(uri_of: impl Fn(&str) -> String, asked: &[&str]) -> Vec<(String, bool)> {
    asked
        .iter()
        .map(|name| {
            let out = Command::new(require("nbdinfo", "libnbd-bin"))
                .args(["--size", &uri_of(name)])
                .output()
                .unwrap();
            (name.to_string(), out.status.success())
        })
        .collect()
}

#[test]
fn export_names_are_matched_as_qemu_nbd_matches_them() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let asked = ["", "disk", "DISK", "disk%20", "dis", "other"];
    for export in ["", "disk"] {
        let ours = Server::unix(&["-t", "-r", "-x", export, img.to_str().unwrap()]);
        let got = names_served(|n| ours.uri_of(n), &asked);
        ours.stop_ok();
        let qemu = QemuNbd::unix(&["-r", "-x", export], &img);
        let want = names_served(|n| qemu.uri_of(n), &asked);
        drop(qemu);
        assert_eq!(got, want, "serving -x {export:?}");
        // The oracle agrees with the rule the README states: exact match only.
        let served: Vec<&str> = want
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(served, [export], "qemu-nbd -x {export:?}");
    }
}

/// nbdinfo against the nbd-server crate's server over in-memory exports, for what the binary cannot
/// serve: feature flags and block sizes it never sets, several exports at once, and a layered
/// export whose allocation and depth are known exactly.
mod mem_export {
    use std::process::Command;
    use std::rc::Rc;

    use nbd_server::{ExportEntry, ExportFeatures, MemExport};
    use serde_json::Value;
    use test_support::nbd_server::{mem_server, snapshots, Opts, TestServer};
    use test_support::{nbdinfo, require};

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
            block_size: nbd_server::BlockSize {
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
}
