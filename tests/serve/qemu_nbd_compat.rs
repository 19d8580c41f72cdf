//! What `serve` prints, side by side with `qemu-nbd` given the same options: scripts (and
//! QEMU's own test suite) compare qemu-nbd's output, so ours must match where qemu-nbd's is
//! silent.

use std::net::TcpListener;
use std::process::Command;

use crate::support::qemu_nbd::QemuNbd;
use crate::support::{serve_fails, Server, BIN};
use test_support::{qemu, qemu_io, Dir};

#[test]
fn verbose_serving_prints_nothing_like_qemu_nbd() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let theirs = QemuNbd::unix(&["-v"], &img);
    qemu_io("raw", &theirs.uri_of(""), &["write -P 0x5a 0 64k"]);
    let theirs = theirs.stop_stderr();
    let ours = Server::unix(&["-t", "-v", img.to_str().unwrap()]);
    qemu_io("raw", &ours.uri(), &["read -P 0x5a 0 64k"]);
    let ours = ours.stop_ok();
    assert_eq!(
        theirs, "",
        "qemu-nbd -v printed something: the oracle changed"
    );
    assert_eq!(ours, theirs, "serve -v printed what qemu-nbd -v does not");
}

#[test]
fn log_option_still_shows_the_server_at_work() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::unix(&["-t", "--log=info", img.to_str().unwrap()]);
    qemu_io("raw", &server.uri(), &["read 0 4k"]);
    let log = server.stop_ok();
    assert!(log.contains("listening"), "no listening line:\n{log}");
}

#[test]
fn a_port_in_use_is_reported_once_like_qemu_nbd() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let theirs = qemu("qemu-nbd")
        .args(["-b", "127.0.0.1", "-p", &port])
        .arg(&img)
        .output()
        .unwrap();
    let theirs = String::from_utf8_lossy(&theirs.stderr).into_owned();
    assert_eq!(theirs.lines().count(), 1, "qemu-nbd: {theirs}");
    let ours = serve_fails(&["-b", "127.0.0.1", "-p", &port, img.to_str().unwrap()]);
    assert_eq!(ours.lines().count(), 1, "reported more than once:\n{ours}");
    assert!(ours.contains("in use"), "{ours}");
    assert!(
        !ours.contains("WARN"),
        "a log line although logs are quiet:\n{ours}"
    );
}

/// A disk stored 1 MiB into a bigger file (as in an OVA tar archive): served with
/// `--offset`, clients see and change only what lies past the offset, as with qemu-nbd.
#[test]
fn offset_exports_the_rest_of_the_image_like_qemu_nbd() {
    let images = Dir::new();
    for (fmt, size) in [("raw", "3M"), ("qcow2", "3M")] {
        let name = format!("outer.{fmt}");
        images.create(&name, fmt, "", None, size);
        images.qemu_io(fmt, &name, &["write -P 0x11 0 1M", "write -P 0x22 1M 2M"]);
        let copy = format!("theirs.{fmt}");
        images.copy(&name, &copy);
        let cmds = [
            "read -P 0x22 0 2M",
            "write -P 0x33 64k 4k",
            "write -z 1M 64k",
        ];
        let theirs = QemuNbd::unix(&["-f", fmt, "--offset", "0x100000"], &images.path(&copy));
        let their_size = nbd_size(&theirs.uri_of(""));
        qemu_io("raw", &theirs.uri_of(""), &cmds);
        theirs.stop();
        let ours = Server::unix(&[
            "-t",
            "-f",
            fmt,
            "--offset",
            "0x100000",
            images.s(&name).as_str(),
        ]);
        assert_eq!(nbd_size(&ours.uri()), their_size, "{fmt}: export size");
        assert_eq!(their_size, 2 << 20, "{fmt}: qemu-nbd's export size changed");
        qemu_io("raw", &ours.uri(), &cmds);
        ours.stop_ok();
        images.assert_same_contents(&name, fmt, &copy, fmt);
        images.qemu_io(
            fmt,
            &name,
            &[
                "read -P 0x11 0 1M",
                "read -P 0x33 1088k 4k",
                "read -P 0 2M 64k",
            ],
        );
    }
}

#[test]
fn an_offset_past_the_end_is_refused_with_qemu_nbds_words() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let theirs = qemu("qemu-nbd")
        .args(["-k", images.s("q.sock").as_str(), "--offset", "2097152"])
        .arg(&img)
        .output()
        .unwrap();
    let theirs = String::from_utf8_lossy(&theirs.stderr).into_owned();
    let ours = serve_fails(&[
        "-k",
        images.s("o.sock").as_str(),
        "--offset",
        "2097152",
        img.to_str().unwrap(),
    ]);
    let message = |s: &str| s.split_once(": ").map(|(_, m)| m.trim().to_owned());
    assert_eq!(
        message(&ours),
        message(&theirs),
        "ours: {ours}theirs: {theirs}"
    );
    for bad in ["3M", "0x", "12abc", "099"] {
        let out = Command::new(BIN)
            .args(["serve", "-k", images.s("o.sock").as_str(), "--offset", bad])
            .arg(&img)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}: accepted");
        assert!(
            err.contains(&format!("Invalid offset '{bad}'")),
            "{bad}: {err}"
        );
    }
}

/// The export size, as `nbdinfo --size` reports it.
fn nbd_size(uri: &str) -> u64 {
    test_support::nbdinfo(&["--size", uri])
        .trim()
        .parse()
        .unwrap()
}

/// `serve -L` against both servers prints what `qemu-nbd -L` prints against them.
#[test]
fn list_mode_prints_what_qemu_nbd_lists() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let listing = |tool: &[&str], socket: &str| {
        let mut cmd = if tool[0] == "qemu-nbd" {
            qemu("qemu-nbd")
        } else {
            let mut c = Command::new(BIN);
            c.arg("serve");
            c
        };
        let out = cmd.args(["-L", "-k", socket]).output().unwrap();
        assert!(
            out.status.success(),
            "{tool:?} -L: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let theirs = QemuNbd::unix(&["-x", "disk", "-D", "a disk", "-A", "-r"], &img);
    let socket = theirs.socket.to_str().unwrap().to_owned();
    let want = listing(&["qemu-nbd"], &socket);
    assert!(want.contains(" export: 'disk'"), "{want}");
    assert_eq!(
        listing(&["serve"], &socket),
        want,
        "listing qemu-nbd's exports"
    );
    theirs.stop();
    let ours = Server::unix(&[
        "-t",
        "-x",
        "disk",
        "-D",
        "a disk",
        "-A",
        "-r",
        img.to_str().unwrap(),
    ]);
    let socket = ours.socket.to_str().unwrap().to_owned();
    let want = listing(&["qemu-nbd"], &socket);
    assert_eq!(listing(&["serve"], &socket), want, "listing our exports");
    ours.stop_ok();
}

/// What the real `qemu-nbd -L -k SOCKET` prints of the server on `socket`.
fn qemu_nbd_listing(socket: &std::path::Path) -> String {
    let out = qemu("qemu-nbd")
        .args(["-L", "-k"])
        .arg(socket)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Run as `qemu-nbd`, the binary advertises what qemu-nbd advertises for the same command
/// line, so that the real `qemu-nbd -L` lists both servers alike: flags (FUA on a read-only
/// export, multi-conn only with `-e` above 1, block status payloads under extended headers),
/// block sizes and contexts.
#[test]
fn as_qemu_nbd_an_export_is_listed_as_qemu_nbds_own() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "4M");
    let as_qemu_nbd = images.path("qemu-nbd");
    std::os::unix::fs::symlink(BIN, &as_qemu_nbd).unwrap();
    for args in [
        &["-r", "-A", "-f", "qcow2", "-x", "disk"][..],
        &["-e", "2", "-f", "qcow2"][..],
        &["-f", "qcow2", "-D", "a disk"][..],
    ] {
        let theirs = QemuNbd::unix(args, &img);
        let want = qemu_nbd_listing(&theirs.socket);
        theirs.stop();
        let ours = QemuNbd::unix_by(Command::new(&as_qemu_nbd), args, &img);
        let got = qemu_nbd_listing(&ours.socket);
        ours.stop();
        assert_eq!(got, want, "qemu-nbd -L of {args:?}");
    }
}

#[test]
fn list_mode_says_when_there_is_no_server() {
    let images = Dir::new();
    let out = Command::new(BIN)
        .args(["serve", "-L", "-k", images.s("none.sock").as_str()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("none.sock"), "{err}");
}

/// A raw file that is not a whole number of sectors: qemu-nbd exports it rounded up to
/// 512 bytes, the tail reading as zeroes and mapped as a hole, and so do we.
#[test]
fn an_unaligned_raw_file_is_exported_in_whole_sectors_like_qemu_nbd() {
    let images = Dir::new();
    std::fs::write(images.path("disk.raw"), vec![0x5a; 1000]).unwrap();
    let map = |uri: &str| {
        let out = qemu("qemu-img")
            .args(["map", "--output=json", "-f", "raw", uri])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json = String::from_utf8(out.stdout).unwrap();
        // Offsets name the server's socket path; the extents are what matters.
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        for e in v.as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("offset");
        }
        v
    };
    let reads = ["read -P 0x5a 0 1000", "read -P 0 1000 24"];
    let theirs = QemuNbd::unix(&["-f", "raw"], &images.path("disk.raw"));
    let (their_size, their_map) = (nbd_size(&theirs.uri_of("")), map(&theirs.uri_of("")));
    qemu_io("raw", &theirs.uri_of(""), &reads);
    theirs.stop();
    assert_eq!(their_size, 1024, "qemu-nbd's export size changed");
    let ours = Server::unix(&["-t", "-f", "raw", images.s("disk.raw").as_str()]);
    assert_eq!(nbd_size(&ours.uri()), their_size);
    assert_eq!(map(&ours.uri()), their_map);
    qemu_io("raw", &ours.uri(), &reads);
    // Zeroes may go to the tail (it reads as zeroes already), data may not.
    qemu_io(
        "raw",
        &ours.uri(),
        &["write -P 0x11 512 488", "write -z 1000 24"],
    );
    let out = qemu("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x22 1000 24", &ours.uri()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("No space left"), "{text}");
    ours.stop_ok();
    let mut want = vec![0x5a; 512];
    want.extend(vec![0x11; 488]);
    assert_eq!(images.read("disk.raw"), want, "the file keeps its size");
}

/// A raw file given without `-f`: qemu-nbd probes it, warns that it guessed raw, and exports
/// it in whole sectors (minimum block 512, the sector holding the end of the data mapped as
/// data), refusing writes that would put another format's header into the first sector.
/// Ours does all of that alike.
#[test]
fn a_raw_file_given_without_a_format_is_probed_and_guarded_like_qemu_nbd() {
    let images = Dir::new();
    let raw = images.path("disk.raw");
    let list = |socket: &std::path::Path| {
        // `serve` differs in flags on purpose (multi-conn on a read-only export, no FUA
        // there); the sizes are the point.
        qemu_nbd_listing(socket)
            .lines()
            .filter(|l| !l.starts_with("  flags:"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let map = |uri: &str| {
        let out = qemu("qemu-img")
            .args(["map", "--output=json", "-f", "raw", uri])
            .output()
            .unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for e in v.as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("offset");
        }
        v
    };
    // A sector that would make the file a qcow2 image, and an ordinary one.
    let mut header = b"QFI\xfb\0\0\0\x03".to_vec();
    header.resize(512, 0);
    std::fs::write(images.path("header"), &header).unwrap();
    let attempt = |uri: &str, cmd: &str| {
        let out = qemu("qemu-io")
            .args(["-f", "raw", "-c", cmd, uri])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    let header_write = format!("write -s {} 0 512", images.s("header"));
    let mut seen = Vec::new();
    for ours in [false, true] {
        std::fs::write(&raw, vec![0x5a; 1000]).unwrap();
        let (uri, listing, mapped, refused, allowed, stop): (
            _,
            _,
            _,
            _,
            _,
            Box<dyn FnOnce() -> String>,
        );
        if ours {
            let s = Server::unix(&["-t", images.s("disk.raw").as_str()]);
            uri = s.uri();
            listing = list(&s.socket);
            mapped = map(&uri);
            refused = attempt(&uri, &header_write);
            allowed = attempt(&uri, "write -P 0x11 0 512");
            stop = Box::new(move || s.stop_ok());
        } else {
            let q = QemuNbd::unix(&[], &raw);
            uri = q.uri_of("");
            listing = list(&q.socket);
            mapped = map(&uri);
            refused = attempt(&uri, &header_write);
            allowed = attempt(&uri, "write -P 0x11 0 512");
            stop = Box::new(move || q.stop_stderr());
        }
        let _ = uri;
        assert!(
            refused.contains("Operation not permitted"),
            "ours={ours}: {refused}"
        );
        assert!(allowed.contains("wrote 512/512"), "ours={ours}: {allowed}");
        let stderr = stop();
        let warning = stderr
            .lines()
            .filter(|l| l.starts_with("WARNING") || l.starts_with("         "))
            .map(str::to_owned)
            .collect::<Vec<_>>();
        assert_eq!(
            &images.read("disk.raw")[..512],
            &[0x11; 512][..],
            "ours={ours}"
        );
        seen.push((listing, mapped, warning));
    }
    let theirs = &seen[0];
    assert!(
        theirs.0.contains("min block: 512"),
        "qemu-nbd changed: {}",
        theirs.0
    );
    assert_eq!(
        theirs.2.len(),
        3,
        "qemu-nbd's warning changed: {:?}",
        theirs.2
    );
    assert_eq!(seen[1], seen[0], "ours (right) against qemu-nbd (left)");
    // Read-only, nothing is restricted, so nothing is said.
    let s = Server::unix(&["-t", "-r", images.s("disk.raw").as_str()]);
    let stderr = s.stop_ok();
    assert!(!stderr.contains("WARNING"), "{stderr}");
}
