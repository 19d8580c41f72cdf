//! The binary as a drop-in by name: run as `qemu-img` (a link of that name, or `exec -a`) it
//! takes qemu-img's command line, run as `qemu-nbd` qemu-nbd's (no `serve`), and its messages
//! begin with that name, as QEMU's tools' messages do.

use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use test_support::{exit_within, text, wait_until, Dir};

use crate::common::BIN;

/// A link named `name` to the binary, in `d`.
fn link(d: &Dir, name: &str) -> String {
    let path = d.path(name);
    std::os::unix::fs::symlink(BIN, &path).expect("link the binary");
    d.s(name)
}

/// Runs the binary with `argv[0]` set to `name` (as `exec -a NAME` does).
fn run_as(d: &Dir, name: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg0(name)
        .args(args)
        .current_dir(d.root())
        .stdin(Stdio::null())
        .output()
        .expect("run the binary")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn as_qemu_img_it_takes_qemu_img_command_lines() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 0x5a 1M 64k"]);
    let own = d.ok(BIN, &["map", "--output=json", "a.qcow2"]);
    let qemu_img = link(&d, "qemu-img");
    let by_link = d.ok(&qemu_img, &["map", "--output=json", "a.qcow2"]);
    let by_arg0 = run_as(&d, "qemu-img", &["map", "--output=json", "a.qcow2"]);
    assert!(by_arg0.status.success(), "{}", text(&by_arg0));
    assert_eq!(by_link, own);
    assert_eq!(String::from_utf8_lossy(&by_arg0.stdout), own);
}

#[test]
fn as_qemu_img_its_errors_begin_with_qemu_img() {
    let d = Dir::new();
    let qemu_img = link(&d, "qemu-img");
    for out in [
        d.run(&qemu_img, &["info", "missing.qcow2"]),
        run_as(&d, "/usr/bin/qemu-img", &["info", "missing.qcow2"]),
    ] {
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(stderr(&out).starts_with("qemu-img: "), "{}", stderr(&out));
    }
    let own = d.run(BIN, &["info", "missing.qcow2"]);
    assert!(stderr(&own).starts_with("qcow2-nbd: "), "{}", stderr(&own));
    // A command line qemu-img refuses exits 1, as qemu-img's does.
    let q = d.run("qemu-img", &["info", "--no-such-option", "x"]);
    let o = d.run(&qemu_img, &["info", "--no-such-option", "x"]);
    assert_eq!(o.status.code(), q.status.code(), "{}", text(&o));
}

#[test]
fn as_qemu_nbd_it_serves_without_a_subcommand() {
    let d = Dir::new();
    d.create("a.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 0x5a 1M 64k"]);
    let qemu_nbd = link(&d, "qemu-nbd");
    let sock = d.s("s.sock");
    let mut server = Command::new(&qemu_nbd)
        .args(["-k", &sock, "-r", "-f", "qcow2", "a.qcow2"])
        .current_dir(d.root())
        .stdin(Stdio::null())
        .spawn()
        .expect("start qemu-nbd (ours)");
    let s = sock.clone();
    wait_until(Duration::from_secs(10), "the socket", move || {
        std::path::Path::new(&s).exists()
    });
    let uri = format!("nbd+unix:///?socket={sock}");
    let read = test_support::qemu("qemu-io")
        .args(["-f", "raw", "-r", "-c", "read -P 0x5a 1M 64k", &uri])
        .output()
        .expect("qemu-io");
    let served = String::from_utf8_lossy(&read.stdout).into_owned();
    // Without -t the server ends once its client has left.
    let status = exit_within(&mut server, Duration::from_secs(10));
    if status.is_none() {
        let _ = server.kill();
        let _ = server.wait();
    }
    assert!(
        read.status.success() && !served.contains("Pattern verification failed"),
        "{served}{}",
        String::from_utf8_lossy(&read.stderr)
    );
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let out = run_as(&d, "qemu-nbd", &["-k", &sock, "missing.qcow2"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(stderr(&out).starts_with("qemu-nbd: "), "{}", stderr(&out));
}
