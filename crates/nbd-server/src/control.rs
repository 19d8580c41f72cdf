//! What the server tells each connection (shutdown, forced close, eviction) and the limits it
//! applies to it. Shared with atomics, not `Rc`, because a connection may run on another
//! thread than the accept loop.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify, Semaphore};

/// Default bound on the bytes one connection may have in flight at once: write data, read
/// lengths, and what block status and cache requests may hold (see [`crate::transmission::BLOCK_STATUS_CHARGE`]).
pub const MAX_IN_FLIGHT_BYTES: usize = 64 * 1024 * 1024;

/// What the server tells one connection, and the limits it applies to it.
#[derive(Debug, Clone)]
pub struct Control {
    /// Turns true on shutdown: stop reading requests, finish those in flight.
    pub shutdown: watch::Receiver<bool>,
    /// Turns true when the shutdown grace period is over: abandon every socket operation,
    /// so a client stalled mid-request or not reading replies cannot hold the server up.
    pub force: watch::Receiver<bool>,
    /// Time the client has to finish the handshake.
    pub handshake_timeout: Option<Duration>,
    /// Close a client in transmission that sent no request for this long (none in flight).
    pub idle_timeout: Option<Duration>,
    /// Notified to end this connection if it is still negotiating (the server makes room
    /// for a new client by dropping the oldest handshake).
    pub evict: Arc<Notify>,
    /// True while the handshake runs.
    pub negotiating: Arc<AtomicBool>,
    /// Transmission slots (qemu-nbd's `-e`): a client that finished its handshake waits for
    /// one before its requests are read.
    pub slots: Option<Arc<Semaphore>>,
    /// Most bytes of payloads and replies this connection may have in flight.
    pub memory: usize,
}

impl Control {
    /// A connection that ends on `shutdown` (abandoning its socket on `force`), with no
    /// handshake or idle limit, never evicted, no slot limit, and the default memory bound.
    pub fn new(shutdown: watch::Receiver<bool>, force: watch::Receiver<bool>) -> Control {
        Control {
            shutdown,
            force,
            handshake_timeout: None,
            idle_timeout: None,
            evict: Arc::new(Notify::new()),
            negotiating: Arc::new(AtomicBool::new(true)),
            slots: None,
            memory: MAX_IN_FLIGHT_BYTES,
        }
    }
}
