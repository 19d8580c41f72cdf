//! An image's bytes for the code that reads them without the engine: `info`'s metadata,
//! `check`'s caps, a format probe, a `backing` node's header. The image is opened by the
//! storage opener, as the engine opens it: with its image locks, its bounded open, the
//! confinement of an untrusted image's files, and the same dispatch of names (a file, an NBD
//! export, a `null-co` device, a `blkdebug` wrapper); and every byte is read through the
//! storage seam.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex, OnceLock};

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

/// The first `n` bytes of the image at `path` (fewer when it is shorter), opened through the
/// storage opener as [`ImageBytes::open`] opens it (read-only, sharing writes, with its
/// locks and its bounded open). Read by the process's one probe thread, so that code already
/// driving a runtime (a subcommand probing a format mid-way) may ask too.
pub fn read_head(path: &Path, n: usize) -> io::Result<Vec<u8>> {
    let (reply, answer) = mpsc::sync_channel(1);
    let job = Probe {
        path: path.to_path_buf(),
        n,
        reply,
    };
    probes()?
        .lock()
        .map_err(|_| io::Error::other("the probe thread is gone"))?
        .send(job)
        .map_err(|_| io::Error::other("the probe thread is gone"))?;
    answer
        .recv()
        .unwrap_or_else(|_| Err(io::Error::other("reading the image's first bytes failed")))
}

/// One [`read_head`] asked of the probe thread.
struct Probe {
    path: PathBuf,
    n: usize,
    reply: mpsc::SyncSender<io::Result<Vec<u8>>>,
}

/// The probe thread's queue, the thread started on first use.
fn probes() -> io::Result<&'static Mutex<mpsc::Sender<Probe>>> {
    static PROBES: OnceLock<Mutex<mpsc::Sender<Probe>>> = OnceLock::new();
    if let Some(probes) = PROBES.get() {
        return Ok(probes);
    }
    let (send, queue) = mpsc::channel::<Probe>();
    std::thread::Builder::new()
        .name("image-probe".into())
        .spawn(move || serve_probes(&queue))?;
    Ok(PROBES.get_or_init(|| Mutex::new(send)))
}

/// Answers probes until the process ends. Each probe gets a runtime of its own, dropped
/// before the answer goes back: dropping it waits for the I/O threads still holding the
/// file, so the probe's descriptor (and its lock) is closed before the caller, which may
/// open the same image for writing next, goes on.
fn serve_probes(queue: &mpsc::Receiver<Probe>) {
    while let Ok(probe) = queue.recv() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let answer = match runtime {
            Ok(runtime) => {
                let local = tokio::task::LocalSet::new();
                let answer = local.block_on(&runtime, head_of(&probe.path, probe.n));
                drop(local);
                drop(runtime);
                answer
            }
            Err(e) => Err(e),
        };
        let _ = probe.reply.send(answer);
    }
}

/// The first `n` bytes of the image at `path`, opened read-only and sharing writes.
async fn head_of(path: &Path, n: usize) -> io::Result<Vec<u8>> {
    let opts = storage::OpenOptions {
        read_only: true,
        force_share: true,
        ..storage::OpenOptions::default()
    };
    let storage = super::settings::opener().open(path, opts).await?;
    let len = storage.len().await?;
    let n = n.min(usize::try_from(len).unwrap_or(usize::MAX));
    if n == 0 {
        return Ok(Vec::new());
    }
    let (result, slice) = storage
        .read_at(storage::Slice::from(IoBuf::zeroed(n)), 0)
        .await;
    result?;
    Ok(slice.to_vec())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_read_from_inside_a_runtime_and_bounded_by_the_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), b"QFI\xfbrest").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (head, all) = rt.block_on(async {
            (
                read_head(file.path(), 4).unwrap(),
                read_head(file.path(), 1 << 20).unwrap(),
            )
        });
        assert_eq!(head, b"QFI\xfb");
        assert_eq!(all, b"QFI\xfbrest");
        assert!(read_head(Path::new("/nonexistent/image"), 4).is_err());
    }
}
