//! `qcow2-nbd convert -O qcow2 [-c] [-o ...]` from raw and qcow2 sources: every target passes
//! `qemu-img check`, `qemu-img compare` finds it identical to the source, `qemu-img info`
//! shows the requested options, exactly the clusters holding non-zero data are allocated
//! (never more than qemu-img allocates for the same conversion), and `-c` compresses.
//! Also: the progress bar, odd-sized raw sources and the error cases.

use crate::common::BIN;
use test_support::{assert_same_bytes, Dir, Rng};

/// A raw disk with random, zero, compressible and sparse-island regions (24 MiB + 512).
fn raw_source(d: &Dir, name: &str) -> Vec<u8> {
    let size = (24usize << 20) + 512;
    let mut rng = Rng(0x5eed);
    let mut data = vec![0u8; size];
    data[..2 << 20].copy_from_slice(&rng.bytes(2 << 20));
    let text = b"convert -O qcow2 keeps only what is not zero; ";
    for (i, b) in data[4 << 20..8 << 20].iter_mut().enumerate() {
        *b = text[i % text.len()];
    }
    for _ in 0..300 {
        let at = (8 << 20) + rng.below(12 << 20) as usize;
        let n = 1 + rng.below(9000) as usize;
        data[at..at + n].copy_from_slice(&rng.bytes(n));
    }
    let tail = size - 4096;
    data[tail..].copy_from_slice(&rng.bytes(4096));
    std::fs::write(d.path(name), &data).expect("write the raw source");
    data
}

/// A qcow2 chain (qcow2 base, extended-L2 top with zeros over base data); returns the guest
/// bytes as QEMU reads them.
fn qcow2_source(d: &Dir, name: &str) -> Vec<u8> {
    raw_source(d, "chain-base.raw");
    d.qemu_img(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=32k",
        "chain-base.raw",
        "chain-base.qcow2",
    ]);
    d.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "extended_l2=on",
        "-b",
        "chain-base.qcow2",
        "-F",
        "qcow2",
        name,
    ]);
    d.qemu_io(
        "qcow2",
        name,
        &[
            "write -z 0 1M",
            "write -P 0x5a 3M 5000",
            "write -z -u 4M 2M",
            "write -P 0x6b 20M 64k",
        ],
    );
    d.qemu_img(&["convert", "-O", "raw", name, &format!("{name}.raw")]);
    d.read(&format!("{name}.raw"))
}

/// Clusters of `cs` bytes that hold a non-zero byte.
fn nonzero_clusters(data: &[u8], cs: usize) -> u64 {
    data.chunks(cs)
        .filter(|c| c.iter().any(|&b| b != 0))
        .count() as u64
}

/// One conversion and every check on its result.
fn convert_and_check(
    d: &Dir,
    src: &str,
    src_fmt: &str,
    data: &[u8],
    opts: &[&str],
    compress: bool,
) {
    let tag =
        format!("{}{}", opts.join("_"), if compress { "-c" } else { "" }).replace(['=', ','], "_");
    let (ours, qemu) = (
        format!("{src}.{tag}.ours.qcow2"),
        format!("{src}.{tag}.qemu.qcow2"),
    );
    let mut args = vec!["convert", "-f", src_fmt, "-O", "qcow2"];
    if compress {
        args.push("-c");
    }
    for o in opts {
        args.extend(["-o", o]);
    }
    let mut ours_args = args.clone();
    ours_args.extend([src, ours.as_str()]);
    d.ok(BIN, &ours_args);
    args.extend([src, qemu.as_str()]);
    d.qemu_img(&args);

    d.assert_check_clean(&ours);
    d.assert_same_contents(src, src_fmt, &ours, "qcow2");

    let list = opts.join(",");
    let opt = |k: &str| {
        list.split(',')
            .filter_map(|kv| kv.split_once('='))
            .filter(|(key, _)| *key == k)
            .map(|(_, v)| v.to_string())
            .next_back()
    };
    let info = d.info(&ours);
    let sp = &info["format-specific"]["data"];
    let cs = info["cluster-size"].as_u64().expect("cluster-size");
    let want_cs = match opt("cluster_size").as_deref() {
        None => 65536,
        Some("4k") => 4096,
        Some("128k") => 128 << 10,
        Some("1M") => 1 << 20,
        Some("2M") => 2 << 20,
        Some(other) => panic!("add {other} to the table"),
    };
    assert_eq!(cs, want_cs, "{ours}: cluster size");
    let compat = opt("compat").unwrap_or_else(|| "1.1".into());
    assert_eq!(sp["compat"], compat.as_str(), "{ours}: compat");
    if compat == "1.1" {
        let codec = opt("compression_type").unwrap_or_else(|| "zlib".into());
        assert_eq!(
            sp["compression-type"],
            codec.as_str(),
            "{ours}: compression type"
        );
        let ext = opt("extended_l2").as_deref() == Some("on");
        assert_eq!(sp["extended-l2"], ext, "{ours}: extended L2");
        let lazy = opt("lazy_refcounts").as_deref() == Some("on");
        assert_eq!(sp["lazy-refcounts"], lazy, "{ours}: lazy refcounts");
        let bits: u64 = opt("refcount_bits").map_or(16, |b| b.parse().expect("refcount_bits"));
        assert_eq!(sp["refcount-bits"], bits, "{ours}: refcount bits");
    }

    // Exactly the clusters with data are allocated (all of them when preallocated), and
    // never more than qemu-img allocates.
    let (mine, theirs) = (d.check_json(&ours), d.check_json(&qemu));
    let allocated = mine["allocated-clusters"]
        .as_u64()
        .expect("allocated-clusters");
    let total = mine["total-clusters"].as_u64().expect("total-clusters");
    let expected = if opt("preallocation").is_some() {
        total
    } else {
        nonzero_clusters(data, cs as usize)
    };
    assert_eq!(allocated, expected, "{ours}: allocated clusters");
    assert!(
        allocated
            <= theirs["allocated-clusters"]
                .as_u64()
                .expect("qemu allocated"),
        "{ours}: more clusters than qemu-img allocates: {mine} vs {theirs}"
    );
    let compressed = mine["compressed-clusters"].as_u64().unwrap_or(0);
    if compress {
        // The text region compresses; random clusters may be stored plain, as QEMU does.
        assert!(compressed > 0, "{ours}: -c compressed nothing: {mine}");
        let size_ours = std::fs::metadata(d.path(&ours)).expect("stat").len();
        let size_qemu = std::fs::metadata(d.path(&qemu)).expect("stat").len();
        assert!(
            size_ours <= size_qemu + size_qemu / 20 + 65536,
            "{ours}: compressed image of {size_ours} bytes, qemu-img's {size_qemu}"
        );
    } else {
        assert_eq!(compressed, 0, "{ours}: compressed clusters without -c");
    }
    // And we read our own output back as QEMU does.
    let back = format!("{ours}.raw");
    d.ok(BIN, &["convert", "-O", "raw", &ours, &back]);
    assert_same_bytes(&d.read(&back)[..data.len()], data, &ours);
}

const MATRIX: &[(&[&str], bool)] = &[
    (&[], false),
    (&["cluster_size=4k"], false),
    (&["cluster_size=2M"], false),
    (&["cluster_size=128k,extended_l2=on"], false),
    (&["compat=0.10"], false),
    (&["refcount_bits=1", "lazy_refcounts=on"], false),
    (&["preallocation=metadata"], false),
    (&[], true),
    (&["compression_type=zstd"], true),
    (&["compression_type=zstd,cluster_size=4k"], true),
    (&["cluster_size=1M"], true),
];

#[test]
fn from_raw() {
    let d = Dir::new();
    let data = raw_source(&d, "src.raw");
    for (opts, compress) in MATRIX {
        convert_and_check(&d, "src.raw", "raw", &data, opts, *compress);
    }
}

#[test]
fn from_a_qcow2_chain() {
    let d = Dir::new();
    let data = qcow2_source(&d, "src.qcow2");
    for (opts, compress) in MATRIX {
        convert_and_check(&d, "src.qcow2", "qcow2", &data, opts, *compress);
    }
}

#[test]
fn odd_sized_raw_source() {
    let d = Dir::new();
    let mut data = Rng(9).bytes(1000);
    data[500..600].fill(0);
    std::fs::write(d.path("odd.raw"), &data).expect("write");
    for fmt in ["raw", "qcow2"] {
        let (o, q) = (format!("o.{fmt}"), format!("q.{fmt}"));
        d.ok(BIN, &["convert", "-f", "raw", "-O", fmt, "odd.raw", &o]);
        d.qemu_img(&["convert", "-f", "raw", "-O", fmt, "odd.raw", &q]);
        let (a, b) = (format!("{o}.check.raw"), format!("{q}.check.raw"));
        d.qemu_img(&["convert", "-f", fmt, "-O", "raw", &o, &a]);
        d.qemu_img(&["convert", "-f", fmt, "-O", "raw", &q, &b]);
        let ours = d.read(&a);
        assert_eq!(ours.len(), 1024, "{fmt}: QEMU rounds the size up to 512");
        assert_same_bytes(&ours, &d.read(&b), fmt);
    }
    d.ok(
        BIN,
        &[
            "convert", "-f", "raw", "-O", "qcow2", "-c", "odd.raw", "c.qcow2",
        ],
    );
    d.assert_check_clean("c.qcow2");
    d.assert_same_contents("odd.raw", "raw", "c.qcow2", "qcow2");
}

#[test]
fn progress_bar_only_when_asked_or_on_a_terminal() {
    let d = Dir::new();
    raw_source(&d, "src.raw");
    // -p: frames separated by carriage returns, ending at 100% and a newline.
    let out = d.run(BIN, &["convert", "-p", "-O", "qcow2", "src.raw", "p.qcow2"]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let frames: Vec<&str> = err.split('\r').filter(|f| !f.is_empty()).collect();
    assert!(frames.len() >= 2, "{err:?}");
    assert!(frames[0].ends_with("(0.00/100%)"), "{err:?}");
    assert!(
        frames
            .last()
            .is_some_and(|f| f.ends_with("(100.00/100%)\n")),
        "{err:?}"
    );
    // The percentages never go backwards.
    let pct: Vec<f64> = frames
        .iter()
        .map(|f| {
            let s = &f[f.rfind('(').expect("(") + 1..f.find("/100%").expect("/100%")];
            s.parse().expect("percentage")
        })
        .collect();
    assert!(pct.windows(2).all(|w| w[0] < w[1]), "{pct:?}");
    // stderr is a pipe here, not a terminal: no bar unless -p; never with -q.
    for args in [
        &["convert", "-O", "qcow2", "src.raw", "n.qcow2"][..],
        &["convert", "-p", "-q", "src.raw", "n.raw"],
    ] {
        let out = d.run(BIN, args);
        assert!(out.status.success());
        assert!(
            out.stderr.is_empty(),
            "{args:?}: {:?}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn errors_say_what_is_wrong() {
    let d = Dir::new();
    raw_source(&d, "src.raw");
    let fail = |args: &[&str], want: &str| {
        let out = d.run(BIN, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    };
    fail(
        &["convert", "-c", "-O", "raw", "src.raw", "x"],
        "Compression not supported for this file format",
    );
    fail(
        &["convert", "-O", "vmdk", "src.raw", "x"],
        "Unknown or unsupported file format 'vmdk'",
    );
    fail(
        &[
            "convert",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=3k",
            "src.raw",
            "x",
        ],
        "Cluster size must be a power of two",
    );
    fail(
        &["convert", "-O", "qcow2", "-o", "foo=1", "src.raw", "x"],
        "Invalid parameter 'foo'",
    );
    fail(
        &[
            "convert",
            "-O",
            "qcow2",
            "-o",
            "backing_file=src.raw",
            "src.raw",
            "x",
        ],
        "Use of backing file requires explicit backing format",
    );
    fail(
        &["convert", "-O", "raw", "missing.raw", "x"],
        "Could not open 'missing.raw'",
    );
    fail(
        &["convert", "-O", "raw", "src.raw", "src.raw"],
        "the same file",
    );
    fail(
        &["convert", "-l", "snap", "-f", "raw", "src.raw", "x"],
        "snapshots of a raw file",
    );
    // -o help lists the target's options, as qemu-img does, and creates nothing.
    let help = d.ok(
        BIN,
        &["convert", "-O", "qcow2", "-o", "help", "src.raw", "h.qcow2"],
    );
    assert!(help.starts_with("Supported options:\n") && help.contains("compression_type=<str>"));
    assert!(!d.path("h.qcow2").exists());
}

#[test]
fn out_of_order_and_deep_parallel_copies_are_still_exact() {
    let d = Dir::new();
    raw_source(&d, "src.raw");
    // -W lets requests write as they complete; with -c, 32 requests compress at once on
    // the blocking pool. Whatever the order, the target reads as the source and checks clean.
    for (i, extra) in [&["-W"][..], &["-W", "-c", "-m", "32"], &["-c", "-m", "1"]]
        .iter()
        .enumerate()
    {
        let out = format!("w{i}.qcow2");
        let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
        args.extend_from_slice(extra);
        args.extend(["src.raw", &out]);
        d.ok(BIN, &args);
        d.assert_check_clean(&out);
        d.assert_same_contents("src.raw", "raw", &out, "qcow2");
    }
}

#[test]
fn ordered_copies_allocate_the_target_in_guest_order() {
    let d = Dir::new();
    raw_source(&d, "src.raw");
    // Several requests copy at once, yet each allocates only after the one before it: the
    // target's data lies in guest order, as qemu-img lays it out without -W.
    d.ok(
        BIN,
        &[
            "convert", "-m", "16", "-f", "raw", "-O", "qcow2", "src.raw", "o.qcow2",
        ],
    );
    d.assert_check_clean("o.qcow2");
    d.assert_same_contents("src.raw", "raw", "o.qcow2", "qcow2");
    let map: Vec<serde_json::Value> =
        serde_json::from_str(&d.qemu_img(&["map", "--output=json", "o.qcow2"]))
            .expect("qemu-img map JSON");
    let offsets: Vec<u64> = map
        .iter()
        .filter(|e| e["data"] == true)
        .filter_map(|e| e["offset"].as_u64())
        .collect();
    assert!(offsets.len() > 10, "the source has many data extents");
    assert!(
        offsets.windows(2).all(|w| w[0] < w[1]),
        "host offsets follow guest order: {offsets:?}"
    );
}
