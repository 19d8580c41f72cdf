//! Many requests in flight at once: writes, zeroes and discards that never overlap in bytes
//! but share clusters, subclusters and L2 slices (so allocations, copy-on-write fills and L2
//! updates race), with readers of untouched bytes running alongside. After every batch the
//! disk must equal the model; at the end QEMU must read the same and find no error.

use crate::support::opener;
use qcow2::engine::{create_file, CreateOptions, Format, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::rc::Rc;
use storage::{Aio, IoBuf};
use test_support::{assert_same_bytes, qemu_contents, run, Dir, Rng};

#[derive(Clone, Copy, Debug)]
enum Req {
    Write(u64, u64, u8),
    Zero(u64, u64, bool),
    Discard(u64, u64),
    Read(u64, u64),
}

/// Cuts a window of the disk into disjoint pieces, one request each.
fn batch(rng: &mut Rng, size: u64, window: u64) -> Vec<Req> {
    let start = rng.below(size - window) / 512 * 512;
    let mut cuts: Vec<u64> = (0..24).map(|_| start + rng.below(window)).collect();
    cuts.push(start);
    cuts.push(start + window);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| {
            let (o, l) = (w[0], w[1] - w[0]);
            match rng.below(10) {
                0..=5 => Req::Write(o, l, (rng.below(254) + 1) as u8),
                6 => Req::Zero(o, l, rng.below(2) == 0),
                7 => Req::Discard(o, l),
                _ => Req::Read(o, l),
            }
        })
        .collect()
}

fn campaign(name: &str, cs: u64, ext: bool, backing: bool, batches: usize) {
    let d = Dir::new();
    let size = 8u64 << 20;
    let base = d.path("base.raw");
    let base_bytes: Vec<u8> = (0..size).map(|i| (i / 1000 % 200) as u8 + 3).collect();
    std::fs::write(&base, &base_bytes).unwrap();
    let path = d.path("img.qcow2");
    let opts = CreateOptions {
        size,
        cluster_size: cs,
        extended_l2: ext,
        backing: backing.then(|| ("base.raw".into(), Format::Raw)),
        ..CreateOptions::default()
    };
    let mut model = if backing {
        base_bytes
    } else {
        vec![0u8; size as usize]
    };
    run(async {
        create_file(&opener(Aio::IoUring), &path, &opts)
            .await
            .unwrap();
        let img = Rc::new(
            Image::open(&opener(Aio::IoUring), &path, &OpenOptions::default())
                .await
                .unwrap(),
        );
        let mut rng = Rng(0xabcdef ^ cs);
        for b in 0..batches {
            // Windows of a few clusters: neighbours share clusters, subclusters and slices.
            let reqs = batch(&mut rng, size, cs * 3);
            let mut tasks = Vec::new();
            for &r in &reqs {
                let img = img.clone();
                let expect_read = match r {
                    Req::Read(o, l) => model[o as usize..(o + l) as usize].to_vec(),
                    _ => Vec::new(),
                };
                tasks.push(tokio::task::spawn_local(async move {
                    match r {
                        Req::Write(o, l, v) => {
                            img.write(
                                GuestOffset(o),
                                IoBuf::from_slice(&vec![v; l as usize]),
                                false,
                            )
                            .await
                            .0
                            .unwrap();
                            None
                        }
                        Req::Zero(o, l, unmap) => {
                            img.write_zeroes(GuestOffset(o), l, unmap, false)
                                .await
                                .unwrap();
                            None
                        }
                        Req::Discard(o, l) => {
                            img.discard(GuestOffset(o), l).await.unwrap();
                            Some(img.read(GuestOffset(o), l as usize).await.unwrap().to_vec())
                        }
                        Req::Read(o, l) => {
                            let got = img.read(GuestOffset(o), l as usize).await.unwrap();
                            assert!(
                                got[..] == expect_read[..],
                                "concurrent read at {o:#x}+{l:#x} saw another request's bytes"
                            );
                            None
                        }
                    }
                }));
            }
            for (r, t) in reqs.iter().zip(tasks) {
                let after = t.await.unwrap();
                match *r {
                    Req::Write(o, l, v) => model[o as usize..(o + l) as usize].fill(v),
                    Req::Zero(o, l, _) => model[o as usize..(o + l) as usize].fill(0),
                    Req::Discard(o, l) => {
                        let now = after.unwrap();
                        for (i, (&m, &n)) in model[o as usize..(o + l) as usize]
                            .iter()
                            .zip(&now)
                            .enumerate()
                        {
                            assert!(
                                m == n || n == 0,
                                "{name}: discard changed byte {i} to {n:#x}"
                            );
                        }
                        model[o as usize..(o + l) as usize].copy_from_slice(&now);
                    }
                    Req::Read(..) => {}
                }
            }
            if b % 10 == 9 {
                img.flush().await.unwrap();
            }
            let all = img.read(GuestOffset(0), size as usize).await.unwrap();
            assert_same_bytes(&all, &model, &format!("{name}: after batch {b}"));
        }
        img.close().await.unwrap();
    });
    let out = std::process::Command::new("qemu-img")
        .args(["check", path.to_str().unwrap()])
        .output()
        .expect("run qemu-img (install qemu-utils)");
    assert!(
        out.status.success(),
        "{name}: qemu-img check: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_same_bytes(
        &qemu_contents(&path, &[]),
        &model,
        &format!("{name}: QEMU's view"),
    );
}

#[test]
fn concurrent_requests_standard_l2() {
    campaign("64k standard", 65536, false, false, 60);
}

#[test]
fn concurrent_requests_extended_l2_over_backing() {
    campaign("64k extended over backing", 65536, true, true, 60);
}

#[test]
fn concurrent_requests_small_clusters_over_backing() {
    campaign("4k standard over backing", 4096, false, true, 60);
}
