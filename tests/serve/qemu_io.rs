//! qemu-io as the NBD client of `qcow2-nbd serve`, over `nbd+unix://` and `nbd://`: writes
//! with patterns, reads that verify them, zeroing with and without unmap, discard, flush and
//! FUA writes, on qcow2 images over backing files (standard and extended L2). Afterwards the
//! file must pass `qemu-img check` and equal a raw model that got the same writes from
//! qemu-io directly. `mem_export` checks what each command arrives as at the server.

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

/// The same client against the nbd-server crate's server over an in-memory export, which
/// reports what each command arrived as: FUA writes, TRIM, flushes, zeroing with and without
/// unmap, the allocation each left behind, and read errors; over a Unix socket and over TCP.
/// An encrypted image is served as qemu-nbd serves it: the secret comes as `--object
/// secret` and the image names it in `--image-opts`; what a client writes is stored
/// encrypted, so QEMU reads it back only with the key.
#[test]
fn an_encrypted_image_is_served_with_its_secret() {
    let images = Dir::new();
    let secret = "secret,id=sec0,data=astrochicken";
    let image = images.s("enc.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        secret,
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
        &image,
        "4M",
    ]);
    let opts = format!("driver=qcow2,file.filename={image},encrypt.key-secret=sec0");
    let qemu_io_enc = |cmds: &[&str]| {
        let mut args = vec!["--object", secret, "--image-opts", &opts];
        for c in cmds {
            args.extend(["-c", c]);
        }
        let out = images.ok("qemu-io", &args);
        assert!(!out.contains("failed"), "qemu-io {cmds:?}: {out}");
    };
    qemu_io_enc(&["write -P 0x5a 0 64k"]);

    let server = Server::unix(&["--object", secret, "--image-opts", &opts]);
    qemu_io(
        "raw",
        &server.uri(),
        &["read -P 0x5a 0 64k", "write -P 0x33 1M 64k", "flush"],
    );
    server.stop_ok();

    qemu_io_enc(&["read -P 0x5a 0 64k", "read -P 0x33 1M 64k"]);
    let plain = std::fs::read(&image).unwrap();
    assert!(
        !plain.windows(4096).any(|w| w.iter().all(|&b| b == 0x33)),
        "the written data is stored encrypted"
    );
    let refused = crate::support::serve_fails(&["-k", "/nonexistent/e.sock", &image]);
    assert!(refused.contains("encrypt.key-secret"), "{refused}");
}

mod mem_export {
    use nbd_server::{Extent, MemExport};
    use std::process::Command;
    use test_support::nbd_server::{mem_server, Opts, Snapshot};
    use test_support::{qemu_io, require};

    const K: usize = 1024;
    const SIZE: u64 = 1 << 20;

    const SCRIPT: &[&str] = &[
        "write -P 0xab 0 64k",
        "read -P 0xab 0 64k",
        "write -P 0x12 64k 64k",
        "write -z 64k 64k",
        "read -P 0 64k 64k",
        "write -P 0xcd 128k 64k",
        "write -z -u 128k 64k",
        "read -P 0 128k 64k",
        "write -P 0xef 192k 64k",
        "discard 192k 64k",
        "flush",
        "write -f -P 0x11 256k 4k",
        "read -P 0x11 256k 4k",
        "write -P 0x33 300000 1000",
        "read -P 0x33 300000 1000",
        "read -P 0 512k 64k",
    ];

    /// What the script leaves behind, byte for byte (the discarded range is unspecified).
    fn expected() -> Vec<Option<u8>> {
        let mut m = vec![Some(0u8); SIZE as usize];
        let mut set = |off: usize, len: usize, v: Option<u8>| m[off..off + len].fill(v);
        set(0, 64 * K, Some(0xab));
        set(64 * K, 64 * K, Some(0));
        set(128 * K, 64 * K, Some(0));
        set(192 * K, 64 * K, None);
        set(256 * K, 4 * K, Some(0x11));
        set(300_000, 1000, Some(0x33));
        m
    }

    fn check(snap: &Snapshot) {
        for (i, want) in expected().iter().enumerate() {
            if let Some(w) = want {
                assert_eq!(snap.contents[i], *w, "byte {i}");
            }
        }
        let s = snap.stats;
        assert!(s.fua_writes >= 1, "write -f must arrive with FUA: {s:?}");
        assert!(s.trims >= 1, "discard must arrive as TRIM: {s:?}");
        assert!(s.flushes >= 2, "flush (plus the shutdown flush): {s:?}");
        assert!(s.zero_writes >= 2 && s.unmapping_zero_writes >= 1, "{s:?}");
        // `write -z` sends NO_HOLE: allocated zeroes; `write -z -u` may unmap: a hole.
        let at = |offset: u64| -> Extent {
            let mut pos = 0;
            for e in &snap.extents {
                if offset < pos + e.len {
                    return *e;
                }
                pos += e.len;
            }
            panic!("offset {offset} not covered");
        };
        let z = at(64 * 1024);
        assert!(
            z.zero && !z.hole,
            "write -z keeps the range allocated: {z:?}"
        );
        let u = at(128 * 1024);
        assert!(u.zero && u.hole, "write -z -u unmaps: {u:?}");
        assert!(at(192 * 1024).hole, "discard deallocates whole granules");
    }

    #[test]
    fn qemu_io_over_a_unix_socket() {
        let server = mem_server(Opts::default(), || MemExport::new(SIZE));
        qemu_io("raw", &server.uri(), SCRIPT);
        // A second, separate client sees what the first wrote.
        qemu_io(
            "raw",
            &server.uri(),
            &["read -P 0xab 0 64k", "read -P 0x11 256k 4k"],
        );
        let (report, snaps) = server.stop();
        assert_eq!(report.connections, 2);
        assert_eq!(report.failed_connections, 0);
        check(&snaps[0]);
    }

    #[test]
    fn qemu_io_over_tcp() {
        let server = mem_server(
            Opts {
                tcp: true,
                ..Opts::default()
            },
            || MemExport::new(SIZE),
        );
        let addr = server.tcp.expect("tcp listener");
        qemu_io("raw", &format!("nbd://{addr}"), SCRIPT);
        let (_, snaps) = server.stop();
        check(&snaps[0]);
    }

    #[test]
    fn qemu_io_sees_read_errors_as_errors() {
        let server = mem_server(Opts::default(), || {
            let m = MemExport::new(SIZE);
            m.fail_range(4096, 1, nbd_proto::Errno::Io);
            m
        });
        let bin = require("qemu-io", "qemu-utils");
        let out = Command::new(bin)
            .args([
                "-f",
                "raw",
                &server.uri(),
                "-c",
                "read 0 8k",
                "-c",
                "read -P 0 8k 8k",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("Input/output error"), "{text}");
        assert!(
            text.contains("read 8192/8192 bytes at offset 8192"),
            "the connection survives: {text}"
        );
    }
}
