//! The server's socket during the TLS handshake, keeping OpenSSL's fatal alerts off the wire.
//!
//! qemu-nbd (GnuTLS) ends a failed handshake by closing the connection without an alert, so
//! its clients report that the peer "non-properly terminated" the connection; OpenSSL sends
//! a fatal alert first, which clients report differently. Until the handshake is over, a
//! write that is exactly one plaintext fatal alert record is dropped (reported as written);
//! everything else, and everything once the handshake is done, passes untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// TLS record type of an alert.
const ALERT: u8 = 21;
/// Alert level "fatal".
const FATAL: u8 = 2;
/// A record header (5 bytes) and a two-byte alert.
const ALERT_RECORD_LEN: usize = 7;

/// A socket that drops plaintext fatal alerts until [`QuietAlerts::handshake_done`].
pub struct QuietAlerts<S> {
    inner: S,
    handshaking: bool,
}

impl<S> QuietAlerts<S> {
    /// Wraps `inner` for a handshake.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            handshaking: true,
        }
    }

    /// From now on every byte is written.
    pub fn handshake_done(&mut self) {
        self.handshaking = false;
    }

    /// The socket.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

fn is_fatal_alert(buf: &[u8]) -> bool {
    buf.len() == ALERT_RECORD_LEN && buf[0] == ALERT && buf[3..5] == [0, 2] && buf[5] == FATAL
}

impl<S: AsyncRead + Unpin> AsyncRead for QuietAlerts<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for QuietAlerts<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.handshaking && is_fatal_alert(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_plaintext_fatal_alert_is_one() {
        assert!(is_fatal_alert(&[21, 3, 3, 0, 2, 2, 40]));
        assert!(!is_fatal_alert(&[21, 3, 3, 0, 2, 1, 0]), "a warning");
        assert!(
            !is_fatal_alert(&[23, 3, 3, 0, 2, 2, 40]),
            "application data"
        );
        assert!(
            !is_fatal_alert(&[21, 3, 3, 0, 2, 2, 40, 0]),
            "more than the alert"
        );
        assert!(!is_fatal_alert(&[21, 3, 3, 0, 3, 2, 40]), "another length");
    }
}
