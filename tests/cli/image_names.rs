//! Image names as qemu-img reads them, side by side with qemu-img: `--image-opts` option
//! lists, `json:{...}` pseudo-filenames and the `file:` protocol prefix must name the same
//! image and print the same lines, and names of drivers we do not have must be refused with
//! QEMU's words.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// A chain base <- top, with data in both.
fn chain(d: &Dir) {
    d.create("base.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "base.qcow2", &["write -P 0x11 0 1M"]);
    d.create(
        "top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "64M",
    );
    d.qemu_io("qcow2", "top.qcow2", &["write -P 0x22 2M 64k"]);
    d.create("r.raw", "raw", "", None, "1M");
}

#[test]
fn image_opts_on_every_reading_subcommand() {
    let p = Pair::new(chain);
    let top = "driver=qcow2,file.driver=file,file.filename=top.qcow2";
    for args in [
        &["info", "--image-opts", top][..],
        &["info", "--backing-chain", "--image-opts", top],
        &["map", "--image-opts", top],
        &["map", "--output=json", "--image-opts", top],
        &["check", "--image-opts", top],
        &[
            "compare",
            "--image-opts",
            top,
            "driver=qcow2,file.filename=top.qcow2",
        ],
        &["info", "--image-opts", "driver=raw,file.filename=r.raw"],
        // Cache tuning changes no data and is taken.
        &[
            "info",
            "--image-opts",
            "driver=qcow2,file.filename=top.qcow2,l2-cache-entry-size=4096",
        ],
        // Probed when no driver is named.
        &["info", "--image-opts", "file.filename=top.qcow2"],
    ] {
        p.same(args);
    }
}

#[test]
fn image_opts_refusals_use_qemus_words() {
    let p = Pair::new(chain);
    for args in [
        &[
            "info",
            "--image-opts",
            "-f",
            "qcow2",
            "driver=qcow2,file.filename=top.qcow2",
        ][..],
        &["info", "--image-opts", "driver=qcow2"],
        &[
            "info",
            "--image-opts",
            "driver=nosuch,file.filename=top.qcow2",
        ],
        &["info", "--image-opts", "top.qcow2,driver=qcow2"],
        &[
            "info",
            "--image-opts",
            "driver=qcow2,file.filename=top.qcow2,bogus=1",
        ],
        &[
            "info",
            "--image-opts",
            "driver=qcow2,file.filename=top.qcow2,file.bogus=1",
        ],
    ] {
        p.same(args);
    }
}

#[test]
fn json_pseudo_filenames() {
    let p = Pair::new(chain);
    for name in [
        "json:{'driver':'qcow2','file':{'driver':'file','filename':'top.qcow2'}}",
        r#"json:{"driver":"qcow2","file.filename":"top.qcow2"}"#,
        r#"json:{"file":{"filename":"top.qcow2"}}"#,
        "json:{'driver':'raw','file':{'filename':'r.raw'}}",
    ] {
        p.same(&["info", name]);
        p.same(&["map", name]);
    }
    for bad in [
        "json:[1]",
        "json:{}",
        "json:{'driver':'nosuch','file':{'filename':'top.qcow2'}}",
        "json:{'driver':'qcow2','file':'top.qcow2'}",
        "json:{'driver':'qcow2','file':{'filename':'top.qcow2'},'bogus':1}",
    ] {
        p.same(&["info", bad]);
    }
}

#[test]
fn hostile_json_names_are_refused_without_a_crash() {
    let d = Dir::new();
    // Deeper than any JSON parser should follow (a command-line argument holds at most
    // 128 KiB, so the length bound is exercised by the unit tests).
    let deep = format!("json:{}", "[".repeat(100_000));
    let nested = format!(
        "json:{{'driver':'qcow2','file.filename':'x','a':{}1{}}}",
        "{'b':".repeat(40),
        "}".repeat(40)
    );
    for name in [
        deep.as_str(),
        nested.as_str(),
        "json:{'a':'\\",
        "json:\u{1}",
    ] {
        let out = d.run(crate::common::BIN, &["info", name]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{}",
            &name[..20.min(name.len())]
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Could not parse the JSON options"),
            "unexpected message: {err}"
        );
    }
}

/// Images whose names have a colon before any slash, as a `file:` prefix allows.
fn colon_names(d: &Dir) {
    chain(d);
    d.create(
        "image:top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "64M",
    );
}

#[test]
fn the_file_protocol_prefix() {
    let p = Pair::new(colon_names);
    p.same(&["info", "file:top.qcow2"]);
    // A colon before any slash is a protocol prefix; behind `file:` it is part of the name.
    p.same(&["info", "file:image:top.qcow2"]);
    p.same(&["check", "file:image:top.qcow2"]);
    p.same(&["map", "file:image:top.qcow2"]);
    p.same(&["info", "image:top.qcow2"]);
    p.same(&["info", "nosuch:top.qcow2"]);
    // create takes the prefix too, and announces the name as given.
    for args in [
        &["create", "-f", "qcow2", "file:new:a.qcow2", "1M"][..],
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "file:new:b.qcow2",
        ],
    ] {
        let (q, o) = p.run(args);
        assert_eq!(
            (o.status.code(), String::from_utf8_lossy(&o.stdout)),
            (q.status.code(), String::from_utf8_lossy(&q.stdout)),
            "{args:?}"
        );
        assert!(
            o.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    for name in ["new:a.qcow2", "new:b.qcow2"] {
        let (q, o) = p.run(&["info", "--output=json", &format!("file:{name}")]);
        let field = |out: &std::process::Output, key: &str| {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
            v[key].clone()
        };
        for key in ["filename", "virtual-size", "backing-filename"] {
            assert_eq!(field(&o, key), field(&q, key), "{name}: {key}");
        }
    }
}

/// The first cluster of a file: the qcow2 header and its extensions.
fn header(d: &Dir, name: &str) -> Vec<u8> {
    let mut bytes = std::fs::read(d.path(name)).expect("read the image");
    bytes.truncate(65536);
    bytes
}

#[test]
fn an_unsafe_rebase_records_any_format_qemu_has() {
    let p = Pair::new(|d| {
        d.create("a.qcow2", "qcow2", "", None, "1M");
        d.create("v2.qcow2", "qcow2", "compat=0.10", None, "1M");
    });
    for image in ["a.qcow2", "v2.qcow2"] {
        p.same(&[
            "rebase",
            "-u",
            "-b",
            "/some/path",
            "-F",
            "host_device",
            image,
        ]);
        // The same header, down to the order of its extensions.
        assert_eq!(
            header(&p.ours, image),
            header(&p.qemu, image),
            "{image}: headers differ"
        );
        p.same(&["rebase", "-u", "-b", "", image]);
        assert_eq!(header(&p.ours, image), header(&p.qemu, image), "{image}");
        p.same(&["rebase", "-u", "-b", "b.qcow2", "-F", "qcow2", image]);
        assert_eq!(header(&p.ours, image), header(&p.qemu, image), "{image}");
    }
}

/// `--image-opts` may describe the backing node again (`backing.driver`,
/// `backing.file.filename`): the same chain is opened, and `commit` writes into that base.
/// A node naming another file is refused: only the image's own backing file is opened.
#[test]
fn image_opts_may_describe_the_backing_node_again() {
    let p = Pair::new(|d| {
        chain(d);
        d.create("other.qcow2", "qcow2", "", None, "64M");
    });
    let top = "driver=qcow2,file.filename=top.qcow2";
    let again = format!("{top},backing.driver=qcow2,backing.file.filename=base.qcow2");
    for args in [
        &["compare", "--image-opts", &again, top][..],
        &["commit", "--image-opts", &again],
        &["compare", "base.qcow2", "top.qcow2"],
    ] {
        p.same(args);
    }
    for node in [
        "backing.file.filename=other.qcow2",
        "backing.driver=raw,backing.file.filename=base.qcow2",
    ] {
        let out = p.ours.run(
            p.ours.path("qemu-img"),
            &["commit", "--image-opts", &format!("{top},{node}")],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{node}: refused");
        assert!(
            err.contains("qcow2-nbd opens only the image's own backing file"),
            "{node}: {err}"
        );
    }
    // Nothing was committed into the other file.
    p.ours.qemu_io("qcow2", "other.qcow2", &["read -P 0 0 64M"]);
}

/// QEMU's `null-co` device, which stores nothing and reads as zeros: a source for convert
/// (sparse or fully allocated), a name `info`, `map` and `compare` open as QEMU does, a
/// target `convert -n` writes into nothing, and never an image to create.
#[test]
fn null_co_devices_read_as_qemu_reads_them() {
    let p = Pair::new(|_| {});
    let zeroes = "json:{ 'driver': 'null-co', 'size': 1048576, 'read-zeroes': true }";
    for sparse in ["512", "0"] {
        p.same(&["convert", "-O", "qcow2", "-S", sparse, zeroes, "t.qcow2"]);
        p.same(&["map", "t.qcow2"]);
        p.same(&["map", "--output=json", "t.qcow2"]);
    }
    p.same(&["info", "null-co://"]);
    p.same(&["map", "--output=json", zeroes]);
    p.same(&["info", "null-co://x"]);
    p.same(&["compare", zeroes, "t.qcow2"]);
    // A target it is with -n (writes vanish), never one to create.
    p.same(&["convert", "-n", "-O", "raw", "t.qcow2", "null-co://"]);
    p.same(&["convert", "-O", "raw", "t.qcow2", "null-co://"]);
    for fmt in ["raw", "qcow2"] {
        p.same(&["create", "-f", fmt, "null-co://", "1M"]);
    }
    // A backing file it may be (stored in the image as `null-co://`), sized as the device.
    let over = [
        "create",
        "-f",
        "qcow2",
        "-F",
        "raw",
        "-b",
        "null-co://",
        "over.qcow2",
    ];
    p.same(&over);
    p.same(&["check", "over.qcow2"]);
    let info = p.ours.info("over.qcow2");
    assert_eq!(info["backing-filename"], "null-co://");
    assert_eq!(info["virtual-size"], 1u64 << 30);
}

/// A file that is not there: qemu-img names the image, then the file it could not open.
#[test]
fn info_of_a_missing_file_says_what_qemu_img_says() {
    let p = Pair::new(|_| {});
    p.same(&["info", "missing.qcow2"]);
    p.same(&["info", "-f", "qcow2", "missing.qcow2"]);
}

/// A qcow2 image over a backing file named relatively, a copy of it, and three raw files of
/// which two hold the same bytes.
fn quorum_files(d: &Dir) {
    chain(d);
    d.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "rel.qcow2",
        "64M",
    ]);
    std::fs::copy(d.path("rel.qcow2"), d.path("rel.copy")).expect("copy the image");
    for (name, pattern) in [("a.raw", "0x33"), ("b.raw", "0x44"), ("c.raw", "0x44")] {
        d.create(name, "raw", "", None, "1M");
        d.qemu_io("raw", name, &[&format!("write -P {pattern} 0 64k")]);
    }
}

/// The `json:` name of `format` over a quorum node of `children` with `threshold`.
fn quorum_name(format: &str, threshold: &str, children: &[&str]) -> String {
    let children: Vec<String> = children
        .iter()
        .map(|c| format!("{{'driver':'file','filename':'{c}'}}"))
        .collect();
    format!(
        "json:{{'driver':'{format}','file':{{'driver':'quorum','vote-threshold':{threshold},\
         'children':[{}]}}}}",
        children.join(",")
    )
}

/// The lines of `info` that describe the image rather than the nodes it is opened through
/// (QEMU also names the node in its own JSON layout and lists the quorum's children, which
/// is not shown here).
fn described(d: &Dir, out: &[u8]) -> Vec<String> {
    let root = d.root().to_str().expect("UTF-8 path");
    String::from_utf8_lossy(out)
        .replace(root, "DIR")
        .lines()
        .take_while(|l| !l.starts_with("Child node"))
        .filter(|l| !l.starts_with("image: ") && !l.starts_with("disk size"))
        .map(str::to_owned)
        .collect()
}

/// `info` of an image on a quorum node: the image is described as on one file, and a
/// relative backing name has no actual path, since the children may lie in different
/// directories; thresholds QEMU refuses are refused in its words.
#[test]
fn info_of_an_image_on_a_quorum_node() {
    let p = Pair::new(quorum_files);
    for children in [["rel.qcow2", "rel.copy"], ["top.qcow2", "top.qcow2"]] {
        let (q, o) = p.run(&["info", &quorum_name("qcow2", "1", &children)]);
        assert_eq!((o.status.code(), q.status.code()), (Some(0), Some(0)));
        assert_eq!(
            described(&p.ours, &o.stdout),
            described(&p.qemu, &q.stdout),
            "{children:?}"
        );
    }
    let (_, o) = p.run(&[
        "info",
        &quorum_name("qcow2", "2", &["rel.qcow2", "rel.copy"]),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("backing file: base.qcow2 (cannot determine actual path)"),
        "{text}"
    );
    for threshold in ["0", "3"] {
        p.same(&[
            "info",
            &quorum_name("qcow2", threshold, &["rel.qcow2", "rel.copy"]),
        ]);
    }
}

/// Reads through a quorum node return what at least `vote-threshold` children agree on, and
/// fail with an I/O error when too few agree (`compare` in qemu-img's words; `convert`'s
/// wording of a failed read is its own).
#[test]
fn reads_through_a_quorum_node_vote() {
    let p = Pair::new(quorum_files);
    for threshold in ["1", "2"] {
        let name = quorum_name("raw", threshold, &["a.raw", "b.raw", "c.raw"]);
        let out = format!("out{threshold}.raw");
        p.same(&["convert", "-O", "raw", &name, &out]);
        p.same(&["compare", "-f", "raw", "-F", "raw", &name, "b.raw"]);
        p.same(&["compare", "-f", "raw", "-F", "raw", &out, "b.raw"]);
    }
    let name = quorum_name("raw", "3", &["a.raw", "b.raw", "c.raw"]);
    p.same(&["compare", "-f", "raw", "-F", "raw", &name, "b.raw"]);
    let (q, o) = p.run(&["convert", "-O", "raw", &name, "out3.raw"]);
    assert_eq!((o.status.code(), q.status.code()), (Some(1), Some(1)));
    for err in [&o.stderr, &q.stderr] {
        let text = String::from_utf8_lossy(err);
        assert!(text.contains("Input/output error"), "{text}");
    }
}
