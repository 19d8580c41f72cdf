//! Growing the image file ahead of its allocations under `O_DIRECT`: the file runs ahead of
//! the data while the image is open, a clean close gives the unused space back, and an image
//! left open (as by a crash) still checks clean, reads back and takes new clusters from the
//! zeros left behind.

use std::path::{Path, PathBuf};

use qcow2::engine::{Image, OpenOptions};
use storage::{Aio, AnyStorage, FileOpener, IoBuf, Locking};
use test_support::{assert_check_clean, qemu_img, qemu_io, run};

const MIB: u64 = 1 << 20;

/// An empty 256 MiB image on a real disk (`O_DIRECT` does not work on tmpfs).
fn image(dir: &tempfile::TempDir) -> PathBuf {
    let path = dir.path().join("a.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        path.to_str().unwrap(),
        "256M",
    ]);
    path
}

async fn open_direct(path: &Path) -> Image<AnyStorage> {
    let opener = FileOpener {
        aio: Aio::IoUring,
        direct: true,
        locking: Locking::Off,
    };
    Image::open(&opener, path, &OpenOptions::default())
        .await
        .expect("open with O_DIRECT")
}

/// One 4 KiB write of byte `i + 1` at `i` MiB for each `i` in `range`, each allocating.
async fn write_spread(img: &Image<AnyStorage>, range: std::ops::Range<u64>) {
    for i in range {
        let buf = IoBuf::from_slice(&[i as u8 + 1; 4096]);
        img.write(i * MIB, buf, false).await.0.expect("write");
    }
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

fn image_end(path: &Path) -> u64 {
    let json = qemu_img(&["check", "--output=json", path.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    v["image-end-offset"].as_u64().expect("image-end-offset")
}

fn assert_reads_back(path: &Path, range: std::ops::Range<u64>) {
    let cmds: Vec<String> = range
        .map(|i| format!("read -P {} {} 4096", i + 1, i * MIB))
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io("qcow2", path, &cmds);
}

#[test]
fn the_file_grows_ahead_while_open_and_shrinks_back_on_close() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = image(&dir);
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 0..32).await;
        let open_len = file_len(&path);
        assert!(
            open_len >= 64 * MIB,
            "the file is grown a step ahead of the data: {open_len} bytes"
        );
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    assert_eq!(
        file_len(&path),
        image_end(&path),
        "a clean close leaves the file ending with its last cluster"
    );
    assert_reads_back(&path, 0..32);
}

#[test]
fn an_image_left_open_with_its_file_grown_ahead_checks_clean_and_reopens() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = image(&dir);
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 0..16).await;
        img.flush().await.expect("flush");
        // Dropped without close, as a crash after the flush leaves it.
    });
    let left = file_len(&path);
    assert!(left >= 64 * MIB);
    assert_check_clean(&path);
    assert_reads_back(&path, 0..16);
    // The next writer allocates into the zeros left behind instead of growing the file
    // further (they stay part of the file: nothing tells them apart from data any more).
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 16..48).await;
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    assert_eq!(file_len(&path), left);
    assert!(image_end(&path) < left);
    assert_reads_back(&path, 0..48);
}
