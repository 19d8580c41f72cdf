//! `qemu-nbd` run side by side with our server (or as the server our image tools talk to), as
//! the oracle for protocol behaviour.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::{exit_within, nbd_unix_uri, qemu, wait_until};

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
        Self::unix_by(qemu("qemu-nbd"), args, image)
    }

    /// [`QemuNbd::unix`] with `program` in qemu-nbd's place: our binary run as `qemu-nbd`
    /// (a link of that name), to compare with the real one.
    pub fn unix_by(mut program: std::process::Command, args: &[&str], image: &Path) -> QemuNbd {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("qemu-nbd.sock");
        let mut child = program
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
        wait_until(
            Duration::from_secs(30),
            format!("qemu-nbd {args:?} listens"),
            || {
                if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                    return true;
                }
                if let Some(status) = child.try_wait().unwrap() {
                    let mut err = String::new();
                    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                    panic!("qemu-nbd {args:?} exited with {status}:\n{err}");
                }
                false
            },
        );
        QemuNbd {
            child,
            _dir: dir,
            socket,
        }
    }

    /// Stops it as an operator would (SIGTERM) and waits, so that it closes the image
    /// cleanly (storing its bitmaps), unlike the kill on drop.
    pub fn stop(mut self) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill only sends a signal to our own child process.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "kill({pid})");
        let status = exit_within(&mut self.child, Duration::from_secs(30));
        assert!(status.is_some(), "qemu-nbd did not stop on SIGTERM");
    }

    /// [`QemuNbd::stop`], returning what qemu-nbd wrote on stderr.
    pub fn stop_stderr(mut self) -> String {
        let mut stderr = self.child.stderr.take().expect("stderr piped");
        self.stop();
        let mut err = String::new();
        stderr.read_to_string(&mut err).unwrap();
        err
    }

    /// Its socket's path as text.
    pub fn path(&self) -> &str {
        self.socket.to_str().expect("temporary paths are UTF-8")
    }

    /// URI of a named export.
    pub fn uri_of(&self, export: &str) -> String {
        nbd_unix_uri(&self.socket, export)
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
