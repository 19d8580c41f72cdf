//! `qcow2-nbd create` against `qemu-img create`: every variant passes `qemu-img check`,
//! `qemu-img info` shows the requested options exactly as for qemu-img's own image (and,
//! without preallocation, the files are byte-identical), the "Formatting" line, `-o help`
//! and the error messages match qemu-img's in substance, raw images are sparse.

use crate::common::BIN;
use serde_json::Value;
use test_support::Dir;

/// The `qemu-img info` fields that describe how an image was created.
fn created_as(d: &Dir, image: &str) -> Value {
    let i = d.info(image);
    serde_json::json!({
        "virtual-size": i["virtual-size"],
        "cluster-size": i["cluster-size"],
        "format": i["format"],
        "format-specific": i["format-specific"],
        "backing-filename": i["backing-filename"],
        "backing-filename-format": i["backing-filename-format"],
        "full-backing-filename": i["full-backing-filename"],
        "dirty-flag": i["dirty-flag"],
    })
}

/// Creates `name` with `args` through both tools (ours as `name`, QEMU's as `q-name`), and
/// compares them.
fn both(d: &Dir, args: &[&str], name: &str, size: Option<&str>, identical_bytes: bool) {
    let qname = name.rsplit_once('/').map_or_else(
        || format!("q-{name}"),
        |(dir, file)| format!("{dir}/q-{file}"),
    );
    let mut ours: Vec<&str> = vec!["create"];
    ours.extend(args);
    ours.push(name);
    let mut theirs = ours.clone();
    *theirs.last_mut().expect("name") = &qname;
    // qemu-img's default format is raw, ours qcow2.
    if !args.contains(&"-f") {
        theirs.splice(1..1, ["-f", "qcow2"]);
    }
    ours.extend(size);
    theirs.extend(size);
    let out_ours = d.ok(BIN, &ours);
    let out_qemu = d.qemu_img(&theirs);
    assert_eq!(
        out_ours,
        out_qemu.replace(&qname, name),
        "Formatting line of {args:?}"
    );
    let raw = args.windows(2).any(|w| w == ["-f", "raw"]);
    if !raw {
        d.assert_check_clean(name);
    }
    let (a, b) = (created_as(d, name), created_as(d, &qname));
    let b: Value = serde_json::from_str(&b.to_string().replace(&qname, name)).expect("json");
    assert_eq!(a, b, "qemu-img info of {args:?}");
    if identical_bytes {
        assert!(
            d.read(name) == d.read(&qname),
            "{args:?}: our file differs from qemu-img's"
        );
    }
}

#[test]
fn qcow2_variants_match_qemu_img() {
    let d = Dir::new();
    let cases: &[(&[&str], &str)] = &[
        (&[], "1G"),
        (&["-f", "qcow2"], "1000"),
        (&["-o", "cluster_size=512"], "100M"),
        (&["-o", "cluster_size=4k"], "1.5G"),
        (&["-o", "cluster_size=2M"], "10T"),
        (&["-o", "extended_l2=on,cluster_size=128k"], "1T"),
        (&["-o", "extended_l2=on", "-o", "cluster_size=16k"], "64M"),
        (&["-o", "refcount_bits=1"], "1G"),
        (&["-o", "refcount_bits=8"], "1G"),
        (&["-o", "refcount_bits=64"], "1G"),
        (&["-o", "compat=0.10"], "1G"),
        (&["-o", "compat=v2"], "1G"),
        (&["-o", "compat=v3"], "1G"),
        (&["-o", "compression_type=zstd"], "1G"),
        (&["-o", "lazy_refcounts=on"], "1G"),
        (&["-o", "size=3M"], ""),
        (&["-o", "cluster_size=64k,cluster_size=1M"], "8G"),
        (&[], "1P"),
        (&[], "0"),
    ];
    for (i, (args, size)) in cases.iter().enumerate() {
        let size = (!size.is_empty()).then_some(*size);
        // With clusters of 4 KiB and less qemu-img leaves out the feature name table (the
        // engine writes it; both are valid), so only those files differ.
        // For an empty disk qemu-img writes no L1 table offset at all.
        let identical = !args
            .iter()
            .any(|a| *a == "cluster_size=512" || *a == "cluster_size=4k")
            && size != Some("0");
        both(&d, args, &format!("v{i}.qcow2"), size, identical);
    }
}

#[test]
fn preallocation_variants() {
    let d = Dir::new();
    for mode in ["metadata", "falloc", "full"] {
        let opt = format!("preallocation={mode}");
        let name = format!("{mode}.qcow2");
        both(&d, &["-o", &opt], &name, Some("64M"), false);
        let map = d.qemu_img(&["map", "--output=json", &name]);
        let runs = crate::common::parse_map(&map);
        assert!(
            runs.iter().all(|r| r.present),
            "{mode}: every cluster is allocated: {map}"
        );
        let du = d.disk_usage(&name);
        if mode == "metadata" {
            assert!(du < 8 << 20, "{mode}: {du} bytes on disk");
        } else {
            assert!(du >= 64 << 20, "{mode}: only {du} bytes on disk");
        }
    }
}

#[test]
fn backing_files() {
    let d = Dir::new();
    d.qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "5M"]);
    d.qemu_io("qcow2", "base.qcow2", &["write -P 0x11 0 5M"]);
    d.qemu_img(&["create", "-q", "-f", "raw", "base.raw", "3M"]);
    // The size defaults to the backing file's.
    both(
        &d,
        &["-b", "base.qcow2", "-F", "qcow2"],
        "t1.qcow2",
        None,
        true,
    );
    assert_eq!(d.info("t1.qcow2")["virtual-size"], 5 << 20);
    both(
        &d,
        &["-b", "base.raw", "-F", "raw"],
        "t2.qcow2",
        Some("8M"),
        true,
    );
    both(
        &d,
        &["-o", "backing_file=base.qcow2,backing_fmt=qcow2"],
        "t3.qcow2",
        None,
        true,
    );
    both(
        &d,
        &[
            "-o",
            "extended_l2=on,cluster_size=32k",
            "-b",
            "t1.qcow2",
            "-F",
            "qcow2",
        ],
        "t4.qcow2",
        Some("6M"),
        true,
    );
    // Preallocation with a backing file, which QEMU allows with extended L2 entries: the
    // clusters are reserved, the subclusters stay unallocated and read from the backing file.
    both(
        &d,
        &[
            "-o",
            "preallocation=metadata,extended_l2=on",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
        ],
        "t5.qcow2",
        None,
        false,
    );
    d.assert_same_contents("t5.qcow2", "qcow2", "base.qcow2", "qcow2");
    // A relative name is relative to the new image's directory.
    std::fs::create_dir(d.path("sub")).expect("mkdir");
    d.qemu_img(&["create", "-q", "-f", "qcow2", "sub/inner.qcow2", "2M"]);
    both(
        &d,
        &["-b", "inner.qcow2", "-F", "qcow2"],
        "sub/t6.qcow2",
        None,
        true,
    );
    assert_eq!(d.info("sub/t6.qcow2")["virtual-size"], 2 << 20);
    // -u: the backing file is not opened, so the size must be given; it exists here (with
    // another size) only so that qemu-img check can open the image.
    d.qemu_img(&["create", "-q", "-f", "qcow2", "later.qcow2", "7M"]);
    both(
        &d,
        &["-u", "-b", "later.qcow2", "-F", "qcow2"],
        "t7.qcow2",
        Some("1M"),
        true,
    );
    assert_eq!(d.info("t7.qcow2")["virtual-size"], 1 << 20);
}

#[test]
fn raw_images_are_sparse() {
    let d = Dir::new();
    both(&d, &["-f", "raw"], "a.raw", Some("1000"), true);
    assert_eq!(d.read("a.raw").len(), 1024);
    both(&d, &["-f", "raw"], "b.raw", Some("1G"), false);
    assert_eq!(
        std::fs::metadata(d.path("b.raw")).expect("stat").len(),
        1 << 30
    );
    assert!(d.disk_usage("b.raw") < 1 << 20, "a sparse raw file");
    for mode in ["falloc", "full"] {
        let name = format!("{mode}.raw");
        both(
            &d,
            &["-f", "raw", "-o", &format!("preallocation={mode}")],
            &name,
            Some("8M"),
            true,
        );
        assert!(d.disk_usage(&name) >= 8 << 20, "{mode}: allocated");
    }
}

#[test]
fn option_help_is_qemu_img_s() {
    let d = Dir::new();
    for fmt in ["qcow2", "raw"] {
        // Without a file name, the format's options and a note; with one, the file
        // protocol's options too (preallocation for raw, extent_size_hint, nocow).
        for args in [
            &["create", "-f", fmt, "-o", "help"][..],
            &["create", "-f", fmt, "-o", "help", "x"],
        ] {
            assert_eq!(d.ok(BIN, args), d.qemu_img(args), "{args:?}");
        }
        // `?` asks for the same thing, anywhere in the list.
        assert_eq!(
            d.ok(BIN, &["create", "-f", fmt, "-o", "size=1M,?"]),
            d.ok(BIN, &["create", "-f", fmt, "-o", "help"])
        );
    }
}

#[test]
fn errors_match_qemu_img() {
    let d = Dir::new();
    d.qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]);
    let cases: &[&[&str]] = &[
        &["-o", "cluster_size=1000", "x.qcow2", "1M"],
        &["-o", "cluster_size=4M", "x.qcow2", "1M"],
        &["-o", "cluster_size=abc", "x.qcow2", "1M"],
        &["-o", "foo=bar", "x.qcow2", "1M"],
        &["-o", "=4k", "x.qcow2", "1M"],
        &["-o", ",cluster_size=4k", "x.qcow2", "1M"],
        &["-o", "cluster_size=4k,", "x.qcow2", "1M"],
        &["-o", "extended_l2=maybe", "x.qcow2", "1M"],
        &["-o", "lazy_refcounts=ON", "x.qcow2", "1M"],
        &["-o", "compat=0.9", "x.qcow2", "1M"],
        &["-o", "refcount_bits=3", "x.qcow2", "1M"],
        &["-o", "refcount_bits=128", "x.qcow2", "1M"],
        &["-o", "refcount_bits=abc", "x.qcow2", "1M"],
        &["-o", "compression_type=lz4", "x.qcow2", "1M"],
        &["-o", "preallocation=yes", "x.qcow2", "1M"],
        &["-o", "compat=0.10,extended_l2=on", "x.qcow2", "1M"],
        &["-o", "compat=0.10,lazy_refcounts=on", "x.qcow2", "1M"],
        &["-o", "compat=0.10,refcount_bits=8", "x.qcow2", "1M"],
        &["-o", "compat=0.10,compression_type=zstd", "x.qcow2", "1M"],
        &["-o", "cluster_size=4k,extended_l2=on", "x.qcow2", "1M"],
        &[
            "-o",
            "preallocation=metadata",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "x.qcow2",
        ],
        &["-o", "size=2M", "x.qcow2", "3M"],
        &["-o", "cluster_size=512", "x.qcow2", "1P"],
        &["-b", "base.qcow2", "x.qcow2"],
        &["-F", "qcow2", "x.qcow2", "1M"],
        &["-b", "nonexistent.qcow2", "-F", "qcow2", "x.qcow2", "1M"],
        &["-u", "-b", "nonexistent.qcow2", "-F", "qcow2", "x.qcow2"],
        &["-b", "x.qcow2", "-F", "qcow2", "x.qcow2", "1M"],
        &["x.qcow2"],
        &["x.qcow2", "1Q"],
        &["x.qcow2", "100E"],
        &["-f", "raw", "-o", "cluster_size=64k", "x.raw", "1M"],
        &["-f", "raw", "-o", "preallocation=metadata", "x.raw", "1M"],
    ];
    for args in cases {
        let mut full = vec!["create", "-q"];
        if !args.contains(&"-f") {
            full.extend(["-f", "qcow2"]);
        }
        full.extend(*args);
        let q = d.run("qemu-img", &full);
        let o = d.run(BIN, &full);
        let qerr = String::from_utf8_lossy(&q.stderr);
        let oerr = String::from_utf8_lossy(&o.stderr);
        assert!(!q.status.success(), "{args:?}: qemu-img accepted it");
        assert!(!o.status.success(), "{args:?}: we accepted it");
        // qemu-img's first line, without its "qemu-img: " and "FILE: " prefixes.
        let first = qerr.lines().next().unwrap_or_default();
        let msg = first.strip_prefix("qemu-img: ").unwrap_or(first);
        let msg = msg.split_once("x.qcow2: ").map_or(msg, |(_, m)| m);
        let msg = msg.split_once("x.raw: ").map_or(msg, |(_, m)| m);
        assert!(
            oerr.contains(msg),
            "{args:?}:\n  qemu-img: {qerr}\n  ours:     {oerr}"
        );
        assert!(oerr.starts_with("qcow2-nbd: "), "{oerr}");
    }
}
