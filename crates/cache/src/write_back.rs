//! Writing dirty entries back. A write-back works on a copy of the entry's dirty pages (see
//! `pages`): it clears the dirty flag when it starts, so an entry modified while its copy is
//! being written stays dirty, and a failed (or abandoned) write-back marks its pages dirty
//! again. At most one write-back per entry is in flight, so writes to one place never
//! overtake each other.

use std::cell::RefCell;
use std::fmt::Debug;
use std::hash::Hash;

use crate::cache::{Backend, Cache};
use crate::error::CacheError;
use crate::pages::DirtyPages;
use crate::state::{Phase, State};

/// What to do next for one entry.
enum Next {
    Done,
    Wait(std::rc::Rc<crate::event::Event>),
    Write,
}

impl<K, B> Cache<K, B>
where
    K: Copy + Eq + Hash + Debug,
    B: Backend<K>,
{
    /// Write back every dirty entry (dependencies first), then make it durable with
    /// `backend.flush()`. Every modification made before the call is durable when it returns
    /// `Ok`. On failure the entries that could not be written stay dirty; "no space" is
    /// reported in preference to other errors.
    pub async fn flush(&self) -> Result<(), CacheError> {
        self.write_back_all().await?;
        self.backend
            .flush()
            .await
            .map_err(|source| CacheError::Flush {
                cache: self.name.clone(),
                source,
            })
    }

    /// Write back every entry dirty at the time of the call (and wait for write-backs already
    /// in flight), honouring dependencies, without flushing the backend.
    pub async fn write_back_all(&self) -> Result<(), CacheError> {
        let targets: Vec<(usize, u64, u64)> = {
            let st = self.state.borrow();
            st.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.is_live() && (s.dirty || s.writing))
                .map(|(idx, s)| (idx, s.residency, s.version))
                .collect()
        };
        let mut failure: Option<CacheError> = None;
        for (idx, residency, version) in targets {
            if let Err(e) = self.write_back_version(idx, residency, version).await {
                keep_worst(&mut failure, e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Make sure `version` of slot `idx` (still of `residency`) has reached the backend.
    async fn write_back_version(
        &self,
        idx: usize,
        residency: u64,
        version: u64,
    ) -> Result<(), CacheError> {
        loop {
            let next = {
                let mut st = self.state.borrow_mut();
                let slot = &mut st.slots[idx];
                if slot.residency != residency || !slot.is_live() || slot.written >= version {
                    // Gone (evicted after a write-back, or forgotten) or written: done.
                    Next::Done
                } else if slot.writing {
                    Next::Wait(slot.changed.listen())
                } else if slot.dirty {
                    Next::Write
                } else {
                    Next::Done
                }
            };
            match next {
                Next::Done => return Ok(()),
                Next::Wait(event) => event.wait().await,
                Next::Write => self.write_back_slot(idx, residency).await?,
            }
        }
    }

    /// Write back slot `idx` if it still holds the entry of `residency` and is dirty,
    /// honouring this cache's dependencies first.
    pub(crate) async fn write_back_slot(
        &self,
        idx: usize,
        residency: u64,
    ) -> Result<(), CacheError> {
        loop {
            self.honour_dependencies().await?;
            let started = {
                let mut st = self.state.borrow_mut();
                let slot = &mut st.slots[idx];
                if slot.residency != residency || slot.phase != Phase::Ready || slot.forgotten {
                    return Ok(());
                }
                if slot.writing {
                    Err(slot.changed.listen())
                } else if !slot.dirty {
                    return Ok(());
                } else if self.deps.borrow().pending() {
                    // A dependency set while we waited must be honoured before this write.
                    continue;
                } else {
                    let Some(key) = slot.key else {
                        return Ok(());
                    };
                    slot.dirty = false;
                    slot.writing = true;
                    let version = slot.version;
                    let pages = slot.pages.take();
                    // SAFETY: the slot is Ready and we hold the `state` borrow: see `apply`.
                    let bytes = unsafe { self.arena.slot_mut(idx) };
                    let copies: Vec<(usize, B::Snapshot)> = pages
                        .runs(self.entry_size)
                        .into_iter()
                        .map(|run| (run.start, self.backend.snapshot(&bytes[run])))
                        .collect();
                    Ok((key, copies, version, pages))
                }
            };
            let (key, copies, version, pages) = match started {
                Ok(started) => started,
                Err(event) => {
                    // Another write-back of this entry is in flight: let it finish first.
                    event.wait().await;
                    continue;
                }
            };
            let mut guard = WriteGuard {
                state: &self.state,
                idx,
                residency,
                version,
                pages,
                armed: true,
            };
            let mut result = Ok(());
            for (at, copy) in copies {
                result = self.backend.write_back(key, at, copy).await;
                if result.is_err() {
                    break;
                }
            }
            guard.armed = false;
            let unwritten = result.is_err().then_some(&guard.pages);
            self.state
                .borrow_mut()
                .finish_write(idx, residency, version, unwritten);
            return result.map_err(|source| CacheError::WriteBack {
                cache: self.name.clone(),
                key: format!("{key:?}"),
                source,
            });
        }
    }
}

/// Keep the error to report: the first one, unless a later one says "no space" (which the
/// client must see rather than a generic I/O error).
pub(crate) fn keep_worst(kept: &mut Option<CacheError>, new: CacheError) {
    match kept {
        Some(old) if old.is_no_space() || !new.is_no_space() => {}
        _ => *kept = Some(new),
    }
}

/// Marks the entry's pages dirty again if a write-back is abandoned (its future dropped)
/// halfway: nobody knows whether the bytes arrived.
struct WriteGuard<'a, K: Copy + Eq + Hash> {
    state: &'a RefCell<State<K>>,
    idx: usize,
    residency: u64,
    version: u64,
    /// The pages this write-back writes.
    pages: DirtyPages,
    armed: bool,
}

impl<K: Copy + Eq + Hash> Drop for WriteGuard<'_, K> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(mut st) = self.state.try_borrow_mut() {
            st.finish_write(self.idx, self.residency, self.version, Some(&self.pages));
        }
    }
}
