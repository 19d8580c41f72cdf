//! qemu-img's outputs and messages, side by side with qemu-img (see `qemu_img_options::Pair`):
//! what scripts parse must read the same from our binary invoked as `qemu-img`.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// Zero clusters that keep their host cluster report where it is, in plain and extended L2
/// images alike, in the image itself and in a backing layer.
#[test]
fn map_json_gives_the_offset_of_allocated_zero_clusters() {
    let p = Pair::new(|d: &Dir| {
        d.create("a.qcow2", "qcow2", "", None, "1M");
        d.qemu_io(
            "qcow2",
            "a.qcow2",
            &["write -P 1 0 192k", "write -z 0 64k", "write -z 128k 64k"],
        );
        d.create("x.qcow2", "qcow2", "extended_l2=on", None, "1M");
        d.qemu_io(
            "qcow2",
            "x.qcow2",
            &["write -P 1 0 64k", "write -z 4k 8k", "write -z 32k 4k"],
        );
        d.create("b.qcow2", "qcow2", "", None, "1M");
        d.qemu_io(
            "qcow2",
            "b.qcow2",
            &["write -P 2 0 128k", "write -z 64k 64k"],
        );
        d.create("m.qcow2", "qcow2", "", Some(("b.qcow2", "qcow2")), "1M");
        d.create("t.qcow2", "qcow2", "", Some(("m.qcow2", "qcow2")), "1M");
        d.qemu_io("qcow2", "t.qcow2", &["write -P 3 0 4k"]);
    });
    for img in ["a.qcow2", "x.qcow2", "t.qcow2"] {
        p.same(&["map", "--output=json", img]);
        p.same(&["map", "--output=json", "-s", "96k", "--max-length=48k", img]);
    }
}

/// The "Formatting" line lists the options in qemu-img's order with its defaults, values as
/// qemu-img reads them (numbers signed, commas in text doubled), also when the driver then
/// refuses a value.
#[test]
fn create_formatting_line_is_qemu_imgs() {
    let p = Pair::new(|d: &Dir| {
        d.create("b,x.qcow2", "qcow2", "", None, "1M");
    });
    for opts in [
        "refcount_bits=-1",
        "refcount_bits=0x8,lazy_refcounts=yes,compat=1.1",
        "preallocation=bogus",
        "compat=bogus",
        "compression_type=nope",
        "cluster_size=4k,extended_l2=on,preallocation=metadata",
        "lazy_refcounts,compat=v3,compression_type=zstd",
    ] {
        p.same(&["create", "-f", "qcow2", "-o", opts, "x.qcow2", "64M"]);
    }
    p.same(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "b,x.qcow2",
        "-F",
        "qcow2",
        "t.qcow2",
    ]);
    p.same(&[
        "create",
        "-f",
        "raw",
        "-o",
        "preallocation=falloc",
        "r",
        "1000",
    ]);
    p.same(&["create", "-f", "raw", "r2", "1M"]);
}
