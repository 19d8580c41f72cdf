//! How `qcow2-nbd serve` starts and stops: SIGTERM with writes in flight (exit 0, every
//! acknowledged write in a consistent image), SIGINT, the pid file, the exit after the last
//! client without `-t`, systemd socket activation through `nbdinfo -- [ ... ]`, `--fork`, and
//! the messages of startup failures.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::kernel_client::{KernelClient, CMD_READ, CMD_WRITE};
use crate::support::{serve_fails, Server, BIN};
use std::os::unix::process::CommandExt;
use test_support::{
    assert_check_clean, exit_within, nbdinfo, process_exited, qemu_bitmaps, qemu_dirty_ranges,
    qemu_io, require, run_ok, stdout, wait_until, Dir,
};

const MIB: u32 = 1 << 20;

#[test]
fn sigterm_with_writes_in_flight_exits_0_and_keeps_every_acknowledged_write() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "128M");
    let server = Server::unix(&["-t", img.to_str().unwrap()]);
    let mut client = KernelClient::connect(&server.socket, "");
    // 96 MiB of writes from another thread: far more than socket buffers hold, so the
    // server is still receiving and executing them when the signal arrives.
    let mut sender = client.stream.try_clone().unwrap();
    let sending = std::thread::spawn(move || {
        for i in 0..96u32 {
            let payload = vec![u8::try_from(i % 250).unwrap() + 1; MIB as usize];
            let msg = KernelClient::encode(
                CMD_WRITE,
                0,
                u64::from(i),
                u64::from(i * MIB),
                MIB,
                &payload,
            );
            if sender.write_all(&msg).is_err() {
                return i; // the server stopped reading and closed
            }
        }
        96
    });
    let first = client.reply();
    assert_eq!(first.error, 0);
    server.signal(libc::SIGTERM);
    let mut acked = vec![first.cookie];
    while let Some(r) = client.try_reply() {
        assert_eq!(r.error, 0, "an accepted write failed: {r:?}");
        acked.push(r.cookie);
    }
    let sent = sending.join().unwrap();
    let mut server = server;
    let (status, err) = server.wait();
    assert!(
        status.success(),
        "exit status {status} after SIGTERM:\n{err}"
    );
    assert!(
        !acked.is_empty() && acked.len() <= usize::try_from(sent.max(1)).unwrap(),
        "{} acknowledged of {sent} sent",
        acked.len()
    );
    assert_check_clean(&img);
    let reads: Vec<String> = acked
        .iter()
        .map(|&i| format!("read -P {} {} 1M", i % 250 + 1, i * u64::from(MIB)))
        .collect();
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    qemu_io("qcow2", img.to_str().unwrap(), &reads);
}

#[test]
fn sigint_shuts_down_cleanly_too() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "lazy_refcounts=on", None, "8M");
    let server = Server::unix(&["-t", img.to_str().unwrap()]);
    qemu_io("raw", &server.uri(), &["write -P 0x61 0 1M"]);
    server.signal(libc::SIGINT);
    let mut server = server;
    let (status, err) = server.wait();
    assert!(status.success(), "{status}: {err}");
    assert_check_clean(&img);
    qemu_io("qcow2", img.to_str().unwrap(), &["read -P 0x61 0 1M"]);
}

#[test]
fn the_pid_file_means_listening_and_goes_away_on_exit() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    for _ in 0..5 {
        // The harness returns as soon as the pid file exists: connecting must work at once.
        let server = Server::unix(&["-t", img.to_str().unwrap()]);
        let c = KernelClient::connect(&server.socket, "");
        assert_eq!(c.size, 1 << 20);
        c.disconnect();
        let pid_file = server.pid_file.clone();
        let socket = server.socket.clone();
        server.stop_ok();
        assert!(!pid_file.exists(), "pid file removed on exit");
        assert!(!socket.exists(), "socket removed on exit");
    }
}

#[test]
fn without_persistent_the_server_exits_after_its_client() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "2M");
    let mut server = Server::unix(&[img.to_str().unwrap()]);
    let size = nbdinfo(&["--size", &server.uri()]);
    assert_eq!(size.trim(), (2u64 << 20).to_string());
    let (status, err) = server.wait();
    assert!(status.success(), "{status}: {err}");
}

#[test]
fn socket_activation_through_nbdinfo() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "5M");
    images.qemu_io("qcow2", "disk.qcow2", &["write -P 1 0 64k"]);
    let out = run_ok(
        Command::new(require("nbdinfo", "libnbd-bin"))
            .args(["--json", "--", "[", BIN, "serve", "-A"])
            .arg(&img)
            .arg("]"),
    );
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-size"], 5 << 20, "{v}");
    assert_eq!(
        e["contexts"],
        serde_json::json!(["base:allocation", "qemu:allocation-depth"])
    );
    // And a client that writes: nbdcopy into an activated server, then QEMU reads it back.
    let source = images.path("source.raw");
    std::fs::write(&source, vec![0x42u8; 5 << 20]).unwrap();
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .arg("--flush")
            .arg(&source)
            .args(["--", "[", BIN, "serve"])
            .arg(&img)
            .arg("]"),
    );
    assert_check_clean(&img);
    qemu_io("qcow2", img.to_str().unwrap(), &["read -P 0x42 0 5M"]);
}

#[test]
fn fork_returns_once_listening_and_the_daemon_serves_until_sigterm() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "4M");
    let pid_file = images.path("serve.pid");
    let socket = images.path("nbd.sock");
    // output() waits for stdout and stderr to close: the daemon must let go of them.
    let out = Command::new(BIN)
        .args(["serve", "--fork", "-t", "--pid-file"])
        .arg(&pid_file)
        .arg("-k")
        .arg(&socket)
        .arg(&img)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .expect("pid file written before the parent returned")
        .trim()
        .parse()
        .unwrap();
    assert!(!process_exited(pid), "the daemon runs");
    let uri = test_support::nbd_unix_uri(&socket, "");
    qemu_io("raw", &uri, &["write -P 0x17 0 64k", "read -P 0x17 0 64k"]);
    let daemon = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill only sends a signal to the daemon we started.
    assert_eq!(unsafe { libc::kill(daemon, libc::SIGTERM) }, 0);
    wait_until(
        Duration::from_secs(60),
        format!("daemon {pid} exits"),
        || process_exited(pid),
    );
    assert!(
        !socket.exists() && !pid_file.exists(),
        "clean exit removes both"
    );
    assert_check_clean(&img);
    qemu_io("qcow2", img.to_str().unwrap(), &["read -P 0x17 0 64k"]);
}

#[test]
fn fork_passes_a_startup_failure_on() {
    let images = Dir::new();
    let missing = images.path("missing.qcow2");
    let err = serve_fails(&["--fork", "-k", &images.s("s"), missing.to_str().unwrap()]);
    assert!(err.contains("missing.qcow2"), "{err}");
}

fn assert_fails_with(args: &[&str], needle: &str) {
    let err = serve_fails(args);
    assert!(err.contains(needle), "serve {args:?}: {err}");
    assert!(err.starts_with("qcow2-nbd: "), "one clear line: {err}");
}

#[test]
fn startup_failures_say_what_is_wrong_and_exit_1() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let sock = images.s("s");
    let i = img.to_str().unwrap();
    assert_fails_with(&["-k", &sock, &images.s("nope.qcow2")], "could not open");
    // The image tools read NBD exports, but serve does not re-export one.
    assert_fails_with(
        &[
            "-k",
            &sock,
            &format!("nbd+unix:///?socket={}", images.s("up.sock")),
        ],
        "serve does not export NBD names",
    );
    assert_fails_with(
        &["-k", &sock, "--detect-zeroes=unmap", i],
        "--detect-zeroes=unmap requires --discard=unmap",
    );
    assert_fails_with(&["-k", &sock, "-l", "nosuch", i], "no snapshot");
    assert_fails_with(
        &["-k", &sock, "--pid-file", &images.s("no/such/dir/pid"), i],
        "pid file",
    );
    assert_fails_with(&["-k", &images.s("no/such/dir/s"), i], "cannot listen");
    // As in QEMU, a tiny cache is raised to its minimum, but all three sizes at once conflict.
    assert_fails_with(
        &[
            "-k",
            &sock,
            "--cache-size=4M",
            "--l2-cache-size=1M",
            "--refcount-cache-size=1M",
            i,
        ],
        "may not be set at the same time",
    );
    // None of that touched the image.
    assert_check_clean(Path::new(i));
}

/// What a client that never reaches transmission does to a server.
type HandshakeOnly = dyn Fn(&Server);

/// A client that connects, reads the greeting and does `what` before closing.
fn raw_client(server: &Server, what: &[u8], linger: Duration) {
    use std::io::Read;
    let mut s = std::os::unix::net::UnixStream::connect(&server.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    let _ = s.write_all(what);
    std::thread::sleep(linger);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
}

#[test]
fn without_persistent_only_a_client_that_reached_transmission_ends_the_server() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "2M");
    let mut abort = 3u32.to_be_bytes().to_vec(); // fixed newstyle, no zeroes
    abort.extend_from_slice(b"IHAVEOPT");
    abort.extend_from_slice(&2u32.to_be_bytes()); // NBD_OPT_ABORT
    abort.extend_from_slice(&0u32.to_be_bytes());
    let no_wait = Duration::ZERO;
    let cases: [(&str, Box<HandshakeOnly>); 5] = [
        (
            "a bare connect and close",
            Box::new(|s: &Server| drop(std::os::unix::net::UnixStream::connect(&s.socket))),
        ),
        (
            "nbdinfo --list",
            Box::new(|s: &Server| {
                nbdinfo(&["--list", &s.uri()]);
            }),
        ),
        (
            "NBD_OPT_ABORT",
            Box::new(move |s: &Server| raw_client(s, &abort, no_wait)),
        ),
        (
            "a failed handshake",
            Box::new(move |s: &Server| raw_client(s, b"\0\0\0\x03not an option header", no_wait)),
        ),
        (
            "a timed-out handshake",
            Box::new(|s: &Server| raw_client(s, b"", Duration::from_millis(1500))),
        ),
    ];
    for (what, client) in cases {
        let mut server = Server::unix(&["--handshake-limit", "1", img.to_str().unwrap()]);
        client(&server);
        std::thread::sleep(Duration::from_millis(200));
        assert!(!process_exited(server.pid()), "{what} ended the server");
        let size = nbdinfo(&["--size", &server.uri()]);
        assert_eq!(size.trim(), (2u64 << 20).to_string(), "after {what}");
        let (status, err) = server.wait();
        assert!(status.success(), "after {what}: {status}: {err}");
    }
}

/// A server with acknowledged, flushed data at the start of a 64 MiB image that has a
/// persistent bitmap, and a client that `stall`s on its connection; then `signals`, 300 ms
/// apart. Returns the seconds the server took to exit after the first, its exit status and
/// stderr.
fn shutdown_with_a_stuck_client(
    grace: &str,
    stall: impl FnOnce(&mut KernelClient),
    signals: &[libc::c_int],
) -> (
    f64,
    std::process::ExitStatus,
    Dir,
    std::path::PathBuf,
    String,
) {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "64M");
    images.qemu_img(&["bitmap", "--add", img.to_str().unwrap(), "good"]);
    let mut server = Server::unix(&[
        "-t",
        "-e",
        "4",
        "--shutdown-grace",
        grace,
        img.to_str().unwrap(),
    ]);
    // qemu-io flushes before it exits: these bytes are acknowledged after FLUSH.
    qemu_io("raw", &server.uri(), &["write -P 0xab 0 1M"]);
    let mut stuck = KernelClient::connect(&server.socket, "");
    stall(&mut stuck);
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    for (i, &sig) in signals.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        server.signal(sig);
    }
    let (status, err) = server.wait_within(Duration::from_secs(30));
    let seconds = start.elapsed().as_secs_f64();
    drop(stuck);
    (seconds, status, images, img, err)
}

/// Pipelines 32 MiB reads and never reads a reply.
fn never_read_replies(c: &mut KernelClient) {
    for i in 0..16u64 {
        let msg = KernelClient::encode(CMD_READ, 0, i, 0, 32 * MIB, &[]);
        c.send_raw(&msg);
    }
}

/// Sends a 1 MiB write's header and half its payload, then nothing.
fn stall_mid_write(c: &mut KernelClient) {
    let payload = vec![0xcd; MIB as usize];
    let msg = KernelClient::encode(CMD_WRITE, 0, 1, 4 * u64::from(MIB), MIB, &payload);
    c.send_raw(&msg[..msg.len() - payload.len() / 2]);
}

/// The image checks clean, holds the flushed data, and QEMU reads its bitmap, which was
/// stored (not left in use) and records the write.
fn assert_flushed_data_survived(img: &Path) {
    assert_check_clean(img);
    qemu_io("qcow2", img.to_str().unwrap(), &["read -P 0xab 0 1M"]);
    let bitmaps = qemu_bitmaps(img);
    assert_eq!(bitmaps.len(), 1, "{bitmaps:?}");
    assert!(
        !bitmaps[0].flags.iter().any(|f| f == "in-use"),
        "{bitmaps:?}"
    );
    let dirty = qemu_dirty_ranges(img, "good");
    assert_eq!(dirty.first(), Some(&(0, u64::from(MIB))), "{dirty:?}");
}

#[test]
fn shutdown_closes_a_client_that_never_reads_its_replies_after_the_grace_period() {
    let (seconds, status, _images, img, err) =
        shutdown_with_a_stuck_client("2", never_read_replies, &[libc::SIGTERM]);
    eprintln!("exit {seconds:.2} s after SIGTERM with a client not reading (grace 2 s)");
    assert!(status.success(), "{status}: {err}");
    assert!(seconds < 3.0, "took {seconds:.2} s with a 2 s grace period");
    assert_flushed_data_survived(&img);
}

#[test]
fn shutdown_closes_a_client_stalled_mid_write_after_the_grace_period() {
    let (seconds, status, _images, img, err) =
        shutdown_with_a_stuck_client("2", stall_mid_write, &[libc::SIGTERM]);
    eprintln!("exit {seconds:.2} s after SIGTERM with a client stalled mid-write (grace 2 s)");
    assert!(status.success(), "{status}: {err}");
    assert!(seconds < 3.0, "took {seconds:.2} s with a 2 s grace period");
    assert_flushed_data_survived(&img);
}

#[test]
fn a_repeated_shutdown_signal_does_not_abandon_the_shutdown() {
    let (seconds, status, _images, img, err) = shutdown_with_a_stuck_client(
        "2",
        never_read_replies,
        &[libc::SIGTERM, libc::SIGINT, libc::SIGTERM, libc::SIGHUP],
    );
    eprintln!("exit {seconds:.2} s after SIGTERM, SIGINT, SIGTERM, SIGHUP (grace 2 s)");
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("already shutting down"), "{err}");
    assert_flushed_data_survived(&img);
}

#[test]
fn sigquit_closes_the_connections_at_once_and_still_stores_the_bitmaps() {
    for signals in [&[libc::SIGTERM, libc::SIGQUIT][..], &[libc::SIGQUIT]] {
        let (seconds, status, _images, img, err) =
            shutdown_with_a_stuck_client("60", stall_mid_write, signals);
        eprintln!("exit {seconds:.2} s after {signals:?} (grace 60 s)");
        assert!(status.success(), "{signals:?}: {status}: {err}");
        assert!(err.contains("forced shutdown"), "{err}");
        assert!(
            seconds < 10.0,
            "SIGQUIT did not cut the 60 s grace period short: {seconds:.2} s"
        );
        assert_flushed_data_survived(&img);
    }
}

/// `timeout` and systemd's `KillMode=mixed` send SIGTERM to the server and then to its
/// whole process group: one request to stop, delivered twice, sometimes while the shutdown
/// already stores the bitmaps. Every run must end as one SIGTERM does.
#[test]
fn sigterm_sent_to_the_process_and_its_group_stores_every_bitmap() {
    for run in 0..20u64 {
        let d = Dir::new();
        let img = d.create("s.qcow2", "qcow2", "", None, "64M");
        d.qemu_img(&["bitmap", "--add", &d.s("s.qcow2"), "good"]);
        let (socket, pid_file) = (d.path("s.sock"), d.path("s.pid"));
        let stderr = std::fs::File::create(d.path("stderr")).unwrap();
        let mut child = Command::new(BIN)
            .arg("serve")
            .arg("-k")
            .arg(&socket)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg("-t")
            .arg(&img)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        wait_until(Duration::from_secs(30), "the server listens", || {
            pid_file.exists()
        });
        qemu_io(
            "raw",
            &test_support::nbd_unix_uri(&socket, ""),
            &["write 0 64k"],
        );
        let pid = libc::pid_t::try_from(child.id()).unwrap();
        // SAFETY: kill only signals the child we started, which leads its own group.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        // Vary where the second delivery lands: at once, or while the shutdown runs.
        std::thread::sleep(Duration::from_millis(run % 4 * 5));
        // SAFETY: as above; the group holds the server alone.
        assert_eq!(unsafe { libc::kill(-pid, libc::SIGTERM) }, 0);
        let status = exit_within(&mut child, Duration::from_secs(30));
        let err = std::fs::read_to_string(d.path("stderr")).unwrap();
        assert!(
            status.is_some_and(|s| s.success()),
            "run {run}: {status:?}: {err}"
        );
        assert_check_clean(&img);
        let bitmaps = qemu_bitmaps(&img);
        assert!(
            bitmaps
                .iter()
                .all(|b| !b.flags.iter().any(|f| f == "in-use")),
            "run {run}: {bitmaps:?}: {err}"
        );
        assert_eq!(
            qemu_dirty_ranges(&img, "good"),
            [(0, 64 << 10)],
            "run {run}"
        );
    }
}
