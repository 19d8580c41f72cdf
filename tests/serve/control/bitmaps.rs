//! The dirty bitmap commands on served exports.

use super::harness::*;
use test_support::Dir;

#[test]
fn bitmaps_change_on_writable_exports_only_and_never_under_a_client() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    dir.create("r.qcow2", "qcow2", "", None, "4M");
    dir.qemu_img(&["bitmap", "--add", &dir.s("a.qcow2"), "served"]);
    let server = serve(
        &dir,
        &[
            format!("{},bitmap=served", export("a", &dir, "a.qcow2")),
            format!("{},readonly=on", export("r", &dir, "r.qcow2")),
        ],
        &[],
    );
    ctl_ok(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=b1",
            "granularity=131072",
        ],
    );
    ctl_ok(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=b2",
            "disabled=true",
        ],
    );
    ctl_ok(&dir, &["block-dirty-bitmap-clear", "node=a", "name=b1"]);
    ctl_ok(&dir, &["block-dirty-bitmap-remove", "node=a", "name=b2"]);
    let err = ctl_fails(
        &dir,
        &["block-dirty-bitmap-remove", "node=a", "name=served"],
    );
    assert!(err.contains("exported to NBD clients"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-clear", "node=a", "name=served"]);
    assert!(err.contains("exported to NBD clients"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-add", "node=r", "name=x"]);
    assert!(err.contains("read-only"), "{err}");
    let err = ctl_fails(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=t",
            "persistent=false",
        ],
    );
    assert!(err.contains("only persistent bitmaps"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-add", "node=zz", "name=x"]);
    assert!(err.contains("Export 'zz' is not found"), "{err}");
    server.stop_ok();
    let info = dir.info("a.qcow2");
    let names: Vec<&str> = info["format-specific"]["data"]["bitmaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["served", "b1"]);
    dir.assert_check_clean("a.qcow2");
}
