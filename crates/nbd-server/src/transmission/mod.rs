//! The transmission phase of one connection: requests are read continuously, each runs in
//! the reader until it first has to wait and then as its own local task (see
//! [`spawn_request`]), and replies go out in completion order through one writer task,
//! which sends every reply completed since its last write in one `writev`: under load the
//! client is woken once per batch instead of once per reply.
//!
//! Memory stays bounded whatever the client sends: at most [`MAX_IN_FLIGHT`] requests and
//! [`MAX_IN_FLIGHT_BYTES`] of payload are in flight, a payload above the maximum is skipped
//! (compact headers) or refused by hanging up (extended headers, as the spec recommends),
//! and a client that vanishes mid-payload ends only its own connection.

pub mod block_status;
pub mod commands;
pub mod reply_writer;
pub mod validate;

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::ops::ControlFlow;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{watch, Mutex, Notify, OwnedSemaphorePermit, Semaphore};

use nbd_proto::errno::Errno;
use nbd_proto::wire::request::{Command, RequestHeader, COMPACT_REQUEST_LEN, EXTENDED_REQUEST_LEN};
use nbd_proto::wire::WireError;

use crate::control::Control;
use crate::export::Export;
use crate::negotiate::{drain, read_or_eof, Mode, Negotiated};
use commands::{execute, ExecContext};
use reply_writer::{Outcome, ReplyTo, Serialized};
use validate::{
    payload_of, status_filter, validate, validate_filtered, Limits, Payload, StatusFilter,
    MAX_STATUS_PAYLOAD,
};

/// Most requests of one connection being served at once; further requests wait unread.
pub const MAX_IN_FLIGHT: usize = 128;
pub use crate::control::MAX_IN_FLIGHT_BYTES;

pub use block_status::MAX_STATUS_EXTENTS;

/// What one BLOCK_STATUS request is charged against the connection's memory bound: the
/// export's extents, the descriptors of up to two contexts and their encoded reply.
pub const BLOCK_STATUS_CHARGE: usize = MAX_STATUS_EXTENTS * (32 + 2 * (16 + 8));

/// What one CACHE request is charged: the export reads the range through a buffer of at
/// most this size.
pub const CACHE_CHARGE: usize = 1 << 20;

/// How a transmission phase ended without a protocol error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransmissionEnd {
    /// The client sent `NBD_CMD_DISC`.
    Disconnect,
    /// The client closed the connection between requests.
    ClientClosed,
    /// The server is shutting down.
    Shutdown,
    /// The client sent no request for longer than the idle timeout.
    IdleTimeout,
    /// The server's shutdown grace period ran out: the connection was closed even though
    /// the client was in the middle of a request or not reading its replies.
    ForcedClose,
    /// A reply could not be written (the client went away).
    WriteFailed,
}

/// Why a transmission phase ended abruptly; the connection is closed, the server goes on.
#[derive(Debug, thiserror::Error)]
pub enum TransmissionError {
    /// Reading from the client failed, e.g. it disconnected mid-request.
    #[error("transmission I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The client sent a malformed request header; there is no way to resynchronise.
    #[error("transmission: {0}")]
    Wire(#[from] WireError),
    /// The client broke a rule the spec answers with a hard disconnect.
    #[error("transmission: {0}")]
    Protocol(String),
}

struct Conn<E: Export, W> {
    export: Rc<E>,
    writer: Mutex<W>,
    exec: ExecContext,
    write_failed: Cell<bool>,
    stop: Notify,
    /// Turns true when the server stops waiting for this client (see [`forced`]).
    force: watch::Receiver<bool>,
    /// Replies waiting for the writer task ([`write_replies`]), in completion order.
    replies: RefCell<Vec<Queued<E::Buf>>>,
    /// Wakes the writer task: a reply was queued, or `closing` turned true.
    replies_ready: Notify,
    /// No more replies will be queued: the writer task ends once the queue is empty.
    closing: Cell<bool>,
}

/// A request's slot and memory charge, held until its reply has been written.
type Held = (OwnedSemaphorePermit, OwnedSemaphorePermit);

/// A reply waiting to be written, with what its request holds.
struct Queued<B> {
    to: ReplyTo,
    outcome: Outcome<B>,
    _held: Option<Held>,
}

impl<E: Export, W: AsyncWrite + Unpin> Conn<E, W> {
    fn new(export: Rc<E>, writer: W, negotiated: &Negotiated, control: &Control) -> Self {
        Conn {
            export,
            writer: Mutex::new(writer),
            exec: ExecContext {
                mode: negotiated.mode,
                size: negotiated.size,
            },
            write_failed: Cell::new(false),
            stop: Notify::new(),
            force: control.force.clone(),
            replies: RefCell::new(Vec::new()),
            replies_ready: Notify::new(),
            closing: Cell::new(false),
        }
    }

    /// Queues a reply for the writer task; `held` is released once it has been written (or
    /// given up on).
    fn reply(&self, to: ReplyTo, outcome: Outcome<E::Buf>, held: Option<Held>) {
        self.replies.borrow_mut().push(Queued {
            to,
            outcome,
            _held: held,
        });
        self.replies_ready.notify_one();
    }

    /// Sends a batch of replies, unless the client stopped reading and the server gave up
    /// on it: replies stuck on a full socket must not keep their requests (and shutdown)
    /// waiting.
    async fn write_batch(&self, batch: &[Queued<E::Buf>]) {
        if self.write_failed.get() {
            return;
        }
        let mut bytes = Serialized::default();
        for q in batch {
            bytes.append(&q.to, &q.outcome);
        }
        // Biased, as for payloads: most batches fit the socket buffer at once.
        let written = tokio::select! {
            biased;
            written = async {
                let mut w = self.writer.lock().await;
                bytes.write_to(&mut *w).await
            } => written,
            () = forced(&self.force) => Err(std::io::ErrorKind::TimedOut.into()),
        };
        if let Err(e) = written {
            tracing::debug!(error = %e, "writing a reply failed; closing the connection");
            self.write_failed.set(true);
            self.stop.notify_one();
        }
    }
}

impl<E: Export, W> Conn<E, W> {
    /// Lets the writer task end once the replies queued so far are written.
    fn stop_writer(&self) {
        self.closing.set(true);
        self.replies_ready.notify_one();
    }
}

/// The writer task of a connection: writes every queued reply, a batch at a time, until the
/// connection closes. The request tasks that completed in one turn of the runtime have
/// queued their replies before this task runs again, so they share one `writev`.
async fn write_replies<E: Export, W: AsyncWrite + Unpin>(conn: Rc<Conn<E, W>>) {
    // Two queues swapped back and forth, so batches reuse their allocation.
    let mut batch = Vec::new();
    loop {
        std::mem::swap(&mut *conn.replies.borrow_mut(), &mut batch);
        if batch.is_empty() {
            if conn.closing.get() {
                return;
            }
            conn.replies_ready.notified().await;
            continue;
        }
        while !batch.is_empty() {
            let n = group_len(&batch);
            conn.write_batch(&batch[..n]).await;
            // Releases the requests' buffers, slots and memory charges as soon as their
            // replies are out, not when the whole batch is.
            batch.drain(..n);
        }
    }
}

/// Replies of at most this many payload bytes share one write (a larger one goes alone).
/// Small replies gain from sharing a `writev`; a large one takes several writes anyway, and
/// held back until the replies after it were written too, its buffer would stay allocated
/// while the client, having read it, already sends the next request: one more buffer per
/// connection than the queue depth.
const GROUP_BYTES: usize = 128 << 10;

/// How many replies from the front of `batch` to write together: at least one, and more
/// while their payloads fit in [`GROUP_BYTES`].
fn group_len<B: AsRef<[u8]>>(batch: &[Queued<B>]) -> usize {
    let mut bytes = 0usize;
    let mut n = 0;
    for q in batch {
        bytes = bytes.saturating_add(q.outcome.payload_len());
        if n > 0 && bytes > GROUP_BYTES {
            break;
        }
        n += 1;
    }
    n
}

/// Stops the writer task when the transmission phase ends, however it ends.
struct WriterGuard<'a, E: Export, W>(&'a Conn<E, W>);

impl<E: Export, W> Drop for WriterGuard<'_, E, W> {
    fn drop(&mut self) {
        self.0.stop_writer();
    }
}

/// Completes once `force` turns true: the server's grace period is over and every socket
/// operation of this connection is to be abandoned. Never completes if the sender is gone
/// without forcing. The receiver is cloned only once this is first polled, so a biased
/// select whose socket operation completes at once costs nothing here.
async fn forced(force: &watch::Receiver<bool>) {
    let mut force = force.clone();
    if force.wait_for(|f| *f).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How the request loop ends: the value `transmit` returns.
type End = Result<TransmissionEnd, TransmissionError>;

/// Serves requests until the client disconnects, the server shuts down, the client stays
/// idle past `control.idle_timeout`, or an error. In-flight requests always finish (and are
/// answered if possible) before this returns. Once `control.force` turns true, reading a
/// request's payload and writing replies are abandoned, so a client that stalls
/// mid-request or stops reading cannot hold the server up.
///
/// Must run inside a tokio `LocalSet`: each request is a `spawn_local` task.
pub async fn transmit<R, W, E>(
    mut reader: R,
    writer: W,
    export: Rc<E>,
    negotiated: &Negotiated,
    control: &Control,
) -> Result<TransmissionEnd, TransmissionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + 'static,
    E: Export + 'static,
{
    let limits = Limits::from(negotiated);
    let conn = Rc::new(Conn::new(export, writer, negotiated, control));
    let mut shutdown = control.shutdown.clone();
    let memory = control
        .memory
        .clamp(limits.max_payload as usize, u32::MAX as usize);
    let requests = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let bytes = Arc::new(Semaphore::new(memory));
    let writer = tokio::task::spawn_local(write_replies(Rc::clone(&conn)));
    let _stop_writer = WriterGuard(&conn);

    let result = loop {
        let next = next_header(&mut reader, &conn, control, &mut shutdown, &requests);
        let (slot, header) = match next.await {
            ControlFlow::Continue(got) => got,
            ControlFlow::Break(end) => break end,
        };
        tracing::trace!(?header, "request");

        let payload = payload_of(&header, limits.mode, limits.max_payload);
        let charge = memory_charge(&header, payload, limits.max_payload, memory);
        let Ok(budget) = bytes.clone().acquire_many_owned(charge).await else {
            break Ok(TransmissionEnd::Shutdown);
        };

        let read = read_payload(&mut reader, &conn, &header, &limits, payload);
        let (data, checked) = match unless_forced(read, &control.force).await {
            Ok(Body::Filter(filter)) => (None, validate_filtered(&header, &limits, filter)),
            Ok(Body::Data(data)) => (data, validate(&header, &limits, payload)),
            Err(Skip::Request) => continue,
            Err(Skip::Connection(end)) => break end,
        };

        let action = match checked {
            Ok(validate::Action::Disc) => break Ok(TransmissionEnd::Disconnect),
            Ok(action) => Ok(action),
            Err(refusal) => {
                tracing::debug!(?header, ?refusal, "request refused");
                Err(refusal)
            }
        };
        spawn_request(Rc::clone(&conn), header, action, data, (slot, budget));
    };

    close(&conn, &requests, writer).await;
    result
}

/// Waits for a free request slot and then the next request header, unless the loop is to
/// end first: the server shuts down, a reply could not be written, the client stays idle,
/// closes the connection or sends a malformed header.
async fn next_header<R, W, E>(
    reader: &mut R,
    conn: &Conn<E, W>,
    control: &Control,
    shutdown: &mut watch::Receiver<bool>,
    requests: &Arc<Semaphore>,
) -> ControlFlow<End, (OwnedSemaphorePermit, RequestHeader)>
where
    R: AsyncRead + Unpin,
    E: Export,
{
    let stop = async {
        tokio::select! {
            _ = shutdown.wait_for(|down| *down) => TransmissionEnd::Shutdown,
            () = conn.stop.notified() => TransmissionEnd::WriteFailed,
            end = idle_timeout(control.idle_timeout, requests) => end,
        }
    };
    let step = async {
        let slot = requests.clone().acquire_owned().await;
        let header = read_header(reader, conn.exec.mode).await;
        (slot, header)
    };
    let (slot, header) = tokio::select! {
        end = stop => return ControlFlow::Break(Ok(end)),
        got = step => got,
    };
    let Ok(slot) = slot else {
        return ControlFlow::Break(Ok(TransmissionEnd::Shutdown));
    };
    match header {
        Ok(Some(h)) => ControlFlow::Continue((slot, h)),
        Ok(None) => ControlFlow::Break(Ok(TransmissionEnd::ClientClosed)),
        Err(e) => ControlFlow::Break(Err(e)),
    }
}

/// Completes once the connection has been idle for `limit`, checked every `limit`: idle
/// means nothing in flight but the slot the pending header read holds. Never completes
/// without a limit.
async fn idle_timeout(limit: Option<Duration>, requests: &Semaphore) -> TransmissionEnd {
    let Some(limit) = limit else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(limit).await;
        if requests.available_permits() + 1 >= MAX_IN_FLIGHT {
            return TransmissionEnd::IdleTimeout;
        }
    }
}

/// What a request is charged against the connection's memory bound of `memory` bytes: its
/// payload, the reply data of a read, or a fixed charge for commands whose export call
/// allocates. Never more than the whole bound, so that every request can run eventually.
fn memory_charge(header: &RequestHeader, payload: Payload, max_payload: u32, memory: usize) -> u32 {
    let charge = match (payload, header.command) {
        (Payload::Read(n), _) => n,
        (_, Command::Read) => usize::try_from(header.length)
            .unwrap_or(usize::MAX)
            .min(max_payload as usize),
        (_, Command::BlockStatus) => BLOCK_STATUS_CHARGE,
        (_, Command::Cache) => CACHE_CHARGE,
        _ => 0,
    };
    u32::try_from(charge.min(memory)).unwrap_or(0)
}

/// Runs one request (or answers its refusal); `held` (its request slot and memory charge)
/// is released once the reply has been written.
///
/// The request is polled once right here, and only if it has to wait (disk I/O, a metadata
/// load, a lock) does it become a task of its own. On a fast image most requests finish in
/// that first poll, and a task for each cost more than the request itself: its creation,
/// scheduling and the moves of its future. The first poll uses a waker that does nothing;
/// the task's own first poll, which follows at once, registers the real one.
fn spawn_request<E, W>(
    conn: Rc<Conn<E, W>>,
    header: RequestHeader,
    action: Result<validate::Action, validate::Refusal>,
    data: Option<E::Buf>,
    held: Held,
) where
    E: Export + 'static,
    W: AsyncWrite + Unpin + 'static,
{
    let mut request = Box::pin(async move {
        let to = reply_to(&header, conn.exec.mode);
        let outcome = match action {
            Ok(action) => execute(&*conn.export, &conn.exec, action, data).await,
            Err(r) => Outcome::Error(r.errno, r.message),
        };
        conn.reply(to, outcome, Some(held));
    });
    let mut cx = Context::from_waker(Waker::noop());
    if request.as_mut().poll(&mut cx).is_pending() {
        tokio::task::spawn_local(request);
    }
}

/// Lets in-flight requests finish and answer; then closes our side.
async fn close<E: Export, W: AsyncWrite + Unpin>(
    conn: &Conn<E, W>,
    requests: &Semaphore,
    writer: tokio::task::JoinHandle<()>,
) {
    let all = u32::try_from(MAX_IN_FLIGHT).unwrap_or(u32::MAX);
    let _ = requests.acquire_many(all).await;
    conn.stop_writer();
    let _ = writer.await;
    let mut w = conn.writer.lock().await;
    let _ = w.shutdown().await;
}

/// Why a request's payload did not become a request to execute.
enum Skip {
    /// The request was answered already; go on with the next one.
    Request,
    /// The connection ends.
    Connection(End),
}

/// Runs `read` (a [`read_payload`]) unless the server's grace period runs out first.
async fn unless_forced<T>(
    read: impl Future<Output = Result<T, Skip>>,
    force: &watch::Receiver<bool>,
) -> Result<T, Skip> {
    // Biased: a payload already in the buffer completes on the first poll, and the
    // forced-close signal is only watched when the read has to wait.
    tokio::select! {
        biased;
        got = read => got,
        () = forced(force) => Err(Skip::Connection(Ok(TransmissionEnd::ForcedClose))),
    }
}

/// What followed a request header.
enum Body<B> {
    /// The write data to execute with, or nothing.
    Data(Option<B>),
    /// A block status payload, decoded (`None`: one to refuse).
    Filter(Option<StatusFilter>),
}

/// Reads (or drains) the payload that follows a request header.
async fn read_payload<R, W, E>(
    reader: &mut R,
    conn: &Conn<E, W>,
    header: &RequestHeader,
    limits: &Limits,
    payload: Payload,
) -> Result<Body<E::Buf>, Skip>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    E: Export,
{
    let io_end = |e: std::io::Error| Skip::Connection(Err(e.into()));
    match payload {
        Payload::None => Ok(Body::Data(None)),
        Payload::Filter(n) => {
            let mut bytes = [0u8; MAX_STATUS_PAYLOAD];
            let bytes = &mut bytes[..n.min(MAX_STATUS_PAYLOAD)];
            reader.read_exact(bytes).await.map_err(io_end)?;
            Ok(Body::Filter(status_filter(bytes, &limits.meta)))
        }
        Payload::Read(n) => {
            let mut buf = conn.export.alloc(n);
            if buf.as_ref().len() != n {
                tracing::error!(
                    n,
                    got = buf.as_ref().len(),
                    "export allocated a buffer of the wrong size"
                );
                drain(reader, n as u64).await.map_err(io_end)?;
                let to = reply_to(header, limits.mode);
                conn.reply(
                    to,
                    Outcome::Error(Errno::Io, "buffer allocation failed"),
                    None,
                );
                return Err(Skip::Request);
            }
            reader.read_exact(buf.as_mut()).await.map_err(io_end)?;
            Ok(Body::Data(Some(buf)))
        }
        Payload::Drain(n) => {
            drain(reader, n).await.map_err(io_end)?;
            Ok(Body::Data(None))
        }
        Payload::Disconnect => Err(Skip::Connection(Err(TransmissionError::Protocol(format!(
            "{} payload of {} bytes exceeds the maximum of {}",
            header.command.name(),
            header.length,
            limits.max_payload
        ))))),
    }
}

fn reply_to(h: &RequestHeader, mode: Mode) -> ReplyTo {
    ReplyTo {
        mode,
        cookie: h.cookie,
        offset: h.offset,
        is_read: h.command == Command::Read,
    }
}

async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    mode: Mode,
) -> Result<Option<RequestHeader>, TransmissionError> {
    let mut buf = [0u8; EXTENDED_REQUEST_LEN];
    let len = match mode {
        Mode::Extended => EXTENDED_REQUEST_LEN,
        _ => COMPACT_REQUEST_LEN,
    };
    let head = &mut buf[..len];
    if !read_or_eof(reader, head).await? {
        return Ok(None);
    }
    let header = match mode {
        Mode::Extended => RequestHeader::decode_extended(head)?,
        _ => RequestHeader::decode_compact(head)?,
    };
    Ok(Some(header))
}

#[cfg(test)]
mod tests;
