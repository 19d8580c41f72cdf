//! The `--metrics` endpoint: a deliberately small HTTP/1.1 server for one resource,
//! `GET /metrics`. Each connection carries one request and is closed after the answer.
//!
//! It runs as tasks on the thread that owns the images (where the numbers and the caches
//! live); a scrape costs that thread one snapshot and one rendering, and every wait (the
//! request, the answer) is bounded in size and time, so a hostile client can hold at most a
//! scrape slot until its time runs out, never the thread.
//!
//! Slots are given so that incomplete requests cannot starve complete ones: a client has
//! a short time to send its request head, and when every slot is taken a new connection
//! replaces the oldest one still sending its head (as the NBD server replaces the oldest
//! unfinished handshake). A connection is never replaced in its first moments, which is
//! when a real scraper's request arrives, so a scraper that sends its request at once is
//! always served, at worst after waiting in the listen backlog for a slot.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tokio::time::Instant;

use super::registry::StatsRegistry;

mod request;

use request::{parse, HeadEnd, Request};

/// How the endpoint bounds its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Largest request head (request line and headers) read.
    pub max_head: usize,
    /// Time a client has to send its request head; then it is closed.
    pub head_timeout: Duration,
    /// Time a client has to send its request and take the answer.
    pub timeout: Duration,
    /// Scrapes served at once; a further client replaces the oldest one still sending its
    /// request head, or waits in the listen backlog until a slot frees.
    pub max_scrapes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_head: 8 * 1024,
            head_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(10),
            max_scrapes: 4,
        }
    }
}

/// How long a new connection keeps its slot whatever comes: its request is sent with the
/// connection's last handshake packet or just after it, so a real scraper's head has
/// arrived by then, while a client that is still sending it is slow or hostile.
const PROTECTED: Duration = Duration::from_millis(25);

/// Why the endpoint cannot start.
#[derive(Debug, thiserror::Error)]
#[error("--metrics {addr}: cannot listen: {source}")]
pub struct MetricsBindError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// A running endpoint; stops when dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Listens on `addr` (port 0 picks a free port) and serves `registry`'s numbers; must
    /// run inside a `LocalSet`.
    pub async fn start(
        addr: SocketAddr,
        registry: Rc<StatsRegistry>,
        limits: HttpLimits,
    ) -> Result<Self, MetricsBindError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| MetricsBindError { addr, source })?;
        let bound = listener
            .local_addr()
            .map_err(|source| MetricsBindError { addr, source })?;
        let task = tokio::task::spawn_local(accept_loop(listener, registry, limits));
        Ok(Self { addr: bound, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One taken slot.
struct Slot {
    started: Instant,
    /// Set once the request head is complete: from then on the slot is not replaced.
    head_read: Rc<std::cell::Cell<bool>>,
    task: AbortHandle,
}

/// The taken slots, oldest first.
#[derive(Default)]
struct Slots {
    taken: VecDeque<Slot>,
}

impl Slots {
    fn forget_finished(&mut self) {
        self.taken.retain(|s| !s.task.is_finished());
    }

    /// The oldest slot still waiting for its request head, with the instant it may be
    /// replaced.
    fn oldest_unfinished(&self) -> Option<(usize, Instant)> {
        self.taken
            .iter()
            .position(|s| !s.head_read.get())
            .map(|i| (i, self.taken[i].started + PROTECTED))
    }

    /// Frees a slot for a new connection, waiting until one is finished or replaceable.
    async fn make_room(&mut self, max: usize, tasks: &mut JoinSet<()>) {
        loop {
            while tasks.try_join_next().is_some() {}
            self.forget_finished();
            if self.taken.len() < max {
                return;
            }
            let replaceable = self.oldest_unfinished();
            if let Some((i, at)) = replaceable {
                if at <= Instant::now() {
                    if let Some(old) = self.taken.remove(i) {
                        tracing::debug!("metrics: replacing the oldest incomplete request");
                        old.task.abort();
                    }
                    return;
                }
            }
            let until = replaceable.map(|(_, at)| at);
            tokio::select! {
                _ = tasks.join_next() => {}
                () = async {
                    match until {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

async fn accept_loop(listener: TcpListener, registry: Rc<StatsRegistry>, limits: HttpLimits) {
    let mut tasks = JoinSet::new();
    let mut slots = Slots::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait a little instead of spinning.
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // While no slot can be had, this client waits (its request stays in the socket)
        // and the ones after it in the listen backlog, rather than being refused.
        slots.make_room(limits.max_scrapes.max(1), &mut tasks).await;
        let registry = Rc::clone(&registry);
        let head_read = Rc::new(std::cell::Cell::new(false));
        let flag = Rc::clone(&head_read);
        let task = tasks.spawn_local(async move {
            let served =
                tokio::time::timeout(limits.timeout, serve(stream, &registry, limits, &flag));
            match served.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics: scrape failed"),
                Err(_) => tracing::debug!(%peer, "metrics: scrape timed out"),
            }
        });
        slots.taken.push_back(Slot {
            started: Instant::now(),
            head_read,
            task,
        });
    }
}

/// One answer.
struct Reply {
    status: &'static str,
    content_type: &'static str,
    body: String,
    /// HEAD: the headers only.
    head_only: bool,
}

impl Reply {
    fn text(status: &'static str, body: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_owned(),
            head_only: false,
        }
    }
}

async fn serve(
    mut stream: TcpStream,
    registry: &StatsRegistry,
    limits: HttpLimits,
    head_read: &std::cell::Cell<bool>,
) -> std::io::Result<()> {
    let head = tokio::time::timeout(limits.head_timeout, read_head(&mut stream, limits.max_head))
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no complete request head in time",
            )
        })??;
    head_read.set(true);
    let reply = match head {
        None => Reply::text(
            "431 Request Header Fields Too Large",
            "request head too large\n",
        ),
        Some(head) => route(&head, registry)?,
    };
    answer(&mut stream, &reply).await
}

/// The answer to a request head.
fn route(head: &[u8], registry: &StatsRegistry) -> std::io::Result<Reply> {
    Ok(match parse(head) {
        Request::Metrics { head } => Reply {
            status: "200 OK",
            content_type: super::prometheus::CONTENT_TYPE,
            body: super::prometheus::render(registry.snapshot()).map_err(std::io::Error::other)?,
            head_only: head,
        },
        Request::NotFound => Reply::text("404 Not Found", "only /metrics is here\n"),
        Request::BadMethod => Reply::text("405 Method Not Allowed", "use GET or HEAD\n"),
        Request::Malformed => Reply::text("400 Bad Request", "not an HTTP request\n"),
    })
}

/// Reads up to the blank line that ends the request head; `None` if it is longer than
/// `max` bytes. A client that closes early has sent what it sent.
async fn read_head(stream: &mut TcpStream, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let mut end = HeadEnd::default();
    loop {
        if end.scan(&head) {
            return Ok(Some(head));
        }
        if head.len() > max {
            return Ok(None);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Some(head));
        }
        head.extend_from_slice(&chunk[..n]);
    }
}

async fn answer(stream: &mut TcpStream, reply: &Reply) -> std::io::Result<()> {
    let allow = if reply.status.starts_with("405") {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let mut out = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        reply.status,
        reply.content_type,
        reply.body.len()
    )
    .into_bytes();
    if !reply.head_only {
        out.extend_from_slice(reply.body.as_bytes());
    }
    stream.write_all(&out).await?;
    stream.shutdown().await
}
