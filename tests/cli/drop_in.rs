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

/// The first word after the tool's name that looks like a version (`10.0.2`).
fn version_of(line: &str) -> Option<(u32, u32)> {
    let word = line
        .split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))?;
    let mut parts = word.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// Scripts probe the tools before using them (libnbd's tests begin with `requires qemu-nbd
/// --version`) and parse the first line's version: ours answers both tools' version options
/// with QEMU's layout (qemu-nbd names itself as it was run, qemu-img by its name), a QEMU
/// version at least the installed QEMU's major release.
#[test]
fn as_qemu_nbd_and_qemu_img_it_answers_the_version_options_in_qemu_layout() {
    let d = Dir::new();
    let nbd_path = test_support::require("qemu-nbd", "qemu-utils");
    let nbd_prefix = format!("{} ", nbd_path.display());
    for (tool, prefix) in [("qemu-nbd", "qemu-nbd "), ("qemu-img", "qemu-img version ")] {
        let theirs = test_support::qemu(tool).arg("--version").output().unwrap();
        let theirs = String::from_utf8_lossy(&theirs.stdout).into_owned();
        let first = theirs.lines().next().unwrap_or_default();
        let their_prefix = if tool == "qemu-nbd" {
            nbd_prefix.as_str()
        } else {
            prefix
        };
        assert!(first.starts_with(their_prefix), "{tool} changed: {theirs}");
        for flag in ["--version", "-V"] {
            let out = run_as(&d, tool, &[flag]);
            assert!(out.status.success(), "{tool} {flag}: {}", text(&out));
            let ours = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = ours.lines().next().unwrap_or_default();
            assert!(line.starts_with(prefix), "{tool} {flag}: {ours}");
            assert!(line.contains("qcow2-nbd"), "{tool} {flag}: {ours}");
            assert!(
                version_of(line).map(|v| v.0) >= version_of(first).map(|v| v.0),
                "{tool} {flag}: ours {line:?}, installed {first:?}"
            );
        }
    }
    // After other options too, as getopt reads them.
    let out = run_as(&d, "qemu-nbd", &["-k", "/nonexistent/s", "--version"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The usage line names the tool as it was run, without our subcommand.
#[test]
fn as_qemu_nbd_its_usage_says_qemu_nbd() {
    let d = Dir::new();
    let out = run_as(&d, "qemu-nbd", &["--help"]);
    assert!(out.status.success(), "{}", text(&out));
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        help.contains("Usage: qemu-nbd [OPTIONS] FILE\n  or:  qemu-nbd -L [OPTIONS]"),
        "{help}"
    );
    assert!(!help.contains("Usage: qemu-nbd serve"), "{help}");
    let out = run_as(&d, "qemu-nbd", &["--no-such-option"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        stderr(&out).contains("Usage: qemu-nbd [OPTIONS] FILE"),
        "{}",
        stderr(&out)
    );
}
