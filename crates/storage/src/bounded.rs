//! Calls on paths that may never answer, made where nobody waits on them for long.
//!
//! A path an operator or a client names may sit on a file system that does not answer (a
//! hung NFS or FUSE mount): an `open` or a `stat` there blocks in the kernel, for good. The
//! thread that drives images must never make such a call itself, so every open (with its
//! checks and locks) and every path walk of this crate runs on a thread of its own, and the
//! caller waits for it at most [`OpenBound::timeout`]. A call that overruns is given up: the
//! caller gets [`BoundError::TimedOut`], and the thread, which cannot be interrupted, is left
//! to finish on its own; if it ever gets its answer it closes what it opened. Such stuck
//! threads are counted, and while [`OpenBound::max_stuck`] of them wait, further calls are
//! refused at once ([`BoundError::TooManyStuck`]) rather than adding one thread more each.
//!
//! The timing needs no runtime timer (a runtime built without the time driver opens files
//! too): a small coordinating thread waits for the worker with a deadline and hands the
//! outcome to the async caller.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// How long one open may take by default: far beyond any healthy file system, and short
/// enough that a control client waiting 30 s hears of the timeout.
pub const DEFAULT_OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// How many given-up opens may still be stuck, by default, before further opens are refused.
pub const DEFAULT_MAX_STUCK: usize = 8;

/// The two threads of a call only open files and walk paths: a small stack is plenty.
const STACK: usize = 256 << 10;

/// Calls given up on whose thread has not returned yet, in this process.
static STUCK: AtomicUsize = AtomicUsize::new(0);

/// The bound on calls that walk a path (opening a file, resolving a name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenBound {
    /// How long the caller waits for one call.
    pub timeout: Duration,
    /// How many given-up calls may still be stuck before further calls are refused.
    pub max_stuck: usize,
}

impl Default for OpenBound {
    fn default() -> OpenBound {
        OpenBound {
            timeout: DEFAULT_OPEN_TIMEOUT,
            max_stuck: DEFAULT_MAX_STUCK,
        }
    }
}

/// Why a bounded call did not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum BoundError {
    /// The file system did not answer in time; the call was given up.
    #[error(
        "{what} {path}: no answer from the file system within {} s (a hung mount?); given up",
        after.as_secs_f64()
    )]
    TimedOut {
        /// What was being done (`opening`, `resolving`).
        what: &'static str,
        /// The path.
        path: String,
        /// How long the caller waited.
        after: Duration,
    },
    /// Too many earlier calls are still stuck; this one was not started.
    #[error(
        "{what} {path}: refused, {stuck} earlier file system calls that were given up still \
         wait for an answer (at most {max} may)"
    )]
    TooManyStuck {
        /// What was to be done.
        what: &'static str,
        /// The path.
        path: String,
        /// Calls stuck now.
        stuck: usize,
        /// The limit.
        max: usize,
    },
    /// No thread could be started for the call.
    #[error("{what} {path}: cannot start a thread: {source}")]
    Thread {
        /// What was to be done.
        what: &'static str,
        /// The path.
        path: String,
        /// The system's error.
        source: io::Error,
    },
}

impl From<BoundError> for io::Error {
    fn from(e: BoundError) -> io::Error {
        let kind = match &e {
            BoundError::TimedOut { .. } => io::ErrorKind::TimedOut,
            BoundError::TooManyStuck { .. } => io::ErrorKind::WouldBlock,
            BoundError::Thread { source, .. } => source.kind(),
        };
        io::Error::new(kind, e)
    }
}

/// Given-up calls whose thread is still waiting for the kernel, in this process.
pub fn stuck() -> usize {
    STUCK.load(Ordering::Acquire)
}

/// Where the worker leaves its outcome, or learns that nobody wants it any more.
enum Slot<T> {
    Waiting,
    Done(io::Result<T>),
    Taken,
    Abandoned,
}

struct Shared<T> {
    slot: Mutex<Slot<T>>,
    done: Condvar,
}

/// Runs `job` (a call on `path`, described by `what`) on a thread of its own and waits for it
/// at most `bound.timeout`. See the module documentation for what happens to a call that
/// overruns.
pub async fn run<T, F>(what: &'static str, path: &Path, bound: OpenBound, job: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    let stuck = stuck();
    if stuck >= bound.max_stuck {
        return Err(BoundError::TooManyStuck {
            what,
            path: path.display().to_string(),
            stuck,
            max: bound.max_stuck,
        }
        .into());
    }
    let shared = Arc::new(Shared {
        slot: Mutex::new(Slot::Waiting),
        done: Condvar::new(),
    });
    let thread_error = |source| BoundError::Thread {
        what,
        path: path.display().to_string(),
        source,
    };
    let worker_side = Arc::clone(&shared);
    let worker = std::thread::Builder::new()
        .name("bounded-open".into())
        .stack_size(STACK)
        .spawn(move || work(&worker_side, job))
        .map_err(thread_error)?;
    // The worker is detached: its handle is never joined.
    drop(worker);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let timeout = bound.timeout;
    let described = path.display().to_string();
    let waiter_side = Arc::clone(&shared);
    let waiter = std::thread::Builder::new()
        .name("bounded-wait".into())
        .stack_size(STACK)
        .spawn(move || {
            let outcome = wait(&waiter_side, timeout).unwrap_or_else(|| {
                Err(BoundError::TimedOut {
                    what,
                    path: described,
                    after: timeout,
                }
                .into())
            });
            // A caller that went away drops the outcome, and with it any file opened.
            let _ = tx.send(outcome);
        });
    if let Err(source) = waiter {
        // Nobody waits for the worker: it counts as stuck until it returns.
        abandon(&shared);
        return Err(thread_error(source).into());
    }
    rx.await.unwrap_or_else(|_| {
        Err(io::Error::other(format!(
            "{what} {}: the waiting thread ended without an answer",
            path.display()
        )))
    })
}

/// The worker: runs the call and leaves its outcome, or, when the call was given up,
/// drops it (closing what it opened) and stops counting as stuck.
fn work<T, F: FnOnce() -> io::Result<T>>(shared: &Shared<T>, job: F) {
    let outcome = job();
    let mut slot = shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
    match *slot {
        Slot::Waiting => {
            *slot = Slot::Done(outcome);
            shared.done.notify_one();
        }
        _ => {
            drop(slot);
            drop(outcome);
            STUCK.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The outcome, if the worker leaves it within `timeout`; otherwise the call is given up.
fn wait<T>(shared: &Shared<T>, timeout: Duration) -> Option<io::Result<T>> {
    let slot = shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
    let (mut slot, _) = shared
        .done
        .wait_timeout_while(slot, timeout, |s| matches!(s, Slot::Waiting))
        .unwrap_or_else(PoisonError::into_inner);
    match std::mem::replace(&mut *slot, Slot::Taken) {
        Slot::Done(outcome) => Some(outcome),
        _ => {
            // Counted under the lock, so the worker's uncounting comes after.
            *slot = Slot::Abandoned;
            STUCK.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

/// Gives up a call nobody will wait for.
fn abandon<T>(shared: &Shared<T>) {
    let mut slot = shared.slot.lock().unwrap_or_else(PoisonError::into_inner);
    if matches!(*slot, Slot::Waiting) {
        *slot = Slot::Abandoned;
        STUCK.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn runtime() -> tokio::runtime::Runtime {
        // No time driver: the bound must not need one.
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_call_that_never_answers_times_out_and_stuck_calls_are_bounded() {
        let rt = runtime();
        let bound = OpenBound {
            timeout: Duration::from_millis(200),
            max_stuck: STUCK.load(Ordering::Acquire) + 1,
        };
        let path = Path::new("/hung/mount/image");
        let (release, hold) = mpsc::channel::<()>();
        let (closed_tx, closed) = mpsc::channel::<()>();
        struct Opened(mpsc::Sender<()>);
        impl Drop for Opened {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let started = std::time::Instant::now();
        let err = rt
            .block_on(run("opening", path, bound, move || {
                let _ = hold.recv();
                Ok(Opened(closed_tx))
            }))
            .err()
            .expect("the call times out");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let text = err.to_string();
        assert!(
            text.contains("/hung/mount/image") && text.contains("given up"),
            "{text}"
        );

        // While it is stuck, a further call is refused at once.
        let err = rt
            .block_on(run("opening", path, bound, || Ok(())))
            .expect_err("refused");
        assert!(
            err.to_string().contains("still wait for an answer"),
            "{err}"
        );

        // Once the stuck call returns, what it opened is dropped and calls run again.
        release.send(()).unwrap();
        closed
            .recv_timeout(Duration::from_secs(10))
            .expect("the late outcome is dropped");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match rt.block_on(run("opening", path, bound, || Ok(7))) {
                Ok(v) => {
                    assert_eq!(v, 7);
                    break;
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("still refused: {e}"),
            }
        }
    }

    #[test]
    fn a_call_that_answers_in_time_gives_its_outcome() {
        let rt = runtime();
        let out = rt.block_on(run("opening", Path::new("x"), OpenBound::default(), || {
            Err::<(), _>(io::Error::from(io::ErrorKind::NotFound))
        }));
        assert_eq!(out.unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
