//! `--cache-clean-interval`: a timer that drops metadata cache entries left unused since the
//! previous tick (QEMU's cache-clean-interval), so an idle server gives memory back: the
//! entries, and then the free heap that I/O buffers left behind (see `malloc_tuning`).

use std::time::Duration;

use qcow2::engine::Image;
use storage::AnyStorage;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

/// A running cleaning timer; [`Cleaner::stop`] ends it between cleanings, never during one.
pub struct Cleaner {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Cleaner {
    /// Starts cleaning `image` every `interval_secs` seconds, or returns `None` for 0.
    /// Must run inside a `LocalSet` (the engine's futures are not `Send`).
    pub fn start(image: Image<AnyStorage>, interval_secs: u64) -> Option<Cleaner> {
        if interval_secs == 0 {
            return None;
        }
        let (stop, mut stopped) = oneshot::channel();
        let period = Duration::from_secs(interval_secs);
        let task = tokio::task::spawn_local(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = ticks.tick() => {}
                }
                // Outside the select: a cleaning that writes back dirty entries is never cut short.
                match image.clean_idle_caches().await {
                    Ok(()) => {
                        tracing::debug!(stats = ?image.l2_cache_stats(), "cleaned idle cache entries")
                    }
                    Err(e) => tracing::warn!(error = %e, "cleaning idle cache entries failed"),
                }
                crate::common::malloc_tuning::release_free_heap();
            }
        });
        Some(Cleaner { stop, task })
    }

    /// Stops the timer, waiting for a cleaning in progress to finish.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "cache cleaning task failed");
        }
    }
}
