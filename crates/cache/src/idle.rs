//! Idle cleaning (`cache-clean-interval`): entries nobody used since the previous cleaning are
//! written back if dirty and dropped, and the memory of free slots goes back to the kernel.

use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::rc::Rc;
use std::time::Duration;

use crate::cache::{Backend, Cache};
use crate::error::CacheError;
use crate::state::{Phase, State};
use crate::write_back::keep_worst;

impl<K, B> Cache<K, B>
where
    K: Copy + Eq + Hash + Debug,
    B: Backend<K>,
{
    /// Write back (if dirty) and drop entries not used since the previous call; return
    /// the memory of every free slot to the OS. Entries used while the write-backs run are
    /// kept. An entry whose write-back fails stays, dirty, and the first error is returned.
    pub async fn clean_idle(&self) -> Result<(), CacheError> {
        let idle_dirty: Vec<(usize, u64)> = {
            let st = self.state.borrow();
            st.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.is_live() && !s.used && s.dirty && !s.writing)
                .map(|(idx, s)| (idx, s.residency))
                .collect()
        };
        let mut failure = None;
        for (idx, residency) in idle_dirty {
            if let Err(e) = self.write_back_slot(idx, residency).await {
                keep_worst(&mut failure, e);
            }
        }

        let mut st = self.state.borrow_mut();
        for idx in 0..st.slots.len() {
            let s = &st.slots[idx];
            if s.is_live() && !s.used && !s.dirty && !s.writing {
                st.drop_resident(idx, false);
                st.counters.idle_drops += 1;
            }
        }
        for slot in &mut st.slots {
            slot.used = false;
        }
        // Reuse low slots first, so the memory in use stays at the front of the arena.
        st.free.sort_unstable_by(|a, b| b.cmp(a));
        self.release_free_slots(&st);
        failure.map_or(Ok(()), Err)
    }

    /// `MADV_DONTNEED` every run of free slots (whole pages only).
    fn release_free_slots(&self, st: &State<K>) {
        let mut idx = 0;
        let n = st.slots.len();
        while idx < n {
            if st.slots[idx].phase != Phase::Free {
                idx += 1;
                continue;
            }
            let start = idx;
            while idx < n && st.slots[idx].phase == Phase::Free {
                idx += 1;
            }
            // SAFETY: free slots have no live references: slot bytes are only referenced
            // for Loading slots (by their loader) or while holding the `state` borrow, which
            // `st` shows we hold; and `release` only touches pages wholly inside the run.
            if let Err(e) = unsafe { self.arena.release(start, idx - start) } {
                tracing::warn!(cache = %self.name, error = %e, "madvise(MADV_DONTNEED) failed");
            }
        }
    }

    /// A task that calls [`clean_idle`](Self::clean_idle) every `interval` for as long as
    /// the cache lives; spawn it on the cache's `LocalSet` (it needs tokio's timer). An
    /// interval of zero (cleaning disabled) gives a task that ends at once. Errors are logged:
    /// the entries concerned stay dirty, so the next flush reports them.
    pub fn idle_cleaner(self: &Rc<Self>, interval: Duration) -> impl Future<Output = ()> + 'static
    where
        K: 'static,
        B: 'static,
    {
        let cache = Rc::downgrade(self);
        async move {
            if interval.is_zero() {
                return;
            }
            loop {
                tokio::time::sleep(interval).await;
                let Some(cache) = cache.upgrade() else {
                    return;
                };
                if let Err(e) = cache.clean_idle().await {
                    tracing::warn!(cache = %cache.name, error = %e, "idle cache cleaning failed");
                }
            }
        }
    }
}
