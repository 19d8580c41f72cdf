//! The export set as the worker threads see it. The owning thread publishes every change
//! of its [`Exports`](crate::Exports) as a new snapshot (the exports offered and closing,
//! each with the [`RemoteHandle`] its calls go through), and starts the dispatcher of an
//! export on the owning thread when it is added. Each worker's copy of the set reads the
//! latest snapshot before it answers an option (an atomic version check when nothing
//! changed), and again whenever one is published, so it lets go of a forgotten export at
//! once. Requests never look here: a connection keeps the [`Remote`] it selected.

use std::rc::Rc;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::export::Export;
use crate::exports::{ExportEntry, ExportState, Follow, Keyed, Publish};
use crate::remote::{dispatch, Remote, RemoteHandle, SendBuf};

/// One export as the workers see it.
struct Shared<B> {
    key: usize,
    name: String,
    description: String,
    handle: RemoteHandle<B>,
    state: Arc<ExportState>,
    /// Offered to new clients (otherwise closing: found by key only).
    offered: bool,
}

impl<B> Clone for Shared<B> {
    fn clone(&self) -> Self {
        Self {
            key: self.key,
            name: self.name.clone(),
            description: self.description.clone(),
            handle: self.handle.clone(),
            state: Arc::clone(&self.state),
            offered: self.offered,
        }
    }
}

type Snapshot<B> = Arc<Vec<Shared<B>>>;

/// The owner's side: publishes the set and keeps each export's dispatcher.
pub(crate) struct Publisher<B> {
    list: watch::Sender<Snapshot<B>>,
    dispatchers: Vec<(usize, JoinHandle<()>)>,
}

/// A worker's side: where its copy of the set comes from.
pub(crate) struct Follower<B> {
    list: watch::Receiver<Snapshot<B>>,
}

/// Wakes a worker when the set changed, so its copy drops what was forgotten.
pub(crate) struct Changes<B> {
    list: watch::Receiver<Snapshot<B>>,
}

/// An empty set to publish to, and the side to follow it with (clone it per worker).
pub(crate) fn channel<B>() -> (Publisher<B>, Follower<B>) {
    let (tx, rx) = watch::channel(Arc::new(Vec::new()));
    let publisher = Publisher {
        list: tx,
        dispatchers: Vec::new(),
    };
    (publisher, Follower { list: rx })
}

impl<B> Publisher<B> {
    /// Publishes the set `change` makes of the current one. The previous snapshot goes
    /// here, and with it the handles only it held.
    fn change(&self, change: impl FnOnce(&mut Vec<Shared<B>>)) {
        let mut next = Vec::clone(&self.list.borrow());
        change(&mut next);
        drop(self.list.send_replace(Arc::new(next)));
    }
}

impl<E> Publish<E> for Publisher<E::Buf>
where
    E: Export + 'static,
    E::Buf: SendBuf,
{
    fn added(&mut self, key: usize, entry: &ExportEntry<E>) {
        let (handle, task) = dispatch(Rc::clone(&entry.export));
        self.dispatchers.push((key, task));
        let shared = Shared {
            key,
            name: entry.name.clone(),
            description: entry.description.clone(),
            handle,
            state: Arc::clone(entry.state()),
            offered: true,
        };
        self.change(|list| list.push(shared));
    }

    fn closed(&mut self, key: usize) {
        self.change(|list| {
            list.iter_mut()
                .filter(|s| s.key == key)
                .for_each(|s| s.offered = false)
        });
    }

    fn forgot(&mut self, key: usize) -> Option<JoinHandle<()>> {
        self.change(|list| list.retain(|s| s.key != key));
        let at = self.dispatchers.iter().position(|(k, _)| *k == key)?;
        Some(self.dispatchers.remove(at).1)
    }

    fn finish(self: Box<Self>) -> Vec<JoinHandle<()>> {
        self.dispatchers.into_iter().map(|(_, task)| task).collect()
    }
}

impl<B> Clone for Follower<B> {
    fn clone(&self) -> Self {
        Self {
            list: self.list.clone(),
        }
    }
}

impl<B> Follower<B> {
    /// What wakes the worker when the set changes.
    pub fn changes(&self) -> Changes<B> {
        Changes {
            list: self.list.clone(),
        }
    }
}

impl<B: SendBuf> Follow<Remote<B>> for Follower<B> {
    fn changed(&mut self) -> Option<(Keyed<Remote<B>>, Keyed<Remote<B>>)> {
        // Once the owner stops publishing (the server is ending) the copy stays as it is.
        if !self.list.has_changed().unwrap_or(false) {
            return None;
        }
        let snapshot = Arc::clone(&self.list.borrow_and_update());
        let (mut live, mut closing) = (Vec::new(), Vec::new());
        for s in snapshot.iter() {
            let entry = ExportEntry::new(s.name.clone(), Rc::new(Remote::from(s.handle.clone())))
                .with_description(s.description.clone())
                .sharing(Arc::clone(&s.state));
            match s.offered {
                true => live.push((s.key, entry)),
                false => closing.push((s.key, entry)),
            }
        }
        Some((live, closing))
    }
}

impl<B> Changes<B> {
    /// Completes when the set changed; `false` once the owner stopped publishing.
    pub async fn next(&mut self) -> bool {
        self.list.changed().await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exports::{CloseMode, Exports};
    use crate::MemExport;

    /// A follower sees additions and closes at its next lookup, keeps the owner's keys and
    /// shares the attached counts; once it let go of a forgotten export, `forget` returns.
    #[tokio::test]
    async fn a_follower_sees_every_change_and_forget_waits_for_it() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let owner =
                    Exports::new(vec![ExportEntry::new("a", Rc::new(MemExport::new(4096)))])
                        .unwrap();
                let (publisher, follower) = channel::<Vec<u8>>();
                owner.publish_to(Box::new(publisher));
                let mut changes = follower.changes();
                let copy = Exports::following(Box::new(follower));
                assert_eq!(copy.find(b"a"), Some(0));

                let key = owner
                    .add(ExportEntry::new("b", Rc::new(MemExport::new(8192))).with_description("B"))
                    .unwrap();
                assert_eq!(copy.find(b"b"), Some(key), "seen at the next lookup");
                let entry = copy.get(key).unwrap();
                assert_eq!(
                    (entry.description.as_str(), entry.export.size()),
                    ("B", 8192)
                );
                drop(entry);
                let attached = copy.attach(key).unwrap();

                let (_, state) = owner.close("b", CloseMode::Safe).unwrap();
                assert_eq!(state.attached(), 1, "the worker's client counts");
                assert_eq!(copy.find(b"b"), None);
                assert!(copy.attach(key).is_none());
                assert!(copy.get(key).is_some(), "its client still finds it");
                drop(attached);
                state.detached().await;

                let forgetting = owner.forget(key);
                tokio::pin!(forgetting);
                assert!(!ready(forgetting.as_mut()).await);
                // Let the dispatcher run: the copy still holds a handle until it refreshes.
                for _ in 0..8 {
                    tokio::task::yield_now().await;
                }
                assert!(
                    !ready(forgetting.as_mut()).await,
                    "forget waits for the worker"
                );
                assert!(changes.next().await);
                copy.refresh();
                assert!(forgetting.await.is_some());
                assert!(copy.get(key).is_none());

                // The last copies of the set go with the worker's receivers.
                drop((copy, changes));
                for task in owner.unpublish() {
                    task.await.unwrap();
                }
            })
            .await;
    }

    /// Polls `f` once: whether it completed.
    async fn ready<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) -> bool {
        std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx).is_ready())).await
    }
}
