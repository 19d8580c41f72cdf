//! The set of named exports a server offers, and how a client's name selects one.
//!
//! The set can change while the server runs: [`Exports`] is a shared handle (cloned into
//! every connection and kept by whoever manages the exports), so an export added with
//! [`Exports::add`] is offered to the next option a client sends, and one closed with
//! [`Exports::close`] disappears from listings and can no longer be selected, while the
//! clients already attached to it keep it until they leave. Each export's [`ExportState`]
//! counts those clients; it is shared (`Arc`) with the worker threads' copies of the entry,
//! so the count covers every thread.
//!
//! With worker threads the set has two kinds of handle: the owner's (made by
//! [`Exports::new`]), which alone changes, and one copy per worker thread that follows it:
//! every change the owner makes is told to a publisher (`Publish`, in `mirror.rs`), whose
//! snapshots the worker copies read before they answer an option, so a client on any
//! thread sees the same set.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use nbd_proto::wire::MAX_STRING_LEN;

use crate::export::{BlockSizeError, Export};

/// One named export.
pub struct ExportEntry<E> {
    /// Name clients ask for (`""` is the conventional default, as in qemu-nbd).
    pub name: String,
    /// Description sent with `NBD_INFO_DESCRIPTION` and in `OPT_LIST` replies.
    pub description: String,
    /// The export itself, shared by every connection.
    pub export: Rc<E>,
    /// Its clients and whether it is being closed.
    state: Arc<ExportState>,
}

impl<E> ExportEntry<E> {
    /// An export named `name` without description.
    pub fn new(name: impl Into<String>, export: Rc<E>) -> Self {
        Self {
            name: name.into(),
            description: String::new(),
            export,
            state: Arc::new(ExportState::new()),
        }
    }

    /// Sets the description.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// Shares `state` with another entry of the same export (a worker thread's copy).
    pub fn sharing(mut self, state: Arc<ExportState>) -> Self {
        self.state = state;
        self
    }

    /// Its clients and whether it is being closed.
    pub fn state(&self) -> &Arc<ExportState> {
        &self.state
    }
}

impl<E> Clone for ExportEntry<E> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            description: self.description.clone(),
            export: Rc::clone(&self.export),
            state: Arc::clone(&self.state),
        }
    }
}

/// The clients of one export and how it is being closed. Thread-safe: connections on
/// worker threads attach to it too.
#[derive(Debug)]
pub struct ExportState {
    /// Connections attached now (from the `OPT_GO`/`OPT_EXPORT_NAME` that selected the
    /// export until the connection ends).
    attached: watch::Sender<usize>,
    /// Closed to new clients.
    closing: AtomicBool,
    /// Turns true to end the attached connections (a hard close).
    hard: watch::Sender<bool>,
}

impl Default for ExportState {
    fn default() -> Self {
        Self::new()
    }
}

impl ExportState {
    /// A state with no client, not closing.
    pub fn new() -> Self {
        Self {
            attached: watch::Sender::new(0),
            closing: AtomicBool::new(false),
            hard: watch::Sender::new(false),
        }
    }

    /// Connections attached now.
    pub fn attached(&self) -> usize {
        *self.attached.borrow()
    }

    /// True once the export was closed to new clients.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Completes once no connection is attached.
    pub async fn detached(&self) {
        let mut rx = self.attached.subscribe();
        // The sender lives in `self`, so the wait cannot fail.
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    /// Turns true when the attached connections are to be ended.
    pub(crate) fn hard_close(&self) -> watch::Receiver<bool> {
        self.hard.subscribe()
    }

    /// Counts one more connection, unless the export is closing. Counted first and checked
    /// after, so a close on another thread that saw no client attached cannot miss one
    /// attaching at the same moment: either the close saw the count, or this sees the close.
    fn attach(self: &Arc<Self>) -> Option<Attachment> {
        self.attached.send_modify(|n| *n += 1);
        let attachment = Attachment(Rc::new(Attached(Arc::clone(self))));
        (!self.is_closing()).then_some(attachment)
    }
}

/// A connection's hold on the export it selected: while any clone lives, the export counts
/// the connection as attached.
#[derive(Clone)]
pub struct Attachment(Rc<Attached>);

struct Attached(Arc<ExportState>);

impl Drop for Attached {
    fn drop(&mut self) {
        self.0.attached.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Attachment")
    }
}

impl PartialEq for Attachment {
    fn eq(&self, other: &Self) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Attachment {}

/// How [`Exports::close`] treats the clients attached to an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseMode {
    /// No new client may attach; those attached keep it until they leave.
    Safe,
    /// The attached connections are ended as on a forced server shutdown: they stop
    /// reading requests, those in flight finish, unsent replies are abandoned.
    Hard,
}

/// Why a list of exports cannot be served, or an export not added or closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportsError {
    /// No export at all.
    #[error("no export to serve")]
    Empty,
    /// Two exports share a name.
    #[error("export name {0:?} is used twice")]
    DuplicateName(String),
    /// A name or description exceeds the protocol's 4096-byte string limit.
    #[error("export {name:?}: {field} is {len} bytes, the NBD limit is 4096")]
    TooLong {
        /// Export concerned.
        name: String,
        /// `name` or `description`.
        field: &'static str,
        /// Its length.
        len: usize,
    },
    /// The export advertises block sizes the spec forbids.
    #[error("export {name:?}: {source}")]
    BlockSize {
        /// Export concerned.
        name: String,
        /// What is wrong.
        source: BlockSizeError,
    },
    /// No export has this name (or it is closing already).
    #[error("export {0:?} is not served")]
    NotFound(String),
}

/// A validated set of exports with unique names; clones share it.
pub struct Exports<E> {
    inner: Rc<RefCell<Registry<E>>>,
}

/// Exports by key: those offered, and those closed to new clients whose attached
/// connections still run (found by key only).
pub(crate) type Keyed<E> = Vec<(usize, ExportEntry<E>)>;

/// The exports, and who else must hear of changes or where they come from.
struct Registry<E> {
    live: Keyed<E>,
    closing: Keyed<E>,
    next_key: usize,
    /// The owner's: tells the worker threads of every change.
    publish: Option<Box<dyn Publish<E>>>,
    /// A worker thread's copy: where it takes the set from.
    follow: Option<Box<dyn Follow<E>>>,
}

/// Hears every change of the owner's set, to pass it on to other threads.
pub(crate) trait Publish<E> {
    /// Export `key` was added (and offered).
    fn added(&mut self, key: usize, entry: &ExportEntry<E>);
    /// Export `key` was closed to new clients.
    fn closed(&mut self, key: usize);
    /// Export `key` was dropped: what ends once no other thread uses it any more.
    fn forgot(&mut self, key: usize) -> Option<JoinHandle<()>>;
    /// Serving with other threads is over: what ends once they let go of every export.
    fn finish(self: Box<Self>) -> Vec<JoinHandle<()>>;
}

/// Where a worker thread's copy of the set takes it from.
pub(crate) trait Follow<E> {
    /// The offered and the closing exports, if they changed since the last call.
    fn changed(&mut self) -> Option<(Keyed<E>, Keyed<E>)>;
}

impl<E> Clone for Exports<E> {
    fn clone(&self) -> Self {
        Self {
            inner: Rc::clone(&self.inner),
        }
    }
}

impl<E: Export> Exports<E> {
    /// Validates names, descriptions and block sizes of a non-empty list; the keys
    /// ([`Exports::find`]) are the positions in it.
    pub fn new(entries: Vec<ExportEntry<E>>) -> Result<Self, ExportsError> {
        if entries.is_empty() {
            return Err(ExportsError::Empty);
        }
        let exports = Self {
            inner: Rc::new(RefCell::new(Registry::empty(Vec::with_capacity(
                entries.len(),
            )))),
        };
        for entry in entries {
            exports.add(entry)?;
        }
        Ok(exports)
    }

    /// Offers one more export (to clients' next options); its key. While worker threads
    /// serve the set, this must run on the owning thread inside its `LocalSet`: the calls
    /// of the workers' connections to the new export run there.
    pub fn add(&self, entry: ExportEntry<E>) -> Result<usize, ExportsError> {
        validate(&entry)?;
        let mut r = self.inner.borrow_mut();
        if r.live.iter().any(|(_, o)| o.name == entry.name) {
            return Err(ExportsError::DuplicateName(entry.name));
        }
        let key = r.next_key;
        r.next_key += 1;
        if let Some(p) = r.publish.as_mut() {
            p.added(key, &entry);
        }
        r.live.push((key, entry));
        Ok(key)
    }
}

impl<E> Registry<E> {
    fn empty(live: Keyed<E>) -> Self {
        Self {
            live,
            closing: Vec::new(),
            next_key: 0,
            publish: None,
            follow: None,
        }
    }
}

fn validate<E: Export>(e: &ExportEntry<E>) -> Result<(), ExportsError> {
    for (field, len) in [("name", e.name.len()), ("description", e.description.len())] {
        if len > MAX_STRING_LEN {
            return Err(ExportsError::TooLong {
                name: e.name.clone(),
                field,
                len,
            });
        }
    }
    e.export
        .features()
        .block_size
        .validate()
        .map_err(|source| ExportsError::BlockSize {
            name: e.name.clone(),
            source,
        })
}

impl<E> Exports<E> {
    /// A copy that follows `follow` (a worker thread's): it takes the set from there before
    /// every lookup, and on [`Exports::refresh`].
    pub(crate) fn following(follow: Box<dyn Follow<E>>) -> Self {
        let mut registry = Registry::empty(Vec::new());
        registry.follow = Some(follow);
        let exports = Self {
            inner: Rc::new(RefCell::new(registry)),
        };
        exports.refresh();
        exports
    }

    /// A follower takes the latest set, dropping the exports forgotten since (so its
    /// handles on them go); nothing for the owner.
    pub(crate) fn refresh(&self) {
        let mut guard = self.inner.borrow_mut();
        let r = &mut *guard;
        if let Some((live, closing)) = r.follow.as_mut().and_then(|f| f.changed()) {
            r.live = live;
            r.closing = closing;
        }
    }

    /// Tells `publish` of every export now and of every change from now on (the owner's,
    /// when worker threads start).
    pub(crate) fn publish_to(&self, mut publish: Box<dyn Publish<E>>) {
        let mut r = self.inner.borrow_mut();
        for (key, entry) in &r.live {
            publish.added(*key, entry);
        }
        for (key, entry) in &r.closing {
            publish.added(*key, entry);
            publish.closed(*key);
        }
        r.publish = Some(publish);
    }

    /// Stops telling the publisher of changes: what ends once the other threads let go of
    /// every export.
    pub(crate) fn unpublish(&self) -> Vec<JoinHandle<()>> {
        let publish = self.inner.borrow_mut().publish.take();
        publish.map(|p| p.finish()).unwrap_or_default()
    }

    /// The exports offered now, in the order they were added.
    pub fn entries(&self) -> Vec<ExportEntry<E>> {
        self.refresh();
        let r = self.inner.borrow();
        r.live.iter().map(|(_, e)| e.clone()).collect()
    }

    /// Calls `f` on each export offered now, in order, without copying them.
    pub fn for_each(&self, mut f: impl FnMut(&ExportEntry<E>)) {
        self.refresh();
        self.inner.borrow().live.iter().for_each(|(_, e)| f(e));
    }

    /// The key of the export a client's name selects: an exact, byte-for-byte match, as
    /// qemu-nbd matches names. The empty name is a name like any other: it reaches an
    /// export only if one is called "" (the default of `serve`), so a client that forgot
    /// the name of a named export is told so instead of silently getting some other disk.
    /// Exports being closed are not found.
    pub fn find(&self, name: &[u8]) -> Option<usize> {
        self.refresh();
        let r = self.inner.borrow();
        r.live
            .iter()
            .find(|(_, e)| e.name.as_bytes() == name)
            .map(|(k, _)| *k)
    }

    /// The export with `key` (as returned by [`Exports::find`]), offered or closing.
    pub fn get(&self, key: usize) -> Option<ExportEntry<E>> {
        self.refresh();
        let r = self.inner.borrow();
        r.live
            .iter()
            .chain(&r.closing)
            .find(|(k, _)| *k == key)
            .map(|(_, e)| e.clone())
    }

    /// Attaches a connection to the offered export with `key`; `None` if it is not offered.
    pub fn attach(&self, key: usize) -> Option<Attachment> {
        self.refresh();
        let r = self.inner.borrow();
        let (_, entry) = r.live.iter().find(|(k, _)| *k == key)?;
        entry.state.attach()
    }

    /// Closes the offered export `name` to new clients (and, in [`CloseMode::Hard`], ends
    /// its connections). Its key and state: once [`ExportState::detached`] completes,
    /// [`Exports::forget`] drops it.
    pub fn close(
        &self,
        name: &str,
        mode: CloseMode,
    ) -> Result<(usize, Arc<ExportState>), ExportsError> {
        let mut r = self.inner.borrow_mut();
        let at = r
            .live
            .iter()
            .position(|(_, e)| e.name == name)
            .ok_or_else(|| ExportsError::NotFound(name.to_owned()))?;
        let (key, entry) = r.live.remove(at);
        let state = Arc::clone(&entry.state);
        state.closing.store(true, Ordering::Release);
        if mode == CloseMode::Hard {
            state.hard.send_replace(true);
        }
        r.closing.push((key, entry));
        if let Some(p) = r.publish.as_mut() {
            p.closed(key);
        }
        Ok((key, state))
    }

    /// Ends the connections of the export `key`, closed earlier in [`CloseMode::Safe`] and
    /// still waiting for them (a client that never leaves must not keep it open for good):
    /// as a [`CloseMode::Hard`] close would have. False when `key` is not closing, or its
    /// connections are being ended already.
    pub fn end_connections(&self, key: usize) -> bool {
        let r = self.inner.borrow();
        let Some((_, entry)) = r.closing.iter().find(|(k, _)| *k == key) else {
            return false;
        };
        !entry.state.hard.send_replace(true)
    }

    /// Drops the closed export with `key`, so the last reference to it goes with its last
    /// connection; the entry, for the caller to close what it wraps. With worker threads,
    /// completes once they have let go of it too (every call they made has finished), so
    /// the entry is then the last reference besides the caller's own.
    pub async fn forget(&self, key: usize) -> Option<ExportEntry<E>> {
        let (entry, released) = {
            let mut r = self.inner.borrow_mut();
            let at = r.closing.iter().position(|(k, _)| *k == key)?;
            let entry = r.closing.remove(at).1;
            (entry, r.publish.as_mut().and_then(|p| p.forgot(key)))
        };
        if let Some(task) = released {
            // The task ends once every worker's handle is gone; a panic in it was logged.
            let _ = task.await;
        }
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemExport;

    fn two() -> Exports<MemExport> {
        Exports::new(vec![
            ExportEntry::new("a", Rc::new(MemExport::new(4096))),
            ExportEntry::new("b", Rc::new(MemExport::new(4096))),
        ])
        .unwrap()
    }

    #[test]
    fn added_exports_are_found_and_names_stay_unique() {
        let exports = two();
        let key = exports
            .add(ExportEntry::new("c", Rc::new(MemExport::new(4096))))
            .unwrap();
        assert_eq!(exports.find(b"c"), Some(key));
        assert_eq!(key, 2, "keys follow the order of addition");
        let dup = exports.add(ExportEntry::new("a", Rc::new(MemExport::new(4096))));
        assert_eq!(dup.unwrap_err(), ExportsError::DuplicateName("a".into()));
        let names: Vec<String> = exports.entries().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn a_closed_export_is_hidden_but_its_clients_keep_it() {
        let exports = two();
        let key = exports.find(b"a").unwrap();
        let attached = exports.attach(key).unwrap();
        let (closed, state) = exports.close("a", CloseMode::Safe).unwrap();
        assert_eq!(closed, key);
        assert!(state.is_closing());
        assert_eq!(exports.find(b"a"), None);
        assert!(exports.attach(key).is_none(), "no new client attaches");
        assert!(
            exports.get(key).is_some(),
            "the attached client still finds it"
        );
        assert_eq!(state.attached(), 1);
        assert_eq!(
            exports.close("a", CloseMode::Safe).unwrap_err(),
            ExportsError::NotFound("a".into())
        );
        drop(attached);
        assert_eq!(state.attached(), 0);
        assert!(exports.forget(key).await.is_some());
        assert!(exports.get(key).is_none());
        // The name is free again.
        exports
            .add(ExportEntry::new("a", Rc::new(MemExport::new(4096))))
            .unwrap();
    }

    #[tokio::test]
    async fn detached_waits_for_the_last_client_and_hard_close_is_signalled() {
        let exports = two();
        let key = exports.find(b"b").unwrap();
        let attached = exports.attach(key).unwrap();
        let (_, state) = exports.close("b", CloseMode::Hard).unwrap();
        assert!(*state.hard_close().borrow());
        let waiting = state.detached();
        tokio::pin!(waiting);
        assert!(futures_poll_once(waiting.as_mut()).await.is_none());
        drop(attached);
        waiting.await;
    }

    #[tokio::test]
    async fn a_safe_close_can_be_made_hard_once() {
        let exports = two();
        let key = exports.find(b"a").unwrap();
        let attached = exports.attach(key).unwrap();
        assert!(
            !exports.end_connections(key),
            "an offered export is not closing"
        );
        let (_, state) = exports.close("a", CloseMode::Safe).unwrap();
        let hard = state.hard_close();
        assert!(!*hard.borrow());
        assert!(exports.end_connections(key));
        assert!(*hard.borrow(), "the attached connections are told to end");
        assert!(!exports.end_connections(key), "only once");
        drop(attached);
        state.detached().await;
        assert!(exports.forget(key).await.is_some());
        assert!(
            !exports.end_connections(key),
            "a forgotten export is not closing"
        );
    }

    /// Polls a future once: its output if it was ready.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        let mut f = f;
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
