//! `dd`, side by side with qemu-img dd: the same operands on the same files must exit the
//! same way, print the same, and create an output that maps, checks and reads as qemu-img's.

use crate::convert_options::same_target;
use crate::qemu_img_options::Pair;

#[test]
fn dd_copies_block_by_block_into_a_new_image() {
    let p = Pair::new(|d| {
        d.create("a.qcow2", "qcow2", "", None, "1M");
        d.qemu_io(
            "qcow2",
            "a.qcow2",
            &["write -P 0xa 0 300k", "write -P 0xb 700k 5k"],
        );
        d.create("r.raw", "raw", "", None, "100k");
        d.qemu_io("raw", "r.raw", &["write -P 0xc 1k 3k"]);
    });
    for bs in ["5", "512", "1999", "64K", "1M"] {
        let bs = format!("bs={bs}");
        same_target(
            &p,
            &["dd", "if=a.qcow2", "of=o.qcow2", &bs, "-O", "qcow2"],
            "o.qcow2",
            "qcow2",
        );
    }
    same_target(
        &p,
        &["dd", "-f", "raw", "if=r.raw", "of=o.raw"],
        "o.raw",
        "raw",
    );
    same_target(
        &p,
        &[
            "dd",
            "if=a.qcow2",
            "of=part.raw",
            "bs=4k",
            "skip=3",
            "count=100",
        ],
        "part.raw",
        "raw",
    );
    same_target(
        &p,
        &[
            "dd",
            "-O",
            "qcow2",
            "if=a.qcow2",
            "of=tail.qcow2",
            "bs=64k",
            "skip=15",
        ],
        "tail.qcow2",
        "qcow2",
    );
    // Skipping past the end warns and leaves an empty output, as dd(1) does.
    same_target(
        &p,
        &["dd", "if=a.qcow2", "of=empty.raw", "bs=1M", "skip=2"],
        "empty.raw",
        "raw",
    );
    for bad in [
        &["dd", "if=a.qcow2"][..],
        &["dd", "if=a.qcow2", "of=x", "bs=0"],
        &["dd", "if=a.qcow2", "of=x", "bs=3x"],
        &["dd", "if=a.qcow2", "of=x", "count=-1"],
        &["dd", "if=a.qcow2", "of=x", "conv=notrunc"],
        &["dd", "if=a.qcow2", "of=x", "noequals"],
        &["dd", "if=a.qcow2", "of=x", "-O", "nosuchfmt"],
    ] {
        p.same(bad);
    }
}
