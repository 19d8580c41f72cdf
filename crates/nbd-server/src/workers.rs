//! Worker threads: each runs a current-thread runtime with connections the accept loop hands
//! it, and reaches the exports through [`Remote`]s, so the socket work of many clients
//! (receiving, TLS, sending replies) spreads over several cores while every export stays
//! on the thread that owns it. Each worker follows the owner's export set as it changes
//! (see [`crate::mirror`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinSet, LocalSet};

use crate::accept::{handle, Accepted, Handled};
use crate::control::Control;
use crate::export::Export;
use crate::exports::Exports;
use crate::mirror::{self, Changes, Follower};
use crate::remote::{Remote, SendBuf};
use crate::tls::TlsServer;

/// A client socket on its way to another thread (detached from the accepting runtime).
enum Moved {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream, SocketAddr),
}

impl Moved {
    fn new(stream: Accepted) -> std::io::Result<Self> {
        Ok(match stream {
            Accepted::Unix(s) => Self::Unix(s.into_std()?),
            Accepted::Tcp(s, peer) => Self::Tcp(s.into_std()?, peer),
        })
    }

    /// Registers the socket with the current thread's runtime.
    fn attach(self) -> std::io::Result<Accepted> {
        Ok(match self {
            Self::Unix(s) => Accepted::Unix(tokio::net::UnixStream::from_std(s)?),
            Self::Tcp(s, peer) => Accepted::Tcp(tokio::net::TcpStream::from_std(s)?, peer),
        })
    }
}

/// One connection for a worker, and where to say how it went.
struct Job {
    stream: Moved,
    control: Control,
    done: oneshot::Sender<Handled>,
}

/// What every connection of a worker shares.
#[derive(Clone)]
pub(crate) struct Setup {
    pub keepalive: Option<Duration>,
    pub tls: Option<Arc<TlsServer>>,
}

struct Worker {
    jobs: mpsc::UnboundedSender<Job>,
    thread: std::thread::JoinHandle<()>,
    exited: oneshot::Receiver<()>,
}

/// The worker threads of a server (the tasks serving their calls on the owning thread are
/// the export set's, see [`Exports::unpublish`]).
pub(crate) struct Workers {
    workers: Vec<Worker>,
    accepted: usize,
}

/// Type-erased [`Workers::start`], so the server can hold it without `E::Buf: SendBuf`.
pub(crate) type Start<E> = fn(&Exports<E>, usize, &Setup) -> std::io::Result<Workers>;

impl Workers {
    /// Starts `threads - 1` workers (this thread is the first) serving `exports`, and its
    /// changes from now on; must run inside a `LocalSet`, where the calls of the workers'
    /// connections will run.
    pub fn start<E>(exports: &Exports<E>, threads: usize, setup: &Setup) -> std::io::Result<Self>
    where
        E: Export + 'static,
        E::Buf: SendBuf,
    {
        let (publisher, follower) = mirror::channel::<E::Buf>();
        let mut workers = Vec::new();
        for i in 1..threads {
            let (jobs, rx) = mpsc::unbounded_channel();
            let (exited_tx, exited) = oneshot::channel();
            let (follower, setup) = (follower.clone(), setup.clone());
            let thread = std::thread::Builder::new()
                .name(format!("nbd-worker-{i}"))
                .spawn(move || {
                    run_worker(follower, rx, setup);
                    let _ = exited_tx.send(());
                })?;
            workers.push(Worker {
                jobs,
                thread,
                exited,
            });
        }
        // Only once every thread runs: on an error above, the workers started see their
        // jobs end and nothing was published.
        exports.publish_to(Box::new(publisher));
        Ok(Self {
            workers,
            accepted: 0,
        })
    }

    /// The worker for the next connection, or `None` for this thread. Round robin starting
    /// with a worker, so even a single client takes the path that crosses threads.
    pub fn pick(&mut self) -> Option<usize> {
        let threads = self.workers.len() + 1;
        self.accepted = self.accepted.wrapping_add(1);
        let slot = self.accepted % threads;
        (slot != 0).then(|| slot - 1)
    }

    /// Hands a client to worker `index`; the receiver says how its connection went.
    pub fn send(
        &self,
        index: usize,
        stream: Accepted,
        control: Control,
    ) -> oneshot::Receiver<Handled> {
        let (done, rx) = oneshot::channel();
        let Some(worker) = self.workers.get(index) else {
            return rx;
        };
        match Moved::new(stream) {
            Ok(stream) => {
                // A worker that has died drops the job, and with it `done`: the connection
                // counts as failed.
                let _ = worker.jobs.send(Job {
                    stream,
                    control,
                    done,
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot hand a connection to a worker thread"),
        }
        rx
    }

    /// Stops the workers once their connections are gone, and waits until every call they
    /// made has finished, so a final flush covers them.
    pub async fn finish<E>(self, exports: &Exports<E>) {
        let dispatchers = exports.unpublish();
        for worker in self.workers {
            drop(worker.jobs);
            let _ = worker.exited.await;
            if worker.thread.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
        for task in dispatchers {
            let _ = task.await;
        }
    }
}

/// A worker thread's life: serve the connections it is given until the accept loop stops
/// sending them, then let them end.
fn run_worker<B: SendBuf>(follower: Follower<B>, jobs: mpsc::UnboundedReceiver<Job>, setup: Setup) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a worker thread's runtime");
            return;
        }
    };
    let changes = follower.changes();
    let exports = Exports::following(Box::new(follower));
    LocalSet::new().block_on(&runtime, serve_jobs(exports, changes, jobs, setup));
}

async fn serve_jobs<B: SendBuf>(
    exports: Exports<Remote<B>>,
    mut changes: Changes<B>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    setup: Setup,
) {
    let mut clients = JoinSet::new();
    let mut published = true;
    loop {
        tokio::select! {
            job = jobs.recv() => {
                let Some(job) = job else { break };
                let exports = exports.clone();
                let setup = setup.clone();
                clients.spawn_local(async move {
                    let handled = match job.stream.attach() {
                        Ok(stream) => handle(stream, exports, job.control, setup.keepalive, setup.tls).await,
                        Err(e) => {
                            tracing::warn!(error = %e, "worker thread cannot take a connection");
                            Handled { ok: false, transmitted: false }
                        }
                    };
                    let _ = job.done.send(handled);
                });
            }
            // Taken at once, not at the next client's option: a forgotten export's handle
            // must go so that its dispatcher can end and its image be closed.
            more = changes.next(), if published => {
                published = more;
                exports.refresh();
            }
            Some(_) = clients.join_next(), if !clients.is_empty() => {}
        }
    }
    while clients.join_next().await.is_some() {}
}
