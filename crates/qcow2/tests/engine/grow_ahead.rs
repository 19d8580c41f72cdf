//! Growing the image file ahead of its allocations under `O_DIRECT`: the file runs ahead of
//! the data while the image is open, a clean close gives the unused space back, and an image
//! left open (as by a crash) still checks clean, reads back and takes new clusters from the
//! zeros left behind. A file system that refuses to grow the file only turns growing ahead
//! off, and a crash in the middle of it leaves an image without corruption.

use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};

use qcow2::engine::{Image, OpenOptions};
use storage::{
    Aio, AnyStorage, CrashPlan, FaultStorage, FileOpener, InjectedError, IoBuf, Locking, OpKind,
    Opener,
};
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

fn direct_opener() -> FileOpener {
    FileOpener {
        aio: Aio::IoUring,
        direct: true,
        locking: Locking::Off,
    }
}

async fn open_direct(path: &Path) -> Image<AnyStorage> {
    Image::open(&direct_opener(), path, &OpenOptions::default())
        .await
        .expect("open with O_DIRECT")
}

/// One 4 KiB write of byte `i + 1` at `i` MiB for each `i` in `range`, each allocating.
async fn write_spread<S: storage::Storage + 'static>(img: &Image<S>, range: std::ops::Range<u64>) {
    for i in range {
        let buf = IoBuf::from_slice(&[i as u8 + 1; 4096]);
        img.write(GuestOffset(i * MIB), buf, false)
            .await
            .0
            .expect("write");
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

/// An empty image of `size` with extended L2 entries (64 KiB clusters, 2 KiB subclusters).
fn ext_image(dir: &tempfile::TempDir, name: &str, size: &str) -> PathBuf {
    ext_image_with(dir, name, size, "64k")
}

/// An empty image of `size` with extended L2 entries and clusters of `cluster_size`.
fn ext_image_with(dir: &tempfile::TempDir, name: &str, size: &str, cluster_size: &str) -> PathBuf {
    let path = dir.path().join(name);
    let opts = format!("extended_l2=on,cluster_size={cluster_size}");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &opts,
        path.to_str().unwrap(),
        size,
    ]);
    path
}

/// Subclusters exist to save disk space: a 4 KiB write into a fresh 64 KiB cluster of an
/// extended-L2 image fills its subclusters and leaves the rest of the cluster a hole. The
/// file still grows ahead (so that allocating writes do not extend it), but only its length:
/// no block is reserved, and a clean close gives the length back.
#[test]
fn extended_l2_images_grow_ahead_sparsely_and_shrink_back_on_close() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = ext_image(&dir, "ext.qcow2", "256M");
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 0..32).await;
        let open_len = file_len(&path);
        assert!(
            open_len >= 64 * MIB,
            "the file's length runs a step ahead of the data: {open_len} bytes"
        );
        assert!(
            disk_use(&path) < MIB,
            "growing ahead reserved blocks: {} bytes on disk",
            disk_use(&path)
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
    // 32 clusters of 64 KiB hold 4 KiB of data each: whole clusters would take 2 MiB.
    let on_disk = disk_use(&path);
    assert!(
        on_disk < MIB,
        "each write takes its subclusters only: {on_disk} bytes on disk"
    );
}

/// The same writes through qemu-io (QEMU's own driver) into the same kind of image take no
/// less space than ours, which grew its file ahead while open.
#[test]
fn extended_l2_disk_use_after_growing_ahead_is_no_more_than_qemus() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ours = ext_image(&dir, "ours.qcow2", "256M");
    let theirs = ext_image(&dir, "theirs.qcow2", "256M");
    spread_through_ours(&ours, 64);
    let cmds = spread_commands(64);
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io("qcow2", &theirs, &cmds);
    assert_clean_and_no_larger(&ours, &theirs, 64);
}

/// [`write_spread`] of `0..n` through ours with O_DIRECT, then a clean close.
fn spread_through_ours(path: &Path, n: u64) {
    run(async {
        let img = open_direct(path).await;
        write_spread(&img, 0..n).await;
        img.close().await.expect("close");
    });
}

/// The qemu-io commands of [`write_spread`] of `0..n`.
fn spread_commands(n: u64) -> Vec<String> {
    (0..n)
        .map(|i| format!("write -q -P {} {} 4096", i + 1, i * MIB))
        .collect()
}

/// `ours`, written with `n` spread writes, checks clean, reads them back and takes no more
/// disk space than `theirs`, the same writes through QEMU.
fn assert_clean_and_no_larger(ours: &Path, theirs: &Path, n: u64) {
    assert_check_clean(ours);
    assert_reads_back(ours, 0..n);
    let (used, qemu_used) = (disk_use(ours), disk_use(theirs));
    assert!(
        used <= qemu_used,
        "{used} bytes on disk against QEMU's {qemu_used}"
    );
}

/// A new image ends inside the cluster of its L1 table; growing ahead starts past that
/// cluster, so the table's unused tail keeps no blocks, as QEMU leaves it: the same writes
/// take no more space through ours than through QEMU's driver, both with O_DIRECT.
#[test]
fn standard_cluster_disk_use_after_growing_ahead_is_no_more_than_qemus() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ours = dir.path().join("ours.qcow2");
    let theirs = dir.path().join("theirs.qcow2");
    for p in [&ours, &theirs] {
        qemu_img(&["create", "-q", "-f", "qcow2", p.to_str().unwrap(), "256M"]);
    }
    spread_through_ours(&ours, 8);
    let cmds = spread_commands(8);
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    test_support::qemu_io_direct("qcow2", &theirs, &cmds);
    assert_clean_and_no_larger(&ours, &theirs, 8);
}

/// An extended-L2 image left open (as by a crash after a flush) with its length grown ahead
/// checks clean, although the file runs past its last cluster; the next writer reopens it,
/// allocates into the sparse tail and trims what it does not use on close.
#[test]
fn an_extended_l2_image_left_open_grown_ahead_checks_clean_and_reopens() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = ext_image(&dir, "ext.qcow2", "256M");
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 0..16).await;
        img.flush().await.expect("flush");
    });
    let left = file_len(&path);
    assert!(left >= 64 * MIB, "grown ahead: {left} bytes");
    assert!(image_end(&path) < left);
    assert_check_clean(&path);
    assert_reads_back(&path, 0..16);
    run(async {
        let img = open_direct(&path).await;
        write_spread(&img, 16..48).await;
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    assert!(file_len(&path) <= left, "the tail was allocated from");
    assert_reads_back(&path, 0..48);
    assert!(disk_use(&path) < 2 * MIB, "{} bytes", disk_use(&path));
}

/// Opens the one image file the fault tests use, through a fault-injecting wrapper.
struct FaultyFile(FaultStorage<AnyStorage>);

impl Opener for FaultyFile {
    type Storage = FaultStorage<AnyStorage>;
    async fn open(&self, _: &Path, _: storage::OpenOptions) -> std::io::Result<Self::Storage> {
        Ok(self.0.clone())
    }
}

/// The image at `path` opened with `O_DIRECT` behind a fault-injecting wrapper (kept by the
/// caller to inject faults and take crash images).
async fn open_faulty(path: &Path) -> (Image<FaultStorage<AnyStorage>>, FaultStorage<AnyStorage>) {
    let opener = FileOpener {
        aio: Aio::IoUring,
        direct: true,
        locking: Locking::Off,
    };
    let file = opener
        .open(path, storage::OpenOptions::default())
        .await
        .expect("open with O_DIRECT");
    let faulty = FaultStorage::new(file).await.expect("wrap the file");
    let img = Image::open(&FaultyFile(faulty.clone()), path, &OpenOptions::default())
        .await
        .expect("open the image");
    (img, faulty)
}

#[test]
fn a_file_system_that_refuses_to_grow_ahead_still_takes_every_write() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = image(&dir);
    run(async {
        let (img, faulty) = open_faulty(&path).await;
        faulty.fail_nth(OpKind::WriteZeroes, 1, InjectedError::Enospc);
        write_spread(&img, 0..32).await;
        img.flush().await.expect("flush");
        assert_eq!(
            faulty.stats().write_zeroes,
            1,
            "after one refusal the engine stops growing ahead"
        );
        assert!(
            file_len(&path) < 64 * MIB,
            "the writes extended the file themselves: {} bytes",
            file_len(&path)
        );
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    assert!(
        file_len(&path) <= image_end(&path),
        "nothing grown ahead is left behind"
    );
    assert_reads_back(&path, 0..32);
}

#[test]
fn a_crash_while_growing_ahead_leaves_an_image_that_checks_without_corruption() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Small, so that one step of growth (bounded by the virtual size) keeps the crash
    // images small too.
    let path = dir.path().join("small.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", path.to_str().unwrap(), "16M"]);
    let crashed = dir.path().join("crashed.qcow2");
    run(async {
        let (img, faulty) = open_faulty(&path).await;
        for i in 0..12u64 {
            let buf = IoBuf::from_slice(&[i as u8 + 1; 4096]);
            img.write(GuestOffset(i * MIB), buf, false)
                .await
                .0
                .expect("write");
        }
        assert_eq!(faulty.stats().write_zeroes, 1, "the file was grown ahead");
        for seed in 0..24 {
            let crash = faulty.crash_image(&CrashPlan::Random { seed, tear: true });
            std::fs::write(&crashed, crash.to_vec()).unwrap();
            let out = std::process::Command::new("qemu-img")
                .args(["check", crashed.to_str().unwrap()])
                .output()
                .expect("run qemu-img (install qemu-utils)");
            let code = out.status.code();
            assert!(
                code == Some(0) || code == Some(3),
                "crash image {seed}: qemu-img check exited {code:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        img.close().await.expect("close");
    });
}

/// `qemu-img check` of a crash image: clean (0) or leaked clusters only (3), never corruption.
fn assert_crash_image_checks(crashed: &Path, what: &str) -> i32 {
    let out = std::process::Command::new("qemu-img")
        .args(["check", crashed.to_str().unwrap()])
        .output()
        .expect("run qemu-img (install qemu-utils)");
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 3,
        "{what}: qemu-img check exited {code}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    code
}

/// A crash at any point of an extended-L2 image's writes while its length grows ahead (every
/// prefix of the unflushed operations, and random subsets with torn writes) leaves an image
/// without corruption; once flushed, the image checks clean with the file grown ahead.
#[test]
fn a_crash_while_growing_ahead_sparsely_leaves_an_image_that_checks_without_corruption() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = ext_image(&dir, "small.qcow2", "16M");
    let crashed = dir.path().join("crashed.qcow2");
    run(async {
        let (img, faulty) = open_faulty(&path).await;
        write_spread(&img, 0..12).await;
        assert!(faulty.stats().set_lens >= 1, "the file was grown ahead");
        assert_eq!(faulty.stats().write_zeroes, 0, "without reserving blocks");
        let n = faulty.unflushed_ops();
        for k in 0..=n {
            let mask: Vec<bool> = (0..n).map(|i| i < k).collect();
            let crash = faulty.crash_image(&CrashPlan::mask(&mask));
            std::fs::write(&crashed, crash.to_vec()).unwrap();
            assert_crash_image_checks(&crashed, &format!("crash after {k} of {n} operations"));
        }
        for seed in 0..24 {
            let crash = faulty.crash_image(&CrashPlan::Random { seed, tear: true });
            std::fs::write(&crashed, crash.to_vec()).unwrap();
            assert_crash_image_checks(&crashed, &format!("crash image {seed}"));
        }
        img.flush().await.expect("flush");
        let durable = faulty.durable_image();
        assert!(durable.to_vec().len() as u64 >= 16 * MIB, "grown ahead");
        std::fs::write(&crashed, durable.to_vec()).unwrap();
        assert_eq!(
            assert_crash_image_checks(&crashed, "after a flush"),
            0,
            "a flushed image grown ahead checks clean"
        );
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    assert_eq!(file_len(&path), image_end(&path));
    assert_reads_back(&path, 0..12);
}

/// Bytes the file system holds for `path` (not its length).
fn disk_use(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn metadata_preallocation_under_o_direct_stays_sparse() {
    use qcow2::engine::{create_file, CreateOptions, Preallocation};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ours = dir.path().join("ours.qcow2");
    let theirs = dir.path().join("theirs.qcow2");
    run(async {
        let opts = CreateOptions {
            size: 2 << 30,
            preallocation: Preallocation::Metadata,
            ..CreateOptions::default()
        };
        create_file(&direct_opener(), &ours, &opts)
            .await
            .expect("create");
    });
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "preallocation=metadata",
        theirs.to_str().unwrap(),
        "2G",
    ]);
    assert_check_clean(&ours);
    assert_eq!(
        file_len(&ours),
        file_len(&theirs),
        "the file reaches the data area"
    );
    // Only the metadata takes space: growing ahead must not reserve the data clusters that
    // metadata preallocation leaves unwritten (qemu-img's image uses well under 1 MiB).
    let (used, qemu_used) = (disk_use(&ours), disk_use(&theirs));
    assert!(
        used <= qemu_used + 4 * MIB,
        "{used} bytes on disk against qemu-img's {qemu_used}"
    );
}

/// An empty image with 1 MiB clusters of 32 KiB subclusters: room for a 4 KiB write to
/// leave most of its subcluster unwritten.
fn wide_subcluster_image(dir: &tempfile::TempDir) -> PathBuf {
    ext_image_with(dir, "wide.qcow2", "64M", "1M")
}

/// A 4 KiB write into a new subcluster of a cluster already in use writes its own bytes
/// only: the rest of that subcluster was never written, so it is a hole and reads as zeros
/// already. (Writing its zeros out would cost the disk eight times the data.)
#[test]
fn a_write_into_a_new_subcluster_of_a_cluster_in_use_leaves_the_rest_a_hole() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = wide_subcluster_image(&dir);
    let grown = run(async {
        let img = open_direct(&path).await;
        let write =
            |at: u64, byte: u8| img.write(GuestOffset(at), IoBuf::from_slice(&[byte; 4096]), false);
        write(0, 1).await.0.expect("write into a fresh cluster");
        let before = disk_use(&path);
        for sc in 1..8u64 {
            write(sc * 32 * 1024, sc as u8 + 1)
                .await
                .0
                .expect("write into a new subcluster");
        }
        let grown = disk_use(&path) - before;
        img.close().await.expect("close");
        grown
    });
    // Their own bytes, and one block of the L2 table, which may first reach the file in
    // between; writing each subcluster whole would take 7 × 32 KiB.
    assert!(
        grown <= 8 * 4096,
        "seven 4 KiB writes into new subclusters took {grown} bytes of disk"
    );
    assert_check_clean(&path);
    let mut cmds = Vec::new();
    for sc in 0..8u64 {
        let at = sc * 32 * 1024;
        cmds.push(format!("read -P {} {at} 4096", sc + 1));
        cmds.push(format!("read -P 0 {} {}", at + 4096, 28 * 1024));
    }
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io("qcow2", &path, &cmds);
}

/// Where a subcluster's bytes are still in the file after it was zeroed (a zero flag, the
/// data left in place), a new write into it writes the zeros around its data: the file does
/// not read as zeros there.
#[test]
fn a_write_into_a_zeroed_subcluster_whose_old_bytes_remain_writes_its_zeros() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = wide_subcluster_image(&dir);
    run(async {
        let img = open_direct(&path).await;
        let sub = 32 * 1024;
        let old = IoBuf::from_slice(&vec![0xaa; sub as usize]);
        img.write(GuestOffset(0), old, false)
            .await
            .0
            .expect("write a whole subcluster");
        img.write_zeroes(GuestOffset(0), sub, false, false)
            .await
            .expect("zero it, keeping its cluster");
        let new = IoBuf::from_slice(&[0xbb; 4096]);
        img.write(GuestOffset(0), new, false)
            .await
            .0
            .expect("write into it again");
        img.close().await.expect("close");
    });
    assert_check_clean(&path);
    qemu_io(
        "qcow2",
        &path,
        &[
            "read -P 0xbb 0 4096",
            "read -P 0 4096 28672",
            "read -P 0 32768 1015808",
        ],
    );
}
