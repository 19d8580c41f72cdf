//! Write side against QEMU: images we create and write pass `qemu-img check` and read back
//! in QEMU exactly as our model says.

use crate::support::{opener, FaultFs};
use qcow2::engine::{create_file, CreateOptions, Format, Image, OpenOptions, Preallocation};
use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use storage::{Aio, FaultStorage, IoBuf, MemStorage};
use test_support::{
    assert_check_clean, assert_same_bytes, qemu_contents, qemu_img, qemu_io, run, Dir, Rng,
};

/// Runs `ops` random operations on `path` (opened read-write) and on `model`, checking reads
/// against the model along the way.
async fn exercise(path: &Path, model: &mut [u8], seed: u64, ops: usize, unit: u64) {
    let img = Image::open(&opener(Aio::IoUring), path, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = model.len() as u64;
    let mut rng = Rng(seed);
    for step in 0..ops {
        // Offsets and lengths around unit (subcluster/cluster) edges.
        let edge = rng.below(size / unit) * unit;
        let offset = match rng.below(4) {
            0 => edge,
            1 => edge + rng.below(unit),
            2 => edge.saturating_sub(rng.below(1024) + 1),
            _ => rng.below(size),
        }
        .min(size - 1);
        let max_len = (size - offset).min(unit * 3);
        let len = (rng.below(max_len) + 1).min(size - offset);
        let what = rng.below(10);
        let ctx = format!("step {step} seed {seed}: op {what} at {offset:#x}+{len:#x}");
        if std::env::var_os("TRACE_OPS").is_some() {
            eprintln!("{ctx}");
        }
        match what {
            0..=5 => {
                let byte = (rng.next_u64() % 255 + 1) as u8;
                let mut buf = IoBuf::zeroed(len as usize);
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = byte.wrapping_add((i / 512) as u8);
                }
                model[offset as usize..(offset + len) as usize].copy_from_slice(&buf);
                let (res, _) = img.write(GuestOffset(offset), buf, rng.below(8) == 0).await;
                res.unwrap_or_else(|e| panic!("{ctx}: write: {e}"));
            }
            6 | 7 => {
                let unmap = rng.below(2) == 0;
                img.write_zeroes(GuestOffset(offset), len, unmap, false)
                    .await
                    .unwrap_or_else(|e| panic!("{ctx}: zero: {e}"));
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            8 => {
                // Discarded bytes may read as before or as zeros: learn which from us, and
                // check that it is one of the two.
                img.discard(GuestOffset(offset), len)
                    .await
                    .unwrap_or_else(|e| panic!("{ctx}: discard: {e}"));
                let now = img.read(GuestOffset(offset), len as usize).await.unwrap();
                for (i, (&m, &n)) in model[offset as usize..(offset + len) as usize]
                    .iter()
                    .zip(now.iter())
                    .enumerate()
                {
                    assert!(
                        n == m || n == 0,
                        "{ctx}: byte {i} reads {n:#x} after discard, was {m:#x}"
                    );
                }
                model[offset as usize..(offset + len) as usize].copy_from_slice(&now);
            }
            _ => img
                .flush()
                .await
                .unwrap_or_else(|e| panic!("{ctx}: flush: {e}")),
        }
        if step % 16 == 0 {
            let all = img.read(GuestOffset(0), size as usize).await.unwrap();
            assert_same_bytes(&all, model, &ctx);
        }
    }
    let all = img.read(GuestOffset(0), size as usize).await.unwrap();
    assert_same_bytes(&all, model, "end of run");
    img.close().await.unwrap();
}

#[test]
fn random_ops_without_backing_match_model_and_pass_qemu_check() {
    let d = Dir::new();
    for (i, (cs, ext, v)) in [
        (65536u64, false, 3u32),
        (65536, true, 3),
        (512, false, 3),
        (16384, true, 3),
        (65536, false, 2),
        (2 << 20, true, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let path = d.path(&format!("w{i}.qcow2"));
        let size = (cs * 24).max(4 << 20);
        let opts = CreateOptions {
            size,
            cluster_size: cs,
            extended_l2: ext,
            version: v,
            ..CreateOptions::default()
        };
        run(async {
            create_file(&opener(Aio::Threads), &path, &opts)
                .await
                .unwrap()
        });
        assert_check_clean(&path);
        let mut model = vec![0u8; size as usize];
        let unit = if ext { cs / 32 } else { cs };
        run(exercise(
            &path,
            &mut model,
            0x9e37_79b9 + i as u64,
            300,
            unit,
        ));
        assert_check_clean(&path);
        assert_same_bytes(
            &qemu_contents(&path, &[]),
            &model,
            &format!("QEMU reading {}", path.display()),
        );
    }
}

#[test]
fn random_ops_over_backing_file() {
    let d = Dir::new();
    let size = 4u64 << 20;
    let base = d.path("base.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        base.to_str().unwrap(),
        &size.to_string(),
    ]);
    qemu_io(
        "qcow2",
        &base,
        &["write -P 0x61 0 3M", "write -P 0x62 3584k 512k"],
    );
    let base_bytes = qemu_contents(&base, &[]);
    for (i, (cs, ext)) in [
        (65536u64, false),
        (65536, true),
        (32768, true),
        (4096, false),
    ]
    .into_iter()
    .enumerate()
    {
        let path = d.path(&format!("top{i}.qcow2"));
        let opts = CreateOptions {
            size,
            cluster_size: cs,
            extended_l2: ext,
            backing: Some(("base.qcow2".into(), Format::Qcow2)),
            ..CreateOptions::default()
        };
        run(async {
            create_file(&opener(Aio::Threads), &path, &opts)
                .await
                .unwrap()
        });
        let mut model = base_bytes.clone();
        let unit = if ext { cs / 32 } else { cs };
        run(exercise(&path, &mut model, 77 + i as u64, 300, unit));
        assert_check_clean(&path);
        assert_same_bytes(
            &qemu_contents(&path, &[]),
            &model,
            &format!("QEMU reading {}", path.display()),
        );
    }
}

#[test]
fn preallocation_modes_pass_qemu_check() {
    let d = Dir::new();
    for mode in [
        Preallocation::Metadata,
        Preallocation::Falloc,
        Preallocation::Full,
    ] {
        for ext in [false, true] {
            let path = d.path(&format!("p-{mode:?}-{ext}.qcow2"));
            let opts = CreateOptions {
                size: 3 << 20,
                extended_l2: ext,
                preallocation: mode,
                ..CreateOptions::default()
            };
            run(async {
                create_file(&opener(Aio::Threads), &path, &opts)
                    .await
                    .unwrap()
            });
            assert_check_clean(&path);
            assert_same_bytes(
                &qemu_contents(&path, &[]),
                &vec![0u8; 3 << 20],
                &format!("{mode:?} ext={ext}"),
            );
            let mut model = vec![0u8; 3 << 20];
            run(exercise(
                &path,
                &mut model,
                5,
                60,
                if ext { 2048 } else { 65536 },
            ));
            assert_check_clean(&path);
        }
    }
}

#[test]
fn writes_into_images_with_internal_snapshots_copy_shared_clusters() {
    let d = Dir::new();
    for ext in ["off", "on"] {
        let path = d.path(&format!("snap-{ext}.qcow2"));
        let p = path.to_str().unwrap();
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("extended_l2={ext}"),
            p,
            "4M",
        ]);
        qemu_io("qcow2", &path, &["write -P 0x31 0 3M", "write -z 3M 256k"]);
        qemu_img(&["snapshot", "-c", "one", p]);
        qemu_io("qcow2", &path, &["write -P 0x32 1M 1M"]);
        qemu_img(&["snapshot", "-c", "two", p]);
        let one = qemu_contents(&path, &["-l", "one"]);
        let two = qemu_contents(&path, &["-l", "two"]);
        let mut model = qemu_contents(&path, &[]);
        run(exercise(
            &path,
            &mut model,
            99,
            200,
            if ext == "on" { 2048 } else { 65536 },
        ));
        assert_check_clean(&path);
        assert_same_bytes(
            &qemu_contents(&path, &[]),
            &model,
            "active layer after our writes",
        );
        assert_same_bytes(
            &qemu_contents(&path, &["-l", "one"]),
            &one,
            "snapshot one is untouched",
        );
        assert_same_bytes(
            &qemu_contents(&path, &["-l", "two"]),
            &two,
            "snapshot two is untouched",
        );
    }
}

/// A qcow2 image `name` of `size` bytes with `cluster`-byte clusters over the raw
/// `base.raw` in `d`, both loaded into memory behind fault storages.
fn overlay_in_memory(d: &Dir, name: &str, cluster: u64, size: u64) -> (FaultFs, PathBuf) {
    let path = d.path(name);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        "-o",
        &format!("cluster_size={cluster}"),
        path.to_str().unwrap(),
        &size.to_string(),
    ]);
    let fs = FaultFs::default();
    for p in [path.clone(), d.path("base.raw")] {
        let bytes = std::fs::read(&p).unwrap();
        let st = FaultStorage::from_mem(MemStorage::from_bytes(&bytes));
        fs.0.borrow_mut().insert(p, st);
    }
    (fs, path)
}

/// A small write into a fresh cluster over a backing file copies the cluster's head and tail:
/// as one backing read when only the write lies between them (the gap is read and then
/// overwritten), as two when the write is large. Either way the result is the backing bytes
/// with the write on top, in QEMU's eyes too.
#[test]
fn copy_on_write_reads_head_and_tail_in_one_request_around_small_writes() {
    const SIZE: usize = 8 << 20;
    let d = Dir::new();
    let base: Vec<u8> = (0..SIZE)
        .map(|i| (i / 512 % 253) as u8 ^ (i % 7) as u8)
        .collect();
    std::fs::write(d.path("base.raw"), &base).unwrap();
    // (cluster size, write offset within the cluster, write length, backing reads expected)
    let cases = [
        (65536u64, 12288u64, 4096usize, 1u64),
        (65536, 0, 4096, 1),
        (65536, 61440, 4096, 1),
        (2 << 20, 1 << 20, 4096, 1),
        (2 << 20, 512 << 10, 128 << 10, 2),
    ];
    for (i, &(cluster, within, len, reads)) in cases.iter().enumerate() {
        let (fs, path) = overlay_in_memory(&d, &format!("cow{i}.qcow2"), cluster, SIZE as u64);
        let backing_reads = || fs.0.borrow()[&d.path("base.raw")].stats().reads;
        let offset = cluster + within;
        let data = IoBuf::from_slice(&vec![0xA5u8; len]);
        let got = run(async {
            let img = Image::open(&fs, &path, &OpenOptions::default())
                .await
                .unwrap();
            let before = backing_reads();
            let (res, _) = img.write(GuestOffset(offset), data, false).await;
            res.unwrap();
            let during = backing_reads() - before;
            img.close().await.unwrap();
            during
        });
        let what = format!("{cluster}-byte clusters, {len} bytes at +{within}");
        assert_eq!(got, reads, "{what}: backing reads");
        let image = fs.0.borrow()[&path].inner().to_vec();
        std::fs::write(&path, image).unwrap();
        assert_check_clean(&path);
        let mut expected = base.clone();
        expected[offset as usize..offset as usize + len].fill(0xA5);
        assert_same_bytes(&qemu_contents(&path, &[]), &expected, &what);
    }
}

/// Copy-on-write spans are built in reused buffers, which hold an earlier span's bytes:
/// spans of different sizes and places, one after another, still put exactly the backing
/// bytes and the written bytes on disk.
#[test]
fn reused_span_buffers_leave_no_old_bytes_behind() {
    const CLUSTER: u64 = 65536;
    let d = Dir::new();
    // Six clusters of backing data, a different byte in every 4 KiB; the image is larger.
    let base: Vec<u8> = (0..6 * CLUSTER as usize)
        .map(|i| (i / 4096 % 251 + 1) as u8)
        .collect();
    std::fs::write(d.path("base.raw"), &base).unwrap();
    let (fs, path) = overlay_in_memory(&d, "over.qcow2", CLUSTER, 1 << 20);
    // (offset, length): a two-cluster span, then smaller ones in the same buffer, one
    // straddling the end of the backing file.
    let writes = [
        (CLUSTER - 4096, 8192usize),
        (3 * CLUSTER + 8192, 4096),
        (5 * CLUSTER - 512, 1024),
        (6 * CLUSTER - 1024, 2048),
        (2 * CLUSTER + 100, 300),
    ];
    run(async {
        let img = Image::open(&fs, &path, &OpenOptions::default())
            .await
            .unwrap();
        for (i, (offset, len)) in writes.into_iter().enumerate() {
            let data = IoBuf::from_slice(&vec![0xC0 + i as u8; len]);
            let (res, _) = img.write(GuestOffset(offset), data, false).await;
            res.unwrap();
        }
        img.close().await.unwrap();
    });
    let image = fs.0.borrow()[&path].inner().to_vec();
    std::fs::write(&path, image).unwrap();
    assert_check_clean(&path);
    let mut expected = vec![0u8; 1 << 20];
    expected[..base.len()].copy_from_slice(&base);
    for (i, (offset, len)) in writes.into_iter().enumerate() {
        expected[offset as usize..offset as usize + len].fill(0xC0 + i as u8);
    }
    assert_same_bytes(
        &qemu_contents(&path, &[]),
        &expected,
        "spans in reused buffers",
    );
}

/// An allocating write plans its clusters once: when nothing changed where clusters live
/// while it waited for its exclusive lock, it executes the plan it made under the shared one.
#[test]
fn an_allocating_write_plans_its_clusters_once() {
    let d = Dir::new();
    let path = d.path("plan-once.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", path.to_str().unwrap(), "4M"]);
    run(async {
        let img = Image::open(&opener(Aio::Threads), &path, &OpenOptions::default())
            .await
            .unwrap();
        let cs = img.facts().cluster_size as usize;
        let filled = |byte: u8| {
            let mut buf = IoBuf::zeroed(cs);
            buf.fill(byte);
            buf
        };
        // The first write creates the L2 table; the second only allocates a cluster in it.
        img.write(GuestOffset(0), filled(1), false).await.0.unwrap();
        let before = img.l2_cache_stats();
        img.write(GuestOffset(cs as u64), filled(2), false)
            .await
            .0
            .unwrap();
        let after = img.l2_cache_stats();
        let lookups = (after.hits + after.misses) - (before.hits + before.misses);
        assert_eq!(
            lookups, 2,
            "one L2 lookup to plan the write and one to point the entry at the new cluster"
        );
        img.close().await.unwrap();
    });
    assert_check_clean(&path);
    // qemu-img's default cluster size: 64 KiB.
    let data = qemu_contents(&path, &[]);
    assert!(data[..65536].iter().all(|&b| b == 1));
    assert!(data[65536..131072].iter().all(|&b| b == 2));
}

/// A guest write through an L2 entry that points at metadata is refused, and marks the image
/// corrupt, instead of overwriting the metadata (QEMU's overlap check).
#[test]
fn a_data_write_over_metadata_marks_the_image_corrupt() {
    let d = Dir::new();
    let path = d.path("overlap.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", path.to_str().unwrap(), "4M"]);
    qemu_io("qcow2", &path, &["write -P 1 0 64k"]);
    let be64 = |b: &[u8], at: u64| {
        let at = at as usize;
        u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
    };
    // Guest cluster 0 now lives where the L1 table is, writable in place (COPIED).
    let mut image = std::fs::read(&path).unwrap();
    let l1 = be64(&image, 40);
    let l1_entry = be64(&image, l1);
    let l2 = (l1_entry & 0x00ff_ffff_ffff_fe00) as usize;
    image[l2..l2 + 8].copy_from_slice(&((1u64 << 63) | l1).to_be_bytes());
    std::fs::write(&path, &image).unwrap();

    let err = run(async {
        let img = Image::open(&opener(Aio::Threads), &path, &OpenOptions::default())
            .await
            .unwrap();
        let mut buf = IoBuf::zeroed(512);
        buf.fill(7);
        let (res, _) = img.write(GuestOffset(0), buf, false).await;
        res.expect_err("a write over the L1 table").to_string()
    });
    assert!(
        err.contains(&format!("would overwrite the L1 table at {l1:#x}")),
        "{err}"
    );
    let image = std::fs::read(&path).unwrap();
    assert_eq!(be64(&image, l1), l1_entry, "the L1 table is intact");
    assert_ne!(be64(&image, 72) & 2, 0, "the corrupt bit is set");
}
