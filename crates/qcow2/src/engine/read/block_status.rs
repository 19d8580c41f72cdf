//! Block status: what each guest byte is (data, zeros, nothing) and which layer provides it,
//! with the meanings `qemu-img map --output=json` gives its keys.

use crate::engine::infra::chain::Source;
use crate::engine::infra::error::Result;
use crate::engine::infra::image::Image;
use crate::engine::infra::range_lock::LockMode;
use crate::format::GuestOffset;
use storage::Storage;

/// A run of guest bytes with the same status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First guest byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// Reads from stored data (qemu-img map's `data`).
    pub data: bool,
    /// Reads as zeros (`zero`).
    pub zero: bool,
    /// Allocated as data or zeros in some layer (`present`).
    pub present: bool,
    /// The layer that provides it when present, else the deepest layer that covers it
    /// (`depth`: 0 = the opened image).
    pub depth: usize,
    /// Stored compressed (`compressed`).
    pub compressed: bool,
    /// Where the data is in its layer's data file (`offset`), for uncompressed data.
    pub offset: Option<u64>,
}

impl Extent {
    /// NBD `qemu:allocation-depth`: 0 when absent, else 1 for the opened image, n for layer n-1.
    pub fn allocation_depth(&self) -> u32 {
        if self.present {
            u32::try_from(self.depth + 1).unwrap_or(u32::MAX)
        } else {
            0
        }
    }

    /// True when `next` can be merged into `self` without changing what either says.
    fn continues(&self, next: &Extent) -> bool {
        self.start + self.len == next.start
            && self.data == next.data
            && self.zero == next.zero
            && self.present == next.present
            && self.depth == next.depth
            && self.compressed == next.compressed
            && match (self.offset, next.offset) {
                (None, None) => true,
                (Some(a), Some(b)) => a + self.len == b,
                _ => false,
            }
    }
}

impl<S: Storage + 'static> Image<S> {
    /// The status of `[offset, offset + len)`, as extents in guest order covering it exactly.
    pub async fn block_status(&self, offset: GuestOffset, len: u64) -> Result<Vec<Extent>> {
        let inner = &self.inner;
        inner.check_range(offset, len)?;
        let _guard = inner.lock_range(offset, len, LockMode::Shared).await;
        let mut pieces = Vec::new();
        inner.resolve(offset, len, &mut pieces).await?;
        let mut out: Vec<Extent> = Vec::with_capacity(pieces.len());
        let mut push = |e: Extent| match out.last_mut() {
            Some(last) if last.continues(&e) => last.len += e.len,
            _ => out.push(e),
        };
        for p in pieces {
            // Extents are the public answer: the typed offsets end here.
            let base = Extent {
                start: p.start.0,
                len: p.len,
                data: false,
                zero: true,
                present: p.present,
                depth: p.layer,
                compressed: false,
                offset: None,
            };
            match p.src {
                // A zero cluster that keeps its host cluster has an offset, as in QEMU.
                Source::Zero { host } => push(Extent {
                    offset: host.map(|h| h.0),
                    ..base
                }),
                Source::Compressed { .. } => push(Extent {
                    data: true,
                    zero: false,
                    compressed: true,
                    ..base
                }),
                Source::Data { host } => {
                    // Raw layers take the file's status: holes are zeros, not data. A qcow2
                    // layer asks its file only when QEMU would (metadata preallocation), and
                    // then data over a hole is data that reads as zeros.
                    let layer = &inner.layer(p.layer);
                    let raw = layer.is_raw();
                    if !raw && !self.metadata_preallocated(p.layer).await {
                        // Ciphertext is no copy of the guest's data: like QEMU, no offset.
                        let encrypted = layer.crypto().is_some();
                        push(Extent {
                            data: true,
                            zero: false,
                            offset: (!encrypted).then_some(host.0),
                            ..base
                        });
                        continue;
                    }
                    if raw {
                        // A protocol's status as QEMU takes it: a run that is neither data
                        // nor zeros (an NBD hole of unknown contents) is not present.
                        let mut pos = 0;
                        for (st, n) in layer.status_runs(host, p.len).await? {
                            let known = st.data || st.zero;
                            push(Extent {
                                start: p.start.0 + pos,
                                len: n,
                                data: st.data,
                                zero: st.zero,
                                present: p.present && known,
                                offset: known.then_some(host.0 + pos),
                                ..base
                            });
                            pos += n;
                        }
                        continue;
                    }
                    let mut pos = 0;
                    for (stored, n) in layer.stored_runs(host, p.len).await? {
                        push(Extent {
                            start: p.start.0 + pos,
                            len: n,
                            data: true,
                            zero: !stored,
                            offset: Some(host.0 + pos),
                            ..base
                        });
                        pos += n;
                    }
                }
            }
        }
        Ok(out)
    }
}
