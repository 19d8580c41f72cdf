//! Exports that come and go with `--threads`: served from every thread, deleted with clients
//! on each, and beside an export under fio load.

use std::process::{Command, Stdio};

use serde_json::{json, Value};

use super::harness::*;
use crate::support::Server;
use test_support::{assert_check_clean, qemu_io, require, text, Dir};

#[test]
fn exports_come_and_go_while_another_is_under_fio_load() {
    come_and_go_under_fio_load("1");
}

#[test]
fn with_worker_threads_exports_come_and_go_while_another_is_under_fio_load() {
    come_and_go_under_fio_load("2");
}

fn come_and_go_under_fio_load(threads: &str) {
    let dir = Dir::new();
    let a = dir.create("a.qcow2", "qcow2", "", None, "32M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = Server::unix_reporting(&[
        "-t",
        "-e",
        "0",
        "--threads",
        threads,
        "--control",
        &dir.s("ctl.sock"),
        "--export",
        &export("a", &dir, "a.qcow2"),
    ]);
    let fio = Command::new(require("fio", "fio"))
        .current_dir(dir.root())
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri_of("a")),
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=8",
            "--size=32m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for round in 0..3u8 {
        let file = format!("file={}", c.display());
        ctl_ok(&dir, &["block-export-add", "id=c", &file, "writable=true"]);
        let pattern = format!("write -P {} 0 1M", round + 1);
        qemu_io("raw", &server.uri_of("c"), &[&pattern]);
        ctl_ok(&dir, &["--wait", "block-export-del", "id=c"]);
        assert_check_clean(&c);
        qemu_io("qcow2", &c, &[&format!("read -P {} 0 1M", round + 1)]);
    }
    let out = fio.wait_with_output().unwrap();
    assert!(out.status.success(), "fio: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout[stdout.find('{').unwrap_or(0)..])
        .unwrap_or_else(|e| panic!("fio JSON output: {e}\n{stdout}"));
    assert_eq!(report["jobs"][0]["error"], 0);
    assert_eq!(
        report["jobs"][0]["read"]["io_bytes"],
        32 << 20,
        "all verified"
    );
    let counts = server.stop_report();
    assert_eq!(counts.failed_connections, 0, "{counts:?}");
    assert_check_clean(&a);
}

/// Two raw clients of `name` in a row: the accept loop hands connections round robin to the
/// two threads, so one of them is on the worker thread and the other on the image's.
fn attach_on_both_threads(server: &Server, name: &str) -> [Attached; 2] {
    [(); 2].map(|()| Attached::try_go(&server.socket, name).expect("served"))
}

#[test]
fn with_worker_threads_exports_added_at_run_time_are_served_from_every_thread() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &["--threads", "2"]);
    qemu_io("raw", &server.uri_of("a"), &["write -P 3 0 64k"]);
    let stats = ctl_ok(&dir, &["query-stats", "id=a"]);
    let a = &stats["exports"][0];
    assert_eq!(a["connections"]["total"], 1, "{stats}");
    assert_eq!(a["commands"]["write"]["requests"], 1, "{stats}");
    assert_eq!(a["commands"]["write"]["bytes"], 65536, "{stats}");
    assert_eq!(a["commands"]["read"]["requests"], 0, "{stats}");
    let all = ctl_ok(&dir, &["query-stats"]);
    assert_eq!(all["total"]["commands"]["write"]["bytes"], 65536, "{all}");

    let file = format!("file={}", c.display());
    ctl_ok(&dir, &["block-export-add", "id=c", &file, "writable=true"]);
    // Each pair of connections covers both threads.
    for _ in 0..2 {
        assert_eq!(listed(&server), ["a", "c"]);
    }
    let uri_c = server.uri_of("c");
    qemu_io("raw", &uri_c, &["write -P 0x1c 0 1M", "read -P 0x1c 0 1M"]);
    qemu_io("raw", &uri_c, &["write -P 0x2c 1M 1M", "read -P 0x1c 0 1M"]);
    for mut client in attach_on_both_threads(&server, "c") {
        assert_eq!(client.read(1 << 20, 4096).unwrap(), vec![0x2c; 4096]);
    }
    let stats = ctl_ok(&dir, &["query-stats", "id=c"]);
    let c_stats = &stats["exports"][0];
    assert_eq!(c_stats["connections"]["total"], 4, "{stats}");
    assert_eq!(c_stats["commands"]["write"]["bytes"], 2 << 20, "{stats}");
    server.stop_ok();
    assert_check_clean(&c);
    qemu_io("qcow2", &c, &["read -P 0x1c 0 1M", "read -P 0x2c 1M 1M"]);
}

#[test]
fn with_worker_threads_a_safe_delete_waits_for_clients_on_every_thread() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &["--threads", "2"]);
    let mut q = Qmp::connect(&dir);
    let file = format!("file={}", c.display());
    ctl_ok(&dir, &["block-export-add", "id=c", &file, "writable=true"]);
    let [mut first, mut second] = attach_on_both_threads(&server, "c");
    first.write(0, &[0x11; 4096]).unwrap();
    second.write(4096, &[0x22; 4096]).unwrap();

    assert_eq!(ctl_ok(&dir, &["block-export-del", "id=c"]), json!({}));
    let info = q.exports();
    let c_info = info.iter().find(|e| e["id"] == "c").unwrap();
    assert_eq!(c_info["shutting-down"], true, "{c_info}");
    assert_eq!(c_info["connections"], 2, "{c_info}");
    for _ in 0..2 {
        assert_eq!(listed(&server), ["a"], "a closing export is not listed");
        assert!(
            Attached::try_go(&server.socket, "c").is_none(),
            "nor selected"
        );
    }
    // Both clients go on working; the image stays open until the last one leaves.
    first.write(8192, &[0x33; 512]).unwrap();
    assert_eq!(second.read(0, 4096).unwrap(), vec![0x11; 4096]);
    drop(first);
    second.write(1 << 20, &[0x44; 4096]).unwrap();
    assert_eq!(second.read(4096, 4096).unwrap(), vec![0x22; 4096]);
    assert!(
        !unlocked(&c),
        "the image is open while a client is attached"
    );

    drop(second);
    q.wait_deleted("c");
    assert_check_clean(&c);
    assert!(unlocked(&c), "the lock is released once the export is gone");
    qemu_io(
        "qcow2",
        &c,
        &[
            "read -P 0x11 0 4k",
            "read -P 0x22 4k 4k",
            "read -P 0x33 8k 512",
            "read -P 0x44 1M 4k",
        ],
    );
    // The name can be served again, from both threads.
    ctl_ok(&dir, &["block-export-add", "id=c", &file]);
    for _ in 0..2 {
        assert_eq!(listed(&server), ["a", "c"]);
    }
    server.stop_ok();
}

#[test]
fn with_worker_threads_a_hard_delete_cuts_off_clients_on_every_thread() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2"), export("b", &dir, "b.qcow2")],
        &["--threads", "2"],
    );
    let mut clients = attach_on_both_threads(&server, "b");
    for (i, client) in clients.iter_mut().enumerate() {
        client
            .write(i as u64 * 65536, &[0x42 + i as u8; 65536])
            .unwrap();
    }
    // --wait returns once the image is closed.
    let out = ctl_ok(&dir, &["--wait", "block-export-del", "id=b", "mode=hard"]);
    assert_eq!(out, json!({}));
    for (i, client) in clients.iter_mut().enumerate() {
        let cut = client.request(0, 0, 512, 9).and_then(|()| client.reply(9));
        assert!(cut.is_err(), "client {i} was cut off: {cut:?}");
    }
    assert_check_clean(&b);
    assert!(unlocked(&b));
    qemu_io("qcow2", &b, &["read -P 0x42 0 64k", "read -P 0x43 64k 64k"]);
    for _ in 0..2 {
        assert_eq!(listed(&server), ["a"]);
    }
    qemu_io(
        "raw",
        &server.uri_of("a"),
        &["write -P 1 0 64k", "read -P 1 0 64k"],
    );
    server.stop_ok();
}
