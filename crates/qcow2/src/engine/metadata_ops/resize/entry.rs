//! What `resize` checks before it changes anything, in QEMU's order and words, and the
//! resize of a raw file.

pub use crate::engine::infra::error::ResizeError;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::layer::{write_zero_data, Qcow2Meta};
use crate::engine::metadata_ops::create::Preallocation;
use crate::format::header;
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Changes the virtual disk to `new_size` bytes (for qcow2, a multiple of 512). New space reads as
    /// zeros, even over a longer backing file, and is allocated as `prealloc` says; a
    /// shrink drops every cluster past the new end. Asking before shrinking is the caller's
    /// business, as it is qemu-img's.
    pub async fn resize(&self, new_size: u64, prealloc: Preallocation) -> Result<()> {
        self.inner.check_writable()?;
        let top = self.inner.top();
        let refuse = |source| EngineError::Resize {
            image: top.name.clone(),
            source,
        };
        let old_size = top.size.get();
        let Some(meta) = top.qcow2() else {
            // A raw file or a LUKS volume: the file is the disk (after the LUKS header).
            return self.resize_raw(old_size, new_size, prealloc).await;
        };
        // A raw file takes any length; qcow2 sizes are whole sectors.
        if new_size % 512 != 0 {
            return Err(refuse(ResizeError::Unaligned));
        }
        self.check_qcow2_resize(meta, new_size)?;
        if new_size < old_size {
            if prealloc != Preallocation::Off {
                return Err(refuse(ResizeError::PreallocShrink));
            }
            self.shrink(new_size).await
        } else if new_size > old_size {
            self.grow(new_size, prealloc).await
        } else {
            Ok(())
        }
    }

    /// The last step of a qcow2 resize, once everything the new size needs is on disk: the
    /// header's size field, made durable, then the size in memory and the bitmaps' length.
    pub(super) async fn set_qcow2_size(&self, new_size: u64) -> Result<()> {
        let w = self.inner.alloc()?;
        let top = self.inner.top();
        let meta = top.qcow2_required()?;
        w.update_header(header::size_update(new_size)).await?;
        w.sync().await?;
        meta.header.borrow_mut().size = new_size;
        top.size.set(new_size);
        w.change_bitmaps(|b| b.resize(new_size));
        Ok(())
    }

    /// What QEMU refuses for any qcow2 resize, checked before anything is written.
    fn check_qcow2_resize(&self, meta: &Qcow2Meta<S>, new_size: u64) -> Result<()> {
        let top = self.inner.top();
        let (version, snapshots) = {
            let h = meta.header.borrow();
            (h.version, h.nb_snapshots)
        };
        if version < 3 && snapshots > 0 {
            return Err(EngineError::Resize {
                image: top.name.clone(),
                source: ResizeError::V2Snapshots,
            });
        }
        if meta.data_file.is_some() {
            return Err(EngineError::Unsupported {
                image: top.name.clone(),
                what: "resizing an image with an external data file".into(),
            });
        }
        self.inner
            .alloc()?
            .with_bitmaps(|b| b.check_resize(new_size))
            .map_err(|source| EngineError::Bitmap {
                image: top.name.clone(),
                source,
            })
    }

    /// A raw file is its disk: truncate or extend it, reserving (`falloc`) or writing
    /// (`full`) the new space when asked; an empty file grown gets its first block written
    /// ([`storage::allocate_first_block`]).
    async fn resize_raw(
        &self,
        old_size: u64,
        new_size: u64,
        prealloc: Preallocation,
    ) -> Result<()> {
        let top = self.inner.top();
        let refuse = |source| EngineError::Resize {
            image: top.name.clone(),
            source,
        };
        // A LUKS volume's disk starts after its header: the file is its payload offset longer.
        let base = top.luks().map_or(0, |m| m.payload);
        let (old_end, new_end) = match (base.checked_add(old_size), base.checked_add(new_size)) {
            (Some(o), Some(n)) => (o, n),
            _ => return Err(top.unsupported_here("a size past the largest file offset")),
        };
        match prealloc {
            Preallocation::Metadata => return Err(refuse(ResizeError::RawMetadata)),
            Preallocation::Off => {}
            _ if new_size < old_size => return Err(refuse(ResizeError::PreallocShrink)),
            _ => {}
        }
        let was_empty = top
            .file
            .len()
            .await
            .map_err(|e| top.io_error("reading the file's length", 0, e))?
            == 0;
        top.file
            .set_len(new_end)
            .await
            .map_err(|e| top.io_error("resizing the file", new_end, e))?;
        let grown = new_size.saturating_sub(old_size);
        match prealloc {
            Preallocation::Falloc => top
                .file
                .write_zeroes_at(old_end, grown, false)
                .await
                .map_err(|e| top.io_error("preallocating", old_end, e))?,
            Preallocation::Full => write_zero_data(top, old_end, grown).await?,
            Preallocation::Off | Preallocation::Metadata => {}
        }
        if was_empty && prealloc != Preallocation::Full {
            // QEMU's `file` driver writes the first block of a file it grows from empty; an
            // optimisation there, so a failure is ignored as QEMU ignores it.
            let _ = storage::allocate_first_block(&top.file, new_end).await;
        }
        top.file
            .flush()
            .await
            .map_err(|e| top.io_error("flushing", 0, e))?;
        top.size.set(new_size);
        Ok(())
    }
}
