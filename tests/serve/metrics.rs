//! `serve --metrics`: an exact workload through libnbd, then the real endpoint scraped with
//! curl and its Prometheus text parsed: counts, bytes, errors by errno, connections,
//! histograms and cache counters per export and in total, on one thread and across
//! threads; wrong paths and methods; hostile scrapers that must not stop the server or
//! other scrapes.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use crate::support::{free_port, serve_fails, Server};
use test_support::{python_with_libnbd, qemu_io, require, run_ok, stdout, wait_until, Dir};

/// One sample line: the metric name, its labels and its value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed exposition: the `# TYPE` of each family and every sample.
#[derive(Debug, Default)]
struct Exposition {
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
}

/// Parses `name{k="v",...} value` lines and `# TYPE name kind` lines (label values with
/// `\"` and `\\` escapes).
fn parse(text: &str) -> Exposition {
    let mut out = Exposition::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE line");
            out.types.insert(name.into(), kind.into());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|e| panic!("{line:?}: {e}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series.to_owned(), BTreeMap::new()),
            Some((name, rest)) => (
                name.to_owned(),
                parse_labels(rest.strip_suffix('}').expect("}")),
            ),
        };
        out.samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

fn parse_labels(mut s: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    while !s.is_empty() {
        let (key, rest) = s.split_once("=\"").expect("label");
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().expect("closing quote") {
                (_, '\\') => value.push(match chars.next().expect("escape").1 {
                    'n' => '\n',
                    c => c,
                }),
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.to_owned(), value);
        s = rest[end + 1..].trim_start_matches(',');
    }
    labels
}

impl Exposition {
    /// The value of the one sample `name` with exactly `labels`.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let found: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.name == name && s.labels == want)
            .collect();
        assert_eq!(found.len(), 1, "{name}{labels:?}: {found:?}");
        found[0].value
    }

    fn of(&self, name: &str, export: Option<&str>, key: &str, value: &str) -> f64 {
        match export {
            Some(e) => self.get(
                &format!("qcow2_nbd_export_{name}"),
                &[("export", e), (key, value)],
            ),
            None => self.get(&format!("qcow2_nbd_{name}"), &[(key, value)]),
        }
    }
}

/// `curl -s -i [ARGS] URL`: the status code, the headers and the body.
fn curl(args: &[&str], url: &str) -> (u32, String, String) {
    let out = run_ok(
        Command::new(require("curl", "curl"))
            .args(["-s", "-i", "--max-time", "30"])
            .args(args)
            .arg(url),
    );
    let text = stdout(&out);
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, head.to_owned(), body.to_owned())
}

fn scrape(port: u16) -> Exposition {
    let (status, head, body) = curl(&[], &format!("http://127.0.0.1:{port}/metrics"));
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    parse(&body)
}

/// The workload, through libnbd: 3 writes of 4 KiB, 5 reads of 64 KiB, a flush, a zeroing
/// of 4 KiB, a trim of 8 KiB, a block status of 64 KiB, a cache of 128 KiB, and a fast
/// zeroing of part of a compressed cluster, which cannot be fast (ENOTSUP); it prints the
/// errno of that last one.
const WORKLOAD: &str = r#"
import nbd, sys
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(sys.argv[1])
for i in range(3):
    h.pwrite(b"w" * 4096, i * 4096)
for i in range(5):
    h.pread(65536, i * 65536)
h.flush()
h.zero(4096, 1 << 20)
h.trim(8192, 0)
h.block_status(65536, 0, lambda *args: 0)
h.cache(131072, 0)
try:
    h.zero(4096, 2 << 20, nbd.CMD_FLAG_FAST_ZERO)
    print("fast zero succeeded")
except nbd.Error as e:
    print("errno", e.errno)
h.shutdown()
"#;

fn images() -> Dir {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "16M");
    dir.create("b.qcow2", "qcow2", "", None, "16M");
    dir.qemu_io("qcow2", "a.qcow2", &["write -c -P 0x55 2M 64k"]);
    dir
}

fn serve_two(dir: &Dir, port: u16, threads: &str) -> Server {
    Server::unix(&[
        "-t",
        "-e",
        "4",
        "--threads",
        threads,
        "--metrics",
        &format!("127.0.0.1:{port}"),
        "--export",
        &format!("name=a,file={}", dir.s("a.qcow2")),
        "--export",
        &format!("name=b,file={}", dir.s("b.qcow2")),
    ])
}

/// Every histogram's buckets rise to `+Inf`, which equals its `_count`, which equals the
/// requests counted.
fn assert_histograms_add_up(m: &Exposition) {
    let mut checked = 0;
    for count in m
        .samples
        .iter()
        .filter(|s| s.name.ends_with("_request_duration_seconds_count"))
    {
        let family = count.name.trim_end_matches("_count");
        let mut buckets: Vec<(f64, f64)> = m
            .samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
            .filter(|s| {
                let mut l = s.labels.clone();
                l.remove("le");
                l == count.labels
            })
            .map(|s| {
                let le = &s.labels["le"];
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, s.value)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(buckets.len(), 20, "{family}{:?}", count.labels);
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "cumulative: {buckets:?}"
        );
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count.value));
        let requests = family.replace("_request_duration_seconds", "_requests_total");
        assert_eq!(m.get(&requests, &pairs(&count.labels)), count.value);
        checked += 1;
    }
    assert_eq!(checked, 3 * 7, "per command, for a, b and the total");
}

fn pairs(labels: &BTreeMap<String, String>) -> Vec<(&str, &str)> {
    labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn counts_the_exact_workload(threads: &str) {
    let dir = images();
    let port = free_port();
    let server = serve_two(&dir, port, threads);
    let before = scrape(port);
    assert_eq!(before.get("qcow2_nbd_exports", &[]), 2.0);
    assert_eq!(
        before.of("requests_total", Some("a"), "command", "read"),
        0.0
    );

    let out = run_ok(
        Command::new(python_with_libnbd())
            .args(["-c", WORKLOAD])
            .arg(server.uri_of("a")),
    );
    assert_eq!(
        stdout(&out).trim(),
        "errno ENOTSUP",
        "the fast zero fails with ENOTSUP"
    );
    // The client has gone; its connection ends on the server a moment later.
    wait_until(Duration::from_secs(30), "the client detaches", || {
        scrape(port).get("qcow2_nbd_export_clients", &[("export", "a")]) == 0.0
    });
    let m = scrape(port);

    assert_eq!(m.types["qcow2_nbd_export_requests_total"], "counter");
    assert_eq!(m.types["qcow2_nbd_export_bytes_total"], "counter");
    assert_eq!(m.types["qcow2_nbd_export_errors_total"], "counter");
    assert_eq!(
        m.types["qcow2_nbd_export_request_duration_seconds"],
        "histogram"
    );
    assert_eq!(m.types["qcow2_nbd_export_clients"], "gauge");
    assert_eq!(m.types["qcow2_nbd_requests_total"], "counter");
    assert_eq!(m.types["qcow2_nbd_cache_memory_bytes"], "gauge");

    let expected = [
        ("read", 5.0, 5.0 * 65536.0),
        ("write", 3.0, 3.0 * 4096.0),
        ("write_zeroes", 2.0, 4096.0),
        ("flush", 1.0, 0.0),
        ("trim", 1.0, 8192.0),
        ("block_status", 1.0, 65536.0),
        ("cache", 1.0, 131072.0),
    ];
    for (cmd, requests, bytes) in expected {
        for export in [Some("a"), None] {
            let what = format!("{cmd} of {export:?}");
            assert_eq!(
                m.of("requests_total", export, "command", cmd),
                requests,
                "{what}"
            );
            assert_eq!(m.of("bytes_total", export, "command", cmd), bytes, "{what}");
        }
        assert_eq!(
            m.of("requests_total", Some("b"), "command", cmd),
            0.0,
            "{cmd} of b"
        );
        assert_eq!(
            m.of("bytes_total", Some("b"), "command", cmd),
            0.0,
            "{cmd} of b"
        );
    }
    for errno in ["EPERM", "EIO", "EINVAL", "ENOSPC", "ENOTSUP"] {
        let want = if errno == "ENOTSUP" { 1.0 } else { 0.0 };
        assert_eq!(
            m.of("errors_total", Some("a"), "errno", errno),
            want,
            "{errno}"
        );
        assert_eq!(m.of("errors_total", None, "errno", errno), want, "{errno}");
        assert_eq!(
            m.of("errors_total", Some("b"), "errno", errno),
            0.0,
            "{errno}"
        );
    }
    assert_eq!(
        m.get("qcow2_nbd_export_connections_total", &[("export", "a")]),
        1.0
    );
    assert_eq!(
        m.get("qcow2_nbd_export_connections_total", &[("export", "b")]),
        0.0
    );
    assert_eq!(m.get("qcow2_nbd_connections_total", &[]), 1.0);
    assert_eq!(m.get("qcow2_nbd_clients", &[]), 0.0);
    assert_histograms_add_up(&m);

    let l2 = |name: &str| m.of(name, Some("a"), "cache", "l2");
    assert!(
        l2("cache_hits_total") + l2("cache_misses_total") > 0.0,
        "reads looked up L2"
    );
    assert!(l2("cache_memory_bytes") > 0.0);
    let refcount = m.of("cache_misses_total", Some("a"), "cache", "refcount")
        + m.of("cache_hits_total", Some("a"), "cache", "refcount");
    assert!(refcount > 0.0, "allocating writes looked up refcounts");
    assert_eq!(
        m.of("cache_hits_total", None, "cache", "l2"),
        l2("cache_hits_total") + m.of("cache_hits_total", Some("b"), "cache", "l2")
    );
    server.stop_ok();
}

#[test]
fn an_exact_workload_is_counted_per_export_and_in_total() {
    counts_the_exact_workload("1");
}

#[test]
fn requests_from_another_thread_are_counted_too() {
    counts_the_exact_workload("2");
}

/// Sends `bytes` on a fresh connection and returns what the server answered (empty if it
/// closed without an answer); write errors are the server closing early, which is allowed.
fn raw_exchange(port: u16, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(bytes);
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn wrong_requests_and_hostile_scrapers_get_answers_and_stop_nothing() {
    let dir = images();
    let port = free_port();
    let server = serve_two(&dir, port, "1");
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    assert_eq!(curl(&[], &url("/")).0, 404);
    assert_eq!(curl(&[], &url("/metrics/x")).0, 404);
    let (status, head, _) = curl(&["-X", "POST", "-d", "x"], &url("/metrics"));
    assert_eq!(status, 405);
    assert!(head.contains("Allow: GET"), "{head}");
    assert_eq!(curl(&["-X", "DELETE"], &url("/metrics")).0, 405);
    let (status, head, body) = curl(&["-I"], &url("/metrics"));
    assert_eq!((status, body.as_str()), (200, ""), "HEAD: {head}");
    assert!(head.contains("Content-Length: "), "{head}");

    // A client that connects and never sends a byte holds one scrape slot, not the server.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // One that never finishes its head.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // No request line at all, and a 1 MiB header.
    assert!(raw_exchange(port, b"\r\n\r\n").starts_with("HTTP/1.1 400"));
    assert!(raw_exchange(port, b"hello\r\n\r\n").starts_with("HTTP/1.1 400"));
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    huge.resize(huge.len() + (1 << 20), b'a');
    huge.extend_from_slice(b"\r\n\r\n");
    let answer = raw_exchange(port, &huge);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "{answer:?}"
    );

    // Scrapes and NBD clients go on meanwhile.
    for _ in 0..3 {
        assert_eq!(scrape(port).get("qcow2_nbd_exports", &[]), 2.0);
    }
    qemu_io(
        "raw",
        &server.uri_of("b"),
        &["write -P 7 0 4k", "read -P 7 0 4k"],
    );
    let m = scrape(port);
    assert_eq!(m.of("requests_total", Some("b"), "command", "write"), 1.0);
    assert_eq!(m.of("requests_total", Some("b"), "command", "read"), 1.0);
    let mut none = [0u8; 1];
    silent
        .set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    assert!(
        !matches!(silent.read(&mut none), Ok(n) if n > 0),
        "the silent client got nothing yet"
    );
    drop((silent, slow));
    server.stop_ok();
}

#[test]
fn a_metrics_address_in_use_fails_the_start_naming_it() {
    let dir = images();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let socket = dir.path("s.sock");
    let err = serve_fails(&[
        "-k",
        socket.to_str().unwrap(),
        "--metrics",
        &addr,
        &dir.s("a.qcow2"),
    ]);
    assert!(
        err.contains(&format!("--metrics {addr}: cannot listen")),
        "{err}"
    );
    // The image was closed again: it opens for writing.
    dir.qemu_io("qcow2", "a.qcow2", &["write -P 1 0 4k"]);
}

/// `--metrics ADDR:0` takes any free port, and `--log info` names it at start (as `serve
/// --help` says), so that a scraper can find it; the address logged is the one serving.
#[test]
fn port_0_is_logged_with_log_info_and_serves() {
    use std::io::BufRead;
    let dir = images();
    let socket = dir.path("s.sock");
    let mut child = Command::new(crate::support::BIN)
        .args(["serve", "-t", "-k", socket.to_str().unwrap()])
        .args([
            "--metrics",
            "127.0.0.1:0",
            "--log",
            "info",
            &dir.s("a.qcow2"),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    // Reads the log off the test's thread, so that a server that never logs the line
    // fails the test at the deadline below instead of hanging it.
    let reader = std::thread::spawn(move || {
        let mut log = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            if let Some(at) = line.find("metrics at http://") {
                let rest = &line[at + "metrics at http://".len()..];
                let addr = rest.split('/').next().unwrap_or_default().to_owned();
                let _ = tx.send(addr);
            }
            log.push_str(&line);
            log.push('\n');
        }
        log
    });
    let Ok(addr) = rx.recv_timeout(Duration::from_secs(60)) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("no metrics address logged:\n{}", reader.join().unwrap());
    };
    let port: u16 = addr
        .strip_prefix("127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("logged address {addr:?}"));
    assert_ne!(port, 0, "the bound port is logged, not the one asked for");
    let m = scrape(port);
    assert_eq!(m.get("qcow2_nbd_exports", &[]), 1.0);
    // SAFETY: signalling our own child, which has not been waited for yet.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let log = reader.join().unwrap();
    assert!(status.success(), "serve exited with {status}:\n{log}");
}

/// `curl` of `/metrics` that may fail (the scrape closed for want of a slot).
fn try_scrape(port: u16) -> bool {
    Command::new(require("curl", "curl"))
        .args(["-s", "-f", "-o", "/dev/null", "--max-time", "30"])
        .arg(format!("http://127.0.0.1:{port}/metrics"))
        .status()
        .is_ok_and(|s| s.success())
}

/// Waits for the server to close `client` (end of file or a reset), within a bound that
/// only guards against a hang.
fn assert_closed_by_the_server(client: &mut TcpStream, why: &str) {
    client
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut byte = [0u8; 1];
    match client.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("{why}: the client was not closed: {other:?}"),
    }
}

#[test]
fn the_scrape_limit_and_the_head_timeout_are_options() {
    let dir = images();
    let start = |scrapes: &str, head: &str| {
        let port = free_port();
        let server = Server::unix(&[
            "--metrics",
            &format!("127.0.0.1:{port}"),
            "--metrics-scrapes",
            scrapes,
            "--metrics-head-timeout",
            head,
            "--metrics-timeout",
            "3600",
            "-t",
            &dir.s("a.qcow2"),
        ]);
        (server, port)
    };
    // With one slot, a client that sends nothing gives it up to a scrape, which is served.
    let (server, port) = start("1", "60");
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(try_scrape(port), "a scrape beside a silent client");
    assert_closed_by_the_server(&mut silent, "replaced by a scrape");
    server.stop_ok();
    // With two, both are served: the silent client keeps its slot.
    let (server, port) = start("2", "60");
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(try_scrape(port), "a scrape beside a silent client");
    silent
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let kept = silent.read(&mut [0u8; 1]);
    assert!(
        matches!(&kept, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a client in a free slot keeps it until its head timeout: {kept:?}"
    );
    server.stop_ok();
    // A client that does not finish its head within --metrics-head-timeout is closed.
    let (server, port) = start("4", "1");
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    let t = std::time::Instant::now();
    assert_closed_by_the_server(&mut slow, "head timeout");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    server.stop_ok();
}

/// Keeps `count` clients sending a request head one byte a second, each reconnecting as
/// soon as the server closes it, until `until`.
fn slowloris(port: u16, count: usize, until: std::time::Instant) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let head = b"GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        let connect = || {
            let c = TcpStream::connect(("127.0.0.1", port)).ok()?;
            c.set_nonblocking(true).ok()?;
            Some((c, 0usize, std::time::Instant::now()))
        };
        let mut clients: Vec<_> = (0..count).map(|_| connect()).collect();
        let mut connections = count as u64;
        while std::time::Instant::now() < until {
            for slot in &mut clients {
                let alive = match slot {
                    Some((c, sent, last)) => {
                        // Nothing is ever answered to them: any read but "nothing yet"
                        // means the server closed the connection.
                        let open = matches!(
                            c.read(&mut [0u8; 64]),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                        );
                        if open && last.elapsed() >= Duration::from_secs(1) {
                            *last = std::time::Instant::now();
                            let byte = head[*sent % head.len()..][..1].to_vec();
                            *sent += 1;
                            c.write_all(&byte).is_ok()
                        } else {
                            open
                        }
                    }
                    None => false,
                };
                if !alive {
                    *slot = connect();
                    connections += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        connections
    })
}

#[test]
fn scrapes_are_served_beside_100_slowloris_clients() {
    let dir = images();
    let port = free_port();
    let server = serve_two(&dir, port, "1");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let attack = slowloris(port, 100, until);
    std::thread::sleep(Duration::from_millis(500));
    let (mut tried, mut served) = (0, 0);
    while std::time::Instant::now() < until {
        let t = std::time::Instant::now();
        tried += 1;
        served += u32::from(try_scrape(port));
        std::thread::sleep(Duration::from_secs(1).saturating_sub(t.elapsed()));
    }
    let connections = attack.join().unwrap();
    eprintln!("{served} of {tried} scrapes served beside {connections} slowloris connections");
    assert_eq!(served, tried, "scrapes refused beside slow clients");
    assert!(connections > 100, "the slow clients were never closed");
    server.stop_ok();
}
