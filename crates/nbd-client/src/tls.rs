//! TLS for the image tools' connections: which exports are reached over TLS, with which
//! credentials and host name, and the encrypted channel itself.
//!
//! The tools open an export by its name alone (the name is the "file" every layer below
//! the command line passes on), so the credentials an `--image-opts` or `json:` name asks
//! for with `tls-creds` are noted here against that name once, when the command line is
//! read, and [`NbdClient::connect`](crate::NbdClient::connect) looks them up.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

use openssl::ssl::{ErrorCode, SslStream};

use crate::creds::TlsClient;

/// The TLS an export is reached with.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// The credentials.
    pub client: Arc<TlsClient>,
    /// What the server's certificate must name instead of the host connected to (QEMU's
    /// `tls-hostname`); a Unix socket has no host, so x509 needs this there.
    pub hostname: Option<String>,
}

/// Exports by the name QEMU shows them ([`crate::NbdTarget::display_name`]), with their TLS.
static REGISTRY: Mutex<Vec<(String, ClientTls)>> = Mutex::new(Vec::new());

/// Notes that the export named `name` is to be reached over TLS with `tls`; a later note
/// for the same name replaces the earlier one.
pub fn register_tls(name: &str, tls: ClientTls) {
    if let Ok(mut all) = REGISTRY.lock() {
        all.retain(|(n, _)| n != name);
        all.push((name.to_owned(), tls));
    }
}

/// The TLS noted for the export named `name`, if any.
pub fn tls_for(name: &str) -> Option<ClientTls> {
    REGISTRY
        .lock()
        .ok()?
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.clone())
}

/// What QEMU's client (GnuTLS) says when the server leaves without ending the TLS session.
const NOT_TERMINATED: &str =
    "Cannot read from TLS channel: The TLS connection was non-properly terminated.";

/// An encrypted channel whose read errors are told as QEMU's client tells them: a server
/// that hangs up without closing the TLS session "non-properly terminated" it.
pub(super) struct TlsChannel<S>(pub(super) SslStream<S>);

impl<S: Read + Write> Read for TlsChannel<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0.ssl_read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) => match e.into_io_error() {
                // A timeout or an interrupted call is the socket's, not the session's.
                Ok(io)
                    if matches!(
                        io.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    Err(io)
                }
                _ => Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    NOT_TERMINATED,
                )),
            },
        }
    }
}

impl<S: Read + Write> Write for TlsChannel<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
