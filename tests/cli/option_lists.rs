//! How `create`, `convert` and `amend` read their option lists and formats, side by side with
//! qemu-img (the `Pair` helper): `-o help` with and without a file named, the file options
//! (`extent_size_hint`, `nocow`) every format takes, an option given twice, formats QEMU
//! knows but cannot create or amend, copy offloading, the external data file's options in
//! `amend`, and a missing backing file named as QEMU names it.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// `info NAME` in both, the same but for the space used on disk (file systems place the
/// blocks of the same writes differently).
fn same_info(p: &Pair, name: &str) {
    let (q, o) = p.run(&["info", name]);
    let strip = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .filter(|l| !l.trim_start().starts_with("disk size:"))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    };
    assert_eq!(
        (o.status.code(), strip(&o.stdout), strip(&o.stderr)),
        (q.status.code(), strip(&q.stdout), strip(&q.stderr)),
        "info {name}: ours (left) and QEMU's (right) differ"
    );
}

/// Runs each command in both: `info NAME` as [`same_info`], anything else as
/// [`Pair::same`].
fn same_all(p: &Pair, commands: &[&[&str]]) {
    for args in commands {
        match args {
            ["info", name] => same_info(p, name),
            _ => {
                p.same(args);
            }
        }
    }
}

/// A qcow2 image with data, and one with an external data file.
fn images(d: &Dir) {
    d.create("a.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 0x5a 1M 64k"]);
    d.create("d.qcow2", "qcow2", "data_file=d.data", None, "1M");
}

#[test]
fn option_help_with_and_without_a_file() {
    let p = Pair::new(images);
    same_all(
        &p,
        &[
            // No file: the format's own options, and a note that the file has more.
            &["create", "-f", "qcow2", "-o", "help"][..],
            &["create", "-f", "raw", "-o", "help"],
            // No format: qemu-img's default, raw.
            &["create", "-o", "help"],
            // A file named: the file's options join the list.
            &["create", "-f", "qcow2", "-o", "help", "new.qcow2", "1M"],
            &[
                "create",
                "-f",
                "raw",
                "-o",
                "cluster_size=4k,?",
                "new.raw",
                "1M",
            ],
            &["convert", "-O", "qcow2", "-o", "help"],
            &["convert", "-o", "help"],
            &["convert", "-O", "qcow2", "-o", "help", "a.qcow2", "b.qcow2"],
            // Formats QEMU reads but cannot create or amend.
            &["create", "-f", "bochs", "-o", "help"],
            &["create", "-f", "bochs", "new.img", "1M"],
            &["convert", "-O", "bochs", "-o", "help"],
            &["amend", "-f", "bochs", "-o", "help"],
            &["amend", "-f", "raw", "-o", "help"],
            // amend: help needs a format or an image to take it from.
            &["amend", "-o", "help"],
            &["amend", "-f", "qcow2", "-o", "help"],
            &["amend", "-o", "help", "a.qcow2"],
            // The list is checked before anything else, and names no image.
            &["create", "-f", "qcow2", "-o", ",help", "new.qcow2", "1M"],
        ],
    );
}

#[test]
fn an_option_given_twice_takes_its_last_value() {
    let p = Pair::new(images);
    same_all(
        &p,
        &[
            &["create", "-f", "foo", "-f", "qcow2", "t.qcow2", "1M"][..],
            &["info", "t.qcow2"],
            &[
                "convert", "-f", "foo", "-f", "qcow2", "-O", "foo", "-O", "qcow2", "a.qcow2",
                "c.qcow2",
            ],
            &["info", "c.qcow2"],
            &[
                "amend",
                "-f",
                "foo",
                "-f",
                "qcow2",
                "-o",
                "lazy_refcounts=on",
                "a.qcow2",
            ],
            &["info", "a.qcow2"],
            // Repeated -o lists still add up.
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "cluster_size=4k",
                "-o",
                "lazy_refcounts=on",
                "u.qcow2",
                "1M",
            ],
            &["info", "u.qcow2"],
        ],
    );
}

#[test]
fn file_options_are_taken_by_every_format() {
    let p = Pair::new(images);
    same_all(
        &p,
        &[
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extent_size_hint=0,nocow=on",
                "h.qcow2",
                "64M",
            ][..],
            &["info", "h.qcow2"],
            &[
                "create",
                "-f",
                "raw",
                "-o",
                "extent_size_hint=1M,preallocation=off,nocow=off",
                "h.raw",
                "1M",
            ],
            &["info", "h.raw"],
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "data_file=h.data,extent_size_hint=0",
                "hd.qcow2",
                "1M",
            ],
            &["info", "hd.qcow2"],
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extent_size_hint=5G",
                "big.qcow2",
                "1M",
            ],
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                "extent_size_hint=abc",
                "bad.qcow2",
                "1M",
            ],
            &[
                "convert",
                "-O",
                "qcow2",
                "-o",
                "extent_size_hint=0",
                "a.qcow2",
                "e.qcow2",
            ],
            &["compare", "a.qcow2", "e.qcow2"],
            // They belong to creation: amend does not know them.
            &["amend", "-o", "extent_size_hint=0", "a.qcow2"],
            &["amend", "-o", "nocow=on", "a.qcow2"],
        ],
    );
    for name in ["h.qcow2", "h.raw", "hd.qcow2", "h.data"] {
        let size = |d: &Dir| std::fs::metadata(d.path(name)).expect("created").len();
        assert_eq!(size(&p.ours), size(&p.qemu), "{name}");
    }
}

#[test]
fn copy_offloading_is_accepted_and_its_conflicts_refused() {
    let p = Pair::new(images);
    same_all(
        &p,
        &[
            &[
                "convert", "-C", "-S", "4k", "-O", "qcow2", "a.qcow2", "t.qcow2",
            ][..],
            &["convert", "-C", "-c", "-O", "qcow2", "a.qcow2", "t.qcow2"],
            &[
                "convert",
                "-C",
                "--salvage",
                "-O",
                "qcow2",
                "a.qcow2",
                "t.qcow2",
            ],
            &["convert", "-C", "-O", "qcow2", "a.qcow2", "t.qcow2"],
            &["compare", "a.qcow2", "t.qcow2"],
        ],
    );
}

#[test]
fn amend_changes_the_data_file_options() {
    let p = Pair::new(images);
    same_all(
        &p,
        &[
            // Only an image with a data file can have it renamed.
            &["amend", "-o", "data_file=x.data", "a.qcow2"][..],
            // Setting the raw promise on an existing image is refused; dropping it is not.
            &["amend", "-o", "data_file_raw=on", "d.qcow2"],
            &["amend", "-o", "data_file_raw=off", "d.qcow2"],
            &["info", "d.qcow2"],
            &["amend", "-o", "data_file=d2.data", "d.qcow2"],
            &["info", "d.qcow2"],
        ],
    );
}

#[test]
fn amend_keeps_a_raw_data_file_raw_when_asked() {
    let p = Pair::new(|d| {
        d.create(
            "r.qcow2",
            "qcow2",
            "data_file=r.data,data_file_raw=on",
            None,
            "1M",
        );
    });
    same_all(
        &p,
        &[
            &["amend", "-o", "data_file_raw=on", "r.qcow2"][..],
            &["info", "r.qcow2"],
            &["amend", "-o", "data_file_raw=off", "r.qcow2"],
            &["info", "r.qcow2"],
            &["check", "r.qcow2"],
        ],
    );
}

#[test]
fn a_missing_backing_file_is_named_below_its_image() {
    let p = Pair::new(|d| {
        d.create("base.qcow2", "qcow2", "", None, "1M");
        d.create(
            "mid.qcow2",
            "qcow2",
            "",
            Some(("base.qcow2", "qcow2")),
            "1M",
        );
        d.create("top.qcow2", "qcow2", "", Some(("mid.qcow2", "qcow2")), "1M");
        std::fs::remove_file(d.path("base.qcow2")).expect("remove the base");
    });
    same_all(
        &p,
        &[
            &["map", "mid.qcow2"][..],
            &["map", "top.qcow2"],
            &["compare", "top.qcow2", "mid.qcow2"],
            &["convert", "-O", "raw", "top.qcow2", "t.raw"],
            // The target's own backing file is missing: it is created, then cannot be opened.
            &[
                "convert",
                "-O",
                "qcow2",
                "-o",
                "backing_fmt=qcow2,backing_file=nosuch,,file",
                "mid.qcow2",
                "n.qcow2",
            ],
        ],
    );
}
