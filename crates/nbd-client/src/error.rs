//! Why a connection or a request failed.

use crate::list::ListError;

/// Why a connection or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached.
    #[error("Failed to connect to '{target}': {}", os_text(source))]
    Connect {
        /// Where.
        target: String,
        /// Why.
        source: std::io::Error,
    },
    /// The handshake failed or was refused; QEMU's hints (what the server said, what to
    /// check) follow on lines of their own, as QEMU prints them.
    #[error("{e}{hints}", e = .0, hints = hint_lines(.0))]
    Handshake(#[from] ListError),
    /// Talking to the server failed.
    #[error("Failed to talk to the NBD server: {0}")]
    Io(#[from] std::io::Error),
    /// The server answered something the protocol does not allow.
    #[error("NBD server sent an invalid reply: {0}")]
    Protocol(String),
    /// The server failed the request with this errno.
    #[error("NBD server failed the request: {}", std::io::Error::from_raw_os_error(*.errno as i32))]
    Server {
        /// The NBD error value (the same numbers as Linux's errno).
        errno: u32,
    },
    /// The server does not offer the metadata context `x-dirty-bitmap` names (QEMU's words).
    #[error("requested x-dirty-bitmap {0} not found")]
    NoStatusContext(String),
    /// The export is read-only and a write was asked.
    #[error("the NBD export is read-only")]
    ReadOnly,
    /// A request beyond the end of the export.
    #[error("request at {offset} for {len} bytes is past the end of the export ({size} bytes)")]
    OutOfRange {
        /// Where.
        offset: u64,
        /// How much.
        len: u64,
        /// The export's size.
        size: u64,
    },
}

impl From<ClientError> for std::io::Error {
    fn from(e: ClientError) -> std::io::Error {
        match e {
            ClientError::Io(e) => e,
            ClientError::Server { errno } if errno > 0 && errno < 4096 => {
                std::io::Error::from_raw_os_error(errno as i32)
            }
            ClientError::ReadOnly => std::io::Error::from_raw_os_error(libc::EROFS),
            e => std::io::Error::other(e),
        }
    }
}

/// An OS error as QEMU words it: its text without Rust's `(os error N)`.
fn os_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

fn hint_lines(e: &ListError) -> String {
    e.hints().iter().map(|h| format!("\n{h}")).collect()
}

/// A protocol error saying `msg`.
pub(super) fn proto(msg: impl Into<String>) -> ClientError {
    ClientError::Protocol(msg.into())
}
