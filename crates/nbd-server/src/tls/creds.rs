//! Building the OpenSSL server context from credentials on disk.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use openssl::ex_data::Index;
use openssl::pkey::PKey;
use openssl::ssl::{
    Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions, SslSessionCacheMode,
    SslVerifyMode, SslVersion,
};
use openssl::stack::Stack;
use openssl::x509::store::{X509Lookup, X509StoreBuilder};
use openssl::x509::verify::X509VerifyFlags;
use openssl::x509::{X509StoreContext, X509};

use nbd_proto::tls::{PskKeys, TlsError, CA_CERT, PSK_CIPHERS};

/// The server's certificate (chain) in a `tls-creds-x509` directory.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The server's private key.
pub const SERVER_KEY: &str = "server-key.pem";
/// Revoked client certificates, optional.
pub const CA_CRL: &str = "ca-crl.pem";

/// Settings every context shares: TLS 1.2 or newer, no renegotiation, no resumption (each
/// connection proves its identity afresh, so authz always sees a full handshake).
fn base() -> Result<SslContextBuilder, TlsError> {
    let mut b = SslContextBuilder::new(SslMethod::tls_server())?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::NO_COMPRESSION);
    b.set_session_cache_mode(SslSessionCacheMode::OFF);
    b.set_num_tickets(0)?;
    Ok(b)
}

fn invalid(path: &Path, reason: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

fn existing(dir: &Path, name: &str) -> Result<PathBuf, TlsError> {
    let path = dir.join(name);
    std::fs::metadata(&path).map_err(|source| TlsError::Read {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The context for x509 credentials in `dir`.
pub(super) fn x509_context(dir: &Path, verify_peer: bool) -> Result<SslContext, TlsError> {
    let ca = existing(dir, CA_CERT)?;
    let cert = existing(dir, SERVER_CERT)?;
    let key = existing(dir, SERVER_KEY)?;
    let crl = Some(dir.join(CA_CRL)).filter(|p| p.exists());
    let mut b = base()?;
    let chain = read_certs(&cert)?;
    let pem = std::fs::read(&key).map_err(|source| TlsError::Read {
        path: key.clone(),
        source,
    })?;
    let private = PKey::private_key_from_pem(&pem)
        .map_err(|e| invalid(&key, format!("not a PEM private key: {e}")))?;
    if !chain[0].public_key()?.public_eq(&private) {
        return Err(invalid(
            &key,
            format!("does not match the key of {SERVER_CERT}"),
        ));
    }
    b.set_certificate_chain_file(&cert)
        .map_err(|e| invalid(&cert, format!("not a PEM certificate: {e}")))?;
    b.set_private_key(&private)?;
    let ca_certs = read_certs(&ca)?;
    check_signed_by(&cert, chain, &ca, &ca_certs)?;
    if verify_peer {
        let mut names = Stack::new()?;
        for c in &ca_certs {
            names.push(c.subject_name().to_owned()?)?;
        }
        b.set_client_ca_list(names);
        let store = b.cert_store_mut();
        for c in ca_certs {
            store.add_cert(c)?;
        }
        if let Some(crl) = &crl {
            store
                .add_lookup(X509Lookup::file())?
                .load_crl_file(crl, SslFiletype::PEM)
                .map_err(|e| invalid(crl, format!("not a PEM revocation list: {e}")))?;
            store.set_flags(X509VerifyFlags::CRL_CHECK)?;
        }
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(b.build())
}

fn read_certs(path: &Path) -> Result<Vec<X509>, TlsError> {
    let pem = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })?;
    let certs = X509::stack_from_pem(&pem)
        .map_err(|e| invalid(path, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "holds no certificate"));
    }
    Ok(certs)
}

/// Refuses to start with a server certificate clients would reject: one the CA did not
/// sign, or one expired or not yet valid (QEMU's `sanity-check` does the same).
fn check_signed_by(
    cert_path: &Path,
    chain: Vec<X509>,
    ca_path: &Path,
    ca: &[X509],
) -> Result<(), TlsError> {
    let mut chain_certs = chain.into_iter();
    let Some(leaf) = chain_certs.next() else {
        return Err(invalid(cert_path, "holds no certificate"));
    };
    let mut store = X509StoreBuilder::new()?;
    for c in ca {
        store.add_cert(c.clone())?;
    }
    let store = store.build();
    let mut chain = Stack::new()?;
    for c in chain_certs {
        chain.push(c)?;
    }
    let mut ctx = X509StoreContext::new()?;
    let outcome = ctx.init(&store, &leaf, &chain, |c| {
        Ok(c.verify_cert()?.then_some(()).ok_or(c.error()))
    })?;
    outcome.map_err(|e| {
        invalid(
            cert_path,
            format!("does not verify against {}: {e}", ca_path.display()),
        )
    })
}

/// The context for pre-shared keys: no certificate; an unknown identity fails the
/// handshake.
///
/// The identity a client proved is kept under `identity` on its `Ssl`: OpenSSL does not
/// report it after a TLS 1.3 handshake.
pub(super) fn psk_context(
    keys: PskKeys,
    identity_slot: Index<Ssl, Vec<u8>>,
) -> Result<SslContext, TlsError> {
    let mut b = base()?;
    b.set_cipher_list(PSK_CIPHERS)?;
    let keys = Arc::new(keys);
    b.set_psk_server_callback(move |ssl, identity, out| {
        let found = identity.and_then(|id| Some((id, keys.get(id)?)));
        match found {
            Some((id, key)) if key.len() <= out.len() => {
                out[..key.len()].copy_from_slice(key);
                ssl.set_ex_data(identity_slot, id.to_vec());
                Ok(key.len())
            }
            // Zero bytes: OpenSSL fails the handshake with an unknown_psk_identity alert.
            _ => Ok(0),
        }
    });
    Ok(b.build())
}
