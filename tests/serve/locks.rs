//! Image locks against QEMU's own: while we serve an image QEMU's tools refuse to open it in
//! a conflicting way, while QEMU holds one we refuse, and each side reads alongside the other
//! where QEMU allows it.

use std::path::Path;
use std::process::{Command, Output};

use crate::support::qemu_nbd::QemuNbd;
use crate::support::{serve_fails, Server, BIN};
use test_support::{text, Dir};

fn qemu(tool: &str, args: &[&str]) -> Output {
    test_support::qemu(tool).args(args).output().unwrap()
}

fn ours(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// The command failed, saying which lock it could not get.
fn refused(out: &Output, lock: &str, what: &str) {
    assert!(!out.status.success(), "{what} was allowed:\n{}", text(out));
    assert!(
        text(out).contains(&format!("Failed to get {lock} lock")),
        "{what} failed without naming the {lock} lock:\n{}",
        text(out)
    );
}

fn allowed(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} was refused:\n{}", text(out));
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A qcow2 image over a qcow2 base.
fn chain(images: &Dir) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = images.create("base.qcow2", "qcow2", "", None, "4M");
    let top = images.create(
        "top.qcow2",
        "qcow2",
        "",
        Some(("base.qcow2", "qcow2")),
        "4M",
    );
    (top, base)
}

#[test]
fn qemu_cannot_write_or_open_an_image_we_serve_read_write() {
    let images = Dir::new();
    let (top, base) = chain(&images);
    let server = Server::unix(&["-t", s(&top)]);
    refused(
        &qemu("qemu-img", &["info", s(&top)]),
        "shared \"write\"",
        "qemu-img info",
    );
    allowed(
        &qemu("qemu-img", &["info", "-U", s(&top)]),
        "qemu-img info -U",
    );
    refused(
        &qemu("qemu-io", &["-c", "write 0 4k", s(&top)]),
        "\"write\"",
        "qemu-io write",
    );
    refused(
        &qemu("qemu-nbd", &["-k", s(&images.path("q.sock")), s(&top)]),
        "\"write\"",
        "qemu-nbd read-write",
    );
    // The backing file is only read: QEMU may read it too, but not write it.
    allowed(
        &qemu("qemu-io", &["-r", "-c", "read 0 4k", s(&base)]),
        "qemu-io -r on the backing file",
    );
    refused(
        &qemu("qemu-io", &["-c", "write 0 4k", s(&base)]),
        "\"write\"",
        "qemu-io write to the backing file",
    );
    server.stop_ok();
    // Once we are gone, the locks are gone.
    allowed(
        &qemu("qemu-io", &["-c", "write 0 4k", s(&top)]),
        "qemu-io write after the server stopped",
    );
}

#[test]
fn we_refuse_an_image_qemu_nbd_serves_read_write() {
    let images = Dir::new();
    let (top, _base) = chain(&images);
    let _qemu = QemuNbd::unix(&[], &top);
    let err = serve_fails(&["-k", s(&images.path("a.sock")), s(&top)]);
    assert!(err.contains("Failed to get \"write\" lock"), "{err}");
    let err = serve_fails(&["-r", "-k", s(&images.path("b.sock")), s(&top)]);
    assert!(err.contains("Failed to get shared \"write\" lock"), "{err}");
    refused(
        &ours(&["check", "-r", "all", s(&top)]),
        "\"write\"",
        "check -r all",
    );
    refused(
        &ours(&["convert", "-O", "raw", s(&top), s(&images.path("o.raw"))]),
        "shared \"write\"",
        "convert",
    );
    refused(&ours(&["info", s(&top)]), "shared \"write\"", "info");
    refused(&ours(&["map", s(&top)]), "shared \"write\"", "map");
    refused(&ours(&["check", s(&top)]), "shared \"write\"", "check");
    allowed(&ours(&["info", "-U", s(&top)]), "info -U");
    allowed(&ours(&["map", "-U", s(&top)]), "map -U");
    allowed(&ours(&["check", "-U", s(&top)]), "check -U");
    allowed(
        &ours(&[
            "convert",
            "-U",
            "-O",
            "raw",
            s(&top),
            s(&images.path("u.raw")),
        ]),
        "convert -U",
    );
    // As qemu-img: -U cannot share writes with a repair, which writes.
    let out = ours(&["check", "-U", "-r", "leaks", s(&top)]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("force-share=on can only be used with read-only images"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_target_held_by_qemu_is_not_overwritten() {
    let images = Dir::new();
    let held = images.create("held.qcow2", "qcow2", "", None, "4M");
    let before = std::fs::read(&held).unwrap();
    let _qemu = QemuNbd::unix(&[], &held);
    refused(
        &ours(&["create", "-f", "qcow2", s(&held), "8M"]),
        "\"write\"",
        "create over a served image",
    );
    let src = images.create("src.qcow2", "qcow2", "", None, "4M");
    refused(
        &ours(&["convert", "-O", "qcow2", s(&src), s(&held)]),
        "\"write\"",
        "convert onto a served image",
    );
    assert_eq!(
        std::fs::read(&held).unwrap(),
        before,
        "the held image is intact"
    );
}

#[test]
fn two_writers_exclude_each_other_and_readers_coexist_as_in_qemu() {
    let images = Dir::new();
    let (top, _base) = chain(&images);
    let first = Server::unix(&["-t", s(&top)]);
    let err = serve_fails(&["-k", s(&images.path("2.sock")), s(&top)]);
    assert!(err.contains("Failed to get \"write\" lock"), "{err}");
    first.stop_ok();

    let r1 = Server::unix(&["-t", "-r", s(&top)]);
    let r2 = Server::unix(&["-t", "-r", s(&top)]);
    let qemu_reader = QemuNbd::unix(&["-r"], &top);
    let err = serve_fails(&["-k", s(&images.path("3.sock")), s(&top)]);
    assert!(err.contains("Failed to get \"write\" lock"), "{err}");
    refused(
        &qemu("qemu-io", &["-c", "write 0 4k", s(&top)]),
        "\"write\"",
        "qemu-io write beside read-only servers",
    );
    drop(qemu_reader);
    r1.stop_ok();
    r2.stop_ok();
}

#[test]
fn the_snapshot_overlay_holds_its_image_read_only() {
    let images = Dir::new();
    let (top, _base) = chain(&images);
    let server = Server::unix(&["-t", "-s", s(&top)]);
    allowed(
        &qemu("qemu-io", &["-r", "-c", "read 0 4k", s(&top)]),
        "qemu-io -r beside -s",
    );
    refused(
        &qemu("qemu-io", &["-c", "write 0 4k", s(&top)]),
        "\"write\"",
        "qemu-io write beside -s",
    );
    server.stop_ok();
}

#[test]
fn locking_off_takes_no_locks() {
    let images = Dir::new();
    let (top, _base) = chain(&images);
    let server = Server::unix(&["-t", "--locking", "off", s(&top)]);
    allowed(&qemu("qemu-img", &["info", s(&top)]), "qemu-img info");
    let _qemu = QemuNbd::unix(&["-r"], &top);
    allowed(
        &ours(&["--locking", "off", "info", s(&top)]),
        "info --locking off",
    );
    server.stop_ok();
}
