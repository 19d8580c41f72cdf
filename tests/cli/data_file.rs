//! External data files (`-o data_file=...,data_file_raw=...`) created as qemu-img creates
//! them: the same "Formatting" line and refusals, an image QEMU reads with its data in the
//! data file, and with `data_file_raw` (or preallocation) every cluster mapped to its own
//! offset of the data file.

use std::process::Output;

use test_support::Dir;

use crate::qemu_img_options::Pair;

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// `qemu-img ARGS` (QEMU's) in `d`.
fn qemu_img(d: &Dir, args: &[&str]) -> Output {
    test_support::qemu("qemu-img")
        .args(args)
        .current_dir(d.root())
        .output()
        .expect("run qemu-img")
}

/// Creates the same image with both tools: the same exit status and stdout, and no error.
fn create_both(p: &Pair, args: &[&str]) {
    let (q, o) = p.run(args);
    assert_eq!(
        (o.status.code(), text(&o.stdout), text(&o.stderr)),
        (q.status.code(), text(&q.stdout), text(&q.stderr)),
        "{args:?}: ours (left) and QEMU's (right) differ"
    );
}

/// What QEMU says of an image: `info`'s format-specific part and `map`, and `check`.
fn qemu_view(d: &Dir, image: &str) -> (String, String, String) {
    let info = qemu_img(d, &["info", "--output=json", image]);
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).expect("info JSON");
    let map = qemu_img(d, &["map", image]);
    let check = qemu_img(d, &["check", image]);
    (
        v["format-specific"].to_string(),
        text(&map.stdout),
        format!(
            "{:?} {}{}",
            check.status.code(),
            text(&check.stdout),
            text(&check.stderr)
        ),
    )
}

#[test]
fn images_with_a_data_file_are_qemus() {
    let p = Pair::new(|_| {});
    for (opts, size) in [
        ("data_file=d.data", "64M"),
        ("data_file=d.data,data_file_raw=on", "64M"),
        ("data_file=d.data,data_file_raw=off", "4M"),
        ("data_file=d.data,preallocation=metadata", "8M"),
        (
            "data_file=d.data,preallocation=falloc,cluster_size=4k",
            "1M",
        ),
        ("data_file=d.data,preallocation=full", "2M"),
    ] {
        create_both(&p, &["create", "-f", "qcow2", "-o", opts, "t.qcow2", size]);
        assert_eq!(
            qemu_view(&p.ours, "t.qcow2"),
            qemu_view(&p.qemu, "t.qcow2"),
            "{opts}: ours (left) and QEMU's (right) differ"
        );
        let len = |d: &Dir| {
            std::fs::metadata(d.path("d.data"))
                .expect("data file")
                .len()
        };
        assert_eq!(len(&p.ours), len(&p.qemu), "{opts}: data file size");
    }
}

#[test]
fn guest_data_lands_in_the_data_file() {
    let p = Pair::new(|_| {});
    create_both(
        &p,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file=d.data",
            "t.qcow2",
            "4M",
        ],
    );
    let d = &p.ours;
    d.qemu_io("qcow2", "t.qcow2", &["write -P 0x5a 1M 64k"]);
    let data = std::fs::read(d.path("d.data")).expect("read the data file");
    assert!(data[1 << 20..(1 << 20) + 65536].iter().all(|&b| b == 0x5a));
    let out = d.run(d.path("qemu-img"), &["check", "t.qcow2"]);
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("No errors were found on the image."));
}

#[test]
fn data_file_refusals_use_qemus_words() {
    let p = Pair::new(|d| {
        d.create("b.qcow2", "qcow2", "", None, "1M");
    });
    for args in [
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file_raw=on",
            "t.qcow2",
            "1M",
        ][..],
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file=d,compat=0.10",
            "t.qcow2",
            "1M",
        ],
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file=d,data_file_raw=on",
            "-b",
            "b.qcow2",
            "-F",
            "qcow2",
            "t.qcow2",
        ],
    ] {
        p.same(args);
    }
}

/// `--image-opts` with a `data-file` node opens the data file it names instead of the one
/// the header names, as qemu-img does: an image whose recorded data file is gone can be
/// inspected and pointed back at its data.
#[test]
fn a_data_file_node_in_image_opts_replaces_the_recorded_one() {
    let p = Pair::new(|d| {
        d.create("d.qcow2", "qcow2", "data_file=d.qcow2.data", None, "8M");
        d.qemu_io("qcow2", "d.qcow2", &["write -P 7 0 64k"]);
        qemu_img(d, &["amend", "-o", "data_file=gone", "d.qcow2"]);
    });
    let opts = "data-file.filename=d.qcow2.data,file.filename=d.qcow2";
    let info = p.same(&["info", "--image-opts", opts]);
    assert!(
        text(&info.stdout).contains("data file: gone"),
        "{}",
        text(&info.stdout)
    );
    p.same(&["map", "--output=json", "--image-opts", opts]);
    p.same(&["amend", "-o", "data_file=", "--image-opts", opts]);
    for d in [&p.qemu, &p.ours] {
        // The name is dropped: QEMU's tools need the node given again to read the data.
        let out = d.run("qemu-io", &["-c", "read 0 4k", "d.qcow2"]);
        assert!(
            text(&out.stderr).contains("'data-file' is required for this image"),
            "{}",
            text(&out.stderr)
        );
        let out = d.run(
            "qemu-io",
            &[
                "--image-opts",
                &format!("driver=qcow2,{opts}"),
                "-c",
                "read -P 7 0 64k",
            ],
        );
        let said = text(&out.stdout);
        assert!(
            out.status.success() && said.contains("read 65536/65536") && !said.contains("fail"),
            "{said}{}",
            text(&out.stderr)
        );
    }
    // Given for an image without a data file, the node is refused.
    let p = Pair::new(|d| {
        d.create("n.qcow2", "qcow2", "", None, "8M");
        d.create("x.raw", "raw", "", None, "8M");
    });
    let (q, o) = p.run(&[
        "amend",
        "-o",
        "lazy_refcounts=on",
        "--image-opts",
        "data-file.filename=x.raw,file.filename=n.qcow2",
    ]);
    let why = "'data-file' can only be set for images with an external data file";
    for out in [&q, &o] {
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).contains(why), "{}", text(&out.stderr));
    }
}
