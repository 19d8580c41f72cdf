//! `serve --control`: exports added and deleted while the server runs, through the QMP-style
//! socket and `qcow2-nbd ctl`, seen by real clients (nbdinfo, qemu-io, fio) and by a raw
//! client that stays attached; images closed, checked and unlocked once deleted; hostile
//! control input answered with QEMU's error classes while the exports go on being served.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::qemu_nbd::QemuNbd;
use crate::support::raw::{finish_option, negotiating, option, OPT_GO, REP_ACK};
use crate::support::{serve_fails, Server, BIN};
use test_support::{assert_check_clean, qemu, qemu_io, require, text, Dir};

/// NBD_REP_ERR_UNKNOWN.
const REP_ERR_UNKNOWN: u32 = 0x8000_0006;

/// A server with `--threads 1 -t -e 0 --control DIR/ctl.sock` and `--export` definitions.
fn serve(dir: &Dir, exports: &[String], extra: &[&str]) -> Server {
    let ctl = dir.s("ctl.sock");
    let mut args = vec!["-t", "-e", "0", "--control", &ctl];
    if !extra.contains(&"--threads") {
        args.extend(["--threads", "1"]);
    }
    args.extend(extra);
    for e in exports {
        args.extend(["--export", e.as_str()]);
    }
    Server::unix(&args)
}

fn export(name: &str, dir: &Dir, file: &str) -> String {
    format!("name={name},file={}", dir.s(file))
}

/// `qcow2-nbd ctl --socket DIR/ctl.sock ARGS...`.
fn ctl(dir: &Dir, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["ctl", "--socket", &dir.s("ctl.sock"), "--timeout", "60"])
        .args(args)
        .output()
        .unwrap()
}

/// `ctl` that must succeed: its JSON output.
fn ctl_ok(dir: &Dir, args: &[&str]) -> Value {
    let out = ctl(dir, args);
    assert!(out.status.success(), "ctl {args:?}: {}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `ctl` that must fail: its stderr.
fn ctl_fails(dir: &Dir, args: &[&str]) -> String {
    let out = ctl(dir, args);
    assert_eq!(out.status.code(), Some(1), "ctl {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The export names `nbdinfo --list` shows.
fn listed(server: &Server) -> Vec<String> {
    let out = Command::new(require("nbdinfo", "libnbd-bin"))
        .args(["--list", "--json", &server.uri()])
        .output()
        .unwrap();
    assert!(out.status.success(), "nbdinfo: {}", text(&out));
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<String> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// A QMP client speaking to the control socket line by line.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events read while waiting for an answer, for [`Qmp::wait_deleted`].
    events: std::collections::VecDeque<Value>,
}

impl Qmp {
    /// Connects and reads the greeting.
    fn connect(dir: &Dir) -> Qmp {
        let (mut q, greeting) = Self::connect_raw(dir);
        assert!(greeting["QMP"]["version"]["package"]
            .as_str()
            .unwrap()
            .starts_with("qcow2-nbd"));
        assert_eq!(
            q.run(json!({"execute": "qmp_capabilities"})),
            json!({"return": {}})
        );
        q
    }

    /// Connects: the client and the first message.
    fn connect_raw(dir: &Dir) -> (Qmp, Value) {
        let s = UnixStream::connect(dir.path("ctl.sock")).unwrap();
        // A safety net so a server bug fails the test instead of hanging it.
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut q = Qmp {
            reader: BufReader::new(s.try_clone().unwrap()),
            writer: s,
            events: Default::default(),
        };
        let first = q.next().expect("a first message");
        (q, first)
    }

    fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).unwrap();
    }

    /// The next message (events included), or `None` at the end of the stream.
    fn next(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(serde_json::from_str(&line).unwrap()),
        }
    }

    /// Sends a request and returns the next message that is not an event.
    fn run(&mut self, request: Value) -> Value {
        self.send(format!("{request}\n").as_bytes());
        self.answer()
    }

    fn answer(&mut self) -> Value {
        loop {
            let m = self.next().expect("an answer");
            if m.get("event").is_none() {
                return m;
            }
            self.events.push_back(m);
        }
    }

    /// The error class and description of an answer that must be an error.
    fn error(&mut self, request: Value) -> (String, String) {
        let a = self.run(request.clone());
        let e = a.get("error").unwrap_or_else(|| panic!("{request} -> {a}"));
        (
            e["class"].as_str().unwrap().to_owned(),
            e["desc"].as_str().unwrap().to_owned(),
        )
    }

    /// Waits for `BLOCK_EXPORT_DELETED` of `id`.
    fn wait_deleted(&mut self, id: &str) -> Value {
        loop {
            let m = match self.events.pop_front() {
                Some(m) => m,
                None => self.next().expect("the BLOCK_EXPORT_DELETED event"),
            };
            if m["event"] == "BLOCK_EXPORT_DELETED" && m["data"]["id"] == id {
                return m;
            }
        }
    }

    fn exports(&mut self) -> Vec<Value> {
        let a = self.run(json!({"execute": "query-block-exports"}));
        a["return"].as_array().unwrap().clone()
    }
}

/// A raw NBD client attached to one export, with simple replies.
struct Attached(UnixStream);

impl Attached {
    /// Connects and selects `name`; `None` if the server refuses it as unknown.
    fn try_go(socket: &Path, name: &str) -> Option<Attached> {
        let mut s = negotiating(socket);
        let mut data = u32::try_from(name.len()).unwrap().to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&option(OPT_GO, &data)).unwrap();
        match finish_option(&mut s) {
            REP_ACK => Some(Attached(s)),
            REP_ERR_UNKNOWN => None,
            other => panic!("NBD_OPT_GO {name:?}: reply {other:#x}"),
        }
    }

    fn request(&mut self, kind: u16, offset: u64, len: u32, cookie: u64) -> std::io::Result<()> {
        let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
        m.extend_from_slice(&0u16.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        self.0.write_all(&m)
    }

    /// The error of the next simple reply.
    fn reply(&mut self, cookie: u64) -> std::io::Result<u32> {
        let mut head = [0u8; 16];
        self.0.read_exact(&mut head)?;
        assert_eq!(head[..4], 0x6744_6698u32.to_be_bytes());
        assert_eq!(head[8..], cookie.to_be_bytes());
        Ok(u32::from_be_bytes(head[4..8].try_into().unwrap()))
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.request(1, offset, u32::try_from(data.len()).unwrap(), 1)?;
        self.0.write_all(data)?;
        assert_eq!(self.reply(1)?, 0, "write at {offset}");
        Ok(())
    }

    fn read(&mut self, offset: u64, len: u32) -> std::io::Result<Vec<u8>> {
        self.request(0, offset, len, 2)?;
        assert_eq!(self.reply(2)?, 0, "read at {offset}");
        let mut data = vec![0u8; len as usize];
        self.0.read_exact(&mut data)?;
        Ok(data)
    }
}

/// True when `qemu-img info` can open the image, which takes its lock.
fn unlocked(image: &Path) -> bool {
    qemu("qemu-img")
        .arg("info")
        .arg(image)
        .output()
        .unwrap()
        .status
        .success()
}

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
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2"), export("b", &dir, "b.qcow2")],
        &[],
    );
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

#[test]
fn bitmaps_change_on_writable_exports_only_and_never_under_a_client() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    dir.create("r.qcow2", "qcow2", "", None, "4M");
    dir.qemu_img(&["bitmap", "--add", &dir.s("a.qcow2"), "served"]);
    let server = serve(
        &dir,
        &[
            format!("{},bitmap=served", export("a", &dir, "a.qcow2")),
            format!("{},readonly=on", export("r", &dir, "r.qcow2")),
        ],
        &[],
    );
    ctl_ok(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=b1",
            "granularity=131072",
        ],
    );
    ctl_ok(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=b2",
            "disabled=true",
        ],
    );
    ctl_ok(&dir, &["block-dirty-bitmap-clear", "node=a", "name=b1"]);
    ctl_ok(&dir, &["block-dirty-bitmap-remove", "node=a", "name=b2"]);
    let err = ctl_fails(
        &dir,
        &["block-dirty-bitmap-remove", "node=a", "name=served"],
    );
    assert!(err.contains("exported to NBD clients"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-clear", "node=a", "name=served"]);
    assert!(err.contains("exported to NBD clients"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-add", "node=r", "name=x"]);
    assert!(err.contains("read-only"), "{err}");
    let err = ctl_fails(
        &dir,
        &[
            "block-dirty-bitmap-add",
            "node=a",
            "name=t",
            "persistent=false",
        ],
    );
    assert!(err.contains("only persistent bitmaps"), "{err}");
    let err = ctl_fails(&dir, &["block-dirty-bitmap-add", "node=zz", "name=x"]);
    assert!(err.contains("Export 'zz' is not found"), "{err}");
    server.stop_ok();
    let info = dir.info("a.qcow2");
    let names: Vec<&str> = info["format-specific"]["data"]["bitmaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["served", "b1"]);
    dir.assert_check_clean("a.qcow2");
}

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
    let a = dir.create("a.qcow2", "qcow2", "", None, "4M");
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2"), export("b", &dir, "b.qcow2")],
        &["--threads", threads],
    );
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

/// A client that reads export `name` without pause, counting its reads, until stopped.
struct SteadyReader {
    reads: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SteadyReader {
    fn start(socket: &Path, name: &str) -> SteadyReader {
        use std::sync::atomic::Ordering;
        let mut client = Attached::try_go(socket, name).expect("served");
        let reads = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, s) = (reads.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut offset = 0u64;
            while !s.load(Ordering::Relaxed) {
                client
                    .read(offset, 4096)
                    .expect("the other export keeps serving");
                offset = (offset + 4096) % (1 << 20);
                r.fetch_add(1, Ordering::Relaxed);
            }
        });
        SteadyReader {
            reads,
            stop,
            thread: Some(thread),
        }
    }

    fn reads(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Fails unless some reads complete within `limit`.
    fn assert_progress(&self, limit: Duration, during: &str) {
        let before = self.reads();
        let deadline = std::time::Instant::now() + limit;
        while self.reads() == before {
            assert!(
                std::time::Instant::now() < deadline,
                "no read of the other export completed within {limit:?} {during}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("the reader saw no error");
        self.reads()
    }
}

/// Fails unless a new control client gets its greeting and an answer within a second.
fn assert_control_answers(dir: &Dir, during: &str) {
    let started = std::time::Instant::now();
    let s = UnixStream::connect(dir.path("ctl.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut q = Qmp {
        reader: BufReader::new(s.try_clone().unwrap()),
        writer: s,
        events: Default::default(),
    };
    let greeting = q.next();
    assert!(
        greeting.is_some(),
        "no control greeting within 1 s {during}"
    );
    let caps = q.run(json!({"execute": "qmp_capabilities"}));
    assert_eq!(caps, json!({"return": {}}), "{during}");
    let listed = q.run(json!({"execute": "query-block-exports"}));
    assert!(listed["return"].is_array(), "{listed} {during}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the control socket took {:?} {during}",
        started.elapsed()
    );
}

/// Fails unless `/metrics` on `port` answers 200 within a second.
fn assert_metrics_answer(port: u16, during: &str) {
    use std::net::TcpStream;
    let started = std::time::Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let read = s.read_to_end(&mut answer);
    let head = String::from_utf8_lossy(&answer[..answer.len().min(64)]).into_owned();
    assert!(
        read.is_ok() && head.starts_with("HTTP/1.1 200"),
        "/metrics did not answer within 1 s {during}: {read:?} {head:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "/metrics took {:?} {during}",
        started.elapsed()
    );
}

/// Holds a read lease on `path`: until it is dropped, an open of the file for writing by
/// another process blocks in the kernel, as an open on a file system that does not answer
/// does (the kernel breaks the lease by force only after `lease-break-time`, 45 s).
struct Lease {
    _file: std::fs::File,
}

/// Linux's `F_SETSIG` (fcntl.h), which the libc crate does not name.
const F_SETSIG: libc::c_int = 10;

impl Lease {
    fn take(path: &Path) -> Lease {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(path).unwrap();
        let fd = file.as_raw_fd();
        // The kernel tells the holder with a signal when another process wants the file:
        // SIGURG, which is ignored by default, rather than SIGIO, which would end the test.
        // SAFETY: fcntl on a descriptor this function owns; no memory is passed.
        assert_eq!(unsafe { libc::fcntl(fd, F_SETSIG, libc::SIGURG) }, 0);
        // SAFETY: as above.
        let taken = unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) };
        assert_eq!(taken, 0, "F_SETLEASE: {}", std::io::Error::last_os_error());
        Lease { _file: file }
    }
}

#[test]
fn files_that_are_no_disk_or_never_answer_are_refused_while_every_export_goes_on() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let held = dir.create("held.qcow2", "qcow2", "", None, "4M");
    let port = crate::support::free_port();
    let metrics = format!("127.0.0.1:{port}");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2")],
        &[
            "--metrics",
            &metrics,
            "--open-timeout",
            "3",
            "--open-stuck-max",
            "1",
        ],
    );
    let fifo = dir.path("fifo");
    let c_fifo = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
    let socket = dir.path("listening.sock");
    let _listening = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let reader = SteadyReader::start(&server.socket, "a");
    let lease = Lease::take(&held);

    let cases: [(&Path, &str, &[&str]); 5] = [
        (&fifo, "it is a FIFO (named pipe)", &["format=raw"]),
        (dir.root(), "it is a directory", &["format=raw"]),
        (&socket, "it is a socket", &[]),
        (
            Path::new("/dev/null"),
            "it is a character device",
            &["format=raw"],
        ),
        (
            &held,
            "no answer from the file system within 3 s",
            &["writable=true"],
        ),
    ];
    for (i, (path, kind, extra)) in cases.into_iter().enumerate() {
        let id = format!("id=x{i}");
        let file = format!("file={}", path.display());
        let mut args = vec!["block-export-add".to_owned(), id, file];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let adding = {
            let dir_path = dir.root().to_path_buf();
            std::thread::spawn(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                Command::new(BIN)
                    .args(["ctl", "--socket"])
                    .arg(dir_path.join("ctl.sock"))
                    .args(["--timeout", "60"])
                    .args(&args)
                    .output()
                    .unwrap()
            })
        };
        let during = format!("while {} is added", path.display());
        // Checked while the add is under way (the one that never answers takes 3 s).
        std::thread::sleep(Duration::from_millis(300));
        reader.assert_progress(Duration::from_secs(1), &during);
        assert_control_answers(&dir, &during);
        assert_metrics_answer(port, &during);
        reader.assert_progress(Duration::from_secs(1), &during);
        let out = adding.join().unwrap();
        assert_eq!(out.status.code(), Some(1), "{during}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("block-export-add")
                && err.contains(&path.display().to_string())
                && err.contains(kind),
            "{during}: {err}"
        );
    }
    // The open given up still waits for the file system: with --open-stuck-max 1 a further
    // open is refused at once instead of adding a thread more.
    let file = format!("file={}", dir.s("a.qcow2"));
    let err = ctl_fails(&dir, &["block-export-add", "id=more", &file]);
    assert!(err.contains("still wait for an answer"), "{err}");
    // Once the file system answers, the stuck open closes what it got and opens go on.
    drop(lease);
    let file = format!("file={}", held.display());
    test_support::wait_until(Duration::from_secs(10), "the stuck open returns", || {
        let out = ctl(
            &dir,
            &["block-export-add", "id=held", &file, "writable=true"],
        );
        out.status.success()
    });
    assert_eq!(listed(&server), ["a", "held"]);
    qemu_io("raw", &server.uri_of("held"), &["write -P 7 0 64k"]);
    assert!(reader.finish() > 0);
    server.stop_ok();
    assert_check_clean(&held);
}

#[test]
fn a_fifo_given_at_start_is_refused_at_once() {
    let dir = Dir::new();
    let fifo = dir.path("fifo");
    let c_fifo = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
    let started = std::time::Instant::now();
    let err = serve_fails(&["-r", "-f", "raw", "-k", &dir.s("s.sock"), &dir.s("fifo")]);
    assert!(
        err.contains(&dir.s("fifo")) && err.contains("it is a FIFO (named pipe)"),
        "{err}"
    );
    let spec = format!("name=d,file={},format=raw", dir.root().display());
    let err = serve_fails(&["-k", &dir.s("s.sock"), "--export", &spec]);
    assert!(
        err.contains("--export name=d") && err.contains("it is a directory"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_hard_delete_ends_a_safe_delete_that_a_client_holds_up() {
    let dir = Dir::new();
    dir.create("a.qcow2", "qcow2", "", None, "4M");
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let server = serve(
        &dir,
        &[export("a", &dir, "a.qcow2"), export("b", &dir, "b.qcow2")],
        &[],
    );
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
