//! Changing the key slots of a LUKS-encrypted image (`amend -o encrypt.state=...`) or a LUKS
//! volume (`amend -o state=...`): the LUKS area is read, changed in memory and written back
//! in place, then flushed.

use crate::crypto::luks::HEADER_LEN;
use crate::crypto::{LuksHeader, SlotChange};
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Image<S> {
    /// Adds or erases key slots as `change` says; `password` is the one the image was
    /// opened with (a new slot stores the master key it unlocks).
    pub async fn change_key_slots(&self, password: &[u8], change: &SlotChange) -> Result<()> {
        let inner = &self.inner;
        inner.check_writable()?;
        let top = inner.top();
        // A LUKS volume's area starts the file and ends at its payload.
        let fde = match top.luks() {
            Some(l) => Some((0, l.payload)),
            None => top
                .qcow2_required()?
                .header
                .borrow()
                .fde_pointer()
                .map(|p| (p.offset, p.length)),
        };
        let crypto = |source| EngineError::Crypto {
            image: top.name.clone(),
            source,
        };
        let Some((offset, length)) = fde else {
            return Err(EngineError::Unsupported {
                image: top.name.clone(),
                what: "key slots of an image without LUKS encryption".into(),
            });
        };
        if length > crate::crypto::luks::MAX_AREA {
            return Err(top.corrupt(format!(
                "encryption header of {length} bytes exceeds the limit of {} bytes",
                crate::crypto::luks::MAX_AREA
            )));
        }
        let mut area = top
            .read_file("reading the encryption header", offset, length as usize)
            .await?
            .to_vec();
        let mut header = LuksHeader::parse(&area).map_err(crypto)?;
        header
            .change_slots(&mut area, password, change)
            .map_err(crypto)?;
        area[..HEADER_LEN].copy_from_slice(&header.encode());
        let (res, _) = top
            .file
            .write_at(IoBuf::from_slice(&area).into(), offset)
            .await;
        res.map_err(|e| top.io_error("writing the encryption header", offset, e))?;
        self.flush().await
    }
}
