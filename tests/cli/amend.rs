//! `qcow2-nbd amend` side by side with `qemu-img amend`: the same `-o` lists on two copies
//! of images QEMU made (64k and 4k clusters, extended L2, compat=0.10, a backing chain with
//! zero clusters, compressed clusters, lazy refcounts left dirty, persistent bitmaps,
//! internal snapshots, zstd) exit the same way with the same reason; ours pass `qemu-img
//! check`, read back identically and `qemu-img info` agrees on everything but sizes and
//! offsets on disk. Where we refuse deliberately (QEMU would leave leaked clusters), the
//! test says so.

use crate::common::{self, info_sans_offsets, reason, BIN};
use test_support::{text, Dir};

/// An image to amend.
struct Variant {
    name: &'static str,
    make: fn(&Dir, &str),
}

/// Data, zero clusters (allocated and not) and a compressed cluster.
fn fill(d: &Dir, img: &str) {
    d.qemu_io(
        "qcow2",
        img,
        &[
            "write -P 1 0 100k",
            "write -z 192k 128k",
            "write -P 2 1M 64k",
            "write -z 1M 64k",
            "write -c -P 3 2M 64k",
        ],
    );
}

fn plain(d: &Dir, img: &str, opts: &str) {
    d.create(img, "qcow2", opts, None, "4M");
    fill(d, img);
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "64k",
        make: |d, img| plain(d, img, ""),
    },
    Variant {
        name: "4k",
        make: |d, img| plain(d, img, "cluster_size=4k"),
    },
    Variant {
        name: "extl2",
        make: |d, img| plain(d, img, "extended_l2=on"),
    },
    Variant {
        name: "v2",
        make: |d, img| {
            d.create(img, "qcow2", "compat=0.10", None, "4M");
            d.qemu_io("qcow2", img, &["write -P 1 0 100k", "write -c -P 3 2M 64k"]);
        },
    },
    Variant {
        name: "backed",
        make: |d, img| {
            let base = format!("{img}.base");
            d.create(&base, "qcow2", "", None, "4M");
            d.qemu_io("qcow2", &base, &["write -P 9 0 4M"]);
            d.create(img, "qcow2", "", Some((&base, "qcow2")), "4M");
            fill(d, img);
        },
    },
    Variant {
        name: "lazy-dirty",
        make: |d, img| {
            plain(d, img, "lazy_refcounts=on");
            // What a crash leaves: writes done, the dirty bit still set.
            let out = d.run(
                "qemu-io",
                &["-f", "qcow2", "-c", "write -P 4 3M 64k", "-c", "abort", img],
            );
            assert!(!out.status.success(), "qemu-io abort");
        },
    },
    Variant {
        name: "bitmaps",
        make: |d, img| {
            plain(d, img, "");
            d.qemu_img(&["bitmap", "--add", img, "b"]);
            d.qemu_io("qcow2", img, &["write -P 6 128k 4k"]);
        },
    },
    Variant {
        name: "snapshot",
        make: |d, img| {
            plain(d, img, "");
            d.qemu_img(&["snapshot", "-c", "s1", img]);
            d.qemu_io("qcow2", img, &["write -P 7 3M 512k"]);
        },
    },
    Variant {
        // The snapshot and the active layer share their L2 table.
        name: "snapshot-shared",
        make: |d, img| {
            plain(d, img, "");
            d.qemu_img(&["snapshot", "-c", "s1", img]);
        },
    },
    Variant {
        // Zero clusters a snapshot keeps over a backing file: each needs a cluster of zeros.
        name: "snapshot-backed",
        make: |d, img| {
            let base = format!("{img}.base");
            d.create(&base, "qcow2", "", None, "4M");
            d.qemu_io("qcow2", &base, &["write -P 9 0 4M"]);
            d.create(img, "qcow2", "", Some((&base, "qcow2")), "4M");
            fill(d, img);
            d.qemu_img(&["snapshot", "-c", "s1", img]);
            d.qemu_img(&["snapshot", "-c", "s2", img]);
            d.qemu_io("qcow2", img, &["write -P 8 0 2M"]);
        },
    },
    Variant {
        name: "zstd",
        make: |d, img| {
            d.create(img, "qcow2", "compression_type=zstd", None, "4M");
            d.qemu_io("qcow2", img, &["write -P 1 0 100k", "write -z 1M 64k"]);
        },
    },
];

/// Cases where we refuse and QEMU goes ahead: (variant, case). A downgrade with bitmaps
/// (QEMU leaves them inconsistent and their clusters leaked).
const REFUSED_HERE: &[(&str, &str)] = &[("bitmaps", "downgrade")];

/// Runs `amend ARGS` (`{}` standing for the image) through both tools on fresh copies of
/// `v`, and compares everything the module doc lists.
fn side_by_side(d: &Dir, v: &Variant, case: &str, args: &[&str]) {
    let (theirs, ours) = (
        format!("{}-{case}-qemu.qcow2", v.name),
        format!("{}-{case}-ours.qcow2", v.name),
    );
    (v.make)(d, &theirs);
    d.copy(&theirs, &ours);
    let (qemu, us) = common::side_by_side(d, "amend", (&theirs, &ours), args);
    let what = format!("{} {case} {args:?}", v.name);
    if REFUSED_HERE.contains(&(v.name, case)) {
        assert!(qemu.status.success(), "{what}: QEMU goes ahead");
        assert_eq!(
            us.status.code(),
            Some(1),
            "{what}: we refuse\n{}",
            text(&us)
        );
        assert!(
            reason(&us.stderr).starts_with("Cannot downgrade"),
            "{what}: {}",
            text(&us)
        );
        // Refused before anything was written: only the bitmaps' in-use marks come and go.
        d.assert_check_clean(&ours);
        assert_eq!(d.info(&ours)["format-specific"]["data"]["compat"], "1.1");
        return;
    }
    assert_eq!(
        us.status.code(),
        qemu.status.code(),
        "{what}: exit status\nqemu: {}\nours: {}",
        text(&qemu),
        text(&us)
    );
    if !qemu.status.success() {
        assert_eq!(reason(&us.stderr), reason(&qemu.stderr), "{what}: reason");
    }
    d.assert_check_clean(&ours);
    d.assert_same_contents(&ours, "qcow2", &theirs, "qcow2");
    assert_eq!(
        info_sans_offsets(d, &ours),
        info_sans_offsets(d, &theirs),
        "{what}: qemu-img info (left ours, right QEMU's)"
    );
    assert_eq!(
        header_length(&d.read(&ours)),
        header_length(&d.read(&theirs)),
        "{what}: header_length"
    );
    // Every snapshot reads as it does after QEMU's amend.
    for name in snapshot_names(d, &theirs) {
        for img in [&ours, &theirs] {
            d.qemu_img(&["snapshot", "-a", &name, img]);
        }
        d.assert_same_contents(&ours, "qcow2", &theirs, "qcow2");
        d.assert_check_clean(&ours);
    }
}

/// A version 3 header's `header_length` field (`None` for version 2).
fn header_length(file: &[u8]) -> Option<u32> {
    let word = |at: usize| u32::from_be_bytes(file[at..at + 4].try_into().expect("4 bytes"));
    (word(4) == 3).then(|| word(100))
}

/// The names of an image's internal snapshots, as `qemu-img snapshot -l` lists them.
fn snapshot_names(d: &Dir, img: &str) -> Vec<String> {
    let info = d.info(img);
    info["snapshots"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn run_cases(cases: &[(&str, &[&str])]) {
    let d = Dir::new();
    for v in VARIANTS {
        for (case, args) in cases {
            side_by_side(&d, v, case, args);
        }
    }
}

#[test]
fn compat_changes_match_qemu_img() {
    run_cases(&[
        ("downgrade", &["-o", "compat=0.10", "{}"]),
        ("upgrade", &["-o", "compat=1.1", "{}"]),
        (
            "downgrade-lazy",
            &["-o", "compat=v2,lazy_refcounts=on", "{}"],
        ),
        ("bad-level", &["-o", "compat=2", "{}"]),
    ]);
}

#[test]
fn lazy_refcounts_size_and_backing_match_qemu_img() {
    run_cases(&[
        ("lazy-on", &["-o", "lazy_refcounts=on", "{}"]),
        ("lazy-off", &["-o", "lazy_refcounts=off", "{}"]),
        ("grow", &["-o", "size=6M", "{}"]),
        ("shrink", &["-o", "size=1M", "{}"]),
        ("backing", &["-o", "backing_file=other.qcow2", "{}"]),
        ("backing-fmt", &["-o", "backing_fmt=raw", "{}"]),
    ]);
}

#[test]
fn options_amend_cannot_change_are_refused_as_qemu_img_refuses_them() {
    run_cases(&[
        ("cluster-size", &["-o", "cluster_size=4k", "{}"]),
        ("extended-l2", &["-o", "extended_l2=on", "{}"]),
        ("encryption", &["-o", "encryption=on", "{}"]),
        ("unknown", &["-o", "bogus=1", "{}"]),
        ("refcount-width", &["-o", "refcount_bits=3", "{}"]),
        ("refcount-v2", &["-o", "refcount_bits=8,compat=0.10", "{}"]),
    ]);
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "4M");
    d.create("r.raw", "raw", "", None, "4M");
    for args in [
        &["amend", "a.qcow2"][..],
        &["amend", "-f", "raw", "-o", "size=1M", "r.raw"][..],
    ] {
        let (q, o) = (d.run("qemu-img", args), d.run(BIN, args));
        assert_eq!(o.status.code(), q.status.code(), "{args:?}: {}", text(&o));
        assert_eq!(reason(&o.stderr), reason(&q.stderr), "{args:?}");
    }
    let (q, o) = (
        d.run("qemu-img", &["amend", "-o", "help", "a.qcow2"]),
        d.run(BIN, &["amend", "-o", "help", "a.qcow2"]),
    );
    assert!(q.status.success() && o.status.success());
    let ours = String::from_utf8_lossy(&o.stdout);
    for opt in [
        "backing_file",
        "backing_fmt",
        "compat",
        "lazy_refcounts",
        "refcount_bits",
        "size",
    ] {
        assert!(ours.contains(&format!("  {opt}=")), "{opt} in {ours}");
    }
}

/// Images of other widths and sizes for the refcount width matrix, besides [`VARIANTS`].
const WIDTH_VARIANTS: &[Variant] = &[
    Variant {
        name: "512",
        make: |d, img| plain(d, img, "cluster_size=512"),
    },
    Variant {
        name: "rc1",
        make: |d, img| plain(d, img, "refcount_bits=1"),
    },
    Variant {
        name: "rc64",
        make: |d, img| plain(d, img, "refcount_bits=64"),
    },
    Variant {
        name: "snap3",
        make: three_snapshots,
    },
];

/// Three internal snapshots of data partly overwritten since: refcounts of 2 to 4.
fn three_snapshots(d: &Dir, img: &str) {
    plain(d, img, "cluster_size=4k");
    for (i, name) in ["s1", "s2", "s3"].iter().enumerate() {
        d.qemu_img(&["snapshot", "-c", name, img]);
        d.qemu_io(
            "qcow2",
            img,
            &[&format!("write -P {} {}k 8k", 10 + i, 64 * i)],
        );
    }
}

/// `refcount_bits=BITS` through both tools ([`side_by_side`]); where QEMU changed the
/// width, we also read QEMU's image as QEMU reads ours, and QEMU writes to ours cleanly.
fn width_case(d: &Dir, v: &Variant, bits: u32) {
    let case = format!("rc{bits}");
    let opt = format!("refcount_bits={bits}");
    side_by_side(d, v, &case, &["-o", &opt, "{}"]);
    let (theirs, ours) = (
        format!("{}-{case}-qemu.qcow2", v.name),
        format!("{}-{case}-ours.qcow2", v.name),
    );
    let width = |img: &str| d.info(img)["format-specific"]["data"]["refcount-bits"].clone();
    if width(&theirs) != bits {
        return;
    }
    assert_eq!(width(&ours), bits, "{} {case}", v.name);
    let out = d.run(BIN, &["compare", &ours, &theirs]);
    assert!(out.status.success(), "{} {case}: {}", v.name, text(&out));
    // Compressed writes go to clusters no variant allocated (QEMU refuses them elsewhere).
    let writes: &[&str] = &["write -P 8 1536k 200k", "write -c -P 9 3584k 64k"];
    d.qemu_io("qcow2", &ours, writes);
    d.assert_check_clean(&ours);
    d.qemu_io("qcow2", &theirs, writes);
    d.assert_same_contents(&ours, "qcow2", &theirs, "qcow2");
}

#[test]
fn refcount_width_changes_match_qemu_img() {
    let d = Dir::new();
    for v in VARIANTS.iter().chain(WIDTH_VARIANTS) {
        for bits in [1, 4, 64, 8, 16] {
            width_case(&d, v, bits);
        }
    }
}

#[test]
fn a_narrower_width_that_cannot_hold_a_refcount_is_refused_untouched() {
    let d = Dir::new();
    three_snapshots(&d, "q.qcow2");
    d.copy("q.qcow2", "o.qcow2");
    let before = d.read("o.qcow2");
    let args = |img: &'static str| ["amend", "-o", "refcount_bits=1", img];
    let (q, o) = (
        d.run("qemu-img", &args("q.qcow2")),
        d.run(BIN, &args("o.qcow2")),
    );
    assert_eq!((o.status.code(), q.status.code()), (Some(1), Some(1)));
    let why = reason(&o.stderr);
    assert!(
        why.starts_with("Cannot decrease refcount entry width to 1 bits: Cluster at offset 0x"),
        "{why}"
    );
    assert_eq!(why, reason(&q.stderr));
    assert!(
        d.read("o.qcow2") == before,
        "the image is byte for byte as before"
    );
}

#[test]
fn refcount_width_with_other_options_matches_qemu_img() {
    let d = Dir::new();
    for v in VARIANTS
        .iter()
        .chain(WIDTH_VARIANTS)
        .filter(|v| v.name.starts_with("rc"))
    {
        for (case, args) in [
            ("v2-16", &["-o", "compat=0.10,refcount_bits=16", "{}"][..]),
            ("v2-only", &["-o", "compat=0.10", "{}"]),
            ("grow-8", &["-o", "refcount_bits=8,size=6M", "{}"]),
            ("lazy-2", &["-o", "lazy_refcounts=on,refcount_bits=2", "{}"]),
        ] {
            side_by_side(&d, v, case, args);
        }
    }
    // An upgrade and a width only version 3 has, in one amend.
    let v = VARIANTS
        .iter()
        .find(|v| v.name == "v2")
        .expect("the v2 variant");
    side_by_side(&d, v, "v3-4", &["-o", "compat=1.1,refcount_bits=4", "{}"]);
}

/// The snapshot table of a qcow2 file: each entry's fixed part with its extra data, ID and
/// name, in order.
fn snapshot_entries(file: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let be = |at: usize, n: usize| {
        file[at..at + n]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    };
    let count = be(60, 4) as usize;
    let mut at = be(64, 8) as usize;
    let mut out = Vec::new();
    for _ in 0..count {
        let (ids, names, extra) = (be(at + 12, 2), be(at + 14, 2), be(at + 36, 4));
        let len = 40 + extra + ids + names;
        let entry = &file[at..at + len as usize];
        out.push((entry[..40].to_vec(), entry[40..].to_vec()));
        at += len.div_ceil(8) as usize * 8;
    }
    out
}

/// Writes `entries` (fixed part with its extra data size set, then extra data, ID, name) as
/// the snapshot table, in place.
fn put_snapshot_entries(path: &std::path::Path, entries: &[(Vec<u8>, Vec<u8>)]) {
    let mut file = std::fs::read(path).expect("read the image");
    let at = u64::from_be_bytes(file[64..72].try_into().expect("8 bytes")) as usize;
    let mut table = Vec::new();
    for (fixed, rest) in entries {
        table.extend_from_slice(fixed);
        table.extend_from_slice(rest);
        table.resize(table.len().div_ceil(8) * 8, 0);
    }
    file[at..at + table.len()].copy_from_slice(&table);
    std::fs::write(path, file).expect("write the image");
}

/// A compat=0.10 image whose snapshots have the extra data of older writers: none, the
/// 64-bit VM state size alone, and more than version 3 defines (kept as it is).
fn old_snapshots(d: &Dir) {
    d.create("v2.qcow2", "qcow2", "compat=0.10", None, "4M");
    d.qemu_io("qcow2", "v2.qcow2", &["write -P 0x21 0 64k"]);
    for sn in ["sn0", "sn1", "sn2"] {
        d.qemu_img(&["snapshot", "-c", sn, "v2.qcow2"]);
    }
    let path = d.path("v2.qcow2");
    let mut entries = snapshot_entries(&std::fs::read(&path).expect("read"));
    for (i, extra_len) in [(0usize, 0usize), (1, 50), (2, 8)] {
        let (fixed, rest) = &mut entries[i];
        let old_extra = u32::from_be_bytes(fixed[36..40].try_into().expect("4 bytes")) as usize;
        let names = rest.split_off(old_extra);
        let mut extra = rest.clone();
        extra.resize(extra_len, 0);
        if extra_len > 24 {
            extra[24..24 + 9].copy_from_slice(b"kept data");
        }
        fixed[36..40].copy_from_slice(&(extra_len as u32).to_be_bytes());
        *rest = [extra, names].concat();
    }
    put_snapshot_entries(&path, &entries);
}

#[test]
fn an_upgrade_completes_old_snapshot_entries_as_qemu_img_does() {
    let p = crate::qemu_img_options::Pair::new(old_snapshots);
    for d in [&p.qemu, &p.ours] {
        d.qemu_img(&["check", "v2.qcow2"]);
    }
    p.same(&["amend", "-o", "compat=1.1", "v2.qcow2"]);
    // The snapshots were taken once in each directory: their dates differ.
    let entries = |d: &Dir| {
        let mut e = snapshot_entries(&d.read("v2.qcow2"));
        for (fixed, _) in &mut e {
            fixed[16..24].fill(0);
        }
        e
    };
    let ours = entries(&p.ours);
    assert_eq!(ours, entries(&p.qemu), "snapshot tables after the upgrade");
    assert_eq!(ours.len(), 3);
    let extra_len = |i: usize| u32::from_be_bytes(ours[i].0[36..40].try_into().expect("4"));
    assert_eq!((extra_len(0), extra_len(1), extra_len(2)), (24, 50, 24));
    p.same(&["check", "v2.qcow2"]);
    // The dates differ by the setup's timing; the rest of each line must not.
    let (q, o) = p.run(&["snapshot", "-l", "v2.qcow2"]);
    let undated = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .map(|l| {
                l.split_whitespace()
                    .filter(|w| !w.contains([':', '-']) || *w == "--")
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(undated(&o.stdout), undated(&q.stdout), "snapshot -l");
    // Each snapshot still holds what it held.
    p.same(&["snapshot", "-a", "sn1", "v2.qcow2"]);
    p.ours.qemu_io("qcow2", "v2.qcow2", &["read -P 0x21 0 64k"]);
}

/// A downgrade refused for a snapshot of another size comes after the other changes, as in
/// QEMU: the new size asked for with it is kept.
#[test]
fn a_refused_downgrade_keeps_the_size_changed_before_it_as_qemu_img_does() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("s.qcow2", "qcow2", "", None, "64M");
        d.qemu_io("qcow2", "s.qcow2", &["write -P 5 1M 64k"]);
        d.qemu_img(&["snapshot", "-c", "s1", "s.qcow2"]);
        d.qemu_img(&["resize", "s.qcow2", "128M"]);
    });
    let out = p.same(&["amend", "-o", "compat=0.10,size=32M", "s.qcow2"]);
    assert!(!out.status.success(), "the downgrade is refused");
    for d in [&p.qemu, &p.ours] {
        let info = d.info("s.qcow2");
        assert_eq!(info["virtual-size"], 32 << 20, "the new size stays");
        assert_eq!(info["format-specific"]["data"]["compat"], "1.1");
        d.assert_check_clean("s.qcow2");
    }
}

/// `amend -p`: qemu-img's percentages, line for line, for a downgrade that walks the active
/// L1 table and a snapshot's.
#[test]
fn amend_progress_prints_qemu_img_percentages() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("big.qcow2", "qcow2", "", None, "4G");
        d.qemu_io(
            "qcow2",
            "big.qcow2",
            &["write -z 0 64k", "write -z 1G 64k", "write -z 3G 64k"],
        );
        d.create("snap.qcow2", "qcow2", "", None, "2G");
        d.qemu_io(
            "qcow2",
            "snap.qcow2",
            &["write -P 1 0 64k", "write -z 1G 64k"],
        );
        d.qemu_img(&["snapshot", "-c", "s1", "snap.qcow2"]);
    });
    for img in ["big.qcow2", "snap.qcow2"] {
        let out = p.same(&["amend", "-p", "-o", "compat=0.10", img]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            text.contains("(0.00/100%)") && text.contains("(100.00/100%)"),
            "{text:?}"
        );
        p.ours.assert_check_clean(img);
    }
    // Without -p, nothing.
    let out = p.same(&["amend", "-o", "compat=1.1", "big.qcow2"]);
    assert!(out.stdout.is_empty());
}

/// Opening a dirty lazy-refcount image for writing repairs it; qemu-img prints what the
/// repair finds on stderr, as `check -r all` would.
#[test]
fn the_repair_of_a_dirty_image_on_open_is_printed_as_qemu_img_prints_it() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("dirty.qcow2", "qcow2", "lazy_refcounts=on", None, "64M");
        let out = d.run(
            "qemu-io",
            &[
                "-f",
                "qcow2",
                "-c",
                "write -P 4 0 128k",
                "-c",
                "abort",
                "dirty.qcow2",
            ],
        );
        assert!(!out.status.success(), "qemu-io abort");
    });
    let out = p.same(&["amend", "-o", "lazy_refcounts=off", "dirty.qcow2"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ERROR cluster"),
        "the repair is reported: {}",
        text(&out)
    );
    p.ours.assert_check_clean("dirty.qcow2");
}

/// QEMU's width change copies the stored refcounts, whatever the references say: an image
/// whose 1-bit refcount cannot count a second reference changes width, and a check then
/// repairs the refcount (iotest 112).
#[test]
fn a_width_change_carries_refcounts_that_disagree_over_as_qemu_img_does() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("s.qcow2", "qcow2", "refcount_bits=1", None, "64M");
        d.qemu_io("qcow2", "s.qcow2", &["write 0 64k"]);
        // The second L2 entry points at the first one's cluster too.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path("s.qcow2"))
            .expect("open");
        use std::io::{Seek, SeekFrom, Write};
        f.seek(SeekFrom::Start(0x4_0008)).expect("seek");
        f.write_all(&0x8000_0000_0005_0000u64.to_be_bytes())
            .expect("poke");
    });
    p.same(&["check", "s.qcow2"]);
    p.same(&["amend", "-o", "refcount_bits=2", "s.qcow2"]);
    p.same(&["info", "s.qcow2"]);
    p.same(&["check", "-r", "all", "s.qcow2"]);
}

/// `amend -p` prints the percentages of QEMU's walks over the refcount table, including the
/// step back when the new blocks force a walk more (iotest 112), and those of a width change
/// after an upgrade.
#[test]
fn a_width_change_reports_progress_as_qemu_img_does() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create(
            "walks.qcow2",
            "qcow2",
            "refcount_bits=1,cluster_size=512",
            None,
            "64k",
        );
        d.qemu_io("qcow2", "walks.qcow2", &[&format!("write 0 {}", 58 * 512)]);
        d.create("wide.qcow2", "qcow2", "", None, "64M");
        d.qemu_io("qcow2", "wide.qcow2", &["write 16M 32M"]);
        d.create("v2.qcow2", "qcow2", "compat=0.10", None, "64M");
        d.qemu_io("qcow2", "v2.qcow2", &["write 16M 32M"]);
    });
    let walks = p.same(&["amend", "-o", "refcount_bits=64", "-p", "walks.qcow2"]);
    let printed = String::from_utf8_lossy(&walks.stdout);
    assert!(
        printed.contains("(66.67/100%)\r    (50.00/100%)"),
        "{printed:?}"
    );
    p.same(&["amend", "-o", "refcount_bits=1", "-p", "wide.qcow2"]);
    p.same(&["amend", "-o", "refcount_bits=64", "-p", "wide.qcow2"]);
    p.same(&[
        "amend",
        "-o",
        "compat=1.1,refcount_bits=4",
        "-p",
        "v2.qcow2",
    ]);
    for img in ["walks.qcow2", "wide.qcow2", "v2.qcow2"] {
        p.same(&["check", img]);
    }
}
