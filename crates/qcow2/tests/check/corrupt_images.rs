//! The corrupt-image suite: real qemu-img images broken in one precise way each (pointers past
//! the end of the file, overlapping tables, invalid subcluster bitmaps, bad compressed
//! descriptors, reserved bits, refcount errors, leaks, broken snapshot and bitmap tables,
//! header bits). For every one:
//! - opening and reading it through the engine gives a clear error, or reads, and never
//!   panics or hangs;
//! - `check` agrees with `qemu-img check` on the exit code and every count, without repair
//!   and with `-r leaks` and `-r all`, and the images both repairs leave behind check the
//!   same way.
//!
//! Backing-chain loops and a 10,000-deep chain are in `corrupt_chains.rs`.
//! Needs qemu-img and qemu-io (Debian: qemu-utils).

use crate::common::{assert_agree, Patch};
use qcow2::check::Repair;
use qcow2::engine::{Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{Aio, AnyStorage, FileOpener};
use test_support::{create_image, qemu, qemu_img, qemu_io, Dir};

const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;
const ZERO: u64 = 1;
const FAR: u64 = 1 << 40;

/// What the engine does with an image: opens and reads it, or the first error, as text.
fn engine_outcome(path: &Path) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::Threads,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        };
        let opts = OpenOptions {
            read_only: true,
            no_backing: true,
            ..OpenOptions::default()
        };
        let img: Image<AnyStorage> = Image::open(&opener, path, &opts)
            .await
            .map_err(|e| e.to_string())?;
        let size = img.size();
        img.block_status(GuestOffset(0), size)
            .await
            .map_err(|e| e.to_string())?;
        let mut pos = 0;
        while pos < size {
            let n = (size - pos).min(1 << 20);
            img.read(GuestOffset(pos), n as usize)
                .await
                .map_err(|e| e.to_string())?;
            pos += n;
        }
        Ok(())
    })
}

/// The base images the cases break.
fn bases(dir: &Dir) {
    let std = dir.path("std");
    create_image(&std, "qcow2", "cluster_size=4096", None, "1M");
    qemu_io("qcow2", &std, &["write -P 1 0 128k", "write -P 2 512k 64k"]);

    let ext = dir.path("ext");
    create_image(
        &ext,
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        None,
        "4M",
    );
    qemu_io(
        "qcow2",
        &ext,
        &["write -P 3 0 66k", "write -z 128k 4k", "write -P 4 1M 64k"],
    );

    create_image(&dir.path("plain"), "qcow2", "cluster_size=4096", None, "1M");
    qemu_io("qcow2", &dir.path("plain"), &["write -P 5 0 64k"]);
    for (name, opts) in [
        ("comp", "cluster_size=4096"),
        ("comp-ext", "cluster_size=16384,extended_l2=on"),
    ] {
        qemu_img(&[
            "convert",
            "-c",
            "-O",
            "qcow2",
            "-o",
            opts,
            &dir.s("plain"),
            &dir.s(name),
        ]);
    }

    let snap = dir.path("snap");
    create_image(&snap, "qcow2", "cluster_size=4096", None, "1M");
    qemu_io("qcow2", &snap, &["write -P 6 0 64k"]);
    qemu_img(&["snapshot", "-c", "s1", snap.to_str().unwrap()]);
    qemu_io("qcow2", &snap, &["write -P 7 0 8k"]);

    let bmp = dir.path("bmp");
    create_image(&bmp, "qcow2", "cluster_size=4096", None, "8M");
    qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        "65536",
        bmp.to_str().unwrap(),
        "b0",
    ]);
    qemu_io("qcow2", &bmp, &["write -P 8 0 1M"]);

    let lazy = dir.path("lazy");
    create_image(
        &lazy,
        "qcow2",
        "cluster_size=4096,lazy_refcounts=on",
        None,
        "1M",
    );
    // qemu-io's `abort` kills it mid-way: the dirty bit stays set and the refcounts of the
    // clusters just written never reach the disk.
    let out = qemu("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            "write -P 9 0 64k",
            "-c",
            "abort",
            lazy.to_str().unwrap(),
        ])
        .output()
        .expect("run qemu-io");
    assert!(!out.status.success(), "qemu-io abort should have aborted");
}

/// One way of breaking an image.
struct Case {
    name: &'static str,
    /// What reading it through the engine says: part of the error, or `None` if it reads.
    engine: Option<&'static str>,
    base: &'static str,
    patch: fn(&Patch, &Path),
}

/// Every corruption case, in the order the tests report them.
fn cases() -> Vec<Case> {
    [
        entry_cases(),
        refcount_cases(),
        cluster_kind_cases(),
        snapshot_bitmap_header_cases(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// L1 and L2 tables and entries: placement, overlaps, reserved bits.
fn entry_cases() -> Vec<Case> {
    vec![
        Case {
            name: "l1_entry_past_eof",
            engine: Some("past the end of the file"),
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), COPIED | FAR),
        },
        Case {
            name: "l2_table_unaligned",
            engine: Some("is not aligned to the cluster size"),
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), COPIED | (p.l2_table(0) + 0x200)),
        },
        Case {
            name: "l1_copied_without_table",
            engine: Some("COPIED flag set on an entry without an L2 table"),
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), COPIED),
        },
        Case {
            name: "l2_table_is_the_refcount_table",
            engine: Some("overlaps the refcount table"),
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), COPIED | p.reftable_offset()),
        },
        Case {
            name: "l2_table_is_the_l1_table",
            engine: Some("overlaps the L1 table"),
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), COPIED | p.l1_offset()),
        },
        Case {
            name: "l1_table_overlaps_the_refcount_table",
            engine: Some("overlaps the L1 table"),
            base: "std",
            patch: |p, _| p.put_u64(40, p.reftable_offset()),
        },
        Case {
            name: "refcount_table_overlaps_the_l1_table",
            engine: Some("overlaps the L1 table"),
            base: "std",
            patch: |p, _| p.put_u64(48, p.l1_offset()),
        },
        Case {
            name: "data_cluster_past_eof",
            engine: Some("past the end of the file"),
            base: "std",
            patch: |p, _| p.put_u64(p.l2_entry_at(0), COPIED | FAR),
        },
        Case {
            name: "data_cluster_is_the_l1_table",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.l2_entry_at(4096), COPIED | p.l1_offset()),
        },
        Case {
            name: "data_cluster_unaligned",
            engine: Some("is not aligned to the cluster size"),
            base: "std",
            patch: |p, _| {
                let at = p.l2_entry_at(0);
                p.put_u64(at, p.u64(at) + 0x200)
            },
        },
        Case {
            name: "preallocated_zero_cluster_unaligned",
            engine: Some("is not aligned to the cluster size"),
            base: "std",
            patch: |p, _| {
                let at = p.l2_entry_at(8192);
                p.put_u64(at, (p.u64(at) + 0x200) | ZERO)
            },
        },
        Case {
            name: "two_l2_entries_share_a_cluster",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.l2_entry_at(8192), p.u64(p.l2_entry_at(0))),
        },
        Case {
            name: "l1_reserved_bits",
            engine: Some("reserved bits"),
            base: "std",
            patch: |p, _| {
                let at = p.l1_entry_at(0);
                p.put_u64(at, p.u64(at) | 0x0100_0000_0000_0000)
            },
        },
        Case {
            name: "l2_reserved_bits",
            engine: Some("reserved bits"),
            base: "std",
            patch: |p, _| {
                let at = p.l2_entry_at(0);
                p.put_u64(at, p.u64(at) | 0x2)
            },
        },
        Case {
            name: "refcount_table_reserved_bits",
            engine: None,
            base: "std",
            patch: |p, _| {
                let at = p.reftable_offset();
                p.put_u64(at, p.u64(at) | 0x1)
            },
        },
    ]
}

/// Stored refcounts and refcount blocks.
fn refcount_cases() -> Vec<Case> {
    vec![
        Case {
            name: "refcount_too_low",
            engine: None,
            base: "snap",
            patch: |p, _| {
                let c = (p.u64(p.l2_entry_at(16384)) & !COPIED) >> 12;
                p.set_refcount(c, 1)
            },
        },
        Case {
            name: "refcount_zero_for_a_used_cluster",
            engine: None,
            base: "std",
            patch: |p, _| p.set_refcount((p.u64(p.l2_entry_at(0)) & !COPIED) >> 12, 0),
        },
        Case {
            name: "l2_copied_flag_missing",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.l2_entry_at(0), p.u64(p.l2_entry_at(0)) & !COPIED),
        },
        Case {
            name: "l1_copied_flag_missing",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.l1_entry_at(0), p.u64(p.l1_entry_at(0)) & !COPIED),
        },
        Case {
            name: "refcount_too_high",
            engine: None,
            base: "std",
            patch: |p, _| p.set_refcount((p.u64(p.l2_entry_at(0)) & !COPIED) >> 12, 3),
        },
        Case {
            name: "leaked_cluster_at_the_end",
            engine: None,
            base: "std",
            patch: |p, path| {
                let len = std::fs::metadata(path).unwrap().len();
                let cs = p.cluster_size();
                let end = len.div_ceil(cs) * cs;
                p.put(end + cs - 1, &[0]);
                p.set_refcount(end / cs, 1)
            },
        },
        Case {
            name: "refcount_block_unaligned",
            engine: None,
            base: "std",
            patch: |p, _| {
                let at = p.reftable_offset();
                p.put_u64(at, p.u64(at) + 0x200)
            },
        },
        Case {
            name: "refcount_block_past_eof",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.reftable_offset() + 8, 64 << 20),
        },
        Case {
            name: "refcount_block_is_an_l2_table",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(p.reftable_offset() + 8, p.l2_table(0)),
        },
    ]
}

/// Subcluster bitmaps and compressed clusters.
fn cluster_kind_cases() -> Vec<Case> {
    vec![
        Case {
            name: "subcluster_allocated_and_zero",
            engine: Some("a subcluster is marked both allocated and zero"),
            base: "ext",
            patch: |p, _| {
                let at = p.l2_entry_at(0) + 8;
                p.put_u64(at, p.u64(at) | (1 << 32) | 1)
            },
        },
        Case {
            name: "unallocated_cluster_with_allocated_subclusters",
            engine: Some("allocated subclusters but no host cluster offset"),
            base: "ext",
            patch: |p, _| p.put_u64(p.l2_entry_at(3 << 20) + 8, 0b1011),
        },
        Case {
            name: "compressed_cluster_with_subcluster_bitmap",
            engine: Some("compressed clusters have no subclusters"),
            base: "comp-ext",
            patch: |p, _| p.put_u64(p.l2_entry_at(0) + 8, 1),
        },
        Case {
            name: "compressed_cluster_past_eof",
            engine: Some("past the end of the file"),
            base: "comp",
            patch: |p, _| {
                let at = p.l2_entry_at(0);
                p.put_u64(at, (p.u64(at) & !0xff_ffff_ffff) | FAR)
            },
        },
        Case {
            name: "compressed_cluster_with_copied_flag",
            engine: Some("COPIED flag set on a compressed cluster"),
            base: "comp",
            patch: |p, _| {
                let at = p.l2_entry_at(4096);
                p.put_u64(at, p.u64(at) | COPIED)
            },
        },
        Case {
            name: "compressed_cluster_is_garbage",
            engine: Some("Zlib data is corrupt"),
            base: "comp",
            patch: |p, _| p.put_u64(p.l2_entry_at(0), COMPRESSED | p.reftable_offset()),
        },
        Case {
            name: "compressed_sectors_past_eof",
            engine: None,
            base: "comp",
            patch: |p, path| {
                let len = std::fs::metadata(path).unwrap().len();
                // 4 KiB clusters: the sector count is bits 58-61, the offset bits 0-57.
                let at = p.l2_entry_at(0);
                p.put_u64(at, COMPRESSED | (7 << 58) | (len - 512))
            },
        },
    ]
}

/// Snapshots, bitmaps, the header and the file as a whole.
fn snapshot_bitmap_header_cases() -> Vec<Case> {
    vec![
        Case {
            name: "snapshot_l1_table_unaligned",
            // QEMU opens it and judges the table only when the snapshot is used (iotest
            // 080): the engine opens it too.
            engine: None,
            base: "snap",
            patch: |p, _| {
                let at = p.snapshots_offset();
                p.put_u64(at, p.u64(at) + 0x200)
            },
        },
        Case {
            name: "snapshot_l1_table_past_eof",
            engine: None,
            base: "snap",
            patch: |p, _| p.put_u64(p.snapshots_offset(), FAR),
        },
        Case {
            name: "snapshot_entry_incomplete",
            engine: None,
            base: "snap",
            patch: |p, _| {
                // Keep 8 of the 24 bytes of extra data: the entry lacks the disk size that
                // version 3 requires. The ID and name move up behind it.
                let at = p.snapshots_offset();
                let ids = u64::from(p.u16(at + 12)) + u64::from(p.u16(at + 14));
                let tail = p.bytes(at + 40 + 24, ids as usize);
                p.put_u32(at + 36, 8);
                p.put(at + 40 + 8, &tail);
            },
        },
        Case {
            name: "snapshot_extra_data_too_large",
            engine: Some("extra_data_size = 4096 exceeds the limit 1024"),
            base: "snap",
            patch: |p, _| p.put_u32(p.snapshots_offset() + 36, 4096),
        },
        Case {
            name: "snapshot_table_unaligned",
            engine: Some("snapshots_offset 0x16008 is not aligned"),
            base: "snap",
            patch: |p, _| p.put_u64(64, p.snapshots_offset() + 8),
        },
        Case {
            name: "bitmap_table_reserved_bits",
            engine: None,
            base: "bmp",
            patch: |p, _| {
                let table = bitmap_table(p);
                p.put_u64(table, p.u64(table) | 0x2)
            },
        },
        Case {
            name: "bitmap_data_cluster_unaligned",
            engine: None,
            base: "bmp",
            patch: |p, _| {
                let table = bitmap_table(p);
                p.put_u64(table, p.u64(table) + 0x200)
            },
        },
        Case {
            name: "header_marked_corrupt",
            engine: None,
            base: "std",
            patch: |p, _| p.put_u64(72, p.u64(72) | 2),
        },
        Case {
            name: "dirty_with_stale_refcounts",
            engine: None,
            base: "lazy",
            patch: |_, _| {},
        },
        Case {
            name: "file_truncated",
            engine: Some("past the end of the file"),
            base: "std",
            patch: |_, path| {
                let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
                f.set_len(std::fs::metadata(path).unwrap().len() / 2)
                    .unwrap();
            },
        },
        Case {
            name: "l1_table_too_small",
            engine: Some("the L1 table is too small"),
            base: "std",
            patch: |p, _| p.put_u32(36, 0),
        },
        Case {
            name: "not_qcow2",
            engine: Some("not qcow2"),
            base: "std",
            patch: |p, _| p.put_u32(0, 0),
        },
    ]
}

/// The first bitmap's table, from the bitmaps header extension and its directory.
fn bitmap_table(p: &Patch) -> u64 {
    let mut at = u64::from(p.u32(100));
    loop {
        let (magic, len) = (p.u32(at), u64::from(p.u32(at + 4)));
        assert_ne!(magic, 0, "no bitmaps extension");
        if magic == 0x2385_2875 {
            let dir = p.u64(at + 8 + 16);
            return p.u64(dir);
        }
        at += 8 + len.div_ceil(8) * 8;
    }
}

/// Opens the image read-write through the engine (which repairs a dirty image) and closes
/// it; the error text if it refuses.
fn engine_rw_outcome(path: &Path) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::Threads,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        };
        let opts = OpenOptions {
            no_backing: true,
            ..OpenOptions::default()
        };
        let img: Image<AnyStorage> = Image::open(&opener, path, &opts)
            .await
            .map_err(|e| e.to_string())?;
        img.close().await.map_err(|e| e.to_string())
    })
}

#[test]
fn corrupt_images_engine_and_check_agree_with_qemu() {
    let dir = Dir::new();
    bases(&dir);
    let verbose = std::env::var_os("CORRUPT_VERBOSE").is_some();
    let cases = cases();
    assert!(cases.len() >= 40);
    for case in cases {
        std::fs::copy(dir.path(case.base), dir.path(case.name)).unwrap();
        let path = dir.path(case.name);
        (case.patch)(&Patch::open(&path), &path);

        let engine = engine_outcome(&path);
        if verbose {
            eprintln!("{}: engine {engine:?}", case.name);
        }
        match (case.engine, &engine) {
            (None, Ok(())) => {}
            (Some(want), Err(got)) if got.contains(want) => {}
            _ => panic!(
                "{}: the engine should say {:?}, said {engine:?}",
                case.name, case.engine
            ),
        }
        // A read-write open must refuse cleanly or succeed (repairing a dirty image); it
        // must never panic. A copy keeps the original for the checks below.
        let rw = dir.copy(case.name, &format!("{}.rw", case.name));
        let opened = engine_rw_outcome(&rw);
        if verbose {
            eprintln!("{}: read-write open {opened:?}", case.name);
        }
        if case.name == "header_marked_corrupt" {
            let e = opened.expect_err("a corrupt image must not open read-write");
            assert!(e.contains("marked corrupt"), "{e}");
        }

        for repair in [Repair::None, Repair::Leaks, Repair::All] {
            let q = assert_agree(&dir, case.name, repair);
            if verbose {
                eprintln!(
                    "{} -r {repair:?}: qemu exit {} {:?}",
                    case.name, q.code, q.report
                );
            }
        }
    }
}
