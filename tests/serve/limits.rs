//! Limits that hold against hostile or broken clients: idle handshakes cannot keep a real
//! client out, option floods are cut off, replies nobody reads cannot grow the server's
//! memory past its bound, idle clients are closed, and TCP clients are kept alive.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::kernel_client::KernelClient;
use crate::support::raw::{
    finish_option, go, negotiating, option, OPT_LIST, OPT_LIST_META_CONTEXT, OPT_SET_META_CONTEXT,
    OPT_STRUCTURED_REPLY, REP_ACK,
};
use crate::support::Server;
use test_support::{exit_within, peak_rss_mib, process_exited, qemu_img, require, Dir};

/// `nbdinfo --size URI`, killed after `limit`: whether it succeeded and how long it took.
fn nbdinfo_size_within(uri: &str, limit: Duration) -> (bool, Duration) {
    let start = Instant::now();
    let mut child = Command::new(require("nbdinfo", "libnbd-bin"))
        .args(["--size", uri])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    match exit_within(&mut child, limit) {
        Some(status) => (status.success(), start.elapsed()),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            (false, start.elapsed())
        }
    }
}

#[test]
fn a_thousand_idle_handshakes_never_keep_a_real_client_out() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    // With qemu-nbd's defaults (-e 1, each idle client allowed its full handshake limit) the
    // real client would wait behind every one of them.
    let server = Server::unix(&["-t", "--handshake-limit", "60", img.to_str().unwrap()]);
    let idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&server.socket).unwrap())
        .collect();
    let (ok, took) = nbdinfo_size_within(&server.uri(), Duration::from_secs(30));
    let peak = peak_rss_mib(server.pid());
    eprintln!(
        "a real client was served in {took:?} beside 1000 idle connections; server peak RSS \
         {peak:.1} MiB"
    );
    assert!(ok, "the real client was not served ({took:?})");
    assert!(peak < 2.0 + 128.0, "peak RSS {peak:.1} MiB");
    assert!(!process_exited(server.pid()));
    drop(idle);
    server.stop_ok();
}

#[test]
fn an_option_flood_is_cut_off_and_the_server_goes_on() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::unix(&["-t", img.to_str().unwrap()]);
    let mut s = negotiating(&server.socket);
    let mut reader = s.try_clone().unwrap();
    let reading = std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink);
        sink.len()
    });
    let list = option(OPT_LIST, &[]);
    let mut sent = 0;
    for _ in 0..100_000 {
        if s.write_all(&list).is_err() {
            break;
        }
        sent += 1;
    }
    let _ = s.shutdown(std::net::Shutdown::Write);
    let replied = reading.join().unwrap();
    let peak = peak_rss_mib(server.pid());
    eprintln!(
        "option flood: {sent} options sent, {replied} reply bytes before the server hung up; \
         server peak RSS {peak:.1} MiB"
    );
    assert!(peak < 2.0 + 128.0, "peak RSS {peak:.1} MiB");
    assert!(sent < 100_000, "the server never stopped reading options");
    let (ok, _) = nbdinfo_size_within(&server.uri(), Duration::from_secs(30));
    assert!(ok, "a real client after the flood was not served");
    server.stop_ok();
}

#[test]
fn too_many_meta_context_queries_are_refused_as_too_big() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::unix(&["-t", img.to_str().unwrap()]);
    let mut s = negotiating(&server.socket);
    s.write_all(&option(OPT_STRUCTURED_REPLY, &[])).unwrap();
    assert_eq!(finish_option(&mut s), REP_ACK);
    let mut data = 0u32.to_be_bytes().to_vec(); // export name ""
    data.extend_from_slice(&1000u32.to_be_bytes());
    for _ in 0..1000 {
        data.extend_from_slice(&15u32.to_be_bytes());
        data.extend_from_slice(b"base:allocation");
    }
    s.write_all(&option(OPT_LIST_META_CONTEXT, &data)).unwrap();
    assert_eq!(finish_option(&mut s), 0x8000_0009, "NBD_REP_ERR_TOO_BIG");
    drop(s);
    server.stop_ok();
}

/// A 1 TiB image with 4 KiB clusters whose first 256 MiB alternate data and holes, so one
/// block status request over them is answered with the most extents a reply holds.
fn fragmented(images: &Dir) -> std::path::PathBuf {
    let raw = images.path("frag.raw");
    let f = std::fs::File::create(&raw).unwrap();
    let block = [1u8; 4096];
    for i in 0..32768u64 {
        std::os::unix::fs::FileExt::write_all_at(&f, &block, i * 8192).unwrap();
    }
    f.set_len(256 << 20).unwrap();
    let img = images.path("frag.qcow2");
    qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4k",
        raw.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    qemu_img(&["resize", "-q", img.to_str().unwrap(), "1T"]);
    img
}

#[test]
fn pipelined_block_status_nobody_reads_stays_within_the_memory_bound() {
    let images = Dir::new();
    let img = fragmented(&images);
    let server = Server::unix(&["-t", "--l2-cache-size", "1M", img.to_str().unwrap()]);
    let before = peak_rss_mib(server.pid());
    let mut s = negotiating(&server.socket);
    s.write_all(&option(OPT_STRUCTURED_REPLY, &[])).unwrap();
    assert_eq!(finish_option(&mut s), REP_ACK);
    let mut meta = 0u32.to_be_bytes().to_vec();
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    s.write_all(&option(OPT_SET_META_CONTEXT, &meta)).unwrap();
    assert_eq!(finish_option(&mut s), REP_ACK);
    go(&mut s);
    // Block status over the fragmented 256 MiB, again and again, never reading a reply.
    s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut sent = 0u64;
    for cookie in 0..2000u64 {
        let msg = KernelClient::encode(7, 0, cookie, 0, 256 << 20, &[]);
        if s.write_all(&msg).is_err() {
            break; // the server stopped reading: its budget is full
        }
        sent += 1;
    }
    std::thread::sleep(Duration::from_secs(2));
    let peak = peak_rss_mib(server.pid());
    eprintln!(
        "block status flood: {sent} requests sent, server peak RSS {peak:.1} MiB \
         (at rest {before:.1} MiB)"
    );
    // Caches: 1 MiB of L2 and QEMU's default refcount cache; the bound is caches + 128 MiB.
    assert!(peak < 2.0 + 128.0, "peak RSS {peak:.1} MiB");
    drop(s);
    server.stop_ok();
}

#[test]
fn an_idle_client_is_closed_after_the_idle_timeout() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::unix(&["-t", "--idle-timeout", "1", img.to_str().unwrap()]);
    let mut idle = KernelClient::connect(&server.socket, "");
    let start = Instant::now();
    let mut byte = [0u8; 1];
    let n = idle.stream.read(&mut byte).unwrap_or(0);
    assert_eq!(n, 0, "the server closed the idle connection");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed too early: {took:?}"
    );
    // A busy client is not idle.
    let (ok, _) = nbdinfo_size_within(&server.uri(), Duration::from_secs(30));
    assert!(ok);
    server.stop_ok();
}

#[test]
fn tcp_clients_get_keepalive_probes() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "1M");
    let server = Server::tcp(&["-t", "--tcp-keepalive", "30", img.to_str().unwrap()]);
    let port = server.port.unwrap();
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut greeting = [0u8; 18];
    c.read_exact(&mut greeting).unwrap();
    let out = Command::new("ss")
        .args([
            "-tnoH",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("keepalive"),
        "no keepalive timer on the server's socket: {text}"
    );
    drop(c);
    server.stop_ok();
}
