//! Crash consistency: a workload runs on fault-injecting storage that "dies" after its n-th
//! operation (so crash points fall inside multi-step metadata updates too: refcount block
//! allocation, refcount table growth, L1 growth, L2 allocation), then crash images keep a
//! random subset of the writes that were not yet flushed (some torn at sector granularity).
//! Every crash image must open, every byte acknowledged by a completed FLUSH or FUA write must
//! read back, and `qemu-img check` must find no corruption (leaks are allowed). With
//! persistent bitmaps the workload closes and reopens the image, so crashes fall inside
//! storing them too: a bitmap a crash image shows as clean must hold every change made
//! before the close that stored it.

use crate::support::{self, crash_plan, FaultFs};
use qcow2::engine::{create, CreateOptions, Format, Image, OpenOptions, Preallocation};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{FaultStorage, InjectedError, IoBuf, MemFs, MemStorage};
use test_support::{run, Rng};

#[derive(Clone, Copy, Debug)]
enum Op {
    Write {
        off: u64,
        len: u64,
        byte: u8,
        fua: bool,
    },
    Zero {
        off: u64,
        len: u64,
        unmap: bool,
    },
    Discard {
        off: u64,
        len: u64,
    },
    Flush,
    Resize {
        size: u64,
    },
    /// Close (storing the bitmaps) and open again (marking them in use).
    CloseReopen,
}

#[derive(Clone, Debug)]
struct Config {
    name: &'static str,
    cluster: u64,
    extended_l2: bool,
    refcount_bits: u32,
    version: u32,
    backing: bool,
    size: u64,
    /// Resize the disk to this size halfway through (L1 table growth, or a shrink that
    /// frees clusters, L2 tables and refcount blocks and cuts the file).
    resize_to: Option<u64>,
    ops: usize,
    /// Lazy refcounts: crash images are dirty and get their refcounts rebuilt on open.
    lazy: bool,
    /// Two persistent bitmaps (one enabled), closed and reopened during the workload.
    bitmaps: bool,
}

impl Config {
    /// The largest the disk gets (the backing file's size).
    fn largest(&self) -> u64 {
        self.size.max(self.resize_to.unwrap_or(0))
    }
}

/// The enabled bitmap of the bitmap configurations, and its granularity.
const TRACKING: &str = "tracking";
const TRACKING_GRANULARITY: u64 = 65536;

fn workload(c: &Config, seed: u64) -> Vec<Op> {
    let mut rng = Rng(seed);
    let unit = if c.extended_l2 {
        c.cluster / 32
    } else {
        c.cluster
    };
    let mut size = c.size;
    let mut ops = Vec::new();
    for i in 0..c.ops {
        if c.bitmaps && i > 0 && i % (c.ops / 3) == 0 {
            ops.push(Op::CloseReopen);
            continue;
        }
        if i == c.ops / 2 {
            if let Some(s) = c.resize_to {
                ops.push(Op::Resize { size: s });
                size = s;
                continue;
            }
        }
        let edge = rng.below(size / unit) * unit;
        let off = match rng.below(3) {
            0 => edge,
            1 => edge + rng.below(unit),
            _ => rng.below(size),
        }
        .min(size - 1);
        let len = (rng.below((size - off).min(unit * 4)) + 1).min(size - off);
        ops.push(match rng.below(12) {
            0..=6 => Op::Write {
                off,
                len,
                byte: (rng.below(254) + 1) as u8,
                fua: rng.below(10) == 0,
            },
            7 | 8 => Op::Zero {
                off,
                len,
                unmap: rng.below(2) == 0,
            },
            9 => Op::Discard { off, len },
            _ => Op::Flush,
        });
    }
    ops
}

/// What the guest may see after a crash.
struct Expect {
    /// Contents as of the last completed flush (or FUA write).
    durable: Vec<u8>,
    /// Bytes changed since then, which may read as anything they held since.
    dirty: Vec<bool>,
    /// Every range the workload touched before the last close began: what a bitmap stored
    /// clean by that close must hold.
    tracked: Vec<(u64, u64)>,
}

const TOP: &str = "/img/top.qcow2";
const BASE: &str = "/img/base.raw";

fn base_bytes(size: u64) -> Vec<u8> {
    (0..size).map(|i| (i / 4096 % 251) as u8 + 1).collect()
}

/// Creates the image (and a raw backing file) as durable, unflushed-log-free storages.
async fn fresh(c: &Config) -> FaultFs {
    let top = MemStorage::new();
    create(
        &top,
        &CreateOptions {
            size: c.size,
            cluster_size: c.cluster,
            extended_l2: c.extended_l2,
            refcount_bits: c.refcount_bits,
            version: c.version,
            lazy_refcounts: c.lazy,
            backing: c.backing.then(|| ("base.raw".to_string(), Format::Raw)),
            ..CreateOptions::default()
        },
    )
    .await
    .unwrap();
    if c.bitmaps {
        add_bitmaps(&top).await;
    }
    let fs = FaultFs::default();
    fs.0.borrow_mut()
        .insert(TOP.into(), FaultStorage::from_mem(top));
    if c.backing {
        let size = c.largest();
        fs.0.borrow_mut().insert(
            BASE.into(),
            FaultStorage::from_mem(MemStorage::from_bytes(&base_bytes(size))),
        );
    }
    fs
}

/// Adds the bitmaps of the bitmap configurations, stored by a clean close.
async fn add_bitmaps(top: &MemStorage) {
    let memfs = MemFs::new();
    memfs.insert(TOP, top.clone());
    let img = Image::open(&memfs, Path::new(TOP), &OpenOptions::default())
        .await
        .unwrap();
    img.add_bitmap(TRACKING, Some(TRACKING_GRANULARITY), true)
        .unwrap();
    img.add_bitmap("frozen", Some(1 << 20), false).unwrap();
    img.close().await.unwrap();
}

/// What the fresh image reads as, and the expectation that all of it is durable.
fn initial_model(c: &Config) -> (Vec<u8>, Expect) {
    let mut model = if c.backing {
        base_bytes(c.largest())
    } else {
        vec![0u8; c.largest() as usize]
    };
    model.truncate(c.size as usize);
    let expect = Expect {
        durable: model.clone(),
        dirty: vec![false; model.len()],
        tracked: Vec::new(),
    };
    (model, expect)
}

/// Runs the workload until the storage dies after `fail_after` operations (or to the end),
/// and returns what a crash now may show.
async fn run_workload(c: &Config, ops: &[Op], fail_after: Option<u64>) -> (FaultFs, Expect, u64) {
    let fs = fresh(c).await;
    let mut img = Image::open(&fs, Path::new(TOP), &OpenOptions::default())
        .await
        .unwrap();
    let handle = fs.0.borrow()[Path::new(TOP)].clone();
    let mut touched_so_far: Vec<(u64, u64)> = Vec::new();
    let (mut model, mut expect) = initial_model(c);
    if let Some(n) = fail_after {
        handle.fail_after(n, InjectedError::Eio);
    }
    for op in ops {
        let touched = match *op {
            Op::Write { off, len, .. } | Op::Zero { off, len, .. } | Op::Discard { off, len } => {
                Some((off, len))
            }
            _ => None,
        };
        // Anything the failing operation touched may or may not have landed.
        if let Some((off, len)) = touched {
            expect.dirty[off as usize..(off + len) as usize].fill(true);
            touched_so_far.push((off, len));
        }
        let res = match *op {
            Op::Write {
                off,
                len,
                byte,
                fua,
            } => {
                let buf = IoBuf::from_slice(&vec![byte; len as usize]);
                let r = img.write(GuestOffset(off), buf, fua).await.0;
                if r.is_ok() {
                    model[off as usize..(off + len) as usize].fill(byte);
                    if fua {
                        expect.durable.copy_from_slice(&model);
                        expect.dirty.fill(false);
                    }
                }
                r
            }
            Op::Zero { off, len, unmap } => {
                let r = img.write_zeroes(GuestOffset(off), len, unmap, false).await;
                if r.is_ok() {
                    model[off as usize..(off + len) as usize].fill(0);
                }
                r
            }
            Op::Discard { off, len } => {
                let r = img.discard(GuestOffset(off), len).await;
                if r.is_ok() {
                    match img.read(GuestOffset(off), len as usize).await {
                        Ok(now) => model[off as usize..(off + len) as usize].copy_from_slice(&now),
                        Err(e) => return finish(fs, expect, Some(e.to_string())),
                    }
                }
                r
            }
            Op::Flush => {
                let r = img.flush().await;
                if r.is_ok() {
                    expect.durable.copy_from_slice(&model);
                    expect.dirty.fill(false);
                }
                r
            }
            Op::CloseReopen => {
                expect.tracked.clone_from(&touched_so_far);
                let r = match img.close().await {
                    Ok(()) => Image::open(&fs, Path::new(TOP), &OpenOptions::default())
                        .await
                        .map(|reopened| img = reopened),
                    Err(e) => Err(e),
                };
                if r.is_ok() {
                    expect.durable.copy_from_slice(&model);
                    expect.dirty.fill(false);
                }
                r
            }
            Op::Resize { size } => {
                let old = expect.durable.len();
                // A shrink may drop the end before a crash: it may read as anything.
                if (size as usize) < old {
                    expect.dirty[size as usize..].fill(true);
                }
                let r = img.resize(size, Preallocation::Off).await;
                if r.is_ok() {
                    // New space reads as zeros, even over the (longer) backing file.
                    model.resize(size as usize, 0);
                    // The grown part is new either way: mark it dirty until flushed.
                    expect.durable.resize(size as usize, 0);
                    expect.dirty.resize(size as usize, true);
                    if (size as usize) > old {
                        expect.dirty[old..].fill(true);
                    }
                }
                r
            }
        };
        if let Err(e) = res {
            assert!(
                fail_after.is_some(),
                "{}: {op:?} failed without a fault: {e}",
                c.name
            );
            return finish(fs, expect, Some(e.to_string()));
        }
    }
    finish(fs, expect, None)
}

fn finish(fs: FaultFs, expect: Expect, _err: Option<String>) -> (FaultFs, Expect, u64) {
    let ops = fs.0.borrow()[Path::new(TOP)].stats().operations();
    (fs, expect, ops)
}

/// Opens a crash image, checks every durable byte, and (sometimes) asks qemu-img check.
async fn verify(c: &Config, crash: MemStorage, expect: &Expect, what: &str, qemu: bool) {
    let memfs = MemFs::new();
    memfs.insert(TOP, crash.clone());
    if c.backing {
        memfs.insert(BASE, MemStorage::from_bytes(&base_bytes(c.largest())));
    }
    let img = Image::open(
        &memfs,
        Path::new(TOP),
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: the crash image does not open: {e}"));
    let size = img.size().min(expect.durable.len() as u64);
    let got = img
        .read(GuestOffset(0), size as usize)
        .await
        .unwrap_or_else(|e| panic!("{what}: read: {e}"));
    for i in 0..size as usize {
        if !expect.dirty[i] && got[i] != expect.durable[i] {
            panic!(
                "{what}: byte {i:#x} was durable as {:#04x} but reads {:#04x}",
                expect.durable[i], got[i]
            );
        }
    }
    if c.bitmaps {
        verify_bitmaps(&img, expect, what).await;
    }
    if qemu {
        let dir = tempfile::tempdir().unwrap();
        if c.backing {
            std::fs::write(dir.path().join("base.raw"), base_bytes(c.largest())).unwrap();
        }
        // A dirty lazy-refcount image is repaired by the next read-write open, not checked
        // as it is.
        if !c.lazy {
            support::assert_qemu_check_at_most_leaks(dir.path(), &crash.to_vec(), what);
        }
        // The crashed image must also stay writable: allocate over it and check again.
        let fs2 = MemFs::new();
        fs2.insert(TOP, MemStorage::from_bytes(&crash.to_vec()));
        if c.backing {
            fs2.insert(BASE, MemStorage::from_bytes(&base_bytes(c.largest())));
        }
        let img = Image::open(&fs2, Path::new(TOP), &OpenOptions::default())
            .await
            .unwrap();
        let len = (c.cluster * 3).min(img.size() / 2);
        let (r, _) = img
            .write(
                GuestOffset(img.size() / 3),
                IoBuf::from_slice(&vec![0xee; len as usize]),
                true,
            )
            .await;
        r.unwrap_or_else(|e| panic!("{what}: writing after the crash: {e}"));
        img.close().await.unwrap();
        let written = fs2.get(Path::new(TOP)).unwrap().to_vec();
        support::assert_qemu_check_at_most_leaks(
            dir.path(),
            &written,
            &format!("{what}: after writing to the crashed image"),
        );
    }
}

/// The bitmaps survive a crash whole: both, or (a crash while the open marked them in use
/// drops the extension, as in QEMU) none; a bitmap shown clean holds every change made before
/// the close that stored it.
async fn verify_bitmaps<S: storage::Storage + 'static>(
    img: &Image<S>,
    expect: &Expect,
    what: &str,
) {
    let list = img
        .bitmaps()
        .await
        .unwrap_or_else(|e| panic!("{what}: the bitmaps do not load: {e}"));
    let names: Vec<&str> = list.iter().map(|b| b.name.as_str()).collect();
    assert!(
        names.is_empty() || names == [TRACKING, "frozen"],
        "{what}: bitmaps {names:?}"
    );
    let Some(tracking) = list.iter().find(|b| b.name == TRACKING && !b.inconsistent) else {
        return;
    };
    assert!(tracking.enabled, "{what}: {tracking:?}");
    let data = img
        .bitmap_data(TRACKING)
        .await
        .unwrap_or_else(|e| panic!("{what}: a clean bitmap's data does not load: {e}"));
    for &(off, len) in &expect.tracked {
        let (first, last) = (
            off / TRACKING_GRANULARITY,
            (off + len - 1) / TRACKING_GRANULARITY,
        );
        for chunk in first..=last {
            assert!(
                data.get(chunk),
                "{what}: {off:#x}+{len:#x} was changed before the bitmap was stored, but chunk {chunk} is clean"
            );
        }
    }
}

fn crash_campaign(c: Config, points: usize, plans_per_point: usize) -> usize {
    let ops = workload(&c, 0xC0FFEE ^ c.cluster);
    let total = run(async { run_workload(&c, &ops, None).await.2 });
    let mut rng = Rng(0x5EED ^ c.cluster ^ u64::from(c.extended_l2));
    let mut checked = 0;
    for p in 0..points {
        let n = rng.below(total) + 1;
        run(async {
            let (fs, expect, _) = run_workload(&c, &ops, Some(n)).await;
            let handle = fs.0.borrow()[Path::new(TOP)].clone();
            for k in 0..plans_per_point {
                let plan = crash_plan(k, &handle, &mut rng);
                let what = format!(
                    "{}: crash after storage op {n} of {total}, plan {k}",
                    c.name
                );
                let qemu = (p * plans_per_point + k) % 7 == 0;
                verify(&c, handle.crash_image(&plan), &expect, &what, qemu).await;
                checked += 1;
            }
        });
    }
    checked
}

fn base_config(name: &'static str) -> Config {
    Config {
        name,
        cluster: 65536,
        extended_l2: false,
        refcount_bits: 16,
        version: 3,
        backing: false,
        size: 8 << 20,
        resize_to: None,
        ops: 120,
        lazy: false,
        bitmaps: false,
    }
}

#[test]
fn crash_standard_l2() {
    let n = crash_campaign(base_config("64k standard"), 120, 4);
    assert_eq!(n, 480);
}

#[test]
fn crash_extended_l2_over_backing() {
    let c = Config {
        extended_l2: true,
        backing: true,
        ..base_config("64k extended over raw backing")
    };
    assert_eq!(crash_campaign(c, 120, 4), 480);
}

#[test]
fn crash_refcount_table_growth() {
    // 512-byte clusters with 64-bit refcounts: one refcount block covers 64 clusters and the
    // first table 4096, so the workload allocates blocks and grows the table many times.
    let c = Config {
        cluster: 512,
        refcount_bits: 64,
        size: 6 << 20,
        ops: 150,
        ..base_config("512 B clusters, 64-bit refcounts")
    };
    assert_eq!(crash_campaign(c, 150, 4), 600);
}

#[test]
fn crash_l1_growth_and_v2() {
    let c = Config {
        cluster: 4096,
        version: 2,
        size: 4 << 20,
        resize_to: Some(40 << 20),
        ops: 120,
        ..base_config("4k clusters, compat 0.10, L1 growth")
    };
    assert_eq!(crash_campaign(c, 120, 4), 480);
}

#[test]
fn crash_lazy_refcounts() {
    let c = Config {
        lazy: true,
        extended_l2: true,
        ..base_config("64k extended, lazy refcounts")
    };
    assert_eq!(crash_campaign(c, 80, 4), 320);
}

#[test]
fn crash_while_bitmaps_are_tracked_and_stored() {
    let c = Config {
        bitmaps: true,
        ..base_config("64k standard, persistent bitmaps")
    };
    assert_eq!(crash_campaign(c, 120, 4), 480);
}

#[test]
fn crash_shrink() {
    // 512-byte clusters: the shrink clears many L1 entries, frees their L2 tables, drops
    // refcount blocks that count nothing any more and cuts the file, so crash points fall
    // between each of those steps. The new end is not cluster-aligned.
    let c = Config {
        cluster: 512,
        size: 6 << 20,
        resize_to: Some((1 << 20) + 1536),
        ops: 150,
        ..base_config("512 B clusters, shrink")
    };
    assert_eq!(crash_campaign(c, 150, 4), 600);
}

#[test]
fn crash_grow_over_a_longer_backing_file() {
    // The backing file is as long as the grown disk: the new space is zeroed before the
    // size shows it.
    let c = Config {
        backing: true,
        size: 3 << 20,
        resize_to: Some(8 << 20),
        ..base_config("64k standard, grow over a longer backing file")
    };
    assert_eq!(crash_campaign(c, 120, 4), 480);
}
