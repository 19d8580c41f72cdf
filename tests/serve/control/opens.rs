//! Files that are no disk or whose file system never answers: refused, while every export,
//! the control socket and `/metrics` go on answering.

use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use super::harness::*;
use crate::support::{serve_fails, BIN};
use test_support::{assert_check_clean, qemu_io, text, Dir};

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
