//! Interop both ways: QEMU (`qemu-io`) writes into images `qcow2-nbd create` made, and our
//! engine writes into images `qemu-img create` made, the same random operations in both
//! directions (writes across cluster and subcluster edges, zeroes with and without unmap,
//! cluster-aligned discards, compressed cluster writes). Afterwards `qemu-img check` is clean
//! and `qemu-img compare` finds the image equal to a raw model of the operations; our
//! `convert -O raw` of it equals the model too.

use qcow2::format::GuestOffset;
use std::path::Path;

use crate::common::BIN;
use qcow2::engine::{Format, Image, OpenOptions};
use storage::{Aio, FileOpener, IoBuf};
use test_support::{assert_same_bytes, Dir, Rng};

/// One guest operation.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// `len` bytes of `byte` at `off`.
    Write { off: u64, len: u64, byte: u8 },
    /// Zeroes, optionally letting the clusters go.
    Zero { off: u64, len: u64, unmap: bool },
    /// A discard of whole clusters (whose contents then read as zeros).
    Discard { off: u64, len: u64 },
    /// One whole cluster of `byte`, compressed, into a cluster not yet written.
    Compressed { off: u64, byte: u8 },
}

/// What an image looks like and what may be done to it.
struct Setup {
    name: &'static str,
    /// `create` options (both tools).
    opts: &'static [&'static str],
    size: u64,
    cluster_size: u64,
    /// Backing file: "qcow2" or "raw", filled with data.
    backing: Option<&'static str>,
    /// Discards read as zeros afterwards (not with compat=0.10 over a backing file).
    discard: bool,
}

const SETUPS: &[Setup] = &[
    Setup {
        name: "default",
        opts: &[],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "c4k",
        opts: &["-o", "cluster_size=4k"],
        size: 8 << 20,
        cluster_size: 4096,
        backing: None,
        discard: true,
    },
    Setup {
        name: "c2m",
        opts: &["-o", "cluster_size=2M"],
        size: 32 << 20,
        cluster_size: 2 << 20,
        backing: None,
        discard: true,
    },
    Setup {
        name: "ext128k",
        opts: &["-o", "extended_l2=on,cluster_size=128k"],
        size: 16 << 20,
        cluster_size: 128 << 10,
        backing: None,
        discard: true,
    },
    Setup {
        name: "ext64k_over_qcow2",
        opts: &["-o", "extended_l2=on"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: Some("qcow2"),
        discard: true,
    },
    Setup {
        name: "over_raw",
        opts: &[],
        size: 16 << 20,
        cluster_size: 65536,
        backing: Some("raw"),
        discard: true,
    },
    Setup {
        name: "v2",
        opts: &["-o", "compat=0.10"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "v2_over_qcow2",
        opts: &["-o", "compat=0.10"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: Some("qcow2"),
        discard: false,
    },
    Setup {
        name: "refcount1",
        opts: &["-o", "refcount_bits=1"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "refcount64_lazy",
        opts: &["-o", "refcount_bits=64,lazy_refcounts=on"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "zstd",
        opts: &["-o", "compression_type=zstd"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "prealloc_metadata",
        opts: &["-o", "preallocation=metadata"],
        size: 16 << 20,
        cluster_size: 65536,
        backing: None,
        discard: true,
    },
    Setup {
        name: "prealloc_full_ext",
        opts: &["-o", "preallocation=full,extended_l2=on,cluster_size=32k"],
        size: 8 << 20,
        cluster_size: 32 << 10,
        backing: None,
        discard: true,
    },
];

/// Random operations: first a few compressed clusters (they must land in clusters nothing
/// was written to), then writes, zeroes and discards with offsets near cluster and
/// subcluster edges.
fn operations(seed: u64, s: &Setup) -> Vec<Op> {
    let mut rng = Rng(seed);
    let (size, cs) = (s.size, s.cluster_size);
    let clusters = size / cs;
    let mut ops = Vec::new();
    let preallocated = s.opts.iter().any(|o| o.contains("preallocation"));
    if !preallocated {
        let mut used = Vec::new();
        for _ in 0..4 {
            let c = rng.below(clusters);
            if !used.contains(&c) {
                used.push(c);
                ops.push(Op::Compressed {
                    off: c * cs,
                    byte: 0x40u8.wrapping_add(c as u8),
                });
            }
        }
    }
    let unit = cs / 32; // a subcluster with extended L2 entries
    for i in 0..64u64 {
        let off = match rng.below(3) {
            0 => rng.below(size),
            // Near a subcluster or cluster edge.
            1 => (rng.below(size / unit) * unit)
                .saturating_sub(rng.below(3) * 512)
                .min(size - 1),
            _ => (rng.below(clusters) * cs + rng.below(2) * (cs - 700)).min(size - 1),
        };
        let max = (size - off).min(3 * cs).min(512 << 10);
        let len = 1 + rng.below(max);
        let op = match rng.below(10) {
            0..=5 => Op::Write {
                off,
                len,
                byte: (i as u8).wrapping_mul(37) | 1,
            },
            6 | 7 => Op::Zero {
                off,
                len,
                unmap: rng.below(2) == 1,
            },
            _ if s.discard => {
                let c = rng.below(clusters);
                let n = (1 + rng.below(3)).min(clusters - c);
                Op::Discard {
                    off: c * cs,
                    len: n * cs,
                }
            }
            _ => Op::Zero {
                off,
                len,
                unmap: true,
            },
        };
        ops.push(op);
    }
    ops
}

/// What the guest reads after `ops`, starting from `initial`.
fn model(initial: &[u8], ops: &[Op], cs: u64) -> Vec<u8> {
    let mut m = initial.to_vec();
    for op in ops {
        let (off, len, byte) = match *op {
            Op::Write { off, len, byte } => (off, len, byte),
            Op::Zero { off, len, .. } | Op::Discard { off, len } => (off, len, 0),
            Op::Compressed { off, byte } => (off, cs, byte),
        };
        m[off as usize..(off + len) as usize].fill(byte);
    }
    m
}

/// The operations as a qemu-io script.
fn script(ops: &[Op], cs: u64) -> String {
    let mut s = String::new();
    for op in ops {
        let line = match *op {
            Op::Write { off, len, byte } => format!("write -P {byte} {off} {len}"),
            Op::Zero {
                off,
                len,
                unmap: false,
            } => format!("write -z {off} {len}"),
            Op::Zero {
                off,
                len,
                unmap: true,
            } => format!("write -z -u {off} {len}"),
            Op::Discard { off, len } => format!("discard {off} {len}"),
            Op::Compressed { off, byte } => format!("write -c -P {byte} {off} {cs}"),
        };
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// Applies the operations through our engine, one after another, then closes the image.
fn apply_ours(path: &Path, ops: &[Op], cs: u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::IoUring,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        };
        let opts = OpenOptions {
            format: Some(Format::Qcow2),
            ..OpenOptions::default()
        };
        let img = Image::open(&opener, path, &opts)
            .await
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        for op in ops {
            let res = match *op {
                Op::Write { off, len, byte } => {
                    img.write(
                        GuestOffset(off),
                        IoBuf::from_slice(&vec![byte; len as usize]),
                        false,
                    )
                    .await
                    .0
                }
                Op::Zero { off, len, unmap } => {
                    img.write_zeroes(GuestOffset(off), len, unmap, false).await
                }
                Op::Discard { off, len } => img.discard(GuestOffset(off), len).await,
                Op::Compressed { off, byte } => {
                    img.write_compressed(
                        GuestOffset(off),
                        IoBuf::from_slice(&vec![byte; cs as usize]),
                    )
                    .await
                }
            };
            res.unwrap_or_else(|e| panic!("{op:?} on {}: {e}", path.display()));
        }
        img.close().await.expect("close");
    });
}

/// Creates the backing file of `s`, if any, and returns the guest's initial contents.
fn prepare(d: &Dir, s: &Setup) -> Vec<u8> {
    match s.backing {
        None => vec![0; s.size as usize],
        Some("raw") => {
            let mut data = Rng(77).bytes(s.size as usize);
            data[..4096].fill(0);
            std::fs::write(d.path("base"), &data).expect("write base");
            data
        }
        Some(_) => {
            d.qemu_img(&["create", "-q", "-f", "qcow2", "base", &s.size.to_string()]);
            d.qemu_io(
                "qcow2",
                "base",
                &[&format!("write -P 0xbb 0 {}", s.size), "write -z 1M 64k"],
            );
            let mut data = vec![0xbb; s.size as usize];
            data[1 << 20..(1 << 20) + 65536].fill(0);
            data
        }
    }
}

/// `create` arguments for `s` (without the tool's own `-f`).
fn create_args<'a>(s: &'a Setup, image: &'a str, size: &'a str) -> Vec<&'a str> {
    let mut a: Vec<&str> = s.opts.to_vec();
    if let Some(fmt) = s.backing {
        a.extend(["-b", "base", "-F", fmt]);
    }
    a.extend([image, size]);
    a
}

/// Checks `image` against the model: qemu-img check and compare, and our own reading.
fn verify(d: &Dir, image: &str, expected: &[u8], what: &str) {
    d.assert_check_clean(image);
    std::fs::write(d.path("model.raw"), expected).expect("write model");
    d.assert_same_contents("model.raw", "raw", image, "qcow2");
    let ours = format!("{image}.ours.raw");
    d.ok(BIN, &["convert", "-O", "raw", image, &ours]);
    assert_same_bytes(&d.read(&ours), expected, what);
}

#[test]
fn qemu_writes_into_images_we_create() {
    for (k, s) in SETUPS.iter().enumerate() {
        let d = Dir::new();
        let initial = prepare(&d, s);
        let size = s.size.to_string();
        let mut args = vec!["create", "-q"];
        args.extend(create_args(s, "img.qcow2", &size));
        d.ok(BIN, &args);
        let ops = operations(1000 + k as u64, s);
        d.qemu_io_script("qcow2", "img.qcow2", &script(&ops, s.cluster_size));
        verify(
            &d,
            "img.qcow2",
            &model(&initial, &ops, s.cluster_size),
            s.name,
        );
    }
}

#[test]
fn we_write_into_images_qemu_img_creates() {
    for (k, s) in SETUPS.iter().enumerate() {
        let d = Dir::new();
        let initial = prepare(&d, s);
        let size = s.size.to_string();
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        args.extend(create_args(s, "img.qcow2", &size));
        d.qemu_img(&args);
        let ops = operations(2000 + k as u64, s);
        apply_ours(&d.path("img.qcow2"), &ops, s.cluster_size);
        verify(
            &d,
            "img.qcow2",
            &model(&initial, &ops, s.cluster_size),
            s.name,
        );
    }
}

#[test]
fn both_tools_write_one_image_in_turns() {
    // Ours creates, QEMU writes, we write, QEMU writes again: each side reads the other's
    // metadata (L2 tables, refcounts, compressed clusters) and extends it.
    for (k, s) in SETUPS.iter().enumerate() {
        let d = Dir::new();
        let initial = prepare(&d, s);
        let size = s.size.to_string();
        let mut args = vec!["create", "-q"];
        args.extend(create_args(s, "img.qcow2", &size));
        d.ok(BIN, &args);
        let all = operations(3000 + k as u64, s);
        // Compressed writes need untouched clusters: they all go first, from QEMU.
        let (first, rest) = all.split_at(all.len() - 64 + 20);
        let (second, third) = rest.split_at(22);
        d.qemu_io_script("qcow2", "img.qcow2", &script(first, s.cluster_size));
        apply_ours(&d.path("img.qcow2"), second, s.cluster_size);
        d.assert_check_clean("img.qcow2");
        d.qemu_io_script("qcow2", "img.qcow2", &script(third, s.cluster_size));
        verify(
            &d,
            "img.qcow2",
            &model(&initial, &all, s.cluster_size),
            s.name,
        );
    }
}
