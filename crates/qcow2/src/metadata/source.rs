//! Where the loader reads from: the engine's asynchronous [`Storage`], or a synchronous
//! [`ByteSource`] (a file or an in-memory buffer, for `info`, the fuzz targets and tests).
//! Both read bytes past the end of the file as zeros, as QEMU reads them; the loader decides
//! per structure whether reaching past the end is an error.

use std::fs::File;
use std::future::Future;
use std::io;
use std::os::unix::fs::FileExt;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use storage::{IoBuf, Storage};

use super::error::MetadataError;

/// Positional reads for the loader: exactly `len` bytes, zeros past the end of the file.
#[allow(async_fn_in_trait)] // single-threaded, like `Storage`
pub(crate) trait MetaSource {
    /// The bytes read.
    type Buf: std::ops::Deref<Target = [u8]>;

    /// Length of the file in bytes.
    fn file_len(&self) -> u64;

    /// Reads `len` bytes at `offset`.
    async fn read(&self, offset: u64, len: usize) -> io::Result<Self::Buf>;
}

/// A [`Storage`] as a metadata source.
pub(crate) struct StorageSource<'a, S> {
    file: &'a S,
    len: u64,
}

impl<'a, S: Storage> StorageSource<'a, S> {
    /// The loader reads `file`, which was `len` bytes long when it was opened.
    pub fn new(file: &'a S, len: u64) -> Self {
        StorageSource { file, len }
    }
}

impl<S: Storage> MetaSource for StorageSource<'_, S> {
    type Buf = IoBuf;

    fn file_len(&self) -> u64 {
        self.len
    }

    async fn read(&self, offset: u64, len: usize) -> io::Result<IoBuf> {
        let (res, slice) = self.file.read_at(IoBuf::zeroed(len).into(), offset).await;
        res.map(|()| slice.into_inner())
    }
}

/// A [`ByteSource`] as a metadata source. Its reads complete at once, so a load over it runs
/// to completion in [`run_ready`] without an executor.
pub(crate) struct SyncSource<'a, B: ?Sized> {
    src: &'a B,
    len: u64,
}

impl<'a, B: ByteSource + ?Sized> SyncSource<'a, B> {
    /// Takes the source's length now: the loader sizes every read against it.
    pub fn new(src: &'a B) -> io::Result<Self> {
        Ok(SyncSource {
            src,
            len: src.byte_len()?,
        })
    }
}

impl<B: ByteSource + ?Sized> MetaSource for SyncSource<'_, B> {
    type Buf = Vec<u8>;

    fn file_len(&self) -> u64 {
        self.len
    }

    async fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        // Only the part inside the file is read; the rest stays zero.
        let inside = self.len.saturating_sub(offset).min(len as u64) as usize;
        if inside > 0 {
            self.src.read_exact_at(offset, &mut buf[..inside])?;
        }
        Ok(buf)
    }
}

/// Runs a future that never waits (a load over a [`SyncSource`]) to its end. A future that
/// does wait is a misuse and reported as an error, not a hang.
pub(crate) fn run_ready<T>(
    f: impl Future<Output = Result<T, MetadataError>>,
) -> Result<T, MetadataError> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => Err(MetadataError::Io {
            what: "metadata",
            offset: 0,
            len: 0,
            source: io::Error::other("a synchronous read would have to wait"),
        }),
    }
}

/// Positional reads from something with a length.
pub trait ByteSource {
    /// Total length in bytes.
    fn byte_len(&self) -> io::Result<u64>;

    /// Fills `buf` from `offset`; fails with `UnexpectedEof` if the source ends first.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

impl ByteSource for [u8] {
    fn byte_len(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl ByteSource for Vec<u8> {
    fn byte_len(&self) -> io::Result<u64> {
        self.as_slice().byte_len()
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.as_slice().read_exact_at(offset, buf)
    }
}

impl ByteSource for File {
    fn byte_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_reads_are_bounds_checked() {
        let data: &[u8] = &[1, 2, 3, 4];
        let mut buf = [0u8; 2];
        data.read_exact_at(2, &mut buf).unwrap();
        assert_eq!(buf, [3, 4]);
        assert!(data.read_exact_at(3, &mut buf).is_err());
        assert!(data.read_exact_at(u64::MAX, &mut buf).is_err());
        assert_eq!(data.byte_len().unwrap(), 4);
    }
}
