//! `qcow2-nbd compare` and `qcow2-nbd measure` side by side with `qemu-img compare` and
//! `qemu-img measure`, on the same images: standard and extended L2 entries, several cluster
//! sizes, a backing chain, compressed and zero clusters, persistent bitmaps, raw files. Both
//! must print the same lines and exit the same way; compare must leave the images untouched
//! and respect QEMU's image locks; what `convert` writes must fit in the measured size.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use test_support::{text, wait_until, Dir};

use crate::common::BIN;

/// Guest size of the test images.
const SIZE: &str = "4M";

/// The images both tools are run on: (file, format).
const IMAGES: &[(&str, &str)] = &[
    ("std64.qcow2", "qcow2"),
    ("ext32.qcow2", "qcow2"),
    ("small4k.qcow2", "qcow2"),
    ("top.qcow2", "qcow2"),
    ("sparse.qcow2", "qcow2"),
    ("plain.raw", "raw"),
];

/// Makes every image of [`IMAGES`] (and the chain's base): data, zero clusters and
/// subclusters, compressed clusters, discarded ranges, persistent bitmaps.
fn make_images(d: &Dir) {
    d.create("std64.qcow2", "qcow2", "", None, SIZE);
    d.qemu_io(
        "qcow2",
        "std64.qcow2",
        &[
            "write -P 0x11 0 1M",
            "write -z 1M 256k",
            "write -c -P 0x22 2M 64k",
            "write -P 0x33 3M 4k",
            "discard 3M 64k",
            "write -P 0x44 3584k 1000",
        ],
    );
    d.qemu_img(&["bitmap", "--add", "std64.qcow2", "b0"]);
    d.qemu_img(&[
        "bitmap",
        "--add",
        "-g",
        "1M",
        "std64.qcow2",
        "a-longer-name",
    ]);

    d.create(
        "ext32.qcow2",
        "qcow2",
        "extended_l2=on,cluster_size=32k",
        None,
        SIZE,
    );
    d.qemu_io(
        "qcow2",
        "ext32.qcow2",
        &[
            "write -P 0x55 0 1k",
            "write -P 0x56 7k 2k",
            "write -z 64k 3k",
            "write -c -P 0x57 1M 32k",
            "write -P 0x58 2M 300k",
            "write -z 2M 1k",
        ],
    );

    d.create("small4k.qcow2", "qcow2", "cluster_size=4k", None, SIZE);
    d.qemu_io(
        "qcow2",
        "small4k.qcow2",
        &[
            "write -P 0x61 0 10k",
            "write -P 0x62 1M 1M",
            "write -z 1536k 8k",
        ],
    );

    d.create("base.qcow2", "qcow2", "cluster_size=16k", None, SIZE);
    d.qemu_io(
        "qcow2",
        "base.qcow2",
        &["write -P 0x71 0 2M", "write -c -P 0x72 3M 16k"],
    );
    d.create(
        "top.qcow2",
        "qcow2",
        "extended_l2=on",
        Some(("base.qcow2", "qcow2")),
        SIZE,
    );
    d.qemu_io(
        "qcow2",
        "top.qcow2",
        &["write -z 0 4k", "write -P 0x73 512k 8k", "write -z 1M 64k"],
    );

    d.create("sparse.qcow2", "qcow2", "", None, SIZE);

    d.qemu_img(&["convert", "-O", "raw", "std64.qcow2", "plain.raw"]);
}

/// `tool ARGS` in the directory: exit code, stdout, stderr.
fn run(d: &Dir, tool: &str, args: &[&str]) -> (i32, String, String) {
    let out = if tool == "qemu-img" {
        test_support::qemu("qemu-img")
            .args(args)
            .current_dir(d.root())
            .output()
            .expect("run qemu-img")
    } else {
        d.run(BIN, args)
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `args` with both tools: same exit code and same stdout.
fn same(d: &Dir, args: &[&str]) -> (i32, String) {
    let (qc, qout, qerr) = run(d, "qemu-img", args);
    let (oc, oout, oerr) = run(d, BIN, args);
    assert_eq!(
        (qc, &qout),
        (oc, &oout),
        "{args:?}: qemu-img exits {qc} with\n{qout}{qerr}\nours exits {oc} with\n{oout}{oerr}"
    );
    (oc, oout)
}

/// Files that must not change while they are compared.
fn fingerprint(d: &Dir) -> Vec<Vec<u8>> {
    IMAGES
        .iter()
        .map(|(f, _)| *f)
        .chain(["base.qcow2"])
        .map(|f| d.read(f))
        .collect()
}

#[test]
fn compare_agrees_with_qemu_img() {
    let d = Dir::new();
    make_images(&d);
    // Variants of each image: a plain copy, the same content in another layout (raw, other
    // cluster sizes), one byte changed, a longer disk reading zeros or data past the end.
    for (img, fmt) in IMAGES {
        let stem = img.split('.').next().unwrap_or(img);
        let copy = format!("{stem}-copy.{fmt}");
        d.copy(img, &copy);
        let flat = format!("{stem}-flat.raw");
        d.qemu_img(&["convert", "-f", fmt, "-O", "raw", img, &flat]);
        let other = format!("{stem}-other.qcow2");
        d.qemu_img(&[
            "convert",
            "-f",
            fmt,
            "-O",
            "qcow2",
            "-o",
            "cluster_size=8k",
            img,
            &other,
        ]);
        let changed = format!("{stem}-changed.qcow2");
        d.copy(&other, &changed);
        d.qemu_io("qcow2", &changed, &["write -P 0xee 1048577 1"]);
        let longer = format!("{stem}-longer.qcow2");
        d.copy(&other, &longer);
        d.qemu_img(&["resize", "-q", &longer, "5M"]);
        let longer_data = format!("{stem}-longer-data.qcow2");
        d.copy(&longer, &longer_data);
        d.qemu_io("qcow2", &longer_data, &["write -P 0x01 4608k 512"]);
        let before = fingerprint(&d);
        let mut outcomes = Vec::new();
        for b in [&copy, &flat, &other, &changed, &longer, &longer_data] {
            for flags in [&[][..], &["-s"][..], &["-q"][..]] {
                let mut args = vec!["compare"];
                args.extend_from_slice(flags);
                args.extend_from_slice(&[img, b.as_str()]);
                outcomes.push(same(&d, &args).0);
                // The longer image first: the tail is checked from the other side.
                let mut swapped = vec!["compare"];
                swapped.extend_from_slice(flags);
                swapped.extend_from_slice(&[b.as_str(), img]);
                same(&d, &swapped);
            }
        }
        assert!(
            outcomes.contains(&0) && outcomes.contains(&1),
            "{img}: {outcomes:?}"
        );
        assert_eq!(before, fingerprint(&d), "compare changed an image");
    }
    // Formats given explicitly, and a wrong one: the qcow2 file read as raw differs.
    same(
        &d,
        &[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "std64.qcow2",
            "plain.raw",
        ],
    );
    same(
        &d,
        &["compare", "-F", "raw", "std64.qcow2", "std64-copy.qcow2"],
    );
    for (img, _) in IMAGES.iter().filter(|(_, fmt)| *fmt == "qcow2") {
        d.assert_check_clean(img);
    }
}

#[test]
fn compare_reports_the_first_difference_among_many() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "cluster_size=4k", None, "8M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 0x42 0 8M"]);
    d.copy("a.qcow2", "b.qcow2");
    // Differences in several chunks read concurrently: the lowest one is reported.
    d.qemu_io(
        "qcow2",
        "b.qcow2",
        &[
            "write -P 0x1 7M 1",
            "write -P 0x2 6000000 3",
            "write -P 0x3 4444444 1",
        ],
    );
    let (code, out) = same(&d, &["compare", "a.qcow2", "b.qcow2"]);
    assert_eq!(
        (code, out.as_str()),
        (1, "Content mismatch at offset 4444160!\n")
    );
}

#[test]
fn compare_exit_codes_for_errors() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "1M");
    let (code, _) = same(&d, &["compare", "a.qcow2", "missing.qcow2"]);
    assert_eq!(code, 2);
    let (code, _) = same(&d, &["compare", "missing.qcow2", "a.qcow2"]);
    assert_eq!(code, 2);
}

/// A `qemu-nbd` serving `image` read-write (it holds QEMU's write lock) until dropped.
struct Holder(std::process::Child);

impl Holder {
    fn start(d: &Dir, image: &str) -> Holder {
        let sock = d.path("holder.sock");
        let child = test_support::qemu("qemu-nbd")
            .args([
                "-k",
                sock.to_str().expect("UTF-8 path"),
                "-f",
                "qcow2",
                image,
            ])
            .current_dir(d.root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start qemu-nbd");
        wait_until(Duration::from_secs(10), "qemu-nbd's socket", || {
            sock.exists()
        });
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn compare_respects_image_locks() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "1M");
    d.copy("a.qcow2", "b.qcow2");
    let _holder = Holder::start(&d, "a.qcow2");
    let out: Output = d.run(BIN, &["compare", "a.qcow2", "b.qcow2"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("lock"), "{}", text(&out));
    same(&d, &["compare", "-U", "a.qcow2", "b.qcow2"]);
}

/// The `-o` sets of the measure matrix (empty: none given).
const OPTION_SETS: &[&str] = &[
    "",
    "cluster_size=4k",
    "cluster_size=2M",
    "extended_l2=on",
    "extended_l2=on,cluster_size=16k",
    "refcount_bits=1",
    "refcount_bits=64,cluster_size=512",
    "compat=0.10",
    "compat=0.10,extended_l2=on",
    "preallocation=metadata",
    "preallocation=falloc",
    "preallocation=full,cluster_size=8k",
    "backing_file=x.qcow2,backing_fmt=qcow2",
    "lazy_refcounts=on,compression_type=zstd,nocow=on",
    // Refused, with qemu-img's messages.
    "cluster_size=1000",
    "extended_l2=on,cluster_size=8k",
    "compat=v3",
    "compat=0.10,refcount_bits=8",
    "refcount_bits=3",
    "preallocation=sometimes",
    "no_such_option=1",
];

#[test]
fn measure_sizes_agree_with_qemu_img() {
    let d = Dir::new();
    for size in ["0", "1", "1000", "64k", "1G", "3T", "100T", "9E"] {
        for output in ["human", "json"] {
            let out = format!("--output={output}");
            same(&d, &["measure", "--size", size, &out]);
            for opts in OPTION_SETS {
                let mut args = vec!["measure", "--size", size, "-O", "qcow2", &out];
                if !opts.is_empty() {
                    args.extend_from_slice(&["-o", opts]);
                }
                same(&d, &args);
            }
        }
    }
    // Arguments refused the same way.
    same(&d, &["measure"]);
    same(&d, &["measure", "--size", "abc"]);
    same(&d, &["measure", "--size", "-1"]);
    same(&d, &["measure", "-O", "qcow2", "-o", "size=1G"]);
    same(
        &d,
        &["measure", "--size", "1G", "-O", "qcow2", "-o", "size=2G"],
    );
}

#[test]
fn measure_images_agrees_with_qemu_img_and_bounds_convert() {
    let d = Dir::new();
    make_images(&d);
    for (img, fmt) in IMAGES {
        for output in ["human", "json"] {
            let out = format!("--output={output}");
            same(&d, &["measure", &out, img]);
            same(&d, &["measure", &out, "-f", fmt, "-O", "raw", img]);
            for opts in ["", "cluster_size=4k", "extended_l2=on", "compat=0.10"] {
                let mut args = vec!["measure", &out, "-O", "qcow2", img];
                if !opts.is_empty() {
                    args.extend_from_slice(&["-o", opts]);
                }
                same(&d, &args);
            }
        }
        // Our convert fits in what we measured.
        for opts in ["cluster_size=65536", "cluster_size=4k", "extended_l2=on"] {
            let (_, text) = same(
                &d,
                &["measure", "--output=json", "-O", "qcow2", "-o", opts, img],
            );
            let json: serde_json::Value = serde_json::from_str(&text).expect("measure JSON");
            let required = json["required"].as_u64().expect("required");
            let target = format!("{img}-{opts}.qcow2");
            d.ok(
                BIN,
                &["convert", "-q", "-O", "qcow2", "-o", opts, img, &target],
            );
            d.assert_check_clean(&target);
            d.assert_same_contents(img, fmt, &target, "qcow2");
            let written = file_len(&d.path(&target));
            assert!(
                written <= required,
                "{img} -o {opts}: convert wrote {written} bytes, measure said {required}"
            );
        }
    }
    // The bitmaps line needs a v3 source and a v3 target; a chain is measured through its
    // top, whose bitmaps alone count.
    d.qemu_img(&["bitmap", "--add", "top.qcow2", "top-bitmap"]);
    same(&d, &["measure", "-O", "qcow2", "top.qcow2"]);
    same(
        &d,
        &["measure", "-O", "qcow2", "-o", "compat=0.10", "std64.qcow2"],
    );
    same(&d, &["measure", "--size", "1G", "-f", "qcow2"]);
    same(&d, &["measure", "--size", "1G", "std64.qcow2"]);
    same(&d, &["measure", "missing.qcow2"]);
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("stat {}: {e}", p.display()))
        .len()
}

#[test]
fn measure_of_a_snapshot_agrees_with_qemu_img() {
    let d = Dir::new();
    d.create("snap.qcow2", "qcow2", "", None, SIZE);
    d.qemu_io("qcow2", "snap.qcow2", &["write -P 0x1 0 1M"]);
    d.qemu_img(&["snapshot", "-c", "s1", "snap.qcow2"]);
    d.qemu_io("qcow2", "snap.qcow2", &["write -P 0x2 2M 2M"]);
    for l in ["s1", "snapshot.name=s1", "1"] {
        same(&d, &["measure", "-O", "qcow2", "-l", l, "snap.qcow2"]);
    }
    same(&d, &["measure", "-O", "qcow2", "snap.qcow2"]);
}
