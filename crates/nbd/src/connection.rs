//! One client connection over any async byte stream: handshake, then transmission.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::{watch, Notify, Semaphore};

use crate::export::Export;
use crate::exports::Exports;
use crate::negotiate::{negotiate, HandshakeEnd, HandshakeError, Negotiated};
use crate::transmission::{transmit, TransmissionEnd, TransmissionError};

/// Read buffer of a connection: large enough for a header and a 4 KiB write in one read,
/// small enough that bigger payloads bypass it and land directly in export buffers.
const READ_BUFFER: usize = 64 * 1024;

/// How a connection ended without error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionEnd {
    /// The client left during the handshake (`OPT_ABORT`, or closing the socket).
    LeftDuringHandshake,
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

/// What the server tells one connection, and the limits it applies to it.
#[derive(Debug, Clone)]
pub struct Control {
    /// Turns true on shutdown: stop reading requests, finish those in flight.
    pub shutdown: watch::Receiver<bool>,
    /// Turns true when the shutdown grace period is over: abandon every socket operation,
    /// so a client stalled mid-request or not reading replies cannot hold the server up.
    pub force: watch::Receiver<bool>,
    /// Time the client has to finish the handshake.
    pub handshake_timeout: Option<Duration>,
    /// Close a client in transmission that sent no request for this long (none in flight).
    pub idle_timeout: Option<Duration>,
    /// Notified to end this connection if it is still negotiating (the server makes room
    /// for a new client by dropping the oldest handshake).
    pub evict: Rc<Notify>,
    /// True while the handshake runs.
    pub negotiating: Rc<Cell<bool>>,
    /// Transmission slots (qemu-nbd's `-e`): a client that finished its handshake waits for
    /// one before its requests are read.
    pub slots: Option<Arc<Semaphore>>,
    /// Most bytes of payloads and replies this connection may have in flight.
    pub memory: usize,
}

impl Control {
    /// A connection that ends on `shutdown` (abandoning its socket on `force`), with no
    /// handshake or idle limit, never evicted, no slot limit, and the default memory bound.
    pub fn new(shutdown: watch::Receiver<bool>, force: watch::Receiver<bool>) -> Control {
        Control {
            shutdown,
            force,
            handshake_timeout: None,
            idle_timeout: None,
            evict: Rc::new(Notify::new()),
            negotiating: Rc::new(Cell::new(true)),
            slots: None,
            memory: crate::transmission::MAX_IN_FLIGHT_BYTES,
        }
    }
}

/// Serves one client on `reader`/`writer` (e.g. the halves of a socket) until it leaves,
/// the server shuts down, or it breaks the protocol; `control` says how (see [`Control`]).
///
/// Must run inside a tokio `LocalSet` (requests run as `spawn_local` tasks);
/// [`crate::Server::serve`] provides one.
pub async fn serve_connection<R, W, E>(
    reader: R,
    mut writer: W,
    exports: &Exports<E>,
    mut control: Control,
) -> Result<ConnectionEnd, ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + 'static,
    E: Export + 'static,
{
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let handshake = negotiate(&mut reader, &mut writer, exports);
    let bounded = async {
        match control.handshake_timeout {
            Some(limit) => tokio::time::timeout(limit, handshake)
                .await
                .map_err(|_| ConnectionError::HandshakeTimeout(limit))?
                .map_err(ConnectionError::from),
            None => handshake.await.map_err(ConnectionError::from),
        }
    };
    let evict = Rc::clone(&control.evict);
    let end = tokio::select! {
        end = bounded => end?,
        _ = control.shutdown.wait_for(|down| *down) => return Ok(ConnectionEnd::ShutdownDuringHandshake),
        () = evict.notified() => return Ok(ConnectionEnd::Evicted),
    };
    control.negotiating.set(false);
    let negotiated = match end {
        HandshakeEnd::ClientLeft => return Ok(ConnectionEnd::LeftDuringHandshake),
        HandshakeEnd::Transmission(n) => n,
    };
    let Some(entry) = exports.get(negotiated.export) else {
        return Err(HandshakeError::Refused("negotiated export does not exist".into()).into());
    };
    // Like a second qemu-nbd client beyond -e, this one waits until a client leaves.
    let _slot = match &control.slots {
        Some(slots) => tokio::select! {
            slot = slots.acquire() => slot.ok(),
            _ = control.shutdown.wait_for(|down| *down) => return Ok(ConnectionEnd::ShutdownDuringHandshake),
        },
        None => None,
    };
    tracing::debug!(export = %entry.name, mode = ?negotiated.mode, "transmission");
    let export = Rc::clone(&entry.export);
    let end = transmit(reader, writer, export, &negotiated, &control).await?;
    Ok(ConnectionEnd::Transmission(negotiated, end))
}
