//! The signals that end the server, counted once per intent.
//!
//! SIGTERM, SIGINT and SIGHUP ask for a graceful shutdown: stop accepting, let requests in
//! flight finish for the grace period, close the images (caches written back, bitmaps
//! stored). Supervisors often deliver the same request twice (`timeout` and systemd's
//! `KillMode=mixed` signal the process and then its group), so a repeat of any of them
//! changes nothing, as in qemu-nbd, which only ever moves from running to terminating.
//!
//! SIGQUIT forces the shutdown: the connections are closed at once, without the grace
//! period, and requests in flight are abandoned unanswered; the images are still closed
//! cleanly, so no bitmap is left marked in use. Nothing short of SIGKILL skips that close:
//! an exit that left the bitmaps in use would make them useless for good (QEMU refuses an
//! in-use bitmap), and the close is bounded by the storage alone once no client is left.
//!
//! The handlers are installed before the server reports itself ready (pid file, `--fork`),
//! so a signal sent the moment the pid file appears is never met by the default action,
//! which would kill the process with writes still in the caches.

use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::watch;

/// Installed handlers for the shutdown signals.
pub struct ShutdownSignals {
    interrupt: Signal,
    terminate: Signal,
    hangup: Signal,
    quit: Signal,
}

/// What the signals received so far ask for; it only ever moves forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Intent {
    Serve,
    Stop,
    Force,
}

/// The shutdown the signals ask for, as futures for the server.
#[derive(Clone)]
pub struct Shutdown {
    intent: watch::Receiver<Intent>,
}

impl Shutdown {
    async fn reached(mut self, intent: Intent) {
        // The sender lives as long as the watching task, which the `LocalSet` keeps for the
        // whole shutdown; if it went away anyway, no signal can come any more.
        if self.intent.wait_for(|i| *i >= intent).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Completes once any shutdown signal arrived.
    pub async fn requested(self) {
        self.reached(Intent::Stop).await;
    }

    /// Completes once SIGQUIT arrived.
    pub async fn forced(self) {
        self.reached(Intent::Force).await;
    }
}

impl ShutdownSignals {
    /// Installs the handlers (inside a tokio runtime).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// Watches for the signals on a task of the current `LocalSet`, which must outlive the
    /// whole shutdown, the close of the images included: signals keep being taken (and
    /// their default action kept away) until the process exits.
    pub fn watch(mut self) -> Shutdown {
        let (tx, rx) = watch::channel(Intent::Serve);
        tokio::task::spawn_local(async move {
            while let Some((name, wanted)) = self.next().await {
                let now = *tx.borrow();
                match (now, wanted) {
                    (Intent::Serve, Intent::Stop) => {
                        tracing::info!(signal = name, "shutting down: finishing requests in flight")
                    }
                    (_, Intent::Force) if now < Intent::Force => tracing::warn!(
                        signal = name,
                        "forced shutdown: closing every connection now; the images are \
                         still closed cleanly"
                    ),
                    _ => tracing::warn!(
                        signal = name,
                        "already shutting down; SIGQUIT closes the connections at once, \
                         only SIGKILL skips writing back the caches and storing the bitmaps"
                    ),
                }
                tx.send_if_modified(|i| {
                    let moved = wanted > *i;
                    *i = (*i).max(wanted);
                    moved
                });
            }
        });
        Shutdown { intent: rx }
    }

    /// The next signal; `None` once the runtime no longer delivers any.
    async fn next(&mut self) -> Option<(&'static str, Intent)> {
        tokio::select! {
            Some(()) = self.interrupt.recv() => Some(("SIGINT", Intent::Stop)),
            Some(()) = self.terminate.recv() => Some(("SIGTERM", Intent::Stop)),
            Some(()) = self.hangup.recv() => Some(("SIGHUP", Intent::Stop)),
            Some(()) = self.quit.recv() => Some(("SIGQUIT", Intent::Force)),
            else => None,
        }
    }
}
