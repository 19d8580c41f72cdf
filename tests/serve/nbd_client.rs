//! The reference `nbd-client` against `qcow2-nbd serve` over TCP: listing exports, and
//! negotiating a named export up to the point where it would hand the socket to the kernel
//! (no /dev/nbd device is needed).

use std::process::Command;

use crate::support::Server;
use test_support::{require, run_ok, stdout, Dir};

fn server(images: &Dir) -> Server {
    let img = images.create("disk.qcow2", "qcow2", "", None, "3M");
    Server::tcp(&[
        "-t",
        "-x",
        "disk2",
        "-D",
        "the second disk",
        img.to_str().unwrap(),
    ])
}

#[test]
fn nbd_client_lists_the_export_with_its_description() {
    let images = Dir::new();
    let server = server(&images);
    let port = server.port.unwrap().to_string();
    let out = stdout(&run_ok(
        Command::new(require("nbd-client", "nbd-client")).args(["-l", "127.0.0.1", &port]),
    ));
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("Negotiation"))
        .collect();
    assert_eq!(lines, ["disk2: the second disk"], "{out}");
    server.stop_ok();
}

#[test]
fn nbd_client_negotiates_the_named_export_up_to_its_size() {
    let images = Dir::new();
    let server = server(&images);
    let port = server.port.unwrap().to_string();
    // The device path does not exist, so the client stops right after negotiation even on
    // a machine with the nbd module; what matters is that it reached the size line.
    let out = Command::new(require("nbd-client", "nbd-client"))
        .args([
            "-N",
            "disk2",
            "127.0.0.1",
            &port,
            "/nonexistent/nbd-device",
            "-n",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("size = 3MB"), "{text}");
    server.stop_ok();
}
