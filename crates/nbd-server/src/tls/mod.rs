//! TLS for `NBD_OPT_STARTTLS`: server credentials (x509 certificates or pre-shared keys, in
//! the files QEMU's `tls-creds-x509` / `tls-creds-psk` objects read), the handshake, and
//! the identity of the peer for access control ([`Authz`]).
//!
//! The handshake runs on the raw socket once the plaintext negotiation has acknowledged
//! STARTTLS; the negotiation then continues inside the TLS stream (see
//! [`crate::negotiate`]).

mod creds;
mod quiet;

use std::path::Path;
use std::pin::Pin;

use nbd_proto::tls::{load_keys, verify_error, TlsError};
use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslContext};
use openssl::x509::X509NameRef;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;

pub use quiet::QuietAlerts;

/// How a TLS handshake with a client failed (the connection is closed).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeFailure {
    /// The TLS handshake itself failed: wrong key, untrusted certificate, unknown PSK
    /// identity, or the client hung up.
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    /// The handshake succeeded but access control does not admit the client, which is
    /// then dropped at once, as qemu-nbd drops it (QEMU's words).
    #[error("{0}")]
    Denied(String),
    /// The client's certificate failed the check (QEMU's words).
    #[error("{0}")]
    Certificate(String),
}

/// The identities admitted after the TLS handshake, like QEMU's `authz-simple` object:
/// an x509 client's distinguished name (as QEMU prints it: attributes in certificate order,
/// `C=GB,O=Example,CN=laptop`) or a PSK client's user name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authz {
    identities: Vec<String>,
}

impl Authz {
    /// Admits exactly these identities.
    pub fn new(identities: Vec<String>) -> Self {
        Self { identities }
    }

    /// True when `identity` is admitted.
    pub fn admits(&self, identity: &str) -> bool {
        self.identities.iter().any(|i| i == identity)
    }
}

/// Which kind of credentials a server presents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredsKind {
    /// x509 certificates; `verify_peer` asks clients for a certificate signed by the CA.
    X509 {
        /// Clients must present a certificate the CA signed.
        verify_peer: bool,
    },
    /// Pre-shared keys.
    Psk,
}

/// A server's TLS setup: credentials loaded once at start, shared by every connection.
pub struct TlsServer {
    context: SslContext,
    kind: CredsKind,
    authz: Option<Authz>,
    /// Where the PSK callback leaves the identity it accepted.
    psk_identity: Option<Index<Ssl, Vec<u8>>>,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("kind", &self.kind)
            .field("authz", &self.authz)
            .finish_non_exhaustive()
    }
}

/// Who the client proved to be in the TLS handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// No identity: an x509 server that does not verify peers.
    None,
    /// The distinguished name of a verified client certificate.
    Certificate(String),
    /// The PSK user name.
    Psk(String),
}

impl PeerIdentity {
    /// The identity as authz matches it, if there is one.
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::None => None,
            Self::Certificate(n) | Self::Psk(n) => Some(n),
        }
    }
}

impl TlsServer {
    /// x509 credentials from QEMU's file names in `dir`: `ca-cert.pem`, `server-cert.pem`,
    /// `server-key.pem`, and `ca-crl.pem` if present.
    pub fn x509(dir: &Path, verify_peer: bool, authz: Option<Authz>) -> Result<Self, TlsError> {
        Ok(Self {
            context: creds::x509_context(dir, verify_peer)?,
            kind: CredsKind::X509 { verify_peer },
            authz,
            psk_identity: None,
        })
    }

    /// Pre-shared keys from `file`, lines of `identity:hexkey` as `psktool` writes them.
    /// QEMU's `tls-creds-psk,dir=DIR` reads `DIR/keys.psk`.
    pub fn psk(file: &Path, authz: Option<Authz>) -> Result<Self, TlsError> {
        let keys = load_keys(file)?;
        let slot = Ssl::new_ex_index()?;
        Ok(Self {
            context: creds::psk_context(keys, slot)?,
            kind: CredsKind::Psk,
            authz,
            psk_identity: Some(slot),
        })
    }

    /// The kind of credentials.
    pub fn kind(&self) -> CredsKind {
        self.kind
    }

    /// The access control list, if any.
    pub fn authz(&self) -> Option<&Authz> {
        self.authz.as_ref()
    }

    /// Runs the server side of the TLS handshake on `stream`. A failed handshake ends
    /// without an alert to the client, as qemu-nbd's does ([`QuietAlerts`]).
    pub async fn accept<S>(
        &self,
        stream: S,
    ) -> Result<(SslStream<QuietAlerts<S>>, PeerIdentity), HandshakeFailure>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let fail = |e: &dyn std::fmt::Display| HandshakeFailure::Tls(e.to_string());
        let ssl = Ssl::new(&self.context).map_err(|e| fail(&e))?;
        let mut tls = SslStream::new(ssl, QuietAlerts::new(stream)).map_err(|e| fail(&e))?;
        if let Err(e) = Pin::new(&mut tls).accept().await {
            // A certificate the CA did not sign is told as QEMU tells it.
            return Err(verify_error(tls.ssl().verify_result(), "").map_or_else(
                || fail(&e),
                |v| HandshakeFailure::Certificate(v.to_string()),
            ));
        }
        tls.get_mut().handshake_done();
        tracing::debug!(
            version = tls.ssl().version_str(),
            cipher = tls.ssl().current_cipher().map(|c| c.name()),
            "TLS handshake done"
        );
        let peer = match self.kind {
            CredsKind::Psk => match self.psk_identity.and_then(|i| tls.ssl().ex_data(i)) {
                Some(id) => PeerIdentity::Psk(String::from_utf8_lossy(id).into_owned()),
                None => return Err(fail(&"no PSK identity after a PSK handshake")),
            },
            CredsKind::X509 { verify_peer: false } => PeerIdentity::None,
            CredsKind::X509 { verify_peer: true } => match tls.ssl().peer_certificate() {
                Some(cert) => PeerIdentity::Certificate(distinguished_name(cert.subject_name())),
                None => return Err(fail(&"the client sent no certificate")),
            },
        };
        Ok((tls, peer))
    }

    /// Why `peer` is refused by the authz list, or `None` if it is admitted.
    pub fn refusal(&self, peer: &PeerIdentity) -> Option<String> {
        let authz = self.authz.as_ref()?;
        match peer.name() {
            Some(name) if authz.admits(name) => None,
            Some(name) => Some(match peer {
                PeerIdentity::Psk(_) => format!("TLS PSK authz check for {name} is denied"),
                _ => format!("TLS x509 authz check for {name} is denied"),
            }),
            None => Some(
                "access control needs a client identity, but the server does not verify \
                 client certificates (verify-peer=off)"
                    .to_owned(),
            ),
        }
    }
}

/// A distinguished name as QEMU's authz sees it (GnuTLS's `gnutls_x509_crt_get_dn`):
/// attributes in certificate order, `,` between, special characters escaped as RFC 4514
/// says.
pub fn distinguished_name(name: &X509NameRef) -> String {
    let parts: Vec<String> = name
        .entries()
        .map(|e| {
            let key = e.object().nid().short_name().unwrap_or("?").to_owned();
            let data = e.data();
            let value = data
                .to_string()
                .unwrap_or_else(|_| String::from_utf8_lossy(data.as_slice()).into_owned());
            format!("{key}={}", escape_dn_value(&value))
        })
        .collect();
    parts.join(",")
}

fn escape_dn_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dn_values_are_escaped_as_rfc_4514_says() {
        assert_eq!(escape_dn_value("plain"), "plain");
        assert_eq!(escape_dn_value("a,b+c"), "a\\,b\\+c");
        assert_eq!(escape_dn_value(" lead"), "\\ lead");
        assert_eq!(escape_dn_value("trail "), "trail\\ ");
        assert_eq!(escape_dn_value("#x"), "\\#x");
        assert_eq!(escape_dn_value("R'lyeh"), "R'lyeh");
    }

    #[test]
    fn authz_admits_only_listed_identities() {
        let authz = Authz::new(vec!["CN=a,O=x".into(), "alice".into()]);
        assert!(authz.admits("alice") && authz.admits("CN=a,O=x"));
        assert!(!authz.admits("CN=a") && !authz.admits("ALICE") && !authz.admits(""));
    }
}
