//! `qemu-nbd` run side by side with our server, as the oracle for protocol behaviour.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use test_support::qemu;

/// A running `qemu-nbd -t -k SOCKET ARGS... IMAGE`, killed when dropped.
pub struct QemuNbd {
    child: Child,
    _dir: tempfile::TempDir,
    /// Its Unix socket.
    pub socket: PathBuf,
}

impl QemuNbd {
    /// Starts qemu-nbd on a fresh Unix socket and waits until it accepts connections. The
    /// deadline only keeps a broken qemu-nbd from hanging the test.
    pub fn unix(args: &[&str], image: &Path) -> QemuNbd {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("qemu-nbd.sock");
        let mut child = qemu("qemu-nbd")
            .arg("-t")
            .arg("-k")
            .arg(&socket)
            .args(args)
            .arg(image)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start qemu-nbd");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                let out = child.wait_with_output().unwrap();
                panic!(
                    "qemu-nbd {args:?} exited with {status}:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                Instant::now() < deadline,
                "qemu-nbd {args:?} did not listen"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        QemuNbd {
            child,
            _dir: dir,
            socket,
        }
    }

    /// URI of a named export.
    pub fn uri_of(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
