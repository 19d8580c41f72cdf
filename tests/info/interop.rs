//! Interop matrix: images made by `qemu-img` across cluster sizes, extended L2, refcount
//! widths, compat levels, compression types, backing files, snapshots and bitmaps must give
//! the same `info --output=json` from us as from `qemu-img info --output=json`.
//!
//! Needs qemu-img (Debian: qemu-utils); fails with a clear message when it is missing.

use serde_json::Value;
use test_support::{qemu, Dir};

const BIN: &str = env!("CARGO_BIN_EXE_qcow2-nbd");

/// Lists every difference between two JSON values, by path.
fn differences(ours: &Value, qemu: &Value, path: &str, out: &mut Vec<String>) {
    match (ours, qemu) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get(k) {
                    Some(mine) => differences(mine, v, &format!("{path}/{k}"), out),
                    None => out.push(format!("{path}/{k}: missing from ours (qemu: {v})")),
                }
            }
            for k in a.keys().filter(|k| !b.contains_key(*k)) {
                out.push(format!("{path}/{k}: only in ours ({})", a[k]));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ if ours != qemu => out.push(format!("{path}: ours {ours} != qemu {qemu}")),
        _ => {}
    }
}

/// Compares both tools' JSON for `image` (with and without `--backing-chain`).
fn assert_same_info(dir: &Dir, image: &str, backing_chain: bool) {
    let mut qemu_args = vec!["info", "--output=json"];
    let mut our_args = vec!["info", "--output=json"];
    if backing_chain {
        qemu_args.push("--backing-chain");
        our_args.push("--backing-chain");
    }
    qemu_args.push(image);
    our_args.push(image);
    let qemu: Value = serde_json::from_str(&dir.qemu_img(&qemu_args)).expect("qemu-img JSON");
    let mine: Value = serde_json::from_str(&dir.ok(BIN, &our_args)).expect("our JSON");
    let mut diffs = Vec::new();
    differences(&mine, &qemu, "", &mut diffs);
    assert!(
        diffs.is_empty(),
        "{image}: info differs from qemu-img:\n{}",
        diffs.join("\n")
    );
}

#[test]
fn cluster_sizes_512b_to_2m_with_and_without_extended_l2() {
    let dir = Dir::new();
    for bits in 9..=21u32 {
        let size = 1u64 << bits;
        let plain = format!("plain-{bits}.qcow2");
        dir.create(
            &plain,
            "qcow2",
            &format!("cluster_size={size}"),
            None,
            "100M",
        );
        dir.qemu_io("qcow2", &plain, &["write -P 7 0 300k"]);
        assert_same_info(&dir, &plain, false);
        if bits >= 14 {
            let ext = format!("ext-{bits}.qcow2");
            dir.create(
                &ext,
                "qcow2",
                &format!("cluster_size={size},extended_l2=on"),
                None,
                "100M",
            );
            dir.qemu_io("qcow2", &ext, &["write -P 7 4k 300k"]);
            assert_same_info(&dir, &ext, false);
        }
    }
}

#[test]
fn refcount_widths_1_to_64_bits() {
    let dir = Dir::new();
    for order in 0..=6 {
        let bits = 1u32 << order;
        let name = format!("rc-{bits}.qcow2");
        dir.create(
            &name,
            "qcow2",
            &format!("refcount_bits={bits}"),
            None,
            "64M",
        );
        dir.qemu_io("qcow2", &name, &["write -P 1 0 128k"]);
        assert_same_info(&dir, &name, false);
    }
}

#[test]
fn compat_0_10_and_1_1_with_lazy_refcounts_and_zstd() {
    let dir = Dir::new();
    for (name, opts) in [
        ("v2.qcow2", "compat=0.10"),
        ("v2-small.qcow2", "compat=0.10,cluster_size=512"),
        ("v3.qcow2", "compat=1.1"),
        ("lazy.qcow2", "compat=1.1,lazy_refcounts=on"),
        ("zstd.qcow2", "compression_type=zstd"),
        (
            "zstd-ext.qcow2",
            "compression_type=zstd,extended_l2=on,cluster_size=128k",
        ),
        ("zlib.qcow2", "compression_type=zlib"),
    ] {
        dir.create(name, "qcow2", opts, None, "1G");
        assert_same_info(&dir, name, false);
    }
    // Compressed clusters written through qemu-img convert -c.
    dir.qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        "compression_type=zstd",
        "zstd.qcow2",
        "conv.qcow2",
    ]);
    assert_same_info(&dir, "conv.qcow2", false);
}

#[test]
fn backing_files_given_with_format() {
    let dir = Dir::new();
    dir.create("base.qcow2", "qcow2", "", None, "64M");
    dir.qemu_io("qcow2", "base.qcow2", &["write -P 3 0 1M"]);
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "mid.qcow2",
    ]);
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "mid.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    dir.qemu_io("qcow2", "top.qcow2", &["write -P 4 512k 64k"]);
    std::fs::write(dir.path("base.raw"), vec![0u8; 3 * 1024 * 1024 + 100]).unwrap();
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.raw",
        "-F",
        "raw",
        "over-raw.qcow2",
    ]);
    for image in ["top.qcow2", "mid.qcow2", "over-raw.qcow2"] {
        assert_same_info(&dir, image, false);
        assert_same_info(&dir, image, true);
    }
    // An absolute image path resolves the backing name against the image's directory.
    let abs = dir.path("top.qcow2");
    assert_same_info(&dir, abs.to_str().unwrap(), true);
}

#[test]
fn internal_snapshots() {
    let dir = Dir::new();
    dir.create("snap.qcow2", "qcow2", "", None, "64M");
    dir.qemu_io("qcow2", "snap.qcow2", &["write -P 1 0 256k"]);
    dir.qemu_img(&["snapshot", "-c", "first", "snap.qcow2"]);
    dir.qemu_io("qcow2", "snap.qcow2", &["write -P 2 0 64k"]);
    dir.qemu_img(&["snapshot", "-c", "second", "snap.qcow2"]);
    assert_same_info(&dir, "snap.qcow2", false);

    dir.create("snap-v2.qcow2", "qcow2", "compat=0.10", None, "64M");
    dir.qemu_img(&["snapshot", "-c", "old-style", "snap-v2.qcow2"]);
    assert_same_info(&dir, "snap-v2.qcow2", false);
}

#[test]
fn persistent_bitmaps() {
    let dir = Dir::new();
    dir.create("bm.qcow2", "qcow2", "", None, "64M");
    dir.qemu_img(&["bitmap", "--add", "bm.qcow2", "enabled"]);
    dir.qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        "1M",
        "--disable",
        "bm.qcow2",
        "disabled",
    ]);
    dir.qemu_io("qcow2", "bm.qcow2", &["write -P 9 0 2M"]);
    assert_same_info(&dir, "bm.qcow2", false);

    // A bitmap left in use (not saved cleanly) is shown with the in-use flag by both.
    let path = dir.path("bm.qcow2");
    let mut bytes = std::fs::read(&path).unwrap();
    let header = qcow2::format::Header::decode(&bytes).unwrap();
    let flags_at = header
        .bitmaps()
        .expect("bitmaps extension")
        .directory_offset as usize
        + 12;
    bytes[flags_at + 3] |= qcow2::format::bitmap::FLAG_IN_USE as u8;
    std::fs::write(&path, &bytes).unwrap();
    assert!(dir
        .ok(BIN, &["info", "--output=json", "bm.qcow2"])
        .contains("\"in-use\""));
    assert_same_info(&dir, "bm.qcow2", false);
}

#[test]
fn external_data_file() {
    let dir = Dir::new();
    dir.create(
        "df.qcow2",
        "qcow2",
        "data_file=df.raw,data_file_raw=on",
        None,
        "16M",
    );
    assert_same_info(&dir, "df.qcow2", false);
    dir.create("df2.qcow2", "qcow2", "data_file=df2.raw", None, "16M");
    assert_same_info(&dir, "df2.qcow2", false);
}

#[test]
fn everything_at_once() {
    let dir = Dir::new();
    dir.create("base.qcow2", "qcow2", "cluster_size=2M", None, "256M");
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "compression_type=zstd,extended_l2=on,lazy_refcounts=on,refcount_bits=4,cluster_size=32k",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "all.qcow2",
    ]);
    dir.qemu_io("qcow2", "all.qcow2", &["write -P 5 1k 100k"]);
    dir.qemu_img(&["snapshot", "-c", "s1", "all.qcow2"]);
    dir.qemu_img(&["bitmap", "--add", "-g", "512", "all.qcow2", "fine"]);
    assert_same_info(&dir, "all.qcow2", false);
    assert_same_info(&dir, "all.qcow2", true);
}

#[test]
fn human_output_matches_qemu_img_line_for_line() {
    let dir = Dir::new();
    dir.create(
        "base.qcow2",
        "qcow2",
        "compat=0.10,cluster_size=4096",
        None,
        "10M",
    );
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on,lazy_refcounts=on",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "h.qcow2",
    ]);
    dir.qemu_io("qcow2", "h.qcow2", &["write -P 1 0 3M"]);
    dir.qemu_img(&["bitmap", "--add", "h.qcow2", "one"]);
    dir.qemu_img(&["bitmap", "--add", "-g", "4M", "--disable", "h.qcow2", "two"]);
    dir.create(
        "d.qcow2",
        "qcow2",
        "data_file=d.raw,data_file_raw=on,compression_type=zstd",
        None,
        "3G",
    );
    for (image, chain) in [("h.qcow2", false), ("h.qcow2", true), ("d.qcow2", false)] {
        let mut args = vec!["info"];
        if chain {
            args.push("--backing-chain");
        }
        args.push(image);
        let qemu = dir.qemu_img(&args);
        let mine = dir.ok(BIN, &args);
        assert_eq!(
            mine, qemu,
            "{image} (backing chain: {chain}): human output differs"
        );
    }
}

#[test]
fn dirty_and_corrupt_flags() {
    let dir = Dir::new();
    dir.create("dirty.qcow2", "qcow2", "lazy_refcounts=on", None, "10M");
    // qemu-io's abort leaves the image as a crash would: dirty, refcounts not yet written.
    let _ = qemu("qemu-io")
        .args([
            "-f",
            "qcow2",
            "-c",
            "write 0 64k",
            "-c",
            "abort",
            "dirty.qcow2",
        ])
        .current_dir(dir.root())
        .output()
        .expect("run qemu-io");
    assert!(dir
        .ok(BIN, &["info", "--output=json", "dirty.qcow2"])
        .contains("\"dirty-flag\": true"));
    assert_same_info(&dir, "dirty.qcow2", false);

    dir.create("corrupt.qcow2", "qcow2", "", None, "10M");
    let path = dir.path("corrupt.qcow2");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[79] |= qcow2::format::features::INCOMPAT_CORRUPT as u8;
    std::fs::write(&path, &bytes).unwrap();
    assert!(dir
        .ok(BIN, &["info", "--output=json", "corrupt.qcow2"])
        .contains("\"corrupt\": true"));
    assert_same_info(&dir, "corrupt.qcow2", false);
}
