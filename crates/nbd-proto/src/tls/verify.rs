//! A failed TLS handshake in the words QEMU's client uses, which scripts compare: the
//! client reports its own failures this way, and the server tells a client certificate
//! its CA did not sign in the same words.

use openssl::x509::X509VerifyResult;

/// Why the client's TLS handshake failed, in QEMU's words.
#[derive(Debug, thiserror::Error)]
pub enum ClientHandshakeError {
    /// x509 credentials verify the server's certificate against a host name, and there is
    /// none (a Unix socket without `--tls-hostname`).
    #[error("No hostname for certificate validation")]
    NoHostname,
    /// The server's certificate names another host.
    #[error("Certificate does not match the hostname {0}")]
    HostnameMismatch(String),
    /// The server's certificate was not issued by the CA of the credentials.
    #[error("The certificate hasn't got a known issuer")]
    UnknownIssuer,
    /// The server's certificate was revoked.
    #[error("The certificate has been revoked")]
    Revoked,
    /// The server's certificate has expired or is not valid yet.
    #[error("The certificate has expired or is not yet active")]
    Expired,
    /// Another certificate problem.
    #[error("The certificate is not trusted: {0}")]
    Untrusted(String),
    /// The handshake itself failed: the server hung up or sent an alert (a PSK it does not
    /// know, no common cipher).
    #[error("TLS handshake failed: {0}")]
    Failed(String),
}

/// OpenSSL's `X509_V_ERR_*` verification results that QEMU's client tells apart.
mod codes {
    pub const UNABLE_TO_GET_ISSUER_CERT: i32 = 2;
    pub const CERT_NOT_YET_VALID: i32 = 9;
    pub const CERT_HAS_EXPIRED: i32 = 10;
    pub const DEPTH_ZERO_SELF_SIGNED_CERT: i32 = 18;
    pub const SELF_SIGNED_CERT_IN_CHAIN: i32 = 19;
    pub const UNABLE_TO_GET_ISSUER_CERT_LOCALLY: i32 = 20;
    pub const UNABLE_TO_VERIFY_LEAF_SIGNATURE: i32 = 21;
    pub const CERT_REVOKED: i32 = 23;
    pub const HOSTNAME_MISMATCH: i32 = 62;
    pub const IP_ADDRESS_MISMATCH: i32 = 64;
}

/// The error for a failed certificate check, `None` if the certificate was not the problem.
pub fn verify_error(result: X509VerifyResult, host: &str) -> Option<ClientHandshakeError> {
    use codes::*;
    if result == X509VerifyResult::OK {
        return None;
    }
    Some(match result.as_raw() {
        HOSTNAME_MISMATCH | IP_ADDRESS_MISMATCH => {
            ClientHandshakeError::HostnameMismatch(host.to_owned())
        }
        UNABLE_TO_GET_ISSUER_CERT
        | UNABLE_TO_GET_ISSUER_CERT_LOCALLY
        | UNABLE_TO_VERIFY_LEAF_SIGNATURE
        | DEPTH_ZERO_SELF_SIGNED_CERT
        | SELF_SIGNED_CERT_IN_CHAIN => ClientHandshakeError::UnknownIssuer,
        CERT_REVOKED => ClientHandshakeError::Revoked,
        CERT_HAS_EXPIRED | CERT_NOT_YET_VALID => ClientHandshakeError::Expired,
        _ => ClientHandshakeError::Untrusted(result.error_string().to_owned()),
    })
}
