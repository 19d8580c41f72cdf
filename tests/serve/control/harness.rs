//! What the control tests share: the server, `ctl`, a QMP client and raw NBD clients.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::raw::{finish_option, negotiating, option, OPT_GO, REP_ACK};
use crate::support::{Server, BIN};
use test_support::{qemu, require, text, Dir};

/// NBD_REP_ERR_UNKNOWN.
const REP_ERR_UNKNOWN: u32 = 0x8000_0006;

/// A server with `--threads 1 -t -e 0 --control DIR/ctl.sock` and `--export` definitions.
pub(super) fn serve(dir: &Dir, exports: &[String], extra: &[&str]) -> Server {
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

/// Two empty 4 MiB images, `a.qcow2` and `b.qcow2`, served as exports `a` and `b` by
/// [`serve`] with `extra`; their paths and the server.
pub(super) fn serve_a_and_b(dir: &Dir, extra: &[&str]) -> (PathBuf, PathBuf, Server) {
    let a = dir.create("a.qcow2", "qcow2", "", None, "4M");
    let b = dir.create("b.qcow2", "qcow2", "", None, "4M");
    let exports = [export("a", dir, "a.qcow2"), export("b", dir, "b.qcow2")];
    (a, b, serve(dir, &exports, extra))
}

pub(super) fn export(name: &str, dir: &Dir, file: &str) -> String {
    format!("name={name},file={}", dir.s(file))
}

/// `qcow2-nbd ctl --socket DIR/ctl.sock ARGS...`.
pub(super) fn ctl(dir: &Dir, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["ctl", "--socket", &dir.s("ctl.sock"), "--timeout", "60"])
        .args(args)
        .output()
        .unwrap()
}

/// `ctl` that must succeed: its JSON output.
pub(super) fn ctl_ok(dir: &Dir, args: &[&str]) -> Value {
    let out = ctl(dir, args);
    assert!(out.status.success(), "ctl {args:?}: {}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `ctl` that must fail: its stderr.
pub(super) fn ctl_fails(dir: &Dir, args: &[&str]) -> String {
    let out = ctl(dir, args);
    assert_eq!(out.status.code(), Some(1), "ctl {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The export names `nbdinfo --list` shows.
pub(super) fn listed(server: &Server) -> Vec<String> {
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
pub(super) struct Qmp {
    pub(super) reader: BufReader<UnixStream>,
    pub(super) writer: UnixStream,
    /// Events read while waiting for an answer, for [`Qmp::wait_deleted`].
    pub(super) events: std::collections::VecDeque<Value>,
}

impl Qmp {
    /// Connects and reads the greeting.
    pub(super) fn connect(dir: &Dir) -> Qmp {
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
    pub(super) fn connect_raw(dir: &Dir) -> (Qmp, Value) {
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

    pub(super) fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).unwrap();
    }

    /// The next message (events included), or `None` at the end of the stream.
    pub(super) fn next(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(serde_json::from_str(&line).unwrap()),
        }
    }

    /// Sends a request and returns the next message that is not an event.
    pub(super) fn run(&mut self, request: Value) -> Value {
        self.send(format!("{request}\n").as_bytes());
        self.answer()
    }

    pub(super) fn answer(&mut self) -> Value {
        loop {
            let m = self.next().expect("an answer");
            if m.get("event").is_none() {
                return m;
            }
            self.events.push_back(m);
        }
    }

    /// The error class and description of an answer that must be an error.
    pub(super) fn error(&mut self, request: Value) -> (String, String) {
        let a = self.run(request.clone());
        let e = a.get("error").unwrap_or_else(|| panic!("{request} -> {a}"));
        (
            e["class"].as_str().unwrap().to_owned(),
            e["desc"].as_str().unwrap().to_owned(),
        )
    }

    /// Waits for `BLOCK_EXPORT_DELETED` of `id`.
    pub(super) fn wait_deleted(&mut self, id: &str) -> Value {
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

    pub(super) fn exports(&mut self) -> Vec<Value> {
        let a = self.run(json!({"execute": "query-block-exports"}));
        a["return"].as_array().unwrap().clone()
    }
}

/// A raw NBD client attached to one export, with simple replies.
pub(super) struct Attached(UnixStream);

impl Attached {
    /// Connects and selects `name`; `None` if the server refuses it as unknown.
    pub(super) fn try_go(socket: &Path, name: &str) -> Option<Attached> {
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

    pub(super) fn request(
        &mut self,
        kind: u16,
        offset: u64,
        len: u32,
        cookie: u64,
    ) -> std::io::Result<()> {
        let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
        m.extend_from_slice(&0u16.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        self.0.write_all(&m)
    }

    /// The error of the next simple reply.
    pub(super) fn reply(&mut self, cookie: u64) -> std::io::Result<u32> {
        let mut head = [0u8; 16];
        self.0.read_exact(&mut head)?;
        assert_eq!(head[..4], 0x6744_6698u32.to_be_bytes());
        assert_eq!(head[8..], cookie.to_be_bytes());
        Ok(u32::from_be_bytes(head[4..8].try_into().unwrap()))
    }

    pub(super) fn write(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.request(1, offset, u32::try_from(data.len()).unwrap(), 1)?;
        self.0.write_all(data)?;
        assert_eq!(self.reply(1)?, 0, "write at {offset}");
        Ok(())
    }

    pub(super) fn read(&mut self, offset: u64, len: u32) -> std::io::Result<Vec<u8>> {
        self.request(0, offset, len, 2)?;
        assert_eq!(self.reply(2)?, 0, "read at {offset}");
        let mut data = vec![0u8; len as usize];
        self.0.read_exact(&mut data)?;
        Ok(data)
    }
}

/// True when `qemu-img info` can open the image, which takes its lock.
pub(super) fn unlocked(image: &Path) -> bool {
    qemu("qemu-img")
        .arg("info")
        .arg(image)
        .output()
        .unwrap()
        .status
        .success()
}

/// A client that reads export `name` without pause, counting its reads, until stopped.
pub(super) struct SteadyReader {
    reads: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SteadyReader {
    pub(super) fn start(socket: &Path, name: &str) -> SteadyReader {
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
    pub(super) fn assert_progress(&self, limit: Duration, during: &str) {
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

    pub(super) fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("the reader saw no error");
        self.reads()
    }
}
