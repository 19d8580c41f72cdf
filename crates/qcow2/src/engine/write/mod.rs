//! Writing guest data: in place where the cluster is ours, otherwise allocate (only the
//! subclusters a write touches, with extended L2 entries) and copy what the write does not
//! cover from wherever the guest currently reads it (backing file, zeros, a compressed or
//! shared cluster). Copy-on-write data and guest data go out as one I/O per run of
//! clusters; copies of zeros into freshly allocated clusters are skipped.
//!
//! `plan` decides what happens to each cluster; `execute` carries the plan out.
//!
//! Concurrency: writes that keep every cluster where it is hold a shared range lock, those
//! that move or fill clusters hold an exclusive one, so two copy-on-writes of one subcluster
//! never overwrite each other's data, and a read never sees a cluster being reused.

pub(crate) mod compressed;
mod discard;
mod execute;
mod flush;
mod luks;
mod plan;
mod preallocate;
mod zero;

use super::infra::error::Result;
use super::infra::image::{Image, Inner};
use super::infra::range_lock::LockMode;
use crate::format::GuestOffset;
use plan::Action;
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Image<S> {
    /// Writes `buf` at guest `offset`; with `fua` the data (and the metadata that makes it
    /// reachable) is durable before this returns. The buffer is handed back either way.
    pub async fn write(&self, offset: GuestOffset, buf: IoBuf, fua: bool) -> (Result<()>, IoBuf) {
        let (res, buf) = self.inner.write(offset, buf).await;
        if res.is_ok() && fua {
            return (self.flush().await, buf);
        }
        (res, buf)
    }
}

impl<S: Storage + 'static> Inner<S> {
    pub(crate) async fn write(&self, offset: GuestOffset, buf: IoBuf) -> (Result<()>, IoBuf) {
        let len = buf.len() as u64;
        if let Err(e) = self
            .check_writable()
            .and_then(|_| self.check_range(offset, len))
        {
            return (Err(e), buf);
        }
        if len == 0 {
            return (Ok(()), buf);
        }
        self.track(offset, len);
        let top = self.top();
        if top.luks().is_some() {
            return self.write_luks(offset, buf).await;
        }
        if top.qcow2().is_none() {
            // A raw layer 0 is the guest's disk byte for byte.
            let (res, slice) = top.file.write_at(buf.into(), offset.0).await;
            return (
                res.map_err(|e| top.io_error("writing data", offset.0, e)),
                slice.into_inner(),
            );
        }
        if let Some((from, to)) = self.sector_aligned(offset, len) {
            // Encrypted data is written in whole sectors: the partial ones are read,
            // patched and written back, under an exclusive lock so that nothing else
            // writes them in between.
            let _exclusive = self.lock_range(from, to - from, LockMode::Exclusive).await;
            return self.write_unlocked(offset, buf).await;
        }
        let generation = match self.alloc() {
            Ok(a) => a.mapping_generation(),
            Err(e) => return (Err(e), buf),
        };
        // Most writes land in clusters we own: try that under a shared lock first.
        let plans = {
            let _shared = self.lock_range(offset, len, LockMode::Shared).await;
            match self.plan(offset, len).await {
                Err(e) => return (Err(e), buf),
                Ok(plans)
                    if plans
                        .iter()
                        .all(|p| matches!(p.action, Action::InPlace { .. })) =>
                {
                    return self.execute(offset, buf, &plans).await;
                }
                Ok(plans) => plans,
            }
        };
        let _exclusive = self.lock_range(offset, len, LockMode::Exclusive).await;
        // The plan holds unless some mapping changed while we waited for the lock; only then
        // is it made again.
        match self.alloc() {
            Ok(a) if a.mapping_generation() == generation => {
                self.execute(offset, buf, &plans).await
            }
            Ok(_) => self.write_unlocked(offset, buf).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// Writes with the caller holding an exclusive lock on the range (qcow2 layer 0 only).
    pub(crate) async fn write_unlocked(
        &self,
        offset: GuestOffset,
        buf: IoBuf,
    ) -> (Result<()>, IoBuf) {
        if let Some((from, to)) = self.sector_aligned(offset, buf.len() as u64) {
            let (res, mut whole) = self
                .read_unlocked(from, IoBuf::zeroed((to - from) as usize))
                .await;
            if let Err(e) = res {
                return (Err(e), buf);
            }
            let at = (offset - from) as usize;
            whole[at..at + buf.len()].copy_from_slice(&buf);
            let (res, _) = self.write_aligned(from, whole).await;
            return (res, buf);
        }
        self.write_aligned(offset, buf).await
    }

    /// [`Inner::write_unlocked`] of whole sectors (any range, for an unencrypted image).
    async fn write_aligned(&self, offset: GuestOffset, buf: IoBuf) -> (Result<()>, IoBuf) {
        if self.top().luks().is_some() {
            return self.seal_luks(offset, buf).await;
        }
        match self.plan(offset, buf.len() as u64).await {
            Err(e) => (Err(e), buf),
            Ok(plans) => self.execute(offset, buf, &plans).await,
        }
    }
}
