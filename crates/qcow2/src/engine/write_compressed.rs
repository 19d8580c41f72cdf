//! Compressed cluster writes (`convert -c`): one whole cluster at a time into an unallocated
//! cluster, packed into shared host clusters as QEMU packs them. Data that does not compress
//! is written as a normal cluster.

use super::compress;
use super::error::{EngineError, Result};
use super::image::{Image, Inner};
use super::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::unpack_bitmap;
use crate::format::{CompressedDescriptor, GuestOffset, HostOffset};
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Image<S> {
    /// Writes one cluster at the cluster-aligned `offset` compressed (the last cluster may be
    /// shorter when the disk ends inside it). Like QEMU, the cluster must be unallocated.
    pub async fn write_compressed(&self, offset: u64, data: IoBuf) -> Result<()> {
        self.inner.write_compressed(offset, data).await
    }
}

impl<S: Storage + 'static> Inner<S> {
    async fn write_compressed(&self, offset: u64, data: IoBuf) -> Result<()> {
        self.check_writable()?;
        let len = data.len() as u64;
        self.check_range(offset, len)?;
        self.track(offset, len);
        let top = self.chain.top();
        let unsupported = |what: &str| EngineError::Unsupported {
            image: top.name.clone(),
            what: what.into(),
        };
        let meta = top
            .qcow2()
            .ok_or_else(|| unsupported("compressed writes to a raw image"))?;
        if meta.data_file.is_some() {
            return Err(unsupported(
                "compressed writes to an image with an external data file",
            ));
        }
        let g = &meta.geom;
        let cs = g.cluster_size();
        let size = top.size.get();
        if offset % cs != 0 || (len != cs && offset + len != size) || len == 0 {
            return Err(unsupported(
                "a compressed write that is not exactly one cluster",
            ));
        }
        let mut cluster = vec![0u8; cs as usize];
        cluster[..len as usize].copy_from_slice(&data);
        let packed =
            compress::compress(meta.codec, &cluster, cs as usize - 1).map_err(|source| {
                EngineError::Compressed {
                    image: top.name.clone(),
                    offset,
                    source,
                }
            })?;
        let Some(packed) = packed else {
            let (res, _) = self.write(offset, data).await;
            return res;
        };
        let _guard = self.lock_range(offset, len, LockMode::Exclusive).await;
        let cluster = GuestOffset(offset);
        let e = self.alloc()?.l2_entries(cluster, 1).await?[0];
        if e.word != 0 || unpack_bitmap(e.bitmap).0 != 0 {
            return Err(unsupported("a compressed write over an allocated cluster"));
        }
        let w = self.alloc()?;
        let host = {
            let _g = w.meta_lock.lock().await;
            w.l2_for_write(g.l1_index(cluster)).await?;
            w.alloc_bytes(packed.len() as u64).await?.0
        };
        let plen = packed.len() as u64;
        w.check_overlap(HostOffset(host), plen).await?;
        let (res, _) = top
            .file
            .write_at(IoBuf::from_slice(&packed).into(), host)
            .await;
        res.map_err(|e| top.io_error("writing a compressed cluster", host, e))?;
        if let Some(wr) = &self.alloc {
            wr.physical_len.set(wr.physical_len.get().max(host + plen));
        }
        let desc = CompressedDescriptor {
            host_offset: host,
            additional_sectors: (host + plen - 1) / 512 - host / 512,
        };
        let word = l2::compressed_word(desc.encode(g.cluster_bits()).map_err(|source| {
            EngineError::Format {
                image: top.name.clone(),
                source,
            }
        })?);
        self.chain
            .l2
            .set_dependency(w.refcounts_flush())
            .await
            .map_err(|source| EngineError::Cache {
                image: top.name.clone(),
                source,
            })?;
        self.chain.l2.set_flush_before_writeback();
        if w.lazy_refcounts {
            w.mark_dirty().await?;
        }
        w.set_l2_entry(cluster, word, 0).await
    }
}
