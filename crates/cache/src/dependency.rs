//! Ordering between caches, with QEMU's semantics (block/qcow2-cache.c):
//!
//! - `set_dependency(other)`: before the next write-back of any entry of this cache, `other`
//!   is flushed (its dirty entries written back, then its backend flushed). Used so that, for
//!   example, a new cluster's refcount is durable before the L2 entry pointing to it is
//!   written.
//! - `set_flush_before_writeback()`: before the next write-back of this cache, its backend
//!   is flushed (so data written by copy-on-write is durable before the L2 entry exposing it).
//!
//! A dependency is recorded when the engine modifies the dependent entry and cleared once
//! honoured. Honouring a cache dependency also satisfies the flush-before-write-back flag,
//! as in QEMU, because the other cache's flush flushes the file both caches live in: caches
//! linked by a dependency must have backends whose `flush` covers each other's writes (for
//! qcow2: the image file, and the data file if there is one).
//!
//! **Cycles.** A cycle (L2 waits for refcounts, refcounts wait for L2) cannot be honoured
//! lazily: both caches would hold changes that must reach the disk before the other's. As in
//! QEMU, `set_dependency` therefore keeps every chain one link long: if `other` itself waits
//! for a cache, that dependency is honoured (flushed) first, and if this cache waited for a
//! different cache, that one is honoured first. So when a new edge A -> B is added, B waits
//! for nobody, and no cycle can ever form; flushes recurse at most along acyclic chains and
//! cannot deadlock. This is why `set_dependency` is `async` (it may have to flush), and the
//! engine must call it *before* modifying the dependent entry, as QEMU does.

use std::fmt::Debug;
use std::hash::Hash;
use std::rc::Rc;

use crate::cache::{Backend, Cache};
use crate::error::CacheError;
use crate::flush::{Flush, FlushFuture};

/// The next obligation to honour, with the generations it was read at.
enum Obligation {
    Cache(Rc<dyn Flush>, u64, u64),
    Flush(u64),
}

impl<K, B> Cache<K, B>
where
    K: Copy + Eq + Hash + Debug,
    B: Backend<K>,
{
    /// Before the next write-back from this cache, flush `other` (write back + backend
    /// flush); cleared once honoured. Call it before modifying the entry that depends on
    /// `other`, as QEMU does.
    ///
    /// It may flush now, to keep every chain of dependencies one link long: if `other`
    /// itself waits for a cache, that one is flushed first; if this cache waited for a
    /// different cache, that one is flushed first. So `other` never waits for anybody when
    /// the link is made and no cycle (L2 -> refcounts -> L2) can form: a cycle could not be
    /// honoured later, since each cache would hold changes that must reach the disk before
    /// the other's. Honouring a dependency also satisfies
    /// [`set_flush_before_writeback`](Self::set_flush_before_writeback), because caches that
    /// depend on each other are expected to share the file(s) their backends flush.
    /// Depending on oneself is a no-op.
    pub async fn set_dependency(&self, other: Rc<dyn Flush>) -> Result<(), CacheError> {
        if std::ptr::addr_eq(Rc::as_ptr(&other), self as *const Self) {
            return Ok(());
        }
        loop {
            if other.has_dependency() {
                other.flush_dependency().await?;
                continue;
            }
            let current = self.deps.borrow().target.clone();
            if let Some(current) = current {
                if !Rc::ptr_eq(&current, &other) {
                    self.honour_cache_dependency().await?;
                    continue;
                }
            }
            // No await since the checks above: `other` waits for nobody right now.
            let mut deps = self.deps.borrow_mut();
            deps.target = Some(other);
            deps.target_generation += 1;
            return Ok(());
        }
    }

    /// Before the next write-back from this cache: `backend.flush()` (so that data written
    /// by copy-on-write is durable before the metadata that exposes it).
    pub fn set_flush_before_writeback(&self) {
        let mut deps = self.deps.borrow_mut();
        deps.flush_first = true;
        deps.flush_generation += 1;
    }

    /// Whether a write-back from this cache would first have to flush something.
    pub fn has_pending_dependency(&self) -> bool {
        self.deps.borrow().pending()
    }

    fn next_obligation(&self, cache_only: bool) -> Option<Obligation> {
        let deps = self.deps.borrow();
        if let Some(target) = &deps.target {
            Some(Obligation::Cache(
                Rc::clone(target),
                deps.target_generation,
                deps.flush_generation,
            ))
        } else if deps.flush_first && !cache_only {
            Some(Obligation::Flush(deps.flush_generation))
        } else {
            None
        }
    }

    async fn honour(&self, obligation: Obligation) -> Result<(), CacheError> {
        match obligation {
            Obligation::Cache(target, generation, flush_generation) => {
                target
                    .flush()
                    .await
                    .map_err(|source| CacheError::Dependency {
                        cache: self.name.clone(),
                        dependency: target.name().to_owned(),
                        source: Box::new(source),
                    })?;
                let mut deps = self.deps.borrow_mut();
                if deps.target_generation == generation {
                    deps.target = None;
                }
                if deps.flush_generation == flush_generation {
                    deps.flush_first = false;
                }
            }
            Obligation::Flush(flush_generation) => {
                self.backend
                    .flush()
                    .await
                    .map_err(|source| CacheError::Flush {
                        cache: self.name.clone(),
                        source,
                    })?;
                let mut deps = self.deps.borrow_mut();
                if deps.flush_generation == flush_generation {
                    deps.flush_first = false;
                }
            }
        }
        Ok(())
    }

    /// Honour every pending obligation; returns once none is left.
    pub(crate) async fn honour_dependencies(&self) -> Result<(), CacheError> {
        while let Some(obligation) = self.next_obligation(false) {
            self.honour(obligation).await?;
        }
        Ok(())
    }

    /// Honour the dependency on another cache, if any.
    pub(crate) async fn honour_cache_dependency(&self) -> Result<(), CacheError> {
        while let Some(obligation) = self.next_obligation(true) {
            self.honour(obligation).await?;
        }
        Ok(())
    }
}

impl<K, B> Flush for Cache<K, B>
where
    K: Copy + Eq + Hash + Debug,
    B: Backend<K>,
{
    fn flush(&self) -> FlushFuture<'_> {
        Box::pin(Cache::flush(self))
    }

    fn has_dependency(&self) -> bool {
        self.deps.borrow().target.is_some()
    }

    fn flush_dependency(&self) -> FlushFuture<'_> {
        Box::pin(self.honour_cache_dependency())
    }

    fn name(&self) -> &str {
        &self.name
    }
}
