//! Why `serve` failed: one error type gathering each part's own, so that the parts can
//! return it without depending on the orchestration in `serve.rs`.

use qcow2::engine::EngineError;

use super::control::error::ControlError;
use super::{args, listen, overlay};
use crate::common::tls;
use crate::daemon::stats::http::MetricsBindError;

/// Why `serve` failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A flag combination qemu-nbd refuses too.
    #[error("--detect-zeroes=unmap requires --discard=unmap")]
    DetectZeroesUnmap,
    /// `-l` is malformed.
    #[error(transparent)]
    SnapshotParam(#[from] args::SnapshotParamError),
    /// The socket-activation environment is unusable.
    #[error(transparent)]
    Activation(#[from] nbd_server::systemd::SystemdError),
    /// `--fork` failed.
    #[error("--fork: {0}")]
    Fork(std::io::Error),
    /// The async runtime or the signal handlers could not be set up.
    #[error("cannot start the server runtime: {0}")]
    Runtime(std::io::Error),
    /// The image could not be opened.
    #[error(transparent)]
    Open(EngineError),
    /// `--offset` is past the end of the image (QEMU's words).
    #[error("Offset ({offset}) cannot be greater than size of the containing file ({size})")]
    OffsetBeyondImage {
        /// The offset given.
        offset: u64,
        /// The image's size.
        size: u64,
    },
    /// Neither an image nor an `--export` was given.
    #[error("nothing to serve: give an IMAGE or --export definitions")]
    NoImage,
    /// An NBD name given as the image: the image tools read NBD exports, but serve does not
    /// re-export them (its NBD client waits on the image's own thread, so a slow server
    /// behind it would stall every export).
    #[error("{0}: serve does not export NBD names; give it the image file (or use qemu-nbd)")]
    NbdName(String),
    /// More `--export` definitions than the server takes.
    #[error("{given} --export definitions given; one server offers at most {max}")]
    TooManyExports {
        /// Definitions given.
        given: usize,
        /// The limit.
        max: usize,
    },
    /// Two `--export` definitions share a name.
    #[error("--export name={0}: the name is given to another --export too")]
    DuplicateExport(String),
    /// An `--export` image could not be opened.
    #[error("--export name={name}: cannot open {path}: {source}")]
    ExportOpen {
        /// The export.
        name: String,
        /// Its file.
        path: String,
        /// Why.
        source: Box<EngineError>,
    },
    /// An `--export` bitmap cannot be exported.
    #[error("--export name={name}: {reason}")]
    ExportBitmap {
        /// The export.
        name: String,
        /// Why.
        reason: String,
    },
    /// Closing an `--export` image failed: writes may not have reached the disk.
    #[error("--export name={name}: closing the image failed: {source}")]
    ExportClose {
        /// The export.
        name: String,
        /// Why.
        source: Box<EngineError>,
    },
    /// The `-s` overlay could not be created.
    #[error(transparent)]
    Overlay(#[from] overlay::OverlayError),
    /// No socket to listen on.
    #[error(transparent)]
    Listen(#[from] listen::ListenError),
    /// The pid file could not be written.
    #[error("cannot write the pid file {path}: {source}")]
    PidFile {
        /// Path given.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The server failed (invalid export, or the final flush).
    #[error(transparent)]
    Server(#[from] nbd_server::ServerError),
    /// The control socket cannot be set up.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The TLS flags are wrong or the credentials cannot be loaded.
    #[error(transparent)]
    Tls(#[from] tls::TlsArgError),
    /// A `-B` bitmap cannot be exported.
    #[error("{0}")]
    Bitmap(String),
    /// Closing the image failed: writes may not have reached the disk.
    #[error("closing the image failed: {0}")]
    Close(EngineError),
    /// The `--metrics` endpoint cannot listen.
    #[error(transparent)]
    Metrics(#[from] MetricsBindError),
    /// Two exports of one server share a name (caught earlier; kept as a typed error).
    #[error(transparent)]
    Stats(#[from] crate::daemon::stats::StatsError),
}
