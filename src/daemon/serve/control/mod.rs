//! `serve --control PATH`: a QMP-style control socket to add, delete and inspect exports
//! while the server runs.
//!
//! Files: `qmp` (framing, greeting, replies, events: pure), `args` (a command's arguments
//! and the checks every handler shares), `commands` (one handler per command, and the
//! command table), `dispatch` (capabilities negotiation, then the handler by name), `error`
//! (setting the socket up). The exports themselves are the [`Registry`]'s.
//!
//! Bounds: at most `--control-clients` sessions at once (a further one is told so and
//! closed), a command of at most `--control-max-command` bytes (a longer one is answered
//! with an error and its session closed), and a reply or event that the client does not
//! take within [`WRITE_TIMEOUT`] ends its session. Sessions share the server's thread but
//! never block it: every command is either immediate or awaits I/O.

pub mod args;
pub mod commands;
pub mod dispatch;
pub mod error;
pub mod qmp;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{broadcast, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::registry::Registry;
use dispatch::Phase;
pub use error::ControlError;
use qmp::{Frame, Framer, QmpError};

/// Default of `--control-max-command`.
pub const DEFAULT_MAX_COMMAND: usize = 64 * 1024;

/// How long a client may leave a reply or event unread before its session is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits of the control socket.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Sessions at once.
    pub clients: usize,
    /// Bytes of one command.
    pub max_command: usize,
}

/// A bound control socket; the file goes when it is dropped.
pub struct ControlSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Binds the control socket at `path`, owner-only from the start: the file is created
/// under a umask that leaves no access to others (then set to 0600 explicitly). A socket
/// file nobody listens on is replaced; any other file is refused.
pub fn bind(path: &Path) -> Result<ControlSocket, ControlError> {
    let err = |source| ControlError::Bind {
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ControlError::NotASocket(path.to_owned()));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(err)?;
            }
            _ => return Err(err(std::io::ErrorKind::AddrInUse.into())),
        }
    }
    // SAFETY: umask only swaps the process's file mode mask; the old one is restored
    // right after the bind.
    let old = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above, restoring the mask read before.
    unsafe { libc::umask(old) };
    let std_listener = bound.map_err(err)?;
    let socket = ControlSocket {
        listener: {
            std_listener.set_nonblocking(true).map_err(err)?;
            UnixListener::from_std(std_listener).map_err(err)?
        },
        path: path.to_owned(),
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(socket)
}

/// The running control server: [`Control::stop`] ends it.
pub struct Control {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Control {
    /// Serves `socket` on the current `LocalSet`.
    pub fn start(socket: ControlSocket, registry: Registry, limits: Limits) -> Control {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::task::spawn_local(accept_loop(socket, registry, limits, stopped));
        Control { stop, task }
    }

    /// Stops accepting, lets commands in progress finish (a session waiting for input is
    /// closed) and removes the socket file.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "the control socket task failed");
        }
    }
}

async fn accept_loop(
    socket: ControlSocket,
    registry: Registry,
    limits: Limits,
    mut stopped: watch::Receiver<bool>,
) {
    let mut sessions = JoinSet::new();
    let for_sessions = stopped.clone();
    loop {
        tokio::select! {
            // Finished sessions first, so their places are free for the next client.
            biased;
            Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
            _ = stopped.wait_for(|s| *s) => break,
            accepted = socket.listener.accept() => match accepted {
                Ok((stream, _)) if sessions.len() >= limits.clients => refuse(&stream, limits.clients),
                Ok((stream, _)) => {
                    let session = session(stream, registry.clone(), limits.max_command, for_sessions.clone());
                    sessions.spawn_local(session);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    drop(socket);
    while sessions.join_next().await.is_some() {}
}

/// Tells a client beyond the limit why it is closed, without waiting for it.
fn refuse(stream: &UnixStream, limit: usize) {
    let error = qmp::reply(
        Err(QmpError::generic(format!(
            "too many control connections: at most {limit} at once"
        ))),
        None,
    );
    let _ = stream.try_write(&qmp::line(&error));
}

/// The session ends: the client cannot be written to, or broke a bound.
struct Closed;

/// One control client: greeting, then commands until it leaves or the server stops.
async fn session(
    mut stream: UnixStream,
    registry: Registry,
    max_command: usize,
    mut stopped: watch::Receiver<bool>,
) {
    let mut events = registry.subscribe();
    let mut framer = Framer::new(max_command);
    let mut phase = Phase::Negotiating;
    let mut chunk = vec![0u8; 8192];
    if send(&mut stream, &qmp::greeting()).await.is_err() {
        return;
    }
    loop {
        if run_frames(&mut stream, &registry, &mut framer, &mut phase)
            .await
            .is_err()
        {
            return;
        }
        tokio::select! {
            read = stream.read(&mut chunk) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => framer.push(&chunk[..n]),
            },
            event = events.recv(), if phase == Phase::Ready => {
                if forward_event(&mut stream, event).await.is_err() {
                    return;
                }
            }
            _ = stopped.wait_for(|s| *s) => return,
        }
    }
}

/// Answers every complete request the framer holds.
async fn run_frames(
    stream: &mut UnixStream,
    registry: &Registry,
    framer: &mut Framer,
    phase: &mut Phase,
) -> Result<(), Closed> {
    while let Some(frame) = framer.next_frame() {
        let answer = match frame {
            Frame::Value(input) => match qmp::parse_request(input) {
                Ok(request) => {
                    let id = request.id.clone();
                    let (outcome, next) = dispatch::dispatch(registry, *phase, request).await;
                    *phase = next;
                    qmp::reply(outcome, id)
                }
                Err((e, id)) => qmp::reply(Err(e), id),
            },
            Frame::Bad(desc) => qmp::reply(Err(QmpError::generic(desc)), None),
            Frame::TooLarge => {
                let desc = format!("command too long: more than {} bytes", framer.limit());
                let _ = send(stream, &qmp::reply(Err(QmpError::generic(desc)), None)).await;
                return Err(Closed);
            }
        };
        send(stream, &answer).await?;
    }
    Ok(())
}

async fn forward_event(
    stream: &mut UnixStream,
    event: Result<String, broadcast::error::RecvError>,
) -> Result<(), Closed> {
    match event {
        Ok(text) => write_bounded(stream, text.as_bytes()).await,
        Err(broadcast::error::RecvError::Lagged(n)) => {
            tracing::warn!(missed = n, "a control client reads events too slowly");
            Ok(())
        }
        Err(broadcast::error::RecvError::Closed) => Err(Closed),
    }
}

async fn send(stream: &mut UnixStream, message: &Value) -> Result<(), Closed> {
    write_bounded(stream, &qmp::line(message)).await
}

async fn write_bounded(stream: &mut UnixStream, bytes: &[u8]) -> Result<(), Closed> {
    match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(bytes)).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Closed),
    }
}
