//! Reading guest data: resolve the range through the chain, then one I/O per contiguous host
//! run, zeros filled in memory, compressed clusters decoded.

pub(crate) mod block_status;
pub(crate) mod prealloc_detect;
pub(crate) mod sparse;

use super::compress;
use super::infra::chain::{Piece, Source};
use super::infra::error::{EngineError, Result};
use super::infra::image::{Image, Inner};
use super::infra::join_all::join_all;
use super::infra::range_lock::LockMode;
use crate::crypto::SECTOR_SIZE;
use crate::format::{CompressedDescriptor, GuestOffset, HostOffset, Location, Structure};
use std::rc::Rc;
use storage::{Event, IoBuf, Storage};

impl<S: Storage + 'static> Image<S> {
    /// Reads `len` guest bytes at `offset` into a new buffer.
    pub async fn read(&self, offset: GuestOffset, len: usize) -> Result<IoBuf> {
        let (res, buf) = self.read_into(offset, IoBuf::zeroed(len)).await;
        res.map(|()| buf)
    }

    /// Reads `buf.len()` guest bytes at `offset` into `buf`, which is handed back either way.
    pub async fn read_into(&self, offset: GuestOffset, buf: IoBuf) -> (Result<()>, IoBuf) {
        self.inner.read_into(offset, buf).await
    }
}

/// Largest uncovered gap read (and then overwritten) to join two runs into one request.
const MAX_BRIDGE: usize = 64 << 10;

/// Whether a run starting at `(at, layer, host)` continues `last` across an uncovered gap: same
/// file, the same distance apart in the file as in the buffer, and the gap small enough that
/// reading it costs less than a second request.
fn bridges(
    last: (usize, u64, usize, HostOffset),
    (at, layer, host): (usize, usize, HostOffset),
) -> bool {
    let (last_at, last_len, last_layer, last_host) = last;
    let Some(last_end) = last_at.checked_add(last_len as usize) else {
        return false;
    };
    layer == last_layer
        && at > last_end
        && at - last_end <= MAX_BRIDGE
        && host.0.checked_sub(last_host.0) == Some((at - last_at) as u64)
}

impl<S: Storage + 'static> Inner<S> {
    pub(crate) async fn read_into(
        &self,
        offset: GuestOffset,
        mut buf: IoBuf,
    ) -> (Result<()>, IoBuf) {
        let len = buf.len() as u64;
        if let Err(e) = self.check_range(offset, len) {
            return (Err(e), buf);
        }
        if len == 0 {
            return (Ok(()), buf);
        }
        if let Some((from, to)) = self.sector_aligned(offset, len) {
            // Encrypted data is deciphered in whole sectors: read those, hand back the part.
            let _guard = self.lock_range(from, to - from, LockMode::Shared).await;
            let (res, whole) = self
                .read_unlocked(from, IoBuf::zeroed((to - from) as usize))
                .await;
            if res.is_ok() {
                let at = (offset - from) as usize;
                buf.copy_from_slice(&whole[at..at + len as usize]);
            }
            return (res, buf);
        }
        // Shared: no cluster under us may be freed and reused while we read it.
        let _guard = self.lock_range(offset, len, LockMode::Shared).await;
        self.read_unlocked(offset, buf).await
    }

    /// Reads with the caller holding a lock on the range.
    pub(crate) async fn read_unlocked(
        &self,
        offset: GuestOffset,
        mut buf: IoBuf,
    ) -> (Result<()>, IoBuf) {
        let len = buf.len() as u64;
        let mut pieces = Vec::new();
        if let Err(e) = self.resolve(offset, len, &mut pieces).await {
            return (Err(e), buf);
        }
        let res = self.fill(offset, &pieces, &mut buf).await;
        (res, buf)
    }

    /// For a chain with encrypted layers, the whole sectors around `[offset, offset + len)`
    /// when it is not made of whole sectors (clipped to the disk); otherwise `None`.
    pub(crate) fn sector_aligned(
        &self,
        offset: GuestOffset,
        len: u64,
    ) -> Option<(GuestOffset, GuestOffset)> {
        let (offset, end) = (offset.0, offset.0 + len);
        if (offset | end) % SECTOR_SIZE == 0 || !self.encrypted() {
            return None;
        }
        let size = self.top().size.get();
        let from = offset - offset % SECTOR_SIZE;
        let to = end
            .div_ceil(SECTOR_SIZE)
            .saturating_mul(SECTOR_SIZE)
            .min(size);
        Some((GuestOffset(from), GuestOffset(to)))
    }

    /// Deciphers `buf`, just read from `host` of layer `li` for guest offset `guest`, when
    /// that layer is encrypted.
    pub(crate) fn decrypt(
        &self,
        li: usize,
        host: HostOffset,
        guest: GuestOffset,
        buf: &mut [u8],
    ) -> Result<()> {
        let layer = &self.layer(li);
        match layer.crypto() {
            Some(c) => c
                .decrypt(host.0, guest.0, buf)
                .map_err(|source| EngineError::Crypto {
                    image: layer.name.clone(),
                    source,
                }),
            None => Ok(()),
        }
    }

    /// Copies the pieces (in guest order) into `buf`. Bytes of `buf` that no piece covers may
    /// be overwritten: a copy-on-write puts the guest's data there afterwards.
    ///
    /// Data runs in different places (other layers of a chain, or non-contiguous clusters)
    /// are read concurrently: one after another, a 1 MiB read through a deep chain costs
    /// sixteen device round trips instead of one. Two runs of one file separated only by
    /// uncovered bytes at the same distance in the file (a copy-on-write's head and tail
    /// around a small write) are read as one, straight into `buf`: one device request, no
    /// bounce buffers, no copy.
    pub(crate) async fn fill(
        &self,
        base: GuestOffset,
        pieces: &[Piece],
        buf: &mut IoBuf,
    ) -> Result<()> {
        // (offset in buf, length, layer, host offset) of each run of data to read.
        let mut runs: Vec<(usize, u64, usize, HostOffset)> = Vec::new();
        // With the pieces in increasing order, a data piece right after another lies after the
        // last run with no piece in between: what may be bridged is uncovered.
        let ordered = pieces.windows(2).all(|w| w[0].end() <= w[1].start);
        let mut i = 0;
        while i < pieces.len() {
            let p = pieces[i];
            let at = (p.start.0 - base.0) as usize;
            match p.src {
                Source::Zero { .. } => {
                    buf[at..at + p.len as usize].fill(0);
                    i += 1;
                }
                Source::Compressed { raw, cluster } => {
                    let data = self.decompress(p.layer, raw).await?;
                    let from = (p.start.0 - cluster.0) as usize;
                    buf[at..at + p.len as usize]
                        .copy_from_slice(&data[from..from + p.len as usize]);
                    i += 1;
                }
                Source::Data { host } => {
                    // Merge following pieces that continue this one in the same file.
                    let mut len = p.len;
                    let mut j = i + 1;
                    while let Some(q) = pieces.get(j).filter(|q| pieces[j - 1].continues_data(q)) {
                        len += q.len;
                        j += 1;
                    }
                    let after_run = i > 0 && matches!(pieces[i - 1].src, Source::Data { .. });
                    match runs.last_mut() {
                        Some(last)
                            if ordered && after_run && bridges(*last, (at, p.layer, host)) =>
                        {
                            last.1 = (at - last.0) as u64 + len;
                        }
                        _ => runs.push((at, len, p.layer, host)),
                    }
                    i = j;
                }
            }
        }
        if runs.is_empty() {
            return Ok(());
        }
        if let [(at, len, li, host)] = runs[..] {
            // One run: straight into the caller's buffer, no copy.
            let layer = &self.layer(li);
            layer.announce(Event::ReadAio);
            let owned = std::mem::replace(buf, IoBuf::zeroed(0));
            let (res, slice) = layer
                .data_storage()
                .read_at(owned.slice(at..at + len as usize), host.0)
                .await;
            *buf = slice.into_inner();
            res.map_err(|e| layer.io_error("reading data", host.0, e))?;
            let run = &mut buf[at..at + len as usize];
            return self.decrypt(li, host, GuestOffset(base.0 + at as u64), run);
        }
        let reads = runs.iter().map(|&(_, len, li, host)| async move {
            let layer = &self.layer(li);
            layer.announce(Event::ReadAio);
            let tmp = IoBuf::zeroed(len as usize);
            let (res, slice) = layer
                .data_storage()
                .read_at(tmp.slice(0..len as usize), host.0)
                .await;
            (
                res.map_err(|e| layer.io_error("reading data", host.0, e)),
                slice.into_inner(),
            )
        });
        let done = join_all(reads.collect()).await;
        for (&(at, len, li, host), (res, mut tmp)) in runs.iter().zip(done) {
            res?;
            self.decrypt(
                li,
                host,
                GuestOffset(base.0 + at as u64),
                &mut tmp[..len as usize],
            )?;
            buf[at..at + len as usize].copy_from_slice(&tmp[..len as usize]);
        }
        Ok(())
    }

    /// Decodes one compressed cluster of layer `li` (the raw L2 word says where it is).
    pub(crate) async fn decompress(&self, li: usize, raw: u64) -> Result<Rc<[u8]>> {
        if let Some(data) = self.recall_decompressed(li, raw) {
            return Ok(data);
        }
        let layer = &self.layer(li);
        let meta = layer
            .qcow2()
            .expect("compressed clusters exist only in qcow2 layers");
        let cs = meta.geom.cluster_size() as usize;
        let at = Location::at(Structure::L2Table, 0);
        let desc =
            CompressedDescriptor::decode(raw, meta.geom.cluster_bits(), at).map_err(|source| {
                EngineError::Format {
                    image: layer.name.clone(),
                    source,
                }
            })?;
        let (offset, len) = desc.byte_range();
        if offset >= meta.file_end.get() {
            return Err(layer.corrupt(format!(
                "compressed cluster at {offset:#x} is past the end of the file ({:#x} bytes)",
                meta.file_end.get()
            )));
        }
        layer.announce(Event::ReadCompressed);
        let input = layer
            .read_file("reading a compressed cluster", offset, len as usize)
            .await?;
        let mut out = vec![0u8; cs];
        compress::decompress(meta.codec, &input, &mut out).map_err(|source| {
            EngineError::Compressed {
                image: layer.name.clone(),
                offset,
                source,
            }
        })?;
        let data: Rc<[u8]> = out.into();
        self.remember_decompressed(li, raw, &data);
        Ok(data)
    }
}
