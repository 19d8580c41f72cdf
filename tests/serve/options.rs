//! The `serve` options that change what clients see or what reaches the disk: `-s` (a
//! throw-away overlay), `-l` (an internal snapshot), `-f raw`, every `--cache` mode with both
//! `--aio` backends, `--detect-zeroes`, and the qcow2 cache flags.

use std::path::Path;

use crate::support::Server;
use serde_json::Value;
use test_support::{
    assert_check_clean, assert_same_contents, nbdinfo, qemu_img, qemu_io, qemu_io_read_only, Dir,
};

fn nbdinfo_json(uri: &str) -> Value {
    let out = nbdinfo(&["--json", uri]);
    serde_json::from_str::<Value>(&out).unwrap()["exports"][0].clone()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn snapshot_mode_sends_writes_to_a_temporary_overlay() {
    let images = Dir::new();
    let tmp = tempfile::tempdir().unwrap();
    for (name, fmt) in [("disk.qcow2", "qcow2"), ("disk.raw", "raw")] {
        let img = images.create(name, fmt, "", None, "4M");
        images.qemu_io(fmt, name, &["write -P 0x33 0 1M"]);
        let before = std::fs::read(&img).unwrap();
        let server = Server::unix_with_env(
            &["-t", "-s", "-f", fmt, img.to_str().unwrap()],
            &[("TMPDIR", tmp.path().as_os_str())],
        );
        let e = nbdinfo_json(&server.uri());
        assert_eq!(e["is_read_only"], false);
        qemu_io(
            "raw",
            &server.uri(),
            &[
                "read -P 0x33 0 1M",
                "write -P 0x44 512k 1M",
                "write -z 3M 64k",
            ],
        );
        // A second connection sees the writes: they live in the overlay, not in memory.
        qemu_io(
            "raw",
            &server.uri(),
            &["read -P 0x33 0 512k", "read -P 0x44 512k 1M"],
        );
        let dirs = entries(tmp.path());
        assert_eq!(dirs.len(), 1, "{dirs:?}");
        assert!(dirs[0].starts_with("qcow2-nbd-snapshot."), "{dirs:?}");
        assert_eq!(entries(&tmp.path().join(&dirs[0])), ["overlay.qcow2"]);
        server.stop_ok();
        assert_eq!(
            std::fs::read(&img).unwrap(),
            before,
            "{name}: the image itself is untouched"
        );
        assert!(
            entries(tmp.path()).is_empty(),
            "the overlay is deleted on exit"
        );
    }
}

#[test]
fn load_snapshot_exports_an_internal_snapshot_read_only() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "4M");
    let i = img.to_str().unwrap();
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 0x01 0 1M"]);
    qemu_img(&["snapshot", "-c", "first", i]);
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 0x02 0 512k"]);
    qemu_img(&["snapshot", "-c", "second", i]);
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 0x03 0 256k"]);
    for (param, head) in [
        ("first", 0x01),
        ("snapshot.name=second", 0x02),
        ("snapshot.id=1", 0x01),
        ("2", 0x02),
    ] {
        let server = Server::unix(&["-t", "-l", param, i]);
        let e = nbdinfo_json(&server.uri());
        assert_eq!(e["is_read_only"], true, "-l {param}");
        qemu_io_read_only(
            "raw",
            &server.uri(),
            &[&format!("read -P {head} 0 256k"), "read -P 0x01 512k 512k"],
        );
        server.stop_ok();
    }
    qemu_io("qcow2", i, &["read -P 0x03 0 256k"]);
    assert_check_clean(&img);
}

#[test]
fn raw_export_with_unmap() {
    let images = Dir::new();
    let img = images.create("disk.raw", "raw", "", None, "4M");
    images.qemu_io("raw", "disk.raw", &["write -P 0x5e 0 4M"]);
    std::fs::copy(&img, images.path("model.raw")).unwrap();
    let server = Server::unix(&["-t", "-f", "raw", "--discard=unmap", img.to_str().unwrap()]);
    let e = nbdinfo_json(&server.uri());
    assert_eq!(e["block_size_preferred"], 4096);
    assert_eq!(e["can_zero"], true);
    let session = [
        "write -P 0x61 1000 70000",
        "write -z 131072 65536",
        "write -z -u 262144 131072",
        "write -f -P 0x62 1M 4k",
        "flush",
    ];
    qemu_io("raw", &server.uri(), &session);
    qemu_io("raw", &server.uri(), &["discard 2M 1M", "read -P 0 2M 1M"]);
    server.stop_ok();
    images.qemu_io("raw", "model.raw", &session);
    images.qemu_io("raw", "model.raw", &["write -z 2M 1M"]);
    assert_same_contents(&img, "raw", &images.path("model.raw"), "raw");
}

#[test]
fn every_cache_mode_with_both_aio_backends() {
    let images = Dir::new();
    images.create("base.qcow2", "qcow2", "", None, "4M");
    images.qemu_io("qcow2", "base.qcow2", &["write -P 0x10 0 4M"]);
    for cache in ["none", "writeback", "writethrough", "directsync", "unsafe"] {
        for aio in ["io_uring", "threads"] {
            let name = format!("top-{cache}-{aio}.qcow2");
            let top = images.create(
                &name,
                "qcow2",
                "extended_l2=on",
                Some(("base.qcow2", "qcow2")),
                "4M",
            );
            let server = Server::unix(&[
                "-t",
                &format!("--cache={cache}"),
                &format!("--aio={aio}"),
                top.to_str().unwrap(),
            ]);
            qemu_io(
                "raw",
                &server.uri(),
                &[
                    "write -P 0x21 70000 5000",
                    "write -f -P 0x22 1M 64k",
                    "write -z 2M 4k",
                    "flush",
                    "read -P 0x10 0 70000",
                    "read -P 0x21 70000 5000",
                ],
            );
            server.stop_ok();
            assert_check_clean(&top);
            qemu_io(
                "qcow2",
                top.to_str().unwrap(),
                &[
                    "read -P 0x10 0 70000",
                    "read -P 0x21 70000 5000",
                    "read -P 0x10 75000 973576",
                    "read -P 0x22 1M 64k",
                    "read -P 0 2M 4k",
                ],
            );
        }
    }
}

/// (data, zero) of the extent at guest offset 0, and the allocated cluster count.
fn state_at_zero(img: &Path) -> ((bool, bool), u64) {
    let i = img.to_str().unwrap();
    let map: Value = serde_json::from_str(&qemu_img(&["map", "--output=json", i])).unwrap();
    let first = &map[0];
    assert_eq!(first["start"], 0);
    let check: Value = serde_json::from_str(&qemu_img(&["check", "--output=json", i])).unwrap();
    (
        (
            first["data"].as_bool().unwrap(),
            first["zero"].as_bool().unwrap(),
        ),
        check["allocated-clusters"].as_u64().unwrap(),
    )
}

#[test]
fn detect_zeroes_turns_zero_writes_into_zeroing() {
    let images = Dir::new();
    for (flags, want_data, frees) in [
        (&["--detect-zeroes=off"][..], true, false),
        (&["--detect-zeroes=on"], false, false),
        (&["--detect-zeroes=unmap", "--discard=unmap"], false, true),
    ] {
        let name = format!("disk{}.qcow2", flags.len() + usize::from(want_data));
        let img = images.create(&name, "qcow2", "", None, "2M");
        images.qemu_io("qcow2", &name, &["write -P 0x11 0 1M"]);
        let (_, allocated_before) = state_at_zero(&img);
        let mut args = vec!["-t"];
        args.extend_from_slice(flags);
        args.push(img.to_str().unwrap());
        let server = Server::unix(&args);
        qemu_io(
            "raw",
            &server.uri(),
            &["write -P 0 0 256k", "read -P 0 0 256k"],
        );
        server.stop_ok();
        assert_check_clean(&img);
        let ((data, zero), allocated) = state_at_zero(&img);
        assert_eq!((data, zero), (want_data, !want_data), "{flags:?}");
        if frees {
            assert_eq!(
                allocated,
                allocated_before - 4,
                "{flags:?}: four clusters freed"
            );
        } else {
            assert_eq!(allocated, allocated_before, "{flags:?}");
        }
        qemu_io(
            "qcow2",
            img.to_str().unwrap(),
            &["read -P 0 0 256k", "read -P 0x11 256k 768k"],
        );
    }
}

#[test]
fn cache_flags_reach_the_engine() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "cluster_size=4096", None, "64M");
    let server = Server::unix(&[
        "-t",
        "--log=info",
        "--l2-cache-size=16K",
        "--l2-cache-entry-size=1K",
        "--refcount-cache-size=16K",
        "--cache-clean-interval=7",
        img.to_str().unwrap(),
    ]);
    // Scattered writes through a tiny cache: slices are evicted and reloaded all the time.
    let cmds: Vec<String> = (0..64u64)
        .map(|i| format!("write -P {} {} 4k", i + 1, i * 1_000_000 / 4096 * 4096))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io("raw", &server.uri(), &cmds);
    let log = server.stop_ok();
    for want in [
        "l2_cache_bytes: 16384",
        "l2_entry_size: 1024",
        "refcount_cache_bytes: 16384",
        "clean_interval_secs: 7",
    ] {
        assert!(
            log.contains(want),
            "{want} not in the --log=info log:\n{log}"
        );
    }
    assert_check_clean(&img);
    let reads: Vec<String> = (0..64u64)
        .map(|i| format!("read -P {} {} 4k", i + 1, i * 1_000_000 / 4096 * 4096))
        .collect();
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    qemu_io("qcow2", img.to_str().unwrap(), &reads);
}
