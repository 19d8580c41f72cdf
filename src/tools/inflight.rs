//! What the copying tools share: for `commit` and `rebase`, a bounded set of request tasks
//! where the first failure stops the rest; for them, `convert` and `compare`, a pool of
//! request buffers.

use std::cell::RefCell;
use std::future::Future;

use qcow2::engine::EngineError;
use storage::IoBuf;
use tokio::task::JoinSet;

/// Why a copy stopped.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// Reading or writing an image failed.
    #[error(transparent)]
    Engine(Box<EngineError>),
    /// A request task died (a bug: tasks return their errors).
    #[error("internal error: a copy task failed: {0}")]
    Task(String),
}

impl From<EngineError> for CopyError {
    fn from(e: EngineError) -> CopyError {
        CopyError::Engine(Box::new(e))
    }
}

/// Request tasks in flight, at most `limit` at once.
pub struct InFlight {
    tasks: JoinSet<Result<(), EngineError>>,
    limit: usize,
}

impl InFlight {
    /// An empty set allowing `limit` (at least one) requests at once.
    pub fn new(limit: usize) -> InFlight {
        InFlight {
            tasks: JoinSet::new(),
            limit: limit.max(1),
        }
    }

    /// Starts `request` once fewer than `limit` are running; fails with the first error of
    /// a finished request.
    pub async fn spawn<F>(&mut self, request: F) -> Result<(), CopyError>
    where
        F: Future<Output = Result<(), EngineError>> + 'static,
    {
        while self.tasks.len() >= self.limit {
            self.reap().await?;
        }
        self.tasks.spawn_local(request);
        Ok(())
    }

    /// Waits for every request; the first error wins.
    pub async fn finish(&mut self) -> Result<(), CopyError> {
        while !self.tasks.is_empty() {
            self.reap().await?;
        }
        Ok(())
    }

    /// Stops the requests still running and waits until they are gone, so nothing writes
    /// after the caller has given up.
    pub async fn stop(&mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }

    async fn reap(&mut self) -> Result<(), CopyError> {
        match self.tasks.join_next().await {
            None => Ok(()),
            Some(Ok(r)) => Ok(r?),
            Some(Err(e)) => Err(CopyError::Task(e.to_string())),
        }
    }
}

/// Request buffers for reuse: a fresh multi-MiB buffer per request costs more in page faults
/// and zeroing than the copy itself.
#[derive(Default)]
pub struct BufferPool {
    free: RefCell<Vec<IoBuf>>,
}

impl BufferPool {
    /// A buffer of `len` bytes (contents unspecified).
    pub fn take(&self, len: usize) -> IoBuf {
        match self.free.borrow_mut().pop() {
            Some(mut b) => {
                if b.len() < len {
                    b.resize(len);
                } else {
                    b.truncate(len);
                }
                b
            }
            None => IoBuf::zeroed(len),
        }
    }

    /// Returns a buffer for reuse.
    pub fn give(&self, buf: IoBuf) {
        self.free.borrow_mut().push(buf);
    }
}
