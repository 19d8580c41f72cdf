//! SIGINT and SIGTERM end the server gracefully. The handlers are installed before the
//! server reports itself ready (pid file, `--fork`), so a signal sent the moment the pid
//! file appears is never met by the default action, which would kill the process with
//! writes still in the caches.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Installed handlers for the shutdown signals.
pub struct ShutdownSignals {
    interrupt: Signal,
    terminate: Signal,
}

impl ShutdownSignals {
    /// Installs the handlers (inside a tokio runtime).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Completes when either signal arrives.
    pub async fn received(mut self) {
        let name = tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        };
        tracing::info!(signal = name, "shutting down: finishing requests in flight");
    }
}
