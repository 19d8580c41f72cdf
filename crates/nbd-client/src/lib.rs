//! An NBD client for the image tools: an export's address, and a connection that reads, writes, zeroes, trims, flushes and asks block status.
//!
//! The server is untrusted: every length, offset and count it sends is checked against
//! what was asked, a reply never makes us allocate more than the request it answers, and
//! anything the protocol does not allow is a [`ClientError`], never a panic. Blocking I/O
//! with timeouts on the socket, so every wait ends; one request is in flight at a time.
//!
//! `name` is the address (the storage opener reads the names QEMU takes for one),
//! `handshake` connects and negotiates, `transmission` sends one
//! request and parses its reply, `commands` are the operations built on them. [`list`]
//! lists a server's exports as qemu-nbd's `--list` does; `creds` loads the client's TLS
//! credentials and `tls` notes which exports are reached with them.

mod commands;
mod creds;
mod error;
mod handshake;
mod limits;
pub mod list;
mod name;
mod session;
mod status_context;
mod tls;
mod transmission;

pub use creds::{TlsClient, CLIENT_CERT, CLIENT_KEY};
pub use error::ClientError;
pub use limits::{DEFAULT_IO_TIMEOUT, MAX_CHUNKS, MAX_EXTENTS, MAX_RANGE, MAX_REQUEST};
pub use name::{NbdTarget, ServerAddr, DEFAULT_PORT};
pub use session::{NbdClient, ReadWrite, Status};
pub use status_context::register_status_context;
pub use tls::{register_tls, tls_for, ClientTls};

#[cfg(test)]
mod tests;
