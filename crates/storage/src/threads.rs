//! The portable file backend: blocking `pread`/`pwrite`/`fallocate`/`fdatasync` run on tokio's
//! blocking thread pool. Each job owns its buffer, so a dropped future cannot free memory a
//! worker is still using (the job runs to completion and drops the buffer itself).

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::file::{FileStorage, RawFile};
use crate::{OpenOptions, Slice};

/// A file whose I/O runs on tokio's blocking pool.
pub struct ThreadsFile {
    file: Arc<File>,
}

/// Thread-pool-backed file storage.
pub type ThreadsStorage = FileStorage<ThreadsFile>;

impl ThreadsStorage {
    /// Open `path` (a regular file or a block device) within `opts.bound`; must be used
    /// inside a tokio runtime.
    pub async fn open(path: &Path, opts: OpenOptions) -> io::Result<ThreadsStorage> {
        let (file, facts) = crate::file::open_file(path, opts).await?;
        Ok(ThreadsStorage::with_facts(ThreadsFile::new(file), facts))
    }
}

impl ThreadsFile {
    /// Wrap an open file.
    pub fn new(file: File) -> ThreadsFile {
        ThreadsFile {
            file: Arc::new(file),
        }
    }
}

fn join_error(e: tokio::task::JoinError) -> io::Error {
    io::Error::other(format!("storage worker thread failed: {e}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(join_error)
        .and_then(|r| r)
}

impl RawFile for ThreadsFile {
    async fn read(&self, mut buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        let file = Arc::clone(&self.file);
        let range = buf.range();
        let job = tokio::task::spawn_blocking(move || {
            let r = crate::sys::pread(&file, &mut buf, offset);
            (r, buf)
        });
        match job.await {
            Ok(out) => out,
            Err(e) => (Err(join_error(e)), lost_buffer(range)),
        }
    }

    async fn write(&self, buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        let file = Arc::clone(&self.file);
        let range = buf.range();
        let job = tokio::task::spawn_blocking(move || {
            let r = crate::sys::pwrite(&file, &buf, offset);
            (r, buf)
        });
        match job.await {
            Ok(out) => out,
            Err(e) => (Err(join_error(e)), lost_buffer(range)),
        }
    }

    async fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        blocking(move || crate::sys::fallocate(&file, mode, offset, len)).await
    }

    async fn fdatasync(&self) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        blocking(move || crate::sys::fdatasync(&file)).await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        let file = Arc::clone(&self.file);
        blocking(move || file.set_len(len)).await
    }

    fn file(&self) -> &File {
        &self.file
    }
}

/// A worker that panicked or was cancelled at runtime shutdown took the buffer with it; hand
/// back an empty one (the error says why).
fn lost_buffer(range: std::ops::Range<usize>) -> Slice {
    tracing::error!("storage worker lost its buffer (range {range:?})");
    crate::IoBuf::zeroed(0).slice(0..0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IoBuf, Storage};

    /// What each flush made durable, as the storage counts it, after one write and a flush.
    async fn synced_after_write_and_flush(path: &Path, ignore_flush: bool) -> (u64, u64) {
        let opts = OpenOptions {
            ignore_flush,
            ..OpenOptions::create()
        };
        let s = ThreadsStorage::open(path, opts).await.unwrap();
        let (res, _) = s.write_at(IoBuf::from_slice(b"data").into(), 0).await;
        res.unwrap();
        s.flush().await.unwrap();
        s.sync_counts()
    }

    #[test]
    fn a_storage_opened_to_ignore_flushes_never_syncs() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let (changes, synced) =
                synced_after_write_and_flush(&dir.path().join("kept.img"), false).await;
            assert_eq!((changes, synced), (1, 1), "a flush syncs what was written");
            let (changes, synced) =
                synced_after_write_and_flush(&dir.path().join("unsafe.img"), true).await;
            assert_eq!((changes, synced), (1, 0), "ignore_flush: nothing synced");
        });
    }
}
