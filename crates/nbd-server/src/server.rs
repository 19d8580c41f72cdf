//! The accept loop: Unix, TCP and socket-activated listeners, named exports, `persistent`
//! and connection-limit semantics like qemu-nbd's `-t` and `-e`, and graceful shutdown.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::{JoinSet, LocalSet};

use nbd_proto::errno::Errno;

use crate::accept::{handle, Accepted, Handled};
use crate::control::Control;
use crate::export::Export;
use crate::exports::{ExportEntry, Exports, ExportsError};
use crate::remote::SendBuf;
use crate::systemd::ActivatedSocket;
use crate::tls::TlsServer;
use crate::workers::{Setup, Start, Workers};

/// Server behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Keep serving after the last client leaves (qemu-nbd `-t`); otherwise stop once a
    /// client that reached transmission has left and no connection remains. Clients that
    /// only list exports, abort, fail or time out in the handshake never end the server.
    pub persistent: bool,
    /// Most clients in transmission at once (qemu-nbd `-e`); a further client that finishes
    /// its handshake waits until one leaves. `None` means unlimited.
    pub max_connections: Option<NonZeroUsize>,
    /// Most connections open at once, those still negotiating included. When full, a new
    /// connection replaces the oldest one still negotiating; if every connection is in
    /// transmission, new ones wait in the listen backlog.
    pub max_open: NonZeroUsize,
    /// Close a client in transmission that sent no request for this long.
    pub idle_timeout: Option<Duration>,
    /// Most bytes of payloads and replies one connection may have in flight.
    pub connection_memory: usize,
    /// Probe idle TCP clients after this long without traffic, so dead peers are noticed.
    pub tcp_keepalive: Option<Duration>,
    /// Time a client has to finish the handshake (qemu-nbd `--handshake-limit`).
    pub handshake_timeout: Option<Duration>,
    /// How long a shutdown waits for requests in flight before closing every connection,
    /// including clients stalled in the middle of a request or not reading replies.
    pub shutdown_grace: Duration,
}

/// The default of [`ServerConfig::max_open`].
pub const DEFAULT_MAX_OPEN: NonZeroUsize = NonZeroUsize::new(100).expect("non-zero");

/// The default of [`ServerConfig::tcp_keepalive`].
pub const DEFAULT_TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// The default of [`ServerConfig::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

impl Default for ServerConfig {
    /// qemu-nbd's defaults: one client, not persistent, 10 s handshake limit.
    fn default() -> Self {
        Self {
            persistent: false,
            max_connections: NonZeroUsize::new(1),
            handshake_timeout: Some(Duration::from_secs(10)),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            max_open: DEFAULT_MAX_OPEN,
            idle_timeout: None,
            connection_memory: crate::transmission::MAX_IN_FLIGHT_BYTES,
            tcp_keepalive: Some(DEFAULT_TCP_KEEPALIVE),
        }
    }
}

/// A socket the server accepts clients on.
#[derive(Debug)]
pub enum Listener {
    /// A Unix socket; `path` is removed when the listener is dropped if we created it.
    Unix {
        /// The socket.
        listener: UnixListener,
        /// Path to unlink on drop.
        path: Option<PathBuf>,
    },
    /// A TCP socket.
    Tcp(TcpListener),
}

impl Listener {
    /// Binds a Unix socket at `path` (must be called inside a tokio runtime). A stale
    /// socket file left by a dead server (nobody accepts on it) is replaced; a live one is
    /// an `AddrInUse` error.
    pub fn bind_unix(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let path = path.as_ref();
        let listener = match UnixListener::bind(path) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && is_stale_socket(path) => {
                std::fs::remove_file(path)?;
                UnixListener::bind(path)?
            }
            other => other?,
        };
        Ok(Self::Unix {
            listener,
            path: Some(path.to_owned()),
        })
    }

    /// Binds a TCP socket (port 0 picks a free port; see [`Listener::local_tcp_addr`]).
    pub async fn bind_tcp(addr: SocketAddr) -> std::io::Result<Self> {
        Ok(Self::Tcp(TcpListener::bind(addr).await?))
    }

    /// Wraps a socket-activated listener (must be called inside a tokio runtime).
    pub fn from_activated(socket: ActivatedSocket) -> std::io::Result<Self> {
        Ok(match socket {
            ActivatedSocket::Unix(l) => Self::Unix {
                listener: UnixListener::from_std(l)?,
                path: None,
            },
            ActivatedSocket::Tcp(l) => Self::Tcp(TcpListener::from_std(l)?),
        })
    }

    /// The bound TCP address, for TCP listeners.
    pub fn local_tcp_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(l) => l.local_addr().ok(),
            Self::Unix { .. } => None,
        }
    }

    fn poll_accept(&self, cx: &mut std::task::Context<'_>) -> Poll<std::io::Result<Accepted>> {
        match self {
            Self::Unix { listener, .. } => {
                listener.poll_accept(cx).map_ok(|(s, _)| Accepted::Unix(s))
            }
            Self::Tcp(l) => l.poll_accept(cx).map_ok(|(s, peer)| Accepted::Tcp(s, peer)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix { path: Some(p), .. } = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// True if `path` is a socket file nobody listens on.
fn is_stale_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    is_socket
        && matches!(
            std::os::unix::net::UnixStream::connect(path),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The exports cannot be served.
    #[error(transparent)]
    Exports(#[from] ExportsError),
    /// No listener was given.
    #[error("no listening socket")]
    NoListener,
    /// A worker thread could not be started.
    #[error("cannot start a worker thread: {0}")]
    Thread(std::io::Error),
    /// The final flush of an export failed.
    #[error("flushing export {name:?} at shutdown failed: {errno}")]
    Flush {
        /// Export concerned.
        name: String,
        /// Its error.
        errno: Errno,
    },
}

/// What happened while serving.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServeReport {
    /// Clients accepted.
    pub connections: u64,
    /// Clients whose connection ended with an error (protocol violation, I/O failure).
    pub failed_connections: u64,
    /// Serving stopped because of the shutdown signal (rather than the last client leaving).
    pub shut_down: bool,
}

/// An NBD server for a set of exports.
pub struct Server<E> {
    exports: Exports<E>,
    config: ServerConfig,
    tls: Option<Arc<TlsServer>>,
    threads: usize,
    start_workers: Option<Start<E>>,
}

impl<E: Export + 'static> Server<E> {
    /// Validates the exports.
    pub fn new(exports: Vec<ExportEntry<E>>, config: ServerConfig) -> Result<Self, ServerError> {
        Ok(Self::from_exports(Exports::new(exports)?, config))
    }

    /// Serves a set of exports its owner may change while the server runs (see
    /// [`Exports`]): connections see exports added or closed from their next option on.
    pub fn from_exports(exports: Exports<E>, config: ServerConfig) -> Self {
        Self {
            exports,
            config,
            tls: None,
            threads: 1,
            start_workers: None,
        }
    }

    /// The set of exports served: a handle sharing it.
    pub fn exports(&self) -> Exports<E> {
        self.exports.clone()
    }

    /// Requires every client to start TLS with these credentials before anything else
    /// (like qemu-nbd with `--tls-creds`).
    pub fn with_tls(mut self, tls: TlsServer) -> Self {
        self.tls = Some(Arc::new(tls));
        self
    }

    /// Accepts clients on `listeners` until `shutdown` completes (or, without
    /// `persistent`, until the clients are gone). On shutdown it stops accepting, lets
    /// in-flight requests finish, flushes every export and returns.
    ///
    /// Runs its connections on a `LocalSet` of its own, so it works on a current-thread
    /// runtime with or without an enclosing `LocalSet`.
    pub async fn serve(
        self,
        listeners: Vec<Listener>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ServeReport, ServerError> {
        self.serve_until(listeners, shutdown, std::future::pending())
            .await
    }

    /// [`Server::serve`], with `force` ending the grace period early: once it completes
    /// (before or during the shutdown), the remaining connections are closed at once
    /// instead of after [`ServerConfig::shutdown_grace`]. The exports are flushed either way.
    pub async fn serve_until(
        self,
        listeners: Vec<Listener>,
        shutdown: impl Future<Output = ()>,
        force: impl Future<Output = ()>,
    ) -> Result<ServeReport, ServerError> {
        if listeners.is_empty() {
            return Err(ServerError::NoListener);
        }
        let local = LocalSet::new();
        local.run_until(self.run(listeners, shutdown, force)).await
    }

    async fn run(
        mut self,
        listeners: Vec<Listener>,
        shutdown: impl Future<Output = ()>,
        force: impl Future<Output = ()>,
    ) -> Result<ServeReport, ServerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (force_tx, force_rx) = watch::channel(false);
        let slots = self
            .config
            .max_connections
            .map(|n| Arc::new(Semaphore::new(n.get())));
        let mut report = ServeReport::default();
        let mut clients: JoinSet<Handled> = JoinSet::new();
        let mut handshakes = Handshakes::default();
        let mut transmitted = false;
        let setup = Setup {
            keepalive: self.config.tcp_keepalive,
            tls: self.tls.clone(),
        };
        let mut workers = match self.start_workers.take() {
            Some(start) => {
                Some(start(&self.exports, self.threads, &setup).map_err(ServerError::Thread)?)
            }
            None => None,
        };
        tokio::pin!(shutdown);
        loop {
            handshakes.forget_finished();
            let full = clients.len() >= self.config.max_open.get();
            let room = !full || handshakes.any();
            tokio::select! {
                () = &mut shutdown => {
                    report.shut_down = true;
                    break;
                }
                accepted = accept_any(&listeners), if room => match accepted {
                    Ok(stream) => {
                        if full {
                            handshakes.evict_oldest(self.config.max_open);
                        }
                        report.connections += 1;
                        let mut control = Control::new(stop_rx.clone(), force_rx.clone());
                        control.handshake_timeout = self.config.handshake_timeout;
                        control.idle_timeout = self.config.idle_timeout;
                        control.slots = slots.clone();
                        control.memory = self.config.connection_memory;
                        handshakes.track(&control);
                        match workers.as_mut().and_then(|w| w.pick().map(|i| (w, i))) {
                            Some((w, index)) => {
                                let done = w.send(index, stream, control);
                                clients.spawn_local(async move {
                                    done.await.unwrap_or(Handled { ok: false, transmitted: false })
                                });
                            }
                            None => {
                                let exports = self.exports.clone();
                                let setup = setup.clone();
                                clients.spawn_local(handle(stream, exports, control, setup.keepalive, setup.tls));
                            }
                        }
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(done) = clients.join_next(), if !clients.is_empty() => {
                    let handled = done.unwrap_or(Handled { ok: false, transmitted: false });
                    if !handled.ok {
                        report.failed_connections += 1;
                    }
                    transmitted |= handled.transmitted;
                    if !self.config.persistent && transmitted && clients.is_empty() {
                        break;
                    }
                }
            }
        }
        drop(listeners);
        self.drain(&mut clients, &stop_tx, &force_tx, force, &mut report)
            .await;
        if let Some(workers) = workers {
            workers.finish(&self.exports).await;
        }
        self.flush_exports().await?;
        Ok(report)
    }

    /// Tells every connection to stop, then waits for them to end: for the grace period,
    /// or until `force`, after which the remaining ones are closed at once.
    async fn drain(
        &self,
        clients: &mut JoinSet<Handled>,
        stop_tx: &watch::Sender<bool>,
        force_tx: &watch::Sender<bool>,
        force: impl Future<Output = ()>,
        report: &mut ServeReport,
    ) {
        let _ = stop_tx.send(true);
        let grace = tokio::time::sleep(self.config.shutdown_grace);
        tokio::pin!(grace);
        tokio::pin!(force);
        loop {
            let why = tokio::select! {
                done = clients.join_next() => Ok(done),
                () = &mut grace, if !*force_tx.borrow() => Err("shutdown grace period over"),
                () = &mut force, if !*force_tx.borrow() => Err("forced shutdown"),
            };
            let done = match why {
                Ok(done) => done,
                Err(why) => {
                    if !clients.is_empty() {
                        tracing::warn!(
                            clients = clients.len(),
                            "{why}: closing the remaining connections now"
                        );
                    }
                    let _ = force_tx.send(true);
                    continue;
                }
            };
            let Some(done) = done else { break };
            if !matches!(done, Ok(Handled { ok: true, .. })) {
                report.failed_connections += 1;
            }
        }
    }

    /// Flushes every export still offered.
    async fn flush_exports(&self) -> Result<(), ServerError> {
        // Exports being closed are flushed and closed by whoever closed them, once their
        // last client is gone (which the end of every connection above ensured).
        for entry in self.exports.entries() {
            entry
                .export
                .flush()
                .await
                .map_err(|errno| ServerError::Flush {
                    name: entry.name.clone(),
                    errno,
                })?;
        }
        Ok(())
    }
}

impl<E> Server<E>
where
    E: Export + 'static,
    E::Buf: SendBuf,
{
    /// Spreads connections over `threads` threads, this one included: round robin, each
    /// connection staying on its thread for life. The exports stay on this thread, which
    /// runs every request; the others do the connections' socket and TLS work and pass
    /// requests to it. One thread (the default) serves everything here, as qemu-nbd does.
    pub fn with_threads(mut self, threads: NonZeroUsize) -> Self {
        self.threads = threads.get();
        self.start_workers = (threads.get() > 1).then_some(Workers::start::<E> as Start<E>);
        self
    }
}

/// The connections still negotiating, oldest first: the ones to drop when the server is
/// full, so idle or slow handshakes can never keep a real client out.
#[derive(Default)]
struct Handshakes {
    open: VecDeque<(Arc<AtomicBool>, Arc<Notify>)>,
    evicted: u64,
}

impl Handshakes {
    fn track(&mut self, control: &Control) {
        self.open
            .push_back((Arc::clone(&control.negotiating), Arc::clone(&control.evict)));
    }

    /// Drops entries whose connection finished its handshake or ended (only we hold their
    /// flag then).
    fn forget_finished(&mut self) {
        self.open.retain(|(negotiating, _)| {
            negotiating.load(Ordering::Acquire) && Arc::strong_count(negotiating) > 1
        });
    }

    fn any(&self) -> bool {
        !self.open.is_empty()
    }

    /// Ends the oldest handshake to make room. Said once as a warning (a flood would
    /// otherwise fill the log, and a log nobody drains would stall the server), then at
    /// debug level.
    fn evict_oldest(&mut self, limit: NonZeroUsize) {
        if let Some((_, evict)) = self.open.pop_front() {
            evict.notify_one();
            self.evicted += 1;
            if self.evicted == 1 {
                tracing::warn!(
                    limit,
                    "connection limit reached: dropping the oldest client still negotiating"
                );
            } else {
                tracing::debug!(evicted = self.evicted, "dropped a client still negotiating");
            }
        }
    }
}

async fn accept_any(listeners: &[Listener]) -> std::io::Result<Accepted> {
    std::future::poll_fn(|cx| {
        for l in listeners {
            if let Poll::Ready(r) = l.poll_accept(cx) {
                return Poll::Ready(r);
            }
        }
        Poll::Pending
    })
    .await
}

/// Completes on SIGINT or SIGTERM: the conventional shutdown signal for `serve`.
pub async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn binding_replaces_a_stale_socket_but_not_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        // A socket file whose server is gone.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let live = Listener::bind_unix(&path).expect("stale socket replaced");
        let again = Listener::bind_unix(&path);
        assert_eq!(again.unwrap_err().kind(), std::io::ErrorKind::AddrInUse);
        drop(live);
        assert!(
            !path.exists(),
            "our socket file is removed with the listener"
        );
        // A regular file is never removed.
        std::fs::write(&path, b"data").unwrap();
        assert!(Listener::bind_unix(&path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }
}
