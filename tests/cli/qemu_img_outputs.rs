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
