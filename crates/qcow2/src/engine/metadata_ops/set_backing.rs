//! Changing the backing file an image names (`qemu-img rebase`): one rewrite of the header
//! cluster, after everything written before it is durable, made durable itself.

use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::load::Format;
use storage::Storage;

impl<S: Storage + 'static> Image<S> {
    /// Names `name` (of format `format`) as the image's backing file, or no backing file
    /// with `None`. Everything written before is made durable first, so the new name never
    /// reaches disk ahead of the data that makes the image read right over the new backing
    /// file. This open keeps reading through the chain it opened; later opens follow the new
    /// name.
    pub async fn set_backing_file(&self, name: Option<&str>, format: Option<Format>) -> Result<()> {
        self.set_backing_file_format_name(name, format.map(|f| f.name()))
            .await
    }

    /// Records a backing file with a format given by name, one this engine may not read
    /// (as `qemu-img rebase -u -F host_device` records one): only the header changes.
    pub async fn set_backing_file_format_name(
        &self,
        name: Option<&str>,
        format: Option<&str>,
    ) -> Result<()> {
        self.inner.check_writable()?;
        let top = self.inner.top();
        let meta = top.qcow2().ok_or_else(|| EngineError::Unsupported {
            image: top.name.clone(),
            what: "a backing file for a raw image".into(),
        })?;
        let w = self.inner.alloc()?;
        self.inner.flush().await?;
        let mut h = meta.header.borrow().clone();
        h.set_backing(
            name.map(|n| n.as_bytes().to_vec()),
            format.map(|f| f.as_bytes().to_vec()),
        );
        let bytes = h
            .encode(meta.geom.cluster_size())
            .map_err(|source| EngineError::Format {
                image: top.name.clone(),
                source,
            })?;
        w.write_meta("writing the backing file name", 0, &bytes)
            .await?;
        *meta.header.borrow_mut() = h;
        w.sync().await
    }
}
