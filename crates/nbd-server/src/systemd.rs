//! systemd socket activation: listening sockets passed as fds 3.. with `LISTEN_PID` and
//! `LISTEN_FDS`, which is also how libnbd's `nbdinfo -- [ server ]` starts a server.

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};

/// First fd systemd passes.
pub const LISTEN_FDS_START: RawFd = 3;
/// Most fds we accept from `LISTEN_FDS` (a sanity bound, far above any real use).
const MAX_LISTEN_FDS: u32 = 1024;

/// A listening socket received from the service manager.
#[derive(Debug)]
pub enum ActivatedSocket {
    /// A Unix stream socket.
    Unix(UnixListener),
    /// A TCP socket.
    Tcp(std::net::TcpListener),
}

/// Why the activation environment cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    /// `LISTEN_PID` or `LISTEN_FDS` is not a number.
    #[error("{var}={value:?} is not a valid number")]
    BadVariable {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// More fds than we are willing to take.
    #[error("LISTEN_FDS={0} is more sockets than supported ({MAX_LISTEN_FDS})")]
    TooMany(u32),
    /// A passed fd is not a stream socket we can listen on.
    #[error("fd {fd} from LISTEN_FDS is not a listening Unix or TCP socket: {reason}")]
    NotASocket {
        /// The fd.
        fd: RawFd,
        /// What is wrong.
        reason: String,
    },
    /// The sockets were already taken by an earlier call.
    #[error("socket activation fds were already taken")]
    AlreadyTaken,
}

/// How many activation fds the environment passes to process `my_pid`: `None` if the
/// variables are absent or meant for another process (`LISTEN_PID` differs).
pub fn parse_listen_env(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    my_pid: u32,
) -> Result<Option<u32>, SystemdError> {
    let (Some(pid), Some(fds)) = (listen_pid, listen_fds) else {
        return Ok(None);
    };
    let pid: u32 = pid.trim().parse().map_err(|_| SystemdError::BadVariable {
        var: "LISTEN_PID",
        value: pid.to_owned(),
    })?;
    if pid != my_pid {
        return Ok(None);
    }
    let count: u32 = fds.trim().parse().map_err(|_| SystemdError::BadVariable {
        var: "LISTEN_FDS",
        value: fds.to_owned(),
    })?;
    if count > MAX_LISTEN_FDS {
        return Err(SystemdError::TooMany(count));
    }
    Ok(Some(count))
}

static TAKEN: AtomicBool = AtomicBool::new(false);

/// Takes the listening sockets passed by socket activation, or an empty list if this
/// process was not socket-activated. The fds are owned from then on (and marked
/// close-on-exec); a second call fails with [`SystemdError::AlreadyTaken`].
pub fn listen_fds() -> Result<Vec<ActivatedSocket>, SystemdError> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let Some(count) = parse_listen_env(pid.as_deref(), fds.as_deref(), std::process::id())? else {
        return Ok(Vec::new());
    };
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(SystemdError::AlreadyTaken);
    }
    let mut out = Vec::new();
    for i in 0..count {
        let fd = LISTEN_FDS_START.saturating_add(RawFd::try_from(i).unwrap_or(RawFd::MAX));
        out.push(socket_from_fd(fd)?);
    }
    Ok(out)
}

/// Wraps one inherited fd after checking it is a listening stream socket.
fn socket_from_fd(fd: RawFd) -> Result<ActivatedSocket, SystemdError> {
    let not = |reason: String| SystemdError::NotASocket { fd, reason };
    let family = socket_family(fd).map_err(|e| not(e.to_string()))?;
    // SAFETY: fcntl on an fd number has no memory effects; an invalid fd just fails.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(not(std::io::Error::last_os_error().to_string()));
    }
    // SAFETY: as above; setting FD_CLOEXEC only changes the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(not(std::io::Error::last_os_error().to_string()));
    }
    let socket = match family {
        libc::AF_UNIX => {
            // SAFETY: the service manager passed this fd to us alone; `TAKEN` guarantees
            // it is wrapped once, so the listener is its sole owner.
            ActivatedSocket::Unix(unsafe { UnixListener::from_raw_fd(fd) })
        }
        libc::AF_INET | libc::AF_INET6 => {
            // SAFETY: as above, this fd is owned by nothing else in the process.
            ActivatedSocket::Tcp(unsafe { std::net::TcpListener::from_raw_fd(fd) })
        }
        other => return Err(not(format!("unsupported address family {other}"))),
    };
    let nonblocking = match &socket {
        ActivatedSocket::Unix(l) => l.set_nonblocking(true),
        ActivatedSocket::Tcp(l) => l.set_nonblocking(true),
    };
    nonblocking.map_err(|e| not(e.to_string()))?;
    Ok(socket)
}

fn socket_family(fd: RawFd) -> std::io::Result<libc::c_int> {
    // SAFETY: sockaddr_storage is plain old data; all-zero bytes are a valid value.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_storage>())
        .unwrap_or(libc::socklen_t::MAX);
    // SAFETY: `addr` is a writable sockaddr_storage and `len` holds its size, as
    // getsockname requires; the kernel writes at most `len` bytes.
    let rc = unsafe { libc::getsockname(fd, std::ptr::addr_of_mut!(addr).cast(), &mut len) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(libc::c_int::from(addr.ss_family))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_env_is_for_us_only_when_the_pid_matches() {
        assert_eq!(parse_listen_env(None, None, 42).unwrap(), None);
        assert_eq!(parse_listen_env(Some("42"), None, 42).unwrap(), None);
        assert_eq!(parse_listen_env(Some("41"), Some("1"), 42).unwrap(), None);
        assert_eq!(
            parse_listen_env(Some("42"), Some("2"), 42).unwrap(),
            Some(2)
        );
        assert_eq!(
            parse_listen_env(Some(" 42\n"), Some("0"), 42).unwrap(),
            Some(0)
        );
    }

    #[test]
    fn malformed_activation_env_is_an_error() {
        assert!(matches!(
            parse_listen_env(Some("x"), Some("1"), 42),
            Err(SystemdError::BadVariable {
                var: "LISTEN_PID",
                ..
            })
        ));
        assert!(matches!(
            parse_listen_env(Some("42"), Some("-1"), 42),
            Err(SystemdError::BadVariable {
                var: "LISTEN_FDS",
                ..
            })
        ));
        assert!(matches!(
            parse_listen_env(Some("42"), Some("100000"), 42),
            Err(SystemdError::TooMany(100000))
        ));
    }

    #[test]
    fn socket_family_tells_unix_from_tcp_and_rejects_non_sockets() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let unix = UnixListener::bind(dir.path().join("s")).unwrap();
        assert_eq!(socket_family(unix.as_raw_fd()).unwrap(), libc::AF_UNIX);
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(socket_family(tcp.as_raw_fd()).unwrap(), libc::AF_INET);
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(socket_family(file.as_raw_fd()).is_err());
    }
}
