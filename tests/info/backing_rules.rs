//! `info --backing-chain` follows backing files only where it is safe: never `json:` or
//! protocol-prefixed names, relative names against the image's directory, no loops.
//!
//! Needs qemu-img (Debian: qemu-utils); fails with a clear message without it.

use std::process::Output;

use test_support::{qemu, run_ok, Dir};

const BIN: &str = env!("CARGO_BIN_EXE_qcow2-nbd");

/// Our `info ARGS` in `d`.
fn info(d: &Dir, args: &[&str]) -> Output {
    let mut full = vec!["info"];
    full.extend_from_slice(args);
    d.run(BIN, &full)
}

fn error_of(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected failure, got {:?}",
        out.status
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn loops_are_refused() {
    let dir = Dir::new();
    dir.qemu_img(&["create", "-q", "-f", "qcow2", "a.qcow2", "1M"]);
    dir.qemu_img(&[
        "create", "-q", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", "b.qcow2",
    ]);
    // Unsafe rebase: point a at b without checking, closing the loop.
    dir.qemu_img(&[
        "rebase", "-u", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", "a.qcow2",
    ]);
    let err = error_of(&info(&dir, &["--backing-chain", "b.qcow2"]));
    assert!(
        err.contains("Backing file 'b.qcow2' creates an infinite loop."),
        "{err}"
    );
    // Without --backing-chain nothing is followed, so the image itself is fine.
    assert!(info(&dir, &["b.qcow2"]).status.success());
}

#[test]
fn foreign_json_and_protocol_names_are_shown_but_never_followed() {
    let dir = Dir::new();
    dir.qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]);
    for (image, name, expected) in [
        (
            "j.qcow2",
            r#"json:{"driver":"qcow2","file":{"driver":"ssh","path":"/base.qcow2"}}"#,
            "driver 'ssh' is not supported",
        ),
        (
            "n.qcow2",
            "nbd:127.0.0.1:1",
            "protocol \"nbd\" is not a local file",
        ),
        (
            "h.qcow2",
            "http://127.0.0.1/base.qcow2",
            "protocol \"http\" is not a local file",
        ),
    ] {
        dir.qemu_img(&["create", "-q", "-f", "qcow2", image, "1M"]);
        dir.qemu_img(&[
            "rebase", "-u", "-f", "qcow2", "-b", name, "-F", "qcow2", image,
        ]);
        let out = info(&dir, &["--output=json", image]);
        assert!(
            out.status.success(),
            "{image}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["backing-filename"], name);
        let err = error_of(&info(&dir, &["--backing-chain", image]));
        assert!(err.contains(expected), "{image}: {err}");
    }
}

#[test]
fn relative_names_resolve_against_the_image_directory_not_the_cwd() {
    let dir = Dir::new();
    let sub = dir.path("images");
    std::fs::create_dir(&sub).unwrap();
    // qemu-img runs inside images/, so the backing name it records is the bare file name.
    let sub_qemu_img = |args: &[&str]| run_ok(qemu("qemu-img").current_dir(&sub).args(args));
    sub_qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]);
    sub_qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    // A decoy with the same name in the working directory must not be picked up.
    std::fs::write(dir.path("base.qcow2"), b"not an image").unwrap();
    let out = info(
        &dir,
        &["--backing-chain", "--output=json", "images/top.qcow2"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chain: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(chain[1]["filename"], "images/base.qcow2");
    assert_eq!(chain[1]["format"], "qcow2");
}

#[test]
fn missing_and_unsupported_backing_files_are_clear_errors() {
    let dir = Dir::new();
    dir.qemu_img(&["create", "-q", "-f", "qcow2", "base.qcow2", "1M"]);
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        "top.qcow2",
    ]);
    std::fs::remove_file(dir.path("base.qcow2")).unwrap();
    let err = error_of(&info(&dir, &["--backing-chain", "top.qcow2"]));
    // qemu-img's words: the backing file named twice, as its open of the file node and of
    // the format node each add the name.
    assert!(
        err.starts_with(
            "qcow2-nbd: Could not open 'base.qcow2': Could not open 'base.qcow2': No such file"
        ),
        "{err}"
    );

    dir.qemu_img(&["create", "-q", "-f", "vmdk", "disk.vmdk", "1M"]);
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "disk.vmdk",
        "-F",
        "vmdk",
        "over.qcow2",
    ]);
    let err = error_of(&info(&dir, &["--backing-chain", "over.qcow2"]));
    assert!(
        err.contains("backing file format \"vmdk\" is not supported"),
        "{err}"
    );
}
