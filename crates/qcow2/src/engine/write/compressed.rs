//! Compressed cluster writes (`convert -c`): one whole cluster at a time into an unallocated
//! cluster, packed into shared host clusters as QEMU packs them. Data that does not compress
//! is written as a normal cluster.

use crate::engine::alloc::{L2Change, Precedes};
use crate::engine::compress;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::Qcow2Meta;
use crate::engine::infra::range_lock::LockMode;
use crate::format::l2;
use crate::format::l2_extended::unpack_bitmap;
use crate::format::{CompressedDescriptor, GuestOffset, HostOffset};
use storage::{IoBuf, Storage};

/// What compressing one cluster needs, detached from the image so that it can run on any
/// thread (`convert -c` compresses on every core while the engine stays on its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterCompressor {
    codec: compress::Codec,
    cluster_size: u64,
}

/// One cluster's worth of data, compressed or (when it does not shrink) as it was.
#[derive(Debug)]
pub enum PackedCluster {
    /// The compressed stream, shorter than a cluster.
    Compressed(Vec<u8>),
    /// Data that does not compress: written as a normal cluster.
    Raw(IoBuf),
}

impl ClusterCompressor {
    fn of<S>(meta: &Qcow2Meta<S>) -> Self {
        Self {
            codec: meta.codec,
            cluster_size: meta.geom.cluster_size(),
        }
    }

    /// Compresses `data`, one cluster (or the short last one), padded with zeros to a whole
    /// cluster as QEMU does. Pure CPU work: safe to run off the engine's thread.
    pub fn compress(
        &self,
        data: IoBuf,
    ) -> std::result::Result<PackedCluster, compress::CompressError> {
        let cs = self.cluster_size as usize;
        let packed = if data.len() == cs {
            compress::compress(self.codec, &data, cs - 1)?
        } else {
            let mut cluster = vec![0u8; cs];
            let n = data.len().min(cs);
            cluster[..n].copy_from_slice(&data[..n]);
            compress::compress(self.codec, &cluster, cs - 1)?
        };
        Ok(match packed {
            Some(p) => PackedCluster::Compressed(p),
            None => PackedCluster::Raw(data),
        })
    }
}

impl<S: Storage + 'static> Image<S> {
    /// Writes one cluster at the cluster-aligned `offset` compressed (the last cluster may be
    /// shorter when the disk ends inside it). Like QEMU, the cluster must be unallocated.
    pub async fn write_compressed(&self, offset: GuestOffset, data: IoBuf) -> Result<()> {
        let compressor = self.compressor()?;
        // Before the work of compressing: the data must be one cluster.
        self.check_cluster(compressor, offset, data.len() as u64)?;
        let packed = compressor
            .compress(data)
            .map_err(|source| EngineError::Compressed {
                image: self.inner.name(),
                offset: offset.0,
                source,
            })?;
        self.write_packed(offset, packed).await
    }

    /// The compressor for this image's clusters, or why it cannot take compressed writes
    /// (read-only, raw, an external data file).
    pub fn compressor(&self) -> Result<ClusterCompressor> {
        self.compressed_target().map(ClusterCompressor::of)
    }

    /// The top layer's qcow2 metadata, if it can take compressed writes: writable, qcow2,
    /// no external data file.
    fn compressed_target(&self) -> Result<&Qcow2Meta<S>> {
        self.inner.check_writable()?;
        let meta = self
            .inner
            .top()
            .qcow2()
            .ok_or_else(|| self.unsupported("compressed writes to a raw image"))?;
        if meta.data_file.is_some() {
            return Err(
                self.unsupported("compressed writes to an image with an external data file")
            );
        }
        if meta.crypto.is_some() {
            // Compressed clusters are stored in plain text, so QEMU refuses them too.
            return Err(self.unsupported("compressed writes to an encrypted image"));
        }
        Ok(meta)
    }

    fn unsupported(&self, what: &str) -> EngineError {
        EngineError::Unsupported {
            image: self.inner.name(),
            what: what.into(),
        }
    }

    /// `[offset, offset + len)` is exactly one cluster of the disk (or its short last one).
    fn check_cluster(
        &self,
        compressor: ClusterCompressor,
        offset: GuestOffset,
        len: u64,
    ) -> Result<()> {
        self.inner.check_range(offset, len)?;
        let cs = compressor.cluster_size;
        let size = self.inner.top().size.get();
        if offset.0 % cs != 0 || (len != cs && offset.0 + len != size) || len == 0 {
            return Err(self.unsupported("a compressed write that is not exactly one cluster"));
        }
        Ok(())
    }

    /// Writes a cluster [`ClusterCompressor::compress`] packed, at the cluster-aligned
    /// `offset`; the cluster must be unallocated.
    pub async fn write_packed(&self, offset: GuestOffset, packed: PackedCluster) -> Result<()> {
        let meta = self.compressed_target()?;
        let compressor = ClusterCompressor::of(meta);
        let top = self.inner.top();
        let len = match &packed {
            PackedCluster::Raw(data) => data.len() as u64,
            PackedCluster::Compressed(_) => compressor
                .cluster_size
                .min(top.size.get().saturating_sub(offset.0)),
        };
        self.check_cluster(compressor, offset, len)?;
        let packed = match packed {
            PackedCluster::Compressed(p) => p,
            PackedCluster::Raw(data) => {
                let (res, _) = self.inner.write(offset, data).await;
                return res;
            }
        };
        let g = &meta.geom;
        self.inner.track(offset, len);
        let unsupported = |what: &str| self.unsupported(what);
        let _guard = self
            .inner
            .lock_range(offset, len, LockMode::Exclusive)
            .await;
        let cluster = offset;
        let e = self.inner.alloc()?.l2_entries(cluster, 1).await?[0];
        if e.word != 0 || unpack_bitmap(e.bitmap).0 != 0 {
            return Err(unsupported("a compressed write over an allocated cluster"));
        }
        // Allocate, write the data, commit.
        let w = self.inner.alloc()?;
        let allocation = w.allocate_packed(cluster, packed.len() as u64).await?;
        let host = allocation.host.0;
        let plen = packed.len() as u64;
        w.check_overlap(HostOffset(host), plen).await?;
        let (res, _) = top
            .file
            .write_at(IoBuf::from_slice(&packed).into(), host)
            .await;
        res.map_err(|e| top.io_error("writing a compressed cluster", host, e))?;
        w.note_file_end(HostOffset(host + plen));
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
        w.change_l2(
            Precedes::Allocation(allocation),
            [L2Change::set(cluster, word, 0)],
        )
        .await
    }
}
