//! Raw files as QEMU's `file` driver makes and reads them, side by side with qemu-img: the
//! first block a new or grown-from-empty file gets written, a length that is not whole
//! sectors (the disk ends at the next multiple of 512), block status under O_DIRECT
//! (`cache.direct=on`) answered in whole blocks, and formats QEMU only reads refused as
//! conversion targets in its words.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// `qemu-img map --output=json -f raw FILE` by QEMU's own tool in `d`: how the file is laid
/// out, whoever made it.
fn qemu_layout(d: &Dir, file: &str) -> String {
    d.qemu_img(&["map", "--output=json", "-f", "raw", file])
}

/// Asserts that `file` is laid out the same in both directories, as QEMU's tool sees it.
fn same_layout(p: &Pair, file: &str) {
    assert_eq!(
        qemu_layout(&p.ours, file),
        qemu_layout(&p.qemu, file),
        "{file}: ours (left) and QEMU's (right) lay the file out differently"
    );
}

#[test]
fn new_raw_files_get_their_first_block_written_as_in_qemu() {
    let p = Pair::new(|d| {
        d.create("zero.qcow2", "qcow2", "", None, "1M");
        std::fs::write(d.path("empty.raw"), b"").expect("write an empty file");
        std::fs::write(d.path("empty2.raw"), b"").expect("write an empty file");
    });
    for (args, file) in [
        (
            &["create", "-q", "-f", "raw", "small.raw", "100"][..],
            "small.raw",
        ),
        (&["create", "-q", "-f", "raw", "big.raw", "1M"], "big.raw"),
        (
            &[
                "create",
                "-q",
                "-f",
                "raw",
                "-o",
                "preallocation=falloc",
                "falloc.raw",
                "1M",
            ],
            "falloc.raw",
        ),
        (&["resize", "-f", "raw", "empty.raw", "1M"], "empty.raw"),
        (&["resize", "-f", "raw", "empty2.raw", "100"], "empty2.raw"),
        (
            &[
                "convert",
                "-O",
                "raw",
                "-S",
                "512",
                "zero.qcow2",
                "conv.raw",
            ],
            "conv.raw",
        ),
        (
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-o",
                "data_file=d.raw",
                "d.qcow2",
                "1M",
            ],
            "d.raw",
        ),
    ] {
        p.same(args);
        same_layout(&p, file);
        p.same(&["map", "--output=json", "-f", "raw", file]);
    }
}

#[test]
fn a_raw_file_whose_length_is_not_whole_sectors_ends_at_the_next_sector() {
    let p = Pair::new(|d| {
        std::fs::write(d.path("odd.raw"), b"").expect("write an empty file");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path("odd.raw"))
            .expect("open the file");
        f.set_len(65537).expect("size the file");
        d.qemu_io("raw", "odd.raw", &["write -P 9 65536 1"]);
    });
    p.same(&["map", "--output=json", "-f", "raw", "odd.raw"]);
    p.same(&["map", "--output=json", "odd.raw"]);
    p.same(&["info", "-f", "raw", "odd.raw"]);
}

#[test]
fn block_status_under_o_direct_reaches_the_end_of_the_last_block() {
    let setup = |d: &Dir| {
        std::fs::write(d.path("tail.raw"), b"").expect("write an empty file");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path("tail.raw"))
            .expect("open the file");
        f.set_len((1 << 20) - 1).expect("size the file");
        d.qemu_io("raw", "tail.raw", &["write -P 3 983040 65535"]);
    };
    let p = Pair::new(setup);
    let opts = "driver=raw,file.driver=file,file.filename=tail.raw,cache.direct=on";
    let probe = p
        .qemu
        .run("qemu-img", &["map", "--output=json", "--image-opts", opts]);
    if !probe.status.success() {
        // A file system without O_DIRECT (tmpfs): QEMU cannot read it so either.
        eprintln!("skipped: qemu-img cannot open a file with O_DIRECT here");
        return;
    }
    p.same(&["map", "--output=json", "--image-opts", opts]);
    p.same(&[
        "map",
        "--output=json",
        "--image-opts",
        "driver=raw,file.driver=file,file.filename=tail.raw",
    ]);
}

#[test]
fn formats_qemu_only_reads_are_refused_as_targets_in_its_words() {
    let p = Pair::new(|d| {
        d.create("a.raw", "raw", "", None, "1M");
    });
    for fmt in ["bochs", "cloop", "dmg"] {
        p.same(&["convert", "-f", "raw", "-O", fmt, "a.raw", "b.img"]);
        p.same(&["create", "-f", fmt, "b.img", "1M"]);
    }
}
