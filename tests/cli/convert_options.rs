//! `convert -n`, `-B`, `-S` and several sources, side by side with qemu-img: the same command
//! line on the same files must exit the same way, print the same, and leave a target with
//! the same map (allocation, zero clusters, compression and data offsets), as clean and
//! reading the same as qemu-img's.

use test_support::Dir;

use crate::common::{parse_map, Run};

use crate::qemu_img_options::Pair;

/// `qemu-img map --output=json` of `image` in `d`, as runs that say what each guest range
/// is: allocated or not, zeros, data, compressed, and whether its data has a host offset.
/// The offsets themselves (the engine's own layout) are left out, and so is the difference
/// between data and zeros within host clusters (qemu-img reports zeros where the host file
/// has a hole): the engine leaves holes where QEMU writes zeros into a newly allocated
/// cluster, and both read as zeros.
fn map(d: &Dir, fmt: &str, image: &str) -> Vec<Run> {
    let json = d.qemu_img(&["map", "--output=json", "-f", fmt, image]);
    let mut out: Vec<Run> = Vec::new();
    for mut r in parse_map(&json) {
        if r.offset.is_some() {
            r.data = true;
            r.zero = false;
        }
        r.offset = r.offset.map(|_| 0);
        match out.last_mut() {
            Some(l)
                if l.start + l.length == r.start
                    && Run {
                        start: l.start,
                        length: l.length,
                        ..r
                    } == *l =>
            {
                l.length += r.length;
            }
            _ => out.push(r),
        }
    }
    out
}

/// Runs `args` in both directories with the same outcome; on success the `target` (of
/// format `fmt`) must map the same in both, pass `qemu-img check` (qcow2) and read the same.
pub fn same_target(p: &Pair, args: &[&str], target: &str, fmt: &str) {
    let out = p.same(args);
    if !out.status.success() {
        return;
    }
    assert_eq!(
        map(&p.ours, fmt, target),
        map(&p.qemu, fmt, target),
        "{args:?}: the maps of {target}, ours (left) and QEMU's (right), differ"
    );
    if fmt == "qcow2" {
        p.ours.assert_check_clean(target);
    }
    let (q, o) = (p.qemu.s(target), p.ours.s(target));
    let cmp = p.ours.qemu_img(&["compare", "-f", fmt, "-F", fmt, &q, &o]);
    assert!(cmp.contains("Images are identical"), "{args:?}: {cmp}");
}

/// A 4 MiB qcow2 source over a backing file: data in both layers, zeros written as data,
/// zero clusters, and a top layer larger than its backing file.
fn chain(d: &Dir) {
    d.create("base.qcow2", "qcow2", "", None, "3M");
    d.qemu_io("qcow2", "base.qcow2", &["write -P 0x11 0 3M"]);
    d.create(
        "top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "4M",
    );
    d.qemu_io(
        "qcow2",
        "top.qcow2",
        &[
            "write -P 0x22 64k 64k",
            "write -P 0 256k 128k",
            "write -z 512k 64k",
            "write -P 0x33 1M 4k",
            "write -P 0x44 3584k 64k",
        ],
    );
}

#[test]
fn convert_n_writes_into_an_existing_image() {
    let p = Pair::new(|d| {
        chain(d);
        // Targets with data where the source reads zeros, with and without zero flags,
        // and with a backing file of their own.
        for (name, opts) in [("t3.qcow2", "compat=1.1"), ("t2.qcow2", "compat=0.10")] {
            d.create(name, "qcow2", opts, None, "4M");
            d.qemu_io("qcow2", name, &["write -P 0x55 0 4M"]);
        }
        d.create("e3.qcow2", "qcow2", "", None, "4M");
        d.create("e2.qcow2", "qcow2", "compat=0.10", None, "4M");
        d.create("c3.qcow2", "qcow2", "", None, "4M");
        d.create(
            "b2.qcow2",
            "qcow2",
            "compat=0.10",
            Some(("base.qcow2", "qcow2")),
            "4M",
        );
        d.create("r.raw", "raw", "", None, "4M");
        d.qemu_io("raw", "r.raw", &["write -P 0x66 0 4M"]);
        d.create("small.qcow2", "qcow2", "", None, "1M");
    });
    for t in ["t3.qcow2", "t2.qcow2", "e3.qcow2", "e2.qcow2", "b2.qcow2"] {
        same_target(
            &p,
            &["convert", "-n", "-O", "qcow2", "top.qcow2", t],
            t,
            "qcow2",
        );
    }
    same_target(&p, &["convert", "-n", "top.qcow2", "r.raw"], "r.raw", "raw");
    same_target(
        &p,
        &[
            "convert",
            "-n",
            "-c",
            "-O",
            "qcow2",
            "top.qcow2",
            "c3.qcow2",
        ],
        "c3.qcow2",
        "qcow2",
    );
    // What qemu-img refuses.
    p.same(&["convert", "-n", "-O", "qcow2", "top.qcow2", "small.qcow2"]);
    p.same(&[
        "convert",
        "-n",
        "-O",
        "qcow2",
        "-o",
        "compat=1.1",
        "top.qcow2",
        "t3.qcow2",
    ]);
    p.same(&[
        "convert",
        "--target-is-zero",
        "-O",
        "qcow2",
        "top.qcow2",
        "new.qcow2",
    ]);
}

#[test]
fn convert_b_leaves_to_the_backing_file_what_the_source_does() {
    let p = Pair::new(chain);
    for extra in [&[][..], &["-c"], &["-o", "compat=0.10"], &["-S", "0"]] {
        let mut args = vec!["convert", "-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["top.qcow2", "out.qcow2"]);
        same_target(&p, &args, "out.qcow2", "qcow2");
    }
    same_target(
        &p,
        &[
            "convert",
            "-O",
            "qcow2",
            "-o",
            "backing_file=base.qcow2,backing_fmt=qcow2",
            "top.qcow2",
            "o.qcow2",
        ],
        "o.qcow2",
        "qcow2",
    );
    // What qemu-img refuses.
    p.same(&[
        "convert",
        "-O",
        "qcow2",
        "-B",
        "base.qcow2",
        "top.qcow2",
        "x.qcow2",
    ]);
    p.same(&[
        "convert",
        "-B",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
        "x.raw",
    ]);
    p.same(&[
        "convert",
        "-O",
        "qcow2",
        "-B",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
        "base.qcow2",
        "x.qcow2",
    ]);
}

#[test]
fn convert_t_takes_every_cache_mode() {
    let p = Pair::new(chain);
    for mode in ["none", "writeback", "writethrough", "directsync", "unsafe"] {
        let target = format!("{mode}.qcow2");
        same_target(
            &p,
            &["convert", "-t", mode, "-O", "qcow2", "top.qcow2", &target],
            &target,
            "qcow2",
        );
        let target = format!("{mode}.raw");
        same_target(
            &p,
            &["convert", "-t", mode, "top.qcow2", &target],
            &target,
            "raw",
        );
    }
    // A mode that does not exist is refused before anything is created, naming the modes.
    let out = p.ours.run(
        p.ours.path("qemu-img"),
        &["convert", "-t", "fast", "top.qcow2", "fast.raw"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("writethrough"),
        "{err}"
    );
    assert!(!p.ours.path("fast.raw").exists());
}

#[test]
fn convert_s_sets_the_sparse_detection_size() {
    let p = Pair::new(|d| {
        chain(d);
        d.create("k.qcow2", "qcow2", "cluster_size=1k", None, "1M");
        d.qemu_io(
            "qcow2",
            "k.qcow2",
            &[
                "write -P 0 0 64k",
                "write -P 1 0 1k",
                "write -P 2 8k 1k",
                "write -P 3 17k 1k",
                "write -P 0 65k 1k",
            ],
        );
    });
    for s in ["0", "512", "4k", "8k", "64k"] {
        for compress in [false, true] {
            let mut args = vec!["convert", "-O", "qcow2", "-o", "cluster_size=1k", "-S", s];
            if compress {
                args.push("-c");
            }
            args.extend_from_slice(&["k.qcow2", "out.qcow2"]);
            same_target(&p, &args, "out.qcow2", "qcow2");
        }
        same_target(
            &p,
            &["convert", "-S", s, "top.qcow2", "out.raw"],
            "out.raw",
            "raw",
        );
    }
    same_target(
        &p,
        &[
            "convert",
            "-O",
            "qcow2",
            "-S",
            "0",
            "top.qcow2",
            "full.qcow2",
        ],
        "full.qcow2",
        "qcow2",
    );
    for bad in ["1000", "32M", "x", "-1"] {
        p.same(&["convert", "-S", bad, "top.qcow2", "bad.raw"]);
    }
}

#[test]
fn convert_concatenates_several_sources() {
    let p = Pair::new(|d| {
        for (name, size, pattern) in [("a.qcow2", "1023k", 0x11), ("b.qcow2", "1M", 0x22)] {
            d.create(name, "qcow2", "cluster_size=1k", None, size);
            let at_end = format!("write -P {pattern} 1020k 3k");
            d.qemu_io(
                "qcow2",
                name,
                &[&format!("write -P {pattern} 16k 130k"), &at_end],
            );
        }
        d.create("c.raw", "raw", "", None, "64k");
        d.qemu_io("raw", "c.raw", &["write -P 0x33 0 4k"]);
    });
    for extra in [&[][..], &["-c"]] {
        let mut args = vec!["convert", "-O", "qcow2"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["a.qcow2", "b.qcow2", "c.raw", "all.qcow2"]);
        same_target(&p, &args, "all.qcow2", "qcow2");
    }
    same_target(
        &p,
        &["convert", "a.qcow2", "c.raw", "b.qcow2", "all.raw"],
        "all.raw",
        "raw",
    );
    p.same(&["convert", "-l", "snap", "a.qcow2", "b.qcow2", "x.raw"]);
    p.same(&[
        "convert",
        "--bitmaps",
        "-O",
        "qcow2",
        "a.qcow2",
        "b.qcow2",
        "x.qcow2",
    ]);
}

#[test]
fn convert_p_prints_qemu_img_progress_lines() {
    let p = Pair::new(|d| {
        d.create("s.qcow2", "qcow2", "", None, "128M");
        d.qemu_io(
            "qcow2",
            "s.qcow2",
            &["write 0 1M", "write 2M 1M", "write 4M 1M", "write 32M 1M"],
        );
        d.create("e.qcow2", "qcow2", "", None, "16M");
    });
    for args in [
        &["convert", "-p", "-O", "qcow2", "s.qcow2", "o.qcow2"][..],
        &["convert", "-p", "s.qcow2", "o.raw"],
        &[
            "convert", "-p", "-S", "0", "-O", "qcow2", "e.qcow2", "f.qcow2",
        ],
        &["convert", "-p", "e.qcow2", "e.raw"],
        &["convert", "-p", "-q", "s.qcow2", "q.raw"],
        &["convert", "-O", "qcow2", "s.qcow2", "n.qcow2"],
    ] {
        p.same(args);
    }
}

#[test]
fn options_may_come_between_the_image_names() {
    let p = Pair::new(|d| {
        d.qemu_img(&["create", "-q", "-f", "qcow2", "s.qcow2", "1M"]);
        d.qemu_io("qcow2", "s.qcow2", &["write -P 7 0 64k"]);
        d.qemu_img(&["snapshot", "-c", "sn1", "s.qcow2"]);
        d.qemu_io("qcow2", "s.qcow2", &["write -P 8 0 64k"]);
    });
    same_target(
        &p,
        &["convert", "s.qcow2", "-l", "sn1", "-O", "qcow2", "t.qcow2"],
        "t.qcow2",
        "qcow2",
    );
    same_target(
        &p,
        &["convert", "s.qcow2", "-O", "raw", "t.raw"],
        "t.raw",
        "raw",
    );
    // One name only: nothing to copy.
    p.same(&["convert", "s.qcow2"]);
}
