//! Many rounds of adds and deletes: every id is reusable at once, and nothing leaks.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::harness::*;
use test_support::{assert_check_clean, Dir};

/// Adds `file` as export `c` (writable), deletes it and polls `query-block-exports` until
/// the id is gone, `rounds` times: the adds that failed, with the first error.
fn delete_poll_add(q: &mut Qmp, file: &Path, rounds: usize) -> (usize, Option<Value>) {
    let add = json!({"execute": "block-export-add",
        "arguments": {"id": "c", "file": file.display().to_string(), "writable": true}});
    let del = json!({"execute": "block-export-del", "arguments": {"id": "c"}});
    let (mut failed, mut first) = (0, None);
    for _ in 0..rounds {
        let added = q.run(add.clone());
        if added.get("error").is_some() {
            failed += 1;
            first.get_or_insert(added);
            continue;
        }
        assert_eq!(q.run(del.clone()), json!({"return": {}}));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while q.exports().iter().any(|e| e["id"] == "c") {
            assert!(std::time::Instant::now() < deadline, "c is never gone");
        }
    }
    (failed, first)
}

#[test]
fn a_deleted_id_is_gone_only_once_its_file_can_be_added_again() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = serve(&dir, &[export("a", &dir, "a.qcow2")], &[]);
    let mut q = Qmp::connect(&dir);
    let started = std::time::Instant::now();
    let (failed, first) = delete_poll_add(&mut q, &c, 1000);
    eprintln!("1000 rounds of del, poll, add: {:?}", started.elapsed());
    assert_eq!(
        failed, 0,
        "adds refused after the id was gone; first: {first:?}"
    );
    server.stop_ok();
    assert_check_clean(&c);
}

/// The server's open descriptors and resident memory (KiB).
fn fds_and_rss(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    (fds, rss)
}

/// Adds `file` as export `c` and deletes it, waiting for its `BLOCK_EXPORT_DELETED` (safe
/// to add the same file again whatever `query-block-exports` says), `rounds` times.
fn add_delete_cycles(q: &mut Qmp, file: &Path, rounds: usize) {
    let add = json!({"execute": "block-export-add",
        "arguments": {"id": "c", "file": file.display().to_string(), "writable": true}});
    let del = json!({"execute": "block-export-del", "arguments": {"id": "c"}});
    for round in 0..rounds {
        assert_eq!(q.run(add.clone()), json!({"return": {}}), "round {round}");
        assert_eq!(q.run(del.clone()), json!({"return": {}}), "round {round}");
        q.wait_deleted("c");
    }
}

#[test]
fn a_thousand_adds_and_deletes_leave_descriptors_and_memory_as_they_were() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let c = dir.create("c.qcow2", "qcow2", "", None, "4M");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2")],
        &["--cache-clean-interval", "1"],
    );
    let reader = SteadyReader::start(&server.socket, "a");
    let mut q = Qmp::connect(&dir);
    // Warm up the allocator's pools and the first-use growth of every table.
    add_delete_cycles(&mut q, &c, 100);
    // A cache-clean tick drops the entries the reads left.
    std::thread::sleep(Duration::from_millis(2500));
    let before = fds_and_rss(server.pid());
    let started = std::time::Instant::now();
    add_delete_cycles(&mut q, &c, 1000);
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(2500));
    let after = fds_and_rss(server.pid());
    eprintln!("1000 add/delete cycles in {took:?}: (fds, RSS KiB) {before:?} -> {after:?}");
    assert_eq!(after.0, before.0, "descriptors before and after");
    assert!(
        after.1 <= before.1 + 1024,
        "RSS grew from {} KiB to {} KiB",
        before.1,
        after.1
    );
    assert!(reader.finish() > 0);
    server.stop_ok();
    assert_check_clean(&c);
}
