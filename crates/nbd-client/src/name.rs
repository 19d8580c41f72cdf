//! An NBD export's address as the client connects to it: its server and its name. The
//! names QEMU takes for one (`nbd://`, `nbd+unix://`, `nbd:...`) are read by the storage
//! opener, which owns image names; this crate only shows an address as QEMU names it.

use std::path::PathBuf;

/// The port NBD servers listen on unless told otherwise.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerAddr {
    /// A Unix socket.
    Unix(PathBuf),
    /// A TCP host and port.
    Inet {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

/// An NBD export: its server and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTarget {
    /// The server.
    pub server: ServerAddr,
    /// The export name (empty: the default export).
    pub export: String,
}

impl NbdTarget {
    /// The name QEMU shows for this export (`nbd+unix://?socket=PATH`,
    /// `nbd://HOST:PORT/EXPORT`).
    pub fn display_name(&self) -> String {
        match &self.server {
            ServerAddr::Unix(path) => {
                let export = if self.export.is_empty() {
                    String::new()
                } else {
                    format!("/{}", self.export)
                };
                format!("nbd+unix://{export}?socket={}", path.display())
            }
            ServerAddr::Inet { host, port } => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                let export = if self.export.is_empty() {
                    String::new()
                } else {
                    format!("/{}", self.export)
                };
                format!("nbd://{host}:{port}{export}")
            }
        }
    }
}
