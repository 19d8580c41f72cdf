//! Several images in one server (`--export name=...,file=...`): real clients list them,
//! select them by name and write to them at once, and the data must land in the right file;
//! a start that cannot open every image must fail naming the one it could not open and
//! leave the others unlocked; definitions that are wrong or too many are refused.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use crate::support::qemu_nbd::QemuNbd;
use crate::support::{serve_fails, Server, BIN};
use test_support::{
    assert_check_clean, assert_same_contents, qemu_img, qemu_io, qemu_io_read_only, require, text,
    Dir,
};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// What each client writes to its export, and the model gets the same.
const A_WRITES: &[&str] = &[
    "write -P 0xa1 0 1M",
    "write -P 0xa2 70000 5000",
    "write -z 2M 64k",
    "write -P 0xa3 3M 512k",
];
const B_WRITES: &[&str] = &[
    "write -P 0xb1 512k 1M",
    "write -P 0xb2 3000 9000",
    "write -P 0xb3 3584k 512k",
];

/// a.qcow2 (extended L2, with backing-free data of its own), b.raw, and c.qcow2 with data,
/// and a raw model of a and b with their starting contents.
fn images() -> Dir {
    let images = Dir::new();
    images.create(
        "a.qcow2",
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        None,
        "4M",
    );
    images.qemu_io("qcow2", "a.qcow2", &["write -P 0x11 1M 2M"]);
    images.create("b.raw", "raw", "", None, "4M");
    images.qemu_io("raw", "b.raw", &["write -P 0x22 0 4M"]);
    images.create("c.qcow2", "qcow2", "", None, "1M");
    images.qemu_io("qcow2", "c.qcow2", &["write -P 0x33 0 1M"]);
    qemu_img(&[
        "convert",
        "-O",
        "raw",
        &images.s("a.qcow2"),
        &images.s("model-a.raw"),
    ]);
    images.copy("b.raw", "model-b.raw");
    images
}

fn export(name: &str, file: &Path, extra: &str) -> String {
    format!("name={name},file={}{extra}", file.display())
}

fn nbdinfo(args: &[&str]) -> String {
    let out = Command::new(require("nbdinfo", "libnbd-bin"))
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "nbdinfo {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `(name, description)` of every export a listing shows.
fn listing(server: &Server) -> Vec<(String, String)> {
    let list: Value = serde_json::from_str(&nbdinfo(&["--list", "--json", &server.uri()])).unwrap();
    list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let field = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
            (field("export-name"), field("description"))
        })
        .collect()
}

fn serve_three(images: &Dir, threads: &str) -> Server {
    let a = export(
        "a",
        &images.path("a.qcow2"),
        ",description=qcow2,, extended L2",
    );
    let b = export(
        "b",
        &images.path("b.raw"),
        ",format=raw,description=raw disk",
    );
    let c = export("c", &images.path("c.qcow2"), ",readonly=on");
    Server::unix(&[
        "-t",
        "-e",
        "4",
        "--threads",
        threads,
        "--export",
        &a,
        "--export",
        &b,
        "--export",
        &c,
    ])
}

fn two_clients_write_their_own_image_at_once(threads: &str) {
    let images = images();
    let server = serve_three(&images, threads);
    assert_eq!(
        listing(&server),
        [
            ("a".to_owned(), "qcow2, extended L2".to_owned()),
            ("b".to_owned(), "raw disk".to_owned()),
            ("c".to_owned(), String::new()),
        ]
    );
    let (uri_a, uri_b) = (server.uri_of("a"), server.uri_of("b"));
    std::thread::scope(|scope| {
        let a = scope.spawn(|| qemu_io("raw", &uri_a, A_WRITES));
        let b = scope.spawn(|| qemu_io("raw", &uri_b, B_WRITES));
        a.join().expect("qemu-io on a");
        b.join().expect("qemu-io on b");
    });
    qemu_io(
        "raw",
        &uri_a,
        &["read -P 0xa1 0 64k", "read -P 0x11 2176k 832k"],
    );
    qemu_io(
        "raw",
        &uri_b,
        &["read -P 0xb1 512k 1M", "read -P 0x22 2M 1M"],
    );
    // The read-only export reads its own data and refuses writes.
    qemu_io_read_only("raw", &server.uri_of("c"), &["read -P 0x33 0 1M"]);
    let write_c = test_support::qemu("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xcc 0 4k", &server.uri_of("c")])
        .output()
        .unwrap();
    assert!(
        !write_c.status.success() && text(&write_c).contains("Permission denied"),
        "qemu-io opened the read-only export for writing: {}",
        text(&write_c)
    );
    server.stop_ok();
    images.qemu_io("raw", "model-a.raw", A_WRITES);
    images.qemu_io("raw", "model-b.raw", B_WRITES);
    assert_check_clean(&images.path("a.qcow2"));
    assert_check_clean(&images.path("c.qcow2"));
    assert_same_contents(
        &images.path("a.qcow2"),
        "qcow2",
        &images.path("model-a.raw"),
        "raw",
    );
    assert_same_contents(
        &images.path("b.raw"),
        "raw",
        &images.path("model-b.raw"),
        "raw",
    );
    images.qemu_io("qcow2", "c.qcow2", &["read -P 0x33 0 1M"]);
}

#[test]
fn exports_are_listed_and_written_by_name_at_once() {
    two_clients_write_their_own_image_at_once("1");
}

#[test]
fn exports_are_served_from_two_threads() {
    two_clients_write_their_own_image_at_once("2");
}

#[test]
fn a_locked_image_fails_the_start_and_leaves_the_others_unlocked() {
    let images = images();
    // A writable open marks c's bitmap in use; only a clean close stores it again.
    qemu_img(&["bitmap", "--add", &images.s("c.qcow2"), "bm"]);
    let _qemu = QemuNbd::unix(&[], &images.path("a.qcow2"));
    let b = export("b", &images.path("b.raw"), ",format=raw");
    let c = export("c", &images.path("c.qcow2"), "");
    let a = export("a", &images.path("a.qcow2"), "");
    let socket = images.path("s.sock");
    let err = serve_fails(&[
        "-k",
        s(&socket),
        "--export",
        &b,
        "--export",
        &c,
        "--export",
        &a,
    ]);
    assert!(
        err.contains(&format!(
            "--export name=a: cannot open {}",
            images.s("a.qcow2")
        )) && err.contains("Failed to get \"write\" lock"),
        "{err}"
    );
    // b and c were opened before a failed: both were closed cleanly, so c's bitmap is not
    // left in use, and both are writable by others.
    let info: Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", &images.s("c.qcow2")])).unwrap();
    let bitmaps = &info["format-specific"]["data"]["bitmaps"];
    assert_eq!(bitmaps[0]["name"], "bm", "{info}");
    assert_eq!(bitmaps[0]["flags"], serde_json::json!(["auto"]), "{info}");
    images.qemu_io("raw", "b.raw", &["write -P 0xbb 0 4k"]);
    images.qemu_io("qcow2", "c.qcow2", &["write -P 0xcc 0 4k"]);
    assert_check_clean(&images.path("c.qcow2"));
}

#[test]
fn a_missing_image_is_named() {
    let images = images();
    let a = export("a", &images.path("a.qcow2"), "");
    let gone = export("gone", &images.path("nothing.qcow2"), "");
    let err = serve_fails(&[
        "-k",
        s(&images.path("s.sock")),
        "--export",
        &a,
        "--export",
        &gone,
    ]);
    assert!(
        err.contains("--export name=gone: cannot open") && err.contains("nothing.qcow2"),
        "{err}"
    );
    images.qemu_io("qcow2", "a.qcow2", &["write -P 0xaa 0 4k"]);
}

fn ours(args: &[&str]) -> Output {
    Command::new(BIN).arg("serve").args(args).output().unwrap()
}

#[test]
fn wrong_definitions_are_refused_naming_the_definition_and_key() {
    let images = images();
    let a = images.s("a.qcow2");
    let bad = [
        (format!("name=a,file={a},size=1G"), "unknown key \"size\""),
        (
            format!("name=a,file={a},name=b"),
            "key \"name\" is given twice",
        ),
        (format!("file={a}"), "key \"name\" is missing"),
        ("name=a".to_owned(), "key \"file\" is missing"),
        (
            format!("name=a,file={a},readonly=maybe"),
            "readonly=\"maybe\"",
        ),
        (format!("name=a,file={a},format=vmdk"), "format=\"vmdk\""),
        (format!("name=a,file={a},"), "expected name=NAME,file=PATH"),
    ];
    for (spec, why) in bad {
        let out = ours(&["-k", "/nonexistent/s", "--export", &spec]);
        let err = text(&out);
        assert_eq!(out.status.code(), Some(2), "{spec}: {err}");
        assert!(
            err.contains(&format!("'{spec}'")) && err.contains(why),
            "{spec}: {err}"
        );
    }
    let one = export("a", &images.path("a.qcow2"), "");
    let out = ours(&["--export", &one, &a]);
    assert!(
        !out.status.success() && text(&out).contains("cannot be used with"),
        "the positional image mixed with --export: {}",
        text(&out)
    );
    let twice = export("a", &images.path("b.raw"), ",format=raw");
    let err = serve_fails(&["-k", "/nonexistent/s", "--export", &one, "--export", &twice]);
    assert!(
        err.contains("--export name=a: the name is given to another --export too"),
        "{err}"
    );
    // Nothing was opened: the image is free.
    images.qemu_io("qcow2", "a.qcow2", &["write -P 0xaa 0 4k"]);
}

#[test]
fn sixty_four_exports_are_served_and_one_more_is_refused() {
    let images = Dir::new();
    let img = images.create("shared.qcow2", "qcow2", "", None, "1M");
    let specs: Vec<String> = (0..65)
        .map(|i| export(&format!("e{i}"), &img, ",readonly=on"))
        .collect();
    let args = |n: usize| -> Vec<&str> {
        specs[..n]
            .iter()
            .flat_map(|s| ["--export", s.as_str()])
            .collect()
    };
    let mut too_many = vec!["-k", "/nonexistent/s"];
    too_many.extend(args(65));
    let err = serve_fails(&too_many);
    assert!(
        err.contains("65 --export definitions given; one server offers at most 64"),
        "{err}"
    );
    let mut all = vec!["-t"];
    all.extend(args(64));
    let server = Server::unix(&all);
    let listed = listing(&server);
    assert_eq!(listed.len(), 64);
    assert_eq!(listed[63].0, "e63");
    qemu_io_read_only("raw", &server.uri_of("e63"), &["read -P 0 0 1M"]);
    server.stop_ok();
}

/// The refcount cache bytes each image logged when it opened.
fn refcount_caches(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("image open"))
        .map(|l| {
            let at = l
                .find("refcount_cache_bytes: ")
                .expect("cache sizes logged")
                + 22;
            l[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        })
        .collect()
}

#[test]
fn the_cache_budget_is_shared_by_the_exports() {
    let images = images();
    let a = export("a", &images.path("a.qcow2"), "");
    let c = export("c", &images.path("c.qcow2"), "");
    // A 4 MiB image's L2 tables fit one 64 KiB cluster of cache; the rest of each image's
    // share goes to its refcount cache, so the share shows there.
    let one = Server::unix_reporting(&["-t", "--cache-size", "2M", "--export", &a]);
    assert_eq!(refcount_caches(&one.stop_ok()), [2048 * 1024 - 65536]);
    let two = Server::unix_reporting(&["-t", "--cache-size", "2M", "--export", &a, "--export", &c]);
    assert_eq!(
        refcount_caches(&two.stop_ok()),
        [1024 * 1024 - 65536, 1024 * 1024 - 65536]
    );
}
