//! Backing chains of depth 1, 3 and 300 (raw base, qcow2 layers of several geometries,
//! extended L2 and compressed clusters, data at every depth): reads, block status and writes
//! on top agree with QEMU; the merged backing map answers deep chains without walking them.

use crate::support::{open_ro, opener, read_all, read_all_sparse, FaultFs};
use qcow2::engine::ReadPart;
use qcow2::engine::{create_file, CreateOptions, Format, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::PathBuf;
use storage::{Aio, FaultStorage, InjectedError, IoBuf, MemStorage, OpKind};
use test_support::{assert_same_bytes, qemu_contents, qemu_img, qemu_io, run, Dir};

const SIZE: u64 = 32 << 20;

/// One layer's writes.
enum W {
    Data(u64, u64, u8),
    Zero(u64, u64),
    Compressed(u64, u64, u8),
}

/// Builds a chain of `depth` layers over a raw base; layer k writes its own stretch, a
/// stretch shared with its neighbours, and (sometimes) zeros or compressed data. With
/// `qemu`, qemu-img and qemu-io make every layer; otherwise our engine does (a 300-layer
/// chain made by QEMU costs 600 process launches).
fn build_chain(d: &Dir, depth: usize, qemu: bool) -> PathBuf {
    let base = d.path("base.raw");
    let mut raw = vec![0u8; (SIZE - (1 << 20)) as usize]; // shorter than the disk
    for (i, b) in raw.iter_mut().enumerate() {
        if (i / 65536) % 3 != 0 {
            *b = (i / 65536 % 250) as u8 + 1;
        }
    }
    std::fs::write(&base, &raw).unwrap();
    let mut below = ("base.raw".to_string(), Format::Raw);
    let mut top = base;
    for k in 0..depth {
        let name = format!("l{k}.qcow2");
        let (cs, ext) = match k % 4 {
            0 => (65536, false),
            1 => (32768, true),
            2 => (4096, false),
            _ => (131072, true),
        };
        let own = (k as u64 * 97 * 1024) % (SIZE - (256 << 10));
        let shared = (k as u64 % 7) * (3 << 20) + 5000;
        let mut writes = Vec::new();
        if k % 6 == 3 {
            // A compressed cluster first (QEMU compresses only into unallocated clusters); the
            // writes below may then copy-on-write out of it.
            writes.push(W::Compressed(
                (k as u64 % 9) * (1 << 20),
                cs,
                (k % 200 + 3) as u8,
            ));
        }
        writes.push(W::Data(own, 20 << 10, (k % 250 + 1) as u8));
        writes.push(W::Data(shared, 3000, ((k * 7) % 250 + 1) as u8));
        if k % 5 == 0 {
            writes.push(W::Zero((k as u64 * 131072) % (SIZE - (1 << 20)), 65536));
        }
        let p = d.path(&name);
        if qemu {
            let fmt = if below.1 == Format::Raw {
                "raw"
            } else {
                "qcow2"
            };
            let opts = format!(
                "cluster_size={cs},extended_l2={}",
                if ext { "on" } else { "off" }
            );
            qemu_img(&[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                &opts,
                "-b",
                &below.0,
                "-F",
                fmt,
                p.to_str().unwrap(),
                &SIZE.to_string(),
            ]);
            let cmds: Vec<String> = writes
                .iter()
                .map(|w| match *w {
                    W::Data(o, l, v) => format!("write -P {v} {o} {l}"),
                    W::Zero(o, l) => format!("write -z {o} {l}"),
                    W::Compressed(o, l, v) => format!("write -c -P {v} {o} {l}"),
                })
                .collect();
            let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
            qemu_io("qcow2", &p, &cmds);
        } else {
            let opts = CreateOptions {
                size: SIZE,
                cluster_size: cs,
                extended_l2: ext,
                backing: Some(below.clone()),
                ..CreateOptions::default()
            };
            run(async {
                create_file(&opener(Aio::Threads), &p, &opts).await.unwrap();
                let img = Image::open(&opener(Aio::Threads), &p, &OpenOptions::default())
                    .await
                    .unwrap();
                for w in &writes {
                    match *w {
                        W::Data(o, l, v) => img
                            .write(
                                GuestOffset(o),
                                IoBuf::from_slice(&vec![v; l as usize]),
                                false,
                            )
                            .await
                            .0
                            .unwrap(),
                        W::Zero(o, l) => img
                            .write_zeroes(GuestOffset(o), l, false, false)
                            .await
                            .unwrap(),
                        W::Compressed(o, l, v) => img
                            .write_compressed(
                                GuestOffset(o),
                                IoBuf::from_slice(&vec![v; l as usize]),
                            )
                            .await
                            .unwrap(),
                    }
                }
                img.close().await.unwrap();
            });
        }
        below = (name, Format::Qcow2);
        top = p;
    }
    top
}

fn check_chain(depth: usize, qemu: bool) {
    let d = Dir::new();
    let top = build_chain(&d, depth, qemu);
    let expected = qemu_contents(&top, &[]);
    run(async {
        let img = open_ro(&top, Aio::IoUring).await;
        assert_eq!(img.chain_len(), depth + 1);
        assert_same_bytes(
            &read_all(&img, 1 << 20).await,
            &expected,
            &format!("depth {depth}, 1 MiB reads"),
        );
        assert_same_bytes(
            &read_all(&img, 4096 + 512).await,
            &expected,
            &format!("depth {depth}, small reads"),
        );
        let (sparse, holes) = read_all_sparse(&img, 1 << 20).await;
        assert_same_bytes(
            &sparse,
            &expected,
            &format!("depth {depth}, sparse 1 MiB reads"),
        );
        assert!(
            holes > 0,
            "depth {depth}: the zero clusters were sent as data"
        );
        if depth >= 2 {
            let stats = img
                .backing_map_stats()
                .expect("deep chains use the backing map");
            assert!(stats.hits > 0, "the backing map was never used: {stats:?}");
        }
    });
    // Block status against qemu-img map, per 512-byte sector.
    let json = qemu_img(&["map", "--output=json", top.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let mut theirs = Vec::new();
    for e in v.as_array().unwrap() {
        let t = (
            e["data"].as_bool().unwrap(),
            e["zero"].as_bool().unwrap(),
            e["present"].as_bool().unwrap(),
            e["depth"].as_u64().unwrap(),
        );
        theirs.extend(std::iter::repeat_n(
            t,
            (e["length"].as_u64().unwrap() / 512) as usize,
        ));
    }
    run(async {
        let img = open_ro(&top, Aio::Threads).await;
        let mut ours = Vec::new();
        for e in img.block_status(GuestOffset(0), SIZE).await.unwrap() {
            let t = (e.data, e.zero, e.present, e.depth as u64);
            ours.extend(std::iter::repeat_n(t, (e.len / 512) as usize));
        }
        if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!(
                "depth {depth}: sector {i}: ours {:?}, qemu-img map {:?}",
                ours[i], theirs[i]
            );
        }
        assert_eq!(ours.len(), theirs.len());
    });
    // Writes on top of the chain: copy-on-write from deep layers.
    let overlay = d.path("overlay.qcow2");
    let top_name = top.file_name().unwrap().to_str().unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on",
        "-b",
        top_name,
        "-F",
        "qcow2",
        overlay.to_str().unwrap(),
    ]);
    let mut model = expected.clone();
    run(async {
        let img = Image::open(&opener(Aio::IoUring), &overlay, &OpenOptions::default())
            .await
            .unwrap();
        for k in 0..40u64 {
            let off = (k * 786_433) % (SIZE - 10_000);
            let len = 1000 + (k * 997) % 9000;
            model[off as usize..(off + len) as usize].fill(0xA0 + k as u8);
            let (r, _) = img
                .write(
                    GuestOffset(off),
                    IoBuf::from_slice(&vec![0xA0 + k as u8; len as usize]),
                    false,
                )
                .await;
            r.unwrap();
        }
        assert_same_bytes(
            &img.read(GuestOffset(0), SIZE as usize).await.unwrap(),
            &model,
            "after writes",
        );
        img.close().await.unwrap();
    });
    assert_same_bytes(
        &qemu_contents(&overlay, &[]),
        &model,
        &format!("depth {depth}: QEMU reading the overlay"),
    );
    qemu_img(&["check", overlay.to_str().unwrap()]);
}

#[test]
fn chain_depth_1() {
    check_chain(1, true);
}

#[test]
fn chain_depth_3() {
    check_chain(3, true);
}

/// Layers made by our engine, read and mapped by QEMU as well.
#[test]
fn chain_depth_300() {
    check_chain(300, false);
}

/// A read that fails anywhere under a deep chain (headers, L1 and L2 tables, the backing
/// map's concurrent slice reads, data) makes the open or the sparse read fail, and never
/// returns other bytes: in-memory copies of the chain's files where one file's n-th read
/// fails once.
#[test]
fn sparse_reads_through_a_chain_fail_cleanly_on_read_errors() {
    const DEPTH: usize = 5;
    let d = Dir::new();
    let top = build_chain(&d, DEPTH, false);
    let expected = qemu_contents(&top, &[]);
    let mut names = vec!["base.raw".to_string()];
    names.extend((0..DEPTH).map(|k| format!("l{k}.qcow2")));
    let files: Vec<Vec<u8>> = names
        .iter()
        .map(|n| std::fs::read(d.path(n)).unwrap())
        .collect();
    let (mut failed, mut clean) = (0, 0);
    for victim in 0..names.len() {
        for n in 1..=24u64 {
            let fs = FaultFs::default();
            for (i, name) in names.iter().enumerate() {
                let st = FaultStorage::from_mem(MemStorage::from_bytes(&files[i]));
                if i == victim {
                    st.fail_nth(OpKind::Read, n, InjectedError::Eio);
                }
                fs.0.borrow_mut().insert(d.path(name), st);
            }
            let outcome = run(async {
                let opts = OpenOptions {
                    read_only: true,
                    ..OpenOptions::default()
                };
                let img = Image::open(&fs, &top, &opts)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut bytes = Vec::new();
                for pos in (0..SIZE).step_by(1 << 20) {
                    let parts = img
                        .read_sparse(GuestOffset(pos), 1 << 20)
                        .await
                        .map_err(|e| e.to_string())?;
                    for part in parts {
                        match part {
                            ReadPart::Data(b) => bytes.extend_from_slice(&b),
                            ReadPart::Hole(len) => bytes.resize(bytes.len() + len, 0),
                        }
                    }
                }
                Ok::<_, String>(bytes)
            });
            match outcome {
                Ok(bytes) => {
                    let what = format!("{}: read {n} failed", names[victim]);
                    assert_same_bytes(&bytes, &expected, &what);
                    clean += 1;
                }
                Err(e) => {
                    assert!(e.contains("injected fault"), "unexpected error: {e}");
                    failed += 1;
                }
            }
        }
    }
    assert!(failed > 0, "no injected read failure reached the reader");
    assert!(
        clean > 0,
        "every case failed: the late reads are never reached"
    );
}
