//! The refcounts as stored in the image: reading them cluster by cluster through the refcount
//! table, and changing them in existing refcount blocks (repairs never need a new block: a
//! cluster without one has refcount 0, which only a rebuild can fix).

use super::error::CheckError;
use super::io;
use super::pass::Pass;
use crate::engine::infra::overlap::MetaKind;
use crate::format::refcount;
use storage::{IoBuf, Storage};

/// Why a stored refcount could not be read.
#[derive(Debug)]
pub(crate) enum GetError {
    /// The refcount table points to a block that is not cluster-aligned.
    Unaligned { block: u64, index: u64 },
    /// The block could not be read.
    Io(CheckError),
}

impl GetError {
    /// The strerror-style text QEMU prints after "Can't get refcount for cluster N: ".
    pub fn reason(&self) -> String {
        match self {
            GetError::Unaligned { block, index } => format!(
                "Input/output error (refcount block {block:#x} of refcount table entry {index} is not cluster-aligned)"
            ),
            GetError::Io(e) => e.to_string(),
        }
    }
}

/// One cached refcount block, the way a check walks them: in order, one at a time.
#[derive(Default)]
pub(crate) struct Refblocks {
    block: Option<(u64, IoBuf)>,
    dirty: bool,
    /// Clusters whose refcount a repair dropped to zero, to deallocate once written.
    freed: Vec<u64>,
}

impl Refblocks {
    /// The bytes of the cached block.
    pub fn cached(&self) -> Option<&[u8]> {
        self.block.as_ref().map(|(_, buf)| &buf[..])
    }
}

impl<S: Storage> Pass<'_, S> {
    /// The stored refcount of cluster `k` (QEMU's `qcow2_get_refcount`).
    pub async fn stored_refcount(&mut self, rb: &mut Refblocks, k: u64) -> Result<u64, GetError> {
        if let Some(v) = self.cached_refcount(rb, k) {
            return Ok(v);
        }
        let index = k >> self.meta.refblock_bits;
        let block = self.meta.refblock_of(k);
        if block == 0 {
            return Ok(0);
        }
        if self.meta.in_cluster(block) != 0 {
            self.signal_corruption(format!(
                "Refblock offset {block:#x} unaligned (reftable index: {index:#x})"
            ))
            .await;
            return Err(GetError::Unaligned { block, index });
        }
        self.load_refblock(rb, block).await.map_err(GetError::Io)?;
        let entry = k & (self.meta.refblock_entries() - 1);
        let order = self.meta.refcount_order;
        let Some((_, buf)) = &rb.block else {
            return Ok(0);
        };
        // The index is below the entries of one cluster-sized block.
        Ok(refcount::get(buf, order, entry as usize).unwrap_or(0))
    }

    /// The stored refcount of cluster `k` when its block is the cached one: the common case
    /// of a walk, answered without the async path.
    fn cached_refcount(&self, rb: &Refblocks, k: u64) -> Option<u64> {
        let block = self.meta.refblock_of(k);
        let (cached, buf) = rb.block.as_ref()?;
        if block == 0 || *cached != block {
            return None;
        }
        // The entry index is below the entries of one cluster-sized block.
        let entry = (k & (self.meta.refblock_entries() - 1)) as usize;
        refcount::get(buf, self.meta.refcount_order, entry).ok()
    }

    /// Stores refcount `value` for cluster `k`, whose block exists (it was just read).
    pub async fn set_stored_refcount(
        &mut self,
        rb: &mut Refblocks,
        k: u64,
        value: u64,
    ) -> Result<(), CheckError> {
        let block = self.meta.refblock_of(k);
        if block == 0 || self.meta.in_cluster(block) != 0 {
            return Err(CheckError::io(
                "updating a refcount",
                k << self.meta.cluster_bits,
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            ));
        }
        self.load_refblock(rb, block).await?;
        let entry = (k & (self.meta.refblock_entries() - 1)) as usize;
        let order = self.meta.refcount_order;
        if let Some((_, buf)) = &mut rb.block {
            refcount::set(buf, order, entry, value).map_err(|e| {
                CheckError::io(
                    "updating a refcount",
                    k << self.meta.cluster_bits,
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
                )
            })?;
            rb.dirty = true;
            if value == 0 {
                rb.freed.push(k);
            }
        }
        Ok(())
    }

    /// Makes `block` the cached block, writing back the previous one if a repair changed it.
    pub(super) async fn load_refblock(
        &mut self,
        rb: &mut Refblocks,
        block: u64,
    ) -> Result<(), CheckError> {
        if rb.block.as_ref().is_some_and(|(b, _)| *b == block) {
            return Ok(());
        }
        self.write_back_refblock(rb).await?;
        // One cluster. The previous block's buffer is read over rather than a fresh one
        // zeroed: a walk loads every block.
        let len = self.meta.cluster_size as usize;
        let buf = match rb.block.take() {
            Some((_, buf)) if buf.len() == len => buf,
            _ => IoBuf::zeroed(len),
        };
        let buf = io::read_into(self.file, "reading a refcount block", block, buf).await?;
        rb.block = Some((block, buf));
        Ok(())
    }

    /// Writes the cached block back if a repair changed it, then deallocates the clusters
    /// that became free (QEMU discards them too; a file system without hole punching keeps
    /// the bytes, which is harmless).
    pub async fn write_back_refblock(&mut self, rb: &mut Refblocks) -> Result<(), CheckError> {
        if !rb.dirty {
            return Ok(());
        }
        rb.dirty = false;
        if let Some((block, buf)) = rb.block.take() {
            self.guarded_write(
                "writing a refcount block",
                block,
                &buf,
                &[MetaKind::RefcountBlock],
            )
            .await?;
            rb.block = Some((block, buf));
        }
        let cs = self.meta.cluster_size;
        for k in std::mem::take(&mut rb.freed) {
            let _ = self.file.discard_at(k << self.meta.cluster_bits, cs).await;
        }
        Ok(())
    }
}
