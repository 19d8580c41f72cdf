//! What happens to one accepted client: socket options, then the connection served to its
//! end. Shared by the server's own loop and the worker threads, which is why it is neither's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::connection::{serve_client, ConnectionEnd};
use crate::control::Control;
use crate::export::Export;
use crate::exports::Exports;
use crate::tls::TlsServer;

/// A client's stream as the listener accepted it.
pub(crate) enum Accepted {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream, SocketAddr),
}

/// What a server that reports failed negotiations (as qemu-nbd does on stderr) is told:
/// why one client's negotiation failed. Set once, by the program.
static NEGOTIATION_FAILURES: std::sync::OnceLock<fn(&str)> = std::sync::OnceLock::new();

/// Has every client negotiation that fails, or that the client leaves without a word
/// (hanging up where an option should begin), reported to `report` with the reason (the
/// connection is closed either way; this only tells of it).
pub fn report_negotiation_failures(report: fn(&str)) {
    let _ = NEGOTIATION_FAILURES.set(report);
}

fn report_negotiation(reason: &str) {
    if let Some(report) = NEGOTIATION_FAILURES.get() {
        report(reason);
    }
}

/// Why a client that hung up between options failed, as qemu-nbd says it.
fn hung_up_reason(tls: bool) -> &'static str {
    if tls {
        "Failed to read opts magic: Cannot read from TLS channel: The TLS connection was \
         non-properly terminated."
    } else {
        "Failed to read opts magic: Unexpected end-of-file before all data were read"
    }
}

/// How a client's connection went.
pub(crate) struct Handled {
    /// It ended without error.
    pub ok: bool,
    /// It reached transmission (and so counts for the server's lifetime).
    pub transmitted: bool,
}

/// Serves one accepted client.
pub(crate) async fn handle<E: Export + 'static>(
    stream: Accepted,
    exports: Exports<E>,
    control: Control,
    keepalive: Option<Duration>,
    tls: Option<Arc<TlsServer>>,
) -> Handled {
    let tls = tls.as_deref();
    let (result, peer) = match stream {
        Accepted::Unix(s) => (
            serve_client(s, &exports, control, tls).await,
            "unix".to_owned(),
        ),
        Accepted::Tcp(s, peer) => {
            // The spec asks both ends to disable Nagle: replies are small and latency-bound.
            let _ = s.set_nodelay(true);
            if let Some(idle) = keepalive {
                if let Err(e) = set_keepalive(&s, idle) {
                    tracing::debug!(%peer, error = %e, "cannot enable TCP keepalive");
                }
            }
            (
                serve_client(s, &exports, control, tls).await,
                peer.to_string(),
            )
        }
    };
    match result {
        Ok(ConnectionEnd::Transmission(n, end)) => {
            tracing::info!(%peer, export = n.export, ?end, "client disconnected");
            Handled {
                ok: true,
                transmitted: true,
            }
        }
        Ok(end) => {
            tracing::debug!(%peer, ?end, "client left during handshake");
            if let ConnectionEnd::HungUpDuringHandshake { tls } = end {
                report_negotiation(hung_up_reason(tls));
            }
            Handled {
                ok: true,
                transmitted: false,
            }
        }
        Err(e) => {
            tracing::info!(%peer, error = %e, "connection closed");
            if !e.reached_transmission() {
                report_negotiation(&e.to_string());
            }
            Handled {
                ok: false,
                transmitted: e.reached_transmission(),
            }
        }
    }
}

/// Turns on TCP keepalive: probes after `idle` without traffic, then every 10 s, and the
/// connection fails after 6 unanswered probes, so a client whose host vanished is noticed
/// in about `idle` + 1 minute instead of holding its connection forever.
fn set_keepalive(s: &tokio::net::TcpStream, idle: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let idle = libc::c_int::try_from(idle.as_secs().max(1)).unwrap_or(libc::c_int::MAX);
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
    ] {
        // SAFETY: fd is the open socket `s` owns; value is a c_int that outlives the call
        // and its size is passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                std::ptr::from_ref(&value).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
