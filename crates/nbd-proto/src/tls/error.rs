//! The errors of loading TLS credentials: a leaf, so that the loaders of each kind and the
//! server set-up that calls them all name these without naming each other.

use std::path::PathBuf;

/// Why TLS credentials cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A credentials file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A credentials file was read but is not usable.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The PSK key file is malformed.
    #[error(transparent)]
    PskFile(#[from] PskFileError),
    /// OpenSSL refused a setting.
    #[error("TLS setup: {0}")]
    Setup(#[from] openssl::error::ErrorStack),
}

/// What is wrong with a PSK key file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}:{line}: {reason}")]
pub struct PskFileError {
    /// The file.
    pub path: PathBuf,
    /// Line number, from 1 (0 for the file as a whole).
    pub line: usize,
    /// What is wrong.
    pub reason: String,
}
