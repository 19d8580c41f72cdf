//! An export served from another thread: [`Remote`] stands for an export that lives on the
//! thread owning the image, and [`dispatch`] runs there, carrying out the calls.
//!
//! This is how the server uses more than one core without making the engine `Send`: the
//! image stays single-threaded on its own thread, and connections on worker threads do the
//! socket work (reading requests, TLS, building and sending replies) and pass each request
//! over a channel. The channel needs no bound of its own: a connection never has more calls
//! in flight than its memory and request limits allow.

use std::rc::Rc;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use nbd_proto::errno::Errno;

use crate::export::{Buffer, Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags};

/// A payload buffer that can cross threads.
pub trait SendBuf: Buffer + Send + 'static {}

impl<B: Buffer + Send + 'static> SendBuf for B {}

type Reply<T> = oneshot::Sender<Result<T, Errno>>;

/// One request to the owning thread, with where its answer goes.
enum Call<B> {
    Read(u64, usize, Reply<Vec<ReadChunk<B>>>),
    Write(u64, B, bool, Reply<()>),
    WriteZeroes(u64, u64, WriteZeroesFlags, Reply<()>),
    Trim(u64, u64, bool, Reply<()>),
    Flush(Reply<()>),
    Cache(u64, u64, Reply<()>),
    BlockStatus(u64, u64, Reply<Vec<Extent>>),
    DirtyStatus(usize, u64, u64, Reply<Vec<(u64, bool)>>),
    /// A connection attached; nothing to answer.
    Attached,
}

/// What a worker thread needs to make a [`Remote`]: `Send`, unlike the export.
pub struct RemoteHandle<B> {
    calls: mpsc::UnboundedSender<Call<B>>,
    size: u64,
    features: ExportFeatures,
    dirty_bitmaps: Vec<String>,
}

impl<B> Clone for RemoteHandle<B> {
    fn clone(&self) -> Self {
        Self {
            calls: self.calls.clone(),
            size: self.size,
            features: self.features,
            dirty_bitmaps: self.dirty_bitmaps.clone(),
        }
    }
}

/// An export whose calls run on the thread that owns the real one.
pub struct Remote<B> {
    handle: RemoteHandle<B>,
}

impl<B> From<RemoteHandle<B>> for Remote<B> {
    fn from(handle: RemoteHandle<B>) -> Self {
        Self { handle }
    }
}

/// Starts carrying out calls for `export` on this thread (inside a `LocalSet`): returns the
/// handle other threads call it through, and the task to await once every handle is gone,
/// which ends when the last call has finished.
pub fn dispatch<E>(export: Rc<E>) -> (RemoteHandle<E::Buf>, tokio::task::JoinHandle<()>)
where
    E: Export + 'static,
    E::Buf: SendBuf,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = RemoteHandle {
        calls: tx,
        size: export.size(),
        features: export.features(),
        dirty_bitmaps: export.dirty_bitmaps(),
    };
    (handle, tokio::task::spawn_local(serve_calls(export, rx)))
}

/// Runs every call as a task of its own, so one slow request does not hold up the others,
/// and waits for all of them once no handle is left: a call whose connection went away
/// still completes before the server's final flush.
async fn serve_calls<E>(export: Rc<E>, mut rx: mpsc::UnboundedReceiver<Call<E::Buf>>)
where
    E: Export + 'static,
    E::Buf: SendBuf,
{
    let mut running = JoinSet::new();
    let mut batch = Vec::with_capacity(64);
    while rx.recv_many(&mut batch, 64).await > 0 {
        for call in batch.drain(..) {
            running.spawn_local(run(Rc::clone(&export), call));
        }
        // Reap finished tasks so a long-lived server does not accumulate their results.
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
}

/// Carries out one call; an answer nobody waits for any more is dropped.
async fn run<E: Export>(export: Rc<E>, call: Call<E::Buf>) {
    match call {
        Call::Read(offset, len, reply) => {
            let _ = reply.send(export.read(offset, len).await);
        }
        Call::Write(offset, data, fua, reply) => {
            let _ = reply.send(export.write(offset, data, fua).await);
        }
        Call::WriteZeroes(offset, len, flags, reply) => {
            let _ = reply.send(export.write_zeroes(offset, len, flags).await);
        }
        Call::Trim(offset, len, fua, reply) => {
            let _ = reply.send(export.trim(offset, len, fua).await);
        }
        Call::Flush(reply) => {
            let _ = reply.send(export.flush().await);
        }
        Call::Cache(offset, len, reply) => {
            let _ = reply.send(export.cache(offset, len).await);
        }
        Call::BlockStatus(offset, len, reply) => {
            let _ = reply.send(export.block_status(offset, len).await);
        }
        Call::DirtyStatus(index, offset, len, reply) => {
            let _ = reply.send(export.dirty_status(index, offset, len).await);
        }
        Call::Attached => export.client_attached(),
    }
}

impl<B: SendBuf> Remote<B> {
    /// Sends a call and waits for its answer. The owning thread outlives every connection,
    /// so a closed channel means it failed: the request fails with `EIO`, as a dead disk
    /// would make it.
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Call<B>) -> Result<T, Errno> {
        let (tx, rx) = oneshot::channel();
        self.handle.calls.send(make(tx)).map_err(|_| Errno::Io)?;
        rx.await.unwrap_or(Err(Errno::Io))
    }
}

impl<B: SendBuf> Export for Remote<B> {
    type Buf = B;

    fn size(&self) -> u64 {
        self.handle.size
    }

    fn features(&self) -> ExportFeatures {
        self.handle.features
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<B>>, Errno> {
        self.call(|r| Call::Read(offset, len, r)).await
    }

    async fn write(&self, offset: u64, data: B, fua: bool) -> Result<(), Errno> {
        self.call(|r| Call::Write(offset, data, fua, r)).await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno> {
        self.call(|r| Call::WriteZeroes(offset, len, flags, r))
            .await
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        self.call(|r| Call::Trim(offset, len, fua, r)).await
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.call(Call::Flush).await
    }

    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.call(|r| Call::Cache(offset, len, r)).await
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        self.call(|r| Call::BlockStatus(offset, len, r)).await
    }

    fn dirty_bitmaps(&self) -> Vec<String> {
        self.handle.dirty_bitmaps.clone()
    }

    /// Passed on to the owning thread, where the export lives; a closed channel means
    /// that thread has failed, and then there is nobody left to tell.
    fn client_attached(&self) {
        let _ = self.handle.calls.send(Call::Attached);
    }

    async fn dirty_status(
        &self,
        index: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, bool)>, Errno> {
        self.call(|r| Call::DirtyStatus(index, offset, len, r))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemExport;

    /// Calls made from another thread reach the export and come back with its answers,
    /// errors included; once the handles are gone the dispatcher ends.
    #[test]
    fn calls_from_another_thread_reach_the_export() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let export = Rc::new(MemExport::new(1 << 20));
            let (handle, done) = dispatch(Rc::clone(&export));
            let size = handle.size;
            let (finished_tx, finished_rx) = oneshot::channel();
            let worker = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let remote = Remote::from(handle);
                    let mut data = remote.alloc(4096);
                    data.fill(0xa5);
                    remote.write(8192, data, false).await.unwrap();
                    let read = remote.read(8192, 4096).await.unwrap();
                    let bytes: Vec<u8> = read
                        .into_iter()
                        .flat_map(|c| match c {
                            ReadChunk::Data(b) => b,
                            ReadChunk::Hole(n) => vec![0; n],
                        })
                        .collect();
                    assert_eq!(bytes, vec![0xa5; 4096]);
                    remote.flush().await.unwrap();
                    // Past the end: the export's own error comes back.
                    assert_eq!(remote.read(size, 4096).await.unwrap_err(), Errno::Inval);
                });
                let _ = finished_tx.send(());
            });
            // Serve the worker's calls until it is done (or has panicked).
            let _ = finished_rx.await;
            worker.join().unwrap();
            tokio::time::timeout(std::time::Duration::from_secs(10), done)
                .await
                .expect("the dispatcher ends once its handles are gone")
                .unwrap();
            assert_eq!(export.stats().writes, 1);
        });
    }
}
