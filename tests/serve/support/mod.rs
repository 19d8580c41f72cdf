//! Shared harness of the `serve_*` tests: the real `qcow2-nbd serve` binary as a child
//! process, QEMU's tools as oracles, and external NBD clients found or explained.
#![allow(dead_code)] // each test binary uses a different subset

pub mod kernel_client;
pub mod qemu_nbd;
pub mod raw;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_qcow2-nbd");

/// Path of an external tool, or a panic naming the Debian package that provides it.
pub fn require(tool: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in
        std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
    {
        let candidate = dir.join(tool);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "`{tool}` is required by this test but not installed: \
         install the Debian package `{package}` (apt-get install {package})"
    );
}

/// A Python interpreter that can `import nbd` (libnbd's bindings, which nbdsh uses). A
/// pyenv or virtualenv `python3` first on PATH usually cannot, Debian's can.
pub fn python_with_libnbd() -> PathBuf {
    for python in ["python3", "/usr/bin/python3"] {
        let ok = Command::new(python)
            .args(["-c", "import nbd"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return PathBuf::from(python);
        }
    }
    panic!(
        "no python3 can `import nbd`: install the Debian package `python3-libnbd` \
         (it provides nbdsh's bindings)"
    );
}

/// Runs a command, panicking with its output if it fails.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qemu-img ARGS`, stdout.
pub fn qemu_img(args: &[&str]) -> String {
    stdout(&run_ok(
        Command::new(require("qemu-img", "qemu-utils")).args(args),
    ))
}

/// `qemu-io` with commands on `target` (a file with `-f fmt`, or an NBD URI with `raw`);
/// fails on any error or pattern mismatch it reports.
pub fn qemu_io(fmt: &str, target: &str, cmds: &[&str]) -> String {
    qemu_io_opts(&["-f", fmt], target, cmds)
}

/// [`qemu_io`] opening `target` read-only (a read-only export refuses read-write opens).
pub fn qemu_io_read_only(fmt: &str, target: &str, cmds: &[&str]) -> String {
    qemu_io_opts(&["-r", "-f", fmt], target, cmds)
}

fn qemu_io_opts(opts: &[&str], target: &str, cmds: &[&str]) -> String {
    let mut cmd = Command::new(require("qemu-io", "qemu-utils"));
    cmd.args(opts);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.arg(target);
    let out = stdout(&run_ok(&mut cmd));
    let lower = out.to_lowercase();
    assert!(
        !lower.contains("error") && !lower.contains("fail"),
        "qemu-io {cmds:?} on {target}: {out}"
    );
    out
}

/// `qemu-img check` passes with no errors and no leaks.
pub fn assert_check_clean(image: &Path) {
    let json = qemu_img(&["check", "--output=json", image.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for key in ["corruptions", "leaks", "check-errors"] {
        assert!(
            v[key].as_u64().unwrap_or(0) == 0,
            "qemu-img check of {}: {key} in {json}",
            image.display()
        );
    }
}

/// `qemu-img compare` finds `image` (qcow2) and `model` (raw) identical.
pub fn assert_same_as_model(image: &Path, model: &Path) {
    assert_same_as_model_fmt(image, "qcow2", model);
}

/// `qemu-img compare` finds `image` (of format `fmt`) and `model` (raw) identical.
pub fn assert_same_as_model_fmt(image: &Path, fmt: &str, model: &Path) {
    let out = Command::new(require("qemu-img", "qemu-utils"))
        .args(["compare", "-f", fmt, "-F", "raw"])
        .arg(image)
        .arg(model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img compare {} {}: {}{}",
        image.display(),
        model.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The guest-visible bytes of `image` according to QEMU.
pub fn qemu_contents(image: &Path, fmt: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("contents.raw");
    qemu_img(&[
        "convert",
        "-f",
        fmt,
        "-O",
        "raw",
        image.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    std::fs::read(out).unwrap()
}

/// A TCP port that was free a moment ago (the kernel hands out ephemeral ports in turn, so
/// another process taking it before the server binds is unlikely; tests that need TCP retry
/// nothing and would fail loudly).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running `qcow2-nbd serve`, started with a pid file so the test knows when it listens.
pub struct Server {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// The Unix socket (when started with [`Server::unix`]).
    pub socket: PathBuf,
    /// The pid file.
    pub pid_file: PathBuf,
    /// The TCP port (when started with [`Server::tcp`]).
    pub port: Option<u16>,
}

impl Server {
    /// `serve -k SOCKET --pid-file PID ARGS...`, waiting until it listens.
    pub fn unix(args: &[&str]) -> Server {
        Self::unix_with_env(args, &[])
    }

    /// [`Server::unix`] with extra environment variables.
    pub fn unix_with_env(args: &[&str], env: &[(&str, &Path)]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let mut full = vec!["-k".to_owned(), socket.to_str().unwrap().to_owned()];
        full.extend(args.iter().map(|s| s.to_string()));
        Self::start(dir, socket, None, &full, env)
    }

    /// `serve -b 127.0.0.1 -p PORT --pid-file PID ARGS...`, waiting until it listens.
    pub fn tcp(args: &[&str]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut full: Vec<String> = ["-b", "127.0.0.1", "-p", &port.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
        full.extend(args.iter().map(|s| s.to_string()));
        let socket = dir.path().join("unused");
        Self::start(dir, socket, Some(port), &full, &[])
    }

    fn start(
        dir: tempfile::TempDir,
        socket: PathBuf,
        port: Option<u16>,
        args: &[String],
        env: &[(&str, &Path)],
    ) -> Server {
        let pid_file = dir.path().join("serve.pid");
        let child = Command::new(BIN)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .arg("serve")
            .arg("--pid-file")
            .arg(&pid_file)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start qcow2-nbd serve");
        let mut server = Server {
            child: Some(child),
            dir,
            socket,
            pid_file,
            port,
        };
        server.wait_listening(args);
        server
    }

    /// Waits for the pid file, which the server writes only once it listens. The deadline
    /// is a safety net against a hung server, not a speed requirement.
    fn wait_listening(&mut self, args: &[String]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.pid_file.exists() {
            let child = self.child.as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                let out = self.child.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "serve {args:?} exited with {status} before listening:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                Instant::now() < deadline,
                "serve {args:?} did not start listening"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid: u32 = std::fs::read_to_string(&self.pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(pid, self.pid(), "the pid file names the server");
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// `nbd+unix` URI of the default export.
    pub fn uri(&self) -> String {
        match self.port {
            Some(port) => format!("nbd://127.0.0.1:{port}/"),
            None => format!("nbd+unix:///?socket={}", self.socket.display()),
        }
    }

    /// URI of a named export.
    pub fn uri_of(&self, export: &str) -> String {
        match self.port {
            Some(port) => format!("nbd://127.0.0.1:{port}/{export}"),
            None => format!("nbd+unix:///{export}?socket={}", self.socket.display()),
        }
    }

    /// A scratch directory that lives as long as the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Sends a signal to the server.
    pub fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.pid()).unwrap();
        // SAFETY: kill only sends a signal to our own child process.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
    }

    /// SIGTERM, then waits: the exit status and stderr.
    pub fn stop(mut self) -> (ExitStatus, String) {
        self.signal(libc::SIGTERM);
        self.wait()
    }

    /// Waits for a server that stops by itself: the exit status and stderr.
    pub fn wait(&mut self) -> (ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (child.wait().unwrap(), err)
    }

    /// Waits at most `limit` for the server to exit by itself; a server still running then
    /// is killed and the test fails, rather than hanging.
    pub fn wait_within(&mut self, limit: Duration) -> (ExitStatus, String) {
        let deadline = Instant::now() + limit;
        loop {
            let child = self.child.as_mut().expect("running");
            if child.try_wait().unwrap().is_some() {
                return self.wait();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let (_, err) = self.wait();
                panic!("serve did not exit within {limit:?}:\n{err}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and an assertion that the server shut down cleanly (exit 0).
    pub fn stop_ok(self) -> String {
        let (status, err) = self.stop();
        assert!(status.success(), "serve exited with {status}:\n{err}");
        err
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `qcow2-nbd serve ARGS` expecting it to fail: its stderr. A server that starts
/// serving instead is killed after a minute and the test fails (rather than hanging).
pub fn serve_fails(args: &[&str]) -> String {
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err);
        err
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve {args:?} was expected to fail but kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = reader.join().unwrap();
    assert!(!status.success(), "serve {args:?} succeeded:\n{err}");
    assert_eq!(status.code(), Some(1), "serve {args:?}: {status:?}\n{err}");
    err
}

/// A temporary directory with helpers to make images in it.
pub struct Images {
    pub dir: tempfile::TempDir,
}

impl Images {
    pub fn new() -> Images {
        Images {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Path of `name` in the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Path of `name` as a string.
    pub fn s(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_owned()
    }

    /// `qemu-img create -f FMT [-o OPTS] [-b BACKING -F BFMT] NAME SIZE`.
    pub fn create(
        &self,
        name: &str,
        fmt: &str,
        opts: &str,
        backing: Option<(&str, &str)>,
        size: &str,
    ) -> PathBuf {
        let mut args = vec!["create", "-q", "-f", fmt];
        if !opts.is_empty() {
            args.extend(["-o", opts]);
        }
        let b;
        if let Some((file, bfmt)) = backing {
            b = self.s(file);
            args.extend(["-b", &b, "-F", bfmt]);
        }
        let p = self.s(name);
        args.push(&p);
        if !size.is_empty() {
            args.push(size);
        }
        qemu_img(&args);
        self.path(name)
    }

    /// Runs qemu-io commands on image `name` of format `fmt`.
    pub fn io(&self, name: &str, fmt: &str, cmds: &[&str]) {
        qemu_io(fmt, &self.s(name), cmds);
    }
}
