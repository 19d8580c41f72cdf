//! NBD names as image names: a real qemu-nbd serves an image, and qemu-img and our binary
//! are given the same NBD name (`nbd+unix://`, `nbd://`, the legacy `nbd:` form, `json:`
//! with an `nbd` file node); both must print the same and read the same bytes.

use std::process::Output;

use test_support::Dir;

use crate::common::BIN;

#[allow(dead_code)]
#[path = "../serve/support/qemu_nbd.rs"]
mod qemu_nbd;

use qemu_nbd::QemuNbd;

/// A 4 MiB raw image with data at a few places and holes between.
fn raw_image(d: &Dir) -> std::path::PathBuf {
    d.create("a.raw", "raw", "", None, "4M");
    d.qemu_io(
        "raw",
        "a.raw",
        &[
            "write -P 0x11 0 64k",
            "write -P 0x22 1M 192k",
            "write -P 0x33 3M 4k",
        ],
    );
    d.path("a.raw")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// qemu-img and our binary run with the same arguments: (QEMU's output, ours).
fn both(d: &Dir, args: &[&str]) -> (Output, Output) {
    (d.run("qemu-img", args), d.run(BIN, args))
}

fn assert_same(d: &Dir, args: &[&str]) {
    let (q, o) = both(d, args);
    assert_eq!(
        (text(&o.stdout), o.status.code()),
        (text(&q.stdout), q.status.code()),
        "{args:?}: ours (left) and qemu-img (right) differ; our stderr: {}",
        text(&o.stderr)
    );
}

#[test]
fn info_map_and_compare_of_an_nbd_export_print_what_qemu_img_prints() {
    let d = Dir::new();
    let image = raw_image(&d);
    d.copy("a.raw", "copy.raw");
    let server = QemuNbd::unix(&["-f", "raw", "-r"], &image);
    let sock = server.socket.display().to_string();
    let names = [
        format!("nbd+unix:///?socket={sock}"),
        format!("nbd:unix:{sock}"),
        format!(
            r#"json:{{"driver":"raw","file":{{"driver":"nbd","server":{{"type":"unix","path":"{sock}"}}}}}}"#
        ),
    ];
    for name in &names {
        assert_same(&d, &["info", name]);
        assert_same(&d, &["map", "--output=json", name]);
        assert_same(&d, &["map", name]);
        assert_same(&d, &["compare", name, &d.s("copy.raw")]);
    }
    // A difference is found as qemu-img finds it.
    d.qemu_io("raw", "copy.raw", &["write -P 0x44 2M 512"]);
    assert_same(&d, &["compare", &names[0], &d.s("copy.raw")]);
}

#[test]
fn qcow2_served_as_bytes_is_probed_and_read_over_nbd() {
    let d = Dir::new();
    d.create("img.qcow2", "qcow2", "", None, "4M");
    d.qemu_io(
        "qcow2",
        "img.qcow2",
        &["write -P 0x55 64k 128k", "write -z 2M 64k"],
    );
    let server = QemuNbd::unix(&["-f", "raw", "-r"], &d.path("img.qcow2"));
    let name = server.uri_of("");
    assert_same(&d, &["map", "--output=json", &name]);
    assert_same(&d, &["map", "-f", "qcow2", "--output=json", &name]);
    let out = d.ok(BIN, &["info", &name]);
    assert!(out.contains("file format: qcow2"), "{out}");
    d.ok(BIN, &["convert", "-O", "raw", &name, &d.s("out.raw")]);
    d.ok(
        "qemu-img",
        &[
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            &d.s("img.qcow2"),
            &d.s("out.raw"),
        ],
    );
}

#[test]
fn convert_reads_from_and_writes_to_an_nbd_export() {
    let d = Dir::new();
    let image = raw_image(&d);
    d.create("target.raw", "raw", "", None, "4M");
    let src = QemuNbd::unix(&["-f", "raw", "-r"], &image);
    let dst = QemuNbd::unix(&["-f", "raw"], &d.path("target.raw"));
    // From NBD into a new qcow2 image.
    d.ok(
        BIN,
        &["convert", "-O", "qcow2", &src.uri_of(""), &d.s("out.qcow2")],
    );
    d.ok(
        "qemu-img",
        &["compare", "-F", "qcow2", &d.s("a.raw"), &d.s("out.qcow2")],
    );
    // From a file into the existing export (`-n`: an export is not created).
    d.ok(
        BIN,
        &[
            "convert",
            "-n",
            "-O",
            "raw",
            &d.s("out.qcow2"),
            &dst.uri_of(""),
        ],
    );
    drop(src);
    dst.stop();
    d.ok(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &d.s("a.raw"),
            &d.s("target.raw"),
        ],
    );
}

#[test]
fn create_takes_the_size_of_an_nbd_backing_file() {
    let d = Dir::new();
    let image = raw_image(&d);
    let server = QemuNbd::unix(&["-f", "raw", "-r"], &image);
    let name = server.uri_of("");
    let args = ["create", "-f", "qcow2", "-b", &name, "-F", "raw"];
    let theirs = d.s("theirs.qcow2");
    let ours = d.s("ours.qcow2");
    let q = d.ok("qemu-img", &[&args[..], &[theirs.as_str()]].concat());
    let o = d.ok(BIN, &[&args[..], &[ours.as_str()]].concat());
    assert_eq!(o.replace(&ours, "X"), q.replace(&theirs, "X"));
    assert_eq!(d.info("ours.qcow2")["virtual-size"], 4 << 20);
}

#[test]
fn an_unreachable_server_is_refused_with_qemu_imgs_reason() {
    let d = Dir::new();
    let name = format!("nbd+unix:///?socket={}", d.s("nobody.sock"));
    for cmd in ["info", "map", "compare"] {
        let mut args = vec![cmd, name.as_str()];
        if cmd == "compare" {
            args.push(name.as_str());
        }
        let (q, o) = both(&d, &args);
        assert_eq!(o.status.code(), q.status.code());
        // The name is shown normalized (as `info` shows it); the reason is QEMU's.
        let reason = |e: &[u8]| text(e).split_once("': ").map(|(_, r)| r.to_string());
        assert_eq!(reason(&o.stderr), reason(&q.stderr));
        assert!(text(&o.stderr).starts_with("qcow2-nbd: Could not open 'nbd+unix://"));
    }
}

#[test]
fn check_dd_and_measure_of_an_nbd_export_match_qemu_img() {
    let d = Dir::new();
    let image = raw_image(&d);
    let server = QemuNbd::unix(&["-f", "raw", "-r"], &image);
    let name = server.uri_of("");
    assert_same(&d, &["check", &name]);
    assert_same(&d, &["check", "-f", "raw", &name]);
    assert_same(&d, &["measure", "-O", "qcow2", &name]);
    let (q, o) = (d.s("q.raw"), d.s("o.raw"));
    d.ok(
        "qemu-img",
        &["dd", &format!("if={name}"), &format!("of={q}"), "bs=64k"],
    );
    d.ok(
        BIN,
        &["dd", &format!("if={name}"), &format!("of={o}"), "bs=64k"],
    );
    assert_eq!(d.read("o.raw"), d.read("q.raw"));
}

/// A qcow2 image inside an export (an OVA's disk written through `qemu-nbd -f raw`) is
/// checked as qemu-img checks it: the same report, the same end offset.
#[test]
fn check_of_a_qcow2_image_in_an_export_matches_qemu_img() {
    let d = Dir::new();
    d.create("c.qcow2", "qcow2", "", None, "4M");
    d.qemu_io(
        "qcow2",
        "c.qcow2",
        &["write -P 0x11 0 64k", "write -P 0x22 1M 4k"],
    );
    let server = QemuNbd::unix(&["-f", "raw", "-r"], &d.path("c.qcow2"));
    let name = server.uri_of("");
    assert_same(&d, &["check", &name]);
    assert_same(&d, &["check", "-f", "qcow2", &name]);
    let (q, o) = both(&d, &["check", "--output=json", &name]);
    let json = |out: &Output| -> serde_json::Value { serde_json::from_slice(&out.stdout).unwrap() };
    assert_eq!(json(&o)["image-end-offset"], json(&q)["image-end-offset"]);
    assert_eq!(json(&o)["check-errors"], json(&q)["check-errors"]);
    assert_eq!(o.status.code(), q.status.code());
}

/// `x-dirty-bitmap` takes block status from another metadata context, read as
/// `base:allocation` flags: `map` then shows a dirty bitmap, or the allocation depth (with
/// depths above 2 read as 2), exactly as qemu-img shows them. A context the server does not
/// offer is refused as qemu-img refuses it, but named: qemu-img's `map` loses its own reason
/// there ("Could not open image: Invalid argument"), so ours says what its `nbd` driver says.
#[test]
fn map_with_x_dirty_bitmap_shows_what_qemu_img_shows() {
    let d = Dir::new();
    d.create("base.qcow2", "qcow2", "", None, "4M");
    d.qemu_io("qcow2", "base.qcow2", &["write 0 2M"]);
    d.create(
        "top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "4M",
    );
    d.qemu_img(&["bitmap", "--add", &d.s("top.qcow2"), "b"]);
    d.qemu_io("qcow2", "top.qcow2", &["write 1M 2M"]);
    let server = QemuNbd::unix(
        &["-r", "-f", "qcow2", "-A", "-B", "b"],
        &d.path("top.qcow2"),
    );
    let sock = server.socket.display().to_string();
    let node = format!("driver=nbd,server.type=unix,server.path={sock}");
    for context in [
        "",
        ",x-dirty-bitmap=qemu:allocation-depth",
        ",x-dirty-bitmap=qemu:dirty-bitmap:b",
    ] {
        let opts = format!("{node}{context}");
        assert_same(&d, &["map", "--output=json", "--image-opts", &opts]);
    }
    let missing = format!("{node},x-dirty-bitmap=qemu:dirty-bitmap:nope");
    let (q, o) = both(&d, &["map", "--output=json", "--image-opts", &missing]);
    assert_eq!(o.status.code(), q.status.code());
    assert!(
        text(&o.stderr).ends_with("': requested x-dirty-bitmap qemu:dirty-bitmap:nope not found\n"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn an_unaligned_export_maps_in_the_servers_blocks_as_qemu_img_maps_it() {
    let d = Dir::new();
    std::fs::write(d.path("u.raw"), vec![b'0'; 1000]).unwrap();
    // Without -f qemu-nbd probes and serves whole 512-byte blocks; with it, single bytes.
    for args in [&[][..], &["-f", "raw"][..]] {
        let server = QemuNbd::unix(args, &d.path("u.raw"));
        let sock = server.socket.display().to_string();
        assert_same(
            &d,
            &[
                "map",
                "-f",
                "raw",
                "--output=json",
                &format!("nbd:unix:{sock}"),
            ],
        );
    }
}

/// An export keeps its size and its old bytes: a new image written over an old one must not
/// inherit the old L1 table, and metadata preallocation past the export's end fails with
/// qemu-img's words instead of mapping clusters the export does not have.
#[test]
fn create_over_an_export_holding_an_old_image_starts_clean() {
    let d = Dir::new();
    d.create("small.raw", "raw", "", None, "1M");
    let server = QemuNbd::unix(&["-f", "raw"], &d.path("small.raw"));
    let name = server.uri_of("");
    let prealloc = [
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "preallocation=metadata",
        &name,
        "64M",
    ];
    let (q, o) = both(&d, &prealloc);
    assert!(!q.status.success() && !o.status.success(), "both refuse");
    let reason = |out: &Output| {
        let e = text(&out.stderr);
        e.split_once(": ")
            .map(|(_, r)| r.trim().to_string())
            .unwrap_or(e)
    };
    assert_eq!(reason(&o), reason(&q), "ours (left) and qemu-img (right)");
    // qemu-img's failed attempt left its L1 and L2 tables in the export; ours starts over.
    d.ok(BIN, &["create", "-q", "-f", "qcow2", &name, "64M"]);
    let check = d.run("qemu-img", &["check", "-f", "qcow2", &name]);
    assert!(check.status.success(), "{}", text(&check.stdout));
    assert!(text(&check.stdout).contains("No errors were found"));
}
