//! Crash consistency of internal snapshot operations (part of the crash suite, see
//! `crash.rs`): create, apply and delete run on fault-injecting storage that dies after
//! its n-th operation, for every n, and crash images keep random subsets of the writes not
//! yet flushed (some torn). Every crash image must open, show the disk and the snapshot
//! table either as before the operation or as after it, and pass `qemu-img check` with at
//! worst leaked clusters: the check may also report a COPIED flag that a leaked reference
//! makes look premature (a flag and the refcount it describes cannot change in one write),
//! but `qemu-img check -r leaks` must then repair it as a leak, with no corruption fixed.

use crate::support::{self, crash_plan, FaultFs};
use qcow2::engine::{create, CreateOptions, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{CrashPlan, FaultStorage, InjectedError, IoBuf, MemFs, MemStorage};
use test_support::{run, Rng};

const TOP: &str = "/img/top.qcow2";
const SIZE: u64 = 4 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SnapOp {
    Create,
    Apply,
    Delete,
}

/// Data, a compressed cluster, and a snapshot "base" (refcounts of 2) with data written over
/// it since: the image, still open for the caller to go on with, and its storage.
pub(crate) async fn with_a_snapshot(opts: &CreateOptions) -> (MemStorage, Image<MemStorage>) {
    let top = MemStorage::new();
    create(&top, opts).await.unwrap();
    let fs = MemFs::new();
    fs.insert(TOP, top.clone());
    let img = Image::open(&fs, Path::new(TOP), &OpenOptions::default())
        .await
        .unwrap();
    let (size, cluster) = (opts.size, opts.cluster_size);
    img.write(GuestOffset(0), fill(1, 3 * cluster), false)
        .await
        .0
        .unwrap();
    img.write(GuestOffset(size / 2), fill(2, cluster), false)
        .await
        .0
        .unwrap();
    img.write_compressed(GuestOffset(size - cluster), fill(3, cluster))
        .await
        .unwrap();
    img.create_snapshot(b"base", (1, 0)).await.unwrap();
    img.write(GuestOffset(cluster), fill(4, cluster / 2), false)
        .await
        .0
        .unwrap();
    (top, img)
}

fn fill(byte: u8, len: u64) -> IoBuf {
    IoBuf::from_slice(&vec![byte; len as usize])
}

/// [`with_a_snapshot`], then more data and a second snapshot "later" with a write over it.
async fn before(cluster: u64, extended: bool) -> MemStorage {
    let opts = CreateOptions {
        size: SIZE,
        cluster_size: cluster,
        extended_l2: extended,
        ..CreateOptions::default()
    };
    let (top, img) = with_a_snapshot(&opts).await;
    img.write(GuestOffset(SIZE / 4), fill(5, cluster), false)
        .await
        .0
        .unwrap();
    img.create_snapshot(b"later", (2, 0)).await.unwrap();
    img.write(GuestOffset(0), fill(6, 512), false)
        .await
        .0
        .unwrap();
    img.close().await.unwrap();
    top
}

/// The guest disk and the snapshot IDs of an image.
async fn state(img: &Image<MemStorage>) -> (Vec<u8>, Vec<String>) {
    let disk = img.read(GuestOffset(0), img.size() as usize).await.unwrap();
    let ids = img
        .snapshots()
        .await
        .unwrap()
        .iter()
        .map(|s| s.id_lossy())
        .collect();
    (disk.to_vec(), ids)
}

async fn open(top: &MemStorage, snapshot: Option<&str>) -> Image<MemStorage> {
    let fs = MemFs::new();
    fs.insert(TOP, MemStorage::from_bytes(&top.to_vec()));
    let opts = OpenOptions {
        read_only: true,
        snapshot: snapshot.map(str::to_string),
        ..OpenOptions::default()
    };
    Image::open(&fs, Path::new(TOP), &opts).await.unwrap()
}

/// Runs `op` on `start`, the storage dying after `fail_after` operations; returns the
/// storage handle and how many operations it saw.
async fn run_op(
    start: &MemStorage,
    op: SnapOp,
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
    let res = match op {
        SnapOp::Create => img.create_snapshot(b"new", (3, 0)).await.map(|_| ()),
        SnapOp::Apply => img.apply_snapshot("base").await,
        SnapOp::Delete => img.delete_snapshot(b"1", b"base").await.map(|_| ()),
    };
    let res = res.and(img.close().await);
    assert!(
        res.is_ok() || fail_after.is_some(),
        "{op:?} failed without a fault: {res:?}"
    );
    (handle.clone(), handle.stats().operations())
}

/// `qemu-img check` finds nothing worse than leaks (see the module documentation).
fn qemu_check(crash: &MemStorage, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, report) = support::qemu_check(dir.path(), &crash.to_vec(), &[]);
    match code {
        Some(0) | Some(3) => return,
        Some(2) => assert!(
            report
                .lines()
                .filter(|l| l.starts_with("ERROR"))
                .all(|l| l.starts_with("ERROR OFLAG_COPIED") && !l.ends_with("refcount=1")),
            "{what}: qemu-img check: {report}"
        ),
        other => panic!("{what}: qemu-img check exited {other:?}: {report}"),
    }
    let (code, out, err) = support::qemu_check(
        dir.path(),
        &crash.to_vec(),
        &["-r", "leaks", "--output=json"],
    );
    let json: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    assert!(
        code == Some(0) && json["corruptions-fixed"].as_u64().unwrap_or(0) == 0,
        "{what}: qemu-img check -r leaks: {out}{err}"
    );
}

/// What a crash image may show: the disk and snapshot IDs before or after, and the disk
/// of snapshot 1 as it was taken.
struct Ends {
    states: [(Vec<u8>, Vec<String>); 2],
    base: Vec<u8>,
}

/// One crash image shows the state before or the state after, whole.
async fn verify(crash: &MemStorage, op: SnapOp, ends: &Ends, what: &str) {
    let img = open(crash, None).await;
    let got = state(&img).await;
    let at = ends
        .states
        .iter()
        .position(|e| *e == got)
        .unwrap_or_else(|| panic!("{what}: neither the state before nor after: {:?}", got.1));
    // A snapshot the table still (or already) lists reads as it was taken.
    if got.1.iter().any(|id| id == "1") {
        let sn = open(crash, Some("1")).await;
        assert!(state(&sn).await.0 == ends.base, "{what}: snapshot 1");
    }
    if op == SnapOp::Create && at == 1 {
        let sn = open(crash, Some("3")).await;
        assert!(state(&sn).await.0 == got.0, "{what}: the new snapshot");
    }
}

fn campaign(cluster: u64, extended: bool, op: SnapOp, plans: usize) {
    let start = run(before(cluster, extended));
    let before_state = run(async { state(&open(&start, None).await).await });
    let base = run(async { state(&open(&start, Some("1")).await).await.0 });
    let (done, total) = run(run_op(&start, op, None));
    let after = done.crash_image(&CrashPlan::mask(&[]));
    let after_state = run(async { state(&open(&after, None).await).await });
    let ends = Ends {
        states: [before_state, after_state],
        base,
    };
    let mut rng = Rng(0x5A4B ^ cluster ^ op as u64);
    for n in 1..=total {
        let (handle, _) = run(run_op(&start, op, Some(n)));
        for k in 0..plans {
            let plan = crash_plan(k, &handle, &mut rng);
            let what =
                format!("{op:?} ({cluster} B clusters): crash after op {n} of {total}, plan {k}");
            let crash = handle.crash_image(&plan);
            run(verify(&crash, op, &ends, &what));
            if (n as usize * plans + k) % 3 == 0 {
                qemu_check(&crash, &what);
            }
        }
    }
}

#[test]
fn crash_while_creating_a_snapshot() {
    campaign(65536, false, SnapOp::Create, 4);
    campaign(4096, false, SnapOp::Create, 3);
}

#[test]
fn crash_while_applying_a_snapshot() {
    campaign(65536, true, SnapOp::Apply, 4);
    campaign(4096, false, SnapOp::Apply, 3);
}

#[test]
fn crash_while_deleting_a_snapshot() {
    campaign(65536, false, SnapOp::Delete, 4);
    campaign(65536, true, SnapOp::Delete, 3);
}
