//! LUKS volumes (QEMU's `luks` driver: a LUKS header, then the enciphered disk, no qcow2)
//! against QEMU: a volume we create reads back identically through qemu-io and qemu-img, one
//! qemu-img creates reads identically through us, our writes read back through QEMU, and
//! `info`, `check`, `measure`, `resize` and key-slot `amend` answer as qemu-img does.

use test_support::{text, Dir};

use crate::common::BIN;

const SECRET: &str = "secret,id=sec0,data=astrochicken";
/// A second secret, for a second key slot.
const SECRET1: &str = "secret,id=sec1,data=furby";
const CREATE_OPTS: &str = "key-secret=sec0,iter-time=10";

/// `--image-opts` string of the volume `image` with the secret `sec0`.
fn spec(d: &Dir, image: &str) -> String {
    format!("driver=luks,key-secret=sec0,file.filename={}", d.s(image))
}

/// qemu-io on a volume; every command must succeed.
fn qemu_io(d: &Dir, image: &str, cmds: &[&str]) -> String {
    let spec = spec(d, image);
    let mut args = vec!["--object", SECRET];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.extend(["--image-opts", &spec]);
    let out = d.ok("qemu-io", &args);
    assert!(
        !out.contains("failed") && !out.contains("error") && !out.contains("Pattern"),
        "qemu-io {cmds:?} on {image}: {out}"
    );
    out
}

/// `create -f luks` of `image` by `tool` (ours or qemu-img), secret `sec0`.
fn create(d: &Dir, tool: &str, image: &str, size: &str) {
    let path = d.s(image);
    let args = [
        "create",
        "-q",
        "-f",
        "luks",
        "--object",
        SECRET,
        "-o",
        CREATE_OPTS,
        &path,
        size,
    ];
    let out = d.run(tool, &args);
    assert!(out.status.success(), "{tool} create: {}", text(&out));
}

/// Runs ours with `args`, which must succeed; returns stdout and stderr.
fn ours(d: &Dir, args: &[&str]) -> String {
    let out = d.run(BIN, args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    text(&out)
}

const WRITES: &[&str] = &["write -P 0x5c 4096 70000", "write -P 0xa1 3M 1000"];
const READS: &[&str] = &[
    "read -P 0x5c 4096 70000",
    "read -P 0xa1 3M 1000",
    "read -P 0 1M 1M",
];

#[test]
fn a_volume_we_create_reads_through_qemu_and_ours_read_qemus() {
    for (maker, reader) in [(BIN, "qemu-img"), ("qemu-img", BIN)] {
        let d = Dir::new();
        create(&d, maker, "v.luks", "4M");
        // Unwritten sectors of a volume read as noise: the test writes every byte it reads.
        qemu_io(&d, "v.luks", &["write -P 0 0 4M"]);
        qemu_io(&d, "v.luks", WRITES);
        d.create("p.raw", "raw", "", None, "4M");
        d.qemu_io("raw", "p.raw", WRITES);
        let v = spec(&d, "v.luks");
        let p = format!("driver=raw,file.filename={}", d.s("p.raw"));
        let out = d.run(
            reader,
            &["compare", "--object", SECRET, "--image-opts", &v, &p],
        );
        assert!(
            out.status.success() && text(&out).contains("Images are identical."),
            "made by {maker}, compared by {reader}: {}",
            text(&out)
        );
    }
}

#[test]
fn our_writes_read_back_through_qemu_io() {
    let d = Dir::new();
    create(&d, "qemu-img", "v.luks", "4M");
    d.create("p.raw", "raw", "", None, "4M");
    d.qemu_io("raw", "p.raw", WRITES);
    // convert -n writes every sector of the existing volume, zeros included.
    let v = spec(&d, "v.luks");
    let p = d.s("p.raw");
    ours(
        &d,
        &[
            "convert",
            "-n",
            "--object",
            SECRET,
            "-f",
            "raw",
            "--target-image-opts",
            &p,
            &v,
        ],
    );
    qemu_io(&d, "v.luks", READS);
    // The same through a `json:` name.
    qemu_io(&d, "v.luks", &["write -P 0x11 0 4M"]);
    let v = format!(
        r#"json:{{"driver":"luks","key-secret":"sec0","file":{{"filename":"{}"}}}}"#,
        d.s("v.luks")
    );
    ours(
        &d,
        &[
            "convert", "-n", "--object", SECRET, "-f", "raw", "-O", "luks", &p, &v,
        ],
    );
    qemu_io(&d, "v.luks", READS);
    // And a new volume made by convert -O luks.
    let n = d.s("n.luks");
    ours(
        &d,
        &[
            "convert",
            "--object",
            SECRET,
            "-f",
            "raw",
            "-O",
            "luks",
            "-o",
            CREATE_OPTS,
            &p,
            &n,
        ],
    );
    qemu_io(&d, "n.luks", READS);
}

#[test]
fn info_check_and_measure_answer_as_qemu_img() {
    let d = Dir::new();
    create(&d, "qemu-img", "v.luks", "4M");
    let path = d.s("v.luks");
    for args in [
        vec!["info", path.as_str()],
        vec!["info", "--output=json", path.as_str()],
        vec!["info", "-f", "luks", path.as_str()],
    ] {
        let ours = ours(&d, &args);
        let theirs = d.ok("qemu-img", &args);
        assert_eq!(ours, theirs, "{args:?}");
    }
    let v = spec(&d, "v.luks");
    let check = ["check", "--object", SECRET, "--image-opts", v.as_str()];
    for tool in [BIN, "qemu-img"] {
        let out = d.run(tool, &check);
        assert_eq!(out.status.code(), Some(63), "{tool}: {}", text(&out));
        assert!(text(&out).contains("This image format does not support checks"));
    }
    let measure = [
        "measure",
        "--object",
        SECRET,
        "-O",
        "luks",
        "-o",
        "key-secret=sec0",
        "--size",
        "1G",
    ];
    assert_eq!(ours(&d, &measure), d.ok("qemu-img", &measure));
    let measure128 = [
        "measure",
        "--object",
        SECRET,
        "-O",
        "luks",
        "-o",
        "key-secret=sec0,cipher-alg=aes-128",
        "--size",
        "5M",
    ];
    assert_eq!(ours(&d, &measure128), d.ok("qemu-img", &measure128));
    // Without a secret, both refuse.
    let unnamed = ["measure", "-O", "luks", "--size", "5M"];
    for tool in [BIN, "qemu-img"] {
        let out = d.run(tool, &unnamed);
        assert!(!out.status.success(), "{tool}");
        assert!(text(&out).contains("Parameter 'key-secret' is required for cipher"));
    }
}

#[test]
fn resize_keeps_the_data_and_the_header() {
    let d = Dir::new();
    create(&d, BIN, "v.luks", "2M");
    qemu_io(&d, "v.luks", &["write -P 0x33 0 2M"]);
    let v = spec(&d, "v.luks");
    ours(
        &d,
        &["resize", "--object", SECRET, "--image-opts", &v, "6M"],
    );
    let info = d.ok("qemu-img", &["info", &d.s("v.luks")]);
    assert!(
        info.contains("virtual size: 6 MiB (6291456 bytes)"),
        "{info}"
    );
    qemu_io(&d, "v.luks", &["read -P 0x33 0 2M"]);
}

#[test]
fn amend_adds_a_key_slot_qemu_then_opens_with() {
    let d = Dir::new();
    create(&d, "qemu-img", "v.luks", "1M");
    qemu_io(&d, "v.luks", &["write -P 0x7e 0 1M"]);
    let v = spec(&d, "v.luks");
    ours(
        &d,
        &[
            "amend",
            "--object",
            SECRET,
            "--object",
            SECRET1,
            "-o",
            "state=active,new-secret=sec1,iter-time=10",
            "--image-opts",
            &v,
        ],
    );
    let with_second = format!(
        "driver=luks,key-secret=sec1,file.filename={}",
        d.s("v.luks")
    );
    d.ok(
        "qemu-io",
        &[
            "--object",
            SECRET1,
            "-c",
            "read -P 0x7e 0 1M",
            "--image-opts",
            &with_second,
        ],
    );
}

#[test]
fn a_secret_that_is_not_utf8_is_refused_and_the_file_removed() {
    let d = Dir::new();
    std::fs::write(d.path("s"), b"\x3a\x3c\x3b\xff").unwrap();
    let secret = format!("secret,id=sec0,file={}", d.s("s"));
    let path = d.s("v.luks");
    std::fs::write(&path, b"was here").unwrap();
    let out = d.run(
        BIN,
        &[
            "create",
            "-f",
            "luks",
            "--object",
            &secret,
            "-o",
            "key-secret=sec0",
            &path,
            "4M",
        ],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Data from secret sec0 is not valid UTF-8"),
        "{}",
        text(&out)
    );
    assert!(!d.path("v.luks").exists());
}
