//! One client connection over any async byte stream: handshake, then transmission.

use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::watch;
use tokio_openssl::SslStream;

use crate::control::Control;
use crate::export::Export;
use crate::exports::Exports;
use crate::negotiate::{negotiate, negotiate_options, HandshakeEnd, HandshakeError, Negotiated};
use crate::tls::{HandshakeFailure, QuietAlerts, TlsServer};
use crate::transmission::{transmit, TransmissionEnd, TransmissionError};

/// Read buffer of a connection: large enough for a header and a 4 KiB write in one read,
/// small enough that bigger payloads bypass it and land directly in export buffers.
const READ_BUFFER: usize = 64 * 1024;

/// How a connection ended without error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// The client left during the handshake (`OPT_ABORT`, or closing the socket).
    LeftDuringHandshake,
    /// The client hung up between options without NBD_OPT_ABORT; `tls` if inside TLS.
    HungUpDuringHandshake {
        /// The connection had gone over to TLS.
        tls: bool,
    },
    /// The server shut down during the handshake.
    ShutdownDuringHandshake,
    /// Still negotiating when the server needed room for a newer client.
    Evicted,
    /// Transmission ran with these parameters and ended this way.
    Transmission(Negotiated, TransmissionEnd),
}

/// Why a connection ended abruptly (it is closed; the server and other clients go on).
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// The handshake failed.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// The handshake took longer than allowed.
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    /// The TLS handshake failed.
    #[error(transparent)]
    Tls(HandshakeFailure),
    /// Transmission failed.
    #[error(transparent)]
    Transmission(#[from] TransmissionError),
}

impl ConnectionError {
    /// True when the connection failed after the handshake, in transmission.
    pub fn reached_transmission(&self) -> bool {
        matches!(self, ConnectionError::Transmission(_))
    }
}

/// How long a client access control turned away may take to hang up once told.
const AUTHZ_DRAIN: Duration = Duration::from_secs(1);

/// A client's socket: split in halves for the plaintext phases, whole again when TLS
/// starts.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Sized + 'static {
    /// The read half.
    type Read: AsyncRead + Unpin + 'static;
    /// The write half.
    type Write: AsyncWrite + Unpin + 'static;
    /// Splits the socket.
    fn split(self) -> (Self::Read, Self::Write);
    /// Joins halves split from one socket (`None` if they were not).
    fn join(read: Self::Read, write: Self::Write) -> Option<Self>;
}

impl Transport for UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn join(read: Self::Read, write: Self::Write) -> Option<Self> {
        read.reunite(write).ok()
    }
}

impl Transport for TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn join(read: Self::Read, write: Self::Write) -> Option<Self> {
        read.reunite(write).ok()
    }
}

/// Serves one client on `stream`, through TLS if `tls` is given (then the client must
/// start TLS before anything else), until it leaves, the server shuts down, or it breaks
/// the protocol.
pub async fn serve_client<T, E>(
    stream: T,
    exports: &Exports<E>,
    control: Control,
    tls: Option<&TlsServer>,
) -> Result<ConnectionEnd, ConnectionError>
where
    T: Transport,
    E: Export + 'static,
{
    let (reader, writer) = stream.split();
    let Some(tls) = tls else {
        return serve_connection(reader, writer, exports, control).await;
    };
    let upgrade = upgrade::<T, E>(reader, writer, exports, tls);
    match guarded(&control, upgrade).await? {
        Guarded::Ended(end) | Guarded::Done(Upgrade::Ended(end)) => Ok(end),
        Guarded::Done(Upgrade::Secure(reader, writer, end)) => {
            finish(reader, writer, exports, control, end, true).await
        }
    }
}

/// Serves one plaintext client on `reader`/`writer` (e.g. the halves of a socket) until it
/// leaves, the server shuts down, or it breaks the protocol; `control` says how (see
/// [`Control`]).
///
/// Must run inside a tokio `LocalSet` (requests run as `spawn_local` tasks);
/// [`crate::Server::serve`] provides one.
pub async fn serve_connection<R, W, E>(
    reader: R,
    mut writer: W,
    exports: &Exports<E>,
    control: Control,
) -> Result<ConnectionEnd, ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + 'static,
    E: Export + 'static,
{
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let handshake = async {
        negotiate(&mut reader, &mut writer, exports, false)
            .await
            .map_err(ConnectionError::from)
    };
    let end = match guarded(&control, handshake).await? {
        Guarded::Done(end) => end,
        Guarded::Ended(end) => return Ok(end),
    };
    finish(reader, writer, exports, control, end, false).await
}

/// How a guarded handshake step came out.
enum Guarded<T> {
    /// It completed.
    Done(T),
    /// The connection ended first (shutdown, eviction).
    Ended(ConnectionEnd),
}

/// Runs a handshake step within the handshake time limit, ending it early if the server
/// shuts down or needs the room.
async fn guarded<T>(
    control: &Control,
    step: impl Future<Output = Result<T, ConnectionError>>,
) -> Result<Guarded<T>, ConnectionError> {
    let bounded = async {
        match control.handshake_timeout {
            Some(limit) => tokio::time::timeout(limit, step)
                .await
                .map_err(|_| ConnectionError::HandshakeTimeout(limit))?,
            None => step.await,
        }
    };
    let mut shutdown = control.shutdown.clone();
    tokio::select! {
        done = bounded => done.map(Guarded::Done),
        _ = shutdown.wait_for(|down| *down) => Ok(Guarded::Ended(ConnectionEnd::ShutdownDuringHandshake)),
        () = control.evict.notified() => Ok(Guarded::Ended(ConnectionEnd::Evicted)),
    }
}

/// A connection after the plaintext phase of a TLS server.
enum Upgrade<T: Transport> {
    /// It ended before TLS started.
    Ended(ConnectionEnd),
    /// TLS is up and the negotiation inside it ended this way.
    Secure(
        BufReader<ReadHalf<SslStream<QuietAlerts<T>>>>,
        WriteHalf<SslStream<QuietAlerts<T>>>,
        HandshakeEnd,
    ),
}

/// The plaintext phase (only STARTTLS is served), the TLS handshake, the access check and
/// the negotiation inside TLS.
async fn upgrade<T: Transport, E: Export>(
    reader: T::Read,
    mut writer: T::Write,
    exports: &Exports<E>,
    tls: &TlsServer,
) -> Result<Upgrade<T>, ConnectionError> {
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let mut state = match negotiate(&mut reader, &mut writer, exports, true).await? {
        HandshakeEnd::StartTls(state) => state,
        HandshakeEnd::ClientLeft => return Ok(Upgrade::Ended(ConnectionEnd::LeftDuringHandshake)),
        HandshakeEnd::HungUp => {
            return Ok(Upgrade::Ended(ConnectionEnd::HungUpDuringHandshake {
                tls: false,
            }))
        }
        HandshakeEnd::Transmission(..) => {
            return Err(HandshakeError::Refused("transmission without TLS".into()).into())
        }
    };
    // `negotiate` refused STARTTLS if bytes were buffered: none are lost here.
    let Some(stream) = T::join(reader.into_inner(), writer) else {
        return Err(HandshakeError::Refused("socket halves do not match".into()).into());
    };
    let (mut secure, peer) = tls.accept(stream).await.map_err(ConnectionError::Tls)?;
    state.tls_started();
    // As qemu-nbd, a client access control does not admit is dropped right after the
    // handshake, without a word: it sees the connection end when it reads a reply.
    if let Some(reason) = tls.refusal(&peer) {
        tracing::info!(?peer, "TLS client refused by authz");
        let raw = secure.get_mut().get_mut();
        // Closing with the client's first option still unread would reset the connection;
        // the client is to see it end (and say so), so this end is shut first and what the
        // client still sends is read and dropped, for a moment at most.
        let _ = tokio::io::AsyncWriteExt::shutdown(raw).await;
        let _ =
            tokio::time::timeout(AUTHZ_DRAIN, tokio::io::copy(raw, &mut tokio::io::sink())).await;
        return Err(ConnectionError::Tls(HandshakeFailure::Denied(reason)));
    }
    tracing::debug!(?peer, "TLS client");
    let (reader, mut writer) = tokio::io::split(secure);
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let end = negotiate_options(&mut reader, &mut writer, exports, state).await?;
    Ok(Upgrade::Secure(reader, writer, end))
}

/// After the handshake: transmission, or the reason there is none.
async fn finish<R, W, E>(
    reader: BufReader<R>,
    writer: W,
    exports: &Exports<E>,
    control: Control,
    end: HandshakeEnd,
    tls: bool,
) -> Result<ConnectionEnd, ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + 'static,
    E: Export + 'static,
{
    control
        .negotiating
        .store(false, std::sync::atomic::Ordering::Release);
    let (negotiated, _attached) = match end {
        HandshakeEnd::ClientLeft => return Ok(ConnectionEnd::LeftDuringHandshake),
        HandshakeEnd::HungUp => return Ok(ConnectionEnd::HungUpDuringHandshake { tls }),
        HandshakeEnd::Transmission(n, attached) => (n, attached),
        HandshakeEnd::StartTls(_) => {
            return Err(HandshakeError::Refused("STARTTLS on a server without TLS".into()).into())
        }
    };
    let Some(entry) = exports.get(negotiated.export) else {
        return Err(HandshakeError::Refused("negotiated export does not exist".into()).into());
    };
    // Like a second qemu-nbd client beyond -e, this one waits until a client leaves.
    let mut shutdown = control.shutdown.clone();
    let mut hard = entry.state().hard_close();
    let _slot = match &control.slots {
        Some(slots) => tokio::select! {
            slot = slots.acquire() => slot.ok(),
            _ = shutdown.wait_for(|down| *down) => return Ok(ConnectionEnd::ShutdownDuringHandshake),
            _ = hard.wait_for(|h| *h) => return Ok(ConnectionEnd::ShutdownDuringHandshake),
        },
        None => None,
    };
    tracing::debug!(export = %entry.name, mode = ?negotiated.mode, "transmission");
    let export = Rc::clone(&entry.export);
    export.client_attached();
    let (linked, senders) = linked_control(&control);
    let forward = forward_stops(&control, entry.state().hard_close(), senders);
    let end = tokio::select! {
        end = transmit(reader, writer, export, &negotiated, &linked) => end?,
        never = forward => match never {},
    };
    Ok(ConnectionEnd::Transmission(negotiated, end))
}

/// A copy of `control` whose shutdown and forced-close signals are this connection's own,
/// so that closing its export can end it without ending the server (see [`forward_stops`]).
fn linked_control(control: &Control) -> (Control, (watch::Sender<bool>, watch::Sender<bool>)) {
    let (stop, stop_rx) = watch::channel(*control.shutdown.borrow());
    let (force, force_rx) = watch::channel(*control.force.borrow());
    let linked = Control {
        shutdown: stop_rx,
        force: force_rx,
        ..control.clone()
    };
    (linked, (stop, force))
}

/// Passes the server's shutdown and forced close on to a connection's own signals, and
/// turns both on when its export is closed hard: it stops reading requests, lets those in
/// flight finish and abandons replies it cannot send, as on a forced server shutdown.
/// Never completes: it runs beside the connection and ends with it.
async fn forward_stops(
    control: &Control,
    mut hard: watch::Receiver<bool>,
    (stop, force): (watch::Sender<bool>, watch::Sender<bool>),
) -> std::convert::Infallible {
    let (mut down, mut forced) = (control.shutdown.clone(), control.force.clone());
    let (mut down_open, mut forced_open, mut hard_open) = (true, true, true);
    loop {
        if *hard.borrow_and_update() {
            stop.send_replace(true);
            force.send_replace(true);
        }
        if *down.borrow_and_update() {
            stop.send_replace(true);
        }
        if *forced.borrow_and_update() {
            force.send_replace(true);
        }
        // A sender that is gone never signals again: stop watching it.
        tokio::select! {
            r = down.changed(), if down_open => down_open = r.is_ok(),
            r = forced.changed(), if forced_open => forced_open = r.is_ok(),
            r = hard.changed(), if hard_open => hard_open = r.is_ok(),
            () = std::future::pending::<()>(), if !(down_open || forced_open || hard_open) => {}
        }
    }
}
