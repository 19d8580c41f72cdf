//! Hostile control input, and a control path that is some other file.

use std::io::Write;

use serde_json::json;

use super::harness::*;
use crate::support::{serve_fails, Server};
use test_support::{qemu_io, Dir};

#[test]
fn hostile_control_input_is_answered_and_the_exports_stay_served() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &[]);
    let (mut q, _) = Qmp::connect_raw(&dir);
    let before = q.error(json!({"execute": "query-block-exports", "id": 1}));
    assert_eq!(before.0, "CommandNotFound", "{before:?}");
    assert!(before.1.contains("qmp_capabilities"), "{before:?}");
    assert_eq!(
        q.run(json!({"execute": "qmp_capabilities", "id": "x"})),
        json!({"return": {}, "id": "x"})
    );
    // Bad JSON: answered, and the stream goes on after the line.
    q.send(b"{\"execute\": oops}\n");
    assert_eq!(q.answer()["error"]["class"], "GenericError");
    for (request, class, desc) in [
        (
            json!([1, 2]),
            "GenericError",
            "QMP input must be a JSON object",
        ),
        (
            json!({"execute": "nope"}),
            "CommandNotFound",
            "The command nope has not been found",
        ),
        (
            json!({"execute": "block-export-add", "arguments": {"file": "f"}}),
            "GenericError",
            "Parameter 'id' is missing",
        ),
        (
            json!({"execute": "block-export-add", "arguments": {"id": "c", "file": "f", "x": 1}}),
            "GenericError",
            "Parameter 'x' is unexpected",
        ),
        (
            json!({"execute": "block-export-add", "arguments": {"id": "c", "file": "f", "writable": "yes"}}),
            "GenericError",
            "Invalid parameter type for 'writable', expected: boolean",
        ),
        (
            json!({"execute": "block-export-add", "arguments": {"id": "c", "node-name": "n", "file": "f"}}),
            "GenericError",
            "Parameter 'node-name' is not supported",
        ),
        (
            json!({"execute": "block-export-add", "arguments": {"id": "c", "file": "f", "type": "fuse"}}),
            "GenericError",
            "Export type 'fuse' is not supported",
        ),
        (
            json!({"execute": "block-export-del", "arguments": {"id": "zz"}}),
            "DeviceNotFound",
            "Export 'zz' is not found",
        ),
        (
            json!({"execute": "block-export-del", "arguments": {"id": "a", "mode": "gentle"}}),
            "GenericError",
            "Parameter 'mode' does not accept value 'gentle'",
        ),
        (
            json!({"execute": "qmp_capabilities"}),
            "CommandNotFound",
            "Capabilities negotiation is already complete",
        ),
    ] {
        let (c, d) = q.error(request.clone());
        assert_eq!(c, class, "{request}: {d}");
        assert!(d.starts_with(desc), "{request}: {d}");
    }
    // Objects back to back, without newlines, each answered with its id.
    q.send(b"{\"execute\":\"query-version\",\"id\":1}{\"execute\":\"query-commands\",\"id\":2}");
    assert_eq!(q.answer()["id"], 1);
    let commands = q.answer();
    assert_eq!(commands["id"], 2);
    assert!(commands["return"]
        .as_array()
        .unwrap()
        .contains(&json!({"name": "block-export-add"})));

    // Too many clients: the 17th is told so and closed.
    let mut held: Vec<Qmp> = (0..15).map(|_| Qmp::connect_raw(&dir).0).collect();
    let (mut extra, first) = Qmp::connect_raw(&dir);
    assert_eq!(first["error"]["class"], "GenericError", "{first}");
    assert!(
        first["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("at most 16"),
        "{first}"
    );
    assert!(extra.next().is_none(), "and closed");
    held.clear();

    // A 1 MiB line: an error, then the connection is closed.
    let big = format!("{{\"execute\": \"{}\"}}\n", "x".repeat(1 << 20));
    let _ = q.writer.write_all(big.as_bytes());
    let answer = q.next().expect("an answer to the long line");
    assert_eq!(answer["error"]["class"], "GenericError", "{answer}");
    assert!(
        answer["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("too long"),
        "{answer}"
    );
    assert!(q.next().is_none(), "the connection is closed");

    // Through all of it the export was served, and new control clients are welcome.
    qemu_io(
        "raw",
        &server.uri_of("a"),
        &["write -P 9 0 64k", "read -P 9 0 64k"],
    );
    let mut q = Qmp::connect(&dir);
    assert_eq!(q.exports().len(), 1);
    server.stop_ok();
}

#[test]
fn the_control_path_must_not_be_another_file() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    std::fs::write(dir.path("ctl.sock"), b"keep me").unwrap();
    let err = serve_fails(&[
        "-k",
        &dir.s("nbd.sock"),
        "--control",
        &dir.s("ctl.sock"),
        &dir.s("a.qcow2"),
    ]);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(dir.path("ctl.sock")).unwrap(), b"keep me");
    // A stale socket is replaced, and the single image's export is export0.
    std::fs::remove_file(dir.path("ctl.sock")).unwrap();
    drop(std::os::unix::net::UnixListener::bind(dir.path("ctl.sock")).unwrap());
    let server = Server::unix(&["-t", "--control", &dir.s("ctl.sock"), &dir.s("a.qcow2")]);
    let exports = ctl_ok(&dir, &["query-block-exports"]);
    assert_eq!(exports[0]["id"], "export0", "{exports}");
    assert_eq!(exports[0]["name"], "", "{exports}");
    server.stop_ok();
    assert!(
        !dir.path("ctl.sock").exists(),
        "the socket file goes with the server"
    );
}
