//! `qcow2-nbd bitmap` side by side with `qemu-img bitmap`: the same command lines on two
//! copies of an image QEMU made (with bitmaps, some of them dirty) must leave the same
//! bitmaps (names, flags, granularity, dirty extents as qemu-nbd exports them), exit the
//! same way and say the same reason; what we leave passes `qemu-img check`.

use std::path::Path;

use test_support::{
    assert_check_clean, qemu_bitmaps, qemu_dirty_ranges, qemu_img, qemu_io, text, Dir,
};

use crate::common::{self, BIN};

/// A 64 MiB image with `on` (enabled, dirty at 1 MiB and 5 MiB), `off` (disabled, dirty at
/// 1 MiB) and `coarse` (enabled, 1 MiB granularity, dirty at 5 MiB).
fn image(d: &Dir, name: &str) {
    let p = d.s(name);
    d.create(name, "qcow2", "", None, "64M");
    qemu_img(&["bitmap", "--add", &p, "on"]);
    qemu_img(&["bitmap", "--add", &p, "off"]);
    qemu_io("qcow2", &p, &["write 1M 4k"]);
    qemu_img(&["bitmap", "--disable", &p, "off"]);
    qemu_img(&["bitmap", "--add", "-g", "1M", &p, "coarse"]);
    qemu_io("qcow2", &p, &["write 5M 4k"]);
}

/// A bitmap as `qemu-img info` lists it, with its dirty ranges as qemu-nbd exports them.
#[derive(Debug, PartialEq, Eq)]
struct Listed {
    name: String,
    flags: Vec<String>,
    granularity: u64,
    dirty: Vec<(u64, u64)>,
}

/// Every bitmap of the image, in directory order.
fn bitmaps(path: &Path) -> Vec<Listed> {
    qemu_bitmaps(path)
        .into_iter()
        .map(|b| {
            let dirty = if b.flags.iter().any(|f| f == "in-use") {
                Vec::new()
            } else {
                qemu_dirty_ranges(path, &b.name)
            };
            Listed {
                name: b.name,
                flags: b.flags,
                granularity: b.granularity,
                dirty,
            }
        })
        .collect()
}

/// The reason after qemu-img's "Operation X on bitmap Y failed: ", or the whole message.
fn reason(stderr: &str) -> String {
    let line = stderr.lines().next().unwrap_or("");
    match line.find("failed: ") {
        Some(i) => line[i + 8..].to_string(),
        None => line.split_once(": ").map_or(line, |(_, r)| r).to_string(),
    }
}

/// Runs `bitmap ARGS` (with `{}` standing for the image) through both tools on two copies.
fn side_by_side(d: &Dir, case: &str, args: &[&str]) {
    let (ours, theirs) = (format!("{case}-ours.qcow2"), format!("{case}-qemu.qcow2"));
    image(d, &theirs);
    d.copy(&theirs, &ours);
    let images = (d.s(&theirs), d.s(&ours));
    let (qemu, us) = common::side_by_side(d, "bitmap", (&images.0, &images.1), args);
    assert_eq!(
        us.status.code(),
        qemu.status.code(),
        "{case}: exit status\nqemu: {}\nours: {}",
        text(&qemu),
        text(&us)
    );
    if !qemu.status.success() {
        let (qr, ur) = (
            reason(&String::from_utf8_lossy(&qemu.stderr)),
            reason(&String::from_utf8_lossy(&us.stderr)),
        );
        assert!(
            ur.starts_with(qr.lines().next().unwrap_or("")) || qr.contains("Can't make bitmap"),
            "{case}: qemu says {qr:?}, we say {ur:?}"
        );
    }
    assert_check_clean(&d.path(&ours));
    assert_eq!(
        bitmaps(&d.path(&ours)),
        bitmaps(&d.path(&theirs)),
        "{case}: the bitmaps differ (left ours, right QEMU's)"
    );
}

#[test]
fn bitmap_operations_leave_what_qemu_img_leaves() {
    let d = Dir::new();
    let cases: &[(&str, &[&str])] = &[
        ("add", &["--add", "{}", "new"]),
        ("add-granularity", &["--add", "-g", "512", "{}", "new"]),
        ("add-disabled", &["--add", "--disable", "{}", "new"]),
        ("add-existing", &["--add", "{}", "on"]),
        ("add-bad-granularity", &["--add", "-g", "1000", "{}", "new"]),
        ("remove", &["--remove", "{}", "on"]),
        ("remove-missing", &["--remove", "{}", "nope"]),
        ("clear", &["--clear", "{}", "on"]),
        ("enable", &["--enable", "{}", "off"]),
        ("disable", &["--disable", "{}", "coarse"]),
        ("merge", &["--merge", "on", "{}", "off"]),
        ("merge-coarse", &["--merge", "on", "{}", "coarse"]),
        ("merge-fine", &["--merge", "coarse", "{}", "on"]),
        ("merge-missing", &["--merge", "nope", "{}", "on"]),
        (
            "in-order",
            &["--add", "--merge", "on", "--disable", "{}", "copy"],
        ),
        (
            "stops-at-failure",
            &["--clear", "--add", "--remove", "{}", "on"],
        ),
        ("twice", &["--add", "--add", "{}", "twice"]),
        ("no-op", &["{}", "on"]),
        (
            "granularity-without-add",
            &["-g", "1M", "--remove", "{}", "on"],
        ),
        (
            "remove-then-add",
            &["--remove", "--add", "-g", "4k", "{}", "on"],
        ),
    ];
    for (case, args) in cases {
        side_by_side(&d, case, args);
    }
}

#[test]
fn merging_from_another_image_matches_qemu_img() {
    let d = Dir::new();
    d.create("src.qcow2", "qcow2", "", None, "64M");
    qemu_img(&["bitmap", "--add", &d.s("src.qcow2"), "s"]);
    qemu_io("qcow2", &d.s("src.qcow2"), &["write 7M 64k"]);
    let src = d.s("src.qcow2");
    side_by_side(
        &d,
        "merge-file",
        &["--merge", "s", "-b", &src, "-F", "qcow2", "{}", "off"],
    );
    side_by_side(
        &d,
        "merge-file-probed",
        &["--merge", "s", "-b", &src, "{}", "on"],
    );
    side_by_side(
        &d,
        "source-without-merge",
        &["--add", "-b", &src, "{}", "x"],
    );
}

#[test]
fn an_in_use_bitmap_can_only_be_removed() {
    let d = Dir::new();
    let path = d.create("img.qcow2", "qcow2", "", None, "16M");
    qemu_img(&["bitmap", "--add", &d.s("img.qcow2"), "crashed"]);
    // What a crash leaves: the in-use flag of the bitmap's directory entry set.
    let meta = qcow2::inspect::inspect(std::fs::read(&path).unwrap().as_slice()).unwrap();
    let dir = meta.header.bitmaps().unwrap().directory_offset as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[dir + 15] |= 1;
    std::fs::write(&path, &bytes).unwrap();
    for op in ["--clear", "--enable", "--disable"] {
        let args = ["bitmap", op, &d.s("img.qcow2"), "crashed"];
        let (ours, qemu) = (d.run(BIN, &args), d.run("qemu-img", &args));
        assert!(!ours.status.success() && !qemu.status.success(), "{op}");
        assert_eq!(
            reason(&String::from_utf8_lossy(&ours.stderr))
                .split(';')
                .next(),
            reason(&String::from_utf8_lossy(&qemu.stderr))
                .lines()
                .next(),
            "{op}"
        );
    }
    assert_eq!(bitmaps(&path)[0].flags, ["in-use", "auto"], "still in use");
    // check and check -r treat it as qemu-img does: not an error, and left as it is.
    d.copy("img.qcow2", "theirs.qcow2");
    let (mine, theirs) = (d.s("img.qcow2"), d.s("theirs.qcow2"));
    for args in [&["check"][..], &["check", "-r", "all"][..]] {
        let with = |img: &str| -> Vec<String> {
            args.iter()
                .map(|a| a.to_string())
                .chain([img.to_string()])
                .collect()
        };
        let (o_args, q_args) = (with(&mine), with(&theirs));
        let o_args: Vec<&str> = o_args.iter().map(String::as_str).collect();
        let q_args: Vec<&str> = q_args.iter().map(String::as_str).collect();
        let (o, q) = (d.run(BIN, &o_args), d.run("qemu-img", &q_args));
        assert_eq!(o.status.code(), q.status.code(), "{args:?}");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).replace(&mine, ""),
            String::from_utf8_lossy(&q.stdout).replace(&theirs, ""),
            "{args:?}"
        );
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(d.path("theirs.qcow2")).unwrap(),
        "check -r all leaves the in-use bitmap as qemu-img does"
    );
    let out = d.run(BIN, &["bitmap", "--remove", &d.s("img.qcow2"), "crashed"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(bitmaps(&path), vec![]);
    assert_check_clean(&path);
}

#[test]
fn convert_copies_bitmaps_as_qemu_img_convert_does() {
    let d = Dir::new();
    image(&d, "src.qcow2");
    let src = d.s("src.qcow2");
    for (tool, out) in [("qemu-img", "qemu.qcow2"), (BIN, "ours.qcow2")] {
        let r = d.run(
            tool,
            &["convert", "--bitmaps", "-O", "qcow2", &src, &d.s(out)],
        );
        assert!(r.status.success(), "{tool}: {}", text(&r));
    }
    assert_check_clean(&d.path("ours.qcow2"));
    let ours = bitmaps(&d.path("ours.qcow2"));
    assert_eq!(ours.len(), 3);
    assert_eq!(ours, bitmaps(&d.path("qemu.qcow2")));
    assert_eq!(
        ours,
        bitmaps(&d.path("src.qcow2")),
        "the bitmaps as the source has them"
    );
    // A bitmap left in use fails the convert, or is skipped on request; both tools agree.
    let meta =
        qcow2::inspect::inspect(std::fs::read(d.path("src.qcow2")).unwrap().as_slice()).unwrap();
    let dir = meta.header.bitmaps().unwrap().directory_offset as usize;
    let mut bytes = std::fs::read(d.path("src.qcow2")).unwrap();
    bytes[dir + 15] |= 1;
    std::fs::write(d.path("src.qcow2"), &bytes).unwrap();
    for extra in [&[][..], &["--skip-broken-bitmaps"][..]] {
        let mut results = Vec::new();
        for (tool, out) in [("qemu-img", "q2.qcow2"), (BIN, "o2.qcow2")] {
            let _ = std::fs::remove_file(d.path(out));
            let mut args = vec!["convert", "--bitmaps"];
            args.extend_from_slice(extra);
            let target = d.s(out);
            args.extend_from_slice(&["-O", "qcow2", &src, &target]);
            let r = d.run(tool, &args);
            results.push(r.status.code());
        }
        assert_eq!(results[0], results[1], "{extra:?}");
        if results[1] == Some(0) {
            let names: Vec<String> = bitmaps(&d.path("o2.qcow2"))
                .into_iter()
                .map(|b| b.name)
                .collect();
            assert_eq!(names, ["off", "coarse"], "the broken one is left out");
        }
    }
    for args in [
        &["convert", "--bitmaps", "-O", "raw"][..],
        &["convert", "--skip-broken-bitmaps", "-O", "qcow2"][..],
    ] {
        let mut full = args.to_vec();
        let target = d.s("x.img");
        full.extend_from_slice(&[&src, &target]);
        let (q, o) = (d.run("qemu-img", &full), d.run(BIN, &full));
        assert_eq!(q.status.code(), o.status.code(), "{args:?}");
        assert_eq!(
            reason(&String::from_utf8_lossy(&q.stderr)),
            reason(&String::from_utf8_lossy(&o.stderr)),
            "{args:?}"
        );
    }
}

/// `qemu-img check --output=json`'s image end offset and the file's length: where the
/// clusters of a store went.
fn layout(d: &Dir, image: &str) -> (u64, u64) {
    let end = d.check_json(image)["image-end-offset"]
        .as_u64()
        .expect("image-end-offset");
    let len = std::fs::metadata(d.path(image)).expect("stat").len();
    (end, len)
}

/// A bitmap whose data is QEMU's largest (512 MiB: 2 TiB at 512-byte granularity, with 2 MiB
/// clusters) is valid: we read the image QEMU made and measure what a copy needs as
/// qemu-img does; and adding bitmaps one call after another rewrites the earlier ones as
/// qemu-img does, leaving the same file.
#[test]
fn the_largest_bitmap_qemu_makes_is_read_and_stored_as_qemu_does() {
    let d = Dir::new();
    for f in ["qemu.qcow2", "ours.qcow2"] {
        d.create(f, "qcow2", "cluster_size=2M", None, "2T");
    }
    let adds: &[(&[&str], &str)] = &[(&["-g", "512"], "b1"), (&["-g", "2M"], "b2"), (&[], "b3")];
    for (opts, name) in adds {
        for (tool, img) in [("qemu-img", "qemu.qcow2"), (BIN, "ours.qcow2")] {
            let mut args = vec!["bitmap", "--add", "-f", "qcow2"];
            args.extend_from_slice(opts);
            args.extend_from_slice(&[img, name]);
            let out = d.run(tool, &args);
            assert!(out.status.success(), "{tool} {args:?}: {}", text(&out));
        }
    }
    assert_check_clean(&d.path("ours.qcow2"));
    assert_eq!(layout(&d, "ours.qcow2"), layout(&d, "qemu.qcow2"));
    let info = d.run(BIN, &["info", "--output=json", "qemu.qcow2"]);
    assert!(info.status.success(), "info: {}", text(&info));
    for args in [
        &[
            "measure",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=64k",
            "-f",
            "qcow2",
        ][..],
        &["measure", "--output=json", "-O", "qcow2", "-f", "qcow2"][..],
    ] {
        let mut args = args.to_vec();
        args.push("qemu.qcow2");
        let (q, o) = (d.run("qemu-img", &args), d.run(BIN, &args));
        assert!(o.status.success(), "{args:?}: {}", text(&o));
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&q.stdout),
            "{args:?}"
        );
    }
}

/// A merge's source may be the image above the one merged into: neither opens its backing
/// chain (as in qemu-img), so the source's backing file, the image being written, is not
/// opened a second time (that open wanted a lock the writer holds).
#[test]
fn merging_into_a_backing_file_from_its_overlay_matches_qemu_img() {
    let d = Dir::new();
    let mut left = Vec::new();
    for (who, tool) in [("qemu", "qemu-img"), ("ours", BIN)] {
        let (base, top) = (format!("base-{who}.qcow2"), format!("top-{who}.qcow2"));
        d.create(&base, "qcow2", "", None, "16M");
        d.create(&top, "qcow2", "", Some((&base, "qcow2")), "16M");
        qemu_img(&["bitmap", "--add", &d.s(&top), "t"]);
        qemu_io("qcow2", &d.s(&top), &["write 2M 64k"]);
        let args = [
            "bitmap",
            "--add",
            "--merge",
            "t",
            "-b",
            &d.s(&top),
            "-F",
            "qcow2",
            "-f",
            "qcow2",
            &d.s(&base),
            "copy",
        ];
        let out = d.run(tool, &args);
        assert!(out.status.success(), "{tool}: {}", text(&out));
        assert_check_clean(&d.path(&base));
        left.push(bitmaps(&d.path(&base)));
    }
    assert_eq!(
        left[1], left[0],
        "the base's bitmaps (right QEMU's, left ours)"
    );
    assert_eq!(left[0][0].dirty, [(2 << 20, 64 << 10)], "the merged bits");
}
