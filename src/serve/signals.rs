//! SIGINT and SIGTERM end the server gracefully; a second one ends it at once. The handlers
//! are installed before the server reports itself ready (pid file, `--fork`), so a signal
//! sent the moment the pid file appears is never met by the default action, which would kill
//! the process with writes still in the caches.

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

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

    /// Watches for the signals on a task of the current `LocalSet` (which must outlive the
    /// whole shutdown, cache write-back included): the returned future completes on the
    /// first signal; a second one exits the process at once with status 1. Leaving then is
    /// safe for the image, whose metadata reaches the disk in an order that keeps it
    /// consistent at every instant: at worst clusters leak.
    pub fn watch(mut self) -> impl std::future::Future<Output = ()> {
        let (first_tx, first_rx) = oneshot::channel();
        tokio::task::spawn_local(async move {
            let name = self.next().await;
            tracing::info!(signal = name, "shutting down: finishing requests in flight");
            let _ = first_tx.send(());
            let name = self.next().await;
            eprintln!(
                "{}: {name} during shutdown: exiting at once without writing back the \
                 caches; the image stays consistent but may leak clusters \
                 (`qcow2-nbd check -r leaks` reclaims them)",
                crate::prog::name()
            );
            std::process::exit(1);
        });
        async move {
            let _ = first_rx.await;
        }
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}
