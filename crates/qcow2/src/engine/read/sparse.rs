//! Reading with holes: the read an NBD server answers with structured replies, where bytes
//! that read as zeros may be sent as a hole instead of as data.
//!
//! The range is resolved through the chain once, for both questions (what is zero, where is
//! the data). Zeros are what the metadata says reads as zeros (zero clusters and subclusters,
//! nothing allocated anywhere) plus the holes of the file under raw layers, and under the
//! opened image's data clusters when it looks made with `preallocation=metadata` (QEMU's
//! guess, as block status makes it), so reading such an image sends its unwritten clusters
//! as holes. Data clusters of backing qcow2 layers are sent as data without asking: a hole
//! under them reads as zeros either way, and the guess costs three reads of each layer's
//! refcount structures, which through a chain of depth 300 doubled the first full read.
//! Block status still answers every layer exactly as QEMU does.

use crate::engine::infra::chain::{Piece, Source};
use crate::engine::infra::error::Result;
use crate::engine::infra::image::Image;
use crate::engine::infra::join_all::join_all;
use crate::engine::infra::range_lock::LockMode;
use crate::format::{GuestOffset, HostOffset};
use storage::{IoBuf, Storage};

/// A part of a sparse read, in guest order.
#[derive(Debug)]
pub enum ReadPart {
    /// Bytes read (the buffer's whole length).
    Data(IoBuf),
    /// This many bytes that read as zeros.
    Hole(usize),
}

impl<S: Storage + 'static> Image<S> {
    /// Reads `len` guest bytes at `offset` as data and holes covering the range exactly.
    pub async fn read_sparse(&self, offset: GuestOffset, len: usize) -> Result<Vec<ReadPart>> {
        let inner = &self.inner;
        let len64 = len as u64;
        inner.check_range(offset, len64)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        if inner.encrypted() {
            // Holes of an encrypted file are not zeros to the guest, and deciphering works
            // in whole sectors: a plain read does both right.
            return Ok(vec![ReadPart::Data(self.read(offset, len).await?)]);
        }
        let _guard = inner.lock_range(offset, len64, LockMode::Shared).await;
        let mut pieces = Vec::new();
        inner.resolve(offset, len64, &mut pieces).await?;

        // Split data pieces at the file's holes where that is asked, then group by zero / not
        // zero.
        let mut classified: Vec<Piece> = Vec::with_capacity(pieces.len());
        for p in pieces {
            match p.src {
                Source::Zero { .. } | Source::Compressed { .. } => classified.push(p),
                Source::Data { host } => {
                    let layer = &inner.layer(p.layer);
                    let ask =
                        layer.is_raw() || (p.layer == 0 && self.metadata_preallocated(0).await);
                    if !ask {
                        classified.push(p);
                        continue;
                    }
                    let mut pos = 0;
                    for (stored, n) in layer.stored_runs(host, p.len).await? {
                        let src = if stored {
                            Source::Data {
                                host: HostOffset(host.0 + pos),
                            }
                        } else {
                            Source::Zero { host: None }
                        };
                        let part = Piece {
                            start: p.start + pos,
                            len: n,
                            src,
                            ..p
                        };
                        classified.push(part);
                        pos += n;
                    }
                }
            }
        }

        let zero = |p: &Piece| p.src.is_zero();
        let mut out = Vec::new();
        let mut i = 0;
        while i < classified.len() {
            let is_zero = zero(&classified[i]);
            let mut j = i;
            let mut n = 0u64;
            while let Some(p) = classified.get(j).filter(|p| zero(p) == is_zero) {
                n += p.len;
                j += 1;
            }
            let n = n as usize;
            if is_zero {
                out.push(ReadPart::Hole(n));
            } else {
                // Each contiguous run of the file (or compressed cluster) goes into a buffer
                // of its own, all read concurrently: the reply sends them back to back, so
                // nothing is copied into one request-sized buffer.
                let segments = segments(&classified[i..j]);
                if let [seg] = &segments[..] {
                    // The usual case, one run: awaited here, without join_all's boxes.
                    out.push(ReadPart::Data(self.read_segment(seg).await?));
                } else {
                    let reads = segments.iter().map(|seg| self.read_segment(seg));
                    for buf in join_all(reads.collect()).await {
                        out.push(ReadPart::Data(buf?));
                    }
                }
            }
            i = j;
        }
        Ok(out)
    }
}

impl<S: Storage + 'static> Image<S> {
    /// Reads one segment (see [`segments`]) into a buffer of its own.
    async fn read_segment(&self, seg: &[Piece]) -> Result<IoBuf> {
        let len: u64 = seg.iter().map(|p| p.len).sum();
        let mut buf = IoBuf::zeroed(len as usize);
        self.inner
            .fill(seg[0].start, seg, &mut buf)
            .await
            .map(|()| buf)
    }
}

/// Splits non-zero pieces into what one read fills: pieces continuing each other in the same
/// file, or one compressed piece.
fn segments(pieces: &[Piece]) -> Vec<Vec<Piece>> {
    let mut out: Vec<Vec<Piece>> = Vec::new();
    for &p in pieces {
        match out.last_mut() {
            Some(seg) if seg.last().is_some_and(|last| last.continues_data(&p)) => seg.push(p),
            _ => out.push(vec![p]),
        }
    }
    out
}
