//! Flush and close: write back every dirty table in dependency order, then fdatasync, so that
//! everything written before a FLUSH (or a FUA write) survives a crash.

use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::{Image, Inner};
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Makes every completed write durable.
    pub async fn flush(&self) -> Result<()> {
        self.inner.flush().await
    }

    /// Stores the persistent bitmaps, flushes and, for lazy-refcount images, clears the
    /// dirty bit: the image is left clean.
    pub async fn close(&self) -> Result<()> {
        if let Some(a) = self.inner.writer() {
            if !a.top().sync_failed.get() {
                a.store_bitmaps().await?;
            }
        }
        self.inner.flush().await?;
        match self.inner.writer() {
            Some(a) => {
                a.mark_clean().await?;
                let top = self.inner.top();
                a.trim_growth()
                    .await
                    .map_err(|e| top.io_error("truncating the space grown ahead", 0, e))
            }
            None => Ok(()),
        }
    }
}

impl<S: Storage + 'static> Inner<S> {
    pub(crate) async fn flush(&self) -> Result<()> {
        if self.is_read_only() {
            return Ok(());
        }
        let top = self.top();
        let cache_err = |source| EngineError::Cache {
            image: top.name.clone(),
            source,
        };
        if let Some(w) = self.writer() {
            // L2 first: its dependency on the refcount cache makes refcounts go out before it.
            self.l2().flush().await.map_err(cache_err)?;
            w.flush_refcounts().await?;
        }
        // Guest data written in place touches no cache: sync explicitly.
        crate::engine::infra::metacache::flush_layer(top)
            .await
            .map_err(|e| top.io_error("flushing", 0, e))
    }
}
