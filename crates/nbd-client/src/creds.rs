//! The client side of `NBD_OPT_STARTTLS`, for the tools that talk to a server (qemu-nbd's
//! `--list`): credentials from the files QEMU's `tls-creds-x509` / `tls-creds-psk` objects
//! read with `endpoint=client`, and a blocking handshake whose failures are told in the
//! words QEMU's client uses, which scripts compare.

use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::path::Path;

use nbd_proto::tls::{
    load_keys, verify_error, ClientHandshakeError, TlsError, CA_CERT, PSK_CIPHERS,
};
use openssl::ssl::{
    HandshakeError, SslConnector, SslFiletype, SslMethod, SslOptions, SslStream, SslVerifyMode,
    SslVersion,
};

/// A client's certificate in a `tls-creds-x509` directory (optional).
pub const CLIENT_CERT: &str = "client-cert.pem";
/// The client's private key (with [`CLIENT_CERT`]).
pub const CLIENT_KEY: &str = "client-key.pem";

/// What the client proves itself with.
enum Kind {
    X509 { verify_peer: bool },
    Psk,
}

/// A client's TLS setup, loaded once.
pub struct TlsClient {
    connector: SslConnector,
    kind: Kind,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::X509 { verify_peer } => format!("x509 (verify-peer={verify_peer})"),
            Kind::Psk => "psk".to_owned(),
        };
        f.debug_struct("TlsClient").field("kind", &kind).finish()
    }
}

fn base() -> Result<openssl::ssl::SslConnectorBuilder, TlsError> {
    let mut b = SslConnector::builder(SslMethod::tls_client())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::NO_COMPRESSION);
    Ok(b)
}

impl TlsClient {
    /// x509 credentials from QEMU's file names in `dir`: `ca-cert.pem` to verify the server
    /// with, and `client-cert.pem` with `client-key.pem` if present. `verify_peer` off
    /// accepts any server certificate, as QEMU's `verify-peer=off`.
    pub fn x509(dir: &Path, verify_peer: bool) -> Result<Self, TlsError> {
        let mut b = base()?;
        let ca = dir.join(CA_CERT);
        std::fs::metadata(&ca).map_err(|source| TlsError::Read {
            path: ca.clone(),
            source,
        })?;
        b.set_ca_file(&ca).map_err(|e| TlsError::Invalid {
            path: ca.clone(),
            reason: format!("not PEM certificates: {e}"),
        })?;
        let (cert, key) = (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY));
        if cert.exists() {
            b.set_certificate_chain_file(&cert)
                .map_err(|e| TlsError::Invalid {
                    path: cert.clone(),
                    reason: format!("not a PEM certificate: {e}"),
                })?;
            b.set_private_key_file(&key, SslFiletype::PEM)
                .map_err(|e| TlsError::Invalid {
                    path: key.clone(),
                    reason: format!("not a PEM private key: {e}"),
                })?;
            b.check_private_key().map_err(|e| TlsError::Invalid {
                path: key.clone(),
                reason: format!("does not match {CLIENT_CERT}: {e}"),
            })?;
            // SAFETY: `b` owns a valid SSL_CTX; the callback is a plain function that keeps
            // no state, so nothing it uses can be freed before the context.
            unsafe {
                SSL_CTX_set_cert_cb(
                    b.as_ptr(),
                    Some(withhold_foreign_certificate),
                    std::ptr::null_mut(),
                )
            };
        }
        if verify_peer {
            // The certificate is checked once the handshake is over, as QEMU's client checks
            // it: the handshake itself always completes, the result is read afterwards (see
            // `connect`), and a server that fails the check sees its client hang up.
            b.set_verify_callback(SslVerifyMode::PEER, |_, _| true);
        } else {
            b.set_verify(SslVerifyMode::NONE);
        }
        Ok(Self {
            connector: b.build(),
            kind: Kind::X509 { verify_peer },
        })
    }

    /// Pre-shared key credentials: the key of `username` in `file` (`psktool` lines of
    /// `identity:hexkey`, QEMU's `DIR/keys.psk`).
    pub fn psk(file: &Path, username: &str) -> Result<Self, TlsError> {
        let keys = load_keys(file)?;
        let key = keys
            .get(username.as_bytes())
            .cloned()
            .ok_or_else(|| TlsError::Invalid {
                path: file.to_owned(),
                reason: format!("no key for the user {username:?}"),
            })?;
        let mut b = base()?;
        b.set_cipher_list(PSK_CIPHERS)?;
        b.set_verify(SslVerifyMode::NONE);
        let identity = username.as_bytes().to_vec();
        b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
            // The identity goes out NUL-terminated; both must fit OpenSSL's buffers.
            if identity.len() >= id_out.len() || key.len() > key_out.len() {
                return Ok(0);
            }
            id_out[..identity.len()].copy_from_slice(&identity);
            id_out[identity.len()] = 0;
            key_out[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        Ok(Self {
            connector: b.build(),
            kind: Kind::Psk,
        })
    }

    /// Runs the client side of the TLS handshake on `stream`. `hostname` is what the
    /// server's certificate must name (a host name or an IP address); x509 credentials that
    /// verify the server need one. As QEMU's client, the handshake completes before the
    /// server's certificate is judged; when it fails the check, the stream is dropped
    /// without ending the TLS session, which is how the server learns of it.
    pub fn connect<S: Read + Write>(
        &self,
        stream: S,
        hostname: Option<&str>,
    ) -> Result<SslStream<S>, ClientHandshakeError> {
        let fail = |e: &dyn std::fmt::Display| ClientHandshakeError::Failed(e.to_string());
        let mut config = self.connector.configure().map_err(|e| fail(&e))?;
        let verify = matches!(self.kind, Kind::X509 { verify_peer: true });
        let host = match hostname {
            Some(h) if verify => h,
            _ => {
                config = config
                    .verify_hostname(false)
                    .use_server_name_indication(false);
                hostname.unwrap_or("")
            }
        };
        let stream = match config.connect(host, stream) {
            Ok(s) => s,
            Err(HandshakeError::Failure(mid)) => {
                let result = mid.ssl().verify_result();
                return Err(
                    verify_error(result, host).unwrap_or_else(|| handshake_error(mid.error()))
                );
            }
            Err(HandshakeError::SetupFailure(e)) => return Err(fail(&e)),
            Err(HandshakeError::WouldBlock(_)) => return Err(fail(&"the socket would block")),
        };
        if verify {
            if let Some(e) = verify_error(stream.ssl().verify_result(), host) {
                return Err(e);
            }
            if hostname.is_none() {
                return Err(ClientHandshakeError::NoHostname);
            }
        }
        Ok(stream)
    }
}

extern "C" {
    // Declared here because openssl-sys does not declare them; both are in every OpenSSL
    // since 1.0.2 (the workspace needs 3).
    fn SSL_CTX_set_cert_cb(
        ctx: *mut openssl_sys::SSL_CTX,
        cb: Option<unsafe extern "C" fn(*mut openssl_sys::SSL, *mut c_void) -> c_int>,
        arg: *mut c_void,
    );
    fn SSL_get_client_CA_list(ssl: *const openssl_sys::SSL)
        -> *mut openssl_sys::stack_st_X509_NAME;
    fn SSL_certs_clear(ssl: *mut openssl_sys::SSL);
}

/// OpenSSL's certificate callback on the client: when the server asks for a certificate
/// and names the CAs it trusts, ours goes only if one of them issued it, as GnuTLS (QEMU's
/// client) decides; otherwise the client answers with none, and the server says so. With
/// no names (a server that lists none) the certificate goes, as GnuTLS sends it then too.
unsafe extern "C" fn withhold_foreign_certificate(
    ssl: *mut openssl_sys::SSL,
    _arg: *mut c_void,
) -> c_int {
    // SAFETY: OpenSSL calls this with a valid SSL in its handshake; every pointer read here
    // belongs to it, is checked for null, and none is kept past the call.
    unsafe {
        let cert = openssl_sys::SSL_get_certificate(ssl);
        let cas = SSL_get_client_CA_list(ssl);
        if cert.is_null() || cas.is_null() {
            return 1;
        }
        let stack = cas as *const openssl_sys::OPENSSL_STACK;
        let n = openssl_sys::OPENSSL_sk_num(stack);
        if n <= 0 {
            return 1;
        }
        let issuer = openssl_sys::X509_get_issuer_name(cert);
        for i in 0..n {
            let name = openssl_sys::OPENSSL_sk_value(stack, i) as *const openssl_sys::X509_NAME;
            if !name.is_null() && openssl_sys::X509_NAME_cmp(name, issuer) == 0 {
                return 1;
            }
        }
        SSL_certs_clear(ssl);
    }
    1
}

/// A handshake that failed without a certificate to blame, told as QEMU's client (GnuTLS)
/// tells it, since scripts match those sentences: a server that hangs up mid-handshake
/// "non-properly terminated" the connection, one that refuses with an alert (an unknown
/// PSK identity, a wrong key) sent "a TLS fatal alert". Other failures (no common cipher,
/// a protocol error) keep OpenSSL's reason.
fn handshake_error(e: &openssl::ssl::Error) -> ClientHandshakeError {
    let alerted = e
        .ssl_error()
        .and_then(|stack| stack.errors().first())
        .and_then(|err| err.reason())
        .is_some_and(|r| r.contains("alert"));
    let hung_up = matches!(
        e.code(),
        openssl::ssl::ErrorCode::SYSCALL | openssl::ssl::ErrorCode::ZERO_RETURN
    );
    let text = if alerted {
        "A TLS fatal alert has been received.".to_owned()
    } else if hung_up {
        "The TLS connection was non-properly terminated.".to_owned()
    } else {
        e.to_string()
    };
    ClientHandshakeError::Failed(text)
}
