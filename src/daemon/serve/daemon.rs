//! `--fork` and `--pid-file`: the parent returns only once the server listens (so a script
//! can connect right after), and the pid file appears only then too.
//!
//! The fork happens before the async runtime exists: a process that forks after starting
//! threads keeps only the forking thread, which would leave a runtime without its workers.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The child's side of `--fork`: tells the waiting parent that the server is ready.
#[derive(Debug)]
pub struct Readiness {
    pipe: File,
}

impl Readiness {
    /// Releases the parent with success, then detaches from its standard streams so that a
    /// caller reading the parent's output sees end-of-file (stderr stays with `keep_stderr`,
    /// for `-v`).
    pub fn notify(mut self, keep_stderr: bool) -> io::Result<()> {
        self.pipe.write_all(b"1")?;
        drop(self.pipe);
        let null = File::options().read(true).write(true).open("/dev/null")?;
        let mut targets = vec![libc::STDIN_FILENO, libc::STDOUT_FILENO];
        if !keep_stderr {
            targets.push(libc::STDERR_FILENO);
        }
        for fd in targets {
            // SAFETY: dup2 onto a standard descriptor number only replaces what that number
            // refers to; `null` stays open for the duration of the call.
            if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Forks. In the parent this never returns: it waits until the child reports readiness
/// (exit 0) or dies first (exit with the child's status, 1 if it was killed). In the child
/// it returns the handle to report readiness with, in a new session so that signals for
/// the caller's terminal do not reach the server.
///
/// Must be called while the process has a single thread.
pub fn fork_and_wait() -> io::Result<Readiness> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nothing else.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the caller guarantees the process is single-threaded, so the child gets a
    // consistent copy of every lock and allocator state.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        drop(read_end);
        // SAFETY: setsid has no memory effects; it fails only if we already lead a group.
        unsafe { libc::setsid() };
        return Ok(Readiness {
            pipe: File::from(write_end),
        });
    }
    drop(write_end);
    let mut byte = [0u8; 1];
    let ready = matches!(File::from(read_end).read(&mut byte), Ok(1) if byte[0] == b'1');
    if ready {
        std::process::exit(0);
    }
    // The child failed before listening (it printed why); pass its status on.
    let mut status: libc::c_int = 0;
    // SAFETY: waiting for our own child; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    let code = if waited == pid && libc::WIFEXITED(status) {
        match libc::WEXITSTATUS(status) {
            0 => 1,
            c => c,
        }
    } else {
        1
    };
    std::process::exit(code);
}

/// A pid file written once the server listens, removed when the server exits cleanly.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
    contents: String,
    /// Leave the file when the server ends, as qemu-nbd leaves its own (scripts written
    /// for qemu-nbd read it after the server stopped, and remove it themselves).
    keep: bool,
}

impl PidFile {
    /// Writes this process's id to `path` (atomically: a reader sees all of it or nothing).
    /// The file is removed when the server ends, unless `keep`.
    pub fn write(path: &Path, keep: bool) -> io::Result<PidFile> {
        let contents = format!("{}\n", std::process::id());
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, &contents)?;
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(PidFile {
            path: path.to_owned(),
            contents,
            keep,
        })
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        // Only our own: another server may have taken the path over since.
        if !self.keep && std::fs::read_to_string(&self.path).is_ok_and(|c| c == self.contents) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pid_file_holds_our_pid_and_is_removed_only_if_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.pid");
        let pid = PidFile::write(&path, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", std::process::id())
        );
        drop(pid);
        assert!(!path.exists());
        let pid = PidFile::write(&path, false).unwrap();
        std::fs::write(&path, "12345\n").unwrap();
        drop(pid);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "12345\n");
    }

    #[test]
    fn a_kept_pid_file_outlives_the_server_as_qemu_nbds_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kept.pid");
        drop(PidFile::write(&path, true).unwrap());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", std::process::id())
        );
    }
}
