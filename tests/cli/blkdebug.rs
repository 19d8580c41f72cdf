//! QEMU's `blkdebug` fault injection through our binary, side by side with qemu-img: the
//! same rules must fail the same requests, with the same messages and exit codes, and leave
//! images that `qemu-img check` finds in the same state.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// A 64 MiB image with data in its first cluster, a copy, and a rule failing every read of
/// data once the qcow2 driver starts reading guest data.
fn read_error_images(d: &Dir) {
    d.create("a.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 7 512 512"]);
    d.copy("a.qcow2", "b.qcow2");
    d.create("empty.qcow2", "qcow2", "", None, "0");
    std::fs::write(
        d.path("read.conf"),
        "[inject-error]\nevent = \"read_aio\"\nerrno = \"5\"\nonce =\"off\"\n",
    )
    .expect("write the rules");
    std::fs::write(
        d.path("nospace.conf"),
        "[inject-error]\nevent = \"read_aio\"\nerrno = \"28\"\n",
    )
    .expect("write the rules");
}

#[test]
fn read_errors_fail_compare_as_in_qemu() {
    let p = Pair::new(read_error_images);
    for args in [
        &["compare", "blkdebug:read.conf:a.qcow2", "b.qcow2"][..],
        &["compare", "blkdebug:nospace.conf:a.qcow2", "b.qcow2"],
        &["compare", "blkdebug:read.conf:a.qcow2", "empty.qcow2"],
        &[
            "compare",
            "-f",
            "qcow2",
            "blkdebug:read.conf:a.qcow2",
            "b.qcow2",
        ],
    ] {
        p.same(args);
    }
}

#[test]
fn rules_that_never_fire_change_nothing() {
    let p = Pair::new(|d| {
        read_error_images(d);
        std::fs::write(
            d.path("late.conf"),
            "[inject-error]\nevent = \"read_aio\"\nstate = \"2\"\n",
        )
        .expect("write the rules");
    });
    p.same(&["compare", "blkdebug:late.conf:a.qcow2", "b.qcow2"]);
    p.same(&["map", "--output=json", "blkdebug:read.conf:a.qcow2"]);
}

#[test]
fn blkdebug_names_that_are_wrong_are_refused_in_qemu_words() {
    let p = Pair::new(|d| {
        read_error_images(d);
        std::fs::write(d.path("group.conf"), "[foo]\n").expect("write the rules");
        std::fs::write(d.path("event.conf"), "[inject-error]\nevent = \"nope\"\n")
            .expect("write the rules");
    });
    for name in [
        "blkdebug:missing.conf:a.qcow2",
        "blkdebug:read.conf",
        "blkdebug:group.conf:a.qcow2",
        "blkdebug:event.conf:a.qcow2",
    ] {
        p.same(&["info", name]);
    }
}

#[test]
fn a_blkdebug_filter_over_the_image_maps_like_the_image() {
    let p = Pair::new(|d| {
        d.create("base.qcow2", "qcow2", "", None, "16M");
        d.qemu_io("qcow2", "base.qcow2", &["write -P 1 0 16M"]);
        d.create(
            "top.qcow2",
            "qcow2",
            "cluster_size=1M",
            Some(("base.qcow2", "qcow2")),
            "16M",
        );
        d.qemu_io(
            "qcow2",
            "top.qcow2",
            &["write -P 2 1000 3M", "write -z 8M 2M"],
        );
    });
    let opts = "driver=blkdebug,image.driver=qcow2,image.file.driver=file,\
                image.file.filename=top.qcow2";
    for limits in [
        "",
        ",align=4k",
        ",align=512,max-transfer=64k,opt-write-zero=1M",
    ] {
        let name = format!("{opts}{limits}");
        p.same(&["map", "--image-opts", &name]);
        p.same(&["map", "--output=json", "--image-opts", &name]);
    }
    p.same(&["map", "--image-opts", &format!("{opts},align=3")]);
}

/// A failure once clusters start to be freed, while `snapshot -d` drops a snapshot that
/// shares its clusters with the disk: the same messages as qemu-img, and an image that
/// `check` finds in the same state (the snapshot gone, its clusters leaked) and repairs the
/// same way.
#[test]
fn a_failure_while_deleting_a_snapshot_leaks_what_qemu_leaks() {
    let p = Pair::new(|d| {
        d.create("s.qcow2", "qcow2", "", None, "64M");
        d.qemu_io("qcow2", "s.qcow2", &["write 0 64k"]);
        d.qemu_img(&["snapshot", "-c", "foo", "s.qcow2"]);
        std::fs::write(
            d.path("free.conf"),
            "[inject-error]\nevent = \"cluster_free\"\nerrno = \"5\"\n",
        )
        .expect("write the rules");
    });
    p.same(&["snapshot", "-d", "foo", "blkdebug:free.conf:s.qcow2"]);
    p.same(&["snapshot", "-l", "s.qcow2"]);
    p.same(&["check", "s.qcow2"]);
    p.same(&["check", "-r", "leaks", "s.qcow2"]);
    p.same(&["check", "s.qcow2"]);
}

/// `info` describes the image behind the rules, under the name given.
#[test]
fn info_describes_the_wrapped_image() {
    let p = Pair::new(read_error_images);
    let (q, o) = p.run(&["info", "--output=json", "blkdebug:read.conf:a.qcow2"]);
    assert_eq!((o.status.code(), q.status.code()), (Some(0), Some(0)));
    let json = |out: &[u8]| -> serde_json::Value { serde_json::from_slice(out).expect("JSON") };
    let (q, o) = (json(&q.stdout), json(&o.stdout));
    for key in ["filename", "format", "virtual-size", "cluster-size"] {
        assert_eq!(o[key], q[key], "{key}");
    }
}

/// A backing file named by a `json:` name whose file is a blkdebug node with an inline rule
/// (a write failing once with ENOSPC): `commit` follows the name, fails with QEMU's words,
/// and leaves the base as qemu-img leaves it.
#[test]
fn commit_into_a_json_blkdebug_backing_fails_as_in_qemu() {
    let p = Pair::new(|d| {
        d.create("base.qcow2", "qcow2", "", None, "1M");
        d.qemu_io("qcow2", "base.qcow2", &["write -P 1 0 1M"]);
        let backing = "json:{'driver': 'qcow2', 'file': {'driver': 'blkdebug', \
                       'inject-error': [{'event': 'write_aio', 'errno': 28, 'once': true}], \
                       'image': {'driver': 'file', 'filename': 'base.qcow2'}}}";
        d.qemu_img(&[
            "create",
            "-f",
            "qcow2",
            "-b",
            backing,
            "-F",
            "qcow2",
            "top.qcow2",
        ]);
        d.qemu_io("qcow2", "top.qcow2", &["write -P 2 0 64k"]);
    });
    let out = p.same(&["commit", "top.qcow2"]);
    assert_eq!(out.status.code(), Some(1));
    p.same(&["map", "--output=json", "base.qcow2"]);
    p.same(&[
        "compare",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "base.qcow2",
        "top.qcow2",
    ]);
    p.same(&["check", "base.qcow2"]);
}

/// The rules of a blkdebug node given as the format's `file`, inline or wrong, behave as in
/// qemu-img: rules that never fire change nothing, a bad rule is refused.
#[test]
fn inline_blkdebug_rules_under_the_format_work_as_in_qemu() {
    let p = Pair::new(read_error_images);
    let node = |rules: &str| {
        format!(
            "json:{{'driver':'qcow2','file':{{'driver':'blkdebug',{rules}\
             'image':{{'driver':'file','filename':'a.qcow2'}}}}}}"
        )
    };
    let fails = node("'inject-error':[{'event':'read_aio','errno':5}],");
    let out = p.same(&["compare", &fails, "b.qcow2"]);
    assert_eq!(out.status.code(), Some(4));
    let late = node("'inject-error':[{'event':'read_aio','state':2}],");
    let out = p.same(&["compare", &late, "b.qcow2"]);
    assert_eq!(out.status.code(), Some(0));
    let moved = node(
        "'set-state':[{'event':'read_aio','new_state':2}],\
         'inject-error':[{'event':'read_aio','state':2,'errno':28}],",
    );
    p.same(&["compare", &moved, "b.qcow2"]);
}

/// Across a blkdebug node without a configuration file, a relative backing file name is
/// still relative to the image's directory (QEMU's `bdrv_dirname`).
#[test]
fn backing_names_under_an_inline_blkdebug_node_are_relative_to_the_image() {
    let p = Pair::new(|d| {
        std::fs::create_dir(d.path("sub")).expect("mkdir");
        d.create("sub/base.qcow2", "qcow2", "", None, "1M");
        d.qemu_img(&[
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "sub/top.qcow2",
        ]);
    });
    let name = "json:{'driver':'qcow2','file':{'driver':'blkdebug',\
                'image':{'driver':'file','filename':'sub/top.qcow2'},\
                'set-state':[{'event':'read_aio','new_state':42}]}}";
    let (q, o) = p.run(&["info", name]);
    assert_eq!((o.status.code(), q.status.code()), (Some(0), Some(0)));
    let backing = |out: &std::process::Output, root: &std::path::Path| -> String {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("backing file:"))
            .unwrap_or_default()
            .replace(root.to_str().expect("UTF-8"), "DIR")
    };
    let theirs = backing(&q, p.qemu.root());
    assert_eq!(
        theirs,
        "backing file: base.qcow2 (actual path: sub/base.qcow2)"
    );
    assert_eq!(backing(&o, p.ours.root()), theirs);
}

/// Wrong inline rules are refused in QEMU's words, as a configuration file's are.
#[test]
fn wrong_inline_blkdebug_rules_are_refused_in_qemu_words() {
    let p = Pair::new(read_error_images);
    for rules in [
        "'inject-error':[{'event':'nope'}],",
        "'inject-error':[{'errno':5}],",
    ] {
        let name = format!(
            "json:{{'driver':'qcow2','file':{{'driver':'blkdebug',{rules}\
             'image':{{'driver':'file','filename':'a.qcow2'}}}}}}"
        );
        let out = p.same(&["info", &name]);
        assert_eq!(out.status.code(), Some(1));
    }
}

/// A 64 MiB image over a backing file, with data in its first cluster and one far behind
/// it, and a rule failing every request once `event` is announced.
fn top_over_base(d: &Dir, event: &str) {
    d.create("base.qcow2", "qcow2", "", None, "64M");
    d.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
        "64M",
    ]);
    d.qemu_io(
        "qcow2",
        "top.qcow2",
        &["write -P 3 0 64k", "write -P 4 10M 64k"],
    );
    std::fs::write(
        d.path("empty.conf"),
        format!("[inject-error]\nevent = \"{event}\"\n"),
    )
    .expect("write the rules");
}

/// `commit` empties a version 3 top image as QEMU does: a new minimal structure at the start
/// of the file, which ends right after it; `check` finds the same, and the image, cut from
/// its backing file, maps the same.
#[test]
fn commit_empties_the_top_as_qemu_does() {
    let p = Pair::new(|d| top_over_base(d, "none"));
    p.same(&["commit", "top.qcow2"]);
    let len = |d: &Dir| std::fs::metadata(d.path("top.qcow2")).expect("top").len();
    assert_eq!(len(&p.ours), len(&p.qemu), "the emptied top's length");
    p.same(&["check", "top.qcow2"]);
    for d in [&p.qemu, &p.ours] {
        d.qemu_img(&["rebase", "-u", "-b", "", "top.qcow2"]);
    }
    p.same(&["map", "--output=json", "top.qcow2"]);
    p.same(&["info", "top.qcow2"]);
}

/// A failure at each point QEMU announces while it empties the top: the same message, and
/// an image `check` finds in the same state (dirty, with the old structure or the half-built
/// new one) and repairs the same way.
#[test]
fn a_failure_while_emptying_the_top_leaves_what_qemu_leaves() {
    for event in [
        "l1_update",
        "empty_image_prepare",
        "reftable_update",
        "refblock_alloc",
    ] {
        let p = Pair::new(|d| top_over_base(d, event));
        let out = p.same(&["commit", "blkdebug:empty.conf:top.qcow2"]);
        assert_eq!(out.status.code(), Some(1), "{event}");
        p.same(&["check", "top.qcow2"]);
        p.same(&["check", "-r", "all", "top.qcow2"]);
        p.same(&["check", "top.qcow2"]);
    }
}
