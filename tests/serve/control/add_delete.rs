//! Exports added and deleted while the server runs: safe and hard deletes, failed adds, a
//! shutdown in the middle of a delete.

use std::os::unix::fs::PermissionsExt;

use serde_json::{json, Value};

use super::harness::*;
use crate::support::qemu_nbd::QemuNbd;
use test_support::{assert_check_clean, qemu_io, Dir};

#[test]
fn an_export_added_at_run_time_is_served_then_deleted_safely_after_its_last_client() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    dir.qemu_io("qcow2", "a.qcow2", &["write -P 0xa1 0 4M"]);
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &[]);
    let mode = std::fs::metadata(dir.path("ctl.sock"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the control socket is owner-only");
    let mut q = Qmp::connect(&dir);

    assert_eq!(
        ctl_ok(
            &dir,
            &[
                "block-export-add",
                "id=b",
                &format!("file={}", b.display()),
                "writable=true"
            ]
        ),
        json!({})
    );
    assert_eq!(listed(&server), ["a", "b"]);
    // Both exports at once: a written-to b while a is read.
    let uri_b = server.uri_of("b");
    let writer = std::thread::spawn(move || qemu_io("raw", &uri_b, &["write -P 0x5b 0 1M"]));
    qemu_io("raw", &server.uri_of("a"), &["read -P 0xa1 0 4M"]);
    writer.join().unwrap();

    let mut client = Attached::try_go(&server.socket, "b").expect("b is served");
    client.write(1 << 20, &[0x77; 4096]).unwrap();
    let stats = ctl_ok(&dir, &["query-stats", "id=b"]);
    let conns = &stats["exports"][0]["connections"];
    assert_eq!(
        (&conns["attached"], &conns["total"]),
        (&json!(1), &json!(2)),
        "{stats}"
    );
    assert_eq!(ctl_ok(&dir, &["block-export-del", "id=b"]), json!({}));
    let info = q.exports();
    let b_info = info.iter().find(|e| e["id"] == "b").unwrap();
    assert_eq!(b_info["shutting-down"], true, "{b_info}");
    assert_eq!(b_info["connections"], 1, "{b_info}");
    assert_eq!(listed(&server), ["a"], "a closing export is not listed");
    assert!(
        Attached::try_go(&server.socket, "b").is_none(),
        "nor selected"
    );
    // The attached client still reads and writes; the image stays open and locked.
    client.write(2 << 20, &[0x78; 512]).unwrap();
    assert_eq!(client.read(1 << 20, 4096).unwrap(), vec![0x77; 4096]);
    assert!(
        !unlocked(&b),
        "the image is open while a client is attached"
    );
    let again = q.error(json!({"execute": "block-export-del", "arguments": {"id": "b"}}));
    assert_eq!(again.0, "GenericError", "{again:?}");

    drop(client);
    let event = q.wait_deleted("b");
    assert!(event["timestamp"]["seconds"].as_u64().unwrap() > 0);
    assert_check_clean(&b);
    assert!(unlocked(&b), "the lock is released once the export is gone");
    qemu_io(
        "qcow2",
        &b,
        &[
            "read -P 0x5b 0 1M",
            "read -P 0x77 1M 4k",
            "read -P 0x78 2M 512",
        ],
    );
    let ids: Vec<Value> = q.exports().iter().map(|e| e["id"].clone()).collect();
    assert_eq!(ids, [json!("a")]);
    let total = &ctl_ok(&dir, &["query-stats"])["total"]["connections"];
    assert_eq!(
        (&total["attached"], &total["total"]),
        (&json!(0), &json!(3)),
        "{total}"
    );
    server.stop_ok();
}

#[test]
fn a_hard_delete_cuts_its_clients_off_and_releases_the_image() {
    let dir = Dir::new();
    let (_, b, server) = serve_a_and_b(&dir, &[]);
    let mut client = Attached::try_go(&server.socket, "b").unwrap();
    client.write(0, &[0x42; 65536]).unwrap();
    // --wait returns once the image is closed.
    let out = ctl_ok(&dir, &["--wait", "block-export-del", "id=b", "mode=hard"]);
    assert_eq!(out, json!({}));
    // The connection is closed: the next request gets no answer.
    let cut = client.request(0, 0, 512, 9).and_then(|()| client.reply(9));
    assert!(cut.is_err(), "the client was cut off: {cut:?}");
    assert_check_clean(&b);
    assert!(unlocked(&b));
    qemu_io("qcow2", &b, &["read -P 0x42 0 64k"]);
    // The other export is untouched.
    qemu_io(
        "raw",
        &server.uri_of("a"),
        &["write -P 1 0 64k", "read -P 1 0 64k"],
    );
    server.stop_ok();
}

#[test]
fn adding_an_image_that_cannot_be_served_fails_cleanly_and_the_server_goes_on() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &[]);
    let file = format!("file={}", c.display());
    {
        let _holder = QemuNbd::unix(&[], &c);
        let err = ctl_fails(&dir, &["block-export-add", "id=c", &file, "writable=true"]);
        assert!(err.contains("lock"), "{err}");
    }
    let missing = format!("file={}", dir.s("missing.qcow2"));
    let err = ctl_fails(&dir, &["block-export-add", "id=m", &missing]);
    assert!(err.contains("missing.qcow2"), "{err}");
    let err = ctl_fails(&dir, &["block-export-add", "id=a", &file]);
    assert!(err.contains("Export id 'a' is already in use"), "{err}");
    let err = ctl_fails(&dir, &["block-export-add", "id=c2", "name=a", &file]);
    assert!(err.contains("Export name 'a' is already in use"), "{err}");
    let err = ctl_fails(&dir, &["block-export-add", "id=c", &file, "bitmaps=nope"]);
    assert!(err.contains("Bitmap 'nope' is not found"), "{err}");
    // Errors speak of the command and its arguments, not of the command line's flags.
    assert!(
        err.contains(&format!("block-export-add id=c {file}")) && !err.contains("--export"),
        "{err}"
    );
    assert!(unlocked(&c), "a failed add leaves nothing open");
    // Nothing of it is served; a and the control socket still work.
    assert_eq!(listed(&server), ["a"]);
    qemu_io("raw", &server.uri_of("a"), &["write -P 3 0 64k"]);
    ctl_ok(&dir, &["block-export-add", "id=c", &file]);
    assert_eq!(listed(&server), ["a", "c"]);
    server.stop_ok();
    assert_check_clean(&c);
}

#[test]
fn a_shutdown_during_a_safe_delete_still_closes_every_image() {
    shutdown_during_a_safe_delete("1");
}

#[test]
fn with_worker_threads_a_shutdown_during_a_safe_delete_still_closes_every_image() {
    shutdown_during_a_safe_delete("2");
}

/// With two threads the delete waits for a client on each.
fn shutdown_during_a_safe_delete(threads: &str) {
    let dir = Dir::new();
    let (a, b, server) = serve_a_and_b(&dir, &["--threads", threads]);
    let clients: Vec<Attached> = (0..threads.parse::<usize>().unwrap())
        .map(|i| {
            let mut c = Attached::try_go(&server.socket, "b").unwrap();
            c.write(i as u64 * 4096, &[0x5c; 4096]).unwrap();
            c
        })
        .collect();
    let mut q = Qmp::connect(&dir);
    ctl_ok(&dir, &["block-export-del", "id=b"]);
    // An idle control client and an attached NBD client do not hold the shutdown up.
    server.stop_ok();
    // The session ends with the server (the delete's event may or may not come first).
    while let Some(m) = q.next() {
        assert_eq!(m["event"], "BLOCK_EXPORT_DELETED", "{m}");
    }
    for image in [&a, &b] {
        assert_check_clean(image);
        assert!(unlocked(image));
    }
    let written = format!("read -P 0x5c 0 {}k", 4 * clients.len());
    qemu_io("qcow2", &b, &[&written]);
    drop(clients);
}

#[test]
fn a_hard_delete_ends_a_safe_delete_that_a_client_holds_up() {
    let dir = Dir::new();
    let (_, b, server) = serve_a_and_b(&dir, &[]);
    let mut q = Qmp::connect(&dir);
    // A client that never leaves.
    let mut client = Attached::try_go(&server.socket, "b").unwrap();
    client.write(0, &[0x6b; 65536]).unwrap();
    assert_eq!(ctl_ok(&dir, &["block-export-del", "id=b"]), json!({}));
    let again = q.error(json!({"execute": "block-export-del", "arguments": {"id": "b"}}));
    assert!(again.1.contains("already shutting down"), "{again:?}");
    assert!(!unlocked(&b), "the client holds the image open");
    // --wait returns once the image is closed.
    let out = ctl_ok(&dir, &["--wait", "block-export-del", "id=b", "mode=hard"]);
    assert_eq!(out, json!({}));
    q.wait_deleted("b");
    let cut = client.request(0, 0, 512, 9).and_then(|()| client.reply(9));
    assert!(cut.is_err(), "the client was cut off: {cut:?}");
    assert_check_clean(&b);
    assert!(unlocked(&b));
    qemu_io("qcow2", &b, &["read -P 0x6b 0 64k"]);
    let gone =
        q.error(json!({"execute": "block-export-del", "arguments": {"id": "b", "mode": "hard"}}));
    assert_eq!(gone.0, "DeviceNotFound", "{gone:?}");
    qemu_io("raw", &server.uri_of("a"), &["write -P 1 0 64k"]);
    server.stop_ok();
}
