//! The reference `nbd-client` against `qcow2-nbd serve` over TCP: listing exports, and
//! negotiating a named export up to the point where it would hand the socket to the kernel
//! (no /dev/nbd device is needed); `mem_export` does both with two exports.

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

/// nbd-client against the nbd-server crate's server with two exports, which the binary cannot
/// serve: the listing shows both (one without a description), and negotiation picks the one named.
mod mem_export {
    use std::process::Command;
    use std::rc::Rc;

    use nbd_server::{ExportEntry, MemExport};
    use test_support::nbd_server::{snapshots, Opts, Snapshot, TestServer};
    use test_support::{require, run_ok, stdout};

    fn two_exports() -> TestServer<Vec<Snapshot>> {
        TestServer::start_with(
            Opts {
                tcp: true,
                ..Opts::default()
            },
            || {
                vec![
                    ExportEntry::new("disk1", Rc::new(MemExport::new(1 << 20)))
                        .with_description("first disk"),
                    ExportEntry::new("disk2", Rc::new(MemExport::new(3 << 20))),
                ]
            },
            snapshots,
        )
    }

    #[test]
    fn nbd_client_lists_the_exports() {
        let server = two_exports();
        let addr = server.tcp.expect("tcp listener");
        let bin = require("nbd-client", "nbd-client");
        let out = stdout(&run_ok(Command::new(bin).args([
            "-l",
            &addr.ip().to_string(),
            &addr.port().to_string(),
        ])));
        let lines: Vec<&str> = out
            .lines()
            .filter(|l| !l.starts_with("Negotiation"))
            .collect();
        assert_eq!(lines, ["disk1: first disk", "disk2"], "{out}");
    }

    #[test]
    fn nbd_client_negotiates_a_named_export_up_to_its_size() {
        let server = two_exports();
        let addr = server.tcp.expect("tcp listener");
        let bin = require("nbd-client", "nbd-client");
        // The device path does not exist, so the client stops right after negotiation even on
        // a machine with the nbd module; what matters is that negotiation reached the size
        // line for the export we named.
        let out = Command::new(bin)
            .args([
                "-N",
                "disk2",
                &addr.ip().to_string(),
                &addr.port().to_string(),
                "/nonexistent/nbd-device",
                "-n",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("size = 3MB"), "{text}");
    }
}
