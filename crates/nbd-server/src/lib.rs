//! The NBD server: handshake, transmission loop, accept loop and the [`Export`] trait, on
//! the protocol of `nbd-proto`.
//!
//! - [`negotiate`]: the handshake (fixed and non-fixed newstyle, `OPT_GO`/`INFO`/`LIST`/
//!   `ABORT`, structured replies, extended headers, metadata contexts).
//! - [`transmission`]: pipelined request handling with simple, structured or extended
//!   replies.
//! - [`server`]: the accept loop over Unix, TCP and socket-activated listeners.
//! - [`tls`]: STARTTLS with x509 or pre-shared-key credentials, and access control.
//! - [`Export`]: what an engine implements; [`MemExport`] is an in-memory one for tests.
//!
//! - [`remote`]: an export called from other threads, so connections can be spread over
//!   several cores while each export stays on the thread that owns it.
//!
//! Each export lives on one thread (a current-thread runtime and a `LocalSet`): exports and
//! their futures need not be `Send`. With [`Server::with_threads`], connections on the other
//! threads reach it through [`remote::Remote`].

mod accept;
pub mod connection;
pub mod control;
pub mod export;
pub mod exports;
pub mod mem_export;
mod mirror;
pub mod negotiate;
pub mod remote;
pub mod server;
pub mod systemd;
pub mod tls;
pub mod transmission;
mod workers;

pub use accept::report_negotiation_failures;
pub use connection::{serve_client, serve_connection, ConnectionEnd, ConnectionError, Transport};
pub use control::Control;
pub use export::{
    BlockSize, BlockSizeError, Buffer, Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags,
};
pub use exports::{Attachment, CloseMode, ExportEntry, ExportState, Exports, ExportsError};
pub use mem_export::{MemExport, MemStats};
pub use negotiate::meta::MAX_DIRTY_BITMAPS;
pub use remote::SendBuf;
pub use server::{
    shutdown_signal, Listener, ServeReport, Server, ServerConfig, ServerError, DEFAULT_MAX_OPEN,
    DEFAULT_SHUTDOWN_GRACE, DEFAULT_TCP_KEEPALIVE,
};
