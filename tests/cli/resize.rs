//! `qcow2-nbd resize` side by side with `qemu-img resize`: the same command lines on two
//! copies of images QEMU made (64k, 4k and 512-byte clusters, extended L2, a backing chain
//! with a longer backing file, compressed clusters, persistent bitmaps, internal snapshots,
//! raw files) exit the same way with the same reason; ours pass `qemu-img check`, read back
//! identically (`qemu-img compare`) and `qemu-img info` agrees on everything but sizes and
//! offsets on disk.

use crate::common::{self, info_sans_offsets, reason, BIN};
use test_support::{text, Dir};

/// An image to resize: its name, format, and how it is made.
struct Variant {
    name: &'static str,
    fmt: &'static str,
    make: fn(&Dir, &str),
}

/// Data in several clusters, one of them compressed, and a partial cluster at the end of a
/// 4 MiB + 1.5 KiB disk.
fn fill(d: &Dir, img: &str, fmt: &str) {
    d.qemu_io(
        fmt,
        img,
        &[
            "write -P 1 0 100k",
            "write -P 2 1M 64k",
            "write -P 3 3M 1M",
            "write -P 4 4M 1536",
        ],
    );
}

fn plain(d: &Dir, img: &str, opts: &str) {
    d.create(img, "qcow2", opts, None, "4195840");
    fill(d, img, "qcow2");
    d.qemu_io("qcow2", img, &["write -c -P 5 2M 64k"]);
}

const VARIANTS: &[Variant] = &[
    Variant {
        name: "64k",
        fmt: "qcow2",
        make: |d, img| plain(d, img, ""),
    },
    Variant {
        name: "4k",
        fmt: "qcow2",
        make: |d, img| plain(d, img, "cluster_size=4k"),
    },
    Variant {
        name: "512",
        fmt: "qcow2",
        make: |d, img| plain(d, img, "cluster_size=512,refcount_bits=64"),
    },
    Variant {
        name: "extl2",
        fmt: "qcow2",
        make: |d, img| plain(d, img, "extended_l2=on,cluster_size=32k"),
    },
    Variant {
        name: "v2",
        fmt: "qcow2",
        make: |d, img| plain(d, img, "compat=0.10"),
    },
    Variant {
        name: "backed",
        fmt: "qcow2",
        make: |d, img| {
            let base = format!("{img}.base");
            d.create(&base, "qcow2", "", None, "8M");
            d.qemu_io("qcow2", &base, &["write -P 9 0 8M"]);
            d.create(img, "qcow2", "", Some((&base, "qcow2")), "4195840");
            fill(d, img, "qcow2");
        },
    },
    Variant {
        name: "backed-extl2",
        fmt: "qcow2",
        make: |d, img| {
            let base = format!("{img}.base");
            d.create(&base, "raw", "", None, "8M");
            d.qemu_io("raw", &base, &["write -P 9 0 8M"]);
            d.create(
                img,
                "qcow2",
                "extended_l2=on",
                Some((&base, "raw")),
                "4195840",
            );
            fill(d, img, "qcow2");
        },
    },
    Variant {
        name: "bitmaps",
        fmt: "qcow2",
        make: |d, img| {
            plain(d, img, "");
            d.qemu_img(&["bitmap", "--add", img, "b1"]);
            d.qemu_img(&["bitmap", "--add", "-g", "1M", img, "b2"]);
            d.qemu_io(
                "qcow2",
                img,
                &["write -P 6 3584k 64k", "write -P 6 128k 4k"],
            );
            d.qemu_img(&["bitmap", "--disable", img, "b2"]);
        },
    },
    Variant {
        name: "snapshot",
        fmt: "qcow2",
        make: |d, img| {
            plain(d, img, "");
            d.qemu_img(&["snapshot", "-c", "s1", img]);
            d.qemu_io("qcow2", img, &["write -P 7 3M 512k"]);
        },
    },
    Variant {
        name: "raw",
        fmt: "raw",
        make: |d, img| {
            d.create(img, "raw", "", None, "4195840");
            fill(d, img, "raw");
        },
    },
];

/// Runs `resize ARGS` (`{}` standing for the image) through both tools on fresh copies of
/// `v`, and compares everything the module doc lists.
fn side_by_side(d: &Dir, v: &Variant, case: &str, args: &[&str]) {
    let (theirs, ours) = (
        format!("{}-{case}-qemu.img", v.name),
        format!("{}-{case}-ours.img", v.name),
    );
    (v.make)(d, &theirs);
    d.copy(&theirs, &ours);
    let mut full = vec!["-f", v.fmt];
    full.extend_from_slice(args);
    let (qemu, us) = common::side_by_side(d, "resize", (&theirs, &ours), &full);
    let what = format!("{} {case} {args:?}", v.name);
    assert_eq!(
        us.status.code(),
        qemu.status.code(),
        "{what}: exit status\nqemu: {}\nours: {}",
        text(&qemu),
        text(&us)
    );
    if qemu.status.success() {
        assert_eq!(
            String::from_utf8_lossy(&us.stdout),
            String::from_utf8_lossy(&qemu.stdout),
            "{what}: output"
        );
    } else {
        assert_eq!(reason(&us.stderr), reason(&qemu.stderr), "{what}: reason");
    }
    if v.fmt == "qcow2" {
        d.assert_check_clean(&ours);
    }
    d.assert_same_contents(&ours, v.fmt, &theirs, v.fmt);
    assert_eq!(
        info_sans_offsets(d, &ours),
        info_sans_offsets(d, &theirs),
        "{what}: qemu-img info (left ours, right QEMU's)"
    );
    if v.name == "bitmaps" {
        for b in ["b1", "b2"] {
            assert_eq!(
                test_support::qemu_dirty_ranges(&d.path(&ours), b),
                test_support::qemu_dirty_ranges(&d.path(&theirs), b),
                "{what}: dirty ranges of {b}"
            );
        }
    }
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
fn growing_matches_qemu_img() {
    run_cases(&[
        ("grow", &["{}", "9M"]),
        ("grow-relative", &["{}", "+3M"]),
        ("grow-unaligned", &["{}", "+1536"]),
        ("same", &["{}", "+0"]),
        ("grow-quiet", &["-q", "{}", "5M"]),
    ]);
}

#[test]
fn shrinking_matches_qemu_img() {
    run_cases(&[
        ("shrink", &["--shrink", "{}", "1M"]),
        ("shrink-relative", &["--shrink", "{}", "-2M"]),
        ("shrink-unaligned", &["--shrink", "{}", "1049088"]),
        ("shrink-refused", &["{}", "1M"]),
        ("not-a-sector", &["--shrink", "{}", "1000"]),
        ("not-positive", &["--shrink", "{}", "-5M"]),
    ]);
}

#[test]
fn preallocating_matches_qemu_img() {
    run_cases(&[
        ("metadata", &["--preallocation=metadata", "{}", "7M"]),
        ("falloc", &["--preallocation=falloc", "{}", "+2M"]),
        ("full", &["--preallocation", "full", "{}", "6M"]),
        ("off", &["--preallocation=off", "{}", "6M"]),
        (
            "prealloc-shrink",
            &["--preallocation=full", "--shrink", "{}", "1M"],
        ),
    ]);
}

#[test]
fn bad_arguments_are_refused_as_qemu_img_refuses_them() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "4M");
    for args in [
        &["resize", "a.qcow2", "1x"][..],
        &["resize", "a.qcow2", "+"][..],
        &["resize", "--preallocation=bogus", "a.qcow2", "8M"][..],
        &["resize", "-f", "vmdk", "a.qcow2", "8M"][..],
        &["resize", "missing.qcow2", "8M"][..],
    ] {
        let (q, o) = (d.run("qemu-img", args), d.run(BIN, args));
        assert_eq!(o.status.code(), q.status.code(), "{args:?}: {}", text(&o));
        assert_eq!(o.status.code(), Some(1), "{args:?}");
    }
    // A bitmap left in use by a crash stops a resize in both tools.
    let path = d.create("inuse.qcow2", "qcow2", "", None, "4M");
    d.qemu_img(&["bitmap", "--add", "inuse.qcow2", "crashed"]);
    let meta = qcow2::inspect::inspect(std::fs::read(&path).unwrap().as_slice()).unwrap();
    let dir = meta.header.bitmaps().unwrap().directory_offset as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[dir + 15] |= 1;
    std::fs::write(&path, &bytes).unwrap();
    let args = ["resize", "inuse.qcow2", "8M"];
    let (q, o) = (d.run("qemu-img", &args), d.run(BIN, &args));
    assert_eq!((o.status.code(), q.status.code()), (Some(1), Some(1)));
    assert!(
        reason(&o.stderr).starts_with("Bitmap 'crashed' is inconsistent and cannot be used"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "nothing changed");
}

#[test]
fn a_served_image_is_not_resized() {
    // Another process holding the image for writing (qemu-io here) makes us fail cleanly.
    let d = Dir::new();
    d.create("busy.qcow2", "qcow2", "", None, "4M");
    let mut holder = hold_with_qemu_io(&d, "busy.qcow2");
    let out = d.run(BIN, &["resize", "busy.qcow2", "8M"]);
    drop(holder.stdin.take());
    let _ = holder.wait();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lock"),
        "{}",
        text(&out)
    );
    assert_eq!(d.info("busy.qcow2")["virtual-size"], 4 << 20);
}

/// Starts qemu-io holding `name` open for writing and waits until it has the lock. The
/// probe (`qemu-img info`, a shared lock) can make a qemu-io that opens at that very moment
/// fail to lock and exit: such a qemu-io is started again.
fn hold_with_qemu_io(d: &Dir, name: &str) -> std::process::Child {
    let spawn = || {
        std::process::Command::new("qemu-io")
            .args(["-f", "qcow2", name])
            .current_dir(d.root())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("run qemu-io")
    };
    let mut holder = spawn();
    test_support::wait_until(
        std::time::Duration::from_secs(60),
        "qemu-io holds the image lock",
        || {
            if holder.try_wait().expect("poll qemu-io").is_some() {
                holder = spawn();
                return false;
            }
            !d.run("qemu-img", &["info", name]).status.success()
        },
    );
    holder
}

/// After growing with `falloc` or `full` preallocation, the grown space of an image we made
/// has its room in the file already, as with qemu-img: writing it does not make the file take more room, also
/// where the space lies in the old last cluster, which metadata preallocation gave a host
/// cluster without reserving its room.
#[test]
fn grown_space_is_reserved_up_front() {
    let d = Dir::new();
    // 2000 KiB: the last 64 KiB cluster is only a quarter inside the disk.
    for create in ["off", "metadata", "falloc", "full"] {
        for grow in ["falloc", "full"] {
            for (cluster, by) in [("64k", "16K"), ("64k", "80K"), ("512", "48K")] {
                let img = format!("g-{create}-{grow}-{cluster}-{by}.qcow2");
                let opts = format!("preallocation={create},cluster_size={cluster}");
                d.ok(
                    BIN,
                    &["create", "-q", "-f", "qcow2", "-o", &opts, &img, "2000K"],
                );
                let prealloc = format!("--preallocation={grow}");
                d.ok(
                    BIN,
                    &["resize", "-f", "qcow2", &prealloc, &img, &format!("+{by}")],
                );
                d.qemu_io("qcow2", &img, &["write 0 2000K"]);
                let before = d.disk_usage(&img);
                d.qemu_io("qcow2", &img, &[&format!("write 2000K {by}")]);
                // Writing into reserved space may still cost the file system one block of
                // its own (an extent index when the reserved extent splits); unreserved
                // space costs the whole write, 16 KiB at least.
                let after = d.disk_usage(&img);
                assert!(
                    after <= before + 4096,
                    "{img}: writing the grown space took more room in the file: {before} -> {after}"
                );
                d.assert_check_clean(&img);
            }
        }
    }
}

/// Growing with `falloc` past an old end inside a cluster that has no host cluster yet:
/// that cluster gets its host cluster first, before the new ones, as with qemu-img, so the
/// file is laid out as QEMU lays it out (and a guest write later splits no more of the
/// file system's extents than it would in QEMU's file).
#[test]
fn a_preallocating_resize_lays_out_the_file_as_qemu_img_does() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("r.qcow2", "qcow2", "cluster_size=64k", None, "2000K");
    });
    p.same(&[
        "resize",
        "-f",
        "qcow2",
        "--preallocation=falloc",
        "r.qcow2",
        "+80K",
    ]);
    let map = |d: &Dir| d.qemu_img(&["map", "--output=json", "r.qcow2"]);
    assert_eq!(map(&p.ours), map(&p.qemu), "the clusters' host offsets");
    assert_eq!(
        p.ours.disk_usage("r.qcow2"),
        p.qemu.disk_usage("r.qcow2"),
        "room taken in the file"
    );
    p.ours.assert_check_clean("r.qcow2");
}

/// Shrinking frees the dropped clusters' room in the file as qemu-img frees it: the file
/// takes the same room afterwards, down to the file system's last block (freed clusters
/// are punched in runs, as QEMU's merged discards punch them).
#[test]
fn shrinking_frees_as_much_room_as_qemu_img() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create(
            "s.qcow2",
            "qcow2",
            "cluster_size=1M,preallocation=metadata",
            None,
            "2100M",
        );
        d.qemu_io(
            "qcow2",
            "s.qcow2",
            &[
                "discard 0 10M",
                "discard 2090M 10M",
                "write 2090M 10M",
                "write 0 10M",
            ],
        );
    });
    let before = (p.qemu.disk_usage("s.qcow2"), p.ours.disk_usage("s.qcow2"));
    p.same(&["resize", "--shrink", "s.qcow2", "5M"]);
    let freed = |d: &Dir, was: u64| was - d.disk_usage("s.qcow2");
    assert_eq!(
        freed(&p.ours, before.1),
        freed(&p.qemu, before.0),
        "room freed in the file (ours, QEMU's)"
    );
    p.ours.assert_check_clean("s.qcow2");
    // qemu-io writes 0xcd unless told otherwise.
    p.ours.qemu_io("qcow2", "s.qcow2", &["read -P 0xcd 0 5M"]);
}
