//! Model-based proptest: random sequences of write / write-zeroes / discard / flush, with
//! offsets and lengths across cluster and subcluster edges, on images with and without a
//! backing file, extended L2 on and off, several cluster sizes. After every step the image
//! equals a byte model; at the end `qemu-img check` finds no error and `qemu-img compare`
//! finds no difference from the model.

use proptest::prelude::*;
use qcow2::engine::{create, CreateOptions, Format, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{IoBuf, MemFs, MemStorage};
use test_support::{run, Dir};

const SIZE: u64 = 2 << 20;

#[derive(Clone, Debug)]
enum Op {
    Write(u64, u64, u8, bool),
    Zero(u64, u64, bool),
    Discard(u64, u64),
    Flush,
}

fn op(unit: u64) -> impl Strategy<Value = Op> {
    let at = (0..SIZE / unit, prop_oneof![Just(0i64), -700i64..700])
        .prop_map(move |(k, j)| ((k * unit) as i64 + j).clamp(0, SIZE as i64 - 1) as u64);
    let len = prop_oneof![1u64..600, Just(unit), 1..unit * 3];
    (at, len, 0u8..10, any::<u8>(), any::<bool>()).prop_map(|(off, len, kind, byte, flag)| {
        let len = len.clamp(1, SIZE - off);
        match kind {
            0..=5 => Op::Write(off, len, byte | 1, flag && byte % 4 == 0),
            6 | 7 => Op::Zero(off, len, flag),
            8 => Op::Discard(off, len),
            _ => Op::Flush,
        }
    })
}

fn base_bytes() -> Vec<u8> {
    (0..SIZE).map(|i| (i / 700 % 200) as u8 + 7).collect()
}

fn run_case(cs: u64, ext: bool, backing: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let fs = MemFs::new();
    let top = Path::new("/t/top.qcow2");
    let mut model = if backing {
        base_bytes()
    } else {
        vec![0u8; SIZE as usize]
    };
    run(async {
        let mem = MemStorage::new();
        let opts = CreateOptions {
            size: SIZE,
            cluster_size: cs,
            extended_l2: ext,
            backing: backing.then(|| ("base.raw".into(), Format::Raw)),
            ..CreateOptions::default()
        };
        create(&mem, &opts).await.unwrap();
        fs.insert(top, mem);
        fs.insert("/t/base.raw", MemStorage::from_bytes(&base_bytes()));
        let img = Image::open(&fs, top, &OpenOptions::default())
            .await
            .unwrap();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Write(o, l, b, fua) => {
                    let (r, _) = img
                        .write(GuestOffset(o), IoBuf::from_slice(&vec![b; l as usize]), fua)
                        .await;
                    r.unwrap();
                    model[o as usize..(o + l) as usize].fill(b);
                }
                Op::Zero(o, l, unmap) => {
                    img.write_zeroes(GuestOffset(o), l, unmap, false)
                        .await
                        .unwrap();
                    model[o as usize..(o + l) as usize].fill(0);
                }
                Op::Discard(o, l) => {
                    img.discard(GuestOffset(o), l).await.unwrap();
                    let now = img.read(GuestOffset(o), l as usize).await.unwrap();
                    for (&m, &n) in model[o as usize..(o + l) as usize].iter().zip(now.iter()) {
                        prop_assert!(m == n || n == 0, "step {i}: discard exposed other data");
                    }
                    model[o as usize..(o + l) as usize].copy_from_slice(&now);
                }
                Op::Flush => img.flush().await.unwrap(),
            }
            let all = img.read(GuestOffset(0), SIZE as usize).await.unwrap();
            prop_assert!(
                all[..] == model[..],
                "step {i} ({op:?}): image differs from the model"
            );
        }
        img.close().await.unwrap();
        Ok(())
    })?;
    let d = Dir::new();
    std::fs::write(d.path("top.qcow2"), fs.get(top).unwrap().to_vec()).unwrap();
    std::fs::write(d.path("base.raw"), base_bytes()).unwrap();
    std::fs::write(d.path("model.raw"), &model).unwrap();
    let check = std::process::Command::new("qemu-img")
        .args(["check", &d.s("top.qcow2")])
        .output()
        .expect("run qemu-img (install qemu-utils)");
    prop_assert!(
        check.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&check.stdout)
    );
    let cmp = std::process::Command::new("qemu-img")
        .args([
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            &d.s("top.qcow2"),
            &d.s("model.raw"),
        ])
        .output()
        .unwrap();
    prop_assert!(
        cmp.status.success(),
        "qemu-img compare: {}",
        String::from_utf8_lossy(&cmp.stdout)
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn standard_64k(ops in proptest::collection::vec(op(65536), 1..40), backing in any::<bool>()) {
        run_case(65536, false, backing, &ops)?;
    }

    #[test]
    fn extended_64k(ops in proptest::collection::vec(op(2048), 1..40), backing in any::<bool>()) {
        run_case(65536, true, backing, &ops)?;
    }

    #[test]
    fn small_clusters(ops in proptest::collection::vec(op(512), 1..40), backing in any::<bool>()) {
        run_case(512, false, backing, &ops)?;
    }

    #[test]
    fn extended_16k(ops in proptest::collection::vec(op(512), 1..40), backing in any::<bool>()) {
        run_case(16384, true, backing, &ops)?;
    }
}
