//! qemu-io as the NBD client of `qcow2-nbd serve`, over `nbd+unix://` and `nbd://`: writes
//! with patterns, reads that verify them, zeroing with and without unmap, discard, flush and
//! FUA writes, on qcow2 images over backing files (standard and extended L2). Afterwards the
//! file must pass `qemu-img check` and equal a raw model that got the same writes from
//! qemu-io directly.

use crate::support::Server;
use test_support::{assert_check_clean, assert_same_contents, qemu_img, qemu_io, Dir};

/// The requests sent over NBD: cluster-aligned and unaligned writes over backing data,
/// zeroing (with and without `-u`), a discard, a flush and a FUA write.
const SESSION: &[&str] = &[
    "write -P 0xa1 0 64k",
    "write -P 0xa2 70000 5000",
    "read -P 0xa1 0 64k",
    "read -P 0xa2 70000 5000",
    "write -z 131072 65536",
    "write -z 200000 3000",
    "write -z -u 262144 131072",
    "discard 524288 65536",
    "flush",
    "write -f -P 0xa3 1048576 8192",
    "write -P 0xa4 3145728 1M",
    "read -P 0xa4 3145728 1M",
    "read -P 0 131072 65536",
    "read -P 0 262144 131072",
    "read -P 0x22 1572864 4096",
];

/// base.qcow2 (data in the first 2 MiB) under top.qcow2 (`top_opts`, some data of its own),
/// and model.raw with the same guest contents.
fn chain(images: &Dir, top_opts: &str) {
    images.create("base.qcow2", "qcow2", "", None, "4M");
    images.qemu_io("qcow2", "base.qcow2", &["write -P 0x11 0 2M"]);
    images.create(
        "top.qcow2",
        "qcow2",
        top_opts,
        Some(("base.qcow2", "qcow2")),
        "4M",
    );
    images.qemu_io("qcow2", "top.qcow2", &["write -P 0x22 1M 1M"]);
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        &images.s("top.qcow2"),
        &images.s("model.raw"),
    ]);
}

/// Applies the session to the raw model as a server with `discard` behaves: with unmap, a
/// discarded cluster of an image with a backing file reads as zeroes; with ignore, it is
/// left alone.
fn apply_to_model(images: &Dir, discard_unmaps: bool) {
    let cmds: Vec<String> = SESSION
        .iter()
        .filter_map(|c| match c.strip_prefix("discard ") {
            Some(range) if discard_unmaps => Some(format!("write -z {range}")),
            Some(_) => None,
            None => Some((*c).to_owned()),
        })
        .collect();
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    images.qemu_io("raw", "model.raw", &cmds);
}

fn run_session(server: Server, images: &Dir, discard_unmaps: bool) {
    qemu_io("raw", &server.uri(), SESSION);
    server.stop_ok();
    apply_to_model(images, discard_unmaps);
    let top = images.path("top.qcow2");
    assert_check_clean(&top);
    assert_same_contents(&top, "qcow2", &images.path("model.raw"), "raw");
}

#[test]
fn qemu_io_over_a_unix_socket_on_a_backed_image() {
    let images = Dir::new();
    chain(&images, "cluster_size=65536");
    let server = Server::unix(&["-t", "--discard=unmap", &images.s("top.qcow2")]);
    run_session(server, &images, true);
}

#[test]
fn qemu_io_over_tcp_on_a_backed_extended_l2_image() {
    let images = Dir::new();
    chain(&images, "cluster_size=65536,extended_l2=on");
    let server = Server::tcp(&["-t", "--discard=unmap", &images.s("top.qcow2")]);
    run_session(server, &images, true);
}

#[test]
fn discard_is_ignored_by_default_like_qemu_nbd() {
    let images = Dir::new();
    chain(&images, "cluster_size=65536,extended_l2=on");
    let server = Server::tcp(&["-t", &images.s("top.qcow2")]);
    run_session(server, &images, false);
}

#[test]
fn a_lazy_refcounts_image_is_left_clean_after_shutdown() {
    let images = Dir::new();
    chain(&images, "lazy_refcounts=on,cluster_size=4096");
    let server = Server::unix(&["-t", "--discard=unmap", &images.s("top.qcow2")]);
    run_session(server, &images, true);
    let info: serde_json::Value = serde_json::from_str(&qemu_img(&[
        "info",
        "--output=json",
        &images.s("top.qcow2"),
    ]))
    .unwrap();
    let data = &info["format-specific"]["data"];
    assert_eq!(data["lazy-refcounts"], true, "{info}");
    assert_eq!(info["dirty-flag"], false, "{info}");
}
