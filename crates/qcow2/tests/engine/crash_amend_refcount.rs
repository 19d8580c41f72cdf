//! Crash consistency of a refcount width change (`amend -o refcount_bits=N`, part of the
//! crash suite, see `crash.rs`): the change runs on fault-injecting storage that dies after
//! its n-th operation, for every n, and crash images keep random subsets of the writes not
//! yet flushed (some torn at sector granularity). Every crash image must open with the old
//! width or the new one, read the disk and the snapshot as before, and pass `qemu-img check`
//! with nothing worse than leaked clusters (the new structure, written before the switch).
//! Widening and narrowing both; and the image stays writable after the change.

use crate::crash_snapshots::with_a_snapshot;
use crate::support::{self, crash_plan, FaultFs};
use qcow2::engine::{create, AmendOptions, CreateOptions, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{CrashPlan, FaultStorage, InjectedError, IoBuf, MemFs, MemStorage};
use test_support::{run, Rng};

const TOP: &str = "/img/top.qcow2";
const SIZE: u64 = 4 << 20;
/// Byte offset of the header's refcount_order field.
const REFCOUNT_ORDER: usize = 96;

/// Data, a compressed cluster, and a snapshot "base" (refcounts of 2) with data written over
/// it since.
async fn before(cluster: u64, refcount_bits: u32) -> MemStorage {
    let opts = CreateOptions {
        size: SIZE,
        cluster_size: cluster,
        refcount_bits,
        ..CreateOptions::default()
    };
    let (top, img) = with_a_snapshot(&opts).await;
    img.close().await.unwrap();
    top
}

/// The refcount width the header of `image` names.
fn width(image: &MemStorage) -> u32 {
    let bytes = image.to_vec();
    let order = u32::from_be_bytes(
        bytes[REFCOUNT_ORDER..REFCOUNT_ORDER + 4]
            .try_into()
            .unwrap(),
    );
    1 << order
}

/// The guest disk of `image`, or of its snapshot.
async fn disk(image: &MemStorage, snapshot: Option<&str>) -> Vec<u8> {
    let fs = MemFs::new();
    fs.insert(TOP, MemStorage::from_bytes(&image.to_vec()));
    let opts = OpenOptions {
        read_only: true,
        snapshot: snapshot.map(str::to_string),
        ..OpenOptions::default()
    };
    let img = Image::open(&fs, Path::new(TOP), &opts).await.unwrap();
    img.read(GuestOffset(0), img.size() as usize)
        .await
        .unwrap()
        .to_vec()
}

fn amend_to(bits: u32) -> AmendOptions {
    AmendOptions {
        refcount_bits: Some(u64::from(bits)),
        ..AmendOptions::default()
    }
}

/// Changes `start` to `bits`-bit refcounts, the storage dying after `fail_after` operations;
/// returns the storage handle and how many operations it saw.
async fn run_amend(
    start: &MemStorage,
    bits: u32,
    fail_after: Option<u64>,
) -> (FaultStorage<MemStorage>, u64) {
    let fs = FaultFs::default();
    let handle = FaultStorage::from_mem(MemStorage::from_bytes(&start.to_vec()));
    fs.0.borrow_mut().insert(TOP.into(), handle.clone());
    let img = Image::open(&fs, Path::new(TOP), &OpenOptions::default())
        .await
        .unwrap();
    if let Some(n) = fail_after {
        handle.fail_after(n, InjectedError::Eio);
    }
    let res = img.amend(&amend_to(bits)).await.and(img.close().await);
    assert!(
        res.is_ok() || fail_after.is_some(),
        "amend to {bits} bits failed without a fault: {res:?}"
    );
    (handle.clone(), handle.stats().operations())
}

/// `qemu-img check` finds nothing worse than leaks.
fn qemu_check(crash: &MemStorage, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    support::assert_qemu_check_at_most_leaks(dir.path(), &crash.to_vec(), what);
}

fn campaign(cluster: u64, from: u32, to: u32, plans: usize) {
    let start = run(before(cluster, from));
    let (disk_before, base) =
        run(async { (disk(&start, None).await, disk(&start, Some("1")).await) });
    let (done, total) = run(run_amend(&start, to, None));
    let after = done.crash_image(&CrashPlan::mask(&[]));
    assert_eq!(width(&after), to, "the change went through");
    qemu_check(&after, "after the change");
    let mut rng = Rng(0x7EF ^ cluster ^ u64::from(from << 8 | to));
    let mut seen = [false; 2];
    for n in 1..=total {
        let (handle, _) = run(run_amend(&start, to, Some(n)));
        for k in 0..plans {
            let plan = crash_plan(k, &handle, &mut rng);
            let what = format!(
                "{from} -> {to} bits ({cluster} B clusters): crash after op {n} of {total}, plan {k}"
            );
            let crash = handle.crash_image(&plan);
            let w = width(&crash);
            assert!(w == from || w == to, "{what}: width {w}");
            seen[usize::from(w == to)] = true;
            let (now, snap) =
                run(async { (disk(&crash, None).await, disk(&crash, Some("1")).await) });
            assert!(now == disk_before, "{what}: the disk changed");
            assert!(snap == base, "{what}: the snapshot changed");
            if (n as usize * plans + k) % 3 == 0 || w == to {
                qemu_check(&crash, &what);
            }
        }
    }
    assert!(
        seen[0] && seen[1],
        "crash images of both widths were seen: {seen:?}"
    );
}

#[test]
fn crash_while_widening_the_refcounts() {
    campaign(65536, 16, 64, 4);
    campaign(4096, 2, 16, 3);
}

#[test]
fn crash_while_narrowing_the_refcounts() {
    campaign(65536, 16, 2, 4);
    campaign(4096, 64, 8, 3);
}

/// The image stays writable after the change, on the same handle: new clusters get
/// refcounts of the new width, and QEMU finds the result clean.
#[test]
fn writes_after_the_change_use_the_new_width() {
    for (from, to) in [(16, 1), (16, 64), (64, 4)] {
        let start = run(before(4096, from));
        let out = run(async {
            let fs = MemFs::new();
            let top = MemStorage::from_bytes(&start.to_vec());
            fs.insert(TOP, top.clone());
            let img = Image::open(&fs, Path::new(TOP), &OpenOptions::default())
                .await
                .unwrap();
            let narrowing = img.amend(&amend_to(to)).await;
            if to == 1 {
                // The snapshot's clusters have refcount 2: QEMU's message, nothing changed.
                let e = narrowing.unwrap_err().to_string();
                assert!(
                    e.contains("Cannot decrease refcount entry width to 1 bits"),
                    "{e}"
                );
                img.close().await.unwrap();
                return top;
            }
            narrowing.unwrap();
            let data = IoBuf::from_slice(&vec![7u8; 3 * 4096 + 512]);
            img.write(GuestOffset(SIZE / 4 + 512), data, false)
                .await
                .0
                .unwrap();
            img.write_compressed(
                GuestOffset(SIZE - 3 * 4096),
                IoBuf::from_slice(&vec![8u8; 4096]),
            )
            .await
            .unwrap();
            img.delete_snapshot(b"1", b"base").await.unwrap();
            let back = img
                .read(GuestOffset(SIZE / 4), 4 * 4096)
                .await
                .unwrap()
                .to_vec();
            let written = 512..512 + 3 * 4096 + 512;
            let ok = back
                .iter()
                .enumerate()
                .all(|(i, &b)| b == if written.contains(&i) { 7 } else { 0 });
            assert!(ok, "{from} -> {to}: the write reads back");
            img.close().await.unwrap();
            top
        });
        let expected = if to == 1 { from } else { to };
        assert_eq!(width(&out), expected);
        qemu_check(&out, &format!("{from} -> {to}"));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("top.qcow2");
        std::fs::write(&p, out.to_vec()).unwrap();
        let check = std::process::Command::new("qemu-img")
            .args(["check", p.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(
            check.status.code(),
            Some(0),
            "{from} -> {to}: no leaks either"
        );
    }
}

/// With lazy refcounts, writes of the same session leave the dirty bit set and refcounts in
/// the cache only: the change writes them back and clears the bit before it counts, and the
/// disk reads the same through the new width.
#[test]
fn a_lazy_refcount_image_written_in_the_same_session_changes_width_cleanly() {
    let out = run(async {
        let top = MemStorage::new();
        let opts = CreateOptions {
            size: SIZE,
            cluster_size: 4096,
            lazy_refcounts: true,
            ..CreateOptions::default()
        };
        create(&top, &opts).await.unwrap();
        let fs = MemFs::new();
        fs.insert(TOP, top.clone());
        let img = Image::open(&fs, Path::new(TOP), &OpenOptions::default())
            .await
            .unwrap();
        let data = IoBuf::from_slice(&vec![5u8; 40 * 1024]);
        img.write(GuestOffset(12345 * 8), data, false)
            .await
            .0
            .unwrap();
        let disk_before = img
            .read(GuestOffset(0), SIZE as usize)
            .await
            .unwrap()
            .to_vec();
        img.amend(&amend_to(8)).await.unwrap();
        assert!(
            img.read(GuestOffset(0), SIZE as usize)
                .await
                .unwrap()
                .to_vec()
                == disk_before
        );
        let more = IoBuf::from_slice(&vec![6u8; 8192]);
        img.write(GuestOffset(SIZE / 2), more, false)
            .await
            .0
            .unwrap();
        img.close().await.unwrap();
        top
    });
    assert_eq!(width(&out), 8);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("top.qcow2");
    std::fs::write(&p, out.to_vec()).unwrap();
    let check = std::process::Command::new("qemu-img")
        .args(["check", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}
