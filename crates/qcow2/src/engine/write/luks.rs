//! Writing to a LUKS volume (QEMU's `luks` driver): guest byte `g` lives enciphered at the
//! payload offset plus `g`, sectors numbered by guest offset. There is no mapping to change,
//! so a write is one enciphered copy of the caller's data; partial sectors are read, patched
//! and written whole.

use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Inner;
use crate::engine::infra::range_lock::LockMode;
use crate::format::GuestOffset;
use storage::{IoBuf, Storage};

impl<S: Storage + 'static> Inner<S> {
    /// A write to a LUKS volume layer 0.
    pub(crate) async fn write_luks(&self, offset: GuestOffset, buf: IoBuf) -> (Result<()>, IoBuf) {
        let len = buf.len() as u64;
        if let Some((from, to)) = self.sector_aligned(offset, len) {
            // Nothing else may write the partial sectors between their read and their write.
            let _exclusive = self.lock_range(from, to - from, LockMode::Exclusive).await;
            return self.write_unlocked(offset, buf).await;
        }
        let _shared = self.lock_range(offset, len, LockMode::Shared).await;
        self.seal_luks(offset, buf).await
    }

    /// Writes zeros over `[offset, offset + len)` of a LUKS volume, a chunk at a time.
    pub(crate) async fn write_luks_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK);
            let (res, _) = self
                .write_luks(GuestOffset(offset + done), IoBuf::zeroed(n as usize))
                .await;
            res?;
            done += n;
        }
        Ok(())
    }

    /// Enciphers a copy of `buf` (whole sectors at `offset`) and writes it to the volume.
    pub(super) async fn seal_luks(&self, offset: GuestOffset, buf: IoBuf) -> (Result<()>, IoBuf) {
        let top = self.top();
        let Some(meta) = top.luks() else {
            return (
                Err(top.unsupported_here("a LUKS write to another format")),
                buf,
            );
        };
        let Some(host) = meta.payload.checked_add(offset.0) else {
            return (
                Err(top.unsupported_here("a write past the largest file offset")),
                buf,
            );
        };
        // The caller's buffer stays plain.
        let mut sealed = IoBuf::from_slice(&buf);
        if let Err(source) = meta.crypto.encrypt(host, offset.0, &mut sealed) {
            let e = EngineError::Crypto {
                image: top.name.clone(),
                source,
            };
            return (Err(e), buf);
        }
        let (res, _) = top.file.write_at(sealed.into(), host).await;
        (res.map_err(|e| top.io_error("writing data", host, e)), buf)
    }
}
