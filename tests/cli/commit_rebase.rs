//! `commit` and `rebase` against `qemu-img commit` and `qemu-img rebase`: the same operation
//! on copies of the same 3-deep chain (data in the base, partial writes in the middle, and in
//! the top partial writes across subcluster edges, zeroes, discards and a compressed
//! cluster), then every image we wrote passes `qemu-img check`, reads like QEMU's result,
//! allocates nothing QEMU does not (rebase: exactly what QEMU allocates) and has the same
//! `qemu-img info` apart from sizes and offsets on disk.

use serde_json::Value;
use test_support::Dir;

use crate::common::{compare_maps, parse_map, Run, BIN};

/// One geometry of the chain.
struct Setup {
    name: &'static str,
    /// `-o` of every image.
    opts: &'static str,
    cluster: u64,
}

const SETUPS: &[Setup] = &[
    Setup {
        name: "standard 64k",
        opts: "cluster_size=64k",
        cluster: 64 << 10,
    },
    Setup {
        name: "extended L2 64k",
        opts: "extended_l2=on",
        cluster: 64 << 10,
    },
    Setup {
        name: "extended L2 128k",
        opts: "extended_l2=on,cluster_size=128k",
        cluster: 128 << 10,
    },
    Setup {
        name: "standard 4k",
        opts: "cluster_size=4k",
        cluster: 4 << 10,
    },
];

const SIZE: u64 = 4 << 20;

/// Builds base <- mid <- top (relative backing names) in `d`.
fn chain(d: &Dir, s: &Setup) {
    let size = SIZE.to_string();
    let c = s.cluster;
    let sub = c / 32;
    d.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        s.opts,
        "base.qcow2",
        &size,
    ]);
    d.qemu_io(
        "qcow2",
        "base.qcow2",
        &["write -P 0x11 0 3M", "write -z 1M 64k"],
    );
    for (img, back) in [("mid.qcow2", "base.qcow2"), ("top.qcow2", "mid.qcow2")] {
        d.qemu_img(&[
            "create", "-q", "-f", "qcow2", "-o", s.opts, "-b", back, "-F", "qcow2", img,
        ]);
    }
    d.qemu_io(
        "qcow2",
        "mid.qcow2",
        &[
            "write -P 0x22 512k 1M",
            &format!("write -P 0x23 {} {}", 2 * c + sub, 3 * sub + 100),
            "write -P 0x24 3500k 10k",
        ],
    );
    d.qemu_io(
        "qcow2",
        "top.qcow2",
        &[
            &format!("write -P 0x33 {} {}", sub / 2, 2 * sub),
            &format!("write -P 0x34 {} {}", 5 * c - sub, 2 * sub + 7),
            &format!("write -z {} {}", 600 << 10, 2 * c),
            &format!("write -z {} {}", 9 * c + 3 * sub, 2 * sub),
            &format!("discard {} {}", 2 << 20, 2 * c),
            &format!("write -c -P 0x35 {} {}", 3 << 20, c),
            "write -P 0x36 3900k 20k",
        ],
    );
}

/// Two copies of the same chain: one for QEMU, one for us.
fn pair(s: &Setup) -> (Dir, Dir) {
    let (q, o) = (Dir::new(), Dir::new());
    chain(&q, s);
    for f in ["base.qcow2", "mid.qcow2", "top.qcow2"] {
        std::fs::copy(q.path(f), o.path(f)).expect("copy image");
    }
    (q, o)
}

/// `qemu-img map --output=json` of `image` alone (no backing file).
fn own_map(d: &Dir, image: &str) -> Vec<Run> {
    let spec = format!("json:{{\"driver\":\"qcow2\",\"file\":{{\"driver\":\"file\",\"filename\":\"{}\"}},\"backing\":null}}", d.s(image));
    parse_map(&d.qemu_img(&["map", "--output=json", &spec]))
}

/// Bytes where `ours` allocates something (data or zeros) and `qemu` does not.
fn allocated_beyond(ours: &[Run], qemu: &[Run]) -> Vec<(u64, u64)> {
    let covered = |pos: u64| {
        qemu.iter()
            .any(|r| r.present && r.start <= pos && pos < r.start + r.length)
    };
    let mut extra = Vec::new();
    for r in ours.iter().filter(|r| r.present) {
        let mut pos = r.start;
        while pos < r.start + r.length {
            if !covered(pos) {
                extra.push((pos, r.start + r.length));
            }
            // 512 bytes: the finest unit either tool allocates.
            pos += 512;
        }
    }
    extra
}

/// `qemu-img info --output=json` without what depends on where things are on disk.
fn info_sans_layout(d: &Dir, image: &str) -> Value {
    let mut v = d.info(image);
    fn strip(v: &mut Value) {
        if let Value::Object(m) = v {
            m.retain(|k, _| {
                !matches!(
                    k.as_str(),
                    "actual-size" | "filename" | "full-backing-filename" | "dirty-flag"
                ) && !k.contains("offset")
            });
            m.values_mut().for_each(strip);
        } else if let Value::Array(a) = v {
            a.iter_mut().for_each(strip);
        }
    }
    strip(&mut v);
    // The file's length is layout too (QEMU truncates an emptied top, we leave it).
    if let Some(c) = v.get_mut("children") {
        *c = Value::Null;
    }
    v
}

/// What every image we wrote must satisfy against QEMU's version of it.
fn assert_like_qemu(q: &Dir, o: &Dir, image: &str, exact_map: bool, what: &str) {
    o.assert_check_clean(image);
    let out = q
        .run(
            "qemu-img",
            &["compare", "-f", "qcow2", "-F", "qcow2", image, &o.s(image)],
        )
        .status;
    assert!(out.success(), "{what}: {image} differs from QEMU's");
    let (ours, theirs) = (own_map(o, image), own_map(q, image));
    if exact_map {
        let diff = compare_maps(&ours, &theirs, SIZE, None);
        assert!(
            diff.mismatches.is_empty(),
            "{what}: {image} map: {:?}",
            diff.mismatches
        );
    } else {
        let extra = allocated_beyond(&ours, &theirs);
        assert!(
            extra.is_empty(),
            "{what}: {image}: we allocate more than QEMU: {extra:?}"
        );
    }
    assert_eq!(
        info_sans_layout(o, image),
        info_sans_layout(q, image),
        "{what}: {image} info"
    );
}

#[test]
fn commit_matches_qemu_img() {
    for s in SETUPS {
        // Into the backing file, emptying the top.
        let (q, o) = pair(s);
        q.qemu_img(&["commit", "-q", "top.qcow2"]);
        let out = o.ok(BIN, &["commit", "top.qcow2"]);
        assert_eq!(out, "Image committed.\n", "{}", s.name);
        for image in ["top.qcow2", "mid.qcow2", "base.qcow2"] {
            assert_like_qemu(&q, &o, image, false, s.name);
        }
        assert!(
            own_map(&o, "top.qcow2").iter().all(|r| !r.present),
            "{}: top not empty",
            s.name
        );
        // Into the base through mid (-b implies -d), and -d alone.
        let (q, o) = pair(s);
        q.qemu_img(&["commit", "-q", "-b", "base.qcow2", "top.qcow2"]);
        o.ok(BIN, &["commit", "-q", "-b", "base.qcow2", "top.qcow2"]);
        for image in ["top.qcow2", "mid.qcow2", "base.qcow2"] {
            assert_like_qemu(&q, &o, image, false, s.name);
        }
        let (q, o) = pair(s);
        q.qemu_img(&["commit", "-q", "-d", "top.qcow2"]);
        o.ok(BIN, &["commit", "-q", "-d", "-p", "top.qcow2"]);
        for image in ["top.qcow2", "mid.qcow2"] {
            assert_like_qemu(&q, &o, image, false, s.name);
        }
    }
}

#[test]
fn commit_into_a_smaller_raw_base_grows_it() {
    let (q, o) = (Dir::new(), Dir::new());
    for d in [&q, &o] {
        std::fs::write(d.path("base.raw"), vec![0x5a; 2 << 20]).expect("write base");
        d.qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "top.qcow2",
            "4M",
        ]);
        d.qemu_io(
            "qcow2",
            "top.qcow2",
            &[
                "write -P 7 3M 64k",
                "write -z 0 64k",
                "write -P 8 1000k 100k",
            ],
        );
    }
    q.qemu_img(&["commit", "-q", "top.qcow2"]);
    o.ok(BIN, &["commit", "-q", "top.qcow2"]);
    assert_eq!(o.read("base.raw"), q.read("base.raw"));
    assert_like_qemu(&q, &o, "top.qcow2", true, "raw base");
}

#[test]
fn commit_refuses_what_qemu_img_refuses() {
    let s = &SETUPS[0];
    let (_q, o) = pair(s);
    let cases: &[(&[&str], &str)] = &[
        (
            &["commit", "base.qcow2"],
            "Image does not have a backing file",
        ),
        (
            &["commit", "-b", "nothere.qcow2", "top.qcow2"],
            "Did not find 'nothere.qcow2' in the backing chain of 'top.qcow2'",
        ),
        (
            &["commit", "-b", "top.qcow2", "top.qcow2"],
            "Did not find 'top.qcow2' in the backing chain of 'top.qcow2'",
        ),
        (
            &["commit", "-r", "abc", "top.qcow2"],
            "Invalid rate limit specified: 'abc'.",
        ),
    ];
    let before: Vec<Vec<u8>> = ["base.qcow2", "mid.qcow2", "top.qcow2"]
        .iter()
        .map(|f| o.read(f))
        .collect();
    for (args, msg) in cases {
        let out = o.run(BIN, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim_end(), format!("qcow2-nbd: {msg}"), "{args:?}");
    }
    let after: Vec<Vec<u8>> = ["base.qcow2", "mid.qcow2", "top.qcow2"]
        .iter()
        .map(|f| o.read(f))
        .collect();
    assert!(before == after, "a refused commit changed an image");
}

#[test]
fn commit_fails_cleanly_while_qemu_holds_the_base() {
    let (_q, o) = pair(&SETUPS[0]);
    // qemu-io keeps the image open read-write until its stdin closes; its first prompt
    // says the image is open (and locked).
    let mut holder = std::process::Command::new("qemu-io")
        .args(["-f", "qcow2", &o.s("mid.qcow2")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("qemu-io");
    let mut prompt = [0u8; 8];
    std::io::Read::read_exact(holder.stdout.as_mut().expect("stdout"), &mut prompt)
        .expect("qemu-io prompt");
    assert_eq!(&prompt, b"qemu-io>");
    let before = o.read("top.qcow2");
    let out = o.run(BIN, &["commit", "top.qcow2"]);
    drop(holder.stdin.take());
    holder.wait().expect("qemu-io exits");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lock"), "{err}");
    assert!(o.read("top.qcow2") == before, "the top changed");
}

#[test]
fn rebase_matches_qemu_img() {
    for s in SETUPS {
        let q0 = Dir::new();
        let size = SIZE.to_string();
        q0.qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            s.opts,
            "other.qcow2",
            &size,
        ]);
        q0.qemu_io(
            "qcow2",
            "other.qcow2",
            &[
                "write -P 0x11 0 1M",
                "write -P 0x44 1M 1M",
                "write -P 0x24 3500k 1k",
            ],
        );
        let cases: &[&[&str]] = &[
            &["-b", "base.qcow2", "-F", "qcow2"],
            &["-b", "other.qcow2", "-F", "qcow2"],
            &["-b", ""],
            &["-u", "-b", "other.qcow2", "-F", "qcow2"],
        ];
        for case in cases {
            let (q, o) = pair(s);
            for d in [&q, &o] {
                std::fs::copy(q0.path("other.qcow2"), d.path("other.qcow2")).expect("copy");
            }
            let mut args = vec!["rebase", "-q"];
            args.extend_from_slice(case);
            args.push("top.qcow2");
            q.qemu_img(&args);
            let out = o.ok(BIN, &args);
            assert_eq!(out, "", "{}: {case:?}", s.name);
            let what = format!("{}: {case:?}", s.name);
            assert_like_qemu(&q, &o, "top.qcow2", true, &what);
        }
    }
}

#[test]
fn rebase_refuses_before_changing_anything() {
    let (_q, o) = pair(&SETUPS[0]);
    let cases: &[(&[&str], &str)] = &[
        (
            &["rebase", "top.qcow2"],
            "Must specify backing file (-b) or use unsafe mode (-u)",
        ),
        (
            &["rebase", "-b", "base.qcow2", "top.qcow2"],
            "Could not change the backing file to 'base.qcow2': backing format must be specified",
        ),
        (
            &["rebase", "-b", "gone.qcow2", "-F", "qcow2", "top.qcow2"],
            "Could not open new backing file 'gone.qcow2': Could not open",
        ),
    ];
    let before = o.read("top.qcow2");
    for (args, msg) in cases {
        let out = o.run(BIN, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with(&format!("qcow2-nbd: {msg}")),
            "{args:?}: {err}"
        );
    }
    assert!(
        o.read("top.qcow2") == before,
        "a refused rebase changed the image"
    );
}

/// A rebase onto a file of the old chain must keep what reads past the end of a shorter
/// layer between the image and that file: zeros in the old chain, whatever the new backing
/// file holds there. Each chain is listed top first as (name, size in KiB, fill pattern, 0
/// for none), the last being the new backing file, with where the old chain reads zeros to
/// the end.
#[test]
fn rebase_keeps_zeros_past_a_shorter_old_layer() {
    type Chain<'a> = (&'a [(&'a str, u64, u8)], u64);
    let chains: &[Chain] = &[
        (
            &[("top", 320, 0), ("old", 256, 0x22), ("new", 320, 0x11)],
            256,
        ),
        (
            &[
                ("top", 320, 0),
                ("mid", 256, 0),
                ("old", 192, 0x22),
                ("new", 320, 0x11),
            ],
            192,
        ),
        (
            &[
                ("top", 320, 0),
                ("mid", 256, 0x33),
                ("old", 192, 0x22),
                ("new", 320, 0x11),
            ],
            256,
        ),
        (&[("top", 320, 0), ("old", 128, 0), ("new", 320, 0x11)], 128),
    ];
    for opts in ["cluster_size=64k", "extended_l2=on,cluster_size=64k"] {
        for &(layers, zeros_from) in chains {
            let q = Dir::new();
            for (i, &(name, kib, pattern)) in layers.iter().enumerate().rev() {
                let file = format!("{name}.qcow2");
                let size = format!("{kib}k");
                let mut args = vec!["create", "-q", "-f", "qcow2", "-o", opts];
                let below = layers.get(i + 1).map(|l| format!("{}.qcow2", l.0));
                if let Some(b) = &below {
                    args.extend_from_slice(&["-b", b, "-F", "qcow2"]);
                }
                args.extend_from_slice(&[&file, &size]);
                q.qemu_img(&args);
                if pattern != 0 {
                    let w = format!("write -P {pattern:#x} 0 {kib}k");
                    q.qemu_io("qcow2", &file, &[&w]);
                }
            }
            // Data of the top itself must stay as it is.
            q.qemu_io("qcow2", "top.qcow2", &["write -P 0x44 40k 16k"]);
            let o = Dir::new();
            for l in layers.iter() {
                let file = format!("{}.qcow2", l.0);
                std::fs::copy(q.path(&file), o.path(&file)).expect("copy image");
            }
            let what = format!("{opts}: {layers:?}");
            let args = [
                "rebase",
                "-q",
                "-b",
                "new.qcow2",
                "-F",
                "qcow2",
                "top.qcow2",
            ];
            q.qemu_img(&args);
            assert_eq!(o.ok(BIN, &args), "", "{what}");
            o.assert_check_clean("top.qcow2");
            let zeros = format!("read -P 0 {zeros_from}k {}k", 320 - zeros_from);
            o.qemu_io("qcow2", "top.qcow2", &[&zeros, "read -P 0x44 40k 16k"]);
            let same = q
                .run(
                    "qemu-img",
                    &[
                        "compare",
                        "-f",
                        "qcow2",
                        "-F",
                        "qcow2",
                        "top.qcow2",
                        &o.s("top.qcow2"),
                    ],
                )
                .status;
            assert!(same.success(), "{what}: top differs from QEMU's");
            let diff = compare_maps(
                &own_map(&o, "top.qcow2"),
                &own_map(&q, "top.qcow2"),
                320 << 10,
                None,
            );
            assert!(
                diff.mismatches.is_empty(),
                "{what}: map {:?}",
                diff.mismatches
            );
        }
    }
}

/// An image without a backing file reads zeros where it allocates nothing; rebased onto a
/// file with data there, it must keep reading zeros, with zero clusters as QEMU writes them
/// (as zero data on version 2 images, where QEMU lets the new backing file show through).
#[test]
fn rebase_of_an_image_without_backing_keeps_its_zeros() {
    for opts in [
        "cluster_size=64k",
        "extended_l2=on,cluster_size=64k",
        "compat=0.10",
    ] {
        let q = Dir::new();
        for f in ["t.qcow2", "n.qcow2"] {
            q.qemu_img(&["create", "-q", "-f", "qcow2", "-o", opts, f, "384k"]);
        }
        q.qemu_io("qcow2", "t.qcow2", &["write -P 0x22 0 128k"]);
        q.qemu_io(
            "qcow2",
            "n.qcow2",
            &["write -P 0x11 64k 64k", "write -P 0x11 256k 64k"],
        );
        let o = Dir::new();
        for f in ["t.qcow2", "n.qcow2"] {
            std::fs::copy(q.path(f), o.path(f)).expect("copy image");
        }
        let args = ["rebase", "-q", "-b", "n.qcow2", "-F", "qcow2", "t.qcow2"];
        q.qemu_img(&args);
        assert_eq!(o.ok(BIN, &args), "", "{opts}");
        o.assert_check_clean("t.qcow2");
        o.qemu_io(
            "qcow2",
            "t.qcow2",
            &["read -P 0x22 0 128k", "read -P 0 128k 256k"],
        );
        if opts == "compat=0.10" {
            // Without zero flags qemu-img leaves the range unallocated, so the new backing
            // file's data shows through: we write zeros as data instead.
            continue;
        }
        let diff = compare_maps(
            &own_map(&o, "t.qcow2"),
            &own_map(&q, "t.qcow2"),
            384 << 10,
            None,
        );
        assert!(
            diff.mismatches.is_empty(),
            "{opts}: map {:?}",
            diff.mismatches
        );
    }
}

/// `-b` names the base as the chain stores backing file names: a relative name against the
/// directory of the image above it, never against the working directory.
#[test]
fn commit_base_names_are_relative_to_the_overlay_as_in_qemu() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        std::fs::create_dir(d.path("subdir")).expect("mkdir");
        d.create("subdir/t.base", "qcow2", "", None, "1M");
        d.create(
            "subdir/t.mid",
            "qcow2",
            "",
            Some(("subdir/t.base", "qcow2")),
            "1M",
        );
        d.create(
            "subdir/t",
            "qcow2",
            "",
            Some(("subdir/t.mid", "qcow2")),
            "1M",
        );
    });
    for args in [
        &["commit", "-b", "subdir/t.mid", "subdir/t"][..],
        &["commit", "-b", "t.mid", "subdir/t"],
        &["commit", "-b", "t.base", "subdir/t"],
    ] {
        p.same(args);
    }
}
