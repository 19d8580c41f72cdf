//! The NBD protocol as both ends speak it; the server and the client crates build on it.
//!
//! - [`wire`]: pure encode/decode of every protocol structure, safe on untrusted bytes.
//! - [`errno`]: the error values a request's reply carries, and their mapping from the OS.
//! - [`tls`]: what both ends of `NBD_OPT_STARTTLS` share (credential file names, the
//!   pre-shared key file, credential errors, certificate failures in QEMU's words).

pub mod errno;
pub mod tls;
pub mod wire;

pub use errno::Errno;
