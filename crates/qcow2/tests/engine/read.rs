//! Read side against QEMU: every image qemu-img/qemu-io can make reads back through the engine
//! exactly as `qemu-img convert -O raw` reads it.

use crate::support::{open_ro, opener, read_all, read_all_sparse};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::Aio;
use test_support::{assert_same_bytes, qemu_contents, qemu_img, qemu_io, run, Dir};

/// Reads `img` with both backends and two request sizes and compares with QEMU.
fn check_image(img: &Path, what: &str) {
    let expected = qemu_contents(img, &[]);
    for aio in [Aio::IoUring, Aio::Threads] {
        run(async {
            let image = open_ro(img, aio).await;
            for chunk in [1 << 20, 12_345] {
                let ours = read_all(&image, chunk).await;
                assert_same_bytes(
                    &ours,
                    &expected,
                    &format!("{what} ({aio:?}, {chunk}-byte reads)"),
                );
                let (sparse, _) = read_all_sparse(&image, chunk).await;
                assert_same_bytes(
                    &sparse,
                    &expected,
                    &format!("{what} ({aio:?}, {chunk}-byte sparse reads)"),
                );
            }
        });
    }
}

/// Writes data, zeros and discards across cluster and subcluster edges.
fn scribble(img: &Path, cluster: u64) {
    let c = cluster;
    let cmds = [
        format!("write -P 0x11 0 {}", c * 2 + 512),
        format!("write -P 0x22 {} {}", c * 3 + 1024, 4096),
        format!("write -P 0x33 {} {}", c * 5 - 512, 1024),
        format!("write -z {} {}", c * 8, c),
        format!("write -P 0x44 {} {}", c * 9, c * 2),
        format!("write -z -u {} {}", c * 9 + c / 2, c),
        format!("discard {} {}", c * 10, c),
        format!("write -P 0x55 {} 512", c * 12 + c / 2 + 512),
    ];
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io("qcow2", img, &cmds);
}

/// A raw file's holes come back as holes from a sparse read, its data as data; a qcow2 layer's
/// data clusters are data even over a hole of its file.
#[test]
fn sparse_reads_report_raw_holes() {
    let d = Dir::new();
    let raw = d.path("sparse.raw");
    let f = std::fs::File::create(&raw).unwrap();
    f.set_len(8 << 20).unwrap();
    drop(f);
    qemu_io(
        "raw",
        &raw,
        &["write -P 0x5a 1M 64k", "write -P 0x5b 5M 4k"],
    );
    run(async {
        let opts = qcow2::engine::OpenOptions {
            read_only: true,
            format: Some(qcow2::engine::Format::Raw),
            ..Default::default()
        };
        let image = qcow2::engine::Image::open(&opener(Aio::IoUring), &raw, &opts)
            .await
            .unwrap();
        let (bytes, holes) = read_all_sparse(&image, 8 << 20).await;
        assert_same_bytes(&bytes, &qemu_contents(&raw, &[]), "sparse raw in one read");
        // Filesystems allocate in blocks of up to 64 KiB around the written bytes.
        assert!(
            holes >= (8 << 20) - (256 << 10),
            "only {holes} bytes of holes"
        );
        let parts = image.read_sparse(GuestOffset(1 << 20), 4096).await.unwrap();
        assert!(
            matches!(&parts[..], [qcow2::engine::ReadPart::Data(b)] if b.iter().all(|&x| x == 0x5a)),
            "written data not read as data: {parts:?}"
        );
    });
}

#[test]
fn cluster_sizes_and_extended_l2() {
    let d = Dir::new();
    for bits in [9u32, 12, 14, 16, 21] {
        for ext in [false, true] {
            if ext && bits < 14 {
                continue;
            }
            let cs = 1u64 << bits;
            let size = (cs * 16).max(1 << 20);
            let name = format!("c{bits}-{ext}.qcow2");
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
                &d.s(&name),
                &size.to_string(),
            ]);
            scribble(&d.path(&name), cs);
            check_image(&d.path(&name), &name);
        }
    }
}

#[test]
fn refcount_widths_and_compat_levels() {
    let d = Dir::new();
    for (opts, name) in [
        ("refcount_bits=1", "r1.qcow2"),
        ("refcount_bits=64", "r64.qcow2"),
        ("compat=0.10", "v2.qcow2"),
        ("lazy_refcounts=on", "lazy.qcow2"),
    ] {
        qemu_img(&["create", "-q", "-f", "qcow2", "-o", opts, &d.s(name), "4M"]);
        scribble(&d.path(name), 65536);
        check_image(&d.path(name), name);
    }
}

#[test]
fn compressed_zlib_and_zstd() {
    let d = Dir::new();
    let src = d.path("src.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", src.to_str().unwrap(), "6M"]);
    // Compressible patterns, a random-ish incompressible stretch and holes.
    qemu_io(
        "qcow2",
        &src,
        &[
            "write -P 0xaa 0 1M",
            "write -P 0x5c 1536k 300k",
            "write -z 2M 64k",
            "write -P 0x01 4M 2M",
        ],
    );
    for ct in ["zlib", "zstd"] {
        for cs in ["4k", "64k", "2M"] {
            let name = format!("c-{ct}-{cs}.qcow2");
            let opts = format!("compression_type={ct},cluster_size={cs}");
            qemu_img(&[
                "convert",
                "-c",
                "-O",
                "qcow2",
                "-o",
                &opts,
                src.to_str().unwrap(),
                &d.s(&name),
            ]);
            let map = qemu_img(&["map", "--output=json", &d.s(&name)]);
            assert!(
                map.contains("\"compressed\": true"),
                "{name} has no compressed cluster: {map}"
            );
            check_image(&d.path(&name), &name);
        }
    }
}

#[test]
fn backing_chain_raw_and_qcow2_with_short_backing() {
    let d = Dir::new();
    // raw base of 1.5 MiB (shorter than the image), qcow2 middle, extended-L2 top.
    std::fs::write(d.path("base.raw"), vec![0x77u8; 1536 * 1024]).unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        &d.s("base.raw"),
        "-F",
        "raw",
        &d.s("mid.qcow2"),
        "2M",
    ]);
    qemu_io(
        "qcow2",
        &d.path("mid.qcow2"),
        &["write -P 0x88 64k 64k", "write -z 256k 64k"],
    );
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on,cluster_size=64k",
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        &d.s("top.qcow2"),
        "4M",
    ]);
    // Mixed subclusters over the backing file: partial, whole, zero.
    qemu_io(
        "qcow2",
        &d.path("top.qcow2"),
        &[
            "write -P 0x99 70k 3k",
            "write -P 0x9a 128k 2k",
            "write -z 130k 4k",
            "write -P 0x9b 1500k 100k",
            "write -z 3M 8k",
        ],
    );
    check_image(&d.path("top.qcow2"), "three-layer chain");
}

#[test]
fn internal_snapshot_reads_as_qemu_reads_it() {
    let d = Dir::new();
    let img = d.path("snap.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "2M"]);
    qemu_io("qcow2", &img, &["write -P 0x10 0 1M"]);
    qemu_img(&["snapshot", "-c", "first", img.to_str().unwrap()]);
    qemu_io("qcow2", &img, &["write -P 0x20 512k 1M"]);
    let expected = qemu_contents(&img, &["-l", "first"]);
    run(async {
        for wanted in ["first", "1"] {
            let opts = qcow2::engine::OpenOptions {
                snapshot: Some(wanted.into()),
                ..Default::default()
            };
            let image = qcow2::engine::Image::open(&opener(Aio::Threads), &img, &opts)
                .await
                .unwrap();
            assert!(image.is_read_only());
            assert_same_bytes(&read_all(&image, 65536).await, &expected, wanted);
        }
    });
    check_image(&img, "active layer with a snapshot");
}

#[test]
fn external_data_file() {
    let d = Dir::new();
    for raw in ["on", "off"] {
        let img = d.path(&format!("df-{raw}.qcow2"));
        let opts = format!(
            "data_file={},data_file_raw={raw}",
            d.s(&format!("df-{raw}.data"))
        );
        qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &opts,
            img.to_str().unwrap(),
            "4M",
        ]);
        scribble(&img, 65536);
        check_image(&img, &format!("data file raw={raw}"));
    }
}

/// Per 512-byte sector: (data, zero, present, depth) from qemu-img map's JSON.
fn qemu_map(img: &Path) -> Vec<(bool, bool, bool, u64)> {
    let json = qemu_img(&["map", "--output=json", img.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let mut out = Vec::new();
    for e in v.as_array().unwrap() {
        let len = e["length"].as_u64().unwrap();
        let t = (
            e["data"].as_bool().unwrap(),
            e["zero"].as_bool().unwrap(),
            e["present"].as_bool().unwrap(),
            e["depth"].as_u64().unwrap(),
        );
        out.extend(std::iter::repeat_n(t, len.div_ceil(512) as usize));
    }
    out
}

fn check_map(img: &Path, what: &str) {
    let expected = qemu_map(img);
    run(async {
        let image = open_ro(img, Aio::Threads).await;
        let extents = image
            .block_status(GuestOffset(0), image.size())
            .await
            .unwrap();
        let mut ours = Vec::new();
        for e in extents {
            let t = (e.data, e.zero, e.present, e.depth as u64);
            ours.extend(std::iter::repeat_n(t, e.len.div_ceil(512) as usize));
        }
        assert_eq!(ours.len(), expected.len(), "{what}: lengths");
        if let Some(i) = ours.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!(
                "{what}: sector {i} (byte {:#x}): ours (data, zero, present, depth) = {:?}, qemu-img map says {:?}",
                i * 512,
                ours[i],
                expected[i]
            );
        }
    });
}

#[test]
fn block_status_agrees_with_qemu_img_map() {
    let d = Dir::new();
    let mut base = vec![0u8; 1536 * 1024];
    base[..300 * 1024].fill(0x77);
    std::fs::write(d.path("base.raw"), &base).unwrap();
    // A hole in the middle of the raw file.
    qemu_img(&["create", "-q", "-f", "raw", &d.s("sparse.raw"), "1M"]);
    qemu_io(
        "raw",
        &d.path("sparse.raw"),
        &["write -P 1 0 64k", "write -P 2 512k 64k"],
    );
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        &d.s("sparse.raw"),
        "-F",
        "raw",
        &d.s("mid.qcow2"),
        "2M",
    ]);
    qemu_io(
        "qcow2",
        &d.path("mid.qcow2"),
        &["write -P 0x88 64k 64k", "write -z 256k 64k"],
    );
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on",
        "-b",
        &d.s("mid.qcow2"),
        "-F",
        "qcow2",
        &d.s("top.qcow2"),
        "4M",
    ]);
    qemu_io(
        "qcow2",
        &d.path("top.qcow2"),
        &[
            "write -P 0x99 70k 4k",
            "write -z 130k 4k",
            "write -P 0x9b 1500k 100k",
            "write -z 3M 8k",
        ],
    );
    check_map(&d.path("top.qcow2"), "chain over a sparse raw file");
    // Not falloc: whether ext4 reports its unwritten extents as data or as holes depends on
    // page-cache state at the moment of asking, for QEMU and for us alike.
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "preallocation=metadata",
        &d.s("prealloc-metadata.qcow2"),
        "1M",
    ]);
    check_map(&d.path("prealloc-metadata.qcow2"), "preallocation=metadata");
    run(async {
        // Its data clusters lie over holes of the file: a sparse read sends them as holes.
        let image = open_ro(&d.path("prealloc-metadata.qcow2"), Aio::IoUring).await;
        let (bytes, holes) = read_all_sparse(&image, 1 << 20).await;
        assert!(bytes.iter().all(|&b| b == 0));
        assert_eq!(holes, 1 << 20, "preallocated clusters were sent as data");
    });
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        &d.s("mid.qcow2"),
        &d.s("comp.qcow2"),
    ]);
    check_map(&d.path("comp.qcow2"), "compressed");
}
