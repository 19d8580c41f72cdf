//! One client connection over any async byte stream: handshake, then transmission.

use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, BufReader};

use crate::control::Control;
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
