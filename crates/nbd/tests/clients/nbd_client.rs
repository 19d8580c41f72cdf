//! The reference `nbd-client` over TCP: listing exports, and negotiating an export up to the
//! point where it would hand the socket to the kernel (no /dev/nbd device is needed).

use std::process::Command;
use std::rc::Rc;

use nbd::{ExportEntry, MemExport};
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
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("size = 3MB"), "{text}");
}
