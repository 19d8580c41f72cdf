//! Persistent dirty bitmaps through the engine, with QEMU as the oracle: what we track, QEMU
//! reads (qemu-nbd -B and nbdinfo); what QEMU tracked, we go on tracking and the other way
//! round; a crash leaves bitmaps in use, as QEMU leaves them.

use qcow2::format::GuestOffset;
use std::path::Path;

use qcow2::engine::{Image, OpenOptions};
use storage::{Aio, AnyStorage, IoBuf};

use crate::support::opener;
use test_support::{
    assert_check_clean, qemu_bitmaps, qemu_dirty_ranges, qemu_img, qemu_io, run, Dir,
};

const K: u64 = 1024;
const M: u64 = 1024 * 1024;

async fn open(path: &Path, read_only: bool) -> Image<AnyStorage> {
    let opts = OpenOptions {
        read_only,
        ..OpenOptions::default()
    };
    Image::open(&opener(Aio::Threads), path, &opts)
        .await
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn names_and_flags(path: &Path) -> Vec<(String, Vec<String>)> {
    qemu_bitmaps(path)
        .into_iter()
        .map(|b| (b.name, b.flags))
        .collect()
}

/// The three bitmaps of [`image_with_bitmaps`], each marked in use.
fn all_in_use() -> Vec<(String, Vec<String>)> {
    vec![
        ("b1".into(), flags(&["in-use", "auto"])),
        ("b2".into(), flags(&["in-use"])),
        ("b3".into(), flags(&["in-use", "auto"])),
    ]
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// A 64 MiB image with `b1` (enabled, 64 KiB), `b2` (disabled) and `b3` (enabled, 1 MiB).
fn image_with_bitmaps(d: &Dir) -> std::path::PathBuf {
    let path = d.create("img.qcow2", "qcow2", "", None, "64M");
    let p = d.s("img.qcow2");
    qemu_img(&["bitmap", "--add", &p, "b1"]);
    qemu_img(&["bitmap", "--add", "--disable", &p, "b2"]);
    qemu_img(&["bitmap", "--add", "-g", "1M", &p, "b3"]);
    path
}

async fn write(img: &Image<AnyStorage>, offset: u64, len: usize) {
    let (res, _) = img
        .write(
            GuestOffset(offset),
            IoBuf::from_slice(&vec![0x5a; len]),
            false,
        )
        .await;
    res.unwrap();
}

#[test]
fn writes_zeroes_and_trims_are_tracked_where_qemu_reads_them() {
    let d = Dir::new();
    let path = image_with_bitmaps(&d);
    run(async {
        let img = open(&path, false).await;
        write(&img, M + 512, 4096).await;
        img.write_zeroes(GuestOffset(8 * M), 64 * K, false, false)
            .await
            .unwrap();
        img.discard(GuestOffset(16 * M), 128 * K).await.unwrap();
        img.close().await.unwrap();
    });
    assert_check_clean(&path);
    assert_eq!(
        names_and_flags(&path),
        vec![
            ("b1".into(), flags(&["auto"])),
            ("b2".into(), flags(&[])),
            ("b3".into(), flags(&["auto"]))
        ]
    );
    assert_eq!(
        qemu_dirty_ranges(&path, "b1"),
        vec![(M, 64 * K), (8 * M, 64 * K), (16 * M, 128 * K)]
    );
    assert_eq!(qemu_dirty_ranges(&path, "b2"), vec![]);
    assert_eq!(
        qemu_dirty_ranges(&path, "b3"),
        vec![(M, M), (8 * M, M), (16 * M, M)]
    );
}

#[test]
fn qemu_goes_on_where_we_stop_and_we_go_on_where_qemu_stops() {
    let d = Dir::new();
    let path = image_with_bitmaps(&d);
    let p = d.s("img.qcow2");
    qemu_io("qcow2", &p, &["write 0 4k"]);
    run(async {
        let img = open(&path, false).await;
        assert!(
            img.bitmap_data("b1").await.unwrap().get(0),
            "QEMU's write is loaded"
        );
        write(&img, 4 * M, 4096).await;
        img.close().await.unwrap();
    });
    qemu_io("qcow2", &p, &["write 32M 4k"]);
    assert_check_clean(&path);
    assert_eq!(
        qemu_dirty_ranges(&path, "b1"),
        vec![(0, 64 * K), (4 * M, 64 * K), (32 * M, 64 * K)]
    );
    run(async {
        let img = open(&path, true).await;
        let data = img.bitmap_data("b1").await.unwrap();
        let dirty: Vec<u64> = (0..1024).filter(|&i| data.get(i)).collect();
        assert_eq!(dirty, vec![0, 64, 512], "we read back what QEMU stored");
    });
}

#[test]
fn an_open_image_holds_its_bitmaps_in_use_and_a_crash_leaves_them_so() {
    let d = Dir::new();
    let path = image_with_bitmaps(&d);
    run(async {
        let img = open(&path, false).await;
        assert_eq!(
            names_and_flags(&path),
            all_in_use(),
            "marked in use on disk before the first write"
        );
        write(&img, 0, 4096).await;
        img.flush().await.unwrap();
        // Dropped without a close: what a crash leaves.
    });
    run(async {
        let img = open(&path, false).await;
        let listed = img.bitmaps().await.unwrap();
        assert!(listed.iter().all(|b| b.inconsistent), "{listed:?}");
        let err = img.clear_bitmap("b1").unwrap_err().to_string();
        assert!(err.contains("inconsistent"), "{err}");
        assert!(img.bitmap_data("b1").await.is_err());
        img.close().await.unwrap();
    });
    assert_eq!(
        names_and_flags(&path),
        all_in_use(),
        "an inconsistent bitmap is never stored as clean"
    );
    run(async {
        let img = open(&path, false).await;
        for name in ["b1", "b2", "b3"] {
            img.remove_bitmap(name).unwrap();
        }
        img.close().await.unwrap();
    });
    assert_eq!(qemu_bitmaps(&path), vec![]);
    assert_check_clean(&path);
}

#[test]
fn changes_to_the_set_are_stored_as_qemu_stores_them() {
    let d = Dir::new();
    let path = image_with_bitmaps(&d);
    run(async {
        let img = open(&path, false).await;
        img.add_bitmap("new", Some(128 * K), false).unwrap();
        img.set_bitmap_enabled("b2", true).unwrap();
        img.set_bitmap_enabled("b1", false).unwrap();
        write(&img, 2 * M, 4096).await;
        img.remove_bitmap("b3").unwrap();
        let b2 = img.bitmap_data("b2").await.unwrap();
        img.merge_bitmap("new", &b2, img.size()).unwrap();
        img.close().await.unwrap();
    });
    assert_check_clean(&path);
    let listed: Vec<(String, Vec<String>, u64)> = qemu_bitmaps(&path)
        .into_iter()
        .map(|b| (b.name, b.flags, b.granularity))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("b1".into(), flags(&[]), 64 * K),
            ("b2".into(), flags(&["auto"]), 64 * K),
            ("new".into(), flags(&[]), 128 * K)
        ]
    );
    assert_eq!(qemu_dirty_ranges(&path, "b1"), vec![]);
    assert_eq!(qemu_dirty_ranges(&path, "b2"), vec![(2 * M, 64 * K)]);
    assert_eq!(qemu_dirty_ranges(&path, "new"), vec![(2 * M, 128 * K)]);
}

#[test]
fn a_read_only_open_reads_bitmaps_and_writes_nothing() {
    let d = Dir::new();
    let path = image_with_bitmaps(&d);
    qemu_io("qcow2", &d.s("img.qcow2"), &["write 1M 4k"]);
    let before = std::fs::read(&path).unwrap();
    run(async {
        let img = open(&path, true).await;
        let names: Vec<String> = img
            .bitmaps()
            .await
            .unwrap()
            .into_iter()
            .map(|b| b.name)
            .collect();
        assert_eq!(names, ["b1", "b2", "b3"]);
        assert!(img.bitmap_data("b1").await.unwrap().get(16));
        assert!(img.add_bitmap("x", None, true).is_err());
        img.close().await.unwrap();
    });
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn removing_the_last_bitmap_drops_the_extension() {
    let d = Dir::new();
    let path = d.create("img.qcow2", "qcow2", "", None, "16M");
    run(async {
        let img = open(&path, false).await;
        img.add_bitmap("only", None, true).unwrap();
        write(&img, 0, 512).await;
        img.close().await.unwrap();
    });
    assert_eq!(qemu_dirty_ranges(&path, "only"), vec![(0, 64 * K)]);
    run(async {
        let img = open(&path, false).await;
        img.remove_bitmap("only").unwrap();
        img.close().await.unwrap();
    });
    assert_check_clean(&path);
    let info = qemu_img(&["info", "--output=json", path.to_str().unwrap()]);
    assert!(!info.contains("bitmaps"), "{info}");
}
