//! What both ends of `NBD_OPT_STARTTLS` share: QEMU's credential file names, the
//! pre-shared key file, the errors of loading credentials, and a failed certificate check
//! told in QEMU's words. The server's and the client's handshakes build on these.

mod error;
mod psk;
mod verify;

pub use error::{PskFileError, TlsError};
pub use psk::{load_keys, parse_psk_file, PskKeys};
pub use verify::{verify_error, ClientHandshakeError};

/// QEMU's file name for the CA certificate in a `tls-creds-x509` directory.
pub const CA_CERT: &str = "ca-cert.pem";

/// TLS 1.2 suites for PSK (TLS 1.3 negotiates PSK with its own suites); forward-secret
/// ones first, nothing without encryption or with broken ciphers.
pub const PSK_CIPHERS: &str = "ECDHE-PSK:DHE-PSK:PSK:!eNULL:!aNULL:!3DES:!RC4:!MD5:!SHA1";
