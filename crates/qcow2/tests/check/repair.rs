//! Repairs: after `check -r all`, `qemu-img check` finds the image clean and the guest sees
//! exactly the data it saw before; QEMU's own repair of the same image agrees; dirty
//! lazy-refcount images are repaired when the engine opens them for writing; and a repair
//! interrupted by a crash at any point leaves an image whose guest data is intact and which a
//! second repair makes clean.
//!
//! Needs qemu-img and qemu-io (Debian: qemu-utils).

use crate::common::{assert_agree, our_check, qemu_check, Patch};
use qcow2::check::{self, Repair};
use qcow2::engine::{Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use storage::{
    Aio, AnyStorage, CrashPlan, FaultStorage, FileOpener, InjectedError, MemFs, MemStorage,
};
use test_support::{create_image, qemu, qemu_contents, qemu_img, qemu_io, run_ok, Dir};

const COPIED: u64 = 1 << 63;
const INCOMPAT_DIRTY: u64 = 1;
const INCOMPAT_CORRUPT: u64 = 2;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, f)
}

/// Images whose refcounts the faults below break.
fn bases(dir: &Dir) -> Vec<&'static str> {
    let specs: [(&str, &str, &str); 6] = [
        ("std", "cluster_size=4096", "4M"),
        ("ext", "cluster_size=65536,extended_l2=on", "8M"),
        ("rc1", "cluster_size=512,refcount_bits=1", "1M"),
        ("rc64", "cluster_size=512,refcount_bits=64", "8M"),
        ("v2", "compat=0.10,cluster_size=4096", "4M"),
        ("snap", "cluster_size=4096", "4M"),
    ];
    for (name, opts, size) in specs {
        let p = dir.path(name);
        create_image(&p, "qcow2", opts, None, size);
        qemu_io(
            "qcow2",
            &p,
            &[
                "write -P 1 0 200k",
                "write -P 2 300k 3k",
                "write -z 400k 64k",
            ],
        );
    }
    let snap = dir.path("snap");
    qemu_img(&["snapshot", "-c", "s", snap.to_str().unwrap()]);
    qemu_io("qcow2", &snap, &["write -P 3 0 16k"]);
    specs.iter().map(|s| s.0).collect()
}

/// The host cluster of guest offset `guest` (a normal, allocated cluster).
fn host_cluster(p: &Patch, guest: u64) -> u64 {
    (p.u64(p.l2_entry_at(guest)) & 0x00ff_ffff_ffff_fe00) >> p.cluster_bits()
}

/// A named way to damage an image.
type Fault = (&'static str, fn(&Patch, &Path));

/// Refcount-level faults: none changes what the guest reads.
fn faults() -> Vec<Fault> {
    vec![
        ("refcount_too_high", |p, path| {
            let c = host_cluster(p, 0);
            if p.refcount_order() > 0 {
                p.set_refcount(c, p.refcount(c) + 1);
            } else {
                // One-bit refcounts cannot be too high: leak a free cluster instead.
                let end = std::fs::metadata(path).unwrap().len() / p.cluster_size();
                p.set_refcount(end - 1, 1);
            }
        }),
        ("used_cluster_refcount_zero", |p, _| {
            p.set_refcount(host_cluster(p, 4096), 0)
        }),
        ("l2_copied_flag_wrong", |p, _| {
            let at = p.l2_entry_at(8192);
            p.put_u64(at, p.u64(at) ^ COPIED)
        }),
        ("l1_copied_flag_wrong", |p, _| {
            let at = p.l1_entry_at(0);
            p.put_u64(at, p.u64(at) ^ COPIED)
        }),
        ("refcount_table_entry_lost", |p, _| {
            p.put_u64(p.reftable_offset(), 0)
        }),
        ("marked_corrupt", |p, _| {
            if p.u32(4) >= 3 {
                p.put_u64(72, p.u64(72) | INCOMPAT_CORRUPT)
            }
        }),
    ]
}

fn incompatible(path: &Path) -> u64 {
    let p = Patch::open(path);
    if p.u32(4) >= 3 {
        p.u64(72)
    } else {
        0
    }
}

#[test]
fn repair_all_leaves_qemu_clean_and_guest_data_unchanged() {
    let dir = Dir::new();
    let mut repaired = 0;
    for base in bases(&dir) {
        let before = qemu_contents(&dir.path(base), &[]);
        for (fault, patch) in faults() {
            let name = format!("{base}-{fault}");
            let path = dir.copy(base, &name);
            patch(&Patch::open(&path), &path);
            // QEMU and we agree on the finding and on the repair.
            assert_agree(&dir, &name, Repair::None);
            assert_agree(&dir, &name, Repair::All);

            let (r, findings) = our_check(&path, Repair::All);
            let outcome = r.unwrap_or_else(|e| panic!("{name}: repair failed: {e}"));
            assert_eq!(outcome.report.exit_code(), 0, "{name}: {findings:?}");
            let q = qemu_check(&path, Repair::None, true);
            assert_eq!(
                q.code, 0,
                "{name}: after our repair qemu-img says {}{}",
                q.stdout, q.stderr
            );
            assert_eq!(
                incompatible(&path) & (INCOMPAT_DIRTY | INCOMPAT_CORRUPT),
                0,
                "{name}"
            );
            assert!(
                qemu_contents(&path, &[]) == before,
                "{name}: the repair changed guest data"
            );
            repaired += 1;
        }
    }
    assert_eq!(repaired, 36);
}

#[test]
fn repair_keeps_the_corrupt_bit_while_corruption_remains() {
    let dir = Dir::new();
    let p = dir.path("img");
    create_image(&p, "qcow2", "cluster_size=4096", None, "1M");
    qemu_io("qcow2", &p, &["write -P 1 0 64k"]);
    let patch = Patch::open(&p);
    // A data cluster offset that is not cluster-aligned cannot be repaired.
    let at = patch.l2_entry_at(0);
    patch.put_u64(at, patch.u64(at) + 0x200);
    patch.put_u64(72, patch.u64(72) | INCOMPAT_CORRUPT);
    let (r, _) = our_check(&p, Repair::All);
    assert_eq!(r.unwrap().report.exit_code(), 2);
    assert_ne!(incompatible(&p) & INCOMPAT_CORRUPT, 0);
}

/// An image left dirty by a crash: qemu-io's `abort` kills it after the writes, before any
/// refcount reached the disk.
fn dirty_image(dir: &Dir, name: &str) -> PathBuf {
    let p = dir.path(name);
    create_image(
        &p,
        "qcow2",
        "cluster_size=4096,lazy_refcounts=on",
        None,
        "4M",
    );
    qemu_io("qcow2", &p, &["write -P 1 0 1M"]);
    let out = qemu("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            "write -P 2 512k 1M",
            "-c",
            "write -P 3 3M 64k",
            "-c",
            "abort",
            p.to_str().unwrap(),
        ])
        .output()
        .expect("run qemu-io");
    assert!(!out.status.success(), "qemu-io abort should have aborted");
    assert_ne!(
        incompatible(&p) & INCOMPAT_DIRTY,
        0,
        "the image should be dirty"
    );
    let q = qemu_check(&p, Repair::None, true);
    assert_eq!(
        q.code, 2,
        "the dirty image should have refcount errors: {}",
        q.stderr
    );
    p
}

#[test]
fn opening_a_dirty_image_for_writing_repairs_it() {
    let dir = Dir::new();
    let p = dirty_image(&dir, "dirty");
    let before = qemu_contents(&p, &[]);
    block_on(async {
        let opener = FileOpener {
            aio: Aio::Threads,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        };
        let img: Image<AnyStorage> = Image::open(&opener, &p, &OpenOptions::default())
            .await
            .expect("a dirty image opens read-write after repair");
        let got = img.read(GuestOffset(0), img.size() as usize).await.unwrap();
        assert!(got[..] == before[..], "the repair changed guest data");
        // The repaired image takes writes, and stays consistent.
        let (r, _) = img
            .write(
                GuestOffset(2 << 20),
                storage::IoBuf::from_slice(&[7u8; 65536]),
                false,
            )
            .await;
        r.unwrap();
        img.close().await.unwrap();
    });
    assert_eq!(incompatible(&p) & INCOMPAT_DIRTY, 0);
    let q = qemu_check(&p, Repair::None, true);
    assert_eq!(q.code, 0, "{}{}", q.stdout, q.stderr);
    let after = qemu_contents(&p, &[]);
    assert!(after[..2 << 20] == before[..2 << 20]);
    assert!(after[2 << 20..(2 << 20) + 65536].iter().all(|&b| b == 7));
}

#[test]
fn repair_dirty_rebuilds_refcounts_and_clears_the_bit() {
    let dir = Dir::new();
    let p = dirty_image(&dir, "dirty");
    let theirs = dir.copy("dirty", "dirty.qemu");
    let bytes = std::fs::read(&p).unwrap();
    let mem = MemStorage::from_bytes(&bytes);
    let report = block_on(check::repair_dirty(&mem, None)).expect("repair a dirty image");
    assert_eq!(report.corruptions, 0);
    assert!(report.corruptions_fixed > 0);
    std::fs::write(&p, mem.to_vec()).unwrap();
    assert_eq!(incompatible(&p) & INCOMPAT_DIRTY, 0);
    assert_eq!(qemu_check(&p, Repair::None, true).code, 0);
    // QEMU repairs the same image the same way when it opens it for writing.
    run_ok(qemu("qemu-io").args(["-c", "flush", theirs.to_str().unwrap()]));
    assert_eq!(
        qemu_check(&p, Repair::None, true).report,
        qemu_check(&theirs, Repair::None, true).report
    );
}

/// Reads every guest byte of an in-memory image through the engine.
async fn read_guest(mem: &MemStorage) -> Vec<u8> {
    let fs = MemFs::new();
    fs.insert("/img", mem.snapshot());
    let img: Image<MemStorage> = Image::open(
        &fs,
        Path::new("/img"),
        &OpenOptions {
            read_only: true,
            no_backing: true,
            ..OpenOptions::default()
        },
    )
    .await
    .expect("the image opens");
    img.read(GuestOffset(0), img.size() as usize)
        .await
        .expect("the image reads")
        .to_vec()
}

/// Runs `-r all` on `mem` over fault-injecting storage that fails every operation after the
/// first `n`, then crashes it every way `plans` say. Each crash image must read the original
/// guest data, and a second repair must make it clean. Returns the number of crash images.
async fn crash_repair_at(mem: &MemStorage, guest: &[u8], n: u64, plans: &[CrashPlan]) -> usize {
    let f = FaultStorage::from_mem(mem.snapshot());
    f.fail_after(n, InjectedError::Eio);
    let _ = check::check(&f, Repair::All, &mut |_| {}).await;
    for plan in plans {
        let crashed = f.crash_image(plan);
        let what = format!("crash after {n} operations, {plan:?}");
        assert!(
            read_guest(&crashed).await == guest,
            "{what}: guest data changed"
        );
        let outcome = check::check(&crashed, Repair::All, &mut |_| {})
            .await
            .unwrap_or_else(|e| panic!("{what}: the second repair failed: {e}"));
        assert_eq!(
            outcome.report.exit_code(),
            0,
            "{what}: {:?}",
            outcome.report
        );
        let clean = check::check(&crashed, Repair::None, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(clean.report.exit_code(), 0, "{what}");
    }
    plans.len()
}

#[test]
fn a_repair_interrupted_by_a_crash_loses_nothing() {
    let dir = Dir::new();
    let mut images = 0;
    for (base, opts, fault) in [
        // A rebuild: new refcount blocks and table, the header switch, then leak repairs.
        (
            "rebuild",
            "cluster_size=512,refcount_bits=16",
            "used_cluster_refcount_zero",
        ),
        // Leak and COPIED repairs in place.
        ("in-place", "cluster_size=4096", "refcount_too_high"),
    ] {
        let p = dir.path(base);
        create_image(&p, "qcow2", opts, None, "2M");
        qemu_io("qcow2", &p, &["write -P 1 0 300k", "write -P 2 1M 64k"]);
        let patch = Patch::open(&p);
        match fault {
            "used_cluster_refcount_zero" => {
                patch.set_refcount(host_cluster(&patch, 0), 0);
                patch.set_refcount(host_cluster(&patch, 200 << 10), 0);
            }
            _ => {
                let c = host_cluster(&patch, 0);
                patch.set_refcount(c, 2);
            }
        }
        let mem = MemStorage::from_bytes(&std::fs::read(&p).unwrap());
        images += block_on(async {
            let guest = read_guest(&mem).await;
            // How many operations a complete repair takes.
            let f = FaultStorage::from_mem(mem.snapshot());
            let first = check::check(&f, Repair::All, &mut |_| {}).await.unwrap();
            assert!(
                first.rechecked,
                "{base}: the fault should have been repaired"
            );
            let total = f.stats().operations();
            let mut images = 0;
            for n in 0..=total {
                let plans = [
                    CrashPlan::mask(&[]),
                    CrashPlan::mask(&[true; 64]),
                    CrashPlan::Random {
                        seed: n,
                        tear: true,
                    },
                    CrashPlan::Random {
                        seed: n ^ 0x5555,
                        tear: false,
                    },
                ];
                images += crash_repair_at(&mem, &guest, n, &plans).await;
            }
            eprintln!("{base}: {total} operations, {images} crash images repaired");
            images
        });
    }
    assert!(images > 200, "only {images} crash images");
}
