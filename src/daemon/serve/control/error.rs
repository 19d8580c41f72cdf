//! Why the control socket cannot be set up.

use std::path::PathBuf;

/// Why the control socket cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A file that is not a socket is in the way.
    #[error("--control {0}: the path exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding or setting the mode failed.
    #[error("--control {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}
