//! `rebase -c`, side by side with qemu-img: what a rebase copies into the image is written
//! compressed, whole clusters at a time, and the image maps, checks and reads as qemu-img's.

use crate::convert_options::same_target;
use crate::qemu_img_options::Pair;

#[test]
fn rebase_c_copies_compressed_clusters() {
    let p = Pair::new(|d| {
        for ext in ["", "extended_l2=on,cluster_size=128k"] {
            let (base, mid, top) = match ext {
                "" => ("base.qcow2", "mid.qcow2", "top.qcow2"),
                _ => ("xbase.qcow2", "xmid.qcow2", "xtop.qcow2"),
            };
            d.create(base, "qcow2", ext, None, "2M");
            d.create(mid, "qcow2", ext, Some((base, "qcow2")), "3M");
            d.create(top, "qcow2", ext, Some((mid, "qcow2")), "3M");
            d.qemu_io("qcow2", base, &["write -P 0x11 0 1M"]);
            d.qemu_io(
                "qcow2",
                mid,
                &[
                    "write -P 0x22 4k 4k",
                    "write -P 0x33 512k 256k",
                    "write -P 0x44 2M 64k",
                ],
            );
            d.qemu_io("qcow2", top, &["write -P 0x55 256k 64k"]);
        }
        d.create("r.raw", "raw", "", None, "1M");
    });
    // Onto the chain's base, onto nothing, and with subclusters.
    same_target(
        &p,
        &[
            "rebase",
            "-c",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
        ],
        "top.qcow2",
        "qcow2",
    );
    same_target(
        &p,
        &["rebase", "-c", "-b", "", "mid.qcow2"],
        "mid.qcow2",
        "qcow2",
    );
    same_target(
        &p,
        &[
            "rebase",
            "-c",
            "-b",
            "xbase.qcow2",
            "-F",
            "qcow2",
            "xtop.qcow2",
        ],
        "xtop.qcow2",
        "qcow2",
    );
    // A raw image cannot hold compressed clusters, which qemu-img says before anything else.
    p.same(&["rebase", "-c", "-f", "raw", "-b", "", "r.raw"]);
}
