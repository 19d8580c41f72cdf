//! An image's bytes for the code that reads them without the engine: `info`'s metadata,
//! `check`'s caps, a format probe, a `backing` node's header. The image is opened by the
//! storage opener, as the engine opens it: with its image locks, its bounded open, the
//! confinement of an untrusted image's files, and the same dispatch of names (a file, an NBD
//! export, a `null-co` device, a `blkdebug` wrapper); and every byte is read through the
//! storage seam.

use std::io;
use std::path::Path;

use storage::{AnyStorage, IoBuf, Opener, Storage};

/// An image opened read-only for synchronous reads (`qcow2::metadata::ByteSource`).
pub struct ImageBytes {
    runtime: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
    storage: AnyStorage,
    len: u64,
}

impl ImageBytes {
    /// Opens `path` read-only, holding the read lock QEMU would (shared with every writer
    /// when `force_share`) for as long as it is open; `confine`, for a file an untrusted
    /// image names, keeps it inside the allowed directories. It drives a runtime of its
    /// own, so it is for synchronous code; code already on a runtime uses [`read_head`].
    pub fn open(
        path: &Path,
        force_share: bool,
        confine: Option<&'static storage::AllowDirs>,
    ) -> io::Result<ImageBytes> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let local = tokio::task::LocalSet::new();
        let opts = storage::OpenOptions {
            read_only: true,
            force_share,
            confine,
            ..storage::OpenOptions::default()
        };
        let (storage, len) = local.block_on(&runtime, async {
            let storage = super::settings::opener().open(path, opts).await?;
            let len = storage.len().await?;
            Ok::<_, io::Error>((storage, len))
        })?;
        Ok(ImageBytes {
            runtime,
            local,
            storage,
            len,
        })
    }

    /// What the name opened: a file, an NBD export, a `null-co` device, ...
    pub fn storage(&self) -> &AnyStorage {
        &self.storage
    }

    /// The first `n` bytes (fewer when the image is shorter).
    pub fn head(&self, n: usize) -> io::Result<Vec<u8>> {
        let n = n.min(usize::try_from(self.len).unwrap_or(usize::MAX));
        let mut buf = vec![0; n];
        qcow2::metadata::ByteSource::read_exact_at(self, 0, &mut buf)?;
        Ok(buf)
    }
}

/// The first `n` bytes of the image at `path` (fewer when it is shorter), opened as
/// [`ImageBytes::open`] opens it, sharing writes. Read on a thread of its own, so that code
/// already driving a runtime (a subcommand probing a format mid-way) may ask too.
pub fn read_head(path: &Path, n: usize) -> io::Result<Vec<u8>> {
    std::thread::scope(|s| {
        s.spawn(|| ImageBytes::open(path, true, None)?.head(n))
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("reading the image's first bytes failed")))
    })
}

impl qcow2::metadata::ByteSource for ImageBytes {
    fn byte_len(&self) -> io::Result<u64> {
        Ok(self.len)
    }

    /// A storage reads zeros past its end; a byte source must say it ended.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let len = u64::try_from(buf.len()).map_err(|_| io::ErrorKind::InvalidInput)?;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => return Err(io::ErrorKind::UnexpectedEof.into()),
        }
        if buf.is_empty() {
            return Ok(());
        }
        let slice = storage::Slice::from(IoBuf::zeroed(buf.len()));
        let (result, slice) = self
            .local
            .block_on(&self.runtime, self.storage.read_at(slice, offset));
        result?;
        buf.copy_from_slice(&slice);
        Ok(())
    }
}
