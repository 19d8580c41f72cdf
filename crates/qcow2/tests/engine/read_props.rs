//! Random reads (offsets and lengths across cluster and subcluster edges) through every
//! storage backend, compared with QEMU's raw view of the same chain.

use proptest::prelude::*;
use qcow2::engine::{Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use storage::{Aio, FileOpener, MemFs, MemStorage};
use test_support::{assert_same_bytes, qemu_contents, qemu_img, qemu_io, run, Dir};

const SIZE: u64 = 6 << 20;

struct Fixture {
    _dir: Dir,
    top: PathBuf,
    base: PathBuf,
    expected: Vec<u8>,
}

/// A two-layer chain with every kind of cluster: data, zeros, compressed, subclusters of all
/// three states, a backing file shorter than the image.
fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let d = Dir::new();
        let base = d.path("base.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=4k",
            base.to_str().unwrap(),
            "5M",
        ]);
        qemu_io(
            "qcow2",
            &base,
            &[
                "write -P 0x11 0 2M",
                "write -c -P 0x22 2M 64k",
                "write -z 1M 8k",
            ],
        );
        let top = d.path("top.qcow2");
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=64k,extended_l2=on",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            top.to_str().unwrap(),
            &SIZE.to_string(),
        ]);
        qemu_io(
            "qcow2",
            &top,
            &[
                "write -P 0x33 5000 7000",
                "write -z 70k 6k",
                "write -P 0x44 1M 130k",
                "write -P 0x55 4M 1M",
                "write -z -u 4200k 64k",
            ],
        );
        let expected = qemu_contents(&top, &[]);
        Fixture {
            _dir: d,
            top,
            base,
            expected,
        }
    })
}

fn check(img_read: impl std::future::Future<Output = Vec<u8>>, off: u64, len: u64, what: &str) {
    let f = fixture();
    let got = run(img_read);
    assert_same_bytes(
        &got,
        &f.expected[off as usize..(off + len) as usize],
        &format!("{what} at {off:#x}+{len:#x}"),
    );
}

async fn read_file(path: &Path, aio: Aio, direct: bool, off: u64, len: u64) -> Vec<u8> {
    let opts = OpenOptions {
        read_only: true,
        direct,
        ..OpenOptions::default()
    };
    let img = Image::open(
        &FileOpener {
            aio,
            direct,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        },
        path,
        &opts,
    )
    .await
    .unwrap();
    img.read(GuestOffset(off), len as usize)
        .await
        .unwrap()
        .to_vec()
}

async fn read_mem(top: &Path, base: &Path, off: u64, len: u64) -> Vec<u8> {
    let fs = MemFs::new();
    fs.insert(top, MemStorage::from_bytes(&std::fs::read(top).unwrap()));
    fs.insert(base, MemStorage::from_bytes(&std::fs::read(base).unwrap()));
    let opts = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let img = Image::open(&fs, top, &opts).await.unwrap();
    img.read(GuestOffset(off), len as usize)
        .await
        .unwrap()
        .to_vec()
}

/// Offsets near 512-byte, 2 KiB (subcluster), 4 KiB and 64 KiB edges, or anywhere.
fn range() -> impl Strategy<Value = (u64, u64)> {
    let edge = prop_oneof![Just(512u64), Just(2048), Just(4096), Just(65536)];
    (edge, 0..SIZE / 512, -600i64..600, 1u64..300_000).prop_map(|(unit, k, jitter, len)| {
        let off = ((k * 512 / unit * unit) as i64 + jitter).clamp(0, SIZE as i64 - 1) as u64;
        (off, len.min(SIZE - off))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn random_reads_match_qemu_on_every_backend((off, len) in range()) {
        let f = fixture();
        check(read_file(&f.top, Aio::IoUring, false, off, len), off, len, "io_uring");
        check(read_file(&f.top, Aio::Threads, false, off, len), off, len, "threads");
        check(read_file(&f.top, Aio::IoUring, true, off, len), off, len, "io_uring O_DIRECT");
        check(read_file(&f.top, Aio::Threads, true, off, len), off, len, "threads O_DIRECT");
        check(read_mem(&f.top, &f.base, off, len), off, len, "memory");
    }
}
