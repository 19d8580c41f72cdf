//! `check` agrees with `qemu-img check` on every kind of image qemu-img makes: the same exit
//! code, the same counts, and byte-for-byte the same human and JSON output, without and with
//! repair (`-r leaks`, `-r all` change nothing on a consistent image).
//!
//! Needs qemu-img and qemu-io (Debian: qemu-utils).

use crate::common::{assert_agree, our_check, qemu_check};
use qcow2::check::Repair;
use test_support::{create_image, qemu_img, qemu_io, Dir};

/// Writes a pattern of data, zeros and discards over the first MiBs of an image.
fn scribble(path: &std::path::Path) {
    qemu_io(
        "qcow2",
        path,
        &[
            "write -P 0x11 0 300k",
            "write -P 0x22 1M 64k",
            "write -z 2M 128k",
            "write -P 0x33 3M 4k",
            "discard 1M 64k",
            "write -P 0x44 5M 1k",
        ],
    );
}

/// Our outputs must equal qemu-img's, character for character, for a consistent image.
fn assert_same_output(path: &std::path::Path) {
    let p = path.to_str().unwrap();
    let (r, _) = our_check(path, Repair::None);
    let ours = r.unwrap_or_else(|e| panic!("{p}: our check failed: {e}"));
    let human = qemu_check(path, Repair::None, false);
    assert_eq!(ours.to_human(), human.stdout, "{p}: human output differs");
    let json = qemu_check(path, Repair::None, true);
    assert_eq!(
        ours.report.to_json(p),
        json.stdout,
        "{p}: JSON output differs"
    );
}

/// Every check mode agrees on a consistent image, which none of them changes.
fn agree_everywhere(dir: &Dir, name: &str) {
    for repair in [Repair::None, Repair::Leaks, Repair::All] {
        let q = assert_agree(dir, name, repair);
        assert_eq!(
            q.code, 0,
            "{name}: qemu-img check -r {repair:?}: {}{}",
            q.stdout, q.stderr
        );
    }
    assert_same_output(&dir.path(name));
}

#[test]
fn clean_images_of_every_refcount_width_and_cluster_size() {
    let dir = Dir::new();
    let specs = [
        ("default", ""),
        ("c512-rc1", "cluster_size=512,refcount_bits=1"),
        ("c1k-rc2", "cluster_size=1024,refcount_bits=2"),
        ("c2k-rc4", "cluster_size=2048,refcount_bits=4"),
        ("c4k-rc8", "cluster_size=4096,refcount_bits=8"),
        ("c8k-rc32", "cluster_size=8192,refcount_bits=32"),
        ("c2m-rc64", "cluster_size=2M,refcount_bits=64"),
        ("v2", "compat=0.10,cluster_size=4096"),
        ("ext-l2", "cluster_size=32k,extended_l2=on"),
        ("prealloc-meta", "cluster_size=4096,preallocation=metadata"),
        ("prealloc-full", "cluster_size=65536,preallocation=full"),
    ];
    for (name, opts) in specs {
        create_image(&dir.path(name), "qcow2", opts, None, "8M");
        scribble(&dir.path(name));
        agree_everywhere(&dir, name);
    }
    // An empty image too (no L2 table at all).
    create_image(&dir.path("empty"), "qcow2", "", None, "1G");
    agree_everywhere(&dir, "empty");
}

#[test]
fn compressed_images_zlib_and_zstd() {
    let dir = Dir::new();
    create_image(&dir.path("src"), "qcow2", "cluster_size=4096", None, "8M");
    scribble(&dir.path("src"));
    for (name, opts) in [
        ("zlib", "cluster_size=4096"),
        ("zstd", "cluster_size=65536,compression_type=zstd"),
        ("zlib-512", "cluster_size=512"),
        ("zlib-ext", "cluster_size=16k,extended_l2=on"),
    ] {
        qemu_img(&[
            "convert",
            "-c",
            "-O",
            "qcow2",
            "-o",
            opts,
            &dir.s("src"),
            &dir.s(name),
        ]);
        // A partial overwrite leaves compressed and normal clusters side by side.
        qemu_io("qcow2", &dir.path(name), &["write -P 0x55 8k 4k"]);
        agree_everywhere(&dir, name);
    }
}

#[test]
fn extended_l2_subclusters_over_a_backing_file() {
    let dir = Dir::new();
    create_image(&dir.path("base"), "qcow2", "cluster_size=65536", None, "4M");
    qemu_io("qcow2", &dir.path("base"), &["write -P 0xaa 0 4M"]);
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base",
        "-F",
        "qcow2",
        "-o",
        "cluster_size=65536,extended_l2=on",
        &dir.s("top"),
    ]);
    qemu_io(
        "qcow2",
        &dir.path("top"),
        &[
            "write -P 1 2k 2k",
            "write -z 8k 6k",
            "write -P 2 64k 64k",
            "write -P 3 130k 1k",
            "write -z 200k 2k",
            "discard 64k 64k",
        ],
    );
    agree_everywhere(&dir, "top");
}

#[test]
fn internal_snapshots_shared_clusters_and_copied_flags() {
    let dir = Dir::new();
    let p = dir.path("snap");
    create_image(&p, "qcow2", "cluster_size=4096", None, "4M");
    qemu_io("qcow2", &p, &["write -P 1 0 256k"]);
    qemu_img(&["snapshot", "-c", "one", p.to_str().unwrap()]);
    qemu_io("qcow2", &p, &["write -P 2 64k 64k", "write -P 3 1M 64k"]);
    qemu_img(&["snapshot", "-c", "two", p.to_str().unwrap()]);
    qemu_io("qcow2", &p, &["write -P 4 0 8k", "discard 128k 64k"]);
    qemu_img(&["snapshot", "-d", "one", p.to_str().unwrap()]);
    agree_everywhere(&dir, "snap");
}

#[test]
fn persistent_bitmaps_and_external_data_files() {
    let dir = Dir::new();
    let p = dir.path("bitmaps");
    create_image(&p, "qcow2", "cluster_size=4096", None, "16M");
    qemu_io("qcow2", &p, &["write -P 1 0 1M"]);
    for name in ["b0", "b1"] {
        qemu_img(&["bitmap", "--add", "-g", "65536", p.to_str().unwrap(), name]);
    }
    // Writing through QEMU dirties the enabled bitmaps, which gives them data clusters.
    qemu_io("qcow2", &p, &["write -P 2 4M 2M"]);
    agree_everywhere(&dir, "bitmaps");

    let d = dir.path("data.qcow2");
    create_image(
        &d,
        "qcow2",
        &format!("data_file={},cluster_size=4096", dir.s("data.raw")),
        None,
        "8M",
    );
    scribble(&d);
    agree_everywhere(&dir, "data.qcow2");
}

#[test]
fn encrypted_images_are_checked_without_the_key() {
    let dir = Dir::new();
    let p = dir.s("luks");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        "secret,id=sec0,data=password",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,cluster_size=4096",
        &p,
        "1M",
    ]);
    let out = qemu_img(&[
        "check",
        "--output=json",
        "--object",
        "secret,id=sec0,data=password",
        "--image-opts",
        &format!("driver=qcow2,file.filename={p},encrypt.key-secret=sec0"),
    ]);
    let theirs = crate::common::parse_report(&out).expect("qemu-img check JSON");
    let (r, _) = our_check(&dir.path("luks"), Repair::None);
    assert_eq!(r.expect("our check").report, theirs);
}
