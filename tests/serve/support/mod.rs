//! Harness of the `serve` tests: the real `qcow2-nbd serve` binary as a child process (QEMU's
//! tools and the NBD clients come from test_support).

pub mod kernel_client;
pub mod qemu_nbd;
pub mod raw;

use std::ffi::OsStr;
use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use test_support::{exit_within, wait_until};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_qcow2-nbd");

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

/// The connection counts `serve` logs at info level when it stops (the nbd-server
/// crate's `ServeReport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Clients accepted.
    pub connections: u64,
    /// Clients whose connection ended with an error (a protocol violation, an I/O failure).
    pub failed_connections: u64,
}

/// A running `qcow2-nbd serve`, started with a pid file so the test knows when it listens.
pub struct Server {
    child: Option<Child>,
    /// Holds the socket and the pid file.
    _dir: tempfile::TempDir,
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

    /// [`Server::unix`] logging at info level, so that [`Server::stop_report`] can read the
    /// connection counts the server logs when it stops.
    pub fn unix_reporting(args: &[&str]) -> Server {
        Self::unix_with_env(args, &[("RUST_LOG", OsStr::new("info"))])
    }

    /// [`Server::unix`] with extra environment variables.
    pub fn unix_with_env(args: &[&str], env: &[(&str, &OsStr)]) -> Server {
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
        env: &[(&str, &OsStr)],
    ) -> Server {
        let pid_file = dir.path().join("serve.pid");
        let child = Command::new(BIN)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .arg("serve")
            .arg("--pid-file")
            .arg(&pid_file)
            .args(default_threads(args))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start qcow2-nbd serve");
        let mut server = Server {
            child: Some(child),
            _dir: dir,
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
        let pid_file = self.pid_file.clone();
        wait_until(
            Duration::from_secs(60),
            format!("serve {args:?} starts listening"),
            || {
                if pid_file.exists() {
                    return true;
                }
                let child = self.child.as_mut().unwrap();
                if let Some(status) = child.try_wait().unwrap() {
                    let out = self.child.take().unwrap().wait_with_output().unwrap();
                    panic!(
                        "serve {args:?} exited with {status} before listening:\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                false
            },
        );
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
            Some(port) => test_support::nbd_tcp_uri(port, ""),
            None => test_support::nbd_unix_uri(&self.socket, ""),
        }
    }

    /// URI of a named export.
    pub fn uri_of(&self, export: &str) -> String {
        match self.port {
            Some(port) => test_support::nbd_tcp_uri(port, export),
            None => test_support::nbd_unix_uri(&self.socket, export),
        }
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
        let child = self.child.as_mut().expect("running");
        if exit_within(child, limit).is_none() {
            let _ = child.kill();
            let (_, err) = self.wait();
            panic!("serve did not exit within {limit:?}:\n{err}");
        }
        self.wait()
    }

    /// SIGTERM and an assertion that the server shut down cleanly (exit 0).
    pub fn stop_ok(self) -> String {
        let (status, err) = self.stop();
        assert!(status.success(), "serve exited with {status}:\n{err}");
        err
    }

    /// [`Server::stop_ok`] for a server started with [`Server::unix_reporting`]: the
    /// connection counts it logged as it stopped.
    pub fn stop_report(self) -> Report {
        let err = self.stop_ok();
        let line = err
            .lines()
            .find(|l| l.contains("server stopped"))
            .unwrap_or_else(|| panic!("no \"server stopped\" line in the log:\n{err}"));
        let count = |key: &str| -> u64 {
            let at = line
                .find(key)
                .unwrap_or_else(|| panic!("no {key:?} in {line:?}"))
                + key.len();
            let digits: String = line[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits
                .parse()
                .unwrap_or_else(|e| panic!("{key:?} in {line:?}: {e}"))
        };
        Report {
            connections: count("{ connections: "),
            failed_connections: count("failed_connections: "),
        }
    }
}

/// `--threads 2` unless the test chose: every served test then runs the multi-threaded
/// path, its first client crossing threads to reach the image and its second served on
/// the image's own thread.
fn default_threads(args: &[String]) -> &'static [&'static str] {
    if args.iter().any(|a| a == "--threads") {
        &[]
    } else {
        &["--threads", "2"]
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
    let Some(status) = exit_within(&mut child, Duration::from_secs(60)) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("serve {args:?} was expected to fail but kept running");
    };
    let err = reader.join().unwrap();
    assert!(!status.success(), "serve {args:?} succeeded:\n{err}");
    assert_eq!(status.code(), Some(1), "serve {args:?}: {status:?}\n{err}");
    err
}
